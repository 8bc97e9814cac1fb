//! Error types: [`ConfigError`] when a limit is built, [`Error`] when a decision fails.

use std::time::Duration;

/// An invalid limit or limiter configuration, reported when it is built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// An amount (limit, capacity, refill, rate or burst) is zero.
    #[error("the {what} of a quota must be at least 1")]
    ZeroAmount {
        /// Which amount was zero.
        what: &'static str,
    },
    /// A window or period is shorter than one microsecond.
    #[error("the {what} of a quota must be at least 1 microsecond")]
    ZeroWindow {
        /// Which duration was zero.
        what: &'static str,
    },
    /// A value is too large for exact integer arithmetic in Redis Lua (below 2^53).
    #[error("the quota is out of range: {0}")]
    OutOfRange(String),
    /// A limit name is empty, longer than 64 bytes, or has characters outside `[A-Za-z0-9_.-]`.
    #[error("invalid limit name {0:?}: use 1 to 64 characters from A-Z, a-z, 0-9, '_', '.', '-'")]
    InvalidName(String),
    /// Two limits of one limiter share a name.
    #[error("two limits are named {0:?}; limit names must be unique within a limiter")]
    DuplicateName(String),
    /// A limiter was built without any limit.
    #[error("a limiter needs at least one limit")]
    NoLimits,
    /// A fixed cost can never be granted because it exceeds a limit's capacity.
    #[error("a cost of {cost} can never be granted: limit {limit:?} holds at most {capacity}")]
    FixedCostExceedsCapacity {
        /// The configured cost.
        cost: u64,
        /// The limit that cannot hold it.
        limit: String,
        /// Its capacity.
        capacity: u64,
    },
    /// The Redis URL or pool configuration was rejected.
    #[error("invalid Redis configuration: {0}")]
    Redis(String),
    /// A key prefix is empty or contains `{`, `}` or whitespace.
    #[error("invalid key prefix {0:?}: use a non-empty string without braces or whitespace")]
    InvalidPrefix(String),
    /// A configuration value of the in-process store is invalid.
    #[error("invalid memory store configuration: {0}")]
    Memory(String),
    /// A configuration value of the HTTP layer is invalid.
    #[error("invalid layer configuration: {0}")]
    Layer(String),
    /// The tiers of a layer's limit are inconsistent: a tier with another
    /// algorithm than its limit, two tiers of one name, tiers without a
    /// way to choose them or the reverse.
    #[error("invalid tiers: {0}")]
    Tiers(String),
    /// A [`LiveLimit`](crate::LiveLimit) or [`LiveLimits`](crate::LiveLimits)
    /// refused a new value: another name, or a set that misses a limit or
    /// has one too many. The current values stay.
    #[error("live limits unchanged: {0}")]
    Live(String),
    /// A stored quota was asked of a limit the limiter does not have, or
    /// that does not use one
    /// ([`Limit::use_stored_quota`](crate::Limit::use_stored_quota)), or
    /// is of another algorithm than the limit.
    #[error("stored quota: {0}")]
    StoredQuota(String),
    /// [`Limiter::acquire_lease`](crate::Limiter::acquire_lease) on a
    /// limiter without a [concurrency limit](crate::Limit::concurrency).
    #[error("no concurrency limit to lease a permit of")]
    NoConcurrencyLimit,
    /// A [maximum hold](crate::Limit::hold_at_most) that is zero, or set on
    /// a limit that is not a concurrency limit.
    #[error("maximum hold: {0}")]
    MaxHold(String),
    /// A [`Penalty`](crate::Penalty) is invalid (no refusals, no blocks, a
    /// zero or too long duration), or a penalty operation
    /// ([`Admin::block`](crate::Admin::block), ...) names a limit
    /// without one.
    #[error("penalty: {0}")]
    Penalty(String),
    /// A [`HotKey`](crate::HotKey) is invalid (no permits, a hold outside
    /// 1 ms to 60 s), or does not fit its limit (a batch over the capacity,
    /// a concurrency limit, a limit with a penalty).
    #[error("hot key: {0}")]
    HotKey(String),
    /// A limit read from a configuration file has a missing, misplaced or
    /// invalid field.
    #[error("limit {limit:?}: `{field}` {problem}")]
    Field {
        /// The limit's name, as written.
        limit: String,
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
}

/// A decision could not be made; the request's fate is the caller's policy.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Redis answered with an error or the connection failed.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    #[error("the Redis store failed: {0}")]
    Redis(#[source] redis::RedisError),
    /// No connection could be taken from the pool.
    #[error("no Redis connection available: {0}")]
    Pool(String),
    /// The store did not answer within the limiter's timeout.
    #[error("the store did not answer within {0:?}")]
    Timeout(Duration),
    /// The store failed several times in a row and is being reconnected in
    /// the background: decisions fail at once, without waiting out the
    /// timeout, until a new connection answers (the circuit is open).
    #[error("the store is unreachable; reconnecting in the background")]
    Unavailable,
    /// The store answered something this crate does not understand.
    #[error("the store gave an unexpected reply: {0}")]
    UnexpectedReply(String),
    /// A `max_wait` longer than [`MAX_WAIT`](crate::MAX_WAIT): nothing is
    /// decided.
    #[error("max_wait {0:?} is longer than a grant may be reserved ahead (1 hour)")]
    WaitTooLong(Duration),
    /// The operation was given an invalid configuration (see
    /// [`Admin::set_stored_quota`](crate::Admin::set_stored_quota)):
    /// nothing was changed.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// A key is empty (`check("")`, one of several keys): nothing is
    /// decided or changed. An empty key would be one bucket shared by every
    /// caller whose key came out empty, and on a Redis Cluster its keys
    /// would not share a slot. The layer treats a request whose key comes
    /// out empty (a [`KeyExtractor`](crate::key::KeyExtractor) or a
    /// `Plan` giving no bytes) as one without a key:
    /// its [`MissingKey`](crate::layer::MissingKey) policy applies.
    #[error("an empty rate-limit key: a key must have at least one byte")]
    EmptyKey,
    /// A [`MemoryStore`](crate::MemoryStore) could not keep a key's new
    /// penalty state (a block by [`Admin::block`](crate::Admin::block)):
    /// penalty states take at most half its
    /// [`max_keys`](crate::MemoryStoreBuilder::max_keys), so that no flood
    /// of them leaves new clients' rate states without room, and they
    /// already do, every one an active block (kept as ban records, 4 to a
    /// state, never dropped). Nothing was changed; counted
    /// under [`PENALTIES_NOT_STORED`](crate::metrics::PENALTIES_NOT_STORED)
    /// (feature `metrics`).
    #[error("penalty states take half the memory store's bound: the penalty state was not stored")]
    PenaltyNotStored,
    /// The number of keys does not match the number of limits.
    #[error("expected {expected} keys (one per limit) or 1, got {got}")]
    KeyCount {
        /// Limits in the limiter.
        expected: usize,
        /// Keys passed.
        got: usize,
    },
}

/// A Redis error, in which a Lua error at a line of the decision library
/// names the line of `lua/` it came from (`lua/gcra.lua:60`).
#[cfg(feature = "redis")]
impl From<redis::RedisError> for Error {
    fn from(e: redis::RedisError) -> Self {
        Error::Redis(lua_source::in_sources(e))
    }
}

/// Where a line of the Redis library came from in `lua/`.
#[cfg(feature = "redis")]
mod lua_source {
    // `LUA_FILES` and `LUA_LINES`: where each line of the library came from
    // in `lua/` (written by `build.rs`).
    include!(concat!(env!("OUT_DIR"), "/library_lines.rs"));

    /// `e` with each line of the library it names (`user_function:N`, a line
    /// of the Function library, whose first line is its `#!lua` one;
    /// `user_script:N`, of the script) named as the line of `lua/` it came
    /// from, `lua/<file>.lua:<line>`: a Lua error names its source. Other
    /// errors are returned as they are.
    pub(super) fn in_sources(e: redis::RedisError) -> redis::RedisError {
        let (Some(code), Some(detail)) = (e.code(), e.detail()) else {
            return e;
        };
        if detail.contains(['\r', '\n']) {
            return e;
        }
        let Some(detail) = source_lines(detail) else {
            return e;
        };
        // the error as Redis would have sent it, of the same kind
        match redis::parse_redis_value(format!("-{code} {detail}\r\n").as_bytes())
            .and_then(redis::Value::extract_error)
        {
            Err(located) => located,
            Ok(_) => e,
        }
    }

    /// `text` with each `user_function:N` and `user_script:N` that names a line
    /// of the library named as its line of `lua/`; `None` when none does.
    fn source_lines(text: &str) -> Option<String> {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        let mut found = false;
        while let Some(k) = rest.find("user_") {
            let (before, after) = rest.split_at(k);
            out.push_str(before);
            // the library's code starts at line 1 of the script, after `#!lua`
            // in the Function
            let (number, first) = if let Some(n) = after.strip_prefix("user_function:") {
                (n, 2)
            } else if let Some(n) = after.strip_prefix("user_script:") {
                (n, 1)
            } else {
                out.push_str("user_");
                rest = &after[5..];
                continue;
            };
            let digits = number.bytes().take_while(u8::is_ascii_digit).count();
            let place = number[..digits]
                .parse::<usize>()
                .ok()
                .and_then(|n| n.checked_sub(first))
                .and_then(|k| LUA_LINES.get(k));
            match place {
                Some(&(file, line)) => {
                    out.push_str(&format!("lua/{}.lua:{line}", LUA_FILES[usize::from(file)]));
                    rest = &number[digits..];
                    found = true;
                }
                None => {
                    out.push_str(&after[..after.len() - number.len()]);
                    rest = number;
                }
            }
        }
        out.push_str(rest);
        found.then_some(out)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// The library's code (see `src/store/redis/script.rs`).
        const CODE: &str = include_str!(concat!(env!("OUT_DIR"), "/library.lua"));

        /// `line` without its indent, each name or number written `x`.
        fn shape(line: &str) -> String {
            let mut out = String::new();
            for c in line.trim().chars() {
                if !(c.is_ascii_alphanumeric() || c == '_') {
                    out.push(c);
                } else if !out.ends_with('x') {
                    out.push('x');
                }
            }
            out
        }

        /// Each line of the library maps to the line of `lua/` it came from:
        /// the same text (names may differ: a template's are filled in, a
        /// fragment's parameters named by a paste's arguments), or the
        /// directive that wrote it.
        #[test]
        fn each_line_of_the_library_names_its_source() {
            assert_eq!(CODE.lines().count(), LUA_LINES.len());
            let sources: Vec<String> = LUA_FILES
                .iter()
                .map(|file| {
                    let path = format!("{}/lua/{file}.lua", env!("CARGO_MANIFEST_DIR"));
                    std::fs::read_to_string(path).expect("read lua/")
                })
                .collect();
            for (k, line) in CODE.lines().enumerate() {
                let (file, n) = LUA_LINES[k];
                let source = sources[usize::from(file)]
                    .lines()
                    .nth(usize::from(n) - 1)
                    .expect("a line of the file");
                let copied = shape(line) == shape(source);
                let written = source.trim_start().starts_with("--:");
                assert!(
                    copied || written,
                    "library line {}: `{line}` from lua/{}.lua:{n}: `{source}`",
                    k + 1,
                    LUA_FILES[usize::from(file)]
                );
            }
        }

        /// A line of the Function library (line 1: `#!lua`) or of the script.
        #[test]
        fn lines_of_the_function_and_the_script_name_the_same_source() {
            let k = CODE
                .lines()
                .position(|l| l.contains("string.byte(args[1], 1) == 111"))
                .expect("the entry point");
            let (file, n) = LUA_LINES[k];
            let expected = format!("lua/{}.lua:{n}", LUA_FILES[usize::from(file)]);
            for (said, to) in [
                (
                    format!("user_function:{}: x", k + 2),
                    format!("{expected}: x"),
                ),
                (
                    format!("on @user_script:{}.", k + 1),
                    format!("on @{expected}."),
                ),
            ] {
                assert_eq!(source_lines(&said).as_deref(), Some(to.as_str()));
            }
            assert_eq!(source_lines("user_function:999999: x"), None);
            assert_eq!(source_lines("no user_ line"), None);
        }
    }
}
