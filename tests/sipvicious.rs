//! An attacker's toolkit against a fulcrum vserver with flood control (docs/edge.md):
//! Debian's SIPVicious (`svwar` enumerating extensions, `svcrack` guessing a password) from
//! 127.0.0.1 (SIPVicious 0.3.3's `svwar` and `svcrack` send from it whatever `-b` says) while
//! a SIPp UAC places calls from 127.0.0.2, all on loopback with explicit ports. The scanner is banned after `flood.limit` new requests in its window: the services
//! see no more of it than that, and every legitimate call completes. `svmap` then asks a
//! vserver whose only service is DOWN: fulcrum's own answer names no service and no software
//! version.
//!
//! Every tool runs under `timeout`; SIPVicious's options that reach outside (report-back,
//! random scans, name lookups) are never used. Without SIPVicious the tests print why and pass
//! (`FULCRUM_REQUIRE_SIPVICIOUS=1` makes that a failure), as without SIPp.

mod common;

use common::sipp::{Scratch, Transport, Uac, UacLoad, sipp_available};
use common::strict_uas::StrictUas;
use common::*;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;

fn sipvicious_available() -> bool {
    let found = ["svwar", "svcrack", "svmap"].iter().all(|t| {
        ["/usr/bin", "/usr/local/bin"]
            .iter()
            .any(|d| std::path::Path::new(d).join(t).is_file())
    });
    if !found {
        assert!(
            std::env::var("FULCRUM_REQUIRE_SIPVICIOUS").as_deref() != Ok("1"),
            "SIPVicious (svwar, svcrack, svmap) is not installed, and FULCRUM_REQUIRE_SIPVICIOUS=1"
        );
        println!(
            "SKIP: SIPVicious is not installed (apt-get install sipvicious; FULCRUM_REQUIRE_SIPVICIOUS=1 makes this a failure)"
        );
    }
    found
}

/// Run SIPVicious tool `tool` with `args` for at most `secs` seconds; its output.
fn sv(tool: &str, args: &[&str], secs: u32) -> String {
    let out = Command::new("timeout")
        .arg(secs.to_string())
        .arg(tool)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run SIPVicious");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn ops_of(yaml: &str) -> Arc<fulcrum::ops::Ops> {
    let c = fulcrum::config::from_str("sv.yaml", yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    fulcrum::ops::Ops::start(c, None).expect("start")
}

/// Twice the legitimate UAC's rate of new requests per window, far below the scanner's.
const LIMIT: u64 = 20;

/// svwar then svcrack from 127.0.0.1 while SIPp calls from 127.0.0.2: the scanner is banned
/// once it passes the limit, the services see at most the limit of its requests, every call
/// completes.
#[test]
fn a_scanner_is_banned_after_the_limit_while_calls_complete() {
    if !sipp_available() || !sipvicious_available() {
        return;
    }
    let uas: Vec<StrictUas> = (0..2).map(|i| StrictUas::udp(&format!("u{i}"))).collect();
    let names: Vec<(String, SocketAddr)> = uas.iter().map(|u| (u.name.clone(), u.addr)).collect();
    let extra = format!("flood: {{ limit: {LIMIT}, window: 1s, ban: 120s }}");
    let yaml = config(
        "sip-udp",
        "127.0.0.1:0",
        "call_id_hash",
        &extra,
        &refs(&names),
    );
    let ops = ops_of(&yaml);
    let vs = ops.with_vservers(|v, _| v[0].bound[0]).expect("running");
    let port = vs.port().to_string();
    let dir = Scratch::new("sipvicious");
    let load = UacLoad {
        calls: 60,
        rate_per_s: 10,
        hold_ms: 200,
    };
    let uac = Uac::start_from(&dir, Transport::Udp, vs, load, "legit", "127.0.0.2");
    // Extension enumeration: 900 REGISTERs, as fast as svwar sends them.
    let war = sv(
        "svwar",
        &[
            "-e",
            "100-999",
            "-m",
            "REGISTER",
            "-p",
            &port,
            "-t",
            "0.002",
            "127.0.0.1",
        ],
        30,
    );
    // Password guessing for one extension: 500 tries.
    let crack = sv(
        "svcrack",
        &[
            "-u",
            "100",
            "-r",
            "1000-1499",
            "-p",
            &port,
            "-t",
            "0.002",
            "127.0.0.1",
        ],
        30,
    );
    let outcome = uac.finish();
    let edge = fulcrum::admin::router::status(&ops)["vservers"][0]["edge"].clone();
    let counts: Vec<_> = uas.iter().map(|u| u.counts()).collect();
    let requests: u64 = counts.iter().map(|c| c.requests).sum();
    println!(
        "svwar: {}\nsvcrack: {}\nUAC {} successful, {} failed\nedge {edge}\nservices {counts:?}",
        war.trim(),
        crack.trim(),
        outcome.successful,
        outcome.failed
    );
    assert_eq!(
        (outcome.successful, outcome.failed),
        (u64::from(load.calls), 0),
        "{}",
        outcome.errors.chars().take(2000).collect::<String>()
    );
    assert_eq!(edge["bans_total"], 1, "{edge}");
    assert!(
        edge["dropped"]["flood"].as_u64().unwrap_or(0) > 0,
        "nothing dropped by flood control: {edge}"
    );
    // Every call's INVITE, ACK and BYE, and at most LIMIT of the scanner's requests (a
    // retransmission of a legitimate request aside).
    let scanner = requests.saturating_sub(3 * u64::from(load.calls));
    assert!(
        scanner <= LIMIT + 5,
        "{scanner} scanner requests reached the services"
    );
    let bans =
        fulcrum::admin::router::handle(&ops, &fulcrum::admin::router::Request::new("GET", "/bans"));
    assert!(bans.body.contains("127.0.0.1"), "{}", bans.body);
    assert!(!bans.body.contains("127.0.0.2"), "{}", bans.body);
    ops.shutdown();
}

/// svmap's INVITE to a vserver whose only service is DOWN: fulcrum answers it itself, and
/// that answer carries no service address and no Server or User-Agent header.
#[test]
fn fulcrums_own_answer_names_no_service_and_no_version() {
    if !sipvicious_available() {
        return;
    }
    // A service that never answers its monitor: DOWN from the first probe.
    let dead: SocketAddr = "127.0.0.1:9".parse().expect("addr");
    let yaml = format!(
        "admin:\n  listen: null\nmonitors:\n  - {{ name: m, type: sip-options, interval: 200ms, timeout: 100ms, failures_to_down: 1 }}\nservices:\n  - {{ name: hidden, address: \"{dead}\", protocol: sip-udp, monitor: m }}\nvservers:\n  - {{ name: v, protocol: sip-udp, bind: \"127.0.0.1:0\", method: call_id_hash, services: [hidden] }}\n"
    );
    let ops = ops_of(&yaml);
    let vs = ops.with_vservers(|v, _| v[0].bound[0]).expect("running");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while fulcrum::admin::router::status(&ops)["vservers"][0]["services"][0]["state"] != "DOWN" {
        assert!(
            std::time::Instant::now() < deadline,
            "the service never went DOWN"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let port = vs.port().to_string();
    let out = sv(
        "svmap",
        &[
            "-m",
            "INVITE",
            "-p",
            &port,
            "-b",
            "127.0.0.3",
            "-d",
            "127.0.0.1",
        ],
        20,
    );
    println!("svmap: {out}");
    assert!(out.contains("SIP/2.0 "), "no answer reached svmap: {out}");
    for leak in [
        "127.0.0.1:9",
        "Server:",
        "User-Agent:",
        env!("CARGO_PKG_VERSION"),
    ] {
        assert!(
            !out.contains(leak),
            "fulcrum's answer shows {leak:?}: {out}"
        );
    }
    ops.shutdown();
}
