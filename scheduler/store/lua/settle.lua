-- Forget the sends due whose job no longer waits to start: its in-flight record is gone or
-- another placement's, it is running, or its start is claimed. Judged here, in the step
-- that forgets them, not from the caller's look: a Redis that lost its last second since
-- that look (and the job's start or end with it) keeps the deadline of a job that waits
-- again. A job started only by its chunks (a crash lost its start claim) is kept: the look
-- moves it on.
-- KEYS[1] ggufq:due:sent (sorted set)
-- KEYS[2] ggufq:running  (hash) job id -> time it started
-- Also touches, by name: ggufq:inflight:<dev> and ggufq:job:<id>:custody (read)
-- ARGV: the members "<job>|<placement>|<device>" to forget if so
-- Returns how many were forgotten.
local forgotten = 0
for _, member in ipairs(ARGV) do
  local job, placement, dev = string.match(member, '^(.*)|([^|]*)|([^|]*)$')
  local forget = job == nil
  if not forget then
    local recorded = placement_of(redis.call('HGET', 'ggufq:inflight:' .. dev, job))
    forget = not recorded or tostring(recorded['id']) ~= placement
      or redis.call('HEXISTS', KEYS[2], job) == 1
      or started_under(job, placement)
  end
  if forget then forgotten = forgotten + redis.call('ZREM', KEYS[1], member) end
end
return forgotten
