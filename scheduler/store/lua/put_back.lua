-- Its holder puts a job in hand back in its queue (parks it again, or returns an orphan it
-- could not handle) and lets go of it; nothing when another placement process swept it
-- back already (the holder had stalled): the job is someone else's now.
-- KEYS[1] the queue: ggufq:parked or ggufq:orphans
-- KEYS[2] ggufq:parked:<id> (string), unused for an orphan
-- KEYS[3] ggufq:in_hand (hash)
-- KEYS[4] ggufq:swept:<token>
-- ARGV: job id, 'orphan' or 'parked', record, field "<placement>|<job id>", token ('' for
--       a job not in hand)
-- Returns 1 when it was put back, 0 when it was swept.
if ARGV[5] ~= '' and redis.call('EXISTS', KEYS[4]) == 1 then
  return 0
end
put_back(KEYS[1], KEYS[2], ARGV[2], ARGV[1], ARGV[3])
let_go(KEYS[3], ARGV[4], ARGV[5])
return 1
