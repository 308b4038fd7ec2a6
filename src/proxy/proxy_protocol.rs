//! PROXY protocol version 2 headers (HAProxy's "PROXY protocol" spec, section 2.2), sent
//! toward services when `send_proxy: v2` so they learn the client's address where
//! transparency is not available. PURE.
//!
//! Over TCP the header is written once, before the first byte of the client's stream. Over
//! UDP there is no connection to attach it to, so every datagram toward the service starts
//! with it (what the spec's `DGRAM` transport byte exists for).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// The 12-byte v2 signature.
pub const SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";

/// Largest header [`encode_v2`] writes (IPv6: 16 + 36 bytes).
pub const MAX_V2_LEN: usize = 16 + 36;

/// Transport of the proxied connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Stream,
    Datagram,
}

/// A decoded header (what a service learns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyHeader {
    pub transport: Transport,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    /// Header length: the payload starts here.
    pub len: usize,
}

/// Why bytes are not a valid v2 header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ProxyProtocolError {
    #[error("need more bytes")]
    Incomplete,
    #[error("not a PROXY protocol v2 signature")]
    BadSignature,
    #[error("unsupported version, command, family or transport")]
    Unsupported,
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

fn as_v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// Write the v2 header for a connection from `src` to `dst` (the address the client
/// reached) into `out`; returns its length. Both addresses of one family: IPv4 when both
/// are IPv4 (mapped addresses count as IPv4), else IPv6 with IPv4 ones mapped.
pub fn encode_v2(
    src: SocketAddr,
    dst: SocketAddr,
    transport: Transport,
    out: &mut [u8; MAX_V2_LEN],
) -> usize {
    let (src, dst) = (canonical(src), canonical(dst));
    out[..12].copy_from_slice(&SIGNATURE);
    // Version 2, command PROXY.
    out[12] = 0x21;
    let proto = match transport {
        Transport::Stream => 0x1,
        Transport::Datagram => 0x2,
    };
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            out[13] = 0x10 | proto;
            out[14..16].copy_from_slice(&12u16.to_be_bytes());
            out[16..20].copy_from_slice(&s.octets());
            out[20..24].copy_from_slice(&d.octets());
            out[24..26].copy_from_slice(&src.port().to_be_bytes());
            out[26..28].copy_from_slice(&dst.port().to_be_bytes());
            28
        }
        (s, d) => {
            out[13] = 0x20 | proto;
            out[14..16].copy_from_slice(&36u16.to_be_bytes());
            out[16..32].copy_from_slice(&as_v6(s).octets());
            out[32..48].copy_from_slice(&as_v6(d).octets());
            out[48..50].copy_from_slice(&src.port().to_be_bytes());
            out[50..52].copy_from_slice(&dst.port().to_be_bytes());
            52
        }
    }
}

/// Parse a v2 PROXY header at the start of `buf` (the services of the tests and the bench
/// use it; fulcrum itself only sends headers).
pub fn decode_v2(buf: &[u8]) -> Result<ProxyHeader, ProxyProtocolError> {
    if buf.len() < 16 {
        return if SIGNATURE.starts_with(&buf[..buf.len().min(12)]) {
            Err(ProxyProtocolError::Incomplete)
        } else {
            Err(ProxyProtocolError::BadSignature)
        };
    }
    if buf[..12] != SIGNATURE {
        return Err(ProxyProtocolError::BadSignature);
    }
    if buf[12] != 0x21 {
        return Err(ProxyProtocolError::Unsupported);
    }
    let transport = match buf[13] & 0x0f {
        0x1 => Transport::Stream,
        0x2 => Transport::Datagram,
        _ => return Err(ProxyProtocolError::Unsupported),
    };
    let body = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
    let len = 16 + body;
    let a = buf.get(16..len).ok_or(ProxyProtocolError::Incomplete)?;
    let port = |i: usize| u16::from_be_bytes([a[i], a[i + 1]]);
    let (src, dst) = match buf[13] >> 4 {
        0x1 if body >= 12 => {
            let s: [u8; 4] = [a[0], a[1], a[2], a[3]];
            let d: [u8; 4] = [a[4], a[5], a[6], a[7]];
            (
                SocketAddr::from((s, port(8))),
                SocketAddr::from((d, port(10))),
            )
        }
        0x2 if body >= 36 => {
            let mut s = [0u8; 16];
            let mut d = [0u8; 16];
            s.copy_from_slice(&a[..16]);
            d.copy_from_slice(&a[16..32]);
            (
                SocketAddr::from((s, port(32))),
                SocketAddr::from((d, port(34))),
            )
        }
        _ => return Err(ProxyProtocolError::Unsupported),
    };
    Ok(ProxyHeader {
        transport,
        src,
        dst,
        len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ipv4_stream_layout() {
        let mut out = [0u8; MAX_V2_LEN];
        let n = encode_v2(
            "10.1.2.3:4000".parse().unwrap(),
            "192.0.2.1:80".parse().unwrap(),
            Transport::Stream,
            &mut out,
        );
        assert_eq!(n, 28);
        assert_eq!(
            &out[12..28],
            &[
                0x21, 0x11, 0, 12, 10, 1, 2, 3, 192, 0, 2, 1, 0x0f, 0xa0, 0, 80
            ]
        );
    }

    #[test]
    fn mixed_families_use_ipv6() {
        let mut out = [0u8; MAX_V2_LEN];
        let src: SocketAddr = "[2001:db8::1]:5".parse().unwrap();
        let dst: SocketAddr = "[::ffff:10.0.0.1]:6".parse().unwrap();
        let n = encode_v2(src, dst, Transport::Datagram, &mut out);
        assert_eq!(n, 52);
        let h = decode_v2(&out[..n]).unwrap();
        assert_eq!(h.transport, Transport::Datagram);
        assert_eq!(h.src, src);
        assert_eq!(h.dst, dst);
    }

    #[test]
    fn decode_rejects_garbage_without_panicking() {
        assert_eq!(
            decode_v2(b"GET / HTTP/1.1\r\n"),
            Err(ProxyProtocolError::BadSignature)
        );
        assert_eq!(
            decode_v2(&SIGNATURE[..5]),
            Err(ProxyProtocolError::Incomplete)
        );
        let mut h = SIGNATURE.to_vec();
        h.extend_from_slice(&[0x21, 0x11, 0, 12, 1, 2]);
        assert_eq!(decode_v2(&h), Err(ProxyProtocolError::Incomplete));
    }

    proptest! {
        #[test]
        fn roundtrip(s in any::<SocketAddr>(), d in any::<SocketAddr>(), dgram in any::<bool>()) {
            let t = if dgram { Transport::Datagram } else { Transport::Stream };
            let mut out = [0u8; MAX_V2_LEN];
            let n = encode_v2(s, d, t, &mut out);
            let h = decode_v2(&out[..n]).unwrap();
            prop_assert_eq!(h.len, n);
            prop_assert_eq!(h.transport, t);
            let c = |a: SocketAddr| (a.ip().to_canonical(), a.port());
            prop_assert_eq!(c(h.src), c(s));
            prop_assert_eq!(c(h.dst), c(d));
        }

        #[test]
        fn decode_never_panics(b in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = decode_v2(&b);
        }
    }
}
