//! Dialog affinity: Call-ID → service, so an established call stays on its service when
//! the service set changes (a service added by reload, another returning from DOWN). PURE:
//! time is passed in as milliseconds on the caller's monotonic clock.
//!
//! Keys are the 64-bit hash of the Call-ID, not the Call-ID itself: no allocation per
//! message, and a collision (2^-64 per pair) only costs affinity, never correctness of
//! routing, because the hash method still picks an UP service.

use dashmap::DashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// One remembered dialog.
#[derive(Debug)]
struct Entry {
    /// Index of the service (in the vserver's member list).
    member: u32,
    last_seen_ms: AtomicU64,
    /// The dialog ended (BYE / CANCEL seen); the entry lingers for retransmissions only,
    /// and `last_seen_ms` then holds the time it expires.
    ended: AtomicBool,
}

impl Entry {
    fn is_expired(&self, now_ms: u64, idle_ms: u64) -> bool {
        let t = self.last_seen_ms.load(Ordering::Relaxed);
        if self.ended.load(Ordering::Relaxed) {
            now_ms > t
        } else {
            now_ms.saturating_sub(t) > idle_ms
        }
    }
}

/// How long an ended dialog keeps its pin: 64×T1 = 32 s, the lifetime of a non-INVITE
/// transaction (RFC 3261 §17.1.2.2), so retransmitted BYEs and their ACKs still follow it.
pub const ENDED_LINGER_MS: u64 = 32_000;

/// What [`DialogTable::put`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// A new dialog was pinned.
    New,
    /// An existing dialog moved from this member (its member was not usable).
    Moved(u32),
    /// The dialog was already pinned to this member.
    Refreshed,
    /// The table is full; the dialog was not pinned.
    Refused,
}

/// What [`DialogTable::migrate_to`] did with the dialogs that have not ended, by new member.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Migration {
    pub open: Vec<u32>,
    /// Not migrated: the new table was full.
    pub refused_open: Vec<u32>,
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
        if e.is_expired(now_ms, self.idle_ms) {
            return None;
        }
        if !e.ended.load(Ordering::Relaxed) && now_ms > e.last_seen_ms.load(Ordering::Relaxed) {
            e.last_seen_ms.store(now_ms, Ordering::Relaxed);
        }
        Some(e.member)
    }

    /// Pin a dialog to `member`. When the table is full the dialog is simply not pinned
    /// (counted): the hash method keeps routing it consistently while the service set is stable.
    pub fn put(&self, call_hash: u64, member: u32, now_ms: u64) -> Pin {
        if let Some(mut e) = self.map.get_mut(&call_hash) {
            if e.ended.load(Ordering::Relaxed) {
                // A lingering ended dialog is not re-pinned; its member is no longer loaded.
                return Pin::Refreshed;
            }
            e.last_seen_ms.store(now_ms, Ordering::Relaxed);
            let old = std::mem::replace(&mut e.member, member);
            return if old == member {
                Pin::Refreshed
            } else {
                Pin::Moved(old)
            };
        }
        if self.map.len() >= self.max_entries {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Pin::Refused;
        }
        self.map.insert(
            call_hash,
            Entry {
                member,
                last_seen_ms: AtomicU64::new(now_ms),
                ended: AtomicBool::new(false),
            },
        );
        Pin::New
    }

    /// Mark a dialog ended (BYE / CANCEL): it keeps its pin for [`ENDED_LINGER_MS`], then
    /// expires. Returns its member the first time, so the caller stops counting its load.
    pub fn end(&self, call_hash: u64, now_ms: u64) -> Option<u32> {
        let e = self.map.get(&call_hash)?;
        if e.ended.swap(true, Ordering::Relaxed) {
            return None;
        }
        let expire_at = now_ms.saturating_add(ENDED_LINGER_MS.min(self.idle_ms));
        e.last_seen_ms.store(expire_at, Ordering::Relaxed);
        Some(e.member)
    }

    /// Forget a dialog (e.g. its service was removed by reload).
    pub fn remove(&self, call_hash: u64) {
        self.map.remove(&call_hash);
    }

    /// Drop entries idle for longer than the timeout, telling `expired` the member of each;
    /// returns how many were dropped.
    pub fn sweep(&self, now_ms: u64, mut expired: impl FnMut(u32)) -> usize {
        let mut dropped = 0;
        self.map.retain(|_, e| {
            let keep = !e.is_expired(now_ms, self.idle_ms);
            if !keep && !e.ended.load(Ordering::Relaxed) {
                expired(e.member);
            }
            if !keep {
                dropped += 1;
            }
            keep
        });
        dropped
    }

    /// Drop every entry pinned to `member` (its service left the vserver).
    pub fn forget_member(&self, member: u32) {
        self.map.retain(|_, e| e.member != member);
    }

    /// Copy every live entry into `into` (a table built for a reloaded member list),
    /// renumbering members with `map`; entries whose member has no new index (its service
    /// left the vserver) are dropped. Returns, by new member, the dialogs that have not ended:
    /// those migrated (to count as load there) and those `into` had no room for (a caller
    /// whose counters carry over closes them).
    pub fn migrate_to(
        &self,
        into: &DialogTable,
        now_ms: u64,
        map: impl Fn(u32) -> Option<u32>,
    ) -> Migration {
        let mut open = Vec::new();
        let mut refused_open = Vec::new();
        for e in self.map.iter() {
            if e.is_expired(now_ms, self.idle_ms) {
                continue;
            }
            let Some(member) = map(e.member) else {
                continue;
            };
            let ended = e.ended.load(Ordering::Relaxed);
            if into.map.len() >= into.max_entries {
                into.refused.fetch_add(1, Ordering::Relaxed);
                if !ended {
                    refused_open.push(member);
                }
                continue;
            }
            into.map.insert(
                *e.key(),
                Entry {
                    member,
                    last_seen_ms: AtomicU64::new(e.last_seen_ms.load(Ordering::Relaxed)),
                    ended: AtomicBool::new(ended),
                },
            );
            if !ended {
                open.push(member);
            }
        }
        Migration { open, refused_open }
    }

    /// How long a dialog may stay idle before it expires.
    pub fn idle(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.idle_ms)
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
    fn migration_renumbers_and_drops_removed_members() {
        let old = DialogTable::new(10, 1000);
        old.put(1, 0, 0);
        old.put(2, 1, 0);
        old.put(3, 2, 0);
        old.end(3, 0);
        let new = DialogTable::new(10, 1000);
        // Member 0 removed; 1 -> 0, 2 -> 1.
        let moved = old.migrate_to(&new, 10, |m| m.checked_sub(1));
        assert_eq!(moved.open, vec![0]);
        assert!(moved.refused_open.is_empty());
        assert_eq!(new.get(1, 10), None);
        assert_eq!(new.get(2, 10), Some(0));
        assert_eq!(new.get(3, 10), Some(1), "ended dialogs keep lingering");
    }

    #[test]
    fn migration_reports_open_dialogs_the_new_table_had_no_room_for() {
        let old = DialogTable::new(10, 1000);
        for (call, member) in [(1, 0), (2, 1), (3, 1)] {
            old.put(call, member, 0);
        }
        let new = DialogTable::new(1, 1000);
        let moved = old.migrate_to(&new, 10, Some);
        assert_eq!(moved.open.len(), 1);
        let mut all: Vec<u32> = moved
            .open
            .iter()
            .chain(&moved.refused_open)
            .copied()
            .collect();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 1]);
    }

    #[test]
    fn pins_refreshes_and_expires() {
        let t = DialogTable::new(10, 1000);
        t.put(1, 2, 0);
        assert_eq!(t.get(1, 900), Some(2));
        // Refreshed at 900, so still alive at 1800.
        assert_eq!(t.get(1, 1800), Some(2));
        assert_eq!(t.get(1, 2801), None);
        let mut gone = Vec::new();
        assert_eq!(t.sweep(2801, |m| gone.push(m)), 1);
        assert_eq!(gone, vec![2]);
        assert!(t.is_empty());
    }

    #[test]
    fn bounded() {
        let t = DialogTable::new(2, 1000);
        assert_eq!(t.put(1, 0, 0), Pin::New);
        assert_eq!(t.put(2, 0, 0), Pin::New);
        assert_eq!(t.put(3, 0, 0), Pin::Refused);
        assert_eq!(t.len(), 2);
        assert_eq!(t.refused(), 1);
        assert_eq!(t.get(3, 0), None);
        // Updating an existing entry is always allowed.
        assert_eq!(t.put(1, 1, 5), Pin::Moved(0));
        assert_eq!(t.put(1, 1, 6), Pin::Refreshed);
        assert_eq!(t.get(1, 6), Some(1));
    }

    #[test]
    fn ended_dialogs_linger_then_expire_without_double_close() {
        let t = DialogTable::new(10, 3_600_000);
        t.put(7, 1, 1000);
        assert_eq!(t.end(7, 2000), Some(1));
        assert_eq!(t.end(7, 2001), None);
        assert_eq!(t.get(7, 2000 + ENDED_LINGER_MS), Some(1));
        assert_eq!(t.get(7, 2001 + ENDED_LINGER_MS), None);
        let mut closed = 0;
        assert_eq!(t.sweep(2001 + ENDED_LINGER_MS, |_| closed += 1), 1);
        assert_eq!(closed, 0);
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
