//! Rate limiting as a Tower layer, for axum or any Tower stack.
//!
//! [`RateLimitLayer`] extracts a key per request for each of its limits, asks
//! the store once for all of them, and either forwards the request (with
//! `RateLimit` headers on the response) or answers `429 Too Many Requests`
//! with `Retry-After` and an RFC 9457 problem body. Nothing is consumed when
//! any limit refuses. Handlers read the [`Decision`] with the
//! [`RateLimitInfo`] extractor, which never fails: a request forwarded
//! without a decision (store down under [`OnStoreError::FailOpen`], every
//! limit skipped) has none.
//!
//! ```
//! use axum::{routing::get, Router};
//! use http::{Request, StatusCode};
//! use tower::ServiceExt;
//! use tower_ratelimit::{key::Global, layer::RateLimitLayer, Limit, Quota};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let limit = Limit::new("api", Quota::per_minute(2).allow_burst(2).gcra())?;
//! let app = Router::new().route("/", get(|| async { "hi" })).layer(RateLimitLayer::new(limit, Global));
//!
//! for expected in [StatusCode::OK, StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
//!     let response = app.clone().oneshot(Request::get("/").body(axum::body::Body::empty())?).await?;
//!     assert_eq!(response.status(), expected);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! Several limits, each with its own key, a store shared by every instance,
//! and a fallback when Redis fails:
//!
//! ```no_run
//! # #[cfg(feature = "redis")] {
//! use tower_ratelimit::key::{ClientIp, ClientIpResolver, RequestExtension};
//! use tower_ratelimit::layer::{OnStoreError, RateLimitLayer};
//! use tower_ratelimit::{Limit, Quota, RedisStore};
//!
//! # #[derive(Clone)] struct UserId(u64);
//! # impl std::fmt::Display for UserId { fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { self.0.fmt(f) } }
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let behind_lb = ClientIpResolver::new().trust_proxies(["10.0.0.0/8"])?;
//! let layer = RateLimitLayer::builder()
//!     .store(RedisStore::new("redis://127.0.0.1:6379")?)
//!     .limit(Limit::new("per-ip", Quota::per_second(10).allow_burst(20).gcra())?, ClientIp::with_resolver(behind_lb))
//!     .limit(Limit::new("per-user-daily", Quota::per_day(10_000).fixed_window())?, RequestExtension::<UserId>::new())
//!     .on_store_error(OnStoreError::FallbackToMemory)
//!     .build()?;
//! # let _ = layer; Ok(()) }
//! # }
//! ```
//!
//! # Outcomes
//!
//! | situation | response |
//! |---|---|
//! | every limit grants | the inner service's, plus `RateLimit-Policy` / `RateLimit`; the handler's [`RateLimitInfo`] has the decision |
//! | a limit refuses | 429, `Retry-After` (whole seconds, rounded up, at least 1), `Cache-Control: no-store`, problem `quota-exceeded` with `violated-policies` |
//! | the cost exceeds a limit's capacity | 429 without `Retry-After` (waiting cannot help) |
//! | delay mode, grant within `max_delay` | forwarded after the wait; nothing is answered early |
//! | delay mode, [`max_waiting`](RateLimitLayerBuilder::max_waiting) requests already waiting | decided without waiting: forwarded if granted now, else 429 with the wait as `Retry-After` |
//! | no key for a limit | per [`MissingKey`] (the layer's, or the limit's own [`Rule::on_missing_key`]): 400 by default; when every limit is skipped, forwarded without a decision |
//! | a resolved limit's plan (feature `resolver`, `Rule::resolved`) is not found: unknown lookup key, lookup failed or timed out, lookup key too long | as no key for that limit, per [`MissingKey`]; the failures logged at `warn` at most once per interval |
//! | exempt ([`RateLimitLayerBuilder::skip_if`]; one limit: [`Rule::skip_if`]) | forwarded without a decision (that limit left out), nothing counted |
//! | deny-listed ([`RateLimitLayerBuilder::deny_if`]) | 403 Forbidden with a generic problem body, without asking the store; counted `deny_listed` under every limit of the layer; before exemptions (a request both deny-listed and exempt is refused) |
//! | a key blocked by a limit's [penalty](crate::Limit::with_penalty) | 429 like any refusal: `Retry-After` the time left of the block, `RateLimit` remaining 0; answered from the cache of denials while the block lasts (see [`LimiterBuilder::cache_denials`](crate::LimiterBuilder::cache_denials)) |
//! | the response says the request does not count ([`RateLimitLayerBuilder::refund_if`], [`Rule::refund_if`]) | the permit taken on arrival is given back before the response is returned, and the response's rate-limit fields show what remains after it |
//! | a [concurrency limit](crate::Limit::concurrency) grants | its permit (a lease, renewed meanwhile) is held from the decision through the handler until the response body has been sent, then given back; at once when the request is dropped (the client went away), the inner service fails or the body is dropped; at the latest at the limit's [maximum hold](crate::Limit::hold_at_most) ([`DEFAULT_MAX_HOLD`](crate::DEFAULT_MAX_HOLD)), when the body ends with an error; a request it refuses gets 429 with `Retry-After` until the oldest lease would expire (an upper bound); in delay mode it waits instead, decided again at pauses of 10 ms to 200 ms, until a permit is free or `max_delay` is over |
//! | a rule charges a cost after the response ([`Rule::cost_from_response`], [`Rule::cost_from_header`], [`Rule::cost_from_body`]) | the request's own cost is taken on arrival; what the response costs beyond it (at most the limit's capacity) is charged, whatever is left, when the head is known or, with a body cost, when the body ends or is dropped, on a task of its own; a key in debt gets 429 until paid back. A charge that fails is tried again while the timeout lasts, then logged and counted (`tower_ratelimit_charges_total{result="failed"}`). A budget is exceeded by at most the costs of the responses admitted before it ran out and still unsettled |
//! | a limit in [shadow mode](crate::Limit::shadow) would refuse | forwarded; counted `shadow_denied`; shadow limits are left out of the headers |
//! | the store fails or times out | per [`OnStoreError`]: 503 with `Retry-After` and a generic problem body by default (the error goes to the log, not the client); fail-open forwards without a decision; the memory fallback decides with the store's shared in-process state |
//! | any of the layer's own answers above to a gRPC call (`content-type: application/grpc...`), feature `grpc` | a trailers-only gRPC response (HTTP 200, `grpc-status`, `grpc-message`) instead: refused, `RESOURCE_EXHAUSTED` with the wait as `google.rpc.RetryInfo` (none when the cost can never fit); deny-listed, `PERMISSION_DENIED`; store failure, `UNAVAILABLE` with the fail-closed `retry_after` as `RetryInfo`; no key, `INVALID_ARGUMENT` (a configured 401, 403, 404: `UNAUTHENTICATED`, `PERMISSION_DENIED`, `NOT_FOUND`); each with `Cache-Control: no-store`. The rate-limit headers and `Retry-After` are kept, as metadata; a custom [`on_rejection`](RateLimitLayerBuilder::on_rejection) handler is not overridden |
//!
//! Tracing (target `tower_ratelimit`): denials at `debug` (a flood of them
//! must not flood the logs). Store failures are logged per outage, not per
//! request: the first failure at `warn` (with the error), then at most one
//! `warn` line per interval counting the requests that failed since the last
//! one, and the recovery at `info` with the total
//! ([`RateLimitLayerBuilder::store_error_log_interval`]).

mod after;
mod body;
mod future;
#[cfg(feature = "grpc")]
mod grpc;
mod info;
mod outage;
#[cfg(feature = "resolver")]
mod plan;
mod response;
mod rule;
mod service;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Response, StatusCode};

pub use self::body::ResponseBody;
pub use self::future::ResponseFuture;
pub use self::info::RateLimitInfo;
#[cfg(feature = "resolver")]
#[cfg_attr(docsrs, doc(cfg(feature = "resolver")))]
pub use self::plan::{Plan, PlanResolver, PlanResolverBuilder};
pub use self::response::{
    QUOTA_EXCEEDED, RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING,
    X_RATELIMIT_RESET,
};
pub use self::rule::Rule;
pub use self::service::RateLimit;

use self::body::{RejectionBody, RejectionResponse};
use self::outage::{OutageLog, DEFAULT_LOG_INTERVAL};
use self::response::HeaderSet;
use self::rule::{CompiledRule, RequestPredicate, ResponsePredicate};
use crate::key::KeyExtractor;
use crate::store::Store;
use crate::{
    ConfigError, Decision, Error, Limit, LimitSource, Limiter, MemoryStore, DEFAULT_TIMEOUT,
};

/// The default of [`RateLimitLayerBuilder::max_waiting`]: requests that may
/// wait in delay mode at once, per layer.
pub const DEFAULT_MAX_WAITING: usize = 1024;

/// What to do when the store fails or does not answer within the timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Forward the request unlimited (logged at `warn`, once per outage).
    FailOpen,
    /// Answer 503 with this `Retry-After` (logged at `warn`, once per outage).
    /// The default, with 1 s.
    FailClosed {
        /// Sent as `Retry-After`, rounded up to whole seconds.
        retry_after: Duration,
    },
    /// Decide with an in-process store holding the same limits, so each
    /// instance still enforces them on its own until Redis is back.
    ///
    /// The in-process store belongs to the [`RedisStore`](crate::RedisStore)
    /// and is shared by its clones: layers built over clones of one store
    /// keep counting a limit they share (same name and key) as one limit
    /// during an outage. Layers over separately built stores fall back to
    /// separate counts.
    FallbackToMemory,
}

impl Default for OnStoreError {
    fn default() -> Self {
        OnStoreError::FailClosed {
            retry_after: Duration::from_secs(1),
        }
    }
}

/// What to do with a request that has no key for a limit (e.g. no API key
/// header, no peer address, or a key that comes out empty: see
/// [`Error::EmptyKey`]): for every limit of a layer
/// ([`RateLimitLayerBuilder::on_missing_key`]) or for one
/// ([`Rule::on_missing_key`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer with this status and a problem body. The default, with 400.
    Reject(StatusCode),
    /// Skip that limit for this request (the others still apply).
    Skip,
    /// Count the request under this key: all keyless requests share one
    /// limit, kept apart from every real key (under the limit's name with
    /// `#keyless` appended, a name no user limit can have), so no client can
    /// name the shared key and join or drain it. The key must not be
    /// empty (a build error).
    Shared(String),
}

impl Default for MissingKey {
    fn default() -> Self {
        MissingKey::Reject(StatusCode::BAD_REQUEST)
    }
}

/// Why the layer answered instead of the inner service; passed to a custom
/// rejection handler ([`RateLimitLayerBuilder::on_rejection`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum Rejection<'a> {
    /// A limit refused (or the cost can never fit). `Retry-After` and the rate
    /// limit headers are added to the handler's response unless it sets them.
    Limited(&'a Decision),
    /// The store failed and the policy is [`OnStoreError::FailClosed`]. The
    /// error is for logs and metrics: its text (Redis or Lua messages,
    /// addresses) does not belong in a response.
    StoreFailed(&'a Error),
    /// The request has no key for this limit and the policy is [`MissingKey::Reject`].
    MissingKey(&'a str),
    /// The layer's deny-list refused the request
    /// ([`RateLimitLayerBuilder::deny_if`]).
    DenyListed,
}

type Rejector = Arc<dyn Fn(&Rejection<'_>) -> RejectionResponse + Send + Sync>;
type CostFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;

pub(crate) struct Config {
    pub(crate) limiter: Limiter,
    pub(crate) rules: Vec<CompiledRule>,
    pub(crate) fallback: Option<Limiter>,
    pub(crate) on_error: OnStoreError,
    /// Requests exempt from every limit of the layer.
    pub(crate) skip: Option<RequestPredicate>,
    /// Requests refused by the layer without a decision (403).
    pub(crate) deny: Option<RequestPredicate>,
    /// Responses whose requests do not count, in any limit.
    pub(crate) refund_if: Option<ResponsePredicate>,
    /// Whether any grant may be given back (a refund predicate, delay mode,
    /// a lease, a cost charged after the response).
    pub(crate) refundable: bool,
    /// Whether a response may say its request does not count (the layer's
    /// or a rule's refund predicate).
    pub(crate) refunds_on_response: bool,
    /// Whether a rule holds a lease until the response body ends, or
    /// charges a cost after the response (see `after.rs`).
    pub(crate) settles_after: bool,
    pub(crate) cost: Option<CostFn>,
    pub(crate) fixed_cost: u64,
    pub(crate) max_delay: Duration,
    /// Requests that may wait in delay mode at once (see
    /// [`RateLimitLayerBuilder::max_waiting`]); `None` without delay mode.
    pub(crate) waiting: Option<Arc<tokio::sync::Semaphore>>,
    /// Decided inside `call`: the store answers at once, and no grant is
    /// reserved ahead, given back or decided again (shadow limits).
    pub(crate) at_once: bool,
    pub(crate) headers: HeaderSet,
    pub(crate) rejector: Option<Rejector>,
    pub(crate) outage: OutageLog,
}

/// A Tower layer that rate-limits requests; see the [module docs](self).
#[derive(Clone)]
pub struct RateLimitLayer {
    config: Arc<Config>,
}

impl std::fmt::Debug for RateLimitLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("limiter", &self.config.limiter)
            .finish()
    }
}

impl RateLimitLayer {
    /// One limit (fixed or [live](crate::LiveLimit)) per `key`, in memory,
    /// with the defaults.
    pub fn new(limit: impl Into<LimitSource>, key: impl KeyExtractor) -> Self {
        let layer = Self::builder().limit(limit, key).build();
        // One validated limit with cost 1 and no other setting cannot fail.
        layer.unwrap_or_else(|e| unreachable!("a single limit is always valid: {e}"))
    }

    /// Configures a layer: limits with their keys, store, cost, delay mode,
    /// failure policies, headers and rejection response.
    pub fn builder() -> RateLimitLayerBuilder {
        RateLimitLayerBuilder {
            store: None,
            rules: Vec::new(),
            skip: None,
            deny: None,
            refund_if: None,
            timeout: DEFAULT_TIMEOUT,
            on_error: OnStoreError::default(),
            on_missing: MissingKey::default(),
            cost: None,
            fixed_cost: 1,
            max_delay: Duration::ZERO,
            max_waiting: DEFAULT_MAX_WAITING,
            headers: HeaderSet {
                ietf: true,
                legacy: false,
                policy: None,
            },
            rejector: None,
            log_interval: DEFAULT_LOG_INTERVAL,
        }
    }
}

impl<S> tower_layer::Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit::new(inner, self.config.clone())
    }
}

/// Configures a [`RateLimitLayer`].
#[must_use]
pub struct RateLimitLayerBuilder {
    store: Option<Arc<dyn Store>>,
    rules: Vec<Rule>,
    skip: Option<RequestPredicate>,
    deny: Option<RequestPredicate>,
    refund_if: Option<ResponsePredicate>,
    timeout: Duration,
    on_error: OnStoreError,
    on_missing: MissingKey,
    cost: Option<CostFn>,
    fixed_cost: u64,
    max_delay: Duration,
    max_waiting: usize,
    headers: HeaderSet,
    rejector: Option<Rejector>,
    log_interval: Duration,
}

impl std::fmt::Debug for RateLimitLayerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.rules.iter().map(|r| r.limit.name()).collect();
        f.debug_struct("RateLimitLayerBuilder")
            .field("limits", &names)
            .finish()
    }
}

impl RateLimitLayerBuilder {
    /// Where state lives (default: a new [`MemoryStore`]).
    pub fn store(mut self, store: impl Store) -> Self {
        self.store = Some(Arc::new(store));
        self
    }

    /// Adds a limit (fixed or [live](crate::LiveLimit)) counted per `key`.
    /// All limits are decided together in one store round trip: a request
    /// passes only if every limit grants it.
    pub fn limit(self, limit: impl Into<LimitSource>, key: impl KeyExtractor) -> Self {
        self.rule(Rule::new(limit, key))
    }

    /// Adds a limit with policies of its own (exemptions, missing keys,
    /// refunds, tiers): see [`Rule`].
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Requests for which `skip` answers `true` are exempt from every limit
    /// of this layer: never counted, never refused, forwarded without a
    /// decision. For internal networks, health checkers, an allow-list of
    /// API keys; for one limit only, see [`Rule::skip_if`].
    ///
    /// ```
    /// use tower_ratelimit::key::ClientIp;
    /// use tower_ratelimit::layer::RateLimitLayer;
    /// use tower_ratelimit::{Limit, Quota};
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .limit(Limit::new("api", Quota::per_second(10).allow_burst(20).gcra())?, ClientIp::peer())
    ///     .skip_if(|request| request.headers.get("x-internal-token").is_some_and(|t| t == "s3cret"))
    ///     .build()?;
    /// # let _ = layer;
    /// # Ok::<(), tower_ratelimit::ConfigError>(())
    /// ```
    pub fn skip_if(mut self, skip: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Self {
        self.skip = Some(Arc::new(skip));
        self
    }

    /// Requests for which `deny` answers `true` are refused by the layer
    /// at once, without asking the store: 403 Forbidden with the layer's
    /// problem-details body (`PERMISSION_DENIED` for a gRPC call with the
    /// `grpc` feature; a custom
    /// [`on_rejection`](Self::on_rejection) handler gets
    /// [`Rejection::DenyListed`]). The deny-list beside the exemptions of
    /// [`skip_if`](Self::skip_if), and checked before them: known abusers,
    /// banned address ranges. Counted `deny_listed` under every limit of
    /// the layer (see [`crate::metrics`]). For bans that come and go, see
    /// [`Limit::with_penalty`](crate::Limit::with_penalty) and
    /// [`Admin::block`](crate::Admin::block).
    ///
    /// ```
    /// use axum::{routing::get, Router};
    /// use http::{Request, StatusCode};
    /// use tower::ServiceExt;
    /// use tower_ratelimit::{key::Global, layer::RateLimitLayer, Limit, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let layer = RateLimitLayer::builder()
    ///     .limit(Limit::new("api", Quota::per_second(10).gcra())?, Global)
    ///     .deny_if(|request| request.headers.get("user-agent").is_some_and(|ua| ua == "BadBot"))
    ///     .build()?;
    /// let app = Router::new().route("/", get(|| async { "hi" })).layer(layer);
    /// let bot = Request::get("/").header("user-agent", "BadBot").body(axum::body::Body::empty())?;
    /// assert_eq!(app.oneshot(bot).await?.status(), StatusCode::FORBIDDEN);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn deny_if(mut self, deny: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Self {
        self.deny = Some(Arc::new(deny));
        self
    }

    /// Gives the permits of a request back, in every limit, when `refund`
    /// answers `true` for its response: the request does not count. For one
    /// limit only, and the details, see [`Rule::refund_if`].
    pub fn refund_if(
        mut self,
        refund: impl Fn(&http::response::Parts) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.refund_if = Some(Arc::new(refund));
        self
    }

    /// Every request costs `cost` (default 1); checked against every limit's
    /// capacity when built.
    pub fn fixed_cost(mut self, cost: u64) -> Self {
        self.fixed_cost = cost;
        self.cost = None;
        self
    }

    /// The cost of each request is computed from it (weighted endpoints).
    /// A cost over a limit's capacity is answered 429 without `Retry-After`.
    pub fn cost_from_request(
        mut self,
        cost: impl Fn(&Parts) -> u64 + Send + Sync + 'static,
    ) -> Self {
        self.cost = Some(Arc::new(cost));
        self
    }

    /// Delay mode (traffic shaping): a request that would be granted within
    /// `max_delay` reserves its slot and is forwarded after the wait; beyond
    /// it, the request is answered 429 and consumes nothing. A request
    /// dropped while it waits (the client went away) gives its reservation
    /// back. At most [`MAX_WAIT`](crate::MAX_WAIT) (a build error beyond),
    /// and at most [`max_waiting`](Self::max_waiting) requests wait at once.
    pub fn delay(mut self, max_delay: Duration) -> Self {
        self.max_delay = max_delay;
        self
    }

    /// In delay mode, how many requests may wait at once (default
    /// [`DEFAULT_MAX_WAITING`]; at least 1). A waiting request holds its
    /// connection and its memory: while this many wait, a request is decided
    /// as without delay mode, so one that would have to wait is answered 429
    /// with its wait as `Retry-After`, consuming nothing.
    pub fn max_waiting(mut self, requests: usize) -> Self {
        self.max_waiting = requests;
        self
    }

    /// Bound on each store call (default [`DEFAULT_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The store failure policy (default: 503 with `Retry-After: 1`).
    pub fn on_store_error(mut self, policy: OnStoreError) -> Self {
        self.on_error = policy;
        self
    }

    /// While the store keeps failing, how often the log gets a line counting
    /// the failed requests (default 10 s). The first failure of an outage is
    /// logged at once (`warn`) and the recovery when the store answers again
    /// (`info`, with the number of failed requests); in between, at most one
    /// `warn` line per interval.
    pub fn store_error_log_interval(mut self, interval: Duration) -> Self {
        self.log_interval = interval;
        self
    }

    /// The policy for requests without a key (default: 400), for every limit
    /// without one of its own ([`Rule::on_missing_key`]).
    pub fn on_missing_key(mut self, policy: MissingKey) -> Self {
        self.on_missing = policy;
        self
    }

    /// Send `RateLimit-Policy` and `RateLimit` (default: yes).
    pub fn ietf_headers(mut self, send: bool) -> Self {
        self.headers.ietf = send;
        self
    }

    /// Send `X-RateLimit-Limit`, `-Remaining` and `-Reset` (default: no).
    pub fn legacy_headers(mut self, send: bool) -> Self {
        self.headers.legacy = send;
        self
    }

    /// Answer rejections with your own response instead of the problem
    /// details body. The body may be of any type with `Bytes` frames: an
    /// `axum::response::Response`, an `http::Response<Full<Bytes>>`, ...
    ///
    /// ```
    /// use http::{Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower_ratelimit::key::Global;
    /// use tower_ratelimit::layer::{RateLimitLayer, Rejection};
    /// use tower_ratelimit::{Limit, Quota};
    ///
    /// let layer = RateLimitLayer::builder()
    ///     .limit(Limit::new("api", Quota::per_second(10).allow_burst(20).gcra())?, Global)
    ///     .on_rejection(|why: &Rejection<'_>| {
    ///         let status = match why {
    ///             Rejection::Limited(_) => StatusCode::TOO_MANY_REQUESTS,
    ///             _ => StatusCode::SERVICE_UNAVAILABLE,
    ///         };
    ///         let mut response = Response::new(Full::from("slow down"));
    ///         *response.status_mut() = status;
    ///         response
    ///     })
    ///     .build()?;
    /// # let _ = layer;
    /// # Ok::<(), tower_ratelimit::ConfigError>(())
    /// ```
    pub fn on_rejection<B>(
        mut self,
        handler: impl Fn(&Rejection<'_>) -> Response<B> + Send + Sync + 'static,
    ) -> Self
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        self.rejector = Some(Arc::new(move |why: &Rejection<'_>| {
            handler(why).map(RejectionBody::new)
        }));
        self
    }

    /// Validates the configuration: a typed [`ConfigError`] for a fixed cost
    /// over a capacity, a missing key answered with a success status,
    /// inconsistent tiers ([`ConfigError::Tiers`]), duplicate limit names.
    ///
    /// Then registers the limits on the store (shared by its clones), with
    /// their quotas and the kinds of key their extractors make
    /// ([`KeyExtractor::key_kind`]), and logs one `warn` line (target
    /// `tower_ratelimit`) per limit name that another layer or limiter on
    /// that store used with another quota, or another layer keyed another
    /// way. Keys are stored per limit name and key text, whatever extractor
    /// made the text, so two layers sharing a name share its buckets: on
    /// purpose with the same key (a per-IP limit on every route), by mistake
    /// with two (a per-API-key layer and a per-IP layer both naming their
    /// limit `api`: an API key written as `203.0.113.9/32` drains that IP's
    /// bucket). Such a layer is still built, and still shares: give each way
    /// of keying its own name. The check runs here, never per request, and
    /// sees the layers of one process only.
    pub fn build(self) -> Result<RateLimitLayer, ConfigError> {
        if self.max_delay > crate::MAX_WAIT {
            return Err(ConfigError::Layer(format!(
                "the delay of {:?} is longer than a grant may be reserved ahead ({:?})",
                self.max_delay,
                crate::MAX_WAIT
            )));
        }
        if self.max_waiting == 0 {
            return Err(ConfigError::Layer(
                "max_waiting must be at least 1".to_owned(),
            ));
        }
        let store = self.store.unwrap_or_else(|| Arc::new(MemoryStore::new()));
        if let MissingKey::Reject(status) = &self.on_missing {
            if status.is_success() || status.is_informational() {
                return Err(ConfigError::Layer(format!(
                    "a missing key cannot be answered with {status}"
                )));
            }
        }
        let fixed_cost = self.cost.is_none().then_some(self.fixed_cost);
        let rules = self
            .rules
            .into_iter()
            .map(|rule| rule.compile(&self.on_missing, fixed_cost))
            .collect::<Result<Vec<CompiledRule>, ConfigError>>()?;
        if self.cost.is_none() {
            let every = rules.iter().flat_map(CompiledRule::limits);
            for limit in every {
                if limit.capacity() < self.fixed_cost {
                    return Err(ConfigError::FixedCostExceedsCapacity {
                        cost: self.fixed_cost,
                        limit: limit.name().to_owned(),
                        capacity: limit.capacity(),
                    });
                }
            }
        }
        let limits: Vec<LimitSource> = rules.iter().map(|r| r.limit().clone()).collect();
        let with_limits = |builder: crate::LimiterBuilder| {
            limits
                .iter()
                .cloned()
                .fold(builder.timeout(self.timeout), |b, l| b.limit(l))
                .build()
        };
        let limiter = with_limits(Limiter::builder_shared(store.clone()))?;
        if let Some(registry) = store.quotas() {
            for rule in &rules {
                registry.register_key(rule.limit().name(), &rule.key_kind);
            }
        }
        let fallback = match self.on_error {
            // The store's own fallback, shared with every other layer over
            // it: a limit shared by two layers stays one limit in an outage.
            OnStoreError::FallbackToMemory => {
                let memory = store.fallback().unwrap_or_default();
                Some(with_limits(Limiter::builder(memory))?)
            }
            _ => None,
        };
        // The same `RateLimit-Policy` for every response that lists every
        // enforced limit, unless a request's quota or name can vary.
        let current: Vec<Limit> = limits.iter().map(|l| Limit::clone(&l.load())).collect();
        let shown: Vec<&Limit> = current.iter().filter(|l| !l.is_shadow()).collect();
        let policy = if rules.iter().any(CompiledRule::varies) {
            None
        } else {
            self::response::policy_value(
                shown
                    .iter()
                    .map(|l| (l.name(), l.capacity(), l.policy_window())),
            )
            .map(|value| (shown.len(), self::response::shared_value(&value)))
        };
        let settles_after = rules.iter().any(CompiledRule::settles_after);
        let refunds_on_response =
            self.refund_if.is_some() || rules.iter().any(|r| r.refund_if.is_some());
        let refundable = refunds_on_response || settles_after || !self.max_delay.is_zero();
        // (a resolved rule's plan is awaited: never within `call`)
        let at_once = limiter.answers_at_once()
            && !refundable
            && !rules.iter().any(CompiledRule::is_resolved)
            && !rules
                .iter()
                .flat_map(CompiledRule::limits)
                .any(|l| l.is_shadow());
        Ok(RateLimitLayer {
            config: Arc::new(Config {
                limiter,
                rules,
                fallback,
                on_error: self.on_error,
                skip: self.skip,
                deny: self.deny,
                refund_if: self.refund_if,
                refundable,
                refunds_on_response,
                settles_after,
                cost: self.cost,
                fixed_cost: self.fixed_cost,
                max_delay: self.max_delay,
                waiting: (!self.max_delay.is_zero()).then(|| {
                    let permits = self.max_waiting.min(tokio::sync::Semaphore::MAX_PERMITS);
                    Arc::new(tokio::sync::Semaphore::new(permits))
                }),
                at_once,
                headers: HeaderSet {
                    policy,
                    ..self.headers
                },
                rejector: self.rejector,
                outage: OutageLog::new(self.log_interval),
            }),
        })
    }
}
