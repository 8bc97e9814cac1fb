-- driver.lua: one atomic decision over one or more limits.
--
-- KEYS:  the keys of each limit in order (sliding log: 2, others: 1), all
--        sharing one hash tag so the decision runs on one cluster slot.
-- ARGV:  [options] "o:<slot 1>:<slot 2>:...", only when any differs from
--            0, by slot (OPT_ in wire.lua, written from
--            src/algorithm/wire.rs, as OP_, PEN_ and LIMIT_ are):
--            now (us since the epoch; 0 = read Redis TIME, the production
--            path), max_wait (us: a grant may be reserved this far ahead),
--            dry (1 = decide, grant nothing: a peek), slack (us keys outlive
--            their state), op (absent or 0: decide; else an OP_ of
--            wire.lua: refund, take what is available, change a kept
--            quota, charge, renew, a key's penalty state, several
--            decisions; see below), at (us, for a refund or a renewal: the
--            time of the grant, `now + wait` of its reply; for a penalty,
--            what to do), block (us, a penalty's block)
--        then one per limit: "algorithm:p1:p2:p3:cost" (algorithm 1
--            sliding log, 2 token bucket, 3 gcra, 4 fixed window, 5 sliding
--            window; p3 0 for the algorithms of two parameters; cost 0
--            changes nothing), with "c" first for a limit
--            whose quota may be kept in the store: one more key follows
--            its own, the hash of its kept quotas (see `configured`),
--            and before that "p<refusals>:<within>:<forget>:<block>...;"
--            for a limit with a penalty: one more key follows all of its
--            own, its penalty key (see "Penalties")
-- A limit's kept quota is read through a mirror in this Lua VM (see
-- `mirror`): a change made through the library (op 3) is in force for the
-- next decision on the same server; one made behind its back (a hand edit,
-- the hash evicted or flushed, another version of the library, a failover)
-- within one second of store time (the decision's clock). A hash's mirror
-- costs a decision no Redis call; its read, once a second per hash and
-- server, is an HLEN and an HGETALL (an HGET of the limit's quota alone
-- when the hash holds more than FIELDS_MIRRORED fields). The overrides of
-- a hash with more than that are read by each decision (one HGET).
-- Reply: little-endian doubles, all integers: outcome (0 granted, 1 denied,
--          2 a cost exceeds a capacity), wait (us until the grant for 0;
--          retry-after for 1; -1 for 2), now (us, the decision's clock),
--          then per limit its status, four doubles: its kind (LIMIT_ in
--          wire.lua), then for LIMIT_ALLOWS its wait (us until it alone
--          allows), remaining and reset (us); for LIMIT_NEVER (its cost
--          exceeds its capacity) 0, remaining and reset; for LIMIT_BLOCKED
--          (see "Penalties") the time left of the block, 0, and the time
--          left. (One string costs Redis less than an
--          array of integers.) Then "i=<quota>;" for each limit i (from 1)
--          that a quota kept in the store decided, and before it "i=!;"
--          for each limit whose kept quota or override in force was
--          ignored: not valid (see `valid_kept`) or of another algorithm.
-- All limits are granted together at one time T = max wait_i, or none is.
--
-- Refund (op 1): gives back, in every limit, a grant of its cost made at
-- `at`: a sliding log drops one member of that time and cost; the buckets
-- take the cost back, never above their capacity; a fixed window uncounts it
-- if `at` lies in the counted window, a sliding window from the current or
-- previous window, whichever holds `at`. Never below empty. Each key is read
-- at its own clock (the latest of the store's and its `written` as believed, see
-- "Clock steps"). Reply: "".
--
-- Charge (op 4): each limit's cost is granted whatever is left, so a limit
-- may end in debt (over its capacity) and refuses its key until the debt is
-- paid back: the cost of a request known only from its response. Granted
-- where a cost of 1 would be (now, unless the limit is spent: then at the
-- earliest time it allows one), behind every grant already made, so a
-- reservation ahead is never overwritten. The limits are read at one
-- clock, as a decision's. Reply: "".
--
-- Renew (op 5): moves a grant of each limit's cost made at `at` to the
-- store's clock, when the limit still holds it (a sliding log drops one
-- entry of that time and cost and adds one now: a lease renewed; the
-- scripts' `refund` of a sliding log says whether it found one). Reply:
-- little-endian doubles, the store's clock (the grant's new time), then
-- per limit 1 when it held the grant, else 0.
--
-- Take (op 2): the cost is an upper bound N (the same for every limit):
-- grants k = min(N, what every limit has left now), at once (max_wait is
-- ignored), or, when k = 0, decides a cost of 1 without granting it (the
-- denial says when one will be there). Reply: a decision's reply for cost
-- k (or 1), then k.
--
-- Change (op 3): KEYS the hash of a limit's kept quotas, ARGV the options,
-- then HSET, HSETNX or HDEL, the field and, for a set, the value: runs that
-- command and drops the hash's mirror. Reply: the command's, as text.
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
-- LIMIT_BLOCKED (see "Reply"); a decision refused by a block
-- waits the longest of its limits' waits, the blocked ones' being their
-- times left. The key expires when its state equals a fresh one.
--
-- Penalty (OP_PENALTY): KEYS a penalty key, ARGV the options, with
-- opts[OPT_AT] PEN_READ, PEN_BLOCK for opts[OPT_BLOCK] us (no offence; the
-- refusals counted go) or PEN_FORGET (delete), then the limit's string. Reply: until,
-- offences, refusals, since (after a block, before a forget) and the
-- store's clock, little-endian doubles.
--
-- Clock steps: every key records the clock of its last write (`written`). A key's
-- clock is believed at most the limit's horizon H ahead of the store's clock,
-- and the decision's clock is the latest of the store's clock and the
-- believed ones. H is the longest wait the limit asks by itself: a full
-- burst's emission (GCRA), a full bucket's refill, one window (fixed window,
-- sliding log), two (a sliding window's estimate spans the previous one).
-- Within H, time never runs backwards for a key: after a backward step,
-- state written "in the future" is read as of its own time (what it records
-- is spent, not reserved), real reservations stay reservations, and waiting
-- the step out costs a request at most H more than the limit could ask. A
-- state dated after the decision's clock (its writer's clock was more than H
-- ahead: a replica promoted with its clock ahead, a misconfigured store
-- clock) is moved back to that clock whole, every time it records by the
-- same amount: its grants count as made now and its reservations stay queued
-- behind them (nothing is over-admitted), and its key is refused no longer
-- than the limit could ask, plus those reservations. A decision that moves a
-- state that still holds something writes it back, a denial or a peek too,
-- so that it ages from then on (one that holds nothing is left to the next
-- write). Expiries are set from the store's own clock, so a key never
-- expires early; they only reclaim memory, since a state past its own `exp`
-- reads as absent anyway.
-- (`algorithms`, by id, and each one's `nkeys` come from wire.lua)

-- A limit's string, parsed once: an array, [1] the algorithm's `one`,
-- [2..4] its parameters ([2] its capacity: no larger cost ever fits; see
-- `Params::wire`), [5] the cost, then constants its algorithm's
-- `derive` adds, and by name its algorithm `alg`, the cost and the horizon
-- `h` (see "Clock steps").
local specs, n_specs = {}, 0
local configured_one, penalized_one
local function spec(s)
  local v = specs[s]
  if v then return v end
  -- every algorithm's decision has a spec: Redis' functions are bound by then
  if not rcall then bind() end
  local first = string.byte(s, 1)
  if first == 111 then return nil end -- 'o': options, no limit
  if first == 112 then -- 'p': its penalty, then its own string
    local semi = string.find(s, ';', 2, true)
    local own = spec(string.sub(s, semi + 1))
    local pk = own.alg.nkeys + 1
    if own.cfg then pk = pk + 1 end
    v = { penalized_one, own = own, pen = ints(string.sub(s, 2, semi - 1)), alg = own.alg,
      cost = own.cost, h = own.h, pk = pk }
    specs[s] = v
    return v
  end
  if first == 99 then -- 'c': its quota may be kept in the store
    local own = spec(string.sub(s, 2))
    v = { configured_one, own = own, cfg = true, alg = own.alg, cost = own.cost, h = own.h,
      cost_text = string.match(s, '%d+$') }
    specs[s] = v
    return v
  end
  local f = ints(s)
  local alg = algorithms[f[1]]
  v = { alg.one, f[2], f[3], f[4], f[5], alg = alg, cost = f[5], id = first }
  v.h = alg.horizon(v)
  if alg.derive then alg.derive(v) end
  if n_specs >= 1024 then specs, n_specs = {}, 0 end
  specs[s] = v
  n_specs = n_specs + 1
  return v
end

-- The longest window or period (us) of a limit: ten years of 366 days
-- (`MAX_WINDOW_MICROS` in src/limit.rs).
local KEPT_WINDOW = 316224000000000

-- Whether a kept quota's algorithm `id` and fields a, b, c (and d, of the
-- form 0.1 wrote: nil for today's) are what
-- `Limit::stored_form` writes for some valid limit: exactly what
-- `Params::from_stored` (src/algorithm/mod.rs) accepts, the parameters
-- `derive` in src/limit.rs makes of a quota (amounts and windows at least
-- 1, windows at most KEPT_WINDOW, a bucket's rate and period in lowest
-- terms, the products the scripts form below 2^53, unused fields 0).
local function valid_kept(id, a, b, c, d)
  if not (a and b and c and int(a) and int(b) and int(c)) or a < 1 or b < 1
      or (d ~= nil and d ~= 0) then
    return false
  end
  if id == 1 or id == 4 then return b <= KEPT_WINDOW and c == 0 end
  if id == 5 then -- a sliding window's weight step: ceil(window / 2^20)
    return b <= KEPT_WINDOW and a * 1048576 < EXACT and c == cdiv(b, 1048576)
  end
  if id == 2 or id == 3 then -- a capacity a, b per period c
    if c < 1 or c > KEPT_WINDOW or a * c + b >= EXACT then return false end
    local x, y = b, c
    while y > 0 do x, y = y, fmod(x, y) end
    return x == 1
  end
  return false
end

-- A kept quota or override that is not valid (`valid_kept`): ignored, as
-- one of another algorithm is; its limit's decisions report it ('!' in
-- the reply's notes) for the Rust side to log once.
local NOT_VALID = { id = 0, ends = 1 / 0 }

-- A quota kept in the store, `q` (see `configured`): NOT_VALID when it is
-- not a valid limit's string less its cost (`valid_kept`; the form 0.1
-- wrote, with a fourth parameter 0, is read as today's), maybe followed
-- by '@' and when it ends, else its algorithm's id (the string's first
-- byte), when it ends (us, store time; infinity when it does not), its note
-- as limit 1 of a reply, and by cost text the spec that decides with it.
-- Checked once per distinct string.
local kept, n_kept = {}, 0
local function kept_quota(q)
  local k = kept[q]
  if k ~= nil then return k end
  k = NOT_VALID
  -- the form of 0.1 (a fourth parameter, 0), else today's
  local params, d, rest = string.match(q, '^(%d:%d+:%d+:%d+:)(%d+):(.*)$')
  if not params then params, rest = string.match(q, '^(%d:%d+:%d+:%d+:)(.*)$') end
  local ends, lasts = 1 / 0, rest == ''
  if rest and not lasts then
    ends = tonumber(string.match(rest, '^@(%d+)$'))
    lasts = ends and int(ends)
  end
  if lasts then
    local f = ints(params)
    if valid_kept(f[1], f[2], f[3], f[4], tonumber(d)) then
      k = { id = string.byte(q, 1), params = params, note = '1=' .. params .. ';', ends = ends,
        text = q }
    end
  end
  if n_kept >= 1024 then kept, n_kept = {}, 0 end
  kept[q] = k
  n_kept = n_kept + 1
  return k
end

-- Each hash as this VM last read it: by the hash's name, [1] the store
-- time of the read, `quota` the limit's kept quota (`kept_quota` of field
-- '', false for none), and either `keys`, every key's override by field
-- (a hash of at most FIELDS_MIRRORED fields), or `more` = true (a larger
-- one, whose overrides each decision reads).
-- `configured` reads a hash again when its mirror is missing, a second old
-- or more, or dated after the decision (a clock stepped back), so a change
-- made behind the library's back is in force within a second of store
-- time; a change made through it (op 3) drops the hash's mirror, so this
-- VM reads it again at its next decision. Emptied when it holds more than
-- MIRRORS hashes (one per limit, on a cluster one per limit and slot). The
-- overrides stay in Redis (a limit may have any number) until they end
-- (see `configured`).
local mirrors, n_mirrors, MIRRORS, FIELDS_MIRRORED = {}, 0, 16384, 256

-- A kept value as a string, or nil (absent, or an error reply: another
-- type of key reads as an empty hash).
local function text(v)
  if type(v) == 'string' then return v end
  return nil
end

-- Reads the hash `hash` into its mirror, at store time `now`; returns it.
local function mirror(hash, now)
  if not mirrors[hash] then
    if n_mirrors >= MIRRORS then mirrors, n_mirrors = {}, 0 end
    n_mirrors = n_mirrors + 1
  end
  local fields = rpcall('HLEN', hash)
  if type(fields) ~= 'number' then fields = 0 end
  local m = { now, quota = false }
  if fields > FIELDS_MIRRORED then
    local own = text(rpcall('HGET', hash, ''))
    m.quota, m.more = own and kept_quota(own), true
  else
    local keys, all = {}, fields > 0 and rpcall('HGETALL', hash) or {}
    for j = 1, #all - 1, 2 do
      local quota = kept_quota(all[j + 1])
      if quota then
        -- an override that has ended goes (see `configured`)
        if quota.ends <= now then
          rcall('HDEL', hash, all[j])
        else
          keys[all[j]] = quota
        end
      end
    end
    m.quota, m.keys = keys[''] or false, keys
  end
  mirrors[hash] = m
  return m
end

-- A limit whose quota may be kept in the store (`s`, with `s.own` its spec
-- less the "c"; see `Limit::quota_from_store`): keys[k] is a hash of the
-- quotas kept for the limit: field '' the limit's, field <its first state
-- key> that key's override, each a limit's string less its cost
-- (`Limit::stored_form`, "algorithm:p1:p2:p3:"), an override with '@'
-- and the store time it ends (us) when it does; read through its mirror
-- (see `mirror`). An override that has ended is deleted from the hash
-- when read: by the first decision of its key after its end, or by the
-- next read of a mirrored hash (of at most FIELDS_MIRRORED fields), so one
-- HDEL per ended override, and nothing on the path of one that lasts. The
-- override while it lasts, else the limit's, decides in place of `s.own`
-- when it is of the same algorithm and valid. Returns the spec that
-- decides, and the reply's note of it for limit `i` (nil for its own),
-- after the note "i=!;" when a kept value in force was ignored.
local function configured(s, keys, k, i, now)
  local own, hash = s.own, keys[k]
  local m = mirrors[hash]
  -- (the second as a literal: an operand, where an upvalue is loaded first)
  if not m or m[1] > now or now - m[1] >= 1000000 then m = mirror(hash, now) end
  -- the key's override, else the limit's (written out: no loop)
  local field, quota = keys[k - own.alg.nkeys], nil
  if m.more then
    local q = text(rpcall('HGET', hash, field))
    quota = q and kept_quota(q)
  else
    quota = m.keys[field]
  end
  -- an override read past its end is removed from the hash (and the
  -- mirror), when the hash still holds it (the mirror may be older)
  if quota and quota.ends <= now then
    if m.more or text(rpcall('HGET', hash, field)) == quota.text then
      rcall('HDEL', hash, field)
    end
    if not m.more then m.keys[field] = nil end
    quota = nil
  end
  -- (nil: no note of a kept value that is not valid, see NOT_VALID)
  local ignored = nil
  if not (quota and quota.id == own.id and quota.ends > now) then
    -- an override in force that cannot decide: not valid, or of another algorithm
    if quota and quota.ends > now then ignored = i .. '=!;' end
    quota = m.quota
    if not (quota and quota.id == own.id and quota.ends > now) then
      if quota and quota.ends > now then ignored = i .. '=!;' end
      return own, ignored
    end
  end
  local decides = quota[s.cost_text]
  if not decides then
    decides = spec(quota.params .. s.cost_text)
    quota[s.cost_text] = decides
  end
  if i == 1 and not ignored then return decides, quota.note end
  return decides, (ignored or '') .. i .. '=' .. quota.params .. ';'
end

-- Op 3: changes a kept quota: keys[1] its hash, args[2] the command (HSET,
-- HSETNX or HDEL), then its field and, for a set, the value. Drops the
-- hash's mirror. Reply: the command's, as text.
local CHANGES = { HSET = true, HSETNX = true, HDEL = true }
local function change(keys, args)
  local hash = keys[1]
  if not rcall then bind() end
  if not CHANGES[args[2]] then return redis.error_reply('not a change of a kept quota') end
  local done = rcall(args[2], hash, unpack(args, 3))
  if mirrors[hash] then mirrors[hash], n_mirrors = nil, n_mirrors - 1 end
  return tostring(done)
end

-- The spec of the limit whose string is `arg` and whose keys start at
-- keys[k] (limit `i` of the call, decided at store time `now`): the one
-- that decides (see `configured`), the reply's note of it (nil for its
-- own), and the key after the limit's; for a limit with a penalty, then
-- its spec (with `pen`) and the index of its penalty key.
local function resolve(arg, keys, k, i, now)
  local s = spec(arg)
  local p
  if s.pen then p, s = s, s.own end
  local n = s.alg.nkeys
  local decides, note, after = s, nil, k + n
  if s.cfg then
    decides, note = configured(s, keys, k + n, i, now)
    after = after + 1
  end
  if p then return decides, note, after + 1, p, after end
  return decides, note, after
end

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

local NO_OPTIONS = { 0, 0, 0, 0 }
local formats = {}

-- The decision's clock: the `now` option, or Redis TIME (the production path).
local function clock(opts)
  local store_now = opts[OPT_NOW]
  if store_now == 0 then
    local t = redis.call('TIME')
    store_now = t[1] * 1000000 + t[2]
  end
  return store_now
end

-- Op 6: reads, sets (a block) or deletes a penalty state.
local function penalty(keys, args, opts)
  if not rcall then bind() end
  local store_now = clock(opts)
  local key, what = keys[1], opts[OPT_AT]
  local ps, moved = pen_load(key, store_now)
  if what == PEN_FORGET then
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

-- Loads the state of the n limits whose arguments start at args[first], in
-- key order; returns them, the latest of the store's clock `store_now` and
-- their clocks as believed, the notes of the stored quotas that decide,
-- and whether a limit is blocked (see "Penalties": a penalized limit has
-- `pen`, its key `pk` and state `ps`, and while blocked `left`, the time
-- left of its block).
local function load_limits(keys, args, first, n, store_now, from)
  local limits = {}
  local next_key, notes = 1, ''
  local now, blocked = store_now, false
  for i = 1, n do
    local s, note, after, p, pk = resolve(args[first + i - 1], keys, next_key, i, store_now)
    local alg = s.alg
    local st = {}
    alg.load(st, s, keys, next_key)
    next_key = after
    if note then notes = notes .. note end
    now = max(now, believed(store_now, st.written, s.h))
    local l = { alg = alg, s = s, cost = s.cost, st = st, t = 0 }
    if p then
      l.pen, l.pk = p.pen, keys[pk]
      local moved
      l.ps, moved = pen_load(l.pk, store_now)
      if moved then pen_save(l.pk, l.ps, l.pen, store_now, from) end
      if l.ps[1] > store_now then l.left, blocked = l.ps[1] - store_now, true end
    end
    limits[i] = l
  end
  return limits, now, notes, blocked
end

-- Ops 1 and 5, on each limit at its own clock: op 1 gives back a grant of
-- its cost made at `at`; op 5 moves a grant of its cost made at `at` to the
-- store's clock, if the limit still holds it (see "Renew" above).
local function settle(keys, args, opts, op)
  local store_now = clock(opts)
  local from, at = store_now - opts[OPT_SLACK], opts[OPT_AT]
  local next_key = 1
  local held = { store_now }
  for i = 2, #args do
    local s, _, after = resolve(args[i], keys, next_key, i - 1, store_now)
    local alg = s.alg
    local st = {}
    alg.load(st, s, keys, next_key)
    next_key = after
    local now = believed(store_now, st.written, s.h)
    alg.prepare(st, s, now)
    held[i] = 0
    if s.cost > 0 then
      if op == OP_REFUND then
        alg.refund(st, s, now, at, s.cost)
      elseif alg == sliding_log and alg.refund(st, s, now, at, s.cost) then
        alg.grant(st, s, store_now, s.cost)
        held[i] = 1
      end
    end
    alg.save(st, s, now, from)
  end
  if op == OP_REFUND then return '' end
  return struct.pack('<' .. string.rep('d', #args), unpack(held))
end

-- The earliest time at which every one of the limits allows its cost (or
-- `cost`, for all): each limit's as `l.t`; returns it, or -1 when a cost
-- exceeds a capacity.
local function earliest(limits, now, cost)
  local at = now
  for i = 1, #limits do
    local l = limits[i]
    local c = cost or l.cost
    l.t = now
    if l.left then
      l.t = now + l.left -- blocked: its quota is not asked
    elseif c > 0 then
      l.t = l.alg.earliest(l.st, l.s, now, c)
    end
    if l.t < 0 then
      at = -1
    elseif at >= 0 and l.t > at then
      at = l.t
    end
  end
  return at
end

-- Grants each limit's cost (or `cost`) at `at` when `grant`, saves every
-- state and returns the reply: outcome, wait, now, then each limit's
-- status as of `as_of` (see "Reply").
local function finish(limits, outcome, wait, now, grant, at, cost, as_of, from)
  local reply = { outcome, wait, now }
  for i = 1, #limits do
    local l = limits[i]
    local c = cost or l.cost
    if grant and c > 0 then l.alg.grant(l.st, l.s, at, c) end
    l.alg.save(l.st, l.s, now, from)
    local remaining, reset = l.alg.status(l.st, l.s, now, as_of)
    local kind, t = LIMIT_ALLOWS, 0
    if l.left then
      kind, t, remaining, reset = LIMIT_BLOCKED, l.left, 0, l.left
    elseif l.t >= 0 then
      t = l.t - now
    else
      kind = LIMIT_NEVER
    end
    reply[4 * i], reply[4 * i + 1], reply[4 * i + 2], reply[4 * i + 3] = kind, t, remaining, reset
  end
  return reply
end

-- Op 2: takes min(N, what every limit has left now).
local function take(keys, args, opts)
  local store_now = clock(opts)
  local n = #args - 1
  local limits, now, notes, blocked = load_limits(keys, args, 2, n, store_now,
    store_now - opts[OPT_SLACK])
  local k = limits[1].cost
  for i = 1, n do
    local l = limits[i]
    l.alg.prepare(l.st, l.s, now)
    k = min(k, (l.alg.status(l.st, l.s, now, now)))
  end
  k = max(0, k)
  if blocked then k = 0 end
  -- k = 0: a cost of 1 decided, not granted (the denial says when)
  local cost = max(k, 1)
  local at = earliest(limits, now, cost)
  local outcome, wait = verdict(at, now, 0)
  if blocked and outcome == 0 then outcome, wait = 1, at - now end
  local reply = finish(limits, outcome, wait, now, outcome == 0 and k > 0, now, cost, now,
    store_now - opts[OPT_SLACK])
  reply[4 * n + 4] = k
  return struct.pack('<' .. string.rep('d', 4 + 4 * n), unpack(reply)) .. notes
end

-- Op 4: charges each limit's cost where a cost of 1 would be granted,
-- whatever is left (see "Charge" above).
local function charge(keys, args, opts)
  local store_now = clock(opts)
  local limits, now = load_limits(keys, args, 2, #args - 1, store_now,
    store_now - opts[OPT_SLACK])
  for i = 1, #limits do
    local l = limits[i]
    l.alg.prepare(l.st, l.s, now)
    if l.cost > 0 then l.alg.grant(l.st, l.s, l.alg.earliest(l.st, l.s, now, 1), l.cost) end
    l.alg.save(l.st, l.s, now, store_now - opts[OPT_SLACK])
  end
  return ''
end

-- Counts a refusal in each penalized limit of `limits` that refused by
-- itself (see "Penalties") at store time `store_now`; one that made an
-- offence is blocked in `reply` (its status: its own quota's wait no longer
-- counts), and the wait is the longest of the statuses' then.
local function count_refusals(limits, reply, now, max_wait, store_now, from)
  local blocked = false
  for i = 1, #limits do
    local l = limits[i]
    if l.pen and l.t - now > max_wait then
      if pen_refuse(l.ps, l.pen, store_now) then
        local left = l.ps[1] - store_now
        reply[4 * i], reply[4 * i + 1], reply[4 * i + 2], reply[4 * i + 3] =
          LIMIT_BLOCKED, left, 0, left
        blocked = true
      end
      pen_save(l.pk, l.ps, l.pen, store_now, from)
    end
  end
  if not blocked then return end
  local wait = 0
  for i = 1, #limits do wait = max(wait, reply[4 * i + 1]) end
  reply[2] = wait
end

-- The decision over loaded limits at the decision's clock `now`: each
-- prepared, T the earliest time all allow their cost, all granted at T or
-- none (none while a limit is blocked); the packed reply.
local function decide_limits(limits, now, max_wait, dry, from, notes, blocked, store_now)
  for i = 1, #limits do
    local l = limits[i]
    l.alg.prepare(l.st, l.s, now)
  end
  local at = earliest(limits, now, nil)
  local outcome, wait = verdict(at, now, max_wait)
  if blocked and outcome == 0 then outcome, wait = 1, at - now end
  local grant = outcome == 0 and not dry
  local as_of = now
  if grant then as_of = at end
  local reply = finish(limits, outcome, wait, now, grant, at, nil, as_of, from)
  if outcome == 1 and not dry and not blocked then
    count_refusals(limits, reply, now, max_wait, store_now, from)
  end
  local n = #limits
  local format = formats[n]
  if not format then
    format = '<' .. string.rep('d', 3 + 4 * n)
    formats[n] = format
  end
  local packed = struct.pack(format, unpack(reply))
  if notes ~= '' then packed = packed .. notes end
  return packed
end

-- The decision of one limit: the steps of the loop above, for one limit,
-- on locals (build.rs pastes each step in; `--: one` in each algorithm's
-- file is where), the production path. Each writes the same state and
-- reply as `decide_limits` over that one limit; `note`, when a quota kept
-- in the store decides, is the reply's note of it (see `configured_one`).
-- While most keys are found absent (see `absent` in common.lua), a state
-- kept as one STRING (`STORED`) is first taken as absent, its key not read:
-- the decision's state is written only where the key is absent, by the
-- call that reads it (`put_absent`); a key found present is decided again on its
-- value, as if read first.
--: template one
local function ALG_one(keys, s, store_now, max_wait, dry, from, note)
  --: locals
  local cost, i = s[5], 1
  local nx = STORED and not dry and absent > absent_above
  -- the key's value: false (absent) while taken so, nil to be read
  local v = nil
  if nx then v = false end
  local now, t, outcome, wait, at
  while true do
    --: inline load(keys, i, v)
    now = store_now -- believed(store_now, written, s.h), written out
    if written > now and written - now <= s.h then now = written end
    --: inline prepare(now)
    -- a fresh state (one that allows any cost up to the capacity now, as
    -- prepare says) grants such a cost now: earliest would find now
    t, outcome, wait = now, 0, 0
    if not fresh or cost > s[2] or max_wait < 0 then
      if cost > 0 then
        --: inline earliest(now, cost) -> t
      end
      outcome, wait = verdict(t, now, max_wait)
    end
    at = now
    if outcome == 0 and not dry then
      at = t
      if cost > 0 then
        --: inline grant(at, cost)
      end
    end
    local was
    --: inline save(now, from, nx) -> was
    if not nx or was == false then break end
    -- present, decided again on its value; or nothing was written, and
    -- the key is read
    nx, v = false, was
  end
  local remaining, reset
  --: inline status(now, at) -> remaining, reset
  local kind = LIMIT_ALLOWS
  if t >= 0 then t = t - now else kind, t = LIMIT_NEVER, 0 end
  -- a quota kept in the store decided: its note follows (packed with the
  -- rest: a concatenation would make a second string). The outcome and the
  -- clock follow the reply, for a caller in the library (`penalized_one`).
  if note then
    return spack('<dddddddc0', outcome, wait, now, kind, t, remaining, reset, note), outcome, now
  end
  return spack('<ddddddd', outcome, wait, now, kind, t, remaining, reset), outcome, now
end
--: end

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
    return spack('<ddddddd', 1, left, store_now, LIMIT_BLOCKED, left, 0, left), 1, store_now
  end
  local r, outcome, now = own[1](keys, own, store_now, max_wait, dry, from)
  if dry or outcome ~= 1 then return r, outcome, now end
  local offence = pen_refuse(ps, pen, store_now)
  pen_save(key, ps, pen, store_now, from)
  if not offence then return r, outcome, now end
  local left = ps[1] - store_now
  -- its notes (after the seven doubles) stay
  return spack('<ddddddd', 1, left, now, LIMIT_BLOCKED, left, 0, left) .. ssub(r, 57), 1, now
end

-- The decision of one limit whose quota may be kept in the store, by the
-- spec that `configured` finds.
function configured_one(keys, s, store_now, max_wait, dry, from)
  local decides, note = configured(s, keys, s.alg.nkeys + 1, 1, store_now)
  return decides[1](keys, decides, store_now, max_wait, dry, from, note)
end

local batch -- op 7, below

local function decide(keys, args)
  if #args == 1 then
    -- the production path: one limit, no options
    local s = specs[args[1]] or spec(args[1])
    if s then
      local t = rcall('TIME')
      local store_now = t[1] * 1000000 + t[2]
      return s[1](keys, s, store_now, 0, false, store_now)
    end
  end
  local first, opts = 1, NO_OPTIONS
  if string.byte(args[1], 1) == 111 then -- 'o'
    opts = ints(string.sub(args[1], 3))
    local op = opts[OPT_OP]
    if op == OP_TAKE then return take(keys, args, opts) end
    if op == OP_CHANGE then return change(keys, args) end
    if op == OP_CHARGE then return charge(keys, args, opts) end
    if op == OP_REFUND or op == OP_RENEW then return settle(keys, args, opts, op) end
    if op == OP_PENALTY then return penalty(keys, args, opts) end
    if op == OP_BATCH then return batch(keys, args) end
    first = 2
  end
  local store_now = clock(opts)
  local max_wait, dry = opts[OPT_MAX_WAIT], opts[OPT_DRY] == 1
  -- expiries count from here: the store's clock, less the slack
  local from = store_now - opts[OPT_SLACK]
  local n = #args - first + 1
  if n == 1 then
    local s = spec(args[first])
    return s[1](keys, s, store_now, max_wait, dry, from)
  end

  local limits, now, notes, blocked = load_limits(keys, args, first, n, store_now, from)
  return decide_limits(limits, now, max_wait, dry, from, notes, blocked, store_now)
end

-- Op 7: several decisions in one call, each decided on its own, as its own
-- call would decide it (none depends on another's outcome), in order.
-- After the options, runs of decisions: "#<keys>:<args>:<count>", then the
-- run's arguments (its own options, if any, then its limits), shared by its
-- `count` decisions (":<count>" may be left out: 1), each of which takes
-- its `keys` keys in order from KEYS; a decision's options may not name an
-- operation. The decisions of a batch usually share one limit: a run's
-- string travels, and is read, once. Reply: each decision's reply after its
-- length (a little-endian double); a decision that fails (a Lua error, or
-- an error reply, for it alone: nothing here reads a value that makes one,
-- so this is the guard against what was not foreseen) has '!' and the
-- error's text for its reply, and the others are decided as usual. (A
-- decision's reply starts with its outcome, a double whose first byte is
-- 0.) A decision fails before it writes: every value it reads is checked
-- first (see "A state is one STRING" in common.lua, `kept_quota`).
local NOT_BATCHED = 'a batch holds decisions only'
local ks, as, nks, nas = {}, {}, 0, 0 -- reused for each decision of a batch
-- Run headers, parsed once: { keys, args, count }, or false when malformed.
local heads, n_heads = {}, 0
local function head(c)
  local h = heads[c]
  if h ~= nil then return h end
  local nk, na, count = string.match(c, '^#(%d+):(%d+):?(%d*)$')
  nk, na, count = tonumber(nk), tonumber(na), tonumber(count) or 1
  h = false
  if nk and na and na >= 1 and count >= 1 then h = { nk, na, count } end
  if n_heads >= 1024 then heads, n_heads = {}, 0 end
  heads[c] = h
  n_heads = n_heads + 1
  return h
end
-- The spec a run of one limit's string `a` decides with (false: the run
-- goes through `decide`), as `pcall` answers: an error for a string the
-- library cannot read.
local function run_spec(a)
  return specs[a] or spec(a) or false
end
-- A decision's reply for the error `e` (see above).
local function failed(e)
  if type(e) == 'table' then e = e.err end
  return '!' .. tostring(e)
end
-- A reply's length as a little-endian double, by length.
local lengths = {}
function batch(keys, args)
  -- (a batch may be the first call a server's VM runs)
  if not rcall then bind() end
  local out, n, k, a, nargs, nkeys = {}, 0, 0, 2, #args, #keys
  -- one clock for the batch: a plain decision's (no options) reads it here
  local t = rcall('TIME')
  local store_now = t[1] * 1000000 + t[2]
  while a <= nargs do
    local h = head(args[a])
    if not h or a + h[2] > nargs or k + h[1] * h[3] > nkeys then
      return redis.error_reply('malformed batch')
    end
    local nk, na, count = h[1], h[2], h[3]
    for i = 1, na do as[i] = args[a + i] end
    for i = na + 1, nas do as[i] = nil end
    nas = na
    if string.byte(as[1], 1) == 111 and ints(string.sub(as[1], 3))[OPT_OP] then
      return redis.error_reply(NOT_BATCHED)
    end
    -- a string the library cannot read fails the run's decisions
    local ok, s = true, false
    if na == 1 then ok, s = lpcall(run_spec, as[1]) end
    for _ = 1, count do
      for i = 1, nk do ks[i] = keys[k + i] end
      for i = nk + 1, nks do ks[i] = nil end
      nks = nk
      local done, r = ok, s
      if not ok then
        r = failed(s)
      elseif s then
        done, r = lpcall(s[1], ks, s, store_now, 0, false, store_now)
      else
        done, r = lpcall(decide, ks, as)
      end
      if not done or type(r) ~= 'string' then r = failed(r) end
      local len = #r
      local packed = lengths[len]
      if not packed then
        packed = struct.pack('<d', len)
        if len < 4096 then lengths[len] = packed end
      end
      out[n + 1], out[n + 2], n = packed, r, n + 2
      k = k + nk
    end
    a = a + na + 1
  end
  return table.concat(out)
end
