//! The parameters of a limit's algorithm: derived from its quota, read from
//! a kept quota's stored form, written on the wire.

use super::{fixed_window, gcra, horizon, sliding_log, sliding_window, token_bucket, EXACT};
use crate::quota::Algorithm;

/// The integers a limit's algorithm decides with, derived once from its
/// quota (see `limit.rs`), typed per algorithm: a state is decided with the
/// parameters of its own algorithm only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Params {
    SlidingLog(sliding_log::Params),
    TokenBucket(token_bucket::Params),
    Gcra(gcra::Params),
    FixedWindow(fixed_window::Params),
    SlidingWindow(sliding_window::Params),
}

impl Params {
    /// Whose parameters these are.
    pub(crate) fn algorithm(&self) -> Algorithm {
        match self {
            Params::SlidingLog(_) => Algorithm::SlidingLog,
            Params::TokenBucket(_) => Algorithm::TokenBucket,
            Params::Gcra(_) => Algorithm::Gcra,
            Params::FixedWindow(_) => Algorithm::FixedWindow,
            Params::SlidingWindow(_) => Algorithm::SlidingWindow,
        }
    }

    /// The most one decision can be granted: a larger cost never fits.
    pub(crate) fn capacity(&self) -> i64 {
        match self {
            Params::SlidingLog(p) => p.limit,
            Params::TokenBucket(p) => p.capacity,
            Params::Gcra(p) => p.burst,
            Params::FixedWindow(p) => p.limit,
            Params::SlidingWindow(p) => p.limit,
        }
    }

    /// The parameters as a limit's string sends them to the scripts, after
    /// the algorithm's id (see `lua/driver.lua`): the one place their order
    /// is written. The first is the capacity (the driver reads it as such);
    /// the third is 0 for the algorithms of two parameters (a sliding log,
    /// a fixed window), so that every limit's string has one shape, and a
    /// calendar quota's code for a window algorithm (negative, see
    /// `calendar.rs`).
    pub(crate) fn wire(&self) -> [i64; 3] {
        match *self {
            Params::SlidingLog(p) => [p.limit, p.window, 0],
            Params::TokenBucket(p) => [p.capacity, p.rate, p.period],
            Params::Gcra(p) => [p.burst, p.rate, p.period],
            // a calendar quota's third parameter is its code, negative
            Params::FixedWindow(p) => [p.limit, p.window, p.calendar.map_or(0, |c| c.code())],
            Params::SlidingWindow(p) => [
                p.limit,
                p.window,
                p.calendar.map_or(i64::from(p.step), |c| c.code()),
            ],
        }
    }
}

impl Params {
    /// Reads what [`Limit::stored_form`](crate::Limit) writes,
    /// `algorithm:p1:p2:p3:`, or what 0.1 wrote,
    /// `algorithm:p1:p2:p3:0:` (a fourth slot, always 0, since removed):
    /// `None` for anything else, and for
    /// parameters no valid limit has (those `derive` in src/limit.rs would
    /// not make of any quota: a zero, a window over ten years, a bucket's
    /// rate and period not in lowest terms, a product the scripts form over
    /// 2^53, an unused field not 0). `valid_kept` in `lua/kept.lua`
    /// accepts exactly these, so that a value written by hand or by another
    /// program decides in neither or both.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn from_stored(text: &[u8]) -> Option<Params> {
        let text = text.strip_suffix(b":")?;
        let mut fields = text.split(|&b| b == b':').map(|field| {
            // digits only (no sign), as the scripts' pattern reads them
            if field.is_empty() || !field.iter().all(u8::is_ascii_digit) {
                return None;
            }
            std::str::from_utf8(field)
                .ok()?
                .parse::<i64>()
                .ok()
                .filter(|&x| x < EXACT)
        });
        let mut next = || fields.next().flatten();
        let (id, a, b, c) = (next()?, next()?, next()?, next()?);
        // the old form's fourth slot, 0
        let old = fields.next();
        // the algorithm's id is one digit (the scripts compare its byte)
        if old.is_some_and(|d| d != Some(0))
            || fields.next().is_some()
            || text.get(1) != Some(&b':')
        {
            return None;
        }
        let positive = |x: i64| (x > 0).then_some(x);
        let params = match id {
            1 => Params::SlidingLog(sliding_log::Params {
                limit: positive(a)?,
                window: positive(b)?,
            }),
            2 => Params::TokenBucket(token_bucket::Params {
                capacity: positive(a)?,
                rate: positive(b)?,
                period: positive(c)?,
            }),
            3 => Params::Gcra(gcra::Params {
                burst: positive(a)?,
                rate: positive(b)?,
                period: positive(c)?,
            }),
            // (never a calendar quota: its code is negative)
            4 => Params::FixedWindow(fixed_window::Params {
                limit: positive(a)?,
                window: positive(b)?,
                calendar: None,
            }),
            5 => Params::SlidingWindow(sliding_window::Params {
                limit: positive(a)?,
                window: positive(b)?,
                step: i32::try_from(positive(c)?).ok()?,
                calendar: None,
            }),
            _ => return None,
        };
        // the fields as this limit writes them, and a limit derives them
        let (derived, _) = crate::limit::derive(&params.quota()).ok()?;
        (derived == params && params.wire() == [a, b, c]).then_some(params)
    }

    /// The time in which a spent capacity comes back in full, in
    /// microseconds: the `w` of `RateLimit-Policy` (see
    /// [`Limit::policy_window`](crate::Limit::policy_window)).
    /// It is the limit's [`horizon`] but for a sliding window, whose
    /// horizon spans two windows.
    pub(crate) fn policy_window_us(&self) -> u64 {
        let us = match *self {
            Params::SlidingWindow(p) => p.window,
            _ => horizon(self),
        };
        u64::try_from(us).unwrap_or(0)
    }

    /// A quota that derives these parameters (the rate and period of a
    /// bucket in lowest terms).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn quota(&self) -> crate::Quota {
        use crate::Quota;
        let us = |x: i64| std::time::Duration::from_micros(u64::try_from(x).unwrap_or(0));
        let n = |x: i64| u64::try_from(x).unwrap_or(0);
        match *self {
            Params::SlidingLog(p) => Quota::sliding_log(n(p.limit), us(p.window)),
            Params::TokenBucket(p) => Quota::token_bucket(n(p.capacity), n(p.rate), us(p.period)),
            Params::Gcra(p) => Quota::gcra(n(p.rate), us(p.period), n(p.burst)),
            Params::FixedWindow(p) => Quota {
                calendar: p.calendar,
                ..Quota::fixed_window(n(p.limit), us(p.window))
            },
            Params::SlidingWindow(p) => Quota {
                calendar: p.calendar,
                ..Quota::sliding_window(n(p.limit), us(p.window))
            },
        }
    }
}
