-- A runner's jobs, a prelude: the hash ggufq:runner:<id>:jobs holds the placement ids of
-- the jobs it runs or was given, each with when it was counted (Redis's clock), and its
-- hash's in_flight (what placement decides on) mirrors the count in the same step. Adding
-- or removing a placement twice changes nothing, so the count cannot drift from a step run
-- again after a lost answer, nor count a job's end against a later placement of it. A
-- placement counted and not yet recorded in flight is due for the recount (_due.lua)
-- until its record is written or it is counted off.
-- Touches, by name: ggufq:runner:<id>:jobs beside each runner hash the callers name, and
-- ggufq:due:counted.

local function jobs_of(runner) return runner .. ':jobs' end

-- The runner's in_flight set to the jobs it counts; returns how many.
local function mirror_count(runner)
  local n = redis.call('HLEN', jobs_of(runner))
  redis.call('HSET', runner, 'in_flight', n)
  return n
end

-- The runner counts ``placement`` (from now, unless it did already); returns how many.
local function count_on(runner, placement)
  local now = now_s()
  if redis.call('HSETNX', jobs_of(runner), placement, now) == 1 then
    redis.call('ZADD', DUE_COUNTED, now, counted_due(runner, placement))
  end
  return mirror_count(runner)
end

-- The runner's ``placement`` is not due for the recount: its job is recorded in flight
-- (the device's records account for it from now on), counted off, or the runner is gone.
local function no_longer_due(runner, placement)
  redis.call('ZREM', DUE_COUNTED, counted_due(runner, placement))
end

-- The runner no longer counts ``placement``; returns how many it still counts.
local function count_out(runner, placement)
  redis.call('HDEL', jobs_of(runner), placement)
  no_longer_due(runner, placement)
  return mirror_count(runner)
end

-- When an idle runner expires: ``alive_s`` after ``now`` (-1, never, while it still has
-- jobs or keeps no expiry).
local function expiry(now, left, alive_s)
  if left == 0 and alive_s >= 0 then return tonumber(now) + alive_s end
  return -1
end

-- The runner goes: its hash, its job set, its place in ``runners`` (ggufq:runners) and its
-- reservations under ``resv_keys`` (ggufq:resv:<dev> each). Returns how many it held.
local function drop_runner(runners, runner, runner_id, resv_keys)
  local removed = 0
  for _, key in ipairs(resv_keys) do
    removed = removed + redis.call('HDEL', key, runner_id)
    changed(key)
  end
  for _, placement in ipairs(redis.call('HKEYS', jobs_of(runner))) do
    no_longer_due(runner, placement)
  end
  redis.call('DEL', runner, jobs_of(runner))
  changed(runner)
  redis.call('SREM', runners, runner_id)
  return removed
end

-- The reservation keys of the devices in ``device_ids`` (a runner's "a,b,..." field).
local function resv_keys_of(device_ids)
  local found = {}
  for dev in string.gmatch(device_ids or '', '[^,]+') do
    table.insert(found, 'ggufq:resv:' .. dev)
  end
  return found
end
