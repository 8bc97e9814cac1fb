//! What a layer settles once a response is known: a refund per the
//! response (`give_back`), a reservation's wait (`wait_for`), the leases of
//! concurrency limits, held until its body ends, and the costs charged
//! after it ([`Rule::cost_from_response`](super::Rule::cost_from_response),
//! [`Rule::cost_from_response_chunks`](super::Rule::cost_from_response_chunks)).

use std::sync::Arc;

use bytes::Bytes;
use http::response::Parts as ResponseParts;
use http::Response;
use smallvec::SmallVec;

use super::meter::{Meter, MeterSpec};
use super::{Config, Rule};
use crate::limiter::{run_detached, Charged, ChargedTo, LeaseGuard, Refund, RefundOnDrop};
use crate::Limiter;

/// How a rule's cost after the response is read (see
/// [`Rule::cost_from_response`], [`Rule::cost_from_response_chunks`]).
#[derive(Clone, Default)]
pub(crate) struct CostAfter {
    pub(crate) head: Option<HeadCost>,
    pub(crate) body: Option<BodyCost>,
    /// A cost read out of the body ([`Rule::cost_from_response_json`],
    /// [`Rule::cost_from_response_body`]), or why it cannot be.
    pub(crate) meter: Option<Result<MeterSpec, String>>,
    /// What a request costs in all when its response tells no cost
    /// ([`Rule::cost_if_untold`]).
    pub(crate) untold: Option<u64>,
}

pub(crate) type HeadCost = Arc<dyn Fn(&ResponseParts) -> Option<u64> + Send + Sync>;
pub(crate) type BodyCost = Arc<dyn Fn(&bytes::Bytes) -> u64 + Send + Sync>;

impl CostAfter {
    /// Whether the rule charges anything after the response.
    pub(crate) fn any(&self) -> bool {
        self.head.is_some() || self.body.is_some() || self.meter.is_some()
    }
}

/// Costs read from the response.
impl Rule {
    /// Charges this limit, after the response, the cost `cost` reads from
    /// its head (`None`: nothing more), such as the tokens an LLM reports:
    /// see [`cost_from_response_header`](Self::cost_from_response_header) for the common case
    /// and the module docs for the bound.
    ///
    /// The request's cost to this rule ([`cost`](Self::cost), 1 by
    /// default) is taken when it arrives, so a key already in debt is refused; once the
    /// response is known, what its cost exceeds that by is charged (see
    /// [`Limiter::charge`](crate::Limiter::charge)), whatever is left, on a
    /// task of its own: the response is not held up. With
    /// [`cost_from_response_chunks`](Self::cost_from_response_chunks) too, both are added, and the
    /// charge is made when the body ends. The response's RateLimit fields
    /// show the limit as the request found it, before its own charge.
    pub fn cost_from_response(
        mut self,
        cost: impl Fn(&ResponseParts) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.cost_after.head = Some(Arc::new(cost));
        self
    }

    /// [`cost_from_response`](Self::cost_from_response) read from the
    /// response header `name`: one JSON number token that is a whole
    /// number from 0 to 2^53 (`100`, `100.0`, `1e2`: the one grammar of a
    /// cost, see [`cost_from_request_header`](Self::cost_from_request_header)).
    /// Absent, given more than once or not such a number: no cost told.
    pub fn cost_from_response_header(self, name: http::HeaderName) -> Self {
        self.cost_from_response(move |response| {
            match crate::key::cost::of_header(&response.headers, &name) {
                crate::key::Told::Cost(cost) => Some(cost),
                _ => None,
            }
        })
    }

    /// What a request costs this limit in all when its response tells no
    /// cost (the response's head and body read as the rule says: a header
    /// absent, a stream without its usage, a compressed or unreadable
    /// body): the most a request may cost, say. Without it such a request
    /// costs what it paid on arrival: its [`cost`](Self::cost) (1 by
    /// default), or its [estimate](Self::settle_estimates), kept. With it,
    /// what `cost` exceeds that by is charged, as a cost told would be.
    /// A request dropped before its response pays only what it paid on
    /// arrival. Over the limit's capacity, or on a rule that reads no cost
    /// after the response, the layer does not build
    /// ([`ConfigError::Layer`](crate::ConfigError::Layer)).
    ///
    /// ```
    /// use tower_ratelimit::key::Global;
    /// use tower_ratelimit::layer::{RateLimitLayer, Rule};
    /// use tower_ratelimit::{Limit, Quota};
    ///
    /// // a call that reports no usage pays 4096 tokens, the most it may use
    /// let tokens = Limit::new("tokens", Quota::per_minute(100_000).sliding_window())?;
    /// let layer = RateLimitLayer::builder()
    ///     .rule(
    ///         Rule::new(tokens, Global)
    ///             .cost_from_response_json("usage.total_tokens")
    ///             .cost_if_untold(4096),
    ///     )
    ///     .build()?;
    /// # Ok::<(), tower_ratelimit::ConfigError>(())
    /// ```
    pub fn cost_if_untold(mut self, cost: u64) -> Self {
        self.cost_after.untold = Some(cost);
        self
    }

    /// Charges this limit, after the response, the cost `cost` counts in
    /// each chunk of its body as it streams (the bytes served:
    /// `|chunk| chunk.len() as u64`), when the body ends or is dropped (a
    /// client gone mid-stream pays for what it was sent). As with
    /// [`cost_from_response`](Self::cost_from_response), the request's own
    /// cost is taken when it arrives and only the excess is charged.
    pub fn cost_from_response_chunks(
        mut self,
        cost: impl Fn(&bytes::Bytes) -> u64 + Send + Sync + 'static,
    ) -> Self {
        self.cost_after.body = Some(Arc::new(cost));
        self
    }

    /// Charges this limit, after the response, the integer at the dotted
    /// `path` (`"usage.total_tokens"`) of the response's JSON body (a
    /// whole number from 0 to 2^53 in the one grammar of a cost: `100`,
    /// `100.0`, `1e2`; see
    /// [`cost_from_request_header`](Self::cost_from_request_header)), read
    /// as the body streams to the client (unchanged, and without waiting
    /// for its end), whatever its chunks, and settled when it ends or is
    /// dropped. A streamed response (`content-type: text/event-stream`,
    /// server-sent events, as a streamed completion is) tells the number
    /// at `path` in the JSON data of the last event that carries one, so
    /// a stream dropped mid-way tells the usage it had sent. A body that
    /// is not JSON, is cut short, is over 1 MiB, compressed (a
    /// `Content-Encoding` other than `identity`: the request forwarded asks
    /// for `Accept-Encoding: identity`), or has no such number there
    /// tells nothing (for an [estimate](Self::settle_estimates): it is
    /// kept; see also [`cost_if_untold`](Self::cost_if_untold)). A path
    /// with an empty segment is a build error
    /// ([`ConfigError::Layer`](crate::ConfigError::Layer)).
    ///
    /// ```
    /// use tower_ratelimit::key::Global;
    /// use tower_ratelimit::layer::{RateLimitLayer, Rule};
    /// use tower_ratelimit::{Limit, Quota};
    ///
    /// let tokens = Limit::new("tokens", Quota::per_minute(10_000).sliding_window())?;
    /// let layer = RateLimitLayer::builder()
    ///     .rule(
    ///         Rule::new(tokens, Global)
    ///             .cost_from_request_json("max_tokens") // (with ReadBody around the layer)
    ///             .cost_from_response_json("usage.total_tokens")
    ///             .settle_estimates(0.1),
    ///     )
    ///     .build()?;
    /// # Ok::<(), tower_ratelimit::ConfigError>(())
    /// ```
    pub fn cost_from_response_json(mut self, path: &str) -> Self {
        self.cost_after.meter = Some(MeterSpec::json_path(path));
        self
    }

    /// Charges this limit, after the response, what `cost` makes of its
    /// whole body (`None`: nothing told), kept up to `max_bytes` as it
    /// streams to the client; a longer body tells nothing, and so does a
    /// compressed one (the request forwarded asks for
    /// `Accept-Encoding: identity`).
    pub fn cost_from_response_body(
        mut self,
        max_bytes: usize,
        cost: impl Fn(&[u8]) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.cost_after.meter = Some(Ok(MeterSpec::Whole {
            max_bytes,
            cost: Arc::new(cost),
        }));
        self
    }
}

/// Held by a response body until it ends or is dropped; then settles each
/// rule's charge that its body tells (a charge the head tells is settled
/// once the head is known: see [`After::of`]) to the cost the response told (charging what it cost
/// beyond what the request paid that rule on arrival and, for an
/// estimate, giving back what it paid beyond its cost), and gives the
/// leases back.
pub(crate) struct After {
    limiter: Limiter,
    /// When the request was granted (what a refund gives back at).
    at: i64,
    charges: SmallVec<[Charge; 1]>,
    /// The waker the body's own body is polled with, while a lease is
    /// held: it tells the lease when that body's data is ready (see
    /// [`LeaseGuard::data_ready`]); and the server's waker it wakes.
    stall_waker: Option<(std::task::Waker, std::task::Waker)>,
    /// Dropped last: a lease is held until the charges are on their way.
    lease: Option<LeaseGuard>,
}

/// Wakes the server's task, first telling the lease that the body's data
/// is ready: from then, the server not asking for it is a stall.
struct StallWaker {
    lease: std::sync::Weak<crate::limiter::LeaseHeld>,
    server: std::task::Waker,
}

impl std::task::Wake for StallWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(held) = self.lease.upgrade() {
            LeaseGuard::data_ready_of(&held);
        }
        self.server.wake_by_ref();
    }
}

/// One rule's charge: its limit and key with what the request paid it on
/// arrival, the cost read from the response's head (`None`: not told), the
/// body's count so far, and whether the rule settles an estimate.
struct Charge {
    charged: ChargedTo,
    head: Option<u64>,
    body: Option<(BodyCost, u64)>,
    meter: Option<Meter>,
    estimate: bool,
    /// What the request costs in all when nothing is told.
    untold: Option<u64>,
}

impl After {
    /// What the grant `refund` leaves to settle once `head` is known: the
    /// charges of the rules that read a cost after the response (`rules`:
    /// the rule of each of the decision's checks), but those given back
    /// (`given_back`, indices in `refund.charged()`), and the permits held
    /// by `lease` since the decision. `None` when nothing.
    pub(crate) fn of(
        config: &Config,
        refund: &Refund,
        rules: &[usize],
        given_back: &[usize],
        head: &ResponseParts,
        lease: Option<LeaseGuard>,
    ) -> Option<Box<Self>> {
        let mut charges: SmallVec<[Charge; 1]> = SmallVec::new();
        for (j, charged) in refund.charged().iter().enumerate() {
            let rule = rules.get(charged.check).and_then(|&r| config.rules.get(r));
            let Some(rule) = rule.filter(|rule| rule.cost_after.any()) else {
                continue;
            };
            if given_back.contains(&j) {
                continue;
            }
            let after = &rule.cost_after;
            charges.push(Charge {
                charged: charged.clone(),
                head: after.head.as_ref().and_then(|cost| cost(head)),
                body: after.body.clone().map(|count| (count, 0)),
                meter: match &after.meter {
                    Some(Ok(spec)) => Some(spec.meter(head)),
                    _ => None,
                },
                estimate: rule.estimates.is_some(),
                untold: after.untold,
            });
        }
        // a cost the head tells is charged now, not when the body ends
        let told_by_head = |c: &Charge| c.body.is_none() && c.meter.is_none();
        if charges.iter().any(told_by_head) {
            let (now, later) = charges.into_iter().partition(told_by_head);
            settle(refund.limiter(), refund.at(), now);
            charges = later;
        }
        // the response goes to the server: from now, a client that does not
        // read it stalls
        if let Some(lease) = &lease {
            lease.handed_over();
        }
        (lease.is_some() || !charges.is_empty()).then(|| {
            Box::new(Self {
                stall_waker: None,
                limiter: refund.limiter().clone(),
                at: refund.at(),
                charges,
                lease,
            })
        })
    }

    /// The waker to poll the body's own body with, given the server's
    /// `waker`: one that tells the lease when data is ready, if one is
    /// held (made once per server waker).
    pub(crate) fn waker(&mut self, waker: &std::task::Waker) -> Option<std::task::Waker> {
        let lease = self.lease.as_ref()?.held()?;
        match &self.stall_waker {
            Some((ours, server)) if server.will_wake(waker) => Some(ours.clone()),
            _ => {
                let ours = std::task::Waker::from(Arc::new(StallWaker {
                    lease,
                    server: waker.clone(),
                }));
                self.stall_waker = Some((ours.clone(), waker.clone()));
                Some(ours)
            }
        }
    }

    /// The body gave the server a frame: the server asks for more at once,
    /// if the client reads.
    pub(crate) fn handed_over(&self) {
        if let Some(lease) = &self.lease {
            lease.handed_over();
        }
    }

    /// The body waits for its own data: no stall of the client.
    pub(crate) fn waiting(&self) {
        if let Some(lease) = &self.lease {
            lease.waiting();
        }
    }

    /// Whether the body's permits were held for their maximum hold, or by
    /// a client that stopped reading, and given back: the body ends.
    pub(crate) fn held_too_long(&self) -> bool {
        self.lease.as_ref().is_some_and(LeaseGuard::is_expired)
    }

    /// Wakes the body's task when its permits are given back for the
    /// maximum hold, so a body that waits for data ends then.
    pub(crate) fn wake_on_expiry(&self, waker: &std::task::Waker) {
        if let Some(lease) = &self.lease {
            lease.wake_on_expiry(waker);
        }
    }

    /// Counts a chunk of the body.
    pub(crate) fn count(&mut self, data: &Bytes) {
        for charge in &mut self.charges {
            if let Some((count, sum)) = &mut charge.body {
                *sum = sum.saturating_add(count(data));
            }
            if let Some(meter) = &mut charge.meter {
                meter.chunk(data);
            }
        }
    }
}

impl Charge {
    /// What settles this charge: the cost beyond what was paid, to charge,
    /// or, for an estimate whose cost was told, what was paid beyond it,
    /// to give back; `None` when the cost is what was paid.
    fn settlement(self) -> Option<(bool, ChargedTo)> {
        let metered = self.meter.and_then(Meter::finish);
        let told = self.head.is_some() || self.body.is_some() || metered.is_some();
        let body = self.body.map_or(0, |(_, sum)| sum);
        let cost = (self.head.unwrap_or(0))
            .saturating_add(body)
            .saturating_add(metered.unwrap_or(0));
        let cost = match self.untold {
            Some(untold) if !told => untold,
            _ => cost,
        };
        if !told && self.estimate {
            // the estimate the upstream was held to is binding
            crate::metrics::charged("estimate_kept");
        } else if !told && self.untold.is_some() {
            crate::metrics::charged("untold");
        }
        let cost = Limiter::cost(cost);
        let paid = self.charged.cost;
        let (charge, amount) = if cost > paid {
            (true, cost - paid)
        } else if self.estimate && told && paid > cost {
            (false, paid - cost)
        } else {
            return None;
        };
        Some((
            charge,
            ChargedTo {
                cost: amount,
                ..self.charged
            },
        ))
    }
}

impl Drop for After {
    fn drop(&mut self) {
        settle(&self.limiter, self.at, std::mem::take(&mut self.charges));
        // the leases go back once the charges are on their way
        drop(self.lease.take());
    }
}

/// Settles `charges` of a grant made at `at`, on a task of their own (at
/// once on a store that answers at once): every charge in one store call,
/// every surplus given back in one more.
fn settle(limiter: &Limiter, at: i64, charges: SmallVec<[Charge; 1]>) {
    let (mut charge, mut give_back): (Charged, Charged) = (Vec::new(), Vec::new());
    for settled in charges.into_iter().filter_map(Charge::settlement) {
        match settled {
            (true, charged) => charge.push(charged),
            (false, charged) => give_back.push(charged),
        }
    }
    if charge.is_empty() && give_back.is_empty() {
        return;
    }
    let at_once = limiter.answers_at_once();
    let limiter = limiter.clone();
    let work = async move {
        // (a failure is logged and counted by the limiter)
        if !charge.is_empty() {
            let _ = limiter.charge_charged(&charge).await;
        }
        if !give_back.is_empty() {
            if let Err(error) = limiter.refund_charged(&give_back, at).await {
                tracing::warn!(target: "tower_ratelimit", %error, "an estimate's surplus could not be given back: it stays counted");
            }
        }
    };
    run_detached(work, at_once, || {
        crate::metrics::charged("failed");
        tracing::warn!(target: "tower_ratelimit", "no runtime to charge a response's cost on: it is not counted");
    });
}

/// Waits out a reservation; a request dropped while it waits gives its
/// slot back.
pub(super) async fn wait_for(wait: std::time::Duration, refund: Option<Refund>) -> Option<Refund> {
    let reservation = RefundOnDrop::new(refund);
    tokio::time::sleep(wait).await;
    reservation.disarm()
}

/// Gives the grant back in the limits whose refund predicate (the layer's
/// or the rule's) says the response does not count, before the response
/// is returned, so that the client's next request sees it; with the
/// indices in `refund.charged()` of the limits it was given back in.
pub(super) async fn give_back<B>(
    config: &Config,
    refund: &Refund,
    rules: &[usize],
    response: Response<B>,
) -> (Response<B>, SmallVec<[usize; 2]>) {
    let (head, body) = response.into_parts();
    // (a lease is given back when the body ends, not here)
    let refunded = |charged: &ChargedTo| {
        let rule = rules.get(charged.check).and_then(|&r| config.rules.get(r));
        !charged.limit.is_concurrency()
            && rule
                .and_then(|rule| rule.refund_if.as_ref())
                .is_some_and(|refund| refund(&head))
    };
    let mut given_back: SmallVec<[usize; 2]> = (refund.charged().iter().enumerate())
        .filter(|(_, charged)| refunded(charged))
        .map(|(j, _)| j)
        .collect();
    // (a charge of cost 0 is given back without a store call: it took
    // nothing, and what its response tells is not settled either)
    if given_back.iter().any(|&j| refund.charged()[j].cost > 0) {
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
