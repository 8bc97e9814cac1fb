//! The in-process store: the same algorithms as the Lua scripts, in a sharded
//! table that keeps only the stored form of each state, holds at most a
//! configured number of keys, and reclaims idle keys in the background.
//!
//! Layout: the key's hash (randomly keyed foldhash) picks one of [`SHARDS`]
//! shards, so every limit of one key lives under one lock, like the hash tag
//! in Redis. A shard holds one [`Table`] per limit (name and algorithm, as in
//! the Redis key): a `hashbrown` table of `u32` slot numbers over slots kept
//! densely in fixed-size chunks, so memory follows the number of keys rather
//! than the table's load factor (`table.rs`). A decision puts its states
//! back through `write.rs`. Expired states are reclaimed a few at a time by
//! the decisions that add keys, and in the background (`reclaim.rs`). A
//! full store takes a new key's room from the limit that holds the most
//! states (`share.rs`).

mod backend;
mod builder;
mod decide;
mod kept;
mod key;
mod penalized;
mod reclaim;
mod share;
mod table;
mod write;

pub use self::builder::MemoryStoreBuilder;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use self::key::Hasher;
use self::table::{Found, Shard, Table};
use super::{lock, Check, Settle, Settled};
use crate::algorithm::{self, Reply, State};
use crate::clock::{Clock, SystemClock};

/// Number of independently locked shards.
const SHARDS: usize = 32;

/// The default bound on stored key states: see [`MemoryStoreBuilder::max_keys`].
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;
/// The default pause between background sweeps: see
/// [`MemoryStoreBuilder::sweep_interval`].
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(1);

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: Hasher,
    clock: Arc<dyn Clock>,
    #[cfg(feature = "metrics")]
    size_gauge: crate::metrics::SizeGauge,
    shared: super::Shared,
    /// Quotas kept in the store (see `Limit::use_stored_quota`).
    kept: kept::Kept,
    /// Penalty states, by the shard of their key (see `penalized.rs`).
    pens: Box<[Mutex<penalized::Pens>]>,
    /// The states each limit holds (see `share.rs`).
    limits: share::Limits,
    max_keys: usize,
    /// Stored states in all shards.
    count: AtomicUsize,
    /// Penalty states among them (see `penalized.rs`).
    pens_count: AtomicUsize,
    sweep_interval: Duration,
    /// Whether a background reclaimer runs (or cannot run: no timers).
    reclaimer: AtomicBool,
    /// Whether the store said it was full.
    full_warned: AtomicBool,
    /// Whether the store said its penalty states took half its bound.
    pens_warned: AtomicBool,
}

impl Inner {
    /// Counts a new state in, unless the store is full.
    fn admit(&self) -> bool {
        self.count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_keys).then_some(n + 1)
            })
            .is_ok()
    }

    fn forget(&self, removed: usize) {
        if removed > 0 {
            self.count.fetch_sub(removed, Ordering::AcqRel);
        }
    }

    /// Where `key`'s state is in `table`. An expired state reads as absent;
    /// its slot is overwritten if the decision writes, else removed.
    #[inline]
    fn locate(&self, table: &Table, hash: u64, key: &[u8], store_now: i64) -> Found {
        let Some(i) = table.find(hash, key) else {
            return match &table.overflow {
                Some(shared) if shared.stored.expires_at() > store_now => Found::Shared,
                _ => Found::Absent,
            };
        };
        match table.slot(i) {
            Some(slot) if slot.stored.expires_at() > store_now => Found::Live(i),
            _ => Found::Expired(i),
        }
    }
}

/// Limit state in this process: the embedded default, no Redis needed.
///
/// Memory is bounded twice over. A key's state is dropped once it is
/// equivalent to a fresh one (the moment its Redis key would expire): by a
/// background task that sweeps the store every
/// [`sweep_interval`](MemoryStoreBuilder::sweep_interval) in short slices
/// (started on the first use inside a Tokio runtime, ended when the store is
/// dropped), and a few slots at a time by the calls that add keys. And at most
/// [`max_keys`](MemoryStoreBuilder::max_keys) states are ever stored: see
/// there for what happens at the bound.
///
/// A state costs about 100 bytes (a GCRA or bucket state with a key of up to
/// 24 bytes; longer keys add their length, a sliding log its grants).
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{Limit, Limiter, MemoryStore, Quota};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let limit = Limit::new("sms", Quota::per_minute(3).sliding_log())?;
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
            .field("max_keys", &self.inner.max_keys)
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store on the process clock, with the default bound and interval.
    pub fn new() -> Self {
        Self::with_clock(SystemClock::new())
    }

    /// A store on the given clock, e.g. a [`crate::ManualClock`] in tests.
    pub fn with_clock(clock: impl Clock) -> Self {
        Self::from_builder(Self::builder().clock(clock))
    }

    /// Configures a store: its bound on keys, sweep interval and clock.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            clock: Arc::new(SystemClock::new()),
            max_keys: DEFAULT_MAX_KEYS,
            sweep_interval: DEFAULT_SWEEP_INTERVAL,
        }
    }

    fn from_builder(builder: MemoryStoreBuilder) -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        let store = Self {
            inner: Arc::new(Inner {
                shards,
                hasher: Hasher(foldhash::quality::RandomState::default()),
                clock: builder.clock.clone(),
                #[cfg(feature = "metrics")]
                size_gauge: Default::default(),
                shared: super::Shared::new("memory", Some(builder.clock.clone()), None),
                kept: Default::default(),
                pens: penalized::pens(),
                limits: Default::default(),
                max_keys: builder.max_keys,
                count: AtomicUsize::new(0),
                pens_count: AtomicUsize::new(0),
                sweep_interval: builder.sweep_interval,
                reclaimer: AtomicBool::new(false),
                full_warned: AtomicBool::new(false),
                pens_warned: AtomicBool::new(false),
            }),
        };
        store.ensure_reclaimer();
        store
    }

    /// Number of stored key states (one per key and limit, and one per key
    /// and limit with a [penalty](crate::Limit::with_penalty) while it holds
    /// refusals, offences or a block), including expired ones not yet
    /// swept.
    pub fn len(&self) -> usize {
        self.inner.count.load(Ordering::Acquire)
    }

    /// Whether no key state is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bound on [`len`](Self::len): see [`MemoryStoreBuilder::max_keys`].
    pub fn max_keys(&self) -> usize {
        self.inner.max_keys
    }

    /// Starts the background reclaimer if none runs and a Tokio runtime is
    /// at hand.
    fn ensure_reclaimer(&self) {
        let inner = &self.inner;
        if inner.reclaimer.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if inner
            .reclaimer
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            runtime.spawn(reclaim::reclaim(Arc::downgrade(inner)));
        }
    }

    fn decide_now(&self, checks: &[Check<'_>], max_wait: i64, dry: bool) -> Reply {
        self.decide_with(
            checks,
            #[inline(always)]
            |ops, now| {
                let reply = algorithm::decide(ops, now, max_wait, dry);
                let write = reply.granted() && !dry;
                (reply, write)
            },
        )
    }

    /// Takes min(`most`, what every limit has left now): see
    /// `algorithm::take`. Returns the reply and the amount taken.
    fn take_now(&self, checks: &[Check<'_>], most: i64) -> (Reply, i64) {
        let mut taken = 0;
        let reply = self.decide_with(checks, |ops, now| {
            let (reply, k) = algorithm::take(ops, most, now);
            taken = k;
            let write = reply.granted() && k > 0;
            (reply, write)
        });
        (reply, taken)
    }

    /// Settles each check's grant after the fact (see [`Settle`]), as the
    /// driver's ops 1, 4 and 5.
    fn settle_now(&self, checks: &[Check<'_>], how: Settle) -> Settled {
        match how {
            Settle::Charge => {
                // one clock for all, as a decision (`charge` in the driver)
                self.decide_with(checks, |ops, now| {
                    algorithm::charge(ops, now);
                    (Reply::at_rest(now), true)
                });
                Settled::default()
            }
            Settle::Refund { at } => {
                self.move_grants(checks, at, None);
                Settled::default()
            }
            Settle::Renew { at } => {
                let mut renewed = smallvec::smallvec![None; checks.len()];
                self.move_grants(checks, at, Some(&mut renewed));
                Settled { renewed }
            }
        }
    }

    /// Gives back each check's grant made at `at`, or with `renewed`, moves
    /// it to the store's clock where still held, noting the new time (the
    /// driver's `settle`): each key at its own clock, a state that did not
    /// change left as it was (but for a sliding log's pruning).
    fn move_grants(&self, checks: &[Check<'_>], at: i64, mut renewed: Option<&mut [Option<i64>]>) {
        let inner = &*self.inner;
        let store_now = inner.clock.now_micros();
        for (j, check) in checks.iter().enumerate().filter(|(_, c)| c.cost > 0) {
            let hash = inner.hasher.hash(check.key);
            let p = check.limit.params();
            let mut shard = lock(&inner.shards[Hasher::shard(hash)]);
            let t = shard.table(check.limit, &inner.limits);
            let table = &mut shard.tables[t];
            let Found::Live(i) = inner.locate(table, hash, check.key, store_now) else {
                continue;
            };
            let Some(slot) = table.slot_mut(i) else {
                continue;
            };
            let now = algorithm::believed(store_now, slot.written, p);
            let (mut state, moved) = State::prepare(Some(&mut slot.stored), p, slot.written, now);
            let changed = match renewed.as_deref_mut() {
                None => state.refund(p, now, at, check.cost),
                Some(renewed) => {
                    let held = state.renew(at, store_now, check.cost);
                    if let (true, Some(slot)) = (held, renewed.get_mut(j)) {
                        *slot = Some(store_now);
                    }
                    held
                }
            };
            if !changed && !moved {
                state.restore(&mut slot.stored);
                continue;
            }
            let expires_at = state.save_into(p, now, &mut slot.stored);
            slot.written = now;
            table.mark(i, p);
            // equal to a fresh state (a sliding log left empty is deleted)
            if expires_at <= now && table.remove(i, &inner.hasher).is_some() {
                inner.forget(1);
            }
        }
    }

    fn reset_now(&self, checks: &[Check<'_>]) {
        let inner = &*self.inner;
        for check in checks {
            let hash = inner.hasher.hash(check.key);
            let mut shard = lock(&inner.shards[Hasher::shard(hash)]);
            let t = shard.table(check.limit, &inner.limits);
            let table = &mut shard.tables[t];
            if let Some(i) = table.find(hash, check.key) {
                if table.remove(i, &inner.hasher).is_some() {
                    inner.forget(1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{lock, Check, MemoryStore};
    use crate::store::keys::MAX_RAW_KEY;
    use crate::store::Engine;
    use crate::store::{Answer, Deadline};
    use crate::{Limit, Quota};

    /// The longest key stored in any table of `store`, and how many are.
    fn stored_keys(store: &MemoryStore) -> (usize, usize) {
        let (mut longest, mut n) = (0, 0);
        for shard in store.inner.shards.iter() {
            for table in &lock(shard).tables {
                for slot in table.chunks.iter().flatten() {
                    longest = longest.max(slot.key.len());
                    n += 1;
                }
            }
        }
        (longest, n)
    }

    /// A client's key of any length costs a bounded slot: a key longer than
    /// [`MAX_RAW_KEY`] is stored as its digest form, whether one limit
    /// decides it (in one-element arrays, see `decide.rs`) or several do.
    #[test]
    fn a_long_key_is_stored_bounded_on_every_path() {
        let quota = || Quota::per_second(10).allow_burst(10).gcra();
        let one = Limit::new("one", quota()).expect("limit");
        let two = Limit::new("two", quota()).expect("limit");
        let long = vec![b'k'; 10_000];
        for limits in [vec![&one], vec![&one, &two]] {
            let store = MemoryStore::new();
            let checks: Vec<Check<'_>> = limits
                .iter()
                .map(|limit| Check {
                    limit,
                    key: &long,
                    cost: 1,
                })
                .collect();
            let deadline = Deadline::after(Duration::from_secs(1));
            let Answer::Now(Ok(reply)) = store.decide(&checks, 0, false, deadline) else {
                panic!("the memory store answers at once");
            };
            assert!(reply.granted());
            assert_eq!(stored_keys(&store), (MAX_RAW_KEY + 1, limits.len()));
        }
    }
}

#[cfg(test)]
mod several_shards {
    use std::time::Duration;

    use super::key::Hasher;
    use super::{Check, MemoryStore};
    use crate::store::Engine;
    use crate::store::{Answer, Deadline};
    use crate::{Limit, Quota};

    /// Two keys of `store` whose states are in one shard (`same`), or in two.
    fn keys(store: &MemoryStore, same: bool) -> (Vec<u8>, Vec<u8>) {
        let shard = |key: &[u8]| Hasher::shard(store.inner.hasher.hash(key));
        let first = b"k0".to_vec();
        let second = (1..10_000)
            .map(|i| format!("k{i}").into_bytes())
            .find(|key| (shard(key) == shard(&first)) == same)
            .expect("a key in that shard among 10,000");
        (first, second)
    }

    fn decide(store: &MemoryStore, checks: &[Check<'_>]) -> (bool, Vec<i64>) {
        let deadline = Deadline::after(Duration::from_secs(1));
        let Answer::Now(Ok(reply)) = store.decide(checks, 0, false, deadline) else {
            panic!("the memory store answers at once");
        };
        (
            reply.granted(),
            reply.limits.iter().map(|l| l.remaining()).collect(),
        )
    }

    /// A decision over limits whose keys lie in one shard or in two (each
    /// shard locked once, in order) is all or nothing: a refusal by one
    /// limit leaves the other's state as it was.
    #[test]
    fn a_decision_over_keys_in_one_shard_or_two_is_all_or_nothing() {
        let one = Limit::new("one", Quota::per_minute(1).allow_burst(1).gcra()).expect("limit");
        let three = Limit::new("three", Quota::per_minute(3).allow_burst(3).gcra()).expect("limit");
        for same in [true, false] {
            let store = MemoryStore::new();
            let (a, b) = keys(&store, same);
            let both = [
                Check {
                    limit: &one,
                    key: &a,
                    cost: 1,
                },
                Check {
                    limit: &three,
                    key: &b,
                    cost: 1,
                },
            ];
            assert_eq!(
                decide(&store, &both),
                (true, vec![0, 2]),
                "same shard: {same}"
            );
            assert_eq!(
                decide(&store, &both),
                (false, vec![0, 2]),
                "same shard: {same}"
            );
            let alone = [Check {
                limit: &three,
                key: &b,
                cost: 1,
            }];
            assert_eq!(
                decide(&store, &alone),
                (true, vec![1]),
                "same shard: {same}"
            );
            assert_eq!(store.len(), 2);
        }
    }
}
