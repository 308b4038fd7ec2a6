//! Dialog affinity: Call-ID → service, so an established call stays on its service when
//! the service set changes (a service added by reload, another returning from DOWN). PURE:
//! time is passed in as milliseconds on the caller's monotonic clock.
//!
//! Keys are the 64-bit hash of the Call-ID, not the Call-ID itself: no allocation per
//! message, and a collision (2^-64 per pair) only costs affinity, never correctness of
//! routing, because the hash method still picks an UP service.

use dashmap::DashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// One remembered dialog.
#[derive(Debug)]
struct Entry {
    /// Index of the service (in the vserver's member list).
    member: u32,
    last_seen_ms: AtomicU64,
}

/// Bounded, lock-striped Call-ID affinity table with idle expiry.
#[derive(Debug)]
pub struct DialogTable {
    map: DashMap<u64, Entry>,
    max_entries: usize,
    idle_ms: u64,
    /// Inserts refused because the table was full.
    refused: AtomicUsize,
}

impl DialogTable {
    pub fn new(max_entries: usize, idle_ms: u64) -> DialogTable {
        DialogTable {
            map: DashMap::new(),
            max_entries,
            idle_ms,
            refused: AtomicUsize::new(0),
        }
    }

    /// The member a live dialog is pinned to; refreshes its idle timer.
    pub fn get(&self, call_hash: u64, now_ms: u64) -> Option<u32> {
        let e = self.map.get(&call_hash)?;
        let last = e.last_seen_ms.load(Ordering::Relaxed);
        if now_ms.saturating_sub(last) > self.idle_ms {
            return None;
        }
        if now_ms > last {
            e.last_seen_ms.store(now_ms, Ordering::Relaxed);
        }
        Some(e.member)
    }

    /// Pin a dialog to `member`. When the table is full the dialog is simply not pinned
    /// (counted): the hash method keeps routing it consistently while the service set is stable.
    pub fn put(&self, call_hash: u64, member: u32, now_ms: u64) {
        if let Some(mut e) = self.map.get_mut(&call_hash) {
            e.member = member;
            e.last_seen_ms.store(now_ms, Ordering::Relaxed);
            return;
        }
        if self.map.len() >= self.max_entries {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.map.insert(
            call_hash,
            Entry {
                member,
                last_seen_ms: AtomicU64::new(now_ms),
            },
        );
    }

    /// Forget a dialog (e.g. its service was removed by reload).
    pub fn remove(&self, call_hash: u64) {
        self.map.remove(&call_hash);
    }

    /// Drop entries idle for longer than the timeout; returns how many were dropped.
    pub fn sweep(&self, now_ms: u64) -> usize {
        let before = self.map.len();
        self.map.retain(|_, e| {
            now_ms.saturating_sub(e.last_seen_ms.load(Ordering::Relaxed)) <= self.idle_ms
        });
        before.saturating_sub(self.map.len())
    }

    /// Drop every entry pinned to `member` (its service left the vserver).
    pub fn forget_member(&self, member: u32) {
        self.map.retain(|_, e| e.member != member);
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_refreshes_and_expires() {
        let t = DialogTable::new(10, 1000);
        t.put(1, 2, 0);
        assert_eq!(t.get(1, 900), Some(2));
        // Refreshed at 900, so still alive at 1800.
        assert_eq!(t.get(1, 1800), Some(2));
        assert_eq!(t.get(1, 2801), None);
        assert_eq!(t.sweep(2801), 1);
        assert!(t.is_empty());
    }

    #[test]
    fn bounded() {
        let t = DialogTable::new(2, 1000);
        t.put(1, 0, 0);
        t.put(2, 0, 0);
        t.put(3, 0, 0);
        assert_eq!(t.len(), 2);
        assert_eq!(t.refused(), 1);
        assert_eq!(t.get(3, 0), None);
        // Updating an existing entry is always allowed.
        t.put(1, 1, 5);
        assert_eq!(t.get(1, 5), Some(1));
    }

    #[test]
    fn forget_member() {
        let t = DialogTable::new(10, 1000);
        t.put(1, 0, 0);
        t.put(2, 1, 0);
        t.forget_member(0);
        assert_eq!(t.get(1, 0), None);
        assert_eq!(t.get(2, 0), Some(1));
    }
}
