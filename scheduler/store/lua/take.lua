-- Take a job's record out of a queue for one taker (a placement process handling it),
-- once: the record leaves the queue and is held in hand under the taker's token, so that
-- the same taker asking again (its reply was lost) gets it again and any other gets
-- nothing; and, should the taker die with it, another placement process puts it back.
-- An entry whose job's custody record says it is elsewhere (held, sent, running or ended:
-- the table allows no take from there; versions before the table was enforced left such
-- entries) is a leftover: it leaves the queue, and nobody takes it.
-- Moves a job (scheduler/custody.py): parked -> placing, orphaned -> placing
-- KEYS[1] the queue: ggufq:parked (sorted set: job id) or ggufq:orphans (hash: job id ->
--         record)
-- KEYS[2] the record: ggufq:parked:<id> (string) for the parked queue, unused otherwise
-- KEYS[3] ggufq:in_hand (hash)
-- KEYS[4] ggufq:job:<id>:custody (hash) the job's record: its hold's token, sweep, send
-- ARGV: job id, field "<placement>|<job id>", token, 'orphan' or 'parked' (the entry's "at"
--       is stamped on Redis's clock, as the holder's beats are)
-- Returns the record, or false when it is not there (another taker has it, or it was taken
-- under this token and swept back from this taker since: asked again after an outage).
local last = redis.call('HMGET', KEYS[4], 'token', 'swept')
if last[1] == ARGV[3] and last[2] and last[2] ~= '' then
  return false
end
local taken = held_entry(KEYS[3], ARGV[2], ARGV[3])
if taken then return taken['record'] end
local raw
if ARGV[4] == 'orphan' then
  raw = redis.call('HGET', KEYS[1], ARGV[1])
  if not raw then return false end
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return false end
  redis.call('ZREM', KEYS[1], ARGV[1])
  unindex(ARGV[1])
  raw = redis.call('GET', KEYS[2])
  redis.call('DEL', KEYS[2])
end
if not raw or not may_hold(ARGV[2]) then return false end  -- a leftover: out, untaken
local entry = {token = ARGV[3], what = ARGV[4], at = now_s(), record = raw}
redis.call('HSET', KEYS[3], ARGV[2], cjson.encode(entry))
hold(ARGV[2], ARGV[3])
return raw
