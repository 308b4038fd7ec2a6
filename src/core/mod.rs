//! PURE: the decisions of the data paths, with no socket, task, clock or randomness of their
//! own: bytes, addresses, counters and `now` in, decisions out. The shells in `proxy` carry
//! them out.
//!
//! - `sip`      the SIP decision shared by every SIP vserver (a stateless proxy, RFC 3261 §16.11)
//! - `link`     a SIP stream vserver's connection to one service, as a state machine
//! - `inbound`  the receive buffer and message deadline of one SIP stream
//! - `udp`      a udp vserver's per-datagram session decision
//! - `tcp`      what a tcp / http vserver reads before choosing, and the key it hashes

pub mod inbound;
pub mod link;
pub mod sip;
pub mod tcp;
pub mod udp;
