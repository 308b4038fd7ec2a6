//! The reference figures of docs/slow_start.md, reproduced by running the fixture scenarios through the real
//! methods and slow-start code (`fulcrum simulate slow-start`).

use fulcrum::simulate::slow_start::{
    SimResult, render_json, render_svg, render_table, run_scenario,
};
use fulcrum::slow_start::ExitReason;

const TOLERANCE: f64 = 0.01;

fn run(path: &str) -> SimResult {
    let full = format!("{}/{path}", env!("CARGO_MANIFEST_DIR"));
    let yaml = std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"));
    run_scenario(&yaml).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// Asserts `expected[row][service]` (None = service absent, rate 0) at each time.
fn assert_rows(r: &SimResult, services: &[&str], expected: &[(f64, &[f64])], tolerance: f64) {
    for (t, rates) in expected {
        for (name, want) in services.iter().zip(rates.iter()) {
            let got = r
                .rate(*t, name)
                .unwrap_or_else(|| panic!("no rate for {name} at t={t}\n{}", render_table(r)));
            assert!(
                (got - want).abs() <= tolerance,
                "{name} at t={t}: got {got}, docs/slow_start.md says {want}\n{}",
                render_table(r)
            );
        }
    }
}

#[test]
fn manual_mode_table() {
    let r = run("fixtures/slowstart/manual.yaml");
    let services = ["Service1", "Service2", "Service3", "Service4"];
    // docs/slow_start.md, Reference figures: rate 10 (Service3 added), 20, 40 (Service4 added), 0 (slow start ended).
    let expected: &[(f64, &[f64])] = &[
        (10.0, &[115.0, 115.0, 10.0, 0.0]),
        (20.0, &[110.0, 110.0, 20.0, 0.0]),
        (30.0, &[80.0, 80.0, 40.0, 40.0]),
        (40.0, &[60.0, 60.0, 60.0, 60.0]),
    ];
    assert_rows(&r, &services, expected, TOLERANCE);
    let ended: Vec<_> = r
        .exits
        .iter()
        .map(|e| (e.t, e.service.as_str(), e.reason))
        .collect();
    assert_eq!(
        ended,
        vec![
            (30.0, "Service3", ExitReason::Ended),
            (30.0, "Service4", ExitReason::Ended)
        ]
    );
}

#[test]
fn automatic_per_second_table() {
    let r = run("fixtures/slowstart/auto_per_second.yaml");
    let services = ["Service1", "Service2", "Service3", "Service4", "Service5"];
    let expected: &[(f64, &[f64])] = &[
        (0.0, &[25.0, 25.0, 25.0, 25.0, 0.0]),
        (10.0, &[24.0, 24.0, 24.0, 24.0, 4.0]),
        (20.0, &[23.0, 23.0, 23.0, 23.0, 8.0]),
        (30.0, &[22.0, 22.0, 22.0, 22.0, 12.0]),
        (40.0, &[21.0, 21.0, 21.0, 21.0, 16.0]),
        (50.0, &[20.0, 20.0, 20.0, 20.0, 20.0]),
        (60.0, &[20.0, 20.0, 20.0, 20.0, 20.0]),
    ];
    assert_rows(&r, &services, expected, TOLERANCE);
    // "After 50 s Service5 is no longer new."
    assert_eq!(r.exits.len(), 1, "{:?}", r.exits);
    assert_eq!(r.exits[0].service, "Service5");
    assert_eq!(r.exits[0].t, 50.0);
    assert_eq!(r.exits[0].reason, ExitReason::BelowRate);
}

/// The percent example at 100 req/s. Over a 5 s row one request is 0.2 req/s, and the exact
/// shares (29.41 requests for the new service in the first 5 s) are not whole numbers, so at
/// this offered rate the rows can only be within one request of the documented ≈ figures; the
/// scaled run below shows the accounting itself is exact.
#[test]
fn automatic_percent_example() {
    let r = run("fixtures/slowstart/auto_percent.yaml");
    let one_request = 1.0 / 5.0;
    for (t, p) in [(5.0, 25.0), (10.0, 50.0), (15.0, 75.0)] {
        let new = 100.0 * (p / 100.0) / (4.0 + p / 100.0);
        let each = 100.0 / (4.0 + p / 100.0);
        assert_rows(
            &r,
            &["Service1", "Service2", "Service3", "Service4", "Service5"],
            &[(t, &[each, each, each, each, new])],
            one_request + 1e-9,
        );
    }
    // Full share after 20 s.
    assert_rows(
        &r,
        &["Service1", "Service2", "Service3", "Service4", "Service5"],
        &[(20.0, &[20.0; 5]), (25.0, &[20.0; 5])],
        TOLERANCE,
    );
    assert_eq!(r.exits.len(), 1, "{:?}", r.exits);
    // "... takes its full share (20) after 20 s, when slow start ends."
    assert_eq!(r.exits[0].reason, ExitReason::FullShare);
    assert_eq!(r.exits[0].t, 20.0);
}

/// The same scenario at 100× the offered rate, rates divided by 100: the ratios 25/425, 50/450
/// and 75/475 are now reproduced within 0.01 req/s (≈5.88 and ≈23.53 over the first 5 s).
#[test]
fn automatic_percent_example_scaled() {
    let path = format!(
        "{}/fixtures/slowstart/auto_percent.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    let yaml = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let yaml = yaml.replace("offered_rate: 100", "offered_rate: 10000");
    let r = run_scenario(&yaml).unwrap_or_else(|e| panic!("{e}"));
    for (t, p) in [(5.0, 25.0), (10.0, 50.0), (15.0, 75.0), (20.0, 100.0)] {
        let new = 100.0 * (p / 100.0) / (4.0 + p / 100.0);
        let each = 100.0 / (4.0 + p / 100.0);
        for (name, want) in [("Service1", each), ("Service4", each), ("Service5", new)] {
            let got = r.rate(t, name).map(|v| v / 100.0);
            assert!(
                got.is_some_and(|g| (g - want).abs() <= TOLERANCE),
                "{name} at t={t}: {got:?} vs {want}"
            );
        }
    }
    assert!((r.rate(5.0, "Service5").unwrap_or(0.0) / 100.0 - 5.88).abs() < 0.01);
    assert!((r.rate(5.0, "Service1").unwrap_or(0.0) / 100.0 - 23.53).abs() < 0.01);
}

#[test]
fn json_output_shape() {
    let r = run("fixtures/slowstart/auto_per_second.yaml");
    let json = render_json(&r);
    assert!(
        json.contains(r#"{"t":10,"rates":{"Service1":24.0,"Service2":24.0,"Service3":24.0,"Service4":24.0,"Service5":4.0}}"#),
        "{json}"
    );
    let v: serde_json::Value = serde_json::from_str(&json).unwrap_or_default();
    assert_eq!(v["rows"].as_array().map(Vec::len), Some(7));
}

/// docs/slow_start_auto.svg is the output of
/// `fulcrum simulate slow-start fixtures/slowstart/auto_per_second.yaml --plot docs/slow_start_auto.svg`;
/// this keeps the committed figure in step with the code. Regenerate it with
/// `FULCRUM_BLESS=1 cargo test --test slow_start_reference`.
#[test]
fn committed_plot_is_current() {
    let svg = render_svg(&run("fixtures/slowstart/auto_per_second.yaml"));
    let path = format!("{}/docs/slow_start_auto.svg", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("FULCRUM_BLESS").is_some() {
        std::fs::write(&path, &svg).unwrap_or_else(|e| panic!("{path}: {e}"));
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(
        committed == svg,
        "{path} is stale: regenerate with FULCRUM_BLESS=1 cargo test --test slow_start_reference"
    );
}

/// Slow start is the same for every non-hash method: with connections held for a second (so the
/// new service, with none open, is what least_connection and friends would flood), every method
/// still reproduces both reference tables.
#[test]
fn every_method_reproduces_the_tables() {
    let auto = std::fs::read_to_string(format!(
        "{}/fixtures/slowstart/auto_per_second.yaml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap_or_default();
    let manual = std::fs::read_to_string(format!(
        "{}/fixtures/slowstart/manual.yaml",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap_or_default();
    for method in [
        "least_connection",
        "least_response_time",
        "least_bandwidth",
        "least_packets",
        "lrtm",
        "custom_load",
    ] {
        let yaml = auto.replace("round_robin", method) + "hold: 1s\n";
        let r = run_scenario(&yaml).unwrap_or_else(|e| panic!("{method}: {e}"));
        for (t, old, new) in [(10.0, 24.0, 4.0), (30.0, 22.0, 12.0), (50.0, 20.0, 20.0)] {
            assert_rows(
                &r,
                &["Service1", "Service4", "Service5"],
                &[(t, &[old, old, new])],
                TOLERANCE,
            );
        }
        let yaml = manual.replace("round_robin", method) + "hold: 1s\n";
        let r = run_scenario(&yaml).unwrap_or_else(|e| panic!("{method}: {e}"));
        assert_rows(
            &r,
            &["Service1", "Service2", "Service3", "Service4"],
            &[
                (10.0, &[115.0, 115.0, 10.0, 0.0]),
                (30.0, &[80.0, 80.0, 40.0, 40.0]),
            ],
            TOLERANCE,
        );
    }
}
