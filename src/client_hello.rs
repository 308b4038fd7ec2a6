//! PURE: the server name (SNI, RFC 6066 §3) and the offered application protocols (ALPN,
//! RFC 7301 §3.1) of a TLS ClientHello, read from the first bytes of a connection without
//! terminating TLS, so a `tcp` vserver can route TLS by name and pass it through untouched
//! (docs/routing.md). The ClientHello may span several TLS records and TCP segments
//! (RFC 8446 §5.1: a handshake message may be fragmented over records); the shell reads until
//! [`parse`] stops saying [`Hello::Incomplete`], up to [`MAX_HELLO`] bytes or a timeout.

/// Most bytes read for a ClientHello (its records with their headers). A larger one is
/// [`Hello::Unreadable`] (RFC 8446 §4.1.2 hellos are a few hundred bytes; post-quantum key
/// shares bring them to 2-3 KB).
pub const MAX_HELLO: usize = 16 * 1024;

/// TLS record content type of handshake messages (RFC 8446 §5.1).
const HANDSHAKE: u8 = 22;
/// Handshake message type of a ClientHello (RFC 8446 §4).
const CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
const EXT_ALPN: u16 = 16;
/// `host_name` in a ServerNameList (RFC 6066 §3).
const HOST_NAME: u8 = 0;

/// What the first bytes of a connection say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// A ClientHello begins but is not complete yet: read more.
    Incomplete,
    /// A complete ClientHello.
    Read(ClientHello),
    /// Not a TLS handshake, a malformed ClientHello, or one larger than [`MAX_HELLO`]: it has
    /// no name or protocols a rule can read.
    Unreadable,
}

/// The fields of a ClientHello the rules read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientHello {
    /// The `host_name` of the server_name extension, lower-cased, without a trailing dot.
    pub sni: Option<Vec<u8>>,
    /// The protocols of the ALPN extension, in the client's order.
    pub alpn: Vec<Vec<u8>>,
}

/// Read the ClientHello at the start of `buf`, the bytes of a connection so far.
pub fn parse(buf: &[u8]) -> Hello {
    // The handshake layer: the fragments of the records, in order, up to the end of the first
    // handshake message.
    let mut msg: Vec<u8> = Vec::new();
    let mut at = 0;
    loop {
        let Some(header) = buf.get(at..at + 5) else {
            // An SSL 2.0 hello or anything else fails on its first byte as soon as it is read.
            return match buf.get(at) {
                Some(&t) if t != HANDSHAKE => Hello::Unreadable,
                _ => Hello::Incomplete,
            };
        };
        // Content type, then legacy_record_version (major 3 in every TLS), then the length.
        if header[0] != HANDSHAKE || header[1] != 3 {
            return Hello::Unreadable;
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len == 0 || len > 1 << 14 {
            return Hello::Unreadable;
        }
        let Some(fragment) = buf.get(at + 5..at + 5 + len) else {
            return if at + 5 + len > MAX_HELLO {
                Hello::Unreadable
            } else {
                Hello::Incomplete
            };
        };
        msg.extend_from_slice(fragment);
        at += 5 + len;
        if msg.len() >= 4 {
            if msg[0] != CLIENT_HELLO {
                return Hello::Unreadable;
            }
            let body = usize::from(msg[1]) << 16 | usize::from(msg[2]) << 8 | usize::from(msg[3]);
            if body > MAX_HELLO {
                return Hello::Unreadable;
            }
            if msg.len() >= 4 + body {
                return match client_hello(&msg[4..4 + body]) {
                    Some(h) => Hello::Read(h),
                    None => Hello::Unreadable,
                };
            }
        }
        if at >= MAX_HELLO {
            return Hello::Unreadable;
        }
    }
}

/// A cursor over a handshake message's body; every read checks its bounds.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    /// A vector with a one-byte length.
    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()?;
        self.take(usize::from(n))
    }

    /// A vector with a two-byte length.
    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.take(usize::from(n))
    }
}

/// The body of a ClientHello (RFC 8446 §4.1.2; TLS 1.2's is the same up to the extensions,
/// which it may leave out, RFC 5246 §7.4.1.2).
fn client_hello(body: &[u8]) -> Option<ClientHello> {
    let mut r = Reader(body);
    r.take(2)?; // legacy_version
    r.take(32)?; // random
    r.vec8()?; // legacy_session_id
    r.vec16()?; // cipher_suites
    r.vec8()?; // legacy_compression_methods
    let mut out = ClientHello::default();
    if r.0.is_empty() {
        return Some(out);
    }
    let mut exts = Reader(r.vec16()?);
    while !exts.0.is_empty() {
        let kind = exts.u16()?;
        let data = exts.vec16()?;
        match kind {
            EXT_SERVER_NAME => out.sni = server_name(data)?,
            EXT_ALPN => out.alpn = protocols(data)?,
            _ => {}
        }
    }
    Some(out)
}

/// The `host_name` of a ServerNameList; `Some(None)` when it holds no host name.
fn server_name(data: &[u8]) -> Option<Option<Vec<u8>>> {
    let mut list = Reader(Reader(data).vec16()?);
    while !list.0.is_empty() {
        let kind = list.u8()?;
        let name = list.vec16()?;
        if kind == HOST_NAME {
            let name = name.strip_suffix(b".").unwrap_or(name);
            if name.is_empty() {
                return None;
            }
            return Some(Some(name.to_ascii_lowercase()));
        }
    }
    Some(None)
}

/// The ProtocolNames of a ProtocolNameList (each 1 to 255 bytes).
fn protocols(data: &[u8]) -> Option<Vec<Vec<u8>>> {
    let mut list = Reader(Reader(data).vec16()?);
    let mut out = Vec::new();
    while !list.0.is_empty() {
        let p = list.vec8()?;
        if p.is_empty() {
            return None;
        }
        out.push(p.to_vec());
    }
    Some(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    fn vec16(b: &[u8]) -> Vec<u8> {
        let mut v = (b.len() as u16).to_be_bytes().to_vec();
        v.extend_from_slice(b);
        v
    }

    fn ext(kind: u16, data: &[u8]) -> Vec<u8> {
        let mut v = kind.to_be_bytes().to_vec();
        v.extend(vec16(data));
        v
    }

    /// A ClientHello handshake message (with its 4-byte header) naming `sni` and offering
    /// `alpn`, padded with an extension of `pad` bytes.
    pub(crate) fn hello_message(sni: Option<&str>, alpn: &[&str], pad: usize) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend([7u8; 32]);
        body.push(32);
        body.extend([9u8; 32]);
        body.extend(vec16(&[0x13, 0x01, 0x13, 0x02]));
        body.extend([1, 0]);
        let mut exts = Vec::new();
        if let Some(name) = sni {
            let mut entry = vec![HOST_NAME];
            entry.extend(vec16(name.as_bytes()));
            exts.extend(ext(EXT_SERVER_NAME, &vec16(&entry)));
        }
        if !alpn.is_empty() {
            let mut list = Vec::new();
            for p in alpn {
                list.push(p.len() as u8);
                list.extend_from_slice(p.as_bytes());
            }
            exts.extend(ext(EXT_ALPN, &vec16(&list)));
        }
        // supported_versions: TLS 1.3, then padding (RFC 7685).
        exts.extend(ext(43, &[2, 3, 4]));
        if pad > 0 {
            exts.extend(ext(21, &vec![0; pad]));
        }
        body.extend(vec16(&exts));
        let mut msg = vec![CLIENT_HELLO];
        msg.extend(&(body.len() as u32).to_be_bytes()[1..]);
        msg.extend(body);
        msg
    }

    /// `msg` in TLS records of at most `chunk` bytes each.
    pub(crate) fn records(msg: &[u8], chunk: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for part in msg.chunks(chunk) {
            out.extend([HANDSHAKE, 3, 1]);
            out.extend((part.len() as u16).to_be_bytes());
            out.extend_from_slice(part);
        }
        out
    }

    fn read(sni: Option<&str>, alpn: &[&str]) -> Hello {
        Hello::Read(ClientHello {
            sni: sni.map(|s| s.as_bytes().to_vec()),
            alpn: alpn.iter().map(|p| p.as_bytes().to_vec()).collect(),
        })
    }

    #[test]
    fn name_and_protocols_of_one_record() {
        let buf = records(
            &hello_message(Some("Api.Example.COM."), &["h2", "http/1.1"], 0),
            1 << 14,
        );
        assert_eq!(
            parse(&buf),
            read(Some("api.example.com"), &["h2", "http/1.1"])
        );
        let buf = records(&hello_message(None, &[], 0), 1 << 14);
        assert_eq!(parse(&buf), read(None, &[]));
    }

    #[test]
    fn a_hello_over_several_records_and_segments() {
        // A 6 KB hello (a post-quantum key share's size) in 1 000-byte records: every prefix is
        // incomplete, the whole is read, and bytes after it (the client's next flight) are
        // left alone.
        let msg = hello_message(Some("b.example.com"), &["h2"], 6000);
        let mut buf = records(&msg, 1000);
        for cut in [0, 1, 4, 5, 6, 1004, 1006, buf.len() - 1] {
            assert_eq!(parse(&buf[..cut]), Hello::Incomplete, "cut at {cut}");
        }
        buf.extend([23, 3, 3, 0, 1, 0]);
        assert_eq!(parse(&buf), read(Some("b.example.com"), &["h2"]));
    }

    #[test]
    fn what_is_not_a_readable_hello() {
        // Plain HTTP, SSL 2.0's hello, an alert record, a handshake that is not a ClientHello,
        // a record longer than TLS allows, a hello longer than the bound.
        for buf in [
            &b"GET / HTTP/1.1\r\n"[..],
            &[0x80, 0x2e, 0x01, 0x00, 0x02][..],
            &[21, 3, 3, 0, 2, 2, 40][..],
            &[22, 3, 3, 0, 4, 2, 0, 0, 0][..],
            &[22, 3, 3, 0x48, 0x01][..],
        ] {
            assert_eq!(parse(buf), Hello::Unreadable, "{buf:?}");
        }
        let big = records(&hello_message(Some("a"), &[], MAX_HELLO), 1 << 14);
        assert_eq!(parse(&big[..MAX_HELLO + 100]), Hello::Unreadable);
        // An ALPN list that claims more bytes than its extension holds.
        let mut msg = hello_message(Some("a.example"), &["h2"], 0);
        let at = msg
            .windows(5)
            .position(|w| w == [0, 3, 2, b'h', b'2'])
            .expect("alpn");
        msg[at + 1] = 9;
        assert_eq!(parse(&records(&msg, 1 << 14)), Hello::Unreadable);
        // An empty ALPN protocol name (RFC 7301 §3.1: 1 to 255 bytes).
        let mut msg = hello_message(None, &["x"], 0);
        let at = msg.windows(2).position(|w| w == [1, b'x']).expect("alpn");
        msg[at] = 0;
        msg[at + 1] = 0;
        assert_eq!(parse(&records(&msg, 1 << 14)), Hello::Unreadable);
    }

    proptest! {
        /// Any name and protocols, in records of any size: read back exactly; no prefix is
        /// mistaken for a complete hello; arbitrary bytes never panic.
        #[test]
        fn round_trip(
            name in "[a-z0-9]{1,20}(\\.[a-z0-9]{1,20}){0,3}",
            alpn in proptest::collection::vec("[a-z0-9/.]{1,12}", 0..4),
            pad in 0usize..3000,
            chunk in 1usize..2000,
            junk in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let protos: Vec<&str> = alpn.iter().map(String::as_str).collect();
            let buf = records(&hello_message(Some(&name), &protos, pad), chunk);
            if buf.len() <= MAX_HELLO {
                prop_assert_eq!(parse(&buf), read(Some(&name), &protos));
                let cut = buf.len() * 2 / 3;
                prop_assert_eq!(parse(&buf[..cut]), Hello::Incomplete);
            } else {
                prop_assert_eq!(parse(&buf), Hello::Unreadable);
            }
            let _ = parse(&junk);
        }
    }
}
