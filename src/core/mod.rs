//! PURE: the decisions of the data paths, with no socket, task, clock or randomness of their
//! own: bytes, addresses, counters and `now` in, decisions out. The shells in `proxy` carry
//! them out.
//!
//! - `sip`      the SIP decision shared by every SIP vserver (a stateless proxy, RFC 3261 §16.11)
//! - `link`     a SIP stream vserver's connection to one service, as a state machine
//! - `inbound`  the receive buffer and message deadline of one SIP stream
//! - `udp`      a udp vserver's per-datagram session decision
//! - `tcp`      what a tcp / http vserver reads before choosing, and the key it hashes

use std::time::Duration;

/// How long a connect to a service may take (TCP, and a TLS handshake where the service has
/// `tls`) before the next member is tried or the link backs off. Short: a service that does
/// not answer a SYN within it is as good as down for this request. One bound for every data
/// path.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

pub mod inbound;
pub mod link;
pub mod sip;
pub mod tcp;
pub mod udp;
