-- Correct a runner's in-flight count that no in-flight record accounts for (a job counted
-- on it whose record was never written: placement's reply lost mid-commit, or Redis
-- restarted from a snapshot older than a job's end), only if it has not changed since it
-- was read. An idle runner gets its expiry as a job's end gives it.
-- KEYS[1] ggufq:runner:<id>  (hash)
-- ARGV: the count read, the count its records give, now
-- Returns 1 when corrected, 0 when the count changed meanwhile or the runner is gone.
local n = redis.call('HGET', KEYS[1], 'in_flight')
if not n or n ~= ARGV[1] then return 0 end
local left = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'in_flight', left)
if left == 0 then
  local keep = tonumber(redis.call('HGET', KEYS[1], 'keep_alive_s') or '-1')
  local expires = -1
  if keep >= 0 then expires = tonumber(ARGV[3]) + keep end
  redis.call('HSET', KEYS[1], 'expires_at', expires)
end
changed(KEYS[1])
return 1
