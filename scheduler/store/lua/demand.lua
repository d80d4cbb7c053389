-- Count one more request for a model (count_demand, in the prelude _demand.lua).
-- KEYS[1] ggufq:demand  (hash) model -> "score:last_time"
-- ARGV: model, now, tau_s
count_demand(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
return 1
