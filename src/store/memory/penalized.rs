//! Penalties (see `Limit::with_penalty`) in the memory store: each key's
//! [`PenState`] by limit name, in one of [`SHARDS`] maps, each under a lock
//! of its own, held across the whole decision of a penalized limit, so that
//! its refusals are counted exactly (the script's atomicity). The steps are
//! those of `penalized_one` and the loop in `lua/penalty.lua`: a blocked key
//! is refused without its quota being consulted (one limit) or charged
//! (several), a refusal by the limit itself is counted, the N-th within the
//! time blocks. Only limits with a penalty take these locks (always before a
//! shard's), so others pay one test.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};

use smallvec::SmallVec;

use super::key::{Hasher, Key};
use super::{lock, Inner, MemoryStore, SHARDS};
use crate::algorithm::{Outcome, Reply, Status};
use crate::penalty::{PenParams, PenState};
use crate::store::backend::PenaltyChange;
use crate::store::Check;
use crate::Error;

/// One shard's penalty states: by limit name and key, the state and when
/// it becomes fresh (store time, us).
pub(super) type Pens = HashMap<(&'static str, Key), (PenState, i64)>;

/// The penalty maps of a store, one per shard.
pub(super) fn pens() -> Box<[Mutex<Pens>]> {
    (0..SHARDS).map(|_| Mutex::new(Pens::new())).collect()
}

/// Drops the states of `pens` that are fresh at `now`; returns how many.
pub(super) fn sweep_pens(pens: &Mutex<Pens>, now: i64) -> usize {
    let mut pens = lock(pens);
    let before = pens.len();
    pens.retain(|_, (_, exp)| *exp > now);
    before - pens.len()
}

/// How a decision runs under its penalties: a plain decision, or a take.
#[derive(Clone, Copy)]
pub(super) enum Run {
    Decide { max_wait: i64, dry: bool },
    Take,
}

impl Inner {
    /// The shard of `key`'s penalty state.
    fn pen_shard(&self, key: &[u8]) -> usize {
        Hasher::shard(self.hasher.hash(key))
    }

    /// `check`'s penalty state at `now` (fresh when absent or expired);
    /// one dated after `now` (the clock stepped back) is moved back to it
    /// whole and written so (see [`PenState::dated`]).
    fn pen_state(&self, pens: &mut Pens, check: &Check<'_>, p: &PenParams, now: i64) -> PenState {
        let id = (check.limit.shared_name(), Key::from_slice(check.key));
        let mut state = pens
            .get(&id)
            .filter(|(_, exp)| *exp > now)
            .map_or_else(PenState::default, |(state, _)| *state);
        if state.dated(now) {
            self.put_pen(pens, check, p, state, now);
        }
        state
    }

    /// The most penalty states the store keeps: half its bound (at least
    /// one), so that no flood of penalty states leaves rate states without
    /// room (the shared overflow state, where new keys would share one
    /// drained state).
    fn max_pens(&self) -> usize {
        (self.max_keys / 2).max(1)
    }

    /// Counts a new penalty state in, unless [`max_pens`](Self::max_pens)
    /// are kept; then in the store's count, in place of a rate state given
    /// up if the store is full (there is one: rate states hold at least
    /// half the bound).
    fn admit_pen(&self, key: &[u8], now: i64) -> bool {
        let max = self.max_pens();
        let counted = self
            .pens_count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if counted && !(self.admit() || self.give_up(self.pen_shard(key), None, now)) {
            self.pens_count.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        counted
    }

    /// Uncounts `removed` penalty states.
    pub(super) fn forget_pens(&self, removed: usize) {
        if removed > 0 {
            self.pens_count.fetch_sub(removed, Ordering::AcqRel);
            self.forget(removed);
        }
    }

    /// Writes `state` back for `check` (or drops it, fresh at `now`).
    /// A new state in a full store takes the place of a rate state given
    /// up (see [`Inner::give_up`]), never of another penalty state; returns
    /// `false` when the penalty states already take half the bound (see
    /// [`max_pens`](Self::max_pens)): then it is not stored, and counted
    /// (see [`crate::metrics::PENALTIES_NOT_STORED`]). Takes shard locks:
    /// none may be held (a penalty lock is taken first).
    fn put_pen(
        &self,
        pens: &mut Pens,
        check: &Check<'_>,
        p: &PenParams,
        state: PenState,
        now: i64,
    ) -> bool {
        let id = (check.limit.shared_name(), Key::from_slice(check.key));
        let exp = state.expires_at(p);
        if exp <= now {
            if pens.remove(&id).is_some() {
                self.forget_pens(1);
            }
            return true;
        }
        match pens.get_mut(&id) {
            Some(slot) => *slot = (state, exp),
            None if self.admit_pen(check.key, now) => {
                pens.insert(id, (state, exp));
            }
            None => {
                crate::metrics::penalty_not_stored(check.limit.shared_name());
                if !self.pens_warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        target: "tower_ratelimit",
                        limit = check.limit.name(),
                        max_keys = self.max_keys,
                        "penalty states take half the memory store's bound: new ones are not \
                         stored (logged once per store, counted each time)"
                    );
                }
                return false;
            }
        }
        true
    }
}

/// Whether `check`'s limit has a penalty (see the module).
#[inline(always)]
pub(super) fn is_penalized(check: &Check<'_>) -> bool {
    check.limit.pen_params().is_some()
}

/// What a run under penalties answers: a decision's reply, or a take's
/// with the amount taken.
pub(super) trait Ran {
    /// The answer of a decision refused by a block: nothing granted.
    fn blocked(reply: Reply) -> Self;
    /// The reply, to mark its blocked limits in.
    fn reply(&mut self) -> &mut Reply;
}

impl Ran for Reply {
    fn blocked(reply: Reply) -> Self {
        reply
    }
    fn reply(&mut self) -> &mut Reply {
        self
    }
}

impl Ran for (Reply, i64) {
    fn blocked(reply: Reply) -> Self {
        (reply, 0)
    }
    fn reply(&mut self) -> &mut Reply {
        &mut self.0
    }
}

impl MemoryStore {
    /// Runs `run` on `checks` under their limits' penalties (see the
    /// module): `run(checks, blocked)` decides (a take takes), or, when
    /// `blocked`, decides without granting (a take: a cost of 1). Returns
    /// its answer with the blocks' statuses.
    #[inline(always)]
    pub(super) fn with_penalties<R: Ran>(
        &self,
        checks: &[Check<'_>],
        how: Run,
        run: impl FnOnce(&[Check<'_>], bool) -> R,
    ) -> R {
        if !checks.iter().any(is_penalized) {
            return run(checks, false);
        }
        self.penalized(checks, how, run)
    }

    #[inline(never)]
    fn penalized<R: Ran>(
        &self,
        checks: &[Check<'_>],
        how: Run,
        run: impl FnOnce(&[Check<'_>], bool) -> R,
    ) -> R {
        let inner = &*self.inner;
        let shards: SmallVec<[Option<usize>; 2]> = checks
            .iter()
            .map(|c| c.limit.pen_params().map(|_| inner.pen_shard(c.key)))
            .collect();
        let mut order: SmallVec<[usize; 2]> = shards.iter().flatten().copied().collect();
        order.sort_unstable();
        order.dedup();
        // taken in shard order, before any shard of the states
        let mut guards: SmallVec<[MutexGuard<'_, Pens>; 2]> =
            order.iter().map(|&s| lock(&inner.pens[s])).collect();
        let guard_of = |shard: usize| order.binary_search(&shard).unwrap_or_default();
        let store_now = inner.clock.now_micros();
        let mut states: SmallVec<[Option<PenState>; 2]> = SmallVec::new();
        for (check, shard) in checks.iter().zip(&shards) {
            let (Some(p), Some(s)) = (check.limit.pen_params(), *shard) else {
                states.push(None);
                continue;
            };
            let Some(pens) = guards.get_mut(guard_of(s)) else {
                states.push(Some(PenState::default()));
                continue;
            };
            states.push(Some(inner.pen_state(pens, check, p, store_now)));
        }
        let lefts: SmallVec<[Option<i64>; 2]> = states
            .iter()
            .map(|s| s.and_then(|s| s.blocked(store_now)))
            .collect();
        if lefts.iter().any(Option::is_some) {
            if let ([_], Run::Decide { .. }) = (checks, how) {
                // one limit, blocked: its quota is not consulted
                let left = lefts.first().copied().flatten().unwrap_or(0);
                let reply = Reply {
                    outcome: Outcome::Denied,
                    wait: left,
                    now: store_now,
                    limits: smallvec::smallvec![Status::Blocked { left }],
                    stored: None,
                };
                return R::blocked(reply);
            }
            // several (or a take): the others decided, nothing granted
            let mut ran = run(checks, true);
            block_statuses(ran.reply(), &lefts);
            return ran;
        }
        let mut ran = run(checks, false);
        let Run::Decide { max_wait, dry } = how else {
            return ran;
        };
        let reply = ran.reply();
        if dry || reply.outcome != Outcome::Denied {
            return ran;
        }
        // count a refusal for each penalized limit that refused
        let mut lefts: SmallVec<[Option<i64>; 2]> = SmallVec::new();
        for (i, ((check, shard), state)) in checks.iter().zip(&shards).zip(&states).enumerate() {
            let (Some(p), Some(s), Some(mut state)) = (check.limit.pen_params(), shard, *state)
            else {
                lefts.push(None);
                continue;
            };
            let refused = reply
                .limits
                .get(i)
                .and_then(Status::wait)
                .is_some_and(|w| w > max_wait);
            if !refused {
                lefts.push(None);
                continue;
            }
            let offence = state.refuse(p, store_now);
            lefts.push(offence.then(|| state.until - store_now));
            if let Some(pens) = guards.get_mut(guard_of(*s)) {
                inner.put_pen(pens, check, p, state, store_now);
            }
        }
        block_statuses(reply, &lefts);
        ran
    }

    /// Changes `check`'s penalty state (see [`PenaltyChange`]); its state
    /// after a block (before a forget), and the store time.
    /// [`Error::PenaltyNotStored`] when a new block finds penalty states
    /// taking half the store's bound.
    pub(super) fn change_pen_now(
        &self,
        check: &Check<'_>,
        change: PenaltyChange,
    ) -> Result<Option<(PenState, i64)>, Error> {
        let inner = &*self.inner;
        let Some(p) = check.limit.pen_params() else {
            return Ok(None);
        };
        let mut pens = lock(&inner.pens[inner.pen_shard(check.key)]);
        let now = inner.clock.now_micros();
        let id = (check.limit.shared_name(), Key::from_slice(check.key));
        let mut state = inner.pen_state(&mut pens, check, p, now);
        match change {
            PenaltyChange::Read => {}
            PenaltyChange::Block(us) => {
                state.block(now, us);
                if !inner.put_pen(&mut pens, check, p, state, now) {
                    return Err(Error::PenaltyNotStored);
                }
            }
            PenaltyChange::Unblock => {
                if pens.remove(&id).is_some() {
                    inner.forget_pens(1);
                }
            }
        }
        Ok(Some((state, now)))
    }
}

/// Marks the limits blocked (`lefts[i]`: the time left of limit i's block)
/// in `reply`, as the script does: their statuses, then the outcome from
/// the statuses (a blocked limit's own quota is not asked, so only another
/// limit's cost over its capacity makes it "never"), refused until all
/// allow.
fn block_statuses(reply: &mut Reply, lefts: &[Option<i64>]) {
    if lefts.iter().all(Option::is_none) {
        return;
    }
    for (status, left) in reply.limits.iter_mut().zip(lefts) {
        if let Some(left) = *left {
            *status = Status::Blocked { left };
        }
    }
    if reply.limits.iter().any(|l| l.wait().is_none()) {
        (reply.outcome, reply.wait) = (Outcome::Never, -1);
    } else {
        let wait = reply
            .limits
            .iter()
            .filter_map(Status::wait)
            .max()
            .unwrap_or(0);
        (reply.outcome, reply.wait) = (Outcome::Denied, wait);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::backend::Backend;
    use crate::store::Deadline;
    use crate::{Clock, Limit, ManualClock, Penalty, Quota};

    /// A penalty state counts among the store's keys while it matters, and
    /// the sweep drops it (and uncounts it) once it equals a fresh one.
    #[test]
    fn ended_penalty_states_are_swept_and_uncounted() {
        let minute = Duration::from_secs(60);
        let clock = ManualClock::new(1_800_000_000_000_000);
        let store = MemoryStore::with_clock(clock.clone());
        let limit = Limit::new("l", Quota::fixed_window(1, minute))
            .expect("limit")
            .with_penalty(
                Penalty::new(1, minute, [minute])
                    .expect("penalty")
                    .forget_after(minute),
            );
        let check = [Check {
            limit: &limit,
            key: b"k",
            cost: 1,
        }];
        for _ in 0..2 {
            let decided = store.decide(&check, 0, false, Deadline::after(minute));
            assert!(matches!(decided, crate::store::Answer::Now(Ok(_))));
        }
        assert_eq!(store.len(), 2, "the window's state and the penalty's");
        let sweep = |now: i64| -> usize {
            store
                .inner
                .pens
                .iter()
                .map(|pens| {
                    let removed = sweep_pens(pens, now);
                    store.inner.forget_pens(removed);
                    removed
                })
                .sum()
        };
        // blocked a minute, remembered a minute after: not before then
        clock.advance(minute);
        assert_eq!(sweep(clock.now_micros()), 0);
        clock.advance(minute);
        assert_eq!(sweep(clock.now_micros()), 1);
        assert_eq!(store.len(), 1);
    }
}
