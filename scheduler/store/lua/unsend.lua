-- Take back a job that placement recorded as sent but could not send (a broker error): its
-- in-flight record and owner go, and the runner it was given forgets it (a runner created
-- for it is removed with its reservations, unless placement routed other jobs to it
-- meanwhile: it stays for them).
-- Moves a job (scheduler/custody.py): sent -> placing
-- KEYS[1] ggufq:inflight:<dev>   (hash)
-- KEYS[2] ggufq:job:<id>:owner   (string)
-- KEYS[3] ggufq:runners          (set)
-- KEYS[4] ggufq:runner:<id>      (hash)
-- KEYS[5] ggufq:in_hand          (hash) the job's entry loses its 'sent' mark with its record
-- KEYS[6..] ggufq:resv:<dev>     (hash) each device a created runner holds memory on
-- Also touches, by name: ggufq:runner:<id>:jobs, ggufq:due:sent, ggufq:due:counted
-- ARGV: job id, runner id, created (1: the runner was created for this job), written (0:
--       the job's record was never written here, as for a job swept from this placement:
--       a record there is another placement's, and stays), field "<placement>|<job id>",
--       token the job is held under, the job's placement id
-- Returns 1. Safe to run twice (its reply was lost): the runner's job set forgets this
-- placement of the job once.
if ARGV[4] ~= '0' then
  local raw = redis.call('HGET', KEYS[1], ARGV[1])
  if raw then redis.call('ZREM', DUE_SENT, sent_due_of(ARGV[1], raw) or '') end
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('DEL', KEYS[2])
  mark_held(KEYS[5], ARGV[5], ARGV[6], 'sent', nil)
end
local others = 0
if redis.call('EXISTS', KEYS[4]) == 1 then others = count_out(KEYS[4], ARGV[7]) end
if ARGV[3] == '1' and others == 0 then
  drop_runner(KEYS[3], KEYS[4], ARGV[2], {unpack(KEYS, 6)})
else
  changed(KEYS[4])
end
return 1
