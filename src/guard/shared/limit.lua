-- One shared limit's step, atomic in Redis: a generic cell rate algorithm on the bucket's theoretical arrival time
-- (when it would be full again), kept in microseconds by Redis's own clock so every replica reads one time.
-- KEYS[1]: the bucket. ARGV: mode, interval (µs per token), tolerance (µs: burst × interval), n, returned.
--   take:   take up to n tokens (a lease may be granted in part); returns {granted, 0} or {0, µs until one fits}.
--   check:  whether one token fits, taking nothing: {1, 0} or {0, µs}.
--   charge: charge n tokens whether or not they fit (a token budget runs into debt): {n, 0}.
-- Every mode first gives back `returned` tokens a lease did not spend.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local mode = ARGV[1]
local interval = tonumber(ARGV[2])
local tolerance = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local returned = tonumber(ARGV[5])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
tat = math.max(tat - returned * interval, now)
local granted, wait = 0, 0
if mode == 'charge' then
  tat = tat + n * interval
  granted = n
else
  local room = math.floor((now + tolerance - tat) / interval)
  if mode == 'check' then
    n = 1
  end
  granted = math.max(math.min(n, room), 0)
  if granted == 0 then
    wait = tat + interval - tolerance - now
  elseif mode == 'take' then
    tat = tat + granted * interval
  end
end
if tat > now then
  -- Kept a second past the time it is full again, then forgotten: a forgotten bucket is a full one.
  redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
else
  redis.call('DEL', KEYS[1])
end
return {granted, math.ceil(wait)}
