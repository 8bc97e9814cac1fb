-- gcra.lua: generic cell rate algorithm (leaky bucket as a meter).
--
-- KEYS: gcra (STRING 'G' level den written exp bmax): `level / den` permits left
--       at the writer's clock `written` (us), negative while reservations are
--       pending; `bmax` the largest burst that wrote the state; `exp` when the
--       bucket has refilled to `bmax`. The theoretical arrival time
--       (TAT) lies (B - level) emission intervals after `written`. An amount, not a
--       time, so another rate or burst reads what is left (converted, rounded
--       down, clamped to its burst).
-- Params: b = B (burst), n = N, w = W (rate N per W us, reduced by gcd)
-- Internally the TAT is tat + frac/N us exactly (0 <= frac < N), so a rate
-- like 3 per second (333333.33.. us apart) never drifts; the level is kept in
-- units of 1/W permit, so tat = written + (B * W - level) / N.
-- Emission interval T = W/N. A cost c fits at t when tat - t <= (B - c) * T,
-- i.e. (tat_us - t) * N + frac <= (B - c) * W: all integers.
-- A missing key (or a tat in the past) is a full bucket. Arrivals are timed to
-- the microsecond: one in the tick that holds the TAT (t <= ceil(tat)) counts
-- as on time, so the fraction is kept and the long-run rate is exactly N/W.
--
-- The steps, on locals (see build.rs): `raw` says the key held a state,
-- r_* its fields; tat, frac, bmax the state as of the decision's clock.
--: state gcra: key written raw r_level r_den r_exp r_bmax tat frac bmax dirty fresh
--: params gcra: b n w

--: stored gcra G: r_level r_den+ written r_exp r_bmax

--: step gcra prepare(now)
  tat, frac, bmax = now, 0, b
  if written > now then
    -- dated after the decision's clock: moved back to it (see "Clock steps"
    -- in driver.lua), and written back if it still holds something
    r_exp, written = r_exp - (written - now), now
    dirty = r_exp > now
  end
  if raw and r_exp > now then
    if r_bmax > b then bmax = r_bmax end
    local debt = 0
    if r_den == w then -- fdiv(r_level, w) < b, exactly: B * W < 2^53
      if r_level < b * w then debt = b * w - r_level end
    elseif fdiv(r_level, r_den) < b then
      debt = b * w - rescale(r_level, r_den, w)
    end
    local r = debt % n -- whole = fdiv(debt, n)
    if r < 0 then r = r + n elseif r >= n then r = r - n end
    local whole = (debt - r) / n
    tat, frac = written + whole, debt - whole * n
    -- a TAT whose tick ceil(tat) is past: a full bucket
    if frac > 0 then
      if tat + 1 < now then tat, frac = now, 0 end
    elseif tat < now then
      tat = now
    end
  end
  -- a full bucket: any cost up to B fits now
  fresh = tat == now and frac == 0
--: end

-- The earliest time the cost (1 <= cost) fits: max(now, tat - fdiv((B -
-- cost) * W - frac, N)), never (-1) for a cost over B.
--: step gcra earliest(now, cost) -> t
  if cost > b then
    t = -1
  else
    local x = (b - cost) * w - frac
    local r = x % n
    if r < 0 then r = r + n elseif r >= n then r = r - n end
    t = tat - (x - r) / n
    if t < now then t = now end
  end
--: end

--: step gcra grant(at, cost)
  if frac > 0 then
    if tat + 1 < at then tat, frac = at, 0 end
  elseif tat < at then
    tat = at
  end
  local total = frac + cost * w
  local r = total % n -- whole = fdiv(total, n)
  if r < 0 then r = r + n elseif r >= n then r = r - n end
  local whole = (total - r) / n
  tat, frac, dirty = tat + whole, total - whole * n, true
--: end

-- Gives back `cost`: the TAT moves back `cost` emission intervals, never
-- before `now` (a full burst).
--: step gcra refund(now, at, cost)
  local x = (tat - now) * n + frac - cost * w
  local t, f = now, 0
  if x > 0 then
    local whole = fdiv(x, n)
    t, f = now + whole, x - whole * n
  end
  if t ~= tat or f ~= frac then tat, frac, dirty = t, f, true end
--: end

-- Permits left as of `at` and microseconds until the bucket is full.
--: step gcra status(now, at) -> remaining, reset
  local used = 0 -- (tat - at) scaled by N
  if tat >= at then used = (tat - at) * n + frac end
  local x = b * w - used -- remaining = max(0, min(b, fdiv(x, w)))
  local r = x % w
  if r < 0 then r = r + w elseif r >= w then r = r - w end
  remaining = (x - r) / w
  if remaining > b then remaining = b elseif remaining < 0 then remaining = 0 end
  reset = 0
  if tat >= now then
    reset = tat - now
    if frac > 0 then reset = reset + 1 end -- + cdiv(frac, n), 0 < frac < n
  end
--: end

-- The state matters through tick ceil(tat), and for a larger burst until its
-- extra permits are back too.
--: step gcra save(now, from, nx) -> was
  if dirty then
    local exp = tat + 1
    if frac > 0 then exp = tat + 2 end
    if bmax > b then exp = exp + cdiv(min(bmax - b, fdiv(EXACT - 1, w)) * w, n) end
    local v = spack('<c1ddddd', 'G', b * w - ((tat - now) * n + frac), w, now, exp, bmax)
    was = put(key, v, nx, px(exp, from))
  end
--: end

--: one gcra gcra
-- the longest wait the limit asks by itself: B emission intervals
gcra.horizon = function(s) return cdiv(s[2] * s[4], s[3]) end
