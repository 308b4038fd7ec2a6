//! Outgoing bytes and routing decisions of a stateless SIP proxy. PURE.
//!
//! Every function reads a scanned [`SipMsg`] and writes into a caller-owned [`BufMut`]
//! (a reused `Vec<u8>` or `BytesMut`), so the per-message cost is one copy of the message and
//! no allocation once the buffer has grown. Bytes that the proxy has no reason to change are
//! copied verbatim: a stateless proxy must not disturb what it does not understand
//! (RFC 3261 §16.6 step 1).

pub use super::local::{Local, Transport};
use super::text::{dec, hex16, ip_text, parse_hex};
use std::net::{IpAddr, SocketAddr};

use bytes::BufMut;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::scan::{
    CommaValues, HeaderName, Indexed, MAX_HEADERS, MaxForwards, Rport, SipMethod, SipMsg, Span,
    Via, parse_ip, parse_name_addr, parse_uri, parse_via,
};

/// Branch prefix of fulcrum's Via: the RFC 3261 §8.1.1.7 magic cookie plus a marker that lets
/// a response be recognised as ours without transaction state.
pub const BRANCH_PREFIX: &[u8] = b"z9hG4bK-fc-";

/// Via parameter carrying the client connection id on stream transports (docs/sip.md, SIP over TCP), so a
/// response finds its connection without a per-transaction table.
pub const CONN_PARAM: &[u8] = b"fc-conn";

/// Record-Route URI parameter naming the service a dialog was set up on (a digest of its
/// hashing identity, [`crate::hash::service_digest`]), so that any fulcrum instance with the
/// same services routes the dialog's later requests to it without shared state (their top
/// Route carries it back, RFC 3261 §12.1.1 / §16.12). See `docs/deployment.md`.
pub const SERVICE_PARAM: &[u8] = b"fc-svc";

use super::flow::FLOW_PARAM;

/// Max-Forwards added when a request has none (RFC 3261 §16.6 step 3: "SHOULD be 70").
pub const DEFAULT_MAX_FORWARDS: u32 = 70;

/// Seed of the branch and to-tag hashes; fixed so every instance derives the same values.
pub(super) const SEED: u64 = 0x6675_6c63_7275_6d31; // "fulcrum1"

/// Why a message cannot be forwarded or answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RewriteError {
    #[error("not a request")]
    NotARequest,
    #[error("not a response")]
    NotAResponse,
    /// Max-Forwards reached 0: answer 483 (RFC 3261 §16.3 step 3), unless it is an ACK.
    #[error("Max-Forwards exhausted")]
    TooManyHops,
    /// Answer 400.
    #[error("malformed Max-Forwards")]
    BadMaxForwards,
    #[error("no Via header")]
    NoVia,
    #[error("malformed top Via")]
    BadVia,
    /// A response whose top Via is not fulcrum's: drop it (RFC 3261 §16.7 step 3 analogue for
    /// a stateless proxy, §16.11).
    #[error("top Via is not ours")]
    ViaNotOurs,
    /// A response with no Via left after ours: it was meant for fulcrum itself.
    #[error("no Via after ours")]
    NoNextVia,
    /// ACK is never answered (RFC 3261 §17.2.1; a stateless proxy drops it).
    #[error("ACK is never answered")]
    AckNotAnswered,
    #[error("no Route or Request-URI to route by")]
    NoTarget,
    /// The next hop is fulcrum itself.
    #[error("request routed to ourselves")]
    Loop,
    /// What fulcrum would send has more header lines than its own scanner takes
    /// ([`MAX_HEADERS`]): the answer could never come back through fulcrum. Answer 513
    /// (RFC 3261 §21.5.14) to a request; drop a reply.
    #[error("more than {MAX_HEADERS} header lines after rewriting")]
    TooManyHeaders,
}

/// How to forward one request.
#[derive(Debug, Clone, Copy)]
pub struct RequestRewrite<'l> {
    pub local: &'l Local,
    /// Where the request came from (the received/rport values, RFC 3581 §4).
    pub src: SocketAddr,
    /// Add `Record-Route: <sip:us;lr>` (RFC 3261 §16.6 step 4).
    pub record_route: bool,
    /// Write `rport` even when the client did not ask for it (NAT traversal for clients that
    /// do not implement RFC 3581; Kamailio's `force_rport()`).
    pub force_rport: bool,
    /// Client connection id written as `;fc-conn=<hex>` in our Via (stream transports).
    pub conn_id: Option<u64>,
    /// With `record_route`: the chosen service's digest, written as `;fc-svc=<hex>` in the
    /// Record-Route URI ([`SERVICE_PARAM`]).
    pub service: Option<u64>,
    /// With `record_route`, when the request arrived on another transport than it leaves on
    /// (the transports bridge): the identity of the leg it arrived on, written as a second
    /// Record-Route entry below the one naming `local` (RFC 5658 §3.2 double
    /// record-routing), so each side's route set names the interface facing it.
    pub arrived_on: Option<&'l Local>,
    /// With `record_route`: a client's flow token ([`crate::sip::flow`]), written as
    /// `;fc-flow=<token>` beside `fc-svc` so that the dialog's requests toward the client
    /// reach it over its flow.
    pub flow: Option<&'l [u8]>,
    /// Add a Path header naming `local` with this flow token (a REGISTER, RFC 3327 §5.2),
    /// above any Path already there.
    pub path: Option<&'l [u8]>,
}

/// A next hop: an address, or a name the shell must resolve (RFC 3263 is out of scope here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Host<'a> {
    Ip(IpAddr),
    Name(&'a [u8]),
}

/// A next hop with its port. IPv4-mapped IPv6 text is returned as IPv4; a shell sending from
/// an IPv6 dual-stack socket maps IPv4 targets back (`Ipv4Addr::to_ipv6_mapped`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target<'a> {
    pub host: Host<'a>,
    pub port: u16,
}

impl Target<'_> {
    /// The socket address when the host is an IP address.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        match self.host {
            Host::Ip(ip) => Some(SocketAddr::new(ip, self.port)),
            Host::Name(_) => None,
        }
    }

    fn from_host(host: &[u8], port: u16) -> Target<'_> {
        match parse_ip(host) {
            Some(ip) => Target {
                host: Host::Ip(ip.to_canonical()),
                port,
            },
            None => Target {
                host: Host::Name(host),
                port,
            },
        }
    }
}

/// Where a response goes after fulcrum's Via is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseRoute<'a> {
    /// From the next Via: `received`/`rport` when present, else sent-by (RFC 3261 §18.2.2,
    /// RFC 3581 §4).
    pub target: Target<'a>,
    /// Transport of the next Via as written (`UDP`, `TCP`, ...).
    pub transport: &'a [u8],
    /// The client connection id fulcrum put in its Via, if any.
    pub conn_id: Option<u64>,
}

/// A stateless reply (RFC 3261 §8.2.6, §16.11).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply<'r> {
    pub code: u16,
    pub reason: &'r str,
    /// `Retry-After` seconds (RFC 3261 §20.33), used with 503.
    pub retry_after_s: Option<u32>,
}

impl Reply<'static> {
    pub const BAD_REQUEST: Reply<'static> = Reply {
        code: 400,
        reason: "Bad Request",
        retry_after_s: None,
    };
    pub const TOO_MANY_HOPS: Reply<'static> = Reply {
        code: 483,
        reason: "Too Many Hops",
        retry_after_s: None,
    };

    /// RFC 3261 §16.3 step 5, §21.4.15: a Proxy-Require option tag fulcrum does not support;
    /// the reply lists the tags in Unsupported (every Proxy-Require value, as received).
    pub const BAD_EXTENSION: Reply<'static> = Reply {
        code: 420,
        reason: "Bad Extension",
        retry_after_s: None,
    };

    /// RFC 3261 §21.5.2; RFC 4475 §3.1.2.18 prefers it at a proxy for an unknown method whose
    /// CSeq names another.
    pub const NOT_IMPLEMENTED: Reply<'static> = Reply {
        code: 501,
        reason: "Not Implemented",
        retry_after_s: None,
    };

    /// RFC 3261 §21.5.6 (RFC 4475 §3.1.2.16): a SIP version other than 2.0.
    pub const VERSION_NOT_SUPPORTED: Reply<'static> = Reply {
        code: 505,
        reason: "Version Not Supported",
        retry_after_s: None,
    };

    /// A flow token fulcrum did not make (docs/sip.md, "Path and flow tokens").
    pub const FORBIDDEN: Reply<'static> = Reply {
        code: 403,
        reason: "Forbidden",
        retry_after_s: None,
    };
    /// A flow token whose flow is gone (RFC 5626 §5.3, §11.5).
    pub const FLOW_FAILED: Reply<'static> = Reply {
        code: 430,
        reason: "Flow Failed",
        retry_after_s: None,
    };
    /// RFC 3261 §21.5.14: the request is larger than fulcrum can forward.
    pub const MESSAGE_TOO_LARGE: Reply<'static> = Reply {
        code: 513,
        reason: "Message Too Large",
        retry_after_s: None,
    };

    /// 503 with Retry-After (RFC 3261 §21.5.4).
    pub const fn service_unavailable(retry_after_s: u32) -> Reply<'static> {
        Reply {
            code: 503,
            reason: "Service Unavailable",
            retry_after_s: Some(retry_after_s),
        }
    }
}

/// One splice of the output: bytes `start..end` of the input are replaced by `ins`.
#[derive(Debug, Clone, Copy)]
struct Edit {
    start: usize,
    end: usize,
    ins: Ins,
}

#[derive(Debug, Clone, Copy)]
enum Ins {
    Nothing,
    /// `rport=<port>` (`;` prefixed when appended).
    Rport(u16, bool),
    /// `received=<ip>` (`;` prefixed when appended).
    Received(IpAddr, bool),
    Decimal(u32),
}

/// At most: rport, received, Max-Forwards, own Route values (two on a bridge).
struct Edits {
    list: [Edit; 5],
    len: usize,
}

impl Edits {
    fn new() -> Edits {
        let e = Edit {
            start: 0,
            end: 0,
            ins: Ins::Nothing,
        };
        Edits {
            list: [e; 5],
            len: 0,
        }
    }

    fn push(&mut self, e: Edit) {
        if self.len < self.list.len() {
            self.list[self.len] = e;
            self.len += 1;
        }
    }

    fn sorted(&mut self) -> &[Edit] {
        let s = &mut self.list[..self.len];
        // Stable: two parameters appended at one place keep the order they were pushed in.
        s.sort_by_key(|e| (e.start, e.end));
        s
    }
}

/// Forward a request statelessly: fulcrum's Via on top with a deterministic branch
/// (RFC 3261 §16.11), `received`/`rport` on the client's Via (RFC 3261 §18.2.1, RFC 3581 §4),
/// Max-Forwards decremented or added (§16.6 step 3), our own Route value removed (loose
/// routing, §16.4), Record-Route added on request (§16.6 step 4). Everything else is copied.
///
/// Returns the number of bytes written. `TooManyHops` means "answer 483" (drop an ACK).
pub fn forward_request<B: BufMut>(
    msg: &SipMsg<'_>,
    rw: &RequestRewrite<'_>,
    out: &mut B,
) -> Result<usize, RewriteError> {
    forward_request_attempt(msg, rw, 0, out)
}

/// [`forward_request`] for attempt `attempt` of a request fulcrum holds statefully (the
/// failover of a request outside a dialog): attempt 0 has the stateless branch, attempt `k`
/// the same with `.k` after it, so that each attempt is its own client transaction toward
/// its service (RFC 3261 §16.6 step 8) and a response names both the transaction and the
/// attempt ([`transaction_of`]).
pub fn forward_request_attempt<B: BufMut>(
    msg: &SipMsg<'_>,
    rw: &RequestRewrite<'_>,
    attempt: u8,
    out: &mut B,
) -> Result<usize, RewriteError> {
    if !msg.is_request() {
        return Err(RewriteError::NotARequest);
    }
    let buf = msg.buf();
    let via_idx = msg.via_index().ok_or(RewriteError::NoVia)?;
    // The scan's parsed top Via, unless the first Via header has no value at all (the scan
    // then takes the next header's; a request's top Via must be in the first header).
    let top = msg
        .top_via()
        .filter(|v| v.span.start >= via_idx.value.start && v.span.end <= via_idx.value.end)
        .ok_or(RewriteError::BadVia)?;

    let mut edits = Edits::new();
    let mf = match msg.max_forwards() {
        MaxForwards::Value(0) => return Err(RewriteError::TooManyHops),
        MaxForwards::Value(n) => {
            let idx = msg
                .max_forwards_index()
                .ok_or(RewriteError::BadMaxForwards)?;
            edits.push(Edit {
                start: idx.value.start,
                end: idx.value.end,
                ins: Ins::Decimal(n - 1),
            });
            true
        }
        MaxForwards::Bad => return Err(RewriteError::BadMaxForwards),
        MaxForwards::Absent => false,
    };
    // Every line added here must still fit what fulcrum's own scanner takes, or the answer
    // (which carries the same headers) could not come back through fulcrum.
    let rr_lines = usize::from(rw.record_route) * (1 + usize::from(rw.arrived_on.is_some()));
    let added = 1 + rr_lines + usize::from(!mf) + usize::from(rw.path.is_some());
    if msg.header_count() + added > MAX_HEADERS {
        return Err(RewriteError::TooManyHeaders);
    }

    source_edits(&top, rw.src, rw.force_rport, &mut edits);
    let (first, second) = own_route_removal(msg, rw.local);
    for remove in [first, second].into_iter().flatten() {
        edits.push(Edit {
            start: remove.start,
            end: remove.end,
            ins: Ins::Nothing,
        });
    }

    let branch = branch_hash(msg, &top, rw.local);
    let mut n = 0;
    let mut put = |out: &mut B, s: &[u8]| {
        out.put_slice(s);
        n += s.len();
    };
    let sl_start = msg.start_offset();
    put(out, &buf[sl_start..msg.headers_start()]);
    put(out, &rw.local.via_prefix);
    put(out, BRANCH_PREFIX);
    put(out, &hex16(branch));
    if attempt > 0 {
        put(out, b".");
        put(out, dec(u64::from(attempt)).as_slice());
    }
    if let Some(id) = rw.conn_id {
        put(out, b";");
        put(out, CONN_PARAM);
        put(out, b"=");
        put(out, &hex16(id));
    }
    put(out, b"\r\n");
    if rw.record_route {
        put(out, &rw.local.rr_line);
        if let Some(d) = rw.service {
            put(out, b";");
            put(out, SERVICE_PARAM);
            put(out, b"=");
            put(out, &hex16(d));
        }
        if let Some(token) = rw.flow {
            put(out, b";");
            put(out, FLOW_PARAM);
            put(out, b"=");
            put(out, token);
        }
        put(out, b">\r\n");
        if let Some(back) = rw.arrived_on {
            put(out, &back.rr_line);
            put(out, b">\r\n");
        }
    }
    if let Some(token) = rw.path {
        put(out, b"Path: ");
        put(out, rw.local.route_uri_open());
        put(out, b";");
        put(out, FLOW_PARAM);
        put(out, b"=");
        put(out, token);
        put(out, b">\r\n");
    }
    if !mf {
        put(out, b"Max-Forwards: ");
        put(out, dec(u64::from(DEFAULT_MAX_FORWARDS)).as_slice());
        put(out, b"\r\n");
    }
    let rest = put_edited(
        out,
        buf,
        Span::new(msg.headers_start(), msg.len()),
        edits.sorted(),
    );
    Ok(n + rest)
}

/// The edits of a request's top Via that record where it really came from (`src`):
///
/// - RFC 3581 §4: with `rport` (or `force_rport`) the port is filled in, and `received` added;
/// - RFC 3261 §18.2.1: `received` when sent-by differs from the source address;
/// - a `received` the sender wrote itself is always replaced by the real source address: the
///   response is routed by it (§18.2.2), and honouring a forged one would send responses to
///   any address the sender names.
fn source_edits(top: &Via<'_>, src: SocketAddr, force_rport: bool, edits: &mut Edits) {
    let src_ip = src.ip().to_canonical();
    let rport_wanted = top.rport.is_present() || force_rport;
    let host_differs = top.host_ip().map(|ip| ip.to_canonical()) != Some(src_ip);
    if rport_wanted {
        let port = src.port();
        edits.push(match top.rport_param {
            Some(p) => Edit {
                start: p.start,
                end: p.end,
                ins: Ins::Rport(port, false),
            },
            None => Edit {
                start: top.span.end,
                end: top.span.end,
                ins: Ins::Rport(port, true),
            },
        });
    }
    if top.received_param.is_some() || rport_wanted || host_differs {
        edits.push(match top.received_param {
            Some(p) => Edit {
                start: p.start,
                end: p.end,
                ins: Ins::Received(src_ip, false),
            },
            None => Edit {
                start: top.span.end,
                end: top.span.end,
                ins: Ins::Received(src_ip, true),
            },
        });
    }
}

/// Write `buf[range]` with `edits` (sorted, inside the range) applied; the bytes written.
fn put_edited<B: BufMut>(out: &mut B, buf: &[u8], range: Span, edits: &[Edit]) -> usize {
    let mut n = 0;
    let mut put = |out: &mut B, s: &[u8]| {
        out.put_slice(s);
        n += s.len();
    };
    let mut pos = range.start;
    for e in edits {
        if e.start < pos || e.end > range.end {
            continue; // overlapping edits cannot happen; skip rather than panic
        }
        put(out, &buf[pos..e.start]);
        match e.ins {
            Ins::Nothing => {}
            Ins::Rport(p, semi) => {
                put(out, if semi { b";rport=" } else { b"rport=" });
                put(out, dec(u64::from(p)).as_slice());
            }
            Ins::Received(ip, semi) => {
                put(out, if semi { b";received=" } else { b"received=" });
                put(out, ip_text(ip).as_slice());
            }
            Ins::Decimal(v) => put(out, dec(u64::from(v)).as_slice()),
        }
        pos = e.end;
    }
    put(out, &buf[pos..range.end]);
    n
}

/// The bytes to cut so that the first value of a header disappears: the whole line when it is
/// the only value, else the value and the separator up to the next value.
fn first_value_removal(buf: &[u8], idx: Indexed) -> Option<Span> {
    let mut vals = CommaValues::new(buf, idx.value);
    let first = vals.next()?;
    match vals.next() {
        Some(second) => Some(Span::new(first.start, second.start)),
        None => Some(idx.line),
    }
}

/// The service digest (`fc-svc`) in the request's top Route when that Route is fulcrum's: the
/// service some fulcrum instance chose for the dialog. `None` without a Route, when the top
/// Route is not fulcrum's (only the first value may name us, §16.4), or when it carries no
/// well-formed digest (16 hex digits). The caller matches it against its own services only.
///
/// On a bridge ([`Local::is_bridged`]) the dialog was double record-routed (RFC 5658 §3.2)
/// and only the entry of one leg carries the digest: when the top Route is fulcrum's without
/// it, the second value is read too if it is fulcrum's.
pub fn routed_service(msg: &SipMsg<'_>, local: &Local) -> Option<u64> {
    routed_param(msg, local, SERVICE_PARAM)
        .filter(|v| v.len() == 16)
        .and_then(parse_hex)
}

/// The flow token (`fc-flow`) of the top Route value when that names fulcrum, or of the
/// second when both are fulcrum's (a double record-route, RFC 5658 §3.2); as written.
pub fn routed_flow<'a>(msg: &SipMsg<'a>, local: &Local) -> Option<&'a [u8]> {
    routed_param(msg, local, FLOW_PARAM)
}

/// Parameter `name` of fulcrum's own Route: the top value when it names fulcrum, or, on a
/// bridge ([`Local::is_bridged`]), the second when the top one is fulcrum's without it (only
/// one entry of a double record-route carries fulcrum's parameters).
fn routed_param<'a>(msg: &SipMsg<'a>, local: &Local, name: &[u8]) -> Option<&'a [u8]> {
    let uri = parse_uri(msg.route_uri()?)?;
    if !local.is_local(uri.host, uri.port) {
        return None;
    }
    match uri.param(name) {
        Some(v) => Some(v),
        None if local.bridged => {
            let second = msg.routes().nth(1)?;
            let uri = parse_uri(parse_name_addr(second)?.uri)?;
            if !local.is_local(uri.host, uri.port) {
                return None;
            }
            uri.param(name)
        }
        None => None,
    }
}

/// The Route values to cut because they name fulcrum (RFC 3261 §16.4: "MUST remove that
/// value"): the first one, and on a bridge the second one too when the first was ours (both
/// entries of a double record-route, RFC 5658 §3.2).
fn own_route_removal(msg: &SipMsg<'_>, local: &Local) -> (Option<Span>, Option<Span>) {
    let (Some(idx), Some(uri)) = (msg.route_index(), msg.route_uri().and_then(parse_uri)) else {
        return (None, None);
    };
    if !local.is_local(uri.host, uri.port) {
        return (None, None);
    }
    if !local.bridged {
        return (first_value_removal(msg.buf(), idx), None);
    }
    let buf = msg.buf();
    let is_ours = |span: Span| {
        parse_name_addr(span.of(buf))
            .and_then(|na| parse_uri(na.uri))
            .is_some_and(|u| local.is_local(u.host, u.port))
    };
    let mut vals = CommaValues::new(buf, idx.value);
    let (Some(first), second) = (vals.next(), vals.next()) else {
        return (None, None);
    };
    match second {
        // Both in the first Route header: cut up to the third value, or the whole line.
        Some(second) if is_ours(second) => match vals.next() {
            Some(third) => (Some(Span::new(first.start, third.start)), None),
            None => (Some(idx.line), None),
        },
        Some(second) => (Some(Span::new(first.start, second.start)), None),
        // The first Route header holds only ours: the second value is the first of the next
        // Route header.
        None => {
            let next = msg.headers().find(|h| {
                h.line.start >= idx.line.end && HeaderName::classify(h.name) == HeaderName::Route
            });
            let cut_next = next.and_then(|h| {
                let i = Indexed {
                    line: h.line,
                    value: h.value_span,
                };
                let v = CommaValues::new(buf, i.value).next()?;
                if is_ours(v) {
                    first_value_removal(buf, i)
                } else {
                    None
                }
            });
            (Some(idx.line), cut_next)
        }
    }
}

/// RFC 3261 §16.11: with a cookie branch, a hash of the received branch and sent-by (so a
/// retransmission, the CANCEL and the non-2xx ACK of an INVITE get the same branch, while two
/// clients that happen to use one branch value stay two transactions, as §17.2.3 matches them
/// by branch and sent-by); without one, a hash of top Via, To tag, From tag, Call-ID, CSeq
/// number and Request-URI. Our own address is mixed in so that a request spiralling through
/// fulcrum twice gets a new branch.
fn branch_hash(msg: &SipMsg<'_>, top: &Via<'_>, local: &Local) -> u64 {
    branch_hash_tagged(msg, top, local, msg.to_tag().unwrap_or_default())
}

/// [`branch_hash`] with `to_tag` in place of the message's own To tag (branches without the
/// magic cookie only; a cookie branch ignores it).
fn branch_hash_tagged(msg: &SipMsg<'_>, top: &Via<'_>, local: &Local, to_tag: &[u8]) -> u64 {
    let mut h = local.branch_seed;
    if top.has_cookie() {
        h = xxh3_64_with_seed(top.host, h);
        h = xxh3_64_with_seed(&top.port.unwrap_or(0).to_le_bytes(), h);
        return xxh3_64_with_seed(top.branch.unwrap_or_default(), h);
    }
    h = xxh3_64_with_seed(top.raw, h);
    h = xxh3_64_with_seed(to_tag, h);
    h = xxh3_64_with_seed(msg.from_tag().unwrap_or_default(), h);
    h = xxh3_64_with_seed(msg.call_id().unwrap_or_default(), h);
    let seq = msg.cseq().map_or(0, |c| c.seq);
    h = xxh3_64_with_seed(&seq.to_le_bytes(), h);
    xxh3_64_with_seed(msg.request_uri().unwrap_or_default(), h)
}

/// The transaction key of a request from a client: the branch fulcrum gives it when it
/// forwards it ([`branch_hash`]), which a retransmission, the CANCEL and the non-2xx ACK of an
/// INVITE share. `None` without a top Via.
pub fn transaction_key(msg: &SipMsg<'_>, local: &Local) -> Option<u64> {
    let top = msg.top_via()?;
    Some(branch_hash(msg, &top, local))
}

/// The key of the INVITE that an ACK from an RFC 2543 client (a top Via without the magic
/// cookie) acknowledges: its own key but for the To tag, which the INVITE did not have (RFC
/// 3261 §17.2.3 matches such an ACK by Request-URI, From tag, Call-ID, CSeq number and top
/// Via, and its To tag against the final response's). `None` for a cookie branch: the ACK
/// of a non-2xx then shares the INVITE's branch, and so its key.
pub fn rfc2543_invite_key(msg: &SipMsg<'_>, local: &Local) -> Option<u64> {
    let top = msg.top_via()?;
    (!top.has_cookie()).then(|| branch_hash_tagged(msg, &top, local, b""))
}

/// The transaction key and attempt a branch of fulcrum's names (`z9hG4bK-fc-<hex>[.k]`,
/// [`forward_request_attempt`]); `None` for any other branch.
pub fn transaction_of(branch: &[u8]) -> Option<(u64, u8)> {
    let rest = branch.strip_prefix(BRANCH_PREFIX)?;
    let (hex, attempt) = match memchr::memchr(b'.', rest) {
        Some(dot) => {
            let k = rest.get(dot + 1..)?;
            let k = std::str::from_utf8(k).ok()?.parse::<u8>().ok()?;
            (rest.get(..dot)?, k)
        }
        None => (rest, 0),
    };
    if hex.len() != 16 {
        return None;
    }
    Some((parse_hex(hex)?, attempt))
}

/// A request fulcrum sends on its own within a client transaction it started toward a
/// service (RFC 3261 §17.1.1.3 ACK of a non-2xx final response, §9.1 CANCEL): built from the
/// request fulcrum `forwarded` (its Request-URI, fulcrum's Via alone with the same branch,
/// Route, From, Call-ID, the CSeq number), with `method` in the CSeq and To taken from
/// `response` when given (the ACK's To carries the response's tag).
pub fn build_hop_request<B: BufMut>(
    forwarded: &SipMsg<'_>,
    method: &[u8],
    response: Option<&SipMsg<'_>>,
    out: &mut B,
) -> Result<(), RewriteError> {
    let buf = forwarded.buf();
    let uri = forwarded.request_uri().ok_or(RewriteError::NotARequest)?;
    let via_idx = forwarded.via_index().ok_or(RewriteError::NoVia)?;
    let top = CommaValues::new(buf, via_idx.value)
        .next()
        .ok_or(RewriteError::BadVia)?;
    let seq = forwarded.cseq().ok_or(RewriteError::NotARequest)?.seq;
    out.put_slice(method);
    out.put_slice(b" ");
    out.put_slice(uri);
    out.put_slice(b" SIP/2.0\r\n");
    put_header(out, b"Via", top.of(buf));
    for h in forwarded.headers() {
        if HeaderName::classify(h.name) == HeaderName::Route {
            put_header(out, b"Route", h.value);
        }
    }
    out.put_slice(b"Max-Forwards: 70\r\n");
    if let Some(i) = forwarded.index_from() {
        put_header(out, b"From", i.value.of(buf));
    }
    let to = match response {
        Some(r) => r.index_to().map(|i| i.value.of(r.buf())),
        None => forwarded.index_to().map(|i| i.value.of(buf)),
    };
    if let Some(to) = to {
        put_header(out, b"To", to);
    }
    if let Some(i) = forwarded.call_id_index() {
        put_header(out, b"Call-ID", i.value.of(buf));
    }
    out.put_slice(b"CSeq: ");
    out.put_slice(dec(u64::from(seq)).as_slice());
    out.put_slice(b" ");
    out.put_slice(method);
    out.put_slice(b"\r\nContent-Length: 0\r\n\r\n");
    Ok(())
}

/// Check that a response's top Via is fulcrum's and find where the response goes next,
/// without writing anything.
pub fn route_response<'a>(
    msg: &SipMsg<'a>,
    local: &Local,
) -> Result<ResponseRoute<'a>, RewriteError> {
    route_and_cut(msg, local).map(|(route, _)| route)
}

/// The route of a response and the bytes to cut to remove fulcrum's Via value.
fn route_and_cut<'a>(
    msg: &SipMsg<'a>,
    local: &Local,
) -> Result<(ResponseRoute<'a>, Span), RewriteError> {
    if msg.is_request() {
        return Err(RewriteError::NotAResponse);
    }
    let buf = msg.buf();
    let idx = msg.via_index().ok_or(RewriteError::NoVia)?;
    let mut vals = CommaValues::new(buf, idx.value);
    let first = vals.next().ok_or(RewriteError::BadVia)?;
    let top = parse_via(buf, first, CONN_PARAM).ok_or(RewriteError::BadVia)?;
    let ours = top.branch.is_some_and(|b| b.starts_with(BRANCH_PREFIX))
        && local.is_local(top.host, top.port);
    if !ours {
        return Err(RewriteError::ViaNotOurs);
    }
    let conn_id = top.extra_param.and_then(|s| parse_hex(s.of(buf)));
    // The next Via is the second value of the same header, else the first of a later one.
    let (next, cut) = match vals.next() {
        Some(second) => (
            parse_via(buf, second, b""),
            Span::new(first.start, second.start),
        ),
        None => (msg.vias_after(idx.line.end).next(), idx.line),
    };
    let next = next.ok_or(RewriteError::NoNextVia)?;
    let default_port = if next.transport.eq_ignore_ascii_case(b"TLS") {
        5061
    } else {
        5060
    };
    let port = match next.rport {
        Rport::Filled(p) => p,
        _ => next.port.unwrap_or(default_port),
    };
    let target = match next.received.and_then(parse_ip) {
        Some(ip) => Target {
            host: Host::Ip(ip.to_canonical()),
            port,
        },
        None => Target::from_host(next.host, port),
    };
    let route = ResponseRoute {
        target,
        transport: next.transport,
        conn_id,
    };
    Ok((route, cut))
}

/// Forward a response: check the top Via is ours, remove it (only the first value when
/// several are comma-joined), copy the rest (RFC 3261 §16.7 step 3, §16.11).
pub fn forward_response<'a, B: BufMut>(
    msg: &SipMsg<'a>,
    local: &Local,
    out: &mut B,
) -> Result<ResponseRoute<'a>, RewriteError> {
    let (route, cut) = route_and_cut(msg, local)?;
    let buf = msg.buf();
    out.put_slice(&buf[msg.start_offset()..cut.start]);
    out.put_slice(&buf[cut.end..msg.len()]);
    Ok(route)
}

/// Build a stateless response to a request (RFC 3261 §8.2.6): all Via values, From, To (with a
/// deterministic tag when it has none, §8.2.6.2, so retransmissions get the same tag), Call-ID,
/// CSeq, Retry-After when set, `Content-Length: 0`.
pub fn build_response<B: BufMut>(
    msg: &SipMsg<'_>,
    reply: &Reply<'_>,
    out: &mut B,
) -> Result<(), RewriteError> {
    build(msg, reply, None, out)
}

/// [`build_response`] for a request that arrived from `src`: its top Via records the real
/// source as a proxy forwarding it would (`rport` filled in, `received` added or corrected;
/// RFC 3581 §4, RFC 3261 §18.2.1), since fulcrum answers as the first hop.
pub fn build_reply<B: BufMut>(
    msg: &SipMsg<'_>,
    reply: &Reply<'_>,
    src: SocketAddr,
    out: &mut B,
) -> Result<(), RewriteError> {
    build(msg, reply, Some(src), out)
}

fn build<B: BufMut>(
    msg: &SipMsg<'_>,
    reply: &Reply<'_>,
    src: Option<SocketAddr>,
    out: &mut B,
) -> Result<(), RewriteError> {
    if !msg.is_request() {
        return Err(RewriteError::NotARequest);
    }
    if msg.method_kind() == SipMethod::Ack {
        return Err(RewriteError::AckNotAnswered);
    }
    let buf = msg.buf();
    // Without any Via the reply cannot be matched; a Via that does not parse (RFC 4475
    // §3.1.2.16 has `SIP/7.0/UDP`) is copied as it is, without received / rport.
    msg.via_index().ok_or(RewriteError::NoVia)?;
    let top = msg.top_via();
    let with_unsupported = reply.code == 420;
    // From, To, Call-ID, CSeq, Content-Length (and Retry-After) besides the copied lines:
    // counted exactly only when the request is near the limit.
    let own = 5 + usize::from(reply.retry_after_s.is_some());
    let per_line = if msg.header_count() + own > MAX_HEADERS {
        via_values_per_line(msg, own, with_unsupported)?
    } else {
        1
    };
    out.put_slice(b"SIP/2.0 ");
    out.put_slice(dec(u64::from(reply.code.clamp(100, 699))).as_slice());
    out.put_slice(b" ");
    out.put_slice(reply.reason.as_bytes());
    out.put_slice(b"\r\n");
    let mut edits = match (src, &top) {
        (Some(src), Some(top)) => {
            let mut e = Edits::new();
            source_edits(top, src, false, &mut e);
            Some((e, top.span))
        }
        _ => None,
    };
    // Via lines after the first one written so far on the line now open (0: none is open).
    let mut open = 0;
    let mut first = true;
    for h in msg.headers() {
        match HeaderName::classify(h.name) {
            HeaderName::Via => {}
            // RFC 3261 §16.3 step 5: the tags the proxy does not support. Written after the
            // Vias when these share lines (the order of different names is not significant,
            // RFC 3261 §7.3.1).
            HeaderName::ProxyRequire if with_unsupported && per_line == 1 => {
                put_header(out, b"Unsupported", h.value);
                continue;
            }
            _ => continue,
        }
        match &mut edits {
            // The header holding the top Via value: written with its edits, on its own line.
            Some((e, top)) if h.value_span.start <= top.start && top.end <= h.value_span.end => {
                out.put_slice(b"Via: ");
                put_edited(out, buf, h.value_span, e.sorted());
                out.put_slice(b"\r\n");
            }
            _ if per_line == 1 || first => put_header(out, b"Via", h.value),
            // Past the limit: this line's values appended to the open line (RFC 3261 §7.3.1).
            _ => {
                out.put_slice(if open == 0 { b"Via: " } else { b", " });
                out.put_slice(h.value);
                open += 1;
                if open == per_line {
                    out.put_slice(b"\r\n");
                    open = 0;
                }
            }
        }
        first = false;
    }
    if open > 0 {
        out.put_slice(b"\r\n");
    }
    if with_unsupported && per_line > 1 {
        for h in msg.headers() {
            if HeaderName::classify(h.name) == HeaderName::ProxyRequire {
                put_header(out, b"Unsupported", h.value);
            }
        }
    }
    if let Some(i) = msg.index_from() {
        put_header(out, b"From", i.value.of(buf));
    }
    if let Some(i) = msg.index_to() {
        let to = i.value.of(buf);
        out.put_slice(b"To: ");
        out.put_slice(to);
        // RFC 3261 §8.2.6.2: every response but a 100 (Trying) gets a To tag.
        if msg.to_tag().is_none() && reply.code > 100 {
            out.put_slice(b";tag=fc");
            out.put_slice(&own_tag(msg));
        }
        out.put_slice(b"\r\n");
    }
    if let Some(i) = msg.call_id_index() {
        put_header(out, b"Call-ID", i.value.of(buf));
    }
    if let Some(i) = msg.cseq_index() {
        put_header(out, b"CSeq", i.value.of(buf));
    }
    if let Some(s) = reply.retry_after_s {
        out.put_slice(b"Retry-After: ");
        out.put_slice(dec(u64::from(s)).as_slice());
        out.put_slice(b"\r\n");
    }
    out.put_slice(b"Content-Length: 0\r\n\r\n");
    Ok(())
}

/// The To tag (after `fc`) of fulcrum's own reply to `msg`: from its Call-ID, From tag and top
/// branch, which the ACK of a non-2xx final repeats (RFC 3261 §17.1.1.3).
fn own_tag(msg: &SipMsg<'_>) -> [u8; 16] {
    let mut h = xxh3_64_with_seed(msg.call_id().unwrap_or_default(), SEED);
    h = xxh3_64_with_seed(msg.from_tag().unwrap_or_default(), h);
    h = xxh3_64_with_seed(msg.top_via().and_then(|t| t.branch).unwrap_or_default(), h);
    hex16(h)
}

/// Whether `msg` is the ACK of a final answer fulcrum gave itself (a refusal, a 503): its To
/// tag is the one fulcrum wrote. Such an ACK ends there (RFC 3261 §17.2.1).
pub fn acks_own_reply(msg: &SipMsg<'_>) -> bool {
    // Most ACKs acknowledge a service's 2xx: a look for `tag=fc` in To spares them the parse.
    msg.method_kind() == SipMethod::Ack
        && msg.to_header().is_some_and(|to| {
            memchr::memchr_iter(b'=', to).any(|i| {
                i >= 3
                    && to[i - 3..i].eq_ignore_ascii_case(b"tag")
                    && to.get(i + 1..i + 3) == Some(b"fc")
            })
        })
        && msg
            .to_tag()
            .and_then(|t| t.strip_prefix(b"fc"))
            .is_some_and(|t| t == own_tag(msg))
}

/// How many of a request's Via lines each line of fulcrum's reply carries, so that the reply
/// has at most [`MAX_HEADERS`] lines with its `own` and, for a 420, one Unsupported per
/// Proxy-Require: 1 when every Via line fits as it is, else the Via lines after the first
/// share lines, their values comma-joined in order. RFC 3261 §7.3.1 makes rows of one header
/// name equivalent to their values joined by commas, so the reply still carries every Via
/// value of the request, in order (§8.2.6.2), and is a message fulcrum itself would read.
fn via_values_per_line(
    msg: &SipMsg<'_>,
    own: usize,
    with_unsupported: bool,
) -> Result<usize, RewriteError> {
    let (mut vias, mut unsupported) = (0, 0);
    for h in msg.headers() {
        match HeaderName::classify(h.name) {
            HeaderName::Via => vias += 1,
            HeaderName::ProxyRequire if with_unsupported => unsupported += 1,
            _ => {}
        }
    }
    let room = MAX_HEADERS.saturating_sub(own + unsupported);
    if vias <= room {
        return Ok(1);
    }
    // The first Via line keeps a line of its own (it holds the top value, edited).
    match room.checked_sub(1) {
        Some(lines) if lines > 0 => Ok((vias - 1).div_ceil(lines).max(2)),
        _ => Err(RewriteError::TooManyHeaders),
    }
}

fn put_header<B: BufMut>(out: &mut B, name: &[u8], value: &[u8]) {
    out.put_slice(name);
    out.put_slice(b": ");
    out.put_slice(value);
    out.put_slice(b"\r\n");
}

/// Where fulcrum sends its own reply to a request received from `src` over a datagram
/// transport: the source address (RFC 3581 §4) when `rport` was requested, else the source IP
/// (the `received` value) with the sent-by port (RFC 3261 §18.2.2). The address family of
/// `src` is kept, so a reply leaves a dual-stack socket as it arrived.
pub fn reply_target(msg: &SipMsg<'_>, src: SocketAddr) -> SocketAddr {
    match msg.top_via() {
        Some(v) if !v.rport.is_present() => {
            let default = if v.transport.eq_ignore_ascii_case(b"TLS") {
                5061
            } else {
                5060
            };
            SocketAddr::new(src.ip(), v.port.unwrap_or(default))
        }
        _ => src,
    }
}

/// Next hop of a request travelling from a service toward a client: the first Route URI that
/// is not fulcrum (loose routing, RFC 3261 §16.4/§16.12), else the Request-URI. The port
/// defaults to 5060 (5061 for `sips:`). `maddr` and `transport` URI parameters are ignored:
/// the vserver's transport is used and `maddr` (deprecated by RFC 3261 §19.1.1) is not followed.
/// A strict-routing Route (without `lr`) is treated as loose.
pub fn request_target<'a>(msg: &SipMsg<'a>, local: &Local) -> Result<Target<'a>, RewriteError> {
    if !msg.is_request() {
        return Err(RewriteError::NotARequest);
    }
    let mut uri = None;
    let mut skipped = false;
    for (i, value) in msg.routes().enumerate() {
        let Some(u) = parse_name_addr(value).and_then(|na| parse_uri(na.uri)) else {
            return Err(RewriteError::NoTarget);
        };
        // Only the first value may name us (§16.4), or the first two on a bridge (RFC 5658
        // double record-routing); a later one naming us is a loop.
        if (i == 0 || (i == 1 && local.bridged && skipped)) && local.is_local(u.host, u.port) {
            skipped = true;
            continue;
        }
        uri = Some(u);
        break;
    }
    let uri = match uri {
        Some(u) => u,
        None => msg
            .request_uri()
            .and_then(parse_uri)
            .ok_or(RewriteError::NoTarget)?,
    };
    if local.is_local(uri.host, uri.port) {
        return Err(RewriteError::Loop);
    }
    let port = uri.port.unwrap_or(if uri.is_sips() { 5061 } else { 5060 });
    Ok(Target::from_host(uri.host, port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sip::scan::scan;

    fn local() -> Local {
        Local::new("192.0.2.1", 5060, Transport::Udp)
    }

    fn src() -> SocketAddr {
        "198.51.100.7:40000".parse().unwrap()
    }

    const REQ: &[u8] = b"INVITE sip:bob@example.com SIP/2.0\r\n\
Via: SIP/2.0/UDP 10.0.0.5:5062;branch=z9hG4bKabc;rport\r\n\
Max-Forwards: 70\r\n\
From: <sip:alice@example.com>;tag=a1\r\n\
To: <sip:bob@example.com>\r\n\
Call-ID: cid-1\r\n\
CSeq: 1 INVITE\r\n\
Content-Length: 0\r\n\r\n";

    /// `REQ` padded with `X-Pad` lines to `lines` header lines in all.
    fn with_header_lines(lines: usize) -> Vec<u8> {
        let mut m = REQ[..REQ.len() - 2].to_vec();
        for i in 0..lines - 7 {
            m.extend_from_slice(format!("X-Pad: {i}\r\n").as_bytes());
        }
        m.extend_from_slice(b"\r\n");
        m
    }

    /// A request past the scanner's line limit, read by `scan_for_reply`, is answered with
    /// every Via value in order in at most [`MAX_HEADERS`] lines; the top one, on its own line,
    /// records the source (RFC 3581 §4). A 420 keeps its Unsupported lines.
    #[test]
    fn a_reply_to_a_request_past_the_line_limit_carries_every_via() {
        use super::super::scan::scan_for_reply;
        for (vias, proxy_require) in [(300, 0), (1000, 0), (400, 3)] {
            let mut m = b"INVITE sip:bob@example.com SIP/2.0\r\n".to_vec();
            for i in 0..vias {
                m.extend_from_slice(
                    format!(
                        "Via: SIP/2.0/UDP 10.0.{}.{};branch=z9hG4bK{i}\r\n",
                        i / 256,
                        i % 256
                    )
                    .as_bytes(),
                );
            }
            for i in 0..proxy_require {
                m.extend_from_slice(format!("Proxy-Require: tag{i}\r\n").as_bytes());
            }
            m.extend_from_slice(
                b"From: <sip:a@x>;tag=1\r\nTo: <sip:b@y>\r\nCall-ID: c\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n",
            );
            assert_eq!(
                scan(&m).err(),
                Some(super::super::ScanError::TooManyHeaders)
            );
            let msg = scan_for_reply(&m).expect("scans for a reply");
            assert_eq!(msg.header_count(), vias + proxy_require + 5);
            let reply = if proxy_require > 0 {
                Reply::BAD_EXTENSION
            } else {
                Reply::MESSAGE_TOO_LARGE
            };
            let mut out = Vec::new();
            build_reply(&msg, &reply, src(), &mut out).expect("reply");
            let r = scan(&out).expect("the reply scans");
            assert!(r.header_count() <= MAX_HEADERS, "{vias}");
            let got: Vec<_> = r.vias().map(|v| (v.host, v.branch)).collect();
            let want: Vec<_> = msg.vias().map(|v| (v.host, v.branch)).collect();
            assert_eq!(got, want, "{vias}");
            let top = r.top_via().expect("top");
            assert_eq!(
                top.received,
                Some(&b"198.51.100.7"[..]),
                "{}",
                String::from_utf8_lossy(&out)
            );
            assert_eq!(r.call_id(), Some(&b"c"[..]));
            assert_eq!(r.cseq().map(|c| c.seq), Some(1));
            assert!(r.to_tag().is_some());
            let unsupported = r
                .headers()
                .filter(|h| h.name.eq_ignore_ascii_case(b"Unsupported"))
                .count();
            assert_eq!(unsupported, proxy_require);
        }
    }

    /// The fuzz finding: a request of 255 header lines scans, but with fulcrum's Via and
    /// Record-Route it would have 257, more than fulcrum takes back; it is refused (513 at the
    /// core) and whatever is forwarded scans and frames again, as do replies and forwarded
    /// responses at the limit.
    #[test]
    fn nothing_forwarded_that_fulcrum_could_not_take_back() {
        use crate::sip::framing::{DEFAULT_MAX_MESSAGE, Frame, next_frame};
        let l = local();
        for lines in [MAX_HEADERS - 2, MAX_HEADERS - 1, MAX_HEADERS] {
            let m = with_header_lines(lines);
            let msg = scan(&m).expect("scans");
            assert_eq!(msg.header_count(), lines);
            for record_route in [false, true] {
                let mut out = Vec::new();
                let r = RequestRewrite {
                    record_route,
                    ..rw(&l)
                };
                match forward_request(&msg, &r, &mut out) {
                    Ok(n) => {
                        assert!(lines + 1 + usize::from(record_route) <= MAX_HEADERS);
                        let again = scan(&out).expect("a forwarded request scans");
                        assert_eq!(again.header_count(), lines + 1 + usize::from(record_route));
                        assert_eq!(
                            next_frame(&out, DEFAULT_MAX_MESSAGE),
                            Ok(Frame::Message {
                                len: n,
                                header_len: n
                            })
                        );
                    }
                    Err(e) => {
                        assert_eq!(e, RewriteError::TooManyHeaders);
                        assert!(lines + 1 + usize::from(record_route) > MAX_HEADERS);
                    }
                }
            }
            // fulcrum's own reply to it scans.
            let mut out = Vec::new();
            build_reply(&msg, &Reply::MESSAGE_TOO_LARGE, src(), &mut out).expect("reply");
            scan(&out).expect("a reply scans");
        }
        // A reply that would copy more lines than the scanner takes has its Via values share
        // lines instead: 252 Via lines and the four other headers a reply copies are 256
        // lines; with the reply's Content-Length they would be 257.
        let mut vias = b"OPTIONS sip:bob@example.com SIP/2.0\r\n".to_vec();
        for i in 0..MAX_HEADERS - 4 {
            vias.extend_from_slice(format!("Via: SIP/2.0/UDP 10.0.0.{i}\r\n").as_bytes());
        }
        vias.extend_from_slice(
            b"From: <sip:a@x>;tag=1\r\nTo: <sip:b@y>\r\nCall-ID: c\r\nCSeq: 1 OPTIONS\r\n\r\n",
        );
        let msg = scan(&vias).expect("scans");
        let mut out = Vec::new();
        build_response(&msg, &Reply::BAD_REQUEST, &mut out).expect("built");
        let reply = scan(&out).expect("the reply scans");
        assert!(reply.header_count() <= MAX_HEADERS);
        assert!(
            reply.vias().map(|v| v.host).eq(msg.vias().map(|v| v.host)),
            "every Via value, in order"
        );
        // One Via fewer fits exactly, one Via a line.
        let fewer = vias.splitn(3, |&c| c == b'\n').collect::<Vec<_>>();
        let fewer = [fewer[0], b"\n", fewer[2]].concat();
        let msg = scan(&fewer).expect("scans");
        out.clear();
        build_response(&msg, &Reply::BAD_REQUEST, &mut out).expect("fits");
        assert_eq!(
            scan(&out).expect("a reply scans").header_count(),
            MAX_HEADERS
        );
        // A response at the limit, fulcrum's Via on top: forwarded, it scans and frames.
        let mut resp = format!(
            "SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP 192.0.2.1:5060;branch={}0123456789abcdef\r\nVia: SIP/2.0/UDP 10.0.0.5:5062;branch=z9hG4bKabc\r\n",
            std::str::from_utf8(BRANCH_PREFIX).expect("ascii")
        )
        .into_bytes();
        for i in 0..MAX_HEADERS - 3 {
            resp.extend_from_slice(format!("X-Pad: {i}\r\n").as_bytes());
        }
        resp.extend_from_slice(b"Content-Length: 2\r\n\r\nok");
        let msg = scan(&resp).expect("scans");
        assert_eq!(msg.header_count(), MAX_HEADERS);
        let mut out = Vec::new();
        forward_response(&msg, &l, &mut out).expect("ours");
        assert_eq!(
            scan(&out)
                .expect("a forwarded response scans")
                .header_count(),
            MAX_HEADERS - 1
        );
        assert!(matches!(
            next_frame(&out, DEFAULT_MAX_MESSAGE),
            Ok(Frame::Message { len, .. }) if len == out.len()
        ));
    }

    /// RFC 4475 §3.2.1: `branch=z9hG4bK` alone is no RFC 3261 branch; two unrelated requests
    /// from one host carrying it get different branches (the RFC 2543 derivation).
    #[test]
    fn a_bare_cookie_branch_is_derived_like_rfc_2543() {
        let l = local();
        let bare = |cid: &str| {
            String::from_utf8_lossy(REQ)
                .replace("branch=z9hG4bKabc", "branch=z9hG4bK")
                .replace("cid-1", cid)
        };
        let (a, b) = (bare("one"), bare("two"));
        let (ma, mb) = (scan(a.as_bytes()).unwrap(), scan(b.as_bytes()).unwrap());
        assert!(!ma.top_via().unwrap().has_cookie());
        let (ta, tb) = (ma.top_via().unwrap(), mb.top_via().unwrap());
        assert_ne!(branch_hash(&ma, &ta, &l), branch_hash(&mb, &tb, &l));
        // A retransmission keeps its branch.
        let again = scan(a.as_bytes()).unwrap();
        assert_eq!(
            branch_hash(&ma, &ta, &l),
            branch_hash(&again, &again.top_via().unwrap(), &l)
        );
    }

    fn rw(l: &Local) -> RequestRewrite<'_> {
        RequestRewrite {
            local: l,
            src: src(),
            record_route: false,
            force_rport: false,
            conn_id: None,
            service: None,
            arrived_on: None,
            flow: None,
            path: None,
        }
    }

    #[test]
    fn forward_request_rewrites() {
        let l = local();
        let m = scan(REQ).unwrap();
        let mut out = Vec::new();
        let n = forward_request(&m, &rw(&l), &mut out).unwrap();
        assert_eq!(n, out.len());
        let text = String::from_utf8(out.clone()).unwrap();
        assert!(text.starts_with(
            "INVITE sip:bob@example.com SIP/2.0\r\nVia: SIP/2.0/UDP 192.0.2.1:5060;branch=z9hG4bK-fc-"
        ));
        assert!(text.contains(
            "Via: SIP/2.0/UDP 10.0.0.5:5062;branch=z9hG4bKabc;rport=40000;received=198.51.100.7\r\n"
        ));
        assert!(text.contains("Max-Forwards: 69\r\n"));
        let f = scan(&out).unwrap();
        assert_eq!(f.vias().count(), 2);
        assert_eq!(f.call_id(), Some(&b"cid-1"[..]));
        // Retransmission: same branch.
        let mut again = Vec::new();
        forward_request(&m, &rw(&l), &mut again).unwrap();
        assert_eq!(out, again);
    }

    /// A request's top Via must be in its first Via header: an empty first header is refused,
    /// though the scan's top Via then comes from the next one.
    #[test]
    fn forward_refuses_an_empty_first_via_header() {
        let l = local();
        let req = b"OPTIONS sip:x SIP/2.0\r\nVia: ,\r\nVia: SIP/2.0/UDP a:1;branch=z9hG4bK1\r\nCall-ID: c\r\nCSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n";
        let m = scan(req).unwrap();
        assert!(m.top_via().is_some());
        let mut out = Vec::new();
        assert_eq!(
            forward_request(&m, &rw(&l), &mut out),
            Err(RewriteError::BadVia)
        );
    }

    /// The branch is a pure function of the request and our address: every instance, and every
    /// retransmission, derives the same one (RFC 3261 §16.11). Pinned so a change is deliberate.
    #[test]
    fn branch_is_pinned() {
        let l = local();
        let mut out = Vec::new();
        forward_request(&scan(REQ).unwrap(), &rw(&l), &mut out).unwrap();
        let f = scan(&out).unwrap();
        let branch = String::from_utf8(f.top_via().unwrap().branch.unwrap().to_vec()).unwrap();
        // Since 2026-12-01 sent-by is part of it (two clients reusing one branch value).
        assert_eq!(branch, "z9hG4bK-fc-55fd0c1a06dac304");
    }

    fn top_branch(out: &[u8]) -> Vec<u8> {
        scan(out)
            .unwrap()
            .top_via()
            .unwrap()
            .branch
            .unwrap()
            .to_vec()
    }

    /// Two clients that use one cookie branch value (simple tools, SIPp instances) stay two
    /// transactions toward the service (RFC 3261 §17.2.3 matches branch and sent-by); one
    /// client's retransmission, CANCEL and ACK keep the branch.
    #[test]
    fn the_branch_depends_on_sent_by() {
        let l = local();
        let other = String::from_utf8(REQ.to_vec())
            .unwrap()
            .replace("10.0.0.5:5062", "10.0.0.6:5062");
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        forward_request(&scan(REQ).unwrap(), &rw(&l), &mut a).unwrap();
        forward_request(&scan(other.as_bytes()).unwrap(), &rw(&l), &mut b).unwrap();
        assert_ne!(top_branch(&a), top_branch(&b));
        let cancel = String::from_utf8(REQ.to_vec())
            .unwrap()
            .replace("INVITE", "CANCEL");
        forward_request(&scan(cancel.as_bytes()).unwrap(), &rw(&l), &mut c).unwrap();
        assert_eq!(top_branch(&a), top_branch(&c));
    }

    /// Toward services from `service_source`: the Via names that address (their answers go
    /// there), while Record-Route, the branch and what counts as fulcrum stay the vserver's.
    #[test]
    fn sending_from_changes_only_the_via() {
        let l = local();
        let from: SocketAddr = "10.1.0.7:5070".parse().unwrap();
        let s = l.sending_from(from);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let mut with_rr = rw(&l);
        with_rr.record_route = true;
        forward_request(&scan(REQ).unwrap(), &with_rr, &mut a).unwrap();
        let mut with_rr = rw(&s);
        with_rr.record_route = true;
        forward_request(&scan(REQ).unwrap(), &with_rr, &mut b).unwrap();
        let text = String::from_utf8(b.clone()).unwrap();
        assert!(
            text.contains("Via: SIP/2.0/UDP 10.1.0.7:5070;branch="),
            "{text}"
        );
        assert!(
            text.contains("Record-Route: <sip:192.0.2.1:5060;lr>"),
            "{text}"
        );
        assert_eq!(top_branch(&a), top_branch(&b));
        assert!(s.is_local(b"10.1.0.7", Some(5070)));
        assert!(s.is_local(b"192.0.2.1", None));
        assert!(
            !l.is_local(b"10.1.0.7", Some(5070)),
            "the client-side identity is unchanged"
        );
        // Given twice, the alias is kept once.
        assert_eq!(s.sending_from(from).addrs().count(), s.addrs().count());
    }

    /// A `received` the client wrote itself never survives: the response is routed by it.
    #[test]
    fn a_forged_received_is_replaced_by_the_source() {
        let l = local();
        let req = b"OPTIONS sip:x SIP/2.0\r\nVia: SIP/2.0/UDP 198.51.100.7:5060;received=203.0.113.9;branch=z9hG4bKs\r\nCall-ID: c\r\nCSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n";
        let mut out = Vec::new();
        forward_request(&scan(req).unwrap(), &rw(&l), &mut out).unwrap();
        let f = scan(&out).unwrap();
        let client = f.vias().nth(1).unwrap();
        assert_eq!(client.received, Some(&b"198.51.100.7"[..]));
        assert!(!out.windows(11).any(|w| w == b"203.0.113.9"));
    }

    /// fulcrum's own replies fill in `rport` and correct `received` like a forwarded request.
    #[test]
    fn own_replies_record_the_source_on_the_top_via() {
        let req = b"OPTIONS sip:x SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.5:5062;rport;received=203.0.113.9;branch=z9hG4bKm2, SIP/2.0/UDP 10.9.9.9;branch=z9hG4bKold\r\nVia: SIP/2.0/UDP 10.8.8.8;branch=z9hG4bKolder\r\nMax-Forwards: 0\r\nFrom: <sip:a@x>;tag=1\r\nTo: <sip:b@x>\r\nCall-ID: c\r\nCSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n";
        let m = scan(req).unwrap();
        let mut out = Vec::new();
        build_reply(&m, &Reply::TOO_MANY_HOPS, src(), &mut out).unwrap();
        let r = scan(&out).unwrap();
        let vias: Vec<_> = r.vias().collect();
        assert_eq!(vias.len(), 3, "{}", String::from_utf8_lossy(&out));
        assert_eq!(vias[0].rport, Rport::Filled(40000));
        assert_eq!(vias[0].received, Some(&b"198.51.100.7"[..]));
        assert_eq!(vias[0].branch, Some(&b"z9hG4bKm2"[..]));
        assert_eq!(vias[1].raw, b"SIP/2.0/UDP 10.9.9.9;branch=z9hG4bKold");
        assert_eq!(vias[2].raw, b"SIP/2.0/UDP 10.8.8.8;branch=z9hG4bKolder");
        // Without a source (a reply built from a forwarded request), Vias are copied as they are.
        let mut plain = Vec::new();
        build_response(&m, &Reply::TOO_MANY_HOPS, &mut plain).unwrap();
        assert!(plain.windows(18).any(|w| w == b"rport;received=203"));
    }

    #[test]
    fn forward_adds_mf_rr_conn() {
        let l = Local::new("2001:db8::1", 5080, Transport::Tcp);
        let req = b"OPTIONS sip:x SIP/2.0\r\nv: SIP/2.0/TCP client.example;branch=z9hG4bK1\r\ni: c\r\nl: 0\r\n\r\n";
        let m = scan(req).unwrap();
        let mut out = Vec::new();
        let r = RequestRewrite {
            record_route: true,
            conn_id: Some(0xabc),
            service: None,
            ..rw(&l)
        };
        forward_request(&m, &r, &mut out).unwrap();
        let text = String::from_utf8(out.clone()).unwrap();
        assert!(text.contains("Via: SIP/2.0/TCP [2001:db8::1]:5080;branch=z9hG4bK-fc-"));
        assert!(text.contains(";fc-conn=0000000000000abc\r\n"));
        assert!(text.contains("Record-Route: <sip:[2001:db8::1]:5080;transport=tcp;lr>\r\n"));
        assert!(text.contains("Max-Forwards: 70\r\n"));
        assert!(
            text.contains(
                "v: SIP/2.0/TCP client.example;branch=z9hG4bK1;received=198.51.100.7\r\n"
            )
        );
    }

    #[test]
    fn max_forwards_zero_and_bad() {
        let l = local();
        let req = String::from_utf8(REQ.to_vec())
            .unwrap()
            .replace("Max-Forwards: 70", "Max-Forwards: 0");
        let m = scan(req.as_bytes()).unwrap();
        let mut out = Vec::new();
        assert_eq!(
            forward_request(&m, &rw(&l), &mut out),
            Err(RewriteError::TooManyHops)
        );
        build_response(&m, &Reply::TOO_MANY_HOPS, &mut out).unwrap();
        let r = scan(&out).unwrap();
        assert_eq!(r.status_code(), Some(483));
        assert!(r.to_tag().unwrap().starts_with(b"fc"));
        assert_eq!(r.call_id(), Some(&b"cid-1"[..]));
        assert_eq!(r.content_length(), Some(0));
    }

    #[test]
    fn response_roundtrip() {
        let l = local();
        let m = scan(REQ).unwrap();
        let mut fwd = Vec::new();
        forward_request(&m, &rw(&l), &mut fwd).unwrap();
        // The service answers by copying the Via headers.
        let f = scan(&fwd).unwrap();
        let mut resp = Vec::new();
        build_response(&f, &Reply::service_unavailable(5), &mut resp).unwrap();
        let r = scan(&resp).unwrap();
        let mut back = Vec::new();
        let route = forward_response(&r, &l, &mut back).unwrap();
        assert_eq!(route.target.socket_addr(), Some(src()));
        let b = scan(&back).unwrap();
        assert_eq!(b.vias().count(), 1);
        assert_eq!(b.top_via().unwrap().host, b"10.0.0.5");
        assert_eq!(b.header(b"retry-after"), Some(&b"5"[..]));
        // Not ours any more.
        assert_eq!(route_response(&b, &l).err(), Some(RewriteError::ViaNotOurs));
    }

    #[test]
    fn response_comma_joined_via() {
        let l = local();
        let resp = b"SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP 192.0.2.1;branch=z9hG4bK-fc-1;fc-conn=2a , SIP/2.0/UDP [2001:db8::5]:5070;branch=z9hG4bKq\r\nCall-ID: x\r\nContent-Length: 0\r\n\r\n";
        let m = scan(resp).unwrap();
        let mut out = Vec::new();
        let route = forward_response(&m, &l, &mut out).unwrap();
        assert_eq!(route.conn_id, Some(0x2a));
        assert_eq!(
            route.target.socket_addr(),
            Some("[2001:db8::5]:5070".parse().unwrap())
        );
        assert_eq!(
            out,
            b"SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP [2001:db8::5]:5070;branch=z9hG4bKq\r\nCall-ID: x\r\nContent-Length: 0\r\n\r\n"
        );
    }

    #[test]
    fn parse_advertise() {
        let l = Local::parse("sip.example.com", 5060, Transport::Udp).unwrap();
        assert!(l.is_local(b"SIP.example.com", None));
        let l = Local::parse("[2001:db8::1]:5070", 5060, Transport::Udp).unwrap();
        assert!(l.is_local(b"2001:db8::1", Some(5070)));
        assert!(!l.is_local(b"2001:db8::1", None));
        let l = Local::parse("2001:db8::1", 5080, Transport::Tcp).unwrap();
        assert_eq!(l.port(), 5080);
        let l = Local::parse("192.0.2.1:5062", 5060, Transport::Udp)
            .unwrap()
            .with_aliases(&["10.0.0.1:5060".parse().unwrap()]);
        assert!(l.is_local(b"192.0.2.1", Some(5062)));
        assert!(l.is_local(b"10.0.0.1", None));
        assert!(l.is_local_addr("[::ffff:10.0.0.1]:5060".parse().unwrap()));
        assert!(Local::parse("bad host", 5060, Transport::Udp).is_none());
        assert!(Local::parse("h:notaport", 5060, Transport::Udp).is_none());
        assert!(Local::parse("[::1", 5060, Transport::Udp).is_none());
    }

    #[test]
    fn ack_not_answered() {
        let m = scan(b"ACK sip:a SIP/2.0\r\nVia: SIP/2.0/UDP h;branch=z9hG4bK1\r\n\r\n").unwrap();
        let mut out = Vec::new();
        assert_eq!(
            build_response(&m, &Reply::BAD_REQUEST, &mut out),
            Err(RewriteError::AckNotAnswered)
        );
    }

    #[test]
    fn request_targets() {
        let l = local();
        let m = scan(b"BYE sip:alice@[2001:db8::7]:5999 SIP/2.0\r\nRoute: <sip:192.0.2.1;lr>, <sip:proxy2.example;lr>\r\nVia: SIP/2.0/UDP s;branch=z9hG4bK1\r\n\r\n").unwrap();
        assert_eq!(
            request_target(&m, &l).unwrap(),
            Target {
                host: Host::Name(b"proxy2.example"),
                port: 5060
            }
        );
        // Own Route value removed when forwarding, the other kept.
        let mut out = Vec::new();
        forward_request(&m, &rw(&l), &mut out).unwrap();
        let f = scan(&out).unwrap();
        assert_eq!(
            f.routes().collect::<Vec<_>>(),
            vec![&b"<sip:proxy2.example;lr>"[..]]
        );
        let m = scan(b"BYE sip:alice@[2001:db8::7]:5999 SIP/2.0\r\nRoute: <sip:192.0.2.1:5060;lr>\r\nVia: SIP/2.0/UDP s;branch=z9hG4bK1\r\n\r\n").unwrap();
        assert_eq!(
            request_target(&m, &l).unwrap().socket_addr(),
            Some("[2001:db8::7]:5999".parse().unwrap())
        );
        let mut out = Vec::new();
        forward_request(&m, &rw(&l), &mut out).unwrap();
        assert_eq!(scan(&out).unwrap().route(), None);
        let m = scan(b"BYE sip:x@192.0.2.1 SIP/2.0\r\nVia: SIP/2.0/UDP s;branch=z9hG4bK1\r\n\r\n")
            .unwrap();
        assert_eq!(request_target(&m, &l), Err(RewriteError::Loop));
    }

    #[test]
    fn reply_targets() {
        let m = scan(REQ).unwrap();
        assert_eq!(reply_target(&m, src()), src());
        let m = scan(b"OPTIONS sip:a SIP/2.0\r\nVia: SIP/2.0/UDP h:5099;branch=z9hG4bK1\r\n\r\n")
            .unwrap();
        assert_eq!(
            reply_target(&m, src()),
            "198.51.100.7:5099".parse().unwrap()
        );
    }
}
