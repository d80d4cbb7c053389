-- A job id's claim on the normal path (api_client/client.py): an id belongs to the job
-- first submitted with it, for as long as Redis knows that job. A reused id would read,
-- or cancel, another job's stream and result; one whose claim lapsed while its job's
-- custody record lives (the job waits long, or ended lately) is taken too. The fast path
-- makes the same check in lua/fast_send.lua.
-- KEYS[1] ggufq:job:<id>:submitted (string: when its job was submitted)
-- KEYS[2] ggufq:job:<id>:custody   (hash) the job's record
-- ARGV: submitted at, claim ttl (s)
-- Returns 1 when the id is this submission's (also when it was claimed so already and the
-- reply lost), 0 when it is taken.
local claim = redis.call('GET', KEYS[1])
if claim then return claim == ARGV[1] and 1 or 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
