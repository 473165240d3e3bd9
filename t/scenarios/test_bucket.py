"""limit_req's bucket (`burst=`, `delay=`, `nodelay`): every assertion of
nginx's own limit_req.t, limit_req2.t, limit_req_delay.t and
limit_req_dry_run.t (nginx/nginx-tests), on their configurations as
scripts/limit-req-tests converts them, on zones without Redis and on
zones with Redis (the fleet's bucket, decided in Redis)."""

import os
import re
import socket
import time

import harness

HTTP = "    redis_ratelimit_status 503;\n"


def on(redis, conf):
    """`conf` with every zone counting through `redis` (None: as it is)."""
    if redis is None:
        return conf
    return re.sub(r"(redis_ratelimit_zone [^;]*);", r"\1 redis=%s;" % redis.url, conf)


def raw_get(port, path, read_after=0.0, timeout=10.0):
    """One request on its own connection, its response read `read_after`
    seconds after it was sent (whole, until the server closes)."""
    s = socket.create_connection((harness.HOST, port), timeout=timeout)
    try:
        s.sendall(b"GET %s HTTP/1.0\r\nHost: localhost\r\n\r\n" % path.encode())
        time.sleep(read_after)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    finally:
        s.close()


def status(resp):
    return int(resp.split(b" ", 2)[1]) if resp.startswith(b"HTTP/") else None


def header(resp, name):
    for line in resp.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name.lower().encode():
            return v.strip().decode()
    return None


def limit_req_t(h, redis=None):
    n = h.nginx(on(redis,
        HTTP
        + "    redis_ratelimit_zone $binary_remote_addr zone=one:1m;\n"
        "    redis_ratelimit_zone $binary_remote_addr zone=long:1m;\n"
        "    redis_ratelimit_zone $binary_remote_addr zone=fast:1m;\n"),
        "        location / { redis_ratelimit one 2r/s burst=1 nodelay; }\n"
        "        location /status { redis_ratelimit one 2r/s burst=1 nodelay;"
        " redis_ratelimit_status 501; }\n"
        "        location /long { redis_ratelimit long 2r/s burst=5; }\n"
        "        location /fast { redis_ratelimit fast 1000r/s burst=1; }\n",
        files={"test1.html": "XtestX", "status.html": "XtestX",
               "long.html": "1234567890\n" * (1 << 16), "fast.html": "XtestX"})
    got = [status(raw_get(n.port, "/test1.html")) for _ in range(3)]
    h.note("burst=1 nodelay at 2r/s: %s" % got)
    h.check(got[0] == 200, "request")
    h.check(got[2] == 503, "request rejected: %s" % got)
    h.check(status(raw_get(n.port, "/status.html")) == 501, "request rejected status")
    raw_get(n.port, "/test1.html")
    raw_get(n.port, "/test1.html")
    # the second /long is delayed; its response is not truncated when the
    # client reads it late
    l1 = len(raw_get(n.port, "/long.html"))
    t0 = time.monotonic()
    l2 = len(raw_get(n.port, "/long.html", read_after=0.6))
    h.note("long: %d and %d bytes, the second in %.2f s" % (l1, l2, time.monotonic() - t0))
    h.check(l1 == l2 and l1 > 700000, "delayed big request not truncated")
    h.check(status(raw_get(n.port, "/test1.html")) == 200, "rejects not counted")
    raw_get(n.port, "/fast.html")
    time.sleep(0.1)
    h.check(status(raw_get(n.port, "/fast.html")) == 200, "negative excess")
    n.stop()


def limit_req2_t(h, redis=None):
    n = h.nginx(on(redis,
        HTTP
        + "    redis_ratelimit_zone $arg_a zone=slow:1m;\n"
        "    redis_ratelimit_zone $arg_b zone=fast:1m;\n"),
        "        location / { redis_ratelimit fast 1000r/s burst=0;"
        " redis_ratelimit slow 1r/m burst=0; }\n"
        "        location /t2.html { redis_ratelimit fast 1000r/s nodelay;"
        " redis_ratelimit slow 1r/m nodelay; alias html/t1.html; }\n",
        files={"t1.html": "XtestX"})
    for path, tag in (("/t1.html", ""), ("/t2.html", "nodelay ")):
        k = {"": ("1", "2"), "nodelay ": ("3", "4")}[tag]
        for args, second in (("b=%s" % k[0], 200), ("a=%s" % k[0], 503),
                             ("a=%s&b=%s" % (k[1], k[1]), 503)):
            first = status(raw_get(n.port, "%s?%s" % (path, args)))
            time.sleep(0.1)
            then = status(raw_get(n.port, "%s?%s" % (path, args)))
            h.note("%s%s: %s then %s" % (tag, args, first, then))
            h.check(first == 200 and then == second, "%s%s: %s then %s" % (tag, args, first, then))
    got = [status(raw_get(n.port, "/t1.html")) for _ in range(2)]
    h.check(got == [200, 200], "no key: %s" % got)
    n.stop()


def limit_req_delay_t(h, redis=None):
    n = h.nginx(on(redis,
        HTTP + "    redis_ratelimit_zone $binary_remote_addr zone=one:1m;\n"),
        "        location / { redis_ratelimit one 30r/m delay=1 burst=2;"
        " add_header X-Time $request_time; }\n",
        files={"delay.html": "XtestX"})
    h.check(status(raw_get(n.port, "/delay.html")) == 200, "request")
    second = raw_get(n.port, "/delay.html")
    # on a Redis zone a request near the burst waits a round trip for the
    # script (which may cross a millisecond): not the delay (2 s) either
    took = float(header(second, "X-Time") or "nan")
    h.check(took == 0.0 or redis is not None and took < 0.05, "not yet delayed: %s" % took)
    # the third waits (2 s); meanwhile a fourth is rejected
    s = socket.create_connection((harness.HOST, n.port), timeout=10)
    s.sendall(b"GET /delay.html HTTP/1.0\r\nHost: localhost\r\n\r\n")
    time.sleep(0.2)
    h.check(status(raw_get(n.port, "/delay.html")) == 503, "rejected")
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
    s.close()
    h.note("the delayed one: %s, X-Time %s" % (status(out), header(out, "X-Time")))
    h.check(status(out) == 200 and header(out, "X-Time") not in (None, "0.000"), "delayed")
    n.stop()


def limit_req_dry_run_t(h, redis=None):
    n = h.nginx(on(redis,
        HTTP
        + "    redis_ratelimit_zone $binary_remote_addr zone=one:1m;\n"
        "    log_format test $uri:$redis_ratelimit_status;\n"),
        "        redis_ratelimit_dry_run on;\n"
        "        add_header X-Status $redis_ratelimit_status always;\n"
        "        access_log logs/test.log test;\n"
        "        location /delay { redis_ratelimit one 1r/m burst=2; }\n"
        "        location /reject { redis_ratelimit one 1r/m burst=0; }\n"
        "        location /reject/off { redis_ratelimit one 1r/m burst=0;"
        " redis_ratelimit_dry_run off; }\n"
        "        location / { }\n",
        files={"delay": "SEE-THIS", "reject": "SEE-THIS"})
    for path, want_status, want in (("/delay", 200, "PASSED"), ("/delay", 200, "DELAYED_DRY_RUN"),
                                    ("/reject", 200, "REJECTED_DRY_RUN"),
                                    ("/reject/off", 503, "REJECTED")):
        r = raw_get(n.port, path)
        h.note("%s: %s %s" % (path, status(r), header(r, "X-Status")))
        h.check(status(r) == want_status and header(r, "X-Status") == want,
                "%s: %s %s, expected %s %s" % (path, status(r), header(r, "X-Status"),
                                               want_status, want))
    r = raw_get(n.port, "/")
    h.check(header(r, "X-Status") is None, "no limit: no X-Status")
    n.stop()
    with open(os.path.join(n.prefix, "logs", "error.log"), encoding="latin-1") as f:
        errors = f.read()
    with open(os.path.join(n.prefix, "logs", "test.log"), encoding="latin-1") as f:
        access = f.read()
    h.check("delaying request, dry" in errors, "log - delay")
    h.check("limiting requests, dry" in errors, "log - reject")
    h.check("\n/:-" in "\n" + access, "log - not found: %r" % access)


def test_a_bucket_s_headers_and_retry_after(h):
    """RateLimit-Policy states a bucket as its burst and the request per the
    time the rate takes to let them through; RateLimit's r is what is left
    of the burst, t when it is whole again; a rejected request's
    Retry-After is when one would pass at once."""
    n = h.nginx("    redis_ratelimit_zone $arg_k zone=b:1m;\n",
                "        location = /t { redis_ratelimit b 1r/s burst=2 nodelay;"
                " redis_ratelimit_headers on; root html; try_files /t =404; }\n")
    seen = []
    for _ in range(4):
        r = raw_get(n.port, "/t?k=x")
        seen.append((status(r), header(r, "RateLimit-Policy"), header(r, "RateLimit"),
                     header(r, "Retry-After")))
    h.note("%s" % seen)
    h.check(seen[0][1] == '"b";q=3;w=3', "the policy: %s" % seen[0][1])
    h.check([s[0] for s in seen] == [200, 200, 200, 429], "three pass: %s" % seen)
    h.check(seen[0][2] == '"b";r=2;t=0' and seen[1][2] == '"b";r=1;t=1',
            "what is left of the burst: %s, %s" % (seen[0][2], seen[1][2]))
    h.check(seen[3][3] == "1" and seen[3][2] == '"b";r=0;t=2',
            "the rejected one: Retry-After %s, %s" % (seen[3][3], seen[3][2]))
    n.stop()


def test_limit_req_t(h):
    limit_req_t(h)


def test_limit_req2_t(h):
    limit_req2_t(h)


def test_limit_req_delay_t(h):
    limit_req_delay_t(h)


def test_limit_req_dry_run_t(h):
    limit_req_dry_run_t(h)


def test_limit_req_t_on_redis(h):
    limit_req_t(h, h.redis())


def test_limit_req2_t_on_redis(h):
    limit_req2_t(h, h.redis())


def test_limit_req_delay_t_on_redis(h):
    limit_req_delay_t(h, h.redis())


def test_limit_req_dry_run_t_on_redis(h):
    limit_req_dry_run_t(h, h.redis())
