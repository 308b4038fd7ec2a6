//! Health probes: one attempt against one service. IO (the message builders and verdicts
//! at the top are PURE and unit-tested).
//!
//! - `sip-options`: an OPTIONS request over the service's transport (UDP, TCP for
//!   `sip-tcp` services, TLS with the service's `tls` for `sip-tls` ones); the final answer
//!   is judged by [`super::answer::judge`] (5xx and 408 are not alive, other final answers
//!   are, unless `expect_codes` lists the acceptable codes; a 503 with Retry-After fails as
//!   [`ProbeError::RetryAfter`]). Provisional responses are skipped.
//! - `tcp-connect`: the TCP handshake completes.
//! - `udp`: `send` is sent; a reply arrives (containing `expect` when set).
//! - `http`: `GET path` answers one of `expect_codes` (200 when empty); over TLS with the
//!   service's `tls` when it has one.
//!
//! # Reported load (`custom_load`)
//! A SIP monitor reads the load from the response header `X-Load: <0..=4294967295>`; an http
//! monitor reads it from the response body, whose first line must be a decimal integer.
//! Anything else reports no load (the method then treats the service as unloaded-unknown).

use super::answer::{self, RETRY_AFTER_HEADER};
use super::state::Outcome;
use crate::config::{MonitorKind, Protocol};
use crate::sip::framing::{self, Frame};
use crate::tls::ClientTls;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

/// Header a SIP service reports its load in (custom_load).
pub const LOAD_HEADER: &[u8] = b"X-Load";
/// Largest reply a probe reads.
const MAX_REPLY: usize = 64 * 1024;

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("no answer within the timeout")]
    Timeout,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("reply is not a valid response")]
    BadReply,
    #[error("unexpected status {0}")]
    UnexpectedStatus(u16),
    /// A 503 with a Retry-After (RFC 3261 §21.5.4): unavailable for that long.
    #[error("status {code} with Retry-After {retry_after_s} s")]
    RetryAfter { code: u16, retry_after_s: u32 },
    #[error("reply does not contain the expected payload")]
    Mismatch,
    #[error("connection closed before a reply")]
    Closed,
    #[error("the data path reported failures")]
    Passive,
    #[error("TLS handshake failed ({0})")]
    Tls(&'static str),
    #[error("a sip-tls service without loaded `tls` cannot be probed")]
    NoTls,
    /// Neither socket an `icmp` probe may use could be opened: what the host lacks.
    #[error("cannot send ICMP echoes: {0}")]
    NoIcmpSocket(String),
}

impl ProbeError {
    /// Whether the probe failed on fulcrum's own side (no descriptor, buffer, memory or local
    /// address: [`crate::eject::is_local_error`]): it says nothing of the service, whose state
    /// stays as it was ([`super::HealthBoard::record`]).
    pub fn is_local(&self) -> bool {
        matches!(self, ProbeError::Io(e) if crate::eject::is_local_error(e))
    }

    /// What the failure says about the service: held DOWN for a Retry-After, or one failure.
    pub fn outcome(&self) -> Outcome {
        match self {
            ProbeError::RetryAfter { retry_after_s, .. } => Outcome::Unavailable {
                retry_after_s: *retry_after_s,
            },
            _ => Outcome::Dead,
        }
    }
}

/// The final answer to a monitor's OPTIONS, as far as the monitor reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SipAnswer {
    pub code: u16,
    /// `X-Load` (custom_load).
    pub load: Option<u32>,
    /// Retry-After in seconds, when present and valid.
    pub retry_after_s: Option<u32>,
}

/// A successful probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeReply {
    /// Time from sending (or connecting) to the reply.
    pub rtt_us: u64,
    /// Status code, for SIP and HTTP monitors.
    pub status: Option<u16>,
    /// Load reported by the service (custom_load).
    pub load: Option<u32>,
}

static SEQ: AtomicU64 = AtomicU64::new(1);

/// An OPTIONS request from `local` to `target` (RFC 3261 §11). `seq` makes the Call-ID
/// and branch unique.
/// The OPTIONS a monitor sends; `transport` is the Via's (`UDP`, `TCP` or `TLS`).
pub fn build_options(target: SocketAddr, local: SocketAddr, transport: &str, seq: u64) -> Vec<u8> {
    format!(
        "OPTIONS sip:{target} SIP/2.0\r\n\
         Via: SIP/2.0/{transport} {local};branch=z9hG4bK-fmon-{seq:x};rport\r\n\
         Max-Forwards: 70\r\n\
         From: <sip:fulcrum@{local}>;tag=fmon{seq:x}\r\n\
         To: <sip:{target}>\r\n\
         Call-ID: fmon-{seq:x}@fulcrum\r\n\
         CSeq: 1 OPTIONS\r\n\
         Accept: application/sdp\r\n\
         User-Agent: fulcrum-monitor\r\n\
         Content-Length: 0\r\n\r\n"
    )
    .into_bytes()
}

/// `Some(answer)` for a final SIP response to the probe with Call-ID `call_id`; `None` for
/// anything to skip (provisional, not ours, not a response). `Err` for garbage.
pub fn sip_final_status(buf: &[u8], call_id: &[u8]) -> Result<Option<SipAnswer>, ProbeError> {
    let msg = crate::sip::scan(buf).map_err(|_| ProbeError::BadReply)?;
    if msg.is_request() || msg.call_id().map(trim) != Some(call_id) {
        return Ok(None);
    }
    let code = msg.status_code().ok_or(ProbeError::BadReply)?;
    if code < 200 {
        return Ok(None);
    }
    Ok(Some(SipAnswer {
        code,
        load: msg.header(LOAD_HEADER).and_then(parse_load),
        retry_after_s: msg
            .header(RETRY_AFTER_HEADER)
            .and_then(crate::sip::parse_retry_after),
    }))
}

/// Is `code` acceptable? Empty `expect` = `default` rule (http monitors).
pub fn status_ok(code: u16, expect: &[u16], default: impl Fn(u16) -> bool) -> bool {
    if expect.is_empty() {
        default(code)
    } else {
        expect.contains(&code)
    }
}

/// A load value: a decimal integer, surrounding whitespace ignored.
pub fn parse_load(v: &[u8]) -> Option<u32> {
    std::str::from_utf8(trim(v)).ok()?.parse().ok()
}

/// Load from an http monitor body: its first line.
pub fn body_load(body: &[u8]) -> Option<u32> {
    let line = body.split(|&b| b == b'\n').next()?;
    parse_load(line)
}

fn trim(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &v[start..end]
}

/// `GET path` toward `target`, closing after the response.
pub fn build_http_get(target: SocketAddr, path: &str) -> Vec<u8> {
    format!(
        "GET {path} HTTP/1.1\r\nHost: {target}\r\nUser-Agent: fulcrum-monitor\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    )
    .into_bytes()
}

/// Status and body of a complete HTTP response in `buf`, `Ok(None)` when more bytes are needed.
pub fn http_response(buf: &[u8], eof: bool) -> Result<Option<(u16, &[u8])>, ProbeError> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => {
            let code = resp.code.ok_or(ProbeError::BadReply)?;
            let len = resp
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                .and_then(|h| std::str::from_utf8(h.value).ok())
                .and_then(|v| v.trim().parse::<usize>().ok());
            let body = &buf[n..];
            let chunked = resp.headers.iter().any(|h| {
                h.name.eq_ignore_ascii_case("transfer-encoding")
                    && std::str::from_utf8(h.value)
                        .is_ok_and(|v| v.to_ascii_lowercase().contains("chunked"))
            });
            if chunked {
                // The load is read from the body's first line: its first chunk's data is
                // enough (RFC 9112 §7.1), and the chunk-size line must not pass for it.
                return match first_chunk(body) {
                    Some(data) => Ok(Some((code, data))),
                    None if !eof => Ok(None),
                    None => Ok(Some((code, &body[..0]))),
                };
            }
            match len {
                Some(l) if body.len() >= l => Ok(Some((code, &body[..l]))),
                Some(_) if !eof => Ok(None),
                None if !eof => Ok(None),
                _ => Ok(Some((code, body))),
            }
        }
        Ok(httparse::Status::Partial) if !eof => Ok(None),
        _ => Err(ProbeError::BadReply),
    }
}

/// The data of the first chunk of a chunked body, once it is complete (`hex-size[;ext] CRLF
/// data CRLF`); `None` while incomplete or when the size line is not one.
fn first_chunk(body: &[u8]) -> Option<&[u8]> {
    let eol = memchr::memchr(b'\n', body)?;
    let line = body[..eol].strip_suffix(b"\r").unwrap_or(&body[..eol]);
    let size = line.split(|&b| b == b';').next().map(trim)?;
    let size = usize::from_str_radix(std::str::from_utf8(size).ok()?, 16).ok()?;
    let data = body.get(eol + 1..)?;
    data.get(..size).filter(|_| data.len() >= size + 2)
}

fn unspecified_for(addr: SocketAddr) -> SocketAddr {
    if addr.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], 0))
    } else {
        SocketAddr::from(([0u16; 8], 0))
    }
}

fn micros(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Run one probe of `kind` against a service at `target` speaking `protocol`, bounded by
/// `timeout`.
pub async fn probe(
    kind: &MonitorKind,
    target: SocketAddr,
    protocol: Protocol,
    timeout: Duration,
) -> Result<ProbeReply, ProbeError> {
    probe_tls(kind, target, protocol, None, timeout).await
}

/// [`probe`] toward a service reached over TLS when `tls` is given (a sip-tls service:
/// the OPTIONS goes over TLS, its handshake inside `timeout`).
pub async fn probe_tls(
    kind: &MonitorKind,
    target: SocketAddr,
    protocol: Protocol,
    tls: Option<&ClientTls>,
    timeout: Duration,
) -> Result<ProbeReply, ProbeError> {
    probe_captured(kind, target, protocol, tls, timeout, Tap(None)).await
}

/// [`probe_tls`], its SIP messages (the OPTIONS and what the service answers) shown to
/// `capture`, which keeps them when its `probes` is on (docs/capture.md).
pub async fn probe_captured(
    kind: &MonitorKind,
    target: SocketAddr,
    protocol: Protocol,
    tls: Option<&ClientTls>,
    timeout: Duration,
    capture: Tap<'_>,
) -> Result<ProbeReply, ProbeError> {
    let inner = probe_inner(kind, target, protocol, tls, timeout, capture);
    match tokio::time::timeout(timeout, inner).await {
        Ok(r) => r,
        Err(_) => Err(ProbeError::Timeout),
    }
}

/// Where a probe shows its SIP messages: capture, or nowhere.
#[derive(Debug, Clone, Copy)]
pub struct Tap<'a>(pub Option<&'a crate::capture::Capture>);

impl Tap<'_> {
    /// A SIP message the probe sent or received on `transport` from `src` to `dst`.
    fn tap(self, transport: crate::capture::Transport, src: SocketAddr, dst: SocketAddr, m: &[u8]) {
        if let Some(c) = self.0 {
            c.tap_probe(crate::capture::Stamp::now(), transport, src, dst, m);
        }
    }
}

async fn probe_inner(
    kind: &MonitorKind,
    target: SocketAddr,
    protocol: Protocol,
    tls: Option<&ClientTls>,
    timeout: Duration,
    capture: Tap<'_>,
) -> Result<ProbeReply, ProbeError> {
    match kind {
        MonitorKind::SipOptions { expect_codes } => {
            let (a, rtt_us) = match (protocol, tls) {
                (Protocol::SipTls, Some(tls)) => sip_tls(target, tls, capture).await?,
                (Protocol::SipTls, None) => return Err(ProbeError::NoTls),
                (Protocol::SipTcp | Protocol::Tcp, _) => sip_tcp(target, capture).await?,
                _ => sip_udp(target, timeout, capture).await?,
            };
            match answer::judge(a.code, a.retry_after_s, expect_codes) {
                Outcome::Alive => Ok(ProbeReply {
                    rtt_us,
                    status: Some(a.code),
                    load: a.load,
                }),
                Outcome::Dead => Err(ProbeError::UnexpectedStatus(a.code)),
                Outcome::Unavailable { retry_after_s } => Err(ProbeError::RetryAfter {
                    code: a.code,
                    retry_after_s,
                }),
            }
        }
        MonitorKind::TcpConnect => {
            let start = Instant::now();
            let _s = TcpStream::connect(target).await?;
            Ok(ProbeReply {
                rtt_us: micros(start),
                status: None,
                load: None,
            })
        }
        MonitorKind::Udp { send, expect } => {
            let sock = UdpSocket::bind(unspecified_for(target)).await?;
            sock.connect(target).await?;
            let start = Instant::now();
            sock.send(send).await?;
            let mut buf = vec![0u8; MAX_REPLY];
            // A connected socket reports ICMP port unreachable as ECONNREFUSED here.
            let n = sock.recv(&mut buf).await?;
            let rtt_us = micros(start);
            match expect {
                Some(e) if !contains(&buf[..n], e) => Err(ProbeError::Mismatch),
                _ => Ok(ProbeReply {
                    rtt_us,
                    status: None,
                    load: None,
                }),
            }
        }
        MonitorKind::Icmp => {
            let seq = SEQ.fetch_add(1, Ordering::Relaxed);
            // A nonce no other process or probe shares; the sequence number alone would
            // repeat across instances probing the same firewall from one host.
            let nonce = {
                use std::hash::{BuildHasher, Hasher};
                let mut h = std::collections::hash_map::RandomState::new().build_hasher();
                h.write_u64(seq);
                h.finish()
            };
            super::icmp::ping(target.ip(), seq as u16, nonce).await
        }
        MonitorKind::Http { path, expect_codes } => {
            let start = Instant::now();
            let s = TcpStream::connect(target).await?;
            // A service with `tls` is asked over TLS (the handshake counts in the round trip).
            match tls {
                Some(tls) => {
                    http_get(tls_over(s, tls).await?, target, path, expect_codes, start).await
                }
                None => http_get(s, target, path, expect_codes, start).await,
            }
        }
    }
}

/// GET `path` on `s` and judge the answer by `expect_codes` (200 when empty).
async fn http_get<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    target: SocketAddr,
    path: &str,
    expect_codes: &[u16],
    start: Instant,
) -> Result<ProbeReply, ProbeError> {
    s.write_all(&build_http_get(target, path)).await?;
    s.flush().await?;
    let mut buf = Vec::with_capacity(4096);
    loop {
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await?;
        buf.extend_from_slice(&chunk[..n]);
        let eof = n == 0 || buf.len() >= MAX_REPLY;
        match http_response(&buf, eof) {
            Ok(Some((code, body))) => {
                let rtt_us = micros(start);
                return if status_ok(code, expect_codes, |c| c == 200) {
                    Ok(ProbeReply {
                        rtt_us,
                        status: Some(code),
                        load: body_load(body),
                    })
                } else {
                    Err(ProbeError::UnexpectedStatus(code))
                };
            }
            Ok(None) => {}
            Err(_) if buf.is_empty() => return Err(ProbeError::Closed),
            Err(e) => return Err(e),
        }
    }
}

/// The TLS handshake toward a service on `s`, with its `tls`.
async fn tls_over(
    s: TcpStream,
    tls: &ClientTls,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, ProbeError> {
    tokio_rustls::TlsConnector::from(Arc::clone(&tls.config))
        .connect(tls.server_name.clone(), s)
        .await
        .map_err(|e| ProbeError::Tls(crate::tls::Reason::of(&e).name()))
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || memchr::memmem::find(hay, needle).is_some()
}

fn call_id_of(seq: u64) -> Vec<u8> {
    format!("fmon-{seq:x}@fulcrum").into_bytes()
}

/// The first retransmission interval of a probe's OPTIONS over UDP bounded by `timeout`:
/// T1 (RFC 3261 §17.1.1.1, 500 ms), or a quarter of the timeout when that is shorter, so that
/// a probe gets two copies after the first however short its timeout. An operator who sets a
/// timeout below T1 says the services answer within it (§17.1.1.1 allows a smaller T1 on a
/// closed network); one lost datagram then no longer fails the probe.
pub fn options_retransmit_first(timeout: Duration) -> Duration {
    const T1: Duration = Duration::from_millis(500);
    T1.min(timeout / 4).max(Duration::from_millis(10))
}

/// RFC 3261 §17.1.2.2: Timer E doubles up to T2 (4 s).
fn options_retransmit_next(interval: Duration) -> Duration {
    (interval * 2).min(Duration::from_secs(4))
}

async fn sip_udp(
    target: SocketAddr,
    timeout: Duration,
    capture: Tap<'_>,
) -> Result<(SipAnswer, u64), ProbeError> {
    use crate::capture::Transport::Udp;
    let sock = UdpSocket::bind(unspecified_for(target)).await?;
    sock.connect(target).await?;
    // Connected: the kernel has chosen the source address.
    let local = sock.local_addr()?;
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let start = Instant::now();
    let options = build_options(target, local, "UDP", seq);
    capture.tap(Udp, local, target, &options);
    sock.send(&options).await?;
    let call_id = call_id_of(seq);
    let mut buf = vec![0u8; MAX_REPLY];
    // An OPTIONS is a non-INVITE client transaction: over UDP it is retransmitted on Timer E
    // until its answer (the caller's timeout ends the probe).
    let mut interval = options_retransmit_first(timeout);
    let mut again = tokio::time::Instant::now() + interval;
    loop {
        tokio::select! {
            r = sock.recv(&mut buf) => {
                let n = r?;
                if crate::sip::scan(&buf[..n]).is_ok() {
                    capture.tap(Udp, target, local, &buf[..n]);
                }
                if let Ok(Some(a)) = sip_final_status(&buf[..n], &call_id) {
                    return Ok((a, micros(start)));
                }
            }
            () = tokio::time::sleep_until(again) => {
                capture.tap(Udp, local, target, &options);
                sock.send(&options).await?;
                interval = options_retransmit_next(interval);
                again += interval;
            }
        }
    }
}

async fn sip_tcp(target: SocketAddr, capture: Tap<'_>) -> Result<(SipAnswer, u64), ProbeError> {
    let start = Instant::now();
    let s = TcpStream::connect(target).await?;
    let local = s.local_addr()?;
    sip_stream(s, target, local, "TCP", start, capture).await
}

/// OPTIONS over TLS: the TCP connect and the handshake are part of the round trip, as the
/// TCP connect is for [`sip_tcp`].
async fn sip_tls(
    target: SocketAddr,
    tls: &ClientTls,
    capture: Tap<'_>,
) -> Result<(SipAnswer, u64), ProbeError> {
    let start = Instant::now();
    let s = TcpStream::connect(target).await?;
    let local = s.local_addr()?;
    let s = tls_over(s, tls).await?;
    sip_stream(s, target, local, "TLS", start, capture).await
}

async fn sip_stream<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    target: SocketAddr,
    local: SocketAddr,
    transport: &str,
    start: Instant,
    capture: Tap<'_>,
) -> Result<(SipAnswer, u64), ProbeError> {
    use crate::capture::Transport::Tcp;
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let options = build_options(target, local, transport, seq);
    capture.tap(Tcp, local, target, &options);
    s.write_all(&options).await?;
    // A TLS stream may hold what the socket did not take until flushed.
    s.flush().await?;
    let call_id = call_id_of(seq);
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    loop {
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(ProbeError::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
        loop {
            match framing::next_frame(&buf, framing::DEFAULT_MAX_MESSAGE) {
                Ok(frame) => {
                    let len = frame.len();
                    if let Frame::Message { .. } = frame {
                        capture.tap(Tcp, target, local, &buf[..len]);
                        match sip_final_status(&buf[..len], &call_id) {
                            Ok(Some(a)) => return Ok((a, micros(start))),
                            Ok(None) => {}
                            Err(e) => return Err(e),
                        }
                    }
                    buf.drain(..len);
                }
                Err(framing::FrameError::Incomplete) => break,
                Err(_) => return Err(ProbeError::BadReply),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_scans_and_matches_its_response() {
        let t: SocketAddr = "127.0.0.1:5071".parse().unwrap();
        let l: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let req = build_options(t, l, "UDP", 7);
        let msg = crate::sip::scan(&req).unwrap();
        assert_eq!(msg.method(), Some(&b"OPTIONS"[..]));
        let cid = call_id_of(7);
        let resp = format!(
            "SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP {l};branch=z9hG4bK-fmon-7\r\nCall-ID: fmon-7@fulcrum\r\nCSeq: 1 OPTIONS\r\nX-Load: 42\r\nContent-Length: 0\r\n\r\n"
        );
        assert_eq!(
            sip_final_status(resp.as_bytes(), &cid).ok(),
            Some(Some(SipAnswer {
                code: 200,
                load: Some(42),
                retry_after_s: None
            }))
        );
        let busy = resp
            .replace("200 OK", "503 Service Unavailable")
            .replace("X-Load: 42", "retry-after: 120 (maintenance);duration=60");
        assert_eq!(
            sip_final_status(busy.as_bytes(), &cid).ok(),
            Some(Some(SipAnswer {
                code: 503,
                load: None,
                retry_after_s: Some(120)
            }))
        );
        let prov = resp.replace("200 OK", "100 Trying");
        assert_eq!(sip_final_status(prov.as_bytes(), &cid).ok(), Some(None));
        assert_eq!(sip_final_status(resp.as_bytes(), b"other").ok(), Some(None));
        assert!(sip_final_status(b"garbage", &cid).is_err());
    }

    #[test]
    fn verdicts() {
        let held = ProbeError::RetryAfter {
            code: 503,
            retry_after_s: 7,
        };
        assert_eq!(held.outcome(), Outcome::Unavailable { retry_after_s: 7 });
        assert_eq!(ProbeError::UnexpectedStatus(503).outcome(), Outcome::Dead);
        assert_eq!(ProbeError::Timeout.outcome(), Outcome::Dead);
        // fulcrum's own trouble, not the service's.
        let os = |e: nix::errno::Errno| ProbeError::Io(std::io::Error::from_raw_os_error(e as i32));
        use nix::errno::Errno::*;
        for local in [EMFILE, ENFILE, ENOBUFS, ENOMEM, EADDRNOTAVAIL] {
            assert!(os(local).is_local(), "{local}");
        }
        for theirs in [ECONNREFUSED, ECONNRESET, EHOSTUNREACH] {
            assert!(!os(theirs).is_local(), "{theirs}");
        }
        assert!(!ProbeError::Timeout.is_local());
        assert!(!ProbeError::Passive.is_local());
        assert!(status_ok(200, &[], |c| c == 200));
        assert!(!status_ok(404, &[], |c| c == 200));
        assert_eq!(body_load(b" 17 \nrest"), Some(17));
        assert_eq!(body_load(b"busy"), None);
    }

    #[test]
    fn http_framing() {
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n12\n";
        assert_eq!(
            http_response(r, false).ok(),
            Some(Some((200, &b"12\n"[..])))
        );
        assert_eq!(http_response(&r[..20], false).ok(), Some(None));
        let no_len = b"HTTP/1.0 503 Busy\r\n\r\nxx";
        assert_eq!(http_response(no_len, false).ok(), Some(None));
        assert_eq!(
            http_response(no_len, true).ok(),
            Some(Some((503, &b"xx"[..])))
        );
        assert!(http_response(b"nonsense\r\n\r\n", true).is_err());
        // A chunked body: the load is in the chunk's data, not its size line (0x4 bytes here).
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n250\n\r\n0\r\n\r\n";
        let (code, body) = http_response(chunked, false)
            .ok()
            .flatten()
            .expect("complete");
        assert_eq!((code, body), (200, &b"250\n"[..]));
        assert_eq!(body_load(body), Some(250));
        assert_eq!(http_response(&chunked[..52], false).ok(), Some(None));
        assert_eq!(
            http_response(&chunked[..52], true).ok(),
            Some(Some((200, &b""[..])))
        );
    }
}
