-- Change log, the prelude of every script: each key a script changes is appended to a
-- stream, numbered by a counter, so a placement process can keep its snapshot current by
-- reading only what changed (scheduler/placement/snapcache.py). A gap in the numbers means entries
-- were trimmed or lost: the reader then reloads everything.
-- Touches, by name: ggufq:changes (stream, fields n, k), ggufq:changes:n (counter)
local function changed(key)
  local n = redis.call('INCR', 'ggufq:changes:n')
  redis.call('XADD', 'ggufq:changes', 'MAXLEN', '~', 100000, '*', 'n', n, 'k', key)
end
