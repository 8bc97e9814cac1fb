//! Counting decisions under their limits (see [`crate::metrics`]): a
//! refusal under the limits that refused it, anything else under every
//! limit of the decision.

use crate::metrics::Outcome;
use crate::store::Check;
use crate::{Decision, Error, Limit, Verdict};

/// The outcome of a decision as a whole.
pub(super) fn outcome_of(result: &Result<Decision, Error>) -> Outcome {
    match result.as_ref().map(Decision::verdict) {
        Ok(Verdict::Allowed) => Outcome::Allowed,
        Ok(Verdict::CostExceedsCapacity) => Outcome::CostExceedsCapacity,
        Ok(_) => Outcome::Denied,
        Err(_) => Outcome::StoreError,
    }
}

/// Counts a decision of `checks` with `outcome`, and reads each limit's
/// status (near the limit, the quota that decided: see
/// [`LimitKeys::observe`](crate::metrics::LimitKeys::observe)).
#[cfg(feature = "metrics")]
pub(super) fn count(checks: &[Check<'_>], result: &Result<Decision, Error>, outcome: Outcome) {
    let Ok(decision) = result else {
        for check in checks {
            check.limit.metric_keys().increment(outcome);
        }
        return;
    };
    let granted = decision.is_allowed();
    for (check, status) in checks.iter().zip(decision.statuses()) {
        let keys = check.limit.metric_keys();
        if granted || status.is_violated() {
            keys.increment(outcome);
        }
        keys.observe(status, granted);
    }
}

#[cfg(not(feature = "metrics"))]
pub(super) fn count(_: &[Check<'_>], _: &Result<Decision, Error>, _: Outcome) {}

/// Counts one outcome under one limit.
#[cfg(feature = "metrics")]
pub(crate) fn count_one(limit: &Limit, outcome: Outcome) {
    limit.metric_keys().increment(outcome);
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn count_one(_: &Limit, _: Outcome) {}
