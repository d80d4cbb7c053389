-- Record a job as sent to a device's queue, before it is sent: from then on the device's
-- records account for it (a dropped device's jobs become orphans; a lost message is sent
-- again), and the job in hand is marked sent, so that if its holder dies before letting go
-- of it, it is not put back to run twice. Nothing when another placement process swept the
-- job back from this one (it had stalled): it is someone else's now.
-- Moves a job (scheduler/custody.py): placing -> sent
-- KEYS[1] ggufq:inflight:<dev> (hash: job id -> SentJob JSON)
-- KEYS[2] ggufq:job:<id>:owner (string: the placement's id)
-- KEYS[3] ggufq:in_hand (hash)
-- KEYS[4] ggufq:swept:<token>
-- Also touches, by name: ggufq:due:sent (due for the lost-send look from now) and
-- ggufq:due:counted (its runner's count is accounted for)
-- ARGV: job id, record, placement id, owner ttl (s), field "<placement>|<job id>", token,
--       runner id, device id (the record's)
-- Returns 1 when it was recorded, 0 when it was swept.
if ARGV[6] ~= '' and put_back_from_us(KEYS[4]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', DUE_SENT, now_s(), sent_due(ARGV[1], ARGV[3], ARGV[8]))
no_longer_due('ggufq:runner:' .. ARGV[7], ARGV[3])
redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
mark_held(KEYS[3], ARGV[5], ARGV[6], 'sent', 1)  -- unsend.lua clears it with the record
return 1
