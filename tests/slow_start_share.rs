//! Where the requests slow start withholds from a new service go: to the other services as the
//! vserver's method shares them among those services alone (docs/slow_start.md, "Where the
//! withheld requests go").
//!
//! The property test runs the same request stream twice through the real
//! [`fulcrum::slow_start::SlowStart::route`] and [`fulcrum::methods::pick`]: once with the new
//! service, once without it, fed only the requests the new service did not take. Every other
//! service must get the same number of requests in every one-second window of both runs, give
//! or take one.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::time::Duration;

use fulcrum::config::{Method, RateUnit, SlowStart as SlowStartParams};
use fulcrum::methods::{self, MethodState};
use fulcrum::simulate::slow_start::{SimResult, render_table, run_scenario};
use fulcrum::slow_start::SlowStart;
use fulcrum::stats::{NANOS_PER_SEC, Nanos, ServiceCounters};
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

fn method_name(m: Method) -> &'static str {
    match m {
        Method::RoundRobin => "round_robin",
        Method::LeastConnection => "least_connection",
        Method::LeastResponseTime => "least_response_time",
        Method::LeastBandwidth => "least_bandwidth",
        Method::LeastPackets => "least_packets",
        Method::Lrtm => "lrtm",
        Method::CustomLoad => "custom_load",
        _ => "hash",
    }
}

fn fixture(path: &str) -> String {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// Asserts that the named services got the same rate, within one request, in every row.
fn assert_equal_rows(r: &SimResult, services: &[&str], one_request: f64, what: &str) {
    for row in &r.rows {
        let rates: Vec<f64> = services
            .iter()
            .map(|s| {
                row.rates
                    .get(*s)
                    .copied()
                    .unwrap_or_else(|| panic!("{what}: no {s} at t={}", row.t))
            })
            .collect();
        let (lo, hi) = rates
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        assert!(
            hi - lo <= one_request + 1e-9,
            "{what}: at t={} the others got {rates:?}\n{}",
            row.t,
            render_table(r)
        );
    }
}

/// The reported case: least_connection, unit percent, every service idle (all tied). Service5
/// takes p% of an existing service's share; Service1..4 share the rest evenly, whatever the
/// method.
#[test]
fn withheld_requests_are_shared_evenly() {
    let yaml = fixture("fixtures/slowstart/least_connection_percent.yaml");
    let others = ["Service1", "Service2", "Service3", "Service4"];
    let one_request = 1.0 / 5.0;
    for method in NON_HASH {
        for hold in ["", "hold: 1s\n"] {
            let yaml = yaml.replace("least_connection", method_name(method)) + hold;
            let what = format!("{} {hold}", method_name(method));
            let r = run_scenario(&yaml).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_equal_rows(&r, &others, one_request, &what);
            // Service5 itself follows the percent example: ≈ 5.88 req/s over the first 5 s
            // (p = 25: 100 × 0.25 / 4.25), its full share of 20 from 15 s, out at 20 s.
            let new = r.rate(5.0, "Service5").unwrap_or(f64::NAN);
            assert!((new - 5.88).abs() <= one_request, "{what}: {new}");
            assert_eq!(r.rate(20.0, "Service5"), Some(20.0), "{what}");
            assert_eq!(r.exits.len(), 1, "{what}: {:?}", r.exits);
            assert_eq!(r.exits[0].t, 20.0, "{what}");
        }
    }
}

/// One scenario of the property test.
#[derive(Debug, Clone)]
struct Case {
    method: Method,
    /// Weights of the services present from the start.
    weights: Vec<u32>,
    new_weight: u32,
    /// Index of the new service in the vserver's list (the others keep their relative order).
    new_at: usize,
    /// Second at which the new service joins.
    added_s: u64,
    unit: RateUnit,
    rate: u32,
    interval_s: u64,
    offered_rate: u64,
    hold_ms: u64,
    secs: u64,
    /// Per existing service: a response time (µs) and a load for the methods that read them,
    /// measured before the new service arrives. The new service has neither at first: it has
    /// just come up.
    measured: Vec<(u64, u32)>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        proptest::sample::select(NON_HASH.to_vec()),
        proptest::collection::vec(1u32..=5, 1..=5),
        1u32..=5,
        any::<prop::sample::Index>(),
        0u64..3,
        any::<bool>(),
        1u32..=120,
        0u64..=4,
        10u64..=400,
        prop_oneof![Just(0u64), 1u64..1500],
        proptest::collection::vec((100u64..5000, 0u32..100), 6),
    )
        .prop_map(
            |(
                method,
                weights,
                new_weight,
                at,
                added_s,
                percent,
                rate,
                interval_s,
                offered_rate,
                hold_ms,
                measured,
            )| {
                let unit = if percent {
                    RateUnit::Percent
                } else {
                    RateUnit::PerSecond
                };
                // per_second: up to 40/s, so the cap bites at most offered rates; percent: up
                // to 120%, 100 and above meaning no limit at all.
                let rate = if percent { rate } else { 1 + rate / 3 };
                Case {
                    new_at: at.index(weights.len() + 1),
                    method,
                    weights,
                    new_weight,
                    added_s,
                    unit,
                    rate,
                    interval_s,
                    offered_rate,
                    hold_ms,
                    secs: 12,
                    measured,
                }
            },
        )
}

/// What one request does to the counters of the service that took it, the same in both runs:
/// it counts as a request of `bytes` bytes, holds a connection for `hold`, and (once answered)
/// gives a response-time sample. Load reports move once per second, per service.
struct Vserver {
    method: Method,
    state: MethodState,
    counters: Vec<ServiceCounters>,
    weights: Vec<u32>,
    present: Vec<bool>,
    /// Identity of each member across both runs (index in the full list).
    ids: Vec<usize>,
    releases: BinaryHeap<Reverse<(Nanos, usize)>>,
    hold: Nanos,
    load_second: u64,
}

impl Vserver {
    fn new(method: Method, weights: Vec<u32>, ids: Vec<usize>, hold: Nanos) -> Self {
        let n = weights.len();
        Vserver {
            method,
            state: MethodState::new(&weights),
            counters: (0..n).map(|_| ServiceCounters::new()).collect(),
            present: vec![true; n],
            weights,
            ids,
            releases: BinaryHeap::new(),
            hold,
            load_second: u64::MAX,
        }
    }

    fn measure(&self, idx: usize, (rt_us, load): (u64, u32)) {
        let c = &self.counters[idx];
        c.record_response_time(rt_us);
        c.record_monitor_response_time(rt_us + 50);
        c.set_reported_load(load);
    }

    /// Closes what is due and lets the load monitors of the measured members report.
    fn tick(&mut self, now: Nanos, case: &Case) {
        while let Some(&Reverse((t, i))) = self.releases.peek() {
            if t > now {
                break;
            }
            self.releases.pop();
            self.counters[i].close();
        }
        let second = now / NANOS_PER_SEC;
        if second != self.load_second {
            self.load_second = second;
            for (i, &id) in self.ids.iter().enumerate() {
                if let Some(&(_, base)) = case.measured.get(id).filter(|_| id != case.new_at) {
                    let load = base + ((second * 7 + id as u64 * 13) % 20) as u32;
                    self.counters[i].set_reported_load(load);
                }
            }
        }
    }

    fn pick(&self, now: Nanos, cap: &dyn Fn(usize) -> bool) -> Option<usize> {
        methods::pick(
            self.method,
            &self.state,
            &self.counters,
            &self.weights,
            |i| self.present[i] && cap(i),
            now,
        )
    }

    fn took(&mut self, idx: usize, request: u64, now: Nanos) {
        let c = &self.counters[idx];
        let id = self.ids[idx] as u64;
        c.record_request();
        c.record_traffic(200 + (request * 37 + id * 101) % 1200, 1, now);
        c.record_response_time(500 + (request * 53 + id * 211) % 4000);
        if self.hold > 0 {
            c.open();
            self.releases
                .push(Reverse((now.saturating_add(self.hold), idx)));
        }
    }
}

/// Requests per (member identity, second).
type Counts = BTreeMap<(usize, u64), i64>;

/// A request of the stream: its number and its time.
type Request = (u64, Nanos);

/// Requests per (member identity, second) of the run with the new service, and the requests it
/// did not take.
fn run_with_new(case: &Case) -> (Counts, Vec<Request>) {
    let n = case.weights.len() + 1;
    let mut weights = case.weights.clone();
    weights.insert(case.new_at, case.new_weight);
    let hold = case.hold_ms * 1_000_000;
    let mut vs = Vserver::new(case.method, weights.clone(), (0..n).collect(), hold);
    vs.present[case.new_at] = false;
    let mut ss = SlowStart::new(Some(SlowStartParams {
        new_service_request_rate: case.rate,
        unit: case.unit,
        increment_interval: Duration::from_secs(case.interval_s),
    }));
    for i in (0..n).filter(|&i| i != case.new_at) {
        ss.register(i, weights[i], true);
        vs.measure(i, case.measured[i]);
    }
    let mut counts = BTreeMap::new();
    let mut rest = Vec::new();
    let added = case.added_s * NANOS_PER_SEC;
    for j in 0..case.secs * case.offered_rate {
        let now = j * NANOS_PER_SEC / case.offered_rate;
        if now >= added && !vs.present[case.new_at] {
            vs.present[case.new_at] = true;
            ss.add_service(case.new_at, case.new_weight, true, added);
        }
        vs.tick(now, case);
        let chosen = ss.route(now, |cap| vs.pick(now, cap));
        let Some(i) = chosen else {
            panic!("nothing chosen at {now}")
        };
        vs.took(i, j, now);
        if i != case.new_at {
            *counts.entry((i, now / NANOS_PER_SEC)).or_insert(0) += 1;
            rest.push((j, now));
        }
    }
    (counts, rest)
}

/// Requests per (member identity, second) when the other services alone receive `rest`.
fn run_without_new(case: &Case, rest: &[Request]) -> Counts {
    let ids: Vec<usize> = (0..=case.weights.len())
        .filter(|&i| i != case.new_at)
        .collect();
    let hold = case.hold_ms * 1_000_000;
    let mut vs = Vserver::new(case.method, case.weights.clone(), ids.clone(), hold);
    for (i, &id) in ids.iter().enumerate() {
        vs.measure(i, case.measured[id]);
    }
    let mut counts = BTreeMap::new();
    for &(j, now) in rest {
        vs.tick(now, case);
        let Some(i) = vs.pick(now, &|_| true) else {
            panic!("nothing chosen at {now}")
        };
        vs.took(i, j, now);
        *counts.entry((ids[i], now / NANOS_PER_SEC)).or_insert(0) += 1;
    }
    counts
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    /// Each other service gets, in every one-second window (the unit of both `per_second`
    /// windows and increment intervals), what the method gives it when it shares the same
    /// requests, minus those the new service took, among the other services alone: within one
    /// request.
    #[test]
    fn others_get_what_the_method_gives_them_alone(case in case()) {
        let (with_new, rest) = run_with_new(&case);
        let alone = run_without_new(&case, &rest);
        let keys: std::collections::BTreeSet<_> = with_new.keys().chain(alone.keys()).collect();
        for key in keys {
            let a = with_new.get(key).copied().unwrap_or(0);
            let b = alone.get(key).copied().unwrap_or(0);
            prop_assert!(
                (a - b).abs() <= 1,
                "service {} in second {}: {} with the new service, {} without", key.0, key.1, a, b
            );
        }
    }
}
