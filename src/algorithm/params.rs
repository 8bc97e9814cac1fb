//! The parameters of a limit's algorithm: derived once from its quota and
//! checked to stay exact in the doubles Redis Lua computes with, read from a
//! stored quota's form in the store.

use std::time::Duration;

use super::calendar;
use super::{Params, State, Stored, EXACT};
use crate::calendar::Calendar;
use crate::quota::{Algorithm, Quota};
use crate::ConfigError;

/// Longest accepted window: ten years, so `now + window` stays far below 2^53 us.
const MAX_WINDOW_MICROS: u128 = 10 * 366 * 86_400 * 1_000_000;

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// `value` as an integer the scripts compute with exactly (below 2^53).
pub(super) fn exact(value: u128, what: &str) -> Result<i64, ConfigError> {
    if value >= EXACT as u128 {
        return Err(ConfigError::OutOfRange(format!(
            "{what} is {value}, which must stay below 2^53 for exact arithmetic"
        )));
    }
    i64::try_from(value).map_err(|_| ConfigError::OutOfRange(format!("{what} is too large")))
}

/// The parameters of the algorithms of one shape: a window's ([`Window`]),
/// a bucket's ([`Bucket`]), a sliding window counter's.
pub(crate) trait Shape: Copy + std::fmt::Debug + Eq {
    /// Its name in `lua/wire.lua`, which `valid_kept` in `lua/kept.lua`
    /// checks a stored quota's parameters by.
    const KIND: &'static str;
    /// The parameters of a quota whose window (`window` microseconds, at
    /// most ten years) and amount are checked (see [`Params::derive`]).
    fn derive(q: &Quota, window: u128) -> Result<Self, ConfigError>;
    /// The most one decision can be granted: a larger cost never fits.
    fn capacity(&self) -> i64;
    /// The longest wait a limit asks by itself (`horizon` in its script):
    /// one window, a full bucket's refill.
    fn horizon(&self) -> i64;
    /// The time in which a spent capacity comes back in full: the `w` of
    /// `RateLimit-Policy`.
    fn policy_window(&self) -> i64 {
        self.horizon()
    }
    /// The parameters as a limit's string sends them, after its id (see
    /// `lua/driver.lua`): the capacity first (the driver reads it as such),
    /// 0 in a slot it does not use.
    fn wire(&self) -> [i64; 3];
}

/// A window's parameters (a sliding log's, a fixed window's): at most
/// `limit` permits per `window` microseconds (a calendar quota's longest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    pub(crate) limit: i64,
    pub(crate) window: i64,
    /// A fixed window's calendar periods, in place of windows aligned to
    /// the epoch (a sliding log has none).
    pub(crate) calendar: Option<Calendar>,
}

impl Window {
    /// The window that holds `at`: its start and length (us).
    pub(crate) fn window_at(&self, at: i64) -> (i64, i64) {
        match self.calendar {
            None => (at - at.rem_euclid(self.window), self.window),
            Some(c) => {
                let (start, len, _) = calendar::window(c, at);
                (start, len)
            }
        }
    }

    /// The length of the window that begins at `start` (us).
    pub(crate) fn len_at(&self, start: i64) -> i64 {
        self.calendar
            .map_or(self.window, |c| calendar::window(c, start).1)
    }
}

impl Shape for Window {
    const KIND: &'static str = "window";

    fn derive(q: &Quota, window: u128) -> Result<Self, ConfigError> {
        Ok(Self {
            limit: exact(u128::from(q.amount), "the limit")?,
            window: exact(window, "the window in microseconds")?,
            // (a sliding log's quota has none: see `CalendarRate`)
            calendar: q.calendar,
        })
    }

    fn capacity(&self) -> i64 {
        self.limit
    }

    fn horizon(&self) -> i64 {
        self.window
    }

    /// A calendar quota's third parameter is its code, negative (see
    /// `calendar.rs`).
    fn wire(&self) -> [i64; 3] {
        [
            self.limit,
            self.window,
            self.calendar.map_or(0, calendar::code),
        ]
    }
}

/// A bucket's parameters (a token bucket's, GCRA's): `capacity` at once,
/// `rate` back per `period` microseconds (the two reduced by their gcd).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bucket {
    pub(crate) capacity: i64,
    pub(crate) rate: i64,
    pub(crate) period: i64,
}

impl Shape for Bucket {
    const KIND: &'static str = "bucket";

    fn derive(q: &Quota, window: u128) -> Result<Self, ConfigError> {
        let (amount_name, rate_name) = (q.algorithm.amount_name(), q.algorithm.rate_name());
        let rate_name = rate_name.unwrap_or("rate");
        if q.extra == 0 {
            return Err(ConfigError::ZeroAmount { what: rate_name });
        }
        let amount = u128::from(q.amount);
        let g = gcd(u128::from(q.extra), window);
        let (per, period) = (u128::from(q.extra) / g, window / g);
        let capacity = exact(amount, amount_name)?;
        let rate = exact(per, rate_name)?;
        let period_us = exact(period, "the reduced period in microseconds")?;
        // The largest products the scripts form: capacity * period (+ rate).
        exact(amount * period + per, "capacity times reduced period")?;
        Ok(Self {
            capacity,
            rate,
            period: period_us,
        })
    }

    fn capacity(&self) -> i64 {
        self.capacity
    }

    /// A full bucket's refill (a full burst's emission).
    fn horizon(&self) -> i64 {
        super::cdiv(self.capacity * self.period, self.rate)
    }

    fn wire(&self) -> [i64; 3] {
        [self.capacity, self.rate, self.period]
    }
}

impl Params {
    /// The parameters of `q` and its policy window, or why it is not a
    /// valid quota.
    pub(crate) fn derive(q: &Quota) -> Result<(Params, Duration), ConfigError> {
        let window = q.window.as_micros();
        let window_name = match q.algorithm.rate_name() {
            Some(_) => "period",
            None => "window",
        };
        if window == 0 {
            return Err(ConfigError::ZeroWindow { what: window_name });
        }
        if window > MAX_WINDOW_MICROS {
            return Err(ConfigError::OutOfRange(format!(
                "the {window_name} is longer than ten years"
            )));
        }
        if q.amount == 0 {
            return Err(ConfigError::ZeroAmount {
                what: q.algorithm.amount_name(),
            });
        }
        if let Some(c) = q.calendar {
            // whole minutes under a day (see `CalendarRate::east_of_utc`)
            if c.offset.unsigned_abs() >= 24 * 60 {
                return Err(ConfigError::OutOfRange(
                    "a calendar quota's offset from UTC must be whole minutes under a day"
                        .to_owned(),
                ));
            }
        }
        let params = q.algorithm.params(q, window)?;
        Ok((params, Duration::from_micros(params.policy_window_us())))
    }

    /// Reads a limit's stored form (`write_stored_form` in
    /// `store/redis/encode.rs`), `algorithm:p1:p2:p3:`, or what 0.1
    /// wrote, `algorithm:p1:p2:p3:0:` (a fourth slot, always 0, since
    /// removed): `None` for anything else, and for parameters no valid
    /// limit has (those [`derive`](Self::derive) would not make of any
    /// quota: a zero, a window over ten years, a bucket's rate and period
    /// not in lowest terms, a product the scripts form over 2^53, an unused
    /// field not 0). `valid_kept` in `lua/kept.lua` accepts exactly these,
    /// so that a value written by hand or by another program decides in
    /// neither or both.
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
        // the fields as a limit writes them, and one derives them
        let algorithm = *super::ALGORITHMS.iter().find(|a| i64::from(a.id()) == id)?;
        let (params, _) = Self::derive(&quota_of(algorithm, [a, b, c])).ok()?;
        (params.wire() == [a, b, c]).then_some(params)
    }

    /// A quota that derives these parameters (the rate and period of a
    /// bucket in lowest terms).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn quota(&self) -> Quota {
        quota_of(self.algorithm(), self.wire())
    }
}

/// The quota of `algorithm` whose parameters would be `wire` (as
/// [`Params::wire`] writes them: a window's limit and window, a bucket's
/// capacity, rate and period).
fn quota_of(algorithm: Algorithm, [a, b, c]: [i64; 3]) -> Quota {
    let n = |x: i64| u64::try_from(x).unwrap_or(0);
    let (window, extra) = match algorithm.rate_name() {
        Some(_) => (c, n(b)),
        None => (b, 0),
    };
    Quota {
        algorithm,
        amount: n(a),
        window: Duration::from_micros(n(window)),
        extra,
        // (a stored quota is never a calendar quota: its code is negative)
        calendar: None,
    }
}

impl Stored {
    /// How much of `p`'s capacity the state, written at `written`, holds
    /// in use at `now` (0 when it is equal to a fresh one; more than the
    /// capacity in debt): what forgetting it would forget. Read as of
    /// `written` if that is later (so it is never moved back) and left as
    /// it was but for the pruning of a sliding log, as a refused decision
    /// leaves it.
    pub(crate) fn used(&mut self, p: &Params, written: i64, now: i64) -> i64 {
        let now = now.max(written);
        let (state, _) = State::prepare(Some(self), p, written, now);
        let (remaining, _) = state.status(p, now, now);
        state.restore(self);
        p.capacity().saturating_sub(remaining)
    }
}
