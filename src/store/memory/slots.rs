//! Slots kept densely in fixed-size chunks, found by a `hashbrown` index
//! of `u32` slot numbers by the hash of their key, so that memory follows
//! the number of slots rather than the index's load factor, and a full
//! store compares a few from a cursor: a rate table's states (`table.rs`)
//! and a shard's penalty states (`pens.rs`).

use hashbrown::HashTable;

use super::key::{Hasher, Key};

/// Slots per chunk.
const CHUNK: usize = 1024;

/// A slot, found by the hash of its key.
pub(super) trait Keyed {
    fn key(&self) -> &Key;
}

/// Slots `0..len`, `CHUNK` per chunk; only the last chunk is partly used.
pub(super) struct Slots<S> {
    /// Slot numbers, found by the key's hash.
    index: HashTable<u32>,
    pub(super) chunks: Vec<Vec<S>>,
    pub(super) len: usize,
    /// Where the next look from the cursor starts.
    pub(super) cursor: usize,
}

impl<S> Default for Slots<S> {
    fn default() -> Self {
        Self {
            index: HashTable::new(),
            chunks: Vec::new(),
            len: 0,
            cursor: 0,
        }
    }
}

impl<S: Keyed> Slots<S> {
    #[inline]
    pub(super) fn get(&self, i: usize) -> Option<&S> {
        self.chunks.get(i / CHUNK)?.get(i % CHUNK)
    }

    #[inline]
    pub(super) fn get_mut(&mut self, i: usize) -> Option<&mut S> {
        self.chunks.get_mut(i / CHUNK)?.get_mut(i % CHUNK)
    }

    /// The slot of hash `hash` that is `eq`.
    #[inline]
    pub(super) fn find(&self, hash: u64, eq: impl Fn(&S) -> bool) -> Option<usize> {
        let found = self
            .index
            .find(hash, |&i| self.get(i as usize).is_some_and(&eq))?;
        Some(*found as usize)
    }

    /// Appends a slot, or gives it back if slot numbers ran out.
    pub(super) fn push(&mut self, hash: u64, slot: S, hasher: &Hasher) -> Result<(), S> {
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
    pub(super) fn remove(&mut self, i: usize, hasher: &Hasher) -> Option<S> {
        let hash = hasher.hash(self.get(i)?.key());
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
        let moved_hash = hasher.hash(last.key());
        let from = self.len;
        if let Some(number) = self.index.find_mut(moved_hash, |&j| j as usize == from) {
            // `i` < `from` <= u32::MAX: it fits.
            *number = u32::try_from(i).unwrap_or(u32::MAX);
        }
        let hole = self.get_mut(i)?;
        Some(std::mem::replace(hole, last))
    }

    /// Of up to `n` slots from the cursor (which moves `n` on), the one
    /// `rank` ranks first (the smallest, on a tie the first; one ranked
    /// `None` is passed over), and where it is.
    pub(super) fn first_of<R: PartialOrd>(
        &mut self,
        n: usize,
        mut rank: impl FnMut(&mut S) -> Option<R>,
    ) -> Option<(R, usize)> {
        if self.len == 0 {
            return None;
        }
        let start = self.cursor % self.len;
        let mut best: Option<(R, usize)> = None;
        for k in 0..n.min(self.len) {
            let i = (start + k) % self.len;
            let Some(r) = self.get_mut(i).and_then(&mut rank) else {
                continue;
            };
            if best.as_ref().is_none_or(|(b, _)| r < *b) {
                best = Some((r, i));
            }
        }
        self.cursor = (start + n) % self.len;
        best
    }

    /// Gives back the index's memory once most of its slots are gone.
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
fn rehash<S: Keyed>(chunks: &[Vec<S>], j: u32, hasher: &Hasher) -> u64 {
    let j = j as usize;
    chunks
        .get(j / CHUNK)
        .and_then(|chunk| chunk.get(j % CHUNK))
        .map_or(0, |slot| hasher.hash(slot.key()))
}
