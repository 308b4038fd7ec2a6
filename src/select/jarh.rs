//! `jarh`: a ring hash with `fingers x weight` points per service and a jump-table-assisted
//! lookup. PURE.
//!
//! Construction: service i places `fingers x w_i` points on a 64-bit ring at
//! `finger_hash(s_i, j)` (`crate::hash`), j = 0, 1, ... A point's position depends only on its own
//! service's hash, so adding or removing a service moves only the arcs its points cover. A key
//! belongs to the first point at or after its hash, wrapping around; the ranking of a key is the
//! distinct owners met walking clockwise from there, so a DOWN service's keys go to the next UP
//! service on the ring and come back exactly when it returns.
//!
//! Jump assist: instead of a binary search over the sorted points, an index of `2^b` entries
//! (`2^b` >= 2 x points) covers the ranges of the top `b` bits of the hash. A range with no point
//! inside belongs wholly to the next point, so its entry is that point's owner and the lookup ends
//! there (about 60-78% of keys); otherwise the entry is the first point inside the range and the
//! lookup walks forward over the few points (about one) that share it. O(1) expected.
//!
//! Bounds: the total number of points is capped at 2^22; when `fingers x sum(weights)` is larger,
//! every service's count is scaled down in proportion (at least one point each). Config limits
//! (fingers <= 1024) reach the cap only with large weights and hundreds of services.

use crate::hash::finger_hash;

/// Most ring points kept, whatever the config asks for (2^22 points: 64 MiB, plus 32 MiB of index).
const MAX_POINTS: u64 = 1 << 22;

/// Flag of an index entry that holds a point index rather than an owner.
const HAS_POINT: u32 = 1 << 31;

/// The jarh selector.
#[derive(Debug, Clone)]
pub struct Jarh {
    /// (position, owner service) of each point, ascending; kept together so that a lookup touches
    /// one cache line for both.
    points: Vec<(u64, u32)>,
    /// One entry per range of the top `b` bits (`2^b` = twice the points, rounded up to a power
    /// of two): when no point falls inside the range, the owner of the next point (every key of
    /// the range belongs to it, so the lookup ends on this one read); else [`HAS_POINT`] | the
    /// index of the first point inside the range.
    index: Vec<u32>,
    /// `64 - b`.
    shift: u32,
    up: Vec<bool>,
    services: usize,
}

impl Jarh {
    pub(crate) fn build(ids: &[u64], weights: &[u32], fingers: u32, up: Vec<bool>) -> Jarh {
        let fingers = u64::from(fingers.max(1));
        let total: u64 = weights
            .iter()
            .map(|w| fingers.saturating_mul(u64::from((*w).max(1))))
            .fold(0u64, u64::saturating_add);
        let mut pts: Vec<(u64, u32)> = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let w = u64::from(weights.get(i).copied().unwrap_or(1).max(1));
            let mut count = fingers.saturating_mul(w);
            if total > MAX_POINTS {
                count = ((count as u128 * MAX_POINTS as u128) / total as u128).max(1) as u64;
            }
            let count = u32::try_from(count).unwrap_or(u32::MAX);
            pts.extend((0..count).map(|j| (finger_hash(*id, j), i as u32)));
        }
        pts.sort_unstable();
        let points = pts;

        // About half the ranges hold no point (2^b >= 2 x points), so most lookups end on the
        // index read.
        let want = (points.len() as u64).saturating_mul(2).max(2);
        let bits = (64 - (want - 1).leading_zeros()).clamp(1, 32);
        let shift = 64 - bits;
        let buckets = 1usize << bits;
        let mut index = Vec::with_capacity(buckets);
        let mut p = 0usize;
        for b in 0..buckets {
            let start = (b as u64) << shift;
            while p < points.len() && points[p].0 < start {
                p += 1;
            }
            let entry = match points.get(p) {
                Some((pos, _)) if (pos >> shift) as usize == b => HAS_POINT | p as u32,
                Some((_, owner)) => *owner,
                // Past the last point the ring wraps to the first one.
                None => points.first().map_or(0, |(_, owner)| *owner),
            };
            index.push(entry);
        }
        Jarh {
            points,
            index,
            shift,
            up,
            services: ids.len(),
        }
    }

    /// Index of the point owning `key` (the failover walk starts there).
    fn successor(&self, key: u64) -> usize {
        let i = self.points.partition_point(|p| p.0 < key);
        if i >= self.points.len() { 0 } else { i }
    }

    /// Owner of `key`'s point: one index read for most keys, else a short walk.
    #[inline]
    fn first_owner(&self, key: u64) -> usize {
        let entry = self
            .index
            .get((key >> self.shift) as usize)
            .copied()
            .unwrap_or(0);
        if entry & HAS_POINT == 0 {
            return entry as usize;
        }
        let mut i = (entry & !HAS_POINT) as usize;
        while i < self.points.len() && self.points[i].0 < key {
            i += 1;
        }
        self.owner(if i >= self.points.len() { 0 } else { i })
    }

    #[inline]
    fn owner(&self, point: usize) -> usize {
        self.points.get(point).map_or(0, |p| p.1 as usize)
    }

    pub(crate) fn pick(
        &self,
        key: u64,
        eligible: impl Fn(usize) -> bool,
    ) -> Option<(usize, usize)> {
        if self.points.is_empty() {
            return None;
        }
        let first = self.first_owner(key);
        if self.up.get(first).copied().unwrap_or(false) && eligible(first) {
            return Some((first, 0));
        }
        let start = self.successor(key);
        // Failover walk: distinct owners clockwise. Off the hot path, so a seen-list is fine.
        let mut seen = vec![false; self.services];
        let mut position = 0usize;
        let len = self.points.len();
        for step in 0..len {
            let o = self.owner((start + step) % len);
            if seen[o] {
                continue;
            }
            seen[o] = true;
            if self.up[o] && eligible(o) {
                return Some((o, position));
            }
            position += 1;
            if position == self.services {
                break;
            }
        }
        None
    }

    pub(crate) fn ranking(&self, key: u64) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.services);
        if self.points.is_empty() {
            return out;
        }
        let start = self.successor(key);
        let mut seen = vec![false; self.services];
        let len = self.points.len();
        for step in 0..len {
            let o = self.owner((start + step) % len);
            if !seen[o] {
                seen[o] = true;
                out.push(o);
                if out.len() == self.services {
                    break;
                }
            }
        }
        out
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.points.len() * std::mem::size_of::<(u64, u32)>() + self.index.len() * 4 + self.up.len()
    }

    /// Exact fraction of the ring each service owns with the current UP set (arcs of DOWN owners
    /// go to the next UP owner clockwise).
    pub(crate) fn shares(&self) -> Vec<f64> {
        let mut acc = vec![0f64; self.services];
        let len = self.points.len();
        if len == 0 || !self.up.iter().any(|u| *u) {
            return acc;
        }
        // Arc (points[i-1], points[i]] belongs to points[i]'s owner, or the next UP one.
        let mut next_up = vec![0usize; len];
        let mut cur = None;
        for step in (0..2 * len).rev() {
            let i = step % len;
            let o = self.owner(i);
            if self.up[o] {
                cur = Some(o);
            }
            if step < len {
                next_up[i] = cur.unwrap_or(o);
            }
        }
        for i in 0..len {
            let prev = if i == 0 {
                self.points[len - 1].0
            } else {
                self.points[i - 1].0
            };
            let arc = self.points[i].0.wrapping_sub(prev);
            let arc = if len == 1 { u64::MAX } else { arc };
            acc[next_up[i]] += arc as f64;
        }
        let ring = 2f64.powi(64);
        acc.into_iter().map(|a| a / ring).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_lookup_agrees_with_binary_search_at_edges() {
        for (n, fingers) in [(1usize, 1u32), (2, 1), (50, 16), (7, 300)] {
            let ids: Vec<u64> = (0..n as u64).map(|i| crate::hash::mix64(i + 7)).collect();
            let j = Jarh::build(&ids, &vec![1; n], fingers, vec![true; n]);
            let mut keys: Vec<u64> = (0..5_000u64)
                .map(|k| crate::hash::mix64(k ^ 0x55))
                .collect();
            for (p, _) in &j.points {
                keys.extend([*p, p.wrapping_sub(1), p.wrapping_add(1)]);
            }
            for b in 0..j.index.len() as u64 {
                let start = b << j.shift;
                keys.extend([start, start.wrapping_sub(1)]);
            }
            keys.extend([0, u64::MAX]);
            for k in keys {
                let want = j.owner(j.successor(k));
                assert_eq!(j.first_owner(k), want, "n {n} key {k:#x}");
                assert_eq!(j.pick(k, |_| true), Some((want, 0)));
            }
        }
    }
}
