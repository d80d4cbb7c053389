-- What changed since placement's snapshot cache last looked (scheduler/placement/
-- snapcache.py), in one step: the change log's counter, the number of parked jobs, the
-- log's entries after ARGV[1] (at most ARGV[2]), and the keys they name read again: a
-- device's hash, a runner's hash, a device's reservations (their values). With ARGV[3]
-- '0' (the cache reloads everything anyway) only the counter and the parked count.
-- Reads only.
-- Touches, by name: ggufq:changes:n, ggufq:parked, ggufq:changes, and the keys the log
-- names (ggufq:device:<id>, ggufq:runner:<id>, ggufq:resv:<id>).
-- Returns {counter, parked, entries (as XRANGE gives them), {key, its reply}...}.
local counter = redis.call('GET', 'ggufq:changes:n') or '0'
local parked = redis.call('ZCARD', 'ggufq:parked')
if ARGV[3] == '0' then
  return {counter, parked, {}}
end
local entries = redis.call('XRANGE', 'ggufq:changes', '(' .. ARGV[1], '+', 'COUNT', ARGV[2])
local out = {counter, parked, entries}
local seen = {}
for _, entry in ipairs(entries) do
  local fields = entry[2]
  for i = 1, #fields, 2 do
    local key = fields[i + 1]
    if fields[i] == 'k' and not seen[key] then
      seen[key] = true
      local reply
      if string.sub(key, 1, 11) == 'ggufq:resv:' then
        reply = redis.call('HVALS', key)
      else
        reply = redis.call('HGETALL', key)
      end
      out[#out + 1] = {key, reply}
    end
  end
end
return out
