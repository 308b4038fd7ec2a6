//! The data paths (IO shells around the pure core) and the runtime that starts them.

pub(crate) mod fd_limit;
pub mod proxy_protocol;
pub(crate) mod reconfig;
pub(crate) mod runtime;
pub(crate) mod shutdown;
pub(crate) mod sip_tcp;
pub(crate) mod sip_udp;
pub(crate) mod tcp;
pub(crate) mod udp;

pub use crate::core::udp::UdpCore;
pub use fd_limit::raise_nofile_limit;
pub use reconfig::Rebuilt;
pub use runtime::{DataPath, Runtime, RuntimeError, VserverHandle};
pub use sip_tcp::{TcpCounters, TcpShared};
pub use tcp::TcpCore;

use crate::stats::Nanos;
use std::time::{Duration, Instant};

/// How often the dialog sweepers look at the current core's sweep interval (a reload may
/// shorten it). Shutdown does not wait on it: see [`shutdown`].
pub const POLL: Duration = Duration::from_millis(100);

/// Nanoseconds since `epoch` (the shell's clock, handed to the pure core).
pub fn elapsed_nanos(epoch: Instant) -> Nanos {
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
