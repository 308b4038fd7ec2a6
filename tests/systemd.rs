//! `fulcrum run` under a service manager's notify protocol (`sd_notify(3)`): a Unix datagram
//! socket stands in for systemd, named by `NOTIFY_SOCKET`. READY once the vserver and the
//! admin API listen; RELOADING (with MONOTONIC_USEC) then READY around each SIGHUP reload,
//! refused or applied; STOPPING on SIGTERM; WATCHDOG keep-alives at half of `WATCHDOG_USEC`.
//! Without `NOTIFY_SOCKET` nothing is sent. Synchronised on the messages, with deadlines. Also
//! `fulcrum --version`, the other face a package shows.

mod common;

use common::{ConfigFile, expect_line, spawn_fulcrum_env};
use std::os::unix::net::UnixDatagram;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const GOOD: &str = "admin: { listen: 127.0.0.1:0 }\nservices:\n  - { name: s0, address: 127.0.0.1:9, protocol: sip-udp }\nvservers:\n  - { name: v, protocol: sip-udp, bind: [127.0.0.1:0], method: round_robin, workers: 1, services: [s0] }\n";

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .expect("kill runs")
        .success();
    assert!(ok, "kill {sig}");
}

/// The service manager's end: messages as lists of `KEY=VALUE` lines.
struct Manager {
    socket: UnixDatagram,
    /// Keep-alives seen while waiting for other messages.
    watchdogs: usize,
}

impl Manager {
    fn bind(file: &ConfigFile) -> (Manager, String) {
        let path = file.dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let socket = UnixDatagram::bind(&path).expect("bind notify socket");
        let path = path.to_str().expect("utf-8 temp path").to_owned();
        (
            Manager {
                socket,
                watchdogs: 0,
            },
            path,
        )
    }

    /// The next message within `limit`, or `None`.
    fn next_within(&mut self, limit: Duration) -> Option<Vec<String>> {
        self.socket
            .set_read_timeout(Some(limit))
            .expect("read timeout");
        let mut buf = [0u8; 4096];
        let n = self.socket.recv(&mut buf).ok()?;
        let text = String::from_utf8(buf[..n].to_vec()).expect("utf-8 message");
        Some(text.lines().map(str::to_owned).collect())
    }

    /// The next message that is not a watchdog keep-alive (at most 10 s); keep-alives on the
    /// way are counted.
    fn next(&mut self) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let msg = self
                .next_within(left.max(Duration::from_millis(1)))
                .expect("a notify message within 10 s");
            if msg == ["WATCHDOG=1"] {
                self.watchdogs += 1;
                continue;
            }
            return msg;
        }
    }
}

fn has(msg: &[String], line: &str) -> bool {
    msg.iter().any(|l| l == line)
}

/// A reload's two messages: RELOADING with a monotonic time, then READY.
fn expect_reload(manager: &mut Manager) {
    let reloading = manager.next();
    assert!(has(&reloading, "RELOADING=1"), "{reloading:?}");
    let usec = reloading
        .iter()
        .find_map(|l| l.strip_prefix("MONOTONIC_USEC="))
        .unwrap_or_else(|| panic!("no MONOTONIC_USEC in {reloading:?}"));
    assert!(usec.parse::<u64>().is_ok_and(|u| u > 0), "{usec}");
    let ready = manager.next();
    assert!(has(&ready, "READY=1"), "{ready:?}");
}

fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(s) = child.try_wait().expect("wait") {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("fulcrum did not exit after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn ready_reloading_stopping_and_the_watchdog() {
    let file = ConfigFile::new("systemd", GOOD);
    let (mut manager, socket) = Manager::bind(&file);
    let (mut child, log) = spawn_fulcrum_env(
        &file.path,
        "2s",
        &[
            ("NOTIFY_SOCKET", socket.as_str()),
            ("WATCHDOG_USEC", "400000"),
        ],
    );

    let ready = manager.next();
    assert!(has(&ready, "READY=1"), "first message {ready:?}");
    // READY comes after the admin API listens.
    expect_line(&log, "admin API listening");

    // A keep-alive every 200 ms: several within a second.
    let start = Instant::now();
    while manager.watchdogs < 3 && start.elapsed() < Duration::from_secs(5) {
        if let Some(msg) = manager.next_within(Duration::from_secs(1)) {
            assert_eq!(msg, ["WATCHDOG=1"], "only keep-alives while idle");
            manager.watchdogs += 1;
        }
    }
    assert!(manager.watchdogs >= 3, "{} keep-alives", manager.watchdogs);

    // A refused reload changed nothing: RELOADING, then READY again.
    file.write("services: [");
    signal(&child, "-HUP");
    expect_reload(&mut manager);
    expect_line(&log, "reload refused");

    file.write(GOOD);
    signal(&child, "-HUP");
    expect_reload(&mut manager);

    signal(&child, "-TERM");
    let stopping = manager.next();
    assert!(has(&stopping, "STOPPING=1"), "{stopping:?}");
    let status = wait_exit(&mut child);
    assert!(status.success(), "exit status {status}");
    // Nothing after STOPPING but keep-alives during the drain.
    while let Some(msg) = manager.next_within(Duration::from_millis(100)) {
        assert_eq!(msg, ["WATCHDOG=1"], "after STOPPING");
    }
}

#[test]
fn without_a_watchdog_only_state_changes_are_sent() {
    let file = ConfigFile::new("systemd-nowd", GOOD);
    let (mut manager, socket) = Manager::bind(&file);
    let (mut child, _log) =
        spawn_fulcrum_env(&file.path, "0s", &[("NOTIFY_SOCKET", socket.as_str())]);
    let ready = manager.next();
    assert!(has(&ready, "READY=1"), "{ready:?}");
    // No WATCHDOG_USEC: no keep-alive within twice the watchdog period of the other test.
    assert_eq!(manager.next_within(Duration::from_millis(800)), None);
    signal(&child, "-TERM");
    let stopping = manager.next();
    assert!(has(&stopping, "STOPPING=1"), "{stopping:?}");
    assert!(wait_exit(&mut child).success());
    assert_eq!(manager.watchdogs, 0);
}

/// `fulcrum --version` (what packaging/check-deb.sh runs on the packaged binary) prints the
/// package version.
#[test]
fn version_flag_prints_the_package_version() {
    let out = Command::new(env!("CARGO_BIN_EXE_fulcrum"))
        .arg("--version")
        .output()
        .expect("run fulcrum --version");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("fulcrum {}", env!("CARGO_PKG_VERSION"))
    );
}
