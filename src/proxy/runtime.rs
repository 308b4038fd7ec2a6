//! Starts the vservers of a config and holds what the operator controls at run time. IO.

use crate::balancer::Health;
use crate::config::{Config, Protocol, Vserver};
use crate::liveness::{Heart, Liveness};
use crate::proxy::context::Rebuilt;
use crate::proxy::context::{
    Prepared, RebuildCx, RuntimeError, SHUTDOWN_WAIT, StartCtx, VserverHandle,
};
use crate::proxy::shutdown::{Shutdown, Signal};
use crate::proxy::{sip_stream, sip_udp, tcp, udp};
use crate::stats::Nanos;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// All running vservers of one config.
pub struct Runtime {
    epoch: Instant,
    /// The open files client connections and sessions draw from.
    budget: std::sync::Arc<crate::budget::FileBudget>,
    shutdown: Shutdown,
    vservers: Vec<VserverHandle>,
    /// Vservers of the config that could not start while the others did, with why: packet
    /// vservers the kernel would not take ([`crate::proxy::packet::start`]).
    refused: Vec<(String, String)>,
    threads: Vec<JoinHandle<()>>,
    /// Async data paths, monitors and the admin API run here.
    tokio: Option<tokio::runtime::Runtime>,
    /// Every worker's progress, for the watchdog.
    liveness: Arc<Liveness>,
    /// Every vserver's evictable client connections.
    evictors: Arc<crate::proxy::evict::Evictors>,
    /// SIP messages to a HEP collector (docs/capture.md); reconfigured by reload.
    capture: Arc<crate::capture::Capture>,
    /// The heart of `tokio`'s probe, held while the runtime lives.
    _tokio_heart: Heart,
    /// The vserver whose next rebuild fails in [`Runtime::prepare_rebuild`]: a fault for the
    /// tests of an all-or-nothing reload (the reload planner refuses every failure it knows
    /// of, so no config provokes one).
    #[cfg(test)]
    pub(crate) fail_rebuild: Option<String>,
}

/// A vserver's rebuild built aside by [`Runtime::prepare_rebuild`], not yet installed.
#[derive(Debug)]
pub struct PreparedVserver {
    slot: usize,
    prepared: Prepared,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("vservers", &self.vservers)
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// Bind every vserver and start its workers. Nothing is left running on error.
    pub fn start(config: &Config) -> Result<Runtime, RuntimeError> {
        let tokio = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("fulcrum-io")
            .build()?;
        let liveness = Arc::new(Liveness::default());
        let _tokio_heart = liveness.runtime("fulcrum-io runtime".into(), tokio.handle().clone());
        let budget = std::sync::Arc::new(crate::fd_limit::budget(config));
        let mut rt = Runtime {
            budget,
            epoch: Instant::now(),
            shutdown: Shutdown::new(),
            vservers: Vec::new(),
            refused: Vec::new(),
            threads: Vec::new(),
            tokio: Some(tokio),
            liveness,
            evictors: Arc::default(),
            capture: Arc::new(crate::capture::Capture::new(config.capture.as_ref())),
            _tokio_heart,
            #[cfg(test)]
            fail_rebuild: None,
        };
        crate::fd_limit::check_capacity(&config.vservers, &rt.budget);
        for v in &config.vservers {
            if v.protocol.is_packet() {
                // One vserver the host cannot run does not keep the others down.
                if let Err(e) = rt.start_vserver(config, v) {
                    tracing::error!(vserver = %v.name, error = %e, "vserver not started");
                    rt.refused.push((v.name.clone(), e.to_string()));
                }
                continue;
            }
            if let Err(e) = rt.start_vserver(config, v) {
                rt.stop_all();
                return Err(e);
            }
        }
        Ok(rt)
    }

    /// Monotonic nanoseconds since start: the `now` handed to the pure core.
    pub fn now(&self) -> Nanos {
        crate::proxy::context::elapsed_nanos(self.epoch)
    }

    /// Every vserver's evictable client connections.
    pub(crate) fn evictors(&self) -> &Arc<crate::proxy::evict::Evictors> {
        &self.evictors
    }

    /// SIP message capture (docs/capture.md).
    pub fn capture(&self) -> &Arc<crate::capture::Capture> {
        &self.capture
    }

    /// The open files client connections and sessions draw from (docs/limits.md).
    pub fn budget(&self) -> &std::sync::Arc<crate::budget::FileBudget> {
        &self.budget
    }

    /// The clock origin of [`Runtime::now`] (monitors and the admin API use it too).
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    pub fn vservers(&self) -> &[VserverHandle] {
        &self.vservers
    }

    /// The vservers of the config that were not started, with why.
    pub fn refused(&self) -> &[(String, String)] {
        &self.refused
    }

    pub fn vserver(&self, name: &str) -> Option<&VserverHandle> {
        self.vservers.iter().find(|v| v.name == name)
    }

    /// Set the state of service `service` in every vserver that uses it; returns how many
    /// vservers it belongs to.
    pub fn set_health(&self, service: &str, health: Health) -> usize {
        let now = self.now();
        let mut n = 0;
        for v in &self.vservers {
            let b = v.balancer();
            if let Some(m) = b.members().iter().position(|m| m.name == service) {
                b.set_health(m, health, now);
                n += 1;
            }
        }
        n
    }

    /// Store the certificates of `config` (read again by the reload that made it) into the
    /// running vservers that terminate TLS, and the CAs into the service connectors of tcp /
    /// http cores: new handshakes use them, established connections keep theirs. A listener
    /// whose files did not change keeps its configuration and session cache
    /// ([`crate::tls::TlsListener::store`]). The vservers whose listener changed, and how.
    pub fn reload_tls(&self, config: &Config) -> Vec<(String, crate::tls::Renewal)> {
        let mut stored = Vec::new();
        for h in &self.vservers {
            let (Some(listener), Some(v)) =
                (h.tls(), config.vservers.iter().find(|v| v.name == h.name))
            else {
                continue;
            };
            if let Some(tls) = v.tls.as_ref().and_then(|t| t.server_tls()) {
                match listener.store(tls) {
                    crate::tls::Renewal::Unchanged => {}
                    changed => stored.push((h.name.clone(), changed)),
                }
            }
        }
        for h in &self.vservers {
            h.data.store_client_tls(config);
        }
        stored
    }

    /// The shutdown signal, for async tasks started beside the runtime (the admin API and
    /// the operator's periodic jobs): it is raised when the runtime shuts down.
    pub fn shutdown_signal(&self) -> Signal {
        self.shutdown.signal()
    }

    /// A group of tasks started beside the runtime that [`Runtime::shutdown`] waits for.
    pub fn task_group(&self, name: &str) -> crate::proxy::shutdown::TaskGroup {
        self.shutdown.group(name)
    }

    /// Every worker's progress, for the watchdog.
    pub fn liveness(&self) -> &Arc<Liveness> {
        &self.liveness
    }

    /// The tokio runtime of async paths, monitors and the admin API.
    pub fn tokio(&self) -> Option<&tokio::runtime::Handle> {
        self.tokio.as_ref().map(|t| t.handle())
    }

    fn start_vserver(&mut self, config: &Config, v: &Vserver) -> Result<(), RuntimeError> {
        let Some(tokio) = self.tokio.as_ref().map(|t| t.handle().clone()) else {
            return Err(RuntimeError::Setup {
                vserver: v.name.clone(),
                problem: "runtime is shut down".into(),
            });
        };
        let mut ctx = StartCtx {
            budget: &self.budget,
            epoch: self.epoch,
            shutdown: &self.shutdown,
            threads: &mut self.threads,
            tokio: &tokio,
            liveness: &self.liveness,
            evictors: &self.evictors,
            capture: &self.capture,
        };
        let start = starter(v.protocol);
        let handle = start(&mut ctx, config, v)?;
        self.vservers.push(handle);
        Ok(())
    }

    /// Cut the flows still open on member `service` of vserver `vserver` whose drain timed
    /// out, where a rebuild without it would not: tcp / http connections finish on the core
    /// they began with, so they are closed here. (A rebuild without the member ends the
    /// others: dialogs and udp sessions are routed afresh, a SIP stream link is retired.)
    pub fn cut_flows(&self, vserver: &str, service: &str) {
        if let Some(h) = self.vserver(vserver) {
            h.data.cut(service);
        }
    }

    /// Rebuild vserver `name` from `config`, whatever its protocol (`proxy::reconfig`):
    /// [`Runtime::prepare_rebuild`], then [`Runtime::install`].
    pub fn rebuild(
        &mut self,
        config: &Config,
        name: &str,
        health_of: &dyn Fn(&str) -> Health,
    ) -> Result<Rebuilt, RuntimeError> {
        let prepared = self.prepare_rebuild(config, name)?;
        Ok(self.install(prepared, health_of))
    }

    /// Build vserver `name` from `config` aside: everything of its rebuild that can fail,
    /// nothing the running vserver uses yet. [`Runtime::install`] puts it in place; dropped,
    /// it leaves the vserver as it was.
    pub fn prepare_rebuild(
        &self,
        config: &Config,
        name: &str,
    ) -> Result<PreparedVserver, RuntimeError> {
        let setup = |problem: &str| RuntimeError::Setup {
            vserver: name.to_owned(),
            problem: problem.to_owned(),
        };
        #[cfg(test)]
        if self.fail_rebuild.as_deref() == Some(name) {
            return Err(setup("rebuild failure injected by a test"));
        }
        let slot = self
            .vservers
            .iter()
            .position(|h| h.name == name)
            .ok_or_else(|| setup("not running"))?;
        let handle = &self.vservers[slot];
        let v = config
            .vservers
            .iter()
            .find(|v| v.name == name && handle.data.protocols().contains(&v.protocol))
            .ok_or_else(|| {
                let names: Vec<&str> = handle.data.protocols().iter().map(|p| p.name()).collect();
                setup(&format!(
                    "not a {} vserver of the new config",
                    names.join(" or ")
                ))
            })?;
        let prepared = handle.data.prepare(config, v)?;
        Ok(PreparedVserver { slot, prepared })
    }

    /// Install a rebuild [`Runtime::prepare_rebuild`] built aside, the members given their
    /// health by `health_of`. Cannot fail: what changed.
    pub fn install(&mut self, p: PreparedVserver, health_of: &dyn Fn(&str) -> Health) -> Rebuilt {
        let cx = RebuildCx {
            epoch: self.epoch,
            health_of,
        };
        let r = p.prepared.install(&cx);
        // The slot was found by `prepare_rebuild`, and vservers are never removed from a
        // running runtime.
        if let Some(handle) = self.vservers.get_mut(p.slot) {
            handle.set_balancer(r.balancer);
            handle.set_data(r.data);
        }
        r.rebuilt
    }

    /// Raise the shutdown, wait (bounded) for the tasks that heed it, join the worker threads
    /// (woken by the raise), then end what is left on the async runtime.
    fn stop_all(&mut self) {
        if self.tokio.is_none() {
            return;
        }
        self.shutdown.raise();
        let left = self.shutdown.wait(SHUTDOWN_WAIT);
        if !left.is_empty() {
            tracing::warn!(unfinished = ?left, wait = ?SHUTDOWN_WAIT, "tasks still running at shutdown: ended with the runtime");
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some(t) = self.tokio.take() {
            t.shutdown_timeout(SHUTDOWN_WAIT);
        }
    }

    /// Stop every worker and wait for them (async handlers for at most [`SHUTDOWN_WAIT`]).
    pub fn shutdown(mut self) {
        self.stop_all();
    }
}

/// How a vserver of protocol `p` starts: the one place that names every data path.
fn starter(
    p: Protocol,
) -> fn(&mut StartCtx<'_>, &Config, &Vserver) -> Result<VserverHandle, RuntimeError> {
    match p {
        Protocol::SipUdp => sip_udp::start,
        Protocol::SipTcp | Protocol::SipTls | Protocol::SipWs | Protocol::SipWss => {
            sip_stream::start
        }
        Protocol::Udp => udp::start,
        Protocol::Tcp | Protocol::Http => tcp::start,
        Protocol::Ip => crate::proxy::packet::start,
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop_all();
    }
}
