-- sliding_log.lua: exact sliding window ("at most N permits in ANY window of W").
--
-- KEYS: log  (ZSET: one member per grant, score = grant time in us,
--             member = "<time>:<seq>:<cost>", unique even for equal times)
--       meta (HASH, a cache of the log: sum = total cost in the log,
--             cnt = its members, top = its last member, seq = member
--             sequence, hw = writer's clock, wmax / wexp = the longest
--             window in use and until when)
-- Params: p[1] = N (limit), p[2] = W (window, us)
-- A grant at time t counts against every window (t' - W, t'] containing t.
-- Grants are queued first-in-first-out: a new grant is never placed before the
-- latest one, which keeps the invariant true for reservations in the future.
-- The log is the truth: when meta is missing, of another type or disagrees
-- with the log's size or last member, it is rebuilt from the log. A limiter with a shorter
-- window keeps the entries a longer one (written within its window) needs.
-- Rejected attempts write nothing but the pruning of expired entries.
local function slog_entry(member) -- (cost, seq); a foreign member counts as one grant
  local seq, cost = string.match(member, '^%d+:(%d+):(%d+)$')
  seq, cost = num(seq), num(cost)
  if not cost or cost < 1 then return 1, 0 end
  return cost, seq
end

local function slog_load(k, p)
  local st = { log = k[1], meta = k[2], hw = 0 }
  local n = redis.pcall('ZCARD', st.log)
  if type(n) ~= 'number' then
    redis.call('DEL', st.log)
    n = 0
  end
  st.n = n
  if n > 0 then
    local top = redis.call('ZRANGE', st.log, -1, -1, 'WITHSCORES')
    st.top, st.last = top[1], tonumber(top[2])
  end
  local m = redis.pcall('HMGET', st.meta, 'sum', 'cnt', 'seq', 'hw', 'wmax', 'wexp', 'top')
  if m.err then
    redis.call('DEL', st.meta)
    m = {}
  end
  local sum, cnt, seq = num(m[1]), num(m[2]), num(m[3])
  local hw, wmax, wexp = num(m[4]), num(m[5]), num(m[6])
  st.hw = hw or 0
  st.seq = seq or 0
  if wmax and wexp then st.wmax, st.wexp = wmax, wexp end
  if sum and seq and cnt == n and (n == 0 or m[7] == st.top) then
    st.sum = sum
  end -- else rebuilt by prepare
  return st
end

local function slog_sum(members) -- total cost of members, and their highest seq
  local sum, seq = 0, 0
  for i = 1, #members do
    local c, s = slog_entry(members[i])
    sum = sum + c
    seq = max(seq, s)
  end
  return sum, seq
end

local function slog_prepare(st, p, now)
  local w = p[2]
  local keep = w
  if st.wmax and st.wmax > w and st.wexp > now then keep = st.wmax end
  st.keep = keep
  local cutoff = fmt(now - keep)
  -- the writer's state is over once its newest grant left its window
  if st.wmax and st.last and st.last + st.wmax <= now then cutoff = '+inf' end
  if st.sum then
    local expired = redis.call('ZRANGEBYSCORE', st.log, '-inf', cutoff)
    if #expired > 0 then
      local gone = slog_sum(expired)
      st.sum = st.sum - gone
      st.n = st.n - #expired
      redis.call('ZREMRANGEBYSCORE', st.log, '-inf', cutoff)
      redis.call('HSET', st.meta, 'sum', fmt(st.sum), 'cnt', fmt(st.n)) -- keeps the TTL
    end
  else
    -- meta lost, foreign or stale: the log itself is the truth
    redis.call('ZREMRANGEBYSCORE', st.log, '-inf', cutoff)
    local all = redis.call('ZRANGE', st.log, 0, -1)
    local sum, seq = slog_sum(all)
    st.sum, st.n, st.seq = sum, #all, max(st.seq, seq)
  end
  -- entries kept only for a longer window are outside this limit's window
  if st.n == 0 then st.top, st.last = nil, nil end
  st.win, st.skip = st.sum, 0
  if keep > w then
    local old = redis.call('ZRANGEBYSCORE', st.log, '-inf', fmt(now - w))
    st.win = st.sum - slog_sum(old)
    st.skip = #old
  end
end

local function slog_earliest(st, p, now, cost)
  local n, w = p[1], p[2]
  if cost > n then return -1 end
  local base = now
  if st.last then base = max(now, st.last) end
  local excess = st.win + cost - n
  if excess <= 0 then return base end
  -- Wait until enough of the oldest grants have left the window.
  local dropped, offset = 0, st.skip
  while true do
    local batch = redis.call('ZRANGE', st.log, offset, offset + 63, 'WITHSCORES')
    if #batch == 0 then break end
    for i = 1, #batch, 2 do
      dropped = dropped + slog_entry(batch[i])
      if dropped >= excess then
        return max(base, tonumber(batch[i + 1]) + w)
      end
    end
    offset = offset + 64
  end
  return max(base, st.last + w)
end

local function slog_grant(st, p, at, cost)
  st.seq = st.seq + 1
  local member = fmt(at) .. ':' .. fmt(st.seq) .. ':' .. fmt(cost)
  redis.call('ZADD', st.log, fmt(at), member)
  -- the log's last member: the highest score, then the greatest bytes
  if not st.last or at > st.last or member > st.top then st.top = member end
  st.sum = st.sum + cost
  st.win = st.win + cost
  st.n = st.n + 1
  st.last = at
  st.dirty = true
end

local function slog_status(st, p, now, at)
  local n, w = p[1], p[2]
  if not st.last then return n, 0 end
  local reset = st.last + w - now
  if st.last > at then return 0, reset end
  local sum = st.win
  if at > now then
    local gone = redis.call('ZRANGEBYSCORE', st.log, '(' .. fmt(now - w), fmt(at - w))
    sum = sum - slog_sum(gone)
  end
  return max(0, n - sum), reset
end

local function slog_save(st, p, now, real)
  if not st.dirty then return end
  local wmax, wexp = p[2], now + p[2]
  if st.keep > p[2] then wmax, wexp = st.wmax, st.wexp end
  redis.call('HSET', st.meta, 'sum', fmt(st.sum), 'cnt', fmt(st.n), 'seq', fmt(st.seq),
    'hw', fmt(now), 'wmax', fmt(wmax), 'wexp', fmt(wexp), 'top', st.top)
  local until_at = st.last + st.keep
  expire_at(st.log, until_at, real)
  expire_at(st.meta, until_at, real)
end

local sliding_log = {
  nkeys = 2, load = slog_load, prepare = slog_prepare, earliest = slog_earliest,
  grant = slog_grant, status = slog_status, save = slog_save,
}
