# The Lua API (lua/resty/redis_ratelimit.lua) on a distribution nginx with
# lua-nginx-module: same zone, counters, breaker and background thread as
# the directives. Run by `make test-lua` against Debian's nginx.
use Test::Nginx::Socket 'no_plan';
use Cwd qw(cwd);

our $pwd = cwd();
our $HttpConfig = qq{
    lua_package_path "$pwd/lua/?.lua;;";
    redis_ratelimit_zone \$arg_k zone=ratelimit_circuit_breaker:1m redis=redis://127.0.0.1:$ENV{TEST_NGINX_REDIS_PORT} prefix=lua:;
    redis_ratelimit_zone \$arg_k zone=local:1m;
};

no_shuffle();
run_tests();

__DATA__

=== TEST 1: 2r/m from Lua: 2 x 200, then 429
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        access_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local lim, err = ratelimit.new("login", "2r/m")
            if not lim then
                ngx.log(ngx.ERR, "new: ", err)
                return ngx.exit(500)
            end
            local limited, err = lim:is_rate_limited(ngx.var.arg_u)
            if err then
                ngx.log(ngx.ERR, "is_rate_limited: ", err)
                return ngx.exit(500)
            end
            if limited then
                return ngx.exit(429)
            end
        }
        content_by_lua_block { ngx.say("ok") }
    }
--- request eval
["GET /t?u=alice", "GET /t?u=alice", "GET /t?u=alice", "GET /t?u=bob"]
--- error_code eval
[200, 200, 429, 200]
--- no_error_log
[error]



=== TEST 2: measure grows with each call (the call included)
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("m", "100r/h", { zone = "local" })
            local a = lim:measure("k")
            local b = lim:measure("k")
            local c = lim:measure("k")
            ngx.say(a, " ", b, " ", c, " ", a < b and b < c)
        }
    }
--- request
GET /t
--- response_body_like
^1(\.0+)? 2(\.0+)? 3(\.0+)? true$
--- no_error_log
[error]



=== TEST 3: Lua and directive callers share one count (namespace = zone name)
--- http_config eval: $::HttpConfig
--- config
    location = /dir {
        redis_ratelimit local 3r/d;
        root html;
    }
    location = /lua {
        content_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("local", "3r/d", { zone = "local" })
            local limited = lim:is_rate_limited(ngx.var.arg_k)
            ngx.say(limited and "limited" or "passed")
        }
    }
--- user_files
>>> dir
ok
--- request eval
["GET /dir?k=s", "GET /lua?k=s", "GET /dir?k=s", "GET /lua?k=s", "GET /dir?k=s"]
--- response_body_like eval
["^ok\n\$", "^passed\n\$", "^ok\n\$", "^limited\n\$", "429 Too Many Requests"]
--- error_code eval
[200, 200, 200, 200, 429]



=== TEST 4: calls from rewrite_by_lua, access_by_lua, content_by_lua and a timer
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        rewrite_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("phases", "100r/d", { zone = "local" })
            ngx.ctx.r = lim:measure("k")
        }
        access_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("phases", "100r/d", { zone = "local" })
            ngx.ctx.a = lim:measure("k")
        }
        content_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("phases", "100r/d", { zone = "local" })
            local c = lim:measure("k")
            local done = false
            local ok, err = ngx.timer.at(0, function(premature)
                local l = require("resty.redis_ratelimit").new("phases", "100r/d", { zone = "local" })
                l:measure("k")
                done = true
            end)
            while not done do ngx.sleep(0.01) end
            ngx.say(ngx.ctx.r, " ", ngx.ctx.a, " ", c, " ", lim:measure("k"))
        }
    }
--- request
GET /t
--- response_body_like
^1(\.0+)? 2(\.0+)? 3(\.0+)? 5(\.0+)?$
--- no_error_log
[error]



=== TEST 5: bad rate, unknown zone, long namespace: nil and a message, the request survives
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local lim, err = ratelimit.new("x", "10r/x", { zone = "local" })
            ngx.say(tostring(lim), ": ", err)
            lim, err = ratelimit.new("x", "0r/s", { zone = "local" })
            ngx.say(tostring(lim), ": ", err)
            lim, err = ratelimit.new("x", "abc", { zone = "local" })
            ngx.say(tostring(lim), ": ", err)
            lim, err = ratelimit.new("x", "10r/s", { zone = "nosuchzone" })
            ngx.say(tostring(lim), ": ", err)
            lim, err = ratelimit.new("x", "10r/s", "nosuchzone")
            ngx.say(tostring(lim), ": ", err)
            lim, err = ratelimit.new(string.rep("n", 129), "10r/s", { zone = "local" })
            ngx.say(tostring(lim), ": ", err)
            lim, err = ratelimit.new(string.rep("n", 128), "10r/s", { zone = "local" })
            ngx.say(type(lim), ": ", tostring(err), ": ", tostring(lim:is_rate_limited("k")))
            ngx.say("still here")
        }
    }
--- request
GET /t
--- response_body
nil: invalid rate "10r/x": N r/s, r/m, r/h or r/d expected (10r/s)
nil: invalid rate "0r/s": N r/s, r/m, r/h or r/d expected (10r/s)
nil: invalid rate "abc": N r/s, r/m, r/h or r/d expected (10r/s)
nil: unknown zone "nosuchzone": declare it with redis_ratelimit_zone
nil: unknown zone "nosuchzone": declare it with redis_ratelimit_zone
nil: namespace longer than 128 bytes
table: nil: false
still here
--- no_error_log
[error]



=== TEST 6: counts reach Redis under the Lua namespace
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("redisns", "100r/h")
            for i = 1, 3 do lim:is_rate_limited("carol") end
            ngx.sleep(0.2)
            -- read it back with a cosocket: the key is lua:{redisns:carol}:3600:<w>
            local sock = ngx.socket.tcp()
            assert(sock:connect("127.0.0.1", $TEST_NGINX_REDIS_PORT))
            local w = math.floor(ngx.time() / 3600) * 3600
            local key = "lua:{redisns:carol}:3600:" .. w
            sock:send("*2\r\n$3\r\nGET\r\n$" .. #key .. "\r\n" .. key .. "\r\n")
            local line = sock:receive("*l")
            local val = line == "$-1" and "nil" or line:sub(1, 1) == "$" and sock:receive("*l") or line
            sock:send("*2\r\n$3\r\nTTL\r\n$" .. #key .. "\r\n" .. key .. "\r\n")
            local ttl = tonumber(sock:receive("*l"):sub(2))
            sock:close()
            ngx.say(val, " ", ttl > 0 and ttl <= 7200)
        }
    }
--- request
GET /t
--- response_body
3 true
--- no_error_log
[error]



=== TEST 7: reset forgets the key here and in Redis
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("resetns", "2r/h")
            local a = lim:is_rate_limited("dave")
            local b = lim:is_rate_limited("dave")
            local c = lim:is_rate_limited("dave")
            ngx.sleep(0.2)
            local function get(key)
                local sock = ngx.socket.tcp()
                assert(sock:connect("127.0.0.1", $TEST_NGINX_REDIS_PORT))
                sock:send("*2\r\n$6\r\nEXISTS\r\n$" .. #key .. "\r\n" .. key .. "\r\n")
                local line = sock:receive("*l")
                sock:close()
                return line
            end
            local key = "lua:{resetns:dave}:3600:" .. math.floor(ngx.time() / 3600) * 3600
            local before = get(key)
            assert(lim:reset("dave"))
            local d = lim:is_rate_limited("dave")
            ngx.sleep(0.2)
            -- after the reset the one new request is all Redis holds
            local sock = ngx.socket.tcp()
            assert(sock:connect("127.0.0.1", $TEST_NGINX_REDIS_PORT))
            sock:send("*2\r\n$3\r\nGET\r\n$" .. #key .. "\r\n" .. key .. "\r\n")
            local line = sock:receive("*l")
            local after = line == "$-1" and "nil" or sock:receive("*l")
            sock:close()
            ngx.say(tostring(a), " ", tostring(b), " ", tostring(c), " ", before, " ", tostring(d), " ", after)
        }
    }
--- request
GET /t
--- response_body
false false true :1 false 1
--- no_error_log
[error]



=== TEST 8: cost: is_rate_limited(key, nil, { cost = 3 }) consumes 3, a request that does not fit is refused uncounted, measure(key, nil, { cost = 5 })
--- init
my $s = time % 60; sleep(61 - $s) if $s > 55;
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("cost", "10r/m", { zone = "local" })
            local out = {}
            for i = 1, 4 do
                local limited = lim:is_rate_limited("k", nil, { cost = 3 })
                out[#out + 1] = tostring(limited)
            end
            local limited = lim:is_rate_limited("k", nil, { cost = 0 })
            out[#out + 1] = "zero:" .. tostring(limited)
            out[#out + 1] = "one:" .. tostring((lim:is_rate_limited("k", nil, { cost = 1 })))
            out[#out + 1] = "full:" .. tostring((lim:is_rate_limited("k", nil, { cost = 1 })))
            out[#out + 1] = "zero-at-limit:" .. tostring((lim:is_rate_limited("k", nil, { cost = 0 })))
            out[#out + 1] = "measure:" .. tostring(lim:measure("m", nil, { cost = 5 }))
            out[#out + 1] = "measure-default:" .. tostring(lim:measure("m"))
            out[#out + 1] = "with-time:" .. tostring((lim:is_rate_limited("t", ngx.req.start_time(), { cost = 10 })))
            out[#out + 1] = "after:" .. tostring((lim:is_rate_limited("t")))
            ngx.say(table.concat(out, ","))
        }
    }
--- request
GET /t
--- response_body_like
^false,false,false,true,zero:false,one:false,full:true,zero-at-limit:true,measure:5(\.0+)?,measure-default:6(\.0+)?,with-time:false,after:true$
--- no_error_log
[error]



=== TEST 9: a small limit (Redis decides it for the directive) counted from Lua, then by the directive: the Lua counts go down the strict link, ahead of the directive's checks
Lua decides in the background (it never waits), but its counts of a small
limit go down the worker's strict link, the connection the directive's
checks take: there they are in Redis before the worker's next check of the
key, whatever the Redis thread is doing. Redis's client list shows the
link's last command: the Lua counts' script call, before any directive
request. Then 1 + 2 from Lua + 17 more from the directive: 20 of 20.
--- init
my $s = time % 60; sleep(61 - $s) if $s > 50;
--- http_config eval: $::HttpConfig
--- config
    location = /lua {
        content_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("ratelimit_circuit_breaker", "20r/m")
            -- the link the first request asked for is there (a count made
            -- before it goes through the Redis thread)
            ngx.sleep(0.2)
            local a = lim:is_rate_limited(ngx.var.arg_k)
            local b = lim:is_rate_limited(ngx.var.arg_k)
            ngx.sleep(0.3)
            -- the link's last command, from Redis's client list
            local sock = ngx.socket.tcp()
            assert(sock:connect("127.0.0.1", $TEST_NGINX_REDIS_PORT))
            sock:send("*2\r\n$6\r\nCLIENT\r\n$4\r\nLIST\r\n")
            local len = tonumber(sock:receive("*l"):sub(2))
            local list = sock:receive(len + 2)
            sock:close()
            local cmds = {}
            for line in list:gmatch("[^\n]+") do
                if line:find("name=ngx_redis_ratelimit_strict", 1, true) then
                    cmds[#cmds + 1] = line:match("cmd=(%S+)")
                end
            end
            ngx.say(tostring(a), " ", tostring(b), " link:", table.concat(cmds, ","))
        }
    }
    location = /dir {
        redis_ratelimit ratelimit_circuit_breaker 20r/m;
        content_by_lua_block { ngx.say("dir") }
    }
--- request eval
["GET /dir?k=mixed", "GET /lua?k=mixed", map { "GET /dir?k=mixed" } 1..18]
--- response_body eval
["dir\n", "false false link:evalsha\n", ("dir\n") x 17, qr/429 Too Many Requests/]
--- error_code eval
[200, 200, (200) x 17, 429]
--- no_error_log
[alert]
[crit]



=== TEST 10: reset, then counted at once (a small limit, decided in Redis): the reset goes down the strict link, between the counts before it and after it
The reset's DEL goes down the worker's strict link (Redis's client list
shows it as the link's last command), so it is in Redis after the counts
before it and before those after: 2 of 2r/h, refused, reset, 2 again,
refused; Redis holds the 2 counted after the reset, and the directive
refuses.
--- init
my $s = time % 3600; sleep(3601 - $s) if $s > 3590;
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local lim = require("resty.redis_ratelimit").new("ratelimit_circuit_breaker", "2r/h")
            local out = {}
            local function count()
                out[#out + 1] = tostring((lim:is_rate_limited("again")))
            end
            local function redis(...)
                local args = { ... }
                local req = { "*" .. #args .. "\r\n" }
                for _, a in ipairs(args) do req[#req + 1] = "$" .. #a .. "\r\n" .. a .. "\r\n" end
                local sock = ngx.socket.tcp()
                assert(sock:connect("127.0.0.1", $TEST_NGINX_REDIS_PORT))
                sock:send(table.concat(req))
                local line = sock:receive("*l")
                local val = line
                if line == "$-1" then
                    val = "nil"
                elseif line:sub(1, 1) == "$" then
                    val = sock:receive(tonumber(line:sub(2)) + 2):sub(1, -3)
                end
                sock:close()
                return val
            end
            local function link_cmd()
                for line in redis("CLIENT", "LIST"):gmatch("[^\n]+") do
                    if line:find("name=ngx_redis_ratelimit_strict", 1, true) then
                        return line:match("cmd=(%S+)")
                    end
                end
            end
            count() count() count()
            ngx.sleep(0.2)
            assert(lim:reset("again"))
            ngx.sleep(0.2)
            out[#out + 1] = "link:" .. tostring(link_cmd())
            count() count() count()
            ngx.sleep(0.2)
            local key = "lua:{ratelimit_circuit_breaker:again}:3600:" .. math.floor(ngx.time() / 3600) * 3600
            ngx.say(table.concat(out, " "), " redis:", redis("GET", key))
        }
    }
    location = /dir {
        redis_ratelimit ratelimit_circuit_breaker 2r/h;
        content_by_lua_block { ngx.say("dir") }
    }
--- request eval
["GET /t", "GET /dir?k=again"]
--- response_body eval
["false false true link:del false false true redis:2\n", qr/429 Too Many Requests/]
--- error_code eval
[200, 429]
--- no_error_log
[alert]
[crit]



=== TEST 11: several ngx.location.capture of a limited location: the first is limited, as limit_req does
A request is decided once, with its subrequests (limit_req keeps the same
rule): three captures of a 1r/h location all pass, and only the first is
counted.
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local out = {}
            for i = 1, 3 do
                out[#out + 1] = ngx.location.capture("/dir?k=sub").status
            end
            ngx.say(table.concat(out, " "))
        }
    }
    location = /dir {
        redis_ratelimit local 1r/h;
        content_by_lua_block { ngx.say("dir") }
    }
--- request eval
["GET /t", "GET /dir?k=sub"]
--- response_body eval
["200 200 200\n", qr/429 Too Many Requests/]
--- error_code eval
[200, 429]
--- no_error_log
[alert]
[crit]



=== TEST 12: limit_req's bucket from Lua (cfg.burst, cfg.delay, cfg.nodelay): on a local zone and on the fleet's (Redis), with the delay it asks for
burst=1 nodelay at 1r/m: two pass, the third is limited (and told when
one passes again); burst=2 delay=1: the third passes with a wait of 60 s
(the excess above delay=1, drained at 1r/m).
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local out = {}
            for _, zone in ipairs({ "local", "ratelimit_circuit_breaker" }) do
                local lim = assert(ratelimit.new("b", "1r/m", { zone = zone, burst = 1, nodelay = true }))
                local k = zone .. ngx.var.arg_k
                for i = 1, 3 do
                    local limited, err, extra, delay = lim:is_rate_limited(k)
                    out[#out + 1] = tostring(limited) .. ":" .. tostring(delay or extra)
                end
                local d = assert(ratelimit.new("d", "1r/m", { zone = zone, burst = 2, delay = 1 }))
                for i = 1, 3 do
                    local limited, err, left, delay = d:is_rate_limited(k)
                    out[#out + 1] = tostring(limited) .. ":" .. tostring(delay)
                end
            end
            ngx.say(table.concat(out, " "))
        }
    }
--- request
GET /t?k=x
--- response_body
false:0 false:0 true:60 false:0 false:0 false:60 false:0 false:0 true:60 false:0 false:0 false:60
--- no_error_log
[error]



=== TEST 13: a bucket's options that are wrong raise
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local out = {}
            for _, cfg in ipairs({ { burst = -1 }, { burst = 2, delay = 3 },
                                   { burst = 2, delay = 1, nodelay = true }, { nodelay = "yes" } }) do
                cfg.zone = "local"
                local ok, err = pcall(ratelimit.new, "b", "1r/m", cfg)
                out[#out + 1] = tostring(ok) .. " " .. err:gsub("^.-: ", "")
            end
            ngx.say(table.concat(out, "\n"))
        }
    }
--- request
GET /t
--- response_body
false burst must be an integer from 0 to 1000000, got -1
false delay must be an integer from 0 to burst (2), got 3
false nodelay and delay together
false nodelay must be a boolean, got string
--- no_error_log
[error]



=== TEST 14: reset of a bucket's limiter forgets the bucket, on a local zone and on a Redis zone
burst=0 at 1r/h: the second call is limited; after reset the key passes
again, once.
--- http_config eval: $::HttpConfig
--- config
    location = /t {
        content_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local out = {}
            for _, zone in ipairs({ "local", "ratelimit_circuit_breaker" }) do
                local lim = assert(ratelimit.new("rb", "1r/h", { zone = zone, burst = 0 }))
                local k = zone .. ngx.var.arg_k
                out[#out + 1] = tostring(lim:is_rate_limited(k))
                out[#out + 1] = tostring(lim:is_rate_limited(k))
                assert(lim:reset(k))
                out[#out + 1] = tostring(lim:is_rate_limited(k))
                out[#out + 1] = tostring(lim:is_rate_limited(k))
            end
            ngx.say(table.concat(out, " "))
        }
    }
--- request
GET /t?k=r
--- response_body
false true false true false true false true
--- no_error_log
[error]
