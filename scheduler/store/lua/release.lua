-- Remove one runner, its job set and every reservation it holds. A runner id is never
-- reused, so a late or repeated release cannot remove a newer runner of the same model.
-- KEYS[1] ggufq:runners          (set)
-- KEYS[2] ggufq:runner:<id>      (hash)
-- KEYS[3..] ggufq:resv:<dev>     (hash) for each device the runner holds memory on
-- ARGV: runner_id
-- Returns the number of reservations removed.
return drop_runner(KEYS[1], KEYS[2], ARGV[1], {unpack(KEYS, 3)})
