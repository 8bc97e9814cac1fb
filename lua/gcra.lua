-- gcra.lua: generic cell rate algorithm (leaky bucket as a meter).
--
-- KEYS: gcra (STRING "<debt>:<den>:<hw>"): `debt / den` permits owed at the
--       writer's clock `hw` (us): the theoretical arrival time (TAT) lies
--       debt/den emission intervals after `hw`. Owed amounts, not times, so
--       another rate reads the same debt (converted, rounded up).
-- Params: p[1] = B (burst), p[2] = N, p[3] = W (rate N per W us, reduced by gcd)
-- Internally the TAT is tat + frac/N us exactly (0 <= frac < N), so a rate
-- like 3 per second (333333.33.. us apart) never drifts; the debt is kept in
-- units of 1/W permit, so tat = hw + debt / N.
-- Emission interval T = W/N. A cost c fits at t when tat - t <= (B - c) * T,
-- i.e. (tat_us - t) * N + frac <= (B - c) * W: all integers.
-- A missing key (or a tat in the past) is a full bucket. Arrivals are timed to
-- the microsecond: one in the tick that holds the TAT (t <= ceil(tat)) counts
-- as on time, so the fraction is kept and the long-run rate is exactly N/W.
local function gcra_load(k, p)
  local st = { key = k[1], hw = 0 }
  local v = get(st.key)
  if v then
    local debt, den, hw = string.match(v, '^(%-?%d+):(%d+):(%d+)$')
    debt, den, hw = num(debt), num(den), num(hw)
    if hw and den > 0 then
      st.raw = { debt, den }
      st.hw = hw
    end
  end
  return st
end

local function gcra_ceil(st, p) -- ceil(tat), the tick that holds the TAT
  if st.frac > 0 then return st.tat + 1 end
  return st.tat
end

local function gcra_prepare(st, p, now)
  st.tat, st.frac = now, 0
  local raw = st.raw
  if raw then
    local debt = rescale(raw[1], raw[2], p[3], true)
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
  local debt = (st.tat - now) * p[2] + st.frac
  -- the state matters through tick ceil(tat)
  redis.call('SET', st.key, fmt(debt) .. ':' .. fmt(p[3]) .. ':' .. fmt(now),
    'PX', px(gcra_ceil(st, p) + 1, real))
end

local gcra = {
  nkeys = 1, load = gcra_load, prepare = gcra_prepare, earliest = gcra_earliest,
  grant = gcra_grant, status = gcra_status, save = gcra_save,
}
