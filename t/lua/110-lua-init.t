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
