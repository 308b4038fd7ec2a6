//! Routing rules of a vserver (docs/routing.md): which pool a SIP request outside a dialog, a
//! tcp connection (by its TLS server name and application protocols) or an HTTP request goes
//! to, or which refusal it gets, from the request alone and the listener it arrived on.
//! PURE: no socket, no clock; a rule depends only on its request, so every instance of a
//! pool routes alike.
//!
//! Fields are read lazily, each the first time a rule asks for it ([`Request`] caches them),
//! so a rule on the method costs a comparison of the method the scan already found. Methods
//! are compared as bytes (case-sensitive, RFC 3261 §7.1), host names case-insensitively with
//! `*.suffix` lookups label by label in a hash set, number prefixes in a byte trie, CIDRs with
//! the access lists' [`Cidr`], regexes with the `regex` crate (linear time, a compiled size
//! limit; a pattern over it is refused at load).

use crate::acl::Cidr;
use crate::http::HttpHead;
use crate::sip::{SipMethod, SipMsg, parse_name_addr, parse_uri};
/// A set of byte strings: compared one by one while small (faster than hashing a short key),
/// hashed with a fixed function (xxh3, never a randomly seeded one) past [`SMALL_SET`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Set {
    small: Vec<Vec<u8>>,
    big: Option<std::collections::HashSet<Vec<u8>, xxhash_rust::xxh3::Xxh3DefaultBuilder>>,
}

/// Items a [`Set`] compares one by one.
pub const SMALL_SET: usize = 16;

impl Set {
    pub fn insert(&mut self, v: Vec<u8>) -> bool {
        if self.contains(&v) {
            return false;
        }
        match &mut self.big {
            Some(b) => {
                b.insert(v);
            }
            None if self.small.len() < SMALL_SET => self.small.push(v),
            None => {
                let mut b: std::collections::HashSet<_, _> = self.small.drain(..).collect();
                b.insert(v);
                self.big = Some(b);
            }
        }
        true
    }

    pub fn contains(&self, v: &[u8]) -> bool {
        match &self.big {
            Some(b) => b.contains(v),
            None => self.small.iter().any(|x| x.as_slice() == v),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.small.is_empty() && self.big.as_ref().is_none_or(|b| b.is_empty())
    }
}

impl FromIterator<Vec<u8>> for Set {
    fn from_iter<I: IntoIterator<Item = Vec<u8>>>(items: I) -> Set {
        let mut s = Set::default();
        for v in items {
            s.insert(v);
        }
        s
    }
}
use std::net::SocketAddr;

/// Compiled size limit of one regex (the `regex` crate's `size_limit`): a pattern that needs
/// more is refused when the config is read.
pub const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// What a request gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The pool with this index: 0 is the vserver's own (`services`, `method`), `k` the
    /// `k`-th route that has a pool.
    Pool(usize),
    /// fulcrum's own final answer, never sent to a service.
    Reject { code: u16, reason: String },
    /// Dropped without an answer.
    Drop,
}

/// One rule: all its tests must hold.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub name: String,
    pub test: Match,
    pub target: Target,
}

/// The rules of a vserver, in file order, and what no rule matched gets.
#[derive(Debug, Clone, PartialEq)]
pub struct Routes {
    pub rules: Vec<Rule>,
    pub default: Target,
    /// Longest wait for a ClientHello a rule reads on a tcp vserver without TLS termination
    /// (`client_hello_timeout`); a connection whose hello is not complete by then is routed
    /// as one without a name.
    pub client_hello_timeout: std::time::Duration,
}

/// `client_hello_timeout` when not given.
pub const CLIENT_HELLO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// The decision for one request: the rule that matched (`None`: the default) and its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision<'r> {
    pub rule: Option<usize>,
    pub target: &'r Target,
}

impl Routes {
    /// Whether a rule reads the TLS handshake (`sni`, `alpn`).
    pub fn reads_tls(&self) -> bool {
        self.rules
            .iter()
            .any(|r| r.test.sni.is_some() || r.test.alpn.is_some())
    }

    /// Whether a rule reads an HTTP request head (`method`, `header`, `host`, `path_prefix`).
    pub fn reads_http(&self) -> bool {
        self.rules.iter().any(|r| {
            r.test.methods.is_some()
                || !r.test.headers.is_empty()
                || r.test.host.is_some()
                || r.test.path_prefix.is_some()
        })
    }

    /// The application protocols the rules' `alpn` tests name, each once, in file order: what
    /// a vserver that terminates TLS offers to negotiate (RFC 7301 §3.2: the server picks).
    pub fn alpn_protocols(&self) -> Vec<Vec<u8>> {
        let mut out: Vec<Vec<u8>> = Vec::new();
        for list in self.rules.iter().filter_map(|r| r.test.alpn.as_ref()) {
            for p in list {
                if !out.contains(p) {
                    out.push(p.clone());
                }
            }
        }
        out
    }

    /// The first rule whose tests all hold, else the default.
    pub fn decide<'r>(&'r self, req: &mut Request<'_, '_>) -> Decision<'r> {
        for (i, r) in self.rules.iter().enumerate() {
            if r.test.holds(req) {
                return Decision {
                    rule: Some(i),
                    target: &r.target,
                };
            }
        }
        Decision {
            rule: None,
            target: &self.default,
        }
    }
}

/// A regex over bytes, compared by its source (configs are compared on reload).
#[derive(Debug, Clone)]
pub struct Pattern {
    pub source: String,
    re: regex::bytes::Regex,
}

impl PartialEq for Pattern {
    fn eq(&self, o: &Pattern) -> bool {
        self.source == o.source
    }
}

impl Pattern {
    /// Compile `source` within [`REGEX_SIZE_LIMIT`]; the error is the crate's, for the config
    /// problem.
    pub fn new(source: &str) -> Result<Pattern, String> {
        regex::bytes::RegexBuilder::new(source)
            .size_limit(REGEX_SIZE_LIMIT)
            .dfa_size_limit(REGEX_SIZE_LIMIT)
            .build()
            .map(|re| Pattern {
                source: source.to_owned(),
                re,
            })
            .map_err(|e| e.to_string())
    }

    /// Whether the pattern matches anywhere in `v` (anchor with `^...$`), as HAProxy and
    /// Kamailio match.
    pub fn is_match(&self, v: &[u8]) -> bool {
        self.re.is_match(v)
    }
}

/// Byte strings by prefix: a trie of the configured prefixes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Prefixes {
    /// Node 0 is the root; each node's children as (byte, node), and whether a prefix ends there.
    nodes: Vec<(Vec<(u8, u32)>, bool)>,
}

impl Prefixes {
    pub fn new<'a>(items: impl IntoIterator<Item = &'a [u8]>) -> Prefixes {
        let mut t = Prefixes {
            nodes: vec![(Vec::new(), false)],
        };
        for p in items {
            let mut n = 0usize;
            for &b in p {
                n = match t.nodes[n].0.iter().find(|(c, _)| *c == b) {
                    Some(&(_, next)) => next as usize,
                    None => {
                        let next = t.nodes.len();
                        t.nodes.push((Vec::new(), false));
                        t.nodes[n].0.push((b, next as u32));
                        next
                    }
                };
            }
            t.nodes[n].1 = true;
        }
        t
    }

    /// Whether some prefix starts `v` (the empty prefix starts everything).
    pub fn starts(&self, v: &[u8]) -> bool {
        let mut n = 0usize;
        if self.nodes[n].1 {
            return true;
        }
        for &b in v {
            match self.nodes[n].0.iter().find(|(c, _)| *c == b) {
                Some(&(_, next)) => n = next as usize,
                None => return false,
            }
            if self.nodes[n].1 {
                return true;
            }
        }
        false
    }
}

/// A text test: any of exact values, prefixes, regexes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Text {
    pub exact: Set,
    pub prefix: Option<Prefixes>,
    pub regex: Vec<Pattern>,
}

impl Text {
    pub fn holds(&self, v: &[u8]) -> bool {
        self.exact.contains(v)
            || self.prefix.as_ref().is_some_and(|p| p.starts(v))
            || self.regex.iter().any(|r| r.is_match(v))
    }
}

/// Host names: exact, or `*.suffix` (any name below the suffix, not the suffix itself), case-
/// insensitive. Kept lower-cased.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hosts {
    pub exact: Set,
    /// The suffixes of `*.suffix`, without `*.`.
    pub below: Set,
}

impl Hosts {
    /// Add `name` (`*.suffix` or a host); false when it is empty, too long or holds another `*`.
    pub fn add(&mut self, name: &str) -> bool {
        let n = name.trim().to_ascii_lowercase();
        let (set, host) = match n.strip_prefix("*.") {
            Some(s) => (&mut self.below, s.trim_end_matches('.')),
            None => (&mut self.exact, n.trim_end_matches('.')),
        };
        if host.is_empty() || host.contains('*') || host.len() > 255 {
            return false;
        }
        set.insert(host.as_bytes().to_vec());
        true
    }

    pub fn holds(&self, host: &[u8]) -> bool {
        let mut buf = [0u8; 256];
        let Some(h) = buf.get_mut(..host.len()) else {
            return false;
        };
        h.copy_from_slice(host);
        h.make_ascii_lowercase();
        let h = h.strip_suffix(b".").unwrap_or(h);
        if self.exact.contains(h) {
            return true;
        }
        if self.below.is_empty() {
            return false;
        }
        // Each proper suffix that starts after a dot: `a.b.example.com` asks
        // `b.example.com`, `example.com`, `com`.
        h.iter()
            .enumerate()
            .filter(|(_, c)| **c == b'.')
            .any(|(i, _)| self.below.contains(&h[i + 1..]))
    }
}

/// A header test: the header's first value (a name's compact form is the same header).
#[derive(Debug, Clone, PartialEq)]
pub struct HeaderTest {
    /// The name as configured, and its other form (long or compact, RFC 3261 §7.3.3 and the
    /// extensions' compact forms), if it has one.
    pub name: String,
    pub alias: Option<&'static str>,
    pub test: HeaderValue,
}

#[derive(Debug, Clone, PartialEq)]
pub enum HeaderValue {
    /// `present: true` (the header is there) or `false` (it is not).
    Present(bool),
    Text(Text),
}

/// The compact forms of header names (RFC 3261 §7.3.3, RFC 3515, RFC 3892, RFC 4028,
/// RFC 3841, RFC 6665, RFC 8224).
pub const COMPACT: &[(&str, &str)] = &[
    ("Call-ID", "i"),
    ("Contact", "m"),
    ("Content-Encoding", "e"),
    ("Content-Length", "l"),
    ("Content-Type", "c"),
    ("From", "f"),
    ("Subject", "s"),
    ("Supported", "k"),
    ("To", "t"),
    ("Via", "v"),
    ("Refer-To", "r"),
    ("Referred-By", "b"),
    ("Session-Expires", "x"),
    ("Accept-Contact", "a"),
    ("Reject-Contact", "j"),
    ("Request-Disposition", "d"),
    ("Allow-Events", "u"),
    ("Event", "o"),
    ("Identity", "y"),
];

/// The other form of a header name (long for a compact one, compact for a long one).
pub fn alias_of(name: &str) -> Option<&'static str> {
    COMPACT.iter().find_map(|(long, short)| {
        if long.eq_ignore_ascii_case(name) {
            Some(*short)
        } else if short.eq_ignore_ascii_case(name) {
            Some(*long)
        } else {
            None
        }
    })
}

/// `local`: the address a request arrived on, with or without its port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Local {
    pub ip: std::net::IpAddr,
    pub port: Option<u16>,
}

/// The tests of one rule; an absent test holds. A rule with none holds for every request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Match {
    /// Method names (case-sensitive).
    pub methods: Option<Vec<Vec<u8>>>,
    pub ruri_user: Option<Text>,
    /// Compare the Request-URI's user as a number: without a leading `+` and without the tel
    /// visual separators `-`, `.`, `(`, `)` (RFC 3966 §3), and without its `;` parameters.
    pub normalize: bool,
    pub ruri_host: Option<Hosts>,
    pub to_host: Option<Hosts>,
    pub from_host: Option<Hosts>,
    pub from_user: Option<Prefixes>,
    pub source: Option<Vec<Cidr>>,
    pub headers: Vec<HeaderTest>,
    pub local: Option<Vec<Local>>,
    /// The TLS server name (tcp vservers): the ClientHello's, or the handshake's with TLS
    /// terminated.
    pub sni: Option<Hosts>,
    /// The TLS application protocol (tcp vservers): any the ClientHello offers, or the one
    /// negotiated with TLS terminated. In file order (a few names: compared one by one).
    pub alpn: Option<Vec<Vec<u8>>>,
    /// The HTTP request's host: the absolute target's, else the Host header's, without port.
    pub host: Option<Hosts>,
    /// The start of the HTTP request target's path (`/api/` holds for `/api/v1?x=1`).
    pub path_prefix: Option<Prefixes>,
}

/// A number as `normalize: true` compares it.
pub fn normalize_number(v: &[u8], out: &mut Vec<u8>) {
    out.clear();
    let v = v.split(|&c| c == b';').next().unwrap_or(v);
    let v = v.strip_prefix(b"+").unwrap_or(v);
    out.extend(
        v.iter()
            .copied()
            .filter(|c| !matches!(c, b'-' | b'.' | b'(' | b')' | b' ')),
    );
}

/// [`normalize_number`] into `buf` when it fits (no allocation for a phone number).
fn normalized<'b>(v: &[u8], buf: &'b mut [u8; 64]) -> Option<&'b [u8]> {
    let v = v.split(|&c| c == b';').next().unwrap_or(v);
    let v = v.strip_prefix(b"+").unwrap_or(v);
    let mut n = 0;
    for &c in v {
        if matches!(c, b'-' | b'.' | b'(' | b')' | b' ') {
            continue;
        }
        *buf.get_mut(n)? = c;
        n += 1;
    }
    Some(&buf[..n])
}

impl Match {
    /// Whether the rule has no test at all (it matches every request).
    pub fn is_unconditional(&self) -> bool {
        *self == Match::default()
    }

    pub fn holds(&self, r: &mut Request<'_, '_>) -> bool {
        if let Some(ms) = &self.methods {
            let m = r.method().unwrap_or(b"");
            if !ms.iter().any(|x| x.as_slice() == m) {
                return false;
            }
        }
        if let Some(cidrs) = &self.source {
            let ip = r.src.ip();
            if !cidrs.iter().any(|c| c.contains(ip)) {
                return false;
            }
        }
        if let Some(locals) = &self.local {
            let (ip, port) = (r.local.ip().to_canonical(), r.local.port());
            if !locals
                .iter()
                .any(|l| l.ip.to_canonical() == ip && l.port.is_none_or(|p| p == port))
            {
                return false;
            }
        }
        if let Some(t) = &self.ruri_user {
            let Some(u) = r.ruri().1 else {
                return false;
            };
            let ok = if self.normalize {
                let mut buf = [0u8; 64];
                match normalized(u, &mut buf) {
                    Some(n) => t.holds(n),
                    None => {
                        let mut n = Vec::with_capacity(u.len());
                        normalize_number(u, &mut n);
                        t.holds(&n)
                    }
                }
            } else {
                t.holds(u)
            };
            if !ok {
                return false;
            }
        }
        if let Some(h) = &self.ruri_host
            && !r.ruri().0.is_some_and(|x| h.holds(x))
        {
            return false;
        }
        if let Some(h) = &self.to_host
            && !r.callee_host().is_some_and(|x| h.holds(x))
        {
            return false;
        }
        if let Some(h) = &self.from_host
            && !r.from().0.is_some_and(|x| h.holds(x))
        {
            return false;
        }
        if let Some(p) = &self.from_user
            && !r.from().1.is_some_and(|x| p.starts(x))
        {
            return false;
        }
        if !self.holds_stream(r) {
            return false;
        }
        if self.headers.is_empty() {
            return true;
        }
        let headers = r.headers();
        self.headers.iter().all(|h| {
            let v = headers
                .iter()
                .find(|(name, _)| {
                    name.eq_ignore_ascii_case(h.name.as_bytes())
                        || h.alias
                            .is_some_and(|a| name.eq_ignore_ascii_case(a.as_bytes()))
                })
                .map(|(_, value)| *value);
            match (&h.test, v) {
                (HeaderValue::Present(want), v) => v.is_some() == *want,
                (HeaderValue::Text(t), Some(v)) => t.holds(v),
                (HeaderValue::Text(_), None) => false,
            }
        })
    }

    /// The TLS and HTTP tests (none of them holds on a request that lacks the field).
    fn holds_stream(&self, r: &Request<'_, '_>) -> bool {
        if let Some(h) = &self.sni
            && !r.sni().is_some_and(|x| h.holds(x))
        {
            return false;
        }
        if let Some(set) = &self.alpn
            && !r.alpn().iter().any(|p| set.contains(p))
        {
            return false;
        }
        if let Some(h) = &self.host
            && !r.http_host().is_some_and(|x| h.holds(x))
        {
            return false;
        }
        if let Some(p) = &self.path_prefix
            && !r.path().is_some_and(|x| p.starts(x))
        {
            return false;
        }
        true
    }
}

type HostUser<'a> = (Option<&'a [u8]>, Option<&'a [u8]>);

/// What a rule reads besides the addresses.
#[derive(Debug, Clone, Copy)]
pub enum Subject<'m, 'a> {
    /// A SIP request, as scanned.
    Sip(&'m SipMsg<'a>),
    /// A tcp connection over TLS: the server name and the application protocols (offered by
    /// the ClientHello, or the one negotiated with TLS terminated); `None` and none when the
    /// connection is not TLS or its hello was unreadable.
    Tls {
        sni: Option<&'a [u8]>,
        alpn: &'m [Vec<u8>],
    },
    /// An HTTP/1.x request head; `None` when the head did not parse.
    Http(Option<&'m HttpHead<'a>>),
    /// A connection of which nothing is read (rules on the addresses only).
    Connection,
}

/// A request as the rules read it: what was read of it, its source and the address it arrived
/// on, with each parsed field kept once parsed.
pub struct Request<'m, 'a> {
    subject: Subject<'m, 'a>,
    pub src: SocketAddr,
    pub local: SocketAddr,
    ruri: Option<HostUser<'a>>,
    from: Option<HostUser<'a>>,
    to_host: Option<Option<&'a [u8]>>,
    /// Every header's name and first-line value, read once for the header tests.
    headers: Option<Vec<(&'a [u8], &'a [u8])>>,
}

impl<'m, 'a> Request<'m, 'a> {
    /// A SIP request's.
    pub fn new(msg: &'m SipMsg<'a>, src: SocketAddr, local: SocketAddr) -> Self {
        Request::of(Subject::Sip(msg), src, local)
    }

    pub fn of(subject: Subject<'m, 'a>, src: SocketAddr, local: SocketAddr) -> Self {
        Request {
            subject,
            src,
            local,
            ruri: None,
            from: None,
            to_host: None,
            headers: None,
        }
    }

    /// Every header line's name and value, trimmed: one pass over the header lines without
    /// the scanner's full parse of each (a folded value's continuation lines are left out:
    /// folding is obsolete, RFC 3261 §7.3.1, and the tests read the first line).
    fn headers(&mut self) -> &[(&'a [u8], &'a [u8])] {
        let msg = match self.subject {
            Subject::Sip(msg) => msg,
            Subject::Http(head) => {
                return self
                    .headers
                    .get_or_insert_with(|| head.map_or_else(Vec::new, |h| h.headers().collect()));
            }
            _ => return &[],
        };
        self.headers.get_or_insert_with(|| {
            let buf = msg.buf();
            let head = buf
                .get(msg.headers_start()..msg.headers_end())
                .unwrap_or_default();
            let mut out = Vec::with_capacity(msg.header_count());
            let mut start = 0;
            for end in memchr::memchr_iter(b'\n', head).chain([head.len()]) {
                let line = &head[start..end];
                start = end + 1;
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                if line.first().is_none_or(|c| *c == b' ' || *c == b'\t') {
                    continue;
                }
                let Some(colon) = memchr::memchr(b':', line) else {
                    continue;
                };
                out.push((line[..colon].trim_ascii(), line[colon + 1..].trim_ascii()));
            }
            out
        })
    }

    /// The method: a SIP request's, an HTTP request's.
    fn method(&self) -> Option<&'a [u8]> {
        match self.subject {
            Subject::Sip(msg) => msg.method(),
            Subject::Http(head) => head.map(|h| h.method().as_bytes()),
            _ => None,
        }
    }

    fn sni(&self) -> Option<&'a [u8]> {
        match self.subject {
            Subject::Tls { sni, .. } => sni,
            _ => None,
        }
    }

    fn alpn(&self) -> &'m [Vec<u8>] {
        match self.subject {
            Subject::Tls { alpn, .. } => alpn,
            _ => &[],
        }
    }

    fn http_host(&self) -> Option<&'a [u8]> {
        match self.subject {
            Subject::Http(Some(h)) => h.host(),
            _ => None,
        }
    }

    /// The HTTP target's path: origin-form as it is, absolute-form from the `/` after its
    /// authority (`*` and authority-form have none), without query or fragment.
    fn path(&self) -> Option<&'a [u8]> {
        let Subject::Http(Some(h)) = self.subject else {
            return None;
        };
        let t = h.target();
        let t = if t.starts_with(b"/") {
            t
        } else {
            let rest = &t[memchr::memmem::find(t, b"://")? + 3..];
            &rest[memchr::memchr(b'/', rest)?..]
        };
        let end = t
            .iter()
            .position(|&c| c == b'?' || c == b'#')
            .unwrap_or(t.len());
        Some(&t[..end])
    }

    fn sip(&self) -> Option<&'m SipMsg<'a>> {
        match self.subject {
            Subject::Sip(msg) => Some(msg),
            _ => None,
        }
    }

    /// The Request-URI's host and user; a `tel:` URI has a user (the number) and no host.
    fn ruri(&mut self) -> HostUser<'a> {
        let Some(msg) = self.sip() else {
            return (None, None);
        };
        *self.ruri.get_or_insert_with(|| {
            let Some(u) = msg.request_uri() else {
                return (None, None);
            };
            if let Some(p) = parse_uri(u) {
                return (Some(p.host), p.user.map(user_only));
            }
            match u.split_first_chunk::<4>() {
                Some((s, rest)) if s.eq_ignore_ascii_case(b"tel:") => {
                    (None, rest.split(|&c| c == b';').next())
                }
                _ => (None, None),
            }
        })
    }

    fn from(&mut self) -> HostUser<'a> {
        let Some(msg) = self.sip() else {
            return (None, None);
        };
        *self.from.get_or_insert_with(|| {
            let uri = msg
                .from_header()
                .and_then(parse_name_addr)
                .and_then(|na| parse_uri(na.uri));
            match uri {
                Some(u) => (Some(u.host), u.user.map(user_only)),
                None => (None, None),
            }
        })
    }

    fn callee_host(&mut self) -> Option<&'a [u8]> {
        let msg = self.sip()?;
        *self.to_host.get_or_insert_with(|| msg.to_host())
    }
}

/// A URI's user without a password (`user:password`); its `;` parameters (a telephone-
/// subscriber's) stay for `normalize` to cut.
fn user_only(u: &[u8]) -> &[u8] {
    u.split(|&c| c == b':').next().unwrap_or(u)
}

/// Whether `msg` may be routed by rules at all: a request other than ACK and CANCEL (those
/// follow their INVITE). The caller has already let a request that belongs to a dialog, or
/// names fulcrum's service in its Route, go its way.
pub fn applies_to(msg: &SipMsg<'_>) -> bool {
    msg.is_request() && !matches!(msg.method_kind(), SipMethod::Ack | SipMethod::Cancel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sip::scan;

    fn req(ruri: &str, from: &str, to: &str, extra: &str) -> Vec<u8> {
        format!(
            "INVITE {ruri} SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1:5060;branch=z9hG4bK1\r\nFrom: <{from}>;tag=a\r\nTo: <{to}>\r\nCall-ID: c1\r\nCSeq: 1 INVITE\r\nMax-Forwards: 70\r\n{extra}Content-Length: 0\r\n\r\n"
        )
        .into_bytes()
    }

    fn at(ip: &str) -> SocketAddr {
        ip.parse().expect("addr")
    }

    fn holds(m: &Match, buf: &[u8]) -> bool {
        let msg = scan(buf).expect("scan");
        let mut r = Request::new(&msg, at("10.0.0.1:5060"), at("192.0.2.1:5060"));
        m.holds(&mut r)
    }

    fn text_prefix(p: &[&str]) -> Text {
        Text {
            prefix: Some(Prefixes::new(p.iter().map(|s| s.as_bytes()))),
            ..Text::default()
        }
    }

    #[test]
    fn the_trie_finds_any_prefix_and_only_prefixes() {
        let t = Prefixes::new([&b"112"[..], b"911", b"1911", b"91"]);
        assert!(t.starts(b"112"));
        assert!(t.starts(b"91100"));
        assert!(t.starts(b"915"));
        assert!(!t.starts(b"11"));
        assert!(!t.starts(b"2112"));
        assert!(!t.starts(b""));
        assert!(Prefixes::new([&b""[..]]).starts(b"anything"));
    }

    #[test]
    fn numbers_are_normalised_when_asked() {
        let m = Match {
            ruri_user: Some(text_prefix(&["1911"])),
            normalize: true,
            ..Match::default()
        };
        assert!(holds(&m, &req("sip:+1-911@x", "sip:a@b", "sip:c@d", "")));
        assert!(holds(
            &m,
            &req("sip:(1)911;isub=2@x", "sip:a@b", "sip:c@d", "")
        ));
        assert!(holds(&m, &req("tel:+1.911.555", "sip:a@b", "sip:c@d", "")));
        assert!(!holds(&m, &req("sip:+2911@x", "sip:a@b", "sip:c@d", "")));
        let raw = Match {
            normalize: false,
            ..m
        };
        assert!(!holds(&raw, &req("sip:+1-911@x", "sip:a@b", "sip:c@d", "")));
    }

    #[test]
    fn hosts_match_exactly_or_below_a_suffix_whatever_the_case() {
        let mut h = Hosts::default();
        assert!(h.add("b.example.com"));
        assert!(h.add("*.c.example.com"));
        assert!(!h.add("*."));
        assert!(h.holds(b"B.Example.COM"));
        assert!(h.holds(b"b.example.com."));
        assert!(h.holds(b"x.y.c.example.com"));
        assert!(
            !h.holds(b"c.example.com"),
            "the suffix itself is not below it"
        );
        assert!(!h.holds(b"xc.example.com"));
        assert!(!h.holds(b"example.com"));
        assert!(!h.holds(&[b'a'; 300]), "too long for any rule");
        let m = Match {
            ruri_host: Some(h.clone()),
            ..Match::default()
        };
        assert!(holds(
            &m,
            &req(
                "sip:u@B.example.com:5070;transport=udp",
                "sip:a@b",
                "sip:c@d",
                ""
            )
        ));
        assert!(!holds(&m, &req("tel:+15551234", "sip:a@b", "sip:c@d", "")));
        let to = Match {
            to_host: Some(h.clone()),
            ..Match::default()
        };
        assert!(holds(
            &to,
            &req("sip:u@z", "sip:a@b", "sip:c@q.c.example.com", "")
        ));
        let from = Match {
            from_host: Some(h),
            ..Match::default()
        };
        assert!(!holds(
            &from,
            &req("sip:u@z", "sip:a@b", "sip:c@q.c.example.com", "")
        ));
        assert!(holds(
            &from,
            &req("sip:u@z", "sip:a@b.example.com", "sip:c@d", "")
        ));
    }

    #[test]
    fn headers_match_by_either_form_of_their_name() {
        let ua = |re: &str| HeaderTest {
            name: "User-Agent".into(),
            alias: alias_of("User-Agent"),
            test: HeaderValue::Text(Text {
                regex: vec![Pattern::new(re).expect("regex")],
                ..Text::default()
            }),
        };
        let m = Match {
            headers: vec![ua("(?i)friendly-scanner|sipvicious")],
            ..Match::default()
        };
        assert!(holds(
            &m,
            &req(
                "sip:u@x",
                "sip:a@b",
                "sip:c@d",
                "User-Agent: SIPVicious 0.3\r\n"
            )
        ));
        assert!(holds(
            &m,
            &req(
                "sip:u@x",
                "sip:a@b",
                "sip:c@d",
                "user-agent: friendly-scanner\r\n"
            )
        ));
        assert!(!holds(
            &m,
            &req("sip:u@x", "sip:a@b", "sip:c@d", "User-Agent: Linphone\r\n")
        ));
        assert!(!holds(&m, &req("sip:u@x", "sip:a@b", "sip:c@d", "")));
        let subject = Match {
            headers: vec![HeaderTest {
                name: "Subject".into(),
                alias: alias_of("Subject"),
                test: HeaderValue::Text(Text {
                    exact: [b"conf-7".to_vec()].into_iter().collect(),
                    ..Text::default()
                }),
            }],
            ..Match::default()
        };
        assert_eq!(alias_of("subject"), Some("s"));
        assert!(holds(
            &subject,
            &req("sip:u@x", "sip:a@b", "sip:c@d", "s: conf-7\r\n")
        ));
        let absent = Match {
            headers: vec![HeaderTest {
                name: "X-Tenant".into(),
                alias: None,
                test: HeaderValue::Present(false),
            }],
            ..Match::default()
        };
        assert!(holds(&absent, &req("sip:u@x", "sip:a@b", "sip:c@d", "")));
        assert!(!holds(
            &absent,
            &req("sip:u@x", "sip:a@b", "sip:c@d", "X-Tenant: 1\r\n")
        ));
    }

    #[test]
    fn the_first_rule_that_holds_wins_and_nothing_falls_to_the_default() {
        let routes = Routes {
            client_hello_timeout: CLIENT_HELLO_TIMEOUT,
            rules: vec![
                Rule {
                    name: "reg".into(),
                    test: Match {
                        methods: Some(vec![b"REGISTER".to_vec()]),
                        ..Match::default()
                    },
                    target: Target::Pool(1),
                },
                Rule {
                    name: "lan".into(),
                    test: Match {
                        source: Some(vec![Cidr::parse("10.0.0.0/8").expect("cidr")]),
                        local: Some(vec![Local {
                            ip: "192.0.2.1".parse().expect("ip"),
                            port: Some(5060),
                        }]),
                        ..Match::default()
                    },
                    target: Target::Drop,
                },
            ],
            default: Target::Reject {
                code: 404,
                reason: "Not Found".into(),
            },
        };
        let buf = req("sip:u@x", "sip:a@b", "sip:c@d", "");
        let msg = scan(&buf).expect("scan");
        let mut r = Request::new(&msg, at("10.1.2.3:5060"), at("192.0.2.1:5060"));
        assert_eq!(routes.decide(&mut r).rule, Some(1));
        let mut r = Request::new(&msg, at("10.1.2.3:5060"), at("192.0.2.1:5070"));
        assert_eq!(routes.decide(&mut r).rule, None, "another port");
        let mut r = Request::new(&msg, at("[2001:db8::1]:5060"), at("192.0.2.1:5060"));
        assert_eq!(routes.decide(&mut r).target, &routes.default);
        let reg = String::from_utf8(buf)
            .expect("utf8")
            .replace("INVITE", "REGISTER");
        let msg = scan(reg.as_bytes()).expect("scan");
        let mut r = Request::new(&msg, at("10.1.2.3:5060"), at("192.0.2.1:5060"));
        assert_eq!(routes.decide(&mut r).target, &Target::Pool(1));
        assert!(Match::default().is_unconditional());
    }

    #[test]
    fn a_regex_too_large_is_refused() {
        assert!(Pattern::new("(").is_err());
        assert!(Pattern::new(r"\w{1000}\w{1000}\w{1000}").is_err());
    }
}
