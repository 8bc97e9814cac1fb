-- sliding_window.lua: sliding window counter, two counters per key (O(1) memory).
--
-- KEYS: counters (STRING 'S' start len prev cur written): the counts of the window
--       of `len` us beginning at `start` (us) and of the one before it
-- Params: n = N (limit), w = W (window, us), u = U (weight step, us:
--         ceil(W / 2^20), so weights have 2^20 steps and N * 2^20 < 2^53);
--         s[6] = ceil(W / U), the steps of a whole window. A calendar
--         quota's u is its code instead (negative: see `cal` in
--         common.lua), W its longest window, and each window's U and
--         steps are those of the window before it, which weighs in
--         proportion to how much of it lies within its own length of now.

-- Estimate at t: cur + prev * ceil(rem / U) / ceil(W / U), rem = time left in
-- the current window. A cost c fits when prev * ceil(rem/U) <= (N - cur - c) * ceil(W/U).
-- A limiter with another W moves each stored count into the newest of its own
-- windows (current, else previous) that overlaps the count's window: the
-- grants may lie anywhere in that window, and newer counts weigh more.
--
-- The steps, on locals (see build.rs): `raw` says the key held a state,
-- r_* its fields; `start` the counted window (see prepare), `prev` and
-- `cur` the counts of the one before it and of it; `kept` whether it is the
-- stored one, unmoved, with this limit's length (its key already expires
-- after the next window's end).
--: state sw: key written raw r_start r_len r_prev r_cur start prev cur kept dirty fresh
--: params sw: n w u

-- (prev, cur) as the window at `at` sees counts `prev`, `cur` of the window
-- at `start`: its own, the next one's (the current count is previous), or
-- none.
local function sw_counts(start, prev, cur, at, w)
  if start == at then return prev, cur end
  if start == at - w then return cur, 0 end
  return 0, 0
end

-- When the count of the window at `start` stops weighing: W after the
-- next window begins (inline where it is used); for a calendar quota (code
-- `u`), whose windows differ in length, its length after the next window
-- begins, or that window's end if sooner.
local function cal_until(start, u)
  local _, len, _, next_len = cal(start, u)
  return start + len + min(len, next_len)
end

--: stored sw S: r_start r_len+ r_prev r_cur written

-- After prepare the counted window starts at or after the window of now:
-- a past one is rolled forward to it (its count previous, if it was the
-- window before, else both gone), which changes no decision.
--: step sw prepare(now)
  start, prev, cur, kept = -1, 0, 0, false
  -- dated after the decision's clock: moved back to it (see "Clock steps"
  -- in driver.lua), and written back if it still holds something
  local moved = written > now
  if moved then r_start, written = r_start - (written - now), now end
  -- present, and not both windows over
  if raw and r_start + 2 * r_len > now then
    local own
    --: paste own_window(r_start, r_len, u, w) -> own
    if own and not moved then
      start, prev, cur, kept = r_start, r_prev, r_cur, true
    else
      -- each stored count into the newest of this limit's windows that
      -- overlaps its window (a moved window need not start where one of
      -- this limit's does)
      local at = now
      if r_start > now then at = r_start end
      local ws, wl, wb
      if u < 0 then ws, wl, wb = cal(at, u) else ws, wl, wb = at - fmod(at, w), w, w end
      for k = 1, 2 do
        local c, s0 = r_cur, r_start
        if k == 2 then c, s0 = r_prev, r_start - r_len end
        if c > 0 then
          if s0 < ws + wl and ws < s0 + r_len then
            cur = cur + c
          elseif s0 < ws and ws - wb < s0 + r_len then
            prev = prev + c
          end
        end
      end
      if prev + cur > 0 then start, dirty = ws, moved end
    end
  end
  local ws, wl, wb -- the window of now
  --: paste window_of(now, u, w) -> ws, wl, wb
  if start < ws then
    if start >= 0 then prev, cur = sw_counts(start, prev, cur, ws, wb) end
    start, kept = ws, false
  end
  -- nothing counted: any cost up to N fits now
  fresh = prev == 0 and cur == 0 and start <= now
--: end

-- The first of three windows (the counted one and the two after it) whose
-- estimate lets the cost in: the earliest time in it that does.
--: step sw earliest(now, cost) -> t
  if cost > n then
    t = -1
  else
    -- each window's start and length, the one before's length, and its
    -- weight step and steps
    local ws, p0, c0 = start, prev, cur
    local wl, wb, uu, wu = w, w, u, s[6]
    if u < 0 then ws, wl, wb = cal(start, u) end
    t = nil
    for _ = 1, 3 do
      if c0 + cost <= n then
        if p0 == 0 then
          t = ws
          break
        end
        if u < 0 then uu = cdiv(wb, 1048576) wu = cdiv(wb, uu) end
        local x = (n - c0 - cost) * wu -- steps = fdiv(x, p0)
        local m = x % p0
        if m < 0 then m = m + p0 elseif m >= p0 then m = m - p0 end
        x = ws + wb - (x - m) / p0 * uu
        if x < ws then x = ws end
        if x < ws + wl then
          t = x
          break
        end
      end
      ws, p0, c0 = ws + wl, c0, 0
      if u < 0 then ws, wl, wb = cal(ws, u) end
    end
    if not t then t = ws end
    if t < now then t = now end
  end
--: end

--: step sw grant(at, cost)
  local ws, wl, wb
  --: paste window_of(at, u, w) -> ws, wl, wb
  if start ~= ws then
    prev, cur = sw_counts(start, prev, cur, ws, wb)
    start, kept = ws, false
  end
  cur, dirty = cur + cost, true
--: end

-- Gives back `cost` granted at `at`: from the current or the previous
-- window, whichever holds `at`; nothing if older.
--: step sw refund(now, at, cost)
  if start >= 0 then
    local ws, wl
    if u < 0 then ws, wl = cal(at, u) else ws, wl = at - fmod(at, w), w end
    if ws == start and cur > 0 then
      cur, dirty = max(0, cur - cost), true
    elseif ws + wl == start and prev > 0 then
      prev, dirty = max(0, prev - cost), true
    end
  end
--: end

-- Permits the estimate leaves as of `at`, and microseconds until it is 0.
--: step sw status(now, at) -> remaining, reset
  local ws, wl, wb
  --: paste window_of(at, u, w) -> ws, wl, wb
  if start > ws then
    remaining, reset = 0, start + 2 * w - now
    if u < 0 then reset = cal_until(start, u) - now end
  else
    local p0, c0 = prev, cur
    if start ~= ws then p0, c0 = sw_counts(start, prev, cur, ws, wb) end
    remaining = n - c0
    if p0 ~= 0 then
      -- less what p0 weighs with rem = ws + wb - at us left of it, at
      -- least 0: cdiv(p0 * cdiv(rem, uu), ceil(wb / uu))
      local uu, wu = u, s[6]
      if u < 0 then uu = cdiv(wb, 1048576) wu = cdiv(wb, uu) end
      local x = at - ws - wb
      if x > 0 then x = 0 end
      local m = x % uu
      if m < 0 then m = m + uu elseif m >= uu then m = m - uu end
      x = p0 * ((x - m) / uu) -- -(p0 * cdiv(rem, uu))
      m = x % wu
      if m < 0 then m = m + wu elseif m >= wu then m = m - wu end
      remaining = remaining + (x - m) / wu
    end
    if remaining < 0 then remaining = 0 end
    reset = 0
    if c0 > 0 then
      reset = ws + 2 * w - now
      if u < 0 then reset = cal_until(ws, u) - now end
    elseif p0 > 0 then
      reset = ws + min(wb, wl) - now
    end
  end
--: end

--: step sw save(now, from, nx) -> was
  if dirty then
    local ws, wl = start, w
    if u < 0 then ws, wl = cal(start, u) end
    local v = spack('<c1ddddd', 'S', start, wl, prev, cur, now)
    -- (a state still of the window it was read in keeps the key's expiry)
    was = put(key, v, nx, (nx or not kept) and px(start + 2 * wl, from))
  end
--: end

--: one sw sliding_window
sliding_window.derive = function(s) if s[4] > 0 then s[6] = cdiv(s[3], s[4]) end end
-- the longest wait: two windows (the estimate weighs the previous one)
sliding_window.horizon = function(s) return 2 * s[3] end
