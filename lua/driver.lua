-- driver.lua: one atomic decision over one or more limits.
--
-- KEYS:  the keys of each limit in order (sliding log: 2, others: 1), all
--        sharing one hash tag so the script runs on one cluster slot.
-- ARGV:  [1] now (us since the epoch; 0 = read Redis TIME, the production path)
--        [2] max_wait (us): a grant may be reserved this far in the future
--        [3] n, the number of limits; then 6 values per limit:
--            algorithm (1 sliding log, 2 token bucket, 3 gcra, 4 fixed window,
--            5 sliding window), 4 parameters, cost (0 = peek, changes nothing)
-- Reply: { outcome (0 granted, 1 denied, 2 cost exceeds a capacity),
--          wait (us until the grant for 0; retry-after for 1; -1 for 2),
--          now (us),
--          then per limit: wait_i (us until it alone allows, -1 never),
--                          remaining, reset_after (us) }
-- All limits are granted together at one time T = max wait_i, or none is.
local algorithms = { sliding_log, token_bucket, gcra, fixed_window, sliding_window }

local now = tonumber(ARGV[1])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local max_wait = tonumber(ARGV[2])
local n = tonumber(ARGV[3])

local limits = {}
local at = now
local never = false
local next_key = 1
for i = 1, n do
  local o = 3 + (i - 1) * 6
  local alg = algorithms[tonumber(ARGV[o + 1])]
  local p = { tonumber(ARGV[o + 2]), tonumber(ARGV[o + 3]), tonumber(ARGV[o + 4]), tonumber(ARGV[o + 5]) }
  local cost = tonumber(ARGV[o + 6])
  local keys = { KEYS[next_key], KEYS[next_key + 1] }
  next_key = next_key + alg.nkeys
  local st = alg.load(keys, p, now)
  local t = now
  if cost > 0 then t = alg.earliest(st, p, now, cost) end
  if t < 0 then
    never = true
  elseif t > at then
    at = t
  end
  limits[i] = { alg = alg, p = p, cost = cost, st = st, t = t }
end

local outcome, wait = 0, at - now
if never then
  outcome, wait = 2, -1
elseif wait > max_wait then
  outcome = 1
end

local reply = { outcome, wait, now }
for i = 1, n do
  local l = limits[i]
  local as_of = now
  if outcome == 0 then
    as_of = at
    if l.cost > 0 then
      l.alg.grant(l.st, l.p, at, l.cost)
      l.alg.save(l.st, l.p, now)
    end
  end
  local remaining, reset = l.alg.status(l.st, l.p, now, as_of)
  local t = -1
  if l.t >= 0 then t = l.t - now end
  reply[#reply + 1] = t
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
end
return reply
