-- Its holder is about to end a job in hand (fail or cancel it): mark it ending, so that a
-- sweep after the holder stops ends it too instead of putting it back to run. Not when
-- another placement process put it back already (the holder had stalled), nor when it was
-- sent (its record says so, or a sweep let go of it because it was: its send step ran, and what
-- failed came after): it runs on its device, and ending it here too would give it two
-- outcomes. Moves no job: its final chunk (lua/final.lua) does.
-- KEYS[1] ggufq:in_hand (hash)
-- KEYS[2] ggufq:job:<id>:custody (hash) the job's record: its hold's token, sweep, send
-- ARGV: field "<placement>|<job id>", token
-- Returns 1 when the holder may end it, 0 when it was put back or sent.
if put_back_from_us(KEYS[2], ARGV[2]) or sent_from_us(ARGV[2], KEYS[2]) then
  return 0
end
mark_held(KEYS[1], ARGV[1], ARGV[2], 'ending', 1)
return 1
