//! The wire between the Rust side and the scripts, named once: the
//! options, operations and statuses here, the algorithms (each one's id,
//! Lua table and key suffixes) in their registry (`registry.rs`).
//! `lua/wire.lua` is written from both (see [`lua`]); a test fails when it
//! differs.

#[cfg(test)]
use super::{VerdictCode, ALGORITHMS};

/// What a call of the library does: the `op` option (slot
/// [`Opt::Op`]); a call without options decides.
#[cfg_attr(not(any(test, feature = "redis")), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Give back the grants made at store time [`Opt::At`].
    Refund = 1,
    /// Take what is available, at most the cost.
    Take = 2,
    /// Change a kept quota (`HSET`, `HSETNX` or `HDEL` on its hash): the
    /// store's `quotas`.
    Quotas = 3,
    /// Charge each cost, whatever is left.
    Charge = 4,
    /// Move the grants made at store time [`Opt::At`] to now.
    Renew = 5,
    /// Read or change a key's penalty state ([`PENALTY_CODES`] in slot
    /// [`Opt::At`]).
    Penalty = 6,
    /// Several decisions in one call.
    Batch = 7,
    /// The fleet's heartbeat: register an instance, count the instances
    /// (`lua/fleet.lua`).
    Fleet = 8,
    /// A set of limits, keys and costs decided in one call by the mode in
    /// slot [`Opt::At`] ([`EACH_MODES`]); a negative cost is a refund.
    Each = 9,
}

impl Op {
    /// Every operation, for `lua/wire.lua`.
    #[cfg(test)]
    const ALL: [Op; 9] = [
        Op::Refund,
        Op::Take,
        Op::Quotas,
        Op::Charge,
        Op::Renew,
        Op::Penalty,
        Op::Batch,
        Op::Fleet,
        Op::Each,
    ];

    /// Its name in the scripts, after `OP_`.
    #[cfg(test)]
    fn lua_name(self) -> &'static str {
        match self {
            Op::Refund => "REFUND",
            Op::Take => "TAKE",
            Op::Quotas => "QUOTAS",
            Op::Charge => "CHARGE",
            Op::Renew => "RENEW",
            Op::Penalty => "PENALTY",
            Op::Batch => "BATCH",
            Op::Fleet => "FLEET",
            Op::Each => "EACH",
        }
    }
}

/// The slots of a call's options, `o:<slot 1>:<slot 2>:...` (the scripts
/// index them from 1); a slot not written reads as absent, and the options
/// travel only when one differs from 0.
#[cfg_attr(not(any(test, feature = "redis")), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Opt {
    /// The decision's clock (us since the epoch); 0: Redis `TIME`.
    Now = 1,
    /// A grant may be reserved this far ahead (us).
    MaxWait = 2,
    /// 1: decide, grant nothing (a peek).
    Dry = 3,
    /// How long (us) keys outlive their state.
    Slack = 4,
    /// The operation ([`Op`]); absent or 0: decide.
    Op = 5,
    /// The time of the grant (a refund, a renewal: `now + wait` of its
    /// reply), or for a penalty what to do ([`PENALTY_CODES`]).
    At = 6,
    /// For a penalty's block: its length (us).
    Block = 7,
}

impl Opt {
    /// Every slot, in order.
    #[cfg_attr(not(any(test, feature = "redis")), allow(dead_code))]
    const ALL: [Opt; 7] = [
        Opt::Now,
        Opt::MaxWait,
        Opt::Dry,
        Opt::Slack,
        Opt::Op,
        Opt::At,
        Opt::Block,
    ];

    /// Its name in the scripts, after `OPT_`.
    #[cfg(test)]
    fn lua_name(self) -> &'static str {
        match self {
            Opt::Now => "NOW",
            Opt::MaxWait => "MAX_WAIT",
            Opt::Dry => "DRY",
            Opt::Slack => "SLACK",
            Opt::Op => "OP",
            Opt::At => "AT",
            Opt::Block => "BLOCK",
        }
    }
}

/// What a penalty call ([`Op::Penalty`]) does, in slot [`Opt::At`]: read
/// the state, block for [`Opt::Block`] us, or unblock (delete the state);
/// the codes of the store's `Penalty::{Read, Block, Unblock}`.
#[cfg_attr(not(any(test, feature = "redis")), allow(dead_code))]
pub(crate) const PENALTY_CODES: [(&str, i64); 3] = [("READ", 0), ("BLOCK", 1), ("UNBLOCK", 2)];

/// How a set ([`Op::Each`]) is decided, in slot [`Opt::At`]: each limit
/// counted whatever is left, each counted unless another is over (then
/// only those over are counted), or all granted together or none; the
/// codes of `SetMode::{EachCounted, EachSparing, AllOrNothing}`.
#[cfg(test)]
pub(crate) const EACH_MODES: [(&str, i64); 3] = [("COUNTED", 0), ("SPARING", 1), ("ALL", 2)];

/// A call's options as the scripts read them: `o` and each slot up to the
/// last one set.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Options {
    slots: [i64; Opt::ALL.len()],
    len: usize,
}

#[cfg_attr(not(feature = "redis"), allow(dead_code))]
impl Options {
    /// Options with `value` in `slot`.
    pub(crate) fn with(mut self, slot: Opt, value: i64) -> Self {
        let i = slot as usize - 1;
        self.slots[i] = value;
        self.len = self.len.max(i + 1);
        self
    }

    /// Options of the operation `op`.
    pub(crate) fn op(op: Op) -> Self {
        Self::default().with(Opt::Op, op as i64)
    }

    /// Appends `o:<slot 1>:...` to `out`.
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        let mut digits = itoa::Buffer::new();
        out.push(b'o');
        for value in &self.slots[..self.len] {
            out.push(b':');
            out.extend_from_slice(digits.format(*value).as_bytes());
        }
    }
}

/// What one limit's status in a decision's reply says it is (its first
/// field; see [`Status`](super::Status)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StatusKind {
    /// Decided by its quota: then its wait, remaining and reset.
    Allows = 0,
    /// Its cost exceeds its capacity: never allowed; then 0, remaining
    /// and reset.
    Never = 1,
    /// Blocked by its penalty: then the time left of the block, 0, and
    /// the time left again.
    Blocked = 2,
}

impl StatusKind {
    /// Every kind, for `lua/wire.lua`.
    #[cfg(test)]
    const ALL: [StatusKind; 3] = [StatusKind::Allows, StatusKind::Never, StatusKind::Blocked];

    /// The kind the scripts write as `code`.
    pub(crate) fn from_code(code: i64) -> Option<Self> {
        match code {
            0 => Some(StatusKind::Allows),
            1 => Some(StatusKind::Never),
            2 => Some(StatusKind::Blocked),
            _ => None,
        }
    }

    /// Its name in the scripts, after `LIMIT_`.
    #[cfg(test)]
    fn lua_name(self) -> &'static str {
        match self {
            StatusKind::Allows => "ALLOWS",
            StatusKind::Never => "NEVER",
            StatusKind::Blocked => "BLOCKED",
        }
    }
}

/// The doubles of one limit's status in a reply: its kind, wait,
/// remaining and reset.
pub(crate) const STATUS_FIELDS: usize = 4;

/// The suffix of a penalized limit's penalty key, after its name (see
/// `lua/driver.lua`).
#[cfg_attr(not(any(test, feature = "redis")), allow(dead_code))]
pub(crate) const PENALTY_KEY: &str = "pen";

/// The text of `lua/wire.lua`.
#[cfg(test)]
pub(crate) fn lua() -> String {
    use std::fmt::Write;

    let mut out = String::from(
        "-- wire.lua: what the scripts share with the Rust side, written from\n\
         -- src/algorithm/wire.rs: do not edit (the test that compares the two\n\
         -- writes this file again when run with WRITE_WIRE=1).\n\
         --\n\
         -- The algorithms by the id a limit's string starts with, and the keys\n\
         -- each stores, in the order it reads them:\n",
    );
    for algorithm in ALGORITHMS {
        let _ = writeln!(
            out,
            "--   {} {}: {}",
            algorithm.id(),
            algorithm.lua_name(),
            algorithm.key_parts().join(", ")
        );
    }
    let _ = write!(
        out,
        "-- A decision's reply starts with its outcome (`algorithm::Outcome`): {}\n\
         -- granted, {} denied, {} never (a cost over a capacity). `verdict` in\n\
         -- common.lua decides it and the driver tests `outcome == {}`: as\n\
         -- literals (a literal is an operand, an upvalue must be loaded first).\n",
        VerdictCode::Granted as i64,
        VerdictCode::Denied as i64,
        VerdictCode::Never as i64,
        VerdictCode::Granted as i64,
    );
    let _ = writeln!(
        out,
        "-- A penalized limit's penalty key ends in `:{PENALTY_KEY}` (made on the\n\
         -- Rust side).\n\
         -- A call's options, `o:<slot 1>:<slot 2>:...` (`wire::Opt`), by slot:"
    );
    let slots: Vec<String> = Opt::ALL
        .iter()
        .map(|o| format!("OPT_{}", o.lua_name()))
        .collect();
    let values: Vec<String> = Opt::ALL.iter().map(|o| (*o as i64).to_string()).collect();
    let _ = writeln!(out, "local {} = {}", slots.join(", "), values.join(", "));
    let _ = writeln!(
        out,
        "-- The operations, in slot OPT_OP (`wire::Op`; absent or 0: decide):"
    );
    let ops: Vec<String> = Op::ALL
        .iter()
        .map(|o| format!("OP_{}", o.lua_name()))
        .collect();
    let values: Vec<String> = Op::ALL.iter().map(|o| (*o as i64).to_string()).collect();
    let _ = writeln!(out, "local {} = {}", ops.join(", "), values.join(", "));
    let _ = writeln!(
        out,
        "-- What a penalty call (OP_PENALTY) does, in slot OPT_AT (`wire::PENALTY_CODES`):\n\
         local {} = {}",
        PENALTY_CODES
            .map(|(name, _)| format!("PEN_{name}"))
            .join(", "),
        PENALTY_CODES.map(|(_, code)| code.to_string()).join(", "),
    );
    let _ = writeln!(
        out,
        "-- How a set (OP_EACH) is decided, in slot OPT_AT (`wire::EACH_MODES`):\n\
         local {} = {}",
        EACH_MODES
            .map(|(name, _)| format!("EACH_{name}"))
            .join(", "),
        EACH_MODES.map(|(_, code)| code.to_string()).join(", "),
    );
    let _ = writeln!(
        out,
        "-- A decision's reply: its outcome and clock, then each limit's status,\n\
         -- {STATUS_FIELDS} doubles: its kind (`wire::StatusKind`), then its wait (us),\n\
         -- remaining and reset (us) (see driver.lua). build.rs\n\
         -- pastes these into the one-limit template as literals (it is expanded\n\
         -- in the algorithms' files, before this one):"
    );
    let kinds: Vec<String> = StatusKind::ALL
        .iter()
        .map(|k| format!("LIMIT_{}", k.lua_name()))
        .collect();
    let values: Vec<String> = StatusKind::ALL
        .iter()
        .map(|k| (*k as i64).to_string())
        .collect();
    let _ = writeln!(out, "local {} = {}", kinds.join(", "), values.join(", "));
    let names: Vec<&str> = ALGORITHMS.iter().map(|a| a.lua_name()).collect();
    let _ = writeln!(out, "local algorithms = {{ {} }}", names.join(", "));
    for algorithm in ALGORITHMS {
        let _ = writeln!(
            out,
            "{0}.nkeys, {0}.shape = {1}, \"{2}\"",
            algorithm.lua_name(),
            algorithm.key_parts().len(),
            algorithm.shape()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_set_modes_codes_are_the_stores() {
        use crate::algorithm::EachMode;
        let modes = [EachMode::Counted, EachMode::Sparing, EachMode::All];
        assert_eq!(EACH_MODES.map(|(_, code)| code), modes.map(|m| m as i64));
    }

    #[test]
    fn ids_are_places_in_the_list() {
        for (i, algorithm) in ALGORITHMS.iter().enumerate() {
            assert_eq!(usize::from(algorithm.id()), i + 1);
        }
    }

    /// `lua/wire.lua` is what [`lua`] writes; `WRITE_WIRE=1` writes it.
    #[test]
    fn lua_wire_is_written_from_rust() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/lua/wire.lua");
        let expected = lua();
        if std::env::var_os("WRITE_WIRE").is_some() {
            std::fs::write(path, &expected).expect("write lua/wire.lua");
        }
        let found = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            found == expected,
            "lua/wire.lua differs from src/algorithm/wire.rs (run the test \
             with WRITE_WIRE=1 to write it):\n{expected}"
        );
    }

    /// `verdict`, the one place the scripts decide a decision's verdict,
    /// writes the codes `VerdictCode` reads.
    #[test]
    fn lua_verdict_writes_the_verdict_codes() {
        let common = include_str!("../../lua/common.lua");
        for line in [
            format!("if t < 0 then return {}, -1 end", VerdictCode::Never as i64),
            format!(
                "if wait > max_wait then return {}, wait end",
                VerdictCode::Denied as i64
            ),
            format!("return {}, wait", VerdictCode::Granted as i64),
        ] {
            assert!(common.contains(&line), "lua/common.lua lacks `{line}`");
        }
        let grant = format!("outcome == {} and not dry", VerdictCode::Granted as i64);
        // the loop over several limits and the one-limit template
        let driver = [
            include_str!("../../lua/driver.lua"),
            include_str!("../../lua/limits.lua"),
            include_str!("../../lua/one.lua"),
        ]
        .concat();
        assert_eq!(
            driver.matches(&grant).count(),
            2,
            "lua/driver.lua tests a grant otherwise"
        );
        for (name, code) in [
            ("gcra", include_str!("../../lua/gcra.lua")),
            ("token_bucket", include_str!("../../lua/token_bucket.lua")),
            ("fixed_window", include_str!("../../lua/fixed_window.lua")),
            (
                "sliding_window",
                include_str!("../../lua/sliding_window.lua"),
            ),
            ("sliding_log", include_str!("../../lua/sliding_log.lua")),
        ] {
            assert!(
                !code.contains("outcome"),
                "lua/{name}.lua decides an outcome: only the driver does"
            );
        }
    }
}
