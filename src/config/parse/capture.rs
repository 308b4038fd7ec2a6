//! The global `capture` section: SIP messages to a HEP collector (docs/capture.md). PURE.

use super::{Cx, did_you_mean, join, parse_socket_addr};
use crate::config::model::*;
use crate::config::yaml::{Node, Value};

const CAPTURE_FIELDS: &[&str] = &["hep"];

const HEP_FIELDS: &[&str] = &[
    "address",
    "transport",
    "id",
    "password",
    "vservers",
    "probes",
    "udp_gso",
];

impl Cx {
    /// `capture: { hep: {..} }`; `Some(None)` when `hep` is absent or null (capture off).
    pub(super) fn capture(
        &mut self,
        node: &Node,
        vservers: &[&str],
        vservers_declared: &[String],
    ) -> Option<Option<HepCapture>> {
        let f = self.fields(node, "capture", CAPTURE_FIELDS)?;
        let Some(n) = f.get("hep").filter(|n| n.value != Value::Null) else {
            return Some(None);
        };
        let path = "capture.hep";
        let f = self.fields(n, path, HEP_FIELDS)?;
        let address = self.required(&f, path, "address").and_then(|n| {
            let p = join(path, "address");
            let text = self.string(n, &p)?;
            match parse_socket_addr(&text) {
                Ok(a) if a.port() != 0 && !a.ip().is_unspecified() => Some(a),
                Ok(_) => {
                    self.problem(
                        n.pos,
                        &p,
                        "a collector needs a real address and a port other than 0",
                    );
                    None
                }
                Err(e) => {
                    self.problem(n.pos, &p, e);
                    None
                }
            }
        });
        let transport = match f.get("transport") {
            None => Some(CaptureTransport::Udp),
            Some(n) => self.choice(n, &join(path, "transport"), &CaptureTransport::ALL),
        };
        let id = self.int_field(&f, path, "id", (0, u32::MAX as i128), 0);
        let password = self.opt_string(&f, path, "password");
        let probes = self.bool_field(&f, path, "probes", false);
        let udp_gso = self.bool_field(&f, path, "udp_gso", false);
        let vs = match f.get("vservers") {
            None => Some(None),
            Some(n) if n.value == Value::Null => Some(None),
            Some(n) => {
                let vp = join(path, "vservers");
                let mut ok = true;
                let mut names = Vec::new();
                for (i, item) in self.seq(n, &vp).iter().enumerate() {
                    let ip = format!("{vp}[{i}]");
                    let Some(name) = self.string(item, &ip) else {
                        ok = false;
                        continue;
                    };
                    if !vservers.contains(&name.as_str()) && !vservers_declared.contains(&name) {
                        let hint =
                            did_you_mean(&name, vservers_declared.iter().map(String::as_str));
                        self.problem(item.pos, &ip, format!("unknown vserver `{name}`{hint}"));
                        ok = false;
                        continue;
                    }
                    names.push(name);
                }
                ok.then_some(Some(names))
            }
        };
        Some(Some(HepCapture {
            address: address?,
            transport: transport?,
            id: u32::try_from(id?).ok()?,
            password,
            vservers: vs?,
            probes: probes?,
            udp_gso: udp_gso?,
        }))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::model::*;
    use crate::config::parse::tests::problems;

    const BASE: &str = "services: [{ name: a, address: 127.0.0.1:5070, protocol: sip-udp }]\n\
        vservers: [{ name: edge, bind: 127.0.0.1:5060, protocol: sip-udp, services: [a] }]\n";

    fn parse(capture: &str) -> Result<crate::config::Config, Vec<(u32, String, String)>> {
        let text = format!("{BASE}{capture}");
        crate::config::from_str("t", &text).map_err(|_| problems(&text))
    }

    #[test]
    fn a_full_block_is_read() {
        let c = parse(
            "capture:\n  hep: { address: 127.0.0.1:9060, transport: tcp, id: 2001, password: s3, vservers: [edge], probes: true, udp_gso: true }\n",
        )
        .expect("valid");
        assert_eq!(
            c.capture,
            Some(HepCapture {
                address: "127.0.0.1:9060".parse().expect("addr"),
                transport: CaptureTransport::Tcp,
                id: 2001,
                password: Some("s3".into()),
                vservers: Some(vec!["edge".into()]),
                probes: true,
                udp_gso: true,
            })
        );
    }

    #[test]
    fn defaults_and_absence() {
        let c = parse("capture: { hep: { address: '[::1]:9060' } }\n").expect("valid");
        let h = c.capture.expect("on");
        assert_eq!(
            (h.transport, h.id, h.password, h.vservers, h.probes),
            (CaptureTransport::Udp, 0, None, None, false)
        );
        assert_eq!(parse("").expect("valid").capture, None);
        assert_eq!(
            parse("capture: { hep: null }\n").expect("valid").capture,
            None
        );
    }

    #[test]
    fn bad_fields_are_named_with_their_line() {
        let p = parse(
            "capture:\n  hep:\n    address: 127.0.0.1\n    transport: sctp\n    id: -1\n    vservers: [egde]\n    prob: true\n",
        )
        .expect_err("invalid");
        let paths: Vec<(u32, &str)> = p.iter().map(|(l, path, _)| (*l, path.as_str())).collect();
        assert_eq!(
            paths,
            [
                (5, "capture.hep.address"),
                (6, "capture.hep.transport"),
                (7, "capture.hep.id"),
                (8, "capture.hep.vservers[0]"),
                (9, "capture.hep.prob"),
            ],
            "{p:?}"
        );
        assert!(p[3].2.contains("did you mean `edge`"), "{p:?}");
    }
}
