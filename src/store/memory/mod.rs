//! The in-process store: the same algorithms as the Lua scripts, in a sharded
//! table that keeps only the stored form of each state, holds at most a
//! configured number of keys, and reclaims idle keys in the background.
//!
//! The engine is a struct of components, each a type of its own in a file
//! of its own, which [`MemoryStore`]'s operations (the [`Engine`] contract,
//! below) call in turn:
//! - the rate states ([`States`], `states.rs`): the key's hash (randomly
//!   keyed foldhash, `key.rs`) picks one of [`SHARDS`] shards, so every
//!   limit of one key lives under one lock, like the hash tag in Redis; a
//!   shard holds one table per limit (name and algorithm, as in the Redis
//!   key, `table.rs`): a `hashbrown` table of `u32` slot numbers over slots
//!   kept densely in fixed-size chunks, so memory follows the number of
//!   keys rather than the table's load factor (`slots.rs`); a decision
//!   holds one value per check as `decide.rs` says; a full store takes a
//!   new key's room from the limit that holds the most states
//!   (`share.rs`);
//! - the penalty states ([`Penalties`], `penalized.rs`; each shard's in
//!   `pens.rs`, in slots as well), which wrap a decision of a limit with a
//!   penalty;
//! - the quotas kept in the store ([`Kept`], `kept.rs`), which a decision
//!   of a limit that takes its quota from the store reads first;
//! - the background reclaimer ([`Reclaimer`], `reclaim.rs`), which sweeps
//!   expired states of all of them (the decisions that add keys reclaim a
//!   few as well).

mod bans;
mod builder;
mod decide;
mod kept;
mod key;
mod penalized;
mod pens;
mod reclaim;
mod share;
mod slots;
mod states;
mod table;

pub use self::builder::MemoryStoreBuilder;

use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use self::kept::{may_be_kept, Kept};
use self::penalized::{is_penalized, Penalties};
use self::reclaim::Reclaimer;
use self::states::States;
use super::keys::{bounded_keys, bounded_one, is_bounded};
use super::{Answer, Check, Deadline, Engine, Penalty, Quotas, Quoted, Settle, Settled, Shared};
use crate::algorithm::{self, Operand, Reply};
use crate::clock::{Clock, SystemClock};
use crate::penalty::PenState;
use crate::Error;

/// Number of independently locked shards.
const SHARDS: usize = 32;

/// The default bound on stored key states: see [`MemoryStoreBuilder::max_keys`].
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;
/// The default pause between background sweeps: see
/// [`MemoryStoreBuilder::sweep_interval`].
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(1);

/// The memory engine: its components (see the module).
struct Inner {
    /// The rate states, within the store's bound.
    states: States,
    /// The penalty states (see `Limit::with_penalty`).
    pens: Penalties,
    /// The quotas kept in the store (see `Limit::use_stored_quota`).
    kept: Kept,
    /// The background sweep of all three.
    reclaimer: Reclaimer,
    /// What the store shares with every limiter and layer over it.
    shared: Shared,
    #[cfg(feature = "metrics")]
    size_gauge: crate::metrics::SizeGauge,
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
            .field("max_keys", &self.max_keys())
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
        let clock = builder.clock;
        let inner = Arc::new_cyclic(|store| Inner {
            states: States::new(clock.clone(), builder.max_keys),
            pens: Penalties::new(clock.clone()),
            kept: Kept::new(clock.clone()),
            reclaimer: Reclaimer::new(store.clone(), builder.sweep_interval),
            shared: Shared::new("memory", Some(clock), None),
            #[cfg(feature = "metrics")]
            size_gauge: Default::default(),
        });
        inner.reclaimer.ensure();
        Self { inner }
    }

    /// Number of stored key states (one per key and limit, and one per key
    /// and limit with a [penalty](crate::Limit::with_penalty) while it holds
    /// refusals, offences or a block; ban records count 4 to a state,
    /// rounded up), including expired ones not yet swept.
    pub fn len(&self) -> usize {
        self.inner.states.len()
    }

    /// Whether no key state is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bound on [`len`](Self::len): see [`MemoryStoreBuilder::max_keys`].
    pub fn max_keys(&self) -> usize {
        self.inner.states.max_keys
    }
}

/// Every operation answered at once, under the shards' locks: a key longer
/// than the bound taken in its bounded form (see `keys::bounded_keys`),
/// under its limit's penalty, on the quota kept in the store for it, if
/// any, as each operation needs.
impl Engine for MemoryStore {
    fn decide<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        max_wait: i64,
        dry: bool,
        _: Deadline,
    ) -> Answer<'a, Result<Reply, Error>> {
        let inner = &*self.inner;
        // one limit that none of the steps below changes: straight to the
        // decision, without the steps' closures
        let reply = match checks {
            [check] if is_bounded(check) && !is_penalized(check) && !may_be_kept(check) => {
                inner.decide(checks, &mut [], decision(max_wait, dry))
            }
            _ => bounded_keys(checks, |checks| {
                // a refusal beyond the wait asked counts towards a penalty
                let refusals = (!dry).then_some(max_wait);
                inner.pens.run(
                    &inner.states,
                    checks,
                    refusals,
                    |checks, blocked, shared| {
                        inner.kept.with(checks, |checks| {
                            inner.decide(checks, shared, decision(max_wait, dry || blocked))
                        })
                    },
                )
            }),
        };
        #[cfg(feature = "metrics")]
        inner.size_gauge.report(reply.now, || self.len());
        Answer::Now(Ok(reply))
    }

    fn take<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        _: Deadline,
    ) -> Answer<'a, Result<(Reply, i64), Error>> {
        let inner = &*self.inner;
        let most = checks.first().map_or(0, |c| c.cost);
        Answer::Now(Ok(bounded_keys(checks, |checks| {
            inner
                .pens
                .run(&inner.states, checks, None, |checks, blocked, _| {
                    if blocked {
                        // a cost of 1 decided, not granted (as k = 0 is)
                        let ones: SmallVec<[Check<'_>; 2]> =
                            checks.iter().map(|c| Check { cost: 1, ..*c }).collect();
                        let reply = inner
                            .kept
                            .with(&ones, |c| inner.decide(c, &mut [], decision(0, true)));
                        return (reply, 0);
                    }
                    inner.kept.with(checks, |checks| {
                        // min(`most`, what every limit has left now): see
                        // `algorithm::take`
                        let mut taken = 0;
                        let reply = inner.decide(checks, &mut [], |ops, now| {
                            let (reply, k) = algorithm::take(ops, most, now);
                            taken = k;
                            let write = reply.granted() && k > 0;
                            (reply, write)
                        });
                        (reply, taken)
                    })
                })
        })))
    }

    fn settle<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        how: Settle,
        _: Deadline,
    ) -> Answer<'a, Result<Settled, Error>> {
        let inner = &*self.inner;
        Answer::Now(Ok(bounded_keys(checks, |checks| {
            inner.kept.with(checks, |checks| match how {
                Settle::Charge => {
                    // one clock for all, as a decision (`charge` in the driver)
                    inner.decide(checks, &mut [], |ops, now| {
                        algorithm::charge(ops, now);
                        (Reply::at_rest(now), true)
                    });
                    Settled::default()
                }
                Settle::Refund { at } => {
                    inner.states.move_grants(checks, at, None);
                    Settled::default()
                }
                Settle::Renew { at } => {
                    let mut renewed = smallvec::smallvec![None; checks.len()];
                    inner.states.move_grants(checks, at, Some(&mut renewed));
                    Settled { renewed }
                }
            })
        })))
    }

    fn each<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        mode: algorithm::EachMode,
        _: Deadline,
    ) -> Answer<'a, Result<Reply, Error>> {
        let inner = &*self.inner;
        let reply = bounded_keys(checks, |checks| {
            inner.kept.with(checks, |checks| {
                inner.decide(checks, &mut [], |ops, now| {
                    (algorithm::each(ops, now, mode), true)
                })
            })
        });
        #[cfg(feature = "metrics")]
        inner.size_gauge.report(reply.now, || self.len());
        Answer::Now(Ok(reply))
    }

    fn reset<'a>(&'a self, checks: &'a [Check<'a>], _: Deadline) -> Answer<'a, Result<(), Error>> {
        bounded_keys(checks, |checks| self.inner.states.reset(checks));
        Answer::Now(Ok(()))
    }

    fn quotas<'a>(
        &'a self,
        check: &'a Check<'a>,
        keyed: bool,
        op: Quotas<'a>,
        _: Deadline,
    ) -> Answer<'a, Result<Quoted, Error>> {
        let kept = &self.inner.kept;
        Answer::Now(Ok(match op {
            Quotas::Read => Quoted::Read(bounded_one(check, |c| kept.read(c, keyed)).flatten()),
            change => Quoted::Changed(
                bounded_one(check, |c| kept.change(c, keyed, change)).unwrap_or(false),
            ),
        }))
    }

    fn penalty<'a>(
        &'a self,
        check: &'a Check<'a>,
        op: Penalty,
        _: Deadline,
    ) -> Answer<'a, Result<Option<(PenState, i64)>, Error>> {
        let inner = &*self.inner;
        let changed = bounded_one(check, |check| inner.pens.change(&inner.states, check, op));
        Answer::Now(changed.transpose().map(Option::flatten))
    }

    fn shared(&self) -> &Shared {
        &self.inner.shared
    }
}

impl Inner {
    /// One atomic decision over the rate states of `checks`, which
    /// `decide` makes, noting in `shared` (unless empty) the checks decided
    /// on a shared overflow state (see [`States::decide`]); the background
    /// reclaimer started if it stored a new key.
    #[inline(always)]
    fn decide(
        &self,
        checks: &[Check<'_>],
        shared: &mut [bool],
        decide: impl FnOnce(&mut [Operand<'_>], i64) -> (Reply, bool),
    ) -> Reply {
        let (reply, added) = self.states.decide(checks, shared, decide);
        if added {
            self.reclaimer.ensure();
        }
        reply
    }
}

/// A decision by `algorithm::decide`: its states written back when it
/// grants, unless `dry`.
#[inline(always)]
fn decision(max_wait: i64, dry: bool) -> impl FnOnce(&mut [Operand<'_>], i64) -> (Reply, bool) {
    #[inline(always)]
    move |ops, now| {
        let reply = algorithm::decide(ops, now, max_wait, dry);
        let write = reply.granted() && !dry;
        (reply, write)
    }
}

/// What an operation answers, as the steps around its decision see it
/// (see [`Kept::with`] and [`Penalties::run`]).
trait Replied: Sized {
    /// Its reply, if it has one.
    fn reply(&mut self) -> Option<&mut Reply> {
        None
    }

    /// The answer of a decision on one limit refused by its block, its
    /// quota not consulted; `None` where the operation decides it still
    /// (a take, at a cost of 1).
    fn blocked(_: Reply) -> Option<Self> {
        None
    }
}

impl Replied for Reply {
    fn reply(&mut self) -> Option<&mut Reply> {
        Some(self)
    }

    fn blocked(reply: Reply) -> Option<Self> {
        Some(reply)
    }
}

impl Replied for (Reply, i64) {
    fn reply(&mut self) -> Option<&mut Reply> {
        Some(&mut self.0)
    }
}

impl Replied for Settled {}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Check, MemoryStore};
    use crate::store::keys::MAX_RAW_KEY;
    use crate::store::lock;
    use crate::store::Engine;
    use crate::store::{Answer, Deadline};
    use crate::{Limit, Quota};

    /// The longest key stored in any table of `store`, and how many are.
    fn stored_keys(store: &MemoryStore) -> (usize, usize) {
        let (mut longest, mut n) = (0, 0);
        for shard in store.inner.states.shards.iter() {
            for table in &lock(shard).tables {
                for slot in table.slots.chunks.iter().flatten() {
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
        let shard = |key: &[u8]| Hasher::shard(store.inner.states.hasher.hash(key));
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
