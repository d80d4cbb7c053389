-- Whether a job is where its custody record says, in one step: the record's state and
-- epoch, and whether the place that state names holds the job. What a waiting reader
-- asks now and then (scheduler/store/whereabouts.py): a job recorded live and held nowhere
-- would keep it waiting until its timeout.
-- Moves no job: reads only
-- KEYS[1] ggufq:job:<id>:custody (hash) the job's record: state, epoch, holder
-- KEYS[2] ggufq:in_hand (hash) where a placing job is held, as "<holder>|<job id>"
-- KEYS[3] ggufq:parked (sorted set) where a parked job waits
-- KEYS[4] ggufq:orphans (hash) where an orphaned job waits
-- ARGV: job id
-- Returns {state, epoch, held}: held is 1 when that place holds the job, 0 when it does
-- not, -1 when no place is looked at (no record; submitted, sent or running: the
-- device's records, which only a device's reap reads; ended).
local record = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'holder')
local state, job_id = record[1] or '', ARGV[1]
local held = -1
if state == 'placing' then
  held = redis.call('HEXISTS', KEYS[2], (record[3] or '') .. '|' .. job_id)
elseif state == 'parked' then
  held = redis.call('ZSCORE', KEYS[3], job_id) and 1 or 0
elseif state == 'orphaned' then
  held = redis.call('HEXISTS', KEYS[4], job_id)
end
return {state, record[2] or '', held}
