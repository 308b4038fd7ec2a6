//! fulcrum — a SIP-aware UDP/TCP load-balancing proxy.
//!
//! # Layout
//! A pure decision core (no sockets, no clock, no randomness) inside an I/O shell.
//!
//! - `config`  PURE  YAML model, validation with field paths and line numbers
//! - `stats`   PURE  per-service atomic counters (connections, rates, response times, load)
//! - `methods` PURE  non-hash methods (round robin, least connection, ...) over the counters
//! - `slow_start` PURE  slow-start state machine driven by injected time
//! - `simulate` PURE  `fulcrum simulate` engines driving the real core with simulated time
#![forbid(unsafe_code)]

pub mod config;
pub mod methods;
pub mod simulate;
pub mod slow_start;
pub mod stats;
