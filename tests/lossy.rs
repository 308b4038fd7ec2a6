//! SIP through a lossy network: `bench/lossy.sh` (a private network namespace, nftables
//! dropping a share of the SIP datagrams at every hop, SIPp as caller and as three RFC 3261
//! UASes that know only their own calls) run on fulcrum alone, reduced to 100 requests per
//! scenario at 5% loss. fulcrum holds every request outside a dialog by default, so it owes the
//! client RFC 3261's retransmissions: without Timer G one lost 486 leaves a refused caller
//! ringing (10 of 200 at 5% before it), and at most 1% of the requests may fail in any
//! scenario (refused calls, answered calls with their BYE, MESSAGE, REGISTER and refresh).
//!
//! Needs root, `ip`, `nft` and SIPp: without them the test says why and passes without
//! running, unless `FULCRUM_REQUIRE_NETNS=1` / `FULCRUM_REQUIRE_SIPP=1` (CI), which make that a
//! failure. The script bounds every process it starts and removes its namespace on exit.

mod common;

use common::netns::is_root;
use common::sipp::{Scratch, sipp_available};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn on_path(cmd: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(cmd).is_file()))
}

/// Why the run cannot happen here, if it cannot.
fn missing() -> Option<String> {
    if !is_root() {
        return Some("needs root for a network namespace and nftables".into());
    }
    ["ip", "nft", "timeout"]
        .into_iter()
        .find(|c| !on_path(c))
        .map(|c| format!("`{c}` is not installed (Debian iproute2, nftables, coreutils)"))
}

/// The rows of the script's summary.tsv as (column -> value) maps.
fn rows(summary: &Path) -> Vec<std::collections::HashMap<String, String>> {
    let text =
        std::fs::read_to_string(summary).unwrap_or_else(|e| panic!("{}: {e}", summary.display()));
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or_default().split('\t').collect();
    lines
        .map(|l| {
            header
                .iter()
                .zip(l.split('\t'))
                .map(|(k, v)| ((*k).to_owned(), v.to_owned()))
                .collect()
        })
        .collect()
}

fn num(row: &std::collections::HashMap<String, String>, col: &str) -> u64 {
    row.get(col)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("column {col} in {row:?}"))
}

#[test]
fn through_a_lossy_network_at_most_one_request_in_a_hundred_fails() {
    if !sipp_available() {
        return;
    }
    if let Some(why) = missing() {
        assert!(
            std::env::var("FULCRUM_REQUIRE_NETNS").as_deref() != Ok("1"),
            "{why}, and FULCRUM_REQUIRE_NETNS=1"
        );
        println!("SKIP: {why} (FULCRUM_REQUIRE_NETNS=1 makes this a failure)");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = Scratch::new("lossy");
    let calls = 100;
    let status = Command::new("timeout")
        .arg(Duration::from_secs(600).as_secs().to_string())
        .arg("bash")
        .arg(root.join("bench/lossy.sh"))
        .env("FULCRUM", env!("CARGO_BIN_EXE_fulcrum"))
        .env("LOSS", "5")
        .env("SCENARIOS", "refused answered message register")
        .env("PROXIES", "fulcrum")
        .env("CALLS", calls.to_string())
        .env("RATE", "25")
        .env("OUT", &dir.0)
        .status()
        .expect("bench/lossy.sh runs");
    assert!(status.success(), "bench/lossy.sh: {status}");
    let rows = rows(&dir.path("summary.tsv"));
    assert_eq!(rows.len(), 4, "one row per scenario: {rows:?}");
    for row in &rows {
        let scenario = &row["scenario"];
        let dropped = num(row, "dropped");
        assert!(
            dropped > 0,
            "{scenario}: nothing was lost, the test tests nothing: {row:?}"
        );
        assert_eq!(num(row, "attempted"), calls, "{scenario}: {row:?}");
        let lost = num(row, "failed") + num(row, "never_ended");
        assert!(
            lost <= calls / 100,
            "{scenario}: {lost} of {calls} failed at 5% loss (logs in {}): {row:?}",
            dir.0.display()
        );
        assert_eq!(
            num(row, "uas_481"),
            0,
            "{scenario}: a request reached a service that did not hold its call: {row:?}"
        );
    }
}
