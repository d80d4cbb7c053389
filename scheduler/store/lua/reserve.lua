-- Create a runner, counting the job it is made for, and reserve its memory on each device
-- it spans, atomically, all or nothing, re-checking every device's free memory.
-- KEYS[1] ggufq:runners          (set)   runner ids
-- KEYS[2] ggufq:runner:<id>      (hash)  the new runner
-- KEYS[3], KEYS[4], ...          for each device: ggufq:device:<dev> (hash: total, free
--                                (reported), heartbeat), then ggufq:resv:<dev> (hash:
--                                runner id -> bytes reserved on the device)
-- ARGV: runner_id, the job's placement id, device_ttl_s (a device counts as alive while
--       its last beat is that recent on Redis's clock), n devices, n byte counts, then
--       field/value pairs for the runner hash
-- Returns {1, 0} on success, {0, i} when device i (1-based) cannot hold its part now.
-- Safe to run twice (its reply was lost): runner ids are new on every call, so the runner
-- already there is this call's.
local runner_id = ARGV[1]
if redis.call('SISMEMBER', KEYS[1], runner_id) == 1 then return {1, 0} end
local now, ttl, n = now_s(), tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 1, n do
  local dev = redis.call('HMGET', KEYS[1 + 2 * i], 'total', 'free', 'heartbeat')
  if not dev[1] or (now - tonumber(dev[3])) > ttl then return {0, i} end
  local reserved = 0
  for _, v in ipairs(redis.call('HVALS', KEYS[2 + 2 * i])) do reserved = reserved + tonumber(v) end
  local free = math.min(tonumber(dev[2]), tonumber(dev[1]) - reserved)
  if free < tonumber(ARGV[4 + i]) then return {0, i} end
end
for i = 1, n do
  redis.call('HSET', KEYS[2 + 2 * i], runner_id, ARGV[4 + i])
  changed(KEYS[2 + 2 * i])
end
for i = 5 + n, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
count_on(KEYS[2], ARGV[2])
redis.call('SADD', KEYS[1], runner_id)
changed(KEYS[2])
return {1, 0}
