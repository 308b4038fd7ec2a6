//! The `icmp` monitor (RFC 792 echo, RFC 4443 §4 echo): a probe of 127.0.0.1 and ::1 is
//! answered, a probe of an address on a link where no host answers, inside a namespace the test
//! creates is not; both the unprivileged ping socket (the namespace's
//! `net.ipv4.ping_group_range` holding the test's group) and the raw socket (the range
//! empty, as root) are exercised. Through a running fulcrum, an `icmp` monitor keeps a
//! service whose host answers UP and takes one whose host is silent DOWN after
//! `failures_to_down` probes. Never probes an address outside loopback and the namespaces.

mod common;

use common::netns::ROLE;
use common::wait_for;
use fulcrum::admin::router;
use fulcrum::config::{MonitorKind, Protocol};
use fulcrum::health::probe::{ProbeError, probe};
use fulcrum::ops::Ops;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// An address of the silent link's network that no host holds: echoes to it vanish.
const SILENT_V4: &str = "10.99.0.7:0";
const SILENT_V6: &str = "[fd99::7]:0";

/// The namespace: a veth pair whose one end carries 10.99.0.0/24 and fd99::/64 and whose
/// other end holds no address (so nothing there answers ARP, neighbour solicitation or
/// echo), and the ping socket range as `range`.
fn setup(range: &'static str) -> Vec<String> {
    vec![
        "link add name fcsil0 type veth peer name fcsil1".into(),
        "link set fcsil0 up".into(),
        "link set fcsil1 up".into(),
        "addr add 10.99.0.1/24 dev fcsil0".into(),
        "-6 addr add fd99::1/64 dev fcsil0 nodad".into(),
        format!("sysctl net.ipv4.ping_group_range {range}"),
    ]
}

async fn one(addr: &str, timeout: Duration) -> Result<u64, ProbeError> {
    let a: SocketAddr = addr.parse().expect("addr");
    probe(&MonitorKind::Icmp, a, Protocol::Ip, timeout)
        .await
        .map(|r| r.rtt_us)
}

/// Inside a namespace: loopback answers on both families, the silent addresses time out,
/// and a run of probes all find their own replies (none taken for another's).
#[test]
fn helper_icmp_probes() {
    if std::env::var(ROLE).as_deref() != Ok("icmp") {
        return;
    }
    let rt = tokio::runtime::Runtime::new().expect("tokio");
    rt.block_on(async {
        for up in ["127.0.0.1:0", "[::1]:0"] {
            let rtt = one(up, Duration::from_secs(1)).await;
            assert!(rtt.is_ok(), "{up}: {rtt:?}");
        }
        for silent in [SILENT_V4, SILENT_V6] {
            let start = Instant::now();
            let r = one(silent, Duration::from_millis(300)).await;
            assert!(matches!(r, Err(ProbeError::Timeout)), "{silent}: {r:?}");
            assert!(start.elapsed() < Duration::from_secs(2), "{silent}");
        }
        // Fifty concurrent probes of both loopbacks: each matches its own reply.
        let probes: Vec<_> = (0..50)
            .map(|i| {
                let a = if i % 2 == 0 { "127.0.0.1:0" } else { "[::1]:0" };
                tokio::spawn(one(a, Duration::from_secs(2)))
            })
            .collect();
        for p in probes {
            let r = p.await.expect("join");
            assert!(r.is_ok(), "{r:?}");
        }
    });
    println!("RESULT ok");
}

/// Unprivileged ping sockets: the namespace lets group 0 (the test's) open them.
#[test]
fn icmp_probes_over_ping_sockets() {
    let s = setup("0 0");
    let steps: Vec<&str> = s.iter().map(String::as_str).collect();
    if let Some(out) =
        common::netns::run_helper("fc-icmp-dgram", &steps, "helper_icmp_probes", "icmp")
    {
        println!("{out}");
    }
}

/// Raw sockets: the range is empty, so the probe falls back to the raw socket root may open.
#[test]
fn icmp_probes_over_raw_sockets() {
    let s = setup("1 0");
    let steps: Vec<&str> = s.iter().map(String::as_str).collect();
    if let Some(out) =
        common::netns::run_helper("fc-icmp-raw", &steps, "helper_icmp_probes", "icmp")
    {
        println!("{out}");
    }
}

/// Inside a namespace: a running fulcrum whose `icmp` monitor watches services on both
/// loopbacks and one at 10.99.0.7, first a local address (answered), then removed (silent),
/// then back: that service goes DOWN only after `failures_to_down` failed probes once
/// confirmed, and UP again; the loopback ones stay UP without a failure.
#[test]
fn helper_icmp_monitor() {
    if std::env::var(ROLE).as_deref() != Ok("icmp-monitor") {
        return;
    }
    common::netns::ip(&["addr", "add", "10.99.0.7/32", "dev", "lo"]).expect("add");
    let yaml = "admin: { listen: null }
monitors:
  - { name: ping, type: icmp, interval: 100ms, timeout: 80ms, failures_to_down: 3, successes_to_up: 2 }
services:
  - { name: here, address: 127.0.0.1:7, protocol: udp, monitor: ping }
  - { name: flaky, address: 10.99.0.7:7, protocol: udp, monitor: ping }
  - { name: here6, address: \"[::1]:7\", protocol: udp, monitor: ping }
vservers:
  - { name: v, protocol: udp, bind: 127.0.0.1:0, method: round_robin, services: [here, flaky, here6] }
";
    let ops = Ops::start(
        fulcrum::config::from_str("t.yaml", yaml).expect("valid"),
        None,
    )
    .expect("start");
    let monitor = |name: &str| {
        let st = router::status(&ops);
        st["vservers"][0]["services"]
            .as_array()
            .and_then(|s| s.iter().find(|x| x["name"] == name))
            .map(|s| s["monitor"].clone())
            .unwrap_or_else(|| panic!("{name} not in {st}"))
    };
    let count = |name: &str, field: &str| monitor(name)[field].as_u64().unwrap_or(0);
    wait_for("flaky confirmed", Duration::from_secs(5), || {
        (count("flaky", "probes_ok") >= 2).then_some(())
    });
    assert_eq!(monitor("flaky")["state"], "UP");
    common::netns::ip(&["addr", "del", "10.99.0.7/32", "dev", "lo"]).expect("del");
    let failed_before = count("flaky", "probes_failed");
    wait_for("flaky DOWN", Duration::from_secs(5), || {
        (monitor("flaky")["state"] == "DOWN").then_some(())
    });
    let failed = count("flaky", "probes_failed") - failed_before;
    assert!(
        (3..=4).contains(&failed),
        "DOWN after {failed} failed probes"
    );
    common::netns::ip(&["addr", "add", "10.99.0.7/32", "dev", "lo"]).expect("add again");
    wait_for("flaky UP again", Duration::from_secs(5), || {
        (monitor("flaky")["state"] == "UP").then_some(())
    });
    for name in ["here", "here6"] {
        let m = monitor(name);
        assert_eq!(m["state"], "UP", "{name}: {m}");
        assert_eq!(m["probes_failed"], 0, "{name}: {m}");
        assert!(m["probes_ok"].as_u64().unwrap_or(0) >= 5, "{name}: {m}");
    }
    println!("RESULT ok");
}

#[test]
fn an_icmp_monitor_moves_the_service_state() {
    let s = setup("1 0");
    let steps: Vec<&str> = s.iter().map(String::as_str).collect();
    if let Some(out) =
        common::netns::run_helper("fc-icmp-mon", &steps, "helper_icmp_monitor", "icmp-monitor")
    {
        println!("{out}");
    }
}
