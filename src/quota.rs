//! What a quota is: an [`Algorithm`] with its amounts and window, built in
//! steps ([`Rate`], [`Burst`], [`CalendarRate`]). A [`Limit`](crate::Limit)
//! names and validates one (`limit/`).

use std::fmt;
use std::time::Duration;

use crate::calendar::{Calendar, Period};

/// The algorithm a [`Quota`] uses. In configuration files (feature `serde`)
/// it is written `sliding-log`, `token-bucket`, `gcra`, `fixed-window` or
/// `sliding-window` (snake case is accepted too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
#[non_exhaustive]
pub enum Algorithm {
    /// Exact sliding window: one sorted-set entry per grant.
    #[cfg_attr(feature = "serde", serde(alias = "sliding_log"))]
    SlidingLog,
    /// Token bucket with lazy refill.
    #[cfg_attr(feature = "serde", serde(alias = "token_bucket"))]
    TokenBucket,
    /// Generic cell rate algorithm (leaky bucket as a meter).
    Gcra,
    /// Fixed window counter aligned to the Unix epoch (or to calendar
    /// periods, see [`CalendarRate`]).
    #[cfg_attr(feature = "serde", serde(alias = "fixed_window"))]
    FixedWindow,
    /// Sliding window counter: two counters, an approximation of the log.
    #[cfg_attr(feature = "serde", serde(alias = "sliding_window"))]
    SlidingWindow,
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How much may pass, and how fast it comes back. Constructing a quota never
/// fails; [`Limit::new`](crate::Limit::new) validates it.
///
/// A quota is spelled in named steps: a [`Rate`] ("10 per second"), for the
/// bucket algorithms a burst ("bursts of 20"), then the algorithm. Every
/// number says what it is where it is written:
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::Quota;
///
/// // "3 SMS per phone number per minute", exactly.
/// let sms = Quota::per_minute(3).sliding_log();
/// // 10 per second on average, bursts of 20.
/// let api = Quota::per_second(10).allow_burst(20).gcra();
/// assert_eq!(api.capacity(), 20);
/// // A bucket of 100 tokens, one back every 10 seconds.
/// let uploads = Quota::rate(1, Duration::from_secs(10)).allow_burst(100).token_bucket();
/// // 1000 per day, windows aligned to midnight UTC.
/// let daily = Quota::per_day(1000).fixed_window();
/// # let _ = (sms, uploads, daily);
/// ```
///
/// The steps are the one way to build a quota: code that computes its
/// amounts passes them to the same steps
/// (`Quota::rate(refill, period).allow_burst(capacity).token_bucket()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub(crate) algorithm: Algorithm,
    pub(crate) amount: u64,
    pub(crate) window: Duration,
    /// The rate (GCRA) or refill (token bucket) per window; 0 for windows.
    pub(crate) extra: u64,
    /// A calendar quota's periods (see [`CalendarRate`]); `None` for
    /// windows aligned to the epoch.
    pub(crate) calendar: Option<Calendar>,
}

impl Quota {
    /// `amount` per second: the first step of a quota (see [`Rate`]).
    pub const fn per_second(amount: u64) -> Rate {
        Rate::new(amount, Duration::from_secs(1))
    }

    /// `amount` per minute (see [`Rate`]).
    pub const fn per_minute(amount: u64) -> Rate {
        Rate::new(amount, Duration::from_secs(60))
    }

    /// `amount` per hour (see [`Rate`]).
    pub const fn per_hour(amount: u64) -> Rate {
        Rate::new(amount, Duration::from_secs(3600))
    }

    /// `amount` per day (see [`Rate`]).
    pub const fn per_day(amount: u64) -> Rate {
        Rate::new(amount, Duration::from_secs(86_400))
    }

    /// `amount` per `period` (see [`Rate`]): `Quota::rate(100, fifteen_minutes)`.
    pub const fn rate(amount: u64, period: Duration) -> Rate {
        Rate::new(amount, period)
    }

    /// The algorithm.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The most one request can ever be granted: the limit, capacity or burst.
    pub fn capacity(&self) -> u64 {
        self.amount
    }

    /// The window, or the refill period / rate period for bucket
    /// algorithms; a calendar quota's longest period (see
    /// [`calendar`](Self::calendar)).
    pub fn window(&self) -> Duration {
        self.window
    }
}

/// As written with the named steps: `GCRA, 10 per 1s, bursts of 20`;
/// `fixed window, 500 per day (UTC+05:30)`.
impl fmt::Display for Quota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.refill() {
            Some(rate) => write!(
                f,
                "{}, {} per {:?}, bursts of {}",
                self.algorithm, rate, self.window, self.amount
            ),
            None => match self.calendar {
                Some(c) => {
                    write!(f, "{}, {} per {}", self.algorithm, self.amount, c.period)?;
                    let (east, m) = (c.offset >= 0, c.offset.unsigned_abs());
                    match m {
                        0 => f.write_str(" (UTC)"),
                        _ => write!(
                            f,
                            " (UTC{}{:02}:{:02})",
                            if east { '+' } else { '-' },
                            m / 60,
                            m % 60
                        ),
                    }
                }
                None => write!(
                    f,
                    "{}, {} per {:?}",
                    self.algorithm, self.amount, self.window
                ),
            },
        }
    }
}

/// The first step of a [`Quota`]: an amount per period, such as
/// `Quota::per_second(10)`. Then either a window algorithm, which lets at
/// most that amount pass per window, or a burst for the bucket algorithms,
/// which let it pass on average.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{Algorithm, Quota};
///
/// let q = Quota::per_minute(3).sliding_log();
/// assert_eq!((q.algorithm(), q.capacity(), q.window()), (Algorithm::SlidingLog, 3, Duration::from_secs(60)));
/// // Without a burst, a bucket holds one period's amount.
/// assert_eq!(Quota::per_second(10).gcra(), Quota::per_second(10).allow_burst(10).gcra());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a rate is only the first step: choose an algorithm (or a burst)"]
pub struct Rate {
    amount: u64,
    period: Duration,
}

impl Rate {
    const fn new(amount: u64, period: Duration) -> Self {
        Self { amount, period }
    }

    /// The bucket algorithms may let `burst` pass at once (the bucket's
    /// capacity), refilled at this rate.
    pub const fn allow_burst(self, burst: u64) -> Burst {
        Burst { rate: self, burst }
    }

    /// At most this amount in any window of one period, exactly. Costs one
    /// stored entry (a sorted-set entry in Redis) per grant: prefer
    /// [`sliding_window`](Self::sliding_window) for limits in the hundred
    /// thousands.
    pub const fn sliding_log(self) -> Quota {
        Quota::windowed(Algorithm::SlidingLog, self)
    }

    /// At most this amount per period, periods aligned to the Unix epoch.
    pub const fn fixed_window(self) -> Quota {
        Quota::windowed(Algorithm::FixedWindow, self)
    }

    /// At most about this amount in any window of one period, estimated
    /// from two counters: O(1) memory whatever the amount.
    pub const fn sliding_window(self) -> Quota {
        Quota::windowed(Algorithm::SlidingWindow, self)
    }

    /// GCRA at this rate, with bursts of one period's amount.
    pub const fn gcra(self) -> Quota {
        self.allow_burst(self.amount).gcra()
    }

    /// A token bucket refilled at this rate, holding one period's amount.
    pub const fn token_bucket(self) -> Quota {
        self.allow_burst(self.amount).token_bucket()
    }
}

/// A [`Rate`] with a burst, such as `Quota::per_second(10).allow_burst(20)`:
/// the last step chooses the bucket algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "choose the algorithm: .gcra() or .token_bucket()"]
pub struct Burst {
    rate: Rate,
    burst: u64,
}

impl Burst {
    /// GCRA: the rate on average, `burst` at once.
    pub const fn gcra(self) -> Quota {
        self.quota(Algorithm::Gcra)
    }

    /// A token bucket of `burst` tokens, refilled at the rate
    /// (continuously, in proportion to the time elapsed). Starts full.
    pub const fn token_bucket(self) -> Quota {
        self.quota(Algorithm::TokenBucket)
    }

    const fn quota(self, algorithm: Algorithm) -> Quota {
        Quota {
            algorithm,
            amount: self.burst,
            window: self.rate.period,
            extra: self.rate.amount,
            calendar: None,
        }
    }
}

impl Quota {
    const fn windowed(algorithm: Algorithm, rate: Rate) -> Self {
        Self {
            algorithm,
            amount: rate.amount,
            window: rate.period,
            extra: 0,
            calendar: None,
        }
    }

    /// For the bucket algorithms, the amount that comes back per
    /// [`window`](Self::window) (the rate); `None` for window algorithms.
    pub fn refill(&self) -> Option<u64> {
        self.algorithm.rate_name().map(|_| self.extra)
    }
}

/// The first step of a calendar quota: an amount per calendar [`Period`],
/// such as `Quota::per_month(10_000)`, its days beginning at midnight UTC
/// unless moved east or west of it; then a window algorithm.
///
/// ```
/// use std::time::Duration;
/// use tower_ratelimit::{Period, Quota};
///
/// // 10,000 per month, the count back to 0 on the 1st at 00:00 UTC.
/// let plan = Quota::per_month(10_000).fixed_window();
/// // 500 per day, from midnight in India (UTC+05:30).
/// let sms = Quota::per_calendar_day(500)
///     .east_of_utc(Duration::from_secs(5 * 3600 + 30 * 60))
///     .fixed_window();
/// assert_eq!((plan.calendar(), sms.calendar()), (Some(Period::Month), Some(Period::Day)));
/// assert_eq!(sms.utc_offset_secs(), 19_800);
/// ```
///
/// The periods are those of a fixed offset from UTC, not of a named time
/// zone: where a zone changes its offset (daylight saving time), its days
/// last 23 or 25 hours, which the store's scripts could only know from a
/// time zone database that Redis does not have. Write the offset the
/// quota's customers are sold, or UTC.
///
/// With [`fixed_window`](Self::fixed_window), at most the amount passes
/// per period, and a refusal's `Retry-After` and the `RateLimit` fields'
/// reset point at the period's end. With
/// [`sliding_window`](Self::sliding_window), the count of the previous
/// period weighs in proportion to how much of it lies within one such
/// period before now. Months have their real lengths, leap years count,
/// and the store's clock (Redis `TIME`, the memory store's [`Clock`])
/// decides which period a decision falls in. A calendar quota is a
/// limit's own: it cannot be a stored quota
/// ([`Admin::set_stored_quota`](crate::Admin::set_stored_quota) refuses it).
///
/// # In Redis
///
/// A month's count lives in Redis for the month: a restart without
/// persistence, or an eviction, forgets it, and the key's customers start
/// the month over. A [`RedisStore`](crate::RedisStore) with calendar
/// quotas needs
///
/// - persistence: AOF (`appendonly yes`) or RDB snapshots (`save ...`),
///   and a replica to fail over to if a lost minute matters;
/// - `maxmemory-policy noeviction` whenever `maxmemory` is set. Every key
///   of this crate has a TTL (a state expires once it equals a fresh
///   one), so the `volatile-*` policies may evict them as well as the
///   `allkeys-*` ones. Under `noeviction` a full Redis refuses writes
///   instead, and decisions fail (see
///   [`OnStoreError`](crate::layer::OnStoreError)).
///
/// At its first decision once a limiter or layer with a calendar limit was
/// built over it, a `RedisStore` (and its clones) asks the server (`CONFIG GET maxmemory maxmemory-policy
/// appendonly save`) and logs one `warn` line (target `tower_ratelimit`)
/// when it sees one of these missing; where `CONFIG` is disabled or
/// renamed (managed services), a `debug` line only. A limit made a
/// calendar one later by a [live change](crate::LiveLimit) is not
/// checked.
///
/// [`Clock`]: crate::Clock
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a calendar rate is only the first step: choose a window algorithm"]
pub struct CalendarRate {
    amount: u64,
    calendar: Calendar,
}

impl CalendarRate {
    pub(crate) const fn new(amount: u64, period: Period) -> Self {
        Self {
            amount,
            calendar: Calendar { period, offset: 0 },
        }
    }

    /// Periods that begin at midnight `by` east of UTC (UTC+hh:mm), which
    /// is `by` before midnight UTC. `by` is whole minutes, under a day (as
    /// every offset in use since 1972 is);
    /// [`Limit::new`](crate::Limit::new) refuses another.
    pub const fn east_of_utc(self, by: Duration) -> Self {
        self.offset(minutes(by))
    }

    /// Periods that begin at midnight `by` west of UTC (UTC-hh:mm), which
    /// is `by` after midnight UTC. `by` is whole minutes, under a day.
    pub const fn west_of_utc(self, by: Duration) -> Self {
        self.offset(-minutes(by))
    }

    const fn offset(mut self, minutes: i16) -> Self {
        self.calendar.offset = minutes;
        self
    }

    /// At most the amount per period (see [`Rate::fixed_window`]).
    pub const fn fixed_window(self) -> Quota {
        self.quota(Algorithm::FixedWindow)
    }

    /// About the amount in any period's length, from the counts of this
    /// period and the previous one (see [`Rate::sliding_window`]).
    pub const fn sliding_window(self) -> Quota {
        self.quota(Algorithm::SlidingWindow)
    }

    const fn quota(self, algorithm: Algorithm) -> Quota {
        Quota {
            algorithm,
            amount: self.amount,
            window: Duration::from_micros(self.calendar.longest() as u64),
            extra: 0,
            calendar: Some(self.calendar),
        }
    }
}

/// `by` in minutes; `i16::MAX`, which `Limit::new` refuses, when not whole
/// minutes under a day.
const fn minutes(by: Duration) -> i16 {
    if by.subsec_nanos() == 0 && by.as_secs().is_multiple_of(60) && by.as_secs() < 86_400 {
        (by.as_secs() / 60) as i16
    } else {
        i16::MAX
    }
}

impl Quota {
    /// `amount` per calendar day, from midnight to midnight (see
    /// [`CalendarRate`]). Unlike [`Quota::per_day`], whose days are 24
    /// hours counted from the Unix epoch (from midnight UTC for a fixed
    /// window, from any instant for a sliding one), its days may begin at
    /// midnight east or west of UTC.
    pub const fn per_calendar_day(amount: u64) -> CalendarRate {
        CalendarRate::new(amount, Period::Day)
    }

    /// `amount` per week, from Monday at midnight (see [`CalendarRate`]).
    /// (Seven days counted from the Unix epoch would begin on Thursdays;
    /// seven days from any instant are `Quota::rate(amount, 7 days)`.)
    pub const fn per_week(amount: u64) -> CalendarRate {
        CalendarRate::new(amount, Period::Week)
    }

    /// `amount` per calendar month, from the first at midnight (see
    /// [`CalendarRate`], and [what it needs from Redis](CalendarRate#in-redis):
    /// persistence and no eviction).
    pub const fn per_month(amount: u64) -> CalendarRate {
        CalendarRate::new(amount, Period::Month)
    }

    /// `amount` per calendar year, from the first of January at midnight
    /// (see [`CalendarRate`]).
    pub const fn per_year(amount: u64) -> CalendarRate {
        CalendarRate::new(amount, Period::Year)
    }

    /// `amount` per calendar `period` (see [`CalendarRate`]), for code that
    /// computes the period: `Quota::per_calendar(10, Period::Month)` is
    /// `Quota::per_month(10)`.
    pub const fn per_calendar(amount: u64, period: Period) -> CalendarRate {
        CalendarRate::new(amount, period)
    }

    /// The calendar period of a calendar quota, `None` for the others.
    /// A calendar quota's [`window`](Self::window) is its longest period
    /// (31 days for a month, 366 for a year).
    pub fn calendar(&self) -> Option<Period> {
        self.calendar.map(|c| c.period)
    }

    /// How far east of UTC a calendar quota's periods begin, in seconds
    /// (west is negative); 0 for the others.
    pub fn utc_offset_secs(&self) -> i64 {
        self.calendar.map_or(0, |c| i64::from(c.offset) * 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ConfigError, Limit};

    /// What a quota is made of: its algorithm, capacity, window and refill.
    fn parts(q: Quota) -> (Algorithm, u64, Duration, Option<u64>) {
        (q.algorithm(), q.capacity(), q.window(), q.refill())
    }

    #[test]
    fn named_steps_build_the_quotas_they_name() {
        let (s, m) = (Duration::from_secs(1), Duration::from_secs(60));
        // a rate of 10 per second, bursts of 20
        assert_eq!(
            parts(Quota::per_second(10).allow_burst(20).gcra()),
            (Algorithm::Gcra, 20, s, Some(10))
        );
        // a bucket of 20, refilled by 10 every second
        assert_eq!(
            parts(Quota::per_second(10).allow_burst(20).token_bucket()),
            (Algorithm::TokenBucket, 20, s, Some(10))
        );
        assert_eq!(
            parts(Quota::per_minute(3).sliding_log()),
            (Algorithm::SlidingLog, 3, m, None)
        );
        assert_eq!(
            parts(Quota::per_hour(5).fixed_window()),
            (Algorithm::FixedWindow, 5, 60 * m, None)
        );
        assert_eq!(
            parts(Quota::per_day(7).sliding_window()),
            (Algorithm::SlidingWindow, 7, 24 * 60 * m, None)
        );
        // without a burst, a bucket holds one period's amount
        assert_eq!(
            parts(Quota::rate(4, m).token_bucket()),
            (Algorithm::TokenBucket, 4, m, Some(4))
        );
        assert_eq!(
            parts(Quota::rate(4, m).gcra()),
            (Algorithm::Gcra, 4, m, Some(4))
        );
        assert_eq!(
            Quota::per_second(10).allow_burst(20).gcra().refill(),
            Some(10)
        );
        assert_eq!(Quota::per_second(10).sliding_log().refill(), None);
        assert_eq!(
            Quota::per_second(10).allow_burst(20).gcra().to_string(),
            "GCRA, 10 per 1s, bursts of 20"
        );
        assert_eq!(
            Quota::per_minute(3).sliding_log().to_string(),
            "sliding log, 3 per 60s"
        );
        // Invalid quotas stay typed errors, naming the step.
        assert!(matches!(
            Limit::new("a", Quota::per_second(10).allow_burst(0).gcra()),
            Err(ConfigError::ZeroAmount { what: "burst" })
        ));
        assert!(matches!(
            Limit::new("a", Quota::per_second(0).allow_burst(5).token_bucket()),
            Err(ConfigError::ZeroAmount { what: "refill" })
        ));
        assert!(matches!(
            Limit::new("a", Quota::rate(1, Duration::ZERO).fixed_window()),
            Err(ConfigError::ZeroWindow { what: "window" })
        ));
    }

    #[test]
    fn reduces_rates_and_rejects_bad_quotas() {
        let l = Limit::new("a", Quota::per_second(10).allow_burst(10).gcra()).unwrap();
        assert_eq!(l.params().wire()[..3], [10, 1, 100_000]);
        assert_eq!(l.policy_window(), Duration::from_secs(1));
        let day = Duration::from_secs(86_400);
        let l = Limit::new(
            "a",
            Quota::rate(1_000_000, day)
                .allow_burst(1_000_000)
                .token_bucket(),
        )
        .unwrap();
        assert_eq!(l.params().wire()[..3], [1_000_000, 1, 86_400]);
        assert!(Limit::new("a", Quota::per_hour(1_000_000).sliding_window()).is_ok());
        assert!(matches!(
            Limit::new("a", Quota::rate(1 << 33, day).sliding_window()),
            Err(ConfigError::OutOfRange(_))
        ));
        assert!(matches!(
            Limit::new("a", Quota::rate(1, Duration::ZERO).fixed_window()),
            Err(ConfigError::ZeroWindow { .. })
        ));
        assert!(matches!(
            Limit::new("a", Quota::rate(0, day).allow_burst(1).gcra()),
            Err(ConfigError::ZeroAmount { what: "rate" })
        ));
        assert!(matches!(
            Limit::new(
                "a",
                Quota::rate(1, Duration::from_secs(40 * 366 * 86_400))
                    .allow_burst(5)
                    .token_bucket()
            ),
            Err(ConfigError::OutOfRange(_))
        ));
        for bad in ["", "a:b", "{x}", "a b", &"x".repeat(65)] {
            assert!(matches!(
                Limit::new(bad, Quota::rate(1, day).fixed_window()),
                Err(ConfigError::InvalidName(_))
            ));
        }
    }
}
