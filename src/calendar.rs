//! Calendar quotas: "10,000 per month", windows that begin on the first of
//! each month (or each day, each Monday, each first of January) at midnight
//! UTC or at a fixed offset from it. The windows are found by the store's
//! clock (`src/algorithm/calendar.rs`, `cal` in `lua/common.lua`).

use std::fmt;
use std::time::Duration;

use crate::algorithm::calendar::Calendar;
use crate::quota::{Algorithm, Quota};

/// A calendar period: the window of a calendar quota (see
/// [`CalendarRate`]). In configuration files (feature `serde`) it is written
/// `day`, `week`, `month` or `year`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
#[non_exhaustive]
pub enum Period {
    /// From midnight to midnight.
    Day,
    /// From Monday at midnight to the next Monday (ISO 8601 weeks).
    Week,
    /// From the first of a month at midnight to the first of the next: 28
    /// to 31 days.
    Month,
    /// From the first of January at midnight to the next: 365 or 366 days.
    Year,
}

/// As in configuration files: `day`, `week`, `month`, `year`.
impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
            Period::Year => "year",
        })
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
/// limit's own: it cannot be kept in the store
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
/// At its first decision with a calendar limit a `RedisStore` (and its
/// clones) asks the server (`CONFIG GET maxmemory maxmemory-policy
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

    /// At most the amount per period (see [`Quota::fixed_window`]).
    pub const fn fixed_window(self) -> Quota {
        self.quota(Algorithm::FixedWindow)
    }

    /// About the amount in any period's length, from the counts of this
    /// period and the previous one (see [`Quota::sliding_window`]).
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
