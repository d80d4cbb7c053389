-- Remove one runner, its job set and every reservation it holds. A runner id is never reused, so a late
-- or repeated release cannot remove a newer runner of the same model.
-- KEYS[1] ggufq:runners          (set)
-- KEYS[2] ggufq:runner:<id>      (hash)
-- KEYS[3..] ggufq:resv:<dev>     (hash) for each device the runner holds memory on
-- ARGV: runner_id
-- Returns the number of reservations removed.
local removed = 0
for i = 3, #KEYS do
  removed = removed + redis.call('HDEL', KEYS[i], ARGV[1])
  changed(KEYS[i])
end
forget_runner(KEYS[2])
changed(KEYS[2])
redis.call('SREM', KEYS[1], ARGV[1])
return removed
