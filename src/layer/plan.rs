//! Plans from an async lookup (feature `resolver`): a [`PlanResolver`]
//! gives a [`Rule`] the key its requests count under and their tier from an
//! answer looked up per client (an API key to its tenant and plan, in a
//! database or from another service), cached.
//!
//! How it joins the layer: for a layer with a resolved rule, the response
//! future first asks each such rule's resolver for the request's plan (the
//! cache, or the lookup), and puts the answers among the request's
//! extensions (a private type, taken out again before the request goes on).
//! The rule's key extractor and tier choice then read them there, so the
//! rest of the layer (exemptions, the missing-key policy, tiers) applies to
//! a resolved rule as to any other.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use http::request::Parts;
use moka::future::Cache;
use smallvec::SmallVec;

use super::rule::Rule;
use super::Config;
use crate::key::{KeyBuf, KeyExtractor};
use crate::ConfigError;

const DEFAULT_MAX_ENTRIES: u64 = 10_000;
const DEFAULT_TTL: Duration = Duration::from_secs(60);
const DEFAULT_UNKNOWN_TTL: Duration = Duration::from_secs(10);
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
const DEFAULT_MAX_KEY_LEN: usize = 256;
const DEFAULT_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// The longest lookup timeout a resolver accepts.
const MAX_TIMEOUT: Duration = Duration::from_secs(60 * 60);

/// What a lookup answers for a known client: the key its requests count
/// under, and their tier.
///
/// The key is what the limit counts per: a tenant id makes every API key
/// of the tenant share one limit. The tier is a name given to
/// [`Rule::tier`], or none for the rule's own limit; a name the rule has no
/// tier for counts under the default tier too (logged once at `warn`), as
/// with [`Rule::choose_tier`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    key: Box<[u8]>,
    tier: Option<Box<str>>,
}

impl Plan {
    /// Requests count under `key`, in the default tier.
    pub fn new(key: impl Into<Vec<u8>>) -> Self {
        Self {
            key: key.into().into_boxed_slice(),
            tier: None,
        }
    }

    /// Requests count in the tier named `tier`.
    pub fn with_tier(mut self, tier: impl Into<String>) -> Self {
        self.tier = Some(tier.into().into_boxed_str());
        self
    }

    /// The key requests count under.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The tier's name; `None` for the default tier.
    pub fn tier(&self) -> Option<&str> {
        self.tier.as_deref()
    }
}

type BoxError = Box<dyn StdError + Send + Sync>;
type Answer = Result<Option<Plan>, BoxError>;
type Lookup = dyn Fn(Vec<u8>) -> Pin<Box<dyn Future<Output = Answer> + Send>> + Send + Sync;
/// A cached answer: the plan, or `None` for a lookup key that belongs to
/// no client (cached too).
type Cached = Option<Arc<Plan>>;

/// Looks a request's [`Plan`] up asynchronously, from a key of the request
/// (such as its API key), and caches the answers: a [`Rule`] made with
/// [`Rule::resolved`] counts requests under the plan's key, in the plan's
/// tier. Feature `resolver`.
///
/// Built with [`builder`](Self::builder) from the extractor of the lookup
/// key and the lookup: an async function of the lookup key's bytes that
/// answers `Ok(Some(plan))` for a known client, `Ok(None)` for a key that
/// belongs to none, or an error.
///
/// A request has no key for the rule (and gets the rule's [`MissingKey`]
/// policy, the layer's or its own, exactly as a request without a key) when:
///
/// - it has no lookup key, or an empty one;
/// - its lookup key is longer than [`max_key_len`](PlanResolverBuilder::max_key_len)
///   bytes (256 by default): never looked up, never cached;
/// - the lookup answers `None` (an unknown API key);
/// - the lookup fails, or does not answer within the
///   [`timeout`](PlanResolverBuilder::timeout) (1 s by default; the lookup's
///   future is dropped then).
///
/// Answers are cached, per lookup key, in a cache of at most
/// [`max_entries`](PlanResolverBuilder::max_entries) (10 000 by default):
/// plans for [`ttl`](PlanResolverBuilder::ttl) (60 s by default), unknown
/// keys for [`unknown_ttl`](PlanResolverBuilder::unknown_ttl) (10 s by
/// default), so that a flood of one invented key costs one lookup per
/// `unknown_ttl`. Failures are not cached: the next request for the key
/// looks it up again. Concurrent requests for a key that is not cached wait
/// for one lookup, never more than the timeout. A client inventing keys
/// costs one lookup per key and cannot grow the cache beyond its bound;
/// entries are evicted by moka's TinyLFU policy, which keeps the keys in
/// frequent use over keys seen once. To bound the lookups themselves, limit
/// per client IP in a layer outside this one (a layer's limits are chosen
/// together, so its per-IP limit does not stop its own lookups).
///
/// Failures are logged (target `tower_ratelimit`) at `warn`, at most one
/// line per [`error_log_interval`](PlanResolverBuilder::error_log_interval)
/// (10 s by default), with the number of requests they left without a key;
/// lookup keys are never logged. With the `metrics` feature, the counter
/// [`PLAN_LOOKUPS`](crate::metrics::PLAN_LOOKUPS) counts lookups by result.
///
/// A clone shares the cache: rules made with clones of one resolver (a
/// per-minute and a per-day limit per tenant) look each key up once.
///
/// [`MissingKey`]: super::MissingKey
///
/// ```
/// use std::collections::HashMap;
/// use std::sync::Arc;
/// use std::time::Duration;
///
/// use axum::{body::Body, routing::get, Router};
/// use http::{HeaderName, Request, StatusCode};
/// use tower::ServiceExt;
/// use tower_ratelimit::key::Header;
/// use tower_ratelimit::layer::{Plan, PlanResolver, RateLimitLayer, Rule};
/// use tower_ratelimit::{Limit, Quota};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// // API key -> (tenant, plan): a database in production.
/// let clients = Arc::new(HashMap::from([
///     ("key-a1", ("acme", None)),
///     ("key-a2", ("acme", None)),
///     ("key-b", ("globex", Some("pro"))),
/// ]));
/// let plans = PlanResolver::builder(Header::new(HeaderName::from_static("x-api-key")), move |api_key| {
///     let clients = clients.clone();
///     async move {
///         let client = std::str::from_utf8(&api_key).ok().and_then(|k| clients.get(k));
///         Ok::<_, std::io::Error>(client.map(|&(tenant, tier)| match tier {
///             Some(tier) => Plan::new(tenant).with_tier(tier),
///             None => Plan::new(tenant),
///         }))
///     }
/// })
/// .ttl(Duration::from_secs(30))
/// .timeout(Duration::from_millis(200))
/// .build()?;
///
/// let reports = Rule::resolved(Limit::new("reports", Quota::per_hour(2).fixed_window())?, plans)
///     .tier("pro", Quota::per_hour(1_000).fixed_window());
/// let app = Router::new()
///     .route("/", get(|| async { "report" }))
///     .layer(RateLimitLayer::builder().rule(reports).build()?);
/// let send = |api_key: &str| {
///     let request = Request::get("/").header("x-api-key", api_key).body(Body::empty()).unwrap();
///     app.clone().oneshot(request)
/// };
///
/// // the two keys of acme share its limit of 2 an hour; globex is on "pro"
/// assert_eq!(send("key-a1").await?.status(), StatusCode::OK);
/// assert_eq!(send("key-a2").await?.status(), StatusCode::OK);
/// assert_eq!(send("key-a1").await?.status(), StatusCode::TOO_MANY_REQUESTS);
/// for _ in 0..3 {
///     assert_eq!(send("key-b").await?.status(), StatusCode::OK);
/// }
/// // an unknown key has no key for the limit: 400 by default
/// assert_eq!(send("made-up").await?.status(), StatusCode::BAD_REQUEST);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct PlanResolver(Arc<Inner>);

struct Inner {
    /// Tells the answers of this resolver apart from other resolvers' in
    /// one request.
    id: u64,
    lookup_key: Box<dyn KeyExtractor>,
    lookup_kind: String,
    lookup: Box<Lookup>,
    cache: Cache<Vec<u8>, Cached>,
    timeout: Duration,
    max_key_len: usize,
    failures: FailureLog,
}

impl std::fmt::Debug for PlanResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // (never the cached keys: they are secrets)
        f.debug_struct("PlanResolver")
            .field("lookup_key", &self.0.lookup_kind)
            .field("timeout", &self.0.timeout)
            .field("max_key_len", &self.0.max_key_len)
            .finish_non_exhaustive()
    }
}

impl PlanResolver {
    /// A resolver that reads the lookup key with `lookup_key` (such as
    /// [`Header`](crate::key::Header) `x-api-key`) and looks its plan up
    /// with `lookup`, with the defaults: see [`PlanResolverBuilder`].
    ///
    /// `lookup` is called only when the key's answer is not cached, and at
    /// most once at a time per key; it should be async all the way (a
    /// blocking call inside it blocks a runtime worker: run such a call
    /// with `tokio::task::spawn_blocking`).
    pub fn builder<K, F, Fut, E>(lookup_key: K, lookup: F) -> PlanResolverBuilder
    where
        K: KeyExtractor,
        F: Fn(Vec<u8>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Option<Plan>, E>> + Send + 'static,
        E: StdError + Send + Sync + 'static,
    {
        let lookup_kind = lookup_key.key_kind();
        let lookup = move |key: Vec<u8>| {
            let answer = lookup(key);
            Box::pin(async move { answer.await.map_err(BoxError::from) })
                as Pin<Box<dyn Future<Output = Answer> + Send>>
        };
        PlanResolverBuilder {
            lookup_key: Box::new(lookup_key),
            lookup_kind,
            lookup: Box::new(lookup),
            max_entries: DEFAULT_MAX_ENTRIES,
            ttl: DEFAULT_TTL,
            unknown_ttl: DEFAULT_UNKNOWN_TTL,
            timeout: DEFAULT_TIMEOUT,
            max_key_len: DEFAULT_MAX_KEY_LEN,
            log_interval: DEFAULT_LOG_INTERVAL,
        }
    }

    /// Forgets the cached answer for `lookup_key` (an API key revoked, a
    /// tenant moved to another plan): its next request looks it up again.
    pub async fn invalidate(&self, lookup_key: &[u8]) {
        self.0.cache.invalidate(lookup_key).await;
    }

    /// Forgets every cached answer.
    pub fn invalidate_all(&self) {
        self.0.cache.invalidate_all();
    }

    /// How many answers the cache holds, plans and unknown keys. The cache
    /// applies evictions and expiries in batches: this applies those that
    /// are due first, so the count is at most the bound.
    pub async fn cached(&self) -> u64 {
        self.0.cache.run_pending_tasks().await;
        self.0.cache.entry_count()
    }

    /// The plan of a request: `None` when it has no key for the rule (see
    /// the type's docs).
    async fn plan_of(&self, parts: &Parts) -> Cached {
        let inner = &*self.0;
        let mut key = KeyBuf::new();
        if !inner.lookup_key.extract_into(parts, &mut key) || key.is_empty() {
            return None;
        }
        if key.len() > inner.max_key_len {
            tracing::debug!(
                target: "tower_ratelimit",
                bytes = key.len(),
                "a lookup key longer than {} bytes: not looked up, the request has no key",
                inner.max_key_len
            );
            count_lookup("oversized");
            return None;
        }
        // One deadline for the lookup and for this request's wait: the
        // lookup's own timeout ends it first, and its failure reaches every
        // request waiting for it.
        let deadline = tokio::time::Instant::now() + inner.timeout;
        let lookup = async {
            let answer = tokio::time::timeout_at(deadline, (inner.lookup)(key.as_bytes().to_vec()));
            match answer.await {
                Ok(Ok(plan)) => {
                    count_lookup(if plan.is_some() { "found" } else { "unknown" });
                    Ok(plan.map(Arc::new))
                }
                Ok(Err(error)) => {
                    count_lookup("failed");
                    Err(Failure::Failed(error))
                }
                Err(_) => {
                    count_lookup("timed_out");
                    Err(Failure::TimedOut(inner.timeout))
                }
            }
        };
        let cached = inner.cache.try_get_with_by_ref(key.as_bytes(), lookup);
        match tokio::time::timeout_at(deadline, cached).await {
            Ok(Ok(plan)) => plan,
            Ok(Err(failure)) => {
                inner.failures.record(&failure);
                None
            }
            // a lookup taken over from a request that went away, still
            // running at this request's deadline
            Err(_) => {
                inner.failures.record(&Failure::TimedOut(inner.timeout));
                None
            }
        }
    }
}

/// Configures a [`PlanResolver`]; made by [`PlanResolver::builder`].
#[must_use]
pub struct PlanResolverBuilder {
    lookup_key: Box<dyn KeyExtractor>,
    lookup_kind: String,
    lookup: Box<Lookup>,
    max_entries: u64,
    ttl: Duration,
    unknown_ttl: Duration,
    timeout: Duration,
    max_key_len: usize,
    log_interval: Duration,
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
    /// its requests have no key for the rule.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
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

/// Why a lookup gave no answer.
#[derive(Debug)]
enum Failure {
    Failed(BoxError),
    TimedOut(Duration),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Failed(error) => write!(f, "the lookup failed: {error}"),
            Failure::TimedOut(timeout) => write!(f, "the lookup did not answer within {timeout:?}"),
        }
    }
}

/// Failed lookups in the logs: at most one `warn` line per interval, with
/// the number of requests they left without a key since the line before.
/// (The store's outage log, which logs each outage's start and end at
/// once, would log twice per change when lookups of some keys fail and
/// others answer.)
struct FailureLog {
    interval: Duration,
    /// When the last line was logged; `None` before the first.
    last_line: Mutex<Option<Instant>>,
    /// Requests not yet counted in a line.
    unreported: AtomicU64,
}

impl FailureLog {
    fn new(interval: Duration) -> Self {
        Self {
            interval,
            last_line: Mutex::new(None),
            unreported: AtomicU64::new(0),
        }
    }

    /// A request got no key because its lookup failed.
    fn record(&self, failure: &Failure) {
        self.unreported.fetch_add(1, Ordering::AcqRel);
        // whoever holds the lock is already deciding whether to log
        let mut last = match self.last_line.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        let now = Instant::now();
        if last.is_some_and(|at| now.saturating_duration_since(at) < self.interval) {
            return;
        }
        *last = Some(now);
        let failed = self.unreported.swap(0, Ordering::AcqRel);
        tracing::warn!(
            target: "tower_ratelimit",
            error = %failure,
            failed_requests = failed,
            "plan lookups left {failed} requests without a rate-limit key (the missing-key policy applied to them); \
             at most one such line per {:?}",
            self.interval
        );
    }
}

/// Counts a lookup (or a key refused without one) under
/// [`PLAN_LOOKUPS`](crate::metrics::PLAN_LOOKUPS).
#[cfg(feature = "metrics")]
fn count_lookup(result: &'static str) {
    ::metrics::counter!(crate::metrics::PLAN_LOOKUPS, "result" => result).increment(1);
}

#[cfg(not(feature = "metrics"))]
#[inline(always)]
fn count_lookup(_: &'static str) {}

/// The plans of one request, per resolver: put among its extensions while
/// the layer chooses its limits.
#[derive(Clone, Default)]
struct Resolved(SmallVec<[(u64, Cached); 1]>);

impl Resolved {
    /// The plan `resolver` found for the request.
    fn of<'a>(parts: &'a Parts, resolver: &PlanResolver) -> Option<&'a Plan> {
        let resolved = parts.extensions.get::<Resolved>()?;
        let (_, plan) = resolved.0.iter().find(|(id, _)| *id == resolver.0.id)?;
        plan.as_deref()
    }
}

/// A resolved rule's key: the key of the plan its resolver found.
struct PlanKey(PlanResolver);

impl KeyExtractor for PlanKey {
    fn extract(&self, parts: &Parts) -> Option<Vec<u8>> {
        Resolved::of(parts, &self.0).map(|plan| plan.key.to_vec())
    }

    fn extract_into(&self, parts: &Parts, key: &mut KeyBuf) -> bool {
        match Resolved::of(parts, &self.0) {
            Some(plan) => {
                key.extend_from_slice(&plan.key);
                true
            }
            None => false,
        }
    }

    fn key_kind(&self) -> String {
        format!("Plan({})", self.0 .0.lookup_kind)
    }
}

impl Rule {
    /// `limit`, counted per the key of each request's [`Plan`], in the
    /// plan's tier: both from `plans`, an async lookup with its cache
    /// (feature `resolver`). Add the tiers plans name with
    /// [`tier`](Self::tier); the tier is never chosen with
    /// [`choose_tier`](Self::choose_tier) (a [`ConfigError::Tiers`] when
    /// the layer is built). A request whose plan is not found (no lookup
    /// key, an unknown one, a failed or slow lookup) has no key for this
    /// limit: its [`MissingKey`](super::MissingKey) policy applies.
    ///
    /// A layer with a resolved rule decides in its response future, never
    /// within `call` (as it does for other layers over a
    /// [`MemoryStore`](crate::MemoryStore)): the lookup is awaited there.
    /// See [`PlanResolver`] for an example.
    #[cfg_attr(docsrs, doc(cfg(feature = "resolver")))]
    pub fn resolved(limit: impl Into<crate::LimitSource>, plans: PlanResolver) -> Self {
        let mut rule = Rule::new(limit, PlanKey(plans.clone()));
        rule.plan = Some(plans);
        rule
    }
}

/// For [`Rule::compile`]: a resolved rule's tier is its plan's.
pub(crate) fn choose_plan_tiers(rule: &mut Rule) -> Result<(), ConfigError> {
    let Some(plans) = rule.plan.clone() else {
        return Ok(());
    };
    let name = rule.limit.name().to_owned();
    if rule.choose.is_some() {
        return Err(ConfigError::Tiers(format!(
            "limit {name:?} takes its tier from a plan resolver: choose_tier cannot choose it too"
        )));
    }
    if rule.tiers.is_empty() {
        // every request in the limit's own quota, whatever tier plans name
        return Ok(());
    }
    let known: Vec<String> = rule.tiers.iter().map(|(tier, _)| tier.clone()).collect();
    let warned = AtomicBool::new(false);
    rule.choose = Some(Arc::new(tier_choice(move |parts: &Parts| {
        let tier = Resolved::of(parts, &plans)?.tier()?;
        if !known.iter().any(|known| known == tier) && !warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tower_ratelimit",
                limit = %name,
                tier,
                "a plan names a tier limit {name:?} does not have: its requests count in the \
                 default tier (logged once per limit)"
            );
        }
        Some(tier)
    })));
    Ok(())
}

/// A tier choice, its signature spelled out (a closure's own inference
/// does not tie the returned name's lifetime to the request's).
fn tier_choice<F>(choose: F) -> F
where
    F: for<'a> Fn(&'a Parts) -> Option<&'a str>,
{
    choose
}

/// Looks up the plans of `parts`' resolved rules (each resolver once, the
/// rules the request is exempt from left out) and puts them among its
/// extensions, for the rules' keys and tiers; [`forget`] takes them out.
/// Each resolver waits at most its timeout, one after the other.
pub(crate) async fn resolve(config: &Config, parts: &mut Parts) {
    let mut resolved = Resolved::default();
    for rule in &config.rules {
        let Some(plans) = &rule.plan else { continue };
        if resolved.0.iter().any(|(id, _)| *id == plans.0.id)
            || rule.skip.as_ref().is_some_and(|skip| skip(parts))
        {
            continue;
        }
        let plan = plans.plan_of(parts).await;
        resolved.0.push((plans.0.id, plan));
    }
    parts.extensions.insert(resolved);
}

/// Takes the plans [`resolve`] put among the extensions out again: the
/// inner service never sees them.
pub(crate) fn forget(parts: &mut Parts) {
    parts.extensions.remove::<Resolved>();
}
