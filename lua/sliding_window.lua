-- sliding_window.lua: sliding window counter, two counters per key (O(1) memory).
--
-- KEYS: counters (STRING "<window start us>:<window us>:<previous>:<current>:<hw>")
-- Params: p[1] = N (limit), p[2] = W (window, us), p[3] = U (weight step, us:
--         ceil(W / 2^20), so weights have 2^20 steps and N * 2^20 < 2^53)
-- Estimate at t: cur + prev * ceil(rem / U) / ceil(W / U), rem = time left in
-- the current window. A cost c fits when prev * ceil(rem/U) <= (N - cur - c) * ceil(W/U).
-- A limiter with another W moves each stored count into the newest of its own
-- windows (current, else previous) that overlaps the count's window: the
-- grants may lie anywhere in that window, and newer counts weigh more.
local function sw_load(k, p)
  local st = { key = k[1], hw = 0 }
  -- start, len, prev, cur, hw
  local f = parse(st.key, '^(%d+):(%d+):(%d+):(%d+):(%d+)$', 5)
  if f and f[2] > 0 then
    st.raw = { f[1], f[2], f[3], f[4] }
    st.hw = f[5]
  end
  return st
end

local function sw_prepare(st, p, now)
  local w = p[2]
  st.start, st.prev, st.cur = -1, 0, 0
  local raw = st.raw
  if not raw or raw[1] + 2 * raw[2] <= now then return end -- absent, or both windows over
  local s, len, prev, cur = raw[1], raw[2], raw[3], raw[4]
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

local function sw_save(st, p, now, real)
  if not st.dirty then return end
  redis.call('SET', st.key,
    fmt(st.start) .. ':' .. fmt(p[2]) .. ':' .. fmt(st.prev) .. ':' .. fmt(st.cur) .. ':' .. fmt(now),
    'PX', px(st.start + 2 * p[2], real))
end

local sliding_window = {
  nkeys = 1, load = sw_load, prepare = sw_prepare, earliest = sw_earliest,
  grant = sw_grant, status = sw_status, save = sw_save,
}
