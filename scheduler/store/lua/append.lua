-- Append one chunk to a job's stream and publish it, unless the job was taken back from the
-- placement whose worker writes it: a worker that stalled past the TTL and came back must
-- not write into the stream of the job's new run (or after placement ended it).
-- KEYS[1] ggufq:job:<id>:owner  (string) placement id, or "orphaned"
-- KEYS[2] ggufq:job:<id>:chunks (stream) entry ids 0-<seq>
-- KEYS[3] ggufq:job:<id>        (pub/sub channel)
-- ARGV: fence (the writer's placement id; "" writes whatever the owner), seq, payload, ttl_s
-- Returns streams.Appended: 1 WRITTEN, 0 FENCED (the owner is another placement id),
-- -1 DUPLICATE (the stream already had this seq).
return append_chunk(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
