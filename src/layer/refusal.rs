//! The layer's own responses: a refusal, a deny-listed request, a store
//! failure (per [`OnStoreError`]); a custom handler's when there is one.

use std::time::Duration;

use http::request::Parts;
use http::Response;
use smallvec::SmallVec;

use super::body::RejectionResponse;
use super::response::{
    insert_headers, insert_retry_after, service_unavailable, too_many_requests, Protocol,
};
use super::{Config, OnStoreError, Rejection, ResponseBody};
use crate::{Decision, Error, Limiter};

/// The layer's response for `why`: the custom handler's, else `default`. An
/// estimate too large or unreadable is counted here, under its limit
/// ([`Outcome::EstimateTooLarge`](crate::metrics::Outcome::EstimateTooLarge)):
/// no decision counts it.
pub(super) fn rejection<B>(
    config: &Config,
    why: Rejection<'_>,
    default: impl FnOnce() -> RejectionResponse,
) -> Response<ResponseBody<B>> {
    match &why {
        Rejection::EstimateTooLarge { limit, .. } => {
            crate::limit::Name::count(limit, crate::metrics::Outcome::EstimateTooLarge);
        }
        Rejection::EstimateUnreadable { limit } => {
            crate::limit::Name::count(limit, crate::metrics::Outcome::EstimateUnreadable);
        }
        _ => {}
    }
    let response = match &config.rejector {
        Some(handler) => handler(&why),
        None => default(),
    };
    response.map(ResponseBody::rejection)
}

/// The 429 (or gRPC status) for a refused decision of the request with head
/// `parts` (`shown`: the decision without its shadow limits).
pub(super) fn refused<B>(
    config: &Config,
    parts: &Parts,
    decision: &Decision,
    shown: &Decision,
) -> Response<ResponseBody<B>> {
    let violated: SmallVec<[&str; 2]> = decision.violated_limits().map(|s| s.name()).collect();
    tracing::debug!(target: "tower_ratelimit", limits = ?violated, retry_after = ?decision.retry_after(), "request rate-limited");
    let mut response = rejection(config, Rejection::Limited(decision), || {
        Protocol::of(parts).refused(decision)
    });
    insert_retry_after(response.headers_mut(), decision);
    insert_headers(response.headers_mut(), shown, &config.headers);
    response
}

/// The 403 (or `PERMISSION_DENIED`) for a request of the deny-list, counted
/// under every limit of the layer.
#[cold]
pub(super) fn deny_listed<B>(config: &Config, parts: &Parts) -> Response<ResponseBody<B>> {
    tracing::debug!(target: "tower_ratelimit", "request refused by the deny-list");
    for rule in &config.rules {
        crate::limiter::count::count_one(&rule.limit().load(), crate::metrics::Outcome::DenyListed);
    }
    rejection(config, Rejection::DenyListed, || {
        Protocol::of(parts).forbidden()
    })
}

/// What a store failure leads to, per [`OnStoreError`].
pub(super) enum AfterFailure<'a, B> {
    /// Decide with the in-process fallback.
    Fallback(&'a Limiter),
    /// Reject the request with this response (fail closed).
    Reject(Response<ResponseBody<B>>),
    /// Forward without a decision (fail open).
    Pass,
}

pub(super) fn after_failure<'a, B>(
    config: &'a Config,
    parts: &Parts,
    error: &Error,
) -> AfterFailure<'a, B> {
    match (config.on_error, &config.fallback) {
        (OnStoreError::FallbackToMemory, Some(fallback)) => {
            config.outage.failure(error, "deciding in memory");
            AfterFailure::Fallback(fallback)
        }
        (OnStoreError::FailClosed { retry_after }, _) => {
            config.outage.failure(error, "refusing requests");
            let why = Rejection::StoreFailed(error);
            let response = || Protocol::of(parts).store_unavailable(retry_after);
            AfterFailure::Reject(rejection(config, why, response))
        }
        _ => {
            config.outage.failure(error, "letting requests through");
            AfterFailure::Pass
        }
    }
}

/// The layer's refusal of a [`Decision`], as a response a handler returns
/// when it calls a [`Limiter`] itself: 429 (without `Retry-After` when the
/// cost can never fit), `Retry-After`, `Cache-Control: no-store`, the
/// `RateLimit-Policy` and `RateLimit` fields (shadow limits left out), and
/// the `quota-exceeded` problem body, as the layer responds. Made by
/// [`Refusal::of`]; returned from an axum handler (it implements
/// `IntoResponse`, feature `axum`) or turned into an `http::Response` of
/// any body made from a `String`.
///
/// ```
/// use tower_ratelimit::layer::Refusal;
/// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let limiter = Limiter::new(MemoryStore::new(), Limit::new("login", Quota::per_minute(1).sliding_log())?);
/// assert!(Refusal::of(&limiter.check("ann", 1).await?).is_none()); // allowed
/// let refusal = Refusal::of(&limiter.check("ann", 1).await?).expect("refused");
/// let response: http::Response<String> = refusal.into();
/// assert_eq!(response.status(), 429);
/// assert_eq!(response.headers()["retry-after"], "60");
/// assert_eq!(response.headers()["ratelimit"], "\"login\";r=0;t=60");
/// assert!(response.body().contains("quota-exceeded"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Debug)]
pub struct Refusal(Response<String>);

impl Refusal {
    /// The layer's refusal of `decision` as a response, for a handler that
    /// calls the limiter itself; `None` when it was allowed.
    pub fn of(decision: &Decision) -> Option<Refusal> {
        if decision.is_allowed() {
            return None;
        }
        let mut response = too_many_requests(decision);
        insert_retry_after(response.headers_mut(), decision);
        decision.insert_headers(response.headers_mut());
        Some(Refusal(response))
    }
}

impl<B: From<String>> From<Refusal> for Response<B> {
    fn from(refusal: Refusal) -> Self {
        refusal.0.map(B::from)
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl axum::response::IntoResponse for Refusal {
    fn into_response(self) -> axum::response::Response {
        self.into()
    }
}

/// The layer's response when its store fails and it fails closed
/// ([`OnStoreError::FailClosed`], the default), as a response a handler
/// returns when it calls a [`Limiter`] itself and the call fails: 503
/// Service Unavailable, `Retry-After`, `Cache-Control: no-store` and an
/// RFC 9457 problem body (`about:blank`) with a generic detail. Nothing of
/// the error is in it (Redis and Lua messages, addresses are for the
/// logs). Made by [`Unavailable::of`] with the layer's default
/// `Retry-After` of 1 s; [`retry_after`](Self::retry_after) sets another.
/// Returned from an axum handler (it implements `IntoResponse`, feature
/// `axum`) or turned into an `http::Response` of any body made from a
/// `String`.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::layer::Unavailable;
/// use tower_ratelimit::Error;
///
/// let error = Error::Timeout(Duration::from_millis(50)); // as limiter.check(..) may fail
/// let response: http::Response<String> = Unavailable::of(&error).into();
/// assert_eq!(response.status(), 503);
/// assert_eq!(response.headers()["retry-after"], "1");
/// assert_eq!(response.headers()["content-type"], "application/problem+json");
/// assert!(!response.body().contains("50ms"));
///
/// let later: http::Response<String> = Unavailable::of(&error).retry_after(Duration::from_secs(5)).into();
/// assert_eq!(later.headers()["retry-after"], "5");
/// ```
#[derive(Debug)]
pub struct Unavailable(Response<String>);

impl Unavailable {
    /// The layer's response to the store failure `error` when it fails closed
    /// (the default [`OnStoreError`]): 503, `Retry-After: 1`, and a problem
    /// body that says nothing of the error, for a handler that calls a
    /// [`Limiter`] itself and fails closed as the layer does;
    /// [`retry_after`](Self::retry_after) sets another wait.
    ///
    /// It is the same for every error, as the layer's is; the errors a
    /// caller's own arguments cause ([`EmptyKey`](Error::EmptyKey),
    /// [`KeyCount`](Error::KeyCount), [`WaitTooLong`](Error::WaitTooLong),
    /// [`Config`](Error::Config)) are better met otherwise (a request
    /// without a key: 400, as the layer's [`MissingKey`](super::MissingKey)
    /// default).
    ///
    /// ```
    /// # #[cfg(feature = "redis")] {
    /// use tower_ratelimit::layer::Unavailable;
    /// use tower_ratelimit::{Limit, Limiter, Quota, RedisStore};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// // nothing listens on port 1: the check fails
    /// let store = RedisStore::new("redis://127.0.0.1:1/")?;
    /// let limiter = Limiter::new(store, Limit::new("sms", Quota::per_hour(3).fixed_window())?);
    /// let response: http::Response<String> = match limiter.check("+15550100", 1).await {
    ///     Ok(decision) => http::Response::new(format!("{} left", decision.remaining())),
    ///     Err(error) => Unavailable::of(&error).into(),
    /// };
    /// assert_eq!(response.status(), 503);
    /// assert_eq!(response.headers()["retry-after"], "1");
    /// assert!(!response.body().contains("127.0.0.1"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// # }
    /// ```
    pub fn of(error: &Error) -> Unavailable {
        // nothing of the error is told: it is for the logs
        let _ = error;
        Unavailable::new(super::FAIL_CLOSED_RETRY_AFTER)
    }

    /// The response with `Retry-After` for `retry_after` (whole seconds,
    /// rounded up, at least 1).
    pub(crate) fn new(retry_after: Duration) -> Unavailable {
        Unavailable(service_unavailable(retry_after))
    }

    /// The same response with `Retry-After` for `retry_after` (whole
    /// seconds, rounded up, at least 1), as a layer configured with
    /// `OnStoreError::FailClosed { retry_after }` sends it.
    #[must_use]
    pub fn retry_after(self, retry_after: Duration) -> Unavailable {
        Unavailable::new(retry_after)
    }
}

impl<B: From<String>> From<Unavailable> for Response<B> {
    fn from(unavailable: Unavailable) -> Self {
        unavailable.0.map(B::from)
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl axum::response::IntoResponse for Unavailable {
    fn into_response(self) -> axum::response::Response {
        self.into()
    }
}

/// A handler's response to a decision it asked of a [`Limiter`] itself, as
/// the layer would respond: `granted` with the decision's rate-limit fields
/// ([`Decision::insert_headers`]) when it was allowed, the layer's 429
/// ([`Refusal::of`]) when it was refused, the layer's 503
/// ([`Unavailable::of`]) when the store failed.
///
/// ```
/// use tower_ratelimit::layer::respond;
/// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// // 3 SMS per phone number per minute; 202 when queued
/// let sms = Limiter::new(MemoryStore::new(), Limit::new("sms", Quota::per_minute(3).sliding_log())?);
/// let queued = || http::Response::builder().status(202).body(String::new()).unwrap();
/// for _ in 0..3 {
///     let response = respond(sms.check("+15550100", 1).await, queued());
///     assert_eq!(response.status(), 202);
///     assert!(response.headers().contains_key("ratelimit"));
/// }
/// let response = respond(sms.check("+15550100", 1).await, queued());
/// assert_eq!(response.status(), 429);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
pub fn respond<B: From<String>>(
    decided: Result<Decision, crate::Error>,
    granted: Response<B>,
) -> Response<B> {
    match decided {
        Err(error) => Unavailable::of(&error).into(),
        Ok(decision) => match Refusal::of(&decision) {
            Some(refusal) => refusal.into(),
            None => {
                let mut granted = granted;
                decision.insert_headers(granted.headers_mut());
                granted
            }
        },
    }
}
