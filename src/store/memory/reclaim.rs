//! Reclaiming expired states in the background: a task per store, in short
//! slices that release the shard's lock and yield between them.

use std::sync::atomic::Ordering;
use std::sync::Weak;

use super::{lock, Inner, SHARDS};

/// Slots examined by the background reclaimer per lock hold.
const SWEEP_SLICE: usize = 1024;

impl Inner {
    /// One background step in shard `s`: sweeps a slice of table `*t`, with
    /// `*budget` slots left to examine in it (first, the shard's overrides
    /// that ended). Returns whether the shard has more.
    fn sweep_step(&self, s: usize, t: &mut usize, budget: &mut Option<usize>) -> bool {
        let Some(shard) = self.shards.get(s) else {
            return false;
        };
        let now = self.clock.now_micros();
        if *t == 0 && budget.is_none() {
            // (before the shard's lock: a decision takes this one first)
            if let Some(pens) = self.pens.get(s) {
                self.forget_pens(super::penalized::sweep_pens(pens, now));
            }
        }
        let mut shard = lock(shard);
        if *t == 0 && budget.is_none() {
            // once per sweep of the shard: the overrides that ended
            let ended = super::kept::sweep_overrides(&mut shard.overrides, now);
            if ended > 0 {
                self.kept.overrides.fetch_sub(ended, Ordering::AcqRel);
            }
        }
        let Some(table) = shard.tables.get_mut(*t) else {
            return false;
        };
        let left = *budget.get_or_insert(table.len);
        let (examined, removed) = table.sweep(left.min(SWEEP_SLICE), now, &self.hasher);
        self.forget(removed);
        let left = left.saturating_sub(examined.max(1));
        if left == 0 || table.len == 0 {
            table.shrink(&self.hasher);
            *t += 1;
            *budget = None;
            return *t < shard.tables.len();
        }
        *budget = Some(left);
        true
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
                inner.reclaimer.store(false, Ordering::Release);
            }
        }
    }
}

/// The background reclaimer: every interval, sweeps every table in slices of
/// [`SWEEP_SLICE`] slots, releasing the shard's lock and yielding between
/// slices. Holds the store only weakly: it ends once the store is dropped.
pub(super) async fn reclaim(weak: Weak<Inner>) {
    let _running = Running(weak.clone());
    loop {
        let Some(interval) = weak.upgrade().map(|inner| inner.sweep_interval) else {
            return;
        };
        tokio::time::sleep(interval).await;
        for s in 0..SHARDS {
            let (mut t, mut budget) = (0, None);
            loop {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                let more = inner.sweep_step(s, &mut t, &mut budget);
                drop(inner);
                tokio::task::yield_now().await;
                if !more {
                    break;
                }
            }
        }
    }
}
