//! Mirror of `lua/token_bucket.lua`: level in 1/P token units at time `ts`.

use super::{cdiv, fdiv};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TokenBucket {
    level: i64,
    ts: i64,
}

impl TokenBucket {
    pub(crate) fn full(p: &[i64; 4], now: i64) -> Self {
        Self {
            level: p[0] * p[2],
            ts: now,
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
}
