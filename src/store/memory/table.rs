//! The memory store's tables: one per limit and shard, a `hashbrown`
//! index of `u32` slot numbers over slots kept densely in fixed-size
//! chunks, and the shared overflow state of keys that found the store full.

use hashbrown::HashTable;
use smallvec::SmallVec;

use super::SHARDS;
use crate::algorithm::Params;
use crate::algorithm::{State, Stored};
use crate::quota::Algorithm;
use crate::Limit;

/// Slots per chunk of a table's slot storage.
const CHUNK: usize = 1024;

/// A user key: stored inline up to 24 bytes, on the heap beyond.
pub(super) type Key = SmallVec<[u8; 24]>;

/// One key's state under one limit.
pub(super) struct Slot {
    pub(super) key: Key,
    /// The clock of the decision that last wrote the state (`written`, as
    /// in the scripts).
    pub(super) written: i64,
    pub(super) stored: Stored,
}

/// The states of one limit (name and algorithm) in one shard.
pub(super) struct Table {
    /// Interned: compared by address.
    pub(super) name: &'static str,
    pub(super) algorithm: Algorithm,
    /// Slot numbers, found by the key's hash.
    pub(super) index: HashTable<u32>,
    /// Slots `0..len`, `CHUNK` per chunk; only the last chunk is partly used.
    pub(super) chunks: Vec<Vec<Slot>>,
    pub(super) len: usize,
    /// Where the next sweep step looks.
    pub(super) cursor: usize,
    /// The state shared by every key of this table that found the store
    /// full (its key is empty): it holds all their grants, so it counts at
    /// least what each of them was granted. While it is live, a key not
    /// stored is decided on a copy of it (see
    /// [`MemoryStoreBuilder::max_keys`]).
    pub(super) overflow: Option<Slot>,
}

impl Table {
    pub(super) fn new(limit: &Limit) -> Self {
        Self {
            name: limit.shared_name(),
            algorithm: limit.params().algorithm(),
            index: HashTable::new(),
            chunks: Vec::new(),
            len: 0,
            cursor: 0,
            overflow: None,
        }
    }

    /// The slot `found` points at: a stored key's, or the shared overflow.
    #[inline]
    pub(super) fn found(&self, found: Found) -> Option<&Slot> {
        match found {
            Found::Live(i) => self.slot(i),
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
                if let Some(slot) = self.slot_mut(i) {
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

    #[inline]
    pub(super) fn slot(&self, i: usize) -> Option<&Slot> {
        self.chunks.get(i / CHUNK)?.get(i % CHUNK)
    }

    #[inline]
    pub(super) fn slot_mut(&mut self, i: usize) -> Option<&mut Slot> {
        self.chunks.get_mut(i / CHUNK)?.get_mut(i % CHUNK)
    }

    #[inline]
    pub(super) fn find(&self, hash: u64, key: &[u8]) -> Option<usize> {
        let found = self.index.find(hash, |&i| {
            self.slot(i as usize)
                .is_some_and(|slot| slot.key.as_slice() == key)
        })?;
        Some(*found as usize)
    }

    /// Appends a slot, or gives it back if slot numbers ran out.
    pub(super) fn push(&mut self, hash: u64, slot: Slot, hasher: &Hasher) -> Result<(), Slot> {
        let Ok(i) = u32::try_from(self.len) else {
            return Err(slot);
        };
        match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < CHUNK => chunk.push(slot),
            _ => self.chunks.push(vec![slot]),
        }
        self.len += 1;
        let chunks = &self.chunks;
        self.index
            .insert_unique(hash, i, |&j| rehash(chunks, j, hasher));
        Ok(())
    }

    /// Removes slot `i`, moving the last slot into its place.
    pub(super) fn remove(&mut self, i: usize, hasher: &Hasher) -> Option<Slot> {
        let hash = hasher.hash(&self.slot(i)?.key);
        if let Ok(entry) = self.index.find_entry(hash, |&j| j as usize == i) {
            entry.remove();
        }
        let last = self.chunks.last_mut()?.pop()?;
        // The first chunk stays (a key coming and going reuses it); `shrink`
        // frees it once the table is empty.
        if self.chunks.len() > 1 && self.chunks.last().is_some_and(Vec::is_empty) {
            self.chunks.pop();
        }
        self.len -= 1;
        if i == self.len {
            return Some(last);
        }
        let moved_hash = hasher.hash(&last.key);
        let from = self.len;
        if let Some(number) = self.index.find_mut(moved_hash, |&j| j as usize == from) {
            // `i` < `from` <= u32::MAX: it fits.
            *number = u32::try_from(i).unwrap_or(u32::MAX);
        }
        let hole = self.slot_mut(i)?;
        Some(std::mem::replace(hole, last))
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
        let n = n.min(self.len);
        let (mut examined, mut removed) = (0, 0);
        while examined < n && self.len > 0 {
            if self.cursor >= self.len {
                self.cursor = 0;
            }
            let expired = self
                .slot(self.cursor)
                .is_some_and(|slot| slot.stored.expires_at() <= now);
            if expired && self.remove(self.cursor, hasher).is_some() {
                removed += 1;
            } else {
                self.cursor += 1;
            }
            examined += 1;
        }
        (examined, removed)
    }

    /// Gives back the index's memory once most of its keys are gone.
    pub(super) fn shrink(&mut self, hasher: &Hasher) {
        if self.len == 0 {
            self.chunks = Vec::new();
        }
        if self.index.capacity() > 4 * self.len.max(64) {
            let chunks = &self.chunks;
            self.index
                .shrink_to(self.len, |&j| rehash(chunks, j, hasher));
        }
    }
}

/// The hash of slot `j`'s key, for the index's own rehashing.
pub(super) fn rehash(chunks: &[Vec<Slot>], j: u32, hasher: &Hasher) -> u64 {
    let j = j as usize;
    chunks
        .get(j / CHUNK)
        .and_then(|chunk| chunk.get(j % CHUNK))
        .map_or(0, |slot| hasher.hash(&slot.key))
}

#[derive(Default)]
pub(super) struct Shard {
    pub(super) tables: Vec<Table>,
    /// The overrides of this shard's keys (see `kept.rs`).
    pub(super) overrides: super::kept::Overrides,
}

impl Shard {
    /// The table of `limit`, created on first use (tables are never removed,
    /// so a table's position stays valid across lock holds).
    #[inline]
    pub(super) fn table(&mut self, limit: &Limit) -> usize {
        if let Some(t) = self.tables.iter().position(|t| t.is_for(limit)) {
            return t;
        }
        self.tables.push(Table::new(limit));
        self.tables.len() - 1
    }
}

/// Randomly keyed foldhash: crafted keys cannot all land in one bucket.
pub(super) struct Hasher(pub(super) foldhash::quality::RandomState);

impl Hasher {
    #[inline]
    pub(super) fn hash(&self, key: &[u8]) -> u64 {
        use std::hash::BuildHasher;
        self.0.hash_one(key)
    }

    /// The shard of a hash: bits the tables' own indexing does not use.
    pub(super) fn shard(hash: u64) -> usize {
        (hash >> 32) as usize % SHARDS
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
