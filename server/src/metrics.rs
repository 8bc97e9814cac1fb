//! The server's counters, as envoyproxy/ratelimit counts them
//! (`src/stats/manager_impl.go`), and their two listings: the debug port's
//! `/stats` (statsd names) and Prometheus (the names of envoyproxy/ratelimit's
//! default statsd-exporter mapping, `src/stats/prom/default_mapper.yaml`).
//!
//! The decision logic reports through [`crate::stats::Stats`], which
//! [`Metrics`] implements; the server adds the configuration loads and the
//! gRPC calls' times. Kept in memory, read when scraped.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::stats::{Counter, Event, Stats};

/// A rule's counters.
#[derive(Debug, Default)]
struct RuleCounters {
    total_hits: AtomicU64,
    over_limit: AtomicU64,
    near_limit: AtomicU64,
    over_limit_with_local_cache: AtomicU64,
    within_limit: AtomicU64,
    shadow_mode: AtomicU64,
}

impl RuleCounters {
    fn counter(&self, counter: Counter) -> &AtomicU64 {
        match counter {
            Counter::TotalHits => &self.total_hits,
            Counter::OverLimit => &self.over_limit,
            Counter::NearLimit => &self.near_limit,
            Counter::OverLimitWithLocalCache => &self.over_limit_with_local_cache,
            Counter::WithinLimit => &self.within_limit,
            Counter::ShadowMode => &self.shadow_mode,
        }
    }

    fn read(&self) -> [(&'static str, u64); 6] {
        [
            ("near_limit", self.near_limit.load(Ordering::Relaxed)),
            ("over_limit", self.over_limit.load(Ordering::Relaxed)),
            (
                "over_limit_with_local_cache",
                self.over_limit_with_local_cache.load(Ordering::Relaxed),
            ),
            ("shadow_mode", self.shadow_mode.load(Ordering::Relaxed)),
            ("total_hits", self.total_hits.load(Ordering::Relaxed)),
            ("within_limit", self.within_limit.load(Ordering::Relaxed)),
        ]
    }
}

/// At most this many distinct stats keys get counters of their own
/// (`detailed_metric` puts request values into keys); the hits of further
/// keys are counted under [`OVERFLOW_KEY`].
pub const MAX_KEYS: usize = 10_000;

/// The stats key that counts the hits of keys past [`MAX_KEYS`].
pub const OVERFLOW_KEY: &str = "_overflow.other_keys";

/// The upper bounds of the response time histogram, in seconds
/// (Prometheus' default buckets, as statsd_exporter uses them).
const BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The response times of one gRPC method.
#[derive(Debug, Default)]
struct Timings {
    requests: AtomicU64,
    /// Counts per bucket (not cumulative), then past the last one.
    buckets: [AtomicU64; 12],
    sum_micros: AtomicU64,
}

/// The server's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    rules: RwLock<HashMap<String, Arc<RuleCounters>>>,
    domains_not_found: RwLock<HashMap<String, Arc<AtomicU64>>>,
    store_errors: AtomicU64,
    service_errors: AtomicU64,
    global_shadow_mode: AtomicU64,
    config_load_success: AtomicU64,
    config_load_error: AtomicU64,
    should_rate_limit: Timings,
}

/// envoyproxy/ratelimit's `SanitizeStatName`: `:` and `|` become `_`, and
/// so do the dots of anything shaped like an IPv4 address.
pub fn sanitize_stat_name(name: &str) -> String {
    let replaced: String = name
        .chars()
        .map(|c| if c == ':' || c == '|' { '_' } else { c })
        .collect();
    let bytes = replaced.as_bytes();
    let mut out = String::with_capacity(replaced.len());
    let mut i = 0;
    while i < bytes.len() {
        if let Some(len) = ipv4_at(&bytes[i..]) {
            out.extend(
                replaced[i..i + len]
                    .chars()
                    .map(|c| if c == '.' { '_' } else { c }),
            );
            i += len;
        } else {
            // `replaced` is UTF-8: copy one whole character
            let ch = replaced[i..].chars().next().unwrap_or('_');
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

/// The length of `\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}` at the start of
/// `b` (leftmost-first, each group as long as it can be), if any.
fn ipv4_at(b: &[u8]) -> Option<usize> {
    let mut i = 0;
    for group in 0..4 {
        let start = i;
        while i < b.len() && i - start < 3 && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == start {
            return None;
        }
        if group < 3 {
            if i < b.len() && b[i] == b'.' {
                i += 1;
            } else {
                return None;
            }
        }
    }
    Some(i)
}

impl Metrics {
    /// Empty counters.
    pub fn new() -> Self {
        Self::default()
    }

    fn rule(&self, key: &str) -> Arc<RuleCounters> {
        if let Some(c) = crate::sync::read(&self.rules).get(key) {
            return c.clone();
        }
        let mut rules = crate::sync::write(&self.rules);
        if rules.len() >= MAX_KEYS && !rules.contains_key(key) {
            return rules.entry(OVERFLOW_KEY.to_owned()).or_default().clone();
        }
        rules.entry(key.to_owned()).or_default().clone()
    }

    /// Records one call of a gRPC method (`ShouldRateLimit`) and how long
    /// it took.
    pub fn observe_call(&self, elapsed: Duration) {
        let t = &self.should_rate_limit;
        t.requests.fetch_add(1, Ordering::Relaxed);
        let secs = elapsed.as_secs_f64();
        let bucket = BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(BUCKETS.len());
        t.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        t.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    /// Every counter as `name: value` lines with envoyproxy/ratelimit's
    /// statsd names, sorted (the debug port's `/stats`).
    pub fn statsd_listing(&self) -> String {
        // keys that sanitize alike are one statsd name: their counts add up
        let mut lines: BTreeMap<String, u64> = BTreeMap::new();
        for (key, c) in crate::sync::read(&self.rules).iter() {
            let key = sanitize_stat_name(key);
            for (stat, v) in c.read() {
                *lines
                    .entry(format!("ratelimit.service.rate_limit.{key}.{stat}"))
                    .or_default() += v;
            }
        }
        for (domain, c) in crate::sync::read(&self.domains_not_found).iter() {
            *lines
                .entry(format!(
                    "ratelimit.service.rate_limit.{}.domain_not_found",
                    sanitize_stat_name(domain)
                ))
                .or_default() += c.load(Ordering::Relaxed);
        }
        for (name, v) in [
            (
                "ratelimit.service.call.should_rate_limit.redis_error",
                &self.store_errors,
            ),
            (
                "ratelimit.service.call.should_rate_limit.service_error",
                &self.service_errors,
            ),
            (
                "ratelimit.service.global_shadow_mode",
                &self.global_shadow_mode,
            ),
            (
                "ratelimit.service.config_load_success",
                &self.config_load_success,
            ),
            (
                "ratelimit.service.config_load_error",
                &self.config_load_error,
            ),
            (
                "ratelimit_server.ShouldRateLimit.total_requests",
                &self.should_rate_limit.requests,
            ),
        ] {
            lines.insert(name.to_owned(), v.load(Ordering::Relaxed));
        }
        let mut out = String::new();
        for (name, v) in lines {
            let _ = writeln!(out, "{name}: {v}");
        }
        out
    }

    /// The Prometheus text exposition (format 0.0.4) of the counters under
    /// envoyproxy/ratelimit's default mapping: per rule
    /// `ratelimit_service_rate_limit_{near_limit,over_limit,total_hits,within_limit,shadow_mode}`
    /// labelled `domain`, `key1` and, for keys of two or more levels,
    /// `key2` (and `..._over_limit_with_local_cache`, which the mapping
    /// leaves out, named as its siblings);
    /// `ratelimit_service_should_rate_limit_error{err_type}`,
    /// `ratelimit_service_global_shadow_mode`,
    /// `ratelimit_service_rate_limit_domain_not_found{domain}`,
    /// `ratelimit_service_total_requests{grpc_method}`,
    /// `ratelimit_service_response_time_seconds{grpc_method}` (a histogram;
    /// in milliseconds, without the `_seconds`-scale, when `millis`), and
    /// `ratelimit_service_config_load_{success,error}`.
    pub fn prometheus(&self, millis: bool) -> String {
        // family name -> (labels, value) lines, in a stable order
        let mut families: BTreeMap<&'static str, Vec<(String, u64)>> = BTreeMap::new();
        for (key, c) in crate::sync::read(&self.rules).iter() {
            let Some(labels) = rule_labels(&sanitize_stat_name(key)) else {
                continue;
            };
            for (stat, v) in c.read() {
                let Some(counter) = Counter::ALL.into_iter().find(|c| c.suffix() == stat) else {
                    continue;
                };
                let family = counter.prometheus_name();
                families
                    .entry(family)
                    .or_default()
                    .push((labels.clone(), v));
            }
        }
        let errors = families
            .entry(crate::stats::SHOULD_RATE_LIMIT_ERROR)
            .or_default();
        errors.push((
            "{err_type=\"redis_error\"}".into(),
            self.store_errors.load(Ordering::Relaxed),
        ));
        errors.push((
            "{err_type=\"service_error\"}".into(),
            self.service_errors.load(Ordering::Relaxed),
        ));
        families.insert(
            crate::stats::GLOBAL_SHADOW_MODE,
            vec![(
                String::new(),
                self.global_shadow_mode.load(Ordering::Relaxed),
            )],
        );
        for (domain, c) in crate::sync::read(&self.domains_not_found).iter() {
            families
                .entry(crate::stats::DOMAIN_NOT_FOUND)
                .or_default()
                .push((
                    format!("{{domain=\"{}\"}}", escape(&sanitize_stat_name(domain))),
                    c.load(Ordering::Relaxed),
                ));
        }
        families.insert(
            "ratelimit_service_total_requests",
            vec![(
                "{grpc_method=\"ShouldRateLimit\"}".into(),
                self.should_rate_limit.requests.load(Ordering::Relaxed),
            )],
        );
        families.insert(
            "ratelimit_service_config_load_success",
            vec![(
                String::new(),
                self.config_load_success.load(Ordering::Relaxed),
            )],
        );
        families.insert(
            "ratelimit_service_config_load_error",
            vec![(
                String::new(),
                self.config_load_error.load(Ordering::Relaxed),
            )],
        );

        let mut out = String::new();
        for (family, mut lines) in families {
            // rules whose labels are alike (keys past two levels, keys that
            // sanitize alike) are one series, as the statsd exporter adds
            // their counts into one
            lines.sort();
            lines.dedup_by(|later, kept| {
                let same = later.0 == kept.0;
                if same {
                    kept.1 += later.1;
                }
                same
            });
            let _ = writeln!(
                out,
                "# HELP {family} Metric autogenerated by statsd_exporter."
            );
            let _ = writeln!(out, "# TYPE {family} counter");
            for (labels, v) in lines {
                let _ = writeln!(out, "{family}{labels} {v}");
            }
        }

        let (family, scale) = if millis {
            ("ratelimit_service_response_time", 1000.0)
        } else {
            ("ratelimit_service_response_time_seconds", 1.0)
        };
        let t = &self.should_rate_limit;
        let _ = writeln!(
            out,
            "# HELP {family} Metric autogenerated by statsd_exporter."
        );
        let _ = writeln!(out, "# TYPE {family} histogram");
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += t.buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{family}_bucket{{grpc_method=\"ShouldRateLimit\",le=\"{}\"}} {cumulative}",
                bound * scale
            );
        }
        cumulative += t.buckets[BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "{family}_bucket{{grpc_method=\"ShouldRateLimit\",le=\"+Inf\"}} {cumulative}"
        );
        let sum = t.sum_micros.load(Ordering::Relaxed) as f64 / 1e6 * scale;
        let _ = writeln!(out, "{family}_sum{{grpc_method=\"ShouldRateLimit\"}} {sum}");
        let _ = writeln!(
            out,
            "{family}_count{{grpc_method=\"ShouldRateLimit\"}} {cumulative}"
        );
        out
    }
}

/// The labels the default mapping gives `ratelimit.service.rate_limit.<key>.<stat>`:
/// `domain` and `key1` for a key of two components, `domain`, `key1` and
/// `key2` for three or more; `None` for one (unmapped).
fn rule_labels(key: &str) -> Option<String> {
    let parts: Vec<&str> = key.split('.').collect();
    match parts.as_slice() {
        [domain, key1] => Some(format!(
            "{{domain=\"{}\",key1=\"{}\"}}",
            escape(domain),
            escape(key1)
        )),
        [domain, key1, key2, ..] => Some(format!(
            "{{domain=\"{}\",key1=\"{}\",key2=\"{}\"}}",
            escape(domain),
            escape(key1),
            escape(key2)
        )),
        _ => None,
    }
}

/// A Prometheus label value: backslash, double quote and line feed escaped.
fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

impl Metrics {
    /// A configuration loaded (`true`) or refused (`false`).
    pub fn config_load(&self, ok: bool) {
        if ok {
            &self.config_load_success
        } else {
            &self.config_load_error
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    fn domain_not_found(&self, domain: &str) {
        if let Some(c) = crate::sync::read(&self.domains_not_found).get(domain) {
            c.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut domains = crate::sync::write(&self.domains_not_found);
        let domain = if domains.len() >= MAX_KEYS && !domains.contains_key(domain) {
            "_overflow"
        } else {
            domain
        };
        domains
            .entry(domain.to_owned())
            .or_default()
            .fetch_add(1, Ordering::Relaxed);
    }
}

impl Stats for Metrics {
    fn add(&self, stats_key: &str, counter: Counter, n: u64) {
        if n != 0 {
            self.rule(stats_key)
                .counter(counter)
                .fetch_add(n, Ordering::Relaxed);
        }
    }

    fn event(&self, event: Event<'_>) {
        match event {
            Event::StoreError => {
                self.store_errors.fetch_add(1, Ordering::Relaxed);
            }
            Event::ServiceError => {
                self.service_errors.fetch_add(1, Ordering::Relaxed);
            }
            Event::GlobalShadowMode => {
                self.global_shadow_mode.fetch_add(1, Ordering::Relaxed);
            }
            Event::DomainNotFound(domain) => self.domain_not_found(domain),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sanitizes_as_envoyproxy() {
        assert_eq!(sanitize_stat_name("d.k_v"), "d.k_v");
        assert_eq!(
            sanitize_stat_name("d.remote_address_10.0.0.1"),
            "d.remote_address_10_0_0_1"
        );
        assert_eq!(sanitize_stat_name("d.a:b|c"), "d.a_b_c");
        assert_eq!(sanitize_stat_name("d.v_1.2.3"), "d.v_1.2.3");
    }

    #[test]
    fn prometheus_names_and_labels() {
        let s = Metrics::new();
        s.add("domain1.key1_val1", Counter::TotalHits, 3);
        s.add("domain1.key1_val1", Counter::OverLimit, 1);
        s.add("domain1.key1_val1", Counter::WithinLimit, 2);
        s.add("domain1.key1_val1.key2_val2.key3", Counter::TotalHits, 1);
        s.add("domain1.key1_val1.key2_val2.key4", Counter::TotalHits, 2);
        s.event(Event::DomainNotFound("nowhere"));
        s.event(Event::StoreError);
        s.config_load(true);
        s.observe_call(Duration::from_millis(3));
        let text = s.prometheus(false);
        for line in [
            "ratelimit_service_rate_limit_over_limit{domain=\"domain1\",key1=\"key1_val1\"} 1\n",
            "ratelimit_service_rate_limit_total_hits{domain=\"domain1\",key1=\"key1_val1\",key2=\"key2_val2\"} 3\n",
            "ratelimit_service_config_load_success 1\n",
            "ratelimit_service_should_rate_limit_error{err_type=\"redis_error\"} 1\n",
            "ratelimit_service_rate_limit_domain_not_found{domain=\"nowhere\"} 1\n",
            "ratelimit_service_total_requests{grpc_method=\"ShouldRateLimit\"} 1\n",
            "ratelimit_service_response_time_seconds_bucket{grpc_method=\"ShouldRateLimit\",le=\"0.005\"} 1\n",
            "# TYPE ratelimit_service_rate_limit_over_limit counter\n",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
        let listing = s.statsd_listing();
        assert!(listing.contains("ratelimit.service.rate_limit.domain1.key1_val1.total_hits: 3\n"));
    }

    #[test]
    fn keys_are_bounded() {
        let s = Metrics::new();
        for i in 0..MAX_KEYS + 5 {
            s.add(&format!("d.k_{i}"), Counter::TotalHits, 1);
        }
        assert_eq!(crate::sync::read(&s.rules).len(), MAX_KEYS + 1);
        assert!(s
            .statsd_listing()
            .contains("_overflow.other_keys.total_hits: 5\n"));
    }
}
