//! The [`RateLimit`] service: one path for every request, [`decide`]
//! (the limits chosen in `choose.rs`, the limiter's one call, the layer's
//! own answers made in `refusal.rs`) then [`respond`] (forwarded in place,
//! or served in `serve_granted` when something follows the grant).

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use http::request::Parts;
use http::{Request, Response};
use smallvec::SmallVec;
use tower_service::Service;

use super::after::After;
use super::choose::{checks_of, choose, cost_of, estimate_too_large};
use super::future::ResponseFuture;
use super::refusal::{after_failure, deny_listed, refused, AfterFailure};
use super::response::Fields;
use super::{Config, RateLimitInfo, ResponseBody};
use crate::limiter::{Ask, Refund, RefundOnDrop};
use crate::store::Answer;
use crate::Grant;

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
async fn ready_and_call<S, R>(mut inner: S, request: R) -> Result<S::Response, S::Error>
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

    /// One path: `decide`, then `respond`. Where nothing can make the
    /// decision wait (a store that answers at once, no refund, no delay,
    /// no shadow limit, no resolved plan: `Config::at_once`), it is polled
    /// here, once, and the response future is the inner service's own (or
    /// the layer's answer); otherwise both steps run in a boxed future.
    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let RateLimit { inner, config } = self;
        let (mut parts, body) = request.into_parts();
        if config.deny.as_ref().is_some_and(|deny| deny(&parts)) {
            return ResponseFuture::ready(Ok(deny_listed(config, &parts)));
        }
        if config.skip.as_ref().is_some_and(|skip| skip(&parts)) {
            // exempt: never counted, never refused
            let info = RateLimitInfo::new(None, false);
            return forward(inner, parts, body, info, None);
        }
        if config.at_once {
            let decided = {
                let decided = std::pin::pin!(decide(config, &mut parts));
                decided.poll(&mut Context::from_waker(Waker::noop()))
            };
            if let Poll::Ready(step) = decided {
                return respond(inner, config, parts, body, step);
            }
            // (not reached: `at_once` holds only where nothing is awaited;
            // were it, the request would be decided again below: counted
            // twice, never admitted over a limit)
        }
        let mut inner = inner.clone();
        let config = config.clone();
        ResponseFuture::boxed(async move {
            let step = decide(&config, &mut parts).await;
            respond(&mut inner, &config, parts, body, step).await
        })
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

/// What the layer decided of a request.
enum Step<B> {
    /// Answer this: refused, no key where the rule requires one, or the
    /// store failed and the layer fails closed.
    Answer(Response<ResponseBody<B>>),
    /// Forward undecided: no limit applies, or the store failed open.
    Pass { store_failed: bool },
    /// Forward the granted request.
    Granted(Granted),
}

/// A granted request: its grant, the rule of each limit charged, its cost,
/// whether the store failed (decided by the fallback), and its place among
/// the requests that may wait (delay mode), held until the wait ends.
struct Granted {
    grant: Grant,
    charged_rules: SmallVec<[usize; 2]>,
    cost: u64,
    store_failed: bool,
    place: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// The decision of a request: its limits chosen (a resolved rule's plan
/// read first), decided by the limiter in one call (by the fallback when
/// the store fails, per `OnStoreError`), a refusal answered.
async fn decide<B>(config: &Config, parts: &mut Parts) -> Step<B> {
    // the plans of resolved rules, read while choosing (boxed: rare)
    #[cfg(feature = "resolver")]
    if config.rules.iter().any(|rule| rule.is_resolved()) {
        Box::pin(super::resolved::resolve(config, parts)).await;
    }
    let chosen = match choose(config, parts) {
        Ok(chosen) => chosen,
        Err(answer) => return Step::Answer(answer),
    };
    #[cfg(feature = "resolver")]
    super::resolved::forget(parts);
    if chosen.is_empty() {
        return Step::Pass {
            store_failed: false,
        };
    }
    let cost = cost_of(config, parts);
    if let Some(share) = config.estimates {
        if let Some(answer) = estimate_too_large(config, parts, &chosen, cost, share) {
            return Step::Answer(answer);
        }
    }
    let checks = checks_of(&chosen, cost);
    // a place among the requests that may wait, while one is free
    let place = config
        .waiting
        .as_ref()
        .and_then(|waiting| waiting.clone().try_acquire_owned().ok());
    let delay = match place {
        Some(_) => config.max_delay,
        None => std::time::Duration::ZERO,
    };
    let ask = Ask::ahead(delay, config.refundable);
    // (matched here rather than through `Answer::get`: one future less
    // around a decision made at once)
    let decided = match config.limiter.answer(&checks, ask) {
        Answer::Now(result) => result,
        Answer::Later(future) => future.await,
    };
    let (grant, store_failed) = match decided {
        Ok(grant) => {
            config.outage.success();
            (grant, false)
        }
        Err(error) => match after_failure(config, parts, &error) {
            AfterFailure::Fallback(fallback) => {
                match Box::pin(fallback.answer(&checks, ask).get()).await {
                    Ok(grant) => (grant, true),
                    Err(_) => return Step::Pass { store_failed: true },
                }
            }
            AfterFailure::Answer(answer) => return Step::Answer(answer),
            AfterFailure::Pass => return Step::Pass { store_failed: true },
        },
    };
    let decision = grant.decision();
    if !decision.is_allowed() {
        return Step::Answer(refused(config, parts, decision, &decision.without_shadow()));
    }
    // the rule of each limit the grant was charged to, for what follows a
    // grant that can be given back
    let charged_rules = match grant.refund {
        Some(_) => chosen
            .iter()
            .zip(decision.statuses())
            .filter(|(_, status)| !status.would_refuse())
            .map(|((_, _, rule), _)| *rule)
            .collect(),
        None => SmallVec::new(),
    };
    Step::Granted(Granted {
        grant,
        charged_rules,
        cost,
        store_failed,
        place,
    })
}

/// The response future of a decided request: the layer's answer, or the
/// request forwarded; a grant with nothing after it (no wait, nothing to
/// give back) is forwarded in place, the others in [`serve_granted`].
fn respond<S, ReqBody, ResBody>(
    inner: &mut S,
    config: &Arc<Config>,
    parts: Parts,
    body: ReqBody,
    step: Step<ResBody>,
) -> ResponseFuture<S::Future, ResBody, S::Error>
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    match step {
        Step::Answer(answer) => ResponseFuture::ready(Ok(answer)),
        Step::Pass { store_failed } => {
            let info = RateLimitInfo::new(None, store_failed);
            forward(inner, parts, body, info, None)
        }
        Step::Granted(granted)
            if granted.grant.refund.is_none() && granted.grant.decision.delay().is_zero() =>
        {
            let decision = granted.grant.into_decision();
            let fields = Fields::of(&decision.without_shadow(), &config.headers);
            let info = RateLimitInfo::new(Some(decision), granted.store_failed);
            forward(inner, parts, body, info, fields)
        }
        Step::Granted(granted) => {
            let inner = inner.clone();
            let config = config.clone();
            ResponseFuture::boxed(serve_granted(inner, config, parts, body, granted))
        }
    }
}

/// Forwards a request with `info` among its extensions (put into the parts
/// before they are rejoined: the request is not moved again): to the inner
/// service itself when it is ready now, else to a clone readied in the
/// future.
fn forward<S, ReqBody, ResBody>(
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
                let response = ready_and_call(readying, request).await?;
                let mut response = response.map(ResponseBody::inner);
                if let Some(fields) = fields {
                    fields.apply(response.headers_mut());
                }
                Ok(response)
            })
        }
    }
}

/// Serves a grant with something after it: a reservation's wait, a
/// permit held through the response, a refund per the response, a charge
/// settled after it.
async fn serve_granted<S, ReqBody, ResBody>(
    mut inner: S,
    config: Arc<Config>,
    parts: Parts,
    body: ReqBody,
    granted: Granted,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Inner<ReqBody, ResBody>,
{
    let Granted {
        grant: Grant { decision, refund },
        charged_rules,
        cost,
        store_failed,
        place,
    } = granted;
    let refund = if decision.delay().is_zero() {
        refund
    } else {
        wait_for(decision.delay(), refund).await
    };
    drop(place);
    // the permits of concurrency limits, held (and renewed) from now
    // until the response body ends: given back at once when this
    // future is dropped (the client went away) or the inner service
    // fails, and at the latest at their maximum hold
    let lease = refund
        .as_ref()
        .and_then(|refund| refund.hold_leases(crate::DEFAULT_MAX_HOLD));
    let shown = decision.without_shadow();
    let mut fields = Fields::of(&shown, &config.headers);
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
    if let Some(refund) = refund {
        let given_back;
        (response, given_back) = give_back(&config, &refund, &charged_rules, response).await;
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
}

/// Waits out a reservation; a request dropped while it waits gives its
/// slot back.
async fn wait_for(wait: std::time::Duration, refund: Option<Refund>) -> Option<Refund> {
    let reservation = RefundOnDrop::new(refund);
    tokio::time::sleep(wait).await;
    reservation.disarm()
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
