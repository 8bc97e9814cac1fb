//! [`Grant`]: a decision whose grant can be given back, once.

use std::sync::atomic::{AtomicBool, Ordering};

use std::time::Duration;

use super::{Checks, LeaseGuard};
use crate::decision::Decision;
use crate::metrics::StoreTimer;
use crate::store::{Check, Settle, Settled};
use crate::{Error, Limit, Limiter};

/// One limit and key a grant was charged to, owned: at what cost, and
/// which check of its decision it was (a layer finds the rule of each
/// charge by it, never by its place among the charges).
#[derive(Debug, Clone)]
pub(crate) struct ChargedTo {
    pub(crate) limit: Limit,
    pub(crate) key: Vec<u8>,
    pub(crate) cost: i64,
    /// The index of its check in the decision's checks.
    pub(crate) check: usize,
}

/// The limits and keys a grant was charged to.
pub(crate) type Charged = Vec<ChargedTo>;

/// A decision of [`Refundable::check`] (`limiter.refundable().check(..)`),
/// [`Refundable::acquire`], [`Refundable::decide`] or
/// [`take_up_to`](Limiter::take_up_to) that can give its grant back with
/// [`refund`](Self::refund): for requests whose outcome says they should not
/// count (a successful login under a limit of failed ones), taken when they
/// arrive so that concurrent requests cannot all pass a look.
///
/// Dropping a `Grant` keeps what it took. The refund is exact for every
/// algorithm: a sliding log forgets that entry, a bucket takes the amount
/// back (never above its capacity), a window uncounts it while that window
/// still counts. It happens at most once, however often and from however
/// many tasks it is asked for.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// // at most 5 failed logins per user per 15 minutes
/// let quota = Quota::rate(5, Duration::from_secs(15 * 60)).sliding_log();
/// let failures = Limiter::new(MemoryStore::new(), Limit::new("login", quota)?);
/// let grant = failures.refundable().check("alice", 1).await?;
/// assert!(grant.is_allowed());
/// let password_was_right = true;
/// if password_was_right {
///     assert!(grant.refund().await?); // a success does not count
/// }
/// assert!(!grant.refund().await?); // given back once only
/// assert_eq!(failures.peek("alice", 1).await?.remaining(), 5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Debug)]
pub struct Grant {
    pub(crate) decision: Decision,
    pub(crate) refund: Option<Refund>,
}

impl Grant {
    pub(crate) fn new(decision: Decision, refund: Option<Refund>) -> Self {
        Self { decision, refund }
    }

    /// The decision.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// The decision, keeping the grant.
    #[inline]
    pub fn into_decision(self) -> Decision {
        self.decision
    }

    /// Whether the request was granted (see [`Decision::is_allowed`]).
    pub fn is_allowed(&self) -> bool {
        self.decision.is_allowed()
    }

    /// The amount granted (see [`Decision::granted_amount`]).
    pub fn granted_amount(&self) -> u64 {
        self.decision.granted_amount()
    }

    /// Gives the grant back: `Ok(true)` when this call did, `Ok(false)` when
    /// there is nothing to give back (a denial, a cost of 0) or it was given
    /// back already. At most once: a second call, or one racing the first,
    /// answers `false` without asking the store. A refund that fails
    /// ([`Error::Timeout`], a Redis error) is not tried again, since the
    /// store may have applied it.
    pub async fn refund(&self) -> Result<bool, Error> {
        match &self.refund {
            Some(refund) => refund.run().await,
            None => Ok(false),
        }
    }

    /// Whether the grant was given back (or a refund of it was attempted).
    pub fn is_refunded(&self) -> bool {
        self.refund
            .as_ref()
            .is_some_and(|r| r.done.load(Ordering::Acquire))
    }
}

/// The decisions of a [`Limiter`] whose grant can be given back: the same
/// `check`, `acquire` and `decide`, answering a [`Grant`] instead of a
/// [`Decision`]; from [`Limiter::refundable`].
///
/// Whether a grant can be given back is a value chosen before the call, not
/// a second name per decision: `limiter.check(k, 1)` and
/// `limiter.refundable().check(k, 1)`. The plain forms stay as they were
/// (a `Decision`, no limit or key cloned): only a `Grant` owns the limits
/// and keys it was charged to, to give back later. (A request value awaited
/// either way, `limiter.check(k, 1).refundable().await`, would need a
/// future type that can be named, which an `async fn`'s is not in stable
/// Rust: it would box every plain check.)
#[derive(Debug, Clone, Copy)]
pub struct Refundable<'a> {
    pub(super) limiter: &'a Limiter,
}

impl Refundable<'_> {
    /// Like [`Limiter::check`], and the grant can be given back once
    /// ([`Grant::refund`]).
    pub async fn check(self, key: impl AsRef<[u8]>, cost: u64) -> Result<Grant, Error> {
        self.decide(&[key], cost, Duration::ZERO).await
    }

    /// Like [`Limiter::acquire`], and the grant can be given back once
    /// ([`Grant::refund`]). Dropping the future while it sleeps gives the
    /// reservation back.
    pub async fn acquire(
        self,
        key: impl AsRef<[u8]>,
        cost: u64,
        max_wait: Duration,
    ) -> Result<Grant, Error> {
        let Grant { decision, refund } = self.decide(&[key], cost, max_wait).await?;
        let refund = if decision.is_allowed() && !decision.delay().is_zero() {
            // cancelled while it sleeps: the reservation goes back
            let guard = RefundOnDrop::new(refund);
            tokio::time::sleep(decision.delay()).await;
            guard.disarm()
        } else {
            refund
        };
        Ok(Grant::new(decision, refund))
    }

    /// Like [`Limiter::decide`], and the grant can be given back once
    /// ([`Grant::refund`]). Returns at once; when the decision is a
    /// reservation, the caller waits (and may give it back instead).
    pub async fn decide<K: AsRef<[u8]>>(
        self,
        keys: &[K],
        cost: u64,
        max_wait: Duration,
    ) -> Result<Grant, Error> {
        let limiter = self.limiter;
        Limiter::within_max_wait(max_wait)?;
        let limits = limiter.current();
        let checks = Limiter::keyed_checks(&limits, keys, cost)?;
        limiter
            .answer(&checks, super::Ask::ahead(max_wait, true))
            .get()
            .await
    }
}

/// What a grant took, to give back once. Boxed: a grant (and every step
/// it moves through on the way to a response) stays small enough to move
/// without a `memcpy` call, and most grants have nothing to give back.
pub(crate) struct Refund(Box<Taken>);

/// What a [`Refund`] gives back.
pub(crate) struct Taken {
    limiter: Limiter,
    charged: Charged,
    at: i64,
    done: AtomicBool,
}

impl std::fmt::Debug for Refund {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Refund")
            .field(
                "limits",
                &self
                    .charged
                    .iter()
                    .map(|c| (c.limit.name(), c.cost))
                    .collect::<Vec<_>>(),
            )
            .field("done", &self.done)
            .finish()
    }
}

impl std::ops::Deref for Refund {
    type Target = Taken;

    fn deref(&self) -> &Taken {
        &self.0
    }
}

impl Refund {
    /// A refund of `decision`'s grant from `charged` through `limiter`;
    /// `None` when nothing was granted. A charge of cost 0 is kept (a
    /// layer settles it after the response), though it gives nothing back.
    pub(crate) fn of(limiter: &Limiter, decision: &Decision, charged: Charged) -> Option<Self> {
        (decision.is_allowed() && !charged.is_empty()).then(|| {
            Self(Box::new(Taken {
                limiter: limiter.clone(),
                charged,
                at: decision.at,
                done: AtomicBool::new(false),
            }))
        })
    }

    /// Gives back once, only in the limits `charged[i]` for which
    /// `refunded(i)`; `true` when this call did. (The refund is spent either
    /// way.)
    pub(crate) async fn run_some(&self, refunded: impl Fn(usize) -> bool) -> Result<bool, Error> {
        if self.done.swap(true, Ordering::AcqRel) {
            return Ok(false);
        }
        let some: Charged = self
            .charged
            .iter()
            .enumerate()
            .filter(|(i, c)| c.cost > 0 && refunded(*i))
            .map(|(_, charged)| charged.clone())
            .collect();
        if some.is_empty() {
            return Ok(false);
        }
        self.limiter
            .refund_charged(&some, self.at)
            .await
            .map(|()| true)
    }

    /// The limits and keys the grant was charged to, in order.
    pub(crate) fn charged(&self) -> &[ChargedTo] {
        &self.charged
    }

    /// The limiter that granted it.
    /// When the grant was made, in store time.
    pub(crate) fn at(&self) -> i64 {
        self.at
    }

    pub(crate) fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    /// Holds the grant's permits of concurrency limits for a response body
    /// until the guard is dropped, renewing them meanwhile, at most for each
    /// limit's [maximum hold](Limit::hold_at_most), and while the client
    /// reads (see [`LeaseGuard::handed_over`]); `None` when the grant holds
    /// none.
    pub(crate) fn hold_leases(&self) -> Option<LeaseGuard> {
        LeaseGuard::hold(&self.limiter, &self.charged, self.at, true)
    }

    /// Gives back once; `true` when this call did (`false` for a grant
    /// of cost 0: nothing to give back).
    pub(crate) async fn run(&self) -> Result<bool, Error> {
        if self.done.swap(true, Ordering::AcqRel) || self.charged.iter().all(|c| c.cost <= 0) {
            return Ok(false);
        }
        self.limiter
            .refund_charged(&self.charged, self.at)
            .await
            .map(|()| true)
    }

    /// Gives back once without awaiting: at once on a store that answers at
    /// once, else on a task of the current runtime (from `Drop`).
    pub(crate) fn run_detached(self) {
        if self.done.swap(true, Ordering::AcqRel) {
            return;
        }
        let at_once = self.limiter.answers_at_once();
        let refund = async move {
            let result = self.limiter.refund_charged(&self.charged, self.at).await;
            if let Err(error) = result {
                tracing::debug!(target: "tower_ratelimit", %error, "could not give back a cancelled reservation");
            }
        };
        super::run_detached(refund, at_once, || {
            tracing::debug!(target: "tower_ratelimit", "no runtime to give back a cancelled reservation on");
        });
    }
}

/// Gives a reservation back if dropped before [`disarm`](Self::disarm):
/// the request that waits for it was cancelled before it ran.
pub(crate) struct RefundOnDrop(Option<Refund>);

impl RefundOnDrop {
    pub(crate) fn new(refund: Option<Refund>) -> Self {
        Self(refund)
    }

    /// The reservation is used: keeps it, and returns the refund for later.
    pub(crate) fn disarm(mut self) -> Option<Refund> {
        self.0.take()
    }
}

impl Drop for RefundOnDrop {
    fn drop(&mut self) {
        if let Some(refund) = self.0.take() {
            refund.run_detached();
        }
    }
}

impl Limiter {
    /// The limits and keys `decision` charged of `checks` (those of its
    /// statuses, in order; a shadow limit that would have refused took
    /// nothing), owned: what a [`Grant`] gives back.
    pub(super) fn charged(checks: &[Check<'_>], decision: &Decision) -> Charged {
        checks
            .iter()
            .zip(decision.statuses())
            .enumerate()
            .filter(|(_, (_, status))| {
                !status.would_refuse() && (!decision.shadow_apart || !status.shadow)
            })
            .map(|(i, (c, _))| ChargedTo {
                limit: c.limit.clone(),
                key: c.key.to_vec(),
                cost: c.cost,
                check: i,
            })
            .collect()
    }

    /// Gives back a grant made at store time `at` from `charged`, each at
    /// its cost (nothing for a cost of 0). On a store that answers at
    /// once, the future is ready on its first poll.
    pub(crate) async fn refund_charged(&self, charged: &[ChargedTo], at: i64) -> Result<(), Error> {
        // a hot limit's grant may have come from a local batch (see
        // `hot.rs`): it counts as spent
        let checks: Checks<'_> = charged
            .iter()
            .filter(|c| c.cost > 0)
            .filter(|c| self.inner.hot.is_none() || c.limit.hot_key().is_none())
            .map(Self::check_of)
            .collect();
        if checks.is_empty() {
            return Ok(());
        }
        self.settle_checks(&checks, Settle::Refund { at }, self.timeout())
            .await
            .map(drop)
    }

    /// Settles a grant in `charged`, each at its cost, after the fact
    /// (see [`Settle`]).
    pub(crate) async fn settle_charged(
        &self,
        charged: &[ChargedTo],
        how: Settle,
    ) -> Result<Settled, Error> {
        let checks: Checks<'_> = charged.iter().map(Self::check_of).collect();
        self.settle_checks(&checks, how, self.timeout()).await
    }

    /// Settles `checks` after the fact (see [`Settle`]): one store call
    /// bounded by `within`, timed under the operation's name.
    pub(crate) async fn settle_checks(
        &self,
        checks: &[Check<'_>],
        how: Settle,
        within: std::time::Duration,
    ) -> Result<Settled, Error> {
        // cached denials of these keys may no longer hold once given back (a
        // charge or a renewal only makes them hold longer)
        if let (Settle::Refund { .. }, Some(denials)) = (how, &self.inner.denials) {
            for check in checks {
                denials.forget(check.key);
            }
        }
        let store = &self.inner.store;
        let timer = StoreTimer::start();
        let deadline = crate::store::Deadline::after(within);
        let result = store.engine().settle(checks, how, deadline).get().await;
        let operation = match how {
            Settle::Refund { .. } => "refund",
            Settle::Charge => "charge",
            Settle::Renew { .. } => "renew",
        };
        self.called(timer, operation, result.is_err());
        result
    }

    /// A store call's end: measured (since `timer`), and whether it
    /// `failed` shown (see [`crate::metrics::STORE_OUTAGE`]).
    pub(super) fn called(&self, timer: StoreTimer, operation: &'static str, failed: bool) {
        let store = &self.inner.store;
        timer.finish(|| store.kind(), operation);
        self.inner.outage.set(|| store.kind(), failed);
    }

    /// The check of a charge, at its cost.
    pub(crate) fn check_of(charged: &ChargedTo) -> Check<'_> {
        Check {
            limit: &charged.limit,
            key: &charged.key,
            cost: charged.cost,
        }
    }
}
