//! [`HotKey`]: permits of a hot key taken from a shared store in batches and
//! granted in this process (see [`Limit::with_hot_key`](crate::Limit::with_hot_key)).

use std::time::Duration;

use crate::ConfigError;

/// The longest a batch may be held: beyond that, permits granted long after
/// the store counted them would make the bound meaningless.
const MAX_HOLD: Duration = Duration::from_secs(60);

/// How an instance serves a hot key (one global limit, one big tenant) from
/// local batches of permits, so that only about one decision in `permits`
/// reaches the store: see [`Limit::with_hot_key`](crate::Limit::with_hot_key).
///
/// An instance takes up to `permits` from the store in one decision (a
/// [`take_up_to`](crate::Limiter::take_up_to)), grants them in this process
/// until they run out or `hold` has passed since it asked, and then gives
/// back what it did not grant.
///
/// # The bound
/// With `N` instances sharing the store, for every key of a hot limit. An
/// instance is a process, or more exactly one [`RedisStore`](crate::RedisStore)
/// and its clones: every limiter and layer built over it shares its
/// batches, so several layers applying one hot limit hold one batch per
/// key between them. (Stores built apart, each with its own connections,
/// count as instances of their own.)
///
/// - **Over-admission.** Over any interval, the fleet grants at most what
///   the limit itself grants over that interval, plus `N × permits`: only
///   permits held in batches when the interval begins can be granted in it
///   beyond what the store counts in it, and each instance holds at most
///   one batch per key. A permit is granted at most `hold` after the store
///   counted it.
/// - **Under-admission.** At any moment at most `N × permits` sit unused in
///   batches; each batch gives its unused permits back when its `hold` ends
///   (a sliding log can take back only a batch of which none was granted;
///   otherwise its entry stays counted until it leaves the window). So a
///   request may be refused while other instances hold permits it could
///   have had, for at most `hold`.
///
/// Choose `permits` small against the limit's capacity (the bound is in
/// permits, not in fractions) and large against the requests one instance
/// serves in `hold` (that is what keeps decisions away from the store).
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{ConfigError, HotKey};
///
/// let hot = HotKey::new(100, Duration::from_millis(500))?;
/// assert_eq!(hot.permits(), 100);
/// assert!(matches!(HotKey::new(0, Duration::from_secs(1)), Err(ConfigError::HotKey(_))));
/// # Ok::<(), ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotKey {
    permits: u64,
    hold: Duration,
}

impl HotKey {
    /// Batches of up to `permits` (at least 1), each granted for at most
    /// `hold` (1 ms to 60 s) after it was asked for.
    pub fn new(permits: u64, hold: Duration) -> Result<Self, ConfigError> {
        if permits == 0 {
            return Err(ConfigError::HotKey(
                "a batch must hold at least 1 permit".into(),
            ));
        }
        if hold < Duration::from_millis(1) || hold > MAX_HOLD {
            return Err(ConfigError::HotKey(format!(
                "a batch is held for 1 ms to 60 s, not {hold:?}"
            )));
        }
        Ok(Self { permits, hold })
    }

    /// The most permits one batch takes from the store.
    pub fn permits(&self) -> u64 {
        self.permits
    }

    /// How long after it was asked for a batch grants.
    pub fn hold(&self) -> Duration {
        self.hold
    }

    /// The hold in microseconds.
    pub(crate) fn hold_us(&self) -> i64 {
        i64::try_from(self.hold.as_micros()).unwrap_or(i64::MAX)
    }
}
