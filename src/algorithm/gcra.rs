//! Mirror of `lua/gcra.lua`: `level / den` permits left at the writer's
//! clock, worked on as the theoretical arrival time `tat + frac/N` us.

use super::{as_of, cdiv, fdiv, rescale, Algo, EXACT};

/// The integers it decides with: bursts of `capacity`, `rate` permits per
/// `period` microseconds.
pub(crate) type Params = super::params::Bucket;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Gcra {
    tat: i64,
    frac: i64,
    /// The largest burst that wrote the state (stored as `bmax`).
    bmax: i64,
}

/// The fields of the script's key: `level / den` permits left, and when the
/// bucket has refilled to `bmax`, the largest burst that wrote it (`exp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stored {
    level: i64,
    den: i64,
    exp: i64,
    bmax: i64,
}

impl super::StoredForm for Stored {
    fn expires_at(&self) -> i64 {
        self.exp
    }

    /// The level is counted from the writer's clock: only `exp` is a time.
    fn move_back(&mut self, by: i64) {
        self.exp -= by;
    }
}

impl Gcra {
    /// ceil(tat): an arrival in this tick is on time (see `lua/gcra.lua`).
    fn ceil(&self) -> i64 {
        self.tat + i64::from(self.frac > 0)
    }
}

impl Algo for Gcra {
    type Params = Params;
    type Stored = Stored;
    const NAME: &'static str = "GCRA";
    const KEYS: &'static [&'static str] = &["gcra"];
    const AMOUNT: &'static str = "burst";
    const RATE: Option<&'static str> = Some("rate");

    /// `None`: fresh.
    fn prepare(p: &Params, stored: Option<&mut Stored>, written: i64, now: i64) -> (Self, bool) {
        let mut s = Self {
            tat: now,
            frac: 0,
            bmax: p.capacity,
        };
        let (stored, moved) = as_of(stored.copied(), written, now);
        if let Some(stored) = stored {
            s.bmax = s.bmax.max(stored.bmax);
            let debt = if fdiv(stored.level, stored.den) < p.capacity {
                p.capacity * p.period - rescale(stored.level, stored.den, p.period)
            } else {
                0
            };
            let whole = fdiv(debt, p.rate);
            // (a state moved back counts from `now`)
            (s.tat, s.frac) = (written.min(now) + whole, debt - whole * p.rate);
            if s.ceil() < now {
                (s.tat, s.frac) = (now, 0);
            }
        }
        (s, moved)
    }

    fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
        let (b, n, w) = (p.capacity, p.rate, p.period);
        if cost > b {
            return None;
        }
        Some(now.max(self.tat - fdiv((b - cost) * w - self.frac, n)))
    }

    fn grant(&mut self, p: &Params, at: i64, cost: i64) {
        if self.ceil() < at {
            (self.tat, self.frac) = (at, 0);
        }
        let total = self.frac + cost * p.period;
        let whole = fdiv(total, p.rate);
        self.tat += whole;
        self.frac = total - whole * p.rate;
    }

    /// Gives back `cost` (as `gcra_refund`): the TAT moves back by `cost`
    /// emission intervals, never before `now` (a full burst). `false` when
    /// nothing changes.
    fn refund(&mut self, p: &Params, now: i64, _at: i64, cost: i64) -> bool {
        let n = p.rate;
        let x = (self.tat - now) * n + self.frac - cost * p.period;
        let (tat, frac) = if x > 0 {
            let whole = fdiv(x, n);
            (now + whole, x - whole * n)
        } else {
            (now, 0)
        };
        let changed = (tat, frac) != (self.tat, self.frac);
        (self.tat, self.frac) = (tat, frac);
        changed
    }

    fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
        let (b, n, w) = (p.capacity, p.rate, p.period);
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

    /// The working state as the store keeps it, as of `now`.
    fn save(self, p: &Params, now: i64) -> Stored {
        let debt = (self.tat - now) * p.rate + self.frac;
        let extra = (self.bmax - p.capacity).min(fdiv(EXACT - 1, p.period));
        Stored {
            level: p.capacity * p.period - debt,
            den: p.period,
            exp: self.ceil() + 1 + cdiv(extra * p.period, p.rate),
            bmax: self.bmax,
        }
    }
}
