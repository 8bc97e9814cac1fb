//! Mirror of `lua/token_bucket.lua`: `level / den` tokens at `ts`.

use super::{cdiv, fdiv, rescale, EXACT};

/// The integers this algorithm decides with: a bucket of `capacity` tokens,
/// `rate` back every `period` microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Params {
    /// The bucket's size.
    pub(crate) capacity: i64,
    /// Tokens back per `period` (reduced by their gcd).
    pub(crate) rate: i64,
    /// Microseconds per `rate` tokens (reduced by their gcd).
    pub(crate) period: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TokenBucket {
    /// What the store keeps, or nothing for a full bucket.
    raw: Option<Raw>,
    /// The level in units of 1/P token of this limit, set by `prepare`.
    level: i64,
    ts: i64,
    /// The largest capacity that wrote the state (stored as `cmax`; `keep`
    /// in the script).
    cmax: i64,
}

/// The fields of the script's key: `level / den` tokens at `ts`, and when
/// the bucket has refilled to `cmax`, the largest capacity that wrote it
/// (`exp`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Raw {
    level: i64,
    den: i64,
    ts: i64,
    exp: i64,
    cmax: i64,
}

impl Raw {
    /// When the state becomes equal to a fresh one (what `save` returned).
    pub(crate) fn expires_at(&self) -> i64 {
        self.exp
    }
}

impl TokenBucket {
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
        let full = p.capacity * p.period;
        (self.level, self.ts, self.cmax) = (full, now, p.capacity);
        let mut moved = false;
        if let Some(raw) = self.raw.as_mut().filter(|_| written > now) {
            (raw.ts, raw.exp) = (raw.ts - (written - now), raw.exp - (written - now));
            moved = raw.exp > now;
        }
        if let Some(raw) = self.raw.filter(|raw| raw.exp > now) {
            self.cmax = self.cmax.max(raw.cmax);
            self.ts = raw.ts;
            if fdiv(raw.level, raw.den) < p.capacity {
                self.level = rescale(raw.level, raw.den, p.period);
            }
        }
        moved
    }

    fn level_at(&self, p: &Params, t: i64) -> i64 {
        let full = p.capacity * p.period;
        let need = full - self.level;
        let elapsed = t - self.ts;
        if elapsed <= 0 {
            return self.level;
        }
        if elapsed >= cdiv(need, p.rate) {
            return full;
        }
        self.level + elapsed * p.rate
    }

    pub(crate) fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
        if cost > p.capacity {
            return None;
        }
        let base = now.max(self.ts);
        let need = cost * p.period - self.level_at(p, base);
        if need <= 0 {
            return Some(base);
        }
        Some(base + cdiv(need, p.rate))
    }

    pub(crate) fn grant(&mut self, p: &Params, at: i64, cost: i64) {
        self.level = self.level_at(p, at) - cost * p.period;
        self.ts = at;
    }

    /// Gives back `cost` tokens (as `tb_refund`), never above the capacity.
    /// `false` when the bucket is full already.
    pub(crate) fn refund(&mut self, p: &Params, cost: i64) -> bool {
        let full = p.capacity * p.period;
        if self.level >= full {
            return false;
        }
        self.level = (self.level + cost * p.period).min(full);
        true
    }

    pub(crate) fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
        let t = at.max(self.ts);
        let level = self.level_at(p, t);
        let remaining = if self.ts > at {
            0
        } else {
            fdiv(level, p.period)
        };
        (
            remaining,
            t - now + cdiv(p.capacity * p.period - level, p.rate),
        )
    }

    /// Records the working state as the store keeps it; returns when it
    /// becomes equal to a fresh one.
    pub(crate) fn save(&mut self, p: &Params, now: i64) -> i64 {
        let t = now.max(self.ts);
        let top = self.cmax.min(fdiv(EXACT - 1, p.period)) * p.period;
        let exp = t + cdiv(top - self.level_at(p, t), p.rate);
        self.raw = Some(Raw {
            level: self.level,
            den: p.period,
            ts: self.ts,
            exp,
            cmax: self.cmax,
        });
        exp
    }
}
