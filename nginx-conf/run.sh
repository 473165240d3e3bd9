#!/usr/bin/env bash
# Used by `make run`: lays out a prefix under build/run and starts nginx in
# the foreground with nginx-conf/example.conf.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
prefix=$root/build/run
port=${1:-8080}
mkdir -p "$prefix"/{conf,logs,html,modules}
cp -f build/modules/ngx_http_redis_ratelimit_module.so "$prefix/modules/"
sed "s/127.0.0.1:8080/127.0.0.1:$port/" nginx-conf/example.conf > "$prefix/conf/nginx.conf"
echo "hello from nginx" > "$prefix/html/index.html"
chmod -R a+rX "$prefix"
build/sbin/nginx -p "$prefix" -c conf/nginx.conf -t
cat <<MSG

nginx is starting on http://127.0.0.1:$port (Ctrl-C stops it)

  see a 429:  for i in \$(seq 7); do curl -s -o /dev/null -w '%{http_code}\n' http://127.0.0.1:$port/login; done
  headers:    curl -i http://127.0.0.1:$port/login
  per token:  for i in \$(seq 12); do curl -s -o /dev/null -w '%{http_code} ' 'http://127.0.0.1:$port/api/?token=abc'; done; echo
  log:        tail -f $prefix/logs/error.log $prefix/logs/access.log

MSG
exec build/sbin/nginx -p "$prefix" -c conf/nginx.conf -g 'daemon off;'
