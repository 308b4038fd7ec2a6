//! Open-file limit. IO.
//!
//! Every UDP session owns a socket and every TCP connection two, so the default soft limit
//! (often 1024) would cap a vserver far below its `max_sessions`. The soft limit is raised
//! to the hard limit once per process, and the result logged; when the vservers'
//! `max_sessions` together cannot fit in the result, the start says so.

use crate::config::{Protocol, Vserver};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use std::sync::OnceLock;

static LIMIT: OnceLock<Option<u64>> = OnceLock::new();

/// Raise RLIMIT_NOFILE's soft limit to its hard limit (once per process); the soft limit
/// in force afterwards, `None` when it cannot be read.
pub fn raise_nofile_limit() -> Option<u64> {
    *LIMIT.get_or_init(|| match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => {
                tracing::info!(from = soft, to = hard, "open-file limit raised");
                Some(hard)
            }
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit");
                Some(soft)
            }
        },
        Ok((soft, _)) => {
            tracing::info!(limit = soft, "open-file limit already at its hard limit");
            Some(soft)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-file limit");
            None
        }
    })
}

/// Descriptors vserver `v` holds at its `max_sessions`: one per UDP session and per sip-tcp
/// or sip-tls client connection, two per TCP / HTTP connection (client and service side); sip-udp holds
/// only its worker sockets.
fn fds_at_max(v: &Vserver) -> u64 {
    let each = match v.protocol {
        Protocol::Udp | Protocol::SipTcp | Protocol::SipTls => 1,
        Protocol::Tcp | Protocol::Http => 2,
        Protocol::SipUdp => 0,
    };
    (v.max_sessions as u64).saturating_mul(each)
}

/// Raise the limit, and warn when the vservers at their `max_sessions` together need more
/// descriptors than it allows (sessions beyond fail to open and are counted as socket
/// errors). One warning for the process, as the limit is the process's: the vservers draw
/// on it together.
pub(crate) fn check_capacity(vservers: &[Vserver]) {
    let Some(limit) = raise_nofile_limit() else {
        return;
    };
    let need: u64 = vservers.iter().map(fds_at_max).fold(0, u64::saturating_add);
    if need > limit {
        let each: Vec<String> = vservers
            .iter()
            .filter(|v| fds_at_max(v) > 0)
            .map(|v| format!("{}={}", v.name, fds_at_max(v)))
            .collect();
        tracing::warn!(
            open_file_limit = limit,
            needed = need,
            by_vserver = %each.join(" "),
            "the vservers' max_sessions need more descriptors than the open-file limit allows: sessions beyond it will fail to open"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_per_protocol() {
        let cfg = crate::config::from_str(
            "t.yaml",
            "services:\n  - { name: s, address: 127.0.0.1:9, protocol: udp }\n  - { name: t, address: 127.0.0.1:9, protocol: tcp }\nvservers:\n  - { name: u, protocol: udp, bind: [127.0.0.1:0], method: round_robin, max_sessions: 10, services: [s] }\n  - { name: c, protocol: tcp, bind: [127.0.0.1:0], method: round_robin, max_sessions: 10, services: [t] }\n",
        )
        .expect("valid");
        let needs: Vec<u64> = cfg.vservers.iter().map(fds_at_max).collect();
        assert_eq!(needs, vec![10, 20]);
    }
}
