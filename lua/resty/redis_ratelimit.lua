-- resty.redis_ratelimit: the ngx_http_redis_ratelimit module's limiter, from
-- Lua (OpenResty, or any nginx with lua-nginx-module). A drop-in for the
-- background limiter of the OpenResty library it replaces
-- ("resty.redis.ratelimiter.background"): code written for that library
-- limits unchanged once its `require` names this module.
--
--   local ratelimit = require "resty.redis_ratelimit"
--
--   -- new(namespace, rate, cfg): cfg is a table, a zone name, or nil
--   local lim, err = ratelimit.new("login", "100r/s")
--   local lim, err = ratelimit.new("login", "100r/s", { zone = "login_zone" })
--   local lim, err = ratelimit.new("login", "100r/s", { circuit_breaker_dict_name = "login_zone" })
--   local lim, err = ratelimit.new("login", "100r/s", { host = "127.0.0.1", port = 6379, timeout = 100 })
--   local lim, err = ratelimit.new("login", "100r/s", "login_zone", redis_cfg)   -- the older form
--
--   -- limit_req's bucket: burst = n, and delay = n or nodelay = true
--   local lim, err = ratelimit.new("api", "10r/s", { zone = "api_zone", burst = 20, nodelay = true })
--
--   local limited, err, extra = lim:is_rate_limited(key)
--   local limited, err, extra = lim:is_rate_limited(key, ngx.req.start_time())
--   local limited, err, extra = lim:is_rate_limited(key, nil, { cost = 5 })
--   local estimate, err       = lim:measure(key)     -- a bucket's: its excess after it
--   local estimate, err       = lim:measure(key, nil, { cost = 5 })
--   local ok, err             = lim:reset(key)
--
-- The zone is declared in nginx.conf with `redis_ratelimit_zone`; it holds
-- the counters and the breaker, and its `redis=` parameter says where Redis
-- is. cfg names it (`cfg.zone`, else `cfg.circuit_breaker_dict_name`, or a
-- string cfg; default "ratelimit_circuit_breaker"). The other keys the older
-- library read from cfg (host, port, timeout, dbid, connection_pool_size,
-- idle_keepalive_ms, expire_after_seconds), and its fourth argument, are
-- accepted and not used: Redis is configured on the zone.
--
-- A bucket (cfg.burst, cfg.delay, cfg.nodelay, as `redis_ratelimit ...
-- burst=N [nodelay | delay=N]` reads them: any of them makes one, burst 0
-- unless given) is limit_req's leaky bucket instead of the sliding window.
-- is_rate_limited then returns a fourth value when allowed: the seconds
-- the request is to wait (limit_req's delay; 0 with nodelay or below
-- delay=); the caller sleeps (ngx.sleep), as lua-resty-limit-traffic's
-- callers do. On a zone with Redis the bucket is the fleet's, decided on
-- this node's view of it (a Lua call never waits for Redis).
--
-- The zone's key expression is not used here: callers pass their own key.
-- The namespace takes the zone name's place in the Redis keys
-- (`rl:{<namespace>:<key>}:P:w`) and in the zone's table: a Lua limiter
-- whose namespace is the zone's name shares its counts with the
-- `redis_ratelimit` directive on the same key.
--
-- Arguments:
--   key       a string or a number (a number counts as its tostring()).
--             The empty string is a key like any other, as in the older
--             library: every call with "" shares one count (so a missing
--             client value written `ngx.var.http_x_token or ""` is limited
--             as one client, never let through and never a 500). It is kept
--             as the one-byte key "\0" (the two share a count).
--   2nd       the request's time (`ngx.req.start_time()`, seconds since the
--             epoch) or nil. Accepted and not used: the window runs on the
--             clock. A number below 1e9 is refused: it is not a time, and
--             most likely a cost written in the place the older library
--             gave the time.
--   opts      nil or a table: { cost = n }. `cost` (an integer 0 to
--             1000000, default 1) is what the request weighs: it is allowed
--             iff estimate + cost - 1 < limit (a cost of 0: iff
--             estimate < limit), and then counts `cost`; 0 checks without
--             counting. Other option names are refused.
--
-- Errors. A wrong argument is a programming error and raises a Lua error
-- naming it (the request fails with 500 and an error-log line): a key that
-- is not a string or a number, a 2nd argument that is not nil or a time, an
-- opts that is not a table, an unknown option, a cost that is not an
-- integer 0 to 1000000, a namespace that is not a non-empty string, a rate
-- or a cfg of the wrong type, a method called with `.` instead of `:`.
-- None of them can come back as "not limited". Conditions of the world come
-- back as nil, "message" and never raise: a rate string that does not parse
-- ("abc"), a namespace over 128 bytes, an unknown zone, a zone not
-- available here (the master, a module not loaded). Redis trouble does not
-- reach the caller: the zone's `on_error=` policy decides, as for the
-- directive.
--
-- A limiter may be made in init_by_lua* (as a global, as the older
-- library's README does) and used in requests: the zone is looked up at its
-- first call in a worker. A call from init_by_lua* itself answers nil, err.

local ffi = require "ffi"

local C = ffi.C
local tostring = tostring
local tonumber = tonumber
local type = type
local pairs = pairs
local error = error
local getmetatable = getmetatable
local setmetatable = setmetatable

pcall(ffi.cdef, [[
int ngx_http_redis_ratelimit_zone_index(const unsigned char *name, size_t len);
int ngx_http_redis_ratelimit_parse_rate(const unsigned char *s, size_t len,
                                        uint32_t *limit, uint32_t *period);
int ngx_http_redis_ratelimit_take(int zone, const unsigned char *ns, size_t ns_len,
                                  uint32_t limit, uint32_t period,
                                  const unsigned char *key, size_t key_len, int take,
                                  uint32_t cost, double *estimate, uint32_t *remaining,
                                  uint64_t *retry_ms);
typedef struct {
    double excess;
    uint32_t remaining;
    uint64_t retry_ms;
    uint64_t delay_ms;
} ngx_http_redis_ratelimit_bucket_answer_t;
int ngx_http_redis_ratelimit_take_bucket(int zone, const unsigned char *ns, size_t ns_len,
                                         uint32_t limit, uint32_t period,
                                         const unsigned char *key, size_t key_len, int take,
                                         uint32_t cost, uint32_t burst, uint32_t delay,
                                         ngx_http_redis_ratelimit_bucket_answer_t *out);
int ngx_http_redis_ratelimit_reset(int zone, const unsigned char *ns, size_t ns_len,
                                   uint32_t period, const unsigned char *key, size_t key_len);
int ngx_http_redis_ratelimit_reset_bucket(int zone, const unsigned char *ns, size_t ns_len,
                                          uint32_t limit, uint32_t period,
                                          const unsigned char *key, size_t key_len);
int ngx_http_redis_ratelimit_control(int zone, const unsigned char *key, size_t key_len,
                                     int op, uint32_t limit, uint32_t period, uint64_t ttl_ms);
typedef struct {
    uint64_t blocked_ms;
    uint64_t override_ms;
    uint32_t limit;
    uint32_t period;
} ngx_http_redis_ratelimit_controls_t;
int ngx_http_redis_ratelimit_inspect(int zone, const unsigned char *key, size_t key_len,
                                     ngx_http_redis_ratelimit_controls_t *out);
]])

local DEFAULT_ZONE = "ratelimit_circuit_breaker"
local TAKE_IF_ALLOWED = 0
local TAKE_ALWAYS = 1
local MAX_COST = 1000000
local MAX_NAMESPACE_BYTES = 128
-- the empty key, as the module stores it (it refuses empty keys)
local EMPTY_KEY = "\0"
-- the smallest 2nd argument taken for a time: 2001-09-09, seconds
local MIN_TIME = 1e9

-- one set of out-parameters per worker (Lua runs on the worker's thread)
local u32_a = ffi.new("uint32_t[1]")
local u32_b = ffi.new("uint32_t[1]")
local est = ffi.new("double[1]")
local rem = ffi.new("uint32_t[1]")
local retry = ffi.new("uint64_t[1]")
local bucket_answer = ffi.new("ngx_http_redis_ratelimit_bucket_answer_t")
-- `delay` for nodelay (the module's NODELAY)
local NODELAY = 4294967295
local MAX_BURST = 1000000

local _M = { _VERSION = "0.2.0" }
local mt = { __index = _M }

local ERR_ZONE = -1
local ERR_NOT_READY = -3
local ERR_FULL = -4

local function errmsg(rc, zone)
    if rc == ERR_ZONE then
        return "zone \"" .. zone .. "\" is not available"
    end
    if rc == ERR_FULL then
        return "zone \"" .. zone .. "\" holds no more blocked or overridden keys"
    end
    if rc == ERR_NOT_READY then
        return "zone \"" .. zone .. "\" is not available here: use the limiter in a worker"
            .. " (init_worker_by_lua*, a request, a timer), not in init_by_lua*"
    end
    return "invalid arguments"
end

-- Each check returns what the module is given, or nil and the message of
-- the Lua error its caller raises (at level 2: the caller's caller, the
-- user's line).

local function check_self(self, fn)
    if type(self) ~= "table" or getmetatable(self) ~= mt then
        return nil, fn .. ": call it as lim:" .. fn .. "(...), with a colon"
    end
    return self
end

local function check_key(key, fn)
    local t = type(key)
    if t == "string" then
        if key == "" then
            return EMPTY_KEY
        end
        return key
    end
    if t == "number" then
        return tostring(key)
    end
    return nil, fn .. ": key must be a string or a number, got " .. t
end

local function check_time(when, fn)
    if when == nil then
        return true
    end
    if type(when) ~= "number" then
        return nil, fn .. ": the 2nd argument is the request's time (ngx.req.start_time())"
            .. " or nil, got " .. type(when)
    end
    if not (when >= MIN_TIME) then
        return nil, fn .. ": the 2nd argument is the request's time (ngx.req.start_time()),"
            .. " not " .. tostring(when) .. "; a cost goes in the options: "
            .. fn .. "(key, nil, { cost = n })"
    end
    return true
end

local function check_opts(opts, fn)
    if opts == nil then
        return 1
    end
    if type(opts) ~= "table" then
        return nil, fn .. ": opts must be a table such as { cost = 5 }, got " .. type(opts)
    end
    for name in pairs(opts) do
        if name ~= "cost" then
            return nil, fn .. ": unknown option " .. tostring(name) .. " (known: cost)"
        end
    end
    local cost = opts.cost
    if cost == nil then
        return 1
    end
    if type(cost) ~= "number" or not (cost >= 0 and cost <= MAX_COST) or cost % 1 ~= 0 then
        return nil, fn .. ": cost must be an integer from 0 to " .. MAX_COST
            .. ", got " .. tostring(cost)
    end
    return cost
end

-- new(namespace, rate [, cfg [, redis_cfg]])
function _M.new(namespace, rate, cfg, redis_cfg)
    if type(namespace) ~= "string" or namespace == "" then
        error("new: namespace must be a non-empty string, got "
              .. (namespace == "" and "\"\"" or type(namespace)), 2)
    end
    if type(rate) ~= "string" then
        error("new: rate must be a string such as \"100r/s\", got " .. type(rate), 2)
    end
    local zone
    local tcfg = type(cfg)
    if tcfg == "string" then
        zone = cfg
    elseif tcfg == "table" then
        zone = cfg.zone
        if zone == nil then
            zone = cfg.circuit_breaker_dict_name
        end
    elseif cfg ~= nil then
        error("new: cfg must be a table or a zone name, got " .. tcfg, 2)
    end
    if zone == nil then
        zone = DEFAULT_ZONE
    elseif type(zone) ~= "string" then
        error("new: the zone name must be a string, got " .. type(zone), 2)
    end
    local burst, delay
    if tcfg == "table" and (cfg.burst ~= nil or cfg.delay ~= nil or cfg.nodelay ~= nil) then
        burst = cfg.burst or 0
        if type(burst) ~= "number" or burst % 1 ~= 0 or burst < 0 or burst > MAX_BURST then
            error("new: burst must be an integer from 0 to " .. MAX_BURST .. ", got "
                  .. tostring(cfg.burst), 2)
        end
        if cfg.nodelay ~= nil and type(cfg.nodelay) ~= "boolean" then
            error("new: nodelay must be a boolean, got " .. type(cfg.nodelay), 2)
        end
        if cfg.nodelay and cfg.delay ~= nil then
            error("new: nodelay and delay together", 2)
        end
        if cfg.nodelay then
            delay = NODELAY
        else
            delay = cfg.delay or 0
            if type(delay) ~= "number" or delay % 1 ~= 0 or delay < 0 or delay > burst then
                error("new: delay must be an integer from 0 to burst (" .. burst .. "), got "
                      .. tostring(cfg.delay), 2)
            end
        end
    end
    if redis_cfg ~= nil and type(redis_cfg) ~= "table" then
        error("new: the 4th argument (Redis settings, not used) must be a table, got "
              .. type(redis_cfg), 2)
    end

    if #namespace > MAX_NAMESPACE_BYTES then
        return nil, "namespace longer than " .. MAX_NAMESPACE_BYTES .. " bytes"
    end

    local ok, idx = pcall(C.ngx_http_redis_ratelimit_zone_index, zone, #zone)
    if not ok then
        return nil, "ngx_http_redis_ratelimit_module is not loaded (load_module it in nginx.conf)"
    end
    if idx == ERR_NOT_READY then
        -- init_by_lua*: the zones of this configuration are not set up yet;
        -- the zone is looked up at the first call, in a worker
        idx = nil
    elseif idx < 0 then
        return nil, "unknown zone \"" .. zone .. "\": declare it with redis_ratelimit_zone"
    end

    if C.ngx_http_redis_ratelimit_parse_rate(rate, #rate, u32_a, u32_b) ~= 0 then
        return nil, "invalid rate \"" .. rate .. "\": N r/s, r/m, r/h or r/d expected (10r/s)"
    end

    return setmetatable({
        zone = zone,
        zone_index = idx,
        namespace = namespace,
        rate = rate,
        limit = u32_a[0],
        period = u32_b[0],
        burst = burst,
        delay = delay,
    }, mt)
end

-- The zone's index in this worker's configuration, looked up once.
local function zone_index(self)
    local idx = self.zone_index
    if idx then
        return idx
    end
    idx = C.ngx_http_redis_ratelimit_zone_index(self.zone, #self.zone)
    if idx < 0 then
        return nil, errmsg(idx, self.zone)
    end
    self.zone_index = idx
    return idx
end

local function take(self, k, how, cost)
    local zi, zerr = zone_index(self)
    if not zi then
        return nil, zerr
    end
    local ns = self.namespace
    local rc
    if self.burst then
        rc = C.ngx_http_redis_ratelimit_take_bucket(zi, ns, #ns, self.limit, self.period, k, #k,
                                                    how, cost, self.burst, self.delay,
                                                    bucket_answer)
        est[0] = bucket_answer.excess
        rem[0] = bucket_answer.remaining
        retry[0] = bucket_answer.retry_ms
    else
        rc = C.ngx_http_redis_ratelimit_take(zi, ns, #ns, self.limit,
                                             self.period, k, #k, how, cost, est, rem,
                                             retry)
    end
    if rc < 0 then
        return nil, errmsg(rc, self.zone)
    end
    return rc
end

-- The arguments of is_rate_limited and measure, checked: the key as stored
-- and the cost, or the message of the error to raise.
local function check_call(self, key, when, opts, fn)
    local ok, msg = check_self(self, fn)
    if not ok then
        return nil, msg
    end
    local k
    k, msg = check_key(key, fn)
    if not k then
        return nil, msg
    end
    ok, msg = check_time(when, fn)
    if not ok then
        return nil, msg
    end
    local cost
    cost, msg = check_opts(opts, fn)
    if not cost then
        return nil, msg
    end
    return k, cost
end

-- lim:is_rate_limited(key [, request_time [, opts]])
-- Returns true when the request is over the limit (and does not count it),
-- false when it is allowed (and counts it); nil, err when the zone cannot
-- be used. A third value is the number of seconds until a request is
-- allowed again (when limited) or the number of requests left (when
-- allowed). A bucket's limiter adds a fourth when allowed: the seconds the
-- request is to wait first (its delay; 0: none).
function _M.is_rate_limited(self, key, when, opts)
    local k, cost = check_call(self, key, when, opts, "is_rate_limited")
    if not k then
        error(cost, 2) -- the message, in cost's place
    end
    local rc, err = take(self, k, TAKE_IF_ALLOWED, cost)
    if not rc then
        return nil, err
    end
    if rc == 1 then
        return true, nil, tonumber(retry[0]) / 1000
    end
    if self.burst then
        return false, nil, tonumber(rem[0]), tonumber(bucket_answer.delay_ms) / 1000
    end
    return false, nil, tonumber(rem[0])
end

-- lim:measure(key [, request_time [, opts]])
-- Counts the request (weighing opts.cost, default 1) whatever the estimate
-- and returns the estimate, this request included; nil, err when the zone
-- cannot be used.
function _M.measure(self, key, when, opts)
    local k, cost = check_call(self, key, when, opts, "measure")
    if not k then
        error(cost, 2) -- the message, in cost's place
    end
    local rc, err = take(self, k, TAKE_ALWAYS, cost)
    if not rc then
        return nil, err
    end
    return tonumber(est[0])
end

-- lim:reset(key)
-- Forgets the key: here at once, in Redis as soon as the background thread
-- sends the DEL (a few milliseconds). true, or nil, err when the zone
-- cannot be used.
function _M.reset(self, key)
    local ok, msg = check_self(self, "reset")
    if not ok then
        error(msg, 2)
    end
    local k
    k, msg = check_key(key, "reset")
    if not k then
        error(msg, 2)
    end
    local zi, zerr = zone_index(self)
    if not zi then
        return nil, zerr
    end
    local ns = self.namespace
    local rc
    if self.burst then
        rc = C.ngx_http_redis_ratelimit_reset_bucket(zi, ns, #ns, self.limit, self.period, k, #k)
    else
        rc = C.ngx_http_redis_ratelimit_reset(zi, ns, #ns, self.period, k, #k)
    end
    if rc < 0 then
        return nil, errmsg(rc, self.zone)
    end
    return true
end

-- A zone's controls: keys blocked, or limited at another rate, for a
-- while, on every node of a zone with Redis (the same as the API's,
-- `redis_ratelimit_api`). Keys are the zone's keys: what its
-- `redis_ratelimit_zone` key gives, or what Lua callers of the zone pass.

local CONTROL_BLOCK, CONTROL_UNBLOCK, CONTROL_OVERRIDE, CONTROL_UNOVERRIDE = 1, 2, 3, 4
local MAX_TTL = 30 * 86400
local controls = ffi.new("ngx_http_redis_ratelimit_controls_t")

local function check_zone(zone, fn, level)
    if type(zone) ~= "string" or zone == "" then
        error(fn .. ": zone must be a zone's name, got " .. type(zone), level + 1)
    end
    local idx = C.ngx_http_redis_ratelimit_zone_index(zone, #zone)
    if idx < 0 then
        return nil, errmsg(idx, zone)
    end
    return idx
end

local function check_ttl(ttl, fn)
    if type(ttl) ~= "number" or not (ttl >= 1 and ttl <= MAX_TTL) then
        error(fn .. ": ttl must be a number of seconds from 1 to " .. MAX_TTL
              .. ", got " .. tostring(ttl), 3)
    end
    return math.floor(ttl * 1000)
end

local function control(zone, key, op, limit, period, ttl_ms, fn)
    local k, msg = check_key(key, fn)
    if not k then
        error(msg, 3)
    end
    local zi, err = check_zone(zone, fn, 3)
    if not zi then
        return nil, err
    end
    local rc = C.ngx_http_redis_ratelimit_control(zi, k, #k, op, limit, period, ttl_ms)
    if rc < 0 then
        return nil, errmsg(rc, zone)
    end
    return rc == 0
end

-- what a control's call returns: the answer, or nil and the message
local function answer(ok, err)
    if ok == nil then
        return nil, err
    end
    return ok
end

-- ratelimit.block(zone, key, ttl): every limit of the zone rejects the key
-- for ttl seconds. true, or nil, err.
function _M.block(zone, key, ttl)
    -- (no tail calls: an error names the caller's line)
    local ok, err = control(zone, key, CONTROL_BLOCK, 0, 0, check_ttl(ttl, "block"), "block")
    return answer(ok, err)
end

-- ratelimit.unblock(zone, key): lifts the key's block. true, false when it
-- had none, or nil, err.
function _M.unblock(zone, key)
    local ok, err = control(zone, key, CONTROL_UNBLOCK, 0, 0, 0, "unblock")
    return answer(ok, err)
end

-- ratelimit.override(zone, key, rate, ttl): the zone's rate limits take
-- `rate` ("1000r/m") for the key for ttl seconds; with rate nil, lifts the
-- override (true, or false when it had none). nil, err on failure.
function _M.override(zone, key, rate, ttl)
    local ok, err
    if rate == nil then
        ok, err = control(zone, key, CONTROL_UNOVERRIDE, 0, 0, 0, "override")
        return answer(ok, err)
    end
    if type(rate) ~= "string"
        or C.ngx_http_redis_ratelimit_parse_rate(rate, #rate, u32_a, u32_b) ~= 0 then
        error("override: rate must be a rate such as \"1000r/m\" or nil, got "
              .. tostring(rate), 2)
    end
    ok, err = control(zone, key, CONTROL_OVERRIDE, u32_a[0], u32_b[0],
                      check_ttl(ttl, "override"), "override")
    return answer(ok, err)
end

local UNITS = { [1] = "s", [60] = "m", [3600] = "h", [86400] = "d" }

-- ratelimit.inspect(zone, key): the key's controls as this node knows them,
-- { blocked = seconds left or nil, override = { rate = "1000r/m",
-- ttl = seconds left } or nil }; nil, err when the zone cannot be used.
function _M.inspect(zone, key)
    local k, msg = check_key(key, "inspect")
    if not k then
        error(msg, 2)
    end
    local zi, err = check_zone(zone, "inspect", 2)
    if not zi then
        return nil, err
    end
    local rc = C.ngx_http_redis_ratelimit_inspect(zi, k, #k, controls)
    if rc < 0 then
        return nil, errmsg(rc, zone)
    end
    local out = {}
    if controls.blocked_ms > 0 then
        out.blocked = tonumber(controls.blocked_ms) / 1000
    end
    if controls.override_ms > 0 then
        out.override = {
            rate = tonumber(controls.limit) .. "r/" .. UNITS[tonumber(controls.period)],
            ttl = tonumber(controls.override_ms) / 1000,
        }
    end
    return out
end

return _M
