-- Send a job to its device: its in-flight record and its Celery message on the device's
-- queue in one step, so that the two cannot part (a record with no message, or a message
-- with no record). From then on the device's records account for the job (a dropped
-- device's jobs become orphans; a message lost later is sent again), so its holder lets go
-- of it in the same step, and its custody record says this hold ended with its send: a
-- holder that dies right after cannot have it put back to run twice. Nothing when another
-- placement process swept the job back from this one (it had stalled): it is someone
-- else's now. Asked again after a lost reply, it finds the job sent already (its record
-- says so, or its custody record's holder is this placement) and sends nothing more.
-- Moves a job (scheduler/custody.py): placing -> sent
-- KEYS[1] ggufq:inflight:<dev> (hash: job id -> SentJob JSON)
-- KEYS[2] ggufq:in_hand (hash)
-- KEYS[3] ggufq:job:<id>:custody (hash) the job's record: its holder (the placement id from
--         here on: the fence of the run's writes), its hold's token, sweep and send
-- KEYS[4] the device's Celery queue (list)
-- Also touches, by name: ggufq:due:sent (due for the lost-send look from now) and
-- ggufq:due:counted (its runner's count is accounted for)
-- ARGV: job id, record, placement id, field "<placement>|<job id>", token, runner id,
--       device id (the record's), the Celery message
-- Returns 1 when it was sent (now or by an earlier ask: its record names this placement,
-- or a run of it, which may have ended or handed it back since), 0 when it was swept.
if redis.call('HGET', KEYS[3], 'holder') == ARGV[3] or started_under(ARGV[1], ARGV[3])
    or sent_from_us(ARGV[5], KEYS[3]) then
  return 1
end
if ARGV[5] ~= '' and (put_back_from_us(KEYS[3], ARGV[5]) or moved_on(KEYS[3])) then
  return 0
end
if not may_move(ARGV[1], 'sent', ARGV[3]) then return 0 end  -- its record says it is elsewhere
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', DUE_SENT, now_s(), sent_due(ARGV[1], ARGV[3], ARGV[7]))
no_longer_due('ggufq:runner:' .. ARGV[6], ARGV[3])
let_go(KEYS[2], ARGV[4], ARGV[5])
redis.call('LPUSH', KEYS[4], ARGV[8])
move(ARGV[1], 'sent', ARGV[3], ARGV[7])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[3], 'sent', '1') end
return 1
