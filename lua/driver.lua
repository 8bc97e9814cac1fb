-- driver.lua: one atomic decision over one or more limits: the wire, a
-- limit's string (`spec`) and the decision's clock. The library's other
-- files, by job (build.rs assembles them in this order): kept.lua (quotas
-- kept in the store), penalty.lua (penalties), limits.lua (a decision over
-- several limits, and the ops on limits), one.lua (the decision of one
-- limit, the production path), dispatch.lua (`decide`, the entry point,
-- and batches). The names in capitals (OPT_, OP_, PEN_, LIMIT_) come from
-- wire.lua, written from src/algorithm/wire.rs.
--
-- KEYS:  the keys of each limit in order (sliding log: 2, others: 1), all
--        sharing one hash tag so the decision runs on one cluster slot.
-- ARGV:  [options] "o:<slot 1>:<slot 2>:...", only when any differs from
--            0, by slot (OPT_ in wire.lua):
--            now (us since the epoch; 0 = read Redis TIME, the production
--            path), max_wait (us: a grant may be reserved this far ahead),
--            dry (1 = decide, grant nothing: a peek), slack (us keys outlive
--            their state), op (absent or 0: decide; else an OP_ of
--            wire.lua: refund, take what is available, change a kept
--            quota, charge, renew, a key's penalty state, several
--            decisions; see limits.lua, kept.lua, penalty.lua and
--            dispatch.lua), at (us, for a refund or a renewal: the time of
--            the grant, `now + wait` of its reply; for a penalty, what to
--            do), block (us, a penalty's block)
--        then one per limit: "algorithm:p1:p2:p3:cost" (algorithm 1
--            sliding log, 2 token bucket, 3 gcra, 4 fixed window, 5 sliding
--            window; p3 0 for the algorithms of two parameters, and a
--            calendar quota's code, negative, for a window (see `cal` in
--            common.lua); cost 0 changes nothing), with "c" first for a limit
--            whose quota may be kept in the store ("k" for a tier of one,
--            which only its key's override may replace): one more key
--            follows its own, the hash of its kept quotas (see `configured`),
--            and before that "p<refusals>:<within>:<forget>:<block>...;"
--            for a limit with a penalty: one more key follows all of its
--            own, its penalty key (see "Penalties" in penalty.lua)
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
--          2 a cost exceeds a capacity), now (us, the decision's clock),
--          then per limit its status, four doubles: its kind (LIMIT_ in
--          wire.lua), then for LIMIT_ALLOWS its wait (us until it alone
--          allows), remaining and reset (us); for LIMIT_NEVER (its cost
--          exceeds its capacity) 0, remaining and reset; for LIMIT_BLOCKED
--          (see "Penalties" in penalty.lua) the time left of the block, 0, and the time
--          left. (One string costs Redis less than an
--          array of integers.) Then "i=<quota>;" for each limit i (from 1)
--          that a quota kept in the store decided, and before it "i=!;"
--          for each limit whose kept quota or override in force was
--          ignored: not valid (see `valid_kept`) or of another algorithm.
-- All limits are granted together at one time T = now + max wait_i, or
-- none is: the decision's wait (until the grant, or a retry) is the longest
-- of its limits' waits, which the Rust side reads off the statuses.
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
  -- 'c': its quota may be kept in the store; 'k': a tier's, which only its
  -- key's override may replace (`Limit::overrides_only`)
  if first == 99 or first == 107 then
    local own = spec(string.sub(s, 2))
    v = { configured_one, own = own, cfg = true, alg = own.alg, cost = own.cost, h = own.h,
      cost_text = string.match(s, '%d+$'), tier = first == 107 }
    specs[s] = v
    return v
  end
  local f = ints(s)
  local alg = algorithms[f[1]]
  v = { alg.one, f[2], f[3], f[4], f[5], alg = alg, cost = f[5], id = first }
  v.h = alg.horizon(v)
  if alg.derive then alg.derive(v) end
  specs, n_specs = cache_put(specs, n_specs, s, v)
  return v
end

-- The decision's clock: the `now` option, or Redis TIME (the production path).
local function clock(opts)
  local store_now = opts[OPT_NOW]
  if store_now == 0 then
    local t = redis.call('TIME')
    store_now = t[1] * 1000000 + t[2]
  end
  return store_now
end
