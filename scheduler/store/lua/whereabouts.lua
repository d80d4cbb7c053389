-- Whether a job is where its custody record says, in one step: the record's state and
-- epoch, and whether the place that state names holds it. What a waiting reader asks now
-- and then (scheduler/store/whereabouts.py): a job recorded live and held nowhere would
-- keep it waiting until its timeout. Given no prelude (scheduler/store/scripts.py: BARE).
-- Moves no job: reads only
-- KEYS[1] ggufq:job:<id>:custody (hash) the job's record: state, epoch, holder, device
--         ("<epoch>|<device>": the epoch of the move that wrote it)
-- KEYS[2] ggufq:in_hand (hash) where a placing job is held, as "<holder>|<job id>"
-- KEYS[3] ggufq:parked (sorted set) where a parked job waits
-- KEYS[4] ggufq:orphans (hash) where an orphaned job waits
-- Also touches, by name: ggufq:inflight:<device> (hash) where a job sent or running is
-- ARGV: job id
-- Returns {state, epoch, held, device}: held is 1 when that place holds the job, 0 when
-- it does not, -1 when no place is looked at (no record; submitted; ended; sent or
-- running with no device written by its last move, as versions before it wrote).
local record = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'holder', 'device')
local state, job_id = record[1] or '', ARGV[1]
-- the device its last move wrote ("<epoch>|<device>"), none when an older version moved it
local at, device = string.match(record[4] or '', '^(%d+)|(.+)$')
if not at or at ~= record[2] then device = '' end
local held = -1
if state == 'placing' then
  held = redis.call('HEXISTS', KEYS[2], (record[3] or '') .. '|' .. job_id)
elseif state == 'parked' then
  held = redis.call('ZSCORE', KEYS[3], job_id) and 1 or 0
elseif state == 'orphaned' then
  held = redis.call('HEXISTS', KEYS[4], job_id)
elseif (state == 'sent' or state == 'running') and device ~= '' then
  held = redis.call('HEXISTS', 'ggufq:inflight:' .. device, job_id)
end
return {state, record[2] or '', held, device}
