-- A job ended on its worker: it is no longer running, nor in flight on its device, unless
-- it was placed again meanwhile (then the record has another placement id).
-- KEYS[1] ggufq:running            (hash) job id -> time it started
-- KEYS[2] ggufq:inflight:<dev>     (hash) job id -> {job, placement, ...} as JSON
-- ARGV: job id, placement id
-- Returns 1 when the in-flight record was this placement's and is gone, else 0.
return done_with(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
