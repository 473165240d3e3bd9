#!/usr/bin/env python3
"""The concurrency limit's cost, measured (part of `make bench`).

One nginx (2 workers) and one Redis; a small static file served by
locations that differ only in their limit, each driven by wrk (one
thread, 32 connections, keep-alive) for a few seconds, in turns, twice
(the better of the two runs counts):

  * /base: no limit;
  * /limit_conn: nginx's `limit_conn` (one key: the client address, 1000);
  * /conn: `redis_ratelimit_conn` on a zone without Redis (one key, 1000);
  * /conn-redis: on a zone with Redis, one key far from its 1000: each
    worker takes slots of its lease without a round trip;
  * /conn-redis-keys: the same over 10 000 keys (wrk picks one a request).

Prints req/s and the ratio to /base, and for the Redis rows the Redis
commands per request (calls of the script: asks and renewals). Target:
the Redis rows at 0.1 commands a request or less (keys far from their
limit: far below one; a key held costs a renewal every third of lease=
per worker, whatever its traffic); exits 1 when missed.

    python3 bench/conn.py [--seconds 5]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "t", "lib"))

import servers  # noqa: E402

NGINX = os.path.join(ROOT, "build", "sbin", "nginx")
MODULE = os.path.join(ROOT, "build", "modules", "ngx_http_redis_ratelimit_module.so")
REG = servers.Registry()

CONF = """load_module {module};
worker_processes 2;
error_log logs/error.log crit;
pid logs/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    limit_conn_zone $binary_remote_addr zone=lc:10m;
    redis_ratelimit_zone $binary_remote_addr zone=local:10m;
    redis_ratelimit_zone $binary_remote_addr zone=fleet:10m redis=redis://127.0.0.1:{redis};
    redis_ratelimit_zone $arg_k zone=keys:10m redis=redis://127.0.0.1:{redis};
    server {{
        listen 127.0.0.1:{port};
        root html;
        location = /base            {{ try_files /t =404; }}
        location = /limit_conn      {{ limit_conn lc 1000; try_files /t =404; }}
        location = /conn            {{ redis_ratelimit_conn local 1000; try_files /t =404; }}
        location = /conn-redis      {{ redis_ratelimit_conn fleet 1000; try_files /t =404; }}
        location = /conn-redis-keys {{ redis_ratelimit_conn keys 1000; try_files /t =404; }}
    }}
}}
"""

KEYS_LUA = """
math.randomseed(7)
request = function()
  return wrk.format("GET", "/conn-redis-keys?k=k" .. math.random(1, 10000))
end
"""


def script_calls(redis):
    return int(redis.commandstats().get("evalsha", {}).get("calls", 0))


def wrk(port, path, seconds, script=None):
    cmd = ["wrk", "-t1", "-c32", "-d%ds" % seconds]
    if script:
        cmd += ["-s", script]
    cmd.append("http://127.0.0.1:%d%s" % (port, path))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    n = int(re.search(r"(\d+) requests in", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    return n, int(bad.group(1)) if bad else 0, rps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=5)
    a = ap.parse_args()
    for p in (NGINX, MODULE):
        if not os.path.exists(p):
            sys.exit("%s is missing: run make build" % p)
    if not shutil.which("wrk"):
        sys.exit("wrk is missing (make test installs it)")
    work = tempfile.mkdtemp(prefix="nginx-rl-conn-")
    os.chmod(work, 0o755)
    best, calls, checks = {}, {}, []
    paths = ["/base", "/limit_conn", "/conn", "/conn-redis", "/conn-redis-keys"]
    try:
        redis = servers.RedisServer(os.path.join(work, "redis"), registry=REG).start(timeout=10)
        port = servers.free_port()
        ng = servers.NginxServer(NGINX, os.path.join(work, "nginx"), port, 2, "nginx", registry=REG)
        with open(os.path.join(ng.prefix, "html", "t"), "w") as f:
            f.write("ok\n")
        with open(ng.conf_path, "w") as f:
            f.write(CONF.format(module=MODULE, redis=redis.port, port=port))
        ng.start()
        script = os.path.join(work, "keys.lua")
        with open(script, "w") as f:
            f.write(KEYS_LUA)
        for _ in range(2):
            for path in paths:
                before = script_calls(redis)
                n, bad, rps = wrk(port, path, a.seconds, script if path.endswith("keys") else None)
                c = script_calls(redis) - before
                print("%s: %d requests (%d not 2xx), %.0f req/s, %d script calls"
                      % (path, n, bad, rps, c), flush=True)
                checks.append(("%s: every request served" % path, bad == 0, "%d not 2xx" % bad))
                if rps > best.get(path, (0,))[0]:
                    best[path] = (rps, n, c)
    finally:
        REG.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    base = best["/base"][0]
    print()
    print("| location | req/s | ratio to /base | Redis calls per request |")
    print("|---|---:|---:|---:|")
    for path in paths:
        rps, n, c = best[path]
        redis_row = path.startswith("/conn-redis")
        print("| %s | %.0f | %.3f | %s |" % (path, rps, rps / base,
                                             "%.5f" % (c / max(1, n)) if redis_row else "—"))
        if redis_row:
            calls[path] = c / max(1, n)
            checks.append(("%s: at most 0.1 Redis calls a request" % path,
                           calls[path] <= 0.1, "%.5f" % calls[path]))
    print()
    good = True
    for what, ok, detail in checks:
        if not ok or "Redis calls" in what:
            print("%s %s (%s)" % ("✓" if ok else "✗", what, detail))
        good = good and ok
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
