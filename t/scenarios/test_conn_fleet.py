"""Concurrency limits (`redis_ratelimit_conn`) on a zone with Redis: one
number of requests in flight for the fleet. Each worker holds a lease of
the key's slots in Redis (a field of the key's hash, renewed every third of
`lease=`), takes slots within it without a round trip, and asks for more
ahead of need; a node killed or frozen stops counting once its leases end;
every count goes back to 0 after the requests end."""

import os
import signal
import socket
import threading
import time

from harness import HOST
from test_conn import Upstream, at_once

HTTP = """
    redis_ratelimit_zone $arg_k zone=c:1m redis=%s timeout=300ms;
    upstream slow { server 127.0.0.1:%d; }
    upstream quick { server 127.0.0.1:%d; }
"""
SERVER = """
        add_header X-Conn $redis_ratelimit_conn_status always;
        location /slow  { redis_ratelimit_conn c 10 lease=2s; proxy_pass http://slow; }
        location /strict { redis_ratelimit_conn c 3 strict lease=2s; proxy_pass http://slow; }
        location /strict10 { redis_ratelimit_conn c 10 strict lease=2s; proxy_pass http://slow; }
        location /twenty { redis_ratelimit_conn c 20 lease=2s; proxy_pass http://slow; }
        location /quick20 { redis_ratelimit_conn c 20 lease=2s; proxy_pass http://quick; }
        location /big   { redis_ratelimit_conn c 1000 lease=2s; limit_rate 20k; }
        location = /metrics { redis_ratelimit_metrics; }
"""


def fleet(h, r, up, count, workers=2, quick=None, server=SERVER, files=None):
    q = quick.port if quick else up.port
    return [h.nginx(HTTP % (r.url, up.port, q), server, workers=workers, files=files)
            for _ in range(count)]


def clients(nodes, path, per_node, seconds, pause=0.05):
    """`per_node` clients on each node, each sending `path` again and again
    (a short pause after a refusal) for `seconds`; returns the statuses."""
    out, lock = [], threading.Lock()
    end = time.monotonic() + seconds

    def run(n):
        mine = []
        while time.monotonic() < end:
            try:
                st = n.request(path, timeout=10.0)[0]
            except OSError as e:
                st = "error: %s" % e
            mine.append(st)
            if st != 200:
                time.sleep(pause)
        with lock:
            out.extend(mine)

    ts = [threading.Thread(target=run, args=(n,)) for n in nodes for _ in range(per_node)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + 30)
    return out


def leases(r, k):
    """The key's leases in Redis: {holder: slots}."""
    got = r.cmd("HGETALL", "rl:{c:%s}:conn" % k) or []
    return {got[i]: int(got[i + 1].split(":")[0]) for i in range(0, len(got), 2)}


def in_flight(n, zone="c"):
    import json
    return json.loads(n.request("/metrics?format=json")[2])["zones"][zone]["conn"]


def wait_for(cond, seconds, step=0.1):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def test_four_nodes_hold_the_number_together(h):
    """4 nodes of 2 workers, one Redis, `redis_ratelimit_conn c 10` (and
    then the same `strict`), an upstream taking 1 s that counts what it
    has in flight, 200 clients (50 a node) for 6 s on a fresh key: a
    worker with no lease of the key waits for one (a round trip), so the
    upstream never has more than 10 in flight, from the first request on;
    the slots are used (not starved), and after the run every count, in
    Redis and on the nodes, is back to 0."""
    r = h.redis()
    up = Upstream(1.0)
    try:
        ns = fleet(h, r, up, 4)
        for path in ("/slow", "/strict10"):
            k = h.key("four" + path[1:])
            with up.lock:
                up.most = 0
            got = clients(ns, "%s?k=%s" % (path, k), 50, 6.0)
            ok = got.count(200)
            other = [s for s in got if s not in (200, 429)]
            h.note("%s, 200 clients, 6 s: %d requests, %d passed; upstream had %d at most"
                   % (path, len(got), ok, up.most))
            h.check(not other, "every request answered 200 or 429: %s" % other[:5])
            h.check(up.most <= 10, "never more than 10 in flight: %d" % up.most)
            h.check(ok >= 45, "the fleet's 10 slots were used (6 s of 1 s requests): %d" % ok)
            # leases given back: at the next renewal an idle key's go, and
            # any not renewed end in Redis
            h.check(wait_for(lambda: not leases(r, k), 5.0), "no lease left: %s" % leases(r, k))
            for n in ns:
                c = in_flight(n)
                h.check(c["in_flight"] == 0, "nothing in flight on a node: %s" % c)
                h.check(c["leased"] == 0, "nothing leased by a node: %s" % c)
    finally:
        up.stop()


def hold(n, path, count):
    """`count` requests of `path` on `n`, left in flight (threads that end
    when their requests do, however)."""
    def one():
        try:
            n.request(path, timeout=60.0)
        except (OSError, ValueError):
            pass    # its node was killed

    for _ in range(count):
        threading.Thread(target=one, daemon=True).start()


def signal_node(n, sig):
    """`sig` to a node's master and workers (by their pids)."""
    for pid in [n.pid] + list(n.worker_pids()):
        os.kill(pid, sig)


def lost_node(h, how):
    """Node A holds the 20 slots of a key (its upstream takes 30 s); B is
    refused; then A is killed (SIGKILL) or frozen (SIGSTOP): B gets slots
    of the key within the lease (2 s) and not before A's lease could end
    (renewed every third of it)."""
    r = h.redis()
    up, quick = Upstream(30.0), Upstream(0.0)
    try:
        a, b = fleet(h, r, up, 2, workers=1, quick=quick)
        k = h.key(how)
        hold(a, "/twenty?k=" + k, 20)
        h.check(wait_for(lambda: up.now >= 20, 5.0), "20 in flight through A: %d" % up.now)
        h.check(wait_for(lambda: sum(leases(r, k).values()) >= 20, 3.0),
                "A's lease holds them: %s" % leases(r, k))
        st = b.request("/quick20?k=" + k)[0]
        h.check(st == 429, "B is refused while A holds the 20: %s" % st)
        signal_node(a, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        lost = time.monotonic()
        back = None
        try:
            while time.monotonic() - lost < 6.0:
                if b.request("/quick20?k=" + k)[0] == 200:
                    back = time.monotonic() - lost
                    break
                time.sleep(0.05)
            h.note("%s: B got a slot %.2f s after A was lost (lease 2 s)" % (how, back or -1))
            h.check(back is not None and 1.0 <= back <= 2.6,
                    "B gets A's slots once its lease ends: %s" % back)
        finally:
            if how == "stop":
                signal_node(a, signal.SIGCONT)
        if how == "stop":
            # A is back with its 20 requests in flight: its lease is renewed
            # with them (Redis grants no less than it uses), and it takes
            # no slot more while the fleet is over the number
            h.check(wait_for(lambda: sum(leases(r, k).values()) >= 20, 3.0),
                    "A's lease is back: %s" % leases(r, k))
            h.check(a.request("/quick20?k=" + k)[0] == 429, "A takes nothing while over")
    finally:
        up.stop()
        quick.stop()


def test_a_killed_node_s_slots_come_back_within_the_lease(h):
    lost_node(h, "kill")


def test_a_frozen_node_s_slots_come_back_within_the_lease(h):
    lost_node(h, "stop")


def test_strict_leases_only_what_is_in_use(h):
    """`redis_ratelimit_conn c 3 strict` over 2 nodes of 2 workers, 20
    clients at once, an upstream of 1 s: 3 pass, and while they run the
    leases in Redis are the 3 slots in use, no spare."""
    r = h.redis()
    up = Upstream(1.0)
    try:
        ns = fleet(h, r, up, 2)
        k = h.key("strict")
        seen = {}

        def look():
            time.sleep(0.5)
            seen["leases"] = leases(r, k)

        t = threading.Thread(target=look)
        t.start()
        out, lock = [], threading.Lock()

        def many(n):
            got = at_once(n, "/strict?k=" + k, 10)
            with lock:
                out.extend(got)

        ts = [threading.Thread(target=many, args=(n,)) for n in ns]
        for x in ts:
            x.start()
        for x in ts + [t]:
            x.join(30)
        passed = [g for g in out if g[0] == 200]
        h.note("20 at once: %d passed, upstream had %d; leases while they ran: %s"
               % (len(passed), up.most, seen["leases"]))
        h.check(len(passed) == 3 and up.most <= 3, "3 pass: %s" % out)
        h.check(sum(seen["leases"].values()) == 3, "the leases are the 3 in use: %s" % seen)
        h.check(wait_for(lambda: not leases(r, k), 4.0), "then none: %s" % leases(r, k))
    finally:
        up.stop()


def test_redis_killed_and_back_loses_and_doubles_nothing(h):
    """A node holds 5 slots (an upstream of 4 s); Redis is killed and
    started again empty: the node's lease is written again with what it
    uses (absolute counts: a renewal never counts a slot twice), new
    requests meanwhile are decided by `on_error` (local), and once the
    requests end nothing is left in Redis or on the node."""
    r = h.redis()
    up = Upstream(4.0)
    try:
        a, = fleet(h, r, up, 1, workers=1)
        k = h.key("restart")
        hold(a, "/slow?k=" + k, 5)
        h.check(wait_for(lambda: up.now >= 5, 5.0), "5 in flight: %d" % up.now)
        h.check(wait_for(lambda: sum(leases(r, k).values()) >= 5, 3.0), "leased: %s" % leases(r, k))
        r.stop(sig=signal.SIGKILL)
        r.start()
        h.check(not leases(r, k), "Redis is back empty")
        back = wait_for(lambda: sum(leases(r, k).values()) >= 5, 3.0)
        got = leases(r, k)
        h.note("after the restart: %s" % got)
        h.check(back, "the lease is written again within a renewal: %s" % got)
        h.check(sum(got.values()) <= 10, "with what it uses and a spare, not twice: %s" % got)
        h.check(wait_for(lambda: up.now == 0, 8.0), "the requests end")
        h.check(wait_for(lambda: not leases(r, k), 4.0), "no lease left: %s" % leases(r, k))
        c = in_flight(a)
        h.check(c["in_flight"] == 0 and c["leased"] == 0, "nothing held: %s" % c)
    finally:
        up.stop()


def test_ten_thousand_clients_gone_mid_response_leak_nothing(h):
    """10 000 clients over 2 nodes of 2 workers each read the start of a
    slow response (`limit_rate`) on one of 50 keys and close their
    connection: every slot is given back, on the nodes and in Redis."""
    r = h.redis()
    up = Upstream(0.0)
    try:
        ns = fleet(h, r, up, 2, files={"big": "x" * (1 << 20)})
        keys = [h.key("gone%d" % i) for i in range(50)]
        sent = 0
        for batch in range(20):
            socks = []
            for i in range(500):
                n = ns[i % 2]
                s = socket.create_connection((HOST, n.port), timeout=5)
                s.sendall(("GET /big?k=%s HTTP/1.1\r\nHost: x\r\n\r\n"
                           % keys[(batch * 500 + i) % 50]).encode())
                socks.append(s)
            for s in socks:
                try:
                    s.recv(64)
                except OSError:
                    pass
                s.close()
            sent += len(socks)
        h.note("%d clients read the start of a response and went" % sent)
        h.check(wait_for(lambda: all(in_flight(n)["in_flight"] == 0 for n in ns), 10.0),
                "nothing in flight on the nodes: %s" % [in_flight(n) for n in ns])
        h.check(wait_for(lambda: not any(leases(r, k) for k in keys), 6.0),
                "no lease left in Redis")
        h.check(all(in_flight(n)["leased"] == 0 for n in ns), "nothing leased")
    finally:
        up.stop()


def test_a_reload_with_requests_in_flight_leaks_nothing(h):
    """5 requests in flight (an upstream of 1.5 s) on a node of 2 workers;
    nginx reloads: the old workers finish them, their leases end with
    them (given back or not renewed), and nothing is left after."""
    r = h.redis()
    up = Upstream(1.5)
    try:
        a, = fleet(h, r, up, 1)
        k = h.key("reload")
        hold(a, "/slow?k=" + k, 5)
        h.check(wait_for(lambda: up.now >= 5, 5.0), "5 in flight: %d" % up.now)
        a.reload()
        h.check(wait_for(lambda: up.now == 0, 5.0), "they end")
        got = at_once(a, "/slow?k=" + k, 3)
        h.check([g[0] for g in got] == [200] * 3, "the new workers take slots: %s" % got)
        h.check(wait_for(lambda: not leases(r, k), 5.0), "no lease left: %s" % leases(r, k))
        c = in_flight(a)
        h.check(c["in_flight"] == 0 and c["leased"] == 0, "nothing held: %s" % c)
    finally:
        up.stop()


def test_redis_down_each_node_admits_its_share(h):
    """`on_error=share nodes=2` on 2 nodes, `redis_ratelimit_conn s 4`:
    with Redis killed, each node lets 2 of its 5 at once through (its
    part of the number), not 4 each as `local` would."""
    r = h.redis()
    up = Upstream(1.0)
    try:
        http = ("    redis_ratelimit_zone $arg_k zone=s:1m redis=%s on_error=share nodes=2 timeout=200ms;\n"
                "    upstream slow { server 127.0.0.1:%d; }\n" % (r.url, up.port))
        server = ("        location /s { redis_ratelimit_conn s 4; proxy_pass http://slow; }\n"
                  "        location = /metrics { redis_ratelimit_metrics; }\n")
        ns = [h.nginx(http, server) for _ in range(2)]
        r.stop(sig=signal.SIGKILL)

        def down(n):
            import json
            return json.loads(n.request("/metrics?format=json")[2])["zones"]["s"]["redis"]["up"] is False

        h.check(wait_for(lambda: all(down(n) for n in ns), 8.0), "both nodes see Redis down")
        out, lock = [], threading.Lock()

        def five(n):
            got = at_once(n, "/s?k=" + h.key("share"), 5)
            with lock:
                out.append(sorted(g[0] for g in got))

        ts = [threading.Thread(target=five, args=(n,)) for n in ns]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        h.note("per node: %s; upstream had %d at most" % (out, up.most))
        h.check(out == [[200, 200, 429, 429, 429]] * 2, "2 a node: %s" % out)
        h.check(up.most <= 4, "the fleet's 4: %d" % up.most)
    finally:
        up.stop()


def test_a_cluster_holds_each_key_s_number(h):
    """A Redis Cluster of three masters, 2 nodes of 2 workers,
    `redis_ratelimit_conn k 3` on keys spread over every master: for each
    key, 8 requests at once over the nodes get at most 3 through (and at
    least 2: a worker refused on an answer that every slot was leased may
    see one of them given back a moment later, when its clients have gone;
    they would be let through on their retry), and each key's leases live
    on the master of its slot."""
    from cluster import keyslot
    from test_cluster import _three_masters
    masters = _three_masters(h, ())
    up = Upstream(1.0)
    try:
        url = "redis://%s:%d" % (HOST, masters[0].port)
        http = ("    redis_ratelimit_zone $arg_k zone=k:1m redis=%s cluster timeout=500ms;\n"
                "    upstream slow { server 127.0.0.1:%d; }\n" % (url, up.port))
        server = ("        location /k { redis_ratelimit_conn k 3; proxy_pass http://slow; }\n"
                  "        location = /metrics { redis_ratelimit_metrics; }\n")
        ns = [h.nginx(http, server, workers=2) for _ in range(2)]
        ranges = [(0, 5460), (5461, 10922), (10923, 16383)]
        keys, owners, i = [], [], 0
        while len(keys) < 3 and i < 500:
            k = h.key("c%d" % i)
            i += 1
            owner = next(j for j, (lo, hi) in enumerate(ranges) if lo <= keyslot("k:%s" % k) <= hi)
            if owner not in owners:
                owners.append(owner)
                keys.append(k)
        out, lock = {}, threading.Lock()

        def four(n, k):
            got = at_once(n, "/k?k=" + k, 4)
            with lock:
                out.setdefault(k, []).extend(g[0] for g in got)

        ts = [threading.Thread(target=four, args=(n, k)) for k in keys for n in ns]
        for t in ts:
            t.start()
        seen = {}
        time.sleep(0.5)
        for k, j in zip(keys, owners):
            got = masters[j].cmd("HGETALL", "rl:{k:%s}:conn" % k) or []
            seen[k] = sum(int(got[x + 1].split(":")[0]) for x in range(0, len(got), 2))

        for t in ts:
            t.join(30)
        h.note("per key: %s; leased on each key's master: %s" % (
            {k: sorted(v) for k, v in out.items()}, seen))
        for k in keys:
            passed = out[k].count(200)
            h.check(2 <= passed <= 3 and out[k].count(429) == 8 - passed,
                    "3 of 8 (or 2) for %s: %s" % (k, out[k]))
            h.check(seen[k] >= passed, "its leases on its master: %s" % seen)
        h.check(up.most <= 9, "never more than 3 a key: %d" % up.most)
    finally:
        up.stop()
