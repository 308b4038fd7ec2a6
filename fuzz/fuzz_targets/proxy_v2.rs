//! PROXY protocol v2: any two addresses encode and decode back to themselves (IPv4-mapped
//! addresses come back as IPv4 when both are IPv4), and the decoder takes any bytes without
//! panicking.
#![no_main]

use fulcrum::proxy::proxy_protocol::{MAX_V2_LEN, Transport, decode_v2, encode_v2};
use libfuzzer_sys::fuzz_target;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

fn addr(b: &[u8], v4: bool) -> SocketAddr {
    let port = u16::from_be_bytes([b[16], b[17]]);
    if v4 {
        SocketAddr::from(([b[0], b[1], b[2], b[3]], port))
    } else {
        let mut o = [0u8; 16];
        o.copy_from_slice(&b[..16]);
        SocketAddr::new(IpAddr::V6(Ipv6Addr::from(o)), port)
    }
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

fuzz_target!(|data: &[u8]| {
    let _ = decode_v2(data);
    if data.len() < 37 {
        return;
    }
    let flags = data[0];
    let src = addr(&data[1..19], flags & 1 == 1);
    let dst = addr(&data[19..37], flags & 2 == 2);
    let transport = if flags & 4 == 4 {
        Transport::Stream
    } else {
        Transport::Datagram
    };
    let mut out = [0u8; MAX_V2_LEN];
    let n = encode_v2(src, dst, transport, &mut out);
    let h = decode_v2(&out[..n]).expect("an encoded header decodes");
    assert_eq!((h.len, h.transport), (n, transport));
    // Both IPv4 (mapped ones count): IPv4 back; else IPv6, IPv4 ones mapped.
    let both_v4 = canonical(src).is_ipv4() && canonical(dst).is_ipv4();
    let want = |a: SocketAddr| {
        if both_v4 {
            canonical(a)
        } else {
            let v6 = match a.ip() {
                IpAddr::V4(v) => v.to_ipv6_mapped(),
                IpAddr::V6(v) => v,
            };
            SocketAddr::new(IpAddr::V6(v6), a.port())
        }
    };
    assert_eq!((h.src, h.dst), (want(src), want(dst)));
});
