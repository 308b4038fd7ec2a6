//! YAML tree → validated [`Config`], collecting every problem. PURE.
//!
//! Each problem carries the position of the offending node and the field path
//! (`vservers[0].method`), so `fulcrum check` can print `FILE:LINE:COL: path: problem`
//! lines an operator can act on without reading code.
//!
//! One submodule per section of the file ([`lb`] with `admin` and `logging`, [`monitor`],
//! [`service`], [`vserver`], with the `tls` blocks in [`tls`], `allow`, `deny` and `flood`
//! in [`edge`], `eject` in [`eject`] and the rules of `protocol: ip` vservers in
//! [`packet`]), each adding the readers of its section to [`Cx`]; the readers every section
//! shares, and the file as a whole, are here.

mod capture;
mod edge;
mod eject;
mod lb;
mod monitor;
mod packet;
mod routes;
mod service;
mod tls;
mod vserver;
mod warnings;

use super::model::*;
use super::yaml::{Key, Node, Pos, Value};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// One thing wrong with a config file.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    pub pos: Pos,
    /// Dotted field path, e.g. `vservers[0].services[2]`.
    pub path: String,
    pub message: String,
}

/// Convert a parsed YAML tree into a [`Config`] (with its warnings, sorted by position), or
/// every problem found (sorted by position).
pub(crate) fn convert(root: &Node) -> Result<Config, Vec<Problem>> {
    let mut cx = Cx::default();
    let config = cx.config(root);
    if cx.problems.is_empty() {
        cx.warnings.sort();
        cx.warnings.dedup();
        let warnings = cx.warnings;
        config.map(|c| Config { warnings, ..c }).ok_or_else(|| {
            vec![Problem {
                pos: root.pos,
                path: String::new(),
                message: "configuration could not be read".into(),
            }]
        })
    } else {
        cx.problems.sort();
        cx.problems.dedup();
        Err(cx.problems)
    }
}

#[derive(Default)]
struct Cx {
    problems: Vec<Problem>,
    /// Valid but probably not meant ([`Cx::warning`]).
    warnings: Vec<Problem>,
}

/// Fields of a mapping, checked against the allowed names.
struct Fields<'a> {
    entries: &'a [(Key, Node)],
    pos: Pos,
}

impl<'a> Fields<'a> {
    fn get(&self, name: &str) -> Option<&'a Node> {
        self.entries
            .iter()
            .find(|(k, _)| k.name == name)
            .map(|(_, v)| v)
    }
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_owned()
    } else {
        format!("{path}.{field}")
    }
}

/// Levenshtein distance, for "did you mean" on unknown names.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur.push((prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The closest candidate within a small edit distance, if any.
fn suggest<'c>(word: &str, candidates: impl IntoIterator<Item = &'c str>) -> Option<&'c str> {
    candidates
        .into_iter()
        .map(|c| (edit_distance(word, c), c))
        .filter(|(d, c)| *d <= 2.max(c.len() / 4) || c.starts_with(word) && word.len() >= 3)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn did_you_mean<'c>(word: &str, candidates: impl IntoIterator<Item = &'c str>) -> String {
    match suggest(word, candidates) {
        Some(s) => format!("; did you mean `{s}`?"),
        None => String::new(),
    }
}

/// Longest duration a config accepts, in seconds (about 31 years): far beyond any timer an
/// operator means, short enough that no deadline computed from it overflows.
const MAX_DURATION_S: i128 = 1_000_000_000;

/// `5s`, `250ms`, `1m`, `1h`, `0`; a bare integer means seconds.
/// A size written as a number of bytes with an optional binary unit: `512`, `512B`, `64KiB`,
/// `256MiB`, `2GiB` (no fractions).
pub(super) fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(digits);
    let n: u64 = n.parse().ok()?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(scale)
}

pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.')?;
    let (num, unit) = s.split_at(split);
    let value: f64 = num.parse().ok()?;
    let secs = match unit.trim() {
        "ms" => value / 1000.0,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => return None,
    };
    if !secs.is_finite() || !(0.0..=MAX_DURATION_S as f64).contains(&secs) {
        return None;
    }
    Some(Duration::from_secs_f64(secs))
}

/// `127.0.0.1:5060`, `[::1]:5060`, `0.0.0.0:5060`, `[::]:5060`.
fn parse_socket_addr(s: &str) -> Result<SocketAddr, String> {
    s.trim().parse::<SocketAddr>().map_err(|_| {
        if s.parse::<IpAddr>().is_ok() {
            format!("`{s}` has no port; write it as IP:PORT (IPv6 as [ADDR]:PORT)")
        } else {
            format!("`{s}` is not an IP:PORT address (IPv6 as [ADDR]:PORT)")
        }
    })
}

const TOP_FIELDS: &[&str] = &[
    "lb",
    "admin",
    "logging",
    "monitors",
    "services",
    "vservers",
    "flow_key_file",
    "dns",
    "capture",
];

/// The `name` of every item of a list, valid or not, so that a reference to an item that
/// has its own problems is not also reported as unknown.
fn declared_names(nodes: &[Node]) -> Vec<String> {
    nodes
        .iter()
        .filter_map(|n| item_name(n).map(|(name, _)| name))
        .collect()
}

/// The `name` of a list item as [`Cx::string`] reads it (`name: 7` is the name "7"), with
/// its position; `None` when the item has no name of a usable kind.
fn item_name(node: &Node) -> Option<(String, Pos)> {
    let Value::Map(entries) = &node.value else {
        return None;
    };
    let (_, v) = entries.iter().find(|(k, _)| k.name == "name")?;
    match &v.value {
        Value::Str(s) => Some((s.clone(), v.pos)),
        Value::Int(i) => Some((i.to_string(), v.pos)),
        _ => None,
    }
}

impl Cx {
    fn problem(&mut self, pos: Pos, path: &str, message: impl Into<String>) {
        self.problems.push(Problem {
            pos,
            path: path.to_owned(),
            message: message.into(),
        });
    }

    /// A mapping with only `allowed` keys; unknown keys are reported with a suggestion.
    fn fields<'a>(&mut self, node: &'a Node, path: &str, allowed: &[&str]) -> Option<Fields<'a>> {
        match &node.value {
            Value::Map(entries) => {
                for (k, _) in entries {
                    if !allowed.contains(&k.name.as_str()) {
                        let hint = did_you_mean(&k.name, allowed.iter().copied());
                        self.problem(
                            k.pos,
                            &join(path, &k.name),
                            format!("unknown field `{}`{hint}", k.name),
                        );
                    }
                }
                Some(Fields {
                    entries,
                    pos: node.pos,
                })
            }
            Value::Null if path.is_empty() => Some(Fields {
                entries: &[],
                pos: node.pos,
            }),
            other => {
                self.problem(
                    node.pos,
                    path,
                    format!("expected a mapping, found {}", other.kind()),
                );
                None
            }
        }
    }

    fn required<'a>(&mut self, f: &Fields<'a>, path: &str, name: &str) -> Option<&'a Node> {
        let node = f.get(name);
        if node.is_none() {
            self.problem(
                f.pos,
                &join(path, name),
                format!("missing required field `{name}`"),
            );
        }
        node
    }

    fn string(&mut self, node: &Node, path: &str) -> Option<String> {
        match &node.value {
            Value::Str(s) if !s.trim().is_empty() => Some(s.clone()),
            Value::Str(_) => {
                self.problem(node.pos, path, "must not be empty");
                None
            }
            Value::Int(i) => Some(i.to_string()),
            other => {
                self.problem(
                    node.pos,
                    path,
                    format!("expected a string, found {}", other.kind()),
                );
                None
            }
        }
    }

    fn opt_string(&mut self, f: &Fields, path: &str, name: &str) -> Option<String> {
        match f.get(name) {
            None => None,
            Some(n) if n.value == Value::Null => None,
            Some(n) => self.string(n, &join(path, name)),
        }
    }

    fn int_in(&mut self, node: &Node, path: &str, min: i128, max: i128) -> Option<i128> {
        match node.value {
            Value::Int(i) if (min..=max).contains(&i) => Some(i),
            Value::Int(i) => {
                self.problem(node.pos, path, format!("{i} is out of range {min}..={max}"));
                None
            }
            ref other => {
                self.problem(
                    node.pos,
                    path,
                    format!(
                        "expected an integer in {min}..={max}, found {}",
                        other.kind()
                    ),
                );
                None
            }
        }
    }

    /// A size in bytes: an integer, or a string such as `"256MiB"` (`B`, `KiB`, `MiB`,
    /// `GiB`), within `min..=max`.
    fn size_bytes(&mut self, node: &Node, path: &str, min: u64, max: u64) -> Option<u64> {
        let n = match &node.value {
            Value::Int(i) => u64::try_from(*i).ok(),
            Value::Str(s) => parse_size(s),
            _ => None,
        };
        match n {
            Some(n) if (min..=max).contains(&n) => Some(n),
            Some(n) => {
                self.problem(
                    node.pos,
                    path,
                    format!("{n} bytes is out of range {min}..={max}"),
                );
                None
            }
            None => {
                self.problem(
                    node.pos,
                    path,
                    "expected a size such as `256MiB`, `64KiB` or a number of bytes",
                );
                None
            }
        }
    }

    /// An optional integer field with a default; `None` only when the value was bad.
    fn int_field(
        &mut self,
        f: &Fields,
        path: &str,
        name: &str,
        (min, max): (i128, i128),
        default: i128,
    ) -> Option<i128> {
        match f.get(name) {
            None => Some(default),
            Some(n) => self.int_in(n, &join(path, name), min, max),
        }
    }

    fn bool_field(&mut self, f: &Fields, path: &str, name: &str, default: bool) -> Option<bool> {
        match f.get(name).map(|n| (n, &n.value)) {
            None => Some(default),
            Some((_, Value::Bool(b))) => Some(*b),
            Some((n, other)) => {
                self.problem(
                    n.pos,
                    &join(path, name),
                    format!("expected true or false, found {}", other.kind()),
                );
                None
            }
        }
    }

    fn duration(&mut self, node: &Node, path: &str, allow_zero: bool) -> Option<Duration> {
        let d = match &node.value {
            Value::Str(s) => parse_duration(s),
            // The same bound as a written duration (`parse_duration`).
            Value::Int(i) if (0..=MAX_DURATION_S).contains(i) => {
                u64::try_from(*i).ok().map(Duration::from_secs)
            }
            _ => None,
        };
        match d {
            Some(d) if d.is_zero() && !allow_zero => {
                self.problem(node.pos, path, "must be greater than 0");
                None
            }
            Some(d) => Some(d),
            None => {
                self.problem(
                    node.pos,
                    path,
                    "expected a duration such as `5s`, `250ms`, `1m` or `1h`",
                );
                None
            }
        }
    }

    fn duration_field(
        &mut self,
        f: &Fields,
        path: &str,
        name: &str,
        default: Duration,
        allow_zero: bool,
    ) -> Option<Duration> {
        match f.get(name) {
            None => Some(default),
            Some(n) => self.duration(n, &join(path, name), allow_zero),
        }
    }

    /// One of a fixed set of words.
    fn choice<T: Copy>(&mut self, node: &Node, path: &str, options: &[(&str, T)]) -> Option<T> {
        let names = || options.iter().map(|(n, _)| *n);
        match &node.value {
            Value::Str(s) => match options.iter().find(|(n, _)| *n == s.as_str()) {
                Some((_, v)) => Some(*v),
                None => {
                    let hint = did_you_mean(s, names());
                    let all: Vec<&str> = names().collect();
                    self.problem(
                        node.pos,
                        path,
                        format!("unknown value `{s}`{hint} (one of: {})", all.join(", ")),
                    );
                    None
                }
            },
            other => {
                let all: Vec<&str> = names().collect();
                self.problem(
                    node.pos,
                    path,
                    format!("expected one of {}, found {}", all.join(", "), other.kind()),
                );
                None
            }
        }
    }

    fn seq<'a>(&mut self, node: &'a Node, path: &str) -> &'a [Node] {
        match &node.value {
            Value::Seq(items) => items,
            Value::Null => &[],
            other => {
                self.problem(
                    node.pos,
                    path,
                    format!("expected a list, found {}", other.kind()),
                );
                &[]
            }
        }
    }

    /// An optional field read by `read`: `Some(None)` when absent, `None` when bad.
    fn optional<T>(
        &mut self,
        f: &Fields,
        path: &str,
        name: &str,
        read: impl FnOnce(&mut Cx, &Node, &str) -> Option<T>,
    ) -> Option<Option<T>> {
        match f.get(name) {
            None => Some(None),
            Some(n) => read(self, n, &join(path, name)).map(Some),
        }
    }

    fn config(&mut self, root: &Node) -> Option<Config> {
        let f = self.fields(root, "", TOP_FIELDS)?;
        let lb = match f.get("lb") {
            Some(n) => self.lb(n),
            None => Some(LbParams::default()),
        };
        let admin = match f.get("admin") {
            Some(n) => self.admin(n),
            None => Some(Admin::default()),
        };
        let logging = match f.get("logging") {
            Some(n) => self.logging(n),
            None => Some(Logging::default()),
        };
        let monitor_nodes = f
            .get("monitors")
            .map_or(&[][..], |n| self.seq(n, "monitors"));
        let monitors = self.named_list(monitor_nodes, "monitors", Cx::monitor);
        let monitor_refs: Vec<&Monitor> = monitors.iter().map(|(m, _)| m).collect();
        let monitors_declared = declared_names(monitor_nodes);

        let service_nodes = match self.required(&f, "", "services") {
            Some(n) => self.seq(n, "services"),
            None => &[],
        };
        let services = self.named_list(service_nodes, "services", |cx, n, path| {
            cx.service(n, path, &monitor_refs, &monitors_declared)
        });

        let vserver_nodes = match self.required(&f, "", "vservers") {
            Some(n) => self.seq(n, "vservers"),
            None => &[],
        };
        if vserver_nodes.is_empty() && f.get("vservers").is_some() {
            self.problem(f.pos, "vservers", "at least one vserver is required");
        }
        let service_refs: Vec<(&str, &Service)> =
            services.iter().map(|(s, _)| (s.name.as_str(), s)).collect();
        let services_declared = declared_names(service_nodes);
        let vservers = self.named_list(vserver_nodes, "vservers", |cx, n, path| {
            cx.vserver(n, path, &service_refs, &services_declared)
        });
        self.check_binds(&vservers, admin.as_ref().and_then(|a| a.listen));
        self.warn_open_websockets(vserver_nodes, &vservers);

        let flow_key_file = match f.get("flow_key_file") {
            None => Some(None),
            Some(n) => self.file(n, "flow_key_file").map(|file| {
                Some(FlowKeyFile {
                    file,
                    keys: Vec::new(),
                })
            }),
        };
        let dns = match f.get("dns") {
            Some(n) => self.dns_settings(n),
            None => Some(DnsSettings::default()),
        };
        let vserver_names: Vec<&str> = vservers.iter().map(|(v, _)| v.name.as_str()).collect();
        let vservers_declared = declared_names(vserver_nodes);
        let capture = match f.get("capture") {
            None => Some(None),
            Some(n) => self.capture(n, &vserver_names, &vservers_declared),
        };
        Some(Config {
            capture: capture?,
            dns: dns?,
            flow_key_file: flow_key_file?,
            lb: lb?,
            admin: admin?,
            logging: logging?,
            monitors: monitors.into_iter().map(|(m, _)| m).collect(),
            services: services.into_iter().map(|(s, _)| s).collect(),
            vservers: vservers.into_iter().map(|(v, _)| v).collect(),
            warnings: Vec::new(),
        })
    }

    /// Convert each item of a list with `one`, and report duplicate names.
    fn named_list<T>(
        &mut self,
        nodes: &[Node],
        path: &str,
        mut one: impl FnMut(&mut Cx, &Node, &str) -> Option<T>,
    ) -> Vec<(T, Pos)> {
        let mut out: Vec<(T, Pos)> = Vec::new();
        let mut seen: HashMap<String, Pos> = HashMap::new();
        for (i, node) in nodes.iter().enumerate() {
            let item_path = format!("{path}[{i}]");
            // Report duplicate names even when the item has other problems.
            if let Some((name, pos)) = item_name(node) {
                if let Some(first) = seen.get(&name) {
                    self.problem(
                        pos,
                        &format!("{item_path}.name"),
                        format!(
                            "duplicate name `{name}` (first defined at line {})",
                            first.line
                        ),
                    );
                } else {
                    seen.insert(name, pos);
                }
            }
            let before = self.problems.len();
            match one(self, node, &item_path) {
                Some(item) => out.push((item, node.pos)),
                // Every converter reports why it gives up; should one ever not, the item must
                // still not vanish from the config without a word.
                None if self.problems.len() == before => {
                    self.problem(node.pos, &item_path, "this item could not be read")
                }
                None => {}
            }
        }
        out
    }

    /// Two vservers may not listen on the same transport address (wildcards overlap
    /// every address of their family). Port 0 asks the kernel for a free port, so it never clashes.
    /// No two listeners on one transport address: vservers among themselves, and a TCP
    /// vserver against the admin API's `listen` (which would otherwise fail only at start).
    fn check_binds(&mut self, vservers: &[(Vserver, Pos)], admin: Option<SocketAddr>) {
        let mut seen: Vec<(bool, SocketAddr, String)> = admin
            .filter(|a| a.port() != 0)
            .map(|a| (false, a, "the admin API (`admin.listen`)".to_owned()))
            .into_iter()
            .collect();
        for (i, (v, pos)) in vservers.iter().enumerate() {
            let is_udp = v.protocol.is_datagram();
            for addr in &v.bind {
                if addr.port() == 0 {
                    continue;
                }
                let clash = seen.iter().find(|(u, a, _)| {
                    *u == is_udp
                        && a.port() == addr.port()
                        && a.is_ipv4() == addr.is_ipv4()
                        && (a.ip() == addr.ip()
                            || a.ip().is_unspecified()
                            || addr.ip().is_unspecified())
                });
                if let Some((_, other, owner)) = clash {
                    self.problem(
                        *pos,
                        &format!("vservers[{i}].bind"),
                        format!(
                            "{addr} ({}) overlaps {other} of {owner}",
                            if is_udp { "udp" } else { "tcp" }
                        ),
                    );
                } else {
                    seen.push((is_udp, *addr, format!("vserver `{}`", v.name)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::from_str;

    /// One sip-udp vserver over one service: the file the tests of every section vary.
    pub(super) const MINIMAL: &str = "services:\n  - { name: s1, address: 127.0.0.1:5071, protocol: sip-udp }\nvservers:\n  - { name: v, protocol: sip-udp, bind: 127.0.0.1:5060, services: [s1] }\n";

    #[test]
    fn defaults_apply() {
        let c = from_str("t", MINIMAL).expect("valid");
        assert_eq!(c.lb, LbParams::default());
        assert_eq!(c.admin, Admin::default());
        let v = &c.vservers[0];
        assert_eq!(v.method, Method::CallIdHash);
        assert_eq!(v.hash, HashParams::default());
        assert_eq!(v.idle_timeout, Duration::from_secs(3600));
        assert_eq!(v.bind, vec!["127.0.0.1:5060".parse().expect("addr")]);
        assert_eq!(c.services[0].weight, 1);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("1m"), Some(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("0s"), Some(Duration::ZERO));
        assert_eq!(parse_duration("5"), None);
        assert_eq!(parse_duration("s"), None);
        assert_eq!(parse_duration("-1s"), None);
        assert_eq!(parse_duration("5 weeks"), None);
    }

    #[test]
    fn all_problems_are_reported_sorted() {
        let text =
            "lb: { hash_fingers: 0, hash_algorithm: ring }\nservices: []\nvservers: []\nextra: 1\n";
        let e = from_str("t", text).expect_err("invalid");
        let p = e.problems();
        assert!(p.len() >= 4, "{p:?}");
        assert!(p.windows(2).all(|w| w[0] <= w[1]));
        assert!(p.iter().any(|x| x.path == "extra"));
        assert!(p.iter().any(|x| x.path == "lb.hash_fingers"));
    }

    /// Problems of `text`, as (line, path, message).
    pub(super) fn problems(text: &str) -> Vec<(u32, String, String)> {
        from_str("t", text)
            .expect_err("invalid")
            .problems()
            .iter()
            .map(|p| (p.pos.line, p.path.clone(), p.message.clone()))
            .collect()
    }

    /// `name: 1` and `name: "1"` are the same name (both read as the string "1").
    #[test]
    fn numeric_names_count_as_duplicates() {
        let text = "services:\n  - { name: 1, address: 127.0.0.1:5071, protocol: udp }\n  - { name: \"1\", address: 127.0.0.1:5072, protocol: udp }\nvservers:\n  - { name: 7, protocol: udp, bind: 127.0.0.1:5060, method: round_robin, services: [1] }\n  - { name: \"7\", protocol: udp, bind: 127.0.0.1:5061, method: round_robin, services: [\"1\"] }\n";
        let p = problems(text);
        assert!(
            p.iter().any(|(l, path, m)| *l == 3
                && path == "services[1].name"
                && m.contains("duplicate")),
            "{p:?}"
        );
        assert!(
            p.iter().any(|(l, path, m)| *l == 6
                && path == "vservers[1].name"
                && m.contains("duplicate")),
            "{p:?}"
        );
    }

    /// A bare integer duration has the same bound as a written one.
    #[test]
    fn integer_durations_are_bounded() {
        let ok = MINIMAL.replace(
            "services: [s1] }",
            "services: [s1], idle_timeout: 1000000000 }",
        );
        assert!(from_str("t", &ok).is_ok());
        let big = MINIMAL.replace(
            "services: [s1] }",
            "services: [s1], idle_timeout: 18446744073709551615 }",
        );
        let p = problems(&big);
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].1, "vservers[0].idle_timeout");
    }

    /// A TCP vserver on the admin API's address is refused by `check`, not at start.
    #[test]
    fn a_tcp_bind_on_the_admin_address_is_reported() {
        let tcp = MINIMAL
            .replace("sip-udp", "sip-tcp")
            .replace("127.0.0.1:5060", "0.0.0.0:9090");
        let p = problems(&format!("admin: {{ listen: 127.0.0.1:9090 }}\n{tcp}"));
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].1, "vservers[0].bind");
        assert!(p[0].2.contains("admin API"), "{p:?}");
        // UDP on the same port, or the admin API switched off, is fine.
        let udp = MINIMAL.replace("127.0.0.1:5060", "127.0.0.1:9090");
        assert!(from_str("t", &udp).is_ok());
        assert!(from_str("t", &format!("admin: {{ listen: null }}\n{tcp}")).is_ok());
    }

    #[test]
    fn never_panics_on_odd_documents() {
        for text in [
            "[]",
            "42",
            "~",
            "services: 3\nvservers: {}",
            "a: &x [*x]",
            "\u{0}",
            "services:\n  - - -\n",
        ] {
            let _ = from_str("t", text);
        }
    }
}
