-- A job's custody record, a prelude: ggufq:job:<id>:custody (hash) names the state the job
-- is in (scheduler/custody.py), who holds it (a placement process, or the placement id a
-- device runs it under; '' for a queue), its epoch (raised at every move: each move hands
-- the job over), when it moved (Redis's clock) and, sent or running, its device. Every
-- script that moves a job writes it in the same step as the job's other keys, so the two
-- cannot part. A move from the recorded state that the custody table does not give the
-- script (its header's "Moves a job" line) is refused whole: the script checks it
-- (may_move) before its first write, writes nothing, answers as it does when the job is
-- not the caller's, and the refusal is counted in ggufq:custody:refused (``ggufq fsck``
-- reports it for a day); so a job recorded ended stays so, and placement cannot end a job
-- a worker runs. Its holder fences the writes of a run (lua/_ends.lua: a placement id that
-- is no longer the holder writes no chunk and no end), and ``run`` (a placement id) with
-- ``delivery`` (the id of the delivery that runs it) claims the one run of that placement
-- (lua/start.lua). The record also fences a job's holds (lua/_hands.lua): the token of its
-- last hold, whether that hold ended with its send (``sent``), and '1' (put back, ended,
-- or let go of a job recorded elsewhere) or '2' (let go only: it was sent, or had ended)
-- once a sweep took that hold from a silent holder. ggufq:custody:live holds the ids of
-- jobs not ended: one that stays there with no place in Redis is a job lost.
-- CUSTODY_MOVES (the script's own moves) and CUSTODY_ENDED are written above this prelude
-- from the table (scheduler/store/scripts.py).
-- Touches, by name: ggufq:job:<id>:custody, ggufq:custody:live, ggufq:custody:refused.

local CUSTODY_LIVE, CUSTODY_REFUSED = 'ggufq:custody:live', 'ggufq:custody:refused'
local CUSTODY_LIVE_TTL = 7 * 86400  -- a record of a job not ended outlives no week

local function custody_key(job_id) return 'ggufq:job:' .. job_id .. ':custody' end

-- Whether the custody table refuses to move the job whose ``record`` (HMGET state, epoch,
-- holder) was read to ``target`` under ``holder``: not when there is no record (a job not
-- placed yet, or one whose record Redis lost with its data: a restart without it),
-- nor when it moved so already (asked again after a lost reply). A refusal is counted.
local function refused(record, target, holder)
  local source = record[1]
  if not source or (source == target and record[3] == holder) then return false end
  local name = source .. ' -> ' .. target
  if CUSTODY_MOVES[name] then return false end
  redis.call('HINCRBY', CUSTODY_REFUSED, name, 1)
  redis.call('EXPIRE', CUSTODY_REFUSED, 86400)  -- reported for a day after the last
  return true
end

local function read_record(key) return redis.call('HMGET', key, 'state', 'epoch', 'holder') end

-- Move the job whose record is ``key`` to ``target`` under ``holder`` (on ``device``, for
-- a job sent or running: where a reader's look finds it, lua/whereabouts.lua; written as
-- "<epoch>|<device>", so that a move by a version that wrote none, raising the epoch, leaves
-- one no look trusts); an ended record expires after ``ended_ttl`` s, with the job's
-- stream. Returns the new epoch (the one it has, asked again after a lost reply), or nil
-- when the table refuses the move.
local function move_record(key, target, holder, ended_ttl, device)
  local job_id = string.sub(key, #'ggufq:job:' + 1, -#':custody' - 1)
  local record = read_record(key)
  if refused(record, target, holder) then return nil end
  if record[1] == target and record[3] == holder then return tonumber(record[2]) end
  local epoch = (tonumber(record[2]) or 0) + 1
  local text = tostring(epoch)  -- the one text of it, in the record and in its device's field
  redis.call('HSET', key, 'state', target, 'epoch', text, 'holder', holder, 'at', now_s(),
    'device', device and (text .. '|' .. device) or '')
  if CUSTODY_ENDED[target] then
    redis.call('SREM', CUSTODY_LIVE, job_id)
    redis.call('EXPIRE', key, tonumber(ended_ttl) or 86400)
  else
    redis.call('SADD', CUSTODY_LIVE, job_id)
    redis.call('EXPIRE', key, CUSTODY_LIVE_TTL)
  end
  return epoch
end

local function move(job_id, target, holder, device)
  return move_record(custody_key(job_id), target, holder, nil, device)
end

-- Whether the job may move to ``target`` under ``holder``: a script asks before its first
-- write, and writes nothing when it may not.
local function may_move(job_id, target, holder)
  return not refused(read_record(custody_key(job_id)), target, holder)
end

-- Whether a run of the job under ``placement_id`` was claimed (lua/start.lua).
local function started_under(job_id, placement_id)
  return redis.call('HGET', custody_key(job_id), 'run') == placement_id
end

-- The holder and job id of a hold's field "<placement>|<job id>", nil when it does not parse.
local function hold_of(field)
  return string.match(field, '^(.*)|([^|]*)$')
end

-- Whether the job held under ``field`` may be taken in hand (moved to placing).
local function may_hold(field)
  local holder, job_id = hold_of(field)
  return job_id ~= nil and may_move(job_id, 'placing', holder)
end

-- A job taken in hand under ``field`` ("<placement>|<job id>") and ``token``: placing,
-- held by that process; the record keeps the token of its last hold, and whether its send
-- (``sent``) or a sweep (``swept``) ended that hold, until the next hold.
local function hold(field, token)
  local holder, job_id = hold_of(field)
  if not job_id then return 0 end
  local epoch = move(job_id, 'placing', holder)
  if not epoch then return 0 end
  redis.call('HSET', custody_key(job_id), 'token', token, 'swept', '', 'sent', '')
  return epoch
end
