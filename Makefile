# ngx_http_redis_ratelimit — build, run, test.
#
#   make build   nginx (vendored 1.28, --with-compat) + the module, in build/
#   make run     nginx in the foreground with nginx-conf/example.conf
#   make test    unit tests + every t/*.t against the built nginx
#   make check   cargo fmt --check + clippy -D warnings
#
# NGINX_BUILD_DIR=/path/to/configured/nginx/objs builds the module for that
# nginx instead of the vendored one (no nginx binary is copied then).

SHELL        := /bin/bash
CARGO        ?= cargo
PROFILE      ?= release
TARGET_DIR   := target/$(PROFILE)
MODULE_NAME  := ngx_http_redis_ratelimit_module
BUILD        := build
PORT         ?= 8080
DEB_PACKAGES := libclang-dev libpcre2-dev libssl-dev zlib1g-dev pkg-config redis-server wrk curl perl
CARGO_FLAGS  := $(if $(filter release,$(PROFILE)),--release,)

.PHONY: all build deps run test unit integration check clean

all: build

# Installs the Debian/Ubuntu packages the build and tests need, when missing
# and when we are root (CI is root on a fresh machine).
deps:
	@missing=""; \
	for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing:$$missing"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "missing packages:$$missing (install them, or run as root)"; exit 1; \
	  fi; \
	fi

build: deps
	$(CARGO) build $(CARGO_FLAGS)
	@mkdir -p $(BUILD)/sbin $(BUILD)/modules
	@cp -f $(TARGET_DIR)/libngx_http_redis_ratelimit.so $(BUILD)/modules/$(MODULE_NAME).so
	@if [ -z "$$NGINX_BUILD_DIR" ] && [ -z "$$NGINX_SOURCE_DIR" ]; then \
	  objs=$$(cat $$(ls -t $(TARGET_DIR)/build/ngx_http_redis_ratelimit-*/out/nginx-build-dir | head -1)); \
	  cp -f $$objs/nginx $(BUILD)/sbin/nginx; \
	  echo "built $(BUILD)/sbin/nginx ($$($(BUILD)/sbin/nginx -v 2>&1)) and $(BUILD)/modules/$(MODULE_NAME).so"; \
	else \
	  echo "built $(BUILD)/modules/$(MODULE_NAME).so for $${NGINX_BUILD_DIR:-$$NGINX_SOURCE_DIR}"; \
	fi

run: build
	@bash nginx-conf/run.sh $(PORT)

unit: deps
	$(CARGO) test $(CARGO_FLAGS) --lib

integration: build
	TEST_NGINX_BINARY=$(CURDIR)/$(BUILD)/sbin/nginx \
	TEST_NGINX_LOAD_MODULES=$(CURDIR)/$(BUILD)/modules/$(MODULE_NAME).so \
	python3 t/runner.py t

test: unit integration

check:
	$(CARGO) fmt --check
	$(CARGO) clippy $(CARGO_FLAGS) -- -D warnings
	$(CARGO) clippy $(CARGO_FLAGS) --lib --tests -- -D warnings

clean:
	rm -rf $(BUILD)
	$(CARGO) clean
