//! The data paths (IO shells around the pure core) and the runtime that starts them.

pub mod fd_limit;
pub mod proxy_protocol;
pub mod runtime;
pub mod sip_udp;
pub mod tcp;
pub mod udp;

pub use runtime::{Runtime, RuntimeError, VserverHandle};
