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
//! (connection task) of each of its members, swapped whole by [`SipStreamShared::install`];
//! the reload then waits for the messages begun with the old one ([`crate::proxy::handover`]). A
//! reload keeps the client connections and the links of members that stay (same service
//! name and address); members it adds get a new link, which connects on their first
//! request. The link of a member it removes is retired: requests still queued for it are
//! chosen again by the current core, no new request is written to it, and its connection
//! stays open for [`link::RETIRED_DRAIN`] (responses to requests already written, the service's
//! in-dialog requests and the clients' responses to them) unless the service closes it
//! first.

use crate::balancer::{Balancer, Health};
use crate::capture::{CallId, CallIdBuf};
use crate::config::{Config, Protocol, Vserver};
use crate::core::sip::{Action, Origin, SipCore, SipParams};
use crate::dialog::Change;
use crate::eject::{Cause, Failure};
use crate::proxy::context::{
    DataPath, Prepared, Rebuild, RuntimeError, StartCtx, VserverHandle, bind_tcp, local_identity,
};
use crate::proxy::context::{POLL, Rebuilt, elapsed_nanos};
use crate::proxy::handover::Readers;
use crate::proxy::reconfig::{
    begin_handover, catch_up_dialogs, end_handover, migrate_dialogs, names_of, rebuilt, settle,
    sip_core,
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
mod client;
mod dispatch;
mod links;
mod outbox;
mod reader;
mod stream;
mod udp_leg;
mod ws;

use client::*;
use dispatch::*;
use links::*;
use reader::*;
use stream::*;
use udp_leg::*;

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

/// A message on its way to a connection (a client's write queue, a service link's), with
/// its Call-ID for the capture of its write (docs/capture.md) when the data path that queued
/// it knew it, so that the tap at the write does not search it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Outgoing {
    pub(crate) bytes: Bytes,
    pub(crate) call_id: CallIdBuf,
}

impl Outgoing {
    pub(crate) fn new(bytes: Bytes, call_id: CallIdBuf) -> Outgoing {
        Outgoing { bytes, call_id }
    }
}

/// A message whose Call-ID is found at its write, if it has one (a pong has none).
impl From<Bytes> for Outgoing {
    fn from(bytes: Bytes) -> Outgoing {
        Outgoing::new(bytes, CallIdBuf::Find)
    }
}

impl std::ops::Deref for Outgoing {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}
/// Counters specific to the stream transport.
#[derive(Debug, Default)]
pub struct SipStreamCounters {
    pub clients_accepted: AtomicU64,
    pub clients_refused: AtomicU64,
    /// Idle clients closed to make room while the open-file pool ran low.
    pub clients_evicted: AtomicU64,
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
    /// Writes toward a service that made no progress for its `write_timeout` (it stopped
    /// reading): the connection ended, its requests chosen again.
    pub service_writes_stalled: AtomicU64,
    /// Events a service link's machine did not wait for in its phase (a shell bug: counted
    /// rather than swallowed).
    pub link_unexpected_events: AtomicU64,
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
    /// WebSocket upgrades refused (no `sip` subprotocol, an Origin not allowed, no upgrade
    /// in time).
    pub websocket_refused: AtomicU64,
}

impl SipStreamCounters {
    /// Each counter by its event name, in the order metrics lists them.
    pub fn events(&self) -> [(&'static str, &AtomicU64); 20] {
        [
            ("clients_accepted", &self.clients_accepted),
            ("clients_refused", &self.clients_refused),
            ("clients_evicted", &self.clients_evicted),
            ("slow_clients_closed", &self.slow_clients_closed),
            ("client_reads_paused", &self.client_reads_paused),
            ("framing_errors", &self.framing_errors),
            ("keepalive_pings", &self.keepalive_pings),
            ("responses_no_client", &self.responses_no_client),
            ("in_dialog_no_client", &self.in_dialog_no_client),
            ("service_connect_failures", &self.service_connect_failures),
            ("service_connections_lost", &self.service_connections_lost),
            ("service_writes_stalled", &self.service_writes_stalled),
            ("link_unexpected_events", &self.link_unexpected_events),
            ("service_queue_full", &self.service_queue_full),
            ("requests_rerouted", &self.requests_rerouted),
            ("requests_lost", &self.requests_lost),
            ("services_retired", &self.services_retired),
            ("udp_leg_strangers", &self.udp_leg_strangers),
            ("udp_leg_send_errors", &self.udp_leg_send_errors),
            ("websocket_refused", &self.websocket_refused),
        ]
    }
}

/// A task that ends with its owner: a client's writer is owned by the client's reading task,
/// so aborting that task (a client that does not read) takes the writer, the socket, the
/// queue and the place in `max_sessions` with it.
struct AbortOnDrop<T = ()>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
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
    draining: DashMap<SocketAddr, mpsc::Sender<Outgoing>>,
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
    /// answered over UDP from these sockets (clones of the vserver's own, blocking: sent to
    /// without waiting), not over client connections; its sip-udp members are reached from
    /// its `service_source` socket when it has one.
    front: Option<crate::proxy::sip_front::Senders>,
    /// Client connections' admission: one open file each from the process's pool, and at
    /// most `max_per_source` from one source (docs/limits.md).
    pub gate: crate::budget::Gate,
    /// Every vserver's evictable client connections, where a new client makes room while
    /// the file pool runs low.
    evictors: Arc<crate::proxy::evict::Evictors>,
    /// Every task that handles a message with the current generation marks it here, so a
    /// reload knows when none still uses the old one ([`crate::proxy::handover`]). A sip-udp
    /// vserver's bridge shares its workers'.
    readers: Arc<Readers>,
    /// A WebSocket vserver's upgrade settings (`None`: SIP straight on the stream).
    ws: Option<ws::WsSettings>,
    /// Every message read from or written to a client connection or a service link is
    /// captured here (docs/capture.md).
    tap: crate::capture::Tap,
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
    /// Per member (same index): its service's `write_timeout`.
    pub write_timeouts: Vec<Duration>,
}

impl Install {
    /// The `write_timeout` of each member of `v`'s service ([`Install::write_timeouts`]).
    pub(crate) fn member_write_timeouts(config: &Config, v: &Vserver) -> Vec<Duration> {
        v.members()
            .map(|i| {
                config
                    .services
                    .get(i)
                    .map_or(crate::core::link::WRITE_TIMEOUT, |s| s.write_timeout)
            })
            .collect()
    }

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
    /// the generation `next` replaced; no task still handles a message with it once
    /// the vserver's readers have been waited for ([`Readers::wait`]).
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
                let write_timeout = next
                    .write_timeouts
                    .get(m)
                    .copied()
                    .unwrap_or(crate::core::link::WRITE_TIMEOUT);
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
                        l.set_write_timeout(write_timeout);
                        Arc::clone(l)
                    }
                    (None, tls) => {
                        // The same service reached anew (another address): its handshakes
                        // count on.
                        let was = old.links.iter().find(|l| l.name == *name);
                        let was = was.and_then(|l| l.tls.as_deref());
                        let tls = tls.map(|t| crate::tls::TlsConnector::carrying(t, was));
                        let (link, rx) = ServiceLink::new(name, addr, tls, udp);
                        link.set_write_timeout(write_timeout);
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
    let sweeper = shared.readers.register();
    let sweep = async {
        let mut last = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(POLL).await;
            let _in = sweeper.enter();
            let core = shared.core();
            if last.elapsed() >= core.sweep_interval() {
                core.sweep(shared.now());
                last = tokio::time::Instant::now();
            }
        }
    };
    // Held requests' deadlines (retransmissions toward sip-udp members, no_answer, Timer C,
    // the end of lingering), in whatever core is current; a sip-udp vserver with stream
    // members has its held requests woken here (its own timer thread is not started).
    let timers = shared.readers.register();
    let held = async {
        let mut sends = Vec::new();
        loop {
            let next = {
                let _in = timers.enter();
                let g = shared.current.load();
                let next = g.core.poll_transactions(shared.now(), &mut sends);
                // No message was handled: each one's Call-ID is found at its write.
                shared.carry_sends(&g, std::mem::take(&mut sends), &CallIdBuf::Find);
                next
            };
            let wait = next.map_or(POLL, |t| {
                Duration::from_nanos(t.saturating_sub(shared.now()))
                    .clamp(Duration::from_millis(5), POLL)
            });
            tokio::time::sleep(wait).await;
        }
    };
    tokio::select! {
        () = signal.recv() => {}
        () = sweep => {}
        () = held => {}
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

    fn gate(&self) -> Option<&crate::budget::Gate> {
        Some(&self.shared.gate)
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
    /// module doc); the new core is built aside and installed with the dialogs migrated.
    fn prepare(&self, config: &Config, v: &Vserver) -> Result<Prepared, RuntimeError> {
        let shared = Arc::clone(&self.shared);
        // The UDP leg toward sip-udp services is bound at start (its address is in the
        // Record-Route of the dialogs it carries); a reload cannot add one.
        let wants_udp = v.forwards_to(config, |p| p == Protocol::SipUdp);
        if wants_udp && !shared.has_udp_leg() {
            return Err(RuntimeError::Setup {
                vserver: v.name.clone(),
                problem:
                    "its first sip-udp service needs a restart (the UDP leg is bound at start)"
                        .to_owned(),
            });
        }
        let old = shared.core();
        // Surviving members share their counters with the old balancer, so the dialogs
        // they carry are already counted there.
        let balancer = Arc::new(Balancer::carrying(config, v, old.balancer()));
        let core = Arc::new(sip_core(config, v, &old, &balancer));
        let generation = Install {
            core: Arc::clone(&core),
            max_clients: v.max_sessions,
            idle: v.idle_timeout,
            tls: Install::member_tls(config, v),
            write_timeouts: Install::member_write_timeouts(config, v),
        };
        let max_per_source = v.max_per_source;
        Ok(Prepared::new(move |cx| {
            let now = cx.now();
            let old_names = names_of(old.balancer());
            let added = settle(&balancer, &old_names, cx.health_of, now);
            let new_names = names_of(&balancer);
            // Expired dialogs are not migrated: close their count first, or it would stay.
            old.sweep(now);
            let moved = migrate_dialogs(&old, &core, &old_names, &new_names, now);
            // The counters carry over: a dialog the new table had no room for is closed there.
            for &(m, count) in &moved.refused_counted {
                core.tally(Change::Close(m, count));
            }
            shared.gate.set_max_per_source(max_per_source);
            // Surviving members' counters are shared: what the new core takes from the old
            // one on demand is counted already.
            begin_handover(&old, &core, &moved, &old_names, &new_names, false);
            shared.install(generation);
            // Until every task that began a message with the old generation has finished it.
            shared.readers.wait();
            // The shared counters already follow what the old core did meanwhile (pins, ends,
            // moves); what must stop counting is a pin the new table had no room for, and the
            // old core's pin of a dialog the new core pinned again (its next request came
            // first).
            let late = catch_up_dialogs(&old, &core, &moved, &old_names, &new_names, cx.now());
            for &(m, count) in late.refused_counted.iter().chain(&late.doubled) {
                core.tally(Change::Close(m, count));
            }
            for &c in &late.pushed_out {
                core.tally(c);
            }
            end_handover(&core);
            let r = Rebuilt {
                dialogs_kept: late.kept(&moved),
                ..rebuilt(&old_names, &balancer, &added)
            };
            Rebuild {
                rebuilt: r,
                balancer,
                data: Arc::new(SipStreamPath { core, shared }),
            }
        }))
    }

    fn protocols(&self) -> &'static [Protocol] {
        &[
            Protocol::SipTcp,
            Protocol::SipTls,
            Protocol::SipWs,
            Protocol::SipWss,
        ]
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
        Protocol::SipWs => Transport::Ws,
        Protocol::SipWss => Transport::Wss,
        _ => Transport::Tcp,
    };
    let local = local_identity(v, &bound, &member_addrs, transport)?;
    let tls = crate::proxy::context::tls_listener(v)?;
    // The transports bridge: the other stream transports share the vserver's address (their
    // links connect out); sip-udp members get a UDP leg of their own. A WebSocket vserver has
    // no service of its own transport: every service is on another leg.
    let mut legs: Vec<Local> = match transport {
        Transport::Tls => vec![local.with_transport(Transport::Tcp)],
        Transport::Ws | Transport::Wss => vec![
            local.with_transport(Transport::Tcp),
            local.with_transport(Transport::Tls),
        ],
        _ => vec![local.with_transport(Transport::Tls)],
    };
    let udp_members: Vec<SocketAddr> = v
        .members()
        .filter_map(|i| config.services.get(i))
        .filter(|s| s.protocol == Protocol::SipUdp)
        .map(|s| s.address)
        .collect();
    let udp = if !v.forwards_to(config, |p| p == Protocol::SipUdp) {
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
            .with_edge(v.edge(None))
            .with_flows(crate::proxy::flows::keys_for(config), v.path)
            .with_failover(v.failover.clone(), Arc::default()),
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
            readers: Arc::default(),
            ws: v.protocol.is_websocket().then(|| ws::WsSettings {
                allowed_origins: v.allowed_origins.clone(),
            }),
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
    front: Option<crate::proxy::sip_front::Senders>,
    readers: Arc<Readers>,
    /// A WebSocket vserver's upgrade settings.
    ws: Option<ws::WsSettings>,
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
        gate: crate::budget::Gate::new(Arc::clone(ctx.budget), 1, v.max_per_source),
        evictors: Arc::clone(ctx.evictors),
        readers: sh.readers,
        ws: sh.ws,
        tap: crate::capture::Tap::new(ctx.capture, &v.name),
    });
    // Its idle clients may make room for any vserver's new connection.
    let idle: Arc<dyn crate::proxy::evict::IdleClients> = shared.clone();
    ctx.evictors.add(Arc::downgrade(&idle));
    shared.install(Install {
        core,
        max_clients: sh.max_clients,
        idle: v.idle_timeout,
        tls: Install::member_tls(config, v),
        write_timeouts: Install::member_write_timeouts(config, v),
    });
    shared
}

/// The links of sip-udp vserver `v`'s sip-tcp / sip-tls members (the transports bridge the
/// other way, docs/sip.md): the same links as a stream vserver's, with no listener and no
/// client connection. `core` is the vserver's (its legs name the stream transports); what
/// the links read is handled by the current core as the member's, and what goes to a client
/// leaves from `front`'s client socket, one of the vserver's (to a sip-udp member, from its
/// service socket); held requests are woken here. The vserver's workers hand their
/// stream members' traffic to [`SipStreamShared::carry_datagram`]; a reload installs its core here
/// too ([`SipStreamShared::install`]). The links' tasks mark their messages on `readers`,
/// the vserver's workers' own, so one hand-over covers both.
pub(crate) fn start_bridge(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
    core: &Arc<SipCore>,
    front: crate::proxy::sip_front::Senders,
    readers: &Arc<Readers>,
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
            readers: Arc::clone(readers),
            ws: None,
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
