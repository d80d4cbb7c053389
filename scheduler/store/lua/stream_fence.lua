-- Placement takes a job from its run (its device was dropped, or its message seemed lost)
-- where the job's stream lives on a Redis of its own (scheduler/store/shards.py): the
-- stream's own record names no holder from now on, so that run, should it come back,
-- writes no more chunks there, and what the stream holds is read in the same step (placement
-- re-places the job, or sends it again, by it). A record claimed under a later epoch (a
-- run placed since) is left as it is.
-- Moves no job: the stream's own record holds a holder and an epoch only
-- KEYS[1] ggufq:job:<id>:chunks  (stream) entry ids 0-<seq>
-- KEYS[2] ggufq:job:<id>:custody (hash) the stream's own record, on the stream's Redis
-- ARGV: the job's custody epoch now (the record lives as long as a custody record:
--       CUSTODY_LIVE_TTL)
-- Returns {chunks the stream holds, 1 when its last is a final chunk else 0}.
local epoch = tonumber(redis.call('HGET', KEYS[2], 'epoch') or '0') or 0
if epoch <= tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[2], 'holder', '', 'epoch', ARGV[1])
  redis.call('EXPIRE', KEYS[2], CUSTODY_LIVE_TTL)
end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local final = 0
if #last > 0 then
  local ok, chunk = pcall(cjson.decode, last[1][2][2])
  if ok and type(chunk) == 'table' and chunk['done'] then final = 1 end
end
return {redis.call('XLEN', KEYS[1]), final}
