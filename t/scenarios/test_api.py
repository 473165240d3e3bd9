"""The control API (`redis_ratelimit_api`) and the penalty box (`block=`):
a key blocked or given another rate on one node is so on every node of
the fleet within a second, for as long as asked, through Redis outages,
restarts and reloads; writes need `write=on` and nginx's access control;
bad requests change nothing."""

import json
import re
import time

from harness import http_call, wait_for

HTTP = """
    redis_ratelimit_zone $arg_k zone=api:1m redis=%s timeout=300ms;
    redis_ratelimit_zone $binary_remote_addr zone=ip:1m;
    redis_ratelimit_zone $arg_k zone=mem:1m;
"""
SERVER = """
        location /t      { redis_ratelimit api 5r/m; try_files /t =404; }
        location /wide   { redis_ratelimit api 100r/m; try_files /t =404; }
        location /login  { redis_ratelimit api 3r/m block=6s; try_files /t =404; }
        location /strict { redis_ratelimit api 2r/h strict; try_files /t =404; }
        location /ip     { redis_ratelimit ip 100r/s; try_files /t =404; }
        location /mem    { redis_ratelimit mem 2r/m; try_files /t =404; }
        location /api/   { redis_ratelimit_api write=on; }
        location /ro/    { redis_ratelimit_api; }
        location /closed/ { redis_ratelimit_api write=on; deny all; }
        location = /metrics { redis_ratelimit_metrics; }
"""
NASTY_RE = r"\[(alert|crit|emerg)\]|exited on signal|panick"


def call(n, method, path, body=None, timeout=3.0):
    """(status, headers {lower: value}, body bytes) of one request to `n`."""
    return http_call(n.port, method, path, body, timeout)


def state(n, zone, key):
    st, _, body = call(n, "GET", "/api/zones/%s/keys/%s" % (zone, key))
    assert st == 200, (st, body)
    return json.loads(body)


def status(n, path):
    return n.request(path)[0]


def fleet(h, r, count=3, workers=2):
    return [h.nginx(HTTP % r.url, SERVER, workers=workers) for _ in range(count)]


def test_an_override_set_on_one_node_holds_on_every_node_until_it_ends(h):
    """Three nodes, one Redis: `PUT .../override` `{"rate":"20r/m",
    "ttl":"4s"}` through node A; B and C show it within 1 s and let 10
    requests of a `5r/m` key through; at its end every node limits at
    5r/m again (the 10 counted keep the key over it)."""
    r = h.redis()
    a, b, c = fleet(h, r)
    k = h.key("ov")
    t0 = time.monotonic()
    st, _, body = call(a, "PUT", "/api/zones/api/keys/%s/override" % k,
                       '{"rate": "20r/m", "ttl": "4s"}')
    h.check(st == 200, "PUT override: %s %s" % (st, body))
    h.check(json.loads(body)["override"]["rate"] == "20r/m", body)
    for n in (b, c):
        seen = wait_for(lambda: state(n, "api", k)["override"] is not None, 1.0)
        h.check(seen, "%s shows the override within 1 s: %s" % (n.name, state(n, "api", k)))
    h.note("B and C saw the override %.2f s after the PUT" % (time.monotonic() - t0))
    got = [status(n, "/t?k=" + k) for n in (b, c) for _ in range(5)]
    h.check(got.count(200) == 10, "10 requests of a 5r/m key pass under 20r/m: %s" % got)
    got = [status(a, "/strict?k=" + k) for _ in range(3)]
    h.check(got == [200] * 3, "a strict 2r/h line takes the override too (20r/m): %s" % got)
    still = state(c, "api", k)["override"]
    h.check(still is not None and still["ttl_s"] > 1.5, "held until its end: %s" % still)
    # ends on time: 4 s after the PUT (nodes count it from when they saw it)
    h.check(wait_for(lambda: all(state(n, "api", k)["override"] is None for n in (a, b, c)),
                     4.0 - (time.monotonic() - t0) + 1.0),
            "the override ended on every node")
    ended = time.monotonic() - t0
    h.check(3.9 <= ended <= 5.0, "it ended 4 s after it was set: %.2f s" % ended)
    h.check(status(b, "/t?k=" + k) == 429, "5r/m again: the key is over it")
    h.check(wait_for(lambda: r.cmd("HLEN", "rl:{api}:ctl") == 0, 2.0),
            "Redis let it go: %s" % r.cmd("HGETALL", "rl:{api}:ctl"))


def test_a_block_set_on_one_node_rejects_on_another_and_lifts_on_delete(h):
    """A block through A rejects the key on C within 1 s (429, Retry-After
    the block's time left, also in strict mode); `DELETE` through A lets
    it through on C within 1 s."""
    r = h.redis()
    a, b, c = fleet(h, r)
    k = h.key("blk")
    h.check(status(c, "/wide?k=" + k) == 200, "the key passes first")
    st, _, body = call(a, "PUT", "/api/zones/api/keys/%s/block" % k, '{"ttl": "1h"}')
    h.check(st == 200 and json.loads(body)["blocked"]["ttl_s"] > 3590, "PUT block: %s %s" % (st, body))
    t0 = time.monotonic()
    h.check(wait_for(lambda: status(c, "/wide?k=" + k) == 429, 1.0), "C rejects within 1 s")
    h.note("C rejected %.2f s after the PUT" % (time.monotonic() - t0))
    st, hd, _ = c.request("/t?k=" + k)[:3]
    h.check(st == 429 and 3590 <= int(hd["retry-after"][0]) <= 3600,
            "Retry-After is the block's: %s %s" % (st, hd))
    h.check(status(b, "/strict?k=" + k) == 429, "strict lines reject it too")
    st, _, body = call(a, "DELETE", "/api/zones/api/keys/%s/block" % k)
    h.check(st == 204, "DELETE: %s %s" % (st, body))
    t0 = time.monotonic()
    h.check(wait_for(lambda: status(c, "/wide?k=" + k) == 200, 1.0), "C lets it through within 1 s")
    h.note("C let it through %.2f s after the DELETE" % (time.monotonic() - t0))
    st, _, body = call(a, "DELETE", "/api/zones/api/keys/%s/block" % k)
    h.check(st == 404 and b"no such control" in body, "a second DELETE: 404 %s %s" % (st, body))
    errors = a.error_log_text()
    h.check(re.search(r'\[notice\].*zone "api": key "%s" blocked for 1h \(API\).*client: 127\.0\.0\.1'
                      % re.escape(k), errors), "the change is logged at notice with its caller")
    h.check(re.search(r'key "%s" unblocked \(API\)' % re.escape(k), errors), "the lift is logged")


def test_block_after_a_breach_holds_on_every_node_and_counts_down(h):
    """`block=6s`: the request over `3r/m` on A blocks the key in its zone
    for 6 s on every node (other limits of the zone reject it too), with a
    Retry-After that counts down; then it passes where the count allows;
    `blocks_total` counts it on A, `blocked_keys` on every node."""
    r = h.redis()
    a, b, c = fleet(h, r)
    k = h.key("pen")
    got = [status(a, "/login?k=" + k) for _ in range(4)]
    h.check(got == [200, 200, 200, 429], "3 pass, the 4th is rejected: %s" % got)
    t0 = time.monotonic()
    for n in (b, c):
        h.check(wait_for(lambda: status(n, "/wide?k=" + k) == 429, 1.0),
                "%s rejects the key on another limit of the zone within 1 s" % n.name)
    first = int(c.request("/wide?k=" + k)[1]["retry-after"][0])
    time.sleep(2.0)
    later = int(c.request("/wide?k=" + k)[1]["retry-after"][0])
    h.check(4 <= first <= 6 and first - 3 <= later <= first - 1,
            "Retry-After counts the block down: %d then %d" % (first, later))
    metrics = [json.loads(n.request("/metrics?format=json")[2])["zones"]["api"] for n in (a, b, c)]
    h.check(metrics[0]["blocks"] == 1, "A counted its block: %s" % metrics[0])
    h.check(all(m["blocked_keys"] == 1 for m in metrics), "every node has it blocked: %s" % metrics)
    prom = a.request("/metrics")[2].decode()
    h.check('nginx_redis_ratelimit_blocks_total{zone="api"} 1' in prom, "Prometheus: blocks_total")
    h.check(wait_for(lambda: status(b, "/wide?k=" + k) == 200, 6.0 - (time.monotonic() - t0) + 1.0),
            "after 6 s the key passes where its count allows")
    lifted = time.monotonic() - t0
    h.check(lifted >= 5.0, "not before its end: %.2f s" % lifted)
    h.check(status(b, "/login?k=" + k) == 429, "the 3r/m limit still counts its 3")
    h.check(re.search(r'key "%s" blocked for 6s \(block=\)' % re.escape(k), a.error_log_text()),
            "the penalty is logged at notice")


def test_writes_need_write_on_and_access(h):
    """`PUT` and `DELETE` on a read-only API location: 405 with a problem
    body; on a location that `deny all` closes: 403 (nginx's access
    phase); neither changes anything; reads answer."""
    r = h.redis()
    (a,) = fleet(h, r, count=1)
    k = h.key("ro")
    for method, path, body in (("PUT", "block", '{"ttl":"1m"}'),
                               ("PUT", "override", '{"rate":"9r/s","ttl":"1m"}'),
                               ("DELETE", "block", None)):
        st, hd, got = call(a, method, "/ro/zones/api/keys/%s/%s" % (k, path), body)
        h.check(st == 405 and hd.get("content-type") == "application/problem+json"
                and b"read-only" in got, "read-only: %s %s %s" % (st, hd, got))
        st, _, got = call(a, method, "/closed/zones/api/keys/%s/%s" % (k, path), body)
        h.check(st == 403, "denied: %s %s" % (st, got))
    st, _, got = call(a, "GET", "/ro/zones/api/keys/" + k)
    view = json.loads(got)
    h.check(st == 200 and view["blocked"] is None and view["override"] is None, "unchanged: %s" % got)
    h.check(status(a, "/t?k=" + k) == 200, "the key passes")
    st, _, got = call(a, "GET", "/ro/zones")
    zones = json.loads(got)
    h.check(st == 200 and set(zones) == {"api", "ip", "mem"}, "GET zones: %s" % got)
    h.check(zones["api"]["redis"]["up"] is True and zones["mem"]["redis"] is None, got)
    h.check(zones["api"]["limits"][0] == {"rate": "5r/m"}, got)
    h.check(r.cmd("EXISTS", "rl:{api}:ctl") == 0, "nothing in Redis")


def test_bad_requests_change_nothing_and_crash_nothing(h):
    """1 000 bad requests (garbage and huge bodies, odd and path-like keys,
    unknown zones and methods, bad rates and times): each gets a 4xx, our
    own with a problem body naming the field; afterwards no control
    exists, Redis holds none, the workers are the same, and the log has no
    alert or crash."""
    r = h.redis()
    (a,) = fleet(h, r, count=1)
    pids = sorted(a.worker_pids())
    k = h.key("bad")
    base = "/api/zones/api/keys/%s" % k
    cases = [
        ("PUT", base + "/block", "{"), ("PUT", base + "/block", "[]"),
        ("PUT", base + "/block", "null"), ("PUT", base + "/block", ""),
        ("PUT", base + "/block", '{"ttl":"31d"}'), ("PUT", base + "/block", '{"ttl":"0"}'),
        ("PUT", base + "/block", '{"ttl":"-1s"}'), ("PUT", base + "/block", '{"ttl":1e9}'),
        ("PUT", base + "/block", '{"ttl":"15m","x":1}'), ("PUT", base + "/block", '{"ttl":"15m"} {}'),
        ("PUT", base + "/block", '{"ttl":"\\ud800"}'), ("PUT", base + "/block", b'{"ttl":"\xff"}'),
        ("PUT", base + "/block", "x" * 5000), ("PUT", base + "/block", "{" * 3000),
        ("PUT", base + "/override", '{"ttl":"1h"}'), ("PUT", base + "/override", '{"rate":"fast","ttl":"1h"}'),
        ("PUT", base + "/override", '{"rate":"0r/s","ttl":"1h"}'),
        ("PUT", base + "/override", '{"rate":"10r/s"}'), ("PUT", base + "/override", '{"rate":10,"ttl":"1h"}'),
        ("PUT", base, '{"ttl":"1h"}'), ("POST", base + "/block", '{"ttl":"1h"}'),
        ("PATCH", base + "/override", '{"ttl":"1h"}'), ("PUT", "/api/zones/api", "{}"),
        ("PUT", "/api/zones/nope/keys/x/block", '{"ttl":"1h"}'),
        ("PUT", "/api/zones/%2e%2e/keys/x/block", '{"ttl":"1h"}'),
        ("PUT", "/api/zones/api/keys/%zz/block", '{"ttl":"1h"}'),
        ("PUT", "/api/zones/api/keys/%/block", '{"ttl":"1h"}'),
        ("PUT", "/api/zones/api/keys//block", '{"ttl":"1h"}'),
        ("PUT", "/api/zones/api/keys/a/b/block", '{"ttl":"1h"}'),
        ("PUT", "/api/zones/ip/keys/not-an-ip/block", '{"ttl":"1h"}'),
        ("PUT", "/api/zones/ip/keys/1.2.3.4.5/block", '{"ttl":"1h"}'),
        ("DELETE", "/api/zones/api/keys/%s/override" % k, None),
        ("GET", "/api/zones/api/keys/..%2F..%2Fetc%2Fpasswd/other", None),
        ("GET", "/api/zones/nope", None), ("GET", "/api/other", None),
        ("GET", "/api/zones/api/top?n=0", None), ("GET", "/api/zones/api/top?n=x", None),
        ("PUT", "/api/zones/api/top", "{}"),
    ]
    big = ("PUT", base + "/block", "y" * (2 << 20))
    answers = {}
    sent = 0
    while sent < 1000:
        for method, path, body in cases:
            st, hd, got = call(a, method, path, body)
            sent += 1
            answers.setdefault((method, path, str(body)[:40]), set()).add(st)
            h.check(400 <= st < 500, "%s %s %r: %s %s" % (method, path, str(body)[:60], st, got[:200]))
            if hd.get("content-type") == "application/problem+json":
                doc = json.loads(got)
                h.check(doc["status"] == st and doc["title"] and doc["detail"], got)
            else:
                # nginx's own refusal, before the API sees the request (a
                # `%` it cannot decode in the request line)
                h.check(st == 400 and b"<html>" in got, "%s %s: %s %s" % (method, path, st, got[:200]))
    st, _, _ = call(a, *big, timeout=10.0)
    h.check(st == 413, "a 2 MB body: 413 (%s)" % st)
    # the field at fault is named
    st, _, got = call(a, "PUT", base + "/override", '{"rate":"fast","ttl":"1h"}')
    h.check(json.loads(got)["invalid-params"][0]["name"] == "rate", got)
    st, _, got = call(a, "PUT", base + "/block", '{"ttl":"31d"}')
    h.check(json.loads(got)["invalid-params"][0]["name"] == "ttl", got)
    st, _, got = call(a, "PUT", "/api/zones/ip/keys/host/block", '{"ttl":"1h"}')
    h.check(json.loads(got)["invalid-params"][0]["name"] == "key", got)
    h.note("%d bad requests, statuses: %s" % (sent, sorted({s for v in answers.values() for s in v})))
    zones = json.loads(call(a, "GET", "/api/zones")[2])
    h.check(all(z["blocked_keys"] == 0 and z["overridden_keys"] == 0 for z in zones.values()),
            "no control made: %s" % zones)
    time.sleep(0.6)
    h.check(r.cmd("EXISTS", "rl:{api}:ctl") == 0, "Redis holds none")
    h.check(sorted(a.worker_pids()) == pids, "the same workers")
    h.check(not re.search(NASTY_RE, a.error_log_text()), "no alert, no crash")
    h.check(status(a, "/t?k=" + k) == 200, "the node still limits and serves")


def test_controls_outlive_redis_restarts_outages_reloads_and_new_nodes(h):
    """A block and an override in force while Redis is down stay in force;
    Redis restarted empty gets them back from the nodes; a reload keeps
    them; a node started later learns them; a zone without Redis keeps
    its own across a reload."""
    r = h.redis()
    a, b = fleet(h, r, count=2)
    kb, ko = h.key("keep-b"), h.key("keep-o")
    call(a, "PUT", "/api/zones/api/keys/%s/block" % kb, '{"ttl":"1h"}')
    call(a, "PUT", "/api/zones/api/keys/%s/override" % ko, '{"rate":"1r/m","ttl":"1h"}')
    h.check(wait_for(lambda: status(b, "/t?k=" + kb) == 429, 1.0), "B has the block")
    h.check(wait_for(lambda: state(b, "api", ko)["override"] is not None, 1.0), "B has the override")
    r.stop(quick=True)
    time.sleep(1.0)
    h.check(status(b, "/t?k=" + kb) == 429, "Redis down: the block holds")
    got = [status(b, "/t?k=" + ko) for _ in range(3)]
    h.check(got.count(200) <= 1, "Redis down: the override holds (1r/m): %s" % got)
    r.start()
    h.check(wait_for(lambda: r.cmd("HLEN", "rl:{api}:ctl") == 2, 5.0),
            "Redis restarted empty has both back: %s" % r.cmd("HGETALL", "rl:{api}:ctl"))
    ttl = r.cmd("PTTL", "rl:{api}:ctl")
    h.check(3_000_000 < ttl <= 3_600_000, "with what is left of the hour: %s ms" % ttl)
    b.reload()
    h.check(status(b, "/t?k=" + kb) == 429, "a reload keeps the block")
    (c,) = fleet(h, r, count=1)
    h.check(wait_for(lambda: status(c, "/t?k=" + kb) == 429, 1.5), "a new node learns the block")
    h.check(state(c, "api", ko)["override"]["rate"] == "1r/m", "and the override")
    # a zone without Redis: this node's alone, kept in its shared memory
    km = h.key("mem")
    st, _, _ = call(a, "PUT", "/api/zones/mem/keys/%s/block" % km, '{"ttl":"1h"}')
    h.check(st == 200, "block on a local zone")
    h.check(status(a, "/mem?k=" + km) == 429 and status(b, "/mem?k=" + km) == 200,
            "a local zone's block is its node's")
    a.reload()
    h.check(status(a, "/mem?k=" + km) == 429, "kept across a reload")


def test_address_keys_and_resets(h):
    """A `$binary_remote_addr` zone takes and shows its keys as IP text;
    `DELETE` of a key resets its counts on the node (and in Redis)."""
    r = h.redis()
    (a,) = fleet(h, r, count=1)
    st, _, got = call(a, "PUT", "/api/zones/ip/keys/127.0.0.1/block", '{"ttl":"1m"}')
    h.check(st == 200 and json.loads(got)["key"] == "127.0.0.1", got)
    h.check(status(a, "/ip") == 429, "this client's address is blocked")
    zone = json.loads(call(a, "GET", "/api/zones/ip")[2])
    h.check(zone["blocked"][0]["key"] == "127.0.0.1", zone)
    call(a, "DELETE", "/api/zones/ip/keys/127.0.0.1/block")
    h.check(status(a, "/ip") == 200, "lifted")
    st, _, _ = call(a, "PUT", "/api/zones/ip/keys/%3A%3A1/block", '{"ttl":"1m"}')
    h.check(st == 200 and json.loads(call(a, "GET", "/api/zones/ip")[2])["blocked"][0]["key"] == "::1",
            "IPv6 as text")
    k = h.key("reset")
    got = [status(a, "/t?k=" + k) for _ in range(6)]
    h.check(got.count(429) == 1, "over 5r/m: %s" % got)
    time.sleep(0.3)
    view = state(a, "api", k)
    h.check(view["limits"][0]["remaining"] == 0, "the key's state: %s" % view)
    st, _, _ = call(a, "DELETE", "/api/zones/api/keys/" + k)
    h.check(st == 204, "reset: %s" % st)
    h.check(state(a, "api", k)["limits"][0]["remaining"] == 5, "counts forgotten")
    h.check(wait_for(lambda: not r.keys("rl:{api:%s}*" % k), 2.0), "and in Redis: %s" % r.keys("*%s*" % k))
    h.check(status(a, "/t?k=" + k) == 200, "it passes again")


def test_top_lists_the_busiest_keys_this_node_sees(h):
    """`GET .../top?n=3` after 600 requests of one key and 5 of each of
    60 others (two workers): that key first, with most of the sampled
    share, and each listed key's state."""
    r = h.redis()
    (a,) = fleet(h, r, count=1)
    hot = h.key("hot")
    paths = ["/wide?k=" + hot] * 600 + ["/wide?k=%s-%d" % (h.key("cold"), i % 60) for i in range(300)]
    a.burst(paths, threads=16)
    st, _, got = call(a, "GET", "/api/zones/api/top?n=3")
    top = json.loads(got)
    h.check(st == 200 and 1 <= len(top) <= 3, "top: %s %s" % (st, got))
    h.note("top: %s" % [(t["state"]["key"], t["share"]) for t in top])
    h.check(top[0]["state"]["key"] == hot and top[0]["share"] > 0.4, "the hot key first: %s" % got)
    h.check(top[0]["state"]["limits"][0]["rate"] == "5r/m", "with its state: %s" % top[0])
    st, _, got = call(a, "GET", "/api/zones/api/top")
    h.check(st == 200 and len(json.loads(got)) > 3, "20 by default: %s" % got[:200])
    a.burst(["/ip"] * 64, threads=4)
    st, _, got = call(a, "GET", "/api/zones/ip/top?n=1")
    h.check(st == 200 and json.loads(got)[0]["state"]["key"] == "127.0.0.1", "an address as text: %s" % got)


def test_many_controls_and_their_ends_in_redis(h):
    """128 blocks through the API on two nodes: every node holds them all;
    Redis's hash lives as long as its last control, and drops the ended
    ones as changes go on (64 of 1 s, then 64 of an hour: 64 left)."""
    r = h.redis()
    a, b = fleet(h, r, count=2)
    for i in range(64):
        st, _, got = call(a if i % 2 else b, "PUT", "/api/zones/api/keys/%s/block" % h.key("s%d" % i),
                          '{"ttl":"1s"}')
        h.check(st == 200, "PUT %d: %s %s" % (i, st, got))
    time.sleep(1.3)
    for i in range(64):
        st, _, got = call(a if i % 2 else b, "PUT", "/api/zones/api/keys/%s/block" % h.key("l%d" % i),
                          '{"ttl":"1h"}')
        h.check(st == 200, "PUT %d: %s %s" % (i, st, got))
    zone = lambda n: json.loads(call(n, "GET", "/api/zones/api")[2])
    h.check(wait_for(lambda: all(zone(n)["blocked_keys"] == 64 for n in (a, b)), 2.0),
            "both nodes hold the 64 in force: %s" % [zone(n)["blocked_keys"] for n in (a, b)])
    h.check(wait_for(lambda: r.cmd("HLEN", "rl:{api}:ctl") == 64, 2.0),
            "Redis dropped the ended ones: %s" % r.cmd("HLEN", "rl:{api}:ctl"))
    ttl = r.cmd("PTTL", "rl:{api}:ctl")
    h.check(3_590_000 < ttl <= 3_600_000, "the hash lives to its last end: %s" % ttl)
    h.check(status(b, "/wide?k=" + h.key("l7")) == 429 and status(b, "/wide?k=" + h.key("s7")) == 200,
            "the hour's blocks hold, the second's ended")
