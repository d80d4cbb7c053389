-- Move a server-side batch (api_client/batches/states.py) to another state: a
-- compare-and-set on its state, from one of the states the move table allows, and, for
-- its driver's moves, only while the driver holds its lease.
-- KEYS: batch record, active batches, its lease, its sent lines, its lines' ends
-- ARGV: holder ('' for a caller's move), target, sources (comma-separated), seconds an
--       ended batch is kept, then field, value, ... to set with the move
-- Returns {outcome, state before}: moved, same (it is there already: a reply lost),
-- refused (not from that state), lease (the holder lost its lease), missing.
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'missing', ''} end
if ARGV[1] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[1] then return {'lease', state} end
if state == ARGV[2] then return {'same', state} end
local allowed = false
for source in string.gmatch(ARGV[3], '[^,]+') do
  if source == state then allowed = true end
end
if not allowed then return {'refused', state} end
redis.call('HSET', KEYS[1], 'state', ARGV[2], ARGV[2] .. '_at', redis.call('TIME')[1])
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
local ended = {completed = true, failed = true, expired = true, cancelled = true}
if ended[ARGV[2]] then
  redis.call('SREM', KEYS[2], string.sub(KEYS[1], #'ggufq:batch:' + 1))
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
  redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])  -- its files hold what these held
end
return {'moved', state}
