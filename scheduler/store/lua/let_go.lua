-- Its holder lets go of a job in hand that it has ended (failed, cancelled, or found
-- finished already).
-- KEYS[1] ggufq:in_hand (hash)
-- ARGV: field "<placement>|<job id>", token
-- Returns 1.
let_go(KEYS[1], ARGV[1], ARGV[2])
return 1
