-- common.lua: helpers shared by every algorithm script.
--
-- All times are integer microseconds since the Unix epoch and all amounts are
-- integers. Lua numbers are doubles, exact below 2^53; the Rust side validates
-- every quota so that no intermediate value exceeds that bound. Division is the
-- only operation that can round, so `fdiv` corrects the quotient exactly.
--
-- Stored state is independent of the quota that wrote it: absolute times and
-- amounts, each amount with the denominator of its unit, and `hw`, the
-- writer's clock. A limiter with other parameters (a rolling deploy) converts
-- what it reads into its own units, rounding towards "less is left". A value
-- that does not parse (garbage, another type, a field evicted) reads as absent
-- and is overwritten by the next write: no input makes a script fail.
-- Each state also says when it becomes equal to a fresh one for its writer
-- (`exp`, stored or derived); from then on it reads as absent whatever the
-- key's TTL, which only collects garbage.
local floor = math.floor
local EXACT = 9007199254740992 -- 2^53

local function fdiv(a, b) -- floor(a / b) for integers, b > 0
  local q = floor(a / b)
  local r = a - q * b
  if r < 0 then
    q = q - 1
  elseif r >= b then
    q = q + 1
  end
  return q
end

local function cdiv(a, b) -- ceil(a / b) for integers, b > 0
  return -fdiv(-a, b)
end

local function fmod(a, b) -- a mod b in [0, b), exact
  return a - fdiv(a, b) * b
end

local function fmt(n) -- integer to decimal string (tostring would print 1.8e+15)
  return string.format('%d', n)
end

local function max(a, b)
  if a > b then return a end
  return b
end

local function min(a, b)
  if a < b then return a end
  return b
end

local function num(s) -- a decimal integer of magnitude below 2^53, else nil
  if not s then return nil end
  local n = tonumber(s)
  if n and n == floor(n) and n < EXACT and n > -EXACT then return n end
  return nil
end

-- The integer fields of the string at `key` as a table, or nil when the key
-- is missing, of another type, or any of its `n` fields does not parse.
local function parse(key, pattern, n)
  local v = redis.pcall('GET', key)
  if type(v) ~= 'string' then return nil end
  local f = { string.match(v, pattern) }
  if #f ~= n then return nil end
  for i = 1, n do
    f[i] = num(f[i])
    if not f[i] then return nil end
  end
  return f
end

-- x / from, expressed in units of 1 / to and rounded down: exact when the
-- product fits in 2^53, else the fraction below one unit of `from` is dropped.
local function rescale(x, from, to)
  if from == to then return x end
  local q = fdiv(x, from)
  local r = x - q * from
  local part = 0
  if r * to < EXACT then part = fdiv(r * to, from) end
  return q * to + part
end

-- Sets a key's expiry so that it outlives `at` (us, on the store's clock
-- `real`), rounded up to whole milliseconds.
local function expire_at(key, at, real)
  redis.call('PEXPIRE', key, fmt(max(1, cdiv(at - real, 1000))))
end

-- The `PX` argument that makes a SET outlive `at`.
local function px(at, real)
  return fmt(max(1, cdiv(at - real, 1000)))
end
