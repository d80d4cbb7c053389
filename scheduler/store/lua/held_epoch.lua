-- The custody epoch of a job while the hold ``token`` (lua/take.lua) is still its holder's:
-- not swept back from it by another placement process since. What placement fences a
-- job's stream under (lua/stream_fence.lua), read in one step with the hold, so that a
-- process that stalled past its lease fences nothing a later run claimed.
-- Moves no job: reads only
-- KEYS[1] ggufq:job:<id>:custody (hash) the job's record: its hold's token, sweep, epoch
-- ARGV: the hold's token
-- Returns the epoch, or false when the hold is another's or was swept.
local record = redis.call('HMGET', KEYS[1], 'token', 'swept', 'epoch')
if record[1] ~= ARGV[1] or (record[2] and record[2] ~= '') then return false end
return record[3] or '0'
