# Two worker processes share one count: the zone lives in shared memory.
use Test::Nginx::Socket 'no_plan';

master_on();
workers(2);
no_shuffle();
run_tests();

__DATA__

=== TEST 1: requests spread over two workers get exactly the limit in total
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
    # reuseport gives each worker its own listening socket, so the kernel
    # spreads the proxied connections (a new one per request) over both
    # workers
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1 reuseport;
        location = /t {
            redis_ratelimit z 10r/d;
            root html;
        }
    }
--- config
    location = /t {
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- user_files
>>> t
ok
--- request eval
[("GET /t?k=shared") x 40]
--- error_code eval
[(200) x 10, (429) x 30]
--- no_error_log
[alert]
[crit]
