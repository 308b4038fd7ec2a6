//! `prac`: a CARP-ranked slot table with capped shares and O(1) lookups. PURE.
//!
//! Construction (also in `docs/hashing.md`):
//! 1. Table size `M = 2^b`, the smallest power of two >= `fingers x services` (at least 2, at
//!    most 2^22). A key lands in slot `key_hash >> (64 - b)`. A power of two (rather than a prime
//!    with a modulo) keeps the key-to-slot map unchanged when a service is added without crossing
//!    a power of two, so a config change re-ranks nothing it does not have to.
//! 2. Bids: each service places `8 x fingers x weight` bids, points in the key space with a
//!    32-bit score, all fixed by its id alone (see `Bids`); a slot's candidates are the bids that
//!    fall in it (about 8), best score first. This ranks each slot on its own, like rendezvous
//!    hashing per slot, for `8 x M` hashes instead of `N x M` (ranking every slot over every
//!    service took 0.8 s at n = 1000).
//! 3. Cells: slots are also grouped in cells of `next_pow2(fingers) / 8` slots; each cell ranks
//!    every service by the carp score (`carp` module, weights included) of its start point, so
//!    that when `M` doubles, cell `2c` keeps old cell `c`'s ranking. Cells give the failover
//!    order and the fallback for slots whose bidders are all full.
//! 4. Caps: `floor(share_i + 1/4 + r_i)` slots with `r_i` in [0, 1) fixed by the service hash
//!    (see `caps` for why), raised where needed to cover `M`.
//! 5. The all-UP table is the capped stable matching, rank first: in round `r` every slot still
//!    free offers itself to its `r`-th best bidder, and each service accepts its offers by
//!    descending bid score up to its cap (so a service keeps every slot it bids best in unless
//!    those alone exceed its cap). Slots whose bidders are exhausted or full are handed out by
//!    their cells' rankings (`assign`: the pairs (cell, service) from each cell's top 8
//!    services in descending carp score, each up to the service's cap, then further down).
//! 6. The health-adjusted table is derived from the all-UP table: slots of UP services stay where
//!    they are; the slots of DOWN services are handed out by their cells' rankings the same way
//!    among UP services, with caps recomputed for the UP set (never below the all-UP caps). So a
//!    service going DOWN moves only its own keys, and its return restores the all-UP table
//!    exactly.
//!
//! Caveat (docs/hashing.md, "Caveat: capped shares"): because of the caps, a slot's owner is not always the first UP service in
//! its ranking: a next-ranked service already at its capped share is passed over. And adding a
//! service to the config moves some slots between existing services (a service that loses a
//! slot to the newcomer and had to leave slots it bid best in to others takes one back, which
//! cascades; about 2.9x the ideal movement at n = 1000, see `docs/hashing.md`); health changes
//! never do. The ranking reported for a key is the all-UP owner first, then the remaining
//! services in the carp order of its cell.
//!
//! Lookup: one shift and one table read, plus an UP check.

use super::carp::{Score, Scorer};
use crate::config::PracMaxShare;

/// Largest table exponent: 2^22 slots (1024 fingers x 4096 services; at most 32 MiB for the
/// two u32 tables) bounds memory whatever `fingers x services` asks for.
const MAX_BITS: u32 = 22;

/// Slot -> service index, stored as u16 while the service count allows (half the memory).
#[derive(Debug, Clone)]
enum Table {
    Small(Vec<u16>),
    Large(Vec<u32>),
}

impl Table {
    fn from_owners(owners: &[u32], small: bool) -> Table {
        if small {
            Table::Small(owners.iter().map(|o| *o as u16).collect())
        } else {
            Table::Large(owners.to_vec())
        }
    }

    #[inline]
    fn get(&self, slot: usize) -> usize {
        match self {
            Table::Small(v) => v.get(slot).map_or(0, |o| usize::from(*o)),
            Table::Large(v) => v.get(slot).map_or(0, |o| *o as usize),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Table::Small(v) => v.len() * 2,
            Table::Large(v) => v.len() * 4,
        }
    }
}

/// The prac selector.
#[derive(Debug, Clone)]
pub(crate) struct Prac {
    scorer: Scorer,
    /// The configured weights (the caps of a derived UP set are computed from them).
    weights: Vec<u32>,
    /// The balance bound the caps keep (`lb.prac_max_share`).
    max_share: PracMaxShare,
    up: Vec<bool>,
    /// Every service UP: the table is the all-UP table, every hit is a first choice.
    all_up: bool,
    geo: Geometry,
    all_up_table: Table,
    table: Table,
}

/// Whether `n` services fit the u16 table.
fn small_table(n: usize) -> bool {
    n <= usize::from(u16::MAX) + 1
}

/// Table exponent for a service count and finger count.
pub(crate) fn table_bits(fingers: u32, services: usize) -> u32 {
    let want = u64::from(fingers.max(1)).saturating_mul(services.max(1) as u64);
    let bits = 64 - want.saturating_sub(1).leading_zeros();
    bits.clamp(1, MAX_BITS)
}

/// Slots per cell: `fingers / 8` rounded up to a power of two, so a service's share spans
/// about 8 cells whatever the finger count, and the build ranks `8 x N` cells, not `M` slots.
fn cell_bits(fingers: u32, table_bits: u32) -> u32 {
    let f = u64::from(fingers.max(1)).next_power_of_two();
    let bits = f.trailing_zeros().saturating_sub(3);
    bits.min(table_bits)
}

/// Where slots and cells sit in the 64-bit key space.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    /// `64 - table bits`: a key's slot is `key >> shift`.
    shift: u32,
    /// log2(slots per cell).
    cell_bits: u32,
    slots: usize,
}

impl Geometry {
    fn new(fingers: u32, services: usize) -> Geometry {
        let bits = table_bits(fingers, services);
        Geometry {
            shift: 64 - bits,
            cell_bits: cell_bits(fingers, bits),
            slots: 1usize << bits,
        }
    }

    #[inline]
    fn slot(&self, key: u64) -> usize {
        (key >> self.shift) as usize
    }

    fn cell_of(&self, slot: usize) -> usize {
        slot >> self.cell_bits
    }

    /// The key a cell is ranked by: its start point in the key space, so that when the table
    /// doubles, cell `2c` keeps cell `c`'s ranking.
    fn cell_key(&self, cell: usize) -> u64 {
        ((cell as u64) << self.cell_bits) << self.shift
    }
}

/// Seed of the per-service rounding offset of the caps: ASCII "fulcrumC".
const CAP_SEED: u64 = 0x6675_6c63_7275_6d43;

/// Slot caps: `floor(share_i + 1/4 + r_i)` where `share_i = M x w_i / sum(w)` over the included
/// services and `r_i` in [0, 1) is fixed by the service hash, then raised by one, largest `r_i`
/// first, until the caps cover the table.
///
/// Why a per-service offset: with one cap for every equal-weight service, every cap drops by one
/// at the same moment as services are added (about every fourth service at n = 1000, fingers
/// 256), and at that moment each full service sheds a slot to some unrelated service (measured:
/// 12x the ideal movement at those counts, 3.6x between them). With the offset only about
/// `share / (N + 1)` of the services see their cap drop per added service, which is what the
/// newcomer's share needs anyway. The cap is below `share + 5/4`, so the largest share stays
/// within 1.25 slots of the mean: under 0.5% for any service count, since the mean is at least
/// `fingers` slots (fingers 256).
///
/// With a looser `max_share` than the default 1.005, each cap grows by `(max_share - 1.005) x
/// share_i` slots, which keeps the largest share at or below `max_share` at `fingers` >= 256
/// (the cap stays below `share x (max_share - 0.005) + 1.25`, and the share is at least 256
/// slots) and lets fewer services sit at their cap, so fewer slots move between existing
/// services when one is added (docs/hashing.md, "Balance against disruption").
fn caps(
    scorer: &Scorer,
    weights: &[u32],
    max_share: PracMaxShare,
    include: impl Fn(usize) -> bool,
    slots: usize,
) -> Vec<usize> {
    let total: u64 = weights
        .iter()
        .enumerate()
        .filter(|(i, _)| include(*i))
        .map(|(_, w)| u64::from((*w).max(1)))
        .sum();
    let offset = |i: usize| {
        let h = crate::hash::mix64(scorer.ids.get(i).copied().unwrap_or(0) ^ CAP_SEED);
        (h >> 11) as f64 / (1u64 << 53) as f64
    };
    let share_of = |i: usize| {
        let w = weights.get(i).copied().unwrap_or(1).max(1);
        slots as f64 * f64::from(w) / total.max(1) as f64
    };
    // A looser bound is also kept for a service whose share is small (a light weight beside
    // heavy ones): its cap never passes `max_share x share`, though never below the share
    // itself (rounded up), which the caps need to cover the table. The default adds nothing.
    let limit = |i: usize| {
        if max_share.slack() > 0.0 {
            let share = share_of(i);
            ((max_share.ratio() * share).floor() as usize).max(share.ceil() as usize)
        } else {
            usize::MAX
        }
    };
    let mut caps: Vec<usize> = weights
        .iter()
        .enumerate()
        .map(|(i, _)| {
            if !include(i) || total == 0 {
                return 0;
            }
            let share = share_of(i);
            let cap = (share + 0.25 + max_share.slack() * share + offset(i)).floor() as usize;
            cap.min(limit(i))
        })
        .collect();
    let mut order: Vec<usize> = (0..weights.len()).filter(|i| include(*i)).collect();
    order.sort_by(|a, b| offset(*b).total_cmp(&offset(*a)).then(a.cmp(b)));
    let mut sum: usize = caps.iter().sum();
    // Raised only where there is room under the limit: the limits cover the table, since
    // each is at least the share rounded up (the `raised` check only guards the loop).
    'raise: while sum < slots {
        let mut raised = false;
        for i in &order {
            if caps[*i] >= limit(*i) {
                continue;
            }
            caps[*i] += 1;
            sum += 1;
            raised = true;
            if sum >= slots {
                break 'raise;
            }
        }
        if !raised {
            break;
        }
    }
    caps
}

impl Prac {
    pub(crate) fn build(
        ids: Vec<u64>,
        weights: &[u32],
        fingers: u32,
        max_share: PracMaxShare,
        up: Vec<bool>,
    ) -> Prac {
        let n = ids.len();
        let geo = Geometry::new(fingers, n);
        let slots = geo.slots;
        let scorer = Scorer::new(ids, weights);

        let all_caps = caps(&scorer, weights, max_share, |_| true, slots);
        let mut owners = vec![0u32; slots];
        if n > 0 {
            let mut held = vec![0usize; n];
            let bids = Bids::new(&scorer.ids, weights, fingers, &geo);
            let left = bids.fill(&all_caps, &mut held, &mut owners);
            assign(
                &scorer,
                &geo,
                &left,
                &all_caps,
                &mut held,
                &|_| true,
                &mut owners,
            );
        }
        let all_up_table = Table::from_owners(&owners, small_table(n));
        Prac::derive(
            scorer,
            weights.to_vec(),
            max_share,
            geo,
            all_up_table,
            owners,
            up,
        )
    }

    /// The same selector for another UP set: the health-adjusted table is derived again from
    /// the all-UP table this one already holds (step 6), without ranking and filling the
    /// table anew. Equal to `build` with the same members and `up`.
    pub(crate) fn with_up(&self, up: Vec<bool>) -> Prac {
        let owners: Vec<u32> = (0..self.geo.slots)
            .map(|s| self.all_up_table.get(s) as u32)
            .collect();
        Prac::derive(
            self.scorer.clone(),
            self.weights.clone(),
            self.max_share,
            self.geo,
            self.all_up_table.clone(),
            owners,
            up,
        )
    }

    /// Step 6: the table for `up` from the all-UP `owners` (consumed).
    fn derive(
        scorer: Scorer,
        weights: Vec<u32>,
        max_share: PracMaxShare,
        geo: Geometry,
        all_up_table: Table,
        mut owners: Vec<u32>,
        up: Vec<bool>,
    ) -> Prac {
        let n = scorer.ids.len();
        let any_down = up.iter().any(|u| !*u);
        let any_up = up.iter().any(|u| *u);
        let table = if any_down && any_up {
            let up_caps = caps(&scorer, &weights, max_share, |i| up[i], geo.slots);
            let mut held = vec![0usize; n];
            let mut orphans = Vec::new();
            for (s, o) in owners.iter().enumerate() {
                let o = *o as usize;
                if up[o] {
                    held[o] += 1;
                } else {
                    orphans.push(s);
                }
            }
            assign(
                &scorer,
                &geo,
                &orphans,
                &up_caps,
                &mut held,
                &|i| up[i],
                &mut owners,
            );
            Table::from_owners(&owners, small_table(n))
        } else {
            all_up_table.clone()
        };

        Prac {
            scorer,
            weights,
            max_share,
            all_up: !any_down,
            up,
            geo,
            all_up_table,
            table,
        }
    }

    #[inline]
    fn slot(&self, key: u64) -> usize {
        self.geo.slot(key)
    }

    /// The key a slot is ranked by (its cell's start point).
    fn slot_key(&self, slot: usize) -> u64 {
        self.geo.cell_key(self.geo.cell_of(slot))
    }

    /// Inlined fast path (every service UP: one shift, one table read); everything else is
    /// out of line in `pick_rest`, so the common case returns its pair in registers.
    #[inline]
    pub(crate) fn pick(
        &self,
        key: u64,
        eligible: impl Fn(usize) -> bool,
    ) -> Option<(usize, usize)> {
        if self.all_up && self.scorer.len() != 0 {
            let owner = self.table.get(self.slot(key));
            if eligible(owner) {
                return Some((owner, 0));
            }
        }
        self.pick_rest(key, &eligible)
    }

    #[inline(never)]
    fn pick_rest(&self, key: u64, eligible: &dyn Fn(usize) -> bool) -> Option<(usize, usize)> {
        if self.scorer.len() == 0 {
            return None;
        }
        let slot = self.slot(key);
        let owner = self.table.get(slot);
        if self.up.get(owner).copied().unwrap_or(false) && eligible(owner) {
            if self.all_up {
                return Some((owner, 0));
            }
            let first = self.all_up_table.get(slot);
            if owner == first {
                return Some((owner, 0));
            }
            return Some((owner, self.position(slot, first, owner)));
        }
        self.ranking(key)
            .into_iter()
            .enumerate()
            .find(|&(_, i)| i != owner && self.up[i] && eligible(i))
            .map(|(pos, i)| (i, pos))
    }

    /// Position of `owner` in the slot's ranking whose head is `first`.
    fn position(&self, slot: usize, first: usize, owner: usize) -> usize {
        let k = self.slot_key(slot);
        let own = self.scorer.score(k, owner);
        1 + (0..self.scorer.len())
            .filter(|&j| {
                j != first && j != owner && Scorer::beats(self.scorer.score(k, j), j, own, owner)
            })
            .count()
    }

    pub(crate) fn ranking(&self, key: u64) -> Vec<usize> {
        if self.scorer.len() == 0 {
            return Vec::new();
        }
        let slot = self.slot(key);
        let first = self.all_up_table.get(slot);
        let mut out = Vec::with_capacity(self.scorer.len());
        out.push(first);
        out.extend(
            self.scorer
                .ranking(self.slot_key(slot))
                .into_iter()
                .filter(|i| *i != first),
        );
        out
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.all_up_table.bytes() + self.table.bytes() + self.scorer.len() * (8 + 8 + 1)
    }

    /// Fraction of the hash space each service owns in the health-adjusted table.
    pub(crate) fn shares(&self) -> Vec<f64> {
        let mut counts = vec![0u64; self.scorer.len()];
        for s in 0..self.geo.slots {
            if let Some(c) = counts.get_mut(self.table.get(s)) {
                *c += 1;
            }
        }
        counts
            .into_iter()
            .map(|c| c as f64 / self.geo.slots as f64)
            .collect()
    }
}

/// Bids per finger and unit of weight: a service places `BIDS_PER_FINGER x fingers x weight`
/// bids in the key space, about 8 per slot in all (see `Bids`).
const BIDS_PER_FINGER: u64 = 8;

/// Most bids placed (8M: about 75-80 ms of build at fingers 1024, n = 1000); beyond, every
/// service's bid count is halved until the total fits. Only when `fingers x total weight`
/// exceeds 2^20 (e.g. more than 1024 services of weight 1 at fingers 1024); the service count
/// that crosses it reshuffles the table once.
const MAX_BIDS: u64 = 1 << 23;

/// Most regions the bids are placed in (see `Bids`).
const MAX_REGIONS: u64 = 64;

/// Seed of the bid positions and scores: ASCII "fulcrumB".
const BID_SEED: u64 = 0x6675_6c63_7275_6d42;

/// The bids of every service, placed in the key space. Bid `j` of service `i` in region `r`
/// (the key space cut in `regions` equal parts) sits at
/// `r x 2^64 / regions + (h >> log2(regions))` with `h = mix64(id_i ^ mix64((r << 32 | j) ^
/// BID_SEED))` and scores `h mod 2^32`. A bid keeps its point whatever the table size and
/// whatever the other services, so adding a service adds its bids and changes no one else's:
/// a slot's first candidate changes only where the newcomer's bid beats the old best
/// (rendezvous hashing per slot, at `8 x M` hashes instead of `N x M`). Placing region by region
/// keeps the rows being written in cache.
struct Bids<'a> {
    ids: &'a [u64],
    geo: &'a Geometry,
    /// Regions and their log2.
    regions: u64,
    region_bits: u32,
    /// `per_region[i]`: bids of service i in each region.
    per_region: Vec<usize>,
}

impl<'a> Bids<'a> {
    fn new(ids: &'a [u64], weights: &[u32], fingers: u32, geo: &'a Geometry) -> Bids<'a> {
        let per_unit = BIDS_PER_FINGER * u64::from(fingers.max(1));
        let regions = (1u64 << per_unit.trailing_zeros()).min(MAX_REGIONS);
        let weight = |i: usize| u64::from(weights.get(i).copied().unwrap_or(1).max(1));
        let total: u64 = (0..ids.len()).map(|i| per_unit * weight(i)).sum();
        let mut halve = 0u32;
        while (total >> halve) > MAX_BIDS {
            halve += 1;
        }
        let per_region = (0..ids.len())
            .map(|i| ((per_unit / regions * weight(i)) >> halve).max(1) as usize)
            .collect();
        Bids {
            ids,
            geo,
            regions,
            region_bits: regions.trailing_zeros(),
            per_region,
        }
    }

    /// Calls `f(slot, bid)` for every bid, `bid = score << 32 | (service + 1)` (never 0).
    fn each(&self, mut f: impl FnMut(usize, u64)) {
        let most = self.per_region.iter().copied().max().unwrap_or(0) as u64;
        let mut keys = Vec::with_capacity(most as usize);
        for r in 0..self.regions {
            keys.clear();
            keys.extend((0..most).map(|j| crate::hash::mix64((r << 32 | j) ^ BID_SEED)));
            let base = if self.region_bits == 0 {
                0
            } else {
                r << (64 - self.region_bits)
            };
            for (i, id) in self.ids.iter().enumerate() {
                let count = self.per_region.get(i).copied().unwrap_or(0);
                for k in &keys[..count.min(keys.len())] {
                    let h = crate::hash::mix64(id ^ k);
                    f(
                        self.geo.slot(base | (h >> self.region_bits)),
                        (h << 32) | (i as u64 + 1),
                    );
                }
            }
        }
    }

    /// The capped fill, rank first: in round `r` every slot still free proposes to its `r`-th
    /// best bidder, and each service accepts its proposals by descending bid score up to its
    /// room. This is the stable matching in which a slot prefers its better bids and a service
    /// prefers slots where it ranks higher, then higher scores: a service keeps every slot it
    /// ranks first in unless those alone exceed its cap. Round 0 needs only each slot's best
    /// bid; the few slots it leaves free get their full bid lists from a second pass over the
    /// bids. Returns the slots left when their bidders are exhausted or full (ascending), for
    /// the cell walk of `assign`.
    fn fill(&self, caps: &[usize], held: &mut [usize], owners: &mut [u32]) -> Vec<usize> {
        let slots = self.geo.slots;
        let mut best = vec![0u64; slots];
        self.each(|s, bid| {
            if let Some(b) = best.get_mut(s) {
                *b = (*b).max(bid);
            }
        });
        let mut left: Vec<usize> = (0..slots).filter(|s| best[*s] == 0).collect();
        let round0 = best
            .iter()
            .enumerate()
            .filter(|(_, b)| **b != 0)
            .map(|(s, b)| (*b, s as u32));
        let rejected = accept(round0, caps, held, owners);
        if rejected.is_empty() {
            return left;
        }
        // Full bid lists of the slots round 0 left free, best first.
        let mut wanted = vec![false; slots];
        for s in &rejected {
            wanted[*s as usize] = true;
        }
        let mut deep: Vec<(u32, u64)> = Vec::new();
        self.each(|s, bid| {
            if wanted.get(s).copied().unwrap_or(false) {
                deep.push((s as u32, bid));
            }
        });
        deep.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        // Per free slot: (slot, next index into `deep`, end of its list).
        let mut free: Vec<(u32, usize, usize)> = Vec::with_capacity(rejected.len());
        let mut at = 0usize;
        while at < deep.len() {
            let slot = deep[at].0;
            let end = at + deep[at..].iter().take_while(|d| d.0 == slot).count();
            free.push((slot, at + 1, end));
            at = end;
        }
        while !free.is_empty() {
            left.extend(free.iter().filter(|f| f.1 >= f.2).map(|f| f.0 as usize));
            free.retain(|f| f.1 < f.2);
            let rejected = accept(
                free.iter().map(|(slot, at, _)| (deep[*at].1, *slot)),
                caps,
                held,
                owners,
            );
            // Still free after this round: the slots rejected in it.
            for f in &free {
                wanted[f.0 as usize] = false;
            }
            for s in &rejected {
                wanted[*s as usize] = true;
            }
            free.retain(|f| wanted[f.0 as usize]);
            free.iter_mut().for_each(|f| f.1 += 1);
        }
        left.sort_unstable();
        left
    }
}

/// One round of the rank-first fill: a proposal `(bid, slot)` goes to the bid's service, which
/// accepts its best ones (by descending score, then higher slot) up to its room
/// `caps[i] - held[i]`. Returns the rejected slots.
fn accept(
    proposals: impl Iterator<Item = (u64, u32)> + Clone,
    caps: &[usize],
    held: &mut [usize],
    owners: &mut [u32],
) -> Vec<u32> {
    let n = held.len();
    // Bids carry `service + 1` in their low half; anything else is dropped (never happens).
    let service = |bid: u64| {
        let i = ((bid & 0xffff_ffff) as usize).wrapping_sub(1);
        (i < n).then_some(i)
    };
    // Counting sort by service; an entry is `score << 32 | slot`.
    let mut start = vec![0usize; n + 1];
    for i in proposals.clone().filter_map(|(bid, _)| service(bid)) {
        start[i + 1] += 1;
    }
    for i in 0..n {
        start[i + 1] += start[i];
    }
    let mut next = start.clone();
    let mut by_service = vec![0u64; start[n]];
    for (bid, slot) in proposals {
        if let Some(i) = service(bid) {
            by_service[next[i]] = (bid & !0xffff_ffff) | u64::from(slot);
            next[i] += 1;
        }
    }
    let mut rejected = Vec::new();
    for i in 0..n {
        let group = &mut by_service[start[i]..start[i + 1]];
        let room = caps.get(i).copied().unwrap_or(0).saturating_sub(held[i]);
        if group.len() > room {
            if room > 0 {
                group.select_nth_unstable_by(room - 1, |a, b| b.cmp(a));
            }
            rejected.extend(group[room..].iter().map(|e| *e as u32));
        }
        let take = room.min(group.len());
        for e in &group[..take] {
            owners[(*e & 0xffff_ffff) as usize] = i as u32;
        }
        held[i] += take;
    }
    rejected
}

/// Candidates kept per cell before falling back to a full pass over the services.
const CELL_CANDIDATES: usize = 8;

/// The best `k` services (passing `filter`) for one cell key ranked strictly after `after`,
/// best first.
fn top_k(
    scorer: &Scorer,
    key: u64,
    k: usize,
    after: Option<(Score, usize)>,
    filter: &dyn Fn(usize) -> bool,
) -> Vec<(Score, usize)> {
    let below = |s: Score, i: usize| after.is_none_or(|(a, ai)| Scorer::beats(a, ai, s, i));
    let n = scorer.len();
    let mut top: Vec<(Score, usize)> = Vec::new();
    if scorer.is_uniform() {
        // Combined values are uniform on [0, ceiling]: a window just below the ceiling holds
        // about `want` of them, so one pass collects a few more than k without sorting N values;
        // widen and retry in the rare case it held too few. Collected as (u64, u32) to keep the
        // sort small.
        let ceiling = after.map_or(u64::MAX, |(a, _)| a as u64);
        let mut want = (2 * k).max(8) as f64;
        let mut found: Vec<(u64, u32)> = Vec::with_capacity(4 * k);
        loop {
            let span = (want / n.max(1) as f64 * 18_446_744_073_709_551_616.0).min(u64::MAX as f64);
            let floor = ceiling.saturating_sub(span as u64);
            found.clear();
            for (i, id) in scorer.ids.iter().enumerate() {
                let c = crate::hash::carp_combine(key, *id);
                if c < floor || c > ceiling {
                    continue;
                }
                if below(Score::from(c), i) && filter(i) {
                    found.push((c, i as u32));
                }
            }
            if found.len() >= k || floor == 0 {
                break;
            }
            want *= 4.0;
        }
        found.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        found.truncate(k);
        return found
            .into_iter()
            .map(|(c, i)| (Score::from(c), i as usize))
            .collect();
    } else {
        for i in 0..n {
            let s = scorer.score(key, i);
            if below(s, i) && filter(i) {
                top.push((s, i));
            }
        }
    }
    top.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    top.truncate(k);
    top
}

/// Hands `slots` (ascending) out to services: candidate pairs (cell, service) from each cell's
/// top `CELL_CANDIDATES` services (those passing `allowed` with a non-zero cap) are taken in
/// descending score order, each giving the cell's remaining slots (lowest slot first) to the
/// service up to its room `caps[i] - held[i]`. Slots left when every candidate of their cell is
/// full walk further down the cell's ranking to the first service with room. Writes the result
/// into `owners`; deterministic and independent of memory layout.
fn assign(
    scorer: &Scorer,
    geo: &Geometry,
    slots: &[usize],
    caps: &[usize],
    held: &mut [usize],
    allowed: &dyn Fn(usize) -> bool,
    owners: &mut [u32],
) {
    let usable = |i: usize| allowed(i) && caps.get(i).copied().unwrap_or(0) > 0;
    let room = |held: &[usize], i: usize| caps[i].saturating_sub(held[i]);
    // Runs of consecutive `slots` in one cell: (cell, next unassigned index, end index).
    let mut groups: Vec<(usize, usize, usize)> = Vec::new();
    for (p, slot) in slots.iter().enumerate() {
        let cell = geo.cell_of(*slot);
        match groups.last_mut() {
            Some(g) if g.0 == cell => g.2 = p + 1,
            _ => groups.push((cell, p, p + 1)),
        }
    }
    let mut lists: Vec<Vec<(Score, usize)>> = Vec::with_capacity(groups.len());
    let mut pairs: Vec<(Score, u32, u32)> = Vec::with_capacity(groups.len() * CELL_CANDIDATES);
    for (g, (cell, _, _)) in groups.iter().enumerate() {
        let list = top_k(scorer, geo.cell_key(*cell), CELL_CANDIDATES, None, &usable);
        pairs.extend(list.iter().map(|(sc, i)| (*sc, g as u32, *i as u32)));
        lists.push(list);
    }
    // Descending score; equal scores follow the ranking tie-break (lower service), then cell.
    pairs.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.2.cmp(&b.2)).then(a.1.cmp(&b.1)));
    for (_, g, svc) in pairs {
        let (svc, g) = (svc as usize, g as usize);
        let Some(group) = groups.get_mut(g) else {
            continue;
        };
        let take = room(held, svc).min(group.2 - group.1);
        for p in group.1..group.1 + take {
            if let Some(o) = slots.get(p).and_then(|s| owners.get_mut(*s)) {
                *o = svc as u32;
            }
        }
        held[svc] += take;
        group.1 += take;
    }
    for (g, group) in groups.iter_mut().enumerate() {
        if group.1 == group.2 {
            continue;
        }
        let key = geo.cell_key(group.0);
        let list = &mut lists[g];
        let mut at = 0usize;
        while group.1 < group.2 {
            if at >= list.len() {
                let more = top_k(scorer, key, CELL_CANDIDATES, list.last().copied(), &usable);
                if more.is_empty() {
                    // Only when no allowed service has room: these slots keep their old owner.
                    break;
                }
                list.extend(more);
            }
            let svc = list[at].1;
            at += 1;
            let take = room(held, svc).min(group.2 - group.1);
            for p in group.1..group.1 + take {
                if let Some(o) = slots.get(p).and_then(|s| owners.get_mut(*s)) {
                    *o = svc as u32;
                }
            }
            held[svc] += take;
            group.1 += take;
        }
    }
}
