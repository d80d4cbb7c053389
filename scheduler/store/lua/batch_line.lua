-- A batch's driver writes down a line: the job it sends for it (before sending it), or
-- its end (once, in the output or the error file's lines). Fenced by the driver's lease:
-- a driver that stalled past its lease writes nothing.
-- KEYS: its lease, its sent lines (or its lines' ends), its record
-- ARGV: holder, line, value, the record's counter to raise ('' for a send)
-- Returns {outcome, value}: written, kept (the line has one already: that one is
-- returned), lease.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'lease', ''} end
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3]) == 0 then
  return {'kept', redis.call('HGET', KEYS[2], ARGV[2])}
end
if ARGV[4] ~= '' then redis.call('HINCRBY', KEYS[3], ARGV[4], 1) end
return {'written', ARGV[3]}
