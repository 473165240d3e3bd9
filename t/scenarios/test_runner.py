"""The test runner keeps the project's promise: no test is skipped to get
green. A `.t` file that needs Redis when no redis-server can be started
fails (it is not skipped), and a block left out with `--- SKIP` counts as a
failure. t/runner.py is run on small `.t` files of its own here.
"""

import os
import subprocess
import sys

from harness import MODULE_SO, NGINX_BIN, ROOT

NEEDS_REDIS = """use Test::Nginx::Socket 'no_plan';
run_tests();

__DATA__

=== TEST 1: a zone on the runner's Redis
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT;
--- config
    location = /t { redis_ratelimit z 10r/s; }
--- user_files
>>> t
ok
--- request
GET /t?k=a
--- error_code: 200
"""

SKIPPED = """use Test::Nginx::Socket 'no_plan';
run_tests();

__DATA__

=== TEST 1: left out
--- SKIP
--- config
    location = /t { return 200; }
--- request
GET /t
--- error_code: 200
"""


def run_runner(h, name, text, path_env=None):
    f = os.path.join(h.tmp, name)
    with open(f, "w") as out:
        out.write(text)
    env = dict(os.environ, TEST_NGINX_BINARY=NGINX_BIN, TEST_NGINX_LOAD_MODULES=MODULE_SO)
    env.pop("TEST_NGINX_REDIS_PORT", None)
    if path_env is not None:
        env["PATH"] = path_env
    p = subprocess.run([sys.executable, os.path.join(ROOT, "t", "runner.py"), f],
                       capture_output=True, text=True, env=env, timeout=120)
    return p.returncode, p.stdout + p.stderr


def test_no_redis_fails_and_skip_fails(h):
    """PATH without redis-server: the file that needs Redis reports not ok,
    says why, and the run exits non-zero; a --- SKIP block is not ok too."""
    rc, out = run_runner(h, "needs-redis.t", NEEDS_REDIS, path_env=h.tmp)
    h.note("no redis-server on PATH: exit %d; %s" % (rc, " | ".join(
        l for l in out.splitlines() if l.startswith(("ok", "not ok", "#   ", "0 ", "1 ")))[:600]))
    h.check(rc != 0, "the run must fail without Redis, exit status was 0")
    h.check("not ok 1" in out, "the block must be reported not ok")
    h.check("Redis is not available" in out, "the failure must say Redis is not available")
    h.check("0 passed, 1 failed" in out, "the summary must count it failed")

    rc, out = run_runner(h, "skipped.t", SKIPPED)
    h.note("--- SKIP: exit %d; %s" % (rc, " | ".join(
        l for l in out.splitlines() if l.startswith(("ok", "not ok", "0 ", "1 ")))))
    h.check(rc != 0, "a skipped block must fail the run, exit status was 0")
    h.check("skipping a test fails the run" in out, "the skip must be reported as a failure")
