"""A client spraying new keys with Redis healthy: every key is new to the
zone, the node and Redis, far below its limit (held, then sent as one
`SET NX EX` each). The Redis thread keeps up: nothing is dropped and Redis
ends up with every allowed request, also with a zone much smaller than the
keys sprayed (the batch's hold budget wakes the thread to send the longest
held). Beyond what the thread can send (Redis paused), what is dropped is
counted in the metrics and logged, and the requests are answered."""

import json
import os
import re
import shutil
import subprocess
import time

from harness import ROOT, wait_for

HTTP = "    redis_ratelimit_zone $http_x_key zone=spray:1m redis=%s timeout=2s;\n"
SERVER = ("        location = /t { redis_ratelimit spray 6000r/m; }\n"
          "        location = /metrics { redis_ratelimit_metrics; }\n")
SCRIPT = os.path.join(ROOT, "bench", "newkeys.lua")


def wrk(port, seconds, conns=32):
    exe = shutil.which("wrk")
    if not exe:
        raise AssertionError("wrk is missing (make test installs it)")
    out = subprocess.run([exe, "-t1", "-c%d" % conns, "-d%ds" % seconds, "-s", SCRIPT,
                          "http://127.0.0.1:%d/t" % port],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=seconds + 30).stdout.decode()
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    return float(m.group(1)) if m else 0.0, out


def zone(n):
    return json.loads(n.request("/metrics?format=json")[2])["zones"]["spray"]


def in_redis(r):
    return int(r.cmd("EVAL", "local s = 0 for _, k in ipairs(redis.call('KEYS', 'rl:*')) do "
                     "s = s + tonumber(redis.call('GET', k)) end return s", "0"))


def test_a_spray_of_new_keys_drops_nothing(h):
    r = h.redis()
    n = h.nginx(HTTP % r.url, SERVER, files={"t": "ok\n"})
    rps, out = wrk(n.port, 8)
    z = zone(n)
    passed, dropped = z["requests"]["passed"], z["dropped_increments"]
    # what the thread still holds goes at the next flushes (at most hold=)
    landed = wait_for(lambda: in_redis(r) == passed, 12.0, 0.5)
    h.note("8 s of new keys: %.0f req/s, %d passed, %d dropped, %d in Redis (keys in a 1m zone: %d)"
           % (rps, passed, dropped, in_redis(r), z["keys_capacity"]))
    h.check(rps > 10000, "the spray ran: %.0f req/s\n%s" % (rps, out))
    h.check(dropped == 0, "no increment dropped with Redis healthy: %d" % dropped)
    h.check(landed, "Redis holds every allowed request: %d of %d" % (in_redis(r), passed))


test_a_spray_of_new_keys_drops_nothing.timeout = 90


def test_beyond_what_can_be_sent_drops_are_counted_and_logged(h):
    """Redis paused for 6 s under the spray: the batch fills, the rest is
    dropped (counted on the node, in dropped_increments_total), an error
    line says so, and every request is still answered at once."""
    r = h.redis()
    n = h.nginx(HTTP % r.url, SERVER, files={"t": "ok\n"})
    h.check(n.get("/t")[0] == 200, "up")
    r.cmd("CLIENT", "PAUSE", "6000", "WRITE")
    rps, out = wrk(n.port, 5)
    z = zone(n)
    logged = wait_for(lambda: re.search(r"redis_ratelimit: \d+ increments dropped", n.error_log_text()), 15.0, 0.5)
    log = n.error_log_text()
    h.note("5 s of new keys while Redis is paused: %.0f req/s, %d passed, %d increments dropped; "
           "log: %s" % (rps, z["requests"]["passed"], z["dropped_increments"],
                        [l[l.find("redis_ratelimit"):][:140] for l in log.splitlines() if "dropped" in l][:2]))
    h.check(rps > 5000, "requests answered meanwhile: %.0f req/s" % rps)
    h.check(z["dropped_increments"] > 0, "what did not fit is counted: %d" % z["dropped_increments"])
    h.check(logged, "and logged")


test_beyond_what_can_be_sent_drops_are_counted_and_logged.timeout = 90
