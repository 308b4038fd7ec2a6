//! fulcrum — a SIP-aware UDP/TCP load-balancing proxy.
//!
//! # Layout
//! A pure decision core (no sockets, no clock, no randomness) inside an I/O shell.
//!
//! - `config`     PURE  YAML model, validation with field paths and line numbers
//! - `dialog`     PURE  Call-ID → service affinity table with idle expiry (time passed in)
//! - `http`       PURE  first HTTP/1.x request head: target, Host, headers, query
//! - `key`        PURE  hash method -> key from a request context (addresses + payload view)
//! - `methods`    PURE  non-hash methods (round robin, least connection, ...) over the counters
//! - `net`        IO    SO_REUSEPORT worker sockets
//! - `simulate`   PURE  `fulcrum simulate` engines driving the real core with simulated time
//! - `sip`        PURE  zero-copy SIP scanner, stateless-proxy rewrite, TCP stream framing
//! - `slow_start` PURE  slow-start state machine driven by injected time
//! - `stats`      PURE  per-service atomic counters (connections, rates, response times, load)
#![forbid(unsafe_code)]

pub mod config;
pub mod dialog;
pub mod http;
pub mod key;
pub mod methods;
pub mod net;
pub mod simulate;
pub mod sip;
pub mod slow_start;
pub mod stats;
