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
//! Exactness has two exceptions, both outside this process: a `reset` of the
//! key, and a quota raised, by another process. A `reset` through this
//! limiter clears the key's entries.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::clock::Clock;
use crate::decision::Verdict;
use crate::store::Check;
use crate::Decision;

/// Entries kept at most; when full, expired ones are dropped first, then
/// nothing new is cached until some expire.
pub(crate) const CAPACITY: usize = 10_000;

struct Entry {
    /// The smallest cost denied, and until when (us on the cache's clock).
    cost: i64,
    until: i64,
    decision: Decision,
}

/// Denials of one limiter, by the limits and keys they were decided on.
pub(crate) struct DenyCache {
    entries: Mutex<HashMap<Vec<u8>, Entry>>,
    /// How many entries there are (kept under the lock, read without it):
    /// while none, a decision neither builds a cache key nor takes the lock.
    held: AtomicUsize,
    clock: Arc<dyn Clock>,
}

impl DenyCache {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            held: AtomicUsize::new(0),
            clock,
        }
    }

    /// Whether any denial is cached (expired ones included, until swept).
    pub(crate) fn holds_any(&self) -> bool {
        self.held.load(Ordering::Acquire) > 0
    }

    /// The time on the cache's clock, in us.
    pub(crate) fn now(&self) -> i64 {
        self.clock.now_micros()
    }

    /// The limits and keys of a decision: each limit's name and parameters
    /// (the tiers of a layer's limit share its name), then its key with its
    /// length (names hold no NUL), so the whole is unambiguous.
    pub(crate) fn key(checks: &[Check<'_>]) -> Vec<u8> {
        let mut key = Vec::with_capacity(checks.iter().map(|c| c.key.len() + 112).sum());
        for check in checks {
            key.extend_from_slice(check.limit.name().as_bytes());
            let params = check.limit.params();
            key.push(b'/');
            key.push(params.algorithm.id());
            for p in params.p {
                key.extend_from_slice(&p.to_le_bytes());
            }
            Self::segment(&mut key, check.key);
        }
        key
    }

    /// How `key` stands in a cache key: NUL, its length, itself.
    fn segment(out: &mut Vec<u8>, key: &[u8]) {
        out.push(0);
        out.extend_from_slice(&(key.len() as u64).to_le_bytes());
        out.extend_from_slice(key);
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
        let entries = self.lock();
        let entry = entries.get(key)?;
        let left = entry.until.saturating_sub(now);
        if cost < entry.cost || left <= max_wait.max(0) {
            return None;
        }
        let left = Duration::from_micros(u64::try_from(left).unwrap_or(0));
        Some(entry.decision.aged(left))
    }

    /// Remembers a denial decided on a request sent at `sent` (us on the
    /// cache's clock).
    pub(crate) fn insert(&self, key: Vec<u8>, cost: i64, sent: i64, decision: &Decision) {
        let Verdict::Denied { retry_after } = decision.verdict() else {
            return;
        };
        let retry = i64::try_from(retry_after.as_micros()).unwrap_or(i64::MAX);
        let until = sent.saturating_add(retry);
        let mut entries = self.lock();
        if entries.len() >= CAPACITY && !entries.contains_key(&key) {
            entries.retain(|_, e| e.until > sent);
            self.held.store(entries.len(), Ordering::Release);
            if entries.len() >= CAPACITY {
                return;
            }
        }
        match entries.get_mut(&key) {
            // a smaller cost denied, or the same cost denied for longer
            Some(e) if e.cost < cost || (e.cost == cost && e.until >= until) => {}
            _ => {
                entries.insert(
                    key,
                    Entry {
                        cost,
                        until,
                        decision: decision.clone(),
                    },
                );
                self.held.store(entries.len(), Ordering::Release);
            }
        }
    }

    /// Forgets every entry that involves `key` (a reset of that key; an
    /// entry that merely contains the same bytes goes too, which is safe).
    pub(crate) fn forget(&self, key: &[u8]) {
        let mut needle = Vec::with_capacity(key.len() + 9);
        Self::segment(&mut needle, key);
        let mut entries = self.lock();
        entries.retain(|k, _| !k.windows(needle.len()).any(|w| w == needle.as_slice()));
        self.held.store(entries.len(), Ordering::Release);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Vec<u8>, Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
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
