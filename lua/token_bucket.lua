-- token_bucket.lua: token bucket with lazy refill, never negative.
--
-- KEYS: bucket (STRING "<level>:<den>:<ts>:<hw>:<exp>:<cmax>:<cexp>"):
--       `level / den` tokens at time `ts` (us); `hw` is the writer's clock;
--       `cmax` the largest capacity in use, honoured until `cexp`; `exp` when
--       the bucket has refilled to `cmax`, so a larger bucket still in use
--       never reads a key that expired at a smaller one's fill as full. `ts`
--       lies ahead of `hw` only for a reservation: nothing refills before it,
--       so later grants queue behind.
-- Params: p[1] = C (capacity), p[2] = R, p[3] = P (refill R tokens per P us,
--         reduced by their gcd on the Rust side). Internally the level is kept
--         in units of 1/P token; another P's level is converted, rounded down,
--         and clamped to C: what is left stays what is left.
-- A missing key is a full bucket. A denied request writes nothing.
local function tb_load(k, p)
  local st = { key = k[1], hw = 0 }
  -- level, den, ts, hw, exp, cmax, cexp
  local f = parse(st.key, '^(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):(%d+)$', 7)
  if f and f[2] > 0 then
    st.raw = { f[1], f[2], f[3], f[5], f[6], f[7] }
    st.hw = f[4]
  end
  return st
end

local function tb_prepare(st, p, now)
  local full = p[1] * p[3]
  st.level, st.ts, st.keep = full, now, p[1]
  local raw = st.raw
  if raw and raw[4] > now then
    if raw[5] > p[1] and raw[6] > now then st.keep, st.cexp = raw[5], raw[6] end
    st.ts = raw[3]
    if fdiv(raw[1], raw[2]) < p[1] then
      st.level = rescale(raw[1], raw[2], p[3])
    end
  end
end

local function tb_level_at(st, p, t) -- fill at time t >= st.ts
  local full = p[1] * p[3]
  local need = full - st.level
  local elapsed = t - st.ts
  if elapsed <= 0 then return st.level end
  if elapsed >= cdiv(need, p[2]) then return full end
  return st.level + elapsed * p[2]
end

local function tb_earliest(st, p, now, cost)
  if cost > p[1] then return -1 end
  local base = max(now, st.ts)
  local level = tb_level_at(st, p, base)
  local need = cost * p[3] - level
  if need <= 0 then return base end
  return base + cdiv(need, p[2])
end

local function tb_grant(st, p, at, cost)
  st.level = tb_level_at(st, p, at) - cost * p[3]
  st.ts = at
  st.dirty = true
end

local function tb_status(st, p, now, at)
  local t = max(at, st.ts)
  local level = tb_level_at(st, p, t)
  local remaining = fdiv(level, p[3])
  if st.ts > at then remaining = 0 end
  local reset = t - now + cdiv(p[1] * p[3] - level, p[2])
  return remaining, reset
end

local function tb_save(st, p, now, real)
  if not st.dirty then return end
  local cmax, cexp = st.keep, st.cexp
  if cmax == p[1] then cexp = now + cdiv(p[1] * p[3], p[2]) end -- one fill from empty
  local t = max(now, st.ts)
  local exp = t + cdiv(min(cmax, fdiv(EXACT - 1, p[3])) * p[3] - tb_level_at(st, p, t), p[2])
  redis.call('SET', st.key,
    fmt(st.level) .. ':' .. fmt(p[3]) .. ':' .. fmt(st.ts) .. ':' .. fmt(now) .. ':' .. fmt(exp)
      .. ':' .. fmt(cmax) .. ':' .. fmt(cexp),
    'PX', px(exp, real))
end

local token_bucket = {
  nkeys = 1, load = tb_load, prepare = tb_prepare, earliest = tb_earliest,
  grant = tb_grant, status = tb_status, save = tb_save,
}
