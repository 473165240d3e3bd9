# Lua's control of a zone's keys (block, unblock, override, inspect): the
# same controls as the API's, honoured by the directives and by Lua's own
# limiters of the zone; wrong arguments raise, conditions come back as
# nil and a message. Run by `make test-lua` against Debian's nginx.
use Test::Nginx::Socket 'no_plan';
use Cwd qw(cwd);

our $pwd = cwd();
our $HttpConfig = qq{
    lua_package_path "$pwd/lua/?.lua;;";
    redis_ratelimit_zone \$arg_k zone=fleet:1m redis=redis://127.0.0.1:$ENV{TEST_NGINX_REDIS_PORT} prefix=luactl:;
    redis_ratelimit_zone \$arg_k zone=local:1m;
};

no_shuffle();
run_tests();

__DATA__

=== TEST 1: a block from Lua rejects the key at the directive and at Lua's limiter; unblock lifts it
--- http_config eval: $::HttpConfig
--- config
    location = /dir { redis_ratelimit local 100r/m; root html; }
    location = /ctl {
        content_by_lua_block {
            local rl = require "resty.redis_ratelimit"
            local op = ngx.var.arg_op
            if op == "block" then
                ngx.say(rl.block("local", ngx.var.arg_k, 60))
            elseif op == "unblock" then
                ngx.say(rl.unblock("local", ngx.var.arg_k))
            else
                local lim = rl.new("local", "100r/m", { zone = "local" })
                local limited, err, retry = lim:is_rate_limited(ngx.var.arg_k)
                local i = rl.inspect("local", ngx.var.arg_k)
                ngx.say(limited, " ", retry and math.ceil(retry) or "-", " ", i.blocked and math.ceil(i.blocked) or "none")
            end
        }
    }
--- user_files
>>> dir
ok
--- request eval
["GET /dir?k=eve", "GET /ctl?op=block&k=eve", "GET /dir?k=eve", "GET /ctl?op=check&k=eve", "GET /ctl?op=unblock&k=eve", "GET /ctl?op=unblock&k=eve", "GET /dir?k=eve", "GET /ctl?op=check&k=eve"]
--- response_body_like eval
["^ok\n\$", "^true\n\$", "429 Too Many Requests", "^true 60 60\n\$", "^true\n\$", "^false\n\$", "^ok\n\$", "^false \\d+ none\n\$"]
--- error_code eval
[200, 200, 429, 200, 200, 200, 200, 200]



=== TEST 2: an override from Lua is the directive's rate for the key; inspect shows it; nil lifts it
--- http_config eval: $::HttpConfig
--- config
    location = /dir { redis_ratelimit local 1r/h; root html; }
    location = /ctl {
        content_by_lua_block {
            local rl = require "resty.redis_ratelimit"
            if ngx.var.arg_op == "set" then
                ngx.say(rl.override("local", "gold", "3r/h", 3600))
            elseif ngx.var.arg_op == "lift" then
                ngx.say(rl.override("local", "gold", nil))
            else
                local i = rl.inspect("local", "gold")
                ngx.say(i.override and (i.override.rate .. " " .. math.ceil(i.override.ttl)) or "none")
            end
        }
    }
--- user_files
>>> dir
ok
--- request eval
["GET /ctl?op=set", "GET /ctl?op=show", "GET /dir?k=gold", "GET /dir?k=gold", "GET /dir?k=gold", "GET /dir?k=gold", "GET /ctl?op=lift", "GET /ctl?op=show", "GET /dir?k=gold"]
--- response_body_like eval
["^true\n\$", "^3r/h 3600\n\$", "^ok\n\$", "^ok\n\$", "^ok\n\$", "429", "^true\n\$", "^none\n\$", "429"]
--- error_code eval
[200, 200, 200, 200, 200, 429, 200, 200, 429]



=== TEST 3: on a zone with Redis the block is written to the zone's hash with its time
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local rl = require "resty.redis_ratelimit"
            assert(rl.block("fleet", "mallory", 900))
            ngx.sleep(0.3)
            local sock = ngx.socket.tcp()
            assert(sock:connect("127.0.0.1", $TEST_NGINX_REDIS_PORT))
            sock:send("PTTL luactl:{fleet}:ctl\r\nHGET luactl:{fleet}:ctl b:mallory\r\n")
            local ttl = sock:receive()
            local len = sock:receive()
            local value = sock:receive()
            sock:close()
            ttl = tonumber(ttl:sub(2))
            ngx.say(ttl > 899000 and ttl <= 900000, " ", value:match("^%d+|$") ~= nil)
        }
    }
--- request
GET /t
--- response_body
true true
--- no_error_log
[error]



=== TEST 4: wrong arguments raise; an unknown zone and a bad time come back as they should
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local rl = require "resty.redis_ratelimit"
            -- the error names the caller's line (content_by_lua's chunk)
            local function try(f)
                local ok, err = pcall(f)
                return ok and "ok" or (err:gsub("^content_by_lua%(.-%):%d+: ", "here: ", 1))
            end
            ngx.say(try(function() local _ = rl.block("local", "k", 0) end))
            ngx.say(try(function() local _ = rl.block("local", "k", 31 * 86400) end))
            ngx.say(try(function() local _ = rl.block("local", {}, 60) end))
            ngx.say(try(function() local _ = rl.block(7, "k", 60) end))
            ngx.say(try(function() local _ = rl.override("local", "k", "fast", 60) end))
            ngx.say(try(function() local _ = rl.inspect(false, "k") end))
            local ok, err = rl.block("nope", "k", 60)
            ngx.say(tostring(ok), " ", err)
            local i, err = rl.inspect("nope", "k")
            ngx.say(tostring(i), " ", err)
        }
    }
--- request
GET /t
--- response_body
here: block: ttl must be a number of seconds from 1 to 2592000, got 0
here: block: ttl must be a number of seconds from 1 to 2592000, got 2678400
here: block: key must be a string or a number, got table
here: block: zone must be a zone's name, got number
here: override: rate must be a rate such as "1000r/m" or nil, got fast
here: inspect: zone must be a zone's name, got boolean
nil zone "nope" is not available
nil zone "nope" is not available
--- no_error_log
[error]
