//! Penalties (see `Limit::with_penalty`) in the memory store: each key's
//! [`PenState`] by limit name, in one of [`SHARDS`](super::SHARDS) maps
//! (`pens.rs`), each under a lock of its own, held across the whole
//! decision of a penalized limit, so that its refusals are counted exactly
//! (the script's atomicity). The steps are those of `penalized_one` and the
//! loop in `lua/penalty.lua`: a blocked key is refused without its quota
//! being consulted (one limit) or charged (several), a refusal by the limit
//! itself is counted, the N-th within the time blocks. Only limits with a
//! penalty take these locks (always before a shard's), so others pay one
//! test.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use smallvec::SmallVec;

use super::key::{shards, Hasher, Key};
use super::pens::{PenShard, PenSlot, PEN_SAMPLE};
use super::share::{search, Usage};
use super::states::States;
use super::Replied;
use crate::algorithm::{Reply, Status, VerdictCode};
use crate::clock::Clock;
use crate::penalty::{PenParams, PenState};
use crate::store::{lock, Check, Penalty};
use crate::Error;

/// Penalty states a full penalty half compares, at least.
const PEN_COMPARED: usize = 2 * PEN_SAMPLE;

/// The penalty states of a store.
pub(super) struct Penalties {
    clock: Arc<dyn Clock>,
    /// By the shard of their key.
    shards: Box<[Mutex<PenShard>]>,
    /// Penalty states in all shards (counted in the store's states too).
    count: AtomicUsize,
    /// Whether the store said its penalty states took half its bound.
    warned: AtomicBool,
}

/// Whether `check`'s limit has a penalty (see the module).
#[inline(always)]
pub(super) fn is_penalized(check: &Check<'_>) -> bool {
    check.limit.pen_params().is_some()
}

impl Penalties {
    pub(super) fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            shards: shards(),
            count: AtomicUsize::new(0),
            warned: AtomicBool::new(false),
        }
    }

    /// Runs `run` on `checks` under their limits' penalties (see the
    /// module): `run(checks, blocked)` decides (a take takes), or, when
    /// `blocked`, decides without granting (a take: a cost of 1). A
    /// refusal by a penalized limit beyond the wait `refusals` counts
    /// (none: a dry run or a take, which count none). Returns its answer
    /// with the blocks' statuses.
    #[inline(always)]
    pub(super) fn run<R: Replied>(
        &self,
        states: &States,
        checks: &[Check<'_>],
        refusals: Option<i64>,
        run: impl FnOnce(&[Check<'_>], bool) -> R,
    ) -> R {
        if !checks.iter().any(is_penalized) {
            return run(checks, false);
        }
        self.penalized(states, checks, refusals, run)
    }

    #[inline(never)]
    fn penalized<R: Replied>(
        &self,
        states: &States,
        checks: &[Check<'_>],
        refusals: Option<i64>,
        run: impl FnOnce(&[Check<'_>], bool) -> R,
    ) -> R {
        // each penalized check's key's hash
        let hashes: SmallVec<[Option<u64>; 2]> = checks
            .iter()
            .map(|c| c.limit.pen_params().map(|_| states.hasher.hash(c.key)))
            .collect();
        let mut order: SmallVec<[usize; 2]> =
            hashes.iter().flatten().map(|&h| Hasher::shard(h)).collect();
        order.sort_unstable();
        order.dedup();
        // taken in shard order, before any shard of the states
        let mut guards: SmallVec<[MutexGuard<'_, PenShard>; 2]> =
            order.iter().map(|&s| lock(&self.shards[s])).collect();
        let guard_of = |hash| {
            order
                .binary_search(&Hasher::shard(hash))
                .unwrap_or_default()
        };
        let store_now = self.clock.now_micros();
        let held: SmallVec<[Option<PenState>; 2]> = checks
            .iter()
            .zip(&hashes)
            .map(|(check, hash)| {
                let (p, hash) = (check.limit.pen_params()?, (*hash)?);
                Some(
                    guards
                        .get_mut(guard_of(hash))
                        .map_or_else(PenState::default, |pens| {
                            self.state(states, pens, hash, check, p, store_now)
                        }),
                )
            })
            .collect();
        let lefts: SmallVec<[Option<i64>; 2]> = held
            .iter()
            .map(|s| s.and_then(|s| s.blocked(store_now)))
            .collect();
        if lefts.iter().any(Option::is_some) {
            if let [_] = checks {
                // one limit, blocked: its quota is not consulted
                let left = lefts.first().copied().flatten().unwrap_or(0);
                let reply = Reply {
                    verdict: VerdictCode::Denied,
                    wait: left,
                    now: store_now,
                    limits: smallvec::smallvec![Status::Blocked { left }],
                    stored: None,
                };
                if let Some(answer) = R::blocked(reply) {
                    return answer;
                }
            }
            // several (or a take): the others decided, nothing granted
            let mut ran = run(checks, true);
            if let Some(reply) = ran.reply() {
                block_statuses(reply, &lefts);
            }
            return ran;
        }
        let mut ran = run(checks, false);
        let counted = refusals.zip(ran.reply());
        let Some((max_wait, reply)) = counted.filter(|(_, r)| r.verdict == VerdictCode::Denied)
        else {
            return ran;
        };
        // count a refusal for each penalized limit that refused
        let lefts: SmallVec<[Option<i64>; 2]> = checks
            .iter()
            .zip(&hashes)
            .zip(&held)
            .enumerate()
            .map(|(i, ((check, hash), state))| {
                let (p, hash, mut state) = (check.limit.pen_params()?, (*hash)?, (*state)?);
                let refused = reply
                    .limits
                    .get(i)
                    .and_then(Status::wait)
                    .is_some_and(|w| w > max_wait);
                if !refused {
                    return None;
                }
                let offence = state.refuse(p, store_now);
                if let Some(pens) = guards.get_mut(guard_of(hash)) {
                    self.put(states, pens, hash, check, p, state, store_now, true);
                }
                offence.then(|| state.until - store_now)
            })
            .collect();
        block_statuses(reply, &lefts);
        ran
    }

    /// Changes `check`'s penalty state (see [`Penalty`]); its state
    /// after a block (before a forget), and the store time.
    /// [`Error::PenaltyNotStored`] when a new block finds penalty states
    /// taking half the store's bound, none of which can be given up (see
    /// [`put`](Self::put)).
    pub(super) fn change(
        &self,
        states: &States,
        check: &Check<'_>,
        change: Penalty,
    ) -> Result<Option<(PenState, i64)>, Error> {
        let Some(p) = check.limit.pen_params() else {
            return Ok(None);
        };
        let hash = states.hasher.hash(check.key);
        let mut pens = lock(&self.shards[Hasher::shard(hash)]);
        let now = self.clock.now_micros();
        let mut state = self.state(states, &mut pens, hash, check, p, now);
        match change {
            Penalty::Read => {}
            Penalty::Block(us) => {
                state.block(now, us);
                if !self.put(states, &mut pens, hash, check, p, state, now, false) {
                    return Err(Error::PenaltyNotStored);
                }
            }
            Penalty::Unblock => {
                if let Some(i) = pens.find(hash, check.limit.shared_name(), check.key) {
                    self.remove(states, &mut pens, i);
                }
            }
        }
        Ok(Some((state, now)))
    }

    /// Drops the states of shard `s` that are fresh (and shared blocks
    /// that ended); returns how many states.
    pub(super) fn sweep(&self, states: &States, s: usize) -> usize {
        let now = self.clock.now_micros();
        let removed = (self.shards.get(s)).map_or(0, |pens| lock(pens).sweep(now, &states.hasher));
        self.forget(states, removed);
        removed
    }

    /// `check`'s penalty state at `now` (see [`PenShard::state`]); one
    /// dated after `now` (the clock stepped back) is moved back to it
    /// whole and written so (see [`PenState::dated`]).
    fn state(
        &self,
        states: &States,
        pens: &mut PenShard,
        hash: u64,
        check: &Check<'_>,
        p: &PenParams,
        now: i64,
    ) -> PenState {
        let mut state = pens.state(hash, check.limit.shared_name(), check.key, now);
        if state.dated(now) {
            self.put(states, pens, hash, check, p, state, now, true);
        }
        state
    }

    /// Writes `state` back for `check` (or drops it, fresh at `now`). A
    /// new state takes the place of a rate state or, once penalty states
    /// take half the bound, of a penalty state given up (see
    /// [`admit`](Self::admit)). When none can be given up (every one
    /// compared holds an active block of its own limit), the store fails
    /// closed: with `share`, the state goes to the limit's shared block in
    /// this shard, which the keys not kept on their own read; without (a
    /// block by hand), it is not stored and `false` returned. Both are
    /// counted (see [`crate::metrics::PENALTIES_NOT_STORED`]). Takes shard
    /// locks: none may be held (a penalty lock is taken first).
    #[allow(clippy::too_many_arguments)]
    fn put(
        &self,
        states: &States,
        pens: &mut PenShard,
        hash: u64,
        check: &Check<'_>,
        p: &PenParams,
        state: PenState,
        now: i64,
        share: bool,
    ) -> bool {
        let name = check.limit.shared_name();
        let exp = state.expires_at(p);
        let found = pens.find(hash, name, check.key);
        if exp <= now {
            if let Some(i) = found {
                self.remove(states, pens, i);
            }
            return true;
        }
        if let Some(slot) = found.and_then(|i| pens.get_mut(i)) {
            (slot.state, slot.exp, slot.written) = (state, exp, now);
            return true;
        }
        let usage = states.shares.usage(name);
        if self.admit(states, pens, Hasher::shard(hash), &usage, now) {
            let slot = PenSlot {
                name,
                key: Key::from_slice(check.key),
                state,
                exp,
                written: now,
            };
            if pens.insert(&states.shares, hash, slot, &states.hasher) {
                return true;
            }
            self.forget(states, 1);
        }
        if share {
            // read from the shared block (or fresh): it becomes the shared one
            pens.share(&states.shares, name, state, exp, now);
        }
        self.shared_block(states, name);
        share
    }

    /// Makes room for a new penalty state of `usage` in the shard `own`
    /// (`pens`, locked): below half the store's bound (at least one), so
    /// that no flood of penalty states leaves rate states without room (the
    /// shared overflow state, where new keys would share one drained
    /// state), counted in, in place of a rate state given up if the store
    /// is full (see [`States::give_up`]); else in place of a penalty state
    /// given up (see [`give_up`](Self::give_up)). Whether it made room.
    fn admit(
        &self,
        states: &States,
        pens: &mut PenShard,
        own: usize,
        usage: &Arc<Usage>,
        now: i64,
    ) -> bool {
        let max = (states.max_keys / 2).max(1);
        let counted = self
            .count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if counted {
            if states.admit() || states.give_up(own, None, now, None) {
                return true;
            }
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
        self.give_up(states, pens, own, usage, now)
    }

    /// Makes room among penalty states for a new one of `asking`: gives up,
    /// of the limit that holds the most penalty states (`asking` counted
    /// with its new one and preferred on a tie, see `share.rs`), the state
    /// ranked first (see [`PenShard::first_to_give_up`]) among those
    /// compared: of the shard `own` (`pens`, locked), then of the next
    /// shards (see [`search`]), until [`PEN_COMPARED`] were compared and
    /// one holds no active block, or every shard was. An active block is
    /// given up only for another limit's state: it goes to its limit's
    /// shared block. Whether it gave one up (its place in the counts is
    /// the new state's).
    fn give_up(
        &self,
        states: &States,
        pens: &mut PenShard,
        own: usize,
        asking: &Arc<Usage>,
        now: i64,
    ) -> bool {
        let Some(donor) = states.shares.donor(|u| &u.pens, Some(asking)) else {
            return false;
        };
        let in_own = pens.first_to_give_up(&donor, now);
        let best = search(
            &self.shards,
            own,
            Some(in_own),
            PEN_COMPARED,
            |r| r.0 < 2,
            |p| p.first_to_give_up(&donor, now),
        );
        let (mut guard, i) = match best {
            Some((_, (2, _), _)) if Arc::ptr_eq(&donor, asking) => return false,
            Some((guard, _, i)) => (guard, i),
            None => return false,
        };
        let pens = guard.as_deref_mut().unwrap_or(pens);
        match pens.give_up(&states.shares, i, now, &states.hasher) {
            Some(shared) => {
                if shared {
                    self.shared_block(states, donor.name);
                }
                true
            }
            None => false,
        }
    }

    /// Removes slot `i` of `pens`, uncounted.
    fn remove(&self, states: &States, pens: &mut PenShard, i: usize) {
        if pens.remove(i, &states.hasher).is_some() {
            self.forget(states, 1);
        }
    }

    /// Uncounts `removed` penalty states.
    fn forget(&self, states: &States, removed: usize) {
        if removed > 0 {
            self.count.fetch_sub(removed, Ordering::AcqRel);
            states.forget(removed);
        }
    }

    /// Counts and logs a block kept shared by the keys of `limit` a shard
    /// could not keep on their own.
    fn shared_block(&self, states: &States, limit: &'static str) {
        crate::metrics::penalty_not_stored(limit);
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tower_ratelimit",
                limit,
                max_keys = states.max_keys,
                "penalty states that hold active blocks take half the memory store's bound: \
                 the keys of a limit that it cannot keep on their own share one block per \
                 shard, refused while it lasts (logged once per store, counted each time)"
            );
        }
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
        (reply.verdict, reply.wait) = (VerdictCode::Never, -1);
    } else {
        let wait = reply
            .limits
            .iter()
            .filter_map(Status::wait)
            .max()
            .unwrap_or(0);
        (reply.verdict, reply.wait) = (VerdictCode::Denied, wait);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::memory::SHARDS;
    use crate::store::{Deadline, Engine};
    use crate::{Limit, ManualClock, MemoryStore, Penalty, Quota};

    /// A penalty state counts among the store's keys while it matters, and
    /// the sweep drops it (and uncounts it) once it equals a fresh one.
    #[test]
    fn ended_penalty_states_are_swept_and_uncounted() {
        let minute = Duration::from_secs(60);
        let clock = ManualClock::new(1_800_000_000_000_000);
        let store = MemoryStore::with_clock(clock.clone());
        let limit = Limit::new("l", Quota::rate(1, minute).fixed_window())
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
        let inner = &store.inner;
        let sweep = || -> usize {
            (0..SHARDS)
                .map(|s| inner.pens.sweep(&inner.states, s))
                .sum()
        };
        // blocked a minute, remembered a minute after: not before then
        clock.advance(minute);
        assert_eq!(sweep(), 0);
        clock.advance(minute);
        assert_eq!(sweep(), 1);
        assert_eq!(store.len(), 1);
    }
}
