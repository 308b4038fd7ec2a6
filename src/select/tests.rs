use proptest::prelude::*;

use super::*;
use crate::config::HashAlgorithm;
use crate::hash::{address_identity, key_hash, service_hash};

const ALGS: [HashAlgorithm; 3] = [
    HashAlgorithm::Carp,
    HashAlgorithm::Prac,
    HashAlgorithm::Jarh,
];

fn member(i: usize, weight: u32) -> Member {
    let addr =
        std::net::SocketAddr::from(([192, 0, 2, (i % 250) as u8 + 1], 5060 + (i / 250) as u16));
    Member {
        id_hash: service_hash(&address_identity(&addr)),
        weight,
    }
}

fn members(n: usize) -> Vec<Member> {
    (0..n).map(|i| member(i, 1)).collect()
}

fn keys(count: usize, salt: u64) -> Vec<u64> {
    (0..count)
        .map(|i| key_hash(format!("call-{salt}-{i}@example.net").as_bytes()))
        .collect()
}

fn owners(sel: &HashSelector, keys: &[u64]) -> Vec<Option<usize>> {
    keys.iter()
        .map(|k| sel.pick(*k, |_| true).map(|(i, _)| i))
        .collect()
}

/// The failover order's S1/S2/S3 example (docs/methods.md, Selection), with each algorithm's own ranking.
/// Returns whether the example held exactly for this key.
fn worked_example_holds(alg: HashAlgorithm, key: u64) -> bool {
    let m = members(3);
    let all = HashSelector::build(alg, 64, &m, &[true; 3]);
    let r = all.ranking(key);
    let (s1, s2, s3) = (r[0], r[1], r[2]);
    let pick = |up: [bool; 3]| HashSelector::build(alg, 64, &m, &up).pick(key, |_| true);
    let mut up = [true; 3];
    let mut ok = pick(up) == Some((s1, 0));
    up[s1] = false;
    ok &= pick(up) == Some((s2, 1));
    up[s2] = false;
    ok &= pick(up) == Some((s3, 2));
    up[s2] = true;
    ok &= pick(up) == Some((s2, 1));
    up[s1] = true;
    ok &= pick(up) == Some((s1, 0));
    ok
}

#[test]
fn worked_example_s1_s2_s3() {
    let ks = keys(300, 1);
    for alg in ALGS {
        let held = ks.iter().filter(|k| worked_example_holds(alg, **k)).count();
        match alg {
            // prac passes over a next-ranked service at its capped share (documented), so a
            // few slots fail over to the third service; the rest follow the example exactly.
            HashAlgorithm::Prac => assert!(held * 100 >= ks.len() * 85, "{alg:?}: {held}"),
            _ => assert_eq!(held, ks.len(), "{alg:?}"),
        }
    }
}

#[test]
fn prac_never_leaves_a_key_on_a_down_service_and_restores() {
    let m = members(3);
    for k in keys(300, 2) {
        let all = HashSelector::build(HashAlgorithm::Prac, 64, &m, &[true; 3]);
        let first = all.pick(k, |_| true);
        let s1 = all.ranking(k)[0];
        let mut up = [true; 3];
        up[s1] = false;
        let down = HashSelector::build(HashAlgorithm::Prac, 64, &m, &up);
        let (c, pos) = down.pick(k, |_| true).unwrap();
        assert_ne!(c, s1);
        assert_eq!(down.ranking(k).iter().position(|x| *x == c), Some(pos));
        let back = HashSelector::build(HashAlgorithm::Prac, 64, &m, &[true; 3]);
        assert_eq!(back.pick(k, |_| true), first);
    }
}

#[test]
fn empty_and_degenerate_inputs_never_panic() {
    for alg in ALGS {
        let e = HashSelector::build(alg, 0, &[], &[]);
        assert_eq!(e.pick(1, |_| true), None);
        assert!(e.ranking(1).is_empty());
        let one = HashSelector::build(alg, 0, &[member(0, 0)], &[true]);
        assert_eq!(one.pick(u64::MAX, |_| true), Some((0, 0)));
        assert_eq!(one.pick(0, |_| true), Some((0, 0)));
        let none_up = HashSelector::build(alg, u32::MAX, &members(4), &[false; 4]);
        assert_eq!(none_up.pick(5, |_| true), None);
        // A short `up` slice counts the missing services as not UP.
        let short = HashSelector::build(alg, 8, &members(4), &[true]);
        assert_eq!(
            short.pick(5, |_| true),
            Some((0, short.ranking(5).iter().position(|x| *x == 0).unwrap()))
        );
        let ineligible = HashSelector::build(alg, 8, &members(4), &[true; 4]);
        assert_eq!(ineligible.pick(5, |_| false), None);
    }
}

#[test]
fn weight_two_gets_about_twice_the_keys() {
    let mut m = members(5);
    m[2].weight = 2;
    let ks = keys(30_000, 3);
    for alg in ALGS {
        let sel = HashSelector::build(alg, 256, &m, &[true; 5]);
        let mut counts = [0usize; 5];
        for o in owners(&sel, &ks).into_iter().flatten() {
            counts[o] += 1;
        }
        let others = (counts.iter().sum::<usize>() - counts[2]) as f64 / 4.0;
        let ratio = counts[2] as f64 / others;
        assert!(
            (1.75..=2.25).contains(&ratio),
            "{alg:?}: {counts:?} ratio {ratio}"
        );
    }
}

#[test]
fn removing_a_service_moves_only_its_keys() {
    let m = members(40);
    let ks = keys(5_000, 4);
    for alg in ALGS {
        let all = HashSelector::build(alg, 64, &m, &[true; 40]);
        let before = owners(&all, &ks);
        let mut up = [true; 40];
        up[17] = false;
        let after = owners(&HashSelector::build(alg, 64, &m, &up), &ks);
        for (b, a) in before.iter().zip(&after) {
            if *b != Some(17) {
                assert_eq!(b, a, "{alg:?}");
            } else {
                assert_ne!(a, &Some(17));
            }
        }
    }
}

#[test]
fn adding_a_service_moves_keys_only_to_it_for_carp_and_jarh() {
    let m = members(40);
    let mut grown = m.clone();
    grown.push(member(999, 1));
    let ks = keys(5_000, 5);
    for alg in [HashAlgorithm::Carp, HashAlgorithm::Jarh] {
        let before = owners(&HashSelector::build(alg, 64, &m, &[true; 40]), &ks);
        let after = owners(&HashSelector::build(alg, 64, &grown, &[true; 41]), &ks);
        let mut moved = 0;
        for (b, a) in before.iter().zip(&after) {
            if b != a {
                assert_eq!(*a, Some(40), "{alg:?}");
                moved += 1;
            }
        }
        assert!(moved > 0 && moved < ks.len() / 20, "{alg:?} {moved}");
    }
}

#[test]
fn prac_add_moves_few_foreign_keys() {
    let m = members(40);
    let mut grown = m.clone();
    grown.push(member(999, 1));
    let ks = keys(20_000, 6);
    let before = owners(
        &HashSelector::build(HashAlgorithm::Prac, 64, &m, &[true; 40]),
        &ks,
    );
    let after = owners(
        &HashSelector::build(HashAlgorithm::Prac, 64, &grown, &[true; 41]),
        &ks,
    );
    let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count();
    let ideal = ks.len() / 41;
    // prac's capped table cascades a few slots between existing services when one is added
    // (measured 1.44x the ideal here with the bid-ranked fill, 2.25x with the cell-ranked one
    // before it; BENCHMARKS.md has n = 1000). This guards against going back.
    assert!(moved < ideal * 2, "moved {moved} ideal {ideal}");
}

#[test]
fn prac_table_is_balanced_to_the_cap() {
    // A cap is below share + 5/4 slots, at every service count (the share target of
    // docs/hashing.md, Targets, must not hold at one count only).
    for n in 30usize..70 {
        let sel = HashSelector::build(HashAlgorithm::Prac, 64, &members(n), &vec![true; n]);
        let shares = sel.exact_shares().unwrap();
        let slots = (64 * n).next_power_of_two() as f64;
        let mean = slots / n as f64;
        let peak = shares.iter().copied().fold(0.0, f64::max) * slots;
        assert!(peak < mean + 1.25, "n {n}: peak {peak} slots, mean {mean}");
        assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    }
}

/// `lb.prac_max_share` trades balance for disruption: a looser bound keeps every share under
/// it (weights included) and moves fewer keys between existing services when one is added;
/// the default builds exactly the table `build` does.
#[test]
fn a_looser_prac_bound_moves_fewer_foreign_keys_within_the_bound() {
    use crate::config::PracMaxShare;
    let n = 300;
    let mut m = members(n);
    m[7].weight = 3;
    let mut grown = m.clone();
    grown.push(member(9_999, 1));
    let ks = keys(200_000, 8);
    let foreign = |bound: PracMaxShare| {
        let build = |ms: &[Member]| {
            HashSelector::build_bounded(HashAlgorithm::Prac, 256, bound, ms, &vec![true; ms.len()])
        };
        let (small, big) = (build(&m), build(&grown));
        let shares = small.exact_shares().unwrap();
        let total: u32 = m.iter().map(|x| x.weight).sum();
        for (i, s) in shares.iter().enumerate() {
            let fair = f64::from(m[i].weight) / f64::from(total);
            assert!(
                s / fair <= bound.ratio(),
                "{bound:?}: service {i} at {}",
                s / fair
            );
        }
        owners(&small, &ks)
            .iter()
            .zip(owners(&big, &ks))
            .filter(|(b, a)| *b != a && *a != Some(n))
            .count()
    };
    // A light service beside heavy ones keeps the bound too (its share is few slots).
    let mut light = members(3);
    light[2].weight = 30;
    let bound = PracMaxShare::from_ratio(1.05).unwrap();
    let sel = HashSelector::build_bounded(HashAlgorithm::Prac, 256, bound, &light, &[true; 3]);
    for (i, s) in sel.exact_shares().unwrap().iter().enumerate() {
        let fair = f64::from(light[i].weight) / 32.0;
        assert!(
            s / fair <= 1.05,
            "weights 1, 1, 30: service {i} at {}",
            s / fair
        );
    }
    let tight = foreign(PracMaxShare::DEFAULT);
    let loose = foreign(PracMaxShare::from_ratio(1.10).unwrap());
    assert!(tight > 0, "the default cascades a little");
    assert!(
        loose * 4 < tight,
        "foreign moves: {loose} at 1.10, {tight} at 1.005"
    );
    assert_eq!(
        owners(
            &HashSelector::build_bounded(
                HashAlgorithm::Prac,
                256,
                PracMaxShare::DEFAULT,
                &m,
                &vec![true; n]
            ),
            &ks
        ),
        owners(
            &HashSelector::build(HashAlgorithm::Prac, 256, &m, &vec![true; n]),
            &ks
        )
    );
}

fn arb_case() -> impl Strategy<Value = (usize, Vec<bool>, Vec<u32>, u32, Vec<u64>)> {
    (1usize..24).prop_flat_map(|n| {
        (
            Just(n),
            prop::collection::vec(any::<bool>(), n),
            prop::collection::vec(1u32..4, n),
            1u32..48,
            prop::collection::vec(any::<u64>(), 1..40),
        )
    })
}

fn weighted(ws: &[u32]) -> Vec<Member> {
    ws.iter().enumerate().map(|(i, w)| member(i, *w)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn deterministic_and_only_up((n, up, ws, fingers, ks) in arb_case()) {
        let m = weighted(&ws);
        for alg in ALGS {
            let a = HashSelector::build(alg, fingers, &m, &up);
            let b = HashSelector::build(alg, fingers, &m, &up);
            for k in &ks {
                let pa = a.pick(*k, |_| true);
                prop_assert_eq!(pa, b.pick(*k, |_| true));
                match pa {
                    Some((i, pos)) => {
                        prop_assert!(up[i]);
                        prop_assert_eq!(a.ranking(*k)[pos], i);
                    }
                    None => prop_assert!(up.iter().all(|u| !*u)),
                }
                let _ = n;
            }
        }
    }

    #[test]
    fn ranking_covers_every_service_once((n, up, ws, fingers, ks) in arb_case()) {
        let m = weighted(&ws);
        for alg in ALGS {
            let sel = HashSelector::build(alg, fingers, &m, &up);
            for k in &ks {
                let mut r = sel.ranking(*k);
                prop_assert_eq!(r.len(), n);
                r.sort_unstable();
                prop_assert_eq!(r, (0..n).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn carp_and_jarh_pick_the_first_up_eligible_in_ranking((n, up, ws, fingers, ks) in arb_case()) {
        let m = weighted(&ws);
        let eligible = |i: usize| i % 3 != 1;
        for alg in [HashAlgorithm::Carp, HashAlgorithm::Jarh] {
            let sel = HashSelector::build(alg, fingers, &m, &up);
            for k in &ks {
                let want = sel.ranking(*k).into_iter().enumerate()
                    .find(|(_, i)| up[*i] && eligible(*i)).map(|(p, i)| (i, p));
                prop_assert_eq!(sel.pick(*k, eligible), want);
            }
        }
        let _ = n;
    }

    #[test]
    fn with_up_equals_a_fresh_build((n, up, ws, fingers, ks) in arb_case()) {
        // A health change derives the selector from the current one (prac reuses its all-UP
        // table); it must choose exactly as a selector built from scratch for that UP set,
        // from any earlier UP set (here: all UP, and the UP set itself back to all UP).
        let m = weighted(&ws);
        let all_up = vec![true; n];
        for alg in ALGS {
            let fresh = HashSelector::build(alg, fingers, &m, &up);
            let derived = HashSelector::build(alg, fingers, &m, &all_up).with_up(&up);
            let back = fresh.with_up(&all_up);
            let whole = HashSelector::build(alg, fingers, &m, &all_up);
            for k in &ks {
                prop_assert_eq!(derived.pick(*k, |_| true), fresh.pick(*k, |_| true));
                prop_assert_eq!(derived.ranking(*k), fresh.ranking(*k));
                prop_assert_eq!(back.pick(*k, |_| true), whole.pick(*k, |_| true));
            }
            prop_assert_eq!(derived.exact_shares(), fresh.exact_shares());
        }
    }

    #[test]
    fn prac_respects_eligibility((n, up, ws, fingers, ks) in arb_case()) {
        let m = weighted(&ws);
        let sel = HashSelector::build(HashAlgorithm::Prac, fingers, &m, &up);
        let eligible = |i: usize| i.is_multiple_of(2);
        let any = (0..n).any(|i| up[i] && eligible(i));
        for k in &ks {
            match sel.pick(*k, eligible) {
                Some((i, pos)) => {
                    prop_assert!(up[i] && eligible(i));
                    prop_assert_eq!(sel.ranking(*k)[pos], i);
                }
                None => prop_assert!(!any),
            }
        }
    }

    #[test]
    fn down_services_move_only_their_keys_and_restore((n, up, ws, fingers, ks) in arb_case()) {
        let m = weighted(&ws);
        let all_up = vec![true; n];
        for alg in ALGS {
            let all = HashSelector::build(alg, fingers, &m, &all_up);
            let health = HashSelector::build(alg, fingers, &m, &up);
            for k in &ks {
                let (b, _) = all.pick(*k, |_| true).unwrap();
                if up[b] {
                    prop_assert_eq!(health.pick(*k, |_| true).map(|x| x.0), Some(b));
                }
            }
            let back = HashSelector::build(alg, fingers, &m, &all_up);
            for k in &ks {
                prop_assert_eq!(back.pick(*k, |_| true), all.pick(*k, |_| true));
            }
        }
    }
}

#[test]
fn carp_all_up_fast_path_matches_ranking() {
    let ks = keys(200, 9);
    for n in 1..14 {
        let sel = HashSelector::build(HashAlgorithm::Carp, 1, &members(n), &vec![true; n]);
        for k in &ks {
            assert_eq!(sel.pick(*k, |_| true), Some((sel.ranking(*k)[0], 0)));
        }
    }
}
