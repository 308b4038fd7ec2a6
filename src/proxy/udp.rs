//! The `udp` vserver: generic UDP sessions, like nginx stream's or Envoy's UDP proxy.
//!
//! A session is one client flow — (client address, local address it reached, and for
//! per-datagram methods the member the datagram's key chose) — with its own connected
//! upstream socket, so the service's replies arrive on that socket and are relayed back to
//! the client from the vserver's own address (the very local address the client sent to,
//! via IP_PKTINFO when bound to a wildcard).
//!
//! [`UdpCore::decide`] is the decision (session lookup, key extraction, balancer choice):
//! bytes, addresses and `now` in, a [`Decision`] out, no socket. The table is
//! [`crate::session::SessionTable`] (PURE). [`run_worker`] is the IO shell: one thread per
//! worker owning one SO_REUSEPORT socket per bind address and a mio poll over those and its
//! sessions' upstream sockets. The kernel keeps a client's flow on one worker socket, so a
//! worker's table needs no lock; the `max_sessions` bound is shared through one atomic.
//! One receive buffer per worker: an idle session costs its table entry and a socket, no
//! buffer.

use crate::balancer::{Balancer, Health, KeyInput};
use crate::config::{Config, HashParams, Method, ProxyProtocol, TokenRule, Vserver};
use crate::hash;
use crate::key::{self, KeyOutcome, Payload, RequestCtx};
use crate::net;
use crate::proxy::proxy_protocol::{self, MAX_V2_LEN, Transport};
use crate::proxy::runtime::{DataPath, RuntimeError, StartCtx, UdpCell, VserverHandle, bind_udp};
use crate::proxy::{LogLimiter, bump, elapsed_nanos};
use crate::session::{Admit, Session, SessionId, SessionKey, SessionTable};
use crate::stats::Nanos;
use arc_swap::ArcSwap;
use mio::net::UdpSocket as MioUdp;
use mio::{Events, Interest, Poll, Token};
use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, SockaddrStorage, recvmsg, sendmsg, setsockopt,
    sockopt,
};
use socket2::{Domain, Socket, Type};
use std::io::{self, IoSlice, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Largest UDP payload (IPv4 65,535 − 8 − 20; IPv6 jumbograms are not supported).
const MAX_DATAGRAM: usize = 65_527;

/// Datagrams handled per socket per wake-up before the others get a turn (one busy
/// client must not starve the replies of every other session).
const BUDGET: usize = 64;

/// How often a worker checks for shutdown when idle.
const POLL: Duration = Duration::from_millis(100);

/// Counters of one udp vserver (all workers).
#[derive(Debug, Default)]
pub struct UdpCounters {
    pub datagrams_in: AtomicU64,
    pub datagrams_out: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub sessions_created: AtomicU64,
    pub sessions_expired: AtomicU64,
    /// New sessions refused because the table was full (their datagrams dropped).
    pub sessions_refused: AtomicU64,
    /// Sessions moved because their member went DOWN.
    pub sessions_rerouted: AtomicU64,
    /// Datagrams dropped because no member could take them.
    pub no_service: AtomicU64,
    /// Upstream socket could not be created (fd limit, transparent bind refused...).
    pub socket_errors: AtomicU64,
    /// Receive errors on a service socket (ICMP port unreachable shows up here).
    pub service_errors: AtomicU64,
    pub recv_errors: AtomicU64,
    pub send_errors: AtomicU64,
}

/// What to do with a datagram from a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Relay on this live session.
    Existing(SessionId),
    /// Open a session toward `member` (after closing `replace`, a session whose member is
    /// no longer UP).
    New {
        key: SessionKey,
        member: usize,
        replace: Option<SessionId>,
    },
    /// No member can take it: drop (UDP has no way to say "unavailable").
    NoService,
}

/// Shared, immutable-after-build state of one udp vserver.
pub struct UdpCore {
    pub name: String,
    method: Method,
    hash_params: HashParams,
    balancer: Arc<Balancer>,
    member_addrs: Vec<SocketAddr>,
    /// `token` on the payload chooses per datagram: sessions are per (client, member).
    per_datagram: bool,
    idle_ns: Nanos,
    max_sessions: usize,
    live: Arc<AtomicUsize>,
    transparent: bool,
    send_proxy: bool,
    pub counters: UdpCounters,
}

impl std::fmt::Debug for UdpCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpCore")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

fn nanos(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl UdpCore {
    pub fn new(config: &Config, v: &Vserver) -> UdpCore {
        let member_addrs = v
            .services
            .iter()
            .filter_map(|&i| config.services.get(i))
            .map(|s| s.address)
            .collect();
        UdpCore {
            name: v.name.clone(),
            method: v.method,
            hash_params: v.hash.clone(),
            balancer: Arc::new(Balancer::new(config, v)),
            member_addrs,
            per_datagram: v.method == Method::Token
                && matches!(v.hash.token, Some(TokenRule::Payload { .. })),
            idle_ns: nanos(v.idle_timeout),
            max_sessions: v.max_sessions,
            live: Arc::new(AtomicUsize::new(0)),
            transparent: v.transparent,
            send_proxy: v.send_proxy == Some(ProxyProtocol::V2),
            counters: UdpCounters::default(),
        }
    }

    /// The core of a reload of the vserver `old` served: members it keeps share their
    /// counters with `old` (sessions established before the reload stay counted on their
    /// service), and the session bound carries over.
    pub fn rebuilt(config: &Config, v: &Vserver, old: &UdpCore) -> UdpCore {
        let mut core = UdpCore::new(config, v);
        core.balancer = Arc::new(Balancer::carrying(config, v, &old.balancer));
        core.live = Arc::clone(&old.live);
        core
    }

    /// Where a session toward member `m` of `old` goes in this core: the member with the
    /// same service name and address, if this core has one (a session's socket is
    /// connected to the address). `None` when the keying changed (per-datagram or not).
    fn carried_member(&self, old: &UdpCore, m: usize) -> Option<u32> {
        if self.per_datagram != old.per_datagram {
            return None;
        }
        let name = &old.balancer.members().get(m)?.name;
        let addr = old.member_addr(m)?;
        let n = self
            .balancer
            .members()
            .iter()
            .position(|x| &x.name == name)?;
        (self.member_addr(n)? == addr)
            .then(|| u32::try_from(n).ok())
            .flatten()
    }

    pub fn balancer(&self) -> &Arc<Balancer> {
        &self.balancer
    }

    /// Live sessions of the vserver (all workers).
    pub fn sessions(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// A new, empty session table for one worker.
    pub fn table<R>(&self) -> SessionTable<R> {
        SessionTable::new(self.idle_ns, self.max_sessions, Arc::clone(&self.live))
    }

    pub fn member_addr(&self, member: usize) -> Option<SocketAddr> {
        self.member_addrs.get(member).copied()
    }

    fn choose(
        &self,
        payload: &[u8],
        client: SocketAddr,
        local: SocketAddr,
        now: Nanos,
    ) -> Option<usize> {
        let ctx = RequestCtx {
            src: client,
            dst: local,
            payload: Payload::Raw(payload),
        };
        let key = match key::extract(self.method, &self.hash_params, &ctx) {
            KeyOutcome::Key(k) => KeyInput::Hash(hash::key_hash(k.as_bytes())),
            KeyOutcome::NoKey => KeyInput::NoKey,
            KeyOutcome::Unparseable => KeyInput::Unparseable,
        };
        self.balancer.choose(key, now).map(|c| c.member)
    }

    /// Decide where a datagram from `client` to `local` goes. A session keeps its member
    /// while that member is not DOWN (OUT_OF_SERVICE drains: existing flows continue).
    pub fn decide<R>(
        &self,
        table: &SessionTable<R>,
        payload: &[u8],
        client: SocketAddr,
        local: SocketAddr,
        now: Nanos,
    ) -> Decision {
        let (key, chosen) = if self.per_datagram {
            match self.choose(payload, client, local, now) {
                Some(m) => (
                    SessionKey {
                        client,
                        local,
                        member: Some(m as u32),
                    },
                    Some(m),
                ),
                None => return Decision::NoService,
            }
        } else {
            (
                SessionKey {
                    client,
                    local,
                    member: None,
                },
                None,
            )
        };
        let mut replace = None;
        if let Some(id) = table.find(&key, now) {
            let member = table.get(id).map_or(0, |s| s.member as usize);
            if self.balancer.health(member) != Some(Health::Down) {
                self.balancer.count_affinity();
                return Decision::Existing(id);
            }
            replace = Some(id);
        }
        let member = match chosen {
            Some(m) => Some(m),
            None => self.choose(payload, client, local, now),
        };
        match member {
            Some(member) => Decision::New {
                key,
                member,
                replace,
            },
            None => Decision::NoService,
        }
    }
}

/// Start a udp vserver: one worker thread per SO_REUSEPORT socket set.
pub fn start(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
) -> Result<VserverHandle, RuntimeError> {
    crate::proxy::fd_limit::check_capacity(&v.name, v.max_sessions, 1);
    let workers = net::worker_count(v.workers);
    let (per_addr, bound) = bind_udp(v, workers)?;
    let core = Arc::new(UdpCore::new(config, v));
    let cell: UdpCell = Arc::new(ArcSwap::new(Arc::clone(&core)));
    ctx.udp_cells.push((v.name.clone(), Arc::clone(&cell)));
    // Worker i takes the i-th socket of every bind address.
    let mut sets: Vec<Vec<UdpSocket>> = (0..workers).map(|_| Vec::new()).collect();
    for socks in per_addr {
        for (i, s) in socks.into_iter().enumerate() {
            if let Some(set) = sets.get_mut(i) {
                set.push(s);
            }
        }
    }
    for (i, set) in sets.into_iter().enumerate() {
        let cell = Arc::clone(&cell);
        let stop = Arc::clone(ctx.stop);
        let epoch = ctx.epoch;
        let t = std::thread::Builder::new()
            .name(format!("{}-{i}", v.name))
            .spawn(move || run_worker(set, cell, epoch, stop))?;
        ctx.threads.push(t);
    }
    tracing::info!(vserver = %v.name, bind = ?bound, workers, method = v.method.name(), "udp vserver started");
    Ok(VserverHandle {
        name: v.name.clone(),
        protocol: v.protocol,
        bound,
        balancer: Arc::clone(core.balancer()),
        data: DataPath::Udp(core),
    })
}

/// A worker's listening socket.
struct Listener {
    sock: MioUdp,
    bound: SocketAddr,
    /// Bound to a wildcard: the local address of each datagram comes from IP_PKTINFO /
    /// IPV6_PKTINFO, and replies name it as their source.
    pktinfo: bool,
}

/// The IO state of one worker.
struct Worker {
    /// The current core; a reload stores a rebuilt one, adopted at the next wake-up.
    cell: UdpCell,
    core: Arc<UdpCore>,
    poll: Poll,
    listeners: Vec<Listener>,
    table: SessionTable<MioUdp>,
    /// The one receive buffer of the worker; the first `MAX_V2_LEN` bytes are room for a
    /// PROXY header written in front of the payload without copying it.
    buf: Vec<u8>,
    cmsg: Vec<u8>,
    /// Sockets not drained in their last turn (edge-triggered readiness will not repeat).
    again: Vec<Token>,
    ready: Vec<Token>,
    log: LogLimiter,
}

/// The receive loop of one worker. Runs until `stop`; errors are counted, never fatal.
pub fn run_worker(socks: Vec<UdpSocket>, cell: UdpCell, epoch: Instant, stop: Arc<AtomicBool>) {
    let core = cell.load_full();
    let poll = match Poll::new() {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(vserver = %core.name, error = %e, "cannot create poll");
            return;
        }
    };
    let mut listeners = Vec::new();
    for (i, s) in socks.into_iter().enumerate() {
        let bound = match s.local_addr() {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(vserver = %core.name, error = %e, "worker socket has no address");
                continue;
            }
        };
        let pktinfo = bound.ip().is_unspecified();
        if let Err(e) = s.set_nonblocking(true) {
            tracing::error!(vserver = %core.name, error = %e, "cannot set non-blocking");
            continue;
        }
        if pktinfo {
            let r = if bound.is_ipv4() {
                setsockopt(&s, sockopt::Ipv4PacketInfo, &true)
            } else {
                setsockopt(&s, sockopt::Ipv6RecvPacketInfo, &true)
            };
            if let Err(e) = r {
                tracing::warn!(vserver = %core.name, error = %e, "no IP_PKTINFO: dest_ip_hash sees the wildcard address");
            }
        }
        let mut sock = MioUdp::from_std(s);
        if let Err(e) = poll
            .registry()
            .register(&mut sock, Token(i), Interest::READABLE)
        {
            tracing::error!(vserver = %core.name, error = %e, "cannot register socket");
            continue;
        }
        listeners.push(Listener {
            sock,
            bound,
            pktinfo,
        });
    }
    let mut w = Worker {
        cell,
        table: core.table(),
        core,
        poll,
        listeners,
        buf: vec![0u8; MAX_V2_LEN + MAX_DATAGRAM],
        cmsg: nix::cmsg_space!(nix::libc::in6_pktinfo),
        again: Vec::new(),
        ready: Vec::with_capacity(1024),
        log: LogLimiter::default(),
    };
    w.run(epoch, &stop);
}

impl Worker {
    fn base(&self) -> usize {
        self.listeners.len()
    }

    /// Expiry precision: within ~10% of the idle timeout, at most every 10 s.
    fn sweep_every(&self) -> Nanos {
        nanos(
            (Duration::from_nanos(self.core.idle_ns) / 10)
                .clamp(Duration::from_millis(20), Duration::from_secs(10)),
        )
    }

    /// Switch to the core a reload stored, if any: sessions of members the new core keeps
    /// (same name and address) are renumbered and stay on their service; sessions of
    /// removed members are closed, so their next datagram is balanced afresh. True when
    /// the core changed.
    fn adopt_reload(&mut self) -> bool {
        if Arc::ptr_eq(&self.core, &self.cell.load()) {
            return false;
        }
        let old = std::mem::replace(&mut self.core, self.cell.load_full());
        let new = Arc::clone(&self.core);
        let registry = self.poll.registry();
        self.table.remap(
            new.idle_ns,
            new.max_sessions,
            |s| new.carried_member(&old, s.member as usize),
            |_, s| close_session(&old, registry, s),
        );
        true
    }

    fn run(&mut self, epoch: Instant, stop: &AtomicBool) {
        let mut events = Events::with_capacity(1024);
        let mut sweep_every = self.sweep_every();
        let mut next_sweep = elapsed_nanos(epoch).saturating_add(sweep_every);
        while !stop.load(Ordering::Relaxed) {
            let timeout = if self.again.is_empty() {
                let until_sweep = next_sweep.saturating_sub(elapsed_nanos(epoch));
                Duration::from_nanos(until_sweep).min(POLL)
            } else {
                Duration::ZERO
            };
            if let Err(e) = self.poll.poll(&mut events, Some(timeout))
                && e.kind() != io::ErrorKind::Interrupted
            {
                tracing::error!(vserver = %self.core.name, error = %e, "poll failed");
                std::thread::sleep(POLL);
            }
            let now = elapsed_nanos(epoch);
            // Before any datagram of this wake-up, so none is routed by a replaced core.
            if self.adopt_reload() {
                sweep_every = self.sweep_every();
                next_sweep = now.saturating_add(sweep_every);
            }
            // Reused across wake-ups: the hot loop does not allocate.
            let mut ready = std::mem::take(&mut self.ready);
            ready.clear();
            ready.append(&mut self.again);
            ready.extend(events.iter().map(|e| e.token()));
            for &token in &ready {
                let drained = if token.0 < self.base() {
                    self.drain_clients(token.0, now)
                } else {
                    self.drain_service(token.0 - self.base(), now)
                };
                if !drained && !self.again.contains(&token) {
                    self.again.push(token);
                }
            }
            self.ready = ready;
            if now >= next_sweep {
                self.sweep(now);
                next_sweep = now.saturating_add(sweep_every);
            }
        }
        let core = Arc::clone(&self.core);
        let registry = self.poll.registry();
        self.table.drain(|_, s| close_session(&core, registry, s));
    }

    fn sweep(&mut self, now: Nanos) {
        let core = Arc::clone(&self.core);
        let registry = self.poll.registry();
        let n = self
            .table
            .expire(now, |_, s| close_session(&core, registry, s));
        self.core
            .counters
            .sessions_expired
            .fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Receive one datagram on listener `li` into `buf[MAX_V2_LEN..]`: (length, client,
    /// local address it was sent to).
    fn recv_client(&mut self, li: usize) -> io::Result<(usize, SocketAddr, SocketAddr)> {
        let l = &self.listeners[li];
        let payload = &mut self.buf[MAX_V2_LEN..];
        if !l.pktinfo {
            let (n, src) = l.sock.recv_from(payload)?;
            return Ok((n, src, l.bound));
        }
        let mut iov = [IoSliceMut::new(payload)];
        let msg = recvmsg::<SockaddrStorage>(
            l.sock.as_raw_fd(),
            &mut iov,
            Some(&mut self.cmsg),
            MsgFlags::empty(),
        )
        .map_err(io::Error::from)?;
        let mut local = l.bound;
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                match c {
                    ControlMessageOwned::Ipv4PacketInfo(pi) => {
                        let ip = Ipv4Addr::from(u32::from_be(pi.ipi_addr.s_addr));
                        local = SocketAddr::new(IpAddr::V4(ip), l.bound.port());
                    }
                    ControlMessageOwned::Ipv6PacketInfo(pi) => {
                        let ip = Ipv6Addr::from(pi.ipi6_addr.s6_addr);
                        local = SocketAddr::new(IpAddr::V6(ip), l.bound.port());
                    }
                    _ => {}
                }
            }
        }
        let src = msg
            .address
            .and_then(|a: SockaddrStorage| {
                a.as_sockaddr_in()
                    .map(|v4| SocketAddr::V4((*v4).into()))
                    .or_else(|| a.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into())))
            })
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    "datagram without source address",
                )
            })?;
        Ok((msg.bytes, src, local))
    }

    /// Drain listener `li`; false when the budget ran out first.
    fn drain_clients(&mut self, li: usize, now: Nanos) -> bool {
        for _ in 0..BUDGET {
            let (n, client, local) = match self.recv_client(li) {
                Ok(r) => r,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    bump(&self.core.counters.recv_errors);
                    if self.log.allow(now) {
                        tracing::warn!(vserver = %self.core.name, error = %e, "receive failed");
                    }
                    continue;
                }
            };
            bump(&self.core.counters.datagrams_in);
            self.core
                .counters
                .bytes_in
                .fetch_add(n as u64, Ordering::Relaxed);
            self.client_datagram(li, n, client, local, now);
        }
        false
    }

    fn client_datagram(
        &mut self,
        li: usize,
        n: usize,
        client: SocketAddr,
        local: SocketAddr,
        now: Nanos,
    ) {
        let payload = &self.buf[MAX_V2_LEN..MAX_V2_LEN + n];
        let id = match self.core.decide(&self.table, payload, client, local, now) {
            Decision::Existing(id) => id,
            Decision::NoService => {
                bump(&self.core.counters.no_service);
                return;
            }
            Decision::New {
                key,
                member,
                replace,
            } => {
                if let Some(old) = replace
                    && let Some(s) = self.table.remove(old)
                {
                    bump(&self.core.counters.sessions_rerouted);
                    close_session(&self.core, self.poll.registry(), s);
                }
                match self.open_session(key, member, li, now) {
                    Some(id) => id,
                    None => return,
                }
            }
        };
        let Some(s) = self.table.get(id) else {
            return;
        };
        let member = s.member as usize;
        // The PROXY header goes right before the payload already in the buffer.
        let start = if self.core.send_proxy {
            let mut hdr = [0u8; MAX_V2_LEN];
            let h = proxy_protocol::encode_v2(client, local, Transport::Datagram, &mut hdr);
            let start = MAX_V2_LEN - h;
            self.buf[start..MAX_V2_LEN].copy_from_slice(&hdr[..h]);
            start
        } else {
            MAX_V2_LEN
        };
        match s.resource.send(&self.buf[start..MAX_V2_LEN + n]) {
            Ok(_) => {
                self.table.touch(id, n, true, now);
                if let Some(c) = self.core.balancer.counters(member) {
                    c.record_traffic(n as u64, 1, now);
                }
            }
            Err(e) => {
                bump(&self.core.counters.send_errors);
                if self.log.allow(now) {
                    tracing::warn!(vserver = %self.core.name, error = %e, "send to service failed");
                }
            }
        }
    }

    fn open_session(
        &mut self,
        key: SessionKey,
        member: usize,
        li: usize,
        now: Nanos,
    ) -> Option<SessionId> {
        if self.table.admit() == Admit::Full {
            bump(&self.core.counters.sessions_refused);
            if self.log.allow(now) {
                tracing::warn!(vserver = %self.core.name, max = self.core.max_sessions, "session table full: new session refused");
            }
            return None;
        }
        let Some(service) = self.core.member_addr(member) else {
            self.table.release();
            return None;
        };
        let sock = match upstream_socket(service, key.client, self.core.transparent) {
            Ok(s) => s,
            Err(e) => {
                self.table.release();
                bump(&self.core.counters.socket_errors);
                if self.log.allow(now) {
                    tracing::warn!(vserver = %self.core.name, %service, error = %e, "cannot open a session socket");
                }
                return None;
            }
        };
        let listener = u16::try_from(li).unwrap_or(0);
        let (id, stale) =
            self.table
                .insert(key, member as u32, listener, MioUdp::from_std(sock), now);
        if let Some(s) = stale {
            close_session(&self.core, self.poll.registry(), s);
        }
        // The token is the slot index, known only once the session is in the table.
        let token = Token(self.base() + id);
        let registered = match self.table.get_mut(id) {
            Some(s) => self
                .poll
                .registry()
                .register(&mut s.resource, token, Interest::READABLE),
            None => return None,
        };
        if let Err(e) = registered {
            bump(&self.core.counters.socket_errors);
            if self.log.allow(now) {
                tracing::warn!(vserver = %self.core.name, error = %e, "cannot register a session socket");
            }
            // Never opened on the member's counters, so it is dropped, not closed.
            drop(self.table.remove(id));
            return None;
        }
        bump(&self.core.counters.sessions_created);
        if let Some(c) = self.core.balancer.counters(member) {
            c.open();
            c.record_request();
        }
        Some(id)
    }

    /// Drain the upstream socket of session `id`; false when the budget ran out first.
    fn drain_service(&mut self, id: SessionId, now: Nanos) -> bool {
        for _ in 0..BUDGET {
            let Some(s) = self.table.get(id) else {
                return true;
            };
            let n = match s.resource.recv(&mut self.buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    // ICMP unreachable from the service (connected socket): reported to the
                    // service's monitor as a passive failure, which decides its health; the
                    // session stays so a transient error does not move the flow.
                    bump(&self.core.counters.service_errors);
                    if let Some(s) = self.table.get(id) {
                        self.core.balancer().report_failure(s.member as usize);
                    }
                    continue;
                }
            };
            let (client, local, member) = (s.key.client, s.key.local, s.member as usize);
            let Some(l) = self.listeners.get(usize::from(s.listener)) else {
                return true;
            };
            match send_from(l, &self.buf[..n], client, local) {
                Ok(()) => {
                    bump(&self.core.counters.datagrams_out);
                    self.core
                        .counters
                        .bytes_out
                        .fetch_add(n as u64, Ordering::Relaxed);
                    self.table.touch(id, n, false, now);
                    if let Some(c) = self.core.balancer.counters(member) {
                        c.record_traffic(n as u64, 1, now);
                    }
                }
                Err(e) => {
                    bump(&self.core.counters.send_errors);
                    if self.log.allow(now) {
                        tracing::warn!(vserver = %self.core.name, %client, error = %e, "send to client failed");
                    }
                }
            }
        }
        false
    }
}

/// Close a session: deregister its socket and stop counting it on its member.
fn close_session(core: &UdpCore, registry: &mio::Registry, mut s: Session<MioUdp>) {
    let _ = registry.deregister(&mut s.resource);
    if let Some(c) = core.balancer.counters(s.member as usize) {
        c.close();
    }
}

/// Send a reply to `client` from `local` (the address the client sent to).
fn send_from(
    l: &Listener,
    payload: &[u8],
    client: SocketAddr,
    local: SocketAddr,
) -> io::Result<()> {
    if !l.pktinfo || local.ip().is_unspecified() {
        l.sock.send_to(payload, client)?;
        return Ok(());
    }
    let iov = [IoSlice::new(payload)];
    let dest = SockaddrStorage::from(client);
    let r = match local.ip() {
        IpAddr::V4(ip) => {
            let pi = nix::libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: nix::libc::in_addr {
                    s_addr: u32::from(ip).to_be(),
                },
                ipi_addr: nix::libc::in_addr { s_addr: 0 },
            };
            sendmsg(
                l.sock.as_raw_fd(),
                &iov,
                &[ControlMessage::Ipv4PacketInfo(&pi)],
                MsgFlags::empty(),
                Some(&dest),
            )
        }
        IpAddr::V6(ip) => {
            let pi = nix::libc::in6_pktinfo {
                ipi6_addr: nix::libc::in6_addr {
                    s6_addr: ip.octets(),
                },
                ipi6_ifindex: 0,
            };
            sendmsg(
                l.sock.as_raw_fd(),
                &iov,
                &[ControlMessage::Ipv6PacketInfo(&pi)],
                MsgFlags::empty(),
                Some(&dest),
            )
        }
    };
    r.map(|_| ()).map_err(io::Error::from)
}

/// A non-blocking UDP socket connected to `service`. Transparent mode binds it to the
/// client's address (IP_TRANSPARENT) so the service sees the client, not fulcrum.
fn upstream_socket(
    service: SocketAddr,
    client: SocketAddr,
    transparent: bool,
) -> io::Result<UdpSocket> {
    let s = Socket::new(
        Domain::for_address(service),
        Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    if transparent {
        if service.is_ipv4() {
            s.set_ip_transparent_v4(true)?;
        } else {
            s.set_ip_transparent_v6(true)?;
        }
        // Several sessions toward different services may share the client's address.
        s.set_reuse_address(true)?;
        s.bind(&SocketAddr::new(client.ip().to_canonical(), client.port()).into())?;
    }
    s.connect(&service.into())?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn core(method: &str, extra: &str) -> UdpCore {
        let yaml = format!(
            "admin: {{ listen: null }}\nservices:\n\
  - {{ name: a, address: \"127.0.0.1:7001\", protocol: udp }}\n\
  - {{ name: b, address: \"127.0.0.1:7002\", protocol: udp }}\n\
vservers:\n  - {{ name: v, protocol: udp, bind: [\"127.0.0.1:0\"], method: {method}, services: [a, b]{extra} }}\n"
        );
        let cfg = crate::config::from_str("t.yaml", &yaml).expect("config");
        UdpCore::new(&cfg, &cfg.vservers[0])
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    #[test]
    fn sessions_stick_until_their_member_is_down() {
        let c = core("round_robin", "");
        let mut t: SessionTable<()> = c.table();
        let (cl, lo) = (addr("10.0.0.1:5000"), addr("127.0.0.1:53"));
        let Decision::New {
            key,
            member,
            replace: None,
        } = c.decide(&t, b"x", cl, lo, 0)
        else {
            panic!("first datagram opens a session");
        };
        assert_eq!(t.admit(), Admit::Reserved);
        let (id, _) = t.insert(key, member as u32, 0, (), 0);
        assert_eq!(c.decide(&t, b"x", cl, lo, 10), Decision::Existing(id));
        // Another local address is another session (replies must leave from it).
        assert!(matches!(
            c.decide(&t, b"x", cl, addr("127.0.0.2:53"), 10),
            Decision::New { .. }
        ));
        c.balancer().set_health(member, Health::OutOfService, 20);
        assert_eq!(
            c.decide(&t, b"x", cl, lo, 30),
            Decision::Existing(id),
            "drain keeps flows"
        );
        c.balancer().set_health(member, Health::Down, 40);
        match c.decide(&t, b"x", cl, lo, 50) {
            Decision::New {
                member: m, replace, ..
            } => {
                assert_ne!(m, member);
                assert_eq!(replace, Some(id));
            }
            d => panic!("{d:?}"),
        }
        c.balancer().set_health(1 - member, Health::Down, 60);
        assert_eq!(
            c.decide(&t, b"x", addr("10.0.0.9:1"), lo, 70),
            Decision::NoService
        );
    }

    #[test]
    fn payload_token_sessions_are_per_member() {
        let c = core("token", ", token: { offset: 0, length: 2 }");
        let t: SessionTable<()> = c.table();
        let (cl, lo) = (addr("10.0.0.1:5000"), addr("127.0.0.1:53"));
        let members: std::collections::HashSet<Option<u32>> = (0..20u8)
            .filter_map(|i| match c.decide(&t, &[b'k', i, b'z'], cl, lo, 0) {
                Decision::New { key, .. } => Some(key.member),
                _ => None,
            })
            .collect();
        assert_eq!(
            members.len(),
            2,
            "one client, two member-keyed sessions: {members:?}"
        );
    }
}
