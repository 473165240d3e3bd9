#!/usr/bin/env python3
"""The fleet's bucket, measured (part of `make bench`).

nginx nodes (1 worker each) on one Redis zone, one fresh key per row,
`redis_ratelimit z 10r/s burst=20 ...`; what the fleet admits against what
one limit_req would (the burst, the request that fills it, and the rate
over the time measured):

  * flood: 2 and then 4 nodes flooded together for 5 s (wrk, 16
    connections a node), `nodelay`: admitted <= 1.05 x (21 + 10 x T);
  * paced: 1.5 x the rate (15 r/s) spread over 4 nodes for 20 s,
    `nodelay`: admitted <= 1.05 x (21 + 10 x T);
  * delay: 4 nodes flooded for 5 s by 8 clients each, `delay=5`: the
    responses served within T <= 1.05 x ((5 + 1) + 10 x T), and every
    request answered (200 or 429, none lost);
  * strict: the flood row with `strict`: exact;
  * far: one node floods a key far below `1000000r/s burst=10000
    nodelay`: it decides on its own and sends its debt in batches, at
    most 0.05 script calls a request.

Besides each row, its Redis script calls per request. Prints a table and
one line per target with a check mark; exits 1 when a target is missed.

    python3 bench/bucket.py [--seconds 5] [--paced-seconds 20]
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "t", "lib"))

import servers  # noqa: E402

NGINX = os.path.join(ROOT, "build", "sbin", "nginx")
MODULE = os.path.join(ROOT, "build", "modules", "ngx_http_redis_ratelimit_module.so")
REG = servers.Registry()

CONF = """load_module {module};
worker_processes 1;
error_log logs/error.log crit;
pid logs/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    redis_ratelimit_zone $arg_k zone=z:4m redis=redis://127.0.0.1:{redis};
    server {{
        listen 127.0.0.1:{port};
        root html;
        location = /nodelay {{ redis_ratelimit z 10r/s burst=20 nodelay; try_files /t =404; }}
        location = /strict  {{ redis_ratelimit z 10r/s burst=20 nodelay strict; try_files /t =404; }}
        location = /delay   {{ redis_ratelimit z 10r/s burst=20 delay=5; try_files /t =404; }}
        location = /far     {{ redis_ratelimit z 1000000r/s burst=10000 nodelay; try_files /t =404; }}
    }}
}}
"""


def script_calls(redis):
    return int(redis.commandstats().get("evalsha", {}).get("calls", 0))


def wrk_flood(ports, path, seconds):
    """wrk on every node at once; (requests, admitted, seconds)."""
    procs = [subprocess.Popen(["wrk", "-t1", "-c16", "-d%ds" % seconds,
                               "http://127.0.0.1:%d%s" % (p, path)],
                              stdout=subprocess.PIPE, text=True) for p in ports]
    t0 = time.monotonic()
    total = admitted = 0
    for p in procs:
        out = p.communicate(timeout=seconds + 60)[0]
        n = int(re.search(r"(\d+) requests in", out).group(1))
        bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        total += n
        admitted += n - (int(bad.group(1)) if bad else 0)
    return total, admitted, time.monotonic() - t0


def paced(ports, path, rate, seconds):
    """`rate` requests a second in all, spread over the nodes in turn;
    (requests, admitted, seconds)."""
    got, lock = [], threading.Lock()
    t0 = time.monotonic()
    n = int(rate * seconds)

    def one(i):
        st = servers.http_get(ports[i % len(ports)], path, timeout=5)[0]
        with lock:
            got.append(st)

    ts = []
    for i in range(n):
        time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        t = threading.Thread(target=one, args=(i,))
        t.start()
        ts.append(t)
    for t in ts:
        t.join(30)
    return len(got), got.count(200), time.monotonic() - t0


def delayed_flood(ports, path, seconds, clients=8):
    """Clients on every node, back to back for `seconds`; returns
    (requests, served within the time, answered 200 or 429, seconds)."""
    out, lock = [], threading.Lock()
    t0 = time.monotonic()
    end = t0 + seconds

    def run(port):
        mine = []
        while time.monotonic() < end:
            try:
                st = servers.http_get(port, path, timeout=30)[0]
            except OSError:
                st = None
            mine.append((st, time.monotonic()))
        with lock:
            out.extend(mine)

    ts = [threading.Thread(target=run, args=(p,)) for p in ports for _ in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + 60)
    served = sum(1 for st, at in out if st == 200 and at <= end)
    answered = sum(1 for st, _ in out if st in (200, 429))
    return len(out), served, answered, seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--paced-seconds", type=int, default=20)
    a = ap.parse_args()
    for p in (NGINX, MODULE):
        if not os.path.exists(p):
            sys.exit("%s is missing: run make build" % p)
    if not shutil.which("wrk"):
        sys.exit("wrk is missing (make test installs it)")
    work = tempfile.mkdtemp(prefix="nginx-rl-bucket-")
    os.chmod(work, 0o755)
    rows, checks = [], []
    try:
        redis = servers.RedisServer(os.path.join(work, "redis"), registry=REG).start(timeout=10)
        ports = []
        for i in range(4):
            port = servers.free_port()
            ng = servers.NginxServer(NGINX, os.path.join(work, "nginx-%d" % i), port, 1,
                                     "nginx-%d" % i, registry=REG)
            with open(os.path.join(ng.prefix, "html", "t"), "w") as f:
                f.write("ok\n")
            with open(ng.conf_path, "w") as f:
                f.write(CONF.format(module=MODULE, redis=redis.port, port=port))
            ng.start()
            ports.append(port)
        # the nodes learn of each other (`nodes` counting through Redis)
        time.sleep(2.5)
        for name, nodes, path, how in (("flood", 2, "/nodelay", "wrk"), ("flood", 4, "/nodelay", "wrk"),
                                       ("paced 1.5x", 4, "/nodelay", "paced"),
                                       ("delay=5", 4, "/delay", "delayed"),
                                       ("strict flood", 4, "/strict", "wrk"),
                                       ("far", 1, "/far", "wrk")):
            key = "%s-%d-%d" % (name.split()[0], nodes, len(rows))
            p = "%s?k=%s" % (path, key)
            before = script_calls(redis)
            if name == "far":
                total, ok, took = wrk_flood(ports[:nodes], p, a.seconds)
                bound = float(total)
            elif how == "wrk":
                total, ok, took = wrk_flood(ports[:nodes], p, a.seconds)
                bound = 21 + 10 * took
            elif how == "paced":
                total, ok, took = paced(ports[:nodes], p, 15, a.paced_seconds)
                bound = 21 + 10 * took
            else:
                total, ok, answered, took = delayed_flood(ports[:nodes], p, a.seconds)
                bound = 6 + 10 * took
                checks.append(("%s: every request answered 200 or 429" % name,
                               answered == total, "%d of %d" % (answered, total)))
            calls = script_calls(redis) - before
            rows.append((name, nodes, took, total, ok, bound, calls))
            if name == "far":
                checks.append(("far: at most 0.05 script calls a request", calls <= 0.05 * total,
                               "%.4f" % (calls / max(1, total))))
                print("far, 1 node, %.1f s: %d requests, %d admitted, %d script calls"
                      % (took, total, ok, calls), flush=True)
                continue
            target = bound if name.startswith("strict") else 1.05 * bound
            checks.append(("%s, %d nodes: admitted <= %s x one limit_req's"
                           % (name, nodes, "1.00" if name.startswith("strict") else "1.05"),
                           ok <= target + (1 if name.startswith("strict") else 0),
                           "%d, one limit_req %.1f" % (ok, bound)))
            print("%s, %d nodes, %.1f s: %d requests, %d admitted (one limit_req: %.1f), "
                  "%d script calls" % rows[-1], flush=True)
    finally:
        REG.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    print()
    print("| traffic | nodes | seconds | requests | admitted | one limit_req | ratio | script calls per request |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, nodes, took, total, ok, bound, calls in rows:
        print("| %s | %d | %.1f | %d | %d | %.1f | %.3f | %.4f |"
              % (name, nodes, took, total, ok, bound, ok / bound, calls / max(1, total)))
    print()
    good = True
    for what, ok, detail in checks:
        print("%s %s (%s)" % ("✓" if ok else "✗", what, detail))
        good = good and ok
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
