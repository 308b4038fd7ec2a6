//! Vserver `freebind`: a standby binds the VIP it does not hold yet (docs/deployment.md).
//! The addresses are documentation prefixes on no host (192.0.2.0/24, RFC 5737;
//! 2001:db8::/32, RFC 3849); the sockets are only bound, nothing is sent from them.

mod common;

use common::ConfigFile;
use std::net::SocketAddr;
use std::process::{Command, Stdio};

const PROTOCOLS: [&str; 5] = ["sip-udp", "sip-tcp", "udp", "tcp", "http"];

/// One vserver `v` of `protocol` on `bind` over a service that is never contacted.
fn yaml(protocol: &str, bind: &str, freebind: bool) -> String {
    let svc: SocketAddr = "127.0.0.1:9".parse().expect("addr");
    let extra = format!("freebind: {freebind}\nworkers: 2");
    common::config(protocol, bind, "round_robin", &extra, &[("s0", svc)])
}

fn start(yaml: &str) -> Result<fulcrum::proxy::Runtime, fulcrum::proxy::RuntimeError> {
    let cfg = fulcrum::config::from_str("t.yaml", yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    fulcrum::proxy::Runtime::start(&cfg)
}

/// net.ipv4.ip_nonlocal_bind = 1 lets every socket bind any address, as freebind does: then the
/// refusal cannot be seen.
fn nonlocal_bind_allowed(family: &str) -> bool {
    std::fs::read_to_string(format!("/proc/sys/net/{family}/ip_nonlocal_bind"))
        .is_ok_and(|v| v.trim() != "0")
}

#[test]
fn freebind_binds_an_address_not_on_the_host_for_every_protocol() {
    for proto in PROTOCOLS {
        let rt =
            start(&yaml(proto, "192.0.2.1:0", true)).unwrap_or_else(|e| panic!("{proto}: {e}"));
        let bound = common::bound(&rt, "v");
        assert_eq!(bound.ip().to_string(), "192.0.2.1", "{proto}");
        assert_ne!(bound.port(), 0, "{proto}");
        rt.shutdown();
    }
}

#[test]
fn without_freebind_the_error_names_the_field() {
    if nonlocal_bind_allowed("ipv4") {
        return;
    }
    for proto in PROTOCOLS {
        let e = start(&yaml(proto, "192.0.2.1:5060", false))
            .expect_err("192.0.2.1 is not on this host")
            .to_string();
        assert!(e.contains("vserver `v`"), "{proto}: {e}");
        assert!(e.contains("192.0.2.1:5060"), "{proto}: {e}");
        assert!(
            e.contains("address not available on this host"),
            "{proto}: {e}"
        );
        assert!(e.contains("`freebind: true`"), "{proto}: {e}");
    }
}

/// IPV6_FREEBIND, when the host has IPv6 at all.
#[test]
fn freebind_binds_an_ipv6_address_not_on_the_host() {
    if std::net::UdpSocket::bind("[::1]:0").is_err() {
        return;
    }
    for proto in ["sip-udp", "tcp"] {
        let rt =
            start(&yaml(proto, "[2001:db8::1]:0", true)).unwrap_or_else(|e| panic!("{proto}: {e}"));
        assert_eq!(common::bound(&rt, "v").ip().to_string(), "2001:db8::1");
        rt.shutdown();
        if nonlocal_bind_allowed("ipv6") {
            continue;
        }
        let e = start(&yaml(proto, "[2001:db8::1]:5060", false)).expect_err("not on this host");
        assert!(e.to_string().contains("`freebind: true`"), "{proto}: {e}");
    }
}

/// What an operator sees: `fulcrum run` exits non-zero with the message on stderr.
#[test]
fn fulcrum_run_reports_the_missing_freebind() {
    if nonlocal_bind_allowed("ipv4") {
        return;
    }
    let file = ConfigFile::new("freebind", &yaml("sip-udp", "192.0.2.1:5060", false));
    let out = Command::new(env!("CARGO_BIN_EXE_fulcrum"))
        .args(["run", "--config", file.arg()])
        .stdin(Stdio::null())
        .output()
        .expect("run fulcrum");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("set `freebind: true`"), "{stderr}");
}
