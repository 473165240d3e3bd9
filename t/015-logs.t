# The rejection log line, its level and dry-run form. Test::Nginx checks
# error_log after every request of a block, so each pair of blocks first
# uses up a limit, then (after a reload that keeps the zone) checks the line
# the next request writes.
use Test::Nginx::Socket 'no_plan';

# every block's zone
add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value("http_config", '    redis_ratelimit_zone $arg_k zone=z:1m;')
        unless defined $block->http_config;
});

master_on();
workers(1);
use_hup();
no_shuffle();
run_tests();

__DATA__

=== TEST 1: use up 10r/m
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- config
    location = /t { redis_ratelimit z 10r/m; }
    location = /warn { redis_ratelimit z 1r/d; redis_ratelimit_status 503; redis_ratelimit_log_level warn; }
    location = /dry { redis_ratelimit z 2r/d; redis_ratelimit_dry_run on; redis_ratelimit_log_level notice; }
--- user_files
>>> t
ok
>>> warn
ok
>>> dry
ok
--- request eval
[("GET /t?k=ten") x 10, "GET /warn?k=w", "GET /dry?k=d", "GET /dry?k=d"]
--- error_code eval
[(200) x 13]
--- no_error_log
limiting requests



=== TEST 2: the 11th request is rejected and logged at error level
--- config
    location = /t { redis_ratelimit z 10r/m; }
    location = /warn { redis_ratelimit z 1r/d; redis_ratelimit_status 503; redis_ratelimit_log_level warn; }
    location = /dry { redis_ratelimit z 2r/d; redis_ratelimit_dry_run on; redis_ratelimit_log_level notice; }
--- user_files
>>> t
ok
--- request
GET /t?k=ten
--- error_code: 429
--- error_log eval
qr/\[error\] .*limiting requests, estimate: 10\.000 of 10r\/m by zone "z", client: 127\.0\.0\.1/



=== TEST 3: the configured status and log level
--- config
    location = /t { redis_ratelimit z 10r/m; }
    location = /warn { redis_ratelimit z 1r/d; redis_ratelimit_status 503; redis_ratelimit_log_level warn; }
    location = /dry { redis_ratelimit z 2r/d; redis_ratelimit_dry_run on; redis_ratelimit_log_level notice; }
--- user_files
>>> warn
ok
--- request
GET /warn?k=w
--- error_code: 503
--- error_log eval
qr/\[warn\] .*limiting requests, estimate: 1\.000 of 1r\/d by zone "z"/
--- no_error_log
[error]



=== TEST 4: dry run passes and logs its own line
--- config
    location = /t { redis_ratelimit z 10r/m; }
    location = /warn { redis_ratelimit z 1r/d; redis_ratelimit_status 503; redis_ratelimit_log_level warn; }
    location = /dry { redis_ratelimit z 2r/d; redis_ratelimit_dry_run on; redis_ratelimit_log_level notice; }
--- user_files
>>> dry
ok
--- request
GET /dry?k=d
--- error_code: 200
--- error_log eval
qr/\[notice\] .*limiting requests, dry run, estimate: 2\.000 of 2r\/d by zone "z"/
--- no_error_log
[error]



=== TEST 5: debug lines are compiled out of a module for nginx without --with-debug (this nginx; t/debian has the debug build)
--- log_level: debug
--- config
    location = /t { redis_ratelimit z 10r/m; }
--- user_files
>>> t
ok
--- request
GET /t?k=nodebug
--- error_code: 200
--- no_error_log
redis_ratelimit: zone "z" key #
redis_ratelimit: zone "z" fresh
