-- Custody deadlines, a prelude: two sorted sets a liveness look reads only below its
-- cutoff, so that its cost is the number of leases due, not the number of jobs.
-- ggufq:due:sent    "<job>|<placement>|<device>" -> when its send counts from (Redis's
--                   clock): a job recorded as sent and not started; the lost-send look
--                   reads those older than its window (scheduler/placement/recovery.py)
-- ggufq:due:counted "<runner id>|<placement>" -> when a runner counted a job whose
--                   in-flight record is not written yet; the recount reads those older
--                   than a placement process may hold a job
-- Touches, by name: ggufq:due:sent, ggufq:due:counted.

local DUE_SENT, DUE_COUNTED = 'ggufq:due:sent', 'ggufq:due:counted'

local function sent_due(job_id, placement, device_id)
  return job_id .. '|' .. placement .. '|' .. device_id
end

-- The placement (a table: id, device_id, runner_id, ...) an in-flight record's JSON
-- ``raw`` names; nil when there is no record or it does not parse.
local function placement_of(raw)
  if not raw then return nil end
  local ok, record = pcall(cjson.decode, raw)
  if not ok or type(record) ~= 'table' or type(record['placement']) ~= 'table' then return nil end
  return record['placement']
end

-- The due member of an in-flight record's JSON ``raw``, nil when it does not parse.
local function sent_due_of(job_id, raw)
  local placement = placement_of(raw)
  if not placement then return nil end
  return sent_due(job_id, tostring(placement['id']), tostring(placement['device_id']))
end

local function runner_id_of(runner) return string.sub(runner, #'ggufq:runner:' + 1) end

local function counted_due(runner, placement) return runner_id_of(runner) .. '|' .. placement end
