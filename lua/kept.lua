-- kept.lua: quotas kept in the store (`Limit::quota_from_store`), read
-- through a mirror in this Lua VM, and op 3 (OP_QUOTAS), which changes them.
--
-- Quotas (op 3): KEYS the hash of a limit's kept quotas, ARGV the options,
-- then HSET, HSETNX or HDEL, the field and, for a set, the value: runs that
-- command and drops the hash's mirror. Reply: the command's, as text.
--
-- The longest window or period (us) of a limit: ten years of 366 days
-- (`MAX_WINDOW_MICROS` in src/limit.rs).
local KEPT_WINDOW = 316224000000000

-- Whether a kept quota's algorithm `id` and fields a, b, c (and d, of the
-- form 0.1 wrote: nil for today's) are what `write_stored_form`
-- (src/store/redis/encode.rs) writes for some valid limit: exactly what
-- `Params::from_stored` (src/algorithm/params.rs) accepts, the parameters
-- `Params::derive` there makes of a quota (amounts and windows at least
-- 1, windows at most KEPT_WINDOW, a bucket's rate and period in lowest
-- terms, the products the scripts form below 2^53, unused fields 0).
local function valid_kept(id, a, b, c, d)
  if not (a and b and c and int(a) and int(b) and int(c)) or a < 1 or b < 1
      or (d ~= nil and d ~= 0) then
    return false
  end
  -- by the shape of the algorithm's parameters (`Shape` in
  -- src/algorithm/params.rs)
  local shape = algorithms[id] and algorithms[id].shape
  if shape == "window" then return b <= KEPT_WINDOW and c == 0 end
  if shape == "weighted" then -- a sliding window's weight step: ceil(window / 2^20)
    return b <= KEPT_WINDOW and a * 1048576 < EXACT and c == cdiv(b, 1048576)
  end
  if shape == "bucket" then -- a capacity a, b per period c
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
-- as limit 1 of a reply, and in `costs` by cost text the spec that decides
-- with it. Checked once per distinct string.
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
        text = q, costs = {}, n_costs = 0 }
    end
  end
  kept, n_kept = cache_put(kept, n_kept, q, k)
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
-- (`write_stored_form` in src/store/redis/encode.rs,
-- "algorithm:p1:p2:p3:"), an override with '@'
-- and the store time it ends (us) when it does; read through its mirror
-- (see `mirror`). An override that has ended is deleted from the hash
-- when read: by the first decision of its key after its end, or by the
-- next read of a mirrored hash (of at most FIELDS_MIRRORED fields), so one
-- HDEL per ended override, and nothing on the path of one that lasts. The
-- override while it lasts, else the limit's (not for a tier, `s.tier`),
-- decides in place of `s.own` when it is of the same algorithm and valid. Returns the spec that
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
    -- a tier's quota is replaced by its key's override only
    if s.tier then return own, ignored end
    quota = m.quota
    if not (quota and quota.id == own.id and quota.ends > now) then
      if quota and quota.ends > now then ignored = i .. '=!;' end
      return own, ignored
    end
  end
  -- (the specs by cost, as many as `cache_put` keeps: a cost read from a
  -- request or a response may take any value)
  local decides = quota.costs[s.cost_text]
  if not decides then
    decides = spec(quota.params .. s.cost_text)
    quota.costs, quota.n_costs = cache_put(quota.costs, quota.n_costs, s.cost_text, decides)
  end
  if i == 1 and not ignored then return decides, quota.note end
  return decides, (ignored or '') .. i .. '=' .. quota.params .. ';'
end

-- Op 3 (OP_QUOTAS, the store's `quotas`): changes a kept quota: keys[1]
-- its hash, args[2] the command (HSET, HSETNX or HDEL), then its field
-- and, for a set, the value. Drops the hash's mirror. Reply: the
-- command's, as text.
local CHANGES = { HSET = true, HSETNX = true, HDEL = true }
local function quotas(keys, args)
  local hash = keys[1]
  if not rcall then bind() end
  if not CHANGES[args[2]] then return redis.error_reply('not a change of a kept quota') end
  local done = rcall(args[2], hash, unpack(args, 3))
  if mirrors[hash] then mirrors[hash], n_mirrors = nil, n_mirrors - 1 end
  return tostring(done)
end

-- The decision of one limit whose quota may be kept in the store, by the
-- spec that `configured` finds.
function configured_one(keys, s, store_now, max_wait, dry, from)
  local decides, note = configured(s, keys, s.alg.nkeys + 1, 1, store_now)
  return decides[1](keys, decides, store_now, max_wait, dry, from, note)
end
