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
//!
//! An offence is a refusal by the key's own state: one decided on its
//! table's shared overflow state (a key not stored in a full store, see
//! `States::decide`) is not counted, since that state holds other keys'
//! grants. The key's own state is then absent, so fresh, and would not
//! refuse; in Redis, where every key has its own state, such a key is
//! granted and counts no refusal either.
//!
//! Penalty states take at most half the store's bound. Once they do, a
//! new one takes the place of one given up; a ban given up is kept as a
//! record of 16 bytes (`bans.rs`), [`RECORDS_PER_STATE`] counted as one
//! state, so that a half of `max_keys / 2` states keeps up to about
//! `2 * max_keys` bans. When none can be given up, a ban goes to its
//! bucket of the key hash (at most 1/8192 of a limit's keys blocked so),
//! else it is not stored (the client is not told it is blocked).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use smallvec::SmallVec;

use super::bans::{recordable, RECORDS_PER_STATE};
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
    /// Penalty states in all shards, and the states their ban records
    /// count as (see [`record_units`]; counted in the store's states too).
    count: AtomicUsize,
    /// Ban records in all shards.
    records: AtomicUsize,
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
            records: AtomicUsize::new(0),
            warned: AtomicBool::new(false),
        }
    }

    /// Runs `run` on `checks` under their limits' penalties (see the
    /// module): `run(checks, blocked, shared)` decides (a take takes), or,
    /// when `blocked`, decides without granting (a take: a cost of 1),
    /// noting in `shared` (unless empty) the checks decided on a shared
    /// overflow state (see `States::decide`). A refusal by a penalized
    /// limit beyond the wait `refusals` counts, unless decided on a shared
    /// state (none: a dry run or a take, which count none). Returns its
    /// answer with the blocks' statuses.
    #[inline(always)]
    pub(super) fn run<R: Replied>(
        &self,
        states: &States,
        checks: &[Check<'_>],
        refusals: Option<i64>,
        run: impl FnOnce(&[Check<'_>], bool, &mut [bool]) -> R,
    ) -> R {
        if !checks.iter().any(is_penalized) {
            return run(checks, false, &mut []);
        }
        self.penalized(states, checks, refusals, run)
    }

    #[inline(never)]
    fn penalized<R: Replied>(
        &self,
        states: &States,
        checks: &[Check<'_>],
        refusals: Option<i64>,
        run: impl FnOnce(&[Check<'_>], bool, &mut [bool]) -> R,
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
            let mut ran = run(checks, true, &mut []);
            if let Some(reply) = ran.reply() {
                block_statuses(reply, &lefts);
            }
            return ran;
        }
        let mut shared: SmallVec<[bool; 2]> = smallvec::smallvec![false; checks.len()];
        let mut ran = run(checks, false, &mut shared);
        let counted = refusals.zip(ran.reply());
        let Some((max_wait, reply)) = counted.filter(|(_, r)| r.verdict == VerdictCode::Denied)
        else {
            return ran;
        };
        // count a refusal for each penalized limit that refused, on its
        // key's own state (see the module)
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
                if !refused || shared.get(i).copied().unwrap_or(false) {
                    return None;
                }
                let offence = state.refuse(p, store_now);
                let stored = guards.get_mut(guard_of(hash)).is_some_and(|pens| {
                    self.put(states, pens, hash, check, p, state, store_now, true)
                });
                // told "blocked" only for a block that was stored
                (offence && stored).then(|| state.until - store_now)
            })
            .collect();
        block_statuses(reply, &lefts);
        ran
    }

    /// Changes `check`'s penalty state (see [`Penalty`]); its state
    /// after a block (before a forget), and the store time.
    /// [`Error::PenaltyNotStored`] when a new block finds penalty states
    /// taking half the store's bound, none of which can be given up, and
    /// no room among ban records (see [`put`](Self::put)).
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
                let name = check.limit.shared_name();
                if let Some(i) = pens.find(hash, name, check.key) {
                    self.remove(states, &mut pens, i);
                }
                self.unrecord(states, &mut pens, name, hash);
                // a block its bucket shares, which it now reads: lifted
                // for the bucket
                pens.unbucket(name, hash, now);
            }
        }
        Ok(Some((state, now)))
    }

    /// Drops the states of shard `s` that are fresh (and the records and
    /// bucket states that ended); returns how many states it uncounted.
    pub(super) fn sweep(&self, states: &States, s: usize) -> usize {
        let now = self.clock.now_micros();
        let (removed, records) =
            (self.shards.get(s)).map_or((0, 0), |pens| lock(pens).sweep(now, &states.hasher));
        self.forget(states, removed);
        removed + self.uncount_records(states, records)
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

    /// Writes `state` back for `check` (or drops it, fresh at `now`):
    /// into its full state, or its ban record while it is a block only. A
    /// new state takes the place of a rate state or, once penalty states
    /// take half the bound, of a penalty state given up (see
    /// [`admit`](Self::admit)). When none can be given up, a block (no
    /// refusals counted) is kept as a record if a record needs no more
    /// room; else, with `share`, the state goes to the state of its key's
    /// bucket (see `bans.rs`), while one of the limit's buckets in the shard
    /// holds no block in force. Whether it was stored; a state that went
    /// to a bucket or was not stored is counted (see
    /// [`crate::metrics::PENALTIES_NOT_STORED`]). Takes shard locks: none
    /// may be held (a penalty lock is taken first).
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
            self.unrecord(states, pens, name, hash);
            return true;
        }
        if let Some(slot) = found.and_then(|i| pens.get_mut(i)) {
            (slot.state, slot.exp, slot.written) = (state, exp, now);
            return true;
        }
        if pens.has_record(name, hash) {
            if recordable(&state, now) {
                pens.record(&states.shares, name, hash, &state);
                return true;
            }
            self.unrecord(states, pens, name, hash);
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
        if recordable(&state, now) && self.record_in_room(states, pens, name, hash, &state) {
            return true;
        }
        let stored = share && pens.put_in_bucket(&states.shares, name, hash, state, exp, now);
        self.not_stored(states, name);
        stored
    }

    /// Makes room for a new penalty state of `usage` in the shard `own`
    /// (`pens`, locked): below half the store's bound (at least one), so
    /// that no flood of penalty states leaves rate states without room (the
    /// shared overflow state, where new keys would share one drained
    /// state), counted in, in place of a rate state given up if the store
    /// is full (see [`States::give_up`]); else in place of a penalty state
    /// given up (see [`give_up`](Self::give_up)), or of the next when that
    /// one's room went to its ban record. Whether it made room.
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
        for _ in 0..3 {
            match self.give_up(states, pens, own, usage, now) {
                Some(true) => return true,
                Some(false) => {}
                None => return false,
            }
        }
        false
    }

    /// Makes room among penalty states for a new one of `asking`: gives up,
    /// of the limit that holds the most penalty states (`asking` counted
    /// with its new one and preferred on a tie, see `share.rs`), the state
    /// ranked first (see [`PenShard::first_to_give_up`]) among those
    /// compared: of the shard `own` (`pens`, locked), then of the next
    /// shards (see [`search`]), until [`PEN_COMPARED`] were compared and
    /// one holds no active block, or every shard was. An active block is
    /// kept as its key's ban record. `None` when none was given up, else
    /// whether its place in the counts is the new state's (not when its
    /// record took it, see [`add_record`](Self::add_record)).
    fn give_up(
        &self,
        states: &States,
        pens: &mut PenShard,
        own: usize,
        asking: &Arc<Usage>,
        now: i64,
    ) -> Option<bool> {
        let donor = states.shares.donor(|u| &u.pens, Some(asking))?;
        let in_own = pens.first_to_give_up(&donor, now);
        let (mut guard, _, i) = search(
            &self.shards,
            own,
            Some(in_own),
            PEN_COMPARED,
            |r| r.0 < 2,
            |p| p.first_to_give_up(&donor, now),
        )?;
        let pens = guard.as_deref_mut().unwrap_or(pens);
        let recorded = pens.give_up(&states.shares, i, now, &states.hasher)?;
        Some(!recorded || !self.add_record())
    }

    /// Counts a new ban record made of a state given up; whether it takes
    /// that state's place in the counts (one state per
    /// [`RECORDS_PER_STATE`] records, see [`record_units`]).
    fn add_record(&self) -> bool {
        let before = self.records.fetch_add(1, Ordering::AcqRel);
        record_units(before + 1) > record_units(before)
    }

    /// Keeps `state` as the new ban record of `hash` under `name` if the
    /// records need no more room for it (see [`record_units`]); whether it
    /// did.
    fn record_in_room(
        &self,
        states: &States,
        pens: &mut PenShard,
        name: &'static str,
        hash: u64,
        state: &PenState,
    ) -> bool {
        let counted = self
            .records
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (record_units(n + 1) == record_units(n)).then_some(n + 1)
            })
            .is_ok();
        if counted && !pens.record(&states.shares, name, hash, state) {
            // (replaced one: the caller removed it first)
            self.uncount_records(states, 1);
        }
        counted
    }

    /// Removes the ban record of `hash` under `name`, uncounted; whether
    /// there was one.
    fn unrecord(
        &self,
        states: &States,
        pens: &mut PenShard,
        name: &'static str,
        hash: u64,
    ) -> bool {
        let removed = pens.unrecord(name, hash);
        if removed {
            self.uncount_records(states, 1);
        }
        removed
    }

    /// Uncounts `removed` ban records; returns how many states they
    /// counted as.
    fn uncount_records(&self, states: &States, removed: usize) -> usize {
        if removed == 0 {
            return 0;
        }
        let before = self.records.fetch_sub(removed, Ordering::AcqRel);
        let units = record_units(before) - record_units(before.saturating_sub(removed));
        self.forget(states, units);
        units
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

    /// Counts and logs a penalty state of `limit` not kept on its own: in
    /// its bucket's state, or not at all.
    fn not_stored(&self, states: &States, limit: &'static str) {
        crate::metrics::penalty_not_stored(limit);
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tower_ratelimit",
                limit,
                max_keys = states.max_keys,
                "penalty states and ban records that hold active blocks take half the memory \
                 store's bound: a new one goes to the state its key's bucket shares (1/2^21 of \
                 the limit's keys), or is not stored (logged once per store, counted each time)"
            );
        }
    }
}

/// The states `records` ban records count as: one per
/// [`RECORDS_PER_STATE`], rounded up.
fn record_units(records: usize) -> usize {
    records.div_ceil(RECORDS_PER_STATE)
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
