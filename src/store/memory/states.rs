//! The rate states: [`SHARDS`] shards of tables (see `table.rs`), found by
//! the key's hash, within the store's bound on keys.
//!
//! A decision locates every check's state under its shard's lock, prepares
//! it, has the caller decide (see `algorithm::decide`, `take`, `charge`)
//! and puts the states back: saved, left as they were, or removed. A new
//! key is stored within the store's bound: in a full store, in place of
//! the state closest to fresh of the limit that holds the most states (see
//! `share.rs`), once every state of the decision is back (see
//! [`States::make_room`]). Expired states are reclaimed a few at a time by
//! the decisions that add keys, and in the background (see
//! [`States::sweep`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::decide::{table_of, Many, One, Place, Width};
use super::key::{shards, Hasher, Key};
use super::share::{search, Limits, Usage};
use super::table::{Found, Shard, Slot, Table, SAMPLE};
use super::SHARDS;
use crate::algorithm::{self, Operand, Params, Reply, State};
use crate::clock::Clock;
use crate::store::{lock, Check};

/// Slots examined for expiry after each new key (sweeping as traffic comes).
const SWEEP_PER_INSERT: usize = 32;
/// Slots of its table examined for expiry when a new key finds the store full.
const SWEEP_AT_BOUND: usize = 256;
/// Slots examined by the background reclaimer per lock hold.
const SWEEP_SLICE: usize = 1024;
/// States a full store compares, at least, to choose the one it gives up.
const COMPARED: usize = 2 * SAMPLE;

/// The rate states of a store, and its count of all states.
pub(super) struct States {
    clock: Arc<dyn Clock>,
    pub(super) shards: Box<[Mutex<Shard>]>,
    pub(super) hasher: Hasher,
    /// The states each limit holds (see `share.rs`).
    pub(super) shares: Limits,
    pub(super) max_keys: usize,
    /// Stored states in all shards, penalty states among them.
    count: AtomicUsize,
    /// Whether the store said it was full.
    full_warned: AtomicBool,
}

/// What putting a state back did.
enum Put {
    /// Saved, left or removed.
    Kept,
    /// A new key stored.
    Added,
    /// A new key that found the store full: its slot waits in its table.
    Full,
}

impl States {
    pub(super) fn new(clock: Arc<dyn Clock>, max_keys: usize) -> Self {
        Self {
            clock,
            shards: shards(),
            hasher: Hasher::default(),
            shares: Limits::default(),
            max_keys,
            count: AtomicUsize::new(0),
            full_warned: AtomicBool::new(false),
        }
    }

    /// Stored states, penalty states among them.
    pub(super) fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Counts a new state in, unless the store is full.
    pub(super) fn admit(&self) -> bool {
        self.count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_keys).then_some(n + 1)
            })
            .is_ok()
    }

    /// Uncounts `removed` states.
    pub(super) fn forget(&self, removed: usize) {
        if removed > 0 {
            self.count.fetch_sub(removed, Ordering::AcqRel);
        }
    }

    /// One atomic decision over `checks` with every key's state prepared and
    /// locked: `decide` makes it and says whether the states are written
    /// back. Returns its reply, and whether it stored a new key. `shared`,
    /// unless empty (one per check), is told which checks were decided on
    /// their table's shared overflow state: no state of their key's own
    /// (see [`Table::overflow`]).
    #[inline(always)]
    pub(super) fn decide(
        &self,
        checks: &[Check<'_>],
        shared: &mut [bool],
        decide: impl FnOnce(&mut [Operand<'_>], i64) -> (Reply, bool),
    ) -> (Reply, bool) {
        match <&[Check<'_>; 1]>::try_from(checks) {
            Ok(one) => self.decide_in::<One>(one, shared, decide),
            Err(_) => self.decide_in::<Many>(checks, shared, decide),
        }
    }

    /// [`decide`](Self::decide) over a [`Width`].
    #[inline(always)]
    fn decide_in<'c, 'a: 'c, W: Width>(
        &self,
        checks: W::Checks<'c, 'a>,
        shared: &mut [bool],
        decide: impl FnOnce(&mut [Operand<'_>], i64) -> (Reply, bool),
    ) -> (Reply, bool) {
        let store_now = self.clock.now_micros();
        let mut places = W::each(checks, |check| {
            let hash = self.hasher.hash(check.key);
            Place {
                hash,
                shard: Hasher::shard(hash),
                lock: 0,
                table: 0,
                found: Found::Absent,
                moved: false,
            }
        });
        let mut locks = W::lock(&self.shards, &mut places);

        // Where each check's state is. Nothing moves until the write-back,
        // where the limits of a limiter, having distinct names, each write
        // their own table. As in `lua/driver.lua`, the decision's clock is
        // the latest of the store's and of every key's last write as
        // believed (at most the limit's horizon ahead), so within that time
        // it never runs back.
        let mut now = store_now;
        for (i, (check, place)) in checks.as_ref().iter().zip(places.as_mut()).enumerate() {
            let Some(shard) = W::shard(&mut locks, place) else {
                continue;
            };
            place.table = shard.table(check.limit, &self.shares);
            let table = &mut shard.tables[place.table];
            place.found = locate(table, place.hash, check.key, store_now);
            if let Some(noted) = shared.get_mut(i) {
                *noted = matches!(place.found, Found::Shared);
            }
            if let Some(slot) = table.found(place.found) {
                now = now.max(algorithm::believed(
                    store_now,
                    slot.written,
                    check.limit.params(),
                ));
            }
        }

        let mut ops = W::zip(checks, &mut places, |check, place| {
            let p = check.limit.params();
            let (state, moved) = match table_of::<W>(&mut locks, place) {
                Some(table) => table.prepare(place.found, p, now),
                None => State::prepare(None, p, now, now),
            };
            place.moved = moved;
            Operand {
                state,
                p,
                cost: check.cost,
            }
        });
        let (reply, write) = decide(ops.as_mut(), now);

        let (mut added, mut full) = (false, false);
        W::each_taken(checks, ops, &places, |check, op, place| {
            if let Some(table) = table_of::<W>(&mut locks, place) {
                match self.write_back(table, check, op.state, place, write, now, store_now) {
                    Put::Kept => {}
                    Put::Added => added = true,
                    Put::Full => full = true,
                }
            }
        });
        if full {
            // once every state is back (a state given up moves others'
            // slots): room for each new key first, so that none takes the
            // place of another made by this decision, then the keys
            for place in places.as_ref() {
                if let Some(shard) = W::shard(&mut locks, place) {
                    self.make_room(shard, place.table, place.hash, store_now);
                }
            }
            for place in places.as_ref() {
                if let Some(shard) = W::shard(&mut locks, place) {
                    added |= self.add_at_bound(shard, place.table, place.hash);
                }
            }
        }
        (reply, added)
    }

    /// Gives back each check's grant made at `at`, or with `renewed`, moves
    /// it to the store's clock where still held, noting the new time (the
    /// driver's `settle`): each key at its own clock, a state that did not
    /// change left as it was (but for a sliding log's pruning).
    pub(super) fn move_grants(
        &self,
        checks: &[Check<'_>],
        at: i64,
        mut renewed: Option<&mut [Option<i64>]>,
    ) {
        let store_now = self.clock.now_micros();
        for (j, check) in checks.iter().enumerate().filter(|(_, c)| c.cost > 0) {
            let p = check.limit.params();
            self.with_table(check, |table, hash| {
                let Found::Live(i) = locate(table, hash, check.key, store_now) else {
                    return;
                };
                let Some(slot) = table.slots.get_mut(i) else {
                    return;
                };
                let now = algorithm::believed(store_now, slot.written, p);
                let (mut state, moved) =
                    State::prepare(Some(&mut slot.stored), p, slot.written, now);
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
                    return;
                }
                // equal to a fresh state (a sliding log left empty is deleted)
                self.save(table, i, state, p, now, now);
            });
        }
    }

    /// Forgets the state of every check's key.
    pub(super) fn reset(&self, checks: &[Check<'_>]) {
        for check in checks {
            self.with_table(check, |table, hash| {
                if let Some(i) = table.find(hash, check.key) {
                    self.remove(table, i);
                }
            });
        }
    }

    /// One background step in shard `s`: sweeps a slice of table `*t`, with
    /// `*budget` slots left to examine in it. Returns whether the shard has
    /// more.
    pub(super) fn sweep(&self, s: usize, t: &mut usize, budget: &mut Option<usize>) -> bool {
        let Some(shard) = self.shards.get(s) else {
            return false;
        };
        let now = self.clock.now_micros();
        let mut shard = lock(shard);
        let Some(table) = shard.tables.get_mut(*t) else {
            return false;
        };
        let left = *budget.get_or_insert(table.slots.len);
        let (examined, removed) = table.sweep(left.min(SWEEP_SLICE), now, &self.hasher);
        self.forget(removed);
        let left = left.saturating_sub(examined.max(1));
        if left == 0 || table.slots.len == 0 {
            table.slots.shrink(&self.hasher);
            *t += 1;
            *budget = None;
            return *t < shard.tables.len();
        }
        *budget = Some(left);
        true
    }

    /// `f` of the table of `check`'s limit in its key's shard, locked, and
    /// the key's hash.
    fn with_table(&self, check: &Check<'_>, f: impl FnOnce(&mut Table, u64)) {
        let hash = self.hasher.hash(check.key);
        let mut shard = lock(&self.shards[Hasher::shard(hash)]);
        let t = shard.table(check.limit, &self.shares);
        f(&mut shard.tables[t], hash);
    }

    /// Removes slot `i` of `table`, uncounted.
    fn remove(&self, table: &mut Table, i: usize) {
        if table.remove(i, &self.hasher).is_some() {
            self.forget(1);
        }
    }

    /// Saves `state` into slot `i` of `table` as of `now`, written by `p`;
    /// removes it if it is fresh by `fresh_at`.
    #[inline(always)]
    fn save(&self, table: &mut Table, i: usize, state: State, p: &Params, now: i64, fresh_at: i64) {
        table.mark(i, p);
        if let Some(slot) = table.slots.get_mut(i) {
            let expires_at = state.save_into(p, now, &mut slot.stored);
            slot.written = now;
            if expires_at <= fresh_at {
                self.remove(table, i);
            }
        }
    }

    /// Puts a decided state back where `place` found it: saved when granted
    /// (`write`) at a cost, or when `prepare` moved it back to the
    /// decision's clock, else unchanged but for the pruning of a sliding
    /// log, as in Redis. Saved as of the decision's clock `now`; a state
    /// expired by the store's clock `store_now` is not kept. Returns
    /// whether a new key was stored, or found the store full: then its slot
    /// waits in the table ([`Table::waiting`]) for the caller to store it
    /// by [`make_room`](Self::make_room) and
    /// [`add_at_bound`](Self::add_at_bound) once every state of the
    /// decision is back (giving up a state moves slots the decision's
    /// other checks point at).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn write_back(
        &self,
        table: &mut Table,
        check: &Check<'_>,
        state: State,
        place: &Place,
        write: bool,
        now: i64,
        store_now: i64,
    ) -> Put {
        let p = check.limit.params();
        let write = (write && check.cost != 0) || place.moved;
        match place.found {
            Found::Live(i) | Found::Expired(i) if write => {
                self.save(table, i, state, p, now, store_now);
            }
            Found::Live(i) => {
                if let Some(slot) = table.slots.get_mut(i) {
                    state.restore(&mut slot.stored);
                }
            }
            Found::Expired(i) => self.remove(table, i),
            Found::Shared | Found::Absent if write => {
                let (stored, expires_at) = state.save_new(p, now);
                if expires_at <= store_now {
                    return Put::Kept;
                }
                let slot = Slot {
                    key: Key::from_slice(check.key),
                    written: now,
                    stored,
                    quota: table.quota_of(p),
                };
                return match self.insert(table, place.hash, slot, store_now) {
                    Ok(()) => Put::Added,
                    Err(slot) => {
                        table.waiting = Some(slot);
                        Put::Full
                    }
                };
            }
            Found::Shared | Found::Absent => {}
        }
        Put::Kept
    }

    /// Makes room for the new key's state waiting in table `t` of a full
    /// store (see [`write_back`](Self::write_back)), if one waits: counts
    /// it in if room was made meanwhile, else gives up a state of the limit
    /// that holds the most, its own preferred (see
    /// [`give_up`](Self::give_up)), whose place in the count it takes.
    /// Notes whether it found room.
    fn make_room(&self, shard: &mut Shard, t: usize, hash: u64, now: i64) {
        let Some(usage) = shard
            .tables
            .get(t)
            .filter(|table| table.waiting.is_some())
            .map(|table| Arc::clone(&table.usage))
        else {
            return;
        };
        if !self.full_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tower_ratelimit",
                max_keys = self.max_keys,
                "the memory store is full: new keys take the place of the states closest to \
                 fresh of the limit that holds the most (logged once per store)"
            );
        }
        let room =
            self.admit() || self.give_up(Hasher::shard(hash), Some(&mut *shard), now, Some(&usage));
        if let Some(table) = shard.tables.get_mut(t) {
            table.room = room;
        }
    }

    /// Stores the new key's state waiting in table `t`, if one waits, in
    /// the room [`make_room`](Self::make_room) made; if it made none, its
    /// grant goes to the table's shared overflow state, which then holds it
    /// (it was live and copied, or equal to fresh). Returns whether a key
    /// was stored.
    fn add_at_bound(&self, shard: &mut Shard, t: usize, hash: u64) -> bool {
        let Some(table) = shard.tables.get_mut(t) else {
            return false;
        };
        let Some(mut slot) = table.waiting.take() else {
            return false;
        };
        if std::mem::take(&mut table.room) {
            match table.push(hash, slot, &self.hasher) {
                Ok(()) => return true,
                Err(back) => {
                    self.forget(1);
                    slot = back;
                }
            }
        }
        slot.key = Key::new();
        table.overflow = Some(slot);
        false
    }

    /// Makes room in a full store for a new state of `asking` (`None`: a
    /// penalty state): removes, of the limit that holds the most rate
    /// states, `asking` preferred on a tie (see `share.rs`), the state
    /// closest to fresh (see [`Shard::nearest_fresh`]) among those
    /// compared: of the shard `own` (`held`, when a decision holds it
    /// locked), then of the next shards in turn until [`COMPARED`] states
    /// were compared or every shard was (see [`search`]; with none held
    /// and none found, each is then waited for in turn, holding one at a
    /// time: no lock order to keep). Returns whether it removed one: its
    /// place in the store's count is the caller's. What is lost is what
    /// that state had used: its key, back, starts fresh.
    pub(super) fn give_up(
        &self,
        own: usize,
        mut held: Option<&mut Shard>,
        now: i64,
        asking: Option<&Arc<Usage>>,
    ) -> bool {
        let Some(donor) = self.shares.donor(|u| &u.states, asking) else {
            return false;
        };
        let donor: &Usage = &donor;
        let in_held = held.as_deref_mut().map(|s| s.nearest_fresh(now, donor));
        let best = search(
            &self.shards,
            own,
            in_held,
            COMPARED,
            |_| true,
            |s| s.nearest_fresh(now, donor),
        );
        match best {
            Some((None, _, (t, i))) => held.is_some_and(|s| s.give_up(t, i, &self.hasher)),
            Some((Some(mut guard), _, (t, i))) => guard.give_up(t, i, &self.hasher),
            // every shard busy, and none held: wait for each in turn, one
            // at a time, until one has a state to give up
            None if held.is_none() => (0..SHARDS).any(|k| {
                self.shards.get((own + k) % SHARDS).is_some_and(|mutex| {
                    let mut shard = lock(mutex);
                    match shard.nearest_fresh(now, donor) {
                        (Some((_, (t, i))), _) => shard.give_up(t, i, &self.hasher),
                        (None, _) => false,
                    }
                })
            }),
            None => false,
        }
    }

    /// Stores a new key's state, within the bound: when the store is full,
    /// first reclaims expired states of this table, else gives it back.
    fn insert(&self, table: &mut Table, hash: u64, slot: Slot, store_now: i64) -> Result<(), Slot> {
        if !self.admit() {
            let (_, removed) = table.sweep(SWEEP_AT_BOUND, store_now, &self.hasher);
            self.forget(removed);
            if !self.admit() {
                return Err(slot);
            }
        }
        if let Err(slot) = table.push(hash, slot, &self.hasher) {
            self.forget(1);
            return Err(slot);
        }
        let (_, removed) = table.sweep(SWEEP_PER_INSERT, store_now, &self.hasher);
        self.forget(removed);
        Ok(())
    }
}

/// Where `key`'s state is in `table`. An expired state reads as absent;
/// its slot is overwritten if the decision writes, else removed.
#[inline]
fn locate(table: &Table, hash: u64, key: &[u8], store_now: i64) -> Found {
    let Some(i) = table.find(hash, key) else {
        return match &table.overflow {
            Some(shared) if shared.stored.expires_at() > store_now => Found::Shared,
            _ => Found::Absent,
        };
    };
    match table.slots.get(i) {
        Some(slot) if slot.stored.expires_at() > store_now => Found::Live(i),
        _ => Found::Expired(i),
    }
}
