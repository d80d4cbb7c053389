-- Its holder puts a job in hand back in its queue (parks it again, or returns an orphan it
-- could not handle) and lets go of it. Not when another placement process put it back
-- already (the holder had stalled): the job is someone else's now; nor when its custody
-- record says it moved on (ended, say, while this holder waited for Redis). Not when it
-- was sent (its record says this hold ended with its send, or a sweep let go of it
-- because it was: its send step ran, and what failed came after): its device's records
-- account for it, and parking it too would run it twice; then it only lets go.
-- Moves a job (scheduler/custody.py): placing -> parked, placing -> orphaned
-- KEYS[1] the queue: ggufq:parked or ggufq:orphans
-- KEYS[2] ggufq:parked:<id> (string), unused for an orphan
-- KEYS[3] ggufq:in_hand (hash)
-- KEYS[4] ggufq:job:<id>:custody (hash) the job's record: its hold's token, sweep, send
-- ARGV: job id, 'orphan' or 'parked', record, field "<placement>|<job id>", token ('' for
--       a job not in hand)
-- Returns hands.PutBack: 1 PUT_BACK, 0 SWEPT (another placement process put it back),
-- 2 SENT (let go only).
if sent_from_us(ARGV[5], KEYS[4]) then
  let_go(KEYS[3], ARGV[4], ARGV[5])
  return 2
end
if ARGV[5] ~= '' and (put_back_from_us(KEYS[4], ARGV[5]) or moved_on(KEYS[4])) then
  return 0
end
local target = ARGV[2] == 'orphan' and 'orphaned' or 'parked'
if not may_move(ARGV[1], target, '') then return 0 end  -- its record says it is elsewhere
put_back(KEYS[1], KEYS[2], ARGV[2], ARGV[1], ARGV[3])
move(ARGV[1], target, '')
let_go(KEYS[3], ARGV[4], ARGV[5])
return 1
