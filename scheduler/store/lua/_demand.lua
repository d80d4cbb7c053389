-- Demand, a prelude: one more request for a model, the old count decayed
-- (score = score*exp(-dt/tau) + 1), in ggufq:demand (hash) model -> "score:last_time".
local function count_demand(key, model, now, tau)
  local raw = redis.call('HGET', key, model)
  now, tau = tonumber(now), tonumber(tau)
  local score = 0
  local s, t
  if raw then s, t = string.match(raw, '^([^:]+):([^:]+)$') end
  s, t = tonumber(s), tonumber(t)
  local finite = s and t and s >= 0 and s < math.huge and t > -math.huge and t < math.huge
  if finite then  -- anything else (nan fails every test) counts as no demand yet
    local dt = now - t
    if dt < 0 then dt = 0 end
    score = s * math.exp(-dt / tau)
  end
  redis.call('HSET', key, model, string.format('%.6f:%.3f', score + 1, now))
end
