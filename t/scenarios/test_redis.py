"""Black-box scenarios for the Redis backend of ngx_http_redis_ratelimit_module.

Each test starts its own redis-server(s) and nginx instance(s) on free
loopback ports; see harness.py.  Every test states the bound it asserts.
"""

import hashlib
import re
import threading
import time

from harness import (HOST, free_port, ms, percentile, wait_for, window)

FAIL_RE = r'\[error\].*redis_ratelimit: zone "%s": (?:connecting to|sending to) \S+ failed: '


def zone(name, redis_url, extra=""):
    return "    redis_ratelimit_zone $arg_k zone=%s:1m redis=%s %s;\n" % (name, redis_url, extra)


def loc(path, body):
    return "        location = %s { %s }\n" % (path, body)


def statuses_str(seq):
    return " ".join(str(s) for s in seq)


def redis_sum(r, pattern):
    total = 0
    for k in r.keys(pattern):
        v = r.cmd("GET", k)
        total += int(v or 0)
    return total


def recording_get(ng):
    """A get(path) -> status that records latencies and unexpected statuses."""
    lat, odd = [], []

    def get(path):
        st, el = ng.get(path)
        lat.append(el)
        if st not in (200, 429):
            odd.append((path, st))
        return st

    return get, lat, odd


def until_denied(get, t_stop, within=2.0):
    """After the backend went down at t_stop: requests on /l, /a and /d (a
    fresh key each time, so that a 429 on /d can only come from
    on_error=deny) until /d answers 429 or `within` seconds pass. Returns
    the /d statuses."""
    seen = []
    i = 0
    while time.monotonic() - t_stop < within:
        get("/l?k=notice-%d" % i)
        get("/a?k=notice-%d" % i)
        st = get("/d?k=notice-%d" % i)
        seen.append(st)
        i += 1
        if st == 429:
            break
        time.sleep(0.02)
    return seen


def fail_lines(text, zone_name):
    return re.findall(FAIL_RE % re.escape(zone_name), text)


# ---------------------------------------------------------------------------
# 1
# ---------------------------------------------------------------------------

def test_keys_and_ttls(h):
    """keys <prefix>{z:key}:P:w, values = allowed counts, 2P-10 <= TTL <= 2P,
    a 300-byte key becomes sha256:<hex>; visible in Redis within 2 s."""
    r = h.redis()
    ng = h.nginx(zone("z", r.url, "prefix=sc:"),
                 loc("/t", "redis_ratelimit z 5r/m; redis_ratelimit z 100r/h;"))
    h.wait_minute_room(8)
    t_before = time.time()
    alice = [ng.get("/t?k=alice")[0] for _ in range(7)]
    long_key = ("L-" + "0123456789abcdefghijklmnopqrstuvwxyz" * 9)[:300]
    assert len(long_key) == 300
    st_long = ng.get("/t?k=" + long_key)[0]
    t_after = time.time()
    h.note("alice statuses: %s; long key: %s" % (statuses_str(alice), st_long))
    h.check(alice == [200] * 5 + [429] * 2,
            "5r/m: expected 5 x 200 then 2 x 429 for alice, got %s" % statuses_str(alice))
    h.check(st_long == 200, "long key: expected 200, got %s" % st_long)

    digest = "sha256:" + hashlib.sha256(long_key.encode()).hexdigest()
    w60s = {window(t_before, 60), window(t_after, 60)}
    w3600s = {window(t_before, 3600), window(t_after, 3600)}
    want_counts = {("z:alice", 60): 5, ("z:alice", 3600): 5,
                   ("z:" + digest, 60): 1, ("z:" + digest, 3600): 1}

    def parse(keys):
        """{(tag, P): total} from key names; None if any key is malformed."""
        got, bad = {}, []
        for k in keys:
            m = re.fullmatch(r"sc:\{([^{}]*)\}:(\d+):(\d+)", k)
            if not m:
                bad.append(k)
                continue
            tag, p, w = m.group(1), int(m.group(2)), int(m.group(3))
            if w not in (w60s if p == 60 else w3600s if p == 3600 else ()):
                bad.append(k)
                continue
            got[(tag, p)] = got.get((tag, p), 0) + int(r.cmd("GET", k) or 0)
        return got, bad

    state = {}

    def settled():
        keys = r.keys("*")
        got, bad = parse(keys)
        state.update(keys=keys, got=got, bad=bad)
        return got == want_counts and not bad

    t0 = time.monotonic()
    # counts far from their limit wait up to hold= (5 s) on the node
    ok = wait_for(settled, 7.0, 0.02)
    h.note("keys in Redis after %.0f ms: %s" % ((time.monotonic() - t0) * 1000,
                                                 ", ".join("%s=%s" % (k, r.cmd("GET", k))
                                                           for k in state["keys"])))
    h.check(ok, "within 7 s expected exactly the counts %s (window starts %s / %s), got %s, "
            "unexpected keys %s" % (want_counts, sorted(w60s), sorted(w3600s),
                                    state["got"], state["bad"]))
    # TTLs: EXPIRE 2P (allow 10 s for the test's own duration)
    ttls = {k: r.cmd("TTL", k) for k in state["keys"]}
    h.note("TTLs: %s" % ttls)
    for k, ttl in ttls.items():
        p = int(k.rsplit(":", 2)[1])
        h.check(2 * p - 10 <= ttl <= 2 * p,
                "TTL of %s is %s, expected within [%d, %d] (EXPIRE 2P)" % (k, ttl, 2 * p - 10, 2 * p))
    # both windows of a key share the hash tag
    for tag in ("z:alice", "z:" + digest):
        tagged = [k for k in state["keys"] if k.startswith("sc:{%s}:" % tag)]
        h.check(len(tagged) == 2, "hash tag {%s}: expected the 60 and 3600 keys, got %s" % (tag, tagged))
    h.check(not any(long_key in k for k in state["keys"]),
            "the 300-byte key appears verbatim in a Redis key")


# ---------------------------------------------------------------------------
# 2
# ---------------------------------------------------------------------------

def test_two_nodes_share_one_limit(h):
    """two nginx nodes, one Redis, 10r/m: 30 alternating requests 50 ms apart
    -> exactly 10 x 200 in total (sequence printed)."""
    r = h.redis()
    http = zone("z", r.url)
    server = loc("/t", "redis_ratelimit z 10r/m;")
    a = h.nginx(http, server)
    b = h.nginx(http, server)
    key = h.key("shared")
    h.wait_minute_room(8)
    seq = []
    for i in range(30):
        node = (a, "A") if i % 2 == 0 else (b, "B")
        st, _ = node[0].get("/t?k=" + key)
        seq.append("%s:%s" % (node[1], st))
        time.sleep(0.05)
    allowed = sum(1 for s in seq if s.endswith(":200"))
    others = [s for s in seq if not s.endswith(":200") and not s.endswith(":429")]
    h.note("allowed %d of 30; sequence: %s" % (allowed, " ".join(seq)))
    wait_for(lambda: redis_sum(r, "rl:{z:%s}:60:*" % key) == 10, 2.0)
    in_redis = redis_sum(r, "rl:{z:%s}:60:*" % key)
    h.note("count in Redis: %d" % in_redis)
    h.check(not others, "non-200/429 answers: %s" % others)
    h.check(allowed == 10, "expected exactly 10 x 200 across both nodes, got %d" % allowed)
    h.check(in_redis == 10, "Redis count for the key should be 10 within 2 s, is %d" % in_redis)


# ---------------------------------------------------------------------------
# 3
# ---------------------------------------------------------------------------

def test_burst_single_node(h):
    """2 workers, 64 threads, 400 concurrent requests on one fresh key, 50r/m
    -> exactly 50 x 200 (never more), the rest 429."""
    r = h.redis()
    ng = h.nginx(zone("z", r.url), loc("/t", "redis_ratelimit z 50r/m;"), workers=2)
    key = h.key("burst")
    h.wait_minute_room(8)
    t0 = time.monotonic()
    res = ng.burst(["/t?k=" + key] * 400, threads=64)
    el = time.monotonic() - t0
    allowed = res.count(200)
    rejected = res.count(429)
    errors = [x for x in res if x not in (200, 429)]
    h.note("400 requests in %.2fs: %d x 200, %d x 429, %d other" % (el, allowed, rejected, len(errors)))
    wait_for(lambda: redis_sum(r, "rl:{z:%s}:60:*" % key) == allowed, 2.0)
    in_redis = redis_sum(r, "rl:{z:%s}:60:*" % key)
    stats = r.info_commandstats()
    h.note("count in Redis: %d; Redis calls: INCRBY %s, GET %s, EXPIRE %s" % (
        in_redis, *(stats.get(c, {}).get("calls", 0) for c in ("incrby", "get", "expire"))))
    h.check(not errors, "failed/odd answers: %s" % errors[:10])
    h.check(allowed <= 50, "over-admission: %d x 200 for a 50r/m limit" % allowed)
    h.check(allowed == 50, "expected exactly 50 x 200 for a fresh key, got %d" % allowed)
    h.check(in_redis == allowed, "Redis count %d != allowed %d (after 2 s)" % (in_redis, allowed))


# ---------------------------------------------------------------------------
# 4
# ---------------------------------------------------------------------------

def test_redis_down_modes(h):
    """Redis stopped for ~2.5 s: every answer < 100 ms; local: fresh key 5 x 200
    then 429; allow: 20/20 x 200; deny: first 429 within 2 s then only 429;
    error lines <= 1 per zone per second + 1; Redis restarted on the same port:
    recovery notice per zone within 6.5 s, new counts in Redis within 2 s."""
    r = h.redis()
    zones = ("zl", "za", "zd")
    http = (zone("zl", r.url, "on_error=local") + zone("za", r.url, "on_error=allow")
            + zone("zd", r.url, "on_error=deny"))
    server = (loc("/l", "redis_ratelimit zl 5r/m;") + loc("/a", "redis_ratelimit za 5r/m;")
              + loc("/d", "redis_ratelimit zd 5r/m;"))
    ng = h.nginx(http, server, files={"l": "l\n", "a": "a\n", "d": "d\n"})
    url_re = re.escape(r.url)
    h.wait_minute_room(8)

    # healthy: one request per zone, counts land
    for p in ("l", "a", "d"):
        st, _ = ng.get("/%s?k=warm" % p)
        h.check(st == 200, "healthy /%s: expected 200, got %s" % (p, st))
    h.check(wait_for(lambda: all(redis_sum(r, "rl:{%s:warm}:60:*" % z) == 1 for z in zones), 2.0),
            "healthy: counts for key warm did not reach Redis within 2 s: %s" % r.keys("*"))

    r.stop()
    t_stop = time.monotonic()
    get, lat, odd = recording_get(ng)
    seen = until_denied(get, t_stop)
    h.note("deny: %d answer(s) before the first 429 (%.0f ms after the stop)"
           % (len(seen) - 1, (time.monotonic() - t_stop) * 1000))
    h.check(seen and seen[-1] == 429, "deny: no 429 within 2 s of Redis going down: %s" % statuses_str(seen[-10:]))

    local = [get("/l?k=" + h.key("local")) for _ in range(8)]
    allow = [get("/a?k=" + h.key("allow")) for _ in range(20)]
    deny = [get("/d?k=%s-%d" % (h.key("deny"), j)) for j in range(10)]
    h.note("down: local %s | allow %s | deny %s" % (statuses_str(local), statuses_str(allow), statuses_str(deny)))
    h.expect(local == [200] * 5 + [429] * 3,
             "on_error=local, 5r/m: expected 5 x 200 then 429, got %s" % statuses_str(local))
    h.expect(allow == [200] * 20, "on_error=allow: expected 20 x 200 (limit 5r/m ignored), got %s" % statuses_str(allow))
    h.expect(deny == [429] * 10, "on_error=deny: expected only 429 after the first, got %s" % statuses_str(deny))

    # keep the outage going (~2.5 s in all) with traffic on every zone
    j = 0
    while time.monotonic() - t_stop < 2.5:
        for p in ("l", "a", "d"):
            get("/%s?k=out-%d" % (p, j))
        j += 1
        time.sleep(0.02)
    h.note("down: %d requests, max latency %s, p50 %s" % (len(lat), ms(max(lat)), ms(percentile(lat, 50))))
    h.expect(max(lat) < 0.100, "a request took %s while Redis was down (bound 100 ms)" % ms(max(lat)))

    # restart on the same port; keep light traffic on every zone meanwhile
    r.start()
    t_restart = time.monotonic()
    notices = {}
    j = 0
    while time.monotonic() - t_restart < 6.5 and len(notices) < 3:
        for p in ("l", "a", "d"):
            get("/%s?k=rec-%d" % (p, j))
        j += 1
        text = ng.error_log_text()
        for z in zones:
            if z not in notices and re.search(
                    r'\[error\].*redis_ratelimit: zone "%s": Redis %s is reachable again' % (z, url_re), text):
                notices[z] = time.monotonic() - t_restart
        time.sleep(0.1)
    h.note("outage %.2fs; recovery notices after the restart: %s" % (
        t_restart - t_stop, ", ".join("%s %.2fs" % (z, t) for z, t in sorted(notices.items())) or "none"))
    text = ng.error_log_text()
    outage = time.monotonic() - t_stop
    bound = int(outage) + 2       # <= 1 per started second of outage, + 1
    counts = {z: len(fail_lines(text, z)) for z in zones}
    h.note("redis error lines per zone %s in %.1fs since the stop (bound %d each)" % (counts, outage, bound))
    h.expect(not odd, "answers other than 200/429: %s" % odd[:5])
    for z in zones:
        h.expect(counts[z] >= 1, 'no "connecting to/sending to %s failed" error line for zone %s' % (r.url, z))
        h.expect(counts[z] <= bound, "zone %s: %d error lines in %.1fs (bound %d)" % (z, counts[z], outage, bound))
        h.expect(z in notices, 'zone %s: no "Redis %s is reachable again" notice within 6.5 s of the restart'
                 % (z, r.url))
        n = len(re.findall(r'zone "%s": Redis \S+ is reachable again' % z, text))
        h.expect(n <= 1, "zone %s: recovery logged %d times (expected once)" % (z, n))

    # new increments land again
    k = h.key("after")
    after = {}
    for p, z in (("l", "zl"), ("a", "za"), ("d", "zd")):
        after[z] = get("/%s?k=%s" % (p, k))
    wait_for(lambda: all(redis_sum(r, "rl:{%s:%s}:60:*" % (z, k)) == 1 for z in zones), 2.0)
    landed = {z: redis_sum(r, "rl:{%s:%s}:60:*" % (z, k)) for z in zones}
    h.note("after recovery: statuses %s, counts in Redis %s" % (after, landed))
    for z in zones:
        h.expect(after[z] == 200, "after recovery zone %s: expected 200 for a fresh key, got %s" % (z, after[z]))
        h.expect(landed[z] == 1, "after recovery zone %s: the fresh key's count is not in Redis within 2 s" % z)


test_redis_down_modes.timeout = 60


# ---------------------------------------------------------------------------
# 5
# ---------------------------------------------------------------------------

def test_redis_paused_latency(h):
    """CLIENT PAUSE 2000 ALL: 100 sequential requests each < 50 ms. The
    pipeline that timed out may or may not have run, so its increments are
    never sent again (they stay counted on the node); everything after it
    waits (PING first) and reaches Redis within 6 s after the pause ends:
    between 95 and 100 counts, never more than 100."""
    r = h.redis()
    # hold=0: what waits here is the pause, not the sync rule
    ng = h.nginx(zone("z", r.url, "hold=0"), loc("/t", "redis_ratelimit z 1000r/m;"))
    st, _ = ng.get("/t?k=warm")
    h.check(st == 200, "warm-up: %s" % st)
    h.check(wait_for(lambda: redis_sum(r, "rl:{z:warm}:60:*") == 1, 2.0), "warm-up count not in Redis within 2 s")
    key = h.key("paused")
    r.cmd("CLIENT", "PAUSE", "2000", "ALL")
    t_pause = time.monotonic()
    lat, sts = [], []
    for _ in range(100):
        st, el = ng.get("/t?k=" + key)
        sts.append(st)
        lat.append(el)
        time.sleep(0.012)
    during = time.monotonic() - t_pause
    h.note("100 requests over %.2fs of the 2 s pause: max %s, p50 %s, p99 %s; statuses %s"
           % (during, ms(max(lat)), ms(percentile(lat, 50)), ms(percentile(lat, 99)),
              {s: sts.count(s) for s in set(sts)}))
    h.expect(sts == [200] * 100, "expected 100 x 200 (limit 1000r/m), got %s" % {s: sts.count(s) for s in set(sts)})
    h.expect(max(lat) < 0.050, "max latency %s during CLIENT PAUSE (bound 50 ms)" % ms(max(lat)))
    time.sleep(max(0.0, 2.0 - (time.monotonic() - t_pause)))
    t_end = time.monotonic()
    got = wait_for(lambda: redis_sum(r, "rl:{z:%s}:60:*" % key) >= 95, 6.0, 0.05)
    time.sleep(0.5)
    total = redis_sum(r, "rl:{z:%s}:60:*" % key)
    h.note("count in Redis %d after %.2fs past the pause end" % (total, time.monotonic() - t_end))
    h.expect(got and 95 <= total <= 100,
             "expected 95..100 counts in Redis within 6 s after the pause (never more than sent), got %d" % total)
    if total < 95:
        # diagnostic only: does a request after the pause land at all?
        st, _ = ng.get("/t?k=" + key)
        wait_for(lambda: redis_sum(r, "rl:{z:%s}:60:*" % key) > total, 2.0)
        h.note("diagnostic: one more request after the pause (%s) -> count in Redis %d"
               % (st, redis_sum(r, "rl:{z:%s}:60:*" % key)))


# ---------------------------------------------------------------------------
# 6
# ---------------------------------------------------------------------------

def test_reload_under_traffic(h):
    """3 x SIGHUP under continuous traffic (~3 s): no connection error, no 5xx,
    no [alert]/[crit]/[emerg]/"exited on signal", old workers gone within 5 s."""
    r = h.redis()
    ng = h.nginx(zone("z", r.url), loc("/t", "redis_ratelimit z 100000r/m;"), workers=2)
    stop = threading.Event()
    results = []

    def traffic():
        i = 0
        while not stop.is_set():
            st, el = ng.get("/t?k=r%d" % (i % 10))
            results.append(st)
            i += 1

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    reloads = []
    try:
        time.sleep(0.3)
        for _ in range(3):
            reloads.append(ng.reload(timeout=5.0, check=False))
            time.sleep(0.5)
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(5)
    bad = [x for x in results if not isinstance(x, int) or x >= 500]
    h.note("%d requests; statuses %s" % (len(results), {s: results.count(s) for s in set(results) if isinstance(s, int)}))
    for i, rl in enumerate(reloads):
        h.note("reload %d: old %s -> new %s, old gone after %s" % (
            i + 1, rl["old"], rl["new"], "%.2fs" % rl["old_gone_after"] if rl["old_gone_after"] else "NOT within 5 s"))
    text = ng.error_log_text()
    nasty = [l for l in text.splitlines()
             if re.search(r"\[(alert|crit|emerg)\]|exited on signal", l)]
    h.expect(len(results) >= 50, "too little traffic: %d requests" % len(results))
    h.expect(not bad, "%d failed/5xx requests, e.g. %s" % (len(bad), bad[:5]))
    for i, rl in enumerate(reloads):
        h.expect(len(rl["new"]) == 2, "reload %d: new workers %s" % (i + 1, rl["new"]))
        h.expect(rl["old_gone_after"] is not None, "reload %d: old workers %s still alive after 5 s"
                 % (i + 1, rl["still_alive"]))
    h.expect(not nasty, "error.log has: %s" % nasty[:5])
    n = len(re.findall(r"\[notice\] \d+#\d+: reconfiguring$", text, re.M))
    h.check(n == 3, "expected 3 'reconfiguring' notices, got %d" % n)


# ---------------------------------------------------------------------------
# 7
# ---------------------------------------------------------------------------

def test_quit_while_redis_unreachable(h):
    """SIGQUIT with the backend unreachable (nothing listening, timeout=500ms)
    and with a Redis under CLIENT PAUSE 10000 ALL: the master exits < 3 s."""
    dead = free_port()
    ng = h.nginx(zone("z", "redis://%s:%d" % (HOST, dead), "timeout=500ms"),
                 loc("/t", "redis_ratelimit z 1000r/m;"))
    t0 = time.monotonic()
    i = 0
    sts = []
    while time.monotonic() - t0 < 1.0:
        sts.append(ng.get("/t?k=q%d" % (i % 5))[0])
        i += 1
        time.sleep(0.01)
    el1 = ng.quit(grace=6.0)
    h.note("nothing listening: %d requests (%s), master exited %.2fs after SIGQUIT"
           % (len(sts), {s: sts.count(s) for s in set(sts)}, el1))

    r = h.redis()
    ng2 = h.nginx(zone("z", r.url, "timeout=500ms"), loc("/t", "redis_ratelimit z 1000r/m;"))
    h.check(ng2.get("/t?k=warm")[0] == 200, "warm-up failed")
    wait_for(lambda: redis_sum(r, "rl:{z:warm}:60:*") == 1, 2.0)
    r.cmd("CLIENT", "PAUSE", "10000", "ALL")
    t0 = time.monotonic()
    sts2 = []
    while time.monotonic() - t0 < 0.7:
        sts2.append(ng2.get("/t?k=p%d" % (len(sts2) % 5))[0])
        time.sleep(0.01)
    el2 = ng2.quit(grace=6.0)
    h.note("CLIENT PAUSE 10000: %d requests (%s), master exited %.2fs after SIGQUIT"
           % (len(sts2), {s: sts2.count(s) for s in set(sts2)}, el2))
    h.expect(el1 < 3.0, "nothing listening: master took %.2fs to exit after SIGQUIT (bound 3 s)" % el1)
    h.expect(el2 < 3.0, "CLIENT PAUSE: master took %.2fs to exit after SIGQUIT (bound 3 s)" % el2)
    h.expect(all(s == 200 for s in sts), "nothing listening: non-200 answers %s" % set(sts))
    h.expect(all(s == 200 for s in sts2), "paused: non-200 answers %s" % set(sts2))
    for n in (ng, ng2):
        nasty = [l for l in n.error_log_text().splitlines()
                 if re.search(r"\[(alert|crit|emerg)\]|exited on signal", l)]
        h.expect(not nasty, "%s error.log has %d [alert]/[crit]/crash lines, e.g. %s"
                 % (n.name, len(nasty), nasty[:3]))


test_quit_while_redis_unreachable.timeout = 40


# ---------------------------------------------------------------------------
# 8
# ---------------------------------------------------------------------------

def test_wrong_password(h):
    """requirepass s3cret: a zone with a wrong password answers (local mode:
    5 x 200 then 429) and logs an error for its zone within 2 s, with `***`;
    the right password lands counts within 2 s; neither password in error.log."""
    r = h.redis(password="s3cret")
    http = (zone("zw", "redis://:wrongpass@%s:%d" % (HOST, r.port))
            + zone("zr", "redis://:s3cret@%s:%d" % (HOST, r.port)))
    server = loc("/w", "redis_ratelimit zw 5r/m;") + loc("/r", "redis_ratelimit zr 5r/m;")
    ng = h.nginx(http, server, files={"w": "w\n", "r": "r\n"})
    h.wait_minute_room(6)
    kw, kr = h.key("w"), h.key("r")
    w = [ng.get("/w?k=" + kw)[0] for _ in range(7)]
    rr = [ng.get("/r?k=" + kr)[0] for _ in range(3)]
    h.note("wrong password zone: %s; right password zone: %s" % (statuses_str(w), statuses_str(rr)))
    h.check(w == [200] * 5 + [429] * 2, "wrong password (local mode, 5r/m): expected 5 x 200 then 429, got %s"
            % statuses_str(w))
    h.check(rr == [200] * 3, "right password: expected 3 x 200, got %s" % statuses_str(rr))
    got = wait_for(lambda: fail_lines(ng.error_log_text(), "zw"), 2.0)
    lines = [l for l in ng.error_log_text().splitlines()
             if re.search(FAIL_RE % "zw", l)]
    h.note("zw error line: %s" % (lines[0][lines[0].find("redis_ratelimit"):] if lines else "none"))
    h.check(got, 'no [error] "redis_ratelimit: zone "zw": ... failed" line within 2 s')
    h.expect(all("***" in l for l in lines), "an error line for zw lacks the *** placeholder: %s" % lines[:2])
    landed = wait_for(lambda: redis_sum(r, "rl:{zr:%s}:60:*" % kr) == 3, 2.0)
    h.note("right-password count in Redis: %d; wrong-password keys: %s"
           % (redis_sum(r, "rl:{zr:%s}:60:*" % kr), r.keys("rl:{zw:*")))
    h.expect(landed, "right password: count 3 not in Redis within 2 s")
    h.expect(not r.keys("rl:{zw:*"), "wrong password zone wrote to Redis")
    time.sleep(0.3)
    text = ng.error_log_text() + ng.stderr_text()
    for secret in ("wrongpass", "s3cret"):
        leaks = [l for l in text.splitlines() if secret in l]
        h.expect(not leaks, "%r appears in the log: %s" % (secret, leaks[:2]))


def test_a_password_file_keeps_the_secret_out_of_nginx_conf(h):
    """Redis behind a password given only in password_file= (user and
    password, the user an ACL user): background counts and strict limits
    work; the password is in no log line and not in nginx.conf. After the
    password changes in Redis and in the file, a reload reads the file
    again and counting goes on."""
    import os
    r = h.redis()
    r.cmd("ACL", "SETUSER", "rl", "on", ">first/pw@1", "~*", "+@all")
    pw = os.path.join(h.tmp, "redis.pw")
    with open(pw, "w") as f:
        f.write("rl\nfirst/pw@1\n")
    os.chmod(pw, 0o644)
    http = "    redis_ratelimit_zone $arg_k zone=pf:1m redis=redis://%s:%d password_file=%s hold=0;\n" % (
        HOST, r.port, pw)
    server = ("        location = /b { redis_ratelimit pf 1000r/h; }\n"
              "        location = /s { redis_ratelimit pf 3r/h; }\n")
    n = h.nginx(http, server, files={"b": "ok\n", "s": "ok\n"})
    k1 = h.key("pf1")
    b = [n.get("/b?k=" + k1)[0] for _ in range(2)]
    s = [n.get("/s?k=" + k1 + "s")[0] for _ in range(4)]
    landed = wait_for(lambda: redis_sum(r, "rl:{pf:%s}:3600:*" % k1) == 2, 3.0)
    h.check(b == [200, 200] and landed, "background counts land: %s, %s" % (b, redis_sum(r, "rl:{pf:%s}:*" % k1)))
    h.check(s == [200, 200, 200, 429], "a small limit decided in Redis: %s" % s)

    r.cmd("ACL", "SETUSER", "rl", "resetpass", ">second:pw")
    r.cmd("CLIENT", "KILL", "USER", "rl")
    with open(pw, "w") as f:
        f.write("rl\nsecond:pw\n")
    n.reload()
    k2 = h.key("pf2")
    after = [n.get("/b?k=" + k2)[0] for _ in range(3)]
    landed = wait_for(lambda: redis_sum(r, "rl:{pf:%s}:3600:*" % k2) == 3, 4.0)
    log = n.error_log_text()
    h.note("before the change: background %s, 3r/h %s; after the new password and a reload: %s, "
           "in Redis %d" % (b, s, after, redis_sum(r, "rl:{pf:%s}:*" % k2)))
    h.check(after == [200] * 3 and landed, "counts land with the new password: %s" % after)
    h.check("first/pw@1" not in log and "second:pw" not in log and "first%2Fpw" not in log,
            "no password in the log")
    h.check("first/pw" not in n.conf_text, "no password in nginx.conf")


def test_a_one_line_password_file_for_the_default_user(h):
    """password_file= holding only the password (Redis's requirepass, the
    default user): counts land; after requirepass and the file change, a
    reload reads the file again and counting goes on."""
    import os
    r = h.redis(password="old:pw")
    pw = os.path.join(h.tmp, "redis.pw")
    with open(pw, "w") as f:
        f.write("old:pw\n")
    os.chmod(pw, 0o644)
    http = "    redis_ratelimit_zone $arg_k zone=p1:1m redis=redis://%s:%d password_file=%s hold=0;\n" % (
        HOST, r.port, pw)
    n = h.nginx(http, "        location = /b { redis_ratelimit p1 1000r/h; }\n", files={"b": "ok\n"})
    k1, k2 = h.key("one"), h.key("two")
    before = [n.get("/b?k=" + k1)[0] for _ in range(2)]
    landed1 = wait_for(lambda: redis_sum(r, "rl:{p1:%s}:3600:*" % k1) == 2, 3.0)
    r.cmd("CONFIG", "SET", "requirepass", "new:pw")
    r.password = "new:pw"
    r.cmd("CLIENT", "KILL", "TYPE", "normal")
    with open(pw, "w") as f:
        f.write("new:pw\n")
    n.reload()
    after = [n.get("/b?k=" + k2)[0] for _ in range(3)]
    landed2 = wait_for(lambda: redis_sum(r, "rl:{p1:%s}:3600:*" % k2) == 3, 4.0)
    h.note("one-line file: %s (in Redis %d); after the change and a reload: %s (in Redis %d)" % (
        before, redis_sum(r, "rl:{p1:%s}:*" % k1), after, redis_sum(r, "rl:{p1:%s}:*" % k2)))
    h.check(before == [200, 200] and landed1, "counts land with the password from the file")
    h.check(after == [200] * 3 and landed2, "counts land with the new password after the reload")
    h.check("old:pw" not in n.error_log_text() and "new:pw" not in n.error_log_text(), "no password in the log")


def test_no_key_ends_the_hash_tag_or_names_another_counter(h):
    """Keys a client controls cannot steer their counters: `}a` and `}b`
    get tags of their own (two cluster slots, not `{z:}` for every key
    that begins with `}`); a key written as a long key's digest
    (`sha256:<hex>`) does not share the long key's counter; `%7Da`, `}a`
    and `%` are three counters. Each counter holds its one request."""
    r = h.redis()
    ng = h.nginx(zone("z", r.url), loc("/t", "redis_ratelimit z 100r/h;"))
    long_key = "L" * 300
    digest = "sha256:" + hashlib.sha256(long_key.encode()).hexdigest()
    # $arg_k is the query's bytes as sent (not percent-decoded)
    sent = ["}a", "}b", "%7Da", "%", long_key, digest]
    sts = [ng.get("/t?k=" + q)[0] for q in sent]
    want = {"rl:{z:%7Da}", "rl:{z:%7Db}", "rl:{z:%257Da}", "rl:{z:%25}", "rl:{z:" + digest + "}",
            "rl:{z:sha256%3A" + digest[7:] + "}"}

    def names():
        return {re.sub(r":3600:\d+$", "", k) for k in r.keys("rl:*")}

    landed = wait_for(lambda: names() == want, 8.0, 0.05)
    h.note("statuses %s; counters %s" % (sts, sorted(names())))
    h.check(sts == [200] * len(sent), "every key passes: %s" % sts)
    h.check(landed, "one counter per key, named as the docs say: %s" % sorted(names()))
    counts = [int(r.cmd("GET", k)) for k in r.keys("rl:*")]
    h.check(counts == [1] * len(want), "each counter holds its one request: %s" % counts)
    tags = {k[k.index("{") + 1:k.index("}")] for k in names()}
    h.check(len(tags) == len(want), "each counter has its own hash tag: %s" % sorted(tags))
