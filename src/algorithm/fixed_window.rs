//! Mirror of `lua/fixed_window.lua`: a count for the window starting at `start`.

use super::as_of;
use super::calendar::Calendar;

/// The integers this algorithm decides with: at most `limit` permits per
/// window of `window` microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Params {
    /// The most granted per window.
    pub(crate) limit: i64,
    /// The window, in microseconds, aligned to the epoch; a calendar
    /// quota's longest.
    pub(crate) window: i64,
    /// A calendar quota's periods, in place of windows aligned to the epoch.
    pub(crate) calendar: Option<Calendar>,
}

impl Params {
    /// The window that holds `at`: its start and length (us).
    pub(crate) fn window_at(&self, at: i64) -> (i64, i64) {
        match self.calendar {
            None => (at - at.rem_euclid(self.window), self.window),
            Some(c) => {
                let (start, len, _) = c.window(at);
                (start, len)
            }
        }
    }

    /// The length of the window that begins at `start` (us).
    fn len_at(&self, start: i64) -> i64 {
        self.calendar.map_or(self.window, |c| c.window(start).1)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FixedWindow {
    start: i64,
    count: i64,
}

/// What the store keeps: (start, window length, count).
pub(crate) type Raw = (i64, i64, i64);

impl super::Raw for Raw {
    fn expires_at(&self) -> i64 {
        self.0 + self.1
    }

    fn move_back(&mut self, by: i64) {
        self.0 -= by;
    }
}

impl FixedWindow {
    /// The working state of what the store keeps (`None`: fresh), see
    /// `State::prepare`; `true` when it was moved back to `now` and still
    /// holds something.
    pub(crate) fn prepare(p: &Params, raw: Option<Raw>, written: i64, now: i64) -> (Self, bool) {
        let w = p.window;
        let fresh = Self {
            start: -1,
            count: 0,
        };
        // absent, or its window is over
        let (Some((s, len, count)), moved) = as_of(raw, written, now) else {
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

    fn count_in(&self, start: i64) -> i64 {
        if self.start == start {
            self.count
        } else {
            0
        }
    }

    pub(crate) fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
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

    pub(crate) fn grant(&mut self, p: &Params, at: i64, cost: i64) {
        let (start, _) = p.window_at(at);
        self.count = self.count_in(start) + cost;
        self.start = start;
    }

    /// Gives back `cost` granted at `at` (as `fw_refund`): only when `at`
    /// lies in the window the state counts, never below zero.
    pub(crate) fn refund(&mut self, p: &Params, at: i64, cost: i64) -> bool {
        if self.start < 0 || self.count == 0 || p.window_at(at).0 != self.start {
            return false;
        }
        self.count = (self.count - cost).max(0);
        true
    }

    pub(crate) fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
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
    pub(crate) fn save(&self, p: &Params) -> Raw {
        (self.start, p.len_at(self.start), self.count)
    }
}
