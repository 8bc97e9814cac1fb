-- penalty.lua: penalties (`Limit::penalty`): a key's penalty state, the
-- refusals counted, op 6, and the decision of one penalized limit.
--
-- Penalties (`Limit::penalty`; src/penalty.rs has the same arithmetic):
-- a penalized limit's key holds, in store time (us), when its block ends,
-- its offences, the refusals counted towards the next offence and the
-- time of the first of them (`pen_load`). While blocked (the store's clock
-- before its end) the limit refuses: one limit at once, with wait the
-- time left of the block, without its state being read; among several,
-- its time is the block's end (the others decide as usual, nothing is
-- granted). A decision refused (not a peek, not a take) counts a refusal
-- in each penalized limit that refused by itself (wait_i > max_wait), when
-- none is blocked; the N-th within `within` of the first makes an
-- offence: the key is blocked from now for the offence's block (the n-th
-- offence's, the last for every one beyond) and the count starts again.
-- Offences are forgotten `forget` after the end of the last block. A
-- state dated after the store's clock is moved back to it whole when read
-- and written so (see `pen_load`): a block written by a clock a year ahead
-- ends at most its own length (the penalty's longest block, or a block by
-- hand's) from now, not a year away. A blocked limit's status is
-- LIMIT_BLOCKED (see driver.lua, "Reply"); a decision refused by a block
-- waits the longest of its limits' waits, the blocked ones' being their
-- times left. The key expires when its state equals a fresh one.
--
-- Penalty (OP_PENALTY): KEYS a penalty key, ARGV the options, with
-- opts[OPT_AT] PEN_READ, PEN_BLOCK for opts[OPT_BLOCK] us (no offence; the
-- refusals counted go) or PEN_UNBLOCK (delete), then the limit's string. Reply: until,
-- offences, refusals, since (after a block, before a forget) and the
-- store's clock, little-endian doubles.
--
-- A key's penalty state (see "Penalties"): [1] when its block ends, [2]
-- its offences, [3] the refusals counted, [4] the time of the first (while
-- none is counted, when the last block began); kept as 'P' and four
-- doubles. Anything else (missing, another type, length or tag, a field
-- not an integer in [0, 2^53)) reads as a fresh state. A state dated after
-- the store's clock `now` ([4] later: its writer's clock was ahead) is
-- moved back to it whole, [1] and [4] by the same amount, so a block ends
-- at most its own length from now; then the second value is true (the
-- caller writes it back, so that it ages from then on).
local function pen_load(key, now)
  local v = rpcall('GET', key)
  if type(v) == 'string' and #v == 33 then
    local tag, u, o, c, f = sunpack('<c1dddd', v)
    if tag == 'P' and int(u) and u >= 0 and int(o) and o >= 0 and int(c) and c >= 0
      and int(f) and f >= 0 then
      if f > now then return { max(u - (f - now), 0), o, c, now }, true end
      return { u, o, c, f }, false
    end
  end
  return { 0, 0, 0, 0 }, false
end

-- Counts a refusal in the state `ps` of a penalty `pen` ([1] refusals,
-- [2] within, [3] forget, [4..] the blocks) at store time `now`; whether
-- it made an offence (the key is then blocked until ps[1]).
local function pen_refuse(ps, pen, now)
  if ps[2] > 0 and ps[1] + pen[3] <= now then ps[2] = 0 end
  if ps[3] == 0 or now - ps[4] >= pen[2] then
    ps[3], ps[4] = 1, now
  else
    ps[3] = ps[3] + 1
  end
  if ps[3] < pen[1] then return false end
  ps[2] = ps[2] + 1
  ps[1] = now + pen[3 + min(ps[2], #pen - 3)]
  ps[3], ps[4] = 0, now
  return true
end

-- Writes `ps` to `key`, to expire when it equals a fresh state (deleted
-- if it does by `now`); expiries count from `from`.
local function pen_save(key, ps, pen, now, from)
  local exp = ps[1]
  if ps[2] > 0 then exp = max(exp, ps[1] + pen[3]) end
  if ps[3] > 0 then exp = max(exp, ps[4] + pen[2]) end
  if exp <= now then
    rcall('DEL', key)
    return
  end
  rcall('SET', key, spack('<c1dddd', 'P', ps[1], ps[2], ps[3], ps[4]), 'PX', px(exp, from))
end

-- Op 6: reads, sets (a block) or deletes a penalty state.
local function penalty(keys, args, opts)
  if not rcall then bind() end
  local store_now = clock(opts)
  local key, what = keys[1], opts[OPT_AT]
  local ps, moved = pen_load(key, store_now)
  if what == PEN_UNBLOCK then
    rcall('DEL', key)
  else
    local s = spec(args[2])
    if not (s and s.pen) then return redis.error_reply('not a limit with a penalty') end
    if what == PEN_BLOCK then
      ps[1], ps[3], ps[4], moved = store_now + opts[OPT_BLOCK], 0, store_now, true
    end
    if moved then pen_save(key, ps, s.pen, store_now, store_now - opts[OPT_SLACK]) end
  end
  return spack('<ddddd', ps[1], ps[2], ps[3], ps[4], store_now)
end

-- Counts a refusal in each penalized limit of `limits` that refused by
-- itself (see "Penalties") at store time `store_now`; one that made an
-- offence is blocked in `reply` (its status: its own quota's wait no longer
-- counts; the decision's wait is the longest of the statuses').
local function count_refusals(limits, reply, now, max_wait, store_now, from)
  local blocked = false
  for i = 1, #limits do
    local l = limits[i]
    if l.pen and l.t - now > max_wait then
      if pen_refuse(l.ps, l.pen, store_now) then
        local left = l.ps[1] - store_now
        reply[4 * i - 1], reply[4 * i], reply[4 * i + 1], reply[4 * i + 2] =
          LIMIT_BLOCKED, left, 0, left
      end
      pen_save(l.pk, l.ps, l.pen, store_now, from)
    end
  end
end

-- The decision of one limit with a penalty (see "Penalties"): refused at
-- once while blocked, else its own decision, and when that refuses (not a
-- peek) one more refusal counted.
function penalized_one(keys, s, store_now, max_wait, dry, from)
  local own, pen, key = s.own, s.pen, keys[s.pk]
  local ps, moved = pen_load(key, store_now)
  if moved then pen_save(key, ps, pen, store_now, from) end
  -- (outcome 1: denied, see wire.lua)
  if ps[1] > store_now then
    local left = ps[1] - store_now
    return spack('<dddddd', 1, store_now, LIMIT_BLOCKED, left, 0, left)
  end
  local r = own[1](keys, own, store_now, max_wait, dry, from)
  if dry then return r end
  -- its outcome and clock, the reply's first two numbers
  local outcome, now = sunpack('<dd', r)
  if outcome ~= 1 then return r end
  local offence = pen_refuse(ps, pen, store_now)
  pen_save(key, ps, pen, store_now, from)
  if not offence then return r end
  local left = ps[1] - store_now
  -- its notes (after the six doubles) stay
  return spack('<dddddd', 1, now, LIMIT_BLOCKED, left, 0, left) .. ssub(r, 49)
end
