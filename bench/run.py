#!/usr/bin/env python3
"""Benchmark harness for ngx_http_redis_ratelimit_module.

    python3 bench/run.py [--quick] [--duration S] [--with-trace | --no-trace]

Starts one redis-server and four nginx instances (build/sbin/nginx + the
built module; a and b with 1 worker each pinned to CPU 0 and 1, c with 2
workers, d with 1; access_log off, 127.0.0.1, free ports) in a temporary
directory, then in the same run:

  * throughput: wrk -t1 -c32 -dS --latency against cases that all serve the
    same small static file: baseline, limit_req, embedded zone, Redis zone
    with one hot key (1 and 2 workers), 10 000 keys each far below a
    6000r/m or a 100r/s limit, 100 000 keys (6000r/m, 16m zone), strict
    limits (one hot key, 10 000 keys), the breaker path, plus a
    `return 429` reference for the breaker path; a 1 s
    warm-up each, 2 rounds in alternating order (best kept); the nginx
    workers' CPU per request (user and system, /proc), Redis commands and
    Redis CPU (INFO commandstats, INFO cpu) per allowed request;
    shared-memory bytes per key measured by filling a 1m zone until its
    first key is evicted;
  * strict latency: what a strict limit adds to one request (one
    connection, requests one after another) against the zone's own Redis
    round trip (from its metrics page);
  * accuracy: single-node flood, two-node and four-node floods of one fresh
    key, four nodes each paced at 40 % of the limit on one key, steady 2x
    overload, and (--with-trace) the trace simulation over the core's
    decision code (cargo test --release -p ratelimit-core --test trace_sim
    -- --nocapture --exact trace_simulation).

`--floods N` runs only the two- and four-node floods, N times each, and
prints their distribution (with `--stall-redis MS`: Redis stopped for up
to MS ms at random during each flood; with `--expiring-keys N`: N Redis
keys expiring during each).

Prints two markdown tables with the targets and a check mark next to each
figure (nothing is asserted: the exit status is 0 unless the harness itself
failed). Every process started here is stopped by its PID on exit, on
failure and on Ctrl-C. Python 3.11 stdlib, wrk and redis-server only.
"""

import argparse
import json
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "t", "lib"))

import servers  # noqa: E402

MODULE_NAME = "ngx_http_redis_ratelimit_module"
FILE_BODY = b"x" * 63 + b"\n"  # the small static file every case serves

# --------------------------------------------------------------------------
# processes (started and stopped by t/lib/servers.py, by PID)
# --------------------------------------------------------------------------

STARTED = servers.Registry()  # every long-running process we own
NGINXES = []  # Nginx instances, for their error logs when something fails
ODDITIES = []  # things to print after the tables


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def stop_all():
    STARTED.stop_all(quick=False, on_error=lambda obj, e: log(f"stopping {obj}: {e}"))


def on_signal(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def start_redis(work, name="redis"):
    """redis-server on a free port, its files in work/<name>."""
    return servers.RedisServer(os.path.join(work, name), registry=STARTED).start(timeout=10.0)


def share_figures(port):
    """The outage zone's Redis figures from a node's metrics page."""
    status, _, body, _ = servers.http_get(port, "/metrics?format=json", timeout=5)
    if status != 200:
        raise RuntimeError(f"/metrics on port {port} answered {status}")
    return json.loads(body.decode())["zones"]["sh"]["redis"]


def script_calls(redis):
    """EVALSHA calls so far (strict mode's decisions)."""
    return int(redis.commandstats().get("evalsha", {}).get("calls", 0))


def zone_rtt(port, zone):
    """(pipelines, sum of their round trips in s) of a zone's Redis threads,
    from the module's metrics page."""
    status, _, body, _ = servers.http_get(port, "/metrics?format=json", timeout=5)
    if status != 200:
        raise RuntimeError(f"/metrics on port {port} answered {status}")
    body = body.decode()
    m = re.search(r'"%s":\{.*?"pipelines":(\d+).*?"roundtrip_sum_seconds":([0-9.e-]+)' % zone, body)
    return (int(m.group(1)), float(m.group(2))) if m else (0, 0.0)


def redis_cpu(redis):
    """Seconds of CPU redis-server used so far (user + system, INFO cpu)."""
    total = 0.0
    for line in redis.cmd("INFO", "cpu").splitlines():
        k, _, v = line.strip().partition(":")
        if k in ("used_cpu_sys", "used_cpu_user"):
            total += float(v)
    return total


def workers_cpu(n):
    """Seconds of CPU an nginx's workers used so far: (user, system), from
    /proc (a worker's Redis I/O thread included)."""
    tick = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    for pid in n.worker_pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone: check_workers says so
        user += int(fields[11]) / tick
        system += int(fields[12]) / tick
    return user, system


# --------------------------------------------------------------------------
# nginx
# --------------------------------------------------------------------------

NGINX_CONF = """\
load_module {module};
worker_processes {workers};
{affinity}
error_log logs/error.log error;
pid logs/nginx.pid;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    server_tokens off;
    default_type text/plain;
    keepalive_requests 10000000;
    keepalive_timeout 300s;

    limit_req_zone $binary_remote_addr zone=lr:10m rate=100000000r/s;
    # the many-key cases' references: the same key variable and zone sizes
    limit_req_zone $http_x_key zone=lrk:10m rate=100r/s;
    limit_req_zone $http_x_key zone=lrh:16m rate=100r/s;

    redis_ratelimit_zone $binary_remote_addr zone=e:10m;
    redis_ratelimit_zone $binary_remote_addr zone=r:10m redis={redis};
    redis_ratelimit_zone $http_x_key zone=km:10m redis={redis};
    redis_ratelimit_zone $http_x_key zone=ks:10m redis={redis};
    redis_ratelimit_zone $http_x_key zone=kh:16m redis={redis};
    redis_ratelimit_zone $binary_remote_addr zone=x:10m redis={redis};
    redis_ratelimit_zone $arg_k zone=m:1m;
    redis_ratelimit_zone $arg_k zone=acc:10m redis={redis};
    redis_ratelimit_zone $binary_remote_addr zone=st:10m redis={redis};
    redis_ratelimit_zone $http_x_key zone=sk:10m redis={redis};
    # the outage case: a Redis of its own, killed at the end
    redis_ratelimit_zone $arg_k zone=sh:1m redis={outage} on_error=share timeout=200ms;

    # rejections are logged at info, below error_log's level: no log cost
    redis_ratelimit_log_level info;
    redis_ratelimit_status 429;

    server {{
        listen 127.0.0.1:{port} backlog=4096;
        root html;

        location = /b {{ try_files /f.txt =404; }}
        location = /lr {{
            limit_req zone=lr burst=1000000 nodelay;
            try_files /f.txt =404;
        }}
        location = /lrk {{
            limit_req zone=lrk burst=1000000 nodelay;
            try_files /f.txt =404;
        }}
        location = /lrh {{
            limit_req zone=lrh burst=1000000 nodelay;
            try_files /f.txt =404;
        }}
        location = /e {{ redis_ratelimit e 1000000000r/s; try_files /f.txt =404; }}
        location = /r {{ redis_ratelimit r 1000000000r/s; try_files /f.txt =404; }}
        location = /km {{ redis_ratelimit km 6000r/m; try_files /f.txt =404; }}
        location = /ks {{ redis_ratelimit ks 100r/s; try_files /f.txt =404; }}
        location = /kh {{ redis_ratelimit kh 6000r/m; try_files /f.txt =404; }}
        location = /x {{ redis_ratelimit x 1r/d; try_files /f.txt =404; }}
        location = /m {{ redis_ratelimit m 1r/d; try_files /f.txt =404; }}
        location = /a {{ redis_ratelimit acc 1000r/m; try_files /f.txt =404; }}
        location = /s {{ redis_ratelimit acc 200r/s; try_files /f.txt =404; }}
        location = /st {{ redis_ratelimit st 1000000000r/s strict; try_files /f.txt =404; }}
        location = /sk {{ redis_ratelimit sk 6000r/m strict; try_files /f.txt =404; }}
        location = /sh {{ redis_ratelimit sh 400r/h; try_files /f.txt =404; }}
        location = /z {{ return 429; }}
        location = /metrics {{ redis_ratelimit_metrics; }}
    }}
}}
"""


class Nginx(servers.NginxServer):
    """One benchmark nginx: 1 worker (optionally pinned to a CPU), the
    module's zones on one Redis, f.txt served by every case."""

    def __init__(self, binary, module, work, name, port, redis_port, cpu, workers=1, outage_port=1):
        super().__init__(binary, os.path.join(work, name), port, workers=workers, name=name,
                         registry=STARTED)
        with open(os.path.join(self.prefix, "html", "f.txt"), "wb") as f:
            f.write(FILE_BODY)
        conf = NGINX_CONF.format(
            module=module, port=port, redis=f"redis://127.0.0.1:{redis_port}", workers=workers,
            outage=f"redis://127.0.0.1:{outage_port}",
            affinity=(f"worker_cpu_affinity {1 << cpu:b};" if cpu is not None else ""))
        with open(self.conf_path, "w") as f:
            f.write(conf)
        # the master runs as root, the workers as nobody
        for dirpath, dirs, files in os.walk(self.prefix):
            os.chmod(dirpath, 0o755)
            for fn in files:
                os.chmod(os.path.join(dirpath, fn), 0o644)
        self.pids = []  # the worker pids, to notice a crash (respawn)
        NGINXES.append(self)

    def start(self):
        self.test_config()
        super().start(timeout=10.0)
        self.pids = sorted(self.worker_pids())

    def check_workers(self, when):
        """Notes a worker that died (and was respawned) since the last check."""
        now = sorted(self.worker_pids())
        if now != self.pids:
            msg = f"nginx {self.name}: worker pids {self.pids} -> {now} during {when} (crash?)"
            log(msg)
            ODDITIES.append(msg)
            self.pids = now

    def error_lines(self):
        return [l for l in self.error_log_text().splitlines() if l.strip()]


def http_conn(port):
    """A keep-alive connection (t/lib/servers.py's client) with Nagle off."""
    return servers.HttpConn(port, timeout=10, nodelay=True)


# --------------------------------------------------------------------------
# wrk
# --------------------------------------------------------------------------

BENCH_RE = re.compile(r"^BENCH (.*)$", re.M)


# the zones' hold= (the default)
HOLD_S = 5.0
# the steady-state cases: a warm-up longer than hold= (the counts it held
# are sent before the counted part starts), then counted (seconds)
STEADY_WARM_S = 6
STEADY_S = 8


def run_wrk(url, conns, duration, script, cpu=None, args=(), timeout_extra=30):
    cmd = (["taskset", "-c", str(cpu)] if cpu is not None else []) + [
        "wrk", "-t1", f"-c{conns}", f"-d{duration}s", "--latency", "--timeout", "10s",
        "-s", script, url]
    if args:
        cmd += ["--"] + list(args)
    return cmd


def parse_wrk(out, cmd):
    m = BENCH_RE.search(out)
    if not m:
        raise RuntimeError(f"no result from {' '.join(cmd)}:\n{out}")
    r = {}
    for kv in m.group(1).split():
        k, v = kv.split("=")
        r[k] = float(v)
    r["allowed"] = int(r["requests"] - r["non2xx"])
    r["rps"] = r["requests"] / (r["duration_us"] / 1e6)
    r["sock_errors"] = int(r["connect"] + r["read"] + r["write"] + r["timeout"])
    return r


def wrk(url, conns, duration, script, cpu=None, args=()):
    cmd = run_wrk(url, conns, duration, script, cpu, args)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    return parse_wrk(p.stdout, cmd)


def wrk_parallel(jobs):
    """Runs several wrk at once (each a tuple of run_wrk arguments)."""
    procs = []
    try:
        for j in jobs:
            cmd = run_wrk(*j)
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append((cmd, p))
        results = []
        for cmd, p in procs:
            out, err = p.communicate(timeout=max(j[2] for j in jobs) + 60)
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{out}{err}")
            results.append(parse_wrk(out, cmd))
        return results
    finally:
        for cmd, p in procs:
            servers.stop_popen(p, grace=2.0)


# --------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------


def shm_bytes_per_key(port, zone_bytes):
    """Capacity of the 1m zone `m` (1r/d per `$arg_k`), found empirically.

    Insert keys 0..M-1 once each (all 200). If key 0 still answers 429 the
    zone holds at least M keys: double M and retry with fresh keys (older
    keys are least recently used, so they go first). Otherwise key 0 was
    evicted; asking for it again re-inserted it and evicted the oldest
    survivor, M-C. Walking down from M-1, survivors answer 429 (which only
    touches them) until M-C, the first 200: capacity C = M - (M-C)."""
    c = http_conn(port)
    try:
        m = 1024
        trial = 0
        while True:
            trial += 1
            pfx = b"/m?k=t%d-" % trial
            st = c.statuses([pfx + b"%d" % i for i in range(m)])
            bad = sum(1 for s in st if s != 200)
            if bad:
                raise RuntimeError(f"shm probe: {bad} of {m} fresh keys were not allowed")
            if c.get(pfx + b"0").status == 429:
                if m >= 1 << 24:
                    raise RuntimeError("shm probe: zone never evicts")
                m *= 2
                continue
            down = list(range(m - 1, 0, -1))
            st = c.statuses([pfx + b"%d" % j for j in down])
            first = next((j for j, s in zip(down, st) if s == 200), None)
            if first is None:
                raise RuntimeError("shm probe: no evicted key found")
            cap = m - first
            return zone_bytes / cap, cap, m
    finally:
        c.close()


def paced_all(ports, path, rate, duration, what):
    """`paced` on every port at once, two connections each: one result per
    port."""
    out = [None] * len(ports)

    def one(i, port):
        out[i] = paced(port, path, rate, duration, conns=2)

    ts = [threading.Thread(target=one, args=(i, p), daemon=True) for i, p in enumerate(ports)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(duration + 50)
    if any(o is None for o in out):
        raise RuntimeError(f"{what}: a pacing client did not finish")
    return out


def paced(port, path, rate, duration, conns=4):
    """Sends `rate` req/s for `duration` s, evenly spaced, over `conns`
    keep-alive connections (connection i takes slots i, i+conns, ...).
    Starts 1 ms after a whole second. Returns (sent, allowed, max lag s)."""
    interval = 1.0 / rate
    total = int(rate * duration)
    t0 = int(time.time()) + 1.001
    results = [None] * conns
    errors = []

    def worker(i):
        sent = allowed = 0
        lag = 0.0
        try:
            h = http_conn(port)
            req = servers.http_request(path)
            for slot in range(i, total, conns):
                at = t0 + slot * interval
                while True:
                    d = at - time.time()
                    if d <= 0:
                        break
                    time.sleep(d if d > 0.002 else d / 2)
                lag = max(lag, time.time() - at)
                h.send(req)
                s = h.read().status
                sent += 1
                allowed += 1 if 200 <= s < 300 else 0
            h.close()
        except Exception as e:
            errors.append(e)
        results[i] = (sent, allowed, lag)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration + 30)
    if errors:
        raise RuntimeError(f"pacing client: {errors[0]}")
    return (sum(r[0] for r in results), sum(r[1] for r in results),
            max(r[2] for r in results))


def redis_rtt_us(port, n=2000):
    """The median of `n` PING round trips on one connection: what one Redis
    round trip adds to a request on this machine."""
    times = []
    with servers.RedisConn(port) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            c.cmd("PING")
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


LATENCY_N = 2000


def latency_probe(port, path, n=LATENCY_N, keyed=False):
    """(p50, p99) in µs of `n` requests sent one after another on one
    keep-alive connection (`keyed`: each with its own X-Key of 10 000)."""
    h = http_conn(port)
    times = []
    try:
        for i in range(n + 100):
            hdr = {"X-Key": b"lat%d" % (i % 10000)} if keyed else None
            t0 = time.perf_counter()
            h.get(path, hdr)
            if i >= 100:  # the first ones warm up
                times.append((time.perf_counter() - t0) * 1e6)
    finally:
        h.close()
    times.sort()
    return times[len(times) // 2], times[int(len(times) * 0.99)]


def wait_minute_safe(limit=50):
    """Waits for the next minute if fewer than 60-limit seconds are left."""
    s = time.time() % 60
    if s > limit:
        log(f"waiting {60 - s:.1f} s for the start of a minute")
        time.sleep(60 - s + 0.05)


def flood_once(nodes, conns, key, what="flood"):
    """Every node floods one fresh key of 1000r/m (`/a`) for 3 s; each
    node's wrk figures."""
    rs = wrk_parallel([(f"http://127.0.0.1:{x.port}/a?k={key}", conns, 3, os.path.join(HERE, "stats.lua"),
                        None) for x in nodes])
    for x in nodes:
        x.check_workers(what)
    return rs


class RedisStaller(threading.Thread):
    """Stops a Redis we started (SIGSTOP, by its PID) for up to `ms` ms at
    random every 20-200 ms until `stop`."""

    def __init__(self, redis, ms):
        super().__init__(daemon=True)
        self.pid, self.ms, self.done = redis.popen.pid, ms, threading.Event()

    def run(self):
        try:
            while not self.done.wait(random.uniform(0.02, 0.2)):
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(random.uniform(0, self.ms) / 1000)
                os.kill(self.pid, signal.SIGCONT)
        finally:
            os.kill(self.pid, signal.SIGCONT)

    def stop(self):
        self.done.set()
        self.join()


def expiring(redis, n, tag):
    """`n` keys that expire 0.5-3.5 s from now."""
    for i in range(0, n, 5000):
        servers.pipeline(redis.port, [("SET", f"exp:{tag}:{j}", "1", "PX", str(random.randint(500, 3500)))
                                      for j in range(i, min(n, i + 5000))], timeout=30)


def floods(n, two, four, redis, stall_ms=0, expiring_keys=0):
    """`--floods N`: cases b and d, N times each, one fresh key each, every
    flood inside one minute window; prints each and the distribution."""
    stamp = int(time.time())
    out = {2: [], 4: []}
    for i in range(n):
        for nodes, conns in ((two, 32), (four, 16)):
            wait_minute_safe(55)
            if expiring_keys:
                expiring(redis, expiring_keys, f"{len(nodes)}-{i}")
            st = RedisStaller(redis, stall_ms) if stall_ms else None
            if st:
                st.start()
            try:
                got = [r["allowed"] for r in flood_once(nodes, conns, f"f{len(nodes)}-{stamp}-{i}")]
            finally:
                if st:
                    st.stop()
            v = sum(got) / 1000
            out[len(nodes)].append(v)
            print(f"{len(nodes)} nodes, run {i + 1}: {v:.3f} ({' + '.join(map(str, got))}) "
                  f"{mark(v <= 1.05)}", flush=True)
    for k, vs in out.items():
        vs = sorted(vs)
        over = sum(v > 1.05 for v in vs)
        print(f"{k} nodes: {len(vs)} floods, min {vs[0]:.3f}, median {vs[len(vs) // 2]:.3f}, "
              f"max {vs[-1]:.3f}, over 1.05: {over}")
    return 0


# --------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------


def mark(ok):
    return "✓" if ok else "✗"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)


def ms(us):
    return f"{us / 1000:.2f} ms"


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def print_cases(res, cases):
    """The short table of `--cases`: each case's best round against the
    baseline, with its strict figures when it has them."""
    b = res["baseline"]
    rows = []
    for name, *_ in cases:
        r = res[name]
        allowed = max(r["allowed_all"], 1)
        rtt = r.get("rtt")
        rows.append([name, f"{r['rps']:,.0f}", f"{r['rps'] / b['rps']:.3f}", ms(r["p50_us"]),
                     f"+{(r['p50_us'] - b['p50_us']) / 1000:.3f} ms" if rtt else "",
                     f"{rtt * 1000:.3f} ms" if rtt else "",
                     "%.1f + %.1f" % r["worker_us"], f"{r['cmds'] / allowed:.3f}",
                     f"{r['calls'] / allowed:.3f}", f"{1e6 * r['redis_cpu'] / allowed:.1f}"])
    print(table(["case", "req/s", "÷ baseline", "p50", "p50 added", "round trip",
                 "worker CPU µs (user + system)", "Redis cmds / allowed",
                 "script calls / allowed", "Redis CPU µs / allowed"], rows))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 s per throughput case")
    ap.add_argument("--duration", type=int, default=None,
                    help="seconds per throughput case (default 5, --quick 2)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds over all throughput cases, best kept (default 2, --quick 1)")
    ap.add_argument("--with-trace", dest="trace", action="store_true",
                    help="also run the trace simulation (cargo test --release -p ratelimit-core --test trace_sim)")
    ap.add_argument("--no-trace", dest="trace", action="store_false")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--latency-only", action="store_true",
                    help="only the strict latency table (one connection, sequential)")
    ap.add_argument("--accuracy-only", action="store_true",
                    help="only the accuracy cases (no throughput, no strict latency)")
    ap.add_argument("--floods", type=int, default=0, metavar="N",
                    help="only the two- and four-node floods (cases b and d), N times each, "
                         "and their distribution")
    ap.add_argument("--stall-redis", type=float, default=0, metavar="MS",
                    help="with --floods: stop Redis (SIGSTOP) for up to MS ms at random "
                         "every 20-200 ms during each flood")
    ap.add_argument("--expiring-keys", type=int, default=0, metavar="N",
                    help="with --floods: before each flood, N Redis keys that expire during it "
                         "(Redis's expiry cycles take its time and a CPU, as after the many-key cases)")
    ap.add_argument("--cases", default="", metavar="A,B",
                    help="only these throughput cases (by name; the baseline always runs), "
                         "printed as a short table; nothing else runs (for comparing builds)")
    ap.add_argument("--nginx", default=os.path.join(ROOT, "build", "sbin", "nginx"))
    ap.add_argument("--module", default=os.path.join(ROOT, "build", "modules", MODULE_NAME + ".so"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.set_defaults(trace=False)
    a = ap.parse_args()
    duration = a.duration or (2 if a.quick else 5)
    rounds = a.rounds or (1 if a.quick else 2)

    for exe in ("wrk", "redis-server"):
        if not shutil.which(exe):
            sys.exit(f"bench: {exe} not found (apt-get install {exe.split('-')[0]})")
    for f in (a.nginx, a.module):
        if not os.path.exists(f):
            sys.exit(f"bench: {f} not found (make build)")

    ncpu = os.cpu_count() or 1
    pin = bool(shutil.which("taskset")) and ncpu >= 2
    cpu_nginx, cpu_wrk, cpu_nginx_b = (0, 1, 1) if pin else (None, None, None)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    work = tempfile.mkdtemp(prefix="rrl-bench-")
    os.chmod(work, 0o755)
    try:
        return bench(a, duration, rounds, work, pin, cpu_nginx, cpu_wrk, cpu_nginx_b)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except Exception:
        for n in NGINXES:
            if n.popen is not None:
                log(f"nginx {n.name}: worker pids now {sorted(n.worker_pids())}; error.log tail:")
                for l in n.error_lines()[-10:]:
                    log("    " + l)
        raise
    finally:
        stop_all()
        if a.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def bench(a, duration, rounds, work, pin, cpu_nginx, cpu_wrk, cpu_nginx_b):
    t_start = time.time()
    redis = start_redis(work)
    redis_port = redis.port
    if pin:
        # with wrk, off the nginx worker's CPU until the accuracy cases: on
        # a node, Redis is another machine's work; left to the scheduler it
        # ran on CPU 0 in some runs and not in others, which moved a strict
        # case by 15 %
        os.sched_setaffinity(redis.popen.pid, {cpu_wrk})
    outage = start_redis(work, "redis-outage")
    a_port, b_port = servers.free_port(), servers.free_port()
    # Run private copies: a concurrent `make build` rewrites build/ in place,
    # which would crash (SIGBUS/SIGSEGV) an nginx that has the files mapped.
    os.makedirs(os.path.join(work, "bin"))
    binary = os.path.join(work, "bin", "nginx")
    module = os.path.join(work, "bin", MODULE_NAME + ".so")
    shutil.copyfile(a.nginx, binary)
    shutil.copyfile(a.module, module)
    os.chmod(os.path.join(work, "bin"), 0o755)
    os.chmod(binary, 0o755)
    os.chmod(module, 0o755)
    c_port, d_port = servers.free_port(), servers.free_port()
    op = outage.port
    na = Nginx(binary, module, work, "a", a_port, redis_port, cpu_nginx, outage_port=op)
    nb = Nginx(binary, module, work, "b", b_port, redis_port, cpu_nginx_b, outage_port=op)
    # c: 2 workers (the hot key with two workers); c and d: the four-node cases
    nc = Nginx(binary, module, work, "c", c_port, redis_port, None, workers=2, outage_port=op)
    nd = Nginx(binary, module, work, "d", d_port, redis_port, None, outage_port=op)
    for n in (na, nb, nc, nd):
        n.start()
    stats = os.path.join(HERE, "stats.lua")
    keys = os.path.join(HERE, "keys.lua")
    base = f"http://127.0.0.1:{a_port}"

    ver = subprocess.run([binary, "-v"], capture_output=True, text=True).stderr.strip()
    rver = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    rver = (re.search(r"v=(\S+)", rver) or re.search(r"(\S+)", rver)).group(1)
    print(f"# ngx_http_redis_ratelimit benchmark — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print()
    print(f"{ver.replace('nginx version: ', '')}, 1 worker per instance, access_log off; "
          f"redis-server {rver}; {os.cpu_count()} CPUs; "
          f"wrk -t1 -c32 -d{duration}s --latency after a 1 s warm-up per case; "
          f"{rounds} round(s) in alternating order, the best kept.")
    if pin:
        print("CPU pinning: nginx worker on CPU 0 (worker_cpu_affinity, its Redis I/O thread "
              "included), wrk on CPU 1 (taskset); redis-server on CPU 1 too until the accuracy "
              "cases, which leave it unpinned. Two-node flood: "
              "the second nginx worker on CPU 1, both wrk unpinned.")
    else:
        print("CPU pinning: none (taskset missing or a single CPU).")
    print()

    if a.floods:
        return floods(a.floods, [na, nb], [na, nb, nc, nd], redis, a.stall_redis, a.expiring_keys)

    if not a.accuracy_only:
        if not a.latency_only:
            # ---- throughput -------------------------------------------------------
            c_base = f"http://127.0.0.1:{c_port}"
            cases = [
                ("baseline", "no limiting", base + "/b", stats, ()),
                ("limit_req", "nginx limit_req, 10m zone, rate never reached", base + "/lr", stats, ()),
                ("embedded", "module, embedded zone, limit never reached", base + "/e", stats, ()),
                ("redis-hot", "module, Redis zone, one hot key", base + "/r", stats, ()),
                ("redis-hot-2w", "module, Redis zone, one hot key, 2 workers (unpinned)", c_base + "/r",
                 stats, ()),
                ("limit_req-10k", "nginx limit_req, 10m zone keyed by X-Key, 10 000 keys, each far below",
                 base + "/lrk", keys, ("10000",)),
                ("limit_req-100k", "nginx limit_req, 16m zone keyed by X-Key, 100 000 keys",
                 base + "/lrh", keys, ("100000",)),
                ("redis-10k-m", "module, Redis zone 6000r/m, 10 000 keys (X-Key), each far below",
                 base + "/km", keys, ("10000",)),
                ("redis-10k-s", "module, Redis zone 100r/s, 10 000 keys (X-Key), each far below",
                 base + "/ks", keys, ("10000",)),
                ("redis-100k", "module, Redis zone 6000r/m (16m), 100 000 keys (X-Key)", base + "/kh",
                 keys, ("100000",)),
                ("strict-hot", "module, strict, one hot key (each request waits for Redis)",
                 base + "/st", stats, ()),
                ("strict-10k", "module, strict 6000r/m, 10 000 keys (X-Key)", base + "/sk", keys,
                 ("10000",)),
                ("breaker", "module, Redis zone, every request over 1r/d", base + "/x", stats, ()),
                ("ref-429", "reference: `return 429`, no limiter", base + "/z", stats, ()),
            ]
            if a.cases:
                only = set(a.cases.split(",")) | {"baseline"}
                unknown = only - {c[0] for c in cases}
                if unknown:
                    sys.exit(f"bench: no case {', '.join(sorted(unknown))}")
                cases = [c for c in cases if c[0] in only]
            h = http_conn(a_port)
            first = [h.get(b"/x").status for _ in range(3)]
            h.close()
            time.sleep(0.5)  # let Redis confirm and open the breaker
            if first[0] != 200 or 200 in first[1:]:
                ODDITIES.append(f"breaker pre-warm (1r/d) answered {first}, expected 200 then 429s")
            runs = {name: [] for name, *_ in cases}
            for rnd in range(rounds):
                # alternate the order so that a drift of the machine cancels out
                order = cases if rnd % 2 == 0 else cases[::-1]
                for name, desc, url, script, args in order:
                    log(f"throughput: {name} (round {rnd + 1}/{rounds})")
                    cpu = None if url.startswith(c_base) else cpu_wrk
                    wrk(url, 32, 1, script, cpu, args)  # warm-up
                    time.sleep(0.3)
                    before, cpu0, calls0 = redis.commands(), redis_cpu(redis), script_calls(redis)
                    zone = {"strict-hot": "st", "strict-10k": "sk"}.get(name)
                    rtt0 = zone_rtt(a_port, zone) if zone else None
                    server = nc if url.startswith(c_base) else na
                    w0 = workers_cpu(server)
                    r = wrk(url, 32, duration, script, cpu, args)
                    r["worker_cpu"] = tuple(b - a for a, b in zip(w0, workers_cpu(server)))
                    if zone:
                        rtt1 = zone_rtt(a_port, zone)
                        r["rtt"] = (rtt1[1] - rtt0[1]) / max(rtt1[0] - rtt0[0], 1)
                    # the background thread flushes what it queued; counts far from
                    # their limit wait up to hold= (5 s) first: they belong to this
                    # case's commands, not the next one's
                    time.sleep(HOLD_S + 0.5 if name.startswith("redis") else 0.5)
                    r["cmds"] = redis.commands() - before
                    r["calls"] = script_calls(redis) - calls0
                    r["redis_cpu"] = redis_cpu(redis) - cpu0
                    runs[name].append(r)
                    na.check_workers(name)
                    nc.check_workers(name)
            res = {}
            for name, rs in runs.items():
                best = dict(max(rs, key=lambda r: r["rps"]))
                # Redis commands per allowed request over every round
                best["cmds"] = sum(r["cmds"] for r in rs)
                best["calls"] = sum(r["calls"] for r in rs)
                best["redis_cpu"] = sum(r["redis_cpu"] for r in rs)
                best["allowed_all"] = sum(r["allowed"] for r in rs)
                # the workers' CPU per request served, over every round
                served = max(sum(r["requests"] for r in rs), 1)
                best["worker_us"] = tuple(1e6 * sum(r["worker_cpu"][i] for r in rs) / served
                                          for i in (0, 1))
                best["spread"] = (max(r["rps"] for r in rs) - min(r["rps"] for r in rs)) / best["rps"]
                res[name] = best

            if a.cases:
                return print_cases(res, cases)
            log("shared memory per key")
            zone_bytes = 1 << 20
            per_key, cap, probe_m = shm_bytes_per_key(a_port, zone_bytes)

            b = res["baseline"]["rps"]
            b_p50 = res["baseline"]["p50_us"]
            rtt_us = redis_rtt_us(redis_port)
            rows = []
            for name, desc, _, _, _ in cases:
                r = res[name]
                ratio = r["rps"] / b
                if r["allowed_all"]:
                    cpa = f"{r['cmds'] / r['allowed_all']:.4f}"
                    cpu_k = f"{1e6 * r['redis_cpu'] / r['allowed_all']:.1f}"
                else:
                    cpa = f"n/a (0 allowed, {r['cmds']} cmds)"
                    cpu_k = "n/a"
                cp = r["cmds"] / max(r["allowed_all"], 1)
                targets = []
                if name == "embedded":
                    v = r["rps"] / res["limit_req"]["rps"]
                    targets.append((f"÷ limit_req = {v:.2f} ≥ 1.00", v >= 1.00))
                elif name in ("redis-hot", "redis-hot-2w"):
                    targets.append((f"÷ baseline ≥ 0.95", ratio >= 0.95))
                    targets.append((f"cmds/allowed ≤ 0.05", cp <= 0.05))
                elif name in ("redis-10k-m", "redis-10k-s"):
                    v = r["rps"] / res["limit_req-10k"]["rps"]
                    targets.append((f"÷ limit_req-10k = {v:.2f} ≥ 0.95", v >= 0.95))
                    most = 0.05 if name == "redis-10k-m" else 0.15
                    targets.append((f"cmds/allowed ≤ {most}", cp <= most))
                elif name == "redis-100k":
                    v = r["rps"] / res["limit_req-100k"]["rps"]
                    targets.append((f"÷ limit_req-100k = {v:.2f} ≥ 0.95", v >= 0.95))
                elif name in ("strict-hot", "strict-10k"):
                    # one round trip: the mean of the zone's own pipelines in this
                    # case (a bare PING on an idle connection: rtt_us)
                    added = r["p50_us"] - b_p50
                    rtt = r.get("rtt", 0) * 1e6
                    targets.append((f"÷ baseline ≥ 0.5", ratio >= 0.5))
                    targets.append((f"p50 +{added / 1000:.2f} ms ≤ 1 round trip ({rtt / 1000:.2f} ms "
                                    f"under this load; idle PING {rtt_us / 1000:.2f} ms)", added <= rtt))
                    targets.append((f"(script calls / allowed {r['calls'] / max(r['allowed_all'], 1):.3f})",
                                    None))
                elif name == "breaker":
                    targets.append((f"÷ baseline ≥ 1.00", ratio >= 1.00))
                    targets.append((f"(÷ ref-429 = {r['rps'] / res['ref-429']['rps']:.2f})", None))
                notes = []
                if name == "breaker" and r["allowed"]:
                    notes.append(f"{r['allowed']} allowed!")
                if r["sock_errors"]:
                    notes.append(f"{r['sock_errors']} socket errors")
                if name not in ("breaker", "ref-429") and r["non2xx"]:
                    notes.append(f"{int(r['non2xx'])} non-2xx!")
                label = f"{name}: {desc}" + (f" ({'; '.join(notes)})" if notes else "")
                rps = f"{r['rps']:,.0f}" + (f" (±{r['spread'] * 50:.0f}%)" if rounds > 1 else "")
                wu, ws = r["worker_us"]
                rows.append([label, rps, ms(r["p50_us"]), ms(r["p99_us"]),
                             f"{ratio:.3f}", f"{wu:.1f} + {ws:.1f}", cpa, cpu_k,
                             "; ".join(t for t, _ in targets) or "—",
                             " ".join(mark(ok) for _, ok in targets if ok is not None)])
            rows.append(["reference (not run here): a Lua limiter in the OpenResty style deciding in "
                         "Redis per request (synchronous), measured on this 2-core machine", "", "", "", "0.34", "", "2.0", "", "", ""])
            rows.append([f"shared memory per key (zone=1m holds {cap} keys; probe M={probe_m})",
                         "", "", "", "", "", "", "", f"{per_key:.1f} B ≤ 128", mark(per_key <= 128)])
            print("## Throughput")
            print()
            na.check_workers("shm probe")
            print(table(["case", "req/s", "p50", "p99", "÷ baseline",
                         "nginx worker CPU µs / request (user + system)", "Redis cmds / allowed",
                         "Redis CPU ms / 1000 allowed", "target", "✓/✗"], rows))
            print()
            sys.stdout.flush()

            # ---- Redis cost once the keys are known ---------------------------------
            # a 5 s case is mostly each key's first counts (a new counter: INCRBY
            # and EXPIRE, the previous window read); here the same traffic runs
            # on after a warm-up, and the commands Redis gets while it runs are
            # counted against the requests it serves meanwhile
            log("steady state: 10 000 keys, counted after a warm-up")
            srows = []
            for name, path, target in (("redis-10k-m", "/km", 0.05), ("redis-10k-s", "/ks", 0.15)):
                wrk(base + path, 32, STEADY_WARM_S, keys, cpu_wrk, ("10000",))
                before, cpu0 = redis.commands(), redis_cpu(redis)
                by0 = {c: int(d.get("calls", 0)) for c, d in redis.commandstats().items()}
                r = wrk(base + path, 32, STEADY_S, keys, cpu_wrk, ("10000",))
                # the commands of the same interval as the requests: in a steady
                # state counts held over its start and over its end balance out
                cmds, cpu = redis.commands() - before, redis_cpu(redis) - cpu0
                by = {c: int(d.get("calls", 0)) - by0.get(c, 0)
                      for c, d in redis.commandstats().items() if c != "info"}
                mix = ", ".join(f"{c.upper()} {n / max(r['allowed'], 1):.3f}"
                                for c, n in sorted(by.items(), key=lambda x: -x[1]) if n)
                na.check_workers(name + " steady")
                v = cmds / max(r["allowed"], 1)
                srows.append([f"{name}: {STEADY_S} s after {STEADY_WARM_S} s of the same traffic ({mix})",
                              f"{r['rps']:,.0f}", f"{int(r['allowed']):,}", f"{v:.4f}",
                              f"{1e6 * cpu / max(r['allowed'], 1):.1f}", f"≤ {target}", mark(v <= target)])
            print("## Redis cost once the keys are known (steady state)")
            print()
            print(table(["case", "req/s", "allowed", "Redis cmds / allowed", "Redis CPU ms / 1000 allowed",
                         "target", "✓/✗"], srows))
            print()
            sys.stdout.flush()

        else:
            rtt_us = redis_rtt_us(redis_port)

        # ---- strict latency at low load ----------------------------------------
        # wrk's 32 connections keep nginx saturated, so its p50 is mostly
        # queueing (32 / req/s); what a strict limit adds to one request is
        # measured here: one keep-alive connection, requests one after another
        log("strict latency: one connection, sequential requests")
        lrows = []
        lat_b = latency_probe(a_port, "/b")
        for label, path, zone, keyed in (("strict-hot", "/st", "st", False),
                                         ("strict-10k", "/sk", "sk", True)):
            rtt0 = zone_rtt(a_port, zone)
            lat = latency_probe(a_port, path, keyed=keyed)
            rtt1 = zone_rtt(a_port, zone)
            rtt = (rtt1[1] - rtt0[1]) / max(rtt1[0] - rtt0[0], 1) * 1e6
            added = lat[0] - lat_b[0]
            lrows.append([f"{label}: one connection, {LATENCY_N} requests", f"{lat_b[0]:.0f} µs",
                          f"{lat[0]:.0f} µs", f"{lat[1]:.0f} µs", f"+{added:.0f} µs",
                          f"{rtt:.0f} µs (idle PING {rtt_us:.0f} µs)",
                          "added ≤ 1 round trip", mark(added <= rtt)])
        print("## Strict mode: latency one request sees")
        print()
        print(table(["case", "baseline p50", "p50", "p99", "added to p50",
                     "the zone's Redis round trip (mean)", "target", "✓/✗"], lrows))
        print()
        sys.stdout.flush()

    # ---- accuracy -----------------------------------------------------------
    if pin:
        os.sched_setaffinity(redis.popen.pid, range(os.cpu_count() or 1))
    if not a.skip_accuracy and not a.latency_only:
        arows = []
        stamp = int(time.time())

        log("accuracy: single-node flood")
        # a and b each flood a fresh key for 3 s inside one minute window:
        # start both before second 50 of the minute
        wait_minute_safe(45)
        r = wrk(f"{base}/a?k=one-{stamp}", 64, 3, stats, cpu_wrk)
        v = r["allowed"] / 1000
        na.check_workers("single-node flood")
        arows.append(["a. single node, fresh key, 64 conns flood 3 s", "1000r/m",
                      f"{int(r['requests']):,}", r["allowed"], f"{v:.3f}", "≤ 1.02",
                      mark(v <= 1.02)])

        def flood(row, nodes, conns, target):
            """Every node floods one fresh key of 1000r/m for 3 s."""
            n = len(nodes)
            words = {2: "two", 4: "four"}
            log(f"accuracy: {words[n]}-node flood")
            wait_minute_safe(50)
            rs = flood_once(nodes, conns, f"{words[n]}-{stamp}", f"{words[n]}-node flood")
            tot = sum(r["allowed"] for r in rs)
            v = tot / 1000
            arows.append([f"{row}. {words[n]} nodes, same key, {n}×{conns} conns flood 3 s "
                          f"({' + '.join(str(r['allowed']) for r in rs)})", "1000r/m",
                          f"{int(sum(r['requests'] for r in rs)):,}", tot, f"{v:.3f}",
                          f"≤ {target:.2f}", mark(v <= target)])

        flood("b", [na, nb], 32, 1.05)

        log("accuracy: steady 2x overload (10 s)")
        sent, allowed, lag = paced(a_port, f"/s?k=steady-{stamp}".encode(), 400, 10)
        v = allowed / 10 / 200
        na.check_workers("steady overload")
        arows.append([f"c. steady 2× overload: 400 req/s paced for 10 s, from a window start "
                      f"(sent {sent}, max lag {lag * 1000:.1f} ms)", "200r/s",
                      f"{sent:,}", allowed, f"{v:.3f} (rate ÷ L)", "0.97–1.03",
                      mark(0.97 <= v <= 1.03)])

        flood("d", [na, nb, nc, nd], 16, 1.05)

        log("accuracy: four nodes at 40 % of the limit each (10 s)")
        ports = (a_port, b_port, c_port, d_port)
        out = paced_all(ports, f"/s?k=share-{stamp}".encode(), 80, 10, "four-node 40 % case")
        sent = sum(o[0] for o in out)
        allowed = sum(o[1] for o in out)
        v = allowed / 10 / 200
        arows.append([f"e. four nodes, one key, each paced at 40 % of the limit (80 req/s) for 10 s, "
                      f"160 % together (sent {sent}, max lag {max(o[2] for o in out) * 1000:.1f} ms)",
                      "200r/s", f"{sent:,}", allowed, f"{v:.3f} (rate ÷ L)", "≤ 1.05",
                      mark(v <= 1.05)])

        log("accuracy: four nodes while their Redis is down (on_error=share)")
        deadline = time.time() + 15
        while time.time() < deadline and any(share_figures(p)["nodes"] != 4 for p in ports):
            time.sleep(0.2)
        known = [share_figures(p)["nodes"] for p in ports]
        outage.stop(quick=True, sig=signal.SIGKILL)
        deadline = time.time() + 15
        while time.time() < deadline and any(share_figures(p)["up"] for p in ports):
            time.sleep(0.2)
        out = paced_all(ports, f"/sh?k=outage-{stamp}".encode(), 40, 5, "outage case")
        sent = sum(o[0] for o in out)
        allowed = sum(o[1] for o in out)
        v = allowed / 400
        arows.append([f"f. four nodes (N learnt: {known}), their Redis killed (SIGKILL), on_error=share: "
                      f"a key first seen during the outage, each node paced at 40 req/s for 5 s "
                      f"({' + '.join(str(o[1]) for o in out)})",
                      "400r/h", f"{sent:,}", allowed, f"{v:.3f}", "≤ 1.25", mark(v <= 1.25)])

        print("## Accuracy")
        print()
        print(table(["case", "limit L", "requests", "allowed", "allowed ÷ L", "target", "✓/✗"],
                    arows))
        print()
        sys.stdout.flush()

    # ---- sanity: workers and error logs -----------------------------------
    for o in ODDITIES:
        print(f"NOTE: {o}")
    for n in (na, nb, nc, nd):
        lines = n.error_lines()
        if lines:
            print(f"nginx {n.name} error.log: {len(lines)} line(s) at level error or above; last:")
            for l in lines[-5:]:
                print(f"    {l}")
            print()
    stop_all()  # before cargo: free the CPUs

    # ---- trace simulation -----------------------------------------------------
    rc = 0
    if a.trace:
        log("trace simulation: cargo test --release -p ratelimit-core --test trace_sim")
        print("## Trace simulation (counter::check over simulated traffic vs an exact sliding log)")
        print()
        p = subprocess.run(["cargo", "test", "--release", "-p", "ratelimit-core", "--test", "trace_sim", "--",
                            "--nocapture", "--exact", "trace_simulation"],
                           cwd=ROOT, capture_output=True, text=True)
        keep = [l for l in p.stdout.splitlines()
                if l.startswith(("|", "trace simulation", "wr.allow", "wrong decisions",
                                 "test ", "thread"))]
        print("\n".join(keep) if keep else p.stdout)
        if p.returncode != 0:
            print("```")
            print(p.stderr[-3000:])
            print("```")
            rc = 1
        print()
    print(f"(whole run: {time.time() - t_start:.0f} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
