-- Count one more request for a model, decaying the old count: score = score*exp(-dt/tau) + 1.
-- KEYS[1] ggufq:demand  (hash) model -> "score:last_time"
-- ARGV: model, now, tau_s
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local now, tau = tonumber(ARGV[2]), tonumber(ARGV[3])
local score = 0
if raw then
  local s, t = string.match(raw, '([^:]+):([^:]+)')
  local dt = now - tonumber(t)
  if dt < 0 then dt = 0 end
  score = tonumber(s) * math.exp(-dt / tau)
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.6f:%.3f', score + 1, now))
return 1
