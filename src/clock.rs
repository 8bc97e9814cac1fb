//! Time sources. Redis reads its own clock (`TIME`) in production; the memory
//! store reads a [`Clock`]; tests drive both with a [`ManualClock`].

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
#[cfg(doc)]
use std::time::Instant;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of the current time in whole microseconds since the Unix epoch.
pub trait Clock: Send + Sync + 'static {
    /// The current time, in microseconds since the Unix epoch.
    fn now_micros(&self) -> i64;
}

/// The process clock: the system time read once, advanced by a monotonic
/// clock, so it is aligned with other machines' epochs (fixed windows
/// start at the same instants everywhere) yet never jumps backwards.
///
/// The monotonic clock is [`quanta`]'s: the CPU's time-stamp counter where
/// it is invariant (a read costs a few nanoseconds, against 20 to 30 for
/// [`Instant::now`] on common virtual machines), else the operating
/// system's monotonic clock.
#[derive(Debug, Clone)]
pub struct SystemClock {
    epoch_micros: i64,
    clock: quanta::Clock,
    start: u64,
}

impl SystemClock {
    /// A clock anchored at the current system time.
    pub fn new() -> Self {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        let clock = quanta::Clock::new();
        Self {
            epoch_micros: i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX / 2),
            start: clock.raw(),
            clock,
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now_micros(&self) -> i64 {
        let nanos = self.clock.delta_as_nanos(self.start, self.clock.raw());
        let micros = i64::try_from(nanos / 1_000).unwrap_or(i64::MAX / 2);
        self.epoch_micros.saturating_add(micros)
    }
}

/// A clock that moves only when told to; cheap to clone, clones share the time.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{Clock, ManualClock};
///
/// let clock = ManualClock::new(1_000_000);
/// clock.advance(Duration::from_millis(250));
/// assert_eq!(clock.now_micros(), 1_250_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicI64>,
}

impl ManualClock {
    /// A clock standing at `micros` since the epoch.
    pub fn new(micros: i64) -> Self {
        Self {
            now: Arc::new(AtomicI64::new(micros)),
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let micros = i64::try_from(by.as_micros()).unwrap_or(i64::MAX / 2);
        self.now.fetch_add(micros, Ordering::SeqCst);
    }

    /// Sets the clock to `micros` since the epoch.
    pub fn set(&self, micros: i64) {
        self.now.store(micros, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_micros(&self) -> i64 {
        self.now.load(Ordering::SeqCst)
    }
}
