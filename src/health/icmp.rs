//! The `icmp` monitor: one ICMP echo (RFC 792) or ICMPv6 echo (RFC 4443 §4.1) to the
//! service's address, alive when its echo reply comes back within the timeout. IO in
//! [`ping`] around the PURE [`echo_request`] and [`is_our_reply`].
//!
//! The socket is the unprivileged ICMP datagram socket (`socket(AF_INET, SOCK_DGRAM,
//! IPPROTO_ICMP)`, Linux "ping sockets"), open to the groups in
//! `net.ipv4.ping_group_range` (which also governs ICMPv6); the kernel sets the identifier
//! to the socket's own and delivers it only the replies that carry it. Where the group is
//! outside the range, a raw socket is used when the process may open one
//! (`CAP_NET_RAW`); it sees every echo reply the host receives, so a reply is ours only
//! when its identifier, sequence number and payload (a per-probe nonce) all match.
//! docs/firewall.md, "Monitoring the firewalls".

use super::probe::{ProbeError, ProbeReply};
use socket2::{Domain, Protocol as SockProtocol, Socket, Type};
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

/// ICMP echo request and reply types (RFC 792; RFC 4443 §4.1, §4.2).
const ECHO_REQUEST_V4: u8 = 8;
const ECHO_REPLY_V4: u8 = 0;
const ECHO_REQUEST_V6: u8 = 128;
const ECHO_REPLY_V6: u8 = 129;

/// The bytes after the 8-byte echo header: a tag and the probe's nonce.
const TAG: &[u8; 8] = b"fulcrum ";
pub const PAYLOAD_LEN: usize = TAG.len() + 8;

/// Largest datagram read: a reply to our probe is 8 + 16 bytes (plus a 60-byte IPv4 header
/// on a raw socket); anything longer is not ours.
const MAX_READ: usize = 256;

/// One probe's identity: what the request carries and the reply must echo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Echo {
    pub v6: bool,
    pub id: u16,
    pub seq: u16,
    pub nonce: u64,
}

impl Echo {
    fn payload(&self) -> [u8; PAYLOAD_LEN] {
        let mut p = [0u8; PAYLOAD_LEN];
        p[..TAG.len()].copy_from_slice(TAG);
        p[TAG.len()..].copy_from_slice(&self.nonce.to_be_bytes());
        p
    }
}

/// The echo request of `echo`: type, code 0, checksum, identifier, sequence number, payload.
/// The ICMPv4 checksum is filled in (RFC 792: the ones' complement of the ones' complement
/// sum of the message); an ICMPv6 checksum covers a pseudo-header the kernel computes and
/// fills in on every ICMPv6 socket (RFC 3542 §3.1), so it is left zero.
pub fn echo_request(echo: &Echo) -> Vec<u8> {
    let kind = if echo.v6 {
        ECHO_REQUEST_V6
    } else {
        ECHO_REQUEST_V4
    };
    let mut m = Vec::with_capacity(8 + PAYLOAD_LEN);
    m.extend_from_slice(&[kind, 0, 0, 0]);
    m.extend_from_slice(&echo.id.to_be_bytes());
    m.extend_from_slice(&echo.seq.to_be_bytes());
    m.extend_from_slice(&echo.payload());
    if !echo.v6 {
        let sum = checksum(&m);
        m[2..4].copy_from_slice(&sum.to_be_bytes());
    }
    m
}

/// RFC 1071 Internet checksum.
pub fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// How the socket a datagram came from frames it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// A ping socket: the ICMP message alone; the kernel has set the identifier to the
    /// socket's, so the identifier is not compared.
    Datagram,
    /// A raw IPv4 socket: the IPv4 header first (its length in the header's IHL).
    RawV4,
    /// A raw ICMPv6 socket: the ICMPv6 message alone (RFC 3542 §3).
    RawV6,
}

/// Whether `datagram` is the echo reply to `echo`. Anything else (another host's reply,
/// another probe's, an echo request looped back, an error message, a truncated datagram)
/// is not, and is never a reason to fail.
pub fn is_our_reply(datagram: &[u8], echo: &Echo, framing: Framing) -> bool {
    let icmp = match framing {
        Framing::RawV4 => {
            let Some(&first) = datagram.first() else {
                return false;
            };
            let ihl = usize::from(first & 0x0f) * 4;
            if first >> 4 != 4 || ihl < 20 {
                return false;
            }
            match datagram.get(ihl..) {
                Some(rest) => rest,
                None => return false,
            }
        }
        Framing::Datagram | Framing::RawV6 => datagram,
    };
    let reply = if echo.v6 {
        ECHO_REPLY_V6
    } else {
        ECHO_REPLY_V4
    };
    let (Some(head), Some(payload)) = (icmp.get(..8), icmp.get(8..)) else {
        return false;
    };
    let id_ok = framing == Framing::Datagram || head[4..6] == echo.id.to_be_bytes();
    head[0] == reply
        && head[1] == 0
        && id_ok
        && head[6..8] == echo.seq.to_be_bytes()
        && payload == echo.payload()
}

/// Open a socket for echoes toward `ip`: a ping socket, else a raw one; the error says what
/// the host lacks for either.
fn open(ip: IpAddr) -> Result<(Socket, Framing), ProbeError> {
    let (domain, proto) = match ip {
        IpAddr::V4(_) => (Domain::IPV4, SockProtocol::ICMPV4),
        IpAddr::V6(_) => (Domain::IPV6, SockProtocol::ICMPV6),
    };
    let dgram = match Socket::new(domain, Type::DGRAM, Some(proto)) {
        Ok(s) => return Ok((s, Framing::Datagram)),
        Err(e) => e,
    };
    match Socket::new(domain, Type::RAW, Some(proto)) {
        Ok(s) => Ok((
            s,
            if ip.is_ipv4() {
                Framing::RawV4
            } else {
                Framing::RawV6
            },
        )),
        Err(raw) => Err(ProbeError::NoIcmpSocket(format!(
            "no ICMP datagram socket ({dgram}: the process's group must be within the sysctl net.ipv4.ping_group_range) and no raw socket ({raw}: needs CAP_NET_RAW)"
        ))),
    }
}

/// Send one echo request to `ip` and wait for its reply (the caller bounds the wait).
/// `seq` and `nonce` tell this probe from every other; on a raw socket the identifier is
/// taken from the nonce too.
pub async fn ping(ip: IpAddr, seq: u16, nonce: u64) -> Result<ProbeReply, ProbeError> {
    let (socket, framing) = open(ip)?;
    socket.set_nonblocking(true)?;
    let socket = tokio::net::UdpSocket::from_std(std::net::UdpSocket::from(socket))?;
    let echo = Echo {
        v6: ip.is_ipv6(),
        id: (nonce >> 48) as u16,
        seq,
        nonce,
    };
    let start = Instant::now();
    socket
        .send_to(&echo_request(&echo), SocketAddr::new(ip, 0))
        .await?;
    let mut buf = [0u8; MAX_READ];
    loop {
        let (n, from) = socket.recv_from(&mut buf).await?;
        if from.ip() == ip
            && buf
                .get(..n)
                .is_some_and(|d| is_our_reply(d, &echo, framing))
        {
            return Ok(ProbeReply {
                rtt_us: u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
                status: None,
                load: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reply_to(echo: &Echo) -> Vec<u8> {
        let mut m = echo_request(echo);
        m[0] = if echo.v6 {
            ECHO_REPLY_V6
        } else {
            ECHO_REPLY_V4
        };
        m
    }

    /// RFC 1071 §3 example: the sum of 0001 f203 f4f5 f6f7 is ddf2, the checksum its
    /// complement; a message with its checksum in place sums to zero.
    #[test]
    fn checksum_matches_rfc_1071() {
        assert_eq!(
            checksum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            !0xddf2
        );
        let m = echo_request(&Echo {
            v6: false,
            id: 0x1234,
            seq: 7,
            nonce: 99,
        });
        assert_eq!(checksum(&m), 0);
        assert_eq!(&m[..2], &[8, 0]);
        assert_eq!(&m[4..8], &[0x12, 0x34, 0, 7]);
    }

    #[test]
    fn a_reply_is_matched_by_sequence_and_nonce_and_on_raw_sockets_the_identifier() {
        let echo = Echo {
            v6: false,
            id: 0xabcd,
            seq: 3,
            nonce: 0x0102_0304_0506_0708,
        };
        let r = reply_to(&echo);
        assert!(is_our_reply(&r, &echo, Framing::Datagram));
        // The kernel rewrote the identifier on a ping socket: still ours there only.
        let mut other_id = r.clone();
        other_id[4] ^= 1;
        assert!(is_our_reply(&other_id, &echo, Framing::Datagram));
        assert!(!is_our_reply(&other_id, &echo, Framing::RawV6));
        // Behind a 20- or 24-byte IPv4 header on a raw socket.
        for ihl in [5u8, 6] {
            let mut ip = vec![0u8; usize::from(ihl) * 4];
            ip[0] = 0x40 | ihl;
            ip.extend_from_slice(&r);
            assert!(is_our_reply(&ip, &echo, Framing::RawV4), "{ihl}");
        }
        // The request looped back, another sequence, another nonce, a truncation: not ours.
        assert!(!is_our_reply(
            &echo_request(&echo),
            &echo,
            Framing::Datagram
        ));
        let mut seq = r.clone();
        seq[7] ^= 1;
        assert!(!is_our_reply(&seq, &echo, Framing::Datagram));
        let mut nonce = r.clone();
        nonce[23] ^= 1;
        assert!(!is_our_reply(&nonce, &echo, Framing::Datagram));
        assert!(!is_our_reply(&r[..20], &echo, Framing::Datagram));
        assert!(!is_our_reply(&[], &echo, Framing::RawV4));
        assert!(!is_our_reply(&[0x4f], &echo, Framing::RawV4));
        // ICMPv6 types.
        let e6 = Echo { v6: true, ..echo };
        assert_eq!(echo_request(&e6)[0], 128);
        assert!(is_our_reply(&reply_to(&e6), &e6, Framing::RawV6));
        assert!(!is_our_reply(&r, &e6, Framing::RawV6));
    }

    proptest! {
        /// No datagram panics the matcher, and only the exact reply matches.
        #[test]
        fn any_datagram_is_judged_without_panic(
            data in proptest::collection::vec(any::<u8>(), 0..120),
            v6: bool, id: u16, seq: u16, nonce: u64,
        ) {
            let echo = Echo { v6, id, seq, nonce };
            for f in [Framing::Datagram, Framing::RawV4, Framing::RawV6] {
                let _ = is_our_reply(&data, &echo, f);
            }
            prop_assert!(is_our_reply(&reply_to(&echo), &echo, Framing::Datagram));
            prop_assert_eq!(checksum(&echo_request(&Echo { v6: false, ..echo })), 0);
        }
    }
}
