//! Locking helpers shared by the IO shell. PURE.

use std::sync::{Mutex, MutexGuard};

/// Locks `mutex`, recovering the guard when a thread panicked while holding it.
///
/// Recovering from poison is right for every mutex in this crate: each one guards data that
/// stays consistent whatever point a panic interrupted. Every critical section is either
/// panic-free (assignments, clones, swaps of an `Arc`, pure state-machine steps that report
/// problems as values) or idempotent (a reload or drain step that the next call repeats from
/// the state it finds). A poisoned lock therefore carries no torn state, and refusing it would
/// turn one panicked task into a process that can no longer reload, drain or report status.
pub(crate) fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
