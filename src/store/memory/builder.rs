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
    /// The clock decisions read (default:
    /// [`SystemClock`](crate::SystemClock)), e.g. a [`crate::ManualClock`]
    /// in tests.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The most key states the store holds (one per key and limit; default
    /// [`DEFAULT_MAX_KEYS`](super::DEFAULT_MAX_KEYS), about 100 MB of GCRA
    /// states: far more clients than one process serves within a window,
    /// and a ceiling on what a flood of made-up keys can take). From 1 to
    /// `u32::MAX`.
    ///
    /// At the bound, a new key first reclaims expired states of its table.
    /// If the store is still full, it takes the place of the state closest
    /// to fresh among 8 states of each table of its shard (one of the
    /// store's 32, so about `max_keys / 32` states; each table examined from
    /// where the last search stopped): the one with the smallest share of
    /// its capacity in use, then the earliest expiry, then the key seen
    /// longest ago. A state given up is
    /// forgotten: its key, seen again, starts fresh. So a flood of made-up
    /// keys that each sent a little takes the place of its own states, and
    /// new clients keep their whole quota while it lasts; memory stays
    /// bounded whatever keys clients make up.
    ///
    /// The bound this costs: within the time a state covers (its window,
    /// or its capacity's refill), a key is granted at most its quota plus,
    /// for each time its state was given up, what that state had used; and
    /// a state is given up only while 7 others of its table in the sample
    /// (and every other table's 8) hold as large a share of their capacity
    /// in use, or more. A key that spent its quota is therefore forgotten
    /// only once the store is full of keys that spent theirs as well. A
    /// concurrency limit's lease states are rate states of a sliding log:
    /// a lease state given up frees its permits early.
    ///
    /// Penalty states (see [`Limit::with_penalty`](crate::Limit::with_penalty)) count
    /// in the bound and are never given up: a new one in a full store takes
    /// the place of a rate state of any shard. They take at most half the
    /// bound, so that no flood of them (made-up keys refused until blocked)
    /// leaves new clients without room: beyond that, a new one is not kept
    /// (a block fails with
    /// [`Error::PenaltyNotStored`](crate::Error::PenaltyNotStored), a
    /// refusal or offence is not counted; both counted in the metrics).
    /// Only when no rate state could be given up at once (a bound below a
    /// few states per shard, the other shards busy), a new key's grant is
    /// recorded in a state shared per limit and shard (not counted in the
    /// bound) on which keys not stored are decided while it holds grants:
    /// it only over-counts.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// The pause between background sweeps of expired states (default
    /// [`DEFAULT_SWEEP_INTERVAL`](super::DEFAULT_SWEEP_INTERVAL)). Expired
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
