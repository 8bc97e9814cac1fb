//! One shard's penalty states (see `penalized.rs`), by limit name and key,
//! in [`Slots`] (as the rate tables); and per limit, the compact forms of
//! the bans the shard could not keep as full states (`bans.rs`): ban
//! records, and the states of buckets of the key hash.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::bans::{Buckets, Records};
use super::key::{Hasher, Key};
use super::share::{Limits, Look, Usage};
use super::slots::{Keyed, Slots};
use crate::penalty::PenState;

/// Penalty states of each shard a full penalty half compares, to choose
/// the one it gives up (see `Penalties::give_up`).
pub(super) const PEN_SAMPLE: usize = 32;

/// One key's penalty state under one limit.
pub(super) struct PenSlot {
    /// Interned: compared by address.
    pub(super) name: &'static str,
    pub(super) key: Key,
    pub(super) state: PenState,
    /// When it becomes fresh (store time, us).
    pub(super) exp: i64,
    /// When it was last written (store time, us).
    pub(super) written: i64,
}

/// One limit's penalty states in a shard: its usage, its ban records and
/// its buckets' states.
struct PenLimit {
    usage: Arc<Usage>,
    records: Records,
    buckets: Buckets,
}

/// One shard's penalty states.
#[derive(Default)]
pub(super) struct PenShard {
    slots: Slots<PenSlot>,
    limits: Vec<PenLimit>,
}

/// How early a penalty state is given up: (0) a count of refusals only,
/// (1) an ended block, (2) an active block; then the one written longest
/// ago.
pub(super) type Rank = (u8, i64);

impl PenShard {
    pub(super) fn find(&self, hash: u64, name: &'static str, key: &[u8]) -> Option<usize> {
        self.slots.find(hash, |s| {
            std::ptr::eq(s.name, name) && s.key.as_slice() == key
        })
    }

    pub(super) fn get_mut(&mut self, i: usize) -> Option<&mut PenSlot> {
        self.slots.get_mut(i)
    }

    /// The state of `key` (of hash `hash`) under `name` at `now`: fresh
    /// when absent or expired; a key without a full state reads its ban
    /// record, else its bucket's state, if one lasts.
    pub(super) fn state(&self, hash: u64, name: &'static str, key: &[u8], now: i64) -> PenState {
        match self.find(hash, name, key) {
            Some(i) => self
                .slots
                .get(i)
                .filter(|s| s.exp > now)
                .map_or_else(PenState::default, |s| s.state),
            None if self.limits.is_empty() => PenState::default(),
            None => self
                .limit(name)
                .and_then(|l| {
                    l.records
                        .get(hash, now)
                        .or_else(|| l.buckets.get(hash, now))
                })
                .unwrap_or_default(),
        }
    }

    /// Whether the key of hash `hash` has a ban record under `name` (ended
    /// or not).
    pub(super) fn has_record(&self, name: &'static str, hash: u64) -> bool {
        self.limit(name).is_some_and(|l| l.records.contains(hash))
    }

    /// Keeps `state` (see [`bans::recordable`](super::bans::recordable))
    /// as the ban record of the key of hash `hash` under `name`; whether it
    /// is a new record (else it replaced one).
    pub(super) fn record(
        &mut self,
        shares: &Limits,
        name: &'static str,
        hash: u64,
        state: &PenState,
    ) -> bool {
        self.limit_mut(shares, name).records.put(hash, state)
    }

    /// Removes the ban record of the key of hash `hash` under `name`;
    /// whether there was one.
    pub(super) fn unrecord(&mut self, name: &'static str, hash: u64) -> bool {
        self.limit_mut_of(name)
            .is_some_and(|l| l.records.remove(hash))
    }

    /// Makes `state`, fresh at `exp`, the state of the bucket of `hash`
    /// under `name` (see [`Buckets::put`]); whether it was kept.
    pub(super) fn put_in_bucket(
        &mut self,
        shares: &Limits,
        name: &'static str,
        hash: u64,
        state: PenState,
        exp: i64,
        now: i64,
    ) -> bool {
        let buckets = &mut self.limit_mut(shares, name).buckets;
        buckets.put(hash, state, exp, now)
    }

    /// Removes the state of the bucket of `hash` under `name` if it blocks
    /// at `now`; whether it did.
    pub(super) fn unbucket(&mut self, name: &'static str, hash: u64, now: i64) -> bool {
        self.limit_mut_of(name)
            .is_some_and(|l| l.buckets.remove(hash, now))
    }

    /// Adds a slot (its limit's usage from `shares`); whether there was
    /// room (slot numbers may run out).
    pub(super) fn insert(
        &mut self,
        shares: &Limits,
        hash: u64,
        slot: PenSlot,
        hasher: &Hasher,
    ) -> bool {
        let name = slot.name;
        if self.slots.push(hash, slot, hasher).is_err() {
            return false;
        }
        let usage = &self.limit_mut(shares, name).usage;
        usage.pens.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Removes slot `i`, moving the last slot into its place.
    pub(super) fn remove(&mut self, i: usize, hasher: &Hasher) -> Option<PenSlot> {
        let slot = self.slots.remove(i, hasher)?;
        if let Some(l) = self.limit(slot.name) {
            l.usage.pens.fetch_sub(1, Ordering::AcqRel);
        }
        Some(slot)
    }

    /// Of up to [`PEN_SAMPLE`] slots from the cursor (which moves past
    /// them), the one of `of` to give up first: a count of refusals only,
    /// then an ended block, the one written longest ago first, then an
    /// active block (see [`Rank`]); and how many were compared.
    pub(super) fn first_to_give_up(&mut self, of: &Usage, now: i64) -> Look<Rank, usize> {
        let n = PEN_SAMPLE.min(self.slots.len);
        let of = |s: &mut PenSlot| std::ptr::eq(s.name, of.name).then(|| rank(s, now));
        (self.slots.first_of(n, of), n)
    }

    /// Gives up slot `i` for a new state: a block in force is kept as its
    /// key's ban record (no ban is dropped; its refusals counted and its
    /// offences' memory past the block are). `None` when there is no such
    /// slot, else whether it made a new record.
    pub(super) fn give_up(
        &mut self,
        shares: &Limits,
        i: usize,
        now: i64,
        hasher: &Hasher,
    ) -> Option<bool> {
        let slot = self.remove(i, hasher)?;
        // (a state dated ahead, moved back first: a record keeps no date)
        let mut state = slot.state;
        state.dated(now);
        if state.blocked(now).is_none() {
            return Some(false);
        }
        let hash = hasher.hash(&slot.key);
        Some(self.record(shares, slot.name, hash, &state))
    }

    /// Drops the states that are fresh at `now`, the ban records whose
    /// block ended and the bucket states that are fresh; returns how many
    /// states, and how many records.
    pub(super) fn sweep(&mut self, now: i64, hasher: &Hasher) -> (usize, usize) {
        let mut records = 0;
        for limit in &mut self.limits {
            records += limit.records.sweep(now);
            limit.buckets.sweep(now);
        }
        let mut removed = 0;
        let mut i = 0;
        while i < self.slots.len {
            if self.slots.get(i).is_some_and(|s| s.exp <= now) && self.remove(i, hasher).is_some() {
                removed += 1;
            } else {
                i += 1;
            }
        }
        (removed, records)
    }

    fn limit(&self, name: &'static str) -> Option<&PenLimit> {
        self.limits
            .iter()
            .find(|l| std::ptr::eq(l.usage.name, name))
    }

    fn limit_mut_of(&mut self, name: &'static str) -> Option<&mut PenLimit> {
        self.limits
            .iter_mut()
            .find(|l| std::ptr::eq(l.usage.name, name))
    }

    fn limit_mut(&mut self, shares: &Limits, name: &'static str) -> &mut PenLimit {
        let at = match self
            .limits
            .iter()
            .position(|l| std::ptr::eq(l.usage.name, name))
        {
            Some(at) => at,
            None => {
                self.limits.push(PenLimit {
                    usage: shares.usage(name),
                    records: Records::default(),
                    buckets: Buckets::default(),
                });
                self.limits.len() - 1
            }
        };
        &mut self.limits[at]
    }
}

fn rank(slot: &PenSlot, now: i64) -> Rank {
    let class = match slot.state.until {
        0 => 0,
        until if until <= now => 1,
        _ => 2,
    };
    (class, slot.written)
}

impl Keyed for PenSlot {
    fn key(&self) -> &Key {
        &self.key
    }
}
