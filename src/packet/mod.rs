//! The decisions of a packet-forwarding vserver (a pool of firewalls), as the kernel program
//! in `crate::bpf` makes them: parse an Ethernet frame, say whether it passes to the host's
//! stack or which bucket its flow falls in, and build the bucket table from a selector. PURE:
//! this is the Rust twin the property tests compare the loaded program against, packet by
//! packet (`tests/packet_bpf.rs`).
//!
//! # Pass to the stack
//! In this order, the first that holds (each counted under its [`PassReason`]):
//! 1. not IPv4 or IPv6 by its EtherType (ARP, LLDP, a VLAN tag), or shorter than an
//!    Ethernet header: [`PassReason::NonIp`];
//! 2. an Ethernet group address (broadcast, IPv4 and IPv6 multicast MACs): `Multicast`;
//! 3. an IP header that is short or of the wrong version: `Malformed`;
//! 4. an IP multicast destination (224.0.0.0/4, ff00::/8, which takes VRRP, RFC 5798 §5.1.1.2,
//!    and Neighbor Discovery's solicited-node groups, RFC 4861 §7.2.2) or 255.255.255.255:
//!    `Multicast`;
//! 5. a link-local source or destination (169.254.0.0/16, RFC 3927; fe80::/10, RFC 4291
//!    §2.5.6): `LinkLocal` (a router never forwards them);
//! 6. a destination that is one of this host's addresses (the `local` set the control plane
//!    keeps; IPv4 as IPv4-mapped, RFC 4291 §2.5.5.2): `ToHost`.
//!
//! # The flow of a packet
//! Addresses are the IP header's; ports are the first four bytes of a TCP, UDP or SCTP header
//! (RFC 9293 §3.1, RFC 768, RFC 9260 §3.1), taken only when the packet is not a fragment. An
//! IPv4 packet with MF set or a non-zero fragment offset (RFC 791 §3.1), and an IPv6 packet
//! whose first next header is a Fragment header (RFC 8200 §4.5), hash by addresses only, so
//! every fragment of a datagram goes one way. An IPv6 packet whose first next header is
//! another extension header also hashes by addresses (the program walks no chain).
//!
//! ICMP errors are about another packet, quoted inside them (RFC 792; RFC 4443 §2.4(c)):
//! IPv4 types 3 (destination unreachable, including fragmentation needed, RFC 1191) and 11
//! (time exceeded); ICMPv6 types 1 (destination unreachable), 2 (packet too big, RFC 8201)
//! and 3 (time exceeded). Such an error travels back toward the quoted packet's source, so
//! it takes the quoted header with source and destination (and ports) swapped: the flow of
//! the replies to the quoted packet. Path MTU discovery through a stateful firewall then
//! reaches the firewall that holds the connection. An error whose quoted header is cut short
//! hashes by its own addresses.
//!
//! # The key and the hash
//! The flow becomes ten 32-bit words, read from the packet as the program reads them: a
//! word is four bytes read little-endian (the program's loads on a little-endian host,
//! x86-64 and arm64), a port is two bytes read little-endian. Addresses are masked first
//! (`netmask` for IPv4 and `v6_netmask_len` for IPv6, [`Masks`]); an IPv4 address fills word
//! one of four, the rest zero.
//!
//! | word | `source_ip_hash` | `dest_ip_hash` | `source_dest_ip_hash` | `source_ip_source_port_hash` |
//! |---|---|---|---|---|
//! | 0 | tag | tag | tag | tag |
//! | 1-4 | source | destination | lower endpoint | lower endpoint |
//! | 5-8 | 0 | 0 | higher endpoint | higher endpoint |
//! | 9 | 0 | 0 | 0 | lower port + higher port << 16 |
//!
//! tag = method code (1..=4, [`PacketMethod::code`]) + 0x100 for IPv6 + protocol << 16 when
//! the ports are in the key. The two symmetric methods put the endpoints in a canonical
//! order, the lower first: (address words 1..4, then port) compared as unsigned numbers, so
//! swapping source and destination gives the same words. `source_ip_source_port_hash` is per
//! connection: both endpoints' addresses and ports and the protocol (TCP, UDP, SCTP), by
//! addresses for ICMP, other protocols and fragments; it is symmetric too, so a
//! connection's replies take the firewall its first packet took.
//!
//! The hash is a fixed, seeded 32-bit multiply-xorshift over the ten words:
//! `h = SEED; for w: h = (h ^ w) * M1; h ^= h >> 15` then `h ^= h >> 16; h *= M2; h ^= h >> 13`,
//! with [`SEED`], [`M1`], [`M2`] below, all arithmetic modulo 2^32. The bucket is the hash's low
//! 12 bits ([`BUCKETS`]). Forty 32-bit operations in the program, no table, no loop; never the
//! kernel's skb hash (it differs between hosts and NICs, and two instances must choose alike).
//!
//! # The bucket table
//! [`BUCKETS`] = 4096 buckets, each naming a firewall slot (its index in the vserver's
//! services + 1; 0 = no usable firewall, the packet is dropped and counted). Bucket `b`
//! gets what the vserver's selector (`crate::select`, carp / prac / jarh with weights and
//! `hash_id`) picks for the key hash [`bucket_key_hash`]`(b)` among the usable firewalls,
//! so a DOWN firewall's buckets move to the next in their ranking and no other bucket moves.
//! 4096: with at most [`MAX_LEGS`] firewalls each owns at least 64 buckets, so the table
//! follows the selector's shares within 1/4096 per bucket; two tables are 32 KiB, held in
//! cache, and a new table is 4096 map writes (milliseconds). 65536 would buy finer shares
//! no firewall pool needs at sixteen times the update cost.

use crate::select::HashSelector;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

#[cfg(test)]
mod tests;

/// Buckets in a table (a power of two: the bucket is the hash's low bits).
pub const BUCKETS: usize = 4096;
/// Firewall slots a vserver can have (legs map entries).
pub const MAX_LEGS: usize = 64;
/// Words in a flow key.
pub const KEY_WORDS: usize = 10;
/// The hash's seed: the ASCII bytes "fulc" read as a big-endian u32.
pub const SEED: u32 = 0x6675_6c63;
/// The per-word multiplier (murmur3's first finaliser constant).
pub const M1: u32 = 0x85eb_ca6b;
/// The final multiplier (murmur3's second finaliser constant).
pub const M2: u32 = 0xc2b2_ae35;

/// Counter slots: the pass reasons, then the drop, then one per firewall slot.
pub const COUNTER_DROP_NO_FIREWALL: u32 = 5;
/// Counter of packets whose firewall has no next hop of their family (an IPv6 packet and a
/// firewall known by an IPv4 address only).
pub const COUNTER_DROP_NO_NEXT_HOP: u32 = 6;
/// First firewall counter (slot 1's); slot `s` counts at `COUNTER_LEGS + s - 1`.
pub const COUNTER_LEGS: u32 = 8;
/// Entries of the counter map.
pub const COUNTERS: u32 = COUNTER_LEGS + MAX_LEGS as u32;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ICMPV6: u8 = 58;
const IPPROTO_SCTP: u8 = 132;

/// A packet vserver's hash method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PacketMethod {
    /// `source_ip_hash`
    SourceIp,
    /// `dest_ip_hash`
    DestIp,
    /// `source_dest_ip_hash` (symmetric)
    SourceDestIp,
    /// `source_ip_source_port_hash` (per connection, symmetric)
    Connection,
}

impl PacketMethod {
    /// Every method.
    pub const ALL: [PacketMethod; 4] = [
        PacketMethod::SourceIp,
        PacketMethod::DestIp,
        PacketMethod::SourceDestIp,
        PacketMethod::Connection,
    ];

    /// The method of a config `method`, when a packet vserver can hash by it.
    pub fn of(method: crate::config::Method) -> Option<PacketMethod> {
        use crate::config::Method;
        match method {
            Method::SourceIpHash => Some(PacketMethod::SourceIp),
            Method::DestIpHash => Some(PacketMethod::DestIp),
            Method::SourceDestIpHash => Some(PacketMethod::SourceDestIp),
            Method::SourceIpSourcePortHash => Some(PacketMethod::Connection),
            _ => None,
        }
    }

    /// The code in the key's tag and in the program's config map.
    pub fn code(self) -> u32 {
        match self {
            PacketMethod::SourceIp => 1,
            PacketMethod::DestIp => 2,
            PacketMethod::SourceDestIp => 3,
            PacketMethod::Connection => 4,
        }
    }
}

/// The address masks of a vserver: `netmask` and `v6_netmask_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Masks {
    /// IPv4 mask bytes.
    pub v4: [u8; 4],
    /// IPv6 mask bytes.
    pub v6: [u8; 16],
}

impl Masks {
    /// Masks from an IPv4 netmask and an IPv6 prefix length (clamped to 128).
    pub fn new(netmask: Ipv4Addr, v6_len: u8) -> Masks {
        let bits = u128::MAX
            .checked_shl(128 - u32::from(v6_len.min(128)))
            .unwrap_or(0);
        Masks {
            v4: netmask.octets(),
            v6: bits.to_be_bytes(),
        }
    }

    /// Nothing masked.
    pub fn full() -> Masks {
        Masks::new(Ipv4Addr::BROADCAST, 128)
    }

    /// The five mask words of the program's config map: IPv4, then IPv6's four.
    pub fn words(&self) -> [u32; 5] {
        let v6 = words16(&self.v6);
        [u32::from_le_bytes(self.v4), v6[0], v6[1], v6[2], v6[3]]
    }
}

/// Why a frame passes to the host's stack (the counter slot is the value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PassReason {
    /// Not IPv4 / IPv6 (ARP, LLDP, VLAN-tagged) or a runt.
    NonIp = 0,
    /// Ethernet group address, IP multicast or limited broadcast.
    Multicast = 1,
    /// Link-local source or destination.
    LinkLocal = 2,
    /// Addressed to this host.
    ToHost = 3,
    /// IP header short or of the wrong version.
    Malformed = 4,
}

impl PassReason {
    /// Every reason, in counter order.
    pub const ALL: [PassReason; 5] = [
        PassReason::NonIp,
        PassReason::Multicast,
        PassReason::LinkLocal,
        PassReason::ToHost,
        PassReason::Malformed,
    ];

    /// Its name in counters and logs.
    pub fn name(self) -> &'static str {
        match self {
            PassReason::NonIp => "non_ip",
            PassReason::Multicast => "multicast",
            PassReason::LinkLocal => "link_local",
            PassReason::ToHost => "to_host",
            PassReason::Malformed => "malformed",
        }
    }
}

/// What the hash sees of a packet: its addresses (an IPv4 address in the first four bytes,
/// the rest zero), protocol and ports (as numbers, when in the key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    /// IPv6 (else IPv4).
    pub is_v6: bool,
    /// Source address bytes.
    pub src: [u8; 16],
    /// Destination address bytes.
    pub dst: [u8; 16],
    /// The protocol the ports belong to.
    pub proto: u8,
    /// (source port, destination port) for TCP, UDP or SCTP outside fragments.
    pub ports: Option<(u16, u16)>,
}

/// A frame's class: to the stack, or a flow to hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// To the host's stack.
    Pass(PassReason),
    /// To a firewall.
    Flow(Flow),
}

fn words16(b: &[u8; 16]) -> [u32; 4] {
    let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    [w(0), w(4), w(8), w(12)]
}

fn addr16(b: &[u8]) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[..b.len().min(16)].copy_from_slice(&b[..b.len().min(16)]);
    a
}

/// The 16-byte key of the local-address set: an IPv6 address, or IPv4-mapped.
pub fn local_key(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

fn has_ports(proto: u8) -> bool {
    matches!(proto, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP)
}

/// Ports at `at`, when four bytes are there.
fn ports_at(p: &[u8], at: usize) -> Option<(u16, u16)> {
    let b = p.get(at..at + 4)?;
    Some((
        u16::from_be_bytes([b[0], b[1]]),
        u16::from_be_bytes([b[2], b[3]]),
    ))
}

/// Classify an Ethernet frame. `is_local` answers for a [`local_key`].
pub fn classify(frame: &[u8], is_local: impl Fn(&[u8; 16]) -> bool) -> Class {
    if frame.len() < ETH_HLEN {
        return Class::Pass(PassReason::NonIp);
    }
    let group = frame[0] & 1 != 0;
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let ip = &frame[ETH_HLEN..];
    let flow = match ethertype {
        _ if group => return Class::Pass(PassReason::Multicast),
        ETH_P_IP => v4(ip),
        ETH_P_IPV6 => v6(ip),
        _ => return Class::Pass(PassReason::NonIp),
    };
    let Some(flow) = flow else {
        return Class::Pass(PassReason::Malformed);
    };
    let (multicast, link_local) = if flow.is_v6 {
        let ll = |a: &[u8; 16]| a[0] == 0xfe && a[1] & 0xc0 == 0x80;
        (flow.dst[0] == 0xff, ll(&flow.src) || ll(&flow.dst))
    } else {
        let ll = |a: &[u8; 16]| a[0] == 169 && a[1] == 254;
        (
            flow.dst[0] & 0xf0 == 0xe0 || flow.dst[..4] == [255; 4],
            ll(&flow.src) || ll(&flow.dst),
        )
    };
    if multicast {
        return Class::Pass(PassReason::Multicast);
    }
    if link_local {
        return Class::Pass(PassReason::LinkLocal);
    }
    let dst_key = if flow.is_v6 {
        flow.dst
    } else {
        local_key(IpAddr::V4(Ipv4Addr::new(
            flow.dst[0],
            flow.dst[1],
            flow.dst[2],
            flow.dst[3],
        )))
    };
    if is_local(&dst_key) {
        return Class::Pass(PassReason::ToHost);
    }
    // The outer header decided the pass reasons; an ICMP error then takes its quoted flow.
    Class::Flow(quoted(ip, &flow).unwrap_or(flow))
}

/// The IPv4 header's flow (ports when the packet is not a fragment). `None`: malformed.
fn v4(ip: &[u8]) -> Option<Flow> {
    let h = ip.get(..20)?;
    let ihl = usize::from(h[0] & 0x0f) * 4;
    if h[0] >> 4 != 4 || ihl < 20 {
        return None;
    }
    let fragment = u16::from_be_bytes([h[6], h[7]]) & 0x3fff != 0;
    let proto = h[9];
    let ports = if fragment || !has_ports(proto) {
        None
    } else {
        ports_at(ip, ihl)
    };
    Some(Flow {
        is_v6: false,
        src: addr16(&h[12..16]),
        dst: addr16(&h[16..20]),
        proto,
        ports,
    })
}

/// The IPv6 header's flow. `None`: malformed.
fn v6(ip: &[u8]) -> Option<Flow> {
    let h = ip.get(..40)?;
    if h[0] >> 4 != 6 {
        return None;
    }
    let proto = h[6];
    let ports = if has_ports(proto) {
        ports_at(ip, 40)
    } else {
        None
    };
    Some(Flow {
        is_v6: true,
        src: addr16(&h[8..24]),
        dst: addr16(&h[24..40]),
        proto,
        ports,
    })
}

/// For an ICMP error (module doc), the quoted packet's flow reversed; `None` otherwise or
/// when the quoted header is cut short.
fn quoted(ip: &[u8], outer: &Flow) -> Option<Flow> {
    let (l4, icmp, errors): (usize, u8, &[u8]) = if outer.is_v6 {
        (40, IPPROTO_ICMPV6, &[1, 2, 3])
    } else {
        (usize::from(ip[0] & 0x0f) * 4, IPPROTO_ICMP, &[3, 11])
    };
    let fragment = !outer.is_v6 && u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff != 0;
    if outer.proto != icmp || fragment || !errors.contains(ip.get(l4)?) {
        return None;
    }
    let inner = ip.get(l4 + 8..)?;
    // A quoted fragment keeps to its addresses, as the fragment itself did (`v4`, `v6`).
    let f = if outer.is_v6 { v6(inner)? } else { v4(inner)? };
    Some(Flow {
        src: f.dst,
        dst: f.src,
        ports: f.ports.map(|(s, d)| (d, s)),
        ..f
    })
}

/// The ten key words of a flow (module doc).
pub fn key_words(method: PacketMethod, masks: &Masks, flow: &Flow) -> [u32; KEY_WORDS] {
    let mask = |a: &[u8; 16]| -> [u32; 4] {
        let w = words16(a);
        if flow.is_v6 {
            let m = words16(&masks.v6);
            [w[0] & m[0], w[1] & m[1], w[2] & m[2], w[3] & m[3]]
        } else {
            [w[0] & u32::from_le_bytes(masks.v4), 0, 0, 0]
        }
    };
    let (src, dst) = (mask(&flow.src), mask(&flow.dst));
    let ports = match (method, flow.ports) {
        (PacketMethod::Connection, Some(p)) => Some(p),
        _ => None,
    };
    let mut tag = method.code() | if flow.is_v6 { 0x100 } else { 0 };
    if ports.is_some() {
        tag |= u32::from(flow.proto) << 16;
    }
    let mut k = [0u32; KEY_WORDS];
    k[0] = tag;
    match method {
        PacketMethod::SourceIp => k[1..5].copy_from_slice(&src),
        PacketMethod::DestIp => k[1..5].copy_from_slice(&dst),
        PacketMethod::SourceDestIp | PacketMethod::Connection => {
            // Ports as the program loads them: two bytes read little-endian.
            let (sp, dp) = ports.map_or((0, 0), |(s, d)| {
                (u32::from(s.swap_bytes()), u32::from(d.swap_bytes()))
            });
            let (lo, hi) = if (src, sp) <= (dst, dp) {
                ((src, sp), (dst, dp))
            } else {
                ((dst, dp), (src, sp))
            };
            k[1..5].copy_from_slice(&lo.0);
            k[5..9].copy_from_slice(&hi.0);
            k[9] = lo.1 | hi.1 << 16;
        }
    }
    k
}

/// The fixed hash of key words (module doc).
pub fn flow_hash(words: &[u32; KEY_WORDS]) -> u32 {
    let mut h = SEED;
    for &w in words {
        h = (h ^ w).wrapping_mul(M1);
        h ^= h >> 15;
    }
    h ^= h >> 16;
    h = h.wrapping_mul(M2);
    h ^ (h >> 13)
}

/// The bucket of a hash.
pub fn bucket_of(hash: u32) -> u32 {
    hash & (BUCKETS as u32 - 1)
}

/// A vserver's data-path settings (the program's config map).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathConfig {
    /// The hash method.
    pub method: PacketMethod,
    /// The address masks.
    pub masks: Masks,
}

impl PathConfig {
    /// The settings of vserver `v`: its method and `netmask` / `v6_netmask_len`. `None` when
    /// its method is not one a packet vserver hashes by.
    pub fn of(v: &crate::config::Vserver) -> Option<PathConfig> {
        Some(PathConfig {
            method: PacketMethod::of(v.method)?,
            masks: Masks::new(v.hash.netmask, v.hash.v6_netmask_len),
        })
    }

    /// The config map's value: method code, then [`Masks::words`].
    pub fn value(&self) -> [u8; 24] {
        let mut v = [0u8; 24];
        v[..4].copy_from_slice(&self.method.code().to_le_bytes());
        for (i, w) in self.masks.words().iter().enumerate() {
            v[4 + 4 * i..8 + 4 * i].copy_from_slice(&w.to_le_bytes());
        }
        v
    }
}

/// What the program does with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// To the stack (TC_ACT_OK).
    Pass(PassReason),
    /// Its bucket names no usable firewall (TC_ACT_SHOT).
    Drop {
        /// The flow hash.
        hash: u32,
        /// Its bucket.
        bucket: u32,
    },
    /// Its firewall has no next hop of the packet's family (TC_ACT_SHOT).
    NoNextHop {
        /// The flow hash.
        hash: u32,
        /// Its bucket.
        bucket: u32,
        /// The firewall slot (1-based).
        slot: u32,
    },
    /// Redirected to the firewall in `slot` (TC_ACT_REDIRECT).
    Forward {
        /// The flow hash.
        hash: u32,
        /// Its bucket.
        bucket: u32,
        /// The firewall slot (1-based).
        slot: u32,
    },
}

/// The whole decision for one frame: `table` is the live bucket table, `leg(slot)` says
/// whether a slot has a leg and which next hops: (IPv4 packets, IPv6 packets), `None` when
/// it has none.
pub fn decide(
    frame: &[u8],
    config: &PathConfig,
    is_local: impl Fn(&[u8; 16]) -> bool,
    table: &[u32],
    leg: impl Fn(u32) -> Option<(bool, bool)>,
) -> Verdict {
    let flow = match classify(frame, is_local) {
        Class::Pass(r) => return Verdict::Pass(r),
        Class::Flow(f) => f,
    };
    let hash = flow_hash(&key_words(config.method, &config.masks, &flow));
    let bucket = bucket_of(hash);
    let slot = table.get(bucket as usize).copied().unwrap_or(0);
    if slot == 0 || slot as usize > MAX_LEGS {
        return Verdict::Drop { hash, bucket };
    }
    match leg(slot) {
        None => Verdict::Drop { hash, bucket },
        Some((v4, v6)) if (if flow.is_v6 { v6 } else { v4 }) => {
            Verdict::Forward { hash, bucket, slot }
        }
        Some(_) => Verdict::NoNextHop { hash, bucket, slot },
    }
}

/// The next hops of a leg: (for IPv4 packets, for IPv6 packets). An IPv4 packet may go to
/// an IPv6 next hop (RFC 8950's IPv4 over an IPv6 next hop, which `bpf_redirect_neigh`
/// supports); an IPv6 packet needs an IPv6 next hop.
pub fn next_hops(hops: &[IpAddr]) -> (Option<IpAddr>, Option<Ipv6Addr>) {
    let v6 = hops.iter().find_map(|h| match h {
        IpAddr::V6(a) => Some(*a),
        IpAddr::V4(_) => None,
    });
    let v4 = hops
        .iter()
        .find(|h| h.is_ipv4())
        .copied()
        .or(v6.map(IpAddr::V6));
    (v4, v6)
}

/// The selector's key hash for bucket `b`.
pub fn bucket_key_hash(bucket: u32) -> u64 {
    crate::hash::key_hash(&bucket.to_be_bytes())
}

/// The ranking of a packet vserver's firewalls: `lb`'s algorithm, fingers and prac bound
/// over `members`, UP where `up` says. The running program's table and `fulcrum simulate
/// flow`'s are built from it alike.
pub fn selector(
    lb: &crate::config::LbParams,
    members: &[crate::select::Member],
    up: &[bool],
) -> HashSelector {
    HashSelector::build_bounded(
        lb.hash_algorithm,
        lb.hash_fingers,
        lb.prac_max_share,
        members,
        up,
    )
}

/// The bucket table: bucket `b` holds 1 + the index of the service `selector` picks for
/// [`bucket_key_hash`]`(b)` among those `usable(i)` (and UP in the selector), 0 when none.
/// Services past [`MAX_LEGS`] are never picked.
pub fn build_table(selector: &HashSelector, usable: impl Fn(usize) -> bool) -> Vec<u32> {
    (0..BUCKETS as u32)
        .map(|b| {
            selector
                .pick(bucket_key_hash(b), |i| i < MAX_LEGS && usable(i))
                .map_or(0, |(i, _)| i as u32 + 1)
        })
        .collect()
}
