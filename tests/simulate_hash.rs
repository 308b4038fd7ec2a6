//! `simulate_hash` through the public API: small sizes always, the 1M-key measurement of
//! docs/hashing.md, Targets,
//! runs on demand (`cargo test --release --test simulate_hash -- --ignored --nocapture`).

mod common;

use common::ConfigFile;
use fulcrum::config::HashAlgorithm;
use fulcrum::select::HashSelector;
use fulcrum::simulate::hash::{HashSimParams, render_text, simulate_hash, synthetic_member};
use std::time::Instant;

#[test]
fn small_simulation_of_each_algorithm() {
    for (name, alg) in HashAlgorithm::ALL {
        let r = simulate_hash(&HashSimParams {
            algorithm: alg,
            services: 30,
            keys: 30_000,
            fingers: 128,
            prac_max_share: fulcrum::config::PracMaxShare::DEFAULT,
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

/// The target runs (docs/hashing.md, Targets): n = 1000, 1M keys. `FULCRUM_SIM=prac:1024` runs one configuration.
#[test]
#[ignore = "measurement run: use --release"]
fn measure_hash_targets() {
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
            prac_max_share: fulcrum::config::PracMaxShare::DEFAULT,
            seed: 1,
        });
        println!("{}", serde_json::to_string(&r).unwrap());
    }
}

/// Table build and health-change rebuild times at n = 1000 (docs/hashing.md, Targets: <= 50 ms).
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
                let (median, min) =
                    five_runs_ms(|| HashSelector::build(alg, fingers, &members, up));
                println!(
                    "build {} fingers {fingers} {label}: median {median:.1} ms (min {min:.1})",
                    alg.name()
                );
            }
            // A health change: one service DOWN, from the all-UP selector (what the balancer
            // does on UP/DOWN).
            let whole = HashSelector::build(alg, fingers, &members, &all_up);
            let (median, min) = five_runs_ms(|| whole.with_up(&one_down));
            println!(
                "health change {} fingers {fingers} one down: median {median:.1} ms (min {min:.1})",
                alg.name()
            );
        }
    }
}

/// Wall time of five runs of `build`: (median, min) in ms.
fn five_runs_ms(mut build: impl FnMut() -> HashSelector) -> (f64, f64) {
    let mut times: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(build());
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    (times[2], times[0])
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
/// others, so one count alone can flatter or hurt). `FULCRUM_SWEEP=lo..hi`, default 996..1008;
/// `FULCRUM_FINGERS`, `FULCRUM_MAX_SHARE` (lb.prac_max_share).
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
    // `FULCRUM_MAX_SHARE=1.05`: lb.prac_max_share (default 1.005).
    let max_share = std::env::var("FULCRUM_MAX_SHARE")
        .ok()
        .and_then(|v| v.parse().ok())
        .and_then(fulcrum::config::PracMaxShare::from_ratio)
        .unwrap_or(fulcrum::config::PracMaxShare::DEFAULT);
    let (mut sum, mut worst, mut foreign_sum, mut share_worst) = (0.0, 0.0f64, 0u64, 0.0f64);
    for n in lo..=hi {
        let r = simulate_hash(&HashSimParams {
            algorithm: HashAlgorithm::Prac,
            services: n,
            keys: 1_000_000,
            fingers,
            prac_max_share: max_share,
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
        "prac fingers {fingers} max share {} n {lo}..{hi}: mean add_moved_ratio {:.3}, worst {worst:.3}, mean worst-trial foreign {:.0}, worst share {share_worst:.4}",
        max_share.ratio(),
        sum / count,
        foreign_sum as f64 / count
    );
}

/// `--prac-max-share` reaches the table (and the report), within its range only.
#[test]
fn simulate_hash_takes_the_prac_bound() {
    let out = fulcrum(&[
        "simulate",
        "hash",
        "--algorithm",
        "prac",
        "--services",
        "300",
        "--keys",
        "20000",
        "--prac-max-share",
        "1.1",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(v["prac_max_share"], 1.1);
    let share = v["share_peak_to_mean"].as_f64().expect("share");
    assert!(share > 1.01 && share <= 1.1, "{share}");
    let out = fulcrum(&[
        "simulate",
        "hash",
        "--algorithm",
        "prac",
        "--services",
        "3",
        "--prac-max-share",
        "2",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("1.005..=1.5"));
}

/// `lb.prac_max_share` holds for a light service beside a heavy one (its share is only a few
/// dozen slots; these identities measured 1.0625 before its cap was clamped to the bound).
#[test]
fn the_prac_bound_holds_for_light_services() {
    let file = ConfigFile::new(
        "praclight",
        "lb: { hash_algorithm: prac, prac_max_share: 1.05 }\n\
         services:\n\
         \x20 - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }\n\
         \x20 - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }\n\
         \x20 - { name: c, address: 127.0.0.1:5073, protocol: sip-udp, weight: 30 }\n\
         vservers:\n\
         \x20 - { name: v, protocol: sip-udp, bind: 127.0.0.1:5060, method: call_id_hash, services: [a, b, c] }\n",
    );
    let v = simulate_json(file.arg());
    assert_eq!(v["prac_max_share"], 1.05);
    for s in v["per_service"].as_array().expect("per service") {
        let r = s["share_to_expected"].as_f64().expect("ratio");
        assert!(r <= 1.05, "{}: {r}", s["name"]);
    }
}

fn fulcrum(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_fulcrum"))
        .args(args)
        .output()
        .expect("run fulcrum")
}

/// `simulate hash --config PATH --keys 40000 --json`: it succeeds; its JSON report.
fn simulate_json(path: &str) -> serde_json::Value {
    let out = fulcrum(&[
        "simulate", "hash", "--config", path, "--keys", "40000", "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON report")
}

/// `simulate hash --config`: the vserver's own services, weights and hash_id identities, the
/// config's algorithm; a weight-2 service gets about twice the share of a weight-1 one, and a
/// hash_id service keeps its keys under a new name and address but not under a new hash_id.
#[test]
fn simulate_hash_from_a_config() {
    let file = ConfigFile::new(
        "simcfg",
        "lb: { hash_algorithm: prac, hash_fingers: 64 }\n\
         services:\n\
         \x20 - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }\n\
         \x20 - { name: b, address: 127.0.0.1:5072, protocol: sip-udp, weight: 2 }\n\
         \x20 - { name: c, address: 127.0.0.1:5073, protocol: sip-udp, hash_id: fw-c }\n\
         vservers:\n\
         \x20 - { name: lb, protocol: sip-udp, bind: [127.0.0.1:5060], method: call_id_hash, services: [a, b, c] }\n\
         \x20 - { name: rr, protocol: sip-udp, bind: [127.0.0.1:5061], method: round_robin, services: [a, b] }\n",
    );
    let p = file.arg();
    let v = simulate_json(p);
    assert_eq!(v["algorithm"], "prac");
    assert_eq!(v["fingers"], 64);
    assert_eq!(v["services"], 3);
    let per = v["per_service"].as_array().unwrap();
    let names: Vec<&str> = per.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["a", "b", "c"]);
    assert_eq!(per[2]["hash_id"], "fw-c");
    assert_eq!(per[1]["expected_share"], 0.5);
    for s in per {
        let ratio = s["share_to_expected"].as_f64().unwrap();
        assert!((ratio - 1.0).abs() < 0.01, "{s}");
    }
    let keys = |i: usize| per[i]["keys"].as_f64().unwrap();
    let twice = keys(1) / keys(0);
    assert!((1.8..2.2).contains(&twice), "weight 2 gets {twice}x");
    assert!(v["restore_exact"].as_bool().unwrap());

    // Overrides, and the text table.
    let out = fulcrum(&[
        "simulate",
        "hash",
        "--config",
        p,
        "--vserver",
        "lb",
        "--algorithm",
        "jarh",
        "--keys",
        "10000",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("algorithm jarh"), "{text}");
    assert!(text.contains("127.0.0.1:5072"), "{text}");

    // The same identity gives the same choices: renaming or readdressing a hash_id service
    // changes nothing, its hash_id does.
    let renamed = std::fs::read_to_string(&file.path)
        .unwrap()
        .replace(
            "name: c, address: 127.0.0.1:5073",
            "name: z, address: 127.0.0.1:6000",
        )
        .replace("[a, b, c]", "[a, b, z]");
    let path2 = file.beside("renamed.yaml", &renamed);
    let v2 = simulate_json(path2.to_str().unwrap());
    for i in 0..3 {
        assert_eq!(v2["per_service"][i]["keys"], per[i]["keys"]);
    }
    let rekeyed = std::fs::read_to_string(&file.path)
        .unwrap()
        .replace("fw-c", "fw-d");
    let path3 = file.beside("rekeyed.yaml", &rekeyed);
    let v3 = simulate_json(path3.to_str().unwrap());
    assert!(
        (0..3).any(|i| v3["per_service"][i]["keys"] != per[i]["keys"]),
        "a new hash_id is a new identity"
    );

    // A vserver that does not hash, an unknown one, and a bad file are clear errors.
    let out = fulcrum(&["simulate", "hash", "--config", p, "--vserver", "rr"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("round_robin") && err.contains("lb"), "{err}");
    let out = fulcrum(&["simulate", "hash", "--config", p, "--vserver", "nope"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no vserver named \"nope\""));
    let bad = file.beside("bad.yaml", "lb: { hash_fingers: 0 }\n");
    let out = fulcrum(&["simulate", "hash", "--config", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad.yaml:1:"));
}

/// `simulate hash --config` with a backup service: the primary tier is simulated (its shares
/// sum to one), the backup is listed in its tier with no key.
#[test]
fn simulate_hash_from_a_config_lists_backups_with_no_share() {
    let file = ConfigFile::new(
        "simbackup",
        "services:\n\
         \x20 - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }\n\
         \x20 - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }\n\
         \x20 - { name: z, address: 127.0.0.1:5079, protocol: sip-udp, backup: true }\n\
         vservers:\n\
         \x20 - { name: v, protocol: sip-udp, bind: [127.0.0.1:5060], method: aor_hash, services: [a, z, b] }\n",
    );
    let v = simulate_json(file.arg());
    let per = v["per_service"].as_array().expect("per service");
    let tiers: Vec<(&str, &str)> = per
        .iter()
        .map(|s| (s["name"].as_str().unwrap(), s["tier"].as_str().unwrap()))
        .collect();
    assert_eq!(tiers, [("a", "primary"), ("b", "primary"), ("z", "backup")]);
    assert_eq!(per[2]["keys"], 0);
    let shares: f64 = per.iter().map(|s| s["share"].as_f64().unwrap()).sum();
    assert!((shares - 1.0).abs() < 1e-9, "{shares}");
}

/// `simulate hash` over each side of config/firewall.yaml (two `protocol: ip` vservers): the
/// firewalls' shares by hash_id, alike on both sides (the legs of one firewall share it).
#[test]
fn simulate_hash_over_the_firewall_sandwich() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config/firewall.yaml");
    let side = |v: &str| {
        let out = fulcrum(&[
            "simulate",
            "hash",
            "--config",
            path,
            "--vserver",
            v,
            "--keys",
            "40000",
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
        j["per_service"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|s| (s["hash_id"].to_string(), s["keys"].as_u64().unwrap_or(0)))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    let (outside, inside) = (side("outside"), side("inside"));
    assert_eq!(outside.len(), 3, "{outside:?}");
    assert_eq!(outside, inside, "both sides rank the firewalls alike");
}
