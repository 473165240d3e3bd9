# ngx_http_redis_ratelimit — build, run, test.
#
#   make build   nginx (vendored 1.28, --with-compat) + the module, in build/
#   make run     nginx in the foreground with nginx-conf/example.conf
#   make test    unit tests + every t/*.t against the built nginx
#   make rust    checks that cargo is there and new enough (make build and
#                every target calling cargo run it first)
#   make check   cargo fmt --check + clippy -D warnings + layout rules (no import cycles)
#   make bench   throughput, Redis cost and accuracy against nginx's limit_req;
#                Redis cost with 1, 2, 4 and 8 workers (bench/workers.py)
#   make soak    ~5 min of traffic on 2 nginx + Redis under chaos (not in `make test`)
#   make build-debian  the module for Debian's nginx, through ./configure
#                      --add-dynamic-module=. on its nginx-dev source
#   make test-lua      t/lua (Lua API) and t/debian (debug log) on Debian's nginx
#   make deb     build/deb/libnginx-mod-http-redis-ratelimit_<version>_<arch>.deb
#                for Debian's nginx (debhelper + dh_nginx, then lintian)
#
# NGINX_BUILD_DIR=/path/to/configured/nginx/objs builds the module for that
# nginx instead of the vendored one (no nginx binary is copied then).

SHELL        := /bin/bash
# rustup's cargo, also when the caller's PATH lacks it
export PATH  := $(HOME)/.cargo/bin:$(PATH)
CARGO        ?= cargo
PROFILE      ?= release
TARGET_DIR   := target/$(PROFILE)
MODULE_NAME  := ngx_http_redis_ratelimit_module
BUILD        := build
PORT         ?= 8080
REDIS_PORT   ?= 6379
DEB_PACKAGES := libclang-dev libpcre2-dev libssl-dev zlib1g-dev pkg-config binutils redis-server wrk curl perl openssl python3
CARGO_FLAGS  := $(if $(filter release,$(PROFILE)),--release,)

DEB_NGINX_SRC := /usr/share/nginx/src
DEB_BUILD    := build/debian
DEB_PACKAGES_NGINX := nginx nginx-dev libnginx-mod-http-lua
LUA_MODULES  := /usr/lib/nginx/modules/ndk_http_module.so /usr/lib/nginx/modules/ngx_http_lua_module.so
DEB_PACKAGES_PKG := debhelper dpkg-dev fakeroot lintian
DEB_OUT      := build/deb
DEB_NAME     := libnginx-mod-http-redis-ratelimit

.PHONY: all build rust deps deps-debian deps-deb build-debian deb run test unit integration scenarios test-lua check bench soak clean

all: build

# One line saying what to do when cargo is missing or older than Cargo.toml's
# rust-version (Debian's own cargo is): run before anything calls cargo.
# $(SHELL) (/bin/bash) rather than `bash`: it answers on any PATH.
rust:
	@$(SHELL) scripts/check-rust $(CARGO)

# Installs the Debian/Ubuntu packages the build and tests need, when missing
# and when we are root (CI is root on a fresh machine).
deps:
	@bash scripts/ensure-packages $(DEB_PACKAGES)

# Debian's nginx, its configured source and its Lua module. A policy-rc.d
# keeps the package from starting an nginx service on port 80.
deps-debian: deps
	@bash scripts/ensure-packages $(DEB_PACKAGES_NGINX)

# The Debian packaging tools (make deb and its test).
deps-deb: deps-debian
	@bash scripts/ensure-packages $(DEB_PACKAGES_PKG)

# The Debian package, from debian/ with dpkg-buildpackage: debhelper and
# nginx-dev's dh_nginx (the nginx-abi dependency, the modules-enabled link
# scripts), the module built by `make build-debian` (debian/rules calls
# it), and the -dbgsym package with its debug information. Everything lands
# in build/deb (not in the parent directory); lintian must report no error.
deb: rust deps-deb
	@rm -rf $(DEB_OUT) && mkdir -p $(DEB_OUT)
	@base=$(DEB_OUT)/$(DEB_NAME)_$$(dpkg-parsechangelog -S Version)_$$(dpkg-architecture -qDEB_HOST_ARCH); \
	DEB_OUT=$(DEB_OUT) dpkg-buildpackage --build=binary --no-sign \
	  --buildinfo-option=-u$(DEB_OUT) --buildinfo-file=$$base.buildinfo \
	  --changes-option=-u$(DEB_OUT) --changes-file=$$base.changes && \
	echo "lintian $$base.changes" && lintian --fail-on error $$base.changes && \
	ls -l $(DEB_OUT)/*.deb

# The module for Debian's nginx, built the way packagers build third-party
# modules: its nginx-dev source, configured with the flags Debian used plus
# --add-dynamic-module=. (this repo's `config`), then `make modules`, which
# runs cargo. Configured again only when `config`, `config.make` or
# `auto/cargo` change. Debian's tree has no top Makefile: objs/Makefile.
DEB_HOOK_FILES := config config.make auto/cargo auto/module.map
build-debian: rust deps-debian
	@stamp="$$(cat $(DEB_HOOK_FILES) | sha256sum)"; \
	if [ "$$(cat $(DEB_BUILD)/src/.configured 2>/dev/null)" != "$$stamp" ]; then \
	  rm -rf $(DEB_BUILD)/src && mkdir -p $(DEB_BUILD) && cp -r $(DEB_NGINX_SRC) $(DEB_BUILD)/src && \
	  cd $(DEB_BUILD)/src && source ./conf_flags && \
	  NGX_CARGO_TARGET_DIR=$(CURDIR)/target/debian ./configure "$${NGX_CONF_FLAGS[@]}" \
	    --add-dynamic-module=$(CURDIR) > configure.log && \
	  echo "$$stamp" > .configured; \
	fi
	$(MAKE) -C $(DEB_BUILD)/src -f objs/Makefile modules
	@mkdir -p $(DEB_BUILD)/modules
	@cp -f $(DEB_BUILD)/src/objs/$(MODULE_NAME).so $(DEB_BUILD)/modules/$(MODULE_NAME).so
	@bash scripts/split-debug $(DEB_BUILD)/modules/$(MODULE_NAME).so
	@echo "built $(DEB_BUILD)/modules/$(MODULE_NAME).so for $$(/usr/sbin/nginx -v 2>&1)"

build: rust deps
	$(CARGO) build $(CARGO_FLAGS)
	@mkdir -p $(BUILD)/sbin $(BUILD)/modules
	@cp -f $(TARGET_DIR)/libngx_http_redis_ratelimit.so $(BUILD)/modules/$(MODULE_NAME).so
	@bash scripts/split-debug $(BUILD)/modules/$(MODULE_NAME).so
	@if [ -z "$$NGINX_BUILD_DIR" ] && [ -z "$$NGINX_SOURCE_DIR" ]; then \
	  objs=$$(cat $$(ls -t $(TARGET_DIR)/build/ngx_http_redis_ratelimit-*/out/nginx-build-dir | head -1)); \
	  cp -f $$objs/nginx $(BUILD)/sbin/nginx; \
	  echo "built $(BUILD)/sbin/nginx ($$($(BUILD)/sbin/nginx -v 2>&1)) and $(BUILD)/modules/$(MODULE_NAME).so"; \
	else \
	  echo "built $(BUILD)/modules/$(MODULE_NAME).so for $${NGINX_BUILD_DIR:-$$NGINX_SOURCE_DIR}"; \
	fi

run: build
	@bash nginx-conf/run.sh $(PORT) $(REDIS_PORT)

# the core crate's unit tests (no nginx needed), also in the debug profile:
# an arithmetic overflow panics there, where the release build wraps
unit: rust deps
	$(CARGO) test $(CARGO_FLAGS) -p ratelimit-core --lib
	$(CARGO) test -p ratelimit-core --lib

# t/*.t on the vendored nginx
integration: build
	TEST_NGINX_BINARY=$(CURDIR)/$(BUILD)/sbin/nginx \
	TEST_NGINX_LOAD_MODULES=$(CURDIR)/$(BUILD)/modules/$(MODULE_NAME).so \
	python3 t/runner.py t/*.t

# multi-process scenarios (several nginx, Redis stopped/paused/restarted)
scenarios: build
	python3 t/scenarios/run.py

# t/lua/*.t (Lua API) and t/debian/*.t (debug logging) on Debian's nginx
# (built --with-debug, with lua-nginx-module)
test-lua: build-debian
	TEST_NGINX_BINARY=/usr/sbin/nginx \
	TEST_NGINX_LOAD_MODULES="$(LUA_MODULES) $(CURDIR)/$(DEB_BUILD)/modules/$(MODULE_NAME).so" \
	python3 t/runner.py t/lua t/debian

# Everything, with one summary line at the end.
test: build build-debian deb
	@bash t/run-all

bench: build
	python3 bench/run.py --with-trace
	python3 bench/workers.py
	python3 bench/bucket.py
	python3 bench/conn.py
	$(CARGO) test --release -p ratelimit-core --test multi_node_sim -- --nocapture --exact workers_per_node

soak: build
	python3 bench/soak.py

check: rust
	$(CARGO) fmt --check
	$(CARGO) clippy $(CARGO_FLAGS) --workspace --all-targets -- -D warnings
	python3 scripts/check-layout

clean:
	rm -rf $(BUILD)
	$(CARGO) clean
