# vim:set ft= ts=4 sw=4 et fdm=marker:
# Self-test of t/runner.py (the Test::Nginx::Socket-compatible runner).
# Uses stock nginx features only (static files, return, add_header, ssi,
# limit_req), so it does not depend on the module under development.

use Test::Nginx::Socket 'no_plan';

master_on();
workers(2);
use_hup();
no_shuffle();
no_long_string();

# configuration shared by blocks, both ways of Test::Nginx: a variable that
# an eval section reads, and a preprocessor that fills what a block lacks
our $HttpConfig = qq{
    map \$uri \$runner_global { default global; }
};

add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value("http_config", '    map $uri $runner_shared { default shared; }')
        unless defined $block->http_config;
    $block->set_value("request", "GET /shared")
        unless defined $block->request || defined $block->raw_request
            || defined $block->pipelined_requests;
});

run_tests();

__DATA__

=== TEST 1: static file from user_files, exact body, headers (present and absent)
--- config
    location = /hello {
        add_header X-Runner selftest;
        alias $TEST_NGINX_HTML_DIR/hello.txt;
    }
--- user_files
>>> hello.txt
hello world
--- request
GET /hello
--- response_headers
Content-Type: text/plain
Content-Length: 12
X-Runner: selftest
!X-Powered-By
!Transfer-Encoding
--- response_body
hello world
--- no_error_log
[error]



=== TEST 2: request arrays built by real Perl (x and map), error_code eval arrays
--- config
    location = /t {
        return 200 "k=$arg_k\n";
    }
--- request eval
[("GET /t?k=a") x 2, (map { "GET /t?k=$_" } 1..3), "GET /nope"]
--- error_code eval
[(200) x 5, 404]
--- response_body_like eval
[qr/^k=a$/, "^k=a\n\\z", map({ qr/^k=$_$/ } 1..3), qr/404 Not Found/]
--- no_error_log
[alert]



=== TEST 3: 404 with error_log (qr// and plain string from eval) and no_error_log
--- config
    location /files/ {
        alias $TEST_NGINX_HTML_DIR/;
    }
--- request
GET /files/missing.txt
--- error_code: 404
--- response_body_like: 404 Not Found
--- error_log eval
[qr/open\(\) "[^"]+missing\.txt" failed \(2: No such file or directory\)/, "No such file"]
--- no_error_log
[alert]
[crit]



=== TEST 4: more_headers, POST body with automatic Content-Length
--- config
    location = /echo {
        return 200 "foo=$http_x_foo len=$http_content_length\n";
    }
--- more_headers
X-Foo: bar baz
--- request
POST /echo
hello
--- response_body
foo=bar baz len=5



=== TEST 5: pipelined requests on one keep-alive connection
--- config
    location = /a { return 200 "A\n"; }
    location = /b { return 201 "BB\n"; }
--- pipelined_requests eval
["GET /a", "GET /b", "GET /a"]
--- error_code eval
[200, 201, 200]
--- response_body eval
["A\n", "BB\n", "A\n"]



=== TEST 6: chunked response (ssi drops Content-Length), response_headers_like
--- config
    location = /page.html {
        ssi on;
        root $TEST_NGINX_HTML_DIR;
    }
--- user_files
>>> page.html
<p>one</p>
--- request
GET /page.html
--- response_headers_like
Transfer-Encoding: chunk\w+
Content-Type: text/html
--- response_body
<p>one</p>



=== TEST 7: shared memory state is created (limit_req zone, 1 request/minute)
--- http_config
    limit_req_zone $binary_remote_addr zone=runner_selftest:1m rate=1r/m;
--- config
    location = /limited {
        limit_req zone=runner_selftest;
        alias $TEST_NGINX_HTML_DIR/passed.txt;
    }
--- user_files
>>> passed.txt
passed
--- init
# runs before the requests (Perl, with Time::HiRes sleep)
sleep 0.01;
--- request
GET /limited
--- response_body
passed
--- no_error_log
limiting requests



=== TEST 8: after a HUP reload (not a restart) the limit_req state survived
--- http_config
    limit_req_zone $binary_remote_addr zone=runner_selftest:1m rate=1r/m;
--- config
    location = /limited {
        limit_req zone=runner_selftest;
        alias $TEST_NGINX_HTML_DIR/passed.txt;
    }
--- user_files
>>> passed.txt
passed
--- request
GET /limited
--- error_code: 503
--- response_body_like: 503 Service Temporarily Unavailable
--- error_log
reconfiguring
limiting requests
--- grep_error_log eval: qr/start worker process \d+/
--- grep_error_log_out eval
qr/\A(?:start worker process \d+\n){2}\z/



=== TEST 9: must_die on an invalid directive
--- config
    location = /bad {
        no_such_directive_for_runner on;
    }
--- must_die
--- error_log
[emerg]
unknown directive "no_such_directive_for_runner"



=== TEST 10: add_block_preprocessor gives a block without them its http_config and request
--- config
    location = /shared { return 200 "$runner_shared\n"; }
--- response_body
shared



=== TEST 11: a block with its own http_config keeps it (the preprocessor fills only what is undefined)
--- http_config
    map $uri $runner_shared { default own; }
--- config
    location = /shared { return 200 "$runner_shared\n"; }
--- request
GET /shared
--- response_body
own



=== TEST 12: http_config from a preamble variable (eval: $::HttpConfig)
--- http_config eval: $::HttpConfig
--- config
    location = /global { return 200 "$runner_global\n"; }
--- request
GET /global
--- response_body
global
