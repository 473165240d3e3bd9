#!/usr/bin/env python3
"""Soak test for ngx_http_redis_ratelimit_module: traffic + chaos for minutes.

    python3 bench/soak.py [--duration SECONDS] [--seed N] [--procs N] [--threads N] [--keep]

One redis-server and two nginx instances (2 workers each, master on, the
same configuration) on free 127.0.0.1 ports, started through
t/scenarios/harness.py (every process stopped by its PID: at the end, on
failure, on Ctrl-C).  The binaries are snapshotted first, so a rebuild of
build/ during the run (or nginx's re-dlopen on reload) never mixes builds.

Traffic (client processes, keep-alive connections to both nodes), key in
the X-Key header:
  * /m  `redis_ratelimit soak 100r/s`: a pool of distinct keys (default
    60 000) walked in order, so every key is sent before any repeats; 70 %
    ASCII, 15 % binary-ish bytes legal in a header value (obs-text, inner
    SP/HTAB), 10 % with `{` `}` braces, 5 % 4 KB long.  Every key stays far
    below its limit, so any 429 here is a false rejection.
  * /h  `redis_ratelimit soak 50r/s`: 3 hot keys hammered from both nodes
    (one thread per client process, alternating nodes).  The response's
    `X-T: $msec` (nginx's cached time, the clock the module decides with)
    puts each answer in its 1 s window.
  * /s  `redis_ratelimit soakstrict 20r/s strict` (timeout=200ms): 2 keys,
    one request at a time per client process, alternating nodes: outside
    outages a 1 s window holds at most L (Redis decides); during them
    on_error=local does.

Chaos (one action at a time, a few seconds apart, shuffled so every kind
runs early): Redis stop + start (counters lost), CLIENT PAUSE 1500 ALL,
`SET <counter of this window> notanumber` and MULTI/DEL/LPUSH (WRONGTYPE) on
a hot key's and a random key's counter, OOM (noeviction + maxmemory 1, then
maxmemory 0), reload (HUP) of one nginx, and Redis killed (SIGKILL) while
one nginx reloads and a worker of the other is killed (SIGKILL), then
started again.  Outages (Redis stopped, paused,
OOM) plus a margin are excluded from the accuracy figures; windows of a hot
key whose counter was planted are reported apart.

Sampled every 0.5 s: VmRSS/RssAnon of every worker (PIDs re-read), worker
PID churn not explained by our reloads, Redis commands/s (INFO commandstats
calls + rejected_calls over one persistent connection, minus the commands
this script sent itself; INFO excluded) and the Redis counters of the hot
keys (cross-check of what the clients saw allowed).

A request in flight for >= --stall s (0.5) is a stall: the first three are
captured (thread states, kernel stacks, CPU per thread over 0.3 s, a gdb
backtrace of every worker thread) into stall-N-nginxM.txt; the gdb time is
an outage.  CPU used by processes that are not the soak's (a build running
beside it) is reported, and so is, per hot window, the longest gap between
two answers of a node: accuracy excursions usually sit on such gaps.

Exit status: 0 when every check holds; 1 when a check fails (5xx, crashes,
a hot-key or strict window outside outages above 1.05 x L (a strict
window tallied over it passes when Redis's own counter of that window,
read after it ended, holds at most L: its answers came after the window
ended; a strict key judged in no window with demand above L fails too, and
so does a Redis count above L in any judged window; for the strict keys
a stall a node saw, a strict link without an answer within timeout=, is
an outage too, since on_error decides then), requests that got no
status, 429s on keys far below their limit, stalls, counter keys without a
TTL); 2 when the harness failed.  Logs and soak-data.json (every figure's
raw data) are kept in the temp dir on failure or with --keep.
Python 3 stdlib only.
"""

import argparse
import array
import bisect
import collections
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "t", "scenarios"))

import harness  # noqa: E402
import cluster  # noqa: E402
from harness import RedisError  # noqa: E402
from servers import HttpClosed, HttpConn, RedisConn, commands_in, commandstats_of  # noqa: E402

ZONE = "soak"
MANY_RATE, HOT_RATE = 100, 50          # r/s of /m and /h
HOT_KEYS = [b"hot-plain", b"{hot}-brace", b"hot-\xe9\xff \x80bin"]
# /s: a strict limit (each request waits for Redis's decision) on two keys
STRICT_RATE = 20
STRICT_ZONE = "soakstrict"
STRICT_KEYS = [b"strict-plain", b"strict-{b}"]
LEGAL = bytes(range(0x21, 0x7F)) + bytes(range(0x80, 0x100))  # field-vchar
CLASSES = ("ascii", "binary", "braces", "4k")
REQ_TIMEOUT = 5.0
SLOW = 0.1                             # requests slower than this are kept


def log(t0, msg):
    print("[%6.1fs] %s" % (time.time() - t0, msg), flush=True)


def kname(k):
    return k.decode("latin-1").encode("unicode_escape").decode()


# --------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------

def many_key(i, tag):
    """(class, bytes) of the i-th key of the pool."""
    c = i % 20
    if c < 14:
        return "ascii", b"k%d-%s" % (i, tag)
    if c < 17:
        r = random.Random(i * 7919 + 17)
        body = bytes(r.choice(LEGAL) for _ in range(r.randint(6, 30)))
        return "binary", b"\xff%d%s \t%s" % (i, body[:3], body[3:])
    if c < 19:
        form = (b"{%d}", b"}{%d{", b"{{%d}}x", b"{}%d", b"a{b}%d}c{")[(i // 20) % 5]
        return "braces", (form % i) + b"-" + tag
    head = b"L%d-%s-" % (i, tag)
    return "4k", head + (b"0123456789abcdef" * 256)[:4096 - len(head)]


def counter_name(key, w, period=1, zone=ZONE):
    """The key's Redis counter (docs/reference.md: `%` and `}` escaped;
    the pool's keys are shorter than the digest's bound or 4k long)."""
    part = key.replace(b"%", b"%25").replace(b"}", b"%7D")
    if part.startswith(b"sha256:"):
        part = b"sha256%3A" + part[7:]
    return b"rl:{%s:%s}:%d:%d" % (zone.encode(), part, period, w)


# --------------------------------------------------------------------------
# client processes
# --------------------------------------------------------------------------

class Conn:
    """One keep-alive connection; a request that fails on a REUSED
    connection before any answer (nginx closed it: reload, keepalive end) is
    retried once on a fresh one, as HTTP clients do for a GET."""

    def __init__(self, port, stats):
        self.c = HttpConn(port, timeout=REQ_TIMEOUT)
        self.stats = stats

    def get(self, path, key):
        for attempt in (0, 1):
            fresh = not self.c.connected
            try:
                r = self.c.get(path, {"X-Key": key})
                return r.status, r.header("X-T")
            except (HttpClosed, ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
                if fresh or attempt:
                    raise
                self.stats["retried"] += 1

    def close(self):
        self.c.close()


def client_main(idx, cfg, ports, t_start, t_end, progress, inflight, out_q):
    """One client process: cfg['threads'] threads on /m + 1 hot thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the parent handles Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with harness._REG_LOCK:                          # never stop the parent's processes
        del harness._REGISTRY[:]
    parent = os.getppid()
    nthreads = cfg["threads"]
    streams = cfg["procs"] * nthreads
    tag = cfg["tag"]
    pool = cfg["keys"]
    results = []
    lock = threading.Lock()

    def new_acc():
        return {"counts": collections.Counter(), "errors": collections.Counter(),
                "err_samples": [], "lat": array.array("f"), "slow": [],
                "hot": collections.defaultdict(lambda: [0, 0, 0, 0]), "retried": 0,
                "sent": 0, "n": 0, "lat_t": array.array("d"),
                "strict": collections.defaultdict(lambda: [0, 0]),
                "hx_t": array.array("d"), "hx_m": array.array("b")}

    def one(acc, conn, node, cls, path, key, slot):
        t = time.time()
        inflight[2 * slot + 1] = node
        inflight[2 * slot] = t          # the parent's stall watcher reads these
        p0 = time.perf_counter()
        try:
            st, xt = conn.get(path, key)
        except Exception as e:      # noqa: BLE001 - counted and reported
            inflight[2 * slot] = 0.0
            el = time.perf_counter() - p0
            what = "%s: %s" % (type(e).__name__, str(e)[:80])
            acc["errors"][(node, cls, type(e).__name__)] += 1
            if len(acc["err_samples"]) < 10:
                acc["err_samples"].append((t, node, cls, el, what))
            acc["lat"].append(el)
            acc["lat_t"].append(t)
            return None, None
        el = time.perf_counter() - p0
        inflight[2 * slot] = 0.0
        acc["counts"][(node, cls, st)] += 1
        acc["lat"].append(el)
        acc["lat_t"].append(t)
        if el >= SLOW and len(acc["slow"]) < 500:
            acc["slow"].append((el, t, node, cls, st))
        return st, xt

    def many_thread(tid):
        acc = new_acc()
        s = idx * nthreads + tid                     # stream number
        conns = [Conn(p, acc) for p in ports]
        mine = len(range(s, pool, streams))
        n = 0
        try:
            while time.time() < t_end:
                i = s + (n % mine) * streams
                cls, key = many_key(i, tag)
                node = (n + n // mine) % 2            # each pass swaps nodes
                one(acc, conns[node], node, cls, "/m", key, idx * (nthreads + 2) + tid)
                n += 1
                if n % 256 == 0:
                    progress[idx] += 256
                    if os.getppid() != parent:
                        break
        finally:
            for c in conns:
                c.close()
        acc["sent"] = min(n, mine)
        acc["n"] = n
        with lock:
            results.append(acc)

    def keyed_thread(cls, path, keys, slot, tally):
        """Requests on `keys` one after another, alternating keys and
        nodes; each answer's 1 s window (X-T) goes to `tally`."""
        acc = new_acc()
        conns = [Conn(p, acc) for p in ports]
        n = idx                                      # procs start on different keys
        try:
            while time.time() < t_end:
                k = n % len(keys)
                node = (n // len(keys)) % 2
                st, xt = one(acc, conns[node], node, cls, path, keys[k], slot)
                if st is not None:
                    try:
                        tally(acc, k, int(float(xt)), node, st, float(xt))
                    except (TypeError, ValueError):
                        acc["errors"][(node, cls, "no X-T header")] += 1
                n += 1
                if n % 256 == 0:
                    progress[idx] += 256
                    if os.getppid() != parent:
                        break
        finally:
            for c in conns:
                c.close()
        acc["n"] = n - idx
        with lock:
            results.append(acc)

    def hot_tally(acc, k, w, node, st, t):
        h = acc["hot"][(k, w)]
        h[1] += 1
        if st == 200:
            h[0] += 1
            h[2 + node] += 1
        # every hot answer: server time, key, node, allowed
        acc["hx_t"].append(t)
        acc["hx_m"].append(k * 4 + node * 2 + (st == 200))

    def strict_tally(acc, k, w, node, st, t):
        h = acc["strict"][(k, w)]
        h[1] += 1
        h[0] += st == 200

    def hot_thread():
        keyed_thread("hot", "/h", HOT_KEYS, idx * (nthreads + 2) + nthreads, hot_tally)

    def strict_thread():
        # strict requests wait for Redis: one at a time is this thread's
        # pace, as the hot thread's
        keyed_thread("strict", "/s", STRICT_KEYS, idx * (nthreads + 2) + nthreads + 1, strict_tally)

    try:
        delay = t_start - time.time()
        if delay > 0:
            time.sleep(delay)
        ts = [threading.Thread(target=many_thread, args=(i,), daemon=True) for i in range(nthreads)]
        ts.append(threading.Thread(target=hot_thread, daemon=True))
        ts.append(threading.Thread(target=strict_thread, daemon=True))
        for t in ts:
            t.start()
        for t in ts:
            t.join(t_end - time.time() + 3 * REQ_TIMEOUT + 10)
        merged = new_acc()
        merged["hot"] = {}
        merged["strict"] = {}
        for a in results:
            merged["counts"].update(a["counts"])
            merged["errors"].update(a["errors"])
            merged["err_samples"] += a["err_samples"]
            merged["lat"].extend(a["lat"])
            merged["lat_t"].extend(a["lat_t"])
            merged["slow"] += a["slow"]
            merged["retried"] += a["retried"]
            merged["sent"] += a["sent"]
            merged["hx_t"].extend(a["hx_t"])
            merged["hx_m"].extend(a["hx_m"])
            for k, v in a["hot"].items():
                merged["hot"][k] = v
            for k, v in a["strict"].items():
                merged["strict"][k] = v
        merged["threads_done"] = len(results)
        merged["threads"] = len(ts)
        out_q.put(("ok", idx, merged))
    except BaseException:           # noqa: BLE001
        out_q.put(("error", idx, traceback.format_exc()))


# --------------------------------------------------------------------------
# Redis side
# --------------------------------------------------------------------------

OWN = [0]                  # commands this script sent to Redis (INFO excluded)
OWN_LOCK = threading.Lock()


def own(n):
    with OWN_LOCK:
        OWN[0] += n


class RConn(RedisConn):
    """A persistent Redis connection with pipelining, counting what it sends."""

    def __init__(self, port, timeout=3.0):
        super().__init__(port, timeout=timeout)

    def pipeline(self, cmds):
        own(sum(1 for c in cmds if str(c[0]).upper() != "INFO"))
        return super().pipeline(cmds)

    def cmd(self, *args):
        return super().cmd(*args, raise_errors=False)


def rcmd(redis, *args):
    own(1)
    return redis.cmd(*args, timeout=5.0, raise_errors=False)


# --------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------

class Run:
    def __init__(self, args, ctx):
        self.a = args
        self.ctx = ctx
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.events = []          # (t0, t1, kind, detail)
        self.outages = []         # (t0, t1, kind)
        self.plants = []          # (t, hot key index or None, redis key name, kind)
        self.planted_names = set()
        self.reloads = []         # (node, t0, t1)
        self.expected_exit = set()  # worker pids we made exit (reloads)
        self.rss = []             # (t, node, pid, vmrss kB, rssanon kB)
        self.churn = []           # (t, node, what, pid)
        self.killed = set()       # worker pids the chaos SIGKILLed
        self.redis_rate = []      # (t, commands/s)
        self.redis_err = []
        self.hot_redis = {}       # (k, w) -> value read from Redis (int or str)
        self.strict_redis = {}    # the same for the strict keys
        self.thread_errors = []
        self.dead_masters = set()
        self.stalls = []          # (t, node) of requests in flight >= --stall s
        self.foreign = collections.Counter()   # comm -> CPU ticks of other processes
        self.foreign_prev = {}
        self.captures = []
        self.quit_times = []

    # -- helpers ---------------------------------------------------------
    def event(self, t0, t1, kind, detail, outage=False):
        with self.lock:
            self.events.append((t0, t1, kind, detail))
            if outage:
                self.outages.append((t0, t1, kind))
        log(self.t0, "chaos %-14s %s (%.1fs)" % (kind, detail, t1 - t0))

    def guarded(self, fn, name):
        def run():
            try:
                fn()
            except Exception:       # noqa: BLE001
                self.thread_errors.append("%s: %s" % (name, traceback.format_exc()))
        return threading.Thread(target=run, name=name, daemon=True)

    # -- samplers ----------------------------------------------------------
    def foreign_scan(self):
        """CPU ticks used since the last scan by processes that are not this
        soak's (not us, our children, nginx workers): other load on the box."""
        procs = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % d) as f:
                    data = f.read()
            except OSError:
                continue
            comm = data[data.find("(") + 1:data.rfind(")")]
            rest = data[data.rfind(")") + 2:].split()
            try:
                procs[int(d)] = (int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[19]), comm)
            except (IndexError, ValueError):
                continue
        ours = {os.getpid()} | {ng.pid for ng in self.ngs if ng.pid}
        ours |= {p for p, v in procs.items() if v[0] in ours}          # clients, redis, gdb, workers
        for p, (ppid, ticks, start, comm) in procs.items():
            if p in ours:
                continue
            key = (p, start)
            if key in self.foreign_prev:
                d = ticks - self.foreign_prev[key]
            elif start >= self.boot_ticks0:
                d = ticks                                               # started during the run
            else:
                d = 0                                                   # first sight: baseline
            self.foreign_prev[key] = ticks
            if d > 0:
                self.foreign[comm] += d

    def foreign_top(self, n):
        hz = float(os.sysconf("SC_CLK_TCK"))
        dur = max(1.0, time.time() - self.t_start) if hasattr(self, "t_start") else 1.0
        return [(c, round(100.0 * v / hz / dur / os.cpu_count(), 1)) for c, v in self.foreign.most_common(n)]

    def proc_sampler(self):
        prev = {i: set(ng.worker_pids()) for i, ng in enumerate(self.ngs)}
        with open("/proc/uptime") as f:
            self.boot_ticks0 = int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))
        self.foreign_scan()
        nscan = 0
        while not self.stop.is_set():
            t = time.time()
            nscan += 1
            if nscan % 4 == 0:
                self.foreign_scan()
            for i, ng in enumerate(self.ngs):
                if not ng.running:
                    if ng.pid not in self.dead_masters:
                        self.dead_masters.add(ng.pid)
                        self.churn.append((t, i, "master exited (%s)" % ng.popen.returncode, ng.pid))
                    continue
                cur = set(ng.worker_pids())
                for pid in cur:
                    try:
                        st = {}
                        with open("/proc/%d/status" % pid) as f:
                            for line in f:
                                k, _, v = line.partition(":")
                                if k in ("VmRSS", "RssAnon"):
                                    st[k] = int(v.split()[0])
                        self.rss.append((t, i, pid, st.get("VmRSS", 0), st.get("RssAnon", 0)))
                    except OSError:
                        pass
                with self.lock:
                    recent = any(n == i and t0 - 0.5 <= t and (t1 is None or t <= t1 + 10)
                                 for n, t0, t1 in self.reloads)
                    for pid in prev[i] - cur:
                        if pid not in self.expected_exit:
                            self.churn.append((t, i, "worker exited, no reload of ours", pid))
                    for pid in cur - prev[i]:
                        if not recent:
                            self.churn.append((t, i, "new worker, no reload of ours", pid))
                prev[i] = cur
            self.stop.wait(0.5)

    def redis_sampler(self):
        conn = None
        last = None               # (t, total, own)
        while not self.stop.is_set():
            t = time.time()
            try:
                if conn is None:
                    conn = RConn(self.redis.port, timeout=4.0)
                    last = None
                # the previous window's counters, final ~0.3 s after it ended
                # (they expire 2 s after their creation)
                frac = time.time() % 1.0
                w = int(time.time()) - 1
                cmds = [("INFO", "server", "commandstats")]
                if 0.3 <= frac <= 0.9:
                    cmds.append(["MGET"] + [counter_name(k, w) for k in HOT_KEYS]
                                + [counter_name(k, w, zone=STRICT_ZONE) for k in STRICT_KEYS])
                replies = conn.pipeline(cmds)
                info = replies[0]
                vals = replies[1] if len(replies) > 1 else None
                if isinstance(info, RedisError):
                    raise OSError(str(info))
                total = commands_in(commandstats_of(info))
                m = re.search(r"server_time_usec:(\d+)", info)
                now = int(m.group(1)) / 1e6 if m else time.time()   # Redis's own clock
                with OWN_LOCK:
                    mine = OWN[0]
                if last is not None and total < last[1]:
                    last = None                      # restarted: counters reset
                if last is None:
                    last = (now, total, mine)
                elif now - last[0] >= 0.45:          # rate over >= 0.45 s of Redis time
                    self.redis_rate.append((now, (total - last[1] - (mine - last[2])) / (now - last[0])))
                    last = (now, total, mine)
                if isinstance(vals, list):
                    for k, v in enumerate(vals):
                        into, kk = ((self.hot_redis, k) if k < len(HOT_KEYS)
                                    else (self.strict_redis, k - len(HOT_KEYS)))
                        if v is not None:
                            try:
                                into[(kk, w)] = int(v)
                            except ValueError:
                                into[(kk, w)] = v
            except (OSError, ConnectionError, ValueError) as e:
                self.redis_err.append((t, "%s: %s" % (type(e).__name__, e)))
                if conn is not None:
                    conn.close()
                conn = None
            self.stop.wait(max(0.0, 0.5 - (time.time() - t)))
        if conn is not None:
            conn.close()

    def progress(self):
        last_n, last_t = 0, time.time()
        while not self.stop.wait(15.0):
            n = sum(self.progress_arr)
            t = time.time()
            rss = [r[3] for r in self.rss[-8:]]
            rate = [r[1] for r in self.redis_rate[-4:]]
            log(self.t0, "progress: ~%d requests (%.0f/s), worker RSS max %.1f MB, Redis %.0f cmds/s"
                % (n, (n - last_n) / (t - last_t), max(rss or [0]) / 1024.0, max(rate or [0])))
            last_n, last_t = n, t

    def stall_watcher(self):
        """A request in flight for >= --stall seconds: record it and, for
        the first few, capture what that node's workers are doing (thread
        states, kernel stacks, a gdb backtrace of every thread)."""
        last_capture = {}
        while not self.stop.wait(0.1):
            now = time.time()
            arr = self.inflight[:]
            for j in range(0, len(arr), 2):
                t, node = arr[j], int(arr[j + 1])
                if t <= 0 or now - t < self.a.stall:
                    continue
                if now - last_capture.get(node, 0) < 10.0:
                    continue
                last_capture[node] = now
                self.stalls.append((t, node))
                if len(self.captures) < 3:
                    self.capture(node, t)

    def capture(self, node, since):
        ng = self.ngs[node]
        path = os.path.join(self.ctx.tmp, "stall-%d-nginx%d.txt" % (len(self.captures) + 1, node + 1))
        t0 = time.time()
        out = ["nginx%d: a request in flight since t=%.2fs (captured at t=%.2fs)"
               % (node + 1, since - self.t0, t0 - self.t0)]
        states = []
        pids = sorted(ng.worker_pids())
        for pid in pids:
            for tid in sorted(os.listdir("/proc/%d/task" % pid), key=int) if os.path.isdir("/proc/%d/task" % pid) else []:
                base = "/proc/%d/task/%s/" % (pid, tid)
                info = {}
                for name in ("comm", "wchan", "syscall", "stack"):
                    try:
                        with open(base + name) as f:
                            info[name] = f.read().strip()
                    except OSError as e:
                        info[name] = "(%s)" % e.strerror
                st = harness.proc_stat(int(tid))
                states.append("%d/%s %s %s" % (pid, tid, info["comm"], st[0] if st else "?"))
                out.append("--- worker %d thread %s (%s): state %s, wchan %s, syscall %s\n%s"
                           % (pid, tid, info["comm"], st[0] if st else "?", info["wchan"],
                              info["syscall"], info["stack"]))
        # spinning or blocked? CPU time of every thread over 0.3 s
        def cpu_ticks():
            out_t = {}
            for pid in pids:
                try:
                    tids = os.listdir("/proc/%d/task" % pid)
                except OSError:
                    continue
                for tid in tids:
                    try:
                        with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                            rest = f.read().rsplit(")", 1)[1].split()
                        out_t["%d/%s" % (pid, tid)] = (rest[0], int(rest[11]) + int(rest[12]))
                    except (OSError, IndexError, ValueError):
                        pass
            return out_t
        c0 = cpu_ticks()
        time.sleep(0.3)
        c1 = cpu_ticks()
        hz = os.sysconf("SC_CLK_TCK")
        spin = ["%s %s->%s %.0fms" % (k, c0[k][0], c1[k][0], (c1[k][1] - c0[k][1]) * 1000.0 / hz)
                for k in sorted(c1) if k in c0]
        out.append("--- CPU time per thread over 0.3 s (state before->after): " + ", ".join(spin))
        inflight_now = [("nginx%d" % (int(self.inflight[j + 1]) + 1), round(time.time() - self.inflight[j], 2))
                        for j in range(0, len(self.inflight), 2) if self.inflight[j] > 0]
        out.append("--- requests still in flight (node, seconds): %s" % inflight_now)
        states.append("cpu over 0.3 s: " + ", ".join(spin))
        gdb = shutil.which("gdb")
        if gdb:
            for pid in pids:
                try:
                    p = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off",
                                        "-ex", "thread apply all bt 40"], capture_output=True, timeout=20,
                                       stdin=subprocess.DEVNULL)
                    out.append("=== gdb backtrace of worker %d\n%s" % (pid, p.stdout.decode("utf-8", "replace")))
                except subprocess.TimeoutExpired:
                    out.append("=== gdb on worker %d timed out" % pid)
        with open(path, "w") as f:
            f.write("\n".join(out) + "\n")
        self.captures.append(path)
        t1 = time.time()
        with self.lock:                 # gdb stops the workers: not judged
            self.outages.append((t0, t1, "stall_capture"))
        log(self.t0, "STALL nginx%d: request in flight %.1fs; threads: %s; details in %s"
            % (node + 1, t0 - since, ", ".join(states), path))

    # -- chaos -------------------------------------------------------------
    def chaos(self):
        rng = random.Random(self.a.seed)
        kinds = ["redis_restart", "client_pause", "plant_garbage", "plant_wrongtype", "oom", "reload",
                 "outage_reload_kill"]
        end = self.t_end - 6.0
        nxt = self.t_start + 3.0
        nreload = 0
        while True:
            bag = kinds[:]
            rng.shuffle(bag)
            for kind in bag:
                while time.time() < nxt:
                    if self.stop.wait(min(0.2, nxt - time.time())):
                        return
                if time.time() > end:
                    return
                if kind == "redis_restart":
                    t0 = time.time()
                    self.redis.stop()
                    down = rng.uniform(1.0, 2.5)
                    time.sleep(down)
                    self.start_redis()
                    self.event(t0, time.time(), kind, "stopped (SIGTERM) for %.1fs, started again" % down, True)
                elif kind == "client_pause":
                    t0 = time.time()
                    r = rcmd(self.redis, "CLIENT", "PAUSE", "1500", "ALL")
                    time.sleep(max(0.0, t0 + 1.6 - time.time()))
                    self.event(t0, t0 + 1.5, kind, "CLIENT PAUSE 1500 ALL -> %s" % r, True)
                elif kind in ("plant_garbage", "plant_wrongtype"):
                    k = rng.randrange(len(HOT_KEYS))
                    i = rng.randrange(self.a.keys)
                    while many_key(i, self.tag)[0] == "4k":   # its Redis name is a digest
                        i = rng.randrange(self.a.keys)
                    t0 = time.time()
                    w = int(t0)
                    out = []
                    for hk, key in ((k, HOT_KEYS[k]), (None, many_key(i, self.tag)[1])):
                        name = counter_name(key, w)
                        if kind == "plant_garbage":
                            r = rcmd(self.redis, "SET", name, "notanumber")
                        else:
                            own(4)
                            r = cluster.cmds(self.redis.port, [("MULTI",), ("DEL", name),
                                                               ("LPUSH", name, "soak"), ("EXEC",)])[-1]
                        with self.lock:
                            self.plants.append((t0, hk, name, kind))
                            self.planted_names.add(name.decode("latin-1"))
                        out.append("%s -> %s" % (kname(name)[:40], r))
                    self.event(t0, time.time(), kind, "; ".join(out))
                elif kind == "oom":
                    t0 = time.time()
                    r1 = rcmd(self.redis, "CONFIG", "SET", "maxmemory-policy", "noeviction")
                    r2 = rcmd(self.redis, "CONFIG", "SET", "maxmemory", "1")
                    hold = rng.uniform(1.5, 3.0)
                    time.sleep(hold)
                    r3 = rcmd(self.redis, "CONFIG", "SET", "maxmemory", "0")
                    self.event(t0, time.time(), kind, "noeviction + maxmemory 1 for %.1fs (%s %s), maxmemory 0 (%s)"
                               % (hold, r1, r2, r3), True)
                elif kind == "reload":
                    node = nreload % 2
                    nreload += 1
                    t0 = time.time()
                    self.event(t0, time.time(), kind, self.reload(node))
                elif kind == "outage_reload_kill":
                    # Redis killed; one node reloads and the other loses a
                    # worker to SIGKILL while it is down: no key may be
                    # refused below its limit once Redis is back
                    t0 = time.time()
                    self.redis.stop(quick=True, sig=signal.SIGKILL)
                    time.sleep(0.5)
                    node = nreload % 2
                    nreload += 1
                    said = self.reload(node)
                    other = self.ngs[1 - node]
                    pids = other.worker_pids()
                    victim = sorted(pids)[0] if pids else None
                    if victim:
                        with self.lock:
                            self.expected_exit.add(victim)
                            self.killed.add(victim)
                            self.reloads.append([1 - node, time.time(), time.time()])
                        os.kill(victim, signal.SIGKILL)
                    time.sleep(rng.uniform(1.0, 2.0))
                    self.start_redis()
                    self.event(t0, time.time(), kind, "Redis SIGKILLed; %s; SIGKILL worker %s of nginx%d; "
                               "Redis started again" % (said, victim, 2 - node), True)
                nxt = time.time() + rng.uniform(2.0, 4.0)

    def start_redis(self):
        """Starts the stopped Redis again (a few tries: its port may linger)."""
        for attempt in range(5):
            try:
                self.redis.start(timeout=10.0)
                break
            except RuntimeError as e:
                self.thread_errors.append("redis start attempt %d: %s" % (attempt, e))
                time.sleep(1.0)
        own(1)   # the harness's readiness PING

    def reload(self, node):
        """HUP one nginx; what happened, in words."""
        ng = self.ngs[node]
        with self.lock:
            self.expected_exit |= set(ng.worker_pids())
            self.reloads.append([node, time.time(), None])
            entry = self.reloads[-1]
        res = ng.reload(timeout=8.0, check=False)
        with self.lock:
            entry[2] = time.time()
            self.expected_exit |= set(res["old"])
        return "HUP nginx%d: workers %s -> %s, old gone after %s" % (
            node + 1, res["old"], res["new"],
            "%.2fs" % res["old_gone_after"] if res["old_gone_after"] else "NEVER")

    # -- main ----------------------------------------------------------------
    def start(self):
        a = self.a
        self.tag = b"%x" % random.Random(a.seed).getrandbits(24)
        self.redis = self.ctx.redis()
        http_conf = (
            "    large_client_header_buffers 4 16k;\n"
            "    keepalive_requests 1000000;\n"
            "    keepalive_timeout 300s;\n"
            "    redis_ratelimit_zone $http_x_key zone=%s:32m redis=%s;\n"
            "    # strict requests wait for Redis: at most 200 ms, below the stall threshold\n"
            "    redis_ratelimit_zone $http_x_key zone=%s:1m redis=%s timeout=200ms;\n"
            "    redis_ratelimit_log_level info;   # rejections are expected here: not errors\n"
            % (ZONE, self.redis.url, STRICT_ZONE, self.redis.url))
        server_conf = (
            "        location = /m { redis_ratelimit %s %dr/s; try_files /t =404; }\n"
            "        location = /h { redis_ratelimit %s %dr/s; add_header X-T $msec always; try_files /t =404; }\n"
            "        location = /s { redis_ratelimit %s %dr/s strict; add_header X-T $msec always; try_files /t =404; }\n"
            % (ZONE, MANY_RATE, ZONE, HOT_RATE, STRICT_ZONE, STRICT_RATE))
        self.ngs = [self.ctx.nginx(http_conf, server_conf, workers=2, log_level="notice") for _ in range(2)]
        for ng in self.ngs:
            for path, key in (("/m", b"warmup-m"), ("/h", b"warmup-h")):
                with HttpConn(ng.port, timeout=5) as c:
                    r = c.get(path, {"X-Key": key})
                if r.status != 200:
                    raise RuntimeError("warm-up %s on %s: status %s\n%s" % (path, ng.name, r.status,
                                                                           ng.error_log_tail()))

    @staticmethod
    def cpu():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]          # total, idle + iowait

    def run(self):
        a = self.a
        self.t0 = time.time()
        log(self.t0, "redis :%d, nginx1 :%d, nginx2 :%d (2 workers each), prefixes under %s"
            % (self.redis.port, self.ngs[0].port, self.ngs[1].port, self.ctx.tmp))
        mpc = mp.get_context("fork")
        self.progress_arr = mpc.Array("q", a.procs, lock=False)
        self.inflight = mpc.Array("d", 2 * a.procs * (a.threads + 2), lock=False)
        q = mpc.Queue()
        self.t_start = time.time() + 1.0
        self.t_end = self.t_start + a.duration
        cfg = {"threads": a.threads, "procs": a.procs, "tag": self.tag, "keys": a.keys}
        ports = [ng.port for ng in self.ngs]
        self.clients = [mpc.Process(target=client_main, name="soak-client-%d" % i,
                                    args=(i, cfg, ports, self.t_start, self.t_end, self.progress_arr, self.inflight, q))
                        for i in range(a.procs)]
        for p in self.clients:
            p.start()
        self.cpu0 = self.cpu()
        threads = [self.guarded(self.proc_sampler, "proc_sampler"),
                   self.guarded(self.redis_sampler, "redis_sampler"),
                   self.guarded(self.chaos, "chaos"),
                   self.guarded(self.progress, "progress"),
                   self.guarded(self.stall_watcher, "stall_watcher")]
        for t in threads:
            t.start()
        log(self.t0, "traffic: %d client processes x (%d /m threads + 1 hot + 1 strict thread), %d s, seed %d"
            % (a.procs, a.threads, a.duration, a.seed))
        self.client_res = {}
        deadline = self.t_end + 3 * REQ_TIMEOUT + 60
        while len(self.client_res) < a.procs and time.time() < deadline:
            try:
                kind, idx, res = q.get(timeout=1.0)
            except Exception:       # noqa: BLE001 - queue.Empty
                if not any(p.is_alive() for p in self.clients) and q.empty():
                    break
                continue
            self.client_res[idx] = (kind, res)
        self.cpu1 = self.cpu()
        for p in self.clients:
            p.join(5)
        time.sleep(0.8)             # the last windows' counters reach Redis
        self.stop.set()
        for t in threads:
            t.join(10)
        log(self.t0, "traffic done; checking counter TTLs, stopping nginx")
        self.ttl_check()
        self.quit_times = [ng.quit() for ng in self.ngs]

    def stop_clients(self):
        for p in getattr(self, "clients", []):
            if p.is_alive():
                p.terminate()       # SIGTERM to that PID
        for p in getattr(self, "clients", []):
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(2)

    def ttl_check(self):
        """Counter keys without a TTL (planted ones excluded)."""
        self.no_ttl, self.nkeys = [], 0
        try:
            c = RConn(self.redis.port, timeout=5.0)
        except OSError as e:
            self.no_ttl = ["(Redis unreachable: %s)" % e]
            return
        try:
            cursor = "0"
            while True:
                cursor, names = c.cmd("SCAN", cursor, "MATCH", "rl:*", "COUNT", "1000")
                if names:
                    ttls = c.pipeline([("TTL", n.encode("utf-8", "surrogateescape")) for n in names])
                    self.nkeys += len(names)
                    for n, t in zip(names, ttls):
                        raw = n.encode("utf-8", "surrogateescape").decode("latin-1")
                        if t == -1 and raw not in self.planted_names:
                            self.no_ttl.append(n)
                if cursor == "0":
                    break
        finally:
            c.close()


# --------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------

LOG_RE = re.compile(r"^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d) \[(\w+)\] ")
NASTY_RE = re.compile(r"\[(alert|crit|emerg)\]|exited on signal|panick")


def parse_log(text):
    lines = []
    for line in text.splitlines():
        m = LOG_RE.match(line)
        if not m:
            continue
        t = time.mktime(time.strptime(m.group(1), "%Y/%m/%d %H:%M:%S"))
        lines.append((t, m.group(2), line))
    return lines


def overlaps(w, intervals, margin):
    return any(s < w + 1 and w < e + margin for s, e in intervals)


def fmt_int(n):
    return "{:,}".format(n)


def summarize(run, args):
    ok = True
    fails = []
    rows = []

    def row(name, value, good=None):
        mark = "" if good is None else ("ok" if good else "FAIL")
        rows.append((name, value, mark))

    counts = collections.Counter()
    errors = collections.Counter()
    err_samples, slow = [], []
    lat = array.array("f")
    lat_t = array.array("d")
    hot = {}
    strict = {}
    retried = sent = 0
    hx_t, hx_m = array.array("d"), array.array("b")
    harness_errors = list(run.thread_errors)
    for idx in range(args.procs):
        kind, res = run.client_res.get(idx, ("missing", "no result from client %d" % idx))
        if kind != "ok":
            harness_errors.append("client %d: %s" % (idx, res))
            continue
        if res["threads_done"] != res["threads"]:
            harness_errors.append("client %d: %d of %d threads finished" % (idx, res["threads_done"], res["threads"]))
        counts.update(res["counts"])
        errors.update(res["errors"])
        err_samples += res["err_samples"]
        slow += res["slow"]
        lat.extend(res["lat"])
        lat_t.extend(res["lat_t"])
        retried += res["retried"]
        sent += res["sent"]
        hx_t.extend(res["hx_t"])
        hx_m.extend(res["hx_m"])
        for k, v in res["hot"].items():
            h = hot.setdefault(k, [0, 0, 0, 0])
            for j in range(4):
                h[j] += v[j]
        for k, v in res["strict"].items():
            h = strict.setdefault(k, [0, 0])
            h[0] += v[0]
            h[1] += v[1]

    t_start, t_end = run.t_start, run.t_end
    dur = t_end - t_start
    answered = sum(counts.values())
    failed = sum(errors[k] for k in errors if k[2] != "no X-T header")
    total = answered + failed
    by_status = collections.Counter()
    for (node, cls, st), n in counts.items():
        by_status[st] += n
    s5xx = sum(n for st, n in by_status.items() if 500 <= st <= 599)
    odd = {st: n for st, n in by_status.items() if st not in (200, 429)}
    keyed = ("hot", "strict")
    false429 = sum(n for (node, cls, st), n in counts.items() if cls not in keyed and st == 429)
    many = sum(n for (node, cls, st), n in counts.items() if cls not in keyed)
    n_strict = sum(n for (node, cls, st), n in counts.items() if cls == "strict")
    row("total requests", "%s (200: %s, 429: %s; /m %s, /h %s, /s %s)"
        % (fmt_int(total), fmt_int(by_status[200]), fmt_int(by_status[429]), fmt_int(many),
           fmt_int(total - many - n_strict), fmt_int(n_strict)))
    busy = 1.0 - (run.cpu1[1] - run.cpu0[1]) / float(max(1, run.cpu1[0] - run.cpu0[0]))
    hz = float(os.sysconf("SC_CLK_TCK"))
    other = sum(run.foreign.values()) / hz / dur / os.cpu_count()
    row("requests/s", "%.0f over %.0f s (keep-alive retries after nginx closed a connection: %d; "
        "CPU busy %.0f%% of %d cores, clients included)" % (total / dur, dur, retried, 100 * busy, os.cpu_count()))
    row("CPU used by other processes", "%.0f%% of the machine (%s)" % (
        100 * other, ", ".join("%s %.0f%%" % (c, p) for c, p in run.foreign_top(4)) or "none"))
    row("client 5xx", str(s5xx), s5xx == 0)
    row("non-200/429 statuses", ", ".join("%s x %d" % kv for kv in sorted(odd.items())) or "none",
        not any(500 <= st <= 599 for st in odd))
    row("requests without a status", "%d %s" % (failed, dict(collections.Counter(
        "%s/%s" % (["nginx1", "nginx2"][k[0]], k[2]) for k in errors.elements() if k[2] != "no X-T header")) or ""),
        failed == 0)
    row("false 429 on /m (%dr/s, keys far below)" % MANY_RATE, str(false429), false429 == 0)
    cls_n = collections.Counter()
    for (node, cls, st), n in counts.items():
        cls_n[cls] += n
    row("distinct keys sent", "%s of a %s-key pool + %d hot (requests: %s)"
        % (fmt_int(sent), fmt_int(args.keys), len(HOT_KEYS),
           ", ".join("%s %s" % (c, fmt_int(cls_n[c])) for c in CLASSES + ("hot",))), sent >= 50000 or None)

    # crashes
    exited, nasty_lines, logs = 0, [], []
    for i, ng in enumerate(run.ngs):
        lines = parse_log(ng.error_log_text())
        logs.append(lines)
        for t, lvl, line in lines:
            if any("worker process %d exited on signal 9" % pid in line for pid in run.killed):
                continue   # the chaos's own SIGKILL
            if NASTY_RE.search(line):
                nasty_lines.append("nginx%d: %s" % (i + 1, line))
                if "exited on signal" in line:
                    exited += 1
    nasty_n = len(nasty_lines) - exited
    churn = [c for c in run.churn]
    crashes = exited + nasty_n + len(churn)
    row("worker crashes", "%d (exited on signal %d, [alert]/[crit]/[emerg] %d, unexplained worker churn %d)"
        % (crashes, exited, nasty_n, len(churn)), crashes == 0)

    # latency
    lv = sorted(lat)
    outs = [(s, e) for s, e, k in run.outages]
    pauses = [(s, e) for s, e, k in run.outages if k == "client_pause"]
    if lv:
        worst = max(slow) if slow else None
        row("latency p50 / p99 / p99.9 / worst", "%s / %s / %s / %s" % (
            harness.ms(harness.percentile(lv, 50)), harness.ms(harness.percentile(lv, 99)),
            harness.ms(harness.percentile(lv, 99.9)), harness.ms(lv[-1])))
        if worst:
            in_pause = [x for x in slow if any(s - 0.05 <= x[1] <= e for s, e in pauses)]
            row("  worst request", "%s at t=%.1fs on nginx%d (%s, status %s)%s; >=%dms: %d (%d during a CLIENT PAUSE)"
                % (harness.ms(worst[0]), worst[1] - run.t0, worst[2] + 1, worst[3], worst[4],
                   " during " + what_at(run, worst[1]) if what_at(run, worst[1]) else "",
                   SLOW * 1000, len(slow), len(in_pause)))
        else:
            row("  worst request", "below %dms (no request kept as slow)" % (SLOW * 1000))
        # latency while Redis was paused / stopped / OOM against the rest
        groups = collections.defaultdict(list)
        ivs = sorted(run.outages)
        starts = [iv[0] for iv in ivs]
        for el, t in zip(lat, lat_t):
            j = bisect.bisect_right(starts, t) - 1
            groups[ivs[j][2] if j >= 0 and t <= ivs[j][1] else "no outage"].append(el)
        row("  latency p99 / worst by Redis state", "; ".join(
            "%s %s / %s (%s req)" % (k, harness.ms(harness.percentile(v, 99)), harness.ms(max(v)), fmt_int(len(v)))
            for k, v in sorted(groups.items())))
    # a stall is bad whatever Redis does (the request path never waits on
    # it); only those that begin while gdb holds the workers are left out
    stall_out = [(t, n) for t, n in run.stalls if not any(s <= t <= e for s, e, k in run.outages
                                                              if k == "stall_capture")]
    row("stalls (a request in flight >= %gs)" % args.stall, "%d%s" % (
        len(stall_out), "".join("; t=%.1fs nginx%d" % (t - run.t0, n + 1) for t, n in run.stalls[:5])
        + ("; captures: " + ", ".join(run.captures) if run.captures else "")), not stall_out)
    # RSS
    if run.rss:
        peak = max(run.rss, key=lambda r: r[3])
        parts = []
        for i in range(2):
            rs = [r for r in run.rss if r[1] == i]
            a0 = [r for r in rs if r[0] <= t_start + 10]
            a1 = [r for r in rs if r[0] >= t_end - 10]
            if a0 and a1:
                parts.append("nginx%d max %.1f -> %.1f MB (RssAnon %.1f -> %.1f)" % (
                    i + 1, max(r[3] for r in a0) / 1024, max(r[3] for r in a1) / 1024,
                    max(r[4] for r in a0) / 1024, max(r[4] for r in a1) / 1024))
        row("peak worker RSS", "%.1f MB (nginx%d pid %d, t=%.0fs)" % (peak[3] / 1024.0, peak[1] + 1, peak[2],
                                                                       peak[0] - run.t0))
        row("  worker RSS first 10 s -> last 10 s", "; ".join(parts))
    if run.redis_rate:
        rates = [r for t, r in run.redis_rate if t_start <= t <= t_end]
        if rates:
            row("peak Redis commands/s", "%.0f (mean %.0f; %.3f per request; INFO and this script's own commands left out)"
                % (max(rates), sum(rates) / len(rates), sum(rates) / len(rates) / (total / dur)))
    # error log
    mins = dur / 60.0
    for i, lines in enumerate(logs):
        inrun = [x for x in lines if t_start - 1 <= x[0] <= t_end + 1]
        lv_n = collections.Counter(l for t, l, _ in inrun)
        mod = [x for x in inrun if "redis_ratelimit" in x[2]]
        per_sec = collections.Counter(int(t) for t, l, line in mod if l in ("error", "warn", "crit", "alert"))
        row("error-log lines/min nginx%d" % (i + 1), "%.1f (%s; module %.1f/min, max %d module error lines in one second)"
            % (len(inrun) / mins, ", ".join("%s %d" % kv for kv in sorted(lv_n.items())),
               len(mod) / mins, max(per_sec.values() or [0])))
    row("counter keys without TTL", "%d of %d rl:* keys at the end (planted ones left out)%s"
        % (len(run.no_ttl), run.nkeys, (": " + ", ".join(run.no_ttl[:3])) if run.no_ttl else ""),
        not run.no_ttl)
    row("nginx stop (SIGQUIT) took", ", ".join("%.2fs" % q for q in run.quit_times),
        all(q < 5.0 for q in run.quit_times))
    ev = collections.Counter(k for _, _, k, _ in run.events)
    row("chaos actions", ", ".join("%s %d" % kv for kv in sorted(ev.items())) or "none")

    # answer gaps: per node, the longest time between two consecutive hot
    # answers (server time) overlapping each window -- a stalled node (or
    # client) shows up here
    gaps = collections.defaultdict(lambda: [0.0, 0.0])
    for n in range(2):
        ts = sorted(t for t, m in zip(hx_t, hx_m) if (m >> 1) & 1 == n)
        for a, b in zip(ts, ts[1:]):
            if b - a >= 0.05:
                for w in range(int(a), int(b) + 1):
                    gaps[w][n] = max(gaps[w][n], b - a)

    # strict keys: decided in Redis, so a window outside outages holds at
    # most L. Clients tally an answer by its X-T, the time nginx wrote it:
    # a request Redis decided just before a window's end and answered
    # just after it is tallied in the next, so a tally has a little slack
    # (as for hot keys), and a tally over it is judged by what Redis
    # counted in that window (its counter, read after the window ended),
    # when that was read: Redis's count is what it allowed there.
    # A stall this run did not cause is an outage all the same when a node
    # saw it: a strict link without an answer within timeout= hands its
    # requests to on_error, and on_error=local counts them here and in
    # Redis (a script already sent may count them too).
    stalls = sorted({t for lines in logs for t, _, line in lines
                     if 'zone "%s"' % STRICT_ZONE in line and "no answer within timeout=" in line
                     and not overlaps(int(t), outs, args.margin)})
    strict_outs = outs + [(t - 1, t + 1) for t in stalls]
    if stalls:
        row("strict links without an answer outside the chaos",
            "%d (at t=%s): their windows are judged as outages"
            % (len(stalls), ", ".join("%.0fs" % (t - run.t0) for t in stalls)))
    for k, key in enumerate(STRICT_KEYS):
        judged, outage_w, late = [], [], []
        for (kk, w), (allowed, tot) in sorted(strict.items()):
            if kk != k or w < int(t_start) or w > int(t_end):
                continue
            (outage_w if overlaps(w, strict_outs, args.margin) else judged).append((allowed, tot, w))
        over = []
        for a, _, w in judged:
            if a <= STRICT_RATE * 1.05:
                continue
            v = run.strict_redis.get((k, w))
            if isinstance(v, int) and v <= STRICT_RATE:
                late.append("w=%d tallied %d, Redis counted %d" % (w, a, v))
            else:
                over.append(a)
        busy = [a for a, t, _ in judged if t > STRICT_RATE]
        row('strict "%s" %dr/s: allowed per 1 s window' % (kname(key), STRICT_RATE),
            "%d windows judged (%d with demand > L): max %d, mean %.1f, > 1.05 x L: %d; "
            "outage windows %d (max %d)%s"
            % (len(judged), len(busy), max([a for a, _, _ in judged] or [0]),
               sum(a for a, _, _ in judged) / max(1, len(judged)), len(over),
               len(outage_w), max([a for a, _, _ in outage_w] or [0]),
               "; tallied over but counted within L by Redis (answered after the window "
               "ended): " + "; ".join(late) if late else ""),
            not over and bool(busy))
        counted = [(w, v) for (kk, w), v in run.strict_redis.items()
                   if kk == k and isinstance(v, int) and int(t_start) <= w <= int(t_end)
                   and not overlaps(w, strict_outs, args.margin)]
        row("  Redis's count per judged window",
            "%d read: max %d" % (len(counted), max([v for _, v in counted] or [0])))
        if any(v > STRICT_RATE for _, v in counted):
            fails.append('strict key "%s": Redis counted more than L in a judged window (max %d of %d)'
                         % (kname(key), max(v for _, v in counted), STRICT_RATE))
        if over:
            fails.append('strict key "%s": %d judged window(s) over 1.05 x L (max %d of %d)'
                         % (kname(key), len(over), max(over), STRICT_RATE))
        elif not busy:
            fails.append('strict key "%s": no judged window had more demand than L' % kname(key))

    # hot keys
    margin = args.margin
    stalled_r, smooth_r = [], []
    over_l = []   # judged windows with more than L allowed
    worst_windows = []
    for k, key in enumerate(HOT_KEYS):
        plant_iv = [(t, int(t) + 2) for t, hk, name, kind in run.plants if hk == k]
        judged, outage_w, planted_w = [], [], []
        for (kk, w), (allowed, tot, n1, n2) in sorted(hot.items()):
            if kk != k or w < int(t_start) or w > int(t_end):
                continue
            r = allowed / float(HOT_RATE)
            if overlaps(w, outs, margin):
                outage_w.append(r)
            elif overlaps(w, plant_iv, margin):
                planted_w.append(r)
            else:
                judged.append((r, w, allowed, tot, n1, n2))
                (stalled_r if max(gaps[w]) >= 0.1 else smooth_r).append(r)
                if allowed > HOT_RATE:
                    over_l.append((k, w))
        over = [j for j in judged if j[0] > 1.05]
        busy = [j for j in judged if j[3] > HOT_RATE]
        mx = max([j[0] for j in judged] or [0])
        row('hot "%s" %dr/s: allowed/L per 1 s window' % (kname(key), HOT_RATE),
            "%d windows judged: max %.2f, mean %.3f (windows with demand > L: %d, mean %.3f), > 1.05: %d; "
            "outage windows %d (max %.2f); planted windows %d (max %.2f)"
            % (len(judged), mx, sum(j[0] for j in judged) / max(1, len(judged)),
               len(busy), sum(j[0] for j in busy) / max(1, len(busy)), len(over),
               len(outage_w), max(outage_w or [0]), len(planted_w), max(planted_w or [0])),
            not over and bool(judged))
        for j in over:
            worst_windows.append((k, j))
        # Redis cross-check
        same = diff = 0
        diffs = []
        for r, w, allowed, tot, n1, n2 in judged:
            v = run.hot_redis.get((k, w))
            if isinstance(v, int):
                if v == allowed:
                    same += 1
                else:
                    diff += 1
                    diffs.append("w=%d allowed %d Redis %d" % (w, allowed, v))
        row("  Redis counter = allowed (judged windows)", "%d equal, %d differ%s"
            % (same, diff, (": " + "; ".join(diffs[:3])) if diffs else ""))

    spans = []
    for k, w in over_l:
        ts = sorted(t for t, m in zip(hx_t, hx_m) if m & 1 and m >> 2 == k and int(t) == w)
        spans.append((ts[-1] - ts[HOT_RATE - 1]) * 1000)
    spans.sort()
    row("judged windows over L: answers past the L-th came within",
        "%d windows; median %.0f ms, max %.0f ms after the L-th allowed answer (a long span: a node "
        "decided on old counts)" % (len(spans), spans[len(spans) // 2] if spans else 0, spans[-1] if spans else 0))
    row("judged hot windows with a >= 100 ms gap in a node's answers",
        "%d of %d (max allowed/L %.2f, > 1.05: %d); without such a gap: max %.2f, > 1.05: %d"
        % (len(stalled_r), len(stalled_r) + len(smooth_r), max(stalled_r or [0]),
           sum(1 for r in stalled_r if r > 1.05), max(smooth_r or [0]), sum(1 for r in smooth_r if r > 1.05)))

    # raw figures, for a closer look (kept with the logs)
    try:
        import json
        with open(os.path.join(run.ctx.tmp, "soak-data.json"), "w") as f:
            json.dump({"t0": run.t0, "t_start": t_start, "t_end": t_end,
                       "events": run.events, "outages": run.outages,
                       "plants": [(t, hk, n.decode("latin-1"), k) for t, hk, n, k in run.plants],
                       "hot": sorted([k, w] + v for (k, w), v in hot.items()),
                       "hot_redis": sorted([k, w, v] for (k, w), v in run.hot_redis.items()),
                       "redis_rate": run.redis_rate, "rss": run.rss, "churn": run.churn,
                       "slow": sorted(slow)[-50:], "foreign": run.foreign_top(10),
                       "hot_allowed": sorted((m >> 2, t, (m >> 1) & 1) for t, m in zip(hx_t, hx_m) if m & 1)}, f)
    except (OSError, TypeError, ValueError) as e:
        harness_errors.append("writing soak-data.json: %s" % e)

    # failures
    if s5xx:
        fails.append("%d client 5xx" % s5xx)
    if crashes:
        fails.append("%d worker crash indicators" % crashes)
    first_w = {k: min([w for (kk, w) in hot if kk == k] or [0]) for k in range(len(HOT_KEYS))}
    for k, (r, w, allowed, tot, n1, n2) in worst_windows:
        fails.append('hot key "%s": window %d (t=%.1fs) allowed %d = %.2f x L (nginx1 %d, nginx2 %d, %d requests)%s%s%s%s'
                     % (kname(HOT_KEYS[k]), w, w - run.t0, allowed, r, n1, n2, tot,
                        " [the key's first window]" if w == first_w[k] else "",
                        "; longest answer gap nginx1 %.0f ms, nginx2 %.0f ms" % (gaps[w][0] * 1000, gaps[w][1] * 1000)
                        + "",
                        "; " + excess_timeline(hx_t, hx_m, k, w) if allowed > HOT_RATE else "",
                        "; nearest chaos: " + nearest(run, w) if nearest(run, w) else ""))
    if failed:
        fails.append("%d requests got no status" % failed)
    if false429:
        fails.append("%d false 429 on /m" % false429)
    if stall_out:
        fails.append("%d request stalls >= %gs (the request path must never wait)"
                              % (len(stall_out), args.stall))
    if run.no_ttl:
        fails.append("%d counter keys without TTL" % len(run.no_ttl))

    # print
    w1 = max(len(r[0]) for r in rows)
    print()
    print("== soak summary: 2 nginx x 2 workers, 1 redis-server, %.0f s, seed %d ==" % (dur, args.seed))
    for name, value, mark in rows:
        print("%-*s  %-4s %s" % (w1, name, mark, value))
    if nasty_lines:
        print("\ncrash lines in error.log:")
        for l in nasty_lines[:10]:
            print("  " + l)
    if churn:
        print("\nworker churn not caused by our reloads:")
        for t, i, what, pid in churn[:10]:
            print("  t=%.1fs nginx%d %s: %s" % (t - run.t0, i + 1, what, pid))
    if err_samples:
        print("\nrequests without a status (first ones):")
        for t, node, cls, el, what in sorted(err_samples)[:8]:
            print("  t=%.1fs nginx%d %s after %s: %s%s" % (t - run.t0, node + 1, cls, harness.ms(el), what,
                                                          (" during " + what_at(run, t)) if what_at(run, t) else ""))
    if harness_errors:
        print("\nHARNESS ERRORS:")
        for e in harness_errors:
            print("  " + e.replace("\n", "\n  "))
    print("\nfigures from this run: statuses/latencies as the clients saw them; hot windows keyed by the "
          "response's X-T ($msec); outage windows = overlapping [start, end + %.0fs] of a Redis stop, "
          "pause or OOM; planted windows = [plant, end of next window + %.0fs]." % (margin, margin))
    repro = "cd %s && python3 bench/soak.py --duration %g --seed %d" % (ROOT, args.duration, args.seed)
    if (args.procs, args.threads, args.keys, args.margin) != (3, 3, 60000, 2.0):
        repro += " --procs %d --threads %d --keys %d --margin %g" % (args.procs, args.threads, args.keys, args.margin)
    print("reproduce: " + repro)
    if fails:
        print("checks failed:")
        for f in fails:
            print("  - " + f)
    if harness_errors:
        print("RESULT: HARNESS ERROR")
        return 2
    if fails:
        print("RESULT: FAIL")
        return 1
    print("RESULT: PASS")
    return 0


def what_at(run, t):
    for s, e, kind, detail in run.events:
        if s - 0.05 <= t <= e + 0.5:
            return kind
    return ""


def excess_timeline(hx_t, hx_m, k, w):
    """How the answers past L came in a hot key's window: when (server time,
    into the window) the L-th allowed answer was, and the ones after it, by
    node and over how long. A few within a couple of milliseconds is two
    nodes deciding at once before either heard of the other's count; many
    over a long span is a node deciding on counts that stayed old (its
    Redis thread or replies held up)."""
    ts = sorted((t, (m >> 1) & 1) for t, m in zip(hx_t, hx_m)
                if m & 1 and m >> 2 == k and int(t) == w)
    if len(ts) <= HOT_RATE:
        return ""
    t_l = ts[HOT_RATE - 1][0]
    extra = ts[HOT_RATE:]
    by = [sum(1 for _, n in extra if n == i) for i in range(2)]
    offs = ", ".join("+%.0f" % ((t - t_l) * 1000) for t, _ in extra[:12])
    return ("the %dth allowed answer %.0f ms into the window, then %d more within %.0f ms "
            "(nginx1 %d, nginx2 %d; ms after it: %s)"
            % (HOT_RATE, (t_l - w) * 1000, len(extra), (extra[-1][0] - t_l) * 1000, by[0], by[1], offs))


def nearest(run, w):
    best = None
    for s, e, kind, detail in run.events:
        d = min(abs(s - w), abs(e - w), abs(s - (w + 1)), abs(e - (w + 1)))
        if s <= w + 1 and w <= e:
            d = 0
        if best is None or d < best[0]:
            best = (d, "%s at t=%.1f-%.1fs" % (kind, s - run.t0, e - run.t0))
    return best[1] if best else ""


# --------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of traffic (default 300)")
    ap.add_argument("--seed", type=int, default=None, help="chaos order/timing and key bytes (default: random)")
    ap.add_argument("--procs", type=int, default=3, help="client processes (default 3)")
    ap.add_argument("--threads", type=int, default=3, help="/m threads per client process (default 3)")
    ap.add_argument("--keys", type=int, default=60000, help="size of the /m key pool (default 60000)")
    ap.add_argument("--margin", type=float, default=2.0, help="seconds after an outage not judged (default 2)")
    ap.add_argument("--stall", type=float, default=0.5,
                    help="a request in flight this long is a stall: recorded, first 3 captured with gdb (default 0.5)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs) also on success")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 1 << 31)
    if args.duration < 20:
        ap.error("--duration must be >= 20")

    for pre in (harness.NGINX_BIN, harness.MODULE_SO):
        if not os.path.exists(pre):
            print("%s is missing (run `make build`)" % pre)
            return 2
    harness.install_signal_handlers()

    class Watchdog(Exception):
        pass

    def on_alarm(signum, frame):
        raise Watchdog("soak exceeded duration + 180 s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.duration) + 180)
    tmp_root = tempfile.mkdtemp(prefix="nginx-rl-soak-")
    os.chmod(tmp_root, 0o755)
    rc = 2
    run = None
    try:
        bindir = os.path.join(tmp_root, "bin")
        os.makedirs(bindir)
        os.chmod(bindir, 0o755)
        for attr in ("NGINX_BIN", "MODULE_SO"):     # a rebuild must not touch what runs
            dst = os.path.join(bindir, os.path.basename(getattr(harness, attr)))
            shutil.copy2(getattr(harness, attr), dst)
            setattr(harness, attr, dst)
        ctx = harness.Ctx("soak", tmp_root)
        run = Run(args, ctx)
        try:
            run.start()
            run.run()
        finally:
            run.stop.set()
            run.stop_clients()
        signal.alarm(0)
        rc = summarize(run, args)
    except Exception:               # noqa: BLE001
        traceback.print_exc()
        if run is not None:
            for line in run.ctx.diagnostics():
                print("# " + line)
        rc = 2
    finally:
        signal.alarm(0)
        if run is not None:
            run.stop.set()
            run.stop_clients()
            run.ctx.cleanup()
        harness.cleanup_all()
        if rc == 0 and not args.keep:
            shutil.rmtree(tmp_root, ignore_errors=True)
        else:
            print("logs kept in %s" % tmp_root)
    return rc


if __name__ == "__main__":
    sys.exit(main())
