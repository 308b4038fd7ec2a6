//! End to end over TCP with real SIPp (Debian `sip-tester`): a SIPp UAC places calls
//! through a sip-tcp vserver to three SIPp UAS (`-t t1`). Zero failed calls, every message
//! of a call on one UAS, each UAS 20-47% of the calls.
//!
//! Without `sipp` on the PATH the test prints why and returns, unless
//! `FULCRUM_REQUIRE_SIPP=1` (set by `.ci/run`), which makes its absence a failure.

use fulcrum::config;
use fulcrum::proxy::Runtime;
use std::collections::{HashMap, HashSet};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CALLS: u32 = 300;

fn sipp_available() -> bool {
    let found = Command::new("sipp")
        .arg("-v")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !found {
        assert!(
            std::env::var("FULCRUM_REQUIRE_SIPP").as_deref() != Ok("1"),
            "sipp is required (FULCRUM_REQUIRE_SIPP=1) but not on PATH: apt-get install -y sip-tester"
        );
        eprintln!("SKIP: sipp not on PATH (apt-get install -y sip-tester)");
    }
    found
}

/// A child process killed when dropped, so a failing test leaves nothing running.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_tcp_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fulcrum-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Call-ID → methods, from a SIPp `-trace_msg` log.
fn calls_in_log(dir: &Path) -> HashMap<String, Vec<String>> {
    let mut calls: HashMap<String, Vec<String>> = HashMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return calls;
    };
    for e in entries.flatten() {
        if !e.file_name().to_string_lossy().ends_with("_messages.log") {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        // Each received message starts with a request line; pair it with its Call-ID.
        let mut method: Option<String> = None;
        for line in text.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if line.ends_with("SIP/2.0") && first.chars().all(|c| c.is_ascii_uppercase()) {
                method = Some(first.to_owned());
            } else if let Some(cid) = line
                .strip_prefix("Call-ID:")
                .or_else(|| line.strip_prefix("i:"))
                && let Some(m) = method.take()
            {
                calls.entry(cid.trim().to_owned()).or_default().push(m);
            }
        }
    }
    calls
}

#[test]
fn sipp_calls_over_tcp_balance_by_call_id_with_zero_failures() {
    if !sipp_available() {
        return;
    }
    let dirs: Vec<PathBuf> = (0..3)
        .map(|i| scratch_dir(&format!("tcp-uas{i}")))
        .collect();
    let ports: Vec<u16> = (0..3).map(|_| free_tcp_port()).collect();
    let _uas: Vec<Proc> = ports
        .iter()
        .zip(&dirs)
        .map(|(p, d)| {
            Proc(
                Command::new("timeout")
                    .args([
                        "120",
                        "sipp",
                        "-sn",
                        "uas",
                        "-t",
                        "t1",
                        "-i",
                        "127.0.0.1",
                        "-p",
                    ])
                    .arg(p.to_string())
                    .args(["-nostdin", "-trace_msg"])
                    .current_dir(d)
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start sipp uas"),
            )
        })
        .collect();
    // Wait until every UAS listens (bounded).
    let deadline = Instant::now() + Duration::from_secs(10);
    for p in &ports {
        while std::net::TcpStream::connect(("127.0.0.1", *p)).is_err() {
            assert!(Instant::now() < deadline, "sipp uas on {p} did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let yaml = format!(
        "admin: {{ listen: null }}\nservices:\n{}vservers:\n  - {{ name: v, protocol: sip-tcp, bind: 127.0.0.1:0, method: call_id_hash, services: [s0, s1, s2] }}\n",
        ports
            .iter()
            .enumerate()
            .map(|(i, p)| format!(
                "  - {{ name: s{i}, address: 127.0.0.1:{p}, protocol: sip-tcp }}\n"
            ))
            .collect::<String>()
    );
    let cfg = config::from_str("sipp-tcp.yaml", &yaml).expect("config");
    let rt = Runtime::start(&cfg).expect("start fulcrum");
    let proxy = rt.vserver("v").expect("vserver").bound[0];
    let uac_dir = scratch_dir("tcp-uac");
    let status = Command::new("timeout")
        .args(["120", "sipp", "-sn", "uac", "-t", "t1"])
        .arg(proxy.to_string())
        .args(["-i", "127.0.0.1", "-p"])
        .arg(free_tcp_port().to_string())
        .args(["-r", "150", "-m"])
        .arg(CALLS.to_string())
        .args(["-nostdin", "-timeout", "60", "-timeout_error"])
        .current_dir(&uac_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run sipp uac");
    // SIPp exits 0 only when every call succeeded.
    assert_eq!(status.code(), Some(0), "sipp uac reported failed calls");

    // Every message of a call reached one UAS; each UAS took a fair share.
    let deadline = Instant::now() + Duration::from_secs(10);
    let per_uas = loop {
        let per_uas: Vec<HashMap<String, Vec<String>>> =
            dirs.iter().map(|d| calls_in_log(d)).collect();
        let byes: usize = per_uas
            .iter()
            .map(|c| c.values().filter(|m| m.iter().any(|x| x == "BYE")).count())
            .sum();
        if byes >= CALLS as usize || Instant::now() > deadline {
            break per_uas;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut owner: HashMap<&str, HashSet<usize>> = HashMap::new();
    for (i, calls) in per_uas.iter().enumerate() {
        for (cid, methods) in calls {
            owner.entry(cid).or_default().insert(i);
            for m in ["INVITE", "ACK", "BYE"] {
                assert!(
                    methods.iter().any(|x| x == m),
                    "call {cid} on uas {i} lacks {m}: {methods:?}"
                );
            }
        }
    }
    assert_eq!(owner.len(), CALLS as usize);
    assert!(
        owner.values().all(|s| s.len() == 1),
        "a call was split across services"
    );
    for (i, calls) in per_uas.iter().enumerate() {
        let share = calls.len() as f64 / f64::from(CALLS);
        assert!(
            (0.20..=0.47).contains(&share),
            "uas {i} got {share:.2} of the calls"
        );
    }
    rt.shutdown();
}
