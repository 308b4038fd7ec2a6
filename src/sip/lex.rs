//! The lexical pieces of SIP (RFC 3261 §25.1): byte ranges into a message, tokens, linear
//! white space, decimals, quoted strings and comma-separated values. PURE.

use memchr::memchr3;

/// A half-open byte range `start..end` into the scanned buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    #[inline]
    pub(crate) fn new(start: usize, end: usize) -> Span {
        Span { start, end }
    }

    /// The bytes of this range in `buf` (empty when out of range, never panics).
    #[inline]
    pub fn of<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        buf.get(self.start..self.end).unwrap_or(&[])
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
}

/// RFC 3261 §25.1 `token` characters, as a table: this test runs once per byte of every name.
pub(crate) const TOKEN: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 256 {
        let b = c as u8;
        t[c] = b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'-' | b'.' | b'!' | b'%' | b'*' | b'_' | b'+' | b'`' | b'\'' | b'~'
            );
        c += 1;
    }
    t
};

/// RFC 3261 §25.1 `token` characters.
#[inline]
pub(crate) fn is_token_char(c: u8) -> bool {
    TOKEN[usize::from(c)]
}

#[inline]
pub(crate) fn is_lws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\r' | b'\n')
}

pub(crate) fn trim_lws(s: &[u8]) -> &[u8] {
    let start = s.iter().position(|&c| !is_lws(c)).unwrap_or(s.len());
    let end = s.iter().rposition(|&c| !is_lws(c)).map_or(start, |i| i + 1);
    &s[start..end.max(start)]
}

pub(crate) fn trailing_lws(s: &[u8]) -> usize {
    s.iter().rev().take_while(|&&c| is_lws(c)).count()
}

pub(crate) fn trim_lws_span(buf: &[u8], mut s: usize, mut e: usize) -> (usize, usize) {
    while s < e && is_lws(buf[s]) {
        s += 1;
    }
    while e > s && is_lws(buf[e - 1]) {
        e -= 1;
    }
    (s, e)
}

/// A non-negative decimal that fits in `usize`, surrounding LWS allowed.
pub(crate) fn parse_decimal(s: &[u8]) -> Option<usize> {
    let s = trim_lws(s);
    if s.is_empty() || s.len() > 18 || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(s.iter().fold(0usize, |a, d| a * 10 + usize::from(d - b'0')))
}

/// Offset of the first byte in `s` that is `target` outside quoted strings and `<...>`.
pub(crate) fn find_unquoted(s: &[u8], target: u8) -> Option<usize> {
    let mut in_quote = false;
    let mut angle = false;
    let mut i = 0;
    while i < s.len() {
        if !in_quote && !angle {
            // Outside quotes and brackets only these three bytes change anything: jump to
            // the next one (SIMD) instead of stepping through every byte of the value.
            i += memchr3(target, b'"', b'<', &s[i..])?;
        }
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

/// Comma-separated values of one header (RFC 3261 §7.3.1), as spans into `buf`.
#[derive(Debug, Clone)]
pub(crate) struct CommaValues<'a> {
    buf: &'a [u8],
    pos: usize,
    end: usize,
}

impl<'a> CommaValues<'a> {
    pub(crate) fn new(buf: &'a [u8], span: Span) -> Self {
        CommaValues {
            buf,
            pos: span.start,
            end: span.end.min(buf.len()),
        }
    }
}

impl Iterator for CommaValues<'_> {
    type Item = Span;
    fn next(&mut self) -> Option<Span> {
        while self.pos < self.end {
            let rest = &self.buf[self.pos..self.end];
            let len = find_unquoted(rest, b',').unwrap_or(rest.len());
            let (s, e) = trim_lws_span(self.buf, self.pos, self.pos + len);
            self.pos += len + 1;
            if e > s {
                return Some(Span::new(s, e));
            }
        }
        None
    }
}
