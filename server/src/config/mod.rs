//! envoyproxy/ratelimit's YAML configuration: domains, nested descriptors,
//! wildcard values and their rate limits, validated as it validates them,
//! plus this server's opt-in extension (the `tower_ratelimit` blocks).
//!
//! INTERFACE STUB (written before the parser): the `srv-config` branch
//! implements it; the `srv-engine` branch codes against it. Names and
//! signatures below may grow but not change without telling the other side.

use std::sync::Arc;
use std::time::Duration;

/// A configuration error, displayed as envoyproxy/ratelimit displays it:
/// `"{file}: {message}"` (the file's name as loaded, then its message, for
/// example `basic.yaml: config error, unknown key 'foo'`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file the error is in (its name as given to the loader).
    pub file: String,
    /// envoyproxy/ratelimit's message, word for word where it has one.
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.file, self.message)
    }
}

impl std::error::Error for ConfigError {}

/// A time unit of envoyproxy/ratelimit (`RateLimitResponse.RateLimit.Unit`,
/// numbered as in the proto).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// 1 s (proto 1).
    Second,
    /// 60 s (proto 2).
    Minute,
    /// 3,600 s (proto 3).
    Hour,
    /// 86,400 s (proto 4).
    Day,
    /// 30 days in envoyproxy/ratelimit's window arithmetic (proto 5).
    Month,
    /// 365 days in envoyproxy/ratelimit's window arithmetic (proto 6).
    Year,
    /// 7 days (proto 7, WEEK).
    Week,
}

impl Unit {
    /// The unit of a proto number (`UNKNOWN` = 0 and others: `None`).
    pub fn from_proto(n: i32) -> Option<Unit> {
        let _ = n;
        todo!("srv-config")
    }
    /// The proto number.
    pub fn to_proto(self) -> i32 {
        todo!("srv-config")
    }
    /// The unit's length in seconds as envoyproxy/ratelimit divides time by
    /// it (`utils.UnitToDivider`).
    pub fn seconds(self) -> u64 {
        todo!("srv-config")
    }
}

/// The opt-in algorithm of a rate limit (the `tower_ratelimit` block).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Algorithm {
    /// Fixed window aligned to the epoch (the default; envoyproxy's own).
    FixedWindow,
    /// Sliding window counter.
    SlidingWindow,
    /// Exact sliding log.
    SlidingLog,
    /// Token bucket.
    TokenBucket,
    /// GCRA.
    Gcra,
}

/// What a rate limit's `tower_ratelimit` block asks for beyond
/// envoyproxy/ratelimit. Only allowed in a domain that turns the crate's
/// behaviour on ([`Domain::tower`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extension {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// A burst above the rate (token bucket, GCRA), if given.
    pub burst: Option<u64>,
    /// A window of any length (`"90s"`, `"15m"`), replacing the unit's.
    pub window: Option<Duration>,
    /// A calendar period (`day`, `week`, `month`, `year`) with a UTC offset
    /// in seconds, replacing the unit's window.
    pub calendar: Option<(tower_ratelimit::Period, i64)>,
}

/// One rate limit of the configuration (or of a request's override).
#[derive(Debug, Clone)]
pub struct Rule {
    /// The stats key: `domain.key_value.key2` as envoyproxy/ratelimit
    /// builds it (the Prometheus label / statsd name of the rule).
    pub full_key: String,
    /// `requests_per_unit`.
    pub requests_per_unit: u32,
    /// `unit` (`None` only when `unlimited`).
    pub unit: Option<Unit>,
    /// `unlimited: true`: never over the limit, nothing counted.
    pub unlimited: bool,
    /// `shadow_mode` of the descriptor: counted and reported, never refusing.
    pub shadow_mode: bool,
    /// `quota_mode` of the descriptor.
    pub quota_mode: bool,
    /// `name` of the rate limit (for `replaces`), if any.
    pub name: Option<String>,
    /// The names this rule replaces.
    pub replaces: Vec<String>,
    /// `detailed_metric`.
    pub detailed_metric: bool,
    /// `value_to_metric`.
    pub value_to_metric: bool,
    /// `share_threshold`.
    pub share_threshold: bool,
    /// The opt-in extension, if any.
    pub extension: Option<Extension>,
    /// The crate's limit for this rule (`None` when `unlimited`): built
    /// once at load, named after `full_key`. Default behaviour: a fixed
    /// window of `requests_per_unit` per unit aligned to the epoch.
    pub limit: Option<tower_ratelimit::Limit>,
}

/// A domain's settings.
#[derive(Debug, Clone, Default)]
pub struct Domain {
    /// Whether the domain opts into the crate's behaviour (the domain-level
    /// `tower_ratelimit` block): descriptors decided all or nothing in one
    /// store call, denials that take nothing, per-rule extensions allowed.
    pub tower: bool,
}

/// The rule a descriptor matched, with what the request's key is built from.
#[derive(Debug, Clone)]
pub struct Matched {
    /// The rule.
    pub rule: Arc<Rule>,
    /// The stats key for this request (`full_key`, or with the value added
    /// by `detailed_metric` / `value_to_metric`).
    pub stats_key: String,
    /// The counter key's descriptor part, as envoyproxy/ratelimit builds its
    /// cache key (`key_value` pairs joined by `_`; a `share_threshold`
    /// wildcard keeps its pattern, not the value).
    pub counter_key: String,
    /// Whether the domain opts into the crate's behaviour.
    pub tower: bool,
}

/// The whole configuration: every file of the runtime directory.
#[derive(Debug, Clone, Default)]
pub struct RateLimitConfig {
    _private: (),
}

impl RateLimitConfig {
    /// Loads `(file name, contents)` pairs; `merge_domains` as
    /// `MERGE_DOMAIN_CONFIG` (else a domain in two files is an error).
    pub fn from_files(
        files: &[(String, String)],
        merge_domains: bool,
    ) -> Result<Self, ConfigError> {
        let _ = (files, merge_domains);
        todo!("srv-config")
    }

    /// The rule for one descriptor of `domain` (`entries`: its key/value
    /// pairs in order), as envoyproxy/ratelimit's `GetLimit` finds it
    /// (exact `key_value`, then wildcard prefix, then `key` alone; the
    /// limit only at the descriptor's full depth). `None`: no limit.
    pub fn get_limit(&self, domain: &str, entries: &[(&str, &str)]) -> Option<Matched> {
        let _ = (domain, entries);
        todo!("srv-config")
    }

    /// Whether `domain` exists.
    pub fn has_domain(&self, domain: &str) -> bool {
        let _ = domain;
        todo!("srv-config")
    }

    /// Every rule, for the debug port's config dump and the limits the
    /// engine builds its limiter of.
    pub fn rules(&self) -> Vec<Arc<Rule>> {
        todo!("srv-config")
    }

    /// The config dump of the debug port (`/rlconfig`), one line a rule as
    /// envoyproxy/ratelimit writes it.
    pub fn dump(&self) -> String {
        todo!("srv-config")
    }
}
