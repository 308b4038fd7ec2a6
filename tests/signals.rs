//! The `fulcrum run` binary's signals: SIGHUP reloads (a bad file changes nothing and the
//! process keeps running), SIGTERM drains and exits 0. Synchronised on log lines, with
//! deadlines.

mod common;

use common::{ConfigFile, expect_line, spawn_fulcrum};
use std::process::{Child, Command};
use std::time::Duration;

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .expect("kill runs")
        .success();
    assert!(ok, "kill {sig}");
}

#[test]
fn sighup_reloads_and_sigterm_exits_zero() {
    let good = "admin: { listen: null }\nservices:\n  - { name: s0, address: 127.0.0.1:9, protocol: sip-udp }\nvservers:\n  - { name: v, protocol: sip-udp, bind: [127.0.0.1:0], method: round_robin, workers: 1, services: [s0] }\n";
    let file = ConfigFile::new("signals", good);
    let (mut child, rx) = spawn_fulcrum(&file.path, "2s");
    expect_line(&rx, "listening");

    file.write("services: [");
    signal(&child, "-HUP");
    expect_line(&rx, "reload refused");

    file.write(good);
    signal(&child, "-HUP");
    expect_line(&rx, "reloaded");

    signal(&child, "-TERM");
    expect_line(&rx, "draining");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("fulcrum did not exit after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}");
}
