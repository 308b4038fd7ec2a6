//! sip-tcp vserver over real loopback sockets: framing on both sides, routing by Call-ID
//! over pooled service connections, responses back on the originating client connection,
//! keep-alives, in-dialog requests from a service, passive failure detection. The stateless
//! proxy (`failover: off`): these tests read one answer per request, and fulcrum answers a
//! held INVITE 100 first (tests/failover.rs).

mod common;

use common::sip_tcp::*;
use common::wait_until;
use fulcrum::balancer::Health;
use fulcrum::config;
use fulcrum::proxy::Runtime;
use fulcrum::sip;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The shared state of the sip-tcp vserver `v` of `rt`.
fn vserver_shared(rt: &Runtime) -> std::sync::Arc<fulcrum::proxy::SipStreamShared> {
    match rt
        .vserver("v")
        .expect("v")
        .path::<fulcrum::proxy::SipStreamPath>()
    {
        Some(p) => std::sync::Arc::clone(p.shared()),
        None => panic!("not a sip-tcp vserver"),
    }
}

fn start(uas: &[&TcpUas]) -> (Runtime, SocketAddr) {
    let mut y = String::from("services:\n");
    for (i, u) in uas.iter().enumerate() {
        y.push_str(&format!(
            "  - {{ name: s{i}, address: {}, protocol: sip-tcp }}\n",
            u.addr
        ));
    }
    let names: Vec<String> = (0..uas.len()).map(|i| format!("s{i}")).collect();
    y.push_str(&format!(
        "vservers:\n  - {{ name: v, protocol: sip-tcp, bind: 127.0.0.1:0, failover: off, method: call_id_hash, services: [{}] }}\n",
        names.join(", ")
    ));
    let cfg = config::from_str("t", &y).expect("config");
    let rt = Runtime::start(&cfg).expect("start");
    let addr = rt.vserver("v").expect("vserver").bound[0];
    (rt, addr)
}

#[test]
fn requests_reach_one_service_per_call_and_responses_return_on_the_client_connection() {
    let uas: Vec<TcpUas> = (0..3).map(|_| TcpUas::start()).collect();
    let refs: Vec<&TcpUas> = uas.iter().collect();
    let (_rt, proxy) = start(&refs);
    let mut client = TcpStream::connect(proxy).expect("connect");
    let local = client.local_addr().expect("local");
    let mut buf = Vec::new();
    for i in 0..30 {
        let cid = format!("call-{i}@tcp");
        // Two messages of one call in a single write: framing must split them.
        let both = format!(
            "{}{}",
            request("OPTIONS", &cid, local, &format!("o{i}")),
            request("INFO", &cid, local, &format!("n{i}"))
        );
        client.write_all(both.as_bytes()).expect("write");
        for _ in 0..2 {
            let resp = read_message(&mut client, &mut buf).expect("response");
            let msg = sip::scan(&resp).expect("scan");
            assert_eq!(msg.status_code(), Some(200));
            // fulcrum's Via is gone: only the client's remains.
            assert_eq!(msg.vias().count(), 1);
            assert!(
                msg.top_via()
                    .expect("via")
                    .branch
                    .is_some_and(|b| b.starts_with(b"z9hG4bK"))
            );
        }
    }
    // Every call's messages landed on exactly one service, and all three took calls.
    let mut per_call: std::collections::HashMap<String, std::collections::HashSet<usize>> =
        Default::default();
    for (i, u) in uas.iter().enumerate() {
        for (cid, _) in u.calls() {
            per_call.entry(cid).or_default().insert(i);
        }
    }
    assert_eq!(per_call.len(), 30);
    assert!(per_call.values().all(|s| s.len() == 1));
    assert!(uas.iter().all(|u| !u.calls().is_empty()));
}

#[test]
fn keepalive_partial_writes_and_bad_framing() {
    let uas = TcpUas::start();
    let (_rt, proxy) = start(&[&uas]);
    let mut client = TcpStream::connect(proxy).expect("connect");
    let local = client.local_addr().expect("local");
    // RFC 5626 §3.5.1: CRLFCRLF ping → CRLF pong.
    client.write_all(b"\r\n\r\n").expect("ping");
    let mut pong = [0u8; 2];
    client.set_read_timeout(Some(WAIT)).expect("timeout");
    client.read_exact(&mut pong).expect("pong");
    assert_eq!(&pong, b"\r\n");
    // A message split across writes.
    let req = request("OPTIONS", "split@tcp", local, "s1");
    let (a, b) = req.as_bytes().split_at(40);
    client.write_all(a).expect("part 1");
    client.flush().expect("flush");
    std::thread::sleep(Duration::from_millis(50));
    client.write_all(b).expect("part 2");
    let mut buf = Vec::new();
    let resp = read_message(&mut client, &mut buf).expect("response to split message");
    assert_eq!(sip::scan(&resp).expect("scan").status_code(), Some(200));
    // No Content-Length on a stream (RFC 3261 §18.3): the connection is closed.
    let bad = "OPTIONS sip:x SIP/2.0\r\nVia: SIP/2.0/TCP 1.2.3.4;branch=z9hG4bKx\r\nCall-ID: bad\r\nCSeq: 1 OPTIONS\r\nFrom: <sip:a@b>;tag=1\r\nTo: <sip:c@d>\r\n\r\n";
    client.write_all(bad.as_bytes()).expect("bad");
    let mut rest = [0u8; 64];
    let deadline = Instant::now() + WAIT;
    loop {
        match client.read(&mut rest) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
        assert!(
            Instant::now() < deadline,
            "connection not closed after a framing error"
        );
    }
    // Other clients are unaffected.
    let mut other = TcpStream::connect(proxy).expect("connect");
    let local2 = other.local_addr().expect("local");
    other
        .write_all(request("OPTIONS", "after@tcp", local2, "a1").as_bytes())
        .expect("write");
    let mut buf2 = Vec::new();
    assert!(read_message(&mut other, &mut buf2).is_some());
}

#[test]
fn in_dialog_request_from_service_reaches_the_client_connection() {
    let uas = TcpUas::start();
    let (_rt, proxy) = start(&[&uas]);
    let mut client = TcpStream::connect(proxy).expect("connect");
    let local = client.local_addr().expect("local");
    client
        .write_all(request("INVITE", "dlg@tcp", local, "i1").as_bytes())
        .expect("invite");
    let mut buf = Vec::new();
    let _ = read_message(&mut client, &mut buf).expect("200");
    // The UAS sends a BYE toward the client's Contact over the connection fulcrum opened.
    let bye = format!(
        "BYE sip:a@{local};transport=tcp SIP/2.0\r\nVia: SIP/2.0/TCP {};branch=z9hG4bKbye1\r\nMax-Forwards: 70\r\nFrom: <sip:svc@example.com>;tag=u1\r\nTo: <sip:a@client>;tag=a1\r\nCall-ID: dlg@tcp\r\nCSeq: 9 BYE\r\nContent-Length: 0\r\n\r\n",
        uas.addr
    );
    let (tx, rx) = mpsc::channel();
    {
        let guard = uas.conn.lock().expect("lock");
        let mut conn = guard
            .as_ref()
            .expect("fulcrum connected to the uas")
            .try_clone()
            .expect("clone");
        conn.write_all(bye.as_bytes()).expect("bye");
        tx.send(()).expect("sent");
    }
    rx.recv_timeout(WAIT).expect("bye written");
    let got = read_message(&mut client, &mut buf).expect("BYE reaches the client");
    let msg = sip::scan(&got).expect("scan");
    assert_eq!(msg.method(), Some(&b"BYE"[..]));
    // fulcrum put its own Via on top.
    assert_eq!(msg.vias().count(), 2);
}

/// A sip-tcp vserver (with `options` in its flow mapping) over a live service and `dead`, a
/// port with nothing listening; a client connected to it.
fn live_and_dead(options: &str) -> (TcpUas, Runtime, TcpStream) {
    let live = TcpUas::start();
    let dead_addr = common::closed_port("127.0.0.1");
    let y = format!(
        "services:\n  - {{ name: live, address: {}, protocol: sip-tcp }}\n  - {{ name: dead, address: {dead_addr}, protocol: sip-tcp }}\nvservers:\n  - {{ name: v, protocol: sip-tcp, bind: 127.0.0.1:0, {options}, services: [live, dead] }}\n",
        live.addr
    );
    let cfg = config::from_str("t", &y).expect("config");
    let rt = Runtime::start(&cfg).expect("start");
    let proxy = rt.vserver("v").expect("v").bound[0];
    let client = TcpStream::connect(proxy).expect("connect");
    (live, rt, client)
}

/// Send `n` OPTIONS (Call-IDs `{tag}{i}@x`) on `client`, each answered before the next.
fn each_answered(client: &mut TcpStream, buf: &mut Vec<u8>, tag: &str, n: usize) {
    let local = client.local_addr().expect("local");
    for i in 0..n {
        let req = request(
            "OPTIONS",
            &format!("{tag}{i}@x"),
            local,
            &format!("{tag}{i}"),
        );
        client.write_all(req.as_bytes()).expect("write");
        assert!(
            read_message(client, buf).is_some(),
            "request {tag}{i} answered"
        );
    }
}

#[test]
fn a_service_that_refuses_connections_is_marked_down_and_calls_go_elsewhere() {
    let (_live, rt, mut client) = live_and_dead("failover: off");
    let mut buf = Vec::new();
    // Requests that hash to the dead service are moved to the next-ranked one when its
    // connect fails (docs/sip.md, SIP over TCP), so every request is answered, none lost.
    each_answered(&mut client, &mut buf, "c", 20);
    let b = rt.vserver("v").expect("v").balancer();
    assert_eq!(b.health(1), Some(Health::Down));
    let shared = vserver_shared(&rt);
    assert!(shared.counters.requests_rerouted.load(Ordering::Relaxed) >= 1);
    assert_eq!(shared.counters.requests_lost.load(Ordering::Relaxed), 0);
    // Now everything lands on the live service.
    each_answered(&mut client, &mut buf, "after", 10);
}

/// Passive ejection on a service link (docs/ejection.md): the link's failed reconnects to a
/// service that refuses connections are its failures, so after `after` of them it is
/// EJECTED with reason `refused`; the live service's answers are successes, which leave it
/// with no failure on record.
#[test]
fn a_service_whose_connects_keep_failing_is_ejected() {
    use fulcrum::eject::{Cause, Phase};
    let (_live, rt, mut client) = live_and_dead("eject: { after: 2, base: 1m }");
    let mut buf = Vec::new();
    each_answered(&mut client, &mut buf, "e", 20);
    let b = rt.vserver("v").expect("v").balancer();
    // The first refusal marks it DOWN; the link's reconnects (100 ms, then 200 ms) fail too.
    assert!(wait_until(Duration::from_secs(5), || b
        .ejection(1, rt.now())
        .is_some_and(|e| matches!(
            e.phase,
            Some(Phase::Ejected { .. })
        ))));
    let dead = b.ejection(1, rt.now()).expect("eject on");
    assert_eq!(dead.reason, Some(Cause::Refused));
    let live = b.ejection(0, rt.now()).expect("eject on");
    assert_eq!((live.phase, live.consecutive_failures), (None, 0));
}

#[test]
fn a_client_that_does_not_read_is_disconnected_and_others_are_served() {
    let uas = TcpUas::start();
    let (rt, proxy) = start(&[&uas]);
    // A small receive buffer makes the kernel stop taking responses early.
    let sock =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    sock.set_recv_buffer_size(4096).expect("rcvbuf");
    sock.connect(&proxy.into()).expect("connect");
    let mut lazy: TcpStream = sock.into();
    let local = lazy.local_addr().expect("local");
    let shared = vserver_shared(&rt);
    // Send requests without ever reading the responses, until fulcrum gives up on us
    // (bounded: at most 200 000 requests or 30 s).
    let deadline = Instant::now() + Duration::from_secs(30);
    lazy.set_write_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let mut sent = 0u32;
    while shared.counters.slow_clients_closed.load(Ordering::Relaxed) == 0 {
        assert!(
            Instant::now() < deadline && sent < 200_000,
            "slow client never disconnected"
        );
        let req = request(
            "OPTIONS",
            &format!("slow-{sent}@x"),
            local,
            &format!("s{sent}"),
        );
        if lazy.write_all(req.as_bytes()).is_err() {
            break;
        }
        sent += 1;
    }
    // fulcrum stopped reading this client once its queue was full (so our writes stopped
    // going through) and gives up on it when a write toward it makes no progress for 10 s.
    let closed = wait_until(Duration::from_secs(30), || {
        shared.counters.slow_clients_closed.load(Ordering::Relaxed) > 0
    });
    assert!(
        closed,
        "slow client never disconnected after {sent} requests"
    );
    assert!(shared.counters.client_reads_paused.load(Ordering::Relaxed) >= 1);
    assert_eq!(
        shared.counters.slow_clients_closed.load(Ordering::Relaxed),
        1
    );
    // Disconnected means closed, although this client reads nothing: fulcrum's side of the
    // socket is gone, not held by a writer blocked on it, so writing on finds it reset
    // rather than blocking on a full window.
    let until = Instant::now() + Duration::from_secs(10);
    let kind = loop {
        assert!(Instant::now() < until, "the connection is still open");
        match lazy.write_all(request("OPTIONS", "after@x", local, "after").as_bytes()) {
            Ok(()) => {}
            Err(e) => break e.kind(),
        }
    };
    assert!(
        matches!(
            kind,
            std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted
        ),
        "the connection was not closed: {kind:?}"
    );
    assert_eq!(shared.clients(), 0);
    // Another client is served normally.
    let mut other = TcpStream::connect(proxy).expect("connect");
    let local2 = other.local_addr().expect("local");
    other
        .write_all(request("OPTIONS", "fine@x", local2, "f1").as_bytes())
        .expect("write");
    let mut buf = Vec::new();
    assert!(read_message(&mut other, &mut buf).is_some());
}

/// A client (a trunk) with a 4 KiB receive buffer sends `total` requests whose answers are
/// large (1 KiB Call-IDs, as 200s with SDP are), `per_tick` of them every 100 ms (all at once
/// when `None`), and reads nothing for 3 s; then it reads. Every request must be answered, in
/// order, and the client never disconnected. Returns how often fulcrum paused reading it.
fn trunk_reads_late(total: usize, per_tick: Option<usize>) -> u64 {
    let pad = "p".repeat(1000);
    let call_id = move |i: usize| format!("burst-{i}-{pad}@x");
    let uas = TcpUas::start();
    let (rt, proxy) = start(&[&uas]);
    let shared = vserver_shared(&rt);
    let sock =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    sock.set_recv_buffer_size(4096).expect("rcvbuf");
    sock.connect(&proxy.into()).expect("connect");
    let mut trunk: TcpStream = sock.into();
    let local = trunk.local_addr().expect("local");
    let mut sender = trunk.try_clone().expect("clone");
    let writer = std::thread::spawn({
        let call_id = call_id.clone();
        move || {
            sender
                .set_write_timeout(Some(Duration::from_secs(60)))
                .expect("timeout");
            for i in 0..total {
                if per_tick.is_some_and(|n| i > 0 && i % n == 0) {
                    std::thread::sleep(Duration::from_millis(100));
                }
                let req = request("OPTIONS", &call_id(i), local, &format!("b{i}"));
                sender.write_all(req.as_bytes()).expect("request written");
            }
        }
    });
    std::thread::sleep(Duration::from_secs(3));
    let mut buf = Vec::new();
    for i in 0..total {
        let resp = read_message(&mut trunk, &mut buf).unwrap_or_else(|| {
            panic!(
                "answer {i} of {total} never came ({} requests at the service, {} clients \
                 disconnected as not reading)",
                uas.calls().len(),
                shared.counters.slow_clients_closed.load(Ordering::Relaxed)
            )
        });
        let msg = sip::scan(&resp).expect("scan");
        assert_eq!(msg.status_code(), Some(200), "answer {i}");
        assert_eq!(msg.call_id(), Some(call_id(i).as_bytes()), "answer {i}");
    }
    writer.join().expect("writer");
    assert_eq!(
        shared.counters.slow_clients_closed.load(Ordering::Relaxed),
        0
    );
    shared.counters.client_reads_paused.load(Ordering::Relaxed)
}

/// A trunk that bursts 7,000 requests at once (about 9 MB of answers: more than the kernel's
/// socket buffers hold, fewer requests than one service's queue) and reads them 3 s later is
/// kept, and every request answered. With a queue bounded in messages (1,024 before) it was
/// disconnected within a fraction of a second.
#[test]
fn a_client_that_bursts_and_reads_late_is_kept_and_answered() {
    trunk_reads_late(7_000, None);
}

/// A trunk that keeps sending (3,000 requests/s, a pace the service keeps up with) while it
/// reads nothing for 3 s: once 1 MiB of answers waits for it, fulcrum stops reading its
/// requests, and reads them again once it reads; nothing is lost, nobody is cut off.
#[test]
fn a_client_that_sends_without_reading_is_paused_then_served() {
    let paused = trunk_reads_late(12_000, Some(300));
    assert!(paused >= 1, "fulcrum never stopped reading the trunk");
}

/// A response from a client never reaches another client's connection, even one from the
/// address a forged second Via names (only a service's in-dialog request may go there).
#[test]
fn a_client_cannot_inject_a_response_into_another_clients_connection() {
    let uas = TcpUas::start();
    let (rt, proxy) = start(&[&uas]);
    let shared = vserver_shared(&rt);
    let mut victim = TcpStream::connect(proxy).expect("connect");
    let victim_addr = victim.local_addr().expect("local");
    // The victim is known to fulcrum (its first request went through).
    let mut buf = Vec::new();
    victim
        .write_all(request("OPTIONS", "v1@x", victim_addr, "v1").as_bytes())
        .expect("write");
    assert!(read_message(&mut victim, &mut buf).is_some());
    let mut attacker = TcpStream::connect(proxy).expect("connect");
    let forged = format!(
        "SIP/2.0 200 OK\r\nVia: SIP/2.0/TCP {proxy};branch=z9hG4bK-fc-0000000000000000\r\nVia: SIP/2.0/TCP {victim_addr};branch=z9hG4bKx\r\nFrom: <sip:a@x>;tag=1\r\nTo: <sip:b@y>;tag=2\r\nCall-ID: inj@x\r\nCSeq: 1 OPTIONS\r\nContent-Length: 8\r\n\r\nINJECTED"
    );
    attacker.write_all(forged.as_bytes()).expect("write");
    // Synchronise on fulcrum having handled it: a keep-alive ping after it is answered.
    attacker.write_all(b"\r\n\r\n").expect("ping");
    let mut pong = [0u8; 2];
    attacker.set_read_timeout(Some(WAIT)).expect("timeout");
    attacker.read_exact(&mut pong).expect("pong");
    // Dropped as a response with nowhere to go (its next Via is no service).
    assert_eq!(
        shared.counters.responses_no_client.load(Ordering::Relaxed),
        1
    );
    // The victim gets its own next answer, and nothing injected before it.
    victim
        .write_all(request("OPTIONS", "v2@x", victim_addr, "v2").as_bytes())
        .expect("write");
    let next = read_message(&mut victim, &mut buf).expect("response");
    let msg = sip::scan(&next).expect("scan");
    assert_eq!(msg.call_id(), Some(&b"v2@x"[..]));
}

/// A "service" that accepts connections and closes them at once is as good as one that
/// refuses them: it is marked DOWN and the requests are answered elsewhere, none swallowed.
#[test]
fn a_service_that_accepts_and_closes_is_marked_down_and_loses_no_request() {
    let closer = TcpListener::bind("127.0.0.1:0").expect("bind");
    let closer_addr = closer.local_addr().expect("addr");
    closer.set_nonblocking(true).expect("nonblocking");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = std::sync::Arc::clone(&stop);
    let closer_thread = std::thread::spawn(move || {
        while !stop2.load(Ordering::Relaxed) {
            match closer.accept() {
                Ok((s, _)) => drop(s),
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    });
    let good = TcpUas::start();
    let y = format!(
        "services:\n  - {{ name: bad, address: {closer_addr}, protocol: sip-tcp }}\n  - {{ name: good, address: {}, protocol: sip-tcp }}\nvservers:\n  - {{ name: v, protocol: sip-tcp, bind: 127.0.0.1:0, failover: off, method: round_robin, services: [bad, good] }}\n",
        good.addr
    );
    let cfg = config::from_str("t", &y).expect("config");
    let rt = Runtime::start(&cfg).expect("start");
    let proxy = rt.vserver("v").expect("v").bound[0];
    let shared = vserver_shared(&rt);
    let mut client = TcpStream::connect(proxy).expect("connect");
    let local = client.local_addr().expect("local");
    let mut buf = Vec::new();
    for i in 0..20 {
        client
            .write_all(
                request("OPTIONS", &format!("ac-{i}@x"), local, &format!("ac{i}")).as_bytes(),
            )
            .expect("write");
        let resp = read_message(&mut client, &mut buf).expect("every request is answered");
        let code = sip::scan(&resp).ok().and_then(|m| m.status_code());
        assert_eq!(code, Some(200), "request {i}");
    }
    assert_eq!(shared.core().balancer().health(0), Some(Health::Down));
    assert!(
        shared
            .counters
            .service_connect_failures
            .load(Ordering::Relaxed)
            >= 1
    );
    assert_eq!(
        shared
            .counters
            .link_unexpected_events
            .load(Ordering::Relaxed),
        0
    );
    stop.store(true, Ordering::Relaxed);
    let _ = closer_thread.join();
}

/// The message deadline times each message, not the connection: a client whose writes
/// always end inside a message, but whose messages each complete at once, is served past the
/// 10 s deadline (bounded: 11.5 s).
#[test]
fn steady_traffic_split_inside_messages_outlives_the_message_deadline() {
    let uas = TcpUas::start();
    let (rt, proxy) = start(&[&uas]);
    let shared = vserver_shared(&rt);
    let mut client = TcpStream::connect(proxy).expect("connect");
    let local = client.local_addr().expect("local");
    let mut reader = client.try_clone().expect("clone");
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = std::sync::Arc::clone(&answered);
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        while read_message(&mut reader, &mut buf).is_some() {
            count.fetch_add(1, Ordering::Relaxed);
        }
    });
    let start = Instant::now();
    let mut tail = String::new();
    let mut sent = 0;
    while start.elapsed() < Duration::from_millis(11_500) {
        let msg = request(
            "OPTIONS",
            &format!("steady-{sent}@x"),
            local,
            &format!("st{sent}"),
        );
        let cut = msg.len() - 20;
        client
            .write_all(format!("{tail}{}", &msg[..cut]).as_bytes())
            .expect("write: the connection stays open");
        tail = msg[cut..].to_owned();
        sent += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    client.write_all(tail.as_bytes()).expect("last tail");
    assert!(
        common::wait_until(WAIT, || answered.load(Ordering::Relaxed) == sent),
        "every request answered: {} of {sent}",
        answered.load(Ordering::Relaxed)
    );
    assert_eq!(shared.counters.framing_errors.load(Ordering::Relaxed), 0);
}

/// A service that answers and then closes its connection is reconnected, not marked DOWN.
#[test]
fn a_service_that_answers_then_closes_stays_up() {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut stream) = conn else { continue };
            let mut buf = Vec::new();
            if let Some(m) = read_message(&mut stream, &mut buf) {
                let msg = sip::scan(&m).expect("scan");
                let ok = sip::Reply {
                    code: 200,
                    reason: "OK",
                    retry_after_s: None,
                };
                let mut out = Vec::new();
                if sip::build_response(&msg, &ok, &mut out).is_ok() {
                    let _ = stream.write_all(&out);
                }
            }
            // One answer per connection, then closed.
        }
    });
    let y = format!(
        "services:\n  - {{ name: once, address: {addr}, protocol: sip-tcp }}\nvservers:\n  - {{ name: v, protocol: sip-tcp, bind: 127.0.0.1:0, failover: off, services: [once] }}\n"
    );
    let cfg = config::from_str("t", &y).expect("config");
    let rt = Runtime::start(&cfg).expect("start");
    let proxy = rt.vserver("v").expect("v").bound[0];
    let shared = vserver_shared(&rt);
    let mut client = TcpStream::connect(proxy).expect("connect");
    let local = client.local_addr().expect("local");
    let mut buf = Vec::new();
    for i in 0..5u64 {
        client
            .write_all(
                request("OPTIONS", &format!("once-{i}@x"), local, &format!("on{i}")).as_bytes(),
            )
            .expect("write");
        let resp = read_message(&mut client, &mut buf).expect("answered");
        assert_eq!(
            sip::scan(&resp).ok().and_then(|m| m.status_code()),
            Some(200),
            "request {i}"
        );
        // fulcrum has seen the service close before the next request (one written meanwhile
        // would be lost with the connection: a known limit, not what this test is about).
        let lost = |k: u64| {
            shared
                .counters
                .service_connections_lost
                .load(Ordering::Relaxed)
                >= k
        };
        assert!(common::wait_until(Duration::from_secs(2), || lost(i + 1)));
        assert!(common::wait_until(Duration::from_secs(2), || {
            shared.core().balancer().health(0) == Some(Health::Up)
        }));
    }
    assert_eq!(shared.core().balancer().health(0), Some(Health::Up));
    assert_eq!(
        shared
            .counters
            .service_connect_failures
            .load(Ordering::Relaxed),
        0,
        "never taken for a refused connect"
    );
}

#[test]
fn a_request_no_service_can_take_after_a_failed_connect_is_answered_503() {
    let dead = common::closed_port("127.0.0.1");
    let y = format!(
        "services:\n  - {{ name: dead, address: {dead}, protocol: sip-tcp }}\nvservers:\n  - {{ name: v, protocol: sip-tcp, bind: 127.0.0.1:0, failover: off, services: [dead] }}\n"
    );
    let cfg = config::from_str("t", &y).expect("config");
    let rt = Runtime::start(&cfg).expect("start");
    let proxy = rt.vserver("v").expect("v").bound[0];
    let mut client = TcpStream::connect(proxy).expect("connect");
    let local = client.local_addr().expect("local");
    client
        .write_all(request("INVITE", "lone@x", local, "l1").as_bytes())
        .expect("write");
    let mut buf = Vec::new();
    let resp = read_message(&mut client, &mut buf).expect("an answer, not silence");
    let msg = sip::scan(&resp).expect("scan");
    assert_eq!(msg.status_code(), Some(503));
    assert!(msg.header(b"Retry-After").is_some());
    assert_eq!(msg.vias().count(), 1, "only the client's Via");
    let shared = vserver_shared(&rt);
    assert_eq!(shared.counters.requests_lost.load(Ordering::Relaxed), 1);
}

#[test]
fn a_service_that_does_not_read_fills_its_queue_and_clients_hear_503() {
    // A "service" that accepts and never reads: fulcrum's writes stall, its queue fills.
    let stuck = TcpListener::bind("127.0.0.1:0").expect("bind");
    let stuck_addr = stuck.local_addr().expect("addr");
    let held = std::thread::spawn(move || stuck.accept().map(|(s, _)| s));
    let y = format!(
        "services:\n  - {{ name: stuck, address: {stuck_addr}, protocol: sip-tcp }}\nvservers:\n  - {{ name: v, protocol: sip-tcp, bind: 127.0.0.1:0, failover: off, services: [stuck] }}\n"
    );
    let cfg = config::from_str("t", &y).expect("config");
    let rt = Runtime::start(&cfg).expect("start");
    let proxy = rt.vserver("v").expect("v").bound[0];
    let shared = vserver_shared(&rt);
    let client = TcpStream::connect(proxy).expect("connect");
    let local = client.local_addr().expect("local");
    let mut reader = client.try_clone().expect("clone");
    // Read on a thread, handing over the first 503, and keep reading (bounded by the read
    // timeout).
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let mut sent = false;
        while let Some(m) = read_message(&mut reader, &mut buf) {
            let code = sip::scan(&m).ok().and_then(|s| s.status_code());
            if code == Some(503) && !sent {
                sent = tx.send(m).is_ok();
            }
        }
    });
    let core = shared.core();
    // Bounded: at most 100 000 requests or 30 s, stopping at the first 503.
    let mut writer = client;
    writer
        .set_write_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut answer = None;
    for n in 0..100_000u32 {
        if Instant::now() > deadline {
            break;
        }
        let req = request("OPTIONS", &format!("q-{n}@x"), local, &format!("q{n}"));
        if writer.write_all(req.as_bytes()).is_err() {
            break;
        }
        if n % 256 == 0 {
            if let Ok(m) = rx.try_recv() {
                answer = Some(m);
                break;
            }
            // At most 256 requests ahead of fulcrum: once the service's queue is full each
            // one is answered 503 at once, and a client with thousands in flight would get
            // them faster than it reads and be disconnected as not reading (right, but not
            // what this test is about).
            let handled =
                || core.counters.requests_in.load(Ordering::Relaxed) + 256 >= u64::from(n);
            common::wait_until(Duration::from_secs(5), handled);
        }
    }
    let answer = answer
        .or_else(|| rx.recv_timeout(Duration::from_secs(5)).ok())
        .expect("a 503 once the service queue is full");
    let msg = sip::scan(&answer).expect("scan");
    assert!(msg.header(b"Retry-After").is_some());
    assert_eq!(msg.vias().count(), 1, "only the client's Via");
    assert!(shared.counters.service_queue_full.load(Ordering::Relaxed) >= 1);
    drop(rt);
    drop(held);
}

/// A service that stops reading its connection (a stuck process whose socket stays open):
/// the link's write makes no progress for the service's `write_timeout`, the connection ends,
/// the service is marked DOWN and the stall counted, and the requests it was given unanswered
/// (and the one cut short) go to the other service: every request is answered, by it.
#[test]
fn a_service_that_stops_reading_is_left_at_write_timeout_and_loses_no_request() {
    // Accepts, never reads, keeps every connection open; a small receive buffer fills soon.
    let deaf =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    deaf.set_recv_buffer_size(4096).expect("rcvbuf");
    deaf.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .expect("bind");
    deaf.listen(16).expect("listen");
    let deaf: TcpListener = deaf.into();
    let deaf_addr = deaf.local_addr().expect("addr");
    deaf.set_nonblocking(true).expect("nonblocking");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = std::sync::Arc::clone(&stop);
    let deaf_thread = std::thread::spawn(move || {
        let mut held = Vec::new();
        while !stop2.load(Ordering::Relaxed) {
            match deaf.accept() {
                Ok((s, _)) => held.push(s),
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
        held.len()
    });
    let good = TcpUas::start();
    let y = format!(
        "services:\n  - {{ name: deaf, address: {deaf_addr}, protocol: sip-tcp, write_timeout: 1s }}\n  - {{ name: good, address: {}, protocol: sip-tcp }}\nvservers:\n  - {{ name: v, protocol: sip-tcp, bind: 127.0.0.1:0, failover: off, method: round_robin, services: [deaf, good] }}\n",
        good.addr
    );
    let cfg = config::from_str("t", &y).expect("config");
    let rt = Runtime::start(&cfg).expect("start");
    let proxy = rt.vserver("v").expect("v").bound[0];
    let shared = vserver_shared(&rt);
    let mut client = TcpStream::connect(proxy).expect("connect");
    let local = client.local_addr().expect("local");
    // Answers are read as they come, so that fulcrum never waits on this client.
    let mut reader = client.try_clone().expect("clone");
    let (tx, answers) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        while let Some(m) = read_message(&mut reader, &mut buf) {
            if tx.send(m).is_err() {
                return;
            }
        }
    });
    // 200 requests of 32 KB: the deaf service's half (3.2 MB) is more than the kernel
    // buffers between fulcrum and it take.
    let body = "x".repeat(32 * 1024);
    let n = 200;
    for i in 0..n {
        let req = request("OPTIONS", &format!("deaf-{i}@x"), local, &format!("d{i}")).replace(
            "Content-Length: 0\r\n\r\n",
            &format!(
                "Content-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            ),
        );
        client.write_all(req.as_bytes()).expect("write");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut ok = 0;
    while ok < n {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(m) = answers.recv_timeout(left) else {
            break;
        };
        if sip::scan(&m).ok().and_then(|m| m.status_code()) == Some(200) {
            ok += 1;
        }
    }
    let stalled = shared
        .counters
        .service_writes_stalled
        .load(Ordering::Relaxed);
    let health = shared.core().balancer().health(0);
    stop.store(true, Ordering::Relaxed);
    let held = deaf_thread.join().expect("deaf thread");
    assert!(held >= 1, "the deaf service was never connected to");
    assert_eq!(ok, n, "requests answered 200 (stalled writes: {stalled})");
    assert!(stalled >= 1, "no write counted as stalled");
    assert_eq!(health, Some(Health::Down));
    assert_eq!(
        good.calls().len(),
        n,
        "the good service answered every request"
    );
    assert_eq!(
        shared
            .counters
            .link_unexpected_events
            .load(Ordering::Relaxed),
        0,
        "the shell sent its links only what their phases wait for"
    );
}

/// `max_sessions` bounds the client connections of all the vserver's listeners together:
/// 40 connections opened at once over four worker listeners leave exactly 6 open (the rest
/// closed at accept and counted), and once those leave, new clients are served again.
#[test]
fn max_sessions_bounds_clients_across_every_listener() {
    let uas = TcpUas::start();
    let y = format!(
        "services:\n  - {{ name: s0, address: {}, protocol: sip-tcp }}\nvservers:\n  - {{ name: v, protocol: sip-tcp, bind: 127.0.0.1:0, workers: 4, max_sessions: 6, failover: off, services: [s0] }}\n",
        uas.addr
    );
    let cfg = config::from_str("t", &y).expect("config");
    let rt = Runtime::start(&cfg).expect("start");
    let proxy = rt.vserver("v").expect("v").bound[0];
    let shared = vserver_shared(&rt);
    let opened: Vec<TcpStream> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..40)
            .map(|_| s.spawn(move || TcpStream::connect(proxy).ok()))
            .collect();
        hs.into_iter()
            .filter_map(|h| h.join().ok().flatten())
            .collect()
    });
    assert_eq!(opened.len(), 40, "the kernel accepted every connect");
    assert!(
        wait_until(Duration::from_secs(5), || {
            shared.counters.clients_refused.load(Ordering::Relaxed) == 34
        }),
        "refused {}",
        shared.counters.clients_refused.load(Ordering::Relaxed)
    );
    assert_eq!(shared.clients(), 6);
    assert_eq!(shared.counters.clients_open.load(Ordering::Relaxed), 6);
    drop(opened);
    assert!(wait_until(Duration::from_secs(5), || shared.clients() == 0));
    let mut c = TcpStream::connect(proxy).expect("connect");
    let mut buf = Vec::new();
    each_answered(&mut c, &mut buf, "after", 2);
}
