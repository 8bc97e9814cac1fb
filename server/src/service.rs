//! The decision engine of the rate limit service: `ShouldRateLimit` as
//! envoyproxy/ratelimit answers it (`src/service/ratelimit.go`,
//! `src/limiter/base_limiter.go`, `src/redis/fixed_cache_impl.go`), decided
//! by tower-ratelimit's [`Limiter::decide_set`] in one store call per
//! request, usable without a network ([`Service::should_rate_limit`]).
//!
//! Two behaviours, chosen by the domain ([`Matched::tower`]):
//! - envoyproxy-compatible (the default): each descriptor counted on its
//!   own, its hits counted even over the limit ([`SetMode::EachCounted`];
//!   with `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`, [`SetMode::EachSparing`],
//!   its rule), `OVER_LIMIT` when the count after the hit exceeds
//!   `requests_per_unit`, over-limit keys kept in a local cache of
//!   `LOCAL_CACHE_SIZE_IN_BYTES`;
//! - the crate's (opt-in per domain): the descriptors decided all or
//!   nothing ([`SetMode::AllOrNothing`]), a denial taking nothing, any
//!   algorithm the rule's limit has; the local cache is the crate's cache
//!   of denials.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prost_types::value::Kind;
use prost_types::{ListValue, Value};
use tokio::sync::watch;
use tower_ratelimit::{Decision, Limit, Limiter, Quota, SetItem, SetMode, Store};

use crate::config::{Matched, RateLimitConfig, Unit};
use crate::proto::rate_limit_response::rate_limit;
use crate::proto::rate_limit_response::{Code, DescriptorStatus, RateLimit};
use crate::proto::{self, HeaderValue, RateLimitDescriptor, RateLimitRequest, RateLimitResponse};
use crate::stats::{Counter, Event, Stats};

/// envoyproxy/ratelimit's message for a request without a domain.
pub const EMPTY_DOMAIN: &str = "rate limit domain must not be empty";
/// envoyproxy/ratelimit's message for a request without descriptors.
pub const NO_DESCRIPTORS: &str = "rate limit descriptor list must not be empty";
/// The message of a descriptor's `limit` override without a valid unit.
pub const BAD_OVERRIDE_UNIT: &str =
    "rate limit override unit must be SECOND, MINUTE, HOUR, DAY, WEEK, MONTH or YEAR";

/// The name of every limit built from a request's override: one name for
/// all of them, so that overrides (sent by clients, any number of distinct
/// ones) grow no registry of names.
pub const OVERRIDE_LIMIT_NAME: &str = "override";

/// The most distinct overrides kept built (by requests per unit and unit);
/// past it the set is emptied and built again as requests come.
const OVERRIDES_KEPT: usize = 1024;

/// The headers of `LIMIT_RESPONSE_HEADERS_ENABLED`, by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHeaders {
    /// `LIMIT_LIMIT_HEADER` (default `RateLimit-Limit`).
    pub limit: String,
    /// `LIMIT_REMAINING_HEADER` (default `RateLimit-Remaining`).
    pub remaining: String,
    /// `LIMIT_RESET_HEADER` (default `RateLimit-Reset`).
    pub reset: String,
}

impl Default for ResponseHeaders {
    fn default() -> Self {
        Self {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }
}

/// The settings the service decides with (envoyproxy/ratelimit's
/// environment variables of the same meaning).
#[derive(Debug, Clone)]
pub struct Options {
    /// `SHADOW_MODE`: every `OVER_LIMIT` answered `OK` (counted, stats
    /// kept).
    pub shadow_mode: bool,
    /// `QUOTA_MODE`: every rule in quota mode.
    pub quota_mode: bool,
    /// `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`.
    pub stop_increment_when_over_limit: bool,
    /// `NEAR_LIMIT_RATIO` (default 0.8).
    pub near_limit_ratio: f32,
    /// `LOCAL_CACHE_SIZE_IN_BYTES` (0: no local cache).
    pub local_cache_size_in_bytes: usize,
    /// `CACHE_KEY_PREFIX`: put before every counter key.
    pub cache_key_prefix: String,
    /// `LIMIT_RESPONSE_HEADERS_ENABLED` with the headers' names.
    pub response_headers: Option<ResponseHeaders>,
    /// `RESPONSE_DYNAMIC_METADATA`.
    pub dynamic_metadata: bool,
    /// The bound on one store call (a call that takes longer is answered
    /// `UNAVAILABLE`).
    pub store_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            shadow_mode: false,
            quota_mode: false,
            stop_increment_when_over_limit: false,
            near_limit_ratio: 0.8,
            local_cache_size_in_bytes: 0,
            cache_key_prefix: String::new(),
            response_headers: None,
            dynamic_metadata: false,
            store_timeout: tower_ratelimit::DEFAULT_TIMEOUT,
        }
    }
}

/// Why a request was not decided.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    /// A malformed request (`INVALID_ARGUMENT`), with envoyproxy/ratelimit's
    /// message where it has one.
    #[error("{0}")]
    InvalidArgument(&'static str),
    /// The store failed or timed out (`UNAVAILABLE`: Envoy applies its
    /// failure mode).
    #[error("rate limit store unavailable")]
    Unavailable,
}

impl From<ServiceError> for tonic::Status {
    fn from(error: ServiceError) -> Self {
        match error {
            ServiceError::InvalidArgument(message) => tonic::Status::invalid_argument(message),
            ServiceError::Unavailable => tonic::Status::unavailable(error.to_string()),
        }
    }
}

/// Where the service reads its configuration: a `watch` channel the
/// configuration loader sends each new configuration on (live reload).
pub type ConfigSource = watch::Receiver<Arc<RateLimitConfig>>;

/// The rate limit service's logic: `ShouldRateLimit` over a store and a
/// live configuration. Cheap to share (`Arc`).
pub struct Service {
    limiter: Limiter,
    config: ConfigSource,
    options: Options,
    stats: Arc<dyn Stats>,
    local: Option<LocalCache>,
    overrides: Mutex<HashMap<(u32, Unit), Limit>>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("limiter", &self.limiter)
            .field("options", &self.options)
            .finish()
    }
}

/// What one descriptor is decided under.
enum Slot {
    /// No rule (none matched, the domain is unknown, or replaced).
    Free,
    /// An `unlimited` rule.
    Unlimited,
    /// A rule with a limit.
    Limited(Box<Rule>),
}

/// A descriptor's rule, as the service decides with it.
struct Rule {
    stats_key: String,
    requests_per_unit: u32,
    unit: Unit,
    name: Option<String>,
    shadow: bool,
    quota: bool,
    /// `None`: a limit of 0 requests, over at once.
    limit: Option<Limit>,
    key: Vec<u8>,
    /// The configuration's rule (none for an override): its metadata.
    source: Option<Arc<crate::config::Rule>>,
}

/// A descriptor's outcome.
struct Outcome {
    over: bool,
    remaining: u64,
    reset: Duration,
    from_local_cache: bool,
}

impl Service {
    /// A service over `store` (memory, or a Redis store built by the
    /// caller), reading its configuration from `config`, recording its
    /// statistics in `stats`.
    pub fn new(
        store: impl Into<Store>,
        config: ConfigSource,
        options: Options,
        stats: Arc<dyn Stats>,
    ) -> Result<Self, tower_ratelimit::ConfigError> {
        let limiter = Limiter::builder(store)
            .timeout(options.store_timeout)
            // the crate's mode: its cache of denials is the local cache
            .cache_denials(options.local_cache_size_in_bytes > 0)
            .build_for_sets()?;
        let local = (options.local_cache_size_in_bytes > 0)
            .then(|| LocalCache::new(options.local_cache_size_in_bytes));
        Ok(Self {
            limiter,
            config,
            options,
            stats,
            local,
            overrides: Mutex::new(HashMap::new()),
        })
    }

    /// The options it decides with.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Answers one `ShouldRateLimit`.
    pub async fn should_rate_limit(
        &self,
        request: RateLimitRequest,
    ) -> Result<RateLimitResponse, ServiceError> {
        if request.domain.is_empty() {
            self.stats.event(Event::ServiceError);
            return Err(ServiceError::InvalidArgument(EMPTY_DOMAIN));
        }
        if request.descriptors.is_empty() {
            self.stats.event(Event::ServiceError);
            return Err(ServiceError::InvalidArgument(NO_DESCRIPTORS));
        }
        let config = Arc::clone(&self.config.borrow());
        let domain = request.domain.as_str();
        let hits: Vec<u64> = request
            .descriptors
            .iter()
            .map(|d| {
                d.hits_addend
                    .unwrap_or_else(|| u64::from(request.hits_addend.max(1)))
            })
            .collect();

        // the rule of each descriptor, then `replaces` applied
        let mut slots = Vec::with_capacity(request.descriptors.len());
        let mut replacing: HashSet<String> = HashSet::new();
        let mut tower = false;
        for descriptor in &request.descriptors {
            let slot = self.slot_of(&config, domain, descriptor, &mut replacing, &mut tower)?;
            slots.push(slot);
        }
        if !replacing.is_empty() {
            for slot in &mut slots {
                if let Slot::Limited(rule) = slot {
                    if rule.name.as_ref().is_some_and(|n| replacing.contains(n)) {
                        *slot = Slot::Free;
                    }
                }
            }
        }
        for (slot, &hits) in slots.iter().zip(&hits) {
            if let Slot::Limited(rule) = slot {
                self.stats.add(&rule.stats_key, Counter::TotalHits, hits);
            }
        }

        let outcomes = self
            .decide(&request.descriptors, &slots, &hits, tower)
            .await?;

        Ok(self.respond(&config, &request, &slots, &hits, outcomes))
    }

    /// The rule of one descriptor: the request's override (in a known
    /// domain), else the configuration's.
    fn slot_of(
        &self,
        config: &RateLimitConfig,
        domain: &str,
        descriptor: &RateLimitDescriptor,
        replacing: &mut HashSet<String>,
        tower: &mut bool,
    ) -> Result<Slot, ServiceError> {
        if !config.has_domain(domain) {
            self.stats.event(Event::DomainNotFound(domain));
            return Ok(Slot::Free);
        }
        if let Some(limit) = descriptor.limit {
            let unit = Unit::from_proto(limit.unit)
                .ok_or(ServiceError::InvalidArgument(BAD_OVERRIDE_UNIT))?;
            let rule = Rule {
                stats_key: descriptor_stats_key(domain, descriptor),
                requests_per_unit: limit.requests_per_unit,
                unit,
                name: None,
                shadow: false,
                quota: false,
                limit: self.override_limit(limit.requests_per_unit, unit),
                key: self.counter_key(domain, &override_counter_key(descriptor)),
                source: None,
            };
            return Ok(Slot::Limited(Box::new(rule)));
        }
        let entries: Vec<(&str, &str)> = descriptor
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect();
        let Some(matched) = config.get_limit(domain, &entries) else {
            return Ok(Slot::Free);
        };
        let Matched {
            rule,
            stats_key,
            counter_key,
            tower: in_tower,
        } = matched;
        *tower |= in_tower || config.domain(domain).is_some_and(|d| d.tower);
        replacing.extend(rule.replaces.iter().cloned());
        if rule.unlimited {
            return Ok(Slot::Unlimited);
        }
        let Some(unit) = rule.unit else {
            return Ok(Slot::Free);
        };
        Ok(Slot::Limited(Box::new(Rule {
            stats_key,
            requests_per_unit: rule.requests_per_unit,
            unit,
            name: rule.name.clone(),
            shadow: rule.shadow_mode,
            quota: rule.quota_mode,
            limit: rule.limit.clone().filter(|_| rule.requests_per_unit > 0),
            key: self.counter_key(domain, &counter_key),
            source: Some(rule),
        })))
    }

    /// The counter key of a descriptor: `CACHE_KEY_PREFIX`, the domain and
    /// the descriptor's part, as envoyproxy/ratelimit builds it (without
    /// its window's start: the store keeps that with the count).
    fn counter_key(&self, domain: &str, descriptor_part: &str) -> Vec<u8> {
        let prefix = &self.options.cache_key_prefix;
        let mut key = Vec::with_capacity(prefix.len() + domain.len() + descriptor_part.len() + 1);
        key.extend_from_slice(prefix.as_bytes());
        key.extend_from_slice(domain.as_bytes());
        key.push(b'_');
        key.extend_from_slice(descriptor_part.as_bytes());
        key
    }

    /// The limit of an override: a fixed window of `requests_per_unit` per
    /// `unit`, aligned to the epoch, named [`OVERRIDE_LIMIT_NAME`]; `None`
    /// for 0 requests (over at once). Built once per distinct override, at
    /// most [`OVERRIDES_KEPT`] kept.
    fn override_limit(&self, requests_per_unit: u32, unit: Unit) -> Option<Limit> {
        if requests_per_unit == 0 {
            return None;
        }
        let mut kept = self.overrides.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(limit) = kept.get(&(requests_per_unit, unit)) {
            return Some(limit.clone());
        }
        let quota = Quota::rate(
            u64::from(requests_per_unit),
            Duration::from_secs(unit.seconds()),
        )
        .fixed_window();
        let limit = Limit::new(OVERRIDE_LIMIT_NAME, quota).ok()?;
        if kept.len() >= OVERRIDES_KEPT {
            kept.clear();
        }
        kept.insert((requests_per_unit, unit), limit.clone());
        Some(limit)
    }

    /// Decides the limited descriptors in one store call (two in the
    /// crate's mode when some rules are in shadow mode: those are counted
    /// on their own, never refusing the others).
    async fn decide(
        &self,
        descriptors: &[RateLimitDescriptor],
        slots: &[Slot],
        hits: &[u64],
        tower: bool,
    ) -> Result<Vec<Option<Outcome>>, ServiceError> {
        let mut outcomes: Vec<Option<Outcome>> = slots.iter().map(|_| None).collect();
        // the local cache of over-limit keys (envoyproxy's mode)
        let mut any_cached = false;
        if let (Some(local), false) = (&self.local, tower) {
            let now = Instant::now();
            for (i, slot) in slots.iter().enumerate() {
                if let Slot::Limited(rule) = slot {
                    if let Some(reset) = local.over(&rule.key, now) {
                        any_cached = true;
                        outcomes[i] = Some(Outcome {
                            over: true,
                            remaining: 0,
                            reset,
                            from_local_cache: true,
                        });
                    }
                }
            }
        }
        let stop = self.options.stop_increment_when_over_limit;
        let mut enforced: Vec<(usize, SetItem<'_>)> = Vec::new();
        let mut apart: Vec<(usize, SetItem<'_>)> = Vec::new();
        for (i, slot) in slots.iter().enumerate() {
            let Slot::Limited(rule) = slot else { continue };
            if outcomes[i].is_some() {
                continue;
            }
            let Some(limit) = &rule.limit else {
                // 0 requests per unit: over at once
                outcomes[i] = Some(Outcome {
                    over: true,
                    remaining: 0,
                    reset: window_left(rule.unit),
                    from_local_cache: false,
                });
                continue;
            };
            // (sparing: a key over in the local cache spares every other)
            let cost = if stop && any_cached { 0 } else { hits[i] };
            let item = SetItem {
                limit,
                key: &rule.key,
                cost,
                refund: descriptors.get(i).is_some_and(|d| d.is_negative_hits),
            };
            if tower && rule.shadow {
                apart.push((i, item));
            } else {
                enforced.push((i, item));
            }
        }
        let mode = match (tower, stop) {
            (true, _) => SetMode::AllOrNothing,
            (false, false) => SetMode::EachCounted,
            (false, true) => SetMode::EachSparing,
        };
        for (items, mode) in [(&enforced, mode), (&apart, SetMode::EachCounted)] {
            if items.is_empty() {
                continue;
            }
            let set: Vec<SetItem<'_>> = items.iter().map(|(_, item)| *item).collect();
            let decision = match self.limiter.decide_set(&set, mode).await {
                Ok(decision) => decision,
                Err(error) => {
                    tracing::warn!(%error, "the rate limit store failed: answering UNAVAILABLE");
                    self.stats.event(Event::StoreError);
                    return Err(ServiceError::Unavailable);
                }
            };
            self.read(&decision, items, slots, &mut outcomes, tower);
        }
        Ok(outcomes)
    }

    /// Each item's outcome from `decision`; an over-limit key noted in the
    /// local cache.
    fn read(
        &self,
        decision: &Decision,
        items: &[(usize, SetItem<'_>)],
        slots: &[Slot],
        outcomes: &mut [Option<Outcome>],
        tower: bool,
    ) {
        for ((i, _), status) in items.iter().zip(decision.statuses()) {
            let over = status.is_violated();
            let mut reset = status.reset_after();
            if reset.is_zero() {
                if let Some(Slot::Limited(rule)) = slots.get(*i) {
                    reset = window_left(rule.unit);
                }
            }
            if let (true, false, Some(local), Some(Slot::Limited(rule))) =
                (over, tower, &self.local, slots.get(*i))
            {
                local.insert(&rule.key, reset);
            }
            if let Some(slot) = outcomes.get_mut(*i) {
                *slot = Some(Outcome {
                    over,
                    remaining: status.remaining(),
                    reset,
                    from_local_cache: false,
                });
            }
        }
    }

    /// The response: statuses, stats, overall code, headers, metadata.
    fn respond(
        &self,
        config: &RateLimitConfig,
        request: &RateLimitRequest,
        slots: &[Slot],
        hits: &[u64],
        outcomes: Vec<Option<Outcome>>,
    ) -> RateLimitResponse {
        let mut statuses = Vec::with_capacity(slots.len());
        let mut passed = Vec::new();
        let (mut failed_rate, mut failed_quota, mut total_quota) = (0, 0, 0);
        // the descriptor closest to its limit, for the headers
        let mut closest: Option<usize> = None;
        let mut least = u32::MAX;
        for (i, (slot, outcome)) in slots.iter().zip(outcomes).enumerate() {
            let status = match (slot, outcome) {
                (Slot::Unlimited, _) => DescriptorStatus {
                    code: Code::Ok as i32,
                    limit_remaining: u32::MAX,
                    ..Default::default()
                },
                (Slot::Limited(rule), Some(outcome)) => {
                    self.count(rule, hits[i], &outcome);
                    let over = outcome.over && !rule.shadow;
                    DescriptorStatus {
                        code: if over { Code::OverLimit } else { Code::Ok } as i32,
                        current_limit: Some(RateLimit {
                            requests_per_unit: rule.requests_per_unit,
                            unit: rule.unit.to_proto(),
                            name: rule.name.clone().unwrap_or_default(),
                        }),
                        limit_remaining: if outcome.over {
                            0
                        } else {
                            u32::try_from(outcome.remaining).unwrap_or(u32::MAX)
                        },
                        duration_until_reset: Some(whole_seconds(outcome.reset)),
                        quota: None,
                    }
                }
                (Slot::Free | Slot::Limited(_), _) => DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                },
            };
            if self.options.response_headers.is_some()
                && status.current_limit.is_some()
                && status.limit_remaining < least
            {
                closest = Some(i);
                least = status.limit_remaining;
            }
            if !matches!(slot, Slot::Unlimited) {
                let quota_mode =
                    self.options.quota_mode || matches!(slot, Slot::Limited(r) if r.quota);
                if status.code == Code::OverLimit as i32 {
                    if quota_mode {
                        failed_quota += 1;
                    } else {
                        failed_rate += 1;
                        closest = Some(i);
                        least = 0;
                    }
                } else {
                    passed.push(i);
                }
                if quota_mode {
                    total_quota += 1;
                }
            }
            statuses.push(status);
        }
        let mut overall = if failed_rate > 0 || (total_quota > 0 && total_quota == failed_quota) {
            Code::OverLimit
        } else {
            Code::Ok
        };
        let mut response = RateLimitResponse::default();
        if let (Some(names), Some(status)) = (
            &self.options.response_headers,
            closest.and_then(|i| statuses.get(i)),
        ) {
            response.response_headers_to_add = headers(names, status);
        }
        if overall == Code::OverLimit && self.options.shadow_mode {
            overall = Code::Ok;
            self.stats.event(Event::GlobalShadowMode);
        }
        if self.options.dynamic_metadata {
            let mut found = serde_json::Map::new();
            for i in passed {
                if let Some(Slot::Limited(limited)) = slots.get(i) {
                    let meta = limited.source.as_ref().and_then(|r| config.metadata(r));
                    if let Some(meta) = meta {
                        merge(&mut found, meta);
                    }
                }
            }
            response.dynamic_metadata = Some(metadata(request, found));
        }
        response.overall_code = overall as i32;
        response.statuses = statuses;
        response
    }

    /// The stats of one decided descriptor, as envoyproxy/ratelimit counts
    /// them (`GetResponseDescriptorStatus`): the hits of an over-limit
    /// descriptor all count as over the limit (envoyproxy/ratelimit counts
    /// only those past the limit when a request of several hits crosses
    /// it, from a count this service does not read back).
    fn count(&self, rule: &Rule, hits: u64, outcome: &Outcome) {
        let key = rule.stats_key.as_str();
        if outcome.over {
            self.stats.add(key, Counter::OverLimit, hits);
            if outcome.from_local_cache {
                self.stats.add(key, Counter::OverLimitWithLocalCache, hits);
            }
            if rule.shadow {
                self.stats.add(key, Counter::ShadowMode, hits);
            }
            return;
        }
        let limit = u64::from(rule.requests_per_unit);
        let after = limit.saturating_sub(outcome.remaining);
        let before = after.saturating_sub(hits);
        // (as envoyproxy/ratelimit: the ratio as a float32 product, floored)
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let near = ((limit as f32) * self.options.near_limit_ratio).floor() as u64;
        if after > near {
            let n = if before >= near { hits } else { after - near };
            self.stats.add(key, Counter::NearLimit, n);
        }
        self.stats.add(key, Counter::WithinLimit, hits);
    }
}

impl proto::RateLimitService for Service {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        Service::should_rate_limit(self, request.into_inner())
            .await
            .map(tonic::Response::new)
            .map_err(tonic::Status::from)
    }
}

/// envoyproxy/ratelimit's stats key of a descriptor with an override
/// (`descriptorKey`): the domain, then each entry's `key_value` (or `key`
/// alone for an empty value), joined by dots.
fn descriptor_stats_key(domain: &str, descriptor: &RateLimitDescriptor) -> String {
    let mut key = String::from(domain);
    key.push('.');
    for (i, entry) in descriptor.entries.iter().enumerate() {
        if i > 0 {
            key.push('.');
        }
        key.push_str(&entry.key);
        if !entry.value.is_empty() {
            key.push('_');
            key.push_str(&entry.value);
        }
    }
    key
}

/// The counter key's descriptor part of an override: each entry's
/// `key_value`, joined by `_` (as envoyproxy/ratelimit's cache key).
fn override_counter_key(descriptor: &RateLimitDescriptor) -> String {
    let mut key = String::new();
    for (i, entry) in descriptor.entries.iter().enumerate() {
        if i > 0 {
            key.push('_');
        }
        key.push_str(&entry.key);
        key.push('_');
        key.push_str(&entry.value);
    }
    key
}

/// What is left of the current window of `unit`, aligned to the epoch, by
/// the system clock (envoyproxy/ratelimit's `CalculateReset`): for a limit
/// the store did not report a reset for (nothing counted yet, or a limit
/// of 0).
fn window_left(unit: Unit) -> Duration {
    let window = unit.seconds().max(1);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let into = Duration::from_secs(now.as_secs() % window)
        + Duration::from_nanos(u64::from(now.subsec_nanos()));
    Duration::from_secs(window).saturating_sub(into)
}

/// A reset as Envoy reads it: whole seconds, rounded up (a client told to
/// come back never comes back early).
fn whole_seconds(reset: Duration) -> prost_types::Duration {
    let secs = reset.as_secs() + u64::from(reset.subsec_nanos() > 0);
    prost_types::Duration {
        seconds: i64::try_from(secs).unwrap_or(i64::MAX),
        nanos: 0,
    }
}

/// The three headers of `LIMIT_RESPONSE_HEADERS_ENABLED` for `status`.
fn headers(names: &ResponseHeaders, status: &DescriptorStatus) -> Vec<HeaderValue> {
    let limit = status
        .current_limit
        .as_ref()
        .map_or(0, |l| l.requests_per_unit);
    let reset = status
        .duration_until_reset
        .as_ref()
        .map_or(0, |d| d.seconds);
    let header = |key: &str, value: String| HeaderValue {
        key: key.to_owned(),
        value,
        raw_value: Vec::new(),
    };
    vec![
        header(&names.limit, limit.to_string()),
        header(&names.remaining, status.limit_remaining.to_string()),
        header(&names.reset, reset.to_string()),
    ]
}

/// `RESPONSE_DYNAMIC_METADATA`: the request as envoyproxy/ratelimit
/// describes it (`domain`, `descriptors` with their `entries` as
/// `key=value`, `limit` and `hitsAddend`, and the request's `hitsAddend`).
fn metadata(
    request: &RateLimitRequest,
    found: serde_json::Map<String, serde_json::Value>,
) -> prost_types::Struct {
    let string = |s: String| Value {
        kind: Some(Kind::StringValue(s)),
    };
    #[allow(clippy::cast_precision_loss)]
    let number = |n: u64| Value {
        kind: Some(Kind::NumberValue(n as f64)),
    };
    let list = |values: Vec<Value>| Value {
        kind: Some(Kind::ListValue(ListValue { values })),
    };
    let mut fields = BTreeMap::new();
    fields.insert("domain".to_owned(), string(request.domain.clone()));
    let descriptors = request
        .descriptors
        .iter()
        .map(|d| {
            let mut f = BTreeMap::new();
            let entries = d
                .entries
                .iter()
                .map(|e| string(format!("{}={}", e.key, e.value)))
                .collect();
            f.insert("entries".to_owned(), list(entries));
            if let Some(limit) = d.limit {
                let unit = rate_limit::Unit::try_from(limit.unit)
                    .map_or_else(|_| limit.unit.to_string(), |u| u.as_str_name().to_owned());
                let text = format!("requests_per_unit:{} unit:{unit}", limit.requests_per_unit);
                f.insert("limit".to_owned(), string(text));
            }
            if let Some(hits) = d.hits_addend {
                f.insert("hitsAddend".to_owned(), number(hits));
            }
            Value {
                kind: Some(Kind::StructValue(prost_types::Struct { fields: f })),
            }
        })
        .collect();
    fields.insert("descriptors".to_owned(), list(descriptors));
    if request.hits_addend != 0 {
        fields.insert(
            "hitsAddend".to_owned(),
            number(u64::from(request.hits_addend)),
        );
    }
    if !found.is_empty() {
        fields.insert(
            "metadata".to_owned(),
            json_value(serde_json::Value::Object(found)),
        );
    }
    prost_types::Struct { fields }
}

/// Merges `from` into `into` as envoyproxy/ratelimit merges the metadata
/// of the passed descriptors' rules: a key already there keeps its value,
/// but two objects under one key are merged the same way.
fn merge(
    into: &mut serde_json::Map<String, serde_json::Value>,
    from: &serde_json::Map<String, serde_json::Value>,
) {
    for (key, value) in from {
        match (into.get_mut(key), value) {
            (Some(serde_json::Value::Object(have)), serde_json::Value::Object(more)) => {
                merge(have, more)
            }
            (Some(_), _) => {}
            (None, _) => {
                into.insert(key.clone(), value.clone());
            }
        }
    }
}

/// A JSON value as a `google.protobuf.Value`.
fn json_value(value: serde_json::Value) -> Value {
    let kind = match value {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s),
        serde_json::Value::Array(items) => Kind::ListValue(ListValue {
            values: items.into_iter().map(json_value).collect(),
        }),
        serde_json::Value::Object(map) => Kind::StructValue(prost_types::Struct {
            fields: map.into_iter().map(|(k, v)| (k, json_value(v))).collect(),
        }),
    };
    Value { kind: Some(kind) }
}

/// envoyproxy/ratelimit's local cache of over-limit keys
/// (`LOCAL_CACHE_SIZE_IN_BYTES`): a key found over its limit is answered
/// over without a store call until its window ends. Bounded by the bytes
/// given (each entry counted as its key and 64 bytes): when full, expired
/// entries are dropped, and a key that still does not fit is not kept.
struct LocalCache {
    budget: usize,
    inner: Mutex<(HashMap<Vec<u8>, Instant>, usize)>,
}

impl LocalCache {
    const ENTRY: usize = 64;

    fn new(budget: usize) -> Self {
        Self {
            budget,
            inner: Mutex::new((HashMap::new(), 0)),
        }
    }

    /// The time left until `key`'s window ends, when it is over.
    fn over(&self, key: &[u8], now: Instant) -> Option<Duration> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let until = *inner.0.get(key)?;
        (until > now).then(|| until - now)
    }

    fn insert(&self, key: &[u8], for_: Duration) {
        let now = Instant::now();
        let Some(until) = now.checked_add(for_) else {
            return;
        };
        let size = key.len() + Self::ENTRY;
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (map, used) = &mut *inner;
        if *used + size > self.budget {
            map.retain(|k, until| {
                let keep = *until > now;
                if !keep {
                    *used -= k.len() + Self::ENTRY;
                }
                keep
            });
        }
        if let Some(old) = map.get_mut(key) {
            *old = until;
            return;
        }
        if *used + size <= self.budget {
            map.insert(key.to_vec(), until);
            *used += size;
        }
    }
}
