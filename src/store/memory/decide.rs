//! One atomic decision over a limiter's checks: every key's state located
//! under its shard's lock, prepared, decided by the caller (see
//! `algorithm::decide`, `take`, `charge`) and put back.
//!
//! The decision is written once, over a [`Width`]: how it holds one value
//! per check. A decision over one limit (the common case) holds them in
//! one-element arrays, so nothing is collected; others in `SmallVec`s.

use std::sync::{Mutex, MutexGuard};

use smallvec::SmallVec;

use super::key::Hasher;
use super::table::{Found, Shard, Table};
use super::write::Put;
use super::{lock, MemoryStore};
use crate::algorithm::{self, Operand, Reply, State};
use crate::store::Check;

/// Where a decision finds one check's state: its key's hash and shard, the
/// index of that shard's lock among the decision's, its table there, its
/// slot, and whether preparing the state moved it back to the decision's
/// clock.
struct Place {
    hash: u64,
    shard: usize,
    lock: usize,
    table: usize,
    found: Found,
    moved: bool,
}

/// A lock of a decision on several limits: a shard, and its guard when this
/// entry is the first of that shard's (the entries are in shard order).
type Lock<'s> = (usize, Option<MutexGuard<'s, Shard>>);

/// How a decision holds one value per check.
trait Width {
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
struct One;

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
struct Many;

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

impl MemoryStore {
    /// One atomic decision over `checks` with every key's state prepared and
    /// locked: `decide` makes it and says whether the states are written
    /// back.
    #[inline(always)]
    pub(super) fn decide_with(
        &self,
        checks: &[Check<'_>],
        decide: impl FnOnce(&mut [Operand<'_>], i64) -> (Reply, bool),
    ) -> Reply {
        match <&[Check<'_>; 1]>::try_from(checks) {
            Ok(one) => self.decide_in::<One>(one, decide),
            Err(_) => self.decide_in::<Many>(checks, decide),
        }
    }

    #[inline(always)]
    fn decide_in<'c, 'a: 'c, W: Width>(
        &self,
        checks: W::Checks<'c, 'a>,
        decide: impl FnOnce(&mut [Operand<'_>], i64) -> (Reply, bool),
    ) -> Reply {
        let inner = &*self.inner;
        let store_now = inner.clock.now_micros();
        let mut places = W::each(checks, |check| {
            let hash = inner.hasher.hash(check.key);
            Place {
                hash,
                shard: Hasher::shard(hash),
                lock: 0,
                table: 0,
                found: Found::Absent,
                moved: false,
            }
        });
        let mut locks = W::lock(&inner.shards, &mut places);

        // Where each check's state is. Nothing moves until the write-back,
        // where the limits of a limiter, having distinct names, each write
        // their own table. As in `lua/driver.lua`, the decision's clock is
        // the latest of the store's and of every key's last write as
        // believed (at most the limit's horizon ahead), so within that time
        // it never runs back.
        let mut now = store_now;
        for (check, place) in checks.as_ref().iter().zip(places.as_mut()) {
            let Some(shard) = W::shard(&mut locks, place) else {
                continue;
            };
            place.table = shard.table(check.limit, &inner.limits);
            let table = &mut shard.tables[place.table];
            place.found = inner.locate(table, place.hash, check.key, store_now);
            if let Some(slot) = table.found(place.found) {
                now = now.max(algorithm::believed(
                    store_now,
                    slot.written,
                    check.limit.params(),
                ));
            }
        }

        let mut ops = W::zip(checks, &mut places, |check, place| {
            let p = check.limit.params();
            let (state, moved) = match table_of::<W>(&mut locks, place) {
                Some(table) => table.prepare(place.found, p, now),
                None => State::prepare(None, p, now, now),
            };
            place.moved = moved;
            Operand {
                state,
                p,
                cost: check.cost,
            }
        });
        let (reply, write) = decide(ops.as_mut(), now);

        let (mut added, mut full) = (false, false);
        W::each_taken(checks, ops, &places, |check, op, place| {
            if let Some(table) = table_of::<W>(&mut locks, place) {
                match inner.write_back(
                    table,
                    check,
                    op.state,
                    place.found,
                    place.hash,
                    write,
                    place.moved,
                    now,
                    store_now,
                ) {
                    Put::Kept => {}
                    Put::Added => added = true,
                    Put::Full => full = true,
                }
            }
        });
        if full {
            // once every state is back (a state given up moves others'
            // slots): room for each new key first, so that none takes the
            // place of another made by this decision, then the keys
            for place in places.as_ref() {
                if let Some(shard) = W::shard(&mut locks, place) {
                    inner.make_room(shard, place.table, place.hash, store_now);
                }
            }
            for place in places.as_ref() {
                if let Some(shard) = W::shard(&mut locks, place) {
                    added |= inner.add_at_bound(shard, place.table, place.hash);
                }
            }
        }
        drop(locks);
        if added {
            self.ensure_reclaimer();
        }
        reply
    }
}

/// The table `place` locates its check in, while `locks` hold it.
#[inline(always)]
fn table_of<'t, W: Width>(locks: &'t mut W::Locks<'_>, place: &Place) -> Option<&'t mut Table> {
    W::shard(locks, place)?.tables.get_mut(place.table)
}
