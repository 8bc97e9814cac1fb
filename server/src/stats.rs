//! The statistics envoyproxy/ratelimit keeps, named as it names them: per
//! rule (its stats key, `domain.key_value.key2...`) the counters
//! `total_hits`, `over_limit`, `near_limit`, `within_limit`, `shadow_mode`
//! and `over_limit_with_local_cache`, and a few of the service's own. The
//! service records them through [`Stats`]; the server turns them into
//! Prometheus series under the names of envoyproxy/ratelimit's Prometheus
//! mapping (`src/stats/prom/default_mapper.yaml`): the constants here.

use std::collections::HashMap;
use std::sync::Mutex;

/// One counter of a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Counter {
    /// Hits asked of the rule.
    TotalHits,
    /// Hits over the limit.
    OverLimit,
    /// Hits within the limit past `NEAR_LIMIT_RATIO` of it.
    NearLimit,
    /// Hits within the limit.
    WithinLimit,
    /// Hits over the limit of a rule in shadow mode (let through).
    ShadowMode,
    /// Hits over the limit answered from the local cache of over-limit keys.
    OverLimitWithLocalCache,
}

impl Counter {
    /// Every counter.
    pub const ALL: [Counter; 6] = [
        Counter::TotalHits,
        Counter::OverLimit,
        Counter::NearLimit,
        Counter::WithinLimit,
        Counter::ShadowMode,
        Counter::OverLimitWithLocalCache,
    ];

    /// The last part of its statsd name,
    /// `ratelimit.service.rate_limit.<stats key>.<suffix>`.
    pub const fn suffix(self) -> &'static str {
        match self {
            Counter::TotalHits => "total_hits",
            Counter::OverLimit => "over_limit",
            Counter::NearLimit => "near_limit",
            Counter::WithinLimit => "within_limit",
            Counter::ShadowMode => "shadow_mode",
            Counter::OverLimitWithLocalCache => "over_limit_with_local_cache",
        }
    }

    /// Its Prometheus name: the mapping's, labelled `domain`, `key1` and
    /// (for a stats key of three parts or more) `key2` (see [`labels`]).
    /// `over_limit_with_local_cache` has no mapping there: it is named in
    /// the same way.
    pub const fn prometheus_name(self) -> &'static str {
        match self {
            Counter::TotalHits => TOTAL_HITS,
            Counter::OverLimit => OVER_LIMIT,
            Counter::NearLimit => NEAR_LIMIT,
            Counter::WithinLimit => WITHIN_LIMIT,
            Counter::ShadowMode => SHADOW_MODE,
            Counter::OverLimitWithLocalCache => OVER_LIMIT_WITH_LOCAL_CACHE,
        }
    }
}

/// `ratelimit_service_rate_limit_total_hits`.
pub const TOTAL_HITS: &str = "ratelimit_service_rate_limit_total_hits";
/// `ratelimit_service_rate_limit_over_limit`.
pub const OVER_LIMIT: &str = "ratelimit_service_rate_limit_over_limit";
/// `ratelimit_service_rate_limit_near_limit`.
pub const NEAR_LIMIT: &str = "ratelimit_service_rate_limit_near_limit";
/// `ratelimit_service_rate_limit_within_limit`.
pub const WITHIN_LIMIT: &str = "ratelimit_service_rate_limit_within_limit";
/// `ratelimit_service_rate_limit_shadow_mode`.
pub const SHADOW_MODE: &str = "ratelimit_service_rate_limit_shadow_mode";
/// `ratelimit_service_rate_limit_over_limit_with_local_cache` (no mapping
/// in envoyproxy/ratelimit: named as its siblings).
pub const OVER_LIMIT_WITH_LOCAL_CACHE: &str =
    "ratelimit_service_rate_limit_over_limit_with_local_cache";
/// `ratelimit_service_should_rate_limit_error`, labelled `err_type`
/// (`redis_error`, `service_error`).
pub const SHOULD_RATE_LIMIT_ERROR: &str = "ratelimit_service_should_rate_limit_error";
/// `ratelimit.service.global_shadow_mode` as the statsd exporter names it
/// without a mapping: `ratelimit_service_global_shadow_mode`.
pub const GLOBAL_SHADOW_MODE: &str = "ratelimit_service_global_shadow_mode";
/// `ratelimit.service.rate_limit.<domain>.domain_not_found`, here
/// labelled `domain`.
pub const DOMAIN_NOT_FOUND: &str = "ratelimit_service_rate_limit_domain_not_found";

/// The Prometheus labels of a stats key as the mapping gives them:
/// `domain`, `key1` and, when there is a third part, `key2` (later parts
/// are dropped, as the mapping's regular expression drops them).
pub fn labels(stats_key: &str) -> (&str, &str, Option<&str>) {
    let mut parts = stats_key.splitn(4, '.');
    let domain = parts.next().unwrap_or_default();
    let key1 = parts.next().unwrap_or_default();
    (domain, key1, parts.next())
}

/// A service-wide event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event<'a> {
    /// A request answered `UNAVAILABLE`: the store failed (`redis_error`).
    StoreError,
    /// A request refused as malformed (`service_error`).
    ServiceError,
    /// An `OVER_LIMIT` answered `OK` by the global `SHADOW_MODE`.
    GlobalShadowMode,
    /// A descriptor of a domain the configuration does not have.
    DomainNotFound(&'a str),
}

/// Where the service records its statistics (the server's Prometheus
/// registry, a test's counts). Called on the request path: keep it cheap.
pub trait Stats: Send + Sync + 'static {
    /// Adds `n` to `counter` of the rule whose stats key is `stats_key`.
    fn add(&self, stats_key: &str, counter: Counter, n: u64);
    /// Records a service-wide event.
    fn event(&self, event: Event<'_>);
}

/// Records nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoStats;

impl Stats for NoStats {
    fn add(&self, _: &str, _: Counter, _: u64) {}
    fn event(&self, _: Event<'_>) {}
}

/// Counts in memory, for tests and the debug port: every stats key and
/// counter, unbounded (a stats key per descriptor value is possible with
/// `detailed_metric`): not for a server facing clients.
#[derive(Debug, Default)]
pub struct Counts {
    counts: Mutex<HashMap<(String, Counter), u64>>,
    events: Mutex<HashMap<String, u64>>,
}

impl Counts {
    /// A counter's value (0 when never added to).
    pub fn get(&self, stats_key: &str, counter: Counter) -> u64 {
        let counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        counts
            .get(&(stats_key.to_owned(), counter))
            .copied()
            .unwrap_or(0)
    }

    /// How many times an event was recorded (`DomainNotFound` by domain).
    pub fn events(&self, event: Event<'_>) -> u64 {
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        events.get(&format!("{event:?}")).copied().unwrap_or(0)
    }
}

impl Stats for Counts {
    fn add(&self, stats_key: &str, counter: Counter, n: u64) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        *counts.entry((stats_key.to_owned(), counter)).or_insert(0) += n;
    }

    fn event(&self, event: Event<'_>) {
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        *events.entry(format!("{event:?}")).or_insert(0) += 1;
    }
}

impl<S: Stats> Stats for std::sync::Arc<S> {
    fn add(&self, stats_key: &str, counter: Counter, n: u64) {
        (**self).add(stats_key, counter, n);
    }
    fn event(&self, event: Event<'_>) {
        (**self).event(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_follow_the_mapping() {
        assert_eq!(labels("basic.key1_value1"), ("basic", "key1_value1", None));
        assert_eq!(labels("d.a_b.c_d"), ("d", "a_b", Some("c_d")));
        assert_eq!(labels("d.a.b.c"), ("d", "a", Some("b")));
    }
}
