# count_if= behind error_page, named locations and internal redirects: the
# log phase counts the key and rate the preaccess phase checked, whatever
# the redirect did to the URI, the arguments or the variables built from
# them. Six failed logins of one client: 401 401 401, then 429.
use Test::Nginx::Socket 'no_plan';

# after each block's zone: $failed for count_if=, and the upstream the
# logins go to, which refuses them all (401)
add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value("http_config", $block->http_config . <<'_EOC_');
    map $status $failed { 401 1; default ""; }
    server {
        listen 127.0.0.1:$TEST_NGINX_RAND_PORT_1;
        location / { return 401 "no\n"; }
    }
_EOC_
});

no_shuffle();
run_tests();

__DATA__

=== TEST 1: key $arg_k behind error_page (the redirect drops the arguments)
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $arg_k zone=login:1m;
--- config
    location = /login {
        redis_ratelimit login 3r/m count_if=$failed;
        proxy_intercept_errors on;
        error_page 401 /denied.html;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- user_files
>>> denied.html
denied
--- request eval
[("GET /login?k=alice") x 6, "GET /login?k=bob"]
--- error_code eval
[401, 401, 401, 429, 429, 429, 401]



=== TEST 2: key "$remote_addr$uri" behind error_page (the redirect changes $uri)
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone "$remote_addr$uri" zone=login:1m;
--- config
    location = /login {
        redis_ratelimit login 3r/m count_if=$failed;
        proxy_intercept_errors on;
        error_page 401 /denied.html;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
    location = /denied.html {
        # a limit here too: the redirect must not count the denied page's
        # key in place of the login's
        redis_ratelimit login 100r/m;
    }
--- user_files
>>> denied.html
denied
--- request eval
[("GET /login") x 6]
--- error_code eval
[401, 401, 401, 429, 429, 429]



=== TEST 3: key $binary_remote_addr behind error_page
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $binary_remote_addr zone=login:1m;
--- config
    location = /login {
        redis_ratelimit login 3r/m count_if=$failed;
        proxy_intercept_errors on;
        error_page 401 /denied.html;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- user_files
>>> denied.html
denied
--- request eval
[("GET /login") x 6]
--- error_code eval
[401, 401, 401, 429, 429, 429]



=== TEST 4: key $arg_k behind error_page to a named location
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $arg_k zone=login:1m;
--- config
    location = /login {
        redis_ratelimit login 3r/m count_if=$failed;
        proxy_intercept_errors on;
        error_page 401 = @denied;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
    location @denied {
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- request eval
[("GET /login?k=alice") x 6]
--- error_code eval
[401, 401, 401, 429, 429, 429]



=== TEST 5: a rate from the arguments ($arg_r) behind error_page: counted under the rate checked, though the redirect leaves no rate
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $arg_k zone=login:1m;
--- config
    location = /login {
        redis_ratelimit login $arg_r count_if=$failed;
        proxy_intercept_errors on;
        error_page 401 /denied.html;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- user_files
>>> denied.html
denied
--- request eval
[("GET /login?k=alice&r=3r/m") x 6]
--- error_code eval
[401, 401, 401, 429, 429, 429]



=== TEST 6: through Redis (a background zone), key $arg_k behind error_page
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $arg_k zone=login:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=countif6:;
--- config
    location = /login {
        redis_ratelimit login 3r/m count_if=$failed;
        proxy_intercept_errors on;
        error_page 401 /denied.html;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- user_files
>>> denied.html
denied
--- request eval
[("GET /login?k=alice$ENV{TEST_NGINX_REDIS_PORT}") x 6]
--- error_code eval
[401, 401, 401, 429, 429, 429]



=== TEST 7: strict, key $arg_k behind error_page
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config
    redis_ratelimit_zone $arg_k zone=login:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=countif7:;
--- config
    location = /login {
        redis_ratelimit login 3r/m count_if=$failed strict;
        proxy_intercept_errors on;
        error_page 401 /denied.html;
        proxy_pass http://127.0.0.1:$TEST_NGINX_RAND_PORT_1;
    }
--- user_files
>>> denied.html
denied
--- request eval
[("GET /login?k=alice$ENV{TEST_NGINX_REDIS_PORT}") x 6]
--- error_code eval
[401, 401, 401, 429, 429, 429]
