-- wrk script: every request carries "X-Key: <i mod N>" (N = 10000 unless
-- passed as the first script argument: wrk ... -s keys.lua URL -- 5000).
-- The requests are formatted once in init(); request() only picks the next.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "stats.lua")

local reqs = {}
local n = 10000
local i = 0

init = function(args)
   n = tonumber(args[1]) or n
   for k = 0, n - 1 do
      reqs[k] = wrk.format(nil, nil, { ["X-Key"] = tostring(k) })
   end
   -- threads start at different offsets so they do not walk in lockstep
   i = math.random(0, n - 1)
end

request = function()
   i = (i + 1) % n
   return reqs[i]
end
