//! Mirror of `lua/sliding_window.lua`: previous and current window counts.

use super::{cdiv, fdiv};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlidingWindow {
    start: i64,
    prev: i64,
    cur: i64,
}

impl Default for SlidingWindow {
    fn default() -> Self {
        Self {
            start: -1,
            prev: 0,
            cur: 0,
        }
    }
}

impl SlidingWindow {
    /// (previous, current) counts as seen from the window beginning at `start`.
    fn counts(&self, p: &[i64; 4], start: i64) -> (i64, i64) {
        if self.start == start {
            (self.prev, self.cur)
        } else if self.start == start - p[1] {
            (self.cur, 0)
        } else {
            (0, 0)
        }
    }

    pub(crate) fn earliest(&self, p: &[i64; 4], now: i64, cost: i64) -> Option<i64> {
        let (n, w, u) = (p[0], p[1], p[2]);
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

    pub(crate) fn grant(&mut self, p: &[i64; 4], at: i64, cost: i64) {
        let start = at - at.rem_euclid(p[1]);
        let (prev, cur) = self.counts(p, start);
        *self = Self {
            start,
            prev,
            cur: cur + cost,
        };
    }

    pub(crate) fn status(&self, p: &[i64; 4], now: i64, at: i64) -> (i64, i64) {
        let (n, w, u) = (p[0], p[1], p[2]);
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

    pub(crate) fn ttl(&self, p: &[i64; 4], now: i64) -> i64 {
        self.start + 2 * p[1] - now
    }
}
