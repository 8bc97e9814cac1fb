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
//! | a resolved limit's plan (feature `resolver`, `Rule::resolved`) is not found: no lookup key, an unknown one, one too long | as no key for that limit, per [`MissingKey`] |
//! | a resolved limit's lookup fails or times out | per the resolver's `OnLookupError`: 503 with `Retry-After` (1 s) by default, as a store failing closed (not for a shadow limit), or as no key; logged at `warn` at most once per interval |
//! | exempt from a limit ([`Rule::skip_if`]) | that limit left out of the decision (every limit: forwarded without one), nothing counted |
//! | deny-listed ([`RateLimitLayerBuilder::deny_if`]) | 403 Forbidden with a generic problem body, without asking the store; counted `deny_listed` under every limit of the layer; before exemptions (a request both deny-listed and exempt is refused) |
//! | a key blocked by a limit's [penalty](crate::Limit::with_penalty) | 429 like any refusal: `Retry-After` the time left of the block, `RateLimit` remaining 0; answered from the cache of denials while the block lasts (see [`LimiterBuilder::cache_denials`](crate::LimiterBuilder::cache_denials)) |
//! | the response says the request does not count ([`Rule::refund_if`]) | the permit taken on arrival is given back before the response is returned, and the response's rate-limit fields show what remains after it |
//! | a [concurrency limit](crate::Limit::concurrency) grants | its permit (a lease, renewed meanwhile) is held from the decision through the handler until the response body has been sent, then given back; at once when the request is dropped (the client went away), the inner service fails or the body is dropped; when a client stops reading, a lease time after the body had data the server did not ask for, and at the limit's [maximum hold](crate::Limit::hold_at_most) if it sets one (none by default: a client that reads keeps it), when the body ends with an error; a request it refuses gets 429 with `Retry-After` until the oldest lease would expire (an upper bound); in delay mode it waits instead, decided again at pauses of 10 ms to 200 ms, until a permit is free or `max_delay` is over |
//! | a rule charges a cost after the response ([`Rule::cost_from_response`], [`Rule::cost_from_response_header`], [`Rule::cost_from_response_chunks`], [`Rule::cost_from_response_json`], [`Rule::cost_from_response_body`]) | the request's cost to that rule ([`Rule::cost`], 1 by default) is taken on arrival; what the response costs beyond it (at most the limit's capacity) is charged, whatever is left, when the head is known or, with a body cost, when the body ends or is dropped, on a task of its own (with [`Rule::settle_estimates`], what it cost less is given back); a key in debt gets 429 until paid back. Every rule's charge goes in one store call, every surplus in one more. A charge that fails is tried again while the timeout lasts, then logged and counted (`tower_ratelimit_charges_total{result="failed"}`). A budget is exceeded by at most the costs, beyond what they paid on arrival (each at most the capacity), of the responses admitted before it ran out and still unsettled. A response that tells no cost costs what was paid on arrival (an estimate kept, counted `result="estimate_kept"`), or [`Rule::cost_if_untold`]; a metered body is asked for with `Accept-Encoding: identity`, and a compressed one tells none |
//! | an estimate not told ([`Rule::settle_estimates`]) | charged [`Rule::estimate_fallback`], which is written into the request forwarded (the header set, the JSON field written into the body) |
//! | an estimate over the share of a limit one request may take ([`Rule::settle_estimates`]) | 400 with a problem body naming the limit, the estimate and the most one request may take, nothing taken; counted `estimate_too_large` under the limit |
//! | an estimate that cannot be read unambiguously ([`Rule::settle_estimates`]) | 400 with a problem body naming the limit, nothing taken; counted `estimate_unreadable` under the limit |
//! | a limit in [shadow mode](crate::Limit::shadow) would refuse | forwarded; counted `shadow_denied`; shadow limits are left out of the headers |
//! | the store fails or times out | per [`OnStoreError`]: 503 with `Retry-After` and a generic problem body by default (the error goes to the log, not the client); fail-open forwards without a decision; the memory fallback decides with the store's shared in-process state, each instance granting its share of every limit (the quota divided by the instances its heartbeat counted: see [`OnStoreError::FallbackToMemory`] for the bound) |
//! | any of the layer's own answers above to a gRPC call (`content-type: application/grpc...`), feature `grpc` | a trailers-only gRPC response (HTTP 200, `grpc-status`, `grpc-message`) instead: refused, `RESOURCE_EXHAUSTED` with the wait as `google.rpc.RetryInfo` (none when the cost can never fit); deny-listed, `PERMISSION_DENIED`; store failure (or a failed plan lookup), `UNAVAILABLE` with the fail-closed `retry_after` as `RetryInfo`; no key, `INVALID_ARGUMENT` (a configured 401, 403, 404: `UNAUTHENTICATED`, `PERMISSION_DENIED`, `NOT_FOUND`); each with `Cache-Control: no-store`. The rate-limit headers and `Retry-After` are kept, as metadata; a custom [`on_rejection`](RateLimitLayerBuilder::on_rejection) handler is not overridden |
//!
//! Tracing (target `tower_ratelimit`): denials at `debug` (a flood of them
//! must not flood the logs). Store failures are logged per outage, not per
//! request: the first failure at `warn` (with the error), then at most one
//! `warn` line per interval counting the requests that failed since the last
//! one, and the recovery at `info` with the total
//! ([`RateLimitLayerBuilder::store_error_log_interval`]).

mod after;
mod arrival;
mod body;
mod builder;
mod choose;
mod compiled;
mod costs;
mod future;
mod info;
mod meter;
mod outage;
mod refusal;
#[cfg(feature = "resolver")]
mod resolved;
mod response;
mod rule;
mod service;

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;

pub use self::body::ResponseBody;
pub use self::builder::RateLimitLayerBuilder;
pub use self::future::ResponseFuture;
pub use self::info::RateLimitInfo;
pub use self::refusal::{respond, Refusal, Unavailable};
pub use self::response::QUOTA_EXCEEDED;
pub use self::rule::Rule;
pub use self::service::RateLimit;
pub use crate::fields::{
    RATELIMIT, RATELIMIT_POLICY, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
};
#[cfg(feature = "resolver")]
#[cfg_attr(docsrs, doc(cfg(feature = "resolver")))]
pub use crate::plan::{OnLookupError, Plan, PlanResolver, PlanResolverBuilder};

use self::body::RejectionResponse;
use self::compiled::CompiledRule;
use self::outage::OutageLog;
use self::rule::RequestPredicate;
use crate::fields::HeaderSet;
use crate::key::KeyExtractor;
use crate::{Decision, Error, LimitSource, Limiter};

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
    /// Decide with an in-process store holding the same limits, each
    /// instance granting its share of every limit until Redis is back: the
    /// fleet as a whole stays within about one quota, not one per instance.
    ///
    /// The in-process store belongs to the [`RedisStore`](crate::RedisStore)
    /// and is shared by its clones: layers built over clones of one store
    /// keep counting a limit they share (same name and key) as one limit
    /// during an outage. Layers over separately built stores fall back to
    /// separate counts.
    ///
    /// # The fleet's share
    ///
    /// While Redis answers, a store with a fallback beats a heartbeat
    /// ([`RedisStoreBuilder::fleet_heartbeat`](crate::RedisStoreBuilder::fleet_heartbeat),
    /// every 5 s by default, on a task of its own) that counts the store
    /// handles with a fallback on its Redis and prefix: the instances, `n`.
    /// During an outage, each instance counts a request of cost `c` as
    /// `min(c × n, C)` against its own copy of a limit of capacity `C`:
    /// its share of the limit, with the refill of a token bucket or GCRA
    /// divided along with the burst. Per key, while Redis is down, with
    /// every instance having learned `n`:
    ///
    /// - when `c × n ≤ C`, each instance grants at most `⌊C / (c × n)⌋`
    ///   requests per window (or per refill of the whole capacity), so the
    ///   fleet grants at most `n × ⌊C / (c × n)⌋ ≤ C / c`: at most one
    ///   quota, less by the rounding (3 instances, 10 per minute: 3 each,
    ///   9 in all), and at most the limit's rate after the burst;
    /// - when `c × n > C`, each instance still grants one request per
    ///   window (the floor: a request that fits the limit is never refused
    ///   for good), so the fleet grants `n` per window, more than the quota
    ///   (4 instances, 3 SMS per phone per hour: 4 per phone per hour).
    ///
    /// For requests of cost 1: at most `n × max(1, ⌊C / n⌋)` per window,
    /// that is at most `max(C, n)`. On top of that bound:
    ///
    /// - an instance that started during the outage has learned no count
    ///   and grants the full quota: each adds up to `C`. An instance keeps
    ///   the count it learned last for the whole outage, whatever happens
    ///   to the fleet meanwhile;
    /// - the count is learned up to one heartbeat before the outage: an
    ///   instance started within that time may be missing from the
    ///   others' counts (their shares are then of `n - 1`); one that
    ///   stopped is still counted for up to seven heartbeats (shares
    ///   smaller than needed, never larger). Counts are per prefix:
    ///   instances that share the prefix but not the limit make the shares
    ///   smaller than needed, never larger;
    /// - the count does not fall when the fleet's set is emptied (`DEL`,
    ///   `FLUSHDB`, eviction, a failover or restart that lost it) or the
    ///   Redis clock steps forward: each instance keeps the largest count
    ///   of its last four heartbeats, by which time every instance alive
    ///   has beaten again, and heartbeats are stamped with Redis `TIME`
    ///   even for a store with its own
    ///   [`clock`](crate::RedisStoreBuilder::clock), so a clock ahead
    ///   drops no other instance. Only an instance started after the set
    ///   was emptied and before the others beat again counts fewer than
    ///   there are;
    /// - as with any fallback, the fallback does not know what Redis
    ///   granted before the outage, nor Redis what the fallback granted:
    ///   the windows in which the outage begins and ends may each let up
    ///   to one more quota through;
    /// - without a heartbeat (`fleet_heartbeat(Duration::ZERO)`, or a
    ///   layer built outside a Tokio runtime, logged at `warn`) each
    ///   instance grants the full quota: `n` quotas in all.
    ///
    /// The response fields of a request the fallback decides show the
    /// instance's share: `RateLimit` `r` counts the requests (of its cost)
    /// this instance still grants; `RateLimit-Policy` shows the full
    /// quota. Once Redis answers again, decisions go back to it at once
    /// (nothing to restart) and the heartbeat resumes. While Redis
    /// answers, the share costs decisions nothing: they never read the
    /// count, and the heartbeat is one `FCALL` per period per store handle.
    FallbackToMemory,
}

/// The `Retry-After` of the default [`OnStoreError::FailClosed`], and of
/// [`Unavailable::of`].
pub(crate) const FAIL_CLOSED_RETRY_AFTER: Duration = Duration::from_secs(1);

impl Default for OnStoreError {
    fn default() -> Self {
        OnStoreError::FailClosed {
            retry_after: FAIL_CLOSED_RETRY_AFTER,
        }
    }
}

/// What to do with a request that has no key for a limit (e.g. no API key
/// header, no peer address, or a key that comes out empty: see
/// [`Error::EmptyKey`]), set for each limit with
/// [`Rule::on_missing_key`] (default: [`MissingKey::Reject`] 400).
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
    /// The plan lookup of limit `limit`'s resolver failed or timed out
    /// and its policy is `OnLookupError::FailClosed` (feature `resolver`):
    /// 503 with `Retry-After` by default, as [`Rejection::StoreFailed`].
    LookupFailed {
        /// The (first) limit keyed by the resolver.
        limit: &'a str,
    },
    /// The request's estimate is over the share of limit `limit`'s capacity
    /// one request may take ([`Rule::settle_estimates`]):
    /// 400 Bad Request by default (the client must ask for less; waiting
    /// cannot help), with a problem body naming the limit, the estimate
    /// and the most one request may take; counted
    /// [`estimate_too_large`](crate::metrics::Outcome::EstimateTooLarge)
    /// under the limit.
    EstimateTooLarge {
        /// The limit.
        limit: &'a str,
        /// The request's estimate.
        estimate: u64,
        /// The most one request may take of it.
        most: u64,
    },
    /// The request's estimate for limit `limit` cannot be read
    /// unambiguously ([`Rule::settle_estimates`]): several header lines,
    /// a name given twice in the JSON body, a value that is no cost
    /// (a string, a negative, a fraction, over 2^53, `null`, 0), a body
    /// that is no JSON object or was not read whole. 400 Bad Request by
    /// default, with a problem body naming the limit; counted
    /// [`estimate_unreadable`](crate::metrics::Outcome::EstimateUnreadable)
    /// under the limit. Nothing is taken.
    EstimateUnreadable {
        /// The limit.
        limit: &'a str,
    },
}

type Rejector = Arc<dyn Fn(&Rejection<'_>) -> RejectionResponse + Send + Sync>;

pub(crate) struct Config {
    pub(crate) limiter: Limiter,
    pub(crate) rules: Vec<CompiledRule>,
    pub(crate) fallback: Option<Limiter>,
    pub(crate) on_error: OnStoreError,
    /// Requests refused by the layer without a decision (403).
    pub(crate) deny: Option<RequestPredicate>,
    /// Whether any grant may be given back (a refund predicate, delay mode,
    /// a lease, a cost charged after the response).
    pub(crate) refundable: bool,
    /// Whether a response may say its request does not count (the layer's
    /// or a rule's refund predicate).
    pub(crate) refunds_on_response: bool,
    /// Whether a rule holds a lease until the response body ends, or
    /// charges a cost after the response (see `after.rs`).
    pub(crate) settles_after: bool,
    pub(crate) max_delay: Duration,
    /// Requests that may wait in delay mode at once (see
    /// [`RateLimitLayerBuilder::max_waiting`]); `None` without delay mode.
    pub(crate) waiting: Option<Arc<tokio::sync::Semaphore>>,
    /// Decided inside `call` (see `service.rs`): the store (and the
    /// fallback, in memory) answers at once, and no grant is reserved
    /// ahead, given back or decided again (shadow limits), and no plan is
    /// resolved: nothing in the decision is awaited.
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
        RateLimitLayerBuilder::new()
    }

    /// The operator's handle on this layer's limits, over its store: the
    /// same [`Admin`](crate::Admin) a [`Limiter`] lends, bound to every
    /// rule's limit (a rule's [tiers](Rule::tier) share its name, so they
    /// are reached through it). Stored quotas and overrides
    /// ([`Limit::use_stored_quota`](crate::Limit::use_stored_quota)),
    /// [`reset`](crate::Admin::reset) of a key in every limit, penalties
    /// (block, unblock, inspect): no second [`Limiter`] repeating the
    /// layer's limits. An unblock or a reset drops the denials this layer
    /// cached for the key. A change is made in the store, shared by every
    /// instance; during an outage a
    /// [`FallbackToMemory`](OnStoreError::FallbackToMemory) decides with
    /// the limits' own quotas.
    ///
    /// ```
    /// use http::{Request, StatusCode};
    /// use tower::{Layer, ServiceExt};
    /// use tower_ratelimit::key::Header;
    /// use tower_ratelimit::layer::{RateLimitLayer, Rule};
    /// use tower_ratelimit::{Limit, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let reports = Limit::new("reports", Quota::per_hour(1).fixed_window())?.use_stored_quota();
    /// let rule = Rule::new(reports, Header::new(http::HeaderName::from_static("x-api-key")))
    ///     .tier("pro", Quota::per_hour(2).fixed_window())
    ///     .choose_tier(|r| r.headers.get("x-plan").is_some_and(|p| p == "pro").then_some("pro"));
    /// let layer = RateLimitLayer::builder().rule(rule).build()?;
    /// let app = layer.layer(tower::service_fn(|_: Request<String>| async {
    ///     Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    /// }));
    /// let call = |plan: &'static str| {
    ///     let request = Request::get("/").header("x-api-key", "acme").header("x-plan", plan);
    ///     app.clone().oneshot(request.body(String::new()).unwrap())
    /// };
    /// assert_eq!(call("pro").await?.status(), StatusCode::OK);
    /// assert_eq!(call("pro").await?.status(), StatusCode::OK);
    /// assert_eq!(call("pro").await?.status(), StatusCode::TOO_MANY_REQUESTS);
    ///
    /// // support raises acme's quota: in force in its tier too, at once
    /// let admin = layer.admin();
    /// admin.set_override("reports", "acme", Quota::per_hour(5).fixed_window(), None).await?;
    /// assert_eq!(call("pro").await?.status(), StatusCode::OK);
    /// admin.reset("acme").await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn admin(&self) -> crate::Admin<'_> {
        self.config.limiter.admin()
    }
}

impl<S> tower_layer::Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit::new(inner, self.config.clone())
    }
}
