# syntax=docker/dockerfile:1
#
# Debian's nginx (1.22, built --with-compat) with lua-nginx-module, plus this
# module built against the same nginx version and ./configure arguments
# (Debian's nginx-dev ships both), running nginx-conf/example.conf with a
# local Redis.
#
#   docker build -t nginx-redis-ratelimit .
#   docker run --rm -p 8080:8080 nginx-redis-ratelimit
#
# The build stage reuses `make build-debian`, the same target CI runs, so the
# steps here are the tested ones. (No container engine runs on the project's
# build machines: this file is kept correct by construction, not by CI.)

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# make build-debian installs nginx, nginx-dev and libnginx-mod-http-lua,
# configures the nginx-dev source with Debian's flags and builds the module.
RUN make build-debian

FROM debian:bookworm-slim
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
 && apt-get update \
 && apt-get install -y --no-install-recommends nginx libnginx-mod-http-lua redis-server \
 && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d
COPY --from=build /src/build/debian/modules/ngx_http_redis_ratelimit_module.so /usr/lib/nginx/modules/
COPY lua/resty/redis_ratelimit.lua /usr/local/share/lua/5.1/resty/redis_ratelimit.lua
COPY nginx-conf/example.conf /etc/nginx/ratelimit/nginx.conf
RUN mkdir -p /var/lib/nginx-ratelimit/logs /var/lib/nginx-ratelimit/html \
 && ln -s /usr/lib/nginx/modules /var/lib/nginx-ratelimit/modules \
 && echo "hello from nginx" > /var/lib/nginx-ratelimit/html/index.html \
 && sed -i 's/listen 127.0.0.1:8080;/listen 8080;/' /etc/nginx/ratelimit/nginx.conf \
 && chown -R www-data /var/lib/nginx-ratelimit/logs
EXPOSE 8080
CMD ["sh", "-c", "redis-server --bind 127.0.0.1 --save '' --appendonly no --daemonize yes && exec nginx -p /var/lib/nginx-ratelimit/ -c /etc/nginx/ratelimit/nginx.conf -g 'daemon off; user www-data;'"]
