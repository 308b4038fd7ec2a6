//! A vserver's edge protection: the `allow` and `deny` access lists and `flood`. PURE.

use super::{Cx, Fields, join};
use crate::acl::Cidr;
use crate::config::yaml::{Node, Value};
use crate::flood::FloodParams;
use std::time::Duration;

const FLOOD_FIELDS: &[&str] = &["limit", "window", "ban", "ipv6_prefix"];

impl Cx {
    /// A CIDR list (`allow`, `deny`): a list of `ADDRESS/PREFIX` or addresses, or one.
    /// `allow` may not be empty (nobody could use the vserver).
    fn cidr_list(&mut self, node: &Node, path: &str, allow: bool) -> Option<Vec<Cidr>> {
        let items: Vec<&Node> = match &node.value {
            Value::Seq(items) => items.iter().collect(),
            _ => vec![node],
        };
        if allow && items.is_empty() {
            self.problem(
                node.pos,
                path,
                "an empty allow list lets nobody in; leave `allow` out to let everyone in",
            );
            return None;
        }
        let mut out = Vec::new();
        let mut ok = true;
        for (i, n) in items.iter().enumerate() {
            let p = if matches!(node.value, Value::Seq(_)) {
                format!("{path}[{i}]")
            } else {
                path.to_owned()
            };
            match self.string(n, &p).map(|s| Cidr::parse(&s)) {
                Some(Ok(c)) => out.push(c),
                Some(Err(e)) => {
                    self.problem(n.pos, &p, e.to_string());
                    ok = false;
                }
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    /// `flood: { limit, window, ban, ipv6_prefix }` (the first three required).
    fn flood(&mut self, node: &Node, path: &str) -> Option<FloodParams> {
        let f = self.fields(node, path, FLOOD_FIELDS)?;
        let limit = self
            .required(&f, path, "limit")
            .and_then(|n| self.int_in(n, &join(path, "limit"), 1, 1_000_000_000));
        let window = self
            .required(&f, path, "window")
            .and_then(|n| self.duration(n, &join(path, "window"), false));
        let ban = self
            .required(&f, path, "ban")
            .and_then(|n| self.duration(n, &join(path, "ban"), false));
        let prefix = self.int_field(
            &f,
            path,
            "ipv6_prefix",
            (1, 128),
            i128::from(crate::flood::DEFAULT_IPV6_PREFIX),
        );
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Some(FloodParams {
            limit: u32::try_from(limit?).unwrap_or(u32::MAX),
            window_ns: nanos(window?),
            ban_ns: nanos(ban?),
            ipv6_prefix: u8::try_from(prefix?).unwrap_or(crate::flood::DEFAULT_IPV6_PREFIX),
        })
    }

    /// The edge protection fields of a vserver: `allow`, `deny`, `flood`.
    pub(super) fn edge_fields(&mut self, f: &Fields, path: &str) -> Option<EdgeFields> {
        let allow = match f.get("allow") {
            None => Some(None),
            Some(n) => self.cidr_list(n, &join(path, "allow"), true).map(Some),
        };
        let deny = match f.get("deny") {
            None => Some(Vec::new()),
            Some(n) => self.cidr_list(n, &join(path, "deny"), false),
        };
        let flood = match f.get("flood") {
            None
            | Some(Node {
                value: Value::Null, ..
            }) => Some(None),
            Some(n) => self.flood(n, &join(path, "flood")).map(Some),
        };
        Some(EdgeFields {
            allow: allow?,
            deny: deny?,
            flood: flood?,
        })
    }
}

/// A vserver's `allow`, `deny` and `flood`, parsed.
pub(super) struct EdgeFields {
    pub(super) allow: Option<Vec<Cidr>>,
    pub(super) deny: Vec<Cidr>,
    pub(super) flood: Option<FloodParams>,
}

#[cfg(test)]
mod tests {
    use super::super::tests::{MINIMAL, problems};
    use crate::config::from_str;

    #[test]
    fn edge_protection_fields_parse_and_report_where() {
        let with = |extra: &str| {
            MINIMAL.replace("services: [s1] }", &format!("{extra}, services: [s1] }}"))
        };
        let c = from_str(
            "t",
            &with("allow: [10.0.0.0/8, \"2001:db8::/32\"], deny: 10.6.0.0/16, flood: { limit: 20, window: 1s, ban: 5m }"),
        )
        .expect("valid");
        let v = &c.vservers[0];
        assert_eq!(v.allow.as_ref().map(Vec::len), Some(2));
        assert_eq!(v.deny.len(), 1);
        let f = v.flood.expect("flood");
        assert_eq!(
            (f.limit, f.window_ns, f.ban_ns, f.ipv6_prefix),
            (20, 1_000_000_000, 300_000_000_000, 64)
        );
        let d = from_str("t", MINIMAL).expect("valid");
        assert!(d.vservers[0].allow.is_none() && d.vservers[0].deny.is_empty());
        assert!(d.vservers[0].flood.is_none());
        for (extra, path, says) in [
            (
                "deny: [10.1.2.3/8]",
                "vservers[0].deny[0]",
                "host bits set (the network is 10.0.0.0/8)",
            ),
            (
                "deny: [nonsense]",
                "vservers[0].deny[0]",
                "not an IP address",
            ),
            ("allow: []", "vservers[0].allow", "empty allow list"),
            (
                "allow: 10.0.0.0/33",
                "vservers[0].allow",
                "prefix length 33",
            ),
            (
                "flood: { limit: 0, window: 1s, ban: 1s }",
                "vservers[0].flood.limit",
                "",
            ),
            (
                "flood: { limit: 5, window: 0s, ban: 1s }",
                "vservers[0].flood.window",
                "greater than 0",
            ),
            (
                "flood: { limit: 5, window: 1s }",
                "vservers[0].flood.ban",
                "missing required field",
            ),
            (
                "flood: { limit: 5, window: 1s, ban: 1s, ipv6_prefix: 0 }",
                "vservers[0].flood.ipv6_prefix",
                "out of range",
            ),
        ] {
            let p = problems(&with(extra));
            assert_eq!(p.len(), 1, "{extra}: {p:?}");
            assert_eq!((p[0].0, p[0].1.as_str()), (4, path), "{extra}: {p:?}");
            assert!(p[0].2.contains(says), "{extra}: {p:?}");
        }
    }
}
