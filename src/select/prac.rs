//! `prac`: a CARP-ranked slot table with capped shares and O(1) lookups. PURE.
//!
//! Construction (also in `docs/hashing.md`):
//! 1. Table size `M = 2^b`, the smallest power of two >= `fingers x services` (at least 2, at
//!    most 2^22). A key lands in slot `key_hash >> (64 - b)`. A power of two (rather than a prime
//!    with a modulo) keeps the key-to-slot map unchanged when a service is added without crossing
//!    a power of two, so a config change re-ranks nothing it does not have to.
//! 2. Slots are grouped in cells of `next_pow2(fingers) / 8` slots; each cell ranks every service
//!    by the carp score (`carp` module, weights included) of its start point, so that when `M`
//!    doubles, cell `2c` keeps old cell `c`'s ranking. Ranking about `8 x N` cells rather than
//!    `M` slots is what keeps the build near 35 ms at n = 1000 (ranking every slot took 1 s);
//!    the caps still balance at slot resolution.
//! 3. Caps: `floor(share_i + 1/4 + r_i)` slots with `r_i` in [0, 1) fixed by the service hash
//!    (see `caps` for why), raised where needed to cover `M`.
//! 4. The all-UP table hands slots out in descending score order: candidate pairs (cell, service)
//!    from each cell's top `CELL_CANDIDATES` (8) services, best score first, each filling the cell's
//!    remaining slots up to the service's cap; slots whose candidates are all full walk further
//!    down their cell's ranking to the first service with room.
//! 5. The health-adjusted table is derived from the all-UP table: slots of UP services stay where
//!    they are; the slots of DOWN services are handed out the same way among UP services, with
//!    caps recomputed for the UP set (never below the all-UP caps). So a service going DOWN moves
//!    only its own keys, and its return restores the all-UP table exactly.
//!
//! Caveat (issue 3): because of the caps, a slot's owner is not always the first UP service in
//! its ranking: a next-ranked service already at its capped share is passed over. And adding a
//! service to the config moves some slots between existing services (the services that lose a
//! slot to the newcomer take back slots they had overflowed to others, which cascades); health
//! changes never do. The ranking reported for a key is the all-UP owner first, then the
//! remaining services in the carp order of its cell.
//!
//! Lookup: one shift and one table read, plus an UP check.

use super::carp::{Score, Scorer};

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
pub struct Prac {
    scorer: Scorer,
    up: Vec<bool>,
    /// Every service UP: the table is the all-UP table, every hit is a first choice.
    all_up: bool,
    geo: Geometry,
    all_up_table: Table,
    table: Table,
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
fn caps(
    scorer: &Scorer,
    weights: &[u32],
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
    let mut caps: Vec<usize> = weights
        .iter()
        .enumerate()
        .map(|(i, w)| {
            if !include(i) || total == 0 {
                return 0;
            }
            let share = slots as f64 * f64::from((*w).max(1)) / total as f64;
            (share + 0.25 + offset(i)).floor() as usize
        })
        .collect();
    let mut order: Vec<usize> = (0..weights.len()).filter(|i| include(*i)).collect();
    order.sort_by(|a, b| offset(*b).total_cmp(&offset(*a)).then(a.cmp(b)));
    let mut sum: usize = caps.iter().sum();
    'raise: while sum < slots && !order.is_empty() {
        for i in &order {
            caps[*i] += 1;
            sum += 1;
            if sum >= slots {
                break 'raise;
            }
        }
    }
    caps
}

impl Prac {
    pub(crate) fn build(ids: Vec<u64>, weights: &[u32], fingers: u32, up: Vec<bool>) -> Prac {
        let n = ids.len();
        let geo = Geometry::new(fingers, n);
        let slots = geo.slots;
        let scorer = Scorer::new(ids, weights);
        let small = n <= usize::from(u16::MAX) + 1;

        let all_caps = caps(&scorer, weights, |_| true, slots);
        let mut owners = vec![0u32; slots];
        if n > 0 {
            let all: Vec<usize> = (0..slots).collect();
            let mut held = vec![0usize; n];
            assign(
                &scorer,
                &geo,
                &all,
                &all_caps,
                &mut held,
                &|_| true,
                &mut owners,
            );
        }
        let all_up_table = Table::from_owners(&owners, small);

        let any_down = up.iter().any(|u| !*u);
        let any_up = up.iter().any(|u| *u);
        let table = if any_down && any_up {
            let up_caps = caps(&scorer, weights, |i| up[i], slots);
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
            Table::from_owners(&owners, small)
        } else {
            all_up_table.clone()
        };

        Prac {
            scorer,
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
