//! The first HTTP/1.x request head of a connection (the `http` vserver's hash keys). PURE.
//!
//! Parsing is httparse's (no allocation); this module bounds the head, keeps the header
//! slices in a fixed array, and answers the few questions the hash methods ask: the
//! request-target, the Host, a header by name, a query parameter.

/// Largest request head accepted (request line and headers).
pub const MAX_HEAD: usize = 16 * 1024;

/// Most header lines accepted in a head.
pub const MAX_HTTP_HEADERS: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    /// The head is not complete yet: read more.
    #[error("incomplete HTTP request head")]
    Incomplete,
    #[error("HTTP request head larger than {MAX_HEAD} bytes")]
    TooLarge,
    #[error("more than {MAX_HTTP_HEADERS} HTTP headers")]
    TooManyHeaders,
    #[error("invalid HTTP request head: {0}")]
    Invalid(httparse::Error),
}

/// A parsed request head borrowing the connection's first bytes.
#[derive(Debug, Clone, Copy)]
pub struct HttpHead<'a> {
    buf: &'a [u8],
    method: &'a str,
    target: &'a [u8],
    /// Minor version: 0 for HTTP/1.0, 1 for HTTP/1.1.
    version: u8,
    headers: [(&'a [u8], &'a [u8]); MAX_HTTP_HEADERS],
    count: usize,
    len: usize,
}

/// Parse the request head at the start of `buf`.
pub fn parse_head(buf: &[u8]) -> Result<HttpHead<'_>, HttpError> {
    let mut storage = [httparse::EMPTY_HEADER; MAX_HTTP_HEADERS];
    let mut req = httparse::Request::new(&mut storage);
    let window = &buf[..buf.len().min(MAX_HEAD)];
    let len = match req.parse(window) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => {
            return Err(HttpError::TooLarge);
        }
        Ok(httparse::Status::Partial) => return Err(HttpError::Incomplete),
        Err(httparse::Error::TooManyHeaders) => return Err(HttpError::TooManyHeaders),
        Err(e) => return Err(HttpError::Invalid(e)),
    };
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Err(HttpError::Incomplete);
    };
    let mut headers: [(&[u8], &[u8]); MAX_HTTP_HEADERS] = [(&[], &[]); MAX_HTTP_HEADERS];
    let mut count = 0;
    for (slot, h) in headers.iter_mut().zip(req.headers.iter()) {
        *slot = (h.name.as_bytes(), trim(h.value));
        count += 1;
    }
    Ok(HttpHead {
        buf,
        method,
        target: target.as_bytes(),
        version,
        headers,
        count,
        len,
    })
}

fn trim(s: &[u8]) -> &[u8] {
    let start = s
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(s.len());
    let end = s
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |i| i + 1);
    &s[start..end.max(start)]
}

impl<'a> HttpHead<'a> {
    /// The bytes the head was parsed from (the whole first read, body bytes included).
    pub fn buf(&self) -> &'a [u8] {
        self.buf
    }

    pub fn method(&self) -> &'a str {
        self.method
    }

    /// Request-target as sent (origin-form `/p?q`, absolute-form `http://h/p`, ...).
    pub fn target(&self) -> &'a [u8] {
        self.target
    }

    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub fn version_minor(&self) -> u8 {
        self.version
    }

    /// Length of the head, up to and including the empty line.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every header as (name, trimmed value).
    pub fn headers(&self) -> impl Iterator<Item = (&'a [u8], &'a [u8])> + '_ {
        self.headers[..self.count].iter().copied()
    }

    /// First header with this name (case-insensitive), trimmed.
    pub fn header(&self, name: &[u8]) -> Option<&'a [u8]> {
        self.headers[..self.count]
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| *v)
    }

    /// The Host header value (with any port).
    pub fn host_header(&self) -> Option<&'a [u8]> {
        self.header(b"host").filter(|h| !h.is_empty())
    }

    /// Host of an absolute-form target (`http://user@host:port/...`, RFC 9112 §3.2.2),
    /// without port or brackets.
    pub fn target_host(&self) -> Option<&'a [u8]> {
        let t = self.target;
        // Absolute-form only: `scheme "://"` before any `/`, `?` or `#` (RFC 3986 §3.1); a
        // `://` further on is inside an origin-form path or query (`/login?next=http://x/`)
        // and must not override the Host header.
        let sep = t
            .iter()
            .position(|&c| matches!(c, b':' | b'/' | b'?' | b'#'))?;
        let scheme = &t[..sep];
        let is_scheme = scheme.first().is_some_and(u8::is_ascii_alphabetic)
            && scheme
                .iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'+' | b'-' | b'.'));
        if !is_scheme || !t[sep..].starts_with(b"://") {
            return None;
        }
        let rest = &t[sep + 3..];
        let end = rest
            .iter()
            .position(|&c| matches!(c, b'/' | b'?' | b'#'))
            .unwrap_or(rest.len());
        let authority = &rest[..end];
        let authority = match memchr::memrchr(b'@', authority) {
            Some(at) => &authority[at + 1..],
            None => authority,
        };
        Some(host_of_authority(authority)).filter(|h| !h.is_empty())
    }

    /// The host name the request is for: the absolute target's host, else the Host header's,
    /// without port or brackets (RFC 9112 §3.2.2: the target wins).
    pub fn host(&self) -> Option<&'a [u8]> {
        self.target_host()
            .or_else(|| self.host_header().map(host_of_authority))
            .filter(|h| !h.is_empty())
    }

    /// Value of a query parameter of the target (exact name match, value not
    /// percent-decoded; `?a&b=1` gives `a` an empty value).
    pub fn query(&self, name: &[u8]) -> Option<&'a [u8]> {
        let t = self.target;
        let q = memchr::memchr(b'?', t)?;
        let query = &t[q + 1..];
        let query = &query[..memchr::memchr(b'#', query).unwrap_or(query.len())];
        query.split(|&c| c == b'&').find_map(|pair| {
            let (n, v) = match memchr::memchr(b'=', pair) {
                Some(i) => (&pair[..i], &pair[i + 1..]),
                None => (pair, &pair[pair.len()..]),
            };
            (n == name).then_some(v)
        })
    }
}

/// `host[:port]` or `[v6][:port]` → host.
fn host_of_authority(a: &[u8]) -> &[u8] {
    if a.first() == Some(&b'[') {
        return match memchr::memchr(b']', a) {
            Some(close) => &a[1..close],
            None => &a[1..],
        };
    }
    match memchr::memrchr(b':', a) {
        Some(i) => &a[..i],
        None => a,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_head() {
        let req = b"GET /a/b?x=1&session=abc&flag HTTP/1.1\r\nHost: Example.COM:8080\r\nX-Tenant:  t1 \r\n\r\nbody";
        let h = parse_head(req).unwrap();
        assert_eq!(h.method(), "GET");
        assert_eq!(h.target(), b"/a/b?x=1&session=abc&flag");
        assert_eq!(h.version_minor(), 1);
        assert_eq!(h.len(), req.len() - 4);
        assert_eq!(h.header(b"x-tenant"), Some(&b"t1"[..]));
        assert_eq!(h.host(), Some(&b"Example.COM"[..]));
        assert_eq!(h.query(b"session"), Some(&b"abc"[..]));
        assert_eq!(h.query(b"flag"), Some(&b""[..]));
        assert_eq!(h.query(b"nope"), None);
    }

    #[test]
    fn absolute_form_wins() {
        let req = b"GET http://u@[2001:db8::1]:81/p HTTP/1.1\r\nHost: other\r\n\r\n";
        let h = parse_head(req).unwrap();
        assert_eq!(h.host(), Some(&b"2001:db8::1"[..]));
        let req = b"GET / HTTP/1.0\r\nHost: [::1]:80\r\n\r\n";
        assert_eq!(parse_head(req).unwrap().host(), Some(&b"::1"[..]));
    }

    /// A URL inside an origin-form target's query or path is not the request's host.
    #[test]
    fn only_an_absolute_target_overrides_the_host() {
        for target in [
            "/login?next=http://evil.test/x",
            "/r/http://evil.test/",
            "/p#x://evil.test",
            "*",
            "1http://evil.test/",
        ] {
            let req = format!("GET {target} HTTP/1.1\r\nHost: example.com\r\n\r\n");
            let h = parse_head(req.as_bytes()).unwrap();
            assert_eq!(h.target_host(), None, "{target}");
            assert_eq!(h.host(), Some(&b"example.com"[..]), "{target}");
        }
        let req = b"GET HTTPS://Up.Example:8443/?u=http://evil.test/ HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(parse_head(req).unwrap().host(), Some(&b"Up.Example"[..]));
    }

    #[test]
    fn incomplete_invalid_large() {
        assert_eq!(
            parse_head(b"GET / HTTP/1.1\r\nHost: a\r\n").err(),
            Some(HttpError::Incomplete)
        );
        assert!(matches!(
            parse_head(b"GET / HTTP/1.1\r\nHo st: a\r\n\r\n"),
            Err(HttpError::Invalid(_))
        ));
        let mut big = b"GET / HTTP/1.1\r\nX: ".to_vec();
        big.resize(MAX_HEAD + 10, b'a');
        assert_eq!(parse_head(&big).err(), Some(HttpError::TooLarge));
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for _ in 0..=MAX_HTTP_HEADERS {
            many.extend_from_slice(b"X: y\r\n");
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(parse_head(&many).err(), Some(HttpError::TooManyHeaders));
    }
}
