//! fulcrum — a SIP-aware UDP/TCP load-balancing proxy.
//!
//! # Layout
//! A pure decision core (no sockets, no clock, no randomness) inside an I/O shell.
//!
//! - `config`  PURE  YAML model, validation with field paths and line numbers
//! - `dialog`  PURE  Call-ID → service affinity table with idle expiry (time passed in)
//! - `http`    PURE  first HTTP/1.x request head: target, Host, headers, query
//! - `key`     PURE  hash method -> key from a request context (addresses + payload view)
//! - `net`     IO    SO_REUSEPORT worker sockets
//! - `sip`     PURE  zero-copy SIP scanner, stateless-proxy rewrite, TCP stream framing
#![forbid(unsafe_code)]

pub mod config;
pub mod dialog;
pub mod http;
pub mod key;
pub mod net;
pub mod sip;
