-- common.lua: helpers shared by every algorithm.
--
-- All times are integer microseconds since the Unix epoch and all amounts are
-- integers. Lua numbers are doubles, exact below 2^53; the Rust side validates
-- every quota so that no intermediate value exceeds that bound. Division is the
-- only operation that can round, so `fdiv` corrects the quotient exactly.
--
-- Stored state is independent of the quota that wrote it: absolute times and
-- amounts, each amount with the denominator of its unit, and `written`, the
-- writer's clock. A limiter with other parameters (a rolling deploy) converts
-- what it reads into its own units, rounding towards "less is left". Each
-- state also says when it becomes equal to a fresh one for its writer (`exp`,
-- stored or derived); from then on it reads as absent whatever the key's TTL,
-- which only collects garbage.
--
-- A state is one STRING: a tag byte naming the algorithm, then its fields as
-- little-endian doubles (`struct.pack`), which Redis packs and unpacks in C
-- and which hold every integer below 2^53 exactly. A value of another length
-- or tag, another type, or a field that is not such an integer reads as
-- absent and is overwritten by the next write: no input makes a script fail.
-- (Text would be easier to read in redis-cli, but formatting and parsing
-- numbers in Lua cost more than the rest of a decision.)
--
-- (No library-level access to `math` or `string`: Redis 7.0 loads a function
-- library in an environment without them. They are used inside functions.)
local EXACT = 9007199254740992 -- 2^53

-- redis.call, redis.pcall, struct.pack, struct.unpack, string.sub and
-- Lua's pcall, looked up once: a global's lookup passes through the
-- protected global table's metatable and costs more than several lines of
-- arithmetic. They are not there while
-- Redis 7 loads a library: `spec` binds them when it parses the first limit.
local rcall, rpcall, spack, sunpack, ssub, lpcall

-- Of the last keys whose state was saved (about 16, each older one
-- weighing 15/16 of the one after it), how many were absent, and the
-- figure above which a decision of one limit takes its key as absent: it
-- decides as for an absent key and writes that state by the call that
-- reads the key, only where the key is absent (`put_absent`; see `--: template
-- one` in driver.lua). A state that equals a fresh one has expired, so a
-- key decided at rest is absent: one Redis call where a read and a write
-- are two. A key taken as absent that is present costs a second pass and a
-- SET that wrote nothing, a little over three times what one found absent
-- saves (the two break even near 12 in 16), so decisions read first unless
-- more than 13 in 16 keys were absent.
-- Infinite where SET cannot combine NX with GET (Redis before 7.0).
local absent, ABSENT_DECAY, absent_above = 16, 15 / 16, 13

local function bind()
  rcall, rpcall, spack, sunpack = redis.call, redis.pcall, struct.pack, struct.unpack
  ssub, lpcall = string.sub, pcall
  if (redis.REDIS_VERSION_NUM or 0) < 0x070000 then absent_above = 1 / 0 end
end

-- Writes a key's state `v` to expire in `ms` milliseconds (a PX argument)
-- for a decision that took the key as absent, only where it is absent;
-- returns the key's value before (false: absent, so written and the
-- decision stands; else it is decided again on that value), and counts it
-- in `absent` as `load` counts a key it reads (see build.rs).
local function put_absent(key, v, ms)
  local was = rpcall('SET', key, v, 'PX', ms, 'NX', 'GET')
  absent = absent * ABSENT_DECAY
  if was == false then absent = absent + 1 end
  return was
end

-- Writes a key's state `v` after a decision: where the decision took the
-- key as absent (`nx`), only where it is absent, returning what
-- `put_absent` returns; else to expire in `ms` milliseconds, or with the
-- key's expiry kept when `ms` is false.
local function put(key, v, nx, ms)
  if nx then return put_absent(key, v, ms) end
  if ms then
    rcall('SET', key, v, 'PX', ms)
  else
    -- KEEPTTL spares Redis formatting and setting the same expiry
    rcall('SET', key, v, 'KEEPTTL')
  end
end

local function fdiv(a, b) -- floor(a / b) for integers, b > 0
  -- `%` is a - floor(a / b) * b in doubles, off by one b when a / b rounds
  -- across an integer; the corrected remainder makes the division exact.
  local r = a % b
  if r < 0 then
    r = r + b
  elseif r >= b then
    r = r - b
  end
  return (a - r) / b
end

local function cdiv(a, b) -- ceil(a / b) for integers, b > 0
  return -fdiv(-a, b)
end

local function fmod(a, b) -- a mod b in [0, b), exact
  return a - fdiv(a, b) * b
end

-- Calendar quotas (src/algorithm/calendar.rs mirrors this): a window
-- algorithm's third parameter `c`, when negative, is -(period + 10 *
-- (offset + 86400)): the period 1 day, 2 week (from Monday), 3 month, 4
-- year, its days beginning at midnight `offset` seconds east of UTC. Civil
-- dates from days and back after Howard Hinnant's algorithms, every
-- division an `fdiv`: exact, as all values stay far below 2^53.
local DAY = 86400000000 -- us

-- Days from the epoch to the first day of month m (1 to 12) of year y.
local function first_of(y, m)
  local mp = m + 9 -- months from March: January and February end the year before
  if m > 2 then mp = m - 3 else y = y - 1 end
  local era = fdiv(y, 400)
  local yoe = y - era * 400
  return era * 146097 + yoe * 365 + fdiv(yoe, 4) - fdiv(yoe, 100) + fdiv(153 * mp + 2, 5) - 719468
end

-- The year and month (1 to 12) of day z from the epoch.
local function month_of(z)
  z = z + 719468
  local era = fdiv(z, 146097)
  local doe = z - era * 146097
  local yoe = fdiv(doe - fdiv(doe, 1460) + fdiv(doe, 36524) - fdiv(doe, 146096), 365)
  local mp = fdiv(5 * (doe - 365 * yoe - fdiv(yoe, 4) + fdiv(yoe, 100)) + 2, 153)
  if mp >= 10 then return yoe + era * 400 + 1, mp - 9 end
  return yoe + era * 400, mp + 3
end

-- The window of calendar code c that holds `at`: its start, its length,
-- the length of the one before it and of the one after it (us). The last
-- one found is kept: the steps of a decision, and decisions in a row, ask
-- for the same window again and again.
local cal_c, cal_s, cal_e, cal_b, cal_n = 0, 0, 0, 0, 0
local function cal(at, c)
  if c == cal_c and at >= cal_s and at < cal_e then
    return cal_s, cal_e - cal_s, cal_s - cal_b, cal_n - cal_e
  end
  local period = fmod(-c, 10)
  local offset = (fdiv(-c, 10) - 86400) * 1000000
  local z = fdiv(at + offset, DAY)
  local s, e, b, n -- in days: its start, the next one's, the one before's, its end
  if period == 1 then
    s, e, b, n = z, z + 1, z - 1, z + 2
  elseif period == 2 then
    s = z - fmod(z + 3, 7) -- 1970-01-01 was a Thursday
    e, b, n = s + 7, s - 7, s + 14
  else
    local y, m = month_of(z)
    if period == 4 then
      s, e, b, n = first_of(y, 1), first_of(y + 1, 1), first_of(y - 1, 1), first_of(y + 2, 1)
    else
      s = first_of(y, m)
      if m == 12 then e = first_of(y + 1, 1) else e = first_of(y, m + 1) end
      if m == 1 then b = first_of(y - 1, 12) else b = first_of(y, m - 1) end
      if m >= 11 then n = first_of(y + 1, m - 10) else n = first_of(y, m + 2) end
    end
  end
  cal_c, cal_s, cal_e = c, s * DAY - offset, e * DAY - offset
  cal_b, cal_n = b * DAY - offset, n * DAY - offset
  return cal_s, cal_e - cal_s, cal_s - cal_b, cal_n - cal_e
end

-- The window of a window algorithm that holds `t`: its start `ws`, its
-- length `wl` and the length `wb` of the one before it; a window of the
-- calendar (code `u` < 0) or of `w` from the epoch, found without a call
-- (t - fmod(t, w)).
--: fragment window_of(t, u, w) -> ws, wl, wb
  if u < 0 then
    ws, wl, wb = cal(t, u)
  else
    local m = t % w
    if m < 0 then m = m + w elseif m >= w then m = m - w end
    ws, wl, wb = t - m, w, w
  end
--: end

-- Whether a stored window (`r_start`, `r_len`) is one of this limit's.
--: fragment own_window(r_start, r_len, u, w) -> own
  own = r_len == w
  if u < 0 then
    local ks, kl = cal(r_start, u)
    own = ks == r_start and kl == r_len
  end
--: end

-- A decision's outcome and wait from T, the earliest time at which all its
-- limits allow it (-1: never, a cost over a capacity), the clock `now` and
-- the longest wait allowed. The outcomes are `algorithm::Outcome`'s: 0
-- granted (wait: until T), 1 denied (wait: the retry-after), 2 never (wait
-- -1); see wire.lua.
local function verdict(t, now, max_wait)
  if t < 0 then return 2, -1 end
  local wait = t - now
  if wait > max_wait then return 1, wait end
  return 0, wait
end

-- A key's clock as the decision believes it (see "Clock steps" in
-- driver.lua): its `written` when that lies ahead of the store's clock
-- `store_now` by at most the limit's horizon `h`, else `store_now`.
local function believed(store_now, written, h)
  if written > store_now and written - store_now <= h then return written end
  return store_now
end

local function max(a, b)
  if a > b then return a end
  return b
end

local function min(a, b)
  if a < b then return a end
  return b
end

local function int(x) -- whether x is an integer of magnitude below 2^53 (NaN is not)
  return x % 1 == 0 and x < EXACT and x > -EXACT
end

-- The packed state at `key` when its tag byte is `tag` and it holds `n`
-- doubles; nil when it is missing, of another type, tag or length. The
-- caller unpacks and checks the fields.
local function get_packed(key, tag, n)
  local v = redis.pcall('GET', key)
  if type(v) ~= 'string' or #v ~= 1 + 8 * n or string.byte(v, 1) ~= tag then return nil end
  return v
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

-- Expiries as PX arguments, as strings: Redis 7.0 formats a number
-- argument with snprintf("%.17g"), which costs more than all of a
-- decision's arithmetic, and decisions in a row mostly set the same few
-- expiries. The text of the last `ms` of each residue mod 64 is kept
-- (see `px`). (A cache of every value seen would grow the Lua heap, whose every
-- object the garbage collector visits again and again.)
local px_ms, px_str = {}, {}
local function px_arg(ms)
  local s = string.format('%d', ms)
  px_ms[ms % 64], px_str[ms % 64] = ms, s
  return s
end

-- Milliseconds from the store's clock `from` until `at`, at least 1: the
-- expiry that makes a key outlive `at` (as a PX argument). Every decision
-- that writes calls it once: max(1, cdiv(at - from, 1000)) is written out,
-- two calls fewer.
local function px(at, from)
  local x = from - at
  local r = x % 1000
  if r < 0 then r = r + 1000 elseif r >= 1000 then r = r - 1000 end
  local ms = -((x - r) / 1000)
  if ms < 1 then ms = 1 end
  return px_ms[ms % 64] == ms and px_str[ms % 64] or px_arg(ms)
end

-- Puts `v` under `k` in `cache`, which holds `n` entries: the caches of
-- what the library reads from its arguments, kept across calls (a limiter
-- sends the same few strings again and again) and bounded, a full one
-- starting again empty. Returns the cache and its new count.
local function cache_put(cache, n, k, v)
  if n >= 1024 then cache, n = {}, 0 end
  cache[k] = v
  return cache, n + 1
end

-- Parsed strings of integers separated by ':' (a limit and its cost,
-- options).
local parsed, n_parsed = {}, 0
local function ints(s)
  local v = parsed[s]
  if v then return v end
  v = {}
  for x in string.gmatch(s, '[^:]+') do v[#v + 1] = tonumber(x) end
  parsed, n_parsed = cache_put(parsed, n_parsed, s, v)
  return v
end
