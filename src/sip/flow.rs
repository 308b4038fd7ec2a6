//! Flow tokens (`fc-flow`): the name of a client's flow that fulcrum writes into the Path of a
//! REGISTER it forwards (RFC 3327) and into the Record-Route of a dialog, so that a request a
//! service sends toward that client later reaches it through fulcrum over the flow the client
//! opened (its address and port on UDP, its live connection on a stream), whatever its Contact
//! says (behind NAT, or a connection no one can dial back). PURE: bytes and keys in, a flow or a
//! refusal out.
//!
//! A token is the flow's fields followed by a 64-bit SipHash-2-4 tag under a 128-bit key
//! (SipHash is a keyed pseudo-random function built for short inputs: a forged or altered token
//! is caught, and the key cannot be learned from tokens), hex-encoded:
//!
//! ```text
//! kind (1: transport, 0x80 for IPv6) | address (4 or 16) | port (2)
//!   | on streams: connection id (8) | the process start's nonce (8)
//!   | tag (8)
//! ```
//!
//! Connection ids restart with the process, so a stream token also names the start
//! ([`FlowKeys::nonce`]): a token from before a restart finds no connection rather than
//! another client's. Keys rotate: the first key signs, every key verifies
//! (docs/sip.md, "Path and flow tokens").

use crate::sip::Transport;
use siphasher::sip::SipHasher24;
use std::hash::Hasher;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The URI parameter that carries a token.
pub const FLOW_PARAM: &[u8] = b"fc-flow";

/// A flow key: 128 bits.
pub type FlowKey = [u8; 16];

const TAG_LEN: usize = 8;
const V6: u8 = 0x80;

/// The longest token's fields and tag, in bytes (before hex).
const MAX_RAW: usize = 1 + 16 + 2 + 16 + TAG_LEN;

/// A token as written in a URI: lowercase hex, on the stack.
#[derive(Clone, Copy)]
pub struct Token {
    hex: [u8; 2 * MAX_RAW],
    len: usize,
}

impl Token {
    pub fn as_bytes(&self) -> &[u8] {
        &self.hex[..self.len]
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&String::from_utf8_lossy(self.as_bytes()))
    }
}

/// The keys that sign and verify tokens, and this process start's nonce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowKeys {
    /// The first signs; all verify (the others are previous keys kept during a rotation).
    keys: Vec<FlowKey>,
    /// This process start's nonce, written into stream tokens.
    pub nonce: u64,
    /// The keys are this process's own random ones (no `flow_key_file`): tokens do not
    /// survive a restart and are not understood by another instance.
    pub ephemeral: bool,
}

/// A client's flow, as a token names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    pub transport: Transport,
    /// The client's address and port (its source, as fulcrum saw it).
    pub addr: SocketAddr,
    /// On streams, the client connection's id and the nonce of the start that made it.
    pub conn: Option<(u64, u64)>,
}

/// Why a token was not honoured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowError {
    /// Not a token fulcrum made: malformed, or its tag does not verify (403 Forbidden).
    Forged,
    /// A sound token whose flow cannot exist here any more: a stream token from another
    /// process start (430 Flow Failed, RFC 5626 §5.3). A connection that closed is the
    /// shell's to find.
    Gone,
}

fn kind_of(t: Transport) -> u8 {
    match t {
        Transport::Udp => 1,
        Transport::Tcp => 2,
        Transport::Tls => 3,
        Transport::Ws => 4,
        Transport::Wss => 5,
    }
}

fn transport_of(k: u8) -> Option<Transport> {
    match k {
        1 => Some(Transport::Udp),
        2 => Some(Transport::Tcp),
        3 => Some(Transport::Tls),
        4 => Some(Transport::Ws),
        5 => Some(Transport::Wss),
        _ => None,
    }
}

/// Parse a flow key as written in a key file: 32 hex digits.
pub fn parse_key(text: &str) -> Option<FlowKey> {
    let b = text.as_bytes();
    if b.len() != 32 {
        return None;
    }
    let mut key = [0u8; 16];
    for (i, k) in key.iter_mut().enumerate() {
        *k = (hex_val(b[2 * i])? << 4) | hex_val(b[2 * i + 1])?;
    }
    Some(key)
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

fn tag(key: &FlowKey, fields: &[u8]) -> [u8; TAG_LEN] {
    let mut h = SipHasher24::new_with_key(key);
    h.write(fields);
    h.finish().to_be_bytes()
}

/// Equal in time independent of where they differ.
fn same_tag(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl FlowKeys {
    /// Keys from a key file's lines (the first signs); `None` when there is none.
    pub fn new(keys: Vec<FlowKey>, nonce: u64, ephemeral: bool) -> Option<FlowKeys> {
        (!keys.is_empty()).then_some(FlowKeys {
            keys,
            nonce,
            ephemeral,
        })
    }

    /// A process's own random key: tokens that no other instance, and no later start,
    /// understands.
    pub fn own(key: FlowKey, nonce: u64) -> FlowKeys {
        FlowKeys {
            keys: vec![key],
            nonce,
            ephemeral: true,
        }
    }

    /// The token of the flow from `addr` over `transport` (on a stream, connection `conn` of
    /// this start).
    pub fn sign(&self, transport: Transport, addr: SocketAddr, conn: Option<u64>) -> Token {
        let mut fields = [0u8; MAX_RAW];
        let mut n = 0;
        let mut put = |b: &[u8]| {
            fields[n..n + b.len()].copy_from_slice(b);
            n += b.len();
        };
        let ip = addr.ip().to_canonical();
        let v6 = if ip.is_ipv6() { V6 } else { 0 };
        put(&[kind_of(transport) | v6]);
        match ip {
            IpAddr::V4(a) => put(&a.octets()),
            IpAddr::V6(a) => put(&a.octets()),
        }
        put(&addr.port().to_be_bytes());
        if let Some(id) = conn {
            put(&id.to_be_bytes());
            put(&self.nonce.to_be_bytes());
        }
        let t = tag(&self.keys[0], &fields[..n]);
        fields[n..n + TAG_LEN].copy_from_slice(&t);
        let n = n + TAG_LEN;
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut token = Token {
            hex: [0; 2 * MAX_RAW],
            len: 2 * n,
        };
        for (i, b) in fields[..n].iter().enumerate() {
            token.hex[2 * i] = HEX[usize::from(b >> 4)];
            token.hex[2 * i + 1] = HEX[usize::from(b & 15)];
        }
        token
    }

    /// The flow a token names, when one of the keys made it.
    pub fn verify(&self, token: &[u8]) -> Result<Flow, FlowError> {
        let mut raw = [0u8; MAX_RAW];
        if !token.len().is_multiple_of(2) || token.len() / 2 > raw.len() {
            return Err(FlowError::Forged);
        }
        let n = token.len() / 2;
        for (i, r) in raw[..n].iter_mut().enumerate() {
            let hi = hex_val(token[2 * i]).ok_or(FlowError::Forged)?;
            let lo = hex_val(token[2 * i + 1]).ok_or(FlowError::Forged)?;
            *r = (hi << 4) | lo;
        }
        let raw = &raw[..n];
        let kind = *raw.first().ok_or(FlowError::Forged)?;
        let transport = transport_of(kind & !V6).ok_or(FlowError::Forged)?;
        let ip_len = if kind & V6 != 0 { 16 } else { 4 };
        let stream = transport != Transport::Udp;
        let want = 1 + ip_len + 2 + if stream { 16 } else { 0 } + TAG_LEN;
        if n != want {
            return Err(FlowError::Forged);
        }
        let (fields, t) = raw.split_at(n - TAG_LEN);
        if !self.keys.iter().any(|k| same_tag(&tag(k, fields), t)) {
            return Err(FlowError::Forged);
        }
        let ip = if ip_len == 4 {
            let mut o = [0u8; 4];
            o.copy_from_slice(&fields[1..5]);
            IpAddr::V4(Ipv4Addr::from(o))
        } else {
            let mut o = [0u8; 16];
            o.copy_from_slice(&fields[1..17]);
            IpAddr::V6(Ipv6Addr::from(o))
        };
        let at = 1 + ip_len;
        let port = u16::from_be_bytes([fields[at], fields[at + 1]]);
        let conn = if stream {
            let mut id = [0u8; 8];
            let mut nonce = [0u8; 8];
            id.copy_from_slice(&fields[at + 2..at + 10]);
            nonce.copy_from_slice(&fields[at + 10..at + 18]);
            let nonce = u64::from_be_bytes(nonce);
            if nonce != self.nonce {
                return Err(FlowError::Gone);
            }
            Some((u64::from_be_bytes(id), nonce))
        } else {
            None
        };
        Ok(Flow {
            transport,
            addr: SocketAddr::new(ip, port),
            conn,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(k: &[FlowKey], nonce: u64) -> FlowKeys {
        FlowKeys::new(k.to_vec(), nonce, false).expect("keys")
    }

    const K1: FlowKey = [1; 16];
    const K2: FlowKey = [2; 16];

    fn token(k: &FlowKeys, t: Transport, addr: &str, conn: Option<u64>) -> Vec<u8> {
        k.sign(t, addr.parse().expect("addr"), conn)
            .as_bytes()
            .to_vec()
    }

    #[test]
    fn a_token_names_its_flow_and_nothing_else() {
        let k = keys(&[K1], 7);
        for (t, a, c) in [
            (Transport::Udp, "192.0.2.1:5060", None),
            (Transport::Udp, "[2001:db8::1]:40000", None),
            (Transport::Tcp, "192.0.2.1:50123", Some(42)),
            (Transport::Tls, "[2001:db8::2]:5061", Some(u64::MAX)),
        ] {
            let tok = token(&k, t, a, c);
            assert!(
                tok.iter()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            );
            let f = k.verify(&tok).expect("verifies");
            assert_eq!(f.transport, t);
            assert_eq!(f.addr, a.parse::<SocketAddr>().expect("addr"));
            assert_eq!(f.conn, c.map(|id| (id, 7)));
        }
        // An IPv4-mapped source is the IPv4 client it is.
        let f = k
            .verify(&token(&k, Transport::Udp, "[::ffff:192.0.2.9]:5060", None))
            .expect("verifies");
        assert_eq!(
            f.addr,
            "192.0.2.9:5060".parse::<SocketAddr>().expect("addr")
        );
    }

    #[test]
    fn any_change_to_a_token_is_forged() {
        let k = keys(&[K1], 7);
        let tok = token(&k, Transport::Tcp, "192.0.2.1:50123", Some(42));
        for i in 0..tok.len() {
            for c in [b'0', b'7', b'f'] {
                let mut t = tok.clone();
                if t[i] == c {
                    continue;
                }
                t[i] = c;
                assert_eq!(
                    k.verify(&t),
                    Err(FlowError::Forged),
                    "digit {i} -> {}",
                    c as char
                );
            }
        }
        for bad in [&b""[..], b"0", b"zz", &tok[..tok.len() - 2], b"01c0000201"] {
            assert_eq!(k.verify(bad), Err(FlowError::Forged));
        }
        let mut longer = tok.clone();
        longer.extend_from_slice(b"00");
        assert_eq!(k.verify(&longer), Err(FlowError::Forged));
        // Uppercase hex is the same bytes: accepted (URI parameters are compared as written,
        // but nothing is gained by refusing it).
        assert!(k.verify(&tok.to_ascii_uppercase()).is_ok());
    }

    #[test]
    fn another_key_forges_and_a_previous_key_still_verifies() {
        let old = keys(&[K1], 7);
        let tok = token(&old, Transport::Udp, "192.0.2.1:5060", None);
        assert_eq!(keys(&[K2], 7).verify(&tok), Err(FlowError::Forged));
        // Rotated: K2 signs, K1 still verifies.
        let rotated = keys(&[K2, K1], 7);
        assert!(rotated.verify(&tok).is_ok());
        let new = token(&rotated, Transport::Udp, "192.0.2.1:5060", None);
        assert_ne!(new, tok);
        assert_eq!(old.verify(&new), Err(FlowError::Forged));
    }

    #[test]
    fn a_stream_token_of_another_start_is_gone_and_a_udp_token_survives_it() {
        let before = keys(&[K1], 7);
        let after = keys(&[K1], 8);
        let tcp = token(&before, Transport::Tcp, "192.0.2.1:50123", Some(1));
        assert_eq!(after.verify(&tcp), Err(FlowError::Gone));
        let udp = token(&before, Transport::Udp, "192.0.2.1:5060", None);
        assert!(after.verify(&udp).is_ok());
    }

    #[test]
    fn keys_parse_from_32_hex_digits() {
        assert_eq!(parse_key("01010101010101010101010101010101"), Some(K1));
        assert_eq!(parse_key("0101"), None);
        assert_eq!(parse_key("0101010101010101010101010101010g"), None);
        assert!(FlowKeys::new(Vec::new(), 0, true).is_none());
    }
}
