-- fixed_window.lua: N permits per window aligned to the epoch (floor(t/W)*W).
--
-- KEYS: counter (STRING 'F' start len count written): the count of the window of
--       `len` us beginning at `start` (us); a start ahead of `written` holds
--       reservations, and later grants queue behind it.
-- Params: p[1] = N (limit), p[2] = W (window, us)
-- The window start and length are stored with the count, so a late expiry
-- never makes an old count look current, and a limiter with another W counts
-- the stored grants in its own window whenever the two windows overlap (the
-- grants may lie anywhere in the stored window: counting them is the safe side).
local function fw_load(keys, i, p)
  local st = { key = keys[i], written = 0, raw = false, r_start = 0, r_len = 1, r_count = 0,
    start = -1, count = 0, dirty = false }
  local v = get_packed(st.key, 70, 4) -- 'F'
  if v then
    local start, len, count, written = struct.unpack('<dddd', v, 2)
    if int(start) and int(len) and len > 0 and int(count) and int(written) then
      st.raw, st.written, st.r_start, st.r_len, st.r_count = true, written, start, len, count
    end
  end
  return st
end

local function fw_prepare(st, p, now)
  local w = p[2]
  st.start, st.count = -1, 0
  -- dated after the decision's clock: moved back to it (see "Clock steps"
  -- in driver.lua), and written back if it still holds something
  local moved = st.written > now
  if moved then st.r_start, st.written = st.r_start - (st.written - now), now end
  -- absent, or its window is over
  if not st.raw or st.r_start + st.r_len <= now then return end
  local s, len, count = st.r_start, st.r_len, st.r_count
  if len == w and not moved then
    st.start, st.count = s, count
    return
  end
  -- the window of this limit that holds the stored one's grants, if any
  -- (a moved window need not start where one of this limit's does)
  local r = now - fmod(now, w)
  if s > now then r = s - fmod(s, w) end
  if s < r + w and r < s + len then
    st.start, st.count, st.dirty = r, count, moved
  end
end

local function fw_count_in(st, start) -- count of the window beginning at `start`
  if st.start == start then return st.count end
  return 0
end

local function fw_earliest(st, p, now, cost)
  local n, w = p[1], p[2]
  if cost > n then return -1 end
  local start = max(now - fmod(now, w), st.start)
  if fw_count_in(st, start) + cost <= n then return max(now, start) end
  return start + w
end

local function fw_grant(st, p, at, cost)
  local start = at - fmod(at, p[2])
  st.count = fw_count_in(st, start) + cost
  st.start = start
  st.dirty = true
end

-- Gives back `cost` granted at `at`, if `at` lies in the counted window.
local function fw_refund(st, p, now, at, cost)
  if st.start < 0 or st.count == 0 or at - fmod(at, p[2]) ~= st.start then return end
  st.count = max(0, st.count - cost)
  st.dirty = true
end

local function fw_status(st, p, now, at)
  local n, w = p[1], p[2]
  local start = at - fmod(at, w)
  if st.start > start then return 0, st.start + w - now end
  if st.start == start then return max(0, n - st.count), start + w - now end
  return n, 0
end

local function fw_save(st, p, now, from)
  if not st.dirty then return end
  redis.call('SET', st.key, struct.pack('<c1dddd', 'F', st.start, p[2], st.count, now),
    'PX', px(st.start + p[2], from))
end

-- The decision of one limit (see `decide_one` in driver.lua): the steps
-- above on locals, for the production path. s[2], s[3] = p, s[6] = cost.
local function fw_one(keys, s, store_now, max_wait, dry, from)
  local n, w, cost = s[2], s[3], s[6]
  local key = keys[1]
  local now, start, count, len = store_now, -1, 0, 0
  -- load and prepare
  local v = rpcall('GET', key)
  if v and #v == 33 then -- (an error reply is a table: #v == 0)
    local tag, s0, c0, written
    tag, s0, len, c0, written = sunpack('<c1dddd', v)
    -- (each field an integer below 2^53 in magnitude, as int() checks;
    -- 2^53 written out: a literal is an operand of the comparison, an upvalue
    -- must be loaded first)
    if tag == 'F' and s0 % 1 == 0 and s0 < 9007199254740992 and s0 > -9007199254740992
        and len % 1 == 0 and len > 0 and len < 9007199254740992
        and c0 % 1 == 0 and c0 < 9007199254740992 and c0 > -9007199254740992
        and written % 1 == 0 and written < 9007199254740992 and written > -9007199254740992 then
      if written > now then
        -- beyond the limit's horizon, the steps above move the state back
        if written - now > s.h then return decide_one(keys, s, store_now, max_wait, dry, from) end
        now = written
      end
      if s0 + len > now then
        if len == w then
          start, count = s0, c0
        else
          local st = { raw = true, written = now, r_start = s0, r_len = len, r_count = c0 }
          fw_prepare(st, s.p, now)
          start, count = st.start, st.count
        end
      end
    end
  end
  -- the window of now (now - fmod(now, w))
  local m = now % w
  if m < 0 then m = m + w elseif m >= w then m = m - w end
  local current = now - m
  if start <= current and s[7] and max_wait >= 0 and not dry then
    -- the common case: 1 <= cost <= N, no reservation ahead; when it fits
    -- in the current window it is granted now, in this window
    local used = cost
    if start == current then used = count + cost end
    if used <= n then
      local state = spack('<c1dddd', 'F', current, w, used, now)
      if start == current and len == w then
        -- the stored state is this window's, and its key already expires
        -- after the window's end: KEEPTTL spares Redis resetting it
        rcall('SET', key, state, 'KEEPTTL')
      else
        rcall('SET', key, state, 'PX', px(current + w, from))
      end
      return spack('<dddddd', 0, 0, now, 0, n - used, current + w - now)
    end
  end
  -- earliest: in the counted window if it is not over, else in the current one
  local t = now
  if cost > 0 then
    if cost > n then
      t = -1
    else
      local at, used = current, 0
      if start >= current then at, used = start, count end
      if used + cost <= n then
        if at > now then t = at end
      else
        t = at + w
      end
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
      if start == ts then count = count + cost else count = cost end
      start = ts
      -- save
      local ms = px(start + w, from)
      rcall('SET', key, spack('<c1dddd', 'F', start, w, count, now), 'PX', ms)
      -- status as of t, in the window just counted
      local remaining = n - count
      if remaining < 0 then remaining = 0 end
      return spack('<dddddd', 0, wait, now, wait, remaining, start + w - now)
    end
  end
  -- status as of now
  if t >= 0 then t = t - now end
  if start > current then return spack('<dddddd', outcome, wait, now, t, 0, start + w - now) end
  if start == current then
    local remaining = n - count
    if remaining < 0 then remaining = 0 end
    return spack('<dddddd', outcome, wait, now, t, remaining, current + w - now)
  end
  return spack('<dddddd', outcome, wait, now, t, n, 0)
end

local fixed_window = {
  load = fw_load, prepare = fw_prepare, earliest = fw_earliest,
  grant = fw_grant, status = fw_status, save = fw_save,
  refund = fw_refund, one = fw_one,
  derive = function(s) s[7] = s[6] >= 1 and s[6] <= s[2] end, -- 1 <= cost <= N
  horizon = function(p) return p[2] end, -- the longest wait: one window
}
