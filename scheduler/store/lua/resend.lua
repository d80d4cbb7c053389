-- A job whose message to a live device was lost, sent again as a new placement of it (its
-- epoch raised): its in-flight record, holder, send deadline and its runner's count move
-- from the old placement id to the new one, and its new message goes on the device's
-- queue, in one step. A first message that turns up
-- after all, or a run of it that a Redis crash forgot (its start claim lost), is then
-- another placement's: start.lua refuses it, and its chunks and end are fenced off. Only
-- while the job still waits under the old id: recorded so, not running, its start not
-- claimed, no chunk written.
-- Moves a job (scheduler/custody.py): sent -> sent
-- KEYS[1] ggufq:inflight:<dev>               (hash) job id -> in-flight record
-- KEYS[2] ggufq:running                      (hash) job id -> time it started
-- KEYS[3] ggufq:job:<id>:chunks              (stream)
-- KEYS[4] ggufq:runner:<id>                  (hash) the runner it was sent to
-- KEYS[5] the device's Celery queue           (list)
-- Also touches, by name: ggufq:runner:<id>:jobs, ggufq:due:sent, ggufq:due:counted, and
-- ggufq:job:<id>:custody (the old placement's start claim; its holder: the new id)
-- ARGV: job id, old placement id, the new in-flight record, new placement id, device id,
--       the new Celery message
-- Returns 1 when the job moved to the new placement, 0 when it no longer waits under the
-- old one.
local recorded = placement_of(redis.call('HGET', KEYS[1], ARGV[1]))
if not recorded or tostring(recorded['id']) ~= ARGV[2]
    or redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1
    or started_under(ARGV[1], ARGV[2]) or redis.call('EXISTS', KEYS[3]) == 1
    or not may_move(ARGV[1], 'sent', ARGV[4]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('ZREM', DUE_SENT, sent_due(ARGV[1], ARGV[2], ARGV[5]))
redis.call('ZADD', DUE_SENT, now_s(), sent_due(ARGV[1], ARGV[4], ARGV[5]))
if redis.call('EXISTS', KEYS[4]) == 1 then
  count_out(KEYS[4], ARGV[2])
  count_on(KEYS[4], ARGV[4])
  no_longer_due(KEYS[4], ARGV[4])  -- recorded in flight in this step
  changed(KEYS[4])
end
redis.call('LPUSH', KEYS[5], ARGV[6])
move(ARGV[1], 'sent', ARGV[4], ARGV[5])
return 1
