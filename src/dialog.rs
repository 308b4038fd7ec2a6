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
pub(crate) const ENDED_LINGER_MS: u64 = 32_000;

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
    /// The dialogs (ended or not) the new table had no room for, sorted: the catch-up pass
    /// leaves them out, as they were refused and reported once already.
    pub refused_keys: Vec<u64>,
    /// The dialogs copied, sorted: the catch-up pass tells them from dialogs pinned later.
    pub copied_keys: Vec<u64>,
}

/// What [`DialogTable::catch_up_to`] changed in the new table, by new member.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CatchUp {
    /// Dialogs pinned in the old table after the migration, now pinned here too.
    pub opened: Vec<u32>,
    /// Dialogs migrated open that ended in the old table afterwards, now ended here too (by
    /// the member this table had them on).
    pub ended: Vec<u32>,
    /// Dialogs the old table moved to another member afterwards: (from, to).
    pub moved: Vec<(u32, u32)>,
    /// Dialogs pinned in the old table after the migration that this table had no room for.
    pub refused_open: Vec<u32>,
    /// Dialogs pinned in the old table after the migration and, before the catch-up, pinned
    /// here too by the new table's own traffic (which this table keeps), by the old table's
    /// member: each was pinned, and counted, twice.
    pub doubled: Vec<u32>,
}

impl CatchUp {
    /// Open dialogs the two passes carried over, `first` being the migration.
    pub fn kept(&self, first: &Migration) -> usize {
        (first.open.len() + self.opened.len()).saturating_sub(self.ended.len())
    }
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

    /// Pin a request that opens no dialog (OPTIONS, MESSAGE, PUBLISH) for the life of its
    /// transaction only: an entry already ended, lingering [`ENDED_LINGER_MS`] (Timer F), so
    /// that its retransmissions reach the same member, and never counted as load. Nothing
    /// happens when the Call-ID is already in the table or the table is full.
    pub fn linger(&self, call_hash: u64, member: u32, now_ms: u64) {
        if self.map.len() >= self.max_entries {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let expire_at = now_ms.saturating_add(ENDED_LINGER_MS.min(self.idle_ms));
        self.map.entry(call_hash).or_insert_with(|| Entry {
            member,
            last_seen_ms: AtomicU64::new(expire_at),
            ended: AtomicBool::new(true),
        });
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
        let mut refused_keys = Vec::new();
        let mut copied_keys = Vec::new();
        // `into` is not in use yet: its size is counted here, not asked per entry (`len`
        // locks every shard).
        let mut held = into.map.len();
        for e in self.map.iter() {
            if e.is_expired(now_ms, self.idle_ms) {
                continue;
            }
            let Some(member) = map(e.member) else {
                continue;
            };
            let ended = e.ended.load(Ordering::Relaxed);
            let seen = e.last_seen_ms.load(Ordering::Relaxed);
            let full = held >= into.max_entries;
            // A fresh table holds none of the old keys: every entry is vacant.
            if let dashmap::Entry::Vacant(at) = into.map.entry(*e.key()) {
                if into.adopt(at, full, member, seen, ended) {
                    held += 1;
                    copied_keys.push(*e.key());
                    if !ended {
                        open.push(member);
                    }
                } else {
                    refused_keys.push(*e.key());
                    if !ended {
                        refused_open.push(member);
                    }
                }
            }
        }
        refused_keys.sort_unstable();
        copied_keys.sort_unstable();
        Migration {
            open,
            refused_open,
            refused_keys,
            copied_keys,
        }
    }

    /// The second pass of a migration, run once the new table is the one in use: what the old
    /// table's users did between [`DialogTable::migrate_to`] and the switch (pins, ends, moves)
    /// is carried into `into`. An entry `into` already holds is changed only where the old
    /// one is newer: an end always carries (a dialog that ended stays ended), a move only when
    /// the old entry was seen after the new one (traffic on the new table wins). `first` is
    /// what the migration did: the dialogs it refused are not looked at again, and a dialog it
    /// did not copy but `into` holds was pinned there by the new table's traffic. Run once,
    /// after the switch.
    pub fn catch_up_to(
        &self,
        into: &DialogTable,
        first: &Migration,
        now_ms: u64,
        map: impl Fn(u32) -> Option<u32>,
    ) -> CatchUp {
        let mut done = CatchUp::default();
        for e in self.map.iter() {
            if e.is_expired(now_ms, self.idle_ms)
                || first.refused_keys.binary_search(e.key()).is_ok()
            {
                continue;
            }
            let Some(member) = map(e.member) else {
                continue;
            };
            let ended = e.ended.load(Ordering::Relaxed);
            let seen = e.last_seen_ms.load(Ordering::Relaxed);
            let copied = first.copied_keys.binary_search(e.key()).is_ok();
            // `into` is live (workers insert meanwhile), so its size is asked, but only for a
            // key it does not hold (`len` locks every shard; an entry it holds is not added).
            let full = !into.map.contains_key(e.key()) && into.map.len() >= into.max_entries;
            match into.map.entry(*e.key()) {
                dashmap::Entry::Occupied(mut n) if copied => {
                    let n = n.get_mut();
                    if n.ended.load(Ordering::Relaxed) {
                        continue;
                    }
                    if ended {
                        n.ended.store(true, Ordering::Relaxed);
                        n.last_seen_ms.store(seen, Ordering::Relaxed);
                        done.ended.push(n.member);
                    } else if seen > n.last_seen_ms.load(Ordering::Relaxed) {
                        n.last_seen_ms.store(seen, Ordering::Relaxed);
                        let from = std::mem::replace(&mut n.member, member);
                        if from != member {
                            done.moved.push((from, member));
                        }
                    }
                }
                dashmap::Entry::Occupied(_) => {
                    // Pinned on both sides after the migration: this table's pin stands.
                    if !ended {
                        done.doubled.push(member);
                    }
                }
                dashmap::Entry::Vacant(at) => {
                    if into.adopt(at, full, member, seen, ended) {
                        if !ended {
                            done.opened.push(member);
                        }
                    } else if !ended {
                        done.refused_open.push(member);
                    }
                }
            }
        }
        done
    }

    /// Put an old table's entry at a vacant key of this table, or, when the table is `full`
    /// (read before the key was locked: `len` locks every shard), count it refused. True
    /// when it was put.
    fn adopt(
        &self,
        at: dashmap::mapref::entry::VacantEntry<'_, u64, Entry>,
        full: bool,
        member: u32,
        seen: u64,
        ended: bool,
    ) -> bool {
        if full {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        at.insert(Entry {
            member,
            last_seen_ms: AtomicU64::new(seen),
            ended: AtomicBool::new(ended),
        });
        true
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

    /// What happens in the old table between the migration and the switch is carried over
    /// by the catch-up pass; what happened in the new table since is not undone.
    #[test]
    fn catch_up_carries_pins_ends_and_moves_made_after_the_migration() {
        let old = DialogTable::new(10, 1000);
        old.put(1, 0, 0); // stays as it is
        old.put(2, 0, 0); // ends in the old table after the migration
        old.put(3, 0, 0); // moves in the old table after the migration
        old.put(4, 0, 0); // moves in the new table after the switch
        let new = DialogTable::new(10, 1000);
        let first = old.migrate_to(&new, 10, Some);
        assert_eq!(first.open, vec![0; 4]);
        // Between the migration and the switch, on the old table:
        old.put(5, 1, 20);
        old.end(2, 21);
        old.put(3, 1, 22);
        old.put(6, 0, 23);
        old.end(6, 24);
        // After the switch, on the new table:
        new.put(4, 1, 30);
        let done = old.catch_up_to(&new, &first, 40, Some);
        assert_eq!(done.opened, vec![1]);
        assert_eq!(done.ended, vec![0]);
        assert_eq!(done.moved, vec![(0, 1)]);
        assert!(done.refused_open.is_empty());
        assert_eq!(new.get(5, 40), Some(1));
        assert_eq!(new.get(3, 40), Some(1));
        assert_eq!(new.get(4, 40), Some(1), "the new table's own move is kept");
        assert_eq!(new.get(1, 40), Some(0));
        assert_eq!(new.end(2, 40), None, "already ended");
        assert_eq!(
            new.end(6, 40),
            None,
            "pinned and ended meanwhile: lingers, ended"
        );
        assert_eq!(new.get(6, 40), Some(0));
        assert!(done.doubled.is_empty());
    }

    /// A dialog pinned in the old table after the migration whose next request reached the
    /// new table first (and was pinned there) is reported as pinned twice; the new pin stays.
    #[test]
    fn catch_up_reports_dialogs_pinned_on_both_sides() {
        let old = DialogTable::new(10, 1000);
        let new = DialogTable::new(10, 1000);
        let first = old.migrate_to(&new, 0, Some);
        old.put(7, 1, 5);
        new.put(7, 2, 6);
        let done = old.catch_up_to(&new, &first, 7, Some);
        assert_eq!(done.doubled, vec![1]);
        assert!(done.opened.is_empty() && done.moved.is_empty() && done.ended.is_empty());
        assert_eq!(new.get(7, 7), Some(2));
    }

    #[test]
    fn catch_up_reports_pins_the_new_table_has_no_room_for() {
        let old = DialogTable::new(10, 1000);
        old.put(1, 0, 0);
        old.put(2, 1, 0);
        let new = DialogTable::new(1, 1000);
        let first = old.migrate_to(&new, 0, Some);
        assert_eq!(first.refused_keys.len(), 1, "one of the two had no room");
        old.put(3, 2, 5);
        let done = old.catch_up_to(&new, &first, 6, Some);
        assert_eq!(
            done.refused_open,
            vec![2],
            "only the later pin; the first is not reported twice"
        );
        assert!(done.opened.is_empty());
        assert_eq!(new.refused(), 2);
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
}
