-- Set fields on a runner only if it still exists (a released runner must not reappear),
-- and never back to "ready" once it is unloading (a "ready" its worker wrote late, kept
-- through an outage, lands after the unload began).
-- KEYS[1] ggufq:runner:<id>  (hash)
-- ARGV: field/value pairs
-- Returns 1 when updated, 0 when the runner is gone.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local unloading = redis.call('HGET', KEYS[1], 'state') == 'unloading'
for i = 1, #ARGV, 2 do
  if not (unloading and ARGV[i] == 'state' and ARGV[i + 1] == 'ready') then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
changed(KEYS[1])
return 1
