//! Mirror of `lua/gcra.lua`: theoretical arrival time `tat + frac/N` us.

use super::{cdiv, fdiv};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Gcra {
    tat: i64,
    frac: i64,
}

impl Gcra {
    pub(crate) fn fresh(now: i64) -> Self {
        Self { tat: now, frac: 0 }
    }

    /// ceil(tat): an arrival in this tick is on time (see `lua/gcra.lua`).
    fn ceil(&self) -> i64 {
        self.tat + i64::from(self.frac > 0)
    }

    pub(crate) fn load(&mut self, now: i64) {
        if self.ceil() < now {
            *self = Self::fresh(now);
        }
    }

    pub(crate) fn earliest(&self, p: &[i64; 4], now: i64, cost: i64) -> Option<i64> {
        let (b, n, w) = (p[0], p[1], p[2]);
        if cost > b {
            return None;
        }
        Some(now.max(self.tat - fdiv((b - cost) * w - self.frac, n)))
    }

    pub(crate) fn grant(&mut self, p: &[i64; 4], at: i64, cost: i64) {
        if self.ceil() < at {
            *self = Self::fresh(at);
        }
        let total = self.frac + cost * p[2];
        let whole = fdiv(total, p[1]);
        self.tat += whole;
        self.frac = total - whole * p[1];
    }

    pub(crate) fn status(&self, p: &[i64; 4], now: i64, at: i64) -> (i64, i64) {
        let (b, n, w) = (p[0], p[1], p[2]);
        let used = if self.tat >= at {
            (self.tat - at) * n + self.frac
        } else {
            0
        };
        let remaining = fdiv(b * w - used, w).clamp(0, b);
        let reset = if self.tat >= now {
            self.tat - now + cdiv(self.frac, n)
        } else {
            0
        };
        (remaining, reset)
    }

    pub(crate) fn ttl(&self, now: i64) -> i64 {
        self.ceil() + 1 - now
    }
}
