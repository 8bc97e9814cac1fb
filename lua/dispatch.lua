-- dispatch.lua: `decide`, the library's entry point, which dispatches a
-- call by its options, and op 7, several decisions in one call.

local NO_OPTIONS = { 0, 0, 0, 0 }

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
    if op == OP_QUOTAS then return quotas(keys, args) end
    if op == OP_CHARGE then return charge(keys, args, opts) end
    if op == OP_REFUND or op == OP_RENEW then return settle(keys, args, opts, op) end
    if op == OP_PENALTY then return penalty(keys, args, opts) end
    if op == OP_BATCH then return batch(keys, args) end
    if op == OP_FLEET then return heartbeat(keys, args) end
    if op == OP_EACH then return each(keys, args, opts) end
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
  heads, n_heads = cache_put(heads, n_heads, c, h)
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
local function length(len)
  local packed = lengths[len]
  if not packed then
    packed = struct.pack('<d', len)
    if len < 4096 then lengths[len] = packed end
  end
  return packed
end
-- Decides `count` decisions of a run, each on the next `nk` keys of
-- `keys` after the `k` first, by the spec `s` (false: through `decide`,
-- with the run's arguments in `as`), and appends each reply after its
-- length to `out`, which holds `n` entries. Called protected, once for a
-- run rather than once for each decision (that cost a batch of GCRA
-- decisions about 1.2% more): a decision that fails stops it there, and
-- what `out` holds then says how many were made.
local function decide_run(out, n, keys, k, s, nk, count, store_now)
  for _ = 1, count do
    for i = 1, nk do ks[i] = keys[k + i] end
    for i = nk + 1, nks do ks[i] = nil end
    nks = nk
    local r
    if s then
      r = s[1](ks, s, store_now, 0, false, store_now)
    else
      r = decide(ks, as)
    end
    if type(r) ~= 'string' then r = failed(r) end
    local len = #r
    out[n + 1], out[n + 2], n = lengths[len] or length(len), r, n + 2
    k = k + nk
  end
end

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
    local readable, s = true, false
    if na == 1 then readable, s = lpcall(run_spec, as[1]) end
    while count > 0 do
      local ok, e = false, s
      if readable then ok, e = lpcall(decide_run, out, n, keys, k, s, nk, count, store_now) end
      -- the decisions made (each put two entries), then the one that failed, alone
      local made = (#out - n) / 2
      n, k, count = n + 2 * made, k + made * nk, count - made
      if not ok then
        local r = failed(e)
        out[n + 1], out[n + 2], n = length(#r), r, n + 2
        k, count = k + nk, count - 1
      end
    end
    a = a + na + 1
  end
  return table.concat(out)
end
