//! Locks that a panic elsewhere does not poison for good: the data behind
//! them (counters, health flags) stays valid whatever a panicking holder
//! left half done.

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Reads `lock`, poisoned or not.
pub(crate) fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|e| e.into_inner())
}

/// Writes `lock`, poisoned or not.
pub(crate) fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|e| e.into_inner())
}
