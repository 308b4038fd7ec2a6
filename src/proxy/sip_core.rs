//! The SIP decision of a vserver, shared by `sip-udp` and `sip-tcp`: a stateless SIP proxy
//! (RFC 3261 §16.11, RFC 3581). PURE apart from reading its own atomics.
//!
//! [`SipCore::handle`] is the whole per-message decision and rewrite: bytes, where they came
//! from and `now` in; an [`Action`] and the bytes to send out. It touches no socket, so it
//! is tested without one; only the transport shells (`sip_udp`, `sip_tcp`) differ.

use crate::balancer::{Balancer, KeyInput};
use crate::config::{HashParams, Method};
use crate::dialog::{DialogTable, Pin};
use crate::hash;
use crate::key::{self, KeyOutcome, Payload, RequestCtx};
use crate::proxy::bump;
use crate::sip::{
    self, Local, MaxForwards, Reply, RequestRewrite, RewriteError, SipMethod, SipMsg, Transport,
    build_reply, build_response, forward_request, forward_response, reply_target, request_target,
};
use crate::stats::Nanos;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// Retry-After of fulcrum's 503 (RFC 3261 §21.5.4): long enough for a monitor to bring a
/// service back, short enough that clients do not give up on the vserver.
pub const RETRY_AFTER_S: u32 = 5;

/// The largest UDP payload over IPv4 (65,535 minus the IP and UDP headers).
const MAX_UDP_PAYLOAD: usize = 65_507;

/// Most bytes forwarding adds to a request: fulcrum's Via (IPv6 sent-by, branch, rport),
/// Record-Route, `received` / `rport` on the client's Via and a Max-Forwards header.
const MAX_GROWTH: usize = 512;

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
    /// From a source the vserver's access lists refuse (counted in its edge counters).
    Acl,
    /// A new request from a source banned by flood control (counted there too).
    Flood,
}

/// Where a message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// A client (anyone who is not a member). On streams, the client connection's id,
    /// which fulcrum writes into its Via so the response finds the connection again.
    Client { conn: Option<u64> },
    /// Member `m` of the vserver (a service).
    Member(usize),
}

/// What to do with the bytes written to `out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// A client's request: send `out` to this member.
    ToMember(usize),
    /// Send `out` to this address: a response to the next Via on datagrams, or a request
    /// from a service toward a client (on streams: the client connection from that address).
    ToAddr(SocketAddr),
    /// A response for the client connection with this id (streams).
    ToConn(u64),
    /// fulcrum's own reply (400 / 483 / 503): back to the sender, at this address on
    /// datagrams (RFC 3581 aware), on the same connection on streams.
    Reply(SocketAddr),
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
    /// In-dialog requests routed to the service their Route's `fc-svc` names.
    pub routed_by_record_route: AtomicU64,
    pub replies_400: AtomicU64,
    pub replies_483: AtomicU64,
    pub replies_503: AtomicU64,
    pub replies_513: AtomicU64,
    /// 420 Bad Extension: a Proxy-Require fulcrum does not support (RFC 3261 §16.3 step 5).
    pub replies_420: AtomicU64,
    /// 501 Not Implemented: an unknown method whose CSeq names another (RFC 4475 §3.1.2.18).
    pub replies_501: AtomicU64,
    /// 505 Version Not Supported (RFC 4475 §3.1.2.16).
    pub replies_505: AtomicU64,
    pub malformed: AtomicU64,
    pub not_ours: AtomicU64,
    pub loops: AtomicU64,
    pub unroutable: AtomicU64,
    /// ACKs that could not be forwarded (no service, no hops left): never answered.
    pub acks_not_forwarded: AtomicU64,
    pub send_errors: AtomicU64,
    pub recv_errors: AtomicU64,
}

/// Shared, immutable-after-build state of one SIP vserver.
pub struct SipCore {
    pub name: String,
    /// fulcrum's identity on the vserver's own transport (the client leg).
    local: Local,
    /// Identities on the other transports some members speak (the transports bridge,
    /// docs/sip.md): a request to such a member leaves with that leg's Via and is double
    /// record-routed (RFC 5658 §3.2). Empty when every member speaks the vserver's transport.
    legs: Vec<Local>,
    /// The leg of each member: 0 for the vserver's own, `k` for `legs[k - 1]`. Empty when
    /// `legs` is.
    member_leg: Vec<u8>,
    /// `local` and the legs as given, before [`Local::bridged_with`]: what a rebuild starts from.
    given: (Local, Vec<Local>),
    record_route: bool,
    method: Method,
    hash_params: HashParams,
    balancer: Arc<Balancer>,
    dialogs: DialogTable,
    /// Address of each member (index = member index).
    member_addrs: Vec<SocketAddr>,
    /// `fc-svc` digest of each member (index = member index).
    digests: Vec<u64>,
    /// Access lists and flood control ([`SipCore::with_edge`]; open by default).
    edge: crate::edge::Edge,
    pub counters: SipCounters,
}

impl std::fmt::Debug for SipCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SipCore")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Everything a SIP vserver needs to decide.
pub struct SipParams {
    pub name: String,
    pub local: Local,
    pub record_route: bool,
    pub method: Method,
    pub hash_params: HashParams,
    pub balancer: Arc<Balancer>,
    pub member_addrs: Vec<SocketAddr>,
    pub max_dialogs: usize,
    pub dialog_idle: Duration,
    /// The transport each member speaks (index = member index); empty: the vserver's own.
    pub member_transports: Vec<Transport>,
    /// fulcrum's identities on other transports ([`SipParams::with_legs`]).
    pub legs: Vec<Local>,
}

impl SipParams {
    /// The parameters of SIP vserver `v` of `config`: its settings, members' addresses, Via
    /// identity `local` and `balancer`.
    pub fn of(
        config: &crate::config::Config,
        v: &crate::config::Vserver,
        local: Local,
        balancer: Arc<Balancer>,
    ) -> SipParams {
        SipParams {
            name: v.name.clone(),
            legs: Vec::new(),
            record_route: v.record_route,
            method: v.method,
            hash_params: v.hash.clone(),
            balancer,
            member_addrs: config.member_addrs(v),
            max_dialogs: v.max_sessions,
            dialog_idle: v.idle_timeout,
            member_transports: v
                .members()
                .map(|i| {
                    config
                        .services
                        .get(i)
                        .and_then(|s| sip_transport(s.protocol))
                        .unwrap_or(local.transport())
                })
                .collect(),
            local,
        }
    }

    /// fulcrum's identities on the other transports the shell speaks toward services (at most
    /// one per transport; the first wins). A member whose transport has no leg here is
    /// reached on the vserver's own.
    pub fn with_legs(mut self, legs: Vec<Local>) -> SipParams {
        self.legs = legs;
        self
    }
}

/// The SIP transport of a service protocol, `None` for the non-SIP ones.
pub fn sip_transport(p: crate::config::Protocol) -> Option<Transport> {
    use crate::config::Protocol;
    match p {
        Protocol::SipUdp => Some(Transport::Udp),
        Protocol::SipTcp => Some(Transport::Tcp),
        Protocol::SipTls => Some(Transport::Tls),
        Protocol::Udp | Protocol::Tcp | Protocol::Http => None,
    }
}

impl SipCore {
    pub fn new(p: SipParams) -> SipCore {
        let digests = p
            .balancer
            .members()
            .iter()
            .map(|m| hash::service_digest(m.id_hash))
            .collect();
        let given = (p.local.clone(), p.legs.clone());
        let own = p.local.transport();
        // A leg per member: the vserver's own, or the first given leg of its transport.
        let member_leg: Vec<u8> = p
            .member_transports
            .iter()
            .map(|&t| {
                if t == own {
                    return 0;
                }
                p.legs
                    .iter()
                    .position(|l| l.transport() == t)
                    .and_then(|k| u8::try_from(k + 1).ok())
                    .unwrap_or(0)
            })
            .collect();
        let (local, legs, member_leg) = if member_leg.iter().any(|&k| k != 0) {
            // Every identity knows the others as itself: a Via or a Route naming any leg
            // is fulcrum's, on whichever leg it comes back.
            let legs: Vec<Local> = p
                .legs
                .iter()
                .map(|l| {
                    let others: Vec<Local> = std::iter::once(p.local.clone())
                        .chain(p.legs.iter().filter(|o| *o != l).cloned())
                        .collect();
                    l.clone().bridged_with(&others)
                })
                .collect();
            (p.local.bridged_with(&p.legs), legs, member_leg)
        } else {
            (p.local, Vec::new(), Vec::new())
        };
        SipCore {
            digests,
            edge: crate::edge::Edge::default(),
            name: p.name,
            local,
            legs,
            member_leg,
            given,
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

    /// The core with the vserver's access lists and flood control.
    pub fn with_edge(mut self, edge: crate::edge::Edge) -> SipCore {
        self.edge = edge;
        self
    }

    pub fn edge(&self) -> &crate::edge::Edge {
        &self.edge
    }

    pub fn dialogs(&self) -> &DialogTable {
        &self.dialogs
    }

    pub fn local(&self) -> &Local {
        &self.local
    }

    /// The identities this core was built with (its own and the other legs), before they
    /// learnt each other: what a rebuild of the vserver starts from.
    pub fn identities(&self) -> (Local, Vec<Local>) {
        self.given.clone()
    }

    /// fulcrum's identity on the leg toward member `m` when it is not the vserver's own
    /// transport (the transports bridge), else `None`.
    fn leg_of(&self, m: usize) -> Option<&Local> {
        match self.member_leg.get(m) {
            None | Some(0) => None,
            Some(&k) => self.legs.get(usize::from(k) - 1),
        }
    }

    /// The transport fulcrum speaks toward member `m`.
    pub fn member_transport(&self, m: usize) -> Transport {
        self.leg_of(m).unwrap_or(&self.local).transport()
    }

    /// How often [`SipCore::sweep`] should run: often enough that the dialog table reflects
    /// the idle timeout within ~10%.
    pub fn sweep_interval(&self) -> Duration {
        (self.dialogs.idle() / 10).clamp(Duration::from_millis(100), Duration::from_secs(10))
    }

    /// Expire idle dialogs; each expired dialog stops counting toward its member's load.
    pub fn sweep(&self, now: Nanos) -> usize {
        self.dialogs
            .sweep(now / 1_000_000, |member| self.close(member))
    }

    /// The member whose address is `src` (datagrams: a service sends from its address).
    pub fn member_of(&self, src: SocketAddr) -> Option<usize> {
        let src = SocketAddr::new(src.ip().to_canonical(), src.port());
        self.member_addrs.iter().position(|a| *a == src)
    }

    /// The member fulcrum reaches over UDP that a datagram from `src` comes from: the member
    /// at that address, else the first at that IP (a service may answer from another port,
    /// RFC 3261 §18.2.2). For the UDP leg of a stream vserver.
    pub fn udp_member_of(&self, src: SocketAddr) -> Option<usize> {
        let src = SocketAddr::new(src.ip().to_canonical(), src.port());
        let on_udp = |m: &usize| self.member_transport(*m) == Transport::Udp;
        (0..self.member_addrs.len())
            .filter(on_udp)
            .find(|&m| self.member_addrs[m] == src)
            .or_else(|| {
                (0..self.member_addrs.len())
                    .filter(on_udp)
                    .find(|&m| self.member_addrs[m].ip() == src.ip())
            })
    }

    /// Address of member `m`.
    pub fn member_addr(&self, m: usize) -> Option<SocketAddr> {
        self.member_addrs.get(m).copied()
    }

    pub fn member_count(&self) -> usize {
        self.member_addrs.len()
    }

    /// Decide and rewrite a datagram from `src` received on local address `dst`.
    pub fn handle_datagram(
        &self,
        buf: &[u8],
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
    ) -> Action {
        let origin = match self.member_of(src) {
            // A datagram comes from a member reached over UDP: one at the address of a stream
            // member (a sip-udp vserver's bridge, where that member's traffic arrives on its
            // link) is a client's.
            Some(m) if self.member_leg.is_empty() || self.member_transport(m) == Transport::Udp => {
                Origin::Member(m)
            }
            _ => Origin::Client { conn: None },
        };
        self.handle(buf, origin, src, dst, now, out)
    }

    /// Decide and rewrite one message from `src` (arrived on local address `dst`).
    pub fn handle(
        &self,
        buf: &[u8],
        origin: Origin,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
    ) -> Action {
        out.clear();
        // The access lists, before anything is parsed; a service's traffic is never checked.
        if matches!(origin, Origin::Client { .. })
            && self.edge.has_acl()
            && !self.is_member_ip(src)
            && !self.edge.admits(src.ip())
        {
            return Action::Drop(DropReason::Acl);
        }
        let msg = match sip::scan(buf) {
            Ok(m) => m,
            Err(e) => return self.unscannable(buf, e, origin, src, out),
        };
        if msg.is_request() {
            bump(&self.counters.requests_in);
            match origin {
                Origin::Member(m) => self.request_from_service(&msg, m, src, now, out),
                Origin::Client { conn } => self.request_from_client(&msg, src, dst, conn, now, out),
            }
        } else {
            bump(&self.counters.responses_in);
            // On datagrams a service may answer from another port than the one it is
            // configured on (fulcrum's Via asks for no rport, RFC 3261 §18.2.2): a response
            // from a service's host is a service's.
            let from_member = match origin {
                Origin::Member(_) => true,
                Origin::Client { conn: None } => self.is_member_ip(src),
                Origin::Client { conn: Some(_) } => false,
            };
            self.response(&msg, from_member, out)
        }
    }

    /// A message that does not scan. A client's request whose start line and headers are
    /// sound is answered rather than dropped, so its sender learns why: 505 for another SIP
    /// version (RFC 3261 §8.2.1 step 1 analogue for a proxy, RFC 4475 §3.1.2.16), 400 for a
    /// Content-Length that is malformed, conflicting or larger than the datagram (RFC 3261
    /// §18.3, RFC 4475 §3.1.2.2, §3.1.2.3, §3.3.9). A missing Content-Length is no error on a
    /// datagram (§18.3) and never gets here. Everything else is dropped.
    fn unscannable(
        &self,
        buf: &[u8],
        e: sip::ScanError,
        origin: Origin,
        src: SocketAddr,
        out: &mut Vec<u8>,
    ) -> Action {
        let reply = match (origin, e) {
            (Origin::Client { .. }, sip::ScanError::BadVersion) => Reply::VERSION_NOT_SUPPORTED,
            // LWS in or around the Request-URI, trailing whitespace (RFC 4475 §3.1.2.8 to
            // §3.1.2.10): a request, but not one fulcrum can forward byte for byte.
            (
                Origin::Client { .. },
                sip::ScanError::BadContentLength | sip::ScanError::BadStartLine,
            ) => Reply::BAD_REQUEST,
            // On a stream the framing already checked Content-Length; an incomplete datagram
            // is one whose Content-Length promises more than arrived.
            (Origin::Client { conn: None }, sip::ScanError::Incomplete) => Reply::BAD_REQUEST,
            _ => {
                bump(&self.counters.malformed);
                return Action::Drop(DropReason::Malformed);
            }
        };
        match sip::scan_for_reply(buf) {
            Ok(msg) if msg.is_request() && msg.via_header().is_some() => {
                bump(&self.counters.requests_in);
                self.reply(&msg, src, &reply, out)
            }
            _ => {
                bump(&self.counters.malformed);
                Action::Drop(DropReason::Malformed)
            }
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
        match build_reply(msg, reply, src, out) {
            Ok(()) => {
                // Counted once it exists: an ACK is never answered, a 400 that cannot be
                // built is counted as malformed instead.
                match reply.code {
                    400 => bump(&self.counters.replies_400),
                    505 => bump(&self.counters.replies_505),
                    420 => bump(&self.counters.replies_420),
                    501 => bump(&self.counters.replies_501),
                    483 => bump(&self.counters.replies_483),
                    513 => bump(&self.counters.replies_513),
                    503 => bump(&self.counters.replies_503),
                    _ => {}
                }
                Action::Reply(reply_target(msg, src))
            }
            Err(RewriteError::AckNotAnswered) => {
                bump(&self.counters.acks_not_forwarded);
                Action::Drop(DropReason::AckNotForwarded)
            }
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
        conn: Option<u64>,
        now: Nanos,
        out: &mut Vec<u8>,
    ) -> Action {
        // RFC 3261 §16.3 in its order: syntax (step 1), Max-Forwards (step 3), Proxy-Require
        // (step 5). Max-Forwards before anything is chosen: a looping request must not pin a
        // dialog or take a slot.
        if let Some(reply) = request_syntax_error(msg) {
            return self.reply(msg, src, &reply, out);
        }
        let max_forwards = msg.max_forwards();
        match max_forwards {
            MaxForwards::Value(0) => return self.reply(msg, src, &Reply::TOO_MANY_HOPS, out),
            MaxForwards::Bad => return self.reply(msg, src, &Reply::BAD_REQUEST, out),
            MaxForwards::Absent | MaxForwards::Value(_) => {}
        }
        // fulcrum supports no option tag, so any Proxy-Require is refused (RFC 3261 §16.3
        // step 5, which §16.11 keeps for stateless proxies; RFC 4475 §3.3.5).
        if msg.proxy_require().is_some() {
            return self.reply(msg, src, &Reply::BAD_EXTENSION, out);
        }
        // A datagram that cannot grow by fulcrum's Via, Record-Route and received / rport
        // without passing the largest UDP payload could not be sent on (RFC 3261 §21.5.14).
        // Both limits are checked before a member is chosen (and the dialog pinned and
        // counted there), so a refusal leaves nothing behind; `forward_request` checks the
        // lines again as its own invariant.
        if msg.len() > self.max_forwarded().saturating_sub(MAX_GROWTH)
            || !self.fits_lines(msg, max_forwards)
        {
            return self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out);
        }
        if self.edge.has_flood()
            && self.is_new_flow(msg, now)
            && !self.edge.admits_new(src.ip(), now)
        {
            return Action::Drop(DropReason::Flood);
        }
        let Some(member) = self.choose(msg, src, dst, now) else {
            return self.reply(msg, src, &Reply::service_unavailable(RETRY_AFTER_S), out);
        };
        if member >= self.member_addrs.len() {
            return Action::Drop(DropReason::Unroutable);
        }
        // Toward a member on another transport: that leg's Via, and its Record-Route on top
        // of the client leg's (RFC 5658 §3.2).
        let leg = self.leg_of(member);
        let rw = RequestRewrite {
            local: leg.unwrap_or(&self.local),
            src,
            record_route: self.record_route,
            force_rport: false,
            conn_id: conn,
            service: self.digest_of(Some(member)),
            arrived_on: leg.map(|_| &self.local),
        };
        match forward_request(msg, &rw, out) {
            Ok(n) if n > self.max_forwarded() => {
                self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out)
            }
            // Fits the client's leg but not the member's: a stream client's request toward a
            // sip-udp member, longer than a datagram carries (RFC 3261 §21.5.14). The dialog
            // an initial request pinned in `choose` is let go (its retransmissions are
            // refused alike); an in-dialog request keeps its dialog.
            Ok(n) if n > self.max_forwarded_to(member) => {
                if msg.to_tag().is_none()
                    && let Some(h) = msg.call_id().map(hash::key_hash)
                {
                    self.end_dialog(h, now / 1_000_000);
                }
                self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out)
            }
            Ok(_) => {
                bump(&self.counters.requests_forwarded);
                if let Some(c) = self.balancer.counters(member) {
                    c.record_request();
                }
                Action::ToMember(member)
            }
            Err(RewriteError::TooManyHops) => self.reply(msg, src, &Reply::TOO_MANY_HOPS, out),
            Err(RewriteError::TooManyHeaders) => {
                self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out)
            }
            Err(_) => self.reply(msg, src, &Reply::BAD_REQUEST, out),
        }
    }

    /// Whether the forwarded request keeps within what fulcrum's scanner takes: the lines
    /// [`forward_request`] adds (its Via, Record-Route when on, Max-Forwards when absent).
    fn fits_lines(&self, msg: &SipMsg<'_>, max_forwards: MaxForwards) -> bool {
        // Checked before a member is chosen: a bridge may record-route twice.
        let rr_lines = usize::from(self.record_route) * (1 + usize::from(!self.legs.is_empty()));
        let added = 1 + rr_lines + usize::from(max_forwards == MaxForwards::Absent);
        msg.header_count() + added <= sip::MAX_HEADERS
    }

    /// The largest request fulcrum forwards: one it could take back itself, so that the
    /// answer (carrying the same headers) passes it again. On datagrams the largest UDP
    /// payload; on streams the frame limit of a client connection, the smaller of fulcrum's
    /// two ([`crate::sip::DEFAULT_MAX_MESSAGE`]).
    fn max_forwarded(&self) -> usize {
        match self.local.transport() {
            sip::Transport::Udp => MAX_UDP_PAYLOAD,
            _ => sip::DEFAULT_MAX_MESSAGE,
        }
    }

    /// The longest request that can be forwarded to `member` over its leg: a datagram's
    /// payload toward a sip-udp member, whatever the client's transport.
    fn max_forwarded_to(&self, member: usize) -> usize {
        match self.member_transport(member) {
            sip::Transport::Udp => MAX_UDP_PAYLOAD,
            _ => self.max_forwarded(),
        }
    }

    /// Choose again for a request already rewritten for a member whose connection failed
    /// (streams): the failed member is no longer usable, so dialog affinity and the method
    /// pass it over and the next-ranked member takes the request. The client's address for
    /// source-based methods is read from the request's second Via (`received`, else
    /// sent-by), since the first is fulcrum's own. Returns the member, or `None` when the
    /// bytes are not a request or no member can take it.
    pub fn rechoose(&self, forwarded: &[u8], dst: SocketAddr, now: Nanos) -> Option<usize> {
        let msg = sip::scan(forwarded).ok()?;
        if !msg.is_request() {
            return None;
        }
        let client = msg.vias().nth(1).and_then(|v| {
            let ip = v
                .received
                .and_then(|r| std::str::from_utf8(r).ok()?.parse().ok())
                .or_else(|| v.host_ip())?;
            Some(SocketAddr::new(ip, v.port.unwrap_or(5060)))
        });
        self.choose(&msg, client.unwrap_or(dst), dst, now)
    }

    /// fulcrum's 503 for a request it had already forwarded (`forwarded` carries its own Via
    /// on top) and can no longer deliver (streams: its member's connection failed and no
    /// other member can take it). Built as a service would answer it, then routed back like
    /// any response (to the client connection named in that Via), so the client learns at
    /// once instead of waiting for its transaction timer (RFC 3261 §16.7 step 6 lets a
    /// proxy answer 503 when it cannot forward). ACKs are not answered.
    pub fn unavailable(&self, forwarded: &[u8], out: &mut Vec<u8>) -> Action {
        out.clear();
        let Ok(msg) = sip::scan(forwarded) else {
            return Action::Drop(DropReason::Malformed);
        };
        let mut resp = Vec::new();
        match build_response(&msg, &Reply::service_unavailable(RETRY_AFTER_S), &mut resp) {
            Ok(()) => {}
            Err(RewriteError::AckNotAnswered) => return Action::Drop(DropReason::AckNotForwarded),
            Err(_) => return Action::Drop(DropReason::Malformed),
        }
        let Ok(reply) = sip::scan(&resp) else {
            return Action::Drop(DropReason::Malformed);
        };
        bump(&self.counters.replies_503);
        // fulcrum's own reply, built from its own Via: as trusted as a service's.
        self.response(&reply, true, out)
    }

    /// Dialog affinity first (an established call stays on its member while it is UP or
    /// draining OUT_OF_SERVICE), else the vserver's method. The dialog is pinned to whatever
    /// was chosen.
    fn choose(
        &self,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
    ) -> Option<usize> {
        let now_ms = now / 1_000_000;
        // The scanner hands out the Call-ID without surrounding LWS, so this is also exactly the
        // call_id_hash key: hashed once, used for both.
        let call_hash = msg.call_id().map(hash::key_hash);
        // The dialog's service named by our Record-Route (`fc-svc`), whichever instance set
        // the dialog up: before the local table, which may not know the dialog.
        if let Some(m) = self.routed_member(msg) {
            self.balancer.count_affinity();
            bump(&self.counters.routed_by_record_route);
            if let Some(h) = call_hash {
                if ends_dialog(msg) {
                    self.end_dialog(h, now_ms);
                } else {
                    // The local pin (if this instance set the dialog up) stays fresh: a call
                    // longer than the idle timeout must not be swept, and uncounted, while up.
                    let _ = self.dialogs.get(h, now_ms);
                }
            }
            return Some(m);
        }
        if let Some(h) = call_hash
            && let Some(m) = self.dialogs.get(h, now_ms)
            && self.balancer.accepts_existing(m as usize)
        {
            self.balancer.count_affinity();
            if ends_dialog(msg) {
                self.end_dialog(h, now_ms);
            }
            return Some(m as usize);
        }
        let ctx = RequestCtx {
            src,
            dst,
            payload: Payload::Sip(msg),
        };
        let key = match (self.method, call_hash) {
            (Method::CallIdHash, Some(h)) => KeyInput::Hash(h),
            _ => match key::extract(self.method, &self.hash_params, &ctx) {
                KeyOutcome::Key(k) => KeyInput::Hash(hash::key_hash(k.as_bytes())),
                KeyOutcome::NoKey => KeyInput::NoKey,
                KeyOutcome::Unparseable => KeyInput::Unparseable,
            },
        };
        let choice = self.balancer.choose(key, now)?;
        let member = choice.member as u32;
        // A BYE (or CANCEL) of a dialog whose member no longer takes it (DOWN) goes elsewhere,
        // and still ends the dialog: its member stops counting it now, not at the idle timeout.
        if let Some(h) = call_hash
            && ends_dialog(msg)
        {
            self.end_dialog(h, now_ms);
        }
        match call_hash {
            Some(h) if pins_dialog(msg) => match self.dialogs.put(h, member, now_ms) {
                Pin::New => self.open(member),
                Pin::Moved(old) => {
                    self.close(old);
                    self.open(member);
                }
                Pin::Refreshed | Pin::Refused => {}
            },
            // No dialog: only its retransmissions follow it (a MESSAGE delivered twice by two
            // services would be a duplicate the user sees), uncounted. An ACK has none.
            Some(h) if msg.method_kind() != SipMethod::Ack => {
                self.dialogs.linger(h, member, now_ms);
            }
            _ => {}
        }
        Some(choice.member)
    }

    /// Whether `addr`'s IP is the IP of a member.
    pub(crate) fn is_member_ip(&self, addr: SocketAddr) -> bool {
        let ip = addr.ip().to_canonical();
        self.member_addrs.iter().any(|m| m.ip() == ip)
    }

    /// Whether a response routed by `route` goes to the host of a member (not to a client
    /// connection, and not to a name).
    fn is_member_host(&self, route: &sip::ResponseRoute<'_>) -> bool {
        route.conn_id.is_none()
            && route
                .target
                .socket_addr()
                .is_some_and(|a| self.is_member_ip(a))
    }

    /// Count one more open dialog (or flow) on `member`.
    pub(crate) fn open(&self, member: u32) {
        if let Some(c) = self.balancer.counters(member as usize) {
            c.open();
        }
    }

    /// Count one open dialog fewer on `member`.
    pub(crate) fn close(&self, member: u32) {
        if let Some(c) = self.balancer.counters(member as usize) {
            c.close();
        }
    }

    /// The member a request's top Route names through `fc-svc`, when it is one of ours and
    /// still takes its established flows (UP, OUT_OF_SERVICE or draining; not DOWN). A value
    /// no member has (forged, stale, another pool) names nothing: the caller chooses as usual.
    fn routed_member(&self, msg: &SipMsg<'_>) -> Option<usize> {
        let digest = sip::routed_service(msg, &self.local)?;
        self.digests
            .iter()
            .enumerate()
            .filter(|(_, d)| **d == digest)
            .map(|(m, _)| m)
            .find(|&m| self.balancer.accepts_existing(m))
    }

    /// Whether a request from a client would open a new flow (flood control counts those):
    /// outside any dialog (no To tag), not a CANCEL or ACK of a transaction, and not a
    /// retransmission of a request already pinned (its Call-ID is in the table).
    fn is_new_flow(&self, msg: &SipMsg<'_>, now: Nanos) -> bool {
        if msg.to_tag().is_some() || matches!(msg.method_kind(), SipMethod::Ack | SipMethod::Cancel)
        {
            return false;
        }
        msg.call_id().is_none_or(|c| {
            self.dialogs
                .get(hash::key_hash(c), now / 1_000_000)
                .is_none()
        })
    }

    /// The `fc-svc` digest to write for `member` when Record-Route is on.
    fn digest_of(&self, member: Option<usize>) -> Option<u64> {
        self.record_route
            .then(|| member.and_then(|m| self.digests.get(m).copied()))
            .flatten()
    }

    /// The dialog of Call-ID hash `h` ended (BYE, or CANCEL of the initial INVITE): its member
    /// stops counting it as load (the entry lingers for retransmissions and the ACK).
    fn end_dialog(&self, h: u64, now_ms: u64) {
        if let Some(member) = self.dialogs.end(h, now_ms) {
            self.close(member);
        }
    }

    /// A request from a service toward a client (in-dialog: BYE, re-INVITE, NOTIFY...):
    /// routed by Route / Request-URI, never to ourselves.
    fn request_from_service(
        &self,
        msg: &SipMsg<'_>,
        member: usize,
        src: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
    ) -> Action {
        bump(&self.counters.in_dialog_from_services);
        // The service hanging up ends the dialog as the client's BYE would.
        if ends_dialog(msg)
            && let Some(h) = msg.call_id().map(hash::key_hash)
        {
            self.end_dialog(h, now / 1_000_000);
        }
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
        // It leaves on the client leg (the vserver's own transport); from a member on another
        // transport it is double record-routed, the client leg's entry on top.
        let rw = RequestRewrite {
            local: &self.local,
            src,
            record_route: self.record_route,
            force_rport: false,
            conn_id: None,
            service: self.digest_of(Some(member)),
            arrived_on: self.leg_of(member),
        };
        match forward_request(msg, &rw, out) {
            Ok(n) if n > self.max_forwarded() => {
                self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out)
            }
            Ok(_) => {
                bump(&self.counters.requests_forwarded);
                Action::ToAddr(addr)
            }
            Err(RewriteError::TooManyHops) => self.reply(msg, src, &Reply::TOO_MANY_HOPS, out),
            Err(RewriteError::TooManyHeaders) => {
                self.reply(msg, src, &Reply::MESSAGE_TOO_LARGE, out)
            }
            Err(_) => {
                bump(&self.counters.malformed);
                Action::Drop(DropReason::Malformed)
            }
        }
    }

    /// A response: fulcrum's Via must be on top; it is removed and the response goes to
    /// the next Via (received / rport aware).
    ///
    /// Only a service's response may go anywhere its next Via says. A response from anyone
    /// else can only answer a request a service sent through fulcrum (an in-dialog BYE
    /// toward a client, say), so it may go only to a service's host: fulcrum's Via is easy
    /// to forge, and honouring a forged one would relay arbitrary datagrams to any address
    /// or inject them into another client's connection (docs/sip.md, Never an open relay).
    fn response(&self, msg: &SipMsg<'_>, from_member: bool, out: &mut Vec<u8>) -> Action {
        match forward_response(msg, &self.local, out) {
            Ok(route) if !from_member && !self.is_member_host(&route) => {
                out.clear();
                bump(&self.counters.not_ours);
                Action::Drop(DropReason::NotOurs)
            }
            Ok(route) => match route.target.socket_addr() {
                // Streams: the client connection named in our Via carries the response.
                _ if route.conn_id.is_some() => {
                    bump(&self.counters.responses_forwarded);
                    route
                        .conn_id
                        .map_or(Action::Drop(DropReason::Unroutable), Action::ToConn)
                }
                Some(addr) if self.local.is_local_addr(addr) => {
                    bump(&self.counters.loops);
                    Action::Drop(DropReason::Loop)
                }
                Some(addr) => {
                    bump(&self.counters.responses_forwarded);
                    Action::ToAddr(addr)
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

/// RFC 3261 §16.3 step 1 for a stateless proxy: the reply to a request a proxy cannot handle
/// as sent, or `None`. Every check reads values the scan already indexed (Request-URI, CSeq,
/// To, From), never the rest of the message: no second pass.
fn request_syntax_error(msg: &SipMsg<'_>) -> Option<Reply<'static>> {
    // Mandatory headers (§8.1.1), and each of Call-ID, CSeq, From, To, Max-Forwards once
    // (RFC 4475 §3.3.8: the proxy cannot know which one the sender meant).
    if msg.missing_mandatory().is_some() || msg.has_duplicate_header() {
        return Some(Reply::BAD_REQUEST);
    }
    // To and From must be a name-addr or addr-spec around an absolute URI: an unbalanced
    // quote hides the URI (RFC 4475 §3.1.2.6).
    for v in [msg.to_header(), msg.from_header()] {
        if !v.is_some_and(names_an_absolute_uri) {
            return Some(Reply::BAD_REQUEST);
        }
    }
    let uri = msg.request_uri()?;
    if !is_absolute_uri(uri) {
        // §7.1 / §25.1: a bare absolute URI; `<sip:...>` is refused (RFC 4475 §3.1.2.7).
        return Some(Reply::BAD_REQUEST);
    }
    // Escaped headers in a SIP Request-URI (RFC 4475 §3.1.2.11): a proxy may refuse the
    // request or drop the headers, but must never forward them in the Request-URI. fulcrum
    // refuses: it forwards the start line byte for byte, and a sender that put headers there
    // has no request a downstream element could act on as meant (§19.1.5 makes them
    // meaningful only when a URI is turned into a request).
    if sip_uri_has_headers(uri) {
        return Some(Reply::BAD_REQUEST);
    }
    let method = msg.method()?;
    let cseq = msg.cseq()?;
    if cseq.method != method {
        // §8.1.1.5: the CSeq method matches the request's. RFC 4475 §3.1.2.17 answers 400;
        // §3.1.2.18 prefers 501 at a proxy when the start line's method is unknown.
        return Some(if SipMethod::from_bytes(method) == SipMethod::Other {
            Reply::NOT_IMPLEMENTED
        } else {
            Reply::BAD_REQUEST
        });
    }
    None
}

/// Whether a To / From value holds an absolute URI, as [`sip::parse_name_addr`] splits it:
/// without a double quote (nearly every message) the URI is between the first `<` and the
/// next `>`, or, with no `<`, everything before the first `;`; only a value with a quoted
/// display name needs the full parse. Two memchr instead of a parse on the per-request path.
fn names_an_absolute_uri(v: &[u8]) -> bool {
    if memchr::memchr(b'"', v).is_some() {
        return sip::parse_name_addr(v).is_some_and(|na| is_absolute_uri(na.uri));
    }
    let uri = match memchr::memchr(b'<', v) {
        Some(lt) => match memchr::memchr(b'>', &v[lt..]) {
            Some(gt) => &v[lt + 1..lt + gt],
            None => return false,
        },
        None => &v[..memchr::memchr(b';', v).unwrap_or(v.len())],
    };
    is_absolute_uri(uri.trim_ascii())
}

/// Whether a `sip:` / `sips:` URI carries `?headers` (RFC 3261 §19.1.1): a non-empty part
/// after a `?` that follows the last `@` (the user part may itself hold `?`), as
/// [`sip::parse_uri`] reads it, without the parse.
fn sip_uri_has_headers(uri: &[u8]) -> bool {
    let is_sip = uri
        .get(..4)
        .is_some_and(|s| s.eq_ignore_ascii_case(b"sip:"))
        || uri
            .get(..5)
            .is_some_and(|s| s.eq_ignore_ascii_case(b"sips:"));
    if !is_sip {
        return false;
    }
    let host_part = memchr::memrchr(b'@', uri).map_or(uri, |at| &uri[at + 1..]);
    memchr::memchr(b'?', host_part).is_some_and(|q| q + 1 < host_part.len())
}

/// RFC 3986 / RFC 3261 §25.1 `absoluteURI` shape: a scheme (ALPHA then ALPHA / DIGIT / `+` /
/// `-` / `.`), a colon and something after it.
fn is_absolute_uri(uri: &[u8]) -> bool {
    let Some(colon) = memchr::memchr(b':', uri) else {
        return false;
    };
    let scheme = &uri[..colon];
    scheme.first().is_some_and(u8::is_ascii_alphabetic)
        && scheme
            .iter()
            .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'-' | b'.'))
        && colon + 1 < uri.len()
}

/// Whether a request ends its dialog: a BYE, or a CANCEL of the initial INVITE (no To tag; a
/// CANCEL of a re-INVITE only ends that transaction, RFC 3261 §9.1, §14.1).
fn ends_dialog(msg: &SipMsg<'_>) -> bool {
    match msg.method_kind() {
        SipMethod::Bye => true,
        SipMethod::Cancel => msg.to_tag().is_none(),
        _ => false,
    }
}

/// Whether a request is pinned to the member it reached: the requests that create a dialog
/// (INVITE, SUBSCRIBE, REFER; RFC 3261 §12, RFC 6665, RFC 3515), REGISTER (its refreshes
/// reuse the Call-ID, §10.2.4, and belong on one registrar), and in-dialog requests (a To
/// tag) whose dialog fulcrum has not seen, e.g. after a restart. Other requests (OPTIONS,
/// MESSAGE, PUBLISH outside a dialog) open nothing: they would fill the dialog table and
/// count as load for the whole idle timeout. A request ending a dialog, and an ACK, pins
/// nothing.
fn pins_dialog(msg: &SipMsg<'_>) -> bool {
    match msg.method_kind() {
        SipMethod::Invite | SipMethod::Register => true,
        SipMethod::Ack | SipMethod::Bye | SipMethod::Cancel => false,
        SipMethod::Options | SipMethod::Other => {
            matches!(msg.method(), Some(b"SUBSCRIBE" | b"REFER")) || msg.to_tag().is_some()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balancer::Health;
    use crate::config;
    use crate::sip::Transport;
    use std::sync::atomic::Ordering;

    const CLIENT: &str = "192.0.2.10:5062";
    const US: &str = "127.0.0.1:5060";

    fn core(record_route: bool) -> SipCore {
        core_with(record_route, "call_id_hash")
    }

    fn core_with(record_route: bool, method: &str) -> SipCore {
        let y = format!(
            "services:\n  - {{ name: a, address: 127.0.0.1:5071, protocol: sip-udp }}\n  - {{ name: b, address: 127.0.0.1:5072, protocol: sip-udp }}\nvservers:\n  - {{ name: v, protocol: sip-udp, bind: 127.0.0.1:5060, method: {method}, services: [a, b] }}\n"
        );
        let cfg = config::from_str("t", &y).expect("config");
        let v = &cfg.vservers[0];
        SipCore::new(SipParams {
            name: "v".into(),
            local: Local::from_addr(US.parse().expect("addr"), Transport::Udp),
            record_route,
            method: v.method,
            hash_params: v.hash.clone(),
            balancer: Arc::new(Balancer::new(&cfg, v)),
            member_addrs: vec![
                "127.0.0.1:5071".parse().expect("addr"),
                "127.0.0.1:5072".parse().expect("addr"),
            ],
            max_dialogs: 100,
            dialog_idle: Duration::from_secs(3600),
            member_transports: Vec::new(),
            legs: Vec::new(),
        })
    }

    fn invite(call_id: &str, max_forwards: u32) -> String {
        format!(
            "INVITE sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1:5062;branch=z9hG4bKc1;rport\r\nMax-Forwards: {max_forwards}\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n"
        )
    }

    fn handle(c: &SipCore, bytes: &str, src: &str, out: &mut Vec<u8>) -> Action {
        c.handle_datagram(
            bytes.as_bytes(),
            src.parse().expect("src"),
            US.parse().expect("dst"),
            0,
            out,
        )
    }

    #[test]
    fn request_goes_to_a_member_with_our_via_and_rport_filled() {
        let c = core(true);
        let mut out = Vec::new();
        let a = handle(&c, &invite("x1", 70), CLIENT, &mut out);
        assert!(matches!(a, Action::ToMember(_)), "{a:?}");
        let msg = crate::sip::scan(&out).expect("rewritten request scans");
        let vias: Vec<_> = msg.vias().collect();
        assert_eq!(vias.len(), 2);
        assert_eq!(vias[0].host, b"127.0.0.1");
        assert!(vias[0].branch.is_some_and(|b| b.starts_with(b"z9hG4bK")));
        assert_eq!(vias[1].received, Some(&b"192.0.2.10"[..]));
        assert_eq!(msg.max_forwards(), MaxForwards::Value(69));
        assert!(msg.record_route().is_some());
        // Same request again (a retransmission): same member, same bytes.
        let mut again = Vec::new();
        assert_eq!(handle(&c, &invite("x1", 70), CLIENT, &mut again), a);
        assert_eq!(again, out);
    }

    #[test]
    fn dialog_key_is_the_call_id_hash_key_whatever_the_spacing() {
        let text = "INVITE sip:a@b SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1;branch=z9hG4bKq\r\ni:   spaced-id@x  \t\r\nCSeq: 1 INVITE\r\nFrom: <sip:a@x>;tag=1\r\nTo: <sip:b@y>\r\nMax-Forwards: 70\r\n\r\n";
        let msg = crate::sip::scan(text.as_bytes()).expect("scan");
        let ctx = RequestCtx {
            src: CLIENT.parse().expect("addr"),
            dst: US.parse().expect("addr"),
            payload: Payload::Sip(&msg),
        };
        let KeyOutcome::Key(k) = key::extract(Method::CallIdHash, &HashParams::default(), &ctx)
        else {
            panic!("no key")
        };
        assert_eq!(msg.call_id(), Some(&b"spaced-id@x"[..]));
        assert_eq!(hash::key_hash(k.as_bytes()), hash::key_hash(b"spaced-id@x"));
    }

    #[test]
    fn replies_483_and_503() {
        let c = core(false);
        let mut out = Vec::new();
        let a = handle(&c, &invite("x2", 0), CLIENT, &mut out);
        assert_eq!(a, Action::Reply(CLIENT.parse().expect("addr")));
        assert_eq!(
            crate::sip::scan(&out).expect("scan").status_code(),
            Some(483)
        );
        let now = 0;
        c.balancer().set_health(0, Health::Down, now);
        c.balancer().set_health(1, Health::Down, now);
        let a = handle(&c, &invite("x3", 70), CLIENT, &mut out);
        assert!(matches!(a, Action::Reply(_)));
        let msg = crate::sip::scan(&out).expect("scan");
        assert_eq!(msg.status_code(), Some(503));
        assert!(msg.header(b"Retry-After").is_some());
        assert_eq!(c.counters.replies_503.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn response_from_member_loses_our_via_and_goes_to_the_client() {
        let c = core(false);
        let mut fwd = Vec::new();
        let Action::ToMember(m) = handle(&c, &invite("x4", 70), CLIENT, &mut fwd) else {
            panic!("not forwarded")
        };
        let req = crate::sip::scan(&fwd).expect("scan");
        let mut resp = Vec::new();
        crate::sip::build_response(
            &req,
            &crate::sip::Reply {
                code: 200,
                reason: "OK",
                retry_after_s: None,
            },
            &mut resp,
        )
        .expect("response");
        let member = c.member_addr(m).expect("member").to_string();
        let mut out = Vec::new();
        let a = handle(
            &c,
            std::str::from_utf8(&resp).expect("utf8"),
            &member,
            &mut out,
        );
        // rport was requested: back to the source address and port (RFC 3581 §4).
        assert_eq!(a, Action::ToAddr(CLIENT.parse().expect("addr")));
        assert_eq!(crate::sip::scan(&out).expect("scan").vias().count(), 1);
    }

    #[test]
    fn foreign_responses_loops_and_garbage_are_dropped_and_counted() {
        let c = core(false);
        let mut out = Vec::new();
        let foreign = "SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP 10.9.9.9:5060;branch=z9hG4bKzz\r\nFrom: <sip:a@x>;tag=1\r\nTo: <sip:b@y>;tag=2\r\nCall-ID: f\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(
            handle(&c, foreign, CLIENT, &mut out),
            Action::Drop(DropReason::NotOurs)
        );
        let to_us = "BYE sip:a@127.0.0.1:5060 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:5071;branch=z9hG4bKb\r\nMax-Forwards: 70\r\nFrom: <sip:b@y>;tag=2\r\nTo: <sip:a@x>;tag=1\r\nCall-ID: l\r\nCSeq: 2 BYE\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(
            handle(&c, to_us, "127.0.0.1:5071", &mut out),
            Action::Drop(DropReason::Loop)
        );
        assert_eq!(
            handle(&c, "\u{1}\u{2}garbage", CLIENT, &mut out),
            Action::Drop(DropReason::Malformed)
        );
        assert_eq!(c.counters.not_ours.load(Ordering::Relaxed), 1);
        assert_eq!(c.counters.loops.load(Ordering::Relaxed), 1);
        assert_eq!(c.counters.malformed.load(Ordering::Relaxed), 1);
    }

    /// A call whose service went DOWN: its BYE goes to another service and ends the dialog,
    /// so the dead service's load count falls back (it stayed up for the idle timeout).
    #[test]
    fn a_bye_rerouted_from_a_down_member_ends_its_dialog() {
        let c = core(false);
        let mut out = Vec::new();
        let Action::ToMember(m) = handle(&c, &invite("gone-1", 70), CLIENT, &mut out) else {
            panic!("forwarded")
        };
        let active = |m: usize| c.balancer().counters(m).map_or(0, |k| k.active());
        assert_eq!(active(m), 1);
        c.balancer().set_health(m, Health::Down, 0);
        let bye = invite("gone-1", 70)
            .replace("INVITE sip", "BYE sip")
            .replace("1 INVITE", "2 BYE")
            .replace(
                "To: <sip:svc@example.com>",
                "To: <sip:svc@example.com>;tag=t1",
            );
        let Action::ToMember(other) = handle(&c, &bye, CLIENT, &mut out) else {
            panic!("forwarded")
        };
        assert_ne!(other, m);
        assert_eq!((active(m), active(other)), (0, 0));
    }

    #[test]
    fn a_forwarded_request_that_cannot_be_delivered_is_answered_503_to_its_sender() {
        let c = core(false);
        let mut fwd = Vec::new();
        assert!(matches!(
            handle(&c, &invite("u1", 70), CLIENT, &mut fwd),
            Action::ToMember(_)
        ));
        let mut out = Vec::new();
        // rport was requested: back to the source address and port (RFC 3581 §4).
        assert_eq!(
            c.unavailable(&fwd, &mut out),
            Action::ToAddr(CLIENT.parse().expect("addr"))
        );
        let msg = crate::sip::scan(&out).expect("scan");
        assert_eq!(msg.status_code(), Some(503));
        assert!(msg.header(b"Retry-After").is_some());
        assert_eq!(msg.vias().count(), 1, "fulcrum's Via is gone");
        assert_eq!(c.counters.replies_503.load(Ordering::Relaxed), 1);
        // An ACK is never answered.
        let ack = invite("u2", 70).replace("INVITE", "ACK");
        let mut fwd = Vec::new();
        assert!(matches!(
            handle(&c, &ack, CLIENT, &mut fwd),
            Action::ToMember(_)
        ));
        assert_eq!(
            c.unavailable(&fwd, &mut out),
            Action::Drop(DropReason::AckNotForwarded)
        );
    }

    #[test]
    fn dialog_stays_on_its_member_when_another_returns() {
        // A twin core (same config, so same hashing) finds a call that ranks member 0 first.
        let probe = core(false);
        let mut out = Vec::new();
        let call = (0..)
            .map(|i| format!("aff-{i}"))
            .find(|id| handle(&probe, &invite(id, 70), CLIENT, &mut out) == Action::ToMember(0))
            .expect("some call ranks member 0 first");
        let c = core(false);
        c.balancer().set_health(0, Health::Down, 0);
        assert_eq!(
            handle(&c, &invite(&call, 70), CLIENT, &mut out),
            Action::ToMember(1)
        );
        c.balancer().set_health(0, Health::Up, 0);
        // Established on 1: it stays there although 0, its first choice, is back.
        assert_eq!(
            handle(&c, &invite(&call, 70), CLIENT, &mut out),
            Action::ToMember(1)
        );
        // A new call with the same ranking goes to 0 again.
        let other = (0..)
            .map(|i| format!("aff-new-{i}"))
            .find(|id| handle(&probe, &invite(id, 70), CLIENT, &mut out) == Action::ToMember(0))
            .expect("another call ranking 0 first");
        assert_eq!(
            handle(&c, &invite(&other, 70), CLIENT, &mut out),
            Action::ToMember(0)
        );
    }

    /// A message of `method` in dialog `call_id` (`to_tag` set when in-dialog), from `via`.
    fn request(method: &str, call_id: &str, to_tag: Option<&str>, via: &str) -> String {
        let to_tag = to_tag.map(|t| format!(";tag={t}")).unwrap_or_default();
        format!(
            "{method} sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/UDP {via};branch=z9hG4bK{method}{call_id};rport\r\nMax-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>{to_tag}\r\nCall-ID: {call_id}\r\nCSeq: 2 {method}\r\nContent-Length: 0\r\n\r\n"
        )
    }

    /// Open dialogs counted on the members.
    fn open(c: &SipCore) -> u64 {
        (0..c.member_count())
            .map(|m| c.balancer().counters(m).map_or(0, |k| k.active()))
            .sum()
    }

    /// Only requests that make (or belong to) a dialog are pinned for the dialog and counted
    /// as load: other requests are pinned for their transaction only (their retransmissions
    /// reach the same service, even under round robin), uncounted, and gone after Timer F.
    #[test]
    fn only_dialog_requests_are_pinned() {
        let c = core_with(false, "round_robin");
        let mut out = Vec::new();
        for i in 0..5 {
            let opt = request("OPTIONS", &format!("o{i}"), None, "10.0.0.1:5062");
            let Action::ToMember(m) = handle(&c, &opt, CLIENT, &mut out) else {
                panic!("not forwarded")
            };
            let msg = request("MESSAGE", &format!("m{i}"), None, "10.0.0.1:5062");
            let Action::ToMember(k) = handle(&c, &msg, CLIENT, &mut out) else {
                panic!("not forwarded")
            };
            // Retransmissions: the same services again, whatever round robin would pick.
            assert_eq!(handle(&c, &opt, CLIENT, &mut out), Action::ToMember(m));
            assert_eq!(handle(&c, &msg, CLIENT, &mut out), Action::ToMember(k));
        }
        assert_eq!(open(&c), 0, "no load counted");
        c.sweep(33_000_000_000);
        assert_eq!(c.dialogs().len(), 0, "gone after Timer F");
        for (i, method) in ["INVITE", "SUBSCRIBE", "REFER", "REGISTER"]
            .iter()
            .enumerate()
        {
            let r = request(method, &format!("d{i}"), None, "10.0.0.1:5062");
            assert!(matches!(
                handle(&c, &r, CLIENT, &mut out),
                Action::ToMember(_)
            ));
        }
        // An in-dialog request of a dialog fulcrum has not seen (after a restart, say).
        let info = request("INFO", "d9", Some("t9"), "10.0.0.1:5062");
        assert!(matches!(
            handle(&c, &info, CLIENT, &mut out),
            Action::ToMember(_)
        ));
        assert_eq!((c.dialogs().len(), open(&c)), (5, 5));
    }

    /// A CANCEL of a re-INVITE (To tag) leaves the call established; a CANCEL of the initial
    /// INVITE, and a BYE from either side, end it.
    #[test]
    fn cancel_of_a_reinvite_keeps_the_dialog_and_a_service_bye_ends_it() {
        let c = core(false);
        let mut out = Vec::new();
        let Action::ToMember(m) = handle(&c, &invite("call-1", 70), CLIENT, &mut out) else {
            panic!("not forwarded")
        };
        assert_eq!(open(&c), 1);
        let cancel_re = request("CANCEL", "call-1", Some("t1"), "10.0.0.1:5062");
        assert_eq!(
            handle(&c, &cancel_re, CLIENT, &mut out),
            Action::ToMember(m)
        );
        assert_eq!(open(&c), 1, "re-INVITE cancelled, call still up");
        // The service hangs up: routed to the client, and the call no longer counts.
        let member = c.member_addr(m).expect("member").to_string();
        let bye = request("BYE", "call-1", Some("f1"), &member)
            .replace("sip:svc@example.com SIP", "sip:a@10.0.0.1:5062 SIP");
        assert_eq!(
            handle(&c, &bye, &member, &mut out),
            Action::ToAddr("10.0.0.1:5062".parse().expect("addr"))
        );
        assert_eq!(open(&c), 0);
        // The initial INVITE's CANCEL ends a call.
        assert!(matches!(
            handle(&c, &invite("call-2", 70), CLIENT, &mut out),
            Action::ToMember(_)
        ));
        assert_eq!(open(&c), 1);
        let cancel = request("CANCEL", "call-2", None, "10.0.0.1:5062");
        assert!(matches!(
            handle(&c, &cancel, CLIENT, &mut out),
            Action::ToMember(_)
        ));
        assert_eq!(open(&c), 0);
    }

    /// A response from someone who is not a service goes only to a service's host: a forged
    /// fulcrum Via cannot make fulcrum relay datagrams to any address.
    #[test]
    fn a_response_from_a_non_member_goes_only_to_a_service() {
        let c = core(false);
        let mut out = Vec::new();
        let ours = "SIP/2.0/UDP 127.0.0.1:5060;branch=z9hG4bK-fc-0000000000000000";
        let forged = format!(
            "SIP/2.0 200 OK\r\nVia: {ours}\r\nVia: SIP/2.0/UDP 198.51.100.66:9;branch=z9hG4bKx\r\nFrom: <sip:a@x>;tag=1\r\nTo: <sip:b@y>;tag=2\r\nCall-ID: r\r\nCSeq: 1 OPTIONS\r\nContent-Length: 7\r\n\r\npayload"
        );
        assert_eq!(
            handle(&c, &forged, CLIENT, &mut out),
            Action::Drop(DropReason::NotOurs)
        );
        assert!(out.is_empty());
        assert_eq!(c.counters.not_ours.load(Ordering::Relaxed), 1);
        // The same from a service is its business (it answers a client's request).
        assert_eq!(
            handle(&c, &forged, "127.0.0.1:5071", &mut out),
            Action::ToAddr("198.51.100.66:9".parse().expect("addr"))
        );
        // A service answering from another port of its host is still a service.
        assert_eq!(
            handle(&c, &forged, "127.0.0.1:6000", &mut out),
            Action::ToAddr("198.51.100.66:9".parse().expect("addr"))
        );
        // A client's response to a service's in-dialog request goes back to the service.
        let answer = forged.replace("198.51.100.66:9", "127.0.0.1:5072");
        assert_eq!(
            handle(&c, &answer, CLIENT, &mut out),
            Action::ToAddr("127.0.0.1:5072".parse().expect("addr"))
        );
    }

    /// An ACK that cannot be forwarded is dropped and counted as such, never as a reply.
    #[test]
    fn an_unforwardable_ack_counts_no_reply() {
        let c = core(false);
        let mut out = Vec::new();
        let ack = invite("ack-1", 0).replace("INVITE", "ACK");
        assert_eq!(
            handle(&c, &ack, CLIENT, &mut out),
            Action::Drop(DropReason::AckNotForwarded)
        );
        c.balancer().set_health(0, Health::Down, 0);
        c.balancer().set_health(1, Health::Down, 0);
        let ack = invite("ack-2", 70).replace("INVITE", "ACK");
        assert_eq!(
            handle(&c, &ack, CLIENT, &mut out),
            Action::Drop(DropReason::AckNotForwarded)
        );
        assert_eq!(c.counters.acks_not_forwarded.load(Ordering::Relaxed), 2);
        assert_eq!(c.counters.replies_483.load(Ordering::Relaxed), 0);
        assert_eq!(c.counters.replies_503.load(Ordering::Relaxed), 0);
    }

    /// The fuzz finding: an INVITE of 255 header lines scans, but forwarded with fulcrum's Via
    /// and Record-Route it would have 257, which fulcrum itself would refuse when the answer
    /// came back. It is answered 513 (RFC 3261 §21.5.14) and nothing is forwarded; with 254
    /// lines it is forwarded and the forwarded request scans.
    #[test]
    fn a_request_fulcrum_could_not_take_back_is_answered_513() {
        let c = core(true);
        let mut out = Vec::new();
        let padded = |lines: usize| {
            let base = invite("hdr-1", 70);
            let n = base.matches("\r\n").count() - 2;
            let pad: String = (0..lines - n).map(|i| format!("X-Pad: {i}\r\n")).collect();
            base.replace(
                "Content-Length: 0\r\n",
                &format!("{pad}Content-Length: 0\r\n"),
            )
        };
        let big = padded(255);
        assert_eq!(
            crate::sip::scan(big.as_bytes())
                .expect("scans")
                .header_count(),
            255
        );
        assert!(matches!(
            handle(&c, &big, CLIENT, &mut out),
            Action::Reply(_)
        ));
        assert_eq!(
            crate::sip::scan(&out).expect("scan").status_code(),
            Some(513)
        );
        assert_eq!(c.counters.replies_513.load(Ordering::Relaxed), 1);
        let fits = padded(254);
        assert!(matches!(
            handle(&c, &fits, CLIENT, &mut out),
            Action::ToMember(_)
        ));
        assert_eq!(
            crate::sip::scan(&out)
                .expect("forwarded scans")
                .header_count(),
            256
        );
    }

    /// A datagram too large to carry fulcrum's additions is answered 513.
    #[test]
    fn an_oversized_datagram_request_is_answered_513() {
        let c = core(false);
        let mut out = Vec::new();
        let big = invite("big-1", 70).replace(
            "Content-Length: 0\r\n\r\n",
            &format!("Content-Length: 65200\r\n\r\n{}", "x".repeat(65_200)),
        );
        assert!(matches!(
            handle(&c, &big, CLIENT, &mut out),
            Action::Reply(_)
        ));
        assert_eq!(
            crate::sip::scan(&out).expect("scan").status_code(),
            Some(513)
        );
        assert_eq!(c.counters.replies_513.load(Ordering::Relaxed), 1);
        assert_eq!(c.dialogs().len(), 0, "nothing pinned");
    }
}

#[cfg(test)]
mod record_route_service {
    //! `fc-svc`: the dialog's service carried in fulcrum's Record-Route, so that any instance
    //! with the same services routes the dialog's later requests to it.
    use super::*;
    use crate::balancer::Health;
    use crate::config;
    use crate::sip::{Local, Transport};
    use std::sync::atomic::Ordering;

    const US: &str = "127.0.0.1:5060";
    const CLIENT: &str = "192.0.2.10:5062";

    /// One instance: three services, Record-Route on.
    fn instance() -> SipCore {
        let cfg = config::from_str(
            "t",
            "services:\n  - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }\n  - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }\n  - { name: c, address: 127.0.0.1:5073, protocol: sip-udp, hash_id: fw-c }\nvservers:\n  - { name: v, protocol: sip-udp, bind: 127.0.0.1:5060, record_route: true, services: [a, b, c] }\n",
        )
        .expect("config");
        let v = &cfg.vservers[0];
        let local = Local::from_addr(US.parse().expect("addr"), Transport::Udp);
        SipCore::new(SipParams::of(
            &cfg,
            v,
            local,
            Arc::new(Balancer::new(&cfg, v)),
        ))
    }

    fn send(c: &SipCore, text: &str) -> (Option<usize>, Vec<u8>) {
        send_at(c, text, 0)
    }

    fn send_at(c: &SipCore, text: &str, now: Nanos) -> (Option<usize>, Vec<u8>) {
        let mut out = Vec::new();
        let a = c.handle_datagram(
            text.as_bytes(),
            CLIENT.parse().expect("src"),
            US.parse().expect("dst"),
            now,
            &mut out,
        );
        match a {
            Action::ToMember(m) => (Some(m), out),
            _ => (None, out),
        }
    }

    fn invite(call_id: &str) -> String {
        format!(
            "INVITE sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1:5062;branch=z9hG4bK{call_id}\r\nMax-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n"
        )
    }

    fn bye(call_id: &str, route: &str) -> String {
        format!(
            "BYE sip:svc@10.0.0.9 SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1:5062;branch=z9hG4bKbye{call_id}\r\nRoute: {route}\r\nMax-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>;tag=s1\r\nCall-ID: {call_id}\r\nCSeq: 2 BYE\r\nContent-Length: 0\r\n\r\n"
        )
    }

    /// The Record-Route value fulcrum wrote into a forwarded request.
    fn record_route(out: &[u8]) -> String {
        let msg = crate::sip::scan(out).expect("forwarded request scans");
        String::from_utf8_lossy(msg.record_route().expect("Record-Route")).into_owned()
    }

    #[test]
    fn record_route_names_the_chosen_service_by_digest_only() {
        let c = instance();
        let (m, out) = send(&c, &invite("rr-1"));
        let m = m.expect("forwarded");
        let rr = record_route(&out);
        let id = c.balancer().members()[m].id_hash;
        let want = format!(
            "<sip:127.0.0.1:5060;lr;fc-svc={:016x}>",
            hash::service_digest(id)
        );
        assert_eq!(rr, want);
        // Neither the address nor the position of the service is in it.
        assert!(!rr.contains(":507"), "{rr}");
    }

    /// A dialog set up on instance A while its first-ranked service was disabled there
    /// reaches the same service through instance B, which has every service UP and would
    /// hash the Call-ID elsewhere, and which never saw the dialog.
    #[test]
    fn another_instance_with_another_health_view_routes_the_dialog_to_its_service() {
        let (a, b) = (instance(), instance());
        for i in 0..40 {
            let call = format!("cross-{i}");
            // Where B's hash puts the call (every service UP there).
            let ranked = send(&b, &invite(&call)).0.expect("b chooses");
            // On A that service is disabled: A sets the dialog up on another one.
            a.balancer().set_health(ranked, Health::OutOfService, 0);
            let (on_a, out) = send(&a, &invite(&call));
            a.balancer().set_health(ranked, Health::Up, 0);
            let on_a = on_a.expect("a chooses another");
            assert_ne!(on_a, ranked);
            let fresh = instance();
            let rr = record_route(&out);
            // The dialog's BYE reaches B (which pinned the call elsewhere itself) and an
            // instance that never saw the call: both follow the Route to A's choice.
            assert_eq!(send(&b, &bye(&call, &rr)).0, Some(on_a), "{call}: {rr}");
            assert_eq!(send(&fresh, &bye(&call, &rr)).0, Some(on_a), "{call}: {rr}");
        }
        assert_eq!(
            b.counters.routed_by_record_route.load(Ordering::Relaxed),
            40
        );
    }

    /// A request refused 513 (too many lines once forwarded) is refused before a member is
    /// chosen: no dialog is pinned, nothing is counted as load (a flood of such INVITEs once
    /// filled the services' counts for the idle timeout).
    #[test]
    fn a_request_refused_513_leaves_nothing_counted() {
        let c = instance();
        let extra: String = (0..crate::sip::MAX_HEADERS - 8)
            .map(|i| format!("X-H{i}: v\r\n"))
            .collect();
        let big =
            invite("big-1").replace("Content-Length: 0", &format!("{extra}Content-Length: 0"));
        assert!(
            crate::sip::scan(big.as_bytes()).is_ok(),
            "the request itself scans"
        );
        let (to_member, out) = send(&c, &big);
        assert_eq!(to_member, None);
        let reply = crate::sip::scan(&out).expect("a reply");
        assert_eq!(reply.status_code(), Some(513));
        let loads: Vec<u64> = (0..3)
            .map(|m| c.balancer().counters(m).map_or(0, |k| k.active()))
            .collect();
        assert_eq!(loads, [0, 0, 0]);
    }

    /// In-dialog requests routed by `fc-svc` keep the local pin fresh: a call longer than
    /// the idle timeout (1 h here) stays counted on its service while requests flow.
    #[test]
    fn requests_routed_by_record_route_keep_a_long_call_counted() {
        const MIN: Nanos = 60 * 1_000_000_000;
        let c = instance();
        let (m, out) = send_at(&c, &invite("long-1"), 0);
        let m = m.expect("forwarded");
        let rr = record_route(&out);
        let info = bye("long-1", &rr)
            .replace("BYE sip", "INFO sip")
            .replace("2 BYE", "3 INFO");
        assert_eq!(send_at(&c, &info, 40 * MIN).0, Some(m));
        c.sweep(70 * MIN);
        let active = c.balancer().counters(m).map_or(0, |k| k.active());
        assert_eq!(active, 1, "swept while its requests still flowed");
        assert_eq!(send_at(&c, &bye("long-1", &rr), 71 * MIN).0, Some(m));
        assert_eq!(c.balancer().counters(m).map_or(9, |k| k.active()), 0);
    }

    #[test]
    fn forged_stale_or_foreign_values_fall_back_to_the_normal_choice() {
        let c = instance();
        let normal = send(&c, &bye("fb-1", "<sip:10.9.9.9;lr>")).0;
        assert!(normal.is_some());
        for route in [
            // A digest no member has.
            "<sip:127.0.0.1:5060;lr;fc-svc=0123456789abcdef>".to_owned(),
            // Not 16 hex digits.
            "<sip:127.0.0.1:5060;lr;fc-svc=zz>".to_owned(),
            "<sip:127.0.0.1:5060;lr;fc-svc=0123456789abcdef0>".to_owned(),
        ] {
            assert_eq!(send(&c, &bye("fb-1", &route)).0, normal, "{route}");
        }
        assert_eq!(c.counters.routed_by_record_route.load(Ordering::Relaxed), 0);
        // A real digest, but in a Route that is not fulcrum's: not ours to follow.
        let d = hash::service_digest(c.balancer().members()[2].id_hash);
        let foreign = format!("<sip:10.9.9.9;lr;fc-svc={d:016x}>");
        assert_eq!(send(&c, &bye("fb-1", &foreign)).0, normal);
        assert_eq!(c.counters.routed_by_record_route.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_named_service_that_is_down_is_not_followed_but_a_disabled_one_is() {
        let c = instance();
        let d = hash::service_digest(c.balancer().members()[1].id_hash);
        let route = format!("<sip:127.0.0.1:5060;lr;fc-svc={d:016x}>");
        assert_eq!(send(&c, &bye("dn-1", &route)).0, Some(1));
        c.balancer().set_health(1, Health::OutOfService, 0);
        assert_eq!(send(&c, &bye("dn-2", &route)).0, Some(1));
        c.balancer().set_health(1, Health::Down, 0);
        let other = send(&c, &bye("dn-3", &route)).0;
        assert!(other.is_some_and(|m| m != 1), "{other:?}");
    }
}

#[cfg(test)]
mod bridge {
    //! The transports bridge: a sip-tcp vserver over sip-udp services. Each leg gets its own
    //! Via; dialogs are double record-routed (RFC 5658 §3.2) and either entry is "us".
    use super::*;
    use crate::config;
    use std::sync::atomic::Ordering;

    const US: &str = "127.0.0.1:5060";
    const LEG: &str = "127.0.0.1:40000";
    const CLIENT: &str = "192.0.2.10:5062";
    const CONN: u64 = 0xabc;

    fn core(services: &str) -> SipCore {
        core_with_leg(
            services,
            Local::from_addr(LEG.parse().expect("addr"), Transport::Udp),
        )
    }

    /// A sip-tcp vserver over services `a` and `b` of protocol `services`, its other leg `leg`.
    fn core_with_leg(services: &str, leg: Local) -> SipCore {
        let cfg = config::from_str(
            "t",
            &format!("services:\n  - {{ name: a, address: 127.0.0.1:5071, protocol: {services} }}\n  - {{ name: b, address: 127.0.0.1:5072, protocol: {services} }}\nvservers:\n  - {{ name: v, protocol: sip-tcp, bind: {US}, record_route: true, services: [a, b] }}\n"),
        )
        .expect("config");
        let v = &cfg.vservers[0];
        let local = Local::from_addr(US.parse().expect("addr"), Transport::Tcp);
        SipCore::new(
            SipParams::of(&cfg, v, local, Arc::new(Balancer::new(&cfg, v))).with_legs(vec![leg]),
        )
    }

    fn from_client(c: &SipCore, text: &str, out: &mut Vec<u8>) -> Action {
        c.handle(
            text.as_bytes(),
            Origin::Client { conn: Some(CONN) },
            CLIENT.parse().expect("src"),
            US.parse().expect("dst"),
            0,
            out,
        )
    }

    fn from_member(c: &SipCore, m: usize, text: &str, out: &mut Vec<u8>) -> Action {
        let src = c.member_addr(m).expect("member");
        c.handle(
            text.as_bytes(),
            Origin::Member(m),
            src,
            LEG.parse().expect("dst"),
            0,
            out,
        )
    }

    fn invite(call_id: &str) -> String {
        format!(
            "INVITE sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/TCP 192.0.2.10:5062;branch=z9hG4bK{call_id}\r\nMax-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContact: <sip:a@192.0.2.10:5062;transport=tcp>\r\nContent-Length: 0\r\n\r\n"
        )
    }

    fn text(out: &[u8]) -> String {
        String::from_utf8_lossy(out).into_owned()
    }

    /// Header values of `name` in order (each comma-separated value on its own).
    fn values(out: &[u8], name: &str) -> Vec<String> {
        let msg = crate::sip::scan(out).expect("scans");
        msg.headers()
            .filter(|h| h.name.eq_ignore_ascii_case(name.as_bytes()))
            .flat_map(|h| {
                String::from_utf8_lossy(h.value)
                    .split(',')
                    .map(|v| v.trim().to_owned())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The record-routed INVITE: which member, the two entries, the forwarded bytes.
    fn set_up(c: &SipCore, call_id: &str) -> (usize, Vec<String>, Vec<u8>) {
        let mut out = Vec::new();
        let Action::ToMember(m) = from_client(c, &invite(call_id), &mut out) else {
            panic!("not forwarded: {}", text(&out))
        };
        (m, values(&out, "Record-Route"), out)
    }

    /// A stream client's request that fits its connection but, once fulcrum's Via and
    /// Record-Routes are added, not a datagram, toward a sip-udp member: 513 (RFC 3261
    /// §21.5.14), nothing forwarded, the dialog it pinned ended at once (not counted). It
    /// takes a long advertised name on the UDP leg for the additions to pass the 29 bytes
    /// between the two limits; before, such a request went to the member and its send failed.
    #[test]
    fn a_request_too_long_for_a_datagram_toward_a_udp_member_is_answered_513() {
        let name = format!("{}.example", "leg".repeat(60));
        let c = core_with_leg("sip-udp", Local::new(&name, 40000, Transport::Udp));
        // Dialogs counted on both members.
        let active = |c: &SipCore| {
            (0..2)
                .filter_map(|m| c.balancer().counters(m).map(|k| k.active()))
                .sum::<u64>()
        };
        let with_body = |call_id: &str, len: usize| {
            invite(call_id).replace(
                "Content-Length: 0\r\n\r\n",
                &format!("Content-Length: {len}\r\n\r\n{}", "x".repeat(len)),
            )
        };
        // What forwarding adds to this INVITE.
        let mut out = Vec::new();
        let small = with_body("probe", 10);
        assert!(matches!(
            from_client(&c, &small, &mut out),
            Action::ToMember(_)
        ));
        let growth = out.len() - small.len();
        // A request that grows to 65,520 bytes: under the stream limit, over a datagram's.
        let big = with_body("big-1", 65_520 - growth - small.len() + 10);
        assert!(big.len() <= crate::sip::DEFAULT_MAX_MESSAGE - MAX_GROWTH);
        let opened = active(&c);
        let a = from_client(&c, &big, &mut out);
        assert!(matches!(a, Action::Reply(_)), "{a:?}");
        assert_eq!(
            crate::sip::scan(&out).expect("scan").status_code(),
            Some(513)
        );
        assert_eq!(c.counters.replies_513.load(Ordering::Relaxed), 1);
        assert_eq!(c.counters.requests_forwarded.load(Ordering::Relaxed), 1);
        assert_eq!(active(&c), opened, "not counted");
        // Its retransmission is refused alike, and counts nothing either.
        assert!(matches!(from_client(&c, &big, &mut out), Action::Reply(_)));
        assert_eq!(c.counters.replies_513.load(Ordering::Relaxed), 2);
        assert_eq!(active(&c), opened);
    }

    #[test]
    fn a_request_to_a_udp_member_carries_the_udp_leg_via_and_two_record_routes() {
        let c = core("sip-udp");
        assert_eq!(c.member_transport(0), Transport::Udp);
        let (m, rr, out) = set_up(&c, "br-1");
        let vias = values(&out, "Via");
        assert!(
            vias[0].starts_with("SIP/2.0/UDP 127.0.0.1:40000;branch=z9hG4bK-fc-"),
            "{vias:?}"
        );
        assert!(vias[0].ends_with(";fc-conn=0000000000000abc"), "{vias:?}");
        let d = hash::service_digest(c.balancer().members()[m].id_hash);
        assert_eq!(
            rr,
            [
                format!("<sip:127.0.0.1:40000;lr;fc-svc={d:016x}>"),
                "<sip:127.0.0.1:5060;transport=tcp;lr>".to_owned()
            ]
        );
    }

    #[test]
    fn the_services_answer_on_the_udp_leg_goes_to_the_client_connection() {
        let c = core("sip-udp");
        let (m, _, fwd) = set_up(&c, "br-2");
        let vias = values(&fwd, "Via").join(", ");
        let answer = format!(
            "SIP/2.0 200 OK\r\nVia: {vias}\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>;tag=s1\r\nCall-ID: br-2\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n"
        );
        let mut out = Vec::new();
        assert_eq!(from_member(&c, m, &answer, &mut out), Action::ToConn(CONN));
        assert_eq!(values(&out, "Via").len(), 1, "{}", text(&out));
    }

    /// The client's BYE names both entries in its Route set (reversed Record-Route, the
    /// client leg first): both are removed, and `fc-svc` in the second names the service.
    #[test]
    fn the_clients_in_dialog_request_follows_fc_svc_past_both_entries() {
        let c = core("sip-udp");
        let (m, rr, _) = set_up(&c, "br-3");
        let route_sets = [
            format!("Route: {}, {}\r\n", rr[1], rr[0]),
            format!("Route: {}\r\nRoute: {}\r\n", rr[1], rr[0]),
            format!("Route: {}, {}, <sip:10.9.9.9;lr>\r\n", rr[1], rr[0]),
        ];
        for (i, routes) in route_sets.iter().enumerate() {
            // Another instance of the same pool, which never saw the call.
            let fresh = core("sip-udp");
            let bye = format!(
                "BYE sip:svc@10.0.0.9 SIP/2.0\r\nVia: SIP/2.0/TCP 192.0.2.10:5062;branch=z9hG4bKbye{i}\r\n{routes}Max-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>;tag=s1\r\nCall-ID: br-3\r\nCSeq: 2 BYE\r\nContent-Length: 0\r\n\r\n"
            );
            let mut out = Vec::new();
            assert_eq!(
                from_client(&fresh, &bye, &mut out),
                Action::ToMember(m),
                "{routes}"
            );
            assert_eq!(
                fresh
                    .counters
                    .routed_by_record_route
                    .load(Ordering::Relaxed),
                1
            );
            let left = values(&out, "Route");
            if i == 2 {
                assert_eq!(left, ["<sip:10.9.9.9;lr>"], "{}", text(&out));
            } else {
                assert!(left.is_empty(), "{}", text(&out));
            }
            assert!(values(&out, "Via")[0].starts_with("SIP/2.0/UDP 127.0.0.1:40000;"));
        }
    }

    /// The callee hangs up: its BYE arrives on the UDP leg with the Route set in Record-Route
    /// order (the service leg first), leaves on the client leg with the client leg's Via
    /// toward the client's Contact, and the client's 200 goes back to the service.
    #[test]
    fn the_services_in_dialog_request_goes_out_on_the_client_leg() {
        let c = core("sip-udp");
        let (m, rr, _) = set_up(&c, "br-4");
        let svc = c.member_addr(m).expect("member");
        let bye = format!(
            "BYE sip:a@192.0.2.10:5062;transport=tcp SIP/2.0\r\nVia: SIP/2.0/UDP {svc};branch=z9hG4bKsvcbye\r\nRoute: {}, {}\r\nMax-Forwards: 70\r\nFrom: <sip:svc@example.com>;tag=s1\r\nTo: <sip:a@x>;tag=f1\r\nCall-ID: br-4\r\nCSeq: 1 BYE\r\nContent-Length: 0\r\n\r\n",
            rr[0], rr[1]
        );
        let mut out = Vec::new();
        assert_eq!(
            from_member(&c, m, &bye, &mut out),
            Action::ToAddr(CLIENT.parse().expect("addr"))
        );
        assert!(values(&out, "Route").is_empty(), "{}", text(&out));
        let vias = values(&out, "Via");
        assert!(
            vias[0].starts_with("SIP/2.0/TCP 127.0.0.1:5060;branch=z9hG4bK-fc-"),
            "{vias:?}"
        );
        let ok = format!(
            "SIP/2.0 200 OK\r\nVia: {}\r\nFrom: <sip:svc@example.com>;tag=s1\r\nTo: <sip:a@x>;tag=f1\r\nCall-ID: br-4\r\nCSeq: 1 BYE\r\nContent-Length: 0\r\n\r\n",
            vias.join(", ")
        );
        let mut back = Vec::new();
        assert_eq!(from_client(&c, &ok, &mut back), Action::ToAddr(svc));
    }

    /// Members of the vserver's own transport are not bridged: one Record-Route, as before,
    /// and the core has no other leg.
    #[test]
    fn members_of_the_vservers_transport_are_not_bridged() {
        let c = core("sip-tcp");
        assert_eq!(c.member_transport(0), Transport::Tcp);
        assert!(!c.local().is_bridged());
        let (m, rr, out) = set_up(&c, "br-5");
        let d = hash::service_digest(c.balancer().members()[m].id_hash);
        assert_eq!(
            rr,
            [format!(
                "<sip:127.0.0.1:5060;transport=tcp;lr;fc-svc={d:016x}>"
            )]
        );
        assert!(values(&out, "Via")[0].starts_with("SIP/2.0/TCP 127.0.0.1:5060;"));
        // A second Route naming fulcrum is not skipped off a bridge: a loop.
        let bye = format!(
            "BYE sip:a@192.0.2.10 SIP/2.0\r\nVia: SIP/2.0/TCP 127.0.0.1:5071;branch=z9hG4bKx\r\nRoute: {}, <sip:127.0.0.1:5060;transport=tcp;lr>\r\nMax-Forwards: 70\r\nFrom: <sip:svc@example.com>;tag=s1\r\nTo: <sip:a@x>;tag=f1\r\nCall-ID: br-5\r\nCSeq: 1 BYE\r\nContent-Length: 0\r\n\r\n",
            rr[0]
        );
        let mut out = Vec::new();
        assert_eq!(
            from_member(&c, m, &bye, &mut out),
            Action::Drop(DropReason::Loop)
        );
    }
}
