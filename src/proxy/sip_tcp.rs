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

use crate::balancer::Health;
use crate::config::{Config, Vserver};
use crate::proxy::runtime::{
    DataPath, RuntimeError, StartCtx, VserverHandle, bind_tcp, local_identity,
};
use crate::proxy::sip_core::{Action, Origin, SipCore, SipParams};
use crate::proxy::{LogLimiter, bump, elapsed_nanos};
use crate::sip::framing::{DEFAULT_MAX_MESSAGE, PONG};
use crate::sip::{Frame, FrameError, Transport, next_frame};
use bytes::{Bytes, BytesMut};
use dashmap::DashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// Messages queued toward one client before it counts as not reading.
pub const CLIENT_QUEUE: usize = 1024;
/// Messages queued toward one service while its connection is (re)established.
pub const SERVICE_QUEUE: usize = 8192;
/// Connect timeout toward a service.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// First and last reconnect delay toward a service.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

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
    pub service_queue_full: AtomicU64,
    /// Requests moved to the next-ranked member after their member's connection failed.
    pub requests_rerouted: AtomicU64,
    /// Requests that found no member after their member's connection failed.
    pub requests_lost: AtomicU64,
}

struct Client {
    tx: mpsc::Sender<Bytes>,
    remote: SocketAddr,
    abort: tokio::task::AbortHandle,
}

/// State shared by the tasks of one sip-tcp vserver.
pub struct TcpShared {
    pub core: Arc<SipCore>,
    pub counters: TcpCounters,
    clients: DashMap<u64, Client>,
    /// Remote address → client connection id (the alias used for in-dialog requests).
    by_remote: DashMap<SocketAddr, u64>,
    services: Vec<mpsc::Sender<Bytes>>,
    next_conn: AtomicU64,
    max_clients: usize,
    idle: Duration,
    epoch: Instant,
    stop: Arc<AtomicBool>,
    log: LogLimiter,
}

impl std::fmt::Debug for TcpShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpShared")
            .field("vserver", &self.core.name)
            .field("clients", &self.clients.len())
            .finish_non_exhaustive()
    }
}

impl TcpShared {
    fn now(&self) -> u64 {
        elapsed_nanos(self.epoch)
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
                bump(&self.counters.slow_clients_closed);
                tracing::info!(vserver = %self.core.name, %remote, "client does not read: disconnected");
                self.forget_client(id, remote);
                abort.abort();
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    fn to_service(&self, member: usize, bytes: Bytes) -> bool {
        match self.services.get(member).map(|tx| tx.try_send(bytes)) {
            Some(Ok(())) => true,
            _ => {
                bump(&self.counters.service_queue_full);
                false
            }
        }
    }

    /// Send a request that could not reach member `failed` to the member chosen now (the
    /// failed one is DOWN, so the ranking passes it over); counted and dropped if none.
    fn redispatch(&self, failed: usize, bytes: Bytes) {
        let dst = self
            .core
            .member_addr(failed)
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
        match self.core.rechoose(&bytes, dst, self.now()) {
            Some(m) if m != failed => {
                bump(&self.counters.requests_rerouted);
                self.to_service(m, bytes);
            }
            _ => bump(&self.counters.requests_lost),
        }
    }

    fn forget_client(&self, id: u64, remote: SocketAddr) {
        if self.clients.remove(&id).is_some() {
            self.counters.clients_open.fetch_sub(1, Ordering::Relaxed);
        }
        self.by_remote.remove_if(&remote, |_, v| *v == id);
    }

    /// Carry out the core's decision for a message that arrived from `origin`.
    fn dispatch(&self, action: Action, out: &[u8], origin: Origin, reply: &mpsc::Sender<Bytes>) {
        let bytes = || Bytes::copy_from_slice(out);
        match action {
            Action::ToMember(m) => {
                self.to_service(m, bytes());
            }
            Action::ToConn(id) => {
                if !self.to_client(id, bytes()) {
                    bump(&self.counters.responses_no_client);
                }
            }
            Action::ToAddr(addr) => {
                let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
                if let Some(m) = self.core.member_of(addr) {
                    // A client's response to a service's in-dialog request.
                    self.to_service(m, bytes());
                } else if let Some(id) = self.by_remote.get(&addr).map(|v| *v) {
                    self.to_client(id, bytes());
                } else {
                    if matches!(origin, Origin::Member(_)) {
                        bump(&self.counters.in_dialog_no_client);
                    } else {
                        bump(&self.counters.responses_no_client);
                    }
                }
            }
            Action::Reply(_) => {
                // On streams a reply goes back on the connection it answers.
                let _ = reply.try_send(bytes());
            }
            Action::Drop(reason) => {
                if self.log.allow(self.now()) {
                    tracing::debug!(vserver = %self.core.name, ?reason, "message dropped");
                }
            }
        }
    }
}

/// Read framed SIP messages from `read`, hand each to the core, until EOF, error, idle
/// timeout or a framing error. `reply` carries pongs and fulcrum's own replies.
async fn read_messages(
    shared: &TcpShared,
    mut read: tokio::net::tcp::OwnedReadHalf,
    origin: Origin,
    src: SocketAddr,
    dst: SocketAddr,
    reply: &mpsc::Sender<Bytes>,
) {
    let mut buf = BytesMut::with_capacity(4096);
    let mut out = Vec::with_capacity(4096);
    loop {
        // Frame everything already buffered (several messages may arrive in one read).
        loop {
            match next_frame(&buf, DEFAULT_MAX_MESSAGE) {
                Ok(frame) => {
                    let len = frame.len();
                    match frame {
                        Frame::Message { .. } => {
                            let now = shared.now();
                            let action =
                                shared
                                    .core
                                    .handle(&buf[..len], origin, src, dst, now, &mut out);
                            shared.dispatch(action, &out, origin, reply);
                        }
                        Frame::Ping => {
                            bump(&shared.counters.keepalive_pings);
                            let _ = reply.try_send(Bytes::from_static(PONG));
                        }
                        Frame::Pong => {}
                    }
                    let _ = buf.split_to(len.min(buf.len()));
                }
                Err(FrameError::Incomplete) => break,
                Err(e) => {
                    bump(&shared.counters.framing_errors);
                    if shared.log.allow(shared.now()) {
                        tracing::info!(vserver = %shared.core.name, %src, error = %e, "closing stream after framing error");
                    }
                    return;
                }
            }
        }
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(4096);
        }
        let n = match tokio::time::timeout(shared.idle, read.read_buf(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return,
            Ok(Ok(n)) => n,
        };
        let _ = n;
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
    }
}

async fn write_messages(mut write: tokio::net::tcp::OwnedWriteHalf, mut rx: mpsc::Receiver<Bytes>) {
    while let Some(b) = rx.recv().await {
        if write.write_all(&b).await.is_err() {
            return;
        }
    }
    let _ = write.shutdown().await;
}

async fn serve_client(
    shared: Arc<TcpShared>,
    stream: TcpStream,
    id: u64,
    src: SocketAddr,
    dst: SocketAddr,
    rx: mpsc::Receiver<Bytes>,
    tx: mpsc::Sender<Bytes>,
) {
    let _ = stream.set_nodelay(true);
    let (read, write) = stream.into_split();
    let writer = tokio::spawn(write_messages(write, rx));
    read_messages(
        &shared,
        read,
        Origin::Client { conn: Some(id) },
        src,
        dst,
        &tx,
    )
    .await;
    shared.forget_client(id, src);
    drop(tx);
    let _ = writer.await;
}

async fn accept_loop(shared: Arc<TcpShared>, listener: TcpListener) {
    loop {
        let (stream, src) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                if shared.log.allow(shared.now()) {
                    tracing::warn!(vserver = %shared.core.name, error = %e, "accept failed");
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
        if shared.clients.len() >= shared.max_clients {
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
        let task = tokio::spawn(serve_client(
            Arc::clone(&shared),
            stream,
            id,
            src,
            dst,
            rx,
            tx.clone(),
        ));
        shared.clients.insert(
            id,
            Client {
                tx,
                remote: src,
                abort: task.abort_handle(),
            },
        );
        shared.by_remote.insert(src, id);
    }
}

/// Own the connection to member `m`: connect on demand with backoff, write what is queued,
/// and read what the service sends (responses, in-dialog requests).
async fn service_loop(
    shared: Arc<TcpShared>,
    m: usize,
    addr: SocketAddr,
    mut rx: mpsc::Receiver<Bytes>,
) {
    let mut backoff = BACKOFF_MIN;
    let mut pending: Option<Bytes> = None;
    // Set after a failed connect: keep probing (with backoff) until the service answers,
    // so a service marked DOWN by this path comes back without waiting for traffic.
    let mut down = false;
    loop {
        if pending.is_none() && !down {
            // Connect only when there is something to send.
            match rx.recv().await {
                Some(b) => pending = Some(b),
                None => return,
            }
        }
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            _ => {
                bump(&shared.counters.service_connect_failures);
                shared.core.balancer().report_failure(m);
                if !down {
                    down = true;
                    shared
                        .core
                        .balancer()
                        .set_health(m, Health::Down, shared.now());
                    tracing::warn!(vserver = %shared.core.name, service = %addr, "cannot connect: service marked DOWN");
                }
                // Requests queued for the dead service go to the next-ranked member.
                let queued = pending
                    .take()
                    .into_iter()
                    .chain(std::iter::from_fn(|| rx.try_recv().ok()));
                for bytes in queued {
                    shared.redispatch(m, bytes);
                }
                if shared.stop.load(Ordering::Relaxed) {
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        if down {
            down = false;
            shared
                .core
                .balancer()
                .set_health(m, Health::Up, shared.now());
            tracing::info!(vserver = %shared.core.name, service = %addr, "connected again: service marked UP");
        }
        backoff = BACKOFF_MIN;
        let _ = stream.set_nodelay(true);
        let dst = stream.local_addr().unwrap_or(addr);
        let (read, mut write) = stream.into_split();
        // Replies fulcrum makes to a service's request go back on this connection.
        let (reply_tx, mut reply_rx) = mpsc::channel::<Bytes>(CLIENT_QUEUE);
        let reader_shared = Arc::clone(&shared);
        let mut reader = tokio::spawn(async move {
            read_messages(
                &reader_shared,
                read,
                Origin::Member(m),
                addr,
                dst,
                &reply_tx,
            )
            .await;
        });
        if let Some(b) = pending.take()
            && write.write_all(&b).await.is_err()
        {
            continue;
        }
        loop {
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(b) => {
                        if write.write_all(&b).await.is_err() {
                            break;
                        }
                    }
                    None => return,
                },
                Some(b) = reply_rx.recv() => {
                    if write.write_all(&b).await.is_err() {
                        break;
                    }
                }
                _ = &mut reader => break,
            }
        }
        reader.abort();
    }
}

/// Start a sip-tcp vserver on the runtime's tokio runtime.
pub fn start(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
) -> Result<VserverHandle, RuntimeError> {
    let (listeners, bound) = bind_tcp(ctx, v)?;
    let member_addrs = config.member_addrs(v);
    let local = local_identity(v, &bound, &member_addrs, Transport::Tcp)?;
    let balancer = Arc::new(crate::balancer::Balancer::new(config, v));
    let core = Arc::new(SipCore::new(SipParams {
        name: v.name.clone(),
        local,
        record_route: v.record_route,
        method: v.method,
        hash_params: v.hash.clone(),
        balancer: Arc::clone(&balancer),
        member_addrs: member_addrs.clone(),
        max_dialogs: v.max_sessions,
        dialog_idle: v.idle_timeout,
    }));
    let mut service_rx = Vec::new();
    let mut service_tx = Vec::new();
    for _ in &member_addrs {
        let (tx, rx) = mpsc::channel(SERVICE_QUEUE);
        service_tx.push(tx);
        service_rx.push(rx);
    }
    let shared = Arc::new(TcpShared {
        core: Arc::clone(&core),
        counters: TcpCounters::default(),
        clients: DashMap::new(),
        by_remote: DashMap::new(),
        services: service_tx,
        next_conn: AtomicU64::new(1),
        max_clients: v.max_sessions,
        idle: v.idle_timeout,
        epoch: ctx.epoch,
        stop: Arc::clone(ctx.stop),
        log: LogLimiter::default(),
    });
    for (m, rx) in service_rx.into_iter().enumerate() {
        ctx.tokio
            .spawn(service_loop(Arc::clone(&shared), m, member_addrs[m], rx));
    }
    for l in listeners {
        ctx.tokio.spawn(accept_loop(Arc::clone(&shared), l));
    }
    // Dialog expiry, as on UDP.
    let sweep_every =
        (v.idle_timeout / 10).clamp(Duration::from_millis(100), Duration::from_secs(10));
    let sweeper = Arc::clone(&shared);
    ctx.tokio.spawn(async move {
        let mut tick = tokio::time::interval(sweep_every);
        loop {
            tick.tick().await;
            if sweeper.stop.load(Ordering::Relaxed) {
                return;
            }
            sweeper.core.sweep(sweeper.now());
        }
    });
    tracing::info!(vserver = %v.name, bind = ?bound, method = v.method.name(), "sip-tcp vserver started");
    Ok(VserverHandle {
        name: v.name.clone(),
        protocol: v.protocol,
        bound,
        balancer,
        data: DataPath::SipTcp(core, shared),
    })
}
