-- limits.lua: decisions over loaded limits: several in one decision, and
-- ops 1, 2, 4 and 5.
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

-- Loads the state of the n limits whose arguments start at args[first], in
-- key order; returns them, the latest of the store's clock `store_now` and
-- their clocks as believed, the notes of the stored quotas that decide,
-- and whether a limit is blocked (see "Penalties" in penalty.lua: a penalized limit has
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
-- state and returns the reply: outcome, now, then each limit's status as
-- of `as_of` (see "Reply" in driver.lua).
local function finish(limits, outcome, now, grant, at, cost, as_of, from)
  local reply = { outcome, now }
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
    reply[4 * i - 1], reply[4 * i], reply[4 * i + 1], reply[4 * i + 2] = kind, t, remaining, reset
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
  local outcome = verdict(at, now, 0)
  if blocked and outcome == 0 then outcome = 1 end
  local reply = finish(limits, outcome, now, outcome == 0 and k > 0, now, cost, now,
    store_now - opts[OPT_SLACK])
  reply[4 * n + 3] = k
  return struct.pack('<' .. string.rep('d', 3 + 4 * n), unpack(reply)) .. notes
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
    -- at most the capacity of the quota that decides (s[2]: a stored
    -- quota's or an override's too): one charge is at most one quota
    if l.cost > 0 then
      l.alg.grant(l.st, l.s, l.alg.earliest(l.st, l.s, now, 1), min(l.cost, l.s[2]))
    end
    l.alg.save(l.st, l.s, now, store_now - opts[OPT_SLACK])
  end
  return ''
end

-- Packing formats of a reply, by its number of limits.
local formats = {}

-- Op 9: a set, each limit with its own key and cost, decided at one clock
-- by the mode in slot OPT_AT (EACH_ in wire.lua). A negative cost is a
-- refund: given back as a grant made now would be, the limit then checked
-- at a cost of 0. A limit is over when its cost does not fit now (a cost
-- of 0: when it is spent beyond its capacity). EACH_COUNTED counts every
-- cost now, past the capacity too; EACH_SPARING the same unless a limit is
-- over, then only the limits over; EACH_ALL every cost if none is over,
-- else none. Reply: a decision's (see "Reply" in driver.lua), each status
-- after the counting: LIMIT_ALLOWS with a wait of 0 (within) or until the
-- cost fits (over), LIMIT_NEVER for a cost over a capacity; the outcome 0
-- when none is over, else 1 (2 for a cost over a capacity). Penalties
-- are neither read nor fed.
local function each(keys, args, opts)
  local store_now = clock(opts)
  local from, mode = store_now - opts[OPT_SLACK], opts[OPT_AT]
  local n = #args - 1
  local limits, now, notes = load_limits(keys, args, 2, n, store_now, from)
  local over, never, wait = false, false, 0
  for i = 1, n do
    local l = limits[i]
    l.alg.prepare(l.st, l.s, now)
    local c = l.cost
    if c < 0 then
      l.alg.refund(l.st, l.s, now, now, -c)
      c = 0
    end
    l.c = c
    local t = l.alg.earliest(l.st, l.s, now, c)
    l.t = t
    if t < 0 then never = true elseif t - now > wait then wait = t - now end
    if t ~= now then over = true end
  end
  local reply = { 0, now }
  if never then reply[1] = 2 elseif over then reply[1] = 1 end
  for i = 1, n do
    local l = limits[i]
    local counted = mode == EACH_COUNTED or not over
      or (mode == EACH_SPARING and l.t ~= now)
    if counted and l.c > 0 then l.alg.grant(l.st, l.s, now, l.c) end
    l.alg.save(l.st, l.s, now, from)
    local remaining, reset = l.alg.status(l.st, l.s, now, now)
    local kind, t = LIMIT_ALLOWS, l.t - now
    if l.t < 0 then kind, t = LIMIT_NEVER, 0 end
    reply[4 * i - 1], reply[4 * i], reply[4 * i + 1], reply[4 * i + 2] = kind, t, remaining, reset
  end
  local format = formats[n]
  if not format then
    format = '<' .. string.rep('d', 2 + 4 * n)
    formats[n] = format
  end
  local packed = struct.pack(format, unpack(reply))
  if notes ~= '' then packed = packed .. notes end
  return packed
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
  local outcome = verdict(at, now, max_wait)
  if blocked and outcome == 0 then outcome = 1 end
  local grant = outcome == 0 and not dry
  local as_of = now
  if grant then as_of = at end
  local reply = finish(limits, outcome, now, grant, at, nil, as_of, from)
  if outcome == 1 and not dry and not blocked then
    count_refusals(limits, reply, now, max_wait, store_now, from)
  end
  local n = #limits
  local format = formats[n]
  if not format then
    format = '<' .. string.rep('d', 2 + 4 * n)
    formats[n] = format
  end
  local packed = struct.pack(format, unpack(reply))
  if notes ~= '' then packed = packed .. notes end
  return packed
end
