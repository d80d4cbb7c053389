-- The parked jobs of some models with their records, in one step: what placement retries
-- after a job's end frees a slot of those models (scheduler/placement/parking.py).
-- Reads only. KEYS: the models' indexes (ggufq:parked:model:<model>); ARGV[1]: the prefix
-- of a parked job's record (ggufq:parked:<id>).
-- Returns a flat list: a job id, its park score, its record (nil when gone), and so on.
local out = {}
for _, index in ipairs(KEYS) do
  local found = redis.call('ZRANGE', index, 0, -1, 'WITHSCORES')
  for i = 1, #found, 2 do
    out[#out + 1] = found[i]
    out[#out + 1] = found[i + 1]
    out[#out + 1] = redis.call('GET', ARGV[1] .. found[i])
  end
end
return out
