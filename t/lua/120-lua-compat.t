# resty.redis_ratelimit as a drop-in for the background limiter of the
# OpenResty library it replaces ("resty.redis.ratelimiter.background"):
# every call form of that library's README, each shown to limit (status
# sequences), plus the options table for cost and the Lua errors raised for
# wrong argument types. Run by `make test-lua` against Debian's nginx.
#
# Every block names its own namespace: Redis keeps its counts from one block
# to the next (nginx is restarted, Redis is flushed only per file).
use Test::Nginx::Socket 'no_plan';
use Cwd qw(cwd);

master_on();
workers(1);
no_shuffle();

our $pwd = cwd();
our $Zones = qq{
    lua_package_path "$pwd/lua/?.lua;;";
    redis_ratelimit_zone \$arg_k zone=ratelimit_circuit_breaker:1m redis=redis://127.0.0.1:$ENV{TEST_NGINX_REDIS_PORT} prefix=compat:;
    redis_ratelimit_zone \$arg_k zone=filter:1m redis=redis://127.0.0.1:$ENV{TEST_NGINX_REDIS_PORT} prefix=filter:;
};

run_tests();

__DATA__

=== TEST 1: a global limiter made in init_by_lua_block, used in access_by_lua_block
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- http_config eval
$::Zones . q{
    init_by_lua_block {
        local ratelimit = require "resty.redis_ratelimit"
        local red = { host = "127.0.0.1", port = 6379, timeout = 100 }
        login, err = ratelimit.new("login", "2r/m", red)
        if not login then
            error("failed to create the limiter: " .. tostring(err))
        end
    }
}
--- config
    location = /login {
        access_by_lua_block {
            if login:is_rate_limited(ngx.var.remote_addr) then
                return ngx.exit(429)
            end
        }
        content_by_lua_block {
            ngx.say("Hello, world!")
        }
    }
--- request eval
["GET /login", "GET /login", "GET /login", "GET /login"]
--- error_code eval
[200, 200, 429, 429]
--- response_body_like eval
["^Hello, world!\n\$", "^Hello, world!\n\$", "429 Too Many Requests", "429 Too Many Requests"]
--- no_error_log
[error]



=== TEST 2: everything in access_by_lua_block: new(name, rate, redis settings) on each request
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- http_config eval: $::Zones
--- config
    location = /login {
        access_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local red = { host = "127.0.0.1", port = $TEST_NGINX_REDIS_PORT, timeout = 100 }
            local lim, err = ratelimit.new("access_login", "2r/m", red)
            if not lim then
                ngx.log(ngx.ERR, "failed to create the limiter: ", err)
                return ngx.exit(500)
            end

            local is_rate_limited = lim:is_rate_limited(ngx.var.remote_addr)
            if is_rate_limited then
                return ngx.exit(429)
            end
        }
        content_by_lua_block {
            ngx.say("Hello, world!")
        }
    }
--- request eval
["GET /login", "GET /login", "GET /login"]
--- error_code eval
[200, 200, 429]
--- no_error_log
[error]



=== TEST 3: is_rate_limited(key, ngx.req.start_time()) at 2r/m: 200, 200, 503, 503
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- http_config eval: $::Zones
--- config
    location = /t {
        access_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local red = { host = "127.0.0.1", port = $TEST_NGINX_REDIS_PORT, timeout = 100,
                          expire_after_seconds = 5 }
            local lim, err = ratelimit.new("one", "2r/m", red)
            if not lim then
                ngx.log(ngx.ERR, "failed to create the limiter: ", err)
                return ngx.exit(500)
            end

            local key = ngx.var.binary_remote_addr
            local is_rate_limited = lim:is_rate_limited(key, ngx.req.start_time())
            if is_rate_limited then
                return ngx.exit(503)
            end
        }
        content_by_lua_block {
            ngx.say("ok")
        }
    }
--- request eval
["GET /t", "GET /t", "GET /t", "GET /t"]
--- error_code eval
[200, 200, 503, 503]
--- no_error_log
[error]



=== TEST 4: every Redis setting of the older library is accepted (and not used); the limiter still limits
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- http_config eval: $::Zones
--- config
    location = /t {
        access_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local cfg = { host = "10.255.255.1", port = 1, timeout = 100, dbid = 3,
                          connection_pool_size = 100, idle_keepalive_ms = 10000,
                          expire_after_seconds = 300 }
            local lim, err = ratelimit.new("allkeys", "2r/m", cfg)
            if not lim then
                ngx.log(ngx.ERR, "failed to create the limiter: ", err)
                return ngx.exit(500)
            end
            if lim:is_rate_limited(ngx.var.remote_addr, ngx.req.start_time()) then
                return ngx.exit(429)
            end
        }
        content_by_lua_block { ngx.say("ok") }
    }
--- request eval
["GET /t", "GET /t", "GET /t"]
--- error_code eval
[200, 200, 429]
--- no_error_log
[error]



=== TEST 5: { circuit_breaker_dict_name = "filter" } selects zone "filter": its counts are the directive's
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- http_config eval: $::Zones
--- config
    location = /lua {
        access_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local config = { circuit_breaker_dict_name = "filter" }
            local lim, err = ratelimit.new("filter", "3r/m", config)
            if not lim then
                ngx.log(ngx.ERR, "failed to create the limiter: ", err)
                return ngx.exit(500)
            end
            if lim:is_rate_limited(ngx.var.arg_k) then
                return ngx.exit(429)
            end
        }
        content_by_lua_block { ngx.say("lua") }
    }
    location = /dir {
        redis_ratelimit filter 3r/m;
        content_by_lua_block { ngx.say("dir") }
    }
    location = /default {
        access_by_lua_block {
            -- the same namespace in the default zone: a count of its own
            local lim = require("resty.redis_ratelimit").new("filter", "3r/m")
            if lim:is_rate_limited(ngx.var.arg_k) then
                return ngx.exit(429)
            end
        }
        content_by_lua_block { ngx.say("default") }
    }
--- request eval
["GET /lua?k=f1", "GET /dir?k=f1", "GET /lua?k=f1", "GET /dir?k=f1", "GET /lua?k=f1", "GET /default?k=f1"]
--- error_code eval
[200, 200, 200, 429, 429, 200]
--- no_error_log
runtime error
failed to create
[crit]



=== TEST 6: the older 4-argument form new(name, rate, zone name, redis settings) with the request's time
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- http_config eval: $::Zones
--- config
    location = /lua {
        access_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local red = { host = "127.0.0.1", port = $TEST_NGINX_REDIS_PORT, timeout = 100,
                          expire_after_seconds = 5 }
            local lim, err = ratelimit.new("filter", "2r/m", "filter", red)
            if not lim then
                ngx.log(ngx.ERR, "failed to create the limiter: ", err)
                return ngx.exit(500)
            end
            local is_rate_limited = lim:is_rate_limited(ngx.var.arg_k, ngx.req.start_time())
            if is_rate_limited then
                return ngx.exit(503)
            end
        }
        content_by_lua_block { ngx.say("lua") }
    }
    location = /dir {
        redis_ratelimit filter 2r/m;
        content_by_lua_block { ngx.say("dir") }
    }
--- request eval
["GET /lua?k=g1", "GET /lua?k=g1", "GET /lua?k=g1", "GET /dir?k=g1", "GET /lua?k=g2"]
--- error_code eval
[200, 200, 503, 429, 200]
--- no_error_log
runtime error
failed to create
[crit]



=== TEST 7: is_rate_limited(key, nil, { cost = 5 }) counts 5; the third value is what is left
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- http_config eval: $::Zones
--- config
    location = /t {
        content_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("cost5", "10r/m")
            local out = {}
            local limited, err, left = lim:is_rate_limited("c", nil, { cost = 5 })
            out[#out + 1] = tostring(limited) .. "/" .. tostring(err) .. "/" .. left
            -- a cost of 0 checks without counting: the estimate is 5
            out[#out + 1] = tostring(lim:measure("c", nil, { cost = 0 }))
            limited, err, left = lim:is_rate_limited("c", ngx.req.start_time(), { cost = 5 })
            out[#out + 1] = tostring(limited) .. "/" .. left
            limited = lim:is_rate_limited("c")
            out[#out + 1] = tostring(limited)
            ngx.say(table.concat(out, " "))
        }
    }
    location = /limited {
        access_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("cost5", "10r/m")
            if lim:is_rate_limited(ngx.var.arg_k, nil, { cost = 5 }) then
                return ngx.exit(429)
            end
        }
        content_by_lua_block { ngx.say("ok") }
    }
--- request eval
["GET /t", "GET /limited?k=d", "GET /limited?k=d", "GET /limited?k=d"]
--- response_body_like eval
["^false/nil/5 5(\\.0+)? false/0 true\n\$", "^ok\n\$", "^ok\n\$", "429"]
--- error_code eval
[200, 200, 200, 429]
--- no_error_log
[error]



=== TEST 8: the empty key is a key: every "" shares one count, apart from other keys
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- http_config eval: $::Zones
--- config
    location = /t {
        access_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("emptykey", "2r/m")
            if lim:is_rate_limited(ngx.var.http_x_token or "") then
                return ngx.exit(429)
            end
        }
        content_by_lua_block { ngx.say("ok") }
    }
    location = /reset {
        content_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("emptykey", "2r/m")
            ngx.say(tostring(lim:reset("")))
        }
    }
--- request eval
["GET /t", "GET /t", "GET /t", "GET /t", "GET /reset", "GET /t"]
--- more_headers eval
["", "X-Token:", "", "X-Token: t1", "", ""]
--- error_code eval
[200, 200, 429, 200, 200, 200]
--- no_error_log
[error]



=== TEST 9: wrong argument types raise a Lua error naming the problem (pcall shows each message)
--- http_config eval: $::Zones
--- config
    location = /t {
        content_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local lim = assert(ratelimit.new("types", "10r/s"))
            local function try(f, ...)
                local ok, err = pcall(f, ...)
                -- the position is the caller's line (error level 2): strip it
                ngx.say(tostring(ok), " ", (tostring(err):gsub("^[^:]*:%d+: ", "")))
            end
            try(lim.is_rate_limited, lim, nil)
            try(lim.is_rate_limited, lim, { "a table" })
            try(lim.is_rate_limited, lim, true)
            try(lim.is_rate_limited, lim, "k", 3)
            try(lim.is_rate_limited, lim, "k", "now")
            try(lim.is_rate_limited, lim, "k", nil, 5)
            try(lim.is_rate_limited, lim, "k", nil, { cost = -1 })
            try(lim.is_rate_limited, lim, "k", nil, { cost = 1.5 })
            try(lim.is_rate_limited, lim, "k", nil, { cost = 1000001 })
            try(lim.is_rate_limited, lim, "k", nil, { cost = "5" })
            try(lim.is_rate_limited, lim, "k", nil, { cots = 5 })
            try(lim.is_rate_limited, "k")
            try(lim.measure, lim, nil)
            try(lim.measure, lim, "k", 5)
            try(lim.measure, lim, "k", nil, { cost = -5 })
            try(lim.reset, lim, {})
            try(ratelimit.new, nil, "10r/s")
            try(ratelimit.new, "", "10r/s")
            try(ratelimit.new, "x", 10)
            try(ratelimit.new, "x", "10r/s", 42)
            try(ratelimit.new, "x", "10r/s", { zone = 42 })
            try(ratelimit.new, "x", "10r/s", { circuit_breaker_dict_name = true })
            try(ratelimit.new, "x", "10r/s", "filter", "redis://127.0.0.1")
            -- and what is accepted
            try(lim.is_rate_limited, lim, 42)
            try(lim.is_rate_limited, lim, "k", ngx.req.start_time(), { cost = 1000000 })
            try(lim.is_rate_limited, lim, "k", ngx.now(), {})
        }
    }
--- request
GET /t
--- response_body
false is_rate_limited: key must be a string or a number, got nil
false is_rate_limited: key must be a string or a number, got table
false is_rate_limited: key must be a string or a number, got boolean
false is_rate_limited: the 2nd argument is the request's time (ngx.req.start_time()), not 3; a cost goes in the options: is_rate_limited(key, nil, { cost = n })
false is_rate_limited: the 2nd argument is the request's time (ngx.req.start_time()) or nil, got string
false is_rate_limited: opts must be a table such as { cost = 5 }, got number
false is_rate_limited: cost must be an integer from 0 to 1000000, got -1
false is_rate_limited: cost must be an integer from 0 to 1000000, got 1.5
false is_rate_limited: cost must be an integer from 0 to 1000000, got 1000001
false is_rate_limited: cost must be an integer from 0 to 1000000, got 5
false is_rate_limited: unknown option cots (known: cost)
false is_rate_limited: call it as lim:is_rate_limited(...), with a colon
false measure: key must be a string or a number, got nil
false measure: the 2nd argument is the request's time (ngx.req.start_time()), not 5; a cost goes in the options: measure(key, nil, { cost = n })
false measure: cost must be an integer from 0 to 1000000, got -5
false reset: key must be a string or a number, got table
false new: namespace must be a non-empty string, got nil
false new: namespace must be a non-empty string, got ""
false new: rate must be a string such as "100r/s", got number
false new: cfg must be a table or a zone name, got number
false new: the zone name must be a string, got number
false new: the zone name must be a string, got boolean
false new: the 4th argument (Redis settings, not used) must be a table, got string
true false
true true
true false
--- no_error_log
[error]



=== TEST 10: in a request, a nil key (a header the request lacks) raises: 500 and an error-log line, never "not limited"
--- http_config eval: $::Zones
--- config
    location = /nilkey {
        access_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("visible", "10r/s")
            if lim:is_rate_limited(ngx.var.http_x_missing) then
                return ngx.exit(429)
            end
        }
        content_by_lua_block { ngx.say("not limited") }
    }
--- request
GET /nilkey?cost=5
--- error_code: 500
--- response_body_unlike: not limited
--- error_log eval
qr/lua entry thread aborted: runtime error: access_by_lua\([^)]*\):3: is_rate_limited: key must be a string or a number, got nil/



=== TEST 11: in a request, a cost in the 2nd place, where the older library takes the request's time raises: 500 and an error-log line, never "not limited"
--- http_config eval: $::Zones
--- config
    location = /oldcost {
        access_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("visible", "10r/s")
            if lim:is_rate_limited("k", 2) then
                return ngx.exit(429)
            end
        }
        content_by_lua_block { ngx.say("not limited") }
    }
--- request
GET /oldcost?cost=5
--- error_code: 500
--- response_body_unlike: not limited
--- error_log eval
qr/lua entry thread aborted: runtime error: access_by_lua\([^)]*\):3: is_rate_limited: the 2nd argument is the request's time \(ngx\.req\.start_time\(\)\), not 2; a cost goes in the options/



=== TEST 12: in a request, a cost that is a string (from a variable) raises: 500 and an error-log line, never "not limited"
--- http_config eval: $::Zones
--- config
    location = /badcost {
        access_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("visible", "10r/s")
            if lim:is_rate_limited("k", nil, { cost = ngx.var.arg_cost }) then
                return ngx.exit(429)
            end
        }
        content_by_lua_block { ngx.say("not limited") }
    }
--- request
GET /badcost?cost=5
--- error_code: 500
--- response_body_unlike: not limited
--- error_log eval
qr/lua entry thread aborted: runtime error: access_by_lua\([^)]*\):3: is_rate_limited: cost must be an integer from 0 to 1000000, got 5/



=== TEST 13: in a request, opts that is not a table raises: 500 and an error-log line, never "not limited"
--- http_config eval: $::Zones
--- config
    location = /badopts {
        access_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("visible", "10r/s")
            if lim:measure("k", nil, 5) then
                return ngx.exit(429)
            end
        }
        content_by_lua_block { ngx.say("not limited") }
    }
--- request
GET /badopts?cost=5
--- error_code: 500
--- response_body_unlike: not limited
--- error_log eval
qr/lua entry thread aborted: runtime error: access_by_lua\([^)]*\):3: measure: opts must be a table such as \{ cost = 5 \}, got number/



=== TEST 14: in a request, new() with a nil namespace raises: 500 and an error-log line
--- http_config eval: $::Zones
--- config
    location = /badns {
        access_by_lua_block {
            local lim = require("resty.redis_ratelimit").new(ngx.var.arg_ns, "10r/s")
            if lim:is_rate_limited("k") then
                return ngx.exit(429)
            end
        }
        content_by_lua_block { ngx.say("not limited") }
    }
--- request
GET /badns
--- error_code: 500
--- response_body_unlike: not limited
--- error_log eval
qr/lua entry thread aborted: runtime error: access_by_lua\([^)]*\):2: new: namespace must be a non-empty string, got nil/
