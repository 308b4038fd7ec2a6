//! The `sip-tcp` vserver's IO shell (tokio): SIP over TCP with Content-Length framing,
//! per-message routing by the shared [`SipCore`], pooled long-lived connections to services,
//! and responses returned on the client connection the request came from.
//!
//! - Client connections get an id that fulcrum writes into its Via (`;fc-conn=<hex>`), so a
//!   response finds its connection without a transaction table.
//! - One connection per service, owned by a task that connects on demand with backoff; a
//!   failed connect marks the service DOWN (passive detection) and a later successful one
//!   marks it UP again.
//! - Each client has a write queue bounded in bytes ([`outbox`]): a client that sends faster
//!   than it reads its answers is no longer read until its queue drains; one that does not
//!   read at all is disconnected, and nobody else waits for it.
//! - Requests from a service toward a client (in-dialog) go to a live connection from the
//!   client's address (RFC 5923-style alias); with none, they are dropped and counted,
//!   never relayed elsewhere.
//! - The transports bridge (docs/sip.md): members that speak sip-udp are reached over one UDP
//!   socket of the vserver (its UDP leg, bound at start when the vserver has such members);
//!   what they send there is handled as theirs and goes back to the client connections.
//!   Members of the other stream transport (sip-tcp under a sip-tls vserver and the
//!   reverse) are links like the others, with or without TLS.
//!
//! # Reload
//! Every message is decided and carried out with one [`Generation`]: the core and the link
//! (connection task) of each of its members, swapped whole by [`SipStreamShared::install`]. A
//! reload keeps the client connections and the links of members that stay (same service
//! name and address); members it adds get a new link, which connects on their first
//! request. The link of a member it removes is retired: requests still queued for it are
//! chosen again by the current core, no new request is written to it, and its connection
//! stays open for [`link::RETIRED_DRAIN`] (responses to requests already written, the service's
//! in-dialog requests and the clients' responses to them) unless the service closes it
//! first.

use crate::balancer::{Balancer, Health};
use crate::config::{Config, Protocol, Vserver};
use crate::core::sip::{Action, Origin, SipCore, SipParams};
use crate::proxy::context::{
    DataPath, Rebuild, RebuildCx, RuntimeError, StartCtx, VserverHandle, bind_tcp, local_identity,
};
use crate::proxy::context::{POLL, Rebuilt, elapsed_nanos};
use crate::proxy::reconfig::{
    HANDOVER_LIMIT, catch_up_dialogs, migrate_dialogs, names_of, rebuilt, settle, sip_core,
    wait_for_readers,
};
use crate::proxy::shutdown::{Signal, TaskGroup, TaskGuard};
use crate::sip::framing::{DEFAULT_MAX_MESSAGE, PONG};
use crate::sip::{Frame, Local, Transport, scan};
use crate::stats::{LogLimiter, bump};
use arc_swap::ArcSwap;
use bytes::{Bytes, BytesMut};
use dashmap::DashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc};

use crate::core::{inbound, link};
mod outbox;

use inbound::Inbound;
use link::{Link, LinkAction, LinkEvent, Phase};
use outbox::{Level, Outbox, Push};

/// fulcrum's own replies queued toward a service's connection (pongs, answers to its
/// requests, clients' responses while it drains) before more are dropped.
pub(crate) const LINK_REPLY_QUEUE: usize = 1024;
/// Messages queued toward one service while its connection is (re)established.
pub(crate) const SERVICE_QUEUE: usize = 8192;
/// Longest message a service may send: twice a client's, since a response repeats the
/// request's Vias and adds fulcrum's, and one client's large request must not cut the
/// connection every client shares.
pub(crate) const SERVICE_MAX_MESSAGE: usize = 2 * DEFAULT_MAX_MESSAGE;
/// How long what is queued toward a client that has stopped sending may take to be written.
pub(crate) const CLIENT_FLUSH: Duration = Duration::from_secs(10);
/// How long one write toward a client may make no progress before the client counts as not
/// reading and is disconnected (Kamailio's `tcp_send_timeout` has the same default).
pub(crate) const CLIENT_SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// TCP keepalive on service connections (which have no idle timeout): a peer that vanished
/// is found within a few minutes.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

/// Counters specific to the stream transport.
#[derive(Debug, Default)]
pub struct SipStreamCounters {
    pub clients_accepted: AtomicU64,
    pub clients_refused: AtomicU64,
    pub clients_open: AtomicU64,
    pub slow_clients_closed: AtomicU64,
    /// Times a client's requests stopped being read until its write queue drained (it sent
    /// faster than it read its answers).
    pub client_reads_paused: AtomicU64,
    pub framing_errors: AtomicU64,
    pub keepalive_pings: AtomicU64,
    pub responses_no_client: AtomicU64,
    pub in_dialog_no_client: AtomicU64,
    pub service_connect_failures: AtomicU64,
    /// Service connections that ended from the service's side (closed, reset, or a message
    /// that does not frame); each is made again on the next request.
    pub service_connections_lost: AtomicU64,
    pub service_queue_full: AtomicU64,
    /// Requests moved to the next-ranked member after their member's connection failed or
    /// a reload removed it.
    pub requests_rerouted: AtomicU64,
    /// Requests that found no member after their member's connection failed (answered
    /// 503 unless they were ACKs).
    pub requests_lost: AtomicU64,
    /// Service connection tasks that took their retirement in (a reload removed their
    /// member): queue handed back, nothing more written.
    pub services_retired: AtomicU64,
    /// Datagrams on the UDP leg from an address that is no sip-udp member: dropped.
    pub udp_leg_strangers: AtomicU64,
    /// Datagrams the UDP leg could not send (its send buffer full, or an error).
    pub udp_leg_send_errors: AtomicU64,
}

impl SipStreamCounters {
    /// Each counter by its event name, in the order metrics lists them.
    pub fn events(&self) -> [(&'static str, &AtomicU64); 16] {
        [
            ("clients_accepted", &self.clients_accepted),
            ("clients_refused", &self.clients_refused),
            ("slow_clients_closed", &self.slow_clients_closed),
            ("client_reads_paused", &self.client_reads_paused),
            ("framing_errors", &self.framing_errors),
            ("keepalive_pings", &self.keepalive_pings),
            ("responses_no_client", &self.responses_no_client),
            ("in_dialog_no_client", &self.in_dialog_no_client),
            ("service_connect_failures", &self.service_connect_failures),
            ("service_connections_lost", &self.service_connections_lost),
            ("service_queue_full", &self.service_queue_full),
            ("requests_rerouted", &self.requests_rerouted),
            ("requests_lost", &self.requests_lost),
            ("services_retired", &self.services_retired),
            ("udp_leg_strangers", &self.udp_leg_strangers),
            ("udp_leg_send_errors", &self.udp_leg_send_errors),
        ]
    }
}

struct Client {
    outbox: Outbox,
    remote: SocketAddr,
    /// The client's task; aborting it ends its writer too (see [`AbortOnDrop`]).
    abort: tokio::task::AbortHandle,
}

/// A task that ends with its owner: a client's writer is owned by the client's reading task,
/// so aborting that task (a client that does not read) takes the writer, the socket, the
/// queue and the place in `max_sessions` with it.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The way to one member's connection task. A reload keeps the link of a member that stays
/// (same service name and address) and retires the others.
struct ServiceLink {
    name: String,
    addr: SocketAddr,
    /// TLS toward the service (a sip-tls service's `tls`); a reload stores new certificates
    /// in it for the next connection.
    tls: Option<Arc<crate::tls::TlsConnector>>,
    tx: mpsc::Sender<Bytes>,
    /// Reached over the vserver's UDP leg (a sip-udp member): no connection, no task.
    udp: bool,
    retired: AtomicBool,
    retire: Notify,
}

impl ServiceLink {
    fn new(
        name: &str,
        addr: SocketAddr,
        tls: Option<crate::tls::TlsConnector>,
        udp: bool,
    ) -> (Arc<ServiceLink>, mpsc::Receiver<Bytes>) {
        let (tx, rx) = mpsc::channel(SERVICE_QUEUE);
        let link = ServiceLink {
            name: name.to_owned(),
            addr,
            tls: tls.map(Arc::new),
            tx,
            udp,
            retired: AtomicBool::new(false),
            retire: Notify::new(),
        };
        (Arc::new(link), rx)
    }

    fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        self.retire.notify_waiters();
    }

    fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Resolves once the link is retired (at once if it already is).
    async fn retired(&self) {
        loop {
            // Created before the check: `notify_waiters` reaches it from here on.
            let wake = self.retire.notified();
            if self.is_retired() {
                return;
            }
            wake.await;
        }
    }
}

/// The configuration one message is handled with: the core, and the link of each of its
/// members (same index). Swapped whole, so a decision and the link it names always belong
/// together.
pub(crate) struct Generation {
    core: Arc<SipCore>,
    links: Vec<Arc<ServiceLink>>,
    max_clients: usize,
    idle: Duration,
}

impl Generation {
    fn index_of(&self, link: &ServiceLink) -> Option<usize> {
        self.links.iter().position(|l| std::ptr::eq(&**l, link))
    }
}

/// State shared by the tasks of one sip-tcp vserver.
pub struct SipStreamShared {
    name: String,
    current: ArcSwap<Generation>,
    pub counters: SipStreamCounters,
    clients: DashMap<u64, Client>,
    /// Remote address → client connection id (the alias used for in-dialog requests).
    by_remote: DashMap<SocketAddr, u64>,
    /// Service address → write queue of a retired link's connection while it drains, so a
    /// client's response to that service's in-dialog request still reaches it.
    draining: DashMap<SocketAddr, mpsc::Sender<Bytes>>,
    next_conn: AtomicU64,
    epoch: Instant,
    /// Client connections and service links: the shutdown waits for them.
    tasks: TaskGroup,
    /// Service links' tasks (current and retired ones still draining), for the shutdown to
    /// end; finished ones are pruned at each install.
    link_tasks: std::sync::Mutex<Vec<tokio::task::AbortHandle>>,
    log: LogLimiter,
    /// Where the links of added members run.
    tokio: tokio::runtime::Handle,
    /// TLS on accepted connections (a sip-tls vserver); a reload stores new certificates in
    /// it for the next handshakes.
    tls: Option<Arc<crate::tls::TlsListener>>,
    /// The UDP leg toward sip-udp members (the transports bridge), when there are any.
    udp: Option<Arc<tokio::net::UdpSocket>>,
    /// The links of a sip-udp vserver's stream members ([`start_bridge`]): its clients are
    /// answered over UDP from this socket (a clone of one of the vserver's own, blocking:
    /// sent to without waiting), not over client connections.
    front: Option<std::net::UdpSocket>,
}

impl std::fmt::Debug for SipStreamShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SipStreamShared")
            .field("vserver", &self.name)
            .field("clients", &self.clients.len())
            .finish_non_exhaustive()
    }
}

/// What a new generation is built from: the core, and the vserver's `max_sessions` and
/// `idle_timeout`.
pub(crate) struct Install {
    pub core: Arc<SipCore>,
    pub max_clients: usize,
    pub idle: Duration,
    /// Per member (same index): TLS toward it, for sip-tls services.
    pub tls: Vec<Option<crate::tls::ClientTls>>,
}

impl Install {
    /// The TLS of each member of `v` toward its service ([`Install::tls`]).
    pub(crate) fn member_tls(config: &Config, v: &Vserver) -> Vec<Option<crate::tls::ClientTls>> {
        v.members()
            .map(|i| {
                let s = config.services.get(i)?;
                s.tls.as_ref()?.client_tls(s.address.ip())
            })
            .collect()
    }
}

impl SipStreamShared {
    fn now(&self) -> u64 {
        elapsed_nanos(self.epoch)
    }

    /// The core messages are decided with now.
    pub fn core(&self) -> Arc<SipCore> {
        Arc::clone(&self.current.load().core)
    }

    /// Open client connections.
    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    /// Whether the vserver has its UDP leg (it had sip-udp members at start).
    pub(crate) fn has_udp_leg(&self) -> bool {
        self.udp.is_some()
    }

    /// Make `next` the current generation: members of its balancer that were already
    /// members with the same address keep their link (and its connection), the others get
    /// a new one; links of members that left are retired once `next` is current. Returns
    /// the generation `next` replaced: once its count falls to one (the caller's), no worker
    /// still handles a message with it.
    pub(crate) fn install(self: &Arc<Self>, next: Install) -> Arc<Generation> {
        let old = self.current.load_full();
        let names: Vec<String> = next
            .core
            .balancer()
            .members()
            .iter()
            .map(|m| m.name.clone())
            .collect();
        let mut fresh = Vec::new();
        let links: Vec<Arc<ServiceLink>> = names
            .iter()
            .enumerate()
            .map(|(m, name)| {
                let addr = next
                    .core
                    .member_addr(m)
                    .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
                let tls = next.tls.get(m).cloned().flatten();
                let udp = next.core.member_transport(m) == Transport::Udp;
                // A link is kept while the service is the same one, reached the same way
                // (UDP, TLS or TCP); new certificates go to its next connection.
                let kept = old.links.iter().find(|l| {
                    l.name == *name
                        && l.addr == addr
                        && l.tls.is_some() == tls.is_some()
                        && l.udp == udp
                });
                match (kept, tls) {
                    (Some(l), tls) => {
                        if let (Some(c), Some(t)) = (&l.tls, tls) {
                            c.store(t);
                        }
                        Arc::clone(l)
                    }
                    (None, tls) => {
                        // The same service reached anew (another address): its handshakes
                        // count on.
                        let was = old.links.iter().find(|l| l.name == *name);
                        let was = was.and_then(|l| l.tls.as_deref());
                        let tls = tls.map(|t| crate::tls::TlsConnector::carrying(t, was));
                        let (link, rx) = ServiceLink::new(name, addr, tls, udp);
                        // A sip-udp member's datagrams go out on the UDP leg: no task.
                        if !udp {
                            fresh.push((Arc::clone(&link), rx));
                        }
                        link
                    }
                }
            })
            .collect();
        let gone: Vec<Arc<ServiceLink>> = old
            .links
            .iter()
            .filter(|l| !links.iter().any(|k| Arc::ptr_eq(k, l)))
            .cloned()
            .collect();
        self.current.store(Arc::new(Generation {
            core: next.core,
            links,
            max_clients: next.max_clients,
            idle: next.idle,
        }));
        {
            let mut tasks = crate::sync::lock(&self.link_tasks);
            tasks.retain(|t| !t.is_finished());
            for (link, rx) in fresh {
                let guard = self.tasks.guard();
                let task = self.tokio.spawn({
                    let shared = Arc::clone(self);
                    async move {
                        let _guard = guard;
                        service_loop(shared, link, rx).await;
                    }
                });
                tasks.push(task.abort_handle());
            }
        }
        for link in gone {
            link.retire();
        }
        old
    }

    /// The handshake counters of each member reached over TLS, by service name.
    pub fn service_tls(&self) -> Vec<(String, Arc<crate::tls::HandshakeCounters>)> {
        let g = self.current.load();
        g.links
            .iter()
            .filter_map(|l| Some((l.name.clone(), Arc::clone(&l.tls.as_ref()?.counters))))
            .collect()
    }

    /// Store the service certificates of `config` (read again by a reload) into the links
    /// of this vserver's members: their next connections use them.
    pub(crate) fn store_client_tls(&self, config: &Config) {
        let g = self.current.load();
        for link in &g.links {
            let (Some(c), Some(s)) = (
                &link.tls,
                config.services.iter().find(|s| s.name == link.name),
            ) else {
                continue;
            };
            if let Some(t) = s.tls.as_ref().and_then(|t| t.client_tls(s.address.ip())) {
                c.store(t);
            }
        }
    }

    /// Queue `bytes` toward client `id`; a full queue disconnects that client only.
    fn to_client(&self, id: u64, bytes: Bytes) -> bool {
        let Some(c) = self.clients.get(&id) else {
            return false;
        };
        match c.outbox.push(bytes) {
            Push::Queued => true,
            Push::Full => {
                drop(c);
                self.disconnect_slow_client(id, "its write queue is full");
                false
            }
            Push::Closed => false,
        }
    }

    /// Disconnect client `id`, which does not read what is written to it: its task (reader,
    /// writer, socket) ends. Counted once, by whoever removes it (two messages may find its
    /// queue full at once).
    fn disconnect_slow_client(&self, id: u64, why: &str) {
        let Some((abort, remote)) = self.clients.get(&id).map(|c| (c.abort.clone(), c.remote))
        else {
            return;
        };
        if self.forget_client(id, remote) {
            bump(&self.counters.slow_clients_closed);
            tracing::info!(vserver = %self.name, %remote, why, "client does not read: disconnected");
            abort.abort();
        }
    }

    /// Send one of fulcrum's own replies (or a pong) back on the connection of `to`.
    fn reply(&self, to: ReplyTo<'_>, bytes: Bytes) {
        match to {
            ReplyTo::Client(id) => {
                self.to_client(id, bytes);
            }
            ReplyTo::Link(tx) => {
                let _ = tx.try_send(bytes);
            }
            ReplyTo::Nowhere => {}
        }
    }

    /// Queue `bytes` toward member `member` of `g`. A link retired meanwhile (a reload
    /// removed its member after `g` was loaded) no longer takes requests: they are chosen
    /// again by the current core.
    fn to_service(&self, g: &Generation, member: usize, bytes: Bytes) -> bool {
        let Some(link) = g.links.get(member) else {
            bump(&self.counters.service_queue_full);
            return false;
        };
        if link.udp {
            return self.to_udp(&bytes, link.addr);
        }
        match link.tx.try_send(bytes) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(bytes)) => {
                self.redispatch(link, bytes);
                true
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                bump(&self.counters.service_queue_full);
                false
            }
        }
    }

    /// Send `bytes` to `addr` over the UDP leg. A datagram path does not wait: a full send
    /// buffer loses the datagram (counted), and SIP retransmits it (RFC 3261 §17.1.1.2).
    fn to_udp(&self, bytes: &[u8], addr: SocketAddr) -> bool {
        if let Some(front) = &self.front {
            return self.to_front(front, bytes, addr);
        }
        let Some(sock) = &self.udp else {
            bump(&self.counters.udp_leg_send_errors);
            return false;
        };
        let addr = udp_target(sock, addr);
        self.datagram_sent(sock.try_send_to(bytes, addr), addr)
    }

    /// Whether a datagram to `addr` went out; one that did not is counted (and logged, at a
    /// limited rate).
    fn datagram_sent(&self, sent: std::io::Result<usize>, addr: SocketAddr) -> bool {
        match sent {
            Ok(_) => true,
            Err(e) => {
                bump(&self.counters.udp_leg_send_errors);
                if self.log.allow(self.now()) {
                    tracing::debug!(vserver = %self.name, %addr, error = %e, "UDP send failed");
                }
                false
            }
        }
    }

    /// Send `bytes` to `addr` from the sip-udp vserver's socket `front`, without waiting (the
    /// socket blocks for its worker's receive; MSG_DONTWAIT keeps this send from blocking a
    /// link's task on a full send buffer: the datagram is lost and counted, as on the leg).
    fn to_front(&self, front: &std::net::UdpSocket, bytes: &[u8], addr: SocketAddr) -> bool {
        let sent = socket2::SockRef::from(front).send_to_with_flags(
            bytes,
            &addr.into(),
            nix::libc::MSG_DONTWAIT,
        );
        self.datagram_sent(sent, addr)
    }

    /// Carry out, for a sip-udp vserver's worker, a decision its core `core` made for a
    /// datagram that involves a stream member: a request to member `m`, or a client's
    /// response to a stream service's in-dialog request (to that service's address). Queues
    /// it on the member's link and returns `None`, or returns where the datagram goes over
    /// UDP (a sip-udp member, or an address that is no stream member's).
    pub(crate) fn carry_datagram(
        &self,
        core: &Arc<SipCore>,
        action: Action,
        out: &[u8],
    ) -> Option<SocketAddr> {
        let g = self.current.load();
        match action {
            Action::ToMember(m) => {
                // A reload between the worker's decision and this load: the member's index in
                // the current generation, by name.
                let m = if Arc::ptr_eq(&g.core, core) {
                    Some(m)
                } else {
                    let name = core.balancer().members().get(m).map(|x| x.name.as_str());
                    g.core
                        .balancer()
                        .members()
                        .iter()
                        .position(|x| Some(x.name.as_str()) == name)
                };
                match m {
                    Some(m) if g.core.member_transport(m) == Transport::Udp => {
                        g.core.member_addr(m)
                    }
                    Some(m) => {
                        if !self.to_service(&g, m, Bytes::copy_from_slice(out)) {
                            self.answer_unavailable(&g, out);
                        }
                        None
                    }
                    None => {
                        self.redispatch_request(&g, None, Bytes::copy_from_slice(out));
                        None
                    }
                }
            }
            Action::ToAddr(addr) => {
                let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
                match g.core.member_of(addr) {
                    Some(m) if g.core.member_transport(m) != Transport::Udp => {
                        self.to_service(&g, m, Bytes::copy_from_slice(out));
                        None
                    }
                    _ => match self.draining_tx(addr) {
                        Some(tx) => {
                            let _ = tx.try_send(Bytes::copy_from_slice(out));
                            None
                        }
                        None => Some(addr),
                    },
                }
            }
            Action::Reply(addr) => Some(addr),
            Action::ToConn(_) | Action::Drop(_) => None,
        }
    }

    /// The queue of the draining connection to a service a reload removed, if there is one.
    fn draining_tx(&self, addr: SocketAddr) -> Option<mpsc::Sender<Bytes>> {
        self.draining.get(&addr).map(|t| t.clone())
    }

    /// Send a request that could not go over `link` to the member the current core chooses
    /// now (a failed member is DOWN and a removed one absent, so the ranking passes it
    /// over). With none, it is counted lost and its client gets fulcrum's 503.
    fn redispatch(&self, link: &ServiceLink, bytes: Bytes) {
        // A client's response to the service's in-dialog request cannot be chosen again:
        // it goes to the service's draining connection if there is one.
        if scan::is_response(&bytes) {
            match self.draining_tx(link.addr) {
                Some(tx) if tx.try_send(bytes).is_ok() => {}
                _ => bump(&self.counters.responses_no_client),
            }
            return;
        }
        let g = self.current.load();
        self.redispatch_request(&g, Some(link), bytes);
    }

    /// Send a forwarded request to the member `g`'s core chooses now, other than `failed`'s;
    /// with none, it is counted lost and its client gets fulcrum's 503.
    fn redispatch_request(&self, g: &Generation, failed_link: Option<&ServiceLink>, bytes: Bytes) {
        let failed = failed_link.and_then(|l| g.index_of(l));
        let dst = failed_link.map_or(SocketAddr::from(([0, 0, 0, 0], 0)), |l| l.addr);
        let sent = match g.core.rechoose(&bytes, dst, self.now()) {
            Some(m) if Some(m) != failed => g.links.get(m).is_some_and(|l| {
                if l.udp {
                    self.to_udp(&bytes, l.addr)
                } else {
                    l.tx.try_send(bytes.clone()).is_ok()
                }
            }),
            _ => false,
        };
        if sent {
            bump(&self.counters.requests_rerouted);
            return;
        }
        bump(&self.counters.requests_lost);
        self.answer_unavailable(g, &bytes);
    }

    /// Answer a forwarded request no service took with fulcrum's 503 on its client's
    /// connection (nothing for ACK, see `SipCore::unavailable`).
    fn answer_unavailable(&self, g: &Generation, forwarded: &[u8]) {
        let mut out = Vec::new();
        match g.core.unavailable(forwarded, &mut out) {
            Action::ToConn(id) => {
                self.to_client(id, Bytes::from(out));
            }
            // A sip-udp vserver's client: the 503 goes where its Via says.
            Action::ToAddr(addr) if self.front.is_some() => {
                self.to_udp(&out, addr);
            }
            _ => {}
        }
    }

    /// Redispatch `pending` and everything queued on `rx` (the receiving end of `link`).
    fn redispatch_queued(
        &self,
        link: &ServiceLink,
        pending: Option<Bytes>,
        rx: &mut mpsc::Receiver<Bytes>,
    ) {
        for bytes in pending
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            self.redispatch(link, bytes);
        }
    }

    /// Remove client `id` from the tables; true when this call removed it.
    fn forget_client(&self, id: u64, remote: SocketAddr) -> bool {
        let removed = self.clients.remove(&id).is_some();
        if removed {
            self.counters.clients_open.fetch_sub(1, Ordering::Relaxed);
        }
        self.by_remote.remove_if(&remote, |_, v| *v == id);
        removed
    }

    /// Carry out the decision `g`'s core made for a message that arrived from `origin`.
    fn dispatch(
        &self,
        g: &Generation,
        action: Action,
        out: &[u8],
        origin: Origin,
        reply: ReplyTo<'_>,
    ) {
        let bytes = || Bytes::copy_from_slice(out);
        match action {
            Action::ToMember(m) => {
                if !self.to_service(g, m, bytes()) {
                    // The service's queue is full (it is not keeping up): the client hears
                    // 503 + Retry-After now rather than waiting for a transaction timeout.
                    self.answer_unavailable(g, out);
                }
            }
            Action::ToConn(id) => {
                if !self.to_client(id, bytes()) {
                    bump(&self.counters.responses_no_client);
                }
            }
            Action::ToAddr(addr) => {
                let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
                // A client's response may go to another port of a sip-udp service's host (its
                // Via says where); anything else only to a member's own address, so that a
                // service's request toward a client on the same host reaches the client.
                let udp_member = match origin {
                    Origin::Client { .. } => g.core.udp_member_of(addr),
                    Origin::Member(_) => g
                        .core
                        .member_of(addr)
                        .filter(|&m| g.core.member_transport(m) == Transport::Udp),
                };
                if self.udp.is_some() && udp_member.is_some() {
                    // A client's response to a sip-udp service's in-dialog request: to the
                    // address its Via names, on the UDP leg.
                    self.to_udp(out, addr);
                } else if let Some(m) = g.core.member_of(addr) {
                    // A client's response to a service's in-dialog request.
                    self.to_service(g, m, bytes());
                } else if let Some(tx) = self.draining_tx(addr) {
                    // The same, toward a service a reload removed (its connection drains).
                    let _ = tx.try_send(bytes());
                } else if let (Origin::Member(_), true) = (origin, self.front.is_some()) {
                    // A stream service's response or in-dialog request toward a client of a
                    // sip-udp vserver: a datagram, as the vserver sends any.
                    self.to_udp(out, addr);
                } else if let Origin::Member(_) = origin {
                    // A service's in-dialog request toward a client: only over a live
                    // connection from that client's address. Never for a message from a
                    // client, which could otherwise be injected into another client's
                    // connection.
                    match self.by_remote.get(&addr).map(|v| *v) {
                        Some(id) => {
                            self.to_client(id, bytes());
                        }
                        None => bump(&self.counters.in_dialog_no_client),
                    }
                } else {
                    bump(&self.counters.responses_no_client);
                }
            }
            Action::Reply(_) => {
                // On streams a reply goes back on the connection it answers.
                self.reply(reply, bytes());
            }
            Action::Drop(reason) => {
                if self.log.allow(self.now()) {
                    tracing::debug!(vserver = %self.name, ?reason, "message dropped");
                }
            }
        }
    }
}

/// A stream a sip-tcp connection runs over (TCP today; a TLS stream is the same to the link
/// and the reader): split into the read half its reader task owns and the write half.
pub(crate) trait SipStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    type Read: StreamRead;
    type Write: AsyncWrite + Unpin + Send + 'static;
    fn split(self) -> (Self::Read, Self::Write);
    fn local_addr(&self) -> std::io::Result<SocketAddr>;
    /// Options of a service connection (which has no idle timeout): TCP keepalive, so a peer
    /// that vanished is found within a few minutes, and no Nagle delay.
    fn prepare_link(&self) -> std::io::Result<()>;
}

/// A read half. A TCP one can wait for bytes without holding a buffer (an idle connection
/// holds none); a TLS one cannot (its records must be read to know whether they carry
/// bytes), so its read waits with the buffer.
pub(crate) trait StreamRead: AsyncRead + Unpin + Send + 'static {
    /// Whether [`StreamRead::readable`] waits for bytes; when false it resolves at once and
    /// the read itself waits.
    const WAITS_WITHOUT_BUFFER: bool;
    /// Resolves once a read may make progress.
    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + Send;
}

/// A TLS stream over TCP, either side (accepted from a client, or opened to a service).
type TlsOver<S> = tokio_rustls::TlsStream<S>;

impl SipStream for TlsOver<TcpStream> {
    type Read = tokio::io::ReadHalf<TlsOver<TcpStream>>;
    type Write = tokio::io::WriteHalf<TlsOver<TcpStream>>;

    fn split(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.get_ref().0.local_addr()
    }

    fn prepare_link(&self) -> std::io::Result<()> {
        self.get_ref().0.prepare_link()
    }
}

impl StreamRead for tokio::io::ReadHalf<TlsOver<TcpStream>> {
    const WAITS_WITHOUT_BUFFER: bool = false;

    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + Send {
        std::future::ready(Ok(()))
    }
}

/// TLS toward a service (a sip-tls service): the TCP connect, then the handshake, both
/// within the link's connect deadline; a failed handshake is counted by its reason and
/// fails the connect. The handshake's own bound is that deadline, so that a handshake still
/// running then is counted as a `timeout` (the link's driver polls the connect before its
/// timer, [`drive_link`]).
struct TlsLinkConnector(Arc<crate::tls::TlsConnector>);

impl Connector for TlsLinkConnector {
    type Stream = TlsOver<TcpStream>;

    fn connect(
        &self,
        addr: SocketAddr,
        deadline: std::time::Instant,
    ) -> impl Future<Output = std::io::Result<Self::Stream>> + Send {
        let tls = Arc::clone(&self.0);
        async move {
            let tcp = TcpStream::connect(addr).await?;
            tls.connect_by(tcp, tokio::time::Instant::from_std(deadline))
                .await
                .map(tokio_rustls::TlsStream::Client)
                .map_err(|r| std::io::Error::other(format!("TLS handshake failed: {}", r.name())))
        }
    }
}

impl SipStream for TcpStream {
    type Read = OwnedReadHalf;
    type Write = OwnedWriteHalf;

    fn split(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        self.into_split()
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        TcpStream::local_addr(self)
    }

    fn prepare_link(&self) -> std::io::Result<()> {
        let keepalive = socket2::SockRef::from(self).set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_IDLE),
        );
        let _ = self.set_nodelay(true);
        keepalive
    }
}

impl StreamRead for OwnedReadHalf {
    const WAITS_WITHOUT_BUFFER: bool = true;

    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + Send {
        OwnedReadHalf::readable(self)
    }
}

/// How a service link makes its connections.
pub(crate) trait Connector: Send + Sync + 'static {
    type Stream: SipStream;
    /// A connection to `addr`; the link gives up at `deadline` (its own timer).
    fn connect(
        &self,
        addr: SocketAddr,
        deadline: std::time::Instant,
    ) -> impl Future<Output = std::io::Result<Self::Stream>> + Send;
}

/// Plain TCP.
struct TcpConnector;

impl Connector for TcpConnector {
    type Stream = TcpStream;

    fn connect(
        &self,
        addr: SocketAddr,
        _: std::time::Instant,
    ) -> impl Future<Output = std::io::Result<TcpStream>> + Send {
        TcpStream::connect(addr)
    }
}

thread_local! {
    /// Where a message is rewritten before it is copied into its queue: one per thread.
    static OUT: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(Vec::with_capacity(4096));
}

/// Who is on the other side of a connection being read, and where its reader's own answers go.
struct Peer<'a> {
    origin: Origin,
    src: SocketAddr,
    dst: SocketAddr,
    /// Where pongs and fulcrum's own replies go.
    reply: ReplyTo<'a>,
    /// Set once anything arrives (a service link's: the service has spoken).
    heard: Option<&'a AtomicBool>,
    /// A client's write queue.
    queue: Option<&'a Level>,
}

/// Where fulcrum's own answers to a message go (a reply it makes, a pong): back on the
/// connection the message came on.
#[derive(Clone, Copy)]
enum ReplyTo<'a> {
    /// A client connection, through its outbox.
    Client(u64),
    /// A service link's connection.
    Link(&'a mpsc::Sender<Bytes>),
    /// Nowhere: the UDP leg sends its replies itself.
    Nowhere,
}

/// Read framed SIP messages from `read`, hand each to the current core, until EOF, error,
/// idle timeout (clients only: a service connection stays while the service keeps it), a
/// message that takes longer than [`inbound::MESSAGE_DEADLINE`] to arrive, or a framing error
/// (the buffer and the deadline are [`Inbound`]'s). A client's requests are not read while
/// its write queue is full ([`outbox`]).
async fn read_messages<R: StreamRead>(shared: &SipStreamShared, mut read: R, peer: Peer<'_>) {
    let Peer {
        origin,
        src,
        dst,
        reply,
        heard,
        queue,
    } = peer;
    let (max_message, is_client) = match origin {
        Origin::Member(_) => (SERVICE_MAX_MESSAGE, false),
        Origin::Client { .. } => (DEFAULT_MAX_MESSAGE, true),
    };
    // Rewritten messages are built in a per-thread buffer and copied out.
    let mut inbound = Inbound::new(max_message);
    loop {
        // Frame everything already buffered (several messages may arrive in one read).
        loop {
            match inbound.frame() {
                Ok(Some(frame)) => {
                    let len = frame.len();
                    match frame {
                        Frame::Message { .. } => OUT.with_borrow_mut(|out| {
                            if let Some(h) = heard.filter(|h| !h.load(Ordering::Relaxed)) {
                                h.store(true, Ordering::Relaxed);
                            }
                            let now = shared.now();
                            let g = shared.current.load();
                            let action =
                                g.core
                                    .handle(inbound.front(len), origin, src, dst, now, out);
                            shared.dispatch(&g, action, out, origin, reply);
                        }),
                        Frame::Ping => {
                            bump(&shared.counters.keepalive_pings);
                            shared.reply(reply, Bytes::from_static(PONG));
                        }
                        Frame::Pong => {}
                    }
                    inbound.consume(len);
                }
                Ok(None) => break,
                Err(e) => {
                    bump(&shared.counters.framing_errors);
                    if shared.log.allow(shared.now()) {
                        tracing::info!(vserver = %shared.name, %src, error = %e, "closing stream after framing error");
                    }
                    return;
                }
            }
        }
        // A client that sends faster than it reads: its next requests wait in its socket
        // until the writer has drained its queue (or has given up on it). The time paused
        // does not count against a message under way.
        if let Some(level) = queue.filter(|l| l.should_pause()) {
            bump(&shared.counters.client_reads_paused);
            let paused = tokio::time::Instant::now();
            level.drained().await;
            inbound.postpone(paused.elapsed());
        }
        // Wait with no buffer; take one once bytes are there. A client waits at most its
        // idle timeout, and a partial message at most what is left of its deadline.
        let now = tokio::time::Instant::now().into_std();
        inbound.settle(now);
        let idle_until = is_client.then(|| now + shared.current.load().idle);
        if !R::WAITS_WITHOUT_BUFFER {
            // TLS: the read waits, with the buffer, within the same bounds.
            let until = inbound.wait_until(idle_until);
            let read_once = read.read_buf(inbound.read_buf());
            let got = match until {
                Some(u) => tokio::time::timeout_at(tokio::time::Instant::from_std(u), read_once)
                    .await
                    .ok(),
                None => Some(read_once.await),
            };
            match got {
                Some(Ok(0) | Err(_)) => return,
                Some(Ok(_)) => continue,
                None => {
                    if inbound.is_overdue(tokio::time::Instant::now().into_std()) {
                        bump(&shared.counters.framing_errors);
                        if shared.log.allow(shared.now()) {
                            tracing::info!(vserver = %shared.name, %src, "closing stream: a message did not arrive whole in time");
                        }
                    }
                    return;
                }
            }
        }
        let ready = match inbound.wait_until(idle_until) {
            Some(u) => {
                tokio::time::timeout_at(tokio::time::Instant::from_std(u), read.readable()).await
            }
            None => Ok(read.readable().await),
        };
        match ready {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return,
            Err(_) => {
                if inbound.is_overdue(tokio::time::Instant::now().into_std()) {
                    bump(&shared.counters.framing_errors);
                    if shared.log.allow(shared.now()) {
                        tracing::info!(vserver = %shared.name, %src, "closing stream: a message did not arrive whole in time");
                    }
                }
                return;
            }
        }
        // One read attempt, never a wait with the buffer held: a readiness can be stale (a
        // fresh connection starts out readable), and then the attempt clears it and the loop
        // waits again without the buffer. A short read clears it too (the receive queue is
        // empty), so a burst costs one `recv`.
        let attempt = {
            let mut read_buf = std::pin::pin!(read.read_buf(inbound.read_buf()));
            std::future::poll_fn(|cx| std::task::Poll::Ready(read_buf.as_mut().poll(cx))).await
        };
        match attempt {
            std::task::Poll::Ready(Ok(0) | Err(_)) => return,
            std::task::Poll::Ready(Ok(_)) => {}
            // Also what the read says once this task has used up its scheduling budget (the
            // readiness is then still set, and `readable` would not wait): give the thread
            // back before trying again, or a busy connection would spin on it.
            std::task::Poll::Pending => tokio::task::yield_now().await,
        }
    }
}

/// Most bytes gathered into one write toward a client.
const WRITE_BATCH: usize = 64 * 1024;

/// Write `bytes` whole and flush them: a TLS stream keeps what the socket did not take in its
/// own buffer until the next write or a flush, and the next write may never come (on TCP the
/// flush costs nothing).
async fn write_out<W: AsyncWrite + Unpin>(write: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    write.write_all(bytes).await?;
    write.flush().await
}

/// Write `bytes` whole and flush them toward a client that must keep reading, for as long as
/// the connection makes progress: the writer gives up only once [`CLIENT_SEND_TIMEOUT`] passes
/// without the connection waking it (room freed by the client's reading). A bound on each
/// step would not do over TLS, whose flush sends what the TLS stream buffered (up to 64 KiB)
/// in one step, however slowly a client that keeps reading takes it.
async fn write_to_client<W: AsyncWrite + Unpin>(
    write: &mut W,
    bytes: &[u8],
) -> Result<(), WriterEnd> {
    use std::task::Poll;
    let mut io = std::pin::pin!(async {
        write.write_all(bytes).await?;
        write.flush().await
    });
    // Made on the first wait only: a write that goes through at once sets no timer.
    let mut quiet: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = io.as_mut().poll(cx) {
            return Poll::Ready(r.map_err(|_| WriterEnd::Failed));
        }
        // The writer's task waits for nothing else: polled before the timer ran out, it was
        // woken by the connection, which made progress; the quiet time starts again.
        let until = tokio::time::Instant::now() + CLIENT_SEND_TIMEOUT;
        let timer = match quiet.as_mut() {
            Some(t) if t.is_elapsed() => return Poll::Ready(Err(WriterEnd::Stalled)),
            Some(t) => {
                t.as_mut().reset(until);
                t
            }
            None => quiet.insert(Box::pin(tokio::time::sleep_until(until))),
        };
        // Registers the wake-up at `until` (it cannot have passed yet).
        let _ = timer.as_mut().poll(cx);
        Poll::Pending
    })
    .await
}

/// How a client's writer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriterEnd {
    /// The queue closed (the client was forgotten) and everything in it was written.
    Done,
    /// A write failed: the connection is broken.
    Failed,
    /// A write (or flush) made no progress for [`CLIENT_SEND_TIMEOUT`]: the client does not
    /// read.
    Stalled,
}

/// Write what is queued toward a client, everything already queued in one write (a client
/// that sends a burst gets its answers in a few system calls, not one per message), and
/// lower its queue's [`Level`] by what was written.
async fn write_messages<W: AsyncWrite + Unpin>(
    mut write: W,
    mut rx: mpsc::UnboundedReceiver<Bytes>,
    level: Arc<Level>,
) -> WriterEnd {
    let mut batch = BytesMut::new();
    while let Some(b) = rx.recv().await {
        let mut cost = outbox::cost(&b);
        let write_once = match rx.try_recv() {
            // The common case: one message, written from where it is.
            Err(_) => write_to_client(&mut write, &b).await,
            Ok(next) => {
                cost += outbox::cost(&next);
                batch.clear();
                batch.extend_from_slice(&b);
                batch.extend_from_slice(&next);
                while batch.len() < WRITE_BATCH {
                    match rx.try_recv() {
                        Ok(more) => {
                            cost += outbox::cost(&more);
                            batch.extend_from_slice(&more);
                        }
                        Err(_) => break,
                    }
                }
                write_to_client(&mut write, &batch).await
            }
        };
        match write_once {
            Ok(()) => level.written(cost),
            Err(end) => return end,
        }
        if batch.capacity() > WRITE_BATCH * 2 {
            batch = BytesMut::new();
        }
    }
    let _ = write.shutdown().await;
    WriterEnd::Done
}

/// Read a client's messages until it is done, then give what is queued toward it a bounded
/// time to be written: a client that half-closed and does not read must not keep the socket.
/// A writer that fails or stalls first ends the client (and with it this task).
async fn serve_client<S: SipStream>(
    shared: Arc<SipStreamShared>,
    stream: S,
    id: u64,
    src: SocketAddr,
    dst: SocketAddr,
    rx: mpsc::UnboundedReceiver<Bytes>,
    level: Arc<Level>,
) {
    // TCP_NODELAY is inherited from the listener (`net::bind_tcp_listener`). The writer is a
    // task of its own, so a client's replies are written while its next requests are read.
    let (read, write) = stream.split();
    let mut writer = AbortOnDrop(tokio::spawn({
        let shared = Arc::clone(&shared);
        let level = Arc::clone(&level);
        async move {
            match write_messages(write, rx, level).await {
                WriterEnd::Done => {}
                WriterEnd::Stalled => shared.disconnect_slow_client(id, "a write made no progress"),
                // The reader finds the broken connection itself, unless it is paused on the
                // queue this writer no longer drains.
                WriterEnd::Failed => {
                    if let Some(abort) = shared.clients.get(&id).map(|c| c.abort.clone()) {
                        shared.forget_client(id, src);
                        abort.abort();
                    }
                }
            }
        }
    }));
    let peer = Peer {
        origin: Origin::Client { conn: Some(id) },
        src,
        dst,
        reply: ReplyTo::Client(id),
        heard: None,
        queue: Some(&level),
    };
    read_messages(&shared, read, peer).await;
    shared.forget_client(id, src);
    // Dropping `writer` afterwards ends it if it has not finished.
    let _ = tokio::time::timeout(CLIENT_FLUSH, &mut writer.0).await;
}

async fn accept_loop(shared: Arc<SipStreamShared>, listener: TcpListener) {
    loop {
        let (stream, src) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                if shared.log.allow(shared.now()) {
                    tracing::warn!(vserver = %shared.name, error = %e, "accept failed");
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        {
            // The access lists, before anything is read (a service's own connection is
            // never refused by them).
            let g = shared.current.load();
            let core = &g.core;
            if core.edge().has_acl() && !core.is_member_ip(src) && !core.edge().admits(src.ip()) {
                drop(stream);
                continue;
            }
        }
        if shared.clients.len() >= shared.current.load().max_clients {
            bump(&shared.counters.clients_refused);
            drop(stream);
            continue;
        }
        let src = SocketAddr::new(src.ip().to_canonical(), src.port());
        let dst = stream.local_addr().unwrap_or(src);
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let (outbox, rx) = Outbox::new();
        let level = outbox.level();
        bump(&shared.counters.clients_accepted);
        shared.counters.clients_open.fetch_add(1, Ordering::Relaxed);
        // The task starts serving once its entry is in the tables: one that ended before
        // could not remove it, and the entry (and its count) would stay forever.
        let (registered, wait_registered) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn({
            let shared = Arc::clone(&shared);
            let guard = shared.tasks.guard();
            async move {
                let _guard = guard;
                if wait_registered.await.is_err() {
                    return;
                }
                match shared.tls.clone() {
                    None => serve_client(shared, stream, id, src, dst, rx, level).await,
                    // The handshake runs here, bounded in time, not in the accept loop: a
                    // client that never finishes it costs this task's timer only.
                    Some(tls) => match tls.accept(stream).await {
                        Ok(s) => {
                            let s = tokio_rustls::TlsStream::Server(s);
                            serve_client(shared, s, id, src, dst, rx, level).await;
                        }
                        Err(reason) => {
                            if shared.log.allow(shared.now()) {
                                tracing::info!(vserver = %shared.name, %src, reason = reason.name(), "TLS handshake failed");
                            }
                            shared.forget_client(id, src);
                        }
                    },
                }
            }
        });
        shared.clients.insert(
            id,
            Client {
                outbox,
                remote: src,
                abort: task.abort_handle(),
            },
        );
        shared.by_remote.insert(src, id);
        let _ = registered.send(());
    }
}

/// Own the connection over `link` (TCP, or TLS for a sip-tls service): see [`drive_link`].
async fn service_loop(
    shared: Arc<SipStreamShared>,
    link: Arc<ServiceLink>,
    rx: mpsc::Receiver<Bytes>,
) {
    match link.tls.clone() {
        Some(tls) => drive_link(shared, link, rx, TlsLinkConnector(tls)).await,
        None => drive_link(shared, link, rx, TcpConnector).await,
    }
}

/// The live connection of a link: the write half, the reader task, and the queue of what
/// fulcrum writes for the service itself (pongs, replies to its requests, and while it
/// drains, clients' responses to its in-dialog requests).
struct LinkConn<W> {
    write: W,
    /// Ends with the connection too: a shutdown aborts the link's task, not its reader.
    reader: AbortOnDrop,
    replies: mpsc::Receiver<Bytes>,
    /// A sender on `replies`, registered in `draining` while the connection drains.
    drain_tx: mpsc::Sender<Bytes>,
    /// Set by the reader once the service has sent anything.
    heard: Arc<AtomicBool>,
}

/// Drive `link`'s [`Link`] machine: wait for what its phase allows (a queued request, the
/// connect, a write, a reply to write, the reader's end, the retirement, the next deadline),
/// feed it in with `now`, and carry out the actions it returns. The member's index, health
/// and failure reports are looked up in the current generation each time, so they follow
/// reloads.
async fn drive_link<C: Connector>(
    shared: Arc<SipStreamShared>,
    link: Arc<ServiceLink>,
    mut rx: mpsc::Receiver<Bytes>,
    connector: C,
) {
    let addr = link.addr;
    let mut machine = Link::new();
    let mut conn: Option<LinkConn<<C::Stream as SipStream>::Write>> = None;
    // The bytes of the write `machine` asked for.
    let mut writing: Option<Bytes> = None;
    let mut actions = Vec::new();
    loop {
        let event = match machine.phase() {
            Phase::Idle => tokio::select! {
                msg = rx.recv() => queued(msg),
                () = link.retired() => LinkEvent::Retired,
            },
            // The connect first: a TLS handshake bounded by the same deadline as the timer
            // is counted as timed out rather than dropped uncounted.
            Phase::Connecting => tokio::select! {
                biased;
                r = connector.connect(addr, connect_deadline(&machine)) => match r {
                    Ok(stream) => {
                        conn = Some(open_link_conn(&shared, &link, stream));
                        LinkEvent::ConnectOk
                    }
                    Err(_) => LinkEvent::ConnectFailed,
                },
                () = sleep_until(machine.poll_timeout()) => LinkEvent::TimerFired,
                () = link.retired() => LinkEvent::Retired,
            },
            Phase::Backoff => tokio::select! {
                () = sleep_until(machine.poll_timeout()) => LinkEvent::TimerFired,
                () = link.retired() => LinkEvent::Retired,
            },
            // A write ends early only if the link is retired meanwhile (a removed service that
            // stopped reading must not hold the task and the requests queued behind it) or,
            // while draining, when the drain ends.
            Phase::Writing | Phase::DrainWriting => match (conn.as_mut(), writing.take()) {
                (Some(c), Some(b)) => tokio::select! {
                    r = write_out(&mut c.write, &b) => if r.is_ok() { LinkEvent::WriteDone } else { LinkEvent::WriteFailed },
                    () = link.retired(), if !machine.is_retired() => LinkEvent::Retired,
                    () = sleep_until(machine.poll_timeout()) => LinkEvent::TimerFired,
                },
                _ => LinkEvent::WriteFailed,
            },
            Phase::Connected => match conn.as_mut() {
                Some(c) => tokio::select! {
                    msg = rx.recv() => queued(msg),
                    Some(b) = c.replies.recv() => LinkEvent::Reply(b),
                    _ = &mut c.reader.0 => LinkEvent::ReaderClosed,
                    () = link.retired() => LinkEvent::Retired,
                    () = sleep_until(machine.poll_timeout()) => LinkEvent::TimerFired,
                },
                None => LinkEvent::ReaderClosed,
            },
            Phase::Draining => match conn.as_mut() {
                Some(c) => tokio::select! {
                    Some(b) = c.replies.recv() => LinkEvent::Reply(b),
                    _ = &mut c.reader.0 => LinkEvent::ReaderClosed,
                    () = sleep_until(machine.poll_timeout()) => LinkEvent::TimerFired,
                },
                None => LinkEvent::ReaderClosed,
            },
            Phase::Closed => return,
        };
        let now = tokio::time::Instant::now().into_std();
        if !machine.is_heard()
            && conn
                .as_ref()
                .is_some_and(|c| c.heard.load(Ordering::Relaxed))
        {
            machine.handle(now, LinkEvent::MessageRead, &mut actions);
        }
        machine.handle(now, event, &mut actions);
        for action in actions.drain(..) {
            match action {
                // The phase (Connecting) does it.
                LinkAction::Connect => {}
                LinkAction::Write(b) => writing = Some(b),
                LinkAction::Redispatch(b) => shared.redispatch(&link, b),
                LinkAction::RedispatchQueue => shared.redispatch_queued(&link, None, &mut rx),
                LinkAction::CloseQueue => rx.close(),
                LinkAction::MarkDown => mark_down(&shared, &link),
                LinkAction::MarkUp => mark_up_again(&shared, &link),
                LinkAction::CountLost => bump(&shared.counters.service_connections_lost),
                LinkAction::CountRetired => bump(&shared.counters.services_retired),
                LinkAction::Disconnect => conn = None,
                LinkAction::StartDrain => {
                    if let Some(c) = &conn {
                        shared.draining.insert(addr, c.drain_tx.clone());
                    }
                }
                LinkAction::EndDrain => {
                    if let Some(mut c) = conn.take() {
                        shared
                            .draining
                            .remove_if(&addr, |_, tx| tx.same_channel(&c.drain_tx));
                        c.reader.0.abort();
                        let _ = c.write.shutdown().await;
                        tracing::debug!(vserver = %shared.name, service = %addr, "connection of a removed service closed");
                    }
                }
                LinkAction::Close => return,
            }
        }
    }
}

fn queued(msg: Option<Bytes>) -> LinkEvent {
    match msg {
        Some(b) => LinkEvent::Queued(b),
        None => LinkEvent::QueueClosed,
    }
}

/// Until when a connect of `machine` (connecting) may run: its timer's deadline.
fn connect_deadline(machine: &Link) -> std::time::Instant {
    let fallback = || std::time::Instant::now() + link::CONNECT_TIMEOUT;
    machine.poll_timeout().unwrap_or_else(fallback)
}

/// Until `t`, or for ever.
async fn sleep_until(t: Option<std::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
        None => std::future::pending().await,
    }
}

/// Set up a new connection to `link`'s service: its options, and the reader task that hands
/// what the service sends to the current core.
fn open_link_conn<S: SipStream>(
    shared: &Arc<SipStreamShared>,
    link: &ServiceLink,
    stream: S,
) -> LinkConn<S::Write> {
    let addr = link.addr;
    if let Err(e) = stream.prepare_link()
        && shared.log.allow(shared.now())
    {
        tracing::debug!(vserver = %shared.name, service = %addr, error = %e, "cannot set TCP keepalive");
    }
    let dst = stream.local_addr().unwrap_or(addr);
    let (read, write) = stream.split();
    // Replies fulcrum makes to a service's request go back on this connection.
    let (reply_tx, replies) = mpsc::channel::<Bytes>(LINK_REPLY_QUEUE);
    let drain_tx = reply_tx.clone();
    // The core reads a member origin only to tell a service from a client, so the index at
    // connect time serves for the life of the connection.
    let origin = Origin::Member(shared.current.load().index_of(link).unwrap_or(0));
    let heard = Arc::new(AtomicBool::new(false));
    let reader = AbortOnDrop(tokio::spawn({
        let shared = Arc::clone(shared);
        let heard = Arc::clone(&heard);
        async move {
            let peer = Peer {
                origin,
                src: addr,
                dst,
                reply: ReplyTo::Link(&reply_tx),
                heard: Some(&heard),
                queue: None,
            };
            read_messages(&shared, read, peer).await;
        }
    }));
    LinkConn {
        write,
        reader,
        replies,
        drain_tx,
        heard,
    }
}

/// A connect to `link`'s service failed (or the connection closed at once): count it, report
/// it to the service's monitor and mark the service DOWN (a member the operator took
/// OUT_OF_SERVICE stays so).
fn mark_down(shared: &SipStreamShared, link: &ServiceLink) {
    bump(&shared.counters.service_connect_failures);
    let g = shared.current.load();
    if let Some(m) = g.index_of(link) {
        let b = g.core.balancer();
        b.report_failure(m);
        // Checked against the current balancer: a reload may have built one that starts
        // this member UP again.
        if b.health(m) == Some(Health::Up) {
            b.set_health(m, Health::Down, shared.now());
            tracing::warn!(vserver = %shared.name, service = %link.addr, "cannot connect: service marked DOWN");
        }
    }
}

/// The service a failed connect marked DOWN has kept a connection for [`link::SHORT_LIVED`]: UP
/// again (unless something else, such as its monitor, has set it otherwise meanwhile).
fn mark_up_again(shared: &SipStreamShared, link: &ServiceLink) {
    let g = shared.current.load();
    if let Some(m) = g.index_of(link)
        && g.core.balancer().health(m) == Some(Health::Down)
    {
        g.core.balancer().set_health(m, Health::Up, shared.now());
        tracing::info!(vserver = %shared.name, service = %link.addr, "connected again: service marked UP");
    }
}

/// Where a datagram to `addr` goes from `sock`: an IPv4 target is mapped when the socket is
/// IPv6 (a wildcard `[::]` bind is dual-stack).
fn udp_target(sock: &tokio::net::UdpSocket, addr: SocketAddr) -> SocketAddr {
    match (sock.local_addr(), addr.ip()) {
        (Ok(SocketAddr::V6(_)), std::net::IpAddr::V4(v4)) => {
            SocketAddr::new(std::net::IpAddr::V6(v4.to_ipv6_mapped()), addr.port())
        }
        _ => addr,
    }
}

/// The UDP leg's receive loop: what sip-udp members send there (responses to the requests
/// fulcrum forwarded, their in-dialog requests toward clients, their answers to the clients'
/// in-dialog requests) is handled as theirs by the current core and carried out like a
/// message read from a link. Datagrams from anyone else are dropped: the leg faces the
/// services, clients reach the vserver on its listener.
async fn udp_leg_loop(shared: Arc<SipStreamShared>, sock: Arc<tokio::net::UdpSocket>) {
    let dst = sock
        .local_addr()
        .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
    let mut buf = vec![0u8; 65_536];
    // fulcrum's own replies to a service's request go back as datagrams, not on a queue.
    loop {
        let (n, src) = match sock.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                if shared.log.allow(shared.now()) {
                    tracing::debug!(vserver = %shared.name, error = %e, "UDP leg receive failed");
                }
                continue;
            }
        };
        let src = SocketAddr::new(src.ip().to_canonical(), src.port());
        OUT.with_borrow_mut(|out| {
            let g = shared.current.load();
            let Some(m) = g.core.udp_member_of(src) else {
                bump(&shared.counters.udp_leg_strangers);
                return;
            };
            let origin = Origin::Member(m);
            match g
                .core
                .handle(&buf[..n], origin, src, dst, shared.now(), out)
            {
                Action::Reply(addr) => {
                    shared.to_udp(out, addr);
                }
                action => shared.dispatch(&g, action, out, origin, ReplyTo::Nowhere),
            }
        });
    }
}

/// Bind the UDP leg of stream vserver `v` toward its sip-udp members: the first bind
/// address's IP with an ephemeral port (docs/sip.md says why), and fulcrum's identity on
/// it (the IP toward the first such member when the bind is a wildcard).
fn bind_udp_leg(
    ctx: &StartCtx<'_>,
    v: &Vserver,
    bound: &[SocketAddr],
    udp_members: &[SocketAddr],
) -> Result<(Arc<tokio::net::UdpSocket>, Local), RuntimeError> {
    let setup = |problem: String| RuntimeError::Setup {
        vserver: v.name.clone(),
        problem,
    };
    let first = *bound
        .first()
        .ok_or_else(|| setup("no bind address".into()))?;
    let at = SocketAddr::new(first.ip(), 0);
    let bind_err = |source| RuntimeError::Bind {
        vserver: v.name.clone(),
        addr: at,
        source,
    };
    let sock = std::net::UdpSocket::bind(at).map_err(bind_err)?;
    sock.set_nonblocking(true).map_err(bind_err)?;
    let sock = {
        let _enter = ctx.tokio.enter();
        tokio::net::UdpSocket::from_std(sock).map_err(bind_err)?
    };
    let local = sock.local_addr().map_err(bind_err)?;
    let ip = if local.ip().is_unspecified() {
        let peer = udp_members
            .first()
            .ok_or_else(|| setup("no sip-udp service for the UDP leg".into()))?;
        crate::net::local_ip_toward(*peer).map_err(|e| setup(format!("no route to {peer}: {e}")))?
    } else {
        local.ip()
    };
    let leg =
        Local::from_addr(SocketAddr::new(ip, local.port()), Transport::Udp).with_aliases(&[local]);
    Ok((Arc::new(sock), leg))
}

/// The vserver's own task: its accept loops and dialog sweeper until the shutdown signal,
/// then the end of every client connection and service link (aborted, so that no
/// connection's read or write loop has to look at the signal on its data path).
async fn run_vserver(
    shared: Arc<SipStreamShared>,
    listeners: Vec<TcpListener>,
    mut signal: Signal,
    _guard: TaskGuard,
) {
    let mut accepts: Vec<AbortOnDrop> = listeners
        .into_iter()
        .map(|l| AbortOnDrop(tokio::spawn(accept_loop(Arc::clone(&shared), l))))
        .collect();
    if let Some(sock) = shared.udp.clone() {
        accepts.push(AbortOnDrop(tokio::spawn(udp_leg_loop(
            Arc::clone(&shared),
            sock,
        ))));
    }
    // Dialog expiry, as on UDP, in whatever core is current (with its idle timeout).
    // Looked at every POLL, so a reload to a shorter timeout is followed at once.
    let sweep = async {
        let mut last = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(POLL).await;
            let core = shared.core();
            if last.elapsed() >= core.sweep_interval() {
                core.sweep(shared.now());
                last = tokio::time::Instant::now();
            }
        }
    };
    tokio::select! {
        () = signal.recv() => {}
        () = sweep => {}
    }
    // No client is accepted after this, so none escapes the aborts below.
    for mut a in accepts {
        a.0.abort();
        let _ = (&mut a.0).await;
    }
    for c in shared.clients.iter() {
        c.abort.abort();
    }
    for t in crate::sync::lock(&shared.link_tasks).drain(..) {
        t.abort();
    }
}

/// A running sip-tcp / sip-tls vserver: the core it runs now and the state its tasks share
/// (kept across rebuilds; a reload installs a new generation in it).
#[derive(Debug)]
pub struct SipStreamPath {
    core: Arc<SipCore>,
    shared: Arc<SipStreamShared>,
}

impl SipStreamPath {
    /// The core the vserver runs now.
    pub fn core(&self) -> &Arc<SipCore> {
        &self.core
    }

    /// The state the vserver's tasks share.
    pub fn shared(&self) -> &Arc<SipStreamShared> {
        &self.shared
    }
}

impl DataPath for SipStreamPath {
    fn edge(&self) -> &crate::edge::Edge {
        self.core.edge()
    }

    fn sip_core(&self) -> Option<&Arc<SipCore>> {
        Some(&self.core)
    }

    fn service_tls(&self) -> Vec<(String, Arc<crate::tls::HandshakeCounters>)> {
        self.shared.service_tls()
    }

    fn store_client_tls(&self, config: &Config) {
        self.shared.store_client_tls(config);
    }

    fn each_event(&self, visit: &mut dyn FnMut(&'static str, &AtomicU64)) {
        for (name, c) in self.shared.counters.events() {
            visit(name, c);
        }
    }

    /// Same listener, client connections and connections of surviving services (see the
    /// module doc).
    fn rebuild(
        &self,
        cx: &RebuildCx<'_>,
        config: &Config,
        v: &Vserver,
    ) -> Result<Rebuild, RuntimeError> {
        let setup = |problem: &str| RuntimeError::Setup {
            vserver: v.name.clone(),
            problem: problem.to_owned(),
        };
        let shared = Arc::clone(&self.shared);
        // The UDP leg toward sip-udp services is bound at start (its address is in the
        // Record-Route of the dialogs it carries); a reload cannot add one.
        let wants_udp = v
            .members()
            .filter_map(|i| config.services.get(i))
            .any(|s| s.protocol == Protocol::SipUdp);
        if wants_udp && !shared.has_udp_leg() {
            return Err(setup(
                "its first sip-udp service needs a restart (the UDP leg is bound at start)",
            ));
        }
        let now = cx.now();
        let old = shared.core();
        let old_names = names_of(old.balancer());
        // Surviving members share their counters with the old balancer, so the dialogs
        // they carry are already counted there.
        let balancer = Arc::new(Balancer::carrying(config, v, old.balancer()));
        let added = settle(&balancer, &old_names, cx.health_of, now);
        let new_names = names_of(&balancer);
        let core = Arc::new(sip_core(config, v, &old, &balancer));
        // Expired dialogs are not migrated: close their count first, or it would stay.
        old.sweep(now);
        let moved = migrate_dialogs(&old, &core, &old_names, &new_names, now);
        // The counters carry over: a dialog the new table had no room for is closed there.
        for &m in &moved.refused_open {
            core.close(m);
        }
        let superseded = shared.install(Install {
            core: Arc::clone(&core),
            max_clients: v.max_sessions,
            idle: v.idle_timeout,
            tls: Install::member_tls(config, v),
        });
        // Held here only: the link set the workers read before the switch.
        if !wait_for_readers(&superseded, 1, HANDOVER_LIMIT) {
            tracing::warn!(vserver = %v.name, "a worker kept the old core past the hand-over limit");
        }
        drop(superseded);
        // The shared counters already follow what the old core did meanwhile (pins, ends,
        // moves); what must stop counting is a pin the new table had no room for, and the old
        // core's pin of a dialog the new core pinned again (its next request came first).
        let late = catch_up_dialogs(&old, &core, &moved, &old_names, &new_names, cx.now());
        for &m in late.refused_open.iter().chain(&late.doubled) {
            core.close(m);
        }
        let kept = late.kept(&moved);
        let r = Rebuilt {
            dialogs_kept: kept,
            ..rebuilt(&old_names, &balancer, &added)
        };
        Ok(Rebuild {
            rebuilt: r,
            balancer,
            data: Arc::new(SipStreamPath { core, shared }),
        })
    }

    fn fits(&self, p: Protocol) -> bool {
        p.is_sip_stream()
    }

    fn kind(&self) -> &'static str {
        "sip-tcp or sip-tls"
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Start a sip-tcp vserver on the runtime's tokio runtime.
pub(crate) fn start(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
) -> Result<VserverHandle, RuntimeError> {
    let (listeners, bound) = bind_tcp(ctx, v)?;
    let member_addrs = config.member_addrs(v);
    let transport = match v.protocol {
        Protocol::SipTls => Transport::Tls,
        _ => Transport::Tcp,
    };
    let local = local_identity(v, &bound, &member_addrs, transport)?;
    let tls = crate::proxy::context::tls_listener(v)?;
    // The transports bridge: the other stream transport shares the vserver's address (its
    // links connect out); sip-udp members get a UDP leg of their own.
    let mut legs = vec![local.with_transport(match transport {
        Transport::Tls => Transport::Tcp,
        _ => Transport::Tls,
    })];
    let udp_members: Vec<SocketAddr> = v
        .members()
        .filter_map(|i| config.services.get(i))
        .filter(|s| s.protocol == Protocol::SipUdp)
        .map(|s| s.address)
        .collect();
    let udp = if udp_members.is_empty() {
        None
    } else {
        let (sock, leg) = bind_udp_leg(ctx, v, &bound, &udp_members)?;
        tracing::info!(vserver = %v.name, udp_leg = ?sock.local_addr().ok(), "UDP leg toward sip-udp services bound");
        legs.push(leg);
        Some(sock)
    };
    let balancer = Arc::new(crate::balancer::Balancer::new(config, v));
    let core = Arc::new(
        SipCore::new(SipParams::of(config, v, local, Arc::clone(&balancer)).with_legs(legs))
            .with_edge(v.edge(None)),
    );
    let shared = launch(
        ctx,
        config,
        v,
        Arc::clone(&core),
        Shells {
            max_clients: v.max_sessions,
            tasks: format!("sip-tcp vserver `{}`", v.name),
            tls: tls.clone(),
            udp,
            front: None,
        },
    );
    ctx.tokio.spawn(run_vserver(
        Arc::clone(&shared),
        listeners,
        ctx.shutdown.signal(),
        shared.tasks.guard(),
    ));
    tracing::info!(vserver = %v.name, bind = ?bound, method = v.method.name(), protocol = v.protocol.name(), "SIP stream vserver started");
    Ok(VserverHandle::new(
        v.name.clone(),
        v.protocol,
        bound,
        balancer,
        Arc::new(SipStreamPath { core, shared }),
    )
    .with_tls(tls))
}

/// What differs between a stream vserver's shared state and a sip-udp vserver's bridge.
struct Shells {
    max_clients: usize,
    /// The name of the shutdown's task group.
    tasks: String,
    tls: Option<Arc<crate::tls::TlsListener>>,
    udp: Option<Arc<tokio::net::UdpSocket>>,
    front: Option<std::net::UdpSocket>,
}

/// The shared state over `core`, with every member of `v` given its link (and connection
/// task) as a reload's added member would be.
fn launch(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
    core: Arc<SipCore>,
    sh: Shells,
) -> Arc<SipStreamShared> {
    let empty = Generation {
        core: Arc::clone(&core),
        links: Vec::new(),
        max_clients: sh.max_clients,
        idle: v.idle_timeout,
    };
    let shared = Arc::new(SipStreamShared {
        name: v.name.clone(),
        current: ArcSwap::from_pointee(empty),
        counters: SipStreamCounters::default(),
        clients: DashMap::new(),
        by_remote: DashMap::new(),
        draining: DashMap::new(),
        next_conn: AtomicU64::new(1),
        epoch: ctx.epoch,
        tasks: ctx.shutdown.group(sh.tasks),
        link_tasks: std::sync::Mutex::new(Vec::new()),
        log: LogLimiter::default(),
        tokio: ctx.tokio.clone(),
        tls: sh.tls,
        udp: sh.udp,
        front: sh.front,
    });
    shared.install(Install {
        core,
        max_clients: sh.max_clients,
        idle: v.idle_timeout,
        tls: Install::member_tls(config, v),
    });
    shared
}

/// The links of sip-udp vserver `v`'s sip-tcp / sip-tls members (the transports bridge the
/// other way, docs/sip.md): the same links as a stream vserver's, with no listener and no
/// client connection. `core` is the vserver's (its legs name the stream transports); what
/// the links read is handled by the current core as the member's, and what goes to a client
/// leaves from `front`, one of the vserver's UDP sockets. The vserver's workers hand their
/// stream members' traffic to [`SipStreamShared::carry_datagram`]; a reload installs its core here
/// too ([`SipStreamShared::install`]).
pub(crate) fn start_bridge(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
    core: &Arc<SipCore>,
    front: std::net::UdpSocket,
) -> Arc<SipStreamShared> {
    let shared = launch(
        ctx,
        config,
        v,
        Arc::clone(core),
        Shells {
            max_clients: 0,
            tasks: format!("sip-udp vserver `{}` (stream services)", v.name),
            tls: None,
            udp: None,
            front: Some(front),
        },
    );
    // No listener: the task sweeps dialogs (the vserver's sweeper thread is not started)
    // and ends the links at the shutdown.
    ctx.tokio.spawn(run_vserver(
        Arc::clone(&shared),
        Vec::new(),
        ctx.shutdown.signal(),
        shared.tasks.guard(),
    ));
    shared
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
    use std::sync::Arc;

    /// A TLS server stream and its client over an in-memory pipe of `pipe` bytes.
    async fn tls_pair(
        pipe: usize,
    ) -> (
        tokio_rustls::server::TlsStream<tokio::io::DuplexStream>,
        tokio_rustls::client::TlsStream<tokio::io::DuplexStream>,
    ) {
        let ck = rcgen::generate_simple_self_signed(vec!["t.test".to_owned()]).expect("rcgen");
        let der: CertificateDer<'static> = ck.cert.der().clone();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], key)
            .expect("server config");
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).expect("root");
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let (a, b) = tokio::io::duplex(pipe);
        let name = ServerName::try_from("t.test").expect("name");
        let (s, c) = tokio::join!(
            tokio_rustls::TlsAcceptor::from(Arc::new(server)).accept(a),
            tokio_rustls::TlsConnector::from(Arc::new(client)).connect(name, b),
        );
        (s.expect("accept"), c.expect("connect"))
    }

    /// A TLS stream keeps what the socket did not take in its own buffer until flushed: a
    /// message written while the socket is full must still go out when nothing follows it.
    #[tokio::test]
    async fn a_message_written_over_tls_goes_out_whole_when_nothing_follows() {
        let (server, mut client) = tls_pair(512).await;
        let (_read, write) = tokio::io::split(server);
        let (outbox, rx) = Outbox::new();
        let level = outbox.level();
        let writer = tokio::spawn(write_messages(write, rx, Arc::clone(&level)));
        let msg = vec![b'x'; 16 * 1024];
        assert_eq!(outbox.push(Bytes::from(msg.clone())), Push::Queued);
        let mut got = vec![0u8; msg.len()];
        let read = tokio::time::timeout(Duration::from_secs(5), client.read_exact(&mut got)).await;
        assert!(
            matches!(read, Ok(Ok(_))),
            "the whole message arrived while the queue stays open: {read:?}"
        );
        assert_eq!(got, msg);
        drop(outbox);
        assert_eq!(writer.await.expect("writer"), WriterEnd::Done);
        assert_eq!(level.queued(), 0, "what was written no longer counts");
    }

    /// A client that reads nothing: the writer gives up after [`CLIENT_SEND_TIMEOUT`] without
    /// progress, and what it could not write still counts in the queue.
    #[tokio::test(start_paused = true)]
    async fn a_writer_gives_up_on_a_client_that_reads_nothing() {
        let (server, _client) = tokio::io::duplex(1024);
        let (outbox, rx) = Outbox::new();
        let level = outbox.level();
        let started = tokio::time::Instant::now();
        let writer = tokio::spawn(write_messages(server, rx, Arc::clone(&level)));
        assert_eq!(outbox.push(Bytes::from(vec![b'x'; 4096])), Push::Queued);
        assert_eq!(writer.await.expect("writer"), WriterEnd::Stalled);
        assert_eq!(started.elapsed(), CLIENT_SEND_TIMEOUT);
        assert_eq!(level.queued(), outbox::cost(&[0; 4096]));
    }

    /// Over TLS too, a client that reads nothing is given up on after [`CLIENT_SEND_TIMEOUT`]
    /// (what the TLS stream took in its buffer does not count as progress).
    #[tokio::test(start_paused = true)]
    async fn a_writer_gives_up_on_a_tls_client_that_reads_nothing() {
        let (server, _client) = tls_pair(1024).await;
        let (_read, write) = tokio::io::split(server);
        let (outbox, rx) = Outbox::new();
        let level = outbox.level();
        let started = tokio::time::Instant::now();
        let writer = tokio::spawn(write_messages(write, rx, Arc::clone(&level)));
        assert_eq!(
            outbox.push(Bytes::from(vec![b'x'; 128 * 1024])),
            Push::Queued
        );
        assert_eq!(writer.await.expect("writer"), WriterEnd::Stalled);
        assert_eq!(started.elapsed(), CLIENT_SEND_TIMEOUT);
    }

    /// A client that reads slowly but keeps reading is waited for, however long the whole
    /// message takes: here 64 KiB through a 1 KiB pipe read 1 KiB every 5 s (5 min 20 s).
    #[tokio::test(start_paused = true)]
    async fn a_writer_waits_for_a_client_that_reads_slowly() {
        let (server, mut client) = tokio::io::duplex(1024);
        let (outbox, rx) = Outbox::new();
        let level = outbox.level();
        let writer = tokio::spawn(write_messages(server, rx, Arc::clone(&level)));
        let len = 64 * 1024;
        assert_eq!(outbox.push(Bytes::from(vec![b'x'; len])), Push::Queued);
        let mut got = 0;
        let mut chunk = [0u8; 1024];
        while got < len {
            tokio::time::sleep(CLIENT_SEND_TIMEOUT / 2).await;
            got += client.read(&mut chunk).await.expect("read");
        }
        drop(outbox);
        assert_eq!(writer.await.expect("writer"), WriterEnd::Done);
        assert_eq!(level.queued(), 0);
    }

    /// The same over TLS: what the TLS stream holds once all is written (up to its 64 KiB
    /// buffer) goes out in the flush, which takes as long as the client takes to read it; a
    /// client that keeps reading (one 16 KiB record every 5 s, so about 20 s for the flush)
    /// is waited for as well.
    #[tokio::test(start_paused = true)]
    async fn a_writer_waits_for_a_tls_client_that_reads_slowly() {
        let (server, mut client) = tls_pair(1024).await;
        let (_read, write) = tokio::io::split(server);
        let (outbox, rx) = Outbox::new();
        let level = outbox.level();
        let writer = tokio::spawn(write_messages(write, rx, Arc::clone(&level)));
        let msg: Vec<u8> = (0..128 * 1024).map(|i| (i % 251) as u8).collect();
        assert_eq!(outbox.push(Bytes::from(msg.clone())), Push::Queued);
        let mut got = Vec::with_capacity(msg.len());
        let mut chunk = vec![0u8; 16 * 1024];
        while got.len() < msg.len() {
            tokio::time::sleep(CLIENT_SEND_TIMEOUT / 2).await;
            let read = tokio::time::timeout(CLIENT_SEND_TIMEOUT * 3, client.read(&mut chunk)).await;
            let n = match read {
                Ok(Ok(n)) if n > 0 => n,
                other => panic!("no more after {} bytes ({other:?})", got.len()),
            };
            got.extend_from_slice(&chunk[..n]);
        }
        assert!(got == msg, "the message arrived intact");
        drop(outbox);
        assert_eq!(writer.await.expect("writer"), WriterEnd::Done);
        assert_eq!(level.queued(), 0);
    }
}
