-- A job's end, a prelude: its steps, which end.lua takes at once (append.lua writes the
-- other chunks with the first).
-- Touches, by name: nothing; the keys are the callers'.

-- Whether the run under ``fence`` (a placement id; '' writes whatever the holder) may not
-- write to the job whose custody record is ``custody``: the record names another holder, or
-- the chunk is final and the custody table refuses its move to ``outcome`` (the job ended
-- already, say), which is fenced as another holder's chunk is. One read of the record.
local function fenced_off(custody, fence, outcome)
  local record = read_record(custody)
  local holder = record[3]
  return fence ~= '' and holder and holder ~= fence
      or outcome ~= '' and refused(record, outcome, fence)
end

-- Append one chunk to a job's stream and publish it, unless the job's custody record
-- ``custody`` names another holder than ``fence``, the placement id of the run that writes
-- it ('' writes whatever the holder): a job taken from that run (orphaned, parked, placing,
-- sent under another placement id, or ended by placement) refuses its chunks; only a job
-- Redis forgot whole is written by whoever runs it. Returns streams.Appended: 1 WRITTEN,
-- 0 FENCED, -1 DUPLICATE (this seq is there already). A final chunk written moves the
-- record to ``outcome`` (done, failed, cancelled; '' for a chunk that is not final).
local function append_chunk(chunks, channel, fence, seq, payload, ttl, custody, outcome)
  local id = '0-' .. seq
  if fenced_off(custody, fence, outcome) then
    -- this very chunk, written before the job was taken from this run (its answer was
    -- lost and it is asked again): not fenced. Another run's chunk of the seq is not it.
    local there = redis.call('XRANGE', chunks, id, id)
    if #there > 0 and there[1][2][2] == payload then return -1 end
    return 0
  end
  local added = redis.pcall('XADD', chunks, id, 'c', payload)
  if type(added) == 'table' and added.err then return -1 end
  redis.call('PUBLISH', channel, payload)
  -- every write renews the expiry, so a stream outlives its job by ttl however long it runs
  redis.call('EXPIRE', chunks, ttl)
  if outcome ~= '' then move_record(custody, outcome, fence, ttl) end
  return 1
end

-- End a job that will not run (or not run again): out of the parked queue if it waits
-- there, and its final chunk ``chunk`` (a JSON object with keys and no seq) after whatever
-- its stream holds, unfenced; its custody record moves to ``outcome``. ``elsewhere`` '1':
-- the stream lives on a Redis of its own (scheduler/store/shards.py), where the caller
-- writes the chunk next, with lua/final.lua; only the record moves here (the chunk owed:
-- ggufq:due:final). ``elsewhere`` '2': this is that Redis, and a stream that ended already
-- gets no second final chunk (-1, as a duplicate). Touches, by name,
-- the job's keys: ggufq:parked, ggufq:parked:<id> and its model's index, and
-- ggufq:job:<id>:chunks, :custody and its channel. Returns streams.Appended: -1 too for a
-- job recorded ended so already (asked again), with nothing written.
local function end_unrun(job_id, chunk, ttl, outcome, elsewhere)
  local job = 'ggufq:job:' .. job_id
  -- not a job whose record says it runs, or ended otherwise (FENCED): it is not unrun; on
  -- the stream's own Redis, whose record moves only with a final chunk, it ended already
  local record = read_record(job .. ':custody')
  if refused(record, outcome, '') then return elsewhere == '2' and -1 or 0 end
  -- ended so already (asked again after a lost reply, or a sweep ending what its holder
  -- ended as it stalled): its final chunk is there, or owed; none a second time
  if record[1] and CUSTODY_ENDED[record[1]] then return -1 end
  redis.call('ZREM', 'ggufq:parked', job_id)
  redis.call('DEL', 'ggufq:parked:' .. job_id)
  unindex(job_id)
  if elsewhere == '1' then
    move_record(job .. ':custody', outcome, '', ttl)
    owe_final(job_id, job .. ':custody', chunk)
    return 1
  end
  local last = redis.call('XREVRANGE', job .. ':chunks', '+', '-', 'COUNT', 1)
  local seq = 1
  if #last > 0 then
    seq = tonumber(string.match(last[1][1], '%-(%d+)$')) + 1
    if elsewhere == '2' then  -- written owed, on the stream's own Redis: once
      local ok, there = pcall(cjson.decode, last[1][2][2])
      if ok and type(there) == 'table' and there['done'] then return -1 end
    end
  end
  -- the seq goes in front of the chunk's other keys as text: a decode and encode here
  -- would turn its empty lists into objects
  local payload = string.format('{"seq": %d, ', seq) .. string.sub(chunk, 2)
  return append_chunk(job .. ':chunks', job, '', seq, payload, ttl, job .. ':custody', outcome)
end

-- The job is no longer running, nor in flight on its device, unless it was placed again
-- meanwhile (its in-flight record, or its custody record ``custody``, then names another
-- placement id: the new run's running mark stays). Returns 1 when the in-flight record was
-- this placement's and is gone, else 0.
local function done_with(running, inflight, job_id, placement_id, custody)
  -- its holder: the placement id it was sent under, '' once orphaned or ended unrun, nil
  -- when Redis has no record of it (a restart without its data)
  local holder = redis.call('HGET', custody, 'holder')
  if not holder or holder == '' or holder == placement_id then
    redis.call('HDEL', running, job_id)
  end
  local raw = redis.call('HGET', inflight, job_id)
  local placement = placement_of(raw)
  if placement and placement['id'] == placement_id then
    redis.call('HDEL', inflight, job_id)
    redis.call('ZREM', DUE_SENT, sent_due(job_id, placement_id, tostring(placement['device_id'])))
    return 1
  end
  return 0
end

-- Count a placement of a job off its runner (its job set: counting it off again changes
-- nothing), and set when the runner expires if it is now idle. ``keep`` '' keeps the
-- runner's keep_alive_s. Returns the jobs it still counts, -1 when it is gone.
local function count_off(runner, placement, now, keep)
  if redis.call('EXISTS', runner) == 0 then return -1 end
  local left = count_out(runner, placement)
  local alive_s = tonumber(keep)
  if keep == '' then alive_s = tonumber(redis.call('HGET', runner, 'keep_alive_s') or '-1') end
  local expires = expiry(now, left, alive_s)
  redis.call('HSET', runner, 'last_used', now, 'keep_alive_s', alive_s, 'expires_at', expires)
  changed(runner)
  return left
end
