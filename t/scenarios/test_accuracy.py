"""Floods stay near L when replies are late: every node floods one fresh
key while Redis itself stalls (CLIENT PAUSE for 40 ms, from just before
the first request and every 300 ms after), or while the nodes' Redis
threads get the CPU only part of the time (a busy loop at real-time
priority takes their CPU for 20 ms of every 50, the workers squeezed onto
the other CPU). Both read 1.00 to 1.05 × L on this 2-core machine, the
worst seen 1.05 in both. The bounds asserted, 1.08 and 1.10, leave room
for that tail: they stand against the blow-up, not the tail. A node that
hears nothing from Redis for a while must not go on spending the headroom
it last saw: without that, two and four nodes pass 2 and 4 × L in the
stall. Near the limit a node spends half its learnt share of the headroom
a round trip: shares learnt from replies that land in different orders
add up to more than 1, and the starved floods read up to 1.13 × L when
each node spends all of its share. Redis holds what was allowed."""

import os
import re
import subprocess
import threading
import time

import starve
from harness import ROOT, wait_for

STATS = os.path.join(ROOT, "bench", "stats.lua")
BENCH_RE = re.compile(r"^BENCH (.*)$", re.M)
LIMIT = 1000

HTTP = "    redis_ratelimit_zone $arg_k zone=f:4m redis=%s;\n"
SERVER = "        location = /a { redis_ratelimit f %dr/m; }\n" % LIMIT


def flood(ports, key, conns, seconds):
    """wrk on every port at once; the requests each allowed (2xx)."""
    procs = []
    try:
        for p in ports:
            cmd = ["wrk", "-t1", "-c%d" % conns, "-d%ds" % seconds, "--timeout", "10s", "-s", STATS,
                   "http://127.0.0.1:%d/a?k=%s" % (p, key)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        allowed, total = [], 0
        for pr in procs:
            out, err = pr.communicate(timeout=seconds + 30)
            m = BENCH_RE.search(out)
            if pr.returncode != 0 or not m:
                raise RuntimeError("wrk failed (%s): %s%s" % (pr.returncode, out, err))
            kv = dict(x.split("=") for x in m.group(1).split())
            allowed.append(int(kv["requests"]) - int(kv["non2xx"]))
            total += int(kv["requests"])
        return allowed, total
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait(5)


def redis_count(r, key):
    return sum(int(r.cmd("GET", k) or 0) for k in r.keys("rl:{f:%s}:60:*" % key))


class Pauser:
    """CLIENT PAUSE <ms> ALL on Redis now and every `every_ms` after, until
    stopped (a pause runs out by itself: nothing to undo)."""

    def __init__(self, r, pause_ms=40, every_ms=300):
        self.r, self.pause_ms, self.every = r, pause_ms, every_ms / 1000
        self.done = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.done.is_set():
            self.r.cmd("CLIENT", "PAUSE", str(self.pause_ms), "ALL")
            self.done.wait(self.every)

    def __enter__(self):
        self.r.cmd("CLIENT", "PAUSE", str(self.pause_ms), "ALL")
        time.sleep(0.002)
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.t.join(5)
        time.sleep(self.pause_ms / 1000 + 0.05)
        return False


def floods(h, how, bound):
    """Two and four nodes, 16 connections each, flood one fresh key of
    1000r/m for 3 s under `how(r, pids)` (a context manager): allowed ≤
    `bound` × L, and Redis holds exactly what was allowed. Three rounds
    each."""
    r = h.redis()
    nodes = [h.nginx(HTTP % r.url, SERVER, files={"a": "ok\n"}) for _ in range(4)]
    rows, worst = [], 0.0
    held_ok = True
    for n in (2, 4, 2, 4, 2, 4):
        group = nodes[:n]
        h.wait_minute_room(6)
        key = h.key("flood%d-%d" % (n, len(rows)))
        pids = [p for g in group for p in g.worker_pids()]
        with how(r, pids):
            allowed, total = flood([g.port for g in group], key, 16, 3)
        tot = sum(allowed)
        errors = [l[l.find("redis_ratelimit:"):][:160] for g in group for l in g.error_log_text().splitlines()
                  if "[error]" in l and "redis_ratelimit:" in l]
        for e in errors[:3]:
            h.note("error line: %s" % e)
        settled = wait_for(lambda: redis_count(r, key) == tot, 6.0)
        held = redis_count(r, key)
        held_ok = held_ok and settled
        worst = max(worst, tot / LIMIT)
        rows.append("%d nodes: %s = %d of %d requests (%.3f L), Redis %d"
                    % (n, " + ".join(map(str, allowed)), tot, total, tot / LIMIT, held))
    for row in rows:
        h.note(row)
    h.check(worst <= bound, "allowed ≤ %.2f L in every flood: worst %.3f" % (bound, worst))
    h.check(held_ok, "Redis holds what was allowed")


def test_floods_with_the_redis_threads_starved(h):
    floods(h, lambda r, pids: starve.Starver(pids, cpu=1, on_ms=20, off_ms=30), 1.10)


def test_floods_while_redis_stalls(h):
    floods(h, lambda r, pids: Pauser(r, pause_ms=40, every_ms=300), 1.08)
