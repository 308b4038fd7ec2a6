//! Eviction under pressure (docs/limits.md): when the process's file pool runs low, a new
//! client connection first closes an idle one, those that never completed a request before
//! any that did, the longest idle first ([`crate::budget::first_victim`]). The pool is the
//! process's, so the idle connection may be any vserver's ([`Evictors`]): a sip-tls vserver's
//! new client makes room by closing a silent connection held on a tcp vserver. IO: the
//! registries hold the connections' tasks, to abort the chosen ones.

use crate::budget::{Activity, Admission, Gate, Refusal};
use crate::stats::LogLimiter;
use crate::sync::lock;
use dashmap::DashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// How long a new connection refused for want of files waits, at most, for an evicted one's
/// files to come back (its task gives them back when it is next polled), in steps.
pub(crate) const EVICTION_WAIT_STEPS: usize = 10;
pub(crate) const EVICTION_WAIT_STEP: Duration = Duration::from_millis(5);

/// Admit a new client from `ip` through `gate`: its source's limit first (a source at its
/// limit is refused without costing anyone a connection), then the files. While the
/// process's file pool runs low, a client its source's limit admits first makes room:
/// `evict` closes one idle connection and says how many it closed; a new client then refused
/// for want of files waits a little for the evicted one's file to come back.
pub(crate) async fn admit_evicting(
    gate: &Gate,
    ip: IpAddr,
    evict: impl FnOnce() -> usize,
) -> Result<Admission, Refusal> {
    let source = gate.admit_source(ip)?;
    let evicted = gate.budget().is_low() && evict() > 0;
    let mut files = gate.budget().permit(gate.files());
    if evicted {
        for _ in 0..EVICTION_WAIT_STEPS {
            if files.is_some() {
                break;
            }
            tokio::time::sleep(EVICTION_WAIT_STEP).await;
            files = gate.budget().permit(gate.files());
        }
    }
    match files {
        Some(files) => Ok(Admission {
            files,
            source: Some(source),
        }),
        None => Err(gate.refused_for_files()),
    }
}

/// A vserver's client connections as the process-wide eviction sees them.
pub(crate) trait IdleClients: Send + Sync {
    /// Its connection to evict first: ([`Activity::rank`], id).
    fn first_victim(&self) -> Option<((u8, u64), u64)>;
    /// Close connection `id` to make room at `now` (the runtime's clock, for the log), if it
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

/// Every vserver's evictable client connections. A vserver's entry goes with it.
#[derive(Default)]
pub(crate) struct Evictors {
    all: Mutex<Vec<Weak<dyn IdleClients>>>,
}

impl std::fmt::Debug for Evictors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Evictors")
            .field("vservers", &lock(&self.all).len())
            .finish()
    }
}

impl Evictors {
    /// Count `v`'s connections among the candidates while it exists.
    pub(crate) fn add(&self, v: Weak<dyn IdleClients>) {
        let mut all = lock(&self.all);
        all.retain(|w| w.strong_count() > 0);
        all.push(v);
    }

    /// Close the connection to evict first among every vserver's (each vserver's first
    /// victim, compared by [`Activity::rank`]); how many were closed (0 or 1). Looks at every
    /// connection, so it runs only while the pool runs low.
    pub(crate) fn evict(&self, now: crate::stats::Nanos) -> usize {
        let sources = self.live();
        let mut firsts: Vec<((u8, u64), usize, u64)> = sources
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.first_victim().map(|(rank, id)| (rank, i, id)))
            .collect();
        firsts.sort_unstable();
        for (_, i, id) in firsts {
            // One that ended meanwhile: the next vserver's first victim.
            if sources.get(i).is_some_and(|s| s.evict_one(id, now)) {
                return 1;
            }
        }
        0
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

/// The client connections of a vserver that may be evicted: each one's activity and task.
/// Shared by the vserver's workers and kept across reloads.
#[derive(Debug, Default)]
pub(crate) struct Evictable {
    /// The vserver's name, for the log.
    name: String,
    conns: DashMap<u64, (Arc<Activity>, tokio::task::AbortHandle)>,
    next: AtomicU64,
    /// Connections closed to make room.
    pub evicted: AtomicU64,
    log: LogLimiter,
}

impl IdleClients for Evictable {
    fn first_victim(&self) -> Option<((u8, u64), u64)> {
        self.conns.retain(|_, (_, abort)| !abort.is_finished());
        crate::budget::first_victim(self.conns.iter().map(|e| (*e.key(), e.value().0.rank())))
    }

    fn evict_one(&self, id: u64, now: crate::stats::Nanos) -> bool {
        let Some((_, (_, abort))) = self.conns.remove(&id) else {
            return false;
        };
        abort.abort();
        self.evicted.fetch_add(1, Ordering::Relaxed);
        if self.log.allow(now) {
            tracing::info!(vserver = %self.name, "idle connection evicted: the open-file pool runs low");
        }
        true
    }

    fn shrink(&self) {
        self.conns.retain(|_, (_, abort)| !abort.is_finished());
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

    /// Register connection `id`'s task (`abort`) and activity.
    pub(crate) fn register(
        &self,
        id: u64,
        activity: Arc<Activity>,
        abort: tokio::task::AbortHandle,
    ) {
        self.conns.insert(id, (activity, abort));
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
    #[tokio::test]
    async fn a_source_at_its_limit_evicts_nothing() {
        let gate = Gate::new(low_pool(), 1, Some(1));
        let ip: IpAddr = "192.0.2.7".parse().expect("ip");
        let held = gate.admit_source(ip).expect("its first connection");
        let evicted = std::sync::atomic::AtomicUsize::new(0);
        for _ in 0..5 {
            let r = admit_evicting(&gate, ip, || {
                evicted.fetch_add(1, Ordering::Relaxed);
                1
            })
            .await;
            assert_eq!(r.err(), Some(Refusal::PerSource));
        }
        assert_eq!(evicted.load(Ordering::Relaxed), 0);
        drop(held);
        // Another source, admitted by its limit, makes room on a low pool.
        let other: IpAddr = "192.0.2.8".parse().expect("ip");
        let r = admit_evicting(&gate, other, || {
            evicted.fetch_add(1, Ordering::Relaxed);
            0
        })
        .await;
        assert_eq!(evicted.load(Ordering::Relaxed), 1);
        assert_eq!(r.err(), Some(Refusal::Budget), "nothing was freed");
        assert_eq!(gate.refusals()[0], (Refusal::Budget, 1));
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
