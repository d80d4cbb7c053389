-- Undo the commit of a job that was not sent (swept from its placement process before its
-- send, or its send step failed): the runner it was given forgets it (a runner created for
-- it is removed with its reservations, unless placement routed other jobs to it
-- meanwhile: it stays for them). Nothing when the job was sent after all (the send step
-- ran and its reply was lost): its custody record's holder, or its in-flight record, is
-- this placement's (the holder outlives the job's end, which takes the in-flight record),
-- or a run of this placement was claimed (it may have handed the job back since).
-- Moves no job: it is still
-- in its placement process's hands.
-- KEYS[1] ggufq:inflight:<dev>   (hash)
-- KEYS[2] ggufq:runners          (set)
-- KEYS[3] ggufq:runner:<id>      (hash)
-- KEYS[4..] ggufq:resv:<dev>     (hash) each device a created runner holds memory on
-- Also touches, by name: ggufq:job:<id>:custody (read), ggufq:runner:<id>:jobs,
-- ggufq:due:counted
-- ARGV: job id, runner id, created (1: the runner was created for this job), the job's
--       placement id
-- Returns 1 when undone, 0 when the job was sent. Safe to run twice (its reply was lost):
-- the runner's job set forgets this placement of the job once.
local recorded = placement_of(redis.call('HGET', KEYS[1], ARGV[1]))
if (recorded and tostring(recorded['id']) == ARGV[4])
    or redis.call('HGET', 'ggufq:job:' .. ARGV[1] .. ':custody', 'holder') == ARGV[4]
    or started_under(ARGV[1], ARGV[4]) then
  return 0
end
local others = 0
if redis.call('EXISTS', KEYS[3]) == 1 then others = count_out(KEYS[3], ARGV[4]) end
if ARGV[3] == '1' and others == 0 then
  drop_runner(KEYS[2], KEYS[3], ARGV[2], {unpack(KEYS, 4)})
else
  changed(KEYS[3])
end
return 1
