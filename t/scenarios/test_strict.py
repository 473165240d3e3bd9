"""Strict mode: the decision waits for Redis, atomically, the
request suspended on the event loop (never the worker). Exact global counts
across nodes, the wait bounded by timeout= (then on_error decides), reloads
and client disconnects while requests wait, and a Redis Cluster.
"""

import json
import os
import socket
import subprocess
import threading
import time

from harness import HOST, RedisError, http_get, wait_for

HTTP = """
    redis_ratelimit_zone $arg_k zone=s:1m redis=%s timeout=%s on_error=%s;
    redis_ratelimit_zone $arg_k zone=b:1m redis=%s;
"""
SERVER = """
        location = /strict { redis_ratelimit s 100r/m strict; }
        location = /bg     { redis_ratelimit b 100r/m; }
        location = /mixed  { redis_ratelimit s 100r/m strict; redis_ratelimit b 5r/m; }
        location = /one    { redis_ratelimit s 5r/m strict; }
        location = /metrics { redis_ratelimit_metrics; }
"""
FILES = {"strict": "ok\n", "bg": "ok\n", "mixed": "ok\n", "one": "ok\n"}


def conf(r, timeout="200ms", on_error="local"):
    return HTTP % (r.url, timeout, on_error, r.url)


def redis_count(r, key, zone):
    return sum(int(r.cmd("GET", k) or 0) for k in r.keys("rl:{%s:%s}:60:*" % (zone, key)))


def zone_up(n, zone):
    """The zone's Redis as the node's metrics show it (up or not)."""
    return json.loads(n.request("/metrics?format=json")[2])["zones"][zone]["redis"]["up"]


def flood(nodes, path, per_node=150, threads=32):
    """Every node gets `per_node` requests from `threads` connections at
    once; returns the statuses of all."""
    out = {}

    def one(i, n):
        out[i] = n.burst([path] * per_node, threads=threads, timeout=5.0)

    ts = [threading.Thread(target=one, args=(i, n)) for i, n in enumerate(nodes)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return [st for i in sorted(out) for st in out[i]]


def test_three_nodes_flooding_one_fresh_key_get_exactly_the_limit(h):
    """Three nginx instances x 32 connections, 150 requests each, on one
    fresh key of a strict 100r/m: exactly 100 allowed in all, and Redis
    holds 100 (rejected requests are not counted). Background mode's figure
    for the same flood is printed beside it."""
    r = h.redis()
    nodes = [h.nginx(conf(r), SERVER, workers=2, files=FILES) for _ in range(3)]
    h.wait_minute_room(20)
    k = h.key("flood")
    got = flood(nodes, "/strict?k=" + k)
    ok = got.count(200)
    other = [s for s in got if s not in (200, 429)]
    in_redis = redis_count(r, k, "s")
    kb = h.key("flood-bg")
    got_b = flood(nodes, "/bg?k=" + kb)
    h.note("strict 100r/m, 3 nodes x 32 connections x 150 requests: %d allowed, Redis %d; "
           "background mode, same flood: %d allowed" % (ok, in_redis, got_b.count(200)))
    h.check(not other, "every request is answered 200 or 429: %s" % other[:5])
    h.check(ok == 100, "strict: exactly 100 of 450 allowed, got %d" % ok)
    h.check(in_redis == 100, "Redis holds the 100 allowed, not the rejected: %d" % in_redis)


def test_key_over_its_limit_answers_without_a_round_trip(h):
    """Once a strict key is over its limit, this node knows it (the script's
    counts close its breaker): the next requests are rejected without a
    script call. Redis's commands are counted around them."""
    r = h.redis()
    n = h.nginx(conf(r), SERVER, files=FILES)
    h.wait_minute_room(10)
    k = h.key("over")
    first = [n.get("/one?k=" + k)[0] for _ in range(6)]
    calls = lambda: int(r.info_commandstats().get("evalsha", {}).get("calls", 0))  # noqa: E731
    before = calls()
    later = [n.get("/one?k=" + k)[0] for _ in range(20)]
    after = calls()
    h.note("5r/m strict: %s, then 20 more -> %s with %d script calls" % (first, set(later), after - before))
    h.check(first == [200] * 5 + [429], "5 pass, the 6th is rejected: %s" % first)
    h.check(set(later) == {429}, "the key stays rejected: %s" % later)
    h.check(after - before == 0, "no script call for a key known over its limit: %d" % (after - before))


def test_mixed_location(h):
    """A location with a strict limit and a background one: both apply (the
    background 5r/m rejects the 6th request while the strict 100r/m
    allows), and the strict count in Redis holds only what passed every
    limit... except those the background one rejected after Redis allowed
    them (documented): 6 here."""
    r = h.redis()
    n = h.nginx(conf(r), SERVER, files=FILES)
    h.wait_minute_room(10)
    k = h.key("mixed")
    got = [n.get("/mixed?k=" + k)[0] for _ in range(7)]
    wait_for(lambda: redis_count(r, k, "b") == 5, 7.0)
    h.note("mixed: %s; Redis strict %d, background %d"
           % (got, redis_count(r, k, "s"), redis_count(r, k, "b")))
    h.check(got == [200] * 5 + [429, 429], "the background 5r/m decides: %s" % got)
    h.check(redis_count(r, k, "b") == 5, "background counts 5")


def test_paused_redis_answers_by_on_error_after_the_timeout(h):
    """Redis paused (CLIENT PAUSE) while strict requests wait: each is
    answered by on_error after timeout= (deny: 429; allow: 200), within
    timeout + 50 ms; the worker keeps serving other locations meanwhile."""
    r = h.redis()
    deny = h.nginx(conf(r, "200ms", "deny"), SERVER, files=FILES)
    allow = h.nginx(conf(r, "200ms", "allow"), SERVER, files=FILES)
    for n in (deny, allow):
        h.check(n.get("/strict?k=" + h.key("warm"))[0] == 200, "a strict request passes first")
    r.cmd("CLIENT", "PAUSE", "1500", "ALL")
    results = {}

    def ask(name, n):
        t0 = time.monotonic()
        sts = n.burst(["/strict?k=" + h.key("p%d" % i) for i in range(4)], threads=4, timeout=5.0)
        results[name] = (sts, time.monotonic() - t0)

    ts = [threading.Thread(target=ask, args=(name, n)) for name, n in (("deny", deny), ("allow", allow))]
    for t in ts:
        t.start()
    # the worker is not blocked: a background location answers at once
    time.sleep(0.05)
    t0 = time.monotonic()
    st_bg = deny.get("/bg?k=" + h.key("bg"))[0]
    bg_ms = (time.monotonic() - t0) * 1000
    for t in ts:
        t.join(30)
    # once the node knows Redis is down (its thread's own read timed out;
    # the metrics say so), a strict request does not wait at all
    h.check(wait_for(lambda: zone_up(deny, "s") is False, 5.0), "zone s is seen down")
    t0 = time.monotonic()
    st_down = deny.get("/strict?k=" + h.key("down"))[0]
    down_ms = (time.monotonic() - t0) * 1000
    time.sleep(1.6)
    h.note("paused, 4 strict requests at once: deny %s in %.0f ms, allow %s in %.0f ms; "
           "a background request meanwhile: %s in %.1f ms; a strict one once Redis is known down: "
           "%s in %.1f ms" % (results["deny"][0], results["deny"][1] * 1000, results["allow"][0],
                              results["allow"][1] * 1000, st_bg, bg_ms, st_down, down_ms))
    h.check(st_bg == 200 and bg_ms < 100, "the worker serves others while strict requests wait")
    for name, want in (("deny", 429), ("allow", 200)):
        sts, el = results[name]
        h.check(sts == [want] * 4, "on_error=%s answers %s, got %s" % (name, want, sts))
        h.check(0.19 <= el <= 0.25, "answered after timeout=200ms (+50 ms): %.0f ms" % (el * 1000))
    h.check(st_down == 429 and down_ms < 50,
            "with Redis known down, on_error=deny answers at once: %s in %.0f ms" % (st_down, down_ms))
    m = json.loads(deny.request("/metrics?format=json")[2])["zones"]["s"]["redis"]["strict"]
    h.check(m == {"waits": 5, "timeouts": 4}, "the metrics count 5 waits, 4 of them timed out: %s" % m)


def test_a_script_run_after_the_timeout_counts_nothing(h):
    """DEBUG SLEEP 1.5 stalls Redis while 100 strict requests on 20 keys
    wait (timeout=300ms, on_error=deny): all are denied at the timeout, and
    when Redis wakes and runs the scripts written before, none of them
    counts a request that gave up (each call carries its requests'
    deadlines in Redis's clock, learnt with TIME when the link was made)."""
    r = h.redis(extra_args=["--enable-debug-command", "yes"])
    n = h.nginx(conf(r, "300ms", "deny"), SERVER, files=FILES)
    h.check(n.get("/strict?k=" + h.key("warm"))[0] == 200, "a strict request passes first")
    h.wait_minute_room(10)
    keys = [h.key("late%d" % i) for i in range(20)]

    def sleep():
        try:
            r.cmd("DEBUG", "SLEEP", "1.5", timeout=5.0)
        except OSError:
            pass

    t = threading.Thread(target=sleep)
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    sts = n.burst(["/strict?k=" + keys[i % 20] for i in range(100)], threads=32, timeout=5.0)
    el = time.monotonic() - t0
    t.join(10)
    time.sleep(1.0)
    counted = sum(redis_count(r, k, "s") for k in keys)
    m = json.loads(n.request("/metrics?format=json")[2])["zones"]["s"]["redis"]["strict"]
    h.note("100 strict requests during DEBUG SLEEP 1.5: %s in %.2f s; Redis counted %d of them "
           "after it woke; strict figures %s" % (sorted(set(sts)), el, counted, m))
    h.check(sts == [429] * 100, "on_error=deny answers every request: %s" % sorted(set(sts)))
    h.check(counted == 0, "Redis counted %d requests that had been denied" % counted)
    # and strict decisions are exact again once Redis answers
    h.check(wait_for(lambda: zone_up(n, "s"), 8.0), "zone s is up again")
    k = h.key("after")
    after = [n.get("/one?k=" + k)[0] for _ in range(7)]
    h.check(after == [200] * 5 + [429] * 2, "5r/m decided by Redis after: %s" % after)


test_a_script_run_after_the_timeout_counts_nothing.timeout = 60


def test_a_subrequest_that_waits_times_out_and_a_client_that_leaves(h):
    """An SSI include of a strict location while Redis is paused: the
    include waits on its own timer and is decided by on_error=deny after
    timeout=300ms (the page comes whole, with the 429 page in it); a client
    that closes while an include waits leaves no timer behind (the worker
    goes on, no crash)."""
    r = h.redis()
    http = ("    redis_ratelimit_zone $arg_k zone=s:1m redis=%s timeout=300ms on_error=deny;\n" % r.url)
    server = ("        location = /page.html { ssi on; }\n"
              "        location = /s { redis_ratelimit s 100r/m strict; }\n"
              "        location = /t { }\n")
    files = {"page.html": "before <!--# include virtual=\"/s?k=sub\" --> after\n", "s": "ok\n", "t": "ok\n"}
    n = h.nginx(http, server, files=files)
    h.check(n.get("/page.html")[0] == 200, "a first page")
    r.cmd("CLIENT", "PAUSE", "1500", "ALL")
    t0 = time.monotonic()
    st, _, body, _ = http_get(n.port, "/page.html", timeout=5.0)
    el = time.monotonic() - t0
    # a client that goes away while its include waits
    s = socket.create_connection((HOST, n.port), timeout=2.0)
    s.sendall(b"GET /page.html HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.05)
    s.close()
    time.sleep(1.6)
    after = n.get("/t")[0]
    log = n.error_log_text()
    h.note("paused: the page %s in %.0f ms (%d bytes); after a client left mid-wait: %s"
           % (st, el * 1000, len(body), after))
    # (chunked: the page's three parts in order)
    parts = [body.find(b"before "), body.find(b"429 Too Many"), body.find(b" after\n")]
    h.check(st == 200 and -1 not in parts and parts == sorted(parts),
            "the page, with the include decided by on_error=deny: %r" % body[:200])
    h.check(0.25 <= el <= 0.6, "decided after timeout=300ms: %.0f ms" % (el * 1000))
    h.check(after == 200, "the worker goes on")
    h.check("[alert]" not in log and "signal 11" not in log and "panicked" not in log, "no crash")


def test_client_disconnect_and_reload_while_waiting(h):
    """Clients that close while their strict request waits leave nothing
    behind (the worker goes on, the late answers find no one); a reload
    with strict requests waiting answers them (old workers finish them)."""
    r = h.redis()
    n = h.nginx(conf(r, "1s"), SERVER, workers=2, files=FILES)
    r.cmd("CLIENT", "PAUSE", "600", "ALL")
    socks = []
    for i in range(20):
        s = socket.create_connection((HOST, n.port), timeout=2)
        s.sendall(("GET /strict?k=%s HTTP/1.1\r\nHost: x\r\n\r\n" % h.key("gone%d" % i)).encode())
        socks.append(s)
    time.sleep(0.1)
    for s in socks:
        s.close()
    time.sleep(0.8)
    after = [n.get("/strict?k=" + h.key("after"))[0] for _ in range(3)]
    h.check(after == [200] * 3, "the worker answers after clients went away: %s" % after)

    # a reload while requests wait
    r.cmd("CLIENT", "PAUSE", "500", "ALL")
    out = []
    t = threading.Thread(target=lambda: out.extend(
        n.burst(["/strict?k=" + h.key("rl%d" % i) for i in range(10)], threads=10, timeout=5.0)))
    t.start()
    time.sleep(0.1)
    n.reload()
    t.join(20)
    h.note("disconnect: 20 closed while waiting, then %s; reload while 10 waited: %s" % (after, out))
    h.check(out == [200] * 10, "requests waiting through a reload are answered: %s" % out)
    log = n.error_log_text()
    h.check("[alert]" not in log and "signal 11" not in log and "panicked" not in log,
            "no worker crashed: %s" % [l for l in log.splitlines() if "alert" in l][:3])


def test_strict_on_a_redis_cluster(h):
    """Strict on a 3+3 Redis Cluster: keys on every master, two nodes
    flooding each: exactly the limit allowed per key, and the script ran on
    the masters (both windows share the key's slot)."""
    from cluster import Cluster, keyslot

    c = Cluster(h).start()
    http = "    redis_ratelimit_zone $arg_k zone=cs:1m redis=%s cluster timeout=300ms;\n" % c.urls()
    server = "        location = /c { redis_ratelimit cs 20r/m strict; }\n"
    nodes = [h.nginx(http, server, workers=2, files={"c": "ok\n"}) for _ in range(2)]
    h.wait_minute_room(20)
    keys, owners = [], set()
    i = 0
    while len(owners) < 3 or len(keys) < 6:
        k = h.key("ck%d" % i)
        i += 1
        o = c.owner_of_slot(keyslot("cs:" + k))
        if o not in owners or len(keys) < 6:
            owners.add(o)
            keys.append(k)
    allowed = {}
    for k in keys:
        got = flood(nodes, "/c?k=" + k, per_node=30, threads=8)
        allowed[k] = got.count(200)
    calls = c.commandstats().get("evalsha", 0)
    h.note("cluster, 20r/m strict, 2 nodes x 30 requests per key on %d masters: allowed %s; "
           "EVALSHA calls on the masters: %d" % (len(owners), sorted(allowed.values()), calls))
    h.check(all(v == 20 for v in allowed.values()), "exactly 20 per key: %s" % allowed)
    h.check(calls > 0, "the script ran on the masters")


LOGIN_HTTP = """
    redis_ratelimit_zone $arg_k zone=login:1m redis=%s timeout=300ms;
    map $status $failed { 401 1; default ""; }
"""
LOGIN_SERVER = """
        location = /login {
            redis_ratelimit login 3r/m strict count_if=$failed;
            proxy_pass http://127.0.0.1:$server_port/answer/$arg_r;
        }
        location = /answer/ok { return 200 "welcome\\n"; }
        location = /answer/bad { return 401 "no\\n"; }
"""


def test_strict_count_if_across_nodes(h):
    """`strict count_if=$failed` (3r/m) on two nodes: successes are not
    counted; failures are counted after the response and reach Redis at
    once, so the third failure on either node closes the key for both: the
    next attempt on each is 429 (checked in Redis), and Redis holds 3."""
    r = h.redis()
    a = h.nginx(LOGIN_HTTP % r.url, LOGIN_SERVER)
    b = h.nginx(LOGIN_HTTP % r.url, LOGIN_SERVER)
    h.wait_minute_room(10)
    k = h.key("login")

    def ask(n, res):
        st = n.get("/login?k=%s&r=%s" % (k, res))[0]
        time.sleep(0.1)
        return st

    seq = [ask(a, "ok"), ask(a, "bad"), ask(b, "ok"), ask(b, "bad"), ask(a, "bad"),
           ask(b, "ok"), ask(a, "ok")]
    in_redis = redis_count(r, k, "login")
    h.note("A ok, A bad, B ok, B bad, A bad, B ok, A ok -> %s; Redis %d" % (seq, in_redis))
    h.check(seq == [200, 401, 200, 401, 401, 429, 429],
            "the third failure closes the key on both nodes: %s" % seq)
    h.check(in_redis == 3, "Redis counts the 3 failures only: %d" % in_redis)


def test_error_reply_fails_one_key_only(h):
    """A counter holding text (someone else's value): the script's error
    reply fails that key alone, at once (no wait for the timeout): on_error
    decides it (deny: 429) and the error is logged naming the key; other
    keys go on through Redis (the backend stays up)."""
    r = h.redis()
    n = h.nginx(conf(r, "1s", "deny"), SERVER, files=FILES)
    h.wait_minute_room(10)
    bad, good = h.key("bad"), h.key("good")
    window = int(time.time()) // 60 * 60
    r.cmd("SET", "rl:{s:%s}:60:%d" % (bad, window), "not-a-number")
    st_bad, el_bad = n.get("/strict?k=" + bad)
    st_good = [n.get("/strict?k=" + good)[0] for _ in range(3)]
    in_redis = redis_count(r, good, "s")
    h.note("text in the counter: %s in %.0f ms; another key: %s, Redis %d"
           % (st_bad, el_bad * 1000, st_good, in_redis))
    h.check(st_bad == 429 and el_bad < 0.5, "the bad key is decided by on_error=deny at once")
    h.check(st_good == [200] * 3 and in_redis == 3, "other keys go on through Redis")
    h.check(wait_for(lambda: "not an integer" in n.error_log_text(), 2.0),
            "the error reply is logged")


def test_redis_stopped_and_restarted_under_strict_traffic(h):
    """Strict traffic on two nodes while Redis is stopped, then started
    again on the same port (empty, the script unknown to it): no request
    waits past timeout= + 50 ms, every answer is 200 or 429 (on_error=local
    decides meanwhile: at once while Redis is known down), and once each
    node has seen Redis back (after its backoff) a fresh key gets exactly
    its limit again (the script loaded anew after NOSCRIPT)."""
    r = h.redis()
    nodes = [h.nginx(conf(r, "200ms"), SERVER, files=FILES) for _ in range(2)]
    stop = threading.Event()
    answers = []

    def traffic(n, i):
        j = 0
        while not stop.is_set():
            answers.append(n.get("/strict?k=" + h.key("t%d-%d" % (i, j % 20)), timeout=3.0))
            j += 1
            time.sleep(0.01)

    ts = [threading.Thread(target=traffic, args=(n, i)) for i, n in enumerate(nodes)]
    for t in ts:
        t.start()
    try:
        time.sleep(0.5)
        r.stop()
        time.sleep(1.5)
        r.start()
        time.sleep(1.5)
    finally:
        stop.set()
        for t in ts:
            t.join(30)
    statuses = sorted(set(st for st, _ in answers), key=str)
    slowest = max(el for _, el in answers)
    # back once a try after its backoff (at most 5 s) reaches Redis
    back = wait_for(lambda: all('zone "s": Redis %s is reachable again' % r.url in n.error_log_text()
                                for n in nodes), 7.0)
    h.check(back, "zone s is reachable again on both nodes within 7 s of the restart")
    h.wait_minute_room(15)
    k = h.key("after")
    got = flood(nodes, "/one?k=" + k, per_node=10, threads=4)
    h.note("%d answers while Redis went away and came back: %s, slowest %.0f ms; then a fresh "
           "5r/m key on two nodes: %d allowed" % (len(answers), statuses, slowest * 1000,
                                                  got.count(200)))
    h.check(set(statuses) <= {200, 429}, "every answer 200 or 429: %s" % statuses)
    h.check(slowest <= 0.25, "no request waited past timeout=200ms + 50 ms: %.0f ms" % (slowest * 1000))
    h.check(got.count(200) == 5, "exact again once Redis is back: %d allowed of 5r/m" % got.count(200))


def curl_h2(port, paths, timeout=5.0):
    """`paths` as HTTP/2 streams of one connection (curl, prior knowledge,
    all at once); returns [(status, seconds)] in the order they finished."""
    import re
    import subprocess
    args = ["curl", "-sS", "--no-progress-meter", "--http2-prior-knowledge", "--parallel",
            "--parallel-immediate", "--max-time", str(timeout), "-w", "%{http_code} %{time_total}\\n"]
    for p in paths:
        args += ["-o", "/dev/null", "http://%s:%d%s" % (HOST, port, p)]
    out = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=timeout + 10).stdout.decode("utf-8", "replace")
    return [(int(c), float(t)) for c, t in re.findall(r"(\d{3}) ([0-9.]+)", out)]


def test_http2_streams_wait_and_resume(h):
    """Strict requests as HTTP/2 streams of one connection: 7 on a fresh
    5r/m key -> 5 x 200, 2 x 429; with Redis paused, 3 streams each answered
    by on_error=local after timeout=200ms; a connection closed while its
    stream waits leaves the worker serving."""
    r = h.redis()
    n = h.nginx(conf(r), SERVER.replace("location = /strict", "http2 on;\n        location = /strict"),
                files=FILES)
    h.wait_minute_room(10)
    k = h.key("h2")
    got = curl_h2(n.port, ["/one?k=" + k] * 7)
    codes = sorted(c for c, _ in got)
    h.check(codes == [200] * 5 + [429] * 2, "7 streams on 5r/m: %s" % got)
    r.cmd("CLIENT", "PAUSE", "1200", "ALL")
    paused = curl_h2(n.port, ["/strict?k=" + h.key("p%d" % i) for i in range(3)])
    h.note("HTTP/2: 7 streams on 5r/m -> %s; Redis paused, 3 streams -> %s" % (codes, paused))
    h.check([c for c, _ in paused] == [200] * 3, "on_error=local answers 200: %s" % paused)
    h.check(all(0.19 <= t <= 0.3 for _, t in paused), "after timeout=200ms: %s" % paused)
    time.sleep(1.3)
    # a stream that waits needs the backend known up again (a try after
    # its backoff, which the pause may have doubled)
    h.check(wait_for(lambda: zone_up(n, "s") is True, 6.0), "zone s is up again")
    r.cmd("CLIENT", "PAUSE", "600", "ALL")
    gone = curl_h2(n.port, ["/strict?k=" + h.key("gone")], timeout=0.1)
    time.sleep(0.8)
    after = curl_h2(n.port, ["/strict?k=" + h.key("after")])
    h.check(gone == [] or gone[0][0] == 0, "the first client gave up: %s" % gone)
    h.check([c for c, _ in after] == [200], "then served: %s" % after)
    log = n.error_log_text()
    h.check("[alert]" not in log and "signal 11" not in log, "no worker crashed")


SCRIPT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "core", "src", "strict.lua")


def run_script(r, groups, timed=False, same=False):
    """One call of the strict script (its text, with EVAL) for `groups`:
    each (key, limit, period_s, elapsed_ms, [(cost, deadline), ...]) and
    optionally the start of its window (s, 6000 unless given: the key's
    windows start at 6000 s and 5940 s). `same`: a group of the same
    limit, period and time into the window as the one before it says so by
    '=' (as the module writes it)."""
    with open(SCRIPT_FILE) as f:
        script = f.read()
    keys, args, before = [], ["1" if timed else "0"], None
    for key, limit, period, elapsed, reqs, *start in groups:
        start = start[0] if start else 6000
        keys += ["%s:%d" % (key, start), "%s:%d" % (key, start - period)]
        four = [elapsed, limit, period * 1000, 2 * period]
        args += ["="] if same and four == before else four
        before = four
        args.append(len(reqs))
        for cost, dl in reqs:
            args += [cost, dl]
    return r.cmd("EVAL", script, len(keys), *keys, *args, raise_errors=False)


def test_one_script_call_decides_several_keys_and_fails_a_key_alone(h):
    """The strict script run on Redis with several groups (keys) in one
    call: each decided as if called alone, its counts and flags in one flat
    answer, a counter's TTL set when the call made it; a counter that is
    not an integer, or a key of another type, fails its group alone (-1,
    nothing counted for it, the others decided and counted), and a call of
    that group alone answers the script's error."""
    r = h.redis()
    a, b, c, d = ("{%s}" % h.key(x) for x in "abcd")
    r.cmd("SET", b + ":5940", 10)
    r.cmd("SET", c + ":6000", 4)
    # a: fresh, 2 allowed of 3; b: 10 in the previous window at half of
    # the period weighs 5 of a limit of 8, so 3 of 4 pass (costs 1, 2, 1
    # 1: the 2 fits, the last does not); c: 4 of 5 used, one counted
    # whatever the estimate (-1), then one more check refused
    got = run_script(r, [(a, 2, 60, 0, [(1, 0), (1, 0), (1, 0)]),
                         (b, 8, 60, 30000, [(1, 0), (2, 0), (1, 0)]),
                         (c, 5, 60, 0, [(1, -1), (1, 0)])])
    h.note("three groups: %s" % (got,))
    h.check(got == [2, 0, 1, 1, 0, 3, 10, 1, 1, 0, 5, 0, 1, 0], "each group decided: %s" % (got,))
    h.check([r.cmd("GET", k + ":6000") for k in (a, b, c)] == ["2", "3", "5"], "counted")
    ttl_a, ttl_c = int(r.cmd("TTL", a + ":6000")), int(r.cmd("TTL", c + ":6000"))
    h.check(100 < ttl_a <= 120 and ttl_c == -1, "TTL set by the call that made the counter: %d %d"
            % (ttl_a, ttl_c))
    # a past deadline: not checked, not counted (2); a future one is
    past, future = int(time.time() * 1000) - 1000, int(time.time() * 1000) + 60000
    got = run_script(r, [(d, 9, 60, 0, [(1, past), (1, future)])], timed=True)
    h.check(got == [1, 0, 2, 1], "a request past its deadline is not counted: %s" % (got,))
    # a bad counter: -1 for its group alone, first in the call or after
    # another group counted; the others decided and counted
    r.cmd("SET", d + ":5940", "text")
    got = run_script(r, [(d, 9, 60, 0, [(1, 0)]), (a, 9, 60, 0, [(1, 0)])])
    h.check(got == [-1, 0, 0, 3, 0, 1], "the bad group first fails alone: %s" % (got,))
    got = run_script(r, [(a, 9, 60, 0, [(1, 0)]), (d, 9, 60, 0, [(1, 0), (1, 0)]),
                         (b, 9, 60, 60000, [(1, 0)])])
    h.check(got == [4, 0, 1, -1, 0, 0, 0, 4, 10, 1], "the bad group after a count fails alone: %s"
            % (got,))
    h.check(r.cmd("GET", d + ":6000") == "1", "and counts nothing (1 from before)")
    alone = run_script(r, [(d, 9, 60, 0, [(1, 0)])])
    h.check(isinstance(alone, RedisError) and "not an integer" in str(alone),
            "alone: the script's error: %s" % alone)
    r.cmd("DEL", d + ":5940", d + ":6000")
    r.cmd("RPUSH", d + ":6000", "x")
    got = run_script(r, [(a, 9, 60, 0, [(1, 0)]), (d, 9, 60, 0, [(1, 0)])])
    alone = run_script(r, [(d, 9, 60, 0, [(1, 0)])])
    h.note("a list as the counter, after a count: %s; alone: %s" % (got, alone))
    h.check(got == [5, 0, 1, -1, 0, 0], "INCRBY's WRONGTYPE fails the group alone: %s" % (got,))
    h.check(isinstance(alone, RedisError) and "WRONGTYPE" in str(alone), "alone: the error: %s" % alone)
    h.check(r.cmd("GET", a + ":6000") == "5", "the other group counted once")
    # a group named '=' takes the limit, period, time and TTL of the group
    # before it: f is decided against a limit of 8 at half the window (its
    # previous window's 10 weigh 5) and its new counter gets the TTL; g,
    # after them, has its own limit
    e, f, g = ("{%s}" % h.key(x) for x in "efg")
    r.cmd("SET", f + ":5940", 10)
    got = run_script(r, [(e, 8, 60, 30000, [(1, 0), (2, 0)]), (f, 8, 60, 30000, [(1, 0), (3, 0)]),
                         (g, 3, 60, 30000, [(1, 0)])], same=True)
    h.check(got == [3, 0, 1, 1, 1, 10, 1, 0, 1, 0, 1], "groups by '=' decided as written out: %s"
            % (got,))
    ttl_f = int(r.cmd("TTL", f + ":6000"))
    h.check(100 < ttl_f <= 120, "and the TTL of the group before: %d" % ttl_f)
    # one read for the call, and a counter an earlier group of the call
    # wrote read as it left it: two limits of one key (2 of 2, then 1 more
    # of 3), and a window that is the next group's previous one (2 in the
    # window before weigh 2 at the start of the next: 1 more of 3)
    t = "{%s}" % h.key("tiers")
    got = run_script(r, [(t, 2, 60, 0, [(1, 0), (1, 0)]), (t, 3, 60, 0, [(1, 0), (1, 0)])])
    h.check(got == [2, 0, 1, 1, 3, 0, 1, 0], "two limits of one key in one call: %s" % (got,))
    h.check(r.cmd("GET", t + ":6000") == "3", "counted 3")
    w = "{%s}" % h.key("windows")
    got = run_script(r, [(w, 5, 60, 59000, [(1, 0), (1, 0)], 5940),
                         (w, 3, 60, 0, [(1, 0), (1, 0)])])
    h.check(got == [2, 0, 1, 1, 1, 2, 1, 0], "a window and the next one in one call: %s" % (got,))
    h.check([r.cmd("GET", w + ":%d" % s) for s in (5940, 6000)] == ["2", "1"], "counted 2 and 1")


def test_strict_waits_on_http2_streams(h):
    """HTTP/2: 30 streams of one connection wait for Redis (writes paused
    0.8 s) and each gets its answer, counted once; then 20 streams waiting
    are reset by the client (curl gives up after 0.3 s) while Redis is
    paused: nothing crashes, no alert, and the next streams are answered."""
    r = h.redis()
    n = h.nginx(conf(r, timeout="2s"), SERVER + "        http2 on;\n", files=FILES)
    h.wait_minute_room(10)
    h.check(n.get("/strict?k=" + h.key("warm"))[0] == 200, "warm-up")
    r.cmd("CLIENT", "PAUSE", "800", "WRITE")
    t0 = time.monotonic()
    many = curl_h2(n.port, ["/strict?k=" + h.key("h2-%d" % i) for i in range(30)])
    took = time.monotonic() - t0
    counted = [redis_count(r, h.key("h2-%d" % i), "s") for i in range(30)]
    h.note("30 streams waiting: %s in %.2f s; counts %s" % (sorted({c for c, _ in many}), took, set(counted)))
    h.check([c for c, _ in many] == [200] * 30, "every stream answered: %s" % many)
    h.check(min(t for _, t in many) >= 0.5, "they waited for Redis: %s" % many)
    h.check(counted == [1] * 30, "each counted once: %s" % counted)
    r.cmd("CLIENT", "PAUSE", "1000", "WRITE")
    reset = curl_h2(n.port, ["/strict?k=" + h.key("rst-%d" % i) for i in range(20)], timeout=0.3)
    time.sleep(1.5)
    after = curl_h2(n.port, ["/strict?k=" + h.key("after-%d" % i) for i in range(5)])
    st = json.loads(n.request("/metrics?format=json")[2])["zones"]["s"]
    log = n.error_log_text()
    h.note("20 streams reset while waiting: %s; then %s; strict waits %s"
           % (reset, after, st["redis"]["strict"]))
    h.check(all(c == 0 for c, _ in reset), "the client gave up on every stream: %s" % reset)
    h.check([c for c, _ in after] == [200] * 5, "the next streams are answered: %s" % after)
    h.check("exited on signal" not in log and "[alert]" not in log, "no crash, no alert")
    h.check(st["redis"]["strict"]["waits"] >= 56, "every strict wait was counted: %s" % st["redis"]["strict"])
