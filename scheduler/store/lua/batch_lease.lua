-- The lease of a batch's driver, on Redis's clock: taken when nobody holds it, renewed or
-- given back only by its holder.
-- KEYS: the lease
-- ARGV: holder, 'take' | 'renew' | 'release', milliseconds it lasts
-- Returns 1 when the holder holds it (or gave it back), 0 when another does.
local holder = redis.call('GET', KEYS[1])
if ARGV[2] == 'take' then
  if holder and holder ~= ARGV[1] then return 0 end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[3]))
  return 1
end
if holder ~= ARGV[1] then return 0 end
if ARGV[2] == 'release' then redis.call('DEL', KEYS[1]) return 1 end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
