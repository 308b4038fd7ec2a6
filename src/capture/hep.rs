//! HEP version 3 (the Homer Encapsulation Protocol) packets: one SIP message, its leg's
//! addresses and the time it crossed, as the collectors Homer (heplify-server), sngrep and
//! Kamailio's sipcapture read them. PURE: bytes and values in, bytes out.
//!
//! Layout (HEP3, as Kamailio's `sipcapture` module `hep.h` and heplify's decoder read it):
//! a 6-byte header, the ASCII `HEP3` and the total length of the packet (header included)
//! as a big-endian u16, then chunks. Every chunk is a 6-byte header (vendor id u16, type id
//! u16, length u16 counting the header) and its value; every number is big-endian.
//!
//! | type | value                           | length |
//! |------|---------------------------------|--------|
//! | 1    | IP family (2 AF_INET, 10 AF_INET6) | 7   |
//! | 2    | IP protocol (17 UDP, 6 TCP)     | 7      |
//! | 3, 4 | IPv4 source, destination        | 10     |
//! | 5, 6 | IPv6 source, destination        | 22     |
//! | 7, 8 | source, destination port        | 8      |
//! | 9    | timestamp, seconds              | 10     |
//! | 10   | timestamp, microseconds         | 10     |
//! | 11   | protocol type (1 SIP)           | 7      |
//! | 12   | capture agent id (u32)          | 10     |
//! | 14   | authentication key              | 6 + n  |
//! | 15   | payload                         | 6 + n  |
//! | 17   | correlation id (the Call-ID)    | 6 + n  |

use std::net::{IpAddr, SocketAddr};

/// The protocol version tag that opens every packet.
pub const MAGIC: &[u8; 4] = b"HEP3";
/// The generic vendor: every chunk fulcrum writes is one of the specification's own.
pub const VENDOR_GENERIC: u16 = 0;
/// Protocol type of a SIP payload (chunk 11).
pub const PROTO_TYPE_SIP: u8 = 1;
/// The largest packet the 16-bit total length can say.
pub const MAX_PACKET: usize = u16::MAX as usize;

/// Chunk type ids (HEP3, generic vendor).
pub mod chunk {
    pub const IP_FAMILY: u16 = 1;
    pub const IP_PROTO: u16 = 2;
    pub const IPV4_SRC: u16 = 3;
    pub const IPV4_DST: u16 = 4;
    pub const IPV6_SRC: u16 = 5;
    pub const IPV6_DST: u16 = 6;
    pub const SRC_PORT: u16 = 7;
    pub const DST_PORT: u16 = 8;
    pub const TIME_SEC: u16 = 9;
    pub const TIME_USEC: u16 = 10;
    pub const PROTO_TYPE: u16 = 11;
    pub const AGENT_ID: u16 = 12;
    pub const AUTH_KEY: u16 = 14;
    pub const PAYLOAD: u16 = 15;
    pub const CORRELATION_ID: u16 = 17;
}

/// The transport a message travelled on, as HEP's IP protocol chunk says it: TLS and
/// WebSocket legs are TCP on the wire (their payload is the SIP inside).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

impl Transport {
    /// The IP protocol number (IANA): 17 UDP, 6 TCP.
    pub fn ip_proto(self) -> u8 {
        match self {
            Transport::Udp => 17,
            Transport::Tcp => 6,
        }
    }
}

/// One captured message's leg and time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leg {
    pub transport: Transport,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    /// Seconds since the Unix epoch and the microseconds within that second.
    pub time_s: u32,
    pub time_us: u32,
}

/// Why a message got no packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// The packet would pass the 16-bit total length.
    #[error("message too large for one HEP packet ({0} bytes)")]
    TooBig(usize),
}

/// The packet's length for these parts, header included.
pub fn packet_len(
    leg: &Leg,
    auth_key: Option<&[u8]>,
    call_id: Option<&[u8]>,
    payload: &[u8],
) -> usize {
    let (a, b) = (leg.src.ip(), leg.dst.ip());
    let v6 = matches!((a, b), (IpAddr::V6(_), _) | (_, IpAddr::V6(_)));
    let addr = if v6 { 2 * 22 } else { 2 * 10 };
    6 + 7
        + 7
        + addr
        + 8
        + 8
        + 10
        + 10
        + 7
        + 10
        + auth_key.map_or(0, |k| 6 + k.len())
        + 6
        + payload.len()
        + call_id.map_or(0, |c| 6 + c.len())
}

/// The HEP3 packet of `payload` on `leg`, in `out` (cleared first). Both addresses are
/// written in one family: a v4 address beside a v6 one is written v4-mapped.
pub fn encode(
    leg: &Leg,
    agent_id: u32,
    auth_key: Option<&[u8]>,
    call_id: Option<&[u8]>,
    payload: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    out.clear();
    append(leg, agent_id, auth_key, call_id, payload, out)
}

/// [`encode`], appended to what `out` holds: packets back to back, as a stream carries them
/// and as the capture queue holds them (each one's length is in its bytes 4..6).
pub fn append(
    leg: &Leg,
    agent_id: u32,
    auth_key: Option<&[u8]>,
    call_id: Option<&[u8]>,
    payload: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    let len = packet_len(leg, auth_key, call_id, payload);
    if len > MAX_PACKET {
        return Err(EncodeError::TooBig(len));
    }
    let start = out.len();
    out.reserve(len);
    // The fixed chunks written on the stack and copied at once (this runs on the data path
    // for every captured message): at most 6 + 2 * 7 + 2 * 22 + 2 * 8 + 2 * 10 + 7 + 10 bytes.
    let mut head = Head::default();
    head.raw(MAGIC);
    head.raw(&(len as u16).to_be_bytes());
    let (src, dst) = (leg.src.ip(), leg.dst.ip());
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            head.put(chunk::IP_FAMILY, &[2]);
            head.put(chunk::IP_PROTO, &[leg.transport.ip_proto()]);
            head.put(chunk::IPV4_SRC, &s.octets());
            head.put(chunk::IPV4_DST, &d.octets());
        }
        _ => {
            let v6 = |ip: IpAddr| match ip {
                IpAddr::V4(a) => a.to_ipv6_mapped(),
                IpAddr::V6(a) => a,
            };
            head.put(chunk::IP_FAMILY, &[10]);
            head.put(chunk::IP_PROTO, &[leg.transport.ip_proto()]);
            head.put(chunk::IPV6_SRC, &v6(src).octets());
            head.put(chunk::IPV6_DST, &v6(dst).octets());
        }
    }
    head.put(chunk::SRC_PORT, &leg.src.port().to_be_bytes());
    head.put(chunk::DST_PORT, &leg.dst.port().to_be_bytes());
    head.put(chunk::TIME_SEC, &leg.time_s.to_be_bytes());
    head.put(chunk::TIME_USEC, &leg.time_us.to_be_bytes());
    head.put(chunk::PROTO_TYPE, &[PROTO_TYPE_SIP]);
    head.put(chunk::AGENT_ID, &agent_id.to_be_bytes());
    out.extend_from_slice(head.written());
    if let Some(k) = auth_key {
        put(out, chunk::AUTH_KEY, k);
    }
    put(out, chunk::PAYLOAD, payload);
    if let Some(c) = call_id {
        put(out, chunk::CORRELATION_ID, c);
    }
    debug_assert_eq!(out.len() - start, len);
    Ok(())
}

/// The fixed-size start of a packet, written on the stack.
struct Head {
    buf: [u8; 128],
    at: usize,
}

impl Default for Head {
    fn default() -> Head {
        Head {
            buf: [0; 128],
            at: 0,
        }
    }
}

impl Head {
    fn raw(&mut self, b: &[u8]) {
        self.buf[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
    }

    /// One chunk, as [`put`] writes it.
    fn put(&mut self, type_id: u16, value: &[u8]) {
        let [v0, v1] = VENDOR_GENERIC.to_be_bytes();
        let [t0, t1] = type_id.to_be_bytes();
        let [l0, l1] = ((6 + value.len()) as u16).to_be_bytes();
        self.raw(&[v0, v1, t0, t1, l0, l1]);
        self.raw(value);
    }

    fn written(&self) -> &[u8] {
        &self.buf[..self.at]
    }
}

/// The vendor id of the padding chunk ([`append_padded`]): not the generic vendor (0), so
/// Kamailio's `sipcapture` skips it whatever its type; heplify-server skips every type it
/// does not know, and sngrep reads nothing after the payload chunk.
pub const VENDOR_PAD: u16 = 0xffff;
/// The type id of the padding chunk: none of the specification's.
pub const PAD_TYPE: u16 = 0xffff;
/// The smallest padding chunk: its header alone.
pub const PAD_MIN: usize = 6;

/// `packet` (one [`append`] wrote) grown to `size` bytes, into `out`: its total length
/// says `size` and a padding chunk (vendor [`VENDOR_PAD`], type [`PAD_TYPE`], zeros) follows
/// its payload chunk. Not at the end: Kamailio's `sipcapture` reads the correlation id, the
/// chunk after the payload, up to the end of the packet. `size` is the packet's length or at
/// least [`PAD_MIN`] more, and at most [`MAX_PACKET`]; anything else appends `packet`
/// unchanged.
pub fn append_padded(packet: &[u8], size: usize, out: &mut Vec<u8>) {
    let pad = size.wrapping_sub(packet.len());
    if packet.len() < 6 || size > MAX_PACKET || !(PAD_MIN..=MAX_PACKET).contains(&pad) {
        out.extend_from_slice(packet);
        return;
    }
    let split = after_payload(packet);
    out.extend_from_slice(&packet[..4]);
    out.extend_from_slice(&(size as u16).to_be_bytes());
    out.extend_from_slice(&packet[6..split]);
    let [v0, v1] = VENDOR_PAD.to_be_bytes();
    let [t0, t1] = PAD_TYPE.to_be_bytes();
    let [l0, l1] = (pad as u16).to_be_bytes();
    out.extend_from_slice(&[v0, v1, t0, t1, l0, l1]);
    out.resize(out.len() + pad - PAD_MIN, 0);
    out.extend_from_slice(&packet[split..]);
}

/// Where the payload chunk of `packet` ends (its end when there is none).
fn after_payload(packet: &[u8]) -> usize {
    let mut at = 6;
    while let Some(h) = packet.get(at..at + 6) {
        let len = u16::from_be_bytes([h[4], h[5]]) as usize;
        if len < 6 {
            break;
        }
        at += len;
        if h[..4] == [0, 0, 0, chunk::PAYLOAD as u8] {
            return at.min(packet.len());
        }
    }
    packet.len()
}

/// Consecutive packets sent as one UDP GSO send (`UDP_SEGMENT`): the kernel cuts it into
/// datagrams of `size` bytes, so each packet is padded to `size` ([`append_padded`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    pub count: usize,
    pub size: usize,
}

/// The runs of consecutive packets of lengths `lens` to send as GSO groups, in order: each at
/// most `max_segments` packets and `max_bytes` once padded, its packets padded to at most
/// `max_size` (the largest datagram the path takes unfragmented), with at most half again the
/// bytes of its packets in padding. A run of one is sent as it is (`size` its length).
pub fn gso_groups(
    lens: &[usize],
    max_segments: usize,
    max_bytes: usize,
    max_size: usize,
) -> Vec<Group> {
    // The padded size of a run whose packets are `min..=max` bytes long: every packet but
    // the longest needs room for a padding chunk's header.
    let size = |min: usize, max: usize| if min == max { max } else { max + PAD_MIN };
    let mut groups = Vec::new();
    let mut i = 0;
    while i < lens.len() {
        let (mut min, mut max, mut sum) = (lens[i], lens[i], lens[i]);
        let mut count = 1;
        while let Some(&l) = lens.get(i + count) {
            let (mn, mx, sm) = (min.min(l), max.max(l), sum + l);
            let s = size(mn, mx);
            if count + 1 > max_segments
                || s * (count + 1) > max_bytes
                || s > max_size.min(MAX_PACKET)
            {
                break;
            }
            if 2 * s * (count + 1) > 3 * sm {
                break;
            }
            (min, max, sum) = (mn, mx, sm);
            count += 1;
        }
        groups.push(Group {
            count,
            size: size(min, max),
        });
        i += count;
    }
    groups
}

/// The packets [`append`] wrote back to back into `buf`, in order: each one's length is in
/// its bytes 4..6. Stops at bytes that do not hold a whole packet.
pub fn packets(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        let len = match rest {
            [_, _, _, _, hi, lo, ..] => u16::from_be_bytes([*hi, *lo]) as usize,
            _ => return None,
        };
        if len < 6 || len > rest.len() {
            return None;
        }
        let (packet, tail) = rest.split_at(len);
        rest = tail;
        Some(packet)
    })
}

/// One chunk: vendor, type, length counting the 6-byte header, value. The caller checked
/// that the whole packet fits in 16 bits, so every chunk does.
fn put(out: &mut Vec<u8>, type_id: u16, value: &[u8]) {
    let [v0, v1] = VENDOR_GENERIC.to_be_bytes();
    let [t0, t1] = type_id.to_be_bytes();
    let [l0, l1] = ((6 + value.len()) as u16).to_be_bytes();
    out.extend_from_slice(&[v0, v1, t0, t1, l0, l1]);
    out.extend_from_slice(value);
}

/// A packet read back chunk by chunk (for tests and tools: fulcrum itself only writes).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Decoded {
    pub family: Option<u8>,
    pub ip_proto: Option<u8>,
    pub src: Option<IpAddr>,
    pub dst: Option<IpAddr>,
    pub src_port: Option<u16>,
    pub dst_port: Option<u16>,
    pub time_s: Option<u32>,
    pub time_us: Option<u32>,
    pub proto_type: Option<u8>,
    pub agent_id: Option<u32>,
    pub auth_key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    pub correlation_id: Option<Vec<u8>>,
    /// Every chunk's (vendor, type, length) in order.
    pub chunks: Vec<(u16, u16, u16)>,
}

/// Why bytes are not a HEP3 packet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("not a HEP3 packet")]
    Magic,
    #[error("total length {said} disagrees with the {got} bytes")]
    Length { said: usize, got: usize },
    #[error("chunk at offset {0} is truncated or has a bad length")]
    Chunk(usize),
    #[error("chunk type {0} has a value of the wrong size")]
    Size(u16),
}

/// Read a packet, checking the total length and every chunk's length against the
/// specification's fixed sizes.
pub fn decode(b: &[u8]) -> Result<Decoded, DecodeError> {
    if b.len() < 6 || &b[..4] != MAGIC {
        return Err(DecodeError::Magic);
    }
    let said = u16::from_be_bytes([b[4], b[5]]) as usize;
    if said != b.len() {
        return Err(DecodeError::Length { said, got: b.len() });
    }
    let mut d = Decoded::default();
    let mut at = 6;
    while at < b.len() {
        let h = b.get(at..at + 6).ok_or(DecodeError::Chunk(at))?;
        let vendor = u16::from_be_bytes([h[0], h[1]]);
        let type_id = u16::from_be_bytes([h[2], h[3]]);
        let len = u16::from_be_bytes([h[4], h[5]]);
        let v = b
            .get(at + 6..at + len as usize)
            .filter(|_| len >= 6)
            .ok_or(DecodeError::Chunk(at))?;
        d.chunks.push((vendor, type_id, len));
        let fixed = |n: usize| {
            if v.len() == n {
                Ok(v)
            } else {
                Err(DecodeError::Size(type_id))
            }
        };
        let u32_of = |v: &[u8]| u32::from_be_bytes([v[0], v[1], v[2], v[3]]);
        match type_id {
            chunk::IP_FAMILY => d.family = Some(fixed(1)?[0]),
            chunk::IP_PROTO => d.ip_proto = Some(fixed(1)?[0]),
            chunk::IPV4_SRC | chunk::IPV4_DST => {
                let v = fixed(4)?;
                let ip = IpAddr::from([v[0], v[1], v[2], v[3]]);
                if type_id == chunk::IPV4_SRC {
                    d.src = Some(ip);
                } else {
                    d.dst = Some(ip);
                }
            }
            chunk::IPV6_SRC | chunk::IPV6_DST => {
                let mut o = [0u8; 16];
                o.copy_from_slice(fixed(16)?);
                let ip = IpAddr::from(o);
                if type_id == chunk::IPV6_SRC {
                    d.src = Some(ip);
                } else {
                    d.dst = Some(ip);
                }
            }
            chunk::SRC_PORT => {
                d.src_port = Some(u16::from_be_bytes(
                    fixed(2)?
                        .try_into()
                        .map_err(|_| DecodeError::Size(type_id))?,
                ))
            }
            chunk::DST_PORT => {
                d.dst_port = Some(u16::from_be_bytes(
                    fixed(2)?
                        .try_into()
                        .map_err(|_| DecodeError::Size(type_id))?,
                ))
            }
            chunk::TIME_SEC => d.time_s = Some(u32_of(fixed(4)?)),
            chunk::TIME_USEC => d.time_us = Some(u32_of(fixed(4)?)),
            chunk::PROTO_TYPE => d.proto_type = Some(fixed(1)?[0]),
            chunk::AGENT_ID => d.agent_id = Some(u32_of(fixed(4)?)),
            chunk::AUTH_KEY => d.auth_key = Some(v.to_vec()),
            chunk::PAYLOAD => d.payload = Some(v.to_vec()),
            chunk::CORRELATION_ID => d.correlation_id = Some(v.to_vec()),
            _ => {}
        }
        at += len as usize;
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn leg(src: &str, dst: &str, transport: Transport) -> Leg {
        Leg {
            transport,
            src: src.parse().expect("src"),
            dst: dst.parse().expect("dst"),
            time_s: 1_764_900_000,
            time_us: 123_456,
        }
    }

    const INVITE: &[u8] = b"INVITE sip:bob@example.com SIP/2.0\r\nCall-ID: c1@h\r\n\r\n";

    /// Read the bytes by hand against the layout in the module doc, offset by offset.
    #[test]
    fn an_ipv4_udp_packet_has_the_specified_layout() {
        let mut out = Vec::new();
        let l = leg("192.0.2.1:5060", "198.51.100.2:5070", Transport::Udp);
        encode(&l, 2001, Some(b"secret"), Some(b"c1@h"), INVITE, &mut out).expect("fits");
        assert_eq!(&out[..4], b"HEP3");
        assert_eq!(u16::from_be_bytes([out[4], out[5]]) as usize, out.len());
        let mut at = 6;
        let mut next = |type_id: u16, value: &[u8]| {
            let h = &out[at..at + 6];
            assert_eq!(&h[..2], &[0, 0], "vendor 0 for chunk {type_id}");
            assert_eq!(u16::from_be_bytes([h[2], h[3]]), type_id);
            assert_eq!(
                u16::from_be_bytes([h[4], h[5]]) as usize,
                6 + value.len(),
                "length of chunk {type_id}"
            );
            assert_eq!(
                &out[at + 6..at + 6 + value.len()],
                value,
                "value of chunk {type_id}"
            );
            at += 6 + value.len();
        };
        next(1, &[2]);
        next(2, &[17]);
        next(3, &[192, 0, 2, 1]);
        next(4, &[198, 51, 100, 2]);
        next(7, &5060u16.to_be_bytes());
        next(8, &5070u16.to_be_bytes());
        next(9, &1_764_900_000u32.to_be_bytes());
        next(10, &123_456u32.to_be_bytes());
        next(11, &[1]);
        next(12, &2001u32.to_be_bytes());
        next(14, b"secret");
        next(15, INVITE);
        next(17, b"c1@h");
        assert_eq!(at, out.len());
    }

    #[test]
    fn an_ipv6_tcp_packet_uses_chunks_5_and_6_and_protocol_6() {
        let mut out = Vec::new();
        let l = leg("[2001:db8::1]:5061", "[2001:db8::2]:40000", Transport::Tcp);
        encode(&l, 7, None, None, INVITE, &mut out).expect("fits");
        let d = decode(&out).expect("decodes");
        assert_eq!((d.family, d.ip_proto), (Some(10), Some(6)));
        let lens: Vec<(u16, u16)> = d.chunks.iter().map(|c| (c.1, c.2)).collect();
        assert_eq!(
            lens,
            [
                (1, 7),
                (2, 7),
                (5, 22),
                (6, 22),
                (7, 8),
                (8, 8),
                (9, 10),
                (10, 10),
                (11, 7),
                (12, 10),
                (15, 6 + INVITE.len() as u16)
            ]
        );
        assert_eq!(d.src, Some("2001:db8::1".parse().expect("ip")));
        assert_eq!(d.auth_key, None);
        assert_eq!(d.correlation_id, None);
    }

    #[test]
    fn a_mixed_family_leg_is_written_v4_mapped() {
        let mut out = Vec::new();
        let l = leg("192.0.2.1:5060", "[2001:db8::2]:5060", Transport::Udp);
        encode(&l, 1, None, None, b"x", &mut out).expect("fits");
        let d = decode(&out).expect("decodes");
        assert_eq!(d.src, Some("::ffff:192.0.2.1".parse().expect("ip")));
    }

    #[test]
    fn a_message_past_the_16_bit_length_is_refused() {
        let mut out = Vec::new();
        let l = leg("192.0.2.1:5060", "192.0.2.2:5060", Transport::Udp);
        let overhead = packet_len(&l, None, None, b"");
        let fits = vec![b'a'; MAX_PACKET - overhead];
        encode(&l, 1, None, None, &fits, &mut out).expect("exactly fits");
        assert_eq!(out.len(), MAX_PACKET);
        let big = vec![b'a'; MAX_PACKET - overhead + 1];
        assert_eq!(
            encode(&l, 1, None, None, &big, &mut out),
            Err(EncodeError::TooBig(MAX_PACKET + 1))
        );
    }

    /// Packets appended back to back come apart again whole and in order; bytes that do not
    /// hold a whole packet (a cut tail, a length under the header's) end the walk.
    #[test]
    fn appended_packets_split_back_in_order() {
        let l = leg("10.0.0.1:5060", "[2001:db8::2]:5070", Transport::Tcp);
        let mut buf = Vec::new();
        append(&l, 1, None, Some(b"a@b"), INVITE, &mut buf).expect("fits");
        append(&l, 2, Some(b"k"), None, b"SIP/2.0 200 OK\r\n\r\n", &mut buf).expect("fits");
        let whole = buf.len();
        let mut one = Vec::new();
        encode(&l, 1, None, Some(b"a@b"), INVITE, &mut one).expect("fits");
        let split: Vec<&[u8]> = packets(&buf).collect();
        assert_eq!(split.len(), 2);
        assert_eq!(split[0], &one[..]);
        assert_eq!(decode(split[1]).expect("decodes").agent_id, Some(2));
        buf.extend_from_slice(&one[..one.len() - 1]);
        assert_eq!(packets(&buf).count(), 2, "a cut packet is not one");
        buf.truncate(whole);
        buf.extend_from_slice(b"HEP3\x00\x03");
        assert_eq!(packets(&buf).count(), 2, "a length under 6 ends the walk");
    }

    #[test]
    fn the_decoder_refuses_wrong_lengths() {
        let mut out = Vec::new();
        let l = leg("192.0.2.1:5060", "192.0.2.2:5060", Transport::Udp);
        encode(&l, 1, None, None, b"x", &mut out).expect("fits");
        let mut short = out.clone();
        short.pop();
        assert!(matches!(decode(&short), Err(DecodeError::Length { .. })));
        let mut bad = out.clone();
        bad[6 + 5] = 8; // the family chunk claims 8 bytes
        assert!(decode(&bad).is_err());
    }

    fn addr() -> impl Strategy<Value = SocketAddr> {
        prop_oneof![
            (any::<[u8; 4]>(), any::<u16>()).prop_map(|(ip, p)| SocketAddr::from((ip, p))),
            (any::<[u8; 16]>(), any::<u16>()).prop_map(|(ip, p)| SocketAddr::from((ip, p))),
        ]
    }

    proptest! {
        #[test]
        fn every_message_and_leg_round_trips(
            src in addr(),
            dst in addr(),
            udp in any::<bool>(),
            time_s in any::<u32>(),
            time_us in 0u32..1_000_000,
            agent in any::<u32>(),
            key in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)),
            cid in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..80)),
            payload in proptest::collection::vec(any::<u8>(), 0..3000),
        ) {
            let transport = if udp { Transport::Udp } else { Transport::Tcp };
            let l = Leg { transport, src, dst, time_s, time_us };
            let mut out = Vec::new();
            encode(&l, agent, key.as_deref(), cid.as_deref(), &payload, &mut out).expect("fits");
            let d = decode(&out).expect("decodes");
            let both_v4 = src.is_ipv4() && dst.is_ipv4();
            let as_written = |a: SocketAddr| match a.ip() {
                IpAddr::V4(v) if !both_v4 => IpAddr::V6(v.to_ipv6_mapped()),
                ip => ip,
            };
            prop_assert_eq!(d.family, Some(if both_v4 { 2 } else { 10 }));
            prop_assert_eq!(d.ip_proto, Some(transport.ip_proto()));
            prop_assert_eq!(d.src, Some(as_written(src)));
            prop_assert_eq!(d.dst, Some(as_written(dst)));
            prop_assert_eq!((d.src_port, d.dst_port), (Some(src.port()), Some(dst.port())));
            prop_assert_eq!((d.time_s, d.time_us), (Some(time_s), Some(time_us)));
            prop_assert_eq!(d.proto_type, Some(PROTO_TYPE_SIP));
            prop_assert_eq!(d.agent_id, Some(agent));
            prop_assert_eq!(d.auth_key, key);
            prop_assert_eq!(d.payload, Some(payload));
            prop_assert_eq!(d.correlation_id, cid);
            prop_assert!(d.chunks.iter().all(|c| c.0 == VENDOR_GENERIC));
        }
    }
    proptest! {
        /// Padded for a GSO send, a packet reads as it did, its padding chunk at the end;
        /// the groups take every packet once, in order, within their bounds.
        #[test]
        fn padded_groups_keep_every_packet_readable(
            payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..1500), 1..150),
        ) {
            let l = leg("192.0.2.1:5060", "198.51.100.2:5070", Transport::Udp);
            let packets: Vec<Vec<u8>> = payloads.iter().map(|p| {
                let mut out = Vec::new();
                encode(&l, 7, None, Some(b"c1@h"), p, &mut out).expect("fits");
                out
            }).collect();
            let lens: Vec<usize> = packets.iter().map(Vec::len).collect();
            let groups = gso_groups(&lens, 64, 65_000, 1_472);
            prop_assert_eq!(groups.iter().map(|g| g.count).sum::<usize>(), packets.len());
            let mut at = 0;
            for g in &groups {
                prop_assert!(g.count >= 1 && g.count <= 64 && g.size * g.count <= 65_000.max(g.size));
                prop_assert!(g.count == 1 || g.size <= 1_472);
                let run = &packets[at..at + g.count];
                let bytes: usize = run.iter().map(Vec::len).sum();
                prop_assert!(2 * g.size * g.count <= 3 * bytes);
                let mut out = Vec::new();
                for p in run {
                    append_padded(p, g.size, &mut out);
                }
                prop_assert_eq!(out.len(), g.size * g.count);
                for (seg, p) in out.chunks(g.size).zip(run) {
                    let want = decode(p).expect("decodes");
                    let got = decode(seg).expect("padded decodes");
                    prop_assert_eq!(&got.payload, &want.payload);
                    prop_assert_eq!(&got.correlation_id, &want.correlation_id);
                    let mut chunks = got.chunks.clone();
                    if seg.len() > p.len() {
                        // Right after the payload: the correlation id stays last.
                        let at = want.chunks.iter().position(|c| c.1 == chunk::PAYLOAD).expect("payload") + 1;
                        let (v, t, n) = chunks.remove(at);
                        prop_assert_eq!((v, t, n as usize), (VENDOR_PAD, PAD_TYPE, seg.len() - p.len()));
                        prop_assert_eq!(got.chunks.last().map(|c| c.1), Some(chunk::CORRELATION_ID));
                    }
                    prop_assert_eq!(chunks, want.chunks.clone());
                }
                at += g.count;
            }
        }
    }
}
