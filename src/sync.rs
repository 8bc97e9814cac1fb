//! The crate's one way to take a lock.

/// Locks `mutex`, even if a thread panicked holding it: what the crate's
/// locks guard (a store shard's slot, a map's entry, a gauge, an interned
/// name) is written whole, so a panic cannot leave it half-updated in a way
/// that matters.
pub(crate) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
