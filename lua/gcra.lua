-- gcra.lua: generic cell rate algorithm (leaky bucket as a meter).
--
-- KEYS: gcra (STRING 'G' level den hw exp bmax): `level / den` permits left
--       at the writer's clock `hw` (us), negative while reservations are
--       pending; `bmax` the largest burst that wrote the state; `exp` when the
--       bucket has refilled to `bmax`. The theoretical arrival time
--       (TAT) lies (B - level) emission intervals after `hw`. An amount, not a
--       time, so another rate or burst reads what is left (converted, rounded
--       down, clamped to its burst).
-- Params: p[1] = B (burst), p[2] = N, p[3] = W (rate N per W us, reduced by gcd)
-- Internally the TAT is tat + frac/N us exactly (0 <= frac < N), so a rate
-- like 3 per second (333333.33.. us apart) never drifts; the level is kept in
-- units of 1/W permit, so tat = hw + (B * W - level) / N.
-- Emission interval T = W/N. A cost c fits at t when tat - t <= (B - c) * T,
-- i.e. (tat_us - t) * N + frac <= (B - c) * W: all integers.
-- A missing key (or a tat in the past) is a full bucket. Arrivals are timed to
-- the microsecond: one in the tick that holds the TAT (t <= ceil(tat)) counts
-- as on time, so the fraction is kept and the long-run rate is exactly N/W.
local function gcra_load(keys, i, p)
  local st = { key = keys[i], hw = 0, raw = false, r_level = 0, r_den = 1, r_exp = 0, r_bmax = 0,
    tat = 0, frac = 0, keep = 0, dirty = false }
  local v = get_packed(st.key, 71, 5) -- 'G'
  if v then
    local level, den, hw, exp, bmax = struct.unpack('<ddddd', v, 2)
    if int(level) and int(den) and den > 0 and int(hw) and int(exp) and int(bmax) then
      st.raw, st.hw = true, hw
      st.r_level, st.r_den, st.r_exp, st.r_bmax = level, den, exp, bmax
    end
  end
  return st
end

local function gcra_ceil(st, p) -- ceil(tat), the tick that holds the TAT
  if st.frac > 0 then return st.tat + 1 end
  return st.tat
end

local function gcra_prepare(st, p, now)
  st.tat, st.frac, st.keep = now, 0, p[1]
  if st.raw and st.r_exp > now then
    st.keep = max(st.keep, st.r_bmax)
    local debt = 0
    if fdiv(st.r_level, st.r_den) < p[1] then
      debt = p[1] * p[3] - rescale(st.r_level, st.r_den, p[3])
    end
    local whole = fdiv(debt, p[2])
    st.tat = st.hw + whole
    st.frac = debt - whole * p[2]
    if gcra_ceil(st, p) < now then
      st.tat, st.frac = now, 0
    end
  end
end

local function gcra_earliest(st, p, now, cost)
  local b, n, w = p[1], p[2], p[3]
  if cost > b then return -1 end
  local t = st.tat - fdiv((b - cost) * w - st.frac, n)
  return max(now, t)
end

local function gcra_grant(st, p, at, cost)
  if gcra_ceil(st, p) < at then
    st.tat = at
    st.frac = 0
  end
  local total = st.frac + cost * p[3]
  local whole = fdiv(total, p[2])
  st.tat = st.tat + whole
  st.frac = total - whole * p[2]
  st.dirty = true
end

-- Gives back `cost`: the TAT moves back `cost` emission intervals, never
-- before `now` (a full burst).
local function gcra_refund(st, p, now, at, cost)
  local x = (st.tat - now) * p[2] + st.frac - cost * p[3]
  local tat, frac = now, 0
  if x > 0 then
    local whole = fdiv(x, p[2])
    tat, frac = now + whole, x - whole * p[2]
  end
  if tat ~= st.tat or frac ~= st.frac then
    st.tat, st.frac, st.dirty = tat, frac, true
  end
end

local function gcra_status(st, p, now, at)
  local b, n, w = p[1], p[2], p[3]
  local used = 0 -- (tat - at) scaled by N
  if st.tat >= at then used = (st.tat - at) * n + st.frac end
  local remaining = max(0, min(b, fdiv(b * w - used, w)))
  local reset = 0
  if st.tat >= now then reset = st.tat - now + cdiv(st.frac, n) end
  return remaining, reset
end

local function gcra_save(st, p, now, from)
  if not st.dirty then return end
  local level = p[1] * p[3] - ((st.tat - now) * p[2] + st.frac)
  local bmax = st.keep
  -- the state matters through tick ceil(tat), and for a larger burst until
  -- its extra permits are back too
  local extra = min(bmax - p[1], fdiv(EXACT - 1, p[3]))
  local exp = gcra_ceil(st, p) + 1 + cdiv(extra * p[3], p[2])
  redis.call('SET', st.key, struct.pack('<c1ddddd', 'G', level, p[3], now, exp, bmax),
    'PX', px(exp, from))
end

local gcra = {
  nkeys = 1, load = gcra_load, prepare = gcra_prepare, earliest = gcra_earliest,
  grant = gcra_grant, status = gcra_status, save = gcra_save,
  refund = gcra_refund,
}
