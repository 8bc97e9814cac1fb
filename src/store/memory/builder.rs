//! Configuring a [`MemoryStore`]: its bound on keys, sweep interval and
//! clock.

use std::sync::Arc;
use std::time::Duration;

use super::MemoryStore;
use crate::clock::Clock;
use crate::ConfigError;

/// Configures a [`MemoryStore`].
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::MemoryStore;
///
/// let store = MemoryStore::builder()
///     .max_keys(100_000)
///     .sweep_interval(Duration::from_secs(5))
///     .build()?;
/// assert!(store.is_empty());
/// # Ok::<(), tower_ratelimit::ConfigError>(())
/// ```
#[must_use]
pub struct MemoryStoreBuilder {
    pub(super) clock: Arc<dyn Clock>,
    pub(super) max_keys: usize,
    pub(super) sweep_interval: Duration,
}

impl std::fmt::Debug for MemoryStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStoreBuilder")
            .field("max_keys", &self.max_keys)
            .field("sweep_interval", &self.sweep_interval)
            .finish()
    }
}

impl MemoryStoreBuilder {
    /// The default bound on stored key states (1,000,000): see
    /// [`max_keys`](Self::max_keys).
    pub const DEFAULT_MAX_KEYS: usize = 1_000_000;
    /// The default pause between background sweeps (1 s): see
    /// [`sweep_interval`](Self::sweep_interval).
    pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(1);

    /// The clock decisions read (default:
    /// [`SystemClock`](crate::SystemClock)), e.g. a [`crate::ManualClock`]
    /// in tests.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The most key states the store holds (one per key and limit; default
    /// [`DEFAULT_MAX_KEYS`](Self::DEFAULT_MAX_KEYS), about 100 MB of GCRA
    /// states: far more clients than one process serves within a window,
    /// and a ceiling on what a flood of made-up keys can take). From 1 to
    /// `u32::MAX`.
    ///
    /// At the bound, a new key first reclaims expired states of its table.
    /// If the store is still full, it takes the place of a state of the
    /// limit (by name) that holds the most rate states, its own limit
    /// counted with the new key and preferred on a tie. Each limit so owns
    /// a share: a limit is never given up for another limit's key while it
    /// holds no more states than that limit will, so a limit within its fair
    /// share (the rate states over the limits that hold some) keeps its
    /// states whatever another limit is flooded with, and a flood gives up
    /// its own. Size `max_keys` so that each limit's live keys fit in that
    /// share. Of that limit's states it gives up the one closest to fresh
    /// among 8 of each of its tables in the new key's shard (one of the
    /// store's 32) and the next shards, 16 at least, each table examined
    /// from where the last search stopped: the one with the smallest share
    /// of its capacity in use, measured in the quota that last wrote it (a
    /// tier's, a live limit's current value, a key's override: up to 64
    /// quotas per limit and shard, beyond which the first is used), then
    /// the earliest expiry, then the key seen longest ago. A state given up
    /// is forgotten: its key, seen again, starts fresh. So a flood of
    /// made-up keys that each sent a little takes the place of its own
    /// states, and new clients keep their whole quota while it lasts;
    /// memory stays bounded whatever keys clients make up.
    ///
    /// The bound this costs: within the time a state covers (its window,
    /// or its capacity's refill), a key is granted at most its quota plus,
    /// for each time its state was given up, what that state had used; and
    /// a state is given up only while its limit holds the most states and
    /// 7 others of its table in the sample (and its other tables' 8) hold
    /// as large a share of their capacity in use, or more. A key that spent
    /// its quota is therefore forgotten only once its limit's share is full
    /// of keys that spent theirs as well. A concurrency limit's lease
    /// states are rate states of a sliding log: a lease state given up
    /// frees its permits early.
    ///
    /// Penalty states (see [`Limit::with_penalty`](crate::Limit::with_penalty))
    /// count in the bound and take at most half of it, so that no flood of
    /// them (made-up keys refused until blocked) leaves new clients without
    /// room; a new one in a full store takes the place of a rate state (of
    /// the limit that holds the most). Once they take half, a new one
    /// takes the place of a penalty state of the limit that holds the most
    /// (its own preferred on a tie): of those compared (32 per shard, 64 at
    /// least), first one that only counts refusals, then an ended block,
    /// the one written longest ago first, then an active block. An active
    /// block is never dropped: it is kept as a ban record of 16 bytes (its
    /// key's hash, the block's end and its offences; its refusals counted
    /// and its offences' memory after the block are given up), 4 records
    /// counted as one state. So the half holds up to `4 * (max_keys / 2)`
    /// bans (2,000 for a bound of 1,000), fewer while it holds refusal
    /// counts. Beyond, a new ban (or count of refusals) goes to the state
    /// its key's bucket shares (the keys of its shard whose hash has the
    /// same top 16 bits: 1/2^21 of a limit's keys, read by those without a
    /// state of their own), at most 8 per limit and shard holding a block
    /// (about 14 KB per limit, outside the bound): so blocks no key has on
    /// its own refuse at most 1/8192 of a limit's other keys. Beyond that,
    /// it is not stored: the key is held to the limit's quota alone, and not
    /// told it is blocked. A block by hand is not put in a bucket: it fails
    /// with [`Error::PenaltyNotStored`](crate::Error::PenaltyNotStored).
    /// Both are counted (see
    /// [`PENALTIES_NOT_STORED`](crate::metrics::PENALTIES_NOT_STORED)) and
    /// logged. Only when no rate state could be given up at once (the limit
    /// to give up one is the new key's own and holds none, as a limit
    /// without rate states beside limits that each hold their share of a
    /// bound of a few states; or none was found, the other shards busy), a
    /// new key's grant is recorded in a state shared per limit and shard
    /// (not counted in the bound) on which keys not stored are decided
    /// while it holds grants: it only over-counts. A refusal decided on
    /// that shared state is no offence of the key's (it counts towards no
    /// penalty): the state holds other keys' grants, and the key's own,
    /// not stored, is fresh (in Redis, where every key has its own state,
    /// the key is granted). So a key is banned only for refusals of its own
    /// state, on both stores; a key not stored is refused by the shared
    /// state but not banned while it is decided there.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The pause between background sweeps of expired states (default
    /// [`DEFAULT_SWEEP_INTERVAL`](Self::DEFAULT_SWEEP_INTERVAL)). Expired
    /// states are never read (they decide as fresh ones); the interval only
    /// bounds how long their memory stays taken. A sweep holds a shard's lock
    /// for a bounded slice of keys. Sweeps run on Tokio's timer, in the
    /// runtime of the store's first use.
    pub fn sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = interval;
        self
    }

    /// Builds the store: [`ConfigError::Memory`] for a bound of 0 or above
    /// `u32::MAX`, or a zero sweep interval.
    pub fn build(self) -> Result<MemoryStore, ConfigError> {
        if self.max_keys == 0 || u32::try_from(self.max_keys).is_err() {
            return Err(ConfigError::Memory(format!(
                "max_keys is {}; it must be from 1 to {}",
                self.max_keys,
                u32::MAX
            )));
        }
        if self.sweep_interval.is_zero() {
            return Err(ConfigError::Memory(
                "the sweep interval must be longer than zero".to_owned(),
            ));
        }
        Ok(MemoryStore::from_builder(self))
    }
}
