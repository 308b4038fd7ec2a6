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
//! Datagrams move in batches: a worker takes up to [`BATCH`] client datagrams per
//! recvmmsg and hands them to their sessions' sockets with one io_uring submission
//! ([`crate::uring`]; one `send` each where the kernel refuses io_uring), reads a session's
//! replies with one recvmmsg (a short count means the socket is drained, so no extra call to
//! see EAGAIN), and sends the replies of one wake-up with one sendmmsg per listener and
//! source address. The receive and reply buffers belong to the
//! worker: an idle session costs its table entry and a socket, no buffer.

use crate::budget::{Activity, SourceSlot};
use crate::config::Protocol;
use crate::config::{Config, Vserver};
use crate::core::udp::{Decision, UdpCore, nanos};
use crate::liveness::Heart;
use crate::net;
use crate::proxy::context::elapsed_nanos;
use crate::proxy::context::{
    DataPath, Prepared, Rebuild, RuntimeError, StartCtx, VserverHandle, bind_udp,
};
use crate::proxy::evict::{Evictors, IdleClients, Ticket};
use crate::proxy::proxy_protocol::{self, MAX_V2_LEN, Transport};
use crate::proxy::reconfig;
use crate::session::{Admit, Session, SessionId, SessionKey, SessionTable};
use crate::stats::Nanos;
use crate::stats::{LogLimiter, bump};
use crate::uring::SendBatch;
use arc_swap::ArcSwap;
use mio::net::UdpSocket as MioUdp;
use mio::{Events, Interest, Poll, Token};
use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, MultiHeaders, SockaddrStorage, recvmmsg,
    sendmmsg, setsockopt, sockopt,
};
use socket2::{Domain, Socket, Type};
use std::io::{self, IoSlice, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Largest UDP payload (IPv4 65,535 − 8 − 20; IPv6 jumbograms are not supported).
const MAX_DATAGRAM: usize = 65_527;

/// Datagrams handled per socket per wake-up before the others get a turn (one busy
/// client must not starve the replies of every other session).
const BUDGET: usize = 64;

/// Datagrams moved per recvmmsg / sendmmsg call (and replies held before a send).
const BATCH: usize = 32;

/// One receive slot: room for a PROXY header written in front of the payload, so the
/// header and the payload leave in one send without copying the payload.
const SLOT: usize = MAX_V2_LEN + MAX_DATAGRAM;

/// Longest wait of an idle worker: how soon it adopts a core a reload stored (and closes
/// the sessions of removed members). Shutdown does not wait on it: [`WAKE`] ends the wait.
const POLL: Duration = Duration::from_millis(100);

/// The current core of a udp vserver; workers adopt a rebuilt one on their next wake-up.
pub(crate) type UdpCell = Arc<ArcSwap<UdpCore>>;

/// A running udp vserver: the core it runs now and the cell its workers load it from.
#[derive(Debug)]
pub struct UdpPath {
    core: Arc<UdpCore>,
    cell: UdpCell,
}

impl UdpPath {
    /// The core the vserver runs now.
    pub fn core(&self) -> &Arc<UdpCore> {
        &self.core
    }
}

impl DataPath for UdpPath {
    fn edge(&self) -> &crate::edge::Edge {
        self.core.edge()
    }

    fn each_event(&self, visit: &mut dyn FnMut(&'static str, &std::sync::atomic::AtomicU64)) {
        for (name, c) in self.core.counters.events() {
            visit(name, c);
        }
    }

    /// A core built aside from the current one ([`UdpCore::rebuilt`]); nothing fails.
    fn prepare(&self, config: &Config, v: &Vserver) -> Result<Prepared, RuntimeError> {
        let old = self.cell.load_full();
        let core = Arc::new(UdpCore::rebuilt(config, v, &old));
        let cell = Arc::clone(&self.cell);
        Ok(Prepared::new(move |cx| {
            let rebuilt = reconfig::swap_core(&cell, &old, &core, cx, UdpCore::balancer);
            Rebuild {
                rebuilt,
                balancer: Arc::clone(core.balancer()),
                data: Arc::new(UdpPath { core, cell }),
            }
        }))
    }

    fn protocols(&self) -> &'static [Protocol] {
        &[Protocol::Udp]
    }
}

/// The token of a worker's mio `Waker`, woken when the runtime shuts down.
const WAKE: Token = Token(usize::MAX);

/// Start a udp vserver: one worker thread per SO_REUSEPORT socket set.
pub(crate) fn start(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
) -> Result<VserverHandle, RuntimeError> {
    let workers = net::worker_count(v.workers);
    let (per_addr, bound) = bind_udp(v, workers)?;
    let core = Arc::new(UdpCore::new(config, v).with_budget(Arc::clone(ctx.budget)));
    let cell: UdpCell = Arc::new(ArcSwap::new(Arc::clone(&core)));
    // Worker i takes the i-th socket of every bind address.
    let mut sets: Vec<Vec<UdpSocket>> = (0..workers).map(|_| Vec::new()).collect();
    for socks in per_addr {
        for (i, s) in socks.into_iter().enumerate() {
            if let Some(set) = sets.get_mut(i) {
                set.push(s);
            }
        }
    }
    // Made here, so the shutdown can wake a worker's poll from the moment it exists.
    let mut polls = Vec::with_capacity(sets.len());
    let mut inboxes = Vec::with_capacity(sets.len());
    for _ in &sets {
        let poll = Poll::new()?;
        let waker = Arc::new(mio::Waker::new(poll.registry(), WAKE)?);
        let w = Arc::clone(&waker);
        ctx.shutdown.on_raise(move || {
            if let Err(e) = w.wake() {
                tracing::warn!(error = %e, "cannot wake a udp worker: it stops at its next wake-up");
            }
        });
        polls.push(poll);
        inboxes.push(Inbox {
            asked: Mutex::new(Vec::new()),
            pending: AtomicBool::new(false),
            waker,
        });
    }
    // Its idle sessions may make room for any vserver's new connection.
    let idle = Arc::new(IdleSessions { inboxes });
    let weak: Weak<dyn IdleClients> = Arc::downgrade(&idle) as Weak<IdleSessions>;
    ctx.evictors.add(weak.clone());
    for (i, (set, poll)) in sets.into_iter().zip(polls).enumerate() {
        let evict = Evict {
            evictors: Arc::clone(ctx.evictors),
            idle: Arc::clone(&idle),
            weak: weak.clone(),
            worker: i,
            serial: 0,
        };
        let cell = Arc::clone(&cell);
        let stop = ctx.shutdown.flag();
        let epoch = ctx.epoch;
        // It wakes at least every POLL, and beats at each wake-up.
        let heart = ctx.liveness.periodic(format!("{}-{i}", v.name), POLL);
        let t = std::thread::Builder::new()
            .name(format!("{}-{i}", v.name))
            .spawn(move || run_worker(set, poll, cell, epoch, stop, heart, evict))?;
        ctx.threads.push(t);
    }
    tracing::info!(vserver = %v.name, bind = ?bound, workers, method = v.method.name(), "udp vserver started");
    Ok(VserverHandle::new(
        v.name.clone(),
        v.protocol,
        bound,
        Arc::clone(core.balancer()),
        Arc::new(UdpPath {
            core,
            cell: Arc::clone(&cell),
        }),
    ))
}

/// A udp vserver's sessions as the process-wide eviction sees them (docs/limits.md): a
/// session lives in one worker's table, which no other thread touches, so an eviction is
/// asked of its worker (queued, the worker woken) and carried out at its next wake-up.
pub(crate) struct IdleSessions {
    inboxes: Vec<Inbox>,
}

/// The sessions a worker is asked to close, and its waker.
struct Inbox {
    asked: Mutex<Vec<u64>>,
    /// Something is in `asked` (looked at without the lock at each wake-up).
    pending: AtomicBool,
    waker: Arc<mio::Waker>,
}

/// A session's id among the evictable clients: its worker, slot and serial (the slot is
/// reused; the serial tells a later session in it from the one asked to close).
fn evict_id(worker: usize, slot: SessionId, serial: u32) -> u64 {
    ((worker as u64 & 0xff) << 56)
        | ((slot as u64 & 0xffff_ffff) << 24)
        | u64::from(serial & 0xff_ffff)
}

/// The worker, slot and serial of [`evict_id`].
fn evict_parts(id: u64) -> (usize, SessionId, u32) {
    (
        (id >> 56) as usize,
        ((id >> 24) & 0xffff_ffff) as usize,
        (id & 0xff_ffff) as u32,
    )
}

impl IdleClients for IdleSessions {
    fn evict_one(&self, id: u64, _now: Nanos) -> bool {
        let Some(inbox) = self.inboxes.get(evict_parts(id).0) else {
            return false;
        };
        crate::sync::lock(&inbox.asked).push(id);
        inbox.pending.store(true, Ordering::Release);
        if let Err(e) = inbox.waker.wake() {
            tracing::warn!(error = %e, "cannot wake a udp worker to evict a session");
        }
        true
    }

    fn shrink(&self) {}
}

/// What a worker needs to make its sessions evictable and to carry out evictions.
pub(crate) struct Evict {
    evictors: Arc<Evictors>,
    idle: Arc<IdleSessions>,
    weak: Weak<dyn IdleClients>,
    worker: usize,
    /// The next session's serial ([`evict_id`]).
    serial: u32,
}

/// A session's own resources: its socket toward the service, its activity (stamped by each
/// client datagram: the service's replies, which reach a spoofed source's session too, do
/// not keep it alive for eviction), its place among the evictable clients and its source's
/// count.
struct Upstream {
    sock: MioUdp,
    serial: u32,
    activity: Arc<Activity>,
    _evictable: Option<Ticket>,
    _source: Option<SourceSlot>,
}

/// A worker's listening socket.
struct Listener {
    sock: MioUdp,
    bound: SocketAddr,
    /// recvmmsg headers (with room for the packet info when `tx_pktinfo` is set).
    rx: MultiHeaders<SockaddrStorage>,
    /// sendmmsg headers without control data.
    tx_plain: MultiHeaders<SockaddrStorage>,
    /// Set when bound to a wildcard: the local address of each datagram comes from
    /// IP_PKTINFO / IPV6_PKTINFO, and replies name it as their source through these sendmmsg
    /// headers, with room for exactly one packet info of the listener's family.
    tx_pktinfo: Option<MultiHeaders<SockaddrStorage>>,
}

/// recvmmsg headers for a listener: with room for one packet info of its family if it asks
/// for them.
fn rx_headers(bound: SocketAddr, pktinfo: bool) -> MultiHeaders<SockaddrStorage> {
    MultiHeaders::preallocate(BATCH, pktinfo.then(|| pktinfo_space(bound)))
}

fn pktinfo_space(bound: SocketAddr) -> Vec<u8> {
    if bound.is_ipv4() {
        nix::cmsg_space!(nix::libc::in_pktinfo)
    } else {
        nix::cmsg_space!(nix::libc::in6_pktinfo)
    }
}

/// A client datagram waiting in its receive slot (`None` client: no usable source address).
#[derive(Debug, Clone, Copy)]
struct Inbound {
    len: usize,
    client: Option<SocketAddr>,
    local: SocketAddr,
}

/// A service's reply waiting in reply slot `slot` for the worker's next sendmmsg.
#[derive(Debug, Clone, Copy)]
struct Reply {
    listener: u16,
    local: SocketAddr,
    client: SocketAddr,
    slot: usize,
    len: usize,
}

/// A client datagram in receive-buffer bytes `start..end` (PROXY header included) for the
/// socket of session `id`; `len` payload bytes are counted once it has gone.
#[derive(Debug, Clone, Copy)]
struct Forward {
    id: SessionId,
    member: usize,
    fd: RawFd,
    start: usize,
    end: usize,
    len: usize,
}

/// The IO state of one worker.
struct Worker {
    /// The current core; a reload stores a rebuilt one, adopted at the next wake-up.
    cell: UdpCell,
    core: Arc<UdpCore>,
    poll: Poll,
    listeners: Vec<Listener>,
    table: SessionTable<Upstream>,
    evict: Evict,
    /// `BATCH` receive slots of `SLOT` bytes for client datagrams (pages are touched only
    /// as far as datagrams fill them).
    rx_buf: Vec<u8>,
    /// What the last recvmmsg on a listener put in each receive slot.
    inbound: Vec<Inbound>,
    /// `BATCH` reply slots of `MAX_DATAGRAM` bytes, and the replies waiting in them.
    reply_buf: Vec<u8>,
    replies: Vec<Reply>,
    /// recvmmsg headers for session sockets (connected: the address is not used).
    session_rx: MultiHeaders<SockaddrStorage>,
    /// Client datagrams of the current receive batch waiting to go to their sessions'
    /// sockets, all in one [`SendBatch::send_all`] once the batch is decided.
    forwards: Vec<Forward>,
    sender: SendBatch,
    send_results: Vec<io::Result<usize>>,
    /// Sockets not drained in their last turn (edge-triggered readiness will not repeat).
    again: Vec<Token>,
    ready: Vec<Token>,
    log: LogLimiter,
}

/// The receive loop of one worker over `poll` (which holds the [`WAKE`] waker). Runs until
/// `stop`, which is set before the waker is woken; errors are counted, never fatal.
pub(crate) fn run_worker(
    socks: Vec<UdpSocket>,
    poll: Poll,
    cell: UdpCell,
    epoch: Instant,
    stop: Arc<AtomicBool>,
    heart: Heart,
    evict: Evict,
) {
    let core = cell.load_full();
    let mut listeners = Vec::new();
    for s in socks {
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
        // The token is the listener's index (a socket that failed to register is skipped).
        if let Err(e) =
            poll.registry()
                .register(&mut sock, Token(listeners.len()), Interest::READABLE)
        {
            tracing::error!(vserver = %core.name, error = %e, "cannot register socket");
            continue;
        }
        listeners.push(Listener {
            sock,
            bound,
            rx: rx_headers(bound, pktinfo),
            tx_plain: MultiHeaders::preallocate(BATCH, None),
            tx_pktinfo: pktinfo
                .then(|| MultiHeaders::preallocate(BATCH, Some(pktinfo_space(bound)))),
        });
    }
    let mut w = Worker {
        cell,
        table: core.table(),
        evict,
        core,
        poll,
        listeners,
        rx_buf: vec![0u8; BATCH * SLOT],
        inbound: Vec::with_capacity(BATCH),
        reply_buf: vec![0u8; BATCH * MAX_DATAGRAM],
        replies: Vec::with_capacity(BATCH),
        session_rx: MultiHeaders::preallocate(BATCH, None),
        forwards: Vec::with_capacity(BATCH),
        sender: SendBatch::new(),
        send_results: Vec::with_capacity(BATCH),
        again: Vec::new(),
        ready: Vec::with_capacity(1024),
        log: LogLimiter::default(),
    };
    // io_uring=true: a receive batch goes to the services' sockets in one system call.
    tracing::info!(vserver = %w.core.name, io_uring = w.sender.uses_io_uring(), "udp worker ready");
    w.run(epoch, &stop, &heart);
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

    fn run(&mut self, epoch: Instant, stop: &AtomicBool, heart: &Heart) {
        let mut events = Events::with_capacity(1024);
        let mut sweep_every = self.sweep_every();
        let mut next_sweep = elapsed_nanos(epoch).saturating_add(sweep_every);
        while !stop.load(Ordering::Acquire) {
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
            heart.beat();
            let now = elapsed_nanos(epoch);
            self.evict_asked(now);
            // Before any datagram of this wake-up, so none is routed by a replaced core.
            if self.adopt_reload() {
                sweep_every = self.sweep_every();
                next_sweep = now.saturating_add(sweep_every);
            }
            // Reused across wake-ups: the hot loop does not allocate.
            let mut ready = std::mem::take(&mut self.ready);
            ready.clear();
            ready.append(&mut self.again);
            ready.extend(events.iter().map(|e| e.token()).filter(|&t| t != WAKE));
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
            self.flush_replies(now);
            if now >= next_sweep {
                self.sweep(now);
                next_sweep = now.saturating_add(sweep_every);
            }
        }
        let core = Arc::clone(&self.core);
        let registry = self.poll.registry();
        self.table.drain(|_, s| close_session(&core, registry, s));
    }

    /// Close the sessions the process-wide eviction chose among this worker's (a new
    /// connection elsewhere needs their files), those still open.
    fn evict_asked(&mut self, now: Nanos) {
        let Some(inbox) = self.evict.idle.inboxes.get(self.evict.worker) else {
            return;
        };
        if !inbox.pending.swap(false, Ordering::AcqRel) {
            return;
        }
        let asked = std::mem::take(&mut *crate::sync::lock(&inbox.asked));
        for id in asked {
            let (_, slot, serial) = evict_parts(id);
            if self
                .table
                .get(slot)
                .is_none_or(|s| s.resource.serial != serial & 0xff_ffff)
            {
                continue;
            }
            if let Some(s) = self.table.remove(slot) {
                close_session(&self.core, self.poll.registry(), s);
                bump(&self.core.counters.sessions_evicted);
                if self.log.allow(now) {
                    tracing::info!(vserver = %self.core.name, "idle session evicted: the open-file pool runs low");
                }
            }
        }
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

    /// Receive up to `BATCH` datagrams on listener `li` into the receive slots, described
    /// in `inbound`; how many came.
    fn recv_clients(&mut self, li: usize) -> io::Result<usize> {
        let Worker {
            listeners,
            rx_buf,
            inbound,
            ..
        } = self;
        inbound.clear();
        let Some(l) = listeners.get_mut(li) else {
            return Ok(0);
        };
        let fd = l.sock.as_raw_fd();
        let mut slots = rx_buf.chunks_exact_mut(SLOT);
        let mut iovs: [[IoSliceMut<'_>; 1]; BATCH] = std::array::from_fn(|_| {
            [IoSliceMut::new(
                slots
                    .next()
                    .map(|s| &mut s[MAX_V2_LEN..])
                    .unwrap_or_default(),
            )]
        });
        let got = recvmmsg(fd, &mut l.rx, iovs.iter_mut(), MsgFlags::MSG_DONTWAIT, None)
            .map_err(io::Error::from)?;
        let mut pktinfo_lost = false;
        for msg in got {
            let mut local = l.bound;
            let mut seen = false;
            if let Ok(cmsgs) = msg.cmsgs() {
                for c in cmsgs {
                    match c {
                        ControlMessageOwned::Ipv4PacketInfo(pi) => {
                            let ip = Ipv4Addr::from(u32::from_be(pi.ipi_addr.s_addr));
                            local = SocketAddr::new(IpAddr::V4(ip), l.bound.port());
                            seen = true;
                        }
                        ControlMessageOwned::Ipv6PacketInfo(pi) => {
                            let ip = Ipv6Addr::from(pi.ipi6_addr.s6_addr);
                            local = SocketAddr::new(IpAddr::V6(ip), l.bound.port());
                            seen = true;
                        }
                        _ => {}
                    }
                }
            }
            pktinfo_lost |= l.tx_pktinfo.is_some() && !seen;
            inbound.push(Inbound {
                len: msg.bytes,
                client: msg.address.as_ref().and_then(socket_addr),
                local,
            });
        }
        // The kernel writes each header's control length back; one that came without a
        // packet info would leave no room for the next: start the headers afresh.
        if pktinfo_lost {
            l.rx = rx_headers(l.bound, l.tx_pktinfo.is_some());
        }
        Ok(inbound.len())
    }

    /// Drain listener `li`; false when the budget ran out first.
    fn drain_clients(&mut self, li: usize, now: Nanos) -> bool {
        let mut handled = 0;
        while handled < BUDGET {
            let n = match self.recv_clients(li) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    handled += 1;
                    bump(&self.core.counters.recv_errors);
                    if self.log.allow(now) {
                        tracing::warn!(vserver = %self.core.name, error = %e, "receive failed");
                    }
                    continue;
                }
            };
            // The vserver's shared counters are updated once per batch.
            let (mut datagrams, mut bytes) = (0u64, 0u64);
            for k in 0..n {
                let Some(&Inbound { len, client, local }) = self.inbound.get(k) else {
                    break;
                };
                let Some(client) = client else {
                    bump(&self.core.counters.recv_errors);
                    continue;
                };
                datagrams += 1;
                bytes += len as u64;
                self.client_datagram(li, k, len, client, local, now);
            }
            // Before the next recvmmsg reuses the receive slots.
            self.send_forwards(now);
            let counters = &self.core.counters;
            counters
                .datagrams_in
                .fetch_add(datagrams, Ordering::Relaxed);
            counters.bytes_in.fetch_add(bytes, Ordering::Relaxed);
            handled += n;
            // A short batch: the queue was empty (a later datagram raises a new edge).
            if n < BATCH {
                return true;
            }
        }
        false
    }

    /// Relay the client datagram of `n` bytes in receive slot `k`.
    fn client_datagram(
        &mut self,
        li: usize,
        k: usize,
        n: usize,
        client: SocketAddr,
        local: SocketAddr,
        now: Nanos,
    ) {
        let base = k * SLOT;
        let Some(payload) = self.rx_buf.get(base + MAX_V2_LEN..base + MAX_V2_LEN + n) else {
            return;
        };
        // The access lists, before anything is read of the datagram.
        if !self.core.edge.admits(client.ip()) {
            return;
        }
        let id = match self.core.decide(&self.table, payload, client, local, now) {
            Decision::Existing(id) => id,
            Decision::NoService => {
                bump(&self.core.counters.no_service);
                return;
            }
            // Refused by flood control (and counted by the edge) before anything was chosen.
            Decision::Flood => return,
            Decision::New {
                key,
                member,
                replace,
            } => {
                if replace.is_some() {
                    // Its socket closes below: what is queued for it goes first (and is
                    // counted on it).
                    self.send_forwards(now);
                }
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
        let (member, fd) = (s.member as usize, s.resource.sock.as_raw_fd());
        // The PROXY header goes right before the payload already in the buffer.
        let start = if self.core.send_proxy {
            let mut hdr = [0u8; MAX_V2_LEN];
            let h = proxy_protocol::encode_v2(client, local, Transport::Datagram, &mut hdr);
            let start = base + MAX_V2_LEN - h;
            self.rx_buf[start..base + MAX_V2_LEN].copy_from_slice(&hdr[..h]);
            start
        } else {
            base + MAX_V2_LEN
        };
        // One receive batch holds at most BATCH datagrams, and each batch is sent before the
        // next is received.
        debug_assert!(self.forwards.len() < BATCH);
        self.forwards.push(Forward {
            id,
            member,
            fd,
            start,
            end: base + MAX_V2_LEN + n,
            len: n,
        });
    }

    /// Send the client datagrams queued by [`Worker::client_datagram`] to their sessions'
    /// sockets, all in one system call where io_uring is available. Called before the
    /// receive slots are reused and before any session socket is closed, so every queued
    /// descriptor is still the session's own.
    fn send_forwards(&mut self, now: Nanos) {
        if self.forwards.is_empty() {
            return;
        }
        let mut sends: [(RawFd, &[u8]); BATCH] = [(-1, &[]); BATCH];
        for (slot, f) in sends.iter_mut().zip(&self.forwards) {
            *slot = (f.fd, self.rx_buf.get(f.start..f.end).unwrap_or_default());
        }
        let count = self.forwards.len().min(BATCH);
        self.sender
            .send_all(&sends[..count], &mut self.send_results);
        for (f, r) in self.forwards.iter().zip(&self.send_results) {
            match r {
                Ok(_) => {
                    self.table.touch(f.id, 1, f.len as u64, true, now);
                    // A client that speaks again once answered has shown it gets the
                    // answers: proven, as a stream client that completed a message.
                    if let Some(s) = self.table.get(f.id) {
                        s.resource.activity.touch(now, s.packets_out > 0);
                    }
                    if let Some(c) = self.core.balancer.counters(f.member) {
                        c.record_traffic(f.len as u64, 1, now);
                    }
                }
                Err(e) => {
                    bump(&self.core.counters.send_errors);
                    if self.log.allow(now) {
                        tracing::warn!(vserver = %self.core.name, error = %e, "send to service failed");
                    }
                    // An ICMP error from an earlier datagram may surface on this send.
                    Self::report_service_error(&self.core, f.member, e, now);
                }
            }
        }
        self.forwards.clear();
    }

    /// A session socket's error toward `member`: an ICMP error (RFC 1122 §4.1.3.3) is the
    /// service's failure, for its monitor's passive detection and for ejection
    /// (docs/ejection.md); silence never is, nor fulcrum's own local errors.
    fn report_service_error(core: &UdpCore, member: usize, e: &io::Error, now: Nanos) {
        if let Some(cause) = crate::eject::Cause::of_datagram_error(e) {
            core.balancer.report_failure(member);
            core.balancer
                .report_failure_with(member, crate::eject::Failure::new(cause), now);
        }
    }

    fn open_session(
        &mut self,
        key: SessionKey,
        member: usize,
        li: usize,
        now: Nanos,
    ) -> Option<SessionId> {
        // The client's own expired session still holds a place in the vserver's bound until
        // the next sweep; give it back first (`now` is the batch's time, so nothing of this
        // batch was queued for it).
        if let Some(s) = self.table.take_expired(&key, now) {
            close_session(&self.core, self.poll.registry(), s);
            bump(&self.core.counters.sessions_expired);
        }
        // Its source's count first: a source at its limit takes nothing from the pool.
        let source = match &self.core.sources {
            Some(limit) => match limit.admit(key.client.ip()) {
                Some(slot) => Some(slot),
                None => {
                    bump(&self.core.counters.sessions_refused);
                    bump(&self.core.counters.sessions_refused_per_source);
                    if self.log.allow(now) {
                        tracing::warn!(vserver = %self.core.name, client = %key.client, max = limit.max(), "source at max_per_source: new session refused");
                    }
                    return None;
                }
            },
            None => None,
        };
        match self.table.admit() {
            Admit::Reserved => {}
            Admit::Full => {
                bump(&self.core.counters.sessions_refused);
                if self.log.allow(now) {
                    tracing::warn!(vserver = %self.core.name, max = self.core.max_sessions, "session table full: new session refused");
                }
                return None;
            }
            Admit::NoFiles => {
                bump(&self.core.counters.sessions_refused);
                if self.log.allow(now) {
                    tracing::warn!(vserver = %self.core.name, "no open file left in the pool: new session refused (docs/limits.md)");
                }
                return None;
            }
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
        let serial = self.evict.serial & 0xff_ffff;
        self.evict.serial = self.evict.serial.wrapping_add(1);
        let activity = Arc::new(Activity::new(now));
        let upstream = Upstream {
            sock: MioUdp::from_std(sock),
            serial,
            activity: Arc::clone(&activity),
            _evictable: None,
            _source: source,
        };
        let (id, stale) = self
            .table
            .insert(key, member as u32, listener, upstream, now);
        if let Some(s) = stale {
            // Not expected (`take_expired` above, and `decide` replaces a DOWN member's
            // session before): closed rather than leaked.
            close_session(&self.core, self.poll.registry(), s);
        }
        // The token is the slot index, known only once the session is in the table.
        let token = Token(self.base() + id);
        let registered = match self.table.get_mut(id) {
            Some(s) => {
                self.poll
                    .registry()
                    .register(&mut s.resource.sock, token, Interest::READABLE)
            }
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
        // Evictable from now on, by its activity (docs/limits.md).
        let ticket = self.evict.evictors.enter(
            self.evict.weak.clone(),
            evict_id(self.evict.worker, id, serial),
            activity,
        );
        if let Some(s) = self.table.get_mut(id) {
            s.resource._evictable = Some(ticket);
        }
        bump(&self.core.counters.sessions_created);
        if let Some(c) = self.core.balancer.counters(member) {
            c.open();
            c.record_request();
        }
        Some(id)
    }

    /// Drain the upstream socket of session `id` into reply slots (sent by the next
    /// [`Worker::flush_replies`]); false when the budget ran out first.
    fn drain_service(&mut self, id: SessionId, now: Nanos) -> bool {
        let mut handled = 0;
        while handled < BUDGET {
            if self.replies.len() >= BATCH {
                self.flush_replies(now);
            }
            let Some(s) = self.table.get(id) else {
                return true;
            };
            let (fd, listener, client, local, member) = (
                s.resource.sock.as_raw_fd(),
                s.listener,
                s.key.client,
                s.key.local,
                s.member as usize,
            );
            let first = self.replies.len();
            let room = BATCH - first;
            let mut lens = [0usize; BATCH];
            let got = {
                let mut slots = self.reply_buf.chunks_exact_mut(MAX_DATAGRAM).skip(first);
                let mut iovs: [[IoSliceMut<'_>; 1]; BATCH] =
                    std::array::from_fn(|_| [IoSliceMut::new(slots.next().unwrap_or_default())]);
                recvmmsg(
                    fd,
                    &mut self.session_rx,
                    iovs.iter_mut().take(room),
                    MsgFlags::MSG_DONTWAIT,
                    None,
                )
                .map(|msgs| {
                    let mut k = 0;
                    for (m, len) in msgs.zip(lens.iter_mut()) {
                        *len = m.bytes;
                        k += 1;
                    }
                    k
                })
                .map_err(io::Error::from)
            };
            let k = match got {
                Ok(k) => k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ICMP unreachable from the service (connected socket): reported to the
                    // service's monitor as a passive failure, which decides its health, and
                    // counted for ejection (not fulcrum's own trouble, which says nothing of
                    // the service); the session stays so a transient error does not move
                    // the flow.
                    handled += 1;
                    bump(&self.core.counters.service_errors);
                    Self::report_service_error(&self.core, member, &e, now);
                    continue;
                }
            };
            if k > 0 {
                // An answer shows the service alive: what ends its ejection's trial.
                self.core.balancer.report_success(member, now);
            }
            let mut bytes = 0u64;
            for (i, &len) in lens.iter().take(k).enumerate() {
                self.replies.push(Reply {
                    listener,
                    local,
                    client,
                    slot: first + i,
                    len,
                });
                bytes += len as u64;
            }
            // One update of the session and of the member's shared counters per batch, not
            // per datagram.
            let answered_in = self.table.touch(id, k as u64, bytes, false, now);
            if let Some(c) = self.core.balancer.counters(member) {
                c.record_traffic(bytes, k as u64, now);
                if let Some(ns) = answered_in {
                    c.record_response_time(ns / 1_000);
                }
            }
            handled += k;
            // A short batch: the socket is drained (a later reply raises a new edge).
            if k < room {
                return true;
            }
        }
        false
    }

    /// Send the waiting replies: one sendmmsg per run of replies that leave from the same
    /// listener and source address (a client's replies keep their order).
    fn flush_replies(&mut self, now: Nanos) {
        if self.replies.is_empty() {
            return;
        }
        self.replies.sort_by_key(|r| (r.listener, r.local));
        let mut start = 0;
        while let Some(&first) = self.replies.get(start) {
            let len = self.replies[start..]
                .iter()
                .take_while(|r| r.listener == first.listener && r.local == first.local)
                .count();
            self.send_run(start, start + len, now);
            start += len;
        }
        self.replies.clear();
    }

    /// Send replies `from..to` (one listener, one source address), sendmmsg after sendmmsg
    /// until all are sent or dropped. UDP drops what cannot be sent; it is counted.
    fn send_run(&mut self, from: usize, to: usize, now: Nanos) {
        let Worker {
            listeners,
            replies,
            reply_buf,
            core,
            log,
            ..
        } = self;
        let Some(run) = replies.get(from..to) else {
            return;
        };
        let Some(first) = run.first() else {
            return;
        };
        let Some(l) = listeners.get_mut(usize::from(first.listener)) else {
            return;
        };
        let fd = l.sock.as_raw_fd();
        let local = first.local;
        let mut at = 0;
        while at < run.len() {
            let part = &run[at..];
            let iovs: [[IoSlice<'_>; 1]; BATCH] = std::array::from_fn(|i| {
                let data = part.get(i).and_then(|r| {
                    reply_buf.get(r.slot * MAX_DATAGRAM..r.slot * MAX_DATAGRAM + r.len)
                });
                [IoSlice::new(data.unwrap_or_default())]
            });
            let addrs: [Option<SockaddrStorage>; BATCH] =
                std::array::from_fn(|i| part.get(i).map(|r| SockaddrStorage::from(r.client)));
            let n = part.len().min(BATCH);
            let sent = send_batch(l, fd, local, &iovs[..n], &addrs[..n]);
            match sent {
                Ok(0) => {
                    // Nothing went (should not happen): drop the first, move on.
                    at += 1;
                    bump(&core.counters.send_errors);
                }
                Ok(k) => {
                    let bytes: usize = part.iter().take(k).map(|r| r.len).sum();
                    core.counters
                        .datagrams_out
                        .fetch_add(k as u64, Ordering::Relaxed);
                    core.counters
                        .bytes_out
                        .fetch_add(bytes as u64, Ordering::Relaxed);
                    at += k;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // The first of the batch failed (buffer full, client unreachable...):
                    // drop it and try the rest.
                    at += 1;
                    bump(&core.counters.send_errors);
                    if log.allow(now) {
                        tracing::warn!(vserver = %core.name, client = %first.client, error = %e, "send to client failed");
                    }
                }
            }
        }
    }
}

/// Close a session: deregister its socket and stop counting it on its member.
fn close_session(core: &UdpCore, registry: &mio::Registry, mut s: Session<Upstream>) {
    let _ = registry.deregister(&mut s.resource.sock);
    if let Some(c) = core.balancer.counters(s.member as usize) {
        c.close();
    }
}

/// One sendmmsg of `iovs` to `addrs` from listener `l`, naming `local` as the source when
/// the listener is bound to a wildcard: how many datagrams went.
fn send_batch(
    l: &mut Listener,
    fd: std::os::fd::RawFd,
    local: SocketAddr,
    iovs: &[[IoSlice<'_>; 1]],
    addrs: &[Option<SockaddrStorage>],
) -> io::Result<usize> {
    let count = |r: nix::Result<nix::sys::socket::MultiResults<'_, SockaddrStorage>>| {
        r.map(Iterator::count).map_err(io::Error::from)
    };
    let flags = MsgFlags::MSG_DONTWAIT;
    let headers = match (&mut l.tx_pktinfo, local.ip()) {
        (Some(h), IpAddr::V4(ip)) if l.bound.is_ipv4() && !ip.is_unspecified() => Some((h, Ok(ip))),
        (Some(h), IpAddr::V6(ip)) if l.bound.is_ipv6() && !ip.is_unspecified() => {
            Some((h, Err(ip)))
        }
        _ => None,
    };
    match headers {
        Some((h, Ok(ip))) => {
            let pi = nix::libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: nix::libc::in_addr {
                    s_addr: u32::from(ip).to_be(),
                },
                ipi_addr: nix::libc::in_addr { s_addr: 0 },
            };
            count(sendmmsg(
                fd,
                h,
                iovs,
                addrs,
                [ControlMessage::Ipv4PacketInfo(&pi)],
                flags,
            ))
        }
        Some((h, Err(ip))) => {
            let pi = nix::libc::in6_pktinfo {
                ipi6_addr: nix::libc::in6_addr {
                    s6_addr: ip.octets(),
                },
                ipi6_ifindex: 0,
            };
            count(sendmmsg(
                fd,
                h,
                iovs,
                addrs,
                [ControlMessage::Ipv6PacketInfo(&pi)],
                flags,
            ))
        }
        None => count(sendmmsg(fd, &mut l.tx_plain, iovs, addrs, [], flags)),
    }
}

/// A socket address nix handed back, as std's.
fn socket_addr(a: &SockaddrStorage) -> Option<SocketAddr> {
    a.as_sockaddr_in()
        .map(|v4| SocketAddr::V4((*v4).into()))
        .or_else(|| a.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into())))
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

    /// A session's eviction id names its worker, slot and serial, and a slot reused by a
    /// later session (another serial) is told apart.
    #[test]
    fn an_eviction_id_names_the_worker_slot_and_serial() {
        for (w, slot, serial) in [(0, 0, 0), (3, 123_456, 0xff_ffff), (255, 9_999_999, 77)] {
            assert_eq!(evict_parts(evict_id(w, slot, serial)), (w, slot, serial));
        }
        assert_ne!(evict_id(1, 5, 1), evict_id(1, 5, 2));
        assert_ne!(evict_id(1, 5, 1), evict_id(2, 5, 1));
        // The serial keeps its low 24 bits, as the worker compares it.
        assert_eq!(evict_parts(evict_id(0, 1, 0x0100_0002)).2, 2);
    }
}
