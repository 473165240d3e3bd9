# The Lua API from the init phases: `new` in init_by_lua* (the master,
# while the configuration is read) keeps the zone's name and looks it up at
# the first call in a worker; a call to the limiter itself from the master
# answers nil, err (never a crash); after a reload that renumbers the zones,
# a limiter made in init_by_lua* still counts in its own zone.
use Test::Nginx::Socket 'no_plan';
use Cwd qw(cwd);

master_on();
workers(1);
use_hup();
no_shuffle();

our $pwd = cwd();
our $Path = qq{
    lua_package_path "$pwd/lua/?.lua;;";
};
our $Init = qq{
    lua_package_path "$pwd/lua/?.lua;;";
    init_by_lua_block {
        local rl = require "resty.redis_ratelimit"
        local lim, err = rl.new("local", "2r/d", { zone = "local" })
        INIT_NEW = tostring(lim ~= nil) .. "/" .. tostring(err)
        if lim then
            local limited, terr = lim:is_rate_limited("from-init")
            INIT_TAKE = tostring(limited) .. "/" .. tostring(terr)
        end
        INIT_LIM = lim
        -- what a request does with it: 429 when limited, 500 on an error
        function LIMIT()
            local limited, err = INIT_LIM:is_rate_limited(ngx.var.arg_k)
            if err then
                ngx.log(ngx.ERR, "is_rate_limited: ", err)
                return ngx.exit(500)
            end
            if limited then
                return ngx.exit(429)
            end
        end
    }
    init_worker_by_lua_block {
        local limited, err = INIT_LIM:is_rate_limited("from-init-worker")
        WORKER_TAKE = tostring(limited) .. "/" .. tostring(err)
    }
};

run_tests();

__DATA__

=== TEST 1: made in init_by_lua, used in a request; the master's own call is refused
--- http_config eval
$::Init . q{
    redis_ratelimit_zone $arg_k zone=local:1m;
    redis_ratelimit_zone $arg_k zone=other:1m;
}
--- config
    location = /t {
        access_by_lua_block { LIMIT() }
        content_by_lua_block {
            ngx.say(INIT_NEW, " | ", INIT_TAKE, " | ", WORKER_TAKE)
        }
    }
--- request eval
["GET /t?k=a1", "GET /t?k=a1", "GET /t?k=a1"]
--- error_code eval
[200, 200, 429]
--- response_body_like eval
[qr{^true/nil \| nil/zone "local" is not available here: use the limiter in a worker.* \| false/nil$},
 qr{^true/nil \| nil/zone "local" is not available here.* \| false/nil$},
 qr{429}]
--- no_error_log
[alert]
[crit]
[error]



=== TEST 2: after a reload that declares other zones first, it still counts in zone "local"
--- http_config eval
$::Init . q{
    redis_ratelimit_zone $arg_k zone=first:1m;
    redis_ratelimit_zone $arg_k zone=other:1m;
    redis_ratelimit_zone $arg_k zone=local:1m;
}
--- config
    location = /lua {
        access_by_lua_block { LIMIT() }
        content_by_lua_block { ngx.say("lua") }
    }
    location = /dir {
        redis_ratelimit local 2r/d;
        content_by_lua_block { ngx.say("dir") }
    }
--- request eval
["GET /lua?k=b1", "GET /dir?k=b1", "GET /dir?k=b1", "GET /dir?k=a1"]
--- error_code eval
[200, 200, 429, 429]
--- no_error_log
[alert]
[crit]
is_rate_limited:



=== TEST 3: counts made in init_worker_by_lua* reach Redis (this module's thread starts at the first call, before its own init_process when Lua's module is loaded first)
--- http_config eval
$::Path . q{
    redis_ratelimit_zone $arg_k zone=rz:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT hold=0 prefix=initworker:;
    init_worker_by_lua_block {
        local rl = require "resty.redis_ratelimit"
        local lim = rl.new("iw", "100r/m", { zone = "rz" })
        local key = "k" .. ngx.worker.pid()
        for _ = 1, 3 do
            lim:is_rate_limited(key)
        end
    }
}
--- config
    location = /t {
        content_by_lua_block {
            ngx.sleep(0.5)
            local sock = ngx.socket.tcp()
            assert(sock:connect("127.0.0.1", tonumber(ngx.var.arg_port)))
            local script = "local s = 0 for _, k in ipairs(redis.call('KEYS', ARGV[1])) do s = s + tonumber(redis.call('GET', k)) end return s"
            local pattern = "initworker:{iw:k" .. ngx.worker.pid() .. "}:*"
            local cmd = { "EVAL", script, "0", pattern }
            local req = { "*" .. #cmd .. "\r\n" }
            for _, w in ipairs(cmd) do
                req[#req + 1] = "$" .. #w .. "\r\n" .. w .. "\r\n"
            end
            assert(sock:send(table.concat(req)))
            local line = assert(sock:receive("*l"))
            ngx.say("in Redis: ", line)
        }
    }
--- request eval
"GET /t?port=$ENV{TEST_NGINX_REDIS_PORT}"
--- response_body
in Redis: :3
--- no_error_log
[alert]
[crit]
