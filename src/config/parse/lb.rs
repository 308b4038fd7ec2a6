//! The global sections: `lb`, `admin` and `logging`. PURE.

use super::{Cx, parse_socket_addr};
use crate::config::model::*;
use crate::config::yaml::{Node, Value};

const LB_FIELDS: &[&str] = &["hash_algorithm", "hash_fingers", "prac_max_share"];

const ADMIN_FIELDS: &[&str] = &["listen", "token"];

const LOGGING_FIELDS: &[&str] = &["format", "level"];

impl Cx {
    pub(super) fn lb(&mut self, node: &Node) -> Option<LbParams> {
        let f = self.fields(node, "lb", LB_FIELDS)?;
        let hash_algorithm = match f.get("hash_algorithm") {
            None => Some(HashAlgorithm::Carp),
            Some(n) => self.choice(n, "lb.hash_algorithm", &HashAlgorithm::ALL),
        };
        let hash_fingers = self.int_field(&f, "lb", "hash_fingers", (1, 1024), 256);
        let prac_max_share = match f.get("prac_max_share") {
            None => Some(PracMaxShare::DEFAULT),
            Some(n) => {
                let ratio = match n.value {
                    Value::Float(x) => Some(x),
                    Value::Int(i) => Some(i as f64),
                    _ => None,
                };
                let bound = ratio.and_then(PracMaxShare::from_ratio);
                if bound.is_none() {
                    self.problem(
                        n.pos,
                        "lb.prac_max_share",
                        format!(
                            "expected a number in {}..={} (the largest share of a service over its fair share)",
                            PracMaxShare::DEFAULT.ratio(),
                            PracMaxShare::MAX.ratio()
                        ),
                    );
                }
                bound
            }
        };
        Some(LbParams {
            hash_algorithm: hash_algorithm?,
            hash_fingers: u32::try_from(hash_fingers?).ok()?,
            prac_max_share: prac_max_share?,
        })
    }

    pub(super) fn admin(&mut self, node: &Node) -> Option<Admin> {
        let f = self.fields(node, "admin", ADMIN_FIELDS)?;
        let listen = match f.get("listen") {
            None => Some(Admin::default().listen),
            Some(Node {
                value: Value::Null, ..
            }) => Some(None),
            Some(n) => {
                let s = self.string(n, "admin.listen");
                s.and_then(|s| match parse_socket_addr(&s) {
                    Ok(a) => Some(Some(a)),
                    Err(e) => {
                        self.problem(n.pos, "admin.listen", e);
                        None
                    }
                })
            }
        };
        let token = self.opt_string(&f, "admin", "token");
        Some(Admin {
            listen: listen?,
            token,
        })
    }

    pub(super) fn logging(&mut self, node: &Node) -> Option<Logging> {
        let f = self.fields(node, "logging", LOGGING_FIELDS)?;
        let format = match f.get("format") {
            None => Some(LogFormat::Text),
            Some(n) => self.choice(
                n,
                "logging.format",
                &[("text", LogFormat::Text), ("json", LogFormat::Json)],
            ),
        };
        let level = self.opt_string(&f, "logging", "level");
        if let (Some(l), Some(n)) = (&level, f.get("level"))
            && tracing_subscriber::EnvFilter::try_new(l).is_err()
        {
            self.problem(
                n.pos,
                "logging.level",
                format!("`{l}` is not a log filter such as `info` or `fulcrum=debug`"),
            );
        }
        Some(Logging {
            format: format?,
            level,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::suggest;
    use super::super::tests::{MINIMAL, problems};
    use super::*;
    use crate::config::from_str;

    #[test]
    fn prac_max_share_is_a_bounded_ratio() {
        let with =
            |v: &str| format!("lb: {{ hash_algorithm: prac, prac_max_share: {v} }}\n{MINIMAL}");
        let c = from_str("t", &with("1.05")).expect("valid");
        assert_eq!(c.lb.prac_max_share.ratio(), 1.05);
        assert_eq!(c.lb.prac_max_share.slack(), 0.045);
        assert_eq!(
            from_str("t", MINIMAL).expect("valid").lb.prac_max_share,
            PracMaxShare::DEFAULT
        );
        for bad in ["1.0", "1", "1.6", "-1.05", "fast", "null"] {
            let p = problems(&with(bad));
            assert_eq!(p.len(), 1, "{bad}: {p:?}");
            assert_eq!((p[0].0, p[0].1.as_str()), (1, "lb.prac_max_share"), "{bad}");
        }
    }

    #[test]
    fn suggestions() {
        assert_eq!(
            suggest("hash_fingrs", LB_FIELDS.iter().copied()),
            Some("hash_fingers")
        );
        assert_eq!(suggest("zzzzzz", LB_FIELDS.iter().copied()), None);
    }
}
