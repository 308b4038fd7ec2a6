//! A sick service never fails a call: one of three services turns sick in a way its keep-alive
//! may not show (INVITEs answered 503, INVITEs and OPTIONS answered 503, INVITEs never answered),
//! and SIPp places calls as a real UA would (ACK and BYE along the Record-Route set) through a
//! `sip-udp` vserver with the default config (`failover` on, a `sip-options` monitor). No call
//! fails at the client; the strict services see no request for a call they did not answer
//! (a misrouted BYE would get 481).

mod common;

use common::sipp::{Scratch, Transport, Uac, UacLoad, sipp_available};
use common::strict_uas::{Counts, Sick, StrictUas};
use fulcrum::admin::router;
use fulcrum::config;
use fulcrum::ops::Ops;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

fn ops_of(yaml: &str) -> Arc<Ops> {
    let c = config::from_str("failover.yaml", yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    Ops::start(c, None).expect("start")
}

fn scenario() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/sipp/uac_rr.xml")
}

/// Three strict services behind a sip-udp vserver with nothing set but the services, a
/// monitor, Record-Route and `extra` fields (`, field: value`): failover is the default.
fn farm_with(uas: &[StrictUas], protocol: &str, extra: &str) -> String {
    let mut y = String::from(
        "admin: { listen: null }\nmonitors:\n  - { name: ping, type: sip-options, interval: 1s, timeout: 500ms, failures_to_down: 2, successes_to_up: 2 }\nservices:\n",
    );
    for u in uas {
        y.push_str(&format!(
            "  - {{ name: {}, address: \"{}\", protocol: {protocol}, monitor: ping }}\n",
            u.name, u.addr
        ));
    }
    let names: Vec<&str> = uas.iter().map(|u| u.name.as_str()).collect();
    y.push_str(&format!(
        "vservers:\n  - {{ name: v, protocol: {protocol}, bind: [\"127.0.0.1:0\"], record_route: true{extra}, services: [{}] }}\n",
        names.join(", ")
    ));
    y
}

struct Run {
    successful: u64,
    failed: u64,
    errors: String,
    counts: Vec<Counts>,
    /// The top Via of each service's last request of a call: fulcrum's.
    vias: Vec<Option<String>>,
    status: serde_json::Value,
}

fn run(t: Transport, sick: Sick, calls: u32) -> Run {
    run_with(t, sick, calls, "")
}

fn run_with(t: Transport, sick: Sick, calls: u32, extra: &str) -> Run {
    let uas: Vec<StrictUas> = (0..3)
        .map(|i| match t {
            Transport::Udp => StrictUas::udp(&format!("s{i}")),
            _ => StrictUas::tcp(&format!("s{i}")),
        })
        .collect();
    uas[1].set_sick(sick);
    let ops = ops_of(&farm_with(&uas, t.protocol(), extra));
    let vs: SocketAddr = ops.with_vservers(|v, _| v[0].bound[0]).expect("running");
    let dir = Scratch::new(&format!("failover-{}-{sick:?}", t.protocol()));
    let load = UacLoad {
        calls,
        rate_per_s: 50,
        hold_ms: 300,
    };
    let uac = Uac::start_with(&dir, t, vs, load, "gray", Some(&scenario()));
    let outcome = uac.finish();
    let status = router::status(&ops);
    Run {
        successful: outcome.successful,
        failed: outcome.failed,
        errors: outcome.errors,
        counts: uas.iter().map(StrictUas::counts).collect(),
        vias: uas.iter().map(StrictUas::last_call_via).collect(),
        status,
    }
}

fn check(t: Transport, sick: Sick) {
    if !sipp_available() {
        return;
    }
    let calls = 300;
    let r = run(t, sick, calls);
    let invites: u64 = r.counts.iter().map(|c| c.invites).sum();
    let share = r.counts[1].invites as f64 / invites.max(1) as f64;
    println!(
        "{} {sick:?}: {} ok, {} failed; INVITE transactions per service {:?} (sick share {:.1}%); services {:?}",
        t.protocol(),
        r.successful,
        r.failed,
        r.counts.iter().map(|c| c.invites).collect::<Vec<_>>(),
        100.0 * share,
        r.counts
    );
    assert_eq!(
        (r.successful, r.failed),
        (u64::from(calls), 0),
        "{}\n{}",
        r.errors,
        r.status
    );
    for (i, c) in r.counts.iter().enumerate() {
        assert_eq!(
            c.r481, 0,
            "s{i} got requests for calls it did not answer: {c:?}"
        );
        assert_eq!(c.stray_acks, 0, "s{i}: {c:?}");
    }
    // Every call was answered by a healthy service, and each of those ended its dialog.
    let byes: u64 = r.counts.iter().map(|c| c.byes_ok).sum();
    assert_eq!(byes, u64::from(calls));
    assert_eq!(r.counts[1].byes_ok, 0, "the sick service set up no call");
    // Down: its OPTIONS answered 503 with Retry-After, its monitor takes it out at the first
    // probe and holds it out. Busy: its third 503 ejects it for at least the Retry-After.
    // Silent: each of its first three failures takes `no_answer` (1 s) to show while calls keep
    // coming, so over this 6 s run it sees more of them (over 15 s, as bench/gray.sh, less).
    let bound = if sick == Sick::Silent { 0.10 } else { 0.05 };
    assert!(share <= bound, "sick share {:.1}%", 100.0 * share);
}

#[test]
fn a_service_answering_invites_503_fails_no_call() {
    check(Transport::Udp, Sick::Busy);
}

#[test]
fn a_service_answering_invites_and_options_503_fails_no_call() {
    check(Transport::Udp, Sick::Down);
}

#[test]
fn a_service_that_never_answers_invites_fails_no_call() {
    check(Transport::Udp, Sick::Silent);
}

#[test]
fn over_tcp_a_service_answering_invites_503_fails_no_call() {
    check(Transport::Tcp, Sick::Busy);
}

#[test]
fn over_tcp_a_service_that_never_answers_invites_fails_no_call() {
    check(Transport::Tcp, Sick::Silent);
}

#[test]
fn a_healthy_farm_loses_nothing_and_shares_evenly() {
    if !sipp_available() {
        return;
    }
    let r = run(Transport::Udp, Sick::Healthy, 300);
    assert_eq!((r.successful, r.failed), (300, 0), "{}", r.errors);
    for (i, c) in r.counts.iter().enumerate() {
        assert!(c.invites >= 50, "s{i} got {} of 300 INVITEs", c.invites);
        assert_eq!(c.r481, 0);
    }
}

/// With `service_source`, requests toward services leave from that address and name it in
/// their Via: the answers (the sick service's 503s included) come back there, to the instance
/// that holds the transaction, and failover works as without it.
#[test]
fn with_a_service_source_services_answer_there_and_no_call_fails() {
    if !sipp_available() {
        return;
    }
    let calls = 200;
    let r = run_with(
        Transport::Udp,
        Sick::Busy,
        calls,
        ", service_source: 127.0.0.2",
    );
    assert_eq!(
        (r.successful, r.failed),
        (u64::from(calls), 0),
        "{}\n{}",
        r.errors,
        r.status
    );
    for (i, v) in r.vias.iter().enumerate() {
        let v = v.as_deref().unwrap_or_default();
        assert!(
            v.starts_with("SIP/2.0/UDP 127.0.0.2:"),
            "s{i}'s top Via: {v}"
        );
    }
    for c in &r.counts {
        assert_eq!((c.r481, c.stray_acks), (0, 0), "{c:?}");
    }
    assert_eq!(r.counts[1].byes_ok, 0, "the sick service set up no call");
}
