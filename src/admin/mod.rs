//! The admin HTTP API and `/metrics`. IO: [`serve`] is a small HTTP/1.1 server (one request
//! per connection, bounded head and body) around the socket-free [`router`].
//!
//! A hand-written server rather than a framework: the API is five routes on loopback, and
//! `httparse` (already used for the `http` data path) is all it needs.

pub mod metrics;
pub mod router;

use crate::ops::Ops;
use router::{Request, Response};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Largest request head.
const MAX_HEAD: usize = 16 * 1024;
/// Largest request body.
const MAX_BODY: usize = 64 * 1024;
/// A client has this long to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Bind `addr` and serve the admin API on `ops`' runtime until the proxy shuts down
/// ([`Ops::shutdown_signal`]). Returns the bound address and the server task.
pub async fn serve(
    ops: Arc<Ops>,
    addr: SocketAddr,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    if !local.ip().is_loopback() {
        tracing::warn!(%local, "admin API listens beyond loopback");
    }
    let mut signal = ops.shutdown_signal();
    let task = tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = signal.recv() => return,
            };
            let (conn, peer) = match accepted {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let ops = Arc::clone(&ops);
            tokio::spawn(async move {
                if let Err(e) = connection(ops, conn).await {
                    tracing::debug!(%peer, error = %e, "admin connection");
                }
            });
        }
    });
    Ok((local, task))
}

async fn connection(ops: Arc<Ops>, mut conn: TcpStream) -> std::io::Result<()> {
    let resp = match tokio::time::timeout(READ_TIMEOUT, read_request(&mut conn)).await {
        Ok(Ok(Some(req))) => {
            // Reload reads a file and restarts monitors: keep it off the async workers.
            tokio::task::spawn_blocking(move || router::handle(&ops, &req))
                .await
                .unwrap_or_else(|_| error(500, "internal error"))
        }
        Ok(Ok(None)) => error(400, "bad request"),
        Ok(Err(e)) => return Err(e),
        Err(_) => error(408, "request timeout"),
    };
    let reason = match resp.status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Payload Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let mut head = format!(
        "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        resp.status,
        resp.content_type,
        resp.body.len()
    );
    if resp.status == 401 {
        head.push_str("WWW-Authenticate: Bearer\r\n");
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(resp.body.as_bytes()).await?;
    conn.shutdown().await
}

fn error(status: u16, msg: &str) -> Response {
    Response {
        status,
        content_type: "application/json",
        body: format!("{}\n", serde_json::json!({ "error": msg })),
    }
}

/// Read one request; `Ok(None)` for a malformed or oversized one.
async fn read_request(conn: &mut TcpStream) -> std::io::Result<Option<Request>> {
    let mut buf = Vec::with_capacity(1024);
    loop {
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf) {
            Ok(httparse::Status::Complete(head_len)) => {
                let header = |name: &str| {
                    req.headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(name))
                        .and_then(|h| std::str::from_utf8(h.value).ok())
                        .map(str::to_owned)
                };
                let len = match header("content-length").map(|v| v.trim().parse::<usize>()) {
                    None => 0,
                    Some(Ok(l)) if l <= MAX_BODY => l,
                    Some(_) => return Ok(None),
                };
                let mut r = Request {
                    method: req.method.unwrap_or("").to_owned(),
                    path: req
                        .path
                        .unwrap_or("/")
                        .split('?')
                        .next()
                        .unwrap_or("/")
                        .to_owned(),
                    authorization: header("authorization"),
                    body: buf[head_len..].to_vec(),
                };
                while r.body.len() < len {
                    let n = conn.read(&mut chunk).await?;
                    if n == 0 {
                        return Ok(None);
                    }
                    r.body.extend_from_slice(&chunk[..n]);
                }
                r.body.truncate(len);
                return Ok(Some(r));
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
            _ => return Ok(None),
        }
    }
}
