//! Starts the vservers of a config and holds what the operator controls at run time. IO.

use crate::balancer::{Balancer, Health};
use crate::config::{Config, Protocol, Vserver};
use crate::net;
use crate::proxy::sip_udp::{self, SipUdpCore, SipUdpParams};
use crate::sip::{Local, Transport};
use crate::stats::Nanos;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a blocked worker checks for shutdown.
const POLL: Duration = Duration::from_millis(100);

/// Why the runtime could not start.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("vserver `{vserver}`: cannot bind {addr}: {source}")]
    Bind {
        vserver: String,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("vserver `{vserver}`: {problem}")]
    Setup { vserver: String, problem: String },
    #[error("vserver `{vserver}`: protocol {protocol} has no data path in this build yet")]
    Unsupported {
        vserver: String,
        protocol: &'static str,
    },
    #[error("cannot start a thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// The data path behind a vserver (one variant per protocol).
#[derive(Debug, Clone)]
pub enum DataPath {
    SipUdp(Arc<SipUdpCore>),
}

/// A running vserver.
#[derive(Debug)]
pub struct VserverHandle {
    pub name: String,
    pub protocol: Protocol,
    /// The addresses actually bound (port 0 resolved).
    pub bound: Vec<SocketAddr>,
    pub balancer: Arc<Balancer>,
    pub data: DataPath,
}

impl VserverHandle {
    pub fn balancer(&self) -> &Arc<Balancer> {
        &self.balancer
    }
}

/// What a data path needs from the runtime to start: the clock epoch, the stop flag its
/// threads watch, a place to register its threads, and the tokio runtime for async paths.
pub struct StartCtx<'a> {
    pub epoch: Instant,
    pub stop: &'a Arc<AtomicBool>,
    pub threads: &'a mut Vec<JoinHandle<()>>,
    pub tokio: &'a tokio::runtime::Handle,
    /// Swappable cores of sip-udp vservers, for reload (see `proxy::reconfig`).
    pub sip_cells: &'a mut Vec<(String, SipUdpCell)>,
}

/// The current core of a sip-udp vserver; a reload stores a rebuilt one.
pub type SipUdpCell = Arc<arc_swap::ArcSwap<SipUdpCore>>;

/// All running vservers of one config.
pub struct Runtime {
    epoch: Instant,
    stop: Arc<AtomicBool>,
    pub(super) vservers: Vec<VserverHandle>,
    threads: Vec<JoinHandle<()>>,
    pub(super) sip_cells: Vec<(String, SipUdpCell)>,
    /// Async data paths, monitors and the admin API run here.
    tokio: Option<tokio::runtime::Runtime>,
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
        let mut rt = Runtime {
            epoch: Instant::now(),
            stop: Arc::new(AtomicBool::new(false)),
            vservers: Vec::new(),
            threads: Vec::new(),
            sip_cells: Vec::new(),
            tokio: Some(tokio),
        };
        for v in &config.vservers {
            if let Err(e) = rt.start_vserver(config, v) {
                rt.stop_all();
                return Err(e);
            }
        }
        Ok(rt)
    }

    /// Monotonic nanoseconds since start: the `now` handed to the pure core.
    pub fn now(&self) -> Nanos {
        sip_udp::elapsed_nanos(self.epoch)
    }

    /// The clock origin of [`Runtime::now`] (monitors and the admin API use it too).
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    pub fn vservers(&self) -> &[VserverHandle] {
        &self.vservers
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
            epoch: self.epoch,
            stop: &self.stop,
            threads: &mut self.threads,
            tokio: &tokio,
            sip_cells: &mut self.sip_cells,
        };
        let handle = match v.protocol {
            Protocol::SipUdp => start_sip_udp(&mut ctx, config, v)?,
            p => {
                return Err(RuntimeError::Unsupported {
                    vserver: v.name.clone(),
                    protocol: p.name(),
                });
            }
        };
        self.vservers.push(handle);
        Ok(())
    }

    fn stop_all(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some(t) = self.tokio.take() {
            t.shutdown_timeout(Duration::from_secs(5));
        }
    }

    /// Stop every worker and wait for them.
    pub fn shutdown(mut self) {
        self.stop_all();
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// Start a sip-udp vserver: worker threads with SO_REUSEPORT sockets, and a dialog sweeper.
fn start_sip_udp(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
) -> Result<VserverHandle, RuntimeError> {
    let workers = net::worker_count(v.workers);
    let mut sockets = Vec::new();
    let mut bound = Vec::new();
    for addr in &v.bind {
        let socks = net::bind_udp_workers(*addr, workers).map_err(|source| RuntimeError::Bind {
            vserver: v.name.clone(),
            addr: *addr,
            source,
        })?;
        let actual = socks
            .first()
            .and_then(|s| s.local_addr().ok())
            .unwrap_or(*addr);
        bound.push(actual);
        sockets.extend(socks);
    }
    let member_addrs: Vec<SocketAddr> = v
        .services
        .iter()
        .filter_map(|&i| config.services.get(i))
        .map(|s| SocketAddr::new(s.address.ip().to_canonical(), s.address.port()))
        .collect();
    let local = local_identity(v, &bound, &member_addrs)?;
    let balancer = Arc::new(Balancer::new(config, v));
    let core = Arc::new(SipUdpCore::new(SipUdpParams {
        name: v.name.clone(),
        local,
        record_route: v.record_route,
        method: v.method,
        hash_params: v.hash.clone(),
        balancer,
        member_addrs,
        max_dialogs: v.max_sessions,
        dialog_idle: v.idle_timeout,
    }));
    let cell: SipUdpCell = Arc::new(arc_swap::ArcSwap::new(Arc::clone(&core)));
    ctx.sip_cells.push((v.name.clone(), Arc::clone(&cell)));
    for (i, socket) in sockets.into_iter().enumerate() {
        let cell = Arc::clone(&cell);
        let stop = Arc::clone(ctx.stop);
        let epoch = ctx.epoch;
        let t = std::thread::Builder::new()
            .name(format!("{}-{i}", v.name))
            .spawn(move || sip_udp::run_worker_swappable(socket, cell, epoch, stop, POLL))?;
        ctx.threads.push(t);
    }
    // Dialog expiry: often enough that the table reflects the idle timeout within ~10%.
    let sweep_every =
        (v.idle_timeout / 10).clamp(Duration::from_millis(100), Duration::from_secs(10));
    let (cell2, stop, epoch) = (Arc::clone(&cell), Arc::clone(ctx.stop), ctx.epoch);
    let t = std::thread::Builder::new()
        .name(format!("{}-sweep", v.name))
        .spawn(move || {
            let mut last = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(POLL);
                if last.elapsed() >= sweep_every {
                    cell2.load().sweep(sip_udp::elapsed_nanos(epoch));
                    last = Instant::now();
                }
            }
        })?;
    ctx.threads.push(t);
    tracing::info!(
        vserver = %v.name,
        bind = ?bound,
        workers,
        method = v.method.name(),
        "sip-udp vserver started"
    );
    Ok(VserverHandle {
        name: v.name.clone(),
        protocol: v.protocol,
        bound,
        balancer: Arc::clone(core.balancer()),
        data: DataPath::SipUdp(core),
    })
}

/// fulcrum's Via / Record-Route identity on a vserver: `advertise`, else the bound
/// address, else (wildcard bind) the local address the kernel uses toward the services.
fn local_identity(
    v: &Vserver,
    bound: &[SocketAddr],
    members: &[SocketAddr],
) -> Result<Local, RuntimeError> {
    let setup = |problem: String| RuntimeError::Setup {
        vserver: v.name.clone(),
        problem,
    };
    let first = *bound
        .first()
        .ok_or_else(|| setup("no bind address".into()))?;
    let local = if let Some(adv) = &v.advertise {
        let (host, port) = adv
            .rsplit_once(':')
            .and_then(|(h, p)| p.parse::<u16>().ok().map(|p| (h, p)))
            .ok_or_else(|| setup(format!("advertise `{adv}` is not HOST:PORT")))?;
        Local::new(host, port, Transport::Udp)
    } else if first.ip().is_unspecified() {
        let peer = members
            .first()
            .ok_or_else(|| setup("no services to route toward".into()))?;
        let ip =
            net::local_ip_toward(*peer).map_err(|e| setup(format!("no route to {peer}: {e}")))?;
        tracing::warn!(vserver = %v.name, %ip, "bound to a wildcard without `advertise`: using the address toward the services in Via");
        Local::from_addr(SocketAddr::new(ip, first.port()), Transport::Udp)
    } else {
        Local::from_addr(first, Transport::Udp)
    };
    Ok(local.with_aliases(bound))
}
