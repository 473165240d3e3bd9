# The recipes of docs/recipes.md, each as written there but with smaller
# limits (through the runner's Redis), a local server standing in for the
# upstream, and the same names, so that what the docs promise is what
# nginx does: forged tiers, X-Items: 0 and missing keys included.
use Test::Nginx::Socket 'no_plan';

no_shuffle();
no_root_location();
run_tests();

__DATA__

=== TEST 1: tiers by API key: each plan its rate, internal not limited; X-Plan cannot buy gold, unknown and missing keys share their address's count
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    map $http_x_api_key $tier_account {
        default        "";
        "k-gold"       "gold:acme";
        "k-free"       "free:bob";
        "k-ops"        "internal:ops";
    }
    map $tier_account $tier_client {
        ""       "addr:$binary_remote_addr";
        default  $tier_account;
    }
    map $tier_account $tier_rate {
        "~^gold:"      4r/m;
        "~^free:"      2r/m;
        "~^internal:"  "";
        default        1r/m;
    }
    redis_ratelimit_zone $tier_client zone=tiers:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070a:;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { return 200 "backend\n"; }
    }
--- config
    location /api/ {
        redis_ratelimit tiers $tier_rate;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- more_headers eval
[("X-API-Key: k-free") x 3, ("X-API-Key: k-gold") x 5, "X-API-Key: K-GOLD", ("X-API-Key: k-ops") x 4,
 "X-API-Key: k-made-up\nX-Plan: gold", "X-Plan: gold", "X-API-Key: k-other"]
--- request eval
[("GET /api/x") x 16]
--- error_code eval
# free: 2; gold: 4 (K-GOLD is the same account); ops: all; a made-up key
# with X-Plan: gold gets the address's 1r/m, and neither no key nor
# another made-up key gets more
[200, 200, 429, 200, 200, 200, 200, 429, 429, 200, 200, 200, 200, 200, 429, 429]
--- wait: 0.2



=== TEST 2: an allow-list with geo: a listed address is not limited, any other gets the rate
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    # the client address stands in as ?ip= (every test client is 127.0.0.1)
    geo $arg_ip $edge_rate {
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
    location / {
        redis_ratelimit edge $edge_rate;
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
    map $status $login_failed { 401 1; default ""; }
    redis_ratelimit_zone $binary_remote_addr zone=logins:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070c:;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location = /login { if ($arg_pw = "right") { return 200 "welcome\n"; } return 401 "no\n"; }
    }
--- config
    location = /login {
        redis_ratelimit logins 5r/m count_if=$login_failed;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- request eval
["GET /login?pw=right", "GET /login?pw=right",
 ("GET /login?pw=guess") x 5,
 "GET /login?pw=right", "GET /login?pw=guess"]
--- error_code eval
[200, 200, 401, 401, 401, 401, 401, 429, 429]
--- wait: 0.2



=== TEST 4: cost per endpoint: one budget per key; an export weighs 50, a batch its X-Items; X-Items: 0 is charged the most, a missing key is limited by address
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    map $http_x_items $batch_cost {
        ""                 1;
        "~^[1-9][0-9]?$"   $http_x_items;
        default            100;
    }
    map $http_x_api_key $budget_client {
        ""       "addr:$binary_remote_addr";
        default  $http_x_api_key;
    }
    redis_ratelimit_zone $budget_client zone=budget:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070d:;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { return 200 "backend\n"; }
    }
--- config
    location /reports/        { redis_ratelimit budget 100r/m;                  proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1; }
    location /reports/export  { redis_ratelimit budget 100r/m cost=50;          proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1; }
    location /reports/batch   { redis_ratelimit budget 100r/m cost=$batch_cost; proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1; }
--- more_headers eval
["X-API-Key: t1", "X-API-Key: t1\nX-Items: 30", "X-API-Key: t1", "X-API-Key: t1\nX-Items: 19", "X-API-Key: t1", "X-API-Key: t1",
 "X-API-Key: t2\nX-Items: 0", "X-API-Key: t2",
 "X-Items: 1", "X-Items: 1", "X-Items: 1"]
--- request eval
# t1: 50 + 30 = 80; another export (50) does not fit; 19 items: 99; one more: 100; then nothing.
# t2: X-Items: 0 weighs 100, the whole budget. No key: the address's budget (export, export, then full)
["GET /reports/export", "GET /reports/batch", "GET /reports/export", "GET /reports/batch", "GET /reports/x", "GET /reports/x",
 "GET /reports/batch", "GET /reports/x",
 "GET /reports/export", "GET /reports/export", "GET /reports/export"]
--- error_code eval
[200, 200, 429, 200, 200, 429, 200, 429, 200, 200, 429]
--- wait: 0.2



=== TEST 5: two levels: a global count for everyone (a constant key) and one per consumer; both must pass
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    map $http_x_api_key $search_client {
        ""       "addr:$binary_remote_addr";
        default  $http_x_api_key;
    }
    redis_ratelimit_zone "search" zone=search_total:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070e:;
    redis_ratelimit_zone $search_client zone=search_each:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070e:;
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
[("X-API-Key: a") x 4, ("X-API-Key: b") x 3, "X-API-Key: c", "X-Other: 1"]
--- request eval
[("GET /search") x 9]
--- error_code eval
# a: 3 (its own limit), b: 2 more (the total's 5), c and a request without a key: none left
[200, 200, 200, 429, 200, 200, 429, 429, 429]
--- wait: 0.2



=== TEST 6: limit_req's line for the fleet: a burst at once, then the rate; past delay= a client's requests spaced out
--- http_config
    redis_ratelimit_zone $binary_remote_addr zone=paced:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070f:;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { return 200 "backend\n"; }
    }
--- config
    location /find/ {
        redis_ratelimit paced 1r/m burst=2 nodelay;
        add_header X-RL "[$redis_ratelimit_status]" always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
    location /put/ {
        redis_ratelimit paced 20r/s burst=2 delay=1;
        add_header X-RL "[$redis_ratelimit_status]" always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- request eval
[("GET /find/a") x 4, ("GET /put/a") x 4]
--- error_code eval
# put: the third and the fourth wait 50 ms each (20r/s): one client's
# requests one after the other are spaced out, never refused
[200, 200, 200, 429, 200, 200, 200, 200]
--- response_headers eval
["X-RL: [PASSED]", "X-RL: [PASSED]", "X-RL: [PASSED]", "X-RL: [REJECTED]",
 "X-RL: [PASSED]", "X-RL: [PASSED]", "X-RL: [DELAYED]", "X-RL: [DELAYED]"]



=== TEST 7: slow endpoints: a rate and a concurrency limit per tenant, for the fleet; one after the other each takes its slot and gives it back, the rate refuses the fourth
--- http_config
    map $http_x_api_key $tenant {
        ""       "addr:$binary_remote_addr";
        default  $http_x_api_key;
    }
    redis_ratelimit_zone $tenant zone=tenant:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070g:;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { return 200 "backend\n"; }
    }
--- config
    location /export {
        redis_ratelimit tenant 3r/m;
        redis_ratelimit_conn tenant 1;
        add_header X-Conn "[$redis_ratelimit_conn_status]" always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- more_headers
X-API-Key: acme
--- request eval
[("GET /export") x 4]
--- error_code eval
[200, 200, 200, 429]
--- response_headers eval
["X-Conn: [PASSED]", "X-Conn: [PASSED]", "X-Conn: [PASSED]", "X-Conn: []"]



=== TEST 8: scrapers: the request over the limit blocks the address for the block's time (Retry-After counts it, every limit of the zone rejects it); the API shows it and lifts it, and the count still holds
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- http_config
    redis_ratelimit_zone $binary_remote_addr zone=scrapers:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t070h:;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { return 200 "backend\n"; }
    }
--- config
    location /catalog/ {
        redis_ratelimit scrapers 3r/m block=10m;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
    location /catalog-wide/ {
        redis_ratelimit scrapers 100r/m;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
    location /ratelimit-admin/ {
        redis_ratelimit_api write=on;
        allow 127.0.0.1;
        allow 10.0.1.0/24;
        deny all;
    }
--- request eval
["GET /catalog/a", "GET /catalog/a", "GET /catalog/a", "GET /catalog/a", "GET /catalog-wide/a", "GET /ratelimit-admin/zones/scrapers", "DELETE /ratelimit-admin/zones/scrapers/keys/127.0.0.1/block", "GET /catalog-wide/a", "GET /catalog/a"]
--- error_code eval
[200, 200, 200, 429, 429, 200, 204, 200, 429]
--- response_headers_like eval
["", "", "", "Retry-After: [1-6]?[0-9]", "Retry-After: (599|600)", "", "", "", "Retry-After: [1-6]?[0-9]"]
--- response_body_like eval
["backend", "backend", "backend", "429", "429", '"blocked":\[\{"key":"127\.0\.0\.1","ttl_s":(599|600)', "^\$", "backend", "429"]
