-- fixed_window.lua: N permits per window aligned to the epoch (floor(t/W)*W).
--
-- KEYS: counter (STRING "<window start us>:<window us>:<count>:<hw>"); a start
--       ahead of `hw` holds reservations, and later grants queue behind it.
-- Params: p[1] = N (limit), p[2] = W (window, us)
-- The window start and length are stored with the count, so a late expiry
-- never makes an old count look current, and a limiter with another W counts
-- the stored grants in its own window whenever the two windows overlap (the
-- grants may lie anywhere in the stored window: counting them is the safe side).
local function fw_load(k, p)
  local st = { key = k[1], hw = 0 }
  local f = parse(st.key, '^(%d+):(%d+):(%d+):(%d+)$', 4) -- start, len, count, hw
  if f and f[2] > 0 then
    st.raw = { f[1], f[2], f[3] }
    st.hw = f[4]
  end
  return st
end

local function fw_prepare(st, p, now)
  local w = p[2]
  st.start, st.count = -1, 0
  local raw = st.raw
  if not raw or raw[1] + raw[2] <= now then return end -- absent, or its window is over
  local s, len, count = raw[1], raw[2], raw[3]
  if len == w then
    st.start, st.count = s, count
    return
  end
  -- the window of this limit that holds the stored one's grants, if any
  local r = now - fmod(now, w)
  if s > now then r = s - fmod(s, w) end
  if s < r + w and r < s + len then
    st.start, st.count = r, count
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

local function fw_status(st, p, now, at)
  local n, w = p[1], p[2]
  local start = at - fmod(at, w)
  if st.start > start then return 0, st.start + w - now end
  if st.start == start then return max(0, n - st.count), start + w - now end
  return n, 0
end

local function fw_save(st, p, now, real)
  if not st.dirty then return end
  redis.call('SET', st.key,
    fmt(st.start) .. ':' .. fmt(p[2]) .. ':' .. fmt(st.count) .. ':' .. fmt(now),
    'PX', px(st.start + p[2], real))
end

local fixed_window = {
  nkeys = 1, load = fw_load, prepare = fw_prepare, earliest = fw_earliest,
  grant = fw_grant, status = fw_status, save = fw_save,
}
