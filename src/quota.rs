//! What a limit is: an [`Algorithm`] with its amounts and window ([`Quota`]),
//! under a name ([`Limit`]). Validation happens in [`Limit::new`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::ConfigError;

/// Largest integer every intermediate value must stay below (2^53, the exact
/// range of the doubles Redis Lua computes with).
pub(crate) const MAX_EXACT: u128 = 1 << 53;
/// Longest accepted window: ten years, so `now + window` stays far below 2^53 us.
const MAX_WINDOW_MICROS: u128 = 10 * 366 * 86_400 * 1_000_000;
/// Sliding window counter weights have 2^20 steps per window.
const WEIGHT_STEPS: u64 = 1 << 20;

/// The algorithm a [`Quota`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// Exact sliding window: one sorted-set entry per grant.
    SlidingLog,
    /// Token bucket with lazy refill.
    TokenBucket,
    /// Generic cell rate algorithm (leaky bucket as a meter).
    Gcra,
    /// Fixed window counter aligned to the Unix epoch.
    FixedWindow,
    /// Sliding window counter: two counters, an approximation of the log.
    SlidingWindow,
}

impl Algorithm {
    /// The id the Lua driver dispatches on.
    pub(crate) fn id(self) -> u8 {
        match self {
            Algorithm::SlidingLog => 1,
            Algorithm::TokenBucket => 2,
            Algorithm::Gcra => 3,
            Algorithm::FixedWindow => 4,
            Algorithm::SlidingWindow => 5,
        }
    }

    /// The suffixes of the keys this algorithm stores under.
    pub(crate) fn key_parts(self) -> &'static [&'static str] {
        match self {
            Algorithm::SlidingLog => &["log", "meta"],
            Algorithm::TokenBucket => &["tb"],
            Algorithm::Gcra => &["gcra"],
            Algorithm::FixedWindow => &["fw"],
            Algorithm::SlidingWindow => &["sw"],
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Algorithm::SlidingLog => "sliding log",
            Algorithm::TokenBucket => "token bucket",
            Algorithm::Gcra => "GCRA",
            Algorithm::FixedWindow => "fixed window",
            Algorithm::SlidingWindow => "sliding window counter",
        })
    }
}

/// How much may pass, and how fast it comes back. Constructing a quota never
/// fails; [`Limit::new`] validates it.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::Quota;
///
/// // "3 SMS per phone number per minute", exactly.
/// let sms = Quota::sliding_log(3, Duration::from_secs(60));
/// // 10 per second with bursts of 10.
/// let api = Quota::gcra(10, Duration::from_secs(1), 10);
/// assert_eq!(api.capacity(), 10);
/// # let _ = sms;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    algorithm: Algorithm,
    amount: u64,
    window: Duration,
    extra: u64,
}

impl Quota {
    /// At most `limit` permits in any window of length `window` (exact).
    /// Costs one sorted-set entry per grant: prefer [`Quota::sliding_window`]
    /// for limits in the hundred thousands.
    pub fn sliding_log(limit: u64, window: Duration) -> Self {
        Self {
            algorithm: Algorithm::SlidingLog,
            amount: limit,
            window,
            extra: 0,
        }
    }

    /// A bucket of `capacity` tokens, refilled by `refill` tokens every `period`
    /// (continuously, in proportion to the time elapsed). Starts full.
    pub fn token_bucket(capacity: u64, refill: u64, period: Duration) -> Self {
        Self {
            algorithm: Algorithm::TokenBucket,
            amount: capacity,
            window: period,
            extra: refill,
        }
    }

    /// `rate` permits per `period` on average, with bursts of up to `burst`.
    pub fn gcra(rate: u64, period: Duration, burst: u64) -> Self {
        Self {
            algorithm: Algorithm::Gcra,
            amount: burst,
            window: period,
            extra: rate,
        }
    }

    /// At most `limit` permits per window, windows aligned to the Unix epoch.
    pub fn fixed_window(limit: u64, window: Duration) -> Self {
        Self {
            algorithm: Algorithm::FixedWindow,
            amount: limit,
            window,
            extra: 0,
        }
    }

    /// At most about `limit` permits in any window of length `window`, estimated
    /// from two counters: O(1) memory whatever the limit.
    pub fn sliding_window(limit: u64, window: Duration) -> Self {
        Self {
            algorithm: Algorithm::SlidingWindow,
            amount: limit,
            window,
            extra: 0,
        }
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The most one request can ever be granted: the limit, capacity or burst.
    pub fn capacity(&self) -> u64 {
        self.amount
    }

    /// The window, or the refill period / rate period for bucket algorithms.
    pub fn window(&self) -> Duration {
        self.window
    }
}

/// Integer parameters shared by the Lua scripts and their Rust mirrors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Params {
    pub(crate) algorithm: Algorithm,
    pub(crate) p: [i64; 4],
}

/// A named, validated quota. Cheap to clone.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{ConfigError, Limit, Quota};
///
/// let sms = Limit::new("sms", Quota::sliding_log(3, Duration::from_secs(60)))?;
/// assert_eq!(sms.name(), "sms");
/// assert!(matches!(
///     Limit::new("sms", Quota::sliding_log(0, Duration::from_secs(60))),
///     Err(ConfigError::ZeroAmount { .. })
/// ));
/// # Ok::<(), ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Limit {
    name: Arc<str>,
    quota: Quota,
    params: Params,
    policy_window: Duration,
}

impl Limit {
    /// Validates `quota` and names it. The name becomes part of every storage
    /// key and of the `RateLimit-Policy` header: 1 to 64 characters from
    /// `A-Z a-z 0-9 _ . -`.
    pub fn new(name: impl Into<String>, quota: Quota) -> Result<Self, ConfigError> {
        let name: String = name.into();
        let valid_name = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !valid_name {
            return Err(ConfigError::InvalidName(name));
        }
        let (params, policy_window) = derive(&quota)?;
        Ok(Self {
            name: name.into(),
            quota,
            params,
            policy_window,
        })
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn shared_name(&self) -> &Arc<str> {
        &self.name
    }

    /// The quota.
    pub fn quota(&self) -> &Quota {
        &self.quota
    }

    /// The most one request can ever be granted.
    pub fn capacity(&self) -> u64 {
        self.quota.amount
    }

    /// The time in which a spent capacity comes back in full: the window for
    /// window algorithms, capacity / rate for the bucket algorithms. Used as the
    /// `w` of `RateLimit-Policy`.
    pub fn policy_window(&self) -> Duration {
        self.policy_window
    }

    pub(crate) fn params(&self) -> &Params {
        &self.params
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn exact(value: u128, what: &str) -> Result<i64, ConfigError> {
    if value >= MAX_EXACT {
        return Err(ConfigError::OutOfRange(format!(
            "{what} is {value}, which must stay below 2^53 for exact arithmetic"
        )));
    }
    i64::try_from(value).map_err(|_| ConfigError::OutOfRange(format!("{what} is too large")))
}

fn derive(q: &Quota) -> Result<(Params, Duration), ConfigError> {
    let window = q.window.as_micros();
    let window_name = match q.algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra => "period",
        _ => "window",
    };
    if window == 0 {
        return Err(ConfigError::ZeroWindow { what: window_name });
    }
    if window > MAX_WINDOW_MICROS {
        return Err(ConfigError::OutOfRange(format!(
            "the {window_name} is longer than ten years"
        )));
    }
    let amount_name = match q.algorithm {
        Algorithm::TokenBucket => "capacity",
        Algorithm::Gcra => "burst",
        _ => "limit",
    };
    if q.amount == 0 {
        return Err(ConfigError::ZeroAmount { what: amount_name });
    }
    let amount = u128::from(q.amount);
    let mut p = [0i64; 4];
    let policy_window_micros: u128;
    match q.algorithm {
        Algorithm::SlidingLog | Algorithm::FixedWindow => {
            p[0] = exact(amount, "the limit")?;
            p[1] = exact(window, "the window in microseconds")?;
            policy_window_micros = window;
        }
        Algorithm::SlidingWindow => {
            let steps = u128::from(WEIGHT_STEPS);
            exact(amount * steps, "the limit times 2^20")?;
            p[0] = exact(amount, "the limit")?;
            p[1] = exact(window, "the window in microseconds")?;
            p[2] = exact(window.div_ceil(steps), "the weight step")?;
            policy_window_micros = window;
        }
        Algorithm::TokenBucket | Algorithm::Gcra => {
            let rate_name = if q.algorithm == Algorithm::Gcra {
                "rate"
            } else {
                "refill"
            };
            if q.extra == 0 {
                return Err(ConfigError::ZeroAmount { what: rate_name });
            }
            let g = gcd(u128::from(q.extra), window);
            let (per, period) = (u128::from(q.extra) / g, window / g);
            p[0] = exact(amount, amount_name)?;
            p[1] = exact(per, rate_name)?;
            p[2] = exact(period, "the reduced period in microseconds")?;
            // The largest products the scripts form: capacity * period (+ rate).
            exact(amount * period + per, "capacity times reduced period")?;
            policy_window_micros = (amount * period).div_ceil(per);
        }
    }
    let micros = u64::try_from(policy_window_micros).unwrap_or(u64::MAX);
    Ok((
        Params {
            algorithm: q.algorithm,
            p,
        },
        Duration::from_micros(micros),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduces_rates_and_rejects_bad_quotas() {
        let l = Limit::new("a", Quota::gcra(10, Duration::from_secs(1), 10)).unwrap();
        assert_eq!(l.params().p[..3], [10, 1, 100_000]);
        assert_eq!(l.policy_window(), Duration::from_secs(1));
        let day = Duration::from_secs(86_400);
        let l = Limit::new("a", Quota::token_bucket(1_000_000, 1_000_000, day)).unwrap();
        assert_eq!(l.params().p[..3], [1_000_000, 1, 86_400]);
        assert!(Limit::new(
            "a",
            Quota::sliding_window(1_000_000, Duration::from_secs(3600))
        )
        .is_ok());
        assert!(matches!(
            Limit::new("a", Quota::sliding_window(1 << 33, day)),
            Err(ConfigError::OutOfRange(_))
        ));
        assert!(matches!(
            Limit::new("a", Quota::fixed_window(1, Duration::ZERO)),
            Err(ConfigError::ZeroWindow { .. })
        ));
        assert!(matches!(
            Limit::new("a", Quota::gcra(0, day, 1)),
            Err(ConfigError::ZeroAmount { what: "rate" })
        ));
        assert!(matches!(
            Limit::new(
                "a",
                Quota::token_bucket(5, 1, Duration::from_secs(40 * 366 * 86_400))
            ),
            Err(ConfigError::OutOfRange(_))
        ));
        for bad in ["", "a:b", "{x}", "a b", &"x".repeat(65)] {
            assert!(matches!(
                Limit::new(bad, Quota::fixed_window(1, day)),
                Err(ConfigError::InvalidName(_))
            ));
        }
    }
}
