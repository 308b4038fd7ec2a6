//! Which routing rule of a vserver a request (a SIP request; a tcp connection's ClientHello
//! or TLS names; an HTTP request head) matches, its target, and the service the
//! target pool's method would choose now (docs/routing.md, "Seeing it"): `fulcrum route` asks
//! a fresh balancer built from the config, `POST /vservers/NAME/route` a copy of the running
//! one ([`crate::balancer::Balancer::snapshot`]). PURE: the balancer, the message, the
//! addresses and `now` in, a value out; both callers share [`decide`].

use crate::balancer::Balancer;
use crate::core::sip::request_key;
use crate::core::tcp::{ConnectionKeys, Handshake};
use crate::route::{self, Target};
use crate::sip::{self, ScanError, SipMsg};
use crate::stats::Nanos;
use serde::Serialize;
use std::net::SocketAddr;

/// What the rules decide for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Answer {
    /// The rule that matched; `None` (JSON `null`): no rule matched, the default decided.
    pub rule: Option<String>,
    pub target: TargetView,
    /// The service the pool's method would choose now: `None` for a refusal, or when no
    /// service of the pool can take the request (fulcrum answers 503).
    pub service: Option<String>,
    /// Where the decision may not be the data path's: a request with a To tag follows the
    /// dialog fulcrum knows, whatever the rules say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A rule's target, with its pool's services by name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum TargetView {
    Pool {
        /// `default` for the vserver's own `services`, else the rule's name.
        pool: String,
        services: Vec<String>,
        method: String,
    },
    Reject {
        code: u16,
        reason: String,
    },
    Drop,
}

/// Why there is no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("vserver `{0}` has no routes (docs/routing.md)")]
    NoRoutes(String),
    #[error("not a SIP message: {0}")]
    Unparseable(ScanError),
    #[error("{0}: the rules route requests other than ACK and CANCEL (docs/routing.md)")]
    NotRouted(&'static str),
}

/// A SIP message as a person writes it in a file: line ends in the header section become
/// CRLF (an LF alone, as editors write, is taken as one), and a header section without the
/// empty line that ends it gets one. The body is kept as written.
pub fn normalize_message(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() + 64);
    let mut rest = text;
    loop {
        let (line, next) = match memchr::memchr(b'\n', rest) {
            Some(i) => (&rest[..i], Some(&rest[i + 1..])),
            None => (rest, None),
        };
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            // The end of the header section (or of a file without a body).
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(next.unwrap_or_default());
            return out;
        }
        out.extend_from_slice(line);
        out.extend_from_slice(b"\r\n");
        match next {
            Some(n) if !n.is_empty() => rest = n,
            _ => {
                out.extend_from_slice(b"\r\n");
                return out;
            }
        }
    }
}

/// The message's sender as the data path would see it when the caller names none: its top
/// Via's `received` (else sent-by) address with its port (5060 when none, RFC 3261 §18.2.1),
/// else the unspecified address.
pub fn default_source(msg: &SipMsg<'_>) -> SocketAddr {
    msg.top_via()
        .and_then(|v| {
            let ip = v
                .received
                .and_then(|r| std::str::from_utf8(r).ok()?.parse().ok())
                .or_else(|| v.host_ip())?;
            Some(SocketAddr::new(ip, v.port.unwrap_or(5060)))
        })
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)))
}

/// Scan `bytes` (already [`normalize_message`]d) as a request the rules route.
pub fn scan_request(bytes: &[u8]) -> Result<SipMsg<'_>, RouteError> {
    let msg = sip::scan(bytes).map_err(RouteError::Unparseable)?;
    if !msg.is_request() {
        return Err(RouteError::NotRouted("a response"));
    }
    if !route::applies_to(&msg) {
        return Err(RouteError::NotRouted("ACK and CANCEL follow their INVITE"));
    }
    Ok(msg)
}

/// What `balancer`'s routes decide for `msg` from `src`, arrived on `local`, and the service
/// its pool's method chooses at `now` (as the data path chooses for a request outside a
/// dialog: the pool's own method, key and hash parameters). `balancer` is the one choosing:
/// give a [`Balancer::snapshot`] of a running one, so the question moves nothing.
pub fn decide(
    balancer: &Balancer,
    vserver: &str,
    msg: &SipMsg<'_>,
    src: SocketAddr,
    local: SocketAddr,
    now: Nanos,
) -> Result<Answer, RouteError> {
    let routes = balancer
        .routes()
        .ok_or_else(|| RouteError::NoRoutes(vserver.to_owned()))?;
    let mut req = route::Request::new(msg, src, local);
    let d = routes.decide(&mut req);
    let rule = d
        .rule
        .and_then(|i| routes.rules.get(i))
        .map(|r| r.name.clone());
    let note = msg.to_tag().is_some().then(|| {
        "a request with a To tag goes to its dialog's service when fulcrum knows the dialog; shown: the rules' decision"
            .to_owned()
    });
    let call_hash = msg.call_id().map(crate::hash::key_hash);
    let key_of = |p: usize| {
        request_key(
            balancer.pool_method(p),
            balancer.pool_hash(p),
            msg,
            (src, local),
            call_hash,
        )
    };
    let (target, service) = target_view(balancer, routes, d.target, key_of, now);
    Ok(Answer {
        rule,
        target,
        service,
        note,
    })
}

/// What the rules of a `tcp` or `http` vserver (its keying `keys`) decide for a connection
/// from `src` to `local` whose first bytes are `first` (a TLS ClientHello, an HTTP request
/// head; may be empty), or whose TLS `handshake` says the server name and protocols (for a
/// vserver that terminates TLS, or in place of a captured hello), and the service its pool
/// would choose at `now`.
pub fn decide_connection(
    balancer: &Balancer,
    keys: &ConnectionKeys,
    vserver: &str,
    first: &[u8],
    handshake: Option<Handshake<'_>>,
    (src, local): (SocketAddr, SocketAddr),
    now: Nanos,
) -> Result<Answer, RouteError> {
    let routes = balancer
        .routes()
        .ok_or_else(|| RouteError::NoRoutes(vserver.to_owned()))?;
    let d = keys.route(routes, first, handshake, src, local);
    let rule = d
        .rule
        .and_then(|i| routes.rules.get(i))
        .map(|r| r.name.clone());
    let key_of = |p: usize| keys.key_input_in(p, first, src, local).0;
    let (target, service) = target_view(balancer, routes, d.target, key_of, now);
    Ok(Answer {
        rule,
        target,
        service,
        note: None,
    })
}

/// A decision's target as shown, and the service its pool would choose at `now` with the
/// pool's key `key_of(pool)`.
fn target_view(
    balancer: &Balancer,
    routes: &route::Routes,
    target: &Target,
    key_of: impl Fn(usize) -> crate::balancer::KeyInput,
    now: Nanos,
) -> (TargetView, Option<String>) {
    match target {
        Target::Pool(p) => {
            let names = |ms: Vec<usize>| -> Vec<String> {
                ms.into_iter()
                    .filter_map(|m| balancer.members().get(m).map(|i| i.name.clone()))
                    .collect()
            };
            let service = balancer
                .choose_in(*p, key_of(*p), now, &|_| false)
                .and_then(|c| balancer.members().get(c.member))
                .map(|m| m.name.clone());
            let pool = match p {
                0 => "default".to_owned(),
                k => routes
                    .rules
                    .iter()
                    .find(|r| r.target == Target::Pool(*k))
                    .map_or_else(|| format!("pool {k}"), |r| r.name.clone()),
            };
            let view = TargetView::Pool {
                pool,
                services: names(balancer.pool_members(*p)),
                method: balancer.pool_method(*p).name().to_owned(),
            };
            (view, service)
        }
        Target::Reject { code, reason } => (
            TargetView::Reject {
                code: *code,
                reason: reason.clone(),
            },
            None,
        ),
        Target::Drop => (TargetView::Drop, None),
    }
}

/// The answer as `fulcrum route` prints it: one `key: value` per line.
pub fn render_text(a: &Answer, src: SocketAddr, local: SocketAddr, fresh: bool) -> String {
    let mut out = String::new();
    out.push_str(&format!("source: {src}\nlocal: {local}\n"));
    out.push_str(&format!(
        "rule: {}\n",
        a.rule.as_deref().unwrap_or("(none matched: the default)")
    ));
    match &a.target {
        TargetView::Pool {
            pool,
            services,
            method,
        } => {
            out.push_str(&format!(
                "target: pool {pool} ({method}): {}\n",
                services.join(", ")
            ));
            let how = if fresh {
                " (a fresh balancer: every service considered UP, no load)"
            } else {
                ""
            };
            match &a.service {
                Some(s) => out.push_str(&format!("service: {s}{how}\n")),
                None => out.push_str(&format!(
                    "service: none can take it: fulcrum answers 503{how}\n"
                )),
            }
        }
        TargetView::Reject { code, reason } => {
            out.push_str(&format!("target: reject {code} {reason}\n"));
        }
        TargetView::Drop => out.push_str("target: drop (no answer)\n"),
    }
    if let Some(n) = &a.note {
        out.push_str(&format!("note: {n}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balancer::Health;
    use crate::config;

    const YAML: &str = "services:
  - { name: p1, address: 127.0.0.1:5071, protocol: sip-udp }
  - { name: p2, address: 127.0.0.1:5072, protocol: sip-udp }
  - { name: r1, address: 127.0.0.1:5081, protocol: sip-udp }
  - { name: r2, address: 127.0.0.1:5082, protocol: sip-udp }
vservers:
  - name: v
    protocol: sip-udp
    bind: 127.0.0.1:5060
    services: [p1, p2]
    routes:
      - { name: registrar, match: { method: REGISTER }, services: [r1, r2], method: round_robin }
      - { name: lan, match: { source: 10.0.0.0/8 }, reject: { code: 403 } }
      - { name: scanners, match: { header: { name: User-Agent, prefix: friendly } }, drop: true }
";

    fn balancer() -> Balancer {
        let cfg = config::from_str("t", YAML).expect("config");
        Balancer::new(&cfg, &cfg.vservers[0])
    }

    fn text(method: &str, extra: &str) -> Vec<u8> {
        normalize_message(
            format!(
                "{method} sip:bob@example.com SIP/2.0\nVia: SIP/2.0/UDP 192.0.2.7:5070;branch=z9hG4bK1\nFrom: <sip:a@x>;tag=1\nTo: <sip:bob@example.com>{extra}\nCall-ID: c1\nCSeq: 1 {method}\nMax-Forwards: 70\n"
            )
            .as_bytes(),
        )
    }

    fn ask(b: &Balancer, bytes: &[u8], src: &str) -> Result<Answer, RouteError> {
        let msg = scan_request(bytes)?;
        decide(
            b,
            "v",
            &msg,
            src.parse().expect("src"),
            "127.0.0.1:5060".parse().expect("local"),
            0,
        )
    }

    #[test]
    fn lf_only_lines_become_crlf_and_the_head_gets_its_end() {
        let m = text("INVITE", "");
        assert!(m.ends_with(b"Max-Forwards: 70\r\n\r\n"));
        assert!(!m.windows(2).any(|w| w[1] == b'\n' && w[0] != b'\r'));
        assert_eq!(
            normalize_message(b"OPTIONS sip:x SIP/2.0\r\nCall-ID: 1\r\n\r\nbody\n"),
            b"OPTIONS sip:x SIP/2.0\r\nCall-ID: 1\r\n\r\nbody\n"
        );
        let msg = scan_request(&m).expect("scans");
        assert_eq!(
            default_source(&msg),
            "192.0.2.7:5070".parse::<SocketAddr>().expect("addr")
        );
    }

    #[test]
    fn each_target_is_named_with_its_pool_and_service() {
        let b = balancer();
        let a = ask(&b, &text("REGISTER", ""), "192.0.2.7:5070").expect("decided");
        assert_eq!(a.rule.as_deref(), Some("registrar"));
        assert_eq!(
            a.target,
            TargetView::Pool {
                pool: "registrar".into(),
                services: vec!["r1".into(), "r2".into()],
                method: "round_robin".into()
            }
        );
        assert_eq!(a.service.as_deref(), Some("r1"));
        let a = ask(&b, &text("INVITE", ""), "192.0.2.7:5070").expect("decided");
        assert_eq!(a.rule, None);
        assert!(matches!(&a.target, TargetView::Pool { pool, .. } if pool == "default"));
        assert!(matches!(a.service.as_deref(), Some("p1" | "p2")));
        let a = ask(&b, &text("INVITE", ""), "10.1.1.1:5060").expect("decided");
        assert_eq!(
            a.target,
            TargetView::Reject {
                code: 403,
                reason: "Forbidden".into()
            }
        );
        assert_eq!(a.service, None);
        let ua = text("OPTIONS", "\nUser-Agent: friendly-scanner");
        let a = ask(&b, &ua, "192.0.2.7:5070").expect("decided");
        assert_eq!(
            (a.rule.as_deref(), &a.target),
            (Some("scanners"), &TargetView::Drop)
        );
        let tagged = ask(&b, &text("INVITE", ";tag=x"), "192.0.2.7:5070").expect("decided");
        assert!(tagged.note.is_some());
    }

    #[test]
    fn a_snapshot_answers_from_the_live_health_and_moves_nothing() {
        let b = balancer();
        let r1 = b.members().iter().position(|m| m.name == "r1").expect("r1");
        b.set_health(r1, Health::Down, 0);
        for _ in 0..3 {
            let s = b.snapshot();
            let a = ask(&s, &text("REGISTER", ""), "192.0.2.7:5070").expect("decided");
            assert_eq!(a.service.as_deref(), Some("r2"));
        }
        b.set_health(r1, Health::Up, 0);
        // Round robin's position never moved: the live balancer still starts at r1.
        for _ in 0..3 {
            let a = ask(&b.snapshot(), &text("REGISTER", ""), "192.0.2.7:5070").expect("decided");
            assert_eq!(a.service.as_deref(), Some("r1"));
        }
        let a = ask(&b, &text("REGISTER", ""), "192.0.2.7:5070").expect("decided");
        assert_eq!(a.service.as_deref(), Some("r1"));
        let a = ask(&b, &text("REGISTER", ""), "192.0.2.7:5070").expect("decided");
        assert_eq!(a.service.as_deref(), Some("r2"), "the live one moves on");
        // Every service of the pool DOWN: no service, as fulcrum's 503.
        for m in 0..b.members().len() {
            b.set_health(m, Health::Down, 0);
        }
        let a = ask(&b.snapshot(), &text("REGISTER", ""), "192.0.2.7:5070").expect("decided");
        assert_eq!(a.service, None);
    }

    #[test]
    fn what_the_rules_never_route_is_refused() {
        let b = balancer();
        assert!(matches!(
            ask(&b, &text("ACK", ""), "192.0.2.7:5070"),
            Err(RouteError::NotRouted(_))
        ));
        assert!(matches!(
            ask(&b, b"SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP 1.2.3.4\r\nCall-ID: x\r\nCSeq: 1 INVITE\r\n\r\n", "192.0.2.7:5070"),
            Err(RouteError::NotRouted(_))
        ));
        assert!(matches!(
            ask(&b, b"not sip at all\r\n\r\n", "192.0.2.7:5070"),
            Err(RouteError::Unparseable(_))
        ));
        let cfg = config::from_str(
            "t",
            "services:\n  - { name: p1, address: 127.0.0.1:5071, protocol: sip-udp }\nvservers:\n  - { name: w, protocol: sip-udp, bind: 127.0.0.1:5060, services: [p1] }\n",
        )
        .expect("config");
        let plain = Balancer::new(&cfg, &cfg.vservers[0]);
        assert_eq!(
            ask(&plain, &text("INVITE", ""), "192.0.2.7:5070"),
            Err(RouteError::NoRoutes("v".into()))
        );
    }
}
