//! The non-hash load-balancing methods (docs/methods.md), weighted, with deterministic tie-breaking. PURE.
//!
//! [`pick`] chooses one service among those the caller marks eligible, reading the per-service
//! [`ServiceCounters`] and the shared [`MethodState`]. It never reads the clock (`now` is passed
//! in for the rate-based methods), never allocates, and never takes a lock: the only shared
//! mutable state is one atomic cursor, so worker tasks can call it concurrently.
//!
//! Health, `max_clients` and slow-start caps are the caller's business (the `eligible`
//! predicate), as in Kamailio's dispatcher: every method reduces to a choice among candidates,
//! filtering happens outside.
//!
//! Scores are compared as exact fractions in integer arithmetic (`load / weight` by
//! cross-multiplication), so the same counters always give the same choice on every machine.
//! Ties go to the tied service chosen least recently (lowest index among never-chosen ones): a
//! fixed "lowest index wins" rule would send every request to the first service while counters
//! are equal (all idle at start, or a method whose counters only move once per second).
//!
//! # Sharing among the services that remain eligible
//! A service that is not eligible for one request (DOWN, at `max_clients`, or held back by slow
//! start, see docs/slow_start.md) must leave the others sharing that request exactly as they
//! would share it without it. Both tie-breaks are built for that:
//! - round robin consumes the positions it skips, so the eligible services are served in their
//!   own order of the weighted cycle, which is the cycle built for them alone;
//! - the least-loaded methods rotate ties by *recency*, not by position: a rotation that starts
//!   at a position (`cursor % n`, the first tied service from there) hands the turn of an
//!   ineligible service to the one after it, which then takes twice its share of ties.
//!   Recency only compares the candidates' own histories, so the remaining services win their
//!   ties in the order they would win them alone.

use std::cmp::Ordering as CmpOrdering;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::Method;
use crate::stats::{MAX_RESPONSE_TIME_US, Nanos, ServiceCounters};

/// Round-robin position and tie-break rotation shared by every worker of one vserver.
///
/// Built from the weights of the vserver's service set; a change of the set (reload, add,
/// remove) builds a new one, like every selector (STYLE: immutable selectors swapped whole).
/// Services that are merely DOWN or capped stay in it and are skipped through `eligible`.
#[derive(Debug)]
pub struct MethodState {
    /// Round robin: the position in `order`. The least-loaded methods: a clock that numbers
    /// their picks (`last_chosen` holds its readings).
    cursor: AtomicU64,
    /// Per service, the `cursor` reading of its last pick by a least-loaded method (0: never):
    /// ties go to the smallest.
    last_chosen: Box<[AtomicU64]>,
    /// One cycle of the smooth weighted order: service `i` appears `weights[i] / g` times
    /// (g = gcd of the weights), spread as evenly as possible.
    order: Box<[u32]>,
    /// Number of services the order was built for.
    services: usize,
}

/// Longest weighted cycle kept; beyond it (tens of thousands of heavily weighted services)
/// round robin falls back to an unweighted cycle rather than allocate without bound.
const MAX_ORDER_LEN: usize = 1 << 20;

impl MethodState {
    /// State for a service set with these weights (0 is treated as 1).
    pub fn new(weights: &[u32]) -> Self {
        MethodState {
            cursor: AtomicU64::new(0),
            last_chosen: weights.iter().map(|_| AtomicU64::new(0)).collect(),
            order: smooth_order(weights).into_boxed_slice(),
            services: weights.len(),
        }
    }

    /// A copy with the same positions: what it chooses from now on leaves this one alone.
    pub fn snapshot(&self) -> MethodState {
        MethodState {
            cursor: AtomicU64::new(self.cursor.load(Ordering::Relaxed)),
            last_chosen: self
                .last_chosen
                .iter()
                .map(|c| AtomicU64::new(c.load(Ordering::Relaxed)))
                .collect(),
            order: self.order.clone(),
            services: self.services,
        }
    }

    /// Number of services this state was built for.
    pub fn services(&self) -> usize {
        self.services
    }

    /// One cycle of the weighted round-robin order (service indices).
    pub fn order(&self) -> &[u32] {
        &self.order
    }
}

impl Default for MethodState {
    fn default() -> Self {
        MethodState::new(&[])
    }
}

/// The method a hash method falls back to when it cannot choose (docs/methods.md, Fallbacks):
/// `round_robin` for `url_hash` and `domain_hash`, `least_connection` for the other hash
/// methods; a non-hash method is its own fallback.
pub fn fallback(method: Method) -> Method {
    match method {
        Method::UrlHash | Method::DomainHash => Method::RoundRobin,
        m if m.is_hash() => Method::LeastConnection,
        m => m,
    }
}

/// Chooses among the services for which `eligible(i)` is true.
///
/// The caller passes UP && not at `max_clients` && not capped by slow start. `counters[i]` are
/// the per-service counters and `weights[i]` the weights (missing or 0 counts as 1); the
/// services considered are `0..counters.len()`. A hash method is served by its [`fallback`].
/// Returns `None` only when no service is eligible.
pub fn pick<C: AsRef<ServiceCounters>>(
    method: Method,
    state: &MethodState,
    counters: &[C],
    weights: &[u32],
    eligible: impl Fn(usize) -> bool,
    now: Nanos,
) -> Option<usize> {
    let n = counters.len();
    if !(0..n).any(&eligible) {
        return None;
    }
    let weight = |i: usize| u128::from(weights.get(i).copied().unwrap_or(1).max(1));
    let active_score = |i: usize| Frac::new(u128::from(counters[i].as_ref().load()) + 1, weight(i));
    match fallback(method) {
        Method::RoundRobin => round_robin(state, n, &eligible),
        Method::LeastConnection => least_by(state, n, &eligible, |i| (active_score(i), Frac::ZERO)),
        Method::LeastResponseTime => {
            let neutral = neutral_time(n, &eligible, |i| counters[i].as_ref().response_time_us());
            least_by(state, n, &eligible, |i| {
                let rt = counters[i].as_ref().response_time_us().unwrap_or(neutral);
                (active_score(i).times(u128::from(rt)), Frac::ZERO)
            })
        }
        Method::Lrtm => {
            let neutral = neutral_time(n, &eligible, |i| {
                counters[i].as_ref().monitor_response_time_us()
            });
            least_by(state, n, &eligible, |i| {
                let rt = counters[i]
                    .as_ref()
                    .monitor_response_time_us()
                    .unwrap_or(neutral);
                (active_score(i).times(u128::from(rt)), Frac::ZERO)
            })
        }
        Method::LeastBandwidth => least_by(state, n, &eligible, |i| {
            let rate = u128::from(counters[i].as_ref().bytes_per_s(now));
            (Frac::new(rate, weight(i)), active_score(i))
        }),
        Method::LeastPackets => least_by(state, n, &eligible, |i| {
            let rate = u128::from(counters[i].as_ref().packets_per_s(now));
            (Frac::new(rate, weight(i)), active_score(i))
        }),
        Method::CustomLoad => {
            // A service that has not reported yet is ranked as the least loaded reporter, so
            // it neither grabs all traffic nor starves until its monitor answers.
            let neutral = (0..n)
                .filter(|&i| eligible(i))
                .filter_map(|i| counters[i].as_ref().reported_load())
                .min()
                .unwrap_or(0);
            least_by(state, n, &eligible, |i| {
                let load = counters[i].as_ref().reported_load().unwrap_or(neutral);
                (Frac::new(u128::from(load), weight(i)), active_score(i))
            })
        }
        // `fallback` maps every hash method to round robin or least connection.
        _ => round_robin(state, n, &eligible),
    }
}

/// Weighted round robin: the next eligible service in the smooth weighted cycle after the
/// cursor. Skipped (ineligible) positions are consumed, so the services that stay eligible keep
/// their relative order and their counts never drift apart by more than one cycle position.
fn round_robin(state: &MethodState, n: usize, eligible: &impl Fn(usize) -> bool) -> Option<usize> {
    let weighted = state.services == n && !state.order.is_empty();
    let len = if weighted { state.order.len() } else { n };
    let at = |pos: usize| -> usize {
        if weighted {
            state.order[pos] as usize
        } else {
            pos
        }
    };
    let len64 = len as u64;
    let mut found = None;
    // A compare-and-swap loop keeps the cursor exact under concurrency; after a few lost races
    // the choice already made is used as is (one position may then be served twice, which
    // only perturbs the order, never correctness).
    for _ in 0..8 {
        let c = state.cursor.load(Ordering::Relaxed);
        found = None;
        for k in 0..len64 {
            let idx = at(((c % len64 + k) % len64) as usize);
            if idx < n && eligible(idx) {
                found = Some((idx, k));
                break;
            }
        }
        let (idx, k) = found?;
        let next = c.wrapping_add(k + 1);
        if state
            .cursor
            .compare_exchange(c, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            return Some(idx);
        }
    }
    found.map(|(idx, _)| idx)
}

/// The eligible service with the smallest score (primary, then secondary); ties go to the
/// tied service chosen least recently, then to the lowest index.
///
/// One pass over the services: each score is computed once. The winner's `last_chosen` is
/// moved to a fresh clock reading with a compare-and-swap, so two workers racing for the same
/// tie do not both take it: the loser scores again and takes the next one. After a few lost
/// races the choice already made is used as is (a tie served twice perturbs the rotation,
/// never correctness), as in [`round_robin`].
fn least_by(
    state: &MethodState,
    n: usize,
    eligible: &impl Fn(usize) -> bool,
    score: impl Fn(usize) -> (Frac, Frac),
) -> Option<usize> {
    if state.last_chosen.len() != n {
        return least_by_position(state, n, eligible, score);
    }
    let mut found = None;
    for _ in 0..8 {
        // (score, last chosen, index) of the best candidate so far.
        let mut best: Option<((Frac, Frac), u64, usize)> = None;
        for i in (0..n).filter(|&i| eligible(i)) {
            let s = score(i);
            let last = state.last_chosen[i].load(Ordering::Relaxed);
            let better = match &best {
                None => true,
                Some((bs, blast, _)) => match cmp_score(&s, bs) {
                    CmpOrdering::Less => true,
                    CmpOrdering::Equal => last < *blast,
                    CmpOrdering::Greater => false,
                },
            };
            if better {
                best = Some((s, last, i));
            }
        }
        let (_, last, idx) = best?;
        found = Some(idx);
        let now_chosen = state.cursor.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        if state.last_chosen[idx]
            .compare_exchange(last, now_chosen, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            return found;
        }
    }
    found
}

/// [`least_by`] for a state built for another service set (no recency to read): ties are
/// rotated by position with the cursor.
fn least_by_position(
    state: &MethodState,
    n: usize,
    eligible: &impl Fn(usize) -> bool,
    score: impl Fn(usize) -> (Frac, Frac),
) -> Option<usize> {
    let mut best: Option<(Frac, Frac)> = None;
    for i in (0..n).filter(|&i| eligible(i)) {
        let s = score(i);
        if best.is_none_or(|b| cmp_score(&s, &b) == CmpOrdering::Less) {
            best = Some(s);
        }
    }
    let best = best?;
    let start = (state.cursor.fetch_add(1, Ordering::Relaxed) % n as u64) as usize;
    (0..n)
        .map(|k| (start + k) % n)
        .find(|&i| eligible(i) && cmp_score(&score(i), &best) == CmpOrdering::Equal)
}

/// The response time used for a service without a measurement: the smallest measured one among
/// the candidates (1 µs if none is measured), so an unmeasured service competes on its active
/// count instead of winning or losing everything.
fn neutral_time(
    n: usize,
    eligible: &impl Fn(usize) -> bool,
    time: impl Fn(usize) -> Option<u64>,
) -> u64 {
    (0..n)
        .filter(|&i| eligible(i))
        .filter_map(time)
        .min()
        .unwrap_or(1)
        .clamp(1, MAX_RESPONSE_TIME_US)
}

/// A non-negative fraction compared exactly by cross-multiplication.
#[derive(Debug, Clone, Copy)]
struct Frac {
    num: u128,
    den: u128,
}

impl Frac {
    const ZERO: Frac = Frac { num: 0, den: 1 };

    fn new(num: u128, den: u128) -> Self {
        Frac {
            num,
            den: den.max(1),
        }
    }

    fn times(self, k: u128) -> Self {
        Frac {
            num: self.num.saturating_mul(k),
            den: self.den,
        }
    }

    fn cmp(&self, other: &Frac) -> CmpOrdering {
        // Operands are at most ~2^96 (counter × response time) and ~2^32 (weight); saturation
        // only matters for values no real counter reaches.
        self.num
            .saturating_mul(other.den)
            .cmp(&other.num.saturating_mul(self.den))
    }
}

fn cmp_score(a: &(Frac, Frac), b: &(Frac, Frac)) -> CmpOrdering {
    a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1))
}

/// One cycle of smooth weighted round robin.
///
/// Service `i` with reduced weight `w` takes the positions whose ideal times are
/// `(2k + 1) / (2w)` of the cycle, `k = 0..w`; merging every service's ideal times in order
/// (ties by index) spreads each service evenly through the cycle like nginx's smooth weighted
/// round robin, but in O(W log W) for a cycle of W positions and without per-pick state beyond
/// the cursor. Equal weights give the plain cycle `0, 1, 2, ...`.
fn smooth_order(weights: &[u32]) -> Vec<u32> {
    let ws: Vec<u64> = weights.iter().map(|&w| u64::from(w.max(1))).collect();
    let g = ws.iter().copied().fold(0, gcd).max(1);
    let total: u64 = ws.iter().map(|w| w / g).sum();
    if ws.is_empty() || total > MAX_ORDER_LEN as u64 || u32::try_from(ws.len()).is_err() {
        return Vec::new();
    }
    let mut slots: Vec<(u64, u64, u32)> = Vec::with_capacity(total as usize);
    for (i, w) in ws.iter().enumerate() {
        let w = w / g;
        for k in 0..w {
            // Ideal time (2k+1)/(2w), stored as numerator/denominator for exact ordering.
            slots.push((2 * k + 1, 2 * w, i as u32));
        }
    }
    slots.sort_by(|a, b| {
        (u128::from(a.0) * u128::from(b.1))
            .cmp(&(u128::from(b.0) * u128::from(a.1)))
            .then(a.2.cmp(&b.2))
    });
    slots.into_iter().map(|(_, _, i)| i).collect()
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NON_HASH: [Method; 7] = [
        Method::RoundRobin,
        Method::LeastConnection,
        Method::LeastResponseTime,
        Method::LeastBandwidth,
        Method::LeastPackets,
        Method::Lrtm,
        Method::CustomLoad,
    ];

    fn counters(n: usize) -> Vec<ServiceCounters> {
        (0..n).map(|_| ServiceCounters::new()).collect()
    }

    #[test]
    fn smooth_order_interleaves() {
        assert_eq!(smooth_order(&[1, 1, 1]), vec![0, 1, 2]);
        assert_eq!(smooth_order(&[2, 4]), vec![1, 0, 1]);
        assert_eq!(smooth_order(&[5, 1, 1]), vec![0, 0, 0, 1, 2, 0, 0]);
        assert!(smooth_order(&[]).is_empty());
    }

    #[test]
    fn round_robin_skips_ineligible_without_reordering() {
        let st = MethodState::new(&[1, 1, 1]);
        let c = counters(3);
        let picks: Vec<_> = (0..6)
            .filter_map(|_| pick(Method::RoundRobin, &st, &c, &[1, 1, 1], |i| i != 1, 0))
            .collect();
        assert_eq!(picks, vec![0, 2, 0, 2, 0, 2]);
        assert_eq!(
            pick(Method::RoundRobin, &st, &c, &[1, 1, 1], |_| false, 0),
            None
        );
    }

    #[test]
    fn least_connection_prefers_fewest_per_weight() {
        let st = MethodState::new(&[1, 3]);
        let c = counters(2);
        c[0].open();
        c[1].open();
        c[1].open();
        // (1+1)/1 = 2 versus (2+1)/3 = 1.
        assert_eq!(
            pick(Method::LeastConnection, &st, &c, &[1, 3], |_| true, 0),
            Some(1)
        );
    }

    #[test]
    fn response_time_methods_prefer_faster() {
        let st = MethodState::new(&[1, 1]);
        let c = counters(2);
        c[0].record_response_time(900);
        c[1].record_response_time(300);
        c[0].record_monitor_response_time(100);
        c[1].record_monitor_response_time(500);
        let w = [1, 1];
        assert_eq!(
            pick(Method::LeastResponseTime, &st, &c, &w, |_| true, 0),
            Some(1)
        );
        assert_eq!(pick(Method::Lrtm, &st, &c, &w, |_| true, 0), Some(0));
    }

    #[test]
    fn rate_and_load_methods_prefer_lighter() {
        let st = MethodState::new(&[1, 1]);
        let c = counters(2);
        c[0].record_traffic(10, 5, 0);
        c[1].record_traffic(1000, 1, 0);
        c[0].set_reported_load(70);
        c[1].set_reported_load(20);
        let w = [1, 1];
        assert_eq!(
            pick(Method::LeastBandwidth, &st, &c, &w, |_| true, 0),
            Some(0)
        );
        assert_eq!(
            pick(Method::LeastPackets, &st, &c, &w, |_| true, 0),
            Some(1)
        );
        assert_eq!(pick(Method::CustomLoad, &st, &c, &w, |_| true, 0), Some(1));
    }

    #[test]
    fn ties_rotate() {
        let st = MethodState::new(&[1, 1, 1]);
        let c = counters(3);
        let picks: Vec<_> = (0..6)
            .filter_map(|_| pick(Method::LeastConnection, &st, &c, &[1, 1, 1], |_| true, 0))
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn an_ineligible_service_leaves_its_turns_to_all_the_others() {
        // Service 2 may take only every third request (a new service held back by slow start,
        // or one at max_clients); the other four share the rest evenly, as they would alone.
        for method in NON_HASH {
            let st = MethodState::new(&[1; 5]);
            let c = counters(5);
            let mut counts = [0u32; 5];
            for k in 0..1200 {
                if let Some(i) = pick(method, &st, &c, &[1; 5], |i| i != 2 || k % 3 == 0, 0) {
                    counts[i] += 1;
                }
            }
            let others = [counts[0], counts[1], counts[3], counts[4]];
            let (lo, hi) = (others.iter().min(), others.iter().max());
            assert!(
                hi.zip(lo).is_some_and(|(h, l)| h - l <= 1),
                "{method:?}: {counts:?}"
            );
        }
    }

    #[test]
    fn hash_methods_use_their_fallback() {
        assert_eq!(fallback(Method::UrlHash), Method::RoundRobin);
        assert_eq!(fallback(Method::DomainHash), Method::RoundRobin);
        assert_eq!(fallback(Method::CallIdHash), Method::LeastConnection);
        assert_eq!(fallback(Method::Lrtm), Method::Lrtm);
        let st = MethodState::new(&[1, 1]);
        let c = counters(2);
        c[0].open();
        assert_eq!(
            pick(Method::CallIdHash, &st, &c, &[1, 1], |_| true, 0),
            Some(1)
        );
    }

    #[test]
    fn mismatched_state_still_works() {
        // A state built for another service set degrades to an unweighted cycle.
        let st = MethodState::new(&[1]);
        let c = counters(3);
        let picks: Vec<_> = (0..3)
            .filter_map(|_| pick(Method::RoundRobin, &st, &c, &[], |_| true, 0))
            .collect();
        assert_eq!(picks, vec![0, 1, 2]);
    }

    #[test]
    fn round_robin_is_shared_across_threads() {
        let st = std::sync::Arc::new(MethodState::new(&[1, 2, 1]));
        let c = std::sync::Arc::new(counters(3));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (st, c) = (st.clone(), c.clone());
                std::thread::spawn(move || {
                    let mut counts = [0u32; 3];
                    for _ in 0..10_000 {
                        if let Some(i) = pick(Method::RoundRobin, &st, &c, &[1, 2, 1], |_| true, 0)
                        {
                            counts[i] += 1;
                        }
                    }
                    counts
                })
            })
            .collect();
        let mut total = [0u32; 3];
        for h in handles {
            let counts = h.join().unwrap_or_default();
            (0..3).for_each(|i| total[i] += counts[i]);
        }
        assert_eq!(total.iter().sum::<u32>(), 40_000);
        for (i, want) in [(0, 10_000), (1, 20_000), (2, 10_000)] {
            assert!(total[i].abs_diff(want) <= 200, "{total:?}");
        }
    }

    fn method_strategy() -> impl Strategy<Value = Method> {
        proptest::sample::select(NON_HASH.to_vec())
    }

    proptest! {
        #[test]
        fn only_eligible_chosen(
            method in method_strategy(),
            weights in proptest::collection::vec(0u32..=100, 1..12),
            mask in proptest::collection::vec(any::<bool>(), 12),
            loads in proptest::collection::vec(any::<u32>(), 12),
            now in any::<u64>(),
        ) {
            let n = weights.len();
            let st = MethodState::new(&weights);
            let c = counters(n);
            for (i, ctr) in c.iter().enumerate() {
                ctr.set_reported_load(loads[i]);
                ctr.record_response_time(u64::from(loads[i]));
                ctr.record_traffic(u64::from(loads[i]), 1, now);
            }
            for _ in 0..50 {
                let got = pick(method, &st, &c, &weights, |i| mask[i], now);
                match got {
                    Some(i) => {
                        prop_assert!(i < n && mask[i]);
                        c[i].open();
                    }
                    None => prop_assert!(!mask[..n].iter().any(|&m| m)),
                }
            }
        }

        #[test]
        fn deterministic(
            method in method_strategy(),
            weights in proptest::collection::vec(1u32..=20, 1..8),
            actives in proptest::collection::vec(0u64..5, 8),
        ) {
            let run = || {
                let st = MethodState::new(&weights);
                let c = counters(weights.len());
                for (i, ctr) in c.iter().enumerate() {
                    for _ in 0..actives[i] { ctr.open(); }
                }
                (0..40)
                    .map(|_| {
                        let p = pick(method, &st, &c, &weights, |_| true, 0);
                        if let Some(i) = p { c[i].open(); }
                        p
                    })
                    .collect::<Vec<_>>()
            };
            prop_assert_eq!(run(), run());
        }

        #[test]
        fn weights_respected(
            method in proptest::sample::select(vec![Method::RoundRobin, Method::LeastConnection]),
            weights in proptest::collection::vec(1u32..=10, 1..6),
        ) {
            // Round robin counts picks; least connection accumulates open connections (none
            // close), so both must split in proportion to the weights.
            let st = MethodState::new(&weights);
            let c = counters(weights.len());
            let total_w: u32 = weights.iter().sum();
            let rounds = 20;
            let mut counts = vec![0u32; weights.len()];
            for _ in 0..(total_w * rounds) {
                if let Some(i) = pick(method, &st, &c, &weights, |_| true, 0) {
                    counts[i] += 1;
                    c[i].open();
                }
            }
            for (i, &w) in weights.iter().enumerate() {
                let expected = w * rounds;
                prop_assert!(counts[i].abs_diff(expected) <= 1,
                    "service {} got {} expected {}", i, counts[i], expected);
            }
        }
    }
}
