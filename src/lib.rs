//! fulcrum — a SIP-aware UDP/TCP load-balancing proxy.
//!
//! # Layout
//! A pure decision core (no sockets, no clock, no randomness) inside an I/O shell.
//!
//! - `config`  PURE  YAML model, validation with field paths and line numbers
#![forbid(unsafe_code)]

pub mod config;
