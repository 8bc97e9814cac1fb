-- sliding_window.lua: sliding window counter, two counters per key (O(1) memory).
--
-- KEYS: counters (STRING 'S' start len prev cur written): the counts of the window
--       of `len` us beginning at `start` (us) and of the one before it
-- Params: p[1] = N (limit), p[2] = W (window, us), p[3] = U (weight step, us:
--         ceil(W / 2^20), so weights have 2^20 steps and N * 2^20 < 2^53)
-- Estimate at t: cur + prev * ceil(rem / U) / ceil(W / U), rem = time left in
-- the current window. A cost c fits when prev * ceil(rem/U) <= (N - cur - c) * ceil(W/U).
-- A limiter with another W moves each stored count into the newest of its own
-- windows (current, else previous) that overlaps the count's window: the
-- grants may lie anywhere in that window, and newer counts weigh more.
local function sw_load(keys, i, p)
  local st = { key = keys[i], written = 0, raw = false, r_start = 0, r_len = 1, r_prev = 0, r_cur = 0,
    start = -1, prev = 0, cur = 0, dirty = false }
  local v = get_packed(st.key, 83, 5) -- 'S'
  if v then
    local start, len, prev, cur, written = struct.unpack('<ddddd', v, 2)
    if int(start) and int(len) and len > 0 and int(prev) and int(cur) and int(written) then
      st.raw, st.written = true, written
      st.r_start, st.r_len, st.r_prev, st.r_cur = start, len, prev, cur
    end
  end
  return st
end

local function sw_prepare(st, p, now)
  local w = p[2]
  st.start, st.prev, st.cur = -1, 0, 0
  -- dated after the decision's clock: moved back to it (see "Clock steps"
  -- in driver.lua), and written back if it still holds something
  local moved = st.written > now
  if moved then st.r_start, st.written = st.r_start - (st.written - now), now end
  -- absent, or both windows over
  if not st.raw or st.r_start + 2 * st.r_len <= now then return end
  local s, len, prev, cur = st.r_start, st.r_len, st.r_prev, st.r_cur
  if len == w and not moved then
    st.start, st.prev, st.cur = s, prev, cur
    return
  end
  -- (a moved window need not start where one of this limit's does)
  local r = now - fmod(now, w)
  if s > now then r = s - fmod(s, w) end
  for _, c in ipairs({ { cur, s, s + len }, { prev, s - len, s } }) do
    if c[1] > 0 then
      if c[2] < r + w and r < c[3] then
        st.cur = st.cur + c[1]
      elseif c[2] < r and r - w < c[3] then
        st.prev = st.prev + c[1]
      end
    end
  end
  if st.prev + st.cur > 0 then st.start, st.dirty = r, moved end
end

local function sw_counts(st, p, start) -- (prev, cur) as seen in the window at `start`
  if st.start == start then return st.prev, st.cur end
  if st.start == start - p[2] then return st.cur, 0 end
  return 0, 0
end

local function sw_earliest(st, p, now, cost)
  local n, w, u = p[1], p[2], p[3]
  if cost > n then return -1 end
  local wu = cdiv(w, u)
  local start = max(now - fmod(now, w), st.start)
  local from = max(now, start)
  for _ = 1, 3 do
    local prev, cur = sw_counts(st, p, start)
    if cur + cost <= n then
      if prev == 0 then return max(from, start) end
      local steps = fdiv((n - cur - cost) * wu, prev)
      local t = max(start, start + w - steps * u)
      if t < start + w then return max(from, t) end
    end
    start = start + w
  end
  return max(from, start)
end

local function sw_grant(st, p, at, cost)
  local start = at - fmod(at, p[2])
  local prev, cur = sw_counts(st, p, start)
  st.start, st.prev, st.cur = start, prev, cur + cost
  st.dirty = true
end

-- Gives back `cost` granted at `at`: from the current or the previous
-- window, whichever holds `at`; nothing if older.
local function sw_refund(st, p, now, at, cost)
  if st.start < 0 then return end
  local start = at - fmod(at, p[2])
  if start == st.start and st.cur > 0 then
    st.cur = max(0, st.cur - cost)
    st.dirty = true
  elseif start == st.start - p[2] and st.prev > 0 then
    st.prev = max(0, st.prev - cost)
    st.dirty = true
  end
end

local function sw_status(st, p, now, at)
  local n, w, u = p[1], p[2], p[3]
  local start = at - fmod(at, w)
  if st.start > start then return 0, st.start + 2 * w - now end
  local prev, cur = sw_counts(st, p, start)
  local used = cur + cdiv(prev * cdiv(start + w - at, u), cdiv(w, u))
  local reset = 0
  if cur > 0 then
    reset = start + 2 * w - now
  elseif prev > 0 then
    reset = start + w - now
  end
  return max(0, n - used), reset
end

local function sw_save(st, p, now, from)
  if not st.dirty then return end
  redis.call('SET', st.key, struct.pack('<c1ddddd', 'S', st.start, p[2], st.prev, st.cur, now),
    'PX', px(st.start + 2 * p[2], from))
end

-- What `prev` weighs with `rem` us left in the current window:
-- cdiv(prev * cdiv(rem, u), wu), as sw_status counts it.
local function sw_weighed(prev, rem, u, wu)
  local x = -rem
  local m = x % u
  if m < 0 then m = m + u elseif m >= u then m = m - u end
  x = prev * ((x - m) / u) -- -(prev * cdiv(rem, u))
  m = x % wu
  if m < 0 then m = m + wu elseif m >= wu then m = m - wu end
  return -((x - m) / wu)
end

-- The decision of one limit (see `decide_one` in driver.lua): the steps
-- above on locals, for the production path. s[2..4] = p, s[6] = cost,
-- s[7] = ceil(W / U).
local function sw_one(keys, s, store_now, max_wait, dry, from)
  local n, w, u, cost, wu = s[2], s[3], s[4], s[6], s[7]
  local key = keys[1]
  local now, start, prev, cur, len = store_now, -1, 0, 0, 0
  -- load and prepare
  local v = rpcall('GET', key)
  if v and #v == 41 then -- (an error reply is a table: #v == 0)
    local tag, s0, p0, c0, written
    tag, s0, len, p0, c0, written = sunpack('<c1ddddd', v)
    -- (each field an integer below 2^53 in magnitude, as int() checks;
    -- 2^53 written out: a literal is an operand of the comparison, an upvalue
    -- must be loaded first)
    if tag == 'S' and s0 % 1 == 0 and s0 < 9007199254740992 and s0 > -9007199254740992
        and len % 1 == 0 and len > 0 and len < 9007199254740992
        and p0 % 1 == 0 and p0 < 9007199254740992 and p0 > -9007199254740992
        and c0 % 1 == 0 and c0 < 9007199254740992 and c0 > -9007199254740992
        and written % 1 == 0 and written < 9007199254740992 and written > -9007199254740992 then
      if written > now then
        -- beyond the limit's horizon, the steps above move the state back
        if written - now > s.h then return decide_one(keys, s, store_now, max_wait, dry, from) end
        now = written
      end
      if s0 + 2 * len > now then
        if len == w then
          start, prev, cur = s0, p0, c0
        else
          local st = { raw = true, written = now, r_start = s0, r_len = len, r_prev = p0, r_cur = c0 }
          sw_prepare(st, s.p, now)
          start, prev, cur = st.start, st.prev, st.cur
        end
      end
    end
  end
  -- the window of now (now - fmod(now, w))
  local m = now % w
  if m < 0 then m = m + w elseif m >= w then m = m - w end
  local current = now - m
  if start <= current and s[8] and max_wait >= 0 and not dry then
    -- the common case: 1 <= cost <= N, no reservation ahead; when the
    -- first window sw_earliest tries, the current one, allows it now, it
    -- is granted now, in this window
    local p, c = 0, 0 -- sw_counts(current)
    if start == current then
      p, c = prev, cur
    elseif start == current - w then
      p = cur
    end
    if c + cost <= n then
      -- with p > 0, now is the time sw_earliest finds when the weight left
      -- of p, ru = ceil((current + w - now) / U) steps, is at most the
      -- steps the cost leaves: fdiv((N - c - cost) * ceil(W / U), p)
      local fits, ru = p == 0, 0
      if p > 0 then
        local x = -(current + w - now)
        m = x % u
        if m < 0 then m = m + u elseif m >= u then m = m - u end
        ru = -((x - m) / u)
        fits = (n - c - cost) * wu >= ru * p
      end
      if fits then
        c = c + cost
        local state = spack('<c1ddddd', 'S', current, w, p, c, now)
        if start == current and len == w then
          -- the stored state is this window's, and its key already expires
          -- after the next window's end: KEEPTTL spares Redis resetting it
          rcall('SET', key, state, 'KEEPTTL')
        else
          rcall('SET', key, state, 'PX', px(current + 2 * w, from))
        end
        local used = c
        if p > 0 then -- + sw_weighed(p, current + w - now, u, wu)
          local x = -(p * ru)
          m = x % wu
          if m < 0 then m = m + wu elseif m >= wu then m = m - wu end
          used = c - (x - m) / wu
        end
        local remaining = n - used
        if remaining < 0 then remaining = 0 end
        return spack('<dddddd', 0, 0, now, 0, remaining, current + 2 * w - now)
      end
    end
  end
  -- earliest
  local t = now
  if cost > 0 then
    if cost > n then
      t = -1
    else
      t = nil
      local at = current
      if start > at then at = start end
      local from_t = now
      if at > now then from_t = at end
      for _ = 1, 3 do
        local p, c = 0, 0 -- sw_counts(at)
        if start == at then
          p, c = prev, cur
        elseif start == at - w then
          p = cur
        end
        if c + cost <= n then
          if p == 0 then
            t = at
            break
          end
          local x = (n - c - cost) * wu -- steps = fdiv(x, p)
          m = x % p
          if m < 0 then m = m + p elseif m >= p then m = m - p end
          x = at + w - (x - m) / p * u
          if x < at then x = at end
          if x < at + w then
            t = x
            break
          end
        end
        at = at + w
      end
      if not t then t = at end
      if t < from_t then t = from_t end
    end
  end
  local outcome, wait = verdict(t, now, max_wait)
  if outcome == 0 and not dry then
    if cost > 0 then
      -- grant in the window of t
      local ts = current
      if t ~= now then
        m = t % w
        if m < 0 then m = m + w elseif m >= w then m = m - w end
        ts = t - m
      end
      if start == ts then
        cur = cur + cost
      elseif start == ts - w then
        prev, cur = cur, cost
      else
        prev, cur = 0, cost
      end
      start = ts
      -- save
      local ms = px(start + 2 * w, from)
      rcall('SET', key, spack('<c1ddddd', 'S', start, w, prev, cur, now), 'PX', ms)
      -- status as of t, in the window just counted (cur > 0)
      local used = cur
      if prev ~= 0 then -- + sw_weighed(prev, start + w - t, u, wu)
        local x = -(start + w - t)
        m = x % u
        if m < 0 then m = m + u elseif m >= u then m = m - u end
        x = prev * ((x - m) / u)
        m = x % wu
        if m < 0 then m = m + wu elseif m >= wu then m = m - wu end
        used = cur - (x - m) / wu
      end
      local remaining = n - used
      if remaining < 0 then remaining = 0 end
      return spack('<dddddd', 0, wait, now, wait, remaining, start + 2 * w - now)
    end
  end
  -- status as of now
  if t >= 0 then t = t - now end
  if start > current then return spack('<dddddd', outcome, wait, now, t, 0, start + 2 * w - now) end
  local p, c = 0, 0 -- sw_counts(current)
  if start == current then
    p, c = prev, cur
  elseif start == current - w then
    p = cur
  end
  local used = c
  if p ~= 0 then used = c + sw_weighed(p, current + w - now, u, wu) end
  local remaining = n - used
  if remaining < 0 then remaining = 0 end
  local reset = 0
  if c > 0 then
    reset = current + 2 * w - now
  elseif p > 0 then
    reset = current + w - now
  end
  return spack('<dddddd', outcome, wait, now, t, remaining, reset)
end

local sliding_window = {
  load = sw_load, prepare = sw_prepare, earliest = sw_earliest,
  grant = sw_grant, status = sw_status, save = sw_save,
  refund = sw_refund, one = sw_one,
  -- s[7] = ceil(W / U), s[8]: 1 <= cost <= N
  derive = function(s) s[7], s[8] = cdiv(s[3], s[4]), s[6] >= 1 and s[6] <= s[2] end,
  -- the longest wait: two windows (the estimate weighs the previous one)
  horizon = function(p) return 2 * p[2] end,
}
