//! SIP message layer for the stateless proxy paths. PURE.
//!
//! - [`scan`]: zero-copy scanner: start line, the headers a proxy needs, Via values, URIs.
//! - [`rewrite`]: the bytes a stateless proxy sends (RFC 3261 §16.6, §16.11; RFC 3581),
//!   written into a caller-owned buffer, and the routing decisions that go with them.
//! - [`flow`]: flow tokens (`fc-flow`) naming a client's flow in Path and Record-Route.
//! - [`framing`]: where one SIP message ends on a stream (RFC 3261 §18.3, RFC 5626 §3.5.1).
//!
//! The shape of one datagram through a stateless proxy (the socket shell does the I/O):
//!
//! ```
//! use fulcrum::sip::{self, Local, Reply, RequestRewrite, RewriteError, Transport};
//!
//! let local = Local::new("192.0.2.1", 5060, Transport::Udp);
//! let src = "198.51.100.7:40000".parse().unwrap();
//! let datagram = b"OPTIONS sip:bob@example.com SIP/2.0\r\n\
//! Via: SIP/2.0/UDP 10.0.0.5:5062;branch=z9hG4bK1;rport\r\n\
//! From: <sip:alice@example.com>;tag=1\r\nTo: <sip:bob@example.com>\r\n\
//! Call-ID: c1\r\nCSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n";
//! let mut out = Vec::with_capacity(2048); // reused across datagrams
//!
//! let msg = sip::scan(datagram).expect("drop and count on error");
//! if msg.is_request() {
//!     if msg.missing_mandatory().is_some() {
//!         sip::build_response(&msg, &Reply::BAD_REQUEST, &mut out).ok();
//!     } else {
//!         let rw = RequestRewrite { local: &local, src, record_route: true,
//!                                   force_rport: false, conn_id: None,
//!                                   service: None, arrived_on: None,
//!                                   flow: None, path: None };
//!         match sip::forward_request(&msg, &rw, &mut out) {
//!             Ok(_) => { /* send `out` to the service chosen from the key */ }
//!             Err(RewriteError::TooManyHops) => {
//!                 out.clear();
//!                 // Err(AckNotAnswered) for an ACK: drop it.
//!                 let _ = sip::build_response(&msg, &Reply::TOO_MANY_HOPS, &mut out);
//!                 let _to = sip::reply_target(&msg, src);
//!             }
//!             Err(_) => { /* 400 or drop */ }
//!         }
//!     }
//! } else {
//!     // From a service: `forward_response` checks and strips our Via and says where to send.
//!     let _ = sip::forward_response(&msg, &local, &mut out);
//! }
//! ```

pub mod flow;
pub(crate) mod framing;
pub(crate) mod lex;
pub(crate) mod local;
pub(crate) mod rewrite;
pub(crate) mod scan;
mod text;
pub(crate) mod values;

pub use framing::{DEFAULT_MAX_MESSAGE, Frame, FrameError, Framer, PONG, next_frame};
pub use lex::Span;
pub use rewrite::{
    BRANCH_PREFIX, CONN_PARAM, DEFAULT_MAX_FORWARDS, Host, Local, Reply, RequestRewrite,
    ResponseRoute, RewriteError, SERVICE_PARAM, Target, Transport, acks_own_reply,
    build_hop_request, build_reply, build_response, forward_request, forward_request_attempt,
    forward_response, reply_target, request_target, rfc2543_invite_key, route_response,
    routed_flow, routed_service, transaction_key, transaction_of,
};
pub use scan::{
    Header, HeaderName, Headers, MAX_HEADERS, ScanError, SipMethod, SipMsg, StartLine, Vias, scan,
    scan_for_reply,
};
pub use values::{
    CSeq, MaxForwards, NameAddr, Rport, Uri, Via, parse_ip, parse_name_addr, parse_retry_after,
    parse_uri,
};
