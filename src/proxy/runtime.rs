//! Starts the vservers of a config and holds what the operator controls at run time. IO.

use crate::balancer::{Balancer, Health};
use crate::config::{Config, Protocol, Vserver};
use crate::core::sip::SipCore;
use crate::net;
use crate::proxy::shutdown::{Shutdown, Signal};
use crate::proxy::sip_udp;
use crate::sip::{Local, Transport};
use crate::stats::Nanos;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Why the runtime could not start.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// EADDRNOTAVAIL without `freebind`: the most likely cause is a VIP this host does not
    /// hold (yet), so the message names the field that allows it.
    #[error(
        "vserver `{vserver}`: cannot bind {addr}: address not available on this host (set `freebind: true` to bind an address this host does not hold yet, e.g. a standby's VIP)"
    )]
    NotOnHost { vserver: String, addr: SocketAddr },
    #[error("vserver `{vserver}`: cannot bind {addr}: {source}")]
    Bind {
        vserver: String,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("vserver `{vserver}`: {problem}")]
    Setup { vserver: String, problem: String },
    #[error("cannot start a thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// The data path behind a vserver (one variant per protocol).
#[derive(Debug, Clone)]
pub enum DataPath {
    SipUdp(Arc<SipCore>),
    SipTcp(Arc<SipCore>, Arc<crate::proxy::sip_tcp::TcpShared>),
    Udp(Arc<crate::core::udp::UdpCore>),
    Tcp(Arc<crate::proxy::tcp::TcpCore>),
}

impl DataPath {
    /// The vserver's access lists, flood table and drop counters.
    pub fn edge(&self) -> &crate::edge::Edge {
        match self {
            DataPath::SipUdp(c) | DataPath::SipTcp(c, _) => c.edge(),
            DataPath::Udp(c) => c.edge(),
            DataPath::Tcp(c) => c.edge(),
        }
    }
}

/// A running vserver.
#[derive(Debug)]
pub struct VserverHandle {
    pub name: String,
    pub protocol: Protocol,
    /// The addresses actually bound (port 0 resolved).
    pub bound: Vec<SocketAddr>,
    balancer: Arc<Balancer>,
    pub data: DataPath,
    /// The TLS side of a vserver with `tls` (kept across rebuilds; a reload stores new
    /// certificates into it).
    tls: Option<Arc<crate::tls::TlsListener>>,
    /// The links of a sip-udp vserver toward its sip-tcp / sip-tls services (kept across
    /// rebuilds; a reload installs its core there too).
    bridge: Option<Arc<crate::proxy::sip_tcp::TcpShared>>,
}

impl VserverHandle {
    pub(crate) fn new(
        name: String,
        protocol: Protocol,
        bound: Vec<SocketAddr>,
        balancer: Arc<Balancer>,
        data: DataPath,
    ) -> VserverHandle {
        VserverHandle {
            name,
            protocol,
            bound,
            balancer,
            data,
            tls: None,
            bridge: None,
        }
    }

    /// The handle of a sip-udp vserver whose stream services are reached over `bridge`.
    pub(crate) fn with_bridge(
        mut self,
        bridge: Option<Arc<crate::proxy::sip_tcp::TcpShared>>,
    ) -> VserverHandle {
        self.bridge = bridge;
        self
    }

    /// The links of a sip-udp vserver toward its stream services, when it has any.
    pub fn bridge(&self) -> Option<&Arc<crate::proxy::sip_tcp::TcpShared>> {
        self.bridge.as_ref()
    }

    /// The handle of a vserver that terminates TLS with `tls`.
    pub(crate) fn with_tls(mut self, tls: Option<Arc<crate::tls::TlsListener>>) -> VserverHandle {
        self.tls = tls;
        self
    }

    /// The TLS side of the vserver, when it terminates TLS.
    pub fn tls(&self) -> Option<&Arc<crate::tls::TlsListener>> {
        self.tls.as_ref()
    }

    /// The handshake counters toward each member the vserver reaches over TLS, by service
    /// name: a tcp / http core's connectors, a SIP stream vserver's links, a sip-udp
    /// vserver's bridge links. Empty when no member has `tls`.
    pub fn service_tls(&self) -> Vec<(String, Arc<crate::tls::HandshakeCounters>)> {
        match &self.data {
            DataPath::Tcp(core) => core.service_tls(),
            DataPath::SipTcp(_, shared) => shared.service_tls(),
            DataPath::SipUdp(_) => self
                .bridge
                .as_ref()
                .map_or_else(Vec::new, |b| b.service_tls()),
            DataPath::Udp(_) => Vec::new(),
        }
    }

    /// The current balancer (a reload rebuilding the vserver swaps it).
    pub fn balancer(&self) -> &Arc<Balancer> {
        &self.balancer
    }

    /// Swap in the balancer of a vserver rebuilt in place.
    pub(crate) fn set_balancer(&mut self, balancer: Arc<Balancer>) {
        self.balancer = balancer;
    }
}

/// What a data path needs from the runtime to start: the clock epoch, the shutdown its
/// tasks await and its threads watch, a place to register its threads, and the tokio
/// runtime for async paths.
pub(crate) struct StartCtx<'a> {
    pub epoch: Instant,
    pub shutdown: &'a Shutdown,
    pub threads: &'a mut Vec<JoinHandle<()>>,
    pub tokio: &'a tokio::runtime::Handle,
    /// Swappable cores of sip-udp vservers, for reload (see `proxy::reconfig`).
    pub sip_cells: &'a mut Vec<(String, SipUdpCell)>,
    /// Swappable cores of udp vservers, for reload.
    pub udp_cells: &'a mut Vec<(String, UdpCell)>,
    /// Swappable cores of tcp / http vservers, for reload.
    pub tcp_cells: &'a mut Vec<(String, TcpCell)>,
}

/// The current core of a sip-udp vserver; a reload stores a rebuilt one.
pub(crate) type SipUdpCell = Arc<arc_swap::ArcSwap<SipCore>>;

/// The current core of a udp vserver; workers adopt a rebuilt one on their next wake-up.
pub(crate) type UdpCell = Arc<arc_swap::ArcSwap<crate::core::udp::UdpCore>>;

/// The current core of a tcp / http vserver; the accept loops load it per connection.
pub(crate) type TcpCell = Arc<arc_swap::ArcSwap<crate::proxy::tcp::TcpCore>>;

/// How long a shutdown waits for async handlers to finish (and then for what is left on
/// the async runtime) before it logs them and ends them.
pub(crate) const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// All running vservers of one config.
pub struct Runtime {
    epoch: Instant,
    shutdown: Shutdown,
    pub(super) vservers: Vec<VserverHandle>,
    threads: Vec<JoinHandle<()>>,
    pub(super) sip_cells: Vec<(String, SipUdpCell)>,
    pub(super) udp_cells: Vec<(String, UdpCell)>,
    pub(super) tcp_cells: Vec<(String, TcpCell)>,
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
            shutdown: Shutdown::new(),
            vservers: Vec::new(),
            threads: Vec::new(),
            sip_cells: Vec::new(),
            udp_cells: Vec::new(),
            tcp_cells: Vec::new(),
            tokio: Some(tokio),
        };
        super::fd_limit::check_capacity(&config.vservers);
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
        super::elapsed_nanos(self.epoch)
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

    /// Store the certificates of `config` (read again by the reload that made it) into the
    /// running vservers that terminate TLS, and the CAs into the service connectors of tcp /
    /// http cores: new handshakes use them, established connections keep theirs. The names
    /// of the vservers whose listener got a new certificate.
    pub fn reload_tls(&self, config: &Config) -> Vec<String> {
        let mut stored = Vec::new();
        for h in &self.vservers {
            let (Some(listener), Some(v)) =
                (h.tls(), config.vservers.iter().find(|v| v.name == h.name))
            else {
                continue;
            };
            if let Some(tls) = v.tls.as_ref().and_then(|t| t.server_tls()) {
                listener.store(tls);
                stored.push(h.name.clone());
            }
        }
        for (_, cell) in &self.tcp_cells {
            cell.load().store_client_tls(config);
        }
        for h in &self.vservers {
            if let DataPath::SipTcp(_, shared) = &h.data {
                shared.store_client_tls(config);
            }
        }
        for shared in self.vservers.iter().filter_map(VserverHandle::bridge) {
            shared.store_client_tls(config);
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
            shutdown: &self.shutdown,
            threads: &mut self.threads,
            tokio: &tokio,
            sip_cells: &mut self.sip_cells,
            udp_cells: &mut self.udp_cells,
            tcp_cells: &mut self.tcp_cells,
        };
        let handle = match v.protocol {
            Protocol::SipUdp => sip_udp::start(&mut ctx, config, v)?,
            Protocol::SipTcp | Protocol::SipTls => {
                crate::proxy::sip_tcp::start(&mut ctx, config, v)?
            }
            Protocol::Udp => crate::proxy::udp::start(&mut ctx, config, v)?,
            Protocol::Tcp | Protocol::Http => crate::proxy::tcp::start(&mut ctx, config, v)?,
        };
        self.vservers.push(handle);
        Ok(())
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

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// Bind `workers` SO_REUSEPORT UDP sockets on every bind address of `v`: the sockets per
/// address, and the addresses actually bound (port 0 resolved).
pub(crate) fn bind_udp(
    v: &Vserver,
    workers: usize,
) -> Result<(Vec<Vec<std::net::UdpSocket>>, Vec<SocketAddr>), RuntimeError> {
    bind_workers(
        v,
        workers,
        |a, n| net::bind_udp_workers(a, n, listen_options(v)),
        std::net::UdpSocket::local_addr,
    )
}

/// Bind `workers` SO_REUSEPORT TCP listeners on every bind address of `v` (not yet
/// registered with any runtime): the listeners per address, and the addresses actually
/// bound (port 0 resolved).
pub(crate) fn bind_tcp_workers(
    v: &Vserver,
    workers: usize,
) -> Result<(Vec<Vec<std::net::TcpListener>>, Vec<SocketAddr>), RuntimeError> {
    bind_workers(
        v,
        workers,
        |a, n| net::bind_tcp_workers(a, n, listen_options(v)),
        std::net::TcpListener::local_addr,
    )
}

fn listen_options(v: &Vserver) -> net::ListenOptions {
    net::ListenOptions {
        freebind: v.freebind,
    }
}

/// The error for a failed bind of `addr` on `v`.
fn bind_error(v: &Vserver, addr: SocketAddr, source: std::io::Error) -> RuntimeError {
    if source.kind() == std::io::ErrorKind::AddrNotAvailable && !v.freebind {
        return RuntimeError::NotOnHost {
            vserver: v.name.clone(),
            addr,
        };
    }
    RuntimeError::Bind {
        vserver: v.name.clone(),
        addr,
        source,
    }
}

/// `bind(addr, workers)` on every bind address of `v`; the bound address of each is the first
/// socket's (they share it).
fn bind_workers<S>(
    v: &Vserver,
    workers: usize,
    bind: impl Fn(SocketAddr, usize) -> std::io::Result<Vec<S>>,
    local: impl Fn(&S) -> std::io::Result<SocketAddr>,
) -> Result<(Vec<Vec<S>>, Vec<SocketAddr>), RuntimeError> {
    let mut per_addr = Vec::new();
    let mut bound = Vec::new();
    for addr in &v.bind {
        let bind_err = |source| bind_error(v, *addr, source);
        let socks = bind(*addr, workers).map_err(bind_err)?;
        let first = socks
            .first()
            .ok_or_else(|| bind_err(std::io::ErrorKind::InvalidInput.into()))?;
        bound.push(local(first).map_err(bind_err)?);
        per_addr.push(socks);
    }
    Ok((per_addr, bound))
}

/// Bind a TCP listener on every bind address of `v`, registered with the tokio runtime
/// `ctx` runs: the listeners and the addresses actually bound.
pub(crate) fn bind_tcp(
    ctx: &StartCtx<'_>,
    v: &Vserver,
) -> Result<(Vec<tokio::net::TcpListener>, Vec<SocketAddr>), RuntimeError> {
    let _enter = ctx.tokio.enter();
    let mut listeners = Vec::new();
    let mut bound = Vec::new();
    for addr in &v.bind {
        let bind_err = |source| bind_error(v, *addr, source);
        let l = net::bind_tcp_listener(*addr, listen_options(v)).map_err(bind_err)?;
        bound.push(l.local_addr().map_err(bind_err)?);
        listeners.push(tokio::net::TcpListener::from_std(l).map_err(bind_err)?);
    }
    Ok((listeners, bound))
}

/// The TLS side of `v` when it has `tls`: an error when its files were not loaded (a config
/// made from text alone, not read by [`crate::config::load`]).
pub(crate) fn tls_listener(
    v: &Vserver,
) -> Result<Option<Arc<crate::tls::TlsListener>>, RuntimeError> {
    let Some(tls) = &v.tls else {
        return Ok(None);
    };
    let server = tls.server_tls().ok_or_else(|| RuntimeError::Setup {
        vserver: v.name.clone(),
        problem: "`tls` files were not read (load the config from its file)".into(),
    })?;
    Ok(Some(Arc::new(crate::tls::TlsListener::new(server))))
}

/// fulcrum's Via / Record-Route identity on a vserver: `advertise`, else the bound
/// address, else (wildcard bind) the local address the kernel uses toward the services.
pub(crate) fn local_identity(
    v: &Vserver,
    bound: &[SocketAddr],
    members: &[SocketAddr],
    transport: Transport,
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
        Local::new(host, port, transport)
    } else if first.ip().is_unspecified() {
        let peer = members
            .first()
            .ok_or_else(|| setup("no services to route toward".into()))?;
        let ip =
            net::local_ip_toward(*peer).map_err(|e| setup(format!("no route to {peer}: {e}")))?;
        tracing::warn!(vserver = %v.name, %ip, "bound to a wildcard without `advertise`: using the address toward the services in Via");
        Local::from_addr(SocketAddr::new(ip, first.port()), transport)
    } else {
        Local::from_addr(first, transport)
    };
    Ok(local.with_aliases(bound))
}
