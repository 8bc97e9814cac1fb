//! A user key as the memory store keeps it, and the hash that finds its
//! shard and slot.

use smallvec::SmallVec;

use super::SHARDS;

/// A user key: stored inline up to 24 bytes, on the heap beyond.
pub(super) type Key = SmallVec<[u8; 24]>;

/// Randomly keyed foldhash: crafted keys cannot all land in one bucket.
#[derive(Default)]
pub(super) struct Hasher(foldhash::quality::RandomState);

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

/// One `T` per shard, each under a lock of its own.
pub(super) fn shards<T: Default>() -> Box<[std::sync::Mutex<T>]> {
    (0..SHARDS).map(|_| Default::default()).collect()
}
