-- fixed_window.lua: N permits per window aligned to the epoch (floor(t/W)*W).
--
-- KEYS: counter (STRING 'F' start len count written): the count of the window of
--       `len` us beginning at `start` (us); a start ahead of `written` holds
--       reservations, and later grants queue behind it.
-- Params: n = N (limit), w = W (window, us), code = a calendar quota's
--         code (see `cal` in common.lua; 0: windows aligned to the epoch,
--         else W is its longest window)
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
--: params fw: n w code

--: stored fw F: r_start r_len+ r_count written

--: step fw prepare(now)
  start, count, kept = -1, 0, false
  -- dated after the decision's clock: moved back to it (see "Clock steps"
  -- in driver.lua), and written back if it still holds something
  local moved = written > now
  if moved then r_start, written = r_start - (written - now), now end
  -- present, and its window not over
  if raw and r_start + r_len > now then
    local own
    --: paste own_window(r_start, r_len, code, w) -> own
    if own and not moved then
      start, count, kept = r_start, r_count, true
    else
      -- the window of this limit that holds the stored one's grants, if any
      -- (a moved window need not start where one of this limit's does)
      local at = now
      if r_start > now then at = r_start end
      local ws, wl
      if code < 0 then ws, wl = cal(at, code) else ws, wl = at - fmod(at, w), w end
      if r_start < ws + wl and ws < r_start + r_len then
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
    local ws, wl, wb, used -- the window of now, or the counted one after it
    --: paste window_of(now, code, w) -> ws, wl, wb
    used = 0
    if start >= ws then
      if start > ws and code < 0 then ws, wl = cal(start, code) end
      ws, used = start, count
    end
    if used + cost <= n then
      t = now
      if ws > now then t = ws end
    else
      t = ws + wl
    end
  end
--: end

--: step fw grant(at, cost)
  local ws, wl, wb
  --: paste window_of(at, code, w) -> ws, wl, wb
  if start == ws then
    count = count + cost
  else
    start, count, kept = ws, cost, false
  end
  dirty = true
--: end

-- Gives back `cost` granted at `at`, if `at` lies in the counted window.
--: step fw refund(now, at, cost)
  local ws
  if code < 0 then ws = cal(at, code) else ws = at - fmod(at, w) end
  if start >= 0 and count > 0 and ws == start then
    count, dirty = max(0, count - cost), true
  end
--: end

-- Permits left in the window of `at`, and microseconds until it ends.
--: step fw status(now, at) -> remaining, reset
  local ws, wl, wb
  --: paste window_of(at, code, w) -> ws, wl, wb
  if start > ws then
    if code < 0 then ws, wl = cal(start, code) end
    remaining, reset = 0, start + wl - now
  elseif start == ws then
    remaining, reset = n - count, start + wl - now
    if remaining < 0 then remaining = 0 end
  else
    remaining, reset = n, 0
  end
--: end

--: step fw save(now, from, nx) -> was
  if dirty then
    local ws, wl = start, w
    if code < 0 then ws, wl = cal(start, code) end
    local v = spack('<c1dddd', 'F', start, wl, count, now)
    -- (a state still of the window it was read in keeps the key's expiry)
    was = put(key, v, nx, (nx or not kept) and px(start + wl, from))
  end
--: end

--: one fw fixed_window
fixed_window.horizon = function(s) return s[3] end -- the longest wait: one window
