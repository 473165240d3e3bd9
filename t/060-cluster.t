# Zones backed by a Redis Cluster (3 masters + 3 replicas started by the
# runner: $TEST_NGINX_REDIS_CLUSTER_PORTS, $TEST_NGINX_REDIS_CLUSTER_PORT_1..6;
# masters are flushed before this file).  Blocks run in order: the `--- init`
# of a block inspects, in the cluster, what the previous block counted
# (following the slot map: CLUSTER KEYSLOT + CLUSTER NODES), and dies to fail.
use Test::Nginx::Socket 'no_plan';

# the zone of a block without its own --- http_config: seeded with two nodes
add_block_preprocessor(sub {
    my $block = shift;
    $block->set_value("http_config", '    redis_ratelimit_zone $arg_k zone=cz:1m'
        . ' redis=redis://127.0.0.1:$TEST_NGINX_REDIS_CLUSTER_PORT_1,redis://127.0.0.1:$TEST_NGINX_REDIS_CLUSTER_PORT_2'
        . ' cluster prefix=t060:;')
        unless defined $block->http_config;
});

no_shuffle();
run_tests();

__DATA__

=== TEST 1: 5r/h counted through the cluster: exactly 5 x 200, then 429
--- init
my $s = time % 3600; sleep(3601 - $s) if $s > 3590;
--- config
    location = /t {
        redis_ratelimit cz 5r/h;
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
["RateLimit: \"cz\";r=4;t=\\d+", "RateLimit: \"cz\";r=3;t=\\d+", "RateLimit: \"cz\";r=2;t=\\d+", "RateLimit: \"cz\";r=1;t=\\d+", "RateLimit: \"cz\";r=0;t=\\d+", "Retry-After: \\d+", "Retry-After: \\d+"]
--- wait: 0.2
--- no_error_log
redis_ratelimit: zone
[alert]



=== TEST 2: the count 5 is in the cluster, on the master owning the key's slot (TTL <= 2P); a fresh node asks the cluster before its first request (a small limit)
--- init
use IO::Socket::INET;
my @ports = split ' ', $ENV{TEST_NGINX_REDIS_CLUSTER_PORTS};
my %conn;
sub rd { my $s = shift; my $l = <$s>; die "redis closed the connection" unless defined $l; $l =~ s/\r\n\z//; my ($t, $v) = (substr($l, 0, 1), substr($l, 1)); if ($t eq '$') { return undef if $v < 0; my $d; read($s, $d, $v + 2) == $v + 2 or die "short read"; return substr($d, 0, $v) } if ($t eq '*') { return undef if $v < 0; return [map { rd($s) } 1 .. $v] } return $t eq '-' ? "-$v" : $v }
sub rc { my ($p, @a) = @_; my $s = ($conn{$p} ||= IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $p, Timeout => 3)) or die "cannot reach redis on port $p: $!"; my $r = "*" . @a . "\r\n"; $r .= "\$" . length($_) . "\r\n$_\r\n" for @a; print $s $r; return rd($s) }
sub masters { my %m; for (split /\n/, rc($ports[0], "CLUSTER", "NODES")) { my @f = split ' '; next unless @f > 8 && $f[2] =~ /master/ && $f[2] !~ /fail/; my ($p) = $f[1] =~ /:(\d+)\@/; $m{$p} = [grep { !/^\[/ } @f[8 .. $#f]] } die "expected 3 masters, CLUSTER NODES shows " . join(",", sort keys %m) unless keys %m == 3; return \%m }
sub owner { my $slot = shift; my $m = masters(); for my $p (keys %$m) { for (@{ $m->{$p} }) { my ($lo, $hi) = split /-/; $hi = $lo unless defined $hi; return $p if $slot >= $lo && $slot <= $hi } } die "no master owns slot $slot" }
my $w = int(time / 3600) * 3600;
my $key = "t060:{cz:erin}:3600:$w";
my $slot = rc($ports[0], "CLUSTER", "KEYSLOT", $key);
my $own = owner($slot);
my $v = rc($own, "GET", $key);
if (!defined $v) { $key = "t060:{cz:erin}:3600:" . ($w - 3600); $v = rc($own, "GET", $key) }
die "expected 5 in $key on master :$own (slot $slot), got " . (defined $v ? $v : "nothing") unless defined $v && $v eq "5";
my $ttl = rc($own, "TTL", $key);
die "TTL of $key is $ttl, expected 0 < TTL <= 7200" unless $ttl > 0 && $ttl <= 7200;
for my $p (grep { $_ != $own } keys %{ masters() }) {
    my $r = rc($p, "GET", $key);
    die "master :$p answered GET $key with " . (defined $r ? $r : "nil") . ", expected a MOVED redirect to :$own" unless defined $r && $r =~ /^-MOVED $slot 127\.0\.0\.1:$own$/;
}
--- config
    location = /t { redis_ratelimit cz 5r/h; }
--- user_files
>>> t
ok
--- request eval
# this nginx is new (fresh shared memory): a small limit is decided in
# the cluster, which says the key is over, from the first request on
["GET /t?k=erin", "GET /t?k=erin", "GET /t?k=erin"]
--- error_code eval
[429, 429, 429]
--- wait: 0.1
--- no_error_log
redis_ratelimit: zone
[alert]



=== TEST 3: 200 distinct clients, one request each, all pass (their keys go to every master: see TEST 4)
--- config
    location = /t { redis_ratelimit cz 100r/m; }
--- user_files
>>> t
ok
--- request eval
[map { "GET /t?k=c$_" } 1 .. 200]
--- error_code eval
[(200) x 200]
--- wait: 0.005
--- no_error_log
redis_ratelimit: zone
[alert]



=== TEST 4: the 200 clients' keys are spread over all 3 masters, each client counted once on the master owning its slot; both windows of a key share one slot
--- init
use IO::Socket::INET;
my @ports = split ' ', $ENV{TEST_NGINX_REDIS_CLUSTER_PORTS};
my %conn;
sub rd { my $s = shift; my $l = <$s>; die "redis closed the connection" unless defined $l; $l =~ s/\r\n\z//; my ($t, $v) = (substr($l, 0, 1), substr($l, 1)); if ($t eq '$') { return undef if $v < 0; my $d; read($s, $d, $v + 2) == $v + 2 or die "short read"; return substr($d, 0, $v) } if ($t eq '*') { return undef if $v < 0; return [map { rd($s) } 1 .. $v] } return $t eq '-' ? "-$v" : $v }
sub rc { my ($p, @a) = @_; my $s = ($conn{$p} ||= IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $p, Timeout => 3)) or die "cannot reach redis on port $p: $!"; my $r = "*" . @a . "\r\n"; $r .= "\$" . length($_) . "\r\n$_\r\n" for @a; print $s $r; return rd($s) }
sub masters { my %m; for (split /\n/, rc($ports[0], "CLUSTER", "NODES")) { my @f = split ' '; next unless @f > 8 && $f[2] =~ /master/ && $f[2] !~ /fail/; my ($p) = $f[1] =~ /:(\d+)\@/; $m{$p} = [grep { !/^\[/ } @f[8 .. $#f]] } die "expected 3 masters, CLUSTER NODES shows " . join(",", sort keys %m) unless keys %m == 3; return \%m }
sub owner { my $slot = shift; my $m = masters(); for my $p (keys %$m) { for (@{ $m->{$p} }) { my ($lo, $hi) = split /-/; $hi = $lo unless defined $hi; return $p if $slot >= $lo && $slot <= $hi } } die "no master owns slot $slot" }
my $now = int(time / 60) * 60;
my (%count, %where, @problems);
my $m = masters();
for my $p (sort keys %$m) {
    my $n = rc($p, "DBSIZE");
    push @problems, "master :$p has DBSIZE $n" unless $n > 0;
    my ($cursor, $found) = ("0", 0);
    do {
        my $r = rc($p, "SCAN", $cursor, "MATCH", "t060:{cz:c*}:60:*", "COUNT", "1000");
        $cursor = $r->[0];
        for my $k (@{ $r->[1] }) {
            $k =~ /^t060:\{cz:(c\d+)\}:60:(\d+)$/ or do { push @problems, "unexpected key $k"; next };
            my ($c, $w) = ($1, $2);
            push @problems, "key $k: window $w is neither $now nor " . ($now - 60) . " (nor the one before)" unless $w == $now || $w == $now - 60 || $w == $now - 120;
            my $val = rc($p, "GET", $k);
            $count{$c} += $val;
            $where{$c}{$p} = 1;
            $found++;
            my $ttl = rc($p, "TTL", $k);
            push @problems, "key $k: TTL $ttl, expected 0 < TTL <= 120" unless $ttl > 0 && $ttl <= 120;
            my $slot = rc($p, "CLUSTER", "KEYSLOT", $k);
            push @problems, "key $k is on :$p but its slot $slot belongs to :" . owner($slot) if owner($slot) != $p;
            for my $other ($w - 60, $w + 60) {
                my $s2 = rc($p, "CLUSTER", "KEYSLOT", "t060:{cz:$c}:60:$other");
                push @problems, "t060:{cz:$c}:60:$other hashes to slot $s2, but $k to $slot" if $s2 != $slot;
            }
        }
    } while ($cursor ne "0");
    push @problems, "master :$p holds none of the 200 clients' keys" unless $found > 0;
}
my @missing = grep { !exists $count{"c$_"} } 1 .. 200;
push @problems, scalar(@missing) . " of 200 clients have no key in the cluster (e.g. " . join(",", map { "c$_" } @missing[0 .. ($#missing < 4 ? $#missing : 4)]) . ")" if @missing;
for my $c (sort keys %count) {
    push @problems, "client $c counted $count{$c} times, expected 1" if $count{$c} != 1;
    push @problems, "client $c has keys on several masters: " . join(",", sort keys %{ $where{$c} }) if keys %{ $where{$c} } > 1;
}
die join("\n", @problems[0 .. ($#problems < 14 ? $#problems : 14)]) . "\n" if @problems;
--- config
    location = /t { redis_ratelimit cz 100r/m; }
--- user_files
>>> t
ok
--- request
GET /t?k=c7
--- error_code: 200
--- no_error_log
redis_ratelimit: zone
[alert]



=== TEST 5: a single seed URL (node 5, a replica as redis-cli created the cluster) is enough: the client learns the topology and writes to the masters
--- http_config
    redis_ratelimit_zone $arg_k zone=cs:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_CLUSTER_PORT_5 cluster prefix=t060:;
--- config
    location = /t { redis_ratelimit cs 3r/h; }
--- user_files
>>> t
ok
--- init
my $s = time % 3600; sleep(3601 - $s) if $s > 3590;
--- request eval
[("GET /t?k=solo") x 5]
--- error_code eval
[200, 200, 200, 429, 429]
--- wait: 0.1
--- no_error_log
redis_ratelimit: zone
[alert]



=== TEST 6: the single-seed node's count (3) is on the master owning the key's slot
--- init
use IO::Socket::INET;
my @ports = split ' ', $ENV{TEST_NGINX_REDIS_CLUSTER_PORTS};
my %conn;
sub rd { my $s = shift; my $l = <$s>; die "redis closed the connection" unless defined $l; $l =~ s/\r\n\z//; my ($t, $v) = (substr($l, 0, 1), substr($l, 1)); if ($t eq '$') { return undef if $v < 0; my $d; read($s, $d, $v + 2) == $v + 2 or die "short read"; return substr($d, 0, $v) } if ($t eq '*') { return undef if $v < 0; return [map { rd($s) } 1 .. $v] } return $t eq '-' ? "-$v" : $v }
sub rc { my ($p, @a) = @_; my $s = ($conn{$p} ||= IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $p, Timeout => 3)) or die "cannot reach redis on port $p: $!"; my $r = "*" . @a . "\r\n"; $r .= "\$" . length($_) . "\r\n$_\r\n" for @a; print $s $r; return rd($s) }
sub masters { my %m; for (split /\n/, rc($ports[0], "CLUSTER", "NODES")) { my @f = split ' '; next unless @f > 8 && $f[2] =~ /master/ && $f[2] !~ /fail/; my ($p) = $f[1] =~ /:(\d+)\@/; $m{$p} = [grep { !/^\[/ } @f[8 .. $#f]] } die "expected 3 masters, CLUSTER NODES shows " . join(",", sort keys %m) unless keys %m == 3; return \%m }
sub owner { my $slot = shift; my $m = masters(); for my $p (keys %$m) { for (@{ $m->{$p} }) { my ($lo, $hi) = split /-/; $hi = $lo unless defined $hi; return $p if $slot >= $lo && $slot <= $hi } } die "no master owns slot $slot" }
my $w = int(time / 3600) * 3600;
my $key = "t060:{cs:solo}:3600:$w";
my $own = owner(rc($ports[0], "CLUSTER", "KEYSLOT", $key));
my $v = rc($own, "GET", $key);
if (!defined $v) { $key = "t060:{cs:solo}:3600:" . ($w - 3600); $v = rc($own, "GET", $key) }
die "expected 3 in $key on master :$own, got " . (defined $v ? $v : "nothing") unless defined $v && $v eq "3";
--- http_config
    redis_ratelimit_zone $arg_k zone=cs:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_CLUSTER_PORT_5 cluster prefix=t060:;
--- config
    location = /t { redis_ratelimit cs 3r/h; }
--- user_files
>>> t
ok
--- request eval
["GET /t?k=solo", "GET /t?k=solo"]
--- error_code eval
[429, 429]
--- wait: 0.1
--- no_error_log
redis_ratelimit: zone
[alert]
