-- fixed_window.lua: N permits per window aligned to the epoch (floor(t/W)*W).
--
-- KEYS: counter (STRING 'F' start len count hw): the count of the window of
--       `len` us beginning at `start` (us); a start ahead of `hw` holds
--       reservations, and later grants queue behind it.
-- Params: p[1] = N (limit), p[2] = W (window, us)
-- The window start and length are stored with the count, so a late expiry
-- never makes an old count look current, and a limiter with another W counts
-- the stored grants in its own window whenever the two windows overlap (the
-- grants may lie anywhere in the stored window: counting them is the safe side).
local function fw_load(keys, i, p)
  local st = { key = keys[i], hw = 0, raw = false, r_start = 0, r_len = 1, r_count = 0,
    start = -1, count = 0, dirty = false }
  local v = get_packed(st.key, 70, 4) -- 'F'
  if v then
    local start, len, count, hw = struct.unpack('<dddd', v, 2)
    if int(start) and int(len) and len > 0 and int(count) and int(hw) then
      st.raw, st.hw, st.r_start, st.r_len, st.r_count = true, hw, start, len, count
    end
  end
  return st
end

local function fw_prepare(st, p, now)
  local w = p[2]
  st.start, st.count = -1, 0
  -- absent, or its window is over
  if not st.raw or st.r_start + st.r_len <= now then return end
  local s, len, count = st.r_start, st.r_len, st.r_count
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

local fixed_window = {
  nkeys = 1, load = fw_load, prepare = fw_prepare, earliest = fw_earliest,
  grant = fw_grant, status = fw_status, save = fw_save,
  refund = fw_refund,
}
