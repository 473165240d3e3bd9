# A strict limit inside auth_request's subrequest (Debian's nginx has the
# module): decided by Redis like a main request. auth_request passes a
# subrequest's 401 and 403 on and turns any other status into 500, so a
# limit used there answers 403 (redis_ratelimit_status), as the docs say.
# The subrequest has its own URI and arguments (none here): its key comes
# from what it shares with the main request (the address, headers).
use Test::Nginx::Socket 'no_plan';

no_shuffle();
run_tests();

__DATA__

=== TEST 1: strict in the auth subrequest with redis_ratelimit_status 403: 3 pass, then 403 (Redis decides; on_error=deny would refuse all)
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $remote_addr zone=auth:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t020a: on_error=deny timeout=1s;
--- config
    location = /app {
        auth_request /check;
        try_files /app.txt =404;
    }
    location = /check {
        internal;
        redis_ratelimit auth 3r/m strict;
        redis_ratelimit_status 403;
        try_files /ok.txt =404;
    }
--- user_files
>>> app.txt
app
>>> ok.txt
ok
--- request eval
[("GET /app?k=u1") x 5]
--- error_code eval
[200, 200, 200, 403, 403]
--- no_error_log
[alert]
[crit]



=== TEST 2: the default 429 in the auth subrequest becomes auth_request's 500 (why the docs say 403)
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $remote_addr zone=auth:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t020b: timeout=1s;
--- config
    location = /app {
        auth_request /check;
        try_files /app.txt =404;
    }
    location = /check {
        internal;
        # a request that weighs more than the limit is never allowed
        redis_ratelimit auth 1r/m strict cost=2;
        try_files /ok.txt =404;
    }
--- user_files
>>> app.txt
app
>>> ok.txt
ok
--- request
GET /app
--- error_code: 500
--- error_log
auth request unexpected status: 429
