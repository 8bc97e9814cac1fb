-- token_bucket.lua: token bucket with lazy refill, never negative.
--
-- KEYS: bucket (STRING "<level>:<den>:<ts>:<hw>"): `level / den` tokens at time
--       `ts` (us); `hw` is the writer's clock. `ts` lies ahead of `hw` only for
--       a reservation: nothing refills before it, so later grants queue behind.
-- Params: p[1] = C (capacity), p[2] = R, p[3] = P (refill R tokens per P us,
--         reduced by their gcd on the Rust side). Internally the level is kept
--         in units of 1/P token; another P's level is converted, rounded down,
--         and clamped to C: what is left stays what is left.
-- A missing key is a full bucket. A denied request writes nothing.
local function tb_load(k, p)
  local st = { key = k[1], hw = 0 }
  local v = get(st.key)
  if v then
    local level, den, ts, hw = string.match(v, '^(%d+):(%d+):(%d+):(%d+)$')
    level, den, ts, hw = num(level), num(den), num(ts), num(hw)
    if hw and den > 0 then
      st.raw = { level, den, ts }
      st.hw = hw
    end
  end
  return st
end

local function tb_prepare(st, p, now)
  local full = p[1] * p[3]
  st.level, st.ts = full, now
  local raw = st.raw
  if raw then
    st.ts = raw[3]
    if fdiv(raw[1], raw[2]) < p[1] then
      st.level = rescale(raw[1], raw[2], p[3], false)
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
  local _, reset = tb_status(st, p, now, now)
  redis.call('SET', st.key,
    fmt(st.level) .. ':' .. fmt(p[3]) .. ':' .. fmt(st.ts) .. ':' .. fmt(now),
    'PX', px(now + reset, real))
end

local token_bucket = {
  nkeys = 1, load = tb_load, prepare = tb_prepare, earliest = tb_earliest,
  grant = tb_grant, status = tb_status, save = tb_save,
}
