-- Record that these keys changed (writes done by plain commands, such as heartbeats).
-- KEYS: any keys
for _, key in ipairs(KEYS) do changed(key) end
return #KEYS
