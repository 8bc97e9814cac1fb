//! Reclaiming expired states in the background: a task per store, in short
//! slices that release the shard's lock and yield between them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Weak;
use std::time::Duration;

use super::{Inner, SHARDS};

/// The background reclaimer of a store.
pub(super) struct Reclaimer {
    /// The store, held weakly: the task ends once the store is dropped.
    store: Weak<Inner>,
    /// The pause between sweeps.
    interval: Duration,
    /// Whether a task runs (or cannot run: no timers).
    running: AtomicBool,
}

impl Reclaimer {
    pub(super) fn new(store: Weak<Inner>, interval: Duration) -> Self {
        Self {
            store,
            interval,
            running: AtomicBool::new(false),
        }
    }

    /// Starts the background task if none runs and a Tokio runtime is at
    /// hand.
    pub(super) fn ensure(&self) {
        if self.running.load(Ordering::Acquire) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self
            .running
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            runtime.spawn(reclaim(self.store.clone()));
        }
    }
}

/// Marks the reclaimer stopped when its task ends or is dropped with its
/// runtime, so a later decision in a live runtime starts another. A task that
/// panicked (a runtime without timers) is not restarted.
struct Running(Weak<Inner>);

impl Drop for Running {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            if let Some(inner) = self.0.upgrade() {
                inner.reclaimer.running.store(false, Ordering::Release);
            }
        }
    }
}

/// The background task: every interval, sweeps every shard, a step at a
/// time (see [`step`]), releasing the shard's lock and yielding between
/// steps.
async fn reclaim(weak: Weak<Inner>) {
    let _running = Running(weak.clone());
    loop {
        let Some(interval) = weak.upgrade().map(|inner| inner.reclaimer.interval) else {
            return;
        };
        tokio::time::sleep(interval).await;
        for s in 0..SHARDS {
            let (mut t, mut budget) = (0, None);
            loop {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                let more = step(&inner, s, &mut t, &mut budget);
                drop(inner);
                tokio::task::yield_now().await;
                if !more {
                    break;
                }
            }
        }
    }
}

/// One background step in shard `s`: first (table `*t` 0, no `*budget`
/// yet) the shard's penalty states and overrides that ended, then a
/// slice of the rate states of table `*t` (see `States::sweep`). Returns
/// whether the shard has more.
fn step(inner: &Inner, s: usize, t: &mut usize, budget: &mut Option<usize>) -> bool {
    if *t == 0 && budget.is_none() {
        inner.pens.sweep(&inner.states, s);
        inner.kept.sweep(s);
    }
    inner.states.sweep(s, t, budget)
}
