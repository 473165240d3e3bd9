"""One sender per node and zone: whichever worker counted a request, the
node's counts of a zone go to Redis from one worker's thread, the holder
of the zone's lease in shared memory; the other workers forward theirs to
it. So Redis commands per request and connections do not grow with
`worker_processes`, and a sender that dies, reloads or quits hands over
without losing or doubling a count."""

import json
import os
import re
import signal
import time

from harness import http_get, wait_for

HTTP = "    redis_ratelimit_zone $arg_k zone=z:1m redis=%s hold=%s;\n"
SERVER = ("        location = /t { redis_ratelimit z 6000r/m; add_header X-Pid $pid always; }\n"
          "        location = /metrics { redis_ratelimit_metrics; }\n")
NAME = "ngx_redis_ratelimit"


def commands(r):
    """Commands Redis ran or refused, but the test's own."""
    return r.commands(own=("info", "client|list", "client", "keys", "get", "eval", "config|get", "ping"))


def counted(r):
    return int(r.cmd("EVAL", "local s = 0 for _, k in ipairs(redis.call('KEYS', 'rl:*')) do "
                     "s = s + tonumber(redis.call('GET', k)) end return s", "0"))


def senders(r):
    """The module's connections other than the strict links."""
    out = []
    for line in r.cmd("CLIENT", "LIST").splitlines():
        f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if f.get("name") == NAME:
            out.append(f)
    return out


def send(n, keys, per_key):
    """Requests on fresh connections; the worker pids that answered."""
    pids = set()
    for _ in range(per_key):
        for k in keys:
            st, hd, _, _ = http_get(n.port, "/t?k=" + k)
            assert st == 200, st
            pids.update(hd.get("x-pid", []))
    return pids


def sender_pid(n):
    """The pid of the worker that sends the zone's counts (the metrics)."""
    st, _, body, _ = http_get(n.port, "/metrics?format=json")
    return json.loads(body)["zones"]["z"]["redis"]["sender"]


def taking_over(n):
    """Pids of the workers that said they took over sending."""
    return re.findall(r"\] (\d+)#\d+: redis_ratelimit: zone \"z\": this worker takes over",
                      n.error_log_text())


def test_commands_and_connections_do_not_grow_with_workers(h):
    """The same traffic (600 keys far below their limit, 3 requests each,
    hold=5s: all three within a key's hold) on one worker and on four:
    Redis commands per request within 1.2 times, and one connection to
    Redis for the zone either way."""
    seen = {}
    for workers in (1, 4):
        r = h.redis()
        n = h.nginx(HTTP % (r.url, "5s"), SERVER, workers=workers, log_level="info")
        h.check(wait_for(lambda: sender_pid(n) in n.worker_pids(), 5.0), "one worker sends: %s" % sender_pid(n))
        before = commands(r)
        keys = [h.key("w%d-%d" % (workers, i)) for i in range(600)]
        pids = send(n, keys, 3)
        landed = wait_for(lambda: counted(r) == 1800, 15.0, 0.2)
        per_request = (commands(r) - before) / 1800.0
        conns = senders(r)
        seen[workers] = per_request
        h.note("%d worker(s) (%d answered): %.3f Redis commands a request, %d connection(s) named %s, "
               "Redis holds %d of 1800" % (workers, len(pids), per_request, len(conns), NAME, counted(r)))
        h.check(landed, "every request counted in Redis once: %d of 1800" % counted(r))
        h.check(len(pids) == workers, "every worker answered some: %s" % pids)
        h.check(len(conns) == 1, "one connection for the zone: %s" % [c.get("addr") for c in conns])
        n.stop()
        r.stop()
    h.check(seen[4] <= 1.2 * seen[1] + 0.01,
            "commands a request with 4 workers %.3f, with 1 %.3f: within 1.2 times" % (seen[4], seen[1]))


def test_a_killed_sender_is_replaced_and_nothing_is_lost_or_doubled(h):
    """Two workers, hold=0: 100 keys counted; the sender is killed
    (SIGKILL); 100 more keys, answered by the other worker and the one
    that replaced the dead: another worker takes the lease, and Redis holds
    exactly 200."""
    r = h.redis()
    n = h.nginx(HTTP % (r.url, "0"), SERVER, workers=2, log_level="info")
    h.check(wait_for(lambda: sender_pid(n) in n.worker_pids(), 5.0), "one worker sends")
    send(n, [h.key("a%d" % i) for i in range(100)], 1)
    h.check(wait_for(lambda: counted(r) == 100, 5.0), "the first 100 in Redis: %d" % counted(r))
    dead = sender_pid(n)
    os.kill(dead, signal.SIGKILL)
    h.check(wait_for(lambda: len(n.worker_pids()) == 2 and dead not in n.worker_pids(), 5.0),
            "the master replaced the killed worker")
    t0 = time.monotonic()
    send(n, [h.key("b%d" % i) for i in range(100)], 1)
    landed = wait_for(lambda: counted(r) == 200, 8.0, 0.1)
    took = time.monotonic() - t0
    new = [int(p) for p in taking_over(n)]
    h.note("sender %d killed; then %s took over; Redis holds %d of 200, %.1f s after the requests began; "
           "connections %d" % (dead, new, counted(r), took, len(senders(r))))
    h.check(new and dead not in new and sender_pid(n) == new[0],
            "another worker took the lease from the dead one, and says so: %s" % new)
    h.check(landed, "nothing lost or doubled: Redis holds %d of 200" % counted(r))
    time.sleep(1.0)
    h.check(counted(r) == 200, "nothing doubled later: %d" % counted(r))
    h.check(len(senders(r)) == 1, "one connection again: %d" % len(senders(r)))


def test_a_reload_and_a_quit_hand_over_every_count_once(h):
    """Two workers, counts held (hold=5s) far from their limit: a reload
    right after 200 requests, then 100 more, then a quit right after:
    Redis holds exactly 300 (the old sender sends what it holds and what
    was forwarded to it; the new workers' counts reach the new sender)."""
    r = h.redis()
    n = h.nginx(HTTP % (r.url, "5s"), SERVER, workers=2, log_level="info")
    h.check(wait_for(lambda: sender_pid(n) in n.worker_pids(), 5.0), "one worker sends")
    send(n, [h.key("r%d" % i) for i in range(200)], 1)
    n.reload()
    after_reload = wait_for(lambda: counted(r) == 200, 6.0, 0.1)
    send(n, [h.key("q%d" % i) for i in range(100)], 1)
    secs = n.quit()
    landed = wait_for(lambda: counted(r) == 300, 3.0, 0.1)
    h.note("after the reload Redis held %d (of 200); after the quit (%.1f s) %d of 300"
           % (200 if after_reload else counted(r), secs, counted(r)))
    h.check(after_reload, "the reload sent the 200 held counts")
    h.check(landed and counted(r) == 300, "every count once: %d of 300" % counted(r))
