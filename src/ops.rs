//! The running proxy as the operator sees it: the vservers, service health and monitors,
//! request-rate sampling, reload and drain. IO (it owns the [`Runtime`]); the admin API
//! ([`crate::admin`]) and the signal handlers in `main` call into it.

use crate::balancer::Health;
use crate::config::{self, Config};
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
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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
    tokio: tokio::runtime::Handle,
    health: Arc<HealthBoard>,
    /// The config as the file says (what a reload compares against).
    config: Mutex<Arc<Config>>,
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
        board.start_monitors(&config, &tokio);
        let ops = Arc::new(Ops {
            rt: Mutex::new(Some(rt)),
            tokio,
            health: board,
            drains: Mutex::new((Drains::default(), Arc::new(config.clone()))),
            config: Mutex::new(Arc::new(config)),
            path,
            rates: Mutex::new(RateSample::default()),
            reload_lock: Mutex::new(()),
            draining: std::sync::atomic::AtomicBool::new(false),
            signal: signal.clone(),
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
                ops.sample_rates();
                ops.end_drains();
            }
        });
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

    /// The open files client connections and sessions draw from; `None` once shut down.
    pub fn budget(&self) -> Option<std::sync::Arc<crate::budget::FileBudget>> {
        self.runtime()
            .as_ref()
            .map(|rt| std::sync::Arc::clone(rt.budget()))
    }

    fn runtime(&self) -> MutexGuard<'_, Option<Runtime>> {
        lock(&self.rt)
    }

    /// Requests per second of member `m` of vserver `v` over the last sampled second.
    pub fn request_rate(&self, v: usize, m: usize) -> f64 {
        lock(&self.rates).rates.get(&(v, m)).copied().unwrap_or(0.0)
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
        self.runtime().is_some()
    }

    /// Whether this instance should get new traffic (`GET /readyz`; [`crate::readiness`]).
    pub fn readiness(&self) -> Readiness {
        let facts = self.with_vservers(|vs, _| vs.iter().map(vserver_facts).collect::<Vec<_>>());
        readiness::readiness(facts.as_deref(), self.is_draining())
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
            .and_then(|new| self.apply_locked(new));
        systemd::notify(systemd::State::Serving);
        applied
    }

    /// Apply a validated config (the second half of [`Ops::reload`]).
    pub fn apply(&self, new: Config) -> Result<Vec<String>, ReloadError> {
        let _one_at_a_time = lock(&self.reload_lock);
        self.apply_locked(new)
    }

    /// [`Ops::apply`] with the reload lock held.
    fn apply_locked(&self, new: Config) -> Result<Vec<String>, ReloadError> {
        if self.is_draining() {
            return Err(ReloadError::ShutDown);
        }
        let old = self.config();
        let plan = reload::plan(&old, &new).map_err(ReloadError::NeedsRestart)?;
        if self.runtime().is_none() {
            return Err(ReloadError::ShutDown);
        }
        // Members the new file drops start draining where flows are pinned to them.
        let running = {
            // Read under the runtime's lock, then released: the drains' lock is never held
            // while the runtime's is taken (the status page takes them the other way round).
            let (counts, now) = self.flow_counts();
            let flows = |v: &str, s: &str| {
                counts
                    .get(&(v.to_owned(), s.to_owned()))
                    .copied()
                    .unwrap_or(0)
            };
            let mut g = self.drains();
            let before = Arc::clone(&g.1);
            g.0.reloaded(&before, &new, &flows, now);
            g.1 = Arc::new(g.0.effective(&new));
            Arc::clone(&g.1)
        };
        let new = Arc::new(new);
        *lock(&self.config) = Arc::clone(&new);
        let new = running;
        for (vs, rate) in &plan.slow_start_rates {
            self.set_slow_start_rate(vs, *rate);
        }
        if plan.monitors_changed || !plan.rebuild.is_empty() {
            self.health.sync_services(&new);
        }
        if !plan.rebuild.is_empty() {
            let mut guard = self.runtime();
            let rt = guard.as_mut().ok_or(ReloadError::ShutDown)?;
            let board = &self.health;
            let health_of = |n: &str| board.service(n).map_or(Health::Up, |r| r.effective());
            for vs in &plan.rebuild {
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
                let r = rt.rebuild(&new, vs, &health_of)?;
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
            crate::proxy::fd_limit::check_capacity(&new.vservers, rt.budget());
            // Request rates are indexed by member position, which a rebuild may change.
            *lock(&self.rates) = RateSample::default();
        }
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
            g.1 = Arc::new(g.0.effective(&self.config()));
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

    /// Pet the service manager's watchdog every `every` for as long as the proxy serves: a
    /// task on the runtime that also runs the admin API and the monitors, so a wedged runtime
    /// or a shut-down proxy stops the keep-alives and the manager steps in.
    pub fn start_watchdog(self: &Arc<Self>, every: Duration) {
        let Some(guard) = self
            .runtime()
            .as_ref()
            .map(|rt| rt.task_group("watchdog").guard())
        else {
            return;
        };
        let weak = Arc::downgrade(self);
        let mut signal = self.shutdown_signal();
        self.tokio.spawn(async move {
            let _guard = guard;
            let mut tick = tokio::time::interval(every);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = signal.recv() => return,
                }
                let Some(ops) = weak.upgrade() else { return };
                if !ops.is_serving() {
                    return;
                }
                systemd::notify(systemd::State::Alive);
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
        if let Some(rt) = rt {
            rt.shutdown();
        }
    }
}

/// What readiness needs of a running vserver: usable services are UP ones (neither DOWN nor
/// out of service).
fn vserver_facts(v: &VserverHandle) -> VserverFacts {
    let b = v.balancer();
    VserverFacts {
        name: v.name.clone(),
        is_bound: !v.bound.is_empty(),
        usable_services: (0..b.members().len())
            .filter(|&m| b.health(m) == Some(Health::Up) && !b.is_draining(m))
            .count(),
    }
}
