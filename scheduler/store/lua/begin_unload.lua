-- Mark a runner unloading so placement stops routing to it; only when no job is assigned.
-- KEYS[1] ggufq:runner:<id>  (hash)
-- ARGV: force (1 = unload even with jobs assigned: the load failed)
-- Returns 1 when the caller may unload, 0 when a job arrived meanwhile or it is gone.
local h = redis.call('HMGET', KEYS[1], 'state', 'in_flight')
if not h[1] or h[1] == 'unloading' then return 0 end
if ARGV[1] ~= '1' and tonumber(h[2]) > 0 then return 0 end
redis.call('HSET', KEYS[1], 'state', 'unloading')
changed(KEYS[1])
return 1
