# Configuration: every directive accepted where it belongs, every bad input
# refused by nginx at startup with an [emerg] line naming the directive and
# the bad value.
use Test::Nginx::Socket 'no_plan';

no_shuffle();
run_tests();

__DATA__

=== TEST 1: every directive, every parameter, at every level
--- http_config
    redis_ratelimit_zone $binary_remote_addr zone=local:1m;
    redis_ratelimit_zone $arg_token zone=api:1m redis=redis://127.0.0.1:1,redis://127.0.0.1:2 cluster on_error=local timeout=100ms prefix=app:;
    redis_ratelimit_zone $arg_u zone=auth:1m redis=redis://user:secret@127.0.0.1:1/2 on_error=deny timeout=2s;
    redis_ratelimit_zone $arg_x zone=tls:1m redis=rediss://127.0.0.1:1 on_error=allow;
    redis_ratelimit_zone $arg_s zone=shared:1m redis=redis://127.0.0.1:1 on_error=share nodes=3;
    redis_ratelimit_zone $arg_y zone=sock:1m redis=redis+unix:///tmp/none.sock;
    redis_ratelimit_zone $arg_v zone=units:1M redis=redis://127.0.0.1:1 timeout=1m hold=250ms;
    redis_ratelimit_zone $arg_w zone=eager:1m redis=redis://127.0.0.1:1 hold=0;
    redis_ratelimit local 1000r/d;
    redis_ratelimit_conn local 100;
    redis_ratelimit_problem on;
    redis_ratelimit_status 503;
    redis_ratelimit_dry_run off;
    redis_ratelimit_log_level warn;
    redis_ratelimit_headers off;
--- config
    redis_ratelimit local 100r/h;
    redis_ratelimit_log_level info;
    location = /t {
        redis_ratelimit local 10r/s;
        redis_ratelimit local 100r/m cost=$arg_cost;
        redis_ratelimit local 1000r/h cost=0;
        redis_ratelimit local $arg_rate;
        redis_ratelimit_status 429;
        redis_ratelimit_dry_run on;
        redis_ratelimit_log_level notice;
        redis_ratelimit_headers on;
    }
    location = /off {
        redis_ratelimit off;
        redis_ratelimit_log_level error;
    }
    location = /counted {
        redis_ratelimit local 5r/m count_if=$status;
        redis_ratelimit api 5r/m count_if=${status}x cost=$arg_cost;
    }
--- user_files
>>> t
ok
--- request
GET /t
--- error_code: 200
--- response_headers
RateLimit-Policy: "local-10r/s";q=10;w=1, "local-100r/m";q=100;w=60, "local-1000r/h";q=1000;w=3600, "local-conn";q=100;qu="concurrent-requests"
--- no_error_log
[emerg]
secret



=== TEST 2: a zone used before it is declared
--- http_config
    server {
        listen 127.0.0.1:$TEST_NGINX_SERVER_PORT;
        server_name early;
        location = /t { redis_ratelimit late 1r/d; }
    }
    redis_ratelimit_zone $arg_k zone=late:64k;
--- config
--- user_files
>>> t
ok
--- request
GET /t?k=a
--- error_code: 200



=== TEST 3: unknown zone
--- config
    location = /t { redis_ratelimit nosuch 10r/s; }
--- must_die
--- error_log
redis_ratelimit: unknown zone "nosuch"



=== TEST 4: zone declared twice
--- http_config
    redis_ratelimit_zone $arg_a zone=twice:1m;
    redis_ratelimit_zone $arg_b zone=twice:2m;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: zone "twice" is already declared



=== TEST 5: zone below 8 pages
--- http_config
    redis_ratelimit_zone $arg_a zone=tiny:8k;
--- config
--- must_die
--- error_log eval
qr/\[emerg\] .*redis_ratelimit_zone: zone "tiny" is too small: 8192 bytes/



=== TEST 6: zone without a size, with a bad size, without zone=
--- http_config
    redis_ratelimit_zone $arg_a zone=nosize;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid zone "zone=nosize"



=== TEST 7: zone size that is not a size
--- http_config
    redis_ratelimit_zone $arg_a zone=z:10q;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid zone size "10q"



=== TEST 8: no zone= at all
--- http_config
    redis_ratelimit_zone $arg_a redis=redis://127.0.0.1:6379;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: no "zone=name:size" parameter



=== TEST 9: unknown parameter
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m foo=bar;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid parameter "foo=bar"



=== TEST 10: on_error with a bad value
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m redis=redis://127.0.0.1:6379 on_error=maybe;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid on_error "maybe": allow, deny, local or share expected



=== TEST 11: negative timeout
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m redis=redis://127.0.0.1:6379 timeout=-1;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid timeout "-1"



=== TEST 12: URL the backend cannot parse
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m redis=http://127.0.0.1:6379;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid Redis URL "http://127.0.0.1:6379"



=== TEST 13: bad port in a URL; the password is not shown
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m redis=redis://u:hunter2@127.0.0.1:notaport;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid Redis URL "redis://u:***@127.0.0.1:notaport"
--- no_error_log
hunter2



=== TEST 14: several URLs without cluster
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m redis=redis://127.0.0.1:1,redis://127.0.0.1:2;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: several Redis URLs need the "cluster" or "sentinel=" parameter



=== TEST 15: cluster without redis=
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m cluster;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: "cluster" needs "redis=URL,..."



=== TEST 16: a prefix with braces would move the hash tag
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m redis=redis://127.0.0.1:6379 "prefix=a{b}";
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid prefix "a{b}"



=== TEST 17: rate with an unknown unit
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m;
--- config
    location = /t { redis_ratelimit z 10r/x; }
--- must_die
--- error_log
redis_ratelimit: invalid rate "10r/x"



=== TEST 18: rate of zero
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m;
--- config
    location = /t { redis_ratelimit z 0r/s; }
--- must_die
--- error_log
redis_ratelimit: invalid rate "0r/s"



=== TEST 19: rate missing
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m;
--- config
    location = /t { redis_ratelimit z; }
--- must_die
--- error_log
redis_ratelimit: "z" needs a rate



=== TEST 20: rate written with a space
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m;
--- config
    location = /t { redis_ratelimit z 10 r/s; }
--- must_die
--- error_log
redis_ratelimit: invalid rate "10"



=== TEST 21: the same limit twice
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m;
--- config
    location = /t { redis_ratelimit z 10r/s; redis_ratelimit z 10r/s; }
--- must_die
--- error_log
redis_ratelimit: duplicate limit "z 10r/s"



=== TEST 22: off mixed with limits at one level
--- http_config
    redis_ratelimit_zone $arg_a zone=z:1m;
--- config
    location = /t { redis_ratelimit z 10r/s; redis_ratelimit off; }
--- must_die
--- error_log
redis_ratelimit: "off" cannot be combined with limits at the same level



=== TEST 23: status below 400
--- config
    redis_ratelimit_status 399;
--- must_die
--- error_log
redis_ratelimit_status: invalid status "399": 400 to 599 expected



=== TEST 24: status above 599
--- config
    redis_ratelimit_status 600;
--- must_die
--- error_log
redis_ratelimit_status: invalid status "600"



=== TEST 25: status that is not a number
--- config
    redis_ratelimit_status teapot;
--- must_die
--- error_log
"redis_ratelimit_status" directive invalid number



=== TEST 26: dry run with a bad value
--- config
    redis_ratelimit_dry_run maybe;
--- must_die
--- error_log
invalid value "maybe" in "redis_ratelimit_dry_run" directive, it must be "on" or "off"



=== TEST 27: headers with a bad value
--- config
    redis_ratelimit_headers yes;
--- must_die
--- error_log
redis_ratelimit_headers: invalid value "yes": on, off or legacy expected



=== TEST 28: log level with a bad value
--- config
    redis_ratelimit_log_level debug;
--- must_die
--- error_log
redis_ratelimit_log_level: invalid level "debug": info, notice, warn or error expected



=== TEST 29: a directive repeated at one level
--- config
    redis_ratelimit_status 429;
    redis_ratelimit_status 503;
--- must_die
--- error_log
"redis_ratelimit_status" directive is duplicate



=== TEST 30: zone directive outside http
--- main_config
    redis_ratelimit_zone $arg_a zone=z:1m;
--- config
--- must_die
--- error_log
"redis_ratelimit_zone" directive is not allowed here



=== TEST 31: an on/off directive repeated at one level (nginx's flag slot)
--- config
    redis_ratelimit_dry_run on;
    redis_ratelimit_dry_run off;
--- must_die
--- error_log
"redis_ratelimit_dry_run" directive is duplicate



=== TEST 32: log level repeated at one level
--- config
    redis_ratelimit_log_level warn;
    redis_ratelimit_log_level info;
--- must_die
--- error_log
redis_ratelimit_log_level: is duplicate



=== TEST 33: sizes and times as nginx reads them (ngx_parse_size, ngx_parse_time)
--- http_config
    redis_ratelimit_zone $arg_k zone=big:1M redis=redis://127.0.0.1:1 timeout=1m;
    redis_ratelimit_zone $arg_k zone=bad:64k redis=redis://127.0.0.1:1 timeout=1.5s;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid timeout "1.5s": a time from 1ms to 60s expected (100ms, 1s)



=== TEST 34: a cost that is not a number
--- config
    location = /t { redis_ratelimit z 10r/s cost=abc; }
--- must_die
--- error_log
redis_ratelimit: invalid cost "cost=abc": 0 to 1000000 or a variable expected



=== TEST 35: a negative cost
--- config
    location = /t { redis_ratelimit z 10r/s cost=-1; }
--- must_die
--- error_log
redis_ratelimit: invalid cost "cost=-1"



=== TEST 36: a cost above 1000000
--- config
    location = /t { redis_ratelimit z 10r/s cost=1000001; }
--- must_die
--- error_log
redis_ratelimit: invalid cost "cost=1000001"



=== TEST 37: an unknown parameter after the rate
--- config
    location = /t { redis_ratelimit z 10r/s weight=2; }
--- must_die
--- error_log
redis_ratelimit: invalid parameter "weight=2"



=== TEST 38: headers repeated at one level
--- config
    redis_ratelimit_headers on;
    redis_ratelimit_headers legacy;
--- must_die
--- error_log
redis_ratelimit_headers: is duplicate



=== TEST 39: count_if without a variable
--- config
    location = /t { redis_ratelimit z 10r/s count_if=yes; }
--- must_die
--- error_log
redis_ratelimit: invalid parameter "count_if=yes": count_if needs a variable



=== TEST 40: count_if with nothing after it
--- config
    location = /t { redis_ratelimit z 10r/s count_if=; }
--- must_die
--- error_log
redis_ratelimit: invalid parameter "count_if=": count_if needs a variable



=== TEST 41: count_if given twice
--- config
    location = /t { redis_ratelimit z 10r/s count_if=$a count_if=$b; }
--- must_die
--- error_log
redis_ratelimit: duplicate parameter "count_if="



=== TEST 42: cost given twice
--- config
    location = /t { redis_ratelimit z 10r/s cost=2 cost=3; }
--- must_die
--- error_log
redis_ratelimit: duplicate parameter "cost="



=== TEST 43: count_if naming a variable nginx does not know
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
--- config
    location = /t { redis_ratelimit z 10r/s count_if=$no_such_variable_here; }
--- must_die
--- error_log
unknown "no_such_variable_here" variable



=== TEST 44: hold below zero
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 hold=-1;
--- config
    location = /t { redis_ratelimit z 1r/s; }
--- must_die
--- error_log
redis_ratelimit_zone: invalid hold "-1": a time from 0 to 60s expected



=== TEST 45: hold above a minute
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 hold=2m;
--- config
    location = /t { redis_ratelimit z 1r/s; }
--- must_die
--- error_log
redis_ratelimit_zone: invalid hold "2m": a time from 0 to 60s expected



=== TEST 46: hold without a Redis backend
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m hold=1s;
--- config
    location = /t { redis_ratelimit z 1r/s; }
--- must_die
--- error_log
redis_ratelimit_zone: "hold=" needs "redis=URL"

=== TEST 47: strict on a zone without Redis
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
--- config
    location = /t { redis_ratelimit z 5r/m strict; }
--- must_die
--- error_log
redis_ratelimit: "strict" needs a zone with Redis: zone "z"

=== TEST 48: strict given twice
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT;
--- config
    location = /t { redis_ratelimit z 5r/m strict strict; }
--- must_die
--- error_log
redis_ratelimit: duplicate parameter "strict"

=== TEST 49: strict on a zone declared after the limit, without Redis
--- http_config
    redis_ratelimit late 5r/m strict;
    redis_ratelimit_zone $arg_k zone=late:1m;
--- config
    location = /t { return 200; }
--- must_die
--- error_log
"strict" needs a zone with Redis: zone "late"

=== TEST 50: sentinel without the sentinels' URLs
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m sentinel=mymaster;
--- config
    location = /t { redis_ratelimit z 1r/s; }
--- must_die
--- error_log
redis_ratelimit_zone: "sentinel=" needs "redis=URL,..." (the sentinels)

=== TEST 51: sentinel and cluster together
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1,redis://127.0.0.1:2 cluster sentinel=m;
--- config
    location = /t { redis_ratelimit z 1r/s; }
--- must_die
--- error_log
redis_ratelimit_zone: "cluster" and "sentinel=" exclude each other

=== TEST 52: a strict limit and sentinel=, accepted
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1,redis://127.0.0.1:2 sentinel=mymaster timeout=100ms;
--- config
    location = /t { redis_ratelimit z 5r/m strict count_if=$arg_f; }
--- user_files
>>> t
ok
--- request
GET /t?k=a
--- error_code: 200



=== TEST 53: a timeout above 60s (a strict request would wait that long, and a worker shutting down)
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 timeout=9223372036854775807ms;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid timeout "9223372036854775807ms": a time from 1ms to 60s expected



=== TEST 54: timeout=61s
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 timeout=61s;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid timeout "61s": a time from 1ms to 60s expected



=== TEST 55: timeout=60s, the longest, accepted
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 timeout=60s;
--- config
    location = /t { redis_ratelimit z 1r/s; }
--- user_files
>>> t
ok
--- request
GET /t?k=a
--- error_code: 200



=== TEST 56: sentinel_password= without sentinel=
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 sentinel_password=hunter2;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: "sentinel_user=" and "sentinel_password=" need "sentinel="



=== TEST 57: a misspelt sentinel_password= fails without showing its value
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 sentinel=m sentinel_pasword=hunter2;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid parameter "sentinel_pasword=***"
--- no_error_log
hunter2



=== TEST 58: sentinel_user= and sentinel_password=, accepted
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://:master@127.0.0.1:1,redis://127.0.0.1:2 sentinel=mymaster sentinel_user=watcher sentinel_password=s3cret;
--- config
    location = /t { redis_ratelimit z 5r/m; }
--- user_files
>>> t
ok
--- request
GET /t?k=a
--- error_code: 200



=== TEST 59: password_file= that cannot be read names the file, not a secret
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 password_file=no/such/file;
--- config
--- must_die
--- error_log eval
qr/\[emerg\] .*redis_ratelimit_zone: cannot read password_file ".*conf\/no\/such\/file": No such file or directory/



=== TEST 60: a password file of three lines is refused without its contents
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 password_file=../html/pw;
--- config
--- user_files
>>> pw
user
hunter2
more
--- must_die
--- error_log eval
qr/redis_ratelimit_zone: password_file ".*html\/pw": the password file must hold one line \(the password\) or two \(the user, then the password\)/
--- no_error_log
hunter2



=== TEST 61: password_file= beside a URL with a password of its own
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://:inurl@127.0.0.1:1 password_file=../html/pw;
--- config
--- user_files
>>> pw
hunter2
--- must_die
--- error_log eval
qr/redis_ratelimit_zone: password_file ".*": the URL "redis:\/\/:\*\*\*\@127.0.0.1:1" has credentials of its own beside "password_file="/
--- no_error_log
hunter2



=== TEST 62: password_file= without redis=
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m password_file=../html/pw;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: "password_file=" needs "redis=URL"



=== TEST 63: a password file of one line (the password) or two (user, password), accepted
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 password_file=../html/pw;
    redis_ratelimit_zone $arg_k zone=y:1m redis=redis://127.0.0.1:1 password_file=../html/pw2;
--- config
    location = /t { redis_ratelimit z 5r/m; }
--- user_files
>>> pw
hunter2
>>> pw2
app
hunter2
>>> t
ok
--- request
GET /t?k=a
--- error_code: 200



=== TEST 64: ssl_certificate= without its key
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=rediss://127.0.0.1:1 ssl_certificate=../html/c.pem;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: "ssl_certificate=" needs "ssl_certificate_key="



=== TEST 65: ssl_trusted_certificate= needs a TLS URL
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 ssl_trusted_certificate=../html/ca.pem;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: "ssl_trusted_certificate=" needs a TLS URL (rediss://host:port)



=== TEST 66: ssl_trusted_certificate= beside #insecure
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=rediss://127.0.0.1:1/#insecure ssl_trusted_certificate=../html/ca.pem;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: "ssl_trusted_certificate=" verifies the server, and the URL's "#insecure" turns verification off: remove one



=== TEST 67: ssl_certificate_key= without redis=, and without its certificate
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m ssl_certificate_key=../html/k.pem;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: "ssl_certificate_key=" needs "ssl_certificate="



=== TEST 68: a CA file that is not PEM: the file is named, not shown
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=rediss://127.0.0.1:1 ssl_trusted_certificate=../html/ca.pem;
--- config
--- user_files
>>> ca.pem
secret-looking garbage
--- must_die
--- error_log eval
qr/redis_ratelimit_zone: ssl_trusted_certificate ".*\/html\/ca.pem": no PEM certificate in it/
--- no_error_log
secret-looking



=== TEST 69: ssl_name= with cluster
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=rediss://127.0.0.1:1 cluster ssl_name=redis.internal;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: "ssl_name=" does not apply to "cluster": each node is verified by the endpoint it announces



=== TEST 70: ssl_name= that is not a host name
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=rediss://127.0.0.1:1 ssl_name=-bad..name;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid ssl_name "-bad..name": a host name or IP address expected



=== TEST 71: nodes= of zero
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:6379 on_error=share nodes=0;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid nodes "0": a number of nodes from 1 to 100000 expected



=== TEST 72: nodes= without on_error=share
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:6379 nodes=4;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: "nodes=" needs "on_error=share"



=== TEST 73: nodes= with on_error=share
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:6379 on_error=share nodes=4;
--- config
    location = /t { redis_ratelimit z 10r/s; try_files /index.html =404; }
--- user_files
>>> index.html
ok
--- request
GET /t?k=a
--- error_code: 200



=== TEST 74: a zone name with a colon
--- http_config
    redis_ratelimit_zone $arg_k zone=a:b:1m;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid zone name "a:b": printable ASCII without braces or colons expected



=== TEST 75: a password with a percent sign that starts no escape
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://:pa%zzss@127.0.0.1:6379;
--- config
--- must_die
--- error_log
redis_ratelimit_zone: invalid Redis URL "redis://:***@127.0.0.1:6379": the user or password holds a "%" that is not followed by two hex digits (write "%" as %25)
--- no_error_log
pa%zz



=== TEST 76: burst= that is not a number of requests
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
--- config
    location = /t { redis_ratelimit z 1r/s burst=-1; }
--- must_die
--- error_log
redis_ratelimit: invalid value "burst=-1": 0 to 1000000 requests expected



=== TEST 77: delay= above burst=
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
--- config
    location = /t { redis_ratelimit z 1r/s burst=2 delay=3; }
--- must_die
--- error_log
redis_ratelimit: delay=3 above burst=2: a request over the burst is rejected, never delayed



=== TEST 78: nodelay and delay= together
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
--- config
    location = /t { redis_ratelimit z 1r/s burst=2 nodelay delay=1; }
--- must_die
--- error_log
redis_ratelimit: "nodelay" and "delay=" given twice, or both



=== TEST 79: a bucket on a zone with Redis, strict or not (its Redis down: on_error decides)
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 timeout=100ms;
--- config
    location = /t { redis_ratelimit z 1r/s burst=2 nodelay; try_files /index.html =404; }
    location = /s { redis_ratelimit z 1r/s burst=2 strict; try_files /index.html =404; }
--- user_files
>>> index.html
ok
--- request
GET /t?k=a
--- error_code: 200



=== TEST 80: a bucket on a zone with Redis, strict
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:1 timeout=100ms;
--- config
    location = /s { redis_ratelimit z 1r/s burst=2 delay=1 strict; try_files /index.html =404; }
--- user_files
>>> index.html
ok
--- request
GET /s?k=a
--- error_code: 200



=== TEST 81: a bucket and a window of one zone and rate, side by side
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
--- config
    location = /t { redis_ratelimit z 1r/m burst=0; redis_ratelimit z 1r/m; try_files /index.html =404; }
--- user_files
>>> index.html
ok
--- request
GET /t?k=a
--- error_code: 200



=== TEST 82: redis_ratelimit_conn: a number that is not 1 to 1000000
--- http_config
    redis_ratelimit_zone $arg_k zone=c:1m;
--- config
    location = /t { redis_ratelimit_conn c 0; }
--- must_die
--- error_log
redis_ratelimit_conn: invalid number "0": 1 to 1000000 requests expected



=== TEST 83: redis_ratelimit_conn: an unknown parameter
--- http_config
    redis_ratelimit_zone $arg_k zone=c:1m;
--- config
    location = /t { redis_ratelimit_conn c 5 nodelay; }
--- must_die
--- error_log
redis_ratelimit_conn: invalid parameter "nodelay"



=== TEST 84: redis_ratelimit_conn: one zone twice at one level
--- http_config
    redis_ratelimit_zone $arg_k zone=c:1m;
--- config
    location = /t { redis_ratelimit_conn c 5; redis_ratelimit_conn c 6; }
--- must_die
--- error_log
redis_ratelimit_conn: zone "c" is limited twice at one level



=== TEST 85: redis_ratelimit_conn: an unknown zone
--- config
    location = /t { redis_ratelimit_conn nowhere 5; }
--- must_die
--- error_log
unknown zone "nowhere"



=== TEST 86: redis_ratelimit_conn strict on a zone without Redis
--- http_config
    redis_ratelimit_zone $arg_k zone=c:1m;
--- config
    location = /t { redis_ratelimit_conn c 5 strict; }
--- must_die
--- error_log
"strict" needs a zone with Redis: zone "c"



=== TEST 87: redis_ratelimit_conn on a zone with Redis, strict and lease=: the fleet's limit (Redis down here: on_error=local decides)
--- http_config
    redis_ratelimit_zone $arg_k zone=c:1m redis=redis://127.0.0.1:1 timeout=100ms;
--- config
    redis_ratelimit_conn c 5 lease=30s;
    location = /t { redis_ratelimit_conn c 2 strict lease=1s; add_header X-Conn $redis_ratelimit_conn_status; try_files /index.html =404; }
--- user_files
>>> index.html
ok
--- request
GET /t?k=a
--- error_code: 200
--- response_headers
X-Conn: PASSED



=== TEST 88: redis_ratelimit_conn at every level, inherited by a level with none, beside rate limits
--- http_config
    redis_ratelimit_zone $arg_k zone=c:1m;
    redis_ratelimit_conn c 100;
--- config
    redis_ratelimit_conn c 50;
    location = /t { redis_ratelimit c 10r/s; add_header X-Conn $redis_ratelimit_conn_status; try_files /index.html =404; }
--- user_files
>>> index.html
ok
--- request
GET /t?k=a
--- error_code: 200
--- response_headers
X-Conn: PASSED



=== TEST 89: redis_ratelimit_problem takes on or off
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
--- config
    location = /t { redis_ratelimit z 1r/s; redis_ratelimit_problem maybe; }
--- must_die
--- error_log
"redis_ratelimit_problem" directive



=== TEST 90: redis_ratelimit_conn lease= on a zone without Redis
--- http_config
    redis_ratelimit_zone $arg_k zone=c:1m;
--- config
    location = /t { redis_ratelimit_conn c 5 lease=10s; }
--- must_die
--- error_log
redis_ratelimit_conn: "lease=" needs a zone with Redis: zone "c"



=== TEST 91: redis_ratelimit_conn lease= out of range
--- http_config
    redis_ratelimit_zone $arg_k zone=c:1m redis=redis://127.0.0.1:1;
--- config
    location = /t { redis_ratelimit_conn c 5 lease=500ms; }
--- must_die
--- error_log
redis_ratelimit_conn: invalid "lease=500ms": a time of 1s to 60s expected



=== TEST 92: redis_ratelimit_conn lease= that is not a time
--- http_config
    redis_ratelimit_zone $arg_k zone=c:1m redis=redis://127.0.0.1:1;
--- config
    location = /t { redis_ratelimit_conn c 5 lease=soon; }
--- must_die
--- error_log
redis_ratelimit_conn: invalid "lease=soon": a time of 1s to 60s expected



=== TEST 93: redis_ratelimit_conn strict twice
--- http_config
    redis_ratelimit_zone $arg_k zone=c:1m redis=redis://127.0.0.1:1;
--- config
    location = /u { redis_ratelimit_conn c 5 strict strict; }
--- must_die
--- error_log
redis_ratelimit_conn: invalid parameter "strict"



=== TEST 94: redis_ratelimit_api, read-only and writable, and block= on a limit
--- http_config
    redis_ratelimit_zone $arg_k zone=api:1m redis=redis://127.0.0.1:1;
    redis_ratelimit_zone $binary_remote_addr zone=ip:1m;
--- config
    location /login { redis_ratelimit ip 5r/m block=15m; redis_ratelimit api 10r/s block=30s strict; }
    location /ratelimit/ { redis_ratelimit_api write=on; allow 127.0.0.1; deny all; }
    location /ratelimit-ro/ { redis_ratelimit_api write=off; }
    location /status/ { redis_ratelimit_api; }
--- request
GET /ratelimit/zones/ip
--- error_code: 200
--- response_body_like: "controls_capacity":\d+



=== TEST 95: redis_ratelimit_api with an unknown parameter
--- config
    location /api/ { redis_ratelimit_api write=yes; }
--- must_die
--- error_log
redis_ratelimit_api: invalid parameter "write=yes": write=on or write=off expected



=== TEST 96: redis_ratelimit_api outside a location
--- http_config
    redis_ratelimit_api;
--- config
    location /t { }
--- must_die
--- error_log
"redis_ratelimit_api" directive is not allowed here



=== TEST 97: redis_ratelimit_api twice in a location
--- config
    location /api/ { redis_ratelimit_api; redis_ratelimit_api write=on; }
--- must_die
--- error_log
redis_ratelimit_api: is duplicate



=== TEST 98: block= out of range
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
--- config
    location /t { redis_ratelimit z 5r/m block=500ms; }
--- must_die
--- error_log
redis_ratelimit: invalid block "block=500ms": a time from 1s to 30d expected (30s, 15m)



=== TEST 99: block= that is not a time
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
--- config
    location /t { redis_ratelimit z 5r/m block=later; }
--- must_die
--- error_log
redis_ratelimit: invalid block "block=later": a time from 1s to 30d expected (30s, 15m)



=== TEST 100: block= twice on one line
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
--- config
    location /u { redis_ratelimit z 5r/m block=1m block=2m; }
--- must_die
--- error_log
redis_ratelimit: duplicate parameter "block="



=== TEST 101: block= over 30 days
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m;
--- config
    location /u { redis_ratelimit z 5r/m block=31d; }
--- must_die
--- error_log
redis_ratelimit: invalid block "block=31d": a time from 1s to 30d expected (30s, 15m)
