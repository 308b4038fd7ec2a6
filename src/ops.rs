//! The running proxy as the operator sees it: the vservers, service health and monitors,
//! request-rate sampling, reload and drain. IO (it owns the [`Runtime`]); the admin API
//! ([`crate::admin`]) and the signal handlers in `main` call into it.

use crate::balancer::Health;
use crate::config::{self, Config};
use crate::discovery::{self as dns, Pools};
use crate::drain::{DrainEnd, Drains};
use crate::health::{self, HealthBoard};
use crate::proxy::shutdown::Signal;
use crate::proxy::{Runtime, VserverHandle};
use crate::readiness::{self, Readiness, VserverFacts};
use crate::reload;
use crate::sync::lock;
use crate::systemd;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

mod discovery;

/// Why a reload did not apply.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("no config file to reload from")]
    NoFile,
    #[error("{0}")]
    Invalid(#[from] config::ConfigError),
    #[error("the new config needs a restart: {}", .0.join("; "))]
    NeedsRestart(Vec<String>),
    #[error("the proxy is shutting down")]
    ShutDown,
    #[error("{0}")]
    Rebuild(#[from] crate::proxy::RuntimeError),
}

/// Requests-per-second estimate per (vserver, member), sampled once a second.
#[derive(Debug, Default)]
struct RateSample {
    at: Option<Instant>,
    totals: HashMap<(usize, usize), u64>,
    rates: HashMap<(usize, usize), f64>,
}

/// The operator's handle on a running proxy.
pub struct Ops {
    rt: Mutex<Option<Runtime>>,
    /// The runtime is there (`rt` is `Some`): read without `rt`'s lock, which a reload
    /// holds while it rebuilds vservers (the watchdog must not wait for it).
    serving: std::sync::atomic::AtomicBool,
    /// The runtime's clock (its epoch), read without `rt`'s lock.
    epoch: std::time::Instant,
    /// What readiness said of the vservers when `rt` was last free: `/readyz` answers from
    /// it while a reload holds `rt` (a load balancer's health check must not time out on a
    /// long reload and withdraw the instance).
    last_facts: Mutex<Option<Vec<crate::readiness::VserverFacts>>>,
    tokio: tokio::runtime::Handle,
    health: Arc<HealthBoard>,
    /// The config as the file says.
    config: Mutex<Arc<Config>>,
    /// The file's config with its pools in DNS expanded into their members
    /// ([`crate::discovery::expand`]): what a reload, or a change of the pools, compares
    /// against.
    expanded: Mutex<Arc<Config>>,
    /// The pools in DNS and what their lookups said ([`discovery`]).
    pools: Mutex<Pools>,
    /// Services removed by reloads that still carry flows, and the config the runtime runs:
    /// the file's plus those (see [`crate::drain`]). Changed under `reload_lock`.
    drains: Mutex<(Drains, Arc<Config>)>,
    path: Option<PathBuf>,
    rates: Mutex<RateSample>,
    reload_lock: Mutex<()>,
    /// Set by [`Ops::drain`]: from then on nothing may undo the drain (enable a service,
    /// reload and so restart monitors that would bring services UP again).
    draining: std::sync::atomic::AtomicBool,
    /// Raised when the runtime shuts down (see [`Ops::shutdown_signal`]).
    signal: Signal,
    /// When to give back what closed connections freed ([`crate::memory`]).
    trim: Mutex<crate::memory::TrimPolicy>,
    /// What the trims did: (trims run, KiB of resident memory they gave back).
    trimmed: Arc<(AtomicU64, AtomicU64)>,
}

impl std::fmt::Debug for Ops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ops")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Ops {
    /// Start the vservers of `config` and their monitors. `path` is the file reloads re-read.
    pub fn start(
        config: Config,
        path: Option<PathBuf>,
    ) -> Result<Arc<Ops>, crate::proxy::RuntimeError> {
        // The first member sets of the pools in DNS, before anything starts.
        let file = config;
        let (config, pools) = dns::resolve::resolved(&file, 0);
        let rt = Runtime::start(&config)?;
        let tokio = rt
            .tokio()
            .cloned()
            .ok_or_else(|| crate::proxy::RuntimeError::Setup {
                vserver: String::new(),
                problem: "no async runtime".into(),
            })?;
        let signal = rt.shutdown_signal();
        let jobs = rt.task_group("operator jobs");
        let placements = health::placements(rt.vservers().iter().map(|v| v.balancer()));
        let board = HealthBoard::new(&config, placements, rt.epoch());
        board.apply_all();
        board.watch_with(Arc::clone(rt.liveness()));
        board.capture_with(Arc::clone(rt.capture()));
        board.start_monitors(&config, &tokio);
        let epoch = rt.epoch();
        let facts: Vec<_> = rt.vservers().iter().map(vserver_facts).collect();
        let ops = Arc::new(Ops {
            epoch,
            rt: Mutex::new(Some(rt)),
            serving: std::sync::atomic::AtomicBool::new(true),
            last_facts: Mutex::new(Some(facts)),
            tokio,
            health: board,
            drains: Mutex::new((Drains::default(), Arc::new(config.clone()))),
            expanded: Mutex::new(Arc::new(config)),
            config: Mutex::new(Arc::new(file)),
            pools: Mutex::new(pools),
            path,
            rates: Mutex::new(RateSample::default()),
            reload_lock: Mutex::new(()),
            draining: std::sync::atomic::AtomicBool::new(false),
            signal: signal.clone(),
            trim: Mutex::new(crate::memory::TrimPolicy::default()),
            trimmed: Arc::default(),
        });
        let weak = Arc::downgrade(&ops);
        let (mut signal, guard) = (signal, jobs.guard());
        ops.tokio.spawn(async move {
            let _guard = guard;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = signal.recv() => return,
                }
                let Some(ops) = weak.upgrade() else { return };
                // They take the runtime's and the reload's locks, which a reload holds while
                // it rebuilds: on a blocking thread, so no worker of this runtime (SIP
                // streams, the admin API, monitors, the watchdog) waits with them.
                let tokio = ops.tokio.clone();
                let _ = tokio
                    .spawn_blocking(move || {
                        // Keeps what `/readyz` answers during a reload fresh.
                        let _ = ops.readiness();
                        ops.sample_rates();
                        ops.end_drains();
                        ops.return_memory();
                    })
                    .await;
            }
        });
        discovery::watch(&ops, &jobs);
        Ok(ops)
    }

    /// Raised when the proxy shuts down ([`Ops::shutdown`]): tasks started on [`Ops::tokio`]
    /// (the admin API) end on it.
    pub fn shutdown_signal(&self) -> Signal {
        self.signal.clone()
    }

    /// The tokio runtime monitors and the admin API run on.
    pub fn tokio(&self) -> &tokio::runtime::Handle {
        &self.tokio
    }

    pub fn health(&self) -> &Arc<HealthBoard> {
        &self.health
    }

    /// The running config.
    pub fn config(&self) -> Arc<Config> {
        Arc::clone(&lock(&self.config))
    }

    /// The file's config with the pools in DNS expanded into their members.
    pub fn expanded_config(&self) -> Arc<Config> {
        Arc::clone(&lock(&self.expanded))
    }

    /// The pools in DNS: what their lookups said.
    pub fn pools(&self) -> Pools {
        lock(&self.pools).clone()
    }

    /// The config the runtime runs: the file's, with the services still draining.
    pub fn running_config(&self) -> Arc<Config> {
        Arc::clone(&self.drains().1)
    }

    /// The drain of `service` on `vserver`, when it drains there: (since, until) in the
    /// runtime's clock.
    pub fn drain_of(&self, vserver: &str, service: &str) -> Option<(u64, u64)> {
        self.drains()
            .0
            .get(vserver, service)
            .map(|d| (d.since, d.until))
    }

    fn drains(&self) -> MutexGuard<'_, (Drains, Arc<Config>)> {
        lock(&self.drains)
    }

    /// The admin token in force (changes with reload).
    pub fn token(&self) -> Option<String> {
        self.config().admin.token.clone()
    }

    /// Run `f` over the vservers; `None` once shut down.
    pub fn with_vservers<R>(&self, f: impl FnOnce(&[VserverHandle], u64) -> R) -> Option<R> {
        let g = self.runtime();
        g.as_ref().map(|rt| f(rt.vservers(), rt.now()))
    }

    /// The vservers of the config that did not start, with why (a packet vserver this build
    /// cannot run, [`crate::proxy::Runtime::refused`]); empty once shut down.
    pub fn not_started(&self) -> Vec<(String, String)> {
        self.runtime()
            .as_ref()
            .map(|rt| rt.refused().to_vec())
            .unwrap_or_default()
    }

    /// The open files client connections and sessions draw from; `None` once shut down.
    pub fn budget(&self) -> Option<std::sync::Arc<crate::budget::FileBudget>> {
        self.runtime()
            .as_ref()
            .map(|rt| std::sync::Arc::clone(rt.budget()))
    }

    /// SIP message capture (docs/capture.md); `None` once shut down.
    pub fn capture(&self) -> Option<std::sync::Arc<crate::capture::Capture>> {
        self.runtime()
            .as_ref()
            .map(|rt| std::sync::Arc::clone(rt.capture()))
    }

    /// The runtime's clock; `None` once shut down.
    fn now(&self) -> Option<crate::stats::Nanos> {
        self.is_serving()
            .then(|| crate::proxy::context::elapsed_nanos(self.epoch))
    }

    fn with_runtime<R>(&self, f: impl FnOnce(&Runtime) -> R) -> Option<R> {
        self.runtime().as_ref().map(f)
    }

    fn runtime(&self) -> MutexGuard<'_, Option<Runtime>> {
        lock(&self.rt)
    }

    /// The memory trims run after bursts of connections closed, and the KiB of resident
    /// memory they gave back in all.
    pub fn memory_trims(&self) -> (u64, u64) {
        (
            self.trimmed.0.load(Ordering::Relaxed),
            self.trimmed.1.load(Ordering::Relaxed),
        )
    }

    /// Requests per second of member `m` of vserver `v` over the last sampled second.
    pub fn request_rate(&self, v: usize, m: usize) -> f64 {
        lock(&self.rates).rates.get(&(v, m)).copied().unwrap_or(0.0)
    }

    /// After a burst of connections closed, give what they freed back to the system
    /// ([`crate::memory`]): rarely, on a blocking thread (the walk takes the allocator's locks
    /// one arena at a time), and logged with what it took and gave.
    fn return_memory(&self) {
        let Some((now, used, high, evictors)) = self.with_runtime(|rt| {
            let b = rt.budget();
            (rt.now(), b.used(), b.take_high(), Arc::clone(rt.evictors()))
        }) else {
            return;
        };
        if !lock(&self.trim).observe(now, used, high) {
            return;
        }
        let trimmed = Arc::clone(&self.trimmed);
        self.tokio.spawn_blocking(move || {
            let before = rss_kib();
            let started = Instant::now();
            evictors.shrink();
            let released = crate::memory::release();
            let took = started.elapsed();
            let after = rss_kib();
            trimmed.0.fetch_add(1, Ordering::Relaxed);
            trimmed
                .1
                .fetch_add(before.saturating_sub(after), Ordering::Relaxed);
            let (live_kib, free_kib) = crate::memory::allocator_kib().unwrap_or_default();
            tracing::info!(
                files_in_use = used,
                released,
                rss_before_kib = before,
                rss_after_kib = after,
                allocated_kib = live_kib,
                kept_by_allocator_kib = free_kib,
                took_us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
                "freed memory given back to the system"
            );
        });
    }

    fn sample_rates(&self) {
        let totals: HashMap<(usize, usize), u64> = self
            .with_vservers(|vs, _| {
                let mut t = HashMap::new();
                for (vi, v) in vs.iter().enumerate() {
                    let b = v.balancer();
                    for mi in 0..b.members().len() {
                        if let Some(c) = b.counters(mi) {
                            t.insert((vi, mi), c.requests_total());
                        }
                    }
                }
                t
            })
            .unwrap_or_default();
        let now = Instant::now();
        let mut s = lock(&self.rates);
        if let Some(at) = s.at {
            let dt = now.duration_since(at).as_secs_f64().max(1e-3);
            let rates = totals
                .iter()
                .map(|(k, &t)| {
                    let prev = s.totals.get(k).copied().unwrap_or(t);
                    (*k, t.saturating_sub(prev) as f64 / dt)
                })
                .collect();
            s.rates = rates;
        }
        s.at = Some(now);
        s.totals = totals;
    }

    /// Whether a graceful stop has begun (see [`Ops::drain`]).
    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether the proxy still runs its vservers (`false` once shut down).
    pub fn is_serving(&self) -> bool {
        self.serving.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether this instance should get new traffic (`GET /readyz`; [`crate::readiness`]).
    pub fn readiness(&self) -> Readiness {
        // Without waiting for a reload that holds the runtime: the facts it last gave.
        let facts = match self.rt.try_lock() {
            Ok(g) => {
                let facts = g
                    .as_ref()
                    .map(|rt| rt.vservers().iter().map(vserver_facts).collect::<Vec<_>>());
                drop(g);
                lock(&self.last_facts).clone_from(&facts);
                facts
            }
            Err(std::sync::TryLockError::Poisoned(p)) => p
                .into_inner()
                .as_ref()
                .map(|rt| rt.vservers().iter().map(vserver_facts).collect::<Vec<_>>()),
            Err(std::sync::TryLockError::WouldBlock) => lock(&self.last_facts)
                .clone()
                .or_else(|| self.with_vservers(|vs, _| vs.iter().map(vserver_facts).collect())),
        };
        let notes = lock(&self.pools).notes(self.now().unwrap_or(0));
        readiness::readiness(facts.as_deref(), self.is_draining()).with_notes(notes)
    }

    /// Operator disable / enable of a service in every vserver. `false` if unknown. Enable
    /// also ends the service's passive ejections (docs/ejection.md): the operator vouches
    /// for it.
    pub fn set_disabled(&self, service: &str, disabled: bool) -> bool {
        let ok = self.health.set_disabled(service, disabled);
        if ok && !disabled {
            for vserver in self.end_ejections(service) {
                tracing::info!(vserver, service, "operator: ejection ended");
            }
        }
        if ok {
            tracing::info!(
                service,
                state = if disabled {
                    "OUT_OF_SERVICE"
                } else {
                    "enabled"
                },
                "operator"
            );
        }
        ok
    }

    /// End the passive ejection of `service` in every vserver; the vservers where it was
    /// ejected.
    fn end_ejections(&self, service: &str) -> Vec<String> {
        self.with_vservers(|vs, _| {
            vs.iter()
                .filter(|v| {
                    let b = v.balancer();
                    let mine = b
                        .members()
                        .iter()
                        .enumerate()
                        .filter(|(_, m)| m.name == service);
                    // Every one ended, not only the first.
                    mine.fold(false, |any, (i, _)| b.end_ejection(i) || any)
                })
                .map(|v| v.name.clone())
                .collect()
        })
        .unwrap_or_default()
    }

    /// Sources banned by flood control now: (vserver, source, seconds left).
    pub fn bans(&self) -> Vec<(String, std::net::IpAddr, f64)> {
        self.with_vservers(|vs, now| {
            vs.iter()
                .flat_map(|v| {
                    v.data.edge().bans(now).into_iter().map(move |b| {
                        let left = b.until.saturating_sub(now) as f64 / 1e9;
                        (v.name.clone(), b.ip, left)
                    })
                })
                .collect()
        })
        .unwrap_or_default()
    }

    /// Lift the ban of `ip` in every vserver; the vservers where it was banned.
    pub fn unban(&self, ip: std::net::IpAddr) -> Vec<String> {
        self.with_vservers(|vs, now| {
            vs.iter()
                .filter(|v| v.data.edge().unban(ip, now))
                .map(|v| v.name.clone())
                .collect()
        })
        .unwrap_or_default()
    }

    /// Change a vserver's slow-start rate. `None` when the vserver is unknown, `Some(false)`
    /// when it has no slow start.
    pub fn set_slow_start_rate(&self, vserver: &str, rate: u32) -> Option<bool> {
        self.with_vservers(|vs, now| {
            vs.iter()
                .find(|v| v.name == vserver)
                .map(|v| v.balancer().set_slow_start_rate(rate, now))
        })
        .flatten()
    }

    /// Re-read the config file and apply it (see [`crate::reload`] for what applies in
    /// place). A file that does not validate, or that needs a restart, changes nothing.
    ///
    /// The service manager hears RELOADING before and READY after, whatever the outcome (a
    /// refused reload leaves the proxy serving as before); both under the reload lock, so a
    /// drain's STOPPING ([`Ops::drain`]) never comes between them, and none once draining.
    pub fn reload(&self) -> Result<Vec<String>, ReloadError> {
        let path = self.path.as_ref().ok_or(ReloadError::NoFile)?;
        let _one_at_a_time = lock(&self.reload_lock);
        if self.is_draining() {
            return Err(ReloadError::ShutDown);
        }
        systemd::notify(systemd::reloading_now());
        let applied = config::load(path)
            .map_err(ReloadError::from)
            .inspect(|new| {
                let file = path.display().to_string();
                for w in new.warning_lines(&file) {
                    tracing::warn!("{w}");
                }
            })
            .and_then(|new| self.apply_locked(new));
        systemd::notify(systemd::State::Serving);
        applied
    }

    /// Apply a validated config (the second half of [`Ops::reload`]).
    pub fn apply(&self, new: Config) -> Result<Vec<String>, ReloadError> {
        let _one_at_a_time = lock(&self.reload_lock);
        self.apply_locked(new)
    }

    /// [`Ops::apply`] with the reload lock held. All or nothing: everything that can fail
    /// (the plan, each rebuilt vserver built aside) is done first; only once all of it has
    /// succeeded is anything changed (the config, the drains, the rebuilt vservers, the
    /// monitors), by steps that cannot fail. A reload never starts or stops a vserver (that
    /// needs a restart, [`crate::reload`]), so no listener is bound here.
    fn apply_locked(&self, new: Config) -> Result<Vec<String>, ReloadError> {
        // The pools the new file names (new ones unasked yet); the old ones come back if the
        // reload does not apply.
        let now = self.now().unwrap_or(0);
        let (expanded, before) = {
            let mut pools = lock(&self.pools);
            let before = pools.clone();
            pools.sync(&new, now);
            (dns::expand(&new, &pools.members()), before)
        };
        let applied = self.apply_expanded(new, expanded);
        if applied.is_err() {
            *lock(&self.pools) = before;
        }
        applied
    }

    /// Apply `file`, whose pools in DNS expand to `new` (the reload lock held).
    fn apply_expanded(&self, file: Config, new: Config) -> Result<Vec<String>, ReloadError> {
        if self.is_draining() {
            return Err(ReloadError::ShutDown);
        }
        let old = self.expanded_config();
        let plan = reload::plan(&old, &new).map_err(ReloadError::NeedsRestart)?;
        // Members the new file drops start draining where flows are pinned to them: worked
        // out aside, on a copy of the drains.
        let (drains, running) = {
            // Read under the runtime's lock, then released: the drains' lock is never held
            // while the runtime's is taken (the status page takes them the other way round).
            let (counts, now) = self.flow_counts();
            let flows = |v: &str, s: &str| {
                counts
                    .get(&(v.to_owned(), s.to_owned()))
                    .copied()
                    .unwrap_or(0)
            };
            let g = self.drains();
            let mut drains = g.0.clone();
            drains.reloaded(&g.1, &new, &flows, now);
            let running = Arc::new(drains.effective(&new));
            (drains, running)
        };
        // Held until the rebuilt vservers are installed: a shutdown cannot come between.
        let mut guard = self.runtime();
        let rt = guard.as_mut().ok_or(ReloadError::ShutDown)?;
        let mut prepared = Vec::with_capacity(plan.rebuild.len());
        for vs in &plan.rebuild {
            // A vserver refused at start stays so until a restart (the log said why).
            if rt.refused().iter().any(|(name, _)| name == vs) {
                continue;
            }
            prepared.push((vs, rt.prepare_rebuild(&running, vs)?));
        }
        // Everything is built: commit. Nothing below fails.
        *self.drains() = (drains, Arc::clone(&running));
        *lock(&self.config) = Arc::new(file);
        *lock(&self.expanded) = Arc::new(new);
        let new = running;
        // Members added (by the file or by DNS) keep their links' and probes' files too.
        let (reserve, pool) = rt.budget().resize(&crate::fd_limit::needs(&new));
        tracing::debug!(reserve, pool, "open files divided again");
        if plan.capture_changed {
            rt.capture().configure(new.capture.as_ref());
        }
        for (vs, rate) in &plan.slow_start_rates {
            if let Some(h) = rt.vserver(vs) {
                h.balancer().set_slow_start_rate(*rate, rt.now());
            }
        }
        if plan.monitors_changed || !plan.rebuild.is_empty() {
            self.health.sync_services(&new);
        }
        if !plan.rebuild.is_empty() {
            let board = &self.health;
            let health_of = |n: &str| board.service(n).map_or(Health::Up, |r| r.effective());
            for (vs, p) in prepared {
                // A rate the operator set at run time survives a rebuild unless the file
                // changes the configured rate.
                let rate_of = |c: &Config| {
                    c.vservers
                        .iter()
                        .find(|v| &v.name == vs)
                        .and_then(|v| v.slow_start)
                        .map(|s| s.new_service_request_rate)
                };
                let live_rate = rt
                    .vserver(vs)
                    .and_then(|h| h.balancer().slow_start())
                    .map(|s| s.rate());
                let r = rt.install(p, &health_of);
                let draining: Vec<&str> = new
                    .vservers
                    .iter()
                    .filter(|v| &v.name == vs)
                    .flat_map(|v| v.draining.iter())
                    .filter_map(|&i| new.services.get(i).map(|s| s.name.as_str()))
                    .collect();
                if rate_of(&old) == rate_of(&new)
                    && let Some(rate) = live_rate
                    && live_rate != rate_of(&new)
                    && let Some(h) = rt.vserver(vs)
                {
                    h.balancer().set_slow_start_rate(rate, rt.now());
                }
                tracing::info!(vserver = %vs, added = ?r.added, removed = ?r.removed, draining = ?draining, dialogs_kept = r.dialogs_kept, "vserver rebuilt");
            }
            board.set_placements(health::placements(
                rt.vservers().iter().map(|v| v.balancer()),
            ));
            // A rebuild may raise max_sessions: warn again if the total no longer fits.
            crate::fd_limit::check_capacity(&new.vservers, rt.budget());
            // Request rates are indexed by member position, which a rebuild may change.
            *lock(&self.rates) = RateSample::default();
        }
        drop(guard);
        // On every reload: a monitor whose definition and service address and protocol are
        // unchanged keeps running (its state and the timing of its probes) and probes with the
        // certificates this reload read; a new or changed one starts anew.
        self.health.start_monitors(&new, &self.tokio);
        if plan.monitors_changed || !plan.rebuild.is_empty() {
            self.health.apply_all();
        }
        let mut changes = plan.describe();
        // Certificates are read again on every reload, whatever the plan; a listener whose
        // files did not change keeps its configuration, and clients resume their sessions.
        if let Some(rt) = self.runtime().as_ref() {
            for (vs, renewal) in rt.reload_tls(&new) {
                changes.push(match renewal {
                    crate::tls::Renewal::Timeout => {
                        format!("vservers.{vs}.tls_handshake_timeout changed")
                    }
                    _ => format!("vservers.{vs}.tls certificate changed"),
                });
            }
        }
        tracing::info!(changes = ?changes, "config reloaded");
        Ok(changes)
    }

    /// Flows pinned to each member, by (vserver, service), and the runtime's `now`.
    fn flow_counts(&self) -> (HashMap<(String, String), u64>, u64) {
        self.with_vservers(|vs, now| {
            let mut counts = HashMap::new();
            for v in vs {
                let b = v.balancer();
                for (m, info) in b.members().iter().enumerate() {
                    // Calls still ringing there too: their 2xx must find the service.
                    let active = b.counters(m).map_or(0, |c| c.load());
                    counts.insert((v.name.clone(), info.name.clone()), active);
                }
            }
            (counts, now)
        })
        .unwrap_or_default()
    }

    /// End the drains that are over (no flow left, or past `drain_timeout`): their vservers
    /// are rebuilt without them, and on a timeout their remaining tcp / http connections
    /// are closed. Called every second.
    pub fn end_drains(&self) {
        let _one_at_a_time = lock(&self.reload_lock);
        if self.is_draining() {
            return;
        }
        if self.drains().0.is_empty() {
            return;
        }
        let (finished, running, services_changed) = {
            let (counts, now) = self.flow_counts();
            let flows = |v: &str, s: &str| {
                counts
                    .get(&(v.to_owned(), s.to_owned()))
                    .copied()
                    .unwrap_or(0)
            };
            let mut g = self.drains();
            let finished = g.0.finish(&flows, now);
            if finished.is_empty() {
                return;
            }
            let before = g.1.services.len();
            g.1 = Arc::new(g.0.effective(&self.expanded_config()));
            (finished, Arc::clone(&g.1), before != g.1.services.len())
        };
        let mut guard = self.runtime();
        let Some(rt) = guard.as_mut() else { return };
        let board = &self.health;
        if services_changed {
            board.sync_services(&running);
        }
        let health_of = |n: &str| board.service(n).map_or(Health::Up, |r| r.effective());
        let mut rebuilt: Vec<&str> = Vec::new();
        for f in &finished {
            tracing::info!(vserver = %f.vserver, service = %f.service, end = ?f.end, "drain ended");
            if f.end == DrainEnd::TimedOut {
                rt.cut_flows(&f.vserver, &f.service);
            }
            if rebuilt.contains(&f.vserver.as_str()) {
                continue;
            }
            rebuilt.push(&f.vserver);
            if let Err(e) = rt.rebuild(&running, &f.vserver, &health_of) {
                tracing::warn!(vserver = %f.vserver, error = %e, "rebuild after a drain failed");
            }
        }
        board.set_placements(health::placements(
            rt.vservers().iter().map(|v| v.balancer()),
        ));
        *lock(&self.rates) = RateSample::default();
        drop(guard);
        if services_changed {
            self.health.start_monitors(&running, &self.tokio);
            self.health.apply_all();
        }
    }

    /// Pet the service manager's watchdog every `every` for as long as the proxy serves and
    /// every worker shows progress ([`crate::liveness`]): each sip-udp thread, udp
    /// event loop, timer and sweep thread, tcp worker runtime, the runtime of the SIP streams,
    /// admin API and monitors (this task runs there too), and each monitor's rounds. A worker
    /// stalled for `every` stops the keep-alives, so the manager steps in; they resume if it
    /// moves again first.
    pub fn start_watchdog(self: &Arc<Self>, every: Duration) {
        let Some((guard, liveness, epoch)) = self.runtime().as_ref().map(|rt| {
            (
                rt.task_group("watchdog").guard(),
                Arc::clone(rt.liveness()),
                rt.epoch(),
            )
        }) else {
            return;
        };
        let weak = Arc::downgrade(self);
        let mut signal = self.shutdown_signal();
        self.tokio.spawn(async move {
            let _guard = guard;
            let mut tick = tokio::time::interval(every);
            let mut stalled_before: Vec<String> = Vec::new();
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = signal.recv() => return,
                }
                let Some(ops) = weak.upgrade() else { return };
                if !ops.is_serving() {
                    return;
                }
                let stalled = liveness.stalled(crate::proxy::context::elapsed_nanos(epoch), every);
                if stalled != stalled_before {
                    if stalled.is_empty() {
                        tracing::info!("watchdog: every worker makes progress again; keep-alives resume");
                    } else {
                        tracing::error!(workers = ?stalled, "watchdog: workers stalled for {every:?} or longer; keep-alives withheld");
                    }
                    stalled_before = stalled;
                }
                if stalled_before.is_empty() {
                    systemd::notify(systemd::State::Alive);
                }
            }
        });
    }

    /// Graceful stop: no new flows (every member OUT_OF_SERVICE; established dialogs and
    /// connections continue), wait until none is active or `timeout` passes, then stop the
    /// workers. Returns the flows still active when it gave up.
    pub fn drain(&self, timeout: Duration) -> u64 {
        self.draining
            .store(true, std::sync::atomic::Ordering::Release);
        // A reload under way finishes before the monitors stop (none starts after this), and
        // its READY reaches the service manager before this STOPPING.
        drop(lock(&self.reload_lock));
        systemd::notify(systemd::State::Stopping);
        self.health.stop_monitors();
        let active = || {
            self.with_vservers(|vs, now| {
                let mut n = 0;
                for v in vs {
                    let b = v.balancer();
                    for m in 0..b.members().len() {
                        b.set_health(m, Health::OutOfService, now);
                        n += b.counters(m).map_or(0, |c| c.load());
                    }
                }
                n
            })
            .unwrap_or(0)
        };
        let deadline = Instant::now() + timeout;
        let mut left = active();
        // A timer, not a signal: this runs on the caller's thread (the signal thread in
        // `main`), not in async code, and the counts are plain atomics the data paths update
        // as flows end; a notification there would add a lock or a wake-up to every flow's end
        // on the data path, to save a look every 50 ms during the one graceful stop.
        while left > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            left = active();
        }
        left
    }

    /// Stop everything: raise the shutdown signal and return once the tasks that heed it
    /// have finished (bounded; see [`Runtime::shutdown`]). Call from outside the tokio
    /// runtime (the signal thread or main).
    pub fn shutdown(&self) {
        self.health.stop_monitors();
        let rt = self.runtime().take();
        self.serving
            .store(false, std::sync::atomic::Ordering::Release);
        *lock(&self.last_facts) = None;
        if let Some(rt) = rt {
            rt.shutdown();
        }
    }
}

/// What readiness needs of a running vserver: usable services are UP ones (neither DOWN nor
/// out of service). With routing rules, those of the default's pool; with a default that
/// refuses, those of any rule's pool (docs/routing.md).
fn vserver_facts(v: &VserverHandle) -> VserverFacts {
    let b = v.balancer();
    let up = |m: &usize| b.health(*m) == Some(Health::Up) && !b.is_draining(*m);
    let usable_services = match b.routes().map(|r| (&r.default, &r.rules)) {
        None => (0..b.members().len()).filter(up).count(),
        Some((crate::route::Target::Pool(p), _)) => {
            b.pool_members(*p).into_iter().filter(up).count()
        }
        Some((_, rules)) => rules
            .iter()
            .filter_map(|r| match r.target {
                crate::route::Target::Pool(p) => Some(p),
                _ => None,
            })
            .flat_map(|p| b.pool_members(p))
            .filter(up)
            .count(),
    };
    VserverFacts {
        name: v.name.clone(),
        is_bound: !v.bound.is_empty(),
        usable_services,
    }
}

/// The process's resident size (`VmRSS`, KiB), for the log; 0 where /proc has none.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{SocketAddr, UdpSocket};

    /// Two udp vservers: `va` balancing over `a_members`, `vb` over `b_members`.
    fn two_vservers(services: &[(&str, SocketAddr)], a_members: &str, b_members: &str) -> Config {
        let mut y = String::from("admin: { listen: null }\nservices:\n");
        for (n, a) in services {
            y += &format!("  - {{ name: {n}, address: \"{a}\", protocol: udp }}\n");
        }
        y += &format!(
            "vservers:\n  - {{ name: va, protocol: udp, bind: [\"127.0.0.1:0\"], method: round_robin, drain_timeout: 60s, services: [{a_members}] }}\n  - {{ name: vb, protocol: udp, bind: [\"127.0.0.1:0\"], method: round_robin, services: [{b_members}] }}\n"
        );
        crate::config::from_str("t.yaml", &y).expect("valid test config")
    }

    /// Each vserver's balancer and member names.
    fn vservers(ops: &Ops) -> Vec<(Arc<crate::balancer::Balancer>, Vec<String>)> {
        ops.with_vservers(|vs, _| {
            vs.iter()
                .map(|v| {
                    let b = Arc::clone(v.balancer());
                    let names = b.members().iter().map(|m| m.name.clone()).collect();
                    (b, names)
                })
                .collect()
        })
        .expect("running")
    }

    /// A rebuild that fails after another vserver's rebuild was built changes nothing: the
    /// file's config, the drains (the flow pinned to the member `va` loses would start one)
    /// and every vserver stay as they were. The same reload without the fault applies whole.
    #[test]
    fn a_rebuild_that_fails_changes_nothing() {
        let services: Vec<(String, UdpSocket)> = ["a1", "a2", "b1", "b2"]
            .iter()
            .map(|n| (n.to_string(), UdpSocket::bind("127.0.0.1:0").expect("bind")))
            .collect();
        let addrs: Vec<(&str, SocketAddr)> = services
            .iter()
            .map(|(n, s)| (n.as_str(), s.local_addr().expect("addr")))
            .collect();
        let ops = Ops::start(two_vservers(&addrs, "a1", "b1"), None).expect("start");
        // A session of `va` on a1: removing a1 starts its drain.
        let client = UdpSocket::bind("127.0.0.1:0").expect("client");
        let va = ops.with_vservers(|vs, _| vs[0].bound[0]).expect("running");
        client.send_to(b"hello", va).expect("send");
        let a1 = &services[0].1;
        a1.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut buf = [0u8; 64];
        a1.recv_from(&mut buf).expect("the session reached a1");

        let (config, running, before) = (ops.config(), ops.running_config(), vservers(&ops));
        let next = two_vservers(&addrs, "a2", "b2");
        lock(&ops.rt).as_mut().expect("running").fail_rebuild = Some("vb".to_owned());
        let failed = ops.apply(next.clone());
        assert!(matches!(failed, Err(ReloadError::Rebuild(_))), "{failed:?}");
        assert!(
            Arc::ptr_eq(&ops.config(), &config),
            "the file's config changed"
        );
        assert!(
            Arc::ptr_eq(&ops.running_config(), &running),
            "the running config changed"
        );
        assert_eq!(ops.drain_of("va", "a1"), None, "a drain started");
        let after = vservers(&ops);
        for ((b0, n0), (b1, n1)) in before.iter().zip(&after) {
            assert!(
                Arc::ptr_eq(b0, b1),
                "a vserver was rebuilt: {n0:?} -> {n1:?}"
            );
        }

        lock(&ops.rt).as_mut().expect("running").fail_rebuild = None;
        let changes = ops.apply(next).expect("the reload without the fault");
        assert!(
            changes.iter().any(|c| c == "vservers.va rebuilt"),
            "{changes:?}"
        );
        assert!(
            changes.iter().any(|c| c == "vservers.vb rebuilt"),
            "{changes:?}"
        );
        assert!(!Arc::ptr_eq(&ops.config(), &config));
        assert!(ops.drain_of("va", "a1").is_some(), "a1 drains its session");
        let names: Vec<Vec<String>> = vservers(&ops).into_iter().map(|(_, n)| n).collect();
        assert_eq!(names, [vec!["a2", "a1"], vec!["b2"]]);
        ops.shutdown();
    }
}
