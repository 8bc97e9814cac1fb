-- fixed_window.lua: N permits per window aligned to the epoch (floor(t/W)*W).
--
-- KEYS: counter (STRING 'F' start len count written): the count of the window of
--       `len` us beginning at `start` (us); a start ahead of `written` holds
--       reservations, and later grants queue behind it.
-- Params: n = N (limit), w = W (window, us)
-- The window start and length are stored with the count, so a late expiry
-- never makes an old count look current, and a limiter with another W counts
-- the stored grants in its own window whenever the two windows overlap (the
-- grants may lie anywhere in the stored window: counting them is the safe side).
--
-- The steps, on locals (see build.rs): `raw` says the key held a state,
-- r_* its fields; `start` and `count` the counted window (start -1: none),
-- `kept` whether it is the stored one, unmoved, with this limit's length
-- (its key already expires at the window's end).
--: state fw: key written raw r_start r_len r_count start count kept dirty fresh
--: params fw: n w

--: stored fw F: r_start r_len+ r_count written

--: step fw prepare(now)
  start, count, kept = -1, 0, false
  -- dated after the decision's clock: moved back to it (see "Clock steps"
  -- in driver.lua), and written back if it still holds something
  local moved = written > now
  if moved then r_start, written = r_start - (written - now), now end
  -- present, and its window not over
  if raw and r_start + r_len > now then
    if r_len == w and not moved then
      start, count, kept = r_start, r_count, true
    else
      -- the window of this limit that holds the stored one's grants, if any
      -- (a moved window need not start where one of this limit's does)
      local at = now
      if r_start > now then at = r_start end
      local ws = at - fmod(at, w)
      if r_start < ws + w and ws < r_start + r_len then
        start, count, dirty = ws, r_count, moved
      end
    end
  end
  -- nothing counted: any cost up to N fits now
  fresh = start < 0
--: end

-- In the counted window if it is not over, else in the current one.
--: step fw earliest(now, cost) -> t
  if cost > n then
    t = -1
  else
    local m = now % w -- the window of now: now - fmod(now, w)
    if m < 0 then m = m + w elseif m >= w then m = m - w end
    local ws, used = now - m, 0
    if start >= ws then ws, used = start, count end
    if used + cost <= n then
      t = now
      if ws > now then t = ws end
    else
      t = ws + w
    end
  end
--: end

--: step fw grant(at, cost)
  local m = at % w -- the window of at: at - fmod(at, w)
  if m < 0 then m = m + w elseif m >= w then m = m - w end
  if start == at - m then
    count = count + cost
  else
    start, count, kept = at - m, cost, false
  end
  dirty = true
--: end

-- Gives back `cost` granted at `at`, if `at` lies in the counted window.
--: step fw refund(now, at, cost)
  if start >= 0 and count > 0 and at - fmod(at, w) == start then
    count, dirty = max(0, count - cost), true
  end
--: end

-- Permits left in the window of `at`, and microseconds until it ends.
--: step fw status(now, at) -> remaining, reset
  local m = at % w
  if m < 0 then m = m + w elseif m >= w then m = m - w end
  if start > at - m then
    remaining, reset = 0, start + w - now
  elseif start == at - m then
    remaining, reset = n - count, start + w - now
    if remaining < 0 then remaining = 0 end
  else
    remaining, reset = n, 0
  end
--: end

--: step fw save(now, from, nx) -> was
  if dirty then
    local v = spack('<c1dddd', 'F', start, w, count, now)
    -- (a state still of the window it was read in keeps the key's expiry)
    was = put(key, v, nx, (nx or not kept) and px(start + w, from))
  end
--: end

--: one fw fixed_window
fixed_window.horizon = function(s) return s[3] end -- the longest wait: one window
