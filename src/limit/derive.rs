//! A quota's integer parameters, derived once and checked to stay exact in
//! the doubles Redis Lua computes with.

use std::time::Duration;

use crate::algorithm::{self, Params};
use crate::quota::{Algorithm, Quota};
use crate::ConfigError;

/// Largest integer every intermediate value must stay below (2^53, the exact
/// range of the doubles Redis Lua computes with).
const MAX_EXACT: u128 = 1 << 53;
/// Longest accepted window: ten years, so `now + window` stays far below 2^53 us.
const MAX_WINDOW_MICROS: u128 = 10 * 366 * 86_400 * 1_000_000;
/// Sliding window counter weights have 2^20 steps per window.
const WEIGHT_STEPS: u64 = 1 << 20;

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

pub(crate) fn derive(q: &Quota) -> Result<(Params, Duration), ConfigError> {
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
    if let Some(c) = q.calendar {
        // whole minutes under a day (see `CalendarRate::east_of_utc`)
        if c.offset.unsigned_abs() >= 24 * 60 {
            return Err(ConfigError::OutOfRange(
                "a calendar quota's offset from UTC must be whole minutes under a day".to_owned(),
            ));
        }
    }
    let params = match q.algorithm {
        Algorithm::SlidingLog | Algorithm::FixedWindow => {
            let limit = exact(amount, "the limit")?;
            let window = exact(window, "the window in microseconds")?;
            if q.algorithm == Algorithm::SlidingLog {
                Params::SlidingLog(algorithm::sliding_log::Params { limit, window })
            } else {
                Params::FixedWindow(algorithm::fixed_window::Params {
                    limit,
                    window,
                    calendar: q.calendar,
                })
            }
        }
        Algorithm::SlidingWindow => {
            let steps = u128::from(WEIGHT_STEPS);
            exact(amount * steps, "the limit times 2^20")?;
            Params::SlidingWindow(algorithm::sliding_window::Params {
                limit: exact(amount, "the limit")?,
                window: exact(window, "the window in microseconds")?,
                // (under 2^29: the window is at most ten years)
                step: i32::try_from(window.div_ceil(steps)).map_err(|_| {
                    ConfigError::OutOfRange("the weight step is too large".to_owned())
                })?,
                calendar: q.calendar,
            })
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
            let capacity = exact(amount, amount_name)?;
            let rate = exact(per, rate_name)?;
            let reduced = exact(period, "the reduced period in microseconds")?;
            // The largest products the scripts form: capacity * period (+ rate).
            exact(amount * period + per, "capacity times reduced period")?;
            if q.algorithm == Algorithm::Gcra {
                Params::Gcra(algorithm::gcra::Params {
                    burst: capacity,
                    rate,
                    period: reduced,
                })
            } else {
                Params::TokenBucket(algorithm::token_bucket::Params {
                    capacity,
                    rate,
                    period: reduced,
                })
            }
        }
    };
    Ok((params, Duration::from_micros(params.policy_window_us())))
}
