-- fleet.lua: op 8, the fleet's heartbeat (see src/store/redis/fleet.rs).
-- KEYS[1]: the fleet's sorted set; after the options, ARGV[2]: this
-- instance's id, ARGV[3]: how long (ms) it is counted after this beat.
-- Adds or refreshes the id, scored by when it stops counting, drops the
-- ids past theirs, keeps the set as long as its last id, and answers how
-- many ids count, as a decimal string. Every time here is the server's
-- `TIME`, never the options' OPT_NOW (a store's own clock): the instances
-- stamp and prune on one clock, so one whose clock runs ahead drops no
-- other, nor one behind keeps the gone.
local function heartbeat(keys, args)
  if not rcall then bind() end
  local key, id, counted = keys[1], args[2], tonumber(args[3])
  if not (key and id and counted) then return redis.error_reply('malformed heartbeat') end
  local t = rcall('TIME')
  local now = t[1] * 1000 + math.floor(t[2] / 1000)
  rcall('ZADD', key, now + counted, id)
  rcall('ZREMRANGEBYSCORE', key, '-inf', '(' .. now)
  local last = rcall('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then rcall('PEXPIREAT', key, last[2]) end
  return tostring(rcall('ZCARD', key))
end
