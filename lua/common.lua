-- common.lua: helpers shared by every algorithm script.
--
-- All times are integer microseconds since the Unix epoch and all amounts are
-- integers. Lua numbers are doubles, exact below 2^53; the Rust side validates
-- every quota so that no intermediate value exceeds that bound. Division is the
-- only operation that can round, so `fdiv` corrects the quotient exactly.
local floor = math.floor

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

-- Sets a key's expiry to `ttl_us` from now, rounded up to whole milliseconds.
local function expire_in(key, ttl_us)
  redis.call('PEXPIRE', key, fmt(max(1, cdiv(ttl_us, 1000))))
end
