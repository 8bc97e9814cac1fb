-- sliding_log.lua: exact sliding window ("at most N permits in ANY window of W").
--
-- KEYS: log  (ZSET: one member per grant, score = grant time in us,
--             member = "<time>:<seq>:<cost>", unique even for equal times)
--       meta (HASH: sum = total cost in the log, seq = member sequence)
-- Params: p[1] = N (limit), p[2] = W (window, us)
-- A grant at time t counts against every window (t' - W, t'] containing t.
-- Grants are queued first-in-first-out: a new grant is never placed before the
-- latest one, which keeps the invariant true for reservations in the future.
-- Rejected attempts write nothing (pruning expired members changes no decision).
local function slog_cost(member)
  return tonumber(string.match(member, ':(%d+)$'))
end

local function slog_load(k, p, now)
  local st = { log = k[1], meta = k[2], sum = 0, last = nil }
  local cutoff = now - p[2]
  local meta = redis.call('HMGET', st.meta, 'sum')
  local sum = tonumber(meta[1])
  if sum then
    local expired = redis.call('ZRANGEBYSCORE', st.log, '-inf', fmt(cutoff))
    for i = 1, #expired do
      sum = sum - slog_cost(expired[i])
    end
    if #expired > 0 then
      redis.call('ZREMRANGEBYSCORE', st.log, '-inf', fmt(cutoff))
      redis.call('HSET', st.meta, 'sum', fmt(sum)) -- keeps the key's TTL
    end
  else
    -- meta lost (evicted) or first use: rebuild the sum from the log itself
    redis.call('ZREMRANGEBYSCORE', st.log, '-inf', fmt(cutoff))
    sum = 0
    local all = redis.call('ZRANGE', st.log, 0, -1)
    for i = 1, #all do
      sum = sum + slog_cost(all[i])
    end
  end
  st.sum = sum
  local last = redis.call('ZRANGE', st.log, -1, -1, 'WITHSCORES')
  if #last > 0 then st.last = tonumber(last[2]) end
  return st
end

local function slog_earliest(st, p, now, cost)
  local n, w = p[1], p[2]
  if cost > n then return -1 end
  local base = now
  if st.last then base = max(now, st.last) end
  local excess = st.sum + cost - n
  if excess <= 0 then return base end
  -- Wait until enough of the oldest grants have left the window.
  local dropped, offset = 0, 0
  while true do
    local batch = redis.call('ZRANGE', st.log, offset, offset + 63, 'WITHSCORES')
    if #batch == 0 then break end
    for i = 1, #batch, 2 do
      dropped = dropped + slog_cost(batch[i])
      if dropped >= excess then
        return max(base, tonumber(batch[i + 1]) + w)
      end
    end
    offset = offset + 64
  end
  return max(base, st.last + w)
end

local function slog_grant(st, p, at, cost)
  local seq = redis.call('HINCRBY', st.meta, 'seq', 1)
  redis.call('ZADD', st.log, fmt(at), fmt(at) .. ':' .. fmt(seq) .. ':' .. fmt(cost))
  st.sum = st.sum + cost
  st.last = at
  st.dirty = true
end

local function slog_status(st, p, now, at)
  local n, w = p[1], p[2]
  if not st.last then return n, 0 end
  local reset = st.last + w - now
  if st.last > at then return 0, reset end
  local sum = st.sum
  if at > now then
    local gone = redis.call('ZRANGEBYSCORE', st.log, '-inf', fmt(at - w))
    for i = 1, #gone do
      sum = sum - slog_cost(gone[i])
    end
  end
  return max(0, n - sum), reset
end

local function slog_save(st, p, now)
  if not st.dirty then return end
  redis.call('HSET', st.meta, 'sum', fmt(st.sum))
  local ttl = st.last + p[2] - now
  expire_in(st.log, ttl)
  expire_in(st.meta, ttl)
end

local sliding_log = {
  nkeys = 2, load = slog_load, earliest = slog_earliest,
  grant = slog_grant, status = slog_status, save = slog_save,
}
