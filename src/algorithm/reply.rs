//! A decision's reply: its verdict and each limit's status, as the scripts
//! write it and the memory store makes it.

use smallvec::SmallVec;

use super::wire::{StatusKind, STATUS_FIELDS};
use super::{Params, EXACT};

/// Per-limit statuses of a reply: inline for the usual one or two limits.
pub(crate) type Statuses = SmallVec<[Status; 2]>;

/// One limit's part in a decision's reply, in the units of the scripts
/// (microseconds, counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Decided by its quota: it alone allows its cost after `wait`; then
    /// `remaining` is left, and all of its capacity after `reset`.
    Allows {
        wait: i64,
        remaining: i64,
        reset: i64,
    },
    /// Its cost exceeds its capacity: it never allows it.
    Never { remaining: i64, reset: i64 },
    /// Blocked by its penalty for `left` more (its quota not asked): it
    /// allows nothing until then.
    Blocked { left: i64 },
}

impl Status {
    /// How long until it alone allows its cost (a block's time left);
    /// `None` never.
    pub(crate) fn wait(&self) -> Option<i64> {
        match *self {
            Status::Allows { wait, .. } => Some(wait),
            Status::Never { .. } => None,
            Status::Blocked { left } => Some(left),
        }
    }

    /// What is left of its capacity (nothing while blocked).
    pub(crate) fn remaining(&self) -> i64 {
        match *self {
            Status::Allows { remaining, .. } | Status::Never { remaining, .. } => remaining,
            Status::Blocked { .. } => 0,
        }
    }

    /// How long until all of its capacity is back (a block's time left).
    pub(crate) fn reset(&self) -> i64 {
        match *self {
            Status::Allows { reset, .. } | Status::Never { reset, .. } => reset,
            Status::Blocked { left } => left,
        }
    }

    /// `cost` given back, never above `capacity` (a grant refunded after
    /// the reply was made); nothing for a blocked limit.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn give_back(&mut self, cost: i64, capacity: i64) {
        if let Status::Allows { remaining, .. } | Status::Never { remaining, .. } = self {
            *remaining = remaining.saturating_add(cost).min(capacity);
        }
    }

    /// The status the scripts write as `kind`, `wait`, `remaining`,
    /// `reset`.
    fn from_fields(kind: i64, wait: i64, remaining: i64, reset: i64) -> Option<Self> {
        Some(match StatusKind::from_code(kind)? {
            StatusKind::Allows => Status::Allows {
                wait,
                remaining,
                reset,
            },
            StatusKind::Never => Status::Never { remaining, reset },
            StatusKind::Blocked => Status::Blocked { left: wait },
        })
    }
}

/// The length of a packed reply's doubles over `limits` limits, with
/// `extra` doubles after the statuses (a take's amount): what precedes
/// its notes.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn packed_len(limits: usize, extra: usize) -> usize {
    8 * (2 + STATUS_FIELDS * limits + extra)
}

/// How a decision ended, as the scripts code it: the first number of their
/// reply, which the limiter reads as the decision's [`Verdict`](crate::Verdict).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VerdictCode {
    /// Granted, now or at `now + wait`.
    Granted = 0,
    /// Refused: a retry after `wait` would be granted.
    Denied = 1,
    /// A cost exceeds a capacity: never granted (`wait` is -1).
    Never = 2,
}

impl VerdictCode {
    /// The verdict the scripts write as `code`.
    pub(crate) fn from_code(code: i64) -> Option<Self> {
        match code {
            0 => Some(VerdictCode::Granted),
            1 => Some(VerdictCode::Denied),
            2 => Some(VerdictCode::Never),
            _ => None,
        }
    }

    /// The verdict and wait of statuses gathered now: never when a cost
    /// exceeds a capacity (wait -1), else denied for the longest `wait`
    /// when one is `over`, else granted now (wait 0).
    pub(crate) fn gathered(never: bool, over: bool, wait: i64) -> (Self, i64) {
        if never {
            (VerdictCode::Never, -1)
        } else if over {
            (VerdictCode::Denied, wait)
        } else {
            (VerdictCode::Granted, 0)
        }
    }
}

/// What a store answers for one decision, in the units of the scripts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) verdict: VerdictCode,
    /// Microseconds until the grant, or until a retry would be granted; -1
    /// for [`VerdictCode::Never`].
    pub(crate) wait: i64,
    /// The decision's clock: the store's, or a key's clock ahead of it as
    /// believed (see [`believed`]).
    pub(crate) now: i64,
    /// Per limit, its status.
    pub(crate) limits: Statuses,
    /// Per limit, the parameters of the stored quota that
    /// decided in place of the limit's own (see
    /// [`Limit::use_stored_quota`](crate::Limit::use_stored_quota)); `None`
    /// when every limit decided with its own.
    pub(crate) stored: Option<Box<[Option<Params>]>>,
}

impl Reply {
    /// A grant of nothing at `now`: the answer of an operation that decides
    /// nothing (a charge).
    pub(crate) fn at_rest(now: i64) -> Self {
        Self {
            verdict: VerdictCode::Granted,
            wait: 0,
            now,
            limits: Statuses::new(),
            stored: None,
        }
    }

    /// Whether the decision was granted (now or as a reservation).
    pub(crate) fn granted(&self) -> bool {
        self.verdict == VerdictCode::Granted
    }

    /// The store time of the grant (us): `now + wait` for a grant; what a
    /// refund names it by.
    pub(crate) fn at(&self) -> i64 {
        self.now + self.wait.max(0)
    }

    /// The parameters limit `i` decided with, when a stored quota decided
    /// in place of its own.
    pub(crate) fn stored(&self, i: usize) -> Option<&Params> {
        self.stored.as_ref()?.get(i)?.as_ref()
    }

    /// Parses the reply of a take (op 2): a decision's reply, then the amount
    /// taken, then the stored quotas used (see [`from_packed`](Self::from_packed)).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn from_packed_take(bytes: &[u8], limits: usize) -> Option<(Self, i64)> {
        let split = packed_len(limits, 0);
        let (decision, rest) = bytes.split_at_checked(split)?;
        let (taken, tail) = rest.split_at_checked(8)?;
        let mut reply = Self::from_packed(decision, limits)?;
        reply.stored = stored_quotas(tail, limits)?;
        let x = f64::from_le_bytes(taken.try_into().ok()?);
        let exact = x.fract() == 0.0 && x.abs() < EXACT as f64;
        exact.then_some((reply, x as i64))
    }

    /// Parses the driver's reply: verdict and now, then per limit its kind
    /// (see [`StatusKind`]), wait, remaining and reset: little-endian
    /// doubles (see [`packed_len`]), each an integer below 2^53 in
    /// magnitude; then `i=<stored form>;` for each limit `i` (from 1) a
    /// stored quota decided. The decision's wait is the longest
    /// of its limits' (all are granted at once, or none), -1 when it is
    /// never granted.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn from_packed(bytes: &[u8], limits: usize) -> Option<Self> {
        let (bytes, tail) = bytes.split_at_checked(packed_len(limits, 0))?;
        let stored = stored_quotas(tail, limits)?;
        let mut values = bytes.chunks_exact(8).map(|chunk| {
            let x = f64::from_le_bytes(chunk.try_into().ok()?);
            // an integer below 2^53 in magnitude (NaN is not): the casts lose nothing
            let exact = x.abs() < EXACT as f64 && (x as i64) as f64 == x;
            exact.then_some(x as i64)
        });
        let mut next = || values.next().flatten();
        let (verdict, now) = (VerdictCode::from_code(next()?)?, next()?);
        let mut per: Statuses = SmallVec::with_capacity(limits);
        for _ in 0..limits {
            per.push(Status::from_fields(next()?, next()?, next()?, next()?)?);
        }
        let wait = match verdict {
            VerdictCode::Never => -1,
            VerdictCode::Granted | VerdictCode::Denied => {
                per.iter().filter_map(Status::wait).max().unwrap_or(0)
            }
        };
        Some(Self {
            verdict,
            wait,
            now,
            limits: per,
            stored,
        })
    }
}

/// The stored quotas of a reply's tail (`i=<stored form>;` each, see
/// [`Reply::from_packed`]): `Some(None)` for none, `None` when unreadable.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
fn stored_quotas(tail: &[u8], limits: usize) -> Option<Option<Box<[Option<Params>]>>> {
    if tail.is_empty() {
        return Some(None);
    }
    let mut stored = vec![None; limits].into_boxed_slice();
    let mut any = false;
    for entry in tail.strip_suffix(b";")?.split(|&b| b == b';') {
        let at = entry.iter().position(|&b| b == b'=')?;
        let i: usize = std::str::from_utf8(&entry[..at]).ok()?.parse().ok()?;
        let slot = stored.get_mut(i.checked_sub(1)?)?;
        // a kept value ignored (see `ignored`)
        if &entry[at + 1..] == b"!" {
            continue;
        }
        *slot = Some(Params::from_stored(&entry[at + 1..])?);
        any = true;
    }
    Some(any.then_some(stored))
}

/// The limits (from 0) of a decision's reply `bytes` over `limits` limits
/// whose stored quota, or override, in force was ignored: not
/// valid (see [`Params::from_stored`]) or of another algorithm than the
/// limit's (`i=!;` in the reply's tail, see `lua/driver.lua`). `extra`
/// doubles follow the statuses (a take's amount).
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn ignored(bytes: &[u8], limits: usize, extra: usize) -> Vec<usize> {
    let Some(tail) = bytes.get(packed_len(limits, extra)..) else {
        return Vec::new();
    };
    tail.split(|&b| b == b';')
        .filter_map(|entry| entry.strip_suffix(b"=!"))
        .filter_map(|i| {
            std::str::from_utf8(i)
                .ok()?
                .parse::<usize>()
                .ok()?
                .checked_sub(1)
        })
        .filter(|&i| i < limits)
        .collect()
}

#[cfg(all(test, feature = "redis"))]
mod tests {
    use super::*;

    fn packed(values: &[i64]) -> Vec<u8> {
        values
            .iter()
            .flat_map(|&x| (x as f64).to_le_bytes())
            .collect()
    }

    /// Each limit's status says what it is (no sentinel), and the
    /// decision's wait is the longest of its limits' (-1 when never).
    #[test]
    fn statuses_are_typed_and_the_wait_is_the_longest() {
        // denied at 100: a limit blocked for 50 more, one that allows in 10
        let reply =
            Reply::from_packed(&packed(&[1, 100, 2, 50, 0, 50, 0, 10, 3, 20]), 2).expect("a reply");
        assert_eq!(reply.verdict, VerdictCode::Denied);
        assert_eq!(reply.wait, 50);
        assert_eq!(
            &reply.limits[..],
            &[
                Status::Blocked { left: 50 },
                Status::Allows {
                    wait: 10,
                    remaining: 3,
                    reset: 20
                }
            ]
        );
        let never = Reply::from_packed(&packed(&[2, 100, 1, 0, 4, 9]), 1).expect("a reply");
        assert_eq!(never.wait, -1);
        assert_eq!(
            never.limits[0],
            Status::Never {
                remaining: 4,
                reset: 9
            }
        );
        assert_eq!(never.limits[0].wait(), None);
        // a kind the crate does not know is no reply
        assert_eq!(Reply::from_packed(&packed(&[0, 100, 7, 0, 4, 9]), 1), None);
    }
}
