//! The [`RateLimit`] service and its response future; the limits that
//! apply to a request are chosen in `choose.rs`, the layer's own answers
//! made in `refusal.rs`.

use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use http::request::Parts;
use http::{Request, Response};
use smallvec::SmallVec;
use tower_service::Service;

use super::after::After;
use super::choose::{checks_of, choose, cost_of};
use super::future::ResponseFuture;
use super::refusal::{after_failure, deny_listed, refused, AfterFailure};
use super::response::Fields;
use super::{Config, RateLimitInfo, ResponseBody};
use crate::limiter::{Refund, RefundOnDrop};
use crate::{Error, Grant};

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
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    /// Always ready, reserving nothing. The inner service is readied once
    /// the request is granted (after the store round trip and any
    /// delay-mode wait), inside the response future on a clone of it, as
    /// `axum::middleware::from_fn` does; over a store that answers at once,
    /// within `call`, and called at once when it is ready then. Readying it
    /// here would hold what its readiness reserves (a `ConcurrencyLimit`
    /// permit, a `Buffer` slot) across the decision and the wait, so a
    /// request sleeping in delay mode would block requests that are granted
    /// at once, and refused requests would take capacity for nothing. The
    /// inner service's backpressure still applies: the future waits for it
    /// before calling it.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let RateLimit { inner, config } = self;
        let (parts, body) = request.into_parts();
        if config.deny.as_ref().is_some_and(|deny| deny(&parts)) {
            return ResponseFuture::ready(Ok(deny_listed(config, &parts)));
        }
        if config.skip.as_ref().is_some_and(|skip| skip(&parts)) {
            // exempt: never counted, never refused
            return forward_now(inner, parts, body, RateLimitInfo::new(None, false), None);
        }
        if !config.at_once {
            return call_later(inner, config, parts, body, None);
        }
        match decide_at_once(config, &parts) {
            AtOnce::Answer(answer) => ResponseFuture::ready(Ok(answer)),
            AtOnce::Forward(info, fields) => forward_now(inner, parts, body, info, fields),
            AtOnce::Later(failed) => call_later(inner, config, parts, body, failed),
        }
    }
}

/// The inner service as the functions below need it: the bounds of the
/// `Service` impl above, named once (the associated types' bounds are
/// implied wherever `Inner` is).
trait Inner<ReqBody, ResBody>:
    Service<
        Request<ReqBody>,
        Response = Response<ResBody>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

// (every service that meets the bounds: `Inner` names them, nothing more)
impl<S, ReqBody, ResBody> Inner<ReqBody, ResBody> for S where
    S: Service<
            Request<ReqBody>,
            Response = Response<ResBody>,
            Future: Send + 'static,
            Error: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// What [`decide_at_once`] found.
enum AtOnce<B> {
    /// Answer this (refused, or no key where the rule requires one).
    Answer(Response<ResponseBody<B>>),
    /// Forward the request with this information and these fields.
    Forward(RateLimitInfo, Option<Fields>),
    /// Decide in the response future after all: the decision is not made
    /// at once (a limit in shadow mode), or the store failed (`Some`), and
    /// what follows a failure is decided there.
    Later(Option<Box<Error>>),
}

/// The decision within `call`, over a store that answers at once with
/// nothing reserved ahead or given back: the steps of [`call_later`]'s
/// common path, not awaited.
fn decide_at_once<B>(config: &Config, parts: &Parts) -> AtOnce<B> {
    let chosen = match choose(config, parts) {
        Ok(chosen) => chosen,
        Err(answer) => return AtOnce::Answer(answer),
    };
    if chosen.is_empty() {
        return AtOnce::Forward(RateLimitInfo::new(None, false), None);
    }
    let checks = checks_of(&chosen, cost_of(config, parts));
    let decision = match config.limiter.decide_checks_now(&checks) {
        Some(Ok(decision)) => decision,
        Some(Err(error)) => return AtOnce::Later(Some(Box::new(error))),
        None => return AtOnce::Later(None),
    };
    config.outage.success();
    if !decision.is_allowed() {
        return AtOnce::Answer(refused(config, parts, &decision, &decision));
    }
    let fields = Fields::of(&decision, &config.headers);
    AtOnce::Forward(RateLimitInfo::new(Some(decision), false), fields)
}

/// Forwards a request decided within `call`, with `info` among its
/// extensions (put into the parts before they are rejoined: the request is
/// not moved again): to the inner service itself when it is ready now, else
/// to a clone readied in the future.
fn forward_now<S, ReqBody, ResBody>(
    inner: &mut S,
    mut parts: Parts,
    body: ReqBody,
    info: RateLimitInfo,
    fields: Option<Fields>,
) -> ResponseFuture<S::Future, ResBody, S::Error>
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    parts.extensions.insert(info);
    let request = Request::from_parts(parts, body);
    let mut cx = Context::from_waker(Waker::noop());
    match inner.poll_ready(&mut cx) {
        Poll::Ready(Ok(())) => ResponseFuture::inner(inner.call(request), fields),
        Poll::Ready(Err(error)) => ResponseFuture::ready(Err(error)),
        Poll::Pending => {
            // The service whose readiness is under way (it may hold a place
            // in a queue, as a `ConcurrencyLimit` or `Buffer` does) goes on
            // being readied in the future, with a real waker; a fresh clone
            // stays. Left behind, that place would take a freed permit that
            // no one polls.
            let clone = inner.clone();
            let readying = std::mem::replace(inner, clone);
            ResponseFuture::boxed(async move {
                let mut response = forward(readying, request).await?.map(ResponseBody::inner);
                if let Some(fields) = fields {
                    fields.apply(response.headers_mut());
                }
                Ok(response)
            })
        }
    }
}

/// Decides inside the response future: the store is awaited, or a grant
/// may be reserved ahead, given back or decided again. `failed`: the store
/// already failed this request's decision within `call` (see
/// [`decide_at_once`]); what follows is decided here, once.
///
/// The boxed future holds only the request, its keys and the awaits of the
/// common path (the decision, the inner service); the rare ones (a store
/// failure, a reservation's wait, a refund) are boxed apart. Every request
/// pays for this future's size: it is allocated and moved once.
fn call_later<S, ReqBody, ResBody>(
    inner: &mut S,
    config: &Arc<Config>,
    parts: Parts,
    body: ReqBody,
    failed: Option<Box<Error>>,
) -> ResponseFuture<S::Future, ResBody, S::Error>
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    let mut inner = inner.clone();
    let config = config.clone();
    ResponseFuture::boxed(async move {
        // the plans of resolved rules, read while choosing (boxed: rare)
        #[cfg(feature = "resolver")]
        let mut parts = parts;
        #[cfg(feature = "resolver")]
        if config.rules.iter().any(|rule| rule.is_resolved()) {
            Box::pin(super::resolved::resolve(&config, &mut parts)).await;
        }
        let chosen = match choose(&config, &parts) {
            Ok(chosen) => chosen,
            Err(answer) => return Ok(answer),
        };
        #[cfg(feature = "resolver")]
        super::resolved::forget(&mut parts);
        let cost = cost_of(&config, &parts);
        let checks = checks_of(&chosen, cost);
        // a place among the requests that may wait, while one is free
        let place = config
            .waiting
            .as_ref()
            .and_then(|waiting| waiting.clone().try_acquire_owned().ok());
        let delay = if place.is_some() {
            config.max_delay
        } else {
            std::time::Duration::ZERO
        };
        let refundable = config.refundable;
        let mut store_failed = false;
        let decided = match failed {
            Some(error) => Some(Err(*error)),
            None => {
                let decision = config.limiter.decide_checks(&checks, delay, refundable);
                decision.await
            }
        };
        let decided = match decided {
            None => None,
            Some(Ok(grant)) => {
                config.outage.success();
                Some(grant)
            }
            Some(Err(error)) => {
                store_failed = true;
                match after_failure(&config, &parts, &error) {
                    AfterFailure::Fallback(fallback) => {
                        let fallback = fallback.decide_checks(&checks, delay, refundable);
                        match Box::pin(fallback).await {
                            Some(Ok(grant)) => Some(grant),
                            _ => None,
                        }
                    }
                    AfterFailure::Answer(answer) => return Ok(answer),
                    AfterFailure::Pass => None,
                }
            }
        };
        drop(checks);
        let Some(Grant { decision, refund }) = decided else {
            let request = Request::from_parts(parts, body);
            return Box::pin(pass(inner, request, store_failed)).await;
        };
        if !decision.is_allowed() {
            return Ok(refused(
                &config,
                &parts,
                &decision,
                &decision.without_shadow(),
            ));
        }
        let refund = if decision.delay().is_zero() {
            refund
        } else {
            Box::pin(wait_for(decision.delay(), refund)).await
        };
        drop(place);
        // the permits of concurrency limits, held (and renewed) from now
        // until the response body ends: given back at once when this
        // future is dropped (the client went away) or the inner service
        // fails, and at the latest at their maximum hold
        let lease = refund
            .as_ref()
            .and_then(|refund| refund.hold_leases(crate::DEFAULT_MAX_HOLD));
        // the rule of each limit the grant was charged to
        let charged_rules: SmallVec<[usize; 2]> = chosen
            .iter()
            .zip(decision.statuses())
            .filter(|(_, status)| !status.would_refuse())
            .map(|((_, _, rule), _)| *rule)
            .collect();
        drop(chosen);
        let shown = decision.without_shadow();
        let fields = Fields::of(&shown, &config.headers);
        // what the fields show after a refund, kept where one may follow
        let shown = (refund.is_some() && config.refunds_on_response).then(|| shown.into_owned());
        let mut request = Request::from_parts(parts, body);
        let info = RateLimitInfo::new(Some(decision), store_failed);
        request.extensions_mut().insert(info);
        // readied only now (see `RateLimit::poll_ready`); called in place,
        // so that the request is not moved into a second future
        std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
        // (the response is large: moved as few times as the types allow)
        let mut response = inner.call(request).await?;
        let mut after = None;
        let mut fields = fields;
        if let Some(refund) = refund {
            let given_back;
            (response, given_back) =
                Box::pin(give_back(&config, &refund, &charged_rules, response)).await;
            if let (Some(mut shown), false) = (shown, given_back.is_empty()) {
                shown.given_back(given_back.iter().map(|&j| refund.charged()[j].0.name()));
                fields = Fields::of(&shown, &config.headers);
            }
            if config.settles_after {
                let (head, body) = response.into_parts();
                after = After::of(&config, &refund, &charged_rules, &head, cost, lease);
                response = Response::from_parts(head, body);
            }
        }
        if let Some(fields) = fields {
            fields.apply(response.headers_mut());
        }
        Ok(response.map(|body| ResponseBody::settled_after(body, after)))
    })
}

/// Waits out a reservation; a request dropped while it waits gives its
/// slot back.
async fn wait_for(wait: std::time::Duration, refund: Option<Refund>) -> Option<Refund> {
    let reservation = RefundOnDrop::new(refund);
    tokio::time::sleep(wait).await;
    reservation.disarm()
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
/// is returned, so that the client's next request sees it; with the
/// indices in `refund.charged()` of the limits it was given back in.
async fn give_back<B>(
    config: &Config,
    refund: &Refund,
    charged_rules: &[usize],
    response: Response<B>,
) -> (Response<B>, SmallVec<[usize; 2]>) {
    let (head, body) = response.into_parts();
    let all = config
        .refund_if
        .as_ref()
        .is_some_and(|refund| refund(&head));
    // (a lease is given back when the body ends, not here)
    let leased = |j: usize| {
        refund
            .charged()
            .get(j)
            .is_some_and(|(l, _)| l.is_concurrency())
    };
    let refunded = |j: usize| {
        !leased(j)
            && (all
                || charged_rules
                    .get(j)
                    .and_then(|&rule| config.rules.get(rule)?.refund_if.as_ref())
                    .is_some_and(|refund| refund(&head)))
    };
    let mut given_back: SmallVec<[usize; 2]> = (0..refund.charged().len())
        .filter(|&j| refunded(j))
        .collect();
    if !given_back.is_empty() {
        // (the predicates, the user's closures, are asked once per limit)
        let result = refund.run_some(|j| given_back.contains(&j)).await;
        match result {
            Ok(true) => {}
            Ok(false) => given_back.clear(),
            Err(error) => {
                given_back.clear();
                config
                    .outage
                    .failure(&error, "a request that should not count was counted");
            }
        }
    }
    (Response::from_parts(head, body), given_back)
}
