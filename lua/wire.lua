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
-- Rust side). A blocked limit's status says -1 for its remaining
-- count (`algorithm::wire::BLOCKED`).
local BLOCKED = -1
local algorithms = { sliding_log, token_bucket, gcra, fixed_window, sliding_window }
sliding_log.nkeys = 2
token_bucket.nkeys = 1
gcra.nkeys = 1
fixed_window.nkeys = 1
sliding_window.nkeys = 1
