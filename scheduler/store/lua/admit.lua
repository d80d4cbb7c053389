-- Room in Redis for a new job's text, taken in one step so that jobs arriving at once
-- cannot all see the same room (scheduler/store/headroom.py): admitted while what Redis
-- uses, what was admitted in the last ARGV[3] seconds and what this job needs stay under a
-- share of its maxmemory (a job admitted lately is counted until its records are written,
-- and then in what Redis uses too, for the rest of those seconds: on the safe side).
-- KEYS[1] ggufq:memory:admitted (prefix of one counter a second, on Redis's clock: bytes
--         admitted that second; each expires once it is older than ARGV[3] s)
-- ARGV: bytes the job needs, the share of maxmemory (0.9), seconds admissions are counted
-- Returns {1 admitted or 0 not, bytes used and admitted lately, maxmemory (0: no limit)}.
local info = redis.call('INFO', 'memory')
local used = tonumber(string.match(info, 'used_memory:(%d+)')) or 0
local max = tonumber(string.match(info, 'maxmemory:(%d+)')) or 0
if max == 0 then
  return {1, used, 0}
end
local now = tonumber(redis.call('TIME')[1])
local window = tonumber(ARGV[3])
local admitted = 0
for second = now - window + 1, now do
  admitted = admitted + (tonumber(redis.call('GET', KEYS[1] .. ':' .. second)) or 0)
end
local need = tonumber(ARGV[1])
if used + admitted + need > max * tonumber(ARGV[2]) then
  return {0, used + admitted, max}
end
redis.call('INCRBY', KEYS[1] .. ':' .. now, need)
redis.call('EXPIRE', KEYS[1] .. ':' .. now, window + 1)
return {1, used + admitted, max}
