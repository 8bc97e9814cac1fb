//! The one Rust decision loop over a decision's limits: the mirror of
//! `lua/limits.lua` (decide, take, charge), each algorithm's steps in its
//! own file.

use super::{Params, Reply, State, Status, Statuses, VerdictCode};

/// One limit's part in a decision: its working state (see
/// [`State::prepare`]), parameters and cost.
pub(crate) struct Operand<'p> {
    pub(crate) state: State,
    pub(crate) p: &'p Params,
    pub(crate) cost: i64,
}

/// One atomic decision over several limits: the mirror of `lua/limits.lua`.
/// The states are prepared as of `now`, the latest of the store's clock and
/// every key's `written` as believed; on a grant (unless `dry`) they are
/// updated, and the caller saves them.
#[inline(always)]
pub(crate) fn decide(ops: &mut [Operand<'_>], now: i64, max_wait: i64, dry: bool) -> Reply {
    let mut at = now;
    let mut never = false;
    // Per limit: its wait (`None`: never), known first.
    let mut waits: smallvec::SmallVec<[Option<i64>; 2]> = smallvec::SmallVec::new();
    for op in ops.iter() {
        let t = if op.cost > 0 {
            op.state.earliest(op.p, now, op.cost)
        } else {
            Some(now)
        };
        match t {
            None => never = true,
            Some(t) => at = at.max(t),
        }
        waits.push(t.map(|t| t - now));
    }
    let (verdict, wait) = if never {
        (VerdictCode::Never, -1)
    } else if at - now > max_wait {
        (VerdictCode::Denied, at - now)
    } else {
        (VerdictCode::Granted, at - now)
    };
    let mut limits = Statuses::with_capacity(ops.len());
    for (op, wait) in ops.iter_mut().zip(waits) {
        let mut as_of = now;
        if verdict == VerdictCode::Granted && !dry {
            as_of = at;
            if op.cost > 0 {
                op.state.grant(op.p, at, op.cost);
            }
        }
        let (remaining, reset) = op.state.status(op.p, now, as_of);
        limits.push(match wait {
            Some(wait) => Status::Allows {
                wait,
                remaining,
                reset,
            },
            None => Status::Never { remaining, reset },
        });
    }
    Reply {
        verdict,
        wait,
        now,
        limits,
        stored: None,
    }
}

/// Charges each limit its cost whatever is left, where a cost of 1 would be
/// granted (now, or the earliest time a spent limit allows one): the mirror
/// of `charge` (op 4) in `lua/limits.lua`. A limit may end in debt, and
/// refuses until it is paid back. Each is charged at most the capacity of
/// the quota that decides it (a stored quota or an override, else its
/// own): one charge is never more than one full quota.
pub(crate) fn charge(ops: &mut [Operand<'_>], now: i64) {
    for op in ops.iter_mut().filter(|op| op.cost > 0) {
        let at = op.state.earliest(op.p, now, 1).unwrap_or(now);
        op.state.grant(op.p, at, op.cost.min(op.p.capacity()));
    }
}

/// Takes what is available, at most `most` in every limit: the mirror of
/// `take` (op 2) in `lua/limits.lua`. Grants k = min(`most`, what every
/// limit has left now) at once; when k = 0, decides a cost of 1 without
/// granting it. Returns the reply and k (each operand's cost is set to
/// what it was charged).
pub(crate) fn take(ops: &mut [Operand<'_>], most: i64, now: i64) -> (Reply, i64) {
    let k = ops
        .iter()
        .map(|op| op.state.status(op.p, now, now).0)
        .fold(most, i64::min)
        .max(0);
    for op in ops.iter_mut() {
        op.cost = k.max(1);
    }
    (decide(ops, now, 0, k == 0), k)
}

/// How [`each`] decides a set: the store's side of `SetMode`, its code in
/// slot `OPT_AT` of op 9 (`wire::EACH_MODES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EachMode {
    /// Each limit's cost counted now, whether it fits or not.
    Counted = 0,
    /// Each limit's cost counted now, unless another limit is over: then
    /// only the limits over are counted.
    Sparing = 1,
    /// Every limit's cost counted now if every one fits, else none.
    All = 2,
}

/// A set decided in one step at `now`: the mirror of `each` (op 9) in
/// `lua/limits.lua`. A negative cost is a refund: the amount is given
/// back as a grant made at `now` would be (see [`State::refund`]), and the
/// limit is then checked at a cost of 0. Each other limit is over when its
/// cost does not fit now (a cost of 0: when it is spent beyond its
/// capacity); it is counted (granted at `now`, past its capacity too) as
/// `mode` says. Statuses: `Allows` with a wait of 0 (within) or until it
/// fits (over), `Never` for a cost over a capacity; remaining and reset
/// after the counting. The verdict: granted when no limit is over, else
/// denied (never, when a cost exceeds a capacity), waiting for the longest.
pub(crate) fn each(ops: &mut [Operand<'_>], now: i64, mode: EachMode) -> Reply {
    let mut fits: smallvec::SmallVec<[Option<i64>; 2]> = smallvec::SmallVec::new();
    let (mut over, mut never, mut wait) = (false, false, 0);
    for op in ops.iter_mut() {
        if op.cost < 0 {
            op.state.refund(op.p, now, now, -op.cost);
            op.cost = 0;
        }
        let t = op.state.earliest(op.p, now, op.cost);
        match t {
            Some(t) => wait = wait.max(t - now),
            None => never = true,
        }
        over |= t != Some(now);
        fits.push(t);
    }
    let mut limits = Statuses::with_capacity(ops.len());
    for (op, t) in ops.iter_mut().zip(fits) {
        let counted = match mode {
            EachMode::Counted => true,
            EachMode::Sparing => !over || t != Some(now),
            EachMode::All => !over,
        };
        if counted && op.cost > 0 {
            op.state.grant(op.p, now, op.cost);
        }
        let (remaining, reset) = op.state.status(op.p, now, now);
        limits.push(match t {
            Some(t) => Status::Allows {
                wait: t - now,
                remaining,
                reset,
            },
            None => Status::Never { remaining, reset },
        });
    }
    let (verdict, wait) = VerdictCode::gathered(never, over, wait);
    Reply {
        verdict,
        wait,
        now,
        limits,
        stored: None,
    }
}
