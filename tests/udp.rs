//! `udp` vserver over loopback: distribution, affinity, failover, session expiry, table
//! limit, IPv6, IP_PKTINFO on a wildcard bind, per-datagram token sessions, PROXY v2, and
//! the firewall-pool properties (two instances agree; an inside/outside sandwich keeps a
//! flow and its reverse on one firewall). Two `fulcrum run` processes: tests/processes.rs.

mod common;

use common::*;
use fulcrum::balancer::Health;
use fulcrum::proxy::UdpPath;
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

fn udp_core(rt: &fulcrum::proxy::Runtime, name: &str) -> std::sync::Arc<fulcrum::proxy::UdpCore> {
    let v = rt.vserver(name).expect("vserver");
    match v.path::<UdpPath>() {
        Some(p) => std::sync::Arc::clone(p.core()),
        None => panic!("not udp: {:?}", v.data),
    }
}

#[test]
fn round_robin_spreads_sessions_and_relays_from_the_vserver_address() {
    let (rt, vs) = start_loopback("udp", 3, "round_robin", "");
    let mut per: HashMap<String, usize> = HashMap::new();
    // Clients are kept open so that no two share a source port (one session each).
    let mut clients = Vec::new();
    for _ in 0..30 {
        let c = udp_client("127.0.0.1");
        let (a, from) = udp_ask(&c, vs, b"ping").expect("answer");
        clients.push(c);
        assert_eq!(from, vs, "reply comes from the vserver's address");
        assert_eq!(a.body, b"ping");
        *per.entry(a.service).or_default() += 1;
    }
    assert_eq!(per.len(), 3);
    assert!(per.values().all(|&n| n == 10), "{per:?}");
    let core = udp_core(&rt, "v");
    assert_eq!(core.sessions(), 30);
    assert_eq!(core.counters.sessions_created.load(Ordering::Relaxed), 30);
    // least_connection reads these: every session is open on its member.
    let b = core.balancer();
    let active: u64 = (0..3)
        .map(|m| b.counters(m).map_or(0, |c| c.active()))
        .sum();
    assert_eq!(active, 30);
}

/// Many clients sending at once: more datagrams than one recvmmsg / sendmmsg batch and one
/// wake-up budget. Every datagram is answered, from the vserver's address, each client's
/// in order.
/// Every client sends `rounds` datagrams (`c{i}-{round}`), all before any answer is read.
fn burst(clients: &[std::net::UdpSocket], vs: SocketAddr, rounds: usize) {
    for round in 0..rounds {
        for (i, c) in clients.iter().enumerate() {
            c.send_to(format!("c{i}-{round}").as_bytes(), vs)
                .expect("send");
        }
    }
}

/// Client `i`'s answers to its burst: from the vserver's address, in the order sent.
fn burst_answers(c: &std::net::UdpSocket, i: usize, vs: SocketAddr, rounds: usize) -> Vec<Answer> {
    let mut buf = vec![0u8; 65_536];
    (0..rounds)
        .map(|round| {
            let (n, from) = c.recv_from(&mut buf).expect("answer");
            assert_eq!(from, vs);
            let a = parse_answer(&buf[..n]).expect("answer format");
            assert_eq!(a.body, format!("c{i}-{round}").as_bytes(), "client {i}");
            a
        })
        .collect()
}

#[test]
fn bursts_larger_than_a_batch_are_all_relayed_in_order() {
    let (rt, vs) = start_loopback("udp", 3, "round_robin", "");
    let clients: Vec<_> = (0..50).map(|_| udp_client("127.0.0.1")).collect();
    burst(&clients, vs, 4);
    for (i, c) in clients.iter().enumerate() {
        burst_answers(c, i, vs, 4);
    }
    let core = udp_core(&rt, "v");
    assert_eq!(core.counters.datagrams_in.load(Ordering::Relaxed), 200);
    assert!(wait_until(ANSWER, || {
        core.counters.datagrams_out.load(Ordering::Relaxed) == 200
    }));
    assert_eq!(core.sessions(), 50);
}

#[test]
fn a_session_keeps_its_service_and_counts_traffic() {
    let svc = services("udp", 3, "127.0.0.1");
    let (rt, vs) = start_over("udp", "127.0.0.1:0", "round_robin", "", &svc);
    let c = udp_client("127.0.0.1");
    let first = udp_ask(&c, vs, b"x").expect("answer").0.service;
    for _ in 0..20 {
        assert_eq!(udp_ask(&c, vs, b"xyz").expect("answer").0.service, first);
    }
    let core = udp_core(&rt, "v");
    assert_eq!(core.sessions(), 1);
    let m = svc.iter().position(|(n, _)| *n == first).expect("member");
    let counters = core.balancer().counters(m).expect("counters");
    // 21 datagrams each way; least_packets / least_bandwidth read these totals and rates.
    // The last reply is counted right after it is sent: wait for it, not for the client.
    assert!(wait_until(ANSWER, || counters.packets_total() == 42));
    assert!(counters.bytes_total() > 42 * 3);
}

#[test]
fn source_ip_hash_is_per_client_ip_and_fails_over_when_down() {
    let (rt, vs) = start_loopback("udp", 3, "source_ip_hash", "");
    let c1 = udp_client("127.0.0.1");
    let c2 = udp_client("127.0.0.1");
    let s1 = udp_ask(&c1, vs, b"a").expect("answer").0.service;
    assert_eq!(
        udp_ask(&c2, vs, b"a").expect("answer").0.service,
        s1,
        "same client IP"
    );
    assert_eq!(rt.set_health(&s1, Health::Down), 1);
    let s2 = udp_ask(&c1, vs, b"a").expect("answer").0.service;
    assert_ne!(
        s2, s1,
        "a session on a DOWN service moves to the next ranked one"
    );
    let core = udp_core(&rt, "v");
    assert_eq!(core.counters.sessions_rerouted.load(Ordering::Relaxed), 1);
    rt.set_health(&s1, Health::Up);
    // The moved session stays where it is; a new flow of this key goes home.
    assert_eq!(udp_ask(&c1, vs, b"a").expect("answer").0.service, s2);
    let c3 = udp_client("127.0.0.1");
    assert_eq!(udp_ask(&c3, vs, b"a").expect("answer").0.service, s1);
}

/// A burst that meets a failover: the sessions of a service gone DOWN are replaced in the
/// middle of receive batches, beside datagrams of other flows that go to their own sessions.
/// Every datagram is still answered, in order, and only the DOWN service's flows move. (It
/// fails when a batch's queued sends are not flushed; the flush before a replaced session's
/// socket closes matters only when health changes inside one batch, which a test cannot time.)
#[test]
fn a_burst_across_a_failover_is_relayed_whole() {
    let (rt, vs) = start_loopback("udp", 3, "source_ip_source_port_hash", "");
    let clients: Vec<_> = (0..40).map(|_| udp_client("127.0.0.1")).collect();
    let home: Vec<String> = clients
        .iter()
        .map(|c| udp_ask(c, vs, b"hello").expect("answer").0.service)
        .collect();
    let down = home[0].clone();
    let on_down = home.iter().filter(|s| **s == down).count();
    assert_eq!(rt.set_health(&down, Health::Down), 1);
    burst(&clients, vs, 3);
    for (i, c) in clients.iter().enumerate() {
        let served: HashSet<String> = burst_answers(c, i, vs, 3)
            .into_iter()
            .map(|a| a.service)
            .collect();
        assert_eq!(served.len(), 1, "client {i}: one service for the flow");
        let now = served.into_iter().next().unwrap_or_default();
        if home[i] == down {
            assert_ne!(now, down, "client {i} left the DOWN service");
        } else {
            assert_eq!(now, home[i], "client {i} stayed home");
        }
    }
    let core = udp_core(&rt, "v");
    assert_eq!(
        core.counters.sessions_rerouted.load(Ordering::Relaxed),
        on_down as u64
    );
    assert_eq!(core.counters.send_errors.load(Ordering::Relaxed), 0);
    assert!(wait_until(ANSWER, || {
        core.counters.datagrams_out.load(Ordering::Relaxed) == 40 + 120
    }));
}

#[test]
fn idle_sessions_expire() {
    let (rt, vs) = start_loopback("udp", 2, "round_robin", "idle_timeout: 150ms");
    let core = udp_core(&rt, "v");
    let c = udp_client("127.0.0.1");
    let first = udp_ask(&c, vs, b"a").expect("answer").0.service;
    assert_eq!(core.sessions(), 1);
    assert!(
        wait_until(Duration::from_secs(3), || core.sessions() == 0),
        "session expired"
    );
    assert_eq!(core.counters.sessions_expired.load(Ordering::Relaxed), 1);
    let b = core.balancer();
    assert_eq!(
        (0..2)
            .map(|m| b.counters(m).map_or(0, |c| c.active()))
            .sum::<u64>(),
        0
    );
    // The next datagram opens a new session: round robin gives it the other service.
    assert_ne!(udp_ask(&c, vs, b"a").expect("answer").0.service, first);
    assert_eq!(core.counters.sessions_created.load(Ordering::Relaxed), 2);
}

#[test]
fn a_full_table_refuses_new_sessions_and_counts_them() {
    let (rt, vs) = start_loopback(
        "udp",
        2,
        "round_robin",
        "max_sessions: 2\nidle_timeout: 300ms",
    );
    let core = udp_core(&rt, "v");
    let (a, b, c) = (
        udp_client("127.0.0.1"),
        udp_client("127.0.0.1"),
        udp_client("127.0.0.1"),
    );
    assert!(udp_ask(&a, vs, b"1").is_some());
    assert!(udp_ask(&b, vs, b"2").is_some());
    c.set_read_timeout(Some(SILENCE)).expect("timeout");
    assert!(udp_ask(&c, vs, b"3").is_none(), "third session refused");
    assert_eq!(core.counters.sessions_refused.load(Ordering::Relaxed), 1);
    // Existing sessions still work while the table is full.
    assert!(udp_ask(&a, vs, b"1").is_some());
    // Once the others expire there is room again.
    assert!(wait_until(Duration::from_secs(3), || core.sessions() == 0));
    c.set_read_timeout(Some(ANSWER)).expect("timeout");
    assert!(udp_ask(&c, vs, b"3").is_some());
}

#[test]
fn ipv6_sessions() {
    let svc = services("udp", 2, "[::1]");
    let (_rt, vs) = start_over("udp", "[::1]:0", "source_ip_source_port_hash", "", &svc);
    assert!(vs.is_ipv6());
    let mut seen = HashSet::new();
    for _ in 0..20 {
        let c = udp_client("[::1]");
        let (a, from) = udp_ask(&c, vs, b"six").expect("answer");
        assert_eq!(from, vs);
        assert_eq!(a.body, b"six");
        assert_eq!(
            udp_ask(&c, vs, b"six").expect("answer").0.service,
            a.service,
            "per-port affinity"
        );
        seen.insert(a.service);
    }
    assert_eq!(seen.len(), 2, "20 ports spread over both services");
}

#[test]
fn wildcard_bind_answers_from_the_address_reached_and_hashes_it() {
    let svc = services("udp", 3, "127.0.0.1");
    let (_rt, vs) = start_over("udp", "0.0.0.0:0", "dest_ip_hash", "", &svc);
    let port = vs.port();
    let c = udp_client("127.0.0.1");
    let mut by_dst = HashMap::new();
    for i in 1..=12u8 {
        let dst: SocketAddr = format!("127.0.0.{i}:{port}").parse().expect("addr");
        let (a, from) = udp_ask(&c, dst, b"d").expect("answer");
        assert_eq!(
            from, dst,
            "IP_PKTINFO: the reply leaves from the address the client reached"
        );
        by_dst.insert(i, a.service);
    }
    // dest_ip_hash sees each destination: several services are used, deterministically.
    let distinct: HashSet<_> = by_dst.values().collect();
    assert!(distinct.len() >= 2, "{by_dst:?}");
    for i in 1..=12u8 {
        let c2 = udp_client("127.0.0.1");
        let dst: SocketAddr = format!("127.0.0.{i}:{port}").parse().expect("addr");
        assert_eq!(
            udp_ask(&c2, dst, b"d").expect("answer").0.service,
            by_dst[&i]
        );
    }
}

#[test]
fn token_on_the_payload_chooses_per_datagram() {
    let (rt, vs) = start_loopback("udp", 3, "token", "token: { offset: 0, length: 4 }");
    let c = udp_client("127.0.0.1");
    let mut by_token = HashMap::new();
    for t in 0..12 {
        let p = format!("t{t:03}rest");
        let s = udp_ask(&c, vs, p.as_bytes()).expect("answer").0.service;
        by_token.insert(t, s);
    }
    let used: HashSet<_> = by_token.values().cloned().collect();
    assert!(
        used.len() >= 2,
        "one client, several tokens, several services: {by_token:?}"
    );
    let core = udp_core(&rt, "v");
    assert_eq!(
        core.sessions(),
        used.len(),
        "one session per (client, service)"
    );
    for t in 0..12 {
        let p = format!("t{t:03}again");
        assert_eq!(
            udp_ask(&c, vs, p.as_bytes()).expect("answer").0.service,
            by_token[&t]
        );
    }
    // Too short for the token: least_connection fallback, still answered.
    assert!(udp_ask(&c, vs, b"ab").is_some());
}

/// A UDP service that answers every datagram with `name` after `delay`.
fn delayed_udp_service(name: &'static str, delay: Duration) -> SocketAddr {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let addr = s.local_addr().expect("addr");
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((_, from)) = s.recv_from(&mut buf) {
            std::thread::sleep(delay);
            let _ = s.send_to(name.as_bytes(), from);
        }
    });
    addr
}

/// least_response_time learns each service's response time from the sessions it relays
/// (a client's datagram to the service's first reply) and gives new sessions to the quicker.
#[test]
fn least_response_time_measures_the_sessions() {
    let fast = delayed_udp_service("fast", Duration::from_millis(1));
    let slow = delayed_udp_service("slow", Duration::from_millis(100));
    let svc = vec![("fast".to_owned(), fast), ("slow".to_owned(), slow)];
    let (rt, vs) = start_over("udp", "127.0.0.1:0", "least_response_time", "", &svc);
    let mut clients = Vec::new();
    let mut ask = || {
        let c = udp_client("127.0.0.1");
        c.send_to(b"ping", vs).expect("send");
        let mut buf = [0u8; 64];
        let (n, _) = c.recv_from(&mut buf).expect("answer");
        clients.push(c);
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let first: Vec<String> = (0..2).map(|_| ask()).collect();
    assert!(
        first.contains(&"fast".to_owned()) && first.contains(&"slow".to_owned()),
        "{first:?}"
    );
    let core = udp_core(&rt, "v");
    let b = core.balancer();
    let time = |m: usize| b.counters(m).and_then(|c| c.response_time_us());
    assert!(
        wait_until(ANSWER, || time(0).is_some() && time(1).is_some()),
        "both services measured"
    );
    assert!(
        time(0) < Some(50_000) && time(1) >= Some(90_000),
        "{:?} {:?}",
        time(0),
        time(1)
    );
    let later: Vec<String> = (0..6).map(|_| ask()).collect();
    assert!(later.iter().all(|s| s == "fast"), "{later:?}");
}

/// Per-datagram choice with `max_clients: 1`: a client's own session on its service does not
/// count against it, so every datagram of the flow stays there (each counted once).
#[test]
fn a_token_flow_keeps_its_service_at_max_clients() {
    let svc = services("udp", 3, "127.0.0.1");
    let text = config(
        "udp",
        "127.0.0.1:0",
        "token",
        "token: { offset: 0, length: 4 }",
        &refs(&svc),
    )
    .replace("protocol: udp }", "protocol: udp, max_clients: 1 }");
    assert_eq!(text.matches("max_clients: 1").count(), 3, "{text}");
    let rt = start(&text);
    let vs = bound(&rt, "v");
    let c = udp_client("127.0.0.1");
    let first = udp_ask(&c, vs, b"tok1-0").expect("answer").0.service;
    for i in 1..5 {
        let p = format!("tok1-{i}");
        assert_eq!(
            udp_ask(&c, vs, p.as_bytes()).expect("answer").0.service,
            first,
            "datagram {i}"
        );
    }
    let core = udp_core(&rt, "v");
    assert_eq!(core.sessions(), 1);
    let b = core.balancer();
    let counted: u64 = fulcrum::balancer::Path::ALL
        .into_iter()
        .map(|p| b.path_count(p))
        .sum();
    assert_eq!(counted, 5, "one selection per datagram");
}

#[test]
fn proxy_v2_header_carries_the_client_address() {
    let (_rt, vs) = start_loopback("udp", 2, "round_robin", "send_proxy: v2");
    for _ in 0..4 {
        let c = udp_client("127.0.0.1");
        let me = c.local_addr().expect("addr");
        let (a, _) = udp_ask(&c, vs, b"payload").expect("answer");
        assert_eq!(
            a.proxy_src,
            me.to_string(),
            "service parsed the PROXY v2 header"
        );
        assert_eq!(a.body, b"payload", "payload unchanged after the header");
        assert_eq!(
            udp_ask(&c, vs, b"again").expect("answer").0.proxy_src,
            me.to_string(),
            "every datagram"
        );
    }
}

/// Determinism (docs/methods.md): two instances with one config pick the same service per flow.
#[test]
fn two_instances_agree_per_flow() {
    let [(_rt1, v1), (_rt2, v2)] = start_pair("udp", 4, "source_ip_source_port_hash");
    let mut used = HashSet::new();
    for _ in 0..24 {
        let c = udp_client("127.0.0.1");
        let a = udp_ask(&c, v1, b"m").expect("answer").0.service;
        let b = udp_ask(&c, v2, b"m").expect("answer").0.service;
        assert_eq!(a, b, "flow {:?}", c.local_addr());
        used.insert(a);
    }
    assert!(used.len() >= 3);
}

/// A firewall sandwich: `inside` and `outside` vservers over the two legs of each firewall
/// (legs share a hash_id), both `source_dest_ip_hash`. A flow client→server enters inside,
/// its reverse server→client enters outside; both must cross the same firewall.
#[test]
fn sandwich_keeps_a_flow_and_its_reverse_on_one_firewall() {
    let fws = ["fw-a", "fw-b", "fw-c"];
    let mut yaml = String::from("admin:\n  listen: null\nservices:\n");
    for fw in fws {
        for leg in ["in", "out"] {
            let (a, _) = udp_service(&format!("{fw}-{leg}"), "127.0.0.1");
            yaml += &format!(
                "  - {{ name: {fw}-{leg}, address: \"{a}\", protocol: udp, hash_id: {fw} }}\n"
            );
        }
    }
    yaml += "vservers:\n";
    for leg in ["in", "out"] {
        yaml += &format!(
            "  - name: {leg}\n    protocol: udp\n    bind: [\"0.0.0.0:0\"]\n    method: source_dest_ip_hash\n    services: [{}]\n",
            fws.map(|f| format!("{f}-{leg}")).join(", ")
        );
    }
    let rt = start(&yaml);
    let (pin, pout) = (bound(&rt, "in").port(), bound(&rt, "out").port());
    let mut used = HashSet::new();
    for (c, s) in [
        (2u8, 9u8),
        (3, 9),
        (4, 10),
        (5, 11),
        (6, 12),
        (7, 13),
        (8, 14),
        (20, 30),
        (21, 31),
    ] {
        let client = udp_client(&format!("127.0.0.{c}"));
        let server = udp_client(&format!("127.0.0.{s}"));
        let fwd: SocketAddr = format!("127.0.0.{s}:{pin}").parse().expect("addr");
        let rev: SocketAddr = format!("127.0.0.{c}:{pout}").parse().expect("addr");
        let inside = udp_ask(&client, fwd, b"syn").expect("answer").0.service;
        let outside = udp_ask(&server, rev, b"syn-ack").expect("answer").0.service;
        let fw_in = inside.trim_end_matches("-in");
        let fw_out = outside.trim_end_matches("-out");
        assert_eq!(fw_in, fw_out, "127.0.0.{c} <-> 127.0.0.{s}");
        used.insert(fw_in.to_string());
    }
    assert!(used.len() >= 2, "flows spread over the firewalls: {used:?}");
}

/// A `udp` service whose port is closed answers each session's datagram with an ICMP port
/// unreachable, which its connected session socket reports: after `eject.after` (3) of those
/// it is EJECTED, for reason `unreachable`, and new flows go to the live service only. Without
/// a monitor nothing else would take it out of the rotation.
#[test]
fn a_service_answering_icmp_unreachable_is_ejected() {
    let live = services("udp", 1, "127.0.0.1");
    let dead = {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        s.local_addr().expect("addr")
    };
    let svc = vec![live[0].clone(), ("gone".to_owned(), dead)];
    let (rt, vs) = start_over("udp", "127.0.0.1:0", "round_robin", "", &svc);
    let core = udp_core(&rt, "v");
    let b = core.balancer();
    let gone = b
        .members()
        .iter()
        .position(|m| m.name == "gone")
        .expect("member");
    // Round robin: every other new flow goes to the closed port; nothing waits for an answer.
    let mut clients = Vec::new();
    let ejected =
        |rt: &fulcrum::proxy::Runtime| b.ejection(gone, rt.now()).is_some_and(|e| e.is_ejected());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !ejected(&rt) && std::time::Instant::now() < deadline {
        if clients.len() < 12 {
            let c = udp_client("127.0.0.1");
            c.send_to(b"x", vs).expect("send");
            clients.push(c);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = b.ejection(gone, rt.now()).expect("eject is on");
    assert!(status.is_ejected(), "{status:?}");
    assert_eq!(status.reason, Some(fulcrum::eject::Cause::Unreachable));
    // New flows reach the live service, every one of them.
    for i in 0..10 {
        let c = udp_client("127.0.0.1");
        let (a, _) = udp_ask(&c, vs, b"y").unwrap_or_else(|| panic!("flow {i} unanswered"));
        assert_eq!(a.service, "s0");
    }
}

/// Tiers (docs/methods.md): a `backup: true` service gets no flow while a primary is UP,
/// takes new flows once every primary is DOWN or out of service, and gives new flows back
/// when a primary returns, while the flows it took stay with it.
#[test]
fn the_backup_service_serves_only_while_every_primary_is_down() {
    let (p0, _) = udp_service("p0", "127.0.0.1");
    let (p1, _) = udp_service("p1", "127.0.0.1");
    let (b0, _) = udp_service("b0", "127.0.0.1");
    let yaml = format!(
        "admin:\n  listen: null\nservices:\n  - {{ name: p0, address: \"{p0}\", protocol: udp }}\n  - {{ name: p1, address: \"{p1}\", protocol: udp }}\n  - {{ name: b0, address: \"{b0}\", protocol: udp, backup: true }}\nvservers:\n  - {{ name: v, protocol: udp, bind: [\"127.0.0.1:0\"], method: source_ip_source_port_hash, services: [p0, p1, b0] }}\n"
    );
    let rt = start(&yaml);
    let v = bound(&rt, "v");
    let served = |clients: &[std::net::UdpSocket]| -> Vec<String> {
        clients
            .iter()
            .map(|c| udp_ask(c, v, b"m").expect("answer").0.service)
            .collect()
    };
    let fresh = |n: usize| -> Vec<std::net::UdpSocket> {
        (0..n).map(|_| udp_client("127.0.0.1")).collect()
    };
    let first = fresh(30);
    let by: HashSet<String> = served(&first).into_iter().collect();
    assert_eq!(
        by,
        HashSet::from(["p0".into(), "p1".into()]),
        "primaries only"
    );

    assert_eq!(rt.set_health("p0", Health::Down), 1);
    assert_eq!(rt.set_health("p1", Health::OutOfService), 1);
    let during = fresh(10);
    assert!(
        served(&during).iter().all(|s| s == "b0"),
        "the backup takes new flows"
    );

    assert_eq!(rt.set_health("p0", Health::Up), 1);
    assert!(
        served(&fresh(10)).iter().all(|s| s == "p0"),
        "new flows go back to the primary that returned"
    );
    assert!(
        served(&during).iter().all(|s| s == "b0"),
        "flows the backup took stay with it"
    );
    rt.shutdown();
}
