-- A placement service's heartbeat, stamped on Redis's clock (the service's own may be off):
-- the jobs a service holds are put back by the others only once it has been silent for the
-- TTL on this clock (sweep.lua). Services silent for ten TTLs are forgotten.
-- KEYS[1] ggufq:placement:alive   (sorted set) placement -> last beat
-- KEYS[2] ggufq:placement:failing (hash) placement -> its loops that keep failing
-- ARGV: placement, ttl_s, failing ("" when healthy)
-- Returns the beat's time.
local now = now_s()
redis.call('ZADD', KEYS[1], now, ARGV[1])
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
else
  redis.call('HDEL', KEYS[2], ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 10 * tonumber(ARGV[2]))
return tostring(now)
