//! Dialog affinity: Call-ID → service, so an established call stays on its service when
//! the service set changes (a service added by reload, another returning from DOWN). PURE:
//! time is passed in as milliseconds on the caller's monotonic clock.
//!
//! Keys are the 64-bit hash of the Call-ID, not the Call-ID itself: no allocation per
//! message, and a collision (2^-64 per pair) only costs affinity, never correctness of
//! routing, because the hash method still picks an UP service.
//!
//! # A dialog exists once it is answered 2xx
//! A request that pins (INVITE and the other requests of [`crate::core::sip`]'s
//! `pins_dialog`) makes a **pending** entry: its transaction is in progress, nothing proves
//! that a dialog will follow. It lives no longer than that transaction: Timer B (64·T1,
//! RFC 3261 §17.1.1.2) after the request while nothing is heard, Timer C (§16.8) after each
//! provisional answer. A 2xx to it (matched by Call-ID and CSeq number) makes the entry
//! **open**, a dialog, kept for the idle timeout after its last request. A final answer
//! above 2xx, or a CANCEL, makes it **spent**: it keeps its service a short while, for the
//! client's ACK of that answer (hop by hop, RFC 3261 §17.1.1.3) and the retransmissions of
//! the CANCEL, and is then gone. An open dialog ended by a BYE is **ended** and lingers
//! likewise.
//!
//! A pending entry counts as *pending* load on its service and an open one as *active*
//! (`ServiceCounters`): least-connection methods see a call being set up at once (a burst
//! of INVITEs would otherwise all land on the same service while they ring), but only a
//! dialog is reported as an active flow, and the pending count of an INVITE nobody answers
//! is gone with its entry, within Timer B. Every count change is told to the caller as a
//! [`Change`].
//!
//! # Eviction
//! The table is bounded (`max_sessions`). Pending and spent entries are **evictable**: when
//! the table is full, a new one pushes out the oldest evictable entry; open and ended dialogs
//! are never pushed out, so a flood of unanswered INVITEs cannot take their place. The order
//! is kept by a ring of the evictable entries' keys in the order they were made (lock-free:
//! two atomic cursors), sized to the next power of two at or above the bound: an entry that
//! more than that many later evictable entries overtook while it lived has left the ring and
//! expires at its own deadline instead. A 2xx whose pending entry was pushed out pins the
//! dialog again, to the service that sent it.

use dashmap::DashMap;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// How long an ended dialog keeps its pin: 64×T1 = 32 s, the lifetime of a non-INVITE
/// transaction (RFC 3261 §17.1.2.2), so retransmitted BYEs and their ACKs still follow it.
/// A CANCEL spends a pending entry for as long (its own retransmissions, then the 487).
pub(crate) const ENDED_LINGER_MS: u64 = 32_000;

/// Timer B (64·T1, RFC 3261 §17.1.1.2): a pending entry nothing was heard for is gone after it.
pub(crate) const TIMER_B_MS: u64 = 32_000;

/// Timer C (RFC 3261 §16.8, more than 3 minutes): a pending entry's life after each
/// provisional answer. A UAS that rings longer sends a provisional every minute
/// (§13.3.1.1) so that proxies' Timer C does not fire.
pub(crate) const TIMER_C_MS: u64 = 180_000;

/// How long a spent entry keeps its service after each final answer above 2xx passes: T2
/// (4 s, §17.1.2.2), the longest a UAS waits between retransmissions of that answer until the
/// ACK comes (Timer G, §17.2.1). Each retransmission passes fulcrum and opens the window
/// again, and the client ACKs each (§17.1.1.2), so the ACK finds the service; Timer D's 32 s
/// would only hold a flood's entries eight times longer.
pub(crate) const ACK_WINDOW_MS: u64 = 4_000;

/// The largest eviction ring (slots of 8 bytes): a table bounded above it keeps the order of
/// its last 4 Mi evictable entries.
const MAX_RING: usize = 1 << 22;

/// The CSeq of a transaction-only entry ([`DialogTable::linger`]): no answer confirms it
/// (RFC 3261 §8.1.1.5 keeps CSeq numbers below 2^31).
const NO_CSEQ: u32 = u32::MAX;

/// Where an entry is in its life (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum State {
    Pending = 0,
    Open = 1,
    Ended = 2,
    Spent = 3,
}

impl State {
    fn of(v: u8) -> State {
        match v {
            0 => State::Pending,
            1 => State::Open,
            2 => State::Ended,
            _ => State::Spent,
        }
    }

    fn count(self) -> Option<Count> {
        match self {
            State::Pending => Some(Count::Pending),
            State::Open => Some(Count::Active),
            State::Ended | State::Spent => None,
        }
    }

    fn is_evictable(self) -> bool {
        matches!(self, State::Pending | State::Spent)
    }
}

/// What an entry counts as on its service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// A request that may open a dialog, not answered 2xx yet.
    Pending,
    /// A dialog (an active flow).
    Active,
}

/// A change of the load counted on a member, for the caller to carry out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Open(u32, Count),
    Close(u32, Count),
}

/// Who sent a 2xx, as far as the caller knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answerer {
    Unknown,
    /// The member at the address it came from: pins the dialog when its entry is gone
    /// (pushed out, or expired while ringing), never moves one.
    Likely(u32),
    /// The member failover forwarded the request to last and whose 2xx the client got
    /// first: the dialog is its, wherever the entry points.
    Winner(u32),
}

/// One remembered Call-ID.
#[derive(Debug)]
struct Entry {
    /// Index of the service (in the vserver's member list); changed under the shard's write
    /// lock only, so a reader of `state` sees the member its count is on.
    member: u32,
    /// The CSeq number of the request that made the entry pending: its answers carry it.
    cseq: AtomicU32,
    /// Where the entry's key was written in the eviction ring (low 32 bits): an older slot
    /// naming the same Call-ID belongs to an entry that is gone.
    ring_at: AtomicU32,
    state: AtomicU8,
    /// Open: when last seen. Otherwise: when it expires.
    stamp_ms: AtomicU64,
}

impl Entry {
    fn new(member: u32, state: State, stamp_ms: u64, cseq: u32) -> Entry {
        Entry {
            member,
            cseq: AtomicU32::new(cseq),
            ring_at: AtomicU32::new(u32::MAX),
            state: AtomicU8::new(state as u8),
            stamp_ms: AtomicU64::new(stamp_ms),
        }
    }

    /// The entry with its place in the eviction ring.
    fn at(self, ring_at: u64) -> Entry {
        // The low 32 bits: a slot is written over long before its index wraps.
        self.ring_at.store(ring_at as u32, Ordering::Relaxed);
        self
    }

    fn state(&self) -> State {
        State::of(self.state.load(Ordering::Relaxed))
    }

    /// Move from `from` to `to`; false when another thread moved it first (each transition,
    /// and so each count change, happens once).
    fn shift(&self, from: State, to: State) -> bool {
        self.state
            .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    fn stamp(&self) -> u64 {
        self.stamp_ms.load(Ordering::Relaxed)
    }

    fn set_stamp(&self, ms: u64) {
        self.stamp_ms.store(ms, Ordering::Relaxed);
    }

    fn is_answer(&self, cseq: u32) -> bool {
        self.cseq.load(Ordering::Relaxed) == cseq
    }

    fn is_expired(&self, now_ms: u64, idle_ms: u64) -> bool {
        let t = self.stamp();
        match self.state() {
            State::Open => now_ms.saturating_sub(t) > idle_ms,
            _ => now_ms > t,
        }
    }
}

/// The keys of evictable entries in the order they were made: a lock-free ring written at
/// `head`, read at `tail` (module doc, Eviction).
struct Ring {
    slots: Box<[AtomicU64]>,
    head: AtomicU64,
    tail: AtomicU64,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("slots", &self.slots.len())
            .field("head", &self.head)
            .field("tail", &self.tail)
            .finish()
    }
}

impl Ring {
    fn new(bound: usize) -> Ring {
        let n = bound.clamp(1, MAX_RING).next_power_of_two();
        Ring {
            slots: (0..n).map(|_| AtomicU64::new(0)).collect(),
            head: AtomicU64::new(0),
            tail: AtomicU64::new(0),
        }
    }

    fn slot(&self, i: u64) -> &AtomicU64 {
        // The length is a power of two: the mask keeps the index in bounds.
        let mask = self.slots.len() as u64 - 1;
        &self.slots[usize::try_from(i & mask).unwrap_or(0)]
    }

    /// The index of the next slot, for the caller to [`Ring::write`] once its entry is in.
    fn claim(&self) -> u64 {
        self.head.fetch_add(1, Ordering::AcqRel)
    }

    fn write(&self, i: u64, key: u64) {
        self.slot(i).store(key, Ordering::Release);
    }

    /// The oldest slot still in the ring, taken out: its index and key. A key written over by
    /// a later one (the writer went round the ring) is gone; a slot claimed but not yet
    /// written reads its previous key, whose entry (if any) has another index.
    fn pop(&self) -> Option<(u64, u64)> {
        let cap = self.slots.len() as u64;
        loop {
            let head = self.head.load(Ordering::Acquire);
            let tail = self.tail.load(Ordering::Acquire);
            if tail >= head {
                return None;
            }
            let from = tail.max(head.saturating_sub(cap));
            if self
                .tail
                .compare_exchange(tail, from + 1, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Some((from, self.slot(from).load(Ordering::Acquire)));
            }
        }
    }
}

/// What [`DialogTable::put`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// A new pending entry (or a spent one pending again).
    New,
    /// An existing entry moved from this member (its member was not usable).
    Moved(u32),
    /// The entry was already pinned to this member, or has ended.
    Refreshed,
    /// The table is full of dialogs; the request was not pinned.
    Refused,
}

/// What [`DialogTable::migrate_to`] did, by new member.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Migration {
    /// The entries copied that count as load (pending requests, open dialogs).
    pub counted: Vec<(u32, Count)>,
    /// Not migrated, and counting as load: the new table was full.
    pub refused_counted: Vec<(u32, Count)>,
    /// The entries the new table had no room for, sorted: the catch-up pass leaves them
    /// out, as they were refused and reported once already.
    pub refused_keys: Vec<u64>,
    /// The entries copied, sorted: the catch-up pass tells them from entries made later.
    pub copied_keys: Vec<u64>,
}

/// What [`DialogTable::catch_up_to`] changed in the new table, by new member.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CatchUp {
    /// Entries made in the old table after the migration, now here too, counting as load.
    pub opened: Vec<(u32, Count)>,
    /// What the old table did afterwards to entries migrated (a 2xx, a final answer, a BYE,
    /// a move), carried here: the count changes, by the members this table has them on.
    pub changed: Vec<Change>,
    /// Pending entries of this table pushed out to make room for the old table's: their
    /// count stops wherever it was kept.
    pub pushed_out: Vec<Change>,
    /// Entries made in the old table after the migration, counting as load, that this table
    /// had no room for.
    pub refused_counted: Vec<(u32, Count)>,
    /// Entries made in the old table after the migration and, before the catch-up, made here
    /// too by the new table's own traffic (which this table keeps), by the old table's member
    /// and count: each was counted twice.
    pub doubled: Vec<(u32, Count)>,
    /// Entries taken from the old table on demand before the catch-up
    /// ([`DialogTable::pull_from`]), counting as load, by new member (the caller that counts
    /// afresh counted them when they were taken).
    pub pulled: Vec<(u32, Count)>,
}

impl CatchUp {
    /// Open dialogs the two passes carried over, `first` being the migration.
    pub fn kept(&self, first: &Migration) -> usize {
        let active = |v: &[(u32, Count)]| v.iter().filter(|(_, c)| *c == Count::Active).count();
        let (mut gained, mut lost) = (0, 0);
        for c in &self.changed {
            match c {
                Change::Open(_, Count::Active) => gained += 1,
                Change::Close(_, Count::Active) => lost += 1,
                _ => {}
            }
        }
        (active(&first.counted) + active(&self.opened) + active(&self.pulled) + gained)
            .saturating_sub(lost)
    }
}

/// Bounded, lock-striped Call-ID affinity table with expiry and eviction of the entries no
/// dialog is known for (module doc).
#[derive(Debug)]
pub struct DialogTable {
    map: DashMap<u64, Entry>,
    /// Entries in `map` (its own `len` locks every shard).
    held: AtomicUsize,
    max_entries: usize,
    idle_ms: u64,
    /// Inserts refused because the table was full of dialogs.
    refused: AtomicUsize,
    /// Evictable entries pushed out to make room.
    evicted: AtomicUsize,
    order: Ring,
    /// What this table took from the table it replaces during a reload's hand-over
    /// ([`DialogTable::pull_from`]), until the catch-up pass.
    pulled: std::sync::Mutex<Pulled>,
}

/// The entries a new table took from its predecessor on demand ([`DialogTable::pull_from`]):
/// the catch-up pass carries later changes into them as into migrated ones.
#[derive(Debug, Default)]
struct Pulled {
    keys: std::collections::HashSet<u64>,
    /// By new member, the entries taken that count as load.
    counted: Vec<(u32, Count)>,
}

impl DialogTable {
    pub fn new(max_entries: usize, idle_ms: u64) -> DialogTable {
        DialogTable {
            map: DashMap::new(),
            held: AtomicUsize::new(0),
            max_entries,
            idle_ms,
            refused: AtomicUsize::new(0),
            evicted: AtomicUsize::new(0),
            order: Ring::new(max_entries),
            pulled: std::sync::Mutex::default(),
        }
    }

    /// `ms` from `now_ms`, but never past the idle timeout.
    fn after(&self, now_ms: u64, ms: u64) -> u64 {
        now_ms.saturating_add(ms.min(self.idle_ms))
    }

    /// The member a live entry is pinned to; refreshes an open dialog's idle timer.
    pub fn get(&self, call_hash: u64, now_ms: u64) -> Option<u32> {
        let e = self.map.get(&call_hash)?;
        if e.is_expired(now_ms, self.idle_ms) {
            return None;
        }
        if e.state() == State::Open && now_ms > e.stamp() {
            e.set_stamp(now_ms);
        }
        Some(e.member)
    }

    /// [`DialogTable::get`] for a request that pins (CSeq number `cseq`): a spent entry
    /// becomes pending again for a new request of its Call-ID (an INVITE sent again with
    /// credentials after a 401 / 407, RFC 3261 §22.2), on the same member.
    pub fn get_pinning(
        &self,
        call_hash: u64,
        cseq: u32,
        now_ms: u64,
        mut tally: impl FnMut(Change),
    ) -> Option<u32> {
        let e = self.map.get(&call_hash)?;
        if e.is_expired(now_ms, self.idle_ms) {
            return None;
        }
        match e.state() {
            State::Open if now_ms > e.stamp() => e.set_stamp(now_ms),
            State::Spent
                if e.cseq.load(Ordering::Relaxed) != cseq
                    && e.shift(State::Spent, State::Pending) =>
            {
                e.cseq.store(cseq, Ordering::Relaxed);
                e.set_stamp(self.after(now_ms, TIMER_B_MS));
                tally(Change::Open(e.member, Count::Pending));
            }
            _ => {}
        }
        Some(e.member)
    }

    /// Pin a request (CSeq number `cseq`) to `member`: pending until a 2xx confirms it
    /// ([`DialogTable::answered`]). When the table is full the oldest evictable entry makes
    /// room; when it holds only dialogs, the request is not pinned (counted): the hash method
    /// keeps routing it consistently while the service set is stable.
    pub fn put(
        &self,
        call_hash: u64,
        member: u32,
        cseq: u32,
        now_ms: u64,
        mut tally: impl FnMut(Change),
    ) -> Pin {
        if let Some(pin) = self.repin(call_hash, member, cseq, now_ms, &mut tally) {
            return pin;
        }
        if !self.make_room(&mut tally) {
            return Pin::Refused;
        }
        let deadline = self.after(now_ms, TIMER_B_MS);
        match self.map.entry(call_hash) {
            dashmap::Entry::Vacant(at) => {
                let i = self.order.claim();
                at.insert(Entry::new(member, State::Pending, deadline, cseq).at(i));
                self.held.fetch_add(1, Ordering::Relaxed);
                self.order.write(i, call_hash);
                tally(Change::Open(member, Count::Pending));
                Pin::New
            }
            // Pinned by another worker meanwhile: that pin stands.
            dashmap::Entry::Occupied(_) => Pin::Refreshed,
        }
    }

    /// [`DialogTable::put`] for a Call-ID the table holds; `None` when it does not.
    fn repin(
        &self,
        call_hash: u64,
        member: u32,
        cseq: u32,
        now_ms: u64,
        tally: &mut impl FnMut(Change),
    ) -> Option<Pin> {
        let mut e = self.map.get_mut(&call_hash)?;
        let state = e.state();
        let old = e.member;
        let pin = match state {
            // A lingering ended dialog is not pinned again; its member is no longer loaded.
            State::Ended => return Some(Pin::Refreshed),
            State::Open => {
                e.set_stamp(now_ms);
                e.member = member;
                if old == member {
                    return Some(Pin::Refreshed);
                }
                Pin::Moved(old)
            }
            // Another attempt (failover) or a new request: its own Timer B.
            State::Pending | State::Spent => {
                e.set_stamp(self.after(now_ms, TIMER_B_MS));
                e.cseq.store(cseq, Ordering::Relaxed);
                e.member = member;
                if state == State::Spent {
                    e.state.store(State::Pending as u8, Ordering::Relaxed);
                    tally(Change::Open(member, Count::Pending));
                    return Some(Pin::New);
                }
                if old == member {
                    return Some(Pin::Refreshed);
                }
                Pin::Moved(old)
            }
        };
        if let Some(count) = state.count() {
            tally(Change::Close(old, count));
            tally(Change::Open(member, count));
        }
        Some(pin)
    }

    /// Room for one more entry: true when there is, after pushing out the oldest evictable
    /// entry if the table was full; false (counted refused) when only dialogs are left.
    fn make_room(&self, tally: &mut impl FnMut(Change)) -> bool {
        if self.held.load(Ordering::Relaxed) < self.max_entries {
            return true;
        }
        while let Some((i, key)) = self.order.pop() {
            let gone = self.map.remove_if(&key, |_, e| {
                e.state().is_evictable() && e.ring_at.load(Ordering::Relaxed) == i as u32
            });
            if let Some((_, e)) = gone {
                self.held.fetch_sub(1, Ordering::Relaxed);
                self.evicted.fetch_add(1, Ordering::Relaxed);
                if e.state() == State::Pending {
                    tally(Change::Close(e.member, Count::Pending));
                }
                return true;
            }
        }
        self.refused.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Pin a request that opens no dialog (OPTIONS, MESSAGE, PUBLISH) for the life of its
    /// transaction only: a spent entry lingering [`ENDED_LINGER_MS`] (Timer F), so that its
    /// retransmissions reach the same member, evictable, never counted as load and never
    /// confirmed. Nothing happens when the Call-ID is already in the table or only dialogs
    /// fill it.
    pub fn linger(&self, call_hash: u64, member: u32, now_ms: u64, mut tally: impl FnMut(Change)) {
        if self.map.contains_key(&call_hash) || !self.make_room(&mut tally) {
            return;
        }
        let expire_at = self.after(now_ms, ENDED_LINGER_MS);
        if let dashmap::Entry::Vacant(at) = self.map.entry(call_hash) {
            let i = self.order.claim();
            at.insert(Entry::new(member, State::Spent, expire_at, NO_CSEQ).at(i));
            self.held.fetch_add(1, Ordering::Relaxed);
            self.order.write(i, call_hash);
        }
    }

    /// A response to the request of CSeq number `cseq` passed from a service toward the
    /// client: a provisional one extends a pending entry to Timer C, a 2xx makes it (or a
    /// spent one: a 2xx that crossed the CANCEL, RFC 3261 §9.1) an open dialog, a final above
    /// 2xx spends it (for [`ACK_WINDOW_MS`]). Answers of other requests (a PRACK, a CANCEL,
    /// an in-dialog request) do not match `cseq` or find an open dialog, and change nothing.
    pub fn answered(
        &self,
        call_hash: u64,
        cseq: u32,
        code: u16,
        by: Answerer,
        now_ms: u64,
        mut tally: impl FnMut(Change),
    ) {
        if (200..300).contains(&code) {
            return self.confirm(call_hash, cseq, by, now_ms, &mut tally);
        }
        let Some(e) = self.map.get(&call_hash) else {
            return;
        };
        if !e.is_answer(cseq) {
            return;
        }
        match e.state() {
            State::Pending if code < 200 => {
                let until = self.after(now_ms, TIMER_C_MS);
                if until > e.stamp() {
                    e.set_stamp(until);
                }
            }
            State::Pending if e.shift(State::Pending, State::Spent) => {
                e.set_stamp(self.after(now_ms, ACK_WINDOW_MS));
                tally(Change::Close(e.member, Count::Pending));
            }
            // A retransmitted final answer: the client ACKs it again.
            State::Spent if code >= 200 => {
                let until = self.after(now_ms, ACK_WINDOW_MS);
                if until > e.stamp() {
                    e.set_stamp(until);
                }
            }
            _ => {}
        }
    }

    fn confirm(
        &self,
        call_hash: u64,
        cseq: u32,
        by: Answerer,
        now_ms: u64,
        tally: &mut impl FnMut(Change),
    ) {
        if let Answerer::Winner(w) = by
            && let Some(mut e) = self.map.get_mut(&call_hash)
        {
            // The dialog is the winner's: the entry moves to it, whatever it pointed at.
            let (state, old) = (e.state(), e.member);
            let counted = match state {
                State::Pending | State::Spent if e.is_answer(cseq) => {
                    if state == State::Pending {
                        tally(Change::Close(old, Count::Pending));
                    }
                    true
                }
                State::Open if old != w => {
                    tally(Change::Close(old, Count::Active));
                    true
                }
                _ => false,
            };
            if counted {
                e.member = w;
                e.state.store(State::Open as u8, Ordering::Relaxed);
                e.set_stamp(now_ms);
                tally(Change::Open(w, Count::Active));
            }
            return;
        }
        if let Some(e) = self.map.get(&call_hash) {
            match e.state() {
                State::Open => e.set_stamp(now_ms.max(e.stamp())),
                from @ (State::Pending | State::Spent)
                    if e.is_answer(cseq) && e.shift(from, State::Open) =>
                {
                    e.set_stamp(now_ms);
                    if from == State::Pending {
                        tally(Change::Close(e.member, Count::Pending));
                    }
                    tally(Change::Open(e.member, Count::Active));
                }
                _ => {}
            }
            return;
        }
        // Pushed out while pending (or expired while ringing): the dialog is pinned again to
        // the service that answered, when the caller knows it.
        let (Answerer::Likely(m) | Answerer::Winner(m)) = by else {
            return;
        };
        if !self.make_room(tally) {
            return;
        }
        if let dashmap::Entry::Vacant(at) = self.map.entry(call_hash) {
            at.insert(Entry::new(m, State::Open, now_ms, cseq));
            self.held.fetch_add(1, Ordering::Relaxed);
            tally(Change::Open(m, Count::Active));
        }
    }

    /// Mark an entry ended (BYE, CANCEL): an open dialog is ended, a pending entry spent; it
    /// keeps its pin for [`ENDED_LINGER_MS`], then expires. The member's count stops the first
    /// time.
    pub fn end(&self, call_hash: u64, now_ms: u64, mut tally: impl FnMut(Change)) {
        let Some(e) = self.map.get(&call_hash) else {
            return;
        };
        let expire_at = self.after(now_ms, ENDED_LINGER_MS);
        if e.shift(State::Open, State::Ended) {
            e.set_stamp(expire_at);
            tally(Change::Close(e.member, Count::Active));
        } else if e.shift(State::Pending, State::Spent) {
            e.set_stamp(expire_at);
            tally(Change::Close(e.member, Count::Pending));
        }
    }

    /// Drop expired entries, telling `tally` the count each closes; returns how many were
    /// dropped.
    pub fn sweep(&self, now_ms: u64, mut tally: impl FnMut(Change)) -> usize {
        let mut dropped = 0;
        self.map.retain(|_, e| {
            let keep = !e.is_expired(now_ms, self.idle_ms);
            if !keep {
                dropped += 1;
                if let Some(count) = e.state().count() {
                    tally(Change::Close(e.member, count));
                }
            }
            keep
        });
        self.held.fetch_sub(dropped, Ordering::Relaxed);
        dropped
    }

    /// Copy every live entry, with its state, into `into` (a table built for a reloaded
    /// member list), renumbering members with `map`; entries whose member has no new index
    /// (its service left the vserver) are dropped. Dialogs go first, so that a smaller table
    /// refuses evictable entries before them; evictable entries follow by deadline, the
    /// oldest first into the new eviction order. Returns, by new member, the entries counting
    /// as load: those migrated (to count there) and those `into` had no room for (a caller
    /// whose counters carry over closes them).
    pub fn migrate_to(
        &self,
        into: &DialogTable,
        now_ms: u64,
        map: impl Fn(u32) -> Option<u32>,
    ) -> Migration {
        let mut done = Migration::default();
        let mut evictable = Vec::new();
        for e in self.map.iter() {
            if e.is_expired(now_ms, self.idle_ms) {
                continue;
            }
            if e.state().is_evictable() {
                evictable.push((e.stamp(), *e.key()));
            } else {
                self.copy_one(into, *e.key(), &e, &map, &mut done);
            }
        }
        evictable.sort_unstable();
        for (_, key) in evictable {
            if let Some(e) = self.map.get(&key) {
                self.copy_one(into, key, &e, &map, &mut done);
            }
        }
        done.refused_keys.sort_unstable();
        done.copied_keys.sort_unstable();
        done
    }

    fn copy_one(
        &self,
        into: &DialogTable,
        key: u64,
        e: &Entry,
        map: &impl Fn(u32) -> Option<u32>,
        done: &mut Migration,
    ) {
        let Some(member) = map(e.member) else {
            return;
        };
        let count = e.state().count();
        // `into` is not in use yet: every key is vacant, and its size is its own count.
        let full = into.held.load(Ordering::Relaxed) >= into.max_entries;
        if full {
            into.refused.fetch_add(1, Ordering::Relaxed);
        }
        if let dashmap::Entry::Vacant(at) = into.map.entry(key) {
            if into.adopt(at, key, full, member, e) {
                done.copied_keys.push(key);
                done.counted.extend(count.map(|c| (member, c)));
            } else {
                done.refused_keys.push(key);
                done.refused_counted.extend(count.map(|c| (member, c)));
            }
        }
    }

    /// During a reload's hand-over, after this table replaced `old` (the switch) and before
    /// the catch-up pass ([`DialogTable::catch_up_to`]), for a message of Call-ID hash `key`:
    /// the live entry of `key` in `old`, its member renumbered by `map`, is taken into this
    /// table when this one has none; when this one has it from `old` (`migrated`: the keys the
    /// migration copied, sorted; or taken so), what `old`'s last users did to it since is
    /// carried into it first, as the catch-up would, the count changes added to `changed`.
    /// Without this, a dialog set up on the old table after the migration pass is unknown
    /// here until the catch-up, which waits for the old table's last users: its next request,
    /// handled with the new table meanwhile, would be balanced afresh (and its end would leave
    /// it counted); and a 2xx the old table took after the migration would be missing here
    /// when the BYE comes. Nothing is taken when the table is full (the catch-up decides
    /// then). Returns the new member and the load the entry counts, when one was taken.
    pub fn pull_from(
        &self,
        old: &DialogTable,
        key: u64,
        now_ms: u64,
        map: impl Fn(u32) -> Option<u32>,
        migrated: &[u64],
        changed: &mut Vec<Change>,
    ) -> Option<(u32, Option<Count>)> {
        if self.map.contains_key(&key) {
            let from_old = migrated.binary_search(&key).is_ok()
                || crate::sync::lock(&self.pulled).keys.contains(&key);
            if from_old {
                // The old table's shard, then this one's: the order of the catch-up pass too.
                let e = old.map.get(&key)?;
                if !e.is_expired(now_ms, old.idle_ms)
                    && let Some(member) = map(e.member)
                    && let Some(mut n) = self.map.get_mut(&key)
                {
                    carry(&mut n, member, &e, changed);
                }
            }
            return None;
        }
        if self.held.load(Ordering::Relaxed) >= self.max_entries {
            return None;
        }
        let e = old.map.get(&key)?;
        if e.is_expired(now_ms, old.idle_ms) {
            return None;
        }
        let member = map(e.member)?;
        let dashmap::Entry::Vacant(at) = self.map.entry(key) else {
            return None;
        };
        let count = e.state().count();
        // Recorded while the key is locked: the catch-up, which locks it too, sees it.
        let mut pulled = crate::sync::lock(&self.pulled);
        if !self.adopt(at, key, false, member, &e) {
            return None;
        }
        pulled.keys.insert(key);
        pulled.counted.extend(count.map(|c| (member, c)));
        Some((member, count))
    }

    /// The second pass of a migration, run once the new table is the one in use: what the old
    /// table's users did between [`DialogTable::migrate_to`] and the switch (pins, answers,
    /// ends, moves) is carried into `into`. An entry `into` already holds changes only where
    /// the old one went further: an end always carries (an entry that ended stays ended), a
    /// 2xx carries unless this table ended the entry since, a move only when the old entry
    /// was seen after the new one (traffic on the new table wins). `first` is what the
    /// migration did: the entries it refused are not looked at again, and an entry it did not
    /// copy, and `into` did not take on demand ([`DialogTable::pull_from`]), but `into` holds
    /// was made there by the new table's traffic. Run once, after the switch.
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
            let count = e.state().count();
            let copied = first.copied_keys.binary_search(e.key()).is_ok();
            // `into` is live (workers insert meanwhile): room is made as a worker would.
            let full = !into.map.contains_key(e.key()) && {
                let mut pushed_out = |c: Change| done.pushed_out.push(c);
                !into.make_room(&mut pushed_out)
            };
            match into.map.entry(*e.key()) {
                dashmap::Entry::Occupied(mut n)
                    if copied || crate::sync::lock(&into.pulled).keys.contains(e.key()) =>
                {
                    carry(n.get_mut(), member, &e, &mut done.changed);
                }
                dashmap::Entry::Occupied(_) => {
                    // Made on both sides after the migration: this table's entry stands.
                    done.doubled.extend(count.map(|c| (member, c)));
                }
                dashmap::Entry::Vacant(at) => {
                    if into.adopt(at, *e.key(), full, member, &e) {
                        done.opened.extend(count.map(|c| (member, c)));
                    } else {
                        done.refused_counted.extend(count.map(|c| (member, c)));
                    }
                }
            }
        }
        // No pull follows the catch-up: what was taken is reported, and forgotten.
        let pulled = std::mem::take(&mut *crate::sync::lock(&into.pulled));
        done.pulled = pulled.counted;
        done
    }

    /// Put an old table's entry at a vacant key of this table, as member `member`, unless the
    /// table is `full` (known before the key was locked; the caller counts the refusal). True
    /// when it was put.
    fn adopt(
        &self,
        at: dashmap::mapref::entry::VacantEntry<'_, u64, Entry>,
        key: u64,
        full: bool,
        member: u32,
        from: &Entry,
    ) -> bool {
        if full {
            return false;
        }
        let state = from.state();
        let entry = Entry::new(
            member,
            state,
            from.stamp(),
            from.cseq.load(Ordering::Relaxed),
        );
        if state.is_evictable() {
            let i = self.order.claim();
            at.insert(entry.at(i));
            self.order.write(i, key);
        } else {
            at.insert(entry);
        }
        self.held.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// How long a dialog may stay idle before it expires.
    pub fn idle(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.idle_ms)
    }

    pub fn len(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Inserts refused because only dialogs filled the table.
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::Relaxed)
    }

    /// Pending or spent entries pushed out to make room.
    pub fn evicted(&self) -> usize {
        self.evicted.load(Ordering::Relaxed)
    }

    /// Whether the Call-ID is pinned to an open dialog (not pending, spent or ended).
    pub fn is_confirmed(&self, call_hash: u64) -> bool {
        self.map
            .get(&call_hash)
            .is_some_and(|e| e.state() == State::Open)
    }
}

/// Carry what the old table did to a migrated entry `o` (its member `member` in this table)
/// into this table's copy `n` (see [`DialogTable::catch_up_to`]), the count changes into
/// `changed`.
fn carry(n: &mut Entry, member: u32, o: &Entry, changed: &mut Vec<Change>) {
    let (ns, os) = (n.state(), o.state());
    let takes = match (ns, os) {
        // This table ended it, or confirmed it since: it stands.
        (State::Ended, _) | (State::Open, State::Pending | State::Spent) => false,
        (State::Open, State::Ended) | (State::Pending, State::Open | State::Spent) => true,
        (State::Spent, State::Open) => true,
        // The same state: a move (another attempt, a member no longer usable), when later.
        (a, b) if a == b => n.member != member && o.stamp() > n.stamp(),
        _ => false,
    };
    if !takes {
        return;
    }
    if let Some(c) = ns.count() {
        changed.push(Change::Close(n.member, c));
    }
    if let Some(c) = os.count() {
        changed.push(Change::Open(member, c));
    }
    n.member = member;
    n.state.store(os as u8, Ordering::Relaxed);
    n.set_stamp(o.stamp());
    n.cseq
        .store(o.cseq.load(Ordering::Relaxed), Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Load per member as a caller counts it from the table's [`Change`]s.
    #[derive(Debug, Default, Clone, PartialEq, Eq)]
    struct Loads {
        pending: [i64; 4],
        active: [i64; 4],
    }

    impl Loads {
        fn apply(&mut self, c: Change) {
            let (m, count, d) = match c {
                Change::Open(m, k) => (m, k, 1),
                Change::Close(m, k) => (m, k, -1),
            };
            let v = match count {
                Count::Pending => &mut self.pending,
                Count::Active => &mut self.active,
            };
            v[m as usize] += d;
        }

        fn totals(&self) -> (i64, i64) {
            (self.pending.iter().sum(), self.active.iter().sum())
        }
    }

    /// A pending entry answered 2xx at `at`.
    fn dialog(t: &DialogTable, call: u64, member: u32, at: u64, l: &mut Loads) {
        t.put(call, member, 1, at, |c| l.apply(c));
        t.answered(call, 1, 200, Answerer::Unknown, at, |c| l.apply(c));
    }

    #[test]
    fn a_pending_entry_counts_pending_and_expires_at_timer_b() {
        let t = DialogTable::new(10, 3_600_000);
        let mut l = Loads::default();
        assert_eq!(t.put(1, 2, 1, 1000, |c| l.apply(c)), Pin::New);
        assert_eq!(l.totals(), (1, 0), "counted pending, not active");
        assert!(!t.is_confirmed(1));
        // A retransmission finds it; it is not refreshed by traffic.
        assert_eq!(t.get(1, 1000 + TIMER_B_MS), Some(2));
        assert_eq!(t.get(1, 1001 + TIMER_B_MS), None);
        assert_eq!(t.sweep(1001 + TIMER_B_MS, |c| l.apply(c)), 1);
        assert_eq!(l.totals(), (0, 0));
        assert!(t.is_empty());
    }

    #[test]
    fn a_provisional_answer_holds_a_pending_entry_until_timer_c() {
        let t = DialogTable::new(10, 3_600_000);
        let mut l = Loads::default();
        t.put(1, 0, 5, 0, |c| l.apply(c));
        t.answered(1, 5, 180, Answerer::Unknown, 10_000, |c| l.apply(c));
        assert_eq!(t.get(1, 10_000 + TIMER_C_MS), Some(0));
        assert_eq!(t.get(1, 10_001 + TIMER_C_MS), None);
        // Ringing for a long while, answered at last: a dialog.
        t.answered(1, 5, 200, Answerer::Unknown, 150_000, |c| l.apply(c));
        assert!(t.is_confirmed(1));
        assert_eq!(l.totals(), (0, 1));
    }

    #[test]
    fn a_2xx_confirms_and_the_dialog_then_lives_for_the_idle_timeout() {
        let t = DialogTable::new(10, 1000);
        let mut l = Loads::default();
        t.put(1, 2, 1, 0, |c| l.apply(c));
        t.answered(1, 1, 200, Answerer::Unknown, 500, |c| l.apply(c));
        assert!(t.is_confirmed(1));
        assert_eq!((l.pending[2], l.active[2]), (0, 1));
        // A retransmitted 2xx changes nothing.
        t.answered(1, 1, 200, Answerer::Unknown, 600, |c| l.apply(c));
        assert_eq!(l.totals(), (0, 1));
        assert_eq!(t.get(1, 1400), Some(2));
        // Refreshed at 1400, so still alive at 2300.
        assert_eq!(t.get(1, 2300), Some(2));
        assert_eq!(t.get(1, 3301), None);
        assert_eq!(t.sweep(3301, |c| l.apply(c)), 1);
        assert_eq!(l.totals(), (0, 0));
    }

    /// A final answer above 2xx spends the entry at once: it keeps its member for the ACK
    /// window, again after each retransmission of the answer, then goes.
    #[test]
    fn a_non_2xx_final_answer_spends_the_entry_for_the_ack_window() {
        let t = DialogTable::new(10, 3_600_000);
        let mut l = Loads::default();
        t.put(1, 1, 1, 0, |c| l.apply(c));
        t.answered(1, 1, 486, Answerer::Unknown, 2000, |c| l.apply(c));
        assert_eq!(l.totals(), (0, 0), "no longer counted");
        assert_eq!(t.get(1, 2000 + ACK_WINDOW_MS), Some(1), "the ACK finds it");
        t.answered(1, 1, 486, Answerer::Unknown, 5000, |c| l.apply(c));
        assert_eq!(t.get(1, 5000 + ACK_WINDOW_MS), Some(1));
        assert_eq!(t.get(1, 5001 + ACK_WINDOW_MS), None);
        assert_eq!(t.sweep(5001 + ACK_WINDOW_MS, |c| l.apply(c)), 1);
        assert_eq!(l.totals(), (0, 0));
    }

    /// Answers of other transactions of the Call-ID (a PRACK, a CANCEL) do not confirm or
    /// spend it, nor do answers to a transaction-only entry.
    #[test]
    fn only_answers_of_the_pinning_request_count() {
        let t = DialogTable::new(10, 3_600_000);
        let mut l = Loads::default();
        t.put(1, 0, 7, 0, |c| l.apply(c));
        t.answered(1, 8, 200, Answerer::Likely(0), 10, |c| l.apply(c));
        t.answered(1, 8, 481, Answerer::Unknown, 10, |c| l.apply(c));
        assert!(!t.is_confirmed(1));
        assert_eq!(l.totals(), (1, 0));
        t.linger(2, 1, 0, |c| l.apply(c));
        t.answered(2, 1, 200, Answerer::Likely(1), 10, |c| l.apply(c));
        assert!(!t.is_confirmed(2));
        assert_eq!(l.totals(), (1, 0));
    }

    #[test]
    fn a_cancel_spends_a_pending_entry_and_a_crossing_2xx_still_confirms_it() {
        let t = DialogTable::new(10, 3_600_000);
        let mut l = Loads::default();
        t.put(1, 0, 1, 0, |c| l.apply(c));
        t.end(1, 100, |c| l.apply(c));
        assert_eq!(l.totals(), (0, 0));
        assert_eq!(t.get(1, 100 + ENDED_LINGER_MS), Some(0));
        // The callee answered before the CANCEL reached it (RFC 3261 §9.1).
        t.answered(1, 1, 200, Answerer::Unknown, 200, |c| l.apply(c));
        assert!(t.is_confirmed(1));
        assert_eq!(l.totals(), (0, 1));
        t.end(1, 300, |c| l.apply(c));
        assert_eq!(l.totals(), (0, 0));
    }

    /// An INVITE challenged (401 / 407) comes again with credentials and a new CSeq: the
    /// spent entry is pending again, on its member, and its 2xx confirms it.
    #[test]
    fn a_new_request_makes_a_spent_entry_pending_again() {
        let t = DialogTable::new(10, 3_600_000);
        let mut l = Loads::default();
        t.put(1, 3, 1, 0, |c| l.apply(c));
        t.answered(1, 1, 407, Answerer::Unknown, 10, |c| l.apply(c));
        // The ACK of the 407 (same CSeq) does not.
        assert_eq!(t.get_pinning(1, 1, 20, |c| l.apply(c)), Some(3));
        assert_eq!(l.totals(), (0, 0));
        assert_eq!(t.get_pinning(1, 2, 30, |c| l.apply(c)), Some(3));
        assert_eq!(l.pending[3], 1);
        assert_eq!(t.get(1, 30 + TIMER_B_MS), Some(3), "its own Timer B");
        t.answered(1, 2, 200, Answerer::Unknown, 40, |c| l.apply(c));
        assert!(t.is_confirmed(1));
        assert_eq!(l.totals(), (0, 1));
    }

    #[test]
    fn a_full_table_pushes_out_the_oldest_evictable_entry_first() {
        let t = DialogTable::new(4, 3_600_000);
        let mut l = Loads::default();
        dialog(&t, 1, 0, 0, &mut l);
        t.put(2, 1, 1, 1, |c| l.apply(c)); // pending, oldest evictable
        t.linger(3, 2, 2, |c| l.apply(c)); // spent (an OPTIONS)
        dialog(&t, 4, 3, 3, &mut l);
        assert_eq!(t.put(5, 1, 1, 4, |c| l.apply(c)), Pin::New);
        assert_eq!(t.get(2, 4), None, "the oldest evictable went");
        assert_eq!(t.evicted(), 1);
        assert_eq!(
            l.pending[1], 1,
            "its pending count closed, the new one opened"
        );
        assert_eq!(t.put(6, 2, 1, 5, |c| l.apply(c)), Pin::New);
        assert_eq!(t.get(3, 5), None);
        assert_eq!(t.put(7, 2, 1, 6, |c| l.apply(c)), Pin::New);
        assert_eq!(t.get(5, 6), None);
        assert_eq!(t.len(), 4);
        for call in [1, 4, 6, 7] {
            assert!(t.get(call, 6).is_some(), "{call}");
        }
        assert_eq!(l.totals(), (2, 2));
        assert_eq!(t.refused(), 0);
    }

    #[test]
    fn a_table_full_of_dialogs_refuses() {
        let t = DialogTable::new(2, 1000);
        let mut l = Loads::default();
        dialog(&t, 1, 0, 0, &mut l);
        dialog(&t, 2, 0, 0, &mut l);
        assert_eq!(t.put(3, 0, 1, 0, |c| l.apply(c)), Pin::Refused);
        t.linger(4, 0, 0, |c| l.apply(c));
        assert_eq!((t.len(), t.refused()), (2, 2));
        assert_eq!(t.get(3, 0), None);
        // Updating an existing dialog is always allowed.
        assert_eq!(t.put(1, 1, 2, 5, |c| l.apply(c)), Pin::Moved(0));
        assert_eq!(t.put(1, 1, 3, 6, |c| l.apply(c)), Pin::Refreshed);
        assert_eq!(t.get(1, 6), Some(1));
        assert_eq!(l.active, [1, 1, 0, 0]);
    }

    /// Many times the table's size in INVITEs with fresh Call-IDs nobody answers: every
    /// dialog stays pinned and counted, the flood's pending load stays within the table.
    #[test]
    fn a_flood_of_unanswered_invites_never_pushes_out_a_dialog() {
        let t = DialogTable::new(64, 3_600_000);
        let mut l = Loads::default();
        for call in 0..16 {
            dialog(&t, call, (call % 4) as u32, 0, &mut l);
        }
        for (i, call) in (1000..1000 + 64 * 20).enumerate() {
            let now = i as u64;
            t.put(call, (call % 4) as u32, 1, now, |c| l.apply(c));
            // A call set up in the middle of the flood gets its dialog too.
            if i == 500 {
                dialog(&t, 99, 1, now, &mut l);
            }
        }
        for call in (0..16).chain([99]) {
            assert!(t.is_confirmed(call), "{call}");
        }
        assert_eq!(t.len(), 64);
        assert_eq!(l.totals(), (64 - 17, 17));
        assert_eq!(t.refused(), 0);
        // Timer B later the flood is gone, its load with it.
        t.sweep(64 * 20 + TIMER_B_MS + 1, |c| l.apply(c));
        assert_eq!(l.totals(), (0, 17));
    }

    #[test]
    fn a_2xx_whose_entry_was_pushed_out_pins_the_dialog_to_its_sender() {
        let t = DialogTable::new(1, 3_600_000);
        let mut l = Loads::default();
        t.put(1, 0, 1, 0, |c| l.apply(c));
        t.put(2, 1, 1, 1, |c| l.apply(c));
        assert_eq!(t.get(1, 1), None);
        // From an unknown sender nothing can be pinned.
        t.answered(1, 1, 200, Answerer::Unknown, 2, |c| l.apply(c));
        assert_eq!(t.get(1, 2), None);
        t.answered(1, 1, 200, Answerer::Likely(0), 3, |c| l.apply(c));
        assert!(t.is_confirmed(1));
        assert_eq!(t.get(2, 3), None, "the younger pending entry made room");
        assert_eq!(l.totals(), (0, 1));
    }

    /// Failover: the 2xx the client gets first is the winner's, wherever the entry pointed.
    #[test]
    fn a_winning_2xx_moves_the_dialog_to_its_sender() {
        let t = DialogTable::new(10, 3_600_000);
        let mut l = Loads::default();
        t.put(1, 0, 1, 0, |c| l.apply(c));
        assert_eq!(t.put(1, 1, 1, 10, |c| l.apply(c)), Pin::Moved(0));
        assert_eq!(l.pending, [0, 1, 0, 0]);
        t.answered(1, 1, 200, Answerer::Winner(0), 20, |c| l.apply(c));
        assert_eq!(t.get(1, 20), Some(0));
        assert_eq!((l.pending, l.active), ([0; 4], [1, 0, 0, 0]));
        // A stateless answer never moves a dialog.
        t.answered(1, 1, 200, Answerer::Likely(1), 30, |c| l.apply(c));
        assert_eq!(t.get(1, 30), Some(0));
    }

    #[test]
    fn ended_dialogs_linger_then_expire_without_double_close() {
        let t = DialogTable::new(10, 3_600_000);
        let mut l = Loads::default();
        dialog(&t, 7, 1, 1000, &mut l);
        t.end(7, 2000, |c| l.apply(c));
        t.end(7, 2001, |c| l.apply(c));
        assert_eq!(l.totals(), (0, 0));
        assert_eq!(t.get(7, 2000 + ENDED_LINGER_MS), Some(1));
        assert_eq!(t.get(7, 2001 + ENDED_LINGER_MS), None);
        assert_eq!(t.sweep(2001 + ENDED_LINGER_MS, |c| l.apply(c)), 1);
        assert_eq!(l.totals(), (0, 0));
    }

    #[test]
    fn migration_renumbers_carries_states_and_drops_removed_members() {
        let old = DialogTable::new(10, 1000);
        let mut l = Loads::default();
        dialog(&old, 1, 0, 0, &mut l);
        dialog(&old, 2, 1, 0, &mut l);
        dialog(&old, 3, 2, 0, &mut l);
        old.end(3, 0, |c| l.apply(c));
        old.put(4, 2, 1, 0, |c| l.apply(c));
        let new = DialogTable::new(10, 1000);
        // Member 0 removed; 1 -> 0, 2 -> 1.
        let moved = old.migrate_to(&new, 10, |m| m.checked_sub(1));
        let mut counted = moved.counted.clone();
        counted.sort_by_key(|(m, _)| *m);
        assert_eq!(counted, vec![(0, Count::Active), (1, Count::Pending)]);
        assert!(moved.refused_counted.is_empty());
        assert_eq!(new.get(1, 10), None);
        assert!(new.is_confirmed(2));
        assert_eq!(new.get(3, 10), Some(1), "ended dialogs keep lingering");
        assert!(!new.is_confirmed(4), "still pending");
        let mut nl = Loads::default();
        new.answered(4, 1, 200, Answerer::Unknown, 20, |c| nl.apply(c));
        assert!(new.is_confirmed(4));
        assert_eq!((nl.pending[1], nl.active[1]), (-1, 1));
    }

    /// A smaller table takes the dialogs first, and pending entries in the order they
    /// expire; what it had no room for is reported.
    #[test]
    fn migration_into_a_smaller_table_keeps_dialogs_first() {
        let old = DialogTable::new(10, 3_600_000);
        let mut l = Loads::default();
        for call in 0..4 {
            old.put(100 + call, 0, 1, call, |c| l.apply(c));
        }
        dialog(&old, 1, 0, 0, &mut l);
        dialog(&old, 2, 1, 0, &mut l);
        let new = DialogTable::new(3, 3_600_000);
        let moved = old.migrate_to(&new, 10, Some);
        assert!(new.is_confirmed(1) && new.is_confirmed(2));
        assert!(new.get(100, 10).is_some(), "the oldest pending entry");
        assert_eq!(moved.refused_counted, vec![(0, Count::Pending); 3]);
        // The new table's eviction order follows the old one's.
        let mut nl = Loads::default();
        new.put(200, 1, 1, 20, |c| nl.apply(c));
        assert_eq!(new.get(100, 20), None);
        assert!(new.is_confirmed(1) && new.is_confirmed(2));
    }

    /// What happens in the old table between the migration and the switch is carried over
    /// by the catch-up pass; what happened in the new table since is not undone.
    #[test]
    fn catch_up_carries_pins_answers_ends_and_moves_made_after_the_migration() {
        let old = DialogTable::new(10, 1000);
        let mut l = Loads::default();
        dialog(&old, 1, 0, 0, &mut l); // stays as it is
        dialog(&old, 2, 0, 0, &mut l); // ends in the old table after the migration
        dialog(&old, 3, 0, 0, &mut l); // moves in the old table after the migration
        dialog(&old, 4, 0, 0, &mut l); // moves in the new table after the switch
        old.put(8, 0, 1, 0, |c| l.apply(c)); // confirmed in the old table afterwards
        old.put(9, 0, 1, 0, |c| l.apply(c)); // refused in the old table afterwards
        let new = DialogTable::new(10, 1000);
        let first = old.migrate_to(&new, 10, Some);
        assert_eq!(first.counted.len(), 6);
        // Between the migration and the switch, on the old table:
        dialog(&old, 5, 1, 20, &mut l);
        old.end(2, 21, |c| l.apply(c));
        old.put(3, 1, 2, 22, |c| l.apply(c));
        dialog(&old, 6, 0, 23, &mut l);
        old.end(6, 24, |c| l.apply(c));
        old.answered(8, 1, 200, Answerer::Unknown, 25, |c| l.apply(c));
        old.answered(9, 1, 603, Answerer::Unknown, 26, |c| l.apply(c));
        // After the switch, on the new table:
        new.put(4, 1, 2, 30, |c| l.apply(c));
        let done = old.catch_up_to(&new, &first, 40, Some);
        assert_eq!(done.opened, vec![(1, Count::Active)]);
        let mut changed = done.changed.clone();
        changed.sort_by_key(|c| format!("{c:?}"));
        let mut want = vec![
            Change::Close(0, Count::Active), // 2 ended
            Change::Close(0, Count::Active), // 3 moved
            Change::Open(1, Count::Active),
            Change::Close(0, Count::Pending), // 8 confirmed
            Change::Open(0, Count::Active),
            Change::Close(0, Count::Pending), // 9 refused
        ];
        want.sort_by_key(|c| format!("{c:?}"));
        assert_eq!(changed, want);
        assert!(done.refused_counted.is_empty() && done.doubled.is_empty());
        assert_eq!(new.get(5, 40), Some(1));
        assert_eq!(new.get(3, 40), Some(1));
        assert_eq!(new.get(4, 40), Some(1), "the new table's own move is kept");
        assert_eq!(new.get(1, 40), Some(0));
        assert!(new.is_confirmed(8));
        assert!(
            !new.is_confirmed(9) && new.get(9, 40).is_some(),
            "spent, for its ACK"
        );
        let mut nl = Loads::default();
        new.end(2, 40, |c| nl.apply(c));
        new.end(6, 40, |c| nl.apply(c));
        assert_eq!(nl.totals(), (0, 0), "already ended");
        assert_eq!(new.get(6, 40), Some(0));
        // Four open dialogs migrated (1 to 4), one ended since (2), one confirmed (8), one
        // made (5).
        assert_eq!(done.kept(&first), 5);
    }

    /// During the hand-over (after the switch, before the catch-up), the new table takes a
    /// dialog set up on the old table after the migration when a message of it comes, and
    /// brings a migrated entry up to date with what the old table did since (its 2xx): the
    /// ACK and BYE the new table handles find each dialog on its renumbered member, and the
    /// BYE closes the count the old table opened. The catch-up then has nothing left to do.
    /// The counters are shared by both tables (by service), as a sip-tcp rebuild keeps them.
    #[test]
    fn the_new_table_takes_what_the_old_one_did_before_the_catch_up() {
        // The reload put a service in front: old member m is new member m + 1.
        let shift = |m: u32| Some(m + 1);
        let by_service = |c: Change| match c {
            Change::Open(m, k) => Change::Open(m + 1, k),
            Change::Close(m, k) => Change::Close(m + 1, k),
        };
        let old = DialogTable::new(10, 1000);
        let mut l = Loads::default();
        old.put(1, 0, 1, 0, |c| l.apply(by_service(c)));
        let new = DialogTable::new(10, 1000);
        let first = old.migrate_to(&new, 10, shift);
        // On the old table, after the migration: call 2 set up, call 1 answered.
        old.put(2, 1, 1, 20, |c| l.apply(by_service(c)));
        old.answered(2, 1, 200, Answerer::Unknown, 20, |c| l.apply(by_service(c)));
        old.answered(1, 1, 200, Answerer::Unknown, 21, |c| l.apply(by_service(c)));
        assert_eq!((l.pending, l.active), ([0; 4], [0, 1, 1, 0]));
        // On the new table, before the catch-up: unknown there, or pending.
        assert_eq!(new.get(2, 30), None);
        assert!(!new.is_confirmed(1));
        let mut changed = Vec::new();
        // The ACK of call 2.
        let taken = new.pull_from(&old, 2, 30, shift, &first.copied_keys, &mut changed);
        assert_eq!(taken, Some((2, Some(Count::Active))));
        assert_eq!(new.get(2, 30), Some(2));
        // The BYE of call 1: its 2xx is carried first (counted already, on the shared
        // counters), then it ends.
        new.pull_from(&old, 1, 31, shift, &first.copied_keys, &mut changed);
        assert!(new.is_confirmed(1));
        assert_eq!(
            changed,
            [
                Change::Close(1, Count::Pending),
                Change::Open(1, Count::Active)
            ]
        );
        new.end(1, 31, |c| l.apply(c));
        // The BYE of call 2.
        new.pull_from(&old, 2, 32, shift, &first.copied_keys, &mut changed);
        new.end(2, 32, |c| l.apply(c));
        assert_eq!(changed.len(), 2, "nothing more to carry");
        assert_eq!(l.totals(), (0, 0), "{l:?}");
        let done = old.catch_up_to(&new, &first, 40, shift);
        assert!(
            done.opened.is_empty() && done.changed.is_empty() && done.doubled.is_empty(),
            "{done:?}"
        );
        assert_eq!(done.pulled, [(2, Count::Active)]);
        assert_eq!(new.get(1, 40), Some(1), "ended, lingering");
        assert!(!new.is_confirmed(1) && !new.is_confirmed(2));
    }

    /// A dialog pinned in the old table after the migration whose next request reached the
    /// new table first (and was pinned there) is reported as pinned twice; the new pin stays.
    #[test]
    fn catch_up_reports_entries_made_on_both_sides() {
        let old = DialogTable::new(10, 1000);
        let new = DialogTable::new(10, 1000);
        let mut l = Loads::default();
        let first = old.migrate_to(&new, 0, Some);
        old.put(7, 1, 1, 5, |c| l.apply(c));
        new.put(7, 2, 1, 6, |c| l.apply(c));
        let done = old.catch_up_to(&new, &first, 7, Some);
        assert_eq!(done.doubled, vec![(1, Count::Pending)]);
        assert!(done.opened.is_empty() && done.changed.is_empty());
        assert_eq!(new.get(7, 7), Some(2));
    }

    #[test]
    fn catch_up_reports_entries_the_new_table_has_no_room_for() {
        let old = DialogTable::new(10, 1000);
        let mut l = Loads::default();
        dialog(&old, 1, 0, 0, &mut l);
        dialog(&old, 2, 1, 0, &mut l);
        let new = DialogTable::new(1, 1000);
        let first = old.migrate_to(&new, 0, Some);
        assert_eq!(first.refused_keys.len(), 1, "one of the two had no room");
        dialog(&old, 3, 2, 5, &mut l);
        let done = old.catch_up_to(&new, &first, 6, Some);
        assert_eq!(
            done.refused_counted,
            vec![(2, Count::Active)],
            "only the later pin; the first is not reported twice"
        );
        assert!(done.opened.is_empty());
        assert_eq!(new.refused(), 2);
    }

    #[test]
    fn catch_up_pushes_out_pending_entries_for_the_old_tables_dialogs() {
        let old = DialogTable::new(10, 3_600_000);
        let new = DialogTable::new(1, 3_600_000);
        let mut l = Loads::default();
        let first = old.migrate_to(&new, 0, Some);
        new.put(1, 0, 1, 1, |c| l.apply(c));
        dialog(&old, 2, 1, 2, &mut l);
        let done = old.catch_up_to(&new, &first, 3, Some);
        assert_eq!(done.pushed_out, vec![Change::Close(0, Count::Pending)]);
        assert_eq!(done.opened, vec![(1, Count::Active)]);
        assert!(new.is_confirmed(2));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Invite(u8),
        Options(u8),
        Ok(u8),
        Fail(u8),
        Bye(u8),
        Wait(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..40).prop_map(Op::Invite),
            1 => (0u8..40).prop_map(Op::Options),
            2 => (0u8..40).prop_map(Op::Ok),
            1 => (0u8..40).prop_map(Op::Fail),
            1 => (0u8..40).prop_map(Op::Bye),
            1 => (0u16..20_000).prop_map(Op::Wait),
        ]
    }

    proptest! {
        /// Against a model: an insert into a full table pushes out the oldest evictable
        /// entry still in the ring (the last `ring` evictable entries made), never a dialog;
        /// it is refused only when no such entry is left; the counts the caller keeps
        /// always equal the pending and open entries held.
        #[test]
        fn eviction_takes_the_oldest_evictable_entry_and_never_a_dialog(
            ops in proptest::collection::vec(op(), 1..300),
        ) {
            const MAX: usize = 6;
            let t = DialogTable::new(MAX, 3_600_000);
            let ring = MAX.next_power_of_two();
            let mut l = Loads::default();
            let mut now = 0u64;
            // The evictable entries in the order they were made (key, index), the last `ring`;
            // and the index of each key's entry now.
            let mut order: std::collections::VecDeque<(u64, u64)> = Default::default();
            let mut made: std::collections::HashMap<u64, u64> = Default::default();
            let mut index = 0u64;
            let mut open: std::collections::HashSet<u64> = Default::default();
            // Keys that became dialogs (open or ended), while the table holds them.
            let mut dialogs: std::collections::HashSet<u64> = Default::default();
            for op in ops {
                match op {
                    Op::Invite(k) | Op::Options(k) => {
                        let k = u64::from(k);
                        t.sweep(now, |c| l.apply(c));
                        if t.get(k, now).is_some() {
                            continue;
                        }
                        let full = t.len() >= MAX;
                        dialogs.remove(&k);
                        let live = |(key, i): &(u64, u64)| {
                            !dialogs.contains(key) && made.get(key) == Some(i)
                                && t.get(*key, now).is_some()
                        };
                        let victim = if full {
                            order.iter().copied().find(|k| live(k))
                        } else {
                            None
                        };
                        let before = t.len();
                        if matches!(op, Op::Invite(_)) {
                            let pin = t.put(k, (k % 4) as u32, 1, now, |c| l.apply(c));
                            prop_assert_eq!(pin == Pin::Refused, full && victim.is_none());
                        } else {
                            t.linger(k, (k % 4) as u32, now, |c| l.apply(c));
                        }
                        if let Some(v) = victim {
                            prop_assert_eq!(t.get(v.0, now), None, "the oldest evictable went");
                            let at = order.iter().position(|x| *x == v).unwrap_or(0);
                            order.drain(..=at);
                            prop_assert_eq!(t.len(), before);
                        } else if full {
                            // Refused: the ring was read to its end.
                            order.clear();
                        }
                        if t.get(k, now).is_some() {
                            order.push_back((k, index));
                            made.insert(k, index);
                            index += 1;
                            while order.len() > ring {
                                order.pop_front();
                            }
                        }
                    }
                    Op::Ok(k) => {
                        let k = u64::from(k);
                        t.answered(k, 1, 200, Answerer::Unknown, now, |c| l.apply(c));
                        if t.is_confirmed(k) {
                            open.insert(k);
                            dialogs.insert(k);
                        }
                    }
                    Op::Fail(k) => {
                        t.answered(u64::from(k), 1, 486, Answerer::Unknown, now, |c| l.apply(c));
                    }
                    Op::Bye(k) => {
                        let k = u64::from(k);
                        t.end(k, now, |c| l.apply(c));
                        open.remove(&k);
                    }
                    Op::Wait(ms) => {
                        now += u64::from(ms);
                        // Expired dialogs are gone (their BYE was lost): the model forgets them.
                        t.sweep(now, |c| l.apply(c));
                        open.retain(|k| t.is_confirmed(*k));
                        dialogs.retain(|k| t.get(*k, now).is_some());
                    }
                }
                for k in &open {
                    prop_assert!(t.is_confirmed(*k), "dialog {} pushed out", k);
                }
                prop_assert!(t.len() <= MAX);
                let pending = t.map.iter().filter(|e| e.state() == State::Pending).count();
                let active = t.map.iter().filter(|e| e.state() == State::Open).count();
                prop_assert_eq!(l.totals(), (pending as i64, active as i64));
                prop_assert!(l.pending.iter().chain(&l.active).all(|&v| v >= 0));
            }
        }
    }
}
