//! Penalties (see `Limit::with_penalty`) in the memory store: each key's
//! [`PenState`] by limit name, in one of [`SHARDS`] maps, each under a lock
//! of its own, held across the whole decision of a penalized limit, so that
//! its refusals are counted exactly (the script's atomicity). The steps are
//! those of `penalized_one` and the loop in `lua/penalty.lua`: a blocked key
//! is refused without its quota being consulted (one limit) or charged
//! (several), a refusal by the limit itself is counted, the N-th within the
//! time blocks. Only limits with a penalty take these locks (always before a
//! shard's), so others pay one test.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use hashbrown::HashTable;
use smallvec::SmallVec;

use super::key::{Hasher, Key};
use super::share::{Kind, Usage};
use super::{lock, Inner, MemoryStore, SHARDS};
use crate::algorithm::{Reply, Status, VerdictCode};
use crate::penalty::{PenParams, PenState};
use crate::store::Check;
use crate::store::Penalty;
use crate::Error;

/// Penalty states of each shard a full penalty half compares, to choose
/// the one it gives up (see [`Inner::give_up_pen`]).
const PEN_SAMPLE: usize = 32;
/// Penalty states a full penalty half compares, at least.
const PEN_COMPARED: usize = 2 * PEN_SAMPLE;

/// One key's penalty state under one limit.
struct PenSlot {
    /// Interned: compared by address.
    name: &'static str,
    key: Key,
    hash: u64,
    state: PenState,
    /// When it becomes fresh (store time, us).
    exp: i64,
    /// When it was last written (store time, us).
    written: i64,
}

/// One limit's penalty states in a shard: its usage, and the block shared
/// by its keys the shard could not keep on their own (see
/// [`MemoryStore::penalized`]).
struct PenLimit {
    usage: Arc<Usage>,
    shared: Option<(PenState, i64)>,
}

/// One shard's penalty states, by limit name and key: kept densely, found
/// by an index of slot numbers (so that a full store compares a few from
/// a cursor, as the rate tables do).
#[derive(Default)]
pub(super) struct Pens {
    slots: Vec<PenSlot>,
    index: HashTable<u32>,
    cursor: usize,
    limits: Vec<PenLimit>,
}

impl Pens {
    fn find(&self, hash: u64, name: &'static str, key: &[u8]) -> Option<usize> {
        let slots = &self.slots;
        let found = self.index.find(hash, |&i| {
            slots
                .get(i as usize)
                .is_some_and(|s| std::ptr::eq(s.name, name) && s.key.as_slice() == key)
        })?;
        Some(*found as usize)
    }

    fn limit(&self, name: &'static str) -> Option<&PenLimit> {
        self.limits
            .iter()
            .find(|l| std::ptr::eq(l.usage.name, name))
    }

    fn limit_mut(&mut self, inner: &Inner, name: &'static str) -> &mut PenLimit {
        let at = match self
            .limits
            .iter()
            .position(|l| std::ptr::eq(l.usage.name, name))
        {
            Some(at) => at,
            None => {
                self.limits.push(PenLimit {
                    usage: inner.limits.usage(name),
                    shared: None,
                });
                self.limits.len() - 1
            }
        };
        &mut self.limits[at]
    }

    /// The shared block of `name` while it lasts at `now`.
    fn shared(&self, name: &'static str, now: i64) -> Option<PenState> {
        match self.limit(name)?.shared {
            Some((state, exp)) if exp > now => Some(state),
            _ => None,
        }
    }

    fn insert(&mut self, inner: &Inner, slot: PenSlot) -> bool {
        let Ok(i) = u32::try_from(self.slots.len()) else {
            return false;
        };
        self.limit_mut(inner, slot.name)
            .usage
            .pens
            .fetch_add(1, Ordering::AcqRel);
        let hash = slot.hash;
        self.slots.push(slot);
        let slots = &self.slots;
        self.index
            .insert_unique(hash, i, |&j| slots.get(j as usize).map_or(0, |s| s.hash));
        true
    }

    /// Removes slot `i`, moving the last slot into its place.
    fn remove(&mut self, i: usize) -> Option<PenSlot> {
        let hash = self.slots.get(i)?.hash;
        if let Ok(entry) = self.index.find_entry(hash, |&j| j as usize == i) {
            entry.remove();
        }
        let last = self.slots.len() - 1;
        if i != last {
            let moved = self.slots.get(last).map_or(0, |s| s.hash);
            if let Some(number) = self.index.find_mut(moved, |&j| j as usize == last) {
                *number = u32::try_from(i).unwrap_or(u32::MAX);
            }
        }
        let slot = self.slots.swap_remove(i);
        if let Some(l) = self.limit(slot.name) {
            l.usage.pens.fetch_sub(1, Ordering::AcqRel);
        }
        Some(slot)
    }

    /// Of up to [`PEN_SAMPLE`] slots of `of` from the cursor (which moves
    /// past them), the one to give up first: a count of refusals only,
    /// then an ended block, the one written longest ago first, then an
    /// active block (see [`rank`]).
    fn first_to_give_up(&mut self, of: &Usage, now: i64) -> (Option<(usize, Rank)>, usize) {
        let len = self.slots.len();
        if len == 0 {
            return (None, 0);
        }
        let start = self.cursor % len;
        let n = PEN_SAMPLE.min(len);
        let mut best: Option<(usize, Rank)> = None;
        for k in 0..n {
            let i = (start + k) % len;
            let Some(slot) = self.slots.get(i).filter(|s| std::ptr::eq(s.name, of.name)) else {
                continue;
            };
            let r = rank(slot, now);
            if best.is_none_or(|(_, b)| r < b) {
                best = Some((i, r));
            }
        }
        self.cursor = (start + n) % len;
        (best, n)
    }

    /// Gives up slot `i` for a new state: a block still active goes to its
    /// limit's shared block (the keys not kept on their own are then
    /// refused with it: no ban is dropped). Whether it removed one.
    fn give_up(&mut self, inner: &Inner, i: usize, now: i64) -> bool {
        let Some(slot) = self.remove(i) else {
            return false;
        };
        if slot.state.blocked(now).is_some() {
            let limit = self.limit_mut(inner, slot.name);
            limit.shared = Some(match limit.shared.filter(|(_, exp)| *exp > now) {
                Some((shared, exp)) => (merged(shared, slot.state), exp.max(slot.exp)),
                None => (slot.state, slot.exp),
            });
            inner.shared_block(slot.name);
        }
        true
    }
}

/// How early a penalty state is given up: (0) a count of refusals only,
/// (1) an ended block, (2) an active block; then the one written longest
/// ago.
type Rank = (u8, i64);

fn rank(slot: &PenSlot, now: i64) -> Rank {
    let class = match slot.state.until {
        0 => 0,
        until if until <= now => 1,
        _ => 2,
    };
    (class, slot.written)
}

/// A block `b` added to the shared `a`: the later end, the more offences.
fn merged(a: PenState, b: PenState) -> PenState {
    PenState {
        until: a.until.max(b.until),
        offences: a.offences.max(b.offences),
        ..a
    }
}

/// The penalty maps of a store, one per shard.
pub(super) fn pens() -> Box<[Mutex<Pens>]> {
    (0..SHARDS).map(|_| Mutex::new(Pens::default())).collect()
}

/// Drops the states of `pens` that are fresh at `now` (and shared blocks
/// that ended); returns how many states.
pub(super) fn sweep_pens(pens: &Mutex<Pens>, now: i64) -> usize {
    let mut pens = lock(pens);
    for limit in &mut pens.limits {
        if limit.shared.is_some_and(|(_, exp)| exp <= now) {
            limit.shared = None;
        }
    }
    let mut removed = 0;
    let mut i = 0;
    while i < pens.slots.len() {
        if pens.slots.get(i).is_some_and(|s| s.exp <= now) && pens.remove(i).is_some() {
            removed += 1;
        } else {
            i += 1;
        }
    }
    removed
}

/// How a decision runs under its penalties: a plain decision, or a take.
#[derive(Clone, Copy)]
pub(super) enum Run {
    Decide { max_wait: i64, dry: bool },
    Take,
}

impl Inner {
    /// `check`'s penalty state at `now` (fresh when absent or expired; a
    /// key not kept on its own reads its limit's shared block, if one
    /// lasts); one dated after `now` (the clock stepped back) is moved back
    /// to it whole and written so (see [`PenState::dated`]).
    fn pen_state(
        &self,
        pens: &mut Pens,
        hash: u64,
        check: &Check<'_>,
        p: &PenParams,
        now: i64,
    ) -> PenState {
        let name = check.limit.shared_name();
        let mut state = match pens.find(hash, name, check.key) {
            Some(i) => pens
                .slots
                .get(i)
                .filter(|s| s.exp > now)
                .map_or_else(PenState::default, |s| s.state),
            None if pens.limits.is_empty() => PenState::default(),
            None => pens.shared(name, now).unwrap_or_default(),
        };
        if state.dated(now) {
            self.put_pen(pens, hash, check, p, state, now, true);
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

    /// Makes room for a new penalty state of `usage` in the shard `own`
    /// (`pens`, locked): below [`max_pens`](Self::max_pens), counted in, in
    /// place of a rate state given up if the store is full (see
    /// [`Inner::give_up`]); else in place of a penalty state given up (see
    /// [`give_up_pen`](Self::give_up_pen)). Whether it made room.
    fn admit_pen(&self, pens: &mut Pens, own: usize, usage: &Arc<Usage>, now: i64) -> bool {
        let max = self.max_pens();
        let counted = self
            .pens_count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if counted {
            if self.admit() || self.give_up(own, None, now, None) {
                return true;
            }
            self.pens_count.fetch_sub(1, Ordering::AcqRel);
        }
        self.give_up_pen(pens, own, usage, now)
    }

    /// Makes room among penalty states for a new one of `asking`: gives up,
    /// of the limit that holds the most penalty states (`asking` counted
    /// with its new one and preferred on a tie, see `share.rs`), the state
    /// ranked first (see [`rank`]) among those compared: of the shard `own`
    /// (`pens`, locked), then of the next shards taken without waiting,
    /// until [`PEN_COMPARED`] were compared and one holds no active block,
    /// or every shard was. An active block is given up only for another
    /// limit's state: it goes to its limit's shared block. Whether it gave
    /// one up (its place in the counts is the new state's).
    fn give_up_pen(&self, pens: &mut Pens, own: usize, asking: &Arc<Usage>, now: i64) -> bool {
        let Some(donor) = self.limits.donor(Kind::Penalty, Some(asking)) else {
            return false;
        };
        let active_ok = !Arc::ptr_eq(&donor, asking);
        let (found, mut seen) = pens.first_to_give_up(&donor, now);
        let mut best: Option<(Option<MutexGuard<'_, Pens>>, usize, Rank)> =
            found.map(|(i, r)| (None, i, r));
        for k in 1..SHARDS {
            if seen >= PEN_COMPARED && best.as_ref().is_some_and(|(_, _, r)| r.0 < 2) {
                break;
            }
            let Some(mutex) = self.pens.get((own + k) % SHARDS) else {
                continue;
            };
            // (held shards, this decision's among them, are passed over)
            let mut guard = match mutex.try_lock() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            let (found, n) = guard.first_to_give_up(&donor, now);
            seen += n;
            if let Some((i, r)) = found {
                if best.as_ref().is_none_or(|(_, _, b)| r < *b) {
                    best = Some((Some(guard), i, r));
                }
            }
        }
        match best {
            Some((_, _, (2, _))) if !active_ok => false,
            Some((None, i, _)) => pens.give_up(self, i, now),
            Some((Some(mut guard), i, _)) => guard.give_up(self, i, now),
            None => false,
        }
    }

    /// Uncounts `removed` penalty states.
    pub(super) fn forget_pens(&self, removed: usize) {
        if removed > 0 {
            self.pens_count.fetch_sub(removed, Ordering::AcqRel);
            self.forget(removed);
        }
    }

    /// Counts and logs a block kept shared by the keys of `limit` a shard
    /// could not keep on their own.
    fn shared_block(&self, limit: &'static str) {
        crate::metrics::penalty_not_stored(limit);
        if !self.pens_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tower_ratelimit",
                limit,
                max_keys = self.max_keys,
                "penalty states that hold active blocks take half the memory store's bound: \
                 the keys of a limit that it cannot keep on their own share one block per \
                 shard, refused while it lasts (logged once per store, counted each time)"
            );
        }
    }

    /// Writes `state` back for `check` (or drops it, fresh at `now`). A
    /// new state takes the place of a rate state or, once penalty states
    /// take half the bound, of a penalty state given up (see
    /// [`admit_pen`](Self::admit_pen)). When none can be given up (every
    /// one compared holds an active block of its own limit), the store
    /// fails closed: with `share`, the state goes to the limit's shared
    /// block in this shard, which the keys not kept on their own read;
    /// without (a block by hand), it is not stored and `false` returned.
    /// Both are counted (see [`crate::metrics::PENALTIES_NOT_STORED`]).
    /// Takes shard locks: none may be held (a penalty lock is taken
    /// first).
    #[allow(clippy::too_many_arguments)]
    fn put_pen(
        &self,
        pens: &mut Pens,
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
                if pens.remove(i).is_some() {
                    self.forget_pens(1);
                }
            }
            return true;
        }
        if let Some(slot) = found.and_then(|i| pens.slots.get_mut(i)) {
            (slot.state, slot.exp, slot.written) = (state, exp, now);
            return true;
        }
        let usage = Arc::clone(&pens.limit_mut(self, name).usage);
        let own = Hasher::shard(hash);
        if self.admit_pen(pens, own, &usage, now) {
            let slot = PenSlot {
                name,
                key: Key::from_slice(check.key),
                hash,
                state,
                exp,
                written: now,
            };
            if pens.insert(self, slot) {
                return true;
            }
            self.forget_pens(1);
        }
        if !share {
            self.shared_block(name);
            return false;
        }
        // read from the shared block (or fresh): it becomes the shared one
        let limit = pens.limit_mut(self, name);
        let exp = limit
            .shared
            .filter(|(_, e)| *e > now)
            .map_or(exp, |(_, e)| e.max(exp));
        limit.shared = Some((state, exp));
        self.shared_block(name);
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
        // each penalized check's key's hash
        let hashes: SmallVec<[Option<u64>; 2]> = checks
            .iter()
            .map(|c| c.limit.pen_params().map(|_| inner.hasher.hash(c.key)))
            .collect();
        let shards: SmallVec<[Option<usize>; 2]> =
            hashes.iter().map(|h| h.map(Hasher::shard)).collect();
        let mut order: SmallVec<[usize; 2]> = shards.iter().flatten().copied().collect();
        order.sort_unstable();
        order.dedup();
        // taken in shard order, before any shard of the states
        let mut guards: SmallVec<[MutexGuard<'_, Pens>; 2]> =
            order.iter().map(|&s| lock(&inner.pens[s])).collect();
        let guard_of = |shard: usize| order.binary_search(&shard).unwrap_or_default();
        let store_now = inner.clock.now_micros();
        let mut states: SmallVec<[Option<PenState>; 2]> = SmallVec::new();
        for (check, hash) in checks.iter().zip(&hashes) {
            let (Some(p), Some(hash)) = (check.limit.pen_params(), *hash) else {
                states.push(None);
                continue;
            };
            let Some(pens) = guards.get_mut(guard_of(Hasher::shard(hash))) else {
                states.push(Some(PenState::default()));
                continue;
            };
            states.push(Some(inner.pen_state(pens, hash, check, p, store_now)));
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
                    verdict: VerdictCode::Denied,
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
        if dry || reply.verdict != VerdictCode::Denied {
            return ran;
        }
        // count a refusal for each penalized limit that refused
        let mut lefts: SmallVec<[Option<i64>; 2]> = SmallVec::new();
        for (i, ((check, hash), state)) in checks.iter().zip(&hashes).zip(&states).enumerate() {
            let (Some(p), Some(hash), Some(mut state)) = (check.limit.pen_params(), *hash, *state)
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
            if let Some(pens) = guards.get_mut(guard_of(Hasher::shard(hash))) {
                inner.put_pen(pens, hash, check, p, state, store_now, true);
            }
        }
        block_statuses(reply, &lefts);
        ran
    }

    /// Changes `check`'s penalty state (see [`Penalty`]); its state
    /// after a block (before a forget), and the store time.
    /// [`Error::PenaltyNotStored`] when a new block finds penalty states
    /// taking half the store's bound, none of which can be given up (see
    /// [`Inner::put_pen`]).
    pub(super) fn change_pen_now(
        &self,
        check: &Check<'_>,
        change: Penalty,
    ) -> Result<Option<(PenState, i64)>, Error> {
        let inner = &*self.inner;
        let Some(p) = check.limit.pen_params() else {
            return Ok(None);
        };
        let hash = inner.hasher.hash(check.key);
        let mut pens = lock(&inner.pens[Hasher::shard(hash)]);
        let now = inner.clock.now_micros();
        let mut state = inner.pen_state(&mut pens, hash, check, p, now);
        match change {
            Penalty::Read => {}
            Penalty::Block(us) => {
                state.block(now, us);
                if !inner.put_pen(&mut pens, hash, check, p, state, now, false) {
                    return Err(Error::PenaltyNotStored);
                }
            }
            Penalty::Unblock => {
                let name = check.limit.shared_name();
                if let Some(i) = pens.find(hash, name, check.key) {
                    if pens.remove(i).is_some() {
                        inner.forget_pens(1);
                    }
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
    use crate::store::Deadline;
    use crate::store::Engine;
    use crate::{Clock, Limit, ManualClock, Penalty, Quota};

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
