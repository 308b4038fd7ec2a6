//! The data paths (IO shells around the pure core) and the runtime that starts them.

pub mod reconfig;
pub mod runtime;
pub mod sip_udp;

pub use reconfig::Rebuilt;
pub use runtime::{DataPath, Runtime, RuntimeError, VserverHandle};
