//! Socket-level tests of the sip-udp vserver: fulcrum runs in-process (`Runtime::start` on
//! port 0) between a test UAC socket and test UAS sockets on loopback. Every message is
//! written as raw SIP text so that each assertion names the exact bytes that matter.
//! Synchronisation is by socket reads with timeouts; "nothing was forwarded" is proven by a
//! marker message sent afterwards arriving first.

mod common;

use fulcrum::balancer::{Health, KeyInput};
use fulcrum::config;
use fulcrum::core::sip::SipCore;
use fulcrum::hash;
use fulcrum::proxy::SipUdpPath;
use fulcrum::proxy::{Runtime, VserverHandle};
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Upper bound of any single wait for a datagram that must arrive.
const WAIT: Duration = Duration::from_secs(3);

struct Lab {
    rt: Runtime,
    proxy: SocketAddr,
    services: Vec<UdpSocket>,
    client: UdpSocket,
}

fn sock(ip: &str) -> UdpSocket {
    let s = UdpSocket::bind(format!("{ip}:0")).expect("bind test socket");
    s.set_read_timeout(Some(WAIT)).expect("read timeout");
    s
}

fn addr(s: &UdpSocket) -> SocketAddr {
    s.local_addr().expect("local addr")
}

/// Host:port as written in SIP (IPv6 in brackets).
fn hp(a: SocketAddr) -> String {
    match a {
        SocketAddr::V4(v) => v.to_string(),
        SocketAddr::V6(v) => format!("[{}]:{}", v.ip(), v.port()),
    }
}

impl Lab {
    fn start(n: usize, method: &str, record_route: bool) -> Lab {
        Lab::start_on("127.0.0.1", n, method, record_route)
    }

    /// The stateless proxy (`failover: off`): these tests read each datagram fulcrum sends,
    /// and a held request adds fulcrum's 100 and its retransmissions (tests/failover.rs).
    fn start_on(ip: &str, n: usize, method: &str, record_route: bool) -> Lab {
        Lab::start_with(ip, n, method, record_route, "")
    }

    /// [`Lab::start_on`] with more settings of the vserver (`extra`: YAML lines, indented).
    fn start_with(ip: &str, n: usize, method: &str, record_route: bool, extra: &str) -> Lab {
        let services: Vec<UdpSocket> = (0..n).map(|_| sock(ip)).collect();
        let mut y = String::from("admin: { listen: null }\nservices:\n");
        for (i, s) in services.iter().enumerate() {
            y.push_str(&format!(
                "  - {{ name: s{i}, address: \"{}\", protocol: sip-udp }}\n",
                hp(addr(s))
            ));
        }
        let names: Vec<String> = (0..n).map(|i| format!("s{i}")).collect();
        let bind = if ip.contains(':') {
            format!("\"[{ip}]:0\"")
        } else {
            format!("\"{ip}:0\"")
        };
        y.push_str(&format!(
            "vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [{bind}]\n    method: {method}\n    record_route: {record_route}\n    workers: 2\n    failover: off\n{extra}    services: [{}]\n",
            names.join(", ")
        ));
        let cfg = config::from_str("test.yaml", &y).expect("config");
        let rt = Runtime::start(&cfg).expect("runtime");
        let proxy = rt.vserver("v").expect("vserver").bound[0];
        Lab {
            rt,
            proxy,
            services,
            client: sock(ip),
        }
    }

    /// Where the service saw `req` come from: fulcrum's Via sent-by (its address toward the
    /// services).
    fn proxy_seen_by_service(&self, req: &str) -> SocketAddr {
        let via = header(req, "Via");
        let sent_by = via
            .strip_prefix("SIP/2.0/UDP ")
            .and_then(|v| v.split(';').next())
            .unwrap_or_else(|| panic!("no sent-by in {via}"));
        sent_by
            .parse()
            .unwrap_or_else(|_| panic!("sent-by {sent_by}"))
    }

    fn vs(&self) -> &VserverHandle {
        self.rt.vserver("v").expect("vserver")
    }

    fn core(&self) -> Arc<SipCore> {
        let v = self.vs();
        match v.path::<SipUdpPath>() {
            Some(p) => Arc::clone(p.core()),
            None => panic!("not a sip-udp vserver: {:?}", v.data),
        }
    }

    fn send(&self, text: &str) {
        self.client
            .send_to(text.as_bytes(), self.proxy)
            .expect("client send");
    }

    fn send_from_service(&self, i: usize, text: &str) {
        self.services[i]
            .send_to(text.as_bytes(), self.proxy)
            .expect("service send");
    }

    fn client_recv(&self) -> String {
        recv(&self.client).expect("client: nothing received")
    }

    fn service_recv(&self, i: usize) -> String {
        recv(&self.services[i]).expect("service: nothing received")
    }

    /// The first message any service receives, and which service got it.
    fn any_service_recv(&self) -> (usize, String) {
        let deadline = Instant::now() + WAIT;
        let mut buf = vec![0u8; 65_536];
        let tick = Some(Duration::from_millis(2));
        for s in &self.services {
            s.set_read_timeout(tick).expect("read timeout");
        }
        let got = loop {
            if let Some(r) = self.services.iter().enumerate().find_map(|(i, s)| {
                s.recv_from(&mut buf)
                    .ok()
                    .map(|(n, _)| (i, String::from_utf8_lossy(&buf[..n]).into_owned()))
            }) {
                break Some(r);
            }
            if Instant::now() > deadline {
                break None;
            }
        };
        for s in &self.services {
            s.set_read_timeout(Some(WAIT)).expect("read timeout");
        }
        got.expect("no service received anything")
    }
}

fn recv(s: &UdpSocket) -> Option<String> {
    let mut buf = vec![0u8; 65_536];
    s.recv_from(&mut buf)
        .ok()
        .map(|(n, _)| String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// All values of header `name` (full name, case-insensitive), in order.
fn headers<'a>(msg: &'a str, name: &str) -> Vec<&'a str> {
    msg.split("\r\n")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .filter(|(n, _)| n.trim().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim())
        .collect()
}

fn header<'a>(msg: &'a str, name: &str) -> &'a str {
    headers(msg, name)
        .first()
        .copied()
        .unwrap_or_else(|| panic!("no {name} in\n{msg}"))
}

fn first_line(msg: &str) -> &str {
    msg.split("\r\n").next().unwrap_or("")
}

fn branch_of(via: &str) -> &str {
    via.split(';')
        .find_map(|p| p.trim().strip_prefix("branch="))
        .unwrap_or_else(|| panic!("no branch in {via}"))
}

/// A request from the test UAC. `via` is the sent-by and parameters after the branch.
fn request(
    method: &str,
    uri: &str,
    via_host: &str,
    branch: &str,
    call_id: &str,
    cseq: &str,
) -> String {
    format!(
        "{method} {uri} SIP/2.0\r\n\
         Via: SIP/2.0/UDP {via_host};branch={branch};rport\r\n\
         Max-Forwards: 70\r\n\
         From: <sip:alice@example.com>;tag=a1\r\n\
         To: <sip:bob@example.com>\r\n\
         Call-ID: {call_id}\r\n\
         CSeq: {cseq}\r\n\
         Contact: <sip:alice@{via_host}>\r\n\
         Content-Length: 0\r\n\r\n"
    )
}

fn invite(lab: &Lab, branch: &str, call_id: &str) -> String {
    request(
        "INVITE",
        "sip:bob@example.com",
        &hp(addr(&lab.client)),
        branch,
        call_id,
        "1 INVITE",
    )
}

/// A response a UAS builds for `req`: every Via copied in order, a to-tag added.
fn response_to(req: &str, status: &str) -> String {
    let mut out = format!("SIP/2.0 {status}\r\n");
    for v in headers(req, "Via") {
        out.push_str(&format!("Via: {v}\r\n"));
    }
    out.push_str(&format!("From: {}\r\n", header(req, "From")));
    out.push_str(&format!("To: {};tag=b1\r\n", header(req, "To")));
    out.push_str(&format!("Call-ID: {}\r\n", header(req, "Call-ID")));
    out.push_str(&format!("CSeq: {}\r\n", header(req, "CSeq")));
    out.push_str("Content-Length: 0\r\n\r\n");
    out
}

#[test]
fn request_gets_our_via_rport_received_and_max_forwards() {
    let lab = Lab::start(1, "call_id_hash", false);
    // Sent-by differs from the real source and rport is requested (RFC 3581 §4).
    let req = request(
        "INVITE",
        "sip:bob@example.com",
        "192.0.2.7:5999",
        "z9hG4bKc1",
        "via-1@test",
        "1 INVITE",
    );
    lab.send(&req);
    let got = lab.service_recv(0);
    let vias = headers(&got, "Via");
    assert_eq!(vias.len(), 2, "{got}");
    let ours = format!("SIP/2.0/UDP {};branch=z9hG4bK", hp(lab.proxy));
    assert!(vias[0].starts_with(&ours), "top Via {}", vias[0]);
    let client = addr(&lab.client);
    assert!(vias[1].starts_with("SIP/2.0/UDP 192.0.2.7:5999;branch=z9hG4bKc1"));
    assert!(
        vias[1].contains(&format!("rport={}", client.port())),
        "{}",
        vias[1]
    );
    assert!(vias[1].contains("received=127.0.0.1"), "{}", vias[1]);
    assert_eq!(header(&got, "Max-Forwards"), "69");
    assert_eq!(first_line(&got), "INVITE sip:bob@example.com SIP/2.0");
    assert!(headers(&got, "Record-Route").is_empty());

    // The response follows received/rport, not the (unreachable) sent-by.
    lab.send_from_service(0, &response_to(&got, "180 Ringing"));
    let back = lab.client_recv();
    assert_eq!(first_line(&back), "SIP/2.0 180 Ringing");
    let vias = headers(&back, "Via");
    assert_eq!(vias.len(), 1, "fulcrum's Via must be removed: {back}");
    assert!(vias[0].starts_with("SIP/2.0/UDP 192.0.2.7:5999;branch=z9hG4bKc1"));
}

#[test]
fn no_rport_same_host_adds_nothing_and_missing_max_forwards_is_added() {
    let lab = Lab::start(1, "call_id_hash", false);
    let me = hp(addr(&lab.client));
    let req = format!(
        "OPTIONS sip:bob@example.com SIP/2.0\r\nVia: SIP/2.0/UDP {me};branch=z9hG4bKo1\r\n\
         From: <sip:a@x>;tag=1\r\nTo: <sip:b@x>\r\nCall-ID: opt-1@test\r\nCSeq: 1 OPTIONS\r\n\
         Content-Length: 0\r\n\r\n"
    );
    lab.send(&req);
    let got = lab.service_recv(0);
    let vias = headers(&got, "Via");
    assert_eq!(vias[1], format!("SIP/2.0/UDP {me};branch=z9hG4bKo1"));
    assert_eq!(header(&got, "Max-Forwards"), "70");
}

#[test]
fn branch_is_deterministic_for_retransmission_cancel_and_non_2xx_ack() {
    let lab = Lab::start(3, "call_id_hash", false);
    let inv = invite(&lab, "z9hG4bKdet1", "det-1@test");
    lab.send(&inv);
    let (svc, first) = lab.any_service_recv();
    let b1 = branch_of(headers(&first, "Via")[0]).to_owned();
    assert!(b1.starts_with("z9hG4bK"), "{b1}");

    lab.send(&inv); // retransmission
    let again = lab.service_recv(svc);
    assert_eq!(branch_of(headers(&again, "Via")[0]), b1);

    let cancel = request(
        "CANCEL",
        "sip:bob@example.com",
        &hp(addr(&lab.client)),
        "z9hG4bKdet1",
        "det-1@test",
        "1 CANCEL",
    );
    lab.send(&cancel);
    let (csvc, c) = lab.any_service_recv();
    assert_eq!(csvc, svc, "CANCEL must reach the INVITE's service");
    assert!(first_line(&c).starts_with("CANCEL "));
    assert_eq!(
        branch_of(headers(&c, "Via")[0]),
        b1,
        "CANCEL gets the INVITE's branch"
    );

    // 200 to the CANCEL and 487 to the INVITE go back to the client.
    lab.send_from_service(svc, &response_to(&c, "200 OK"));
    assert!(header(&lab.client_recv(), "CSeq").ends_with("CANCEL"));
    lab.send_from_service(svc, &response_to(&first, "487 Request Terminated"));
    let r487 = lab.client_recv();
    assert_eq!(first_line(&r487), "SIP/2.0 487 Request Terminated");

    // ACK for a non-2xx: same branch as the INVITE (RFC 3261 §17.1.1.3), same service.
    let ack = request(
        "ACK",
        "sip:bob@example.com",
        &hp(addr(&lab.client)),
        "z9hG4bKdet1",
        "det-1@test",
        "1 ACK",
    )
    .replace(
        "To: <sip:bob@example.com>",
        "To: <sip:bob@example.com>;tag=b1",
    );
    lab.send(&ack);
    let (asvc, a) = lab.any_service_recv();
    assert_eq!(asvc, svc, "non-2xx ACK must reach the INVITE's service");
    assert!(first_line(&a).starts_with("ACK "));
    assert_eq!(branch_of(headers(&a, "Via")[0]), b1);

    // A different transaction gets a different branch.
    lab.send(&invite(&lab, "z9hG4bKdet2", "det-1@test").replace("1 INVITE", "2 INVITE"));
    let (_, other) = lab.any_service_recv();
    assert_ne!(branch_of(headers(&other, "Via")[0]), b1);
}

#[test]
fn cancel_and_ack_follow_invite_for_many_calls() {
    cancel_and_ack_follow_invite("call_id_hash");
}

/// Without a hash the dialog table alone must hold CANCEL and the non-2xx ACK on the
/// INVITE's service (round robin would otherwise move each request).
#[test]
fn cancel_and_ack_follow_invite_with_round_robin() {
    cancel_and_ack_follow_invite("round_robin");
}

fn cancel_and_ack_follow_invite(method: &str) {
    let lab = Lab::start(3, method, false);
    let me = hp(addr(&lab.client));
    let mut used = [0usize; 3];
    for i in 0..30 {
        let cid = format!("many-{i}@test");
        let br = format!("z9hG4bKm{i}");
        lab.send(&invite(&lab, &br, &cid));
        let (svc, inv) = lab.any_service_recv();
        used[svc] += 1;
        lab.send(&request(
            "CANCEL",
            "sip:bob@example.com",
            &me,
            &br,
            &cid,
            "1 CANCEL",
        ));
        let (csvc, _) = lab.any_service_recv();
        assert_eq!(csvc, svc, "{cid}: CANCEL moved");
        lab.send_from_service(svc, &response_to(&inv, "487 Request Terminated"));
        assert!(lab.client_recv().starts_with("SIP/2.0 487"));
        lab.send(&request(
            "ACK",
            "sip:bob@example.com",
            &me,
            &br,
            &cid,
            "1 ACK",
        ));
        let (asvc, _) = lab.any_service_recv();
        assert_eq!(asvc, svc, "{cid}: ACK moved");
    }
    assert!(
        used.iter().all(|&n| n > 0),
        "30 Call-IDs all on some services: {used:?}"
    );
}

#[test]
fn max_forwards_zero_is_answered_483_and_not_forwarded() {
    let lab = Lab::start(1, "call_id_hash", false);
    let req = invite(&lab, "z9hG4bKmf0", "mf0@test").replace("Max-Forwards: 70", "Max-Forwards: 0");
    lab.send(&req);
    let r = lab.client_recv();
    assert_eq!(first_line(&r), "SIP/2.0 483 Too Many Hops");
    assert_eq!(header(&r, "Call-ID"), "mf0@test");
    assert!(header(&r, "Via").contains("branch=z9hG4bKmf0"));
    // Max-Forwards 1 is forwarded with 0.
    lab.send(
        &invite(&lab, "z9hG4bKmf1", "mf1@test").replace("Max-Forwards: 70", "Max-Forwards: 1"),
    );
    let got = lab.service_recv(0);
    assert_eq!(
        header(&got, "Call-ID"),
        "mf1@test",
        "the 483'd request was forwarded"
    );
    assert_eq!(header(&got, "Max-Forwards"), "0");
    assert_eq!(lab.core().counters.replies_483.load(Ordering::Relaxed), 1);
}

#[test]
fn every_service_down_is_answered_503_with_retry_after() {
    let lab = Lab::start(2, "call_id_hash", false);
    assert_eq!(lab.rt.set_health("s0", Health::Down), 1);
    assert_eq!(lab.rt.set_health("s1", Health::Down), 1);
    lab.send(&invite(&lab, "z9hG4bKd1", "down-1@test"));
    let r = lab.client_recv();
    assert_eq!(first_line(&r), "SIP/2.0 503 Service Unavailable");
    let ra: u32 = header(&r, "Retry-After")
        .parse()
        .expect("Retry-After is a number");
    assert!(ra > 0);
    assert!(
        header(&r, "To").contains(";tag="),
        "a final response carries a To tag"
    );
    // One service back: traffic flows again.
    lab.rt.set_health("s1", Health::Up);
    lab.send(&invite(&lab, "z9hG4bKd2", "down-2@test"));
    assert_eq!(header(&lab.service_recv(1), "Call-ID"), "down-2@test");
}

/// `rr` is fulcrum's Record-Route value at `proxy`, naming the chosen service by its digest
/// (`;fc-svc=` and 16 hex digits), and on a dialog-creating request the client's flow
/// (`;fc-flow=`, docs/sip.md "Path and flow tokens").
fn assert_ours_naming_a_service(rr: &str, proxy: SocketAddr) {
    let prefix = format!("<sip:{};lr;fc-svc=", hp(proxy));
    let params = rr
        .strip_prefix(&prefix)
        .and_then(|r| r.strip_suffix('>'))
        .unwrap_or_else(|| panic!("{rr}"));
    let digest = match params.split_once(";fc-flow=") {
        Some((d, token)) => {
            assert!(
                !token.is_empty() && token.bytes().all(|c| c.is_ascii_hexdigit()),
                "{rr}"
            );
            d
        }
        None => params,
    };
    assert!(
        digest.len() == 16 && digest.bytes().all(|c| c.is_ascii_hexdigit()),
        "{rr}"
    );
}

#[test]
fn record_route_added_when_configured() {
    let lab = Lab::start(1, "call_id_hash", true);
    lab.send(&invite(&lab, "z9hG4bKrr", "rr@test"));
    let got = lab.service_recv(0);
    let rr = headers(&got, "Record-Route");
    assert_eq!(rr.len(), 1, "{rr:?}");
    assert_ours_naming_a_service(rr[0], lab.proxy);
}

#[test]
fn response_whose_top_via_is_not_ours_is_dropped() {
    let lab = Lab::start(1, "call_id_hash", false);
    lab.send(&invite(&lab, "z9hG4bKno", "notours@test"));
    let got = lab.service_recv(0);
    // The service strips fulcrum's Via itself (or forges one): not ours, dropped.
    let mut forged = response_to(&got, "200 OK");
    let our_via = format!("Via: {}\r\n", headers(&got, "Via")[0]);
    forged = forged.replacen(&our_via, "", 1);
    lab.send_from_service(0, &forged);
    let foreign = response_to(&got, "486 Busy Here").replacen(
        &our_via,
        &format!(
            "Via: SIP/2.0/UDP {};branch=z9hG4bKforeign\r\n",
            hp(lab.proxy)
        ),
        1,
    );
    lab.send_from_service(0, &foreign);
    // Marker: the genuine response arrives first.
    lab.send_from_service(0, &response_to(&got, "180 Ringing"));
    assert_eq!(first_line(&lab.client_recv()), "SIP/2.0 180 Ringing");
    assert_eq!(lab.core().counters.not_ours.load(Ordering::Relaxed), 2);
}

#[test]
fn in_dialog_request_from_service_is_routed_to_the_client() {
    let lab = Lab::start(1, "call_id_hash", true);
    let client = addr(&lab.client);
    let svc = addr(&lab.services[0]);
    lab.send(&invite(&lab, "z9hG4bKdlg", "dlg@test"));
    let _ = lab.service_recv(0);
    // BYE from the callee: Route = the Record-Route it saw (fulcrum), R-URI = the caller's Contact.
    let bye = format!(
        "BYE sip:alice@{c} SIP/2.0\r\n\
         Via: SIP/2.0/UDP {s};branch=z9hG4bKbye1;rport\r\n\
         Max-Forwards: 70\r\n\
         Route: <sip:{p};lr>\r\n\
         From: <sip:bob@example.com>;tag=b1\r\n\
         To: <sip:alice@example.com>;tag=a1\r\n\
         Call-ID: dlg@test\r\nCSeq: 1 BYE\r\nContent-Length: 0\r\n\r\n",
        c = hp(client),
        s = hp(svc),
        p = hp(lab.proxy)
    );
    lab.send_from_service(0, &bye);
    let got = lab.client_recv();
    assert_eq!(
        first_line(&got),
        format!("BYE sip:alice@{} SIP/2.0", hp(client))
    );
    assert!(
        headers(&got, "Route").is_empty(),
        "our Route value is removed: {got}"
    );
    let vias = headers(&got, "Via");
    assert_eq!(vias.len(), 2);
    assert!(vias[0].starts_with(&format!("SIP/2.0/UDP {};branch=z9hG4bK", hp(lab.proxy))));
    assert_eq!(header(&got, "Max-Forwards"), "69");
    // The caller's 200 goes back through fulcrum to the service.
    lab.send(&response_to(&got, "200 OK"));
    let ok = lab.service_recv(0);
    assert_eq!(first_line(&ok), "SIP/2.0 200 OK");
    assert_eq!(headers(&ok, "Via").len(), 1);
    assert!(header(&ok, "CSeq").ends_with("BYE"));
    assert_eq!(
        lab.core()
            .counters
            .in_dialog_from_services
            .load(Ordering::Relaxed),
        1
    );
}

#[test]
fn request_from_service_targeting_fulcrum_is_a_refused_loop() {
    let lab = Lab::start(1, "call_id_hash", false);
    let svc = addr(&lab.services[0]);
    let looping = format!(
        "INFO sip:x@{p} SIP/2.0\r\nVia: SIP/2.0/UDP {s};branch=z9hG4bKloop\r\nMax-Forwards: 70\r\n\
         From: <sip:b@x>;tag=1\r\nTo: <sip:a@x>;tag=2\r\nCall-ID: loop@test\r\nCSeq: 1 INFO\r\n\
         Content-Length: 0\r\n\r\n",
        p = hp(lab.proxy),
        s = hp(svc)
    );
    lab.send_from_service(0, &looping);
    // Marker: a client request still reaches the service and nothing came back to it first.
    lab.send(&invite(&lab, "z9hG4bKafter", "after-loop@test"));
    let got = lab.service_recv(0);
    assert_eq!(header(&got, "Call-ID"), "after-loop@test");
    // The loop and the marker may be handled by different worker threads: wait for the count.
    let core = lab.core();
    assert!(
        common::wait_until(Duration::from_secs(2), || core
            .counters
            .loops
            .load(Ordering::Relaxed)
            == 1),
        "loop not counted"
    );
}

#[test]
fn requests_from_outside_go_only_to_bound_services() {
    let lab = Lab::start(1, "call_id_hash", false);
    let victim = sock("127.0.0.1");
    // A client asks fulcrum to relay to an arbitrary address, by R-URI and by Route.
    let by_uri = request(
        "MESSAGE",
        &format!("sip:v@{}", hp(addr(&victim))),
        &hp(addr(&lab.client)),
        "z9hG4bKrelay1",
        "relay-1@test",
        "1 MESSAGE",
    );
    lab.send(&by_uri);
    assert_eq!(header(&lab.service_recv(0), "Call-ID"), "relay-1@test");
    let by_route = by_uri.replace("relay-1@test", "relay-2@test").replace(
        "Max-Forwards: 70\r\n",
        &format!(
            "Max-Forwards: 70\r\nRoute: <sip:{};lr>\r\n",
            hp(addr(&victim))
        ),
    );
    lab.send(&by_route);
    assert_eq!(header(&lab.service_recv(0), "Call-ID"), "relay-2@test");
    victim.set_nonblocking(true).expect("nonblocking");
    assert!(
        recv(&victim).is_none(),
        "fulcrum relayed to a foreign address"
    );
}

#[test]
fn established_call_stays_on_its_service_when_another_returns_from_down() {
    let lab = Lab::start(3, "call_id_hash", false);
    let me = hp(addr(&lab.client));
    lab.rt.set_health("s0", Health::Down);
    let mut calls = Vec::new();
    for i in 0..40 {
        let cid = format!("aff-{i}@test");
        lab.send(&invite(&lab, &format!("z9hG4bKaf{i}"), &cid));
        let (svc, _) = lab.any_service_recv();
        assert_ne!(svc, 0, "a DOWN service got a new call");
        calls.push((cid, svc));
    }
    lab.rt.set_health("s0", Health::Up);
    // Which of these calls would a fresh decision now send to s0? Those are the ones the
    // dialog table must hold in place.
    let balancer = lab.vs().balancer();
    let now = lab.rt.now();
    let would_move: Vec<&(String, usize)> = calls
        .iter()
        .filter(|(cid, _)| {
            let c = balancer.choose(KeyInput::Hash(hash::key_hash(cid.as_bytes())), now);
            c.map(|c| c.member) == Some(0)
        })
        .collect();
    assert!(
        !would_move.is_empty(),
        "no call ranks s0 first: the test proves nothing"
    );
    for (i, (cid, svc)) in calls.iter().enumerate() {
        let bye = request(
            "BYE",
            "sip:bob@example.com",
            &me,
            &format!("z9hG4bKaby{i}"),
            cid,
            "2 BYE",
        );
        lab.send(&bye);
        let (got, msg) = lab.any_service_recv();
        assert_eq!(header(&msg, "Call-ID"), cid);
        assert_eq!(
            got, *svc,
            "{cid} moved from s{svc} to s{got} after s0 came back"
        );
    }
    assert_eq!(lab.vs().balancer().health(0), Some(Health::Up));
}

#[test]
fn malformed_datagrams_are_counted_and_never_stop_traffic() {
    let lab = Lab::start(1, "call_id_hash", false);
    let core = lab.core();
    let good = |i: usize| invite(&lab, &format!("z9hG4bKg{i}"), &format!("good-{i}@test"));
    let full = invite(&lab, "z9hG4bKtr", "trunc@test");
    let no_call_id = full.replace("Call-ID: trunc@test\r\n", "");
    let mut huge = full.replace("Content-Length: 0\r\n\r\n", "X-Pad: ");
    // 65 507 bytes: the largest UDP/IPv4 payload. Valid SIP, but with fulcrum's Via added it
    // no longer fits in a datagram: it is answered 513 (RFC 3261 §21.5.14) without stalling
    // others.
    let tail = "\r\nContent-Length: 0\r\n\r\n";
    huge.push_str(&"a".repeat(65_507 - huge.len() - tail.len()));
    huge.push_str(tail);
    assert_eq!(huge.len(), 65_507);
    let binary: Vec<u8> = (0..1400u32).map(|i| (i * 7919 % 251) as u8).collect();
    let bad: Vec<Vec<u8>> = vec![
        binary,
        vec![0u8; 0],
        full.as_bytes()[..full.len() / 2].to_vec(),
        b"INVITE\r\n\r\n".to_vec(),
        b"SIP/2.0 200\r\n\r\n".to_vec(),
        no_call_id.into_bytes(),
        huge.into_bytes(),
        vec![b'A'; 65_507],
    ];
    for (i, b) in bad.iter().enumerate() {
        lab.client.send_to(b, lab.proxy).expect("send bad datagram");
        lab.send(&good(i));
        let got = lab.service_recv(0);
        assert_eq!(
            header(&got, "Call-ID"),
            format!("good-{i}@test"),
            "bad datagram {i} was forwarded or stalled traffic"
        );
    }
    let c = &core.counters;
    let counted = c.malformed.load(Ordering::Relaxed)
        + c.replies_400.load(Ordering::Relaxed)
        + c.replies_513.load(Ordering::Relaxed)
        + c.not_ours.load(Ordering::Relaxed)
        + c.send_errors.load(Ordering::Relaxed);
    assert_eq!(
        counted,
        bad.len() as u64,
        "every bad datagram is counted once"
    );
    assert_eq!(c.replies_513.load(Ordering::Relaxed), 1, "the huge INVITE");
    // No Call-ID: 400 to the client (RFC 3261 §8.1.1 mandatory header missing) or dropped;
    // the huge INVITE: 513.
    lab.client.set_nonblocking(true).expect("nonblocking");
    let mut buf = vec![0u8; 65_536];
    while let Ok((n, _)) = lab.client.recv_from(&mut buf) {
        let r = String::from_utf8_lossy(&buf[..n]);
        assert!(
            r.starts_with("SIP/2.0 400") || r.starts_with("SIP/2.0 513"),
            "unexpected reply to bad input: {r}"
        );
    }
}

#[test]
fn ipv6_loopback_round_trip() {
    if UdpSocket::bind("[::1]:0").is_err() {
        eprintln!("skipping: no IPv6 loopback on this host");
        return;
    }
    let lab = Lab::start_on("::1", 2, "call_id_hash", true);
    lab.send(&invite(&lab, "z9hG4bKv6", "v6@test"));
    let (svc, got) = lab.any_service_recv();
    let vias = headers(&got, "Via");
    assert!(
        vias[0].starts_with(&format!("SIP/2.0/UDP {};branch=z9hG4bK", hp(lab.proxy))),
        "{}",
        vias[0]
    );
    assert!(vias[0].starts_with("SIP/2.0/UDP [::1]:"));
    assert!(
        vias[1].contains(&format!("rport={}", addr(&lab.client).port())),
        "{}",
        vias[1]
    );
    assert_ours_naming_a_service(header(&got, "Record-Route"), lab.proxy);
    lab.send_from_service(svc, &response_to(&got, "200 OK"));
    let back = lab.client_recv();
    assert_eq!(first_line(&back), "SIP/2.0 200 OK");
    assert_eq!(headers(&back, "Via").len(), 1);
}

/// `max_sessions: 16`, round robin: calls answered 200 by their service are dialogs; a flood
/// of INVITEs with fresh Call-IDs that no service answers, many times the table's size, then
/// passes. The calls' BYEs still reach their services (round robin would move most of them),
/// a call set up during the flood too, and the flood never counted as active flows.
#[test]
fn a_flood_of_unanswered_invites_leaves_confirmed_calls_pinned() {
    let lab = Lab::start_with(
        "127.0.0.1",
        3,
        "round_robin",
        false,
        "    max_sessions: 16\n",
    );
    let me = hp(addr(&lab.client));
    let call = |cid: &str, br: &str| {
        lab.send(&invite(&lab, br, cid));
        let (svc, inv) = lab.any_service_recv();
        lab.send_from_service(svc, &response_to(&inv, "200 OK"));
        let ok = lab.client_recv();
        assert!(ok.starts_with("SIP/2.0 200"), "{ok}");
        (cid.to_owned(), svc)
    };
    let mut calls: Vec<(String, usize)> = (0..8)
        .map(|i| call(&format!("up-{i}@test"), &format!("z9hG4bKup{i}")))
        .collect();
    for i in 0..200 {
        lab.send(&invite(
            &lab,
            &format!("z9hG4bKfl{i}"),
            &format!("flood-{i}@test"),
        ));
        let (_, inv) = lab.any_service_recv();
        assert_eq!(header(&inv, "Call-ID"), format!("flood-{i}@test"));
        if i == 100 {
            calls.push(call("mid@test", "z9hG4bKmid"));
        }
    }
    let core = lab.core();
    assert_eq!(core.dialogs().refused(), 0, "no call was refused a pin");
    assert!(core.dialogs().evicted() >= 200 - 16);
    let b = lab.vs().balancer();
    let (active, pending) = (0..3)
        .filter_map(|m| b.counters(m))
        .fold((0, 0), |(a, p), c| (a + c.active(), p + c.pending()));
    assert_eq!(active, 9, "the calls, and only they, are active flows");
    assert!(
        pending <= 16 - 9,
        "the flood's pending load stays in the table: {pending}"
    );
    for (i, (cid, svc)) in calls.iter().enumerate() {
        lab.send(&request(
            "BYE",
            "sip:bob@example.com",
            &me,
            &format!("z9hG4bKby{i}"),
            cid,
            "2 BYE",
        ));
        let (got, msg) = lab.any_service_recv();
        assert_eq!(header(&msg, "Call-ID"), cid);
        assert_eq!(got, *svc, "{cid} moved from s{svc} to s{got}");
    }
    let active: u64 = (0..3)
        .filter_map(|m| b.counters(m))
        .map(|c| c.active())
        .sum();
    assert_eq!(active, 0);
}

/// A stateless vserver on `binds` (YAML list items) with one service on 127.0.0.1, and a
/// client on 127.0.0.1; `proxy` is the first bound address.
fn lab_bound(binds: &str, record_route: bool) -> Lab {
    let service = sock("127.0.0.1");
    let y = format!(
        "admin: {{ listen: null }}\nservices:\n  - {{ name: s0, address: \"{}\", protocol: sip-udp }}\n\
         vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [{binds}]\n    method: call_id_hash\n    record_route: {record_route}\n    workers: 2\n    failover: off\n    services: [s0]\n",
        hp(addr(&service))
    );
    let cfg = config::from_str("test.yaml", &y).expect("config");
    let rt = Runtime::start(&cfg).expect("runtime");
    let proxy = rt.vserver("v").expect("vserver").bound[0];
    Lab {
        rt,
        proxy,
        services: vec![service],
        client: sock("127.0.0.1"),
    }
}

/// What `s` receives next, and from where.
fn recv_src(s: &UdpSocket) -> (String, SocketAddr) {
    let mut buf = vec![0u8; 65_536];
    let (n, from) = s.recv_from(&mut buf).expect("nothing received");
    (String::from_utf8_lossy(&buf[..n]).into_owned(), from)
}

/// RFC 3581 §4: answers leave from the address the request was sent to. On a wildcard bind
/// the kernel would pick 127.0.0.1 toward a client on 127.0.0.1 (the route's source), not
/// the 127.0.0.2 or 127.0.0.3 the client used; fulcrum names the arrival address as the
/// source (IP_PKTINFO), for relayed answers and for its own.
#[test]
fn a_wildcard_bind_answers_from_the_address_each_request_was_sent_to() {
    let lab = lab_bound("\"0.0.0.0:0\"", false);
    let port = lab.proxy.port();
    let client = hp(addr(&lab.client));
    for (i, target) in ["127.0.0.2", "127.0.0.3"].iter().enumerate() {
        let to: SocketAddr = format!("{target}:{port}").parse().expect("addr");
        let options = request(
            "OPTIONS",
            "sip:bob@example.com",
            &client,
            &format!("z9hG4bKwild{i}"),
            &format!("wild-{i}@test"),
            "1 OPTIONS",
        );
        lab.client.send_to(options.as_bytes(), to).expect("send");
        let got = lab.service_recv(0);
        lab.services[0]
            .send_to(
                response_to(&got, "200 OK").as_bytes(),
                lab.proxy_seen_by_service(&got),
            )
            .expect("answer");
        let (answer, from) = recv_src(&lab.client);
        assert_eq!(first_line(&answer), "SIP/2.0 200 OK");
        assert_eq!(
            from, to,
            "the relayed answer leaves from the address the client used"
        );
    }
    // fulcrum's own answer (every service down: 503) too.
    assert_eq!(lab.rt.set_health("s0", Health::Down), 1);
    let to: SocketAddr = format!("127.0.0.3:{port}").parse().expect("addr");
    let options = request(
        "OPTIONS",
        "sip:bob@example.com",
        &client,
        "z9hG4bKwild9",
        "wild-9@test",
        "1 OPTIONS",
    );
    lab.client.send_to(options.as_bytes(), to).expect("send");
    let (answer, from) = recv_src(&lab.client);
    assert_eq!(first_line(&answer), "SIP/2.0 503 Service Unavailable");
    assert_eq!(
        from, to,
        "fulcrum's own answer leaves from the address the client used"
    );
}

/// A vserver on two addresses: the callee's BYE reaches fulcrum on the address its
/// Record-Route names (the first), and goes on to the caller from the address the caller
/// used (the second), not from the socket it arrived on.
#[test]
fn a_request_toward_a_client_leaves_from_the_address_that_client_used() {
    let lab = lab_bound("\"127.0.0.1:0\", \"127.0.0.2:0\"", true);
    let second = lab.vs().bound[1];
    let client = addr(&lab.client);
    let svc = addr(&lab.services[0]);
    lab.client
        .send_to(invite(&lab, "z9hG4bKtwo", "two@test").as_bytes(), second)
        .expect("send");
    let got = lab.service_recv(0);
    let rr = header(&got, "Record-Route");
    assert!(
        rr.contains(&hp(lab.proxy)),
        "Record-Route names the first address: {rr}"
    );
    let bye = format!(
        "BYE sip:alice@{c} SIP/2.0\r\n\
         Via: SIP/2.0/UDP {s};branch=z9hG4bKbyetwo;rport\r\n\
         Max-Forwards: 70\r\n\
         Route: {rr}\r\n\
         From: <sip:bob@example.com>;tag=b1\r\n\
         To: <sip:alice@example.com>;tag=a1\r\n\
         Call-ID: two@test\r\nCSeq: 1 BYE\r\nContent-Length: 0\r\n\r\n",
        c = hp(client),
        s = hp(svc),
    );
    lab.services[0]
        .send_to(bye.as_bytes(), lab.proxy)
        .expect("service send");
    let (got, from) = recv_src(&lab.client);
    assert!(first_line(&got).starts_with("BYE "), "{got}");
    assert_eq!(
        from, second,
        "the BYE leaves from the address the caller used"
    );
}
