-- ngx_http_redis_ratelimit strict mode: one call decides several keys
-- (groups). KEYS: per group its current window's counter, then the
-- previous window's. ARGV[1]: 1 when a request has a deadline (TIME is
-- read once, before any write); then per group: time into the window
-- (ms), limit, period (ms), TTL (s), or '=' for the four of the group
-- before; then n, and n times cost, deadline.
-- A bucket's group (limit_req's burst=) names its bucket key twice; its
-- first argument is BUCKET plus its burst. Its level is kept as
-- 'excess:ms' (thousandths of a request, and Redis's clock when it was
-- written), drains at the rate, and lives until it is empty (its TTL).
-- It answers the excess after its requests plus 1000 (an idle key's level
-- is one request below empty) in place of cur, and 0 for prev. A counted
-- request (deadline -1) of a bucket is what a node owes it: its cost is
-- thousandths of a request, added as they are.
-- A concurrency limit's group (redis_ratelimit_conn) names the key's hash
-- of leases twice; its first argument is CONN, then the number, the lease
-- (ms) and the holder (the field it writes). Each field is a holder's
-- 'slots:expiry' (Redis's clock); a lease past its expiry is dropped (its
-- holder stopped renewing it: gone, frozen or cut off). Its counted
-- requests are the holder's slots in use, then the slots it asks to hold;
-- it is granted what it asks within the number less the other holders'
-- (never less than it uses). It answers, each packed as low + high *
-- SPLIT, the others' slots and their holders in place of cur, and the
-- slots granted and the leases dropped in place of prev.
-- Answers per group: cur, prev, and a flag per request. A group that
-- fails (a counter that is not an integer, an INCRBY refused) counts
-- nothing and answers cur -1, and the others go on; a call of one group
-- answers the error itself.
-- One MGET reads every group's windows (in a cluster a call holds one
-- group, whose two windows share a slot): one command a call, not one a
-- group. A counter that an earlier group of the call wrote (two limits of
-- one key, or a window that is a later group's previous one) is read as
-- that group left it.
-- The groups of a call mostly share a limit, a period and a window, which
-- are then converted once; most costs and counts are 1, compared as
-- strings before they are converted (Lua keeps one copy of each string, so
-- that is a pointer comparison, and strtod is the dearest step of a call).
local now
if ARGV[1] == '1' then
  if redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = t[1] * 1000 + math.floor(t[2] / 1000)
end
local out = {}
local j = 0
local a = 2
local p, left, cap, ttl, limit, burst, conn
local BUCKET = 1099511627776
local CONN = 2199023255552
local SPLIT = 1048576
local counts = redis.call('MGET', unpack(KEYS))
local wrote = {}
for g = 1, #KEYS, 2 do
  if ARGV[a] == '=' then
    -- one argument where the four were: n at a + 1
    a = a - 3
  else
    p = tonumber(ARGV[a + 2])
    limit = tonumber(ARGV[a + 1])
    local first = tonumber(ARGV[a])
    conn = nil
    burst = nil
    if first >= CONN then
      conn = ARGV[a + 3]
    elseif first >= BUCKET then
      burst = (first - BUCKET) * 1000
    else
      left = p - first
      if left < 0 then left = 0 end
      cap = limit * p
      ttl = ARGV[a + 3]
    end
  end
  local n = ARGV[a + 4]
  if n == '1' then n = 1 else n = tonumber(n) end
  local cur, prev, err
  if conn then
    local h = redis.pcall('HGETALL', KEYS[g])
    if h.err then
      err = h
    else
      local others, holders, expired = 0, 0, 0
      for i = 1, #h, 2 do
        if h[i] ~= conn then
          local s, x = string.match(h[i + 1], '^(%d+):(%d+)$')
          if s and tonumber(x) > now then
            others = others + tonumber(s)
            holders = holders + 1
          else
            redis.call('HDEL', KEYS[g], h[i])
            expired = expired + 1
          end
        end
      end
      local mine, want = nil, 0
      local at = j + 2
      for i = a + 5, a + 3 + 2 * n, 2 do
        local c = tonumber(ARGV[i])
        local dl = tonumber(ARGV[i + 1])
        at = at + 1
        if dl < 0 then
          if mine == nil then mine = c else want = c end
          out[at] = 1
        elseif dl > 0 and now > dl then
          out[at] = 2
        elseif others + (mine or 0) + c <= limit then
          mine = (mine or 0) + c
          out[at] = 1
        else
          out[at] = 0
        end
      end
      mine = mine or 0
      local r = want
      if others + r > limit then r = limit - others end
      if r < mine then r = mine end
      if r > 0 then
        redis.call('HSET', KEYS[g], conn, string.format('%d:%d', r, now + p))
        if redis.call('PTTL', KEYS[g]) < p then redis.call('PEXPIRE', KEYS[g], p) end
      else
        redis.call('HDEL', KEYS[g], conn)
      end
      if others >= SPLIT then others = SPLIT - 1 end
      if expired >= SPLIT then expired = SPLIT - 1 end
      cur = others + holders * SPLIT
      prev = r + expired * SPLIT
    end
  elseif burst then
    -- limit_req's arithmetic (bucket.rs): drained since it was written,
    -- never below one request under empty; a request over the burst adds
    -- nothing
    local level = wrote[KEYS[g]] or counts[g]
    local e = -1000
    if level then
      local le, lt = string.match(level, '^(%-?%d+):(%d+)$')
      if not le then
        err = redis.error_reply('ERR redis_ratelimit: the bucket is not a level')
      else
        e = tonumber(le)
        local gone = now - tonumber(lt)
        if gone > 0 then e = e - math.floor(limit * gone * 1000 / p) end
        if e < -1000 then e = -1000 end
      end
    end
    if not err then
      local at = j + 2
      local added = false
      for i = a + 5, a + 3 + 2 * n, 2 do
        local c = tonumber(ARGV[i])
        local dl = tonumber(ARGV[i + 1])
        at = at + 1
        local with = e + c * 1000
        if with < 0 then with = 0 end
        if dl < 0 then
          -- what a node owes (thousandths, drained on the node already)
          e = e + c
          added = true
          out[at] = 1
        elseif dl > 0 and now > dl then
          out[at] = 2
        elseif with > burst then
          out[at] = 0
        else
          e = with
          added = true
          out[at] = 1
        end
      end
      if added then
        -- it lives until it is empty, and a second more
        local v = string.format('%d:%d', e, now)
        local r = redis.pcall('SET', KEYS[g], v, 'PX',
          math.floor((e + 1000) * p / (limit * 1000)) + 1000)
        if type(r) == 'table' and r.err then
          err = r
        else
          wrote[KEYS[g]] = v
        end
      end
      cur = e + 1000
      prev = 0
    end
  else
    cur = tonumber(wrote[KEYS[g]] or counts[g] or 0)
    prev = tonumber(wrote[KEYS[g + 1]] or counts[g + 1] or 0)
    if not cur or not prev or cur < 0 or prev < 0 or cur % 1 ~= 0 or prev % 1 ~= 0 then
      err = redis.error_reply('ERR redis_ratelimit: the counter is not an integer')
    else
      local weighted = prev * left
      local at = j + 2
      local added = 0
      local one
      for i = a + 5, a + 3 + 2 * n, 2 do
        local c = ARGV[i]
        if c == '1' then c = 1 else c = tonumber(c) end
        local dl = ARGV[i + 1]
        if dl == '0' then dl = 0 else dl = tonumber(dl) end
        local k = c
        if k < 1 then k = 1 end
        at = at + 1
        if dl < 0 then
          added = added + c
          one = one == nil and ARGV[i] or false
          out[at] = 1
        elseif dl > 0 and now and now > dl then
          out[at] = 2
        elseif weighted + (cur + added + k - 1) * p < cap then
          added = added + c
          one = one == nil and ARGV[i] or false
          out[at] = 1
        else
          out[at] = 0
        end
      end
      if added > 0 then
        -- one request's cost as it came: no number written back as text
        local r = redis.pcall('INCRBY', KEYS[g], one or added)
        if type(r) == 'table' then
          err = r
        else
          if r == added then
            redis.call('EXPIRE', KEYS[g], ttl)
          end
          cur = r
          wrote[KEYS[g]] = r
        end
      end
    end
  end
  if err then
    if #KEYS == 2 then
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
