//! fulcrum — a SIP-aware UDP/TCP load-balancing proxy.
//!
//! # Layout
//! A pure decision core (no sockets, no clock, no randomness) inside an I/O shell.
//!
//! - `config`  PURE  YAML model, validation with field paths and line numbers
//! - `sip`     PURE  zero-copy SIP scanner, stateless-proxy rewrite, TCP stream framing
//! - `http`    PURE  first HTTP/1.x request head: target, Host, headers, query
//! - `key`     PURE  hash method -> key from a request context (addresses + payload view)
#![forbid(unsafe_code)]

pub mod config;
pub mod http;
pub mod key;
pub mod sip;
