-- sliding_log.lua: exact sliding window ("at most N permits in ANY window of W").
--
-- KEYS: log  (ZSET: one member per grant, score = grant time in us, member =
--             'E' time seq cost packed, unique even for equal times)
--       meta (STRING 'M' sum cnt seq written wmax wexp uni, then the log's last
--             member: a cache of the log. sum = total cost in the log, cnt =
--             its members, seq = member sequence, written = writer's clock,
--             wmax / wexp = the longest window in use and until when,
--             uni = 1 when every member costs 1)
-- Params: n = N (limit), w = W (window, us)
-- A grant at time t counts against every window (t' - W, t'] containing t.
-- Grants are queued first-in-first-out: a new grant is never placed before the
-- latest one, which keeps the invariant true for reservations in the future.
-- The log is the truth: when meta is missing, foreign, or disagrees with the
-- log's size or last member, it is rebuilt from the log (a foreign member
-- counts as one grant). A limiter with a shorter window keeps the entries a
-- longer one (written within its window) needs.
-- Rejected attempts write nothing but the pruning of expired entries.
--
-- The steps, on locals (see build.rs): the log's `cnt` members, `top` the
-- last of them (the highest score, then the greatest bytes) and `last` its
-- time (false: an empty log), `sum` their total cost (false while unknown:
-- meta missing, foreign or stale), `uni` 1 when each costs 1, `seq` the
-- member sequence; `written`, `wmax` (false: none) and `wexp` as meta says
-- (`clocked`: it was read); `keep` how far back entries are kept, `win` the
-- cost inside this limit's window and `skip` the entries before it (kept
-- for a longer window).
-- A log of at most SLOG_SMALL members that meta describes (its count and
-- last member), or an empty one, is read whole by load: `members`, oldest
-- first, each of this code's members' time read from the member (it is its
-- score), the first `left` of them gone from the window once prepared;
-- `members` is false for any other log, and from a step that cannot use it
-- on (a log moved or kept for a longer window, a foreign member met, a
-- grant), and the steps read the log through Redis.
--: state slog: log meta written clocked seq cnt top last sum uni wmax wexp keep win skip members left pruned dirty fresh
--: params slog: n w

local function slog_entry(member) -- (cost, seq)
  if #member == 25 and ssub(member, 1, 1) == 'E' then
    local _, seq, cost = sunpack('<ddd', member, 2)
    if int(cost) and cost >= 1 and int(seq) then return cost, seq end
  end
  return 1, 0
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

local function slog_sum(members) -- total cost of members, their highest seq, 1 if all cost 1
  local sum, seq, uni = 0, 0, 1
  for i = 1, #members do
    local c, s = slog_entry(members[i])
    sum = sum + c
    seq = max(seq, s)
    if c ~= 1 then uni = 0 end
  end
  return sum, seq, uni
end

-- The size of the log at `log`, its last entry and that one's score. First,
-- entries whose score is no grant time (an integer below 2^53 in magnitude:
-- not inf, 1e300 or 0.5) are foreign and go, those beyond the range at once
-- (the lower ones go with the expired); a key of another type goes.
local function slog_tail(log)
  local n = rpcall('ZCARD', log)
  if type(n) ~= 'number' then
    rcall('DEL', log)
    n = 0
  end
  while n > 0 do
    local top = rcall('ZRANGE', log, -1, -1, 'WITHSCORES')
    local last = tonumber(top[2])
    if last and int(last) then return n, top[1], last end
    if last and last >= EXACT then
      rcall('ZREMRANGEBYSCORE', log, '9007199254740992', '+inf')
    elseif last and last <= -EXACT then
      rcall('ZREMRANGEBYSCORE', log, '-inf', '-9007199254740992')
    else
      rcall('ZREM', log, top[1])
    end
    n = rcall('ZCARD', log)
  end
  return 0, false, false
end

-- Moves the log at `log` `d` back (see "Clock steps" in driver.lua): every
-- score, and the time in each of this code's members (the steps read a
-- small log's times from its members), so the entries keep their order and
-- their costs. Returns its last member.
local function slog_move(log, d)
  local all = rcall('ZRANGE', log, 0, -1, 'WITHSCORES')
  rcall('DEL', log)
  local args, k = {}, 0
  for i = 1, #all, 2 do
    local member = all[i]
    if #member == 25 and string.byte(member, 1) == 69 then -- 'E'
      local at, seq, cost = sunpack('<ddd', member, 2)
      if int(at) then member = spack('<c1ddd', 'E', at - d, seq, cost) end
    end
    args[k + 1], args[k + 2], k = tonumber(all[i + 1]) - d, member, k + 2
    if k == 512 or i + 1 == #all then
      rcall('ZADD', log, unpack(args, 1, k))
      k = 0
    end
  end
  return rcall('ZRANGE', log, -1, -1)[1]
end

-- The longest log load reads whole (see above), and ranks as arguments (a
-- number argument is formatted).
local SLOG_SMALL = 8
local RANK = { [0] = '0', '1', '2', '3', '4', '5', '6', '7', '8' }
-- string.format, for a grant's score as text: Lua formats an integer for
-- less than Redis a number argument (see `px` in common.lua). (Bound by the
-- first grant: there is no `string` while Redis 7 loads the library.)
local sformat

-- (`v` is nil: a log is always read here, see `put_absent`)
--: step slog load(keys, i, v)
  -- (one assignment a statement: a multiple one moves each value twice)
  log = keys[i]; meta = keys[i + 1]; written = 0; clocked = false; seq = 0
  cnt = 0; top = false; last = false; sum = false; uni = 0; wmax = false; wexp = 0
  members = false; pruned = false; dirty = false
  -- meta's count `mcnt` (-1: none to trust; a missing meta is an empty log's),
  -- sum and uni
  local m, mcnt, msum, muni = rpcall('GET', meta), 0, 0, 1
  if m then
    mcnt = -1
    if #m >= 57 then -- (a string: an error reply is a table, #m == 0)
      local tag, a, c, q, wr, wm, we, u = sunpack('<c1ddddddd', m)
      -- (int() of every field; 2^53 written out: a literal is an operand of
      -- the comparison, an upvalue must be loaded first)
      if tag == 'M' and a % 1 == 0 and a < 9007199254740992 and a > -9007199254740992
          and c % 1 == 0 and c < 9007199254740992 and c > -9007199254740992
          and q % 1 == 0 and q < 9007199254740992 and q > -9007199254740992
          and wr % 1 == 0 and wr < 9007199254740992 and wr > -9007199254740992
          and wm % 1 == 0 and wm < 9007199254740992 and wm > -9007199254740992
          and we % 1 == 0 and we < 9007199254740992 and we > -9007199254740992
          and u % 1 == 0 and u < 9007199254740992 and u > -9007199254740992 then
        written, clocked, seq, mcnt, msum, muni = wr, true, q, c, a, u
        if u ~= 1 then muni = 0 end
        if wm > 0 then wmax, wexp = wm, we end
      end
    elseif type(m) ~= 'string' then
      rcall('DEL', meta) -- another type
    end
  end
  if mcnt >= 0 and mcnt <= SLOG_SMALL then
    -- ranks 0 .. mcnt: exactly mcnt members when meta's count is the log's
    local r = rpcall('ZRANGE', log, '0', RANK[mcnt])
    if not r.err and #r == mcnt then
      if mcnt == 0 then
        members = r
      elseif r[mcnt] == ssub(m, 58) then
        last = slog_member(r[mcnt])
        if last then members, cnt, top, sum, uni = r, mcnt, r[mcnt], msum, muni end
      end
    end
  end
  if not members then
    cnt, top, last = slog_tail(log)
    if clocked and mcnt == cnt and (cnt == 0 or ssub(m, 58) == top) then
      sum, uni = msum, muni
    end
  end
--: end

--: step slog prepare(now)
  -- dated after the decision's clock: moved back to it (see below)
  local moved = written > now
  if moved then
    local d = written - now
    written, members = now, false
    if wmax then wexp = wexp - d end
    if cnt > 0 then top, last = slog_move(log, d), last - d end
  end
  keep = w
  if wmax and wmax > w and wexp > now then keep = wmax end
  -- the writer's state is over once its newest grant left its window (no
  -- score lies above `last`'s)
  local cutoff = now - keep
  if wmax and last and last + wmax <= now then cutoff = last end
  if keep > w then members = false end
  -- the log in hand: its first `left` members lie at or before the cutoff
  -- (the last's time is `last`), of total cost `gone`
  local gone = 0
  left = 0
  if members then
    while left < cnt do
      local at, c = last, nil
      if left + 1 < cnt then
        at, c = slog_member(members[left + 1])
        if not at then members, left, gone = false, 0, 0 break end
      end
      if at > cutoff then break end
      left = left + 1
      if uni == 1 then gone = gone + 1 else gone = gone + (c or slog_entry(top)) end
    end
  end
  if cnt == 0 then
    sum = 0; uni = 1
  elseif members then
    if left > 0 then
      rcall('ZREMRANGEBYRANK', log, '0', RANK[left - 1])
      sum, cnt, pruned = sum - gone, cnt - left, true
    end
  elseif sum and uni == 1 then
    gone = rcall('ZREMRANGEBYSCORE', log, '-inf', cutoff)
    sum, cnt = sum - gone, cnt - gone
    pruned = gone > 0
  elseif sum then
    local expired = rcall('ZRANGEBYSCORE', log, '-inf', cutoff)
    if #expired > 0 then
      sum = sum - slog_sum(expired)
      cnt = cnt - #expired
      rcall('ZREMRANGEBYSCORE', log, '-inf', cutoff)
      pruned = true
    end
  else
    -- meta lost, foreign or stale: the log itself is the truth, but for the
    -- entries whose score is a fraction (foreign, as in load)
    rcall('ZREMRANGEBYSCORE', log, '-inf', cutoff)
    local scored = rcall('ZRANGE', log, 0, -1, 'WITHSCORES')
    local all, oldest = {}, now
    for i = 1, #scored, 2 do
      local t = tonumber(scored[i + 1])
      if t and int(t) then
        if #all == 0 then oldest = t end
        all[#all + 1] = scored[i]
      else
        rcall('ZREM', log, scored[i])
      end
    end
    -- without meta the writer's clock is unknown: a log whose oldest entry
    -- lies beyond the limit's horizon is moved back so that entry is now
    -- (the writer's clock had passed it, unless it was a reservation)
    if not clocked and oldest - now > w then
      written, moved = now, true
      top, last = slog_move(log, oldest - now), last - (oldest - now)
    end
    local s_sum, s_seq, s_uni = slog_sum(all)
    sum, cnt, seq, uni = s_sum, #all, max(seq, s_seq), s_uni
  end
  if cnt == 0 then top = false; last = false; uni = 1 end
  -- entries kept only for a longer window are outside this limit's window
  win = sum; skip = 0
  if keep > w and cnt > 0 then
    local old = rcall('ZRANGEBYSCORE', log, '-inf', now - w)
    win = sum - slog_sum(old)
    skip = #old
  end
  if moved then
    -- written back if it still holds something, else fresh
    dirty = cnt > 0
    if cnt == 0 then
      rcall('DEL', meta)
      wmax, pruned = false, false
    end
  end
  -- an empty log: any cost up to N fits now
  fresh = cnt == 0
--: end

-- The earliest time the cost (1 <= cost) fits: once enough of the oldest
-- grants have left the window, never before the last grant (first in,
-- first out); never (-1) for a cost over N.
--: step slog earliest(now, cost) -> t
  if cost > n then
    t = -1
  else
    t = now
    if last and last > now then t = last end
    local excess = win + cost - n
    if excess > 0 then
      -- the time of the grant whose leaving makes room (the last's when
      -- too few would): from the log in hand while its members are this
      -- code's, else from the scores
      local at
      if members then
        local dropped, i, c = 0, left, 0
        at = last
        while i < left + cnt and dropped < excess do
          i = i + 1
          at, c = slog_member(members[i])
          if not at then break end
          dropped = dropped + c
        end
      end
      if not at then
        -- (Scores here are finite and in range, load and the pruning saw to
        -- both ends; one changed in place to a fraction, which meta cannot
        -- tell, counts from the next microsecond.)
        local dropped, offset, batch = 0, skip, nil
        repeat
          batch = rcall('ZRANGE', log, offset, offset + 63, 'WITHSCORES')
          for i = 1, #batch, 2 do
            dropped = dropped + slog_entry(batch[i])
            if dropped >= excess then
              at = math.ceil(tonumber(batch[i + 1]))
              break
            end
          end
          offset = offset + 64
        until at or #batch < 128
        if not at then at = last end
      end
      if at and at + w > t then t = at + w end
    end
  end
--: end

--: step slog grant(at, cost)
  seq = seq + 1
  local member = spack('<c1ddd', 'E', at, seq, cost)
  if not sformat then sformat = string.format end
  rcall('ZADD', log, sformat('%d', at), member)
  -- the log's last member: the highest score, then the greatest bytes (a
  -- renewal, op 5 in driver.lua, may grant before a reservation)
  if not last or at > last or (at == last and member > top) then top = member; last = at end
  sum = sum + cost; win = win + cost; cnt = cnt + 1
  if cost ~= 1 then uni = 0 end
  members = false; dirty = true
--: end

-- Permits left as of `at` and microseconds until the last grant leaves the
-- window.
--: step slog status(now, at) -> remaining, reset
  remaining = n; reset = 0
  if last then
    reset = last + w - now
    if last > at then
      remaining = 0
    else
      local used = win
      if at > now then
        local gone = rcall('ZRANGEBYSCORE', log, '(' .. string.format('%d', now - w), at - w)
        used = used - slog_sum(gone)
      end
      remaining = max(0, n - used)
    end
  end
--: end

-- Gives back one grant of `cost` made at `at`: one member with that score
-- and cost leaves the log (such members are interchangeable), `gone` when
-- one did. Without one, a larger grant made at `at` keeps the rest of its
-- cost (a hot key's batch giving back what it did not grant): same score
-- and sequence, so the same place. A log left empty is deleted, as a fresh
-- state.
--: step slog refund(now, at, cost) -> gone
  gone = false
  if last then
    local found = rcall('ZRANGEBYSCORE', log, at, at)
    local whole, part
    for i = #found, 1, -1 do
      local c = slog_entry(found[i])
      if c == cost then whole = found[i] break end
      if c > cost and not part then part = found[i] end
    end
    if whole then
      rcall('ZREM', log, whole)
      cnt, sum, members, gone = cnt - 1, sum - cost, false, true
      if cnt == 0 then
        rcall('DEL', log, meta)
        top, last, pruned, dirty = false, false, false, false
      else
        if whole == top then
          local tail = rcall('ZRANGE', log, -1, -1, 'WITHSCORES')
          top, last = tail[1], tonumber(tail[2])
        end
        dirty = true
      end
    elseif part then
      local c, q = slog_entry(part)
      local kept = spack('<c1ddd', 'E', at, q, c - cost)
      rcall('ZREM', log, part)
      rcall('ZADD', log, at, kept)
      if part == top then top = kept end
      sum, members, gone, dirty = sum - cost, false, true, true
    end
  end
--: end

-- (`nx` is never set for a log: it is not one STRING, see `put_absent`;
-- `was` stays nil)
--: step slog save(now, from, nx) -> was
  if dirty then
    local mw, me = w, now + w
    if keep > w then mw, me = wmax or 0, wexp end -- (a moved log left empty has none)
    local ms = px(last + keep, from)
    -- (dirty: the log holds something, `top` is its last member)
    rcall('SET', meta, spack('<c1dddddddc0', 'M', sum, cnt, seq, now, mw, me, uni, top), 'PX', ms)
    rcall('PEXPIRE', log, ms)
  elseif pruned then
    -- a denial that pruned keeps meta in step with the log
    rcall('SET', meta, spack('<c1dddddddc0', 'M', sum, cnt, seq, written, wmax or 0, wexp, uni,
      top or ''), 'KEEPTTL')
  end
--: end

--: one slog sliding_log
sliding_log.horizon = function(s) return s[3] end -- the longest wait: one window
