-- A census for ggufq fsck (scheduler/store/fsck.py): every place a job, a runner or a
-- reservation lives, read in one atomic look, so that a busy cluster shows no job between
-- two of its own steps. Reads only.
-- Touches, by name: ggufq:devices, ggufq:runners, ggufq:running, ggufq:parked,
-- ggufq:orphans, ggufq:in_hand (their members), ggufq:resv:<dev>, ggufq:inflight:<dev>,
-- ggufq:runner:<id> (model, in_flight, devices) and its :jobs, ggufq:parked:<id>,
-- ggufq:job:<id>:custody (holder), ggufq:parked:model_of (the parked jobs' index by model),
-- ggufq:heartbeats, ggufq:due:sent and ggufq:due:counted (their members),
-- ggufq:custody:live (its members' ggufq:job:<id>:custody state), ggufq:custody:refused,
-- ggufq:due:final (its members: final chunks owed to streams' own Redis)
-- Returns {devices, running, parked, orphans, held (the fields: who holds each job), parked ids that
-- have their record, {runner id, model, in_flight, devices JSON, its jobs' placement
-- ids}..., {device id, reservations (flat runner, bytes), in-flight records (flat job,
-- record)}..., holders (flat job, custody holder or ''), the job ids in the parked jobs' index,
-- the devices that have a beat, the sends due, the counts due, the custody records of the
-- jobs not ended (flat job, state), the refused moves (flat move, count), the jobs whose
-- final chunk is owed}
local devices = redis.call('SMEMBERS', 'ggufq:devices')
local parked = redis.call('ZRANGE', 'ggufq:parked', 0, -1)
local recorded = {}
for _, id in ipairs(parked) do
  if redis.call('EXISTS', 'ggufq:parked:' .. id) == 1 then table.insert(recorded, id) end
end
local runners = {}
for _, id in ipairs(redis.call('SMEMBERS', 'ggufq:runners')) do
  local r = redis.call('HMGET', 'ggufq:runner:' .. id, 'model', 'in_flight', 'devices')
  if r[1] then
    local jobs = redis.call('HKEYS', 'ggufq:runner:' .. id .. ':jobs')
    table.insert(runners, {id, r[1], r[2] or '0', r[3] or '{}', jobs})
  end
end
local per_device, holders = {}, {}
for _, dev in ipairs(devices) do
  local sent = redis.call('HGETALL', 'ggufq:inflight:' .. dev)
  for i = 1, #sent, 2 do
    table.insert(holders, sent[i])
    table.insert(holders, redis.call('HGET', 'ggufq:job:' .. sent[i] .. ':custody', 'holder') or '')
  end
  table.insert(per_device, {dev, redis.call('HGETALL', 'ggufq:resv:' .. dev), sent})
end
local custody = {}
for _, id in ipairs(redis.call('SMEMBERS', 'ggufq:custody:live')) do
  table.insert(custody, id)
  table.insert(custody, redis.call('HGET', 'ggufq:job:' .. id .. ':custody', 'state') or '')
end
return {
  devices,
  redis.call('HKEYS', 'ggufq:running'),
  parked,
  redis.call('HKEYS', 'ggufq:orphans'),
  redis.call('HKEYS', 'ggufq:in_hand'),
  recorded,
  runners,
  per_device,
  holders,
  redis.call('HKEYS', 'ggufq:parked:model_of'),
  redis.call('ZRANGE', 'ggufq:heartbeats', 0, -1),
  redis.call('ZRANGE', 'ggufq:due:sent', 0, -1),
  redis.call('ZRANGE', 'ggufq:due:counted', 0, -1),
  custody,
  redis.call('HGETALL', 'ggufq:custody:refused'),
  redis.call('ZRANGE', 'ggufq:due:final', 0, -1),
}
