"""`on_error=share`: one fleet-wide limit while Redis is down. Four real
nginx nodes count through one Redis, each saying every 2 s that it counts
(a sorted set under the zone's prefix), so each knows N = 4. Redis is then
killed (SIGKILL): a key first seen during the outage gets L/4 on each
node (L in all, not 4 × L as with `local`); a key the nodes counted
together before gets each node's learnt share of what was left; a key
whose traffic was 70/10/10/10 keeps most of what is left for the heavy
node (the light nodes' shares, learnt from two requests each, read high:
the total is reported, not bounded). When Redis is back, what each node
counted lands in it, once. Lua callers, deciding through the same
engine, get the same."""

import json
import os
import signal
import time

from harness import DEBIAN_MODULE, DEBIAN_NGINX, LUA_MODULES, ROOT, wait_for, write_file

L = 40
HTTP = "    redis_ratelimit_zone $arg_k zone=sh:1m redis=%s on_error=%s timeout=200ms;\n"
SERVER = ("        location = /a { redis_ratelimit sh %dr/h; }\n" % L
          + "        location = /metrics { redis_ratelimit_metrics; }\n")


def figures(n):
    return json.loads(n.request("/metrics?format=json")[2])["zones"]["sh"]["redis"]


def redis_count(r, key):
    return sum(int(r.cmd("GET", k) or 0) for k in r.keys("rl:{sh:%s}:3600:*" % key))


def send(nodes, key, counts):
    """counts[i] requests to node i, interleaved; the 200s per node."""
    ok = [0] * len(nodes)
    left = list(counts)
    while any(left):
        for i, n in enumerate(nodes):
            if left[i]:
                left[i] -= 1
                if n.get("/a?k=%s" % key)[0] == 200:
                    ok[i] += 1
    return ok


def learn(r, nodes, key, counts):
    """Spaced requests before the outage, each node's share learnt from
    Redis's replies; waits until Redis holds them."""
    left = list(counts)
    while any(left):
        for i, n in enumerate(nodes):
            if left[i]:
                left[i] -= 1
                n.get("/a?k=%s" % key)
                time.sleep(0.12)
    total = sum(counts)
    return wait_for(lambda: redis_count(r, key) == total, 10.0)


def outage(h, policy):
    """The four keys' traffic before and during an outage, and Redis back:
    (allowed per node for each key, the counts before, rows to note)."""
    r = h.redis()
    nodes = [h.nginx(HTTP % (r.url, policy), SERVER, files={"a": "ok\n"}) for _ in range(4)]
    known, skewed, fresh, moved = h.key("known"), h.key("skewed"), h.key("fresh"), h.key("moved")
    if policy == "share":
        h.check(wait_for(lambda: all(figures(n)["nodes"] == 4 for n in nodes), 10.0),
                "each node knows N = 4: %s" % [figures(n)["nodes"] for n in nodes])
    # before the outage: 16 of 40 even, 20 of 40 skewed 14/2/2/2
    learnt = (learn(r, nodes, known, [4, 4, 4, 4]) and learn(r, nodes, skewed, [14, 2, 2, 2])
              and learn(r, nodes, moved, [2, 2, 2, 2]))
    h.check(learnt, "Redis holds the counts made before the outage")
    before = {known: redis_count(r, known), skewed: redis_count(r, skewed)}

    r.stop(sig=signal.SIGKILL, quick=True)
    h.check(wait_for(lambda: all(not figures(n)["up"] for n in nodes), 10.0),
            "every node sees Redis down")
    even = send(nodes, fresh, [50] * 4)
    again = send(nodes, known, [30] * 4)
    heavy = send(nodes, skewed, [70, 10, 10, 10])
    # a load balancer that moves all of a key's traffic to one node
    one = send(nodes, moved, [60, 0, 0, 0])
    rows = [
        "fresh key, even traffic: %s = %d of %d (%.2f L)" % (even, sum(even), L, sum(even) / L),
        "known key (16 before), even: %s = %d + %d before = %.2f L"
        % (again, sum(again), before[known], (sum(again) + before[known]) / L),
        "known key (20 before, 14/2/2/2), 70/10/10/10: %s; the heavy node %d + 14 before = %.2f L, "
        "all %.2f L" % (heavy, heavy[0], (heavy[0] + 14) / L, (sum(heavy) + before[skewed]) / L),
    ]
    rows.append("known key (8 before, even), all traffic moved to one node: it allows %d (%.2f L "
                "with the 8 before) and no more this window" % (one[0], (one[0] + 8) / L))
    for row in rows:
        h.note(row)
    # Redis back (empty, on the same port): what each node counted lands once
    r.start()
    h.check(wait_for(lambda: all(figures(n)["up"] for n in nodes), 15.0), "every node sees Redis up")
    landed = wait_for(lambda: redis_count(r, fresh) == sum(even), 15.0)
    h.note("after the outage Redis holds %d of the fresh key's %d (%s)"
           % (redis_count(r, fresh), sum(even), "landed" if landed else "not yet"))
    h.check(landed, "the outage's counts land in Redis, none lost or doubled")
    return even, again, heavy, before


def test_each_node_limits_at_its_share_while_redis_is_down(h):
    even, again, heavy, before = outage(h, "share")
    h.check(sum(even) <= 1.25 * L, "a fresh key: at most 1.25 L in all (%d)" % sum(even))
    h.check(min(even) >= 1, "a fresh key: at least one a node")
    h.check(sum(again) + 16 <= 1.25 * L, "a known key: at most 1.25 L with what came before")
    # (the skewed key's total is reported, not bounded: the light nodes'
    # shares, learnt from two requests each, read high)
    h.check(heavy[0] + 14 >= 0.6 * L, "the heavy node keeps at least 0.6 L of the skewed key")


def test_with_on_error_local_each_node_passes_its_own_limit(h):
    """The same outage with `on_error=local`, what `share` is measured
    against: a key first seen during the outage gets L on every node."""
    even, _, _, _ = outage(h, "local")
    h.check(sum(even) == 4 * L, "a fresh key: L on each node, 4 L in all (%d)" % sum(even))


def test_the_fleet_size_outlives_reloads_killed_workers_and_restarts(h):
    """Three nodes learn N = 3, Redis is killed; then one node reloads, one
    has its worker killed, and a fourth starts during the outage with
    `nodes=3`: a key first seen after that gets at most its share of L
    (ceil(L/3)) on each of them, not L: N is kept in the zone's shared
    memory, and a node that never heard it assumes the configured floor."""
    r = h.redis()
    share = HTTP % (r.url, "share")
    nodes = [h.nginx(share, SERVER, files={"a": "ok\n"}) for _ in range(3)]
    h.check(wait_for(lambda: all(figures(n)["nodes"] == 3 for n in nodes), 10.0),
            "each node knows N = 3: %s" % [figures(n)["nodes"] for n in nodes])
    r.stop(sig=signal.SIGKILL, quick=True)
    h.check(wait_for(lambda: all(not figures(n)["up"] for n in nodes), 10.0),
            "every node sees Redis down")
    nodes[0].reload()
    for pid in nodes[1].worker_pids():
        os.kill(pid, signal.SIGKILL)
    h.check(wait_for(lambda: len(nodes[1].worker_pids()) == 1
                     and nodes[1].get("/metrics")[0] == 200, 5.0, 0.1),
            "the killed worker was replaced")
    late = h.nginx(share.replace("on_error=share", "on_error=share nodes=3"), SERVER,
                   files={"a": "ok\n"})
    h.check(wait_for(lambda: not figures(late)["up"], 10.0), "the new node sees Redis down")
    cap = -(-L // 3)
    for name, n in (("reloaded", nodes[0]), ("worker killed", nodes[1]), ("started with nodes=3", late)):
        got = send([n], h.key("fresh-" + name.split()[0]), [L])[0]
        h.note("%s: N read %d, a fresh key gets %d of %d" % (name, figures(n)["nodes"], got, L))
        h.expect(1 <= got <= cap, "%s: a fresh key gets its share (at most %d), got %d" % (name, cap, got))
    h.expect(figures(nodes[0])["nodes"] == 3 and figures(nodes[1])["nodes"] == 3,
             "the metric keeps N after a reload and a killed worker")


LUA_CONF = """load_module %s;
load_module %s;
load_module %s;
worker_processes 1;
error_log logs/error.log info;
pid logs/nginx.pid;
events { worker_connections 1024; }
http {
    access_log off;
    lua_package_path "%s/lua/?.lua;;";
    redis_ratelimit_zone $arg_k zone=ratelimit_circuit_breaker:1m redis=%s on_error=share timeout=200ms;
    server {
        listen 127.0.0.1:%d;
        location = /a {
            access_by_lua_block {
                local lim = require("resty.redis_ratelimit").new("login", "%dr/h")
                local limited, err = lim:is_rate_limited(ngx.var.arg_k)
                if err then
                    ngx.log(ngx.ERR, "is_rate_limited: ", err)
                    return ngx.exit(500)
                end
                if limited then
                    return ngx.exit(429)
                end
            }
            content_by_lua_block { ngx.say("ok") }
        }
        location = /metrics { redis_ratelimit_metrics; }
    }
}
"""


def test_lua_callers_limit_at_their_share_too(h):
    """The Lua API decides through the same engine: two Debian nginx with
    lua-nginx-module, `on_error=share` on the Lua zone, Redis killed: a key
    first seen during the outage gets L/2 on each node, L in all."""
    r = h.redis()
    nodes = []
    for _ in range(2):
        n = h.nginx(start=False)
        n.binary = DEBIAN_NGINX
        write_file(n.conf_path, LUA_CONF % (LUA_MODULES + (DEBIAN_MODULE, ROOT, r.url, n.port, L)))
        nodes.append(n.start())

    def lua_figures(n):
        return json.loads(n.request("/metrics?format=json")[2])["zones"]["ratelimit_circuit_breaker"]["redis"]

    h.check(wait_for(lambda: all(lua_figures(n)["nodes"] == 2 for n in nodes), 10.0),
            "each node knows N = 2")
    r.stop(sig=signal.SIGKILL, quick=True)
    h.check(wait_for(lambda: all(not lua_figures(n)["up"] for n in nodes), 10.0), "both see Redis down")
    fresh = h.key("lua-fresh")
    even = send(nodes, fresh, [50, 50])
    h.note("Lua, a fresh key during the outage: %s = %d of %d" % (even, sum(even), L))
    h.check(even == [L // 2, L // 2], "L/2 on each node: %s" % even)
