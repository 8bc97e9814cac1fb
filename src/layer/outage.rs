//! Store failures in the logs: one line when an outage begins, a count per
//! interval while it lasts, one line when it ends. Logging every failed
//! request would flood the logs exactly when they are needed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, TryLockError};
use std::time::{Duration, Instant};

use crate::Error;

/// Default interval between two summary lines of one outage.
pub(crate) const DEFAULT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The outage state of one layer's store.
#[derive(Debug)]
pub(crate) struct OutageLog {
    /// Set by the first failure, cleared by the next success: while healthy,
    /// a success costs one relaxed load of this flag.
    failing: AtomicBool,
    /// Failed requests since the outage began.
    total: AtomicU64,
    /// Failed requests not yet counted in a log line.
    unreported: AtomicU64,
    /// When the last line about this outage was logged.
    last_line: Mutex<Instant>,
    interval: Duration,
    /// The store's kind, for [`STORE_OUTAGE`](crate::metrics::STORE_OUTAGE).
    store: &'static str,
}

impl OutageLog {
    pub(crate) fn new(interval: Duration, store: &'static str) -> Self {
        Self {
            failing: AtomicBool::new(false),
            total: AtomicU64::new(0),
            unreported: AtomicU64::new(0),
            last_line: Mutex::new(Instant::now()),
            interval,
            store,
        }
    }

    /// A store call succeeded: logs the recovery if the store was failing.
    pub(crate) fn success(&self) {
        if self.failing.load(Ordering::Relaxed) && self.failing.swap(false, Ordering::AcqRel) {
            let failed = self.total.swap(0, Ordering::AcqRel);
            self.unreported.store(0, Ordering::Relaxed);
            crate::metrics::store_outage(self.store, false);
            tracing::info!(
                target: "tower_ratelimit",
                failed_requests = failed,
                "rate-limit store recovered after {failed} failed requests"
            );
        }
    }

    /// A store call failed; `action` says what the policy does about it.
    pub(crate) fn failure(&self, error: &Error, action: &str) {
        self.failure_at(error, action, Instant::now());
    }

    fn failure_at(&self, error: &Error, action: &str, now: Instant) {
        self.total.fetch_add(1, Ordering::AcqRel);
        if !self.failing.swap(true, Ordering::AcqRel) {
            crate::metrics::store_outage(self.store, true);
            *crate::sync::lock(&self.last_line) = now;
            tracing::warn!(
                target: "tower_ratelimit",
                %error,
                "rate-limit store failed; {action}; further failures are counted every {:?} until it recovers",
                self.interval
            );
            return;
        }
        self.unreported.fetch_add(1, Ordering::AcqRel);
        // Whoever holds the lock is already deciding whether to log.
        let mut last = match self.last_line.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        let since = now.saturating_duration_since(*last);
        if since >= self.interval {
            *last = now;
            let failed = self.unreported.swap(0, Ordering::AcqRel);
            tracing::warn!(
                target: "tower_ratelimit",
                %error,
                failed_requests = failed,
                "rate-limit store still failing: {failed} more failed requests in the last {since:.1?}; {action}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    /// Records the level and the rendered fields of every event.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<(tracing::Level, String)>>>);

    struct Render<'a>(&'a mut String);

    impl tracing::field::Visit for Render<'_> {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            self.0.push_str(&format!(" {}={value:?}", field.name()));
        }
    }

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Lines {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            let mut text = String::new();
            event.record(&mut Render(&mut text));
            let mut lines = crate::sync::lock(&self.0);
            lines.push((*event.metadata().level(), text));
        }
    }

    type Line = (tracing::Level, String);

    impl Lines {
        fn count(&self) -> usize {
            crate::sync::lock(&self.0).len()
        }
    }

    /// Runs `steps` on an outage log (10 s interval) with a timeout error,
    /// every event recorded (`steps` can count them as it goes); returns
    /// the events and their levels.
    fn logged(steps: impl FnOnce(&OutageLog, &Error, &Lines)) -> (Vec<Line>, Vec<tracing::Level>) {
        let lines = Lines::default();
        let _guard =
            tracing::subscriber::set_default(tracing_subscriber::registry().with(lines.clone()));
        let log = OutageLog::new(Duration::from_secs(10), "redis");
        let error = Error::Timeout(Duration::from_millis(100));
        steps(&log, &error, &lines);
        let lines = lines.0.lock().unwrap().clone();
        let levels = lines.iter().map(|(level, _)| *level).collect();
        (lines, levels)
    }

    #[test]
    fn an_outage_is_one_line_then_a_count_per_interval_then_the_recovery() {
        let (lines, levels) = logged(|log, error, lines| {
            let t0 = Instant::now();
            log.success();
            for i in 0..40 {
                // 40 failures within the first 9.75 s: only the first is logged
                log.failure_at(
                    error,
                    "refusing requests",
                    t0 + Duration::from_millis(250) * i,
                );
            }
            assert_eq!(lines.count(), 1);
            log.failure_at(error, "refusing requests", t0 + Duration::from_secs(10));
            log.failure_at(error, "refusing requests", t0 + Duration::from_secs(11));
            log.success();
            log.success();
        });
        assert_eq!(
            levels,
            [
                tracing::Level::WARN,
                tracing::Level::WARN,
                tracing::Level::INFO
            ],
            "{lines:?}"
        );
        assert!(lines[0].1.contains("refusing requests"), "{lines:?}");
        assert!(
            lines[0].1.contains("did not answer"),
            "the error: {lines:?}"
        );
        // the 39 after the first, and the one at 10 s
        assert!(lines[1].1.contains("failed_requests=40"), "{lines:?}");
        assert!(lines[2].1.contains("failed_requests=42"), "{lines:?}");
    }

    #[test]
    fn a_new_outage_starts_a_new_count() {
        let (lines, levels) = logged(|log, error, _| {
            for _ in 0..3 {
                log.failure(error, "letting requests through");
            }
            log.success();
            log.failure(error, "letting requests through");
            log.success();
        });
        assert_eq!(
            levels,
            [
                tracing::Level::WARN,
                tracing::Level::INFO,
                tracing::Level::WARN,
                tracing::Level::INFO
            ],
            "{lines:?}"
        );
        assert!(lines[1].1.contains("failed_requests=3"), "{lines:?}");
        assert!(lines[3].1.contains("failed_requests=1"), "{lines:?}");
    }
}
