# redis_ratelimit_metrics: every zone's figures, counted in shared memory
# (any worker answers the same), as Prometheus text or JSON.
use Test::Nginx::Socket 'no_plan';

master_on();
workers(2);
no_shuffle();
run_tests();

__DATA__

=== TEST 1: passed and rejected requests over two workers, keys and capacity, text and JSON
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
    redis_ratelimit_zone $arg_k zone=idle:1m;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1 reuseport;
        location = /t { redis_ratelimit z 3r/d; root html; }
        location = /dry { redis_ratelimit z 3r/d; redis_ratelimit_dry_run on; root html; }
    }
--- config
    location = /t { proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1; }
    location = /dry { proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1; }
    location = /metrics { redis_ratelimit_metrics; }
--- user_files
>>> t
ok
>>> dry
ok
--- request eval
# key a: 3 passed, 3 rejected; key b: 1 passed; a in dry run: 1 rejected_dry_run
[("GET /t?k=a") x 6, "GET /t?k=b", "GET /dry?k=a", "GET /metrics", "GET /metrics?format=json"]
--- error_code eval
[200, 200, 200, 429, 429, 429, 200, 200, 200, 200]
--- response_headers eval
[("") x 8, "Content-Type: text/plain; version=0.0.4; charset=utf-8", "Content-Type: application/json"]
--- response_body_like eval
[("^ok\n\$") x 3, (".*") x 3, "^ok\n\$", "^ok\n\$",
 qr/# TYPE nginx_redis_ratelimit_requests_total counter\n(?s:.*)nginx_redis_ratelimit_requests_total\{zone="z",outcome="passed"\} 4\nnginx_redis_ratelimit_requests_total\{zone="z",outcome="rejected"\} 3\nnginx_redis_ratelimit_requests_total\{zone="z",outcome="rejected_dry_run"\} 1\nnginx_redis_ratelimit_requests_total\{zone="idle",outcome="passed"\} 0\n(?s:.*)nginx_redis_ratelimit_keys\{zone="z"\} 2\n(?s:.*)nginx_redis_ratelimit_keys_capacity\{zone="z"\} \d{4,}\n(?s:.*)nginx_redis_ratelimit_redis_backend\{zone="z"\} 0\n/,
 qr/^\{"zones":\{"z":\{"redis":false,"requests":\{"passed":4,"rejected":3,"rejected_dry_run":1\},"keys":2,"keys_capacity":\d{4,},"evictions":0\},"idle":\{"redis":false,"requests":\{"passed":0,"rejected":0,"rejected_dry_run":0\},"keys":0,/]
--- no_error_log
[alert]
[crit]



=== TEST 2: only GET and HEAD
--- config
    location = /metrics { redis_ratelimit_metrics; }
--- request
POST /metrics
abc
--- error_code: 405



=== TEST 3: no arguments
--- config
    location = /metrics { redis_ratelimit_metrics on; }
--- must_die
--- error_log
invalid number of arguments in "redis_ratelimit_metrics" directive



=== TEST 4: only in a location
--- http_config
    redis_ratelimit_metrics;
--- config
    location = /t { return 200; }
--- must_die
--- error_log
"redis_ratelimit_metrics" directive is not allowed here
