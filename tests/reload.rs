//! Reload of udp, tcp and sip-tcp vservers over loopback: services added and removed
//! behind the unchanged listener, established flows (and SIP dialogs) kept on their
//! service, a balancing change taking effect, sip-tcp calls going on during hundreds of reloads
//! all kept on their strict services. Synchronisation is by
//! polling with deadlines (or blocking reads with timeouts), never by bare sleeps.

mod common;

use common::sip_tcp::{TcpUas, read_message, request};
use common::*;
use fulcrum::admin::router::{self, Request};
use fulcrum::balancer::{Balancer, KeyInput};
use fulcrum::config;
use fulcrum::ops::Ops;
use fulcrum::proxy::SipStreamPath;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A config file the test rewrites and reloads.
struct File(ConfigFile);

impl File {
    fn new(tag: &str, yaml: &str) -> File {
        File(ConfigFile::new(tag, yaml))
    }

    fn start(&self) -> Arc<Ops> {
        let path = &self.0.path;
        Ops::start(config::load(path).expect("valid"), Some(path.clone())).expect("start")
    }

    /// Write `yaml` and reload it; the reload must apply as a rebuild of `v`.
    fn reload(&self, ops: &Ops, yaml: &str) {
        self.0.write(yaml);
        let changes = ops
            .reload()
            .unwrap_or_else(|e| panic!("reload: {e}\n{yaml}"));
        assert!(
            changes.iter().any(|c| c == "vservers.v rebuilt"),
            "{changes:?}"
        );
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
    // New flows reach the added service; the established one stays where it was. Every
    // client is kept open to the end: a later client on a port an earlier one had would be
    // that earlier flow's session (pinned to its service), not a new flow.
    let mut clients = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for i in 0..6 {
        let c = udp_client("127.0.0.1");
        let a = udp_ask(&c, vs, format!("n{i}").as_bytes()).expect("answer");
        seen.insert(a.0.service);
        assert_eq!(udp_ask(&old, vs, b"again").expect("answer").0.service, "s0");
        clients.push(c);
    }
    assert!(seen.contains("s1"), "{seen:?}");

    // Remove s0: no new flow reaches it, but it drains: the session established on it
    // keeps going there (and its replies keep coming back) until the drain timeout.
    let drain = format!("{slow}\ndrain_timeout: 2s");
    let only_s1 = config("udp", "127.0.0.1:0", "round_robin", &drain, &[("s1", a1)]);
    file.reload(&ops, &only_s1);
    assert_eq!(state(&ops, "s0").as_deref(), Some("DRAINING"));
    let before = hits(&h0);
    for i in 0..6 {
        let c = udp_client("127.0.0.1");
        let a = udp_ask(&c, vs, format!("m{i}").as_bytes()).expect("answer");
        assert_eq!(a.0.service, "s1");
        clients.push(c);
    }
    assert_eq!(hits(&h0), before, "a draining service gets no new flows");
    assert_eq!(udp_ask(&old, vs, b"kept").expect("answer").0.service, "s0");
    assert!(hits(&h1) >= 6);
    // The drain times out: s0 leaves the vserver and the session is balanced afresh.
    assert!(wait_until(Duration::from_secs(6), || state(&ops, "s0").is_none()));
    assert_eq!(udp_ask(&old, vs, b"moved").expect("answer").0.service, "s1");
    ops.shutdown();
}

/// The state `/status` gives `service` in the first vserver (`None`: not a member).
fn state(ops: &Ops, service: &str) -> Option<String> {
    let st = router::status(ops);
    st["vservers"][0]["services"]
        .as_array()?
        .iter()
        .find(|s| s["name"] == service)
        .and_then(|s| s["state"].as_str().map(str::to_owned))
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

/// A client connection to a sip-tcp vserver.
struct SipClient {
    stream: TcpStream,
    local: SocketAddr,
    buf: Vec<u8>,
    sent: u32,
}

impl SipClient {
    fn connect(vs: SocketAddr) -> SipClient {
        let stream = TcpStream::connect_timeout(&vs, ANSWER).expect("connect");
        let local = stream.local_addr().expect("local");
        SipClient {
            stream,
            local,
            buf: Vec::new(),
            sent: 0,
        }
    }

    /// Send a request on this connection; the status of the response that comes back on
    /// it (None when none comes).
    fn ask(&mut self, method: &str, call_id: &str) -> Option<u16> {
        self.sent += 1;
        let req = request(method, call_id, self.local, &format!("r{}", self.sent));
        self.stream.write_all(req.as_bytes()).ok()?;
        let resp = read_message(&mut self.stream, &mut self.buf)?;
        fulcrum::sip::scan(&resp).ok()?.status_code()
    }
}

/// The services (by index) that saw a request of call `call_id`.
fn owners(uas: &[TcpUas], call_id: &str) -> Vec<usize> {
    (0..uas.len())
        .filter(|&i| !uas[i].methods_of(call_id).is_empty())
        .collect()
}

/// A sip-tcp config with services `s{i}` for the indices `members` of `uas`. The stateless
/// proxy (`failover: off`): these tests read one answer per request, and fulcrum would answer
/// a held INVITE 100 first (tests/failover.rs).
fn sip_tcp(uas: &[TcpUas], members: &[usize], method: &str, extra: &str) -> String {
    let services: Vec<(String, SocketAddr)> = members
        .iter()
        .map(|&i| (format!("s{i}"), uas[i].addr))
        .collect();
    let extra = format!("{extra}\nfailover: off");
    config("sip-tcp", "127.0.0.1:0", method, &extra, &refs(&services))
}

/// A sip-tcp vserver (round robin) in front of one service `name` at `at` (stateless, as
/// [`sip_tcp`]).
fn sip_tcp_one(name: &str, at: SocketAddr) -> String {
    config(
        "sip-tcp",
        "127.0.0.1:0",
        "round_robin",
        "failover: off",
        &[(name, at)],
    )
}

fn tcp_counters<T>(ops: &Ops, f: impl Fn(&fulcrum::proxy::SipStreamCounters) -> T) -> T {
    ops.with_vservers(|vs, _| match vs[0].path::<SipStreamPath>() {
        Some(p) => f(&p.shared().counters),
        None => panic!("not a sip-tcp vserver"),
    })
    .expect("running")
}

#[test]
fn sip_tcp_reload_adds_a_service_keeping_connections_and_dialogs() {
    let uas: Vec<TcpUas> = (0..3).map(|_| TcpUas::start()).collect();
    let slow =
        "slow_start: { new_service_request_rate: 100, unit: per_second, increment_interval: 0s }";
    let file = File::new(
        "reload-sip-tcp-add",
        &sip_tcp(&uas, &[0, 1], "round_robin", slow),
    );
    let ops = file.start();
    let vs = addr(&ops);
    let mut client = SipClient::connect(vs);
    assert_eq!(client.ask("INVITE", "long@tcp"), Some(200));
    let owner = match owners(&uas, "long@tcp")[..] {
        [o] => o,
        ref other => panic!("the INVITE reached {other:?}"),
    };
    let owner_name = format!("s{owner}");
    assert_eq!(active(&ops, &owner_name), 1);

    file.reload(&ops, &sip_tcp(&uas, &[0, 1, 2], "round_robin", slow));
    assert_eq!(active(&ops, &owner_name), 1, "the dialog is still counted");
    let in_slow_start = ops
        .with_vservers(|v, _| v[0].balancer().slow_start().map(|s| s.is_active()))
        .flatten();
    assert_eq!(in_slow_start, Some(true), "the added service is new");

    // The connection established before the reload carries the dialog on to its service.
    assert_eq!(client.ask("INFO", "long@tcp"), Some(200));
    assert_eq!(uas[owner].methods_of("long@tcp"), ["INVITE", "INFO"]);
    // New calls, on that connection and on a new one, reach the added service too.
    let mut fresh = SipClient::connect(vs);
    for i in 0..6 {
        assert_eq!(client.ask("OPTIONS", &format!("old-{i}@tcp")), Some(200));
        assert_eq!(fresh.ask("OPTIONS", &format!("new-{i}@tcp")), Some(200));
    }
    assert!(!uas[2].calls().is_empty(), "the added service takes calls");
    assert_eq!(client.ask("BYE", "long@tcp"), Some(200));
    assert_eq!(uas[owner].methods_of("long@tcp"), ["INVITE", "INFO", "BYE"]);
    assert_eq!(owners(&uas, "long@tcp"), [owner]);
    // Both clients kept their one connection throughout.
    assert_eq!(
        tcp_counters(&ops, |c| c.clients_accepted.load(Ordering::Relaxed)),
        2
    );
    ops.shutdown();
}

#[test]
fn sip_tcp_reload_removes_a_service_over_post_reload() {
    let uas: Vec<TcpUas> = (0..3).map(|_| TcpUas::start()).collect();
    let file = File::new(
        "reload-sip-tcp-remove",
        &sip_tcp(&uas, &[0, 1, 2], "round_robin", ""),
    );
    let ops = file.start();
    let mut client = SipClient::connect(addr(&ops));
    // Round robin: one call per service.
    let calls: Vec<String> = (0..3).map(|i| format!("call-{i}@tcp")).collect();
    let mut owner_of = Vec::new();
    for c in &calls {
        assert_eq!(client.ask("INVITE", c), Some(200));
        match owners(&uas, c)[..] {
            [o] => owner_of.push(o),
            ref other => panic!("{c} reached {other:?}"),
        }
    }
    let mut sorted = owner_of.clone();
    sorted.sort();
    assert_eq!(sorted, [0, 1, 2]);

    file.0.write(&sip_tcp(&uas, &[0, 2], "round_robin", ""));
    let r = router::handle(&ops, &Request::new("POST", "/reload"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("vservers.v rebuilt"), "{}", r.body);

    // s1 carries a call: it drains. Its connection stays (not retired) and relays what it
    // sends: its in-dialog request for its call reaches the client, and the client's
    // answer reaches it.
    assert_eq!(state(&ops, "s1").as_deref(), Some("DRAINING"));
    assert_eq!(
        tcp_counters(&ops, |c| c.services_retired.load(Ordering::Relaxed)),
        0
    );
    let kept = calls[owner_of.iter().position(|&o| o == 1).expect("a call on s1")].clone();
    let info = format!(
        "INFO sip:a@{};transport=tcp SIP/2.0\r\nVia: SIP/2.0/TCP {};branch=z9hG4bKkept\r\nMax-Forwards: 70\r\nFrom: <sip:svc@example.com>;tag=u1\r\nTo: <sip:a@client>;tag=a1\r\nCall-ID: {kept}\r\nCSeq: 9 INFO\r\nContent-Length: 0\r\n\r\n",
        client.local, uas[1].addr
    );
    uas[1]
        .conn
        .lock()
        .expect("lock")
        .as_mut()
        .expect("fulcrum connected to s1")
        .write_all(info.as_bytes())
        .expect("info");
    let got = read_message(&mut client.stream, &mut client.buf).expect("INFO reaches the client");
    let msg = fulcrum::sip::scan(&got).expect("scan");
    assert_eq!(msg.method(), Some(&b"INFO"[..]));
    assert_eq!(msg.call_id(), Some(kept.as_bytes()));
    let mut ok = Vec::new();
    let reply = fulcrum::sip::Reply {
        code: 200,
        reason: "OK",
        retry_after_s: None,
    };
    fulcrum::sip::build_response(&msg, &reply, &mut ok).expect("200 to the INFO");
    client.stream.write_all(&ok).expect("write 200");
    assert!(
        wait_until(ANSWER, || uas[1]
            .methods_of(&kept)
            .contains(&"200".to_owned())),
        "{:?}",
        uas[1].methods_of(&kept)
    );
    // Every call stays on its service, the draining one included.
    for (c, &o) in calls.iter().zip(&owner_of) {
        assert_eq!(client.ask("INFO", c), Some(200), "{c}");
        assert_eq!(owners(&uas, c), [o], "{c}");
        assert_eq!(
            uas[o].methods_of(c).last().map(String::as_str),
            Some("INFO"),
            "{c}"
        );
    }
    let s1_seen = uas[1].calls().len();
    for i in 0..8 {
        assert_eq!(client.ask("OPTIONS", &format!("after-{i}@tcp")), Some(200));
    }
    assert_eq!(
        uas[1].calls().len(),
        s1_seen,
        "a draining service gets nothing new: {:?}",
        uas[1].calls()
    );
    // Its call ends: the drain is over, the service leaves and its connection is retired.
    assert_eq!(client.ask("BYE", &kept), Some(200));
    assert!(wait_until(std::time::Duration::from_secs(5), || {
        tcp_counters(&ops, |c| c.services_retired.load(Ordering::Relaxed)) == 1
    }));
    assert_eq!(state(&ops, "s1"), None);
    assert_eq!(
        tcp_counters(&ops, |c| c.requests_lost.load(Ordering::Relaxed)),
        0
    );
    // Nothing is left hanging: shutdown returns promptly.
    let t = std::time::Instant::now();
    ops.shutdown();
    assert!(
        t.elapsed() < std::time::Duration::from_secs(8),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn sip_tcp_reload_changes_the_method() {
    let uas: Vec<TcpUas> = (0..2).map(|_| TcpUas::start()).collect();
    let file = File::new(
        "reload-sip-tcp-method",
        &sip_tcp(&uas, &[0, 1], "round_robin", ""),
    );
    let ops = file.start();
    let mut client = SipClient::connect(addr(&ops));
    let mut before = Vec::new();
    for i in 0..4 {
        let c = format!("rr-{i}@tcp");
        assert_eq!(client.ask("OPTIONS", &c), Some(200));
        before.extend(owners(&uas, &c));
    }
    assert!(
        before.windows(2).all(|w| w[0] != w[1]),
        "round robin alternates: {before:?}"
    );

    let hashed = sip_tcp(&uas, &[0, 1], "call_id_hash", "");
    file.reload(&ops, &hashed);
    // A balancer built aside from the same file predicts where each new call goes.
    let cfg = config::from_str("t.yaml", &hashed).expect("valid");
    let twin = Balancer::new(&cfg, &cfg.vservers[0]);
    let mut seen = Vec::new();
    for i in 0..16 {
        let c = format!("hashed-{i}@tcp");
        let expect = twin
            .choose(KeyInput::Hash(fulcrum::hash::key_hash(c.as_bytes())), 0)
            .expect("a member")
            .member;
        assert_eq!(client.ask("OPTIONS", &c), Some(200));
        assert_eq!(owners(&uas, &c), [expect], "{c}");
        seen.push(expect);
    }
    // The hash puts consecutive calls on the same service at times, as round robin never does.
    assert!(seen.windows(2).any(|w| w[0] == w[1]), "{seen:?}");
    ops.shutdown();
}

/// A listener whose accept queue is full: connects to it hang (loopback drops the SYNs).
fn hanging_service() -> (socket2::Socket, Vec<TcpStream>, SocketAddr) {
    let l =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    l.bind(&"127.0.0.1:0".parse::<SocketAddr>().expect("addr").into())
        .expect("bind");
    l.listen(0).expect("listen");
    let at = l.local_addr().expect("addr").as_socket().expect("inet");
    // Fill the queue until a connect no longer completes (bounded).
    let mut held = Vec::new();
    for _ in 0..16 {
        match TcpStream::connect_timeout(&at, std::time::Duration::from_millis(300)) {
            Ok(s) => held.push(s),
            Err(_) => return (l, held, at),
        }
    }
    panic!("the accept queue never filled");
}

#[test]
fn sip_tcp_reload_sends_requests_queued_for_a_removed_service_elsewhere() {
    let live = [TcpUas::start()];
    let (_listener, _held, stuck) = hanging_service();
    let file = File::new("reload-sip-tcp-queued", &sip_tcp_one("stuck", stuck));
    let ops = file.start();
    let mut client = SipClient::connect(addr(&ops));
    // Two requests wait for the connection to `stuck`, which does not complete.
    for i in 0..2 {
        let req = request(
            "OPTIONS",
            &format!("q{i}@tcp"),
            client.local,
            &format!("q{i}"),
        );
        client.stream.write_all(req.as_bytes()).expect("write");
    }
    let forwarded = || {
        ops.with_vservers(|vs, _| match vs[0].path::<SipStreamPath>() {
            Some(p) => p.core().counters.requests_forwarded.load(Ordering::Relaxed),
            None => 0,
        })
        .unwrap_or(0)
    };
    assert!(wait_until(ANSWER, || forwarded() == 2));

    file.reload(&ops, &sip_tcp_one("s0", live[0].addr));
    // Both are answered by the service that replaced it, well before the connect timeout.
    for _ in 0..2 {
        let resp = read_message(&mut client.stream, &mut client.buf).expect("answered");
        assert_eq!(
            fulcrum::sip::scan(&resp).expect("scan").status_code(),
            Some(200)
        );
    }
    assert_eq!(owners(&live, "q0@tcp"), [0]);
    assert_eq!(owners(&live, "q1@tcp"), [0]);
    assert_eq!(
        tcp_counters(&ops, |c| c.requests_rerouted.load(Ordering::Relaxed)),
        2
    );
    assert_eq!(
        tcp_counters(&ops, |c| c.service_connect_failures.load(Ordering::Relaxed)),
        0
    );
    ops.shutdown();
}

/// A removed service that stopped reading while fulcrum was writing to it: the blocked write
/// gives way to the reload (before, the link's task waited on the write forever and the
/// requests queued behind it were never handed back).
#[test]
fn sip_tcp_reload_retires_a_service_that_stopped_reading() {
    let live = [TcpUas::start()];
    // Accepts the connection and never reads from it.
    let stuck = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let stuck_addr = stuck.local_addr().expect("addr");
    let held = std::thread::spawn(move || stuck.accept().map(|(s, _)| s));
    let file = File::new(
        "reload-sip-tcp-not-reading",
        &sip_tcp_one("stuck", stuck_addr),
    );
    let ops = file.start();
    // Requests until the service queue is full, so the write to `stuck` is blocked
    // (bounded: 100 000 requests or 30 s). Answers (503s once full) are not read: a client
    // fulcrum closes as a slow reader is replaced.
    let connect = || {
        let c = TcpStream::connect(addr(&ops)).expect("connect");
        c.set_write_timeout(Some(std::time::Duration::from_secs(2)))
            .expect("timeout");
        c
    };
    let mut writer = connect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut full = false;
    for n in 0..100_000u32 {
        if std::time::Instant::now() > deadline {
            break;
        }
        let local = writer.local_addr().expect("local");
        let req = request("OPTIONS", &format!("b-{n}@tcp"), local, &format!("b{n}"));
        if writer.write_all(req.as_bytes()).is_err() {
            writer = connect();
            continue;
        }
        if n % 256 == 0 && tcp_counters(&ops, |c| c.service_queue_full.load(Ordering::Relaxed)) >= 1
        {
            full = true;
            break;
        }
    }
    assert!(full, "the service queue never filled");
    assert_eq!(
        tcp_counters(&ops, |c| c.services_retired.load(Ordering::Relaxed)),
        0
    );

    file.reload(&ops, &sip_tcp_one("s0", live[0].addr));
    assert!(
        wait_until(ANSWER, || tcp_counters(&ops, |c| c
            .services_retired
            .load(Ordering::Relaxed))
            == 1),
        "the link of the removed service was not retired"
    );
    // What was queued behind the blocked write went to the service that replaced it (so
    // many answers at once may close this client as a slow reader), and new requests too.
    assert!(wait_until(ANSWER, || tcp_counters(&ops, |c| c
        .requests_rerouted
        .load(Ordering::Relaxed))
        >= 1));
    assert!(
        wait_until(ANSWER, || live[0]
            .calls()
            .iter()
            .any(|(call, _)| call.starts_with("b-"))),
        "no queued request reached the service that replaced the stuck one"
    );
    drop(writer);
    // The re-routed burst can fill the new service's queue for a moment (503): ask again,
    // bounded, until it is through.
    let mut fresh = SipClient::connect(addr(&ops));
    let mut code = None;
    for i in 0..50 {
        code = fresh.ask("OPTIONS", &format!("after-{i}@tcp"));
        if code == Some(200) {
            assert_eq!(owners(&live, &format!("after-{i}@tcp")), [0]);
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(code, Some(200), "no 200 after the reload");
    ops.shutdown();
    drop(held);
}

/// A reload that lowers `max_sessions` keeps only as many dialogs as the new table holds;
/// the others are no longer counted as load (the sip-tcp counters carry over a reload).
#[test]
fn sip_tcp_reload_to_a_smaller_dialog_table_counts_only_the_kept_dialogs() {
    let uas = [TcpUas::start()];
    let file = File::new(
        "reload-sip-tcp-fewer-dialogs",
        &sip_tcp(&uas, &[0], "round_robin", "max_sessions: 10"),
    );
    let ops = file.start();
    let mut client = SipClient::connect(addr(&ops));
    for i in 0..4 {
        assert_eq!(client.ask("INVITE", &format!("d{i}@tcp")), Some(200));
    }
    assert_eq!(active(&ops, "s0"), 4);
    file.reload(&ops, &sip_tcp(&uas, &[0], "round_robin", "max_sessions: 2"));
    assert_eq!(
        active(&ops, "s0"),
        2,
        "dialogs the new table refused are closed"
    );
    ops.shutdown();
}

/// A reload to a shorter idle timeout is followed by the dialog sweeper at once: an idle
/// dialog is gone about one (new) idle timeout later, not after the old sweep interval.
#[test]
fn sip_tcp_reload_to_a_shorter_idle_timeout_expires_dialogs_on_the_new_timeout() {
    let uas = [TcpUas::start()];
    let file = File::new(
        "reload-sip-tcp-idle",
        &sip_tcp(&uas, &[0], "round_robin", "idle_timeout: 600s"),
    );
    let ops = file.start();
    file.reload(
        &ops,
        &sip_tcp(&uas, &[0], "round_robin", "idle_timeout: 1s"),
    );
    let mut client = SipClient::connect(addr(&ops));
    assert_eq!(client.ask("INVITE", "idle@tcp"), Some(200));
    assert_eq!(active(&ops, "s0"), 1);
    let started = std::time::Instant::now();
    assert!(
        wait_until(std::time::Duration::from_secs(4), || active(&ops, "s0")
            == 0),
        "the idle dialog did not expire"
    );
    assert!(started.elapsed() >= std::time::Duration::from_millis(900));
    ops.shutdown();
}

/// The value of header `name` in `msg` (empty when absent).
fn header_of(msg: &str, name: &str) -> String {
    msg.lines()
        .find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
        .unwrap_or_default()
}

/// Whole calls on one sip-tcp connection until `stop`: INVITE (answered 200 by a strict
/// UAS), ACK and BYE to the service's Contact, without Route (only fulcrum's dialog table
/// takes them to the service). The calls whose BYE was answered 200, and the others.
fn calls_until(
    vs: SocketAddr,
    name: &str,
    stop: &std::sync::atomic::AtomicBool,
) -> (u32, Vec<String>) {
    let mut s = TcpStream::connect_timeout(&vs, ANSWER).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let local = s.local_addr().expect("local");
    let (mut buf, mut done, mut failed) = (Vec::new(), 0, Vec::new());
    let req = |m: &str, uri: &str, to: &str, id: &str, cseq: u32| {
        format!(
            "{m} {uri} SIP/2.0\r\nVia: SIP/2.0/TCP {local};branch=z9hG4bK{id}-{m}\r\nMax-Forwards: 70\r\nFrom: <sip:{name}@client>;tag=t-{id}\r\nTo: {to}\r\nCall-ID: {id}\r\nCSeq: {cseq} {m}\r\nContact: <sip:{name}@{local};transport=tcp>\r\nContent-Length: 0\r\n\r\n"
        )
    };
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) && failed.len() < 10 {
        n += 1;
        let id = format!("{name}-{n}");
        let mut answer = |s: &mut TcpStream| {
            read_message(s, &mut buf).map(|m| String::from_utf8_lossy(&m).into_owned())
        };
        if s.write_all(
            req(
                "INVITE",
                "sip:svc@example.com",
                "<sip:svc@example.com>",
                &id,
                1,
            )
            .as_bytes(),
        )
        .is_err()
        {
            failed.push(format!("{id}: connection lost"));
            break;
        }
        let ok = loop {
            match answer(&mut s) {
                Some(m) if m.starts_with("SIP/2.0 1") => continue,
                other => break other,
            }
        };
        let ok = match ok {
            Some(m) if m.starts_with("SIP/2.0 200") => m,
            other => {
                failed.push(format!("{id}: INVITE {other:?}"));
                continue;
            }
        };
        let (to, contact) = (header_of(&ok, "To"), header_of(&ok, "Contact"));
        let target = contact
            .trim_start_matches('<')
            .split('>')
            .next()
            .unwrap_or_default()
            .to_owned();
        let sent = s
            .write_all(req("ACK", &target, &to, &id, 1).as_bytes())
            .and_then(|()| s.write_all(req("BYE", &target, &to, &id, 2).as_bytes()));
        match (sent, answer(&mut s)) {
            (Ok(()), Some(m)) if m.starts_with("SIP/2.0 200") => done += 1,
            (_, m) => failed.push(format!("{id}: BYE {m:?}")),
        }
    }
    (done, failed)
}

/// sip-tcp calls while the config is reloaded back and forth (every member's index moving
/// each time), to strict UAS (a BYE they did not set up is answered 481): between a
/// reload's switch and its catch-up pass the new core handles messages of dialogs the old
/// one set up or answered after the migration, and must find them (before, about one call
/// in 250 had its ACK and BYE balanced afresh). Every call completes on one service and no
/// load is left counted.
#[test]
fn sip_tcp_calls_during_reloads_keep_their_services_and_leave_no_load() {
    use common::strict_uas::StrictUas;
    // Services over UDP: a strict UAS over TCP answers 100, 180 and 200 in three writes,
    // which Nagle's algorithm spaces out, and the calls would be too few to tell.
    let uas: Vec<StrictUas> = ["s0", "s1", "s2"]
        .iter()
        .map(|n| StrictUas::udp(n))
        .collect();
    let yaml = |order: &[usize]| {
        let mut y = String::from("admin:\n  listen: null\nservices:\n");
        for u in &uas {
            y += &format!(
                "  - {{ name: {}, address: \"{}\", protocol: sip-udp }}\n",
                u.name, u.addr
            );
        }
        let names: Vec<&str> = order.iter().map(|&i| uas[i].name.as_str()).collect();
        y + &format!(
            "vservers:\n  - {{ name: v, protocol: sip-tcp, bind: 127.0.0.1:0, method: round_robin, services: [{}] }}\n",
            names.join(", ")
        )
    };
    let orders: [&[usize]; 2] = [&[0, 1, 2], &[2, 0, 1]];
    let file = File::new("reload-sip-tcp-calls", &yaml(orders[0]));
    let ops = file.start();
    let vs = addr(&ops);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let callers: Vec<_> = (0..4)
        .map(|i| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || calls_until(vs, &format!("c{i}"), &stop))
        })
        .collect();
    assert!(
        wait_until(Duration::from_secs(5), || uas
            .iter()
            .map(|u| u.counts().byes_ok)
            .sum::<u64>()
            >= 20),
        "no calls"
    );
    let began = std::time::Instant::now();
    let mut reloads = 0;
    while began.elapsed() < Duration::from_secs(3) {
        reloads += 1;
        file.reload(&ops, &yaml(orders[reloads % 2]));
    }
    stop.store(true, Ordering::Relaxed);
    let (mut done, mut failed) = (0, Vec::new());
    for c in callers {
        let (d, f) = c.join().expect("caller");
        done += d;
        failed.extend(f);
    }
    let counts: Vec<_> = uas.iter().map(StrictUas::counts).collect();
    let report =
        format!("{reloads} reloads, {done} calls, failed: {failed:?}; per service: {counts:?}");
    eprintln!("{report}");
    assert!(failed.is_empty(), "{report}");
    assert!(done >= 100, "too few calls to tell: {report}");
    for c in &counts {
        assert_eq!(
            (c.r481, c.stray_acks, c.dialogs),
            (0, 0, c.byes_ok),
            "{report}"
        );
    }
    let left = || ["s0", "s1", "s2"].map(|s| active(&ops, s));
    assert!(
        wait_until(Duration::from_secs(3), || left() == [0; 3]),
        "load left counted: {:?}; {report}",
        left()
    );
    ops.shutdown();
}
