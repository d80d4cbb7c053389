-- Take a job's record out of a queue for one taker (a placement process handling it),
-- once: the record leaves the queue and is kept under the taker's token for a while, so
-- that the same taker asking again (its reply was lost) gets it again and any other gets
-- nothing. A record taken and lost with its reply would be a job never run nor ended.
-- KEYS[1] the queue: ggufq:parked (sorted set: job id) or ggufq:orphans (hash: job id ->
--         record)
-- KEYS[2] the record: ggufq:parked:<id> (string) for the parked queue, unused otherwise
-- KEYS[3] ggufq:taken:<what>:<id> (hash: token, record)
-- ARGV: job id, token, seconds to keep the taken record, 'orphan' or 'parked'
-- Returns the record, or false when it is not there (another taker has it).
if redis.call('HGET', KEYS[3], 'token') == ARGV[2] then
  return redis.call('HGET', KEYS[3], 'record')
end
local raw
if ARGV[4] == 'orphan' then
  raw = redis.call('HGET', KEYS[1], ARGV[1])
  if not raw then return false end
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return false end
  raw = redis.call('GET', KEYS[2])
  redis.call('DEL', KEYS[2])
  if not raw then return false end
end
redis.call('HSET', KEYS[3], 'token', ARGV[2], 'record', raw)
redis.call('EXPIRE', KEYS[3], ARGV[3])
return raw
