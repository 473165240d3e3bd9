"""What the sliding window holds, as docs/how-it-works.md states it: at
most L in each fixed window, and up to 2L - 1 in an interval one period
long that straddles two windows (the previous window's L bunched at its
end, then the current window's share as that count fades). Reproduced at
10r/s with a request every 25 ms from 0.3 s before a second begins: the
docs' figure is 17 within the one second from the first request (10
before the boundary, then one each time the estimate falls a request
below the limit)."""

import time

L = 10
STEP = 0.025


def test_an_interval_across_a_window_boundary_holds_up_to_twice_the_limit(h):
    for backend in ("", " redis=%s" % h.redis().url):
        n = h.nginx("    redis_ratelimit_zone $arg_k zone=w:1m%s;\n" % backend,
                    "        location = /t { redis_ratelimit w %dr/s; }\n" % L)
        k = h.key("edge" + ("r" if backend else "l"))
        # the first request 0.3 s before a second begins
        time.sleep(1.7 - time.time() % 1)
        start = time.time()
        passed = []
        for i in range(60):
            at = start + i * STEP
            time.sleep(max(0.0, at - time.time()))
            if n.get("/t?k=" + k)[0] == 200:
                passed.append(time.time() - start)
        in_period = [t for t in passed if t < 1.0]
        before = [t for t in passed if t < 0.3]
        h.note("%s: passed at %s s; %d within the first second, %d before the boundary"
               % ("redis" if backend else "local", ", ".join("%.3f" % t for t in passed),
                  len(in_period), len(before)))
        h.check(len(before) == L, "the first window holds exactly L: %d" % len(before))
        h.check(16 <= len(in_period) <= 18, "about 17 within one period, as the docs say: %d"
                % len(in_period))
        h.check(len(in_period) <= 2 * L - 1, "never more than 2L - 1 in a period: %d" % len(in_period))
        n.stop()
