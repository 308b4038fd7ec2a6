//! fulcrum's SIP transaction duties (docs/sip.md, "Failover") with real SIPp callers and
//! strict services (tests/common/strict_uas.rs: a BYE or re-INVITE for a dialog a service did
//! not set up gets 481, as from a production one), Kamailio registrars and reloads:
//!
//! - server transactions over UDP: a non-2xx final to an INVITE (relayed, a CANCELed call's
//!   487, fulcrum's own 500 / 408 / 487) is sent again on Timer G until the caller's ACK and
//!   never after it (RFC 3261 §17.2.1), over a stream only once; a retransmitted MESSAGE gets
//!   the final it was given, the best answer after every try included (§17.2.2); fulcrum's
//!   at-once 503 is stateless, with no 100 before it (§8.2.7);
//! - a failover attempt carries what the first carried: the Path and flow token of a
//!   REGISTER, the Record-Route of an INVITE whose callee hangs up over sip-tcp;
//! - held transactions survive reloads that shift, remove or stop failing over, and a ringing
//!   call's CANCEL still reaches its service;
//! - one final per request on streams when the first attempt cannot even be queued;
//! - registrations converge with `aor_hash`, and `aor_key: user` ignores the domain.
//!
//! Without `sipp` (or `kamailio`) on the PATH a test says why and passes without running,
//! unless `FULCRUM_REQUIRE_SIPP=1` (`FULCRUM_REQUIRE_KAMAILIO=1`), as in CI. Every SIPp
//! process runs under `timeout` and is ended when its guard drops.

mod common;

use common::sipp::{Proc, Scratch, Transport, spawn_listening, uac_counts};
use common::strict_uas::{Counts, Sick, StrictUas};
use fulcrum::admin::router;
use fulcrum::config;
use fulcrum::ops::Ops;
use fulcrum::proxy::{SipStreamCounters, SipStreamPath};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/sipp")
        .join(name)
}

fn ops_of(yaml: &str) -> Arc<Ops> {
    let c =
        config::from_str("sip_transactions.yaml", yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    Ops::start(c, None).expect("start")
}

fn vserver_addr(ops: &Ops) -> SocketAddr {
    ops.with_vservers(|v, _| v[0].bound[0]).expect("running")
}

/// A vserver `v` of `protocol` over `services` (name, address, protocol), with `extra`
/// fields (`, field: value`); no monitor, so a service is UP unless ejected. Each service
/// hashes by its name (`hash_id`), not its port, so a key ranks them the same every run.
fn farm(protocol: &str, services: &[(&str, SocketAddr, &str)], extra: &str) -> String {
    let mut y = String::from("admin: { listen: null }\nservices:\n");
    for (name, addr, proto) in services {
        y.push_str(&format!(
            "  - {{ name: {name}, address: \"{addr}\", protocol: {proto}, hash_id: {name} }}\n"
        ));
    }
    let names: Vec<&str> = services.iter().map(|s| s.0).collect();
    y.push_str(&format!(
        "vservers:\n  - {{ name: v, protocol: {protocol}, bind: [\"127.0.0.1:0\"], record_route: true{extra}, services: [{}] }}\n",
        names.join(", ")
    ));
    y
}

/// Strict services `s0..` over `t`, each sick as given.
fn strict(t: Transport, sick: &[Sick]) -> Vec<StrictUas> {
    sick.iter()
        .enumerate()
        .map(|(i, s)| {
            let u = match t {
                Transport::Udp => StrictUas::udp(&format!("s{i}")),
                Transport::Tcp => StrictUas::tcp(&format!("s{i}")),
            };
            u.set_sick(*s);
            u
        })
        .collect()
}

fn members(uas: &[StrictUas], t: Transport) -> Vec<(&str, SocketAddr, &'static str)> {
    uas.iter()
        .map(|u| (u.name.as_str(), u.addr, t.protocol()))
        .collect()
}

/// The vserver's `fulcrum_sip_failover_total` of `event`, as /metrics shows it.
fn failover_total(ops: &Ops, event: &str) -> u64 {
    metric(
        ops,
        "fulcrum_sip_failover_total{",
        &format!("event=\"{event}\""),
    )
}

/// The value of the first /metrics line starting with `prefix` and containing `label`.
fn metric(ops: &Ops, prefix: &str, label: &str) -> u64 {
    let body = router::handle(ops, &router::Request::new("GET", "/metrics")).body;
    body.lines()
        .find(|l| l.starts_with(prefix) && l.contains(label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
        .unwrap_or_else(|| panic!("no {prefix}..{label} in /metrics:\n{body}"))
}

/// A counter of the sip-tcp vserver's stream shell.
fn stream_counter(ops: &Ops, f: impl Fn(&SipStreamCounters) -> &AtomicU64) -> u64 {
    ops.with_vservers(|vs, _| match vs[0].path::<SipStreamPath>() {
        Some(p) => f(&p.shared().counters).load(Ordering::Relaxed),
        None => panic!("not a sip-tcp vserver"),
    })
    .expect("running")
}

/// Requests the vserver took for its service `i` (`/status` `requests_total`).
fn requests_total(ops: &Ops, i: usize) -> u64 {
    router::status(ops)["vservers"][0]["services"][i]["requests_total"]
        .as_u64()
        .unwrap_or_else(|| panic!("no requests_total for service {i}"))
}

/// How one SIPp UAC run ended.
#[derive(Debug)]
struct Outcome {
    exit: Option<i32>,
    successful: u64,
    failed: u64,
    /// The first lines of SIPp's error log.
    errors: String,
    /// Each (rtd name, milliseconds) of every call (-trace_rtt).
    rtts: Vec<(String, u64)>,
    /// The -trace_msg log: every message SIPp sent and received.
    messages: String,
}

/// Run a SIPp UAC (`scenario`, over `t`, toward `proxy`) to its end: `calls` calls at
/// `rate_per_s`, `-nr` (no retransmission handling of SIPp's own: every copy of a message is
/// matched against the scenario), each call failing after 8 s without an expected message.
/// Bounded by `timeout`.
fn run_uac(
    dir: &Scratch,
    t: Transport,
    proxy: SocketAddr,
    scenario: &Path,
    calls: u32,
    rate_per_s: u32,
    tag: &str,
) -> Outcome {
    run_uac_with(dir, t, proxy, scenario, calls, rate_per_s, tag, &[])
}

/// [`run_uac`] with `extra` SIPp arguments (`-d MS` for a scenario's `<pause/>`).
#[allow(clippy::too_many_arguments)]
fn run_uac_with(
    dir: &Scratch,
    t: Transport,
    proxy: SocketAddr,
    scenario: &Path,
    calls: u32,
    rate_per_s: u32,
    tag: &str,
    extra: &[&str],
) -> Outcome {
    let run = dir.path(tag);
    std::fs::create_dir_all(&run).expect("run dir");
    let stat = run.join("stat.csv");
    let errors = run.join("errors.log");
    let messages = run.join("messages.log");
    let limit = Duration::from_secs(u64::from(calls / rate_per_s.max(1)) + 30);
    let secs = limit.as_secs().to_string();
    let (mut proc, _port): (Proc, u16) = spawn_listening(&format!("sipp uac {tag}"), t, |port| {
        let mut cmd = Command::new("timeout");
        cmd.args(["-s", "KILL", &secs, "sipp", "-t", t.sipp_mode(), "-nr"])
            .arg("-sf")
            .arg(scenario)
            .arg(proxy.to_string())
            .args(["-i", "127.0.0.1", "-p", &port.to_string()])
            .args(["-r", &rate_per_s.to_string(), "-m", &calls.to_string()])
            .args(["-nostdin", "-timeout", &format!("{secs}s")])
            .args(["-recv_timeout", "8000", "-trace_stat", "-stf"])
            .arg(&stat)
            .args(["-trace_rtt", "-rtt_freq", "1"])
            .args(["-trace_err", "-error_file"])
            .arg(&errors)
            .args(["-trace_msg", "-message_file"])
            .arg(&messages)
            .args(extra)
            .current_dir(&run);
        cmd
    });
    let exit = proc.wait_for(limit + Duration::from_secs(5));
    let (successful, failed) = uac_counts(&stat);
    let mut rtts = Vec::new();
    for f in std::fs::read_dir(&run).expect("run dir").flatten() {
        if f.file_name().to_string_lossy().ends_with("_rtt.csv") {
            let text = std::fs::read_to_string(f.path()).unwrap_or_default();
            rtts.extend(text.lines().skip(1).filter_map(|l| {
                let cols: Vec<&str> = l.split(';').collect();
                // SIPp writes milliseconds with a fraction at times ("504.001").
                let ms: f64 = cols.get(1)?.trim().parse().ok()?;
                Some((cols.get(2)?.trim().to_owned(), ms.round() as u64))
            }));
        }
    }
    Outcome {
        exit,
        successful,
        failed,
        errors: std::fs::read_to_string(&errors)
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .take(12)
            .collect::<Vec<_>>()
            .join("\n"),
        rtts,
        messages: std::fs::read_to_string(&messages).unwrap_or_default(),
    }
}

/// `fixtures/sipp/uac_final_twice.xml` expecting `code` instead of 486, written to `dir`.
fn final_twice(dir: &Scratch, code: u16) -> PathBuf {
    let text = std::fs::read_to_string(fixture("uac_final_twice.xml")).expect("fixture");
    let path = dir.path(&format!("uac_final_twice_{code}.xml"));
    std::fs::write(
        &path,
        text.replace("response=\"486\"", &format!("response=\"{code}\"")),
    )
    .expect("write scenario");
    path
}

fn sum(counts: &[Counts], f: impl Fn(&Counts) -> u64) -> u64 {
    counts.iter().map(f).sum()
}

/// `calls` calls through a sip-udp vserver over strict services sick as `sick` (failover on,
/// `extra` vserver fields), each refused with `code`: the caller does not ACK the first copy
/// and must get the final again after T1 (Timer G, 500 ms; accepted 400..=900 ms on a loaded
/// machine), then ACKs, and no copy follows the ACK. The services' counts are returned.
fn final_retransmitted_until_ack(
    sick: &[Sick],
    extra: &str,
    code: u16,
    calls: u32,
    tag: &str,
) -> (Vec<Counts>, Arc<Ops>) {
    let uas = strict(Transport::Udp, sick);
    let ops = ops_of(&farm("sip-udp", &members(&uas, Transport::Udp), extra));
    let counts = timer_g_calls(&ops, &uas, None, code, calls, tag);
    (counts, ops)
}

/// The SIPp run and checks of [`final_retransmitted_until_ack`] through `ops`'s vserver over
/// `uas`, with `scenario` (else fixtures/sipp/uac_final_twice.xml expecting `code`).
fn timer_g_calls(
    ops: &Ops,
    uas: &[StrictUas],
    scenario: Option<PathBuf>,
    code: u16,
    calls: u32,
    tag: &str,
) -> Vec<Counts> {
    let dir = Scratch::new(tag);
    let scenario = scenario.unwrap_or_else(|| final_twice(&dir, code));
    let out = run_uac(
        &dir,
        Transport::Udp,
        vserver_addr(ops),
        &scenario,
        calls,
        10,
        tag,
    );
    println!(
        "{tag}: {out:?}",
        out = (&out.exit, out.successful, out.failed, &out.rtts)
    );
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    let g: Vec<u64> = out
        .rtts
        .iter()
        .filter(|(n, _)| n == "g")
        .map(|(_, ms)| *ms)
        .collect();
    assert_eq!(
        g.len(),
        calls as usize,
        "one Timer G interval per call: {g:?}"
    );
    assert!(
        g.iter().all(|ms| (400..=900).contains(ms)),
        "the second copy of the {code} came T1 (500 ms) after the first: {g:?}"
    );
    // Each final reached the caller exactly twice before its ACK, and never after it.
    let finals = out.messages.matches(&format!("SIP/2.0 {code} ")).count();
    assert_eq!(finals, 2 * calls as usize, "copies of the {code} received");
    let counts: Vec<Counts> = uas.iter().map(StrictUas::counts).collect();
    for (i, c) in counts.iter().enumerate() {
        assert_eq!((c.r481, c.stray_acks), (0, 0), "s{i}: {c:?}");
    }
    counts
}

/// RFC 3261 §17.2.1: a callee's 486 (not a failover code) is relayed, and fulcrum's INVITE
/// server transaction sends it again on Timer G until the caller's ACK, which ends at
/// fulcrum. The callee is asked once and ACKed once (by fulcrum, for its own client
/// transaction): the copies are fulcrum's.
#[test]
fn a_relayed_486_is_sent_again_on_timer_g_until_the_callers_ack() {
    if !common::sipp::sipp_available() {
        return;
    }
    let calls = 10;
    let (counts, _ops) = final_retransmitted_until_ack(
        &[Sick::Refusing; 3],
        ", eject: off",
        486,
        calls,
        "timer-g-486",
    );
    assert_eq!(sum(&counts, |c| c.invites), u64::from(calls), "{counts:?}");
    // Each service saw the INVITE and fulcrum's ACK of its 486, nothing more.
    assert_eq!(
        sum(&counts, |c| c.requests),
        2 * u64::from(calls),
        "{counts:?}"
    );
}

/// fulcrum's own final: every service answers 503, the tries (3) run out and the caller gets
/// the best answer as 500 (§16.7 step 6), sent again on Timer G like a relayed one.
#[test]
fn fulcrums_own_500_after_every_try_is_sent_again_on_timer_g() {
    if !common::sipp::sipp_available() {
        return;
    }
    let calls = 5;
    let (counts, ops) = final_retransmitted_until_ack(
        &[Sick::Overloaded; 3],
        ", eject: off",
        500,
        calls,
        "timer-g-500",
    );
    // Every call tried all three services, each attempt ACKed by fulcrum.
    assert_eq!(
        sum(&counts, |c| c.invites),
        3 * u64::from(calls),
        "{counts:?}"
    );
    assert_eq!(
        sum(&counts, |c| c.requests),
        6 * u64::from(calls),
        "{counts:?}"
    );
    assert_eq!(failover_total(&ops, "exhausted"), u64::from(calls));
}

/// fulcrum's own 408: no service answers an INVITE at all (`no_answer` 200 ms, three tries),
/// and the 408 is sent again on Timer G too.
#[test]
fn fulcrums_own_408_when_no_service_answers_is_sent_again_on_timer_g() {
    if !common::sipp::sipp_available() {
        return;
    }
    let calls = 5;
    let (counts, _ops) = final_retransmitted_until_ack(
        &[Sick::Silent; 3],
        ", eject: off, failover: { no_answer: 200ms }",
        408,
        calls,
        "timer-g-408",
    );
    assert_eq!(
        sum(&counts, |c| c.invites),
        3 * u64::from(calls),
        "{counts:?}"
    );
}

/// Across the transports bridge (a sip-udp vserver over sip-tcp services): the 486 comes
/// back over a service's link and still goes to the UDP caller on Timer G until its ACK.
#[test]
fn across_the_bridge_a_relayed_486_is_sent_again_on_timer_g_until_the_ack() {
    if !common::sipp::sipp_available() {
        return;
    }
    let uas = strict(Transport::Tcp, &[Sick::Refusing; 2]);
    let ops = ops_of(&farm(
        "sip-udp",
        &members(&uas, Transport::Tcp),
        ", eject: off",
    ));
    let calls = 5;
    let counts = timer_g_calls(&ops, &uas, None, 486, calls, "timer-g-bridge");
    assert_eq!(sum(&counts, |c| c.invites), u64::from(calls), "{counts:?}");
}

/// RFC 3261 §16.10: a call cancelled before its service answered anything gets fulcrum's
/// own 487 once the attempt is given up on (`no_answer`, 300 ms here), sent again on Timer
/// G until the ACK (fixtures/sipp/uac_cancel_487_twice.xml without the 180, the 100 then
/// required).
#[test]
fn a_call_cancelled_before_any_answer_gets_fulcrums_487_on_timer_g() {
    if !common::sipp::sipp_available() {
        return;
    }
    let uas = strict(Transport::Udp, &[Sick::Silent; 2]);
    let ops = ops_of(&farm(
        "sip-udp",
        &members(&uas, Transport::Udp),
        ", eject: off, failover: { no_answer: 300ms }",
    ));
    let dir = Scratch::new("cancel-unanswered-scenario");
    let text = std::fs::read_to_string(fixture("uac_cancel_487_twice.xml")).expect("fixture");
    let unanswered = text.replace("<recv response=\"180\"/>", "").replace(
        "<recv response=\"100\" optional=\"true\"/>",
        "<recv response=\"100\"/>",
    );
    assert_ne!(unanswered, text, "the fixture changed shape");
    let scenario = dir.path("uac_cancel_unanswered_487_twice.xml");
    std::fs::write(&scenario, unanswered).expect("write scenario");
    let calls = 5;
    let counts = timer_g_calls(&ops, &uas, Some(scenario), 487, calls, "timer-g-own-487");
    // Cancelled where it was first sent, never moved on (§16.10: nothing to cancel there yet).
    assert_eq!(sum(&counts, |c| c.invites), u64::from(calls), "{counts:?}");
    assert_eq!(failover_total(&ops, "failover"), 0);
}

/// fulcrum's own 503 when no service can take the call (every one DOWN: its `sip-options`
/// monitor got 503) is a stateless answer (RFC 3261 §8.2.7, §16.7 step 6), given before any
/// provisional one: no 100 precedes it (after a 100 the caller stops retransmitting and only
/// Timer G could recover a lost final), and the caller's retransmitted INVITE gets it again
/// at once (fixtures/sipp/uac_invite_twice.xml). No Timer G: a copy after the ACK would fail
/// the call, and exactly two copies arrive per call.
#[test]
fn fulcrums_own_503_when_no_service_is_up_comes_before_any_100_and_again_on_retransmission() {
    if !common::sipp::sipp_available() {
        return;
    }
    let uas = strict(Transport::Udp, &[Sick::Down; 2]);
    let mut y = String::from(
        "admin: { listen: null }\nmonitors:\n  - { name: ping, type: sip-options, interval: 200ms, timeout: 100ms, failures_to_down: 1, successes_to_up: 2 }\nservices:\n",
    );
    for u in &uas {
        y.push_str(&format!(
            "  - {{ name: {}, address: \"{}\", protocol: sip-udp, monitor: ping }}\n",
            u.name, u.addr
        ));
    }
    y.push_str("vservers:\n  - { name: v, protocol: sip-udp, bind: [\"127.0.0.1:0\"], services: [s0, s1] }\n");
    let ops = ops_of(&y);
    common::wait_for("both services DOWN", Duration::from_secs(5), || {
        ["s0", "s1"]
            .iter()
            .all(|n| service_status(&ops, n)["state"] == "DOWN")
            .then_some(())
    });
    let dir = Scratch::new("own-503");
    let calls = 5;
    let out = run_uac(
        &dir,
        Transport::Udp,
        vserver_addr(&ops),
        &fixture("uac_invite_twice.xml"),
        calls,
        10,
        "own-503",
    );
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    assert_eq!(
        received_finals(&out.messages),
        vec![503; 2 * calls as usize]
    );
    let r: Vec<u64> = out
        .rtts
        .iter()
        .filter(|(n, _)| n == "r")
        .map(|(_, ms)| *ms)
        .collect();
    assert!(
        r.len() == calls as usize && r.iter().all(|ms| *ms < 1000),
        "{r:?}"
    );
    let counts: Vec<Counts> = uas.iter().map(StrictUas::counts).collect();
    assert_eq!(
        sum(&counts, |c| c.invites),
        0,
        "no INVITE reached a service: {counts:?}"
    );
}

/// RFC 3261 §9.1, §16.10: a call cancelled while it rings ends 487 (the service's, relayed),
/// and that 487 is sent again on Timer G until the caller's ACK
/// (fixtures/sipp/uac_cancel_487_twice.xml).
#[test]
fn a_cancelled_invites_487_is_sent_again_on_timer_g_until_the_ack() {
    if !common::sipp::sipp_available() {
        return;
    }
    let uas = strict(Transport::Udp, &[Sick::Ringing; 2]);
    let ops = ops_of(&farm(
        "sip-udp",
        &members(&uas, Transport::Udp),
        ", eject: off",
    ));
    let calls = 5;
    let counts = timer_g_calls(
        &ops,
        &uas,
        Some(fixture("uac_cancel_487_twice.xml")),
        487,
        calls,
        "timer-g-487",
    );
    assert_eq!(sum(&counts, |c| c.cancels), u64::from(calls), "{counts:?}");
    assert_eq!(sum(&counts, |c| c.invites), u64::from(calls), "{counts:?}");
}

/// RFC 3261 §17.2.2: a MESSAGE every service refuses (503) gets the best answer, 500, and
/// the same MESSAGE sent again gets that 500 at once from fulcrum's memory: no service is
/// asked again.
#[test]
fn a_retransmitted_message_gets_the_remembered_best_answer() {
    if !common::sipp::sipp_available() {
        return;
    }
    let uas = strict(Transport::Udp, &[Sick::Overloaded; 3]);
    let ops = ops_of(&farm(
        "sip-udp",
        &members(&uas, Transport::Udp),
        ", eject: off",
    ));
    let dir = Scratch::new("message-twice");
    let calls = 5;
    let out = run_uac(
        &dir,
        Transport::Udp,
        vserver_addr(&ops),
        &fixture("uac_message_twice.xml"),
        calls,
        10,
        "message",
    );
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    let counts: Vec<Counts> = uas.iter().map(StrictUas::counts).collect();
    // Three attempts per MESSAGE (one per service), none for its retransmission.
    assert_eq!(
        sum(&counts, |c| c.requests),
        3 * u64::from(calls),
        "{counts:?}"
    );
    let r: Vec<u64> = out
        .rtts
        .iter()
        .filter(|(n, _)| n == "r")
        .map(|(_, ms)| *ms)
        .collect();
    assert_eq!(r.len(), calls as usize, "{r:?}");
    assert!(
        r.iter().all(|ms| *ms < 1000),
        "the remembered answer comes at once (the services' counts above show none was asked): {r:?}"
    );
    assert_eq!(failover_total(&ops, "exhausted"), u64::from(calls));
}

/// The status codes of the final responses SIPp received, in order, from its -trace_msg log
/// (blocks headed `... message received [N] bytes :`).
fn received_finals(messages: &str) -> Vec<u16> {
    messages
        .split("-----------------------------------------------")
        .filter(|block| block.contains("message received"))
        .filter_map(|block| {
            let status = block.lines().find(|l| l.starts_with("SIP/2.0 "))?;
            status.split(' ').nth(1)?.parse().ok()
        })
        .filter(|code| *code >= 200)
        .collect()
}

/// A SIPp UAS running `scenario` over `t` on a port of its own, for `calls` calls at most,
/// bounded by `timeout`; its stat file is `dir`/`tag`-uas.csv.
fn sipp_uas(dir: &Scratch, t: Transport, scenario: &Path, calls: u32, tag: &str) -> (Proc, u16) {
    let stat = dir.path(&format!("{tag}-uas.csv"));
    spawn_listening(&format!("sipp uas {tag}"), t, |port| {
        let mut cmd = Command::new("timeout");
        cmd.args(["-s", "KILL", "120", "sipp", "-t", t.sipp_mode()])
            .arg("-sf")
            .arg(scenario)
            .args(["-i", "127.0.0.1", "-p", &port.to_string()])
            .args(["-m", &calls.to_string(), "-nostdin"])
            .args(["-trace_stat", "-stf"])
            .arg(&stat)
            .current_dir(&dir.0);
        cmd
    })
}

/// Over sip-tcp the first service refuses connections (its port is closed), so a request
/// taken for it cannot even be queued on its link; the held INVITE moves to the next service
/// inside its transaction. Each SIPp call (fixtures/sipp/uac_rr.xml: INVITE, 200, ACK, BYE
/// along the Record-Route, 200) gets exactly one final per request, never fulcrum's 503
/// beside the second service's 200 (an unexpected 503 would fail the call too).
#[test]
fn over_tcp_an_attempt_no_link_can_take_moves_on_with_one_final_answer() {
    if !common::sipp::sipp_available() {
        return;
    }
    let ok = StrictUas::tcp("s1");
    let refusing = common::closed_port("127.0.0.1");
    let ops = ops_of(&farm(
        "sip-tcp",
        &[("s0", refusing, "sip-tcp"), ("s1", ok.addr, "sip-tcp")],
        ", method: round_robin, eject: off",
    ));
    let dir = Scratch::new("tcp-refused");
    let calls = 20;
    let out = run_uac(
        &dir,
        Transport::Tcp,
        vserver_addr(&ops),
        &fixture("uac_rr.xml"),
        calls,
        20,
        "refused",
    );
    // The test tests something: a request was taken for s0 (and moved on), before its link
    // was marked down and round robin passed it over.
    assert!(requests_total(&ops, 0) >= 1, "no request was taken for s0");
    // Moved on to s1 (rerouted), none left without a member (answered 503: lost).
    assert!(stream_counter(&ops, |c| &c.requests_rerouted) >= 1);
    assert_eq!(stream_counter(&ops, |c| &c.requests_lost), 0);
    one_final_each(&out, calls, &ok);
}

/// What every call of a [`run_uac`] of fixtures/sipp/uac_rr.xml must have seen when `ok`
/// answered all of them: success, one 200 to its INVITE and one to its BYE and no other
/// final, its dialog set up and ended at `ok`, which saw no request for another's dialog.
fn one_final_each(out: &Outcome, calls: u32, ok: &StrictUas) {
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    let finals = received_finals(&out.messages);
    assert_eq!(
        finals,
        vec![200; 2 * calls as usize],
        "one final per request, each a 200"
    );
    let c = ok.counts();
    assert_eq!(
        (c.dialogs, c.byes_ok, c.r481),
        (u64::from(calls), u64::from(calls), 0),
        "{c:?}"
    );
}

/// The same when the first service's link was up and its service then went away (its
/// connections closed, its port refusing): calls taken for it in round robin move on, each
/// with one final.
#[test]
fn over_tcp_an_attempt_on_a_closed_link_moves_on_with_one_final_answer() {
    if !common::sipp::sipp_available() {
        return;
    }
    let gone = StrictUas::tcp("s0");
    let ok = StrictUas::tcp("s1");
    let ops = ops_of(&farm(
        "sip-tcp",
        &[("s0", gone.addr, "sip-tcp"), ("s1", ok.addr, "sip-tcp")],
        ", method: round_robin, eject: off",
    ));
    let dir = Scratch::new("tcp-closed");
    let vs = vserver_addr(&ops);
    let first = run_uac(
        &dir,
        Transport::Tcp,
        vs,
        &fixture("uac_rr.xml"),
        4,
        20,
        "before",
    );
    assert_eq!((first.successful, first.failed), (4, 0), "{}", first.errors);
    assert!(
        gone.counts().dialogs > 0,
        "s0's link was up: {:?}",
        gone.counts()
    );
    let before = ok.counts();
    let taken_before = requests_total(&ops, 0);
    // s0 goes away: its listener and, within 200 ms, its connections close; fulcrum sees
    // its link end.
    let at = gone.addr;
    drop(gone);
    assert!(
        common::wait_until(Duration::from_secs(5), || {
            std::net::TcpStream::connect(at).is_err()
                && stream_counter(&ops, |c| &c.service_connections_lost) >= 1
        }),
        "s0's port still accepts, or fulcrum did not see its link end"
    );
    let calls = 20;
    let out = run_uac(
        &dir,
        Transport::Tcp,
        vs,
        &fixture("uac_rr.xml"),
        calls,
        20,
        "after",
    );
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    assert_eq!(
        received_finals(&out.messages),
        vec![200; 2 * calls as usize],
        "one final per request, each a 200"
    );
    assert!(
        requests_total(&ops, 0) > taken_before,
        "no request was taken for s0 after it went away"
    );
    // Moved on to s1 (rerouted), none left without a member (answered 503: lost).
    assert!(stream_counter(&ops, |c| &c.requests_rerouted) >= 1);
    assert_eq!(stream_counter(&ops, |c| &c.requests_lost), 0);
    let c = ok.counts();
    assert_eq!(c.dialogs - before.dialogs, u64::from(calls), "{c:?}");
    assert_eq!(c.r481, 0, "{c:?}");
}

/// RFC 3261 §16.6 step 4, §12.1.2: over sip-tcp, an INVITE that failed over (the first
/// service answers 503) reaches the second with fulcrum's Record-Route and the flow token in
/// it, so the callee's own BYE (fixtures/sipp/uas_hangs_up.xml, a SIPp UAS) finds the
/// caller's connection, whose Contact names only SIPp's listening port.
#[test]
fn over_tcp_a_failed_over_invite_keeps_the_record_route_the_callees_bye_follows() {
    hangup_after_failover(Sick::Busy, Transport::Tcp);
}

/// The same when the first service is silent: the attempt moved on at `no_answer` (300 ms)
/// is built from the held request, and keeps the Record-Route too.
#[test]
fn over_tcp_an_invite_moved_on_after_silence_keeps_the_record_route_the_callees_bye_follows() {
    hangup_after_failover(Sick::Silent, Transport::Tcp);
}

/// Across the transports bridge (a sip-tcp vserver over sip-udp services, record-routed
/// twice, RFC 5658 §3.2): the callee's BYE over UDP still finds the caller's connection.
#[test]
fn across_the_bridge_a_failed_over_invite_keeps_the_record_route_the_callees_bye_follows() {
    hangup_after_failover(Sick::Busy, Transport::Udp);
}

/// SIPp calls over sip-tcp to services over `services`, taken in round robin: s0 (strict)
/// sick as `sick`, s1 a SIPp callee that hangs up; every call succeeds and half of them
/// failed over first.
fn hangup_after_failover(sick: Sick, services: Transport) {
    if !common::sipp::sipp_available() {
        return;
    }
    let dir = Scratch::new(&format!("tcp-hangup-{sick:?}-{}", services.protocol()));
    let calls = 10;
    let busy = strict(services, &[sick]).remove(0);
    let (mut uas, port) = sipp_uas(
        &dir,
        services,
        &fixture("uas_hangs_up.xml"),
        calls,
        "hangup",
    );
    let callee = SocketAddr::from(([127, 0, 0, 1], port));
    let proto = services.protocol();
    let ops = ops_of(&farm(
        "sip-tcp",
        &[("s0", busy.addr, proto), ("s1", callee, proto)],
        ", method: round_robin, eject: off, failover: { no_answer: 300ms }",
    ));
    let out = run_uac(
        &dir,
        Transport::Tcp,
        vserver_addr(&ops),
        &fixture("uac_hung_up.xml"),
        calls,
        10,
        "hangup",
    );
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    let moved = failover_total(&ops, "failover");
    assert!(
        moved >= u64::from(calls) / 2,
        "half the calls (s0's in round robin) failed over: {moved}"
    );
    // Every BYE came from the callee through fulcrum, and the callee got its 200.
    // The 200s the caller got name fulcrum's flow to it in their Record-Route.
    let flows = out
        .messages
        .lines()
        .filter(|l| l.starts_with("Record-Route:") && l.contains(";fc-flow="))
        .count();
    assert!(
        flows >= calls as usize,
        "Record-Routes with a flow token: {flows}"
    );
    let byes = out.messages.matches("BYE sip:sipp@").count();
    assert_eq!(byes, calls as usize, "BYEs the caller received");
    assert_eq!(
        uas.wait_for(Duration::from_secs(10)),
        Some(0),
        "the SIPp callee's calls all ended well"
    );
    let c = busy.counts();
    assert_eq!((c.dialogs, c.r481), (0, 0), "{c:?}");
}

/// A REGISTER for `user@domain` from `phone` (Contact: an address no one reaches, as a NAT's
/// inside one), sent to `to`; its final answer (3 s at most).
fn register(
    phone: &std::net::UdpSocket,
    to: SocketAddr,
    user: &str,
    domain: &str,
    call_id: &str,
    cseq: u32,
) -> Option<String> {
    let me = phone.local_addr().expect("addr");
    let msg = format!(
        "REGISTER sip:{domain} SIP/2.0\r\nVia: SIP/2.0/UDP {me};branch=z9hG4bK{call_id}.{cseq};rport\r\n\
         Max-Forwards: 70\r\nFrom: <sip:{user}@{domain}>;tag=f{call_id}\r\nTo: <sip:{user}@{domain}>\r\n\
         Call-ID: {call_id}\r\nCSeq: {cseq} REGISTER\r\nContact: <sip:{user}@10.1.2.3:9>\r\n\
         Expires: 300\r\nContent-Length: 0\r\n\r\n"
    );
    phone.send_to(msg.as_bytes(), to).expect("send REGISTER");
    let mut buf = vec![0u8; 65_536];
    let end = std::time::Instant::now() + common::ANSWER;
    while std::time::Instant::now() < end {
        let (n, _) = common::recv_from_retrying(phone, &mut buf).ok()?;
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        let ours = text.contains(&format!("Call-ID: {call_id}\r\n"))
            && text.contains(&format!("CSeq: {cseq} REGISTER"));
        let code = text.get(8..11).and_then(|c| c.parse::<u16>().ok());
        if ours && code.is_some_and(|c| c >= 200) {
            return Some(text);
        }
    }
    None
}

/// The registrars (indices into `regs`) that received a request of `call_id`, and how many.
fn holders(regs: &[StrictUas], call_id: &str) -> Vec<(usize, usize)> {
    regs.iter()
        .enumerate()
        .map(|(i, r)| (i, r.methods_of(call_id).len()))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// docs/sip.md, "Registrations: one registrar per user": with `aor_hash` a REGISTER is not
/// pinned by its Call-ID. A user's registrar refuses (503) a refresh, which fails over to the
/// next-ranked one; once it is back, the next refresh (same Call-ID, next CSeq, RFC 3261
/// §10.2.4) reaches it again, not the registrar the failover found.
#[test]
fn with_aor_hash_refreshes_return_to_the_first_registrar_once_it_is_back() {
    let regs = strict(Transport::Udp, &[Sick::Healthy; 3]);
    let ops = ops_of(&farm(
        "sip-udp",
        &members(&regs, Transport::Udp),
        ", method: aor_hash, eject: off",
    ));
    let vs = vserver_addr(&ops);
    let phone = common::udp_client("127.0.0.1");
    for u in 0..6 {
        let (user, call_id) = (format!("conv{u}"), format!("conv-{u}"));
        let ok = |cseq| {
            let a = register(&phone, vs, &user, "example.com", &call_id, cseq)
                .unwrap_or_else(|| panic!("no answer to REGISTER {call_id} {cseq}"));
            assert!(a.starts_with("SIP/2.0 200 "), "{a}");
        };
        ok(1);
        let at = holders(&regs, &call_id);
        assert_eq!(at.len(), 1, "{user} registered at one registrar: {at:?}");
        let home = at[0].0;
        // Its registrar refuses: the refresh fails over.
        regs[home].set_sick(Sick::Overloaded);
        ok(2);
        regs[home].set_sick(Sick::Healthy);
        let moved: Vec<(usize, usize)> = holders(&regs, &call_id)
            .into_iter()
            .filter(|(i, _)| *i != home)
            .collect();
        assert_eq!(
            moved.len(),
            1,
            "{user}: the refresh failed over once: {moved:?}"
        );
        // Back: the next refresh reaches the home registrar again.
        ok(3);
        assert_eq!(
            regs[home].methods_of(&call_id),
            ["REGISTER"; 3],
            "{user}: every REGISTER but the refused one's failover reached r{home}"
        );
        assert_eq!(
            holders(&regs, &call_id),
            {
                let mut h = vec![(home, 3), moved[0]];
                h.sort();
                h
            },
            "{user}: the failover registrar got only the refused refresh"
        );
    }
    assert!(failover_total(&ops, "failover") >= 6);
}

/// `aor_key: user`: a user's registrations in two domains hash by the user part alone and
/// reach one registrar; with the whole URI (the default) some user's two registrations are
/// split (with names as `hash_id`, the ranking is the same every run).
#[test]
fn with_aor_key_user_a_user_of_two_domains_registers_at_one_registrar() {
    let split = |extra: &str| -> usize {
        let regs = strict(Transport::Udp, &[Sick::Healthy; 3]);
        let ops = ops_of(&farm(
            "sip-udp",
            &members(&regs, Transport::Udp),
            &format!(", method: aor_hash{extra}"),
        ));
        let vs = vserver_addr(&ops);
        let phone = common::udp_client("127.0.0.1");
        (0..12)
            .filter(|u| {
                let user = format!("dom{u}");
                let at: Vec<usize> = ["a.example", "b.example"]
                    .iter()
                    .map(|domain| {
                        let call_id = format!("{user}-{domain}");
                        let a = register(&phone, vs, &user, domain, &call_id, 1)
                            .unwrap_or_else(|| panic!("no answer to REGISTER {call_id}"));
                        assert!(a.starts_with("SIP/2.0 200 "), "{a}");
                        let h = holders(&regs, &call_id);
                        assert_eq!(h.len(), 1, "{call_id}: {h:?}");
                        h[0].0
                    })
                    .collect();
                at[0] != at[1]
            })
            .count()
    };
    assert_eq!(
        split(", aor_key: user"),
        0,
        "users split with aor_key: user"
    );
    assert!(split("") > 0, "no user split by domain with the whole URI");
}

/// A REGISTER that fails over carries what its first attempt carried: fulcrum's Path with the
/// phone's flow token (`path: always`). The first-ranked registrar of some users refuses
/// (a strict service answering 503); their REGISTERs reach the second, a Kamailio registrar
/// that stores Path (`use_path`). A caller then asks that registrar for each user directly:
/// its INVITE, routed along the stored Path, reaches each phone at the address it registered
/// from through fulcrum, though the phone's Contact names an address no one reaches.
#[test]
fn a_register_that_failed_over_reaches_the_next_registrar_with_its_path_and_flow_token() {
    register_failover_keeps_path(FirstRegistrar::Refusing);
}

/// The same when the first-ranked registrar is silent (a socket that never answers) and
/// `no_answer_non_invite` (500 ms) moves a REGISTER on silence.
#[test]
fn a_register_that_failed_over_on_silence_reaches_the_next_registrar_with_its_path() {
    register_failover_keeps_path(FirstRegistrar::Silent);
}

/// How the first-ranked registrar fails a REGISTER.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FirstRegistrar {
    /// A strict service answering 503 to everything.
    Refusing,
    /// A UDP socket nobody reads.
    Silent,
}

fn register_failover_keeps_path(first: FirstRegistrar) {
    if !common::kamailio_available() {
        return;
    }
    let scratch = Scratch::new(&format!("path-failover-{first:?}"));
    let (_kamailio, port) = spawn_listening("path registrar", Transport::Udp, |port| {
        let cfg = scratch.path(&format!("path-{port}.cfg"));
        std::fs::write(&cfg, common::kamailio_path_registrar_cfg(port))
            .expect("write kamailio config");
        let mut c = Command::new("kamailio");
        c.arg("-f").arg(cfg).args(["-DD", "-E"]);
        c
    });
    let registrar = SocketAddr::from(([127, 0, 0, 1], port));
    let refusing = StrictUas::udp("r0");
    refusing.set_sick(Sick::Overloaded);
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind silent registrar");
    let (r0, extra) = match first {
        FirstRegistrar::Refusing => (refusing.addr, ""),
        FirstRegistrar::Silent => (
            silent.local_addr().expect("addr"),
            ", failover: { no_answer_non_invite: 500ms }",
        ),
    };
    let ops = ops_of(&farm(
        "sip-udp",
        &[("r0", r0, "sip-udp"), ("r1", registrar, "sip-udp")],
        &format!(", method: aor_hash, path: always, eject: off{extra}"),
    ));
    let vs = vserver_addr(&ops);
    let users: Vec<String> = (0..10).map(|u| format!("nat{u}")).collect();
    let phones: Vec<std::net::UdpSocket> = users
        .iter()
        .map(|_| common::udp_client("127.0.0.2"))
        .collect();
    for (user, phone) in users.iter().zip(&phones) {
        let answer = register(phone, vs, user, "example.com", &format!("reg-{user}"), 1)
            .unwrap_or_else(|| panic!("no answer to {user}'s REGISTER"));
        assert!(answer.starts_with("SIP/2.0 200 "), "{answer}");
    }
    // Some users rank r0 first (the same ones with either failure: services hash by name).
    let moved = failover_total(&ops, "failover");
    assert!(
        moved > 0,
        "no user ranks r0 first: the test would test nothing"
    );
    if first == FirstRegistrar::Refusing {
        let refused = users
            .iter()
            .filter(|u| !refusing.methods_of(&format!("reg-{u}")).is_empty())
            .count();
        assert_eq!(
            moved, refused as u64,
            "each REGISTER r0 refused moved on once"
        );
    }
    // The caller asks the registrar for every user, directly.
    let caller = common::udp_client("127.0.0.1");
    let me = caller.local_addr().expect("addr");
    let mut buf = vec![0u8; 65_536];
    for (user, phone) in users.iter().zip(&phones) {
        let invite = format!(
            "INVITE sip:{user}@example.com SIP/2.0\r\nVia: SIP/2.0/UDP {me};branch=z9hG4bKcall{user};rport\r\n\
             Max-Forwards: 70\r\nFrom: <sip:caller@example.com>;tag=c{user}\r\nTo: <sip:{user}@example.com>\r\n\
             Call-ID: call-{user}\r\nCSeq: 1 INVITE\r\nContact: <sip:caller@{me}>\r\nContent-Length: 0\r\n\r\n"
        );
        caller
            .send_to(invite.as_bytes(), registrar)
            .expect("send INVITE");
        let (n, from) = common::recv_from_retrying(phone, &mut buf)
            .unwrap_or_else(|e| panic!("{user}'s call did not reach the phone: {e}"));
        let call = String::from_utf8_lossy(&buf[..n]).into_owned();
        assert!(
            call.starts_with(&format!("INVITE sip:{user}@10.1.2.3:9 SIP/2.0")),
            "{call}"
        );
        assert!(call.contains(&format!("Call-ID: call-{user}")), "{call}");
        assert_eq!(from, vs, "through fulcrum");
    }
}

/// A service's entry in `/status`, by name.
fn service_status(ops: &Ops, name: &str) -> serde_json::Value {
    let status = router::status(ops);
    status["vservers"][0]["services"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no service {name} in {status}"))
}

/// The config of the reload tests: strict UDP services `names` (name, address), `extra`
/// vserver fields.
fn reload_farm(services: &[(&str, SocketAddr)], extra: &str) -> String {
    let members: Vec<(&str, SocketAddr, &str)> =
        services.iter().map(|(n, a)| (*n, *a, "sip-udp")).collect();
    farm("sip-udp", &members, extra)
}

/// A reload while INVITEs are held at a silent service: the reload inserts a service in
/// front (every index shifts by one) before the held INVITEs' `no_answer` (2 s) ends. They
/// still fail over to a service other than the silent one, every call succeeds (SIPp,
/// fixtures/sipp/uac_rr.xml, ACK and BYE along the Record-Route, no 481 anywhere), and the
/// silence is charged to the silent service (EJECTED after three failures in a row,
/// docs/ejection.md), not to the service now at its old index.
#[test]
fn a_reload_shifting_indices_while_invites_are_held_still_fails_them_over_right() {
    if !common::sipp::sipp_available() {
        return;
    }
    let front = StrictUas::udp("front");
    let silent = StrictUas::udp("silent");
    silent.set_sick(Sick::Silent);
    let last = StrictUas::udp("last");
    let before = reload_farm(&[("silent", silent.addr), ("last", last.addr)], "");
    let after = reload_farm(
        &[
            ("front", front.addr),
            ("silent", silent.addr),
            ("last", last.addr),
        ],
        "",
    );
    let file = common::ConfigFile::new("sip-tx-reload-shift", &before);
    let ops = Ops::start(
        config::load(&file.path).expect("valid"),
        Some(file.path.clone()),
    )
    .expect("start");
    let vs = vserver_addr(&ops);
    let dir = Scratch::new("reload-shift");
    let calls = 20;
    let out = std::thread::scope(|s| {
        let uac = s.spawn(|| {
            run_uac(
                &dir,
                Transport::Udp,
                vs,
                &fixture("uac_rr.xml"),
                calls,
                20,
                "shift",
            )
        });
        // Three INVITEs held at the silent service (enough to eject it), none moved on yet.
        common::wait_for(
            "3 INVITEs at the silent service",
            Duration::from_secs(10),
            || (silent.counts().invites >= 3).then_some(()),
        );
        file.write(&after);
        let changes = ops.reload().expect("reload");
        assert!(
            changes.iter().any(|c| c == "vservers.v rebuilt"),
            "{changes:?}"
        );
        assert_eq!(
            failover_total(&ops, "failover"),
            0,
            "the reload came while the INVITEs were held"
        );
        uac.join().expect("uac thread")
    });
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    let held_at_silent = silent.counts().invites;
    assert!(failover_total(&ops, "failover") >= held_at_silent);
    for u in [&front, &silent, &last] {
        let c = u.counts();
        assert_eq!((c.r481, c.stray_acks), (0, 0), "{}: {c:?}", u.name);
    }
    assert_eq!(silent.counts().dialogs, 0);
    assert_eq!(
        front.counts().byes_ok + last.counts().byes_ok,
        u64::from(calls),
        "every call set up and ended at a service that answers"
    );
    let state = |n: &str| {
        service_status(&ops, n)["state"]
            .as_str()
            .unwrap_or("?")
            .to_owned()
    };
    assert_eq!(
        state("silent"),
        "EJECTED",
        "{}",
        service_status(&ops, "silent")
    );
    assert_eq!(state("front"), "UP", "{}", service_status(&ops, "front"));
    assert_eq!(state("last"), "UP", "{}", service_status(&ops, "last"));
}

/// A reload that turns failover off while INVITEs are held at a silent service: the held
/// INVITEs finish as they began (they move on at `no_answer` and are answered 200), and no
/// caller gets a stray final (a 503 or 408 from a transaction the reload dropped) beside it.
#[test]
fn a_reload_turning_failover_off_lets_held_invites_finish() {
    if !common::sipp::sipp_available() {
        return;
    }
    let silent = StrictUas::udp("silent");
    silent.set_sick(Sick::Silent);
    let ok = StrictUas::udp("ok");
    let services = [("silent", silent.addr), ("ok", ok.addr)];
    let file = common::ConfigFile::new("sip-tx-reload-off", &reload_farm(&services, ""));
    let ops = Ops::start(
        config::load(&file.path).expect("valid"),
        Some(file.path.clone()),
    )
    .expect("start");
    let vs = vserver_addr(&ops);
    let dir = Scratch::new("reload-off");
    let calls = 10;
    let out = std::thread::scope(|s| {
        let uac = s.spawn(|| {
            run_uac(
                &dir,
                Transport::Udp,
                vs,
                &fixture("uac_rr.xml"),
                calls,
                50,
                "off",
            )
        });
        // Every INVITE placed (and some held at the silent service) before the reload: a new
        // INVITE after it would go statelessly to the silent service and fail.
        common::wait_for("every INVITE placed", Duration::from_secs(10), || {
            let at_silent = silent.counts().invites;
            (at_silent >= 1 && at_silent + ok.counts().invites >= u64::from(calls)).then_some(())
        });
        file.write(&reload_farm(&services, ", failover: off"));
        // Through the admin API this time.
        let r = router::handle(&ops, &router::Request::new("POST", "/reload"));
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.body.contains("vservers.v rebuilt"), "{}", r.body);
        assert_eq!(failover_total(&ops, "failover"), 0, "held at the reload");
        uac.join().expect("uac thread")
    });
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    assert_eq!(
        received_finals(&out.messages),
        vec![200; 2 * calls as usize],
        "one final per request, each a 200"
    );
    let c = ok.counts();
    assert_eq!(
        (c.dialogs, c.byes_ok, c.r481),
        (u64::from(calls), u64::from(calls), 0),
        "{c:?}"
    );
}

/// A reload that removes the silent service while INVITEs are held there: they still move
/// on at `no_answer` to the service that remains, and every call succeeds there.
#[test]
fn a_reload_removing_the_service_invites_are_held_at_still_fails_them_over() {
    if !common::sipp::sipp_available() {
        return;
    }
    let silent = StrictUas::udp("silent");
    silent.set_sick(Sick::Silent);
    let ok = StrictUas::udp("ok");
    let file = common::ConfigFile::new(
        "sip-tx-reload-remove",
        &reload_farm(&[("silent", silent.addr), ("ok", ok.addr)], ""),
    );
    let ops = Ops::start(
        config::load(&file.path).expect("valid"),
        Some(file.path.clone()),
    )
    .expect("start");
    let vs = vserver_addr(&ops);
    let dir = Scratch::new("reload-remove");
    let calls = 10;
    let out = std::thread::scope(|s| {
        let uac = s.spawn(|| {
            run_uac(
                &dir,
                Transport::Udp,
                vs,
                &fixture("uac_rr.xml"),
                calls,
                50,
                "remove",
            )
        });
        common::wait_for("every INVITE placed", Duration::from_secs(10), || {
            let at_silent = silent.counts().invites;
            (at_silent >= 1 && at_silent + ok.counts().invites >= u64::from(calls)).then_some(())
        });
        file.write(&reload_farm(&[("ok", ok.addr)], ""));
        let changes = ops.reload().expect("reload");
        assert!(
            changes.iter().any(|c| c == "vservers.v rebuilt"),
            "{changes:?}"
        );
        assert_eq!(failover_total(&ops, "failover"), 0, "held at the reload");
        uac.join().expect("uac thread")
    });
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    assert_eq!(
        received_finals(&out.messages),
        vec![200; 2 * calls as usize],
        "one final per request, each a 200"
    );
    let c = ok.counts();
    assert_eq!(
        (c.dialogs, c.byes_ok, c.r481),
        (u64::from(calls), u64::from(calls), 0),
        "{c:?}"
    );
}

/// A reload that shifts service indices while calls ring (their INVITEs held, answered 180
/// by strict services that ring until cancelled): each caller's CANCEL, 1 s after the 180
/// (fixtures/sipp/uac_cancel.xml), still reaches the service its INVITE rings at (RFC 3261
/// §16.10), never the service now at that index (which would answer it 481), and the call
/// ends 487.
#[test]
fn a_reload_shifting_indices_while_calls_ring_still_cancels_them_where_they_ring() {
    if !common::sipp::sipp_available() {
        return;
    }
    let front = StrictUas::udp("front");
    let ring: Vec<StrictUas> = (0..2)
        .map(|i| {
            let u = StrictUas::udp(&format!("ring{i}"));
            u.set_sick(Sick::Ringing);
            u
        })
        .collect();
    let before = reload_farm(&[("ring0", ring[0].addr), ("ring1", ring[1].addr)], "");
    let after = reload_farm(
        &[
            ("front", front.addr),
            ("ring0", ring[0].addr),
            ("ring1", ring[1].addr),
        ],
        "",
    );
    let file = common::ConfigFile::new("sip-tx-reload-ringing", &before);
    let ops = Ops::start(
        config::load(&file.path).expect("valid"),
        Some(file.path.clone()),
    )
    .expect("start");
    let vs = vserver_addr(&ops);
    let dir = Scratch::new("reload-ringing");
    let calls = 10;
    let out = std::thread::scope(|s| {
        let uac = s.spawn(|| {
            run_uac_with(
                &dir,
                Transport::Udp,
                vs,
                &fixture("uac_cancel.xml"),
                calls,
                50,
                "ringing",
                &["-d", "1000"],
            )
        });
        common::wait_for("every call ringing", Duration::from_secs(10), || {
            (ring.iter().map(|r| r.counts().invites).sum::<u64>() >= u64::from(calls)).then_some(())
        });
        file.write(&after);
        let changes = ops.reload().expect("reload");
        assert!(
            changes.iter().any(|c| c == "vservers.v rebuilt"),
            "{changes:?}"
        );
        assert_eq!(
            ring.iter().map(|r| r.counts().cancels).sum::<u64>(),
            0,
            "the reload came before the CANCELs"
        );
        uac.join().expect("uac thread")
    });
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "every call gets 200 to its CANCEL and 487 to its INVITE\n{}",
        out.errors
    );
    assert_eq!(front.counts().requests, 0, "{:?}", front.counts());
    for r in &ring {
        let c = r.counts();
        assert_eq!(
            c.cancels, c.invites,
            "{}: each INVITE cancelled there: {c:?}",
            r.name
        );
        assert_eq!(
            (c.stray_cancels, c.r481, c.stray_acks, c.dialogs),
            (0, 0, 0, 0),
            "{}: {c:?}",
            r.name
        );
    }
}

/// Over a stream the transport is reliable: no Timer G (RFC 3261 §17.2.1). A sip-tcp caller
/// that waits 1.5 s before ACKing a relayed 486 gets it once
/// (fixtures/sipp/uac_final_twice.xml with the second copy replaced by that wait: a copy
/// would be an unexpected message and fail the call).
#[test]
fn over_tcp_a_486_is_sent_once() {
    if !common::sipp::sipp_available() {
        return;
    }
    let uas = strict(Transport::Tcp, &[Sick::Refusing; 2]);
    let ops = ops_of(&farm(
        "sip-tcp",
        &members(&uas, Transport::Tcp),
        ", eject: off",
    ));
    let dir = Scratch::new("tcp-final-once");
    let text = std::fs::read_to_string(fixture("uac_final_twice.xml")).expect("fixture");
    let once = text
        .replace(
            "<recv response=\"486\" rtd=\"g\"/>",
            "<pause milliseconds=\"1500\"/>",
        )
        .replace(" start_rtd=\"g\"", "");
    assert_ne!(once, text, "the fixture changed shape");
    let scenario = dir.path("uac_final_once.xml");
    std::fs::write(&scenario, once).expect("write scenario");
    let calls = 5;
    let out = run_uac(
        &dir,
        Transport::Tcp,
        vserver_addr(&ops),
        &scenario,
        calls,
        10,
        "once",
    );
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    assert_eq!(received_finals(&out.messages), vec![486; calls as usize]);
}

/// RFC 3261 §17.2.1: an INVITE retransmitted after its relayed 486 (200 ms later, before
/// the ACK) gets the 486 again at once from the server transaction, well before Timer G's
/// copy (due 500 ms after the first), and the service is not asked again
/// (fixtures/sipp/uac_invite_twice.xml expecting 486, after fulcrum's 100).
#[test]
fn a_retransmitted_invite_gets_the_relayed_486_again_at_once() {
    if !common::sipp::sipp_available() {
        return;
    }
    let uas = strict(Transport::Udp, &[Sick::Refusing; 2]);
    let ops = ops_of(&farm(
        "sip-udp",
        &members(&uas, Transport::Udp),
        ", eject: off",
    ));
    let dir = Scratch::new("invite-twice-486");
    let text = std::fs::read_to_string(fixture("uac_invite_twice.xml")).expect("fixture");
    // fulcrum holds a call it forwards and answers it 100 at once (§16.2); the 486 follows.
    let refused = text
        .replace("response=\"503\"", "response=\"486\"")
        .replacen(
            "<recv response=\"486\"/>",
            "<recv response=\"100\" optional=\"true\"/>\n  <recv response=\"486\"/>",
            1,
        );
    assert_ne!(refused, text, "the fixture changed shape");
    let scenario = dir.path("uac_invite_twice_486.xml");
    std::fs::write(&scenario, refused).expect("write scenario");
    let calls = 5;
    let out = run_uac(
        &dir,
        Transport::Udp,
        vserver_addr(&ops),
        &scenario,
        calls,
        10,
        "invite-twice",
    );
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    assert_eq!(
        received_finals(&out.messages),
        vec![486; 2 * calls as usize]
    );
    let r: Vec<u64> = out
        .rtts
        .iter()
        .filter(|(n, _)| n == "r")
        .map(|(_, ms)| *ms)
        .collect();
    assert!(
        r.len() == calls as usize && r.iter().all(|ms| *ms < 250),
        "the retransmission's answer, not Timer G's copy (300 ms after it): {r:?}"
    );
    let counts: Vec<Counts> = uas.iter().map(StrictUas::counts).collect();
    // One INVITE per call reached a service, and fulcrum's ACK of its 486.
    assert_eq!(
        sum(&counts, |c| c.requests),
        2 * u64::from(calls),
        "{counts:?}"
    );
}

/// A `fulcrum run` child process, killed when dropped however the test ends.
struct Fulcrum(std::process::Child);

impl Drop for Fulcrum {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The same as [`a_reload_turning_failover_off_lets_held_invites_finish`] in the `fulcrum
/// run` binary, reloaded by SIGHUP: the held INVITEs finish with one 200 each.
#[test]
fn a_sighup_turning_failover_off_lets_held_invites_finish() {
    if !common::sipp::sipp_available() {
        return;
    }
    let silent = StrictUas::udp("silent");
    silent.set_sick(Sick::Silent);
    let ok = StrictUas::udp("ok");
    let services = [("silent", silent.addr), ("ok", ok.addr)];
    let file = common::ConfigFile::new("sip-tx-sighup", &reload_farm(&services, ""));
    let (child, lines) = common::spawn_fulcrum(&file.path, "2s");
    let fulcrum = Fulcrum(child);
    let listening = common::expect_line(&lines, "listening");
    let vs: SocketAddr = listening
        .split("bound=[")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .and_then(|a| a.split(',').next())
        .and_then(|a| a.trim().parse().ok())
        .unwrap_or_else(|| panic!("no bound address in `{listening}`"));
    let dir = Scratch::new("sighup-off");
    let calls = 10;
    let out = std::thread::scope(|s| {
        let uac = s.spawn(|| {
            run_uac(
                &dir,
                Transport::Udp,
                vs,
                &fixture("uac_rr.xml"),
                calls,
                50,
                "sighup",
            )
        });
        common::wait_for("every INVITE placed", Duration::from_secs(10), || {
            let at_silent = silent.counts().invites;
            (at_silent >= 1 && at_silent + ok.counts().invites >= u64::from(calls)).then_some(())
        });
        file.write(&reload_farm(&services, ", failover: off"));
        let hup = Command::new("kill")
            .args(["-HUP", &fulcrum.0.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(hup.success(), "kill -HUP");
        common::expect_line(&lines, "reloaded");
        uac.join().expect("uac thread")
    });
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
    assert_eq!(
        received_finals(&out.messages),
        vec![200; 2 * calls as usize],
        "one final per request, each a 200"
    );
    let c = ok.counts();
    assert_eq!(
        (c.dialogs, c.byes_ok, c.r481),
        (u64::from(calls), u64::from(calls), 0),
        "{c:?}"
    );
    drop(fulcrum);
}
