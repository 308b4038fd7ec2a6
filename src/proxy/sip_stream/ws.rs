//! Clients of a `sip-ws` / `sip-wss` vserver: SIP over WebSocket (RFC 7118), the transport
//! of browser softphones. The HTTP/1.1 upgrade and the framing are tokio-tungstenite's; this
//! module checks what RFC 7118 asks of the upgrade (the `sip` subprotocol, §4.1; the page's
//! Origin against `allowed_origins`, RFC 6455 §10.2), hands each WebSocket message to the
//! core as one SIP message (§5.1: a message is whole, so no Content-Length framing), writes
//! each queued message as one WebSocket message, pings the client (browsers cannot send
//! pings), and fails a connection whose client breaks the protocol with the close code that
//! says why (RFC 6455 §7.1.7, §7.4.1: 1002, 1007, 1009). Everything else (the core's
//! decisions, the write queue and its bound, eviction, the idle timeout) is the stream
//! vserver's, as for sip-tcp clients. IO, but for [`check_upgrade`] and [`failing_close`].

use super::*;
use crate::sip::{FrameError, next_frame};
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::protocol::frame::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{Bytes as WsBytes, Error as WsError, Message, Utf8Bytes};

/// The subprotocol of SIP over WebSocket (RFC 7118 §4.1, IANA WebSocket Subprotocol Name
/// Registry).
pub(super) const SUBPROTOCOL: &str = "sip";
/// How long a client has to complete the upgrade once connected (and its TLS handshake
/// done): a connection that never upgrades is closed, not held.
pub(super) const UPGRADE_TIMEOUT: Duration = Duration::from_secs(10);
/// A ping toward a client after this long without a message either way (browsers answer
/// pings but cannot send them; NAT bindings and proxies drop silent connections).
pub(super) const PING_EVERY: Duration = Duration::from_secs(30);

/// What a WebSocket vserver checks at the upgrade.
#[derive(Debug, Clone, Default)]
pub(super) struct WsSettings {
    /// Origins whose pages may connect (`None`: any), compared ASCII case-insensitively.
    pub(super) allowed_origins: Option<Vec<String>>,
}

/// Why an upgrade was refused, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refused {
    /// No `sip` among the offered subprotocols: 400 (RFC 7118 §4.1 leaves the refusal to the
    /// server; a WebSocket server without the subprotocol must not accept, RFC 6455 §4.2.2).
    Subprotocol,
    /// An Origin not in `allowed_origins` (or none, when a list is given): 403.
    Origin,
    /// Not a WebSocket upgrade at all, a bad handshake, or none in time.
    Handshake,
}

impl Refused {
    fn name(self) -> &'static str {
        match self {
            Refused::Subprotocol => "subprotocol",
            Refused::Origin => "origin",
            Refused::Handshake => "handshake",
        }
    }
}

/// The upgrade's verdict on a request whose `Sec-WebSocket-Protocol` fields are `protocols`
/// (the field may be repeated, RFC 6455 §11.3.4): the subprotocol to answer, or the refusal.
/// PURE.
///
/// The answer is `sip` as the client wrote it. RFC 6455 §4.2.2 has the server select "one of
/// the values from the |Sec-WebSocket-Protocol| field", and a client fails the connection
/// when the answer names a subprotocol it did not offer (§4.1); it compares octets (RFC 6455
/// folds case only where it says so), so a client that offered `SIP` must hear `SIP`. RFC
/// 7118 §4.1 registers the name `sip` and says nothing of case, so any case is taken.
pub(super) fn check_upgrade<'a>(
    settings: &WsSettings,
    protocols: &[&'a str],
    origin: Option<&str>,
) -> Result<&'a str, Refused> {
    let offered = protocols
        .iter()
        .flat_map(|p| p.split(','))
        .map(str::trim)
        .find(|p| p.eq_ignore_ascii_case(SUBPROTOCOL))
        .ok_or(Refused::Subprotocol)?;
    if let Some(allowed) = &settings.allowed_origins {
        let ok = origin.is_some_and(|o| allowed.iter().any(|a| a.eq_ignore_ascii_case(o.trim())));
        if !ok {
            return Err(Refused::Origin);
        }
    }
    Ok(offered)
}

/// The Close frame that fails a connection after the library reported `e` reading from the
/// client (RFC 6455 §7.1.7: "SHOULD send a Close frame with an appropriate status code"), or
/// `None` when the connection is gone and there is no one to tell. PURE.
pub(super) fn failing_close(e: &WsError) -> Option<CloseFrame> {
    use tokio_tungstenite::tungstenite::error::ProtocolError;
    let (code, reason) = match e {
        // The client closed the TCP connection without a close handshake: nothing to send.
        WsError::Protocol(ProtocolError::ResetWithoutClosingHandshake) => return None,
        // §7.4.1: 1002, "a protocol error" (bad framing, a fragmented control frame, a
        // continuation out of place, reserved bits or opcodes...).
        WsError::Protocol(_) => (CloseCode::Protocol, "protocol error"),
        // §7.4.1 and §8.1: 1007, a text message that is not UTF-8.
        WsError::Utf8(_) => (CloseCode::Invalid, "text message not UTF-8"),
        // §7.4.1: 1009, a message or frame larger than fulcrum takes (64 KiB).
        WsError::Capacity(_) => (CloseCode::Size, "message too big"),
        _ => return None,
    };
    Some(CloseFrame {
        code,
        reason: Utf8Bytes::from_static(reason),
    })
}

fn refusal(status: StatusCode, why: &str) -> ErrorResponse {
    let mut r = ErrorResponse::new(Some(why.to_owned()));
    *r.status_mut() = status;
    r
}

/// Serve one client connection of a WebSocket vserver: the upgrade, then messages both ways
/// until either side closes, the idle timeout, or a broken frame.
pub(super) async fn serve_ws_client<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    shared: Arc<SipStreamShared>,
    stream: S,
    id: u64,
    src: SocketAddr,
    dst: SocketAddr,
    own: client::ClientOwn,
) {
    let settings = shared.ws.clone().unwrap_or_default();
    let mut refused = None;
    // The refusal's type is tungstenite's (its `Callback` trait), large or not.
    #[allow(clippy::result_large_err)]
    let callback = |req: &Request, mut resp: Response| {
        let protocols: Vec<&str> = req
            .headers()
            .get_all("sec-websocket-protocol")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        let origin = req.headers().get("origin").and_then(|v| v.to_str().ok());
        let verdict = check_upgrade(&settings, &protocols, origin)
            .and_then(|p| HeaderValue::from_str(p).map_err(|_| Refused::Subprotocol));
        match verdict {
            Ok(p) => {
                resp.headers_mut().insert("sec-websocket-protocol", p);
                Ok(resp)
            }
            Err(why) => {
                refused = Some(why);
                Err(match why {
                    Refused::Origin => refusal(StatusCode::FORBIDDEN, "origin not allowed"),
                    _ => refusal(
                        StatusCode::BAD_REQUEST,
                        "the sip WebSocket subprotocol (RFC 7118) is required",
                    ),
                })
            }
        }
    };
    let config = WebSocketConfig::default()
        .max_message_size(Some(DEFAULT_MAX_MESSAGE))
        .max_frame_size(Some(DEFAULT_MAX_MESSAGE));
    let upgraded = tokio::time::timeout(
        UPGRADE_TIMEOUT,
        tokio_tungstenite::accept_hdr_async_with_config(stream, callback, Some(config)),
    )
    .await;
    let ws = match upgraded {
        Ok(Ok(ws)) => ws,
        Ok(Err(_)) | Err(_) => {
            let why = refused.unwrap_or(Refused::Handshake);
            bump(&shared.counters.websocket_refused);
            if shared.log.allow(shared.now()) {
                tracing::info!(vserver = %shared.name, %src, reason = why.name(), "WebSocket upgrade refused");
            }
            shared.forget_client(id, src);
            return;
        }
    };
    run(shared, ws, id, src, dst, own).await;
}

/// Messages both ways over an upgraded connection.
async fn run<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    shared: Arc<SipStreamShared>,
    ws: WebSocketStream<S>,
    id: u64,
    src: SocketAddr,
    dst: SocketAddr,
    own: client::ClientOwn,
) {
    let client::ClientOwn {
        mut rx,
        level,
        activity,
    } = own;
    let (mut sink, mut stream) = ws.split();
    // The Close frame that fails the connection, from the reading side to the writer.
    // Fused: a receiver polled again once it has completed (its sender dropped) would panic.
    let (fail_tx, fail_rx) = tokio::sync::oneshot::channel::<CloseFrame>();
    let mut fail_rx = futures_util::FutureExt::fuse(fail_rx);
    let mut writer = AbortOnDrop(tokio::spawn({
        let shared = Arc::clone(&shared);
        let level = Arc::clone(&level);
        async move {
            let mut ping = tokio::time::interval(PING_EVERY);
            ping.tick().await;
            let end = loop {
                let mut cost = 0;
                let msg = tokio::select! {
                    // First: once the connection fails, nothing else is sent.
                    biased;
                    Ok(frame) = &mut fail_rx => {
                        let close = sink.send(Message::Close(Some(frame)));
                        let _ = tokio::time::timeout(CLIENT_FLUSH, close).await;
                        break client::WriterEnd::Done;
                    }
                    b = rx.recv() => match b {
                        Some(Outgoing { bytes: b, call_id }) => {
                            cost = outbox::cost(&b);
                            // Captured as the WebSocket message's payload, on the client's
                            // connection (docs/capture.md), the time taken before the send.
                            if let Some(at) = shared.tap.stamp() {
                                let leg = (crate::capture::Transport::Tcp, dst, src);
                                shared.tap.tap_as(at, leg, &b, call_id.as_call_id());
                            }
                            // SIP is text; a message that is not UTF-8 (a binary body) goes
                            // as a binary message (RFC 7118 §5.1 allows both).
                            // (The clone shares the bytes: validated once, copied never.)
                            match Utf8Bytes::try_from(b.clone()) {
                                Ok(t) => Message::Text(t),
                                Err(_) => Message::Binary(b),
                            }
                        }
                        None => break client::WriterEnd::Done,
                    },
                    _ = ping.tick() => {
                        bump(&shared.counters.keepalive_pings);
                        Message::Ping(WsBytes::new())
                    }
                };
                match tokio::time::timeout(CLIENT_SEND_TIMEOUT, sink.send(msg)).await {
                    Ok(Ok(())) => level.written(cost),
                    Ok(Err(_)) => break client::WriterEnd::Failed,
                    Err(_) => break client::WriterEnd::Stalled,
                }
            };
            match end {
                client::WriterEnd::Done => {
                    let _ = tokio::time::timeout(CLIENT_FLUSH, sink.close()).await;
                }
                client::WriterEnd::Stalled => {
                    shared.disconnect_slow_client(id, "a write made no progress")
                }
                client::WriterEnd::Failed => {
                    if let Some(abort) = shared.clients.get(&id).map(|c| c.abort.clone()) {
                        shared.forget_client(id, src);
                        abort.abort();
                    }
                }
            }
            sink
        }
    }));
    let origin = Origin::Client { conn: Some(id) };
    let mut failed = false;
    // Marks each message handled with the core, so that a reload's hand-over waits for it
    // (crate::proxy::handover), as a TCP client's task does: without it a reload could swap
    // the core while this client's message pinned a dialog in the old table, and the pin
    // (and its count) would be lost.
    let reader = shared.readers.register();
    loop {
        let idle = shared.current.load().idle;
        let next = match tokio::time::timeout(idle, stream.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => {
                bump(&shared.counters.framing_errors);
                if shared.log.allow(shared.now()) {
                    tracing::info!(vserver = %shared.name, %src, error = %e, "closing WebSocket after a bad frame");
                }
                if let Some(frame) = failing_close(&e) {
                    failed = fail_tx.send(frame).is_ok();
                }
                break;
            }
            // Closed, or silent for the idle timeout.
            Ok(None) | Err(_) => break,
        };
        let bytes: &[u8] = match &next {
            Message::Text(t) => t.as_bytes(),
            Message::Binary(b) => b,
            Message::Ping(_) | Message::Pong(_) => {
                activity.touch(shared.now(), false);
                continue;
            }
            Message::Close(_) => break,
            Message::Frame(_) => continue,
        };
        // The CRLF keep-alive of RFC 5626 §3.5.1 as browser stacks send it over WebSocket
        // (SIP.js: a message of two CRLFs), answered with one CRLF as over TCP; a lone CRLF
        // (the client's own pong) is activity and nothing else.
        if bytes == b"\r\n\r\n" || bytes == PONG {
            activity.touch(shared.now(), false);
            if bytes != PONG {
                bump(&shared.counters.keepalive_pings);
                shared.reply(ReplyTo::Client(id), bytes::Bytes::from_static(PONG).into());
            }
            continue;
        }
        // A client that sends faster than it reads its answers waits for its queue.
        if level.should_pause() {
            bump(&shared.counters.client_reads_paused);
            level.drained().await;
        }
        handle_message(&shared, bytes, origin, src, dst, id, &activity, &reader);
    }
    shared.forget_client(id, src);
    let sink = tokio::time::timeout(CLIENT_FLUSH, &mut writer.0).await;
    if failed && let Ok(Ok(sink)) = sink {
        linger(sink, stream).await;
    }
}

/// After failing the connection: the server closes the TCP connection first (RFC 6455
/// §7.1.1), and reads what the client still sends (the rest of a message too big) until it
/// closes, [`reader::LINGER`] passes or [`reader::LINGER_BYTES`] arrived: closing with unread
/// bytes resets the connection (RFC 1122 §4.2.2.13), which may discard the Close frame before
/// the client has read it.
async fn linger<S: AsyncRead + AsyncWrite + Unpin>(
    sink: futures_util::stream::SplitSink<WebSocketStream<S>, Message>,
    stream: futures_util::stream::SplitStream<WebSocketStream<S>>,
) {
    let Ok(mut ws) = sink.reunite(stream) else {
        return;
    };
    let raw = ws.get_mut();
    let until = tokio::time::Instant::now() + reader::LINGER;
    let _ = tokio::time::timeout_at(until, raw.shutdown()).await;
    let mut buf = [0u8; 4096];
    let mut discarded = 0;
    while discarded < reader::LINGER_BYTES {
        match tokio::time::timeout_at(until, raw.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => discarded += n,
            _ => return,
        }
    }
}

/// One SIP message from a WebSocket client, through the current core.
#[allow(clippy::too_many_arguments)]
fn handle_message(
    shared: &SipStreamShared,
    bytes: &[u8],
    origin: Origin,
    src: SocketAddr,
    dst: SocketAddr,
    id: u64,
    activity: &crate::budget::Activity,
    reader: &crate::proxy::handover::Reader,
) {
    let now = shared.now();
    activity.touch(now, true);
    let _in = reader.enter();
    let g = shared.current.load();
    if g.core.registers_flow(bytes) {
        activity.mark_registered();
    }
    let at = shared.tap.stamp();
    let payload = bytes;
    let framed = with_content_length(bytes);
    let bytes = framed.as_deref().unwrap_or(bytes);
    reader::OUT.with_borrow_mut(|out| {
        let mut sends = Vec::new();
        let d = g
            .core
            .decide_stateful(bytes, origin, src, dst, now, out, &mut sends);
        let (call_id, queued) = reader::handed_on(at, &d, &sends);
        // Captured as the WebSocket message's payload, as it crossed the wire (without the
        // Content-Length a stream service is given), unless dropped.
        if let Some(at) = at
            && crate::proxy::sip_front::is_captured(&d.action)
        {
            let leg = (crate::capture::Transport::Tcp, src, dst);
            shared.tap.tap_as(at, leg, payload, call_id);
        }
        shared.carry_sends(&g, sends, &queued);
        shared.dispatch(&g, d.action, out, origin, ReplyTo::Client(id), &queued);
    });
}

/// A WebSocket message may leave out Content-Length (RFC 7118 §5.1: the message frames
/// itself); a stream service needs it (RFC 3261 §18.3). The message with one added, when it
/// has none; `None` when it has one or does not scan (the core answers or drops it).
fn with_content_length(bytes: &[u8]) -> Option<Vec<u8>> {
    // The stream framer's walk over the header lines tells, without a full scan, the rare
    // message that lacks one; only that one is scanned.
    if next_frame(bytes, DEFAULT_MAX_MESSAGE) != Err(FrameError::MissingContentLength) {
        return None;
    }
    let msg = scan(bytes).ok()?;
    let end = msg.headers_end();
    let body = bytes.len().saturating_sub(msg.body_start());
    let mut out = Vec::with_capacity(bytes.len() + 24);
    out.extend_from_slice(&bytes[..end]);
    out.extend_from_slice(format!("Content-Length: {body}\r\n").as_bytes());
    out.extend_from_slice(&bytes[end..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_without_content_length_gets_one_and_others_are_left_alone() {
        let bare = b"MESSAGE sip:a@b SIP/2.0\r\nVia: SIP/2.0/WS x.invalid;branch=z9hG4bK1\r\nCall-ID: c\r\n\r\nhello";
        let added = with_content_length(bare).expect("added");
        let m = scan(&added).expect("scans");
        assert_eq!(m.content_length(), Some(5));
        assert_eq!(m.body(), b"hello");
        let has = b"MESSAGE sip:a@b SIP/2.0\r\nl: 5\r\n\r\nhello";
        assert_eq!(with_content_length(has), None);
        assert_eq!(with_content_length(b"garbage"), None);
    }

    #[test]
    fn the_upgrade_needs_the_sip_subprotocol_and_an_allowed_origin() {
        let any = WsSettings::default();
        assert_eq!(check_upgrade(&any, &["sip"], None), Ok("sip"));
        // The client's own spelling comes back (RFC 6455 §4.2.2), from any of its fields.
        assert_eq!(check_upgrade(&any, &["chat, SIP"], None), Ok("SIP"));
        assert_eq!(check_upgrade(&any, &["chat", " Sip "], None), Ok("Sip"));
        assert_eq!(
            check_upgrade(&any, &["sipx"], None),
            Err(Refused::Subprotocol)
        );
        assert_eq!(check_upgrade(&any, &[], None), Err(Refused::Subprotocol));
        let listed = WsSettings {
            allowed_origins: Some(vec!["https://phone.example.com".to_owned()]),
        };
        assert_eq!(
            check_upgrade(&listed, &["sip"], Some("https://PHONE.example.com")),
            Ok("sip")
        );
        assert_eq!(
            check_upgrade(&listed, &["sip"], Some("https://evil.example")),
            Err(Refused::Origin)
        );
        assert_eq!(
            check_upgrade(&listed, &["sip"], None),
            Err(Refused::Origin),
            "no Origin where a list is given"
        );
        assert_eq!(
            check_upgrade(&listed, &["chat"], Some("https://phone.example.com")),
            Err(Refused::Subprotocol)
        );
    }

    #[test]
    fn a_connection_fails_with_the_close_code_that_says_why() {
        use tokio_tungstenite::tungstenite::error::{CapacityError, ProtocolError};
        let code = |e: WsError| failing_close(&e).map(|f| u16::from(f.code));
        assert_eq!(
            code(WsError::Protocol(ProtocolError::UnexpectedContinueFrame)),
            Some(1002)
        );
        assert_eq!(
            code(WsError::Protocol(ProtocolError::FragmentedControlFrame)),
            Some(1002)
        );
        assert_eq!(code(WsError::Utf8("\u{fffd}".into())), Some(1007));
        assert_eq!(
            code(WsError::Capacity(CapacityError::MessageTooLong {
                size: 70_000,
                max_size: 65_536
            })),
            Some(1009)
        );
        // Nobody left to tell.
        assert_eq!(
            code(WsError::Protocol(
                ProtocolError::ResetWithoutClosingHandshake
            )),
            None
        );
        assert_eq!(code(WsError::ConnectionClosed), None);
        assert_eq!(
            code(WsError::Io(std::io::ErrorKind::BrokenPipe.into())),
            None
        );
    }
}
