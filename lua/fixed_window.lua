-- fixed_window.lua: N permits per window aligned to the epoch (floor(t/W)*W).
--
-- KEYS: counter (STRING "<window start us>:<count>"); a start in the future
--       holds reservations, and later grants queue behind it.
-- Params: p[1] = N (limit), p[2] = W (window, us)
-- The window start is stored with the count, so a changed W or a late expiry
-- never makes an old count look current.
local function fw_load(k, p, now)
  local st = { key = k[1], start = -1, count = 0 }
  local v = redis.call('GET', st.key)
  if v then
    local start, count = string.match(v, '^(%d+):(%d+)$')
    if start then
      st.start = tonumber(start)
      st.count = tonumber(count)
    end
  end
  return st
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

local function fw_save(st, p, now)
  if not st.dirty then return end
  redis.call('SET', st.key, fmt(st.start) .. ':' .. fmt(st.count),
    'PX', fmt(max(1, cdiv(st.start + p[2] - now, 1000))))
end

local fixed_window = {
  nkeys = 1, load = fw_load, earliest = fw_earliest,
  grant = fw_grant, status = fw_status, save = fw_save,
}
