//! envoyproxy/ratelimit's YAML configuration: domains, nested descriptors,
//! wildcard values and their rate limits, validated as it validates them,
//! plus this server's opt-in extension (the `tower_ratelimit` blocks).
//!
//! The parser builds the YAML tree itself from saphyr-parser's events
//! (`yaml.rs`: scalars resolved as Go's yaml.v2 resolves them, duplicate
//! keys refused), checks and loads it as envoyproxy's `config_impl.go` does
//! (`load.rs`: same order, same messages), and builds each rule's crate
//! limit (`tower.rs`, with the opt-in blocks). [`RateLimitConfig::get_limit`]
//! is envoyproxy's `GetLimit`, with its stats keys and the counter key of
//! its `base_limiter`.

mod load;
mod tower;
mod yaml;

use std::collections::HashMap;
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
    /// Every unit, in proto order.
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Month,
        Unit::Year,
        Unit::Week,
    ];

    /// The unit of a proto number (`UNKNOWN` = 0 and others: `None`).
    pub fn from_proto(n: i32) -> Option<Unit> {
        match n {
            1 => Some(Unit::Second),
            2 => Some(Unit::Minute),
            3 => Some(Unit::Hour),
            4 => Some(Unit::Day),
            5 => Some(Unit::Month),
            6 => Some(Unit::Year),
            7 => Some(Unit::Week),
            _ => None,
        }
    }
    /// The proto number.
    pub fn to_proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }
    /// The unit's length in seconds as envoyproxy/ratelimit divides time by
    /// it (`utils.UnitToDivider`): a month is 30 days and a year 365, so
    /// their windows are aligned to multiples of those from the epoch, not
    /// to calendar months.
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }
    /// The proto enum's name (`SECOND`, ..., as the config dump writes it).
    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "SECOND",
            Unit::Minute => "MINUTE",
            Unit::Hour => "HOUR",
            Unit::Day => "DAY",
            Unit::Month => "MONTH",
            Unit::Year => "YEAR",
            Unit::Week => "WEEK",
        }
    }
    /// The unit a config file names, case-insensitive as envoyproxy reads
    /// it (`minute`, `MINUTE`); `UNKNOWN` and other names: `None`.
    pub fn from_name(name: &str) -> Option<Unit> {
        let upper = name.to_uppercase();
        Unit::ALL.into_iter().find(|u| u.name() == upper)
    }
}

/// The opt-in algorithm of a rate limit (the `tower_ratelimit` block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
    /// `unit` (`None` only when `unlimited`). A rule whose extension gives
    /// a `window` or `calendar` may leave `unit` out; it then reports the
    /// calendar's unit, or the longest unit that fits in the window.
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
    /// The crate's limit for this rule: built once at load, named after
    /// the rule's domain and descriptor path (injectively, in the
    /// characters a limit name allows; see `tower::limit_name`). Default
    /// behaviour: a fixed window of `requests_per_unit` per unit aligned to
    /// the epoch (a month 30 days, a year 365, as envoyproxy divides time);
    /// with an [`Extension`], its quota. `None` when `unlimited`, and when
    /// `requests_per_unit` is 0 (the crate refuses an empty quota): such a
    /// rule is over the limit at every hit, as envoyproxy's
    /// count-after-hit > 0 makes it, and needs no store.
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
    /// The stats key for this request (`full_key`, or with the values added
    /// by `detailed_metric` / `value_to_metric`, or the wildcard patterns
    /// of `share_threshold`): what envoyproxy's `GetLimit` sets the
    /// returned limit's `FullKey` and stats to.
    pub stats_key: String,
    /// The counter key's descriptor part, as envoyproxy/ratelimit builds its
    /// cache key: every entry's `key_value`, joined by `_`
    /// (`key1_value1_subkey1_something`); a `share_threshold` wildcard's
    /// entry has its pattern in place of the value (`files_files/*`), so
    /// all its values count together. envoyproxy's whole Redis key is
    /// `CACHE_KEY_PREFIX + domain + "_" + counter_key + "_" + window start`.
    pub counter_key: String,
    /// Whether the domain opts into the crate's behaviour.
    pub tower: bool,
}

/// The whole configuration: every file of the runtime directory.
#[derive(Debug, Clone, Default)]
pub struct RateLimitConfig {
    domains: HashMap<String, DomainTree>,
    /// Every rule, in the order loaded.
    rules: Vec<Arc<Rule>>,
    /// Each rule's `metadata` (by the rule's `full_key`).
    metadata: HashMap<String, Arc<serde_json::Map<String, serde_json::Value>>>,
}

/// A domain: its settings and its tree of descriptors.
#[derive(Debug, Clone, Default)]
struct DomainTree {
    settings: Domain,
    /// The domain-level block's default algorithm, if it names one.
    default_algorithm: Option<Algorithm>,
    root: Descriptor,
}

/// One level of descriptors (envoyproxy's `rateLimitDescriptor`).
#[derive(Debug, Clone, Default)]
struct Descriptor {
    /// The next level, by `key` or `key_value`.
    children: HashMap<String, Descriptor>,
    /// The wildcard keys among `children`, in the order written, split on
    /// `*` once at load.
    wildcards: Vec<(String, Vec<String>)>,
    rule: Option<Arc<Rule>>,
    value_to_metric: bool,
    share_threshold: bool,
    /// The `key_value*` pattern when `share_threshold` is on.
    wildcard_pattern: String,
}

impl RateLimitConfig {
    /// Loads `(file name, contents)` pairs; `merge_domains` as
    /// `MERGE_DOMAIN_CONFIG` (else a domain in two files is an error).
    pub fn from_files(
        files: &[(String, String)],
        merge_domains: bool,
    ) -> Result<Self, ConfigError> {
        let mut config = RateLimitConfig::default();
        for (name, text) in files {
            load::load_file(&mut config, name, text, merge_domains)?;
        }
        Ok(config)
    }

    /// The rule for one descriptor of `domain` (`entries`: its key/value
    /// pairs in order), as envoyproxy/ratelimit's `GetLimit` finds it
    /// (exact `key_value`, then wildcard prefix, then `key` alone; the
    /// limit only at the descriptor's full depth). `None`: no limit.
    pub fn get_limit(&self, domain: &str, entries: &[(&str, &str)]) -> Option<Matched> {
        let tree = self.domains.get(domain)?;
        let mut level = &tree.root;
        let mut value_key = String::with_capacity(domain.len() + 16 * entries.len());
        value_key.push_str(domain);
        // The wildcard pattern a share_threshold entry counts under, by index.
        let mut shared: Vec<Option<&str>> = vec![None; entries.len()];
        let mut found: Option<&Arc<Rule>> = None;
        let mut key_value = String::new();
        for (i, &(key, value)) in entries.iter().enumerate() {
            key_value.clear();
            key_value.push_str(key);
            key_value.push('_');
            key_value.push_str(value);
            let mut next = level.children.get(&key_value);
            let mut wildcard: Option<&str> = None;
            if next.is_none() {
                if let Some((pattern, _)) = level
                    .wildcards
                    .iter()
                    .find(|(_, parts)| wildcard_match(parts, &key_value))
                {
                    next = level.children.get(pattern);
                    wildcard = Some(pattern);
                }
            }
            let by_value = next.is_some();
            if next.is_none() {
                next = level.children.get(key);
            }
            if let (Some(_), Some(n)) = (wildcard, next) {
                if n.share_threshold && !n.wildcard_pattern.is_empty() {
                    shared[i] = Some(strip_key(&n.wildcard_pattern, key));
                }
            }
            value_key.push('.');
            value_key.push_str(key);
            if let Some(n) = next {
                let shown: &str = match (wildcard, shared[i]) {
                    (Some(_), Some(pattern)) => pattern,
                    (Some(_), None) if n.value_to_metric => value,
                    (Some(pattern), None) => strip_key(pattern, key),
                    (None, _) if by_value || n.value_to_metric => value,
                    (None, _) => "",
                };
                if !shown.is_empty() {
                    value_key.push('_');
                    value_key.push_str(shown);
                }
            }
            let Some(n) = next else { break };
            if i == entries.len() - 1 {
                found = n.rule.as_ref();
            }
            if n.children.is_empty() {
                break;
            }
            level = n;
        }
        let rule = Arc::clone(found?);
        // A rule is found only at the last entry: every entry was looked at.
        let stats_key = if rule.detailed_metric {
            let any_shared = shared.iter().any(Option::is_some);
            let mut key = String::from(domain);
            for (i, &(k, v)) in entries.iter().enumerate() {
                key.push('.');
                key.push_str(k);
                match shared[i] {
                    Some(pattern) => {
                        key.push('_');
                        key.push_str(pattern);
                    }
                    // Without share_threshold anywhere, envoyproxy writes
                    // `key_value` even for an empty value.
                    None if !v.is_empty() || !any_shared => {
                        key.push('_');
                        key.push_str(v);
                    }
                    None => {}
                }
            }
            key
        } else {
            value_key
        };
        let counter_key = entries
            .iter()
            .enumerate()
            .map(|(i, &(k, v))| format!("{k}_{}", shared[i].unwrap_or(v)))
            .collect::<Vec<_>>()
            .join("_");
        Some(Matched {
            rule,
            stats_key,
            counter_key,
            tower: tree.settings.tower,
        })
    }

    /// Whether `domain` exists.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// A domain's settings (`None`: no such domain).
    pub fn domain(&self, domain: &str) -> Option<&Domain> {
        self.domains.get(domain).map(|d| &d.settings)
    }

    /// Whether no domain is loaded (envoyproxy's `IsEmptyDomains`).
    pub fn is_empty(&self) -> bool {
        self.domains.is_empty()
    }

    /// Every rule, for the debug port's config dump and the limits the
    /// engine builds its limiter of.
    pub fn rules(&self) -> Vec<Arc<Rule>> {
        self.rules.clone()
    }

    /// The `metadata` of a rule's descriptor (as JSON; envoyproxy converts
    /// it to a `google.protobuf.Struct` for the response's dynamic
    /// metadata), `None` when it has none.
    pub fn metadata(&self, rule: &Rule) -> Option<&serde_json::Map<String, serde_json::Value>> {
        self.metadata.get(&rule.full_key).map(|m| m.as_ref())
    }

    /// The config dump of the debug port (`/rlconfig`), one line a rule as
    /// envoyproxy/ratelimit writes it:
    /// `{full_key}: unit={UNIT} requests_per_unit={n}, shadow_mode: {b}, quota_mode: {b}`
    /// (in load order; a rule of the opt-in extension adds its quota).
    pub fn dump(&self) -> String {
        let mut out = String::new();
        for rule in &self.rules {
            let unit = rule.unit.map_or("UNKNOWN", Unit::name);
            out.push_str(&format!(
                "{}: unit={} requests_per_unit={}, shadow_mode: {}, quota_mode: {}",
                rule.full_key, unit, rule.requests_per_unit, rule.shadow_mode, rule.quota_mode
            ));
            if rule.extension.is_some() {
                if let Some(limit) = &rule.limit {
                    out.push_str(&format!(", tower_ratelimit: {}", limit.quota()));
                }
            }
            out.push('\n');
        }
        out
    }
}

/// A wildcard pattern without its `key_` (envoyproxy's `TrimPrefix`).
fn strip_key<'p>(pattern: &'p str, key: &str) -> &'p str {
    pattern
        .strip_prefix(key)
        .and_then(|rest| rest.strip_prefix('_'))
        .unwrap_or(pattern)
}

/// Whether `value` matches a wildcard pattern split on `*` (each `*`
/// matches any run of characters, the empty one too), as envoyproxy's
/// `wildcardMatch` decides.
fn wildcard_match(parts: &[String], value: &str) -> bool {
    let [first, middle @ .., last] = parts else {
        return parts.first().is_some_and(|p| p == value);
    };
    if !value.starts_with(first.as_str()) || !value.ends_with(last.as_str()) {
        return false;
    }
    let fixed: usize = parts.iter().map(String::len).sum();
    if value.len() < fixed {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for part in middle {
        match rest.find(part.as_str()) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}
