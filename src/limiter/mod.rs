//! The programmatic API: [`Limiter`] with the decisions a request makes
//! (`check`, `acquire`, `peek`, `take_up_to`, `reset`, ...), and beside it
//! [`Admin`] (`admin/`), what an operator does (stored quotas, overrides,
//! penalties). How a limiter is made ([`LimiterBuilder`], the limits
//! registered on the store) is `builder.rs`.
//!
//! A decision goes one way: the public methods here build the checks (one
//! per limit, with its key and cost) and call [`answer`](Limiter::answer)
//! (`call.rs`), which classifies them once and dispatches: to the store's
//! one call (measured, traced, counted, and answered from the cache of
//! denials, `deny_cache.rs`, when it can be), or to the component their
//! kind needs (shadow limits, `shadow.rs`; hot keys' batches, `hot.rs`; a
//! concurrency limit that may wait). The answer is ready at once when the
//! store answered at once, else a future; a grant that can be given back
//! is a [`Grant`] (`grant.rs`).
//!
//! One name per decision kind: whether its grant can be given back is a
//! value chosen before the call, [`Limiter::refundable`] (a [`Refundable`]
//! view whose `check`, `acquire` and `decide` answer a [`Grant`]), not a
//! `_refundable` twin of each method. The plain forms answer a [`Decision`]
//! and clone no limit or key: the hot path pays nothing for refunds. (A
//! request value awaited either way, `limiter.check(k, 1).refundable()`,
//! would need its future's type named for `IntoFuture`, which an `async
//! fn`'s cannot be in stable Rust without boxing every check.)

mod admin;
mod builder;
mod call;
mod charge;
pub(crate) use self::charge::share_of;
pub(crate) mod count;
mod deny_cache;
mod grant;
mod hot;
mod lease;
mod set;
mod shadow;

use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

pub use self::admin::{Admin, Inspection};
pub use self::builder::LimiterBuilder;
pub(crate) use self::call::Ask;
use self::deny_cache::DenyCache;
pub(crate) use self::grant::{Charged, ChargedTo, Refund, RefundOnDrop};
pub use self::grant::{Grant, Refundable};
pub(crate) use self::hot::HotPools;
pub use self::lease::Lease;
pub(crate) use self::lease::{Held as LeaseHeld, LeaseGuard};
pub use self::set::{SetItem, SetMode};
use crate::decision::Decision;
use crate::live::Current;
use crate::metrics::StoreTimer;
use crate::store::{Check, Store};
use crate::{Error, Limit, LimitSource};

/// Runs `work` without awaiting it (from `Drop`): in place when it is done
/// on its first poll (`at_once`: a store that answers at once), else on a
/// task of the current runtime; without a runtime, `lost` says what is not
/// done.
pub(crate) fn run_detached(
    work: impl std::future::Future<Output = ()> + Send + 'static,
    at_once: bool,
    lost: fn(),
) {
    let mut work = Box::pin(work);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    if at_once && work.as_mut().poll(&mut cx).is_ready() {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn(work)),
        Err(_) => lost(),
    }
}

/// The checks of one decision: inline for the usual few limits.
pub(crate) type Checks<'a> = SmallVec<[Check<'a>; 2]>;

/// The limits of one decision as read when it began (see [`LimitSource`]).
type Limits<'a> = SmallVec<[Current<'a>; 2]>;

/// Default bound on one store call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);

/// The furthest ahead a grant may be reserved: the longest `max_wait` of
/// [`Limiter::acquire`] and [`Limiter::decide`], and the longest delay of
/// the layer's delay mode. A reservation takes its permits until its time
/// (a bucket's tokens, a window's count), so an unbounded one could hold a
/// key's limit for longer than any caller waits.
pub const MAX_WAIT: Duration = Duration::from_secs(3600);

struct Inner {
    store: Store,
    limits: Vec<LimitSource>,
    timeout: Duration,
    /// Denials known to hold, for a remote store (see [`DenyCache`]).
    denials: Option<DenyCache>,
    /// Batches of hot keys' permits, for a remote store (see [`Limit::with_hot_key`]):
    /// the store's, shared by every limiter over it.
    hot: Option<Arc<HotPools>>,
    /// Whether the store's calls fail, for the metrics.
    outage: crate::metrics::OutageGauge,
}

/// One or more limits over one store. Cheap to clone (an `Arc`), `Send` and
/// `Sync`: share one limiter across tasks.
///
/// With several limits, a call decides all of them atomically in one store
/// round trip: either every limit grants the cost, or none consumes anything.
///
/// ```
/// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota, Verdict};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let limiter = Limiter::builder(MemoryStore::new())
///     .limit(Limit::new("burst", Quota::per_second(10).allow_burst(10).gcra())?)
///     .limit(Limit::new("daily", Quota::per_day(1000).fixed_window())?)
///     .build()?;
/// let d = limiter.check("client-7", 1).await?;
/// assert!(d.is_allowed());
/// assert_eq!(d.remaining(), 9); // the binding limit: burst
/// assert_eq!(limiter.check("client-7", 11).await?.verdict(), Verdict::CostExceedsCapacity);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("limits", &self.inner.limits)
            .field("timeout", &self.inner.timeout)
            .finish()
    }
}

impl Limiter {
    /// The limits, in order, as they are now (a [live](crate::LiveLimit)
    /// one's current value).
    pub fn limits(&self) -> Vec<Limit> {
        self.current().iter().map(|l| Limit::clone(l)).collect()
    }

    /// The limits as a decision beginning now reads them.
    fn current(&self) -> Limits<'_> {
        self.inner.limits.iter().map(LimitSource::load).collect()
    }

    /// The store call timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Tries to take `cost` from every limit for `key`, now. Denied and
    /// impossible requests consume nothing. A cost of 0 always passes and
    /// consumes nothing; to ask whether a request would pass, use
    /// [`peek`](Self::peek).
    pub async fn check(&self, key: impl AsRef<[u8]>, cost: u64) -> Result<Decision, Error> {
        let limits = self.current();
        let checks = Self::checks(limits.iter().map(|l| (&**l, key.as_ref())), cost);
        self.decided(&checks, Ask::NOW).await
    }

    /// Whether a request of `cost` for `key` would be granted now, and the
    /// current state of every limit, consuming nothing: the same decision as
    /// [`check`](Self::check) would make, without its effect. An exhausted
    /// limit answers [`Verdict::Denied`](crate::Verdict::Denied) with the exact
    /// `retry_after`.
    ///
    /// ```
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let limiter = Limiter::new(MemoryStore::new(), Limit::new("otp", Quota::per_minute(2).sliding_log())?);
    /// assert!(limiter.peek("alice", 1).await?.is_allowed());
    /// limiter.check("alice", 2).await?;
    /// let look = limiter.peek("alice", 1).await?;
    /// assert!(!look.is_allowed() && look.remaining() == 0);
    /// assert!(limiter.peek("alice", 0).await?.is_allowed());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn peek(&self, key: impl AsRef<[u8]>, cost: u64) -> Result<Decision, Error> {
        let limits = self.current();
        let checks = Self::checks(limits.iter().map(|l| (&**l, key.as_ref())), cost);
        let look = Ask {
            dry: true,
            ..Ask::NOW
        };
        self.decided(&checks, look).await
    }

    /// Takes as much as every limit has left for `key` now, at most `most`
    /// (a batch endpoint taking what it may), in one round trip:
    /// [`Decision::granted_amount`] says how much. When nothing is left, the
    /// decision is the denial of 1, with the exact `retry_after` until one
    /// is there; a `most` of 0 takes nothing and is allowed. The grant can
    /// be given back once ([`Grant::refund`]). Limits in
    /// [shadow mode](Limit::shadow) take no part.
    ///
    /// ```
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let limiter = Limiter::new(MemoryStore::new(), Limit::new("rows", Quota::per_minute(10).sliding_log())?);
    /// assert_eq!(limiter.take_up_to("tenant", 4).await?.granted_amount(), 4);
    /// assert_eq!(limiter.take_up_to("tenant", 100).await?.granted_amount(), 6);
    /// let none = limiter.take_up_to("tenant", 100).await?;
    /// assert!(!none.is_allowed() && none.granted_amount() == 0);
    /// assert!(none.decision().retry_after().is_some());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn take_up_to(&self, key: impl AsRef<[u8]>, most: u64) -> Result<Grant, Error> {
        if most == 0 {
            return self.refundable().check(key, 0).await;
        }
        let keys = [key];
        let limits = self.current();
        let mut checks = Self::keyed_checks(&limits, &keys, most)?;
        // limits in shadow mode never refuse, so they take no part
        checks.retain(|c| !c.limit.is_shadow());
        if checks.is_empty() {
            let mut decision = self.refundable().check(&keys[0], 0).await?.into_decision();
            decision.granted = most;
            return Ok(Grant::new(decision, None));
        }
        let store = &self.inner.store;
        let timer = StoreTimer::start();
        let taken = store.engine().take(&checks, self.deadline()).get().await;
        timer.finish(|| store.kind(), "take");
        let result = taken.and_then(|(reply, k)| {
            let mut decision = Self::decision_of(&checks, reply, 0)?;
            decision.granted = if decision.is_allowed() {
                u64::try_from(k).unwrap_or(0)
            } else {
                0
            };
            Ok(decision)
        });
        self::count::count(&checks, &result, self::count::outcome_of(&result));
        let decision = result?;
        // each limit was charged what was taken, not what was asked
        let taken = Self::cost(decision.granted);
        let mut charged = Self::charged(&checks, &decision);
        for charge in &mut charged {
            charge.cost = taken;
        }
        let refund = Refund::of(self, &decision, charged);
        Ok(Grant::new(decision, refund))
    }

    /// Takes `cost` now or reserves it for the earliest moment within
    /// `max_wait`, in one round trip, then sleeps until that moment. When the
    /// wait would exceed `max_wait` it returns the denial at once, consuming
    /// nothing. Dropping the future while it sleeps gives the reservation
    /// back, so the next request can have it. A `max_wait` over [`MAX_WAIT`]
    /// is refused ([`Error::WaitTooLong`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let limiter = Limiter::new(MemoryStore::new(), Limit::new("jobs", Quota::per_second(100).allow_burst(1).gcra())?);
    /// limiter.check("queue", 1).await?;
    /// let d = limiter.acquire("queue", 1, Duration::from_secs(1)).await?; // sleeps ~10 ms
    /// assert!(d.is_allowed() && d.delay() > Duration::ZERO);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn acquire(
        &self,
        key: impl AsRef<[u8]>,
        cost: u64,
        max_wait: Duration,
    ) -> Result<Decision, Error> {
        Self::within_max_wait(max_wait)?;
        let limits = self.current();
        let key = key.as_ref();
        let checks = Self::checks(limits.iter().map(|l| (&**l, key)), cost);
        let decision = self.decided(&checks, Ask::ahead(max_wait, false)).await?;
        if decision.is_allowed() && !decision.delay().is_zero() {
            let charged = Self::charged(&checks, &decision);
            let guard = RefundOnDrop::new(Refund::of(self, &decision, charged));
            tokio::time::sleep(decision.delay()).await;
            drop(guard.disarm());
        }
        Ok(decision)
    }

    /// The general form: one key per limit (or one key for all), a cost, and
    /// how far in the future a grant may be reserved. Returns at once; when the
    /// decision is a reservation ([`Decision::delay`] > 0), the caller waits.
    ///
    /// A `max_wait` over [`MAX_WAIT`] is refused ([`Error::WaitTooLong`]).
    pub async fn decide<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        cost: u64,
        max_wait: Duration,
    ) -> Result<Decision, Error> {
        Self::within_max_wait(max_wait)?;
        let limits = self.current();
        let checks = Self::keyed_checks(&limits, keys, cost)?;
        self.decided(&checks, Ask::ahead(max_wait, false)).await
    }

    /// [`Error::WaitTooLong`] for a `max_wait` over [`MAX_WAIT`].
    fn within_max_wait(max_wait: Duration) -> Result<(), Error> {
        if max_wait > MAX_WAIT {
            return Err(Error::WaitTooLong(max_wait));
        }
        Ok(())
    }

    /// One check per limit: `keys[i]` for limit `i`, or one key for all.
    fn keyed_checks<'a, K: AsRef<[u8]>>(
        limits: &'a [Current<'_>],
        keys: &'a [K],
        cost: u64,
    ) -> Result<Checks<'a>, Error> {
        if keys.len() != 1 && keys.len() != limits.len() {
            return Err(Error::KeyCount {
                expected: limits.len(),
                got: keys.len(),
            });
        }
        if keys.iter().any(|k| k.as_ref().is_empty()) {
            return Err(Error::EmptyKey);
        }
        let pairs = limits
            .iter()
            .enumerate()
            .map(|(i, l)| (&**l, keys[i.min(keys.len() - 1)].as_ref()));
        Ok(Self::checks(pairs, cost))
    }

    /// Whether every decision of this limiter's store is made at once (in
    /// memory): the layer then decides inside `call`.
    pub(crate) fn answers_at_once(&self) -> bool {
        !self.inner.store.engine().shared().remote()
    }

    /// The decisions whose grant can be given back once ([`Grant::refund`]):
    /// take when a request arrives, give back when its outcome says it
    /// should not count (see [`Refundable`]).
    pub fn refundable(&self) -> Refundable<'_> {
        Refundable { limiter: self }
    }

    /// Takes a permit of each of the limiter's
    /// [concurrency limits](Limit::concurrency) for `key`, with the
    /// limiter's other limits in the same atomic decision (each charged
    /// 1), and returns a [`Lease`] that holds the permits until it is
    /// dropped or released. When any limit refuses, the lease holds nothing
    /// ([`Lease::is_held`] is `false`) and its decision says when to retry.
    /// A limiter without a concurrency limit is an [`Error::Config`].
    pub async fn acquire_lease(&self, key: impl AsRef<[u8]>) -> Result<Lease, Error> {
        if !self.current().iter().any(|l| l.is_concurrency()) {
            return Err(Error::Config(crate::ConfigError::NoConcurrencyLimit));
        }
        let keys = [key];
        let limits = self.current();
        let checks = Self::keyed_checks(&limits, &keys, 1)?;
        let decision = self.decided(&checks, Ask::NOW).await?;
        let charged = Self::charged(&checks, &decision);
        Ok(Lease::of(self, decision, &charged))
    }

    /// The operator's handle: stored quotas, per-key overrides,
    /// blocks and inspection (see [`Admin`]).
    pub fn admin(&self) -> Admin<'_> {
        Admin { limiter: self }
    }

    /// Forgets `key`'s state in every limit: the next check sees fresh limits.
    pub async fn reset(&self, key: impl AsRef<[u8]>) -> Result<(), Error> {
        let key = non_empty(key.as_ref())?;
        if self.inner.limits.is_empty() {
            return Err(Error::Config(crate::ConfigError::NoLimits));
        }
        let limits = self.current();
        let checks = Self::checks(limits.iter().map(|l| (&**l, key)), 0);
        if let (Some(denials), Some(check)) = (&self.inner.denials, checks.first()) {
            denials.forget(check.key);
        }
        let timer = StoreTimer::start();
        let result = self
            .inner
            .store
            .engine()
            .reset(&checks, self.deadline())
            .get()
            .await;
        timer.finish(|| self.inner.store.kind(), "reset");
        result
    }
}

/// `key`, or [`Error::EmptyKey`] when it is empty: every operation of the
/// limiter that names a key refuses an empty one.
pub(crate) fn non_empty(key: &[u8]) -> Result<&[u8], Error> {
    if key.is_empty() {
        return Err(Error::EmptyKey);
    }
    Ok(key)
}
