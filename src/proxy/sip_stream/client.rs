//! Client connections of a SIP stream vserver: accepted (access lists, `max_sessions`, the
//! TLS handshake on the connection's own task), read, and written through a byte-bounded
//! queue ([`outbox`]) by a writer that gives up on a client that stops reading. IO.

use super::*;

pub(super) struct Client {
    pub(super) outbox: Outbox,
    pub(super) remote: SocketAddr,
    /// The client's task; aborting it ends its writer too (see [`AbortOnDrop`]).
    pub(super) abort: tokio::task::AbortHandle,
    /// Its place among the process's evictable clients, ranked by what it has done
    /// (docs/limits.md) and given up with this entry; `None` for a member's connection,
    /// which is never evicted.
    pub(super) _evictable: Option<crate::proxy::evict::Ticket>,
}

/// Most bytes gathered into one write toward a client.
pub(super) const WRITE_BATCH: usize = 64 * 1024;

/// Write `bytes` whole and flush them toward a client that must keep reading, for as long as
/// the connection makes progress: the writer gives up only once [`CLIENT_SEND_TIMEOUT`] passes
/// without the connection waking it (room freed by the client's reading). A bound on each
/// step would not do over TLS, whose flush sends what the TLS stream buffered (up to 64 KiB)
/// in one step, however slowly a client that keeps reading takes it.
pub(super) async fn write_to_client<W: AsyncWrite + Unpin>(
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

/// A client connection's two ends, where its writer captures what it writes (docs/capture.md):
/// the time is taken before the write, each message of a batch captured on its own, with the
/// Call-ID queued beside it when its queuer knew it.
pub(super) struct Wire {
    pub(super) tap: crate::capture::Tap,
    pub(super) local: SocketAddr,
    pub(super) remote: SocketAddr,
}

/// How a client's writer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WriterEnd {
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
pub(super) async fn write_messages<W: AsyncWrite + Unpin>(
    mut write: W,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    level: Arc<Level>,
    wire: Option<Wire>,
) -> WriterEnd {
    let mut batch = BytesMut::new();
    while let Some(b) = rx.recv().await {
        let mut cost = outbox::cost(&b);
        let at = wire.as_ref().and_then(|w| w.tap.stamp());
        let tap = |m: &Outgoing| {
            if let (Some(w), Some(at)) = (&wire, at) {
                let leg = (crate::capture::Transport::Tcp, w.local, w.remote);
                w.tap.tap_as(at, leg, &m.bytes, m.call_id.as_call_id());
            }
        };
        tap(&b);
        let write_once = match rx.try_recv() {
            // The common case: one message, written from where it is.
            Err(_) => write_to_client(&mut write, &b).await,
            Ok(next) => {
                cost += outbox::cost(&next);
                tap(&next);
                batch.clear();
                batch.extend_from_slice(&b);
                batch.extend_from_slice(&next);
                while batch.len() < WRITE_BATCH {
                    match rx.try_recv() {
                        Ok(more) => {
                            cost += outbox::cost(&more);
                            tap(&more);
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

/// What a client's task owns besides its stream: its write queue's receiver and level, and
/// its activity.
pub(super) struct ClientOwn {
    pub(super) rx: mpsc::UnboundedReceiver<Outgoing>,
    pub(super) level: Arc<Level>,
    pub(super) activity: Arc<crate::budget::Activity>,
}

/// Read a client's messages until it is done, then give what is queued toward it a bounded
/// time to be written: a client that half-closed and does not read must not keep the socket.
/// A writer that fails or stalls first ends the client (and with it this task).
pub(super) async fn serve_client<S: SipStream>(
    shared: Arc<SipStreamShared>,
    stream: S,
    id: u64,
    src: SocketAddr,
    dst: SocketAddr,
    own: ClientOwn,
) {
    let ClientOwn {
        rx,
        level,
        activity,
    } = own;
    // TCP_NODELAY is inherited from the listener (`net::bind_tcp_listener`). The writer is a
    // task of its own, so a client's replies are written while its next requests are read.
    let (read, write) = stream.split();
    let mut writer = AbortOnDrop(tokio::spawn({
        let shared = Arc::clone(&shared);
        let level = Arc::clone(&level);
        async move {
            let wire = Wire {
                tap: shared.tap.clone(),
                local: dst,
                remote: src,
            };
            match write_messages(write, rx, level, Some(wire)).await {
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
        link: None,
        activity: Some(&activity),
    };
    read_messages(&shared, read, peer).await;
    shared.forget_client(id, src);
    // Dropping `writer` afterwards ends it if it has not finished.
    let _ = tokio::time::timeout(CLIENT_FLUSH, &mut writer.0).await;
}

pub(super) async fn accept_loop(shared: Arc<SipStreamShared>, listener: TcpListener) {
    loop {
        let (stream, src) = crate::proxy::context::accept(&listener, |e| {
            if shared.log.allow(shared.now()) {
                tracing::warn!(vserver = %shared.name, error = %e, "accept failed");
            }
        })
        .await;
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
        // Its place in `max_sessions` first, reserved atomically (the accept loops of every
        // listener draw on it together; given back when the client leaves the table,
        // `forget_client`): a client refused anyway must not evict another on its way out.
        let max = shared.current.load().max_clients as u64;
        let reserved =
            shared
                .counters
                .clients_open
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < max).then_some(n + 1)
                });
        if reserved.is_err() {
            bump(&shared.counters.clients_refused);
            drop(stream);
            continue;
        }
        // Then its place among its source's and its file from the process's pool, held by the
        // client's task: given back however it ends (docs/limits.md). Only a pool running low
        // makes room by evicting an idle client, and only for a client nothing else refuses.
        // A member connecting in (a service opening a flow toward fulcrum) is no client: its
        // address is not limited per source and its connection is never evicted.
        let member = shared.current.load().core.is_member_ip(src);
        let admitted = match if member {
            shared.admit_member()
        } else {
            shared.admit_client(src.ip())
        } {
            Ok(a) => a,
            Err(why) => {
                shared.counters.clients_open.fetch_sub(1, Ordering::AcqRel);
                bump(&shared.counters.clients_refused);
                if shared.log.allow(shared.now()) {
                    tracing::warn!(vserver = %shared.name, %src, reason = why.name(), "client connection refused");
                }
                drop(stream);
                continue;
            }
        };
        let src = SocketAddr::new(src.ip().to_canonical(), src.port());
        let dst = stream.local_addr().unwrap_or(src);
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let (outbox, rx) = Outbox::new();
        let level = outbox.level();
        let activity = Arc::new(crate::budget::Activity::new(shared.now()));
        let own = ClientOwn {
            rx,
            level,
            activity: Arc::clone(&activity),
        };
        bump(&shared.counters.clients_accepted);
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
                // Here, not in the accept loop: a client for which an idle one was evicted
                // waits for that one's file to come back.
                let _admission = match admitted.files(&shared.gate).await {
                    Ok(a) => a,
                    Err(why) => {
                        shared.forget_client(id, src);
                        bump(&shared.counters.clients_refused);
                        if shared.log.allow(shared.now()) {
                            tracing::warn!(vserver = %shared.name, %src, reason = why.name(), "client connection refused");
                        }
                        return;
                    }
                };
                let ws = shared.ws.is_some();
                match shared.tls.clone() {
                    None if ws => ws::serve_ws_client(shared, stream, id, src, dst, own).await,
                    None => serve_client(shared, stream, id, src, dst, own).await,
                    // The handshake runs here, bounded in time, not in the accept loop: a
                    // client that never finishes it costs this task's timer only.
                    Some(tls) => match tls.accept(stream).await {
                        Ok(s) if ws => ws::serve_ws_client(shared, s, id, src, dst, own).await,
                        Ok(s) => serve_client(shared, s, id, src, dst, own).await,
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
        let me: std::sync::Weak<dyn crate::proxy::evict::IdleClients> =
            Arc::downgrade(&shared) as std::sync::Weak<SipStreamShared>;
        let evictable = (!member).then(|| shared.evictors.enter(me, id, activity));
        shared.clients.insert(
            id,
            Client {
                outbox,
                remote: src,
                abort: task.abort_handle(),
                _evictable: evictable,
            },
        );
        shared.by_remote.insert(src, id);
        let _ = registered.send(());
    }
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
        let writer = tokio::spawn(write_messages(write, rx, Arc::clone(&level), None));
        let msg = vec![b'x'; 16 * 1024];
        assert_eq!(outbox.push(Bytes::from(msg.clone()).into()), Push::Queued);
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
        let writer = tokio::spawn(write_messages(server, rx, Arc::clone(&level), None));
        assert_eq!(
            outbox.push(Bytes::from(vec![b'x'; 4096]).into()),
            Push::Queued
        );
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
        let writer = tokio::spawn(write_messages(write, rx, Arc::clone(&level), None));
        assert_eq!(
            outbox.push(Bytes::from(vec![b'x'; 128 * 1024]).into()),
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
        let writer = tokio::spawn(write_messages(server, rx, Arc::clone(&level), None));
        let len = 64 * 1024;
        assert_eq!(
            outbox.push(Bytes::from(vec![b'x'; len]).into()),
            Push::Queued
        );
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
        let writer = tokio::spawn(write_messages(write, rx, Arc::clone(&level), None));
        let msg: Vec<u8> = (0..128 * 1024).map(|i| (i % 251) as u8).collect();
        assert_eq!(outbox.push(Bytes::from(msg.clone()).into()), Push::Queued);
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
