"""When counts reach Redis (`ratelimit_core::sync`): a key far
from its limit waits up to `hold=` on the node, a key near its limit goes
at once, nothing held is lost on a reload, and many
keys far below their limits cost far less than a command per request while
Redis ends up with every count.
"""

import time

from harness import wait_for


def redis_sum(r, pattern):
    return sum(int(r.cmd("GET", k) or 0) for k in r.keys(pattern))


def calls(r, cmd):
    """Calls of `cmd` Redis ran; for "get", those of counters: the node's
    sender reads the zone's controls every 500 ms (an EVAL that runs one
    GET, of their version), which is not a counter's GET."""
    stats = r.info_commandstats()
    n = int(stats.get(cmd, {}).get("calls", 0))
    if cmd == "get":
        n -= int(stats.get("eval", {}).get("calls", 0))
    return n


def incrby_calls(r):
    return calls(r, "incrby")


FILES = {"t": "ok\n", "s": "ok\n", "q": "ok\n", "q2": "ok\n"}


def zone(url, extra=""):
    return "    redis_ratelimit_zone $arg_k zone=z:1m redis=%s %s;\n" % (url, extra)


LOC = ("        location = /t { redis_ratelimit z 6000r/m; }\n"
       "        location = /s { redis_ratelimit z 20r/m; }\n"
       "        location = /q { redis_ratelimit z 1000r/s; }\n"
       "        location = /q2 { redis_ratelimit z 1000r/s; redis_ratelimit z 100000r/m; }\n")


def test_far_key_waits_for_the_hold(h):
    """hold=1500ms, 6000r/m: six requests of a fresh key wait on the node
    (a key new to the node holds as one node in 32: 23 requests at this
    limit) — none in Redis 0.7 s later — and arrive together, in one
    command (SET NX EX: the key's first count makes its counter), about
    1.5 s after the first."""
    r = h.redis()
    ng = h.nginx(zone(r.url, "hold=1500ms"), LOC)
    h.wait_minute_room(8)
    k = h.key("far")
    pat = "rl:{z:%s}:60:*" % k
    calls0 = incrby_calls(r) + calls(r, "set")
    t0 = time.monotonic()
    for _ in range(6):
        h.check(ng.get("/t?k=" + k)[0] == 200, "far request")
    time.sleep(0.7)
    early = redis_sum(r, pat)
    landed = wait_for(lambda: redis_sum(r, pat) == 6, 3.0, 0.01)
    after = time.monotonic() - t0
    sent = incrby_calls(r) + calls(r, "set") - calls0
    h.note("held: Redis %d of 6 after 0.7 s, 6 after %.2f s, %d INCRBY or SET" % (early, after, sent))
    h.check(early == 0, "six far requests should wait on the node: Redis holds %d after 0.7 s" % early)
    h.check(landed, "the held counts did not reach Redis within 3.7 s")
    h.check(1.3 <= after <= 2.5, "held counts should arrive about hold=1.5 s after the first: %.2f s" % after)
    h.check(sent == 1, "the six held requests should cost one command, cost %d" % sent)


def test_near_key_goes_at_once(h):
    """20r/m with hold=30s: from half the limit on, every request reaches
    Redis within a round trip or two, whatever the hold."""
    r = h.redis()
    ng = h.nginx(zone(r.url, "hold=30s"), LOC, files={"t": "ok\n", "s": "ok\n"})
    h.wait_minute_room(8)
    k = h.key("near")
    pat = "rl:{z:%s}:60:*" % k
    for _ in range(10):
        h.check(ng.get("/s?k=" + k)[0] == 200, "request below the limit")
    t0 = time.monotonic()
    landed = wait_for(lambda: redis_sum(r, pat) == 10, 2.0, 0.005)
    took = time.monotonic() - t0
    h.note("10 of 20r/m (half the limit): all 10 in Redis %.0f ms after the tenth" % (took * 1000))
    h.check(landed and took < 0.5, "a key at half its limit should be in Redis at once: %s after %.2f s"
            % (redis_sum(r, pat), took))


def test_held_counts_survive_a_reload(h):
    """hold=30s: counts held on the node go to Redis when its workers exit
    on a reload, not 30 s later."""
    r = h.redis()
    ng = h.nginx(zone(r.url, "hold=30s"), LOC)
    h.wait_minute_room(10)
    k = h.key("reload")
    pat = "rl:{z:%s}:60:*" % k
    for _ in range(8):
        h.check(ng.get("/t?k=" + k)[0] == 200, "far request")
    time.sleep(0.3)
    held = redis_sum(r, pat)
    t0 = time.monotonic()
    ng.reload()
    landed = wait_for(lambda: redis_sum(r, pat) == 8, 3.0, 0.01)
    h.note("before the reload Redis held %d of 8; all 8 %.2f s after it" % (held, time.monotonic() - t0))
    h.check(held == 0, "8 far requests should be held before the reload: Redis holds %d" % held)
    h.check(landed, "held counts lost on reload: Redis holds %d of 8" % redis_sum(r, pat))


def test_many_far_keys_cost_little_and_lose_nothing(h):
    """Two nodes, 100 keys at 6000r/m, 2 000 requests spread over both
    nodes (default hold=5s): every count reaches Redis, for far less than
    one command per request: each node holds a key's ten requests and sends
    them in one (0.1 per request when the run fits in one hold, plus the
    EXPIRE or the second try of a first count)."""
    r = h.redis()
    a = h.nginx(zone(r.url), LOC)
    b = h.nginx(zone(r.url), LOC)
    h.wait_minute_room(20)
    keys = [h.key("m%d" % i) for i in range(100)]
    def counting():
        return sum(calls(r, c) for c in ("incrby", "set", "expire"))

    calls0 = counting()
    statuses = []
    for rnd in range(20):
        for i, k in enumerate(keys):
            node = a if (i + rnd) % 2 else b
            statuses.append(node.get("/t?k=" + k)[0])
    ok = statuses.count(200)

    def in_redis():
        return sum(redis_sum(r, "rl:{z:%s}:60:*" % k) for k in keys)

    total = wait_for(lambda: in_redis() == 2000, 8.0, 0.1)
    got = in_redis()
    spent = counting() - calls0
    h.note("2000 requests (%d x 200): Redis holds %d, %d INCRBY, SET or EXPIRE (%.3f per request)"
           % (ok, got, spent, spent / 2000.0))
    h.check(ok == 2000, "every request is far below its limit: %d x 200" % ok)
    h.check(total, "Redis should hold all 2000 counts, holds %d" % got)
    h.check(spent <= 0.35 * 2000, "%d commands for 2000 far requests: held counts should coalesce"
            % spent)


def carries(h, path):
    """The quiet-key check below on `path`; returns (incr, sets, exp)."""
    r = h.redis()
    ng = h.nginx(zone(r.url), LOC, files=FILES)
    k = h.key("quiet")
    pat = "rl:{z:%s}:1:*" % k
    incr0, exp0, set0 = calls(r, "incrby"), calls(r, "expire"), calls(r, "set")
    # every counter seen, with its largest value and first TTL (it lives
    # 2 s: the first may be gone before the last is written)
    seen, ttls = {}, {}

    def watch():
        for c in r.keys(pat):
            v = int(r.cmd("GET", c) or 0)
            if c not in ttls:
                ttls[c] = int(r.cmd("PTTL", c))
            seen[c] = max(seen.get(c, 0), v)
        return seen

    sent, windows, t_end = 0, set(), time.monotonic() + 4.5
    while time.monotonic() < t_end:
        h.check(ng.get("%s?k=%s" % (path, k))[0] == 200, "quiet request")
        sent += 1
        windows.add(int(time.time()))
        watch()
        time.sleep(0.25)
    landed = wait_for(lambda: sum(watch().values()) == sent, 7.0, 0.02)
    incr, exp = calls(r, "incrby") - incr0, calls(r, "expire") - exp0
    sets = calls(r, "set") - set0
    h.note("%d requests over %d windows: Redis got %d in %d counters %s (TTLs %s), "
           "%d INCRBY, %d EXPIRE, %d SET NX EX"
           % (sent, len(windows), sum(seen.values()), len(seen), sorted(seen.values()),
              sorted(ttls.values()), incr, exp, sets))
    counters, ttls = seen, list(ttls.values())
    h.check(landed, "every count reaches Redis: %d of %d" % (sum(seen.values()), sent))
    h.check(len(windows) >= 5, "the requests spanned %d windows" % len(windows))
    h.check(len(counters) <= 4, "carried: %d counters for %d windows" % (len(counters), len(windows)))
    h.check(all(0 < t <= 2000 for t in ttls), "every counter expires within 2 periods (ms): %s" % ttls)
    return incr, sets, exp


def test_quiet_key_carries_its_counts_across_windows(h):
    """1000r/s, default hold=5s: a key seen 4 times a second for 4.5 s
    (five or six 1 s windows) is far from its limit, so the node carries
    what it holds from window to window and sends it into the counter of
    the window current when it goes: every count reaches Redis, in two or
    three counters (until its first reply a node holds little of a key it
    does not know: one node in 32, 3 requests at this limit; then the rest
    is carried into one; a first reply later than a window, on a busy
    machine, costs one more), for at most four INCRBY (or SET NX EX, below)
    — against one INCRBY and one EXPIRE per window without carrying. Each
    counter has its TTL."""
    incr, sets, exp = carries(h, "/q")
    h.check(incr + sets <= 4, "carried: %d INCRBY + %d SET" % (incr, sets))
    h.check(exp <= incr, "an EXPIRE only for a counter an INCRBY made: %d EXPIRE, %d INCRBY" % (exp, incr))


def test_quiet_key_carries_under_two_limits(h):
    """The same under a location with two limits of the zone (`1000r/s`
    and `100000r/m`): the per-second counters are carried alike (the
    limits' send times are combined so that a key held by all of them
    stays held)."""
    carries(h, "/q2")



def test_held_counts_may_take_as_much_memory_as_the_zone(h):
    """8 000 far keys of 250 bytes (about 2.8 MB of held counts, past the
    2 MiB floor): a worker of a 1m zone holds at most 2 MiB and sends the
    earliest held first (at least what does not fit in 2 MiB reaches Redis
    at once),
    one of an 8m zone holds them all (nothing in Redis until its reload),
    and every count reaches Redis from both."""
    r = h.redis()
    loc = "        location = /t { redis_ratelimit z 6000r/m; }\n"
    small = h.nginx("    redis_ratelimit_zone $arg_k zone=z:1m redis=%s prefix=s: hold=30s;\n" % r.url, loc)
    big = h.nginx("    redis_ratelimit_zone $arg_k zone=z:8m redis=%s prefix=b: hold=30s;\n" % r.url, loc)
    h.wait_minute_room(30)
    tag = h.key("mem")
    keys = ["%s-%05d-%s" % (tag, i, "x" * 230) for i in range(8000)]
    for n in (small, big):
        sts = n.burst(["/t?k=" + k for k in keys], threads=8, timeout=10.0)
        h.check(sts.count(200) == len(keys), "every far request passes: %s" % sorted(set(map(str, sts))))
    time.sleep(1.0)

    def in_redis(prefix):
        return redis_sum(r, "%s{z:%s-*" % (prefix, tag))

    early_small, early_big = in_redis("s:"), in_redis("b:")
    for n in (small, big):
        n.reload()
    done = wait_for(lambda: in_redis("s:") == 8000 and in_redis("b:") == 8000, 15.0, 0.2)
    h.note("8000 held keys of 250 bytes: 1m zone sent %d before its reload, 8m zone %d; after: %d and %d"
           % (early_small, early_big, in_redis("s:"), in_redis("b:")))
    # what cannot be held within 2 MiB went: an item is accounted as 96
    # bytes plus its tag ("z:" + key; batch::ITEM_OVERHEAD)
    item = 96 + len("z:") + len(keys[0])
    must = len(keys) - (2 << 20) // item
    h.check(early_small >= must, "past 2 MiB the earliest held go at once: %d in Redis, at least %d"
            % (early_small, must))
    h.check(early_big == 0, "an 8m zone holds 2.8 MB of counts: %d in Redis" % early_big)
    h.check(done, "every count reaches Redis: %d and %d of 8000" % (in_redis("s:"), in_redis("b:")))


def quiet_traffic(h, ng, r, k, seconds):
    """Requests of key `k` every 0.1 s on /q (1000r/s: far below); every
    counter of the key seen meanwhile, with its largest value and first
    TTL (ms). Returns (sent, seen, ttls)."""
    pat = "rl:{z:%s}:1:*" % k
    seen, ttls = {}, {}

    def watch():
        for c in r.keys(pat):
            if c not in ttls:
                ttls[c] = int(r.cmd("PTTL", c))
            # MGET: the module's own GETs are counted by the tests
            seen[c] = max(seen.get(c, 0), int(r.cmd("MGET", c)[0] or 0))

    sent, t_end = 0, time.monotonic() + seconds
    while time.monotonic() < t_end:
        h.check(ng.get("/q?k=" + k)[0] == 200, "quiet request")
        sent += 1
        watch()
        time.sleep(0.1)
    return sent, seen, ttls, watch


def test_a_quiet_counter_the_node_makes_alone_is_one_set_nx_ex(h):
    """A 1000r/s key only this node counts (hold=300ms, so that it learns
    quickly that the key's traffic is its own): once its share is known, a
    window's counter is made with its TTL in one command, SET NX EX,
    instead of INCRBY and EXPIRE; every count lands, every counter
    expires."""
    r = h.redis()
    ng = h.nginx(zone(r.url, "hold=300ms"), LOC, files=FILES)
    k = h.key("alone")
    set0, incr0, exp0, get0 = calls(r, "set"), calls(r, "incrby"), calls(r, "expire"), calls(r, "get")
    sent, seen, ttls, watch = quiet_traffic(h, ng, r, k, 5.0)
    landed = wait_for(lambda: (watch(), sum(seen.values()))[1] == sent, 5.0, 0.02)
    sets, incr, exp = calls(r, "set") - set0, calls(r, "incrby") - incr0, calls(r, "expire") - exp0
    gets = calls(r, "get") - get0
    h.note("%d requests in %d counters: %d SET NX EX, %d INCRBY, %d EXPIRE, %d GET of a previous "
           "window; TTLs %s" % (sent, len(seen), sets, incr, exp, gets, sorted(ttls.values())))
    # a window whose counter SET NX made once the node knows the key is
    # its own: the previous one was this node's own count, not read again
    # while the key stays quiet (the first windows, before its share is
    # learnt from a few replies, read it: others may have counted there)
    h.check(gets <= 3 and gets < len(seen), "no previous-window GET once the key is known to be the "
            "node's own: %d GET, %d SET, %d counters" % (gets, sets, len(seen)))
    h.check(landed, "every count lands: %d of %d" % (sum(seen.values()), sent))
    h.check(sets >= 2, "windows' counters made by SET NX EX: %d" % sets)
    h.check(exp + sets <= len(seen), "no EXPIRE after a SET NX EX: %d EXPIRE, %d SET, %d counters"
            % (exp, sets, len(seen)))
    h.check(all(0 < t <= 2000 for t in ttls.values()), "every counter expires: %s" % ttls)


def test_a_quiet_counter_that_exists_already_is_counted_by_incrby(h):
    """The guess that a counter is new can be wrong (another node made it):
    the same traffic as above, with the key's counters from its fourth
    window on planted at 10 beforehand: each SET NX finds its counter
    there, an INCRBY follows, and every count lands on top of the planted
    ones."""
    r = h.redis()
    ng = h.nginx(zone(r.url, "hold=300ms"), LOC, files=FILES)
    k = h.key("planted")
    now = int(time.time())
    planted = set("rl:{z:%s}:1:%d" % (k, w) for w in range(now + 3, now + 12))
    for c in planted:
        r.cmd("SET", c, "10", "EX", "20")
    set0, incr0 = calls(r, "set"), calls(r, "incrby")
    sent, seen, _, watch = quiet_traffic(h, ng, r, k, 5.0)

    def added():
        watch()
        return sum(v - (10 if c in planted else 0) for c, v in seen.items())

    landed = wait_for(lambda: added() == sent, 5.0, 0.02)
    sets, incr = calls(r, "set") - set0, calls(r, "incrby") - incr0
    h.note("%d requests, counters from the fourth window planted: %d counted, %d SET NX, %d INCRBY"
           % (sent, added(), sets, incr))
    h.check(landed, "every count lands: %d of %d" % (added(), sent))
    h.check(sets >= 1, "SET NX tried on a planted counter: %d" % sets)


def test_first_counts_of_new_keys_learn_whether_they_make_their_counters(h):
    """Most keys of real traffic are new to the node (one client, a few
    requests). Their first counts make their counters with SET NX EX (one
    command) while most such counts do make them, and go as INCRBY (EXPIRE
    only when it made the counter) once most find them made by another
    node (the last 8 remembered, `sync::FirstCounts`). 6000r/m, hold=1s,
    one request per key, 50 ms apart: 30 new keys cost 30 SET NX EX and
    nothing else; of 30 keys whose counters another node made (planted at
    5), the first 9 try SET NX and the rest go as INCRBY at once; of 40 new
    keys after that, the first 8 go as INCRBY and EXPIRE, the rest as SET
    NX EX again. Every count lands, every counter expires."""
    r = h.redis()
    ng = h.nginx(zone(r.url, "hold=1s"), LOC, files=FILES)
    h.wait_minute_room(20)
    w = int(time.time()) // 60 * 60
    names = {}

    def counter(k):
        return "rl:{z:%s}:60:%d" % (k, w)

    def phase(name, n, planted=0):
        keys = [h.key("%s%d" % (name, i)) for i in range(n)]
        for k in keys:
            if planted:
                r.cmd("SET", counter(k), str(planted), "EX", "120")
        before = {c: calls(r, c) for c in ("set", "incrby", "expire", "get")}
        for k in keys:
            h.check(ng.get("/t?k=" + k)[0] == 200, "a request far below its limit")
            time.sleep(0.05)

        def landed():
            return all(int(r.cmd("MGET", counter(k))[0] or 0) == planted + 1 for k in keys)

        ok = wait_for(landed, 4.0, 0.05)
        time.sleep(0.2)
        got = {c: calls(r, c) - before[c] for c in before}
        ttls = [int(r.cmd("TTL", counter(k))) for k in keys]
        h.note("%s: %d keys%s: %d SET, %d INCRBY, %d EXPIRE, %d GET; TTLs %d..%d"
               % (name, n, " (counters planted at %d)" % planted if planted else "", got["set"],
                  got["incrby"], got["expire"], got["get"], min(ttls), max(ttls)))
        h.check(ok, "%s: every count lands" % name)
        h.check(all(0 < t <= 120 for t in ttls), "%s: every counter expires: %s" % (name, ttls))
        names[name] = got
        return got

    new = phase("new", 30)
    h.check(new["set"] == 30 and new["incrby"] == 0 and new["expire"] == 0,
            "30 new keys: one SET NX EX each, nothing else: %s" % new)
    made = phase("made", 30, planted=5)
    h.check(made["set"] <= 10, "counters made by another node: SET NX stops after 9 misses: %d"
            % made["set"])
    h.check(made["incrby"] == 30 and made["expire"] == 0 and made["get"] == 0,
            "counters made by another node: one INCRBY each, no EXPIRE, no GET: %s" % made)
    back = phase("back", 40)
    h.check(back["incrby"] + back["set"] == 40, "40 new keys: one count each: %s" % back)
    h.check(back["expire"] == back["incrby"], "an INCRBY that makes a counter sets its TTL: %s" % back)
    h.check(back["set"] >= 25, "SET NX EX again once most first counts make their counters: %s" % back)
