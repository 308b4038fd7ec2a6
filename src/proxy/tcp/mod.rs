//! The `tcp` and `http` vservers: per-connection TCP proxying on tokio.
//!
//! Per accepted connection: read the first bytes when the method needs them (the HTTP/1.x
//! request head for `url_hash` / `domain_hash` / `token` on `http`; `offset + length` bytes
//! for `token` on the payload of `tcp`), bounded in size and time; choose a member; connect
//! with a timeout, and on failure pass over that member and choose again (the key's next
//! ranked member, or the method's next pick), counting each failure and reporting it (and a
//! completed connect) for passive ejection (docs/ejection.md); then copy both ways
//! until both sides have finished, honouring half-close (a FIN from one side becomes a
//! shutdown of the write side toward the other), or until the idle timeout.
//!
//! With TLS on either side (docs/tls.md) a connection takes the stream path instead
//! ([`serve_stream`]): the client's handshake runs on the connection's own task under the
//! vserver's `tls_handshake_timeout` (the accept loop never waits on it), the first bytes are
//! read from the decrypted stream, a member with `tls` is reached by a TCP connect, the PROXY
//! header in clear, then the TLS handshake (a failed one passes over the member like a failed
//! connect), and both directions are copied through [`MaybeTls`] streams with a buffer each.
//! Plain to plain keeps the single-scratch-buffer relay.
//!
//! The decision ([`TcpCore::key_input`], [`TcpCore::first_bytes_needed`]) is pure; the rest
//! is the shell. Threading is HAProxy's: `workers` threads, each with a single-threaded
//! tokio runtime and its own SO_REUSEPORT listener, a connection served start to end by the
//! thread that accepted it. Memory of an idle connection is its task and two sockets: bytes
//! are copied through one scratch buffer per worker thread, and a connection holds a buffer
//! of its own only while a write toward a slow peer is pending.

use crate::balancer::{Balancer, KeyInput};
use crate::budget::Activity;
use crate::config::{Config, Protocol, ProxyProtocol, Vserver};
use crate::core::CONNECT_TIMEOUT;
use crate::core::tcp::{ConnectionKeys, FirstBytes, Handshake};
use crate::eject::{Cause, Failure};
use crate::http::{self};
use crate::net;
use crate::proxy::context::elapsed_nanos;
use crate::proxy::context::{
    DataPath, Prepared, Rebuild, RuntimeError, StartCtx, VserverHandle, bind_tcp_workers,
};
use crate::proxy::evict::{Evictable, Registration, admit_evicting};
use crate::proxy::proxy_protocol::{self, MAX_V2_LEN, Transport};
use crate::proxy::reconfig;
use crate::proxy::shutdown::Signal;
use crate::route::Target;
use crate::stats::{LogLimiter, bump};
use crate::stats::{Nanos, ServiceCounters};
use crate::tls::{ClientTls, HandshakeCounters, MaybeTls, TlsConnector, TlsListener};
use arc_swap::ArcSwap;
use nix::sys::socket::{MsgFlags, recv};
use socket2::{Domain, Protocol as SockProtocol, SockRef, Socket, Type};
use std::cell::RefCell;
use std::io;
use std::net::{Shutdown, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, Interest};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

mod tls_path;
use tls_path::serve_stream;

/// Longest wait for the first request head (or token bytes); a slower client is balanced
/// without a key (fallback), not held. Never longer than the vserver's idle timeout.
pub(crate) const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(10);

/// Scratch buffer per worker thread, shared by every connection that thread polls.
const SCRATCH_BYTES: usize = 64 * 1024;

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0u8; SCRATCH_BYTES]);
}

/// Counters of one tcp / http vserver.
#[derive(Debug, Default)]
pub struct TcpCounters {
    pub accepted: AtomicU64,
    /// Connections refused because `max_sessions` were open.
    pub refused: AtomicU64,
    pub connect_failures: AtomicU64,
    /// Connections closed because no member could take them (or all connects failed).
    pub no_service: AtomicU64,
    pub idle_timeouts: AtomicU64,
    /// Connections closed because their service's drain timed out.
    pub drain_cuts: AtomicU64,
    /// First bytes not complete in time / too large / not HTTP: balanced by the fallback.
    pub first_bytes_timeouts: AtomicU64,
    pub heads_unparseable: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    /// Errors tagged by side (reset, broken pipe...).
    pub client_errors: AtomicU64,
    pub service_errors: AtomicU64,
    pub accept_errors: AtomicU64,
    /// Connects toward a service that found no local port free (EADDRNOTAVAIL): the
    /// ephemeral range (`net.ipv4.ip_local_port_range`, about 28,000 ports) is shared by all
    /// connections to one service address (docs/limits.md).
    pub ports_exhausted: AtomicU64,
}

impl TcpCounters {
    /// Each counter by its event name, in the order metrics lists them.
    /// (`evicted`, the idle connections closed to make room while the file pool ran low, is
    /// counted by the vserver's [`Evictable`], kept across reloads.)
    pub fn events(&self) -> [(&'static str, &AtomicU64); 12] {
        [
            ("accepted", &self.accepted),
            ("refused", &self.refused),
            ("connect_failures", &self.connect_failures),
            ("no_service", &self.no_service),
            ("idle_timeouts", &self.idle_timeouts),
            ("drain_cuts", &self.drain_cuts),
            ("first_bytes_timeouts", &self.first_bytes_timeouts),
            ("heads_unparseable", &self.heads_unparseable),
            ("client_errors", &self.client_errors),
            ("service_errors", &self.service_errors),
            ("accept_errors", &self.accept_errors),
            ("ports_exhausted", &self.ports_exhausted),
        ]
    }
}

/// Shared state of one tcp / http vserver.
pub struct TcpCore {
    pub name: String,
    /// What is read before choosing, and the key hashed from it.
    keys: ConnectionKeys,
    balancer: Arc<Balancer>,
    member_addrs: Vec<SocketAddr>,
    idle_timeout: Duration,
    first_timeout: Duration,
    max_connections: usize,
    /// Open client connections; shared with the cores a reload builds from this one, so
    /// connections accepted before a reload still count toward `max_sessions`.
    live: Arc<AtomicUsize>,
    /// Admission of client connections: two open files each (client and service side) from
    /// the process's pool, at most `max_per_source` from one source (docs/limits.md); kept
    /// across reloads.
    gate: Arc<crate::budget::Gate>,
    /// Its client connections, for eviction while the pool runs low; kept across reloads.
    conns: Arc<Evictable>,
    /// Every vserver's, where a new connection makes room while the pool runs low.
    evictors: Arc<crate::proxy::evict::Evictors>,
    /// Rate limit of the warnings its connections log.
    log: LogLimiter,
    /// Per member: raised when the member's drain times out, which closes the connections
    /// still open on it. Shared by name with the cores a reload builds from this one.
    cuts: Vec<Arc<watch::Sender<bool>>>,
    /// Access lists and flood control, checked per accepted connection.
    edge: crate::edge::Edge,
    transparent: bool,
    send_proxy: bool,
    /// Per member: TLS toward it (`tls` on the service), by member index.
    connectors: Vec<Option<Arc<TlsConnector>>>,
    /// Whether any member is reached over TLS (read per accepted connection).
    tls_members: bool,
    epoch: Instant,
    pub counters: TcpCounters,
}

impl std::fmt::Debug for TcpCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpCore")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl TcpCore {
    pub fn new(config: &Config, v: &Vserver, epoch: Instant) -> TcpCore {
        let connectors: Vec<_> = v
            .members()
            .filter_map(|i| config.services.get(i))
            .map(|s| {
                let tls = s.tls.as_ref()?.client_tls(s.address.ip())?;
                Some(Arc::new(TlsConnector::new(tls)))
            })
            .collect();
        let keys = ConnectionKeys::new(v);
        TcpCore {
            name: v.name.clone(),
            balancer: Arc::new(Balancer::new(config, v)),
            member_addrs: v
                .members()
                .filter_map(|i| config.services.get(i))
                .map(|s| s.address)
                .collect(),
            idle_timeout: v.idle_timeout,
            first_timeout: first_timeout(v, &keys),
            max_connections: v.max_sessions,
            live: Arc::new(AtomicUsize::new(0)),
            log: LogLimiter::default(),
            gate: Arc::new(crate::budget::Gate::new(
                Arc::new(crate::budget::FileBudget::unlimited()),
                2,
                v.max_per_source,
            )),
            conns: Arc::new(Evictable::named(&v.name)),
            evictors: Arc::default(),
            cuts: v
                .members()
                .map(|_| Arc::new(watch::Sender::new(false)))
                .collect(),
            edge: v.edge(None),
            transparent: v.transparent,
            send_proxy: v.send_proxy == Some(ProxyProtocol::V2),
            tls_members: connectors.iter().any(Option::is_some),
            connectors,
            epoch,
            counters: TcpCounters::default(),
            keys,
        }
    }

    /// Store the service CAs and client certificates of `config` (read again by a reload)
    /// into the members' connectors, by service name: new connections use them.
    pub(crate) fn store_client_tls(&self, config: &Config) {
        for (m, connector) in self.balancer.members().iter().zip(&self.connectors) {
            let (Some(connector), Some(s)) =
                (connector, config.services.iter().find(|s| s.name == m.name))
            else {
                continue;
            };
            if let Some(tls) = s.tls.as_ref().and_then(|t| t.client_tls(s.address.ip())) {
                connector.store(tls);
            }
        }
    }

    /// The core of a reload of the vserver `old` served: members it keeps share their
    /// counters with `old` (connections established before the reload stay counted on
    /// their service), their TLS handshake counters too, and the admission of client
    /// connections carries over (its per-source limit changes only when the core is
    /// installed: building one aside changes nothing the running vserver uses).
    pub fn rebuilt(config: &Config, v: &Vserver, epoch: Instant, old: &TcpCore) -> TcpCore {
        let mut core = TcpCore::new(config, v, epoch);
        core.balancer = Arc::new(Balancer::carrying(config, v, &old.balancer));
        core.live = Arc::clone(&old.live);
        core.gate = Arc::clone(&old.gate);
        core.conns = Arc::clone(&old.conns);
        core.evictors = Arc::clone(&old.evictors);
        core.edge = v.edge(Some(&old.edge));
        let old_names = old.balancer.members();
        let members = core.balancer.members().iter();
        for ((m, cut), connector) in members
            .zip(core.cuts.iter_mut())
            .zip(core.connectors.iter_mut())
        {
            let Some(j) = old_names.iter().position(|o| o.name == m.name) else {
                continue;
            };
            if let Some(c) = old.cuts.get(j) {
                *cut = Arc::clone(c);
            }
            if let (Some(new), Some(Some(was))) = (connector.as_ref(), old.connectors.get(j)) {
                let tls = ClientTls::clone(&new.current());
                *connector = Some(Arc::new(TlsConnector::carrying(tls, Some(was))));
            }
        }
        core
    }

    /// The handshake counters of each member reached over TLS, by service name.
    /// The admission of the vserver's client connections.
    pub fn gate(&self) -> &crate::budget::Gate {
        &self.gate
    }

    pub fn service_tls(&self) -> Vec<(String, Arc<HandshakeCounters>)> {
        let members = self.balancer.members().iter();
        members
            .zip(&self.connectors)
            .filter_map(|(m, c)| Some((m.name.clone(), Arc::clone(&c.as_ref()?.counters))))
            .collect()
    }

    /// Close the connections open on member `service` (its drain timed out). `false` when
    /// it is not a member.
    pub fn cut(&self, service: &str) -> bool {
        let m = self
            .balancer
            .members()
            .iter()
            .position(|m| m.name == service);
        match m.and_then(|m| self.cuts.get(m)) {
            Some(c) => {
                let open = m
                    .and_then(|m| self.balancer.counters(m))
                    .map_or(0, |c| c.active());
                self.counters.drain_cuts.fetch_add(open, Ordering::Relaxed);
                c.send_replace(true);
                true
            }
            None => false,
        }
    }

    /// Resolves once member `m`'s connections are cut (never for an unknown member).
    async fn cut_of(&self, m: Option<usize>) {
        match m.and_then(|m| self.cuts.get(m)) {
            Some(c) => {
                let mut rx = c.subscribe();
                if rx.wait_for(|cut| *cut).await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending().await,
        }
    }

    pub fn balancer(&self) -> &Arc<Balancer> {
        &self.balancer
    }

    pub fn edge(&self) -> &crate::edge::Edge {
        &self.edge
    }

    /// True when some member is reached over TLS.
    pub fn has_tls_members(&self) -> bool {
        self.tls_members
    }

    /// Open client connections.
    pub fn connections(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// True when a connection's local address matters: the key uses it (`dest_ip_hash`,
    /// `source_dest_ip_hash`) or a PROXY header carries it.
    pub fn needs_local(&self) -> bool {
        self.send_proxy || self.keys.reads_local()
    }

    /// What must be read before choosing.
    pub fn first_bytes_needed(&self) -> FirstBytes {
        self.keys.first_bytes_needed()
    }

    /// True when `buf` holds enough to choose (or can never be enough).
    pub fn is_first_complete(&self, buf: &[u8]) -> bool {
        self.keys.is_first_complete(buf)
    }

    /// The balancer's key for a connection from `client` to `local` whose first bytes are
    /// `first`; an HTTP head that does not parse is counted.
    pub fn key_input(&self, first: &[u8], client: SocketAddr, local: SocketAddr) -> KeyInput {
        self.key_input_in(0, first, client, local)
    }

    /// [`TcpCore::key_input`] for pool `pool` (0: the vserver's own; `k`: the `k`-th rule's).
    pub fn key_input_in(
        &self,
        pool: usize,
        first: &[u8],
        client: SocketAddr,
        local: SocketAddr,
    ) -> KeyInput {
        let (key, head_unparseable) = self.keys.key_input_in(pool, first, client, local);
        if head_unparseable {
            bump(&self.counters.heads_unparseable);
        }
        key
    }

    /// What the routing rules (docs/routing.md) make of a connection from `client` to `local`
    /// whose first bytes are `first` (`handshake`: the server name and negotiated protocol of
    /// TLS terminated here), counted per rule. Without rules: the vserver's own pool.
    pub fn routed(
        &self,
        first: &[u8],
        handshake: Option<Handshake<'_>>,
        client: SocketAddr,
        local: SocketAddr,
    ) -> Routed<'_> {
        let Some(routes) = self.balancer.routes() else {
            return Routed::Pool(0, None);
        };
        let d = self.keys.route(routes, first, handshake, client, local);
        self.balancer.count_route(d.rule, d.target);
        match d.target {
            Target::Pool(p) => Routed::Pool(*p, Some(d.rule)),
            refusal => Routed::Refused(refusal),
        }
    }

    fn now(&self) -> Nanos {
        elapsed_nanos(self.epoch)
    }
}

/// What the routing rules make of a connection ([`TcpCore::routed`]).
#[derive(Debug)]
pub enum Routed<'r> {
    /// Choose in this pool; the rule that chose it (`Some(None)`: the default), to count its
    /// pool's unavailability against (`None` without rules).
    Pool(usize, Option<Option<usize>>),
    /// A rule (or the default) drops the connection, or answers it (http).
    Refused(&'r Target),
}

/// The bound on reading the first bytes: a ClientHello read for the rules alone has its own
/// (`client_hello_timeout`); never longer than the idle timeout.
fn first_timeout(v: &Vserver, keys: &ConnectionKeys) -> Duration {
    let bound = match &v.routes {
        Some(r) if keys.reads_hello_only() => r.client_hello_timeout,
        _ => FIRST_BYTES_TIMEOUT,
    };
    bound.min(v.idle_timeout)
}

/// The HTTP response of a rejecting rule, the connection closed after it.
fn rejection(code: u16, reason: &str) -> Vec<u8> {
    format!("HTTP/1.1 {code} {reason}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        .into_bytes()
}

/// The current core of a tcp / http vserver; the accept loops load it per connection.
pub(crate) type TcpCell = Arc<ArcSwap<TcpCore>>;

/// A running tcp / http vserver: the core it runs now and the cell its accept loops load
/// it from.
#[derive(Debug)]
pub struct TcpPath {
    core: Arc<TcpCore>,
    cell: TcpCell,
}

impl TcpPath {
    /// The core the vserver runs now.
    pub fn core(&self) -> &Arc<TcpCore> {
        &self.core
    }
}

impl DataPath for TcpPath {
    fn edge(&self) -> &crate::edge::Edge {
        self.core.edge()
    }

    fn gate(&self) -> Option<&crate::budget::Gate> {
        Some(self.core.gate())
    }

    fn service_tls(&self) -> Vec<(String, Arc<HandshakeCounters>)> {
        self.core.service_tls()
    }

    fn store_client_tls(&self, config: &Config) {
        self.cell.load().store_client_tls(config);
    }

    fn each_event(&self, visit: &mut dyn FnMut(&'static str, &AtomicU64)) {
        for (name, c) in self.core.counters.events() {
            visit(name, c);
        }
        visit("evicted", &self.core.conns.evicted);
    }

    fn cut(&self, service: &str) {
        self.cell.load().cut(service);
    }

    /// A core built aside from the current one ([`TcpCore::rebuilt`]); nothing fails. The
    /// per-source limit of the admission the cores share changes when it is installed.
    fn prepare(&self, config: &Config, v: &Vserver) -> Result<Prepared, RuntimeError> {
        let old = self.cell.load_full();
        let core = Arc::new(TcpCore::rebuilt(config, v, old.epoch, &old));
        let (cell, max_per_source) = (Arc::clone(&self.cell), v.max_per_source);
        Ok(Prepared::new(move |cx| {
            core.gate.set_max_per_source(max_per_source);
            let rebuilt = reconfig::swap_core(&cell, &old, &core, cx, TcpCore::balancer);
            Rebuild {
                rebuilt,
                balancer: Arc::clone(core.balancer()),
                data: Arc::new(TcpPath { core, cell }),
            }
        }))
    }

    fn protocols(&self) -> &'static [Protocol] {
        &[Protocol::Tcp, Protocol::Http]
    }
}

/// Start a tcp / http vserver: `workers` threads (one per core by default), each with its
/// own single-threaded tokio runtime and its own SO_REUSEPORT listener on every bind
/// address. The kernel spreads incoming connections over the listeners, and a connection
/// lives on the thread that accepted it (no work stealing, no wake-ups across threads).
pub(crate) fn start(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
) -> Result<VserverHandle, RuntimeError> {
    let tls = crate::proxy::context::tls_listener(v)?;
    let mut core = TcpCore::new(config, v, ctx.epoch);
    core.gate = Arc::new(crate::budget::Gate::new(
        Arc::clone(ctx.budget),
        2,
        v.max_per_source,
    ));
    core.evictors = Arc::clone(ctx.evictors);
    let conns: Arc<dyn crate::proxy::evict::IdleClients> = core.conns.clone();
    ctx.evictors.add(Arc::downgrade(&conns));
    let core = Arc::new(core);
    let workers = net::worker_count(v.workers);
    let (per_addr, bound) = bind_tcp_workers(v, workers)?;
    let cell: TcpCell = Arc::new(ArcSwap::new(Arc::clone(&core)));
    // Worker `w` takes the `w`-th listener of every bind address.
    let mut per_worker: Vec<Vec<(SocketAddr, std::net::TcpListener)>> =
        (0..workers).map(|_| Vec::new()).collect();
    for (addr, listeners) in bound.iter().zip(per_addr) {
        for (mine, l) in per_worker.iter_mut().zip(listeners) {
            mine.push((*addr, l));
        }
    }
    for (i, listeners) in per_worker.into_iter().enumerate() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // Probed by the watchdog while the worker holds the heart.
        let heart = ctx
            .liveness
            .runtime(format!("{}-{i} runtime", v.name), rt.handle().clone());
        // Registered here, with the worker's runtime, so a failure stops the start.
        let listeners = {
            let _enter = rt.enter();
            listeners
                .into_iter()
                .map(|(addr, l)| {
                    TcpListener::from_std(l).map_err(|source| RuntimeError::Bind {
                        vserver: v.name.clone(),
                        addr,
                        source,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        let cell = Arc::clone(&cell);
        let signal = ctx.shutdown.signal();
        let tls = tls.clone();
        let thread = std::thread::Builder::new()
            .name("fulcrum-tcp".into())
            .spawn(move || {
                let _heart = heart;
                worker(rt, cell, tls, listeners, signal);
            })?;
        ctx.threads.push(thread);
    }
    tracing::info!(vserver = %v.name, protocol = v.protocol.name(), bind = ?bound, method = v.method.name(), workers, "tcp vserver started");
    Ok(VserverHandle::new(
        v.name.clone(),
        v.protocol,
        bound,
        Arc::clone(core.balancer()),
        Arc::new(TcpPath { core, cell }),
    )
    .with_tls(tls))
}

/// One worker thread: its accept loops and the connections they accept, until the
/// runtime's shutdown signal; the connections still open then are closed with it.
///
/// The worker owns every task of its runtime, so it alone awaits the signal: returning from
/// `block_on` and dropping the runtime ends the accept loops and the connections at their
/// next await (their sockets close as they drop), and the runtime's join of this thread is
/// the wait for them. A connection's copy loop never looks at the signal itself: that would
/// add a shared lock to every wake-up of the data path.
fn worker(
    rt: tokio::runtime::Runtime,
    cell: TcpCell,
    tls: Option<Arc<TlsListener>>,
    listeners: Vec<TcpListener>,
    mut signal: Signal,
) {
    rt.block_on(async {
        tokio::spawn(timer_anchor());
        for l in listeners {
            tokio::spawn(accept_loop(Arc::clone(&cell), tls.clone(), l));
        }
        signal.recv().await;
    });
    drop(rt);
}

/// How far away the worker's anchor timer ([`timer_anchor`]) always is: less than the
/// connect timeout, so that one and the idle timer (its default and common settings) fall
/// after it. A shorter timer (a sub-second `idle_timeout`) still wakes the driver.
const ANCHOR: Duration = Duration::from_secs(1);
const _: () = assert!(ANCHOR.as_nanos() < CONNECT_TIMEOUT.as_nanos());

/// Keeps one timer of the worker's runtime pending, at most [`ANCHOR`] away. Arming a timer
/// wakes the runtime's driver (a write to its eventfd, one system call) when the new
/// deadline comes before the driver's next wake-up, or the driver has none: on a worker with
/// no other timer, every connection's connect timeout would. With this one pending, a
/// connection's timers fall after the driver's next wake-up and are armed without a system
/// call; the anchor costs one wake-up a second.
async fn timer_anchor() {
    let mut tick = tokio::time::interval(ANCHOR);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}

async fn accept_loop(cell: TcpCell, tls: Option<Arc<TlsListener>>, listener: TcpListener) {
    let log = LogLimiter::default();
    loop {
        let (stream, peer) = crate::proxy::context::accept(&listener, |e| {
            let core = cell.load();
            bump(&core.counters.accept_errors);
            if log.allow(core.now()) {
                tracing::warn!(vserver = %core.name, error = %e, "accept failed");
            }
        })
        .await;
        // Loaded per connection, after the accept: a reload swaps in a rebuilt core, and
        // connections already accepted keep the core (members, addresses) they began with.
        let core = cell.load_full();
        bump(&core.counters.accepted);
        // Every connection is a new flow: the access lists, then flood control; a
        // refused one is closed at once (dropped).
        if !core.edge.admits(peer.ip())
            || core.edge.has_flood() && !core.edge.admits_new(peer.ip(), core.now())
        {
            continue;
        }
        // Its place under the vserver's bound first: a connection refused anyway must not
        // evict another on its way out.
        let reserved = core
            .live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < core.max_connections).then_some(n + 1)
            });
        if reserved.is_err() {
            bump(&core.counters.refused);
            if log.allow(core.now()) {
                tracing::warn!(vserver = %core.name, max = core.max_connections, "connection limit reached: connection refused");
            }
            continue;
        }
        // Then its place among its source's and its files from the process's pool, held by
        // the connection's task (docs/limits.md). Only a pool running low makes room by
        // evicting an idle connection, and only for a connection nothing else refuses.
        let evict = || core.evictors.evict(core.now());
        let admitted = match admit_evicting(&core.gate, peer.ip(), evict) {
            Ok(a) => a,
            Err(why) => {
                refuse(&core, &log, peer, why);
                continue;
            }
        };
        // TLS on either side takes the stream path; plain to plain keeps the
        // single-buffer relay below. Registered for eviction before the task first runs: the
        // worker's runtime is single-threaded, so the task starts only once this loop awaits
        // (and an entry whose task ended anyway is passed over by the eviction).
        let activity = Arc::new(Activity::new(core.now()));
        let id = core.conns.next_id();
        let conns = Arc::clone(&core.conns);
        let evictors = Arc::clone(&core.evictors);
        let stream_path = tls.is_some() || core.has_tls_members();
        let tls = tls.clone();
        let task = tokio::spawn({
            let activity = Arc::clone(&activity);
            async move {
                let _registration = Registration {
                    table: Arc::clone(&core.conns),
                    id,
                };
                // Here, not in the accept loop: a connection for which an idle one was
                // evicted waits for that one's files to come back.
                let _admission = match admitted.files(&core.gate).await {
                    Ok(a) => a,
                    Err(why) => {
                        refuse(&core, &core.log, peer, why);
                        return;
                    }
                };
                if stream_path {
                    serve_stream(core, stream, peer, tls, &activity).await;
                } else {
                    serve(core, stream, peer, &activity).await;
                }
            }
        });
        conns.register(&evictors, id, activity, task.abort_handle());
    }
}

/// A connection its source's limit or the file pool refused: its place under the vserver's
/// bound goes back, and it is counted and logged.
fn refuse(core: &TcpCore, log: &LogLimiter, peer: SocketAddr, why: crate::budget::Refusal) {
    core.live.fetch_sub(1, Ordering::AcqRel);
    bump(&core.counters.refused);
    if log.allow(core.now()) {
        tracing::warn!(vserver = %core.name, %peer, reason = why.name(), "connection refused");
    }
}

/// Gives back a connection slot, and the member's open-connection count, when the
/// connection's task ends however it ends.
struct Live<'a> {
    core: &'a TcpCore,
    member: Option<&'a ServiceCounters>,
    /// The member chosen (for its drain's cut).
    index: Option<usize>,
}

impl Drop for Live<'_> {
    fn drop(&mut self) {
        let _ = self
            .core
            .live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(1))
            });
        if let Some(c) = self.member {
            c.close();
        }
    }
}

async fn serve(core: Arc<TcpCore>, client: TcpStream, peer: SocketAddr, activity: &Activity) {
    let mut live = Live {
        core: &core,
        member: None,
        index: None,
    };
    // The local address costs a system call: asked only when the key or a PROXY header
    // uses it (the placeholder is never read otherwise, see `needs_local`).
    let local = if core.needs_local() {
        match client.local_addr() {
            Ok(a) => a,
            Err(_) => {
                bump(&core.counters.client_errors);
                return;
            }
        }
    } else {
        SocketAddr::from(([0, 0, 0, 0], 0))
    };
    // TCP_NODELAY is inherited from the listener (`net::bind_tcp_workers`).
    let first = match read_first(&core, &client).await {
        Ok(Some(b)) => b,
        // The client left before sending anything a member could be chosen for.
        Ok(None) => return,
        Err(_) => {
            bump(&core.counters.client_errors);
            return;
        }
    };
    let (pool, rule) = match core.routed(&first, None, peer, local) {
        Routed::Pool(p, rule) => (p, rule),
        Routed::Refused(t) => {
            if let Target::Reject { code, reason } = t {
                let _ = write_all(&client, &rejection(*code, reason)).await;
            }
            return;
        }
    };
    let key = core.key_input_in(pool, &first, peer, local);
    let Some(upstream) = connect_any(&core, pool, key, peer, &mut live).await else {
        bump(&core.counters.no_service);
        if let Some(rule) = rule {
            core.balancer.count_route_unavailable(rule);
        }
        return;
    };
    // Counted open on its member by `connect_any` (`live` gives it back).
    let counters = live.member;
    let member = live.index;
    if let Some(c) = counters {
        c.record_request();
    }
    let _ = upstream.set_nodelay(true);
    // The PROXY header and the bytes already read go first, in one write; without a header
    // the bytes already read are written as they are.
    // The client's own bytes among them: the PROXY header is fulcrum's, not traffic.
    let first_len = first.len() as u64;
    let prefix = if core.send_proxy {
        let mut hdr = [0u8; MAX_V2_LEN];
        let n = proxy_protocol::encode_v2(peer, local, Transport::Stream, &mut hdr);
        let mut p = Vec::with_capacity(n + first.len());
        p.extend_from_slice(&hdr[..n]);
        p.extend_from_slice(&first);
        p
    } else {
        first
    };
    if !prefix.is_empty() {
        if write_all(&upstream, &prefix).await.is_err() {
            bump(&core.counters.service_errors);
            return;
        }
        if first_len > 0 {
            // Counted like relayed bytes: for the vserver and, for least_bandwidth and
            // least_packets, for the service.
            core.counters
                .bytes_in
                .fetch_add(first_len, Ordering::Relaxed);
            if let Some(c) = counters {
                c.record_traffic(first_len, 1, core.now());
            }
        }
    }
    drop(prefix);
    // The client's bytes already went to the service: its answer to them is timed from now.
    let asked_at = if first_len > 0 { core.now().max(1) } else { 0 };
    tokio::select! {
        () = relay(&core, &client, &upstream, counters, asked_at, activity) => {}
        () = core.cut_of(member) => {}
    }
}

/// Read what the method needs before choosing: `Some(bytes)` (possibly incomplete after
/// the timeout or at the size bound), `None` when the client closed without sending.
async fn read_first(core: &TcpCore, client: &TcpStream) -> io::Result<Option<Vec<u8>>> {
    if !core.keys.reads_first() {
        return Ok(Some(Vec::new()));
    }
    let deadline = tokio::time::Instant::now() + core.first_timeout;
    let mut buf: Vec<u8> = Vec::new();
    loop {
        if core.is_first_complete(&buf) || buf.len() >= http::MAX_HEAD {
            return Ok(Some(buf));
        }
        match tokio::time::timeout_at(deadline, client.readable()).await {
            Err(_) => {
                bump(&core.counters.first_bytes_timeouts);
                return Ok(if buf.is_empty() { None } else { Some(buf) });
            }
            Ok(r) => r?,
        }
        let room = http::MAX_HEAD - buf.len();
        let got = SCRATCH.with_borrow_mut(|s| {
            let n = s.len().min(room);
            client
                .try_read(&mut s[..n])
                .inspect(|&k| buf.extend_from_slice(&s[..k]))
        });
        match got {
            Ok(0) => return Ok(if buf.is_empty() { None } else { Some(buf) }),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}

/// Connect to the member the method chooses, trying the next ones on failure: a member
/// whose connect fails is passed over for this connection. The member tried is counted open
/// in `live` from the moment it is chosen (see below), and stays so on success; `live` gives
/// it back when the connection ends, or if the task ends meanwhile.
async fn connect_any<'a>(
    core: &'a TcpCore,
    pool: usize,
    key: KeyInput,
    client: SocketAddr,
    live: &mut Live<'a>,
) -> Option<TcpStream> {
    connect_any_then(core, pool, key, client, live, |_, s| {
        std::future::ready(Ok(s))
    })
    .await
}

/// [`connect_any`] with `finish` run on each connected stream (the PROXY header and TLS of
/// [`connect_any_stream`]); a member whose `finish` fails is passed over like a failed connect.
async fn connect_any_then<'a, T, F, Fut>(
    core: &'a TcpCore,
    pool: usize,
    key: KeyInput,
    client: SocketAddr,
    live: &mut Live<'a>,
    finish: F,
) -> Option<T>
where
    F: Fn(usize, TcpStream) -> Fut,
    Fut: std::future::Future<Output = Result<T, (Cause, &'static str)>>,
{
    let mut failed: Vec<usize> = Vec::new();
    loop {
        // Within the pool the routing rules chose (0: the vserver's own, without rules).
        let choice = core
            .balancer
            .choose_in(pool, key, core.now(), &|m| failed.contains(&m))?;
        let addr = core.member_addrs.get(choice.member).copied()?;
        // Counted on the member from the moment it is chosen, not once connected: the
        // connections of one burst, all chosen before any connect completes, must see each
        // other (max_clients, least_connection, bounded loads). A failed connect gives it
        // back here.
        live.member = core.balancer.counters(choice.member);
        live.index = Some(choice.member);
        if let Some(c) = live.member {
            c.open();
        }
        // What the failure says of the service, for passive ejection (docs/ejection.md):
        // `None` for fulcrum's own local errors, which never count against it; `local` when
        // it is one, which its monitor does not hear of either.
        let mut local = false;
        let cause = match tokio::time::timeout(
            CONNECT_TIMEOUT,
            connect(addr, client, core.transparent),
        )
        .await
        {
            Ok(Ok(s)) => match finish(choice.member, s).await {
                Ok(s) => {
                    core.balancer.report_success(choice.member, core.now());
                    return Some(s);
                }
                Err((cause, why)) => {
                    tracing::debug!(vserver = %core.name, service = %addr, why, "service connection failed");
                    Some(cause)
                }
            },
            Ok(Err(e)) => {
                tracing::debug!(vserver = %core.name, service = %addr, error = %e, "connect failed");
                local = crate::eject::is_local_error(&e);
                if e.kind() == std::io::ErrorKind::AddrNotAvailable {
                    bump(&core.counters.ports_exhausted);
                    if core.log.allow(core.now()) {
                        tracing::warn!(vserver = %core.name, service = %addr, "no local port left toward the service: its connections use the whole ephemeral range (net.ipv4.ip_local_port_range)");
                    }
                }
                Cause::of_stream_error(&e)
            }
            Err(_) => {
                tracing::debug!(vserver = %core.name, service = %addr, "connect timed out");
                Some(Cause::Timeout)
            }
        };
        if let Some(c) = live.member.take() {
            c.close();
        }
        bump(&core.counters.connect_failures);
        // Passive detection (README.md, "Health monitors"): the service's monitor counts this
        // as a failure, unless it was fulcrum's own.
        if !local {
            core.balancer.report_failure(choice.member);
        }
        if let Some(cause) = cause {
            core.balancer
                .report_failure_with(choice.member, Failure::new(cause), core.now());
        }
        failed.push(choice.member);
        if failed.len() >= core.member_addrs.len() {
            return None;
        }
    }
}

/// Connect to `service` without the `getsockopt(SO_ERROR)` that tokio's connect makes after
/// every connect: the socket is non-blocking from birth, and once epoll reports it the outcome
/// is in the readiness itself (a failed connect is reported with EPOLLERR / EPOLLHUP). Only a
/// failure reads the socket error, for the log. One system call less per connection (BENCHMARKS.md,
/// TCP: 20.0 against HAProxy's 17.9 per `Connection: close` request).
async fn connect(
    service: SocketAddr,
    client: SocketAddr,
    transparent: bool,
) -> io::Result<TcpStream> {
    let domain = Domain::for_address(service);
    let s = Socket::new(domain, Type::STREAM.nonblocking(), Some(SockProtocol::TCP))?;
    if transparent {
        // The service sees the client's own address; its replies must route back through
        // this host (the firewall-pool deployment this mode exists for).
        if service.is_ipv4() {
            s.set_ip_transparent_v4(true)?;
        } else {
            s.set_ip_transparent_v6(true)?;
        }
        s.set_reuse_address(true)?;
        s.bind(&SocketAddr::new(client.ip().to_canonical(), client.port()).into())?;
    }
    match s.connect(&service.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(nix::errno::Errno::EINPROGRESS as i32) => {}
        Err(e) => return Err(e),
    }
    let stream = TcpStream::from_std(std::net::TcpStream::from(s))?;
    let ready = stream.ready(Interest::WRITABLE | Interest::ERROR).await?;
    if ready.is_error() || ready.is_write_closed() {
        return Err(stream
            .take_error()?
            .unwrap_or_else(|| io::Error::from(io::ErrorKind::ConnectionRefused)));
    }
    Ok(stream)
}

/// Write all of `data` to `to` (used for the prefix and for a pending remainder).
async fn write_all(to: &TcpStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        to.writable().await?;
        match to.try_write(data) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Which side an error came from (for the counters and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Client,
    Service,
}

/// Copy both ways until both directions have seen EOF, an error, or the idle timeout.
async fn relay(
    core: &TcpCore,
    client: &TcpStream,
    upstream: &TcpStream,
    counters: Option<&ServiceCounters>,
    asked_at: Nanos,
    activity: &Activity,
) {
    // When the last byte moved: the idle timeout's clock, and eviction's.
    let last = activity.stamp();
    last.store(core.now(), Ordering::Relaxed);
    let ended = AtomicBool::new(false);
    // When the client's bytes now awaiting an answer went to the service (0: none awaits):
    // the service's first bytes after them give one response time (least_response_time).
    let asked = AtomicU64::new(asked_at);
    // The two directions are made inside the joining future, not before it: captured, they
    // would be stored twice in the connection's task (as captures and as the join's state).
    let ended = &ended;
    let timing = Timing {
        asked: &asked,
        counters,
    };
    let both = async move {
        tokio::try_join!(
            pump(core, client, upstream, activity, ended, timing, true),
            pump(core, upstream, client, activity, ended, timing, false),
        )
    };
    tokio::select! {
        r = both => {
            if let Err(side) = r {
                match side {
                    Side::Client => bump(&core.counters.client_errors),
                    Side::Service => bump(&core.counters.service_errors),
                }
            }
        }
        () = idle_watch(core, last) => bump(&core.counters.idle_timeouts),
    }
}

/// Resolves once nothing has moved in either direction for the idle timeout.
async fn idle_watch(core: &TcpCore, last: &AtomicU64) {
    let idle = core.idle_timeout;
    loop {
        let last_at = core.epoch + Duration::from_nanos(last.load(Ordering::Relaxed));
        // An idle timeout beyond the clock's range means "never".
        let Some(deadline) = last_at.checked_add(idle) else {
            return std::future::pending().await;
        };
        if Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep_until(deadline.into()).await;
    }
}

/// Read what `from` has into `buf`. A short read (fewer bytes than `buf` holds) emptied the
/// socket's receive queue, so its readiness is cleared right away instead of by one more
/// `recv` that would only return EAGAIN (two system calls per message become one). The
/// readiness cleared is the one seen before the read: data arriving after the read raises a
/// new readiness event, which tokio keeps, so no wake-up is lost.
fn read_draining(from: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = None;
    let r = from.try_io(Interest::READABLE, || {
        let n = recv(from.as_raw_fd(), buf, MsgFlags::empty()).map_err(io::Error::from)?;
        got = Some(n);
        if n > 0 && n < buf.len() {
            Err(io::ErrorKind::WouldBlock.into())
        } else {
            Ok(n)
        }
    });
    match (r, got) {
        (Err(e), Some(n)) if e.kind() == io::ErrorKind::WouldBlock => Ok(n),
        (r, _) => r,
    }
}

enum Step {
    Eof,
    Sent(usize),
    Pending(usize, Vec<u8>),
    Again,
}

/// One direction: `from` → `to`. On EOF from `from`, shut down the write side of `to` (the
/// half-close is passed on) and finish; the other direction keeps flowing.
/// The passive response-time measurement of one connection, shared by its two directions:
/// a request is the client's bytes sent while no answer is awaited, its response time the
/// wait for the service's next bytes (request to first byte, as an ADC measures it).
#[derive(Clone, Copy)]
struct Timing<'a> {
    asked: &'a AtomicU64,
    counters: Option<&'a ServiceCounters>,
}

impl Timing<'_> {
    /// `n` bytes moved at `now`, from the client (`inbound`) or from the service.
    fn moved(&self, inbound: bool, now: Nanos) {
        let Some(c) = self.counters else {
            return;
        };
        if inbound {
            // Only the first bytes of a request start the clock.
            let _ =
                self.asked
                    .compare_exchange(0, now.max(1), Ordering::Relaxed, Ordering::Relaxed);
        } else {
            let asked = self.asked.swap(0, Ordering::Relaxed);
            if asked != 0 {
                c.record_response_time(now.saturating_sub(asked) / 1_000);
            }
        }
    }
}

async fn pump(
    core: &TcpCore,
    from: &TcpStream,
    to: &TcpStream,
    activity: &Activity,
    ended: &AtomicBool,
    timing: Timing<'_>,
    inbound: bool,
) -> Result<(), Side> {
    let counters = timing.counters;
    let (from_side, to_side) = if inbound {
        (Side::Client, Side::Service)
    } else {
        (Side::Service, Side::Client)
    };
    loop {
        from.readable().await.map_err(|_| from_side)?;
        let step = SCRATCH.with_borrow_mut(|buf| {
            let n = match read_draining(from, buf) {
                Ok(0) => return Ok(Step::Eof),
                Ok(n) => n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) =>
                {
                    return Ok(Step::Again);
                }
                Err(_) => return Err(from_side),
            };
            match to.try_write(&buf[..n]) {
                Ok(w) if w == n => Ok(Step::Sent(n)),
                // Only now, with a slow peer, does the connection hold bytes of its own.
                Ok(w) => Ok(Step::Pending(n, buf[w..n].to_vec())),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    Ok(Step::Pending(n, buf[..n].to_vec()))
                }
                Err(_) => Err(to_side),
            }
        })?;
        let n = match step {
            Step::Again => continue,
            Step::Eof => {
                // NotConnected: the peer is already gone; nothing left to tell it.
                // The first direction to end passes the half-close on; when the other one
                // has already ended, both sockets are closed right after, and the close
                // sends the FIN (every byte received has been read: no reset).
                if !ended.swap(true, Ordering::AcqRel) {
                    let _ = SockRef::from(to).shutdown(Shutdown::Write);
                }
                return Ok(());
            }
            Step::Sent(n) => n,
            Step::Pending(n, rest) => {
                // Boxed: this slow-peer path is rare, and inline its state would enlarge
                // every connection's task by its size.
                Box::pin(write_all(to, &rest)).await.map_err(|_| to_side)?;
                n
            }
        };
        let now = core.now();
        // The client's bytes prove it a client, not an idle holder of a connection.
        activity.touch(now, inbound);
        timing.moved(inbound, now);
        let total = if inbound {
            &core.counters.bytes_in
        } else {
            &core.counters.bytes_out
        };
        total.fetch_add(n as u64, Ordering::Relaxed);
        if let Some(c) = counters {
            c.record_traffic(n as u64, 1, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Method;

    fn core(protocol: &str, method: &str, extra: &str) -> TcpCore {
        let yaml = format!(
            "admin: {{ listen: null }}\nservices:\n\
  - {{ name: a, address: \"127.0.0.1:7001\", protocol: tcp }}\n\
  - {{ name: b, address: \"127.0.0.1:7002\", protocol: tcp }}\n\
vservers:\n  - {{ name: v, protocol: {protocol}, bind: [\"127.0.0.1:0\"], method: {method}, services: [a, b]{extra} }}\n"
        );
        let cfg = crate::config::from_str("t.yaml", &yaml).expect("config");
        TcpCore::new(&cfg, &cfg.vservers[0], Instant::now())
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    /// An idle connection costs its task (header + `serve`'s state) plus two sockets. The
    /// state was 2,104 bytes while the two directions were stored twice (captured by the
    /// joining future and held in its state); 1,160 since (rustc 1.95). The bound leaves room
    /// for compiler changes, not for a layout that stores a direction twice again.
    #[test]
    fn a_connection_task_stays_small() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let to = l.local_addr().expect("addr");
            let (c, accepted) = tokio::join!(TcpStream::connect(to), l.accept());
            let (_c, (s, peer)) = (c.expect("connect"), accepted.expect("accept"));
            let activity = Activity::default();
            let task = serve(Arc::new(core("tcp", "round_robin", "")), s, peer, &activity);
            let size = std::mem::size_of_val(&task);
            assert!(size <= 1_536, "serve's state is {size} bytes");
        });
    }

    #[test]
    fn what_is_read_before_choosing() {
        assert_eq!(
            core("tcp", "round_robin", "").first_bytes_needed(),
            FirstBytes::None
        );
        assert_eq!(
            core("http", "source_ip_hash", "").first_bytes_needed(),
            FirstBytes::None
        );
        assert_eq!(
            core("http", "url_hash", "").first_bytes_needed(),
            FirstBytes::HttpHead
        );
        let t = core("tcp", "token", ", token: { offset: 3, length: 4 }");
        assert_eq!(t.first_bytes_needed(), FirstBytes::Bytes(7));
        assert!(!t.is_first_complete(b"abcdef"));
        assert!(t.is_first_complete(b"abcdefg"));
        let h = core("http", "url_hash", "");
        assert!(!h.is_first_complete(b"GET / HTTP/1.1\r\nHost: a\r\n"));
        assert!(h.is_first_complete(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"));
        assert!(
            h.is_first_complete(b"\x16\x03\x01garbage"),
            "never HTTP: stop reading"
        );
    }

    #[test]
    fn the_local_address_is_skipped_only_where_no_key_reads_it() {
        let (c, l1, l2) = (
            addr("10.0.0.1:4000"),
            addr("10.0.0.2:80"),
            addr("0.0.0.0:0"),
        );
        let mut checked = 0;
        for (name, method) in Method::ALL {
            for protocol in ["tcp", "http"] {
                let extra = if method == Method::Token {
                    ", token: { offset: 0, length: 2 }"
                } else {
                    ""
                };
                let yaml = format!(
                    "admin: {{ listen: null }}\nservices:\n\
  - {{ name: a, address: \"127.0.0.1:7001\", protocol: tcp }}\n\
vservers:\n  - {{ name: v, protocol: {protocol}, bind: [\"127.0.0.1:0\"], method: {name}, services: [a]{extra} }}\n"
                );
                // Methods a tcp / http vserver does not accept (call_id_hash) are skipped.
                let Ok(cfg) = crate::config::from_str("t.yaml", &yaml) else {
                    continue;
                };
                let t = TcpCore::new(&cfg, &cfg.vservers[0], Instant::now());
                checked += 1;
                let first = b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n";
                if !t.needs_local() {
                    assert_eq!(
                        t.key_input(first, c, l1),
                        t.key_input(first, c, l2),
                        "{protocol} {name} reads the local address"
                    );
                }
            }
        }
        assert!(checked >= 26, "only {checked} method/protocol pairs built");
        assert!(core("tcp", "dest_ip_hash", "").needs_local());
        assert!(core("tcp", "source_dest_ip_hash", "").needs_local());
        assert!(core("tcp", "round_robin", ", send_proxy: v2").needs_local());
        assert!(!core("tcp", "source_ip_hash", "").needs_local());
    }

    #[test]
    fn keys_from_heads_addresses_and_fallbacks() {
        let (c, l) = (addr("10.0.0.1:4000"), addr("10.0.0.2:80"));
        let h = core("http", "url_hash", "");
        let k1 = h.key_input(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n", c, l);
        let k2 = h.key_input(b"POST /a HTTP/1.0\r\n\r\n", addr("10.9.9.9:1"), l);
        assert!(matches!(k1, KeyInput::Hash(_)));
        assert_eq!(k1, k2, "the URL is the key, not the client");
        assert_eq!(
            h.key_input(b"not http\r\n\r\n", c, l),
            KeyInput::Unparseable
        );
        assert_eq!(h.key_input(b"", c, l), KeyInput::Unparseable);
        let d = core("tcp", "dest_ip_hash", "");
        assert_eq!(
            d.key_input(b"", c, l),
            d.key_input(b"", addr("10.7.7.7:9"), l)
        );
        assert_ne!(
            d.key_input(b"", c, l),
            d.key_input(b"", c, addr("10.0.0.3:80"))
        );
        let t = core("tcp", "token", ", token: { offset: 0, length: 4 }");
        assert_eq!(
            t.key_input(b"ab", c, l),
            KeyInput::NoKey,
            "too short: least_connection"
        );
        assert_eq!(t.key_input(b"abcdXX", c, l), t.key_input(b"abcdYY", c, l));
    }
}
