//! Limits in shadow mode: decided and recorded, never refusing nor
//! delaying a request (see [`Limit::shadow`](crate::Limit::shadow)).

use std::time::Duration;

use smallvec::SmallVec;

use super::{Ask, Checks, Grant, Limiter};
use crate::decision::{Decision, LimitStatus, LimitStatuses, Verdict};
use crate::metrics::Outcome;
use crate::store::Check;
use crate::Error;

/// A decision over limits some of which are in shadow mode: decided
/// with every limit; while only shadow limits refuse, decided again
/// without them. Each would-be refusal is logged and counted
/// (`shadow_denied`); the decision lists every limit, in order, those
/// left out marked [`LimitStatus::would_refuse`].
pub(super) async fn decide(
    limiter: &Limiter,
    checks: &[Check<'_>],
    ask: Ask,
) -> Result<Decision, Error> {
    let Ask { max_wait, dry, .. } = ask;
    // the checks still decided, by their index in `checks`
    let mut active: SmallVec<[usize; 2]> = (0..checks.len()).collect();
    let mut left_out: SmallVec<[(usize, LimitStatus); 1]> = SmallVec::new();
    loop {
        let round: Checks<'_> = active.iter().map(|&i| checks[i]).collect();
        let round_ask = Ask {
            max_wait,
            dry,
            refundable: false,
            counted: false,
        };
        let result = limiter.decision_at_store(&round, round_ask, limiter.deadline());
        let result = result.get().await.map(Grant::into_decision);
        let decision = match result {
            Ok(decision) => decision,
            Err(error) => {
                let result = Err(error);
                if !dry {
                    super::count::count(&round, &result, Outcome::StoreError);
                }
                return result;
            }
        };
        let only_shadow = !decision.is_allowed() && !decision.statuses.iter().any(|s| s.violated);
        if only_shadow && !round.is_empty() {
            // only shadow limits refused: decide again without them
            let mut keep = SmallVec::<[usize; 2]>::new();
            for (&i, status) in active.iter().zip(&decision.statuses) {
                if status.would_refuse {
                    if !dry {
                        tracing::debug!(
                            target: "tower_ratelimit",
                            limit = status.name(),
                            "shadow limit {} would have refused the request",
                            status.name()
                        );
                        super::count::count_one(checks[i].limit, Outcome::ShadowDenied);
                    }
                    left_out.push((i, status.clone()));
                } else {
                    keep.push(i);
                }
            }
            // (a round that leaves nothing out would be decided again
            // as it is, for ever: it is the answer)
            let progressed = keep.len() < active.len();
            active = keep;
            if progressed && !active.is_empty() {
                continue;
            }
        }
        if !dry {
            if active.is_empty() {
                // every limit left out: the request passes, nothing taken
            } else {
                let result = Ok(decision.clone());
                super::count::count(&round, &result, super::count::outcome_of(&result));
                // refused by an enforced limit: the shadow limits that
                // would have refused too are counted as such
                if !decision.is_allowed() {
                    for (check, status) in round.iter().zip(&decision.statuses) {
                        if status.would_refuse {
                            super::count::count_one(check.limit, Outcome::ShadowDenied);
                        }
                    }
                }
            }
        }
        let mut merged = merge(decision, &active, left_out);
        // refused by enforced limits: retry when they allow, whatever
        // the shadow limits would ask
        if let Verdict::Denied { retry_after } = &mut merged.verdict {
            let enforced = merged.statuses.iter().filter(|s| !s.shadow);
            if let Some(wait) = enforced.map(|s| s.wait_us).max() {
                if wait != u64::MAX {
                    *retry_after = (*retry_after).min(Duration::from_micros(wait));
                }
            }
        }
        return Ok(merged);
    }
}

/// [`decide`] for a decision that may be reserved
/// ahead (`max_wait` > 0): the enforced limits alone decide the request
/// and its time, then the shadow limits are decided by that time (dry
/// when the request is refused), so that no shadow limit can delay it.
/// The shadow limits' grants are made apart, at their own time: a
/// refund of the request leaves them counted.
pub(super) async fn decide_ahead(
    limiter: &Limiter,
    checks: &[Check<'_>],
    ask: Ask,
) -> Result<Decision, Error> {
    let Ask { max_wait, dry, .. } = ask;
    let (shadow, enforced): (Checks<'_>, Checks<'_>) =
        checks.iter().copied().partition(|c| c.limit.is_shadow());
    let decided = if enforced.is_empty() {
        None
    } else {
        let enforced_ask = Ask {
            max_wait,
            dry,
            refundable: false,
            counted: true,
        };
        let decided = limiter.decision_at_store(&enforced, enforced_ask, limiter.deadline());
        Some(decided.get().await?.into_decision())
    };
    let (by, refused) = match &decided {
        Some(d) if d.is_allowed() => (d.delay(), false),
        Some(_) => (Duration::ZERO, true),
        None => (Duration::ZERO, false),
    };
    let shadow_ask = Ask {
        max_wait: by,
        dry: dry || refused,
        ..ask
    };
    let looked = decide(limiter, &shadow, shadow_ask).await?;
    if refused && !dry {
        for (check, status) in shadow.iter().zip(&looked.statuses) {
            if status.would_refuse {
                super::count::count_one(check.limit, Outcome::ShadowDenied);
            }
        }
    }
    let mut shadow_statuses = looked.statuses.into_iter();
    let mut outcome = decided.unwrap_or_else(|| {
        // (its statuses are merged in below, and bound once there)
        let mut passed = Decision::unbound(Verdict::Allowed, 0);
        passed.granted = looked.granted;
        passed.at = looked.at;
        passed
    });
    let mut enforced_statuses = std::mem::take(&mut outcome.statuses).into_iter();
    let statuses: LimitStatuses = checks
        .iter()
        .filter_map(|c| {
            if c.limit.is_shadow() {
                shadow_statuses.next()
            } else {
                enforced_statuses.next()
            }
        })
        .collect();
    let mut decision = Decision::new(outcome.verdict, outcome.wait_us, statuses);
    decision.granted = std::mem::take(&mut outcome.granted);
    decision.at = outcome.at;
    decision.shadow_apart = true;
    Ok(decision)
}

/// The final decision of [`decide`], over every
/// limit in order: the last round's statuses and those left out.
fn merge(
    last: Decision,
    active: &[usize],
    left_out: SmallVec<[(usize, LimitStatus); 1]>,
) -> Decision {
    if left_out.is_empty() {
        return last;
    }
    let (verdict, wait) = if active.is_empty() {
        (Verdict::Allowed, 0)
    } else {
        (last.verdict, last.wait_us)
    };
    let granted = if active.is_empty() { 0 } else { last.granted };
    let mut all: SmallVec<[(usize, LimitStatus); 2]> = left_out.into_iter().collect();
    if !active.is_empty() {
        all.extend(active.iter().copied().zip(last.statuses));
    }
    all.sort_by_key(|(i, _)| *i);
    let mut decision = Decision::new(verdict, wait, all.into_iter().map(|(_, s)| s).collect());
    decision.granted = granted;
    decision.at = last.at;
    decision
}
