//! `simulate_hash` through the public API: small sizes always, issue 3's 1M-key measurement
//! runs on demand (`cargo test --release --test simulate_hash -- --ignored --nocapture`).

use std::time::Instant;

use fulcrum::config::HashAlgorithm;
use fulcrum::select::HashSelector;
use fulcrum::simulate::hash::{HashSimParams, render_text, simulate_hash, synthetic_member};

#[test]
fn small_simulation_of_each_algorithm() {
    for (name, alg) in HashAlgorithm::ALL {
        let r = simulate_hash(&HashSimParams {
            algorithm: alg,
            services: 30,
            keys: 30_000,
            fingers: 128,
            seed: 42,
        });
        assert_eq!(r.algorithm, name);
        assert_eq!(r.remove_foreign_moved, 0);
        assert!(r.restore_exact);
        assert!(r.memory_bytes > 0);
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.starts_with("{\"algorithm\":"), "{json}");
        assert!(render_text(&r).contains("restore exact"));
    }
}

/// Issue 3's target runs: n = 1000, 1M keys. `FULCRUM_SIM=prac:1024` runs one configuration.
#[test]
#[ignore = "measurement run: use --release"]
fn measure_issue3_targets() {
    let runs: Vec<(HashAlgorithm, u32)> = match std::env::var("FULCRUM_SIM") {
        Ok(spec) => spec
            .split(',')
            .filter_map(|one| {
                let (a, f) = one.split_once(':')?;
                let alg = HashAlgorithm::ALL.iter().find(|(n, _)| *n == a)?.1;
                Some((alg, f.parse().ok()?))
            })
            .collect(),
        Err(_) => vec![
            (HashAlgorithm::Carp, 256),
            (HashAlgorithm::Prac, 256),
            (HashAlgorithm::Prac, 1024),
            (HashAlgorithm::Jarh, 256),
            (HashAlgorithm::Jarh, 1024),
        ],
    };
    for (alg, fingers) in runs {
        let r = simulate_hash(&HashSimParams {
            algorithm: alg,
            services: 1000,
            keys: 1_000_000,
            fingers,
            seed: 1,
        });
        println!("{}", serde_json::to_string(&r).unwrap());
    }
}

/// Table build and health-change rebuild times at n = 1000 (issue 3: <= 50 ms).
#[test]
#[ignore = "measurement run: use --release"]
fn measure_rebuild_times() {
    let members: Vec<_> = (0..1000).map(synthetic_member).collect();
    let all_up = vec![true; 1000];
    let mut one_down = all_up.clone();
    one_down[500] = false;
    for alg in [
        HashAlgorithm::Carp,
        HashAlgorithm::Prac,
        HashAlgorithm::Jarh,
    ] {
        for fingers in [256u32, 1024] {
            for (label, up) in [("all up", &all_up), ("one down", &one_down)] {
                let mut times = Vec::new();
                for _ in 0..5 {
                    let t = Instant::now();
                    let sel = HashSelector::build(alg, fingers, &members, up);
                    times.push(t.elapsed().as_secs_f64() * 1e3);
                    std::hint::black_box(sel);
                }
                times.sort_by(f64::total_cmp);
                println!(
                    "build {} fingers {fingers} {label}: median {:.1} ms (min {:.1})",
                    alg.name(),
                    times[2],
                    times[0]
                );
            }
        }
    }
}

/// Profiling aid: one prac build at n = 1000, fingers 256.
#[test]
#[ignore = "profiling aid: use --release"]
fn one_prac_build() {
    let members: Vec<_> = (0..1000).map(synthetic_member).collect();
    let sel = HashSelector::build(HashAlgorithm::Prac, 256, &members, &vec![true; 1000]);
    std::hint::black_box(sel);
}
