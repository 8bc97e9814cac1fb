-- gcra.lua: generic cell rate algorithm (leaky bucket as a meter).
--
-- KEYS: gcra (STRING 'G' level den written exp bmax): `level / den` permits left
--       at the writer's clock `written` (us), negative while reservations are
--       pending; `bmax` the largest burst that wrote the state; `exp` when the
--       bucket has refilled to `bmax`. The theoretical arrival time
--       (TAT) lies (B - level) emission intervals after `written`. An amount, not a
--       time, so another rate or burst reads what is left (converted, rounded
--       down, clamped to its burst).
-- Params: p[1] = B (burst), p[2] = N, p[3] = W (rate N per W us, reduced by gcd)
-- Internally the TAT is tat + frac/N us exactly (0 <= frac < N), so a rate
-- like 3 per second (333333.33.. us apart) never drifts; the level is kept in
-- units of 1/W permit, so tat = written + (B * W - level) / N.
-- Emission interval T = W/N. A cost c fits at t when tat - t <= (B - c) * T,
-- i.e. (tat_us - t) * N + frac <= (B - c) * W: all integers.
-- A missing key (or a tat in the past) is a full bucket. Arrivals are timed to
-- the microsecond: one in the tick that holds the TAT (t <= ceil(tat)) counts
-- as on time, so the fraction is kept and the long-run rate is exactly N/W.
local function gcra_load(keys, i, p)
  local st = { key = keys[i], written = 0, raw = false, r_level = 0, r_den = 1, r_exp = 0, r_bmax = 0,
    tat = 0, frac = 0, bmax = 0, dirty = false }
  local v = get_packed(st.key, 71, 5) -- 'G'
  if v then
    local level, den, written, exp, bmax = struct.unpack('<ddddd', v, 2)
    if int(level) and int(den) and den > 0 and int(written) and int(exp) and int(bmax) then
      st.raw, st.written = true, written
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
  st.tat, st.frac, st.bmax = now, 0, p[1]
  if st.written > now then
    -- dated after the decision's clock: moved back to it (see "Clock steps"
    -- in driver.lua), and written back if it still holds something
    st.r_exp, st.written = st.r_exp - (st.written - now), now
    st.dirty = st.r_exp > now
  end
  if st.raw and st.r_exp > now then
    st.bmax = max(st.bmax, st.r_bmax)
    local debt = 0
    if fdiv(st.r_level, st.r_den) < p[1] then
      debt = p[1] * p[3] - rescale(st.r_level, st.r_den, p[3])
    end
    local whole = fdiv(debt, p[2])
    st.tat = st.written + whole
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
  local bmax = st.bmax
  -- the state matters through tick ceil(tat), and for a larger burst until
  -- its extra permits are back too
  local extra = min(bmax - p[1], fdiv(EXACT - 1, p[3]))
  local exp = gcra_ceil(st, p) + 1 + cdiv(extra * p[3], p[2])
  redis.call('SET', st.key, struct.pack('<c1ddddd', 'G', level, p[3], now, exp, bmax),
    'PX', px(exp, from))
end

-- The decision of one limit (see `decide_one` in driver.lua): the steps
-- above on locals, the common cases inline, for the production path. `s` is
-- the limit's spec: s[2..4] = p, s[6] = cost, s[7] = B * W,
-- s[8] = (B - cost) * W, s[9] = cost * W.
local function gcra_one(keys, s, store_now, max_wait, dry, from)
  local b, n, w, cost = s[2], s[3], s[4], s[6]
  local key = keys[1]
  local now, tat, frac, bmax = store_now, store_now, 0, b
  -- load and prepare
  local v = rpcall('GET', key)
  if v and #v == 41 then -- (an error reply is a table: #v == 0)
    local tag, level, den, written, exp, r_bmax = sunpack('<c1ddddd', v)
    -- (each field an integer below 2^53 in magnitude, as int() checks;
    -- 2^53 written out: a literal is an operand of the comparison, an upvalue
    -- must be loaded first)
    if tag == 'G' and level % 1 == 0 and level < 9007199254740992 and level > -9007199254740992
        and den % 1 == 0 and den > 0 and den < 9007199254740992
        and written % 1 == 0 and written < 9007199254740992 and written > -9007199254740992
        and exp % 1 == 0 and exp < 9007199254740992 and exp > -9007199254740992
        and r_bmax % 1 == 0 and r_bmax < 9007199254740992 and r_bmax > -9007199254740992 then
      if written > now then
        -- beyond the limit's horizon, the steps above move the state back
        if written - now > s.h then return decide_one(keys, s, store_now, max_wait, dry, from) end
        now = written
      end
      tat = now
      if exp > now then
        if r_bmax > b then bmax = r_bmax end
        local debt = 0
        if den == w then -- fdiv(level, w) < b, exactly: B * W < 2^53
          if level < s[7] then debt = s[7] - level end
        elseif fdiv(level, den) < b then
          debt = s[7] - rescale(level, den, w)
        end
        local r = debt % n -- whole = fdiv(debt, n)
        if r < 0 then r = r + n elseif r >= n then r = r - n end
        local whole = (debt - r) / n
        tat, frac = written + whole, debt - whole * n
        if frac > 0 then
          if tat + 1 < now then tat, frac = now, 0 end
        elseif tat < now then
          tat = now
        end
      end
    end
  end
  if tat == now and frac == 0 and bmax == b and s[16] and now < s[17] and max_wait >= 0
      and not dry then
    -- a full bucket (the common case: a key that rested) grants 1 <= cost
    -- <= B at once, to the same state and status every time (spec[10..15]:
    -- exactly what the steps below compute while the new TAT's tick stays
    -- below 2^53)
    local ms = px(now + s[13], from)
    rcall('SET', key, spack('<c1ddddd', 'G', s[12], w, now, now + s[13], b), 'PX', ms)
    return spack('<dddddd', 0, 0, now, 0, s[14], s[15])
  end
  -- earliest
  local t = now
  if cost > 0 then
    if cost > b then
      t = -1
    else
      local x = s[8] - frac -- t = max(now, tat - fdiv(x, n))
      local r = x % n
      if r < 0 then r = r + n elseif r >= n then r = r - n end
      t = tat - (x - r) / n
      if t < now then t = now end
    end
  end
  local outcome, wait = verdict(t, now, max_wait)
  local as_of = now
  if outcome == 0 and not dry then
    as_of = t
    if cost > 0 then
      -- grant
      if frac > 0 then
        if tat + 1 < t then tat, frac = t, 0 end
      elseif tat < t then
        tat = t
      end
      local total = frac + s[9]
      local r = total % n
      if r < 0 then r = r + n elseif r >= n then r = r - n end
      local whole = (total - r) / n
      tat, frac = tat + whole, total - whole * n
      -- save
      local exp = tat + 1
      if frac > 0 then exp = tat + 2 end
      if bmax > b then
        local extra = min(bmax - b, fdiv(EXACT - 1, w))
        exp = exp + cdiv(extra * w, n)
      end
      local ms = px(exp, from)
      rcall('SET', key, spack('<c1ddddd', 'G', s[7] - ((tat - now) * n + frac), w, now, exp, bmax),
        'PX', ms)
    end
  end
  -- status
  local used = 0 -- (tat - as_of) scaled by N
  if tat >= as_of then used = (tat - as_of) * n + frac end
  local x = s[7] - used -- remaining = max(0, min(b, fdiv(x, w)))
  local r = x % w
  if r < 0 then r = r + w elseif r >= w then r = r - w end
  local remaining = (x - r) / w
  if remaining > b then remaining = b elseif remaining < 0 then remaining = 0 end
  local reset = 0
  if tat >= now then
    reset = tat - now
    if frac > 0 then -- + cdiv(frac, n), 0 < frac < n
      reset = reset + 1
    end
  end
  if t >= 0 then t = t - now end
  return spack('<dddddd', outcome, wait, now, t, remaining, reset)
end

local gcra = {
  load = gcra_load, prepare = gcra_prepare, earliest = gcra_earliest,
  grant = gcra_grant, status = gcra_status, save = gcra_save,
  refund = gcra_refund, one = gcra_one,
  -- the longest wait the limit asks by itself: B emission intervals
  horizon = function(p) return cdiv(p[1] * p[3], p[2]) end,
  -- the constants gcra_one reads from a spec; [10..17] describe a grant
  -- from a full bucket (TAT = now): the TAT moves whole = s[10] us and
  -- frac = s[11] ahead, the level left is s[12], the state expires s[13]
  -- after now, remaining s[14], reset_after s[15]; s[16]: 1 <= cost <= B;
  -- s[17]: the clocks below which now + s[13] is exact
  derive = function(s)
    local b, n, w, cost = s[2], s[3], s[4], s[6]
    s[7], s[8], s[9] = b * w, (b - cost) * w, cost * w
    s[16] = cost >= 1 and cost <= b
    if s[16] then
      local whole = fdiv(s[9], n)
      local frac = s[9] - whole * n
      s[10], s[11], s[12] = whole, frac, s[7] - s[9]
      s[13], s[14], s[15] = whole + 1, b - cost, whole
      if frac > 0 then s[13], s[15] = whole + 2, whole + 1 end
      s[17] = EXACT - 2 - whole
    end
  end,
}
