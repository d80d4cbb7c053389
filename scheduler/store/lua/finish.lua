-- One job on a runner ended: count it off and set when the runner expires if now idle.
-- Counted once per placement of the job: a worker that writes the end again (its reply
-- was lost to a Redis outage) finds the job's end marker and changes nothing.
-- KEYS[1] ggufq:runner:<id>                       (hash)
-- KEYS[2] ggufq:job:<id>:ended:<placement id>     (string) absent: no marker is kept
-- ARGV: now, keep_alive_s (negative: never expires; "": the value the record has),
--       the marker's time to live in seconds
-- Returns the in-flight count left, or -1 when the runner is gone.
return count_off(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])
