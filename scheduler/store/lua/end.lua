-- A job's end on its worker, in one step: its last chunk (unless there is none to write:
-- handed back), fenced by its custody record's holder as append.lua's are; its running mark (unless the job
-- is another placement's now: a new run's mark stays) and in-flight record gone; and its runner counting this placement off (its job set: an end written
-- again after a lost answer changes nothing), with its expiry if now idle. A reader that
-- sees the last chunk finds the slot free and `ps` shows the runner idle; a worker that
-- dies before this leaves the job in flight, for placement to re-place or fail with its
-- device. A job handed back (its model could not load there) goes among the orphans in
-- the same step, and placement hears of it: never in flight and orphaned at once; only
-- while its in-flight record is this placement's (once, and not after a reap), and its
-- custody record says it is this run's to hand back: a hand-back the custody table
-- refuses is not made, but the run's own end (its slot, its in-flight record) still is.
-- Moves a job (scheduler/custody.py): running -> done, running -> failed, running -> cancelled
-- Moves a job (scheduler/custody.py): running -> orphaned, sent -> orphaned
-- Moves a job (scheduler/custody.py): sent -> done, sent -> failed, sent -> cancelled
-- KEYS[1] ggufq:job:<id>:chunks                    (stream) entry ids 0-<seq>
-- KEYS[2] ggufq:job:<id>                           (pub/sub channel)
-- KEYS[3] ggufq:running                            (hash) job id -> time it started
-- KEYS[4] ggufq:inflight:<dev>                     (hash) job id -> in-flight record
-- KEYS[5] ggufq:runner:<id>                        (hash)
-- KEYS[6] ggufq:events                             (pub/sub channel) job_finished, with
--                                                  the runner's model: wakes parked jobs
-- KEYS[7] ggufq:orphans                            (hash) job id -> in-flight record
-- KEYS[8] ggufq:job:<id>:custody                   (hash) its custody record: the fence
-- ARGV: placement id (the fence), seq, payload ('' for no chunk, or one written where the
--       stream lives apart), stream ttl_s, job id,
--       now, keep_alive_s ('' keeps the runner's), runner id, the orphan record of a job
--       handed back ('' for none), the final chunk's outcome (done, failed, cancelled; ''
--       with no chunk: none to move to), the final chunk owed to the stream's own Redis
--       (with its seq; only where the stream lives apart: ggufq:due:final)
-- Returns {streams.Appended (1 also when there was no chunk), jobs the runner still counts
-- (-1: it is gone)}.
local appended = 1
if ARGV[3] ~= '' then
  appended = append_chunk(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], KEYS[8],
    ARGV[10])
elseif ARGV[10] ~= '' then
  -- the stream lives on a Redis of its own (scheduler/store/shards.py): the record moves
  -- here, fenced as append_chunk fences, and the caller writes the chunk there next
  if fenced_off(KEYS[8], ARGV[1], ARGV[10]) then
    appended = 0
  else
    move_record(KEYS[8], ARGV[10], ARGV[1], ARGV[4])
    owe_final(ARGV[5], KEYS[8], ARGV[11])
  end
end
local was_recorded = done_with(KEYS[3], KEYS[4], ARGV[5], ARGV[1], KEYS[8])
local left = count_off(KEYS[5], ARGV[1], ARGV[6], ARGV[7])
if left >= 0 then
  local model = redis.call('HGET', KEYS[5], 'model') or ''
  local event = {event = 'job_finished', runner = ARGV[8], model = model, in_flight = left}
  redis.call('PUBLISH', KEYS[6], cjson.encode(event))
end
-- only with its record: an end run again after a lost answer, or of a job reaped or
-- placed again meanwhile, finds none and hands nothing back a second time
if ARGV[9] ~= '' and was_recorded == 1 and may_move(ARGV[5], 'orphaned', '') then
  redis.call('HSET', KEYS[7], ARGV[5], ARGV[9])
  move(ARGV[5], 'orphaned', '')
  redis.call('PUBLISH', KEYS[6], cjson.encode({event = 'handed_back', job = ARGV[5]}))
end
return {appended, left}
