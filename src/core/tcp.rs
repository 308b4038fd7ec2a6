//! PURE: what a `tcp` / `http` vserver reads of a connection before it chooses (nothing, an
//! HTTP/1.x request head, a token's bytes, or a TLS ClientHello its routing rules read), what
//! the rules decide from it, and the key the pool's method hashes from it and the
//! connection's addresses. The shell (`proxy::tcp`) reads the bytes, bounded in size and
//! time, and asks.

use crate::balancer::KeyInput;
use crate::client_hello::{self, Hello};
use crate::config::{HashParams, Method, Protocol, TokenRule, Vserver};
use crate::hash;
use crate::http::{self, HttpError};
use crate::key::{self, KeyOutcome, Payload, RequestCtx};
use crate::route::{Decision, Request, Routes, Subject};
use std::net::SocketAddr;

/// What the first bytes of a connection must contain before a member can be chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstBytes {
    /// Nothing: choose at accept.
    None,
    /// A complete HTTP/1.x request head.
    HttpHead,
    /// At least this many bytes (`token` offset + length).
    Bytes(usize),
}

/// What a TLS handshake fulcrum terminated says to the rules: the server name the client
/// asked for, and the application protocol negotiated (none, or one).
#[derive(Debug, Clone, Copy)]
pub struct Handshake<'a> {
    pub sni: Option<&'a [u8]>,
    pub alpn: &'a [Vec<u8>],
}

/// The keying of one tcp / http vserver: its method, the method's parameters and what must
/// be read first, for its own pool and for its routing rules and their pools (docs/routing.md).
#[derive(Debug, Clone)]
pub struct ConnectionKeys {
    protocol: Protocol,
    method: Method,
    hash_params: HashParams,
    first: FirstBytes,
    /// The method and hash parameters of each rule's pool (pool `k` at `k - 1`).
    pools: Vec<(Method, HashParams)>,
    /// The rules read the ClientHello (`sni` / `alpn` on a tcp vserver without TLS).
    hello: bool,
    /// The rules, or a pool's method, read the HTTP request head.
    head: bool,
    /// A rule reads the address the connection arrived on.
    routes_read_local: bool,
}

/// What `method` reads first on a `protocol` vserver with token rule `token`.
fn first_of(protocol: Protocol, method: Method, token: Option<&TokenRule>) -> FirstBytes {
    match (protocol, method, token) {
        (_, Method::Token, Some(TokenRule::Payload { offset, length })) => {
            FirstBytes::Bytes(offset.saturating_add(*length).min(http::MAX_HEAD))
        }
        (Protocol::Http, Method::UrlHash | Method::DomainHash | Method::Token, _) => {
            FirstBytes::HttpHead
        }
        _ => FirstBytes::None,
    }
}

impl ConnectionKeys {
    /// The keying of vserver `v`.
    pub fn new(v: &Vserver) -> ConnectionKeys {
        let first = first_of(v.protocol, v.method, v.hash.token.as_ref());
        let pools: Vec<(Method, HashParams)> = v
            .route_pools
            .iter()
            .map(|p| {
                let hash = HashParams {
                    hash_length: p.hash_length,
                    ..v.hash.clone()
                };
                (p.method.unwrap_or(v.method), hash)
            })
            .collect();
        let routes = v.routes.as_ref();
        let head = v.protocol == Protocol::Http
            && (routes.is_some_and(crate::route::Routes::reads_http)
                || pools
                    .iter()
                    .any(|(m, _)| first_of(v.protocol, *m, None) == FirstBytes::HttpHead));
        ConnectionKeys {
            protocol: v.protocol,
            method: v.method,
            hash_params: v.hash.clone(),
            first,
            hello: v.protocol == Protocol::Tcp
                && v.tls.is_none()
                && routes.is_some_and(crate::route::Routes::reads_tls),
            head,
            routes_read_local: routes
                .is_some_and(|r| r.rules.iter().any(|rule| rule.test.local.is_some())),
            pools,
        }
    }

    /// True when the key uses the connection's local address (`dest_ip_hash`,
    /// `source_dest_ip_hash`), or a rule does (`local`).
    pub fn reads_local(&self) -> bool {
        self.routes_read_local
            || key::reads_local(self.method)
            || self.pools.iter().any(|(m, _)| key::reads_local(*m))
    }

    /// What the vserver's own method must read before choosing.
    pub fn first_bytes_needed(&self) -> FirstBytes {
        self.first
    }

    /// Whether anything is read before choosing: for the key, or for the rules.
    pub fn reads_first(&self) -> bool {
        self.first != FirstBytes::None || self.hello || self.head
    }

    /// Whether only the rules' ClientHello is read first (its own, shorter, time bound).
    pub fn reads_hello_only(&self) -> bool {
        self.hello && self.first == FirstBytes::None && !self.head
    }

    /// True when `buf` holds enough to choose (or can never be enough: too large, not HTTP,
    /// not TLS).
    pub fn is_first_complete(&self, buf: &[u8]) -> bool {
        // The head is parsed once whether the key or the rules want it.
        let head = self.head || self.first == FirstBytes::HttpHead;
        let key = match self.first {
            FirstBytes::Bytes(n) => buf.len() >= n,
            FirstBytes::None | FirstBytes::HttpHead => true,
        };
        key && (!head || !matches!(http::parse_head(buf), Err(HttpError::Incomplete)))
            && (!self.hello || client_hello::parse(buf) != Hello::Incomplete)
    }

    /// The balancer's key in pool `pool` (0: the vserver's own; `k`: the `k`-th rule's, with its
    /// method and hash parameters) for a connection from `client` to `local` whose first bytes
    /// are `first` (empty when none were needed or none came), and whether an HTTP head that
    /// was needed did not parse.
    pub fn key_input_in(
        &self,
        pool: usize,
        first: &[u8],
        client: SocketAddr,
        local: SocketAddr,
    ) -> (KeyInput, bool) {
        let (method, params, need) = match pool.checked_sub(1).and_then(|k| self.pools.get(k)) {
            Some((m, params)) => (*m, params, first_of(self.protocol, *m, None)),
            None => (self.method, &self.hash_params, self.first),
        };
        let head;
        let payload = match need {
            FirstBytes::HttpHead => match http::parse_head(first) {
                Ok(h) => {
                    head = h;
                    Payload::Http(&head)
                }
                Err(_) => return (KeyInput::Unparseable, true),
            },
            FirstBytes::Bytes(_) => Payload::Raw(first),
            FirstBytes::None => Payload::None,
        };
        let ctx = RequestCtx {
            src: client,
            dst: local,
            payload,
        };
        let key = match key::extract(method, params, &ctx) {
            KeyOutcome::Key(k) => KeyInput::Hash(hash::key_hash(k.as_bytes())),
            KeyOutcome::NoKey => KeyInput::NoKey,
            KeyOutcome::Unparseable => KeyInput::Unparseable,
        };
        (key, false)
    }

    /// What `routes` decide for a connection from `client` to `local` whose first bytes are
    /// `first`: from its ClientHello (tcp without TLS), from `handshake` (the server name and
    /// negotiated protocol of a terminated TLS connection), from its HTTP head (http), or from
    /// the addresses alone.
    pub fn route<'r>(
        &self,
        routes: &'r Routes,
        first: &[u8],
        handshake: Option<Handshake<'_>>,
        client: SocketAddr,
        local: SocketAddr,
    ) -> Decision<'r> {
        let hello;
        let head;
        let subject = if let Some(Handshake { sni, alpn }) = handshake {
            Subject::Tls { sni, alpn }
        } else if self.hello {
            hello = client_hello::parse(first);
            match &hello {
                Hello::Read(h) => Subject::Tls {
                    sni: h.sni.as_deref(),
                    alpn: &h.alpn,
                },
                _ => Subject::Tls {
                    sni: None,
                    alpn: &[],
                },
            }
        } else if self.head {
            head = http::parse_head(first).ok();
            Subject::Http(head.as_ref())
        } else {
            Subject::Connection
        };
        routes.decide(&mut Request::of(subject, client, local))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client_hello::tests::{hello_message, records};
    use crate::route::Target;

    fn vserver(protocol: &str, extra: &str, routes: &str) -> Vserver {
        let yaml = format!(
            "admin: {{ listen: null }}\nservices:\n  - {{ name: a, address: \"127.0.0.1:7001\", protocol: {protocol} }}\n  - {{ name: b, address: \"127.0.0.1:7002\", protocol: {protocol} }}\nvservers:\n  - name: v\n    protocol: {protocol}\n    bind: [\"127.0.0.1:0\"]\n    services: [a]\n{extra}    routes:\n{routes}"
        );
        let cfg = crate::config::from_str("t.yaml", &yaml).expect("config");
        cfg.vservers[0].clone()
    }

    fn at(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    fn decide(v: &Vserver, first: &[u8]) -> (Option<usize>, Target) {
        let keys = ConnectionKeys::new(v);
        let routes = v.routes.as_ref().expect("routes");
        let d = keys.route(routes, first, None, at("10.0.0.1:4000"), at("10.0.0.2:443"));
        (d.rule, d.target.clone())
    }

    #[test]
    fn tls_routed_by_its_hello_is_read_whole_first() {
        let v = vserver(
            "tcp",
            "",
            "      - { name: a, match: { sni: a.test, alpn: h2 }, services: [b] }\n      - { name: any-b, match: { sni: \"*.b.test\" }, services: [b] }\n",
        );
        let keys = ConnectionKeys::new(&v);
        assert!(keys.reads_first() && keys.reads_hello_only());
        assert!(!keys.reads_local());
        let hello = records(&hello_message(Some("a.test"), &["http/1.1", "h2"], 0), 100);
        assert!(!keys.is_first_complete(&hello[..hello.len() - 1]));
        assert!(keys.is_first_complete(&hello));
        assert!(keys.is_first_complete(b"SSH-2.0-x\r\n"), "not TLS: stop");
        assert_eq!(decide(&v, &hello), (Some(0), Target::Pool(1)));
        let h1 = records(&hello_message(Some("a.test"), &["http/1.1"], 0), 1 << 14);
        assert_eq!(decide(&v, &h1), (None, Target::Pool(0)), "h2 not offered");
        let b = records(&hello_message(Some("x.y.B.test"), &[], 0), 1 << 14);
        assert_eq!(decide(&v, &b), (Some(1), Target::Pool(2)));
        assert_eq!(decide(&v, b"SSH-2.0-x\r\n"), (None, Target::Pool(0)));
        assert_eq!(decide(&v, &b[..20]), (None, Target::Pool(0)), "cut short");
        // With TLS terminated the handshake says it; nothing is read first for the rules.
        let tls = vserver(
            "tcp",
            "    tls: { cert: c.pem, key: k.pem }\n",
            "      - { name: a, match: { sni: a.test }, services: [b] }\n",
        );
        assert!(!ConnectionKeys::new(&tls).reads_first());
        let routes = tls.routes.as_ref().expect("routes");
        let h2 = [b"h2".to_vec()];
        let d = ConnectionKeys::new(&tls).route(
            routes,
            b"",
            Some(Handshake {
                sni: Some(b"a.test"),
                alpn: &h2,
            }),
            at("10.0.0.1:4000"),
            at("10.0.0.2:443"),
        );
        assert_eq!(d.rule, Some(0));
        assert_eq!(routes.alpn_protocols(), Vec::<Vec<u8>>::new());
    }

    #[test]
    fn http_rules_read_the_head_and_a_pools_method_its_key() {
        let v = vserver(
            "http",
            "",
            "      - { name: api, match: { path_prefix: /api/, method: [GET, HEAD] }, services: [b], method: url_hash }\n      - { name: lan, match: { local: 10.0.0.2 }, services: [b] }\n",
        );
        let keys = ConnectionKeys::new(&v);
        assert_eq!(
            keys.first_bytes_needed(),
            FirstBytes::None,
            "round robin itself"
        );
        assert!(keys.reads_first() && !keys.reads_hello_only() && keys.reads_local());
        assert!(!keys.is_first_complete(b"GET /api/x HTTP/1.1\r\n"));
        let get = b"GET /api/x?q=1 HTTP/1.1\r\nHost: h\r\n\r\n";
        assert!(keys.is_first_complete(get));
        assert_eq!(decide(&v, get), (Some(0), Target::Pool(1)));
        assert_eq!(
            decide(&v, b"POST /api/x HTTP/1.1\r\nHost: h\r\n\r\n").0,
            Some(1)
        );
        assert_eq!(decide(&v, b"junk\r\n\r\n").0, Some(1), "local still holds");
        let (c, l) = (at("10.0.0.1:4000"), at("10.0.0.2:80"));
        let (k1, _) = keys.key_input_in(1, get, c, l);
        let (k2, _) = keys.key_input_in(1, get, at("10.9.9.9:1"), l);
        assert!(matches!(k1, KeyInput::Hash(_)));
        assert_eq!(k1, k2, "the api pool hashes the URL");
        assert_eq!(keys.key_input_in(0, get, c, l).0, KeyInput::NoKey);
    }
}
