//! Mirror of `lua/sliding_window.lua`: previous and current window counts.

use super::params::Shape;
use super::{as_of, cdiv, fdiv, Algo, ConfigError, Quota};

/// The weights of a window's estimate have 2^20 steps per window.
const WEIGHT_STEPS: u64 = 1 << 20;

/// The integers this algorithm decides with: about `limit` permits in any
/// window of `window` microseconds, weighed in steps of `step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Params {
    /// The most granted per estimated window.
    pub(crate) limit: i64,
    /// The window, in microseconds.
    pub(crate) window: i64,
    /// One 2^-20 of the window, rounded up: the unit of the previous
    /// window's weight.
    pub(crate) step: i64,
}

impl Shape for Params {
    const KIND: &'static str = "weighted";

    fn derive(q: &Quota, window: u128) -> Result<Self, ConfigError> {
        let steps = u128::from(WEIGHT_STEPS);
        super::params::exact(u128::from(q.amount) * steps, "the limit times 2^20")?;
        let super::params::Window { limit, window: us } = Shape::derive(q, window)?;
        Ok(Self {
            limit,
            window: us,
            step: super::params::exact(window.div_ceil(steps), "the weight step")?,
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

    fn wire(&self) -> [i64; 3] {
        [self.limit, self.window, self.step]
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlidingWindow {
    start: i64,
    prev: i64,
    cur: i64,
}

/// What the store keeps: (start, window length, previous, current).
pub(crate) type Raw = (i64, i64, i64, i64);

impl super::Raw for Raw {
    fn expires_at(&self) -> i64 {
        self.0 + 2 * self.1
    }

    fn move_back(&mut self, by: i64) {
        self.0 -= by;
    }
}

impl SlidingWindow {
    /// What the store keeps, as counts of this limit's windows.
    fn read(p: &Params, raw: Option<&mut Raw>, written: i64, now: i64) -> (Self, bool) {
        let w = p.window;
        let mut s = Self {
            start: -1,
            prev: 0,
            cur: 0,
        };
        // absent, or both windows over
        let (Some((start, len, prev, cur)), moved) = as_of(raw.copied(), written, now) else {
            return (s, false);
        };
        if len == w && !moved {
            (s.start, s.prev, s.cur) = (start, prev, cur);
            return (s, false);
        }
        // (a moved window need not start where one of this limit's does)
        let r = if start > now {
            start - start.rem_euclid(w)
        } else {
            now - now.rem_euclid(w)
        };
        for (count, from, to) in [(cur, start, start + len), (prev, start - len, start)] {
            if count > 0 {
                if from < r + w && r < to {
                    s.cur += count;
                } else if from < r && r - w < to {
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

    /// (previous, current) counts as seen from the window beginning at `start`.
    fn counts(&self, p: &Params, start: i64) -> (i64, i64) {
        if self.start == start {
            (self.prev, self.cur)
        } else if self.start == start - p.window {
            (self.cur, 0)
        } else {
            (0, 0)
        }
    }
}

impl Algo for SlidingWindow {
    type Params = Params;
    type Stored = Raw;
    const NAME: &'static str = "sliding window counter";
    const KEYS: &'static [&'static str] = &["sw"];
    const AMOUNT: &'static str = "limit";
    const RATE: Option<&'static str> = None;

    /// `None`: fresh.
    fn prepare(p: &Params, stored: Option<&mut Raw>, written: i64, now: i64) -> (Self, bool) {
        let (mut s, moved) = Self::read(p, stored, written, now);
        // rolled forward to the window of now: from here `start` is at or
        // after it (a past window's count is previous, if it was the window
        // before, else gone; this changes no decision)
        let current = now - now.rem_euclid(p.window);
        if s.start < current {
            (s.prev, s.cur) = s.counts(p, current);
            s.start = current;
        }
        (s, moved)
    }

    fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
        let (n, w, u) = (p.limit, p.window, p.step);
        if cost > n {
            return None;
        }
        let wu = cdiv(w, u);
        let mut start = (now - now.rem_euclid(w)).max(self.start);
        let from = now.max(start);
        for _ in 0..3 {
            let (prev, cur) = self.counts(p, start);
            if cur + cost <= n {
                if prev == 0 {
                    return Some(from.max(start));
                }
                let steps = fdiv((n - cur - cost) * wu, prev);
                let t = start.max(start + w - steps * u);
                if t < start + w {
                    return Some(from.max(t));
                }
            }
            start += w;
        }
        Some(from.max(start))
    }

    fn grant(&mut self, p: &Params, at: i64, cost: i64) {
        let start = at - at.rem_euclid(p.window);
        let (prev, cur) = self.counts(p, start);
        (self.start, self.prev, self.cur) = (start, prev, cur + cost);
    }

    /// Gives back `cost` granted at `at` (as `sw_refund`): from the current
    /// or the previous window, whichever holds `at`; nothing if older.
    /// Never below zero.
    fn refund(&mut self, p: &Params, _now: i64, at: i64, cost: i64) -> bool {
        if self.start < 0 {
            return false;
        }
        let start = at - at.rem_euclid(p.window);
        if start == self.start && self.cur > 0 {
            self.cur = (self.cur - cost).max(0);
            true
        } else if start == self.start - p.window && self.prev > 0 {
            self.prev = (self.prev - cost).max(0);
            true
        } else {
            false
        }
    }

    fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
        let (n, w, u) = (p.limit, p.window, p.step);
        let start = at - at.rem_euclid(w);
        if self.start > start {
            return (0, self.start + 2 * w - now);
        }
        let (prev, cur) = self.counts(p, start);
        let used = cur + cdiv(prev * cdiv(start + w - at, u), cdiv(w, u));
        let reset = if cur > 0 {
            start + 2 * w - now
        } else if prev > 0 {
            start + w - now
        } else {
            0
        };
        ((n - used).max(0), reset)
    }

    /// The working state as the store keeps it.
    fn save(self, p: &Params, _now: i64) -> Raw {
        (self.start, p.window, self.prev, self.cur)
    }
}
