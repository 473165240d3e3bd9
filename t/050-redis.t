# Zones with a Redis backend (the runner's redis-server on
# $TEST_NGINX_REDIS_PORT): exact limits, the documented keys and TTLs, and
# the on_error policies against a port where nothing listens.
use Test::Nginx::Socket 'no_plan';

no_shuffle();
check_accum_error_log();
run_tests();

__DATA__

=== TEST 1: 5r/h counted through Redis: exactly 5 x 200, then 429
--- init
my $s = time % 3600; sleep(3601 - $s) if $s > 3590;
--- http_config
    redis_ratelimit_zone $arg_k zone=rz:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t050:;
--- config
    location = /t {
        redis_ratelimit rz 5r/h;
        redis_ratelimit_headers on;
    }
--- user_files
>>> t
ok
--- request eval
[("GET /t?k=erin") x 7]
--- error_code eval
[200, 200, 200, 200, 200, 429, 429]
--- response_headers_like eval
["RateLimit: \"rz\";r=4;t=\\d+", "RateLimit: \"rz\";r=3;t=\\d+", "RateLimit: \"rz\";r=2;t=\\d+", "RateLimit: \"rz\";r=1;t=\\d+", "RateLimit: \"rz\";r=0;t=\\d+", "Retry-After: \\d+", "Retry-After: \\d+"]
--- wait: 0.2
--- no_error_log
redis_ratelimit: zone



=== TEST 2: the count is in Redis under the documented key, with a TTL of at most 2P; a restarted node asks Redis before its first request (a small limit is decided there)
--- init
use IO::Socket::INET;
my $sock = IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $ENV{TEST_NGINX_REDIS_PORT}, Timeout => 3)
    or die "cannot reach redis: $!";
sub cmd { my @a = @_; my $r = "*" . @a . "\r\n"; $r .= "\$" . length($_) . "\r\n$_\r\n" for @a; print $sock $r; my $l = <$sock>; $l =~ s/\r\n$//; if ($l =~ /^\$(-?\d+)/) { return undef if $1 < 0; my $v = <$sock>; $v =~ s/\r\n$//; return $v } $l =~ s/^[:+]//; return $l }
my $w = int(time / 3600) * 3600;
my $key = "t050:{rz:erin}:3600:$w";
my $v = cmd("GET", $key);
$v = cmd("GET", "t050:{rz:erin}:3600:" . ($w - 3600)) unless defined $v;
die "expected 5 in $key, got " . (defined $v ? $v : "nothing") unless defined $v && $v == 5;
my $ttl = cmd("TTL", $key);
die "TTL of $key is $ttl, expected 0 < TTL <= 7200" unless $ttl > 0 && $ttl <= 7200;
--- http_config
    redis_ratelimit_zone $arg_k zone=rz:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t050:;
--- config
    location = /t { redis_ratelimit rz 5r/h; }
--- user_files
>>> t
ok
--- request eval
# this nginx is new (fresh shared memory): a small limit is decided in
# Redis, which says the key is over, from the first request on
["GET /t?k=erin", "GET /t?k=erin", "GET /t?k=erin"]
--- error_code eval
[429, 429, 429]
--- wait: 0.1



=== TEST 3: on_error=allow lets everything through while Redis is unreachable, and says so once
--- http_config
    redis_ratelimit_zone $arg_k zone=down:1m redis=redis://127.0.0.1:1 timeout=100ms on_error=allow;
--- config
    location = /t { redis_ratelimit down 1r/d; }
--- user_files
>>> t
ok
--- request eval
# 1r/d, but every request passes: the first one finds Redis unreachable
[("GET /t?k=a") x 6]
--- error_code eval
[(200) x 6]
--- wait: 0.2
--- error_log eval
qr/\[error\] .*redis_ratelimit: zone "down": connecting to redis:\/\/127\.0\.0\.1:1 failed/



=== TEST 4: on_error=deny rejects while Redis is unreachable
--- http_config
    redis_ratelimit_zone $arg_k zone=down:1m redis=redis://127.0.0.1:1 timeout=100ms on_error=deny;
--- config
    location = /t { redis_ratelimit down 1000r/d; }
    location = /warm { redis_ratelimit down 1000r/d; }
--- user_files
>>> t
ok
>>> warm
ok
--- init
# nothing to do: the first request finds the backend "up" (never tried)
--- request eval
["GET /warm?k=w", "GET /t?k=a", "GET /t?k=b"]
--- error_code_like eval
["^(200|429)\$", "^429\$", "^429\$"]
--- wait: 0.3



=== TEST 5: on_error=local keeps limiting from this node's counts
--- http_config
    redis_ratelimit_zone $arg_k zone=down:1m redis=redis://127.0.0.1:1 timeout=100ms;
--- config
    location = /t { redis_ratelimit down 3r/d; }
--- user_files
>>> t
ok
--- request eval
[("GET /t?k=a") x 5]
--- error_code eval
[200, 200, 200, 429, 429]



=== TEST 6: cost=4 through Redis: two requests fit 10r/h, the third does not
--- init
my $s = time % 3600; sleep(3601 - $s) if $s > 3590;
--- http_config
    redis_ratelimit_zone $arg_k zone=rc:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t050:;
--- config
    location = /t { redis_ratelimit rc 10r/h cost=4; }
--- user_files
>>> t
ok
--- request eval
[("GET /t?k=cost") x 3]
--- error_code eval
[200, 200, 429]
--- wait: 0.2



=== TEST 7: Redis holds the weight, not the number of requests (INCRBY 4, twice)
--- init
use IO::Socket::INET;
my $sock = IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $ENV{TEST_NGINX_REDIS_PORT}, Timeout => 3)
    or die "cannot reach redis: $!";
sub cmd2 { my @a = @_; my $r = "*" . @a . "\r\n"; $r .= "\$" . length($_) . "\r\n$_\r\n" for @a; print $sock $r; my $l = <$sock>; $l =~ s/\r\n$//; if ($l =~ /^\$(-?\d+)/) { return undef if $1 < 0; my $v = <$sock>; $v =~ s/\r\n$//; return $v } $l =~ s/^[:+]//; return $l }
my $w = int(time / 3600) * 3600;
my $v = cmd2("GET", "t050:{rc:cost}:3600:$w");
$v = cmd2("GET", "t050:{rc:cost}:3600:" . ($w - 3600)) unless defined $v;
die "expected 8 in t050:{rc:cost}, got " . (defined $v ? $v : "nothing") unless defined $v && $v == 8;
--- http_config
    redis_ratelimit_zone $arg_k zone=rc:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT prefix=t050:;
--- config
    location = /t { redis_ratelimit rc 10r/h cost=4; }
--- user_files
>>> t
ok
--- request eval
# this nginx is new: Redis (8 of 10, a cost of 4 does not fit) decides
# its first request too
["GET /t?k=cost", "GET /t?k=cost"]
--- error_code eval
[429, 429]
--- wait: 0.1
