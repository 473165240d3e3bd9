#!/usr/bin/env bash
# Used by `make run`: lays out a prefix under build/run and starts nginx in
# the foreground with nginx-conf/example.conf.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
prefix=$root/build/run
port=${1:-8080}
redis_port=${2:-6379}
mkdir -p "$prefix"/{conf,logs,html,modules,redis}
cp -f build/modules/ngx_http_redis_ratelimit_module.so "$prefix/modules/"
sed -e "s/127.0.0.1:8080/127.0.0.1:$port/" -e "s/127.0.0.1:6379/127.0.0.1:$redis_port/g" \
    nginx-conf/example.conf > "$prefix/conf/nginx.conf"

# A local Redis beside nginx, stopped (by its pid) when this script ends.
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$prefix/redis" --daemonize no > "$prefix/logs/redis.log" 2>&1 &
redis_pid=$!
trap 'kill "$redis_pid" 2>/dev/null; wait "$redis_pid" 2>/dev/null' EXIT
for _ in $(seq 50); do
    (exec 3<>"/dev/tcp/127.0.0.1/$redis_port") 2>/dev/null && break
    sleep 0.1
done
echo "redis-server (pid $redis_pid) on 127.0.0.1:$redis_port"
echo "hello from nginx" > "$prefix/html/index.html"
chmod -R a+rX "$prefix"
build/sbin/nginx -p "$prefix" -c conf/nginx.conf -t
cat <<MSG

nginx is starting on http://127.0.0.1:$port (Ctrl-C stops it)

  see a 429:  for i in \$(seq 7); do curl -s -o /dev/null -w '%{http_code}\n' http://127.0.0.1:$port/login; done
  headers:    curl -i http://127.0.0.1:$port/login
  per token:  for i in \$(seq 12); do curl -s -o /dev/null -w '%{http_code} ' 'http://127.0.0.1:$port/api/?token=abc'; done; echo
  no Redis:   for i in \$(seq 5); do curl -s -o /dev/null -w '%{http_code} ' http://127.0.0.1:$port/local/; done; echo
  in Redis:   redis-cli -p $redis_port --no-raw --scan --pattern 'rl:*'
  log:        tail -f $prefix/logs/error.log $prefix/logs/access.log

MSG
build/sbin/nginx -p "$prefix" -c conf/nginx.conf -g 'daemon off;' &
nginx_pid=$!
stop() {
    kill -QUIT "$nginx_pid" 2>/dev/null; wait "$nginx_pid" 2>/dev/null
    kill "$redis_pid" 2>/dev/null; wait "$redis_pid" 2>/dev/null
}
# Ctrl-C is how this ends: a clean stop, not a failure for make
trap 'stop; exit 0' INT TERM
trap stop EXIT
wait "$nginx_pid"
