#!/usr/bin/env python3
"""Renders the metrics page of a real run as the Grafana dashboard
(nginx-conf/grafana-dashboard.json) lays it out, into a PNG.

    python3 bench/metrics_plot.py [--duration S] [--out nginx-conf/grafana-dashboard.png]

Starts a redis-server and one nginx (2 workers) from build/ on free
127.0.0.1 ports, every process stopped by its PID at the end: wrk sends
10 000 keys far below their limit (zone `api`, 6000r/m, Redis), a client
floods one key at 20r/s (zone `login`, Redis: most of it rejected), a
third zone counts in shared memory only (`edge`); a third of the way in,
Redis is stopped for 5 s and started again. /metrics is scraped every
0.5 s, and the panels are drawn from the scraped counters with the
dashboard's queries (rates over 2 s instead of 1 m). Needs wrk and
matplotlib (`pip install matplotlib`).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "t", "lib"))
import servers  # noqa: E402

CONF = """load_module {root}/build/modules/ngx_http_redis_ratelimit_module.so;
worker_processes 2;
error_log logs/error.log error;
pid logs/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 10000000;
    redis_ratelimit_zone $http_x_key zone=api:16m redis=redis://127.0.0.1:{rport} timeout=200ms;
    redis_ratelimit_zone $arg_k zone=login:1m redis=redis://127.0.0.1:{rport} timeout=200ms;
    redis_ratelimit_zone $http_x_key zone=edge:1m;
    redis_ratelimit_log_level info;
    server {{
        listen 127.0.0.1:{port};
        root html;
        location = /api {{ redis_ratelimit api 6000r/m; try_files /f =404; }}
        location = /login {{ redis_ratelimit login 20r/s; try_files /f =404; }}
        location = /edge {{ redis_ratelimit edge 100r/s; try_files /f =404; }}
        location = /metrics {{ redis_ratelimit_metrics; }}
    }}
}}
"""

SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$')


def parse(text):
    """{(name, frozenset(labels)): value}"""
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = frozenset(tuple(kv.split("=", 1)) for kv in re.findall(r'\w+="[^"]*"', m.group(2)))
            labels = frozenset((k, v.strip('"')) for k, v in labels)
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=45.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "nginx-conf", "grafana-dashboard.png"))
    a = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reg = servers.Registry()
    tmp = tempfile.mkdtemp(prefix="metrics-plot-")
    os.chmod(tmp, 0o755)
    samples = []          # (t, parsed)
    try:
        r = servers.RedisServer(os.path.join(tmp, "redis"), registry=reg).start()
        port = servers.free_port()
        ng = servers.NginxServer(os.path.join(ROOT, "build", "sbin", "nginx"), os.path.join(tmp, "nginx"),
                                 port, workers=2, registry=reg)
        with open(ng.conf_path, "w") as f:
            f.write(CONF.format(root=ROOT, rport=r.port, port=port))
        with open(os.path.join(tmp, "nginx", "html", "f"), "w") as f:
            f.write("ok\n")
        ng.start()
        base = "http://127.0.0.1:%d" % port
        stop = threading.Event()

        def flood():
            while not stop.is_set():
                try:
                    urllib.request.urlopen(base + "/login?k=hot", timeout=2).read()
                except Exception:
                    pass
                time.sleep(0.01)

        def edge():
            i = 0
            while not stop.is_set():
                req = urllib.request.Request(base + "/edge", headers={"X-Key": "e%d" % (i % 50)})
                try:
                    urllib.request.urlopen(req, timeout=2).read()
                except Exception:
                    pass
                i += 1
                time.sleep(0.005)

        wrk = subprocess.Popen(["wrk", "-t1", "-c8", "-d%ds" % int(a.duration), "-s",
                                os.path.join(ROOT, "bench", "keys.lua"), base + "/api", "--", "10000"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        threads = [threading.Thread(target=flood), threading.Thread(target=edge)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        outage = (a.duration / 3, a.duration / 3 + 5)
        stopped = False
        while time.monotonic() - t0 < a.duration:
            now = time.monotonic() - t0
            if not stopped and now >= outage[0]:
                r.stop(quick=True)
                stopped = True
            if stopped and now >= outage[1] and not r.running:
                r.start()
            try:
                text = urllib.request.urlopen(base + "/metrics", timeout=2).read().decode()
                samples.append((now, parse(text)))
            except Exception:
                pass
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(5)
        if wrk.poll() is None:
            wrk.terminate()
        wrk.wait(10)
    finally:
        reg.stop_all()

    def series(name, **labels):
        want = frozenset(labels.items())
        ts, vs = [], []
        for t, s in samples:
            for (n, lab), v in s.items():
                if n == name and want <= lab:
                    ts.append(t)
                    vs.append(v)
                    break
        return ts, vs

    def rate(name, **labels):
        ts, vs = series(name, **labels)
        return ts[1:], [max(0.0, (v1 - v0) / (t1 - t0)) for t0, t1, v0, v1 in zip(ts, ts[1:], vs, vs[1:])]

    zones = ["api", "login", "edge"]
    fig, ax = plt.subplots(3, 3, figsize=(16, 11))
    fig.suptitle("nginx_redis_ratelimit — one nginx (2 workers), one Redis stopped for 5 s "
                 "(grey); bench/metrics_plot.py", fontsize=13)

    def fill(z):
        tk, k = series("nginx_redis_ratelimit_keys", zone=z)
        _, c = series("nginx_redis_ratelimit_keys_capacity", zone=z)
        return tk, [100.0 * a_ / b_ if b_ else 0 for a_, b_ in zip(k, c)]

    redis = ("api", "login")
    # (title, [(label, (times, values))], step)
    panels = [
        ("passed requests/s by zone",
         [(z, rate("nginx_redis_ratelimit_requests_total", zone=z, outcome="passed")) for z in zones], False),
        ("rejected requests/s by zone",
         [(z, rate("nginx_redis_ratelimit_requests_total", zone=z, outcome="rejected")) for z in zones], False),
        ("backend up (1) / down (0)",
         [(z, series("nginx_redis_ratelimit_backend_up", zone=z)) for z in redis], True),
        ("age of the last sync with Redis (s)",
         [(z, series("nginx_redis_ratelimit_last_sync_age_seconds", zone=z)) for z in redis], False),
        ("Redis commands/s", [(z, rate("nginx_redis_ratelimit_redis_commands_total", zone=z)) for z in redis], False),
        ("Redis transport errors/s",
         [(z, rate("nginx_redis_ratelimit_redis_errors_total", zone=z, kind="transport")) for z in redis], False),
        ("zone fill (% of capacity)", [(z, fill(z)) for z in zones], False),
        ("increments waiting on the node",
         [(z, series("nginx_redis_ratelimit_increments_waiting", zone=z)) for z in redis], False),
        ("breaker trips/s", [("login", rate("nginx_redis_ratelimit_breaker_trips_total", zone="login"))], False),
    ]
    for x, (title, lines, step) in zip([x for row in ax for x in row], panels):
        for label, (ts, vs) in lines:
            if step:
                x.step(ts, vs, where="post", label=label)
            else:
                x.plot(ts, vs, label=label)
        x.set_title(title)
        x.legend(fontsize=8)
        x.axvspan(*outage, color="0.85", zorder=0)
        x.set_xlabel("s")
        x.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(a.out, dpi=80)
    print("wrote %s (%d scrapes)" % (a.out, len(samples)))


if __name__ == "__main__":
    main()
