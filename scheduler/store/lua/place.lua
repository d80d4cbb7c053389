-- Claim a submitted job's placement for one delivery of its message, and hold the job in
-- hand while it is placed: a claim tried again after a lost reply is found ours; another
-- delivery finds it taken. Held, the job is parked again by another placement process if
-- this one dies before it sends, parks or ends it.
-- Moves a job (scheduler/custody.py): submitted -> placing
-- KEYS[1] ggufq:job:<id>:placed (string: the delivery's id)
-- KEYS[2] ggufq:in_hand (hash)
-- KEYS[3] ggufq:job:<id>:custody (hash) the job's record: its hold's token, sweep, send
-- ARGV: delivery id, claim ttl (s), field "<placement>|<job id>", entry (JSON; its "at" is
--       stamped here, on Redis's clock, as the holder's beats are), token
-- Returns 1 when the job is this delivery's, else 0 (also when it was held under this token
-- and swept from this process meanwhile: the claim was asked again after an outage).
if put_back_from_us(KEYS[3], ARGV[5]) or not may_hold(ARGV[3]) then
  return 0  -- or its record says it moved on (a delivery whose claim lapsed): not ours
end
redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
-- "at" goes in front of the entry's other keys as text: the entry carries the whole job,
-- which a decode and encode here would parse and copy on every placement
local at = string.format('{"at": %.6f, ', now_s())
redis.call('HSET', KEYS[2], ARGV[3], at .. string.sub(ARGV[4], 2))
hold(ARGV[3], ARGV[5])
return 1
