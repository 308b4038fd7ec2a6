//! `fulcrum simulate flow`: which firewall a packet vserver sends a flow to, by the Rust twin
//! of its program (the same key, hash, bucket and table). PURE.
//!
//! The table is built as the running vserver builds it: the firewalls of the config ranked
//! by `lb`, each UP unless named in `down`. Both directions are answered, so that an
//! operator sees whether a method keeps a flow's two directions on one firewall.

use crate::config::{Config, Vserver};
use crate::packet::{Flow, PathConfig, bucket_of, build_table, flow_hash, key_words};
use crate::select::{HashSelector, Member};
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

/// One direction's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Choice {
    pub hash: u32,
    pub bucket: u32,
    /// The firewall leg (its service names joined by `+`), `None` when every firewall is
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
    if q.src.is_ipv4() != q.dst.is_ipv4() {
        return Err("source and destination must be of one family".into());
    }
    let path = PathConfig::of(v)
        .ok_or_else(|| format!("method {} cannot hash packets", v.method.name()))?;
    let legs = crate::proxy::packet::legs(config, v)?;
    let name_of = |i: &usize| config.services.get(*i).map(|s| s.name.clone());
    let names: Vec<String> = legs
        .iter()
        .map(|(_, ms)| ms.iter().filter_map(name_of).collect::<Vec<_>>().join("+"))
        .collect();
    let up: Vec<bool> = legs
        .iter()
        .map(|(_, ms)| !ms.iter().filter_map(name_of).any(|n| down.contains(&n)))
        .collect();
    let members: Vec<Member> = legs.iter().map(|(f, _)| f.member).collect();
    let selector = HashSelector::build_bounded(
        config.lb.hash_algorithm,
        config.lb.hash_fingers,
        config.lb.prac_max_share,
        &members,
        &up,
    );
    let table = build_table(&selector, |_| true);
    let reply = FlowQuery {
        src: q.dst,
        dst: q.src,
        ports: q.ports.map(|(a, b)| (b, a)),
        ..*q
    };
    Ok(FlowReport {
        vserver: v.name.clone(),
        method: v.method.name(),
        forward: choice(&path, &table, &names, q),
        reply: choice(&path, &table, &names, &reply),
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
}
