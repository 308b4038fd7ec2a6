//! End-to-end with real SIPp (Debian `sip-tester`): a SIPp UAC places calls through an
//! in-process fulcrum (`call_id_hash`) to three SIPp UAS. Each UAS logs every message it
//! receives (`-trace_msg`); the logs are parsed per Call-ID to prove affinity and spread.
//!
//! When `sipp` is not on PATH the tests are skipped with a message, unless
//! `FULCRUM_REQUIRE_SIPP=1` (CI), where a missing SIPp is a failure. Every SIPp process runs
//! with a deadline and is terminated when its guard drops, whatever the test outcome.

mod common;

use common::sipp::{Proc, Scratch, Transport, sipp_available, spawn_listening, uac_counts};
use fulcrum::balancer::Health;
use fulcrum::config;
use fulcrum::proxy::Runtime;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Hard bound of one SIPp UAC run.
const UAC_DEADLINE: Duration = Duration::from_secs(90);

/// A SIPp UAS on a port of its own (see [`spawn_listening`]), logging what it receives.
fn start_uas(dir: &Scratch, t: Transport, log: &str) -> (Proc, u16) {
    spawn_listening("sipp uas", t, |port| {
        let mut cmd = Command::new("timeout");
        cmd.args([
            "-s",
            "KILL",
            "300",
            "sipp",
            "-sn",
            "uas",
            "-t",
            t.sipp_mode(),
            "-i",
            "127.0.0.1",
            "-p",
        ])
        .arg(port.to_string())
        .args(["-nostdin", "-trace_msg", "-message_file"])
        .arg(dir.path(log))
        .current_dir(&dir.0);
        cmd
    })
}

/// Run a SIPp UAC to completion: `calls` calls at `rate` per second with Call-IDs
/// `fo-<n>@sipp` (the same set every run). Returns (successful, failed) from its stat file.
fn run_uac(
    dir: &Scratch,
    t: Transport,
    proxy: SocketAddr,
    calls: u32,
    rate: u32,
    tag: &str,
) -> (u64, u64) {
    let stat = dir.path(&format!("uac-{tag}.csv"));
    // A port of its own, held before the run counts: SIPp's own search from 5060 races
    // another SIPp starting over TCP at the same moment (both bind, the second's listen fails).
    let (mut uac, _port) = spawn_listening(&format!("sipp uac {tag}"), t, |port| {
        let mut cmd = Command::new("timeout");
        cmd.args(["-s", "KILL"])
            .arg(UAC_DEADLINE.as_secs().to_string())
            .args(["sipp", "-sn", "uac", "-t", t.sipp_mode()])
            .arg(proxy.to_string())
            .args(["-i", "127.0.0.1", "-p", &port.to_string()])
            .args(["-r", &rate.to_string(), "-m", &calls.to_string()])
            .args(["-nostdin", "-cid_str", "fo-%u@sipp", "-timeout", "60s"])
            .args(["-recv_timeout", "10000", "-trace_stat", "-stf"])
            .arg(&stat)
            .current_dir(&dir.0);
        cmd
    });
    let code = uac.wait_for(UAC_DEADLINE + Duration::from_secs(5));
    let (ok, failed) = uac_counts(&stat);
    assert_eq!(
        code,
        Some(0),
        "SIPp UAC {tag} exit code (0 = every call successful); successful {ok}, failed {failed}"
    );
    (ok, failed)
}

/// Call-ID → methods of the requests a UAS received, in order, from its `-trace_msg` log.
fn received_requests(log: &Path) -> BTreeMap<String, Vec<String>> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut calls: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for block in text.split("\n----------------------------------------------- ") {
        let Some((head, rest)) = block.split_once('\n') else {
            continue;
        };
        let _ = head;
        let mut lines = rest.lines().map(str::trim);
        let Some(kind) = lines.next() else { continue };
        if !kind.contains("message received") {
            continue;
        }
        let mut lines = lines.skip_while(|l| l.is_empty());
        let Some(start) = lines.next() else { continue };
        if start.starts_with("SIP/2.0") {
            continue;
        }
        let method = start.split(' ').next().unwrap_or("").to_owned();
        let call_id = lines.take_while(|l| !l.is_empty()).find_map(|l| {
            let (n, v) = l.split_once(':')?;
            let n = n.trim();
            (n.eq_ignore_ascii_case("Call-ID") || n.eq_ignore_ascii_case("i"))
                .then(|| v.trim().to_owned())
        });
        if let Some(cid) = call_id {
            calls.entry(cid).or_default().push(method);
        }
    }
    calls
}

/// fulcrum in front of `ports` with `call_id_hash`. Each service hashes by a fixed `hash_id`
/// (`uas<i>`), not by its port, so a Call-ID ranks the services the same whichever ports the
/// UAS hold, in every instance (docs/methods.md, Determinism).
fn start_fulcrum(t: Transport, ports: &[u16]) -> (Runtime, SocketAddr) {
    let proto = t.protocol();
    let mut y = String::from("admin: { listen: null }\nservices:\n");
    for (i, p) in ports.iter().enumerate() {
        y.push_str(&format!(
            "  - {{ name: uas{i}, address: 127.0.0.1:{p}, protocol: {proto}, hash_id: uas{i} }}\n"
        ));
    }
    let names: Vec<String> = (0..ports.len()).map(|i| format!("uas{i}")).collect();
    y.push_str(&format!(
        "vservers:\n  - name: sipp\n    protocol: {proto}\n    bind: [127.0.0.1:0]\n    method: call_id_hash\n    workers: 2\n    services: [{}]\n",
        names.join(", ")
    ));
    let cfg = config::from_str("sipp.yaml", &y).expect("config");
    let rt = Runtime::start(&cfg).expect("fulcrum runtime");
    let addr = rt.vserver("sipp").expect("vserver").bound[0];
    (rt, addr)
}

/// Per UAS: Call-ID → methods. Checks every call is whole (INVITE, ACK, BYE) on exactly one
/// UAS and returns Call-ID → UAS index.
fn affinity(logs: &[BTreeMap<String, Vec<String>>], calls: u32) -> BTreeMap<String, usize> {
    let mut home: BTreeMap<String, usize> = BTreeMap::new();
    for (i, log) in logs.iter().enumerate() {
        for (cid, methods) in log {
            if let Some(other) = home.insert(cid.clone(), i) {
                panic!("Call-ID {cid} reached UAS {other} and UAS {i}");
            }
            let set: BTreeSet<&str> = methods.iter().map(String::as_str).collect();
            assert_eq!(
                set,
                BTreeSet::from(["ACK", "BYE", "INVITE"]),
                "{cid} on UAS {i}: {methods:?}"
            );
            assert_eq!(
                methods.first().map(String::as_str),
                Some("INVITE"),
                "{cid}: {methods:?}"
            );
        }
    }
    assert_eq!(home.len(), calls as usize, "calls seen by the UAS");
    home
}

#[test]
fn sipp_300_calls_through_fulcrum_keep_call_id_affinity_and_spread() {
    spread(Transport::Udp);
}

/// SIP over TCP (docs/sip.md): the same 300 calls through a sip-tcp vserver, SIPp `-t t1`.
#[test]
fn sipp_300_calls_over_tcp_keep_call_id_affinity_and_spread() {
    spread(Transport::Tcp);
}

fn spread(t: Transport) {
    if !sipp_available() {
        return;
    }
    let dir = Scratch::new(&format!("spread-{t:?}"));
    let (mut uas, ports): (Vec<Proc>, Vec<u16>) = (0..3)
        .map(|i| start_uas(&dir, t, &format!("uas{i}.msg")))
        .unzip();
    let (rt, proxy) = start_fulcrum(t, &ports);
    let calls = 300;
    let (ok, failed) = run_uac(&dir, t, proxy, calls, 150, "spread");
    assert_eq!((ok, failed), (u64::from(calls), 0));
    for u in &mut uas {
        u.terminate(); // flushes the message logs
    }
    let logs: Vec<_> = (0..3)
        .map(|i| received_requests(&dir.path(&format!("uas{i}.msg"))))
        .collect();
    let home = affinity(&logs, calls);
    for (i, log) in logs.iter().enumerate() {
        let share = log.len() as f64 / f64::from(calls);
        assert!(
            (0.20..=0.47).contains(&share),
            "UAS {i} got {} of {calls} calls ({:.1}%)",
            log.len(),
            share * 100.0
        );
    }
    eprintln!(
        "per-UAS calls: {:?}",
        logs.iter().map(BTreeMap::len).collect::<Vec<_>>()
    );
    assert_eq!(home.len(), calls as usize);
    rt.shutdown();
}

#[test]
fn sipp_failover_new_calls_complete_and_others_do_not_move() {
    if !sipp_available() {
        return;
    }
    let dir = Scratch::new("failover");
    let calls = 150;

    // Phase 1: all three UAS up.
    let (mut uas, ports): (Vec<Proc>, Vec<u16>) = (0..3)
        .map(|i| start_uas(&dir, Transport::Udp, &format!("p1-uas{i}.msg")))
        .unzip();
    let (rt, proxy) = start_fulcrum(Transport::Udp, &ports);
    assert_eq!(
        run_uac(&dir, Transport::Udp, proxy, calls, 150, "p1"),
        (u64::from(calls), 0)
    );
    for u in &mut uas {
        u.terminate();
    }
    let before = affinity(
        &(0..3)
            .map(|i| received_requests(&dir.path(&format!("p1-uas{i}.msg"))))
            .collect::<Vec<_>>(),
        calls,
    );
    assert!(
        before.values().any(|&u| u == 0),
        "UAS 0 had no calls: test proves nothing"
    );

    // Phase 2: UAS 0 stays stopped and its service is DOWN; the same Call-IDs again. UAS 1
    // and 2 start afresh on ports of their own (taking back the ports phase 1 released could
    // race with any other process), behind a second fulcrum: with the same `hash_id`s it
    // ranks every Call-ID as the first one did.
    drop(uas);
    rt.shutdown();
    let (_uas, mut ports): (Vec<Proc>, Vec<u16>) = (1..3)
        .map(|i| start_uas(&dir, Transport::Udp, &format!("p2-uas{i}.msg")))
        .unzip();
    // UAS 0's address is never used: its service is DOWN.
    ports.insert(0, ports[0]);
    let (rt, proxy) = start_fulcrum(Transport::Udp, &ports);
    assert_eq!(rt.set_health("uas0", Health::Down), 1);
    assert_eq!(
        run_uac(&dir, Transport::Udp, proxy, calls, 150, "p2"),
        (u64::from(calls), 0)
    );
    drop(_uas);
    let mut logs = vec![BTreeMap::new()];
    logs.extend((1..3).map(|i| received_requests(&dir.path(&format!("p2-uas{i}.msg")))));
    let after = affinity(&logs, calls);
    let mut moved_from_0 = 0;
    for (cid, &was) in &before {
        let now = after[cid];
        if was == 0 {
            assert_ne!(now, 0);
            moved_from_0 += 1;
        } else {
            assert_eq!(now, was, "{cid} moved from UAS {was} to UAS {now}");
        }
    }
    eprintln!("{moved_from_0} calls of the stopped UAS went to the others; no other call moved");
    rt.shutdown();
}

/// README's hand-run service, `sipp -sf config/sipp-uas.xml`, answers the `sip-options`
/// monitor of config/fulcrum.yaml (SIPp's built-in `-sn uas` does not, and the monitor would
/// mark it DOWN) and still takes calls through fulcrum.
#[test]
fn the_readme_uas_scenario_answers_options_and_calls() {
    if !sipp_available() {
        return;
    }
    let dir = Scratch::new("readme-uas");
    let scenario = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/sipp-uas.xml");
    let (_uas, port) = spawn_listening("sipp readme uas", Transport::Udp, |port| {
        let mut cmd = Command::new("timeout");
        cmd.args(["-s", "KILL", "120", "sipp", "-sf"])
            .arg(&scenario)
            .args(["-i", "127.0.0.1", "-p"])
            .arg(port.to_string())
            .arg("-nostdin")
            .current_dir(&dir.0);
        cmd
    });
    let target = SocketAddr::from(([127, 0, 0, 1], port));
    let rt = tokio::runtime::Runtime::new().expect("tokio");
    for _ in 0..3 {
        let reply = rt
            .block_on(fulcrum::health::probe::probe(
                &config::MonitorKind::SipOptions {
                    expect_codes: Vec::new(),
                },
                target,
                config::Protocol::SipUdp,
                Duration::from_secs(2),
            ))
            .expect("OPTIONS answered");
        assert_eq!(reply.status, Some(200));
    }
    let (_fulcrum, proxy) = start_fulcrum(Transport::Udp, &[port]);
    let (ok, failed) = run_uac(&dir, Transport::Udp, proxy, 20, 20, "readme");
    assert_eq!((ok, failed), (20, 0));
}

/// A port another process took before SIPp could bind it: SIPp exits, and `spawn_listening`
/// starts it again on another port instead of mistaking the other holder for SIPp.
#[test]
fn sipp_on_a_taken_port_is_started_again_on_another() {
    if !sipp_available() {
        return;
    }
    let dir = Scratch::new("taken-port");
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let taken_port = taken.local_addr().expect("addr").port();
    let starts = std::cell::Cell::new(0u32);
    let (_uas, port) = spawn_listening("sipp uas", Transport::Udp, |candidate| {
        starts.set(starts.get() + 1);
        // The first start is given the taken port, as if it had been taken in the meantime.
        let port = if starts.get() == 1 {
            taken_port
        } else {
            candidate
        };
        let mut cmd = Command::new("timeout");
        cmd.args([
            "-s",
            "KILL",
            "60",
            "sipp",
            "-sn",
            "uas",
            "-i",
            "127.0.0.1",
            "-p",
        ])
        .arg(port.to_string())
        .arg("-nostdin")
        .current_dir(&dir.0);
        cmd
    });
    assert_eq!(starts.get(), 2, "SIPp started again once");
    assert_ne!(port, taken_port);
}
