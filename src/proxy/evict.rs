//! Eviction under pressure (docs/limits.md): when the process's file pool runs low, a new
//! client connection first closes an idle one, those that never completed a request before
//! any that did, the longest idle first ([`crate::budget::victims`]). IO: the registry holds
//! the connections' tasks, to abort the chosen ones.

use crate::budget::{Activity, Admission, Gate, Refusal};
use dashmap::DashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How long a new connection refused for want of files waits, at most, for an evicted one's
/// files to come back (its task gives them back when it is next polled), in steps.
pub(crate) const EVICTION_WAIT_STEPS: usize = 10;
pub(crate) const EVICTION_WAIT_STEP: Duration = Duration::from_millis(5);

/// Admit a new client from `ip` through `gate`. While the process's file pool runs low, the
/// new client first makes room: `evict` closes one idle connection and says how many it
/// closed; a new client then refused for want of files waits a little for the evicted
/// one's file to come back.
pub(crate) async fn admit_evicting(
    gate: &Gate,
    ip: IpAddr,
    evict: impl FnOnce() -> usize,
) -> Result<Admission, Refusal> {
    let evicted = gate.budget().is_low() && evict() > 0;
    let mut r = gate.admit(ip);
    if evicted {
        for _ in 0..EVICTION_WAIT_STEPS {
            if !matches!(r, Err(Refusal::Budget)) {
                break;
            }
            tokio::time::sleep(EVICTION_WAIT_STEP).await;
            r = gate.admit(ip);
        }
    }
    r
}

/// The client connections of a vserver that may be evicted: each one's activity and task.
/// Shared by the vserver's workers and kept across reloads.
#[derive(Debug, Default)]
pub(crate) struct Evictable {
    conns: DashMap<u64, (Arc<Activity>, tokio::task::AbortHandle)>,
    next: AtomicU64,
}

impl Evictable {
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

    /// Close up to `n` connections in eviction order; how many were closed. Entries whose
    /// task already ended are dropped on the way, not counted.
    pub(crate) fn evict(&self, n: usize) -> usize {
        self.conns.retain(|_, (_, abort)| !abort.is_finished());
        let ranks = self.conns.iter().map(|e| (*e.key(), e.value().0.rank()));
        let mut closed = 0;
        for id in crate::budget::victims(ranks, n) {
            if let Some((_, (_, abort))) = self.conns.remove(&id) {
                abort.abort();
                closed += 1;
            }
        }
        closed
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
