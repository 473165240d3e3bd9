# cost= from a variable, per request: digits up to 1000000 are the weight,
# digits above it saturate at 1000000, anything else (a sign, hex, an
# exponent, a fraction, text) weighs 1; the last two are logged, at most
# once a second per zone. Fed through an upstream's header
# ($upstream_http_x_tokens), as the token-quota recipe does.
use Test::Nginx::Socket 'no_plan';

no_shuffle();
run_tests();

__DATA__

=== TEST 1: each form of X-Tokens counts as the rule says (what is left after it, read by the next request of the key)
--- http_config
    redis_ratelimit_zone $arg_k zone=tokens:1m;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { add_header X-Tokens $arg_c; return 200 "ok\n"; }
    }
--- config
    location = /llm {
        redis_ratelimit tokens 3000000r/d count_if=$status cost=$upstream_http_x_tokens;
        redis_ratelimit_headers legacy;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1/?c=$arg_c;
    }
--- request eval
["GET /llm?k=a&c=1000001", "GET /llm?k=a&c=0",
 "GET /llm?k=b&c=99999999999", "GET /llm?k=b&c=0",
 "GET /llm?k=c&c=18446744073709551617", "GET /llm?k=c&c=0",
 "GET /llm?k=d&c=1e9", "GET /llm?k=d&c=0",
 "GET /llm?k=e&c=-5", "GET /llm?k=e&c=0",
 "GET /llm?k=f&c=0x10", "GET /llm?k=f&c=0",
 "GET /llm?k=g&c=2.5", "GET /llm?k=g&c=0",
 "GET /llm?k=h&c=1000000", "GET /llm?k=h&c=0",
 "GET /llm?k=i&c=7", "GET /llm?k=i&c=0",
 "GET /llm?k=j", "GET /llm?k=j&c=0",
 "GET /llm?k=l&c=1000001", "GET /llm?k=l&c=1000001", "GET /llm?k=l&c=1000001", "GET /llm?k=l&c=0"]
--- error_code eval
[(200) x 23, 429]
--- response_headers eval
["X-RateLimit-Remaining: 3000000", "X-RateLimit-Remaining: 2000000",
 "X-RateLimit-Remaining: 3000000", "X-RateLimit-Remaining: 2000000",
 "X-RateLimit-Remaining: 3000000", "X-RateLimit-Remaining: 2000000",
 "X-RateLimit-Remaining: 3000000", "X-RateLimit-Remaining: 2999999",
 "X-RateLimit-Remaining: 3000000", "X-RateLimit-Remaining: 2999999",
 "X-RateLimit-Remaining: 3000000", "X-RateLimit-Remaining: 2999999",
 "X-RateLimit-Remaining: 3000000", "X-RateLimit-Remaining: 2999999",
 "X-RateLimit-Remaining: 3000000", "X-RateLimit-Remaining: 2000000",
 "X-RateLimit-Remaining: 3000000", "X-RateLimit-Remaining: 2999993",
 "X-RateLimit-Remaining: 3000000", "X-RateLimit-Remaining: 2999999",
 "X-RateLimit-Remaining: 3000000", "X-RateLimit-Remaining: 2000000", "X-RateLimit-Remaining: 1000000", "X-RateLimit-Remaining: 0"]



=== TEST 2: a cost above the maximum is logged, saying what it counted as
--- http_config
    redis_ratelimit_zone $arg_k zone=tokens:1m;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { add_header X-Tokens $arg_c; return 200 "ok\n"; }
    }
--- config
    location = /llm {
        redis_ratelimit tokens 3000000r/d count_if=$status cost=$upstream_http_x_tokens;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1/?c=$arg_c;
    }
--- request
GET /llm?k=a&c=99999999999
--- error_code: 200
--- error_log
redis_ratelimit: zone "tokens": cost "99999999999" is above 1000000, counted as 1000000



=== TEST 3: a malformed cost is logged, escaped, saying what it counted as
--- http_config
    redis_ratelimit_zone $arg_k zone=items:1m;
--- config
    location = /t { redis_ratelimit items 3000000r/d cost=$http_x_items; }
--- user_files
>>> t
ok
--- request
GET /t?k=a
--- more_headers
X-Items: -5"\
--- error_code: 200
--- error_log
redis_ratelimit: zone "items": cost "-5\"\\" is not valid, counted as 1



=== TEST 4: the same rule for a cost read before the request (cost=$http_x_items, no count_if)
--- http_config
    redis_ratelimit_zone $arg_k zone=items:1m;
--- config
    location = /t {
        redis_ratelimit items 3000000r/d cost=$http_x_items;
        redis_ratelimit_headers legacy;
    }
--- user_files
>>> t
ok
--- request eval
["GET /t?k=a", "GET /t?k=a", "GET /t?k=b", "GET /t?k=b", "GET /t?k=c", "GET /t?k=c"]
--- more_headers eval
["X-Items: 5000000", "X-Items: 0", "X-Items: -3", "X-Items: 0", "X-Items: 12", "X-Items: 0"]
--- response_headers eval
["X-RateLimit-Remaining: 2000000", "X-RateLimit-Remaining: 2000000",
 "X-RateLimit-Remaining: 2999999", "X-RateLimit-Remaining: 2999999",
 "X-RateLimit-Remaining: 2999988", "X-RateLimit-Remaining: 2999988"]
