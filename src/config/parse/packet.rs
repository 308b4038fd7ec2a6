//! The rules of a `protocol: ip` vserver (docs/firewall.md): the links it takes packets
//! from, its `sticky` flag, the hash methods a per-packet choice can use, and every field that
//! means nothing when the kernel forwards packets unchanged. PURE.
//!
//! Nothing here asks the host whether an interface exists or BPF is available: `fulcrum
//! check` validates the file alone, and the start reports what the host lacks.

use super::service::interface_name;
use super::{Cx, Fields, join};
use crate::config::model::*;
use crate::config::yaml::Value;

/// The methods a packet vserver hashes with: they read addresses (and the source port)
/// only, which every packet of a flow carries.
const PACKET_METHODS: &[Method] = &[
    Method::SourceDestIpHash,
    Method::SourceIpSourcePortHash,
    Method::SourceIpHash,
    Method::DestIpHash,
];

const NO_SESSIONS: &str = "a packet vserver keeps no sessions or connections: each packet's service follows from its hash";
const NOT_SIP: &str = "a SIP field, and a packet vserver does not read SIP";
const IN_KERNEL: &str = "packets are forwarded in the kernel as they arrive, with no socket, worker, TLS or proxy header of fulcrum's on their path";

/// Vserver fields a packet vserver refuses, and why.
const NOT_FOR_PACKET: &[(&str, &str)] = &[
    (
        "bind",
        "a packet vserver has no listening socket: it forwards what arrives on `interface`",
    ),
    (
        "hash_length",
        "a packet vserver hashes addresses, not a URL",
    ),
    (
        "token",
        "a packet vserver hashes addresses, not a header or payload",
    ),
    ("aor_key", NOT_SIP),
    (
        "hash_balance_factor",
        "bounded loads count each service's connections, which the packet path does not",
    ),
    (
        "slow_start",
        "slow start paces new connections, which a per-packet hash does not see",
    ),
    ("advertise", NOT_SIP),
    ("service_source", NOT_SIP),
    ("record_route", NOT_SIP),
    ("path", NOT_SIP),
    ("allowed_origins", NOT_SIP),
    ("failover", NOT_SIP),
    ("idle_timeout", NO_SESSIONS),
    ("drain_timeout", NO_SESSIONS),
    ("max_sessions", NO_SESSIONS),
    ("max_per_source", NO_SESSIONS),
    (
        "allow",
        "access lists act on fulcrum's sockets; filter on the firewalls",
    ),
    (
        "deny",
        "access lists act on fulcrum's sockets; filter on the firewalls",
    ),
    (
        "flood",
        "flood limits act on fulcrum's sockets; filter on the firewalls",
    ),
    (
        "eject",
        "passive ejection watches the requests fulcrum relays; an `icmp` monitor watches a firewall",
    ),
    ("transparent", IN_KERNEL),
    ("freebind", IN_KERNEL),
    ("send_proxy", IN_KERNEL),
    ("kernel_relay", IN_KERNEL),
    ("workers", IN_KERNEL),
    ("tls", IN_KERNEL),
    ("tls_handshake_timeout", IN_KERNEL),
    ("client_hello_timeout", IN_KERNEL),
];

impl Cx {
    /// `interface` (a non-empty list of link names, required) and `sticky` (default false)
    /// on a `protocol: ip` vserver; both refused on any other, where they read as an empty
    /// list and false.
    pub(super) fn packet_fields(
        &mut self,
        f: &Fields,
        path: &str,
        protocol: Option<Protocol>,
    ) -> (Option<Vec<String>>, Option<bool>) {
        let Some(p) = protocol else {
            return (None, None);
        };
        if !p.is_packet() {
            for field in ["interface", "sticky"] {
                if let Some(n) = f.get(field) {
                    self.problem(
                        n.pos,
                        &join(path, field),
                        format!(
                            "`{field}` applies to `protocol: ip` vservers only, not {}",
                            p.name()
                        ),
                    );
                }
            }
            return (Some(Vec::new()), Some(false));
        }
        let sticky = self.bool_field(f, path, "sticky", false);
        let ip = join(path, "interface");
        let Some(node) = f.get("interface") else {
            self.problem(
                f.pos,
                &ip,
                "missing required field `interface`: the links whose arriving packets a `protocol: ip` vserver forwards, e.g. `interface: [eth1]`",
            );
            return (None, sticky);
        };
        let items: Vec<(&crate::config::yaml::Node, String)> = match &node.value {
            Value::Seq(items) => items
                .iter()
                .enumerate()
                .map(|(i, n)| (n, format!("{ip}[{i}]")))
                .collect(),
            _ => vec![(node, ip.clone())],
        };
        if items.is_empty() {
            self.problem(node.pos, &ip, "at least one interface is required");
            return (None, sticky);
        }
        let mut names: Vec<String> = Vec::new();
        let mut ok = true;
        for (n, at) in items {
            let Some(name) = self.string(n, &at) else {
                ok = false;
                continue;
            };
            if let Err(e) = interface_name(&name) {
                self.problem(n.pos, &at, e);
                ok = false;
            } else if names.contains(&name) {
                self.problem(n.pos, &at, format!("`{name}` is listed twice"));
                ok = false;
            } else {
                names.push(name);
            }
        }
        (ok.then_some(names), sticky)
    }

    /// The rules of a packet vserver: a method it can hash each packet with, and none of
    /// the fields that need a socket, a session or a SIP message.
    pub(super) fn packet_rules(&mut self, f: &Fields, path: &str, method: Option<Method>) {
        if let (Some(m), Some(n)) = (method, f.get("method"))
            && !PACKET_METHODS.contains(&m)
        {
            let names: Vec<&str> = PACKET_METHODS.iter().map(|m| m.name()).collect();
            self.problem(
                n.pos,
                &join(path, "method"),
                format!(
                    "{} cannot choose per packet; a `protocol: ip` vserver hashes addresses: {}",
                    m.name(),
                    names.join(", ")
                ),
            );
        }
        for (field, why) in NOT_FOR_PACKET {
            if let Some(n) = f.get(field) {
                self.problem(
                    n.pos,
                    &join(path, field),
                    format!("`{field}` does not apply to a `protocol: ip` vserver: {why}"),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::problems;
    use crate::config::from_str;
    use crate::config::model::*;

    const SANDWICH: &str = "\
monitors:
  - { name: fw-ping, type: icmp, interval: 1s, timeout: 500ms, failures_to_down: 2, successes_to_up: 2 }
services:
  - { name: fw1-out, protocol: ip, address: 10.10.1.11, interface: lbo-f1, hash_id: fw1, monitor: fw-ping }
  - { name: fw2-out, protocol: ip, address: \"fd00:10::12\", interface: lbo-f2, hash_id: fw2, monitor: fw-ping }
vservers:
  - { name: outside, protocol: ip, interface: [lbo-c], method: source_dest_ip_hash, netmask: 255.255.255.255,
      v6_netmask_len: 128, services: [fw1-out, fw2-out], sticky: false }
";

    /// The agreed format reads into the model: an IP without port, the legs' links, the
    /// vserver's links and flag, and no listener.
    #[test]
    fn a_packet_vserver_reads() {
        let c = from_str("t", SANDWICH).expect("valid");
        assert_eq!(c.monitors[0].kind, MonitorKind::Icmp);
        let s = &c.services[0];
        assert_eq!(s.protocol, Protocol::Ip);
        assert_eq!(s.address, "10.10.1.11:0".parse().expect("addr"));
        assert_eq!(s.interface.as_deref(), Some("lbo-f1"));
        assert_eq!(
            c.services[1].address,
            "[fd00:10::12]:0".parse().expect("addr")
        );
        let v = &c.vservers[0];
        assert_eq!(v.protocol, Protocol::Ip);
        assert!(v.bind.is_empty());
        assert_eq!(v.interfaces, ["lbo-c"]);
        assert!(!v.sticky);
        assert_eq!(v.method, Method::SourceDestIpHash);
        assert_eq!(v.services, [0, 1]);
        // The method defaults to the symmetric one; sticky reads.
        let text = SANDWICH
            .replace("method: source_dest_ip_hash, ", "")
            .replace("sticky: false", "sticky: true");
        let v = &from_str("t", &text).expect("valid").vservers[0];
        assert_eq!((v.method, v.sticky), (Method::SourceDestIpHash, true));
    }

    fn one(old: &str, new: &str) -> Vec<(u32, String, String)> {
        assert!(SANDWICH.contains(old), "{old}");
        problems(&SANDWICH.replacen(old, new, 1))
    }

    /// Golden problems: each at its line and column's field, saying why.
    #[test]
    fn service_problems_name_the_field_and_why() {
        let cases: &[(&str, &str, u32, &str, &str)] = &[
            (
                "address: 10.10.1.11,",
                "address: \"10.10.1.11:80\",",
                4,
                "services[0].address",
                "has a port",
            ),
            (
                "address: 10.10.1.11,",
                "address: fw1.example,",
                4,
                "services[0].address",
                "not an IP address",
            ),
            (
                "address: 10.10.1.11,",
                "address: 0.0.0.0,",
                4,
                "services[0].address",
                "unicast",
            ),
            (
                " interface: lbo-f1,",
                "",
                4,
                "services[0].interface",
                "missing required field `interface`",
            ),
            (
                "interface: lbo-f1,",
                "interface: a-name-far-too-long,",
                4,
                "services[0].interface",
                "not a network interface name",
            ),
            (
                "hash_id: fw1,",
                "hash_id: fw1, max_clients: 5,",
                4,
                "services[0].max_clients",
                "counts none",
            ),
            (
                "hash_id: fw1,",
                "hash_id: fw1, port: 5,",
                4,
                "services[0].port",
                "keep their own ports",
            ),
            (
                "type: icmp",
                "type: tcp-connect",
                4,
                "services[0].monitor",
                "not of type icmp",
            ),
        ];
        for (old, new, line, path, says) in cases {
            let p = one(old, new);
            assert!(
                p.iter()
                    .any(|(l, pa, m)| l == line && pa == path && m.contains(says)),
                "{new}: {p:?}"
            );
        }
        // `interface` on any other service is refused.
        let tcp = "services:\n  - { name: s, address: 127.0.0.1:81, protocol: tcp, interface: eth0 }\nvservers:\n  - { name: v, protocol: tcp, bind: 127.0.0.1:80, services: [s] }\n";
        let p = problems(tcp);
        assert_eq!((p[0].0, p[0].1.as_str()), (2, "services[0].interface"));
        assert!(p[0].2.contains("`protocol: ip` services only"), "{p:?}");
        // An IP without port stays refused elsewhere.
        let p = problems(&tcp.replace(
            "127.0.0.1:81, protocol: tcp, interface: eth0",
            "127.0.0.1, protocol: tcp",
        ));
        assert!(p[0].2.contains("has no port"), "{p:?}");
    }

    #[test]
    fn vserver_problems_name_the_field_and_why() {
        let cases: &[(&str, &str, u32, &str, &str)] = &[
            (
                "interface: [lbo-c], ",
                "",
                7,
                "vservers[0].interface",
                "missing required field `interface`",
            ),
            (
                "interface: [lbo-c]",
                "interface: []",
                7,
                "vservers[0].interface",
                "at least one",
            ),
            (
                "interface: [lbo-c]",
                "interface: [lbo-c, lbo-c]",
                7,
                "vservers[0].interface[1]",
                "listed twice",
            ),
            (
                "method: source_dest_ip_hash",
                "method: round_robin",
                7,
                "vservers[0].method",
                "cannot choose per packet",
            ),
            (
                "sticky: false",
                "sticky: false, bind: 10.0.0.1:80",
                8,
                "vservers[0].bind",
                "no listening socket",
            ),
            (
                "sticky: false",
                "sticky: false, idle_timeout: 5s",
                8,
                "vservers[0].idle_timeout",
                "keeps no sessions",
            ),
            (
                "sticky: false",
                "sticky: false, max_sessions: 5",
                8,
                "vservers[0].max_sessions",
                "keeps no sessions",
            ),
            (
                "sticky: false",
                "sticky: false, failover: off",
                8,
                "vservers[0].failover",
                "SIP field",
            ),
            (
                "sticky: false",
                "sticky: false, send_proxy: v2",
                8,
                "vservers[0].send_proxy",
                "in the kernel",
            ),
            (
                "sticky: false",
                "sticky: false, slow_start: { new_service_request_rate: 5 }",
                8,
                "vservers[0].slow_start",
                "new connections",
            ),
            (
                "sticky: false",
                "sticky: maybe",
                8,
                "vservers[0].sticky",
                "expected true or false",
            ),
        ];
        for (old, new, line, path, says) in cases {
            let p = one(old, new);
            assert!(
                p.iter()
                    .any(|(l, pa, m)| l == line && pa == path && m.contains(says)),
                "{new}: {p:?}"
            );
        }
        // Exact position of one golden problem.
        let e = from_str(
            "t",
            &SANDWICH.replace("sticky: false", "sticky: false, workers: 2"),
        )
        .expect_err("invalid");
        let p = &e.problems()[0];
        assert_eq!(
            (p.pos.line, p.pos.col, p.path.as_str()),
            (8, 82, "vservers[0].workers")
        );
    }

    /// A packet vserver takes `protocol: ip` services only, and no other vserver takes
    /// them; `interface` and `sticky` belong to packet vservers.
    #[test]
    fn members_and_fields_stay_on_their_side() {
        let mixed = SANDWICH.replace(
            "vservers:\n",
            "  - { name: web, protocol: tcp, address: 127.0.0.1:81 }\nvservers:\n",
        );
        let p =
            problems(&mixed.replace("services: [fw1-out, fw2-out]", "services: [fw1-out, web]"));
        assert!(
            p.iter()
                .any(|(_, pa, m)| pa == "vservers[0].services[1]" && m.contains("speaks tcp")),
            "{p:?}"
        );
        let tcp_vs = format!(
            "{mixed}  - {{ name: w, protocol: tcp, bind: 127.0.0.1:80, services: [web, fw1-out], sticky: true, interface: eth0 }}\n"
        );
        let p = problems(&tcp_vs);
        let paths: Vec<&str> = p.iter().map(|(_, pa, _)| pa.as_str()).collect();
        assert!(paths.contains(&"vservers[1].services[1]"), "{p:?}");
        assert!(paths.contains(&"vservers[1].sticky"), "{p:?}");
        assert!(paths.contains(&"vservers[1].interface"), "{p:?}");
    }
}
