//! Mirror of `lua/fixed_window.lua`: a count for the window starting at `start`.

use super::{as_of, Algo};

/// The integers it decides with: at most `limit` permits per window of
/// `window` microseconds, aligned to the epoch or to calendar periods.
pub(crate) type Params = super::params::Window;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FixedWindow {
    start: i64,
    count: i64,
}

/// What the store keeps: (start, window length, count).
pub(crate) type Stored = (i64, i64, i64);

impl super::StoredForm for Stored {
    fn expires_at(&self) -> i64 {
        self.0 + self.1
    }

    fn move_back(&mut self, by: i64) {
        self.0 -= by;
    }
}

impl FixedWindow {
    fn count_in(&self, start: i64) -> i64 {
        if self.start == start {
            self.count
        } else {
            0
        }
    }
}

impl Algo for FixedWindow {
    type Params = Params;
    type Stored = Stored;
    const NAME: &'static str = "fixed window";
    const KEYS: &'static [&'static str] = &["fw"];
    const AMOUNT: &'static str = "limit";
    const RATE: Option<&'static str> = None;

    /// `None`: fresh.
    fn prepare(p: &Params, stored: Option<&mut Stored>, written: i64, now: i64) -> (Self, bool) {
        let w = p.window;
        let fresh = Self {
            start: -1,
            count: 0,
        };
        // absent, or its window is over
        let (Some((s, len, count)), moved) = as_of(stored.copied(), written, now) else {
            return (fresh, false);
        };
        // one of this limit's windows
        let own = match p.calendar {
            None => len == w,
            Some(_) => p.window_at(s) == (s, len),
        };
        if own && !moved {
            return (Self { start: s, count }, false);
        }
        // (a moved window need not start where one of this limit's does)
        let (r, rl) = p.window_at(s.max(now));
        if s < r + rl && r < s + len {
            return (Self { start: r, count }, moved);
        }
        (fresh, false)
    }

    fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
        let n = p.limit;
        if cost > n {
            return None;
        }
        // the window of now, or the counted one after it
        let (mut start, mut len) = p.window_at(now);
        if self.start > start {
            (start, len) = (self.start, p.len_at(self.start));
        }
        if self.count_in(start) + cost <= n {
            return Some(now.max(start));
        }
        Some(start + len)
    }

    fn grant(&mut self, p: &Params, at: i64, cost: i64) {
        let (start, _) = p.window_at(at);
        self.count = self.count_in(start) + cost;
        self.start = start;
    }

    /// Gives back `cost` granted at `at` (as `fw_refund`): only when `at`
    /// lies in the window the state counts, never below zero.
    fn refund(&mut self, p: &Params, _now: i64, at: i64, cost: i64) -> bool {
        if self.start < 0 || self.count == 0 || p.window_at(at).0 != self.start {
            return false;
        }
        self.count = (self.count - cost).max(0);
        true
    }

    fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
        let n = p.limit;
        let (start, len) = p.window_at(at);
        if self.start > start {
            (0, self.start + p.len_at(self.start) - now)
        } else if self.start == start {
            ((n - self.count).max(0), start + len - now)
        } else {
            (n, 0)
        }
    }

    /// The working state as the store keeps it.
    fn save(self, p: &Params, _now: i64) -> Stored {
        (self.start, p.len_at(self.start), self.count)
    }
}
