//! `vservers[]`: a listener's fields group by group, its services resolved by name, and
//! the rules across fields (method against protocol, token, slow start, members). PURE.

use super::edge::EdgeFields;
use super::{Cx, Fields, did_you_mean, join, parse_socket_addr};
use crate::config::model::*;
use crate::config::yaml::{Node, Pos, Value};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

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
    "aor_key",
    "slow_start",
    "services",
    "advertise",
    "service_source",
    "record_route",
    "path",
    "allowed_origins",
    "idle_timeout",
    "drain_timeout",
    "allow",
    "deny",
    "flood",
    "failover",
    "eject",
    "max_sessions",
    "max_per_source",
    "transparent",
    "freebind",
    "send_proxy",
    "kernel_relay",
    "workers",
    "tls",
    "tls_handshake_timeout",
    "interface",
    "sticky",
    "routes",
    "default",
    "client_hello_timeout",
];

const FAILOVER_FIELDS: &[&str] = &[
    "codes",
    "no_answer",
    "no_answer_non_invite",
    "tries",
    "max_pending",
    "max_pending_bytes",
];

const SLOW_START_FIELDS: &[&str] = &["new_service_request_rate", "unit", "increment_interval"];

const TOKEN_FIELDS: &[&str] = &["header", "query", "offset", "length"];

/// True when `mask` is a run of ones followed by zeros.
fn is_contiguous_mask(mask: Ipv4Addr) -> bool {
    let m = u32::from(mask);
    m.leading_ones() + m.trailing_zeros() == 32
}

fn default_idle_timeout(protocol: Protocol) -> Duration {
    match protocol {
        // Dialog affinity lives as long as a long call (docs/config.md, Defaults worth a reason).
        Protocol::SipUdp
        | Protocol::SipTcp
        | Protocol::SipTls
        | Protocol::SipWs
        | Protocol::SipWss => Duration::from_secs(3600),
        // nginx stream / Envoy UDP proxy default idle timeouts are about a minute. A packet
        // vserver keeps no sessions of its own; the value is never read there.
        Protocol::Udp | Protocol::Ip => Duration::from_secs(60),
        Protocol::Tcp | Protocol::Http => Duration::from_secs(600),
    }
}

impl Cx {
    /// A vserver: its fields read group by group, its services resolved, then the
    /// cross-field rules ([`Cx::vserver_rules`], [`Cx::members_fit`]) over what was read.
    pub(super) fn vserver(
        &mut self,
        node: &Node,
        path: &str,
        services: &[(&str, &Service)],
        services_declared: &[String],
    ) -> Option<Vserver> {
        let f = self.fields(node, path, VSERVER_FIELDS)?;
        let v = self.vserver_fields(&f, path);
        let may_be_empty = Cx::default_refuses(&f);
        let (members, listed_ok) =
            self.members(&f, path, services, services_declared, may_be_empty);
        let members_fit = self.members_fit(v.protocol, services, &members);
        self.vserver_rules(&f, path, &v);
        let inherited = super::routes::PoolDefaults {
            method: v.method,
            hash_length: v.hash.hash_length.and_then(|l| usize::try_from(l).ok()),
            slow_start: v.slow_start,
            failover: v.failover.clone(),
        };
        let routes = self.routes(
            &f,
            path,
            v.protocol,
            (services, services_declared),
            &inherited,
        );
        let mut discovered: Vec<Protocol> = Vec::new();
        for m in &members {
            let s = services[m.index].1;
            if s.dns.is_some() && !discovered.contains(&s.protocol) {
                discovered.push(s.protocol);
            }
        }
        let members = members.iter().map(|m| m.index).collect();
        let mut v = v.build((listed_ok && members_fit).then_some((members, discovered)))?;
        (v.routes, v.route_pools) = routes?;
        Some(v)
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
        let is_packet = protocol.is_some_and(Protocol::is_packet);
        let bind = if is_packet {
            // Reported with the other fields a packet vserver cannot use.
            Some(Vec::new())
        } else {
            self.required(f, path, "bind")
                .and_then(|n| self.bind_list(n, &join(path, "bind")))
        };
        let method = match (f.get("method"), protocol) {
            (Some(n), _) => self.choice(n, &join(path, "method"), &Method::ALL),
            (None, Some(p)) if p.is_sip() => Some(Method::CallIdHash),
            (None, Some(Protocol::Ip)) => Some(Method::SourceDestIpHash),
            (None, _) => Some(Method::LeastConnection),
        };
        let (idle_timeout, drain_timeout) = self.timeouts(f, path, protocol);
        let tls = self.vserver_tls_fields(f, path, protocol);
        let (interfaces, sticky) = self.packet_fields(f, path, protocol);
        VserverFields {
            tls,
            interfaces,
            sticky,
            name,
            protocol,
            bind,
            method,
            hash: self.hash_fields(f, path),
            slow_start: self.optional(f, path, "slow_start", Cx::slow_start),
            advertise: self.advertise(f, path),
            service_source: self.service_source(f, path, protocol),
            record_route: self.bool_field(f, path, "record_route", false),
            allowed_origins: match f.get("allowed_origins") {
                None => Some(None),
                Some(n) => {
                    let p = join(path, "allowed_origins");
                    let items: Vec<Option<String>> = self
                        .seq(n, &p)
                        .iter()
                        .enumerate()
                        .map(|(i, item)| self.string(item, &format!("{p}[{i}]")))
                        .collect();
                    items.into_iter().collect::<Option<Vec<String>>>().map(Some)
                }
            },
            path_mode: match f.get("path") {
                None => Some(PathMode::Auto),
                // `off` reads as a boolean in YAML 1.1.
                Some(n) if matches!(n.value, Value::Bool(false)) => Some(PathMode::Off),
                Some(n) => self.choice(n, &join(path, "path"), &PathMode::ALL),
            },
            failover: self.failover_field(f, path, protocol),
            idle_timeout,
            drain_timeout,
            edge: self.edge_fields(f, path),
            eject: self.eject_field(f, path),
            options: self.proxy_options(f, path, protocol),
        }
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

    pub(super) fn slow_start(&mut self, node: &Node, path: &str) -> Option<SlowStart> {
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
            aor_key: match f.get("aor_key") {
                None => Some(AorKey::Uri),
                Some(n) => self.choice(
                    n,
                    &join(path, "aor_key"),
                    &[("uri", AorKey::Uri), ("user", AorKey::User)],
                ),
            },
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

    /// `service_source: IP[:PORT]` (`Some(None)` when absent; port 0 when not given: the
    /// vserver's own). sip-udp only: a stream service answers on the connection fulcrum
    /// opened, whatever its Via says.
    fn service_source(
        &mut self,
        f: &Fields,
        path: &str,
        protocol: Option<Protocol>,
    ) -> Option<Option<SocketAddr>> {
        let Some(node) = f.get("service_source") else {
            return Some(None);
        };
        let p = join(path, "service_source");
        if let Some(pr) = protocol
            && !pr.is_sip()
        {
            self.problem(
                node.pos,
                &p,
                format!(
                    "`service_source` applies to SIP vservers only, not {}",
                    pr.name()
                ),
            );
            return None;
        }
        let s = self.string(node, &p)?;
        let addr = match s.trim().parse::<std::net::IpAddr>() {
            Ok(ip) => Some(SocketAddr::new(ip, 0)),
            Err(_) => s.trim().parse::<SocketAddr>().ok(),
        };
        match addr {
            Some(a) if a.ip().is_unspecified() || a.ip().is_multicast() => {
                self.problem(
                    node.pos,
                    &p,
                    format!("`{s}` is not a unicast address of this instance"),
                );
                None
            }
            Some(a) => Some(Some(a)),
            None => {
                self.problem(
                    node.pos,
                    &p,
                    format!("`{s}` is not IP or IP:PORT (IPv6 as [ADDR]:PORT)"),
                );
                None
            }
        }
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

    /// `failover`: on by default on SIP vservers, `off`, or a map whose absent fields take
    /// their defaults; nothing on other protocols (where the field is reported).
    pub(super) fn failover_field(
        &mut self,
        f: &Fields,
        path: &str,
        protocol: Option<Protocol>,
    ) -> Option<Option<Failover>> {
        let p = join(path, "failover");
        let node = match f.get("failover") {
            None => {
                return Some(
                    protocol
                        .is_some_and(Protocol::is_sip)
                        .then(Failover::default),
                );
            }
            Some(n) => n,
        };
        // `off` reads as a boolean in YAML 1.1; `true` means the defaults.
        match &node.value {
            Value::Bool(false) => return Some(None),
            Value::Bool(true) => return Some(Some(Failover::default())),
            _ => {}
        }
        if let Value::Str(s) = &node.value {
            if s == "off" {
                return Some(None);
            }
            self.problem(
                node.pos,
                &p,
                format!(
                    "expected `off` or a map of {}, found `{s}`",
                    FAILOVER_FIELDS.join(", ")
                ),
            );
            return None;
        }
        let ff = self.fields(node, &p, FAILOVER_FIELDS)?;
        let d = Failover::default();
        let codes = match ff.get("codes") {
            None => Some(d.codes),
            Some(n) => {
                let cp = join(&p, "codes");
                let mut codes = Vec::new();
                let mut ok = true;
                for (i, c) in self.seq(n, &cp).iter().enumerate() {
                    let at = format!("{cp}[{i}]");
                    match self.int_in(c, &at, 300, 699) {
                        Some(v) => match unbreakable(v as u16) {
                            Some(why) => {
                                self.problem(c.pos, &at, format!("{v} cannot fail over: {why}"));
                                ok = false;
                            }
                            None => codes.push(v as u16),
                        },
                        None => ok = false,
                    }
                }
                ok.then_some(codes)
            }
        };
        let no_answer = match ff.get("no_answer") {
            None => Some(d.no_answer),
            Some(n) => self.duration(n, &join(&p, "no_answer"), false),
        };
        let no_answer_non_invite = match ff.get("no_answer_non_invite") {
            None => Some(d.no_answer_non_invite),
            Some(n)
                if matches!(&n.value, Value::Bool(false))
                    || matches!(&n.value, Value::Str(s) if s == "off") =>
            {
                Some(None)
            }
            Some(n) => {
                let at = join(&p, "no_answer_non_invite");
                let d = self.duration(n, &at, false);
                if let Some(d) = d {
                    self.warn_short_non_invite_timeout(n, &at, d);
                }
                d.map(Some)
            }
        };
        let tries = self.int_field(&ff, &p, "tries", (1, 16), i128::from(d.tries));
        let max_pending = self.int_field(
            &ff,
            &p,
            "max_pending",
            (1, 10_000_000),
            d.max_pending as i128,
        );
        let max_pending_bytes = match ff.get("max_pending_bytes") {
            None => Some(d.max_pending_bytes),
            Some(n) => self
                .size_bytes(n, &join(&p, "max_pending_bytes"), 64 << 10, 1 << 40)
                .and_then(|b| usize::try_from(b).ok()),
        };
        Some(Some(Failover {
            codes: codes?,
            no_answer: no_answer?,
            no_answer_non_invite: no_answer_non_invite?,
            tries: u8::try_from(tries?).ok()?,
            max_pending: usize::try_from(max_pending?).ok()?,
            max_pending_bytes: max_pending_bytes?,
        }))
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
    fn proxy_options(
        &mut self,
        f: &Fields,
        path: &str,
        protocol: Option<Protocol>,
    ) -> ProxyOptions {
        let send_proxy = match f.get("send_proxy") {
            None => Some(None),
            Some(Node {
                value: Value::Null, ..
            }) => Some(None),
            Some(n) => self
                .choice(n, &join(path, "send_proxy"), &[("v2", ProxyProtocol::V2)])
                .map(Some),
        };
        let max_per_source = match f.get("max_per_source") {
            // Off on udp unless asked: resolvers and carrier-grade NATs put many clients
            // behind one address (docs/limits.md).
            None if protocol == Some(Protocol::Udp) => Some(None),
            None => Some(Some(crate::budget::DEFAULT_MAX_PER_SOURCE)),
            Some(n)
                if matches!(&n.value, Value::Str(s) if s == "off")
                    || n.value == Value::Bool(false) =>
            {
                Some(None)
            }
            Some(n) => self
                .int_in(n, &join(path, "max_per_source"), 1, i128::from(u32::MAX))
                .map(|v| Some(v as u32)),
        };
        if let Some(n) = f.get("kernel_relay") {
            self.removed_kernel_relay(n, &join(path, "kernel_relay"));
        }
        ProxyOptions {
            max_per_source,
            max_sessions: self.int_field(f, path, "max_sessions", (1, 10_000_000), 100_000),
            max_sessions_set: f.get("max_sessions").is_some(),
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
        may_be_empty: bool,
    ) -> (Vec<Member>, bool) {
        let mut ok = true;
        if may_be_empty && f.get("services").is_none() {
            return (Vec::new(), ok);
        }
        let Some(list) = self.required(f, path, "services") else {
            return (Vec::new(), ok);
        };
        let sp = join(path, "services");
        let items = self.seq(list, &sp);
        if items.is_empty() && !may_be_empty {
            self.problem(list.pos, &sp, "at least one service is required");
            ok = false;
        }
        let (found, listed_ok) = self.resolve_services(items, &sp, services, services_declared);
        (found, ok && listed_ok)
    }

    /// The services a list names (`items`, at `sp`), resolved by name: each declared and
    /// listed once. The flag is false when one was not (its problem reported). A vserver's
    /// `services` and a routing rule's pool read their lists through here.
    pub(super) fn resolve_services(
        &mut self,
        items: &[Node],
        sp: &str,
        services: &[(&str, &Service)],
        services_declared: &[String],
    ) -> (Vec<Member>, bool) {
        let mut members: Vec<Member> = Vec::new();
        let mut ok = true;
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
    pub(super) fn members_fit(
        &mut self,
        protocol: Option<Protocol>,
        services: &[(&str, &Service)],
        members: &[Member],
    ) -> bool {
        // A pool in DNS hashes its members by their addresses; two pools of one name
        // would tie on every key.
        let ident = |s: &Service| match (&s.dns, &s.hash_id) {
            (Some(d), _) => format!("dns:{}", d.name),
            (None, Some(id)) => id.clone(),
            (None, None) => s.address.to_string(),
        };
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
                        "service `{sname}` hashes like `{}` (same address, hash_id or dns name); give one a distinct hash_id, or list one pool of a name only",
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
        if v.protocol.is_some_and(Protocol::is_packet) {
            self.packet_rules(f, path, v.method);
            return;
        }
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
    pub(super) fn method_fits_protocol(&mut self, n: &Node, mp: &str, m: Method, p: Protocol) {
        if matches!(m, Method::CallIdHash | Method::AorHash) && !p.is_sip() {
            self.problem(
                n.pos,
                mp,
                format!(
                    "{} needs a SIP vserver (sip-udp, sip-tcp or sip-tls), not {}",
                    m.name(),
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
        if let (Some(m), Some(n)) = (method, f.get("aor_key"))
            && m != Method::AorHash
        {
            self.problem(
                n.pos,
                &join(path, "aor_key"),
                format!(
                    "`aor_key` applies to `method: aor_hash` only, not {}",
                    m.name()
                ),
            );
        }
        if let (Some(p), Some(n)) = (protocol, f.get("max_per_source"))
            && p == Protocol::SipUdp
        {
            self.problem(
                n.pos,
                &join(path, "max_per_source"),
                format!(
                    "`max_per_source` applies to stream listeners (sip-tcp, sip-tls, tcp, http) and udp sessions, not {}",
                    p.name()
                ),
            );
        }
        if let (Some(p), Some(n)) = (protocol, f.get("allowed_origins"))
            && !p.is_websocket()
        {
            self.problem(
                n.pos,
                &join(path, "allowed_origins"),
                format!(
                    "`allowed_origins` applies to sip-ws and sip-wss vservers only, not {}",
                    p.name()
                ),
            );
        }
        if let (Some(p), Some(n)) = (protocol, f.get("record_route"))
            && p.is_websocket()
            && matches!(n.value, Value::Bool(false))
        {
            self.problem(
                n.pos,
                &join(path, "record_route"),
                format!(
                    "{} vservers always record-route (a WebSocket client is reachable only through fulcrum)",
                    p.name()
                ),
            );
        }
        for field in ["advertise", "record_route", "failover", "path"] {
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
    service_source: Option<Option<SocketAddr>>,
    record_route: Option<bool>,
    path_mode: Option<PathMode>,
    allowed_origins: Option<Option<Vec<String>>>,
    failover: Option<Option<Failover>>,
    idle_timeout: Option<Duration>,
    drain_timeout: Option<Duration>,
    edge: Option<EdgeFields>,
    /// `eject` (`Some(None)` when off).
    eject: Option<Option<crate::eject::EjectParams>>,
    options: ProxyOptions,
    /// `tls` with `tls_handshake_timeout` (`Some(None)` when absent).
    tls: Option<Option<VserverTls>>,
    /// `interface` (empty but on `protocol: ip`).
    interfaces: Option<Vec<String>>,
    sticky: Option<bool>,
}

/// The hashing fields as read (`token` and `hash_balance_factor` are `Some(None)` when
/// absent).
struct HashFields {
    hash_length: Option<i128>,
    netmask: Option<Ipv4Addr>,
    v6_netmask_len: Option<i128>,
    token: Option<Option<TokenRule>>,
    hash_balance_factor: Option<Option<u32>>,
    aor_key: Option<AorKey>,
}

/// The listener and forwarding options as read.
struct ProxyOptions {
    max_per_source: Option<Option<u32>>,
    max_sessions: Option<i128>,
    max_sessions_set: bool,
    workers: Option<i128>,
    transparent: Option<bool>,
    freebind: Option<bool>,
    send_proxy: Option<Option<ProxyProtocol>>,
}

/// A service a vserver lists: its index in the services, and where it is listed.
pub(super) struct Member {
    pub(super) index: usize,
    pub(super) pos: Pos,
    pub(super) path: String,
}

impl VserverFields {
    /// The vserver, when every field was good and `members` is `Some`.
    fn build(self, members: Option<(Vec<usize>, Vec<Protocol>)>) -> Option<Vserver> {
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
                aor_key: h.aor_key?,
            },
            slow_start: self.slow_start?,
            services: members.as_ref()?.0.clone(),
            discovered: members?.1,
            advertise: self.advertise,
            service_source: self.service_source?,
            // Always on for WebSocket clients: their Contact (`.invalid`) is reachable only
            // through fulcrum (RFC 7118 §5.4).
            record_route: self.record_route? || self.protocol.is_some_and(Protocol::is_websocket),
            path: self.path_mode?,
            allowed_origins: self.allowed_origins?,
            idle_timeout: self.idle_timeout?,
            drain_timeout: self.drain_timeout?,
            draining: Vec::new(),
            allow: edge.allow,
            deny: edge.deny,
            flood: edge.flood,
            failover: self.failover?,
            eject: self.eject?,
            max_sessions: o.max_sessions? as usize,
            max_sessions_set: o.max_sessions_set,
            max_per_source: o.max_per_source?,
            transparent: o.transparent?,
            freebind: o.freebind?,
            send_proxy: o.send_proxy?,
            workers: o.workers? as usize,
            tls: self.tls?,
            interfaces: self.interfaces?,
            sticky: self.sticky?,
            routes: None,
            route_pools: Vec::new(),
        })
    }
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

/// Why a final answer must not send a request to another service (RFC 3261 §16.7): a 3xx
/// asks the client to try elsewhere itself, a 401 / 407 challenge is the answering server's
/// (the credentials are computed for its realm and nonce), a 6xx is a global failure that
/// ends the search (steps 5-6).
fn unbreakable(code: u16) -> Option<&'static str> {
    match code {
        300..=399 => Some("a redirection is for the client to follow"),
        401 | 407 => Some("a challenge belongs to the server that sent it"),
        600..=699 => Some("a global failure ends the search (RFC 3261 §16.7)"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{MINIMAL, problems};
    use super::*;
    use crate::config::from_str;

    fn sip_with(failover: &str) -> String {
        format!(
            "services:\n  - {{ name: s1, address: 127.0.0.1:5071, protocol: sip-udp }}\nvservers:\n  - name: v\n    protocol: sip-udp\n    bind: 127.0.0.1:5060\n{failover}    services: [s1]\n"
        )
    }

    /// RFC 3261 §16.7: answers that must reach the client from the server that gave them
    /// are refused as failover codes, at their line; `no_answer_non_invite` is off unless set.
    #[test]
    fn failover_refuses_codes_that_would_break_a_call() {
        for code in [300, 302, 401, 407, 600, 603, 699] {
            let bad = problems(&sip_with(&format!(
                "    failover:\n      codes: [503, {code}]\n"
            )));
            assert!(
                bad.iter().any(|(line, p, m)| *line == 8
                    && p == "vservers[0].failover.codes[1]"
                    && m.contains("cannot fail over")),
                "{code}: {bad:?}"
            );
        }
        for code in [408, 480, 486, 500, 502, 503, 504, 599] {
            let text = sip_with(&format!("    failover: {{ codes: [{code}] }}\n"));
            assert!(from_str("t", &text).is_ok(), "{code}");
        }
        let c = from_str("t", &sip_with("")).expect("valid");
        let f = c.vservers[0].failover.clone().expect("on");
        assert_eq!(f.no_answer, Duration::from_secs(2));
        assert_eq!(f.no_answer_non_invite, None);
        assert_eq!(f.max_pending_bytes, 256 << 20);
        let text = sip_with("    failover: { no_answer_non_invite: 5s }\n");
        let f = from_str("t", &text).expect("valid").vservers[0]
            .failover
            .clone();
        assert_eq!(
            f.expect("on").no_answer_non_invite,
            Some(Duration::from_secs(5))
        );
        for (written, bytes) in [
            ("\"64MiB\"", 64usize << 20),
            ("1048576", 1 << 20),
            ("\"2GiB\"", 2 << 30),
        ] {
            let text = sip_with(&format!(
                "    failover: {{ max_pending_bytes: {written} }}\n"
            ));
            let f = from_str("t", &text).expect("valid").vservers[0]
                .failover
                .clone();
            assert_eq!(f.expect("on").max_pending_bytes, bytes, "{written}");
        }
        for bad in ["\"lots\"", "\"1.5MiB\"", "12", "\"3TB\""] {
            let text = sip_with(&format!("    failover: {{ max_pending_bytes: {bad} }}\n"));
            assert!(
                problems(&text)
                    .iter()
                    .any(|(_, p, _)| p == "vservers[0].failover.max_pending_bytes"),
                "{bad}"
            );
        }
        let text = sip_with("    failover: { no_answer_non_invite: off }\n");
        let f = from_str("t", &text).expect("valid").vservers[0]
            .failover
            .clone();
        assert_eq!(f.expect("on").no_answer_non_invite, None);
        let bad = problems(&sip_with("    failover: { no_answer_non_invite: soon }\n"));
        assert!(
            bad.iter()
                .any(|(_, p, _)| p == "vservers[0].failover.no_answer_non_invite"),
            "{bad:?}"
        );
    }

    #[test]
    fn aor_key_is_for_aor_hash_only() {
        let with = |fields: &str| {
            format!(
                "services:\n  - {{ name: s1, address: 127.0.0.1:5071, protocol: sip-udp }}\nvservers:\n  - {{ name: v, protocol: sip-udp, bind: 127.0.0.1:5060, {fields}, services: [s1] }}\n"
            )
        };
        let c = from_str("t", &with("method: aor_hash, aor_key: user")).expect("valid");
        assert_eq!(c.vservers[0].hash.aor_key, AorKey::User);
        let c = from_str("t", &with("method: aor_hash")).expect("valid");
        assert_eq!(c.vservers[0].hash.aor_key, AorKey::Uri);
        let bad = problems(&with("method: call_id_hash, aor_key: user"));
        assert!(
            bad.iter()
                .any(|(_, p, m)| p == "vservers[0].aor_key" && m.contains("aor_hash")),
            "{bad:?}"
        );
        let bad = problems(&with("method: aor_hash, aor_key: domain"));
        assert!(
            bad.iter().any(|(_, p, _)| p == "vservers[0].aor_key"),
            "{bad:?}"
        );
    }

    #[test]
    fn failover_is_on_by_default_for_sip_and_reads_its_fields() {
        let c = from_str("t", &sip_with("")).expect("valid");
        assert_eq!(c.vservers[0].failover, Some(Failover::default()));
        for off in ["off", "false", "\"off\""] {
            let c = from_str("t", &sip_with(&format!("    failover: {off}\n"))).expect("valid");
            assert_eq!(c.vservers[0].failover, None, "{off}");
        }
        let c = from_str(
            "t",
            &sip_with("    failover: { codes: [503, 480], no_answer: 250ms, tries: 2 }\n"),
        )
        .expect("valid");
        let f = c.vservers[0].failover.clone().expect("on");
        assert_eq!(f.codes, [503, 480]);
        assert_eq!(f.no_answer, Duration::from_millis(250));
        assert_eq!((f.tries, f.max_pending), (2, 65_536));
        let bad = problems(&sip_with(
            "    failover: { codes: [200], tries: 0, retries: 1 }\n",
        ));
        let paths: Vec<&str> = bad.iter().map(|(_, p, _)| p.as_str()).collect();
        assert!(paths.contains(&"vservers[0].failover.codes[0]"), "{bad:?}");
        assert!(paths.contains(&"vservers[0].failover.tries"), "{bad:?}");
        assert!(paths.contains(&"vservers[0].failover.retries"), "{bad:?}");
        let tcp = "services:\n  - { name: s1, address: 127.0.0.1:5071, protocol: tcp }\nvservers:\n  - { name: v, protocol: tcp, bind: 127.0.0.1:80, failover: off, services: [s1] }\n";
        let bad = problems(tcp);
        assert!(
            bad.iter()
                .any(|(_, p, m)| p == "vservers[0].failover" && m.contains("SIP vservers only")),
            "{bad:?}"
        );
        assert_eq!(
            from_str("t", &tcp.replace(", failover: off", ""))
                .expect("valid")
                .vservers[0]
                .failover,
            None
        );
    }

    #[test]
    fn kernel_relay_off_is_a_warning_and_auto_a_problem_since_the_relay_was_removed() {
        let tcp = |field: &str| {
            format!(
                "services:\n  - {{ name: s1, address: 127.0.0.1:81, protocol: tcp }}\nvservers:\n  - {{ name: v, protocol: tcp, bind: 127.0.0.1:80, {field}services: [s1] }}\n"
            )
        };
        // Where the value stands on line 4: the warning and the problem point at it.
        let at = |text: &str| {
            let line = text.lines().nth(3).expect("line 4");
            let col = line.find("kernel_relay: ").expect("field") + "kernel_relay: ".len() + 1;
            (4, u32::try_from(col).expect("short line"))
        };
        // YAML 1.1's bare `off` is false; quoted, a string: both only warn.
        for off in ["kernel_relay: off, ", "kernel_relay: \"off\", "] {
            let text = tcp(off);
            let c = from_str("t", &text).expect("valid");
            assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
            let w = &c.warnings[0];
            assert_eq!(w.path, "vservers[0].kernel_relay");
            assert_eq!((w.pos.line, w.pos.col), at(&text));
            assert!(w.message.contains("removed"), "{}", w.message);
        }
        assert!(from_str("t", &tcp("")).expect("valid").warnings.is_empty());
        for refused in ["kernel_relay: auto, ", "kernel_relay: on, "] {
            let text = tcp(refused);
            let err = from_str("t", &text).expect_err("invalid");
            let bad = err.problems();
            assert_eq!(bad.len(), 1, "{bad:?}");
            assert_eq!(bad[0].path, "vservers[0].kernel_relay");
            assert_eq!((bad[0].pos.line, bad[0].pos.col), at(&text));
            let m = &bad[0].message;
            assert!(
                m.contains("removed") && m.contains("slower") && m.contains("BENCHMARKS.md"),
                "{m}"
            );
        }
    }

    #[test]
    fn service_source_is_an_ip_with_an_optional_port_on_sip_udp() {
        let read = |v: &str| {
            from_str("t", &sip_with(&format!("    service_source: \"{v}\"\n")))
                .expect("valid")
                .vservers[0]
                .service_source
        };
        assert_eq!(read("10.0.0.7"), Some("10.0.0.7:0".parse().expect("addr")));
        assert_eq!(
            read("10.0.0.7:5070"),
            Some("10.0.0.7:5070".parse().expect("addr"))
        );
        assert_eq!(
            read("2001:db8::7"),
            Some("[2001:db8::7]:0".parse().expect("addr"))
        );
        assert_eq!(
            read("[2001:db8::7]:5070"),
            Some("[2001:db8::7]:5070".parse().expect("addr"))
        );
        assert_eq!(
            from_str("t", &sip_with("")).expect("valid").vservers[0].service_source,
            None
        );
        for bad in ["sip.example.com", "0.0.0.0", "10.0.0.7:x", "224.0.0.1:5060"] {
            let p = problems(&sip_with(&format!("    service_source: \"{bad}\"\n")));
            assert!(
                p.iter()
                    .any(|(line, path, _)| path == "vservers[0].service_source" && *line == 7),
                "{bad}: {p:?}"
            );
        }
        // On a stream vserver it is the UDP leg's address.
        let tcp = sip_with("    service_source: 10.0.0.7:5099\n").replace("sip-udp", "sip-tcp");
        assert_eq!(
            from_str("t", &tcp).expect("valid").vservers[0].service_source,
            Some("10.0.0.7:5099".parse().expect("addr"))
        );
        let plain = sip_with("    service_source: 10.0.0.7\n")
            .replace("protocol: sip-udp", "protocol: udp")
            .replace("method: call_id_hash", "method: round_robin");
        let p = problems(&plain);
        assert!(
            p.iter()
                .any(|(_, path, m)| path == "vservers[0].service_source"
                    && m.contains("SIP vservers only")),
            "{p:?}"
        );
    }

    #[test]
    fn write_timeout_is_a_stream_service_field_with_a_default() {
        let svc = |proto: &str, extra: &str| {
            format!(
                "services:\n  - {{ name: s1, address: 127.0.0.1:5071, protocol: {proto}{extra} }}\nvservers:\n  - {{ name: v, protocol: {proto}, bind: 127.0.0.1:5060, services: [s1] }}\n"
            )
        };
        let c = from_str("t", &svc("sip-tcp", "")).expect("valid");
        assert_eq!(c.services[0].write_timeout, DEFAULT_WRITE_TIMEOUT);
        let c = from_str("t", &svc("sip-tcp", ", write_timeout: 750ms")).expect("valid");
        assert_eq!(c.services[0].write_timeout, Duration::from_millis(750));
        let p = problems(&svc("sip-tcp", ", write_timeout: 0s"));
        assert!(
            p.iter()
                .any(|(_, path, _)| path == "services[0].write_timeout"),
            "{p:?}"
        );
        let p = problems(&svc("sip-udp", ", write_timeout: 2s"));
        assert!(
            p.iter()
                .any(|(_, path, m)| path == "services[0].write_timeout"
                    && m.contains("sip-tcp and sip-tls services only")),
            "{p:?}"
        );
    }

    #[test]
    fn max_per_source_has_a_default_an_off_and_applies_to_streams() {
        let tcp = |extra: &str| {
            format!(
                "services:\n  - {{ name: s1, address: 127.0.0.1:5071, protocol: tcp }}\nvservers:\n  - {{ name: v, protocol: tcp, bind: 127.0.0.1:80{extra}, services: [s1] }}\n"
            )
        };
        let read =
            |extra: &str| from_str("t", &tcp(extra)).expect("valid").vservers[0].max_per_source;
        assert_eq!(read(""), Some(crate::budget::DEFAULT_MAX_PER_SOURCE));
        assert_eq!(read(", max_per_source: 50"), Some(50));
        assert_eq!(read(", max_per_source: off"), None);
        let p = problems(&tcp(", max_per_source: 0"));
        assert!(
            p.iter()
                .any(|(_, path, _)| path == "vservers[0].max_per_source"),
            "{p:?}"
        );
        let p = problems(&sip_with("    max_per_source: 10\n"));
        assert!(
            p.iter()
                .any(|(_, path, m)| path == "vservers[0].max_per_source"
                    && m.contains("stream listeners")),
            "{p:?}"
        );
        // On udp it counts sessions, off unless asked.
        let udp = |extra: &str| {
            format!(
                "services:\n  - {{ name: s1, address: 127.0.0.1:5071, protocol: udp }}\nvservers:\n  - {{ name: v, protocol: udp, bind: 127.0.0.1:80, method: round_robin{extra}, services: [s1] }}\n"
            )
        };
        let v = |extra: &str| {
            from_str("t", &udp(extra))
                .expect("valid")
                .vservers
                .remove(0)
        };
        assert_eq!(v("").max_per_source, None);
        assert_eq!(v(", max_per_source: 4").max_per_source, Some(4));
        assert!(!v("").max_sessions_set);
        assert!(v(", max_sessions: 10").max_sessions_set);
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

    /// `freebind` is a bool of every protocol, off by default; a wrong type or a misspelling
    /// is reported at its line and column.
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

    #[test]
    fn masks() {
        assert!(is_contiguous_mask(Ipv4Addr::new(255, 255, 255, 0)));
        assert!(is_contiguous_mask(Ipv4Addr::new(0, 0, 0, 0)));
        assert!(!is_contiguous_mask(Ipv4Addr::new(255, 0, 255, 0)));
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
}
