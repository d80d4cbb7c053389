-- A worker starts a job it was delivered, in one step: the job must still be this
-- placement's (not re-placed after its device was dropped), and this delivery must be the
-- one run of it (a redelivered or duplicated message finds the run claimed by another
-- delivery: the custody record's ``run`` and ``delivery``).
-- Moves a job (scheduler/custody.py): sent -> running
-- KEYS[1] ggufq:inflight:<dev>          (hash) job id -> {job, placement, ...} as JSON
-- KEYS[2] ggufq:job:<id>:custody        (hash) its record: ``run``, ``delivery`` claim the run
-- KEYS[3] ggufq:running                 (hash) job id -> time it started
-- KEYS[4..6] the job's cancel flag, reader-wanted and reader keys (scheduler/store/cancel.py)
-- Also touches, by name: ggufq:due:sent (a started job is not due for the lost-send look)
-- ARGV: job id, placement id, delivery id, now
-- Returns {0} when the job is not this delivery's to run, else {1, flag, wanted, reader}.
local placement = placement_of(redis.call('HGET', KEYS[1], ARGV[1]))
if not placement or placement['id'] ~= ARGV[2] then
  return {0}
end
local claim = redis.call('HMGET', KEYS[2], 'run', 'delivery')
if claim[1] == ARGV[2] and claim[2] ~= ARGV[3] then
  return {0}  -- another delivery of this placement runs it
end
if not may_move(ARGV[1], 'running', ARGV[2]) then return {0} end  -- recorded elsewhere
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
move(ARGV[1], 'running', ARGV[2], string.sub(KEYS[1], #'ggufq:inflight:' + 1))
redis.call('HSET', KEYS[2], 'run', ARGV[2], 'delivery', ARGV[3])
redis.call('ZREM', DUE_SENT, sent_due(ARGV[1], ARGV[2], tostring(placement['device_id'])))
return {1, redis.call('GET', KEYS[4]), redis.call('GET', KEYS[5]), redis.call('GET', KEYS[6])}
