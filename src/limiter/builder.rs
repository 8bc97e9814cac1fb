//! How a [`Limiter`] is made: its builder, and the registration of its
//! limits on the store.

use std::sync::Arc;
use std::time::Duration;

use super::deny_cache::DenyCache;
use super::{Inner, Limiter, DEFAULT_TIMEOUT};
use crate::store::Store;
use crate::{ConfigError, Limit, LimitSource};

/// Configures a [`Limiter`].
#[must_use]
pub struct LimiterBuilder {
    store: Store,
    limits: Vec<LimitSource>,
    timeout: Duration,
    cache_denials: bool,
}

impl std::fmt::Debug for LimiterBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimiterBuilder")
            .field("limits", &self.limits)
            .finish()
    }
}

impl LimiterBuilder {
    /// Adds a limit, fixed or [live](crate::LiveLimit). All limits are
    /// decided together.
    pub fn limit(mut self, limit: impl Into<LimitSource>) -> Self {
        self.limits.push(limit.into());
        self
    }

    /// Bounds every store call (default [`DEFAULT_TIMEOUT`]); a call that takes
    /// longer fails with [`Error::Timeout`].
    ///
    /// [`Error::Timeout`]: crate::Error::Timeout
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Answer denials known to hold from a local cache (default: yes, for a
    /// store shared over a network; the in-memory store needs none).
    ///
    /// A request denied with `retry_after` R is denied again, for the same
    /// limits and keys and the same or a larger cost, until R has passed,
    /// whatever other instances do: so until then the limiter answers it
    /// without a round trip, and a flood on one key costs the store one
    /// decision per retry period. Such a decision repeats the store's last
    /// answer, aged: its waits count down, its `remaining` is the one the
    /// store reported (see [`Decision::from_local_cache`]); for a larger
    /// cost its `retry_after` is a lower bound. It never refuses what the
    /// store would grant, unless another process resets the key, raises
    /// the quota or lifts a key's block meanwhile (a
    /// [`reset`](Limiter::reset) or [`unblock`](crate::Admin::unblock) through
    /// this limiter clears the key's entries). A limit with a
    /// [penalty](crate::Limit::with_penalty) has its denials cached only while
    /// it blocks the key (its other refusals are counted by the store). At
    /// most 10 000 entries are kept.
    ///
    /// [`Decision::from_local_cache`]: crate::Decision::from_local_cache
    pub fn cache_denials(mut self, cache: bool) -> Self {
        self.cache_denials = cache;
        self
    }

    /// Builds the limiter: at least one limit, unique names.
    pub fn build(self) -> Result<Limiter, ConfigError> {
        if self.limits.is_empty() {
            return Err(ConfigError::NoLimits);
        }
        self.build_for_sets()
    }
}

impl LimiterBuilder {
    /// Builds a limiter for [sets](Limiter::decide_set), whose limits come
    /// with each call: limits of its own are optional (unique names). With
    /// none, its other decisions (`check`, `peek`, `reset`, ...) answer
    /// [`Error::Config`](crate::Error::Config) with
    /// [`ConfigError::NoLimits`]; a set is decided with its store,
    /// [timeout](Self::timeout) and (for a plain all-or-nothing set) its
    /// [cache of denials](Self::cache_denials).
    ///
    /// ```
    /// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota, SetItem, SetMode};
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let limiter = Limiter::builder(MemoryStore::new()).build_for_sets()?;
    /// let tenant = Limit::new("tenant", Quota::per_minute(1).fixed_window())?;
    /// let set = [SetItem::new(&tenant, b"acme", 1)];
    /// assert!(limiter.decide_set(&set, SetMode::AllOrNothing).await?.is_allowed());
    /// assert!(!limiter.decide_set(&set, SetMode::AllOrNothing).await?.is_allowed());
    /// assert!(limiter.check("acme", 1).await.is_err()); // no limits of its own
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn build_for_sets(self) -> Result<Limiter, ConfigError> {
        for (i, limit) in self.limits.iter().enumerate() {
            if self.limits[..i].iter().any(|l| l.name() == limit.name()) {
                return Err(ConfigError::DuplicateName(limit.name().to_owned()));
            }
        }
        register(&self.store, &self.limits);
        let clock = local_clock(&self.store);
        Ok(Limiter {
            inner: Arc::new(Inner {
                denials: clock
                    .clone()
                    .filter(|_| self.cache_denials)
                    .map(DenyCache::new),
                hot: hot_pools(&self.store),
                store: self.store,
                limits: self.limits,
                timeout: self.timeout,
                outage: Default::default(),
            }),
        })
    }
}

impl Limiter {
    /// A limiter with one limit, fixed or [live](crate::LiveLimit).
    pub fn new(store: impl Into<Store>, limit: impl Into<LimitSource>) -> Self {
        let (store, limit) = (store.into(), limit.into());
        register(&store, std::slice::from_ref(&limit));
        let clock = local_clock(&store);
        Self {
            inner: Arc::new(Inner {
                denials: clock.map(DenyCache::new),
                hot: hot_pools(&store),
                store,
                limits: vec![limit],
                timeout: DEFAULT_TIMEOUT,
                outage: Default::default(),
            }),
        }
    }

    /// A builder over a store that is already shared.
    pub(crate) fn builder_shared(store: Store) -> LimiterBuilder {
        LimiterBuilder {
            store,
            limits: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            cache_denials: true,
        }
    }

    /// Configures a limiter with several limits or a custom timeout.
    pub fn builder(store: impl Into<Store>) -> LimiterBuilder {
        LimiterBuilder {
            store: store.into(),
            limits: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            cache_denials: true,
        }
    }
}

/// Registers the fixed limits among `limits` on the store, which warns about
/// a name used with two quotas (a live limit changes its quota by design),
/// and whether any is a calendar limit (whose store is then checked for
/// persistence and eviction: see [`crate::CalendarRate`]).
fn register(store: &Store, limits: &[LimitSource]) {
    let names = &store.engine().shared().names;
    if limits.iter().any(|l| l.load().quota().calendar().is_some()) {
        names.calendar_limit();
    }
    let fixed: Vec<Limit> = limits
        .iter()
        .filter(|l| l.live().is_none())
        .map(|l| Limit::clone(&l.load()))
        .collect();
    names.register(&fixed);
}

/// The batches of hot keys' permits (see `Limit::with_hot_key`) of every
/// limiter over a store shared over a network: one set per store, shared
/// by its clones and every limiter and layer over it, so that a process
/// holds one batch per hot limit and key, which the bound `HotKey` states
/// counts on. `None` over the memory store (it serves no batches).
fn hot_pools(store: &Store) -> Option<Arc<super::HotPools>> {
    let clock = local_clock(store)?;
    Some(store.engine().shared().one(|| super::HotPools::new(clock)))
}

/// For a store shared over a network, the clock of what this process
/// keeps of its decisions: the store's own when it has one.
fn local_clock(store: &Store) -> Option<Arc<dyn crate::Clock>> {
    let shared = store.engine().shared();
    shared.remote().then(|| {
        shared
            .clock
            .clone()
            .unwrap_or_else(|| Arc::new(crate::SystemClock::new()))
    })
}
