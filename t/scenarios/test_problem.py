"""`redis_ratelimit_problem on`: a rejection answers RFC 9457 problem
details (`application/problem+json`, type `quota-exceeded`,
`violated-policies`), whoever rejected it: a rate limit on the node, the
strict script in Redis (the request woken with the verdict), a
concurrency limit; off, nginx's own page."""

import json
import socket
import threading
import time

from harness import HOST

HTTP = """
    redis_ratelimit_zone $arg_k zone=p:1m redis=%s;
    redis_ratelimit_zone $arg_k zone=c:1m;
"""
SERVER = """
        redis_ratelimit_problem on;
        location = /t      { redis_ratelimit p 100r/h; try_files /t =404; }
        location = /two    { redis_ratelimit p 100r/h; redis_ratelimit p 1000r/d; try_files /t =404; }
        location = /strict { redis_ratelimit p 2r/h strict; try_files /t =404; }
        location = /slow   { redis_ratelimit_conn c 1; proxy_pass http://127.0.0.1:%d; }
        location = /off    { redis_ratelimit p 1r/h; redis_ratelimit_problem off; try_files /t =404; }
"""
TYPE = "https://iana.org/assignments/http-problem-types#quota-exceeded"


def slow_upstream():
    """A listener that answers each connection after 1 s."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((HOST, 0))
    s.listen(64)

    def serve():
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return

            def one(c=c):
                time.sleep(1.0)
                try:
                    c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
                finally:
                    c.close()
            threading.Thread(target=one, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return s


def problem(h, resp, what, policies):
    st, headers, body, _ = resp
    ctype = (headers.get("content-type") or [None])[0]
    h.note("%s: %s %s %r" % (what, st, ctype, body[:200]))
    h.check(st == 429 and ctype == "application/problem+json", "%s: status and type" % what)
    doc = json.loads(body)
    h.check(doc == {"type": TYPE, "status": 429, "violated-policies": policies,
                    "title": "Request cannot be satisfied as assigned quota has been exceeded"},
            "%s: the document: %s" % (what, doc))
    h.check((headers.get("retry-after") or [None])[0] is not None, "%s: Retry-After" % what)


def test_rejections_answer_problem_details(h):
    r = h.redis()
    up = slow_upstream()
    try:
        n = h.nginx(HTTP % r.url, SERVER % up.getsockname()[1], workers=2)
        k = h.key("rate")
        for _ in range(100):
            n.request("/t?k=" + k)
        problem(h, n.request("/t?k=" + k), "a rate limit", ["p"])
        k2 = h.key("two")
        for _ in range(100):
            n.request("/two?k=" + k2)
        problem(h, n.request("/two?k=" + k2), "two limits of one zone", ["p-100r/h"])
        # the strict script rejects: the key's count set in Redis behind the
        # node's back, so the node asks and is woken with the verdict
        ks = h.key("strict")
        now = int(time.time())
        r.cmd("SET", "rl:{p:%s}:3600:%d" % (ks, now // 3600 * 3600), "2", "EX", "7200")
        problem(h, n.request("/strict?k=" + ks), "the strict script", ["p"])
        # a concurrency limit: a second request while the first is in flight
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("a", n.request("/slow?k=c", timeout=5)))
        t.start()
        time.sleep(0.3)
        problem(h, n.request("/slow?k=c"), "a concurrency limit", ["c"])
        t.join(10)
        h.check(out.get("a", [None])[0] == 200, "the one in flight: %s" % (out.get("a", [None])[0],))
        # two on one keep-alive connection, and a HEAD: answered whole
        c = socket.create_connection((HOST, n.port), timeout=5)
        req = "%s /t?k=" + k + " HTTP/1.1\r\nHost: x\r\n\r\n"
        c.sendall(((req % "GET") * 2 + req % "HEAD").encode())
        seen = b""
        deadline = time.time() + 5
        while seen.count(b"HTTP/1.1 429") < 3 and time.time() < deadline:
            chunk = c.recv(65536)
            if not chunk:
                break
            seen += chunk
        c.close()
        h.check(seen.count(b"HTTP/1.1 429") == 3 and seen.count(b'"violated-policies"') == 2,
                "keep-alive: 3 answers, 2 bodies (the HEAD none): %r" % seen[-300:])
        # off: nginx's own page
        ko = h.key("off")
        n.request("/off?k=" + ko)
        st, headers, body, _ = n.request("/off?k=" + ko)
        h.check(st == 429 and b"<html>" in body and "problem" not in str(headers.get("content-type")),
                "off: nginx's page: %s %s" % (st, headers.get("content-type")))
        log = n.error_log_text()
        h.check("[alert]" not in log and "signal" not in log.replace("signal 29", ""),
                "no worker crashed")
    finally:
        up.close()
