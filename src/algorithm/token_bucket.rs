//! Mirror of `lua/token_bucket.lua`: `level / den` tokens at `ts`.

use super::{cdiv, fdiv, rescale};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TokenBucket {
    /// What the store keeps: (level, den, ts), or nothing for a full bucket.
    raw: Option<(i64, i64, i64)>,
    /// The level in units of 1/P token of this limit, set by `prepare`.
    level: i64,
    ts: i64,
}

impl TokenBucket {
    pub(crate) fn prepare(&mut self, p: &[i64; 4], now: i64) {
        let full = p[0] * p[2];
        (self.level, self.ts) = (full, now);
        if let Some((level, den, ts)) = self.raw {
            self.ts = ts;
            if fdiv(level, den) < p[0] {
                self.level = rescale(level, den, p[2], false);
            }
        }
    }

    fn level_at(&self, p: &[i64; 4], t: i64) -> i64 {
        let full = p[0] * p[2];
        let need = full - self.level;
        let elapsed = t - self.ts;
        if elapsed <= 0 {
            return self.level;
        }
        if elapsed >= cdiv(need, p[1]) {
            return full;
        }
        self.level + elapsed * p[1]
    }

    pub(crate) fn earliest(&self, p: &[i64; 4], now: i64, cost: i64) -> Option<i64> {
        if cost > p[0] {
            return None;
        }
        let base = now.max(self.ts);
        let need = cost * p[2] - self.level_at(p, base);
        if need <= 0 {
            return Some(base);
        }
        Some(base + cdiv(need, p[1]))
    }

    pub(crate) fn grant(&mut self, p: &[i64; 4], at: i64, cost: i64) {
        self.level = self.level_at(p, at) - cost * p[2];
        self.ts = at;
    }

    pub(crate) fn status(&self, p: &[i64; 4], now: i64, at: i64) -> (i64, i64) {
        let t = at.max(self.ts);
        let level = self.level_at(p, t);
        let remaining = if self.ts > at { 0 } else { fdiv(level, p[2]) };
        (remaining, t - now + cdiv(p[0] * p[2] - level, p[1]))
    }

    /// Records the working state as the store keeps it; returns when it
    /// becomes equal to a fresh one.
    pub(crate) fn save(&mut self, p: &[i64; 4], now: i64) -> i64 {
        self.raw = Some((self.level, p[2], self.ts));
        now + self.status(p, now, now).1
    }
}
