//! The in-process store: the same algorithms as the Lua scripts, in a sharded
//! map whose idle keys are evicted automatically.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::sealed::Sealed;
use super::{BoxFuture, Check, Store};
use crate::algorithm::{self, Reply, State};
use crate::clock::{Clock, SystemClock};
use crate::Error;

const SHARDS: usize = 32;
/// A shard is swept when it has doubled since its last sweep (never below this size) ...
const SWEEP_MIN_LEN: usize = 64;
/// ... or when this much time (us) has passed since its last sweep.
const SWEEP_INTERVAL: i64 = 10_000_000;

struct Entry {
    state: State,
    /// The clock of the decision that wrote the state (`hw` in the scripts).
    hw: i64,
    /// When the state becomes equal to a fresh one (the Redis key's TTL).
    expires_at: i64,
}

#[derive(Default)]
struct Shard {
    map: HashMap<Box<str>, Entry>,
    last_sweep: i64,
    len_after_sweep: usize,
}

impl Shard {
    fn maybe_sweep(&mut self, now: i64) {
        let grown = self.map.len() >= (2 * self.len_after_sweep).max(SWEEP_MIN_LEN);
        if grown || now - self.last_sweep >= SWEEP_INTERVAL {
            self.map.retain(|_, e| e.expires_at > now);
            self.last_sweep = now;
            self.len_after_sweep = self.map.len();
        }
    }
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    /// Randomly keyed SipHash: crafted keys cannot all land in one bucket.
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    #[cfg(feature = "metrics")]
    size_gauge: crate::metrics::SizeGauge,
    quotas: super::QuotaRegistry,
}

/// Limit state in this process: the embedded default, no Redis needed.
///
/// Memory stays bounded by the live keys: a key's state is dropped once it is
/// equivalent to a fresh one (the same moment its Redis key would expire), in
/// sweeps that run as part of ordinary calls; nothing needs to be called.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let limit = Limit::new("sms", Quota::sliding_log(3, Duration::from_secs(60)))?;
/// let limiter = Limiter::new(MemoryStore::new(), limit);
/// for _ in 0..3 {
///     assert!(limiter.check("+15550100", 1).await?.is_allowed());
/// }
/// assert!(!limiter.check("+15550100", 1).await?.is_allowed());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("keys", &self.len())
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store on the process clock.
    pub fn new() -> Self {
        Self::with_clock(SystemClock::new())
    }

    /// A store on the given clock, e.g. a [`crate::ManualClock`] in tests.
    pub fn with_clock(clock: impl Clock) -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        Self {
            inner: Arc::new(Inner {
                shards,
                hasher: RandomState::new(),
                clock: Arc::new(clock),
                #[cfg(feature = "metrics")]
                size_gauge: Default::default(),
                quotas: Default::default(),
            }),
        }
    }

    /// Number of stored key states, including expired ones not yet swept.
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).map.len()).sum()
    }

    /// Whether no key state is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard_of(&self, key: &str) -> usize {
        (self.inner.hasher.hash_one(key) as usize) % SHARDS
    }

    fn storage_key(check: &Check<'_>) -> String {
        let part = check.limit.params().algorithm.key_parts()[0];
        format!("{}:{}:{part}", check.tag, check.limit.name())
    }

    fn decide_now(&self, checks: &[Check<'_>], max_wait: i64, dry: bool) -> Reply {
        let real = self.inner.clock.now_micros();
        let keys: Vec<String> = checks.iter().map(Self::storage_key).collect();
        let slots: Vec<usize> = keys.iter().map(|k| self.shard_of(k)).collect();
        let mut order = slots.clone();
        order.sort_unstable();
        order.dedup();
        // Locks taken in shard order: no deadlock between concurrent decisions.
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> = order
            .iter()
            .map(|&i| (i, lock(&self.inner.shards[i])))
            .collect();
        let positions: Vec<usize> = slots
            .iter()
            .map(|s| order.binary_search(s).unwrap_or(0))
            .collect();

        // As in `lua/driver.lua`: the decision's clock is the latest of the
        // store's and of every key's last write, so time never runs back.
        let mut now = real;
        let mut entries = Vec::with_capacity(checks.len());
        for (key, &g) in keys.iter().zip(&positions) {
            let entry = guards[g]
                .1
                .map
                .remove(key.as_str())
                .filter(|e| e.expires_at > real);
            if let Some(entry) = &entry {
                now = now.max(entry.hw);
            }
            entries.push(entry);
        }
        let mut kept = Vec::with_capacity(checks.len());
        let mut states = Vec::with_capacity(checks.len());
        for (check, entry) in checks.iter().zip(entries) {
            let p = check.limit.params();
            let (mut state, hw) = match entry {
                Some(e) => {
                    kept.push(Some((e.hw, e.expires_at)));
                    (e.state, e.hw)
                }
                None => {
                    kept.push(None);
                    (State::fresh(p), now)
                }
            };
            state.prepare(p, hw, now);
            states.push(state);
        }
        let params: Vec<_> = checks.iter().map(|c| c.limit.params()).collect();
        let costs: Vec<i64> = checks.iter().map(|c| c.cost).collect();
        let reply = algorithm::decide(&mut states, &params, &costs, now, max_wait, dry);

        for (((check, key), mut state), (g, kept)) in checks
            .iter()
            .zip(keys)
            .zip(states)
            .zip(positions.into_iter().zip(kept))
        {
            let entry = if reply.outcome == 0 && !dry && check.cost > 0 {
                let expires_at = state.save(check.limit.params(), now);
                Entry {
                    state,
                    hw: now,
                    expires_at,
                }
            } else if let Some((hw, expires_at)) = kept {
                // Unchanged but for the pruning of a sliding log, as in Redis.
                Entry {
                    state,
                    hw,
                    expires_at,
                }
            } else {
                continue;
            };
            if entry.expires_at > real {
                guards[g].1.map.insert(key.into_boxed_str(), entry);
            }
        }
        for (_, shard) in &mut guards {
            shard.maybe_sweep(real);
        }
        reply
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding the lock cannot leave a shard half-updated in a
    // way that matters (entries are removed and re-inserted whole).
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Store for MemoryStore {}

impl Sealed for MemoryStore {
    fn decide<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        max_wait: i64,
        dry: bool,
    ) -> BoxFuture<'a, Result<Reply, Error>> {
        let reply = self.decide_now(checks, max_wait, dry);
        Box::pin(std::future::ready(Ok(reply)))
    }

    fn reset<'a>(&'a self, checks: &'a [Check<'a>]) -> BoxFuture<'a, Result<(), Error>> {
        for check in checks {
            let key = Self::storage_key(check);
            lock(&self.inner.shards[self.shard_of(&key)])
                .map
                .remove(key.as_str());
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn quotas(&self) -> Option<&super::QuotaRegistry> {
        Some(&self.inner.quotas)
    }

    #[cfg(feature = "metrics")]
    fn report_size(&self) {
        self.inner.size_gauge.report(|| self.len());
    }
}
