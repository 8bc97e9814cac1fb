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

use super::after::{give_back, wait_for, After};
use super::choose::{checks_of, choose};
use super::future::ResponseFuture;
use super::refusal::{after_failure, deny_listed, refused, AfterFailure};
use super::{Config, RateLimitInfo, ResponseBody};
use crate::fields::Fields;
use crate::limiter::Ask;
use crate::store::Answer;
use crate::{Decision, Grant};

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

    /// The operator's handle on the limits of its layer, as
    /// [`RateLimitLayer::admin`](super::RateLimitLayer::admin) gives it.
    pub fn admin(&self) -> crate::Admin<'_> {
        self.config.limiter.admin()
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

/// What the layer decided of a request. Small enough to move without a
/// `memcpy` call (what is rare is boxed): it is the output of the decision
/// polled inside `call`.
enum Step<B> {
    /// Reject the request with this response: no key where the rule
    /// requires one, an estimate over its cap, or the store failed and the
    /// layer fails closed.
    Reject(Box<Response<ResponseBody<B>>>),
    /// Refused: answered 429 in `respond`.
    Refused(Decision),
    /// Forward the request, its [`RateLimitInfo`] already among its
    /// extensions, and add these fields to its response.
    Forward(Option<Fields>),
    /// Serve a grant with something after it (see [`serve_granted`]).
    Serve(Box<Granted>),
}

/// A granted request with something after its grant: its grant, the rule
/// of each of its decision's checks (each charge names its check), whether
/// the store failed (decided by the fallback), and its place among the
/// requests that may wait (delay mode), held until the wait ends.
struct Granted {
    grant: Grant,
    rules: SmallVec<[usize; 2]>,
    store_failed: bool,
    place: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// The decision of a request: its limits chosen (a resolved rule's plan
/// read first), decided by the limiter in one call (by the fallback when
/// the store fails, per `OnStoreError`), a refusal answered; a request
/// forwarded as it is gets its [`RateLimitInfo`] here.
async fn decide<B>(config: &Config, parts: &mut Parts) -> Step<B> {
    // forwarded undecided: no limit applies, or the store failed open
    let pass = |parts: &mut Parts, store_failed| {
        parts
            .extensions
            .insert(RateLimitInfo::new(None, store_failed));
        Step::Forward(None)
    };
    // the plans of resolved rules, read while choosing (boxed: rare)
    #[cfg(feature = "resolver")]
    let resolving = config.rules.iter().any(|rule| rule.is_resolved());
    #[cfg(feature = "resolver")]
    if resolving {
        if let Err(failed) = Box::pin(super::resolved::resolve(config, parts)).await {
            return Step::Reject(Box::new(failed));
        }
    }
    let chosen = match choose(config, parts) {
        Ok(chosen) => chosen,
        Err(rejected) => return Step::Reject(Box::new(rejected)),
    };
    // what was resolved, for the handler
    #[cfg(feature = "resolver")]
    if resolving {
        super::resolved::hand_over(parts);
    }
    if chosen.is_empty() {
        return pass(parts, false);
    }
    let checks = checks_of(&chosen);
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
    let store_failed = decided.is_err();
    let grant = match decided {
        Ok(grant) => {
            config.outage.success();
            grant
        }
        Err(error) => match after_failure(config, parts, &error) {
            AfterFailure::Fallback(fallback) => {
                match Box::pin(fallback.answer(&checks, ask).get()).await {
                    Ok(grant) => grant,
                    Err(_) => return pass(parts, true),
                }
            }
            AfterFailure::Reject(rejected) => return Step::Reject(Box::new(rejected)),
            AfterFailure::Pass => return pass(parts, true),
        },
    };
    if !grant.decision.is_allowed() {
        return Step::Refused(grant.into_decision());
    }
    if grant.refund.is_none() && grant.decision.delay().is_zero() {
        // nothing after the grant: forwarded as it is
        let decision = grant.into_decision();
        let fields = decision.without_shadow().fields(&config.headers);
        let info = RateLimitInfo::new(Some(decision), store_failed);
        parts.extensions.insert(info);
        return Step::Forward(fields);
    }
    // the rule of each check, for what follows a grant that can be given
    // back
    let rules = match grant.refund {
        Some(_) => chosen.iter().map(|applies| applies.rule).collect(),
        None => SmallVec::new(),
    };
    Step::Serve(Box::new(Granted {
        grant,
        rules,
        store_failed,
        place,
    }))
}

/// The response future of a decided request: the layer's answer, or the
/// request forwarded; a grant with nothing after it (no wait, nothing to
/// give back) is forwarded in place, the others in [`serve_granted`].
#[inline(always)]
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
        Step::Reject(rejected) => ResponseFuture::ready(Ok(*rejected)),
        Step::Refused(decision) => {
            let refused = refused(config, &parts, &decision, &decision.without_shadow());
            ResponseFuture::ready(Ok(refused))
        }
        Step::Forward(fields) => forward(inner, parts, body, fields),
        Step::Serve(granted) => {
            let inner = inner.clone();
            let config = config.clone();
            ResponseFuture::boxed(serve_granted(inner, config, parts, body, *granted))
        }
    }
}

/// Forwards a request (its [`RateLimitInfo`] put into its parts before
/// they are rejoined: the request is not moved again): to the inner
/// service itself when it is ready now, else to a clone readied in the
/// future.
fn forward<S, ReqBody, ResBody>(
    inner: &mut S,
    parts: Parts,
    body: ReqBody,
    fields: Option<Fields>,
) -> ResponseFuture<S::Future, ResBody, S::Error>
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
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
        rules,
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
    // fails, a lease time after the client stopped reading the body, and
    // at their maximum hold if they set one
    let lease = refund.as_ref().and_then(|refund| refund.hold_leases());
    let shown = decision.without_shadow();
    let mut fields = shown.fields(&config.headers);
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
        (response, given_back) = give_back(&config, &refund, &rules, response).await;
        if let (Some(mut shown), false) = (shown, given_back.is_empty()) {
            let charged = refund.charged();
            let each = given_back.iter().map(|&j| {
                let amount = u64::try_from(charged[j].cost).unwrap_or(0);
                (charged[j].limit.name(), amount)
            });
            shown.given_back(each);
            fields = shown.fields(&config.headers);
        }
        if config.settles_after {
            let (head, body) = response.into_parts();
            after = After::of(&config, &refund, &rules, &given_back, &head, lease);
            response = Response::from_parts(head, body);
        }
    }
    if let Some(fields) = fields {
        fields.apply(response.headers_mut());
    }
    Ok(response.map(|body| ResponseBody::settled_after(body, after)))
}
