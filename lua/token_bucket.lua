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
-- Params: c = C (capacity), r = R, p = P (refill R tokens per P us, reduced
--         by their gcd on the Rust side). Internally the level is kept
--         in units of 1/P token; another P's level is converted, rounded down,
--         and clamped to C: what is left stays what is left.
-- A missing key is a full bucket. A denied request writes nothing.
--
-- The steps, on locals (see build.rs): `raw` says the key held a state,
-- r_* its fields; level, ts, cmax the state as of the decision's clock.
--: state tb: key written raw r_level r_den r_ts r_exp r_cmax level ts cmax dirty fresh
--: params tb: c r p

-- The fill at time t of a bucket filled `level` at `ts`, full at `full`:
-- full once elapsed >= cdiv(full - level, r), i.e. elapsed * r >= full -
-- level (exact: a product rounded above 2^53 is still above the need).
local function tb_fill(level, ts, t, full, r)
  local elapsed = t - ts
  if elapsed <= 0 then return level end
  if elapsed * r >= full - level then return full end
  return level + elapsed * r
end

--: stored tb T: r_level r_den+ r_ts written r_exp r_cmax

-- After prepare the bucket's fill is as of `ts` >= now: a past `ts` is
-- refilled to now (which changes no decision: the fill is linear up to the
-- capacity), a later one is a reservation's.
--: step tb prepare(now)
  level, ts, cmax = c * p, now, c
  if written > now then
    -- dated after the decision's clock: moved back to it (see "Clock steps"
    -- in driver.lua), and written back if it still holds something
    local d = written - now
    r_ts, r_exp, written = r_ts - d, r_exp - d, now
    dirty = r_exp > now
  end
  if raw and r_exp > now then
    if r_cmax > c then cmax = r_cmax end
    if r_den == p then -- fdiv(r_level, p) < c, exactly: C * P < 2^53
      if r_level < c * p then level = r_level end
    elseif fdiv(r_level, r_den) < c then
      level = rescale(r_level, r_den, p)
    end
    ts = r_ts
    if ts < now then level, ts = tb_fill(level, ts, now, c * p, r), now end
  end
  -- a full bucket: any cost up to C fits now
  fresh = ts == now and level == c * p
--: end

--: step tb earliest(now, cost) -> t
  if cost > c then
    t = -1
  else
    t = ts
    if cost * p > level then t = ts + cdiv(cost * p - level, r) end
  end
--: end

--: step tb grant(at, cost)
  if at > ts then level = tb_fill(level, ts, at, c * p, r) end
  level, ts, dirty = level - cost * p, at, true
--: end

-- Gives back `cost` tokens, never above the capacity.
--: step tb refund(now, at, cost)
  if level < c * p then level, dirty = min(c * p, level + cost * p), true end
--: end

-- Tokens left as of `at` (none while reserved) and microseconds until full.
--: step tb status(now, at) -> remaining, reset
  local t, fill = ts, level
  remaining = 0
  if at >= ts then
    t = at
    if at > ts then fill = tb_fill(level, ts, at, c * p, r) end
    local m = fill % p -- remaining = fdiv(fill, p)
    if m < 0 then m = m + p elseif m >= p then m = m - p end
    remaining = (fill - m) / p
  end
  local x = fill - c * p -- reset = t - now + cdiv(c * p - fill, r)
  local m = x % r
  if m < 0 then m = m + r elseif m >= r then m = m - r end
  reset = t - now - (x - m) / r
--: end

-- The bucket is full again, at its largest capacity, at `exp`.
--: step tb save(now, from, nx) -> was
  if dirty then
    local top = c * p
    if cmax > c then top = min(cmax, fdiv(EXACT - 1, p)) * p end
    local x = level - top -- exp = ts + cdiv(top - level, r)
    local m = x % r
    if m < 0 then m = m + r elseif m >= r then m = m - r end
    local exp = ts - (x - m) / r
    local v = spack('<c1dddddd', 'T', level, p, ts, now, exp, cmax)
    was = put(key, v, nx, px(exp, from))
  end
--: end

--: one tb token_bucket
-- the longest wait the limit asks by itself: a full bucket's refill
token_bucket.horizon = function(s) return cdiv(s[2] * s[4], s[3]) end
