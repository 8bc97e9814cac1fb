//! Putting a decision's states back: saved, left as they were, or removed,
//! and a new key stored within the store's bound: in a full store, in
//! place of the state closest to fresh of the limit that holds the most
//! states (see `share.rs`), once every state of the decision is back (see
//! [`Inner::make_room`]).

use std::sync::atomic::Ordering;
use std::sync::{MutexGuard, TryLockError};

use super::key::{Hasher, Key};
use super::share::{Kind, Usage};
use super::table::{Closeness, Found, Shard, Slot, Table, SAMPLE};
use super::{Inner, SHARDS};
use crate::algorithm::State;
use crate::store::Check;

/// Slots examined for expiry after each new key (sweeping as traffic comes).
const SWEEP_PER_INSERT: usize = 32;
/// Slots of its table examined for expiry when a new key finds the store full.
const SWEEP_AT_BOUND: usize = 256;
/// States a full store compares, at least, to choose the one it gives up.
const COMPARED: usize = 2 * SAMPLE;

/// What putting a state back did.
pub(super) enum Put {
    /// Saved, left or removed.
    Kept,
    /// A new key stored.
    Added,
    /// A new key that found the store full: its slot waits in its table.
    Full,
}

impl Inner {
    /// Puts a decided state back: saved when granted (`write`) at a cost, or
    /// when `prepare` moved it back to the decision's clock (`moved`), else
    /// unchanged but for the pruning of a sliding log, as in Redis. Saved as
    /// of the decision's clock `now`; a state expired by the store's clock
    /// `store_now` is not kept. Returns whether a new key was stored, or
    /// found the store full: then its slot waits in the table
    /// ([`Table::waiting`]) for the caller to store it by
    /// [`make_room`](Self::make_room) and
    /// [`add_at_bound`](Self::add_at_bound) once every state of the
    /// decision is back (giving up a state moves slots the decision's
    /// other checks point at).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(super) fn write_back(
        &self,
        table: &mut Table,
        check: &Check<'_>,
        state: State,
        found: Found,
        hash: u64,
        write: bool,
        moved: bool,
        now: i64,
        store_now: i64,
    ) -> Put {
        let p = check.limit.params();
        let write = (write && check.cost > 0) || moved;
        match found {
            Found::Live(i) | Found::Expired(i) if write => {
                table.mark(i, p);
                if let Some(slot) = table.slot_mut(i) {
                    let expires_at = state.save_into(p, now, &mut slot.stored);
                    slot.written = now;
                    if expires_at <= store_now && table.remove(i, &self.hasher).is_some() {
                        self.forget(1);
                    }
                }
                Put::Kept
            }
            Found::Live(i) => {
                if let Some(slot) = table.slot_mut(i) {
                    state.restore(&mut slot.stored);
                }
                Put::Kept
            }
            Found::Expired(i) => {
                if table.remove(i, &self.hasher).is_some() {
                    self.forget(1);
                }
                Put::Kept
            }
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
                match self.insert(table, hash, slot, store_now) {
                    Ok(()) => Put::Added,
                    Err(slot) => {
                        table.waiting = Some(slot);
                        Put::Full
                    }
                }
            }
            Found::Shared | Found::Absent => Put::Kept,
        }
    }

    /// Makes room for the new key's state waiting in table `t` of a full
    /// store (see [`write_back`](Self::write_back)), if one waits: counts
    /// it in if room was made meanwhile, else gives up a state of the limit
    /// that holds the most, its own preferred (see
    /// [`give_up`](Self::give_up)), whose place in the count it takes.
    /// Notes whether it found room.
    pub(super) fn make_room(&self, shard: &mut Shard, t: usize, hash: u64, now: i64) {
        let Some(usage) = shard
            .tables
            .get(t)
            .filter(|table| table.waiting.is_some())
            .map(|table| std::sync::Arc::clone(&table.usage))
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
    pub(super) fn add_at_bound(&self, shard: &mut Shard, t: usize, hash: u64) -> bool {
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
    /// compared: of the shard `own`
    /// (`held`, when a decision holds it locked), then of the next shards
    /// in turn until [`COMPARED`] states were compared or every shard
    /// was, each taken without waiting (one busy or held by the decision is
    /// passed over; with none held and none found, each is then waited for
    /// in turn, holding one at a time: no lock order to keep). Returns whether
    /// it removed one: its place in the store's count is the caller's.
    /// What is lost is what that state had used: its key, back, starts
    /// fresh.
    pub(super) fn give_up(
        &self,
        own: usize,
        mut held: Option<&mut Shard>,
        now: i64,
        asking: Option<&std::sync::Arc<Usage>>,
    ) -> bool {
        let Some(donor) = self.limits.donor(Kind::Rate, asking) else {
            return false;
        };
        let donor: &Usage = &donor;
        /// Where the best state so far is: in the held shard, or another.
        enum Best<'s> {
            Held(usize, usize),
            Other(MutexGuard<'s, Shard>, usize, usize),
        }
        let mut best: Option<(Best<'_>, Closeness)> = None;
        let mut seen = 0;
        let waits = held.is_none();
        if let Some(shard) = held.as_deref_mut() {
            let (found, n) = shard.nearest_fresh(now, donor);
            seen += n;
            best = found.map(|(t, i, c)| (Best::Held(t, i), c));
        }
        for k in 0..SHARDS {
            if seen >= COMPARED && best.is_some() {
                break;
            }
            let s = (own + k) % SHARDS;
            if held.is_some() && s == own {
                continue;
            }
            let Some(mutex) = self.shards.get(s) else {
                continue;
            };
            // (never waiting while holding a shard: no lock order to keep)
            let mut guard = match mutex.try_lock() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            let (found, n) = guard.nearest_fresh(now, donor);
            seen += n;
            if let Some((t, i, c)) = found {
                if best.as_ref().is_none_or(|(_, b)| c < *b) {
                    best = Some((Best::Other(guard, t, i), c));
                }
            }
        }
        match best {
            Some((Best::Held(t, i), _)) => {
                held.is_some_and(|shard| shard.give_up(t, i, &self.hasher))
            }
            Some((Best::Other(mut guard, t, i), _)) => guard.give_up(t, i, &self.hasher),
            // every shard busy, and none held: wait for each in turn, one
            // at a time, until one has a state to give up
            None if waits => (0..SHARDS).any(|k| {
                self.shards.get((own + k) % SHARDS).is_some_and(|mutex| {
                    let mut shard = super::lock(mutex);
                    match shard.nearest_fresh(now, donor) {
                        (Some((t, i, _)), _) => shard.give_up(t, i, &self.hasher),
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
