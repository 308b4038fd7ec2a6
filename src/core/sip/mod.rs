//! The SIP decision of a vserver, shared by `sip-udp` and `sip-tcp`: a stateless SIP proxy
//! (RFC 3261 §16.11, RFC 3581). PURE apart from reading its own atomics.
//!
//! [`SipCore::handle`] is the whole per-message decision and rewrite: bytes, where they came
//! from and `now` in; an [`Action`] and the bytes to send out. It touches no socket, so it
//! is tested without one; only the transport shells (`proxy::sip_udp`, `proxy::sip_stream`) differ.

use crate::balancer::{Balancer, KeyInput};
use crate::config::{HashParams, Method};
use crate::dialog::{Answerer, Change, Count, DialogTable};
use crate::hash;
use crate::key::{self, KeyOutcome, Payload, RequestCtx};
use crate::sip::{
    self, Local, MaxForwards, Reply, RequestRewrite, RewriteError, SipMethod, SipMsg, Transport,
    build_reply, build_response, forward_request, forward_response, reply_target, request_target,
};
use crate::stats::Nanos;
use crate::stats::bump;
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
    /// Part of a request fulcrum holds (a retransmission, an ACK, a failed attempt's
    /// answer): handled by its transaction (counted there).
    Absorbed,
    /// A routing rule (or the default) says `drop: true` (counted per rule).
    Routed,
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
    /// A service's request for the client connection with this id, named by a flow token
    /// (streams): when the connection is gone the service gets 430 ([`SipCore::flow_failed`]).
    ToFlow(u64),
    /// fulcrum's own reply (400 / 483 / 503): back to the sender, at this address on
    /// datagrams (RFC 3581 aware), on the same connection on streams.
    Reply(SocketAddr),
    Drop(DropReason),
}

/// A decision ([`Action`]) and what the core's scan read of the message's Call-ID, for a
/// shell that captures the message and what it sends of it (docs/capture.md) and would
/// otherwise search the Call-ID again in each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision<'a> {
    pub action: Action,
    pub call_id: Scanned<'a>,
}

/// The Call-ID of a message the core decided on, as its scan read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scanned<'a> {
    /// The message was not scanned (refused by the access lists), or only leniently to be
    /// answered: nothing is vouched for.
    No,
    /// The message's Call-ID (`None`: it has none). The bytes its decision left in `out`
    /// carry the same: forwarded, the Call-ID is copied (RFC 3261 §16.6 step 1, §16.7 step
    /// 9); fulcrum's own answer copies the request's (§8.2.6.2).
    CallId(Option<&'a [u8]>),
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
    /// REGISTERs forwarded with fulcrum's Path (a flow token).
    pub paths_added: AtomicU64,
    /// Requests from services routed to a client by a flow token.
    pub routed_by_flow: AtomicU64,
    /// Requests from services refused for a flow token fulcrum did not make (403).
    pub flow_forged: AtomicU64,
    /// Requests from services whose flow is gone (430).
    pub flow_failed: AtomicU64,
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
    /// Messages with more header lines than the scanner reads (`sip::MAX_HEADERS`), requests
    /// and responses: a client's request is answered 513 where it can be, the rest dropped.
    pub over_header_limit: AtomicU64,
    /// Stream messages longer than a frame may be (`sip::DEFAULT_MAX_MESSAGE` from a client):
    /// a client's request answered 513 like the above; the connection closes either way.
    pub over_size_limit: AtomicU64,
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
    /// `local` as it faces members on the vserver's own transport from `service_source`
    /// ([`Local::sending_from`]), with that address; `None` without one.
    toward_services: Option<(Local, SocketAddr)>,
    record_route: bool,
    method: Method,
    hash_params: HashParams,
    balancer: Arc<Balancer>,
    dialogs: DialogTable,
    /// The core this one replaces, while a reload hands over to it ([`SipCore::begin_handover`]).
    handover: arc_swap::ArcSwapOption<HandOver>,
    /// `handover` is set: read first, so a message outside a reload pays one relaxed load, not
    /// the `ArcSwapOption`'s.
    handing_over: std::sync::atomic::AtomicBool,
    /// Address of each member (index = member index).
    member_addrs: Vec<SocketAddr>,
    /// `fc-svc` digest of each member (index = member index).
    digests: Vec<u64>,
    /// Access lists and flood control ([`SipCore::with_edge`]; open by default).
    edge: crate::edge::Edge,
    /// Failover of requests outside a dialog ([`SipCore::with_failover`]; off by default).
    failover: Option<transaction::Failover>,
    /// The failover of each routing rule's pool (pool `k` is `pool_failovers[k - 1]`), its
    /// own or the vserver's as the config resolved it: a request routed there fails over
    /// with it (docs/routing.md).
    pool_failovers: Vec<Option<transaction::Failover>>,
    /// Some rule's pool fails over otherwise than the vserver's own: a held request's pool
    /// is looked up ([`SipCore::with_failover`] sets it).
    pools_differ: bool,
    /// The requests held for failover.
    transactions: Arc<stateful::Transactions>,
    /// The keys of flow tokens ([`SipCore::with_flows`]; none: no Path, no token honoured).
    flows: Option<Arc<sip::flow::FlowKeys>>,
    /// When a REGISTER gets fulcrum's Path.
    path: crate::config::PathMode,
    pub counters: SipCounters,
}

impl std::fmt::Debug for SipCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SipCore")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// A reload's hand-over from the core a new one replaces ([`SipCore::begin_handover`]).
struct HandOver {
    old: Arc<SipCore>,
    /// New member index by old member index.
    to: Vec<Option<u32>>,
    /// The keys the migration pass copied, sorted.
    migrated: Vec<u64>,
    /// Whether the new core counts the load of the entries it takes.
    counts: bool,
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
    /// The failover of each routing rule's pool ([`crate::config::RoutePool::failover`]).
    pub pool_failovers: Vec<Option<crate::config::Failover>>,
    /// The address requests toward members on the vserver's own transport leave from and
    /// name in their Via (`service_source`, port resolved); `None`: `local`'s.
    pub service_source: Option<SocketAddr>,
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
            service_source: None,
            pool_failovers: v.route_pools.iter().map(|p| p.failover.clone()).collect(),
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

    /// Requests toward members on the vserver's own transport leave from `addr` and name it
    /// in their Via, so that their answers come back to this instance (`service_source`).
    pub fn with_service_source(mut self, addr: Option<SocketAddr>) -> SipParams {
        self.service_source = addr;
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
        Protocol::SipWs => Some(Transport::Ws),
        Protocol::SipWss => Some(Transport::Wss),
        Protocol::Udp | Protocol::Tcp | Protocol::Http | Protocol::Ip => None,
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
        // A Via naming `service_source` is fulcrum's on every leg.
        let (p_local, p_legs) = match p.service_source {
            Some(a) => (
                p.local.with_alias(a),
                p.legs.into_iter().map(|l| l.with_alias(a)).collect(),
            ),
            None => (p.local, p.legs),
        };
        let p = SipParams {
            local: p_local,
            legs: p_legs,
            ..p
        };
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
                    l.clone().bridged_with(&others).branching_as(&p.local)
                })
                .collect();
            (p.local.bridged_with(&p.legs), legs, member_leg)
        } else {
            (p.local, Vec::new(), Vec::new())
        };
        let toward_services = p.service_source.map(|a| (local.sending_from(a), a));
        SipCore {
            digests,
            edge: crate::edge::Edge::default(),
            name: p.name,
            toward_services,
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
            handover: arc_swap::ArcSwapOption::empty(),
            handing_over: std::sync::atomic::AtomicBool::new(false),
            member_addrs: p.member_addrs,
            failover: None,
            pools_differ: p.pool_failovers.iter().any(Option::is_some),
            pool_failovers: p.pool_failovers,
            transactions: Arc::default(),
            flows: None,
            path: crate::config::PathMode::Off,
            counters: SipCounters::default(),
        }
    }

    pub fn balancer(&self) -> &Arc<Balancer> {
        &self.balancer
    }

    /// The core with flow tokens signed and verified with `keys`, bound to this vserver's
    /// name (a token of another vserver is refused), and Path added to REGISTERs as `path`
    /// says (docs/sip.md, "Path and flow tokens").
    pub fn with_flows(
        mut self,
        keys: Arc<sip::flow::FlowKeys>,
        path: crate::config::PathMode,
    ) -> SipCore {
        self.flows = Some(Arc::new(keys.for_listener(&self.name)));
        self.path = path;
        self
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

    /// The address requests toward members on the vserver's own transport leave from
    /// (`service_source`), when it is not the vserver's.
    pub fn service_source(&self) -> Option<SocketAddr> {
        self.toward_services.as_ref().map(|(_, a)| *a)
    }

    /// fulcrum's identity in a request toward member `m`: its leg's on another transport, else
    /// the vserver's own as it faces services (`service_source`).
    fn identity_toward(&self, m: usize) -> &Local {
        self.leg_of(m).unwrap_or_else(|| {
            self.toward_services
                .as_ref()
                .map_or(&self.local, |(l, _)| l)
        })
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

    /// Expire idle dialogs and pending requests past their transaction; each stops counting
    /// toward its member's load.
    pub fn sweep(&self, now: Nanos) -> usize {
        self.dialogs.sweep(now / 1_000_000, |c| self.tally(c))
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
        self.decide_datagram(buf, src, dst, now, out).action
    }

    /// [`SipCore::handle_datagram`], with the Call-ID its scan read.
    pub fn decide_datagram<'a>(
        &self,
        buf: &'a [u8],
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
    ) -> Decision<'a> {
        let origin = self.datagram_origin(src);
        self.decide(buf, origin, src, dst, now, out)
    }

    /// Who sent a datagram from `src`: a member reached over UDP, or a client (a datagram from
    /// the address of a stream member, a sip-udp vserver's bridge where that member's traffic
    /// arrives on its link, is a client's).
    fn datagram_origin(&self, src: SocketAddr) -> Origin {
        match self.member_of(src) {
            Some(m) if self.member_leg.is_empty() || self.member_transport(m) == Transport::Udp => {
                Origin::Member(m)
            }
            _ => Origin::Client { conn: None },
        }
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
        self.decide(buf, origin, src, dst, now, out).action
    }

    /// [`SipCore::handle`], with the Call-ID its scan read.
    pub fn decide<'a>(
        &self,
        buf: &'a [u8],
        origin: Origin,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
    ) -> Decision<'a> {
        out.clear();
        let not_scanned = |action| Decision {
            action,
            call_id: Scanned::No,
        };
        if self.refused_by_acl(origin, src) {
            return not_scanned(Action::Drop(DropReason::Acl));
        }
        let msg = match sip::scan(buf) {
            Ok(m) => m,
            Err(e) => return not_scanned(self.unscannable(buf, e, origin, src, out)),
        };
        Decision {
            action: self.handle_scanned(&msg, origin, src, dst, now, out),
            call_id: Scanned::CallId(msg.call_id()),
        }
    }

    /// The access lists, before anything is parsed; a service's traffic is never checked.
    fn refused_by_acl(&self, origin: Origin, src: SocketAddr) -> bool {
        matches!(origin, Origin::Client { .. })
            && self.edge.has_acl()
            && !self.is_member_ip(src)
            && !self.edge.admits(src.ip())
    }

    /// [`SipCore::handle`] for a message already scanned (and past the access lists).
    fn handle_scanned(
        &self,
        msg: &SipMsg<'_>,
        origin: Origin,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
    ) -> Action {
        out.clear();
        let msg = *msg;
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
            let action = self.response(&msg, from_member, out);
            if from_member && matches!(action, Action::ToAddr(_) | Action::ToConn(_)) {
                self.track_answer(&msg, self.answerer(origin, src), now);
            }
            action
        }
    }

    /// Whether `addr`'s IP is the IP of a member.
    pub(crate) fn is_member_ip(&self, addr: SocketAddr) -> bool {
        let ip = addr.ip().to_canonical();
        self.member_addrs.iter().any(|m| m.ip() == ip)
    }

    /// From now until [`SipCore::end_handover`], this core (about to replace `old`) brings a
    /// dialog's entry up to date from `old`'s table when a message of it comes, taking it
    /// when it has none ([`DialogTable::pull_from`]): one set up or answered on `old` after
    /// the migration pass (`migrated`: the keys it copied, sorted) keeps its service and its
    /// count though its next request is handled here before the catch-up pass. `to`
    /// renumbers `old`'s members (`None`: the service left); `counts`: this core counts the
    /// load of what it takes (its balancer counts afresh; one sharing `old`'s counters
    /// already has it).
    pub(crate) fn begin_handover(
        &self,
        old: &Arc<SipCore>,
        to: Vec<Option<u32>>,
        migrated: Vec<u64>,
        counts: bool,
    ) {
        self.handover.store(Some(Arc::new(HandOver {
            old: Arc::clone(old),
            to,
            migrated,
            counts,
        })));
        self.handing_over
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// The hand-over is over (the catch-up pass has run): nothing more is taken from the old
    /// core, which is let go.
    pub(crate) fn end_handover(&self) {
        self.handing_over
            .store(false, std::sync::atomic::Ordering::Release);
        self.handover.store(None);
    }

    /// During a hand-over, the old core's entry of Call-ID hash `h`: taken when this core has
    /// none, else what the old core did to it since carried here ([`SipCore::begin_handover`],
    /// [`DialogTable::pull_from`]). One load when there is no hand-over.
    fn pull(&self, h: u64, now_ms: u64) {
        if !self.handing_over.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let g = self.handover.load();
        let Some(ho) = g.as_ref() else {
            return;
        };
        let mut changed = Vec::new();
        let taken = self.dialogs.pull_from(
            ho.old.dialogs(),
            h,
            now_ms,
            |m| ho.to.get(m as usize).copied().flatten(),
            &ho.migrated,
            &mut changed,
        );
        if ho.counts {
            if let Some((m, Some(count))) = taken {
                self.tally(Change::Open(m, count));
            }
            for c in changed {
                self.tally(c);
            }
        }
    }

    /// Pin the request of Call-ID hash `h` and CSeq number `cseq` to `member`: pending there
    /// until a 2xx confirms its dialog (moved from the member it was on, if any).
    fn pin(&self, h: u64, member: u32, cseq: u32, now_ms: u64) {
        self.dialogs.put(h, member, cseq, now_ms, |c| self.tally(c));
    }

    /// Carry out a change of the load the dialog table counts.
    pub(crate) fn tally(&self, change: Change) {
        let (member, count, open) = match change {
            Change::Open(m, c) => (m, c, true),
            Change::Close(m, c) => (m, c, false),
        };
        let Some(c) = self.balancer.counters(member as usize) else {
            return;
        };
        match (count, open) {
            (Count::Active, true) => c.open(),
            (Count::Active, false) => c.close(),
            (Count::Pending, true) => c.open_pending(),
            (Count::Pending, false) => c.close_pending(),
        }
    }

    /// A service's response on its way to the client: the answer to a request that pinned its
    /// Call-ID confirms the dialog (2xx), holds the request (1xx) or ends it (above 2xx),
    /// `crate::dialog`. The answers to a BYE or CANCEL (whose CSeq number is the INVITE's)
    /// are passed over without a look-up.
    pub(super) fn track_answer(&self, msg: &SipMsg<'_>, by: Answerer, now: Nanos) {
        let (Some(code), Some(cseq), Some(call_id)) =
            (msg.status_code(), msg.cseq(), msg.call_id())
        else {
            return;
        };
        if matches!(
            SipMethod::from_bytes(cseq.method),
            SipMethod::Bye | SipMethod::Cancel | SipMethod::Ack
        ) {
            return;
        }
        let h = hash::key_hash(call_id);
        self.pull(h, now / 1_000_000);
        self.dialogs
            .answered(h, cseq.seq, code, by, now / 1_000_000, |c| self.tally(c));
    }

    /// Who sent a response from `src`, as far as addresses tell: the member at that address,
    /// else the only member at that IP (a service may answer from another port).
    fn answerer(&self, origin: Origin, src: SocketAddr) -> Answerer {
        if let Origin::Member(m) = origin {
            return u32::try_from(m).map_or(Answerer::Unknown, Answerer::Likely);
        }
        let at = self.member_of(src).or_else(|| {
            let ip = src.ip().to_canonical();
            let mut same = self
                .member_addrs
                .iter()
                .enumerate()
                .filter(|(_, a)| a.ip() == ip);
            match (same.next(), same.next()) {
                (Some((m, _)), None) => Some(m),
                _ => None,
            }
        });
        at.and_then(|m| u32::try_from(m).ok())
            .map_or(Answerer::Unknown, Answerer::Likely)
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
            let (h, now_ms) = (hash::key_hash(c), now / 1_000_000);
            self.pull(h, now_ms);
            self.dialogs.get(h, now_ms).is_none()
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
        self.pull(h, now_ms);
        self.dialogs.end(h, now_ms, |c| self.tally(c));
    }
}

mod checks;
mod requests;
pub use requests::request_key;
mod responses;
pub mod stateful;
pub mod transaction;

#[cfg(test)]
mod bridge;
#[cfg(test)]
mod record_route_service;
#[cfg(test)]
mod routes;
#[cfg(test)]
mod tests;
