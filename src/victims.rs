//! The order in which idle clients are evicted when the open-file pool runs low
//! (docs/limits.md, "Eviction under pressure"), kept as an index so that choosing a victim
//! never looks at every connection. PURE: ranks come in as values, no clock, no IO.
//!
//! A client's rank is `(class, last activity)` ([`crate::budget::Activity::rank`]): lower
//! goes first. Its connection stamps its activity with one atomic store per movement and
//! never tells the index, so the index keeps each entry under the rank it had when it was
//! last looked at. Both parts of a rank only grow (a class is only ever raised, a stamp only
//! moves forward), so an entry's indexed rank is never above its true one: the index is a
//! priority queue with lazy re-keying. [`VictimIndex::pop_victim`] takes the first entry;
//! when its true rank has moved past the indexed one it is put back under its true rank and
//! the next first is looked at. Each such move follows some activity of that client since it
//! was last indexed, so the re-keying is paid for by the activity (amortised O(log n) per
//! choice; a choice itself is O(log n) when nothing moved).
//!
//! Last activity is compared by buckets of [`BUCKET_NS`] (2^20 ns, about 1.05 ms): a client
//! active within the same bucket as its indexed stamp is not re-keyed, so the victim is no
//! younger than the true oldest of the lowest class by more than one bucket width. Within a
//! bucket the older id (the connection opened first) goes first.

use std::collections::{BTreeMap, HashMap};

/// An eviction rank: (class, last activity in nanoseconds of the runtime's epoch).
pub type Rank = (u8, u64);

/// log2 of the bucket width last activity is compared by.
pub const BUCKET_SHIFT: u32 = 20;
/// The bucket width: the most by which a victim may be younger than the true oldest of its
/// class (about 1.05 ms).
pub const BUCKET_NS: u64 = 1 << BUCKET_SHIFT;

/// Where an entry is ordered: (class, bucket of its stamp, id).
type Key = (u8, u64, u64);

fn key_of(rank: Rank, id: u64) -> Key {
    (rank.0, rank.1 >> BUCKET_SHIFT, id)
}

/// Clients by eviction rank, each with what its owner needs to evict it (`T`).
#[derive(Debug)]
pub struct VictimIndex<T> {
    order: BTreeMap<Key, T>,
    /// Each entry's place in `order`: (class, bucket).
    keys: HashMap<u64, (u8, u64)>,
}

impl<T> Default for VictimIndex<T> {
    fn default() -> Self {
        VictimIndex {
            order: BTreeMap::new(),
            keys: HashMap::new(),
        }
    }
}

impl<T> VictimIndex<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Clients indexed.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Index client `id` (unique while it lives) at `rank`; an entry already under `id` is
    /// replaced and returned.
    pub fn insert(&mut self, id: u64, rank: Rank, payload: T) -> Option<T> {
        let old = self.remove(id);
        let key = key_of(rank, id);
        self.keys.insert(id, (key.0, key.1));
        self.order.insert(key, payload);
        old
    }

    /// Forget client `id` (it ended); its payload, if it was indexed.
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let (class, bucket) = self.keys.remove(&id)?;
        self.order.remove(&(class, bucket, id))
    }

    /// Take out the client to evict first: the lowest class, then the oldest bucket of last
    /// activity, then the lowest id, by the true ranks `rank_of` reads. Entries found to have
    /// moved on are re-keyed on the way.
    pub fn pop_victim(&mut self, mut rank_of: impl FnMut(&T) -> Rank) -> Option<(u64, T)> {
        loop {
            let (key, payload) = self.order.pop_first()?;
            let id = key.2;
            let now = key_of(rank_of(&payload), id);
            // `<=`: a stamp stored late by a slower thread may step back a little; the
            // entry is then at least as old as indexed, and first all the same.
            if now <= key {
                self.keys.remove(&id);
                return Some((id, payload));
            }
            self.keys.insert(id, (now.0, now.1));
            self.order.insert(now, payload);
        }
    }

    /// Every entry whose payload `keep` refuses is removed (a registry's sweep of clients
    /// that ended without saying so).
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        let keys = &mut self.keys;
        self.order.retain(|k, p| {
            let kept = keep(p);
            if !kept {
                keys.remove(&k.2);
            }
            kept
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::class::{PROVEN, REGISTERED, UNPROVEN};
    use proptest::prelude::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A client as its connection sees it: the rank it would report now.
    type Live = Rc<Cell<Rank>>;

    fn ms(n: u64) -> u64 {
        n * 1_000_000
    }

    #[test]
    fn the_unproven_then_the_longest_idle_and_registrations_last() {
        let mut ix = VictimIndex::new();
        let c: [(u64, Rank); 7] = [
            (1, (PROVEN, ms(100))),
            (2, (UNPROVEN, ms(900))),
            (3, (PROVEN, ms(50))),
            (4, (UNPROVEN, ms(200))),
            (5, (PROVEN, ms(5_000))),
            (6, (REGISTERED, ms(10))),
            (7, (REGISTERED, ms(1))),
        ];
        for (id, r) in c {
            ix.insert(id, r, Rc::new(Cell::new(r)));
        }
        let mut order = Vec::new();
        while let Some((id, _)) = ix.pop_victim(|l: &Live| l.get()) {
            order.push(id);
        }
        assert_eq!(order, vec![4, 2, 3, 1, 5, 7, 6]);
        assert!(ix.is_empty());
    }

    #[test]
    fn a_client_active_since_it_was_indexed_is_re_keyed_not_evicted() {
        let mut ix = VictimIndex::new();
        let a: Live = Rc::new(Cell::new((UNPROVEN, ms(1))));
        let b: Live = Rc::new(Cell::new((UNPROVEN, ms(2))));
        ix.insert(1, a.get(), Rc::clone(&a));
        ix.insert(2, b.get(), Rc::clone(&b));
        // `a` spoke since (a keep-alive), then completed a message: `b` is the idlest now.
        a.set((UNPROVEN, ms(50)));
        assert_eq!(ix.pop_victim(|l| l.get()).map(|v| v.0), Some(2));
        a.set((PROVEN, ms(60)));
        let c: Live = Rc::new(Cell::new((UNPROVEN, ms(70))));
        ix.insert(3, c.get(), c);
        assert_eq!(ix.pop_victim(|l| l.get()).map(|v| v.0), Some(3));
        assert_eq!(ix.pop_victim(|l| l.get()).map(|v| v.0), Some(1));
        assert_eq!(ix.pop_victim(|l| l.get()).map(|v| v.0), None);
    }

    #[test]
    fn within_a_bucket_the_older_id_goes_first_and_removal_forgets() {
        let mut ix = VictimIndex::new();
        ix.insert(9, (UNPROVEN, 10), ());
        ix.insert(3, (UNPROVEN, BUCKET_NS - 1), ());
        ix.insert(5, (UNPROVEN, BUCKET_NS), ());
        assert_eq!(ix.remove(7), None);
        assert_eq!(ix.remove(9), Some(()));
        assert_eq!(ix.len(), 2);
        assert_eq!(ix.pop_victim(|_| (UNPROVEN, 0)).map(|v| v.0), Some(3));
        ix.retain(|_| false);
        assert!(ix.is_empty());
        assert_eq!(ix.pop_victim(|_| (UNPROVEN, 0)), None);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Open {
            class: u8,
            after_ns: u64,
        },
        Touch {
            pick: usize,
            after_ns: u64,
            raise: bool,
        },
        Close {
            pick: usize,
        },
        Evict,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..3, 0u64..5_000_000).prop_map(|(class, after_ns)| Op::Open { class, after_ns }),
            4 => (any::<usize>(), 0u64..5_000_000, any::<bool>())
                .prop_map(|(pick, after_ns, raise)| Op::Touch { pick, after_ns, raise }),
            1 => any::<usize>().prop_map(|pick| Op::Close { pick }),
            2 => Just(Op::Evict),
        ]
    }

    proptest! {
        /// Whatever clients open, speak, close and are evicted, each victim is of the lowest
        /// class among the clients left, no younger than the oldest of that class by more
        /// than one bucket width, and never one that closed.
        #[test]
        fn the_victim_is_the_true_first_within_one_bucket(
            ops in proptest::collection::vec(op(), 1..300),
        ) {
            let mut ix: VictimIndex<Live> = VictimIndex::new();
            let mut live: Vec<(u64, Live)> = Vec::new();
            let (mut now, mut next_id) = (0u64, 0u64);
            for op in ops {
                match op {
                    Op::Open { class, after_ns } => {
                        now += after_ns;
                        let l = Rc::new(Cell::new((class, now)));
                        ix.insert(next_id, (class, now), Rc::clone(&l));
                        live.push((next_id, l));
                        next_id += 1;
                    }
                    Op::Touch { pick, after_ns, raise } if !live.is_empty() => {
                        now += after_ns;
                        let l = &live[pick % live.len()].1;
                        let (class, _) = l.get();
                        let class = if raise { (class + 1).min(REGISTERED) } else { class };
                        l.set((class, now));
                    }
                    Op::Close { pick } if !live.is_empty() => {
                        let (id, _) = live.swap_remove(pick % live.len());
                        prop_assert!(ix.remove(id).is_some());
                    }
                    Op::Evict => {
                        let got = ix.pop_victim(|l| l.get());
                        let Some((id, l)) = got else {
                            prop_assert!(live.is_empty());
                            continue;
                        };
                        let at = live.iter().position(|(i, _)| *i == id);
                        prop_assert!(at.is_some(), "a closed client was chosen");
                        let (class, stamp) = l.get();
                        let lowest = live.iter().map(|(_, l)| l.get().0).min();
                        prop_assert_eq!(Some(class), lowest);
                        let oldest = live
                            .iter()
                            .filter(|(_, l)| l.get().0 == class)
                            .map(|(_, l)| l.get().1)
                            .min()
                            .unwrap_or(stamp);
                        prop_assert!(stamp < oldest + BUCKET_NS, "{stamp} vs oldest {oldest}");
                        live.swap_remove(at.unwrap_or(0));
                    }
                    _ => {}
                }
                prop_assert_eq!(ix.len(), live.len());
            }
        }
    }
}
