//! What a limit does besides counting its quota: leases (a concurrency
//! limit), shadow mode, a stored quota, a penalty, hot keys.

use std::sync::Arc;
use std::time::Duration;

use super::Limit;
use crate::hot::HotKey;
use crate::penalty::{PenParams, Penalty};
use crate::quota::Quota;
use crate::ConfigError;

impl Limit {
    /// A concurrency limit: at most `max` permits held at once per key
    /// ("at most 2 exports running per tenant"). A permit is a lease, held
    /// while the work runs and given back when it ends: by a
    /// [`Lease`](crate::Lease) from
    /// [`Limiter::acquire_lease`](crate::Limiter::acquire_lease), or, in a
    /// layer, from the decision through the handler until the response body
    /// is finished or dropped (a client that stops reading loses it a
    /// lease time later; see [`hold_at_most`](Self::hold_at_most)). A lease
    /// lasts `lease` unless renewed: its holder renews it
    /// while it runs, so the permits of a holder that died (a crashed
    /// instance, a killed task) come back within `lease` at most.
    ///
    /// It is a sliding log of `max` per `lease` whose grants are given back
    /// at the end: exact under concurrency on both stores and a cluster, and
    /// decided with other limits in one atomic decision. A refused request
    /// is told to retry when the oldest lease would expire (a bound: a
    /// release frees a permit sooner). A decision that may wait (a layer's
    /// delay mode, [`Limiter::acquire`](crate::Limiter::acquire)) reserves
    /// no permit ahead, since a lease renewed meanwhile would run beside the
    /// reserved one: it is decided again, at pauses of 10 ms doubling up to
    /// 200 ms, until a permit is free or the wait is over.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let exports = Limit::concurrency("exports", 2, Duration::from_secs(30))?;
    /// let limiter = Limiter::new(MemoryStore::new(), exports);
    /// let first = limiter.acquire_lease("acme").await?;
    /// let second = limiter.acquire_lease("acme").await?;
    /// assert!(first.is_held() && second.is_held());
    /// assert!(!limiter.acquire_lease("acme").await?.is_held()); // two running
    /// drop(first); // the export ended
    /// assert!(limiter.acquire_lease("acme").await?.is_held());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn concurrency(
        name: impl Into<String>,
        max: u64,
        lease: Duration,
    ) -> Result<Self, ConfigError> {
        let mut limit = Self::new(name, Quota::rate(max, lease).sliding_log())?;
        limit.leases = true;
        Ok(limit)
    }

    /// Whether this is a [concurrency limit](Self::concurrency), whose
    /// grants are leases given back when the work ends.
    pub fn is_concurrency(&self) -> bool {
        self.leases
    }

    /// The longest a permit of this [concurrency limit](Self::concurrency)
    /// is held, renewals included: past it, the permit is given back and
    /// the holder loses it. Unset (the default), a permit has no such
    /// bound: a [`Lease`](crate::Lease)'s holder is code of the
    /// application, and a long job keeps its permit; in a layer, a request
    /// holds its permit from its decision until its response body ends,
    /// however long a client that reads it takes (a stream of events, a
    /// download).
    ///
    /// In a layer, a client that stops reading loses its permit whether
    /// this is set or not: once the body has had data ready that the server
    /// did not ask for during the lease time (the server asks whenever the
    /// client takes what was sent; a body waiting for its own data is no
    /// stall), the permit comes back. Then, or at `max_hold`, the body ends
    /// with an error at its next poll, which closes the connection.
    ///
    /// A zero `max_hold`, or one on a limit that is not a concurrency
    /// limit, is a [`ConfigError::MaxHold`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimit::Limit;
    ///
    /// let downloads = Limit::concurrency("downloads", 4, Duration::from_secs(30))?
    ///     .hold_at_most(Duration::from_secs(120))?;
    /// assert_eq!(downloads.max_hold(), Some(Duration::from_secs(120)));
    /// # Ok::<(), tower_ratelimit::ConfigError>(())
    /// ```
    pub fn hold_at_most(mut self, max_hold: Duration) -> Result<Self, ConfigError> {
        if !self.leases {
            return Err(ConfigError::MaxHold(format!(
                "limit {:?} is not a concurrency limit",
                self.name()
            )));
        }
        if max_hold.is_zero() {
            return Err(ConfigError::MaxHold(format!(
                "the maximum hold of limit {:?} is zero",
                self.name()
            )));
        }
        self.max_hold = Some(max_hold);
        Ok(self)
    }

    /// The longest a permit is held, when set with
    /// [`hold_at_most`](Self::hold_at_most).
    pub fn max_hold(&self) -> Option<Duration> {
        self.max_hold
    }

    /// This limit in shadow mode: it decides and records as if enforced
    /// (its grants count, and a request it would refuse takes nothing from
    /// it), but it never refuses. Its would-be refusals are counted under the
    /// outcome `shadow_denied` (see [`crate::metrics`]), logged at `debug`,
    /// and marked in the decision ([`LimitStatus::would_refuse`]): roll a
    /// new limit out, watch it, then enforce it. As Envoy's rate limit
    /// service does.
    ///
    /// With other limits, the request is decided once with every limit; if
    /// only shadow limits refuse, it is decided again without them (a second
    /// round trip, only then), so the enforced limits count it.
    ///
    /// ```
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let trial = Limit::new("trial", Quota::per_minute(1).sliding_log())?.shadow();
    /// let limiter = Limiter::new(MemoryStore::new(), trial);
    /// limiter.check("alice", 1).await?;
    /// let second = limiter.check("alice", 1).await?;
    /// assert!(second.is_allowed()); // never refused,
    /// assert!(second.statuses()[0].would_refuse()); // but it would have been
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    ///
    /// [`LimitStatus::would_refuse`]: crate::LimitStatus::would_refuse
    pub fn shadow(mut self) -> Self {
        self.shadow = true;
        self
    }

    /// This limit uses its stored quota when it has one: a quota kept in
    /// the store for it, shared by every instance, set with
    /// [`Admin::set_stored_quota`](crate::Admin::set_stored_quota), and
    /// per key with [`Admin::set_override`](crate::Admin::set_override).
    /// Both are read in the round trip of each decision (no call of their
    /// own), so a change is in force for every instance's next decision. The
    /// limit's own quota decides when none is stored, and a stored quota of
    /// another algorithm is ignored.
    ///
    /// On Redis, each server keeps what it last read of the limit's quota
    /// in its Lua VM and reads it again at most once a second (with whether
    /// any key has an override; a key's override is read by its decision,
    /// one more command, only while the limit has some): a change made
    /// through these methods drops that copy on every server it writes, so
    /// it is in force for the next decision there; a change made behind
    /// their back (the hash edited by hand, evicted or flushed, set by
    /// another version of this crate, a failover to a replica) is in force
    /// within one second of the store's clock (Redis `TIME`, or the store's
    /// [`clock`](crate::RedisStoreBuilder::clock) when it has one). During
    /// a Redis outage, a layer's
    /// [`FallbackToMemory`](crate::layer::OnStoreError::FallbackToMemory)
    /// decides with the limit's own quota. Such a limit's denials are not cached
    /// (see [`LimiterBuilder::cache_denials`](crate::LimiterBuilder::cache_denials)):
    /// a raised quota must not wait for a cached refusal to run out.
    ///
    /// ```
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let reports = Limit::new("reports", Quota::per_hour(2).fixed_window())?.use_stored_quota();
    /// let store = MemoryStore::new();
    /// let (a, b) = (Limiter::new(store.clone(), reports.clone()), Limiter::new(store, reports));
    /// a.admin().set_stored_quota("reports", Quota::per_hour(10).fixed_window()).await?;
    /// assert_eq!(b.check("acme", 1).await?.capacity(), 10); // b reads what a stored
    /// b.admin().set_override("reports", "bigcorp", Quota::per_hour(1000).fixed_window(), None).await?;
    /// assert_eq!(a.check("bigcorp", 1).await?.capacity(), 1000);
    /// assert_eq!(a.check("acme", 1).await?.capacity(), 10);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn use_stored_quota(mut self) -> Self {
        self.stored_quota = true;
        self
    }

    /// This limit with a [`Penalty`]: after the penalty's number of
    /// refusals by this limit within its time, the key is blocked, longer
    /// on each repeat offence. Counted and decided in the same store call
    /// as the limit's decision (on Redis, one more key in the key's hash
    /// tag); limits without a penalty pay nothing for it.
    ///
    /// A refusal counts when this limit itself refuses a decision that
    /// would have taken something (not a [`peek`](crate::Limiter::peek), a
    /// [`take_up_to`](crate::Limiter::take_up_to) that finds nothing or a
    /// decision refused by another limit only). While the key is blocked the
    /// limit refuses it with `retry_after` the time left of the block
    /// ([`LimitStatus::is_blocked`](crate::LimitStatus::is_blocked)), without
    /// consulting or charging its quota, whatever `max_wait` (a block is not
    /// waited out by a reservation); refusals during a block do not count.
    /// [`Admin::block`](crate::Admin::block),
    /// [`unblock`](crate::Admin::unblock) and
    /// [`inspect`](crate::Admin::inspect) manage a key's penalty. Refunds
    /// are unaffected by a block, and [`reset`](crate::Limiter::reset)
    /// leaves the penalty (an unblock forgives it). On a limit in
    /// [shadow mode](Self::shadow), would-be refusals count, and a block is a
    /// would-be refusal too.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimit::{Limit, Limiter, ManualClock, MemoryStore, Penalty, Quota};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let min = Duration::from_secs(60);
    /// let logins = Limit::new("login", Quota::per_minute(1).fixed_window())?
    ///     .with_penalty(Penalty::new(2, 10 * min, [5 * min, 60 * min])?);
    /// let clock = ManualClock::new(1_800_000_000_000_000);
    /// let limiter = Limiter::new(MemoryStore::with_clock(clock.clone()), logins);
    /// assert!(limiter.check("mallory", 1).await?.is_allowed());
    /// assert!(!limiter.check("mallory", 1).await?.is_allowed()); // refusal 1
    /// let banned = limiter.check("mallory", 1).await?; // refusal 2: an offence
    /// assert_eq!(banned.retry_after(), Some(5 * min));
    /// clock.advance(2 * min); // the quota is back, the block is not
    /// assert_eq!(limiter.check("mallory", 1).await?.retry_after(), Some(3 * min));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn with_penalty(mut self, penalty: Penalty) -> Self {
        // every refusal must reach the store to be counted
        self.hot = None;
        let params = penalty.params();
        self.penalty = Some(Arc::new((penalty, params)));
        self
    }

    /// This limit's keys are hot: on a store shared over a network, each
    /// instance takes batches of permits from the store and grants them in
    /// this process, so one global key can be decided far faster than one
    /// Redis could decide it alone, at a bounded cost in exactness stated
    /// in [`HotKey`]. Refusals reach the store about once per `retry_after`
    /// (as with the limiter's cache of denials). An in-process store
    /// decides every request itself and ignores this.
    ///
    /// Only a plain decision (a `check` or a layer's request, cost at most
    /// [`HotKey::permits`]) is served from a batch: a look, a reservation
    /// ahead, [`take_up_to`](crate::Limiter::take_up_to) and a limit in
    /// shadow mode are decided by the store. A refund gives nothing back
    /// to a hot limit (its permit may have come from a batch: it counts as
    /// spent). With other,
    /// ordinary limits in the same decision, those are decided by the store
    /// and, if they refuse, the permit goes back to the batch.
    ///
    /// Fails with [`ConfigError::HotKey`] when a batch is larger than the
    /// limit's capacity, or for a concurrency limit or a limit with a
    /// penalty (whose every decision must reach the store).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimit::{HotKey, Limit, Quota};
    ///
    /// let global = Limit::new("global", Quota::per_second(50_000).gcra())?
    ///     .with_hot_key(HotKey::new(200, Duration::from_millis(100))?)?;
    /// assert_eq!(global.hot_key().map(HotKey::permits), Some(200));
    /// # Ok::<(), tower_ratelimit::ConfigError>(())
    /// ```
    pub fn with_hot_key(mut self, hot: HotKey) -> Result<Self, ConfigError> {
        if hot.permits() > self.capacity() {
            return Err(ConfigError::HotKey(format!(
                "a batch of {} is more than limit {:?} holds ({})",
                hot.permits(),
                self.name(),
                self.capacity()
            )));
        }
        if self.leases || self.penalty.is_some() {
            return Err(ConfigError::HotKey(format!(
                "limit {:?} must decide every request in the store (a concurrency limit or a penalty)",
                self.name()
            )));
        }
        self.hot = Some(hot);
        Ok(self)
    }

    /// How the limit's keys are served from local batches, if they are (see
    /// [`with_hot_key`](Self::with_hot_key)).
    pub fn hot_key(&self) -> Option<&HotKey> {
        self.hot.as_ref()
    }

    /// The limit's penalty, if it has one (see [`with_penalty`](Self::with_penalty)).
    pub fn penalty(&self) -> Option<&Penalty> {
        self.penalty.as_ref().map(|p| &p.0)
    }

    /// The penalty's integers.
    pub(crate) fn pen_params(&self) -> Option<&PenParams> {
        self.penalty.as_ref().map(|p| &p.1)
    }

    /// Whether the limit uses its stored quota when it has one (see
    /// [`use_stored_quota`](Self::use_stored_quota)).
    pub fn uses_stored_quota(&self) -> bool {
        self.stored_quota
    }

    /// This limit as a tier of a layer's rule whose limit uses a stored
    /// quota ([`Rule::tier`](crate::layer::Rule::tier)): a key's override
    /// decides in place of its quota, the limit's stored quota never (it is
    /// the default tier's).
    pub(crate) fn overrides_only(mut self) -> Self {
        self.stored_quota = true;
        self.overrides_only = true;
        self
    }

    /// Whether only a key's override may decide in place of the quota, not
    /// the limit's stored quota (see [`overrides_only`](Self::overrides_only)).
    pub(crate) fn is_overrides_only(&self) -> bool {
        self.overrides_only
    }

    /// Whether the limit is in [shadow mode](Self::shadow).
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }
}
