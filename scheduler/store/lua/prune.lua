-- Forget the jobs a runner counts that no in-flight record accounts for, once the caller
-- saw the same ones unaccounted for in its last look too and they were counted longer ago
-- than a placement process may hold a job (past that, its hold is swept and its record
-- refused): a job counted whose record was never written (placement's reply lost between
-- its commit and its record) would keep the runner full for good and never idle. Judged
-- per placement, against the records read in this same step: a job whose record was
-- written since the caller's last look stays.
-- A runner still loading that is left with no job was never given to a worker (its jobs'
-- records never came): nobody would load or release it, so it goes with its reservations.
-- KEYS[1] ggufq:runner:<id>  (hash: device_ids, keep_alive_s, state)
-- KEYS[2] ggufq:runners      (set)
-- Also touches, by name: ggufq:runner:<id>:jobs, and ggufq:inflight:<dev> (read) and
-- ggufq:resv:<dev> for each of the runner's devices
-- ARGV: now, runner id, the least age (s, Redis's clock) of a placement to forget, then
--       the placement ids the caller saw unaccounted for in its last look
-- Returns {placement ids unaccounted for now, those of them forgotten (in ARGV too),
-- 1 when the runner was released}.
if redis.call('EXISTS', KEYS[1]) == 0 then return {{}, {}, 0} end
local recorded = {}
local devices = redis.call('HGET', KEYS[1], 'device_ids') or ''
for dev in string.gmatch(devices, '[^,]+') do
  for _, raw in ipairs(redis.call('HVALS', 'ggufq:inflight:' .. dev)) do
    local placement = placement_of(raw)
    if placement then recorded[tostring(placement['id'])] = true end
  end
end
local seen = {}
for i = 4, #ARGV do seen[ARGV[i]] = true end
local counted_before = now_s() - tonumber(ARGV[3])
local unaccounted, forgotten = {}, {}
local jobs = redis.call('HGETALL', jobs_of(KEYS[1]))
for i = 1, #jobs, 2 do
  local placement, at = jobs[i], tonumber(jobs[i + 1])
  if not recorded[placement] then
    table.insert(unaccounted, placement)
    if seen[placement] and at < counted_before then table.insert(forgotten, placement) end
  end
end
local released = 0
if #forgotten > 0 then
  for _, placement in ipairs(forgotten) do count_out(KEYS[1], placement) end
  local idle = redis.call('HLEN', jobs_of(KEYS[1])) == 0
  if idle and redis.call('HGET', KEYS[1], 'state') == 'loading' then
    drop_runner(KEYS[2], KEYS[1], ARGV[2], resv_keys_of(devices))
    released = 1
  else
    if idle then
      local keep = tonumber(redis.call('HGET', KEYS[1], 'keep_alive_s') or '-1')
      redis.call('HSET', KEYS[1], 'expires_at', expiry(ARGV[1], 0, keep))
    end
    changed(KEYS[1])
  end
end
return {unaccounted, forgotten, released}
