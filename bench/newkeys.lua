-- wrk script: every request carries a key no request before it had
-- ("X-Key: <thread>-<n>"), as a key-spraying client sends: each is new to
-- the zone, the node and Redis.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "stats.lua")

local counter = 0
local id = 0
local n = 0

setup = function(thread)
   counter = counter + 1
   thread:set("id", counter)
end

init = function()
   n = 0
end

request = function()
   n = n + 1
   return wrk.format(nil, nil, { ["X-Key"] = id .. "-" .. n })
end
