-- Count one more job on a runner (its placement id into the runner's job set), unless the
-- runner is gone or unloading.
-- KEYS[1] ggufq:runner:<id>  (hash)
-- ARGV: now, placement id
-- Returns 1 when assigned, 0 when the runner cannot take the job.
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'unloading' then return 0 end
count_on(KEYS[1], ARGV[2])
redis.call('HSET', KEYS[1], 'last_used', ARGV[1], 'expires_at', -1)
changed(KEYS[1])
return 1
