-- Put back a job that a placement process had in hand when it died or stalled past the
-- TTL: its holder has not beaten since ``dead_before``, and took the job before that. The
-- job's custody record marks that hold swept ('1': put back), so that a holder that was
-- only stalled does nothing more with it (its send, park, end and take scripts look). A
-- job that ended, or whose entry is marked sent (as versions before the send let go of it
-- wrote it), is let go only ('2'); one its holder was ending, or whose entry does not
-- parse, is ended in the same step with the final chunk the caller gave for it (a crash
-- between letting go and ending would leave it nowhere). A holder sweeps its own entry
-- held past the TTL that none of its threads decides on any more (a Redis restored from an
-- older snapshot gave it back): then its own beat does not stop it.
-- Moves a job (scheduler/custody.py): placing -> parked, placing -> orphaned, placing -> failed
-- KEYS[1] ggufq:in_hand (hash)
-- KEYS[2] ggufq:placement:alive (sorted set: placement -> last beat)
-- KEYS[3] the queue the entry names: ggufq:parked or ggufq:orphans
-- KEYS[4] ggufq:parked:<id> (string), unused for an orphan
-- KEYS[5] ggufq:job:<id>:custody (hash) the job's record: its hold's token, sweep, send
-- Also touches, by name: the job's keys lua/_ends.lua's end_unrun names, when it ends it
-- ARGV: field, token, placement, dead_before, job id, '1' when the job has ended already,
--       '1' when the placement sweeps its own entry, the final chunk of a job its holder
--       was ending, that of a job whose entry does not parse (JSON objects with keys and
--       no seq), stream ttl (s), '1' when the job's stream lives on a Redis of its own
--       (the caller writes the final chunk there: lua/final.lua)
-- Returns hands.Swept: 1 PUT_BACK, 2 LET_GO, 3 ENDING (let go of a job its holder was
-- ending, and ended), -1 UNREADABLE (let go of an entry that does not parse, and its job
-- ended), 0 NOTHING (gone, another token, or its holder is alive).
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held then return 0 end
local ok, entry = pcall(cjson.decode, held)
local readable = ok and type(entry) == 'table' and type(entry['record']) == 'string'
if readable and (entry['token'] ~= ARGV[2] or (tonumber(entry['at']) or 0) >= tonumber(ARGV[4])) then
  return 0
end
local beat = redis.call('ZSCORE', KEYS[2], ARGV[3])
if ARGV[7] ~= '1' and beat and tonumber(beat) >= tonumber(ARGV[4]) then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
local outcome = 1
if not readable then
  outcome = -1
elseif ARGV[6] == '1' or entry['sent'] then
  outcome = 2
elseif entry['ending'] then
  outcome = 3
end
-- a job whose record says it is elsewhere (the table allows no such move) is let go only;
-- its stalled holder, should it come back, finds it put back ('1'), not sent
local target = readable and entry['what'] == 'orphan' and 'orphaned' or 'parked'
local elsewhere = outcome == 1 and not may_move(ARGV[5], target, '')
    or (outcome == 3 or outcome == -1) and not may_move(ARGV[5], 'failed', '')
if elsewhere then outcome = 2 end
if outcome == 1 then
  put_back(KEYS[3], KEYS[4], entry['what'], ARGV[5], entry['record'])
  move(ARGV[5], target, '')
elseif outcome == 3 or outcome == -1 then
  end_unrun(ARGV[5], outcome == 3 and ARGV[8] or ARGV[9], ARGV[10], 'failed', ARGV[11] or '')
end
-- the hold is the sweep's now: its stalled holder, should it come back, leaves the job
local token = redis.call('HGET', KEYS[5], 'token')
if ARGV[2] ~= '' and (not token or token == ARGV[2]) then
  local swept = outcome == 2 and not elsewhere and '2' or '1'
  redis.call('HSET', KEYS[5], 'token', ARGV[2], 'swept', swept)
  if redis.call('TTL', KEYS[5]) < 0 then redis.call('EXPIRE', KEYS[5], CUSTODY_LIVE_TTL) end
end
return outcome
