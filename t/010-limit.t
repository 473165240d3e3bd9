# The embedded limiter (a zone without redis=): exact counts, the status,
# Retry-After, RateLimit headers, variables, dry run, log level, several
# limits, inheritance and `off`, empty, binary and long keys.
use Test::Nginx::Socket 'no_plan';

# the zone of a block without its own --- http_config
add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value("http_config", '    redis_ratelimit_zone $arg_k zone=z:1m;')
        unless defined $block->http_config;
});

no_shuffle();
run_tests();

__DATA__

=== TEST 1: 10r/m gives exactly 10 x 200, then 429 with a sane Retry-After
--- init
# stay away from a minute boundary: the previous minute's count would
# otherwise weigh in mid-test
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- config
    location = /t { redis_ratelimit z 10r/m; }
--- user_files
>>> t
ok
--- request eval
[("GET /t?k=ten") x 12]
--- error_code eval
[(200) x 10, 429, 429]
--- response_headers eval
[("!Retry-After") x 10, "", ""]
--- response_headers_like eval
[("") x 10, "Retry-After: ([1-9]|[1-5][0-9]|60)\$", "Retry-After: ([1-9]|[1-5][0-9]|60)\$"]



=== TEST 2: Retry-After only on rejections; other keys are not affected
--- config
    location = /t { redis_ratelimit z 2r/d; }
--- user_files
>>> t
ok
--- request eval
["GET /t?k=a", "GET /t?k=a", "GET /t?k=a", "GET /t?k=b", "GET /t?k=b", "GET /t?k=a"]
--- error_code eval
[200, 200, 429, 200, 200, 429]
--- response_headers eval
["!Retry-After", "!Retry-After", "", "!Retry-After", "!Retry-After", ""]



=== TEST 3: the configured status
--- config
    location = /t {
        redis_ratelimit z 1r/d;
        redis_ratelimit_status 503;
        redis_ratelimit_log_level warn;
    }
--- user_files
>>> t
ok
--- request eval
["GET /t?k=a", "GET /t?k=a"]
--- error_code eval
[200, 503]
--- no_error_log
[error]



=== TEST 4: a rejection below error_log's level is not logged
--- config
    location = /t {
        redis_ratelimit z 1r/d;
        redis_ratelimit_log_level info;
    }
--- log_level: notice
--- user_files
>>> t
ok
--- request eval
["GET /t?k=a", "GET /t?k=a"]
--- error_code eval
[200, 429]
--- no_error_log
limiting requests



=== TEST 5: dry run passes everything and sets the variable
--- config
    location = /t {
        redis_ratelimit z 2r/d;
        redis_ratelimit_dry_run on;
        add_header X-Status $redis_ratelimit_status;
        add_header X-Remaining $redis_ratelimit_remaining;
    }
--- user_files
>>> t
ok
--- request eval
[("GET /t?k=a") x 4]
--- error_code eval
[200, 200, 200, 200]
--- response_headers eval
["X-Status: PASSED\nX-Remaining: 1\n!Retry-After", "X-Status: PASSED\nX-Remaining: 0", "X-Status: REJECTED_DRY_RUN\nX-Remaining: 0\n!Retry-After", "X-Status: REJECTED_DRY_RUN"]



=== TEST 6: variables on passed and rejected requests
--- config
    location = /t {
        redis_ratelimit z 3r/d;
        add_header X-Status $redis_ratelimit_status always;
        add_header X-Remaining $redis_ratelimit_remaining always;
    }
    location = /free {
        add_header X-Status "[$redis_ratelimit_status]" always;
    }
--- user_files
>>> t
ok
>>> free
ok
--- request eval
["GET /t?k=a", "GET /t?k=a", "GET /t?k=a", "GET /t?k=a", "GET /free"]
--- error_code eval
[200, 200, 200, 429, 200]
--- response_headers eval
["X-Status: PASSED\nX-Remaining: 2", "X-Status: PASSED\nX-Remaining: 1", "X-Status: PASSED\nX-Remaining: 0", "X-Status: REJECTED\nX-Remaining: 0", "X-Status: []"]



=== TEST 7: RateLimit-Policy and RateLimit headers
--- http_config
    redis_ratelimit_zone $arg_k zone=login:1m;
--- config
    location = /t {
        redis_ratelimit login 3r/h;
        redis_ratelimit_headers on;
    }
    location = /quiet {
        redis_ratelimit login 3r/h;
    }
--- user_files
>>> t
ok
>>> quiet
ok
--- init
my $s = time % 3600; sleep(3601 - $s) if $s > 3590;
--- request eval
["GET /t?k=a", "GET /t?k=a", "GET /t?k=a", "GET /t?k=a", "GET /quiet?k=b"]
--- error_code eval
[200, 200, 200, 429, 200]
--- response_headers eval
["RateLimit-Policy: \"login\";q=3;w=3600", "", "", "RateLimit-Policy: \"login\";q=3;w=3600", "!RateLimit-Policy\n!RateLimit"]
--- response_headers_like eval
["RateLimit: \"login\";r=2;t=\\d+", "RateLimit: \"login\";r=1;t=\\d+", "RateLimit: \"login\";r=0;t=\\d+", "RateLimit: \"login\";r=0;t=\\d+", ""]



=== TEST 8: several limits: all must pass, and a rejected request consumes nothing
--- http_config
    redis_ratelimit_zone $arg_k zone=a:1m;
    redis_ratelimit_zone $arg_j zone=b:1m;
--- config
    location = /both {
        redis_ratelimit a 5r/d;
        redis_ratelimit b 2r/d;
    }
    location = /a {
        redis_ratelimit a 5r/d;
    }
--- user_files
>>> both
ok
>>> a
ok
--- request eval
# b allows 2; the 3rd and 4th /both are rejected by b and must not use up a,
# so /a still gets 5 - 2 = 3 more
["GET /both?k=x&j=y", "GET /both?k=x&j=y", "GET /both?k=x&j=y", "GET /both?k=x&j=y", "GET /a?k=x", "GET /a?k=x", "GET /a?k=x", "GET /a?k=x"]
--- error_code eval
[200, 200, 429, 429, 200, 200, 200, 429]



=== TEST 9: two periods of one zone; the tighter answers
--- config
    location = /t {
        redis_ratelimit z 100r/s;
        redis_ratelimit z 3r/d;
        add_header X-Remaining $redis_ratelimit_remaining always;
    }
--- user_files
>>> t
ok
--- request eval
[("GET /t?k=a") x 4]
--- error_code eval
[200, 200, 200, 429]
--- response_headers eval
["X-Remaining: 2", "X-Remaining: 1", "X-Remaining: 0", "X-Remaining: 0"]



=== TEST 10: inheritance from http and server, and off
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
    redis_ratelimit z 1r/d;
    redis_ratelimit_status 418;
--- config
    location = /inherit { }
    location = /own { redis_ratelimit z 2r/d; }
    location = /off { redis_ratelimit off; }
    location /nested {
        redis_ratelimit z 3r/d;
        location = /nested/inner { }
    }
--- user_files
>>> inherit
ok
>>> own
ok
>>> off
ok
>>> nested/inner
ok
--- request eval
["GET /inherit?k=i", "GET /inherit?k=i", "GET /own?k=o", "GET /own?k=o", "GET /own?k=o", "GET /off?k=f", "GET /off?k=f", "GET /off?k=f", "GET /nested/inner?k=n", "GET /nested/inner?k=n", "GET /nested/inner?k=n", "GET /nested/inner?k=n"]
--- error_code eval
[200, 418, 200, 200, 418, 200, 200, 200, 200, 200, 200, 418]



=== TEST 11: an empty key is not limited and sets no status
--- config
    location = /t {
        redis_ratelimit z 1r/d;
        add_header X-Status "[$redis_ratelimit_status]" always;
    }
--- user_files
>>> t
ok
--- request eval
["GET /t", "GET /t", "GET /t?k=", "GET /t?k=x", "GET /t?k=x"]
--- error_code eval
[200, 200, 200, 200, 429]
--- response_headers eval
["X-Status: []", "X-Status: []", "X-Status: []", "X-Status: [PASSED]", "X-Status: [REJECTED]"]



=== TEST 12: binary keys (the client address in binary form, a header of raw bytes)
--- http_config
    redis_ratelimit_zone $binary_remote_addr zone=ip:1m;
    redis_ratelimit_zone $http_x_key zone=raw:1m;
--- config
    location = /ip { redis_ratelimit ip 2r/d; }
    location = /raw { redis_ratelimit raw 1r/d; }
--- user_files
>>> ip
ok
>>> raw
ok
--- request eval
["GET /ip", "GET /ip", "GET /ip", "GET /raw", "GET /raw", "GET /raw", "GET /raw"]
--- more_headers eval
["", "", "", "X-Key: \x01\x7f\xff\xfe{}:", "X-Key: \x01\x7f\xff\xfe{}:", "X-Key: \x01\x7f\xff\xfe{};", "X-Key: \x01\x7f\xff\xfe{};"]
--- error_code eval
[200, 200, 429, 200, 429, 200, 429]



=== TEST 13: very long keys are counted apart by their whole bytes
--- config
    location = /t { redis_ratelimit z 1r/d; }
--- user_files
>>> t
ok
--- request eval
my $a = "a" x 6000;
["GET /t?k=${a}1", "GET /t?k=${a}1", "GET /t?k=${a}2", "GET /t?k=${a}2"]
--- error_code eval
[200, 429, 200, 429]
--- no_error_log
[alert]
[crit]



=== TEST 14: the limiter runs once per request, not again after an internal redirect
--- config
    location = /t {
        redis_ratelimit z 2r/d;
        error_page 404 = /fallback;
    }
    location = /fallback {
        redis_ratelimit z 2r/d;
        add_header X-Status $redis_ratelimit_status always;
    }
--- user_files
>>> fallback
ok
--- request eval
["GET /t?k=a", "GET /t?k=a", "GET /t?k=a"]
--- error_code eval
[200, 200, 429]
--- response_headers eval
["X-Status: PASSED", "X-Status: PASSED", ""]



=== TEST 15: cost=3 consumes 3; a request that does not fit is refused and not counted; cost=0 only checks
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- config
    location = /c3 { redis_ratelimit z 10r/m cost=3; }
    location = /c1 { redis_ratelimit z 10r/m; }
    location = /c0 { redis_ratelimit z 10r/m cost=0; }
--- user_files
>>> c3
ok
>>> c1
ok
>>> c0
ok
--- request eval
# 3 + 3 + 3 = 9; a fourth 3 does not fit (9 + 3 - 1 >= 10); cost 0 passes
# without counting; cost 1 fits (10); then nothing does
["GET /c3?k=w", "GET /c3?k=w", "GET /c3?k=w", "GET /c3?k=w", "GET /c0?k=w", "GET /c1?k=w", "GET /c0?k=w", "GET /c1?k=w"]
--- error_code eval
[200, 200, 200, 429, 200, 200, 429, 429]



=== TEST 16: cost from a variable, per request
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- config
    location = /cv { redis_ratelimit z 10r/m cost=$arg_c; }
--- user_files
>>> cv
ok
--- request eval
# 5 + 4 = 9; no value counts 1 (10); then even a check (0) is refused
["GET /cv?k=v&c=5", "GET /cv?k=v&c=4", "GET /cv?k=v", "GET /cv?k=v&c=0"]
--- error_code eval
[200, 200, 200, 429]



=== TEST 17: a cost variable whose value is not a cost counts as 1 and is logged
--- config
    location = /cv { redis_ratelimit z 10r/m cost=$arg_c; }
--- user_files
>>> cv
ok
--- request
GET /cv?k=bad&c=abc
--- error_code: 200
--- error_log
redis_ratelimit: zone "z": cost "abc" is not valid, counted as 1



=== TEST 18: redis_ratelimit_headers legacy: X-RateLimit-Limit, -Remaining and -Reset (Unix time) of the tightest limit, not the draft's headers
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- config
    location = /t {
        redis_ratelimit z 3r/m;
        redis_ratelimit z 100r/h;
        redis_ratelimit_headers legacy;
    }
--- user_files
>>> t
ok
--- request eval
[("GET /t?k=legacy") x 4]
--- error_code eval
[200, 200, 200, 429]
--- response_headers eval
[("X-RateLimit-Limit: 3\n!RateLimit\n!RateLimit-Policy") x 4]
--- response_headers_like eval
["X-RateLimit-Remaining: 2\nX-RateLimit-Reset: [0-9]{10}\$", "X-RateLimit-Remaining: 1\nX-RateLimit-Reset: [0-9]{10}\$", "X-RateLimit-Remaining: 0\nX-RateLimit-Reset: [0-9]{10}\$", "X-RateLimit-Remaining: 0\nX-RateLimit-Reset: [0-9]{10}\$"]



=== TEST 19: tiers: the rate from a map, per request; an empty rate does not apply; tiers of one period share the key's count
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
    map $arg_plan $plan_rate {
        gold      4r/m;
        free      2r/m;
        internal  "";
        default   1r/m;
    }
--- config
    location = /t { redis_ratelimit z $plan_rate; }
--- user_files
>>> t
ok
--- request eval
[("GET /t?k=g&plan=gold") x 5,
 ("GET /t?k=f&plan=free") x 3,
 ("GET /t?k=i&plan=internal") x 5,
 # one key, first free (2 of 2), then gold: the same count, 2 more of 4
 ("GET /t?k=s&plan=free") x 3, ("GET /t?k=s&plan=gold") x 3]
--- error_code eval
[200, 200, 200, 200, 429,
 200, 200, 429,
 200, 200, 200, 200, 200,
 200, 200, 429, 200, 200, 429]



=== TEST 20: a rate variable whose value is not a rate: the line does not apply, and it is logged
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
    map $arg_plan $plan_rate { default ten; }
--- config
    location = /t { redis_ratelimit z $plan_rate; redis_ratelimit z 1r/m; }
--- user_files
>>> t
ok
--- request
GET /t?k=badrate
--- error_code: 200
--- error_log
redis_ratelimit: zone "z": rate "ten" is not valid, does not apply



=== TEST 21: a rate written around a variable (${arg_n}r/m), evaluated per request
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- config
    location = /t { redis_ratelimit z ${arg_n}r/m; }
--- user_files
>>> t
ok
--- request eval
[("GET /t?k=text&n=2") x 3, "GET /t?k=other&n=3", "GET /t?k=other&n=3", "GET /t?k=other&n=3", "GET /t?k=other&n=3"]
--- error_code eval
[200, 200, 429, 200, 200, 200, 429]



=== TEST 22: count_if=$failed: every request is checked, only 401s are counted; 200s pass until the 401s reach the limit
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
    map $status $failed { 401 1; default ""; }
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location = /ok { return 200 "welcome\n"; }
        location = /bad { return 401 "no\n"; }
    }
--- config
    location = /login {
        redis_ratelimit z 3r/m count_if=$failed;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1/$arg_r;
    }
--- request eval
["GET /login?k=u&r=bad", "GET /login?k=u&r=ok", "GET /login?k=u&r=ok", "GET /login?k=u&r=bad",
 "GET /login?k=u&r=ok", "GET /login?k=u&r=bad", "GET /login?k=u&r=ok", "GET /login?k=u&r=bad",
 "GET /login?k=other&r=ok"]
--- error_code eval
[401, 200, 200, 401, 200, 401, 429, 429, 200]



=== TEST 23: count_if with the cost from a response header (cost=$upstream_http_x_cost, evaluated after the response)
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location = /llm { add_header X-Cost $arg_c; return 200 "tokens\n"; }
    }
--- config
    location = /llm {
        redis_ratelimit z 10r/m count_if=$status cost=$upstream_http_x_cost;
        redis_ratelimit_headers legacy;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- request eval
# checked before the response (is the key below 10?), weighed after it:
# 4, 8 (passes: 4 < 10), 9 (passes: 8 < 10), 10 (9 < 10); then none
["GET /llm?k=t&c=4", "GET /llm?k=t&c=4", "GET /llm?k=t&c=1", "GET /llm?k=t&c=1", "GET /llm?k=t&c=1"]
--- error_code eval
[200, 200, 200, 200, 429]
--- response_headers eval
# the headers speak of the check, made before the request's own weight is known
["X-RateLimit-Remaining: 10", "X-RateLimit-Remaining: 6", "X-RateLimit-Remaining: 2", "X-RateLimit-Remaining: 1", "X-RateLimit-Remaining: 0"]



=== TEST 24: count_if beside a counted limit on the same key: the other limit still counts every request; a rejected request is never counted later
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
    map $status $failed { 401 1; default ""; }
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location = /bad { return 401 "no\n"; }
    }
--- config
    location = /login {
        redis_ratelimit z 2r/m count_if=$failed;
        redis_ratelimit z 3r/h;
        add_header X-Left $redis_ratelimit_remaining always;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1/bad;
    }
    location = /hour {
        redis_ratelimit z 3r/h;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1/bad;
    }
--- request eval
# 401 twice (the minute's count 2, the hour's 2); then the minute limit
# refuses, and the refused requests are counted nowhere: the hour has one
# request left
["GET /login?k=v", "GET /login?k=v", "GET /login?k=v", "GET /login?k=v", "GET /hour?k=v", "GET /hour?k=v"]
--- error_code eval
[401, 401, 429, 429, 401, 429]
--- response_headers eval
["X-Left: 2", "X-Left: 1", "X-Left: 0", "X-Left: 0", "", ""]



=== TEST 25: a key of one variable is read by its index, a key of text and variables as a complex value (the text is part of the key: "1:2:" is one key however a and b split it); an empty one-variable key is not limited
--- http_config
    redis_ratelimit_zone $arg_k zone=one:1m;
    redis_ratelimit_zone $arg_a:$arg_b zone=two:1m;
    redis_ratelimit_zone ${arg_c} zone=braced:1m;
--- config
    location = /one { redis_ratelimit one 1r/d; }
    location = /two { redis_ratelimit two 1r/d; }
    location = /braced { redis_ratelimit braced 1r/d; }
--- user_files
>>> one
ok
>>> two
ok
>>> braced
ok
--- request eval
["GET /one?k=x", "GET /one?k=x", "GET /one?k=y", "GET /one",
 "GET /two?a=1&b=2", "GET /two?a=1&b=2", "GET /two?a=1&b=3", "GET /two?a=1:2", "GET /two?a=1&b=2:", "GET /two", "GET /two",
 "GET /braced?c=x", "GET /braced?c=x", "GET /braced", "GET /braced"]
--- error_code eval
[200, 429, 200, 200,
 200, 429, 200, 200, 429, 200, 429,
 200, 429, 200, 200]
