-- sliding_log_steps.lua: the sliding log's steps after `prepare`: when a
-- cost fits, a grant, the status, a refund, the save; then its table.
-- (Its state, helpers, `load` and `prepare`: sliding_log.lua.)

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
