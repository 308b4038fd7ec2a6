//! Eviction under pressure (docs/limits.md): when the process's file pool runs low, a new
//! client connection first closes an idle one, those that never completed a request before
//! any that did, the longest idle first. The pool is the process's, so the idle connection may
//! be any vserver's: a sip-tls vserver's new client makes room by closing a silent connection
//! held on a tcp vserver, or an idle udp session. Every evictable client of the process is in
//! one [`crate::victims::VictimIndex`] ([`Evictors`]), so a choice costs O(log n), never a look
//! at every connection. IO: the registries hold the connections' tasks, to abort the chosen
//! ones.

use crate::budget::{Activity, Admission, FileBudget, Gate, Refusal, SourceSlot};
use crate::stats::LogLimiter;
use crate::sync::lock;
use crate::victims::VictimIndex;
use dashmap::DashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// How long a new client refused for want of files waits, at most, for an evicted one's
/// files to come back (an aborted task gives them back when it is next polled, a udp worker
/// when it next wakes). The wait is in the new client's own task, never in an accept loop.
pub(crate) const EVICTION_WAIT: Duration = Duration::from_millis(50);

/// What [`admit_evicting`] admitted.
#[derive(Debug)]
pub(crate) enum Admitted {
    /// Its files were there.
    Now(Admission),
    /// An idle client was evicted for it; its files are taken once the evicted one's come
    /// back ([`Pending::files`], in the new client's task).
    Pending(Pending),
}

/// A client admitted by its source's limit whose files are on their way back from an
/// eviction.
#[derive(Debug)]
pub(crate) struct Pending {
    source: Option<SourceSlot>,
    budget: Arc<FileBudget>,
    files: u64,
}

impl Pending {
    /// Its files, once the pool has them again, or a refusal (counted on `gate`) after
    /// [`EVICTION_WAIT`]. Woken by every file given back while it waits; the timeout also
    /// covers a wake-up missed between its look at the pool and its wait.
    pub(crate) async fn files(self, gate: &Gate) -> Result<Admission, Refusal> {
        let deadline = tokio::time::Instant::now() + EVICTION_WAIT;
        let _waiting = self.budget.waiter();
        loop {
            let freed = self.budget.freed();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(files) = self.budget.permit_uncounted(self.files) {
                return Ok(Admission {
                    files,
                    source: self.source,
                });
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                self.budget.count_refusal();
                return Err(gate.refused_for_files());
            }
        }
    }
}

impl Admitted {
    /// The admission, waiting for an evicted client's files when there was one.
    pub(crate) async fn files(self, gate: &Gate) -> Result<Admission, Refusal> {
        match self {
            Admitted::Now(a) => Ok(a),
            Admitted::Pending(p) => p.files(gate).await,
        }
    }
}

/// Admit a new client from `ip` through `gate`: its source's limit first (a source at its
/// limit is refused without costing anyone a connection), then the files. While the
/// process's file pool runs low, a client its source's limit admits first makes room:
/// `evict` closes one idle client and says how many it closed; a new client whose files are
/// not there yet is then [`Admitted::Pending`]. Never waits: accept loops call it.
pub(crate) fn admit_evicting(
    gate: &Gate,
    ip: IpAddr,
    evict: impl FnOnce() -> usize,
) -> Result<Admitted, Refusal> {
    let source = gate.admit_source(ip)?;
    admit_files(gate, Some(source), evict)
}

/// [`admit_evicting`] for a connection from one of the vserver's own members (a service
/// opening a flow toward fulcrum): no source limit; it may make room like a client.
pub(crate) fn admit_member(
    gate: &Gate,
    evict: impl FnOnce() -> usize,
) -> Result<Admitted, Refusal> {
    admit_files(gate, None, evict)
}

fn admit_files(
    gate: &Gate,
    source: Option<SourceSlot>,
    evict: impl FnOnce() -> usize,
) -> Result<Admitted, Refusal> {
    let evicted = gate.budget().is_low() && evict() > 0;
    match gate.budget().permit_uncounted(gate.files()) {
        Some(files) => Ok(Admitted::Now(Admission { files, source })),
        None if evicted => Ok(Admitted::Pending(Pending {
            source,
            budget: Arc::clone(gate.budget()),
            files: gate.files(),
        })),
        None => {
            gate.budget().count_refusal();
            Err(gate.refused_for_files())
        }
    }
}

/// A vserver's client connections as the process-wide eviction sees them.
pub(crate) trait IdleClients: Send + Sync {
    /// Close its client `id` to make room at `now` (the runtime's clock, for the log), if it
    /// is still open; whether it was.
    fn evict_one(&self, id: u64, now: crate::stats::Nanos) -> bool;
    /// Give back its tables' spare room once most of their entries are gone (after a burst
    /// of connections closed; rare: each shrink rehashes what is left).
    fn shrink(&self);
}

/// Shrink `map` when it holds under a quarter of what it has room for: a table grown by a
/// burst of 20,000 connections keeps its room otherwise (a few MB).
pub(crate) fn shrink_spare<K: Eq + std::hash::Hash, V>(map: &DashMap<K, V>) {
    if map.capacity() > 1024 && map.len() * 4 < map.capacity() {
        map.shrink_to_fit();
    }
}

/// Every evictable client of the process, in eviction order, and every vserver's registry
/// (for [`Evictors::shrink`]). A vserver's entry goes with it.
#[derive(Default)]
pub(crate) struct Evictors {
    all: Mutex<Vec<Weak<dyn IdleClients>>>,
    index: Mutex<VictimIndex<Victim>>,
    next: AtomicU64,
}

/// An indexed client: who closes it, under which of its ids, and its activity (read for its
/// true rank).
struct Victim {
    table: Weak<dyn IdleClients>,
    local: u64,
    activity: Arc<Activity>,
}

impl std::fmt::Debug for Evictors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Evictors")
            .field("vservers", &lock(&self.all).len())
            .field("clients", &lock(&self.index).len())
            .finish()
    }
}

impl Evictors {
    /// Count `v`'s registry among those [`Evictors::shrink`] shrinks while it exists.
    pub(crate) fn add(&self, v: Weak<dyn IdleClients>) {
        let mut all = lock(&self.all);
        all.retain(|w| w.strong_count() > 0);
        all.push(v);
    }

    /// Make client `local` of `table` evictable, ranked by `activity`, until the returned
    /// ticket is dropped (with the client's entry in its registry).
    pub(crate) fn enter(
        self: &Arc<Self>,
        table: Weak<dyn IdleClients>,
        local: u64,
        activity: Arc<Activity>,
    ) -> Ticket {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let rank = activity.rank();
        lock(&self.index).insert(
            id,
            rank,
            Victim {
                table,
                local,
                activity,
            },
        );
        Ticket {
            evictors: Arc::clone(self),
            id,
        }
    }

    /// Close the client to evict first among every vserver's ([`VictimIndex::pop_victim`]);
    /// how many were closed (0 or 1). The index is locked for the choice only: the client is
    /// closed once it is released (closing drops tickets, which lock it again).
    pub(crate) fn evict(&self, now: crate::stats::Nanos) -> usize {
        loop {
            let Some((_, v)) = lock(&self.index).pop_victim(|v| v.activity.rank()) else {
                return 0;
            };
            // One that ended meanwhile, or whose vserver is gone: the next.
            if v.table.upgrade().is_some_and(|t| t.evict_one(v.local, now)) {
                return 1;
            }
        }
    }

    /// Clients indexed now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        lock(&self.index).len()
    }

    /// The vservers that still exist (the others' entries are dropped).
    fn live(&self) -> Vec<Arc<dyn IdleClients>> {
        let mut all = lock(&self.all);
        all.retain(|w| w.strong_count() > 0);
        all.iter().filter_map(Weak::upgrade).collect()
    }

    /// Shrink every vserver's connection tables ([`IdleClients::shrink`]).
    pub(crate) fn shrink(&self) {
        for s in self.live() {
            s.shrink();
        }
    }
}

/// A client's place in the [`Evictors`]' index, given up when dropped.
pub(crate) struct Ticket {
    evictors: Arc<Evictors>,
    id: u64,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket").field("id", &self.id).finish()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        lock(&self.evictors.index).remove(self.id);
    }
}

/// The client connections of a vserver that may be evicted: each one's activity and task.
/// Shared by the vserver's workers and kept across reloads.
#[derive(Debug, Default)]
pub(crate) struct Evictable {
    /// The vserver's name, for the log.
    name: String,
    conns: DashMap<u64, (tokio::task::AbortHandle, Ticket)>,
    next: AtomicU64,
    /// Connections closed to make room.
    pub evicted: AtomicU64,
    log: LogLimiter,
}

impl IdleClients for Evictable {
    fn evict_one(&self, id: u64, now: crate::stats::Nanos) -> bool {
        let Some((_, (abort, _ticket))) = self.conns.remove(&id) else {
            return false;
        };
        // A task that ended on its own gave its files back already.
        if abort.is_finished() {
            return false;
        }
        abort.abort();
        self.evicted.fetch_add(1, Ordering::Relaxed);
        if self.log.allow(now) {
            tracing::info!(vserver = %self.name, "idle connection evicted: the open-file pool runs low");
        }
        true
    }

    fn shrink(&self) {
        self.conns.retain(|_, (abort, _)| !abort.is_finished());
        shrink_spare(&self.conns);
    }
}

impl Evictable {
    /// The registry of vserver `name`'s connections.
    pub(crate) fn named(name: &str) -> Evictable {
        Evictable {
            name: name.to_owned(),
            ..Evictable::default()
        }
    }

    /// The id of a connection about to be registered (its task's [`Registration`] names it).
    pub(crate) fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// Register connection `id`'s task (`abort`), evictable by `evictors` by its `activity`
    /// while it is registered.
    pub(crate) fn register(
        self: &Arc<Self>,
        evictors: &Arc<Evictors>,
        id: u64,
        activity: Arc<Activity>,
        abort: tokio::task::AbortHandle,
    ) {
        let me: Weak<dyn IdleClients> = Arc::downgrade(self) as Weak<Evictable>;
        let ticket = evictors.enter(me, id, activity);
        self.conns.insert(id, (abort, ticket));
    }
}

/// A connection's place in its vserver's [`Evictable`], given up when its task ends.
pub(crate) struct Registration {
    pub table: Arc<Evictable>,
    pub id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.table.conns.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{FileBudget, Needs};

    /// A pool with `free` files left of which all but the reserve are taken: low.
    fn low_pool() -> Arc<FileBudget> {
        let b = Arc::new(FileBudget::new(1_000, &Needs::default()));
        while b.take(1) {}
        assert!(b.is_low());
        b
    }

    /// A source at its limit is refused before anything is evicted: one source retrying
    /// cannot close a legitimate connection per attempt.
    #[test]
    fn a_source_at_its_limit_evicts_nothing() {
        let gate = Gate::new(low_pool(), 1, Some(1));
        let ip: IpAddr = "192.0.2.7".parse().expect("ip");
        let held = gate.admit_source(ip).expect("its first connection");
        let evicted = std::sync::atomic::AtomicUsize::new(0);
        for _ in 0..5 {
            let r = admit_evicting(&gate, ip, || {
                evicted.fetch_add(1, Ordering::Relaxed);
                1
            });
            assert_eq!(r.err(), Some(Refusal::PerSource));
        }
        assert_eq!(evicted.load(Ordering::Relaxed), 0);
        drop(held);
        // Another source, admitted by its limit, makes room on a low pool.
        let other: IpAddr = "192.0.2.8".parse().expect("ip");
        let r = admit_evicting(&gate, other, || {
            evicted.fetch_add(1, Ordering::Relaxed);
            0
        });
        assert_eq!(evicted.load(Ordering::Relaxed), 1);
        assert_eq!(r.err(), Some(Refusal::Budget), "nothing was freed");
        assert_eq!(gate.refusals()[0], (Refusal::Budget, 1));
    }

    /// The accept loop never waits: a client for which one was evicted is admitted pending,
    /// and waits in its own task for the evicted one's file, or is refused after
    /// [`EVICTION_WAIT`] when none comes back.
    #[tokio::test(start_paused = true)]
    async fn a_client_waits_for_an_evicted_ones_file_in_its_own_task() {
        let pool = low_pool();
        let gate = Gate::new(Arc::clone(&pool), 1, None);
        let ip: IpAddr = "192.0.2.9".parse().expect("ip");
        let Ok(Admitted::Pending(p)) = admit_evicting(&gate, ip, || 1) else {
            panic!("no file was free: pending");
        };
        let t0 = tokio::time::Instant::now();
        let (got, ()) = tokio::join!(p.files(&gate), async {
            tokio::task::yield_now().await;
            // The evicted client's task ends: its file comes back.
            pool.give_back(1);
        });
        assert!(got.is_ok(), "{got:?}");
        assert!(t0.elapsed() < EVICTION_WAIT, "woken, not timed out");
        let Ok(Admitted::Pending(p)) = admit_evicting(&gate, ip, || 1) else {
            panic!("no file was free: pending");
        };
        assert_eq!(p.files(&gate).await.err(), Some(Refusal::Budget));
        assert!(t0.elapsed() >= EVICTION_WAIT);
        assert_eq!(gate.refusals()[0], (Refusal::Budget, 1));
        drop(got);
        // With a file free, admitted at once.
        assert!(matches!(
            admit_evicting(&gate, ip, || 0),
            Ok(Admitted::Now(_))
        ));
    }

    /// A registry that records what it was asked to close; `gone` ended on its own.
    struct Fake {
        evicted: Mutex<Vec<u64>>,
        gone: u64,
    }

    impl IdleClients for Fake {
        fn evict_one(&self, id: u64, _now: crate::stats::Nanos) -> bool {
            if id == self.gone {
                return false;
            }
            lock(&self.evicted).push(id);
            true
        }

        fn shrink(&self) {}
    }

    /// Clients of every vserver are evicted in one order: the unproven first, the longest
    /// idle first; one that ended meanwhile is passed over, one whose ticket was dropped is
    /// not in the index any more.
    #[test]
    fn every_vservers_clients_are_evicted_in_one_order() {
        let ev = Arc::new(Evictors::default());
        let (a, b) = (
            Arc::new(Fake {
                evicted: Mutex::new(Vec::new()),
                gone: 2,
            }),
            Arc::new(Fake {
                evicted: Mutex::new(Vec::new()),
                gone: 0,
            }),
        );
        let wa: Weak<dyn IdleClients> = Arc::downgrade(&a) as Weak<Fake>;
        let wb: Weak<dyn IdleClients> = Arc::downgrade(&b) as Weak<Fake>;
        let ms = |n: u64| n * 1_000_000;
        let act = |at: u64, proven: bool| {
            let x = Arc::new(Activity::new(at));
            x.touch(at, proven);
            x
        };
        let _t = [
            ev.enter(wa.clone(), 1, act(ms(5), false)),
            ev.enter(wa.clone(), 2, act(ms(1), false)),
            ev.enter(wb.clone(), 1, act(0, true)),
            ev.enter(wb.clone(), 2, act(ms(9), false)),
        ];
        let dropped = ev.enter(wa, 3, act(ms(2), false));
        assert_eq!(ev.len(), 5);
        drop(dropped);
        assert_eq!(ev.len(), 4);
        let mut n = 0;
        while ev.evict(0) == 1 {
            n += 1;
        }
        assert_eq!(n, 3);
        assert_eq!(*lock(&a.evicted), [1]);
        assert_eq!(*lock(&b.evicted), [2, 1]);
        assert_eq!(ev.len(), 0);
    }

    #[test]
    fn a_table_emptied_after_a_burst_gives_its_room_back_and_a_full_one_keeps_it() {
        let map: DashMap<u64, [u8; 64]> = DashMap::new();
        for i in 0..20_000 {
            map.insert(i, [0; 64]);
        }
        let grown = map.capacity();
        shrink_spare(&map);
        assert_eq!(map.capacity(), grown, "full: nothing to give back");
        map.retain(|k, _| *k < 100);
        shrink_spare(&map);
        assert!(map.capacity() < grown / 16, "{} of {grown}", map.capacity());
        assert_eq!(map.len(), 100);
    }
}
