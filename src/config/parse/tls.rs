//! The `tls` blocks of vservers and services: the files they name, kept with where they
//! are named (the files themselves are read by [`crate::config::load`]). PURE.

use super::{Cx, Fields, join};
use crate::config::model::*;
use crate::config::yaml::Node;
use std::net::Ipv4Addr;

const VSERVER_TLS_FIELDS: &[&str] = &["cert", "key", "client_ca"];

const SERVICE_TLS_FIELDS: &[&str] = &["ca", "server_name", "cert", "key"];

impl Cx {
    /// A file name (`cert`, `key`, `ca`...), kept with where it is written: the file is read
    /// by [`crate::config::load`], which reports its problems there.
    pub(super) fn file(&mut self, node: &Node, path: &str) -> Option<ConfigFile> {
        self.string(node, path).map(|s| ConfigFile {
            path: s.into(),
            pos: node.pos,
            field: path.to_owned(),
        })
    }

    /// An optional file field.
    fn opt_file(&mut self, f: &Fields, path: &str, name: &str) -> Option<Option<ConfigFile>> {
        self.optional(f, path, name, Cx::file)
    }

    /// `tls: { cert, key, client_ca }` of a vserver and its `tls_handshake_timeout`.
    pub(super) fn vserver_tls_fields(
        &mut self,
        f: &Fields,
        path: &str,
        protocol: Option<Protocol>,
    ) -> Option<Option<VserverTls>> {
        let timeout = self.duration_field(
            f,
            path,
            "tls_handshake_timeout",
            crate::tls::DEFAULT_HANDSHAKE_TIMEOUT,
            false,
        );
        let tls = match f.get("tls") {
            None => {
                if let Some(p) = protocol.filter(|p| p.needs_tls()) {
                    self.problem(
                        f.pos,
                        &join(path, "tls"),
                        format!(
                            "a {} vserver needs `tls: {{ cert: FILE, key: FILE }}`",
                            p.name()
                        ),
                    );
                    return None;
                }
                if let Some(n) = f.get("tls_handshake_timeout") {
                    self.problem(
                        n.pos,
                        &join(path, "tls_handshake_timeout"),
                        "`tls_handshake_timeout` applies to a vserver with `tls` only",
                    );
                }
                return Some(None);
            }
            Some(n) => n,
        };
        let tp = join(path, "tls");
        if let Some(p) = protocol {
            self.tls_fits_protocol(tls, &tp, p, "vserver");
        }
        let f = self.fields(tls, &tp, VSERVER_TLS_FIELDS)?;
        let cert = self
            .required(&f, &tp, "cert")
            .and_then(|n| self.file(n, &join(&tp, "cert")));
        let key = self
            .required(&f, &tp, "key")
            .and_then(|n| self.file(n, &join(&tp, "key")));
        let client_ca = self.opt_file(&f, &tp, "client_ca");
        Some(Some(VserverTls {
            cert: cert?,
            key: key?,
            client_ca: client_ca?,
            handshake_timeout: timeout?,
            loaded: crate::tls::Loaded::default(),
        }))
    }

    /// `tls: { ca, server_name, cert, key }` of a service.
    pub(super) fn service_tls(&mut self, node: &Node, path: &str) -> Option<ServiceTls> {
        let f = self.fields(node, path, SERVICE_TLS_FIELDS)?;
        let ca = self
            .required(&f, path, "ca")
            .and_then(|n| self.file(n, &join(path, "ca")));
        let server_name = self.opt_string(&f, path, "server_name");
        if let (Some(name), Some(n)) = (&server_name, f.get("server_name"))
            && crate::tls::server_name(Some(name), Ipv4Addr::LOCALHOST.into()).is_none()
        {
            self.problem(
                n.pos,
                &join(path, "server_name"),
                format!("`{name}` is not a DNS name or an IP address"),
            );
        }
        let cert = self.opt_file(&f, path, "cert");
        let key = self.opt_file(&f, path, "key");
        match (f.get("cert"), f.get("key")) {
            (Some(n), None) => {
                self.problem(n.pos, &join(path, "key"), "`cert` needs its `key`");
            }
            (None, Some(n)) => {
                self.problem(n.pos, &join(path, "cert"), "`key` needs its `cert`");
            }
            _ => {}
        }
        Some(ServiceTls {
            ca: ca?,
            server_name,
            cert: cert?,
            key: key?,
            loaded: crate::tls::Loaded::default(),
        })
    }

    /// `tls` only where the protocol's data path carries TLS ([`Protocol::takes_tls`]).
    pub(super) fn tls_fits_protocol(&mut self, n: &Node, tp: &str, p: Protocol, what: &str) {
        if !p.takes_tls() {
            let takes: Vec<&str> = Protocol::ALL
                .iter()
                .filter(|(_, q)| q.takes_tls() && (what == "vserver" || !q.is_websocket()))
                .map(|(name, _)| *name)
                .collect();
            self.problem(
                n.pos,
                tp,
                format!(
                    "`tls` applies to a {what} of protocol {}, not {}",
                    takes.join(" or "),
                    p.name()
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::MINIMAL;
    use crate::config::from_str;
    use std::time::Duration;

    /// `tls` is read as file names with their locations (the files are read by `load`), with
    /// the handshake timeout's default; a config from text alone holds no loaded material.
    #[test]
    fn tls_fields_are_read_with_their_locations() {
        let text = "services:\n  - { name: s1, address: 127.0.0.1:7001, protocol: tcp, tls: { ca: ca.pem, server_name: svc.test } }\nvservers:\n  - name: v\n    protocol: http\n    bind: 127.0.0.1:8443\n    tls: { cert: a.crt, key: a.key }\n    services: [s1]\n";
        let c = from_str("t", text).expect("valid");
        let t = c.vservers[0].tls.as_ref().expect("tls");
        assert_eq!(t.cert.path, std::path::PathBuf::from("a.crt"));
        assert_eq!(
            (t.key.pos.line, t.key.field.as_str()),
            (7, "vservers[0].tls.key")
        );
        assert_eq!(t.handshake_timeout, crate::tls::DEFAULT_HANDSHAKE_TIMEOUT);
        assert!(t.client_ca.is_none() && t.loaded.get().is_none());
        let s = c.services[0].tls.as_ref().expect("service tls");
        assert_eq!(s.server_name.as_deref(), Some("svc.test"));
        assert_eq!(s.ca.field, "services[0].tls.ca");
        let timed = text.replace(
            "    services: [s1]\n",
            "    tls_handshake_timeout: 2s\n    services: [s1]\n",
        );
        let c = from_str("t", &timed).expect("valid");
        let t = c.vservers[0].tls.as_ref().expect("tls");
        assert_eq!(t.handshake_timeout, Duration::from_secs(2));
        assert!(
            from_str("t", MINIMAL).expect("valid").vservers[0]
                .tls
                .is_none()
        );
    }
}
