//! The compact forms of a limit's bans in one shard (see `pens.rs`), kept
//! when a full penalty state cannot be:
//! - [`Records`]: a ban given up as a full state (its key, its counts)
//!   kept as its key's hash and the block's end, 16 bytes; the store
//!   counts [`RECORDS_PER_STATE`] of them as one state (see
//!   `Penalties::record`);
//! - [`Buckets`]: when no record can be stored either, the penalty state
//!   of a bucket of the key hash (the keys of this shard whose hash has
//!   the same top [`BUCKET_BITS`] bits, 1/2^21 of a limit's keys), which
//!   the keys of the bucket without a state of their own share; at most
//!   [`BUCKETS`] per limit and shard, so that blocked buckets reach at most
//!   `32 * BUCKETS / 2^21` (1/8192) of a limit's keys.

use hashbrown::HashTable;

use crate::penalty::PenState;

/// Ban records the store counts as one state: a record is 16 bytes in a
/// hash table (about 18 to 37 with the table's slack), a full penalty
/// state about 100 (its key, name, four integers, its index).
pub(super) const RECORDS_PER_STATE: usize = 4;

/// The bits of the key's hash that name its bucket.
const BUCKET_BITS: u32 = 16;

/// Buckets with a penalty state per limit and shard.
pub(super) const BUCKETS: usize = 8;

/// The end of a block, and its offences, in one word: a block ends before
/// 2^53 us (see `crate::penalty`), offences above.
const UNTIL_BITS: u32 = 53;
const UNTIL_MASK: u64 = (1 << UNTIL_BITS) - 1;

/// A ban kept as its key's hash.
#[derive(Clone, Copy)]
struct Record {
    hash: u64,
    /// The block's end (low bits) and its offences (high bits).
    packed: u64,
}

impl Record {
    fn new(hash: u64, state: &PenState) -> Self {
        let until = u64::try_from(state.until).unwrap_or(0).min(UNTIL_MASK);
        let offences = u64::try_from(state.offences)
            .unwrap_or(0)
            .min(u64::MAX >> UNTIL_BITS);
        Self {
            hash,
            packed: until | (offences << UNTIL_BITS),
        }
    }

    fn until(self) -> i64 {
        i64::try_from(self.packed & UNTIL_MASK).unwrap_or(0)
    }

    /// The state it keeps: the block and its offences (no refusals
    /// counted; `since` unknown).
    fn state(self) -> PenState {
        PenState {
            until: self.until(),
            offences: i64::try_from(self.packed >> UNTIL_BITS).unwrap_or(0),
            count: 0,
            since: 0,
        }
    }
}

/// One limit's ban records in a shard, by key hash.
#[derive(Default)]
pub(super) struct Records(HashTable<Record>);

/// Whether `state` can be kept as a record: a block in force at `now`, no
/// refusals counted.
pub(super) fn recordable(state: &PenState, now: i64) -> bool {
    state.count == 0 && state.blocked(now).is_some()
}

impl Records {
    /// The ban kept for the key of hash `hash`, while it lasts at `now`.
    pub(super) fn get(&self, hash: u64, now: i64) -> Option<PenState> {
        let record = self.0.find(hash, |r| r.hash == hash)?;
        (record.until() > now).then(|| record.state())
    }

    /// Whether a record (ended or not) is kept for `hash`.
    pub(super) fn contains(&self, hash: u64) -> bool {
        self.0.find(hash, |r| r.hash == hash).is_some()
    }

    /// Keeps `state` for `hash`: whether it is a new record (else it
    /// replaced the one kept).
    pub(super) fn put(&mut self, hash: u64, state: &PenState) -> bool {
        let record = Record::new(hash, state);
        match self.0.find_mut(hash, |r| r.hash == hash) {
            Some(kept) => {
                *kept = record;
                false
            }
            None => {
                self.0.insert_unique(hash, record, |r| r.hash);
                true
            }
        }
    }

    /// Removes the record of `hash`; whether there was one.
    pub(super) fn remove(&mut self, hash: u64) -> bool {
        match self.0.find_entry(hash, |r| r.hash == hash) {
            Ok(entry) => {
                entry.remove();
                true
            }
            Err(_) => false,
        }
    }

    /// Drops the records whose block ended by `now`; returns how many.
    pub(super) fn sweep(&mut self, now: i64) -> usize {
        let before = self.0.len();
        self.0.retain(|r| r.until() > now);
        let removed = before - self.0.len();
        if self.0.capacity() > 4 * self.0.len().max(64) {
            self.0.shrink_to(self.0.len(), |r| r.hash);
        }
        removed
    }
}

/// One bucket's penalty state.
#[derive(Clone, Copy)]
struct Bucket {
    id: u64,
    state: PenState,
    /// When it becomes fresh.
    exp: i64,
    /// When it was last written.
    written: i64,
}

/// One limit's bucket states in a shard (at most [`BUCKETS`]).
#[derive(Default)]
pub(super) struct Buckets(Vec<Bucket>);

/// The bucket of a key's hash.
fn bucket(hash: u64) -> u64 {
    hash >> (64 - BUCKET_BITS)
}

impl Buckets {
    /// The state of the bucket of `hash`, while it lasts at `now`.
    pub(super) fn get(&self, hash: u64, now: i64) -> Option<PenState> {
        let id = bucket(hash);
        let b = self.0.iter().find(|b| b.id == id)?;
        (b.exp > now).then_some(b.state)
    }

    /// Makes `state` (read from the bucket of `hash`, or fresh), fresh at
    /// `exp`, its bucket's, lasting at least as long as the one kept: in
    /// the room of a bucket state that blocks no one at `now` when
    /// [`BUCKETS`] are kept (the one written longest ago). Whether it was
    /// kept (not when every bucket state kept is a block in force).
    pub(super) fn put(&mut self, hash: u64, state: PenState, exp: i64, now: i64) -> bool {
        let id = bucket(hash);
        let new = Bucket {
            id,
            state,
            exp,
            written: now,
        };
        if let Some(b) = self.0.iter_mut().find(|b| b.id == id) {
            let exp = if b.exp > now { b.exp.max(exp) } else { exp };
            *b = Bucket { exp, ..new };
            return true;
        }
        if self.0.len() < BUCKETS {
            self.0.push(new);
            return true;
        }
        let idle = self
            .0
            .iter_mut()
            .filter(|b| b.exp <= now || b.state.blocked(now).is_none())
            .min_by_key(|b| (b.exp > now, b.written));
        match idle {
            Some(b) => {
                *b = new;
                true
            }
            None => false,
        }
    }

    /// Removes the state of the bucket of `hash` if it blocks at `now`;
    /// whether it did.
    pub(super) fn remove(&mut self, hash: u64, now: i64) -> bool {
        let id = bucket(hash);
        let blocks = |b: &Bucket| b.id == id && b.exp > now && b.state.blocked(now).is_some();
        let Some(i) = self.0.iter().position(blocks) else {
            return false;
        };
        self.0.swap_remove(i);
        true
    }

    /// Drops the bucket states that are fresh at `now`.
    pub(super) fn sweep(&mut self, now: i64) {
        self.0.retain(|b| b.exp > now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(until: i64, offences: i64) -> PenState {
        PenState {
            until,
            offences,
            count: 0,
            since: 5,
        }
    }

    /// A record keeps the block's end and its offences, nothing else, and
    /// reads as nothing once the block ended.
    #[test]
    fn a_record_keeps_the_block_and_its_offences() {
        let mut records = Records::default();
        let until = 1_800_000_000_000_000;
        assert!(records.put(7, &block(until, 3)));
        assert_eq!(
            records.get(7, until - 1),
            Some(PenState {
                since: 0,
                ..block(until, 3)
            })
        );
        assert_eq!(records.get(7, until), None);
        assert_eq!(records.get(8, 0), None);
        assert!(!records.put(7, &block(until + 1, 4)), "replaced");
        assert_eq!(records.sweep(until), 0);
        assert_eq!(records.sweep(until + 1), 1);
        assert!(!records.contains(7));
    }

    /// At most `BUCKETS` bucket states: a new bucket takes the room of one
    /// that blocks no one, never of a block in force.
    #[test]
    fn bucket_states_are_bounded_and_keep_their_blocks() {
        let now = 1_000;
        let mut buckets = Buckets::default();
        let key = |i: u64| i << (64 - BUCKET_BITS);
        for i in 0..BUCKETS as u64 {
            assert!(buckets.put(key(i), block(now + 10, 1), now + 10, now));
        }
        assert!(!buckets.put(key(99), block(now + 10, 1), now + 10, now));
        assert_eq!(buckets.get(key(99), now), None);
        // same bucket, another key: shared
        assert!(buckets.get(key(3) + 1, now).is_some());
        assert!(buckets.remove(key(3), now));
        let counted = PenState {
            count: 1,
            since: now,
            ..PenState::default()
        };
        assert!(buckets.put(key(99), counted, now + 5, now));
        assert!(buckets.put(key(100), block(now + 10, 1), now + 10, now + 1));
        assert_eq!(buckets.get(key(99), now + 1), None, "its room taken");
        buckets.sweep(now + 10);
        assert_eq!(buckets.0.len(), 0);
    }
}
