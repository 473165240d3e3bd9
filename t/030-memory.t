# A zone of the minimum size (8 pages) with far more keys than it can hold:
# the least recently used keys are evicted, every request still gets an
# answer, and a key in use keeps its count.
use Test::Nginx::Socket 'no_plan';

no_shuffle();
run_tests();

__DATA__

=== TEST 1: 3000 distinct keys through a 32k zone; the hot key stays limited
--- http_config
    redis_ratelimit_zone $arg_k zone=small:32k;
--- config
    keepalive_requests 100000;
    location = /t { redis_ratelimit small 3r/d; }
--- user_files
>>> t
ok
--- pipelined_requests eval
my @r = ("GET /t?k=hot") x 4;
for my $i (1 .. 3000) {
    push @r, "GET /t?k=cold$i";
    push @r, "GET /t?k=hot" if $i % 50 == 0;
}
push @r, ("GET /t?k=cold1") x 3, ("GET /t?k=cold3000") x 3;
\@r
--- error_code eval
my @c = (200, 200, 200, 429);
for my $i (1 .. 3000) {
    push @c, 200;
    push @c, 429 if $i % 50 == 0;
}
# cold1 was evicted long ago: it starts afresh (3 more pass); cold3000 is
# still known with 1 counted (2 more pass)
push @c, 200, 200, 200, 200, 200, 429;
\@c
--- no_error_log
[alert]
[crit]
no memory



=== TEST 2: a 1m zone holds thousands of keys without evicting any
--- http_config
    redis_ratelimit_zone $arg_k zone=big:1m;
--- config
    keepalive_requests 100000;
    location = /t { redis_ratelimit big 1r/d; }
--- user_files
>>> t
ok
--- pipelined_requests eval
my @r;
push @r, "GET /t?k=k$_" for 1 .. 2000;
push @r, "GET /t?k=k$_" for 1 .. 2000;
\@r
--- error_code eval
[(200) x 2000, (429) x 2000]
--- no_error_log
[alert]
