//! Reload of udp and tcp vservers over loopback: services added and removed behind the
//! unchanged listener, established flows kept on their service. Synchronisation is by
//! polling with deadlines (or blocking reads with timeouts), never by bare sleeps.

mod common;

use common::*;
use fulcrum::config;
use fulcrum::ops::Ops;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A config file the test rewrites and reloads.
struct File {
    dir: PathBuf,
    path: PathBuf,
}

impl File {
    fn new(tag: &str, yaml: &str) -> File {
        let dir = std::env::temp_dir().join(format!("fulcrum-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("f.yaml");
        std::fs::write(&path, yaml).expect("write");
        File { dir, path }
    }

    fn start(&self) -> Arc<Ops> {
        Ops::start(
            config::load(&self.path).expect("valid"),
            Some(self.path.clone()),
        )
        .expect("start")
    }

    /// Write `yaml` and reload it; the reload must apply as a rebuild of `v`.
    fn reload(&self, ops: &Ops, yaml: &str) {
        std::fs::write(&self.path, yaml).expect("write");
        let changes = ops
            .reload()
            .unwrap_or_else(|e| panic!("reload: {e}\n{yaml}"));
        assert!(
            changes.iter().any(|c| c == "vservers.v rebuilt"),
            "{changes:?}"
        );
    }
}

impl Drop for File {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn addr(ops: &Ops) -> SocketAddr {
    ops.with_vservers(|vs, _| vs[0].bound[0]).expect("running")
}

/// Open flows the running balancer of `v` counts on `service`.
fn active(ops: &Ops, service: &str) -> u64 {
    ops.with_vservers(|vs, _| {
        let b = vs[0].balancer();
        b.members()
            .iter()
            .position(|m| m.name == service)
            .and_then(|m| b.counters(m))
            .map_or(0, |c| c.active())
    })
    .unwrap_or(0)
}

fn hits(h: &Arc<AtomicU64>) -> u64 {
    h.load(Ordering::Relaxed)
}

#[test]
fn udp_reload_adds_and_removes_services_keeping_sessions() {
    let (a0, h0) = udp_service("s0", "127.0.0.1");
    let (a1, h1) = udp_service("s1", "127.0.0.1");
    let slow = "slow_start: { new_service_request_rate: 100, unit: per_second, increment_interval: 0s }\nworkers: 1";
    let one = config("udp", "127.0.0.1:0", "round_robin", slow, &[("s0", a0)]);
    let both = config(
        "udp",
        "127.0.0.1:0",
        "round_robin",
        slow,
        &[("s0", a0), ("s1", a1)],
    );
    let file = File::new("reload-udp", &one);
    let ops = file.start();
    let vs = addr(&ops);
    let old = udp_client("127.0.0.1");
    assert_eq!(udp_ask(&old, vs, b"a").expect("answer").0.service, "s0");

    file.reload(&ops, &both);
    // The session established before the reload is still counted on its service.
    assert_eq!(active(&ops, "s0"), 1);
    let in_slow_start = ops
        .with_vservers(|v, _| v[0].balancer().slow_start().map(|s| s.is_active()))
        .flatten();
    assert_eq!(in_slow_start, Some(true), "the added service is new");
    // New flows reach the added service; the established one stays where it was.
    let mut seen = std::collections::HashSet::new();
    for i in 0..6 {
        let c = udp_client("127.0.0.1");
        let a = udp_ask(&c, vs, format!("n{i}").as_bytes()).expect("answer");
        seen.insert(a.0.service);
        assert_eq!(udp_ask(&old, vs, b"again").expect("answer").0.service, "s0");
    }
    assert!(seen.contains("s1"), "{seen:?}");

    // Remove s0: no new flow reaches it. Its session is closed; the client's next datagram
    // is balanced afresh.
    let only_s1 = config("udp", "127.0.0.1:0", "round_robin", slow, &[("s1", a1)]);
    file.reload(&ops, &only_s1);
    let before = hits(&h0);
    for i in 0..6 {
        let c = udp_client("127.0.0.1");
        let a = udp_ask(&c, vs, format!("m{i}").as_bytes()).expect("answer");
        assert_eq!(a.0.service, "s1");
    }
    assert_eq!(udp_ask(&old, vs, b"moved").expect("answer").0.service, "s1");
    assert_eq!(hits(&h0), before, "a removed service gets no new flows");
    assert!(hits(&h1) >= 7);
    ops.shutdown();
}

/// A connection through the vserver that has sent `payload` but not yet half-closed (the
/// test service answers once it sees the half-close).
fn open(vs: SocketAddr, payload: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect_timeout(&vs, ANSWER).expect("connect");
    s.set_read_timeout(Some(ANSWER)).expect("timeout");
    s.write_all(payload).expect("write");
    s
}

fn finish(mut s: TcpStream) -> Answer {
    s.shutdown(Shutdown::Write).expect("half-close");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read");
    parse_answer(&out).expect("answer")
}

#[test]
fn tcp_reload_adds_and_removes_services_keeping_connections() {
    let (a0, h0) = tcp_service("s0", "127.0.0.1");
    let (a1, h1) = tcp_service("s1", "127.0.0.1");
    let one = config("tcp", "127.0.0.1:0", "round_robin", "", &[("s0", a0)]);
    let both = config(
        "tcp",
        "127.0.0.1:0",
        "round_robin",
        "",
        &[("s0", a0), ("s1", a1)],
    );
    let file = File::new("reload-tcp", &one);
    let ops = file.start();
    let vs = addr(&ops);
    let first = open(vs, b"before");
    assert!(wait_until(ANSWER, || hits(&h0) == 1 && active(&ops, "s0") == 1));

    file.reload(&ops, &both);
    // The connection established before the reload is still counted on its service.
    assert_eq!(active(&ops, "s0"), 1);
    let mut seen = std::collections::HashSet::new();
    for i in 0..4 {
        let a = tcp_ask(vs, format!("n{i}").as_bytes()).expect("answer");
        seen.insert(a.service);
    }
    assert!(
        seen.contains("s1"),
        "new connections reach the added service"
    );

    // Two connections open across the removal of s0: round robin puts one on each service,
    // and each finishes where it began; new ones never reach s0.
    let total = || hits(&h0) + hits(&h1);
    let before_open = total();
    let across: Vec<TcpStream> = (0..2).map(|_| open(vs, b"across")).collect();
    assert!(wait_until(ANSWER, || total() == before_open + 2));
    let only_s1 = config("tcp", "127.0.0.1:0", "round_robin", "", &[("s1", a1)]);
    file.reload(&ops, &only_s1);
    let before = hits(&h0);
    for i in 0..4 {
        let a = tcp_ask(vs, format!("m{i}").as_bytes()).expect("answer");
        assert_eq!(a.service, "s1");
    }
    assert_eq!(hits(&h0), before, "a removed service gets no new flows");
    assert!(hits(&h1) >= 4);

    let a = finish(first);
    assert_eq!(
        (a.service.as_str(), a.body.as_slice()),
        ("s0", &b"before"[..])
    );
    let mut owners: Vec<String> = across
        .into_iter()
        .map(|s| {
            let a = finish(s);
            assert_eq!(a.body, b"across");
            a.service
        })
        .collect();
    owners.sort();
    assert_eq!(owners, ["s0", "s1"]);
    // Connections closing after the reloads are uncounted where the new balancer reads.
    assert!(wait_until(ANSWER, || active(&ops, "s1") == 0));
    ops.shutdown();
}
