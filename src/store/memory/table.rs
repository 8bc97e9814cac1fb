//! The memory store's tables: one per limit and shard, its states in
//! [`Slots`]; the choice of the state a full store gives up (of the limit
//! `share.rs` names, the one closest to fresh, see
//! [`Shard::nearest_fresh`]), and the shared overflow state of keys that
//! found no state to give up.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::key::{Hasher, Key};
use super::share::{Limits, Look, Usage};
use super::slots::{Keyed, Slots};
use crate::algorithm::Params;
use crate::algorithm::{State, Stored};
use crate::quota::Algorithm;
use crate::Limit;

/// Slots of each table of a shard a full store compares to choose the
/// state it gives up (see `States::give_up`).
pub(super) const SAMPLE: usize = 8;

/// The most quotas a table tells its states' apart by (see
/// [`Table::quotas`]).
const QUOTAS: usize = 64;

/// One key's state under one limit.
pub(super) struct Slot {
    pub(super) key: Key,
    /// The clock of the decision that last wrote the state (`written`, as
    /// in the scripts).
    pub(super) written: i64,
    pub(super) stored: Stored,
    /// The quota that last wrote the state: its place in [`Table::quotas`].
    pub(super) quota: u32,
}

/// The states of one limit (name and algorithm) in one shard.
pub(super) struct Table {
    /// Interned: compared by address.
    pub(super) name: &'static str,
    pub(super) algorithm: Algorithm,
    /// The quotas that wrote its states (a limit's tiers, its values over
    /// time, keys' overrides), each state's own marked in its slot: what a
    /// full store measures the state's use in (see
    /// [`Shard::nearest_fresh`]). At most [`QUOTAS`]: beyond, a state is
    /// measured in the first.
    pub(super) quotas: Vec<Params>,
    /// The states its limit holds in the store, this table's among them.
    pub(super) usage: Arc<Usage>,
    /// Its states (the cursor: where the next sweep step looks).
    pub(super) slots: Slots<Slot>,
    /// The state shared by every key of this table that found the store
    /// full and its shard without a state to give up (its key is empty): it
    /// holds all their grants, so it counts at least what each of them was
    /// granted. While it is live, a key not stored is decided on a copy of
    /// it (see [`MemoryStoreBuilder::max_keys`]); a refusal so decided is
    /// no offence of the key's (see `penalized.rs`).
    pub(super) overflow: Option<Slot>,
    /// A new key's state that found the store full, while the decision
    /// that made it puts its other states back (see `States::write_back`).
    pub(super) waiting: Option<Slot>,
    /// Whether room was made for it (counted in the store's bound).
    pub(super) room: bool,
}

impl Table {
    pub(super) fn new(limit: &Limit, usage: Arc<Usage>) -> Self {
        Self {
            name: limit.shared_name(),
            algorithm: limit.params().algorithm(),
            quotas: vec![*limit.params()],
            usage,
            slots: Slots::default(),
            overflow: None,
            waiting: None,
            room: false,
        }
    }

    /// The slot `found` points at: a stored key's, or the shared overflow.
    #[inline]
    pub(super) fn found(&self, found: Found) -> Option<&Slot> {
        match found {
            Found::Live(i) => self.slots.get(i),
            Found::Shared => self.overflow.as_ref(),
            Found::Expired(_) | Found::Absent => None,
        }
    }

    /// The state `found` points at, prepared for `p` as of `now` (see
    /// [`State::prepare`]), and whether it was moved back. A stored key's
    /// state is moved out; the shared overflow is copied.
    #[inline(always)]
    pub(super) fn prepare(&mut self, found: Found, p: &Params, now: i64) -> (State, bool) {
        match found {
            Found::Live(i) => {
                if let Some(slot) = self.slots.get_mut(i) {
                    return State::prepare(Some(&mut slot.stored), p, slot.written, now);
                }
            }
            Found::Shared => {
                if let Some(shared) = &self.overflow {
                    let mut copy = shared.stored.clone();
                    return State::prepare(Some(&mut copy), p, shared.written, now);
                }
            }
            Found::Expired(_) | Found::Absent => {}
        }
        State::prepare(None, p, now, now)
    }

    #[inline]
    pub(super) fn is_for(&self, limit: &Limit) -> bool {
        self.algorithm == limit.params().algorithm() && std::ptr::eq(self.name, limit.shared_name())
    }

    /// The place of `p` in [`quotas`](Self::quotas), added if new (the
    /// first when they are full).
    pub(super) fn quota_of(&mut self, p: &Params) -> u32 {
        let i = match self.quotas.iter().position(|q| q == p) {
            Some(i) => i,
            None if self.quotas.len() < QUOTAS => {
                self.quotas.push(*p);
                self.quotas.len() - 1
            }
            None => 0,
        };
        u32::try_from(i).unwrap_or(0)
    }

    /// Marks slot `i` as written by `p` (a compare when it was already).
    #[inline]
    pub(super) fn mark(&mut self, i: usize, p: &Params) {
        let Some(slot) = self.slots.get(i) else {
            return;
        };
        if self.quotas.get(slot.quota as usize) == Some(p) {
            return;
        }
        let quota = self.quota_of(p);
        if let Some(slot) = self.slots.get_mut(i) {
            slot.quota = quota;
        }
    }

    #[inline]
    pub(super) fn find(&self, hash: u64, key: &[u8]) -> Option<usize> {
        self.slots.find(hash, |slot| slot.key.as_slice() == key)
    }

    /// Appends a slot, or gives it back if slot numbers ran out.
    pub(super) fn push(&mut self, hash: u64, slot: Slot, hasher: &Hasher) -> Result<(), Slot> {
        self.slots.push(hash, slot, hasher)?;
        self.usage.states.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Removes slot `i`, moving the last slot into its place.
    pub(super) fn remove(&mut self, i: usize, hasher: &Hasher) -> Option<Slot> {
        let slot = self.slots.remove(i, hasher)?;
        self.usage.states.fetch_sub(1, Ordering::AcqRel);
        Some(slot)
    }

    /// Examines up to `n` slots (each at most once) from the cursor and
    /// removes the expired ones; returns how many it examined and removed.
    pub(super) fn sweep(&mut self, n: usize, now: i64, hasher: &Hasher) -> (usize, usize) {
        if self
            .overflow
            .as_ref()
            .is_some_and(|shared| shared.stored.expires_at() <= now)
        {
            self.overflow = None;
        }
        let n = n.min(self.slots.len);
        let (mut examined, mut removed) = (0, 0);
        while examined < n && self.slots.len > 0 {
            if self.slots.cursor >= self.slots.len {
                self.slots.cursor = 0;
            }
            let cursor = self.slots.cursor;
            let expired = self
                .slots
                .get(cursor)
                .is_some_and(|slot| slot.stored.expires_at() <= now);
            if expired && self.remove(cursor, hasher).is_some() {
                removed += 1;
            } else {
                self.slots.cursor += 1;
            }
            examined += 1;
        }
        (examined, removed)
    }

    /// Of up to `n` slots from the cursor (the cursor moves past them), the
    /// one closest to fresh at `now` (see [`Closeness`]).
    fn nearest_fresh(&mut self, n: usize, now: i64) -> Option<(Closeness, usize)> {
        let quotas = &self.quotas;
        self.slots.first_of(n, |slot| {
            let p = quotas.get(slot.quota as usize).or(quotas.first())?;
            Some(closeness(slot, p, now))
        })
    }
}

impl Keyed for Slot {
    fn key(&self) -> &Key {
        &self.key
    }
}

/// How far a state is from fresh, smallest first: the share of its
/// capacity in use (parts per million; more than a million in debt), then
/// its expiry, then its last write (the key seen longest ago). An expired
/// state is closest: forgetting it forgets nothing.
pub(super) type Closeness = (u64, i64, i64);

fn closeness(slot: &mut Slot, p: &Params, now: i64) -> Closeness {
    let expires_at = slot.stored.expires_at();
    if expires_at <= now {
        return (0, i64::MIN, i64::MIN);
    }
    let used = i128::from(slot.stored.used(p, slot.written, now).max(0));
    let capacity = i128::from(p.capacity().max(1));
    let share = u64::try_from(used * 1_000_000 / capacity).unwrap_or(u64::MAX);
    (share, expires_at, slot.written)
}

/// The tables of one shard.
#[derive(Default)]
pub(super) struct Shard {
    pub(super) tables: Vec<Table>,
}

impl Shard {
    /// The table of `limit`, created on first use (tables are never removed,
    /// so a table's position stays valid across lock holds).
    #[inline]
    pub(super) fn table(&mut self, limit: &Limit, limits: &Limits) -> usize {
        if let Some(t) = self.tables.iter().position(|t| t.is_for(limit)) {
            return t;
        }
        self.tables
            .push(Table::new(limit, limits.usage(limit.shared_name())));
        self.tables.len() - 1
    }

    /// The state closest to fresh (see [`Closeness`]) among [`SAMPLE`]
    /// slots of each table of this shard of the limit `of` from its
    /// cursor: its closeness, table and slot, and how many slots were
    /// compared.
    pub(super) fn nearest_fresh(
        &mut self,
        now: i64,
        of: &Usage,
    ) -> Look<Closeness, (usize, usize)> {
        let mut best: Option<(Closeness, (usize, usize))> = None;
        let mut seen = 0;
        for (t, table) in self.tables.iter_mut().enumerate() {
            if !std::ptr::eq(Arc::as_ptr(&table.usage), of) {
                continue;
            }
            seen += table.slots.len.min(SAMPLE);
            if let Some((c, i)) = table.nearest_fresh(SAMPLE, now) {
                if best.is_none_or(|(b, _)| c < b) {
                    best = Some((c, (t, i)));
                }
            }
        }
        (best, seen)
    }

    /// Removes slot `i` of table `t`; whether there was one.
    pub(super) fn give_up(&mut self, t: usize, i: usize, hasher: &Hasher) -> bool {
        self.tables
            .get_mut(t)
            .and_then(|table| table.remove(i, hasher))
            .is_some()
    }
}

/// Where a key's state is in its table.
#[derive(Debug, Clone, Copy)]
pub(super) enum Found {
    /// A live state in this slot.
    Live(usize),
    /// An expired state (read as absent) in this slot.
    Expired(usize),
    /// No state stored, while the table's shared overflow state is live.
    Shared,
    /// No state stored, nor a live overflow state.
    Absent,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Hasher, Key, Limits, Shard, Slot, SAMPLE};
    use crate::algorithm::{Params, State};
    use crate::{Limit, Quota};

    /// A slot of `key` that spent `used` of `limit`'s quota at `now`.
    fn spent(limit: &Limit, key: &str, used: i64, now: i64) -> Slot {
        let p: &Params = limit.params();
        let (mut state, _) = State::prepare(None, p, now, now);
        let mut ops = [crate::algorithm::Operand {
            state,
            p,
            cost: used,
        }];
        crate::algorithm::decide(&mut ops, now, 0, false);
        let [op] = ops;
        state = op.state;
        let (stored, _) = state.save_new(p, now);
        Slot {
            key: Key::from_slice(key.as_bytes()),
            written: now,
            stored,
            quota: 0,
        }
    }

    /// A full store gives up, of the states it compares of the limit it
    /// takes from, the one with the smallest share of its capacity in use,
    /// whatever the algorithm, and one expired before any; another limit's
    /// states are not compared.
    #[test]
    fn the_state_given_up_is_the_one_closest_to_fresh() {
        let minute = Duration::from_secs(60);
        let hasher = Hasher::default();
        let now = 1_800_000_000_000_000;
        for quota in [
            Quota::rate(10, minute).sliding_log(),
            Quota::rate(10, minute).allow_burst(10).token_bucket(),
            Quota::rate(10, minute).allow_burst(10).gcra(),
            Quota::rate(10, minute).fixed_window(),
            Quota::rate(10, minute).sliding_window(),
        ] {
            let limit = Limit::new("l", quota).expect("limit");
            let other =
                Limit::new("o", Quota::rate(100, minute).allow_burst(100).gcra()).expect("limit");
            let limits = Limits::default();
            let mut shard = Shard::default();
            let (t, o) = (shard.table(&limit, &limits), shard.table(&other, &limits));
            let (of_l, of_o) = (shard.tables[t].usage.clone(), shard.tables[o].usage.clone());
            for (key, used) in [("a", 9), ("b", 4), ("c", 10), ("d", 7)] {
                let slot = spent(&limit, key, used, now);
                let table = &mut shard.tables[t];
                assert!(table
                    .push(hasher.hash(key.as_bytes()), slot, &hasher)
                    .is_ok());
            }
            // 1 of 100: a smaller share than b's 4 of 10, of another limit
            let slot = spent(&other, "e", 1, now);
            assert!(shard.tables[o]
                .push(hasher.hash(b"e"), slot, &hasher)
                .is_ok());
            let (best, seen) = shard.nearest_fresh(now, &of_l);
            assert_eq!(seen, 4.min(SAMPLE), "{quota:?}");
            let (_, (bt, bi)) = best.expect("a state to give up");
            assert_eq!(
                (bt, shard.tables[t].slots.get(bi).map(|s| s.key.as_slice())),
                (t, Some(&b"b"[..])),
                "{quota:?}"
            );
            assert!(shard.give_up(bt, bi, &hasher));
            assert_eq!(of_l.states.load(std::sync::atomic::Ordering::Acquire), 3);
            // then d (70%): never c, spent, while another is left
            let (best, _) = shard.nearest_fresh(now, &of_l);
            let (_, (bt, bi)) = best.expect("a state to give up");
            let key = shard.tables[bt].slots.get(bi).map(|s| s.key.as_slice());
            assert_eq!((bt, key), (t, Some(&b"d"[..])), "{quota:?}");
            let (best, _) = shard.nearest_fresh(now, &of_o);
            assert_eq!(best.map(|(_, (bt, _))| bt), Some(o), "{quota:?}");
            // long after: every state is expired, the first compared goes
            let (best, _) = shard.nearest_fresh(now + 3_600_000_000, &of_l);
            assert_eq!(
                best.map(|(c, _)| c),
                Some((0, i64::MIN, i64::MIN)),
                "{quota:?}"
            );
        }
    }
}
