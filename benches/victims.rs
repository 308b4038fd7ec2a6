//! The cost of choosing an idle client to evict when the open-file pool runs low
//! ([`fulcrum::victims::VictimIndex`]), with 100,000 and 500,000 clients indexed.
//!
//! Each iteration is one eviction as an accept under pressure makes it: the victim is
//! chosen and taken out, and the new client takes its place (inserted, so the count stays
//! the same). Between choices one client in 20 speaks (its true stamp moves forward
//! without the index being told, as a connection's keep-alive does), so the choice also
//! pays the lazy re-keying of those it finds moved on. Clients are a mix of classes
//! (three quarters proven, a tenth registered, the rest unproven) with last activity spread
//! over an hour.
//!
//! Beside it, `victim_scan`: the same choice by looking at every client, as it was made
//! before the index.
//!
//! `cargo bench --bench victims` (BENCHMARKS.md records the figures).

use std::cell::Cell;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use fulcrum::budget::class::{PROVEN, REGISTERED, UNPROVEN};
use fulcrum::victims::{Rank, VictimIndex};

/// A small deterministic generator (xorshift64*), so runs index the same clients.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

const HOUR_NS: u64 = 3_600_000_000_000;

/// `n` clients' true ranks, and an index of them.
fn clients(n: usize, rng: &mut Rng) -> (Vec<Cell<Rank>>, VictimIndex<usize>) {
    let ranks: Vec<Cell<Rank>> = (0..n)
        .map(|_| {
            let class = match rng.next() % 20 {
                0..=2 => UNPROVEN,
                3..=4 => REGISTERED,
                _ => PROVEN,
            };
            Cell::new((class, rng.next() % HOUR_NS))
        })
        .collect();
    let mut ix = VictimIndex::new();
    for (i, r) in ranks.iter().enumerate() {
        ix.insert(i as u64, r.get(), i);
    }
    (ranks, ix)
}

fn choose(c: &mut Criterion) {
    let mut g = c.benchmark_group("victim_choice");
    for n in [100_000usize, 500_000] {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ n as u64);
        let (ranks, mut ix) = clients(n, &mut rng);
        let mut now = HOUR_NS;
        let mut next_id = n as u64;
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                now += 100_000;
                // One client in 20 spoke since the last choice.
                if rng.next().is_multiple_of(20) {
                    let r = &ranks[(rng.next() % n as u64) as usize];
                    r.set((r.get().0, now));
                }
                let (_, slot) = ix
                    .pop_victim(|&i| ranks[i].get())
                    .expect("the index is never empty");
                black_box(slot);
                // The new client takes the victim's place.
                ranks[slot].set((UNPROVEN, now));
                ix.insert(next_id, (UNPROVEN, now), slot);
                next_id += 1;
            });
        });
        assert_eq!(ix.len(), n);
    }
    g.finish();
}

/// What the index replaced, as a lower bound: the first victim found by looking at every
/// client's rank in a plain vector (the registries were concurrent maps, slower to walk).
fn scan(c: &mut Criterion) {
    let mut g = c.benchmark_group("victim_scan");
    for n in [100_000usize, 500_000] {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ n as u64);
        let (ranks, _) = clients(n, &mut rng);
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                let first = ranks
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (r.get(), i))
                    .min()
                    .expect("clients");
                black_box(first)
            });
        });
    }
    g.finish();
}

criterion_group!(benches, choose, scan);
criterion_main!(benches);
