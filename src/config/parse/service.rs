//! `services[]`: a backend's address, protocol, weight, monitor and `tls`. PURE.

use super::{Cx, Fields, did_you_mean, join, parse_socket_addr};
use crate::config::model::*;
use crate::config::yaml::{Node, Value};
use std::net::SocketAddr;

const SERVICE_FIELDS: &[&str] = &[
    "name",
    "address",
    "protocol",
    "weight",
    "monitor",
    "max_clients",
    "hash_id",
    "tls",
    "write_timeout",
    "backup",
    "dns",
    "port",
    "interface",
];

/// Fields of a service that a `protocol: ip` service cannot use, and why.
const NOT_FOR_IP: &[(&str, &str)] = &[
    (
        "max_clients",
        "the kernel forwards packets, not clients, and counts none",
    ),
    (
        "tls",
        "packets are forwarded as they are; no TLS is originated",
    ),
    (
        "dns",
        "a firewall leg is one address on one link; give `address`",
    ),
    ("port", "packets keep their own ports"),
];

impl Cx {
    pub(super) fn service(
        &mut self,
        node: &Node,
        path: &str,
        monitors: &[&Monitor],
        monitors_declared: &[String],
    ) -> Option<Service> {
        let f = self.fields(node, path, SERVICE_FIELDS)?;
        let name = self
            .required(&f, path, "name")
            .and_then(|n| self.string(n, &join(path, "name")));
        let protocol = self
            .required(&f, path, "protocol")
            .and_then(|n| self.choice(n, &join(path, "protocol"), &Protocol::ALL));
        let is_ip = protocol.is_some_and(Protocol::is_packet);
        let (address, dns) = if is_ip {
            self.ip_service_fields(&f, path)
        } else {
            self.service_address(&f, path)
        };
        let interface = self.service_interface(&f, path, protocol);
        let weight = self.int_field(&f, path, "weight", (1, 100), 1);
        let max_clients = self.int_field(&f, path, "max_clients", (0, u32::MAX as i128), 0);
        let monitor = match f.get("monitor") {
            None => Some(None),
            Some(Node {
                value: Value::Null, ..
            }) => Some(None),
            Some(n) => {
                let p = join(path, "monitor");
                self.string(n, &p).and_then(|m| {
                    match monitors.iter().position(|mon| mon.name == m) {
                        Some(i) if is_ip && monitors[i].kind != MonitorKind::Icmp => {
                            self.problem(
                                n.pos,
                                &p,
                                format!("monitor `{m}` is not of type icmp: a `protocol: ip` service is a router with no port to probe; ping it"),
                            );
                            None
                        }
                        Some(i) => Some(Some(i)),
                        // Declared but invalid: its own problem is already reported.
                        None if monitors_declared.contains(&m) => None,
                        None => {
                            let hint =
                                did_you_mean(&m, monitors_declared.iter().map(String::as_str));
                            self.problem(n.pos, &p, format!("unknown monitor `{m}`{hint}"));
                            None
                        }
                    }
                })
            }
        };
        if let (Some(p), Some(n)) = (protocol, f.get("protocol"))
            && p.is_websocket()
        {
            self.problem(
                n.pos,
                &join(path, "protocol"),
                format!(
                    "{} is a vserver protocol only (browsers connect to fulcrum over it); reach services over sip-udp, sip-tcp or sip-tls",
                    p.name()
                ),
            );
        }
        let hash_id = self.opt_string(&f, path, "hash_id");
        if let (Some(Some(_)), Some(n)) = (&dns, f.get("hash_id")) {
            self.problem(
                n.pos,
                &join(path, "hash_id"),
                "a service found in DNS hashes each member by its address and port, so that every instance seeing the same records chooses alike; `hash_id` is for services with an `address`",
            );
        }
        let backup = self.bool_field(&f, path, "backup", false);
        let write_timeout =
            self.duration_field(&f, path, "write_timeout", DEFAULT_WRITE_TIMEOUT, false);
        if let (Some(p), Some(n)) = (protocol, f.get("write_timeout"))
            && !p.is_sip_stream()
        {
            self.problem(
                n.pos,
                &join(path, "write_timeout"),
                format!(
                    "`write_timeout` applies to sip-tcp and sip-tls services only, not {}",
                    p.name()
                ),
            );
        }
        let tls = self.optional(&f, path, "tls", Cx::service_tls);
        if let (Some(p), Some(Some(_)), Some(n)) = (protocol, &tls, f.get("tls")) {
            self.tls_fits_protocol(n, &join(path, "tls"), p, "service");
        }
        if let (Some(p), Some(None)) = (protocol, &tls)
            && p.needs_tls()
        {
            self.problem(
                f.pos,
                &join(path, "tls"),
                format!(
                    "a {} service needs `tls: {{ ca: FILE }}` (the CA that signed its certificate)",
                    p.name()
                ),
            );
        }
        Some(Service {
            name: name?,
            address: address?,
            protocol: protocol?,
            weight: weight? as u32,
            monitor: monitor?,
            max_clients: max_clients? as u32,
            hash_id,
            tls: tls?,
            write_timeout: write_timeout?,
            backup: backup?,
            dns: dns?,
            priority: None,
            interface: interface?,
        })
    }

    /// The `address` of a `protocol: ip` service: an IP without port (the port 0 in the
    /// model), with the fields it cannot use reported.
    fn ip_service_fields(
        &mut self,
        f: &Fields,
        path: &str,
    ) -> (Option<SocketAddr>, Option<Option<DnsName>>) {
        for (field, why) in NOT_FOR_IP {
            if let Some(n) = f.get(field) {
                self.problem(
                    n.pos,
                    &join(path, field),
                    format!("`{field}` does not apply to a `protocol: ip` service: {why}"),
                );
            }
        }
        let Some(n) = self.required(f, path, "address") else {
            return (None, None);
        };
        let p = join(path, "address");
        let address = self.string(n, &p).and_then(|s| {
            match s.trim().parse::<std::net::IpAddr>() {
                Ok(ip) if ip.is_unspecified() || ip.is_multicast() => {
                    self.problem(n.pos, &p, format!("`{s}` is not the unicast address of a router"));
                    None
                }
                Ok(ip) => Some(SocketAddr::new(ip, 0)),
                Err(_) if parse_socket_addr(&s).is_ok() => {
                    self.problem(
                        n.pos,
                        &p,
                        format!("`{s}` has a port: a `protocol: ip` service is a router reached at its IP alone (packets keep their own ports)"),
                    );
                    None
                }
                Err(_) => {
                    self.problem(n.pos, &p, format!("`{s}` is not an IP address"));
                    None
                }
            }
        });
        (address, Some(None))
    }

    /// `interface`: required on a `protocol: ip` service (the link its leg is on), refused
    /// on every other. `Some(None)` when absent where it may be.
    fn service_interface(
        &mut self,
        f: &Fields,
        path: &str,
        protocol: Option<Protocol>,
    ) -> Option<Option<String>> {
        let p = join(path, "interface");
        match (protocol, f.get("interface")) {
            (Some(Protocol::Ip), Some(n)) => {
                let name = self.string(n, &p)?;
                match interface_name(&name) {
                    Ok(()) => Some(Some(name)),
                    Err(e) => {
                        self.problem(n.pos, &p, e);
                        None
                    }
                }
            }
            (Some(Protocol::Ip), None) => {
                self.problem(
                    f.pos,
                    &p,
                    "missing required field `interface`: the link on which a `protocol: ip` service's address is reached",
                );
                None
            }
            (Some(pr), Some(n)) => {
                self.problem(
                    n.pos,
                    &p,
                    format!(
                        "`interface` applies to `protocol: ip` services only, not {}",
                        pr.name()
                    ),
                );
                None
            }
            (None, Some(_)) => None,
            (_, None) => Some(None),
        }
    }

    /// `address: IP:PORT`, or `dns: NAME` (with `port` for an A/AAAA name; an SRV name,
    /// whose first label starts with `_`, gives its own ports). The address of a `dns`
    /// service is the unspecified address: its members have the real ones.
    fn service_address(
        &mut self,
        f: &Fields,
        path: &str,
    ) -> (Option<SocketAddr>, Option<Option<DnsName>>) {
        let port = f.get("port").and_then(|n| {
            self.int_in(n, &join(path, "port"), 1, 65535)
                .and_then(|p| u16::try_from(p).ok())
        });
        match (f.get("address"), f.get("dns")) {
            (Some(_), Some(d)) => {
                self.problem(
                    d.pos,
                    &join(path, "dns"),
                    "give either `address` (one service) or `dns` (a pool published in DNS), not both",
                );
                (None, None)
            }
            (None, None) => {
                self.problem(
                    f.pos,
                    &join(path, "address"),
                    "missing required field `address` (or `dns` for a pool published in DNS)",
                );
                (None, None)
            }
            (Some(n), None) => {
                if let Some(p) = f.get("port") {
                    self.problem(
                        p.pos,
                        &join(path, "port"),
                        "`port` goes with `dns`; an `address` carries its own port",
                    );
                }
                let p = join(path, "address");
                let address = self
                    .string(n, &p)
                    .and_then(|s| match parse_socket_addr(&s) {
                        Ok(a) if a.port() == 0 => {
                            self.problem(n.pos, &p, "a service port must not be 0");
                            None
                        }
                        Ok(a) if a.ip().is_unspecified() => {
                            self.problem(n.pos, &p, "a service address must not be a wildcard");
                            None
                        }
                        Ok(a) => Some(a),
                        Err(e) => {
                            self.problem(n.pos, &p, e);
                            None
                        }
                    });
                (address, Some(None))
            }
            (None, Some(n)) => {
                let p = join(path, "dns");
                let Some(raw) = self.string(n, &p) else {
                    return (None, None);
                };
                let name = match dns_name(&raw) {
                    Ok(name) => name,
                    Err(e) => {
                        self.problem(n.pos, &p, e);
                        return (None, None);
                    }
                };
                let srv = name.starts_with('_');
                let kind = match (srv, f.get("port"), port) {
                    (true, Some(pn), _) => {
                        self.problem(
                            pn.pos,
                            &join(path, "port"),
                            format!("`{raw}` is an SRV name: its records give each target's port; leave `port` out"),
                        );
                        return (None, None);
                    }
                    (true, None, _) => DnsKind::Srv,
                    (false, None, _) => {
                        self.problem(
                            f.pos,
                            &join(path, "port"),
                            format!("`{raw}` is looked up for A and AAAA records, which carry no port: give `port` (or use an SRV name such as `_sip._udp.{raw}`)"),
                        );
                        return (None, None);
                    }
                    (false, Some(_), Some(port)) => DnsKind::Host { port },
                    // Out of range: reported.
                    (false, Some(_), None) => return (None, None),
                };
                let placeholder = SocketAddr::from(([0, 0, 0, 0], 0));
                (Some(placeholder), Some(Some(DnsName { name, kind })))
            }
        }
    }
}

/// A Linux network interface name: 1 to 15 bytes (IFNAMSIZ less the final NUL), no `/`,
/// `:` or white space, not `.` or `..` (the kernel's `dev_valid_name`). Whether it exists
/// is not checked: `fulcrum check` reads the file only.
pub(super) fn interface_name(s: &str) -> Result<(), String> {
    let ok = (1..=15).contains(&s.len())
        && s != "."
        && s != ".."
        && !s
            .bytes()
            .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{s}` is not a network interface name (1 to 15 bytes, no `/`, `:` or spaces)"
        ))
    }
}

/// A DNS name as a service's `dns` gives it: letters, digits, `-` and `_`, labels of 1..=63
/// characters, at most 253 in all; made lowercase and fully qualified (a final dot, so no
/// search domain is tried).
fn dns_name(s: &str) -> Result<String, String> {
    let t = s.trim().trim_end_matches('.').to_ascii_lowercase();
    if t.parse::<std::net::IpAddr>().is_ok() {
        return Err(format!(
            "`{s}` is an IP address; write `address: IP:PORT` for a fixed service"
        ));
    }
    let ok_label = |l: &str| {
        (1..=63).contains(&l.len())
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if t.is_empty() || t.len() > 253 || !t.split('.').all(ok_label) {
        return Err(format!(
            "`{s}` is not a DNS name (labels of letters, digits, `-` and `_`, separated by dots)"
        ));
    }
    Ok(format!("{t}."))
}

const DNS_FIELDS: &[&str] = &["servers", "min_refresh", "max_refresh", "resolv_conf"];

impl Cx {
    /// The global `dns` block.
    pub(super) fn dns_settings(&mut self, node: &Node) -> Option<DnsSettings> {
        let path = "dns";
        let f = self.fields(node, path, DNS_FIELDS)?;
        let d = DnsSettings::default();
        let servers = match f.get("servers") {
            None => Some(Vec::new()),
            Some(n) => {
                let sp = join(path, "servers");
                let mut ok = true;
                let mut out = Vec::new();
                for (i, item) in self.seq(n, &sp).iter().enumerate() {
                    let ip = format!("{sp}[{i}]");
                    let Some(text) = self.string(item, &ip) else {
                        ok = false;
                        continue;
                    };
                    // A bare IP means port 53.
                    let parsed = text
                        .trim()
                        .parse::<std::net::IpAddr>()
                        .map(|a| SocketAddr::new(a, 53))
                        .or_else(|_| parse_socket_addr(&text));
                    match parsed {
                        Ok(a) if a.port() != 0 && !a.ip().is_unspecified() => out.push(a),
                        Ok(_) => {
                            self.problem(
                                item.pos,
                                &ip,
                                "a DNS server needs a real address and a port other than 0",
                            );
                            ok = false;
                        }
                        Err(e) => {
                            self.problem(item.pos, &ip, e);
                            ok = false;
                        }
                    }
                }
                ok.then_some(out)
            }
        };
        let min_refresh = self.duration_field(&f, path, "min_refresh", d.min_refresh, false);
        let max_refresh = self.duration_field(&f, path, "max_refresh", d.max_refresh, false);
        if let (Some(lo), Some(hi)) = (min_refresh, max_refresh)
            && lo > hi
        {
            let pos = f.get("min_refresh").map_or(f.pos, |n| n.pos);
            self.problem(
                pos,
                &join(path, "min_refresh"),
                format!("min_refresh ({lo:?}) is above max_refresh ({hi:?})"),
            );
            return None;
        }
        let resolv_conf = match f.get("resolv_conf") {
            None => Some(d.resolv_conf),
            Some(n) => {
                let p = join(path, "resolv_conf");
                match self.string(n, &p) {
                    Some(text) if text.starts_with('/') => Some(std::path::PathBuf::from(text)),
                    Some(_) => {
                        self.problem(n.pos, &p, "an absolute path (such as /etc/resolv.conf)");
                        None
                    }
                    None => None,
                }
            }
        };
        Some(DnsSettings {
            servers: servers?,
            min_refresh: min_refresh?,
            max_refresh: max_refresh?,
            resolv_conf: resolv_conf?,
        })
    }
}
