-- one.lua: the decision of one limit, the production path, as a template
-- that build.rs expands for each algorithm.

-- The decision of one limit: the steps of `decide_limits` (limits.lua)
-- for one limit, on locals (build.rs pastes each step in; `--: one` in
-- each algorithm's file is where), the production path. Each writes the same state and
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
  local now, t, outcome, at
  while true do
    --: inline load(keys, i, v)
    now = store_now -- believed(store_now, written, s.h), written out
    if written > now and written - now <= s.h then now = written end
    --: inline prepare(now)
    -- a fresh state (one that allows any cost up to the capacity now, as
    -- prepare says) grants such a cost now: earliest would find now
    t, outcome = now, 0
    if not fresh or cost > s[2] or max_wait < 0 then
      if cost > 0 then
        --: inline earliest(now, cost) -> t
      end
      outcome = verdict(t, now, max_wait)
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
  -- rest: a concatenation would make a second string)
  if note then return spack('<ddddddc0', outcome, now, kind, t, remaining, reset, note) end
  return spack('<dddddd', outcome, now, kind, t, remaining, reset)
end
--: end
