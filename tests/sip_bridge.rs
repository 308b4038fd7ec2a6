//! The transports bridge (docs/sip.md) over loopback: whole calls from a TLS client (and a
//! TCP one) through a stream vserver to strict SIP services over UDP, each of which answers
//! 481 to a BYE for a dialog it did not set up. Each leg speaks its own transport: the
//! services see fulcrum's `Via: SIP/2.0/UDP`, the 200 brings two Record-Route entries (RFC
//! 5658 §3.2: the UDP one toward the service on top, the client leg's below), and a BYE
//! the callee sends over UDP reaches the caller over its TLS connection. The other way: a
//! UDP client through a sip-udp vserver to strict services over TCP and TLS, each reached
//! over its link.

mod common;

use common::sip_tcp::{Next, next_message};
use common::sip_uac::{Uac, UdpStream};
use common::strict_uas::StrictUas;
use common::tls::{
    Ca, addr, client_config, connect, metrics, server_config, service_handshakes, start,
};
use common::*;
use fulcrum::ops::Ops;
use fulcrum::sip;
use std::io::Write;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

const CALLS: usize = 20;

/// A `protocol` vserver `v` (sip-tls with `sip.crt` for `fulcrum.test`, or sip-tcp) over
/// sip-udp services at `services`, record-routing, `extra` for the services' lines.
fn yaml(protocol: &str, services: &[(String, SocketAddr)], extra: &str) -> String {
    let mut y = String::from(
        "admin: { listen: null }\n\
         monitors:\n  - { name: ping, type: sip-options, interval: 500ms, timeout: 500ms, failures_to_down: 1, successes_to_up: 1 }\n\
         services:\n",
    );
    for (name, a) in services {
        y.push_str(&format!(
            "  - {{ name: {name}, address: \"{a}\", protocol: sip-udp{extra} }}\n"
        ));
    }
    let tls = if protocol == "sip-tls" {
        "    tls: { cert: sip.crt, key: sip.key }\n"
    } else {
        ""
    };
    let names: Vec<&str> = services.iter().map(|(n, _)| n.as_str()).collect();
    y.push_str(&format!(
        "vservers:\n  - name: v\n    protocol: {protocol}\n    bind: [\"127.0.0.1:0\"]\n    method: call_id_hash\n    record_route: true\n{tls}    services: [{}]\n",
        names.join(", ")
    ));
    y
}

/// Whole calls over `uac` through vserver `vs` (transport `tp` on the client leg) to `uas`:
/// every call 200/200, two Record-Route entries in RFC 5658 order, no 481, fulcrum's UDP Via
/// at the services.
fn check_calls<S: common::sip_tcp::TimedRead + Write>(
    uac: &mut Uac<S>,
    uas: &[StrictUas],
    vs: SocketAddr,
    tp: &str,
    tag: &str,
) {
    for i in 0..CALLS {
        let call = uac.call(&format!("{tag}-{i}"));
        assert_eq!((call.invite, call.bye), (200, 200), "call {i}: {call:?}");
        let rr = &call.record_route;
        assert_eq!(rr.len(), 2, "double record-route: {call:?}");
        // Top: the UDP leg, toward the service, naming the service (fc-svc).
        assert!(rr[0].starts_with("<sip:127.0.0.1:"), "{rr:?}");
        assert!(!rr[0].contains("transport="), "a UDP entry: {rr:?}");
        assert!(rr[0].contains(";lr;fc-svc="), "{rr:?}");
        assert!(!rr[0].starts_with(&format!("<sip:{vs};")), "{rr:?}");
        // Below: the client leg, the vserver's listener and transport.
        assert_eq!(rr[1], format!("<sip:{vs};transport={tp};lr>"), "{rr:?}");
    }
    let counts: Vec<_> = uas.iter().map(|u| u.counts()).collect();
    assert_eq!(
        counts.iter().map(|c| c.dialogs).sum::<u64>(),
        CALLS as u64,
        "{counts:?}"
    );
    assert_eq!(
        counts.iter().map(|c| c.byes_ok).sum::<u64>(),
        CALLS as u64,
        "{counts:?}"
    );
    assert_eq!(
        counts.iter().map(|c| c.r481).sum::<u64>(),
        0,
        "no misrouted BYE: {counts:?}"
    );
    assert!(
        counts.iter().all(|c| c.dialogs > 0),
        "Call-IDs spread: {counts:?}"
    );
    for u in uas {
        let via = u.last_via().expect("a request reached it");
        assert!(
            via.starts_with("SIP/2.0/UDP 127.0.0.1:"),
            "fulcrum's Via toward a UDP service: {via}"
        );
    }
}

fn uas_pair() -> (Vec<StrictUas>, Vec<(String, SocketAddr)>) {
    let uas: Vec<StrictUas> = (0..2).map(|i| StrictUas::udp(&format!("s{i}"))).collect();
    let services = uas.iter().map(|u| (u.name.clone(), u.addr)).collect();
    (uas, services)
}

fn monitored(ops: &Arc<Ops>, uas: &[StrictUas]) -> Arc<Ops> {
    assert!(
        wait_until(Duration::from_secs(10), || uas
            .iter()
            .all(|u| u.counts().requests > 0)),
        "the sip-options monitors reached both services over UDP"
    );
    Arc::clone(ops)
}

#[test]
fn tls_calls_reach_strict_services_over_udp_with_each_leg_its_transport() {
    let f = ConfigFile::new("sip-bridge-tls", "");
    let ca = Ca::new("fulcrum sip bridge test CA");
    ca.issue(&f, "sip", "fulcrum.test", "fulcrum");
    let (uas, services) = uas_pair();
    f.write(&yaml("sip-tls", &services, ", monitor: ping"));
    let ops = monitored(&start(&f), &uas);
    let vs = addr(&ops, "v");
    let s = connect(vs, &client_config(&ca, None), "fulcrum.test", ANSWER).expect("TLS client");
    let local = s.sock.local_addr().expect("addr");
    let mut uac = Uac::new(s, local, "TLS");
    check_calls(&mut uac, &uas, vs, "tls", "bridge-tls");
    ops.shutdown();
}

#[test]
fn tcp_calls_reach_strict_services_over_udp_with_each_leg_its_transport() {
    let f = ConfigFile::new("sip-bridge-tcp", "");
    let (uas, services) = uas_pair();
    f.write(&yaml("sip-tcp", &services, ", monitor: ping"));
    let ops = monitored(&start(&f), &uas);
    let vs = addr(&ops, "v");
    let s = TcpStream::connect(vs).expect("connect");
    let local = s.local_addr().expect("addr");
    let mut uac = Uac::new(s, local, "TCP");
    check_calls(&mut uac, &uas, vs, "tcp", "bridge-tcp");
    ops.shutdown();
}

/// The values of header `name` in `msg`, in order.
fn values(msg: &[u8], name: &str) -> Vec<String> {
    let m = sip::scan(msg).expect("scans");
    m.headers()
        .filter(|h| h.name.eq_ignore_ascii_case(name.as_bytes()))
        .flat_map(|h| {
            String::from_utf8_lossy(h.value)
                .split(',')
                .map(|v| v.trim().to_owned())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The next SIP message on a UDP socket within `ANSWER`, with its source.
fn recv_udp(sock: &UdpSocket) -> (Vec<u8>, SocketAddr) {
    sock.set_read_timeout(Some(ANSWER)).expect("timeout");
    let mut buf = vec![0u8; 65_536];
    let (n, src) = sock.recv_from(&mut buf).expect("a datagram from fulcrum");
    buf.truncate(n);
    (buf, src)
}

/// A response to `req` with `status`, the request's Vias, From, To (a tag added when
/// `to_tag`), Call-ID and CSeq, and `extra` lines.
fn answer(req: &[u8], status: &str, to_tag: Option<&str>, extra: &str) -> String {
    let m = sip::scan(req).expect("scans");
    let one = |n: &str| values(req, n).join(", ");
    let to = match to_tag {
        Some(t) if m.to_tag().is_none() => format!("{};tag={t}", one("To")),
        _ => one("To"),
    };
    let vias: String = values(req, "Via")
        .iter()
        .map(|v| format!("Via: {v}\r\n"))
        .collect();
    format!(
        "SIP/2.0 {status}\r\n{vias}From: {}\r\nTo: {to}\r\nCall-ID: {}\r\nCSeq: {}\r\n{extra}Content-Length: 0\r\n\r\n",
        one("From"),
        one("Call-ID"),
        one("CSeq")
    )
}

/// The callee hangs up: a BYE it sends over UDP on the route set the 200 set up (Record-Route
/// in order, RFC 3261 §12.1.1) reaches the caller over its TLS connection with fulcrum's TLS
/// Via and no Route left, and the caller's 200 goes back to the callee over UDP.
#[test]
fn a_bye_from_the_udp_callee_reaches_the_tls_caller() {
    let f = ConfigFile::new("sip-bridge-callee-bye", "");
    let ca = Ca::new("fulcrum sip bridge test CA");
    ca.issue(&f, "sip", "fulcrum.test", "fulcrum");
    // A hand-driven callee (no monitor: it answers only what the test makes it answer).
    let callee = UdpSocket::bind("127.0.0.1:0").expect("bind");
    let callee_addr = callee.local_addr().expect("addr");
    f.write(&yaml("sip-tls", &[("c".to_owned(), callee_addr)], ""));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let mut s = connect(vs, &client_config(&ca, None), "fulcrum.test", ANSWER).expect("TLS client");
    let me = s.sock.local_addr().expect("addr");
    let call = "callee-bye-1";
    let invite = format!(
        "INVITE sip:c@fulcrum.test SIP/2.0\r\nVia: SIP/2.0/TLS {me};branch=z9hG4bK-inv;rport\r\nMax-Forwards: 70\r\nFrom: <sip:uac@{me}>;tag=uac1\r\nTo: <sip:c@fulcrum.test>\r\nCall-ID: {call}\r\nCSeq: 1 INVITE\r\nContact: <sip:uac@{me};transport=tls>\r\nContent-Length: 0\r\n\r\n"
    );
    s.write_all(invite.as_bytes()).expect("write");
    let (inv, from) = recv_udp(&callee);
    assert!(
        inv.starts_with(b"INVITE "),
        "{}",
        String::from_utf8_lossy(&inv)
    );
    let rr = values(&inv, "Record-Route");
    assert_eq!(rr.len(), 2, "{rr:?}");
    assert_eq!(rr[1], format!("<sip:{vs};transport=tls;lr>"));
    // fulcrum's UDP leg sent it, and its Via and top Record-Route name that leg.
    assert!(
        rr[0].starts_with(&format!("<sip:{from};lr;fc-svc=")),
        "{rr:?} from {from}"
    );
    assert!(values(&inv, "Via")[0].starts_with(&format!("SIP/2.0/UDP {from};")));
    let rr_lines: String = rr
        .iter()
        .map(|r| format!("Record-Route: {r}\r\n"))
        .collect();
    let ok = answer(
        &inv,
        "200 OK",
        Some("callee1"),
        &format!("{rr_lines}Contact: <sip:c@{callee_addr}>\r\n"),
    );
    callee.send_to(ok.as_bytes(), from).expect("send 200");
    let mut buf = Vec::new();
    // fulcrum holds the INVITE for failover across the bridge too: its 100 comes first.
    let Next::Message(trying) = next_message(&mut s, &mut buf, ANSWER) else {
        panic!("no 100 to the INVITE over TLS")
    };
    assert!(
        trying.starts_with(b"SIP/2.0 100 Trying"),
        "{}",
        String::from_utf8_lossy(&trying)
    );
    let Next::Message(got) = next_message(&mut s, &mut buf, ANSWER) else {
        panic!("no 200 to the INVITE over TLS")
    };
    let got_rr = values(&got, "Record-Route");
    assert_eq!(got_rr, rr, "{}", String::from_utf8_lossy(&got));
    // The callee's BYE: Route = Record-Route in order, toward the caller's Contact.
    let routes: String = rr.iter().map(|r| format!("Route: {r}\r\n")).collect();
    let bye = format!(
        "BYE sip:uac@{me};transport=tls SIP/2.0\r\nVia: SIP/2.0/UDP {callee_addr};branch=z9hG4bK-callee-bye\r\n{routes}Max-Forwards: 70\r\nFrom: <sip:c@fulcrum.test>;tag=callee1\r\nTo: <sip:uac@{me}>;tag=uac1\r\nCall-ID: {call}\r\nCSeq: 1 BYE\r\nContent-Length: 0\r\n\r\n"
    );
    callee.send_to(bye.as_bytes(), from).expect("send BYE");
    let mut got_bye = None;
    while let Next::Message(m) = next_message(&mut s, &mut buf, ANSWER) {
        if m.starts_with(b"BYE ") {
            got_bye = Some(m);
            break;
        }
    }
    let got_bye = got_bye.expect("the callee's BYE over TLS");
    let vias = values(&got_bye, "Via");
    assert!(
        vias[0].starts_with(&format!("SIP/2.0/TLS {vs};branch=z9hG4bK-fc-")),
        "{vias:?}"
    );
    assert!(
        values(&got_bye, "Route").is_empty(),
        "both of fulcrum's Route entries removed: {}",
        String::from_utf8_lossy(&got_bye)
    );
    s.write_all(answer(&got_bye, "200 OK", None, "").as_bytes())
        .expect("write 200");
    let (ok_bye, _) = recv_udp(&callee);
    let text = String::from_utf8_lossy(&ok_bye).into_owned();
    assert!(text.starts_with("SIP/2.0 200 OK"), "{text}");
    assert!(text.contains("CSeq: 1 BYE"), "{text}");
    assert_eq!(
        values(&ok_bye, "Via").len(),
        1,
        "fulcrum's Via removed: {text}"
    );
    ops.shutdown();
}

// The other direction: a sip-udp vserver over stream services.

/// A UDP client as a stream for [`Uac`]: connected to the vserver, one datagram per write,
/// each datagram read is one whole message (fulcrum answers from the address it was sent to,
/// so the connected socket takes it).
fn udp_uac(vs: SocketAddr) -> Uac<UdpStream> {
    let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
    s.connect(vs).expect("connect");
    let local = s.local_addr().expect("addr");
    Uac::new(UdpStream(s), local, "UDP")
}

/// A sip-udp vserver `v` over `services` (name, address, protocol), record-routing; a
/// sip-tls service is checked against `ca.crt` for `uas.test`.
fn udp_yaml(services: &[(&str, SocketAddr, &str)]) -> String {
    let mut y = String::from("admin: { listen: null }\nservices:\n");
    for (name, a, protocol) in services {
        let tls = if *protocol == "sip-tls" {
            ", tls: { ca: ca.crt, server_name: uas.test }"
        } else {
            ""
        };
        y.push_str(&format!(
            "  - {{ name: {name}, address: \"{a}\", protocol: {protocol}{tls} }}\n"
        ));
    }
    let names: Vec<&str> = services.iter().map(|s| s.0).collect();
    y.push_str(&format!(
        "vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [\"127.0.0.1:0\"]\n    method: call_id_hash\n    record_route: true\n    services: [{}]\n",
        names.join(", ")
    ));
    y
}

/// Strict services `s0` over TCP and `s1` over TLS, whose certificate comes from a CA written
/// to `f`'s directory as `ca.crt` (the file the services' `tls` names).
fn stream_services(f: &ConfigFile) -> (StrictUas, StrictUas) {
    let ca = Ca::new("fulcrum sip bridge test CA");
    ca.write(f, "ca.crt");
    let uas_cert = ca.issue(f, "uas", "uas.test", "uas");
    let tcp = StrictUas::tcp("s0");
    let tls = StrictUas::tls_at(
        "s1",
        SocketAddr::from(([127, 0, 0, 1], 0)),
        server_config(&uas_cert),
    );
    (tcp, tls)
}

/// Whole calls from a UDP client through vserver `vs` to stream services: every call
/// 200/200, the 200's Record-Route the service leg's entry (its transport, `fc-svc`) over the
/// client leg's (the vserver's UDP address), no 481. Returns how many calls went over each
/// of `tcp` and `tls`.
fn check_udp_calls(uac: &mut Uac<UdpStream>, vs: SocketAddr, tag: &str) -> (usize, usize) {
    let (mut tcp, mut tls) = (0, 0);
    for i in 0..CALLS {
        let call = uac.call(&format!("{tag}-{i}"));
        assert_eq!((call.invite, call.bye), (200, 200), "call {i}: {call:?}");
        let rr = &call.record_route;
        assert_eq!(rr.len(), 2, "double record-route: {call:?}");
        if rr[0].starts_with(&format!("<sip:{vs};transport=tcp;lr;fc-svc=")) {
            tcp += 1;
        } else if rr[0].starts_with(&format!("<sip:{vs};transport=tls;lr;fc-svc=")) {
            tls += 1;
        } else {
            panic!("the service leg's entry on top: {rr:?}");
        }
        assert_eq!(
            rr[1],
            format!("<sip:{vs};lr>"),
            "the client leg's below: {rr:?}"
        );
    }
    (tcp, tls)
}

fn assert_no_481(uas: &[&StrictUas]) {
    for u in uas {
        let c = u.counts();
        assert_eq!(c.r481, 0, "no misrouted BYE at {}: {c:?}", u.name);
        assert_eq!(
            c.dialogs, c.byes_ok,
            "every dialog ended at {}: {c:?}",
            u.name
        );
    }
}

#[test]
fn udp_calls_reach_strict_services_over_tcp_and_tls() {
    let f = ConfigFile::new("sip-bridge-udp-streams", "");
    let (tcp, tls) = stream_services(&f);
    f.write(&udp_yaml(&[
        ("s0", tcp.addr, "sip-tcp"),
        ("s1", tls.addr, "sip-tls"),
    ]));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let mut uac = udp_uac(vs);
    let (over_tcp, over_tls) = check_udp_calls(&mut uac, vs, "udp-streams");
    assert_eq!(
        (over_tcp as u64, over_tls as u64),
        (tcp.counts().dialogs, tls.counts().dialogs),
        "each Record-Route names the transport of the service that took the call"
    );
    assert!(
        over_tcp > 0 && over_tls > 0,
        "Call-IDs spread: {over_tcp} / {over_tls}"
    );
    assert_no_481(&[&tcp, &tls]);
    let via = tcp.last_via().expect("a request reached s0");
    assert!(via.starts_with(&format!("SIP/2.0/TCP {vs};")), "{via}");
    let via = tls.last_via().expect("a request reached s1");
    assert!(via.starts_with(&format!("SIP/2.0/TLS {vs};")), "{via}");
    // The bridge's link to s1 counts its handshakes; s0 is reached without TLS.
    let m = metrics(&ops);
    let h = service_handshakes(&m, "v", "s1").expect("s1's handshakes");
    assert!(h.completed >= Some(1) && h.failed_total() == 0, "{m}");
    assert_eq!(service_handshakes(&m, "v", "s0"), None, "{m}");
    ops.shutdown();
}

fn health_of(ops: &Ops, m: usize) -> Option<fulcrum::balancer::Health> {
    ops.with_vservers(|vs, _| {
        vs.iter()
            .find(|v| v.name == "v")
            .map(|v| v.balancer().health(m))
    })
    .flatten()
    .flatten()
}

/// A stream service that refuses connections is marked DOWN by its link, and every call,
/// the ones that were on their way to it too, goes to the other.
#[test]
fn a_stream_service_that_refuses_connections_is_down_and_calls_go_to_the_other() {
    let f = ConfigFile::new("sip-bridge-udp-refused", "");
    let tcp = StrictUas::tcp("s0");
    let refused = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    f.write(&udp_yaml(&[
        ("s0", tcp.addr, "sip-tcp"),
        ("s1", refused, "sip-tcp"),
    ]));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let mut uac = udp_uac(vs);
    let (over_tcp, _) = check_udp_calls(&mut uac, vs, "udp-refused");
    assert_eq!(over_tcp, CALLS);
    assert_eq!(tcp.counts().dialogs, CALLS as u64);
    assert_no_481(&[&tcp]);
    assert_eq!(health_of(&ops, 1), Some(fulcrum::balancer::Health::Down));
    assert_eq!(health_of(&ops, 0), Some(fulcrum::balancer::Health::Up));
    let failures = ops
        .with_vservers(|vs, _| {
            vs.iter()
                .find_map(|v| v.path::<fulcrum::proxy::SipUdpPath>()?.bridge())
                .map(|b| b.counters.service_connect_failures.load(Ordering::Relaxed))
        })
        .flatten();
    assert!(failures.is_some_and(|n| n > 0), "counted: {failures:?}");
    ops.shutdown();
}

/// Reloads of a sip-udp vserver with stream services: one that adds a stream service gives
/// it a link (calls reach it); one that gives a plain sip-udp vserver its first stream
/// service is refused, and that vserver keeps working.
#[test]
fn reloads_add_stream_services_to_a_bridged_sip_udp_vserver_and_refuse_the_first() {
    let f = ConfigFile::new("sip-bridge-udp-reload", "");
    let (tcp, tls) = stream_services(&f);
    f.write(&udp_yaml(&[("s0", tcp.addr, "sip-tcp")]));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let mut uac = udp_uac(vs);
    assert_eq!(check_udp_calls(&mut uac, vs, "before"), (CALLS, 0));
    f.write(&udp_yaml(&[
        ("s0", tcp.addr, "sip-tcp"),
        ("s1", tls.addr, "sip-tls"),
    ]));
    ops.reload().expect("a stream service added");
    let (over_tcp, over_tls) = check_udp_calls(&mut uac, vs, "after");
    assert!(over_tcp > 0 && over_tls > 0, "{over_tcp} / {over_tls}");
    assert_eq!(tls.counts().dialogs, over_tls as u64);
    assert_no_481(&[&tcp, &tls]);
    ops.shutdown();

    // A plain sip-udp vserver: its first stream service needs a restart.
    let g = ConfigFile::new("sip-bridge-udp-reload-first", "");
    let udp = StrictUas::udp("u0");
    g.write(&udp_yaml(&[("u0", udp.addr, "sip-udp")]));
    let ops = start(&g);
    g.write(&udp_yaml(&[
        ("u0", udp.addr, "sip-udp"),
        ("s0", tcp.addr, "sip-tcp"),
    ]));
    let e = ops.reload().expect_err("refused");
    assert!(e.to_string().contains("needs a restart"), "{e}");
    let vs = addr(&ops, "v");
    let mut uac = udp_uac(vs);
    let call = uac.call("after-refusal");
    assert_eq!((call.invite, call.bye), (200, 200), "{call:?}");
    let rr = &call.record_route;
    assert_eq!(rr.len(), 1, "one transport, one entry: {rr:?}");
    assert!(
        rr[0].starts_with(&format!("<sip:{vs};lr;fc-svc=")),
        "{rr:?}"
    );
    ops.shutdown();
}

/// The callee over TCP hangs up: its BYE on the connection fulcrum opened, on the route set
/// the 200 set up, reaches the UDP caller as a datagram from the vserver's address with
/// fulcrum's UDP Via and no Route left, and the caller's 200 goes back on that connection.
#[test]
fn a_bye_from_the_tcp_callee_reaches_the_udp_caller() {
    let f = ConfigFile::new("sip-bridge-udp-callee-bye", "");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let callee_addr = listener.local_addr().expect("addr");
    f.write(&udp_yaml(&[("c", callee_addr, "sip-tcp")]));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let caller = UdpSocket::bind("127.0.0.1:0").expect("bind");
    let me = caller.local_addr().expect("addr");
    let call = "udp-callee-bye-1";
    let invite = format!(
        "INVITE sip:c@fulcrum.test SIP/2.0\r\nVia: SIP/2.0/UDP {me};branch=z9hG4bK-inv;rport\r\nMax-Forwards: 70\r\nFrom: <sip:uac@{me}>;tag=uac1\r\nTo: <sip:c@fulcrum.test>\r\nCall-ID: {call}\r\nCSeq: 1 INVITE\r\nContact: <sip:uac@{me}>\r\nContent-Length: 0\r\n\r\n"
    );
    caller.send_to(invite.as_bytes(), vs).expect("send INVITE");
    let (mut link, _) = listener.accept().expect("fulcrum's link");
    let mut buf = Vec::new();
    let Next::Message(inv) = next_message(&mut link, &mut buf, ANSWER) else {
        panic!("no INVITE on the link")
    };
    assert!(
        values(&inv, "Via")[0].starts_with(&format!("SIP/2.0/TCP {vs};")),
        "{}",
        String::from_utf8_lossy(&inv)
    );
    let rr = values(&inv, "Record-Route");
    assert_eq!(rr.len(), 2, "{rr:?}");
    assert!(
        rr[0].starts_with(&format!("<sip:{vs};transport=tcp;lr;fc-svc=")),
        "{rr:?}"
    );
    assert_eq!(rr[1], format!("<sip:{vs};lr>"));
    let rr_lines: String = rr
        .iter()
        .map(|r| format!("Record-Route: {r}\r\n"))
        .collect();
    let ok = answer(
        &inv,
        "200 OK",
        Some("callee1"),
        &format!("{rr_lines}Contact: <sip:c@{callee_addr};transport=tcp>\r\n"),
    );
    link.write_all(ok.as_bytes()).expect("write 200");
    // fulcrum holds the INVITE for failover across the bridge too: its 100 comes first.
    let (trying, _) = recv_udp(&caller);
    assert!(
        trying.starts_with(b"SIP/2.0 100 Trying"),
        "{}",
        String::from_utf8_lossy(&trying)
    );
    let (got, from) = recv_udp(&caller);
    assert_eq!(
        from, vs,
        "the answer comes from the address the caller sent to"
    );
    assert!(
        got.starts_with(b"SIP/2.0 200 OK"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    assert_eq!(values(&got, "Record-Route"), rr);
    assert_eq!(values(&got, "Via").len(), 1, "fulcrum's Via removed");
    // The callee's BYE: Route = Record-Route in order, toward the caller's Contact.
    let routes: String = rr.iter().map(|r| format!("Route: {r}\r\n")).collect();
    let bye = format!(
        "BYE sip:uac@{me} SIP/2.0\r\nVia: SIP/2.0/TCP {callee_addr};branch=z9hG4bK-callee-bye\r\n{routes}Max-Forwards: 70\r\nFrom: <sip:c@fulcrum.test>;tag=callee1\r\nTo: <sip:uac@{me}>;tag=uac1\r\nCall-ID: {call}\r\nCSeq: 1 BYE\r\nContent-Length: 0\r\n\r\n"
    );
    link.write_all(bye.as_bytes()).expect("write BYE");
    let (got_bye, from) = recv_udp(&caller);
    assert_eq!(from, vs);
    assert!(
        got_bye.starts_with(b"BYE "),
        "{}",
        String::from_utf8_lossy(&got_bye)
    );
    let vias = values(&got_bye, "Via");
    assert!(
        vias[0].starts_with(&format!("SIP/2.0/UDP {vs};branch=z9hG4bK-fc-")),
        "{vias:?}"
    );
    assert!(
        values(&got_bye, "Route").is_empty(),
        "both of fulcrum's Route entries removed: {}",
        String::from_utf8_lossy(&got_bye)
    );
    caller
        .send_to(answer(&got_bye, "200 OK", None, "").as_bytes(), vs)
        .expect("send 200");
    let Next::Message(ok_bye) = next_message(&mut link, &mut buf, ANSWER) else {
        panic!("no 200 to the BYE on the link")
    };
    let text = String::from_utf8_lossy(&ok_bye).into_owned();
    assert!(text.starts_with("SIP/2.0 200 OK"), "{text}");
    assert!(text.contains("CSeq: 1 BYE"), "{text}");
    assert_eq!(
        values(&ok_bye, "Via").len(),
        1,
        "fulcrum's Via removed: {text}"
    );
    ops.shutdown();
}
