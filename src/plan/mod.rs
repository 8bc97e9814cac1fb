//! Plans from an async lookup (feature `resolver`): a [`PlanResolver`]
//! gives a [`Rule`] the key its requests count under and their tier from an
//! answer looked up per client (an API key to its tenant and plan, in a
//! database or from another service), cached.
//!
//! Here: the resolver and its cache; its builder (`builder.rs`); the log and
//! count of failed lookups (`failures.rs`); the plans of one request and a
//! resolved rule's key (`request.rs`). The layer's side, the rule made from
//! a resolver and the lookups in the response future, is
//! `layer/resolved.rs`.
//!
//! [`Rule`]: crate::layer::Rule

mod builder;
mod failures;
mod request;

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use moka::future::Cache;

use crate::key::{KeyBuf, KeyExtractor};

pub use self::builder::{OnLookupError, PlanResolverBuilder};
pub(crate) use self::request::{PlanKey, Resolved};

use self::failures::{count_lookup, Failure, FailureLog};

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
///
/// [`Rule::tier`]: crate::layer::Rule::tier
/// [`Rule::choose_tier`]: crate::layer::Rule::choose_tier
///
/// One lookup can key several rules by different keys: a plan may carry
/// more keys, each under a name ([`with_key`](Self::with_key)), for rules
/// made with [`Rule::resolved_per`] (an organisation's budget by its
/// [`key`](Self::key), and each of its users' limit by the key named
/// `"user"`, from one lookup of the API key).
///
/// [`Rule::resolved_per`]: crate::layer::Rule::resolved_per
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    key: Box<[u8]>,
    tier: Option<Box<str>>,
    /// More keys, by name (few: a list).
    named: Vec<(Box<str>, Box<[u8]>)>,
}

impl Plan {
    /// Requests count under `key`, in the default tier.
    pub fn new(key: impl Into<Vec<u8>>) -> Self {
        Self {
            key: key.into().into_boxed_slice(),
            tier: None,
            named: Vec::new(),
        }
    }

    /// Another key of this plan, named `name`: the key of the rules made
    /// with [`Rule::resolved_per`](crate::layer::Rule::resolved_per)`(..,
    /// name)`. A second key of the same name replaces the first.
    pub fn with_key(mut self, name: impl Into<String>, key: impl Into<Vec<u8>>) -> Self {
        let name = name.into().into_boxed_str();
        let key = key.into().into_boxed_slice();
        match self.named.iter_mut().find(|(known, _)| *known == name) {
            Some(slot) => slot.1 = key,
            None => self.named.push((name, key)),
        }
        self
    }

    /// The key named `name` ([`with_key`](Self::with_key)); `None` when the
    /// plan has none of that name.
    pub fn key_named(&self, name: &str) -> Option<&[u8]> {
        self.named
            .iter()
            .find(|(known, _)| &**known == name)
            .map(|(_, key)| &**key)
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
/// What a lookup finds: the plan, `None` for a lookup key that belongs to
/// no client, or the lookup's error.
type Found = Result<Option<Plan>, BoxError>;
type Lookup = dyn Fn(Vec<u8>) -> Pin<Box<dyn Future<Output = Found> + Send>> + Send + Sync;
/// What is cached of a lookup: the plan, or `None` for a lookup key that belongs to
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
/// - the lookup answers `None` (an unknown API key).
///
/// A lookup that fails, or does not answer within the
/// [`timeout`](PlanResolverBuilder::timeout) (1 s by default; the lookup's
/// future is dropped then), is not an unknown key: its request gets the
/// [`on_lookup_error`](PlanResolverBuilder::on_lookup_error) policy, by
/// default 503 Service Unavailable with `Retry-After: 1` (the layer's answer
/// to a store that fails closed), so that an outage of the directory does
/// not refuse every client as unknown. [`OnLookupError::MissingKey`] gives
/// such a request no key instead (the rule's [`MissingKey`] policy).
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
/// (10 s by default), with the number of requests they failed and what the
/// policy did with them;
/// lookup keys are never logged. With the `metrics` feature, the counter
/// [`PLAN_LOOKUPS`](crate::metrics::PLAN_LOOKUPS) counts lookups by result.
///
/// A clone shares the cache: rules made with clones of one resolver (a
/// per-minute and a per-day limit per tenant) look each key up once per
/// request, and at most once per [`ttl`](PlanResolverBuilder::ttl) while
/// cached; so does a resolver used by an outer and an inner layer.
///
/// # In the handler
///
/// A forwarded request carries the [`Plan`] found (the first found, in
/// the order of the layer's rules) as an extension: an axum handler takes it with
/// `Extension<Plan>` (`Option<Extension<Plan>>` when a request may have
/// none: an exempt request, or one whose rule skips missing keys), other
/// services with `request.extensions().get::<Plan>()`, so the app never
/// looks the key up again. With several resolvers in one layer, ask each
/// with [`found_in`](Self::found_in).
///
/// [`MissingKey`]: crate::layer::MissingKey
/// [`Rule`]: crate::layer::Rule
/// [`Rule::resolved`]: crate::layer::Rule::resolved
///
/// ```
/// use std::collections::HashMap;
/// use std::sync::Arc;
/// use std::time::Duration;
///
/// use axum::{body::Body, routing::get, Extension, Router};
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
/// // the handler is handed the plan found: no second lookup
/// let report = |Extension(plan): Extension<Plan>| async move {
///     let tenant = String::from_utf8_lossy(plan.key()).into_owned();
///     format!("report for {tenant} on {}", plan.tier().unwrap_or("basic"))
/// };
/// let app = Router::new()
///     .route("/", get(report))
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
///     let response = send("key-b").await?;
///     assert_eq!(response.status(), StatusCode::OK);
///     let body = axum::body::to_bytes(response.into_body(), 1024).await?;
///     assert_eq!(body, "report for globex on pro");
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
    on_error: OnLookupError,
    failures: FailureLog,
}

/// A lookup failed or timed out, and the resolver's policy is
/// [`OnLookupError::FailClosed`]: the request is answered 503 with this
/// `Retry-After`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LookupFailed {
    pub(crate) retry_after: Duration,
}

impl std::fmt::Debug for PlanResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // (never the cached keys: they are secrets)
        f.debug_struct("PlanResolver")
            .field("lookup_key", &self.0.lookup_kind)
            .field("timeout", &self.0.timeout)
            .field("max_key_len", &self.0.max_key_len)
            .field("on_lookup_error", &self.0.on_error)
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
            let found = lookup(key);
            Box::pin(async move { found.await.map_err(BoxError::from) })
                as Pin<Box<dyn Future<Output = Found> + Send>>
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
            on_error: OnLookupError::default(),
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

    /// The plan of a request: `None` when it has no key for the rule, an
    /// error when its lookup failed and the policy answers 503 (see the
    /// type's docs).
    pub(crate) async fn plan_of(&self, parts: &Parts) -> Result<Cached, LookupFailed> {
        let inner = &*self.0;
        let mut key = KeyBuf::new();
        if !inner.lookup_key.extract_into(parts, &mut key) || key.is_empty() {
            return Ok(None);
        }
        if key.len() > inner.max_key_len {
            tracing::debug!(
                target: "tower_ratelimit",
                bytes = key.len(),
                "a lookup key longer than {} bytes: not looked up, the request has no key",
                inner.max_key_len
            );
            count_lookup("oversized");
            return Ok(None);
        }
        // One deadline for the lookup and for this request's wait: the
        // lookup's own timeout ends it first, and its failure reaches every
        // request waiting for it.
        let deadline = tokio::time::Instant::now() + inner.timeout;
        let lookup = async {
            let found = tokio::time::timeout_at(deadline, (inner.lookup)(key.as_bytes().to_vec()));
            let (result, cached) = match found.await {
                Ok(Ok(Some(plan))) => ("found", Ok(Some(Arc::new(plan)))),
                Ok(Ok(None)) => ("unknown", Ok(None)),
                Ok(Err(error)) => ("failed", Err(Failure::Failed(error))),
                Err(_) => ("timed_out", Err(Failure::TimedOut(inner.timeout))),
            };
            count_lookup(result);
            cached
        };
        let cached = inner.cache.try_get_with_by_ref(key.as_bytes(), lookup);
        let failure = match tokio::time::timeout_at(deadline, cached).await {
            Ok(Ok(plan)) => return Ok(plan),
            Ok(Err(failure)) => failure,
            // a lookup taken over from a request that went away, still
            // running at this request's deadline
            Err(_) => Arc::new(Failure::TimedOut(inner.timeout)),
        };
        inner.failures.record(&failure, inner.on_error);
        match inner.on_error {
            OnLookupError::FailClosed { retry_after } => Err(LookupFailed { retry_after }),
            OnLookupError::MissingKey => Ok(None),
        }
    }

    /// The plan this resolver found for a request a layer forwarded, read
    /// from the request's extensions (in the handler, or a service inside
    /// the layer): `None` when it found none (no lookup key, an unknown one,
    /// a lookup that failed under [`OnLookupError::MissingKey`]) or did not
    /// look (the request was exempt from its rules). With one resolver, the
    /// [`Plan`] extension says the same; with several, ask each.
    pub fn found_in<'a>(&self, extensions: &'a http::Extensions) -> Option<&'a Plan> {
        Resolved::among(extensions, self)
    }

    /// Tells the answers of this resolver apart from other resolvers' in
    /// one request.
    pub(crate) fn id(&self) -> u64 {
        self.0.id
    }
}
