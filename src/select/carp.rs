//! `carp`: weighted highest-random-weight (rendezvous) hashing. PURE.
//!
//! Construction: for a key hash `k` and service hash `s_i`, the pair value is
//! `c_i = carp_combine(k, s_i)` (see `crate::hash`). With equal weights the service with the
//! largest `c_i` wins. With unequal weights the score is `w_i / -ln(u_i)` where
//! `u_i = (c_i >> 11 + 0.5) / 2^53` (the "logarithmic method" of weighted rendezvous hashing):
//! service i then wins a fraction `w_i / sum(w)` of the keys exactly, and, unlike the multiplier
//! table of the CARP draft, a service's score never depends on the other members, so adding or
//! removing one service moves only the keys that service wins or held. Ties (same score) go to
//! the larger `c_i`, then to the lower index.
//!
//! The ranking of a key is all services by descending score; a lookup is one pass over the
//! services, O(N), without allocation. The comparison order is shared with `prac`, which ranks
//! table slots with it.

/// A comparable score: higher wins. For equal weights the high half is 0 and the low half is the
/// combined value; for weighted members the high half is the IEEE bits of `w / -ln(u)` (positive
/// finite floats order like their bit patterns) and the low half the combined value.
pub(crate) type Score = u128;

/// Scores services against a key; shared by carp and prac.
#[derive(Debug, Clone)]
pub(crate) struct Scorer {
    pub(crate) ids: Vec<u64>,
    /// `None` when every weight is equal: then the combined value alone orders services.
    weights: Option<Vec<f64>>,
}

impl Scorer {
    pub(crate) fn new(ids: Vec<u64>, weights: &[u32]) -> Scorer {
        let first = weights.first().copied().unwrap_or(1);
        let uniform = weights.iter().all(|w| *w == first);
        let weights = if uniform {
            None
        } else {
            // Weight 0 is rejected by config validation; treating it as 1 keeps this total.
            Some(weights.iter().map(|w| f64::from((*w).max(1))).collect())
        };
        Scorer { ids, weights }
    }

    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    pub(crate) fn is_uniform(&self) -> bool {
        self.weights.is_none()
    }

    #[inline]
    pub(crate) fn score(&self, key: u64, i: usize) -> Score {
        let c = crate::hash::carp_combine(key, self.ids[i]);
        match &self.weights {
            None => Score::from(c),
            Some(w) => {
                let u = ((c >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
                let s = w[i] / -u.ln();
                (Score::from(s.to_bits()) << 64) | Score::from(c)
            }
        }
    }

    /// True when (a, i) ranks before (b, j).
    #[inline]
    pub(crate) fn beats(a: Score, i: usize, b: Score, j: usize) -> bool {
        a > b || (a == b && i < j)
    }

    /// The best service ranked strictly after `after` (None = from the top) among those passing
    /// `filter`.
    pub(crate) fn best_after(
        &self,
        key: u64,
        after: Option<(Score, usize)>,
        filter: impl Fn(usize) -> bool,
    ) -> Option<(Score, usize)> {
        let mut best: Option<(Score, usize)> = None;
        for i in 0..self.ids.len() {
            if !filter(i) {
                continue;
            }
            let s = self.score(key, i);
            if let Some((bs, bi)) = after
                && !Self::beats(bs, bi, s, i)
            {
                continue;
            }
            match best {
                Some((cs, ci)) if !Self::beats(s, i, cs, ci) => {}
                _ => best = Some((s, i)),
            }
        }
        best
    }

    /// Every service in descending score order.
    pub(crate) fn ranking(&self, key: u64) -> Vec<usize> {
        let mut v: Vec<(Score, usize)> = (0..self.ids.len())
            .map(|i| (self.score(key, i), i))
            .collect();
        v.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        v.into_iter().map(|(_, i)| i).collect()
    }
}

/// The carp selector: service hashes, weights and the UP set.
#[derive(Debug, Clone)]
pub(crate) struct Carp {
    scorer: Scorer,
    up: Vec<bool>,
    all_up: bool,
}

impl Carp {
    pub(crate) fn build(ids: Vec<u64>, weights: &[u32], up: Vec<bool>) -> Carp {
        let all_up = up.iter().all(|u| *u);
        Carp {
            scorer: Scorer::new(ids, weights),
            up,
            all_up,
        }
    }

    /// The best UP service, by one pass; the hot path of [`Carp::pick`].
    #[inline]
    fn best_up(&self, key: u64) -> Option<(Score, usize)> {
        if !self.scorer.is_uniform() {
            return self.scorer.best_after(key, None, |i| self.up[i]);
        }
        if self.all_up {
            return best_of_all(&self.scorer.ids, key).map(|(c, i)| (Score::from(c), i));
        }
        // Equal weights: compare combined values as u64, no float work.
        let mut best: Option<(u64, usize)> = None;
        for (i, id) in self.scorer.ids.iter().enumerate() {
            if !self.up[i] {
                continue;
            }
            let c = crate::hash::carp_combine(key, *id);
            match best {
                Some((bc, _)) if bc >= c => {}
                _ => best = Some((c, i)),
            }
        }
        best.map(|(c, i)| (Score::from(c), i))
    }

    /// Inlined fast path (equal weights, every service UP: one pass, first choice); the rest
    /// is out of line in `pick_rest`, so the common case returns its pair in registers.
    #[inline]
    pub(crate) fn pick(
        &self,
        key: u64,
        eligible: impl Fn(usize) -> bool,
    ) -> Option<(usize, usize)> {
        if self.all_up && self.scorer.is_uniform() {
            let (_, idx) = best_of_all(&self.scorer.ids, key)?;
            if eligible(idx) {
                return Some((idx, 0));
            }
        }
        self.pick_rest(key, &eligible)
    }

    #[inline(never)]
    fn pick_rest(&self, key: u64, eligible: &dyn Fn(usize) -> bool) -> Option<(usize, usize)> {
        let (score, idx) = self.best_up(key)?;
        if eligible(idx) {
            if self.all_up {
                return Some((idx, 0));
            }
            // Position = how many (DOWN) services outrank the winner.
            let above = (0..self.scorer.len())
                .filter(|&j| !self.up[j] && Scorer::beats(self.scorer.score(key, j), j, score, idx))
                .count();
            return Some((idx, above));
        }
        self.scorer
            .ranking(key)
            .into_iter()
            .enumerate()
            .find(|&(_, i)| self.up[i] && eligible(i))
            .map(|(pos, i)| (i, pos))
    }

    pub(crate) fn ranking(&self, key: u64) -> Vec<usize> {
        self.scorer.ranking(key)
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.scorer.ids.len() * (8 + 8 + 1)
    }
}

/// Highest combined value over all services (ties: lower index).
///
/// Two independent running maxima (lane 0 sees even services, lane 1 odd ones) halve the
/// compare chain, so the throughput of the mixing multiplies, not the chain, sets the pace; each
/// update is a compare and two conditional moves (no branch on the data), and a lane records the
/// pair number, not the index, to keep every live value in a register. A lane replaces its
/// maximum only on a strictly larger value, so it keeps the lowest index among equal values; the
/// two lanes are merged by (value, lower index). The result is the one of a single pass in config
/// order with the same tie rule.
#[inline]
fn best_of_all(ids: &[u64], key: u64) -> Option<(u64, usize)> {
    use crate::hash::carp_combine;
    let (first, rest) = ids.split_first()?;
    let Some((second, rest)) = rest.split_first() else {
        return Some((carp_combine(key, *first), 0));
    };
    let (mut v0, mut v1) = (carp_combine(key, *first), carp_combine(key, *second));
    // Pair numbers: services 2p and 2p + 1.
    let (mut p0, mut p1) = (0usize, 0usize);
    let pairs = rest.chunks_exact(2);
    let tail = pairs.remainder();
    for (p, q) in pairs.enumerate() {
        let (a, b) = (carp_combine(key, q[0]), carp_combine(key, q[1]));
        let pair = p + 1;
        let (ga, gb) = (a > v0, b > v1);
        v0 = if ga { a } else { v0 };
        p0 = if ga { pair } else { p0 };
        v1 = if gb { b } else { v1 };
        p1 = if gb { pair } else { p1 };
    }
    if let Some(last) = tail.first() {
        let a = carp_combine(key, *last);
        if a > v0 {
            (v0, p0) = (a, ids.len() / 2);
        }
    }
    let (i0, i1) = (2 * p0, 2 * p1 + 1);
    Some(if v1 > v0 || (v1 == v0 && i1 < i0) {
        (v1, i1)
    } else {
        (v0, i0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two-lane pass equals a plain pass in config order, ties (duplicate service hashes,
    /// as two legs sharing one `hash_id` have) included, at every length and parity.
    #[test]
    fn best_of_all_matches_a_single_pass_with_ties() {
        let plain = |ids: &[u64], key: u64| {
            let mut best: Option<(u64, usize)> = None;
            for (i, id) in ids.iter().enumerate() {
                let c = crate::hash::carp_combine(key, *id);
                if best.is_none_or(|(b, _)| c > b) {
                    best = Some((c, i));
                }
            }
            best
        };
        for n in 0..40usize {
            let base: Vec<u64> = (0..n as u64)
                .map(|i| crate::hash::mix64(i ^ 0xabc))
                .collect();
            // Every service duplicated somewhere later, so the winner always has a twin.
            let mut ids = base.clone();
            ids.extend(base.iter().rev());
            for k in 0..300u64 {
                let key = crate::hash::mix64(k);
                assert_eq!(best_of_all(&base, key), plain(&base, key), "n {n}");
                assert_eq!(best_of_all(&ids, key), plain(&ids, key), "dup n {n}");
                let odd = ids.get(1..).unwrap_or(&[]);
                assert_eq!(best_of_all(odd, key), plain(odd, key));
            }
        }
    }
}
