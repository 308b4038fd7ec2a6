//! Where one SIP message ends on a byte stream (SIP over TCP, RFC 3261 §18.3; docs/sip.md). PURE.
//!
//! [`next_frame`] looks at the front of a connection's read buffer and says how many bytes
//! form the next unit: a message (framed by Content-Length, mandatory on streams, RFC 3261
//! §18.3), a keep-alive ping (CRLFCRLF, RFC 5626 §3.5.1, answered with [`PONG`]) or a pong
//! (a lone CRLF, ignored). "Need more bytes" is [`FrameError::Incomplete`], a normal result.
//! The caller consumes `frame.len()` bytes and calls again, so back-to-back messages in one
//! read come out one at a time.
//!
//! Framing reads only the start of each line and Content-Length, so a frame may still fail
//! [`crate::sip::scan`]; such a message is dropped, and the stream stays in sync because the
//! boundary came from Content-Length. A Content-Length value folded over two lines is refused
//! (no implementation sends one, and guessing would desynchronise the stream).

use memchr::memchr;

use super::scan::{HeaderName, parse_decimal, trim_lws};

/// Default upper bound on one message, header and body together.
pub const DEFAULT_MAX_MESSAGE: usize = 64 * 1024;

/// The answer to a CRLFCRLF ping (RFC 5626 §3.5.1).
pub const PONG: &[u8] = b"\r\n";

/// The next unit on the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame {
    /// A SIP message of `len` bytes whose body starts at `header_len`; scan `&buf[..len]`.
    Message { len: usize, header_len: usize },
    /// CRLFCRLF keep-alive: send [`PONG`] back.
    Ping,
    /// A lone CRLF: a pong to our ping, or padding between messages (RFC 3261 §7.5). Ignore.
    Pong,
}

impl Frame {
    /// Bytes to consume from the front of the buffer.
    pub fn len(&self) -> usize {
        match *self {
            Frame::Message { len, .. } => len,
            Frame::Ping => 4,
            Frame::Pong => 2,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why the stream cannot be framed. Everything but `Incomplete` means "close the connection":
/// after a framing error the message boundaries are lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("need more bytes")]
    Incomplete,
    #[error("message larger than the limit")]
    TooLarge,
    /// RFC 3261 §18.3: Content-Length MUST be used with stream transports.
    #[error("no Content-Length on a stream")]
    MissingContentLength,
    #[error("bad or conflicting Content-Length")]
    BadContentLength,
    #[error("malformed header section")]
    Malformed,
}

/// Frame the front of `buf`, allowing messages of at most `max_len` bytes.
pub fn next_frame(buf: &[u8], max_len: usize) -> Result<Frame, FrameError> {
    Framer::default().frame(buf, max_len)
}

/// [`next_frame`] that remembers how far it has read the message at the front of a growing
/// buffer, so each call reads only the bytes that arrived since the last one: a peer that
/// sends a message a byte at a time costs work in proportion to its bytes, not to their
/// square. Same answers as [`next_frame`] on the same buffer.
///
/// The caller keeps one per buffer and must not change the buffered bytes between calls
/// except by appending; after a frame (or an error) it starts afresh on its own, ready for the
/// caller to consume the frame and call again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Framer {
    /// Where the next header line starts; 0 while nothing of the message has been read.
    pos: usize,
    content_length: Option<usize>,
    /// The header section's length, once its empty line has been read.
    header_len: Option<usize>,
}

impl Framer {
    /// The frame at the front of `buf` (see [`next_frame`]).
    pub fn frame(&mut self, buf: &[u8], max_len: usize) -> Result<Frame, FrameError> {
        let r = self.advance(buf, max_len);
        if r != Err(FrameError::Incomplete) {
            *self = Framer::default();
        }
        r
    }

    fn advance(&mut self, buf: &[u8], max_len: usize) -> Result<Frame, FrameError> {
        if self.pos == 0 {
            match buf {
                [] | [b'\r'] | [b'\r', b'\n'] | [b'\r', b'\n', b'\r'] => {
                    return Err(FrameError::Incomplete);
                }
                [b'\r', b'\n', b'\r', b'\n', ..] => return Ok(Frame::Ping),
                [b'\r', b'\n', ..] => return Ok(Frame::Pong),
                [b'\r', ..] => return Err(FrameError::Malformed),
                _ => {}
            }
        }
        let header_len = match self.header_len {
            Some(h) => h,
            None => {
                let h = self.header_section(buf, max_len)?;
                self.header_len = Some(h);
                h
            }
        };
        let body = self
            .content_length
            .ok_or(FrameError::MissingContentLength)?;
        let len = header_len
            .checked_add(body)
            .filter(|l| *l <= max_len)
            .ok_or(FrameError::TooLarge)?;
        if buf.len() < len {
            return Err(FrameError::Incomplete);
        }
        Ok(Frame::Message { len, header_len })
    }

    /// Walk the header lines from where the last call stopped up to the empty one; bounded
    /// by `max_len`, so a peer cannot make us read an endless header section.
    fn header_section(&mut self, buf: &[u8], max_len: usize) -> Result<usize, FrameError> {
        let limit = buf.len().min(max_len);
        loop {
            let Some(i) = memchr(b'\n', buf.get(self.pos..limit).unwrap_or_default()) else {
                return Err(if buf.len() >= max_len {
                    FrameError::TooLarge
                } else {
                    FrameError::Incomplete
                });
            };
            let first = self.pos == 0;
            let line_end = self.pos + i;
            let line = &buf[self.pos..line_end];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let next = line_end + 1;
            if line.is_empty() {
                if first {
                    return Err(FrameError::Malformed);
                }
                return Ok(next);
            }
            // Continuation lines (leading SP/HT) cannot start a Content-Length header; the
            // start line is skipped.
            if !first && !matches!(line[0], b' ' | b'\t') {
                if let Some(colon) = memchr(b':', line) {
                    if HeaderName::classify(trim_lws(&line[..colon])) == HeaderName::ContentLength {
                        let n = parse_decimal(&line[colon + 1..])
                            .ok_or(FrameError::BadContentLength)?;
                        match self.content_length {
                            Some(prev) if prev != n => return Err(FrameError::BadContentLength),
                            _ => self.content_length = Some(n),
                        }
                    }
                } else {
                    return Err(FrameError::Malformed);
                }
            }
            self.pos = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sip::scan::scan;

    const MSG: &[u8] = b"INVITE sip:bob@example.com SIP/2.0\r\n\
Via: SIP/2.0/TCP client.example.com:5060;branch=z9hG4bK74bf9\r\n\
Max-Forwards: 70\r\n\
From: Alice <sip:alice@example.com>;tag=9fxced76sl\r\n\
To: Bob <sip:bob@example.com>\r\n\
Call-ID: 3848276298220188511@example.com\r\n\
CSeq: 1 INVITE\r\n\
Content-Type: application/sdp\r\n\
Content-Length: 5\r\n\
\r\n\
v=0\r\n";

    fn frame(buf: &[u8]) -> Result<Frame, FrameError> {
        next_frame(buf, DEFAULT_MAX_MESSAGE)
    }

    #[test]
    fn complete_message() {
        let f = frame(MSG).unwrap();
        assert_eq!(f.len(), MSG.len());
        let m = scan(&MSG[..f.len()]).unwrap();
        assert_eq!(m.body(), b"v=0\r\n");
    }

    #[test]
    fn partial_headers_every_cut() {
        let hl = MSG.len() - 5;
        for cut in 0..hl - 1 {
            assert_eq!(
                frame(&MSG[..cut]),
                Err(FrameError::Incomplete),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn partial_body() {
        for cut in MSG.len() - 5..MSG.len() {
            assert_eq!(frame(&MSG[..cut]), Err(FrameError::Incomplete));
        }
    }

    #[test]
    fn back_to_back_and_keepalives() {
        let mut s = Vec::new();
        s.extend_from_slice(b"\r\n\r\n");
        s.extend_from_slice(MSG);
        s.extend_from_slice(b"\r\n");
        s.extend_from_slice(MSG);
        s.extend_from_slice(&MSG[..20]);
        let mut pos = 0;
        let mut seen = Vec::new();
        loop {
            match frame(&s[pos..]) {
                Ok(f) => {
                    seen.push(f);
                    pos += f.len();
                }
                Err(FrameError::Incomplete) => break,
                Err(e) => panic!("{e}"),
            }
        }
        let hl = MSG.len() - 5;
        let m = Frame::Message {
            len: MSG.len(),
            header_len: hl,
        };
        assert_eq!(seen, vec![Frame::Ping, m, Frame::Pong, m]);
        assert_eq!(pos, s.len() - 20);
    }

    #[test]
    fn keepalive_prefixes() {
        assert_eq!(frame(b""), Err(FrameError::Incomplete));
        assert_eq!(frame(b"\r"), Err(FrameError::Incomplete));
        assert_eq!(frame(b"\r\n"), Err(FrameError::Incomplete));
        assert_eq!(frame(b"\r\n\r"), Err(FrameError::Incomplete));
        assert_eq!(frame(b"\r\n\r\n"), Ok(Frame::Ping));
        assert_eq!(frame(b"\r\nI"), Ok(Frame::Pong));
        assert_eq!(frame(b"\rX"), Err(FrameError::Malformed));
    }

    #[test]
    fn compact_content_length() {
        let m = b"OPTIONS sip:a SIP/2.0\r\nl:3\r\n\r\nabcOPTIONS";
        assert_eq!(
            frame(m),
            Ok(Frame::Message {
                len: m.len() - 7,
                header_len: m.len() - 10
            })
        );
    }

    proptest::proptest! {
        /// A [`Framer`] fed a growing buffer answers, at every length, what [`next_frame`]
        /// answers on the same bytes: on any bytes (a small alphabet, so that lines, colons,
        /// Content-Length values and CRLFs occur), after any growth steps.
        #[test]
        fn framer_answers_as_next_frame_at_every_length(
            bytes in proptest::collection::vec(proptest::sample::select(
                b"\r\n: l0123Content-LghOPTIONS".to_vec()), 0..400),
            steps in proptest::collection::vec(1usize..40, 1..40),
            max in 16usize..300,
        ) {
            let mut framer = Framer::default();
            let (mut len, mut k) = (0, 0);
            while len < bytes.len() {
                len = (len + steps[k % steps.len()]).min(bytes.len());
                k += 1;
                let want = next_frame(&bytes[..len], max);
                proptest::prop_assert_eq!(framer.frame(&bytes[..len], max), want);
                if want != Err(FrameError::Incomplete) {
                    break;
                }
            }
        }
    }

    #[test]
    fn a_framer_reads_each_line_once_however_the_message_trickles_in() {
        // Byte by byte: every call after the first resumes where the last stopped.
        let mut framer = Framer::default();
        for n in 1..MSG.len() {
            assert_eq!(
                framer.frame(&MSG[..n], DEFAULT_MAX_MESSAGE),
                Err(FrameError::Incomplete)
            );
            // The line walk never goes back before the start of the line under way.
            let line_start = MSG[..n]
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1);
            let header_end = MSG.len() - 5;
            if n < header_end {
                assert_eq!(framer.pos, line_start, "at {n}: {framer:?}");
            } else {
                assert_eq!(framer.header_len, Some(header_end), "at {n}: {framer:?}");
            }
        }
        assert_eq!(
            framer.frame(MSG, DEFAULT_MAX_MESSAGE),
            Ok(Frame::Message {
                len: MSG.len(),
                header_len: MSG.len() - 5
            })
        );
        assert_eq!(framer, Framer::default(), "ready for the next message");
    }

    proptest::proptest! {
        /// Reads of any size give the same frames as one read of the whole stream.
        #[test]
        fn any_read_sizes(parts in proptest::collection::vec(0u8..3, 1..12),
                          chunks in proptest::collection::vec(1usize..300, 1..64)) {
            let mut stream = Vec::new();
            for p in &parts {
                match p {
                    0 => stream.extend_from_slice(MSG),
                    1 => stream.extend_from_slice(b"\r\n\r\n"),
                    _ => stream.extend_from_slice(b"OPTIONS sip:a SIP/2.0\r\nl: 0\r\n\r\n"),
                }
            }
            let mut expected = Vec::new();
            let mut pos = 0;
            while let Ok(f) = frame(&stream[pos..]) {
                expected.push(f);
                pos += f.len();
            }
            proptest::prop_assert_eq!(pos, stream.len());

            let mut got = Vec::new();
            let mut buf: Vec<u8> = Vec::new();
            let mut fed = 0;
            let mut c = 0;
            while fed < stream.len() {
                let n = chunks[c % chunks.len()].min(stream.len() - fed);
                c += 1;
                buf.extend_from_slice(&stream[fed..fed + n]);
                fed += n;
                loop {
                    match frame(&buf) {
                        Ok(f) => {
                            got.push(f);
                            buf.drain(..f.len());
                        }
                        Err(FrameError::Incomplete) => break,
                        Err(e) => return Err(proptest::test_runner::TestCaseError::fail(e.to_string())),
                    }
                }
            }
            proptest::prop_assert!(buf.is_empty());
            proptest::prop_assert_eq!(got, expected);
        }
    }

    #[test]
    fn errors() {
        assert_eq!(
            frame(b"OPTIONS sip:a SIP/2.0\r\nVia: x\r\n\r\n"),
            Err(FrameError::MissingContentLength)
        );
        assert_eq!(
            frame(b"OPTIONS sip:a SIP/2.0\r\nContent-Length: -1\r\n\r\n"),
            Err(FrameError::BadContentLength)
        );
        assert_eq!(
            frame(b"OPTIONS sip:a SIP/2.0\r\nContent-Length: 1\r\nl: 2\r\n\r\nab"),
            Err(FrameError::BadContentLength)
        );
        assert_eq!(
            frame(b"OPTIONS sip:a SIP/2.0\r\nContent-Length: 99999\r\n\r\n"),
            Err(FrameError::TooLarge)
        );
        assert_eq!(
            frame(b"OPTIONS sip:a SIP/2.0\r\nbroken\r\n\r\n"),
            Err(FrameError::Malformed)
        );
        let big = vec![b'A'; DEFAULT_MAX_MESSAGE + 1];
        assert_eq!(frame(&big), Err(FrameError::TooLarge));
        assert_eq!(frame(&big[..100]), Err(FrameError::Incomplete));
        // Content-Length exactly at the limit is accepted.
        let head = b"OPTIONS sip:a SIP/2.0\r\nl: 100\r\n\r\n";
        let mut m = head.to_vec();
        m.extend_from_slice(&[b'x'; 100]);
        assert_eq!(next_frame(&m, m.len()).unwrap().len(), m.len());
        assert_eq!(next_frame(&m, m.len() - 1), Err(FrameError::TooLarge));
    }
}
