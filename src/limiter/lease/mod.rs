//! [`Lease`]: the permits of concurrency limits, held while work runs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::{watch, Mutex};

use super::grant::{Charged, ChargedTo};
use crate::decision::Decision;
use crate::{Error, Limiter};

/// A decision of [`Limiter::acquire_lease`] that holds the permits of the
/// limiter's [concurrency limits](crate::Limit::concurrency) while it lives, and
/// gives them back when dropped or [released](Self::release).
///
/// While held, it renews itself every third of the shortest lease time (on
/// a task of the current Tokio runtime), so a long job keeps its permit and
/// a holder that dies loses it within the lease time. A lease that could
/// not be renewed in time (the store unreachable for a lease time, or the
/// permit gone from the store: evicted, reset) is lost: [`is_lost`](Self::is_lost)
/// says so and [`lost`](Self::lost) resolves, and the work it guarded is no
/// longer counted. The grants of the limiter's other limits (rate limits
/// decided with it) are kept, as a [`Grant`](crate::Grant)'s are.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// // at most 1 export running per tenant, and at most 10 started per hour
/// let running = Limit::concurrency("exports", 1, Duration::from_secs(30))?;
/// let started = Limit::new("exports-per-hour", Quota::per_hour(10).sliding_window())?;
/// let limiter = Limiter::builder(MemoryStore::new()).limit(running).limit(started).build()?;
/// let lease = limiter.acquire_lease("acme").await?;
/// assert!(lease.is_held());
/// assert!(!limiter.acquire_lease("acme").await?.is_held()); // one running
/// assert!(lease.release().await?);
/// let next = limiter.acquire_lease("acme").await?;
/// assert!(next.is_held());
/// assert_eq!(next.decision().statuses()[1].remaining(), 8); // two started
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Debug)]
#[must_use = "a lease is given back when dropped"]
pub struct Lease {
    decision: Decision,
    guard: Option<LeaseGuard>,
}

/// What a lease holds, given back when dropped: what a [`Lease`] holds
/// apart from its decision, and what a layer holds until a response body
/// ends.
#[derive(Debug)]
pub(crate) struct LeaseGuard(Option<Arc<Held>>);

/// What a held lease holds, shared with its renewal task.
pub(crate) struct Held {
    limiter: Limiter,
    /// A third of the shortest lease time: how often it is renewed.
    every: Duration,
    /// The shortest lease time: how long it lasts without a renewal.
    lasts: Duration,
    grants: Mutex<Grants>,
    lost: watch::Sender<bool>,
    /// Given back (or being given back): renewals stop.
    released: AtomicBool,
    /// The renewal task, stopped when the lease is given back (rather than
    /// left to notice at its next tick).
    renewer: std::sync::OnceLock<tokio::task::AbortHandle>,
    /// When the permits must be given back at the latest (the shortest
    /// [maximum hold](crate::Limit::hold_at_most) of the limits held).
    until: Option<tokio::time::Instant>,
    /// The response body a layer holds the permits for, watched for a
    /// client that stops reading (`None`: a [`Lease`], held by code).
    stall: Option<Stall>,
    /// Given back because held for the maximum hold, or stalled.
    expired: AtomicBool,
    /// Woken when that happens: the task of a response body that waits.
    on_expiry: std::sync::Mutex<Option<std::task::Waker>>,
}

/// When a response body last had data for the server that the server has
/// not asked for since: the client stopped reading when that lasts a lease
/// time (the server polls the body whenever it can send more).
struct Stall {
    /// What `since` counts from.
    born: tokio::time::Instant,
    /// Nanoseconds from `born`; [`WAITING`]: the body waits for its own
    /// data (or the handler still runs), which is no stall of the client.
    since: AtomicU64,
}

/// [`Stall::since`] while the body waits for its own data.
const WAITING: u64 = u64::MAX;

impl Stall {
    fn now(&self) -> u64 {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.born);
        u64::try_from(elapsed.as_nanos()).unwrap_or(WAITING - 1)
    }

    /// How long the body has had data the server did not ask for.
    fn stalled_for(&self) -> Duration {
        match self.since.load(Ordering::Acquire) {
            WAITING => Duration::ZERO,
            since => Duration::from_nanos(self.now().saturating_sub(since)),
        }
    }
}

/// Each concurrency limit and key held, with the store time of its grant
/// (`None`: lost), and when the lease was last known held.
struct Grants {
    held: Vec<(ChargedTo, Option<i64>)>,
    renewed: tokio::time::Instant,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("every", &self.every)
            .field("lost", &*self.lost.borrow())
            .field("released", &self.released)
            .finish()
    }
}

impl LeaseGuard {
    /// Holds the grants in `charged` that are of concurrency limits (at a
    /// cost above 0), made at store time `at` through `limiter`, renewing them on
    /// a task of the current runtime until they are given back, at the
    /// latest at the shortest [maximum hold](crate::Limit::hold_at_most) of their
    /// limits, and, with `body` (a layer's response body), once the body has
    /// had data the server did not ask for during the lease time (see
    /// [`handed_over`](Self::handed_over)); `None` when there are none.
    pub(crate) fn hold(
        limiter: &Limiter,
        charged: &[ChargedTo],
        at: i64,
        body: bool,
    ) -> Option<Self> {
        let held: Vec<_> = charged
            .iter()
            .filter(|c| c.limit.is_concurrency() && c.cost > 0)
            .map(|c| (c.clone(), Some(at)))
            .collect();
        if held.is_empty() {
            return None;
        }
        let lasts = held
            .iter()
            .map(|(c, _)| c.limit.quota().window())
            .min()
            .unwrap_or(Duration::from_secs(1));
        let now = tokio::time::Instant::now();
        let until = held
            .iter()
            .filter_map(|(c, _)| c.limit.max_hold())
            .min()
            .map(|hold| now.checked_add(hold).unwrap_or(now + crate::MAX_WAIT));
        let held = Arc::new(Held {
            limiter: limiter.clone(),
            every: (lasts / 3).max(Duration::from_millis(1)),
            lasts,
            grants: Mutex::new(Grants { held, renewed: now }),
            lost: watch::channel(false).0,
            released: AtomicBool::new(false),
            renewer: std::sync::OnceLock::new(),
            until,
            stall: body.then(|| Stall {
                born: now,
                since: AtomicU64::new(WAITING),
            }),
            expired: AtomicBool::new(false),
            on_expiry: std::sync::Mutex::new(None),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let task = runtime.spawn(renewals(Arc::downgrade(&held)));
            let _ = held.renewer.set(task.abort_handle());
        }
        Some(Self(Some(held)))
    }

    /// Whether the lease was lost.
    pub(crate) fn is_lost(&self) -> bool {
        self.0.as_ref().is_some_and(|held| *held.lost.borrow())
    }

    /// Whether the permits were given back because they were held for the
    /// maximum hold.
    pub(crate) fn is_expired(&self) -> bool {
        self.0
            .as_ref()
            .is_some_and(|held| held.expired.load(Ordering::Acquire))
    }

    /// The body has data for the server (a frame it gave, a response
    /// given, or its own data ready): the client stalls if the server does
    /// not ask for more within the lease time.
    pub(crate) fn handed_over(&self) {
        if let Some(stall) = self.0.as_ref().and_then(|held| held.stall.as_ref()) {
            stall.since.store(stall.now(), Ordering::Release);
        }
    }

    /// The body waits for its own data: no stall of the client.
    pub(crate) fn waiting(&self) {
        if let Some(stall) = self.0.as_ref().and_then(|held| held.stall.as_ref()) {
            stall.since.store(WAITING, Ordering::Release);
        }
    }

    /// What the lease holds, for a waker to tell [`data_ready_of`](Self::data_ready_of)
    /// (`None`: given back, or not watched for stalls).
    pub(crate) fn held(&self) -> Option<Weak<Held>> {
        let held = self.0.as_ref().filter(|held| held.stall.is_some())?;
        Some(Arc::downgrade(held))
    }

    /// [`handed_over`](Self::handed_over) only if the body was
    /// [`waiting`](Self::waiting): its data is ready now.
    pub(crate) fn data_ready_of(held: &Held) {
        if let Some(stall) = held.stall.as_ref() {
            let now = stall.now();
            let _ = stall
                .since
                .compare_exchange(WAITING, now, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Wakes `waker` when the permits are given back for the maximum hold
    /// or a stall (only one waker is kept: the last one given).
    pub(crate) fn wake_on_expiry(&self, waker: &std::task::Waker) {
        let watched = |held: &&Arc<Held>| held.until.is_some() || held.stall.is_some();
        let Some(held) = self.0.as_ref().filter(watched) else {
            return;
        };
        if let Ok(mut slot) = held.on_expiry.lock() {
            match slot.as_mut() {
                Some(old) if old.will_wake(waker) => {}
                _ => *slot = Some(waker.clone()),
            }
        }
        // expired while the waker was being stored: no one will take it
        if held.expired.load(Ordering::Acquire) {
            waker.wake_by_ref();
        }
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        let Some(held) = self.0.take() else {
            return;
        };
        let at_once = held.limiter.answers_at_once();
        let release = async move {
            if let Err(error) = held.release().await {
                tracing::warn!(target: "tower_ratelimit", %error, "could not give a lease back: its permit comes back when the lease time ends");
            }
        };
        super::run_detached(release, at_once, || {
            tracing::warn!(target: "tower_ratelimit", "no runtime to give a lease back on: its permit comes back when the lease time ends");
        });
    }
}

impl Lease {
    /// The lease of `decision`'s grants in `charged` (those of concurrency
    /// limits) through `limiter`: holds nothing for a denial.
    pub(crate) fn of(limiter: &Limiter, decision: Decision, charged: &Charged) -> Self {
        let guard = decision
            .is_allowed()
            .then(|| LeaseGuard::hold(limiter, charged, decision.at, false))
            .flatten();
        Self { decision, guard }
    }

    fn held(&self) -> Option<&Arc<Held>> {
        self.guard.as_ref()?.0.as_ref()
    }

    /// The decision.
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// Whether the lease was granted and holds its permits: granted, not
    /// lost, not released.
    pub fn is_held(&self) -> bool {
        self.held()
            .is_some_and(|held| !*held.lost.borrow() && !held.released.load(Ordering::Acquire))
    }

    /// Whether the lease was lost: not renewed within the lease time, or
    /// its permit gone from the store.
    pub fn is_lost(&self) -> bool {
        self.guard.as_ref().is_some_and(LeaseGuard::is_lost)
    }

    /// Resolves when the lease is lost (never, for a lease that holds
    /// nothing): the work it guards may stop, since others may now run.
    pub async fn lost(&self) {
        match self.held() {
            Some(held) => {
                let mut lost = held.lost.subscribe();
                let _ = lost.wait_for(|lost| *lost).await;
            }
            None => std::future::pending().await,
        }
    }

    /// Gives the permits back now: `Ok(true)` when this call did, `Ok(false)`
    /// when there was nothing to give back (a denial, or released already).
    /// Dropping the lease does the same without waiting.
    pub async fn release(mut self) -> Result<bool, Error> {
        match self.guard.as_mut().and_then(|guard| guard.0.take()) {
            Some(held) => held.release().await,
            None => Ok(false),
        }
    }
}

mod held;

use self::held::renewals;

#[cfg(test)]
mod tests {
    use super::held::by_time;
    use smallvec::SmallVec;

    use super::*;
    use crate::Limit;

    #[test]
    fn grants_are_grouped_by_their_time() {
        let minute = Duration::from_secs(60);
        let a = Limit::concurrency("a", 1, minute).expect("limit");
        let b = Limit::concurrency("b", 1, minute).expect("limit");
        let to = |limit: &Limit, key: &[u8], check| ChargedTo {
            limit: limit.clone(),
            key: key.to_vec(),
            cost: 1,
            check,
        };
        let held = vec![
            (to(&a, b"k", 0), Some(5)),
            (to(&b, b"k", 1), Some(5)),
            (to(&a, b"j", 0), Some(7)),
            (to(&b, b"j", 1), None),
        ];
        let groups: SmallVec<[(i64, usize); 2]> = by_time(&held)
            .into_iter()
            .map(|(at, charged)| (at, charged.len()))
            .collect();
        assert_eq!(groups.as_slice(), &[(5, 2), (7, 1)]);
    }
}
