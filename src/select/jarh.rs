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
//! (`2^b` >= points) holds, for each range of the top `b` bits of the hash, the first point at or
//! after the start of the range. A lookup reads the index and walks forward over the few points
//! (about one on average) that share that range: O(1) expected, no branches on the ring size.
//!
//! Bounds: the total number of points is capped at 2^22; when `fingers x sum(weights)` is larger,
//! every service's count is scaled down in proportion (at least one point each). Config limits
//! (fingers <= 1024) reach the cap only with large weights and hundreds of services.

use crate::hash::finger_hash;

/// Most ring points kept, whatever the config asks for (2^22 points = 64 MiB with the index).
const MAX_POINTS: u64 = 1 << 22;

/// The jarh selector.
#[derive(Debug, Clone)]
pub struct Jarh {
    /// (position, owner service) of each point, ascending; kept together so that a lookup touches
    /// one cache line for both.
    points: Vec<(u64, u32)>,
    /// For each top-`b`-bit range, the first point index at or after its start.
    index: Vec<u32>,
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

        let want = (points.len() as u64).max(2);
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
            index.push(p as u32);
        }
        Jarh {
            points,
            index,
            shift,
            up,
            services: ids.len(),
        }
    }

    /// Index of the point owning `key`.
    #[inline]
    fn successor(&self, key: u64) -> usize {
        let mut i = self
            .index
            .get((key >> self.shift) as usize)
            .map_or(0, |v| *v as usize);
        while i < self.points.len() && self.points[i].0 < key {
            i += 1;
        }
        if i >= self.points.len() { 0 } else { i }
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
        let start = self.successor(key);
        let first = self.owner(start);
        if self.up[first] && eligible(first) {
            return Some((first, 0));
        }
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
