//! The tc ingress program of a packet vserver, written with [`super::asm`]. PURE: maps by
//! descriptor in, bytes out. What it decides is `crate::packet`'s module doc, step for step;
//! `crate::packet::decide` is its twin.
//!
//! Context: `struct __sk_buff` (include/uapi/linux/bpf.h): `len` at 0, `cb[5]` at 48, `data`
//! at 76, `data_end` at 80. The program leaves in `cb` what the tests read back from
//! `BPF_PROG_TEST_RUN`'s `ctx_out`: cb\[0\] the flow hash, cb\[1\] its bucket, cb\[2\] the
//! firewall slot it went to, cb\[3\] the counter it counted under (`cb` is the program's
//! scratch area on tc ingress; nothing reads it after a redirect).
//!
//! Stack (below r10): the flow (source and destination words, protocol, ports, flags: bit 0
//! IPv6, bit 1 ports known), the ten key words, a 16-byte local-address key and a u32 map
//! index.

use super::asm::{Alu, Asm, AsmError, Cond, FP, R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, Size};
use crate::packet::{
    BUCKETS, COUNTER_DROP_NO_FIREWALL, COUNTER_DROP_NO_NEXT_HOP, COUNTER_LEGS, M1, M2, MAX_LEGS,
    SEED,
};

const SRC: i16 = -128;
const DST: i16 = -112;
const PROTO: i16 = -96;
const SPORT: i16 = -92;
const DPORT: i16 = -88;
const FLAGS: i16 = -84;
const KEY: i16 = -80;
const LKEY: i16 = -32;
const IDX: i16 = -8;

const SKB_LEN: i16 = 0;
const SKB_CB: i16 = 48;
const SKB_DATA: i16 = 76;
const SKB_DATA_END: i16 = 80;

const HELPER_MAP_LOOKUP_ELEM: i32 = 1;
const HELPER_REDIRECT_NEIGH: i32 = 152;
const TC_ACT_OK: i32 = 0;
const TC_ACT_SHOT: i32 = 2;
/// Size of `struct bpf_redir_neigh`: family, then a 16-byte address.
const REDIR_NEIGH_LEN: i32 = 20;
/// Offsets in a leg: the next hop for IPv4 packets, then for IPv6 packets.
const LEG_NEIGH_V4: i32 = 4;
const LEG_NEIGH_V6: i32 = 24;

/// The descriptors of the program's maps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MapFds {
    /// Array, 1 entry: method code and mask words (`PathConfig::value`).
    pub(crate) config: i32,
    /// Array, 1 entry: which half of `table` is live (0 or 1).
    pub(crate) active: i32,
    /// Array, 2 × BUCKETS u32: firewall slot per bucket, two tables.
    pub(crate) table: i32,
    /// Array, MAX_LEGS entries: ifindex, then a `struct bpf_redir_neigh` for IPv4 packets and
    /// one for IPv6 packets (family 0: none).
    pub(crate) legs: i32,
    /// Hash, 16-byte address → u32: this host's addresses.
    pub(crate) local: i32,
    /// Per-CPU array, COUNTERS entries of {packets, bytes}.
    pub(crate) counters: i32,
}

/// Counter index in r9 += 1 packet and skb->len bytes; cb[3] = the index.
fn count(a: &mut Asm, m: &MapFds, done: &str) {
    a.stx(Size::W, R6, SKB_CB + 12, R9);
    a.stx(Size::W, FP, IDX, R9);
    lookup(a, m.counters);
    a.jmp_imm(Cond::Eq, R0, 0, done);
    a.ldx(Size::DW, R1, R0, 0);
    a.alu64_imm(Alu::Add, R1, 1);
    a.stx(Size::DW, R0, 0, R1);
    a.ldx(Size::W, R2, R6, SKB_LEN);
    a.ldx(Size::DW, R1, R0, 8);
    a.alu64(Alu::Add, R1, R2);
    a.stx(Size::DW, R0, 8, R1);
    a.label(done);
}

/// r0 = map_lookup_elem(map, fp + IDX).
fn lookup(a: &mut Asm, map: i32) {
    lookup_at(a, map, IDX);
}

fn lookup_at(a: &mut Asm, map: i32, key: i16) {
    a.ld_map(R1, map);
    a.mov(R2, FP);
    a.alu64_imm(Alu::Add, R2, i32::from(key));
    a.call(HELPER_MAP_LOOKUP_ELEM);
}

/// The key's address `from` (4 words, stack) into key words starting at `to`.
fn copy4(a: &mut Asm, from: i16, to: i16) {
    for i in 0..4 {
        a.ldx(Size::W, R3, FP, from + 4 * i);
        a.stx(Size::W, FP, to + 4 * i, R3);
    }
}

/// if r2 is TCP, UDP or SCTP goto `yes`.
fn if_ports(a: &mut Asm, yes: &str) {
    for proto in [6, 17, 132] {
        a.jmp_imm(Cond::Eq, R2, proto, yes);
    }
}

/// r2 = method code | 0x100 for IPv6 (flags in r3).
fn tag_v6(a: &mut Asm, end: &str) {
    a.mov(R4, R3);
    a.alu64_imm(Alu::And, R4, 1);
    a.jmp_imm(Cond::Eq, R4, 0, end);
    a.alu64_imm(Alu::Or, R2, 0x100);
    a.label(end);
}

/// The program, with `m`'s descriptors in it.
pub(crate) fn program(m: &MapFds) -> Result<Vec<u8>, AsmError> {
    let mut a = Asm::default();
    a.mov(R6, R1);
    a.ldx(Size::W, R7, R6, SKB_DATA);
    a.ldx(Size::W, R8, R6, SKB_DATA_END);
    for off in (SRC..KEY).step_by(8) {
        a.st(Size::DW, FP, off, 0);
    }
    a.mov_imm(R2, 0);
    for i in 0..3 {
        a.stx(Size::W, R6, SKB_CB + 4 * i, R2);
    }
    // Ethernet: a runt or a group address, then the EtherType.
    a.mov(R2, R7);
    a.alu64_imm(Alu::Add, R2, 14);
    a.jmp(Cond::Gt, R2, R8, "pass_non_ip");
    a.ldx(Size::B, R2, R7, 0);
    a.alu64_imm(Alu::And, R2, 1);
    a.jmp_imm(Cond::Ne, R2, 0, "pass_multicast");
    a.ldx(Size::H, R2, R7, 12);
    a.jmp_imm(Cond::Eq, R2, 0x0008, "v4");
    a.jmp_imm(Cond::Eq, R2, 0xdd86, "v6");
    a.ja("pass_non_ip");

    v4(&mut a, m);
    v6(&mut a, m);
    keyed(&mut a, m);

    for (label, reason) in [
        ("pass_non_ip", 0),
        ("pass_multicast", 1),
        ("pass_link_local", 2),
        ("pass_to_host", 3),
        ("pass_malformed", 4),
    ] {
        a.label(label);
        a.mov_imm(R9, reason);
        a.ja("pass");
    }
    a.label("pass");
    count(&mut a, m, "pass_counted");
    a.mov_imm(R0, TC_ACT_OK);
    a.exit();
    a.label("drop");
    a.mov_imm(R9, COUNTER_DROP_NO_FIREWALL as i32);
    count(&mut a, m, "drop_counted");
    a.mov_imm(R0, TC_ACT_SHOT);
    a.exit();
    a.label("drop_no_next_hop");
    a.mov_imm(R9, COUNTER_DROP_NO_NEXT_HOP as i32);
    count(&mut a, m, "no_next_hop_counted");
    a.mov_imm(R0, TC_ACT_SHOT);
    a.exit();
    debug_assert!(a.len() < 4096);
    a.finish()
}

fn v4(a: &mut Asm, m: &MapFds) {
    a.label("v4");
    a.mov(R2, R7);
    a.alu64_imm(Alu::Add, R2, 14 + 20);
    a.jmp(Cond::Gt, R2, R8, "pass_malformed");
    a.ldx(Size::B, R3, R7, 14);
    a.mov(R4, R3);
    a.alu64_imm(Alu::Rsh, R4, 4);
    a.jmp_imm(Cond::Ne, R4, 4, "pass_malformed");
    a.alu64_imm(Alu::And, R3, 15);
    a.jmp_imm(Cond::Lt, R3, 5, "pass_malformed");
    a.ldx(Size::W, R2, R7, 26);
    a.stx(Size::W, FP, SRC, R2);
    a.ldx(Size::W, R2, R7, 30);
    a.stx(Size::W, FP, DST, R2);
    a.ldx(Size::B, R2, R7, 23);
    a.stx(Size::W, FP, PROTO, R2);
    // 224.0.0.0/4 and 255.255.255.255.
    a.ldx(Size::B, R2, R7, 30);
    a.alu64_imm(Alu::And, R2, 0xf0);
    a.jmp_imm(Cond::Eq, R2, 0xe0, "pass_multicast");
    a.ldx(Size::W, R2, R7, 30);
    a.alu64_imm(Alu::Add, R2, 1);
    a.alu64_imm(Alu::Rsh, R2, 32);
    a.jmp_imm(Cond::Ne, R2, 0, "pass_multicast");
    // 169.254.0.0/16 either side (the two bytes read little-endian).
    a.ldx(Size::H, R2, R7, 26);
    a.jmp_imm(Cond::Eq, R2, 0xfea9, "pass_link_local");
    a.ldx(Size::H, R2, R7, 30);
    a.jmp_imm(Cond::Eq, R2, 0xfea9, "pass_link_local");
    // ::ffff:a.b.c.d
    a.st(Size::W, FP, LKEY, 0);
    a.st(Size::W, FP, LKEY + 4, 0);
    a.st(Size::W, FP, LKEY + 8, 0xffff_0000_u32 as i32);
    a.ldx(Size::W, R2, R7, 30);
    a.stx(Size::W, FP, LKEY + 12, R2);
    lookup_at(a, m.local, LKEY);
    a.jmp_imm(Cond::Ne, R0, 0, "pass_to_host");
    // r3 = header length; a fragment keeps to its addresses.
    a.ldx(Size::B, R3, R7, 14);
    a.alu64_imm(Alu::And, R3, 15);
    a.alu64_imm(Alu::Lsh, R3, 2);
    a.ldx(Size::H, R2, R7, 20);
    a.alu64_imm(Alu::And, R2, 0xff3f);
    a.jmp_imm(Cond::Ne, R2, 0, "keyed");
    a.ldx(Size::B, R2, R7, 23);
    a.jmp_imm(Cond::Eq, R2, 1, "icmp4");
    if_ports(a, "ports4");
    a.ja("keyed");

    a.label("ports4");
    a.mov(R4, R7);
    a.alu64_imm(Alu::Add, R4, 14);
    a.alu64(Alu::Add, R4, R3);
    a.mov(R5, R4);
    a.alu64_imm(Alu::Add, R5, 4);
    a.jmp(Cond::Gt, R5, R8, "keyed");
    a.ldx(Size::H, R2, R4, 0);
    a.stx(Size::W, FP, SPORT, R2);
    a.ldx(Size::H, R2, R4, 2);
    a.stx(Size::W, FP, DPORT, R2);
    a.st(Size::W, FP, FLAGS, 2);
    a.ja("keyed");

    // An error quoting an IPv4 header: its addresses and ports, swapped.
    a.label("icmp4");
    a.mov(R4, R7);
    a.alu64_imm(Alu::Add, R4, 14);
    a.alu64(Alu::Add, R4, R3);
    a.mov(R5, R4);
    a.alu64_imm(Alu::Add, R5, 8 + 20);
    a.jmp(Cond::Gt, R5, R8, "keyed");
    a.ldx(Size::B, R2, R4, 0);
    a.jmp_imm(Cond::Eq, R2, 3, "icmp4_error");
    a.jmp_imm(Cond::Eq, R2, 11, "icmp4_error");
    a.ja("keyed");
    a.label("icmp4_error");
    a.alu64_imm(Alu::Add, R4, 8);
    a.ldx(Size::B, R3, R4, 0);
    a.mov(R5, R3);
    a.alu64_imm(Alu::Rsh, R5, 4);
    a.jmp_imm(Cond::Ne, R5, 4, "keyed");
    a.alu64_imm(Alu::And, R3, 15);
    a.jmp_imm(Cond::Lt, R3, 5, "keyed");
    a.alu64_imm(Alu::Lsh, R3, 2);
    a.ldx(Size::W, R2, R4, 16);
    a.stx(Size::W, FP, SRC, R2);
    a.ldx(Size::W, R2, R4, 12);
    a.stx(Size::W, FP, DST, R2);
    a.ldx(Size::B, R2, R4, 9);
    a.stx(Size::W, FP, PROTO, R2);
    a.ldx(Size::H, R5, R4, 6);
    a.alu64_imm(Alu::And, R5, 0xff3f);
    a.jmp_imm(Cond::Ne, R5, 0, "keyed");
    if_ports(a, "inner_ports4");
    a.ja("keyed");
    a.label("inner_ports4");
    a.alu64(Alu::Add, R4, R3);
    a.mov(R5, R4);
    a.alu64_imm(Alu::Add, R5, 4);
    a.jmp(Cond::Gt, R5, R8, "keyed");
    a.ldx(Size::H, R2, R4, 0);
    a.stx(Size::W, FP, DPORT, R2);
    a.ldx(Size::H, R2, R4, 2);
    a.stx(Size::W, FP, SPORT, R2);
    a.st(Size::W, FP, FLAGS, 2);
    a.ja("keyed");
}

fn v6(a: &mut Asm, m: &MapFds) {
    a.label("v6");
    a.mov(R2, R7);
    a.alu64_imm(Alu::Add, R2, 14 + 40);
    a.jmp(Cond::Gt, R2, R8, "pass_malformed");
    a.ldx(Size::B, R2, R7, 14);
    a.alu64_imm(Alu::Rsh, R2, 4);
    a.jmp_imm(Cond::Ne, R2, 6, "pass_malformed");
    for i in 0..4 {
        a.ldx(Size::W, R2, R7, 22 + 4 * i);
        a.stx(Size::W, FP, SRC + 4 * i, R2);
        a.ldx(Size::W, R2, R7, 38 + 4 * i);
        a.stx(Size::W, FP, DST + 4 * i, R2);
    }
    a.ldx(Size::B, R2, R7, 20);
    a.stx(Size::W, FP, PROTO, R2);
    a.st(Size::W, FP, FLAGS, 1);
    a.ldx(Size::B, R2, R7, 38);
    a.jmp_imm(Cond::Eq, R2, 0xff, "pass_multicast");
    // fe80::/10 either side (the two bytes read little-endian).
    for at in [22, 38] {
        a.ldx(Size::H, R2, R7, at);
        a.alu64_imm(Alu::And, R2, 0xc0ff);
        a.jmp_imm(Cond::Eq, R2, 0x80fe, "pass_link_local");
    }
    lookup_at(a, m.local, DST);
    a.jmp_imm(Cond::Ne, R0, 0, "pass_to_host");
    a.ldx(Size::B, R2, R7, 20);
    a.jmp_imm(Cond::Eq, R2, 58, "icmp6");
    if_ports(a, "ports6");
    a.ja("keyed");

    a.label("ports6");
    a.mov(R5, R7);
    a.alu64_imm(Alu::Add, R5, 54 + 4);
    a.jmp(Cond::Gt, R5, R8, "keyed");
    a.ldx(Size::H, R2, R7, 54);
    a.stx(Size::W, FP, SPORT, R2);
    a.ldx(Size::H, R2, R7, 56);
    a.stx(Size::W, FP, DPORT, R2);
    a.st(Size::W, FP, FLAGS, 3);
    a.ja("keyed");

    // An error quoting an IPv6 header (at 62): its addresses and ports, swapped.
    a.label("icmp6");
    a.mov(R5, R7);
    a.alu64_imm(Alu::Add, R5, 54 + 8 + 40);
    a.jmp(Cond::Gt, R5, R8, "keyed");
    a.ldx(Size::B, R2, R7, 54);
    for t in [1, 2, 3] {
        a.jmp_imm(Cond::Eq, R2, t, "icmp6_error");
    }
    a.ja("keyed");
    a.label("icmp6_error");
    a.ldx(Size::B, R2, R7, 62);
    a.alu64_imm(Alu::Rsh, R2, 4);
    a.jmp_imm(Cond::Ne, R2, 6, "keyed");
    for i in 0..4 {
        a.ldx(Size::W, R2, R7, 86 + 4 * i);
        a.stx(Size::W, FP, SRC + 4 * i, R2);
        a.ldx(Size::W, R2, R7, 70 + 4 * i);
        a.stx(Size::W, FP, DST + 4 * i, R2);
    }
    a.ldx(Size::B, R2, R7, 68);
    a.stx(Size::W, FP, PROTO, R2);
    if_ports(a, "inner_ports6");
    a.ja("keyed");
    a.label("inner_ports6");
    a.mov(R5, R7);
    a.alu64_imm(Alu::Add, R5, 102 + 4);
    a.jmp(Cond::Gt, R5, R8, "keyed");
    a.ldx(Size::H, R2, R7, 102);
    a.stx(Size::W, FP, DPORT, R2);
    a.ldx(Size::H, R2, R7, 104);
    a.stx(Size::W, FP, SPORT, R2);
    a.st(Size::W, FP, FLAGS, 3);
    a.ja("keyed");
}

/// Masks, key words, hash, bucket, table, leg, redirect.
fn keyed(a: &mut Asm, m: &MapFds) {
    a.label("keyed");
    a.st(Size::W, FP, IDX, 0);
    lookup(a, m.config);
    a.jmp_imm(Cond::Eq, R0, 0, "drop");
    a.mov(R9, R0);
    a.ldx(Size::W, R2, FP, FLAGS);
    a.alu64_imm(Alu::And, R2, 1);
    a.jmp_imm(Cond::Ne, R2, 0, "mask6");
    a.ldx(Size::W, R3, R9, 4);
    for at in [SRC, DST] {
        a.ldx(Size::W, R2, FP, at);
        a.alu64(Alu::And, R2, R3);
        a.stx(Size::W, FP, at, R2);
    }
    a.ja("method");
    a.label("mask6");
    for i in 0..4 {
        a.ldx(Size::W, R3, R9, 8 + 4 * i);
        for at in [SRC, DST] {
            a.ldx(Size::W, R2, FP, at + 4 * i);
            a.alu64(Alu::And, R2, R3);
            a.stx(Size::W, FP, at + 4 * i, R2);
        }
    }

    a.label("method");
    a.ldx(Size::W, R2, R9, 0);
    a.ldx(Size::W, R3, FP, FLAGS);
    a.jmp_imm(Cond::Eq, R2, 4, "symmetric");
    // Only the per-connection method keys by ports.
    a.st(Size::W, FP, SPORT, 0);
    a.st(Size::W, FP, DPORT, 0);
    a.alu64_imm(Alu::And, R3, 1);
    a.stx(Size::W, FP, FLAGS, R3);
    a.jmp_imm(Cond::Eq, R2, 3, "symmetric");
    a.jmp_imm(Cond::Eq, R2, 1, "source_only");
    a.jmp_imm(Cond::Eq, R2, 2, "dest_only");
    a.ja("drop");

    a.label("symmetric");
    tag_v6(a, "symmetric_v4");
    a.mov(R4, R3);
    a.alu64_imm(Alu::And, R4, 2);
    a.jmp_imm(Cond::Eq, R4, 0, "symmetric_tagged");
    a.ldx(Size::W, R4, FP, PROTO);
    a.alu64_imm(Alu::Lsh, R4, 16);
    a.alu64(Alu::Or, R2, R4);
    a.label("symmetric_tagged");
    a.stx(Size::W, FP, KEY, R2);
    for i in 0..4 {
        a.ldx(Size::W, R3, FP, SRC + 4 * i);
        a.ldx(Size::W, R4, FP, DST + 4 * i);
        a.jmp(Cond::Lt, R3, R4, "in_order");
        a.jmp(Cond::Gt, R3, R4, "swapped");
    }
    a.ldx(Size::W, R3, FP, SPORT);
    a.ldx(Size::W, R4, FP, DPORT);
    a.jmp(Cond::Gt, R3, R4, "swapped");
    for (label, lo, hi, lo_port, hi_port) in [
        ("in_order", SRC, DST, SPORT, DPORT),
        ("swapped", DST, SRC, DPORT, SPORT),
    ] {
        a.label(label);
        copy4(a, lo, KEY + 4);
        copy4(a, hi, KEY + 20);
        a.ldx(Size::W, R3, FP, lo_port);
        a.ldx(Size::W, R4, FP, hi_port);
        a.alu64_imm(Alu::Lsh, R4, 16);
        a.alu64(Alu::Or, R3, R4);
        a.stx(Size::W, FP, KEY + 36, R3);
        a.ja("hash");
    }

    for (label, from) in [("source_only", SRC), ("dest_only", DST)] {
        a.label(label);
        tag_v6(a, &format!("{label}_v4"));
        a.stx(Size::W, FP, KEY, R2);
        copy4(a, from, KEY + 4);
        for i in 5..10 {
            a.st(Size::W, FP, KEY + 4 * i, 0);
        }
        a.ja("hash");
    }

    a.label("hash");
    a.mov_imm(R1, SEED as i32);
    for i in 0..10 {
        a.ldx(Size::W, R2, FP, KEY + 4 * i);
        a.alu32(Alu::Xor, R1, R2);
        a.alu32_imm(Alu::Mul, R1, M1 as i32);
        a.mov(R2, R1);
        a.alu32_imm(Alu::Rsh, R2, 15);
        a.alu32(Alu::Xor, R1, R2);
    }
    for (shift, mul) in [(16, Some(M2)), (13, None)] {
        a.mov(R2, R1);
        a.alu32_imm(Alu::Rsh, R2, shift);
        a.alu32(Alu::Xor, R1, R2);
        if let Some(mul) = mul {
            a.alu32_imm(Alu::Mul, R1, mul as i32);
        }
    }
    a.stx(Size::W, R6, SKB_CB, R1);
    a.alu64_imm(Alu::And, R1, BUCKETS as i32 - 1);
    a.mov(R8, R1);
    a.stx(Size::W, R6, SKB_CB + 4, R1);

    // The live half of the table, then the bucket's slot, then its leg.
    a.st(Size::W, FP, IDX, 0);
    lookup(a, m.active);
    a.jmp_imm(Cond::Eq, R0, 0, "drop");
    a.ldx(Size::W, R2, R0, 0);
    a.alu64_imm(Alu::And, R2, 1);
    a.alu64_imm(Alu::Lsh, R2, BUCKETS.trailing_zeros() as i32);
    a.alu64(Alu::Add, R2, R8);
    a.stx(Size::W, FP, IDX, R2);
    lookup(a, m.table);
    a.jmp_imm(Cond::Eq, R0, 0, "drop");
    a.ldx(Size::W, R9, R0, 0);
    a.jmp_imm(Cond::Eq, R9, 0, "drop");
    a.jmp_imm(Cond::Gt, R9, MAX_LEGS as i32, "drop");
    a.mov(R2, R9);
    a.alu64_imm(Alu::Add, R2, -1);
    a.stx(Size::W, FP, IDX, R2);
    lookup(a, m.legs);
    a.jmp_imm(Cond::Eq, R0, 0, "drop");
    a.ldx(Size::W, R2, R0, 0);
    a.jmp_imm(Cond::Eq, R2, 0, "drop");
    a.mov(R8, R0);
    a.stx(Size::W, R6, SKB_CB + 8, R9);
    // r7 = the next hop for the packet's family; none: dropped.
    a.mov(R7, R8);
    a.ldx(Size::W, R2, FP, FLAGS);
    a.alu64_imm(Alu::And, R2, 1);
    a.jmp_imm(Cond::Ne, R2, 0, "leg_v6");
    a.alu64_imm(Alu::Add, R7, LEG_NEIGH_V4);
    a.ja("leg_chosen");
    a.label("leg_v6");
    a.alu64_imm(Alu::Add, R7, LEG_NEIGH_V6);
    a.label("leg_chosen");
    a.ldx(Size::W, R2, R7, 0);
    a.jmp_imm(Cond::Eq, R2, 0, "drop_no_next_hop");
    a.alu64_imm(Alu::Add, R9, COUNTER_LEGS as i32 - 1);
    count(a, m, "forward_counted");
    // bpf_redirect_neigh(ifindex, &leg.neigh, sizeof, 0): the kernel's neighbour table
    // gives the firewall's MAC and refreshes it.
    a.ldx(Size::W, R1, R8, 0);
    a.mov(R2, R7);
    a.mov_imm(R3, REDIR_NEIGH_LEN);
    a.mov_imm(R4, 0);
    a.call(HELPER_REDIRECT_NEIGH);
    a.exit();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_program_assembles_within_the_instruction_limit() {
        let fds = MapFds {
            config: 3,
            active: 4,
            table: 5,
            legs: 6,
            local: 7,
            counters: 8,
        };
        let p = program(&fds).expect("assembles");
        assert_eq!(p.len() % 8, 0);
        assert!(p.len() / 8 < 1000, "{} instructions", p.len() / 8);
    }
}
