//! YAML tree → validated [`Config`], collecting every problem. PURE.
//!
//! Each problem carries the position of the offending node and the field path
//! (`vservers[0].method`), so `fulcrum check` can print `FILE:LINE:COL: path: problem`
//! lines an operator can act on without reading code.

use super::model::*;
use super::yaml::{Key, Node, Pos, Value};
use crate::acl::Cidr;
use crate::flood::FloodParams;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

/// One thing wrong with a config file.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    pub pos: Pos,
    /// Dotted field path, e.g. `vservers[0].services[2]`.
    pub path: String,
    pub message: String,
}

/// Convert a parsed YAML tree into a [`Config`], or every problem found (sorted by position).
pub(crate) fn convert(root: &Node) -> Result<Config, Vec<Problem>> {
    let mut cx = Cx::default();
    let config = cx.config(root);
    if cx.problems.is_empty() {
        config.ok_or_else(|| {
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

/// True when `mask` is a run of ones followed by zeros.
fn is_contiguous_mask(mask: Ipv4Addr) -> bool {
    let m = u32::from(mask);
    m.leading_ones() + m.trailing_zeros() == 32
}

fn default_idle_timeout(protocol: Protocol) -> Duration {
    match protocol {
        // Dialog affinity lives as long as a long call (docs/config.md, Defaults worth a reason).
        Protocol::SipUdp | Protocol::SipTcp | Protocol::SipTls => Duration::from_secs(3600),
        // nginx stream / Envoy UDP proxy default idle timeouts are about a minute.
        Protocol::Udp => Duration::from_secs(60),
        Protocol::Tcp | Protocol::Http => Duration::from_secs(600),
    }
}

const TOP_FIELDS: &[&str] = &["lb", "admin", "logging", "monitors", "services", "vservers"];
const LB_FIELDS: &[&str] = &["hash_algorithm", "hash_fingers", "prac_max_share"];
const ADMIN_FIELDS: &[&str] = &["listen", "token"];
const LOGGING_FIELDS: &[&str] = &["format", "level"];
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
const SERVICE_FIELDS: &[&str] = &[
    "name",
    "address",
    "protocol",
    "weight",
    "monitor",
    "max_clients",
    "hash_id",
    "tls",
];
const VSERVER_FIELDS: &[&str] = &[
    "name",
    "protocol",
    "bind",
    "method",
    "hash_length",
    "netmask",
    "v6_netmask_len",
    "token",
    "hash_balance_factor",
    "slow_start",
    "services",
    "advertise",
    "record_route",
    "idle_timeout",
    "drain_timeout",
    "allow",
    "deny",
    "flood",
    "max_sessions",
    "transparent",
    "freebind",
    "send_proxy",
    "workers",
    "tls",
    "tls_handshake_timeout",
];
const VSERVER_TLS_FIELDS: &[&str] = &["cert", "key", "client_ca"];
const SERVICE_TLS_FIELDS: &[&str] = &["ca", "server_name", "cert", "key"];
const FLOOD_FIELDS: &[&str] = &["limit", "window", "ban"];
const SLOW_START_FIELDS: &[&str] = &["new_service_request_rate", "unit", "increment_interval"];
const TOKEN_FIELDS: &[&str] = &["header", "query", "offset", "length"];
const MONITOR_TYPES: &[&str] = &["sip-options", "tcp-connect", "udp", "http"];

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
        let monitor_names: Vec<&str> = monitors.iter().map(|(m, _)| m.name.as_str()).collect();
        let monitors_declared = declared_names(monitor_nodes);

        let service_nodes = match self.required(&f, "", "services") {
            Some(n) => self.seq(n, "services"),
            None => &[],
        };
        let services = self.named_list(service_nodes, "services", |cx, n, path| {
            cx.service(n, path, &monitor_names, &monitors_declared)
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

        Some(Config {
            lb: lb?,
            admin: admin?,
            logging: logging?,
            monitors: monitors.into_iter().map(|(m, _)| m).collect(),
            services: services.into_iter().map(|(s, _)| s).collect(),
            vservers: vservers.into_iter().map(|(v, _)| v).collect(),
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

    fn lb(&mut self, node: &Node) -> Option<LbParams> {
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

    fn admin(&mut self, node: &Node) -> Option<Admin> {
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

    fn logging(&mut self, node: &Node) -> Option<Logging> {
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

    fn monitor(&mut self, node: &Node, path: &str) -> Option<Monitor> {
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

    fn service(
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
        let hash_id = self.opt_string(&f, path, "hash_id");
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
        })
    }

    fn bind_list(&mut self, node: &Node, path: &str) -> Option<Vec<SocketAddr>> {
        let items: Vec<&Node> = match &node.value {
            Value::Seq(items) => items.iter().collect(),
            _ => vec![node],
        };
        if items.is_empty() {
            self.problem(node.pos, path, "at least one bind address is required");
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
            match self.string(n, &p).map(|s| parse_socket_addr(&s)) {
                Some(Ok(a)) => {
                    if out.contains(&a) {
                        self.problem(n.pos, &p, format!("{a} is listed twice"));
                        ok = false;
                    }
                    out.push(a);
                }
                Some(Err(e)) => {
                    self.problem(n.pos, &p, e);
                    ok = false;
                }
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    fn token_rule(&mut self, node: &Node, path: &str) -> Option<TokenRule> {
        let f = self.fields(node, path, TOKEN_FIELDS)?;
        let present: Vec<&str> = ["header", "query", "offset"]
            .into_iter()
            .filter(|k| f.get(k).is_some())
            .collect();
        match present.as_slice() {
            ["header"] => self
                .required(&f, path, "header")
                .and_then(|n| self.string(n, &join(path, "header")))
                .map(TokenRule::Header),
            ["query"] => self
                .required(&f, path, "query")
                .and_then(|n| self.string(n, &join(path, "query")))
                .map(TokenRule::Query),
            ["offset"] => {
                let offset = self.int_field(&f, path, "offset", (0, 65_535), 0);
                let length = match self.required(&f, path, "length") {
                    Some(n) => self.int_in(n, &join(path, "length"), 1, 4096),
                    None => None,
                };
                Some(TokenRule::Payload {
                    offset: offset? as usize,
                    length: length? as usize,
                })
            }
            _ => {
                self.problem(
                    node.pos,
                    path,
                    "give exactly one of `header`, `query` or `offset` (with `length`)",
                );
                None
            }
        }
    }

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

    /// `flood: { limit, window, ban }` (all required).
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
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Some(FloodParams {
            limit: u32::try_from(limit?).unwrap_or(u32::MAX),
            window_ns: nanos(window?),
            ban_ns: nanos(ban?),
        })
    }

    /// The edge protection fields of a vserver: `allow`, `deny`, `flood`.
    fn edge_fields(&mut self, f: &Fields, path: &str) -> Option<EdgeFields> {
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

    fn slow_start(&mut self, node: &Node, path: &str) -> Option<SlowStart> {
        let f = self.fields(node, path, SLOW_START_FIELDS)?;
        let rate = self
            .required(&f, path, "new_service_request_rate")
            .and_then(|n| self.int_in(n, &join(path, "new_service_request_rate"), 0, 1_000_000));
        let unit = match f.get("unit") {
            None => Some(RateUnit::PerSecond),
            Some(n) => self.choice(
                n,
                &join(path, "unit"),
                &[
                    ("per_second", RateUnit::PerSecond),
                    ("percent", RateUnit::Percent),
                ],
            ),
        };
        let interval = self.duration_field(&f, path, "increment_interval", Duration::ZERO, true);
        Some(SlowStart {
            new_service_request_rate: rate? as u32,
            unit: unit?,
            increment_interval: interval?,
        })
    }

    /// A vserver: its fields read group by group, its services resolved, then the
    /// cross-field rules ([`Cx::vserver_rules`], [`Cx::members_fit`]) over what was read.
    fn vserver(
        &mut self,
        node: &Node,
        path: &str,
        services: &[(&str, &Service)],
        services_declared: &[String],
    ) -> Option<Vserver> {
        let f = self.fields(node, path, VSERVER_FIELDS)?;
        let v = self.vserver_fields(&f, path);
        let (members, listed_ok) = self.members(&f, path, services, services_declared);
        let members_fit = self.members_fit(v.protocol, services, &members);
        self.vserver_rules(&f, path, &v);
        let members = members.iter().map(|m| m.index).collect();
        v.build((listed_ok && members_fit).then_some(members))
    }

    /// Every field of a vserver but `services`, each read on its own (defaults may depend
    /// on the protocol).
    fn vserver_fields(&mut self, f: &Fields, path: &str) -> VserverFields {
        let name = self
            .required(f, path, "name")
            .and_then(|n| self.string(n, &join(path, "name")));
        let protocol = self
            .required(f, path, "protocol")
            .and_then(|n| self.choice(n, &join(path, "protocol"), &Protocol::ALL));
        let bind = self
            .required(f, path, "bind")
            .and_then(|n| self.bind_list(n, &join(path, "bind")));
        let method = match (f.get("method"), protocol) {
            (Some(n), _) => self.choice(n, &join(path, "method"), &Method::ALL),
            (None, Some(p)) if p.is_sip() => Some(Method::CallIdHash),
            (None, _) => Some(Method::LeastConnection),
        };
        let (idle_timeout, drain_timeout) = self.timeouts(f, path, protocol);
        let tls = self.vserver_tls_fields(f, path, protocol);
        VserverFields {
            tls,
            name,
            protocol,
            bind,
            method,
            hash: self.hash_fields(f, path),
            slow_start: self.optional(f, path, "slow_start", Cx::slow_start),
            advertise: self.advertise(f, path),
            record_route: self.bool_field(f, path, "record_route", false),
            idle_timeout,
            drain_timeout,
            edge: self.edge_fields(f, path),
            options: self.proxy_options(f, path),
        }
    }

    /// A file name (`cert`, `key`, `ca`...), kept with where it is written: the file is read
    /// by [`crate::config::load`], which reports its problems there.
    fn file(&mut self, node: &Node, path: &str) -> Option<ConfigFile> {
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
    fn vserver_tls_fields(
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
    fn service_tls(&mut self, node: &Node, path: &str) -> Option<ServiceTls> {
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
    fn tls_fits_protocol(&mut self, n: &Node, tp: &str, p: Protocol, what: &str) {
        if !p.takes_tls() {
            let takes: Vec<&str> = Protocol::ALL
                .iter()
                .filter(|(_, q)| q.takes_tls())
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

    /// `hash_length`, `netmask`, `v6_netmask_len`, `token` and `hash_balance_factor`.
    fn hash_fields(&mut self, f: &Fields, path: &str) -> HashFields {
        HashFields {
            hash_length: self.int_field(f, path, "hash_length", (1, 4096), 80),
            netmask: self.netmask(f, path),
            v6_netmask_len: self.int_field(f, path, "v6_netmask_len", (0, 128), 128),
            token: self.optional(f, path, "token", Cx::token_rule),
            hash_balance_factor: self.optional(f, path, "hash_balance_factor", |cx, n, p| {
                cx.int_in(n, p, 100, 10_000).map(|v| v as u32)
            }),
        }
    }

    fn netmask(&mut self, f: &Fields, path: &str) -> Option<Ipv4Addr> {
        let Some(n) = f.get("netmask") else {
            return Some(Ipv4Addr::BROADCAST);
        };
        let p = join(path, "netmask");
        self.string(n, &p)
            .and_then(|s| match s.parse::<Ipv4Addr>() {
                Ok(m) if is_contiguous_mask(m) => Some(m),
                _ => {
                    self.problem(
                        n.pos,
                        &p,
                        format!("`{s}` is not an IPv4 netmask such as 255.255.255.0"),
                    );
                    None
                }
            })
    }

    /// `advertise`, reported (and kept) when it is not HOST:PORT.
    fn advertise(&mut self, f: &Fields, path: &str) -> Option<String> {
        let advertise = self.opt_string(f, path, "advertise");
        if let (Some(a), Some(n)) = (&advertise, f.get("advertise"))
            && !is_host_port(a)
        {
            self.problem(
                n.pos,
                &join(path, "advertise"),
                format!("`{a}` is not HOST:PORT (IPv6 as [ADDR]:PORT)"),
            );
        }
        advertise
    }

    /// `idle_timeout` (its default depends on the protocol) and `drain_timeout` (by
    /// default the idle timeout).
    fn timeouts(
        &mut self,
        f: &Fields,
        path: &str,
        protocol: Option<Protocol>,
    ) -> (Option<Duration>, Option<Duration>) {
        let idle_timeout = match (f.get("idle_timeout"), protocol) {
            (Some(n), _) => self.duration(n, &join(path, "idle_timeout"), false),
            (None, Some(p)) => Some(default_idle_timeout(p)),
            (None, None) => None,
        };
        let drain_timeout = match f.get("drain_timeout") {
            Some(n) => self.duration(n, &join(path, "drain_timeout"), true),
            None => idle_timeout,
        };
        (idle_timeout, drain_timeout)
    }

    /// `max_sessions`, `workers`, `transparent`, `freebind` and `send_proxy`.
    fn proxy_options(&mut self, f: &Fields, path: &str) -> ProxyOptions {
        let send_proxy = match f.get("send_proxy") {
            None => Some(None),
            Some(Node {
                value: Value::Null, ..
            }) => Some(None),
            Some(n) => self
                .choice(n, &join(path, "send_proxy"), &[("v2", ProxyProtocol::V2)])
                .map(Some),
        };
        ProxyOptions {
            max_sessions: self.int_field(f, path, "max_sessions", (1, 10_000_000), 100_000),
            workers: self.int_field(f, path, "workers", (0, 256), 0),
            transparent: self.bool_field(f, path, "transparent", false),
            freebind: self.bool_field(f, path, "freebind", false),
            send_proxy,
        }
    }

    /// The vserver's `services` resolved by name: each must be declared and listed once.
    /// The flag is false when one was not (its problem reported).
    fn members(
        &mut self,
        f: &Fields,
        path: &str,
        services: &[(&str, &Service)],
        services_declared: &[String],
    ) -> (Vec<Member>, bool) {
        let mut members: Vec<Member> = Vec::new();
        let mut ok = true;
        let Some(list) = self.required(f, path, "services") else {
            return (members, ok);
        };
        let sp = join(path, "services");
        let items = self.seq(list, &sp);
        if items.is_empty() {
            self.problem(list.pos, &sp, "at least one service is required");
            ok = false;
        }
        for (i, item) in items.iter().enumerate() {
            let ip = format!("{sp}[{i}]");
            let Some(sname) = self.string(item, &ip) else {
                ok = false;
                continue;
            };
            match services.iter().position(|(n, _)| *n == sname) {
                None if services_declared.contains(&sname) => ok = false,
                None => {
                    let hint = did_you_mean(&sname, services_declared.iter().map(String::as_str));
                    self.problem(item.pos, &ip, format!("unknown service `{sname}`{hint}"));
                    ok = false;
                }
                Some(idx) if members.iter().any(|m| m.index == idx) => {
                    self.problem(item.pos, &ip, format!("service `{sname}` is listed twice"));
                    ok = false;
                }
                Some(index) => members.push(Member {
                    index,
                    pos: item.pos,
                    path: ip,
                }),
            }
        }
        (members, ok)
    }

    /// Members must speak the vserver's protocol, and hash apart: two members with one
    /// hashing identity would tie on every key. False when one does not (reported).
    fn members_fit(
        &mut self,
        protocol: Option<Protocol>,
        services: &[(&str, &Service)],
        members: &[Member],
    ) -> bool {
        let ident = |s: &Service| s.hash_id.clone().unwrap_or_else(|| s.address.to_string());
        let mut ok = true;
        for (k, m) in members.iter().enumerate() {
            let (sname, svc) = services[m.index];
            if let Some(p) = protocol
                && !protocols_fit(p, svc.protocol)
            {
                self.problem(
                    m.pos,
                    &m.path,
                    format!(
                        "service `{sname}` speaks {}, which a {} vserver cannot forward to",
                        svc.protocol.name(),
                        p.name()
                    ),
                );
                ok = false;
            }
            if let Some(other) = members[..k]
                .iter()
                .find(|o| ident(services[o.index].1) == ident(svc))
            {
                self.problem(
                    m.pos,
                    &m.path,
                    format!(
                        "service `{sname}` hashes like `{}` (same address or hash_id); give one a distinct hash_id",
                        services[other.index].0
                    ),
                );
                ok = false;
            }
        }
        ok
    }

    /// The cross-field rules over a vserver's fields as read: method against protocol, the
    /// token rule against method and protocol, slow start against method, and the fields
    /// that apply to some methods or protocols only. Each is reported at the field to change.
    fn vserver_rules(&mut self, f: &Fields, path: &str, v: &VserverFields) {
        if let (Some(m), Some(p), Some(n)) = (v.method, v.protocol, f.get("method")) {
            self.method_fits_protocol(n, &join(path, "method"), m, p);
        }
        let token = v.hash.token.as_ref().and_then(|t| t.as_ref());
        self.token_fits(f, path, (v.method, v.protocol), token);
        if let (Some(m), Some(Some(_)), Some(n)) = (v.method, &v.slow_start, f.get("slow_start"))
            && m.is_hash()
        {
            self.problem(
                n.pos,
                &join(path, "slow_start"),
                format!(
                    "slow start applies to non-hash methods only, not {} (docs/slow_start.md)",
                    m.name()
                ),
            );
        }
        self.fields_apply(f, path, v.method, v.protocol);
    }

    /// Methods that read a Call-ID or a request URL need a protocol that has one.
    fn method_fits_protocol(&mut self, n: &Node, mp: &str, m: Method, p: Protocol) {
        if m == Method::CallIdHash && !p.is_sip() {
            self.problem(
                n.pos,
                mp,
                format!(
                    "call_id_hash needs a SIP vserver (sip-udp, sip-tcp or sip-tls), not {}",
                    p.name()
                ),
            );
        }
        if matches!(m, Method::UrlHash | Method::DomainHash) && !(p.is_sip() || p == Protocol::Http)
        {
            self.problem(
                n.pos,
                mp,
                format!(
                    "{} needs a request URL: use protocol http, sip-udp, sip-tcp or sip-tls, not {}",
                    m.name(),
                    p.name()
                ),
            );
        }
    }

    /// Method token needs a `token` rule, and only method token takes one.
    fn token_fits(
        &mut self,
        f: &Fields,
        path: &str,
        (method, protocol): (Option<Method>, Option<Protocol>),
        token: Option<&TokenRule>,
    ) {
        match (method, token, f.get("token")) {
            (Some(Method::Token), None, None) => {
                self.problem(
                    f.pos,
                    &join(path, "token"),
                    "method token needs a `token` rule ({ header: NAME } | { query: NAME } | { offset: N, length: N })",
                );
            }
            (Some(m), Some(_), Some(n)) if m != Method::Token => {
                self.problem(
                    n.pos,
                    &join(path, "token"),
                    format!("`token` is only used by method token, not {}", m.name()),
                );
            }
            (Some(Method::Token), Some(rule), Some(n)) => {
                if let Some(p) = protocol {
                    self.token_fits_protocol(n, &join(path, "token"), rule, p);
                }
            }
            _ => {}
        }
    }

    /// A header or query token needs a protocol with headers; a payload token on a stream
    /// must lie within the bytes read before choosing.
    fn token_fits_protocol(&mut self, n: &Node, tp: &str, rule: &TokenRule, p: Protocol) {
        let fits = match rule {
            TokenRule::Header(_) => p.is_sip() || p == Protocol::Http,
            TokenRule::Query(_) => p.is_sip() || p == Protocol::Http,
            TokenRule::Payload { .. } => true,
        };
        if !fits {
            self.problem(
                n.pos,
                tp,
                format!(
                    "a header or query token needs protocol http, sip-udp, sip-tcp or sip-tls, not {}",
                    p.name()
                ),
            );
        }
        // A stream vserver reads at most this much before it chooses.
        if let TokenRule::Payload { offset, length } = rule
            && !p.is_datagram()
            && offset + length > crate::http::MAX_HEAD
        {
            self.problem(
                n.pos,
                tp,
                format!(
                    "offset + length ({}) must not exceed {} on a {} vserver (the bytes read before choosing)",
                    offset + length,
                    crate::http::MAX_HEAD,
                    p.name()
                ),
            );
        }
    }

    /// Hash parameters apply to hash methods only; `advertise` and `record_route` to SIP
    /// vservers only.
    fn fields_apply(
        &mut self,
        f: &Fields,
        path: &str,
        method: Option<Method>,
        protocol: Option<Protocol>,
    ) {
        for field in [
            "hash_length",
            "netmask",
            "v6_netmask_len",
            "hash_balance_factor",
        ] {
            if let (Some(m), Some(n)) = (method, f.get(field))
                && !m.is_hash()
            {
                self.problem(
                    n.pos,
                    &join(path, field),
                    format!("`{field}` applies to hash methods only, not {}", m.name()),
                );
            }
        }
        for field in ["advertise", "record_route"] {
            if let (Some(p), Some(n)) = (protocol, f.get(field))
                && !p.is_sip()
            {
                self.problem(
                    n.pos,
                    &join(path, field),
                    format!("`{field}` applies to SIP vservers only, not {}", p.name()),
                );
            }
        }
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

/// A vserver's fields as read, before the cross-field rules; a `None` is a value that was
/// bad (and already reported).
struct VserverFields {
    name: Option<String>,
    protocol: Option<Protocol>,
    bind: Option<Vec<SocketAddr>>,
    method: Option<Method>,
    hash: HashFields,
    slow_start: Option<Option<SlowStart>>,
    advertise: Option<String>,
    record_route: Option<bool>,
    idle_timeout: Option<Duration>,
    drain_timeout: Option<Duration>,
    edge: Option<EdgeFields>,
    options: ProxyOptions,
    /// `tls` with `tls_handshake_timeout` (`Some(None)` when absent).
    tls: Option<Option<VserverTls>>,
}

/// The hashing fields as read (`token` and `hash_balance_factor` are `Some(None)` when
/// absent).
struct HashFields {
    hash_length: Option<i128>,
    netmask: Option<Ipv4Addr>,
    v6_netmask_len: Option<i128>,
    token: Option<Option<TokenRule>>,
    hash_balance_factor: Option<Option<u32>>,
}

/// The listener and forwarding options as read.
struct ProxyOptions {
    max_sessions: Option<i128>,
    workers: Option<i128>,
    transparent: Option<bool>,
    freebind: Option<bool>,
    send_proxy: Option<Option<ProxyProtocol>>,
}

/// A service a vserver lists: its index in the services, and where it is listed.
struct Member {
    index: usize,
    pos: Pos,
    path: String,
}

impl VserverFields {
    /// The vserver, when every field was good and `members` is `Some`.
    fn build(self, members: Option<Vec<usize>>) -> Option<Vserver> {
        let (h, o) = (self.hash, self.options);
        let edge = self.edge?;
        Some(Vserver {
            name: self.name?,
            protocol: self.protocol?,
            bind: self.bind?,
            method: self.method?,
            hash: HashParams {
                hash_length: h.hash_length? as usize,
                netmask: h.netmask?,
                v6_netmask_len: h.v6_netmask_len? as u8,
                token: h.token?,
                hash_balance_factor: h.hash_balance_factor?,
            },
            slow_start: self.slow_start?,
            services: members?,
            advertise: self.advertise,
            record_route: self.record_route?,
            idle_timeout: self.idle_timeout?,
            drain_timeout: self.drain_timeout?,
            draining: Vec::new(),
            allow: edge.allow,
            deny: edge.deny,
            flood: edge.flood,
            max_sessions: o.max_sessions? as usize,
            transparent: o.transparent?,
            freebind: o.freebind?,
            send_proxy: o.send_proxy?,
            workers: o.workers? as usize,
            tls: self.tls?,
        })
    }
}

/// A vserver's `allow`, `deny` and `flood`, parsed.
struct EdgeFields {
    allow: Option<Vec<Cidr>>,
    deny: Vec<Cidr>,
    flood: Option<FloodParams>,
}

/// A vserver forwards to services of its own protocol; tcp and http are the same bytes. A
/// sip-tcp or sip-tls vserver forwards to any SIP service (the transports bridge,
/// docs/sip.md); a sip-udp vserver to sip-udp services only (not yet a stream leg).
fn protocols_fit(vserver: Protocol, service: Protocol) -> bool {
    vserver == service
        || (vserver.is_sip() && service.is_sip())
        || matches!(
            (vserver, service),
            (Protocol::Tcp, Protocol::Http) | (Protocol::Http, Protocol::Tcp)
        )
}

/// `host:port` with a DNS name, IPv4 or bracketed IPv6 host and a non-zero port.
fn is_host_port(s: &str) -> bool {
    if s.parse::<SocketAddr>().is_ok_and(|a| a.port() != 0) {
        return true;
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    port.parse::<u16>().is_ok_and(|p| p != 0)
        && !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::from_str;

    const MINIMAL: &str = "services:\n  - { name: s1, address: 127.0.0.1:5071, protocol: sip-udp }\nvservers:\n  - { name: v, protocol: sip-udp, bind: 127.0.0.1:5060, services: [s1] }\n";

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
    fn problems(text: &str) -> Vec<(u32, String, String)> {
        from_str("t", text)
            .expect_err("invalid")
            .problems()
            .iter()
            .map(|p| (p.pos.line, p.path.clone(), p.message.clone()))
            .collect()
    }

    /// A null token name is a problem of its own; before, the vserver vanished from a config
    /// that `check` called valid.
    #[test]
    fn a_null_token_name_is_reported() {
        for field in ["query", "header"] {
            let text = format!(
                "services:\n  - {{ name: s1, address: 127.0.0.1:5071, protocol: http }}\nvservers:\n  - name: web\n    protocol: http\n    bind: 127.0.0.1:8080\n    method: token\n    token: {{ {field}: null }}\n    services: [s1]\n"
            );
            let p = problems(&text);
            assert_eq!(
                p,
                vec![(
                    8,
                    format!("vservers[0].token.{field}"),
                    "expected a string, found null".to_owned()
                )],
                "{field}"
            );
        }
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

    /// A payload token beyond what a stream vserver reads first is refused (it could never
    /// give a key); on udp the datagram holds it.
    #[test]
    fn a_payload_token_must_fit_the_first_bytes_on_streams() {
        let cfg = |proto: &str, offset: usize| {
            format!(
                "services:\n  - {{ name: s1, address: 127.0.0.1:5071, protocol: {proto} }}\nvservers:\n  - {{ name: v, protocol: {proto}, bind: 127.0.0.1:5060, method: token, token: {{ offset: {offset}, length: 4 }}, services: [s1] }}\n"
            )
        };
        assert!(from_str("t", &cfg("tcp", 16_380)).is_ok());
        let p = problems(&cfg("tcp", 20_000));
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].1, "vservers[0].token");
        assert!(from_str("t", &cfg("udp", 20_000)).is_ok());
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

    /// `freebind` is a bool of every protocol, off by default; a wrong type or a misspelling
    /// is reported at its line and column.
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
            (f.limit, f.window_ns, f.ban_ns),
            (20, 1_000_000_000, 300_000_000_000)
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
        ] {
            let p = problems(&with(extra));
            assert_eq!(p.len(), 1, "{extra}: {p:?}");
            assert_eq!((p[0].0, p[0].1.as_str()), (4, path), "{extra}: {p:?}");
            assert!(p[0].2.contains(says), "{extra}: {p:?}");
        }
    }

    #[test]
    fn freebind_is_a_bool_off_by_default() {
        assert!(!from_str("t", MINIMAL).expect("valid").vservers[0].freebind);
        for proto in ["sip-udp", "sip-tcp", "udp", "tcp", "http"] {
            let text = MINIMAL
                .replace("sip-udp", proto)
                .replace("services: [s1] }", "freebind: true, services: [s1] }");
            let c = from_str("t", &text).unwrap_or_else(|e| panic!("{proto}: {e}"));
            assert!(c.vservers[0].freebind, "{proto}");
        }
        let wrong = MINIMAL.replace("services: [s1] }", "freebind: yes please, services: [s1] }");
        let e = from_str("t", &wrong).expect_err("invalid");
        let p = &e.problems()[0];
        assert_eq!((p.pos.line, p.pos.col), (4, 67), "{p:?}");
        assert_eq!(p.path, "vservers[0].freebind");
        assert!(p.message.contains("expected true or false"), "{p:?}");
        let typo = MINIMAL.replace("services: [s1] }", "freebnd: true, services: [s1] }");
        let p = problems(&typo);
        assert!(p[0].2.contains("did you mean `freebind`"), "{p:?}");
    }

    /// The transports bridge: a SIP vserver of any transport takes services of any SIP
    /// protocol, and no others.
    #[test]
    fn sip_vservers_take_any_sip_service_and_no_other() {
        let bridged = MINIMAL.replace("protocol: sip-udp, bind", "protocol: sip-tcp, bind");
        from_str("t", &bridged).expect("sip-tcp over sip-udp");
        let back = MINIMAL.replace("5071, protocol: sip-udp", "5071, protocol: sip-tcp");
        from_str("t", &back).expect("sip-udp over sip-tcp");
        let udp_plain = MINIMAL.replace("5071, protocol: sip-udp", "5071, protocol: udp");
        let p = problems(&udp_plain);
        assert_eq!(p[0].1, "vservers[0].services[0]", "{p:?}");
        assert!(
            p[0].2.contains("which a sip-udp vserver cannot forward to"),
            "{p:?}"
        );
        let plain = bridged.replace("5071, protocol: sip-udp", "5071, protocol: udp");
        let p = problems(&plain);
        assert!(
            p[0].2.contains("which a sip-tcp vserver cannot forward to"),
            "{p:?}"
        );
    }

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

    #[test]
    fn masks_and_suggestions() {
        assert!(is_contiguous_mask(Ipv4Addr::new(255, 255, 255, 0)));
        assert!(is_contiguous_mask(Ipv4Addr::new(0, 0, 0, 0)));
        assert!(!is_contiguous_mask(Ipv4Addr::new(255, 0, 255, 0)));
        assert_eq!(
            suggest("hash_fingrs", LB_FIELDS.iter().copied()),
            Some("hash_fingers")
        );
        assert_eq!(suggest("zzzzzz", LB_FIELDS.iter().copied()), None);
    }

    #[test]
    fn slow_start_and_ipv6() {
        let text = "services:\n  - { name: a, address: \"[::1]:7001\", protocol: udp }\nvservers:\n  - name: v\n    protocol: udp\n    bind: [\"[::]:8000\"]\n    method: round_robin\n    slow_start: { new_service_request_rate: 25, unit: percent, increment_interval: 5s }\n    services: [a]\n";
        let c = from_str("t", text).expect("valid");
        let s = c.vservers[0].slow_start.expect("slow start");
        assert_eq!(s.unit, RateUnit::Percent);
        assert_eq!(s.increment_interval, Duration::from_secs(5));
        assert!(c.services[0].address.is_ipv6());
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
