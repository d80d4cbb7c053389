-- A job ended on its worker: it is no longer running, nor in flight on its device, unless
-- it was placed again meanwhile (then the record has another placement id).
-- KEYS[1] ggufq:running            (hash) job id -> time it started
-- KEYS[2] ggufq:inflight:<dev>     (hash) job id -> {job, placement, ...} as JSON
-- ARGV: job id, placement id
-- Returns 1 when the in-flight record was this placement's and is gone, else 0.
redis.call('HDEL', KEYS[1], ARGV[1])
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if raw and cjson.decode(raw)['placement']['id'] == ARGV[2] then
  redis.call('HDEL', KEYS[2], ARGV[1])
  return 1
end
return 0
