//! What an engine shares with every limiter and layer over it ([`Shared`]):
//! its kind and clock, the names its limits were registered with, the
//! fallback that decides while it fails, and one value per type for the
//! layers above (the limiter's batches of hot keys, the layer's key kinds)
//! that the store holds without knowing what they are.

use std::any::Any;
use std::sync::{Arc, Mutex, OnceLock};

use super::fleet::Fleet;
use super::MemoryStore;
use crate::clock::Clock;
use crate::sync::lock;

/// What an engine shares with every limiter and layer over it: one per
/// store, shared by its clones.
pub(crate) struct Shared {
    /// The `store` label of the metrics: `"memory"` or `"redis"`.
    pub(crate) kind: &'static str,
    /// The application clock the store decides on, if it has one.
    pub(crate) clock: Option<Arc<dyn Clock>>,
    /// The quota each limit name was first used with.
    pub(crate) names: Names,
    /// What decides while the store fails; `None` for a store that does
    /// not fail (memory). A store that can fail is shared over a network.
    pub(crate) fallback: Option<Fallback>,
    /// One value per type, made on first use (see [`one`](Self::one)).
    ones: Mutex<Vec<Arc<dyn Any + Send + Sync>>>,
}

impl Shared {
    pub(crate) fn new(
        kind: &'static str,
        clock: Option<Arc<dyn Clock>>,
        fallback: Option<Fallback>,
    ) -> Self {
        Self {
            kind,
            clock,
            names: Names::default(),
            fallback,
            ones: Mutex::default(),
        }
    }

    /// Whether the store is shared with other processes over a network
    /// (it can fail: it has a fallback), so that a local cache of its
    /// denials saves round trips.
    pub(crate) fn remote(&self) -> bool {
        self.fallback.is_some()
    }

    /// The store's one value of type `T`, made by `make` on first use: a
    /// layer above keeps there what must be one per store, shared by its
    /// clones and every limiter and layer over it. Only asked when a
    /// limiter or layer is built, never per decision.
    pub(crate) fn one<T: Any + Send + Sync>(&self, make: impl FnOnce() -> T) -> Arc<T> {
        let mut ones = lock(&self.ones);
        if let Some(found) = ones.iter().find_map(|one| one.clone().downcast::<T>().ok()) {
            return found;
        }
        let made = Arc::new(make());
        ones.push(made.clone());
        made
    }
}

/// The in-process store that decides in a store's place while it fails
/// (the layer's `FallbackToMemory`): one per store, shared by its clones
/// and every layer over it, so a limit shared by several layers stays one
/// limit during an outage; with the fleet of instances that share the
/// store, when its heartbeat runs.
pub(crate) struct Fallback {
    memory: OnceLock<MemoryStore>,
    /// The store's own clock, if it has one: the fallback decides on it
    /// too (else on the system clock).
    clock: Option<Arc<dyn Clock>>,
    /// This instance's place among the instances that share the store,
    /// its heartbeat started (see `fleet.rs`); `None` when the heartbeat
    /// is off.
    fleet: Box<dyn Fn() -> Option<Arc<Fleet>> + Send + Sync>,
}

impl Fallback {
    #[cfg(feature = "redis")]
    pub(crate) fn new(
        clock: Option<Arc<dyn Clock>>,
        fleet: impl Fn() -> Option<Arc<Fleet>> + Send + Sync + 'static,
    ) -> Self {
        Self {
            memory: OnceLock::new(),
            clock,
            fleet: Box::new(fleet),
        }
    }

    /// The memory store, made on first use, on the store's clock.
    pub(crate) fn memory(&self) -> MemoryStore {
        let make = || match &self.clock {
            Some(clock) => MemoryStore::with_clock(StoreClock(clock.clone())),
            None => MemoryStore::new(),
        };
        self.memory.get_or_init(make).clone()
    }

    /// The fleet, its heartbeat started unless it runs.
    pub(crate) fn fleet(&self) -> Option<Arc<Fleet>> {
        (self.fleet)()
    }
}

/// A store's clock, shared with its fallback.
struct StoreClock(Arc<dyn Clock>);

impl Clock for StoreClock {
    fn now_micros(&self) -> i64 {
        self.0.now_micros()
    }
}

/// The quota each limit name was first used with on one store, to warn
/// (once per name) when a name comes back with another quota: both would
/// read and write the same keys, each misreading the other's state. Only
/// consulted when a limiter is built, never per decision.
#[derive(Debug, Default)]
pub(crate) struct Names {
    seen: std::sync::Mutex<std::collections::HashMap<&'static str, (crate::Quota, bool)>>,
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

impl Names {
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
}
