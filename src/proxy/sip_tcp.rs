//! The `sip-tcp` vserver's IO shell (tokio): SIP over TCP with Content-Length framing,
//! per-message routing by the shared [`SipCore`], pooled long-lived connections to services,
//! and responses returned on the client connection the request came from.
//!
//! - Client connections get an id that fulcrum writes into its Via (`;fc-conn=<hex>`), so a
//!   response finds its connection without a transaction table.
//! - One connection per service, owned by a task that connects on demand with backoff; a
//!   failed connect marks the service DOWN (passive detection) and a later successful one
//!   marks it UP again.
//! - Each client has a bounded write queue: a client that does not read is disconnected,
//!   and nobody else waits for it.
//! - Requests from a service toward a client (in-dialog) go to a live connection from the
//!   client's address (RFC 5923-style alias); with none, they are dropped and counted,
//!   never relayed elsewhere.
//!
//! # Reload
//! Every message is decided and carried out with one [`Generation`]: the core and the link
//! (connection task) of each of its members, swapped whole by [`TcpShared::install`]. A
//! reload keeps the client connections and the links of members that stay (same service
//! name and address); members it adds get a new link, which connects on their first
//! request. The link of a member it removes is retired: requests still queued for it are
//! chosen again by the current core, no new request is written to it, and its connection
//! stays open for [`RETIRED_DRAIN`] (responses to requests already written, the service's
//! in-dialog requests and the clients' responses to them) unless the service closes it
//! first.

use crate::balancer::Health;
use crate::config::{Config, Vserver};
use crate::proxy::runtime::{
    DataPath, RuntimeError, StartCtx, VserverHandle, bind_tcp, local_identity,
};
use crate::proxy::shutdown::{Signal, TaskGroup, TaskGuard};
use crate::proxy::sip_core::{Action, Origin, SipCore, SipParams};
use crate::proxy::{LogLimiter, POLL, bump, elapsed_nanos};
use crate::sip::framing::{DEFAULT_MAX_MESSAGE, PONG};
use crate::sip::{Frame, FrameError, Transport, next_frame, scan};
use arc_swap::ArcSwap;
use bytes::{Buf, Bytes, BytesMut};
use dashmap::DashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc};

/// Messages queued toward one client before it counts as not reading.
pub(crate) const CLIENT_QUEUE: usize = 1024;
/// Messages queued toward one service while its connection is (re)established.
pub(crate) const SERVICE_QUEUE: usize = 8192;
/// Connect timeout toward a service.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// First and last reconnect delay toward a service.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How long the connection of a member removed by a reload stays open for what the service
/// still sends: 64·T1, the non-INVITE transaction timeout (RFC 3261 §17.1.2.2, Timer F).
pub(crate) const RETIRED_DRAIN: Duration = Duration::from_secs(32);
/// Longest message a service may send: twice a client's, since a response repeats the
/// request's Vias and adds fulcrum's, and one client's large request must not cut the
/// connection every client shares.
pub(crate) const SERVICE_MAX_MESSAGE: usize = 2 * DEFAULT_MAX_MESSAGE;
/// How long a started message may take to arrive whole (however slowly its bytes come): a
/// client cannot hold a partial message's buffer for longer.
pub(crate) const MESSAGE_DEADLINE: Duration = Duration::from_secs(10);
/// How long what is queued toward a client that has stopped sending may take to be written.
pub(crate) const CLIENT_FLUSH: Duration = Duration::from_secs(10);
/// A service connection that ends this soon after it was made counts as a failed connect
/// (a service that accepts and closes must not swallow requests while staying UP).
const SHORT_LIVED: Duration = Duration::from_secs(1);
/// Requests written on a service connection that has not answered yet, kept to be chosen
/// again should it close first.
const UNANSWERED_KEPT: usize = 256;
/// TCP keepalive on service connections (which have no idle timeout): a peer that vanished
/// is found within a few minutes.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

/// Counters specific to the stream transport.
#[derive(Debug, Default)]
pub struct TcpCounters {
    pub clients_accepted: AtomicU64,
    pub clients_refused: AtomicU64,
    pub clients_open: AtomicU64,
    pub slow_clients_closed: AtomicU64,
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
}

struct Client {
    tx: mpsc::Sender<Bytes>,
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
    tx: mpsc::Sender<Bytes>,
    retired: AtomicBool,
    retire: Notify,
}

impl ServiceLink {
    fn new(name: &str, addr: SocketAddr) -> (Arc<ServiceLink>, mpsc::Receiver<Bytes>) {
        let (tx, rx) = mpsc::channel(SERVICE_QUEUE);
        let link = ServiceLink {
            name: name.to_owned(),
            addr,
            tx,
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
pub struct TcpShared {
    name: String,
    current: ArcSwap<Generation>,
    pub counters: TcpCounters,
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
}

impl std::fmt::Debug for TcpShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpShared")
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
}

impl TcpShared {
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
                old.links
                    .iter()
                    .find(|l| l.name == *name && l.addr == addr)
                    .cloned()
                    .unwrap_or_else(|| {
                        let (link, rx) = ServiceLink::new(name, addr);
                        fresh.push((Arc::clone(&link), rx));
                        link
                    })
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

    /// Queue `bytes` toward client `id`; a full queue disconnects that client only.
    fn to_client(&self, id: u64, bytes: Bytes) -> bool {
        let Some(c) = self.clients.get(&id) else {
            return false;
        };
        match c.tx.try_send(bytes) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                let (abort, remote) = (c.abort.clone(), c.remote);
                drop(c);
                // Counted once, by whoever removes it (two messages may find it full at once).
                if self.forget_client(id, remote) {
                    bump(&self.counters.slow_clients_closed);
                    tracing::info!(vserver = %self.name, %remote, "client does not read: disconnected");
                    abort.abort();
                }
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
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
        let failed = g.index_of(link);
        let sent = match g.core.rechoose(&bytes, link.addr, self.now()) {
            Some(m) if Some(m) != failed => g
                .links
                .get(m)
                .is_some_and(|l| l.tx.try_send(bytes.clone()).is_ok()),
            _ => false,
        };
        if sent {
            bump(&self.counters.requests_rerouted);
            return;
        }
        bump(&self.counters.requests_lost);
        self.answer_unavailable(&g, &bytes);
    }

    /// Answer a forwarded request no service took with fulcrum's 503 on its client's
    /// connection (nothing for ACK, see `SipCore::unavailable`).
    fn answer_unavailable(&self, g: &Generation, forwarded: &[u8]) {
        let mut out = Vec::new();
        if let Action::ToConn(id) = g.core.unavailable(forwarded, &mut out) {
            self.to_client(id, Bytes::from(out));
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
        reply: &mpsc::Sender<Bytes>,
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
                if let Some(m) = g.core.member_of(addr) {
                    // A client's response to a service's in-dialog request.
                    self.to_service(g, m, bytes());
                } else if let Some(tx) = self.draining_tx(addr) {
                    // The same, toward a service a reload removed (its connection drains).
                    let _ = tx.try_send(bytes());
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
                let _ = reply.try_send(bytes());
            }
            Action::Drop(reason) => {
                if self.log.allow(self.now()) {
                    tracing::debug!(vserver = %self.name, ?reason, "message dropped");
                }
            }
        }
    }
}

thread_local! {
    /// Where a message is rewritten before it is copied into its queue: one per thread.
    static OUT: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(Vec::with_capacity(4096));
}

/// Read framed SIP messages from `read`, hand each to the current core, until EOF, error,
/// idle timeout (clients only: a service connection stays while the service keeps it), a
/// message that takes longer than [`MESSAGE_DEADLINE`] to arrive, or a framing error.
/// `reply` carries pongs and fulcrum's own replies.
async fn read_messages(
    shared: &TcpShared,
    mut read: tokio::net::tcp::OwnedReadHalf,
    origin: Origin,
    src: SocketAddr,
    dst: SocketAddr,
    reply: &mpsc::Sender<Bytes>,
    heard: Option<&AtomicBool>,
) {
    let (max_message, is_client) = match origin {
        Origin::Member(_) => (SERVICE_MAX_MESSAGE, false),
        Origin::Client { .. } => (DEFAULT_MAX_MESSAGE, true),
    };
    // The connection's own buffer holds bytes only while a message is incomplete: an idle
    // connection (a registered phone between requests) holds none. Rewritten messages are
    // built in a per-thread buffer and copied out.
    let mut buf = BytesMut::new();
    // When the first bytes of the message now in `buf` arrived.
    let mut started: Option<tokio::time::Instant> = None;
    loop {
        // Frame everything already buffered (several messages may arrive in one read).
        loop {
            match next_frame(&buf, max_message) {
                Ok(frame) => {
                    let len = frame.len();
                    match frame {
                        Frame::Message { .. } => OUT.with_borrow_mut(|out| {
                            if let Some(h) = heard.filter(|h| !h.load(Ordering::Relaxed)) {
                                h.store(true, Ordering::Relaxed);
                            }
                            let now = shared.now();
                            let g = shared.current.load();
                            let action = g.core.handle(&buf[..len], origin, src, dst, now, out);
                            shared.dispatch(&g, action, out, origin, reply);
                        }),
                        Frame::Ping => {
                            bump(&shared.counters.keepalive_pings);
                            let _ = reply.try_send(Bytes::from_static(PONG));
                        }
                        Frame::Pong => {}
                    }
                    buf.advance(len.min(buf.len()));
                    // The deadline times the message now at the front, not the first one
                    // that was ever incomplete.
                    started = None;
                }
                Err(FrameError::Incomplete) => break,
                Err(e) => {
                    bump(&shared.counters.framing_errors);
                    if shared.log.allow(shared.now()) {
                        tracing::info!(vserver = %shared.name, %src, error = %e, "closing stream after framing error");
                    }
                    return;
                }
            }
        }
        if buf.is_empty() {
            // (`started` was reset by the frame that emptied it.)
            if buf.capacity() > 0 {
                buf = BytesMut::new();
            }
        } else {
            started.get_or_insert_with(tokio::time::Instant::now);
        }
        // Wait with no buffer; take one once bytes are there. A client waits at most its
        // idle timeout, and a partial message at most what is left of its deadline.
        let now = tokio::time::Instant::now();
        let mut until = is_client.then(|| now + shared.current.load().idle);
        if let Some(t) = started {
            let end = t + MESSAGE_DEADLINE;
            until = Some(until.map_or(end, |u| u.min(end)));
        }
        let ready = match until {
            Some(u) => tokio::time::timeout_at(u, read.readable()).await,
            None => Ok(read.readable().await),
        };
        match ready {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return,
            Err(_) => {
                if started.is_some_and(|t| t.elapsed() >= MESSAGE_DEADLINE) {
                    bump(&shared.counters.framing_errors);
                    if shared.log.allow(shared.now()) {
                        tracing::info!(vserver = %shared.name, %src, "closing stream: a message did not arrive whole in time");
                    }
                }
                return;
            }
        }
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(4096);
        }
        // One read attempt, never a wait with the buffer held: a readiness can be stale (a
        // fresh connection starts out readable), and then the attempt clears it and the loop
        // waits again without the buffer. A short read clears it too (the receive queue is
        // empty), so a burst costs one `recv`.
        let attempt = {
            let mut read_buf = std::pin::pin!(read.read_buf(&mut buf));
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

/// Write what is queued toward a client, everything already queued in one write (a client
/// that sends a burst gets its answers in a few system calls, not one per message).
async fn write_messages(mut write: tokio::net::tcp::OwnedWriteHalf, mut rx: mpsc::Receiver<Bytes>) {
    let mut batch = BytesMut::new();
    while let Some(b) = rx.recv().await {
        let result = match rx.try_recv() {
            // The common case: one message, written from where it is.
            Err(_) => write.write_all(&b).await,
            Ok(next) => {
                batch.clear();
                batch.extend_from_slice(&b);
                batch.extend_from_slice(&next);
                while batch.len() < WRITE_BATCH {
                    match rx.try_recv() {
                        Ok(more) => batch.extend_from_slice(&more),
                        Err(_) => break,
                    }
                }
                write.write_all(&batch).await
            }
        };
        if result.is_err() {
            return;
        }
        if batch.capacity() > WRITE_BATCH * 2 {
            batch = BytesMut::new();
        }
    }
    let _ = write.shutdown().await;
}

/// Read a client's messages until it is done, then give what is queued toward it a bounded
/// time to be written: a client that half-closed and does not read must not keep the socket.
async fn serve_client(
    shared: Arc<TcpShared>,
    stream: TcpStream,
    id: u64,
    src: SocketAddr,
    dst: SocketAddr,
    rx: mpsc::Receiver<Bytes>,
    tx: mpsc::Sender<Bytes>,
) {
    // TCP_NODELAY is inherited from the listener (`net::bind_tcp_listener`). The writer is a
    // task of its own, so a client's replies are written while its next requests are read.
    let (read, write) = stream.into_split();
    let mut writer = AbortOnDrop(tokio::spawn(write_messages(write, rx)));
    read_messages(
        &shared,
        read,
        Origin::Client { conn: Some(id) },
        src,
        dst,
        &tx,
        None,
    )
    .await;
    shared.forget_client(id, src);
    drop(tx);
    // Dropping `writer` afterwards ends it if it has not finished.
    let _ = tokio::time::timeout(CLIENT_FLUSH, &mut writer.0).await;
}

async fn accept_loop(shared: Arc<TcpShared>, listener: TcpListener) {
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
        let (tx, rx) = mpsc::channel(CLIENT_QUEUE);
        bump(&shared.counters.clients_accepted);
        shared.counters.clients_open.fetch_add(1, Ordering::Relaxed);
        // The task starts serving once its entry is in the tables: one that ended before
        // could not remove it, and the entry (and its count) would stay forever.
        let (registered, wait_registered) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn({
            let shared = Arc::clone(&shared);
            let tx = tx.clone();
            let guard = shared.tasks.guard();
            async move {
                let _guard = guard;
                if wait_registered.await.is_ok() {
                    serve_client(shared, stream, id, src, dst, rx, tx).await;
                }
            }
        });
        shared.clients.insert(
            id,
            Client {
                tx,
                remote: src,
                abort: task.abort_handle(),
            },
        );
        shared.by_remote.insert(src, id);
        let _ = registered.send(());
    }
}

/// Own the connection over `link`: connect on demand with backoff, write what is queued,
/// and read what the service sends (responses, in-dialog requests). The member's index,
/// health and failure reports are looked up in the current generation each time, so they
/// follow reloads; a retired link hands its queue back to the current core and drains.
async fn service_loop(
    shared: Arc<TcpShared>,
    link: Arc<ServiceLink>,
    mut rx: mpsc::Receiver<Bytes>,
) {
    let addr = link.addr;
    let mut backoff = BACKOFF_MIN;
    let mut pending: Option<Bytes> = None;
    // Set after a failed connect: keep probing (with backoff) until the service answers,
    // so a service marked DOWN by this path comes back without waiting for traffic.
    let mut down = false;
    'link: loop {
        if link.is_retired() {
            retire(&shared, &link, pending.take(), &mut rx);
            return;
        }
        if pending.is_none() && !down {
            // Connect only when there is something to send.
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(b) => pending = Some(b),
                    None => return,
                },
                () = link.retired() => continue,
            }
        }
        let attempt = tokio::select! {
            r = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)) => r,
            () = link.retired() => continue,
        };
        let stream = match attempt {
            Ok(Ok(s)) => s,
            _ => {
                connect_failed(
                    &shared,
                    &link,
                    &mut pending,
                    Vec::new(),
                    &mut rx,
                    &mut backoff,
                )
                .await;
                down = true;
                continue;
            }
        };
        let connected_at = tokio::time::Instant::now();
        // Kept until the connection proves itself (see SHORT_LIVED).
        let failed_backoff = backoff;
        backoff = BACKOFF_MIN;
        if let Err(e) = socket2::SockRef::from(&stream).set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_IDLE),
        ) && shared.log.allow(shared.now())
        {
            tracing::debug!(vserver = %shared.name, service = %addr, error = %e, "cannot set TCP keepalive");
        }
        let _ = stream.set_nodelay(true);
        let dst = stream.local_addr().unwrap_or(addr);
        let (read, mut write) = stream.into_split();
        // Replies fulcrum makes to a service's request go back on this connection.
        let (reply_tx, mut reply_rx) = mpsc::channel::<Bytes>(CLIENT_QUEUE);
        let drain_tx = reply_tx.clone();
        let reader_shared = Arc::clone(&shared);
        // The core reads a member origin only to tell a service from a client, so the index
        // at connect time serves for the life of the connection.
        let origin = Origin::Member(shared.current.load().index_of(&link).unwrap_or(0));
        // Set once the service has sent anything: until then the requests written on this
        // connection are kept, and handed to the next-ranked members if it closes first.
        let heard = Arc::new(AtomicBool::new(false));
        let reader_heard = Arc::clone(&heard);
        // Ends with this task too: a shutdown aborts the link's task, not its reader.
        let mut reader = AbortOnDrop(tokio::spawn(async move {
            read_messages(
                &reader_shared,
                read,
                origin,
                addr,
                dst,
                &reply_tx,
                Some(&reader_heard),
            )
            .await;
        }));
        let mut unanswered: Vec<Bytes> = Vec::new();
        // The connection ends when it fails (then reconnect) or when the link is retired,
        // between two messages or in the middle of a write. A request whose write fails or is
        // cut short is chosen again, never lost.
        let mut first = pending.take();
        // Made once per connection, not per message: polled until it fires.
        let proof = tokio::time::sleep_until(connected_at + SHORT_LIVED);
        tokio::pin!(proof);
        let mut proven = false;
        let cut = loop {
            let (wrote, request) = if let Some(b) = first.take() {
                (write_unless_retired(&mut write, &b, &link).await, Some(b))
            } else {
                tokio::select! {
                    msg = rx.recv() => match msg {
                        Some(b) => (write_unless_retired(&mut write, &b, &link).await, Some(b)),
                        None => {
                            reader.0.abort();
                            return;
                        }
                    },
                    Some(b) = reply_rx.recv() => (write_unless_retired(&mut write, &b, &link).await, None),
                    _ = &mut reader.0 => {
                        bump(&shared.counters.service_connections_lost);
                        (Wrote::Failed, None)
                    }
                    () = link.retired() => break None,
                    () = &mut proof, if !proven => {
                        proven = true;
                        if down {
                            down = false;
                            mark_up_again(&shared, &link);
                        }
                        (Wrote::Done, None)
                    }
                }
            };
            match wrote {
                Wrote::Done => {
                    if let Some(b) = request {
                        if heard.load(Ordering::Relaxed) {
                            unanswered = Vec::new();
                        } else if unanswered.len() < UNANSWERED_KEPT {
                            unanswered.push(b);
                        }
                    }
                }
                Wrote::Retired => {
                    // Closed without a drain: what the service never answered goes elsewhere.
                    if !heard.load(Ordering::Relaxed) {
                        for b in std::mem::take(&mut unanswered) {
                            shared.redispatch(&link, b);
                        }
                    }
                    break Some(request);
                }
                Wrote::Failed => {
                    reader.0.abort();
                    pending = request;
                    // Closed before answering anything: what it was given goes elsewhere.
                    let heard = heard.load(Ordering::Relaxed);
                    let unanswered = if heard {
                        Vec::new()
                    } else {
                        std::mem::take(&mut unanswered)
                    };
                    if !heard && connected_at.elapsed() < SHORT_LIVED {
                        // Closed at once and without a word: as good as refused (marked
                        // DOWN first, so that the choice for those requests passes it over).
                        // A service that answered, then closed, is only reconnected.
                        backoff = failed_backoff;
                        connect_failed(
                            &shared,
                            &link,
                            &mut pending,
                            unanswered,
                            &mut rx,
                            &mut backoff,
                        )
                        .await;
                        down = true;
                    } else {
                        for b in unanswered {
                            shared.redispatch(&link, b);
                        }
                    }
                    continue 'link;
                }
            }
        };
        // `Some(request)`: retired in the middle of writing `request`.
        let retired_mid_write = cut.is_some();
        retire(&shared, &link, cut.flatten(), &mut rx);
        if retired_mid_write {
            // The service stopped reading: the connection holds part of a message, so
            // nothing more can go on it; it is closed without a drain.
            reader.0.abort();
            return;
        }
        // What the service still sends (responses to requests already written, its
        // in-dialog requests) is relayed for a while, and clients' responses to those
        // requests reach it; nothing new is written to it.
        shared.draining.insert(addr, drain_tx.clone());
        let drain = async {
            loop {
                tokio::select! {
                    Some(b) = reply_rx.recv() => {
                        if write.write_all(&b).await.is_err() {
                            return;
                        }
                    }
                    _ = &mut reader.0 => return,
                }
            }
        };
        let _ = tokio::time::timeout(RETIRED_DRAIN, drain).await;
        shared
            .draining
            .remove_if(&addr, |_, tx| tx.same_channel(&drain_tx));
        reader.0.abort();
        let _ = write.shutdown().await;
        tracing::debug!(vserver = %shared.name, service = %addr, "connection of a removed service closed");
        return;
    }
}

/// A connect to `link`'s service failed (or the connection closed at once): count it, report
/// it to the service's monitor, mark the service DOWN (a member the operator took
/// OUT_OF_SERVICE stays so), hand `unanswered` (written on a connection that closed at once),
/// `pending` and the queue to the next-ranked members, and wait out the backoff (doubled for
/// next time).
async fn connect_failed(
    shared: &TcpShared,
    link: &ServiceLink,
    pending: &mut Option<Bytes>,
    unanswered: Vec<Bytes>,
    rx: &mut mpsc::Receiver<Bytes>,
    backoff: &mut Duration,
) {
    bump(&shared.counters.service_connect_failures);
    {
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
    // Requests written to or queued for the dead service go to the next-ranked member.
    for b in unanswered {
        shared.redispatch(link, b);
    }
    shared.redispatch_queued(link, pending.take(), rx);
    tokio::select! {
        () = tokio::time::sleep(*backoff) => {}
        () = link.retired() => {}
    }
    *backoff = (*backoff * 2).min(BACKOFF_MAX);
}

/// The service a failed connect marked DOWN has kept a connection for [`SHORT_LIVED`]: UP
/// again (unless something else, such as its monitor, has set it otherwise meanwhile).
fn mark_up_again(shared: &TcpShared, link: &ServiceLink) {
    let g = shared.current.load();
    if let Some(m) = g.index_of(link)
        && g.core.balancer().health(m) == Some(Health::Down)
    {
        g.core.balancer().set_health(m, Health::Up, shared.now());
        tracing::info!(vserver = %shared.name, service = %link.addr, "connected again: service marked UP");
    }
}

/// Hand a retired link's queue (and `pending`) back to the current core and count it;
/// late senders are refused first, so nothing is left behind in the queue.
fn retire(
    shared: &TcpShared,
    link: &ServiceLink,
    pending: Option<Bytes>,
    rx: &mut mpsc::Receiver<Bytes>,
) {
    rx.close();
    shared.redispatch_queued(link, pending, rx);
    bump(&shared.counters.services_retired);
}

/// Outcome of one write toward a service.
enum Wrote {
    Done,
    Failed,
    /// The link was retired while the write waited (the service is not reading).
    Retired,
}

/// Write `b` whole, unless the link is retired first: a removed service that stopped reading
/// must not hold its task (and the requests queued behind the write) forever.
async fn write_unless_retired(
    write: &mut tokio::net::tcp::OwnedWriteHalf,
    b: &[u8],
    link: &ServiceLink,
) -> Wrote {
    tokio::select! {
        r = write.write_all(b) => if r.is_ok() { Wrote::Done } else { Wrote::Failed },
        () = link.retired() => Wrote::Retired,
    }
}

/// The vserver's own task: its accept loops and dialog sweeper until the shutdown signal,
/// then the end of every client connection and service link (aborted, so that no
/// connection's read or write loop has to look at the signal on its data path).
async fn run_vserver(
    shared: Arc<TcpShared>,
    listeners: Vec<TcpListener>,
    mut signal: Signal,
    _guard: TaskGuard,
) {
    let accepts: Vec<AbortOnDrop> = listeners
        .into_iter()
        .map(|l| AbortOnDrop(tokio::spawn(accept_loop(Arc::clone(&shared), l))))
        .collect();
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

/// Start a sip-tcp vserver on the runtime's tokio runtime.
pub(crate) fn start(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
) -> Result<VserverHandle, RuntimeError> {
    let (listeners, bound) = bind_tcp(ctx, v)?;
    let member_addrs = config.member_addrs(v);
    let local = local_identity(v, &bound, &member_addrs, Transport::Tcp)?;
    let balancer = Arc::new(crate::balancer::Balancer::new(config, v));
    let core = Arc::new(
        SipCore::new(SipParams::of(config, v, local, Arc::clone(&balancer)))
            .with_edge(v.edge(None)),
    );
    let empty = Generation {
        core: Arc::clone(&core),
        links: Vec::new(),
        max_clients: v.max_sessions,
        idle: v.idle_timeout,
    };
    let shared = Arc::new(TcpShared {
        name: v.name.clone(),
        current: ArcSwap::from_pointee(empty),
        counters: TcpCounters::default(),
        clients: DashMap::new(),
        by_remote: DashMap::new(),
        draining: DashMap::new(),
        next_conn: AtomicU64::new(1),
        epoch: ctx.epoch,
        tasks: ctx.shutdown.group(format!("sip-tcp vserver `{}`", v.name)),
        link_tasks: std::sync::Mutex::new(Vec::new()),
        log: LogLimiter::default(),
        tokio: ctx.tokio.clone(),
    });
    // Every member gets its link (and connection task) as a reload's added member would.
    shared.install(Install {
        core: Arc::clone(&core),
        max_clients: v.max_sessions,
        idle: v.idle_timeout,
    });
    ctx.tokio.spawn(run_vserver(
        Arc::clone(&shared),
        listeners,
        ctx.shutdown.signal(),
        shared.tasks.guard(),
    ));
    tracing::info!(vserver = %v.name, bind = ?bound, method = v.method.name(), "sip-tcp vserver started");
    Ok(VserverHandle::new(
        v.name.clone(),
        v.protocol,
        bound,
        balancer,
        DataPath::SipTcp(core, shared),
    ))
}
