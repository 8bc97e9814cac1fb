-- token_bucket.lua: token bucket with lazy refill, never negative.
--
-- KEYS: bucket (STRING 'T' level den ts hw exp cmax): `level / den` tokens
--       at time `ts` (us); `hw` is the writer's clock; `cmax` the largest
--       capacity that wrote the state; `exp` when the bucket has refilled to
--       `cmax`, so a larger bucket never reads a key that expired at a smaller
--       one's fill as full. (A capacity cut keeps keys alive as long as the
--       larger bucket would need, until a key once goes quiet.) `ts` lies
--       ahead of `hw` only for a reservation: nothing refills before it, so
--       later grants queue behind.
-- Params: p[1] = C (capacity), p[2] = R, p[3] = P (refill R tokens per P us,
--         reduced by their gcd on the Rust side). Internally the level is kept
--         in units of 1/P token; another P's level is converted, rounded down,
--         and clamped to C: what is left stays what is left.
-- A missing key is a full bucket. A denied request writes nothing.
local function tb_load(keys, i, p)
  local st = { key = keys[i], hw = 0, raw = false, r_level = 0, r_den = 1, r_ts = 0, r_exp = 0,
    r_cmax = 0, level = 0, ts = 0, keep = 0, dirty = false }
  local v = get_packed(st.key, 84, 6) -- 'T'
  if v then
    local level, den, ts, hw, exp, cmax = struct.unpack('<dddddd', v, 2)
    if int(level) and int(den) and den > 0 and int(ts) and int(hw) and int(exp) and int(cmax) then
      st.raw, st.hw = true, hw
      st.r_level, st.r_den, st.r_ts, st.r_exp, st.r_cmax = level, den, ts, exp, cmax
    end
  end
  return st
end

local function tb_prepare(st, p, now)
  local full = p[1] * p[3]
  st.level, st.ts, st.keep = full, now, p[1]
  if st.raw and st.r_exp > now then
    st.keep = max(st.keep, st.r_cmax)
    st.ts = st.r_ts
    if fdiv(st.r_level, st.r_den) < p[1] then
      st.level = rescale(st.r_level, st.r_den, p[3])
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

-- Gives back `cost` tokens, never above the capacity.
local function tb_refund(st, p, now, at, cost)
  local full = p[1] * p[3]
  if st.level >= full then return end
  st.level = min(full, st.level + cost * p[3])
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

local function tb_save(st, p, now, from)
  if not st.dirty then return end
  local cmax = st.keep
  local t = max(now, st.ts)
  local exp = t + cdiv(min(cmax, fdiv(EXACT - 1, p[3])) * p[3] - tb_level_at(st, p, t), p[2])
  redis.call('SET', st.key, struct.pack('<c1dddddd', 'T', st.level, p[3], st.ts, now, exp, cmax),
    'PX', px(exp, from))
end

local token_bucket = {
  nkeys = 1, load = tb_load, prepare = tb_prepare, earliest = tb_earliest,
  grant = tb_grant, status = tb_status, save = tb_save,
  refund = tb_refund,
}
