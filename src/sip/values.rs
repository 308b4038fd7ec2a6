//! Header values a proxy reads, parsed on demand from the bytes the scanner indexed, without
//! copying: Via (RFC 3261 §20.42, `received` / `rport` of RFC 3581), SIP URIs (§19.1),
//! name-addr (§20.10, §25.1), CSeq, Max-Forwards. PURE.

use super::lex::*;
use memchr::memchr;
use std::net::IpAddr;

/// The parts of one Via value (RFC 3261 §20.42, RFC 3581 for `rport`).
/// A Via's `rport` parameter (RFC 3581 §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rport {
    /// No `rport`: replies go to the sent-by port.
    Absent,
    /// `;rport` without a value: the client asks for replies to its source port.
    Requested,
    /// `rport=n`, as filled in by a server or proxy.
    Filled(u16),
}

impl Rport {
    /// Whether the parameter is there at all, with or without a value.
    pub fn is_present(self) -> bool {
        self != Rport::Absent
    }
}

/// A request's Max-Forwards header (RFC 3261 §8.1.1.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaxForwards {
    /// No Max-Forwards header.
    Absent,
    /// A value that fits a `u32`.
    Value(u32),
    /// A header whose value is not a decimal number that fits a `u32`.
    Bad,
}

impl MaxForwards {
    /// The value, when present and well formed.
    pub fn value(self) -> Option<u32> {
        match self {
            MaxForwards::Value(n) => Some(n),
            MaxForwards::Absent | MaxForwards::Bad => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Via<'a> {
    /// The whole via-parm, e.g. `SIP/2.0/UDP 10.0.0.1:5060;branch=z9hG4bK1`.
    pub raw: &'a [u8],
    /// `UDP`, `TCP`, `TLS`, ... as written.
    pub transport: &'a [u8],
    /// sent-by host; IPv6 references without their brackets.
    pub host: &'a [u8],
    pub port: Option<u16>,
    pub branch: Option<&'a [u8]>,
    /// `received` value (brackets removed if a peer added them).
    pub received: Option<&'a [u8]>,
    /// The `rport` parameter (RFC 3581 §4).
    pub rport: Rport,
    /// Range of the whole via-parm in the message buffer.
    pub span: Span,
    /// Range of the `rport[=n]` parameter (without the `;`).
    pub(crate) rport_param: Option<Span>,
    /// Range of the `received=x` parameter (without the `;`).
    pub(crate) received_param: Option<Span>,
    /// Range of the `name=value` of a parameter named by the caller of `parse_via`.
    pub(crate) extra_param: Option<Span>,
}

impl Via<'_> {
    /// `true` when `host` is an IPv6 reference (it needs brackets when printed with a port).
    pub fn is_ipv6(&self) -> bool {
        self.host.contains(&b':')
    }

    /// The sent-by host as an IP address, when it is one.
    pub fn host_ip(&self) -> Option<IpAddr> {
        parse_ip(self.host)
    }

    /// `true` when the branch is an RFC 3261 branch (§8.1.1.7): the magic cookie followed by
    /// an id. A bare cookie is no transaction id at all (RFC 4475 §3.2.1): such a request is
    /// handled as an RFC 2543 one.
    pub fn has_cookie(&self) -> bool {
        self.branch
            .is_some_and(|b| b.len() > 7 && b.starts_with(b"z9hG4bK"))
    }
}

/// Parse an IP address written as text; IPv6 with or without brackets.
pub fn parse_ip(s: &[u8]) -> Option<IpAddr> {
    let s = s
        .strip_prefix(b"[")
        .and_then(|s| s.strip_suffix(b"]"))
        .unwrap_or(s);
    std::str::from_utf8(s).ok()?.parse().ok()
}

pub(crate) struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn skip_lws(&mut self) {
        while self.i < self.b.len() && is_lws(self.b[self.i]) {
            self.i += 1;
        }
    }
    fn eat(&mut self, c: u8) -> bool {
        self.skip_lws();
        if self.b.get(self.i) == Some(&c) {
            self.i += 1;
            self.skip_lws();
            true
        } else {
            false
        }
    }
    fn take_while(&mut self, f: impl Fn(u8) -> bool) -> (usize, usize) {
        let s = self.i;
        while self.i < self.b.len() && f(self.b[self.i]) {
            self.i += 1;
        }
        (s, self.i)
    }
    fn token(&mut self) -> Option<&'a [u8]> {
        let (s, e) = self.take_while(is_token_char);
        (e > s).then(|| &self.b[s..e])
    }
}

/// Parse one via-parm occupying `span` of `buf`. `extra` names one more parameter whose range
/// the caller wants (fulcrum's connection id).
pub(crate) fn parse_via<'a>(buf: &'a [u8], span: Span, extra: &[u8]) -> Option<Via<'a>> {
    let raw = buf.get(span.start..span.end)?;
    let mut c = Cursor { b: raw, i: 0 };
    c.skip_lws();
    // sent-protocol = protocol-name SLASH protocol-version SLASH transport; SLASH = SWS "/" SWS
    if !c.token()?.eq_ignore_ascii_case(b"SIP") || !c.eat(b'/') {
        return None;
    }
    if c.token()? != b"2.0" || !c.eat(b'/') {
        return None;
    }
    let transport = c.token()?;
    c.skip_lws();
    let host = if c.b.get(c.i) == Some(&b'[') {
        let (s, e) = c.take_while(|ch| ch != b']');
        if c.b.get(c.i) != Some(&b']') {
            return None;
        }
        c.i += 1;
        &raw[s + 1..e]
    } else {
        let (s, e) = c.take_while(is_token_char);
        &raw[s..e]
    };
    if host.is_empty() {
        return None;
    }
    let mut port = None;
    if c.eat(b':') {
        let (s, e) = c.take_while(|ch| ch.is_ascii_digit());
        port = Some(parse_port(&raw[s..e])?);
    }
    let mut via = Via {
        raw,
        transport,
        host,
        port,
        branch: None,
        received: None,
        rport: Rport::Absent,
        span,
        rport_param: None,
        received_param: None,
        extra_param: None,
    };
    loop {
        c.skip_lws();
        if c.i >= raw.len() {
            break;
        }
        if !c.eat(b';') {
            return None;
        }
        let ps = c.i;
        let name = c.token()?;
        let mut value: Option<&[u8]> = None;
        let mut vspan = None;
        if c.eat(b'=') {
            let (s, e) = if c.b.get(c.i) == Some(&b'"') {
                let q = find_unquoted(&raw[c.i..], b';').map_or(raw.len(), |n| c.i + n);
                let s = c.i;
                c.i = q;
                (s, trim_lws_span(raw, s, q).1)
            } else {
                // Token plus the characters of IPv6 references (`received=[::1]`, RFC 5118).
                c.take_while(|ch| is_token_char(ch) || matches!(ch, b':' | b'[' | b']'))
            };
            if e == s {
                return None;
            }
            value = Some(&raw[s..e]);
            vspan = Some(Span::new(span.start + s, span.start + e));
        }
        let pe = c.i;
        let pspan = Span::new(span.start + ps, span.start + trim_lws_span(raw, ps, pe).1);
        if name.eq_ignore_ascii_case(b"branch") {
            via.branch = value;
        } else if name.eq_ignore_ascii_case(b"received") {
            via.received = value.map(|v| {
                v.strip_prefix(b"[")
                    .and_then(|v| v.strip_suffix(b"]"))
                    .unwrap_or(v)
            });
            via.received_param = Some(pspan);
        } else if name.eq_ignore_ascii_case(b"rport") {
            via.rport = match value {
                Some(v) => Rport::Filled(parse_port(v)?),
                None => Rport::Requested,
            };
            via.rport_param = Some(pspan);
        } else if !extra.is_empty() && name.eq_ignore_ascii_case(extra) {
            via.extra_param = vspan;
        }
    }
    Some(via)
}

pub(crate) fn parse_port(s: &[u8]) -> Option<u16> {
    let n = parse_decimal(s)?;
    u16::try_from(n).ok()
}

/// The parts of a SIP or SIPS URI (RFC 3261 §19.1.1) that routing needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uri<'a> {
    pub scheme: &'a [u8],
    pub user: Option<&'a [u8]>,
    /// Host; IPv6 references without their brackets.
    pub host: &'a [u8],
    pub port: Option<u16>,
    /// `;params` after the host (without the first `;`), before any `?headers`.
    pub params: &'a [u8],
    /// `?headers` part (without the `?`).
    pub headers: &'a [u8],
}

impl<'a> Uri<'a> {
    /// `true` for `sips:` (default port 5061, RFC 3261 §19.1.2).
    pub fn is_sips(&self) -> bool {
        self.scheme.eq_ignore_ascii_case(b"sips")
    }

    /// The value of a URI parameter (`lr` gives `Some(b"")`).
    pub fn param(&self, name: &[u8]) -> Option<&'a [u8]> {
        self.params.split(|&c| c == b';').find_map(|p| {
            let (n, v) = match memchr(b'=', p) {
                Some(i) => (&p[..i], &p[i + 1..]),
                None => (p, &p[p.len()..]),
            };
            n.eq_ignore_ascii_case(name).then_some(v)
        })
    }

    /// The value of a `?headers` entry.
    pub fn header_param(&self, name: &[u8]) -> Option<&'a [u8]> {
        self.headers.split(|&c| c == b'&').find_map(|p| {
            let i = memchr(b'=', p)?;
            p[..i].eq_ignore_ascii_case(name).then_some(&p[i + 1..])
        })
    }
}

/// Parse a `sip:`/`sips:` URI. Other schemes (`tel:`, ...) carry no host and give `None`.
pub fn parse_uri(uri: &[u8]) -> Option<Uri<'_>> {
    let colon = memchr(b':', uri)?;
    let scheme = &uri[..colon];
    if !(scheme.eq_ignore_ascii_case(b"sip") || scheme.eq_ignore_ascii_case(b"sips")) {
        return None;
    }
    let rest = &uri[colon + 1..];
    // `@` cannot occur unescaped in params or headers, but the user part may hold `;` and `?`.
    let (user, hostpart) = match memchr::memrchr(b'@', rest) {
        Some(at) => (Some(&rest[..at]), &rest[at + 1..]),
        None => (None, rest),
    };
    let (host, after) = if hostpart.first() == Some(&b'[') {
        let close = memchr(b']', hostpart)?;
        (&hostpart[1..close], &hostpart[close + 1..])
    } else {
        let end = hostpart
            .iter()
            .position(|&c| matches!(c, b':' | b';' | b'?'))
            .unwrap_or(hostpart.len());
        (&hostpart[..end], &hostpart[end..])
    };
    if host.is_empty() || host.iter().any(|&c| c <= b' ') {
        return None;
    }
    let (port, after) = match after.strip_prefix(b":") {
        Some(p) => {
            let end = p
                .iter()
                .position(|&c| matches!(c, b';' | b'?'))
                .unwrap_or(p.len());
            (Some(parse_port(&p[..end])?), &p[end..])
        }
        None => (None, after),
    };
    let (params, headers) = match memchr(b'?', after) {
        Some(q) => (&after[..q], &after[q + 1..]),
        None => (after, &after[after.len()..]),
    };
    let params = params.strip_prefix(b";").unwrap_or(params);
    Some(Uri {
        scheme,
        user,
        host,
        port,
        params,
        headers,
    })
}

/// The URI and header parameters of a name-addr / addr-spec value (From, To, Route,
/// Record-Route, Contact; RFC 3261 §20.10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NameAddr<'a> {
    pub uri: &'a [u8],
    /// `;params` after the URI (or after `>`), without the first `;`.
    pub params: &'a [u8],
}

impl<'a> NameAddr<'a> {
    /// A header parameter such as `tag` (name case-insensitive, RFC 3261 §7.3.1).
    pub fn param(&self, name: &[u8]) -> Option<&'a [u8]> {
        let mut rest = self.params;
        loop {
            let end = find_unquoted(rest, b';').unwrap_or(rest.len());
            let p = &rest[..end];
            let (n, v) = match memchr(b'=', p) {
                Some(i) => (trim_lws(&p[..i]), trim_lws(&p[i + 1..])),
                None => (trim_lws(p), &p[p.len()..]),
            };
            if n.eq_ignore_ascii_case(name) {
                return Some(v);
            }
            if end >= rest.len() {
                return None;
            }
            rest = &rest[end + 1..];
        }
    }
}

/// Split a name-addr (`"Bob" <sip:bob@x>;tag=1`) or addr-spec (`sip:bob@x;tag=1`) value.
pub fn parse_name_addr(value: &[u8]) -> Option<NameAddr<'_>> {
    let v = trim_lws(value);
    if let Some(lt) = find_unquoted(v, b'<') {
        let gt = lt + memchr(b'>', &v[lt..])?;
        let uri = trim_lws(&v[lt + 1..gt]);
        let after = trim_lws(&v[gt + 1..]);
        let params = after.strip_prefix(b";").unwrap_or(&after[after.len()..]);
        return Some(NameAddr { uri, params });
    }
    // addr-spec form: the URI cannot contain `;` here (RFC 3261 §20), so `;` starts params.
    let end = memchr(b';', v).unwrap_or(v.len());
    let uri = trim_lws(&v[..end]);
    if uri.is_empty() {
        return None;
    }
    let params = v.get(end + 1..).unwrap_or(&[]);
    Some(NameAddr { uri, params })
}

/// CSeq number and method (RFC 3261 §20.16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CSeq<'a> {
    pub seq: u32,
    pub method: &'a [u8],
}

/// The delta-seconds of a Retry-After value (RFC 3261 §20.33:
/// `delta-seconds [ comment ] *( SEMI retry-param )`, e.g. `120 (in a meeting);duration=60`).
/// A value past 2^32-1 counts as 2^32-1 (the hold is capped far below that anyway); `None`
/// for a value that does not start with delta-seconds (an HTTP-date, which SIP's grammar
/// does not allow here, or garbage).
pub fn parse_retry_after(value: &[u8]) -> Option<u32> {
    let start = value.iter().position(|b| !b.is_ascii_whitespace())?;
    let value = &value[start..];
    let digits = value.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    match value.get(digits) {
        None | Some(b'(' | b';') => {}
        Some(b) if b.is_ascii_whitespace() => {}
        Some(_) => return None,
    }
    Some(value[..digits].iter().fold(0u32, |n, d| {
        n.saturating_mul(10).saturating_add(u32::from(d - b'0'))
    }))
}
