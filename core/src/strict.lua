-- ngx_http_redis_ratelimit strict mode: one call decides several keys
-- (groups). KEYS: per group its current window's counter, then the
-- previous window's. ARGV[1]: 1 when a request has a deadline (TIME is
-- read once, before any write); then per group: limit, period (ms), time
-- into the window (ms), TTL (s), n, and n times cost, deadline.
-- Answers per group: cur, prev, and a flag per request. A group that
-- fails after another group counted answers cur -1 (it counted nothing).
local now
if ARGV[1] == '1' then
  if redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = t[1] * 1000 + math.floor(t[2] / 1000)
end
local out = {}
local j = 0
local a = 2
local wrote = false
for g = 1, #KEYS, 2 do
  local n = tonumber(ARGV[a + 4])
  local both = redis.call('MGET', KEYS[g], KEYS[g + 1])
  local cur = tonumber(both[1] or 0)
  local prev = tonumber(both[2] or 0)
  local err
  if not cur or not prev or cur < 0 or prev < 0 or cur % 1 ~= 0 or prev % 1 ~= 0 then
    err = redis.error_reply('ERR redis_ratelimit: the counter is not an integer')
  else
    local p = tonumber(ARGV[a + 1])
    local e = tonumber(ARGV[a + 2])
    if e > p then e = p end
    local weighted = prev * (p - e)
    local cap = tonumber(ARGV[a]) * p
    local at = j + 2
    local added = 0
    for i = a + 5, a + 3 + 2 * n, 2 do
      local c = tonumber(ARGV[i])
      local dl = tonumber(ARGV[i + 1])
      local k = c
      if k < 1 then k = 1 end
      at = at + 1
      if dl < 0 then
        added = added + c
        out[at] = 1
      elseif dl > 0 and now and now > dl then
        out[at] = 2
      elseif weighted + (cur + added + k - 1) * p < cap then
        added = added + c
        out[at] = 1
      else
        out[at] = 0
      end
    end
    if added > 0 then
      local r = redis.pcall('INCRBY', KEYS[g], added)
      if type(r) == 'table' then
        err = r
      else
        if r == added then
          redis.call('EXPIRE', KEYS[g], ARGV[a + 3])
        end
        cur = r
        wrote = true
      end
    end
  end
  if err then
    if not wrote then
      return err
    end
    cur = -1
    for i = j + 3, j + 2 + n do
      out[i] = 0
    end
  end
  out[j + 1] = cur
  out[j + 2] = prev or 0
  j = j + 2 + n
  a = a + 5 + 2 * n
end
return out
