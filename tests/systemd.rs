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

/// The watchdog vouches for every worker: one thread of the process frozen (a ptrace stop
/// holds that thread alone) stops the keep-alives, whatever kind of worker it is, and they
/// resume once it runs again. The kinds: a tcp worker's runtime (probed with a task), a udp
/// event loop (wakes at least every 100 ms), a sip-udp receiver frozen between datagrams
/// with datagrams waiting on its socket (found by a peek).
#[test]
fn a_frozen_worker_stops_the_keep_alives() {
    use nix::sys::ptrace;
    use nix::sys::wait::{WaitPidFlag, waitpid};
    use nix::unistd::Pid;

    let yaml = "admin: { listen: null }\nservices:\n  - { name: s0, address: 127.0.0.1:9, protocol: sip-udp }\n  - { name: u0, address: 127.0.0.1:9, protocol: udp }\n  - { name: t0, address: 127.0.0.1:9, protocol: tcp }\nvservers:\n  - { name: sip, protocol: sip-udp, bind: [127.0.0.1:0], method: call_id_hash, workers: 2, services: [s0] }\n  - { name: gen, protocol: udp, bind: [127.0.0.1:0], method: round_robin, workers: 1, services: [u0] }\n  - { name: tcp, protocol: tcp, bind: [127.0.0.1:0], method: round_robin, workers: 1, services: [t0] }\n";
    let file = ConfigFile::new("watchdog-freeze", yaml);
    let (mut manager, socket) = Manager::bind(&file);
    let (child, log) = spawn_fulcrum_env(
        &file.path,
        "0s",
        &[
            ("NOTIFY_SOCKET", socket.as_str()),
            ("WATCHDOG_USEC", "400000"),
        ],
    );
    let mut lines = Vec::new();
    let listening = common::expect_line_keeping(&log, "vserver=sip bound=", &mut lines);
    let sip: std::net::SocketAddr = listening
        .split("bound=[")
        .nth(1)
        .and_then(|r| r.split(']').next())
        .and_then(|l| l.split(", ").next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {listening:?}"));
    // Killed however the test ends (a failed assertion included).
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let child = Killed(child);
    let ready = manager.next();
    assert!(has(&ready, "READY=1"), "first message {ready:?}");

    let pid = child.0.id();
    let thread = |name: &str| -> Pid {
        let dir = format!("/proc/{pid}/task");
        for t in std::fs::read_dir(&dir).expect("task dir").flatten() {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            if comm.trim_end() == name {
                let tid: i32 = t
                    .file_name()
                    .to_str()
                    .and_then(|s| s.parse().ok())
                    .expect("tid");
                return Pid::from_raw(tid);
            }
        }
        panic!("no thread {name} in {dir}");
    };
    // Keep-alives arrive every 200 ms: `n` of them within 2 s.
    let flowing = |manager: &mut Manager, n: usize| {
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut seen = 0;
        while seen < n && Instant::now() < deadline {
            if manager.next_within(Duration::from_millis(300)) == Some(vec!["WATCHDOG=1".into()]) {
                seen += 1;
            }
        }
        seen >= n
    };
    // Keep-alives stop: a silence of a second begins within 2 s.
    let stopped = |manager: &mut Manager| {
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if manager.next_within(Duration::from_secs(1)).is_none() {
                return true;
            }
        }
        false
    };
    // (thread, the name the log gives it, what it is)
    for (name, logged, what) in [
        ("fulcrum-tcp", "tcp-0 runtime", "a tcp worker runtime"),
        ("gen-0", "gen-0", "a udp event loop"),
        (
            "sip-0",
            "sip-0",
            "a sip-udp receiver with datagrams waiting",
        ),
    ] {
        assert!(
            flowing(&mut manager, 3),
            "keep-alives before freezing {what}"
        );
        let tid = thread(name);
        ptrace::seize(tid, ptrace::Options::empty()).expect("ptrace seize");
        ptrace::interrupt(tid).expect("ptrace interrupt");
        waitpid(tid, Some(WaitPidFlag::__WALL)).expect("the thread stops");
        if name == "sip-0" {
            // From many source ports, so the kernel's reuseport hash gives some to the frozen
            // worker's socket (the other worker takes its share).
            for _ in 0..64 {
                let c = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
                c.send_to(b"OPTIONS sip:x SIP/2.0\r\n\r\n", sip)
                    .expect("send");
            }
        }
        let quiet = stopped(&mut manager);
        ptrace::detach(tid, None).expect("ptrace detach");
        assert!(quiet, "keep-alives went on with {what} frozen");
        let said = common::expect_line_keeping(&log, "keep-alives withheld", &mut lines);
        assert!(said.contains(logged), "the log names {logged}: {said}");
        assert!(
            flowing(&mut manager, 3),
            "keep-alives after {what} ran again"
        );
        common::expect_line_keeping(&log, "keep-alives resume", &mut lines);
        lines.clear();
    }
    drop(child);
}
