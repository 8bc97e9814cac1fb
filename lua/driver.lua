-- driver.lua: one atomic decision over one or more limits.
--
-- KEYS:  the keys of each limit in order (sliding log: 2, others: 1), all
--        sharing one hash tag so the script runs on one cluster slot.
-- ARGV:  [1] now (us since the epoch; 0 = read Redis TIME, the production path)
--        [2] max_wait (us): a grant may be reserved this far in the future
--        [3] 1 = dry run: decide, but grant and write nothing (a peek)
--        [4] expiry slack (us): keys outlive their state by this much
--        [5] n, the number of limits; then 6 values per limit:
--            algorithm (1 sliding log, 2 token bucket, 3 gcra, 4 fixed window,
--            5 sliding window), 4 parameters, cost (0 changes nothing)
-- Reply: { outcome (0 granted, 1 denied, 2 cost exceeds a capacity),
--          wait (us until the grant for 0; retry-after for 1; -1 for 2),
--          now (us, the decision's clock),
--          then per limit: wait_i (us until it alone allows, -1 never),
--                          remaining, reset_after (us) }
-- All limits are granted together at one time T = max wait_i, or none is.
--
-- Clock steps: every key records the clock of its last write (`hw`). The
-- decision's clock is the latest of the store's clock and those, so time never
-- runs backwards for a key: after a backward step, state written "in the
-- future" is read as of its own time (what it records is spent, not
-- reserved), and real reservations stay reservations. Expiries are set from
-- the store's own clock, so a key never expires early; they only reclaim
-- memory, since a state past its own `exp` reads as absent anyway.
local algorithms = { sliding_log, token_bucket, gcra, fixed_window, sliding_window }

local real = tonumber(ARGV[1])
if real == 0 then
  local t = redis.call('TIME')
  real = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local max_wait = tonumber(ARGV[2])
local dry = ARGV[3] == '1'
-- expiries count from here: the store's clock, less the slack
local ttl_from = real - tonumber(ARGV[4])
local n = tonumber(ARGV[5])

local limits = {}
local now = real
local next_key = 1
for i = 1, n do
  local o = 5 + (i - 1) * 6
  local alg = algorithms[tonumber(ARGV[o + 1])]
  local p = { tonumber(ARGV[o + 2]), tonumber(ARGV[o + 3]), tonumber(ARGV[o + 4]), tonumber(ARGV[o + 5]) }
  local keys = { KEYS[next_key], KEYS[next_key + 1] }
  next_key = next_key + alg.nkeys
  local st = alg.load(keys, p)
  if st.hw > now then now = st.hw end
  limits[i] = { alg = alg, p = p, cost = tonumber(ARGV[o + 6]), st = st }
end

local at = now
local never = false
for i = 1, n do
  local l = limits[i]
  l.alg.prepare(l.st, l.p, now)
  l.t = now
  if l.cost > 0 then l.t = l.alg.earliest(l.st, l.p, now, l.cost) end
  if l.t < 0 then
    never = true
  elseif l.t > at then
    at = l.t
  end
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
  if outcome == 0 and not dry then
    as_of = at
    if l.cost > 0 then
      l.alg.grant(l.st, l.p, at, l.cost)
      l.alg.save(l.st, l.p, now, ttl_from)
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
