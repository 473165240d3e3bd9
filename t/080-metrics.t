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
# key a: 3 passed, 3 rejected; key b: 1 passed; a in dry run: 1
# rejected_dry_run; no key: not limited
[("GET /t?k=a") x 6, "GET /t?k=b", "GET /dry?k=a", "GET /t", "GET /metrics", "GET /metrics?format=json"]
--- error_code eval
[200, 200, 200, 429, 429, 429, 200, 200, 200, 200, 200]
--- response_headers eval
[("") x 9, "Content-Type: text/plain; version=0.0.4; charset=utf-8", "Content-Type: application/json"]
--- response_body_like eval
[("^ok\n\$") x 3, (".*") x 3, "^ok\n\$", "^ok\n\$", "^ok\n\$",
 qr/# TYPE nginx_redis_ratelimit_requests_total counter\n(?s:.*)nginx_redis_ratelimit_requests_total\{zone="z",outcome="passed"\} 4\nnginx_redis_ratelimit_requests_total\{zone="z",outcome="rejected"\} 3\nnginx_redis_ratelimit_requests_total\{zone="z",outcome="rejected_dry_run"\} 1\nnginx_redis_ratelimit_requests_total\{zone="z",outcome="not_limited"\} 1\nnginx_redis_ratelimit_requests_total\{zone="idle",outcome="passed"\} 0\n(?s:.*)nginx_redis_ratelimit_keys\{zone="z"\} 2\n(?s:.*)nginx_redis_ratelimit_keys_capacity\{zone="z"\} \d{4,}\n(?s:.*)# TYPE nginx_redis_ratelimit_backend_up gauge\n# HELP/,
 qr/^\{"zones":\{"z":\{"requests":\{"passed":4,"rejected":3,"rejected_dry_run":1,"not_limited":1\},"delayed":0,"conn":\{"in_flight":0,"rejected":0,"rejected_dry_run":0,"leased":0,"leases_expired":0\},"blocks":0,"blocked_keys":0,"overridden_keys":0,"keys":2,"keys_capacity":\d{4,},"evictions":0,"breaker_trips":0,"dropped_increments":0,"redis":null\},"idle":\{"requests":\{"passed":0,"rejected":0,"rejected_dry_run":0,"not_limited":0\},"delayed":0,"conn":\{"in_flight":0,"rejected":0,"rejected_dry_run":0,"leased":0,"leases_expired":0\},"blocks":0,"blocked_keys":0,"overridden_keys":0,"keys":0,/]
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



=== TEST 5: a Redis zone: commands, pipelines, round trips, last sync, the backend up, its policy, breaker trips
--- http_config
    redis_ratelimit_zone $arg_k zone=r:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t080: hold=0 on_error=deny;
--- config
    location = /t { redis_ratelimit r 2r/d; }
    location = /metrics { redis_ratelimit_metrics; }
--- user_files
>>> t
ok
--- request eval
["GET /t?k=trip", "GET /t?k=trip", "GET /metrics", "GET /t?k=trip", "GET /metrics"]
--- error_code eval
[200, 200, 200, 429, 200]
--- wait: 0.1
--- response_body_like eval
["ok", "ok", ".*", ".*",
 qr/nginx_redis_ratelimit_breaker_trips_total\{zone="r"\} 1\n(?s:.*)nginx_redis_ratelimit_backend_up\{zone="r"\} 1\n(?s:.*)nginx_redis_ratelimit_on_error\{zone="r",policy="deny"\} 1\n(?s:.*)nginx_redis_ratelimit_redis_commands_total\{zone="r"\} [1-9]\d*\n(?s:.*)nginx_redis_ratelimit_redis_errors_total\{zone="r",kind="transport"\} 0\n(?s:.*)nginx_redis_ratelimit_redis_connects_total\{zone="r"\} [1-4]\n(?s:.*)nginx_redis_ratelimit_last_sync_age_seconds\{zone="r"\} \d(?s:.*)nginx_redis_ratelimit_redis_roundtrip_seconds_count\{zone="r"\} [1-9]/]



=== TEST 6: Redis unreachable: the backend down, transport errors counted; the request's count waits, and the age says how long it has waited
--- http_config
    redis_ratelimit_zone $arg_k zone=down:1m redis=redis://127.0.0.1:1 timeout=100ms;
--- config
    location = /t { redis_ratelimit down 100r/d; }
    location = /metrics { redis_ratelimit_metrics; }
--- user_files
>>> t
ok
--- init
# the thread checks its backend at once; give it a moment
select(undef, undef, undef, 0.5);
--- request eval
["GET /t?k=a", "GET /metrics"]
--- wait: 0.3
--- error_code eval
[200, 200]
--- response_body_like eval
["ok", qr/nginx_redis_ratelimit_backend_up\{zone="down"\} 0\n(?s:.*)nginx_redis_ratelimit_redis_errors_total\{zone="down",kind="transport"\} [1-9]\n(?s:.*)nginx_redis_ratelimit_increments_waiting\{zone="down"\} 1\n(?s:.*)nginx_redis_ratelimit_last_sync_age_seconds\{zone="down"\} 0\.[0-9]+\n/]



=== TEST 7: an idle Redis zone is in sync: nothing waits, the age is 0 (no staleness alert on a quiet zone)
--- http_config
    redis_ratelimit_zone $arg_k zone=quiet:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t080q: hold=0;
--- config
    location = /t { redis_ratelimit quiet 100r/d; }
    location = /metrics { redis_ratelimit_metrics; }
--- user_files
>>> t
ok
--- request eval
["GET /t?k=once", "GET /metrics"]
--- wait: 1.2
--- error_code eval
[200, 200]
--- response_body_like eval
["ok", qr/nginx_redis_ratelimit_increments_waiting\{zone="quiet"\} 0\n(?s:.*)nginx_redis_ratelimit_last_sync_age_seconds\{zone="quiet"\} 0\n/]

