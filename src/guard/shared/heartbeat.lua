-- A replica says it is alive and learns how many are: KEYS[1] is the set of replicas by when each was last seen
-- (milliseconds of Redis's clock); ARGV: this replica's id, how long one counts as seen (ms). Returns whether this
-- replica was added (not in the set: its first beat, or the set lost or the replica forgotten since its last) and how
-- many replicas the set holds.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local window = tonumber(ARGV[2])
local added = redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('PEXPIRE', KEYS[1], window)
return {added, redis.call('ZCARD', KEYS[1])}
