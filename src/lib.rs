//! fulcrum — a SIP-aware UDP/TCP load-balancing proxy.
//!
//! # Layout
//! A pure decision core (no sockets, no clock, no randomness) inside an I/O shell.
//!
//! - `config`  PURE  YAML model, validation with field paths and line numbers
//! - `hash`    PURE  fixed, seeded hash functions: keys, service identities, carp combine
//! - `select`  PURE  consistent-hash selectors carp, prac, jarh: ranking and UP/eligible filtering
//! - `simulate` PURE  `fulcrum simulate` engines (hash distribution, disruption, lookup time)
#![forbid(unsafe_code)]

pub mod config;
pub mod hash;
pub mod select;
pub mod simulate;
