//! The local cache of denials that keeps a flood on one key away from the
//! store.
//!
//! A decision denied with `retry_after` R stays denied, for the same limits
//! and keys and the same or a larger cost, until R has passed: consumption by
//! any instance only delays the next grant, and a larger cost fits later. So
//! until then the answer is known without asking the store. R is counted from
//! the moment the request was sent, before the store read its clock, so the
//! entry expires no later than the store would grant.
//!
//! Time is read from the clock the store decides on when it has one (an
//! application clock), else from this process's monotonic clock, which runs
//! at the rate of Redis' (an offset between them does not matter).
//!
//! Exactness has three exceptions, all outside this process: a `reset` of
//! the key, a quota raised, and an `unblock` of a key blocked by a penalty,
//! by another process. A `reset`, refund or `unblock` through this limiter
//! forgets the key's entries, and a denial decided on a request sent before
//! such a forget is not cached.
//!
//! A denial of a hot limit (`Limit::with_hot_key`) is held at most the limit's
//! batch hold: within it, other instances give their unused permits back.
//!
//! A limit with a penalty (`Limit::with_penalty`) counts its refusals in the
//! store, so its denials are cached only while it blocks the key: then the
//! denial holds until the block ends (its `retry_after` is at least that),
//! and refusals during a block are not counted anyway. Another denial of it
//! must reach the store to be counted, and is not cached.
//!
//! Bounds, whatever clients send: at most [`CAPACITY`] entries, each holding
//! its limits' names (at most 64 bytes each) and parameters and, per key,
//! at most [`keys::MAX_RAW_KEY`] bytes (longer keys are held as their
//! SHA-256, as the stores hold them). Forgetting a key is O(1): it bumps
//! the epoch of the key's slot, and an entry whose keys' slots moved on since
//! it was cached reads as absent (a slot shared with another key costs at
//! most a round trip, never a wrong refusal). When full, the expired entries
//! go, and if that frees less than an eighth, the eighth nearest their
//! expiry: a few round trips more, never a refusal the store would not make.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use smallvec::SmallVec;

use crate::clock::Clock;
use crate::decision::Verdict;
use crate::store::{keys, Check};
use crate::Decision;

/// Entries kept at most (see the module's bounds).
pub(crate) const CAPACITY: usize = 10_000;

/// Epoch slots that keys hash to (see the module's bounds).
const SLOTS: usize = 1024;

struct Entry {
    /// The smallest cost denied, and until when (us on the cache's clock).
    cost: i64,
    until: i64,
    decision: Decision,
    /// Each key's slot and that slot's epoch when the entry was cached.
    epochs: SmallVec<[(u16, u32); 2]>,
}

struct Table {
    entries: HashMap<Vec<u8>, Entry>,
    epochs: Box<[u32]>,
    /// No entry expires before this (us on the cache's clock).
    earliest: i64,
}

/// Whether none of `entry`'s keys was forgotten since it was cached.
fn current(epochs: &[u32], entry: &Entry) -> bool {
    entry
        .epochs
        .iter()
        .all(|&(slot, epoch)| epochs.get(usize::from(slot)) == Some(&epoch))
}

impl Table {
    /// Makes room at `now`: drops expired and forgotten entries, and, while
    /// that leaves the table more than seven eighths full, the entries that
    /// expire first.
    fn make_room(&mut self, now: i64) {
        let epochs = &self.epochs;
        self.entries
            .retain(|_, e| e.until > now && current(epochs, e));
        let keep = CAPACITY - CAPACITY / 8;
        if self.entries.len() > keep {
            let mut untils: Vec<i64> = self.entries.values().map(|e| e.until).collect();
            // the latest of the `len - keep` that expire first (ties go too)
            let cut = untils.len() - keep - 1;
            let (_, &mut threshold, _) = untils.select_nth_unstable(cut);
            self.entries.retain(|_, e| e.until > threshold);
        }
        self.earliest = self
            .entries
            .values()
            .map(|e| e.until)
            .min()
            .unwrap_or(i64::MAX);
    }
}

/// When a request was sent, as the cache reads it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sent {
    /// us on the cache's clock
    pub(crate) at: i64,
    /// how many keys had been forgotten
    forgets: u64,
}

/// Denials of one limiter, by the limits and keys they were decided on.
pub(crate) struct DenyCache {
    table: Mutex<Table>,
    /// How many entries there are (kept under the lock, read without it):
    /// while none, a decision neither builds a cache key nor takes the lock.
    held: AtomicUsize,
    /// Keys forgotten so far: a denial decided across a forget is not cached.
    forgets: AtomicU64,
    hasher: foldhash::quality::RandomState,
    clock: Arc<dyn Clock>,
}

impl DenyCache {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            table: Mutex::new(Table {
                entries: HashMap::new(),
                epochs: vec![0; SLOTS].into_boxed_slice(),
                earliest: i64::MAX,
            }),
            held: AtomicUsize::new(0),
            forgets: AtomicU64::new(0),
            hasher: foldhash::quality::RandomState::default(),
            clock,
        }
    }

    /// Whether any denial is cached (expired ones included, until swept).
    pub(crate) fn holds_any(&self) -> bool {
        self.held.load(Ordering::Acquire) > 0
    }

    /// The moment a request is sent.
    pub(crate) fn sent(&self) -> Sent {
        Sent {
            forgets: self.forgets.load(Ordering::Acquire),
            at: self.clock.now_micros(),
        }
    }

    /// The limits and keys of a decision: each limit's name and parameters
    /// (the tiers of a layer's limit share its name), then its key (see
    /// [`segment`](Self::segment)), so the whole is unambiguous.
    pub(crate) fn key(checks: &[Check<'_>]) -> Vec<u8> {
        let size = |c: &Check<'_>| c.key.len().min(keys::MAX_RAW_KEY) + 112;
        let mut key = Vec::with_capacity(checks.iter().map(size).sum());
        for check in checks {
            key.extend_from_slice(check.limit.name().as_bytes());
            let params = check.limit.params();
            key.push(b'/');
            key.push(params.algorithm().id());
            for p in params.wire() {
                key.extend_from_slice(&p.to_le_bytes());
            }
            Self::segment(&mut key, check.key);
        }
        key
    }

    /// How `key` stands in a cache key: NUL and its length, then itself, or,
    /// beyond [`keys::MAX_RAW_KEY`] bytes, its SHA-256 (its length, over the
    /// bound, tells the two apart).
    fn segment(out: &mut Vec<u8>, key: &[u8]) {
        out.push(0);
        out.extend_from_slice(&(key.len() as u64).to_le_bytes());
        if key.len() > keys::MAX_RAW_KEY {
            out.extend_from_slice(&Sha256::digest(key));
        } else {
            out.extend_from_slice(key);
        }
    }

    /// The epoch slot of a key.
    fn slot(&self, key: &[u8]) -> u16 {
        // SLOTS fits in u16
        (self.hasher.hash_one(key) % SLOTS as u64) as u16
    }

    /// The store's answer for `cost` at `now`, when it is known to be a
    /// denial: a cached one that still holds, whose retry lies beyond
    /// `max_wait` (a longer wait may be granted as a reservation).
    pub(crate) fn lookup(
        &self,
        key: &[u8],
        cost: i64,
        max_wait: i64,
        now: i64,
    ) -> Option<Decision> {
        let mut table = self.lock();
        let entry = table.entries.get(key)?;
        if !current(&table.epochs, entry) {
            table.entries.remove(key);
            self.held.store(table.entries.len(), Ordering::Release);
            return None;
        }
        let left = entry.until.saturating_sub(now);
        if cost < entry.cost || left <= max_wait.max(0) {
            return None;
        }
        let left = Duration::from_micros(u64::try_from(left).unwrap_or(0));
        Some(entry.decision.aged(left))
    }

    /// Remembers a denial of `checks` (whose cache key is `key`) decided on
    /// a request sent at `sent`.
    pub(crate) fn insert(
        &self,
        key: Vec<u8>,
        checks: &[Check<'_>],
        cost: i64,
        sent: Sent,
        decision: &Decision,
    ) {
        let Verdict::Denied { retry_after } = decision.verdict() else {
            return;
        };
        // a hot limit's batches give unused permits back within their hold
        let retry = checks
            .iter()
            .filter_map(|c| c.limit.hot_key())
            .map(crate::HotKey::hold_us)
            .fold(
                i64::try_from(retry_after.as_micros()).unwrap_or(i64::MAX),
                i64::min,
            );
        let until = sent.at.saturating_add(retry);
        let slots: SmallVec<[u16; 2]> = checks.iter().map(|c| self.slot(c.key)).collect();
        let mut table = self.lock();
        // a key forgotten since the request was sent: the denial may be stale
        if self.forgets.load(Ordering::Acquire) != sent.forgets {
            return;
        }
        if table.entries.len() >= CAPACITY && !table.entries.contains_key(&key) {
            if table.earliest > sent.at {
                // nothing has expired: full until something does
                return;
            }
            table.make_room(sent.at);
        }
        let epochs = slots
            .iter()
            .map(|&slot| (slot, table.epochs[usize::from(slot)]))
            .collect();
        match table.entries.get_mut(&key) {
            // a smaller cost denied, or the same cost denied for longer
            Some(e) if e.cost < cost || (e.cost == cost && e.until >= until) => {}
            _ => {
                table.entries.insert(
                    key,
                    Entry {
                        cost,
                        until,
                        decision: decision.clone(),
                        epochs,
                    },
                );
                table.earliest = table.earliest.min(until);
                self.held.store(table.entries.len(), Ordering::Release);
            }
        }
    }

    /// Forgets every entry that involves `key` (a reset or refund of that
    /// key), in O(1): see the module's bounds.
    pub(crate) fn forget(&self, key: &[u8]) {
        let slot = usize::from(self.slot(key));
        let mut table = self.lock();
        self.forgets.fetch_add(1, Ordering::AcqRel);
        if let Some(epoch) = table.epochs.get_mut(slot) {
            *epoch = epoch.wrapping_add(1);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        crate::sync::lock(&self.table)
    }
}

impl Decision {
    /// This denial as the cache answers it `left` before its retry: the
    /// waits and resets shortened by the time that has passed.
    fn aged(&self, left: Duration) -> Decision {
        let Verdict::Denied { retry_after } = self.verdict else {
            return self.clone();
        };
        let passed =
            u64::try_from(retry_after.saturating_sub(left).as_micros()).unwrap_or(u64::MAX);
        let mut decision = self.clone();
        decision.verdict = Verdict::Denied { retry_after: left };
        for status in &mut decision.statuses {
            if status.wait_us != u64::MAX {
                status.wait_us = status.wait_us.saturating_sub(passed);
            }
            status.reset_us = status.reset_us.saturating_sub(passed);
        }
        decision.cached = true;
        decision
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::LimitStatuses;
    use crate::{Limit, ManualClock, Quota};

    const T0: i64 = 1_800_000_000_000_000;

    fn limit() -> Limit {
        Limit::new("login", Quota::per_minute(1).allow_burst(1).gcra()).expect("limit")
    }

    fn denied(retry: Duration) -> Decision {
        Decision::new(
            Verdict::Denied { retry_after: retry },
            0,
            LimitStatuses::new(),
        )
    }

    fn cache() -> (DenyCache, ManualClock) {
        let clock = ManualClock::new(T0);
        (DenyCache::new(Arc::new(clock.clone())), clock)
    }

    /// Caches a denial of `key` for `retry`, sent now.
    fn deny(cache: &DenyCache, limit: &Limit, key: &[u8], retry: Duration) {
        let checks = [Check {
            limit,
            key,
            cost: 1,
        }];
        let sent = cache.sent();
        cache.insert(DenyCache::key(&checks), &checks, 1, sent, &denied(retry));
    }

    fn holds(cache: &DenyCache, limit: &Limit, key: &[u8]) -> bool {
        let checks = [Check {
            limit,
            key,
            cost: 1,
        }];
        let now = cache.sent().at;
        cache.lookup(&DenyCache::key(&checks), 1, 0, now).is_some()
    }

    #[test]
    fn a_key_of_any_length_costs_a_bounded_entry() {
        let limit = limit();
        let (long, longer) = (vec![b'u'; 16 << 10], vec![b'u'; (16 << 10) + 1]);
        let key = |key: &[u8]| {
            DenyCache::key(&[Check {
                limit: &limit,
                key,
                cost: 1,
            }])
        };
        let bound = limit.name().len() + 2 + 8 * 4 + 9 + keys::MAX_RAW_KEY;
        assert!(key(&long).len() <= bound, "{} bytes", key(&long).len());
        assert_ne!(key(&long), key(&longer));
        let (cache, _) = cache();
        deny(&cache, &limit, &long, Duration::from_secs(60));
        assert!(holds(&cache, &limit, &long));
        assert!(!holds(&cache, &limit, &longer));
    }

    #[test]
    fn a_forgotten_key_reads_as_absent() {
        let limit = limit();
        let (cache, _) = cache();
        let keys: Vec<Vec<u8>> = (0..64).map(|i| format!("user-{i}").into_bytes()).collect();
        for key in &keys {
            deny(&cache, &limit, key, Duration::from_secs(60));
        }
        cache.forget(&keys[0]);
        assert!(!holds(&cache, &limit, &keys[0]));
        // the others stay, but for the few that share its slot
        let slot = cache.slot(&keys[0]);
        for key in &keys[1..] {
            assert_eq!(holds(&cache, &limit, key), cache.slot(key) != slot);
        }
        // cached again once denied again
        deny(&cache, &limit, &keys[0], Duration::from_secs(60));
        assert!(holds(&cache, &limit, &keys[0]));
    }

    #[test]
    fn a_denial_decided_across_a_forget_is_not_cached() {
        let limit = limit();
        let (cache, _) = cache();
        let checks = [Check {
            limit: &limit,
            key: b"user",
            cost: 1,
        }];
        let sent = cache.sent();
        // a reset of the key while the request was out
        cache.forget(b"user");
        let decision = denied(Duration::from_secs(60));
        cache.insert(DenyCache::key(&checks), &checks, 1, sent, &decision);
        assert!(!holds(&cache, &limit, b"user"));
    }

    #[test]
    fn a_full_cache_makes_room_an_eighth_at_a_time() {
        let limit = limit();
        let (cache, clock) = cache();
        for i in 0..CAPACITY {
            let retry = Duration::from_secs(10) + Duration::from_micros(i as u64);
            deny(&cache, &limit, format!("k{i}").as_bytes(), retry);
        }
        let size = || cache.lock().entries.len();
        assert_eq!(size(), CAPACITY);
        // nothing expired: the newcomer is not cached, nothing is scanned
        deny(&cache, &limit, b"new", Duration::from_secs(60));
        assert!(!holds(&cache, &limit, b"new"));
        assert_eq!(size(), CAPACITY);
        // one expired: it goes, and an eighth with it
        clock.advance(Duration::from_secs(10));
        deny(&cache, &limit, b"new", Duration::from_secs(60));
        assert!(holds(&cache, &limit, b"new"));
        assert_eq!(size(), CAPACITY - CAPACITY / 8 + 1);
        // the ones that expire last are kept
        assert!(holds(
            &cache,
            &limit,
            format!("k{}", CAPACITY - 1).as_bytes()
        ));
    }
}
