//! `jarh`: a ring hash with `fingers x weight` points per service and a jump-table-assisted
//! lookup. PURE.
//!
//! Construction: the ring is the 32-bit circle. Service i places `fingers x w_i` points at
//! `finger_hash(s_i, j) >> 32` (`crate::hash`), j = 0, 1, ...; a key hash `k` sits at `k >> 32`.
//! Points are ordered by (position, high half of the service hash, config index), so that
//! coincident points (about one per 2^32 / points) have an order that does not depend on the
//! config order. A key belongs to the point nearest to it (ties: the counter-clockwise one), that
//! is, to the first cell end at or after it, where point i's cell ends at the midpoint between it
//! and the next point ([`cells`]). A service's share is then half the gaps on both sides of its
//! points instead of the gap before each one, which halves the variance of the share (peak/mean
//! at n = 1000, fingers 1024: 1.07 instead of 1.13); choosing among candidate positions with the
//! service's own data does not help, because the gaps depend on the other services' points
//! (`docs/hashing.md`). A point's position depends only on its own service's hash, so adding a
//! service moves keys only to it (a key's nearest point is either unchanged or a new one), and
//! removing one moves only the keys of its cells. The ranking of a key is the distinct owners of
//! the cells met walking clockwise from its own, so a DOWN service's keys go to the next UP
//! service and come back exactly when it returns.
//!
//! Jump assist (how a lookup finds that cell in O(1); it decides nothing; below, "point" means a
//! cell end): the circle is cut into `S = 5 x points` equal slots. One 32 x 32-bit multiply
//! `(k >> 32) x S` gives the slot (high half) and the key's offset inside it (low half,
//! monotone); with `S >= 2^17` the top 15 bits of the offset still tell any two 32-bit positions
//! of one slot apart, so they compare exactly.
//! Each slot has one 32-bit entry:
//! - no point in the slot: the owner of the next point after it;
//! - one point: that point's 15-bit offset and its owner; a key at or below the offset belongs to
//!   it, a key above it to the next slot's entry owner (the first point after this slot). Both
//!   entries are adjacent, and the choice is a conditional move, not a branch;
//! - two or more points (a flag bit; about 1.8% of the slots at 5 slots per point): an index into
//!   a side list of the slot's (offset, owner) pairs, ended by the next slot's owner, scanned in
//!   order.
//!
//! So about 97% of lookups read two adjacent entries and end. The slot table and the side list
//! hold the whole ring (no separate point array), which keeps memory at about 21 bytes per point.
//! Entries are 64-bit (31-bit offsets, 32-bit owners) when there are more than 65,536 services or
//! fewer than 2^17 slots.
//!
//! Bounds: the total number of points is capped at 2^22; when `fingers x sum(weights)` is larger,
//! every service's count is scaled down in proportion (at least one point each). Config limits
//! (fingers <= 1024) reach the cap only with large weights and hundreds of services.

use super::words::{Word, Words};
use crate::hash::finger_hash;

/// Most ring points kept, whatever the config asks for.
const MAX_POINTS: u64 = 1 << 22;

/// Slots per point.
const SLOTS_PER_POINT: u64 = 5;

/// Side-list terminator offset: above every real offset.
const END: u32 = u32::MAX;

/// One slot entry: either plain (offset of the slot's only point, or all ones when it has none,
/// and an owner) or multi (an index into the side list).
trait Entry: Word + std::fmt::Debug {
    /// Bits of a stored offset; the offset inside a slot is shifted right by `32 - OFFSET_BITS`.
    const OFFSET_BITS: u32;
    /// Fewest slots for which that shift keeps offsets exact.
    const MIN_SLOTS: u64 = 1 << (32 - Self::OFFSET_BITS);
    /// Offset value of a slot with no point.
    const EMPTY: u64 = (1 << Self::OFFSET_BITS) - 1;
    fn plain(offset: u64, owner: u32) -> Self;
    fn multi(index: usize) -> Self;
    fn is_multi(self) -> bool;
    fn offset(self) -> u64;
    fn owner(self) -> usize;
    fn index(self) -> usize;
}

impl Entry for u32 {
    const OFFSET_BITS: u32 = 15;
    fn plain(offset: u64, owner: u32) -> u32 {
        ((offset as u32 & 0x7fff) << 16) | (owner & 0xffff)
    }
    fn multi(index: usize) -> u32 {
        (1 << 31) | (index as u32 & 0x7fff_ffff)
    }
    #[inline]
    fn is_multi(self) -> bool {
        self >> 31 != 0
    }
    #[inline]
    fn offset(self) -> u64 {
        u64::from((self >> 16) & 0x7fff)
    }
    #[inline]
    fn owner(self) -> usize {
        (self & 0xffff) as usize
    }
    #[inline]
    fn index(self) -> usize {
        (self & 0x7fff_ffff) as usize
    }
}

impl Entry for u64 {
    const OFFSET_BITS: u32 = 31;
    fn plain(offset: u64, owner: u32) -> u64 {
        ((offset & 0x7fff_ffff) << 32) | u64::from(owner)
    }
    fn multi(index: usize) -> u64 {
        (1 << 63) | (index as u64 & 0x7fff_ffff_ffff_ffff)
    }
    #[inline]
    fn is_multi(self) -> bool {
        self >> 63 != 0
    }
    #[inline]
    fn offset(self) -> u64 {
        (self >> 32) & 0x7fff_ffff
    }
    #[inline]
    fn owner(self) -> usize {
        (self & 0xffff_ffff) as usize
    }
    #[inline]
    fn index(self) -> usize {
        (self & 0x7fff_ffff_ffff_ffff) as usize
    }
}

/// Slot entries (`S + 1`: the last one stands for slot 0's start, for the wrap) and the side list
/// of the multi-point slots.
#[derive(Debug, Clone)]
struct Table<E: Entry> {
    entries: Words<E>,
    /// (offset, owner) of the points of each multi slot in ring order, then (`END`, owner of the
    /// first point after the slot).
    side: Vec<(u32, u32)>,
}

#[derive(Debug, Clone)]
enum Slots {
    Narrow(Table<u32>),
    Wide(Table<u64>),
}

/// The jarh selector.
#[derive(Debug, Clone)]
pub(crate) struct Jarh {
    /// Number of slots `S`.
    slot_count: u64,
    slots: Slots,
    /// Number of points on the ring.
    points: usize,
    up: Vec<bool>,
    all_up: bool,
    services: usize,
}

/// Slot of a 32-bit ring position and its offset inside the slot.
#[inline]
fn slot_of(pos: u32, slot_count: u64) -> (usize, u64) {
    let prod = u64::from(pos) * slot_count;
    ((prod >> 32) as usize, prod & 0xffff_ffff)
}

/// The ring position of the point stored at (slot, stored offset): the one 32-bit position whose
/// offset shifted right gives `offset` (exact because `S >= E::MIN_SLOTS`).
fn position_of<E: Entry>(slot: usize, offset: u64, slot_count: u64) -> u32 {
    let scaled = (u128::from(slot as u64) << 32) + (u128::from(offset) << (32 - E::OFFSET_BITS));
    scaled.div_ceil(u128::from(slot_count)) as u32
}

/// Sorts points (position, owner), generated in ring tie order (see `Jarh::build`), by position,
/// keeping that order among equal positions: a least-significant-digit radix sort in three stable
/// passes of 11, 11 and 10 bits. Linear time, a few milliseconds for a million points.
fn sort_points(pts: Vec<(u32, u32)>) -> Vec<(u32, u32)> {
    let mut src = pts;
    let mut dst = vec![(0u32, 0u32); src.len()];
    for (shift, bits) in [(0u32, 11u32), (11, 11), (22, 10)] {
        let mask = (1usize << bits) - 1;
        let digit = |p: u32| (p >> shift) as usize & mask;
        let mut next = vec![0usize; mask + 2];
        for (p, _) in &src {
            next[digit(*p) + 1] += 1;
        }
        for d in 0..=mask {
            next[d + 1] += next[d];
        }
        for p in &src {
            let d = digit(p.0);
            dst[next[d]] = *p;
            next[d] += 1;
        }
        std::mem::swap(&mut src, &mut dst);
    }
    src
}

/// The cells of points in ring order: point i owns the keys nearer to it than to its neighbours
/// (ties: to the counter-clockwise point), i.e. the arc up to and including the midpoint
/// `p_i + (p_{i+1} - p_i) / 2` (wrapping, rounded down) after the previous point's midpoint.
/// Returns the (midpoint, owner) of every cell in ring order: a key belongs to the first midpoint
/// at or after it, the same successor rule as a plain ring, so the table and the walk are shared.
fn cells(pts: Vec<(u32, u32)>) -> Vec<(u32, u32)> {
    let mut pts = pts;
    let len = pts.len();
    let (Some(first), Some(last)) = (pts.first().map(|p| p.0), pts.last().map(|p| p.0)) else {
        return pts;
    };
    for i in 0..len {
        let p = pts[i].0;
        let next = pts.get(i + 1).map_or(first, |n| n.0);
        pts[i].0 = p.wrapping_add(next.wrapping_sub(p) / 2);
    }
    // The last cell's midpoint wraps past zero when the gap to the first point does: then it
    // comes first in ring order.
    if pts.last().is_some_and(|m| m.0 < last) {
        pts.rotate_right(1);
    }
    pts
}

fn build_table<E: Entry>(pts: &[(u32, u32)], slot_count: u64) -> Table<E> {
    let s_total = slot_count as usize;
    let shift = 32 - E::OFFSET_BITS;
    let len = pts.len();
    let first_owner = pts.first().map_or(0, |p| p.1);
    // Slots with no point get the owner of the next point: filled a run at a time.
    let mut entries: Vec<E> = vec![E::plain(E::EMPTY, first_owner); s_total + 1];
    let mut side: Vec<(u32, u32)> = Vec::new();
    let mut filled = 0usize;
    let mut p = 0usize;
    while p < len {
        let (s, off) = slot_of(pts[p].0, slot_count);
        let mut q = p + 1;
        while q < len && slot_of(pts[q].0, slot_count).0 == s {
            q += 1;
        }
        let owner = pts[p].1;
        if let Some(run) = entries.get_mut(filled..s) {
            run.fill(E::plain(E::EMPTY, owner));
        }
        let offset = off >> shift;
        let entry = if q - p == 1 && offset != E::EMPTY {
            E::plain(offset, owner)
        } else {
            let e = E::multi(side.len());
            side.extend(
                pts[p..q]
                    .iter()
                    .map(|(pos, o)| ((slot_of(*pos, slot_count).1 >> shift) as u32, *o)),
            );
            side.push((END, pts.get(q).map_or(first_owner, |n| n.1)));
            e
        };
        if let Some(slot) = entries.get_mut(s) {
            *slot = entry;
        }
        filled = s + 1;
        p = q;
    }
    // Slots after the last point, and the wrap entry, keep the first point's owner.
    Table {
        entries: Words::new(entries),
        side,
    }
}

impl<E: Entry> Table<E> {
    /// Owner of the first point at or after ring position `k32`.
    #[inline]
    fn first_owner(&self, k32: u32, slot_count: u64) -> usize {
        let (s, off) = slot_of(k32, slot_count);
        let kt = off >> (32 - E::OFFSET_BITS);
        let Some((e, n)) = self.entries.get2(s) else {
            return 0;
        };
        let below = kt <= e.offset();
        if !e.is_multi() && (below || !n.is_multi()) {
            return if below { e.owner() } else { n.owner() };
        }
        self.first_owner_slow(e, n, kt)
    }

    #[cold]
    fn first_owner_slow(&self, e: E, n: E, kt: u64) -> usize {
        if e.is_multi() {
            let mut i = e.index();
            while let Some((off, owner)) = self.side.get(i) {
                if u64::from(*off) >= kt {
                    return *owner as usize;
                }
                i += 1;
            }
            0
        } else {
            // Above the slot's point, and the next slot is multi: its first point.
            self.side.get(n.index()).map_or(0, |(_, o)| *o as usize)
        }
    }

    /// Calls `f(stored offset, owner)` for every point of slot `s` in ring order.
    fn each_in_slot(&self, s: usize, mut f: impl FnMut(u64, usize)) {
        let Some(e) = self.entries.get(s) else {
            return;
        };
        if e.is_multi() {
            for (off, owner) in self.side.iter().skip(e.index()) {
                if *off == END {
                    break;
                }
                f(u64::from(*off), *owner as usize);
            }
        } else if e.offset() != E::EMPTY {
            f(e.offset(), e.owner());
        }
    }

    /// Owners of the points clockwise from ring position `k32` (its own point first), once round
    /// the ring, until `f` returns true. Stored offsets compare exactly with the key's, so no
    /// position is reconstructed.
    fn walk(&self, k32: u32, slot_count: u64, mut f: impl FnMut(usize) -> bool) {
        let (s0, off) = slot_of(k32, slot_count);
        let kt = off >> (32 - E::OFFSET_BITS);
        let total = slot_count as usize;
        let mut done = false;
        for step in 0..=total {
            let s = (s0 + step) % total;
            self.each_in_slot(s, |offset, owner| {
                let in_range = if step == 0 {
                    offset >= kt
                } else if step == total {
                    offset < kt
                } else {
                    true
                };
                if !done && in_range {
                    done = f(owner);
                }
            });
            if done {
                return;
            }
        }
    }

    /// Every point (position, owner), ascending.
    fn points(&self, slot_count: u64) -> Vec<(u32, usize)> {
        let mut out = Vec::new();
        for s in 0..slot_count as usize {
            self.each_in_slot(s, |off, o| {
                out.push((position_of::<E>(s, off, slot_count), o))
            });
        }
        out
    }

    fn bytes(&self) -> usize {
        self.entries.len() * std::mem::size_of::<E>() + self.side.len() * 8
    }
}

impl Jarh {
    pub(crate) fn build(ids: &[u64], weights: &[u32], fingers: u32, up: Vec<bool>) -> Jarh {
        let fingers = u64::from(fingers.max(1));
        let total: u64 = weights
            .iter()
            .map(|w| fingers.saturating_mul(u64::from((*w).max(1))))
            .fold(0u64, u64::saturating_add);
        // Services in tie order (high half of the service hash, then config index), so that
        // the stable sort leaves coincident points in an order that does not depend on the
        // config order.
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|i| (ids[*i] >> 32, *i));
        let counts: Vec<u32> = (0..ids.len())
            .map(|i| {
                let w = u64::from(weights.get(i).copied().unwrap_or(1).max(1));
                let mut count = fingers.saturating_mul(w);
                if total > MAX_POINTS {
                    count = ((count as u128 * MAX_POINTS as u128) / total as u128).max(1) as u64;
                }
                u32::try_from(count).unwrap_or(u32::MAX)
            })
            .collect();
        let mut pts: Vec<(u32, u32)> = Vec::with_capacity(counts.iter().map(|c| *c as usize).sum());
        for i in order {
            let id = ids[i];
            pts.extend((0..counts[i]).map(|j| ((finger_hash(id, j) >> 32) as u32, i as u32)));
        }
        let cells = cells(sort_points(pts));
        Jarh::from_cells(&cells, up, ids.len())
    }

    /// From the cell ends (position, owner) in ring order.
    fn from_cells(pts: &[(u32, u32)], up: Vec<bool>, services: usize) -> Jarh {
        let wanted = (pts.len() as u64 * SLOTS_PER_POINT).clamp(<u64 as Entry>::MIN_SLOTS, 1 << 31);
        let (slot_count, slots) = if services <= 1 << 16 && wanted >= <u32 as Entry>::MIN_SLOTS {
            (wanted, Slots::Narrow(build_table(pts, wanted)))
        } else {
            (wanted, Slots::Wide(build_table(pts, wanted)))
        };
        let all_up = up.iter().all(|u| *u);
        Jarh {
            slot_count,
            slots,
            points: pts.len(),
            up,
            all_up,
            services,
        }
    }

    /// Owner of `key`'s point.
    #[inline]
    fn first_owner(&self, key: u64) -> usize {
        let k32 = (key >> 32) as u32;
        match &self.slots {
            Slots::Narrow(t) => t.first_owner(k32, self.slot_count),
            Slots::Wide(t) => t.first_owner(k32, self.slot_count),
        }
    }

    /// Owners clockwise from `key`'s point until `f` returns true.
    fn walk(&self, key: u64, f: impl FnMut(usize) -> bool) {
        let k32 = (key >> 32) as u32;
        match &self.slots {
            Slots::Narrow(t) => t.walk(k32, self.slot_count, f),
            Slots::Wide(t) => t.walk(k32, self.slot_count, f),
        }
    }

    fn points(&self) -> Vec<(u32, usize)> {
        match &self.slots {
            Slots::Narrow(t) => t.points(self.slot_count),
            Slots::Wide(t) => t.points(self.slot_count),
        }
    }

    /// Inlined fast path (the key's own point is UP); the failover walk is out of line in
    /// `pick_rest`, so the common case returns its pair in registers.
    #[inline]
    pub(crate) fn pick(
        &self,
        key: u64,
        eligible: impl Fn(usize) -> bool,
    ) -> Option<(usize, usize)> {
        if self.points == 0 {
            return None;
        }
        let first = self.first_owner(key);
        if (self.all_up || self.up.get(first).copied().unwrap_or(false)) && eligible(first) {
            return Some((first, 0));
        }
        self.pick_rest(key, &eligible)
    }

    #[inline(never)]
    fn pick_rest(&self, key: u64, eligible: &dyn Fn(usize) -> bool) -> Option<(usize, usize)> {
        // Failover walk: distinct owners clockwise. Off the hot path, so a seen-list is fine.
        let mut seen = vec![false; self.services];
        let mut position = 0usize;
        let mut found = None;
        self.walk(key, |o| {
            if seen.get(o).copied().unwrap_or(true) {
                return false;
            }
            seen[o] = true;
            if self.up.get(o).copied().unwrap_or(false) && eligible(o) {
                found = Some((o, position));
                return true;
            }
            position += 1;
            position == self.services
        });
        found
    }

    pub(crate) fn ranking(&self, key: u64) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.services);
        if self.points == 0 {
            return out;
        }
        let mut seen = vec![false; self.services];
        self.walk(key, |o| {
            if !seen.get(o).copied().unwrap_or(true) {
                seen[o] = true;
                out.push(o);
            }
            out.len() == self.services
        });
        out
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        let table = match &self.slots {
            Slots::Narrow(t) => t.bytes(),
            Slots::Wide(t) => t.bytes(),
        };
        table + self.up.len()
    }

    /// Exact fraction of the ring each service owns with the current UP set (arcs of DOWN owners
    /// go to the next UP owner clockwise).
    pub(crate) fn shares(&self) -> Vec<f64> {
        let mut acc = vec![0f64; self.services];
        let pts = self.points();
        let len = pts.len();
        let up = |o: usize| self.up.get(o).copied().unwrap_or(false);
        if len == 0 || !(0..self.services).any(up) {
            return acc;
        }
        // Arc (pos[i-1], pos[i]] belongs to point i's owner, or the next UP one.
        let mut next_up = vec![0usize; len];
        let mut cur = None;
        for step in (0..2 * len).rev() {
            let i = step % len;
            if up(pts[i].1) {
                cur = Some(pts[i].1);
            }
            if step < len {
                next_up[i] = cur.unwrap_or(pts[i].1);
            }
        }
        for i in 0..len {
            let prev = pts[if i == 0 { len - 1 } else { i - 1 }].0;
            let arc = if len == 1 {
                1u64 << 32
            } else {
                u64::from(pts[i].0.wrapping_sub(prev))
            };
            if let Some(a) = acc.get_mut(next_up[i]) {
                *a += arc as f64;
            }
        }
        let ring = 2f64.powi(32);
        acc.into_iter().map(|a| a / ring).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Points of a ring sorted independently of `sort_points`, and the selector.
    fn ring(n: usize, fingers: u32) -> (Vec<u32>, Vec<u32>, Jarh) {
        let ids: Vec<u64> = (0..n as u64).map(|i| crate::hash::mix64(i + 7)).collect();
        let j = Jarh::build(&ids, &vec![1; n], fingers, vec![true; n]);
        let mut pts: Vec<(u32, u64, u32)> = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            for f in 0..fingers {
                pts.push((
                    (crate::hash::finger_hash(*id, f) >> 32) as u32,
                    id >> 32,
                    i as u32,
                ));
            }
        }
        pts.sort_unstable();
        let (pos, owner) = pts.into_iter().map(|(p, _, o)| (p, o)).unzip();
        (pos, owner, j)
    }

    /// Reference: the nearest point by brute force, ties to the counter-clockwise one.
    fn nearest(pos: &[u32], owner: &[u32], key: u64) -> usize {
        let k32 = (key >> 32) as u32;
        let len = pos.len();
        let r = pos.partition_point(|p| *p < k32) % len;
        let l = (r + len - 1) % len;
        let (dl, dr) = (k32.wrapping_sub(pos[l]), pos[r].wrapping_sub(k32));
        if len > 1 && dl <= dr && dr != 0 {
            owner[l] as usize
        } else {
            owner[r] as usize
        }
    }

    /// Reference: the first entry at or after the key (binary search).
    fn successor(pos: &[u32], owner: &[u32], key: u64) -> usize {
        let k32 = (key >> 32) as u32;
        let i = pos.partition_point(|p| *p < k32);
        owner[if i == pos.len() { 0 } else { i }] as usize
    }

    /// The slot-table lookup gives the nearest point at every point, midpoint, slot edge and
    /// side-list entry, for narrow and wide entries, and the table holds every cell exactly.
    #[test]
    fn slot_lookup_finds_the_nearest_point_at_edges() {
        for (n, fingers) in [(1usize, 1u32), (2, 1), (50, 16), (7, 300), (40, 1000)] {
            let (pos, owner, narrow) = ring(n, fingers);
            assert_eq!(pos.len(), n * fingers as usize);
            let want_cells = cells(
                pos.iter()
                    .copied()
                    .zip(owner.iter().copied())
                    .collect::<Vec<_>>(),
            );
            let wide = Jarh {
                slots: Slots::Wide(build_table(&want_cells, narrow.slot_count)),
                ..narrow.clone()
            };
            let want: Vec<(u32, usize)> =
                want_cells.iter().map(|(p, o)| (*p, *o as usize)).collect();
            assert!(want.windows(2).all(|w| w[0].0 <= w[1].0));
            assert_eq!(narrow.points(), want);
            assert_eq!(wide.points(), want);
            let mut keys: Vec<u64> = (0..5_000u64)
                .map(|k| crate::hash::mix64(k ^ 0x55))
                .collect();
            for p in pos.iter().chain(want_cells.iter().map(|(m, _)| m)) {
                let p = u64::from(*p) << 32;
                keys.extend([
                    p,
                    p | 0xffff_ffff,
                    p.wrapping_sub(1 << 32),
                    p.wrapping_add(1 << 32),
                ]);
            }
            for s in 0..narrow.slot_count {
                let start = ((u128::from(s) << 32).div_ceil(u128::from(narrow.slot_count))) as u64;
                keys.extend([start << 32, (start << 32).wrapping_sub(1)]);
            }
            keys.extend([0, u64::MAX]);
            for k in keys {
                let want = nearest(&pos, &owner, k);
                assert_eq!(narrow.first_owner(k), want, "n {n} key {k:#x}");
                assert_eq!(wide.first_owner(k), want, "wide n {n} key {k:#x}");
                assert_eq!(narrow.pick(k, |_| true), Some((want, 0)));
                assert_eq!(narrow.ranking(k)[0], want);
            }
        }
    }

    #[test]
    fn crowded_slots_and_coincident_cell_ends() {
        // Hand-made cell ends with coincident positions and crowded slots.
        let pos = [5u32, 5, 6, 1 << 20, (1 << 20) + 1, u32::MAX - 1, u32::MAX];
        let owner = [0u32, 1, 2, 0, 1, 2, 0];
        let pts: Vec<(u32, u32)> = pos.iter().copied().zip(owner).collect();
        let j = Jarh::from_cells(&pts, vec![true; 3], 3);
        for k32 in [
            0u32,
            4,
            5,
            6,
            7,
            1 << 20,
            (1 << 20) + 1,
            (1 << 20) + 2,
            u32::MAX - 1,
            u32::MAX,
        ] {
            let k = u64::from(k32) << 32 | 0x1234;
            assert_eq!(j.first_owner(k), successor(&pos, &owner, k), "{k32}");
        }
        let got: Vec<(u32, u32)> = j.points().into_iter().map(|(p, o)| (p, o as u32)).collect();
        assert_eq!(got, pts);
    }

    #[test]
    fn cells_of_coincident_and_wrapping_points() {
        // The last gap wraps: its midpoint comes first.
        assert_eq!(
            cells(vec![(10, 0), (20, 1), (u32::MAX - 9, 2)]),
            vec![(0, 2), (15, 0), (u32::MAX / 2 + 6, 1)]
        );
        assert_eq!(cells(vec![(7, 3)]), vec![(7, 3)]);
        assert!(cells(Vec::new()).is_empty());
        // Coincident points alone: a zero gap both ways.
        assert_eq!(cells(vec![(7, 0), (7, 1)]), vec![(7, 0), (7, 1)]);
    }

    #[test]
    fn memory_at_1024_fingers_and_1000_services_is_within_24_mib() {
        let ids: Vec<u64> = (0..1000u64).map(crate::hash::mix64).collect();
        let j = Jarh::build(&ids, &vec![1; 1000], 1024, vec![true; 1000]);
        assert!(matches!(j.slots, Slots::Narrow(_)));
        assert!(j.memory_bytes() <= 24 << 20, "{}", j.memory_bytes());
    }
}
