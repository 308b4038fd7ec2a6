//! The packet vservers' tc program, loaded into this kernel, against its Rust twin
//! (`fulcrum::packet::decide`): generated frames of every kind run through the program with
//! `BPF_PROG_TEST_RUN`, and its return code, hash, bucket, firewall slot and counter must be
//! the twin's, for every method, IPv4 and IPv6. Needs root (or CAP_BPF + CAP_NET_ADMIN):
//! skipped with a message without it, a failure when FULCRUM_REQUIRE_BPF is set.

use fulcrum::bpf::{PacketPath, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT};
use fulcrum::packet::{
    BUCKETS, COUNTER_DROP_NO_FIREWALL, COUNTER_DROP_NO_NEXT_HOP, COUNTER_LEGS, Masks, PacketMethod,
    PassReason, PathConfig, Verdict, decide, local_key,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

const LOCAL4: [u8; 4] = [10, 9, 9, 9];
const LOCAL6: [u8; 16] = [0x20, 0x01, 0x0d, 0xb8, 9, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9];
/// Slots 1..=3 have legs; slot 4 is in the table without one (dropped). Slot 1 has an IPv4
/// next hop only (its IPv6 packets are dropped), slot 2 an IPv6 one only (for both
/// families), slot 3 both.
const LEGS: u32 = 3;

fn leg(slot: u32) -> Option<(bool, bool)> {
    match slot {
        1 => Some((true, false)),
        2 | 3 => Some((true, true)),
        _ => None,
    }
}

fn hops(slot: u32) -> Vec<IpAddr> {
    let v4 = IpAddr::V4(Ipv4Addr::new(192, 0, 2, slot as u8));
    let v6 = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, slot as u16));
    match slot {
        1 => vec![v4],
        2 => vec![v6],
        _ => vec![v6, v4],
    }
}

fn load(config: &PathConfig) -> Option<PacketPath> {
    match PacketPath::load_at("twin-test", config, std::path::Path::new("/nonexistent")) {
        Ok(p) => Some(p),
        Err(e) if std::env::var_os("FULCRUM_REQUIRE_BPF").is_some() => {
            panic!("the packet program cannot load: {e}")
        }
        Err(e) => {
            eprintln!("skipped: the packet program cannot load here: {e}");
            None
        }
    }
}

fn locals() -> Vec<IpAddr> {
    vec![
        IpAddr::V4(Ipv4Addr::from(LOCAL4)),
        IpAddr::V6(Ipv6Addr::from(LOCAL6)),
    ]
}

/// A table from a seed: slots 0..=4 (0 = no firewall, 4 = no leg), mostly 1..=3.
fn table(seed: u64) -> Vec<u32> {
    let mut x = seed | 1;
    (0..BUCKETS)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match x % 16 {
                0 => 0,
                1 => 4,
                n => (n % 3 + 1) as u32,
            }
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Eth {
    Ip,
    Group,
    Arp,
    Vlan,
}

#[derive(Debug, Clone)]
enum L4 {
    Ported(u8),
    Echo,
    /// An ICMP error of `ty`, quoting a packet of `proto` (a fragment when `frag`), cut to
    /// `keep` bytes after the quoted IP header (None: whole).
    Error {
        ty: u8,
        proto: u8,
        frag: bool,
        keep: Option<usize>,
        src: [u8; 16],
        dst: [u8; 16],
    },
    Other(u8),
}

#[derive(Debug, Clone)]
struct Spec {
    eth: Eth,
    v6: bool,
    src: [u8; 16],
    dst: [u8; 16],
    l4: L4,
    ports: (u16, u16),
    frag: bool,
    /// IPv4 option words; for IPv6 a hop-by-hop header first.
    options: u8,
    bad_version: bool,
    cut: Option<usize>,
}

fn addr() -> impl Strategy<Value = [u8; 16]> {
    prop_oneof![
        6 => any::<[u8; 16]>(),
        // Few distinct addresses: flows meet their reverse, masks matter.
        4 => (0u8..4, 0u8..4).prop_map(|(a, b)| {
            let mut x = [0u8; 16];
            x[0] = 10 + a;
            x[3] = b;
            x[15] = b;
            x
        }),
        1 => Just({ let mut x = [0u8; 16]; x[..4].copy_from_slice(&LOCAL4); x }),
        1 => Just(LOCAL6),
        1 => Just([224, 0, 0, 18, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
        1 => Just([0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, 0, 0, 1]),
        1 => Just([169, 254, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
        1 => Just([0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
        1 => Just([255, 255, 255, 255, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
    ]
}

fn l4() -> impl Strategy<Value = L4> {
    prop_oneof![
        4 => prop_oneof![Just(6u8), Just(17u8), Just(132u8)].prop_map(L4::Ported),
        2 => Just(L4::Echo),
        4 => (
            prop_oneof![Just(3u8), Just(11), Just(1), Just(2), Just(12), Just(4)],
            prop_oneof![Just(6u8), Just(17), Just(132), Just(1), Just(58), Just(47)],
            any::<bool>(),
            proptest::option::weighted(0.3, 0usize..12),
            addr(),
            addr(),
        )
            .prop_map(|(ty, proto, frag, keep, src, dst)| L4::Error {
                ty,
                proto,
                frag,
                keep,
                src,
                dst
            }),
        1 => prop_oneof![Just(47u8), Just(50), Just(112), Just(0), Just(255)].prop_map(L4::Other),
    ]
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        prop_oneof![12 => Just(Eth::Ip), 1 => Just(Eth::Group), 1 => Just(Eth::Arp), 1 => Just(Eth::Vlan)],
        any::<bool>(),
        addr(),
        addr(),
        l4(),
        any::<(u16, u16)>(),
        proptest::bool::weighted(0.15),
        prop_oneof![6 => Just(0u8), 1 => 1u8..3],
        proptest::bool::weighted(0.03),
        proptest::option::weighted(0.1, 14usize..120),
    )
        .prop_map(
            |(eth, v6, src, dst, l4, ports, frag, options, bad_version, cut)| Spec {
                eth,
                v6,
                src,
                dst,
                l4,
                ports,
                frag,
                options,
                bad_version,
                cut,
            },
        )
}

fn sum16(b: &[u8]) -> u16 {
    let mut s: u32 = 0;
    for c in b.chunks(2) {
        s += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// An IP header (and extension or options) for `proto` with `payload` after it.
fn ip(
    v6: bool,
    src: &[u8; 16],
    dst: &[u8; 16],
    proto: u8,
    frag: bool,
    options: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut p = Vec::new();
    if v6 {
        let mut body = Vec::new();
        let mut next = proto;
        if frag {
            body.extend_from_slice(&[next, 0, 0x00, 0x09, 0, 0, 0, 7]);
            next = 44;
        }
        if options > 0 {
            let mut hbh = vec![next, 0, 1, 4, 0, 0, 0, 0];
            hbh.extend_from_slice(&body);
            body = hbh;
            next = 0;
        }
        body.extend_from_slice(payload);
        p.extend_from_slice(&[0x60, 0, 0, 0]);
        p.extend_from_slice(&(body.len() as u16).to_be_bytes());
        p.extend_from_slice(&[next, 64]);
        p.extend_from_slice(src);
        p.extend_from_slice(dst);
        p.extend_from_slice(&body);
    } else {
        let ihl = 5 + options;
        let total = usize::from(ihl) * 4 + payload.len();
        p.extend_from_slice(&[0x40 | ihl, 0]);
        p.extend_from_slice(&(total as u16).to_be_bytes());
        p.extend_from_slice(&[0x12, 0x34]);
        p.extend_from_slice(if frag { &[0x20, 0x00] } else { &[0x40, 0x00] });
        p.extend_from_slice(&[64, proto, 0, 0]);
        p.extend_from_slice(&src[..4]);
        p.extend_from_slice(&dst[..4]);
        p.extend(std::iter::repeat_n(1u8, usize::from(options) * 4));
        let c = sum16(&p);
        p[10..12].copy_from_slice(&c.to_be_bytes());
        p.extend_from_slice(payload);
    }
    p
}

fn frame(s: &Spec) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
    if matches!(s.eth, Eth::Group) {
        f[0] = 0x01;
    }
    let ported = |ports: (u16, u16)| {
        let mut l = Vec::new();
        l.extend_from_slice(&ports.0.to_be_bytes());
        l.extend_from_slice(&ports.1.to_be_bytes());
        l.extend_from_slice(&[0u8; 16]);
        l
    };
    let (proto, payload) = match &s.l4 {
        L4::Ported(p) => (*p, ported(s.ports)),
        L4::Echo => (
            if s.v6 { 58 } else { 1 },
            vec![if s.v6 { 128 } else { 8 }, 0, 0, 0, 0, 1, 0, 1],
        ),
        L4::Error {
            ty,
            proto,
            frag,
            keep,
            src,
            dst,
        } => {
            let mut quoted = ip(s.v6, src, dst, *proto, *frag, 0, &ported(s.ports));
            if let Some(k) = keep {
                quoted.truncate(k * 5);
            }
            let mut m = vec![*ty, 4, 0, 0, 0, 0, 5, 0xdc];
            m.extend_from_slice(&quoted);
            (if s.v6 { 58 } else { 1 }, m)
        }
        L4::Other(p) => (*p, vec![0xab; 12]),
    };
    let mut packet = ip(s.v6, &s.src, &s.dst, proto, s.frag, s.options, &payload);
    if s.bad_version {
        packet[0] = (packet[0] & 0x0f) | 0x50;
    }
    match s.eth {
        Eth::Arp => f.extend_from_slice(&[0x08, 0x06]),
        Eth::Vlan => f.extend_from_slice(&[0x81, 0x00, 0x00, 0x05, 0x08, 0x00]),
        _ => f.extend_from_slice(if s.v6 { &[0x86, 0xdd] } else { &[0x08, 0x00] }),
    }
    f.extend_from_slice(&packet);
    if let Some(c) = s.cut {
        f.truncate(c.max(14));
    }
    f
}

fn masks() -> impl Strategy<Value = Masks> {
    prop_oneof![
        2 => Just(Masks::full()),
        1 => (0u32..=32, 0u8..=128).prop_map(|(l4, l6)| Masks::new(
            Ipv4Addr::from(u32::MAX.checked_shl(32 - l4).unwrap_or(0)),
            l6
        )),
    ]
}

/// The program and its twin agree on `frame`.
fn agree(
    path: &PacketPath,
    config: &PathConfig,
    live: &[u32],
    frame: &[u8],
) -> Result<Verdict, TestCaseError> {
    let local: Vec<[u8; 16]> = locals().into_iter().map(local_key).collect();
    let want = decide(frame, config, |k| local.contains(k), live, leg);
    // The kernel's test run refuses an IP frame cut inside its fixed header (it reads the
    // header to set the socket family): those runts are the twin's alone to say.
    let header = match frame.get(12..14) {
        Some([0x08, 0x00]) => 14 + 20,
        Some([0x86, 0xdd]) => 14 + 40,
        _ => 0,
    };
    if frame.len() < header {
        return Ok(want);
    }
    let got = path
        .run(frame)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    match want {
        Verdict::Pass(r) => {
            prop_assert_eq!(got.action, TC_ACT_OK, "{:?} {:?}", want, got);
            prop_assert_eq!(got.counter, r as u32, "{:?} {:?}", want, got);
        }
        Verdict::Drop { hash, bucket } => {
            prop_assert_eq!(got.action, TC_ACT_SHOT, "{:?} {:?}", want, got);
            prop_assert_eq!((got.hash, got.bucket), (hash, bucket));
            prop_assert_eq!(got.counter, COUNTER_DROP_NO_FIREWALL);
        }
        Verdict::NoNextHop { hash, bucket, slot } => {
            prop_assert_eq!(got.action, TC_ACT_SHOT, "{:?} {:?}", want, got);
            prop_assert_eq!((got.hash, got.bucket, got.slot), (hash, bucket, slot));
            prop_assert_eq!(got.counter, COUNTER_DROP_NO_NEXT_HOP);
        }
        Verdict::Forward { hash, bucket, slot } => {
            prop_assert_eq!(got.action, TC_ACT_REDIRECT, "{:?} {:?}", want, got);
            prop_assert_eq!((got.hash, got.bucket, got.slot), (hash, bucket, slot));
            prop_assert_eq!(got.counter, COUNTER_LEGS + slot - 1);
        }
    }
    Ok(want)
}

fn prepared(method: PacketMethod) -> Option<(PacketPath, Vec<u32>)> {
    let config = PathConfig {
        method,
        masks: Masks::full(),
    };
    let mut path = load(&config)?;
    path.set_local_addresses(&locals()).expect("locals");
    for slot in 1..=LEGS {
        path.set_leg(slot, 1, &hops(slot)).expect("leg");
    }
    // Twice: the second table is in the other half, and live.
    path.install_table(&table(7)).expect("table");
    let live = table(method.code() as u64 + 11);
    path.install_table(&live).expect("table");
    Some((path, live))
}

fn twin_matches_program(method: PacketMethod) {
    let Some((path, live)) = prepared(method) else {
        return;
    };
    let mut runner = TestRunner::new(Config {
        cases: 64,
        ..Config::default()
    });
    let seen = std::cell::RefCell::new(std::collections::HashSet::new());
    runner
        .run(
            &(masks(), proptest::collection::vec(spec(), 1..40)),
            |(masks, specs)| {
                let config = PathConfig { method, masks };
                path.set_config(&config)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                for s in &specs {
                    let v = agree(&path, &config, &live, &frame(s))?;
                    seen.borrow_mut().insert(match v {
                        Verdict::Pass(r) => r as u32,
                        Verdict::Drop { .. } => 100,
                        Verdict::NoNextHop { .. } => 300,
                        Verdict::Forward { .. } => 200,
                    });
                }
                Ok(())
            },
        )
        .expect("program and twin agree");
    // The generator reached every outcome.
    let seen = seen.into_inner();
    for r in PassReason::ALL {
        assert!(
            seen.contains(&(r as u32)),
            "{r:?} never generated: {seen:?}"
        );
    }
    assert!(
        seen.contains(&100) && seen.contains(&200) && seen.contains(&300),
        "{seen:?}"
    );
}

#[test]
fn program_matches_twin_source_ip() {
    twin_matches_program(PacketMethod::SourceIp);
}

#[test]
fn program_matches_twin_dest_ip() {
    twin_matches_program(PacketMethod::DestIp);
}

#[test]
fn program_matches_twin_source_dest_ip() {
    twin_matches_program(PacketMethod::SourceDestIp);
}

#[test]
fn program_matches_twin_connection() {
    twin_matches_program(PacketMethod::Connection);
}

/// A new table takes effect at the next packet; counters count what the program did.
#[test]
fn a_new_table_moves_buckets_and_counters_count() {
    let Some((mut path, _)) = prepared(PacketMethod::SourceDestIp) else {
        return;
    };
    let spec = Spec {
        eth: Eth::Ip,
        v6: false,
        src: [10, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        dst: [10, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        l4: L4::Ported(6),
        ports: (40000, 443),
        frag: false,
        options: 0,
        bad_version: false,
        cut: None,
    };
    let f = frame(&spec);
    let before = path.counters().expect("counters");
    for slot in 1..=LEGS {
        path.install_table(&vec![slot; BUCKETS]).expect("table");
        let r = path.run(&f).expect("run");
        assert_eq!((r.action, r.slot), (TC_ACT_REDIRECT, slot));
    }
    path.install_table(&vec![0; BUCKETS]).expect("table");
    assert_eq!(path.run(&f).expect("run").action, TC_ACT_SHOT);
    let mut arp = f.clone();
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    assert_eq!(path.run(&arp).expect("run").action, TC_ACT_OK);
    let after = path.counters().expect("counters");
    let len = f.len() as u64;
    for s in 0..LEGS as usize {
        assert_eq!(after.forwarded[s].packets - before.forwarded[s].packets, 1);
        assert_eq!(after.forwarded[s].bytes - before.forwarded[s].bytes, len);
    }
    assert_eq!(
        after.dropped_no_firewall.packets - before.dropped_no_firewall.packets,
        1
    );
    assert_eq!(
        after.passed(PassReason::NonIp).packets - before.passed(PassReason::NonIp).packets,
        1
    );
    // A table of the wrong size or naming a slot past the legs is refused.
    assert!(path.install_table(&[1, 2, 3]).is_err());
    assert!(path.install_table(&vec![65; BUCKETS]).is_err());
}

/// The program's cost per packet as the kernel measures it, printed for BENCHMARKS.md: a
/// million runs each of an IPv4 TCP segment, an IPv6 UDP datagram and an IPv4 ICMP error
/// (the longest path). Bounded loosely (a shared machine): under 5 µs a packet.
#[test]
fn cost_per_packet() {
    let Some((path, _)) = prepared(PacketMethod::Connection) else {
        return;
    };
    let base = Spec {
        eth: Eth::Ip,
        v6: false,
        src: [10, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
        dst: [10, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
        l4: L4::Ported(6),
        ports: (40000, 443),
        frag: false,
        options: 0,
        bad_version: false,
        cut: None,
    };
    let udp6 = Spec {
        v6: true,
        l4: L4::Ported(17),
        src: [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
        dst: [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
        ..base.clone()
    };
    let error = Spec {
        l4: L4::Error {
            ty: 3,
            proto: 6,
            frag: false,
            keep: None,
            src: base.dst,
            dst: base.src,
        },
        ..base.clone()
    };
    for (name, s) in [
        ("ipv4 tcp", &base),
        ("ipv6 udp", &udp6),
        ("ipv4 icmp error", &error),
    ] {
        let t = path
            .time_per_packet(&frame(s), 1_000_000)
            .expect("timed run");
        println!("program cost, {name}: {} ns per packet", t.as_nanos());
        assert!(t < std::time::Duration::from_micros(5), "{name}: {t:?}");
    }
}
