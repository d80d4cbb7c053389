-- Create a runner and reserve its memory on one device, atomically, re-checking free memory.
-- KEYS[1] ggufq:runners          (set)   runner ids
-- KEYS[2] ggufq:runner:<id>      (hash)  the new runner
-- KEYS[3] ggufq:device:<dev>     (hash)  the device: total, free (reported), heartbeat
-- KEYS[4] ggufq:resv:<dev>       (hash)  runner id -> bytes reserved on the device
-- ARGV: runner_id, bytes, now, device_ttl_s, then field/value pairs for the runner hash
-- Returns {1, free_after} on success, {0, free} when the device cannot hold it now.
local runner_id, need = ARGV[1], tonumber(ARGV[2])
local now, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local dev = redis.call('HMGET', KEYS[3], 'total', 'free', 'heartbeat')
if not dev[1] or (now - tonumber(dev[3])) > ttl then
  return {0, -1}
end
local reserved = 0
for _, v in ipairs(redis.call('HVALS', KEYS[4])) do reserved = reserved + tonumber(v) end
local free = math.min(tonumber(dev[2]), tonumber(dev[1]) - reserved)
if free < need then
  return {0, free}
end
redis.call('HSET', KEYS[4], runner_id, need)
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('SADD', KEYS[1], runner_id)
changed(KEYS[2])
changed(KEYS[4])
return {1, free - need}
