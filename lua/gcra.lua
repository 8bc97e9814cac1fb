-- gcra.lua: generic cell rate algorithm (leaky bucket as a meter).
--
-- KEYS: tat (STRING "<us>:<frac>"): the theoretical arrival time, exactly
--       us + frac/N microseconds (0 <= frac < N), so a rate like 3 per second
--       (333333.33.. us apart) never drifts.
-- Params: p[1] = B (burst), p[2] = N, p[3] = W (rate N per W us, reduced by gcd)
-- Emission interval T = W/N. A cost c fits at t when tat - t <= (B - c) * T,
-- i.e. (tat_us - t) * N + frac <= (B - c) * W: all integers.
-- A missing key (or a tat in the past) is a full bucket. Arrivals are timed to
-- the microsecond: one in the tick that holds the TAT (t <= ceil(tat)) counts
-- as on time, so the fraction is kept and the long-run rate is exactly N/W.
local function gcra_ceil(st, p) -- ceil(tat), the tick that holds the TAT
  if st.frac > 0 then return st.tat + 1 end
  return st.tat
end

local function gcra_load(k, p, now)
  local st = { key = k[1], tat = now, frac = 0 }
  local v = redis.call('GET', st.key)
  if v then
    local tat, frac = string.match(v, '^(%d+):(%d+)$')
    if tat then
      st.tat = tonumber(tat)
      st.frac = tonumber(frac)
    end
  end
  if gcra_ceil(st, p) < now then
    st.tat = now
    st.frac = 0
  end
  return st
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

local function gcra_save(st, p, now)
  if not st.dirty then return end
  local ttl = gcra_ceil(st, p) + 1 - now -- the state matters through tick ceil(tat)
  redis.call('SET', st.key, fmt(st.tat) .. ':' .. fmt(st.frac),
    'PX', fmt(max(1, cdiv(ttl, 1000))))
end

local gcra = {
  nkeys = 1, load = gcra_load, earliest = gcra_earliest,
  grant = gcra_grant, status = gcra_status, save = gcra_save,
}
