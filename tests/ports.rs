//! Ephemeral ports toward one service address are a limit too (docs/limits.md): a `tcp`
//! vserver whose connections toward its service use up the local port range counts each
//! connection that finds no port left (`ports_exhausted`) and its client is closed, while the
//! connections already made go on. The range is made small with
//! `net.ipv4.ip_local_port_range` in a network namespace the test creates (the sysctl is per
//! namespace); the body is this test binary run again inside it (`helper_ports`).

mod common;

use common::netns::ROLE;
use fulcrum::proxy::TcpPath;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Local ports connections may use inside the namespace: 40000 to 40009.
const RANGE: u16 = 10;
const CLIENTS: u16 = 16;

#[test]
fn helper_ports() {
    if std::env::var(ROLE).as_deref() != Ok("ports") {
        return;
    }
    let svc = common::services("tcp", 1, "127.0.0.1");
    let (rt, vs) = common::start_over("tcp", "127.0.0.1:0", "round_robin", "", &svc);
    let core = match rt.vserver("v").and_then(|v| v.path::<TcpPath>()) {
        Some(p) => std::sync::Arc::clone(p.core()),
        None => panic!("not tcp"),
    };
    // Silent clients from ports outside the range: each holds a connection toward the
    // service (a tcp vserver connects at once) until the range runs out.
    let mut held = Vec::new();
    for i in 0..CLIENTS {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
            .expect("socket");
        s.bind(&SocketAddr::from(([127, 0, 0, 1], 50_000 + i)).into())
            .expect("bind a client port");
        s.connect(&vs.into()).expect("connect to the vserver");
        held.push(TcpStream::from(s));
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        common::wait_until(Duration::from_secs(5), || {
            core.counters.ports_exhausted.load(Ordering::Relaxed) >= u64::from(CLIENTS - RANGE)
        }),
        "ports_exhausted {}",
        core.counters.ports_exhausted.load(Ordering::Relaxed)
    );
    let exhausted = core.counters.ports_exhausted.load(Ordering::Relaxed);
    // Those without a port were closed; the others still relay.
    let mut relayed = 0;
    let mut closed = 0;
    for (i, s) in held.iter_mut().enumerate() {
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let msg = format!("c{i}");
        if s.write_all(msg.as_bytes()).is_err() {
            closed += 1;
            continue;
        }
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        match common::parse_answer(&got) {
            Some(a) if a.body == msg.as_bytes() => relayed += 1,
            _ => closed += 1,
        }
    }
    println!(
        "{CLIENTS} clients, {RANGE} local ports: {relayed} relayed, {closed} closed, ports_exhausted {exhausted}"
    );
    assert!(
        relayed >= 1 && relayed <= usize::from(RANGE),
        "{relayed} relayed"
    );
    assert_eq!(relayed + closed, usize::from(CLIENTS));
    assert!(exhausted >= u64::from(CLIENTS) - relayed as u64);
    println!("RESULT ok");
}

#[test]
fn connections_past_the_local_port_range_are_counted_as_ports_exhausted() {
    let end = 40_000 + RANGE - 1;
    let range = format!("sysctl net.ipv4.ip_local_port_range 40000 {end}");
    if let Some(out) = common::netns::run_helper("fc-ports", &[&range], "helper_ports", "ports") {
        println!("{out}");
    }
}
