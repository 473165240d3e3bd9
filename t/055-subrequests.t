# Strict limits in subrequests (SSI includes): the subrequest waits for
# Redis's decision as a main request does (woken as nginx wakes
# subrequests, a posted request), so Redis decides, not on_error.
use Test::Nginx::Socket 'no_plan';

no_shuffle();
run_tests();

__DATA__

=== TEST 1: an SSI include of a strict location: Redis decides (on_error=deny would refuse every one)
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $arg_k zone=s:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t055a: on_error=deny timeout=1s;
--- config
    location = /page.html { ssi on; }
    location = /s { redis_ratelimit s 3r/m strict; }
--- user_files
>>> page.html
[<!--# include virtual="/s?k=inc" -->]
>>> s
ok
--- request eval
[("GET /page.html") x 5]
--- error_code eval
[(200) x 5]
--- response_body_like eval
[("^\\[ok\\n\\]\\n\$") x 3, ("429 Too Many Requests") x 2]
--- no_error_log
[alert]
[crit]



=== TEST 2: the page around a waiting include keeps its order (the include waits for Redis, the text after it waits for the include)
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $arg_k zone=s:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t055b: on_error=deny timeout=1s;
--- config
    location = /page.html { ssi on; }
    location = /s { redis_ratelimit s 1r/m strict; }
--- user_files
>>> page.html
before <!--# include virtual="/s?k=a" --> after
>>> s
ok
--- request eval
["GET /page.html", "GET /page.html"]
--- error_code eval
[200, 200]
--- response_body_like eval
["^before ok\n after\n\$", "^before <html>(?s:.*)429 Too Many Requests(?s:.*) after\n\$"]
--- no_error_log
[alert]
[crit]
