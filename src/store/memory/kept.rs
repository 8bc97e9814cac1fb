//! Quotas kept in the store (see `Limit::use_stored_quota`): a limit's, in
//! a map swapped whole on a change (read without a lock), and a key's
//! override, in one of [`SHARDS`](super::SHARDS) maps by the key's hash (an
//! ended one is dropped when looked up, or by the background sweep,
//! `reclaim.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use smallvec::SmallVec;

use super::key::{shards, Hasher, Key};
use super::Replied;
use crate::clock::Clock;
use crate::store::{lock, Check, Quotas};
use crate::Limit;

/// The quotas kept in a store.
pub(super) struct Kept {
    clock: Arc<dyn Clock>,
    /// By limit name.
    limits: ArcSwap<HashMap<&'static str, Limit>>,
    /// Held while `limits` is replaced.
    writing: Mutex<()>,
    /// Keys' overrides, by their key's shard.
    overrides: Box<[Mutex<Overrides>]>,
    hasher: Hasher,
    /// How many overrides all shards hold.
    count: AtomicUsize,
}

/// A key's override of a limit's quota.
pub(super) struct Override {
    limit: Limit,
    /// Store time (us) it ends, if it does.
    until: Option<i64>,
}

/// The overrides of one shard, by limit name and key.
pub(super) type Overrides = HashMap<(&'static str, Key), Override>;

/// Drops the overrides of `overrides` that ended by store time `now` (one a
/// decision looked up is dropped then; this reclaims those of keys that
/// came no more); returns how many.
pub(super) fn sweep_overrides(overrides: &mut Overrides, now: i64) -> usize {
    let before = overrides.len();
    overrides.retain(|_, o| o.until.is_none_or(|until| until > now));
    before - overrides.len()
}

/// Whether `check`'s quota may be kept in the store.
#[inline(always)]
pub(super) fn may_be_kept(check: &Check<'_>) -> bool {
    check.limit.uses_stored_quota()
}

impl Kept {
    pub(super) fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            limits: ArcSwap::default(),
            writing: Mutex::new(()),
            overrides: shards(),
            hasher: Hasher::default(),
            count: AtomicUsize::new(0),
        }
    }

    /// Runs `f` on `checks`, each limit whose quota may be kept in the store
    /// replaced by the one kept, if any; its answer is told, per limit, the
    /// parameters of a kept one that decided.
    #[inline(always)]
    pub(super) fn with<R: Replied>(
        &self,
        checks: &[Check<'_>],
        f: impl FnOnce(&[Check<'_>]) -> R,
    ) -> R {
        if !checks.iter().any(may_be_kept) {
            return f(checks);
        }
        self.with_kept(checks, f)
    }

    #[inline(never)]
    fn with_kept<R: Replied>(&self, checks: &[Check<'_>], f: impl FnOnce(&[Check<'_>]) -> R) -> R {
        let now = self.clock.now_micros();
        let kept: SmallVec<[Option<Limit>; 2]> = checks
            .iter()
            .map(|c| may_be_kept(c).then(|| self.kept_for(c, now)).flatten())
            .collect();
        if kept.iter().all(Option::is_none) {
            return f(checks);
        }
        let resolved: SmallVec<[Check<'_>; 2]> = checks
            .iter()
            .zip(&kept)
            .map(|(c, k)| Check {
                limit: k.as_ref().unwrap_or(c.limit),
                ..*c
            })
            .collect();
        let stored = kept
            .iter()
            .map(|k| k.as_ref().map(|l| *l.params()))
            .collect();
        let mut answer = f(&resolved);
        if let Some(reply) = answer.reply() {
            reply.stored = Some(stored);
        }
        answer
    }

    /// The quota kept for `check`: its key's override when `keyed`, else
    /// its limit's.
    pub(super) fn read(&self, check: &Check<'_>, keyed: bool) -> Option<crate::Quota> {
        let limit = if keyed {
            self.override_of(check, self.clock.now_micros())
        } else {
            self.limits.load().get(check.limit.shared_name()).cloned()
        };
        limit.map(|l| *l.quota())
    }

    /// Makes `change` to the quota kept for `check` (its key's override
    /// when `keyed`, else its limit's); whether it changed it.
    pub(super) fn change(&self, check: &Check<'_>, keyed: bool, change: Quotas<'_>) -> bool {
        let name = check.limit.shared_name();
        if !keyed {
            let _writing = lock(&self.writing);
            let current = self.limits.load_full();
            let mut next = HashMap::clone(&current);
            let changed = match change {
                Quotas::Keep {
                    if_absent: true, ..
                } if next.contains_key(name) => false,
                Quotas::Keep { limit, .. } => {
                    next.insert(name, limit.clone());
                    true
                }
                Quotas::Remove => next.remove(name).is_some(),
                Quotas::Read => false,
            };
            self.limits.store(Arc::new(next));
            return changed;
        }
        let now = self.clock.now_micros();
        let (mut overrides, id) = self.shard_of(check);
        let lasting = self.lasting(&mut overrides, &id, now).is_some();
        match change {
            Quotas::Keep {
                if_absent: true, ..
            } if lasting => false,
            Quotas::Keep { limit, ttl, .. } => {
                let until = ttl.map(|ttl| {
                    let us = i64::try_from(ttl.as_micros()).unwrap_or(i64::MAX);
                    now.saturating_add(us.max(1))
                });
                let limit = limit.clone();
                if overrides.insert(id, Override { limit, until }).is_none() {
                    self.count.fetch_add(1, Ordering::AcqRel);
                }
                true
            }
            Quotas::Remove => {
                let removed = overrides.remove(&id).is_some();
                if removed {
                    self.count.fetch_sub(1, Ordering::AcqRel);
                }
                removed && lasting
            }
            Quotas::Read => false,
        }
    }

    /// Drops the overrides of shard `s` that ended (see
    /// [`sweep_overrides`]).
    pub(super) fn sweep(&self, s: usize) {
        let now = self.clock.now_micros();
        if let Some(overrides) = self.overrides.get(s) {
            let ended = sweep_overrides(&mut lock(overrides), now);
            if ended > 0 {
                self.count.fetch_sub(ended, Ordering::AcqRel);
            }
        }
    }

    /// The quota kept for `check`: its key's override, else its limit's
    /// (not for a tier, see `Limit::overrides_only`); one of another
    /// algorithm than the limit's does not count.
    fn kept_for(&self, check: &Check<'_>, now: i64) -> Option<Limit> {
        let algorithm = check.limit.params().algorithm();
        let same = |limit: &Limit| limit.params().algorithm() == algorithm;
        if let Some(limit) = self.override_of(check, now).filter(same) {
            return Some(limit);
        }
        if check.limit.is_overrides_only() {
            return None;
        }
        let limits = self.limits.load();
        limits
            .get(check.limit.shared_name())
            .filter(|l| same(l))
            .cloned()
    }

    /// `check`'s override, while it lasts.
    fn override_of(&self, check: &Check<'_>, now: i64) -> Option<Limit> {
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        let (mut overrides, id) = self.shard_of(check);
        self.lasting(&mut overrides, &id, now)
    }

    /// The overrides of `check`'s key's shard, locked, and its id there.
    fn shard_of(
        &self,
        check: &Check<'_>,
    ) -> (std::sync::MutexGuard<'_, Overrides>, (&'static str, Key)) {
        let shard = Hasher::shard(self.hasher.hash(check.key));
        let id = (check.limit.shared_name(), Key::from_slice(check.key));
        (lock(&self.overrides[shard]), id)
    }

    /// The override `id` in `overrides` while it lasts at `now` (one that
    /// has ended is dropped).
    fn lasting(
        &self,
        overrides: &mut Overrides,
        id: &(&'static str, Key),
        now: i64,
    ) -> Option<Limit> {
        match overrides.get(id) {
            Some(o) if o.until.is_none_or(|until| until > now) => Some(o.limit.clone()),
            Some(_) => {
                overrides.remove(id);
                self.count.fetch_sub(1, Ordering::AcqRel);
                None
            }
            None => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::{Deadline, Engine};
    use crate::{ManualClock, MemoryStore, Quota};

    /// An ended override is dropped by the first decision of its key after
    /// its end (as the script deletes it from its hash).
    #[test]
    fn an_ended_override_is_dropped_by_the_next_decision_of_its_key() {
        let second = Duration::from_secs(1);
        let clock = ManualClock::new(1_800_000_000_000_000);
        let store = MemoryStore::with_clock(clock.clone());
        let limit = |n| {
            Limit::new("l", Quota::per_minute(n).fixed_window())
                .expect("limit")
                .use_stored_quota()
        };
        let (own, kept) = (limit(1), limit(5));
        let check = Check {
            limit: &own,
            key: b"k",
            cost: 1,
        };
        let keep = Quotas::Keep {
            limit: &kept,
            ttl: Some(second),
            if_absent: false,
        };
        assert!(store.inner.kept.change(&check, true, keep));
        let held = || store.inner.kept.count.load(Ordering::Acquire);
        assert_eq!(held(), 1);
        clock.advance(second);
        let checks = [check];
        let decided = store.decide(&checks, 0, false, Deadline::after(second));
        assert!(matches!(decided, crate::store::Answer::Now(Ok(_))));
        assert_eq!(held(), 0, "dropped");
    }

    #[test]
    fn a_sweep_drops_ended_overrides_only() {
        let limit = Limit::new("l", Quota::per_minute(1).fixed_window()).expect("limit");
        let mut overrides = Overrides::new();
        for (key, until) in [(&b"a"[..], Some(10)), (b"b", Some(20)), (b"c", None)] {
            let id = (limit.shared_name(), Key::from_slice(key));
            let limit = limit.clone();
            overrides.insert(id, Override { limit, until });
        }
        assert_eq!(sweep_overrides(&mut overrides, 10), 1);
        assert_eq!(sweep_overrides(&mut overrides, 15), 0);
        assert_eq!(sweep_overrides(&mut overrides, i64::MAX), 1);
        assert_eq!(overrides.len(), 1, "the lasting one stays");
    }
}
