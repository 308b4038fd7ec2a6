//! Hash method → key, from a request context (docs/methods.md, Keys). PURE.
//!
//! A key borrows from the packet whenever the bytes can be hashed as they are; keys derived
//! from addresses, and host names that need lowercasing, live in a small inline array.
//! Nothing here allocates.
//!
//! Key bytes are part of the hashing contract (a change moves live traffic), so their layout
//! is fixed and documented:
//! - an address is `[4, a, b, c, d]` (IPv4) or `[6, 16 bytes]` (IPv6), after masking with
//!   `netmask` / `v6_netmask_len`. IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`, what a
//!   dual-stack socket reports for an IPv4 peer) are treated as IPv4, so one client hashes the
//!   same whichever socket it reached;
//! - `source_dest_ip_hash`: the two encoded addresses, smaller first (byte order), so swapping
//!   source and destination gives the same key;
//! - `source_ip_source_port_hash`: the encoded source address then the port, big-endian;
//! - `domain_hash`: the host lowercased (ASCII), one trailing dot removed, then its first
//!   `min(len, hash_length)` bytes. Lowercased hosts are copied into the inline array, which
//!   holds [`INLINE_KEY`] bytes: DNS names are at most 253 octets (RFC 1035 §2.3.4), so a
//!   longer "host" that also needs lowercasing is cut at 256 bytes.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use crate::config::{AorKey, HashParams, Method, TokenRule};
use crate::http::HttpHead;
use crate::sip::{SipMethod, SipMsg, parse_name_addr, parse_uri};

/// Capacity of an inline key.
pub const INLINE_KEY: usize = 256;

/// What the request carries beyond its addresses.
#[derive(Debug, Clone, Copy)]
pub enum Payload<'a> {
    Sip(&'a SipMsg<'a>),
    Http(&'a HttpHead<'a>),
    /// TCP/UDP payload bytes (first datagram or first read).
    Raw(&'a [u8]),
    None,
}

/// Everything a hash method may look at.
#[derive(Debug, Clone, Copy)]
pub struct RequestCtx<'a> {
    /// Client address.
    pub src: SocketAddr,
    /// Address the client sent to (from IP_PKTINFO or the accepted socket).
    pub dst: SocketAddr,
    pub payload: Payload<'a>,
}

/// Key bytes: borrowed from the request, or built inline.
// Boxing the inline variant is the heap allocation this type exists to avoid.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy)]
pub enum Key<'a> {
    Borrowed(&'a [u8]),
    Inline { len: u16, buf: [u8; INLINE_KEY] },
}

impl Key<'_> {
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Key::Borrowed(b) => b,
            Key::Inline { len, buf } => &buf[..usize::from(*len).min(INLINE_KEY)],
        }
    }

    fn inline(parts: &[&[u8]]) -> Key<'static> {
        let mut w = KeyWriter::default();
        for p in parts {
            w.push(p);
        }
        w.key()
    }
}

impl PartialEq for Key<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Key<'_> {}

impl std::fmt::Debug for Key<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key(\"{}\")", self.as_bytes().escape_ascii())
    }
}

/// Result of key extraction; the fallbacks follow docs/methods.md, Fallbacks.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOutcome<'a> {
    Key(Key<'a>),
    /// No key: fall back to `least_connection`. Also what non-hash methods get.
    NoKey,
    /// `url_hash` / `domain_hash` could not parse the request or found no domain: fall back to
    /// `round_robin`.
    Unparseable,
}

impl<'a> KeyOutcome<'a> {
    pub fn key(&self) -> Option<&Key<'a>> {
        match self {
            KeyOutcome::Key(k) => Some(k),
            _ => None,
        }
    }
}

/// True when [`extract`] reads `ctx.dst` for `method` (the local address a request arrived
/// on); an IO shell may skip finding that address out for every other method.
pub fn reads_local(method: Method) -> bool {
    matches!(method, Method::DestIpHash | Method::SourceDestIpHash)
}

/// Extract the key of `method` from `ctx`.
pub fn extract<'a>(method: Method, params: &HashParams, ctx: &RequestCtx<'a>) -> KeyOutcome<'a> {
    match method {
        Method::UrlHash => url_key(params, ctx),
        Method::DomainHash => domain_key(params, ctx),
        Method::DestIpHash => {
            let (b, n) = encode_ip(ctx.dst.ip(), params);
            KeyOutcome::Key(Key::inline(&[&b[..n]]))
        }
        Method::SourceIpHash => {
            let (b, n) = encode_ip(ctx.src.ip(), params);
            KeyOutcome::Key(Key::inline(&[&b[..n]]))
        }
        Method::SourceDestIpHash => {
            let (s, sn) = encode_ip(ctx.src.ip(), params);
            let (d, dn) = encode_ip(ctx.dst.ip(), params);
            let (s, d) = (&s[..sn], &d[..dn]);
            let (lo, hi) = if s <= d { (s, d) } else { (d, s) };
            KeyOutcome::Key(Key::inline(&[lo, hi]))
        }
        Method::SourceIpSourcePortHash => {
            let (b, n) = encode_ip(ctx.src.ip(), params);
            KeyOutcome::Key(Key::inline(&[&b[..n], &ctx.src.port().to_be_bytes()]))
        }
        Method::CallIdHash => match ctx.payload {
            Payload::Sip(m) => m
                .call_id()
                .map_or(KeyOutcome::NoKey, |c| KeyOutcome::Key(Key::Borrowed(c))),
            _ => KeyOutcome::NoKey,
        },
        Method::AorHash => aor_key(ctx, params.aor_key),
        Method::Token => token_key(params.token.as_ref(), ctx),
        Method::RoundRobin
        | Method::LeastConnection
        | Method::LeastResponseTime
        | Method::LeastBandwidth
        | Method::LeastPackets
        | Method::Lrtm
        | Method::CustomLoad => KeyOutcome::NoKey,
    }
}

/// `[4, a, b, c, d]` or `[6, 16 bytes]` after masking; IPv4-mapped IPv6 counts as IPv4.
fn encode_ip(ip: IpAddr, params: &HashParams) -> ([u8; 17], usize) {
    let mut out = [0u8; 17];
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let masked = u32::from(v4) & u32::from(params.netmask);
            out[0] = 4;
            out[1..5].copy_from_slice(&Ipv4Addr::from(masked).octets());
            (out, 5)
        }
        IpAddr::V6(v6) => {
            let bits = u32::from(params.v6_netmask_len.min(128));
            let mask = if bits == 0 {
                0
            } else {
                u128::MAX << (128 - bits)
            };
            out[0] = 6;
            out[1..17].copy_from_slice(&(u128::from(v6) & mask).to_be_bytes());
            (out, 17)
        }
    }
}

fn url_key<'a>(params: &HashParams, ctx: &RequestCtx<'a>) -> KeyOutcome<'a> {
    let url = match ctx.payload {
        Payload::Sip(m) => m.request_uri(),
        Payload::Http(h) => Some(h.target()),
        Payload::Raw(_) | Payload::None => None,
    };
    match url.filter(|u| !u.is_empty()) {
        Some(u) => KeyOutcome::Key(Key::Borrowed(&u[..u.len().min(params.hash_length)])),
        None => KeyOutcome::Unparseable,
    }
}

fn domain_key<'a>(params: &HashParams, ctx: &RequestCtx<'a>) -> KeyOutcome<'a> {
    let host = match ctx.payload {
        // The Request-URI host wins over the To host (docs/methods.md, Keys).
        Payload::Sip(m) => m
            .request_uri()
            .and_then(parse_uri)
            .map(|u| u.host)
            .filter(|h| !h.is_empty())
            .or_else(|| m.to_host()),
        Payload::Http(h) => h.host(),
        Payload::Raw(_) | Payload::None => None,
    };
    let Some(host) = host else {
        return KeyOutcome::Unparseable;
    };
    let host = host.strip_suffix(b".").unwrap_or(host);
    let host = &host[..host.len().min(params.hash_length)];
    if host.is_empty() {
        return KeyOutcome::Unparseable;
    }
    if !host.iter().any(u8::is_ascii_uppercase) {
        return KeyOutcome::Key(Key::Borrowed(host));
    }
    let mut w = KeyWriter::default();
    w.lowercase(host);
    KeyOutcome::Key(w.key())
}

/// `aor_hash`: the address-of-record, the To URI of a REGISTER and the Request-URI of any
/// other request, as [`aor_hash_key`] reads it. No URI that gives one: no key.
fn aor_key<'a>(ctx: &RequestCtx<'a>, mode: AorKey) -> KeyOutcome<'a> {
    let Payload::Sip(m) = ctx.payload else {
        return KeyOutcome::NoKey;
    };
    let uri = if m.method_kind() == SipMethod::Register {
        m.to_header().and_then(parse_name_addr).map(|na| na.uri)
    } else {
        m.request_uri()
    };
    uri.and_then(|u| aor_hash_key(u, mode))
        .map_or(KeyOutcome::NoKey, KeyOutcome::Key)
}

/// What `aor_hash` hashes of an address-of-record `uri`:
/// - a telephone number, `tel:N` or `sip:N@host;user=phone` (RFC 3261 §19.1.6): N without its
///   visual separators (`-` `.` `(` `)`, RFC 3966 §3), its leading `+` kept, whatever the host:
///   a number registered from one gateway and called through another lands on one registrar;
/// - otherwise with `aor_key: uri` the canonical AoR ([`canonical_aor`], user and host), with
///   `aor_key: user` the user part alone (unescaped; the canonical AoR when there is none),
///   for registrars that ignore the domain (Kamailio's `use_domain=0`).
pub fn aor_hash_key(uri: &[u8], mode: AorKey) -> Option<Key<'static>> {
    if let Some(n) = telephone_number(uri) {
        let mut w = KeyWriter::default();
        for &c in n {
            if !matches!(c, b'-' | b'.' | b'(' | b')') {
                w.push(&[c]);
            }
        }
        return Some(w.key());
    }
    match (mode, parse_uri(uri)) {
        (AorKey::User, Some(u)) if u.user.is_some_and(|user| !user.is_empty()) => {
            let user = u.user.unwrap_or_default();
            let user = &user[..memchr::memchr(b':', user).unwrap_or(user.len())];
            let mut w = KeyWriter::default();
            w.unescaped(user);
            Some(w.key())
        }
        _ => canonical_aor(uri),
    }
}

/// The number of a `tel:` URI (up to its first parameter) or of a SIP URI whose `user=phone`
/// parameter says its user part is one.
fn telephone_number(uri: &[u8]) -> Option<&[u8]> {
    if let Some(rest) = uri.get(..4).filter(|s| s.eq_ignore_ascii_case(b"tel:")) {
        let rest = &uri[rest.len()..];
        let n = &rest[..memchr::memchr(b';', rest).unwrap_or(rest.len())];
        return (!n.is_empty()).then_some(n);
    }
    let u = parse_uri(uri)?;
    let phone = u
        .params
        .split(|&c| c == b';')
        .any(|p| p.eq_ignore_ascii_case(b"user=phone"));
    let user = u.user.filter(|n| phone && !n.is_empty())?;
    // The number ends where its own parameters start (`;isub=`, `;phone-context=`).
    Some(&user[..memchr::memchr(b';', user).unwrap_or(user.len())])
}

/// The address-of-record of `uri` in the canonical form of RFC 3261 §10.3, the form a
/// registrar indexes its bindings by: every URI parameter (the user-param too), the
/// `?headers`, the port and a password removed, escaped characters unescaped.
/// - `sip:` / `sips:`: the scheme lowercased, `:`, the user unescaped (case kept: users are
///   case-sensitive, RFC 3261 §19.1.4) and `@` when there is one, then the host lowercased
///   (IPv6 without brackets) with one trailing dot removed;
/// - `tel:` (RFC 3966): `tel:` and the number up to its first parameter, without the visual
///   separators `-` `.` `(` `)`;
/// - any other scheme: the scheme lowercased, `:`, the rest up to its first `;` unescaped.
///
/// At most [`INLINE_KEY`] bytes (longer ones are cut). `None` when there is no URI to read.
pub fn canonical_aor(uri: &[u8]) -> Option<Key<'static>> {
    let mut w = KeyWriter::default();
    if let Some(u) = parse_uri(uri) {
        w.lowercase(u.scheme);
        w.push(b":");
        if let Some(user) = u.user {
            // `user:password`: the password is not part of the address.
            let user = &user[..memchr::memchr(b':', user).unwrap_or(user.len())];
            w.unescaped(user);
            w.push(b"@");
        }
        w.lowercase(u.host.strip_suffix(b".").unwrap_or(u.host));
        return Some(w.key());
    }
    let colon = memchr::memchr(b':', uri)?;
    let (scheme, rest) = (&uri[..colon], &uri[colon + 1..]);
    let rest = &rest[..memchr::memchr(b';', rest).unwrap_or(rest.len())];
    if scheme.is_empty() || rest.is_empty() || uri.iter().any(|&c| c <= b' ') {
        return None;
    }
    w.lowercase(scheme);
    w.push(b":");
    if scheme.eq_ignore_ascii_case(b"tel") {
        for &c in rest {
            if !matches!(c, b'-' | b'.' | b'(' | b')') {
                w.push(&[c]);
            }
        }
    } else {
        w.unescaped(rest);
    }
    Some(w.key())
}

/// Builds an inline key byte by byte; what does not fit is cut.
struct KeyWriter {
    buf: [u8; INLINE_KEY],
    len: usize,
}

impl Default for KeyWriter {
    fn default() -> Self {
        KeyWriter {
            buf: [0; INLINE_KEY],
            len: 0,
        }
    }
}

impl KeyWriter {
    fn push(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(INLINE_KEY - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    fn lowercase(&mut self, bytes: &[u8]) {
        let start = self.len;
        self.push(bytes);
        self.buf[start..self.len].make_ascii_lowercase();
    }

    /// `%XX` escapes decoded (RFC 3261 §25.1 `escaped`); a `%` not followed by two hex
    /// digits is kept as it is.
    fn unescaped(&mut self, bytes: &[u8]) {
        let mut i = 0;
        while i < bytes.len() {
            let c = bytes[i];
            if c == b'%'
                && let (Some(h), Some(l)) = (
                    bytes.get(i + 1).and_then(|&d| hex(d)),
                    bytes.get(i + 2).and_then(|&d| hex(d)),
                )
            {
                self.push(&[h << 4 | l]);
                i += 3;
                continue;
            }
            self.push(&[c]);
            i += 1;
        }
    }

    fn key(self) -> Key<'static> {
        Key::Inline {
            len: self.len as u16,
            buf: self.buf,
        }
    }
}

fn hex(d: u8) -> Option<u8> {
    char::from(d)
        .to_digit(16)
        .and_then(|v| u8::try_from(v).ok())
}

fn token_key<'a>(rule: Option<&TokenRule>, ctx: &RequestCtx<'a>) -> KeyOutcome<'a> {
    let value = match (rule, ctx.payload) {
        (None, _) => None,
        (Some(TokenRule::Header(name)), Payload::Sip(m)) => m.header(name.as_bytes()),
        (Some(TokenRule::Header(name)), Payload::Http(h)) => h.header(name.as_bytes()),
        (Some(TokenRule::Query(name)), Payload::Http(h)) => h.query(name.as_bytes()),
        // For SIP the Request-URI's `;param` or `?header` carries the token.
        (Some(TokenRule::Query(name)), Payload::Sip(m)) => {
            m.request_uri().and_then(parse_uri).and_then(|u| {
                u.param(name.as_bytes())
                    .or_else(|| u.header_param(name.as_bytes()))
            })
        }
        (Some(TokenRule::Payload { offset, length }), p) => {
            let bytes = match p {
                Payload::Sip(m) => m.buf(),
                Payload::Http(h) => h.buf(),
                Payload::Raw(b) => b,
                Payload::None => &[],
            };
            offset
                .checked_add(*length)
                .and_then(|end| bytes.get(*offset..end))
        }
        (Some(_), _) => None,
    };
    match value.filter(|v| !v.is_empty()) {
        Some(v) => KeyOutcome::Key(Key::Borrowed(v)),
        None => KeyOutcome::NoKey,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::parse_head;
    use crate::sip::scan;
    use proptest::prelude::*;

    fn ctx<'a>(src: &str, dst: &str, payload: Payload<'a>) -> RequestCtx<'a> {
        RequestCtx {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            payload,
        }
    }

    fn key_of(o: KeyOutcome<'_>) -> Vec<u8> {
        o.key().map(|k| k.as_bytes().to_vec()).unwrap_or_default()
    }

    const SIP: &[u8] = b"INVITE sip:Bob@Biloxi.EXAMPLE.com;tenant=t9 SIP/2.0\r\n\
Via: SIP/2.0/UDP h;branch=z9hG4bK1\r\n\
i:  call-42@host  \r\n\
To: <sip:bob@ToHost.example>\r\n\
X-Tenant: blue\r\n\
l: 0\r\n\r\n";

    fn aor(msg: &[u8]) -> Vec<u8> {
        let m = scan(msg).unwrap();
        let c = ctx("10.0.0.1:5060", "10.0.0.2:5060", Payload::Sip(&m));
        key_of(extract(Method::AorHash, &HashParams::default(), &c))
    }

    fn request(method: &str, ruri: &str, to: &str) -> Vec<u8> {
        format!(
            "{method} {ruri} SIP/2.0\r\nVia: SIP/2.0/UDP h;branch=z9hG4bK1\r\nCall-ID: {method}-1\r\n\
             To: {to}\r\nFrom: <sip:a@b>;tag=1\r\nCSeq: 1 {method}\r\nl: 0\r\n\r\n"
        )
        .into_bytes()
    }

    #[test]
    fn aor_of_a_register_is_its_to_uri_in_canonical_form() {
        // Two phones of one user: different Call-IDs, Contacts and To forms, one AoR.
        let a = aor(&request(
            "REGISTER",
            "sip:Example.COM",
            "\"Bob\" <sip:bob@Example.COM:5060;transport=tcp?x=y>;tag=9",
        ));
        let b = aor(&request(
            "REGISTER",
            "sip:registrar.example.com",
            "sip:bob@example.com.",
        ));
        let c = aor(&request(
            "REGISTER",
            "sip:example.com",
            "<sip:%62ob:secret@EXAMPLE.com;user=ip>",
        ));
        assert_eq!(a, b"sip:bob@example.com");
        assert_eq!(b, a);
        assert_eq!(c, a);
        // The user is case-sensitive; the scheme is part of the address.
        assert_eq!(
            aor(&request("REGISTER", "sip:x", "<sip:Bob@example.com>")),
            b"sip:Bob@example.com"
        );
        assert_eq!(
            aor(&request("REGISTER", "sip:x", "<SIPS:bob@example.com>")),
            b"sips:bob@example.com"
        );
    }

    #[test]
    fn aor_of_other_requests_is_their_request_uri() {
        // (method, Request-URI, key); the To URI never counts outside a REGISTER.
        let cases: [(&str, &str, &[u8]); 5] = [
            (
                "INVITE",
                "sip:bob@EXAMPLE.com:5070;transport=udp",
                b"sip:bob@example.com",
            ),
            (
                "MESSAGE",
                "sip:bob@[2001:DB8::1]:5060",
                b"sip:bob@2001:db8::1",
            ),
            (
                "INVITE",
                "tel:+1-212-555-0101;phone-context=example.com",
                b"+12125550101",
            ),
            ("OPTIONS", "sip:Example.com;lr", b"sip:example.com"),
            // A bad escape is kept as written; nothing panics on a short one.
            ("INVITE", "sip:b%zz%4@h", b"sip:b%zz%4@h"),
        ];
        for (method, ruri, key) in cases {
            assert_eq!(
                aor(&request(method, ruri, "<sip:someone@else>")),
                key,
                "{ruri}"
            );
        }
    }

    /// `aor_key`: a number keys alike as `tel:` and as `sip:...;user=phone` whatever the
    /// host, in both modes; `user` keys a SIP AoR by its user alone.
    #[test]
    fn aor_key_modes_and_telephone_numbers() {
        let key =
            |uri: &str, mode| aor_hash_key(uri.as_bytes(), mode).map(|k| k.as_bytes().to_vec());
        for mode in [AorKey::Uri, AorKey::User] {
            let n = Some(b"+12125550101".to_vec());
            assert_eq!(key("tel:+1-212-555-0101", mode), n);
            assert_eq!(
                key("sip:+1(212)555.0101@gw1.example.com;user=phone", mode),
                n
            );
            assert_eq!(
                key(
                    "sip:+12125550101;isub=7@gw2.example.net:5080;user=phone",
                    mode
                ),
                n
            );
            assert_eq!(key("TEL:+12125550101;phone-context=x", mode), n);
        }
        // Without user=phone a number-like user is an ordinary user.
        assert_eq!(
            key("sip:+12125550101@gw1.example.com", AorKey::Uri),
            Some(b"sip:+12125550101@gw1.example.com".to_vec())
        );
        assert_eq!(
            key("sip:Bob@A.example.com:5070", AorKey::User),
            Some(b"Bob".to_vec())
        );
        assert_eq!(key("sip:b%6Fb@x", AorKey::User), Some(b"bob".to_vec()));
        assert_eq!(
            key("sip:bob@a.example.com", AorKey::User),
            key("sip:bob@b.example.org", AorKey::User)
        );
        assert_eq!(
            key("sip:example.com", AorKey::User),
            Some(b"sip:example.com".to_vec())
        );
        assert_eq!(key("tel:", AorKey::Uri), None, "no number, no key");
    }

    #[test]
    fn aor_without_a_uri_is_no_key() {
        // A REGISTER whose To holds no URI.
        assert_eq!(aor(&request("REGISTER", "sip:x", "<>")), b"");
        let msg = request("REGISTER", "sip:x", "<>");
        let m = scan(&msg).unwrap();
        let c = ctx("10.0.0.1:5060", "10.0.0.2:5060", Payload::Sip(&m));
        assert_eq!(
            extract(Method::AorHash, &HashParams::default(), &c),
            KeyOutcome::NoKey
        );
        // Not SIP: no key.
        let c = ctx("10.0.0.1:5060", "10.0.0.2:5060", Payload::Raw(b"x"));
        assert_eq!(
            extract(Method::AorHash, &HashParams::default(), &c),
            KeyOutcome::NoKey
        );
        assert_eq!(canonical_aor(b""), None);
        assert_eq!(canonical_aor(b"sip:"), None);
        assert_eq!(canonical_aor(b"nocolon"), None);
        // Cut at the inline capacity, never past it.
        let long = format!("sip:{}@h", "u".repeat(400));
        assert_eq!(
            canonical_aor(long.as_bytes()).map(|k| k.as_bytes().len()),
            Some(INLINE_KEY)
        );
    }

    proptest! {
        #[test]
        fn aor_ignores_params_port_and_host_case(user in "[a-z0-9]{1,12}", host in "[a-z]{1,10}\\.[a-z]{2,3}", port in 1u16.., param in "[a-z]{1,6}=[a-z0-9]{1,6}") {
            let plain = canonical_aor(format!("sip:{user}@{host}").as_bytes()).map(|k| k.as_bytes().to_vec());
            let dressed = canonical_aor(format!("sip:{user}@{}:{port};{param}?h=v", host.to_ascii_uppercase()).as_bytes()).map(|k| k.as_bytes().to_vec());
            prop_assert_eq!(plain, dressed);
        }

        #[test]
        fn aor_never_panics(uri in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = canonical_aor(&uri);
        }
    }

    #[test]
    fn sip_keys() {
        let m = scan(SIP).unwrap();
        let c = ctx("10.0.0.1:5060", "10.0.0.2:5060", Payload::Sip(&m));
        let p = HashParams::default();
        assert_eq!(key_of(extract(Method::CallIdHash, &p, &c)), b"call-42@host");
        assert_eq!(
            key_of(extract(Method::UrlHash, &p, &c)),
            b"sip:Bob@Biloxi.EXAMPLE.com;tenant=t9"
        );
        let short = HashParams {
            hash_length: 7,
            ..HashParams::default()
        };
        assert_eq!(key_of(extract(Method::UrlHash, &short, &c)), b"sip:Bob");
        assert_eq!(
            key_of(extract(Method::DomainHash, &p, &c)),
            b"biloxi.example.com"
        );
        assert_eq!(key_of(extract(Method::DomainHash, &short, &c)), b"biloxi.");
        let tok = |rule| HashParams {
            token: Some(rule),
            ..HashParams::default()
        };
        assert_eq!(
            key_of(extract(
                Method::Token,
                &tok(TokenRule::Header("x-tenant".into())),
                &c
            )),
            b"blue"
        );
        assert_eq!(
            key_of(extract(
                Method::Token,
                &tok(TokenRule::Header("Call-ID".into())),
                &c
            )),
            b"call-42@host"
        );
        assert_eq!(
            key_of(extract(
                Method::Token,
                &tok(TokenRule::Query("tenant".into())),
                &c
            )),
            b"t9"
        );
        assert_eq!(
            key_of(extract(
                Method::Token,
                &tok(TokenRule::Payload {
                    offset: 0,
                    length: 6
                }),
                &c
            )),
            b"INVITE"
        );
        assert_eq!(
            extract(
                Method::Token,
                &tok(TokenRule::Payload {
                    offset: SIP.len() - 2,
                    length: 6
                }),
                &c
            ),
            KeyOutcome::NoKey
        );
        assert_eq!(
            extract(Method::Token, &tok(TokenRule::Header("nope".into())), &c),
            KeyOutcome::NoKey
        );
        assert_eq!(extract(Method::RoundRobin, &p, &c), KeyOutcome::NoKey);
    }

    #[test]
    fn domain_falls_back_to_to_host() {
        let m = scan(b"INVITE tel:+123 SIP/2.0\r\nt: <sip:x@Dom.Example.>\r\n\r\n").unwrap();
        let c = ctx("10.0.0.1:1", "10.0.0.2:2", Payload::Sip(&m));
        let p = HashParams::default();
        assert_eq!(key_of(extract(Method::DomainHash, &p, &c)), b"dom.example");
        let m = scan(b"INVITE tel:+123 SIP/2.0\r\n\r\n").unwrap();
        let c = ctx("10.0.0.1:1", "10.0.0.2:2", Payload::Sip(&m));
        assert_eq!(extract(Method::DomainHash, &p, &c), KeyOutcome::Unparseable);
        assert_eq!(extract(Method::CallIdHash, &p, &c), KeyOutcome::NoKey);
        let raw = ctx("10.0.0.1:1", "10.0.0.2:2", Payload::Raw(b"xx"));
        assert_eq!(extract(Method::UrlHash, &p, &raw), KeyOutcome::Unparseable);
    }

    #[test]
    fn http_keys() {
        let h = parse_head(b"GET /x?sid=9 HTTP/1.1\r\nHost: WWW.Example.com:8080\r\n\r\n").unwrap();
        let c = ctx("[2001:db8::1]:1", "[2001:db8::2]:80", Payload::Http(&h));
        let p = HashParams {
            token: Some(TokenRule::Query("sid".into())),
            ..HashParams::default()
        };
        assert_eq!(key_of(extract(Method::UrlHash, &p, &c)), b"/x?sid=9");
        assert_eq!(
            key_of(extract(Method::DomainHash, &p, &c)),
            b"www.example.com"
        );
        assert_eq!(key_of(extract(Method::Token, &p, &c)), b"9");
    }

    #[test]
    fn address_keys() {
        let p = HashParams {
            netmask: Ipv4Addr::new(255, 255, 255, 0),
            v6_netmask_len: 64,
            ..HashParams::default()
        };
        let c = ctx("192.0.2.77:4000", "[2001:db8::1:2]:5060", Payload::None);
        assert_eq!(
            key_of(extract(Method::SourceIpHash, &p, &c)),
            [4, 192, 0, 2, 0]
        );
        let mut v6 = vec![6, 0x20, 0x01, 0x0d, 0xb8];
        v6.extend_from_slice(&[0; 12]);
        assert_eq!(key_of(extract(Method::DestIpHash, &p, &c)), v6);
        assert_eq!(
            key_of(extract(Method::SourceIpSourcePortHash, &p, &c)),
            [4, 192, 0, 2, 0, 0x0f, 0xa0]
        );
        // IPv4-mapped IPv6 is IPv4.
        let m = ctx("[::ffff:192.0.2.9]:4000", "10.0.0.1:1", Payload::None);
        assert_eq!(
            key_of(extract(Method::SourceIpHash, &p, &m)),
            [4, 192, 0, 2, 0]
        );
        let zero = HashParams {
            v6_netmask_len: 0,
            ..HashParams::default()
        };
        assert_eq!(
            key_of(extract(Method::DestIpHash, &zero, &c)),
            [6; 1].iter().copied().chain([0; 16]).collect::<Vec<_>>()
        );
    }

    fn arb_addr() -> impl Strategy<Value = SocketAddr> {
        prop_oneof![
            (any::<u32>(), any::<u16>())
                .prop_map(|(ip, port)| SocketAddr::new(Ipv4Addr::from(ip).into(), port)),
            (any::<u128>(), any::<u16>())
                .prop_map(|(ip, port)| SocketAddr::new(std::net::Ipv6Addr::from(ip).into(), port)),
        ]
    }

    fn arb_params() -> impl Strategy<Value = HashParams> {
        (1usize..=4096, any::<u32>(), 0u8..=128).prop_map(|(hash_length, mask, v6)| HashParams {
            hash_length,
            netmask: Ipv4Addr::from(mask),
            v6_netmask_len: v6,
            ..HashParams::default()
        })
    }

    proptest! {
        #[test]
        fn symmetric(a in arb_addr(), b in arb_addr(), p in arb_params()) {
            let x = ctx_of(a, b);
            let y = ctx_of(b, a);
            prop_assert_eq!(
                extract(Method::SourceDestIpHash, &p, &x),
                extract(Method::SourceDestIpHash, &p, &y)
            );
        }

        #[test]
        fn masking(a in any::<u32>(), noise in any::<u32>(), prefix in 0u32..=32,
                   a6 in any::<u128>(), noise6 in any::<u128>(), prefix6 in 0u8..=128) {
            let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
            let p = HashParams {
                netmask: Ipv4Addr::from(mask),
                v6_netmask_len: prefix6,
                ..HashParams::default()
            };
            let b = (a & mask) | (noise & !mask);
            let x = ctx_of(SocketAddr::new(Ipv4Addr::from(a).into(), 1), SocketAddr::new(Ipv4Addr::from(b).into(), 2));
            prop_assert_eq!(
                key_of(extract(Method::SourceIpHash, &p, &x)),
                key_of(extract(Method::DestIpHash, &p, &x))
            );
            let m6 = if prefix6 == 0 { 0 } else { u128::MAX << (128 - u32::from(prefix6)) };
            let b6 = (a6 & m6) | (noise6 & !m6);
            let y = ctx_of(
                SocketAddr::new(std::net::Ipv6Addr::from(a6).into(), 1),
                SocketAddr::new(std::net::Ipv6Addr::from(b6).into(), 2),
            );
            // IPv4-mapped addresses hash as IPv4 and are masked by `netmask` instead.
            let mapped = |v: u128| std::net::Ipv6Addr::from(v).to_ipv4_mapped().is_some();
            if !mapped(a6) && !mapped(b6) {
                prop_assert_eq!(
                    key_of(extract(Method::SourceIpHash, &p, &y)),
                    key_of(extract(Method::DestIpHash, &p, &y))
                );
            }
        }

        #[test]
        fn deterministic_and_total(bytes in proptest::collection::vec(any::<u8>(), 0..600),
                                   a in arb_addr(), b in arb_addr(), p in arb_params(),
                                   off in 0usize..700, len in 0usize..50) {
            let sip = scan(&bytes).ok();
            let http = parse_head(&bytes).ok();
            let mut payloads = vec![Payload::Raw(&bytes), Payload::None];
            if let Some(m) = &sip { payloads.push(Payload::Sip(m)); }
            if let Some(h) = &http { payloads.push(Payload::Http(h)); }
            let rules = [
                TokenRule::Header("X-Tenant".into()),
                TokenRule::Query("q".into()),
                TokenRule::Payload { offset: off, length: len },
            ];
            for payload in payloads {
                let c = RequestCtx { src: a, dst: b, payload };
                for (_, method) in Method::ALL {
                    for rule in &rules {
                        let p = HashParams { token: Some(rule.clone()), ..p.clone() };
                        let k1 = extract(method, &p, &c);
                        let k2 = extract(method, &p, &c);
                        prop_assert_eq!(&k1, &k2);
                        if !reads_local(method) {
                            // Whatever the local address, the same key.
                            let elsewhere = RequestCtx { dst: a, ..c };
                            prop_assert_eq!(&k1, &extract(method, &p, &elsewhere));
                        }
                        if let KeyOutcome::Key(k) = k1 {
                            prop_assert!(!k.as_bytes().is_empty());
                        }
                    }
                }
            }
        }
    }

    fn ctx_of(src: SocketAddr, dst: SocketAddr) -> RequestCtx<'static> {
        RequestCtx {
            src,
            dst,
            payload: Payload::None,
        }
    }
}
