-- A job that will not run (or not run again) ends here: placement fails or cancels it with
-- a final chunk after whatever its stream holds and, should it wait parked, takes it out of
-- the parked queue, its record and its model's index in the same step, so that no crash
-- between the two leaves a job neither waiting nor ended.
-- Moves a job (scheduler/custody.py): placing -> failed, placing -> cancelled
-- Moves a job (scheduler/custody.py): parked -> failed, parked -> cancelled, submitted -> failed
-- KEYS[1] ggufq:parked           (sorted set) job id -> order
-- KEYS[2] ggufq:parked:<id>      (string) its record
-- KEYS[3] ggufq:job:<id>:owner   (string) unchecked: this end is written whoever owns it
-- KEYS[4] ggufq:job:<id>:chunks  (stream) entry ids 0-<seq>
-- KEYS[5] ggufq:job:<id>         (pub/sub channel)
-- KEYS[6] ggufq:job:<id>:custody (hash)
-- Also touches, by name: the parked jobs' index by model (lua/_hands.lua: unindex)
-- ARGV: job id, the final chunk (a JSON object with keys and no seq: it is set here), stream ttl_s, its outcome
--       (failed, cancelled)
-- Returns streams.Appended.
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
unindex(ARGV[1])
local last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
local seq = 1
if #last > 0 then seq = tonumber(string.match(last[1][1], '%-(%d+)$')) + 1 end
-- the seq goes in front of the chunk's other keys as text: a decode and encode here would
-- turn its empty lists into objects
local payload = string.format('{"seq": %d, ', seq) .. string.sub(ARGV[2], 2)
return append_chunk(KEYS[3], KEYS[4], KEYS[5], '', seq, payload, ARGV[3], KEYS[6], ARGV[4])
