"""limit_req's bucket on a zone with Redis: one bucket for the fleet. Its
level lives in Redis (drained by Redis's clock, with a TTL until it is
empty), each request the node does not already know to be over the burst
is decided there by the strict script, so nodes that flood a key together
get what one limit_req would give, delays follow the fleet's level, and a
key over its burst is refused without a round trip."""

import threading
import time

HTTP = """
    redis_ratelimit_zone $arg_k zone=b:1m redis=%s timeout=500ms;
    log_format st $redis_ratelimit_status;
"""
SERVER = """
        add_header X-Status $redis_ratelimit_status always;
        location = /nodelay { redis_ratelimit b 10r/s burst=20 nodelay; try_files /t =404; }
        location = /strict  { redis_ratelimit b 10r/s burst=20 nodelay strict; try_files /t =404; }
        location = /five    { redis_ratelimit b 10r/s burst=5 nodelay; try_files /t =404; }
        location = /delay   { redis_ratelimit b 2r/s burst=4 delay=1; try_files /t =404; }
        location = /slow    { redis_ratelimit b 1r/m burst=2 nodelay; try_files /t =404; }
        location = /wide    { redis_ratelimit b 50r/s burst=100 nodelay; try_files /t =404; }
        location = /hot     { redis_ratelimit b 100000r/s burst=5000 nodelay; try_files /t =404; }
"""


def nodes(h, r, n, workers=1):
    return [h.nginx(HTTP % r.url, SERVER, workers=workers) for _ in range(n)]


def flood_for(nodes_, path, seconds, threads=8):
    """Every node gets requests from `threads` connections at once, back to
    back, for `seconds`; returns (statuses, the time from the first request
    sent to the last answered)."""
    out, lock = [], threading.Lock()
    start = time.monotonic()
    end = start + seconds

    def run(n):
        mine = []
        while time.monotonic() < end:
            mine.append(n.get(path)[0])
        with lock:
            out.extend(mine)

    ts = [threading.Thread(target=run, args=(n,)) for n in nodes_ for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + 30)
    return out, time.monotonic() - start


def paced_pair(a, b, path, count, every):
    """`count` requests to each of two nodes, one every `every` seconds,
    node b half a step after node a; returns (statuses, seconds)."""
    got, lock = [], threading.Lock()

    def paced(n, offset):
        time.sleep(offset)
        t0 = time.monotonic()
        for i in range(count):
            time.sleep(max(0.0, t0 + i * every - time.monotonic()))
            st = n.get(path)[0]
            with lock:
                got.append(st)

    ts = [threading.Thread(target=paced, args=(n, off)) for n, off in ((a, 0), (b, every / 2))]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join(count * every + 30)
    return got, time.monotonic() - t0


def script_calls(r):
    return int(r.info_commandstats().get("evalsha", {}).get("calls", 0))


def test_nodes_flooding_a_fresh_key_get_one_bucket(h):
    """2 and then 4 nodes (2 workers each) flood one fresh key of
    `10r/s burst=20 nodelay` for 3 s: the fleet admits what one limit_req
    would (the burst and the request that fills it, then the rate), not
    that per node; the same with `strict`."""
    r = h.redis()
    ns = nodes(h, r, 4, workers=2)
    for count, path in ((2, "/nodelay"), (4, "/nodelay"), (4, "/strict")):
        k = h.key("flood-%d%s" % (count, path[1:]))
        got, took = flood_for(ns[:count], "%s?k=%s" % (path, k), 3.0)
        ok = got.count(200)
        other = [s for s in got if s not in (200, 429)]
        most = 21 + 10 * took
        h.note("%s, %d nodes, %.2f s: %d requests, %d admitted (one limit_req: at most %.1f)"
               % (path, count, took, len(got), ok, most))
        h.check(not other, "every request is answered 200 or 429: %s" % other[:5])
        h.check(len(got) > 10 * ok, "a flood: %d requests" % len(got))
        h.check(ok <= most + 1, "%d nodes admit at most one bucket's: %d > %.1f" % (count, ok, most))
        h.check(ok >= 21 + 10 * (took - 0.5) - 1, "and about that much: %d" % ok)


def test_two_nodes_at_the_rate_each_share_it(h):
    """Two nodes each receiving 10 r/s (paced) against `10r/s burst=5
    nodelay`: between them they get the burst and the rate, and about half
    of the 20 r/s is rejected, as from one limit_req."""
    r = h.redis()
    a, b = nodes(h, r, 2)
    k = h.key("paced")
    got, _ = paced_pair(a, b, "/five?k=" + k, 30, 0.1)
    ok = got.count(200)
    h.note("2 nodes x 30 requests at 10 r/s: %d admitted (one limit_req: about 6 + 30)" % ok)
    h.check(len(got) == 60 and set(got) <= {200, 429}, "every request answered: %s" % got)
    h.check(30 <= ok <= 38, "the fleet admits about the burst and the rate: %d" % ok)


def test_nodes_deciding_on_their_own_still_share_the_rate(h):
    """`50r/s burst=100 nodelay`, two nodes each at 50 r/s (paced) for 4 s:
    far from the burst each node decides on its own and sends what it
    admitted in batches; the fleet still gets the burst and the rate (about
    301 of 400), not each node's, and a few fewer at most (a batch reaches
    Redis after some of it drained)."""
    r = h.redis()
    a, b = nodes(h, r, 2)
    k = h.key("wide")
    before = script_calls(r)
    got, took = paced_pair(a, b, "/wide?k=" + k, 200, 0.02)
    ok, calls = got.count(200), script_calls(r) - before
    most = 101 + 50 * took
    h.note("2 nodes x 200 requests at 50 r/s in %.2f s: %d admitted (one limit_req: %.0f), "
           "%d script calls" % (took, ok, most, calls))
    h.check(len(got) == 400 and set(got) <= {200, 429}, "every request answered: %s" % set(got))
    # a debt sent late counts a little more than it drained: a few fewer
    h.check(0.92 * most <= ok <= most + 2, "the fleet admits about the burst and the rate: %d" % ok)
    h.check(calls < 400, "some requests decided without a call: %d calls" % calls)


def test_a_hot_key_far_from_its_burst_costs_a_call_per_many_requests(h):
    """One node floods a key far below `100000r/s burst=5000`: it decides
    on its own and sends its debt in batches (a script call per many
    requests), and Redis holds the fleet's level."""
    r = h.redis()
    (n,) = nodes(h, r, 1, workers=2)
    k = h.key("hot")
    before = script_calls(r)
    got, took = flood_for([n], "/hot?k=" + k, 2.0)
    calls = script_calls(r) - before
    level = r.cmd("GET", "rl:{b:%s}:1:b100000" % k)
    h.note("%d requests in %.1f s, %d script calls (%.3f a request); level %s"
           % (len(got), took, calls, calls / max(1, len(got)), level))
    h.check(set(got) == {200}, "all admitted: %s" % set(got))
    h.check(calls * 10 <= len(got), "a call per ten requests or fewer: %d for %d" % (calls, len(got)))
    h.check(level is not None, "Redis holds the key's level")


def test_a_delay_follows_the_fleet_s_level(h):
    """`2r/s burst=4 delay=1`: two requests on node A leave an excess of 1
    (not delayed); the next, on node B, finds the fleet's excess at 2 and
    waits (2 - 1) / 2 r/s = 0.5 s, as it would on A."""
    r = h.redis()
    a, b = nodes(h, r, 2)
    k = h.key("delay")
    first = [a.request("/delay?k=" + k)[1].get("x-status") for _ in range(2)]
    st, headers, _, took = b.request("/delay?k=" + k, timeout=5.0)
    h.note("on A: %s; on B: %s %s in %.3f s" % (first, st, headers.get("x-status"), took))
    h.check(first == [["PASSED"], ["PASSED"]], "not delayed on A: %s" % first)
    h.check(st == 200 and headers.get("x-status") == ["DELAYED"], "delayed on B: %s" % headers)
    h.check(0.35 <= took <= 1.0, "by about 0.5 s: %.3f" % took)


def test_the_level_lives_in_redis_until_the_bucket_is_empty(h):
    """Redis holds the key's bucket as `excess:ms` under
    `<prefix>{<zone>:<key>}:<period>:b<limit>` with a TTL of the time it
    takes to empty, plus a second; never without one."""
    r = h.redis()
    (n,) = nodes(h, r, 1)
    k = h.key("ttl")
    got = [n.get("/slow?k=" + k)[0] for _ in range(4)]
    name = "rl:{b:%s}:60:b1" % k
    value, ttl = r.cmd("GET", name), int(r.cmd("PTTL", name))
    h.note("1r/m burst=2 nodelay: %s; %s = %s, PTTL %d ms" % (got, name, value, ttl))
    h.check(got == [200, 200, 200, 429], "the burst and the request that fills it: %s" % got)
    excess, _, at = str(value).partition(":")
    h.check(excess == "2000" and at.isdigit(), "an excess of 2 requests: %s" % value)
    # (2 + 1) requests at 1r/m drain in 180 s
    h.check(178_000 <= ttl <= 181_000, "lives until it is empty: %d ms" % ttl)


def test_a_key_over_its_burst_is_refused_without_a_round_trip(h):
    """Once the fleet's level is over the burst, the node knows it from the
    script's answer: its next requests are refused without a script call."""
    r = h.redis()
    (n,) = nodes(h, r, 1)
    k = h.key("over")
    first = [n.get("/slow?k=" + k)[0] for _ in range(4)]
    before = script_calls(r)
    later = [n.get("/slow?k=" + k)[0] for _ in range(30)]
    calls = script_calls(r) - before
    h.note("%s, then 30 more: %s with %d script calls" % (first, set(later), calls))
    h.check(first == [200, 200, 200, 429] and set(later) == {429}, "refused: %s %s" % (first, later))
    h.check(calls == 0, "no script call for a key known over its burst: %d" % calls)


def test_redis_down_each_node_keeps_its_own_bucket(h):
    """Redis stopped (`on_error=local`, the default): the node limits from
    its own bucket, started from the fleet's level it last knew; nothing
    hangs."""
    r = h.redis()
    (n,) = nodes(h, r, 1)
    k = h.key("down")
    before = [n.get("/slow?k=" + k)[0] for _ in range(2)]
    r.stop()
    during = [n.get("/slow?k=" + k, timeout=3.0) for _ in range(3)]
    h.note("before: %s; Redis stopped: %s" % (before, [(s, round(t, 3)) for s, t in during]))
    h.check(before == [200, 200], "two pass: %s" % before)
    h.check([s for s, _ in during] == [200, 429, 429], "one more, then refused: %s" % during)
    h.check(all(t < 1.5 for _, t in during), "no request waits past timeout=: %s" % during)
