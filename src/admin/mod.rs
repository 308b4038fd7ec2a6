//! The admin HTTP API, `/metrics` and the dashboard page. IO: [`serve`] carries the
//! socket-free [`router`] over HTTP/1.1 (hyper), with keep-alive and bounds on everything a
//! client controls: connections at once, head size, body size, and the time to send a request.
//!
//! Limits ([`Limits::default`]): 256 connections at once (the next ones wait in the listen
//! backlog until one ends: accepted late, never reset), a 16 KiB head (431 above it, however
//! many header fields it holds: [`max_header_fields`]), a
//! 64 KiB body (413 above it, from `Content-Length` before reading or while reading a chunked
//! one), 10 s to send a request head (also the idle time allowed between two requests on a
//! kept-alive connection) and 10 s to send its body (408).

pub(crate) mod metrics;
pub mod router;

use crate::ops::Ops;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Incoming};
use hyper::header::{self, HeaderValue};
use hyper_util::rt::{TokioIo, TokioTimer};
use router::{Request, Response};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// The bounds [`serve_with`] holds every client to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once; the next ones wait, unaccepted, in the listen backlog.
    pub max_connections: usize,
    /// Largest request head (request line and header fields), in bytes.
    pub max_head_bytes: usize,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Time to send a request head, counted from the end of the previous response on a
    /// kept-alive connection: also how long an idle connection stays open.
    pub head_timeout: Duration,
    /// Time to send a request body once its head has arrived.
    pub body_timeout: Duration,
}

/// Admin connections served at once by default (kept in the open-file reserve, where
/// [`crate::budget::ADMIN_CONNECTIONS`] counts them).
pub const MAX_CONNECTIONS: usize = crate::budget::ADMIN_CONNECTIONS;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: MAX_CONNECTIONS,
            max_head_bytes: 16 * 1024,
            max_body_bytes: 64 * 1024,
            head_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
        }
    }
}

/// [`serve_with`] with the default [`Limits`].
pub async fn serve(
    ops: Arc<Ops>,
    addr: SocketAddr,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    serve_with(ops, addr, Limits::default()).await
}

/// Bind `addr` and serve the admin API on `ops`' runtime until the proxy shuts down
/// ([`Ops::shutdown_signal`]): then it accepts no more connections, lets each open one finish
/// the response it is writing and closes it. Returns the bound address and the server task.
pub async fn serve_with(
    ops: Arc<Ops>,
    addr: SocketAddr,
    limits: Limits,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    if !local.ip().is_loopback() {
        tracing::warn!(%local, "admin API listens beyond loopback");
    }
    let mut signal = ops.shutdown_signal();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let task = tokio::spawn(async move {
        loop {
            // A slot first, then accept: past the bound, connections queue in the kernel.
            let slot = tokio::select! {
                s = Arc::clone(&slots).acquire_owned() => s,
                () = signal.recv() => return,
            };
            let Ok(slot) = slot else { return };
            let accepted = crate::proxy::context::accept(&listener, |e| {
                tracing::debug!(error = %e, "admin accept failed");
            });
            let (conn, peer) = tokio::select! {
                a = accepted => a,
                () = signal.recv() => return,
            };
            let (ops, signal) = (Arc::clone(&ops), signal.clone());
            tokio::spawn(async move {
                let _slot = slot;
                if let Err(e) = connection(ops, limits, conn, signal).await {
                    tracing::debug!(%peer, error = %e, "admin connection");
                }
            });
        }
    });
    Ok((local, task))
}

/// Header fields a head of `max_head_bytes` may hold: as many as fit, so that the head's size
/// is the one bound a client meets (hyper's own default is 100 fields, which a valid 16 KiB
/// head can pass). The shortest field line is `x:` and its CRLF, 4 bytes (RFC 9112 section 5).
/// hyper allocates room for this many while it parses a head (64 bytes each: 256 KiB for a
/// 16 KiB head), freed once parsed.
pub fn max_header_fields(max_head_bytes: usize) -> usize {
    (max_head_bytes / 4).max(1)
}

async fn connection(
    ops: Arc<Ops>,
    limits: Limits,
    conn: TcpStream,
    mut signal: crate::proxy::shutdown::Signal,
) -> hyper::Result<()> {
    let service = hyper::service::service_fn(move |req| {
        let ops = Arc::clone(&ops);
        async move { Ok::<_, Infallible>(respond(ops, limits, req).await) }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.head_timeout)
        .max_buf_size(limits.max_head_bytes.max(8192) * 2)
        .max_header_size(limits.max_head_bytes)
        .max_headers(max_header_fields(limits.max_head_bytes))
        .keep_alive(true)
        .serve_connection(TokioIo::new(conn), service);
    tokio::pin!(served);
    tokio::select! {
        r = served.as_mut() => r,
        () = signal.recv() => {
            served.as_mut().graceful_shutdown();
            served.await
        }
    }
}

async fn respond(
    ops: Arc<Ops>,
    limits: Limits,
    req: hyper::Request<Incoming>,
) -> hyper::Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    // A declared length over the bound is refused before any of it is read (nor a
    // `100 Continue` sent, RFC 9110 section 10.1.1); `Limited` catches a chunked one.
    if body.size_hint().lower() > limits.max_body_bytes as u64 {
        return closing(error(413, "request body too large"));
    }
    let read = Limited::new(body, limits.max_body_bytes).collect();
    let body = match tokio::time::timeout(limits.body_timeout, read).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) if e.is::<LengthLimitError>() => {
            return closing(error(413, "request body too large"));
        }
        Ok(Err(_)) => return closing(error(400, "bad request body")),
        Err(_) => return closing(error(408, "request timeout")),
    };
    let text = |name: header::HeaderName| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let request = Request {
        method: parts.method.as_str().to_owned(),
        path: parts.uri.path().to_owned(),
        query: parts.uri.query().map(str::to_owned),
        authorization: text(header::AUTHORIZATION),
        origin: text(header::ORIGIN),
        host: text(header::HOST),
        body: body.to_vec(),
    };
    // Reload reads files (the config, its certificates) and rebuilds vservers: keep it off
    // the async workers.
    let resp = tokio::task::spawn_blocking(move || router::handle(&ops, &request))
        .await
        .unwrap_or_else(|_| error(500, "internal error"));
    to_http(resp)
}

fn to_http(resp: Response) -> hyper::Response<Full<Bytes>> {
    let html = resp.content_type.starts_with("text/html");
    let mut r = hyper::Response::new(Full::new(Bytes::from(resp.body)));
    *r.status_mut() = hyper::StatusCode::from_u16(resp.status)
        .unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(resp.content_type),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    if resp.status == 401 {
        h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if html {
        // The page is self-contained: its inline script and style, and its own origin for
        // the API; nothing else, and no framing by other sites (clickjacking the buttons).
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; \
                 base-uri 'none'; form-action 'none'",
            ),
        );
    }
    r
}

/// `resp`, and the connection closes after it: its request body may be left unread.
fn closing(resp: Response) -> hyper::Response<Full<Bytes>> {
    let mut r = to_http(resp);
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

fn error(status: u16, msg: &str) -> Response {
    Response {
        status,
        content_type: "application/json",
        body: format!("{}\n", serde_json::json!({ "error": msg })),
    }
}
