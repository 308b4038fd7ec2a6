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

/// One table build at n = 1000, for `perf stat -e task-clock` (CPU time, insensitive to other
/// processes sharing the cores). `FULCRUM_BUILD=jarh:1024` picks algorithm and fingers
/// (default prac:256); `FULCRUM_BUILD_DOWN=1` takes one service DOWN.
#[test]
#[ignore = "profiling aid: use --release"]
fn one_build() {
    let spec = std::env::var("FULCRUM_BUILD").unwrap_or_else(|_| "prac:256".to_string());
    let (name, fingers) = spec.split_once(':').unwrap_or(("prac", "256"));
    let alg = HashAlgorithm::ALL
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(HashAlgorithm::Prac, |(_, a)| *a);
    let fingers: u32 = fingers.parse().unwrap_or(256);
    let members: Vec<_> = (0..1000).map(synthetic_member).collect();
    let mut up = vec![true; 1000];
    if std::env::var_os("FULCRUM_BUILD_DOWN").is_some() {
        up[500] = false;
    }
    let sel = HashSelector::build(alg, fingers, &members, &up);
    std::hint::black_box(sel);
}

/// prac's add disruption over a range of service counts (caps change at some counts and not at
/// others, so one count alone can flatter or hurt). `FULCRUM_SWEEP=lo..hi`, default 996..1008.
#[test]
#[ignore = "measurement run: use --release"]
fn measure_prac_add_sweep() {
    let (lo, hi) = std::env::var("FULCRUM_SWEEP")
        .ok()
        .and_then(|v| {
            let (a, b) = v.split_once("..")?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .unwrap_or((996usize, 1008usize));
    let fingers: u32 = std::env::var("FULCRUM_FINGERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let (mut sum, mut worst, mut foreign_sum, mut share_worst) = (0.0, 0.0f64, 0u64, 0.0f64);
    for n in lo..=hi {
        let r = simulate_hash(&HashSimParams {
            algorithm: HashAlgorithm::Prac,
            services: n,
            keys: 1_000_000,
            fingers,
            seed: 1,
        });
        println!(
            "n {n}: add_moved_ratio {:.3} add_foreign_moved {} share {:.4}",
            r.add_moved_ratio, r.add_foreign_moved, r.share_peak_to_mean
        );
        sum += r.add_moved_ratio;
        worst = worst.max(r.add_moved_ratio);
        foreign_sum += r.add_foreign_moved;
        share_worst = share_worst.max(r.share_peak_to_mean);
    }
    let count = (hi + 1 - lo) as f64;
    println!(
        "prac fingers {fingers} n {lo}..{hi}: mean add_moved_ratio {:.3}, worst {worst:.3}, mean worst-trial foreign {:.0}, worst share {share_worst:.4}",
        sum / count,
        foreign_sum as f64 / count
    );
}
