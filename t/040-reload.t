# Counts survive `nginx -s reload` (SIGHUP): the zone is reused, not reset.
use Test::Nginx::Socket 'no_plan';

master_on();
workers(1);
use_hup();
no_shuffle();
run_tests();

__DATA__

=== TEST 1: use up the limit
--- http_config
    redis_ratelimit_zone $arg_k zone=keep:1m;
--- config
    location = /t { redis_ratelimit keep 3r/d; }
--- user_files
>>> t
ok
--- request eval
[("GET /t?k=reload") x 3]
--- error_code eval
[200, 200, 200]



=== TEST 2: after a reload the key is still over its limit
--- http_config
    redis_ratelimit_zone $arg_k zone=keep:1m;
--- config
    location = /t { redis_ratelimit keep 3r/d; add_header X-Reloaded yes always; }
--- user_files
>>> t
ok
--- request eval
["GET /t?k=reload", "GET /t?k=other"]
--- error_code eval
[429, 200]
--- response_headers eval
["X-Reloaded: yes", "X-Reloaded: yes"]
--- no_error_log
[alert]
[crit]
counters reset
