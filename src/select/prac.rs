//! `prac`: a CARP-ranked slot table with capped shares and O(1) lookups. PURE.
//!
//! Construction:
//! 1. Table size `M = 2^b`, the smallest power of two >= `fingers x services` (at least 2, at
//!    most 2^26). A key lands in slot `key_hash >> (64 - b)`. A power of two (rather than a prime
//!    with a modulo) keeps the key-to-slot map unchanged when a service is added without crossing a
//!    power of two, so a config change re-ranks nothing it does not have to; when `M` doubles, slot
//!    `s` splits into `2s` and `2s+1`, and `2s` keeps `s`'s ranking because a slot is ranked by its
//!    start point `s << (64 - b)`.
//! 2. Each slot ranks every service by the carp score of its start point (`carp` module, weights
//!    included).
//! 3. The all-UP table hands slots out in descending score order, each service capped at
//!    `ceil(M x w_i / sum(w))` slots (its weighted share, +1 at most). This is computed as
//!    slot-proposing deferred acceptance, whose result is the same unique matching as a global
//!    descending-score greedy, independent of processing order.
//! 4. The health-adjusted table is derived from the all-UP table: slots of UP services stay where
//!    they are; the slots of DOWN services go, again by deferred acceptance, to their next-ranked
//!    UP service that has room under the caps recomputed for the UP set. So a service going DOWN
//!    moves only its own keys, and its return restores the all-UP table exactly.
//!
//! Caveat (issue 3): because of the caps, a slot's owner is not always the first UP service in
//! the slot's ranking: a next-ranked service already at its capped share is passed over. The
//! ranking reported for a key is the all-UP owner first, then the remaining services in carp
//! order of the slot.
//!
//! Lookup: one shift and one table read, plus an UP check.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::carp::{Score, Scorer};

/// Largest table exponent: 2^26 slots (128 MiB of u16 entries at most) bounds memory whatever
/// `fingers x services` asks for.
const MAX_BITS: u32 = 26;

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
    shift: u32,
    slots: usize,
    all_up_table: Table,
    table: Table,
}

/// Table exponent for a service count and finger count.
pub(crate) fn table_bits(fingers: u32, services: usize) -> u32 {
    let want = u64::from(fingers.max(1)).saturating_mul(services.max(1) as u64);
    let bits = 64 - want.saturating_sub(1).leading_zeros();
    bits.clamp(1, MAX_BITS)
}

fn caps(weights: &[u32], include: impl Fn(usize) -> bool, slots: usize) -> Vec<usize> {
    let total: u64 = weights
        .iter()
        .enumerate()
        .filter(|(i, _)| include(*i))
        .map(|(_, w)| u64::from((*w).max(1)))
        .sum();
    weights
        .iter()
        .enumerate()
        .map(|(i, w)| {
            if !include(i) || total == 0 {
                0
            } else {
                let num = (slots as u64) * u64::from((*w).max(1));
                num.div_ceil(total) as usize
            }
        })
        .collect()
}

impl Prac {
    pub(crate) fn build(ids: Vec<u64>, weights: &[u32], fingers: u32, up: Vec<bool>) -> Prac {
        let n = ids.len();
        let bits = table_bits(fingers, n);
        let slots = 1usize << bits;
        let shift = 64 - bits;
        let scorer = Scorer::new(ids, weights);
        let small = n <= usize::from(u16::MAX) + 1;

        let all_caps = caps(weights, |_| true, slots);
        let mut owners = vec![0u32; slots];
        if n > 0 {
            let all: Vec<usize> = (0..slots).collect();
            let mut held = vec![0usize; n];
            assign(
                &scorer,
                shift,
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
            let up_caps = caps(weights, |i| up[i], slots);
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
                shift,
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
            up,
            shift,
            slots,
            all_up_table,
            table,
        }
    }

    #[inline]
    fn slot(&self, key: u64) -> usize {
        (key >> self.shift) as usize
    }

    #[inline]
    fn slot_key(&self, slot: usize) -> u64 {
        (slot as u64) << self.shift
    }

    pub(crate) fn pick(
        &self,
        key: u64,
        eligible: impl Fn(usize) -> bool,
    ) -> Option<(usize, usize)> {
        if self.scorer.len() == 0 {
            return None;
        }
        let slot = self.slot(key);
        let owner = self.table.get(slot);
        if self.up.get(owner).copied().unwrap_or(false) && eligible(owner) {
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
        for s in 0..self.slots {
            if let Some(c) = counts.get_mut(self.table.get(s)) {
                *c += 1;
            }
        }
        counts
            .into_iter()
            .map(|c| c as f64 / self.slots as f64)
            .collect()
    }
}

/// Slot-proposing deferred acceptance: each slot in `slots` proposes to services in its carp
/// order (only those passing `allowed`); a service holds at most `caps[i] - held[i]` proposals
/// and keeps the highest-scoring ones. Writes the result into `owners`.
fn assign(
    scorer: &Scorer,
    shift: u32,
    slots: &[usize],
    caps: &[usize],
    held: &mut [usize],
    allowed: &dyn Fn(usize) -> bool,
    owners: &mut [u32],
) {
    let n = scorer.len();
    // Per service, the proposals it holds: min-heap on (score, slot) so the weakest is evicted.
    let mut holding: Vec<BinaryHeap<Reverse<(Score, usize)>>> = vec![BinaryHeap::new(); n];
    // Last service each proposing slot went to, so the next proposal continues down its ranking.
    let mut last: Vec<Option<(Score, usize)>> = vec![None; slots.len()];
    let mut free: Vec<usize> = (0..slots.len()).rev().collect();
    while let Some(p) = free.pop() {
        let Some(slot) = slots.get(p).copied() else {
            continue;
        };
        let key = (slot as u64) << shift;
        let Some((score, svc)) = scorer.best_after(key, last[p], |i| {
            allowed(i) && caps.get(i).copied().unwrap_or(0) > 0
        }) else {
            // Only when no allowed service has any capacity; the slot keeps its old owner.
            continue;
        };
        last[p] = Some((score, svc));
        let room = caps[svc].saturating_sub(held[svc]);
        let heap = &mut holding[svc];
        if heap.len() < room {
            heap.push(Reverse((score, p)));
            continue;
        }
        match heap.peek() {
            Some(Reverse((ws, wp))) if (score, p) > (*ws, *wp) => {
                let loser = *wp;
                heap.pop();
                heap.push(Reverse((score, p)));
                free.push(loser);
            }
            _ => free.push(p),
        }
    }
    for (svc, heap) in holding.into_iter().enumerate() {
        for Reverse((_, p)) in heap {
            if let Some(slot) = slots.get(p) {
                owners[*slot] = svc as u32;
            }
        }
    }
}
