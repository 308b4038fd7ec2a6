//! The data paths (IO shells around the pure core) and the runtime that starts them.

pub(crate) mod context;
pub(crate) mod evict;
pub(crate) mod flows;
pub(crate) mod handover;
pub(crate) mod packet;
pub mod proxy_protocol;
pub(crate) mod reconfig;
pub(crate) mod runtime;
pub(crate) mod shutdown;
pub(crate) mod sip_front;
pub(crate) mod sip_stream;
pub(crate) mod sip_udp;
pub(crate) mod tcp;
pub(crate) mod udp;

pub use crate::core::udp::UdpCore;
pub use context::{DataPath, POLL, RuntimeError, VserverHandle, elapsed_nanos};
pub use context::{Prepared, Rebuilt};
pub use runtime::{PreparedVserver, Runtime};
pub use sip_stream::{SipStreamCounters, SipStreamPath, SipStreamShared};
pub use sip_udp::SipUdpPath;
pub use tcp::TcpCore;
pub use tcp::TcpPath;
pub use udp::UdpPath;
