-- Correct a runner's in-flight count that its in-flight records do not account for (a job
-- counted on it whose record was never written: placement's reply lost mid-commit, or
-- Redis restarted from a snapshot older than a job's end), only if the count is still the
-- one the caller saw over-counted twice. The records are counted here, in the same step
-- as the correction: counted from a read seconds older, a job that started meanwhile
-- would be missed, the count set one too low, and the runner unloaded under it. An idle
-- runner gets its expiry as a job's end gives it.
-- KEYS[1] ggufq:runner:<id>  (hash: in_flight, device_ids, keep_alive_s)
-- Also touches, by name: ggufq:inflight:<dev> (hash, read) for each of its devices
-- ARGV: runner id, the count the caller saw, now
-- Returns the count set, or -1 when nothing changed (the count moved meanwhile, its
-- records account for it now, or the runner is gone).
local n = redis.call('HGET', KEYS[1], 'in_flight')
if not n or n ~= ARGV[2] then return -1 end
local counted = 0
local devices = redis.call('HGET', KEYS[1], 'device_ids') or ''
for dev in string.gmatch(devices, '[^,]+') do
  for _, raw in ipairs(redis.call('HVALS', 'ggufq:inflight:' .. dev)) do
    local ok, record = pcall(cjson.decode, raw)
    if ok and type(record) == 'table' and type(record['placement']) == 'table'
        and record['placement']['runner_id'] == ARGV[1] then
      counted = counted + 1
    end
  end
end
if counted >= tonumber(n) then return -1 end
redis.call('HSET', KEYS[1], 'in_flight', counted)
if counted == 0 then
  local keep = tonumber(redis.call('HGET', KEYS[1], 'keep_alive_s') or '-1')
  local expires = -1
  if keep >= 0 then expires = tonumber(ARGV[3]) + keep end
  redis.call('HSET', KEYS[1], 'expires_at', expires)
end
changed(KEYS[1])
return counted
