//! Mirror of `cal` in `lua/common.lua`: the window of a calendar quota (a
//! day, a week from Monday, a month or a year at a fixed offset from UTC)
//! that holds a time, found from Unix time alone with the same integer
//! steps (days from a civil date and back, after Howard Hinnant's
//! algorithms), exact in the doubles Redis Lua computes with.

use super::fdiv;
use crate::calendar::{Calendar, Period, DAY};

/// A calendar limit's third parameter on the wire, negative (a window
/// algorithm's own is 0 or positive): `-(period + 10 * (offset in
/// seconds + 86,400))`, the period 1 (day) to 4 (year).
pub(crate) fn code(calendar: Calendar) -> i64 {
    let period = match calendar.period {
        Period::Day => 1,
        Period::Week => 2,
        Period::Month => 3,
        Period::Year => 4,
    };
    -(period + 10 * (i64::from(calendar.offset) * 60 + 86_400))
}

/// The window of `calendar` that holds `at`: its start, its length and the length of
/// the one before it (us).
pub(crate) fn window(calendar: Calendar, at: i64) -> (i64, i64, i64) {
    let z = fdiv(at + calendar.offset_us(), DAY);
    // in days from the epoch: its start, the next one's, the one before's
    let (s, e, b) = match calendar.period {
        Period::Day => (z, z + 1, z - 1),
        Period::Week => {
            // 1970-01-01 was a Thursday: day 0 is 3 days after a Monday
            let s = z - (z + 3 - fdiv(z + 3, 7) * 7);
            (s, s + 7, s - 7)
        }
        Period::Month => {
            let (y, m) = month_of(z);
            let e = if m == 12 {
                first_of(y + 1, 1)
            } else {
                first_of(y, m + 1)
            };
            let b = if m == 1 {
                first_of(y - 1, 12)
            } else {
                first_of(y, m - 1)
            };
            (first_of(y, m), e, b)
        }
        Period::Year => {
            let (y, _) = month_of(z);
            (first_of(y, 1), first_of(y + 1, 1), first_of(y - 1, 1))
        }
    };
    let start = s * DAY - calendar.offset_us();
    (start, (e - s) * DAY, (s - b) * DAY)
}

/// Days from the epoch to the first day of month `m` (1 to 12) of year `y`.
fn first_of(y: i64, m: i64) -> i64 {
    // years from March: January and February end the year before
    let y = if m <= 2 { y - 1 } else { y };
    let era = fdiv(y, 400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    era * 146_097 + yoe * 365 + fdiv(yoe, 4) - fdiv(yoe, 100) + fdiv(153 * mp + 2, 5) - 719_468
}

/// The year and month (1 to 12) of day `z` from the epoch.
fn month_of(z: i64) -> (i64, i64) {
    let z = z + 719_468;
    let era = fdiv(z, 146_097);
    let doe = z - era * 146_097;
    let yoe = fdiv(
        doe - fdiv(doe, 1460) + fdiv(doe, 36_524) - fdiv(doe, 146_096),
        365,
    );
    let doy = doe - 365 * yoe - fdiv(yoe, 4) + fdiv(yoe, 100);
    let mp = fdiv(5 * doy + 2, 153);
    let y = yoe + era * 400;
    if mp >= 10 {
        (y + 1, mp - 9)
    } else {
        (y, mp + 3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::{Date, Duration, Month, OffsetDateTime, UtcOffset};

    /// The model: the window of `period` that holds `at` at `offset`
    /// seconds east of UTC, from the `time` crate's civil dates.
    fn model(period: Period, offset: i16, at: i64) -> (i64, i64) {
        let off = UtcOffset::from_whole_seconds(i32::from(offset) * 60).expect("offset");
        let local = OffsetDateTime::from_unix_timestamp_nanos(i128::from(at) * 1000)
            .expect("time")
            .to_offset(off);
        let d = local.date();
        let first = |y: i32, m: Month| Date::from_calendar_date(y, m, 1).expect("date");
        let (start, end) = match period {
            Period::Day => (d, d + Duration::days(1)),
            Period::Week => {
                let s = d - Duration::days(i64::from(d.weekday().number_days_from_monday()));
                (s, s + Duration::days(7))
            }
            Period::Month => {
                let y = d.year() + i32::from(d.month() == Month::December);
                (first(d.year(), d.month()), first(y, d.month().next()))
            }
            Period::Year => (
                first(d.year(), Month::January),
                first(d.year() + 1, Month::January),
            ),
        };
        let us = |d: Date| d.midnight().assume_offset(off).unix_timestamp() * 1_000_000;
        (us(start), us(end))
    }

    /// Each day of 1896 to 1903 (1900 is no leap year), 1968 to 2039 and
    /// 2096 to 2103 (nor is 2100) at four offsets, at its first and last
    /// microsecond: the window of each period is the model's, and the one
    /// before ends where it starts.
    #[test]
    fn windows_are_the_models_for_every_day_and_offset() {
        let periods = [Period::Day, Period::Week, Period::Month, Period::Year];
        let years = [(1896, 1904), (1968, 2040), (2096, 2104)];
        for ((from, to), offset) in years
            .iter()
            .flat_map(|y| [0, 330, -480, 840].map(|o| (*y, o)))
        {
            let mut day = first_of(from, 1) * DAY - i64::from(offset) * 60_000_000;
            while day < first_of(to, 1) * DAY {
                for at in [day, day + DAY - 1] {
                    for period in periods {
                        let c = Calendar { period, offset };
                        let (start, len, before) = window(c, at);
                        assert_eq!(
                            (start, start + len),
                            model(period, offset, at),
                            "{c:?} {at}"
                        );
                        assert_eq!(model(period, offset, start - 1).0, start - before);
                    }
                }
                day += DAY;
            }
        }
    }

    /// Every day from 1600 to 2400 (leap years and their exceptions, all
    /// month lengths) against a plain count of days.
    #[test]
    fn civil_dates_round_trip_against_a_count_of_days() {
        let leap = |y: i64| y % 4 == 0 && (y % 100 != 0 || y % 400 == 0);
        let mut z = first_of(1600, 1);
        assert_eq!(first_of(1970, 1), 0);
        for y in 1600..2400 {
            for m in 1..=12 {
                assert_eq!(first_of(y, m), z, "{y}-{m}-01");
                let len = match m {
                    2 => 28 + i64::from(leap(y)),
                    4 | 6 | 9 | 11 => 30,
                    _ => 31,
                };
                for d in 0..len {
                    assert_eq!(month_of(z + d), (y, m), "{y}-{m}-{}", d + 1);
                }
                z += len;
            }
        }
    }
}
