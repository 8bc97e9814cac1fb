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
    /// At the bound, a new key first reclaims expired states of its shard.
    /// If the store is still full, its grant is recorded in a state shared
    /// by every key that found the store full (one per limit in each of the
    /// store's 32 shards, not counted in the bound), and while that shared
    /// state holds grants, every key not stored is decided on it, and a key
    /// stored then starts from it. The shared state counts at least every
    /// grant of each key it stands for, so no key ever passes more than its
    /// quota, and memory stays bounded whatever keys clients make up.
    ///
    /// What a legitimate new key gets while a flood of made-up keys keeps
    /// the store full: the quota left in its shard's shared state, often
    /// none (refused with the shared state's `retry_after`). That lasts
    /// until room is made by expiry and, after the flood's last grant, at
    /// most the time the limit takes to become fresh again (its window, or
    /// its capacity's refill). Stored keys are never evicted to make room
    /// and keep their exact limits; a reset or refund of a key that was not
    /// stored leaves the shared state as it is.
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
