"""Concurrency limits (`redis_ratelimit_conn`) on a zone without Redis, as
`limit_conn`: a slow upstream that counts its own requests in flight, many
clients at once, two workers sharing the slots; every way a request ends
gives its slot back (a response, a client gone, an internal redirect, a
reload), and a request takes its slot once."""

import http.server
import json
import os
import socket
import re
import socketserver
import subprocess
import threading
import time

from harness import HOST, free_port

HTTP = """
    redis_ratelimit_zone $arg_k zone=c:1m;
    upstream slow { server 127.0.0.1:%d; }
"""
SERVER = """
        add_header X-Conn $redis_ratelimit_conn_status always;
        location /slow { redis_ratelimit_conn c 3; proxy_pass http://slow; }
        location /dry  { redis_ratelimit_conn c 1; redis_ratelimit_dry_run on; proxy_pass http://slow; }
        location /hop  { redis_ratelimit_conn c 1; error_page 404 = /slow; proxy_intercept_errors on;
                         proxy_pass http://slow/missing; }
        location /both { redis_ratelimit c 2r/m; redis_ratelimit_conn c 1; proxy_pass http://slow; }
        location /free { proxy_pass http://slow; }
        location /hdr  { redis_ratelimit c 10r/m; redis_ratelimit_conn c 2; redis_ratelimit_headers on;
                         proxy_pass http://slow; }
        location = /metrics { redis_ratelimit_metrics; }
        location = /page.html { ssi on; root html; }
        location /inc/ { redis_ratelimit_conn c 1; proxy_pass http://slow; }
"""


class Upstream:
    """An HTTP server that answers after `delay` seconds and keeps the most
    requests it had in flight at once (404 for /missing, at once)."""

    def __init__(self, delay):
        self.delay, self.now, self.most, self.lock = delay, 0, 0, threading.Lock()
        up = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path.startswith("/missing"):
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with up.lock:
                    up.now += 1
                    up.most = max(up.most, up.now)
                try:
                    time.sleep(up.delay)
                finally:
                    # before the response: nginx may end the request (and
                    # give its slot back) as soon as it has the body
                    with up.lock:
                        up.now -= 1
                try:
                    body = b"slow\n"
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass

        class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.port = free_port()
        self.server = S((HOST, self.port), H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def at_once(n, path, count, timeout=10.0):
    """`count` requests at once; their (status, X-Conn) in order."""
    out = [None] * count

    def one(i):
        try:
            st, headers, _, _ = n.request(path, timeout=timeout)
            out[i] = (st, (headers.get("x-conn") or [None])[0],
                      (headers.get("retry-after") or [None])[0])
        except OSError as e:
            out[i] = ("error: %s" % e, None, None)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout + 5)
    return out


def setup(h, delay=1.0, workers=2, server=SERVER):
    up = Upstream(delay)
    try:
        n = h.nginx(HTTP % up.port, server, workers=workers, files={
            "page.html": "".join('<!--# include virtual="/inc/%d?k=ssi" -->' % i for i in range(3))})
    except Exception:
        up.stop()
        raise
    return up, n


def test_at_most_the_number_in_flight_across_workers(h):
    """20 clients at once on `redis_ratelimit_conn c 3` (2 workers), the
    upstream taking 1 s: the upstream never has more than 3, the others are
    refused with the status and Retry-After; once they end, 3 more pass."""
    up, n = setup(h)
    try:
        got = at_once(n, "/slow?k=a", 20)
        passed = [g for g in got if g[0] == 200]
        refused = [g for g in got if g[0] == 429]
        h.note("20 at once: %d passed, %d refused, upstream had %d at most"
               % (len(passed), len(refused), up.most))
        h.check(len(passed) == 3 and len(refused) == 17, "3 pass: %s" % got)
        h.check(up.most <= 3, "the upstream never had more than 3: %d" % up.most)
        h.check(all(g[1] == "PASSED" for g in passed) and all(g[1] == "REJECTED" for g in refused),
                "$redis_ratelimit_conn_status: %s" % got)
        h.check(all(g[2] == "1" for g in refused), "Retry-After: 1 on the refused: %s" % refused[:2])
        again = at_once(n, "/slow?k=a", 4)
        h.check(sorted(g[0] for g in again) == [200, 200, 200, 429], "slots given back: %s" % again)
        h.check([g[0] for g in at_once(n, "/slow?k=b", 3)] == [200] * 3, "another key its own")
        free = at_once(n, "/free?k=a", 1)
        h.check(free[0][1] is None, "no limit applied: not found: %s" % free)
        c = json.loads(n.request("/metrics?format=json")[2])["zones"]["c"]["conn"]
        h.note("metrics: %s" % c)
        h.check(c["in_flight"] == 0 and c["rejected"] == 18, "in flight back to 0, 18 refused: %s" % c)
    finally:
        up.stop()


def test_clients_that_go_away_give_their_slots_back(h):
    """100 clients send a request and close their connection while the
    upstream still works on it (5 s): none of their slots stays taken, and
    3 new requests pass at once, long before those 5 s."""
    up, n = setup(h, delay=5.0)
    try:
        socks = []
        for _ in range(100):
            s = socket.create_connection((HOST, n.port), timeout=5)
            s.sendall(b"GET /slow?k=gone HTTP/1.1\r\nHost: x\r\n\r\n")
            socks.append(s)
        time.sleep(0.2)
        for s in socks:
            s.close()
        time.sleep(0.5)
        up.delay = 0.2
        got = at_once(n, "/slow?k=gone", 3)
        h.note("after 100 clients went away: %s" % got)
        h.check([g[0] for g in got] == [200] * 3, "3 pass again: %s" % got)
    finally:
        up.stop()


def test_a_request_takes_its_slot_once(h):
    """`redis_ratelimit_conn c 1` on a location whose upstream's 404 goes
    to another location (`error_page 404 = /slow`, an internal redirect):
    the request keeps its one slot, is not refused by it, and gives it
    back; a request a rate limit refuses takes no slot."""
    up, n = setup(h, delay=0.2)
    try:
        first = at_once(n, "/hop?k=h", 1)
        second = at_once(n, "/hop?k=h", 1)
        h.note("through an internal redirect: %s, then %s" % (first, second))
        h.check(first[0][0] == 200 and second[0][0] == 200, "one slot, given back: %s %s"
                % (first, second))
        rate = [at_once(n, "/both?k=r", 1)[0][0] for _ in range(4)]
        h.note("2r/m and 1 in flight, one after the other: %s" % rate)
        h.check(rate == [200, 200, 429, 429], "refused by the rate, no slot held: %s" % rate)
    finally:
        up.stop()


def test_dry_run_passes_and_says_so(h):
    """`redis_ratelimit_dry_run on`: a request over the number passes,
    `REJECTED_DRY_RUN`, and the log says `limiting connections, dry run,`."""
    up, n = setup(h, delay=0.5)
    try:
        got = at_once(n, "/dry?k=d", 3)
        h.note("%s" % got)
        h.check([g[0] for g in got] == [200] * 3, "all pass: %s" % got)
        h.check(sorted(g[1] for g in got) == ["PASSED", "REJECTED_DRY_RUN", "REJECTED_DRY_RUN"],
                "statuses: %s" % got)
        with open(os.path.join(n.prefix, "logs", "error.log"), encoding="latin-1") as f:
            h.check('limiting connections, dry run, by zone "c"' in f.read(), "the log line")
    finally:
        up.stop()


def test_a_reload_with_requests_in_flight_leaks_nothing(h):
    """Three slow requests hold every slot; nginx reloads meanwhile; once
    they end (served by the old workers), the new workers find the slots
    free."""
    up, n = setup(h, delay=1.5)
    try:
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("a", at_once(n, "/slow?k=rl", 3)))
        t.start()
        time.sleep(0.4)
        during = at_once(n, "/slow?k=rl", 1, timeout=5)
        n.reload()
        t.join(20)
        after = at_once(n, "/slow?k=rl", 4)
        h.note("in flight: %s; during: %s; after the reload: %s" % (out.get("a"), during, after))
        h.check([g[0] for g in out.get("a", [])] == [200] * 3, "the three in flight end well")
        h.check(during[0][0] == 429, "full while they run: %s" % during)
        h.check(sorted(g[0] for g in after) == [200, 200, 200, 429], "nothing leaked: %s" % after)
    finally:
        up.stop()


def curl_h2(port, paths, timeout=5.0):
    """`paths` as HTTP/2 streams of one connection (curl, prior knowledge,
    all at once); returns the statuses in the order they finished (none
    for a stream curl gave up on)."""
    args = ["curl", "-sS", "--no-progress-meter", "--http2-prior-knowledge", "--parallel",
            "--parallel-immediate", "--max-time", str(timeout), "-w", "%{http_code}\\n"]
    for p in paths:
        args += ["-o", "/dev/null", "http://%s:%d%s" % (HOST, port, p)]
    out = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         timeout=timeout + 10).stdout.decode("utf-8", "replace")
    return [int(c) for c in re.findall(r"^(\d{3})$", out, re.M) if c != "000"]


def test_http2_streams_take_slots_and_a_reset_gives_them_back(h):
    """HTTP/2 streams of one connection are requests: 5 at once on `... 3`
    get 3 x 200 and 2 x 429; a connection that goes away while its 3
    streams wait on the upstream (5 s) gives their slots back at once."""
    up, n = setup(h, delay=0.5, server=SERVER.replace("add_header", "http2 on;\n        add_header", 1))
    try:
        got = sorted(curl_h2(n.port, ["/slow?k=h2"] * 5))
        h.note("5 streams: %s" % got)
        h.check(got == [200, 200, 200, 429, 429], "3 pass, 2 refused: %s" % got)
        up.delay = 5.0
        gone = curl_h2(n.port, ["/slow?k=h2r"] * 3, timeout=0.5)
        up.delay = 0.2
        again = sorted(curl_h2(n.port, ["/slow?k=h2r"] * 3))
        h.note("3 streams given up after 0.5 s: %s; then 3 more: %s" % (gone, again))
        h.check(again == [200, 200, 200], "the reset streams' slots are free: %s" % again)
    finally:
        up.stop()


def test_subrequests_count_with_their_main_request(h):
    """A page with three SSI includes of a location limited to one request
    in flight: the page is one request, its includes subrequests of it,
    and none of them is refused by the page's own slot (nor holds one of
    its own)."""
    up, n = setup(h, delay=0.1)
    try:
        st, _, body, _ = n.request("/page.html")
        h.note("the page: %s %r" % (st, body[:60]))
        h.check(st == 200 and body.count(b"slow") == 3, "three includes served: %s %r" % (st, body))
        got = at_once(n, "/inc/x?k=ssi", 2, timeout=5)
        h.check(sorted(g[0] for g in got) == [200, 429], "the key's one slot, given back: %s" % got)
    finally:
        up.stop()


def test_ratelimit_headers_state_the_concurrency_policy(h):
    """`redis_ratelimit_headers on` with a rate and a concurrency limit: the
    rate's policy, and the concurrency limit's with
    `qu="concurrent-requests"` (draft-ietf-httpapi-ratelimit-headers-11)
    and what is left of it, in lines of their own; a refused request's
    says none is left."""
    up, n = setup(h, delay=1.0)
    try:
        got = {}

        def one(i):
            got[i] = n.request("/hdr?k=hd", timeout=5.0)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        ok = [g for g in got.values() if g[0] == 200]
        no = [g for g in got.values() if g[0] == 429]
        h.check(len(ok) == 2 and len(no) == 1, "2 pass, 1 refused: %s" % [g[0] for g in got.values()])
        for st, headers, _, _ in ok + no:
            pol = headers.get("ratelimit-policy") or []
            state = headers.get("ratelimit") or []
            h.note("%d: RateLimit-Policy %s, RateLimit %s" % (st, pol, state))
            h.check('"c-conn";q=2;qu="concurrent-requests"' in pol, "the policy: %s" % pol)
            conn = [v for v in state if v.startswith('"c-conn"')]
            h.check(len(conn) == 1 and re.fullmatch(r'"c-conn";r=[01]', conn[0]), "its state: %s" % state)
        h.check(any(v == '"c-conn";r=0' for v in (no[0][1].get("ratelimit") or [])),
                "refused: none left: %s" % no[0][1])
    finally:
        up.stop()
