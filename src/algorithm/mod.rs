//! The in-process mirror of `lua/`: one file per algorithm with the same state,
//! the same integer arithmetic and the same function names as its script,
//! each an [`Algo`]; the one loop over a decision's limits in `driver.rs`
//! ([`decide`], the mirror of `lua/limits.lua`), and the reply it makes in
//! `reply.rs`. The algorithms are listed once, below: `registry.rs` makes of
//! the list the enums the rest of the crate holds ([`Params`], [`State`],
//! [`Stored`]) and the one `match` over them per step.

pub(crate) mod calendar;
mod driver;
pub(crate) mod fixed_window;
pub(crate) mod gcra;
mod params;
#[macro_use]
mod registry;
mod reply;
pub(crate) mod sliding_log;
pub(crate) mod sliding_window;
pub(crate) mod token_bucket;
pub(crate) mod wire;

use self::params::Shape;
use crate::quota::{Algorithm, Quota};
use crate::ConfigError;

pub(crate) use self::driver::{charge, decide, each, take, EachMode, Operand};
#[cfg(feature = "redis")]
pub(crate) use self::reply::ignored;
#[cfg(feature = "redis")]
pub(crate) use self::reply::packed_len;
pub(crate) use self::reply::{Reply, Status, Statuses, VerdictCode};

// Every algorithm: its public name, its id on the wire (what a limit's
// string starts with, and its place in `lua/wire.lua`'s list), its state.
registry! {
    SlidingLog = 1: sliding_log::SlidingLog,
    TokenBucket = 2: token_bucket::TokenBucket,
    Gcra = 3: gcra::Gcra,
    FixedWindow = 4: fixed_window::FixedWindow,
    SlidingWindow = 5: sliding_window::SlidingWindow,
}

/// One algorithm: its working state (the implementing type, in the reading
/// limit's units), its parameters, what the store keeps, its steps, names.
///
/// Its steps on the state:
/// - `earliest(now, cost)`: the first time >= now at which `cost` fits
///   (`None` if it never fits: cost over capacity). Feasibility never
///   decreases with time, so several limits can all be granted at the latest
///   of their earliest times.
/// - `grant(at, cost)`: record the grant at time `at`.
/// - `status(now, at)`: remaining amount at `at` and time from `now` until full.
/// - `refund(now, at, cost)`: give back a grant of `cost` made at `at`, exactly
///   (a sliding log drops that entry; buckets take the cost back, never above
///   their capacity; windows uncount it if its window is still counted).
///   Returns whether the state changed (and must be saved).
///
/// Around them, `prepare` reads the stored form (the same fields the script
/// writes: absolute times and amounts, independent of the quota) into the
/// reading limit's units, and `save` writes it back; the stored form says
/// when the state becomes equal to a fresh one (the key's expiry).
pub(crate) trait Algo: Sized + std::fmt::Debug + Clone + Eq {
    /// The integers it decides with, derived once from a quota.
    type Params: Shape;
    /// What the store keeps of a key: the fields its script writes.
    type Stored: StoredForm + std::fmt::Debug + Clone + Eq;
    /// Its name in prose (how [`Algorithm`] displays).
    const NAME: &'static str;
    /// The suffixes of the keys it stores under, in the order its script
    /// reads them.
    const KEYS: &'static [&'static str];
    /// What a quota's amount (its capacity) is called.
    const AMOUNT: &'static str;
    /// A bucket's rate (a quota's `extra`, per period), by what it is
    /// called; `None` for a window, which takes none.
    const RATE: Option<&'static str>;

    /// The working state of `stored` (`None`: fresh), written at its
    /// writer's clock `written`, as of `now`; `true` when it was moved back
    /// to `now` and still holds something (see [`State::prepare`]).
    fn prepare(
        p: &Self::Params,
        stored: Option<&mut Self::Stored>,
        written: i64,
        now: i64,
    ) -> (Self, bool);
    /// Gives back what `prepare` moved out of `stored` (a sliding log's grants).
    fn restore(self, _stored: &mut Self::Stored) {}
    /// The working state as the store keeps it, as of `now`.
    fn save(self, p: &Self::Params, now: i64) -> Self::Stored;
    /// [`save`](Self::save) into `stored`; returns the expiry.
    fn save_into(self, p: &Self::Params, now: i64, stored: &mut Self::Stored) -> i64 {
        *stored = self.save(p, now);
        stored.expires_at()
    }
    fn earliest(&self, p: &Self::Params, now: i64, cost: i64) -> Option<i64>;
    fn grant(&mut self, p: &Self::Params, at: i64, cost: i64);
    fn refund(&mut self, p: &Self::Params, now: i64, at: i64, cost: i64) -> bool;
    /// Moves a grant of `cost` made at `at` to `to` when the state still
    /// holds it (a lease renewed, op 5 of `lua/limits.lua`); whether it
    /// did. Only a sliding log holds leases.
    fn renew(&mut self, _at: i64, _to: i64, _cost: i64) -> bool {
        false
    }
    fn status(&self, p: &Self::Params, now: i64, at: i64) -> (i64, i64);
}

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

/// A key's clock as a decision believes it (`believed` in `lua/common.lua`):
/// the clock of its writer at its last write, `written`, when that lies
/// ahead of the store's clock `store_now` by at most the limit's horizon ([`Params::horizon`]), else `store_now`.
#[inline]
pub(crate) fn believed(store_now: i64, written: i64, p: &Params) -> i64 {
    if written > store_now && written.saturating_sub(store_now) <= p.horizon() {
        written
    } else {
        store_now
    }
}

/// What every algorithm's stored form (its `Stored`: what the store keeps of
/// a key, the fields the scripts write, absolute times and amounts,
/// independent of the quota) tells of its times.
pub(crate) trait StoredForm {
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
pub(crate) fn as_of<S: StoredForm + Copy>(
    mut stored: Option<S>,
    written: i64,
    now: i64,
) -> (Option<S>, bool) {
    let moved = written > now;
    if let Some(stored) = stored.as_mut().filter(|_| moved) {
        stored.move_back(written - now);
    }
    let live = stored.filter(|stored| stored.expires_at() > now);
    (live, moved && live.is_some())
}

#[cfg(test)]
mod tests {
    use super::{cdiv, fdiv, Params};
    use proptest::prelude::*;

    /// A stored quota reads in the form the crate writes, three parameters,
    /// and in the one 0.1 wrote, with a fourth slot that must be 0.
    #[test]
    #[cfg(feature = "redis")]
    fn stored_quotas_read_in_both_forms() {
        let gcra = Params::Gcra(super::gcra::Params {
            capacity: 5,
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
                calendar: None,
            }),
            Params::TokenBucket(super::token_bucket::Params {
                capacity: 3,
                rate: 5,
                period: 7,
            }),
            Params::Gcra(super::gcra::Params {
                capacity: 3,
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
