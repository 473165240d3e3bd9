"""Per-request policies through Redis on two nginx nodes: a
request's cost, rates from a map (tiers) and the legacy headers are global,
not per node. Requests are 0.2 s apart, so that every reply is in before
the next request: what each node decides is then fixed by the counts.
"""

import os
import re
import subprocess
import sys
import time

from harness import ROOT, http_get, wait_for

HTTP = """
    redis_ratelimit_zone $arg_k zone=p:1m redis=%s;
    map $arg_plan $plan_rate { gold 6r/m; default 3r/m; }
"""
SERVER = """
        location = /c { redis_ratelimit p 10r/m cost=4; redis_ratelimit_headers legacy; }
        location = /t { redis_ratelimit p $plan_rate; }
"""


def ask(node, path):
    st, hdrs, _, _ = http_get(node.port, path)
    time.sleep(0.2)
    return st, hdrs


def redis_count(r, key, zone="p"):
    return sum(int(r.cmd("GET", k) or 0) for k in r.keys("rl:{%s:%s}:60:*" % (zone, key)))


def test_cost_and_tiers_are_global(h):
    """cost=4 under 10r/m (a small limit: decided in Redis): node A 200,
    200 (8), node B, fresh, 429 at once (8 + 4 does not fit in 10), then 429
    on both; Redis holds 8 = 2 x 4. X-RateLimit-* on A: limit 10, remaining
    6 then 2. Tiers of one minute share the key's count: 3 free requests on A
    (3r/m) use the count that B's gold plan (6r/m) then continues from: B
    200 (4), 200 (5), 200 (6), 429; Redis holds 6."""
    r = h.redis()
    files = {"c": "ok\n", "t": "ok\n"}
    a = h.nginx(HTTP % r.url, SERVER, files=files)
    b = h.nginx(HTTP % r.url, SERVER, files=files)
    h.wait_minute_room(12)

    kc = h.key("cost")
    got = [ask(a, "/c?k=" + kc), ask(a, "/c?k=" + kc), ask(b, "/c?k=" + kc),
           ask(b, "/c?k=" + kc), ask(a, "/c?k=" + kc)]
    statuses = [st for st, _ in got]
    legacy = [(hd.get("x-ratelimit-limit"), hd.get("x-ratelimit-remaining")) for _, hd in got[:2]]
    wait_for(lambda: redis_count(r, kc) == 8, 2.0)
    in_redis = redis_count(r, kc)
    h.note("cost: A A B B A -> %s; Redis %d; A's X-RateLimit (limit, remaining): %s"
           % (statuses, in_redis, legacy))
    h.check(statuses == [200, 200, 429, 429, 429],
            "cost=4 of 10r/m across two nodes: expected 200 200 429 429 429, got %s" % statuses)
    h.check(in_redis == 8, "Redis should hold the weight 2 x 4 = 8, holds %d" % in_redis)
    h.check(legacy == [(["10"], ["6"]), (["10"], ["2"])],
            "A's legacy headers should say limit 10, remaining 6 then 2: %s" % legacy)

    kt = h.key("tier")
    free = [ask(a, "/t?plan=free&k=" + kt)[0] for _ in range(4)]
    gold = [ask(b, "/t?plan=gold&k=" + kt)[0] for _ in range(4)]
    wait_for(lambda: redis_count(r, kt) == 6, 2.0)
    in_redis = redis_count(r, kt)
    h.note("tiers: A free x4 -> %s; B gold x4 -> %s; Redis %d" % (free, gold, in_redis))
    h.check(free == [200, 200, 200, 429], "free (3r/m) on A: expected 200 x3 then 429, got %s" % free)
    h.check(gold == [200, 200, 200, 429],
            "gold (6r/m) on B continues the key's count of 3: expected 200 x3 then 429, got %s" % gold)
    h.check(in_redis == 6, "Redis should hold 6 for the key, holds %d" % in_redis)


LOGIN_HTTP = """
    redis_ratelimit_zone $arg_k zone=login:1m redis=%s;
    map $status $failed { 401 1; default ""; }
"""
LOGIN_SERVER = """
        location = /login {
            redis_ratelimit login 3r/m count_if=$failed;
            proxy_pass http://127.0.0.1:$server_port/answer/$arg_r;
        }
        location = /answer/ok { return 200 "welcome\\n"; }
        location = /answer/bad { return 401 "no\\n"; }
"""


def test_count_if_is_global(h):
    """count_if=$failed under 3r/m through Redis on two nodes: A's three
    401s fill the key (A's successes are never counted: 200 200 pass
    between them), then A refuses even a good password. B has not heard of
    the key, but a small limit is checked in Redis: B refuses from its first
    request, and Redis holds 3."""
    r = h.redis()
    a = h.nginx(LOGIN_HTTP % r.url, LOGIN_SERVER, files={})
    b = h.nginx(LOGIN_HTTP % r.url, LOGIN_SERVER, files={})
    h.wait_minute_room(10)
    k = h.key("login")
    on_a = [ask(a, "/login?r=%s&k=%s" % (x, k))[0] for x in ("bad", "ok", "bad", "ok", "bad", "ok")]
    wait_for(lambda: redis_count(r, k, "login") == 3, 2.0)
    after_a = redis_count(r, k, "login")
    on_b = [ask(b, "/login?r=%s&k=%s" % (x, k))[0] for x in ("ok", "bad", "ok")]
    time.sleep(0.3)
    in_redis = redis_count(r, k, "login")
    h.note("count_if: A bad ok bad ok bad ok -> %s (Redis %d); B ok bad ok -> %s (Redis %d)"
           % (on_a, after_a, on_b, in_redis))
    h.check(on_a == [401, 200, 401, 200, 401, 429],
            "A: only 401s count; expected 401 200 401 200 401 429, got %s" % on_a)
    h.check(after_a == 3, "Redis should hold A's three failures, holds %d" % after_a)
    h.check(on_b == [429, 429, 429],
            "B: closed by the global count from its first request: expected 429 x3, got %s" % on_b)
    h.check(in_redis == 3, "Redis should hold 3 failures, holds %d" % in_redis)


def test_after_x_ratelimit_reset_the_whole_quota_is_back(h):
    """X-RateLimit-Reset is the Unix time the whole quota is back, as
    clients of the GitHub convention read it: 3r/s spent, then after
    waiting until Reset a client gets all 3 again (Remaining counts down from 2); waiting only
    until the end of the window would find the previous window still
    weighing (Retry-After says when a single request may pass)."""
    n = h.nginx("    redis_ratelimit_zone $arg_k zone=hq:1m;\n",
                "        location = /q { redis_ratelimit hq 3r/s; redis_ratelimit_headers legacy; }\n",
                files={"q": "ok\n"})
    k = h.key("reset")
    first = [http_get(n.port, "/q?k=" + k) for _ in range(4)]
    reset = int(first[2][1].get("x-ratelimit-reset", ["-1"])[0]) - int(time.time())
    time.sleep(max(0, reset + 1 - time.time() % 1))
    again = [http_get(n.port, "/q?k=" + k) for _ in range(4)]
    h.note("3r/s: %s, Reset after the third %d s; after waiting it: %s, Remaining %s"
           % ([s for s, _, _, _ in first], reset, [s for s, _, _, _ in again],
              [hd.get("x-ratelimit-remaining", [None])[0] for _, hd, _, _ in again]))
    h.check([s for s, _, _, _ in first] == [200, 200, 200, 429], "3 of 3r/s pass")
    h.check(1 <= reset <= 2, "the quota is back by the end of the next window: %d s from now" % reset)
    h.check([s for s, _, _, _ in again] == [200, 200, 200, 429], "the whole quota after Reset")
    h.check([hd.get("x-ratelimit-remaining", [None])[0] for _, hd, _, _ in again[:3]] == ["2", "1", "0"],
            "Remaining counts down from the full limit")


def test_a_github_client_reads_the_legacy_headers(h):
    """PyGithub, a client written for GitHub's X-RateLimit-* headers,
    against a location that answers as GitHub's API would (3r/s, legacy
    headers): it reads the limit and what is left, its reset time is a
    Unix time one or two seconds ahead, the fourth request is refused,
    and once the reset time has come it gets the whole quota again."""
    lib = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ensure-pylib")],
                         capture_output=True, text=True, timeout=300)
    h.check(lib.returncode == 0, "PyGithub installed into build/pylib: %s" % lib.stderr[-500:])
    sys.path.insert(0, lib.stdout.strip())
    import github     # noqa: E402 (from build/pylib)
    n = h.nginx("    redis_ratelimit_zone $remote_addr zone=gh:1m;\n",
                "        default_type application/json;\n"
                "        location /users/ { redis_ratelimit gh 3r/s; redis_ratelimit_headers legacy; }\n",
                files={"users/octocat": '{"login": "octocat", "id": 1}'})
    g = github.Github(base_url="http://127.0.0.1:%d" % n.port, retry=None)
    # the four requests within one second's window
    time.sleep(1.01 - time.time() % 1)
    users = [g.get_user("octocat").login for _ in range(3)]
    remaining, limit = g.rate_limiting
    reset_at = g.rate_limiting_resettime
    now = time.time()
    try:
        g.get_user("octocat")
        refused = None
    except github.GithubException as e:
        refused = e.status
    h.note("3 users %s; rate_limiting %s, reset %d (%.1f s ahead); the 4th: %s"
           % (users, (remaining, limit), reset_at, reset_at - now, refused))
    h.check(users == ["octocat"] * 3 and (remaining, limit) == (0, 3), "3 of 3 read: %s" % ((remaining, limit),))
    h.check(now < reset_at <= now + 2.5, "the reset time is a Unix time 1 to 2 s ahead: %s" % reset_at)
    h.check(refused == 429, "the 4th is refused (429): %s" % refused)
    time.sleep(max(0.0, reset_at - time.time()) + 0.05)
    h.check(g.get_user("octocat").login == "octocat" and g.rate_limiting == (2, 3),
            "at the reset time the quota is back: %s" % (g.rate_limiting,))


def test_each_policy_of_a_response_has_its_own_name(h):
    """The README's /login, two limits on one zone: RateLimit-Policy names
    them apart ("login-5r/m", "login-100r/h") and RateLimit names one of
    them (the tightest); a zone with one limit keeps its plain name."""
    n = h.nginx("    redis_ratelimit_zone $arg_k zone=login:1m;\n    redis_ratelimit_zone $arg_k zone=ip:1m;\n",
                "        location = /login { redis_ratelimit login 5r/m; redis_ratelimit login 100r/h;\n"
                "                            redis_ratelimit ip 50r/s; redis_ratelimit_headers on; }\n",
                files={"login": "ok\n"})
    st, hd, _, _ = http_get(n.port, "/login?k=" + h.key("names"))
    policy, state = hd.get("ratelimit-policy", [""])[0], hd.get("ratelimit", [""])[0]
    names = re.findall(r'"((?:[^"\\]|\\.)*)";q=', policy)
    h.note("RateLimit-Policy: %s; RateLimit: %s" % (policy, state))
    h.check(st == 200, "passed")
    h.check(names == ["login-5r/m", "login-100r/h", "ip"], "one name per policy: %s" % names)
    h.check(re.match(r'"login-5r/m";r=4;t=\d+$', state), "RateLimit names the tightest: %s" % state)
