//! Minimal SIP user agents over UDP for `fulcrum demo` and the socket tests. IO.
//!
//! The UAS answers like a callee: INVITE → 180 + 200 (with a to-tag), BYE / OPTIONS /
//! CANCEL / REGISTER → 200, ACK → nothing, and records every message per Call-ID so tests
//! can check affinity. Switched sick ([`Uas::set_sick`]) it answers INVITEs 503 with
//! Retry-After and everything else as before: an overloaded server whose keep-alive still
//! looks fine. The UAC places whole calls (INVITE, 200, ACK, BYE, 200), telling a call never
//! set up from one set up and then cut. They use fulcrum's own scanner and reply builder,
//! which are tested against rsip elsewhere.

use crate::sip::{self, Reply, SipMethod, SipMsg};
use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Every value of header `name` (compared ASCII case-insensitively; no compact forms) in the
/// header section of SIP message text `msg`, in order, comma-separated values split: what a
/// test peer needs to copy Vias or reverse a Record-Route (their values hold no commas).
pub fn header_values(msg: &str, name: &str) -> Vec<String> {
    let head = msg.split("\r\n\r\n").next().unwrap_or("");
    head.lines()
        .filter_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
        .flat_map(|v| v.split(',').map(|x| x.trim().to_owned()))
        .collect()
}

/// The first value of header `name` ([`header_values`]), or "".
pub fn first_header(msg: &str, name: &str) -> String {
    header_values(msg, name)
        .into_iter()
        .next()
        .unwrap_or_default()
}

/// What a UAS has seen.
#[derive(Debug, Default)]
pub struct UasLog {
    /// Call-ID → methods received, in order.
    pub calls: Mutex<HashMap<String, Vec<String>>>,
    /// INVITEs received, answered or refused.
    pub invites: AtomicU64,
    /// INVITEs refused 503 while sick.
    pub refused: AtomicU64,
    pub messages: AtomicU64,
}

impl UasLog {
    pub fn call_ids(&self) -> Vec<String> {
        self.calls
            .lock()
            .map(|c| c.keys().cloned().collect())
            .unwrap_or_default()
    }

    pub fn methods_of(&self, call_id: &str) -> Vec<String> {
        self.calls
            .lock()
            .ok()
            .and_then(|c| c.get(call_id).cloned())
            .unwrap_or_default()
    }
}

/// A running UAS.
pub struct Uas {
    pub addr: SocketAddr,
    pub log: Arc<UasLog>,
    stop: Arc<AtomicBool>,
    /// 0 while healthy, else the Retry-After seconds of its 503s plus one.
    sick: Arc<AtomicU64>,
    /// A clone of the socket, to end the thread's blocking receive on [`Uas::stop`].
    wake: Option<UdpSocket>,
    thread: Option<JoinHandle<()>>,
}

impl Uas {
    /// Start a UAS on `bind` (port 0 for any).
    pub fn start(bind: SocketAddr) -> io::Result<Uas> {
        let socket = UdpSocket::bind(bind)?;
        let wake = socket.try_clone()?;
        let addr = socket.local_addr()?;
        let log = Arc::new(UasLog::default());
        let stop = Arc::new(AtomicBool::new(false));
        let sick = Arc::new(AtomicU64::new(0));
        let (log2, stop2, sick2) = (Arc::clone(&log), Arc::clone(&stop), Arc::clone(&sick));
        let thread = std::thread::Builder::new()
            .name(format!("uas-{}", addr.port()))
            .spawn(move || uas_loop(&socket, &log2, &stop2, &sick2))?;
        Ok(Uas {
            addr,
            log,
            stop,
            sick,
            wake: Some(wake),
            thread: Some(thread),
        })
    }

    /// Start again on the same address after [`Uas::stop`] (or at once, stopping first),
    /// keeping its log and its sick mode: a service that restarts.
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop();
        let socket = UdpSocket::bind(self.addr)?;
        let wake = socket.try_clone()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (log, stop2, sick) = (
            Arc::clone(&self.log),
            Arc::clone(&stop),
            Arc::clone(&self.sick),
        );
        let thread = std::thread::Builder::new()
            .name(format!("uas-{}", self.addr.port()))
            .spawn(move || uas_loop(&socket, &log, &stop2, &sick))?;
        self.stop = stop;
        self.wake = Some(wake);
        self.thread = Some(thread);
        Ok(())
    }

    /// Turn sick (`Some(retry_after_s)`): answer every INVITE 503 Service Unavailable with
    /// `Retry-After: retry_after_s` (RFC 3261 §21.5.4, §20.33) while OPTIONS, BYE and the rest
    /// still get 200, so a sip-options monitor keeps it UP. `None`: answer normally again.
    pub fn set_sick(&self, retry_after_s: Option<u32>) {
        let v = retry_after_s.map_or(0, |s| u64::from(s) + 1);
        self.sick.store(v, Ordering::Relaxed);
    }

    /// Whether INVITEs are refused now ([`Uas::set_sick`]).
    pub fn is_sick(&self) -> bool {
        self.sick.load(Ordering::Relaxed) != 0
    }

    /// Stop answering (the socket closes: later datagrams get ICMP port unreachable).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the blocking receive (Linux does so on an unconnected UDP socket too, and
        // reports ENOTCONN); the clone then closes, so the socket closes with the thread.
        if let Some(s) = self.wake.take() {
            let _ = socket2::SockRef::from(&s).shutdown(std::net::Shutdown::Read);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Uas {
    fn drop(&mut self) {
        self.stop();
    }
}

fn uas_loop(socket: &UdpSocket, log: &UasLog, stop: &AtomicBool, sick: &AtomicU64) {
    let mut buf = vec![0u8; 65_536];
    let mut out = Vec::with_capacity(2048);
    while !stop.load(Ordering::Acquire) {
        // A shutdown wakes this receive with `SHUT_RD` (no sender): see `net::recv_from`.
        let Ok((n, Some(src))) = crate::net::recv_from(socket, &mut buf) else {
            continue;
        };
        let Ok(msg) = sip::scan(&buf[..n]) else {
            continue;
        };
        if !msg.is_request() {
            continue;
        }
        log.messages.fetch_add(1, Ordering::Relaxed);
        let method = String::from_utf8_lossy(msg.method().unwrap_or(b"?")).into_owned();
        if let Some(cid) = msg.call_id()
            && let Ok(mut calls) = log.calls.lock()
        {
            calls
                .entry(String::from_utf8_lossy(cid).into_owned())
                .or_default()
                .push(method);
        }
        let kind = msg.method_kind();
        if kind == SipMethod::Ack {
            continue;
        }
        if kind == SipMethod::Invite {
            log.invites.fetch_add(1, Ordering::Relaxed);
            out.clear();
            let retry_after = sick.load(Ordering::Relaxed);
            if retry_after != 0 {
                log.refused.fetch_add(1, Ordering::Relaxed);
                let s = u32::try_from(retry_after - 1).unwrap_or(u32::MAX);
                if sip::build_response(&msg, &Reply::service_unavailable(s), &mut out).is_ok() {
                    let _ = socket.send_to(&out, src);
                }
                continue;
            }
            let ringing = Reply {
                code: 180,
                reason: "Ringing",
                retry_after_s: None,
            };
            if sip::build_response(&msg, &ringing, &mut out).is_ok() {
                let _ = socket.send_to(&out, src);
            }
        }
        out.clear();
        let ok = Reply {
            code: 200,
            reason: "OK",
            retry_after_s: None,
        };
        if sip::build_response(&msg, &ok, &mut out).is_ok() {
            let _ = socket.send_to(&out, src);
        }
    }
}

/// Why a call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    Timeout(&'static str),
    Status(u16),
    Io(String),
    /// The call was set up (its INVITE answered 200, the ACK sent) and then lost: its BYE
    /// failed so. The service that took the call went away under it.
    Cut(Box<CallError>),
}

impl CallError {
    /// Whether the call was set up before it failed ([`CallError::Cut`]).
    pub fn is_cut(&self) -> bool {
        matches!(self, CallError::Cut(_))
    }
}

/// A UAC placing calls through `proxy` from its own socket.
pub struct Uac {
    socket: UdpSocket,
    local: SocketAddr,
    proxy: SocketAddr,
    seq: u64,
    tag: String,
    buf: Vec<u8>,
}

impl Uac {
    pub fn new(bind: SocketAddr, proxy: SocketAddr, tag: &str) -> io::Result<Uac> {
        let socket = UdpSocket::bind(bind)?;
        let local = socket.local_addr()?;
        Ok(Uac {
            socket,
            local,
            proxy,
            seq: 0,
            tag: tag.to_owned(),
            buf: vec![0u8; 65_536],
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn host(&self) -> String {
        match self.local {
            SocketAddr::V4(a) => a.to_string(),
            SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
        }
    }

    /// A request from this UAC (Via with rport, CRLF line ends, Content-Length: 0).
    pub fn request(
        &self,
        method: &str,
        call_id: &str,
        cseq: u32,
        branch: &str,
        to_tag: Option<&str>,
    ) -> String {
        let host = self.host();
        let to_tag = to_tag.map(|t| format!(";tag={t}")).unwrap_or_default();
        format!(
            "{method} sip:service@fulcrum SIP/2.0\r\n\
             Via: SIP/2.0/UDP {host};branch=z9hG4bK{branch};rport\r\n\
             Max-Forwards: 70\r\n\
             From: <sip:{tag}@client>;tag={tag}\r\n\
             To: <sip:service@fulcrum>{to_tag}\r\n\
             Call-ID: {call_id}\r\n\
             CSeq: {cseq} {method}\r\n\
             Contact: <sip:{tag}@{host}>\r\n\
             Content-Length: 0\r\n\r\n",
            tag = self.tag
        )
    }

    pub fn send_raw(&self, bytes: &[u8]) -> io::Result<()> {
        self.socket.send_to(bytes, self.proxy).map(|_| ())
    }

    /// Wait for the next final (>= 200) response, up to `timeout`. Returns status and the
    /// To header value (with the callee's tag).
    pub fn final_response(
        &mut self,
        timeout: Duration,
    ) -> Result<(u16, String, Vec<u8>), CallError> {
        self.final_response_matching(timeout, |_| true)
    }

    /// Wait for the final response to this UAC's `method` request of Call-ID `call_id`, up to
    /// `timeout`, passing over any other (a late answer to an earlier call given up on).
    pub fn final_response_to(
        &mut self,
        call_id: &str,
        method: &str,
        timeout: Duration,
    ) -> Result<(u16, String, Vec<u8>), CallError> {
        self.final_response_matching(timeout, |msg| {
            msg.call_id() == Some(call_id.as_bytes())
                && msg.cseq().is_some_and(|c| c.method == method.as_bytes())
        })
    }

    fn final_response_matching(
        &mut self,
        timeout: Duration,
        is_wanted: impl Fn(&SipMsg<'_>) -> bool,
    ) -> Result<(u16, String, Vec<u8>), CallError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CallError::Timeout("final response"));
            }
            self.socket
                .set_read_timeout(Some(left))
                .map_err(|e| CallError::Io(e.to_string()))?;
            let n = match self.socket.recv_from(&mut self.buf) {
                Ok((n, _)) => n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(CallError::Timeout("final response"));
                }
                Err(e) => return Err(CallError::Io(e.to_string())),
            };
            let Ok(msg) = sip::scan(&self.buf[..n]) else {
                continue;
            };
            match msg.status_code() {
                Some(code) if code >= 200 && is_wanted(&msg) => {
                    let to = String::from_utf8_lossy(msg.to_header().unwrap_or(b"")).into_owned();
                    return Ok((code, to, self.buf[..n].to_vec()));
                }
                _ => continue,
            }
        }
    }

    /// One complete call: INVITE → 200 → ACK → BYE → 200, waiting up to `timeout` for each
    /// final answer. Returns the Call-ID; a call that fails after its 200 is
    /// [`CallError::Cut`].
    pub fn call(&mut self, timeout: Duration) -> Result<String, CallError> {
        self.seq += 1;
        let call_id = format!("{}-{}@fulcrum-demo", self.tag, self.seq);
        let invite = self.request(
            "INVITE",
            &call_id,
            1,
            &format!("{}i{}", self.tag, self.seq),
            None,
        );
        self.send_raw(invite.as_bytes())
            .map_err(|e| CallError::Io(e.to_string()))?;
        let (code, to, _) = self.final_response_to(&call_id, "INVITE", timeout)?;
        if code != 200 {
            return Err(CallError::Status(code));
        }
        let to_tag = to
            .split(";tag=")
            .nth(1)
            .map(|t| t.split(';').next().unwrap_or(t).to_owned());
        let ack = self.request(
            "ACK",
            &call_id,
            1,
            &format!("{}a{}", self.tag, self.seq),
            to_tag.as_deref(),
        );
        self.send_raw(ack.as_bytes())
            .map_err(|e| CallError::Io(e.to_string()))?;
        let bye = self.request(
            "BYE",
            &call_id,
            2,
            &format!("{}b{}", self.tag, self.seq),
            to_tag.as_deref(),
        );
        let cut = |e: CallError| CallError::Cut(Box::new(e));
        self.send_raw(bye.as_bytes())
            .map_err(|e| cut(CallError::Io(e.to_string())))?;
        let (code, _, _) = self
            .final_response_to(&call_id, "BYE", timeout)
            .map_err(cut)?;
        if code != 200 {
            return Err(cut(CallError::Status(code)));
        }
        Ok(call_id)
    }
}
