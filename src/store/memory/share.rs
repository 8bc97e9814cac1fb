//! Each limit's share of the store: how many rate and penalty states each
//! limit (by name) holds, and which limit a full store takes a state from.
//!
//! A full store takes the place of a state of the limit that holds the
//! most states of that kind, the new state's own limit counted with it
//! and preferred on a tie (see [`Limits::donor`]). So a limit is never
//! given up for another limit's key while it holds no more states than
//! that limit will: a limit within its fair share (the states of that
//! kind over the limits that hold some) keeps them whatever another limit
//! is flooded with, and a flood gives up its own states. Which of its
//! states is found by a [`search`] of the shards.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use arc_swap::ArcSwap;

use crate::store::lock;

/// One limit's states in the store, shared by its tables in every shard.
#[derive(Debug)]
pub(super) struct Usage {
    /// Interned: compared by address.
    pub(super) name: &'static str,
    /// Its rate states (see `table.rs`).
    pub(super) states: AtomicUsize,
    /// Its penalty states (see `penalized.rs`).
    pub(super) pens: AtomicUsize,
}

/// The limits of a store, read without a lock (a limit is added once, the
/// first time one of its states is made in a shard).
#[derive(Default)]
pub(super) struct Limits {
    list: ArcSwap<Vec<Arc<Usage>>>,
    /// Held while `list` is replaced.
    writing: Mutex<()>,
}

impl Limits {
    /// The usage of the limit named `name` (interned), added on first use.
    pub(super) fn usage(&self, name: &'static str) -> Arc<Usage> {
        let find = |list: &[Arc<Usage>]| {
            list.iter()
                .find(|u| std::ptr::eq(u.name, name))
                .map(Arc::clone)
        };
        if let Some(found) = find(&self.list.load()) {
            return found;
        }
        let _writing = lock(&self.writing);
        let current = self.list.load_full();
        if let Some(found) = find(&current) {
            return found;
        }
        let usage = Arc::new(Usage {
            name,
            states: AtomicUsize::new(0),
            pens: AtomicUsize::new(0),
        });
        let mut next = Vec::clone(&current);
        next.push(Arc::clone(&usage));
        self.list.store(Arc::new(next));
        usage
    }

    /// The limit a full store takes a state from, of the kind whose count
    /// `of` reads (rate or penalty), for a new state of `asking` (none: a
    /// penalty state's room among rate states): the one that holds the
    /// most, `asking` counted with its new state and preferred on a tie.
    /// `None` when no limit holds one.
    pub(super) fn donor(
        &self,
        of: impl Fn(&Usage) -> &AtomicUsize,
        asking: Option<&Arc<Usage>>,
    ) -> Option<Arc<Usage>> {
        let count = |u: &Usage| of(u).load(Ordering::Acquire);
        let list = self.list.load();
        let mut best: Option<(usize, &Arc<Usage>)> =
            asking.map(|u| (count(u).saturating_add(1), u));
        for usage in list.iter() {
            let n = count(usage);
            if n > 0 && best.is_none_or(|(most, _)| n > most) {
                best = Some((n, usage));
            }
        }
        best.map(|(_, usage)| Arc::clone(usage))
    }
}

/// What a look in one shard found: the state it ranks first, if any (its
/// rank, where it is), and how many states it compared.
pub(super) type Look<R, P> = (Option<(R, P)>, usize);

/// What a search of the shards found: the guard of its shard (`None`: the
/// shard the caller holds), its rank and where it is.
type Found<'s, T, R, P> = Option<(Option<MutexGuard<'s, T>>, R, P)>;

/// Of what `look` finds in `shards` (see [`Look`]; smallest rank first,
/// on a tie the first found), the first: in the shard `own`, when the caller holds it
/// (`held`: what `look` found there), then in the next shards in turn,
/// each taken without waiting (one busy, or held by the caller, is passed
/// over: never waiting while holding a shard, no lock order to keep),
/// until `enough` were compared and the first so far is `good`, or every
/// shard was.
pub(super) fn search<'s, T, R: PartialOrd, P>(
    shards: &'s [Mutex<T>],
    own: usize,
    held: Option<Look<R, P>>,
    enough: usize,
    good: impl Fn(&R) -> bool,
    mut look: impl FnMut(&mut T) -> Look<R, P>,
) -> Found<'s, T, R, P> {
    let first = usize::from(held.is_some());
    let (found, mut seen) = held.unwrap_or((None, 0));
    let mut best: Found<'s, T, R, P> = found.map(|(r, at)| (None, r, at));
    for k in first..shards.len() {
        if seen >= enough && best.as_ref().is_some_and(|(_, r, _)| good(r)) {
            break;
        }
        let Some(mutex) = shards.get((own + k) % shards.len()) else {
            continue;
        };
        let mut guard = match mutex.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => continue,
        };
        let (found, n) = look(&mut guard);
        seen += n;
        if let Some((r, at)) = found {
            if best.as_ref().is_none_or(|(_, b, _)| r < *b) {
                best = Some((Some(guard), r, at));
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::Limits;
    use std::sync::atomic::Ordering;

    /// The donor is the limit holding the most, the asking one preferred on
    /// a tie (counted with its new state).
    #[test]
    fn the_donor_is_the_limit_that_holds_the_most() {
        let limits = Limits::default();
        let name: &'static str = "a";
        let (a, b) = (limits.usage(name), limits.usage("b"));
        assert!(std::sync::Arc::ptr_eq(&a, &limits.usage(name)));
        a.states.store(10, Ordering::Release);
        b.states.store(3, Ordering::Release);
        let donor = |asking| limits.donor(|u| &u.states, asking).map(|u| u.name);
        assert_eq!(donor(Some(&b)), Some("a"));
        assert_eq!(donor(Some(&a)), Some("a"));
        assert_eq!(donor(None), Some("a"));
        b.states.store(9, Ordering::Release);
        assert_eq!(donor(Some(&b)), Some("b"), "9 + 1: a tie, its own");
        assert_eq!(limits.donor(|u| &u.pens, None).map(|u| u.name), None);
    }
}
