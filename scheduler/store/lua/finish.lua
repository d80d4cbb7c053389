-- One job on a runner ended: count it off and set when the runner expires if now idle.
-- Counted once per placement of the job: a worker that writes the end again (its reply
-- was lost to a Redis outage) finds the job's end marker and changes nothing.
-- KEYS[1] ggufq:runner:<id>                       (hash)
-- KEYS[2] ggufq:job:<id>:ended:<placement id>     (string) absent: no marker is kept
-- ARGV: now, keep_alive_s (negative: never expires; "": the value the record has),
--       the marker's time to live in seconds
-- Returns the in-flight count left, or -1 when the runner is gone.
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if KEYS[2] and not redis.call('SET', KEYS[2], 1, 'NX', 'EX', ARGV[3]) then
  return tonumber(redis.call('HGET', KEYS[1], 'in_flight') or '0')
end
local left = redis.call('HINCRBY', KEYS[1], 'in_flight', -1)
if left < 0 then
  redis.call('HSET', KEYS[1], 'in_flight', 0)
  left = 0
end
local now = tonumber(ARGV[1])
local keep = tonumber(ARGV[2])
if ARGV[2] == '' then keep = tonumber(redis.call('HGET', KEYS[1], 'keep_alive_s') or '-1') end
local expires = -1
if left == 0 and keep >= 0 then expires = now + keep end
redis.call('HSET', KEYS[1], 'last_used', now, 'keep_alive_s', keep, 'expires_at', expires)
changed(KEYS[1])
return left
