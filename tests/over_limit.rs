//! Requests past fulcrum's limits are answered, not met with silence: an INVITE with more
//! header lines than the scanner reads (the Vias a routing loop stacks) gets 513 Message Too
//! Large (RFC 3261 §21.5.14) from a sip-udp and a sip-tcp vserver, and a sip-tcp request
//! longer than a frame may be gets 513 before its connection closes (docs/sip.md, SIP over
//! TCP). Nothing reaches the service, and each is counted.

mod common;

use common::sip_tcp::{Next, TcpUas, next_message, request};
use fulcrum::proxy::Runtime;
use fulcrum::sip::{MAX_HEADERS, SipMsg, scan};
use std::io::Write;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// An INVITE from `local` over `transport` whose `vias` Via lines come first, the client's
/// own (asking for rport) on top.
fn stacked_vias(transport: &str, local: SocketAddr, vias: usize, call_id: &str) -> String {
    let mut m = format!(
        "INVITE sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/{transport} {local};branch=z9hG4bKtop;rport\r\n"
    );
    for i in 1..vias {
        m.push_str(&format!(
            "Via: SIP/2.0/UDP 10.1.{}.{}:5060;branch=z9hG4bKloop{i}\r\n",
            i / 256,
            i % 256
        ));
    }
    m.push_str(&format!(
        "Max-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n"
    ));
    m
}

/// `r` is fulcrum's 513 to the request `req`: every Via value in order, its Call-ID and CSeq.
fn assert_answers_513(r: &[u8], req: &[u8]) {
    let m = scan(r).expect("the answer scans");
    assert_eq!(m.status_code(), Some(513), "{}", String::from_utf8_lossy(r));
    let req = fulcrum::sip::scan_for_reply(req).expect("request scans for a reply");
    let branches = |m: &SipMsg<'_>| {
        m.vias()
            .map(|v| v.branch.map(<[u8]>::to_vec))
            .collect::<Vec<_>>()
    };
    assert_eq!(branches(&m), branches(&req), "every Via, in order");
    assert_eq!(m.call_id(), req.call_id());
    assert_eq!(m.cseq_raw(), req.cseq_raw());
}

/// The counter `pick` of vserver `v`'s SIP core.
fn counter(rt: &Runtime, pick: fn(&fulcrum::core::sip::SipCounters) -> u64) -> u64 {
    let v = rt.vserver("v").expect("vserver v");
    pick(&v.data.sip_core().expect("a SIP vserver").counters)
}

#[test]
fn a_udp_request_past_the_line_limit_is_answered_513() {
    let service = UdpSocket::bind("127.0.0.1:0").expect("service");
    service
        .set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let (rt, proxy) = common::start_over(
        "sip-udp",
        "127.0.0.1:0",
        "call_id_hash",
        "",
        &[("s0".to_owned(), service.local_addr().expect("addr"))],
    );
    let client = UdpSocket::bind("127.0.0.1:0").expect("client");
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let req = stacked_vias("UDP", client.local_addr().expect("addr"), 300, "udp-loop");
    assert!(req.len() < 65_507 && req.matches("\r\n").count() - 2 > MAX_HEADERS);
    client.send_to(req.as_bytes(), proxy).expect("send");
    let mut buf = vec![0u8; 65_536];
    let (n, from) = client.recv_from(&mut buf).expect("an answer, not silence");
    assert_eq!(from, proxy);
    assert_answers_513(&buf[..n], req.as_bytes());
    assert!(service.recv_from(&mut buf).is_err(), "nothing forwarded");
    assert_eq!(
        counter(&rt, |c| c.over_header_limit.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(counter(&rt, |c| c.replies_513.load(Ordering::Relaxed)), 1);
}

/// A sip-tcp vserver over `uas`, and a client connection to it with its local address.
fn sip_tcp_client(uas: &TcpUas) -> (fulcrum::proxy::Runtime, TcpStream, std::net::SocketAddr) {
    let (rt, proxy) = common::start_over(
        "sip-tcp",
        "127.0.0.1:0",
        "call_id_hash",
        "",
        &[("s0".to_owned(), uas.addr)],
    );
    let conn = TcpStream::connect(proxy).expect("connect");
    let local = conn.local_addr().expect("addr");
    (rt, conn, local)
}

#[test]
fn a_tcp_request_past_the_line_limit_is_answered_513_and_the_connection_goes_on() {
    let uas = TcpUas::start();
    let (rt, mut conn, local) = sip_tcp_client(&uas);
    let req = stacked_vias("TCP", local, 300, "tcp-loop");
    conn.write_all(req.as_bytes()).expect("write");
    let mut buf = Vec::new();
    let Next::Message(r) = next_message(&mut conn, &mut buf, Duration::from_secs(5)) else {
        panic!("no answer")
    };
    assert_answers_513(&r, req.as_bytes());
    // Content-Length framed it: the connection carries the next request.
    conn.write_all(request("OPTIONS", "after-loop", local, "next").as_bytes())
        .expect("write");
    let Next::Message(r) = next_message(&mut conn, &mut buf, Duration::from_secs(5)) else {
        panic!("no answer to the next request")
    };
    assert_eq!(scan(&r).expect("scans").status_code(), Some(200));
    assert!(uas.methods_of("tcp-loop").is_empty(), "nothing forwarded");
    assert_eq!(
        counter(&rt, |c| c.over_header_limit.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(counter(&rt, |c| c.replies_513.load(Ordering::Relaxed)), 1);
}

#[test]
fn a_tcp_request_past_the_size_limit_is_answered_513_then_closed() {
    let uas = TcpUas::start();
    let (rt, mut conn, local) = sip_tcp_client(&uas);
    let body = "v".repeat(70_000);
    let req = request("INVITE", "too-long", local, "big").replace(
        "Content-Length: 0\r\n\r\n",
        &format!(
            "Content-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    );
    conn.write_all(req.as_bytes()).expect("write");
    let mut buf = Vec::new();
    let Next::Message(r) = next_message(&mut conn, &mut buf, Duration::from_secs(5)) else {
        panic!("no answer")
    };
    assert_answers_513(&r, req.as_bytes());
    // Framing is lost: fulcrum closes the connection after the answer.
    assert!(matches!(
        next_message(&mut conn, &mut buf, Duration::from_secs(5)),
        Next::Closed
    ));
    assert!(uas.methods_of("too-long").is_empty(), "nothing forwarded");
    assert_eq!(
        counter(&rt, |c| c.over_size_limit.load(Ordering::Relaxed)),
        1
    );
    assert_eq!(counter(&rt, |c| c.replies_513.load(Ordering::Relaxed)), 1);
}
