//! Open-file limit. IO.
//!
//! Every UDP session owns a socket and every TCP connection two, so the default soft limit
//! (often 1024) would cap a vserver far below its `max_sessions`. The soft limit is raised
//! to the hard limit once per process, and the result logged; when the vservers'
//! `max_sessions` together cannot fit in the result, the start says so.

use crate::config::{Config, Protocol, Vserver};
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
        Protocol::Udp
        | Protocol::SipTcp
        | Protocol::SipTls
        | Protocol::SipWs
        | Protocol::SipWss => 1,
        Protocol::Tcp | Protocol::Http => 2,
        Protocol::SipUdp | Protocol::Ip => 0,
    };
    (v.max_sessions as u64).saturating_mul(each)
}

/// The files the config needs kept whatever clients do ([`crate::budget::Needs`]).
pub(crate) fn needs(config: &Config) -> crate::budget::Needs {
    let mut n = crate::budget::Needs::default();
    for v in &config.vservers {
        let workers = crate::net::worker_count(v.workers) as u64;
        let sockets = workers * v.bind.len() as u64 * (1 + u64::from(v.service_source.is_some()));
        // A timer thread's and a UDP leg's sockets, an io_uring ring per worker.
        n.listeners += sockets + workers + 2;
        if v.protocol.is_sip() {
            n.links += v.services.len() as u64;
        }
    }
    n.probes = config
        .services
        .iter()
        .filter(|s| s.monitor.is_some())
        .count() as u64;
    if config.admin.listen.is_some() {
        // The listener and the connections the admin API serves at once.
        n.admin = 1 + crate::budget::ADMIN_CONNECTIONS as u64;
    }
    n
}

/// The budget of a process running `config`: its open-file limit (raised) divided into the
/// reserve and the pool.
pub(crate) fn budget(config: &Config) -> crate::budget::FileBudget {
    match raise_nofile_limit() {
        Some(limit) => crate::budget::FileBudget::new(limit, &needs(config)),
        None => crate::budget::FileBudget::unlimited(),
    }
}

/// The ports of the ephemeral range (`net.ipv4.ip_local_port_range`), `None` when it cannot
/// be read.
fn ephemeral_ports() -> Option<u64> {
    port_range_size(&std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?)
}

/// The ports of a range as the kernel writes it (`"32768\t60999\n"`).
fn port_range_size(text: &str) -> Option<u64> {
    let mut it = text.split_whitespace().map(|v| v.parse::<u64>().ok());
    let (lo, hi) = (it.next()??, it.next()??);
    (hi >= lo).then(|| hi - lo + 1)
}

/// Warn when a tcp / http vserver's `max_sessions` passes the ephemeral ports toward one
/// service address: connections to one service beyond the range fail to connect (counted as
/// `ports_exhausted`).
fn check_ports(vservers: &[Vserver]) {
    let Some(ports) = ephemeral_ports() else {
        return;
    };
    for (i, v) in vservers.iter().enumerate() {
        if matches!(v.protocol, Protocol::Tcp | Protocol::Http) && v.max_sessions as u64 > ports {
            tracing::warn!(
                field = %format!("vservers[{i}].max_sessions"),
                vserver = %v.name,
                max_sessions = v.max_sessions,
                ephemeral_ports = ports,
                "more connections than ephemeral ports toward one service address: past the range, connections to one service fail (ports_exhausted); widen net.ipv4.ip_local_port_range or add service addresses (docs/limits.md)"
            );
        }
    }
}

/// Warn when the vservers at their `max_sessions` together need more files than the pool
/// holds (connections and sessions beyond it are refused and counted), naming each field.
/// One warning for the process, as the pool is the process's: the vservers draw on it
/// together.
pub(crate) fn check_capacity(vservers: &[Vserver], budget: &crate::budget::FileBudget) {
    check_ports(vservers);
    // A udp vserver's unset max_sessions is clamped to the pool (and says so at its start).
    let fds_at_max = |v: &Vserver| {
        let n = fds_at_max(v);
        if v.protocol == Protocol::Udp && !v.max_sessions_set {
            n.min(budget.pool())
        } else {
            n
        }
    };
    let need: u64 = vservers.iter().map(fds_at_max).fold(0, u64::saturating_add);
    tracing::info!(
        open_file_limit = budget.limit(),
        reserve = budget.reserve(),
        pool = budget.pool(),
        "open files: a reserve for monitors, admin and service links; the pool for client connections and sessions"
    );
    if need > budget.pool() {
        let each: Vec<String> = vservers
            .iter()
            .enumerate()
            .filter(|(_, v)| fds_at_max(v) > 0)
            .map(|(i, v)| format!("vservers[{i}].max_sessions ({})={}", v.name, fds_at_max(v)))
            .collect();
        tracing::warn!(
            pool = budget.pool(),
            needed = need,
            by_field = %each.join(" "),
            "the vservers' max_sessions need more open files than the pool holds: connections and sessions beyond it are refused and counted (docs/limits.md)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ephemeral_range_is_read_as_the_kernel_writes_it() {
        assert_eq!(port_range_size("32768\t60999\n"), Some(28_232));
        assert_eq!(port_range_size("1024 1024"), Some(1));
        assert_eq!(port_range_size("60999 32768"), None);
        assert_eq!(port_range_size("x"), None);
    }

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
