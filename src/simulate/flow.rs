//! `fulcrum simulate flow`: which firewall a packet vserver sends a flow to, by the Rust twin
//! of its program (the same key, hash, bucket and table). PURE.
//!
//! The table is built as the running vserver builds it: the firewalls of the config ranked
//! by `lb`, each UP unless named in `down`. Both directions are answered, so that an
//! operator sees whether a method keeps a flow's two directions on one firewall.

use crate::config::{Config, Vserver};
use crate::packet::{Flow, PathConfig, bucket_of, build_table, flow_hash, key_words};
use crate::select::Member;
use serde::Serialize;
use std::net::IpAddr;

/// A flow as the operator gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowQuery {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// IP protocol number (6 TCP, 17 UDP, 1 ICMP, ...).
    pub proto: u8,
    /// (source port, destination port) for TCP, UDP and SCTP.
    pub ports: Option<(u16, u16)>,
}

impl FlowQuery {
    /// A flow from what an operator types: a protocol name (`tcp`, `udp`, `sctp`, `icmp`,
    /// `icmpv6`) or number, two addresses of one family, and ports exactly for TCP, UDP and
    /// SCTP. The error says which part is wrong.
    pub fn parse(
        proto: &str,
        src: IpAddr,
        dst: IpAddr,
        ports: Option<(u16, u16)>,
    ) -> Result<FlowQuery, String> {
        let proto: u8 = match proto.to_ascii_lowercase().as_str() {
            "tcp" => 6,
            "udp" => 17,
            "sctp" => 132,
            "icmp" => 1,
            "icmpv6" => 58,
            n => n
                .parse()
                .map_err(|_| format!("protocol {n:?}: tcp, udp, sctp, icmp, icmpv6 or a number"))?,
        };
        if src.is_ipv4() != dst.is_ipv4() {
            return Err("source and destination must be of one family".into());
        }
        match (proto, ports) {
            (6 | 17 | 132, None) => {
                Err("tcp, udp and sctp need a source and a destination port".into())
            }
            (6 | 17 | 132, _) | (_, None) => Ok(FlowQuery {
                src,
                dst,
                proto,
                ports,
            }),
            _ => Err("only tcp, udp and sctp take ports".into()),
        }
    }

    /// The reply: addresses and ports swapped.
    pub fn reply(&self) -> FlowQuery {
        FlowQuery {
            src: self.dst,
            dst: self.src,
            ports: self.ports.map(|(a, b)| (b, a)),
            proto: self.proto,
        }
    }
}

/// One direction's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Choice {
    pub hash: u32,
    pub bucket: u32,
    /// The firewall leg (its service's name), `None` when every firewall is
    /// DOWN (the packet is dropped).
    pub firewall: Option<String>,
}

/// Both directions on vserver `vserver`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FlowReport {
    pub vserver: String,
    pub method: &'static str,
    pub forward: Choice,
    /// The reply (source and destination swapped) on the same vserver.
    pub reply: Choice,
}

fn bytes(ip: IpAddr) -> [u8; 16] {
    let mut b = [0u8; 16];
    match ip {
        IpAddr::V4(a) => b[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => b = a.octets(),
    }
    b
}

/// Where `q` goes by bucket table `table` (slot `i + 1` is leg `names[i]`) under `path`: the
/// program's twin.
pub fn choice(path: &PathConfig, table: &[u32], names: &[String], q: &FlowQuery) -> Choice {
    let flow = Flow {
        is_v6: q.src.is_ipv6(),
        src: bytes(q.src),
        dst: bytes(q.dst),
        proto: q.proto,
        ports: q.ports,
    };
    let hash = flow_hash(&key_words(path.method, &path.masks, &flow));
    let bucket = bucket_of(hash);
    let slot = table.get(bucket as usize).copied().unwrap_or(0);
    Choice {
        hash,
        bucket,
        firewall: slot
            .checked_sub(1)
            .and_then(|i| names.get(i as usize).cloned()),
    }
}

/// Which firewall `q` takes on packet vserver `v` of `config`, the services in `down`
/// taken DOWN.
pub fn which_firewall(
    config: &Config,
    v: &Vserver,
    q: &FlowQuery,
    down: &[String],
) -> Result<FlowReport, String> {
    if !v.protocol.is_packet() {
        return Err(format!(
            "vserver {:?} is {}, not a `protocol: ip` vserver",
            v.name,
            v.protocol.name()
        ));
    }
    let path = crate::proxy::packet::path_of(v)?;
    let legs = crate::proxy::packet::legs(config, v)?;
    let names: Vec<String> = legs
        .iter()
        .map(|&(_, i)| {
            config
                .services
                .get(i)
                .map_or_else(String::new, |s| s.name.clone())
        })
        .collect();
    let up: Vec<bool> = names.iter().map(|n| !down.contains(n)).collect();
    let members: Vec<Member> = legs.iter().map(|(f, _)| f.member).collect();
    let table = build_table(&crate::packet::selector(&config.lb, &members, &up), |_| {
        true
    });
    Ok(FlowReport {
        vserver: v.name.clone(),
        method: v.method.name(),
        forward: choice(&path, &table, &names, q),
        reply: choice(&path, &table, &names, &q.reply()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = "services:\n  - { name: fw1, protocol: ip, address: 10.2.1.2, interface: f1, hash_id: fw1 }\n  - { name: fw2, protocol: ip, address: 10.2.2.2, interface: f2, hash_id: fw2 }\n  - { name: fw3, protocol: ip, address: 10.2.3.2, interface: f3, hash_id: fw3 }\nvservers:\n  - { name: outside, protocol: ip, interface: [c], method: source_dest_ip_hash, services: [fw1, fw2, fw3] }\n";

    fn q(src: &str, dst: &str) -> FlowQuery {
        FlowQuery {
            src: src.parse().expect("ip"),
            dst: dst.parse().expect("ip"),
            proto: 6,
            ports: Some((40000, 443)),
        }
    }

    /// The symmetric method sends both directions to one firewall; a DOWN firewall is never
    /// named and only its flows move; with every firewall DOWN, none is.
    #[test]
    fn both_directions_meet_and_only_a_down_firewalls_flows_move() {
        let config = crate::config::from_str("t.yaml", YAML).expect("valid");
        let v = &config.vservers[0];
        let mut moved = 0;
        let mut seen = std::collections::HashSet::new();
        for i in 0..200u32 {
            let src = format!("10.1.{}.{}", i / 250, i % 250 + 1);
            let r = which_firewall(&config, v, &q(&src, "10.4.0.2"), &[]).expect("report");
            assert_eq!(r.forward.firewall, r.reply.firewall, "{r:?}");
            let fw = r.forward.firewall.clone().expect("a firewall");
            seen.insert(fw.clone());
            let d =
                which_firewall(&config, v, &q(&src, "10.4.0.2"), &["fw2".into()]).expect("report");
            let now = d.forward.firewall.expect("a firewall");
            assert_ne!(now, "fw2");
            if now != fw {
                assert_eq!(fw, "fw2", "a flow moved off an UP firewall");
                moved += 1;
            }
        }
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert!(moved > 0);
        let all_down: Vec<String> = ["fw1", "fw2", "fw3"].map(String::from).to_vec();
        let none =
            which_firewall(&config, v, &q("10.1.0.1", "10.4.0.2"), &all_down).expect("report");
        assert_eq!(none.forward.firewall, None);
    }

    /// What an operator types is checked: protocol, family, ports for the port protocols
    /// only; the reply swaps addresses and ports.
    #[test]
    fn a_query_is_checked_and_its_reply_swaps_both_ends() {
        let (a, b) = (
            "10.0.0.1".parse().expect("ip"),
            "10.0.0.2".parse().expect("ip"),
        );
        let v6: IpAddr = "fd00::1".parse().expect("ip");
        let t = FlowQuery::parse("TCP", a, b, Some((1, 2))).expect("tcp");
        assert_eq!(
            (t.proto, t.reply().src, t.reply().ports),
            (6, b, Some((2, 1)))
        );
        assert_eq!(FlowQuery::parse("47", a, b, None).expect("gre").proto, 47);
        assert!(FlowQuery::parse("tcp", a, b, None).is_err());
        assert!(FlowQuery::parse("icmp", a, b, Some((1, 2))).is_err());
        assert!(FlowQuery::parse("udp", a, v6, Some((1, 2))).is_err());
        assert!(FlowQuery::parse("bogus", a, b, None).is_err());
    }
}
