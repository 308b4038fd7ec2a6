//! `monitors[]`: a health monitor, its timing and the fields of its type. PURE.

use super::{Cx, Fields, join};
use crate::config::model::*;
use crate::config::yaml::Node;
use std::time::Duration;

const MONITOR_FIELDS: &[&str] = &[
    "name",
    "type",
    "interval",
    "timeout",
    "failures_to_down",
    "successes_to_up",
    "expect_codes",
    "send",
    "expect",
    "path",
];

const MONITOR_TYPES: &[&str] = &["sip-options", "tcp-connect", "udp", "http", "icmp"];

impl Cx {
    fn status_codes(&mut self, f: &Fields, path: &str) -> Option<Vec<u16>> {
        let Some(n) = f.get("expect_codes") else {
            return Some(Vec::new());
        };
        let p = join(path, "expect_codes");
        let mut codes = Vec::new();
        let mut ok = true;
        for (i, c) in self.seq(n, &p).iter().enumerate() {
            match self.int_in(c, &format!("{p}[{i}]"), 100, 699) {
                Some(v) => codes.push(v as u16),
                None => ok = false,
            }
        }
        ok.then_some(codes)
    }

    pub(super) fn monitor(&mut self, node: &Node, path: &str) -> Option<Monitor> {
        let f = self.fields(node, path, MONITOR_FIELDS)?;
        let name = self
            .required(&f, path, "name")
            .and_then(|n| self.string(n, &join(path, "name")));
        let type_node = self.required(&f, path, "type");
        let kind_name = type_node.and_then(|n| {
            let opts: Vec<(&str, &str)> = MONITOR_TYPES.iter().map(|t| (*t, *t)).collect();
            self.choice(n, &join(path, "type"), &opts)
        });
        let interval = self.duration_field(&f, path, "interval", Duration::from_secs(5), false);
        let timeout = self.duration_field(&f, path, "timeout", Duration::from_secs(2), false);
        if let (Some(i), Some(t)) = (interval, timeout)
            && t > i
        {
            // Reported where the operator can fix it: at the timeout when it was written, else
            // at the interval that is shorter than the default timeout.
            let (pos, field) = match (f.get("timeout"), f.get("interval")) {
                (Some(n), _) => (n.pos, "timeout"),
                (None, Some(n)) => (n.pos, "interval"),
                (None, None) => (f.pos, "timeout"),
            };
            self.problem(
                pos,
                &join(path, field),
                format!("timeout ({t:?}) must not exceed interval ({i:?})"),
            );
        }
        let failures_to_down = self.int_field(&f, path, "failures_to_down", (1, 100), 3);
        let successes_to_up = self.int_field(&f, path, "successes_to_up", (1, 100), 2);
        let codes = self.status_codes(&f, path);
        let kind = match kind_name? {
            "sip-options" => MonitorKind::SipOptions {
                expect_codes: codes?,
            },
            "tcp-connect" => MonitorKind::TcpConnect,
            "icmp" => MonitorKind::Icmp,
            "udp" => {
                let send = self.required(&f, path, "send");
                let send = send.and_then(|n| self.string(n, &join(path, "send")));
                let expect = self.opt_string(&f, path, "expect");
                MonitorKind::Udp {
                    send: send?.into_bytes(),
                    expect: expect.map(String::into_bytes),
                }
            }
            _ => {
                let p = self
                    .opt_string(&f, path, "path")
                    .unwrap_or_else(|| "/".into());
                if !p.starts_with('/') {
                    if let Some(n) = f.get("path") {
                        self.problem(n.pos, &join(path, "path"), "must start with `/`");
                    }
                    return None;
                }
                MonitorKind::Http {
                    path: p,
                    expect_codes: codes?,
                }
            }
        };
        for (field, kinds) in [
            ("send", &["udp"][..]),
            ("expect", &["udp"][..]),
            ("path", &["http"][..]),
            ("expect_codes", &["http", "sip-options"][..]),
        ] {
            if let (Some(n), Some(k)) = (f.get(field), kind_name)
                && !kinds.contains(&k)
            {
                self.problem(
                    n.pos,
                    &join(path, field),
                    format!("`{field}` does not apply to a `{k}` monitor"),
                );
            }
        }
        Some(Monitor {
            name: name?,
            kind,
            interval: interval?,
            timeout: timeout?,
            failures_to_down: failures_to_down? as u32,
            successes_to_up: successes_to_up? as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{MINIMAL, problems};

    /// The default timeout (2s) counts against a shorter interval, reported at the interval.
    #[test]
    fn a_default_timeout_longer_than_the_interval_is_reported() {
        let text = format!(
            "monitors:\n  - {{ name: m, type: tcp-connect, interval: 1s }}\n{}",
            MINIMAL.replace("protocol: sip-udp }", "protocol: sip-udp, monitor: m }")
        );
        let p = problems(&text);
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!((p[0].0, p[0].1.as_str()), (2, "monitors[0].interval"));
        assert!(p[0].2.contains("must not exceed interval"), "{p:?}");
    }
}
