-- The fast path: a client sends a job straight to the queue of a runner that is resident
-- with a free slot, as placement would have (scheduler/store/routes.py). Nothing is
-- written unless every check holds; then all of it is, at once.
-- Moves a job (scheduler/custody.py): submitted -> sent
-- KEYS[1]  ggufq:route:<...>          (string) the runner placement named for such jobs
-- KEYS[2]  ggufq:runner:<id>          (hash)
-- KEYS[3]  ggufq:heartbeats           (sorted set)
-- KEYS[4]  ggufq:parked               (sorted set)
-- KEYS[5]  ggufq.placement            (list) placement's queues: jobs waiting there go first
-- KEYS[6]  ggufq.placement.batch      (list)
-- KEYS[7]  ggufq:job:<id>:submitted   (string) the job id's claim
-- KEYS[8]  ggufq:job:<id>:placed      (string) the job's placement claim
-- KEYS[9]  ggufq:inflight:<dev>       (hash)
-- KEYS[10] the device's Celery queue  (list)
-- KEYS[11] ggufq:demand               (hash) counted as placement counts a job it sends
-- KEYS[12] ggufq:job:<id>:hops        (hash) the client's hops: submitted, sent
-- Also touches, by name: ggufq:runner:<id>:jobs, ggufq:due:sent, ggufq:due:counted, and
-- ggufq:job:<id>:custody (its holder: the placement id, the fence of the run's writes)
-- ARGV: route (as the client read it), device id, now (the client's: last use, demand and
--       hops), device ttl (the device's last beat must be that recent on Redis's clock),
--       claim ttl, submitted at, placement claim, job id, in-flight record (its
--       "sent_at":0.0 stamped here on Redis's clock), placement id,
--       the hops' ttl, message, route ttl, model, demand tau
-- Returns 1 when sent (also when this attempt's claim is there already: it ran, and its
-- reply was lost); 0 when the normal path must place it (the route changed, the runner
-- is not ready or has no free slot, its device is silent, or jobs wait); -1 when the job
-- id is taken.
-- this very attempt ran already (sent again after its reply was lost): sent
if redis.call('GET', KEYS[8]) == ARGV[7] then return 1 end
local route = redis.call('GET', KEYS[1])
if route ~= ARGV[1] then return 0 end
local runner = redis.call('HMGET', KEYS[2], 'state', 'in_flight', 'num_parallel')
if not runner[1] then
  redis.call('DEL', KEYS[1])  -- the runner is gone: so is its route
  return 0
end
if runner[1] ~= 'ready' or tonumber(runner[2] or 0) >= tonumber(runner[3] or 0) then
  return 0
end
local beat = redis.call('ZSCORE', KEYS[3], ARGV[2])
if not beat or tonumber(beat) < now_s() - tonumber(ARGV[4]) then return 0 end
if redis.call('ZCARD', KEYS[4]) > 0 then return 0 end
if redis.call('LLEN', KEYS[5]) > 0 or redis.call('LLEN', KEYS[6]) > 0 then return 0 end
-- a job id claimed, or one whose job has a custody record (its claim lapsed while Redis
-- knows the job: no recorded state is one this script moves from), is taken, as
-- lua/claim_id.lua answers: a reused id is the client's mistake, not a refused move
if redis.call('EXISTS', KEYS[7]) == 1 or redis.call('EXISTS', custody_key(ARGV[8])) == 1 then
  return -1
end
redis.call('SET', KEYS[7], ARGV[6], 'EX', ARGV[5])
redis.call('SET', KEYS[8], ARGV[7], 'EX', ARGV[5])
count_on(KEYS[2], ARGV[10])
redis.call('HSET', KEYS[2], 'last_used', ARGV[3], 'expires_at', -1)
changed(KEYS[2])
-- the record's "sent_at":0.0 becomes the time on Redis's clock, which the lost-send look
-- compares with (no JSON string holds '":' unescaped, so the field is the one matched)
local stamped = string.gsub(ARGV[9], '"sent_at":0%.0', '"sent_at":' .. string.format('%.6f', now_s()), 1)
redis.call('HSET', KEYS[9], ARGV[8], stamped)
redis.call('ZADD', DUE_SENT, now_s(), sent_due(ARGV[8], ARGV[10], ARGV[2]))
no_longer_due(KEYS[2], ARGV[10])
redis.call('LPUSH', KEYS[10], ARGV[12])
move(ARGV[8], 'sent', ARGV[10], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[13])
count_demand(KEYS[11], ARGV[14], ARGV[3], ARGV[15])
redis.call('HSET', KEYS[12], 'submitted', ARGV[6], 'sent', ARGV[3])
redis.call('EXPIRE', KEYS[12], ARGV[11])
return 1
