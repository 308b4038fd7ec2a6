//! Packet vservers (`protocol: ip`, docs/firewall.md): packets forwarded unchanged at the IP
//! layer by a kernel program, only their Ethernet addresses rewritten. IO.
//!
//! This build carries no such data path: [`start`] refuses every packet vserver with the
//! reason, and [`super::Runtime::start`] starts the other vservers beside it. The refusal
//! is the one place a packet data path plugs in.

use crate::config::{Config, Vserver};
use crate::proxy::RuntimeError;

/// Why this build cannot forward packets, in the words the operator reads.
pub(crate) const UNAVAILABLE: &str = "protocol ip needs the kernel packet data path (a tc BPF program), which this build of fulcrum does not have; the vserver is not started, the others are";

/// Start packet vserver `v` of `config`; here always the error that names it and says why.
pub(crate) fn start(_config: &Config, v: &Vserver) -> Result<(), RuntimeError> {
    Err(RuntimeError::Setup {
        vserver: v.name.clone(),
        problem: UNAVAILABLE.to_owned(),
    })
}
