//! The admin dashboard (`GET /`) in a real browser: Debian's chromium, driven headless by
//! playwright-core (tests/dashboard/drive.mjs, installed by `npm ci --prefix tests/dashboard`).
//! The proxy runs here with three SIP services and a backup service behind a token and manual
//! slow start, under a little traffic; the script logs in, checks the backup is marked,
//! disables and re-enables a service, raises the slow-start rate and saves a screenshot
//! (target/dashboard.png; with FULCRUM_BLESS=1, README's docs/dashboard.png).
//!
//! Without chromium, node or playwright-core the test says why and passes, unless
//! `FULCRUM_REQUIRE_BROWSER=1` (CI, which installs them) makes that a failure.

mod common;

use fulcrum::admin::router::{self, Request};
use fulcrum::config;
use fulcrum::ops::Ops;
use fulcrum::peer::{Uac, Uas};
use serde_json::Value;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const TOKEN: &str = "dash-s3cret";

fn any() -> SocketAddr {
    "127.0.0.1:0".parse().expect("addr")
}

fn yaml(ports: &[u16]) -> String {
    let mut y = format!(
        "admin: {{ listen: null, token: {TOKEN} }}\nmonitors:\n  - {{ name: ping, type: sip-options, interval: 300ms, timeout: 200ms, failures_to_down: 2, successes_to_up: 2 }}\nservices:\n"
    );
    for (i, p) in ports.iter().enumerate() {
        y.push_str(&format!(
            "  - {{ name: s{i}, address: 127.0.0.1:{p}, protocol: sip-udp, monitor: ping, weight: {} }}\n",
            [100, 100, 50][i % 3]
        ));
    }
    // A backup service (no monitor, never given a flow while the others are UP).
    y.push_str("  - { name: s3, address: 127.0.0.1:9, protocol: sip-udp, backup: true }\n");
    y.push_str(
        "vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [127.0.0.1:0]\n    method: round_robin\n    slow_start: { new_service_request_rate: 2, unit: per_second, increment_interval: 0s }\n    workers: 1\n    services: [s0, s1, s2, s3]\n",
    );
    y
}

/// Calls through the proxy until `stop`: a few left open (active flows), the rest complete,
/// so that the page has rates and sparklines to show.
fn traffic(proxy: SocketAddr, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut open = Uac::new(any(), proxy, "open").expect("uac");
        for i in 0..4 {
            let id = format!("open-{i}");
            let inv = open.request("INVITE", &id, 1, &format!("{id}i"), None);
            open.send_raw(inv.as_bytes()).expect("send");
            if let Ok((200, to, _)) = open.final_response(Duration::from_secs(2)) {
                let tag = to.split(";tag=").nth(1).unwrap_or("").to_owned();
                let ack = open.request("ACK", &id, 1, &format!("{id}a"), Some(&tag));
                open.send_raw(ack.as_bytes()).expect("send");
            }
        }
        let mut uac = Uac::new(any(), proxy, "load").expect("uac");
        while !stop.load(Ordering::Relaxed) {
            let _ = uac.call(Duration::from_secs(1));
            // A load generator's pace (about 20 calls a second), not a synchronisation.
            std::thread::sleep(Duration::from_millis(50));
        }
    })
}

#[test]
fn dashboard_in_headless_chromium() {
    let Some((chromium, dir)) = common::browser(&["playwright-core"], "the dashboard browser test")
    else {
        return;
    };
    let uas: Vec<Uas> = (0..3).map(|_| Uas::start(any()).expect("uas")).collect();
    let ports: Vec<u16> = uas.iter().map(|u| u.addr.port()).collect();
    let cfg = config::from_str("dashboard.yaml", &yaml(&ports)).expect("valid");
    let ops = Ops::start(cfg, None).expect("start");
    let (admin, _server) = ops
        .tokio()
        .block_on(fulcrum::admin::serve(Arc::clone(&ops), any()))
        .expect("admin listener");
    let proxy = ops.with_vservers(|vs, _| vs[0].bound[0]).expect("running");
    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(proxy, Arc::clone(&stop));

    // The screenshot goes to target/ on every run (a test run leaves the tree as it was);
    // `FULCRUM_BLESS=1` writes README's docs/dashboard.png instead.
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let shot = if std::env::var_os("FULCRUM_BLESS").is_some() {
        root.join("docs/dashboard.png")
    } else {
        root.join("target/dashboard.png")
    };
    let out = Command::new("node")
        .arg(dir.join("drive.mjs"))
        .env("FULCRUM_ADMIN", format!("http://{admin}"))
        .env("FULCRUM_TOKEN", TOKEN)
        .env("FULCRUM_CHROMIUM", &chromium)
        .env("FULCRUM_SCREENSHOT", &shot)
        .output()
        .expect("run node");
    stop.store(true, Ordering::Relaxed);
    load.join().expect("traffic thread");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    assert!(
        out.status.success(),
        "the browser script failed:\n{stdout}\n{stderr}"
    );

    // What the page did is what the proxy holds.
    let r = router::handle(&ops, &Request::new("GET", "/status").bearer(TOKEN));
    let status: Value = serde_json::from_str(&r.body).expect("JSON");
    let v = &status["vservers"][0];
    assert_eq!(v["slow_start"]["new_service_request_rate"], 20, "{v}");
    let s1 = v["services"]
        .as_array()
        .and_then(|s| s.iter().find(|x| x["name"] == "s1"))
        .expect("s1");
    assert_eq!(s1["state"], "UP", "{s1}");
    let png = std::fs::read(&shot).expect("screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    ops.shutdown();
}
