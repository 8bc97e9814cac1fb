-- sliding_log.lua: exact sliding window ("at most N permits in ANY window of W").
--
-- KEYS: log  (ZSET: one member per grant, score = grant time in us, member =
--             'E' time seq cost packed, unique even for equal times)
--       meta (STRING 'M' sum cnt seq written wmax wexp uni, then the log's last
--             member: a cache of the log. sum = total cost in the log, cnt =
--             its members, seq = member sequence, written = writer's clock,
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
  local st = { log = keys[i], meta = keys[i + 1], written = 0, clocked = false, seq = 0, n = 0,
    top = false, last = false, sum = false, uni = false, wmax = false, wexp = 0, keep = 0,
    win = 0, skip = 0, pruned = false, dirty = false }
  local n = redis.pcall('ZCARD', st.log)
  if type(n) ~= 'number' then
    redis.call('DEL', st.log)
    n = 0
  end
  -- the last entry; first, entries whose score is no grant time (an integer
  -- below 2^53 in magnitude: not inf, 1e300 or 0.5) are foreign and go,
  -- those beyond the range at once (the lower ones go with the expired)
  while n > 0 do
    local top = redis.call('ZRANGE', st.log, -1, -1, 'WITHSCORES')
    local last = tonumber(top[2])
    if last and int(last) then
      st.top, st.last = top[1], last
      break
    elseif last and last >= EXACT then
      redis.call('ZREMRANGEBYSCORE', st.log, '9007199254740992', '+inf')
    elseif last and last <= -EXACT then
      redis.call('ZREMRANGEBYSCORE', st.log, '-inf', '-9007199254740992')
    else
      redis.call('ZREM', st.log, top[1])
    end
    n = redis.call('ZCARD', st.log)
  end
  st.n = n
  local m = redis.pcall('GET', st.meta)
  if type(m) == 'string' and #m >= 57 and string.byte(m, 1) == 77 then -- 'M'
    local sum, cnt, seq, written, wmax, wexp, uni = struct.unpack('<ddddddd', m, 2)
    if int(sum) and int(cnt) and int(seq) and int(written) and int(wmax) and int(wexp) and int(uni) then
      st.written, st.clocked, st.seq = written, true, seq
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

-- Moves the log `d` back, to the decision's clock `now` (see "Clock steps"
-- in driver.lua): every score, and the time in each of this code's members
-- (slog_one reads it), so the entries keep their order and their costs.
local function slog_move(st, d, now)
  st.written = now
  if st.wmax then st.wexp = st.wexp - d end
  if st.n == 0 then return end
  local all = redis.call('ZRANGE', st.log, 0, -1, 'WITHSCORES')
  redis.call('DEL', st.log)
  local args, k = {}, 0
  for i = 1, #all, 2 do
    local member = all[i]
    if #member == 25 and string.byte(member, 1) == 69 then -- 'E'
      local at, seq, cost = struct.unpack('<ddd', member, 2)
      if int(at) then member = struct.pack('<c1ddd', 'E', at - d, seq, cost) end
    end
    args[k + 1], args[k + 2], k = tonumber(all[i + 1]) - d, member, k + 2
    if k == 512 or i + 1 == #all then
      redis.call('ZADD', st.log, unpack(args, 1, k))
      k = 0
    end
  end
  st.top, st.last = redis.call('ZRANGE', st.log, -1, -1)[1], st.last - d
end

local function slog_prepare(st, p, now)
  local w = p[2]
  -- dated after the decision's clock: moved back to it (see below)
  local moved = st.written > now
  if moved then slog_move(st, st.written - now, now) end
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
    -- meta lost, foreign or stale: the log itself is the truth, but for the
    -- entries whose score is a fraction (foreign, as in slog_load)
    redis.call('ZREMRANGEBYSCORE', st.log, '-inf', cutoff)
    local scored = redis.call('ZRANGE', st.log, 0, -1, 'WITHSCORES')
    local all, oldest = {}, now
    for i = 1, #scored, 2 do
      local t = tonumber(scored[i + 1])
      if t and int(t) then
        if #all == 0 then oldest = t end
        all[#all + 1] = scored[i]
      else
        redis.call('ZREM', st.log, scored[i])
      end
    end
    -- without meta the writer's clock is unknown: a log whose oldest entry
    -- lies beyond the limit's horizon is moved back so that entry is now
    -- (the writer's clock had passed it, unless it was a reservation)
    if not st.clocked and oldest - now > w then
      st.n = #all
      slog_move(st, oldest - now, now)
      moved = true
    end
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
  if moved then
    -- written back if it still holds something, else fresh
    st.dirty = st.n > 0
    if st.n == 0 then
      redis.call('DEL', st.meta)
      st.wmax, st.pruned = false, false
    end
  end
end

local function slog_earliest(st, p, now, cost)
  local n, w = p[1], p[2]
  if cost > n then return -1 end
  local base = now
  if st.last then base = max(now, st.last) end
  local excess = st.win + cost - n
  if excess <= 0 then return base end
  -- Wait until enough of the oldest grants have left the window. (Scores
  -- here are finite and in range, slog_load and the pruning saw to both
  -- ends; one changed in place to a fraction, which meta cannot tell,
  -- counts from the next microsecond.)
  local dropped, offset = 0, st.skip
  while true do
    local batch = redis.call('ZRANGE', st.log, offset, offset + 63, 'WITHSCORES')
    if #batch == 0 then break end
    for i = 1, #batch, 2 do
      dropped = dropped + slog_entry(batch[i])
      if dropped >= excess then
        return max(base, math.ceil(tonumber(batch[i + 1])) + w)
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

local function slog_meta(st, written, wmax, wexp)
  local uni = 0
  if st.uni then uni = 1 end
  return struct.pack('<c1ddddddd', 'M', st.sum, st.n, st.seq, written, wmax or 0, wexp or 0, uni)
    .. (st.top or '')
end

local function slog_save(st, p, now, from)
  if not st.dirty then
    -- a denial that pruned keeps meta in step with the log
    if st.pruned then
      redis.call('SET', st.meta, slog_meta(st, st.written, st.wmax, st.wexp), 'KEEPTTL')
    end
    return
  end
  local wmax, wexp = p[2], now + p[2]
  if st.keep > p[2] then wmax, wexp = st.wmax, st.wexp end
  local ms = px(st.last + st.keep, from)
  redis.call('SET', st.meta, slog_meta(st, now, wmax, wexp), 'PX', ms)
  redis.call('PEXPIRE', st.log, ms)
end

-- A log member's time and cost when it is this code's ('E', integer time,
-- seq and cost, cost at least 1: what slog_entry reads as such); nil for
-- another (slog_entry counts it as one grant, and its time is only its
-- score).
local function slog_member(e)
  if #e ~= 25 then return nil end
  local tag, at, seq, cost = sunpack('<c1ddd', e)
  if tag == 'E' and at % 1 == 0 and at < 9007199254740992 and at > -9007199254740992
      and seq % 1 == 0 and seq < 9007199254740992 and seq > -9007199254740992
      and cost % 1 == 0 and cost >= 1 and cost < 9007199254740992 then
    return at, cost
  end
  return nil
end

-- The decision of one limit (see `decide_one` in driver.lua) for a log of
-- at most SLOG_SMALL members whose meta is valid (or absent, the log
-- empty), every member this code's own, and no longer window keeping
-- entries: the steps above, with the whole log in one ZRANGE that also
-- checks meta's count and last member, and each member's time read from
-- the member (it is its score). Any other state takes decide_one, before
-- anything is written. `clock`, the TIME reply `store_now` was read from (nil
-- for a given clock), spells a grant's score without formatting a number.
local SLOG_SMALL = 8
-- ranks as arguments (a number argument is formatted), and the zeros that
-- pad 1 to 6 digits of microseconds to 6
local RANK = { [0] = '0', '1', '2', '3', '4', '5', '6', '7', '8' }
local PAD = { '00000', '0000', '000', '00', '0', '' }

local function slog_one(keys, s, store_now, max_wait, dry, from, clock)
  local n, w, cost = s[2], s[3], s[6]
  local log, meta = keys[1], keys[2]
  -- load: meta (valid, or absent for an empty log), then the whole log
  local sum, cnt, seq, written, wmax, wexp, uni = 0, 0, 0, 0, 0, 0, 1
  local m = rpcall('GET', meta)
  if m then
    if #m < 57 then return decide_one(keys, s, store_now, max_wait, dry, from) end
    local tag
    tag, sum, cnt, seq, written, wmax, wexp, uni = sunpack('<c1ddddddd', m)
    -- (int() of every field; 2^53 written out: a literal is an operand of the
    -- comparison, an upvalue must be loaded first)
    if not (tag == 'M' and cnt >= 0 and cnt <= SLOG_SMALL and cnt % 1 == 0
        and sum % 1 == 0 and sum < 9007199254740992 and sum > -9007199254740992
        and seq % 1 == 0 and seq < 9007199254740992 and seq > -9007199254740992
        and written % 1 == 0 and written < 9007199254740992 and written > -9007199254740992
        and wmax % 1 == 0 and wmax < 9007199254740992 and wmax > -9007199254740992
        and wexp % 1 == 0 and wexp < 9007199254740992 and wexp > -9007199254740992
        and uni % 1 == 0 and uni < 9007199254740992 and uni > -9007199254740992) then
      return decide_one(keys, s, store_now, max_wait, dry, from)
    end
    if wmax <= 0 then wmax, wexp = 0, 0 end
    if uni ~= 1 then uni = 0 end
  end
  local now = store_now
  if written > now then
    -- beyond the limit's horizon, the steps above move the log back
    if written - now > s.h then return decide_one(keys, s, store_now, max_wait, dry, from) end
    now = written
  end
  -- a longer window in use keeps entries outside this one
  if wmax > w and wexp > now then return decide_one(keys, s, store_now, max_wait, dry, from) end
  -- ranks 0 .. cnt: exactly cnt members when meta's count is the log's
  local r = rpcall('ZRANGE', log, '0', RANK[cnt])
  if r.err or #r ~= cnt or (cnt > 0 and r[cnt] ~= ssub(m, 58)) then
    return decide_one(keys, s, store_now, max_wait, dry, from)
  end
  -- prepare: the first k members left the window (all of them once the
  -- writer's newest grant left the writer's window); an empty log is empty
  -- whatever meta's sum says
  local top, last, k, gone = false, false, 0, 0
  if cnt == 0 then
    sum, uni = 0, 1
  else
    top = r[cnt]
    local top_cost
    last, top_cost = slog_member(top)
    if not last then return decide_one(keys, s, store_now, max_wait, dry, from) end
    local cutoff = now - w
    if wmax > 0 and last + wmax <= now then cutoff = last end
    while k < cnt do
      local at, c = last, top_cost
      if k + 1 < cnt then
        at, c = slog_member(r[k + 1])
        if not at then return decide_one(keys, s, store_now, max_wait, dry, from) end
      end
      if at > cutoff then break end
      k = k + 1
      if uni == 1 then gone = gone + 1 else gone = gone + c end
    end
  end
  local count = cnt - k
  sum = sum - gone
  if count == 0 then top, last, uni = false, false, 1 end
  local win = sum
  -- earliest
  local t = now
  if cost > 0 then
    if cost > n then
      t = -1
    else
      if last and last > now then t = last end
      local excess = win + cost - n
      if excess > 0 then
        -- wait until enough of the oldest grants have left the window
        local dropped, i, at, c = 0, k, last, 0
        while i < cnt and dropped < excess do
          i = i + 1
          at, c = slog_member(r[i])
          if not at then return decide_one(keys, s, store_now, max_wait, dry, from) end
          dropped = dropped + c
        end
        at = at + w -- (when too few: the last's time, which is the log's last)
        if at > t then t = at end
      end
    end
  end
  if k > 0 then rcall('ZREMRANGEBYRANK', log, '0', RANK[k - 1]) end
  local outcome, wait = verdict(t, now, max_wait)
  local as_of = now
  if outcome == 0 and not dry then as_of = t end
  if outcome == 0 and not dry and cost > 0 then
    -- grant, then save
    seq = seq + 1
    local member = spack('<c1ddd', 'E', t, seq, cost)
    local score = t
    if clock and t == store_now then score = clock[1] .. PAD[#clock[2]] .. clock[2] end
    rcall('ZADD', log, score, member)
    if not last or t > last or member > top then top = member end
    sum, win, count, last = sum + cost, win + cost, count + 1, t
    if cost ~= 1 then uni = 0 end
    local ms = px(t + w, from)
    rcall('SET', meta, spack('<c1dddddddc0', 'M', sum, count, seq, now, w, now + w, uni, top),
      'PX', ms)
    rcall('PEXPIRE', log, ms)
    k = 0
  end
  if k > 0 then
    -- a decision that pruned and granted nothing keeps meta in step
    rcall('SET', meta, spack('<c1dddddddc0', 'M', sum, count, seq, written, wmax, wexp, uni, top or ''),
      'KEEPTTL')
  end
  -- status
  local remaining, reset = n, 0
  if last then
    reset = last + w - now
    if last > as_of then
      remaining = 0
    else
      if as_of > now then
        local grants = rcall('ZRANGEBYSCORE', log, '(' .. string.format('%d', now - w), as_of - w)
        win = win - slog_sum(grants)
      end
      remaining = max(0, n - win)
    end
  end
  if t >= 0 then t = t - now end
  return spack('<dddddd', outcome, wait, now, t, remaining, reset)
end

local sliding_log = {
  load = slog_load, prepare = slog_prepare, earliest = slog_earliest,
  grant = slog_grant, status = slog_status, save = slog_save,
  refund = slog_refund, one = slog_one,
  horizon = function(p) return p[2] end, -- the longest wait: one window
}
