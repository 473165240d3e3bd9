"""A flood of new keys in a full zone must not switch off the limit of a key
that counts. A small zone (64k: about 900 keys) turns over every few
milliseconds under wrk's stream of new keys, while one client sends its
own key every 0.1 s: that key must still get exactly its 30 a minute. On
a zone with Redis from the flood's start (Redis's answers give the key its
count back); on a zone without Redis once the key has counted a few (a
key seen once is like every key of the flood; an evicted key would start
afresh there for good). The zone says it is full in the error log."""

import os
import re
import shutil
import subprocess
import threading
import time

from harness import ROOT

SCRIPT = os.path.join(ROOT, "bench", "newkeys.lua")


def flood(port, seconds, out):
    exe = shutil.which("wrk")
    if not exe:
        raise AssertionError("wrk is missing (make test installs it)")
    p = subprocess.run([exe, "-t1", "-c32", "-d%ds" % seconds, "-s", SCRIPT,
                        "http://127.0.0.1:%d/t" % port],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=seconds + 30)
    out.append(p.stdout.decode())


def one_key_under_a_flood(h, backend, first):
    http = "    redis_ratelimit_zone $http_x_key zone=fl:64k%s;\n" % backend
    ng = h.nginx(http, "        location = /t { redis_ratelimit fl 30r/m; }\n")
    h.wait_minute_room(12)
    k = h.key("mine")
    sts = [ng.request("/t", {"X-Key": k})[0] for _ in range(first)]
    out = []
    t = threading.Thread(target=flood, args=(ng.port, 6, out))
    t.start()
    time.sleep(1)
    for _ in range(36 - first):
        try:
            sts.append(ng.request("/t", {"X-Key": k})[0])
        except Exception as e:     # noqa: BLE001
            sts.append(type(e).__name__)
        time.sleep(0.1)
    t.join()
    m = re.search(r"(\d+) requests in", out[0] if out else "")
    flooded = int(m.group(1)) if m else 0
    h.note("%s: %d flood requests; the key got %d x 200, %d x 429"
           % (backend or "local", flooded, sts.count(200), sts.count(429)))
    h.check(flooded > 20000, "the flood ran: %d requests\n%s" % (flooded, out[0] if out else ""))
    h.expect(sts.count(200) == 30 and sts.count(429) == 6,
             "the key keeps its 30 a minute under the flood: %s" % sts)
    h.expect(re.search(r'zone "fl" is full: \d+ keys that still counted were evicted', ng.error_log_text()),
             "a line says the zone is full")


def test_a_flood_of_new_keys_leaves_a_counted_key_limited_with_redis(h):
    r = h.redis()
    one_key_under_a_flood(h, " redis=%s" % r.url, 0)


def test_a_flood_of_new_keys_leaves_a_counted_key_limited_without_redis(h):
    one_key_under_a_flood(h, "", 5)


test_a_flood_of_new_keys_leaves_a_counted_key_limited_with_redis.timeout = 90
test_a_flood_of_new_keys_leaves_a_counted_key_limited_without_redis.timeout = 90
