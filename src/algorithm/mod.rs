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

/// The state of one key under one algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State {
    SlidingLog(sliding_log::SlidingLog),
    TokenBucket(token_bucket::TokenBucket),
    Gcra(gcra::Gcra),
    FixedWindow(fixed_window::FixedWindow),
    SlidingWindow(sliding_window::SlidingWindow),
}

impl State {
    /// The state of a key never seen (or expired), as of `now`.
    pub(crate) fn fresh(p: &Params, now: i64) -> Self {
        match p.algorithm {
            Algorithm::SlidingLog => State::SlidingLog(sliding_log::SlidingLog::default()),
            Algorithm::TokenBucket => {
                State::TokenBucket(token_bucket::TokenBucket::full(&p.p, now))
            }
            Algorithm::Gcra => State::Gcra(gcra::Gcra::fresh(now)),
            Algorithm::FixedWindow => State::FixedWindow(fixed_window::FixedWindow::default()),
            Algorithm::SlidingWindow => {
                State::SlidingWindow(sliding_window::SlidingWindow::default())
            }
        }
    }

    /// Brings stored state up to `now` (drops expired log entries, a past TAT),
    /// as the scripts' `load` functions do.
    pub(crate) fn load(&mut self, p: &Params, now: i64) {
        match self {
            State::SlidingLog(s) => s.load(&p.p, now),
            State::Gcra(s) => s.load(now),
            State::TokenBucket(_) | State::FixedWindow(_) | State::SlidingWindow(_) => {}
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

    /// Time from `now` after which the state equals a fresh one: the TTL the
    /// scripts set on the key.
    pub(crate) fn ttl(&self, p: &Params, now: i64) -> i64 {
        match self {
            State::SlidingLog(s) => s.ttl(&p.p, now),
            State::TokenBucket(s) => s.status(&p.p, now, now).1,
            State::Gcra(s) => s.ttl(now),
            State::FixedWindow(s) => s.ttl(&p.p, now),
            State::SlidingWindow(s) => s.ttl(&p.p, now),
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
    /// Parses the flat integer array the driver script returns.
    pub(crate) fn from_flat(values: &[i64], limits: usize) -> Option<Self> {
        if values.len() != 3 + 3 * limits {
            return None;
        }
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
/// `states` are loaded (see [`State::load`]); on a grant they are updated.
pub(crate) fn decide(
    states: &mut [State],
    params: &[&Params],
    costs: &[i64],
    now: i64,
    max_wait: i64,
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
        if outcome == 0 {
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
