-- Set fields on a runner only if it still exists (a released runner must not reappear).
-- KEYS[1] ggufq:runner:<id>  (hash)
-- ARGV: field/value pairs
-- Returns 1 when updated, 0 when the runner is gone.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 1, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
changed(KEYS[1])
return 1
