-- A worker's heartbeat: the reported free memory and the time on Redis's clock (the
-- worker's own may be off), for each of its devices that is still registered. A device
-- that was dropped (its worker stalled past the TTL, or Redis lost its data) is not written
-- back in part: its id is returned, and the worker registers it again in full. A beat
-- goes in the change log (placement's snapshot cache reads the device again) when the
-- free memory or the failing loops changed, or when the last beat logged (``logged``) is
-- ``quiet_s`` old (or in the future: Redis's clock was set back), so that 1,000 devices
-- that beat every second and change nothing log a fraction of their beats. A cache's beat
-- may then be older than the device's: the cache reads the beats of ggufq:heartbeats
-- before it judges a device dead (scheduler/placement/snapcache.py).
-- KEYS[1] ggufq:devices    (set)
-- KEYS[2] ggufq:heartbeats (sorted set) device id -> last heartbeat
-- Also touches, by name: ggufq:device:<dev> (hash)
-- ARGV: quiet_s (0 logs every beat), failing (the worker's loops that keep failing; ""
--       when healthy), then device id, free bytes, device id, free bytes, ...
-- Returns the ids of the devices that are not registered.
local missing = {}
local now, quiet, failing = now_s(), tonumber(ARGV[1]), ARGV[2]
for i = 3, #ARGV, 2 do
  local dev = ARGV[i]
  local key = 'ggufq:device:' .. dev
  local was = {}
  if redis.call('SISMEMBER', KEYS[1], dev) == 1 then
    was = redis.call('HMGET', key, 'worker', 'free', 'failing', 'logged')
  end
  if was[1] then
    local logged = tonumber(was[4])
    if was[2] ~= ARGV[i + 1] or was[3] ~= failing or not logged or now < logged
        or now - logged >= quiet then
      redis.call('HSET', key, 'free', ARGV[i + 1], 'heartbeat', now, 'failing', failing,
        'logged', now)
      changed(key)
    else
      redis.call('HSET', key, 'heartbeat', now)
    end
    redis.call('ZADD', KEYS[2], now, dev)
  else
    table.insert(missing, dev)
  end
end
return missing
