//! Mirror of `lua/fixed_window.lua`: a count for the window starting at `start`.

/// The integers this algorithm decides with: at most `limit` permits per
/// window of `window` microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Params {
    /// The most granted per window.
    pub(crate) limit: i64,
    /// The window, in microseconds, aligned to the epoch.
    pub(crate) window: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FixedWindow {
    /// What the store keeps: (start, window length, count); nothing when fresh.
    raw: Option<Raw>,
    start: i64,
    count: i64,
}

/// What the store keeps: (start, window length, count).
pub(crate) type Raw = (i64, i64, i64);

/// When a stored state becomes equal to a fresh one (what `save` returned).
pub(crate) fn expires_at(raw: &Raw) -> i64 {
    raw.0 + raw.1
}

impl Default for FixedWindow {
    fn default() -> Self {
        Self {
            raw: None,
            start: -1,
            count: 0,
        }
    }
}

impl FixedWindow {
    /// A state to `prepare` from what the store keeps (`None`: fresh).
    pub(crate) fn from_raw(raw: Option<Raw>) -> Self {
        Self {
            raw,
            ..Self::default()
        }
    }

    /// What the store keeps, once loaded or saved.
    pub(crate) fn raw(&self) -> Option<Raw> {
        self.raw
    }

    /// See `State::prepare`: `true` when the state was moved back to `now`
    /// and still holds something.
    pub(crate) fn prepare(&mut self, p: &Params, written: i64, now: i64) -> bool {
        let w = p.window;
        (self.start, self.count) = (-1, 0);
        let moved = written > now;
        if let Some(raw) = self.raw.as_mut().filter(|_| moved) {
            raw.0 -= written - now;
        }
        // absent, or its window is over
        let Some((s, len, count)) = self.raw.filter(|raw| raw.0 + raw.1 > now) else {
            return false;
        };
        if len == w && !moved {
            (self.start, self.count) = (s, count);
            return false;
        }
        // (a moved window need not start where one of this limit's does)
        let r = if s > now {
            s - s.rem_euclid(w)
        } else {
            now - now.rem_euclid(w)
        };
        if s < r + w && r < s + len {
            (self.start, self.count) = (r, count);
            return moved;
        }
        false
    }

    fn count_in(&self, start: i64) -> i64 {
        if self.start == start {
            self.count
        } else {
            0
        }
    }

    pub(crate) fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
        let (n, w) = (p.limit, p.window);
        if cost > n {
            return None;
        }
        let start = (now - now.rem_euclid(w)).max(self.start);
        if self.count_in(start) + cost <= n {
            return Some(now.max(start));
        }
        Some(start + w)
    }

    pub(crate) fn grant(&mut self, p: &Params, at: i64, cost: i64) {
        let start = at - at.rem_euclid(p.window);
        self.count = self.count_in(start) + cost;
        self.start = start;
    }

    /// Gives back `cost` granted at `at` (as `fw_refund`): only when `at`
    /// lies in the window the state counts, never below zero.
    pub(crate) fn refund(&mut self, p: &Params, at: i64, cost: i64) -> bool {
        if self.start < 0 || self.count == 0 || at - at.rem_euclid(p.window) != self.start {
            return false;
        }
        self.count = (self.count - cost).max(0);
        true
    }

    pub(crate) fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
        let (n, w) = (p.limit, p.window);
        let start = at - at.rem_euclid(w);
        if self.start > start {
            (0, self.start + w - now)
        } else if self.start == start {
            ((n - self.count).max(0), start + w - now)
        } else {
            (n, 0)
        }
    }

    /// Records the working state as the store keeps it; returns when it
    /// becomes equal to a fresh one.
    pub(crate) fn save(&mut self, p: &Params) -> i64 {
        self.raw = Some((self.start, p.window, self.count));
        self.start + p.window
    }
}
