//! Where limit state lives: [`MemoryStore`] (in-process, the default) and
//! [`RedisStore`] (shared by every instance, with the `redis` feature). Both
//! run the same algorithms with the same arithmetic and give the same
//! decisions for the same inputs.

#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) mod fleet;
pub(crate) mod keys;
mod memory;
#[cfg(feature = "redis")]
mod redis;

use std::future::Future;
use std::pin::Pin;

pub use self::memory::{MemoryStore, MemoryStoreBuilder, DEFAULT_MAX_KEYS, DEFAULT_SWEEP_INTERVAL};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use self::redis::{RedisStore, RedisStoreBuilder};

use crate::algorithm::Reply;
use crate::Error;

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

pub(crate) use crate::sync::lock;

pub(crate) use self::backend::{
    Answer, Check, Deadline, PenaltyChange, QuotaChange, QuotaRegistry, Settle, Settled,
};

/// A place to keep limit state: [`MemoryStore`] or [`RedisStore`].
///
/// Sealed: no other crate can implement it. Its operations are a supertrait
/// private to this crate, so that both stores can evolve together with the
/// algorithms (the same arithmetic in Rust and in Lua); a user chooses one
/// of the two and passes it to [`Limiter`](crate::Limiter) or the layer.
///
/// ```compile_fail
/// struct Mine;
/// impl tower_ratelimit::Store for Mine {} // sealed: Mine cannot be a store
/// ```
pub trait Store: backend::Backend + Send + Sync + 'static {}

/// The operations of a store ([`Backend`](backend::Backend)) and what they
/// take and answer: public items in a module private to this crate, so that
/// no other crate can implement [`Store`].
pub(crate) mod backend {
    use super::{lock, BoxFuture, Error, Reply};
    use crate::{Limit, MemoryStore};
    use std::future::Future;

    /// A store's answer to one operation: at once (in memory: nothing to
    /// await, no allocation), or later (over the network: a future to
    /// await, bounded by the operation's [`Deadline`]). Each caller has one
    /// path over it.
    #[allow(unreachable_pub)]
    pub enum Answer<'a, T> {
        /// Answered.
        Now(T),
        /// To be awaited.
        Later(BoxFuture<'a, T>),
    }

    impl<'a, T> Answer<'a, T> {
        /// The answer, awaited if it comes later.
        pub(crate) async fn get(self) -> T {
            match self {
                Answer::Now(answer) => answer,
                Answer::Later(future) => future.await,
            }
        }

        /// The answer passed through `f`, at once or when it comes.
        pub(crate) fn map<U>(self, f: impl FnOnce(T) -> U + Send + 'a) -> Answer<'a, U>
        where
            T: 'a,
            U: 'a,
        {
            match self {
                Answer::Now(answer) => Answer::Now(f(answer)),
                Answer::Later(future) => Answer::Later(Box::pin(async move { f(future.await) })),
            }
        }
    }

    /// When a store call must have answered: the limiter's timeout, counted
    /// from the call's start. A store that waits (on the network) bounds every
    /// wait by it, and only a request still unanswered at its deadline tells
    /// anything about the connection it was sent on: a caller that goes away
    /// sooner (an HTTP client closing its socket drops the request's future)
    /// tells nothing.
    #[derive(Debug, Clone, Copy)]
    #[allow(unreachable_pub)]
    // (only a store that waits reads it: the Redis store)
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub struct Deadline {
        /// When the deadline falls, once a store that waits has started it
        /// (a store that answers at once never reads the clock for it).
        at: Option<tokio::time::Instant>,
        timeout: std::time::Duration,
    }

    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    impl Deadline {
        /// `timeout` from when the store starts the call (see
        /// [`start`](Self::start)).
        pub(crate) fn after(timeout: std::time::Duration) -> Self {
            Self { at: None, timeout }
        }

        /// The deadline fixed: `timeout` from now unless already fixed (or,
        /// for a timeout beyond any clock, in 30 years). A store that waits
        /// starts it as it takes the call, before it builds the future.
        pub(crate) fn start(self) -> Self {
            Self {
                at: Some(self.at()),
                timeout: self.timeout,
            }
        }

        pub(crate) fn at(self) -> tokio::time::Instant {
            self.at.unwrap_or_else(|| {
                let now = tokio::time::Instant::now();
                now.checked_add(self.timeout)
                    .unwrap_or_else(|| now + std::time::Duration::from_secs(30 * 365 * 86_400))
            })
        }

        /// The error of a call that met its deadline.
        pub(crate) fn error(self) -> Error {
            Error::Timeout(self.timeout)
        }

        /// `call`'s result, or [`error`](Self::error) if it is not done by the
        /// deadline (it is dropped then).
        pub(crate) async fn bound<T>(
            self,
            call: impl Future<Output = Result<T, Error>>,
        ) -> Result<T, Error> {
            tokio::time::timeout_at(self.at(), call)
                .await
                .unwrap_or(Err(self.error()))
        }
    }

    /// One limit of an atomic decision: which limit, whose key, at what cost.
    #[derive(Debug, Clone, Copy)]
    #[allow(unreachable_pub)]
    pub struct Check<'a> {
        pub(crate) limit: &'a Limit,
        /// The user's key, as given (the Redis store escapes it into its
        /// hash tag, see `keys::tag`).
        pub(crate) key: &'a [u8],
        /// Cost; 0 looks without consuming.
        pub(crate) cost: i64,
    }

    /// What [`Backend::settle`] does, after the fact, to each check's limit
    /// and key.
    #[derive(Debug, Clone, Copy)]
    #[allow(unreachable_pub)]
    pub enum Settle {
        /// Gives back the grant of each check's `cost` that the store made
        /// at store time `at` (microseconds; for a granted [`Reply`] that is
        /// `reply.now + reply.wait`), exactly: a sliding log drops one entry
        /// of that time and cost (entries with equal time and cost are
        /// interchangeable); token bucket and GCRA take the cost back, never
        /// above their capacity; a fixed window uncounts it only if `at`
        /// lies in its current window; a sliding window counter from the
        /// current or previous window `at` fell in, nothing if older. Never
        /// below empty. Not idempotent: each call gives back once more, so
        /// callers make sure a grant is refunded at most once.
        Refund { at: i64 },
        /// Charges each check's cost whatever is left (a cost known only
        /// after the fact): where a cost of 1 would be granted, so a limit
        /// may end in debt, refusing until it is paid back. Not idempotent.
        Charge,
        /// Moves the grant of each check's cost made at `at` to the store's
        /// clock, where the limit still holds it: a sliding log's lease
        /// renewed (a concurrency limit); other algorithms hold none.
        Renew { at: i64 },
    }

    /// What [`Backend::settle`] answers: for [`Settle::Renew`], per check,
    /// the grant's new store time, `None` where it was no longer held;
    /// empty for the others.
    #[derive(Debug, Clone, Default, PartialEq, Eq)]
    #[allow(unreachable_pub)]
    pub struct Settled {
        pub(crate) renewed: smallvec::SmallVec<[Option<i64>; 2]>,
    }

    impl Settled {
        /// Reads the reply of a renewal (op 5 of `lua/limits.lua`): the
        /// store's clock, then per limit 1 when it held its grant, else 0,
        /// as little-endian doubles.
        #[cfg_attr(not(feature = "redis"), allow(dead_code))]
        pub(crate) fn from_packed(bytes: &[u8], limits: usize) -> Option<Self> {
            if bytes.len() != 8 * (1 + limits) {
                return None;
            }
            let mut values = bytes.chunks_exact(8).map(|chunk| {
                let x = f64::from_le_bytes(chunk.try_into().ok()?);
                let exact = x.abs() < crate::algorithm::EXACT as f64 && (x as i64) as f64 == x;
                exact.then_some(x as i64)
            });
            let now = values.next().flatten()?;
            let renewed = values
                .map(|held| match held? {
                    1 => Some(Some(now)),
                    0 => Some(None),
                    _ => None,
                })
                .collect::<Option<_>>()?;
            Some(Self { renewed })
        }
    }

    /// A change of a quota kept in the store (see
    /// [`Limit::quota_from_store`](crate::Limit::quota_from_store)).
    #[derive(Debug, Clone, Copy)]
    #[allow(unreachable_pub)]
    pub enum QuotaChange<'a> {
        /// Keep `limit`'s quota (for `ttl`, when given; only if none is kept
        /// yet, when `if_absent`).
        Keep {
            limit: &'a Limit,
            ttl: Option<std::time::Duration>,
            if_absent: bool,
        },
        /// Keep none.
        Remove,
    }

    /// An operation on a key's penalty state (see
    /// [`Limit::with_penalty`](crate::Limit::with_penalty)).
    #[derive(Debug, Clone, Copy)]
    #[allow(unreachable_pub)]
    pub enum PenaltyChange {
        /// Read it.
        Read,
        /// Block the key for this many microseconds from now (no offence;
        /// the refusals counted are dropped).
        Block(i64),
        /// Forget it all: block, refusals and offences.
        Unblock,
    }

    /// The quota each limit name was first used with on one store, to warn
    /// (once per name) when a name comes back with another quota: both would
    /// read and write the same keys, each misreading the other's state. And
    /// the kind of key each name was first used with by a layer, to warn
    /// (once per name) when a layer keys it another way: both would count
    /// in the same buckets wherever their key texts meet. Only consulted when
    /// a limiter or layer is built, never per decision.
    #[derive(Debug, Default)]
    #[allow(unreachable_pub)]
    pub struct QuotaRegistry {
        seen: std::sync::Mutex<std::collections::HashMap<&'static str, (crate::Quota, bool)>>,
        keyed:
            std::sync::Mutex<std::collections::HashMap<&'static str, (crate::key::KeyKind, bool)>>,
        /// Whether the server's persistence and eviction policy are to be
        /// checked for calendar quotas: [`CALENDAR_NONE`], then
        /// [`CALENDAR_DUE`] once a limiter with a calendar limit is built,
        /// then [`CALENDAR_TAKEN`] once a decision took the check (once per
        /// store and its clones).
        calendar: std::sync::atomic::AtomicU8,
    }

    const CALENDAR_NONE: u8 = 0;
    const CALENDAR_DUE: u8 = 1;
    // (checked by the Redis store only)
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    const CALENDAR_TAKEN: u8 = 2;

    impl QuotaRegistry {
        /// Records `limits`, warning about a name already used with another quota.
        pub(crate) fn register(&self, limits: &[crate::Limit]) {
            let mut seen = lock(&self.seen);
            for limit in limits {
                let quota = *limit.quota();
                let (first, warned) = seen.entry(limit.shared_name()).or_insert((quota, false));
                if *first != quota && !*warned {
                    *warned = true;
                    tracing::warn!(
                        target: "tower_ratelimit",
                        limit = limit.name(),
                        "limit {:?} is used with two different quotas on one store ({} and {}): \
                         both read and write the same keys, so each counts the other's requests \
                         under its own rules. Give each quota its own limit name.",
                        limit.name(),
                        first,
                        quota
                    );
                }
            }
        }

        /// Records that a limiter with a calendar limit was built: the
        /// store's durability is then checked once (see
        /// [`take_calendar_check`](Self::take_calendar_check)).
        pub(crate) fn calendar_limit(&self) {
            use std::sync::atomic::Ordering;
            let _ = self.calendar.compare_exchange(
                CALENDAR_NONE,
                CALENDAR_DUE,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }

        /// Whether the caller is the one to check the store's durability
        /// for calendar quotas: `true` once, after
        /// [`calendar_limit`](Self::calendar_limit). A load otherwise.
        #[inline]
        #[cfg_attr(not(feature = "redis"), allow(dead_code))]
        pub(crate) fn take_calendar_check(&self) -> bool {
            use std::sync::atomic::Ordering;
            self.calendar.load(Ordering::Relaxed) == CALENDAR_DUE
                && self
                    .calendar
                    .compare_exchange(
                        CALENDAR_DUE,
                        CALENDAR_TAKEN,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    )
                    .is_ok()
        }

        /// Records that a layer keys `limit` by `kind`, warning about a name
        /// already keyed by another kind.
        pub(crate) fn register_key(&self, name: &'static str, kind: &crate::key::KeyKind) {
            let mut keyed = lock(&self.keyed);
            let (first, warned) = keyed.entry(name).or_insert_with(|| (kind.clone(), false));
            if first != kind && !*warned {
                *warned = true;
                let (first_text, text) = (first.to_string(), kind.to_string());
                let alike = if first_text == text {
                    " (two extractor types of that name)"
                } else {
                    ""
                };
                tracing::warn!(
                    target: "tower_ratelimit",
                    limit = name,
                    "limit {:?} is keyed two ways on one store, by {} and by {}{}: both count \
                     in the same buckets wherever their key texts meet, so a client can spend \
                     another's (an API key written as an IP address drains that address). Give \
                     each its own limit name, or key both layers with one extractor.",
                    name,
                    first_text,
                    text,
                    alike
                );
            }
        }
    }

    /// The operations of a store: what the limiter and the layer ask of
    /// it, private to this crate.
    #[allow(unreachable_pub)]
    pub trait Backend {
        /// Decides all checks atomically: grants all of them at one time no
        /// later than `max_wait` microseconds from now, or none. A `dry` run
        /// decides the same way but grants and writes nothing. Every
        /// operation answers by its `deadline` ([`Error::Timeout`] then).
        fn decide<'a>(
            &'a self,
            checks: &'a [Check<'a>],
            max_wait: i64,
            dry: bool,
            deadline: Deadline,
        ) -> Answer<'a, Result<Reply, Error>>;
        /// Forgets the state of every check's key.
        fn reset<'a>(
            &'a self,
            checks: &'a [Check<'a>],
            deadline: Deadline,
        ) -> Answer<'a, Result<(), Error>>;
        /// Settles a grant after the fact (see [`Settle`]): gives it back,
        /// charges a cost known only now, or renews a lease.
        fn settle<'a>(
            &'a self,
            checks: &'a [Check<'a>],
            how: Settle,
            deadline: Deadline,
        ) -> Answer<'a, Result<Settled, Error>>;
        /// Takes what is available: grants k = min(N, what every check's
        /// limit has left now) at once, N being the checks' cost, or, when
        /// k = 0, decides a cost of 1 without granting it. Returns the reply
        /// (for cost k, or 1) and k.
        fn take<'a>(
            &'a self,
            checks: &'a [Check<'a>],
            deadline: Deadline,
        ) -> Answer<'a, Result<(Reply, i64), Error>>;

        /// The quota kept in the store for `check`'s limit: its key's
        /// override when `keyed`, else the limit's (see
        /// [`Limit::quota_from_store`](crate::Limit::quota_from_store)).
        fn read_quota<'a>(
            &'a self,
            check: &'a Check<'a>,
            keyed: bool,
            deadline: Deadline,
        ) -> Answer<'a, Result<Option<crate::Quota>, Error>>;
        /// Changes the quota [`read_quota`](Self::read_quota) reads; whether
        /// anything changed.
        fn write_quota<'a>(
            &'a self,
            check: &'a Check<'a>,
            keyed: bool,
            change: QuotaChange<'a>,
            deadline: Deadline,
        ) -> Answer<'a, Result<bool, Error>>;

        /// Applies `change` to the penalty state of `check`'s key in its
        /// limit; the state after it (before it, for an unblock) and the
        /// store time.
        /// `None` for a limit without a penalty.
        fn penalty<'a>(
            &'a self,
            check: &'a Check<'a>,
            change: PenaltyChange,
            deadline: Deadline,
        ) -> Answer<'a, Result<Option<(crate::penalty::PenState, i64)>, Error>>;

        /// The application clock the store decides on, if it has one.
        fn clock(&self) -> Option<std::sync::Arc<dyn crate::Clock>> {
            None
        }

        /// Whether the store is shared with other processes over a network,
        /// so that a local cache of its denials saves round trips.
        fn remote(&self) -> bool {
            false
        }

        /// The in-process store that decides in this one's place while it
        /// fails (the layer's `FallbackToMemory`): one per store, shared by
        /// its clones and every layer over it, so a limit shared by several
        /// layers stays one limit during an outage. `None` for a store that
        /// does not fail (memory).
        fn fallback(&self) -> Option<MemoryStore> {
            None
        }
        /// This instance's place among the instances that share this
        /// store, learned by a heartbeat while it answers: the fallback
        /// then grants each of them its share of every limit (see
        /// `fleet.rs`). Starts the heartbeat, unless it runs. `None` for a
        /// store that does not fail (memory), or one whose heartbeat is off.
        fn fleet(&self) -> Option<std::sync::Arc<super::fleet::Fleet>> {
            None
        }
        /// Where this store remembers which quota each limit name has.
        fn quotas(&self) -> Option<&QuotaRegistry> {
            None
        }
        /// The batches of hot keys' permits (see `Limit::with_hot_key`) of every
        /// limiter over this store: one set per store, shared by its clones
        /// and every limiter and layer over it, so that a process holds one
        /// batch per hot limit and key, which the bound `HotKey` states
        /// counts on. `None` for a store that serves no batches (memory).
        fn hot_pools(&self) -> Option<std::sync::Arc<crate::limiter::HotPools>> {
            None
        }
        /// The `store` label of the metrics: `"memory"` or `"redis"`.
        fn kind(&self) -> &'static str;
        /// Reports the number of stored key states to the metrics, when due.
        fn report_size(&self, _now: i64) {}
    }
}
