//! Costs charged after the fact: known only from a response.

use std::time::Duration;

use super::grant::{Charged, ChargedTo};
use crate::store::{Check, Settle};
use crate::{Error, Limiter};

/// The first pause before a failed charge is tried again; each next one
/// doubles.
const FIRST_PAUSE: Duration = Duration::from_millis(5);

impl Limiter {
    /// Charges `cost` to every limit of the limiter for `key` (but its
    /// [concurrency limits](crate::Limit::concurrency)), after the fact: the cost of work known only once it is done (the tokens of a
    /// completion, the bytes served, the rows exported). The charge is
    /// granted whatever is left, so a limit may end in debt: it refuses the
    /// key until the debt is paid back by time, as its algorithm returns
    /// capacity. Each limit is charged at most its capacity per call (the
    /// capacity of the quota that decides it: a
    /// [stored quota](crate::Limit::use_stored_quota) or a key's override
    /// too; a charge is never more than one full quota), so one charge refuses a
    /// key for at most one more [policy window](crate::Limit::policy_window).
    ///
    /// A charge that fails is tried again, with pauses of 5 ms, 10 ms, ...,
    /// while the limiter's [timeout](crate::LimiterBuilder::timeout) lasts;
    /// one that still fails is logged (`warn`), counted under
    /// [`CHARGES`](crate::metrics::CHARGES) with `result="failed"` and
    /// returned. A charge is not idempotent: a try that timed out may have
    /// been applied, so a retried charge can count twice (never less).
    ///
    /// ```
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// // 10 000 tokens per tenant per day; a completion's cost is known at its end
    /// let tokens = Limit::new("tokens", Quota::per_day(10_000).sliding_window())?;
    /// let limiter = Limiter::new(MemoryStore::new(), tokens);
    /// assert!(limiter.check("acme", 1).await?.is_allowed()); // may it start?
    /// limiter.charge("acme", 10_499).await?; // it used 10 500 in all
    /// assert!(!limiter.peek("acme", 1).await?.is_allowed()); // in debt until paid back
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn charge(&self, key: impl AsRef<[u8]>, cost: u64) -> Result<(), Error> {
        let key = super::non_empty(key.as_ref())?;
        // (a concurrency limit counts work in progress: nothing to charge)
        let cost = Self::cost(cost);
        let charged: Charged = self
            .current()
            .iter()
            .filter(|limit| !limit.is_concurrency())
            .enumerate()
            .map(|(check, limit)| ChargedTo {
                limit: (**limit).clone(),
                key: key.to_vec(),
                cost,
                check,
            })
            .collect();
        self.charge_charged(&charged).await
    }

    /// Charges each of `charged` its cost (at most the capacity of the
    /// quota that decides it),
    /// tried again while the timeout lasts (see [`charge`](Self::charge)).
    pub(crate) async fn charge_charged(&self, charged: &[ChargedTo]) -> Result<(), Error> {
        // (the store charges at most the capacity of the quota that
        // decides: a stored quota's or an override's, unknown here)
        let most = |limit: &crate::Limit| match limit.uses_stored_quota() {
            true => crate::algorithm::EXACT - 1,
            false => i64::try_from(limit.capacity()).unwrap_or(i64::MAX),
        };
        let checks: Vec<Check<'_>> = charged
            .iter()
            .map(|c| Check {
                cost: c.cost.min(most(&c.limit)),
                ..Self::check_of(c)
            })
            .filter(|check| check.cost > 0)
            .collect();
        if checks.is_empty() {
            return Ok(());
        }
        let until = tokio::time::Instant::now() + self.timeout();
        let mut pause = FIRST_PAUSE;
        let mut tries = 0;
        loop {
            tries += 1;
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            let result = self.settle_checks(&checks, Settle::Charge, left).await;
            let error = match result {
                Ok(_) => {
                    crate::metrics::charged(if tries == 1 { "charged" } else { "retried" });
                    for check in &checks {
                        let limit = check.limit.shared_name();
                        crate::metrics::overshoot(limit, "charge", check.cost);
                    }
                    return Ok(());
                }
                Err(error) => error,
            };
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            if left <= pause {
                crate::metrics::charged("failed");
                tracing::warn!(
                    target: "tower_ratelimit",
                    %error,
                    tries,
                    limits = ?checks.iter().map(|c| c.limit.name()).collect::<Vec<_>>(),
                    "a charge after the fact failed: it is not counted"
                );
                return Err(error);
            }
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
    }
}

/// `share` (in (0, 1]) of `capacity`, rounded down, at least 1.
pub(crate) fn share_of(capacity: u64, share: f64) -> u64 {
    // (exact for capacities below 2^53, the validated range)
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let most = (capacity as f64 * share).floor() as u64;
    most.clamp(1, capacity.max(1))
}
