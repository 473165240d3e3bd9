"""Black-box scenarios for Redis Cluster backends (3 masters + 3 replicas,
started per test by cluster.Cluster; every process stopped by its pid).

Each test states the bound it asserts; figures are printed as notes.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time

from harness import HOST, ms, percentile, wait_for, window
from cluster import REDIS_CLI, Cluster, keyslot
from test_redis import recording_get, until_denied

NASTY_RE = r"\[(alert|crit|emerg)\]|exited on signal|panick"
# a failure of the whole backend (its URLs), or of one master of a cluster
# whose topology is known (`sending to Redis Cluster master host:port of
# URLs failed`)
FAIL_RE = r'\[error\].*redis_ratelimit: zone "%s": (?:connecting to|sending to) (?:Redis Cluster master \S+ of )?\S+ failed: '
PREFIX = "sc:"
# (ii): how many 500-slot reshards (alternately there and back), 2 s apart;
# SCENARIO_RESHARDS=10 makes it a stress test
RESHARDS = int(os.environ.get("SCENARIO_RESHARDS", "2"))


def czone(c, name, extra=""):
    # hold=0: these tests look at what reaches the cluster right after a
    # request (test_sync.py tests the hold)
    return "    redis_ratelimit_zone $arg_k zone=%s:1m redis=%s cluster prefix=%s hold=0 %s;\n" % (
        name, c.urls(), PREFIX, extra)


def loc(path, body):
    return "        location = %s { %s }\n" % (path, body)


def rkeys(zone, key, period, t0, t1=None):
    """The Redis keys of (zone, key) for the windows between t0 and t1."""
    ws = {window(t0, period), window(t1 if t1 is not None else time.time(), period)}
    return ["%s{%s:%s}:%d:%d" % (PREFIX, zone, key, period, w) for w in sorted(ws)]


def counted(c, zone, keys, period, t0):
    """{key: total over its windows} read from the masters owning the slots."""
    names = {k: rkeys(zone, k, period, t0) for k in keys}
    vals = c.get_many([n for ns in names.values() for n in ns])
    return {k: sum(vals[n] or 0 for n in ns) for k, ns in names.items()}


def keys_around(h, c, victim, base):
    """3 keys (of zone "cz") on each master: (the victim's, the others')."""
    by_owner, i = {}, 0
    while len(by_owner) < 3 or min(len(v) for v in by_owner.values()) < 3:
        k = h.key("%s%d" % (base, i))
        i += 1
        own = c.owner_of_slot(keyslot("cz:" + k))
        if len(by_owner.setdefault(own, [])) < 3:
            by_owner[own].append(k)
    return by_owner[victim], [k for p, ks in by_owner.items() if p != victim for k in ks]


def nasty(ng):
    return [l for l in ng.error_log_text().splitlines() if re.search(NASTY_RE, l)]


def fail_lines(ng, zone_name):
    """The error lines about this zone's backend, from "redis_ratelimit:" on."""
    return [l[l.find("redis_ratelimit:"):] for l in ng.error_log_text().splitlines()
            if re.search(FAIL_RE % re.escape(zone_name), l)]


def err_msgs(lines):
    """The distinct messages of error lines (after "failed: ")."""
    return sorted(set(re.sub(r" \(\d+ more errors.*", "", l.split(" failed: ", 1)[-1])[:150] for l in lines))


def counts_str(xs):
    d = {}
    for x in xs:
        d[x] = d.get(x, 0) + 1
    return ", ".join("%s x %d" % (k, v) for k, v in sorted(d.items(), key=lambda kv: str(kv[0])))


class Traffic:
    """Background threads sending GETs continuously, paced to `rate` req/s
    in total; records (start time, label, status, latency)."""

    def __init__(self, targets, rate=300, threads=2):
        self.targets = targets          # list of (nginx, path, label)
        self.rate = rate
        self.nthreads = threads
        self.stop_ev = threading.Event()
        self.log = []
        self.lock = threading.Lock()
        self.threads = []

    def start(self):
        per = self.nthreads / float(self.rate)

        def run(tid):
            i = tid
            nxt = time.monotonic()
            while not self.stop_ev.is_set():
                ng, path, label = self.targets[i % len(self.targets)]
                i += self.nthreads
                t = time.monotonic()
                st, el = ng.get(path)
                with self.lock:
                    self.log.append((t, label, st, el))
                nxt += per
                d = nxt - time.monotonic()
                if d > 0:
                    time.sleep(d)
                else:
                    nxt = time.monotonic()

        self.threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(self.nthreads)]
        for t in self.threads:
            t.start()
        return self

    def stop(self):
        self.stop_ev.set()
        for t in self.threads:
            t.join(5)


# ---------------------------------------------------------------------------
# (i) a master is SIGKILLed during traffic
# ---------------------------------------------------------------------------

def test_master_killed_failover(h):
    """SIGKILL of a master (a seed URL) under ~300 req/s over 9 keys (3 per
    master): its replica takes over; new increments for keys on its slots land
    in the cluster again <= 10 s after the kill; every answer 200 and < 100 ms;
    no [alert]/[crit]/"exited on signal"; <= 1 error line per second + 2."""
    c = Cluster(h).start()
    ng = h.nginx(czone(c, "cz"), loc("/t", "redis_ratelimit cz 1000000r/h;"))
    victim = c.ports[1]                 # a master, and the 2nd seed URL
    h.check(victim in [m["port"] for m in c.masters()], "node 2 is not a master: %s" % c.masters())
    replica = c.replica_of(victim)
    vkeys, okeys = keys_around(h, c, victim, "fo")
    keys = vkeys + okeys
    t_begin = time.time()
    for k in keys:
        h.check(ng.get("/t?k=" + k)[0] == 200, "warm-up request failed")
    h.check(wait_for(lambda: all(v == 1 for v in counted(c, "cz", keys, 3600, t_begin).values()), 3.0),
            "warm-up counts not in the cluster within 3 s: %s" % counted(c, "cz", keys, 3600, t_begin))

    tr = Traffic([(ng, "/t?k=" + k, k) for k in keys], rate=300, threads=2).start()
    try:
        time.sleep(2.0)
        vnames = [n for k in vkeys for n in rkeys("cz", k, 3600, t_begin)]
        c.kill(victim)
        t_kill = time.monotonic()
        base = sum(v or 0 for v in c.read_on(replica, vnames).values())
        promoted = ok_again = recovered = None
        other_prev, other_last_rise, other_gap = None, t_kill, 0.0
        while time.monotonic() - t_kill < 12.0:
            now = time.monotonic()
            if promoted is None:
                try:
                    if c.node(replica).cmd("ROLE", timeout=0.5)[0] == "master":
                        promoted = now - t_kill
                except OSError:
                    pass
            if ok_again is None and promoted is not None and c.is_ok(replica):
                ok_again = now - t_kill
            try:
                vsum = sum(v or 0 for v in c.read_on(replica, vnames).values())
                if recovered is None and vsum > base:
                    recovered = now - t_kill
                osum = sum(counted(c, "cz", okeys, 3600, t_begin).values())
                if other_prev is not None and osum > other_prev:
                    other_gap = max(other_gap, now - other_last_rise)
                    other_last_rise = now
                other_prev = osum
            except OSError:
                pass
            if recovered is not None and now - t_kill > max(7.0, recovered + 1.5):
                break
            time.sleep(0.05)
        t_end = time.monotonic()
    finally:
        tr.stop()
    log = list(tr.log)
    lat = [x[3] for x in log]
    sts = [x[2] for x in log]
    bad = [x for x in log if x[2] != 200]
    allowed = {k: sum(1 for x in log if x[1] == k and x[2] == 200) + 1 for k in keys}   # + warm-up
    time.sleep(1.5)
    final = counted(c, "cz", keys, 3600, t_begin)
    va = sum(allowed[k] for k in vkeys)
    vc = sum(final[k] for k in vkeys)
    oa = sum(allowed[k] for k in okeys)
    oc = sum(final[k] for k in okeys)
    errs = fail_lines(ng, "cz")
    span = t_end - t_kill
    h.note("victim :%d (replica :%d); %d requests over %.1fs (%.0f req/s): %s" % (
        victim, replica, len(log), log[-1][0] - log[0][0] if log else 0,
        len(log) / max(0.001, (log[-1][0] - log[0][0])) if log else 0, counts_str(sts)))
    h.note("after the kill: replica promoted %s, cluster_state ok on it %s, module's increments for the "
           "victim's keys land again %s" % tuple("%.2fs" % x if x is not None else "never"
                                                 for x in (promoted, ok_again, recovered)))
    h.note("keys on the other masters: longest stall of their counts after the kill %.2fs" % other_gap)
    h.note("latency: max %s, p99 %s, p50 %s" % (ms(max(lat) if lat else None), ms(percentile(lat, 99)),
                                               ms(percentile(lat, 50))))
    h.note("allowed vs counted in the cluster: victim's keys %d vs %d (%+d), other keys %d vs %d (%+d)"
           % (va, vc, vc - va, oa, oc, oc - oa))
    h.note("redis_ratelimit error lines: %d in %.1fs; messages: %s" % (len(errs), span, err_msgs(errs)))
    h.expect(recovered is not None and recovered <= 10.0,
             "increments for the killed master's keys did not land in the cluster within 10 s of the kill "
             "(recovered: %s)" % recovered)
    h.expect(len(log) >= 1500, "too little traffic: %d requests" % len(log))
    h.expect(not bad, "%d answers other than 200, e.g. %s" % (len(bad), bad[:5]))
    h.expect(lat and max(lat) < 0.100, "a request took %s (bound 100 ms)" % ms(max(lat) if lat else None))
    h.expect(not nasty(ng), "error.log: %s" % nasty(ng)[:5])
    h.expect(len(errs) <= int(span) + 2, "%d error lines in %.1fs (bound 1/s + 2)" % (len(errs), span))


test_master_killed_failover.timeout = 45


# ---------------------------------------------------------------------------
# (ii) slots resharded during traffic
# ---------------------------------------------------------------------------

def test_reshard_under_traffic(h):
    """Two nginx nodes; slots 0-499 moved to another master with `redis-cli
    --cluster reshard ... --cluster-slots 500` at t=0.8 s, and back at t=2.8 s
    (SCENARIO_RESHARDS), under ~300 req/s on 200 keys in those slots, while 6
    keys of 20r/h in those slots are hammered (30 requests each, 50 ms apart,
    alternately on both nodes; key j starts at t=0.5*j s, so they are counting
    before, during and after the moves): no 5xx or failed request; each 20r/h
    key gets <= 20 x 200 (and exactly 20), and its count in the cluster equals
    what was allowed; <= 1 redis error line per node per reshard; no
    [alert]/[crit]."""
    c = Cluster(h).start()
    # a move takes about 0.5 s, the default timeout=: a wait through a
    # slow one would be decided by on_error, which is not what this test
    # is about (test_faults.py and test_strict.py are)
    http = czone(c, "cz", "timeout=3s")
    server = (loc("/t", "redis_ratelimit cz 20r/h;") + loc("/bg", "redis_ratelimit cz 1000000r/h;")
              + loc("/metrics", "redis_ratelimit_metrics;"))
    files = {"t": "ok\n", "bg": "ok\n"}
    a = h.nginx(http, server, files=files)
    b = h.nginx(http, server, files=files)
    masters = c.masters()
    src = next(m for m in masters if m["slots"][0][0] == 0)
    dst = next(m for m in masters if m is not src)

    def in_moving(k):
        return keyslot("cz:" + k) < 500

    gen = (h.key("k%d" % i) for i in range(100000))
    hot = []
    bg = []
    while len(hot) < 6 or len(bg) < 200:
        k = next(gen)
        if in_moving(k):
            (hot if len(hot) < 6 else bg).append(k)
    t_begin = time.time()
    res = a.burst(["/bg?k=" + k for k in bg], threads=16)
    h.check(res == [200] * len(bg), "pre-fill: %s" % counts_str(res))
    h.check(wait_for(lambda: sum(counted(c, "cz", bg, 3600, t_begin).values()) == len(bg), 3.0),
            "pre-fill counts not in the cluster within 3 s")

    tr = Traffic([(ng, "/bg?k=" + k, k) for k in bg for ng in (a, b)], rate=300, threads=2).start()
    hot_log = {k: [] for k in hot}
    t0 = time.monotonic()

    def hammer(j, k):
        time.sleep(max(0.0, t0 + 0.5 * j - time.monotonic()))
        for n in range(30):
            ng = (a, b)[n % 2]
            st, el = ng.get("/t?k=" + k)
            hot_log[k].append(("AB"[n % 2], st, el, time.monotonic() - t0))
            time.sleep(0.05)

    hts = [threading.Thread(target=hammer, args=(j, k), daemon=True) for j, k in enumerate(hot)]
    reshards = []
    try:
        for t in hts:
            t.start()
        frm, to = src, dst
        for i in range(RESHARDS):
            time.sleep(max(0.0, t0 + 0.8 + 2.0 * i - time.monotonic()))
            s0 = time.monotonic()
            p = subprocess.run([REDIS_CLI, "--cluster", "reshard", "%s:%d" % (HOST, c.ports[0]),
                                "--cluster-from", frm["id"], "--cluster-to", to["id"],
                                "--cluster-slots", "500", "--cluster-yes"],
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=20)
            out = (p.stdout + p.stderr).decode("utf-8", "replace")
            reshards.append((frm["port"], to["port"], s0 - t0, time.monotonic() - s0))
            h.check(p.returncode == 0, "reshard %d -> %d failed (%d): %s" % (
                frm["port"], to["port"], p.returncode, out[-800:]))
            h.check(c.wait_ok(5.0), "cluster not ok after a reshard: %s" % c.states())
            frm, to = to, frm
        for t in hts:
            t.join(10)
        time.sleep(0.3)
    finally:
        tr.stop()
    moved_to = c.owner_of_slot(0)
    log = list(tr.log)
    bad = [x for x in log if x[2] != 200]
    lat = [x[3] for x in log] + [x[2] for v in hot_log.values() for x in v]
    time.sleep(1.0)
    hot_counts = counted(c, "cz", hot, 3600, t_begin)
    bg_counts = counted(c, "cz", bg, 3600, t_begin)
    bg_allowed = sum(1 for x in log if x[2] == 200) + len(bg)
    h.note("%d reshard(s) of slots 0-499: %s; slot 0 now on :%d" % (
        len(reshards), ", ".join(":%d -> :%d at t=%.2fs, took %.2fs" % r for r in reshards), moved_to))
    h.note("background: %d requests: %s; max latency %s; allowed %d vs counted in the cluster %d (%+d)" % (
        len(log), counts_str([x[2] for x in log]), ms(max(lat) if lat else None), bg_allowed,
        sum(bg_counts.values()), sum(bg_counts.values()) - bg_allowed))
    for k in hot:
        sts = [x[1] for x in hot_log[k]]
        h.note("20r/h key %s (t=%.1f-%.1fs): %d x 200 (A %d, B %d), %s; count in the cluster %d" % (
            k, hot_log[k][0][3], hot_log[k][-1][3], sts.count(200), sum(1 for x in hot_log[k] if x[0] == "A" and x[1] == 200),
            sum(1 for x in hot_log[k] if x[0] == "B" and x[1] == 200), counts_str(sts), hot_counts[k]))
    ea, eb = fail_lines(a, "cz"), fail_lines(b, "cz")
    h.note("redis_ratelimit error lines: node A %d, node B %d; messages: %s" % (len(ea), len(eb), err_msgs(ea + eb)))
    h.note("strict (small limits decided in the cluster) on A and B: %s; refused keys: %s" % (
        [json.loads(ng.request("/metrics?format=json")[2])["zones"]["cz"]["redis"]["strict"] for ng in (a, b)],
        [l[l.find("refused"):][:160] for ng in (a, b) for l in ng.error_log_text().splitlines() if "refused" in l][:4]))
    # afterwards: does each node's backend count again?
    fresh = h.key("after")
    after = [ng.get("/bg?k=%s-%s" % (fresh, ng.name))[0] for ng in (a, b)]
    landed = wait_for(lambda: all(v == 1 for v in counted(
        c, "cz", ["%s-%s" % (fresh, ng.name) for ng in (a, b)], 3600, t_begin).values()), 3.0)
    h.note("after the reshards: a fresh key on each node -> %s, counted in the cluster within 3 s: %s" % (
        after, counted(c, "cz", ["%s-%s" % (fresh, ng.name) for ng in (a, b)], 3600, t_begin)))
    h.expect(landed, "after the reshards, a fresh key's count did not land in the cluster within 3 s "
             "(a backend still down?)")
    h.expect(not bad, "%d background answers other than 200, e.g. %s" % (len(bad), bad[:5]))
    for k in hot:
        sts = [x[1] for x in hot_log[k]]
        odd = [s for s in sts if s not in (200, 429)]
        h.expect(not odd, "20r/h key %s: answers other than 200/429: %s" % (k, odd[:5]))
        h.expect(sts.count(200) <= 20, "20r/h key %s: %d x 200 (bound 20)" % (k, sts.count(200)))
        h.expect(sts.count(200) == 20, "20r/h key %s: %d x 200, expected exactly 20 of 30" % (k, sts.count(200)))
        h.expect(hot_counts[k] == sts.count(200), "20r/h key %s: count in the cluster %d != allowed %d"
                 % (k, hot_counts[k], sts.count(200)))
    h.expect(len(ea) <= len(reshards) and len(eb) <= len(reshards),
             "error lines: A %d, B %d (bound %d each: 1 per reshard)" % (len(ea), len(eb), len(reshards)))
    for ng in (a, b):
        h.expect(not nasty(ng), "%s error.log: %s" % (ng.name, nasty(ng)[:5]))


test_reshard_under_traffic.timeout = 45


# ---------------------------------------------------------------------------
# (iii) the whole cluster down, then back
# ---------------------------------------------------------------------------

def test_whole_cluster_down_and_back(h):
    """All 6 nodes stopped by pid for ~3 s: every answer < 100 ms; local:
    fresh key 5r/h -> 5 x 200 then 429; allow: 20 x 200 at 5r/h; deny: first
    429 within 2 s, then only 429; <= 1 error line per zone per second + 2.
    The 6 nodes restarted on the same ports (nodes.conf kept): the cluster
    reforms, and a new key's count appears in the cluster <= 8 s after
    cluster_state:ok (each zone), and recovery is logged (by the backend or
    each master that failed, never more often than failures were)."""
    c = Cluster(h).start()
    zones = ("zl", "za", "zd")
    http = czone(c, "zl", "on_error=local") + czone(c, "za", "on_error=allow") + czone(c, "zd", "on_error=deny")
    server = (loc("/l", "redis_ratelimit zl 5r/h;") + loc("/a", "redis_ratelimit za 5r/h;")
              + loc("/d", "redis_ratelimit zd 5r/h;"))
    ng = h.nginx(http, server, files={"l": "l\n", "a": "a\n", "d": "d\n"})
    t_begin = time.time()
    paths = {"zl": "/l", "za": "/a", "zd": "/d"}
    for z in zones:
        h.check(ng.get(paths[z] + "?k=warm")[0] == 200, "healthy %s: warm-up failed" % z)
    h.check(wait_for(lambda: all(counted(c, z, ["warm"], 3600, t_begin)["warm"] == 1 for z in zones), 3.0),
            "healthy: warm-up counts not in the cluster within 3 s")

    c.stop_all()
    t_stop = time.monotonic()
    get, lat, odd = recording_get(ng)
    seen = until_denied(get, t_stop)
    deny_after = time.monotonic() - t_stop
    h.note("deny: %d answer(s) before the first 429 (%.0f ms after the stop)" % (len(seen) - 1, deny_after * 1000))
    h.check(seen and seen[-1] == 429, "deny: no 429 within 2 s of the cluster going down: %s" % seen[-10:])
    local = [get("/l?k=" + h.key("local")) for _ in range(8)]
    allow = [get("/a?k=" + h.key("allow")) for _ in range(20)]
    deny = [get("/d?k=%s-%d" % (h.key("deny"), j)) for j in range(10)]
    h.note("down: local %s | allow %s | deny %s" % (counts_str(local), counts_str(allow), counts_str(deny)))
    h.expect(local == [200] * 5 + [429] * 3, "on_error=local, 5r/h: expected 5 x 200 then 429, got %s" % local)
    h.expect(allow == [200] * 20, "on_error=allow: expected 20 x 200, got %s" % counts_str(allow))
    h.expect(deny == [429] * 10, "on_error=deny: expected only 429, got %s" % counts_str(deny))
    j = 0
    while time.monotonic() - t_stop < 3.0:
        for p in ("l", "a", "d"):
            get("/%s?k=out-%d" % (p, j))
        j += 1
        time.sleep(0.02)
    h.note("down: %d requests, max latency %s, p50 %s" % (len(lat), ms(max(lat)), ms(percentile(lat, 50))))
    h.expect(max(lat) < 0.100, "a request took %s while the cluster was down (bound 100 ms)" % ms(max(lat)))

    t_restart = time.monotonic()
    c.restart_all(timeout=20.0)
    t_ok = time.monotonic()
    landed = {}
    key = h.key("after")
    n = 0
    while time.monotonic() - t_ok < 10.0 and len(landed) < 3:
        for z in zones:
            if z not in landed:
                get("%s?k=%s-%d" % (paths[z], key, n))
        for z in zones:
            if z not in landed and any(v for v in counted(c, z, ["%s-%d" % (key, m) for m in range(n + 1)],
                                                          3600, t_begin).values()):
                landed[z] = time.monotonic() - t_ok
        n += 1
        time.sleep(0.1)
    text = ng.error_log_text()
    outage = t_ok - t_stop
    h.note("cluster restarted: cluster_state:ok on all 6 after %.2fs; a new key's count in the cluster "
           "after cluster ok: %s" % (t_ok - t_restart, ", ".join("%s %.2fs" % (z, landed[z]) if z in landed
                                                                 else "%s never (10 s)" % z for z in zones)))
    span = time.monotonic() - t_stop
    errs = {z: len(fail_lines(ng, z)) for z in zones}
    notices = {z: len(re.findall(r'\[error\].*redis_ratelimit: zone "%s": Redis (?:Cluster master )?\S+ is reachable again'
                                 % z, text))
               for z in zones}
    h.note("error lines per zone %s in %.1fs (outage %.1fs); recovery notices %s; messages: %s" % (
        errs, span, outage, notices, err_msgs(sum((fail_lines(ng, z) for z in zones), []))))
    after = {z: get("%s?k=%s" % (paths[z], h.key("final"))) for z in zones}
    h.note("after recovery, a fresh key: %s" % after)
    h.expect(not odd, "answers other than 200/429: %s" % odd[:5])
    for z in zones:
        h.expect(z in landed and landed[z] <= 8.0, "zone %s: a new key's count not in the cluster within 8 s of "
                 "cluster_state:ok (%s)" % (z, landed.get(z)))
        h.expect(1 <= errs[z] <= int(span) + 2, "zone %s: %d error lines in %.1fs (bound 1..%d)"
                 % (z, errs[z], span, int(span) + 2))
        # the backend, or each master that failed, says it is back; a master
        # that answered while the cluster was still forming may fail and
        # come back once more: never more notices than failure reports
        h.expect(1 <= notices[z] <= max(1, errs[z]),
                 "zone %s: recovery logged %d times (expected 1..%d)" % (z, notices[z], max(1, errs[z])))
        h.expect(after[z] == 200, "zone %s after recovery: fresh key got %s" % (z, after[z]))
    h.expect(not nasty(ng), "error.log: %s" % nasty(ng)[:5])


test_whole_cluster_down_and_back.timeout = 60


# ---------------------------------------------------------------------------
# (iv) throughput and Redis commands per request: cluster vs single Redis
# ---------------------------------------------------------------------------

def _wrk(port, path, secs=3, conns=32):
    p = subprocess.run(["wrk", "-t1", "-c%d" % conns, "-d%ds" % secs, "http://%s:%d%s" % (HOST, port, path)],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=secs + 15)
    out = p.stdout.decode("utf-8", "replace")
    m = re.search(r"(\d+) requests in ([\d.]+)s", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: (.*)", out)
    lat = re.search(r"Latency\s+(\S+)\s+(\S+)\s+(\S+)", out)
    if not m or not rps:
        raise AssertionError("wrk output not understood: %s %s" % (out[-500:], p.stderr[-300:]))
    return {"requests": int(m.group(1)), "rps": float(rps.group(1)),
            "non2xx": int(non2xx.group(1)) if non2xx else 0, "sock": sock.group(1) if sock else "",
            "lat_avg": lat.group(1) if lat else "?", "lat_max": lat.group(3) if lat else "?"}


def test_throughput_cluster_vs_single(h):
    """3 s of `wrk -t1 -c32` on one hot key (limit never reached), one worker:
    local-only zone, single Redis, 3+3 cluster.  Figures only (not asserted,
    except: the load ran, every answer 2xx, counts landed)."""
    c = Cluster(h).start()
    r = h.redis()
    body = "redis_ratelimit z 100000000r/h;"
    ngl = h.nginx("    redis_ratelimit_zone $arg_k zone=z:1m;\n", loc("/t", body))
    ngs = h.nginx("    redis_ratelimit_zone $arg_k zone=z:1m redis=%s prefix=%s hold=0;\n" % (r.url, PREFIX),
                  loc("/t", body))
    ngc = h.nginx(czone(c, "z"), loc("/t", body))

    def single_stats():
        return {k: int(v.get("calls", 0)) for k, v in r.info_commandstats().items()
                if k not in ("info", "replconf", "psync", "sync")}

    rows = []
    for label, ng, stats in (("local only", ngl, None), ("single Redis", ngs, single_stats),
                             ("cluster 3+3", ngc, c.commandstats)):
        key = h.key("hot-" + label.split()[0])
        t_begin = time.time()
        before = stats() if stats else {}
        res = _wrk(ng.port, "/t?k=" + key)
        time.sleep(0.5)
        after = stats() if stats else {}
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        delta = {k: v for k, v in delta.items() if v}
        total = sum(delta.values())
        if label.startswith("cluster"):
            in_store = counted(c, "z", [key], 3600, t_begin)[key]
        elif stats:
            in_store = sum(int(r.cmd("GET", k) or 0) for k in rkeys("z", key, 3600, t_begin))
        else:
            in_store = None
        rows.append((label, res, total, delta, in_store))
        h.expect(res["requests"] > 1000, "%s: only %d requests" % (label, res["requests"]))
        h.expect(res["non2xx"] == 0 and not res["sock"], "%s: non-2xx %d, socket errors %s"
                 % (label, res["non2xx"], res["sock"] or "none"))
    base = rows[0][1]["rps"]
    for label, res, total, delta, in_store in rows:
        h.note("%-12s %8.0f req/s (%.2fx local), latency avg %s max %s; Redis commands %d = %.4f per request %s%s" % (
            label, res["rps"], res["rps"] / base, res["lat_avg"], res["lat_max"], total,
            total / float(res["requests"]),
            " ".join("%s=%d" % kv for kv in sorted(delta.items())) if delta else "",
            "; count in Redis %d of %d requests" % (in_store, res["requests"]) if in_store is not None else ""))
    for label, res, total, delta, in_store in rows[1:]:
        # wrk does not count the responses still in flight when it stops
        h.expect(res["requests"] <= in_store <= res["requests"] + 64,
                 "%s: count in Redis %s, but wrk got %d answers" % (label, in_store, res["requests"]))


test_throughput_cluster_vs_single.timeout = 45


# ---------------------------------------------------------------------------
# (v) one master hangs or dies: only the keys of its slots wait
# ---------------------------------------------------------------------------

def _one_master_fails(h, how):
    """`how` is "kill" (SIGKILL: refused at once) or "hang" (SIGSTOP: the
    node accepts and never answers). The cluster keeps serving the other
    slots (cluster-require-full-coverage no, no failover for the victim),
    so what the module does is all that is measured: counts of keys on the
    other masters keep rising, their longest stall is bounded, every answer
    is 200 and fast; the victim's keys land once it is back (SIGCONT) or
    not at all (killed)."""
    c = Cluster(h).start()
    for p in c.ports:
        c.node(p).cmd("CONFIG", "SET", "cluster-require-full-coverage", "no")
    ng = h.nginx(czone(c, "cz", "timeout=200ms"), loc("/t", "redis_ratelimit cz 1000000r/h;"))
    victim = c.masters()[1]["port"]
    alive = c.masters()[0]["port"]
    c.node(c.replica_of(victim)).cmd("CONFIG", "SET", "cluster-replica-no-failover", "yes")

    def counted(c, zone, keys, period, t0):
        """As the module's `counted`, asking a master that stays up."""
        names = {k: rkeys(zone, k, period, t0) for k in keys}
        vals = c.get_many([n for ns in names.values() for n in ns], port=alive)
        return {k: sum(vals[n] or 0 for n in ns) for k, ns in names.items()}
    vkeys, okeys = keys_around(h, c, victim, "iso")
    t_begin = time.time()
    for k in vkeys + okeys:
        h.check(ng.get("/t?k=" + k)[0] == 200, "warm-up request failed")
    h.check(wait_for(lambda: all(v == 1 for v in counted(c, "cz", vkeys + okeys, 3600, t_begin).values()), 3.0),
            "warm-up counts not in the cluster within 3 s")
    vnode = c.node(victim)
    tr = Traffic([(ng, "/t?k=" + k, k) for k in vkeys + okeys], rate=300, threads=2).start()
    try:
        time.sleep(1.0)
        sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
        os.kill(vnode.popen.pid, sig)
        t_fail = time.monotonic()
        prev, last_rise, gap = None, t_fail, 0.0
        while time.monotonic() - t_fail < 4.0:
            osum = sum(counted(c, "cz", okeys, 3600, t_begin).values())
            now = time.monotonic()
            if prev is not None and osum > prev:
                gap = max(gap, now - last_rise)
                last_rise = now
            prev = osum
            time.sleep(0.05)
        gap = max(gap, time.monotonic() - last_rise)
        if how == "hang":
            os.kill(vnode.popen.pid, signal.SIGCONT)
            t_back = time.monotonic()
    finally:
        if how == "hang":
            try:
                os.kill(vnode.popen.pid, signal.SIGCONT)
            except OSError:
                pass
        time.sleep(1.5 if how == "hang" else 0)
        tr.stop()
    log = list(tr.log)
    lat = [x[3] for x in log]
    bad = [x for x in log if x[2] != 200]
    allowed = {k: sum(1 for x in log if x[1] == k and x[2] == 200) + 1 for k in vkeys + okeys}
    time.sleep(1.0)
    final = counted(c, "cz", okeys, 3600, t_begin)
    oa, oc = sum(allowed[k] for k in okeys), sum(final[k] for k in okeys)
    h.note("%s of master :%d; %d requests: %s; latency max %s, p99 %s" % (
        how, victim, len(log), counts_str([x[2] for x in log]), ms(max(lat)), ms(percentile(lat, 99))))
    h.note("keys on the other masters: longest stall of their counts %.2fs in the 4 s after the %s; "
           "allowed %d, counted %d" % (gap, how, oa, oc))
    if how == "hang":
        vsum = sum(counted(c, "cz", vkeys, 3600, t_begin).values())
        va = sum(allowed[k] for k in vkeys)
        h.note("victim's keys after SIGCONT: allowed %d, counted %d (a pipeline that timed out is never "
               "sent again)" % (va, vsum))
        h.expect(vsum >= va * 0.5 and vsum <= va, "victim's keys: %d counted of %d allowed" % (vsum, va))
    h.expect(gap <= 1.2, "keys on the healthy masters stalled %.2fs (bound 1.2 s)" % gap)
    h.expect(oc >= oa * 0.97 and oc <= oa, "healthy masters' keys: %d counted of %d allowed" % (oc, oa))
    h.expect(not bad, "%d answers other than 200, e.g. %s" % (len(bad), bad[:5]))
    h.expect(lat and max(lat) < 0.100, "a request took %s (bound 100 ms)" % ms(max(lat) if lat else None))
    h.expect(not nasty(ng), "error.log: %s" % nasty(ng)[:5])


def test_master_killed_others_flow(h):
    _one_master_fails(h, "kill")


def test_master_hung_others_flow(h):
    _one_master_fails(h, "hang")


test_master_killed_others_flow.timeout = 45
test_master_hung_others_flow.timeout = 45


def test_a_one_node_cluster_counts_and_decides(h):
    """A one-node Redis Cluster holding every slot (the usual development
    and small production setup) names itself with an empty host in
    CLUSTER SLOTS, which Redis documents as "the host you asked": counts
    land (background, 1000r/h), small limits and strict ones are decided
    there (5r/h: exactly 5), and no send fails."""
    from cluster import NODE_ARGS, cluster_port
    p = cluster_port()
    node = h.redis(port=p, extra_args=NODE_ARGS)
    node.cmd("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
    h.check(wait_for(lambda: "cluster_state:ok" in node.cmd("CLUSTER", "INFO"), 5.0), "the cluster is ok")
    http = "    redis_ratelimit_zone $arg_k zone=one:1m redis=redis://%s:%d cluster hold=0;\n" % (HOST, p)
    server = (loc("/b", "redis_ratelimit one 1000r/h;") + loc("/s", "redis_ratelimit one 5r/h;")
              + loc("/st", "redis_ratelimit one 100r/h strict;"))
    ng = h.nginx(http, server, files={"b": "ok\n", "s": "ok\n", "st": "ok\n"})
    kb, ks, kt = h.key("b"), h.key("s"), h.key("st")
    b = [ng.get("/b?k=" + kb)[0] for _ in range(3)]
    s = [ng.get("/s?k=" + ks)[0] for _ in range(7)]
    st = [ng.get("/st?k=" + kt)[0] for _ in range(2)]

    def total(k):
        return _counts_on([node], "one", k)

    landed = wait_for(lambda: total(kb) == 3, 3.0)
    errs = [l for l in ng.error_log_text().splitlines() if "[error]" in l and "redis_ratelimit:" in l]
    h.note("one-node cluster: background %s (in Redis %d), 5r/h %s (in Redis %d), strict %s (%d); "
           "error lines %s" % (b, total(kb), s, total(ks), st, total(kt), errs[:2]))
    h.check(landed, "background counts land: %d" % total(kb))
    h.check(s == [200] * 5 + [429] * 2 and total(ks) == 5, "5r/h exact: %s, %d" % (s, total(ks)))
    h.check(st == [200, 200] and total(kt) == 2, "strict decided there: %s" % st)
    h.check(not errs, "no send fails: %s" % errs[:3])


def _three_masters(h, extra):
    """Three masters on cluster ports, met and given a third of the slots
    each by hand (no replicas), with `extra` arguments each; waits until
    every node is ok and knows the others."""
    from cluster import NODE_ARGS, cluster_port
    ports = []
    while len(ports) < 3:
        p = cluster_port()
        if p not in ports:
            ports.append(p)
    nodes = [h.redis(port=p, extra_args=tuple(NODE_ARGS) + tuple(extra)) for p in ports]
    for n in nodes[1:]:
        nodes[0].cmd("CLUSTER", "MEET", HOST, str(n.port))
    for n, (lo, hi) in zip(nodes, [(0, 5460), (5461, 10922), (10923, 16383)]):
        n.cmd("CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi))

    def ok():
        return all("cluster_state:ok" in n.cmd("CLUSTER", "INFO")
                   and "cluster_known_nodes:3" in n.cmd("CLUSTER", "INFO") for n in nodes)
    h.check(wait_for(ok, 10.0), "three masters ok")
    return nodes


def _counts_on(nodes, zone, key):
    return sum(int(n.cmd("GET", k) or 0) for n in nodes for k in n.cmd("KEYS", "rl:{%s:%s}:*" % (zone, key)))


def _spread(h, nodes, zone, url, extra, addr_prefix=None):
    """Keys over every master through `url`: counts land on every master,
    small limits decided there, no send fails; with `addr_prefix`, every
    master sees the module's connection from that address family."""
    http = "    redis_ratelimit_zone $arg_k zone=%s:1m redis=%s cluster hold=0 %s;\n" % (zone, url, extra)
    server = loc("/b", "redis_ratelimit %s 1000r/h;" % zone) + loc("/s", "redis_ratelimit %s 3r/h;" % zone)
    ng = h.nginx(http, server, files={"b": "ok\n", "s": "ok\n"})
    keys = []
    owners = set()
    i = 0
    while len(owners) < 3 and i < 200:
        k = h.key("k%d" % i)
        i += 1
        owner = next(n.port for n, (lo, hi) in zip(nodes, [(0, 5460), (5461, 10922), (10923, 16383)])
                     if lo <= keyslot("%s:%s" % (zone, k)) <= hi)
        if owner not in owners:
            owners.add(owner)
            keys.append(k)
    b = [ng.get("/b?k=" + k)[0] for k in keys for _ in range(2)]
    ks = h.key("small")
    s = [ng.get("/s?k=" + ks)[0] for _ in range(4)]
    landed = wait_for(lambda: all(_counts_on(nodes, zone, k) == 2 for k in keys), 3.0)
    errs = [l for l in ng.error_log_text().splitlines() if "[error]" in l and "redis_ratelimit:" in l]
    per = [_counts_on([n], zone, k) for n in nodes for k in keys]
    h.note("%s: background %s, per master and key %s; 3r/h %s; error lines %s" % (
        zone, b, per, s, errs[:2]))
    h.check(b == [200] * 6 and landed, "counts land on all three masters: %s" % per)
    h.check(s == [200] * 3 + [429], "3r/h decided in the cluster: %s" % s)
    h.check(not errs, "no send fails: %s" % errs[:2])
    if addr_prefix:
        for n in nodes:
            clients = n.cmd("CLIENT", "LIST")
            h.check(any(l.startswith("id=") and (" addr=%s" % addr_prefix) in l for l in clients.splitlines()),
                    "master :%d sees a connection from %s" % (n.port, addr_prefix))


def test_a_cluster_that_announces_hostnames(h):
    """Three masters announcing a hostname (cluster-announce-hostname,
    cluster-preferred-endpoint-type hostname, as managed services do): the
    slot map names them by hostname, which the module resolves and
    reaches; counts land on every master."""
    nodes = _three_masters(h, ("--cluster-announce-hostname", "localhost",
                               "--cluster-preferred-endpoint-type", "hostname"))
    slots = nodes[0].cmd("CLUSTER", "SLOTS")
    named = sorted({str(s[2][0]) for s in slots})
    h.note("CLUSTER SLOTS endpoints: %s" % named)
    h.check(named == ["localhost"], "the slot map names hostnames: %s" % named)
    _spread(h, nodes, "hn", "redis://%s:%d" % (HOST, nodes[0].port), "")


def test_a_cluster_on_ipv6(h):
    """Three masters on ::1 announcing ::1: the seed URL in brackets
    (redis://[::1]:port), IPv6 addresses in the slot map; every master sees
    the module's connections from ::1."""
    nodes = _three_masters(h, ("--bind", "127.0.0.1", "::1", "--cluster-announce-ip", "::1"))
    slots = nodes[0].cmd("CLUSTER", "SLOTS")
    named = sorted({str(s[2][0]) for s in slots})
    h.note("CLUSTER SLOTS endpoints: %s" % named)
    h.check(named == ["::1"], "the slot map holds IPv6 addresses: %s" % named)
    _spread(h, nodes, "v6", "redis://[::1]:%d" % nodes[0].port, "", addr_prefix="[::1]")


def test_redis_on_ipv6(h):
    """A standalone Redis reached at redis://[::1]:port: counts land, small
    limits and strict ones are decided there, from a ::1 connection."""
    r = h.redis(extra_args=("--bind", "127.0.0.1", "::1"))
    http = "    redis_ratelimit_zone $arg_k zone=s6:1m redis=redis://[::1]:%d hold=0;\n" % r.port
    server = (loc("/b", "redis_ratelimit s6 1000r/h;") + loc("/s", "redis_ratelimit s6 3r/h;")
              + loc("/st", "redis_ratelimit s6 100r/h strict;"))
    ng = h.nginx(http, server, files={"b": "ok\n", "s": "ok\n", "st": "ok\n"})
    kb, ks, kt = h.key("b"), h.key("s"), h.key("t")
    b = [ng.get("/b?k=" + kb)[0] for _ in range(2)]
    s = [ng.get("/s?k=" + ks)[0] for _ in range(4)]
    st = [ng.get("/st?k=" + kt)[0] for _ in range(2)]
    landed = wait_for(lambda: _counts_on([r], "s6", kb) == 2, 3.0)
    clients = [l for l in r.cmd("CLIENT", "LIST").splitlines() if " addr=[::1]:" in l]
    h.note("IPv6: background %s, 3r/h %s, strict %s; connections from ::1: %d" % (b, s, st, len(clients)))
    h.check(landed and b == [200, 200], "counts land over IPv6")
    h.check(s == [200] * 3 + [429] and st == [200, 200] and _counts_on([r], "s6", kt) == 2,
            "decided in Redis over IPv6: %s %s" % (s, st))
    h.check(clients, "Redis sees the module's connections from ::1")
