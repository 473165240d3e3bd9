# Debug logging, on an nginx built --with-debug (Debian's is): one line per
# decision, zone setup, the background thread, replies applied, the breaker.
# Compiled out of a module built for an nginx without --with-debug.
# Run by `make test` against Debian's nginx and the module built through
# this repo's `config` (./configure --add-dynamic-module=...).
use Test::Nginx::Socket 'no_plan';

our $HttpConfig = qq{
    redis_ratelimit_zone \$arg_k zone=dbg:1m redis=redis://127.0.0.1:$ENV{TEST_NGINX_REDIS_PORT} prefix=dbg:;
};

no_shuffle();
run_tests();

__DATA__

=== TEST 1: error_log debug: zone setup, thread start, the decision, the reply and the breaker
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- log_level: debug
--- http_config eval: $::HttpConfig
--- config
    # a background limit (the smallest are decided in Redis) that one
    # request fills
    location = /t { redis_ratelimit dbg 30r/m cost=30; }
--- user_files
>>> t
ok
--- request
GET /t?k=debug-one
--- error_code: 200
--- wait: 0.5
--- error_log eval
[
qr/redis_ratelimit: zone "dbg" fresh: \d+ entries in \d+ bytes/,
qr/redis_ratelimit: background thread started, 1 Redis zone\(s\)/,
qr/redis_ratelimit: zone "dbg" key #[0-9a-f]{16} 30r\/m: estimate 0\.00, 30\.00 after, mode redis: pass/,
qr/redis_ratelimit: reply applied: zone 0 key #[0-9a-f]{16} window \d+: 30 sent, count 30, previous -1/,
qr/redis_ratelimit: breaker armed: zone 0 key #[0-9a-f]{16} limited for \d+ ms/,
]

=== TEST 2: error_log at info: no debug line
--- log_level: info
--- http_config eval: $::HttpConfig
--- config
    location = /t { redis_ratelimit dbg 10r/m; }
--- user_files
>>> t
ok
--- request
GET /t?k=debug-two
--- error_code: 200
--- no_error_log
redis_ratelimit: zone "dbg" key #
background thread started

=== TEST 3: a strict limit: its check before the wait, then Redis's decision, each a debug line
--- log_level: debug
--- http_config eval: $::HttpConfig
--- config
    location = /t { redis_ratelimit dbg 5r/m strict; }
--- user_files
>>> t
ok
--- request
GET /t?k=debug-strict
--- error_code: 200
--- error_log eval
[
qr/redis_ratelimit: zone "dbg" key #[0-9a-f]{16} 5r\/m: estimate 0\.00, 0\.00 after, mode redis: pass/,
qr/redis_ratelimit: reply applied: zone 0 key #[0-9a-f]{16} window \d+: 0 sent, count 1, previous 0/,
qr/redis_ratelimit: zone "dbg" key #[0-9a-f]{16} 5r\/m: estimate 1\.00, 1\.00 after, mode redis: pass/,
]
