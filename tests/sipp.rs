//! End-to-end with real SIPp (Debian `sip-tester`): a SIPp UAC places calls through an
//! in-process fulcrum (`call_id_hash`) to three SIPp UAS. Each UAS logs every message it
//! receives (`-trace_msg`); the logs are parsed per Call-ID to prove affinity and spread.
//!
//! When `sipp` is not on PATH the tests are skipped with a message, unless
//! `FULCRUM_REQUIRE_SIPP=1` (CI), where a missing SIPp is a failure. Every SIPp process runs
//! with a deadline and is terminated when its guard drops, whatever the test outcome.

use fulcrum::balancer::Health;
use fulcrum::config;
use fulcrum::proxy::Runtime;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Hard bound of one SIPp UAC run.
const UAC_DEADLINE: Duration = Duration::from_secs(90);
/// Bound of the wait for a UAS to bind its port.
const UP_DEADLINE: Duration = Duration::from_secs(10);

/// SIP transport of a run: SIPp's `-t` mode and fulcrum's protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Udp,
    Tcp,
}

impl Transport {
    /// SIPp transport mode: one socket (UDP) or one connection (TCP) per instance.
    fn sipp_mode(self) -> &'static str {
        match self {
            Transport::Udp => "u1",
            Transport::Tcp => "t1",
        }
    }

    fn protocol(self) -> &'static str {
        match self {
            Transport::Udp => "sip-udp",
            Transport::Tcp => "sip-tcp",
        }
    }
}

fn sipp_available() -> bool {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("sipp").is_file()))
        .unwrap_or(false);
    if found {
        return true;
    }
    if std::env::var("FULCRUM_REQUIRE_SIPP").as_deref() == Ok("1") {
        panic!(
            "sipp is not on PATH and FULCRUM_REQUIRE_SIPP=1 (install Debian package sip-tester)"
        );
    }
    eprintln!(
        "SKIPPED: sipp is not on PATH (apt-get install sip-tester); set FULCRUM_REQUIRE_SIPP=1 to make this a failure"
    );
    false
}

/// A child process terminated (SIGTERM, then SIGKILL after a grace period) on drop.
struct Proc {
    child: Child,
    name: String,
}

impl Proc {
    fn spawn(name: &str, cmd: &mut Command) -> Proc {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc {
            child,
            name: name.to_owned(),
        }
    }

    /// Wait for exit up to `limit`; kill on timeout. Returns the exit code (None if killed).
    fn wait_for(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => return st.code(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => {
                    eprintln!("{}: deadline passed, killing", self.name);
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return None;
                }
            }
        }
    }

    /// SIGTERM (SIPp flushes its logs and exits), then SIGKILL after a grace period.
    fn terminate(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.wait_for(Duration::from_secs(5));
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.terminate();
    }
}

/// A port free right now on 127.0.0.1 for `t` (bound and released). Ports come from the
/// kernel's ephemeral range, so parallel tests do not collide by construction.
fn free_port(t: Transport) -> u16 {
    match t {
        Transport::Udp => UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()),
        Transport::Tcp => TcpListener::bind("127.0.0.1:0").and_then(|s| s.local_addr()),
    }
    .expect("free port")
    .port()
}

/// Poll until the SIPp process holds `port` (bound it, or listens on it), bounded.
fn wait_bound(t: Transport, port: u16) {
    let deadline = Instant::now() + UP_DEADLINE;
    let free = || match t {
        Transport::Udp => UdpSocket::bind(("127.0.0.1", port)).is_ok(),
        Transport::Tcp => std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
    };
    while free() {
        assert!(Instant::now() < deadline, "SIPp did not bind port {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("fulcrum-sipp-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("scratch dir");
        Scratch(d)
    }
    fn path(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        } else {
            eprintln!("SIPp logs kept in {}", self.0.display());
        }
    }
}

fn start_uas(dir: &Scratch, t: Transport, port: u16, log: &str) -> Proc {
    let p = Proc::spawn(
        &format!("sipp uas :{port}"),
        Command::new("timeout")
            .args([
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
            .current_dir(&dir.0),
    );
    wait_bound(t, port);
    p
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
    let mut uac = Proc::spawn(
        &format!("sipp uac {tag}"),
        Command::new("timeout")
            .args(["-s", "KILL"])
            .arg(UAC_DEADLINE.as_secs().to_string())
            .args(["sipp", "-sn", "uac", "-t", t.sipp_mode()])
            .arg(proxy.to_string())
            .args(["-i", "127.0.0.1", "-p"])
            .arg(free_port(t).to_string())
            .args(["-r", &rate.to_string(), "-m", &calls.to_string()])
            .args(["-nostdin", "-cid_str", "fo-%u@sipp", "-timeout", "60s"])
            .args(["-recv_timeout", "10000", "-trace_stat", "-stf"])
            .arg(&stat)
            .current_dir(&dir.0),
    );
    let code = uac.wait_for(UAC_DEADLINE + Duration::from_secs(5));
    let (ok, failed) = uac_counts(&stat);
    assert_eq!(
        code,
        Some(0),
        "SIPp UAC {tag} exit code (0 = every call successful); successful {ok}, failed {failed}"
    );
    (ok, failed)
}

/// SuccessfulCall(C) and FailedCall(C) from the last line of a SIPp stat file.
fn uac_counts(stat: &Path) -> (u64, u64) {
    let text = std::fs::read_to_string(stat).unwrap_or_default();
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let head: Vec<&str> = lines.next().unwrap_or("").split(';').collect();
    let last: Vec<&str> = lines.next_back().unwrap_or("").split(';').collect();
    let col = |name: &str| {
        head.iter()
            .position(|h| *h == name)
            .and_then(|i| last.get(i))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name} in {}", stat.display()))
    };
    (col("SuccessfulCall(C)"), col("FailedCall(C)"))
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

/// fulcrum in front of `ports` with `call_id_hash`.
fn start_fulcrum(t: Transport, ports: &[u16]) -> (Runtime, SocketAddr) {
    let proto = t.protocol();
    let mut y = String::from("admin: { listen: null }\nservices:\n");
    for (i, p) in ports.iter().enumerate() {
        y.push_str(&format!(
            "  - {{ name: uas{i}, address: 127.0.0.1:{p}, protocol: {proto} }}\n"
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

/// SIP over TCP (issue 8): the same 300 calls through a sip-tcp vserver, SIPp `-t t1`.
#[test]
fn sipp_300_calls_over_tcp_keep_call_id_affinity_and_spread() {
    spread(Transport::Tcp);
}

fn spread(t: Transport) {
    if !sipp_available() {
        return;
    }
    let dir = Scratch::new(&format!("spread-{t:?}"));
    let ports: Vec<u16> = (0..3).map(|_| free_port(t)).collect();
    let mut uas: Vec<Proc> = ports
        .iter()
        .enumerate()
        .map(|(i, &p)| start_uas(&dir, t, p, &format!("uas{i}.msg")))
        .collect();
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
    let ports: Vec<u16> = (0..3).map(|_| free_port(Transport::Udp)).collect();
    let calls = 150;
    let (rt, proxy) = start_fulcrum(Transport::Udp, &ports);

    // Phase 1: all three UAS up.
    let mut uas: Vec<Proc> = ports
        .iter()
        .enumerate()
        .map(|(i, &p)| start_uas(&dir, Transport::Udp, p, &format!("p1-uas{i}.msg")))
        .collect();
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

    // Phase 2: UAS 0 stays stopped and its service is DOWN; the same Call-IDs again.
    drop(uas);
    assert_eq!(rt.set_health("uas0", Health::Down), 1);
    let _uas: Vec<Proc> = ports
        .iter()
        .enumerate()
        .skip(1)
        .map(|(i, &p)| start_uas(&dir, Transport::Udp, p, &format!("p2-uas{i}.msg")))
        .collect();
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
    let port = free_port(Transport::Udp);
    let scenario = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/sipp-uas.xml");
    let _uas = Proc::spawn(
        "sipp readme uas",
        Command::new("timeout")
            .args(["-s", "KILL", "120", "sipp", "-sf"])
            .arg(&scenario)
            .args(["-i", "127.0.0.1", "-p"])
            .arg(port.to_string())
            .arg("-nostdin")
            .current_dir(&dir.0),
    );
    wait_bound(Transport::Udp, port);
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
