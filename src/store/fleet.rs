//! A fleet's share of each limit while its shared store is down: the
//! layer's `FallbackToMemory` decides in memory, per process, so without a
//! share `n` instances would admit `n` times each quota until the store is
//! back.
//!
//! A shared store that has a fallback keeps a [`Fleet`]: an id of its own,
//! registered in the store by a background heartbeat, and the number of
//! instances the heartbeat counted there: the largest count of its last
//! [`COUNTS_KEPT`] beats, so that a count does not fall while the store's
//! set fills again after it was emptied (see the Redis store's
//! `fleet.rs`). The fallback's store is a [`FleetShare`]: the shared
//! store's [`MemoryStore`] with every check's cost multiplied by that count
//! (at most the limit's capacity), so each instance grants its share of the
//! full quota, and a token bucket's or GCRA's refill is divided with its
//! burst. Nothing of it runs while the shared store answers: decisions
//! never read the count, the heartbeat does not wait for them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use super::{
    lock, Answer, Check, Deadline, Engine, MemoryStore, Penalty, Quotas, Quoted, Reply, Settle,
    Settled, Shared, Store,
};
use crate::algorithm::Status;
use crate::Error;

/// Heartbeats a member is counted for after its last one: a member that
/// missed two in a row (a long pause, a slow store) still counts.
pub(crate) const PERIODS_COUNTED: u32 = 3;

/// The heartbeats whose counts an instance keeps: its fleet's count is the
/// largest of them. A set emptied under the heartbeats (`DEL`, `FLUSHDB`,
/// eviction, a forward step of the server's clock, a restart without
/// persistence, a failover) holds at first only the instances that have
/// beaten since; each of them has beaten again within one period, and
/// within the [`PERIODS_COUNTED`] periods after that even one that missed
/// two beats in a row has: until then, a count from before the set was
/// emptied is kept. The price: an instance gone is still counted for up to
/// this many heartbeats after the set stops counting it (fewer grants
/// during an outage in that time, never more).
pub(crate) const COUNTS_KEPT: usize = PERIODS_COUNTED as usize + 1;

/// This instance's place in the fleet of instances that share a store.
#[derive(Debug)]
pub(crate) struct Fleet {
    /// Registered in the store by the heartbeat: random, new per store
    /// handle (per process, as separate processes build their own).
    id: String,
    /// The largest of `counts`: what the fallback reads (0: no heartbeat
    /// has reached the store yet).
    count: AtomicU64,
    /// What the last [`COUNTS_KEPT`] heartbeats that reached the store
    /// counted (0: none yet), and where the next one goes; written by the
    /// heartbeat alone, once a period.
    counts: Mutex<([u64; COUNTS_KEPT], usize)>,
    /// Whether the heartbeat was started.
    beating: AtomicBool,
}

impl Fleet {
    pub(crate) fn new() -> Self {
        use std::hash::BuildHasher;
        // foldhash's random state is seeded per process and per state: with
        // the process id and the time, no two handles draw the same id
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let random = foldhash::fast::RandomState::default().hash_one((std::process::id(), nanos));
        Self {
            id: format!("{random:016x}-{}", std::process::id()),
            count: AtomicU64::new(0),
            counts: Mutex::new(([0; COUNTS_KEPT], 0)),
            beating: AtomicBool::new(false),
        }
    }

    /// Whether the heartbeat runs.
    pub(crate) fn beating(&self) -> bool {
        self.beating.load(Ordering::Acquire)
    }

    /// Whether the caller is the one to start the heartbeat: `true` once.
    pub(crate) fn start(&self) -> bool {
        !self.beating.swap(true, Ordering::AcqRel)
    }

    /// This instance's id in the store.
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// How many instances share each limit, as last learned: at least 1
    /// (1 when nothing was learned: the full quota).
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed).max(1)
    }

    /// Records what a heartbeat that reached the store counted: the count
    /// is the largest of the last [`COUNTS_KEPT`] heartbeats', so it rises
    /// at once and falls only once a whole counting window of heartbeats
    /// has counted fewer (see there why).
    pub(crate) fn learn(&self, counted: u64) {
        let mut counts = lock(&self.counts);
        let (last, next) = &mut *counts;
        last[*next % COUNTS_KEPT] = counted;
        *next = (*next + 1) % COUNTS_KEPT;
        let largest = last.iter().copied().max().unwrap_or(counted);
        self.count.store(largest, Ordering::Relaxed);
    }
}

/// What a check of `cost` counts against one instance's copy of a limit of
/// `capacity` when `fleet` instances share it: `cost × fleet`, but at most
/// the capacity (each instance still grants one request per key, whatever
/// the fleet), and a cost that never fits stays as it is (still never).
pub(crate) fn share_of(cost: i64, capacity: i64, fleet: u64) -> i64 {
    if fleet <= 1 || cost <= 0 || cost > capacity {
        return cost;
    }
    let fleet = i64::try_from(fleet).unwrap_or(i64::MAX);
    cost.saturating_mul(fleet).min(capacity)
}

/// The fallback's store with a fleet: the shared store's [`MemoryStore`],
/// every check's cost counted as its [share](share_of).
#[derive(Debug, Clone)]
pub(crate) struct FleetShare {
    memory: MemoryStore,
    fleet: Arc<Fleet>,
}

impl From<FleetShare> for Store {
    fn from(share: FleetShare) -> Self {
        Store::of(share)
    }
}

type Scaled<'a> = SmallVec<[Check<'a>; 2]>;

impl FleetShare {
    pub(crate) fn new(memory: MemoryStore, fleet: Arc<Fleet>) -> Self {
        Self { memory, fleet }
    }

    /// `checks` at their shares' costs; `None` for a fleet of one.
    fn scaled<'a>(&self, checks: &[Check<'a>]) -> Option<Scaled<'a>> {
        let fleet = self.fleet.count();
        (fleet > 1).then(|| {
            checks
                .iter()
                .map(|c| Check {
                    cost: share_of(c.cost, c.limit.params().capacity(), fleet),
                    ..*c
                })
                .collect()
        })
    }

    /// `reply` of the scaled checks as the checks' own: each limit's
    /// `remaining` counted in their costs (what this instance still grants
    /// of them), not in the scaled ones.
    fn unscaled(checks: &[Check<'_>], scaled: &[Check<'_>], mut reply: Reply) -> Reply {
        for ((check, share), status) in checks.iter().zip(scaled).zip(reply.limits.iter_mut()) {
            if share.cost <= check.cost || check.cost <= 0 {
                continue;
            }
            let (Status::Allows { remaining, .. } | Status::Never { remaining, .. }) = status
            else {
                continue;
            };
            let left =
                i128::from((*remaining).max(0)) * i128::from(check.cost) / i128::from(share.cost);
            *remaining = i64::try_from(left).unwrap_or(*remaining);
        }
        reply
    }
}

/// The answer of `call` on `scaled`, which it borrows: at once when the
/// memory store answers at once (always), else awaited with `scaled` moved
/// into the future.
fn on_scaled<'a, T, F>(scaled: Scaled<'a>, call: F) -> Answer<'a, T>
where
    T: Send + 'a,
    F: for<'s> Fn(&'s [Check<'a>]) -> Answer<'s, T> + Send + Sync + 'a,
{
    let now = match call(&scaled) {
        Answer::Now(result) => Some(result),
        Answer::Later(_) => None,
    };
    match now {
        Some(result) => Answer::Now(result),
        None => Answer::Later(Box::pin(async move { call(&scaled).get().await })),
    }
}

impl Engine for FleetShare {
    fn decide<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        max_wait: i64,
        dry: bool,
        deadline: Deadline,
    ) -> Answer<'a, Result<Reply, Error>> {
        let Some(scaled) = self.scaled(checks) else {
            return self.memory.decide(checks, max_wait, dry, deadline);
        };
        on_scaled(scaled, move |s| {
            self.memory
                .decide(s, max_wait, dry, deadline)
                .map(move |r| r.map(|reply| Self::unscaled(checks, s, reply)))
        })
    }

    fn reset<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        deadline: Deadline,
    ) -> Answer<'a, Result<(), Error>> {
        self.memory.reset(checks, deadline)
    }

    /// A set decided on the fleet's share of each cost (a refund's amount
    /// given back as it is).
    fn each<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        mode: crate::algorithm::EachMode,
        deadline: Deadline,
    ) -> Answer<'a, Result<Reply, Error>> {
        let Some(scaled) = self.scaled(checks) else {
            return self.memory.each(checks, mode, deadline);
        };
        on_scaled(scaled, move |s| {
            self.memory
                .each(s, mode, deadline)
                .map(move |r| r.map(|reply| Self::unscaled(checks, s, reply)))
        })
    }

    /// A refund gives back the share its grant took (the fleet's count
    /// does not change while the store is down, when the fallback
    /// decides); a charge takes the share of its cost.
    fn settle<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        how: Settle,
        deadline: Deadline,
    ) -> Answer<'a, Result<Settled, Error>> {
        let Some(scaled) = self.scaled(checks) else {
            return self.memory.settle(checks, how, deadline);
        };
        on_scaled(scaled, move |s| self.memory.settle(s, how, deadline))
    }

    /// Takes up to the share of the checks' cost; answers what that is of
    /// their cost, rounded down (the layer never takes: only a limiter's
    /// `take_up_to` does, and the fallback's limiter is the layer's own).
    fn take<'a>(
        &'a self,
        checks: &'a [Check<'a>],
        deadline: Deadline,
    ) -> Answer<'a, Result<(Reply, i64), Error>> {
        let Some(scaled) = self.scaled(checks) else {
            return self.memory.take(checks, deadline);
        };
        let (cost, share) = match (checks.first(), scaled.first()) {
            (Some(check), Some(scaled)) => (check.cost, scaled.cost.max(1)),
            _ => (1, 1),
        };
        on_scaled(scaled, move |s| {
            self.memory.take(s, deadline).map(move |r| {
                r.map(|(reply, taken)| {
                    let taken = i128::from(taken) * i128::from(cost) / i128::from(share);
                    let taken = i64::try_from(taken).unwrap_or(0);
                    (Self::unscaled(checks, s, reply), taken)
                })
            })
        })
    }

    fn quotas<'a>(
        &'a self,
        check: &'a Check<'a>,
        keyed: bool,
        op: Quotas<'a>,
        deadline: Deadline,
    ) -> Answer<'a, Result<Quoted, Error>> {
        self.memory.quotas(check, keyed, op, deadline)
    }

    fn penalty<'a>(
        &'a self,
        check: &'a Check<'a>,
        op: Penalty,
        deadline: Deadline,
    ) -> Answer<'a, Result<Option<(crate::penalty::PenState, i64)>, Error>> {
        self.memory.penalty(check, op, deadline)
    }

    fn shared(&self) -> &Shared {
        self.memory.shared()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_is_the_cost_times_the_fleet_at_most_the_capacity() {
        assert_eq!(share_of(1, 10, 1), 1);
        assert_eq!(share_of(1, 10, 0), 1, "nothing learned: the full quota");
        assert_eq!(share_of(1, 10, 3), 3);
        assert_eq!(share_of(2, 10, 3), 6);
        assert_eq!(share_of(1, 3, 4), 3, "at least one request per instance");
        assert_eq!(share_of(4, 3, 4), 4, "a cost that never fits stays");
        assert_eq!(share_of(0, 3, 4), 0, "a look takes nothing");
        assert_eq!(share_of(1 << 53, i64::MAX, u64::MAX), i64::MAX);
    }

    #[test]
    fn a_count_falls_only_after_a_window_of_lower_counts() {
        let fleet = Fleet::new();
        assert_eq!(fleet.count(), 1, "nothing learned: the full quota");
        fleet.learn(4);
        fleet.learn(4);
        // the set emptied: the next heartbeats count 1, 2, ...
        fleet.learn(1);
        assert_eq!(fleet.count(), 4);
        fleet.learn(2);
        fleet.learn(3);
        assert_eq!(fleet.count(), 4, "the last count from before is kept");
        fleet.learn(3);
        assert_eq!(fleet.count(), 3, "a whole window of 3: one left");
        fleet.learn(5);
        assert_eq!(fleet.count(), 5, "a rise counts at once");
        assert_ne!(Fleet::new().id(), fleet.id());
    }
}
