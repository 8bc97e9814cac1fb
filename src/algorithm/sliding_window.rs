//! Mirror of `lua/sliding_window.lua`: previous and current window counts.

use super::calendar;
use super::params::Shape;
use super::{as_of, cdiv, fdiv, Algo, ConfigError, Quota};
use crate::calendar::Calendar;

/// The weights of a window's estimate have 2^20 steps per window.
const WEIGHT_STEPS: u64 = 1 << 20;

/// The integers this algorithm decides with: about `limit` permits in any
/// window of `window` microseconds, weighed in steps of `step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Params {
    /// The most granted per estimated window.
    pub(crate) limit: i64,
    /// The window, in microseconds; a calendar quota's longest.
    pub(crate) window: i64,
    /// One 2^-20 of the window, rounded up: the unit of the previous
    /// window's weight (a calendar quota's: of the previous period's).
    pub(crate) step: i32,
    /// A calendar quota's periods, in place of windows aligned to the epoch.
    pub(crate) calendar: Option<Calendar>,
}

impl Params {
    /// The window that holds `at`: its start, its length and the length of
    /// the one before it (us).
    pub(crate) fn window_at(&self, at: i64) -> (i64, i64, i64) {
        match self.calendar {
            None => (at - at.rem_euclid(self.window), self.window, self.window),
            Some(c) => calendar::window(c, at),
        }
    }

    /// The length of the window that begins at `start` and of the one
    /// before it (us).
    fn lengths(&self, start: i64) -> (i64, i64) {
        self.calendar.map_or((self.window, self.window), |c| {
            let (_, len, before) = calendar::window(c, start);
            (len, before)
        })
    }

    /// When the count of the window that begins at `start` stops weighing:
    /// its length after the next window begins, or that window's end if
    /// sooner.
    fn weighs_until(&self, start: i64) -> i64 {
        let (len, _) = self.lengths(start);
        start + len + len.min(self.lengths(start + len).0)
    }

    /// The weight step of a previous window of `len` us and the steps in
    /// it: `step` and ceil(W / step) (see `lua/sliding_window.lua`).
    fn steps(&self, len: i64) -> (i64, i64) {
        let u = match self.calendar {
            None => i64::from(self.step),
            Some(_) => cdiv(len, 1 << 20),
        };
        (u, cdiv(len, u))
    }
}

impl Shape for Params {
    const KIND: &'static str = "weighted";

    fn derive(q: &Quota, window: u128) -> Result<Self, ConfigError> {
        let steps = u128::from(WEIGHT_STEPS);
        super::params::exact(u128::from(q.amount) * steps, "the limit times 2^20")?;
        let super::params::Window {
            limit,
            window: us,
            calendar,
        } = Shape::derive(q, window)?;
        Ok(Self {
            limit,
            window: us,
            // (under 2^29: the window is at most ten years)
            step: i32::try_from(window.div_ceil(steps))
                .map_err(|_| ConfigError::OutOfRange("the weight step is too large".to_owned()))?,
            calendar,
        })
    }

    fn capacity(&self) -> i64 {
        self.limit
    }

    /// Two windows: the estimate spans the previous one.
    fn horizon(&self) -> i64 {
        2 * self.window
    }

    /// One window (its horizon spans two).
    fn policy_window(&self) -> i64 {
        self.window
    }

    /// A calendar quota's third parameter is its code, negative (see
    /// `calendar.rs`).
    fn wire(&self) -> [i64; 3] {
        [
            self.limit,
            self.window,
            self.calendar.map_or(i64::from(self.step), calendar::code),
        ]
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlidingWindow {
    start: i64,
    prev: i64,
    cur: i64,
}

/// What the store keeps: (start, window length, previous, current).
pub(crate) type Stored = (i64, i64, i64, i64);

impl super::StoredForm for Stored {
    fn expires_at(&self) -> i64 {
        self.0 + 2 * self.1
    }

    fn move_back(&mut self, by: i64) {
        self.0 -= by;
    }
}

impl SlidingWindow {
    /// What the store keeps, as counts of this limit's windows.
    fn read(p: &Params, stored: Option<&mut Stored>, written: i64, now: i64) -> (Self, bool) {
        let w = p.window;
        let mut s = Self {
            start: -1,
            prev: 0,
            cur: 0,
        };
        // absent, or both windows over
        let (Some((start, len, prev, cur)), moved) = as_of(stored.copied(), written, now) else {
            return (s, false);
        };
        // one of this limit's windows
        let own = match p.calendar {
            None => len == w,
            Some(_) => matches!(p.window_at(start), (s, l, _) if (s, l) == (start, len)),
        };
        if own && !moved {
            (s.start, s.prev, s.cur) = (start, prev, cur);
            return (s, false);
        }
        // (a moved window need not start where one of this limit's does)
        let (r, rl, rb) = p.window_at(start.max(now));
        for (count, from, to) in [(cur, start, start + len), (prev, start - len, start)] {
            if count > 0 {
                if from < r + rl && r < to {
                    s.cur += count;
                } else if from < r && r - rb < to {
                    s.prev += count;
                }
            }
        }
        if s.prev + s.cur > 0 {
            s.start = r;
            return (s, moved);
        }
        (s, false)
    }

    /// (previous, current) counts as seen from the window beginning at
    /// `start`, after one of `before` us.
    fn counts(&self, start: i64, before: i64) -> (i64, i64) {
        if self.start == start {
            (self.prev, self.cur)
        } else if self.start == start - before {
            (self.cur, 0)
        } else {
            (0, 0)
        }
    }
}

impl Algo for SlidingWindow {
    type Params = Params;
    type Stored = Stored;
    const NAME: &'static str = "sliding window counter";
    const KEYS: &'static [&'static str] = &["sw"];
    const AMOUNT: &'static str = "limit";
    const RATE: Option<&'static str> = None;

    /// `None`: fresh.
    fn prepare(p: &Params, stored: Option<&mut Stored>, written: i64, now: i64) -> (Self, bool) {
        let (mut s, moved) = Self::read(p, stored, written, now);
        // rolled forward to the window of now: from here `start` is at or
        // after it (a past window's count is previous, if it was the window
        // before, else gone; this changes no decision)
        let (current, _, before) = p.window_at(now);
        if s.start < current {
            (s.prev, s.cur) = s.counts(current, before);
            s.start = current;
        }
        (s, moved)
    }

    fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
        let n = p.limit;
        if cost > n {
            return None;
        }
        // the window of now, or the counted one after it
        let (mut start, mut len, mut before) = p.window_at(now);
        if self.start > start {
            start = self.start;
            (len, before) = p.lengths(start);
        }
        let from = now.max(start);
        for _ in 0..3 {
            let (prev, cur) = self.counts(start, before);
            if cur + cost <= n {
                if prev == 0 {
                    return Some(from.max(start));
                }
                // the previous window weighs until `before` after `start`
                let (u, wu) = p.steps(before);
                let steps = fdiv((n - cur - cost) * wu, prev);
                let t = start.max(start + before - steps * u);
                if t < start + len {
                    return Some(from.max(t));
                }
            }
            start += len;
            (len, before) = p.lengths(start);
        }
        Some(from.max(start))
    }

    fn grant(&mut self, p: &Params, at: i64, cost: i64) {
        let (start, _, before) = p.window_at(at);
        let (prev, cur) = self.counts(start, before);
        (self.start, self.prev, self.cur) = (start, prev, cur + cost);
    }

    /// Gives back `cost` granted at `at` (as `sw_refund`): from the current
    /// or the previous window, whichever holds `at`; nothing if older.
    /// Never below zero.
    fn refund(&mut self, p: &Params, _now: i64, at: i64, cost: i64) -> bool {
        if self.start < 0 {
            return false;
        }
        let (start, len, _) = p.window_at(at);
        if start == self.start && self.cur > 0 {
            self.cur = (self.cur - cost).max(0);
            true
        } else if start + len == self.start && self.prev > 0 {
            self.prev = (self.prev - cost).max(0);
            true
        } else {
            false
        }
    }

    fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
        let n = p.limit;
        let (start, len, before) = p.window_at(at);
        if self.start > start {
            return (0, p.weighs_until(self.start) - now);
        }
        let (prev, cur) = self.counts(start, before);
        // the previous window weighs until `before` after `start`
        let (u, wu) = p.steps(before);
        let used = cur + cdiv(prev * cdiv((start + before - at).max(0), u), wu);
        let reset = if cur > 0 {
            p.weighs_until(start) - now
        } else if prev > 0 {
            start + before.min(len) - now
        } else {
            0
        };
        ((n - used).max(0), reset)
    }

    /// The working state as the store keeps it.
    fn save(self, p: &Params, _now: i64) -> Stored {
        (self.start, p.lengths(self.start).0, self.prev, self.cur)
    }
}
