//! Lookup cost of carp, prac and jarh beside straightforward reference versions of ring hash
//! (ketama, 160 points per service), jump consistent hash and Maglev (table 65,537), on the same
//! pre-hashed keys, in one run. Also the table build times of prac and jarh.
//!
//! `cargo bench --bench consistent` (BENCHMARKS.md records the figures).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group};
use fulcrum::config::HashAlgorithm;
use fulcrum::hash::mix64;
use fulcrum::select::{HashSelector, Member};
use fulcrum::simulate::hash::{synthetic_key_hashes, synthetic_member};
use xxhash_rust::xxh3::xxh3_64_with_seed;

const KEYS: usize = 1 << 14;

/// Reference ring hash: 160 points per service, binary search.
struct Ketama {
    points: Vec<(u64, u32)>,
}

impl Ketama {
    fn new(members: &[Member]) -> Ketama {
        let mut points = Vec::with_capacity(members.len() * 160);
        for (i, m) in members.iter().enumerate() {
            for j in 0..160u64 {
                let mut buf = [0u8; 16];
                buf[..8].copy_from_slice(&m.id_hash.to_le_bytes());
                buf[8..].copy_from_slice(&j.to_le_bytes());
                points.push((xxh3_64_with_seed(&buf, 0), i as u32));
            }
        }
        points.sort_unstable();
        Ketama { points }
    }

    fn get(&self, key: u64) -> u32 {
        let i = self.points.partition_point(|p| p.0 < key);
        let i = if i == self.points.len() { 0 } else { i };
        self.points[i].1
    }
}

/// Jump consistent hash (Lamping and Veach 2014).
fn jump(mut key: u64, buckets: i64) -> i64 {
    let (mut b, mut j) = (-1i64, 0i64);
    while j < buckets {
        b = j;
        key = key.wrapping_mul(2862933555777941757).wrapping_add(1);
        j = ((b + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
    }
    b
}

/// Reference Maglev table (Eisenbud et al. 2016), M = 65,537.
struct Maglev {
    table: Vec<u32>,
}

impl Maglev {
    const M: u64 = 65_537;

    fn new(members: &[Member]) -> Maglev {
        let n = members.len();
        let perm: Vec<(u64, u64)> = members
            .iter()
            .map(|m| {
                (
                    mix64(m.id_hash) % Self::M,
                    mix64(m.id_hash ^ 0x5555) % (Self::M - 1) + 1,
                )
            })
            .collect();
        let mut next = vec![0u64; n];
        let mut table = vec![u32::MAX; Self::M as usize];
        let mut filled = 0u64;
        'outer: loop {
            for i in 0..n {
                let (off, skip) = perm[i];
                let mut c = (off + next[i] * skip) % Self::M;
                while table[c as usize] != u32::MAX {
                    next[i] += 1;
                    c = (off + next[i] * skip) % Self::M;
                }
                table[c as usize] = i as u32;
                next[i] += 1;
                filled += 1;
                if filled == Self::M {
                    break 'outer;
                }
            }
        }
        Maglev { table }
    }

    fn get(&self, key: u64) -> u32 {
        self.table[(key % Self::M) as usize]
    }
}

fn config(c: &mut Criterion) -> &mut Criterion {
    c
}

fn lookups(c: &mut Criterion) {
    let keys = synthetic_key_hashes(KEYS, 3);
    let mut g = config(c).benchmark_group("lookup");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    for n in [100usize, 1000] {
        let members: Vec<Member> = (0..n).map(synthetic_member).collect();
        let up = vec![true; n];
        for (name, alg) in HashAlgorithm::ALL {
            let sel = HashSelector::build(alg, 256, &members, &up);
            g.bench_with_input(BenchmarkId::new(name, n), &sel, |b, sel| {
                let mut i = 0usize;
                b.iter(|| {
                    i = (i + 1) & (KEYS - 1);
                    black_box(sel.pick(black_box(keys[i]), |_| true))
                })
            });
        }
        let ring = Ketama::new(&members);
        g.bench_with_input(BenchmarkId::new("ketama160", n), &ring, |b, r| {
            let mut i = 0usize;
            b.iter(|| {
                i = (i + 1) & (KEYS - 1);
                black_box(r.get(black_box(keys[i])))
            })
        });
        g.bench_with_input(BenchmarkId::new("jump", n), &n, |b, n| {
            let mut i = 0usize;
            b.iter(|| {
                i = (i + 1) & (KEYS - 1);
                black_box(jump(black_box(keys[i]), *n as i64))
            })
        });
        let maglev = Maglev::new(&members);
        g.bench_with_input(BenchmarkId::new("maglev65537", n), &maglev, |b, m| {
            let mut i = 0usize;
            b.iter(|| {
                i = (i + 1) & (KEYS - 1);
                black_box(m.get(black_box(keys[i])))
            })
        });
    }
    // prac and jarh at their largest table resolution and a large pool.
    for (n, fingers) in [(1000usize, 1024u32), (4096, 256)] {
        let members: Vec<Member> = (0..n).map(synthetic_member).collect();
        let up = vec![true; n];
        for alg in [HashAlgorithm::Prac, HashAlgorithm::Jarh] {
            let sel = HashSelector::build(alg, fingers, &members, &up);
            let id = format!("{}-f{fingers}", alg.name());
            g.bench_with_input(BenchmarkId::new(id, n), &sel, |b, sel| {
                let mut i = 0usize;
                b.iter(|| {
                    i = (i + 1) & (KEYS - 1);
                    black_box(sel.pick(black_box(keys[i]), |_| true))
                })
            });
        }
    }
    g.finish();
}

fn builds(c: &mut Criterion) {
    let mut g = c.benchmark_group("build");
    g.warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10);
    let n = 1000;
    let members: Vec<Member> = (0..n).map(synthetic_member).collect();
    let up = vec![true; n];
    let mut one_down = up.clone();
    one_down[n / 2] = false;
    for alg in [HashAlgorithm::Prac, HashAlgorithm::Jarh] {
        for (label, mask) in [("all-up", &up), ("one-down", &one_down)] {
            let id = format!("{}-{label}", alg.name());
            g.bench_with_input(BenchmarkId::new(id, n), mask, |b, mask| {
                b.iter(|| black_box(HashSelector::build(alg, 256, &members, mask)))
            });
        }
    }
    g.finish();
}

/// Median time per lookup over batches of 1,024 lookups, for every algorithm on the same keys.
/// A batch lasts microseconds, so on a shared, loaded machine most batches run without being
/// preempted and the median shows the undisturbed cost, where criterion's millisecond samples
/// absorb the scheduler's time slices.
fn batch_medians() {
    fn median_ns(mut f: impl FnMut(u64) -> u64, keys: &[u64]) -> f64 {
        let mut samples = Vec::new();
        for round in 0..400 {
            let t = Instant::now();
            let mut acc = 0u64;
            for k in keys.iter().skip((round * 1024) % (KEYS - 1024)).take(1024) {
                acc = acc.wrapping_add(f(black_box(*k)));
            }
            black_box(acc);
            samples.push(t.elapsed().as_nanos() as f64 / 1024.0);
        }
        samples.sort_by(f64::total_cmp);
        samples[samples.len() / 2]
    }
    let keys = synthetic_key_hashes(KEYS, 3);
    println!("batch medians (ns per lookup, median of 400 batches of 1,024 lookups)");
    println!(
        "{:<16}{:>10}{:>10}{:>10}",
        "algorithm", "n=100", "n=1000", "n=4096"
    );
    let ns = [100usize, 1000, 4096];
    let sets: Vec<Vec<Member>> = ns
        .iter()
        .map(|n| (0..*n).map(synthetic_member).collect())
        .collect();
    let row = |name: &str, f: &mut dyn FnMut(&[Member]) -> f64| {
        let cells: Vec<String> = sets.iter().map(|m| format!("{:>10.2}", f(m))).collect();
        println!("{name:<16}{}", cells.join(""));
    };
    for (name, alg) in HashAlgorithm::ALL {
        for fingers in [256u32, 1024] {
            if alg == HashAlgorithm::Carp && fingers == 1024 {
                continue;
            }
            let label = format!("{name}-f{fingers}");
            row(&label, &mut |m: &[Member]| {
                let sel = HashSelector::build(alg, fingers, m, &vec![true; m.len()]);
                median_ns(
                    |k| sel.pick(k, |_| true).map_or(0, |(i, _)| i as u64),
                    &keys,
                )
            });
        }
    }
    row("ketama160", &mut |m: &[Member]| {
        let r = Ketama::new(m);
        median_ns(|k| u64::from(r.get(k)), &keys)
    });
    row("jump", &mut |m: &[Member]| {
        let n = m.len() as i64;
        median_ns(|k| jump(k, n) as u64, &keys)
    });
    row("maglev65537", &mut |m: &[Member]| {
        let t = Maglev::new(m);
        median_ns(|k| u64::from(t.get(k)), &keys)
    });
}

criterion_group!(benches, lookups, builds);

fn main() {
    batch_medians();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
