//! SIP message layer for the stateless proxy paths. PURE.
//!
//! - [`scan`]: zero-copy scanner: start line, the headers a proxy needs, Via values, URIs.
//! - [`rewrite`]: the bytes a stateless proxy sends (RFC 3261 §16.6, §16.11; RFC 3581),
//!   written into a caller-owned buffer, and the routing decisions that go with them.
//! - [`framing`]: where one SIP message ends on a stream (RFC 3261 §18.3, RFC 5626 §3.5.1).

pub mod framing;
pub mod rewrite;
pub mod scan;

pub use framing::{DEFAULT_MAX_MESSAGE, Frame, FrameError, PONG, next_frame};
pub use rewrite::{
    BRANCH_PREFIX, CONN_PARAM, DEFAULT_MAX_FORWARDS, Host, Local, Reply, RequestRewrite,
    ResponseRoute, RewriteError, Target, Transport, build_response, forward_request,
    forward_response, reply_target, request_target, route_response,
};
pub use scan::{
    CSeq, Header, HeaderName, Headers, MAX_HEADERS, NameAddr, ScanError, SipMethod, SipMsg, Span,
    StartLine, Uri, Via, Vias, parse_ip, parse_name_addr, parse_uri, scan,
};
