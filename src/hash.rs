//! The fixed hash functions every consistent-hash decision rests on. PURE.
//!
//! Determinism (docs/methods.md) demands that the same config and the same UP set give the same choice
//! in every process, on every machine, after every upgrade. So nothing here is randomly seeded:
//! keys and service identities go through xxh3-64 (the `xxhash-rust` crate, a published,
//! platform-independent algorithm) with the fixed seeds below, and the per-pair combination is a
//! fixed 64-bit mixer. Changing any constant or encoding in this file moves live traffic after an
//! upgrade; `tests/golden_hash.rs` fails when that happens by accident.

use std::net::{IpAddr, SocketAddr};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of [`key_hash`]: the ASCII bytes "fulcrumK" read as a big-endian u64.
pub const KEY_SEED: u64 = 0x6675_6c63_7275_6d4b;
/// Seed of [`service_hash`]: the ASCII bytes "fulcrumS" read as a big-endian u64.
pub const SERVICE_SEED: u64 = 0x6675_6c63_7275_6d53;
/// Seed of [`finger_hash`] (jarh ring points): the ASCII bytes "fulcrumF" as a big-endian u64.
pub const FINGER_SEED: u64 = 0x6675_6c63_7275_6d46;
/// Seed of [`service_digest`]: the ASCII bytes "fulcrumD" as a big-endian u64.
pub const DIGEST_SEED: u64 = 0x6675_6c63_7275_6d44;

/// Length of [`address_identity`].
pub const ADDRESS_IDENTITY_LEN: usize = 19;

/// Hash of a request key (the bytes a hash method extracted): xxh3-64 with [`KEY_SEED`].
pub fn key_hash(key: &[u8]) -> u64 {
    xxh3_64_with_seed(key, KEY_SEED)
}

/// Hash of a service identity: xxh3-64 with [`SERVICE_SEED`].
///
/// The identity is the service's `hash_id` bytes when configured, else [`address_identity`] of its
/// address; never its name, so renaming a service does not move traffic (docs/methods.md, Selection).
pub fn service_hash(identity: &[u8]) -> u64 {
    xxh3_64_with_seed(identity, SERVICE_SEED)
}

/// The fixed byte encoding of a service address used as its hashing identity.
///
/// Layout (19 bytes): byte 0 is the family (4 or 6); bytes 1..17 the address octets in network
/// order (IPv4 in bytes 1..5, the rest zero); bytes 17..19 the port, big-endian. IPv6 flow info and
/// scope id are left out because they are not part of which box the service is; an IPv4-mapped IPv6
/// address stays distinct from the plain IPv4 one, because the operator wrote a different address.
pub fn address_identity(addr: &SocketAddr) -> [u8; ADDRESS_IDENTITY_LEN] {
    let mut out = [0u8; ADDRESS_IDENTITY_LEN];
    match addr.ip() {
        IpAddr::V4(v4) => {
            out[0] = 4;
            out[1..5].copy_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => {
            out[0] = 6;
            out[1..17].copy_from_slice(&v6.octets());
        }
    }
    out[17..19].copy_from_slice(&addr.port().to_be_bytes());
    out
}

/// The identity hash of a configured service: its `hash_id` when set (so that the two legs of one
/// firewall rank identically), else its address.
pub fn service_identity_hash(hash_id: Option<&str>, addr: &SocketAddr) -> u64 {
    match hash_id {
        Some(id) => service_hash(id.as_bytes()),
        None => service_hash(&address_identity(addr)),
    }
}

/// The digest of a service's identity hash written into fulcrum's Record-Route (`fc-svc`):
/// a keyed hash of it, so the parameter names a configured service to any instance with the
/// same services without giving its address or its position in the config.
pub fn service_digest(identity_hash: u64) -> u64 {
    xxh3_64_with_seed(&identity_hash.to_le_bytes(), DIGEST_SEED)
}

/// A bijective 64-bit finaliser (the splitmix64 / Stafford "mix13" output function).
///
/// Used where a cheap, full-avalanche mix of already-uniform 64-bit values is enough; every
/// output bit depends on every input bit.
#[inline]
pub fn mix64(z: u64) -> u64 {
    let z = mix64_head(z);
    z ^ (z >> 31)
}

/// The first two rounds of [`mix64`] (everything but its last `z ^= z >> 31`).
#[inline]
fn mix64_head(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb)
}

/// The CARP combination of a key hash and a service hash: [`mix64`] of `key ^ service` without
/// its last step (`z ^= z >> 31`).
///
/// The 1998 CARP draft's own 32-bit combine gives a peak/mean of 4 with IP:port members (measured
/// while designing carp, docs/hashing.md), so fulcrum keeps the draft's structure (combine two hashes, highest wins) with a
/// 64-bit mixer whose high bits avalanche fully: for a fixed key, the values over distinct
/// services behave as independent uniform draws, which is what highest-random-weight hashing
/// needs. The last xor-shift of `mix64` only re-mixes the low 33 bits from the high ones, so it
/// never changes the order of two values whose top 31 bits differ; leaving it out saves three of
/// the instructions a carp lookup spends per service (1.27 -> 1.14 ns per service at n = 100).
/// Rankings differ from the full `mix64` only where the two best values share their top 31 bits,
/// about one key in two million at n = 1000 with equal weights (a weight scales the value, so
/// weighted scores within a relative 2^-31 of each other may also swap); the golden file's
/// 1,000 keys did not change.
#[inline]
pub fn carp_combine(key_hash: u64, service_hash: u64) -> u64 {
    mix64_head(key_hash ^ service_hash)
}

/// Position of ring point number `finger` of a service on the jarh ring: xxh3-64 with
/// [`FINGER_SEED`] over the 12 bytes `service_hash` (little-endian) ++ `finger` (little-endian).
pub fn finger_hash(service_hash: u64, finger: u32) -> u64 {
    let mut buf = [0u8; 12];
    buf[..8].copy_from_slice(&service_hash.to_le_bytes());
    buf[8..].copy_from_slice(&finger.to_le_bytes());
    xxh3_64_with_seed(&buf, FINGER_SEED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_identity_layout() {
        let a: SocketAddr = "10.1.2.3:5060".parse().unwrap();
        let id = address_identity(&a);
        assert_eq!(id[0], 4);
        assert_eq!(&id[1..5], &[10, 1, 2, 3]);
        assert!(id[5..17].iter().all(|b| *b == 0));
        assert_eq!(&id[17..], &5060u16.to_be_bytes());
        let b: SocketAddr = "[2001:db8::1]:5060".parse().unwrap();
        let id6 = address_identity(&b);
        assert_eq!(id6[0], 6);
        assert_eq!(id6[16], 1);
    }

    #[test]
    fn mapped_v6_is_distinct_from_v4() {
        let a: SocketAddr = "10.1.2.3:5060".parse().unwrap();
        let b: SocketAddr = "[::ffff:10.1.2.3]:5060".parse().unwrap();
        assert_ne!(address_identity(&a), address_identity(&b));
    }

    #[test]
    fn hash_id_overrides_address() {
        let a: SocketAddr = "10.1.2.3:5060".parse().unwrap();
        let b: SocketAddr = "10.9.9.9:5060".parse().unwrap();
        assert_eq!(
            service_identity_hash(Some("fw-a"), &a),
            service_identity_hash(Some("fw-a"), &b)
        );
        assert_ne!(
            service_identity_hash(None, &a),
            service_identity_hash(None, &b)
        );
    }

    #[test]
    fn seeds_are_distinct() {
        assert_ne!(key_hash(b"x"), service_hash(b"x"));
    }
}
