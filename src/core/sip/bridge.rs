//! The transports bridge: a sip-tcp vserver over sip-udp services. Each leg gets its own
//! Via; dialogs are double record-routed (RFC 5658 §3.2) and either entry is "us".
use super::*;
use crate::config;
use std::sync::atomic::Ordering;

const US: &str = "127.0.0.1:5060";
const LEG: &str = "127.0.0.1:40000";
const CLIENT: &str = "192.0.2.10:5062";
const CONN: u64 = 0xabc;

fn core(services: &str) -> SipCore {
    core_with_leg(
        services,
        Local::from_addr(LEG.parse().expect("addr"), Transport::Udp),
    )
}

/// A sip-tcp vserver over services `a` and `b` of protocol `services`, its other leg `leg`.
fn core_with_leg(services: &str, leg: Local) -> SipCore {
    let cfg = config::from_str(
        "t",
        &format!("services:\n  - {{ name: a, address: 127.0.0.1:5071, protocol: {services} }}\n  - {{ name: b, address: 127.0.0.1:5072, protocol: {services} }}\nvservers:\n  - {{ name: v, protocol: sip-tcp, bind: {US}, record_route: true, services: [a, b] }}\n"),
    )
    .expect("config");
    let v = &cfg.vservers[0];
    let local = Local::from_addr(US.parse().expect("addr"), Transport::Tcp);
    SipCore::new(
        SipParams::of(&cfg, v, local, Arc::new(Balancer::new(&cfg, v))).with_legs(vec![leg]),
    )
}

fn from_client(c: &SipCore, text: &str, out: &mut Vec<u8>) -> Action {
    c.handle(
        text.as_bytes(),
        Origin::Client { conn: Some(CONN) },
        CLIENT.parse().expect("src"),
        US.parse().expect("dst"),
        0,
        out,
    )
}

fn from_member(c: &SipCore, m: usize, text: &str, out: &mut Vec<u8>) -> Action {
    let src = c.member_addr(m).expect("member");
    c.handle(
        text.as_bytes(),
        Origin::Member(m),
        src,
        LEG.parse().expect("dst"),
        0,
        out,
    )
}

fn invite(call_id: &str) -> String {
    format!(
        "INVITE sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/TCP 192.0.2.10:5062;branch=z9hG4bK{call_id}\r\nMax-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContact: <sip:a@192.0.2.10:5062;transport=tcp>\r\nContent-Length: 0\r\n\r\n"
    )
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

/// Header values of `name` in order (each comma-separated value on its own).
fn values(out: &[u8], name: &str) -> Vec<String> {
    let msg = crate::sip::scan(out).expect("scans");
    msg.headers()
        .filter(|h| h.name.eq_ignore_ascii_case(name.as_bytes()))
        .flat_map(|h| {
            String::from_utf8_lossy(h.value)
                .split(',')
                .map(|v| v.trim().to_owned())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The record-routed INVITE: which member, the two entries, the forwarded bytes.
fn set_up(c: &SipCore, call_id: &str) -> (usize, Vec<String>, Vec<u8>) {
    let mut out = Vec::new();
    let Action::ToMember(m) = from_client(c, &invite(call_id), &mut out) else {
        panic!("not forwarded: {}", text(&out))
    };
    (m, values(&out, "Record-Route"), out)
}

/// A stream client's request that fits its connection but, once fulcrum's Via and
/// Record-Routes are added, not a datagram, toward a sip-udp member: 513 (RFC 3261
/// §21.5.14), nothing forwarded, the dialog it pinned ended at once (not counted). It
/// takes a long advertised name on the UDP leg for the additions to pass the 29 bytes
/// between the two limits; before, such a request went to the member and its send failed.
#[test]
fn a_request_too_long_for_a_datagram_toward_a_udp_member_is_answered_513() {
    let name = format!("{}.example", "leg".repeat(60));
    let c = core_with_leg("sip-udp", Local::new(&name, 40000, Transport::Udp));
    // Dialogs counted on both members.
    let active = |c: &SipCore| {
        (0..2)
            .filter_map(|m| c.balancer().counters(m).map(|k| k.load()))
            .sum::<u64>()
    };
    let with_body = |call_id: &str, len: usize| {
        invite(call_id).replace(
            "Content-Length: 0\r\n\r\n",
            &format!("Content-Length: {len}\r\n\r\n{}", "x".repeat(len)),
        )
    };
    // What forwarding adds to this INVITE.
    let mut out = Vec::new();
    let small = with_body("probe", 10);
    assert!(matches!(
        from_client(&c, &small, &mut out),
        Action::ToMember(_)
    ));
    let growth = out.len() - small.len();
    // A request that grows to 65,520 bytes: under the stream limit, over a datagram's.
    let big = with_body("big-1", 65_520 - growth - small.len() + 10);
    assert!(big.len() <= crate::sip::DEFAULT_MAX_MESSAGE - MAX_GROWTH);
    let opened = active(&c);
    let a = from_client(&c, &big, &mut out);
    assert!(matches!(a, Action::Reply(_)), "{a:?}");
    assert_eq!(
        crate::sip::scan(&out).expect("scan").status_code(),
        Some(513)
    );
    assert_eq!(c.counters.replies_513.load(Ordering::Relaxed), 1);
    assert_eq!(c.counters.requests_forwarded.load(Ordering::Relaxed), 1);
    assert_eq!(active(&c), opened, "not counted");
    // Its retransmission is refused alike, and counts nothing either.
    assert!(matches!(from_client(&c, &big, &mut out), Action::Reply(_)));
    assert_eq!(c.counters.replies_513.load(Ordering::Relaxed), 2);
    assert_eq!(active(&c), opened);
}

#[test]
fn a_request_to_a_udp_member_carries_the_udp_leg_via_and_two_record_routes() {
    let c = core("sip-udp");
    assert_eq!(c.member_transport(0), Transport::Udp);
    let (m, rr, out) = set_up(&c, "br-1");
    let vias = values(&out, "Via");
    assert!(
        vias[0].starts_with("SIP/2.0/UDP 127.0.0.1:40000;branch=z9hG4bK-fc-"),
        "{vias:?}"
    );
    assert!(vias[0].ends_with(";fc-conn=0000000000000abc"), "{vias:?}");
    let d = hash::service_digest(c.balancer().members()[m].id_hash);
    assert_eq!(
        rr,
        [
            format!("<sip:127.0.0.1:40000;lr;fc-svc={d:016x}>"),
            "<sip:127.0.0.1:5060;transport=tcp;lr>".to_owned()
        ]
    );
}

#[test]
fn the_services_answer_on_the_udp_leg_goes_to_the_client_connection() {
    let c = core("sip-udp");
    let (m, _, fwd) = set_up(&c, "br-2");
    let vias = values(&fwd, "Via").join(", ");
    let answer = format!(
        "SIP/2.0 200 OK\r\nVia: {vias}\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>;tag=s1\r\nCall-ID: br-2\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n"
    );
    let mut out = Vec::new();
    assert_eq!(from_member(&c, m, &answer, &mut out), Action::ToConn(CONN));
    assert_eq!(values(&out, "Via").len(), 1, "{}", text(&out));
}

/// The client's BYE names both entries in its Route set (reversed Record-Route, the
/// client leg first): both are removed, and `fc-svc` in the second names the service.
#[test]
fn the_clients_in_dialog_request_follows_fc_svc_past_both_entries() {
    let c = core("sip-udp");
    let (m, rr, _) = set_up(&c, "br-3");
    let route_sets = [
        format!("Route: {}, {}\r\n", rr[1], rr[0]),
        format!("Route: {}\r\nRoute: {}\r\n", rr[1], rr[0]),
        format!("Route: {}, {}, <sip:10.9.9.9;lr>\r\n", rr[1], rr[0]),
    ];
    for (i, routes) in route_sets.iter().enumerate() {
        // Another instance of the same pool, which never saw the call.
        let fresh = core("sip-udp");
        let bye = format!(
            "BYE sip:svc@10.0.0.9 SIP/2.0\r\nVia: SIP/2.0/TCP 192.0.2.10:5062;branch=z9hG4bKbye{i}\r\n{routes}Max-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>;tag=s1\r\nCall-ID: br-3\r\nCSeq: 2 BYE\r\nContent-Length: 0\r\n\r\n"
        );
        let mut out = Vec::new();
        assert_eq!(
            from_client(&fresh, &bye, &mut out),
            Action::ToMember(m),
            "{routes}"
        );
        assert_eq!(
            fresh
                .counters
                .routed_by_record_route
                .load(Ordering::Relaxed),
            1
        );
        let left = values(&out, "Route");
        if i == 2 {
            assert_eq!(left, ["<sip:10.9.9.9;lr>"], "{}", text(&out));
        } else {
            assert!(left.is_empty(), "{}", text(&out));
        }
        assert!(values(&out, "Via")[0].starts_with("SIP/2.0/UDP 127.0.0.1:40000;"));
    }
}

/// The callee hangs up: its BYE arrives on the UDP leg with the Route set in Record-Route
/// order (the service leg first), leaves on the client leg with the client leg's Via
/// toward the client's Contact, and the client's 200 goes back to the service.
#[test]
fn the_services_in_dialog_request_goes_out_on_the_client_leg() {
    let c = core("sip-udp");
    let (m, rr, _) = set_up(&c, "br-4");
    let svc = c.member_addr(m).expect("member");
    let bye = format!(
        "BYE sip:a@192.0.2.10:5062;transport=tcp SIP/2.0\r\nVia: SIP/2.0/UDP {svc};branch=z9hG4bKsvcbye\r\nRoute: {}, {}\r\nMax-Forwards: 70\r\nFrom: <sip:svc@example.com>;tag=s1\r\nTo: <sip:a@x>;tag=f1\r\nCall-ID: br-4\r\nCSeq: 1 BYE\r\nContent-Length: 0\r\n\r\n",
        rr[0], rr[1]
    );
    let mut out = Vec::new();
    assert_eq!(
        from_member(&c, m, &bye, &mut out),
        Action::ToAddr(CLIENT.parse().expect("addr"))
    );
    assert!(values(&out, "Route").is_empty(), "{}", text(&out));
    let vias = values(&out, "Via");
    assert!(
        vias[0].starts_with("SIP/2.0/TCP 127.0.0.1:5060;branch=z9hG4bK-fc-"),
        "{vias:?}"
    );
    let ok = format!(
        "SIP/2.0 200 OK\r\nVia: {}\r\nFrom: <sip:svc@example.com>;tag=s1\r\nTo: <sip:a@x>;tag=f1\r\nCall-ID: br-4\r\nCSeq: 1 BYE\r\nContent-Length: 0\r\n\r\n",
        vias.join(", ")
    );
    let mut back = Vec::new();
    assert_eq!(from_client(&c, &ok, &mut back), Action::ToAddr(svc));
}

/// Members of the vserver's own transport are not bridged: one Record-Route, as before,
/// and the core has no other leg.
#[test]
fn members_of_the_vservers_transport_are_not_bridged() {
    let c = core("sip-tcp");
    assert_eq!(c.member_transport(0), Transport::Tcp);
    assert!(!c.local().is_bridged());
    let (m, rr, out) = set_up(&c, "br-5");
    let d = hash::service_digest(c.balancer().members()[m].id_hash);
    assert_eq!(
        rr,
        [format!(
            "<sip:127.0.0.1:5060;transport=tcp;lr;fc-svc={d:016x}>"
        )]
    );
    assert!(values(&out, "Via")[0].starts_with("SIP/2.0/TCP 127.0.0.1:5060;"));
    // A second Route naming fulcrum is not skipped off a bridge: a loop.
    let bye = format!(
        "BYE sip:a@192.0.2.10 SIP/2.0\r\nVia: SIP/2.0/TCP 127.0.0.1:5071;branch=z9hG4bKx\r\nRoute: {}, <sip:127.0.0.1:5060;transport=tcp;lr>\r\nMax-Forwards: 70\r\nFrom: <sip:svc@example.com>;tag=s1\r\nTo: <sip:a@x>;tag=f1\r\nCall-ID: br-5\r\nCSeq: 1 BYE\r\nContent-Length: 0\r\n\r\n",
        rr[0]
    );
    let mut out = Vec::new();
    assert_eq!(
        from_member(&c, m, &bye, &mut out),
        Action::Drop(DropReason::Loop)
    );
}

/// A held request's attempts across the bridge, each a `(destination, first line, top Via)`.
fn attempts(sends: &[stateful::Send]) -> Vec<(stateful::Dest, String, String)> {
    sends
        .iter()
        .map(|s| {
            let first = text(&s.bytes).lines().next().unwrap_or_default().to_owned();
            let via = values(&s.bytes, "Via").first().cloned().unwrap_or_default();
            (s.dest, first, via)
        })
        .collect()
}

/// Member `m`'s answer `code` to the request it was `sent`, arriving at `dst` at `now`: what
/// the core does with it; `sends` then holds what the held request sent besides.
fn member_answers(
    c: &SipCore,
    m: usize,
    sent: &[u8],
    code: u16,
    dst: SocketAddr,
    now: Nanos,
    sends: &mut Vec<stateful::Send>,
) -> Action {
    let reason = if code == 200 {
        "OK"
    } else {
        "Service Unavailable"
    };
    let text = stateful::tests::answer(sent, code, reason);
    let src = c.member_addr(m).expect("member");
    sends.clear();
    let mut out = Vec::new();
    c.handle_stateful(
        text.as_bytes(),
        Origin::Member(m),
        src,
        dst,
        now,
        &mut out,
        sends,
    )
}

/// A sip-tcp vserver holds a client's INVITE toward sip-udp members as it does toward its
/// own: 100 on the connection, Timer A over the UDP leg, a 503 ACKed and the INVITE moved to
/// the other member with attempt 1's branch, whose answer finds the transaction (every leg
/// branches alike) and reaches the client's connection.
#[test]
fn a_stream_clients_invite_fails_over_between_udp_members() {
    use stateful::Dest;
    let c = core("sip-udp").with_failover(Some(config::Failover::default()), Arc::default());
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let (client, us, leg) = (
        CLIENT.parse().expect("client"),
        US.parse().expect("us"),
        LEG.parse().expect("leg"),
    );
    let a = c.handle_stateful(
        invite("fo-1").as_bytes(),
        Origin::Client { conn: Some(CONN) },
        client,
        us,
        0,
        &mut out,
        &mut sends,
    );
    let Action::ToMember(m0) = a else {
        panic!("not forwarded: {a:?}")
    };
    let m1 = 1 - m0;
    let (a0, a1) = (
        c.member_addr(m0).expect("m0"),
        c.member_addr(m1).expect("m1"),
    );
    assert_eq!(attempts(&sends)[0].0, Dest::Conn(CONN));
    assert_eq!(attempts(&sends)[0].1, "SIP/2.0 100 Trying");
    let first = out.clone();
    // Timer A: sent again over the leg.
    sends.clear();
    c.poll_transactions(transaction::T1, &mut sends);
    // A timer's send: its Call-ID is not vouched for (no message was handled).
    assert_eq!(
        sends,
        [stateful::Send {
            dest: Dest::Service(a0),
            bytes: bytes::Bytes::from(first.clone()),
            call_id: stateful::Carries::Unknown,
        }]
    );
    // The member's 503 on the leg: absorbed, ACKed, the INVITE moved.
    let a = member_answers(&c, m0, &first, 503, leg, transaction::T1 + 1, &mut sends);
    assert!(matches!(a, Action::Drop(DropReason::Absorbed)), "{a:?}");
    let sent = attempts(&sends);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(
        (sent[0].0, sent[0].1.as_str()),
        (Dest::Service(a0), "ACK sip:svc@example.com SIP/2.0")
    );
    assert_eq!(sent[1].0, Dest::Service(a1));
    assert!(sent[1].1.starts_with("INVITE "), "{sent:?}");
    assert!(
        sent[1]
            .2
            .starts_with("SIP/2.0/UDP 127.0.0.1:40000;branch=z9hG4bK-fc-")
            && sent[1].2.ends_with(".1;fc-conn=0000000000000abc"),
        "the client's connection named in every attempt: {sent:?}"
    );
    let second = sends[1].bytes.clone();
    // The other member's 200 reaches the client's connection.
    let a = member_answers(&c, m1, &second, 200, leg, transaction::T1 + 2, &mut sends);
    assert!(matches!(a, Action::ToConn(CONN)), "{a:?}");
    assert_eq!(
        c.transactions().counters.failovers.load(Ordering::Relaxed),
        1
    );
}

/// A sip-udp vserver over sip-tcp members: the attempts go over the members' links, are
/// never retransmitted (a stream is reliable), and a 503 moves the INVITE to the other
/// member's link; the client hears 100 and the winner's 200 as datagrams.
#[test]
fn a_udp_clients_invite_fails_over_between_stream_members() {
    use stateful::Dest;
    let cfg = config::from_str(
        "t",
        &format!("services:\n  - {{ name: a, address: 127.0.0.1:5071, protocol: sip-tcp }}\n  - {{ name: b, address: 127.0.0.1:5072, protocol: sip-tcp }}\nvservers:\n  - {{ name: v, protocol: sip-udp, bind: {US}, record_route: true, services: [a, b] }}\n"),
    )
    .expect("config");
    let v = &cfg.vservers[0];
    let local = Local::from_addr(US.parse().expect("addr"), Transport::Udp);
    let legs = vec![
        local.with_transport(Transport::Tcp),
        local.with_transport(Transport::Tls),
    ];
    let c = SipCore::new(
        SipParams::of(&cfg, v, local, Arc::new(Balancer::new(&cfg, v))).with_legs(legs),
    )
    .with_failover(v.failover.clone(), Arc::default());
    let (client, us) = (CLIENT.parse().expect("client"), US.parse().expect("us"));
    let request = invite("fo-2").replace("SIP/2.0/TCP", "SIP/2.0/UDP");
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let a = c.handle_datagram_stateful(request.as_bytes(), client, us, 0, &mut out, &mut sends);
    let Action::ToMember(m0) = a else {
        panic!("not forwarded: {a:?}")
    };
    let m1 = 1 - m0;
    assert_eq!(
        attempts(&sends)[0],
        (
            Dest::Addr(client),
            "SIP/2.0 100 Trying".to_owned(),
            "SIP/2.0/UDP 192.0.2.10:5062;branch=z9hG4bKfo-2".to_owned()
        )
    );
    let first = out.clone();
    // No retransmission toward a stream member: the next deadline is no_answer (2 s).
    sends.clear();
    let next = c.poll_transactions(transaction::T1, &mut sends);
    assert!(sends.is_empty(), "{:?}", attempts(&sends));
    assert_eq!(next, Some(2_000_000_000));
    let a = member_answers(&c, m0, &first, 503, us, transaction::T1 + 1, &mut sends);
    assert!(matches!(a, Action::Drop(DropReason::Absorbed)), "{a:?}");
    let sent = attempts(&sends);
    assert_eq!(
        (sent[0].0, sent[0].1.as_str()),
        (Dest::Member(m0), "ACK sip:svc@example.com SIP/2.0")
    );
    assert_eq!(sent[1].0, Dest::Member(m1));
    assert!(
        sent[1]
            .2
            .starts_with("SIP/2.0/TCP 127.0.0.1:5060;branch=z9hG4bK-fc-")
            && sent[1].2.contains(".1"),
        "{sent:?}"
    );
    let second = sends[1].bytes.clone();
    let a = member_answers(&c, m1, &second, 200, us, transaction::T1 + 2, &mut sends);
    assert!(matches!(a, Action::ToAddr(to) if to == client), "{a:?}");
}
