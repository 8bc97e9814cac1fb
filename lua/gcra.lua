-- gcra.lua: generic cell rate algorithm (leaky bucket as a meter).
--
-- KEYS: gcra (STRING "<level>:<den>:<hw>:<exp>:<bmax>:<bexp>"): `level / den`
--       permits left at the writer's clock `hw` (us), negative while
--       reservations are pending; `bmax` the largest burst in use, honoured
--       until `bexp`; `exp` when the bucket has refilled to `bmax`:
--       the theoretical arrival time (TAT) lies (B - level) emission intervals
--       after `hw`. An amount, not a time, so another rate or burst reads what
--       is left (converted, rounded down, clamped to its burst).
-- Params: p[1] = B (burst), p[2] = N, p[3] = W (rate N per W us, reduced by gcd)
-- Internally the TAT is tat + frac/N us exactly (0 <= frac < N), so a rate
-- like 3 per second (333333.33.. us apart) never drifts; the level is kept in
-- units of 1/W permit, so tat = hw + (B * W - level) / N.
-- Emission interval T = W/N. A cost c fits at t when tat - t <= (B - c) * T,
-- i.e. (tat_us - t) * N + frac <= (B - c) * W: all integers.
-- A missing key (or a tat in the past) is a full bucket. Arrivals are timed to
-- the microsecond: one in the tick that holds the TAT (t <= ceil(tat)) counts
-- as on time, so the fraction is kept and the long-run rate is exactly N/W.
local function gcra_load(k, p)
  local st = { key = k[1], hw = 0 }
  -- level, den, hw, exp, bmax, bexp
  local f = parse(st.key, '^(%-?%d+):(%d+):(%d+):(%d+):(%d+):(%d+)$', 6)
  if f and f[2] > 0 then
    st.raw = { f[1], f[2], f[4], f[5], f[6] }
    st.hw = f[3]
  end
  return st
end

local function gcra_ceil(st, p) -- ceil(tat), the tick that holds the TAT
  if st.frac > 0 then return st.tat + 1 end
  return st.tat
end

local function gcra_prepare(st, p, now)
  st.tat, st.frac, st.keep = now, 0, p[1]
  local raw = st.raw
  if raw and raw[3] > now then
    if raw[4] > p[1] and raw[5] > now then st.keep, st.bexp = raw[4], raw[5] end
    local full = p[1] * p[3]
    local debt = 0
    if fdiv(raw[1], raw[2]) < p[1] then
      debt = full - rescale(raw[1], raw[2], p[3])
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

local function gcra_status(st, p, now, at)
  local b, n, w = p[1], p[2], p[3]
  local used = 0 -- (tat - at) scaled by N
  if st.tat >= at then used = (st.tat - at) * n + st.frac end
  local remaining = max(0, min(b, fdiv(b * w - used, w)))
  local reset = 0
  if st.tat >= now then reset = st.tat - now + cdiv(st.frac, n) end
  return remaining, reset
end

local function gcra_save(st, p, now, real)
  if not st.dirty then return end
  local level = p[1] * p[3] - ((st.tat - now) * p[2] + st.frac)
  local bmax, bexp = st.keep, st.bexp
  if bmax == p[1] then bexp = now + cdiv(p[1] * p[3], p[2]) end -- one burst's refill
  -- the state matters through tick ceil(tat), and for a larger burst until
  -- its extra permits are back too
  local extra = min(bmax - p[1], fdiv(EXACT - 1, p[3]))
  local exp = gcra_ceil(st, p) + 1 + cdiv(extra * p[3], p[2])
  redis.call('SET', st.key, fmt(level) .. ':' .. fmt(p[3]) .. ':' .. fmt(now) .. ':' .. fmt(exp)
      .. ':' .. fmt(bmax) .. ':' .. fmt(bexp),
    'PX', px(exp, real))
end

local gcra = {
  nkeys = 1, load = gcra_load, prepare = gcra_prepare, earliest = gcra_earliest,
  grant = gcra_grant, status = gcra_status, save = gcra_save,
}
