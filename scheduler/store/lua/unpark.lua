-- A job leaves the parked queue for good, with its record and its place in its model's
-- index (the job ended while it waited: placement fails or cancels it). Nothing when it
-- is not parked.
-- KEYS[1] ggufq:parked          (sorted set) job id -> order
-- KEYS[2] ggufq:parked:<id>     (string) its record
-- Also touches, by name: the index by model (lua/_hands.lua: unindex)
-- ARGV: job id
-- Returns 1 when it was parked, else 0.
local parked = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
unindex(ARGV[1])
return parked
