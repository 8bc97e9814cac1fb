-- sliding_log.lua: exact sliding window ("at most N permits in ANY window of W").
--
-- KEYS: log  (ZSET: one member per grant, score = grant time in us, member =
--             'E' time seq cost packed, unique even for equal times)
--       meta (STRING 'M' sum cnt seq hw wmax wexp uni, then the log's last
--             member: a cache of the log. sum = total cost in the log, cnt =
--             its members, seq = member sequence, hw = writer's clock,
--             wmax / wexp = the longest window in use and until when,
--             uni = 1 when every member costs 1)
-- Params: p[1] = N (limit), p[2] = W (window, us)
-- A grant at time t counts against every window (t' - W, t'] containing t.
-- Grants are queued first-in-first-out: a new grant is never placed before the
-- latest one, which keeps the invariant true for reservations in the future.
-- The log is the truth: when meta is missing, foreign, or disagrees with the
-- log's size or last member, it is rebuilt from the log (a foreign member
-- counts as one grant). A limiter with a shorter window keeps the entries a
-- longer one (written within its window) needs.
-- Rejected attempts write nothing but the pruning of expired entries.

local function slog_entry(member) -- (cost, seq)
  if #member == 25 and string.sub(member, 1, 1) == 'E' then
    local _, seq, cost = struct.unpack('<ddd', member, 2)
    if int(cost) and cost >= 1 and int(seq) then return cost, seq end
  end
  return 1, 0
end

local function slog_load(keys, i, p)
  local st = { log = keys[i], meta = keys[i + 1], hw = 0, seq = 0, n = 0, top = false, last = false,
    sum = false, uni = false, wmax = false, wexp = 0, keep = 0, win = 0, skip = 0,
    pruned = false, dirty = false }
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
  local m = redis.pcall('GET', st.meta)
  if type(m) == 'string' and #m >= 57 and string.byte(m, 1) == 77 then -- 'M'
    local sum, cnt, seq, hw, wmax, wexp, uni = struct.unpack('<ddddddd', m, 2)
    if int(sum) and int(cnt) and int(seq) and int(hw) and int(wmax) and int(wexp) and int(uni) then
      st.hw, st.seq = hw, seq
      if wmax > 0 then st.wmax, st.wexp = wmax, wexp end
      if cnt == n and (n == 0 or string.sub(m, 58) == st.top) then
        st.sum, st.uni = sum, uni == 1
      end
    end
  elseif m ~= false and type(m) ~= 'string' then
    redis.call('DEL', st.meta) -- another type
  end
  return st
end

local function slog_sum(members) -- total cost of members, their highest seq, all cost 1
  local sum, seq, uni = 0, 0, true
  for i = 1, #members do
    local c, s = slog_entry(members[i])
    sum = sum + c
    seq = max(seq, s)
    uni = uni and c == 1
  end
  return sum, seq, uni
end

local function slog_prepare(st, p, now)
  local w = p[2]
  local keep = w
  if st.wmax and st.wmax > w and st.wexp > now then keep = st.wmax end
  st.keep = keep
  -- the writer's state is over once its newest grant left its window
  local cutoff = now - keep
  if st.wmax and st.last and st.last + st.wmax <= now then cutoff = '+inf' end
  if st.n == 0 then
    st.sum, st.uni = 0, true
  elseif st.sum and st.uni then
    local gone = redis.call('ZREMRANGEBYSCORE', st.log, '-inf', cutoff)
    st.sum, st.n = st.sum - gone, st.n - gone
    st.pruned = gone > 0
  elseif st.sum then
    local expired = redis.call('ZRANGEBYSCORE', st.log, '-inf', cutoff)
    if #expired > 0 then
      st.sum = st.sum - slog_sum(expired)
      st.n = st.n - #expired
      redis.call('ZREMRANGEBYSCORE', st.log, '-inf', cutoff)
      st.pruned = true
    end
  else
    -- meta lost, foreign or stale: the log itself is the truth
    redis.call('ZREMRANGEBYSCORE', st.log, '-inf', cutoff)
    local all = redis.call('ZRANGE', st.log, 0, -1)
    local sum, seq, uni = slog_sum(all)
    st.sum, st.n, st.seq, st.uni = sum, #all, max(st.seq, seq), uni
  end
  if st.n == 0 then st.top, st.last, st.uni = false, false, true end
  -- entries kept only for a longer window are outside this limit's window
  st.win, st.skip = st.sum, 0
  if keep > w and st.n > 0 then
    local old = redis.call('ZRANGEBYSCORE', st.log, '-inf', now - w)
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
  local member = struct.pack('<c1ddd', 'E', at, st.seq, cost)
  redis.call('ZADD', st.log, at, member)
  -- the log's last member: the highest score, then the greatest bytes
  if not st.last or at > st.last or member > st.top then st.top = member end
  st.sum = st.sum + cost
  st.win = st.win + cost
  st.n = st.n + 1
  st.uni = st.uni and cost == 1
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
    local gone = redis.call('ZRANGEBYSCORE', st.log, '(' .. string.format('%d', now - w), at - w)
    sum = sum - slog_sum(gone)
  end
  return max(0, n - sum), reset
end

-- Gives back one grant of `cost` made at `at`: one member with that score
-- and cost leaves the log (such members are interchangeable). A log left
-- empty is deleted, as a fresh state.
local function slog_refund(st, p, now, at, cost)
  if not st.last then return end
  local found = redis.call('ZRANGEBYSCORE', st.log, at, at)
  for i = #found, 1, -1 do
    local member = found[i]
    if slog_entry(member) == cost then
      redis.call('ZREM', st.log, member)
      st.n = st.n - 1
      st.sum = st.sum - cost
      if st.n == 0 then
        redis.call('DEL', st.log, st.meta)
        st.top, st.last, st.pruned = false, false, false
        return
      end
      if member == st.top then
        local top = redis.call('ZRANGE', st.log, -1, -1, 'WITHSCORES')
        st.top, st.last = top[1], tonumber(top[2])
      end
      st.dirty = true
      return
    end
  end
end

local function slog_meta(st, hw, wmax, wexp)
  local uni = 0
  if st.uni then uni = 1 end
  return struct.pack('<c1ddddddd', 'M', st.sum, st.n, st.seq, hw, wmax or 0, wexp or 0, uni)
    .. (st.top or '')
end

local function slog_save(st, p, now, from)
  if not st.dirty then
    -- a denial that pruned keeps meta in step with the log
    if st.pruned then
      redis.call('SET', st.meta, slog_meta(st, st.hw, st.wmax, st.wexp), 'KEEPTTL')
    end
    return
  end
  local wmax, wexp = p[2], now + p[2]
  if st.keep > p[2] then wmax, wexp = st.wmax, st.wexp end
  local until_at = st.last + st.keep
  redis.call('SET', st.meta, slog_meta(st, now, wmax, wexp), 'PX', px(until_at, from))
  redis.call('PEXPIRE', st.log, px(until_at, from))
end

local sliding_log = {
  nkeys = 2, load = slog_load, prepare = slog_prepare, earliest = slog_earliest,
  grant = slog_grant, status = slog_status, save = slog_save,
  refund = slog_refund,
}
