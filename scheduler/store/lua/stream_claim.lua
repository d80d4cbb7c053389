-- A run's claim on its job's stream, where streams live on Redis instances of their own
-- (scheduler/store/shards.py), made right after its start (lua/start.lua): the stream's own
-- record names the run its holder, so chunks of a run the job was taken from are refused
-- here from now on (append.lua), as the custody record refuses them where the stream lives
-- beside it. The record keeps the custody epoch it was claimed or fenced under: a claim
-- under an older one (a run that stalled between its start and its claim, the job taken
-- from it meanwhile) is refused, unless forced (the custody record still names the run:
-- a control Redis restored from an older snapshot counts its epochs again).
-- Moves no job: the stream's own record holds a holder and an epoch only
-- KEYS[1] ggufq:job:<id>:chunks  (stream) entry ids 0-<seq>
-- KEYS[2] ggufq:job:<id>:custody (hash) the stream's own record, on the stream's Redis
-- ARGV: placement id of the run, its custody epoch, '1' to force (the record lives as long
--       as a custody record: CUSTODY_LIVE_TTL)
-- Returns the seq of the stream's last chunk (0: none yet), -1 when that chunk is a final
-- one (the job's stream ended: nothing is claimed), -2 when the record was claimed or
-- fenced under a later epoch.
local epoch = tonumber(redis.call('HGET', KEYS[2], 'epoch') or '0') or 0
if ARGV[3] ~= '1' and epoch > tonumber(ARGV[2]) then return -2 end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq = 0
if #last > 0 then
  seq = tonumber(string.match(last[1][1], '%-(%d+)$'))
  local ok, chunk = pcall(cjson.decode, last[1][2][2])
  if ok and type(chunk) == 'table' and chunk['done'] then return -1 end
end
redis.call('HSET', KEYS[2], 'holder', ARGV[1], 'epoch', ARGV[2])
redis.call('EXPIRE', KEYS[2], CUSTODY_LIVE_TTL)
return seq
