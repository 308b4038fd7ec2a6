//! The data paths (IO shells around the pure core) and the runtime that starts them.

pub(crate) mod fd_limit;
pub mod proxy_protocol;
pub(crate) mod reconfig;
pub(crate) mod runtime;
pub(crate) mod shutdown;
pub mod sip_core;
pub(crate) mod sip_tcp;
pub(crate) mod sip_udp;
pub(crate) mod tcp;
pub(crate) mod udp;

pub use fd_limit::raise_nofile_limit;
pub use reconfig::Rebuilt;
pub use runtime::{DataPath, Runtime, RuntimeError, VserverHandle};
pub use sip_tcp::{TcpCounters, TcpShared};
pub use tcp::TcpCore;
pub use udp::UdpCore;

use crate::stats::Nanos;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often the dialog sweepers look at the current core's sweep interval (a reload may
/// shorten it). Shutdown does not wait on it: see [`shutdown`].
pub const POLL: Duration = Duration::from_millis(100);

/// Count one event.
pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Logs at most once per second per limiter (bad input must not flood the log).
#[derive(Debug, Default)]
pub struct LogLimiter {
    last_s: AtomicU64,
}

impl LogLimiter {
    pub fn allow(&self, now: Nanos) -> bool {
        let s = now / 1_000_000_000 + 1;
        let last = self.last_s.load(Ordering::Relaxed);
        s != last
            && self
                .last_s
                .compare_exchange(last, s, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

/// Nanoseconds since `epoch` (the shell's clock, handed to the pure core).
pub fn elapsed_nanos(epoch: Instant) -> Nanos {
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
