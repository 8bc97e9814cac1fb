//! Mirror of `lua/token_bucket.lua`: `level / den` tokens at `ts`.

use super::{as_of, cdiv, fdiv, rescale, Algo, EXACT};

/// The integers it decides with: a bucket of `capacity` tokens, `rate`
/// back every `period` microseconds.
pub(crate) type Params = super::params::Bucket;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TokenBucket {
    /// The level in units of 1/P token of this limit, set by `prepare`.
    level: i64,
    ts: i64,
    /// The largest capacity that wrote the state (stored as `cmax`).
    cmax: i64,
}

/// The fields of the script's key: `level / den` tokens at `ts`, and when
/// the bucket has refilled to `cmax`, the largest capacity that wrote it
/// (`exp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stored {
    level: i64,
    den: i64,
    ts: i64,
    exp: i64,
    cmax: i64,
}

impl super::StoredForm for Stored {
    fn expires_at(&self) -> i64 {
        self.exp
    }

    fn move_back(&mut self, by: i64) {
        (self.ts, self.exp) = (self.ts - by, self.exp - by);
    }
}

impl TokenBucket {
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
}

impl Algo for TokenBucket {
    type Params = Params;
    type Stored = Stored;
    const NAME: &'static str = "token bucket";
    const KEYS: &'static [&'static str] = &["tb"];
    const AMOUNT: &'static str = "capacity";
    const RATE: Option<&'static str> = Some("refill");

    /// `None`: a full bucket.
    fn prepare(p: &Params, stored: Option<&mut Stored>, written: i64, now: i64) -> (Self, bool) {
        let mut s = Self {
            level: p.capacity * p.period,
            ts: now,
            cmax: p.capacity,
        };
        let (stored, moved) = as_of(stored.copied(), written, now);
        if let Some(stored) = stored {
            s.cmax = s.cmax.max(stored.cmax);
            s.ts = stored.ts;
            if fdiv(stored.level, stored.den) < p.capacity {
                s.level = rescale(stored.level, stored.den, p.period);
            }
            // refilled to now: from here `ts >= now` (the fill is linear
            // up to the capacity, so this changes no decision)
            if s.ts < now {
                (s.level, s.ts) = (s.level_at(p, now), now);
            }
        }
        (s, moved)
    }

    fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
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

    fn grant(&mut self, p: &Params, at: i64, cost: i64) {
        self.level = self.level_at(p, at) - cost * p.period;
        self.ts = at;
    }

    /// Gives back `cost` tokens (as `tb_refund`), never above the capacity.
    /// `false` when the bucket is full already.
    fn refund(&mut self, p: &Params, _now: i64, _at: i64, cost: i64) -> bool {
        let full = p.capacity * p.period;
        if self.level >= full {
            return false;
        }
        self.level = (self.level + cost * p.period).min(full);
        true
    }

    fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
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

    /// The working state as the store keeps it.
    fn save(self, p: &Params, now: i64) -> Stored {
        let t = now.max(self.ts);
        let top = self.cmax.min(fdiv(EXACT - 1, p.period)) * p.period;
        Stored {
            level: self.level,
            den: p.period,
            ts: self.ts,
            exp: t + cdiv(top - self.level_at(p, t), p.rate),
            cmax: self.cmax,
        }
    }
}
