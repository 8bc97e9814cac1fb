//! The wire between the Rust side and the scripts, named once: each
//! algorithm's id (what a limit's string starts with), the Lua table that
//! implements it and the suffixes of the keys it stores under. `lua/wire.lua`
//! is written from these (see [`lua`]); a test fails when it differs.

#[cfg(test)]
use super::Outcome;
use crate::quota::Algorithm;

/// What a blocked limit's status says for `remaining` in a reply (never a
/// count: counts are not negative); see `Limit::penalty`.
pub(crate) const BLOCKED: i64 = -1;

/// The suffix of a penalized limit's penalty key, after its name (see
/// `lua/driver.lua`).
#[cfg_attr(not(any(test, feature = "redis")), allow(dead_code))]
pub(crate) const PENALTY_KEY: &str = "pen";

/// Every algorithm, in the order of their ids (1, 2, ...).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const ALGORITHMS: [Algorithm; 5] = [
    Algorithm::SlidingLog,
    Algorithm::TokenBucket,
    Algorithm::Gcra,
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
];

impl Algorithm {
    /// The id the Lua driver dispatches on: its place in [`ALGORITHMS`],
    /// from 1.
    pub(crate) fn id(self) -> u8 {
        match self {
            Algorithm::SlidingLog => 1,
            Algorithm::TokenBucket => 2,
            Algorithm::Gcra => 3,
            Algorithm::FixedWindow => 4,
            Algorithm::SlidingWindow => 5,
        }
    }

    /// The name of its table in the scripts (and of its files, `lua/` and
    /// `src/algorithm/`).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn lua_name(self) -> &'static str {
        match self {
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
        }
    }

    /// The suffixes of the keys this algorithm stores under, in the order
    /// its script reads them.
    #[cfg_attr(not(any(test, feature = "redis")), allow(dead_code))]
    pub(crate) fn key_parts(self) -> &'static [&'static str] {
        match self {
            Algorithm::SlidingLog => &["log", "meta"],
            Algorithm::TokenBucket => &["tb"],
            Algorithm::Gcra => &["gcra"],
            Algorithm::FixedWindow => &["fw"],
            Algorithm::SlidingWindow => &["sw"],
        }
    }
}

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
        Outcome::Granted as i64,
        Outcome::Denied as i64,
        Outcome::Never as i64,
        Outcome::Granted as i64,
    );
    let _ = write!(
        out,
        "-- A penalized limit's penalty key ends in `:{PENALTY_KEY}` (made on the\n\
         -- Rust side). A blocked limit's status says {BLOCKED} for its remaining\n\
         -- count (`algorithm::wire::BLOCKED`).\n\
         local BLOCKED = {BLOCKED}\n",
    );
    let names: Vec<&str> = ALGORITHMS.iter().map(|a| a.lua_name()).collect();
    let _ = writeln!(out, "local algorithms = {{ {} }}", names.join(", "));
    for algorithm in ALGORITHMS {
        let _ = writeln!(
            out,
            "{}.nkeys = {}",
            algorithm.lua_name(),
            algorithm.key_parts().len()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// `verdict`, the one place the scripts decide an outcome, writes the
    /// codes `Outcome` reads.
    #[test]
    fn lua_verdict_writes_the_outcome_codes() {
        let common = include_str!("../../lua/common.lua");
        for line in [
            format!("if t < 0 then return {}, -1 end", Outcome::Never as i64),
            format!(
                "if wait > max_wait then return {}, wait end",
                Outcome::Denied as i64
            ),
            format!("return {}, wait", Outcome::Granted as i64),
        ] {
            assert!(common.contains(&line), "lua/common.lua lacks `{line}`");
        }
        let grant = format!("outcome == {} and not dry", Outcome::Granted as i64);
        let driver = include_str!("../../lua/driver.lua");
        // the loop over several limits and the one-limit template
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
