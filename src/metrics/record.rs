//! Recording the crate's metrics through the `metrics` facade: keys built
//! once per limit and store, and the gauges and timers the engines hold
//! (all of it compiled away without the `metrics` feature).

#[cfg_attr(not(feature = "metrics"), allow(unused_imports))]
use super::*;

/// The metadata every metric of this crate is registered with.
#[cfg(feature = "metrics")]
static METADATA: ::metrics::Metadata<'static> =
    ::metrics::Metadata::new(module_path!(), ::metrics::Level::INFO, Some(module_path!()));

/// The metric keys of one limit name, built once per name (with the name,
/// which the process keeps: see `limit/intern.rs`): its [`DECISIONS`]
/// keys, one per [`Outcome`], its [`NEAR_LIMIT`] key and its quota gauges'.
/// A decision then looks up the recorder in effect (global or local, as the
/// `metrics` macros do) with a key whose labels and hash are already made,
/// instead of building and hashing a new key per decision.
#[cfg(feature = "metrics")]
#[derive(Debug)]
pub(crate) struct LimitKeys {
    decisions: [::metrics::Key; Outcome::ALL.len()],
    near_limit: ::metrics::Key,
    capacity: ::metrics::Key,
    window: ::metrics::Key,
    /// The capacity and the window (us) last set in the quota gauges;
    /// `u64::MAX` before the first decision.
    quota: [std::sync::atomic::AtomicU64; 2],
    /// Held while the gauges are set, so they end with what `quota` holds.
    setting: std::sync::Mutex<()>,
}

#[cfg(feature = "metrics")]
impl LimitKeys {
    pub(crate) fn new(name: &'static str) -> Self {
        use ::metrics::{Key, Label};
        let limit = || Label::from_static_parts("limit", name);
        Self {
            decisions: Outcome::ALL.map(|outcome| {
                let outcome = Label::from_static_parts("outcome", outcome.as_str());
                Key::from_parts(DECISIONS, vec![limit(), outcome])
            }),
            near_limit: Key::from_parts(NEAR_LIMIT, vec![limit()]),
            capacity: Key::from_parts(LIMIT_CAPACITY, vec![limit()]),
            window: Key::from_parts(LIMIT_WINDOW, vec![limit()]),
            quota: [u64::MAX, u64::MAX].map(std::sync::atomic::AtomicU64::new),
            setting: std::sync::Mutex::new(()),
        }
    }

    /// Counts one decision of the limit with `outcome`.
    pub(crate) fn increment(&self, outcome: Outcome) {
        let key = &self.decisions[outcome as usize];
        ::metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA).increment(1));
    }

    /// Reads the limit's `status` after a decision (`granted` or not): a
    /// grant that left under a fifth of the capacity counts under
    /// [`NEAR_LIMIT`]; the quota gauges are set when the quota that decided
    /// differs from the one they show. Otherwise two loads and compares.
    pub(crate) fn observe(&self, status: &crate::LimitStatus, granted: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        if granted && status.remaining.saturating_mul(5) < status.limit {
            let key = &self.near_limit;
            ::metrics::with_recorder(|r| r.register_counter(key, &METADATA).increment(1));
        }
        let [capacity, window] = &self.quota;
        if capacity.load(Relaxed) == status.limit && window.load(Relaxed) == status.window_us {
            return;
        }
        let _setting = crate::sync::lock(&self.setting);
        capacity.store(status.limit, Relaxed);
        window.store(status.window_us, Relaxed);
        ::metrics::with_recorder(|recorder| {
            let seconds = status.window_us as f64 / 1e6;
            recorder
                .register_gauge(&self.capacity, &METADATA)
                .set(status.limit as f64);
            recorder
                .register_gauge(&self.window, &METADATA)
                .set(seconds);
        });
    }
}

/// Whether a store's calls fail, as [`STORE_OUTAGE`] shows it: set when
/// that changes (a load and a compare otherwise).
#[derive(Debug, Default)]
pub(crate) struct OutageGauge {
    /// 0 before the first call, 1 answering, 2 failing.
    #[cfg(feature = "metrics")]
    state: std::sync::atomic::AtomicU8,
    /// Held while the gauge is set, so it ends with what `state` holds.
    #[cfg(feature = "metrics")]
    setting: std::sync::Mutex<()>,
}

impl OutageGauge {
    /// A call to the store of kind `store` answered, or `failed`.
    #[cfg(feature = "metrics")]
    #[inline]
    pub(crate) fn set(&self, store: impl FnOnce() -> &'static str, failed: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let state = 1 + u8::from(failed);
        if self.state.load(Relaxed) == state {
            return;
        }
        let _setting = crate::sync::lock(&self.setting);
        if self.state.swap(state, Relaxed) != state {
            store_outage(store(), failed);
        }
    }

    /// Without metrics: nothing.
    #[cfg(not(feature = "metrics"))]
    #[inline(always)]
    pub(crate) fn set(&self, _: impl FnOnce() -> &'static str, _: bool) {}
}

/// Sets [`STORE_OUTAGE`] of the store kind `store`: 1 when `failing`
/// (without metrics: nothing).
#[cfg_attr(not(feature = "metrics"), inline(always), allow(unused_variables))]
pub(crate) fn store_outage(store: &'static str, failing: bool) {
    #[cfg(feature = "metrics")]
    ::metrics::gauge!(STORE_OUTAGE, "store" => store).set(f64::from(u8::from(failing)));
}

/// Records under [`OVERSHOOT`] what `source` (`charge`, `hot_batch`) may
/// put `limit` over its capacity: `amount` (without metrics: nothing).
#[cfg_attr(not(feature = "metrics"), inline(always), allow(unused_variables))]
pub(crate) fn overshoot(limit: &'static str, source: &'static str, amount: i64) {
    #[cfg(feature = "metrics")]
    ::metrics::histogram!(OVERSHOOT, "limit" => limit, "source" => source).record(amount as f64);
}

/// Measures one store call.
pub(crate) struct StoreTimer {
    #[cfg(feature = "metrics")]
    started: std::time::Instant,
}

impl StoreTimer {
    pub(crate) fn start() -> Self {
        Self {
            #[cfg(feature = "metrics")]
            started: std::time::Instant::now(),
        }
    }

    /// Records the call's duration under the store's kind (`"redis"`,
    /// `"memory"`), asked only when metrics are recorded.
    #[cfg(feature = "metrics")]
    pub(crate) fn finish(self, kind: impl FnOnce() -> &'static str, operation: &'static str) {
        let store = kind();
        let seconds = self.started.elapsed().as_secs_f64();
        match duration_key(store, operation) {
            Some(key) => ::metrics::with_recorder(|recorder| {
                recorder.register_histogram(key, &METADATA).record(seconds);
            }),
            None => {
                ::metrics::histogram!(STORE_DURATION, "store" => store, "operation" => operation)
                    .record(seconds)
            }
        }
    }

    /// Without metrics: nothing (the store's kind is not asked).
    #[cfg(not(feature = "metrics"))]
    #[inline(always)]
    pub(crate) fn finish(self, _: impl FnOnce() -> &'static str, _: &'static str) {}
}

/// The [`STORE_DURATION`] key of a store kind and an operation: made once.
#[cfg(feature = "metrics")]
fn duration_key(store: &'static str, operation: &'static str) -> Option<&'static ::metrics::Key> {
    use ::metrics::{Key, Label};
    macro_rules! keys {
        ($($store:literal => [$($op:literal),*]),*) => {
            match (store, operation) {
                $($(($store, $op) => {
                    static LABELS: [Label; 2] = [
                        Label::from_static_parts("store", $store),
                        Label::from_static_parts("operation", $op),
                    ];
                    static KEY: Key = Key::from_static_parts(STORE_DURATION, &LABELS);
                    Some(&KEY)
                })*)*
                _ => None,
            }
        };
    }
    keys!(
        "memory" => ["decide", "reset", "refund", "take", "charge", "renew"],
        "redis" => ["decide", "reset", "refund", "take", "charge", "renew"]
    )
}

/// Counts one charge after the fact under [`CHARGES`] with `result`
/// (without metrics: nothing).
#[cfg_attr(not(feature = "metrics"), inline(always), allow(unused_variables))]
pub(crate) fn charged(result: &'static str) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(CHARGES, "result" => result).increment(1);
}

/// Counts one penalty state of `limit` a memory store did not keep, under
/// [`PENALTIES_NOT_STORED`] (without metrics: nothing).
#[cfg_attr(not(feature = "metrics"), inline(always), allow(unused_variables))]
pub(crate) fn penalty_not_stored(limit: &'static str) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(PENALTIES_NOT_STORED, "limit" => limit).increment(1);
}

/// One memory store's share of [`MEMORY_STORE_KEYS`]: the store adds the
/// change since its last report, and takes its share back when dropped, so
/// the gauge is the sum over every memory store of the process.
#[cfg(feature = "metrics")]
#[derive(Debug, Default)]
pub(crate) struct SizeGauge {
    reported: std::sync::atomic::AtomicI64,
    /// The store time (us) before which no report is due.
    next_at: std::sync::atomic::AtomicU64,
}

#[cfg(feature = "metrics")]
impl SizeGauge {
    const INTERVAL_MICROS: u64 = 1_000_000;

    /// Reports `len()` if the last report is a second old at `now` (the
    /// store's time, in microseconds), one caller winning: no clock read.
    pub(crate) fn report(&self, now: i64, len: impl FnOnce() -> usize) {
        use std::sync::atomic::Ordering;
        let now = u64::try_from(now).unwrap_or(0);
        let due = self.next_at.load(Ordering::Relaxed);
        if now < due
            || self
                .next_at
                .compare_exchange(
                    due,
                    now.saturating_add(Self::INTERVAL_MICROS),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        let len = i64::try_from(len()).unwrap_or(i64::MAX);
        let change = len - self.reported.swap(len, Ordering::AcqRel);
        ::metrics::gauge!(MEMORY_STORE_KEYS).increment(change as f64);
    }
}

#[cfg(feature = "metrics")]
impl Drop for SizeGauge {
    fn drop(&mut self) {
        let reported = *self.reported.get_mut();
        if reported != 0 {
            ::metrics::gauge!(MEMORY_STORE_KEYS).decrement(reported as f64);
        }
    }
}
