//! Following the pools in DNS while the proxy runs: each name is asked again when its
//! [`crate::discovery::Pool`] is due, and a change of a member set is applied as a reload
//! is (the vservers that list the pool rebuilt behind their sockets, members that left
//! draining, new ones in slow start). IO.

use super::Ops;
use crate::config::{Config, DnsSettings};
use crate::discovery::{self as dns, Outcome};
use crate::proxy::shutdown::TaskGroup;
use crate::sync::lock;
use hickory_resolver::TokioResolver;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// The longest the watcher sleeps: a reload that adds a pool is asked within this.
const TICK: Duration = Duration::from_secs(1);

/// Start following the pools of `ops` on its runtime.
pub(super) fn watch(ops: &Arc<Ops>, jobs: &TaskGroup) {
    let weak = Arc::downgrade(ops);
    let (signal, guard) = (ops.signal.clone(), jobs.guard());
    ops.tokio.spawn(async move {
        let _guard = guard;
        let mut signal = signal;
        let mut resolver: Option<Resolver> = None;
        loop {
            let wait = match round(&weak, &mut resolver).await {
                Some(wait) => wait,
                None => return,
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = signal.recv() => return,
            }
        }
    });
}

/// Ask the names that are due and apply what changed; how long to sleep (`None`: the
/// proxy is gone).
/// The resolver in use: the settings it was built from, the stamp of the system's
/// configuration it read (`dns::resolve::system_conf_stamp`), and the resolver.
type Resolver = (DnsSettings, Option<Stamp>, TokioResolver);
type Stamp = (u64, u64, std::time::SystemTime);

async fn round(weak: &Weak<Ops>, resolver: &mut Option<Resolver>) -> Option<Duration> {
    let (file, due) = {
        let ops = weak.upgrade()?;
        let file: Arc<Config> = ops.config();
        let now = ops.now()?;
        let mut pools = lock(&ops.pools);
        pools.sync(&file, now);
        (file, pools.due(now))
    };
    if !due.is_empty() {
        // Built again when the settings change, or the system's configuration (a DHCP
        // lease, systemd-resolved rewriting /etc/resolv.conf while fulcrum runs).
        let stamp = dns::resolve::system_conf_stamp(&file.dns);
        if let Some((_, old, _)) = resolver.as_ref()
            && *old != stamp
        {
            tracing::info!(path = %file.dns.resolv_conf.display(), "DNS: the system's resolver configuration changed; read again");
        }
        if resolver
            .as_ref()
            .is_none_or(|(s, old, _)| *s != file.dns || *old != stamp)
        {
            *resolver = match dns::resolve::resolver(&file.dns) {
                Ok(r) => Some((file.dns.clone(), stamp, r)),
                Err(e) => {
                    tracing::warn!(error = %e, "DNS: no resolver");
                    None
                }
            };
        }
        let outcomes: Vec<(String, Outcome)> = match resolver {
            Some((_, _, r)) => {
                use futures_util::StreamExt;
                // Owned (a resolver clone shares its connections): a borrowing stream is not
                // `Send` enough for the spawned task.
                let asks: Vec<_> = due
                    .iter()
                    .map(|(service, name)| {
                        let (r, service, name) = (r.clone(), service.clone(), name.clone());
                        async move { (service, dns::resolve::lookup(&r, &name).await) }
                    })
                    .collect();
                futures_util::stream::iter(asks)
                    .buffer_unordered(dns::resolve::LOOKUPS_AT_ONCE)
                    .collect()
                    .await
            }
            None => due
                .iter()
                .map(|(s, _)| (s.clone(), Outcome::Failed("no resolver".to_owned())))
                .collect(),
        };
        let ops = weak.upgrade()?;
        let now = ops.now()?;
        let changed = {
            let mut pools = lock(&ops.pools);
            let mut changed = false;
            for (service, outcome) in outcomes {
                // A pool a reload removed or renamed meanwhile: its answer is stale.
                let Some(p) = pools
                    .by_service
                    .get_mut(&service)
                    .filter(|p| due.iter().any(|(s, d)| *s == service && *d == p.dns))
                else {
                    continue;
                };
                changed |= dns::resolve::record_logged(&service, p, outcome, now, &file.dns);
            }
            changed
        };
        if changed {
            let ops2 = Arc::clone(&ops);
            // A rebuild takes locks and may wait for workers: off the async threads.
            let _ = ops.tokio.spawn_blocking(move || ops2.rediscovered()).await;
        }
    }
    let ops = weak.upgrade()?;
    let now = ops.now()?;
    let next = lock(&ops.pools).next_due();
    let wait = next.map_or(TICK, |t| Duration::from_nanos(t.saturating_sub(now)));
    Some(wait.clamp(Duration::from_millis(20), TICK))
}

impl Ops {
    /// A member set changed: run the file's config with the sets now known, as a reload
    /// would (nothing when the result is what runs already).
    fn rediscovered(&self) {
        let _one_at_a_time = lock(&self.reload_lock);
        if self.is_draining() {
            return;
        }
        let file = self.config();
        let new = dns::expand(&file, &lock(&self.pools).members());
        if *self.expanded_config() == new {
            return;
        }
        match self.apply_expanded((*file).clone(), new) {
            Ok(changes) => tracing::info!(changes = ?changes, "DNS pools applied"),
            Err(e) => tracing::warn!(error = %e, "DNS pools not applied"),
        }
    }
}
