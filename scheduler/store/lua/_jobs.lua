-- A runner's jobs, a prelude: the hash ggufq:runner:<id>:jobs holds the placement ids of
-- the jobs it runs or was given, each with when it was counted (Redis's clock), and its
-- hash's in_flight (what placement decides on) mirrors the count in the same step. Adding
-- or removing a placement twice changes nothing, so the count cannot drift from a step run
-- again after a lost answer, nor count a job's end against a later placement of it.
-- Touches, by name: ggufq:runner:<id>:jobs beside each runner hash the callers name.

local function jobs_of(runner) return runner .. ':jobs' end

-- The runner counts ``placement`` (from now, unless it did already); returns how many.
local function count_on(runner, placement)
  redis.call('HSETNX', jobs_of(runner), placement, now_s())
  local n = redis.call('HLEN', jobs_of(runner))
  redis.call('HSET', runner, 'in_flight', n)
  return n
end

-- The runner no longer counts ``placement``; returns how many it still counts.
local function count_out(runner, placement)
  redis.call('HDEL', jobs_of(runner), placement)
  local n = redis.call('HLEN', jobs_of(runner))
  redis.call('HSET', runner, 'in_flight', n)
  return n
end

-- The runner and its job set are gone.
local function forget_runner(runner)
  redis.call('DEL', runner, jobs_of(runner))
end
