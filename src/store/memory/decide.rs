//! How a decision over the rate states (see `States::decide`) holds one
//! value per check and locks its shards: the decision is written once,
//! over a [`Width`]. A decision over one limit (the common case) holds its
//! values in one-element arrays, so nothing is collected, and one plain
//! guard; others in `SmallVec`s, their shards locked in order.

use std::sync::{Mutex, MutexGuard};

use smallvec::SmallVec;

use super::table::{Found, Shard, Table};
use crate::store::{lock, Check};

/// Where a decision finds one check's state: its key's hash and shard, the
/// index of that shard's lock among the decision's, its table there, its
/// slot, and whether preparing the state moved it back to the decision's
/// clock.
pub(super) struct Place {
    pub(super) hash: u64,
    pub(super) shard: usize,
    pub(super) lock: usize,
    pub(super) table: usize,
    pub(super) found: Found,
    pub(super) moved: bool,
}

/// A lock of a decision on several limits: a shard, and its guard when this
/// entry is the first of that shard's (the entries are in shard order).
type Lock<'s> = (usize, Option<MutexGuard<'s, Shard>>);

/// How a decision holds one value per check.
pub(super) trait Width {
    /// The checks, as the decision receives them.
    type Checks<'c, 'a: 'c>: Copy + AsRef<[Check<'a>]>;
    /// One value per check.
    type Of<T>: AsRef<[T]> + AsMut<[T]> + IntoIterator<Item = T>;
    /// `f` of each check, in order.
    fn each<'c, 'a: 'c, T>(
        checks: Self::Checks<'c, 'a>,
        f: impl FnMut(&Check<'a>) -> T,
    ) -> Self::Of<T>;
    /// `f` of each check and its value.
    fn zip<'c, 'a: 'c, T, U>(
        checks: Self::Checks<'c, 'a>,
        values: &mut Self::Of<T>,
        f: impl FnMut(&Check<'a>, &mut T) -> U,
    ) -> Self::Of<U>;
    /// `f` of each check, its value (taken) and its `other` value.
    fn each_taken<'c, 'a: 'c, T, U>(
        checks: Self::Checks<'c, 'a>,
        values: Self::Of<T>,
        other: &Self::Of<U>,
        f: impl FnMut(&Check<'a>, T, &U),
    );
    /// The locks of a decision's shards.
    type Locks<'s>;
    /// Locks the shards of `places`, each once and in shard order (no
    /// deadlock between concurrent decisions), and notes in each place
    /// where its shard's lock is.
    fn lock<'s>(shards: &'s [Mutex<Shard>], places: &mut Self::Of<Place>) -> Self::Locks<'s>;
    /// The locked shard of `place`.
    fn shard<'l>(locks: &'l mut Self::Locks<'_>, place: &Place) -> Option<&'l mut Shard>;
}

/// One check: values in one-element arrays.
pub(super) struct One;

impl Width for One {
    type Checks<'c, 'a: 'c> = &'c [Check<'a>; 1];
    type Of<T> = [T; 1];
    #[inline(always)]
    fn each<'c, 'a: 'c, T>(
        checks: &'c [Check<'a>; 1],
        mut f: impl FnMut(&Check<'a>) -> T,
    ) -> [T; 1] {
        let [check] = checks;
        [f(check)]
    }
    #[inline(always)]
    fn zip<'c, 'a: 'c, T, U>(
        [check]: &'c [Check<'a>; 1],
        [value]: &mut [T; 1],
        mut f: impl FnMut(&Check<'a>, &mut T) -> U,
    ) -> [U; 1] {
        [f(check, value)]
    }
    #[inline(always)]
    fn each_taken<'c, 'a: 'c, T, U>(
        [check]: &'c [Check<'a>; 1],
        [value]: [T; 1],
        [other]: &[U; 1],
        mut f: impl FnMut(&Check<'a>, T, &U),
    ) {
        f(check, value, other);
    }
    type Locks<'s> = Option<MutexGuard<'s, Shard>>;
    #[inline(always)]
    fn lock<'s>(shards: &'s [Mutex<Shard>], [place]: &mut [Place; 1]) -> Self::Locks<'s> {
        shards.get(place.shard).map(lock)
    }
    #[inline(always)]
    fn shard<'l>(locks: &'l mut Self::Locks<'_>, _: &Place) -> Option<&'l mut Shard> {
        locks.as_deref_mut()
    }
}

/// Any number of checks: values in `SmallVec`s.
pub(super) struct Many;

impl Width for Many {
    type Checks<'c, 'a: 'c> = &'c [Check<'a>];
    type Of<T> = SmallVec<[T; 2]>;
    #[inline(always)]
    fn each<'c, 'a: 'c, T>(
        checks: &'c [Check<'a>],
        f: impl FnMut(&Check<'a>) -> T,
    ) -> SmallVec<[T; 2]> {
        checks.iter().map(f).collect()
    }
    #[inline(always)]
    fn zip<'c, 'a: 'c, T, U>(
        checks: &'c [Check<'a>],
        values: &mut SmallVec<[T; 2]>,
        mut f: impl FnMut(&Check<'a>, &mut T) -> U,
    ) -> SmallVec<[U; 2]> {
        checks.iter().zip(values).map(|(c, v)| f(c, v)).collect()
    }
    #[inline(always)]
    fn each_taken<'c, 'a: 'c, T, U>(
        checks: &'c [Check<'a>],
        values: SmallVec<[T; 2]>,
        other: &SmallVec<[U; 2]>,
        mut f: impl FnMut(&Check<'a>, T, &U),
    ) {
        for ((check, value), other) in checks.iter().zip(values).zip(other) {
            f(check, value, other);
        }
    }
    /// A shard's first entry holds its guard.
    type Locks<'s> = SmallVec<[Lock<'s>; 2]>;
    #[inline(always)]
    fn lock<'s>(shards: &'s [Mutex<Shard>], places: &mut SmallVec<[Place; 2]>) -> Self::Locks<'s> {
        let mut locks: Self::Locks<'s> = places.iter().map(|p| (p.shard, None)).collect();
        locks.sort_unstable_by_key(|&(shard, _)| shard);
        let mut last = None;
        for (shard, guard) in locks.iter_mut() {
            if last != Some(*shard) {
                *guard = shards.get(*shard).map(lock);
                last = Some(*shard);
            }
        }
        for place in places.iter_mut() {
            place.lock = locks.partition_point(|&(shard, _)| shard < place.shard);
        }
        locks
    }
    #[inline(always)]
    fn shard<'l>(locks: &'l mut Self::Locks<'_>, place: &Place) -> Option<&'l mut Shard> {
        match locks.get_mut(place.lock)? {
            (_, Some(shard)) => Some(shard),
            (_, None) => None,
        }
    }
}

/// The table `place` locates its check in, while `locks` hold it.
#[inline(always)]
pub(super) fn table_of<'t, W: Width>(
    locks: &'t mut W::Locks<'_>,
    place: &Place,
) -> Option<&'t mut Table> {
    W::shard(locks, place)?.tables.get_mut(place.table)
}
