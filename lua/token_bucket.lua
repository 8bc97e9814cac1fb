-- token_bucket.lua: token bucket with lazy refill, never negative.
--
-- KEYS: bucket (STRING "<level>:<ts>"): `level` is the fill in units of 1/P of a
--       token at time `ts` (us). `ts` may lie in the future when a reservation
--       was made: nothing refills before it, so later grants queue behind it.
-- Params: p[1] = C (capacity), p[2] = R, p[3] = P (refill R tokens per P us,
--         reduced by their gcd on the Rust side)
-- A missing key is a full bucket. A denied request writes nothing.
local function tb_load(k, p, now)
  local st = { key = k[1], level = p[1] * p[3], ts = now }
  local v = redis.call('GET', st.key)
  if v then
    local level, ts = string.match(v, '^(%d+):(%d+)$')
    if level then
      st.level = tonumber(level)
      st.ts = tonumber(ts)
    end
  end
  return st
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

local function tb_save(st, p, now)
  if not st.dirty then return end
  local _, reset = tb_status(st, p, now, now)
  redis.call('SET', st.key, fmt(st.level) .. ':' .. fmt(st.ts),
    'PX', fmt(max(1, cdiv(reset, 1000))))
end

local token_bucket = {
  nkeys = 1, load = tb_load, earliest = tb_earliest,
  grant = tb_grant, status = tb_status, save = tb_save,
}
