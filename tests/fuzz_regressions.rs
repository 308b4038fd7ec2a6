//! Inputs the fuzz targets once failed on (docs/fuzzing.md, Ledger), replayed under the
//! same invariants as the targets: a request fulcrum forwards scans again and keeps its
//! Call-ID, a reply it builds scans. One directory per target under `fixtures/fuzz/`.

use fulcrum::sip::{
    Local, Reply, RequestRewrite, Transport, build_response, forward_request, scan,
};
use std::net::SocketAddr;

fn inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/fuzz")
        .join(target);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| {
            let bytes = std::fs::read(e.path()).expect("read");
            (e.file_name().to_string_lossy().into_owned(), bytes)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn sip_message_findings_hold_the_forwarding_invariant() {
    let local = Local::new("192.0.2.1", 5060, Transport::Udp);
    let src: SocketAddr = "198.51.100.7:40000".parse().expect("addr");
    let found = inputs("sip_message");
    assert!(!found.is_empty());
    for (name, data) in found {
        // Each kept input scans (else it no longer exercises the rewrite it was kept for).
        let m = scan(&data).unwrap_or_else(|e| panic!("{name}: no longer scans: {e:?}"));
        for service in [None, Some(0x0123_4567_89ab_cdef)] {
            let rw = RequestRewrite {
                local: &local,
                src,
                record_route: true,
                force_rport: data.len() % 2 == 0,
                conn_id: Some(data.len() as u64),
                service,
                arrived_on: None,
                flow: None,
                path: None,
            };
            let mut out = Vec::new();
            if forward_request(&m, &rw, &mut out).is_ok() {
                let again = scan(&out)
                    .unwrap_or_else(|e| panic!("{name}: forwarded, does not scan: {e:?}"));
                assert_eq!(again.call_id(), m.call_id(), "{name}");
            }
        }
        let mut out = Vec::new();
        if build_response(&m, &Reply::service_unavailable(5), &mut out).is_ok() {
            assert!(scan(&out).is_ok(), "{name}: a built reply does not scan");
        }
    }
}

/// Scenarios the `slow_start_scenario` target once failed on: each is refused by the check
/// with an error naming its field, or checks and then runs (as the target runs it: at most
/// 20,000 requests) within the report limit.
#[test]
fn slow_start_scenario_findings_are_refused_or_run_bounded() {
    use fulcrum::simulate::slow_start::{MAX_REPORTS, check_scenario, run_scenario};
    let found = inputs("slow_start_scenario");
    assert!(!found.is_empty());
    for (name, data) in found {
        let text = String::from_utf8(data).unwrap_or_else(|e| panic!("{name}: not UTF-8: {e}"));
        match check_scenario(&text) {
            Err(e) => assert!(e.to_string().contains(':'), "{name}: {e}"),
            Ok(requests) if requests <= 20_000 => {
                let r = run_scenario(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(r.rows.len() as u64 <= MAX_REPORTS, "{name}");
            }
            Ok(_) => {}
        }
    }
}

/// The first of them: `report_every: 5us` over 25 s (five million rows) ran the target out
/// of memory; it is refused by `report_every`.
#[test]
fn a_scenario_with_millions_of_report_rows_is_refused() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/fuzz/slow_start_scenario/oom-report-every-5us");
    let text = std::fs::read_to_string(path).expect("fixture");
    let e = fulcrum::simulate::slow_start::check_scenario(&text).expect_err("refused");
    assert!(e.to_string().starts_with("report_every:"), "{e}");
}
