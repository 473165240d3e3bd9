"""A plain URL's server that becomes a replica (a failover done by DNS or
a virtual IP leaves the address on the old master): every count it refuses
with READONLY takes the backend down, as a lost connection does; the
module reconnects (resolving the name again) and stays down, saying why,
until the server at the address takes writes; then counting through Redis
resumes. Background and strict zones alike.
"""

import json
import time

from harness import HOST, wait_for

HTTP = """
    redis_ratelimit_zone $arg_k zone=bg:1m redis=%s timeout=200ms hold=0;
    redis_ratelimit_zone $arg_k zone=st:1m redis=%s timeout=200ms;
"""
SERVER = """
        location = /bg { redis_ratelimit bg 1000r/m; }
        location = /st { redis_ratelimit st 1000r/m strict; }
        location = /metrics { redis_ratelimit_metrics; }
"""
FILES = {"bg": "ok\n", "st": "ok\n"}


def figures(n, zone):
    return json.loads(n.request("/metrics?format=json")[2])["zones"][zone]["redis"]


def total(r, zone, key):
    return sum(int(r.cmd("GET", k) or 0) for k in r.keys("rl:{%s:%s}:60:*" % (zone, key)))


def test_a_server_that_became_a_replica_is_left_until_it_takes_writes(h):
    a = h.redis()
    b = h.redis()
    n = h.nginx(HTTP % (a.url, a.url), SERVER, files=FILES)
    h.wait_minute_room(25)
    k1 = h.key("before")
    for _ in range(3):
        n.get("/bg?k=" + k1)
        n.get("/st?k=" + k1)
    h.check(wait_for(lambda: total(a, "bg", k1) == 3 and total(a, "st", k1) == 3, 3.0),
            "counts land before the failover: bg %d, st %d" % (total(a, "bg", k1), total(a, "st", k1)))

    a.cmd("REPLICAOF", HOST, str(b.port))
    h.check(wait_for(lambda: "master_link_status:up" in a.cmd("INFO", "replication"), 10.0),
            "the old master follows the new one")
    k2 = h.key("during")
    statuses = []
    down = False
    t0 = time.monotonic()
    while time.monotonic() - t0 < 6.0:
        statuses.append(n.get("/bg?k=" + k2)[0])
        statuses.append(n.get("/st?k=" + k2)[0])
        if not figures(n, "bg")["up"] and not figures(n, "st")["up"]:
            down = True
            break
        time.sleep(0.05)
    h.note("after REPLICAOF: %d requests (%s), backends down: %s after %.2fs"
           % (len(statuses), sorted(set(statuses)), down, time.monotonic() - t0))
    h.check(down, "both zones report the backend down while the server is a replica: bg %s, st %s"
            % (figures(n, "bg"), figures(n, "st")))
    h.check(set(statuses) <= {200}, "requests are answered meanwhile (on_error=local): %s" % statuses)
    # a sync that stalls the server can time the first exchange out (logged
    # as such); the next connection's ROLE says why, within the backoff
    h.check(wait_for(lambda: "not a master" in n.error_log_text() or "is a replica" in n.error_log_text(),
                     5.0), "the reason is logged")
    # still down a while later: reconnecting finds a replica again
    time.sleep(2.5)
    h.check(not figures(n, "bg")["up"], "still down while the address leads to a replica")

    a.cmd("REPLICAOF", "NO", "ONE")
    back = wait_for(lambda: figures(n, "bg")["up"] and figures(n, "st")["up"], 12.0)
    k3 = h.key("after")
    for _ in range(4):
        n.get("/bg?k=" + k3)
        n.get("/st?k=" + k3)
    landed = wait_for(lambda: total(a, "bg", k3) == 4 and total(a, "st", k3) == 4, 3.0)
    log = n.error_log_text()
    h.note("after REPLICAOF NO ONE: up again %s; counts in Redis bg %d, st %d; figures %s"
           % (back, total(a, "bg", k3), total(a, "st", k3), figures(n, "bg")))
    h.check(back, "both zones up again within 12 s of REPLICAOF NO ONE")
    h.check(landed, "new counts land on the server again")
    h.check("reachable again" in log, "the recovery is logged")
    h.check("[alert]" not in log and "panicked" not in log, "no worker crashed")
