-- A worker's heartbeat: the reported free memory and the time on Redis's clock (the
-- worker's own may be off), for each of its devices that is still registered. A device that was dropped (its worker stalled past the TTL, or Redis
-- lost its data) is not written back in part: its id is returned, and the worker registers
-- it again in full.
-- KEYS[1] ggufq:devices    (set)
-- KEYS[2] ggufq:heartbeats (sorted set) device id -> last heartbeat
-- Also touches, by name: ggufq:device:<dev> (hash)
-- ARGV: failing (the worker's loops that keep failing; "" when healthy), then device id,
--       free bytes, device id, free bytes, ...
-- Returns the ids of the devices that are not registered.
local missing = {}
local now = now_s()
for i = 2, #ARGV, 2 do
  local dev = ARGV[i]
  local key = 'ggufq:device:' .. dev
  if redis.call('SISMEMBER', KEYS[1], dev) == 1 and redis.call('HEXISTS', key, 'worker') == 1 then
    redis.call('HSET', key, 'free', ARGV[i + 1], 'heartbeat', now, 'failing', ARGV[1])
    redis.call('ZADD', KEYS[2], now, dev)
    changed(key)
  else
    table.insert(missing, dev)
  end
end
return missing
