//! Failed lookups: logged at most once per interval, and counted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, TryLockError};
use std::time::{Duration, Instant};

use super::{BoxError, OnLookupError};

/// Why a lookup gave no answer.
#[derive(Debug)]
pub(super) enum Failure {
    Failed(BoxError),
    TimedOut(Duration),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Failed(error) => write!(f, "the lookup failed: {error}"),
            Failure::TimedOut(timeout) => write!(f, "the lookup did not answer within {timeout:?}"),
        }
    }
}

/// Failed lookups in the logs: at most one `warn` line per interval, with
/// the number of requests they failed since the line before and what the
/// policy did with them.
/// (The store's outage log, which logs each outage's start and end at
/// once, would log twice per change when lookups of some keys fail and
/// others answer.)
pub(super) struct FailureLog {
    interval: Duration,
    /// When the last line was logged; `None` before the first.
    last_line: Mutex<Option<Instant>>,
    /// Requests not yet counted in a line.
    unreported: AtomicU64,
}

impl FailureLog {
    pub(super) fn new(interval: Duration) -> Self {
        Self {
            interval,
            last_line: Mutex::new(None),
            unreported: AtomicU64::new(0),
        }
    }

    /// A request's lookup failed; `policy` says what it got.
    pub(super) fn record(&self, failure: &Failure, policy: OnLookupError) {
        self.unreported.fetch_add(1, Ordering::AcqRel);
        // whoever holds the lock is already deciding whether to log
        let mut last = match self.last_line.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        let now = Instant::now();
        if last.is_some_and(|at| now.saturating_duration_since(at) < self.interval) {
            return;
        }
        *last = Some(now);
        let failed = self.unreported.swap(0, Ordering::AcqRel);
        let action = match policy {
            OnLookupError::FailClosed { .. } => "answered 503 Service Unavailable",
            OnLookupError::MissingKey => {
                "left without a rate-limit key (the missing-key policy applied to them)"
            }
        };
        tracing::warn!(
            target: "tower_ratelimit",
            error = %failure,
            failed_requests = failed,
            "plan lookups failed for {failed} requests, {action}; at most one such line per {:?}",
            self.interval
        );
    }
}

/// Counts a lookup (or a key refused without one) under
/// [`PLAN_LOOKUPS`](crate::metrics::PLAN_LOOKUPS).
#[cfg(feature = "metrics")]
pub(super) fn count_lookup(result: &'static str) {
    ::metrics::counter!(crate::metrics::PLAN_LOOKUPS, "result" => result).increment(1);
}

#[cfg(not(feature = "metrics"))]
#[inline(always)]
pub(super) fn count_lookup(_: &'static str) {}
