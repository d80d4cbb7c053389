-- Jobs in hand, a prelude: a placement process holds each job it handles in ggufq:in_hand
-- (field "<placement>|<job id>", JSON token, what, at, record) until it sends, parks or
-- ends it (scheduler/store/hands.py).
-- Touches, by name: the parked jobs' index by model: ggufq:parked:model_of (hash: job id ->
-- model), ggufq:parked:model:<model> (sorted set, as ggufq:parked), ggufq:parked:models
-- (hash: model -> its parked jobs).

-- Whether a job held under ``token`` was taken from its holder: its custody record
-- ``record`` (ggufq:job:<id>:custody) says another hold took it since (its last hold's
-- token is another), or a sweep took this hold ('1': put back or ended, or let go of a job
-- its record places elsewhere; '2': let go only, it was sent or had ended). Its holder (it
-- had stalled) must not send, park or end it. A record with no token (gone with Redis's
-- data, or never held) tells nothing.
local function put_back_from_us(record, token)
  local last = redis.call('HMGET', record, 'token', 'swept')
  if not last[1] or last[1] == '' then return false end
  return last[1] ~= token or (last[2] and last[2] ~= '')
end

-- Whether a job's custody record says it moved on from being placed (it was sent, parked
-- or ended since): its holder must not send or park it again. No record tells nothing.
local function moved_on(record)
  local state = redis.call('HGET', record, 'state')
  return state and state ~= 'placing'
end

-- The entry a job is held under when it is held under ``token``, decoded; nil otherwise.
local function held_entry(in_hand, field, token)
  local held = redis.call('HGET', in_hand, field)
  if not held then return nil end
  local ok, entry = pcall(cjson.decode, held)
  if ok and type(entry) == 'table' and entry['token'] == token then return entry end
  return nil
end

-- Whether a job held under ``token`` was sent by its send step (lua/sent.lua), which let
-- go of the hold in the same step: its custody ``record`` says this hold ended with its
-- send, or a sweep let go of it because it was sent (swept '2'; also for a job that had
-- ended). Both outlive a reap of its device, which rewrites its holder.
local function sent_from_us(token, record)
  if token == '' then return false end
  local last = redis.call('HMGET', record, 'token', 'swept', 'sent')
  return last[1] == token and (last[2] == '2' or last[3] == '1')
end

-- Mark the entry of a job held under ``token`` (mark: 'ending'; value nil clears).
local function mark_held(in_hand, field, token, mark, value)
  local entry = held_entry(in_hand, field, token)
  if entry then
    entry[mark] = value
    redis.call('HSET', in_hand, field, cjson.encode(entry))
  end
end

-- Let go of a job held under ``token`` (a held entry that does not parse goes too).
local function let_go(in_hand, field, token)
  local held = redis.call('HGET', in_hand, field)
  if not held then return end
  local ok, entry = pcall(cjson.decode, held)
  if not ok or type(entry) ~= 'table' or entry['token'] == token then
    redis.call('HDEL', in_hand, field)
  end
end

-- A job's record back in its queue: ggufq:orphans (hash), or ggufq:parked (sorted set, by
-- the record's score) with its record under ``record_key``.
local function put_back(queue, record_key, what, job_id, raw)
  if what == 'orphan' then
    redis.call('HSET', queue, job_id, raw)
    return
  end
  local ok, record = pcall(cjson.decode, raw)
  local score = ok and type(record) == 'table' and tonumber(record['score']) or 0
  redis.call('SET', record_key, raw)
  redis.call('ZADD', queue, score, job_id)
  -- and in its model's index (keys.parked_of), so that a job's end reads only the parked
  -- jobs of its runner's model, and a new job learns which models wait without any record
  local job = ok and type(record) == 'table' and record['job']
  local model = type(job) == 'table' and job['model']
  local indexed = type(model) == 'string'
    and redis.call('HSETNX', 'ggufq:parked:model_of', job_id, model) == 1
  if indexed then
    redis.call('ZADD', 'ggufq:parked:model:' .. model, score, job_id)
    redis.call('HINCRBY', 'ggufq:parked:models', model, 1)
  end
end

-- Take a job out of its model's parked index (put_back's), if it is there.
local function unindex(job_id)
  local model = redis.call('HGET', 'ggufq:parked:model_of', job_id)
  if not model then return end
  redis.call('HDEL', 'ggufq:parked:model_of', job_id)
  redis.call('ZREM', 'ggufq:parked:model:' .. model, job_id)
  if redis.call('HINCRBY', 'ggufq:parked:models', model, -1) <= 0 then
    redis.call('HDEL', 'ggufq:parked:models', model)
  end
end
