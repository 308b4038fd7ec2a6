//! Health monitoring: per-service state, probes on tokio, results applied to every vserver
//! that contains the service. IO around the PURE [`state`] machine.
//!
//! One task per monitored service probes every `interval` (first probe after a
//! deterministic per-service fraction of the interval, [`state::first_probe_delay_ms`]),
//! each probe bounded by `timeout`. Outcomes feed the service's [`state::HealthState`];
//! a transition is applied with [`Balancer::set_health`] in every vserver holding the
//! service (DOWN→UP starts slow start there). Every reply's round-trip time feeds
//! `record_monitor_response_time` (the `lrtm` method) and a reported load feeds
//! `set_reported_load` (`custom_load`, see [`probe`] for where the load is read).
//!
//! A reload restarts only the tasks whose monitor definition or service address or protocol
//! changed ([`HealthBoard::start_monitors`]); the others keep their probe timing, so frequent
//! reloads do not hold back the detection of a failure. A task reads its service's client TLS
//! from a holder before each probe, and a reload stores the certificates it read there.
//!
//! Passive failure detection: data paths call [`Balancer::report_failure`] when a service
//! refuses a connection or a connected socket gets ICMP unreachable; before each probe the
//! monitor counts any such reports as one failed observation (so a dead service goes DOWN
//! in fewer probe rounds; with `failures_to_down` >= 2 never on passive reports alone when
//! it answers its probes; an unmonitored service is never taken down by them).
//!
//! A probe that fails on fulcrum's own side (no file descriptor, buffer, memory or local
//! address: [`crate::eject::is_local_error`]) is no observation of the service: its state is
//! left as it was, the probe is counted apart (`fulcrum_monitor_local_errors_total`) and logged
//! as fulcrum's trouble, once a second at most.
//!
//! The operator's disable (OUT_OF_SERVICE) wins over the monitor: a disabled service keeps
//! being probed, so its monitored state is current when it is enabled again.
//!
//! A `sip-options` probe's answer is judged by the PURE [`answer`]; a 503 with Retry-After
//! holds the service DOWN for it ([`state`], "Held DOWN by Retry-After"), which `/status`
//! shows as the monitor's `hold` and the log as `retry_after_s` / `held_s`.

pub mod answer;
pub mod icmp;
pub mod probe;
pub(crate) mod state;

pub use state::{Hold, Outcome};

use crate::balancer::{Balancer, Health};
use crate::config::{Config, Monitor, Protocol};
use crate::stats::{LogLimiter, Nanos};
use crate::sync::lock;
use crate::tls::ClientTls;
use arc_swap::ArcSwapOption;
use state::{HealthState, Phase, Thresholds, Transition};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where a service sits: (balancer, member index) in every vserver that holds it.
pub type Placements = HashMap<String, Vec<(Arc<Balancer>, usize)>>;

/// The shared view of one service's health, read by the admin API and metrics.
#[derive(Debug)]
pub struct ServiceHealth {
    pub name: String,
    /// Set by the operator (OUT_OF_SERVICE).
    disabled: AtomicBool,
    /// The monitor definition and its state; `None` for an unmonitored service.
    monitor: Mutex<Option<(Monitor, HealthState)>>,
    pub probes_ok: AtomicU64,
    pub probes_failed: AtomicU64,
    /// Probes that failed on fulcrum's own side ([`probe::ProbeError::is_local`]): neither
    /// ok nor failed, the service's state left as it was.
    pub local_errors: AtomicU64,
    /// Last successful probe's round-trip time (µs); 0 = none yet.
    pub last_rtt_us: AtomicU64,
    /// Sum of successful probes' round-trip times (µs), for the latency metric.
    pub rtt_sum_us: AtomicU64,
}

impl ServiceHealth {
    fn new(name: &str, monitor: Option<Monitor>) -> ServiceHealth {
        ServiceHealth {
            name: name.to_owned(),
            disabled: AtomicBool::new(false),
            monitor: Mutex::new(monitor.map(|m| {
                let st = HealthState::new(thresholds(&m));
                (m, st)
            })),
            probes_ok: AtomicU64::new(0),
            probes_failed: AtomicU64::new(0),
            local_errors: AtomicU64::new(0),
            last_rtt_us: AtomicU64::new(0),
            rtt_sum_us: AtomicU64::new(0),
        }
    }

    pub fn is_disabled(&self) -> bool {
        self.disabled.load(Ordering::Acquire)
    }

    /// The monitor's name and phase, `None` when unmonitored.
    pub fn monitor(&self) -> Option<(String, Phase)> {
        self.lock()
            .as_ref()
            .map(|(m, s)| (m.name.clone(), s.phase()))
    }

    /// The Retry-After hold in force at `now` (on [`HealthBoard::now`]'s clock), if any.
    pub fn hold(&self, now: Nanos) -> Option<Hold> {
        self.lock().as_ref().and_then(|(_, s)| s.hold(now))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(Monitor, HealthState)>> {
        lock(&self.monitor)
    }

    /// The state the balancers should hold: disabled wins, then the monitor.
    pub fn effective(&self) -> Health {
        if self.is_disabled() {
            Health::OutOfService
        } else if self.lock().as_ref().is_some_and(|(_, s)| !s.is_up()) {
            Health::Down
        } else {
            Health::Up
        }
    }
}

fn thresholds(m: &Monitor) -> Thresholds {
    Thresholds {
        failures_to_down: m.failures_to_down,
        successes_to_up: m.successes_to_up,
    }
}

/// Health of every service of the running config, and the monitor tasks.
#[derive(Debug)]
pub struct HealthBoard {
    services: Mutex<HashMap<String, Arc<ServiceHealth>>>,
    placements: Mutex<Arc<Placements>>,
    epoch: Instant,
    /// The probe task of each monitored service, by service name.
    tasks: Mutex<HashMap<String, MonitorTask>>,
    /// Probes failing on fulcrum's own side: one line a second at most, for all monitors (the
    /// trouble is the host's, and hits every monitor at once).
    local_log: LogLimiter,
    /// Where each monitor task shows its rounds to the watchdog, once set.
    liveness: std::sync::OnceLock<Arc<crate::liveness::Liveness>>,
    /// Where the SIP probes are shown (captured when its `probes` is on), once set.
    capture: std::sync::OnceLock<Arc<crate::capture::Capture>>,
}

impl HealthBoard {
    /// A board for `config`; `epoch` is the runtime's clock origin (`now` for balancers).
    pub fn new(config: &Config, placements: Placements, epoch: Instant) -> Arc<HealthBoard> {
        let board = Arc::new(HealthBoard {
            services: Mutex::new(HashMap::new()),
            placements: Mutex::new(Arc::new(placements)),
            epoch,
            tasks: Mutex::new(HashMap::new()),
            local_log: LogLimiter::default(),
            liveness: std::sync::OnceLock::new(),
            capture: std::sync::OnceLock::new(),
        });
        board.sync_services(config);
        board
    }

    /// Show every monitor task's rounds on `liveness` (set once; tasks started from now on).
    pub fn watch_with(&self, liveness: Arc<crate::liveness::Liveness>) {
        let _ = self.liveness.set(liveness);
    }

    /// Show every SIP probe and its answers to `capture` (set once; docs/capture.md).
    pub fn capture_with(&self, capture: Arc<crate::capture::Capture>) {
        let _ = self.capture.set(capture);
    }

    /// Nanoseconds since the board's epoch: the clock of monitor holds.
    pub fn now(&self) -> Nanos {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Bring the service records in line with `config`: new services get a fresh record,
    /// removed ones are dropped, a service whose monitor definition is unchanged keeps its
    /// state; a changed or new monitor starts UP, unconfirmed.
    pub fn sync_services(&self, config: &Config) {
        let mut map = lock(&self.services);
        let mut next = HashMap::new();
        for s in &config.services {
            let mon = s.monitor.and_then(|i| config.monitors.get(i)).cloned();
            let rec = match map.remove(&s.name) {
                Some(old) => {
                    let mut g = old.lock();
                    let same = match (&*g, &mon) {
                        (Some((a, _)), Some(b)) => a == b,
                        (None, None) => true,
                        _ => false,
                    };
                    if !same {
                        *g = mon.map(|m| {
                            let st = HealthState::new(thresholds(&m));
                            (m, st)
                        });
                    }
                    drop(g);
                    old
                }
                None => Arc::new(ServiceHealth::new(&s.name, mon)),
            };
            next.insert(s.name.clone(), rec);
        }
        *map = next;
    }

    /// Replace where services sit (after a reload changed memberships).
    pub fn set_placements(&self, placements: Placements) {
        *lock(&self.placements) = Arc::new(placements);
    }

    fn placements(&self) -> Arc<Placements> {
        Arc::clone(&lock(&self.placements))
    }

    pub fn service(&self, name: &str) -> Option<Arc<ServiceHealth>> {
        lock(&self.services).get(name).cloned()
    }

    /// Every service record, sorted by name.
    pub fn services(&self) -> Vec<Arc<ServiceHealth>> {
        let mut v: Vec<_> = lock(&self.services).values().cloned().collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Push the effective state of `name` to every balancer that holds it.
    pub fn apply(&self, name: &str) {
        let Some(rec) = self.service(name) else {
            return;
        };
        let health = rec.effective();
        let now = self.now();
        if let Some(places) = self.placements().get(name) {
            for (b, m) in places {
                b.set_health(*m, health, now);
            }
        }
    }

    /// Push every service's effective state (after start or reload).
    pub fn apply_all(&self) {
        for s in self.services() {
            self.apply(&s.name);
        }
    }

    /// Operator disable (`true`) / enable (`false`). `false` when the service is unknown.
    pub fn set_disabled(&self, name: &str, disabled: bool) -> bool {
        let Some(rec) = self.service(name) else {
            return false;
        };
        rec.disabled.store(disabled, Ordering::Release);
        self.apply(name);
        true
    }

    /// Bring the probe tasks on `tokio` in line with `config` (at start and on every reload):
    /// a service whose monitor definition, address and protocol are unchanged keeps its task,
    /// and so the timing of its probes, and its next probes use the client TLS of `config`
    /// (the certificates a reload read again); a new or changed one starts a task of its own
    /// (first probe after [`state::first_probe_delay_ms`]); the task of a service no longer
    /// monitored ends.
    pub fn start_monitors(self: &Arc<Self>, config: &Config, tokio: &tokio::runtime::Handle) {
        let mut running = lock(&self.tasks);
        let mut next = HashMap::new();
        for s in &config.services {
            let Some(monitor) = s.monitor.and_then(|i| config.monitors.get(i)).cloned() else {
                continue;
            };
            let target = ProbeTarget {
                name: s.name.clone(),
                address: s.address,
                protocol: s.protocol,
                monitor,
            };
            let tls = s.tls.as_ref().and_then(|t| t.client_tls(s.address.ip()));
            let task = match running.remove(&s.name) {
                Some(t) if t.target == target && !t.handle.is_finished() => {
                    t.tls.store(tls.map(Arc::new));
                    t
                }
                old => {
                    if let Some(t) = old {
                        t.handle.abort();
                    }
                    let tls = Arc::new(ArcSwapOption::from(tls.map(Arc::new)));
                    let board = Arc::clone(self);
                    let (t, cell) = (target.clone(), Arc::clone(&tls));
                    MonitorTask {
                        target,
                        tls,
                        handle: tokio.spawn(async move { board.run_monitor(t, cell).await }),
                    }
                }
            };
            next.insert(s.name.clone(), task);
        }
        for (_, gone) in running.drain() {
            gone.handle.abort();
        }
        *running = next;
    }

    /// Stop every probe task.
    pub fn stop_monitors(&self) {
        for (_, t) in lock(&self.tasks).drain() {
            t.handle.abort();
        }
    }

    async fn run_monitor(self: Arc<Self>, target: ProbeTarget, tls: Arc<ArcSwapOption<ClientTls>>) {
        let m = &target.monitor;
        let interval_ms = u64::try_from(m.interval.as_millis()).unwrap_or(u64::MAX);
        let delay = state::first_probe_delay_ms(&target.name, interval_ms);
        // A round ends at most an interval (the first: the delay) plus the timeout after the
        // previous one.
        let heart = self.liveness.get().map(|l| {
            l.periodic(
                format!("monitor of {}", target.name),
                m.interval + m.timeout,
            )
        });
        tokio::time::sleep(Duration::from_millis(delay)).await;
        let mut tick = tokio::time::interval(m.interval.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.take_passive_failures(&target.name) > 0 {
                self.record(&target.name, m, Err(probe::ProbeError::Passive));
            }
            // Read for each probe: a reload stores the certificates it read here.
            let tls = tls.load_full();
            let result = probe::probe_captured(
                &m.kind,
                target.address,
                target.protocol,
                tls.as_deref(),
                m.timeout,
                probe::Tap(self.capture.get().map(Arc::as_ref)),
            )
            .await;
            self.record(&target.name, m, result);
            if let Some(h) = &heart {
                h.beat();
            }
        }
    }

    /// Passive failures the data paths reported for `name` since the last look, in every
    /// vserver holding it.
    fn take_passive_failures(&self, name: &str) -> u64 {
        self.placements()
            .get(name)
            .map_or(0, |p| p.iter().map(|(b, i)| b.take_failures(*i)).sum())
    }

    /// Fold one probe result into the service's state and counters.
    pub fn record(
        &self,
        name: &str,
        m: &Monitor,
        result: Result<probe::ProbeReply, probe::ProbeError>,
    ) {
        self.record_at(self.now(), name, m, result);
    }

    /// [`record`](Self::record) at `now` on the board's clock.
    fn record_at(
        &self,
        now: Nanos,
        name: &str,
        m: &Monitor,
        result: Result<probe::ProbeReply, probe::ProbeError>,
    ) {
        let Some(rec) = self.service(name) else {
            return;
        };
        // fulcrum's own trouble says nothing of the service: as if no probe had run, but
        // counted and said.
        if let Err(e) = &result
            && e.is_local()
        {
            rec.local_errors.fetch_add(1, Ordering::Relaxed);
            if self.local_log.allow(now) {
                tracing::warn!(
                    service = name, monitor = %m.name, error = %e,
                    "probe failed on fulcrum's side (out of descriptors, buffers, memory or local ports?): not counted against the service"
                );
            }
            return;
        }
        let outcome = result
            .as_ref()
            .map_or_else(|e| e.outcome(), |_| Outcome::Alive);
        match &result {
            Ok(reply) => {
                rec.probes_ok.fetch_add(1, Ordering::Relaxed);
                rec.last_rtt_us
                    .store(reply.rtt_us.max(1), Ordering::Relaxed);
                rec.rtt_sum_us.fetch_add(reply.rtt_us, Ordering::Relaxed);
                if let Some(places) = self.placements().get(name) {
                    for (b, i) in places {
                        if let Some(c) = b.counters(*i) {
                            c.record_monitor_response_time(reply.rtt_us);
                            if let Some(load) = reply.load {
                                c.set_reported_load(load);
                            }
                        }
                    }
                }
            }
            Err(e) => {
                rec.probes_failed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(service = name, monitor = %m.name, error = %e, "probe failed");
            }
        }
        let passive = matches!(result, Err(probe::ProbeError::Passive));
        let folded = fold(&rec, m, now, outcome, passive);
        let why = result.err().map(|e| e.to_string()).unwrap_or_default();
        log_folded(name, m, now, outcome, &why, &folded);
        if folded.transition.is_some() {
            self.apply(name);
        }
    }
}

/// What folding one probe outcome into a service's state did.
#[derive(Debug)]
struct Folded {
    transition: Option<Transition>,
    /// Whether a Retry-After hold was in force before the outcome.
    held_before: bool,
    /// The hold in force after it.
    hold: Option<Hold>,
}

/// Fold `outcome` (at `now`) into the state of `rec` when `m` is still its monitor.
fn fold(rec: &ServiceHealth, m: &Monitor, now: Nanos, outcome: Outcome, passive: bool) -> Folded {
    let mut g = rec.lock();
    match g.as_mut() {
        // A probe of a monitor replaced by reload meanwhile is ignored.
        Some((cur, st)) if cur == m => {
            let held_before = st.hold(now).is_some();
            // Before its first probe result a service is UP unconfirmed, and one failure
            // would take it DOWN: only a probe may do that, never a report of the data path
            // alone (which then counts from the next probe on).
            let transition = if passive && st.phase() == state::Phase::Unconfirmed {
                None
            } else {
                st.observe(now, outcome)
            };
            Folded {
                transition,
                held_before,
                hold: st.hold(now),
            }
        }
        _ => Folded {
            transition: None,
            held_before: false,
            hold: None,
        },
    }
}

/// The monitor's log line for what folding `outcome` did, `why` the probe's failure.
fn log_folded(name: &str, m: &Monitor, now: Nanos, outcome: Outcome, why: &str, f: &Folded) {
    let held_s = |h: &Hold| h.remaining(now).div_ceil(1_000_000_000);
    match (f.transition, f.hold) {
        (Some(Transition::WentDown), Some(h)) => tracing::warn!(
            service = name, monitor = %m.name, reason = %why,
            retry_after_s = h.retry_after_s, held_s = held_s(&h),
            "service DOWN, held for its Retry-After"
        ),
        (Some(Transition::WentDown), None) => {
            tracing::warn!(service = name, monitor = %m.name, reason = %why, "service DOWN");
        }
        (Some(Transition::CameUp), _) => {
            tracing::info!(service = name, monitor = %m.name, "service UP");
        }
        // Already DOWN: a hold that starts is worth a line, one renewed probe after probe
        // is not.
        (None, Some(h)) if matches!(outcome, Outcome::Unavailable { .. }) => {
            if f.held_before {
                tracing::debug!(
                    service = name, monitor = %m.name, retry_after_s = h.retry_after_s,
                    held_s = held_s(&h), "service still held DOWN"
                );
            } else {
                tracing::info!(
                    service = name, monitor = %m.name, reason = %why,
                    retry_after_s = h.retry_after_s, held_s = held_s(&h),
                    "service held DOWN for its Retry-After"
                );
            }
        }
        (None, _) => {}
    }
}

impl Drop for HealthBoard {
    fn drop(&mut self) {
        self.stop_monitors();
    }
}

/// What a probe task probes: a change of any of it restarts the task.
#[derive(Debug, Clone, PartialEq)]
struct ProbeTarget {
    name: String,
    address: SocketAddr,
    protocol: Protocol,
    monitor: Monitor,
}

/// A running probe task and the client TLS its probes read (the service's `tls`; `None` for
/// a plain service), which a reload replaces without restarting the task.
#[derive(Debug)]
struct MonitorTask {
    target: ProbeTarget,
    tls: Arc<ArcSwapOption<ClientTls>>,
    handle: tokio::task::JoinHandle<()>,
}

/// Where each service of `vservers` sits.
pub fn placements<'a>(balancers: impl IntoIterator<Item = &'a Arc<Balancer>>) -> Placements {
    let mut map: Placements = HashMap::new();
    for b in balancers {
        for (i, m) in b.members().iter().enumerate() {
            map.entry(m.name.clone())
                .or_default()
                .push((Arc::clone(b), i));
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        crate::config::from_str(
            "t.yaml",
            "admin: { listen: null }\n\
             monitors:\n  - { name: m, type: tcp-connect, interval: 1s, timeout: 500ms, failures_to_down: 2, successes_to_up: 1 }\n\
             services:\n  - { name: a, address: 127.0.0.1:5071, protocol: sip-udp, monitor: m }\n  - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }\n\
             vservers:\n  - { name: v1, protocol: sip-udp, bind: [127.0.0.1:0], method: round_robin, services: [a, b] }\n  - { name: v2, protocol: sip-udp, bind: [127.0.0.1:0], method: call_id_hash, services: [b, a] }\n",
        )
        .expect("valid")
    }

    #[test]
    fn outcomes_reach_every_vserver_and_disable_wins() {
        let cfg = config();
        let b1 = Arc::new(Balancer::new(&cfg, &cfg.vservers[0]));
        let b2 = Arc::new(Balancer::new(&cfg, &cfg.vservers[1]));
        let board = HealthBoard::new(&cfg, placements([&b1, &b2]), Instant::now());
        let m = cfg.monitors[0].clone();
        let fail = || Err(probe::ProbeError::Timeout);
        let ok = || {
            Ok(probe::ProbeReply {
                rtt_us: 250,
                status: None,
                load: Some(9),
            })
        };
        board.record("a", &m, ok());
        assert_eq!(
            b1.counters(0).and_then(|c| c.monitor_response_time_us()),
            Some(250)
        );
        assert_eq!(b2.counters(1).and_then(|c| c.reported_load()), Some(9));
        board.record("a", &m, fail());
        assert_eq!(b1.health(0), Some(Health::Up), "one failure of two");
        board.record("a", &m, fail());
        assert_eq!(b1.health(0), Some(Health::Down));
        assert_eq!(b2.health(1), Some(Health::Down));
        assert!(board.set_disabled("a", true));
        board.record("a", &m, ok());
        assert_eq!(
            b1.health(0),
            Some(Health::OutOfService),
            "disable wins over UP"
        );
        assert!(board.set_disabled("a", false));
        assert_eq!(b2.health(1), Some(Health::Up));
        assert!(!board.set_disabled("nope", true));
    }

    /// A report of the data path alone never takes down a service no probe has answered
    /// yet (UP unconfirmed); once a probe has, it counts like a failed probe.
    #[test]
    fn a_passive_failure_waits_for_the_first_probe() {
        let cfg = config();
        let b1 = Arc::new(Balancer::new(&cfg, &cfg.vservers[0]));
        let b2 = Arc::new(Balancer::new(&cfg, &cfg.vservers[1]));
        let board = HealthBoard::new(&cfg, placements([&b1, &b2]), Instant::now());
        let m = cfg.monitors[0].clone();
        let passive = || Err(probe::ProbeError::Passive);
        board.record("a", &m, passive());
        assert_eq!(
            b1.health(0),
            Some(Health::Up),
            "unconfirmed: not taken down"
        );
        board.record(
            "a",
            &m,
            Ok(probe::ProbeReply {
                rtt_us: 100,
                status: None,
                load: None,
            }),
        );
        board.record("a", &m, passive());
        board.record("a", &m, passive());
        assert_eq!(b1.health(0), Some(Health::Down), "two failures of two");
    }

    /// A probe that fails on fulcrum's own side is no observation of the service: an
    /// unconfirmed service is not taken down by it, a run of failures is neither broken nor
    /// lengthened, a DOWN service stays DOWN; it is counted apart from the probes' results.
    #[test]
    fn a_local_error_leaves_the_service_as_it_was() {
        let cfg = config();
        let b1 = Arc::new(Balancer::new(&cfg, &cfg.vservers[0]));
        let b2 = Arc::new(Balancer::new(&cfg, &cfg.vservers[1]));
        let board = HealthBoard::new(&cfg, placements([&b1, &b2]), Instant::now());
        let m = cfg.monitors[0].clone();
        let rec = board.service("a").expect("a");
        let phase = || rec.monitor().map(|(_, p)| p);
        let local = |e: i32| Err(probe::ProbeError::Io(std::io::Error::from_raw_os_error(e)));
        let fail = || Err(probe::ProbeError::Timeout);
        let ok = || {
            Ok(probe::ProbeReply {
                rtt_us: 100,
                status: None,
                load: None,
            })
        };
        use nix::libc::{EADDRNOTAVAIL, EMFILE, ENFILE, ENOBUFS, ENOMEM};
        board.record("a", &m, local(EMFILE));
        assert_eq!(
            phase(),
            Some(Phase::Unconfirmed),
            "one failure would take it down"
        );
        assert_eq!(b1.health(0), Some(Health::Up));
        board.record("a", &m, ok());
        board.record("a", &m, fail());
        for e in [ENFILE, ENOBUFS, ENOMEM, EADDRNOTAVAIL] {
            board.record("a", &m, local(e));
        }
        assert_eq!(b1.health(0), Some(Health::Up), "still one failure of two");
        board.record("a", &m, fail());
        assert_eq!(b1.health(0), Some(Health::Down), "the run went on");
        board.record("a", &m, local(EMFILE));
        assert_eq!(b2.health(1), Some(Health::Down));
        board.record("a", &m, ok());
        assert_eq!(b2.health(1), Some(Health::Up));
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!(
            (
                n(&rec.probes_ok),
                n(&rec.probes_failed),
                n(&rec.local_errors)
            ),
            (2, 2, 6)
        );
    }

    /// A 503 with Retry-After takes the service DOWN in every vserver at once (the monitor
    /// wants two failures), and answers before the Retry-After has passed do not bring it
    /// back; the first one after it does (`successes_to_up` 1).
    #[test]
    fn a_retry_after_holds_the_service_down_in_every_vserver() {
        const S: Nanos = 1_000_000_000;
        let cfg = config();
        let b1 = Arc::new(Balancer::new(&cfg, &cfg.vservers[0]));
        let b2 = Arc::new(Balancer::new(&cfg, &cfg.vservers[1]));
        let board = HealthBoard::new(&cfg, placements([&b1, &b2]), Instant::now());
        let m = cfg.monitors[0].clone();
        let ok = || {
            Ok(probe::ProbeReply {
                rtt_us: 100,
                status: Some(200),
                load: None,
            })
        };
        let busy = || {
            Err(probe::ProbeError::RetryAfter {
                code: 503,
                retry_after_s: 2,
            })
        };
        board.record_at(S, "a", &m, ok());
        board.record_at(2 * S, "a", &m, busy());
        assert_eq!(b1.health(0), Some(Health::Down), "at once");
        assert_eq!(b2.health(1), Some(Health::Down));
        let rec = board.service("a").expect("a");
        assert_eq!(
            rec.hold(3 * S),
            Some(Hold {
                retry_after_s: 2,
                until: 4 * S
            })
        );
        board.record_at(3 * S, "a", &m, ok());
        board.record_at(4 * S - 1, "a", &m, ok());
        assert_eq!(b1.health(0), Some(Health::Down), "held");
        board.record_at(4 * S, "a", &m, ok());
        assert_eq!(b1.health(0), Some(Health::Up));
        assert_eq!(b2.health(1), Some(Health::Up));
        assert_eq!(rec.hold(4 * S), None);
        assert!(board.service("b").is_some_and(|b| b.hold(0).is_none()));
    }

    /// Monitor `m` probing every hour (no probe runs during a test) of service `a`, reached
    /// over TLS with the client configuration `tls`, and of the plain service `b`.
    fn hourly(tls: &Arc<rustls::ClientConfig>) -> Config {
        let mut cfg = crate::config::from_str(
            "t.yaml",
            "admin: { listen: null }\n\
             monitors:\n  - { name: m, type: sip-options, interval: 1h, timeout: 1s }\n\
             services:\n  - { name: a, address: 127.0.0.1:5071, protocol: sip-tls, monitor: m, tls: { ca: ca.crt, server_name: a.test } }\n  - { name: b, address: 127.0.0.1:5072, protocol: sip-tcp, monitor: m }\n\
             vservers:\n  - { name: v, protocol: sip-tcp, bind: [127.0.0.1:0], method: call_id_hash, services: [a, b] }\n",
        )
        .expect("valid");
        if let Some(t) = cfg.services[0].tls.as_mut() {
            t.loaded = crate::tls::Loaded::new(Arc::clone(tls));
        }
        cfg
    }

    fn client_config() -> Arc<rustls::ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let c = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        Arc::new(c)
    }

    /// The id of each probe task, by service.
    fn task_ids(board: &HealthBoard) -> HashMap<String, tokio::task::Id> {
        lock(&board.tasks)
            .iter()
            .map(|(n, t)| (n.clone(), t.handle.id()))
            .collect()
    }

    /// The client configuration the next probe of `name` uses.
    fn probe_tls_of(board: &HealthBoard, name: &str) -> Option<Arc<rustls::ClientConfig>> {
        let tasks = lock(&board.tasks);
        let tls = tasks.get(name)?.tls.load_full()?;
        Some(Arc::clone(&tls.config))
    }

    /// Whether the task of `h` ends once the runtime has run what is ready (a few turns).
    async fn ended(h: &tokio::task::AbortHandle) -> bool {
        for _ in 0..100 {
            if h.is_finished() {
                return true;
            }
            tokio::task::yield_now().await;
        }
        h.is_finished()
    }

    /// A reload's certificates reach a running probe task, which keeps running (its timing);
    /// only a task whose monitor or service address changed starts again, and the task of
    /// a service no longer monitored ends.
    #[tokio::test]
    async fn a_reload_keeps_unchanged_probe_tasks_and_swaps_their_certificates() {
        let tokio = tokio::runtime::Handle::current();
        let (first, second) = (client_config(), client_config());
        let cfg = hourly(&first);
        let board = HealthBoard::new(&cfg, Placements::new(), Instant::now());
        board.start_monitors(&cfg, &tokio);
        let before = task_ids(&board);
        assert_eq!(before.len(), 2, "{before:?}");
        let uses = |board: &HealthBoard, c: &Arc<rustls::ClientConfig>| {
            probe_tls_of(board, "a").is_some_and(|t| Arc::ptr_eq(&t, c))
        };
        assert!(uses(&board, &first));
        assert!(probe_tls_of(&board, "b").is_none(), "b is plain");

        // The same config with certificates read again: no task restarts.
        let reread = hourly(&second);
        board.start_monitors(&reread, &tokio);
        assert_eq!(task_ids(&board), before);
        assert!(uses(&board, &second), "the next probe uses the new CA");

        // b moves: its task restarts, a's goes on.
        let mut moved = reread.clone();
        moved.services[1].address = "127.0.0.1:5073".parse().expect("addr");
        board.start_monitors(&moved, &tokio);
        let after = task_ids(&board);
        assert_eq!(after.get("a"), before.get("a"));
        assert_ne!(after.get("b"), before.get("b"));

        // a's monitor changes: its task restarts; b is no longer monitored: its task ends.
        let mut changed = moved.clone();
        changed.monitors[0].timeout = Duration::from_millis(400);
        changed.services[1].monitor = None;
        let b_task = lock(&board.tasks)
            .get("b")
            .map(|t| t.handle.abort_handle())
            .expect("b's task");
        board.start_monitors(&changed, &tokio);
        let last = task_ids(&board);
        assert_ne!(last.get("a"), after.get("a"));
        assert!(!last.contains_key("b"), "{last:?}");
        assert!(ended(&b_task).await, "b's task was stopped");

        // A task that ended is started again.
        let a_task = lock(&board.tasks)
            .get("a")
            .map(|t| t.handle.abort_handle())
            .expect("a's task");
        a_task.abort();
        assert!(ended(&a_task).await);
        board.start_monitors(&changed, &tokio);
        assert_ne!(task_ids(&board).get("a"), last.get("a"));
        board.stop_monitors();
        assert!(task_ids(&board).is_empty());
    }

    #[test]
    fn passive_failures_are_summed_and_drained() {
        let cfg = config();
        let b1 = Arc::new(Balancer::new(&cfg, &cfg.vservers[0]));
        let b2 = Arc::new(Balancer::new(&cfg, &cfg.vservers[1]));
        let board = HealthBoard::new(&cfg, placements([&b1, &b2]), Instant::now());
        b1.report_failure(0);
        b2.report_failure(1);
        b2.report_failure(1);
        b1.report_failure(99);
        assert_eq!(board.take_passive_failures("a"), 3);
        assert_eq!(board.take_passive_failures("a"), 0);
    }
}
