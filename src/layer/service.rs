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
use super::{Config, MissingKey, OnStoreError, RateLimitInfo, Rejection, ResponseBody};
use crate::Decision;

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
            let mut keys = Vec::with_capacity(config.keys.len());
            for (extractor, limit) in config.keys.iter().zip(config.limiter.limits()) {
                let key = match (extractor.extract(&parts), &config.on_missing) {
                    (Some(key), _) => Some(key),
                    (None, MissingKey::Skip) => None,
                    (None, MissingKey::Shared(key)) => Some(key.clone().into_bytes()),
                    (None, MissingKey::Reject(status)) => {
                        tracing::debug!(target: "tower_ratelimit", limit = limit.name(), "request without a rate-limit key");
                        let why = Rejection::MissingKey(limit.name());
                        return Ok(rejection(&config, why, || {
                            missing_key(*status, limit.name())
                        }));
                    }
                };
                keys.push(key);
            }
            let cost = config
                .cost
                .as_ref()
                .map_or(config.fixed_cost, |cost| cost(&parts));
            let mut store_failed = false;
            let decision = match config
                .limiter
                .decide_present(&keys, cost, config.max_delay)
                .await
            {
                None => None,
                Some(Ok(decision)) => {
                    config.outage.success();
                    Some(decision)
                }
                Some(Err(error)) => {
                    store_failed = true;
                    match (config.on_error, &config.fallback) {
                        (OnStoreError::FallbackToMemory, Some(fallback)) => {
                            config.outage.failure(&error, "deciding in memory");
                            match fallback.decide_present(&keys, cost, config.max_delay).await {
                                Some(Ok(decision)) => Some(decision),
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
            let Some(decision) = decision else {
                let mut request = Request::from_parts(parts, body);
                request
                    .extensions_mut()
                    .insert(RateLimitInfo::new(None, store_failed));
                let response = forward(inner, request).await?;
                return Ok(response.map(ResponseBody::inner));
            };
            if !decision.is_allowed() {
                let violated: Vec<&str> = decision.violated().map(|s| s.name()).collect();
                tracing::debug!(target: "tower_ratelimit", limits = ?violated, retry_after = ?decision.retry_after(), "request rate-limited");
                let mut response = rejection(&config, Rejection::Limited(&decision), || {
                    too_many_requests(&decision)
                });
                insert_retry_after(response.headers_mut(), &decision);
                insert_headers(response.headers_mut(), &decision, &config.headers);
                return Ok(response);
            }
            if !decision.wait().is_zero() {
                tokio::time::sleep(decision.wait()).await;
            }
            let mut request = Request::from_parts(parts, body);
            let extensions = request.extensions_mut();
            extensions.insert::<Decision>(decision.clone());
            extensions.insert(RateLimitInfo::new(Some(decision.clone()), store_failed));
            let mut response = forward(inner, request).await?.map(ResponseBody::inner);
            insert_headers(response.headers_mut(), &decision, &config.headers);
            Ok(response)
        });
        ResponseFuture { inner }
    }
}
