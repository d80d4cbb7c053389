-- Custody deadlines, a prelude: two sorted sets a liveness look reads only below its
-- cutoff, so that its cost is the number of leases due, not the number of jobs.
-- ggufq:due:sent    "<job>|<placement>|<device>" -> when its send counts from (Redis's
--                   clock): a job recorded as sent and not started; the lost-send look
--                   reads those older than its window (scheduler/placement/recovery.py)
-- ggufq:due:counted "<runner id>|<placement>" -> when a runner counted a job whose
--                   in-flight record is not written yet; the recount reads those older
--                   than a placement process may hold a job
-- ggufq:due:final  job id -> when its end was recorded while its final chunk, owed to its
--                   stream's own Redis (scheduler/store/shards.py), was not written yet:
--                   the chunk waits in its custody record's ``owed`` until its writer (or,
--                   should that writer die first, placement's look) writes it there
-- Touches, by name: ggufq:due:sent, ggufq:due:counted, ggufq:due:final.

local DUE_SENT, DUE_COUNTED, DUE_FINAL = 'ggufq:due:sent', 'ggufq:due:counted', 'ggufq:due:final'

-- The final chunk ``chunk`` (JSON) of the job whose custody record is ``custody`` is owed
-- to its stream's own Redis from now on; one owed already stays (the end that came first:
-- a placement that fails a job its worker ended owes nothing over the worker's chunk).
local function owe_final(job_id, custody, chunk)
  redis.call('HSETNX', custody, 'owed', chunk)
  redis.call('ZADD', DUE_FINAL, 'NX', now_s(), job_id)  -- due from the first
end

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

local function counted_due(runner, placement)
  return string.sub(runner, #'ggufq:runner:' + 1) .. '|' .. placement
end
