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

use super::costs::BodyCost;
use super::meter::Meter;
use super::Config;
use crate::limiter::{run_detached, Charged, ChargedTo, LeaseGuard, Refund, RefundOnDrop};
use crate::Limiter;

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
