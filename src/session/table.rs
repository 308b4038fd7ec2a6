//! The UDP session table of one worker: client flow → session, bounded, with idle expiry.
//! PURE: time comes in as `now` ([`Nanos`]); the shell's per-session resource (its upstream
//! socket) is an opaque `R` the table only stores and hands back on expiry.
//!
//! Sessions live in a slab (`Vec<Option<Session>>` plus a free list) so that a session's
//! index is a stable, small id the shell can use as its poll token, and the key map holds
//! only that index. The bound (`max_sessions`) is shared by every worker of a vserver
//! through one atomic count, so the vserver as a whole never holds more than the limit.

use crate::stats::Nanos;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// What identifies a session: the client's address, the local address it sent to (replies
/// must leave from that address), and, for methods that choose per datagram (`token` on the
/// payload), the member the datagram's key chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionKey {
    pub client: SocketAddr,
    pub local: SocketAddr,
    pub member: Option<u32>,
}

/// Index of a session in its table (stable while the session lives).
pub(crate) type SessionId = usize;

/// One session.
#[derive(Debug)]
pub struct Session<R> {
    pub key: SessionKey,
    /// Member (index in the vserver's member list) the session sends to.
    pub member: u32,
    /// Which listener socket of the worker the client reached (replies leave from it).
    pub listener: u16,
    pub last_seen: Nanos,
    pub packets_in: u64,
    pub bytes_in: u64,
    pub packets_out: u64,
    pub bytes_out: u64,
    /// When the client's datagrams now awaiting a reply were relayed (0: none awaits).
    pub asked_at: Nanos,
    pub resource: R,
}

/// Result of [`SessionTable::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// A slot is reserved; the caller must `insert` or `release`.
    Reserved,
    /// The vserver's session limit is reached: the datagram is refused (and counted).
    Full,
    /// The process's file pool has no file left for the session's socket (docs/limits.md).
    NoFiles,
}

/// The session table of one worker.
#[derive(Debug)]
pub struct SessionTable<R> {
    by_key: HashMap<SessionKey, SessionId>,
    slots: Vec<Option<Session<R>>>,
    free: Vec<SessionId>,
    idle_ns: Nanos,
    max_sessions: usize,
    /// Live sessions of the whole vserver (every worker's table).
    live: Arc<AtomicUsize>,
    /// The process's open files, one per session ([`SessionTable::with_budget`]).
    budget: Option<Arc<crate::budget::FileBudget>>,
}

impl<R> SessionTable<R> {
    /// A table whose sessions expire after `idle_ns` without traffic in either direction.
    /// `live` is shared by the tables of one vserver and bounded by `max_sessions`.
    pub fn new(idle_ns: Nanos, max_sessions: usize, live: Arc<AtomicUsize>) -> Self {
        SessionTable {
            by_key: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            idle_ns,
            max_sessions,
            live,
            budget: None,
        }
    }

    /// Sessions in this table.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// The live session of `key`, if any (an expired one not yet swept counts as gone).
    pub fn find(&self, key: &SessionKey, now: Nanos) -> Option<SessionId> {
        let id = *self.by_key.get(key)?;
        let s = self.slots.get(id)?.as_ref()?;
        (now.saturating_sub(s.last_seen) <= self.idle_ns).then_some(id)
    }

    pub fn get(&self, id: SessionId) -> Option<&Session<R>> {
        self.slots.get(id)?.as_ref()
    }

    pub fn get_mut(&mut self, id: SessionId) -> Option<&mut Session<R>> {
        self.slots.get_mut(id)?.as_mut()
    }

    /// Remove `key`'s session when it has expired at `now` but was not swept yet, so that a
    /// returning client does not find the vserver full of its own dead session. Returned for
    /// the caller to close.
    pub fn take_expired(&mut self, key: &SessionKey, now: Nanos) -> Option<Session<R>> {
        let id = *self.by_key.get(key)?;
        if self.find(key, now).is_some() {
            return None;
        }
        self.remove(id)
    }

    /// Reserve room for one more session of the vserver.
    pub fn admit(&self) -> Admit {
        let reserved = self
            .live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_sessions).then_some(n + 1)
            });
        match reserved {
            Ok(_) if self.budget.as_ref().is_some_and(|b| !b.take(1)) => {
                self.release_live();
                Admit::NoFiles
            }
            Ok(_) => Admit::Reserved,
            Err(_) => Admit::Full,
        }
    }

    /// Sessions draw their sockets' files from `budget`.
    pub fn with_budget(mut self, budget: Arc<crate::budget::FileBudget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Give back a reservation that did not become a session (its socket failed).
    pub fn release(&self) {
        self.release_live();
        if let Some(b) = &self.budget {
            b.give_back(1);
        }
    }

    fn release_live(&self) {
        let _ = self
            .live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(1))
            });
    }

    /// Store a session for a reservation obtained from [`SessionTable::admit`]. The shell
    /// takes an expired session of the key out first ([`SessionTable::take_expired`], so
    /// that its place counts for the new one); any session still under the key is
    /// returned for the caller to close.
    pub fn insert(
        &mut self,
        key: SessionKey,
        member: u32,
        listener: u16,
        resource: R,
        now: Nanos,
    ) -> (SessionId, Option<Session<R>>) {
        let stale = self
            .by_key
            .get(&key)
            .copied()
            .and_then(|id| self.remove(id));
        let session = Session {
            key,
            member,
            listener,
            last_seen: now,
            packets_in: 0,
            bytes_in: 0,
            packets_out: 0,
            bytes_out: 0,
            asked_at: 0,
            resource,
        };
        let id = match self.free.pop() {
            Some(id) => {
                if let Some(slot) = self.slots.get_mut(id) {
                    *slot = Some(session);
                }
                id
            }
            None => {
                self.slots.push(Some(session));
                self.slots.len() - 1
            }
        };
        self.by_key.insert(key, id);
        (id, stale)
    }

    /// `packets` datagrams (`bytes` in all) from the client (`inbound`) or from the service
    /// were relayed. Returns the service's response time when these are its first replies
    /// since the client's datagrams it answers (request to first reply, for
    /// least_response_time).
    pub fn touch(
        &mut self,
        id: SessionId,
        packets: u64,
        bytes: u64,
        inbound: bool,
        now: Nanos,
    ) -> Option<Nanos> {
        let s = self.get_mut(id)?;
        s.last_seen = s.last_seen.max(now);
        if inbound {
            s.packets_in = s.packets_in.saturating_add(packets);
            s.bytes_in = s.bytes_in.saturating_add(bytes);
            if s.asked_at == 0 {
                s.asked_at = now.max(1);
            }
            None
        } else {
            s.packets_out = s.packets_out.saturating_add(packets);
            s.bytes_out = s.bytes_out.saturating_add(bytes);
            let asked = std::mem::take(&mut s.asked_at);
            (asked != 0).then(|| now.saturating_sub(asked))
        }
    }

    /// Remove a session (expiry, error, or its member went DOWN) and free its slot.
    pub fn remove(&mut self, id: SessionId) -> Option<Session<R>> {
        let s = self.slots.get_mut(id)?.take()?;
        self.by_key.remove(&s.key);
        self.free.push(id);
        self.release();
        Some(s)
    }

    /// Remove every session idle for longer than the idle timeout; `closed` receives each
    /// (the shell closes its socket and stops counting it on its member).
    pub fn expire(&mut self, now: Nanos, mut closed: impl FnMut(SessionId, Session<R>)) -> usize {
        let idle = self.idle_ns;
        let expired: Vec<SessionId> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref()
                    .filter(|s| now.saturating_sub(s.last_seen) > idle)
                    .map(|_| i)
            })
            .collect();
        let n = expired.len();
        for id in expired {
            if let Some(s) = self.remove(id) {
                closed(id, s);
            }
        }
        n
    }

    /// Adopt a reload: a new idle timeout and bound, and each session's member renumbered
    /// by `map` (also in its key, for per-member sessions). A session `map` gives `None`
    /// (its member is gone) is removed and handed to `closed`. Session ids, which the
    /// shell uses as poll tokens, do not change.
    pub fn remap(
        &mut self,
        idle_ns: Nanos,
        max_sessions: usize,
        mut map: impl FnMut(&Session<R>) -> Option<u32>,
        mut closed: impl FnMut(SessionId, Session<R>),
    ) {
        self.idle_ns = idle_ns;
        self.max_sessions = max_sessions;
        for id in 0..self.slots.len() {
            let Some(s) = self.slots.get_mut(id).and_then(|s| s.as_mut()) else {
                continue;
            };
            match map(s) {
                Some(m) => {
                    s.member = m;
                    if let Some(km) = s.key.member.as_mut() {
                        *km = m;
                    }
                }
                None => {
                    if let Some(s) = self.remove(id) {
                        closed(id, s);
                    }
                }
            }
        }
        // Rebuilt whole: renumbering may permute keys, so entries cannot be moved one by one.
        self.by_key = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(id, s)| s.as_ref().map(|s| (s.key, id)))
            .collect();
    }

    /// Remove every session (shutdown).
    pub fn drain(&mut self, mut closed: impl FnMut(SessionId, Session<R>)) {
        for id in 0..self.slots.len() {
            if let Some(s) = self.remove(id) {
                closed(id, s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(port: u16, member: Option<u32>) -> SessionKey {
        SessionKey {
            client: SocketAddr::from(([10, 0, 0, 1], port)),
            local: SocketAddr::from(([10, 0, 0, 2], 53)),
            member,
        }
    }

    #[test]
    fn remap_renumbers_members_and_closes_the_removed() {
        let mut t = table(10);
        let mut ids = Vec::new();
        for (port, m) in [(1, 0u32), (2, 1), (3, 2)] {
            assert_eq!(t.admit(), Admit::Reserved);
            ids.push(t.insert(key(port, Some(m)), m, 0, port as u32, 0).0);
        }
        let mut closed = Vec::new();
        // Member 1 removed, members 0 and 2 swap places.
        t.remap(
            2_000,
            5,
            |s| match s.member {
                0 => Some(1),
                2 => Some(0),
                _ => None,
            },
            |id, s| closed.push((id, s.resource)),
        );
        assert_eq!(closed, vec![(ids[1], 2)]);
        assert_eq!(t.len(), 2);
        assert_eq!(t.find(&key(1, Some(1)), 0), Some(ids[0]));
        assert_eq!(t.find(&key(3, Some(0)), 0), Some(ids[2]));
        assert_eq!(t.find(&key(1, Some(0)), 0), None);
        assert_eq!(t.get(ids[2]).map(|s| s.member), Some(0));
        // The new idle timeout applies.
        assert_eq!(t.find(&key(1, Some(1)), 1_500), Some(ids[0]));
    }

    fn table(max: usize) -> SessionTable<u32> {
        SessionTable::new(1_000, max, Arc::new(AtomicUsize::new(0)))
    }

    #[test]
    fn find_insert_expire() {
        let mut t = table(10);
        assert_eq!(t.find(&key(1, None), 0), None);
        assert_eq!(t.admit(), Admit::Reserved);
        let (id, stale) = t.insert(key(1, None), 2, 0, 77, 100);
        assert!(stale.is_none());
        assert_eq!(t.find(&key(1, None), 1_100), Some(id));
        assert_eq!(
            t.find(&key(1, Some(2)), 100),
            None,
            "per-member keys are distinct"
        );
        t.touch(id, 1, 50, true, 1_000);
        assert_eq!(t.find(&key(1, None), 2_000), Some(id), "touch refreshes");
        assert_eq!(t.expire(2_000, |_, _| panic!("not idle yet")), 0);
        let mut closed = Vec::new();
        assert_eq!(t.expire(2_001, |_, s| closed.push(s.resource)), 1);
        assert_eq!(closed, vec![77]);
        assert!(t.is_empty());
        assert_eq!(t.live.load(Ordering::Relaxed), 0);
    }

    /// Each session's socket is a file of the process's pool: past the pool a session is
    /// refused (its reservation undone), and an ending session gives its file back.
    #[test]
    fn sessions_draw_their_files_from_the_pool() {
        let needs = crate::budget::Needs::default();
        // A limit whose pool is exactly 2 files.
        let limit = crate::budget::split(200, &needs).0 + 2;
        let budget = Arc::new(crate::budget::FileBudget::new(limit, &needs));
        assert_eq!(budget.pool(), 2);
        let mut t = table(10).with_budget(Arc::clone(&budget));
        assert_eq!(t.admit(), Admit::Reserved);
        let (a, _) = t.insert(key(1, None), 0, 0, 1, 0);
        assert_eq!(t.admit(), Admit::Reserved);
        t.release();
        assert_eq!(t.admit(), Admit::Reserved);
        let (_b, _) = t.insert(key(2, None), 0, 0, 2, 0);
        assert_eq!(t.admit(), Admit::NoFiles);
        assert_eq!((t.live.load(Ordering::Relaxed), budget.used()), (2, 2));
        assert!(t.remove(a).is_some());
        assert_eq!(budget.used(), 1);
        assert_eq!(t.admit(), Admit::Reserved);
    }

    #[test]
    fn limit_is_shared_and_released() {
        let live = Arc::new(AtomicUsize::new(0));
        let mut a: SessionTable<()> = SessionTable::new(1_000, 2, Arc::clone(&live));
        let b: SessionTable<()> = SessionTable::new(1_000, 2, Arc::clone(&live));
        assert_eq!(a.admit(), Admit::Reserved);
        let (id, _) = a.insert(key(1, None), 0, 0, (), 0);
        assert_eq!(b.admit(), Admit::Reserved);
        assert_eq!(
            a.admit(),
            Admit::Full,
            "limit counts every worker's sessions"
        );
        b.release();
        assert_eq!(a.admit(), Admit::Reserved);
        a.release();
        assert!(a.remove(id).is_some());
        assert_eq!(live.load(Ordering::Relaxed), 0);
        assert!(a.remove(id).is_none(), "double remove is harmless");
        assert_eq!(live.load(Ordering::Relaxed), 0);
    }

    /// A session times its service: from the client's first datagram awaiting a reply to the
    /// service's first reply.
    #[test]
    fn touch_measures_request_to_first_reply() {
        let mut t = table(10);
        t.admit();
        let (id, _) = t.insert(key(1, None), 0, 0, 1, 0);
        assert_eq!(t.touch(id, 1, 50, false, 100), None, "a reply to nothing");
        assert_eq!(t.touch(id, 1, 50, true, 1_000), None);
        assert_eq!(
            t.touch(id, 1, 50, true, 1_200),
            None,
            "the first request starts the clock"
        );
        assert_eq!(t.touch(id, 2, 90, false, 1_700), Some(700));
        assert_eq!(
            t.touch(id, 1, 40, false, 1_800),
            None,
            "later replies answer nothing new"
        );
        assert_eq!(t.touch(id, 1, 50, true, 2_000), None);
        assert_eq!(t.touch(id, 1, 40, false, 2_050), Some(50));
    }

    /// A returning client whose session expired but was not swept gets its place back
    /// before the bound is checked (max_sessions 1: it would otherwise be refused).
    #[test]
    fn an_expired_session_gives_its_place_back_to_its_client() {
        let mut t = table(1);
        assert_eq!(t.admit(), Admit::Reserved);
        t.insert(key(1, None), 0, 0, 7, 0);
        assert!(t.take_expired(&key(1, None), 1_000).is_none(), "still live");
        assert!(
            t.take_expired(&key(2, None), 5_000).is_none(),
            "no such session"
        );
        assert_eq!(t.admit(), Admit::Full);
        let stale = t.take_expired(&key(1, None), 1_001);
        assert_eq!(stale.map(|s| s.resource), Some(7));
        assert!(t.is_empty());
        assert_eq!(t.admit(), Admit::Reserved, "its place is free again");
    }

    #[test]
    fn slots_are_reused_and_stale_sessions_replaced() {
        let mut t = table(10);
        t.admit();
        let (a, _) = t.insert(key(1, None), 0, 0, 1, 0);
        t.remove(a);
        t.admit();
        let (b, _) = t.insert(key(2, None), 0, 0, 2, 0);
        assert_eq!(a, b, "freed slot reused");
        t.admit();
        let (c, stale) = t.insert(key(2, None), 1, 0, 3, 5_000);
        assert_eq!(stale.map(|s| s.resource), Some(2));
        assert_eq!(t.len(), 1);
        assert_eq!(t.get(c).map(|s| s.member), Some(1));
        let mut n = 0;
        t.drain(|_, _| n += 1);
        assert_eq!(n, 1);
        assert_eq!(t.live.load(Ordering::Relaxed), 0);
    }
}
