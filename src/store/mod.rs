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
mod shared;

use std::future::Future;
use std::pin::Pin;

pub use self::memory::{MemoryStore, MemoryStoreBuilder, DEFAULT_MAX_KEYS, DEFAULT_SWEEP_INTERVAL};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use self::redis::{RedisStore, RedisStoreBuilder};

use crate::algorithm::Reply;
use crate::Error;
use crate::Limit;

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

pub(crate) use crate::sync::lock;

#[cfg(feature = "redis")]
pub(crate) use self::shared::Fallback;
pub(crate) use self::shared::Shared;

/// A place to keep limit state, as the limiter and the layer take it: a
/// [`MemoryStore`] or a [`RedisStore`] (`.into()`, or passed where
/// `impl Into<Store>` is asked). Cloning it is cheap; clones share the state.
///
/// ```
/// use tower_ratelimit::{MemoryStore, Store};
///
/// let store: Store = MemoryStore::new().into();
/// assert_eq!(store.kind(), "memory");
/// ```
#[derive(Clone)]
pub struct Store {
    engine: std::sync::Arc<dyn Engine>,
}

impl Store {
    pub(crate) fn of(engine: impl Engine) -> Self {
        Self {
            engine: std::sync::Arc::new(engine),
        }
    }

    /// Its engine: what the limiter and the layer call.
    pub(crate) fn engine(&self) -> &dyn Engine {
        &*self.engine
    }

    /// `"memory"` or `"redis"`: the `store` label of the metrics.
    pub fn kind(&self) -> &'static str {
        self.engine.shared().kind
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("kind", &self.kind()).finish()
    }
}

impl From<MemoryStore> for Store {
    fn from(store: MemoryStore) -> Self {
        Self::of(store)
    }
}

#[cfg(feature = "redis")]
impl From<RedisStore> for Store {
    fn from(store: RedisStore) -> Self {
        Self::of(store)
    }
}

/// The contract of an engine that keeps limit state: its operations, one
/// name each from the limiter down to the library's op codes (`decide`,
/// `take`, `settle`: `OP_REFUND`, `OP_CHARGE`, `OP_RENEW`, `reset`,
/// `quotas`, `penalty`), and what it shares with every limiter and layer
/// over it ([`Shared`]). Every operation answers by its `deadline`
/// ([`Error::Timeout`] then); an engine that never waits answers
/// [`Answer::Now`].
pub(crate) trait Engine: Send + Sync + 'static {
    /// Decides all checks atomically: grants all of them at one time no
    /// later than `max_wait` microseconds from now, or none. A `dry` run
    /// decides the same way but grants and writes nothing.
    fn decide<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        max_wait: i64,
        dry: bool,
        deadline: Deadline,
    ) -> Answer<'a, Result<Reply, Error>>;
    /// Takes what is available: grants k = min(N, what every check's
    /// limit has left now) at once, N being the checks' cost, or, when
    /// k = 0, decides a cost of 1 without granting it. Returns the reply
    /// (for cost k, or 1) and k.
    fn take<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        deadline: Deadline,
    ) -> Answer<'a, Result<(Reply, i64), Error>>;
    /// Settles a grant after the fact (see [`Settle`]): gives it back,
    /// charges a cost known only now, or renews a lease.
    fn settle<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        how: Settle,
        deadline: Deadline,
    ) -> Answer<'a, Result<Settled, Error>>;
    /// Decides a set at one clock (op 9, `each` in `lua/limits.lua`, and
    /// its mirror [`crate::algorithm::each`]): each check with its own
    /// limit, key and cost (negative: a refund), counted as `mode` says.
    /// Penalties are neither read nor fed.
    fn each<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        mode: crate::algorithm::EachMode,
        deadline: Deadline,
    ) -> Answer<'a, Result<Reply, Error>>;
    /// Forgets the state of every check's key.
    fn reset<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        deadline: Deadline,
    ) -> Answer<'a, Result<(), Error>>;
    /// Reads or changes the quota kept in the store for `check`'s limit:
    /// its key's override when `keyed`, else the limit's (see
    /// [`Limit::use_stored_quota`](crate::Limit::use_stored_quota)).
    fn quotas<'a>(
        &'a self,
        check: &'a Check<'a>,
        keyed: bool,
        op: Quotas<'a>,
        deadline: Deadline,
    ) -> Answer<'a, Result<Quoted, Error>>;
    /// Applies `op` to the penalty state of `check`'s key in its limit; the
    /// state after it (before it, for an unblock) and the store time.
    /// `None` for a limit without a penalty.
    fn penalty<'a>(
        &'a self,
        check: &'a Check<'a>,
        op: Penalty,
        deadline: Deadline,
    ) -> Answer<'a, Result<Option<(crate::penalty::PenState, i64)>, Error>>;
    /// What the engine shares with every limiter and layer over it.
    fn shared(&self) -> &Shared;
}

/// A store's answer to one operation: at once (in memory: nothing to
/// await, no allocation), or later (over the network: a future to
/// await, bounded by the operation's [`Deadline`]). Each caller has one
/// path over it.
pub(crate) enum Answer<'a, T> {
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
// (only a store that waits reads it: the Redis store)
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct Deadline {
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
pub(crate) struct Check<'a> {
    pub(crate) limit: &'a Limit,
    /// The user's key, as given (the Redis store escapes it into its
    /// hash tag, see `keys::tag`).
    pub(crate) key: &'a [u8],
    /// Cost; 0 looks without consuming.
    pub(crate) cost: i64,
}

/// What [`Engine::settle`] does, after the fact, to each check's limit
/// and key: the library's op of the same name.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Settle {
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

/// What [`Engine::settle`] answers: for [`Settle::Renew`], per check,
/// the grant's new store time, `None` where it was no longer held;
/// empty for the others.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Settled {
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

/// What [`Engine::quotas`] does with a quota kept in the store (see
/// [`Limit::use_stored_quota`](crate::Limit::use_stored_quota)).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Quotas<'a> {
    /// Read it.
    Read,
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

/// What [`Engine::quotas`] answers: the quota read ([`Quotas::Read`]), or
/// whether a change changed anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Quoted {
    /// The quota kept, if any.
    Read(Option<crate::Quota>),
    /// Whether the kept quota changed.
    Changed(bool),
}

/// What [`Engine::penalty`] does to a key's penalty state (see
/// [`Limit::with_penalty`](crate::Limit::with_penalty)); its wire code is
/// [`code`](Self::code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Penalty {
    /// Read it.
    Read,
    /// Block the key for this many microseconds from now (no offence;
    /// the refusals counted are dropped).
    Block(i64),
    /// Forget it all: block, refusals and offences.
    Unblock,
}

impl Penalty {
    /// The library's code for it (option slot `OPT_AT` of `OP_PENALTY`,
    /// see `wire::PENALTY_CODES`) and the length of a block (us).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn code(self) -> (i64, i64) {
        let [read, block, unblock] = crate::algorithm::wire::PENALTY_CODES.map(|(_, c)| c);
        match self {
            Penalty::Read => (read, 0),
            Penalty::Block(us) => (block, us),
            Penalty::Unblock => (unblock, 0),
        }
    }
}
