"""Counts the Redis thread can no longer deliver (a reload, a worker killed,
more held than the thread keeps while Redis is down) must not hold their key
back once Redis is back: they stay counted on this node, are counted as
dropped and are logged. Redis is killed (SIGKILL), a key gets 30 of its 100
an hour, the thing happens, Redis comes back: the key still gets the rest of
its limit."""

import json
import os
import re
import shutil
import signal
import subprocess
import time

from harness import ROOT, wait_for

SCRIPT = os.path.join(ROOT, "bench", "newkeys.lua")
HTTP = ("    redis_ratelimit_zone $http_x_key zone=ro:1m redis=%s timeout=200ms;\n")
SERVER = ("        location = /t { redis_ratelimit ro 100r/h; }\n"
          "        location = /metrics { redis_ratelimit_metrics; }\n")


def get(ng, key):
    try:
        return ng.request("/t", {"X-Key": key})[0]
    except Exception as e:     # noqa: BLE001
        return "%s: %s" % (type(e).__name__, e)


def metrics(ng):
    return json.loads(ng.request("/metrics?format=json")[2])["zones"]["ro"]


def spray(port, seconds):
    exe = shutil.which("wrk")
    if not exe:
        raise AssertionError("wrk is missing (make test installs it)")
    out = subprocess.run([exe, "-t1", "-c32", "-d%ds" % seconds, "-s", SCRIPT,
                          "http://127.0.0.1:%d/t" % port],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=seconds + 30).stdout.decode()
    m = re.search(r"(\d+) requests in", out)
    return int(m.group(1)) if m else 0, out


def lockout(h, what, workers=2):
    r = h.redis()
    ng = h.nginx(HTTP % r.url, SERVER, workers=workers)
    # an hour's window: the key must not roll over during the test
    h.check(get(ng, h.key("warm")) == 200, "warm-up request not 200")
    r.stop(quick=True, sig=signal.SIGKILL)
    k = h.key("x")
    before = [get(ng, k) for _ in range(30)]
    h.check(before == [200] * 30, "30 of 100r/h while Redis is down: %s" % before)
    if what == "reload":
        ng.reload()
    elif what == "kill":
        for pid in ng.worker_pids():
            os.kill(pid, signal.SIGKILL)
        h.check(wait_for(lambda: len(ng.worker_pids()) == 2 and get(ng, h.key("up")) == 200, 5.0, 0.1),
                "nginx answers after its workers were killed")
    elif what == "spray":
        n, out = spray(ng.port, 4)
        h.check(n > 20000, "the spray ran: %d requests\n%s" % (n, out))
    r.start()
    # reconnect (backoff) and the first exchanges
    time.sleep(4)
    after = [get(ng, k) for _ in range(20)]
    time.sleep(0.5)
    later = [get(ng, k) for _ in range(20)]
    m = metrics(ng)
    h.note("%s: after Redis came back %s then %s; dropped %d; Redis holds %d keys"
           % (what, after, later, m["dropped_increments"], len(r.keys("*"))))
    h.expect(after == [200] * 20 and later == [200] * 20,
             "%s during the outage: the key (30 of 100r/h) must get the rest of its limit: %s, %s"
             % (what, after, later))
    return ng, m


def test_reload_during_an_outage_locks_no_key_out(h):
    ng, m = lockout(h, "reload")
    log = ng.error_log_text()
    # the first one or two went with the connection that broke: they may
    # have run, and stay local without counting as dropped
    h.expect(m["dropped_increments"] >= 25, "the undelivered counts are counted as dropped: %d"
             % m["dropped_increments"])
    h.expect(re.search(r"increments? .*not sent", log),
             "an error line says the worker's counts were not sent")


def test_killed_worker_during_an_outage_locks_no_key_out(h):
    ng, m = lockout(h, "kill")
    h.expect(m["dropped_increments"] >= 25, "a killed worker's counts are counted as dropped: %d"
             % m["dropped_increments"])
    h.expect(re.search(r"exited without sending", ng.error_log_text()),
             "a line says a worker's counts were lost with it")


def test_spray_during_an_outage_locks_no_key_out(h):
    ng, m = lockout(h, "spray", workers=1)
    h.expect(m["dropped_increments"] > 0, "counts the thread could not keep are counted as dropped")
    h.expect(re.search(r"increments? .*counted on this node only", ng.error_log_text()),
             "an error line says counts stay on this node")


test_spray_during_an_outage_locks_no_key_out.timeout = 90
