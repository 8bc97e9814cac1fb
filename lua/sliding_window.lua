-- sliding_window.lua: sliding window counter, two counters per key (O(1) memory).
--
-- KEYS: counters (STRING 'S' start len prev cur hw): the counts of the window
--       of `len` us beginning at `start` (us) and of the one before it
-- Params: p[1] = N (limit), p[2] = W (window, us), p[3] = U (weight step, us:
--         ceil(W / 2^20), so weights have 2^20 steps and N * 2^20 < 2^53)
-- Estimate at t: cur + prev * ceil(rem / U) / ceil(W / U), rem = time left in
-- the current window. A cost c fits when prev * ceil(rem/U) <= (N - cur - c) * ceil(W/U).
-- A limiter with another W moves each stored count into the newest of its own
-- windows (current, else previous) that overlaps the count's window: the
-- grants may lie anywhere in that window, and newer counts weigh more.
local function sw_load(keys, i, p)
  local st = { key = keys[i], hw = 0, raw = false, r_start = 0, r_len = 1, r_prev = 0, r_cur = 0,
    start = -1, prev = 0, cur = 0, dirty = false }
  local v = get_packed(st.key, 83, 5) -- 'S'
  if v then
    local start, len, prev, cur, hw = struct.unpack('<ddddd', v, 2)
    if int(start) and int(len) and len > 0 and int(prev) and int(cur) and int(hw) then
      st.raw, st.hw = true, hw
      st.r_start, st.r_len, st.r_prev, st.r_cur = start, len, prev, cur
    end
  end
  return st
end

local function sw_prepare(st, p, now)
  local w = p[2]
  st.start, st.prev, st.cur = -1, 0, 0
  -- absent, or both windows over
  if not st.raw or st.r_start + 2 * st.r_len <= now then return end
  local s, len, prev, cur = st.r_start, st.r_len, st.r_prev, st.r_cur
  if len == w then
    st.start, st.prev, st.cur = s, prev, cur
    return
  end
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
  if st.prev + st.cur > 0 then st.start = r end
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

local sliding_window = {
  nkeys = 1, load = sw_load, prepare = sw_prepare, earliest = sw_earliest,
  grant = sw_grant, status = sw_status, save = sw_save,
  refund = sw_refund,
}
