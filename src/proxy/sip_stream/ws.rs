//! Clients of a `sip-ws` / `sip-wss` vserver: SIP over WebSocket (RFC 7118), the transport
//! of browser softphones. The HTTP/1.1 upgrade and the framing are tokio-tungstenite's; this
//! module checks what RFC 7118 asks of the upgrade (the `sip` subprotocol, §4.1; the page's
//! Origin against `allowed_origins`, RFC 6455 §10.2), hands each WebSocket message to the
//! core as one SIP message (§5.1: a message is whole, so no Content-Length framing), writes
//! each queued message as one WebSocket message, and pings the client (browsers cannot send
//! pings). Everything else (the core's decisions, the write queue and its bound, eviction,
//! the idle timeout) is the stream vserver's, as for sip-tcp clients. IO.

use super::*;
use crate::sip::{FrameError, next_frame};
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::{HeaderValue, StatusCode};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Bytes as WsBytes, Message, Utf8Bytes};

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

/// The upgrade's verdict on a request: the subprotocol to answer, or the refusal. PURE.
pub(super) fn check_upgrade(
    settings: &WsSettings,
    protocols: Option<&str>,
    origin: Option<&str>,
) -> Result<&'static str, Refused> {
    let offered = protocols
        .into_iter()
        .flat_map(|p| p.split(','))
        .any(|p| p.trim().eq_ignore_ascii_case(SUBPROTOCOL));
    if !offered {
        return Err(Refused::Subprotocol);
    }
    if let Some(allowed) = &settings.allowed_origins {
        let ok = origin.is_some_and(|o| allowed.iter().any(|a| a.eq_ignore_ascii_case(o.trim())));
        if !ok {
            return Err(Refused::Origin);
        }
    }
    Ok(SUBPROTOCOL)
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
        let header = |n: &str| req.headers().get(n).and_then(|v| v.to_str().ok());
        match check_upgrade(
            &settings,
            header("sec-websocket-protocol"),
            header("origin"),
        ) {
            Ok(p) => {
                resp.headers_mut()
                    .insert("sec-websocket-protocol", HeaderValue::from_static(p));
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
    let mut writer = AbortOnDrop(tokio::spawn({
        let shared = Arc::clone(&shared);
        let level = Arc::clone(&level);
        async move {
            let mut ping = tokio::time::interval(PING_EVERY);
            ping.tick().await;
            let end = loop {
                let mut cost = 0;
                let msg = tokio::select! {
                    b = rx.recv() => match b {
                        Some(b) => {
                            cost = outbox::cost(&b);
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
        }
    }));
    let origin = Origin::Client { conn: Some(id) };
    loop {
        let idle = shared.current.load().idle;
        let next = match tokio::time::timeout(idle, stream.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => {
                bump(&shared.counters.framing_errors);
                if shared.log.allow(shared.now()) {
                    tracing::info!(vserver = %shared.name, %src, error = %e, "closing WebSocket after a bad frame");
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
                shared.reply(ReplyTo::Client(id), bytes::Bytes::from_static(PONG));
            }
            continue;
        }
        // A client that sends faster than it reads its answers waits for its queue.
        if level.should_pause() {
            bump(&shared.counters.client_reads_paused);
            level.drained().await;
        }
        handle_message(&shared, bytes, origin, src, dst, id, &activity);
    }
    shared.forget_client(id, src);
    let _ = tokio::time::timeout(CLIENT_FLUSH, &mut writer.0).await;
}

/// One SIP message from a WebSocket client, through the current core.
fn handle_message(
    shared: &SipStreamShared,
    bytes: &[u8],
    origin: Origin,
    src: SocketAddr,
    dst: SocketAddr,
    id: u64,
    activity: &crate::budget::Activity,
) {
    let now = shared.now();
    activity.touch(now, true);
    let g = shared.current.load();
    if g.core.registers_flow(bytes) {
        activity.mark_registered();
    }
    let framed = with_content_length(bytes);
    let bytes = framed.as_deref().unwrap_or(bytes);
    reader::OUT.with_borrow_mut(|out| {
        let mut sends = Vec::new();
        let action = g
            .core
            .handle_stateful(bytes, origin, src, dst, now, out, &mut sends);
        shared.carry_sends(&g, sends);
        shared.dispatch(&g, action, out, origin, ReplyTo::Client(id));
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
        assert_eq!(check_upgrade(&any, Some("sip"), None), Ok("sip"));
        assert_eq!(check_upgrade(&any, Some("chat, SIP"), None), Ok("sip"));
        assert_eq!(
            check_upgrade(&any, Some("sipx"), None),
            Err(Refused::Subprotocol)
        );
        assert_eq!(check_upgrade(&any, None, None), Err(Refused::Subprotocol));
        let listed = WsSettings {
            allowed_origins: Some(vec!["https://phone.example.com".to_owned()]),
        };
        assert_eq!(
            check_upgrade(&listed, Some("sip"), Some("https://PHONE.example.com")),
            Ok("sip")
        );
        assert_eq!(
            check_upgrade(&listed, Some("sip"), Some("https://evil.example")),
            Err(Refused::Origin)
        );
        assert_eq!(
            check_upgrade(&listed, Some("sip"), None),
            Err(Refused::Origin),
            "no Origin where a list is given"
        );
        assert_eq!(
            check_upgrade(&listed, Some("chat"), Some("https://phone.example.com")),
            Err(Refused::Subprotocol)
        );
    }
}
