//! `services[]`: a backend's address, protocol, weight, monitor and `tls`. PURE.

use super::{Cx, did_you_mean, join, parse_socket_addr};
use crate::config::model::*;
use crate::config::yaml::{Node, Value};

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
];

impl Cx {
    pub(super) fn service(
        &mut self,
        node: &Node,
        path: &str,
        monitors: &[&str],
        monitors_declared: &[String],
    ) -> Option<Service> {
        let f = self.fields(node, path, SERVICE_FIELDS)?;
        let name = self
            .required(&f, path, "name")
            .and_then(|n| self.string(n, &join(path, "name")));
        let address = self.required(&f, path, "address").and_then(|n| {
            let p = join(path, "address");
            let s = self.string(n, &p)?;
            match parse_socket_addr(&s) {
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
            }
        });
        let protocol = self
            .required(&f, path, "protocol")
            .and_then(|n| self.choice(n, &join(path, "protocol"), &Protocol::ALL));
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
                    match monitors.iter().position(|name| *name == m) {
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
        })
    }
}
