#!/usr/bin/env python3
"""Redis cost against worker_processes (part of `make bench`).

One nginx, one Redis zone (16m, 6000r/m on X-Key) and 10 000 keys each far
below their limit (wrk with bench/keys.lua for 8 s, then the holds: 6 s),
with 1, 2, 4 and 8 workers in turn; each row says what the zone cost Redis:

  * commands per request allowed (INFO commandstats, calls and rejected
    calls of every command but INFO and the bench's own reads);
  * connections the module holds to Redis (CLIENT LIST, names
    ngx_redis_ratelimit and ngx_redis_ratelimit_strict);
  * the workers' resident memory together (VmRSS, at the end).

Targets (issue: one sender per node): 8 workers cost at most 1.1 times
the commands per request of 1 worker, and one connection serves the zone
(no strict limits here). The machine has 2 cores: the point is the Redis
side, not the throughput. Prints a table, then one line per target with
a check mark; exits 1 when a target is missed.

    python3 bench/workers.py [--seconds 8] [--workers 1,2,4,8]
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "t", "lib"))

import servers  # noqa: E402

NGINX = os.path.join(ROOT, "build", "sbin", "nginx")
MODULE = os.path.join(ROOT, "build", "modules", "ngx_http_redis_ratelimit_module.so")
KEYS = os.path.join(HERE, "keys.lua")
REG = servers.Registry()

CONF = """load_module {module};
worker_processes {workers};
error_log logs/error.log notice;
pid logs/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    redis_ratelimit_zone $http_x_key zone=many:16m redis=redis://127.0.0.1:{redis};
    server {{
        listen 127.0.0.1:{port};
        location = /k {{ redis_ratelimit many 6000r/m; return 200 "ok\\n"; }}
        location = /t {{ redis_ratelimit many 6000r/m; root html; try_files /index.html =404; }}
        location = /metrics {{ redis_ratelimit_metrics; }}
    }}
}}
"""


def module_connections(redis):
    n = 0
    for line in redis.cmd("CLIENT", "LIST").splitlines():
        name = dict(kv.split("=", 1) for kv in line.split() if "=" in kv).get("name", "")
        n += name.startswith("ngx_redis_ratelimit")
    return n


def rss_mib(ng):
    total = 0
    for pid in ng.worker_pids():
        try:
            with open("/proc/%d/status" % pid) as f:
                total += next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024.0


def passed(port):
    st, _, body, _ = servers.http_get(port, "/metrics?format=json", timeout=5)
    return json.loads(body)["zones"]["many"]["requests"]["passed"]


def one(work, workers, seconds):
    redis = servers.RedisServer(os.path.join(work, "redis-%d" % workers), registry=REG).start(timeout=10)
    port = servers.free_port()
    prefix = os.path.join(work, "nginx-%d" % workers)
    ng = servers.NginxServer(NGINX, prefix, port, workers, "nginx-%d" % workers, registry=REG)
    os.makedirs(os.path.join(prefix, "html"), exist_ok=True)
    with open(os.path.join(prefix, "html", "index.html"), "w") as f:
        f.write("ok\n")
    os.chmod(prefix, 0o755)
    with open(ng.conf_path, "w") as f:
        f.write(CONF.format(module=MODULE, workers=workers, redis=redis.port, port=port))
    ng.start()
    try:
        time.sleep(1.0)
        before = redis.commands(own=("info", "client|list", "config|get"))
        out = subprocess.run(["wrk", "-t2", "-c32", "-d%ds" % seconds, "-s", KEYS,
                              "http://127.0.0.1:%d/t" % port],
                             capture_output=True, text=True, timeout=seconds + 60).stdout
        m = re.search(r"Requests/sec:\s+([\d.]+)", out)
        # the holds (hold=5s by default) and the flushes after them
        time.sleep(6.5)
        allowed = passed(port)
        cost = (redis.commands(own=("info", "client|list", "config|get")) - before) / max(1, allowed)
        return {"workers": workers, "rps": float(m.group(1)) if m else 0.0, "allowed": allowed,
                "cmds": cost, "conns": module_connections(redis), "rss": rss_mib(ng)}
    finally:
        ng.stop()
        redis.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--workers", default="1,2,4,8")
    a = ap.parse_args()
    for p in (NGINX, MODULE):
        if not os.path.exists(p):
            sys.exit("%s is missing: run make build" % p)
    if not shutil.which("wrk"):
        sys.exit("wrk is missing (make test installs it)")
    work = tempfile.mkdtemp(prefix="nginx-rl-workers-")
    os.chmod(work, 0o755)
    rows = []
    try:
        for w in [int(x) for x in a.workers.split(",")]:
            rows.append(one(work, w, a.seconds))
            r = rows[-1]
            print("%d worker(s): %.0f req/s, %d allowed, %.4f Redis commands a request, "
                  "%d connection(s), workers' RSS %.1f MiB" % (r["workers"], r["rps"], r["allowed"],
                                                                r["cmds"], r["conns"], r["rss"]),
                  flush=True)
    finally:
        REG.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    print()
    print("| workers | Redis commands per request | ratio to 1 worker | Redis connections | workers' RSS |")
    print("|---:|---:|---:|---:|---:|")
    base = rows[0]["cmds"] or 1e-9
    for r in rows:
        print("| %d | %.4f | %.2f | %d | %.0f MiB |" % (r["workers"], r["cmds"], r["cmds"] / base,
                                                      r["conns"], r["rss"]))
    print()
    last = rows[-1]
    ok_cost = last["cmds"] <= 1.1 * base
    ok_conns = all(r["conns"] <= 1 for r in rows)
    print("%s %d workers: %.2f x the commands per request of 1 worker (target <= 1.1)"
          % ("✓" if ok_cost else "✗", last["workers"], last["cmds"] / base))
    print("%s connections for the zone: %s (target <= 1: no strict limits)"
          % ("✓" if ok_conns else "✗", [r["conns"] for r in rows]))
    return 0 if ok_cost and ok_conns else 1


if __name__ == "__main__":
    sys.exit(main())
