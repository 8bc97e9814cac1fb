//! Calendar periods: a day, a week from Monday, a month or a year, at a
//! fixed offset from UTC, in which a calendar quota ("10,000 per month",
//! see [`CalendarRate`](crate::CalendarRate)) counts. The window of a
//! period that holds a time is found by the store's clock
//! (`src/algorithm/calendar.rs`, `cal` in `lua/common.lua`).

use std::fmt;

/// A calendar period: the window of a calendar quota (see
/// [`CalendarRate`](crate::CalendarRate)). In configuration files (feature
/// `serde`) it is written `day`, `week`, `month` or `year`.
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

/// A day in microseconds.
pub(crate) const DAY: i64 = 86_400_000_000;

/// A calendar quota's periods: which, and how far east of UTC (minutes;
/// west is negative) its days begin. (Four bytes: a `Limit` is copied
/// whole, and every limit's quota and parameters hold one.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Calendar {
    pub(crate) period: Period,
    pub(crate) offset: i16,
}

impl Calendar {
    /// The offset in microseconds.
    pub(crate) fn offset_us(self) -> i64 {
        i64::from(self.offset) * 60_000_000
    }

    /// The longest of its windows (us): what the limit's window says, and
    /// its horizon.
    pub(crate) const fn longest(self) -> i64 {
        DAY * match self.period {
            Period::Day => 1,
            Period::Week => 7,
            Period::Month => 31,
            Period::Year => 366,
        }
    }
}
