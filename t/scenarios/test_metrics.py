"""redis_ratelimit_metrics on a real nginx (2 workers) and a real Redis:
the page passes `promtool check metrics`, its counts match the traffic
sent across both workers and after a reload, JSON agrees with the text,
every metric the Grafana dashboard (nginx-conf/grafana-dashboard.json)
queries is there, and a Redis outage moves the backend gauge and the error
counters."""

import json
import os
import re
import subprocess
import time

from harness import ROOT, wait_for

HTTP = """
    redis_ratelimit_zone $arg_k zone=rz:1m redis=%s hold=0;
    redis_ratelimit_zone $arg_k zone=held:1m redis=%s hold=5s;
    redis_ratelimit_zone $arg_k zone=local:1m;
"""
SERVER = """
        location = /t { redis_ratelimit rz 5r/m; }
        location = /h { redis_ratelimit held 6000r/m; }
        location = /l { redis_ratelimit local 3r/m; }
        location = /metrics { redis_ratelimit_metrics; }
"""
FILES = {"t": "ok\n", "l": "ok\n", "h": "ok\n"}


def promtool():
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ensure-promtool")],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300)
    if p.returncode != 0:
        raise AssertionError("no promtool: %s" % p.stderr.decode(errors="replace"))
    return p.stdout.decode().strip().splitlines()[-1]


def sample(text, name, **labels):
    """The value of one sample of the text exposition (None if absent)."""
    want = ",".join('%s="%s"' % kv for kv in labels.items())
    m = re.search(r"^%s\{%s\} (\S+)$" % (re.escape(name), re.escape(want)), text, re.M)
    return float(m.group(1)) if m else None


def page(ng, fmt=""):
    st, hdrs, body, _ = ng.request("/metrics" + fmt)
    if st != 200:
        raise AssertionError("/metrics answered %s" % st)
    return body.decode()


def test_metrics_page(h):
    """Traffic over 2 workers: 5 passed and 3 rejected on the Redis zone,
    3 passed and 2 rejected on the local one; promtool accepts the page;
    JSON agrees; a reload keeps the counts; Redis stopped: backend_up 0 and
    transport errors; started again: backend_up 1."""
    tool = promtool()
    r = h.redis()
    ng = h.nginx(HTTP % (r.url, r.url), SERVER, files=FILES, workers=2)
    h.wait_minute_room(15)
    k = h.key("m")
    got = [ng.get("/t?k=" + k)[0] for _ in range(8)] + [ng.get("/l?k=" + k)[0] for _ in range(5)]
    h.check(got == [200] * 5 + [429] * 3 + [200] * 3 + [429] * 2, "traffic: %s" % got)
    wait_for(lambda: (sample(page(ng), "nginx_redis_ratelimit_redis_commands_total", zone="rz") or 0) > 0, 2.0)
    text = page(ng)

    p = subprocess.run([tool, "check", "metrics"], input=text.encode(),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
    h.note("promtool check metrics: exit %d %s" % (p.returncode, p.stdout.decode().strip()[:300]))
    h.check(p.returncode == 0, "promtool check metrics failed:\n%s\n--- page:\n%s" % (p.stdout.decode(), text))

    want = {("rz", "passed"): 5, ("rz", "rejected"): 3, ("local", "passed"): 3, ("local", "rejected"): 2}
    counts = {(z, o): sample(text, "nginx_redis_ratelimit_requests_total", zone=z, outcome=o) for z, o in want}
    h.note("requests_total: %s" % counts)
    h.check(counts == {kk: float(v) for kk, v in want.items()}, "counts %s, expected %s" % (counts, want))
    h.check(sample(text, "nginx_redis_ratelimit_backend_up", zone="rz") == 1.0, "backend_up should be 1")
    h.check(sample(text, "nginx_redis_ratelimit_backend_up", zone="local") is None,
            "a zone without Redis has no backend_up")

    # every metric the Grafana dashboard queries is on the page
    with open(os.path.join(ROOT, "nginx-conf", "grafana-dashboard.json")) as f:
        dash = json.load(f)
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"nginx_redis_ratelimit_\w+", target["expr"]))
    missing = sorted(m for m in used if not re.search(r"^%s[{ ]" % re.escape(m), text, re.M))
    h.note("dashboard: %d panels, %d metrics, all on the page" % (len(dash["panels"]), len(used)))
    h.check(not missing, "the dashboard queries metrics the page does not have: %s" % missing)

    j = json.loads(page(ng, "?format=json"))
    jz = j["zones"]["rz"]
    h.check(jz["requests"] == {"passed": 5, "rejected": 3, "rejected_dry_run": 0, "not_limited": 0},
            "JSON: %s" % jz["requests"])
    h.check(jz["redis"]["up"] is True and jz["redis"]["on_error"] == "local", "JSON redis: %s" % jz["redis"])
    h.check(j["zones"]["local"]["redis"] is None, "JSON: the local zone has no redis part")
    h.check(jz["redis"]["commands"] >= sample(text, "nginx_redis_ratelimit_redis_commands_total", zone="rz"),
            "JSON commands fewer than the text's, read before")

    ng.reload()
    after = page(ng)
    h.check(sample(after, "nginx_redis_ratelimit_requests_total", zone="rz", outcome="passed") == 5.0,
            "the counts should survive a reload:\n%s" % after[:400])

    errs0 = sample(after, "nginx_redis_ratelimit_redis_errors_total", zone="rz", kind="transport")
    r.stop()
    t0 = time.monotonic()
    down = wait_for(lambda: sample(page(ng), "nginx_redis_ratelimit_backend_up", zone="rz") == 0.0, 5.0, 0.1)
    text = page(ng)
    errs1 = sample(text, "nginx_redis_ratelimit_redis_errors_total", zone="rz", kind="transport")
    h.note("Redis stopped: backend_up 0 after %.2f s; transport errors %s -> %s" % (time.monotonic() - t0, errs0, errs1))
    h.check(down, "backend_up did not go to 0 within 5 s of stopping Redis")
    h.check(errs1 > errs0, "transport errors should grow: %s -> %s" % (errs0, errs1))
    r.start()
    up = wait_for(lambda: sample(page(ng), "nginx_redis_ratelimit_backend_up", zone="rz") == 1.0, 10.0, 0.1)
    h.check(up, "backend_up did not come back to 1 within 10 s of starting Redis")


def test_waiting_increments(h):
    """hold=5s, far from the limit: three requests wait on the node; the
    gauge shows them within a second (each Redis thread refreshes its share
    at least once a second) and drops to 0 once they are sent."""
    r = h.redis()
    ng = h.nginx(HTTP % (r.url, r.url), SERVER, files=FILES, workers=2)
    h.wait_minute_room(10)
    for i in range(3):
        h.check(ng.get("/h?k=" + h.key("w%d" % i))[0] == 200, "far request")
    t0 = time.monotonic()
    seen = wait_for(lambda: sample(page(ng), "nginx_redis_ratelimit_increments_waiting", zone="held") == 3.0,
                    1.5, 0.05)
    at = time.monotonic() - t0
    gone = wait_for(lambda: sample(page(ng), "nginx_redis_ratelimit_increments_waiting", zone="held") == 0.0,
                    7.0, 0.1)
    h.note("3 waiting seen after %.2f s; 0 after %.2f s" % (at, time.monotonic() - t0))
    h.check(seen, "increments_waiting should show the 3 held requests within 1.5 s")
    h.check(gone, "increments_waiting should drop to 0 once they are sent (hold=5s)")


def test_a_killed_workers_waiting_increments_leave_the_gauge(h):
    """hold=60s keeps 200 counts over 20 keys far from their limit on the
    worker; SIGKILL of the worker loses them (nothing reached Redis: the
    crash-loss bound is what a worker holds) and the gauge, read from the
    worker the master starts next, no longer shows them."""
    import signal
    r = h.redis()
    n = h.nginx("    redis_ratelimit_zone $arg_k zone=hz:1m redis=%s hold=60s;\n" % r.url,
                "        location = /h { redis_ratelimit hz 100000r/h; }\n"
                "        location = /metrics { redis_ratelimit_metrics; }\n",
                files={"h": "ok\n"})
    keys = [h.key("crash%d" % i) for i in range(20)]
    for i in range(200):
        n.get("/h?k=" + keys[i % 20])

    def waiting():
        return json.loads(n.request("/metrics?format=json")[2])["zones"]["hz"]["redis"]["waiting"]

    held = wait_for(lambda: waiting() == 200, 3.0)
    before = waiting()
    old = set(n.worker_pids())
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    respawned = wait_for(lambda: n.worker_pids() and not (set(n.worker_pids()) & old), 5.0)
    after = waiting() if respawned else None
    in_redis = sum(len(r.keys("rl:{hz:%s}:*" % k)) for k in keys)
    h.note("waiting before the kill %d, after the new worker started %s; counters in Redis %d"
           % (before, after, in_redis))
    h.check(held, "the worker holds all 200 counts (hold=60s): %d" % before)
    h.check(respawned, "the master started a new worker")
    h.check(after == 0, "the dead worker's 200 left the gauge: %s" % after)
    h.check(in_redis == 0, "held counts die with the worker (nothing was sent): %d" % in_redis)


def test_a_key_held_at_its_limit_counts_one_breaker_opening_per_window(h):
    """One key flooded for 3 s at 5r/s (through Redis, hold=0): its breaker
    opens again and again as its estimate dips under the limit, but the
    figure counts the key once per window (at most one per second here),
    not once per reply."""
    r = h.redis()
    n = h.nginx("    redis_ratelimit_zone $arg_k zone=bz:1m redis=%s hold=0;\n" % r.url,
                "        location = /b { redis_ratelimit bz 5r/s; }\n"
                "        location = /metrics { redis_ratelimit_metrics; }\n",
                files={"b": "ok\n"})
    k = h.key("hot")
    t0 = time.monotonic()
    statuses = []
    while time.monotonic() - t0 < 3.0:
        statuses.append(n.get("/b?k=" + k)[0])
        time.sleep(0.005)
    z = json.loads(n.request("/metrics?format=json")[2])["zones"]["bz"]
    h.note("3 s of one key at 5r/s: %d requests, %d passed; breaker openings counted: %d"
           % (len(statuses), statuses.count(200), z["breaker_trips"]))
    h.check(statuses.count(429) > 100, "the key was limited most of the time")
    h.check(1 <= z["breaker_trips"] <= 5, "once per key and window: %d" % z["breaker_trips"])
