//! Warnings: what a config may say but probably does not mean. PURE.
//!
//! A warning carries the position and field path a problem does ([`Problem`]) but never
//! refuses the file: `fulcrum check` prints it as `FILE:LINE:COL: field.path: warning: ...`
//! and exits as it would without it, `fulcrum run` logs it at start (docs/config.md).

use super::{Cx, Problem, item_name};
use crate::config::model::Vserver;
use crate::config::yaml::{Node, Pos, Value};
use std::time::Duration;

/// RFC 3261's T2 (§17.1.2.2): a service may hold a non-INVITE request's 100 back until
/// nearly this long (RFC 4320 §4.1).
const T2: Duration = Duration::from_secs(4);

impl Cx {
    /// Note something valid but probably not meant.
    pub(super) fn warning(&mut self, pos: Pos, path: &str, message: impl Into<String>) {
        self.warnings.push(Problem {
            pos,
            path: path.to_owned(),
            message: message.into(),
        });
    }

    /// `failover.no_answer_non_invite` (`node`, at `path`) of `no_answer`: below T2 it fails
    /// over requests that were only slow.
    pub(super) fn warn_short_non_invite_timeout(
        &mut self,
        node: &Node,
        path: &str,
        no_answer: Duration,
    ) {
        if no_answer < T2 {
            self.warning(
                node.pos,
                path,
                "below 4s, non-INVITE requests that were merely slow fail over: over UDP a \
                 service may send one nothing, not even a 100, until T2 (4s) has nearly \
                 passed (RFC 4320 §4.1)",
            );
        }
    }

    /// `kernel_relay` (`node`, at `path`): the in-kernel TCP relay was removed. `off` asked
    /// for what every tcp / http vserver now does, so it only warns; anything else asked for
    /// the relay and is refused, with the reason (BENCHMARKS.md, "TCP: the in-kernel relay
    /// against the user-space relay and HAProxy").
    pub(super) fn removed_kernel_relay(&mut self, node: &Node, path: &str) {
        // YAML 1.1 reads a bare `off` as false.
        let is_off =
            node.value == Value::Bool(false) || matches!(&node.value, Value::Str(s) if s == "off");
        if is_off {
            self.warning(
                node.pos,
                path,
                "the in-kernel TCP relay was removed and the user-space relay always serves: \
                 `kernel_relay: off` changes nothing, delete the field",
            );
        } else {
            self.problem(
                node.pos,
                path,
                "the in-kernel TCP relay was removed: it was measured slower than the \
                 user-space relay (BENCHMARKS.md); delete the field",
            );
        }
    }

    /// A `sip-ws` / `sip-wss` vserver with `allow` but no `allowed_origins`: the access list
    /// admits networks, not pages. A browser does not hold a WebSocket to its page's origin
    /// (RFC 6455 §10.2 leaves the Origin check to the server), so any page opened inside an
    /// allowed network could connect through that browser. `nodes` are the `vservers` items
    /// as written, `vservers` what was read of them.
    pub(super) fn warn_open_websockets(&mut self, nodes: &[Node], vservers: &[(Vserver, Pos)]) {
        for (i, node) in nodes.iter().enumerate() {
            let Some((name, _)) = item_name(node) else {
                continue;
            };
            let Some((v, _)) = vservers.iter().find(|(v, _)| v.name == name) else {
                continue;
            };
            if !v.protocol.is_websocket() || v.allow.is_none() || v.allowed_origins.is_some() {
                continue;
            }
            let Value::Map(entries) = &node.value else {
                continue;
            };
            if let Some((_, allow)) = entries.iter().find(|(k, _)| k.name == "allow") {
                self.warning(
                    allow.pos,
                    &format!("vservers[{i}].allow"),
                    format!(
                        "`allow` admits networks, not web pages: without `allowed_origins`, \
                         any page opened in a browser inside an allowed network can use this \
                         {} vserver; list your softphone's origins in `allowed_origins`",
                        v.protocol.name()
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Problem, from_str_with_env};

    fn warnings(text: &str) -> Vec<Problem> {
        from_str_with_env("t", text, &|_| None)
            .expect("valid")
            .warnings
    }

    const SERVICES: &str =
        "services:\n  - { name: r, address: 127.0.0.1:5071, protocol: sip-udp }\nvservers:\n";

    #[test]
    fn a_websocket_vserver_with_allow_and_no_origins_is_warned_at_allow() {
        let w = warnings(&format!(
            "{SERVICES}  - name: ws\n    protocol: sip-ws\n    bind: 127.0.0.1:0\n    allow: [10.0.0.0/8]\n    services: [r]\n"
        ));
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!((w[0].pos.line, w[0].pos.col), (7, 12));
        assert_eq!(w[0].path, "vservers[0].allow");
        assert!(w[0].message.contains("allowed_origins"), "{}", w[0].message);
        // With origins listed, without `allow`, or on another protocol: nothing to say.
        for quiet in [
            "  - { name: ws, protocol: sip-ws, bind: 127.0.0.1:0, allow: 10.0.0.0/8, allowed_origins: [\"https://a.example\"], services: [r] }\n",
            "  - { name: ws, protocol: sip-ws, bind: 127.0.0.1:0, services: [r] }\n",
            "  - { name: u, protocol: sip-udp, bind: 127.0.0.1:0, allow: 10.0.0.0/8, services: [r] }\n",
        ] {
            assert_eq!(
                warnings(&format!("{SERVICES}{quiet}")),
                Vec::new(),
                "{quiet}"
            );
        }
    }

    #[test]
    fn a_non_invite_no_answer_below_t2_is_warned_and_the_file_stays_valid() {
        let sip = |failover: &str| {
            format!(
                "{SERVICES}  - {{ name: u, protocol: sip-udp, bind: 127.0.0.1:0, services: [r], failover: {failover} }}\n"
            )
        };
        let w = warnings(&sip("{ no_answer_non_invite: 1s }"));
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(w[0].path, "vservers[0].failover.no_answer_non_invite");
        assert_eq!(w[0].pos.line, 4);
        assert!(w[0].message.contains("RFC 4320"), "{}", w[0].message);
        for quiet in [
            "{ no_answer_non_invite: 4s }",
            "{ no_answer_non_invite: 10s }",
            "{ no_answer_non_invite: off }",
            "{ no_answer: 500ms }",
            "off",
        ] {
            assert_eq!(warnings(&sip(quiet)), Vec::new(), "{quiet}");
        }
    }
}
