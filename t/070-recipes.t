# The README's recipes, each as written there (through the runner's Redis),
# with a local server standing in for the upstreams.
use Test::Nginx::Socket 'no_plan';

no_shuffle();
run_tests();

__DATA__

=== TEST 1: tiers with map: gold and free get their own rates on one zone and key space; internal is not limited
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    map $http_x_plan $plan_rate {
        gold      4r/m;
        internal  "";
        default   2r/m;
    }
    redis_ratelimit_zone $http_x_api_key zone=api:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070a:;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { return 200 "backend\n"; }
    }
--- config
    location /api/ { redis_ratelimit api $plan_rate; proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1; }
--- more_headers eval
[("X-API-Key: free-1") x 3, ("X-API-Key: gold-1\nX-Plan: gold") x 5, ("X-API-Key: ops\nX-Plan: internal") x 6]
--- request eval
[("GET /api/x") x 14]
--- error_code eval
[200, 200, 429, 200, 200, 200, 200, 429, 200, 200, 200, 200, 200, 200]
--- wait: 0.2



=== TEST 2: an allow-list with geo: a listed address is not limited, any other gets the rate
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    # the client address stands in as ?ip= (every test client is 127.0.0.1)
    geo $arg_ip $client_rate {
        default       2r/m;
        10.0.0.0/8    "";
        192.0.2.7     "";
    }
    redis_ratelimit_zone $arg_ip zone=edge:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070b:;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { return 200 "backend\n"; }
    }
--- config
    location /app/ {
        redis_ratelimit edge $client_rate;
        add_header X-RL "[$redis_ratelimit_status]" always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- request eval
[("GET /app/?ip=198.51.100.1") x 3, ("GET /app/?ip=10.1.2.3") x 4, ("GET /app/?ip=192.0.2.7") x 4]
--- error_code eval
[200, 200, 429, 200, 200, 200, 200, 200, 200, 200, 200]
--- response_headers eval
# a listed address: no limit applied, so no status
["X-RL: [PASSED]", "X-RL: [PASSED]", "X-RL: [REJECTED]", ("X-RL: []") x 8]
--- wait: 0.2



=== TEST 3: failed logins: every attempt is checked, only 401s are counted; then even the right password waits
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    map $status $failed_login { 401 1; default ""; }
    redis_ratelimit_zone $arg_user zone=login:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070c:;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location = /login { if ($arg_pw = "right") { return 200 "welcome\n"; } return 401 "no\n"; }
    }
--- config
    location = /login {
        redis_ratelimit login 5r/m count_if=$failed_login;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- request eval
["GET /login?user=ann&pw=right", "GET /login?user=ann&pw=right",
 ("GET /login?user=ann&pw=guess") x 5,
 "GET /login?user=ann&pw=right", "GET /login?user=ann&pw=guess",
 "GET /login?user=bob&pw=right"]
--- error_code eval
[200, 200, 401, 401, 401, 401, 401, 429, 429, 200]
--- wait: 0.2



=== TEST 4: cost per endpoint: one budget per token, an export weighs 50, a batch what X-Items says
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $http_x_api_key zone=api:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070d:;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { return 200 "backend\n"; }
    }
--- config
    location /api/        { redis_ratelimit api 100r/m;                    proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1; }
    location /api/export  { redis_ratelimit api 100r/m cost=50;            proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1; }
    location /api/batch   { redis_ratelimit api 100r/m cost=$http_x_items; proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1; }
--- more_headers eval
["X-API-Key: t1", "X-API-Key: t1\nX-Items: 30", "X-API-Key: t1", "X-API-Key: t1\nX-Items: 19", "X-API-Key: t1", "X-API-Key: t1", "X-API-Key: t2"]
--- request eval
# 50 + 30 = 80; another export (50) does not fit; 19 items: 99; one more: 100; then nothing; another token is untouched
["GET /api/export", "GET /api/batch", "GET /api/export", "GET /api/batch", "GET /api/x", "GET /api/x", "GET /api/export"]
--- error_code eval
[200, 200, 429, 200, 200, 429, 200]
--- wait: 0.2



=== TEST 5: two levels: a global count for everyone (a constant key) and one per consumer; both must pass
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone "search" zone=search_total:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070e:;
    redis_ratelimit_zone $http_x_api_key zone=search_each:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070e:;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { return 200 "backend\n"; }
    }
--- config
    location /search {
        redis_ratelimit search_total 5r/m;
        redis_ratelimit search_each 3r/m;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- more_headers eval
[("X-API-Key: a") x 4, ("X-API-Key: b") x 3, "X-API-Key: c"]
--- request eval
[("GET /search") x 8]
--- error_code eval
# a: 3 (its own limit), b: 2 more (the total's 5), c: none left
[200, 200, 200, 429, 200, 200, 429, 429]
--- wait: 0.2
