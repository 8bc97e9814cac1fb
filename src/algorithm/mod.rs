//! The in-process mirror of `lua/`: one file per algorithm with the same state,
//! the same integer arithmetic and the same function names as its script,
//! the one loop over a decision's limits in `driver.rs` ([`decide`], the
//! mirror of `lua/limits.lua`), and the reply it makes in `reply.rs`. Each
//! limit's parameters, per algorithm, are a [`Params`] (`params.rs`).
//!
//! Every algorithm answers three questions about its state:
//! - `earliest(now, cost)`: the first time >= now at which `cost` fits
//!   (`None` if it never fits: cost over capacity). Feasibility never
//!   decreases with time, so several limits can all be granted at the latest
//!   of their earliest times.
//! - `grant(at, cost)`: record the grant at time `at`.
//! - `status(now, at)`: remaining amount at `at` and time from `now` until full.
//! - `refund(now, at, cost)`: give back a grant of `cost` made at `at`, exactly
//!   (a sliding log drops that entry; buckets take the cost back, never above
//!   their capacity; windows uncount it if its window is still counted).
//!
//! Around them, `prepare` reads the stored form (the same fields the script
//! writes: absolute times and amounts, independent of the quota) into the
//! reading limit's units, and `save` writes it back; the stored form says
//! when the state becomes equal to a fresh one (the key's expiry).

pub(crate) mod calendar;
mod driver;
pub(crate) mod fixed_window;
pub(crate) mod gcra;
mod params;
mod reply;
pub(crate) mod sliding_log;
pub(crate) mod sliding_window;
pub(crate) mod token_bucket;
pub(crate) mod wire;

pub(crate) use self::driver::{charge, decide, take, Operand};
pub(crate) use self::params::Params;
#[cfg(feature = "redis")]
pub(crate) use self::reply::ignored;
#[cfg(feature = "redis")]
pub(crate) use self::reply::packed_len;
#[allow(unreachable_pub)] // `Reply` is named by the store trait `Backend`, never exported
pub use self::reply::Reply;
pub(crate) use self::reply::{Outcome, Status, Statuses};

/// floor(a / b) for b > 0.
///
/// Exactly `a.div_euclid(b)`. A 64-bit division costs several times a
/// 32-bit one on common CPUs, and these operands are mostly small (amounts,
/// debts, rates of 1 after reduction), so those take a shorter way.
#[inline]
pub(crate) fn fdiv(a: i64, b: i64) -> i64 {
    if b == 1 {
        return a;
    }
    if let (Ok(a), Ok(b)) = (u32::try_from(a), u32::try_from(b)) {
        return i64::from(a / b);
    }
    a.div_euclid(b)
}

/// ceil(a / b) for b > 0: exactly `-(-a).div_euclid(b)`, see [`fdiv`].
#[inline]
pub(crate) fn cdiv(a: i64, b: i64) -> i64 {
    if b == 1 {
        return a;
    }
    if let (Ok(a), Ok(b)) = (u32::try_from(a), u32::try_from(b)) {
        return i64::from(a / b + u32::from(a % b != 0));
    }
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

/// The longest wait a limit asks by itself, its horizon (`horizon` in each
/// script): a full burst's emission (GCRA), a full bucket's refill, one
/// window (fixed window, sliding log), two (a sliding window's estimate
/// spans the previous one). A key's clock is believed that far ahead of the
/// store's, no further (see "Clock steps" in `lua/driver.lua`).
pub(crate) fn horizon(p: &Params) -> i64 {
    match *p {
        Params::Gcra(p) => cdiv(p.burst * p.period, p.rate),
        Params::TokenBucket(p) => cdiv(p.capacity * p.period, p.rate),
        Params::FixedWindow(p) => p.window,
        Params::SlidingLog(p) => p.window,
        Params::SlidingWindow(p) => 2 * p.window,
    }
}

/// A key's clock as a decision believes it (`believed` in `lua/common.lua`):
/// the clock of its writer at its last write, `written`, when that lies
/// ahead of the store's clock `store_now` by at most the limit's [`horizon`], else `store_now`.
#[inline]
pub(crate) fn believed(store_now: i64, written: i64, p: &Params) -> i64 {
    if written > store_now && written.saturating_sub(store_now) <= horizon(p) {
        written
    } else {
        store_now
    }
}

/// What the store keeps of a bucket's or a window's state (a sliding log
/// keeps its grants, see [`sliding_log::Log`]): the fields the scripts
/// write, absolute times and amounts, independent of the quota.
pub(crate) trait Raw: Copy {
    /// When the state becomes equal to a fresh one.
    fn expires_at(&self) -> i64;
    /// Moves every time it holds back by `by` microseconds.
    fn move_back(&mut self, by: i64);
}

/// What the store keeps as a decision at `now` reads it, written at its
/// writer's clock `written`: moved back whole by how far `written` lies
/// ahead of `now` (see "Clock steps" in `lua/driver.lua`), `None` once equal
/// to a fresh state; and whether it was moved back.
#[inline]
pub(crate) fn as_of<R: Raw>(raw: Option<R>, written: i64, now: i64) -> (Option<R>, bool) {
    let mut raw = raw;
    let moved = written > now;
    if let Some(raw) = raw.as_mut().filter(|_| moved) {
        raw.move_back(written - now);
    }
    let live = raw.filter(|raw| raw.expires_at() > now);
    (live, moved && live.is_some())
}

/// The working state of one key under one algorithm, in the reading
/// limit's units: made from what the store keeps (the fields the scripts
/// write, independent of the quota) by [`State::prepare`], written back by
/// [`State::save_new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State {
    SlidingLog(sliding_log::SlidingLog),
    TokenBucket(token_bucket::TokenBucket),
    Gcra(gcra::Gcra),
    FixedWindow(fixed_window::FixedWindow),
    SlidingWindow(sliding_window::SlidingWindow),
}

impl State {
    /// The working state of `stored` (`None`, or a form of another
    /// algorithm: fresh), written at its writer's clock `written`, in this
    /// limit's units as of `now`, as the scripts' `load` and `prepare` do. A
    /// state dated after `now` is moved back to it whole (see "Clock steps"
    /// in `lua/driver.lua`); returns whether it was and still holds
    /// something, in which case the decision writes it back whatever it
    /// decides. A sliding log's grants are moved out of `stored`, which
    /// [`restore`](Self::restore) or [`save_into`](Self::save_into) gives
    /// back.
    #[inline(always)]
    pub(crate) fn prepare(
        stored: Option<&mut Stored>,
        p: &Params,
        written: i64,
        now: i64,
    ) -> (Self, bool) {
        // the stored form of its own algorithm (a form of another reads as
        // fresh: `None`), prepared into the working form
        macro_rules! prepare {
            ($module:ident::$alg:ident, $p:expr) => {{
                let raw = match stored {
                    Some(Stored::$alg(raw)) => Some(*raw),
                    _ => None,
                };
                let (s, moved) = $module::$alg::prepare($p, raw, written, now);
                (State::$alg(s), moved)
            }};
        }
        match p {
            Params::SlidingLog(p) => {
                let log = match stored {
                    Some(Stored::SlidingLog(s)) => std::mem::take(&mut s.0),
                    _ => Default::default(),
                };
                let (s, moved) = sliding_log::SlidingLog::prepare(p, log, written, now);
                (State::SlidingLog(s), moved)
            }
            Params::TokenBucket(p) => prepare!(token_bucket::TokenBucket, p),
            Params::Gcra(p) => prepare!(gcra::Gcra, p),
            Params::FixedWindow(p) => prepare!(fixed_window::FixedWindow, p),
            Params::SlidingWindow(p) => prepare!(sliding_window::SlidingWindow, p),
        }
    }

    /// Gives a state that was prepared from `stored` and not saved back to
    /// it: unchanged but for the pruning of a sliding log, as in Redis.
    #[inline]
    pub(crate) fn restore(self, stored: &mut Stored) {
        if let (State::SlidingLog(s), Stored::SlidingLog(slot)) = (self, stored) {
            slot.0 = s.into_log();
        }
    }

    /// [`save_new`](Self::save_new) into `stored`, reusing a sliding log's
    /// allocation; returns the expiry.
    #[inline(always)]
    pub(crate) fn save_into(self, p: &Params, now: i64, stored: &mut Stored) -> i64 {
        match (self, stored, p) {
            (State::SlidingLog(mut s), Stored::SlidingLog(slot), Params::SlidingLog(p)) => {
                let expires_at = s.save(p, now);
                **slot = (s.into_log(), expires_at);
                expires_at
            }
            (state, stored, _) => {
                let (saved, expires_at) = state.save_new(p, now);
                *stored = saved;
                expires_at
            }
        }
    }

    /// Writes the working state into a new stored form, as of `now` (the
    /// key's new `written`), as the scripts' `save` functions do. Returns it
    /// and the time at which the state becomes equal to a fresh one: the
    /// key's expiry.
    #[inline(always)]
    pub(crate) fn save_new(self, p: &Params, now: i64) -> (Stored, i64) {
        let stored = match (self, p) {
            (State::SlidingLog(mut s), Params::SlidingLog(p)) => {
                let expires_at = s.save(p, now);
                Stored::SlidingLog(Box::new((s.into_log(), expires_at)))
            }
            (State::TokenBucket(s), Params::TokenBucket(p)) => Stored::TokenBucket(s.save(p, now)),
            (State::Gcra(s), Params::Gcra(p)) => Stored::Gcra(s.save(p, now)),
            (State::FixedWindow(s), Params::FixedWindow(p)) => Stored::FixedWindow(s.save(p)),
            (State::SlidingWindow(s), Params::SlidingWindow(p)) => Stored::SlidingWindow(s.save(p)),
            // (never: a state is prepared for its own limit's parameters;
            // an empty log is a fresh state, expired at `now`)
            _ => Stored::SlidingLog(Box::new((sliding_log::Log::default(), now))),
        };
        let expires_at = stored.expires_at();
        (stored, expires_at)
    }

    #[inline]
    fn earliest(&self, p: &Params, now: i64, cost: i64) -> Option<i64> {
        match (self, p) {
            (State::SlidingLog(s), Params::SlidingLog(p)) => s.earliest(p, now, cost),
            (State::TokenBucket(s), Params::TokenBucket(p)) => s.earliest(p, now, cost),
            (State::Gcra(s), Params::Gcra(p)) => s.earliest(p, now, cost),
            (State::FixedWindow(s), Params::FixedWindow(p)) => s.earliest(p, now, cost),
            (State::SlidingWindow(s), Params::SlidingWindow(p)) => s.earliest(p, now, cost),
            // (never: a state is prepared for its own limit's parameters)
            _ => None,
        }
    }

    #[inline]
    fn grant(&mut self, p: &Params, at: i64, cost: i64) {
        match (self, p) {
            (State::SlidingLog(s), _) => s.grant(at, cost),
            (State::TokenBucket(s), Params::TokenBucket(p)) => s.grant(p, at, cost),
            (State::Gcra(s), Params::Gcra(p)) => s.grant(p, at, cost),
            (State::FixedWindow(s), Params::FixedWindow(p)) => s.grant(p, at, cost),
            (State::SlidingWindow(s), Params::SlidingWindow(p)) => s.grant(p, at, cost),
            // (never: a state is prepared for its own limit's parameters)
            _ => {}
        }
    }

    /// Gives back a grant of `cost` made at `at`, the state prepared as of
    /// `now` (the scripts' `refund` functions). Returns whether the state
    /// changed (and must be saved).
    pub(crate) fn refund(&mut self, p: &Params, now: i64, at: i64, cost: i64) -> bool {
        match (self, p) {
            (State::SlidingLog(s), _) => s.refund(at, cost),
            (State::TokenBucket(s), Params::TokenBucket(p)) => s.refund(p, cost),
            (State::Gcra(s), Params::Gcra(p)) => s.refund(p, now, cost),
            (State::FixedWindow(s), Params::FixedWindow(p)) => s.refund(p, at, cost),
            (State::SlidingWindow(s), Params::SlidingWindow(p)) => s.refund(p, at, cost),
            // (never: a state is prepared for its own limit's parameters)
            _ => false,
        }
    }

    /// Moves a grant of `cost` made at `at` to `to`, when the state still
    /// holds it: a sliding log's lease renewed (op 5 of `lua/limits.lua`);
    /// whether it did. Other algorithms hold no leases: `false`.
    pub(crate) fn renew(&mut self, at: i64, to: i64, cost: i64) -> bool {
        let State::SlidingLog(s) = self else {
            return false;
        };
        let held = s.refund(at, cost);
        if held {
            s.grant(to, cost);
        }
        held
    }

    #[inline]
    pub(crate) fn status(&self, p: &Params, now: i64, at: i64) -> (i64, i64) {
        match (self, p) {
            (State::SlidingLog(s), Params::SlidingLog(p)) => s.status(p, now, at),
            (State::TokenBucket(s), Params::TokenBucket(p)) => s.status(p, now, at),
            (State::Gcra(s), Params::Gcra(p)) => s.status(p, now, at),
            (State::FixedWindow(s), Params::FixedWindow(p)) => s.status(p, now, at),
            (State::SlidingWindow(s), Params::SlidingWindow(p)) => s.status(p, now, at),
            // (never: a state is prepared for its own limit's parameters)
            _ => (0, 0),
        }
    }
}

/// What the in-process store keeps of one key of one limit: exactly the
/// fields the scripts keep in Redis (no working fields), and for a sliding
/// log its expiry (the other forms carry theirs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stored {
    /// Boxed: the largest form, and it owns a growing log anyway.
    SlidingLog(Box<(sliding_log::Log, i64)>),
    TokenBucket(token_bucket::Raw),
    Gcra(gcra::Raw),
    FixedWindow(fixed_window::Raw),
    SlidingWindow(sliding_window::Raw),
}

impl Stored {
    /// When the state becomes equal to a fresh one: the expiry `save` returned.
    pub(crate) fn expires_at(&self) -> i64 {
        match self {
            Stored::SlidingLog(s) => s.1,
            Stored::TokenBucket(raw) => raw.expires_at(),
            Stored::Gcra(raw) => raw.expires_at(),
            Stored::FixedWindow(raw) => raw.expires_at(),
            Stored::SlidingWindow(raw) => raw.expires_at(),
        }
    }

    /// How much of `p`'s capacity the state, written at `written`, holds
    /// in use at `now` (0 when it is equal to a fresh one; more than the
    /// capacity in debt): what forgetting it would forget. Read as of
    /// `written` if that is later (so it is never moved back) and left as
    /// it was but for the pruning of a sliding log, as a refused decision
    /// leaves it.
    pub(crate) fn used(&mut self, p: &Params, written: i64, now: i64) -> i64 {
        let now = now.max(written);
        let (state, _) = State::prepare(Some(self), p, written, now);
        let (remaining, _) = state.status(p, now, now);
        state.restore(self);
        p.capacity().saturating_sub(remaining)
    }
}

#[cfg(test)]
mod tests {
    use super::{cdiv, fdiv, Params};
    use proptest::prelude::*;

    /// A kept quota reads in the form the crate writes, three parameters,
    /// and in the one 0.1 wrote, with a fourth slot that must be 0.
    #[test]
    #[cfg(feature = "redis")]
    fn kept_quotas_read_in_both_forms() {
        let gcra = Params::Gcra(super::gcra::Params {
            burst: 5,
            rate: 1,
            period: 1_000_000,
        });
        assert_eq!(Params::from_stored(b"3:5:1:1000000:"), Some(gcra));
        assert_eq!(Params::from_stored(b"3:5:1:1000000:0:"), Some(gcra));
        assert_eq!(Params::from_stored(b"3:5:1:1000000:7:"), None);
        assert_eq!(Params::from_stored(b"3:5:1:1000000:0:0:"), None);
        assert_eq!(Params::from_stored(b"3:5:1:"), None);
    }

    /// The driver's one-limit decision grants a cost up to the capacity at
    /// once from a fresh state, reading the capacity as the first parameter.
    #[test]
    fn the_first_parameter_on_the_wire_is_the_capacity() {
        let all = [
            Params::SlidingLog(super::sliding_log::Params {
                limit: 3,
                window: 7,
            }),
            Params::TokenBucket(super::token_bucket::Params {
                capacity: 3,
                rate: 5,
                period: 7,
            }),
            Params::Gcra(super::gcra::Params {
                burst: 3,
                rate: 5,
                period: 7,
            }),
            Params::FixedWindow(super::fixed_window::Params {
                limit: 3,
                window: 7,
                calendar: None,
            }),
            Params::SlidingWindow(super::sliding_window::Params {
                limit: 3,
                window: 7,
                step: 1,
                calendar: None,
            }),
        ];
        for p in all {
            assert_eq!(p.wire()[0], p.capacity(), "{p:?}");
        }
    }

    #[test]
    fn divisions_equal_the_euclidean_ones_at_the_edges() {
        let edges = [0, 1, 1 << 31, 1 << 32, 1 << 53, i64::MAX / 2];
        let near = |x: i64| (-2..=2).map(move |d: i64| x.saturating_add(d));
        for &e in &edges {
            for a in near(e).chain(near(-e)) {
                for b in near(e).chain([1, 2, 3, 1000]).filter(|&b| b > 0) {
                    assert_eq!(fdiv(a, b), a.div_euclid(b), "fdiv({a}, {b})");
                    assert_eq!(cdiv(a, b), -(-a).div_euclid(b), "cdiv({a}, {b})");
                }
            }
        }
    }

    proptest! {
        #[test]
        fn divisions_equal_the_euclidean_ones(
            a in prop_oneof![any::<i64>().prop_map(|a| a / 2), -(1i64 << 34)..(1i64 << 34)],
            b in prop_oneof![1i64..=i64::MAX, 1i64..(1i64 << 33), 1i64..4],
        ) {
            prop_assert_eq!(fdiv(a, b), a.div_euclid(b));
            prop_assert_eq!(cdiv(a, b), -(-a).div_euclid(b));
        }
    }
}
