-- token_bucket.lua: token bucket with lazy refill, never negative.
--
-- KEYS: bucket (STRING 'T' level den ts written exp cmax): `level / den` tokens
--       at time `ts` (us); `written` is the writer's clock; `cmax` the largest
--       capacity that wrote the state; `exp` when the bucket has refilled to
--       `cmax`, so a larger bucket never reads a key that expired at a smaller
--       one's fill as full. (A capacity cut keeps keys alive as long as the
--       larger bucket would need, until a key once goes quiet.) `ts` lies
--       ahead of `written` only for a reservation: nothing refills before it, so
--       later grants queue behind.
-- Params: p[1] = C (capacity), p[2] = R, p[3] = P (refill R tokens per P us,
--         reduced by their gcd on the Rust side). Internally the level is kept
--         in units of 1/P token; another P's level is converted, rounded down,
--         and clamped to C: what is left stays what is left.
-- A missing key is a full bucket. A denied request writes nothing.
local function tb_load(keys, i, p)
  local st = { key = keys[i], written = 0, raw = false, r_level = 0, r_den = 1, r_ts = 0, r_exp = 0,
    r_cmax = 0, level = 0, ts = 0, cmax = 0, dirty = false }
  local v = get_packed(st.key, 84, 6) -- 'T'
  if v then
    local level, den, ts, written, exp, cmax = struct.unpack('<dddddd', v, 2)
    if int(level) and int(den) and den > 0 and int(ts) and int(written) and int(exp) and int(cmax) then
      st.raw, st.written = true, written
      st.r_level, st.r_den, st.r_ts, st.r_exp, st.r_cmax = level, den, ts, exp, cmax
    end
  end
  return st
end

local function tb_prepare(st, p, now)
  local full = p[1] * p[3]
  st.level, st.ts, st.cmax = full, now, p[1]
  if st.written > now then
    -- dated after the decision's clock: moved back to it (see "Clock steps"
    -- in driver.lua), and written back if it still holds something
    local d = st.written - now
    st.r_ts, st.r_exp, st.written = st.r_ts - d, st.r_exp - d, now
    st.dirty = st.r_exp > now
  end
  if st.raw and st.r_exp > now then
    st.cmax = max(st.cmax, st.r_cmax)
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
  local cmax = st.cmax
  local t = max(now, st.ts)
  local exp = t + cdiv(min(cmax, fdiv(EXACT - 1, p[3])) * p[3] - tb_level_at(st, p, t), p[2])
  redis.call('SET', st.key, struct.pack('<c1dddddd', 'T', st.level, p[3], st.ts, now, exp, cmax),
    'PX', px(exp, from))
end

-- The decision of one limit (see `decide_one` in driver.lua): the steps
-- above on locals, for the production path. s[2..4] = p, s[6] = cost,
-- s[7] = C * P, s[8] = cost * P.
local function tb_one(keys, s, store_now, max_wait, dry, from)
  local c, r, p, cost, full = s[2], s[3], s[4], s[6], s[7]
  local key = keys[1]
  local now, level, ts, cmax = store_now, full, store_now, c
  -- load and prepare
  local v = rpcall('GET', key)
  if v and #v == 49 then -- (an error reply is a table: #v == 0)
    local tag, l, den, t0, written, exp, r_cmax = sunpack('<c1dddddd', v)
    -- (each field an integer below 2^53 in magnitude, as int() checks;
    -- 2^53 written out: a literal is an operand of the comparison, an upvalue
    -- must be loaded first)
    if tag == 'T' and l % 1 == 0 and l < 9007199254740992 and l > -9007199254740992
        and den % 1 == 0 and den > 0 and den < 9007199254740992
        and t0 % 1 == 0 and t0 < 9007199254740992 and t0 > -9007199254740992
        and written % 1 == 0 and written < 9007199254740992 and written > -9007199254740992
        and exp % 1 == 0 and exp < 9007199254740992 and exp > -9007199254740992
        and r_cmax % 1 == 0 and r_cmax < 9007199254740992 and r_cmax > -9007199254740992 then
      if written > now then
        -- beyond the limit's horizon, the steps above move the state back
        if written - now > s.h then return decide_one(keys, s, store_now, max_wait, dry, from) end
        now = written
      end
      ts = now
      if exp > now then
        if r_cmax > c then cmax = r_cmax end
        ts = t0
        if den == p then -- fdiv(l, p) < c, exactly: C * P < 2^53
          if l < full then level = l end
        elseif fdiv(l, den) < c then
          level = rescale(l, den, p)
        end
      end
    end
  end
  if level == full and ts == now and cmax == c and s[12] and max_wait >= 0 and not dry then
    -- a full bucket (the common case: a key that rested) grants 1 <= cost
    -- <= C at once, to the same state and status every time (spec[9..11])
    local ms = px(now + s[9], from)
    rcall('SET', key, spack('<c1dddddd', 'T', s[10], p, now, now, now + s[9], c), 'PX', ms)
    return spack('<dddddd', 0, 0, now, 0, s[11], s[9])
  end
  -- the fill at base = max(now, ts) (tb_level_at)
  local base = now
  if ts > now then base = ts end
  local fill = level
  if base > ts then
    if base - ts >= cdiv(full - level, r) then fill = full else fill = level + (base - ts) * r end
  end
  -- earliest
  local t = now
  if cost > 0 then
    if cost > c then
      t = -1
    else
      local need = s[8] - fill
      t = base
      if need > 0 then t = base + cdiv(need, r) end
    end
  end
  local outcome, wait = verdict(t, now, max_wait)
  if outcome == 0 and not dry then
    if cost > 0 then
      -- grant at t >= ts: the fill at t, less the cost
      if t > ts then
        if t - ts >= cdiv(full - level, r) then fill = full else fill = level + (t - ts) * r end
      end
      level, ts = fill - s[8], t
      fill = level
      -- save: the bucket is full again (at its largest capacity) at exp
      local x = -(full - level) -- refill = cdiv(full - level, r)
      local m = x % r
      if m < 0 then m = m + r elseif m >= r then m = m - r end
      local refill = -((x - m) / r)
      local exp = ts + refill
      if cmax > c then exp = ts + cdiv(min(cmax, fdiv(EXACT - 1, p)) * p - level, r) end
      local ms = px(exp, from)
      rcall('SET', key, spack('<c1dddddd', 'T', level, p, ts, now, exp, cmax), 'PX', ms)
      -- status as of t: this fill, full again `refill` later
      x = level -- remaining = fdiv(level, p)
      m = x % p
      if m < 0 then m = m + p elseif m >= p then m = m - p end
      return spack('<dddddd', 0, wait, now, wait, (x - m) / p, t - now + refill)
    end
  end
  -- status as of now: the fill at base = max(now, ts), none while reserved
  local remaining = 0
  if ts <= now then remaining = fdiv(fill, p) end
  local reset = base - now + cdiv(full - fill, r)
  if t >= 0 then t = t - now end
  return spack('<dddddd', outcome, wait, now, t, remaining, reset)
end

local token_bucket = {
  load = tb_load, prepare = tb_prepare, earliest = tb_earliest,
  grant = tb_grant, status = tb_status, save = tb_save,
  refund = tb_refund, one = tb_one,
  -- the longest wait the limit asks by itself: a full bucket's refill
  horizon = function(p) return cdiv(p[1] * p[3], p[2]) end,
  -- the constants tb_one reads from a spec; [9..12] describe a grant from
  -- a full bucket: it is full again s[9] us later, leaves the level s[10]
  -- and s[11] tokens; s[12]: 1 <= cost <= C
  derive = function(s)
    local c, r, p, cost = s[2], s[3], s[4], s[6]
    s[7], s[8] = c * p, cost * p
    s[12] = cost >= 1 and cost <= c
    if s[12] then s[9], s[10], s[11] = cdiv(s[8], r), s[7] - s[8], c - cost end
  end,
}
