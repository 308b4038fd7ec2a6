//! Zero-copy SIP message scanner. PURE.
//!
//! One pass over the bytes finds the start line and the offsets of the headers a stateless
//! proxy needs; everything else is left untouched so that the rewrite can copy it verbatim.
//! No allocation: [`SipMsg`] holds offsets into the caller's buffer, and the values that are
//! rarely needed (every Via, any header by name) are found again on demand by iterators.
//!
//! The scanner is strict only where framing depends on it (start line, header syntax,
//! Content-Length) and lenient on header contents: semantic values (CSeq, Max-Forwards, Via
//! parameters) are parsed by accessors that return `Option`, so that a proxy can still answer
//! 400 to a message whose framing is sound (RFC 3261 §16.3 step 1).

pub(crate) use super::lex::*;
pub(crate) use super::values::*;
use memchr::memchr;

/// Upper bound on header lines in one message; a datagram that claims more is hostile.
pub const MAX_HEADERS: usize = 256;

/// Why a buffer is not a SIP message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ScanError {
    /// The header section or the body is not complete yet (stream transports read more;
    /// on a datagram transport it means truncated, RFC 3261 §18.3).
    #[error("incomplete SIP message")]
    Incomplete,
    #[error("bad SIP start line")]
    BadStartLine,
    #[error("unsupported SIP version")]
    BadVersion,
    #[error("malformed header line")]
    BadHeader,
    #[error("more than {MAX_HEADERS} header lines")]
    TooManyHeaders,
    #[error("bad or conflicting Content-Length")]
    BadContentLength,
}

/// Request or response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartLine<'a> {
    Request { method: &'a [u8], uri: &'a [u8] },
    Response { code: u16, reason: &'a [u8] },
}

/// Methods a proxy treats specially; the rest are `Other` (RFC 3261 §27.4 is open-ended).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SipMethod {
    Invite,
    Ack,
    Bye,
    Cancel,
    Options,
    Register,
    Other,
}

impl SipMethod {
    /// Methods are case-sensitive (RFC 3261 §7.1), so `invite` is `Other`.
    pub fn from_bytes(m: &[u8]) -> SipMethod {
        match m {
            b"INVITE" => SipMethod::Invite,
            b"ACK" => SipMethod::Ack,
            b"BYE" => SipMethod::Bye,
            b"CANCEL" => SipMethod::Cancel,
            b"OPTIONS" => SipMethod::Options,
            b"REGISTER" => SipMethod::Register,
            _ => SipMethod::Other,
        }
    }
}

/// Headers the scanner indexes (full and compact names, RFC 3261 §7.3.3 and §20).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderName {
    Via,
    CallId,
    From,
    To,
    CSeq,
    MaxForwards,
    ContentLength,
    Route,
    RecordRoute,
    Contact,
    /// RFC 3261 §20.29: option tags a proxy must support (§16.3 step 5).
    ProxyRequire,
    Other,
}

impl HeaderName {
    /// Case-insensitive lookup; compact forms `v i f t l m` map to their headers. `s k c e`
    /// (Subject, Supported, Content-Type, Content-Encoding) are `Other`: nothing here needs them.
    pub fn classify(name: &[u8]) -> HeaderName {
        let eq = |s: &[u8]| name.eq_ignore_ascii_case(s);
        match name.len() {
            1 => match name[0].to_ascii_lowercase() {
                b'v' => HeaderName::Via,
                b'i' => HeaderName::CallId,
                b'f' => HeaderName::From,
                b't' => HeaderName::To,
                b'l' => HeaderName::ContentLength,
                b'm' => HeaderName::Contact,
                _ => HeaderName::Other,
            },
            2 if eq(b"to") => HeaderName::To,
            3 if eq(b"via") => HeaderName::Via,
            4 if eq(b"from") => HeaderName::From,
            4 if eq(b"cseq") => HeaderName::CSeq,
            5 if eq(b"route") => HeaderName::Route,
            7 if eq(b"call-id") => HeaderName::CallId,
            7 if eq(b"contact") => HeaderName::Contact,
            12 if eq(b"max-forwards") => HeaderName::MaxForwards,
            12 if eq(b"record-route") => HeaderName::RecordRoute,
            13 if eq(b"proxy-require") => HeaderName::ProxyRequire,
            14 if eq(b"content-length") => HeaderName::ContentLength,
            _ => HeaderName::Other,
        }
    }
}

/// `true` when two header names denote the same header, compact forms included.
pub(crate) fn same_header(a: &[u8], b: &[u8]) -> bool {
    if a.eq_ignore_ascii_case(b) {
        return true;
    }
    let (ka, kb) = (HeaderName::classify(a), HeaderName::classify(b));
    ka != HeaderName::Other && ka == kb
}

/// One header line (with its continuation lines).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header<'a> {
    pub name: &'a [u8],
    /// Value with leading and trailing LWS removed; folded lines keep their inner CRLF+WS.
    pub value: &'a [u8],
    /// The whole line in the buffer, from the name to after the final LF.
    pub line: Span,
    /// The value's range in the buffer.
    pub value_span: Span,
}

/// An indexed header: the line and its trimmed value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Indexed {
    pub(crate) line: Span,
    pub(crate) value: Span,
}

/// A scanned SIP message borrowing the buffer it was scanned from.
#[derive(Debug, Clone, Copy)]
pub struct SipMsg<'a> {
    buf: &'a [u8],
    start: StartLine<'a>,
    start_line: Span,
    /// Offset of the first header line.
    headers_start: usize,
    /// Offset of the empty line that ends the header section.
    headers_end: usize,
    body: Span,
    header_count: usize,
    via: Option<Indexed>,
    call_id: Option<Indexed>,
    from: Option<Indexed>,
    to: Option<Indexed>,
    cseq: Option<Indexed>,
    max_forwards: Option<Indexed>,
    content_length: Option<(Indexed, usize)>,
    route: Option<Indexed>,
    record_route: Option<Indexed>,
    contact: Option<Indexed>,
    proxy_require: Option<Indexed>,
    /// A header that RFC 3261 §7.3.1 / §20 allows once (Call-ID, CSeq, From, To,
    /// Max-Forwards) appeared twice: the request is ambiguous (RFC 4475 §3.3.8).
    has_duplicate: bool,
    /// The first Via value, parsed once at the end of the scan (every message on the proxy
    /// path needs it, some twice).
    top_via: Option<Via<'a>>,
    /// The CSeq number and method, parsed once at the end of the scan (a request's syntax
    /// check and its dialog pin, a response's dialog tracking all read it).
    parsed_cseq: Option<CSeq<'a>>,
}

/// Scan one SIP message at the start of `buf` (leading CRLFs are skipped, RFC 3261 §7.5).
///
/// With a Content-Length the message ends after that many body bytes and anything beyond is
/// ignored (RFC 3261 §18.3); without one the body is the rest of the buffer (datagram rule).
pub fn scan(buf: &[u8]) -> Result<SipMsg<'_>, ScanError> {
    scan_with::<false>(buf)
}

/// [`scan`] for a message that is to be answered, not forwarded: a Content-Length that is
/// malformed, conflicting or larger than the buffer is ignored (the body is the rest of the
/// buffer) and any `SIP/x.y` version is taken, so that fulcrum can still answer 400 or 505
/// (RFC 3261 §16.3 step 1, §18.3; RFC 4475 §3.1.2.2, §3.1.2.3, §3.1.2.16). Only on the error
/// path: the message it returns must never be forwarded.
///
/// It also reads past [`MAX_HEADERS`] lines, as far as the header section goes in `buf`, so
/// that a request refused for its length can still be answered 513 with every Via it
/// carries (RFC 3261 §8.2.6.2, §21.5.14): the work stays bounded by `buf`, which the caller
/// keeps within its size limit. [`SipMsg::header_count`] may then pass [`MAX_HEADERS`].
pub fn scan_for_reply(buf: &[u8]) -> Result<SipMsg<'_>, ScanError> {
    scan_with::<true>(buf)
}

/// The scan; `FOR_REPLY` is a constant so that [`scan`], on every message's path, is compiled
/// without the lenient branches of [`scan_for_reply`].
#[inline]
fn scan_with<const FOR_REPLY: bool>(buf: &[u8]) -> Result<SipMsg<'_>, ScanError> {
    let mut pos = 0;
    while buf.len() >= pos + 2 && &buf[pos..pos + 2] == b"\r\n" {
        pos += 2;
    }
    let sl_end = match memchr(b'\n', &buf[pos..]) {
        Some(i) => pos + i,
        None => return Err(ScanError::Incomplete),
    };
    let sl_content = Span::new(pos, trim_cr(buf, pos, sl_end));
    let start = match parse_start_line(sl_content.of(buf)) {
        Err(ScanError::BadVersion | ScanError::BadStartLine) if FOR_REPLY => {
            parse_request_line_loosely(sl_content.of(buf))?
        }
        r => r?,
    };
    let start_line = sl_content;
    let headers_start = sl_end + 1;

    let mut msg = SipMsg {
        buf,
        start,
        start_line,
        headers_start,
        headers_end: headers_start,
        body: Span::default(),
        header_count: 0,
        via: None,
        call_id: None,
        from: None,
        to: None,
        cseq: None,
        max_forwards: None,
        content_length: None,
        route: None,
        record_route: None,
        contact: None,
        proxy_require: None,
        has_duplicate: false,
        top_via: None,
        parsed_cseq: None,
    };

    let mut pos = headers_start;
    let body_start = loop {
        if let Some(after) = blank_line_at(buf, pos)? {
            msg.headers_end = pos;
            break after;
        }
        if !FOR_REPLY && msg.header_count == MAX_HEADERS {
            return Err(ScanError::TooManyHeaders);
        }
        let h = header_at(buf, pos)?;
        msg.header_count += 1;
        let idx = Indexed {
            line: h.line,
            value: h.value_span,
        };
        match HeaderName::classify(h.name) {
            HeaderName::Via => set_first(&mut msg.via, idx),
            HeaderName::CallId => set_once(&mut msg.call_id, idx, &mut msg.has_duplicate),
            HeaderName::From => set_once(&mut msg.from, idx, &mut msg.has_duplicate),
            HeaderName::To => set_once(&mut msg.to, idx, &mut msg.has_duplicate),
            HeaderName::CSeq => set_once(&mut msg.cseq, idx, &mut msg.has_duplicate),
            HeaderName::MaxForwards => {
                set_once(&mut msg.max_forwards, idx, &mut msg.has_duplicate);
            }
            HeaderName::ProxyRequire => set_first(&mut msg.proxy_require, idx),
            HeaderName::Route => set_first(&mut msg.route, idx),
            HeaderName::RecordRoute => set_first(&mut msg.record_route, idx),
            HeaderName::Contact => set_first(&mut msg.contact, idx),
            HeaderName::ContentLength if FOR_REPLY => {}
            HeaderName::ContentLength => {
                let n = parse_decimal(h.value).ok_or(ScanError::BadContentLength)?;
                match msg.content_length {
                    // Two different lengths are a smuggling attempt, not a typo to guess at.
                    Some((_, prev)) if prev != n => return Err(ScanError::BadContentLength),
                    Some(_) => {}
                    None => msg.content_length = Some((idx, n)),
                }
            }
            HeaderName::Other => {}
        }
        pos = h.line.end;
    };

    let body_end = match msg.content_length {
        Some((_, n)) => body_start
            .checked_add(n)
            .filter(|e| *e <= buf.len())
            .ok_or(ScanError::Incomplete)?,
        None => buf.len(),
    };
    msg.body = Span::new(body_start, body_end);
    msg.top_via = msg.parse_top_via();
    msg.parsed_cseq = msg.parse_cseq();
    Ok(msg)
}

/// Index a header allowed once; a second one only raises `dup` (no extra pass).
#[inline]
fn set_once(slot: &mut Option<Indexed>, idx: Indexed, dup: &mut bool) {
    if slot.is_none() {
        *slot = Some(idx);
    } else {
        *dup = true;
    }
}

#[inline]
fn set_first(slot: &mut Option<Indexed>, idx: Indexed) {
    if slot.is_none() {
        *slot = Some(idx);
    }
}

/// Index of the `\n` that ends the line containing `from`, or the end without a `\r`.
#[inline]
fn trim_cr(buf: &[u8], start: usize, lf: usize) -> usize {
    if lf > start && buf[lf - 1] == b'\r' {
        lf - 1
    } else {
        lf
    }
}

/// If a blank line (CRLF or bare LF) starts at `pos`, the offset after it.
#[inline]
fn blank_line_at(buf: &[u8], pos: usize) -> Result<Option<usize>, ScanError> {
    match buf.get(pos) {
        None => Err(ScanError::Incomplete),
        Some(b'\n') => Ok(Some(pos + 1)),
        Some(b'\r') => match buf.get(pos + 1) {
            None => Err(ScanError::Incomplete),
            Some(b'\n') => Ok(Some(pos + 2)),
            Some(_) => Err(ScanError::BadHeader),
        },
        Some(_) => Ok(None),
    }
}

/// Parse the header line (plus continuation lines, RFC 3261 §7.3.1) starting at `pos`.
pub(crate) fn header_at(buf: &[u8], pos: usize) -> Result<Header<'_>, ScanError> {
    let first_lf = match memchr(b'\n', &buf[pos..]) {
        Some(i) => pos + i,
        None => return Err(ScanError::Incomplete),
    };
    let mut lf = first_lf;
    loop {
        match buf.get(lf + 1) {
            // Cannot tell yet whether the next line continues this one.
            None => return Err(ScanError::Incomplete),
            Some(b' ' | b'\t') => {
                lf += 1 + memchr(b'\n', &buf[lf + 1..]).ok_or(ScanError::Incomplete)?;
            }
            Some(_) => break,
        }
    }
    let colon = pos + memchr(b':', &buf[pos..first_lf]).ok_or(ScanError::BadHeader)?;
    let name = trim_lws(&buf[pos..colon]);
    // The name must start the line (a leading space would be a continuation) and be a token.
    if name.is_empty() || name.len() != colon - pos - trailing_lws(&buf[pos..colon]) {
        return Err(ScanError::BadHeader);
    }
    if !name.iter().all(|&c| is_token_char(c)) {
        return Err(ScanError::BadHeader);
    }
    let (vs, ve) = trim_lws_span(buf, colon + 1, lf + 1);
    Ok(Header {
        name,
        value: &buf[vs..ve],
        line: Span::new(pos, lf + 1),
        value_span: Span::new(vs, ve),
    })
}

fn parse_start_line(line: &[u8]) -> Result<StartLine<'_>, ScanError> {
    if line.len() >= 4 && line[..4].eq_ignore_ascii_case(b"SIP/") {
        // Status-Line = SIP-Version SP Status-Code SP Reason-Phrase (RFC 3261 §7.2)
        let sp = memchr(b' ', line).ok_or(ScanError::BadStartLine)?;
        check_version(&line[..sp])?;
        let rest = &line[sp + 1..];
        if rest.len() < 3 || !rest[..3].iter().all(u8::is_ascii_digit) {
            return Err(ScanError::BadStartLine);
        }
        let code = rest[..3]
            .iter()
            .fold(0u16, |a, d| a * 10 + u16::from(d - b'0'));
        if !(100..=699).contains(&code) {
            return Err(ScanError::BadStartLine);
        }
        let reason = match rest.get(3) {
            None => &rest[3..],
            Some(b' ') => &rest[4..],
            Some(_) => return Err(ScanError::BadStartLine),
        };
        return Ok(StartLine::Response { code, reason });
    }
    // Request-Line = Method SP Request-URI SP SIP-Version (RFC 3261 §7.1): exactly two SPs,
    // so LWS inside the URI (RFC 4475 §3.1.2.7) is refused.
    let sp1 = memchr(b' ', line).ok_or(ScanError::BadStartLine)?;
    let sp2 = memchr::memrchr(b' ', line).ok_or(ScanError::BadStartLine)?;
    if sp2 <= sp1 + 1 {
        return Err(ScanError::BadStartLine);
    }
    let method = &line[..sp1];
    let uri = &line[sp1 + 1..sp2];
    if method.is_empty() || !method.iter().all(|&c| is_token_char(c)) {
        return Err(ScanError::BadStartLine);
    }
    if uri.iter().any(|&c| c <= b' ' || c == 0x7f) {
        return Err(ScanError::BadStartLine);
    }
    check_version(&line[sp2 + 1..])?;
    Ok(StartLine::Request { method, uri })
}

/// A Request-Line read only to answer it (400 or 505): a method token, then anything, then a
/// last word `SIP/...`; extra or trailing whitespace is tolerated (RFC 4475 §3.1.2.8 to
/// §3.1.2.10, §3.1.2.16). Never used for a message that is forwarded.
fn parse_request_line_loosely(line: &[u8]) -> Result<StartLine<'_>, ScanError> {
    let line = trim_lws(line);
    if line
        .get(..4)
        .is_some_and(|v| v.eq_ignore_ascii_case(b"SIP/"))
    {
        return Err(ScanError::BadStartLine);
    }
    let sp1 = memchr(b' ', line).ok_or(ScanError::BadStartLine)?;
    let sp2 = memchr::memrchr(b' ', line).ok_or(ScanError::BadStartLine)?;
    let method = &line[..sp1];
    let version = &line[sp2 + 1..];
    if method.is_empty()
        || !method.iter().all(|&c| is_token_char(c))
        || !version
            .get(..4)
            .is_some_and(|v| v.eq_ignore_ascii_case(b"SIP/"))
    {
        return Err(ScanError::BadStartLine);
    }
    Ok(StartLine::Request {
        method,
        uri: trim_lws(&line[sp1..sp2]),
    })
}

/// Whether `buf` starts like a response (`SIP/2.0 ` then a status), without scanning it;
/// the version is compared as [`scan`] does, case-insensitively.
pub(crate) fn is_response(buf: &[u8]) -> bool {
    buf.get(..8)
        .is_some_and(|v| v.eq_ignore_ascii_case(b"SIP/2.0 "))
}

fn check_version(v: &[u8]) -> Result<(), ScanError> {
    if v.eq_ignore_ascii_case(b"SIP/2.0") {
        Ok(())
    } else if v.len() > 4 && v[..4].eq_ignore_ascii_case(b"SIP/") {
        Err(ScanError::BadVersion)
    } else {
        Err(ScanError::BadStartLine)
    }
}

/// Iterator over the header lines of a scanned message.
#[derive(Debug, Clone)]
pub struct Headers<'a> {
    buf: &'a [u8],
    pos: usize,
    end: usize,
}

impl<'a> Iterator for Headers<'a> {
    type Item = Header<'a>;
    fn next(&mut self) -> Option<Header<'a>> {
        if self.pos >= self.end {
            return None;
        }
        // The range was validated by `scan`, so this only fails on a foreign buffer.
        let h = header_at(self.buf, self.pos).ok()?;
        self.pos = h.line.end;
        Some(h)
    }
}

/// Every Via value of a message, in order, across headers and comma-joined values.
///
/// Stops at the first value that does not parse: a proxy cannot route past it anyway.
#[derive(Debug, Clone)]
pub struct Vias<'a> {
    headers: Headers<'a>,
    values: Option<CommaValues<'a>>,
}

impl<'a> Iterator for Vias<'a> {
    type Item = Via<'a>;
    fn next(&mut self) -> Option<Via<'a>> {
        loop {
            if let Some(vals) = &mut self.values {
                if let Some(span) = vals.next() {
                    return parse_via(self.headers.buf, span, b"");
                }
                self.values = None;
            }
            let h = self.headers.next()?;
            if HeaderName::classify(h.name) == HeaderName::Via {
                self.values = Some(CommaValues::new(self.headers.buf, h.value_span));
            }
        }
    }
}

impl<'a> SipMsg<'a> {
    /// The buffer the message was scanned from.
    pub fn buf(&self) -> &'a [u8] {
        self.buf
    }

    pub fn start_line(&self) -> StartLine<'a> {
        self.start
    }

    /// The start line's bytes, without the line end.
    pub fn start_line_bytes(&self) -> &'a [u8] {
        self.start_line.of(self.buf)
    }

    pub fn is_request(&self) -> bool {
        matches!(self.start, StartLine::Request { .. })
    }

    /// Request method bytes (`None` for a response).
    pub fn method(&self) -> Option<&'a [u8]> {
        match self.start {
            StartLine::Request { method, .. } => Some(method),
            StartLine::Response { .. } => None,
        }
    }

    /// The request's method as a [`SipMethod`]; for a response, the CSeq method.
    pub fn method_kind(&self) -> SipMethod {
        match self.start {
            StartLine::Request { method, .. } => SipMethod::from_bytes(method),
            StartLine::Response { .. } => self
                .cseq()
                .map_or(SipMethod::Other, |c| SipMethod::from_bytes(c.method)),
        }
    }

    pub fn request_uri(&self) -> Option<&'a [u8]> {
        match self.start {
            StartLine::Request { uri, .. } => Some(uri),
            StartLine::Response { .. } => None,
        }
    }

    pub fn status_code(&self) -> Option<u16> {
        match self.start {
            StartLine::Response { code, .. } => Some(code),
            StartLine::Request { .. } => None,
        }
    }

    /// Offset of the start line (after any leading CRLFs, RFC 3261 §7.5).
    pub fn start_offset(&self) -> usize {
        self.start_line.start
    }

    /// Offset of the first header line.
    pub fn headers_start(&self) -> usize {
        self.headers_start
    }

    /// Offset of the empty line that ends the headers.
    pub fn headers_end(&self) -> usize {
        self.headers_end
    }

    /// Offset of the body.
    pub fn body_start(&self) -> usize {
        self.body.start
    }

    pub fn body(&self) -> &'a [u8] {
        self.body.of(self.buf)
    }

    /// Length of the message in the buffer (bytes after it are not part of it).
    pub fn len(&self) -> usize {
        self.body.end
    }

    pub fn is_empty(&self) -> bool {
        self.body.end == 0
    }

    /// The message bytes, without anything after the body.
    pub fn as_bytes(&self) -> &'a [u8] {
        &self.buf[..self.body.end]
    }

    pub fn header_count(&self) -> usize {
        self.header_count
    }

    /// Every header line in order.
    pub fn headers(&self) -> Headers<'a> {
        Headers {
            buf: self.buf,
            pos: self.headers_start,
            end: self.headers_end,
        }
    }

    /// First value of a header by name (case-insensitive; compact forms match their long
    /// names), trimmed. Linear in the header count; the hot headers have their own accessors.
    pub fn header(&self, name: &[u8]) -> Option<&'a [u8]> {
        self.headers()
            .find(|h| same_header(h.name, name))
            .map(|h| h.value)
    }

    /// Whether a Supported header (compact `k`) lists option tag `tag` (RFC 3261 §20.37).
    /// Linear in the header count: for the rare request that asks (a REGISTER).
    pub fn supports(&self, tag: &[u8]) -> bool {
        self.headers()
            .filter(|h| {
                h.name.eq_ignore_ascii_case(b"supported") || h.name.eq_ignore_ascii_case(b"k")
            })
            .flat_map(|h| h.value.split(|&c| c == b','))
            .any(|t| crate::sip::lex::trim_lws(t).eq_ignore_ascii_case(tag))
    }

    /// Call-ID (compact `i`), trimmed.
    pub fn call_id(&self) -> Option<&'a [u8]> {
        self.call_id
            .map(|h| h.value.of(self.buf))
            .filter(|v| !v.is_empty())
    }

    /// From header value (compact `f`).
    pub fn from_header(&self) -> Option<&'a [u8]> {
        self.from.map(|h| h.value.of(self.buf))
    }

    /// To header value (compact `t`).
    pub fn to_header(&self) -> Option<&'a [u8]> {
        self.to.map(|h| h.value.of(self.buf))
    }

    /// Host of the To URI, as written (domain_hash normalises case).
    pub fn to_host(&self) -> Option<&'a [u8]> {
        let na = parse_name_addr(self.to_header()?)?;
        Some(parse_uri(na.uri)?.host)
    }

    /// `tag` parameter of From.
    pub fn from_tag(&self) -> Option<&'a [u8]> {
        parse_name_addr(self.from_header()?)?.param(b"tag")
    }

    /// `tag` parameter of To.
    pub fn to_tag(&self) -> Option<&'a [u8]> {
        parse_name_addr(self.to_header()?)?.param(b"tag")
    }

    /// Raw CSeq value.
    pub fn cseq_raw(&self) -> Option<&'a [u8]> {
        self.cseq.map(|h| h.value.of(self.buf))
    }

    /// CSeq number and method; `None` when absent or malformed.
    #[inline]
    pub fn cseq(&self) -> Option<CSeq<'a>> {
        self.parsed_cseq
    }

    fn parse_cseq(&self) -> Option<CSeq<'a>> {
        let v = self.cseq_raw()?;
        let digits = v.iter().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 || digits > 10 {
            return None;
        }
        let seq = u32::try_from(parse_decimal(&v[..digits])?).ok()?;
        let method = trim_lws(&v[digits..]);
        if method.is_empty()
            || method.len() == v.len() - digits
            || !method.iter().all(|&c| is_token_char(c))
        {
            return None;
        }
        Some(CSeq { seq, method })
    }

    /// The Max-Forwards header: absent, a value, or malformed.
    pub fn max_forwards(&self) -> MaxForwards {
        let Some(h) = self.max_forwards else {
            return MaxForwards::Absent;
        };
        match parse_decimal(h.value.of(self.buf)).and_then(|n| u32::try_from(n).ok()) {
            Some(n) => MaxForwards::Value(n),
            None => MaxForwards::Bad,
        }
    }

    /// Content-Length (compact `l`), when present.
    pub fn content_length(&self) -> Option<usize> {
        self.content_length.map(|(_, n)| n)
    }

    /// First Via value, parsed (once, by `scan`).
    #[inline]
    pub fn top_via(&self) -> Option<Via<'a>> {
        self.top_via
    }

    /// First Via value, parsed straight from the indexed Via header: no header is
    /// re-scanned.
    fn parse_top_via(&self) -> Option<Via<'a>> {
        let idx = self.via?;
        match CommaValues::new(self.buf, idx.value).next() {
            Some(span) => parse_via(self.buf, span, b""),
            // An empty first Via header: let the general walk find the first value.
            None => self.vias().next(),
        }
    }

    /// Raw value of the first Via header (possibly several comma-joined values).
    pub fn via_header(&self) -> Option<&'a [u8]> {
        self.via.map(|h| h.value.of(self.buf))
    }

    /// Every Via value in order (RFC 3261 §7.3.1: several headers and comma-joined values).
    pub fn vias(&self) -> Vias<'a> {
        Vias {
            headers: Headers {
                buf: self.buf,
                pos: self.via.map_or(self.headers_end, |h| h.line.start),
                end: self.headers_end,
            },
            values: None,
        }
    }

    /// Via values in headers starting at or after offset `pos`.
    pub(crate) fn vias_after(&self, pos: usize) -> Vias<'a> {
        Vias {
            headers: Headers {
                buf: self.buf,
                pos: pos.min(self.headers_end),
                end: self.headers_end,
            },
            values: None,
        }
    }

    /// First Route value (`<sip:...;lr>`), raw.
    pub fn route(&self) -> Option<&'a [u8]> {
        let h = self.route?;
        CommaValues::new(self.buf, h.value)
            .next()
            .map(|s| s.of(self.buf))
    }

    /// URI of the first Route value.
    pub fn route_uri(&self) -> Option<&'a [u8]> {
        Some(parse_name_addr(self.route()?)?.uri)
    }

    /// Every Route value in order, raw.
    pub fn routes(&self) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.values_of(self.route, HeaderName::Route)
    }

    /// First Record-Route value, raw.
    pub fn record_route(&self) -> Option<&'a [u8]> {
        let h = self.record_route?;
        CommaValues::new(self.buf, h.value)
            .next()
            .map(|s| s.of(self.buf))
    }

    /// First Contact value (compact `m`), raw.
    pub fn contact(&self) -> Option<&'a [u8]> {
        let h = self.contact?;
        CommaValues::new(self.buf, h.value)
            .next()
            .map(|s| s.of(self.buf))
    }

    fn values_of(
        &self,
        first: Option<Indexed>,
        name: HeaderName,
    ) -> impl Iterator<Item = &'a [u8]> + 'a {
        let buf = self.buf;
        let headers = Headers {
            buf,
            pos: first.map_or(self.headers_end, |h| h.line.start),
            end: self.headers_end,
        };
        headers
            .filter(move |h| HeaderName::classify(h.name) == name)
            .flat_map(move |h| CommaValues::new(buf, h.value_span))
            .map(move |s| s.of(buf))
    }

    /// The mandatory headers a proxy needs to handle the message (RFC 3261 §8.1.1, §16.3):
    /// the name of the first one missing or malformed.
    pub fn missing_mandatory(&self) -> Option<&'static str> {
        if self.top_via().is_none() {
            return Some("Via");
        }
        if self.call_id().is_none() {
            return Some("Call-ID");
        }
        if self.from.is_none() {
            return Some("From");
        }
        if self.to.is_none() {
            return Some("To");
        }
        if self.cseq().is_none() {
            return Some("CSeq");
        }
        None
    }

    /// Whether Call-ID, CSeq, From, To or Max-Forwards appears more than once (RFC 4475
    /// §3.3.8: answer 400; a proxy cannot tell which one the sender meant).
    pub fn has_duplicate_header(&self) -> bool {
        self.has_duplicate
    }

    /// Raw value of the first Proxy-Require header (RFC 3261 §20.29).
    pub fn proxy_require(&self) -> Option<&'a [u8]> {
        self.proxy_require.map(|h| h.value.of(self.buf))
    }

    pub(crate) fn via_index(&self) -> Option<Indexed> {
        self.via
    }
    pub(crate) fn max_forwards_index(&self) -> Option<Indexed> {
        self.max_forwards
    }
    pub(crate) fn route_index(&self) -> Option<Indexed> {
        self.route
    }
    pub(crate) fn index_from(&self) -> Option<Indexed> {
        self.from
    }
    pub(crate) fn index_to(&self) -> Option<Indexed> {
        self.to
    }
    pub(crate) fn call_id_index(&self) -> Option<Indexed> {
        self.call_id
    }
    pub(crate) fn cseq_index(&self) -> Option<Indexed> {
        self.cseq
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn is_response_reads_the_version_like_scan() {
        assert!(super::is_response(b"SIP/2.0 200 OK\r\n"));
        assert!(super::is_response(b"sip/2.0 180 Ringing\r\n"));
        assert!(!super::is_response(b"INVITE sip:a@b SIP/2.0\r\n"));
        assert!(!super::is_response(b"SIP/2.0"));
        assert!(!super::is_response(b"SIP/3.0 200 OK\r\n"));
    }

    use super::*;

    /// The byte-at-a-time definition `find_unquoted` must keep.
    fn find_unquoted_reference(s: &[u8], target: u8) -> Option<usize> {
        let (mut in_quote, mut angle, mut i) = (false, false, 0);
        while i < s.len() {
            let c = s[i];
            if in_quote {
                match c {
                    b'\\' => i += 1,
                    b'"' => in_quote = false,
                    _ => {}
                }
            } else if c == target && !angle {
                return Some(i);
            } else {
                match c {
                    b'"' => in_quote = true,
                    b'<' => angle = true,
                    b'>' => angle = false,
                    _ => {}
                }
            }
            i += 1;
        }
        None
    }

    proptest::proptest! {
        #[test]
        fn find_unquoted_matches_reference(
            s in proptest::collection::vec(proptest::sample::select(b"ab,;\"<>\\ ".to_vec()), 0..40),
            t in proptest::sample::select(b",;\"<".to_vec()),
        ) {
            proptest::prop_assert_eq!(find_unquoted(&s, t), find_unquoted_reference(&s, t));
        }
    }

    #[test]
    fn top_via_matches_the_general_walk() {
        let cases: [&[u8]; 5] = [
            b"SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP a:1;branch=z9hG4bK1, SIP/2.0/UDP b:2;rport=9\r\nCall-ID: x\r\n\r\n",
            b"SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP a:1;branch=z9hG4bK1\r\nCall-ID: x\r\nv: SIP/2.0/UDP [::1]:2\r\n\r\n",
            b"SIP/2.0 200 OK\r\nVia: ,\r\nVia: SIP/2.0/UDP a:1\r\nVia: SIP/2.0/UDP b:2\r\n\r\n",
            b"SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP a:1\r\nCall-ID: x\r\n\r\n",
            b"SIP/2.0 200 OK\r\nCall-ID: x\r\n\r\n",
        ];
        for c in cases {
            let m = scan(c).unwrap();
            let all: Vec<_> = m.vias().collect();
            assert_eq!(m.top_via(), all.first().copied());
        }
    }

    const INVITE: &[u8] = b"INVITE sip:bob@biloxi.example.com SIP/2.0\r\n\
Via: SIP/2.0/UDP pc33.atlanta.example.com;branch=z9hG4bK776asdhds ;rport\r\n\
Max-Forwards: 70\r\n\
To: Bob <sip:bob@Biloxi.Example.com>\r\n\
From: Alice <sip:alice@atlanta.example.com>;tag=1928301774\r\n\
Call-ID: a84b4c76e66710@pc33.atlanta.example.com\r\n\
CSeq: 314159 INVITE\r\n\
Contact: <sip:alice@pc33.atlanta.example.com>\r\n\
Content-Type: application/sdp\r\n\
Content-Length: 4\r\n\
\r\n\
v=0\n";

    #[test]
    fn scans_invite() {
        let m = scan(INVITE).unwrap();
        assert_eq!(m.method(), Some(&b"INVITE"[..]));
        assert_eq!(m.request_uri(), Some(&b"sip:bob@biloxi.example.com"[..]));
        assert_eq!(
            m.call_id(),
            Some(&b"a84b4c76e66710@pc33.atlanta.example.com"[..])
        );
        let cs = m.cseq().unwrap();
        assert_eq!((cs.seq, cs.method), (314159, &b"INVITE"[..]));
        assert_eq!(m.max_forwards(), MaxForwards::Value(70));
        assert_eq!(m.content_length(), Some(4));
        assert_eq!(m.body(), b"v=0\n");
        assert_eq!(m.to_host(), Some(&b"Biloxi.Example.com"[..]));
        assert_eq!(m.from_tag(), Some(&b"1928301774"[..]));
        assert_eq!(m.to_tag(), None);
        let v = m.top_via().unwrap();
        assert_eq!(v.transport, b"UDP");
        assert_eq!(v.host, b"pc33.atlanta.example.com");
        assert_eq!(v.port, None);
        assert_eq!(v.branch, Some(&b"z9hG4bK776asdhds"[..]));
        assert_eq!(v.rport, Rport::Requested);
        assert_eq!(m.missing_mandatory(), None);
        assert_eq!(m.header(b"content-type"), Some(&b"application/sdp"[..]));
        assert_eq!(m.len(), INVITE.len());
    }

    #[test]
    fn compact_folded_multi_via() {
        let msg = b"OPTIONS sip:[2001:db8::10]:5070;transport=udp SIP/2.0\r\n\
v: SIP/2.0/UDP [2001:db8::1]:5062;branch=z9hG4bKa;received=[2001:db8::9];rport=7,\r\n \
 SIP / 2.0 / TCP  host.example:5099 ;branch=z9hG4bKb\r\n\
VIA: SIP/2.0/UDP 10.0.0.1;branch=z9hG4bKc\r\n\
i:   abc@def  \r\n\
f: <sip:a@b>;tag=x\r\n\
t: sip:c@D.example\r\n\
CSeq: 1\r\n   OPTIONS\r\n\
l: 0\r\n\r\n";
        let m = scan(msg).unwrap();
        assert_eq!(m.call_id(), Some(&b"abc@def"[..]));
        assert_eq!(m.cseq().unwrap().method, b"OPTIONS");
        let vias: Vec<_> = m.vias().collect();
        assert_eq!(vias.len(), 3);
        assert_eq!(vias[0].host, b"2001:db8::1");
        assert_eq!(vias[0].port, Some(5062));
        assert_eq!(vias[0].received, Some(&b"2001:db8::9"[..]));
        assert_eq!(vias[0].rport, Rport::Filled(7));
        assert_eq!(vias[1].transport, b"TCP");
        assert_eq!(vias[1].host, b"host.example");
        assert_eq!(vias[1].port, Some(5099));
        assert_eq!(vias[2].branch, Some(&b"z9hG4bKc"[..]));
        assert_eq!(m.to_host(), Some(&b"D.example"[..]));
        let u = parse_uri(m.request_uri().unwrap()).unwrap();
        assert_eq!((u.host, u.port), (&b"2001:db8::10"[..], Some(5070)));
        assert_eq!(u.param(b"transport"), Some(&b"udp"[..]));
    }

    #[test]
    fn response_line() {
        let m = scan(b"SIP/2.0 180 Ringing\r\nVia: SIP/2.0/UDP h;branch=z9hG4bKx\r\n\r\n").unwrap();
        assert_eq!(m.status_code(), Some(180));
        assert!(matches!(
            m.start_line(),
            StartLine::Response {
                reason: b"Ringing",
                ..
            }
        ));
        assert!(scan(b"SIP/2.0 20 OK\r\n\r\n").is_err());
        assert_eq!(
            scan(b"SIP/7.0 200 OK\r\n\r\n").err(),
            Some(ScanError::BadVersion)
        );
    }

    #[test]
    fn errors() {
        assert_eq!(scan(b"").err(), Some(ScanError::Incomplete));
        assert_eq!(
            scan(b"INVITE sip:a SIP/2.0\r\nVia: x\r\n").err(),
            Some(ScanError::Incomplete)
        );
        assert_eq!(
            scan(b"INVITE sip:a SIP/2.0\r\nl: 10\r\n\r\nabc").err(),
            Some(ScanError::Incomplete)
        );
        assert_eq!(
            scan(b"INVITE sip:a SIP/2.0\r\nl: x\r\n\r\n").err(),
            Some(ScanError::BadContentLength)
        );
        assert_eq!(
            scan(b"INVITE sip:a SIP/2.0\r\nl: 1\r\nContent-Length: 2\r\n\r\nab").err(),
            Some(ScanError::BadContentLength)
        );
        assert_eq!(
            scan(b"INVITE sip:a b SIP/2.0\r\n\r\n").err(),
            Some(ScanError::BadStartLine)
        );
        assert_eq!(
            scan(b"INVITE sip:a SIP/2.0\r\nNoColon\r\n\r\n").err(),
            Some(ScanError::BadHeader)
        );
        let mut many = b"OPTIONS sip:a SIP/2.0\r\n".to_vec();
        for _ in 0..=MAX_HEADERS {
            many.extend_from_slice(b"X: y\r\n");
        }
        many.extend_from_slice(b"\r\n");
        assert_eq!(scan(&many).err(), Some(ScanError::TooManyHeaders));
    }

    #[test]
    fn large_and_hostile_inputs() {
        // 64 KB without a line end, 64 KB of NULs, 64 KB of LFs, a 64 KB header value.
        assert_eq!(scan(&[b'A'; 65536]).err(), Some(ScanError::Incomplete));
        assert!(scan(&[0u8; 65536]).is_err());
        assert!(scan(&[b'\n'; 65536]).is_err());
        let mut big = b"OPTIONS sip:a SIP/2.0\r\nX-Big: ".to_vec();
        big.resize(65536 - 4, b'x');
        big.extend_from_slice(b"\r\n\r\n");
        let m = scan(&big).unwrap();
        assert_eq!(m.header(b"x-big").map(<[u8]>::len), Some(65536 - 4 - 30));
        // A body of 60000 bytes framed by Content-Length.
        let mut body = b"MESSAGE sip:a SIP/2.0\r\nl: 60000\r\n\r\n".to_vec();
        body.resize(body.len() + 60000, b'b');
        assert_eq!(scan(&body).unwrap().body().len(), 60000);
        assert_eq!(
            scan(&body[..body.len() - 1]).err(),
            Some(ScanError::Incomplete)
        );
    }

    #[test]
    fn name_addr_and_routes() {
        let na = parse_name_addr(b"\"A <b>, c\" <sip:x@y;lr>;tag=\"q;r\";foo").unwrap();
        assert_eq!(na.uri, b"sip:x@y;lr");
        assert_eq!(na.param(b"TAG"), Some(&b"\"q;r\""[..]));
        assert_eq!(na.param(b"foo"), Some(&b""[..]));
        let m = scan(
            b"BYE sip:a@b SIP/2.0\r\nRoute: <sip:p1;lr>, <sip:p2;lr>\r\nRoute: <sip:p3>\r\n\r\n",
        )
        .unwrap();
        let r: Vec<_> = m.routes().collect();
        assert_eq!(r, vec![&b"<sip:p1;lr>"[..], b"<sip:p2;lr>", b"<sip:p3>"]);
        assert_eq!(m.route_uri(), Some(&b"sip:p1;lr"[..]));
    }
}
