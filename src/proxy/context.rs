//! What every data path shares with the runtime that starts it, below both: the start
//! context, the handle of a running vserver, the [`DataPath`] behaviour the runtime, the
//! admin API and reloads ask of a vserver without knowing its protocol, and the binding and
//! identity helpers. IO. Data paths import this module; nothing here imports a data path.

use crate::balancer::{Balancer, Health};
use crate::config::{Config, Protocol, Vserver};
use crate::net;
use crate::proxy::shutdown::Shutdown;
use crate::sip::{Local, Transport};
use crate::stats::Nanos;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
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

/// What a running vserver's data path does for the rest of the process, whatever its
/// protocol. Each data path implements it; the runtime, reloads, metrics and the admin API
/// use nothing else of it, so a new protocol is its own module and one line in
/// `runtime::starter`.
pub trait DataPath: std::fmt::Debug + Send + Sync + AsAny {
    /// The vserver's access lists, flood table and drop counters.
    fn edge(&self) -> &crate::edge::Edge;

    /// The admission of a stream listener's client connections (the file pool, the
    /// per-source limit), else `None`.
    fn gate(&self) -> Option<&crate::budget::Gate> {
        None
    }

    /// The SIP core of a SIP vserver (its counters, dialogs), else `None`.
    fn sip_core(&self) -> Option<&Arc<crate::core::sip::SipCore>> {
        None
    }

    /// The handshake counters toward each member reached over TLS, by service name.
    fn service_tls(&self) -> Vec<(String, Arc<crate::tls::HandshakeCounters>)> {
        Vec::new()
    }

    /// Store the service certificates of `config` (read again by a reload) where this path
    /// makes connections toward its members: new connections use them.
    fn store_client_tls(&self, _config: &Config) {}

    /// Each transport-specific counter, by event name (the SIP counters are the core's).
    fn each_event(&self, _visit: &mut dyn FnMut(&'static str, &AtomicU64)) {}

    /// Close the flows still open on member `service` whose drain timed out, where a
    /// rebuild without it would not (see `Runtime::cut_flows`).
    fn cut(&self, _service: &str) {}

    /// Build the vserver from `v` of a new config aside (`proxy::reconfig`): everything of the
    /// rebuild that can fail is done here, and nothing the running vserver uses changes. The
    /// [`Prepared`] rebuild installs it, or is dropped to leave the vserver as it was.
    fn prepare(&self, config: &Config, v: &Vserver) -> Result<Prepared, RuntimeError>;

    /// The protocols of the vservers this data path runs (and so can rebuild).
    fn protocols(&self) -> &'static [Protocol];
}

/// A value as `Any`, for [`VserverHandle::path`]'s downcast of a `dyn DataPath`.
pub trait AsAny: std::any::Any {
    fn as_any(&self) -> &dyn std::any::Any;
}

impl<T: std::any::Any> AsAny for T {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// How long an accept loop waits after a failed accept: out of descriptors (EMFILE, ENFILE)
/// makes accept fail at once, again and again, so the loop backs off instead of spinning
/// and gives open connections time to end.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The next connection from `listener`. A failed accept is handed to `failed` (to count and
/// log it) and tried again after [`ACCEPT_BACKOFF`]: every accept loop of the process (tcp /
/// http, SIP streams, admin) backs off the same way.
pub(crate) async fn accept(
    listener: &tokio::net::TcpListener,
    mut failed: impl FnMut(&std::io::Error),
) -> (tokio::net::TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(c) => return c,
            Err(e) => {
                failed(&e);
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// What a rebuild is given besides the new config: the clock and each member's health now.
pub struct RebuildCx<'a> {
    pub epoch: Instant,
    pub health_of: &'a dyn Fn(&str) -> Health,
}

impl RebuildCx<'_> {
    /// Nanoseconds since the runtime's start.
    pub fn now(&self) -> Nanos {
        elapsed_nanos(self.epoch)
    }
}

/// What a rebuild changed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rebuilt {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Dialogs carried over to the new core.
    pub dialogs_kept: usize,
}

/// A rebuild built aside by [`DataPath::prepare`], not yet installed. Installing it cannot
/// fail, so a reload that prepared every vserver it rebuilds commits them all or none.
pub struct Prepared(Box<dyn FnOnce(&RebuildCx<'_>) -> Rebuild + Send>);

impl Prepared {
    /// A rebuild that `install` carries out: it swaps the new core in and hands the old
    /// one over (settling its members' health, migrating dialogs), and must not fail.
    pub(crate) fn new(install: impl FnOnce(&RebuildCx<'_>) -> Rebuild + Send + 'static) -> Self {
        Prepared(Box::new(install))
    }

    /// Install the rebuild in the running vserver: what changed, its new balancer and data
    /// path.
    pub fn install(self, cx: &RebuildCx<'_>) -> Rebuild {
        (self.0)(cx)
    }
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared").finish_non_exhaustive()
    }
}

/// A vserver rebuilt in place: what changed, its new balancer and data path.
pub struct Rebuild {
    pub rebuilt: Rebuilt,
    pub balancer: Arc<Balancer>,
    pub data: Arc<dyn DataPath>,
}

/// A running vserver.
#[derive(Debug)]
pub struct VserverHandle {
    pub name: String,
    pub protocol: Protocol,
    /// The addresses actually bound (port 0 resolved).
    pub bound: Vec<SocketAddr>,
    balancer: Arc<Balancer>,
    /// What the vserver runs; a reload rebuilding it swaps in the rebuilt one.
    pub data: Arc<dyn DataPath>,
    /// The TLS side of a vserver with `tls` (kept across rebuilds; a reload stores new
    /// certificates into it).
    tls: Option<Arc<crate::tls::TlsListener>>,
}

impl VserverHandle {
    pub(crate) fn new(
        name: String,
        protocol: Protocol,
        bound: Vec<SocketAddr>,
        balancer: Arc<Balancer>,
        data: Arc<dyn DataPath>,
    ) -> VserverHandle {
        VserverHandle {
            name,
            protocol,
            bound,
            balancer,
            data,
            tls: None,
        }
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

    /// The data path as its own type `P` (for tests and tools that look inside one).
    pub fn path<P: DataPath>(&self) -> Option<&P> {
        // Through the `dyn DataPath`: the `Arc` around it is `Any` too.
        AsAny::as_any(&*self.data).downcast_ref::<P>()
    }

    /// The handshake counters toward each member the vserver reaches over TLS, by service
    /// name. Empty when no member has `tls`.
    pub fn service_tls(&self) -> Vec<(String, Arc<crate::tls::HandshakeCounters>)> {
        self.data.service_tls()
    }

    /// The current balancer (a reload rebuilding the vserver swaps it).
    pub fn balancer(&self) -> &Arc<Balancer> {
        &self.balancer
    }

    /// Swap in the balancer of a vserver rebuilt in place.
    pub(crate) fn set_balancer(&mut self, balancer: Arc<Balancer>) {
        self.balancer = balancer;
    }

    /// Swap in the data path of a vserver rebuilt in place.
    pub(crate) fn set_data(&mut self, data: Arc<dyn DataPath>) {
        self.data = data;
    }
}

/// What a data path needs from the runtime to start: the clock epoch, the shutdown its
/// tasks await and its threads watch, a place to register its threads, and the tokio
/// runtime for async paths.
pub(crate) struct StartCtx<'a> {
    pub epoch: Instant,
    /// The process's open files for client connections and sessions ([`crate::budget`]).
    pub budget: &'a Arc<crate::budget::FileBudget>,
    pub shutdown: &'a Shutdown,
    pub threads: &'a mut Vec<JoinHandle<()>>,
    pub tokio: &'a tokio::runtime::Handle,
    /// Where the vserver's workers show their progress to the watchdog.
    pub liveness: &'a Arc<crate::liveness::Liveness>,
    /// Every vserver's evictable client connections (the file pool is the process's).
    pub evictors: &'a Arc<crate::proxy::evict::Evictors>,
    /// SIP message capture, tapped by the SIP data paths (docs/capture.md).
    pub capture: &'a Arc<crate::capture::Capture>,
}

/// How long a shutdown waits for async handlers to finish (and then for what is left on
/// the async runtime) before it logs them and ends them.
pub(crate) const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

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

/// The sockets a sip-udp vserver sends to its services from (`service_source`, port 0 taking
/// the vserver's first bound port), `workers` of them with SO_REUSEPORT, and their address;
/// `None` without a `service_source`.
pub(crate) fn bind_service_source(
    v: &Vserver,
    bound: &[SocketAddr],
    workers: usize,
) -> Result<Option<(Vec<std::net::UdpSocket>, SocketAddr)>, RuntimeError> {
    let Some(mut addr) = v.service_source else {
        return Ok(None);
    };
    if addr.port() == 0 {
        addr.set_port(bound.first().map_or(0, SocketAddr::port));
    }
    let socks = net::bind_udp_workers(addr, workers, listen_options(v))
        .map_err(|e| bind_error(v, addr, e))?;
    let bound = match socks.first().map(std::net::UdpSocket::local_addr) {
        Some(Ok(a)) => a,
        Some(Err(e)) => return Err(bind_error(v, addr, e)),
        None => return Err(bind_error(v, addr, std::io::ErrorKind::InvalidInput.into())),
    };
    Ok(Some((socks, bound)))
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

/// How often the dialog sweepers look at the current core's sweep interval (a reload may
/// shorten it). Shutdown does not wait on it: see `proxy::shutdown`.
pub const POLL: Duration = Duration::from_millis(100);

/// Nanoseconds since `epoch` (the shell's clock, handed to the pure core).
pub fn elapsed_nanos(epoch: Instant) -> Nanos {
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
