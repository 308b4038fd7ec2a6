//! The `sip-udp` vserver: a stateless SIP proxy (RFC 3261 §16.11, RFC 3581).
//!
//! [`SipUdpCore::handle`] is the whole per-datagram decision and rewrite: bytes, source,
//! destination and `now` in; an [`Action`] and the bytes to send out. It touches no socket,
//! so it is tested without one. [`run_worker`] is the IO loop around it: one blocking
//! SO_REUSEPORT socket per worker thread, receive → handle → send from the same socket.
//! Because the kernel keeps each 4-tuple on one socket and each worker sends in the order
//! it received, the messages of one call leave fulcrum in the order they arrived.

use crate::balancer::{Balancer, KeyInput};
use crate::config::{HashParams, Method};
use crate::dialog::{DialogTable, Pin};
use crate::hash;
use crate::key::{self, KeyOutcome, Payload, RequestCtx};
use crate::sip::{
    self, Local, Reply, RequestRewrite, RewriteError, SipMethod, SipMsg, build_response,
    forward_request, forward_response, reply_target, request_target,
};
use crate::stats::Nanos;
use arc_swap::ArcSwap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Retry-After of fulcrum's 503 (RFC 3261 §21.5.4): long enough for a monitor to bring a
/// service back, short enough that clients do not give up on the vserver.
pub const RETRY_AFTER_S: u32 = 5;

/// Why a datagram was not forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Not a SIP message, or one too broken to answer.
    Malformed,
    /// A response whose top Via is not fulcrum's.
    NotOurs,
    /// Next hop is fulcrum itself.
    Loop,
    /// Next hop is a name (fulcrum does not resolve DNS on the data path) or missing.
    Unroutable,
    /// An ACK that could not be forwarded (ACKs are never answered).
    AckNotForwarded,
}

/// What to do with the bytes written to `out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Send `out` to this address (a request forwarded to a service, a response forwarded
    /// to a client, or fulcrum's own reply).
    Send(SocketAddr),
    Drop(DropReason),
}

/// Counters of one sip-udp vserver (all workers).
#[derive(Debug, Default)]
pub struct SipCounters {
    pub requests_in: AtomicU64,
    pub responses_in: AtomicU64,
    pub requests_forwarded: AtomicU64,
    pub responses_forwarded: AtomicU64,
    pub in_dialog_from_services: AtomicU64,
    pub replies_400: AtomicU64,
    pub replies_483: AtomicU64,
    pub replies_503: AtomicU64,
    pub malformed: AtomicU64,
    pub not_ours: AtomicU64,
    pub loops: AtomicU64,
    pub unroutable: AtomicU64,
    pub send_errors: AtomicU64,
    pub recv_errors: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Shared, immutable-after-build state of one sip-udp vserver.
pub struct SipUdpCore {
    pub name: String,
    local: Local,
    record_route: bool,
    method: Method,
    hash_params: HashParams,
    balancer: Arc<Balancer>,
    dialogs: DialogTable,
    /// Address of each member (index = member index).
    member_addrs: Vec<SocketAddr>,
    pub counters: SipCounters,
}

impl std::fmt::Debug for SipUdpCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SipUdpCore")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Everything a sip-udp vserver needs to decide.
pub struct SipUdpParams {
    pub name: String,
    pub local: Local,
    pub record_route: bool,
    pub method: Method,
    pub hash_params: HashParams,
    pub balancer: Arc<Balancer>,
    pub member_addrs: Vec<SocketAddr>,
    pub max_dialogs: usize,
    pub dialog_idle: Duration,
}

impl SipUdpCore {
    pub fn new(p: SipUdpParams) -> SipUdpCore {
        SipUdpCore {
            name: p.name,
            local: p.local,
            record_route: p.record_route,
            method: p.method,
            hash_params: p.hash_params,
            balancer: p.balancer,
            dialogs: DialogTable::new(
                p.max_dialogs,
                u64::try_from(p.dialog_idle.as_millis()).unwrap_or(u64::MAX),
            ),
            member_addrs: p.member_addrs,
            counters: SipCounters::default(),
        }
    }

    pub fn balancer(&self) -> &Arc<Balancer> {
        &self.balancer
    }

    pub fn dialogs(&self) -> &DialogTable {
        &self.dialogs
    }

    pub fn local(&self) -> &Local {
        &self.local
    }

    /// Expire idle dialogs; each expired dialog stops counting toward its member's load.
    pub fn sweep(&self, now: Nanos) -> usize {
        let balancer = &self.balancer;
        self.dialogs.sweep(now / 1_000_000, |member| {
            if let Some(c) = balancer.counters(member as usize) {
                c.close();
            }
        })
    }

    fn member_of(&self, src: SocketAddr) -> Option<usize> {
        let src = SocketAddr::new(src.ip().to_canonical(), src.port());
        self.member_addrs.iter().position(|a| *a == src)
    }

    /// Decide and rewrite one datagram received from `src` on local address `dst`.
    pub fn handle(
        &self,
        buf: &[u8],
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
    ) -> Action {
        out.clear();
        let msg = match sip::scan(buf) {
            Ok(m) => m,
            Err(_) => {
                bump(&self.counters.malformed);
                return Action::Drop(DropReason::Malformed);
            }
        };
        if msg.is_request() {
            bump(&self.counters.requests_in);
            match self.member_of(src) {
                Some(_) => self.request_from_service(&msg, src, out),
                None => self.request_from_client(&msg, src, dst, now, out),
            }
        } else {
            bump(&self.counters.responses_in);
            self.response(&msg, out)
        }
    }

    /// A stateless reply to the request's sender (RFC 3261 §8.2.6, RFC 3581 §4).
    fn reply(
        &self,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        reply: &Reply<'_>,
        out: &mut Vec<u8>,
    ) -> Action {
        out.clear();
        match build_response(msg, reply, out) {
            Ok(()) => Action::Send(reply_target(msg, src)),
            Err(RewriteError::AckNotAnswered) => Action::Drop(DropReason::AckNotForwarded),
            Err(_) => {
                bump(&self.counters.malformed);
                Action::Drop(DropReason::Malformed)
            }
        }
    }

    fn request_from_client(
        &self,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
    ) -> Action {
        if msg.missing_mandatory().is_some() {
            bump(&self.counters.replies_400);
            return self.reply(msg, src, &Reply::BAD_REQUEST, out);
        }
        // Max-Forwards first: a looping request must not pin a dialog or take a slot.
        if msg.max_forwards() == Some(Some(0)) {
            bump(&self.counters.replies_483);
            return self.reply(msg, src, &Reply::TOO_MANY_HOPS, out);
        }
        let Some(member) = self.choose(msg, src, dst, now) else {
            bump(&self.counters.replies_503);
            return self.reply(msg, src, &Reply::service_unavailable(RETRY_AFTER_S), out);
        };
        let Some(&target) = self.member_addrs.get(member) else {
            return Action::Drop(DropReason::Unroutable);
        };
        let rw = RequestRewrite {
            local: &self.local,
            src,
            record_route: self.record_route,
            force_rport: false,
            conn_id: None,
        };
        match forward_request(msg, &rw, out) {
            Ok(_) => {
                bump(&self.counters.requests_forwarded);
                if let Some(c) = self.balancer.counters(member) {
                    c.record_request();
                }
                Action::Send(target)
            }
            Err(RewriteError::TooManyHops) => {
                bump(&self.counters.replies_483);
                self.reply(msg, src, &Reply::TOO_MANY_HOPS, out)
            }
            Err(_) => {
                bump(&self.counters.replies_400);
                self.reply(msg, src, &Reply::BAD_REQUEST, out)
            }
        }
    }

    /// Dialog affinity first (an established call stays on its member while it is UP or
    /// draining OUT_OF_SERVICE), else the
    /// vserver's method. The dialog is pinned to whatever was chosen.
    fn choose(
        &self,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
    ) -> Option<usize> {
        let now_ms = now / 1_000_000;
        let call_hash = msg.call_id().map(|c| hash::key_hash(sip_trim(c)));
        if let Some(h) = call_hash
            && let Some(m) = self.dialogs.get(h, now_ms)
            && self.balancer.accepts_existing(m as usize)
        {
            self.balancer.count_affinity();
            // BYE / CANCEL end the dialog: its member stops counting it as load.
            if matches!(msg.method_kind(), SipMethod::Bye | SipMethod::Cancel)
                && let Some(member) = self.dialogs.end(h, now_ms)
            {
                self.close(member);
            }
            return Some(m as usize);
        }
        let ctx = RequestCtx {
            src,
            dst,
            payload: Payload::Sip(msg),
        };
        let key = match key::extract(self.method, &self.hash_params, &ctx) {
            KeyOutcome::Key(k) => KeyInput::Hash(hash::key_hash(k.as_bytes())),
            KeyOutcome::NoKey => KeyInput::NoKey,
            KeyOutcome::Unparseable => KeyInput::Unparseable,
        };
        let choice = self.balancer.choose(key, now)?;
        if let Some(h) = call_hash {
            let member = choice.member as u32;
            match self.dialogs.put(h, member, now_ms) {
                Pin::New => self.open(member),
                Pin::Moved(old) => {
                    self.close(old);
                    self.open(member);
                }
                Pin::Refreshed | Pin::Refused => {}
            }
        }
        Some(choice.member)
    }

    fn open(&self, member: u32) {
        if let Some(c) = self.balancer.counters(member as usize) {
            c.open();
        }
    }

    fn close(&self, member: u32) {
        if let Some(c) = self.balancer.counters(member as usize) {
            c.close();
        }
    }

    /// A request from a service toward a client (in-dialog: BYE, re-INVITE, NOTIFY...):
    /// routed by Route / Request-URI, never to ourselves.
    fn request_from_service(&self, msg: &SipMsg<'_>, src: SocketAddr, out: &mut Vec<u8>) -> Action {
        bump(&self.counters.in_dialog_from_services);
        let target = match request_target(msg, &self.local) {
            Ok(t) => t,
            Err(RewriteError::Loop) => {
                bump(&self.counters.loops);
                return Action::Drop(DropReason::Loop);
            }
            Err(_) => {
                bump(&self.counters.unroutable);
                return Action::Drop(DropReason::Unroutable);
            }
        };
        let Some(addr) = target.socket_addr() else {
            bump(&self.counters.unroutable);
            return Action::Drop(DropReason::Unroutable);
        };
        if self.local.is_local_addr(addr) {
            bump(&self.counters.loops);
            return Action::Drop(DropReason::Loop);
        }
        let rw = RequestRewrite {
            local: &self.local,
            src,
            record_route: self.record_route,
            force_rport: false,
            conn_id: None,
        };
        match forward_request(msg, &rw, out) {
            Ok(_) => {
                bump(&self.counters.requests_forwarded);
                Action::Send(addr)
            }
            Err(RewriteError::TooManyHops) => {
                bump(&self.counters.replies_483);
                self.reply(msg, src, &Reply::TOO_MANY_HOPS, out)
            }
            Err(_) => {
                bump(&self.counters.malformed);
                Action::Drop(DropReason::Malformed)
            }
        }
    }

    /// A response: fulcrum's Via must be on top; it is removed and the response goes to
    /// the next Via (received / rport aware).
    fn response(&self, msg: &SipMsg<'_>, out: &mut Vec<u8>) -> Action {
        match forward_response(msg, &self.local, out) {
            Ok(route) => match route.target.socket_addr() {
                Some(addr) if self.local.is_local_addr(addr) => {
                    bump(&self.counters.loops);
                    Action::Drop(DropReason::Loop)
                }
                Some(addr) => {
                    bump(&self.counters.responses_forwarded);
                    Action::Send(addr)
                }
                None => {
                    bump(&self.counters.unroutable);
                    Action::Drop(DropReason::Unroutable)
                }
            },
            Err(RewriteError::ViaNotOurs) => {
                bump(&self.counters.not_ours);
                Action::Drop(DropReason::NotOurs)
            }
            Err(_) => {
                bump(&self.counters.malformed);
                Action::Drop(DropReason::Malformed)
            }
        }
    }
}

/// Call-ID without surrounding whitespace (the scanner already trims LWS; this keeps the
/// dialog key identical to the call_id_hash key whatever the header's spacing).
fn sip_trim(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &v[start..end]
}

/// Logs at most once per second per limiter (bad input must not flood the log).
#[derive(Debug, Default)]
pub struct LogLimiter {
    last_s: AtomicU64,
}

impl LogLimiter {
    pub fn allow(&self, now: Nanos) -> bool {
        let s = now / 1_000_000_000 + 1;
        let last = self.last_s.load(Ordering::Relaxed);
        s != last
            && self
                .last_s
                .compare_exchange(last, s, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

/// The receive loop of one worker socket. Runs until `stop` is set (checked at least every
/// `poll` interval). Errors are counted and never end the loop.
pub fn run_worker(
    socket: UdpSocket,
    core: Arc<SipUdpCore>,
    epoch: Instant,
    stop: Arc<AtomicBool>,
    poll: Duration,
) {
    run_worker_swappable(socket, Arc::new(ArcSwap::new(core)), epoch, stop, poll);
}

/// [`run_worker`] over a core that a reload may replace: each datagram is handled by the
/// core current when it arrives (one atomic load, no lock).
pub fn run_worker_swappable(
    socket: UdpSocket,
    cell: Arc<ArcSwap<SipUdpCore>>,
    epoch: Instant,
    stop: Arc<AtomicBool>,
    poll: Duration,
) {
    let core = cell.load_full();
    let dst = match socket.local_addr() {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(vserver = %core.name, error = %e, "worker socket has no address");
            return;
        }
    };
    if let Err(e) = socket.set_read_timeout(Some(poll)) {
        tracing::warn!(vserver = %core.name, error = %e, "cannot set read timeout");
    }
    let mut buf = vec![0u8; 65_536];
    let mut out: Vec<u8> = Vec::with_capacity(65_536 + 1024);
    let recv_log = LogLimiter::default();
    let send_log = LogLimiter::default();
    let drop_log = LogLimiter::default();
    while !stop.load(Ordering::Relaxed) {
        let (n, src) = match socket.recv_from(&mut buf) {
            Ok(r) => r,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(e) => {
                // ICMP errors from an earlier send surface here (ECONNREFUSED); not fatal.
                bump(&cell.load().counters.recv_errors);
                let now = elapsed_nanos(epoch);
                if recv_log.allow(now) {
                    tracing::debug!(vserver = %core.name, error = %e, "receive error");
                }
                continue;
            }
        };
        let now = elapsed_nanos(epoch);
        let core = cell.load();
        match core.handle(&buf[..n], src, dst, now, &mut out) {
            Action::Send(to) => {
                if let Err(e) = socket.send_to(&out, to) {
                    bump(&core.counters.send_errors);
                    if send_log.allow(now) {
                        tracing::warn!(vserver = %core.name, %to, error = %e, "send failed");
                    }
                }
            }
            Action::Drop(reason) => {
                if drop_log.allow(now) {
                    tracing::debug!(vserver = %core.name, %src, ?reason, "datagram dropped");
                }
            }
        }
    }
}

/// Nanoseconds since `epoch` (the shell's clock, handed to the pure core).
pub fn elapsed_nanos(epoch: Instant) -> Nanos {
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
