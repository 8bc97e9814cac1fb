//! One shard's penalty states (see `penalized.rs`), by limit name and key,
//! in [`Slots`] (as the rate tables); and per limit, the block shared by
//! its keys the shard could not keep on their own.

use std::sync::atomic::Ordering;
use std::sync::Arc;

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

/// One limit's penalty states in a shard: its usage, and the block shared
/// by its keys the shard could not keep on their own.
struct PenLimit {
    usage: Arc<Usage>,
    shared: Option<(PenState, i64)>,
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

    /// The state of `key` under `name` at `now`: fresh when absent or
    /// expired; a key not kept on its own reads its limit's shared block,
    /// if one lasts.
    pub(super) fn state(&self, hash: u64, name: &'static str, key: &[u8], now: i64) -> PenState {
        match self.find(hash, name, key) {
            Some(i) => self
                .slots
                .get(i)
                .filter(|s| s.exp > now)
                .map_or_else(PenState::default, |s| s.state),
            None if self.limits.is_empty() => PenState::default(),
            None => match self.limit(name).and_then(|l| l.shared) {
                Some((state, exp)) if exp > now => state,
                _ => PenState::default(),
            },
        }
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

    /// Gives up slot `i` for a new state: a block still active goes to its
    /// limit's shared block (the keys not kept on their own are then
    /// refused with it: no ban is dropped). `None` when there is no such
    /// slot, else whether a block went to the shared one.
    pub(super) fn give_up(
        &mut self,
        shares: &Limits,
        i: usize,
        now: i64,
        hasher: &Hasher,
    ) -> Option<bool> {
        let slot = self.remove(i, hasher)?;
        if slot.state.blocked(now).is_none() {
            return Some(false);
        }
        let limit = self.limit_mut(shares, slot.name);
        limit.shared = Some(match limit.shared.filter(|(_, exp)| *exp > now) {
            Some((shared, exp)) => (merged(shared, slot.state), exp.max(slot.exp)),
            None => (slot.state, slot.exp),
        });
        Some(true)
    }

    /// Makes `state`, fresh at `exp`, the block `name`'s keys share (it was
    /// read from it, or is fresh), lasting at least as long as the one that
    /// lasts at `now`.
    pub(super) fn share(
        &mut self,
        shares: &Limits,
        name: &'static str,
        state: PenState,
        exp: i64,
        now: i64,
    ) {
        let limit = self.limit_mut(shares, name);
        let exp = limit
            .shared
            .filter(|(_, e)| *e > now)
            .map_or(exp, |(_, e)| e.max(exp));
        limit.shared = Some((state, exp));
    }

    /// Drops the states that are fresh at `now` (and shared blocks that
    /// ended); returns how many states.
    pub(super) fn sweep(&mut self, now: i64, hasher: &Hasher) -> usize {
        for limit in &mut self.limits {
            if limit.shared.is_some_and(|(_, exp)| exp <= now) {
                limit.shared = None;
            }
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
        removed
    }

    fn limit(&self, name: &'static str) -> Option<&PenLimit> {
        self.limits
            .iter()
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
                    shared: None,
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

/// A block `b` added to the shared `a`: the later end, the more offences.
fn merged(a: PenState, b: PenState) -> PenState {
    PenState {
        until: a.until.max(b.until),
        offences: a.offences.max(b.offences),
        ..a
    }
}

impl Keyed for PenSlot {
    fn key(&self) -> &Key {
        &self.key
    }
}
