//! The in-process mirror of `lua/`: one file per algorithm with the same state,
//! the same integer arithmetic and the same function names as its script, and
//! [`decide`], the mirror of `lua/driver.lua`.
//!
//! Every algorithm answers three questions about its state:
//! - `earliest(now, cost)`: the first time >= now at which `cost` fits
//!   (`None` if it never fits: cost over capacity). Feasibility never
//!   decreases with time, so several limits can all be granted at the latest
//!   of their earliest times.
//! - `grant(at, cost)`: record the grant at time `at`.
//! - `status(now, at)`: remaining amount at `at` and time from `now` until full.
//!
//! Around them, `prepare` reads the stored form (the same fields the script
//! writes: absolute times and amounts, independent of the quota) into the
//! reading limit's units, and `save` writes it back and says when the state
//! becomes equal to a fresh one (the key's expiry).

pub(crate) mod fixed_window;
pub(crate) mod gcra;
pub(crate) mod sliding_log;
pub(crate) mod sliding_window;
pub(crate) mod token_bucket;

use crate::quota::{Algorithm, Params};

/// floor(a / b) for b > 0.
pub(crate) fn fdiv(a: i64, b: i64) -> i64 {
    a.div_euclid(b)
}

/// ceil(a / b) for b > 0.
pub(crate) fn cdiv(a: i64, b: i64) -> i64 {
    -(-a).div_euclid(b)
}

/// 2^53: the exact range of the doubles Redis Lua computes with.
pub(crate) const EXACT: i64 = 1 << 53;

/// `x / from` in units of `1 / to`, rounded down, as `rescale` in
/// `lua/common.lua`: exact when the product fits in 2^53, else the fraction
/// below one unit of `from` is dropped.
pub(crate) fn rescale(x: i64, from: i64, to: i64) -> i64 {
    if from == to {
        return x;
    }
    let q = fdiv(x, from);
    let r = x - q * from;
    let part = if i128::from(r) * i128::from(to) < i128::from(EXACT) {
        fdiv(r * to, from)
    } else {
        0
    };
    q * to + part
}

/// The state of one key under one algorithm: what the store keeps (the
/// fields the scripts write, independent of the quota) and, once prepared,
/// the working form in the reading limit's units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State {
    SlidingLog(sliding_log::SlidingLog),
    TokenBucket(token_bucket::TokenBucket),
    Gcra(gcra::Gcra),
    FixedWindow(fixed_window::FixedWindow),
    SlidingWindow(sliding_window::SlidingWindow),
}

impl State {
    /// The state of a key never seen (or expired).
    pub(crate) fn fresh(p: &Params) -> Self {
        match p.algorithm {
            Algorithm::SlidingLog => State::SlidingLog(Default::default()),
            Algorithm::TokenBucket => State::TokenBucket(Default::default()),
            Algorithm::Gcra => State::Gcra(Default::default()),
            Algorithm::FixedWindow => State::FixedWindow(Default::default()),
            Algorithm::SlidingWindow => State::SlidingWindow(Default::default()),
        }
    }

    /// Reads the stored state (written at the writer's clock `hw`) in this
    /// limit's units as of `now`, as the scripts' `prepare` functions do.
    pub(crate) fn prepare(&mut self, p: &Params, hw: i64, now: i64) {
        match self {
            State::SlidingLog(s) => s.prepare(&p.p, now),
            State::TokenBucket(s) => s.prepare(&p.p, now),
            State::Gcra(s) => s.prepare(&p.p, hw, now),
            State::FixedWindow(s) => s.prepare(&p.p, now),
            State::SlidingWindow(s) => s.prepare(&p.p, now),
        }
    }

    fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
        match self {
            State::SlidingLog(s) => s.earliest(&p.p, now, cost),
            State::TokenBucket(s) => s.earliest(&p.p, now, cost),
            State::Gcra(s) => s.earliest(&p.p, now, cost),
            State::FixedWindow(s) => s.earliest(&p.p, now, cost),
            State::SlidingWindow(s) => s.earliest(&p.p, now, cost),
        }
    }

    fn grant(&mut self, p: &Params, at: i64, cost: i64) {
        match self {
            State::SlidingLog(s) => s.grant(at, cost),
            State::TokenBucket(s) => s.grant(&p.p, at, cost),
            State::Gcra(s) => s.grant(&p.p, at, cost),
            State::FixedWindow(s) => s.grant(&p.p, at, cost),
            State::SlidingWindow(s) => s.grant(&p.p, at, cost),
        }
    }

    fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
        match self {
            State::SlidingLog(s) => s.status(&p.p, now, at),
            State::TokenBucket(s) => s.status(&p.p, now, at),
            State::Gcra(s) => s.status(&p.p, now, at),
            State::FixedWindow(s) => s.status(&p.p, now, at),
            State::SlidingWindow(s) => s.status(&p.p, now, at),
        }
    }

    /// Writes the working state back into its stored form, as of `now` (the
    /// key's new `hw`), as the scripts' `save` functions do. Returns the time
    /// at which the state becomes equal to a fresh one: the key's expiry.
    pub(crate) fn save(&mut self, p: &Params, now: i64) -> i64 {
        match self {
            State::SlidingLog(s) => s.save(&p.p, now),
            State::TokenBucket(s) => s.save(&p.p, now),
            State::Gcra(s) => s.save(&p.p, now),
            State::FixedWindow(s) => s.save(&p.p),
            State::SlidingWindow(s) => s.save(&p.p),
        }
    }
}

/// What a store answers for one decision, in the units of the scripts.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(unreachable_pub)] // named by the sealed store trait, never exported
pub struct Reply {
    /// 0 granted, 1 denied, 2 a cost exceeds a capacity.
    pub(crate) outcome: i64,
    /// Microseconds until the grant (0) or until a retry would succeed (1); -1 for 2.
    pub(crate) wait: i64,
    /// The store's clock.
    pub(crate) now: i64,
    /// Per limit: (wait or -1, remaining, reset_after).
    pub(crate) limits: Vec<[i64; 3]>,
}

impl Reply {
    /// Parses the driver's reply: `3 + 3 * limits` little-endian doubles, each
    /// an integer below 2^53 in magnitude.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn from_packed(bytes: &[u8], limits: usize) -> Option<Self> {
        if bytes.len() != 8 * (3 + 3 * limits) {
            return None;
        }
        let values = bytes
            .chunks_exact(8)
            .map(|chunk| {
                let x = f64::from_le_bytes(chunk.try_into().ok()?);
                let exact = x.fract() == 0.0 && x.abs() < EXACT as f64;
                // exact: an integer below 2^53, so the cast loses nothing
                exact.then_some(x as i64)
            })
            .collect::<Option<Vec<i64>>>()?;
        let per = values[3..]
            .chunks_exact(3)
            .map(|c| [c[0], c[1], c[2]])
            .collect();
        Some(Self {
            outcome: values[0],
            wait: values[1],
            now: values[2],
            limits: per,
        })
    }
}

/// One atomic decision over several limits: the mirror of `lua/driver.lua`.
/// `states` are prepared (see [`State::prepare`]) as of `now`, the latest of
/// the store's clock and every key's `hw`; on a grant (unless `dry`) they are
/// updated, and the caller saves them.
pub(crate) fn decide(
    states: &mut [State],
    params: &[&Params],
    costs: &[i64],
    now: i64,
    max_wait: i64,
    dry: bool,
) -> Reply {
    let mut at = now;
    let mut never = false;
    let mut earliest = Vec::with_capacity(states.len());
    for ((state, p), &cost) in states.iter().zip(params).zip(costs) {
        let t = if cost > 0 {
            state.earliest(p, now, cost)
        } else {
            Some(now)
        };
        match t {
            None => never = true,
            Some(t) => at = at.max(t),
        }
        earliest.push(t);
    }
    let (outcome, wait) = if never {
        (2, -1)
    } else if at - now > max_wait {
        (1, at - now)
    } else {
        (0, at - now)
    };
    let mut limits = Vec::with_capacity(states.len());
    for (((state, p), &cost), t) in states.iter_mut().zip(params).zip(costs).zip(earliest) {
        let mut as_of = now;
        if outcome == 0 && !dry {
            as_of = at;
            if cost > 0 {
                state.grant(p, at, cost);
            }
        }
        let (remaining, reset) = state.status(p, now, as_of);
        limits.push([t.map_or(-1, |t| t - now), remaining, reset]);
    }
    Reply {
        outcome,
        wait,
        now,
        limits,
    }
}
