//! The path of a tcp / http connection with TLS on either side: the client's handshake on
//! the connection's own task, the first bytes read from the decrypted stream, a member with
//! `tls` reached by a TCP connect, the PROXY header in clear, then the handshake, and both
//! directions copied through [`MaybeTls`] streams with a buffer each (docs/tls.md). IO.

use super::*;

/// Bytes a TLS-carrying connection reads at a time per direction (one TLS record's payload).
const STREAM_CHUNK: usize = 16 * 1024;

/// [`serve`] for a connection with TLS on either side: the handshake with the client (when the
/// vserver terminates TLS) on this task under its time bound, the first bytes read from the
/// decrypted stream, the service reached with TLS where its `tls` says, then both directions
/// copied through [`MaybeTls`] streams with the same half-close, idle timeout, drain cut and
/// counters as the plain relay.
pub(super) async fn serve_stream(
    core: Arc<TcpCore>,
    client: TcpStream,
    peer: SocketAddr,
    tls: Option<Arc<TlsListener>>,
    activity: &Activity,
) {
    let mut live = Live {
        core: &core,
        member: None,
        index: None,
    };
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
    let mut client = match tls {
        Some(l) => match l.accept(client).await {
            Ok(s) => s,
            Err(reason) => {
                tracing::debug!(vserver = %core.name, client = %peer, reason = reason.name(), "TLS handshake failed");
                return;
            }
        },
        None => MaybeTls::Plain(client),
    };
    let first = match read_first_stream(&core, &mut client).await {
        Ok(Some(b)) => b,
        Ok(None) => return,
        Err(_) => {
            bump(&core.counters.client_errors);
            return;
        }
    };
    // The rules read what TLS terminated here says (server name, negotiated protocol).
    let names = client.accepted_names();
    let alpn: Vec<Vec<u8>> = names
        .and_then(|(_, p)| p)
        .map(|p| vec![p.to_vec()])
        .unwrap_or_default();
    let handshake = names.map(|(sni, _)| Handshake {
        sni: sni.map(str::as_bytes),
        alpn: &alpn,
    });
    let (pool, rule) = match core.routed(&first, handshake, peer, local) {
        Routed::Pool(p, rule) => (p, rule),
        Routed::Refused(t) => {
            if let Target::Reject { code, reason } = t {
                let _ = write_flush(&mut client, &rejection(*code, reason)).await;
            }
            return;
        }
    };
    let key = core.key_input_in(pool, &first, peer, local);
    let Some(mut upstream) = connect_any_stream(&core, pool, key, peer, local, &mut live).await
    else {
        bump(&core.counters.no_service);
        if let Some(rule) = rule {
            core.balancer.count_route_unavailable(rule);
        }
        return;
    };
    let counters = live.member;
    let member = live.index;
    if let Some(c) = counters {
        c.record_request();
    }
    let first_len = first.len() as u64;
    if first_len > 0 {
        if write_flush(&mut upstream, &first).await.is_err() {
            bump(&core.counters.service_errors);
            return;
        }
        core.counters
            .bytes_in
            .fetch_add(first_len, Ordering::Relaxed);
        if let Some(c) = counters {
            c.record_traffic(first_len, 1, core.now());
        }
    }
    drop(first);
    let asked_at = if first_len > 0 { core.now().max(1) } else { 0 };
    tokio::select! {
        () = relay_streams(&core, client, upstream, counters, asked_at, activity) => {}
        () = core.cut_of(member) => {}
    }
}

/// [`read_first`] over a stream that may be TLS (the bytes are the decrypted ones).
async fn read_first_stream<S: AsyncRead + Unpin>(
    core: &TcpCore,
    client: &mut S,
) -> io::Result<Option<Vec<u8>>> {
    if !core.keys.reads_first() {
        return Ok(Some(Vec::new()));
    }
    let deadline = tokio::time::Instant::now() + core.first_timeout;
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; STREAM_CHUNK];
    loop {
        if core.is_first_complete(&buf) || buf.len() >= http::MAX_HEAD {
            return Ok(Some(buf));
        }
        let room = (http::MAX_HEAD - buf.len()).min(chunk.len());
        match tokio::time::timeout_at(deadline, client.read(&mut chunk[..room])).await {
            Err(_) => {
                bump(&core.counters.first_bytes_timeouts);
                return Ok(if buf.is_empty() { None } else { Some(buf) });
            }
            Ok(Ok(0)) => return Ok(if buf.is_empty() { None } else { Some(buf) }),
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Ok(Err(e)) => return Err(e),
        }
    }
}

/// [`connect_any`] where members may need TLS: after the TCP connect, the PROXY header (in
/// clear, before any TLS), then the member's TLS handshake within [`CONNECT_TIMEOUT`]. A
/// failed handshake passes over the member like a failed connect.
async fn connect_any_stream<'a>(
    core: &'a TcpCore,
    pool: usize,
    key: KeyInput,
    client: SocketAddr,
    local: SocketAddr,
    live: &mut Live<'a>,
) -> Option<MaybeTls<TcpStream>> {
    connect_any_then(core, pool, key, client, live, |member, s| async move {
        let _ = s.set_nodelay(true);
        let connector = core.connectors.get(member).and_then(Option::as_ref);
        finish_connect(core, s, connector, client, local).await
    })
    .await
}

/// The PROXY header, then TLS toward the service when it has a connector. A failure says
/// what it tells of the service (passive ejection) and why (the log).
async fn finish_connect(
    core: &TcpCore,
    s: TcpStream,
    connector: Option<&Arc<TlsConnector>>,
    client: SocketAddr,
    local: SocketAddr,
) -> Result<MaybeTls<TcpStream>, (Cause, &'static str)> {
    if core.send_proxy {
        let mut hdr = [0u8; MAX_V2_LEN];
        let n = proxy_protocol::encode_v2(client, local, Transport::Stream, &mut hdr);
        write_all(&s, &hdr[..n])
            .await
            .map_err(|_| (Cause::Refused, "PROXY header not written"))?;
    }
    match connector {
        None => Ok(MaybeTls::Plain(s)),
        Some(c) => c
            .connect(s, CONNECT_TIMEOUT)
            .await
            .map_err(|r| (Cause::Handshake, r.name())),
    }
}

/// Write all of `data` and flush it out (a TLS stream holds written bytes until flushed).
async fn write_flush<S: AsyncWrite + Unpin>(to: &mut S, data: &[u8]) -> io::Result<()> {
    to.write_all(data).await?;
    to.flush().await
}

/// [`relay`] over streams that may be TLS.
async fn relay_streams(
    core: &TcpCore,
    client: MaybeTls<TcpStream>,
    upstream: MaybeTls<TcpStream>,
    counters: Option<&ServiceCounters>,
    asked_at: Nanos,
    activity: &Activity,
) {
    // When the last byte moved: the idle timeout's clock, and eviction's.
    let last = activity.stamp();
    last.store(core.now(), Ordering::Relaxed);
    let asked = AtomicU64::new(asked_at);
    let timing = Timing {
        asked: &asked,
        counters,
    };
    let (client_r, client_w) = tokio::io::split(client);
    let (up_r, up_w) = tokio::io::split(upstream);
    let both = async move {
        tokio::try_join!(
            pump_stream(core, client_r, up_w, activity, timing, true),
            pump_stream(core, up_r, client_w, activity, timing, false),
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

/// One direction of [`relay_streams`]: on EOF from `from`, shut `to` down (on TLS:
/// close_notify, then the socket's write side), and finish; the other direction goes on.
async fn pump_stream<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    core: &TcpCore,
    mut from: R,
    mut to: W,
    activity: &Activity,
    timing: Timing<'_>,
    inbound: bool,
) -> Result<(), Side> {
    let (from_side, to_side) = if inbound {
        (Side::Client, Side::Service)
    } else {
        (Side::Service, Side::Client)
    };
    let mut buf = vec![0u8; STREAM_CHUNK];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(n) => n,
            // A TLS peer that closed its TCP side without close_notify: rustls reports the
            // missing alert as UnexpectedEof. Read as the end of its stream (a half-close, as
            // HAProxy and nginx read it), so the other direction can still finish; a plain
            // stream never reports it.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => 0,
            Err(_) => return Err(from_side),
        };
        if n == 0 {
            let _ = to.shutdown().await;
            return Ok(());
        }
        write_flush(&mut to, &buf[..n]).await.map_err(|_| to_side)?;
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
        if let Some(c) = timing.counters {
            c.record_traffic(n as u64, 1, now);
        }
    }
}
