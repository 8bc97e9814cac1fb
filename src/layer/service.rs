//! The [`RateLimit`] service and its response future.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::body::RejectionResponse;
use http::{Request, Response};
use tower_service::Service;

use super::response::{
    insert_headers, insert_retry_after, missing_key, store_unavailable, too_many_requests,
};
use smallvec::SmallVec;

use super::{Config, MissingKey, OnStoreError, RateLimitInfo, Rejection, ResponseBody};
use crate::grant::{Refund, RefundOnDrop};
use crate::{Decision, Grant, Limit};

/// Middleware that rate-limits requests; built by [`RateLimitLayer`](super::RateLimitLayer).
///
/// Always ready: the inner service is readied (on a clone) inside the
/// response future, once the request is granted, so nothing its readiness
/// reserves (a `ConcurrencyLimit` permit, a `Buffer` slot) is held while the
/// store decides or a request waits in delay mode.
#[derive(Clone)]
pub struct RateLimit<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> std::fmt::Debug for RateLimit<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit")
            .field("limiter", &self.config.limiter)
            .finish()
    }
}

impl<S> RateLimit<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// The response future of [`RateLimit`].
///
/// Unlike tower-http's hand-written state machines this is a boxed `async`
/// block: the store call is already a boxed future (stores are trait
/// objects), so a second box costs one allocation and keeps the control flow
/// (decide, wait, forward, decorate) readable top to bottom.
pub struct ResponseFuture<B, E> {
    inner: Pin<Box<dyn Future<Output = Outcome<B, E>> + Send>>,
}

type Outcome<B, E> = Result<Response<ResponseBody<B>>, E>;

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Outcome<B, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B, E> std::fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResponseFuture")
    }
}

fn rejection<B>(
    config: &Config,
    why: Rejection<'_>,
    default: impl FnOnce() -> RejectionResponse,
) -> Response<ResponseBody<B>> {
    let response = match &config.rejector {
        Some(handler) => handler(&why),
        None => default(),
    };
    response.map(ResponseBody::rejection)
}

/// Readies `inner` and calls it: readiness is taken only once the request
/// is about to be served.
async fn forward<S, R>(mut inner: S, request: R) -> Result<S::Response, S::Error>
where
    S: Service<R>,
{
    std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
    inner.call(request).await
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    /// Always ready, reserving nothing. The inner service is readied inside
    /// the response future, once the request is granted (after the store
    /// round trip and any delay-mode wait), on a clone of it, as
    /// `axum::middleware::from_fn` does. Readying it here would hold what
    /// its readiness reserves (a `ConcurrencyLimit` permit, a `Buffer` slot)
    /// across the decision and the wait, so a request sleeping in delay mode
    /// would block requests that are granted at once, and refused requests
    /// would take capacity for nothing. The inner service's backpressure
    /// still applies: the future waits for it before calling it.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let inner = self.inner.clone();
        let config = self.config.clone();
        let inner = Box::pin(async move {
            let (parts, body) = request.into_parts();
            if config.skip.as_ref().is_some_and(|skip| skip(&parts)) {
                // exempt: never counted, never refused
                return pass(inner, Request::from_parts(parts, body), false).await;
            }
            // (limit, key, rule) of each limit that applies to this request
            let mut chosen: SmallVec<[(&Limit, Vec<u8>, usize); 2]> = SmallVec::new();
            for (i, rule) in config.rules.iter().enumerate() {
                if rule.skip.as_ref().is_some_and(|skip| skip(&parts)) {
                    continue;
                }
                let tier = rule.tier(&parts);
                match (rule.key.extract(&parts), &rule.on_missing) {
                    (Some(key), _) => chosen.push((&tier.limit, key, i)),
                    (None, MissingKey::Skip) => {}
                    (None, MissingKey::Shared(key)) => {
                        let limit = tier.keyless.as_ref().unwrap_or(&tier.limit);
                        chosen.push((limit, key.clone().into_bytes(), i));
                    }
                    (None, MissingKey::Reject(status)) => {
                        let name = rule.limit().name();
                        tracing::debug!(target: "tower_ratelimit", limit = name, "request without a rate-limit key");
                        let why = Rejection::MissingKey(name);
                        return Ok(rejection(&config, why, || missing_key(*status, name)));
                    }
                }
            }
            let pairs: SmallVec<[(&Limit, &[u8]); 2]> = chosen
                .iter()
                .map(|(limit, key, _)| (*limit, key.as_slice()))
                .collect();
            let cost = config
                .cost
                .as_ref()
                .map_or(config.fixed_cost, |cost| cost(&parts));
            let (delay, refundable) = (config.max_delay, config.refundable);
            let mut store_failed = false;
            let decided = match config
                .limiter
                .decide_pairs(&pairs, cost, delay, refundable)
                .await
            {
                None => None,
                Some(Ok(grant)) => {
                    config.outage.success();
                    Some(grant)
                }
                Some(Err(error)) => {
                    store_failed = true;
                    match (config.on_error, &config.fallback) {
                        (OnStoreError::FallbackToMemory, Some(fallback)) => {
                            config.outage.failure(&error, "deciding in memory");
                            match fallback.decide_pairs(&pairs, cost, delay, refundable).await {
                                Some(Ok(grant)) => Some(grant),
                                _ => None,
                            }
                        }
                        (OnStoreError::FailClosed { retry_after }, _) => {
                            config.outage.failure(&error, "refusing requests");
                            let why = Rejection::StoreFailed(&error);
                            return Ok(rejection(&config, why, || store_unavailable(retry_after)));
                        }
                        _ => {
                            config.outage.failure(&error, "letting requests through");
                            None
                        }
                    }
                }
            };
            let Some(Grant { decision, refund }) = decided else {
                return pass(inner, Request::from_parts(parts, body), store_failed).await;
            };
            let shown = decision.without_shadow();
            if !decision.is_allowed() {
                let violated: Vec<&str> = decision.violated().map(|s| s.name()).collect();
                tracing::debug!(target: "tower_ratelimit", limits = ?violated, retry_after = ?decision.retry_after(), "request rate-limited");
                let mut response = rejection(&config, Rejection::Limited(&decision), || {
                    too_many_requests(&decision)
                });
                insert_retry_after(response.headers_mut(), &decision);
                insert_headers(response.headers_mut(), &shown, &config.headers);
                return Ok(response);
            }
            let refund = if decision.wait().is_zero() {
                refund
            } else {
                // a request dropped while it waits gives its slot back
                let reservation = RefundOnDrop::new(refund);
                tokio::time::sleep(decision.wait()).await;
                reservation.disarm()
            };
            // the rule of each limit the grant was charged to
            let charged_rules: SmallVec<[usize; 2]> = chosen
                .iter()
                .zip(decision.statuses())
                .filter(|(_, status)| !status.would_refuse())
                .map(|((_, _, rule), _)| *rule)
                .collect();
            let mut request = Request::from_parts(parts, body);
            let extensions = request.extensions_mut();
            extensions.insert::<Decision>(decision.clone());
            extensions.insert(RateLimitInfo::new(Some(decision.clone()), store_failed));
            let response = forward(inner, request).await?;
            let response = match refund {
                Some(refund) => give_back(&config, &refund, &charged_rules, response).await,
                None => response,
            };
            let mut response = response.map(ResponseBody::inner);
            insert_headers(response.headers_mut(), &shown, &config.headers);
            Ok(response)
        });
        ResponseFuture { inner }
    }
}

/// Forwards a request the layer did not decide (exempt, every limit
/// skipped, or the store failed open).
async fn pass<S, ReqBody, ResBody>(
    inner: S,
    mut request: Request<ReqBody>,
    store_failed: bool,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    request
        .extensions_mut()
        .insert(RateLimitInfo::new(None, store_failed));
    let response = forward(inner, request).await?;
    Ok(response.map(ResponseBody::inner))
}

/// Gives the grant back in the limits whose refund predicate (the layer's
/// or the rule's) says the response does not count, before the response
/// is returned, so that the client's next request sees it.
async fn give_back<B>(
    config: &Config,
    refund: &Refund,
    charged_rules: &[usize],
    response: Response<B>,
) -> Response<B> {
    let (head, body) = response.into_parts();
    let all = config
        .refund_if
        .as_ref()
        .is_some_and(|refund| refund(&head));
    let keep = |j: usize| {
        all || charged_rules
            .get(j)
            .and_then(|&rule| config.rules.get(rule)?.refund_if.as_ref())
            .is_some_and(|refund| refund(&head))
    };
    if (0..refund.charged().len()).any(keep) {
        if let Err(error) = refund.run_some(keep).await {
            config
                .outage
                .failure(&error, "a request that should not count was counted");
        }
    }
    Response::from_parts(head, body)
}
