//! `routes` and `default` of a SIP vserver (docs/routing.md): each rule's tests compiled into
//! [`crate::route::Match`], its pool's services resolved by name, every problem at its line.
//! PURE.

use super::vserver::Member;
use super::{Cx, Fields, join};
use crate::config::model::*;
use crate::config::yaml::{Node, Value};
use crate::route::{self, HeaderTest, HeaderValue, Hosts, Match, Pattern, Prefixes, Rule, Text};

const ROUTE_FIELDS: &[&str] = &[
    "name",
    "match",
    "services",
    "method",
    "reject",
    "drop",
    "normalize",
    "hash_length",
    "slow_start",
    "failover",
];

/// A rule's fields that shape its pool, given with `services` only.
const POOL_FIELDS: &[&str] = &["method", "hash_length", "slow_start", "failover"];

const MATCH_FIELDS: &[&str] = &[
    "method",
    "ruri_user",
    "ruri_host",
    "to_host",
    "from_host",
    "from_user",
    "source",
    "header",
    "local",
    "sni",
    "alpn",
    "host",
    "path_prefix",
];

/// The match keys each kind of vserver reads (the others mean nothing on it): SIP's are the
/// first nine of [`MATCH_FIELDS`].
const SIP_KEYS: &[&str] = MATCH_FIELDS.split_at(9).0;
const TCP_KEYS: &[&str] = &["sni", "alpn", "source", "local"];
const HTTP_KEYS: &[&str] = &["method", "host", "path_prefix", "header", "source", "local"];

/// The match keys of `p`'s vservers.
fn keys_of(p: Protocol) -> &'static [&'static str] {
    match p {
        Protocol::Tcp => TCP_KEYS,
        Protocol::Http => HTTP_KEYS,
        _ => SIP_KEYS,
    }
}

const TEXT_FIELDS: &[&str] = &["exact", "prefix", "regex"];
const HEADER_FIELDS: &[&str] = &["name", "present", "exact", "prefix", "regex"];
const REJECT_FIELDS: &[&str] = &["code", "reason"];
const DEFAULT_FIELDS: &[&str] = &["reject", "drop"];

/// A rule's pool with the services it lists, as read (for the protocol checks).
type ReadPool = (RoutePool, Vec<Member>);

/// The vserver's fields a rule's pool takes when the rule does not give its own, as read
/// (`None`: bad, reported at the vserver).
pub(super) struct PoolDefaults {
    pub(super) method: Option<Method>,
    pub(super) hash_length: Option<usize>,
    pub(super) slow_start: Option<Option<SlowStart>>,
    pub(super) failover: Option<Option<Failover>>,
}

/// The services declared (as read, and every declared name) that a rule's pool names.
type Declared<'a> = (&'a [(&'a str, &'a Service)], &'a [String]);

/// The reason phrase fulcrum gives a rejecting rule that names none (RFC 3261 §21).
fn reason_of(code: u16) -> &'static str {
    match code {
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        408 => "Request Timeout",
        410 => "Gone",
        413 => "Request Entity Too Large",
        414 => "Request-URI Too Long",
        415 => "Unsupported Media Type",
        416 => "Unsupported URI Scheme",
        420 => "Bad Extension",
        421 => "Extension Required",
        480 => "Temporarily Unavailable",
        481 => "Call/Transaction Does Not Exist",
        482 => "Loop Detected",
        483 => "Too Many Hops",
        484 => "Address Incomplete",
        485 => "Ambiguous",
        486 => "Busy Here",
        487 => "Request Terminated",
        488 => "Not Acceptable Here",
        491 => "Request Pending",
        493 => "Undecipherable",
        500 => "Server Internal Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Server Time-out",
        505 => "Version Not Supported",
        513 => "Message Too Large",
        600 => "Busy Everywhere",
        603 => "Decline",
        604 => "Does Not Exist Anywhere",
        606 => "Not Acceptable",
        _ => "Rejected",
    }
}

impl Cx {
    /// Whether the vserver's `default` refuses (`reject` or `drop`), so its own `services`
    /// may be empty. Read before the services are resolved; problems are reported later.
    pub(super) fn default_refuses(f: &Fields) -> bool {
        f.get("default")
            .is_some_and(|n| matches!(&n.value, Value::Map(e) if !e.is_empty()))
    }

    /// `routes` and `default`: `Some((None, []))` when neither is given; `None` when one is bad
    /// (reported).
    pub(super) fn routes(
        &mut self,
        f: &Fields,
        path: &str,
        protocol: Option<Protocol>,
        declared: Declared<'_>,
        inherited: &PoolDefaults,
    ) -> Option<(Option<route::Routes>, Vec<RoutePool>)> {
        let services = declared.0;
        let (read, pools) = self.routes_read(f, path, protocol, declared, inherited)?;
        let mut ok = read.is_some();
        for (_, members) in &pools {
            ok &= self.members_fit(protocol, services, members);
        }
        let pools = pools.into_iter().map(|(p, _)| p).collect();
        ok.then_some((read?, pools))
    }

    fn routes_read(
        &mut self,
        f: &Fields,
        path: &str,
        protocol: Option<Protocol>,
        declared: Declared<'_>,
        inherited: &PoolDefaults,
    ) -> Option<(Option<Option<route::Routes>>, Vec<ReadPool>)> {
        let (list, default) = (f.get("routes"), f.get("default"));
        if list.is_none() && default.is_none() {
            return Some((Some(None), Vec::new()));
        }
        if let Some(p) = protocol
            && !(p.is_sip() || matches!(p, Protocol::Tcp | Protocol::Http))
        {
            let (n, name) = match list {
                Some(n) => (n, "routes"),
                None => (default?, "default"),
            };
            self.problem(
                n.pos,
                &join(path, name),
                format!(
                    "routing rules apply to SIP, tcp and http vservers, not {} (docs/routing.md)",
                    p.name()
                ),
            );
            return None;
        }
        let mut ok = true;
        let mut rules: Vec<Rule> = Vec::new();
        let mut pools: Vec<ReadPool> = Vec::new();
        let rp = join(path, "routes");
        let items = list.map_or(&[][..], |n| self.seq(n, &rp));
        let mut unconditional: Option<String> = None;
        let mut names: Vec<(String, u32)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let at = format!("{rp}[{i}]");
            if let Some((name, pos)) = super::item_name(item) {
                match names.iter().find(|(n, _)| *n == name) {
                    Some((_, line)) => {
                        self.problem(
                            pos,
                            &join(&at, "name"),
                            format!("duplicate route name `{name}` (first at line {line})"),
                        );
                        ok = false;
                    }
                    None => names.push((name, pos.line)),
                }
            }
            let Some(r) = self.rule(item, &at, protocol, declared, inherited, pools.len() + 1)
            else {
                ok = false;
                continue;
            };
            if let Some(u) = &unconditional {
                self.warning(
                    item.pos,
                    &at,
                    format!(
                        "route `{}` can never match: route `{u}` before it matches every request",
                        r.0.name
                    ),
                );
            } else if r.0.test.is_unconditional() {
                unconditional = Some(r.0.name.clone());
            }
            if let Some(p) = r.1 {
                pools.push(p);
            }
            rules.push(r.0);
        }
        let dp = join(path, "default");
        let default = match default {
            None => Some(route::Target::Pool(0)),
            Some(n) if matches!(&n.value, Value::Str(s) if s == "pool") => {
                Some(route::Target::Pool(0))
            }
            Some(n) => self.refusal(n, &dp, DEFAULT_FIELDS, protocol),
        };
        let timeout = self.client_hello_timeout(f, path, protocol, (&rules, ok));
        ok &= timeout.is_some();
        let routes = default.map(|default| route::Routes {
            rules,
            default,
            client_hello_timeout: timeout.unwrap_or(route::CLIENT_HELLO_TIMEOUT),
        });
        Some(((ok && routes.is_some()).then_some(routes), pools))
    }

    /// `client_hello_timeout`: on a tcp vserver whose rules read `sni` or `alpn` (without
    /// `tls`: with it, the handshake's own timeout bounds the wait); `None` when bad.
    fn client_hello_timeout(
        &mut self,
        f: &Fields,
        path: &str,
        protocol: Option<Protocol>,
        (rules, all_read): (&[Rule], bool),
    ) -> Option<std::time::Duration> {
        let Some(n) = f.get("client_hello_timeout") else {
            return Some(route::CLIENT_HELLO_TIMEOUT);
        };
        let p = join(path, "client_hello_timeout");
        // A rule that did not read (reported) may be one that reads the hello.
        let reads = !all_read
            || rules
                .iter()
                .any(|r| r.test.sni.is_some() || r.test.alpn.is_some());
        if protocol != Some(Protocol::Tcp) || !reads || f.get("tls").is_some() {
            self.problem(
                n.pos,
                &p,
                "`client_hello_timeout` applies to a tcp vserver without `tls` whose routes read `sni` or `alpn`",
            );
            return None;
        }
        let d = self.duration(n, &p, false)?;
        if d.is_zero() || d > std::time::Duration::from_secs(60) {
            self.problem(n.pos, &p, "must be between 1ms and 60s");
            return None;
        }
        Some(d)
    }

    /// One rule and, when it has one, its pool (number `pool`).
    fn rule(
        &mut self,
        node: &Node,
        path: &str,
        protocol: Option<Protocol>,
        (services, services_declared): Declared<'_>,
        inherited: &PoolDefaults,
        pool: usize,
    ) -> Option<(Rule, Option<ReadPool>)> {
        let f = self.fields(node, path, ROUTE_FIELDS)?;
        let name = self
            .required(&f, path, "name")
            .and_then(|n| self.string(n, &join(path, "name")));
        let normalize = self.bool_field(&f, path, "normalize", false);
        if let (Some(n), Some(p)) = (f.get("normalize"), protocol)
            && !p.is_sip()
        {
            self.problem(
                n.pos,
                &join(path, "normalize"),
                format!(
                    "`normalize` reads a SIP Request-URI's number: it means nothing on {}",
                    p.name()
                ),
            );
            return None;
        }
        let test = match self.required(&f, path, "match") {
            Some(n) => self.test(
                n,
                &join(path, "match"),
                normalize.unwrap_or(false),
                protocol,
            ),
            None => None,
        };
        let given: Vec<&str> = ["services", "reject", "drop"]
            .into_iter()
            .filter(|k| f.get(k).is_some())
            .collect();
        if given.len() != 1 {
            self.problem(
                node.pos,
                path,
                "give exactly one of `services` (a pool), `reject` or `drop: true`",
            );
            return None;
        }
        if given[0] != "services" {
            let mut pool_field = false;
            for k in POOL_FIELDS {
                if let Some(n) = f.get(k) {
                    let why = if *k == "method" {
                        "chooses within a pool"
                    } else {
                        "shapes a pool"
                    };
                    self.problem(
                        n.pos,
                        &join(path, k),
                        format!("`{k}` {why}: give it with `services` only"),
                    );
                    pool_field = true;
                }
            }
            if pool_field {
                return None;
            }
        }
        let method = match f.get("method") {
            Some(n) => self
                .choice(n, &join(path, "method"), &Method::ALL)
                .map(Some),
            None => Some(None),
        };
        let shape = match (given[0], method) {
            ("services", Some(m)) => self.pool_shape(&f, path, (m, protocol), inherited),
            _ => None,
        };
        let (target, members) = match given[0] {
            "services" => {
                let members = self.pool_members(&f, path, services, services_declared)?;
                (route::Target::Pool(pool), Some(members))
            }
            "reject" => {
                let n = f.get("reject")?;
                (self.reject(n, &join(path, "reject"), protocol)?, None)
            }
            _ => {
                let n = f.get("drop")?;
                if n.value != Value::Bool(true) {
                    self.problem(n.pos, &join(path, "drop"), "write `drop: true`");
                    return None;
                }
                (route::Target::Drop, None)
            }
        };
        let name = name?;
        let pool = match members {
            Some(m) => {
                let (hash_length, slow_start, failover) = shape?;
                let p = RoutePool {
                    route: name.clone(),
                    services: m.iter().map(|m| m.index).collect(),
                    method: method.flatten(),
                    hash_length,
                    slow_start,
                    failover,
                };
                Some((p, m))
            }
            None => None,
        };
        if let (Some(Some(m)), Some(n), Some(p)) = (method, f.get("method"), protocol) {
            let known = self.problems.len();
            self.method_fits_protocol(n, &join(path, "method"), m, p);
            if m == Method::Token {
                self.problem(
                    n.pos,
                    &join(path, "method"),
                    "a route's pool takes the vserver's `token` rule: give method token on the vserver",
                );
            }
            if self.problems.len() > known {
                return None;
            }
        }
        Some((
            Rule {
                name,
                test: test?,
                target,
            },
            pool,
        ))
    }

    /// A rule pool's `hash_length`, `slow_start` and `failover`, read as a vserver reads its
    /// own; each the vserver's where the rule gives none. Each given field must fit the pool's
    /// method (`method`, else the vserver's), as on a vserver.
    fn pool_shape(
        &mut self,
        f: &Fields,
        path: &str,
        (method, protocol): (Option<Method>, Option<Protocol>),
        inherited: &PoolDefaults,
    ) -> Option<(usize, Option<SlowStart>, Option<Failover>)> {
        let m = method.or(inherited.method);
        let hash_length = match f.get("hash_length") {
            None => inherited.hash_length,
            Some(n) => {
                let at = join(path, "hash_length");
                let l = self.int_in(n, &at, 1, 4096);
                if let Some(m) = m.filter(|m| !m.is_hash()) {
                    self.problem(
                        n.pos,
                        &at,
                        format!(
                            "`hash_length` applies to hash methods only, not {}",
                            m.name()
                        ),
                    );
                    return None;
                }
                l.and_then(|l| usize::try_from(l).ok())
            }
        };
        let slow_start = match f.get("slow_start") {
            None => inherited.slow_start,
            Some(n) => {
                let at = join(path, "slow_start");
                let s = self.slow_start(n, &at);
                if let Some(m) = m.filter(|m| m.is_hash()) {
                    self.problem(
                        n.pos,
                        &at,
                        format!(
                            "slow start applies to non-hash methods only, not {} (docs/slow_start.md)",
                            m.name()
                        ),
                    );
                    return None;
                }
                s.map(Some)
            }
        };
        let failover = match f.get("failover") {
            None => inherited.failover.clone(),
            Some(n) if protocol.is_some_and(|p| !p.is_sip()) => {
                self.problem(
                    n.pos,
                    &join(path, "failover"),
                    "`failover` holds SIP requests for another try; a tcp or http connection that cannot connect moves on within its pool without it",
                );
                None
            }
            // Read as the vserver's field.
            Some(_) => self.failover_field(f, path, protocol),
        };
        Some((hash_length?, slow_start?, failover?))
    }

    /// A rule pool's `services`, each declared once; at least one.
    fn pool_members(
        &mut self,
        f: &Fields,
        path: &str,
        services: &[(&str, &Service)],
        services_declared: &[String],
    ) -> Option<Vec<Member>> {
        let list = f.get("services")?;
        let sp = join(path, "services");
        let items = self.seq(list, &sp);
        if items.is_empty() {
            self.problem(list.pos, &sp, "a route's pool needs at least one service");
            return None;
        }
        let (out, ok) = self.resolve_services(items, &sp, services, services_declared);
        ok.then_some(out)
    }

    /// `reject: { code, reason }`: a SIP final answer (400-699), an HTTP response (400-599);
    /// a tcp vserver has no answer to give (`drop` closes the connection).
    fn reject(
        &mut self,
        node: &Node,
        path: &str,
        protocol: Option<Protocol>,
    ) -> Option<route::Target> {
        if protocol == Some(Protocol::Tcp) {
            self.problem(
                node.pos,
                path,
                "a tcp vserver has no answer to send: write `drop: true` to close the connection",
            );
            return None;
        }
        let f = self.fields(node, path, REJECT_FIELDS)?;
        let top = if protocol == Some(Protocol::Http) {
            599
        } else {
            699
        };
        let code = self
            .required(&f, path, "code")
            .and_then(|n| self.int_in(n, &join(path, "code"), 400, top))?;
        let code = u16::try_from(code).ok()?;
        let reason = match f.get("reason") {
            None => reason_of(code).to_owned(),
            Some(n) => {
                let r = self.string(n, &join(path, "reason"))?;
                if r.bytes().any(|c| c == b'\r' || c == b'\n') {
                    self.problem(n.pos, &join(path, "reason"), "a reason phrase is one line");
                    return None;
                }
                r
            }
        };
        Some(route::Target::Reject { code, reason })
    }

    /// `default: { reject: {...} }` or `{ drop: true }`.
    fn refusal(
        &mut self,
        node: &Node,
        path: &str,
        allowed: &[&str],
        protocol: Option<Protocol>,
    ) -> Option<route::Target> {
        if let Value::Str(s) = &node.value {
            self.problem(
                node.pos,
                path,
                format!("expected `pool`, `{{ reject: {{ code, reason }} }}` or `{{ drop: true }}`, found `{s}`"),
            );
            return None;
        }
        let f = self.fields(node, path, allowed)?;
        match (f.get("reject"), f.get("drop")) {
            (Some(n), None) => self.reject(n, &join(path, "reject"), protocol),
            (None, Some(n)) if n.value == Value::Bool(true) => Some(route::Target::Drop),
            _ => {
                self.problem(
                    node.pos,
                    path,
                    "give exactly one of `reject: { code, reason }` or `drop: true`",
                );
                None
            }
        }
    }

    /// A rule's `match`: every key compiled; a key given a list matches any of its items.
    fn test(
        &mut self,
        node: &Node,
        path: &str,
        normalize: bool,
        protocol: Option<Protocol>,
    ) -> Option<Match> {
        let f = self.fields(node, path, MATCH_FIELDS)?;
        let mut ok = true;
        if let Some(p) = protocol {
            let keys = keys_of(p);
            for (key, n) in f.entries {
                let key = key.name.as_str();
                if !keys.contains(&key) {
                    self.problem(
                        n.pos,
                        &join(path, key),
                        format!(
                            "`{key}` means nothing on {} vservers; their keys: {}",
                            p.name(),
                            keys.join(", ")
                        ),
                    );
                    ok = false;
                }
            }
        }
        let http = protocol == Some(Protocol::Http);
        let mut m = Match {
            normalize,
            ..Match::default()
        };
        if let Some(n) = f.get("method") {
            let p = join(path, "method");
            let names = self.strings(n, &p);
            match names {
                Some(v) if v.iter().all(|s| is_token(s)) => {
                    m.methods = Some(v.into_iter().map(String::into_bytes).collect());
                }
                Some(_) => {
                    let example = if http {
                        "GET (RFC 9110 §9.1)"
                    } else {
                        "INVITE (RFC 3261 §25.1)"
                    };
                    self.problem(n.pos, &p, format!("a method is a token such as {example}"));
                    ok = false;
                }
                None => ok = false,
            }
        }
        for (key, slot) in [("sni", &mut m.sni), ("host", &mut m.host)] {
            if let Some(n) = f.get(key) {
                match self.hosts(n, &join(path, key)) {
                    Some(h) => *slot = Some(h),
                    None => ok = false,
                }
            }
        }
        if let Some(n) = f.get("alpn") {
            let p = join(path, "alpn");
            let mut list: Vec<Vec<u8>> = Vec::new();
            for (i, s) in self.strings_at(n, &p).into_iter().enumerate() {
                match s {
                    // RFC 7301 §3.1: a ProtocolName is 1 to 255 bytes.
                    Some((name, _)) if (1..=255).contains(&name.len()) => {
                        if !list.contains(&name.clone().into_bytes()) {
                            list.push(name.into_bytes());
                        }
                    }
                    Some((_, pos)) => {
                        self.problem(
                            pos,
                            &format!("{p}[{i}]"),
                            "an ALPN protocol name is 1 to 255 bytes (RFC 7301 §3.1), e.g. h2",
                        );
                        ok = false;
                    }
                    None => ok = false,
                }
            }
            m.alpn = Some(list);
        }
        if let Some(n) = f.get("path_prefix") {
            let p = join(path, "path_prefix");
            match self
                .strings_at(n, &p)
                .into_iter()
                .collect::<Option<Vec<_>>>()
            {
                Some(v) => {
                    if let Some((bad, pos)) = v.iter().find(|(s, _)| !s.starts_with('/')) {
                        self.problem(
                            *pos,
                            &p,
                            format!("`{bad}` is not a path: a path prefix starts with `/`"),
                        );
                        ok = false;
                    }
                    m.path_prefix = Some(Prefixes::new(v.iter().map(|(s, _)| s.as_bytes())));
                }
                None => ok = false,
            }
        }
        if let Some(n) = f.get("ruri_user") {
            match self.text(n, &join(path, "ruri_user"), normalize) {
                Some(t) => m.ruri_user = Some(t),
                None => ok = false,
            }
        }
        for (key, slot) in [
            ("ruri_host", &mut m.ruri_host),
            ("to_host", &mut m.to_host),
            ("from_host", &mut m.from_host),
        ] {
            if let Some(n) = f.get(key) {
                match self.hosts(n, &join(path, key)) {
                    Some(h) => *slot = Some(h),
                    None => ok = false,
                }
            }
        }
        if let Some(n) = f.get("from_user") {
            let p = join(path, "from_user");
            let fields = match &n.value {
                Value::Map(_) => self.fields(n, &p, &["prefix"]),
                _ => None,
            };
            let list = match fields {
                Some(ff) => ff
                    .get("prefix")
                    .and_then(|x| self.strings(x, &join(&p, "prefix"))),
                None if matches!(&n.value, Value::Map(_)) => None,
                None => self.strings(n, &p),
            };
            match list {
                Some(v) => m.from_user = Some(Prefixes::new(v.iter().map(|s| s.as_bytes()))),
                None => ok = false,
            }
        }
        if let Some(n) = f.get("source") {
            let p = join(path, "source");
            let mut cidrs = Vec::new();
            for (i, s) in self.strings_at(n, &p).into_iter().enumerate() {
                match s {
                    Some((text, pos)) => match crate::acl::Cidr::parse(&text) {
                        Ok(c) => cidrs.push(c),
                        Err(e) => {
                            self.problem(pos, &format!("{p}[{i}]"), e.to_string());
                            ok = false;
                        }
                    },
                    None => ok = false,
                }
            }
            m.source = Some(cidrs);
        }
        if let Some(n) = f.get("local") {
            let p = join(path, "local");
            let mut locals = Vec::new();
            for (i, s) in self.strings_at(n, &p).into_iter().enumerate() {
                let Some((text, pos)) = s else {
                    ok = false;
                    continue;
                };
                let t = text.trim();
                let l = match (
                    t.parse::<std::net::IpAddr>(),
                    t.parse::<std::net::SocketAddr>(),
                ) {
                    (Ok(ip), _) => Some(route::Local { ip, port: None }),
                    (_, Ok(a)) => Some(route::Local {
                        ip: a.ip(),
                        port: Some(a.port()),
                    }),
                    _ => None,
                };
                match l {
                    Some(l) => locals.push(l),
                    None => {
                        self.problem(
                            pos,
                            &format!("{p}[{i}]"),
                            format!("`{t}` is not IP or IP:PORT (IPv6 as [ADDR]:PORT)"),
                        );
                        ok = false;
                    }
                }
            }
            m.local = Some(locals);
        }
        if let Some(n) = f.get("header") {
            let p = join(path, "header");
            let items: Vec<(&Node, String)> = match &n.value {
                Value::Seq(items) => items
                    .iter()
                    .enumerate()
                    .map(|(i, x)| (x, format!("{p}[{i}]")))
                    .collect(),
                _ => vec![(n, p.clone())],
            };
            for (x, at) in items {
                match self.header_test(x, &at) {
                    // HTTP has no compact header names (RFC 9110 §5.1).
                    Some(h) if http => m.headers.push(HeaderTest { alias: None, ..h }),
                    Some(h) => m.headers.push(h),
                    None => ok = false,
                }
            }
        }
        ok.then_some(m)
    }

    /// One `header` test: `name` and one of `present`, `exact`, `prefix`, `regex`.
    fn header_test(&mut self, node: &Node, path: &str) -> Option<HeaderTest> {
        let f = self.fields(node, path, HEADER_FIELDS)?;
        let name = self
            .required(&f, path, "name")
            .and_then(|n| self.string(n, &join(path, "name")))?;
        if !is_token(&name) {
            self.problem(
                node.pos,
                &join(path, "name"),
                format!("`{name}` is not a header name"),
            );
            return None;
        }
        let kinds: Vec<&str> = ["present", "exact", "prefix", "regex"]
            .into_iter()
            .filter(|k| f.get(k).is_some())
            .collect();
        let test = match kinds.as_slice() {
            ["present"] => HeaderValue::Present(self.bool_field(&f, path, "present", true)?),
            [_, ..] if !kinds.contains(&"present") => {
                HeaderValue::Text(self.text_fields(&f, path, false)?)
            }
            _ => {
                self.problem(
                    node.pos,
                    path,
                    "give `present`, or any of `exact`, `prefix`, `regex`",
                );
                return None;
            }
        };
        Some(HeaderTest {
            alias: route::alias_of(&name),
            name,
            test,
        })
    }

    /// A text test: a string or list (exact values), or a map of `exact`, `prefix`, `regex`.
    fn text(&mut self, node: &Node, path: &str, normalize: bool) -> Option<Text> {
        match &node.value {
            Value::Map(_) => {
                let f = self.fields(node, path, TEXT_FIELDS)?;
                if f.entries.is_empty() {
                    self.problem(node.pos, path, "give any of `exact`, `prefix`, `regex`");
                    return None;
                }
                self.text_fields(&f, path, normalize)
            }
            _ => {
                let v = self.strings(node, path)?;
                Some(Text {
                    exact: v.into_iter().map(|s| norm(&s, normalize)).collect(),
                    ..Text::default()
                })
            }
        }
    }

    fn text_fields(&mut self, f: &Fields, path: &str, normalize: bool) -> Option<Text> {
        let mut t = Text::default();
        let mut ok = true;
        if let Some(n) = f.get("exact") {
            match self.strings(n, &join(path, "exact")) {
                Some(v) => t.exact = v.iter().map(|s| norm(s, normalize)).collect(),
                None => ok = false,
            }
        }
        if let Some(n) = f.get("prefix") {
            match self.strings(n, &join(path, "prefix")) {
                Some(v) => {
                    let v: Vec<Vec<u8>> = v.iter().map(|s| norm(s, normalize)).collect();
                    t.prefix = Some(Prefixes::new(v.iter().map(Vec::as_slice)));
                }
                None => ok = false,
            }
        }
        if let Some(n) = f.get("regex") {
            let p = join(path, "regex");
            for (i, s) in self.strings_at(n, &p).into_iter().enumerate() {
                let Some((src, pos)) = s else {
                    ok = false;
                    continue;
                };
                match Pattern::new(&src) {
                    Ok(re) => t.regex.push(re),
                    Err(e) => {
                        let at = if matches!(n.value, Value::Seq(_)) {
                            format!("{p}[{i}]")
                        } else {
                            p.clone()
                        };
                        // The crate's message spans lines (the pattern, a caret); one line here.
                        let e = e.split_whitespace().collect::<Vec<_>>().join(" ");
                        self.problem(pos, &at, format!("bad regex: {e}"));
                        ok = false;
                    }
                }
            }
        }
        ok.then_some(t)
    }

    /// Host names: a string or list, each a host or `*.suffix`.
    fn hosts(&mut self, node: &Node, path: &str) -> Option<Hosts> {
        let mut h = Hosts::default();
        let mut ok = true;
        for (i, s) in self.strings_at(node, path).into_iter().enumerate() {
            let Some((name, pos)) = s else {
                ok = false;
                continue;
            };
            if !h.add(&name) {
                self.problem(
                    pos,
                    &format!("{path}[{i}]"),
                    format!("`{name}` is not a host name or `*.suffix`"),
                );
                ok = false;
            }
        }
        ok.then_some(h)
    }

    /// A string or a list of strings.
    fn strings(&mut self, node: &Node, path: &str) -> Option<Vec<String>> {
        self.strings_at(node, path)
            .into_iter()
            .map(|s| s.map(|(s, _)| s))
            .collect()
    }

    /// A string or a list of strings, each with its position (`None` where one is bad,
    /// reported).
    fn strings_at(
        &mut self,
        node: &Node,
        path: &str,
    ) -> Vec<Option<(String, crate::config::yaml::Pos)>> {
        match &node.value {
            Value::Seq(items) if items.is_empty() => {
                self.problem(node.pos, path, "must not be an empty list");
                vec![None]
            }
            Value::Seq(items) => items
                .iter()
                .enumerate()
                .map(|(i, x)| self.string(x, &format!("{path}[{i}]")).map(|s| (s, x.pos)))
                .collect(),
            _ => vec![self.string(node, path).map(|s| (s, node.pos))],
        }
    }
}

/// A configured number (`normalize: true`) or text, as bytes.
fn norm(s: &str, normalize: bool) -> Vec<u8> {
    if normalize {
        let mut out = Vec::new();
        route::normalize_number(s.as_bytes(), &mut out);
        out
    } else {
        s.as_bytes().to_vec()
    }
}

/// An RFC 3261 §25.1 token (method and header names).
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes().all(|c| {
            c.is_ascii_alphanumeric()
                || matches!(
                    c,
                    b'-' | b'.' | b'!' | b'%' | b'*' | b'_' | b'+' | b'`' | b'\'' | b'~'
                )
        })
}

#[cfg(test)]
mod tests {
    use crate::config::{Failover, Method, from_str};
    use std::time::Duration;

    fn sip(vserver: &str, rule: &str) -> String {
        format!(
            "services:\n  - {{ name: p, address: 127.0.0.1:5071, protocol: sip-udp }}\n  - {{ name: g, address: 127.0.0.1:5081, protocol: sip-udp }}\nvservers:\n  - name: v\n    protocol: sip-udp\n    bind: 127.0.0.1:5060\n{vserver}    services: [p]\n    routes:\n      - {{ name: r, match: {{ method: INVITE }}, services: [g]{rule} }}\n"
        )
    }

    /// A rule's pool takes the vserver's `hash_length`, `slow_start` and `failover` unless
    /// it gives its own, read as the vserver reads them (a map's absent fields: defaults).
    #[test]
    fn a_pool_takes_the_vservers_fields_unless_it_gives_its_own() {
        let vserver = "    method: round_robin\n    slow_start: { new_service_request_rate: 3 }\n    failover: { codes: [503], tries: 2 }\n";
        let c = from_str("t", &sip(vserver, "")).expect("valid");
        let (v, p) = (&c.vservers[0], &c.vservers[0].route_pools[0]);
        assert_eq!(
            (p.hash_length, p.slow_start, &p.failover),
            (80, v.slow_start, &v.failover)
        );
        assert!(v.slow_start.is_some() && v.failover.is_some());
        let hashed = "    method: domain_hash\n    hash_length: 40\n";
        let c = from_str("t", &sip(hashed, "")).expect("valid");
        assert_eq!(c.vservers[0].route_pools[0].hash_length, 40);
        let c = from_str(
            "t",
            &sip(
                vserver,
                ", method: url_hash, hash_length: 12, failover: { tries: 4 }",
            ),
        )
        .expect("valid");
        let p = &c.vservers[0].route_pools[0];
        assert_eq!(p.method, Some(Method::UrlHash));
        assert_eq!(p.hash_length, 12);
        assert_eq!(
            p.failover,
            Some(Failover {
                tries: 4,
                ..Failover::default()
            })
        );
        let c = from_str(
            "t",
            &sip(
                vserver,
                ", failover: off, slow_start: { new_service_request_rate: 9, increment_interval: 5s }",
            ),
        )
        .expect("valid");
        let p = &c.vservers[0].route_pools[0];
        assert_eq!(p.failover, None);
        let s = p.slow_start.expect("its own");
        assert_eq!(
            (s.new_service_request_rate, s.increment_interval),
            (9, Duration::from_secs(5))
        );
        // The vserver's failover off: a rule may still turn its own on.
        let c = from_str("t", &sip("    failover: off\n", ", failover: on")).expect("valid");
        assert_eq!(c.vservers[0].failover, None);
        assert_eq!(
            c.vservers[0].route_pools[0].failover,
            Some(Failover::default())
        );
    }
}
