//! Putting a decision's states back: saved, left as they were, or removed,
//! and a new key stored within the store's bound.

use std::sync::atomic::Ordering;

use super::table::{Found, Key, Slot, Table};
use super::Inner;
use crate::algorithm::State;
use crate::store::Check;

/// Slots examined for expiry after each new key (sweeping as traffic comes).
const SWEEP_PER_INSERT: usize = 32;
/// Slots of its table examined for expiry when a new key finds the store full.
const SWEEP_AT_BOUND: usize = 256;

impl Inner {
    /// Puts a decided state back: saved when granted (`write`) at a cost, or
    /// when `prepare` moved it back to the decision's clock (`moved`), else
    /// unchanged but for the pruning of a sliding log, as in Redis. Saved as
    /// of the decision's clock `now`; a state expired by the store's clock
    /// `store_now` is not kept. Returns whether a new key was stored.
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
    ) -> bool {
        let p = check.limit.params();
        let write = (write && check.cost > 0) || moved;
        match found {
            Found::Live(i) | Found::Expired(i) if write => {
                if let Some(slot) = table.slot_mut(i) {
                    let expires_at = state.save_into(p, now, &mut slot.stored);
                    slot.written = now;
                    if expires_at <= store_now && table.remove(i, &self.hasher).is_some() {
                        self.forget(1);
                    }
                }
                false
            }
            Found::Live(i) => {
                if let Some(slot) = table.slot_mut(i) {
                    state.restore(&mut slot.stored);
                }
                false
            }
            Found::Expired(i) => {
                if table.remove(i, &self.hasher).is_some() {
                    self.forget(1);
                }
                false
            }
            Found::Shared | Found::Absent if write => {
                let (stored, expires_at) = state.save_new(p, now);
                if expires_at <= store_now {
                    return false;
                }
                let slot = Slot {
                    key: Key::from_slice(check.key),
                    written: now,
                    stored,
                };
                match self.insert(table, hash, slot, store_now) {
                    Ok(()) => true,
                    // full: the grant goes to the shared state, which then
                    // holds it (it was live and copied, or equal to fresh)
                    Err(mut slot) => {
                        if !self.full_warned.swap(true, Ordering::Relaxed) {
                            tracing::warn!(
                                target: "tower_ratelimit",
                                max_keys = self.max_keys,
                                "the memory store is full: keys not stored share one state per \
                                 limit and shard until room is made (logged once per store)"
                            );
                        }
                        slot.key = Key::new();
                        table.overflow = Some(slot);
                        false
                    }
                }
            }
            Found::Shared | Found::Absent => false,
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
