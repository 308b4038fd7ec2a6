//! Flood control of a vserver: per source IP, more than `limit` new requests in `window`
//! bans the source for `ban`. PURE: `now` is passed in, nothing reads the clock.
//!
//! # Bounded memory
//! Sources are tracked in a fixed table allocated once ([`FloodTable::new`]: `slots`
//! entries of 48 bytes, 16,384 by default, under 1 MiB per vserver) whatever the number of
//! sources: a source hashes to a bucket of [`WAYS`] slots and takes the first free, expired
//! or matching slot there, else evicts the slot of the bucket whose window began longest
//! ago (never a banned one while its ban runs). Exact counts per tracked source, so a
//! legitimate source is never banned for another's traffic (a count-min sketch would
//! over-count under collisions and could ban an innocent source); under a flood from more
//! sources than the table holds, sources are evicted and start counting again, so the table
//! fails open (lets a source through) rather than closed. A source whose bucket is full of
//! running bans is not tracked (let through, counted as `untracked`).
//!
//! The table is split into shards, each behind its own mutex, so workers checking sources
//! that land in different shards do not wait for each other; a check is a hash, a lock and
//! at most [`WAYS`] slot comparisons, without allocation. Only requests that would open a
//! new flow are checked (SIP requests outside a dialog, new udp sessions, new tcp
//! connections); established dialogs and sessions never are.

use crate::stats::Nanos;
use std::net::IpAddr;
use std::sync::Mutex;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Slots per bucket: the probe length of a lookup.
pub(crate) const WAYS: usize = 8;
/// Shards of the table (each a mutex over its slots).
const SHARDS: usize = 16;
/// Seed of the source hash: "fulcrumB".
const SEED: u64 = 0x6675_6c63_7275_6d42;

/// The `flood:` parameters of a vserver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FloodParams {
    /// New requests a source may send in one window.
    pub limit: u32,
    pub window_ns: Nanos,
    pub ban_ns: Nanos,
    /// IPv6 sources count by this prefix (one subscriber is given a /64, so counting each
    /// address apart would give one attacker 2^64 sources); IPv4 by address.
    pub ipv6_prefix: u8,
}

/// The default `flood.ipv6_prefix`.
pub(crate) const DEFAULT_IPV6_PREFIX: u8 = 64;

/// What a check decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Let through, counted.
    Pass,
    /// This request went over the limit: the source is banned from now on.
    Banned,
    /// The source is banned: drop.
    Refused,
    /// Let through uncounted: every slot of its bucket holds a running ban.
    Untracked,
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// 0 = empty.
    ip: u128,
    /// Family tag, so that `::a.b.c.d` and `a.b.c.d` never share a slot.
    v6: bool,
    used: bool,
    window_start: Nanos,
    count: u32,
    /// Banned until (exclusive); 0 = not banned.
    banned_until: Nanos,
}

impl Slot {
    fn holds(&self, ip: u128, v6: bool) -> bool {
        self.used && self.ip == ip && self.v6 == v6
    }

    fn is_banned(&self, now: Nanos) -> bool {
        self.banned_until > now
    }

    /// Nothing left to remember at `now`: no running ban, window over.
    fn is_stale(&self, now: Nanos, p: &FloodParams) -> bool {
        !self.used || (!self.is_banned(now) && now.saturating_sub(self.window_start) >= p.window_ns)
    }
}

/// A banned source, for the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ban {
    pub ip: IpAddr,
    pub until: Nanos,
}

/// Per-source counts and bans of one vserver, in bounded memory.
#[derive(Debug)]
pub(crate) struct FloodTable {
    params: FloodParams,
    shards: Vec<Mutex<Vec<Slot>>>,
    buckets_per_shard: usize,
}

/// The source `ip` counts as: an IPv4 address, or an IPv6 address's first `prefix` bits.
fn key(ip: IpAddr, prefix: u8) -> (u128, bool) {
    match ip.to_canonical() {
        IpAddr::V4(v4) => (u128::from(u32::from(v4)), false),
        IpAddr::V6(v6) => {
            let keep = u32::from(prefix.min(128));
            let mask = u128::MAX.checked_shl(128 - keep).unwrap_or(0);
            (u128::from(v6) & mask, true)
        }
    }
}

fn ip_of(slot: &Slot) -> IpAddr {
    if slot.v6 {
        IpAddr::V6(slot.ip.into())
    } else {
        IpAddr::V4(u32::try_from(slot.ip).unwrap_or(0).into())
    }
}

impl FloodTable {
    /// A table of about `slots` entries (rounded up to whole buckets of every shard).
    pub(crate) fn new(params: FloodParams, slots: usize) -> FloodTable {
        let buckets_per_shard = slots.div_ceil(SHARDS * WAYS).max(1);
        FloodTable {
            params,
            shards: (0..SHARDS)
                .map(|_| Mutex::new(vec![Slot::default(); buckets_per_shard * WAYS]))
                .collect(),
            buckets_per_shard,
        }
    }

    pub(crate) fn params(&self) -> FloodParams {
        self.params
    }

    /// Slots in the table (its memory bound).
    pub(crate) fn capacity(&self) -> usize {
        SHARDS * self.buckets_per_shard * WAYS
    }

    /// Bytes of the table's slots.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.capacity() * std::mem::size_of::<Slot>()
    }

    fn place(&self, ip: u128, v6: bool) -> (usize, usize) {
        let h = xxh3_64_with_seed(&ip.to_le_bytes(), SEED ^ u64::from(v6));
        let shard = (h as usize) % SHARDS;
        let bucket = ((h >> 32) as usize) % self.buckets_per_shard;
        (shard, bucket * WAYS)
    }

    /// Count one new request from `ip` at `now`.
    pub(crate) fn check(&self, ip: IpAddr, now: Nanos) -> Verdict {
        let p = &self.params;
        let (ip, v6) = key(ip, p.ipv6_prefix);
        let (shard, at) = self.place(ip, v6);
        let mut slots = crate::sync::lock(&self.shards[shard]);
        let bucket = &mut slots[at..at + WAYS];
        let found = bucket.iter().position(|s| s.holds(ip, v6));
        let i = match found {
            Some(i) => i,
            None => {
                let free = bucket.iter().position(|s| s.is_stale(now, p)).or_else(|| {
                    (0..WAYS)
                        .filter(|&i| !bucket[i].is_banned(now))
                        .min_by_key(|&i| bucket[i].window_start)
                });
                let Some(i) = free else {
                    return Verdict::Untracked;
                };
                bucket[i] = Slot {
                    ip,
                    v6,
                    used: true,
                    window_start: now,
                    count: 0,
                    banned_until: 0,
                };
                i
            }
        };
        let s = &mut bucket[i];
        if s.is_banned(now) {
            return Verdict::Refused;
        }
        // A new window, or a ban that ran out: counting starts again.
        if now.saturating_sub(s.window_start) >= p.window_ns || s.banned_until != 0 {
            s.window_start = now;
            s.count = 0;
            s.banned_until = 0;
        }
        s.count = s.count.saturating_add(1);
        if s.count > p.limit {
            s.banned_until = now.saturating_add(p.ban_ns).max(1);
            return Verdict::Banned;
        }
        Verdict::Pass
    }

    /// Whether `ip` is banned at `now` (without counting anything).
    #[cfg(test)]
    pub(crate) fn is_banned(&self, ip: IpAddr, now: Nanos) -> bool {
        let (ip, v6) = key(ip, self.params.ipv6_prefix);
        let (shard, at) = self.place(ip, v6);
        let slots = crate::sync::lock(&self.shards[shard]);
        slots[at..at + WAYS]
            .iter()
            .any(|s| s.holds(ip, v6) && s.is_banned(now))
    }

    /// Every source banned at `now`.
    pub(crate) fn bans(&self, now: Nanos) -> Vec<Ban> {
        let mut out = Vec::new();
        for shard in &self.shards {
            let slots = crate::sync::lock(shard);
            out.extend(
                slots
                    .iter()
                    .filter(|s| s.used && s.is_banned(now))
                    .map(|s| Ban {
                        ip: ip_of(s),
                        until: s.banned_until,
                    }),
            );
        }
        out.sort_by_key(|b| b.ip);
        out
    }

    /// Lift the ban of `ip` (its count starts again). `false` if it was not banned.
    pub(crate) fn unban(&self, ip: IpAddr, now: Nanos) -> bool {
        let (ip, v6) = key(ip, self.params.ipv6_prefix);
        let (shard, at) = self.place(ip, v6);
        let mut slots = crate::sync::lock(&self.shards[shard]);
        match slots[at..at + WAYS]
            .iter_mut()
            .find(|s| s.holds(ip, v6) && s.is_banned(now))
        {
            Some(s) => {
                *s = Slot::default();
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: Nanos = 1_000_000_000;

    fn table(limit: u32) -> FloodTable {
        FloodTable::new(
            FloodParams {
                limit,
                window_ns: S,
                ban_ns: 10 * S,
                ipv6_prefix: DEFAULT_IPV6_PREFIX,
            },
            1024,
        )
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    /// One /64 is one source: 100,000 of its addresses share one count and one ban, while a
    /// client of another /64 goes on; `ipv6_prefix: 128` counts each address apart, and IPv4
    /// is always by address.
    #[test]
    fn ipv6_sources_count_by_their_prefix() {
        let t = table(50);
        let base = u128::from("2001:db8:1:2::".parse::<std::net::Ipv6Addr>().expect("v6"));
        let mut verdicts = [0u32; 4];
        for i in 0..100_000u128 {
            let a = IpAddr::V6((base | (i * 7_919 + 1)).into());
            let v = t.check(a, S / 2);
            verdicts[match v {
                Verdict::Pass => 0,
                Verdict::Banned => 1,
                Verdict::Refused => 2,
                Verdict::Untracked => 3,
            }] += 1;
        }
        assert_eq!(
            verdicts,
            [50, 1, 99_949, 0],
            "one count, one ban for the /64"
        );
        assert!(t.is_banned(ip("2001:db8:1:2:ffff::1"), S));
        assert_eq!(
            t.check(ip("2001:db8:1:3::1"), S),
            Verdict::Pass,
            "another /64"
        );
        assert_eq!(
            t.bans(S).iter().map(|b| b.ip).collect::<Vec<_>>(),
            [ip("2001:db8:1:2::")]
        );
        assert!(
            t.unban(ip("2001:db8:1:2::99"), S),
            "any address of the prefix lifts its ban"
        );
        let per_address = FloodTable::new(
            FloodParams {
                ipv6_prefix: 128,
                ..t.params()
            },
            1024,
        );
        for i in 1..=60u128 {
            assert_eq!(
                per_address.check(IpAddr::V6((base | i).into()), S),
                Verdict::Pass
            );
        }
        assert_eq!(
            key(ip("192.0.2.7"), 8),
            key(ip("192.0.2.7"), 128),
            "IPv4 by address"
        );
    }

    #[test]
    fn over_the_limit_in_a_window_bans_until_the_ban_ends() {
        let t = table(3);
        let a = ip("192.0.2.1");
        for _ in 0..3 {
            assert_eq!(t.check(a, 0), Verdict::Pass);
        }
        assert_eq!(t.check(a, 1), Verdict::Banned);
        assert_eq!(t.check(a, S), Verdict::Refused);
        assert!(t.is_banned(a, 5 * S));
        assert_eq!(
            t.bans(5 * S),
            vec![Ban {
                ip: a,
                until: 1 + 10 * S
            }]
        );
        // Another source is not touched; the same source as IPv4-mapped IPv6 is the same.
        assert_eq!(t.check(ip("192.0.2.2"), S), Verdict::Pass);
        assert_eq!(t.check(ip("::ffff:192.0.2.1"), S), Verdict::Refused);
        // The ban ends: counting starts again.
        assert_eq!(t.check(a, 10 * S + 1), Verdict::Pass);
        assert!(t.bans(10 * S + 1).is_empty());
    }

    /// A ban shorter than the window: when it ends, the source starts a fresh count (it was
    /// banned again at once while its old window ran on).
    #[test]
    fn a_source_counts_afresh_once_its_ban_ends() {
        let t = FloodTable::new(
            FloodParams {
                limit: 2,
                window_ns: 30 * S,
                ban_ns: S,
                ipv6_prefix: DEFAULT_IPV6_PREFIX,
            },
            1024,
        );
        let a = ip("192.0.2.1");
        assert_eq!(t.check(a, 0), Verdict::Pass);
        assert_eq!(t.check(a, 0), Verdict::Pass);
        assert_eq!(t.check(a, 0), Verdict::Banned);
        assert_eq!(t.check(a, S / 2), Verdict::Refused);
        assert_eq!(t.check(a, S), Verdict::Pass);
        assert_eq!(t.check(a, S), Verdict::Pass);
        assert_eq!(t.check(a, S), Verdict::Banned);
    }

    #[test]
    fn the_window_restarts_and_a_ban_can_be_lifted() {
        let t = table(2);
        let a = ip("2001:db8::1");
        assert_eq!(t.check(a, 0), Verdict::Pass);
        assert_eq!(t.check(a, 0), Verdict::Pass);
        // A new window: two more are fine.
        assert_eq!(t.check(a, S), Verdict::Pass);
        assert_eq!(t.check(a, S), Verdict::Pass);
        assert_eq!(t.check(a, S), Verdict::Banned);
        assert!(t.unban(a, S));
        assert!(!t.unban(a, S));
        assert_eq!(t.check(a, S), Verdict::Pass);
    }

    #[test]
    fn memory_is_fixed_whatever_the_number_of_sources() {
        let t = table(5);
        let bytes = t.memory_bytes();
        assert!(bytes < 64 * 1024, "{bytes}");
        for i in 0..200_000u32 {
            let _ = t.check(IpAddr::V4(i.into()), 0);
        }
        assert_eq!(t.memory_bytes(), bytes);
        assert_eq!(t.capacity(), 1024);
    }

    proptest! {
        /// Whatever other sources send (any number, any interleaving), a source that sends
        /// at most `limit` new requests per window is never refused: tracking is exact for a
        /// tracked source, and an evicted one only starts counting again.
        #[test]
        fn a_source_within_the_limit_is_never_refused(
            others in proptest::collection::vec((any::<u32>(), 0u32..20), 0..400),
            limit in 1u32..10,
        ) {
            let t = table(limit);
            let me = ip("198.51.100.77");
            let mut now = 0;
            for (round, chunk) in others.chunks(20).enumerate() {
                now = round as u64 * S;
                for &(src, n) in chunk {
                    for _ in 0..n {
                        let _ = t.check(IpAddr::V4(src.into()), now);
                    }
                }
                for _ in 0..limit {
                    let v = t.check(me, now);
                    prop_assert!(matches!(v, Verdict::Pass | Verdict::Untracked), "{v:?}");
                }
            }
            prop_assert!(!t.is_banned(me, now));
        }
    }
}
