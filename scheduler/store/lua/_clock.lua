-- Redis's clock, a prelude: liveness is stamped and compared on it, never on a caller's,
-- so that no host's clock matters (scheduler/store/clock.py reads the same clock).
-- Touches, by name: nothing.
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
