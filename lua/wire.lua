-- wire.lua: what the scripts share with the Rust side, written from
-- src/algorithm/wire.rs: do not edit (the test that compares the two
-- writes this file again when run with WRITE_WIRE=1).
--
-- The algorithms by the id a limit's string starts with, and the keys
-- each stores, in the order it reads them:
--   1 sliding_log: log, meta
--   2 token_bucket: tb
--   3 gcra: gcra
--   4 fixed_window: fw
--   5 sliding_window: sw
-- A decision's reply starts with its outcome (`algorithm::Outcome`): 0
-- granted, 1 denied, 2 never (a cost over a capacity). `verdict` in
-- common.lua decides it and the driver tests `outcome == 0`: as
-- literals (a literal is an operand, an upvalue must be loaded first).
-- A penalized limit's penalty key ends in `:pen` (made on the
-- Rust side).
-- A call's options, `o:<slot 1>:<slot 2>:...` (`wire::Opt`), by slot:
local OPT_NOW, OPT_MAX_WAIT, OPT_DRY, OPT_SLACK, OPT_OP, OPT_AT, OPT_BLOCK = 1, 2, 3, 4, 5, 6, 7
-- The operations, in slot OPT_OP (`wire::Op`; absent or 0: decide):
local OP_REFUND, OP_TAKE, OP_QUOTAS, OP_CHARGE, OP_RENEW, OP_PENALTY, OP_BATCH, OP_FLEET, OP_EACH = 1, 2, 3, 4, 5, 6, 7, 8, 9
-- What a penalty call (OP_PENALTY) does, in slot OPT_AT (`wire::PENALTY_CODES`):
local PEN_READ, PEN_BLOCK, PEN_UNBLOCK = 0, 1, 2
-- How a set (OP_EACH) is decided, in slot OPT_AT (`wire::EACH_MODES`):
local EACH_COUNTED, EACH_SPARING, EACH_ALL = 0, 1, 2
-- A decision's reply: its outcome and clock, then each limit's status,
-- 4 doubles: its kind (`wire::StatusKind`), then its wait (us),
-- remaining and reset (us) (see driver.lua). build.rs
-- pastes these into the one-limit template as literals (it is expanded
-- in the algorithms' files, before this one):
local LIMIT_ALLOWS, LIMIT_NEVER, LIMIT_BLOCKED = 0, 1, 2
local algorithms = { sliding_log, token_bucket, gcra, fixed_window, sliding_window }
sliding_log.nkeys, sliding_log.shape = 2, "window"
token_bucket.nkeys, token_bucket.shape = 1, "bucket"
gcra.nkeys, gcra.shape = 1, "bucket"
fixed_window.nkeys, fixed_window.shape = 1, "window"
sliding_window.nkeys, sliding_window.shape = 1, "weighted"
