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
pub struct Carp {
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

    pub(crate) fn pick(
        &self,
        key: u64,
        eligible: impl Fn(usize) -> bool,
    ) -> Option<(usize, usize)> {
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

/// Highest combined value over all services (ties: lower index). Four independent running
/// maxima let the multiplies of consecutive services overlap instead of waiting on one compare
/// chain.
#[inline]
fn best_of_all(ids: &[u64], key: u64) -> Option<(u64, usize)> {
    const LANES: usize = 4;
    let mut best = [(0u64, usize::MAX); LANES];
    let chunks = ids.chunks_exact(LANES);
    let tail = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        for lane in 0..LANES {
            let v = crate::hash::carp_combine(key, chunk[lane]);
            let i = c * LANES + lane;
            if v > best[lane].0 || best[lane].1 == usize::MAX {
                best[lane] = (v, i);
            }
        }
    }
    let base = ids.len() - tail.len();
    for (t, id) in tail.iter().enumerate() {
        let v = crate::hash::carp_combine(key, *id);
        if v > best[0].0 || best[0].1 == usize::MAX {
            best[0] = (v, base + t);
        }
    }
    best.into_iter()
        .filter(|b| b.1 != usize::MAX)
        .reduce(|a, b| {
            if b.0 > a.0 || (b.0 == a.0 && b.1 < a.1) {
                b
            } else {
                a
            }
        })
}
