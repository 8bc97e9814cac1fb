//! The layer's builder: its settings, checked and compiled into the
//! layer's [`Config`](super::Config) by [`RateLimitLayerBuilder::build`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::Response;

use super::body::RejectionBody;
use super::compiled::CompiledRule;
use super::outage::{OutageLog, DEFAULT_LOG_INTERVAL};
use super::rule::RequestPredicate;
use super::{Config, OnStoreError, RateLimitLayer, Rejection, Rejector, Rule, DEFAULT_MAX_WAITING};
use crate::fields::HeaderSet;
use crate::key::KeyExtractor;
use crate::store::fleet::FleetShare;
use crate::store::Store;
use crate::{ConfigError, Limit, LimitSource, Limiter, MemoryStore, DEFAULT_TIMEOUT};

/// Configures a [`RateLimitLayer`].
#[must_use]
pub struct RateLimitLayerBuilder {
    store: Option<Store>,
    rules: Vec<Rule>,
    deny: Option<RequestPredicate>,
    timeout: Duration,
    on_error: OnStoreError,
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
    pub(super) fn new() -> Self {
        Self {
            store: None,
            rules: Vec::new(),
            deny: None,
            timeout: DEFAULT_TIMEOUT,
            on_error: OnStoreError::default(),
            max_delay: Duration::ZERO,
            max_waiting: DEFAULT_MAX_WAITING,
            headers: HeaderSet::default(),
            rejector: None,
            log_interval: DEFAULT_LOG_INTERVAL,
        }
    }

    /// Where state lives (default: a new [`MemoryStore`]).
    pub fn store(mut self, store: impl Into<Store>) -> Self {
        self.store = Some(store.into());
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

    /// Requests for which `deny` answers `true` are refused by the layer
    /// at once, without asking the store: 403 Forbidden with the layer's
    /// problem-details body (`PERMISSION_DENIED` for a gRPC call with the
    /// `grpc` feature; a custom
    /// [`on_rejection`](Self::on_rejection) handler gets
    /// [`Rejection::DenyListed`]). The deny-list beside the exemptions of
    /// [`Rule::skip_if`], and checked before them: known abusers,
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
        let store = self.store.unwrap_or_else(|| MemoryStore::new().into());
        let rules = self
            .rules
            .into_iter()
            .map(|#[allow(unused_mut)] mut rule| {
                #[cfg(feature = "resolver")]
                super::resolved::choose_plan_tiers(&mut rule)?;
                rule.compile()
            })
            .collect::<Result<Vec<CompiledRule>, ConfigError>>()?;
        for rule in &rules {
            let Some(cost) = rule.fixed_cost() else {
                continue;
            };
            for limit in rule.limits() {
                if limit.capacity() < cost {
                    return Err(ConfigError::FixedCostExceedsCapacity {
                        cost,
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
        let kinds = store.engine().shared().one(crate::key::KeyKinds::default);
        for rule in &rules {
            kinds.register(rule.limit().name(), &rule.key_kind);
        }
        let fallback = match self.on_error {
            // The store's own fallback, shared with every other layer over
            // it: a limit shared by two layers stays one limit in an outage.
            // With a fleet (a heartbeat counting the instances that share
            // the store), each request counts its share of every limit.
            OnStoreError::FallbackToMemory => {
                let fallback = store.engine().shared().fallback.as_ref();
                let memory = fallback.map(|f| f.memory()).unwrap_or_default();
                Some(match fallback.and_then(|f| f.fleet()) {
                    Some(fleet) => with_limits(Limiter::builder(FleetShare::new(memory, fleet)))?,
                    None => with_limits(Limiter::builder(memory))?,
                })
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
            crate::fields::policy_value(
                shown
                    .iter()
                    .map(|l| (l.name(), l.capacity(), l.policy_window())),
            )
            .map(|value| (shown.len(), super::response::shared_value(&value)))
        };
        let settles_after = rules.iter().any(CompiledRule::settles_after);
        let refunds_on_response = rules.iter().any(|r| r.refund_if.is_some());
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
                deny: self.deny,
                refundable,
                refunds_on_response,
                settles_after,
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
                outage: OutageLog::new(self.log_interval, store.kind()),
            }),
        })
    }
}
