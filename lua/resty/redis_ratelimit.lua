-- resty.redis_ratelimit: the ngx_http_redis_ratelimit module's limiter, from
-- Lua (OpenResty, or any nginx with lua-nginx-module).
--
--   local ratelimit = require "resty.redis_ratelimit"
--   local lim, err = ratelimit.new("login", "100r/s", { zone = "ratelimit_circuit_breaker" })
--   local limited, err = lim:is_rate_limited(ngx.var.remote_addr)
--   local rate, err    = lim:measure(key)
--   local ok, err      = lim:reset(key)
--
-- The zone is declared in nginx.conf with `redis_ratelimit_zone`; its key
-- expression is not used here (callers pass their own key). The namespace
-- takes the zone name's place in the Redis keys (`rl:{<namespace>:<key>}:P:w`)
-- and in the zone's table: a Lua limiter whose namespace is the zone's name
-- shares its counts with the `redis_ratelimit` directive on the same key.
-- Errors come back as nil, "message"; nothing here raises a Lua error.

local ffi = require "ffi"

local C = ffi.C
local tostring = tostring
local tonumber = tonumber
local type = type
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
int ngx_http_redis_ratelimit_reset(int zone, const unsigned char *ns, size_t ns_len,
                                   uint32_t period, const unsigned char *key, size_t key_len);
]])

local DEFAULT_ZONE = "ratelimit_circuit_breaker"
local TAKE_IF_ALLOWED = 0
local TAKE_ALWAYS = 1

-- one set of out-parameters per worker (Lua runs on the worker's thread)
local u32_a = ffi.new("uint32_t[1]")
local u32_b = ffi.new("uint32_t[1]")
local est = ffi.new("double[1]")
local rem = ffi.new("uint32_t[1]")
local retry = ffi.new("uint64_t[1]")

local _M = { _VERSION = "0.1.0" }
local mt = { __index = _M }

local ERR_ZONE = -1
local ERR_NOT_READY = -3

local function errmsg(rc, zone)
    if rc == ERR_ZONE then
        return "zone \"" .. zone .. "\" is not available"
    end
    if rc == ERR_NOT_READY then
        return "zone \"" .. zone .. "\" is not available here: use the limiter in a worker"
            .. " (init_worker_by_lua*, a request, a timer), not in init_by_lua*"
    end
    return "invalid arguments"
end

local function check_key(key)
    local t = type(key)
    if t == "number" then
        return tostring(key)
    end
    if t ~= "string" then
        return nil, "key must be a string"
    end
    if key == "" then
        return nil, "key must not be empty"
    end
    return key
end

function _M.new(namespace, rate, cfg)
    if type(namespace) ~= "string" or namespace == "" then
        return nil, "namespace must be a non-empty string"
    end
    if type(rate) ~= "string" then
        return nil, "rate must be a string such as \"100r/s\""
    end
    if cfg ~= nil and type(cfg) ~= "table" then
        return nil, "cfg must be a table"
    end
    local zone = (cfg and (cfg.zone or cfg.circuit_breaker_dict_name)) or DEFAULT_ZONE
    if type(zone) ~= "string" then
        return nil, "cfg.zone must be a string"
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

local MAX_COST = 1000000

local function take(self, key, how, cost)
    local k, err = check_key(key)
    if not k then
        return nil, err
    end
    if cost == nil then
        cost = 1
    elseif type(cost) ~= "number" or cost < 0 or cost > MAX_COST or cost % 1 ~= 0 then
        return nil, "cost must be an integer from 0 to " .. MAX_COST
    end
    local zi, zerr = zone_index(self)
    if not zi then
        return nil, zerr
    end
    local ns = self.namespace
    local rc = C.ngx_http_redis_ratelimit_take(zi, ns, #ns, self.limit,
                                               self.period, k, #k, how, cost, est, rem,
                                               retry)
    if rc < 0 then
        return nil, errmsg(rc, self.zone)
    end
    return rc
end

-- Returns true when the request is over the limit (and does not count it),
-- false when it is allowed (and counts it); nil, err on error. A third value
-- is the number of seconds until a request is allowed again (when limited)
-- or the number of requests left (when allowed). `cost` (default 1, 0 to
-- 1000000; 0 checks without counting): what the request weighs; it is
-- allowed iff estimate + cost - 1 < limit, and then counts `cost`.
function _M.is_rate_limited(self, key, cost)
    local rc, err = take(self, key, TAKE_IF_ALLOWED, cost)
    if not rc then
        return nil, err
    end
    if rc == 1 then
        return true, nil, tonumber(retry[0]) / 1000
    end
    return false, nil, tonumber(rem[0])
end

-- Counts the request (weighing `cost`, default 1) whatever the estimate and
-- returns the estimate, this request included.
function _M.measure(self, key, cost)
    local rc, err = take(self, key, TAKE_ALWAYS, cost)
    if not rc then
        return nil, err
    end
    return tonumber(est[0])
end

-- Forgets the key: here at once, in Redis as soon as the background thread
-- sends the DEL (a few milliseconds).
function _M.reset(self, key)
    local k, err = check_key(key)
    if not k then
        return nil, err
    end
    local zi, zerr = zone_index(self)
    if not zi then
        return nil, zerr
    end
    local ns = self.namespace
    local rc = C.ngx_http_redis_ratelimit_reset(zi, ns, #ns, self.period, k, #k)
    if rc < 0 then
        return nil, errmsg(rc, self.zone)
    end
    return true
end

return _M
