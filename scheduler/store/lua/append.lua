-- Append one chunk to a job's stream and publish it, unless the job was taken back from the
-- placement whose worker writes it: a worker that stalled past the TTL and came back must
-- not write into the stream of the job's new run (or after placement ended it).
-- Moves a job (scheduler/custody.py): running -> done, running -> failed, running -> cancelled
-- KEYS[1] ggufq:job:<id>:owner  (string) placement id, or "orphaned"
-- KEYS[2] ggufq:job:<id>:chunks (stream) entry ids 0-<seq>
-- KEYS[3] ggufq:job:<id>        (pub/sub channel)
-- ARGV: fence (the writer's placement id; "" writes whatever the owner), seq, payload, ttl_s
-- Returns streams.Appended: 1 WRITTEN, 0 FENCED (the owner is another placement id),
-- -1 DUPLICATE (the stream already had this seq).
local owner = redis.call('GET', KEYS[1])
if ARGV[1] ~= '' and owner and owner ~= ARGV[1] then return 0 end
local added = redis.pcall('XADD', KEYS[2], '0-' .. ARGV[2], 'c', ARGV[3])
if type(added) == 'table' and added.err then return -1 end
redis.call('PUBLISH', KEYS[3], ARGV[3])
-- every write renews the expiry, so a stream outlives its job by ttl_s however long it runs
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
