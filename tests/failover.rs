//! A sick service never fails a call: one of three services turns sick in a way its keep-alive
//! may not show (INVITEs answered 503, INVITEs and OPTIONS answered 503, INVITEs never answered),
//! and SIPp places calls as a real UA would (ACK and BYE along the Record-Route set) through a
//! `sip-udp` vserver with the default config (`failover` on, a `sip-options` monitor). No call
//! fails at the client; the strict services see no request for a call they did not answer
//! (a misrouted BYE would get 481).
//!
//! Then what failover meets besides a sick service: a caller's CANCEL before any answer, while
//! the service rings, and after the INVITE moved on; a 2xx from a service given up on, after
//! the next one answered; a burst beyond `max_pending`; and the live calls of a service that
//! is ejected.

mod common;

use common::sipp::{Scratch, Transport, Uac, UacLoad, sipp_available};
use common::strict_uas::{Counts, Sick, StrictUas};
use fulcrum::admin::router;
use fulcrum::config;
use fulcrum::ops::Ops;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn ops_of(yaml: &str) -> Arc<Ops> {
    let c = config::from_str("failover.yaml", yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    Ops::start(c, None).expect("start")
}

fn scenario() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/sipp/uac_rr.xml")
}

/// Three strict services behind a vserver of `protocol` with nothing set but the services, a
/// monitor, Record-Route and `extra` fields (`, field: value`): failover is the default.
fn farm_with(uas: &[StrictUas], protocol: &str, extra: &str) -> String {
    farm_between(uas, protocol, protocol, extra)
}

/// The same with services of another protocol (the transports bridge).
fn farm_between(uas: &[StrictUas], protocol: &str, services: &str, extra: &str) -> String {
    let mut y = String::from(
        "admin: { listen: null }\nmonitors:\n  - { name: ping, type: sip-options, interval: 1s, timeout: 500ms, failures_to_down: 2, successes_to_up: 2 }\nservices:\n",
    );
    for u in uas {
        y.push_str(&format!(
            "  - {{ name: {}, address: \"{}\", protocol: {services}, monitor: ping }}\n",
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
    run_between(t, t, sick, calls, extra)
}

/// Calls from SIPp over `t` to services reached over `services`.
fn run_between(t: Transport, services: Transport, sick: Sick, calls: u32, extra: &str) -> Run {
    let uas: Vec<StrictUas> = (0..3)
        .map(|i| match services {
            Transport::Udp => StrictUas::udp(&format!("s{i}")),
            _ => StrictUas::tcp(&format!("s{i}")),
        })
        .collect();
    uas[1].set_sick(sick);
    let ops = ops_of(&farm_between(
        &uas,
        t.protocol(),
        services.protocol(),
        extra,
    ));
    let vs: SocketAddr = ops.with_vservers(|v, _| v[0].bound[0]).expect("running");
    let dir = Scratch::new(&format!(
        "failover-{}-{}-{sick:?}",
        t.protocol(),
        services.protocol()
    ));
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
    check_between(t, t, sick);
}

/// No call fails with service s1 `sick`: calls from SIPp over `t`, services over `services`.
fn check_between(t: Transport, services: Transport, sick: Sick) {
    if !sipp_available() {
        return;
    }
    let calls = 300;
    let r = run_between(t, services, sick, calls, "");
    let invites: u64 = r.counts.iter().map(|c| c.invites).sum();
    let share = r.counts[1].invites as f64 / invites.max(1) as f64;
    println!(
        "{} to {} {sick:?}: {} ok, {} failed; INVITE transactions per service {:?} (sick share {:.1}%); services {:?}",
        t.protocol(),
        services.protocol(),
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
    // Silent: each of its first three failures takes `no_answer` (2 s for an INVITE, room for
    // a stateful service's 100 behind a slow database) to show while calls keep coming: its
    // hash share of the calls of those 2 s, 50/s · 2 s / 3 = 33 of 300 (11%), reach it before
    // it is ejected (over 15 s, as bench/gray.sh, less).
    let bound = if sick == Sick::Silent { 0.15 } else { 0.05 };
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

/// Across the transports bridge (a sip-tcp vserver over sip-udp services, and the other way)
/// a held request fails over as on one transport.
#[test]
fn across_the_bridge_to_udp_services_a_service_answering_503_fails_no_call() {
    check_between(Transport::Tcp, Transport::Udp, Sick::Busy);
}

#[test]
fn across_the_bridge_to_udp_services_a_silent_service_fails_no_call() {
    check_between(Transport::Tcp, Transport::Udp, Sick::Silent);
}

#[test]
fn across_the_bridge_to_tcp_services_a_service_answering_503_fails_no_call() {
    check_between(Transport::Udp, Transport::Tcp, Sick::Busy);
}

#[test]
fn across_the_bridge_to_tcp_services_a_silent_service_fails_no_call() {
    check_between(Transport::Udp, Transport::Tcp, Sick::Silent);
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

/// A farm of strict services, each sick its own way, behind a vserver with `extra` fields.
struct Farm {
    uas: Vec<StrictUas>,
    ops: Arc<Ops>,
    vs: SocketAddr,
}

impl Farm {
    fn start(t: Transport, sick: &[Sick], extra: &str) -> Farm {
        let uas: Vec<StrictUas> = sick
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let u = match t {
                    Transport::Udp => StrictUas::udp(&format!("s{i}")),
                    _ => StrictUas::tcp(&format!("s{i}")),
                };
                u.set_sick(*s);
                u
            })
            .collect();
        let ops = ops_of(&farm_with(&uas, t.protocol(), extra));
        let vs = ops.with_vservers(|v, _| v[0].bound[0]).expect("running");
        Farm { uas, ops, vs }
    }

    fn counts(&self) -> Vec<Counts> {
        self.uas.iter().map(StrictUas::counts).collect()
    }

    /// The vserver's `fulcrum_sip_failover_total` of `event` (held, failover, table_full...),
    /// as /metrics shows it.
    fn failover_total(&self, event: &str) -> u64 {
        let body = router::handle(&self.ops, &router::Request::new("GET", "/metrics")).body;
        let label = format!("event=\"{event}\"");
        body.lines()
            .find(|l| l.starts_with("fulcrum_sip_failover_total{") && l.contains(&label))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no fulcrum_sip_failover_total {label} in /metrics"))
    }

    /// The failover table's counters: requests held, attempts moved on, forwarded statelessly
    /// for want of room.
    fn table(&self) -> (u64, u64, u64) {
        (
            self.failover_total("held"),
            self.failover_total("failover"),
            self.failover_total("table_full"),
        )
    }

    /// A service's state in `/status` (UP, EJECTED...).
    fn state(&self, i: usize) -> String {
        router::status(&self.ops)["vservers"][0]["services"][i]["state"]
            .as_str()
            .unwrap_or("?")
            .to_owned()
    }
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/sipp")
        .join(name)
}

/// Wait (bounded) until `ready` holds, polling what the test can observe.
fn wait_until(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ready() {
        assert!(Instant::now() < deadline, "gave up waiting: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Calls that the caller cancels (`scenario`: fixtures/sipp/uac_cancel.xml `pause_ms` after
/// the 180, uac_cancel_unanswered.xml after fulcrum's 100) through services sick as `sick`,
/// taken in round robin; every call must end with 200 to the CANCEL and 487 to the INVITE,
/// and leave no dialog anywhere.
fn cancelled_calls(
    t: Transport,
    sick: &[Sick],
    scenario: &str,
    pause_ms: u32,
    calls: u32,
) -> (Farm, Vec<Counts>) {
    let farm = Farm::start(t, sick, ", method: round_robin, eject: off");
    let names: Vec<String> = sick.iter().map(|s| format!("{s:?}")).collect();
    let dir = Scratch::new(&format!(
        "cancel-{}-{}-{pause_ms}",
        t.protocol(),
        names.join("-")
    ));
    let load = UacLoad {
        calls,
        rate_per_s: 4,
        hold_ms: pause_ms,
    };
    let scenario = fixture(scenario);
    let out = Uac::start_with(&dir, t, farm.vs, load, "cancel", Some(&scenario)).finish();
    let counts = farm.counts();
    println!(
        "{} {sick:?}, CANCEL after {pause_ms} ms: {} ok, {} failed; services {counts:?}; table (held, failovers, full) {:?}",
        t.protocol(),
        out.successful,
        out.failed,
        farm.table()
    );
    assert_eq!(
        (out.successful, out.failed),
        (u64::from(calls), 0),
        "every call gets 200 to its CANCEL and 487 to its INVITE\n{}",
        out.errors
    );
    for (i, c) in counts.iter().enumerate() {
        assert_eq!(
            (c.stray_cancels, c.r481, c.stray_acks),
            (0, 0, 0),
            "s{i} got a CANCEL or ACK for a transaction it does not have: {c:?}"
        );
        assert_eq!(
            (c.dialogs, c.byes_ok),
            (0, 0),
            "a cancelled call leaves no dialog: s{i} {c:?}"
        );
    }
    (farm, counts)
}

/// RFC 3261 §9.1, §16.10: a CANCEL before the service answered at all is answered 200 by
/// fulcrum, which sends the service no CANCEL (there is nothing to cancel yet) and gives the
/// caller 487 once the attempt is given up on (`no_answer`), without moving the cancelled
/// INVITE to another service.
#[test]
fn a_call_cancelled_before_any_answer_gets_487_and_moves_nowhere() {
    if !sipp_available() {
        return;
    }
    let (farm, c) = cancelled_calls(
        Transport::Udp,
        &[Sick::Silent, Sick::Silent],
        "uac_cancel_unanswered.xml",
        500,
        4,
    );
    let (_, failovers, _) = farm.table();
    assert_eq!(failovers, 0, "a cancelled INVITE is not failed over");
    assert_eq!(c[0].invites + c[1].invites, 4);
    assert_eq!(c[0].cancels + c[1].cancels, 0, "no provisional, no CANCEL");
}

/// RFC 3261 §16.10: a CANCEL while the service rings reaches it; its 200 to the CANCEL stays
/// with fulcrum (which answered the caller's CANCEL itself) and its 487 reaches the caller.
#[test]
fn a_call_cancelled_while_ringing_is_cancelled_at_its_service() {
    if !sipp_available() {
        return;
    }
    let (_, c) = cancelled_calls(
        Transport::Udp,
        &[Sick::Ringing, Sick::Ringing],
        "uac_cancel.xml",
        500,
        4,
    );
    assert_eq!(c[0].cancels + c[1].cancels, 4, "{c:?}");
}

/// The first service never answers, so after `no_answer` (2 s) fulcrum moved the INVITE to
/// the second, which rings; the caller's CANCEL (1.5 s) reaches the second service, and none
/// reaches the first (it never answered: RFC 3261 §9.1, no CANCEL before a provisional).
#[test]
fn a_call_cancelled_after_failover_is_cancelled_at_the_next_service() {
    if !sipp_available() {
        return;
    }
    cancelled_after_failover(Transport::Udp);
}

#[test]
fn over_tcp_a_call_cancelled_after_failover_is_cancelled_at_the_next_service() {
    if !sipp_available() {
        return;
    }
    cancelled_after_failover(Transport::Tcp);
}

/// s0 never answers, s1 rings: the calls s0 took first move to s1 at `no_answer` (2 s) and
/// ring there; the caller cancels 500 ms after the 180, and every CANCEL reaches s1.
fn cancelled_after_failover(t: Transport) {
    let sick = [Sick::Silent, Sick::Ringing];
    let (farm, c) = cancelled_calls(t, &sick, "uac_cancel.xml", 500, 6);
    let (_, failovers, _) = farm.table();
    assert!(c[0].invites >= 1 && failovers >= 1, "no call moved: {c:?}");
    assert_eq!(c[1].cancels, 6, "every call was cancelled at s1: {c:?}");
    assert_eq!(c[0].cancels, 0);
}

/// RFC 3261 §16.7 step 5: the first service answers 200 only after fulcrum gave up on it
/// (2 s, `no_answer` set to 1 s) and moved the INVITE to the second, which answered at once. Both
/// 2xx reach the caller (fixtures/sipp/uac_two_2xx.xml), each with its service's
/// Record-Route, so the caller's ACK and BYE of each dialog reach the service that set it up:
/// no service is left with a dialog never ended, and none answers 481.
#[test]
fn a_late_2xx_reaches_the_caller_and_its_dialog_is_ended_at_its_service() {
    if !sipp_available() {
        return;
    }
    let calls = 6;
    let farm = Farm::start(
        Transport::Udp,
        &[Sick::Late(2000), Sick::Healthy],
        ", method: round_robin, eject: off, failover: { no_answer: 1s }",
    );
    let dir = Scratch::new("late-2xx");
    let load = UacLoad {
        calls,
        rate_per_s: 2,
        hold_ms: 0,
    };
    let scenario = fixture("uac_two_2xx.xml");
    let out =
        Uac::start_with(&dir, Transport::Udp, farm.vs, load, "late", Some(&scenario)).finish();
    let c = farm.counts();
    let (_, failovers, _) = farm.table();
    println!(
        "late 2xx: {} ok, {} failed; services {c:?}; failovers {failovers}",
        out.successful, out.failed
    );
    assert_eq!(
        (out.successful, out.failed),
        (u64::from(calls), 0),
        "{}",
        out.errors
    );
    assert!(c[0].dialogs >= 1 && failovers >= 1, "no late 2xx: {c:?}");
    for (i, c) in c.iter().enumerate() {
        assert_eq!(
            (c.acked, c.byes_ok),
            (c.dialogs, c.dialogs),
            "s{i}: every dialog ACKed and ended: {c:?}"
        );
        assert_eq!((c.r481, c.stray_acks), (0, 0), "s{i}: {c:?}");
    }
}

/// With `max_pending: 8`, a burst of 50 INVITEs: 8 are held, the rest forwarded statelessly
/// and counted (`fulcrum_sip_failover_total{event="table_full"}`). The held ones that met the
/// silent service moved on and succeed, as does every call that reached the healthy one; the
/// others, forwarded without failover to the silent service, fail at the caller, and
/// nothing else happens to fulcrum.
#[test]
fn beyond_max_pending_requests_are_forwarded_statelessly_and_counted() {
    if !sipp_available() {
        return;
    }
    let calls = 50;
    let farm = Farm::start(
        Transport::Udp,
        &[Sick::Silent, Sick::Healthy],
        ", method: round_robin, eject: off, failover: { max_pending: 8 }",
    );
    let dir = Scratch::new("table-full");
    let load = UacLoad {
        calls,
        rate_per_s: 500,
        hold_ms: 100,
    };
    let out = Uac::start_with(
        &dir,
        Transport::Udp,
        farm.vs,
        load,
        "burst",
        Some(&scenario()),
    )
    .finish();
    let c = farm.counts();
    let (held, failovers, full) = farm.table();
    println!(
        "burst: {} ok, {} failed; services {c:?}; held {held}, failovers {failovers}, table_full {full}",
        out.successful, out.failed
    );
    assert_eq!(held, 8, "the table holds max_pending requests");
    assert!(
        full >= u64::from(calls) - 8,
        "every INVITE beyond 8 counted"
    );
    assert!(
        failovers >= 1,
        "a held INVITE met the silent service: {c:?}"
    );
    assert_eq!(out.successful + out.failed, u64::from(calls));
    // Every call the healthy service took succeeded and ended; those that failed were the
    // silent service's, forwarded without failover.
    assert_eq!(c[1].dialogs, out.successful, "{}", out.errors);
    assert_eq!((c[1].acked, c[1].byes_ok), (c[1].dialogs, c[1].dialogs));
    assert!(out.failed <= c[0].invites, "{c:?}");
    assert!(out.successful > u64::from(calls) / 2, "{c:?}");
    for c in &c {
        assert_eq!((c.r481, c.stray_acks), (0, 0), "{c:?}");
    }
}

/// Calls set up on s0 and held; s0 turns busy (503 to new INVITEs) and is EJECTED. Its calls
/// still end there normally (RFC 3261 §16.6: a BYE follows the route set; docs/ejection.md,
/// "New flows only"): their BYEs, sent after the ejection, are answered 200, never 481. New
/// calls go to the others and none fails.
#[test]
fn an_ejected_service_still_ends_its_live_calls() {
    if !sipp_available() {
        return;
    }
    let calls = 45;
    let farm = Farm::start(
        Transport::Udp,
        &[Sick::Healthy, Sick::Healthy, Sick::Healthy],
        ", method: round_robin",
    );
    let dir = Scratch::new("ejected-live");
    let load = UacLoad {
        calls,
        rate_per_s: 15,
        hold_ms: 3000,
    };
    let uac = Uac::start_with(
        &dir,
        Transport::Udp,
        farm.vs,
        load,
        "held",
        Some(&scenario()),
    );
    let s0 = &farm.uas[0];
    wait_until("s0 holds 3 calls", Duration::from_secs(10), || {
        s0.counts().dialogs >= 3
    });
    s0.set_sick(Sick::Busy);
    wait_until("s0 EJECTED", Duration::from_secs(10), || {
        farm.state(0) == "EJECTED"
    });
    let at_eject = s0.counts();
    let out = uac.finish();
    let c = farm.counts();
    println!(
        "ejected: {} ok, {} failed; s0 at ejection {at_eject:?}; services {c:?}; status {}",
        out.successful,
        out.failed,
        router::status(&farm.ops)["vservers"][0]["services"][0]
    );
    assert_eq!(
        (out.successful, out.failed),
        (u64::from(calls), 0),
        "{}",
        out.errors
    );
    assert_eq!(
        farm.state(0),
        "EJECTED",
        "Retry-After 30 s outlasts the run"
    );
    assert!(
        at_eject.byes_ok < at_eject.dialogs,
        "s0 had live calls when ejected: {at_eject:?}"
    );
    assert_eq!(
        c[0].dialogs, at_eject.dialogs,
        "no new call on s0 once ejected"
    );
    assert_eq!(
        (c[0].acked, c[0].byes_ok),
        (c[0].dialogs, c[0].dialogs),
        "s0's calls all ended there: {c:?}"
    );
    for (i, c) in c.iter().enumerate() {
        assert_eq!((c.r481, c.stray_acks), (0, 0), "s{i}: {c:?}");
        assert_eq!(c.byes_ok, c.dialogs, "s{i}: {c:?}");
    }
    // Three 503s in a row eject (docs/ejection.md); INVITEs already on their way may add one.
    assert!(c[0].invites - c[0].dialogs <= 4, "s0 refused {c:?}");
}
