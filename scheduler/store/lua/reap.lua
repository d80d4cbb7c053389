-- Drop devices whose worker stopped heartbeating (judged on Redis's clock, as the beats are
-- stamped), with their runners and reservations; the jobs sent to them become orphans, for
-- placement to re-place or fail.
-- Moves a job (scheduler/custody.py): sent -> orphaned, running -> orphaned
-- KEYS[1] ggufq:devices   (set)
-- KEYS[2] ggufq:runners   (set)
-- KEYS[3] ggufq:heartbeats (sorted set) device id -> last heartbeat
-- KEYS[4] ggufq:orphans   (hash) job id -> in-flight record
-- Also touches, by name: ggufq:device:<dev>, ggufq:resv:<dev>, ggufq:runner:<id>[:jobs],
-- ggufq:inflight:<dev> (hash) job id -> in-flight record, ggufq:job:<id>:custody,
-- ggufq:running (hash) job id -> start time, ggufq:due:sent, and the device's Celery
-- queues (lists)
-- ggufq.<dev with '.' for ':'> and ggufq.<...>.batch
-- ARGV: device_ttl_s
-- Returns the ids of the dropped devices.
local now, ttl = now_s(), tonumber(ARGV[1])
local dropped = {}
-- only the devices whose last beat is that old: a look costs the devices due, not all
for _, dev in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. (now - ttl))) do
  local beat = redis.call('HGET', 'ggufq:device:' .. dev, 'heartbeat')
  if not beat or (now - tonumber(beat)) > ttl then
    for _, rid in ipairs(redis.call('HKEYS', 'ggufq:resv:' .. dev)) do
      local runner = 'ggufq:runner:' .. rid
      drop_runner(KEYS[2], runner, rid, resv_keys_of(redis.call('HGET', runner, 'device_ids')))
    end
    local sent = redis.call('HGETALL', 'ggufq:inflight:' .. dev)
    for i = 1, #sent, 2 do
      local placement = placement_of(sent[i + 1])
      if placement then
        redis.call('ZREM', DUE_SENT,
          sent_due(sent[i], tostring(placement['id']), tostring(placement['device_id'])))
      end
      -- not a job another placement of it holds now (its running mark is that run's), nor
      -- one whose record says it is elsewhere: its in-flight record here outlived it
      local record = read_record(custody_key(sent[i]))
      local holder = record[3]
      local theirs = holder and holder ~= '' and placement and placement['id'] ~= nil
          and holder ~= tostring(placement['id'])
      if not theirs then redis.call('HDEL', 'ggufq:running', sent[i]) end
      if not theirs and not refused(record, 'orphaned', '') then
        redis.call('HSET', KEYS[4], sent[i], sent[i + 1])
        -- held by nobody now: a worker that comes back finds its writes fenced and does
        -- not go on running it (placement re-places or fails it)
        move(sent[i], 'orphaned', '')
      end
    end
    redis.call('DEL', 'ggufq:resv:' .. dev, 'ggufq:device:' .. dev, 'ggufq:inflight:' .. dev)
    -- its queues hold only messages of the jobs just orphaned: nothing will read them
    local queue = 'ggufq.' .. string.gsub(dev, ':', '.')
    redis.call('DEL', queue, queue .. '.batch')
    changed('ggufq:resv:' .. dev)
    changed('ggufq:device:' .. dev)
    redis.call('SREM', KEYS[1], dev)
    redis.call('ZREM', KEYS[3], dev)
    table.insert(dropped, dev)
  end
end
return dropped
