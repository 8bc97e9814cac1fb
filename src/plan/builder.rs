//! A [`PlanResolver`]'s builder: its cache, timeout and key bounds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::future::Cache;

use super::failures::FailureLog;
use super::{Cached, Inner, Lookup, PlanResolver, MAX_TIMEOUT};
use crate::key::KeyExtractor;
use crate::ConfigError;

/// Configures a [`PlanResolver`]; made by [`PlanResolver::builder`].
#[must_use]
pub struct PlanResolverBuilder {
    pub(super) lookup_key: Box<dyn KeyExtractor>,
    pub(super) lookup_kind: String,
    pub(super) lookup: Box<Lookup>,
    pub(super) max_entries: u64,
    pub(super) ttl: Duration,
    pub(super) unknown_ttl: Duration,
    pub(super) timeout: Duration,
    pub(super) max_key_len: usize,
    pub(super) on_error: OnLookupError,
    pub(super) log_interval: Duration,
}

/// What a request gets when its plan's lookup fails (the lookup's error)
/// or does not answer within the resolver's
/// [`timeout`](PlanResolverBuilder::timeout): chosen with
/// [`PlanResolverBuilder::on_lookup_error`]. An unknown key (the lookup
/// answered `None`) is not a failure: it has no key, whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnLookupError {
    /// Answer 503 Service Unavailable with this `Retry-After`, as the layer
    /// answers a store failure with
    /// [`OnStoreError::FailClosed`](crate::layer::OnStoreError::FailClosed)
    /// (a custom rejection handler sees
    /// [`Rejection::LookupFailed`](crate::layer::Rejection::LookupFailed)).
    /// The default, with 1 s. A client is never told it is unknown because
    /// the directory is down, and is told to come back.
    FailClosed {
        /// Sent as `Retry-After`, rounded up to whole seconds (at least 1).
        retry_after: Duration,
    },
    /// The request has no key for the resolver's rules, as for an unknown
    /// key: each rule's [`MissingKey`](crate::layer::MissingKey) policy
    /// applies. With `MissingKey::Skip` the rule fails open (the request is
    /// not limited by it); with `MissingKey::Shared` the requests whose
    /// lookup failed share one limit; with the default `Reject`, 400.
    MissingKey,
}

impl Default for OnLookupError {
    fn default() -> Self {
        OnLookupError::FailClosed {
            retry_after: Duration::from_secs(1),
        }
    }
}

impl std::fmt::Debug for PlanResolverBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanResolverBuilder")
            .field("lookup_key", &self.lookup_kind)
            .field("max_entries", &self.max_entries)
            .field("ttl", &self.ttl)
            .field("unknown_ttl", &self.unknown_ttl)
            .field("timeout", &self.timeout)
            .field("max_key_len", &self.max_key_len)
            .field("on_lookup_error", &self.on_error)
            .finish_non_exhaustive()
    }
}

impl PlanResolverBuilder {
    /// The most answers cached at once, plans and unknown keys together
    /// (default 10 000; at least 1). Each holds its lookup key (at most
    /// [`max_key_len`](Self::max_key_len) bytes) and its plan.
    pub fn max_entries(mut self, entries: u64) -> Self {
        self.max_entries = entries;
        self
    }

    /// How long a plan is cached (default 60 s): how long a change of plan
    /// or a revoked key may go unseen, unless
    /// [`invalidate`](PlanResolver::invalidate)d. Zero caches no plan
    /// (concurrent requests still share one lookup).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long a key the lookup answered `None` for is cached as unknown
    /// (default 10 s): how long a new API key may be refused, and at most
    /// one lookup per key per this time for invented keys. Zero caches no
    /// unknown key.
    pub fn unknown_ttl(mut self, ttl: Duration) -> Self {
        self.unknown_ttl = ttl;
        self
    }

    /// The longest a request waits for its plan (default 1 s; more than
    /// zero, at most an hour). A lookup still running then is dropped, and
    /// its requests get the [`on_lookup_error`](Self::on_lookup_error)
    /// policy.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// What a request gets when its lookup fails or times out (default
    /// [`OnLookupError::FailClosed`] with a `Retry-After` of 1 s: 503).
    /// Failures are never cached, whatever the policy.
    pub fn on_lookup_error(mut self, policy: OnLookupError) -> Self {
        self.on_error = policy;
        self
    }

    /// The longest lookup key looked up, in bytes (default 256; at least
    /// 1): a longer one is no key, without a lookup.
    pub fn max_key_len(mut self, bytes: usize) -> Self {
        self.max_key_len = bytes;
        self
    }

    /// The least time between two log lines about failed lookups (default
    /// 10 s); failures in between are counted in the next line.
    pub fn error_log_interval(mut self, interval: Duration) -> Self {
        self.log_interval = interval;
        self
    }

    /// The resolver, or [`ConfigError::Layer`] for no room in the cache, no
    /// timeout or one over an hour, or a zero `max_key_len`.
    pub fn build(self) -> Result<PlanResolver, ConfigError> {
        if self.max_entries == 0 {
            return Err(ConfigError::Layer(
                "a plan resolver's cache needs room for at least 1 entry".to_owned(),
            ));
        }
        if self.timeout.is_zero() || self.timeout > MAX_TIMEOUT {
            return Err(ConfigError::Layer(format!(
                "a plan resolver's timeout must be more than zero and at most {MAX_TIMEOUT:?}, not {:?}",
                self.timeout
            )));
        }
        if self.max_key_len == 0 {
            return Err(ConfigError::Layer(
                "a plan resolver's max_key_len must be at least 1".to_owned(),
            ));
        }
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        let cache = Cache::builder()
            .max_capacity(self.max_entries)
            .expire_after(Ttls {
                plan: self.ttl,
                unknown: self.unknown_ttl,
            })
            .build();
        Ok(PlanResolver(Arc::new(Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            lookup_key: self.lookup_key,
            lookup_kind: self.lookup_kind,
            lookup: self.lookup,
            cache,
            timeout: self.timeout,
            max_key_len: self.max_key_len,
            on_error: self.on_error,
            failures: FailureLog::new(self.log_interval),
        })))
    }
}

/// How long each kind of answer stays cached.
struct Ttls {
    plan: Duration,
    unknown: Duration,
}

impl moka::Expiry<Vec<u8>, Cached> for Ttls {
    fn expire_after_create(&self, _: &Vec<u8>, value: &Cached, _: Instant) -> Option<Duration> {
        Some(match value {
            Some(_) => self.plan,
            None => self.unknown,
        })
    }
}
