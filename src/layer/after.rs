//! What a layer settles once a response is known: the leases of
//! concurrency limits, held until its body ends, and the costs charged
//! after it ([`Rule::cost_from_response`](super::Rule::cost_from_response),
//! [`Rule::cost_from_body`](super::Rule::cost_from_body)).

use bytes::Bytes;
use http::response::Parts as ResponseParts;
use smallvec::SmallVec;

use super::rule::BodyCost;
use super::Config;
use crate::limiter::{run_detached, LeaseGuard, Refund};
use crate::Limiter;

/// Held by a response body until it ends or is dropped; then charges what
/// the response cost beyond what its request paid (and, settling
/// estimates, gives back what it paid beyond its cost), and gives the
/// leases back.
pub(crate) struct After {
    limiter: Limiter,
    /// What the request paid when it arrived.
    paid: u64,
    /// When it was granted (what a refund gives back at).
    at: i64,
    /// Settling estimates: the share of each limit's capacity a charge
    /// after the response may add ([`RateLimitLayerBuilder::settle_estimates`](super::RateLimitLayerBuilder::settle_estimates)).
    estimates: Option<f64>,
    charges: SmallVec<[Charge; 1]>,
    /// Dropped last: a lease is held until the charges are on their way.
    lease: Option<LeaseGuard>,
}

/// One rule's charge: its limits and keys, the cost read from the
/// response's head (`None`: not told), and the body's count so far.
struct Charge {
    charged: Vec<(crate::Limit, Vec<u8>)>,
    head: Option<u64>,
    body: Option<(BodyCost, u64)>,
}

impl After {
    /// What the grant `refund` (charged to the rules `charged_rules`, in
    /// order, its permits held by `lease` since the decision) leaves to
    /// settle once `head` is known, for a request that paid `paid`: `None`
    /// when nothing.
    pub(crate) fn of(
        config: &Config,
        refund: &Refund,
        charged_rules: &[usize],
        head: &ResponseParts,
        paid: u64,
        lease: Option<LeaseGuard>,
    ) -> Option<Box<Self>> {
        let mut charges: SmallVec<[Charge; 1]> = SmallVec::new();
        for (j, &r) in charged_rules.iter().enumerate() {
            let (Some(rule), Some(pair)) = (config.rules.get(r), refund.charged().get(j)) else {
                continue;
            };
            let after = &rule.cost_after;
            if !after.any() {
                continue;
            }
            let head_cost = after.head.as_ref().and_then(|cost| cost(head));
            match charges
                .iter_mut()
                .find(|c| c.same_rule_as(after.body.as_ref(), head_cost))
            {
                Some(charge) => charge.charged.push(pair.clone()),
                None => charges.push(Charge {
                    charged: vec![pair.clone()],
                    head: head_cost,
                    body: after.body.clone().map(|count| (count, 0)),
                }),
            }
        }
        (lease.is_some() || !charges.is_empty()).then(|| {
            Box::new(Self {
                limiter: refund.limiter().clone(),
                paid,
                at: refund.at(),
                estimates: config.estimates,
                charges,
                lease,
            })
        })
    }

    /// Whether the body's permits were held for their maximum hold and
    /// given back: the body ends.
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
        }
    }
}

impl Charge {
    /// Whether a rule with `body` and `head` charges as this one (one
    /// store call for both).
    fn same_rule_as(&self, body: Option<&BodyCost>, head: Option<u64>) -> bool {
        body.is_none() && self.body.is_none() && self.head == head
    }
}

impl Drop for After {
    fn drop(&mut self) {
        let (paid, at, estimates) = (self.paid, self.at, self.estimates);
        for charge in std::mem::take(&mut self.charges) {
            // the cost, when the response told it
            let told = charge.head.is_some() || charge.body.is_some();
            let body = charge.body.map_or(0, |(_, sum)| sum);
            let cost = charge.head.unwrap_or(0).saturating_add(body);
            let extra = cost.saturating_sub(paid);
            // an estimate over the cost gives the rest back
            let over = match estimates {
                Some(_) if told => paid.saturating_sub(cost),
                _ => 0,
            };
            if extra == 0 && over == 0 {
                continue;
            }
            let limiter = self.limiter.clone();
            let work = async move {
                // (a failure is logged and counted by the limiter)
                if extra > 0 {
                    let share = estimates.unwrap_or(1.0);
                    let _ = limiter.charge_charged(&charge.charged, extra, share).await;
                } else if let Ok(over) = i64::try_from(over) {
                    let refunded = limiter.refund_charged(&charge.charged, over, at).await;
                    if let Err(error) = refunded {
                        tracing::warn!(target: "tower_ratelimit", %error, "an estimate's surplus could not be given back: it stays counted");
                    }
                }
            };
            run_detached(work, self.limiter.answers_at_once(), || {
                crate::metrics::charged("failed");
                tracing::warn!(target: "tower_ratelimit", "no runtime to charge a response's cost on: it is not counted");
            });
        }
        // the leases go back once the charges are on their way
        drop(self.lease.take());
    }
}
