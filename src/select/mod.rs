//! Consistent-hash selection: `carp`, `prac`, `jarh` (docs/hashing.md). PURE.
//!
//! Every algorithm reduces to a ranking of the configured services for a key; health and
//! eligibility (max_clients, bounded loads) filter that ranking from the outside. A
//! [`HashSelector`] is immutable once built from (algorithm, fingers, members, UP set): a health
//! or config change builds a new one aside and the caller swaps it in (ArcSwap), so lookups never
//! wait for a rebuild. The result is a pure function of those inputs, so every instance with the
//! same config and UP set chooses the same service (docs/methods.md, Determinism).
//!
//! Constructions are documented in each submodule and in `docs/hashing.md`.

pub(crate) mod carp;
pub(crate) mod jarh;
pub(crate) mod prac;
mod words;

use crate::config::{HashAlgorithm, PracMaxShare};

/// One configured service as the hash algorithms see it, in config order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// `crate::hash::service_identity_hash` of the service (hash_id, else address).
    pub id_hash: u64,
    /// Service weight (config guarantees 1..=100; 0 is treated as 1).
    pub weight: u32,
}

#[derive(Debug, Clone)]
enum Inner {
    Carp(carp::Carp),
    Prac(prac::Prac),
    Jarh(jarh::Jarh),
}

/// An immutable consistent-hash selector for one service set and one UP set.
#[derive(Debug, Clone)]
pub struct HashSelector {
    algorithm: HashAlgorithm,
    fingers: u32,
    max_share: PracMaxShare,
    members: Vec<Member>,
    inner: Inner,
}

/// `up` for `n` services: a missing entry counts as not UP.
fn up_of(n: usize, up: &[bool]) -> Vec<bool> {
    (0..n)
        .map(|i| up.get(i).copied().unwrap_or(false))
        .collect()
}

impl HashSelector {
    /// Builds the selector. `up[i]` = service i is UP; a missing entry counts as not UP.
    /// prac and jarh derive their health-adjusted state from the all-UP one, so the result is a
    /// pure function of (algorithm, fingers, members, up). `fingers` is clamped to at least 1;
    /// an empty member list gives a selector that never picks.
    pub fn build(
        algorithm: HashAlgorithm,
        fingers: u32,
        members: &[Member],
        up: &[bool],
    ) -> HashSelector {
        HashSelector::build_bounded(algorithm, fingers, PracMaxShare::DEFAULT, members, up)
    }

    /// [`HashSelector::build`] with prac's balance bound `max_share` (`lb.prac_max_share`;
    /// carp and jarh ignore it).
    pub fn build_bounded(
        algorithm: HashAlgorithm,
        fingers: u32,
        max_share: PracMaxShare,
        members: &[Member],
        up: &[bool],
    ) -> HashSelector {
        let ids: Vec<u64> = members.iter().map(|m| m.id_hash).collect();
        let weights: Vec<u32> = members.iter().map(|m| m.weight).collect();
        let up = up_of(members.len(), up);
        let inner = match algorithm {
            HashAlgorithm::Carp => Inner::Carp(carp::Carp::build(ids, &weights, up)),
            HashAlgorithm::Prac => {
                Inner::Prac(prac::Prac::build(ids, &weights, fingers, max_share, up))
            }
            HashAlgorithm::Jarh => Inner::Jarh(jarh::Jarh::build(&ids, &weights, fingers, up)),
        };
        HashSelector {
            algorithm,
            fingers,
            max_share,
            members: members.to_vec(),
            inner,
        }
    }

    /// The same selector for another UP set: equal to [`HashSelector::build`] with the same
    /// algorithm, fingers and members and `up`. prac derives the new table from the all-UP
    /// table it already holds (a health change does not fill the table anew); carp and jarh
    /// are built again (cheap beside prac's fill).
    pub fn with_up(&self, up: &[bool]) -> HashSelector {
        match &self.inner {
            Inner::Prac(p) => HashSelector {
                algorithm: self.algorithm,
                fingers: self.fingers,
                max_share: self.max_share,
                members: self.members.clone(),
                inner: Inner::Prac(p.with_up(up_of(self.members.len(), up))),
            },
            _ => HashSelector::build_bounded(
                self.algorithm,
                self.fingers,
                self.max_share,
                &self.members,
                up,
            ),
        }
    }

    /// The algorithm this selector runs.
    pub fn algorithm(&self) -> HashAlgorithm {
        self.algorithm
    }

    /// First service for this key that is UP and for which `eligible(i)` holds, following the
    /// algorithm's ranking (docs/methods.md, Selection). Returns the service index and its position
    /// in [`HashSelector::ranking`] (0 = first choice), so metrics can tell "hash" from
    /// "next-ranked". `None` when no UP eligible service exists.
    ///
    /// A first-choice hit does not allocate: O(1) for prac and jarh, one pass over the services
    /// for carp. prac's table may pass over a next-ranked service at its capped share (see
    /// `prac`).
    #[inline]
    pub fn pick(&self, key_hash: u64, eligible: impl Fn(usize) -> bool) -> Option<(usize, usize)> {
        match &self.inner {
            Inner::Carp(c) => c.pick(key_hash, eligible),
            Inner::Prac(p) => p.pick(key_hash, eligible),
            Inner::Jarh(j) => j.pick(key_hash, eligible),
        }
    }

    /// The full failover order for a key: every service exactly once, UP or not.
    pub fn ranking(&self, key_hash: u64) -> Vec<usize> {
        match &self.inner {
            Inner::Carp(c) => c.ranking(key_hash),
            Inner::Prac(p) => p.ranking(key_hash),
            Inner::Jarh(j) => j.ranking(key_hash),
        }
    }

    /// Bytes held by the algorithm's tables (the selector's heap data).
    pub fn memory_bytes(&self) -> usize {
        match &self.inner {
            Inner::Carp(c) => c.memory_bytes(),
            Inner::Prac(p) => p.memory_bytes(),
            Inner::Jarh(j) => j.memory_bytes(),
        }
    }

    /// The exact fraction of the hash space each service owns with the current UP set, for the
    /// table and ring algorithms; `None` for carp, whose shares exist only as probabilities.
    pub fn exact_shares(&self) -> Option<Vec<f64>> {
        match &self.inner {
            Inner::Carp(_) => None,
            Inner::Prac(p) => Some(p.shares()),
            Inner::Jarh(j) => Some(j.shares()),
        }
    }
}

#[cfg(test)]
mod tests;
