#!/usr/bin/env bash
# Instructions per request, counted by valgrind's callgrind (repeatable,
# unlike req/s on a shared VM): nginx in one process serves N keep-alive
# requests to one location, and the same with 200 requests; the difference
# divided by (N - 200) is the cost of one request. Locations: a static file
# (baseline), the same behind limit_req, behind an embedded zone, and
# behind the same zone with its rate from a map (tiers), limit_conn and a
# concurrency limit (redis_ratelimit_conn); with redis-server,
# one key through Redis, strict (a request alone, and 16 connections in
# step, each its own key: their requests share script calls; this row is
# 192 and 2 400 requests whatever N), and 10 000 keys behind limit_req and
# a Redis zone (the many-key cases of make bench).
#
#   bash bench/callgrind.sh [N]        (needs valgrind; about a minute)
#   CALLGRIND_MODULE=/path/to/module.so bash bench/callgrind.sh   (another build)
#   CALLGRIND_ONLY='strict lrk' bash bench/callgrind.sh   (only these rows, by
#       location name without its slash; the baseline is always run)
#   CALLGRIND_KEYS=100000 CALLGRIND_ONLY='lrk redis-10k' bash bench/callgrind.sh
#       (the many-key rows over 100 000 keys, 16m zones: about two minutes)
#   CALLGRIND_OUT=dir bash bench/callgrind.sh   (keeps each run's profile,
#       with per-instruction counts, as dir/<conf>-<location>-<requests>.out: for
#       bench/callgrind_instr.py, or callgrind_annotate on two of them)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-2400}
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 1; }
work=$(mktemp -d)
chmod 755 "$work"
nginx_pid=
redis_pid=
cleanup() {
    if [ -n "$nginx_pid" ] && kill -0 "$nginx_pid" 2>/dev/null; then
        kill -QUIT "$nginx_pid"; sleep 2; kill -KILL "$nginx_pid" 2>/dev/null || true
    fi
    if [ -n "$redis_pid" ] && kill -0 "$redis_pid" 2>/dev/null; then
        kill -TERM "$redis_pid"; sleep 1; kill -KILL "$redis_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work"/{conf,logs,html}
echo ok > "$work/html/b"
chmod -R a+rX "$work"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$work/conf/nginx.conf" <<CONF
load_module ${CALLGRIND_MODULE:-$PWD/build/modules/ngx_http_redis_ratelimit_module.so};
daemon off; master_process off;
error_log logs/error.log error;
events {}
http {
    access_log off;
    limit_req_zone \$binary_remote_addr zone=lr:10m rate=100000000r/s;
    redis_ratelimit_zone \$binary_remote_addr zone=e:10m;
    server {
        listen 127.0.0.1:$port;
        keepalive_requests 1000000;
        location = /base { root html; try_files /b =404; }
        location = /limit_req { root html; try_files /b =404; limit_req zone=lr burst=1000000 nodelay; }
        location = /embedded { root html; try_files /b =404; redis_ratelimit e 1000000000r/s; }
    }
}
CONF
# the same, plus a rate from a map (tiers): its own file, because every
# variable a configuration defines costs every request a little
sed -e 's|^    server {|    map $arg_plan $tier_rate { default 1000000000r/s; }\n    server {|' \
    -e 's|^    }$|        location = /embedded-map { root html; try_files /b =404; redis_ratelimit e $tier_rate; }\n    }|' \
    "$work/conf/nginx.conf" > "$work/conf/map.conf"
# a concurrency limit (redis_ratelimit_conn) beside nginx's limit_conn: a
# configuration of its own too (each location more costs every row a little)
sed -e 's|^    server {|    limit_conn_zone $binary_remote_addr zone=lc:10m;\n    server {|' \
    -e 's|^    }$|        location = /limit_conn { root html; try_files /b =404; limit_conn lc 1000; }\n        location = /conn { root html; try_files /b =404; redis_ratelimit_conn e 1000; }\n    }|' \
    "$work/conf/nginx.conf" > "$work/conf/conn.conf"
cat > "$work/load.py" <<'PY'
import socket, sys
port, path, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
keys = int(sys.argv[4]) if len(sys.argv) > 4 else 0
conns = int(sys.argv[5]) if len(sys.argv) > 5 else 1
socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(conns)]
bufs = [b""] * conns
def request(i):
    if not keys:
        return ("GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path).encode()
    # X-Key k0 .. k<keys-1>, in turn
    return ("GET %s HTTP/1.1\r\nHost: x\r\nX-Key: k%d\r\n\r\n" % (path, i % keys)).encode()
# `conns` connections in step: a request on each, then every response
for r in range(0, n, conns):
    for j, s in enumerate(socks):
        s.sendall(request(r + j))
    for j, s in enumerate(socks):
        while b"\r\n\r\nok\n" not in bufs[j]:
            d = s.recv(65536)
            if not d:
                raise SystemExit("connection closed")
            bufs[j] += d
        bufs[j] = bufs[j][bufs[j].index(b"\r\n\r\nok\n") + 7:]
for s in socks:
    s.close()
PY
run() { # location requests [conf [keys [connections]]] -> instructions
    valgrind --tool=callgrind --callgrind-out-file="$work/out" \
        ${CALLGRIND_OUT:+--dump-instr=yes} build/sbin/nginx \
        -p "$work/" -c "conf/${3:-nginx.conf}" > "$work/vg.log" 2>&1 &
    nginx_pid=$!
    for _ in $(seq 150); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        sleep 0.2
    done
    python3 "$work/load.py" "$port" "$1" "$2" "${4:-0}" "${5:-1}"
    kill -QUIT "$nginx_pid"; wait "$nginx_pid" 2>/dev/null || true; nginx_pid=
    if [ -n "${CALLGRIND_OUT:-}" ]; then
        mkdir -p "$CALLGRIND_OUT"
        cp "$work/out" "$CALLGRIND_OUT/$(basename "${3:-nginx.conf}" .conf)-$(echo "${1#/}" | tr / -)-$2.out"
    fi
    sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$work/vg.log"
}
# whether a row is wanted (CALLGRIND_ONLY: its location names; the baseline
# always is: every row is also given beyond it)
want() { [ -z "${CALLGRIND_ONLY:-}" ] || [ "$1" = base ] || [[ " $CALLGRIND_ONLY " == *" $1 "* ]]; }
echo "| location | instructions per request | beyond the baseline |"
echo "|---|---:|---:|"
base=
per_request() { # location [conf]
    local small total
    small=$(run "$1" 200 "${2:-}")
    total=$(run "$1" "$n" "${2:-}")
    echo $(( (total - small) / (n - 200) ))
}
# `conns` connections in step, each with its own key (X-Key k0 ..): what a
# request costs when requests arrive together, as under load
conns_per_request() { # location conf conns
    local small total
    small=$(run "$1" $(( 12 * $3 )) "$2" "$3" "$3")
    total=$(run "$1" $(( 150 * $3 )) "$2" "$3" "$3")
    echo $(( (total - small) / (138 * $3) ))
}
# many keys: X-Key over `keys` values in turn, `rounds` times; the first
# round (every key new) is the baseline taken away, so the figure is what
# a request of a key seen before costs, its table and batch entries found
# among `keys` others
many_per_request() { # location conf keys rounds
    local first total
    first=$(run "$1" "$3" "$2" "$3")
    total=$(run "$1" $(( $3 * $4 )) "$2" "$3")
    echo $(( (total - first) / ($3 * ($4 - 1)) ))
}
for loc in base limit_req embedded; do
    want "$loc" || continue
    per=$(per_request "/$loc")
    [ -n "$base" ] || base=$per
    echo "| /$loc | $per | $(( per - base )) |"
done
for loc in limit_conn conn; do
    want "$loc" || continue
    per=$(per_request "/$loc" conn.conf)
    echo "| /$loc (a concurrency limit of 1000; conn.conf) | $per | $(( per - base )) |"
done
# one hot key through Redis: every thread counted (the worker's and its
# Redis thread's), so what the background thread spends per request is in
# the figure; under valgrind the threads run one at a time, so flushes
# coalesce differently than at full speed: an indication, not a constant
if command -v redis-server >/dev/null; then
    rport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no \
        --dir "$work" > "$work/redis.log" 2>&1 &
    redis_pid=$!
    sed -e "s|^    server {|    redis_ratelimit_zone \$binary_remote_addr zone=r:10m redis=redis://127.0.0.1:$rport;\n    server {|" \
        -e 's|^    }$|        location = /redis-hot { root html; try_files /b =404; redis_ratelimit r 1000000000r/s; }\n    }|' \
        "$work/conf/nginx.conf" > "$work/conf/redis.conf"
    # the same with a strict location: a configuration of its own (a zone a
    # strict limit uses gets a strict link per worker)
    sed -e 's|^    }$|        location = /strict { root html; try_files /b =404; redis_ratelimit r 1000000000r/s strict; }\n    }|' \
        "$work/conf/redis.conf" > "$work/conf/strict.conf"
    # a concurrency limit on the zone with Redis: one key far from its
    # number, its slots taken of the worker's lease (a configuration of
    # its own)
    sed -e 's|^    }$|        location = /conn-redis { root html; try_files /b =404; redis_ratelimit_conn r 1000; }\n    }|' \
        "$work/conf/redis.conf" > "$work/conf/connredis.conf"
    if want conn-redis; then
        cr=$(per_request /conn-redis connredis.conf)
        echo "| /conn-redis (a concurrency limit of 1000 on a zone with Redis, one key, all threads; connredis.conf) | $cr | $(( cr - base )) |"
    fi
    if want redis-hot; then
        hot=$(per_request /redis-hot redis.conf)
        echo "| /redis-hot (one key through Redis, all threads; redis.conf) | $hot | $(( hot - base )) |"
    fi
    # a strict request waits for its script call (the worker's strict link:
    # sent and read on the event loop)
    if want strict; then
        strict=$(per_request /strict strict.conf)
        echo "| /strict (one key, each request waits for Redis's decision, all threads; strict.conf) | $strict | $(( strict - base )) |"
    fi
    # the same under load: 16 connections in step, each with its own key,
    # so that keys waiting together share script calls (the row above is
    # a request alone: a call, a reply and a wake-up of its own); judged
    # against the static file served to the same 16 connections
    sed -e "s|^    server {|    redis_ratelimit_zone \$http_x_key zone=sk:10m redis=redis://127.0.0.1:$rport;\n    server {|" \
        -e 's|^    }$|        location = /strict-16 { root html; try_files /b =404; redis_ratelimit sk 1000000000r/s strict; }\n    }|' \
        "$work/conf/nginx.conf" > "$work/conf/strict16.conf"
    if want strict-16; then
        base16=$(conns_per_request /base strict16.conf 16)
        strict16=$(conns_per_request /strict-16 strict16.conf 16)
        echo "| /base (16 connections in step, X-Key; strict16.conf) | $base16 | $(( base16 - base )) |"
        echo "| /strict-16 (16 connections in step, each its own key: keys share script calls, all threads; strict16.conf) | $strict16 | $(( strict16 - base )) ($(( strict16 - base16 )) beyond the same 16 connections' static file) |"
    fi
    # 10 000 keys, far below their limits: limit_req and a Redis zone on
    # the same key variable and zone size (bench/run.py's many-key cases).
    # hold=60s: the held counts wait out the run, so the figure is the
    # request path's over many keys, the same in every run (with the
    # default 5 s hold, how many keys a flush finds depends on how fast
    # valgrind runs: 12 000 to 18 000 instructions on this machine; what
    # the thread spends per key is in make bench's Redis figures)
    # CALLGRIND_KEYS=100000: make bench's 100 000-key cases (16m zones)
    keys=${CALLGRIND_KEYS:-10000}
    size=10m
    [ "$keys" -le 20000 ] || size=16m
    sed -e "s|^    server {|    limit_req_zone \$http_x_key zone=lrk:$size rate=100r/s;\n    redis_ratelimit_zone \$http_x_key zone=km:$size redis=redis://127.0.0.1:$rport hold=60s;\n    server {|" \
        -e 's|^    }$|        location = /lrk { root html; try_files /b =404; limit_req zone=lrk burst=1000000 nodelay; }\n        location = /redis-10k { root html; try_files /b =404; redis_ratelimit km 6000r/m; }\n    }|' \
        "$work/conf/nginx.conf" > "$work/conf/keys.conf"
    if want lrk || want redis-10k; then
        lrk=$(many_per_request /lrk keys.conf "$keys" 3)
        rk=$(many_per_request /redis-10k keys.conf "$keys" 3)
        echo "| /lrk (limit_req, $keys keys by X-Key, $size; keys.conf) | $lrk | $(( lrk - base )) |"
        echo "| /redis-10k ($keys keys by X-Key through Redis, 6000r/m, hold=60s, $size, all threads; keys.conf) | $rk | $(( rk - base )) |"
        echo
        echo "many keys: /redis-10k ÷ /lrk = $(( rk * 1000 / lrk )) per mille (X-Key's header adds to both and to neither baseline)"
    fi
fi
if want embedded-map; then
    fixed=$(per_request /embedded map.conf)
    mapped=$(per_request /embedded-map map.conf)
    echo
    echo "rate from a map (map.conf: the same plus one map): /embedded $fixed, /embedded-map $mapped" \
         "instructions per request ($(( mapped - fixed )) more, $(( (mapped - fixed) * 1000 / fixed )) per mille)"
fi
