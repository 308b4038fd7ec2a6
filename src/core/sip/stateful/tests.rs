//! Failover through the core: requests, responses and timers as bytes, the sends checked.

use super::*;
use crate::config;
use std::time::Duration;

const CLIENT: &str = "192.0.2.10:5062";
const US: &str = "127.0.0.1:5060";
const S: Nanos = 1_000_000_000;

fn core() -> SipCore {
    core_with("", Arc::default())
}

/// The core of a sip-udp vserver on `US` over services a, b, c (127.0.0.1:5071..) with the
/// vserver fields `fields` (`key: value, ` each), holding its requests in `table`.
fn core_with(fields: &str, table: Arc<Transactions>) -> SipCore {
    let y = format!(
        "services:\n  - {{ name: a, address: 127.0.0.1:5071, protocol: sip-udp }}\n  - {{ name: b, address: 127.0.0.1:5072, protocol: sip-udp }}\n  - {{ name: c, address: 127.0.0.1:5073, protocol: sip-udp }}\nvservers:\n  - {{ name: v, protocol: sip-udp, bind: 127.0.0.1:5060, {fields}services: [a, b, c] }}\n"
    );
    let cfg = config::from_str("t", &y).expect("config");
    let v = &cfg.vservers[0];
    let local = Local::from_addr(US.parse().expect("addr"), Transport::Udp);
    let balancer = Arc::new(Balancer::new(&cfg, v));
    SipCore::new(SipParams::of(&cfg, v, local, balancer)).with_failover(v.failover.clone(), table)
}

fn invite(call_id: &str) -> String {
    format!(
        "INVITE sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/UDP 192.0.2.10:5062;branch=z9hG4bKc1;rport\r\nMax-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n"
    )
}

/// The service's answer to a forwarded request: its Vias, a To tag, `code`.
pub(in crate::core::sip) fn answer(forwarded: &[u8], code: u16, reason: &str) -> String {
    let msg = sip::scan(forwarded).expect("forwarded");
    let vias: Vec<String> = msg
        .headers()
        .filter(|h| h.name.eq_ignore_ascii_case(b"Via"))
        .map(|h| format!("Via: {}\r\n", String::from_utf8_lossy(h.value)))
        .collect();
    format!(
        "SIP/2.0 {code} {reason}\r\n{}From: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>;tag=s1\r\nCall-ID: {}\r\nCSeq: 1 INVITE\r\nRetry-After: 30\r\nContent-Length: 0\r\n\r\n",
        vias.concat(),
        String::from_utf8_lossy(msg.call_id().expect("call-id"))
    )
}

fn from(
    c: &SipCore,
    text: &str,
    src: &str,
    now: Nanos,
    out: &mut Vec<u8>,
    sends: &mut Vec<(SocketAddr, Bytes)>,
) -> Action {
    let mut raw = Vec::new();
    let a = c.handle_datagram_stateful(
        text.as_bytes(),
        src.parse().expect("src"),
        US.parse().expect("dst"),
        now,
        out,
        &mut raw,
    );
    *sends = flat(raw);
    a
}

/// A sip-udp vserver's sends are datagrams.
fn flat(sends: Vec<Send>) -> Vec<(SocketAddr, Bytes)> {
    sends
        .into_iter()
        .map(|s| match s.dest {
            Dest::Addr(a) | Dest::Service(a) => (a, s.bytes),
            other => panic!("not a datagram: {other:?}"),
        })
        .collect()
}

fn poll(c: &SipCore, now: Nanos, timers: &mut Vec<(SocketAddr, Bytes)>) -> Option<Nanos> {
    let mut raw = Vec::new();
    let next = c.poll_transactions(now, &mut raw);
    timers.extend(flat(raw));
    next
}

fn first_line(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned()
}

fn member_addr(c: &SipCore, m: usize) -> String {
    c.member_addr(m).expect("member").to_string()
}

#[test]
fn a_503_moves_the_invite_to_the_next_service_and_the_client_sees_only_the_200() {
    let c = core();
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(m0) = from(&c, &invite("call-1"), CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    assert_eq!(sends.len(), 1);
    assert_eq!(sends[0].0, CLIENT.parse::<SocketAddr>().expect("client"));
    assert_eq!(first_line(&sends[0].1), "SIP/2.0 100 Trying");
    let trying = String::from_utf8_lossy(&sends[0].1).into_owned();
    let to = trying.lines().find(|l| l.starts_with("To:")).expect("To");
    assert!(!to.contains(";tag="), "no To tag on 100: {to}");
    let first = out.clone();
    // The service is sick: 503. The client hears nothing; the service gets its ACK and the
    // next service the INVITE with attempt 1's branch.
    let a = from(
        &c,
        &answer(&first, 503, "Service Unavailable"),
        &member_addr(&c, m0),
        S / 10,
        &mut out,
        &mut sends,
    );
    assert_eq!(a, Action::Drop(DropReason::Absorbed));
    assert_eq!(sends.len(), 2, "{sends:?}");
    assert_eq!(sends[0].0, c.member_addr(m0).expect("m0"));
    assert_eq!(first_line(&sends[0].1), "ACK sip:svc@example.com SIP/2.0");
    let next = sends[1].clone();
    assert_ne!(next.0, c.member_addr(m0).expect("m0"));
    let text = String::from_utf8_lossy(&next.1).into_owned();
    assert!(text.starts_with("INVITE sip:svc@example.com SIP/2.0"));
    let branch = sip::scan(&next.1)
        .expect("scan")
        .top_via()
        .expect("via")
        .branch
        .expect("branch");
    assert_eq!(sip::transaction_of(branch).map(|(_, k)| k), Some(1));
    // The next service answers 200: relayed to the client as the stateless proxy would.
    let a = from(
        &c,
        &answer(&next.1, 200, "OK"),
        &next.0.to_string(),
        S / 5,
        &mut out,
        &mut sends,
    );
    assert_eq!(a, Action::ToAddr(CLIENT.parse().expect("client")));
    assert_eq!(first_line(&out), "SIP/2.0 200 OK");
    assert_eq!(
        c.transactions()
            .counters
            .failovers
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // The dialog now belongs to the service that answered.
    let m1 = (0..3)
        .find(|&m| c.member_addr(m) == Some(next.0))
        .expect("m1");
    assert_eq!(
        c.dialogs().get(crate::hash::key_hash(b"call-1"), 0),
        Some(m1 as u32)
    );
}

#[test]
fn a_service_that_never_answers_is_left_after_no_answer() {
    let c = core();
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(m0) = from(&c, &invite("call-2"), CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let mut timers = Vec::new();
    // Timer A at 500 ms and 1.5 s: the INVITE again to the same service.
    let next = poll(&c, S / 2, &mut timers);
    assert_eq!(timers.len(), 1);
    assert_eq!(timers[0].0, c.member_addr(m0).expect("m0"));
    assert_eq!(next, Some(3 * S / 2));
    timers.clear();
    assert_eq!(
        poll(&c, 3 * S / 2, &mut timers),
        Some(2 * S),
        "no_answer: 2 s"
    );
    assert_eq!(timers.len(), 1);
    timers.clear();
    poll(&c, 2 * S, &mut timers);
    assert_eq!(timers.len(), 1, "{timers:?}");
    assert_ne!(timers[0].0, c.member_addr(m0).expect("m0"));
    assert!(first_line(&timers[0].1).starts_with("INVITE"));
    // Its retransmission from the client gets the 100 again, not a second INVITE.
    let a = from(
        &c,
        &invite("call-2"),
        CLIENT,
        2 * S + 1,
        &mut out,
        &mut sends,
    );
    assert_eq!(a, Action::Drop(DropReason::Absorbed));
    assert_eq!(sends.len(), 1);
    assert_eq!(first_line(&sends[0].1), "SIP/2.0 100 Trying");
}

#[test]
fn every_service_503_gives_the_client_500_and_cancel_is_answered_200() {
    let c = core();
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(m0) = from(&c, &invite("call-3"), CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let mut to = (c.member_addr(m0).expect("m0"), Bytes::copy_from_slice(&out));
    let mut client = Vec::new();
    for i in 0..3 {
        from(
            &c,
            &answer(&to.1, 503, "Service Unavailable"),
            &to.0.to_string(),
            (i + 1) * S / 10,
            &mut out,
            &mut sends,
        );
        client.extend(
            sends
                .iter()
                .filter(|s| s.0 == CLIENT.parse().expect("client"))
                .map(|s| first_line(&s.1)),
        );
        if let Some(next) = sends
            .iter()
            .find(|s| first_line(&s.1).starts_with("INVITE"))
        {
            to = next.clone();
        }
    }
    assert_eq!(client, ["SIP/2.0 500 Server Internal Error"]);
    let cancel = invite("call-3")
        .replace("INVITE sip", "CANCEL sip")
        .replace("1 INVITE", "1 CANCEL");
    let a = from(&c, &cancel, CLIENT, S, &mut out, &mut sends);
    assert_eq!(a, Action::Drop(DropReason::Absorbed));
    assert_eq!(sends.len(), 1, "{sends:?}");
    assert_eq!(sends[0].0, CLIENT.parse().expect("client"));
    assert_eq!(first_line(&sends[0].1), "SIP/2.0 200 OK");
    let _ = Duration::ZERO;
}

/// RFC 3261 §9.1, §16.10: the client's CANCEL of a ringing INVITE is answered 200 by fulcrum
/// and sent on to the attempt with the attempt's branch. The service's 200 to that CANCEL
/// answers fulcrum's CANCEL, not the INVITE: absorbed, never relayed, and the INVITE's 487
/// after it reaches the client.
#[test]
fn a_services_200_to_fulcrums_cancel_is_absorbed_and_its_487_relayed() {
    let c = core();
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(m0) = from(&c, &invite("call-5"), CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let svc = member_addr(&c, m0);
    let fwd = out.clone();
    let a = from(
        &c,
        &answer(&fwd, 180, "Ringing"),
        &svc,
        1,
        &mut out,
        &mut sends,
    );
    assert_eq!(a, Action::ToAddr(CLIENT.parse().expect("client")));
    let cancel = invite("call-5")
        .replace("INVITE sip", "CANCEL sip")
        .replace("1 INVITE", "1 CANCEL");
    let a = from(&c, &cancel, CLIENT, 2, &mut out, &mut sends);
    assert_eq!(a, Action::Drop(DropReason::Absorbed));
    // The client's 200 first: sent after the CANCEL, it could be overtaken by the 487 the
    // CANCEL provokes, relayed by another worker.
    assert_eq!(sends.len(), 2, "{sends:?}");
    assert_eq!(sends[0].0, CLIENT.parse().expect("client"));
    assert_eq!(first_line(&sends[0].1), "SIP/2.0 200 OK");
    assert!(first_line(&sends[1].1).starts_with("CANCEL "));
    let ours = sends[1].1.clone();
    let ok = answer(&ours, 200, "OK").replace("1 INVITE", "1 CANCEL");
    let a = from(&c, &ok, &svc, 3, &mut out, &mut sends);
    assert_eq!(
        a,
        Action::Drop(DropReason::Absorbed),
        "the CANCEL's 200 is fulcrum's"
    );
    assert!(sends.is_empty(), "{sends:?}");
    let a = from(
        &c,
        &answer(&fwd, 487, "Request Terminated"),
        &svc,
        4,
        &mut out,
        &mut sends,
    );
    assert_eq!(a, Action::ToAddr(CLIENT.parse().expect("client")));
    assert_eq!(first_line(&out), "SIP/2.0 487 Request Terminated");
    assert_eq!(sends.len(), 1, "the 487 is ACKed: {sends:?}");
    assert!(first_line(&sends[0].1).starts_with("ACK "));
}

#[test]
fn a_held_options_gets_its_200_relayed() {
    let c = core();
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let opt = invite("opt-1")
        .replace("INVITE sip", "OPTIONS sip")
        .replace("1 INVITE", "1 OPTIONS");
    let Action::ToMember(m0) = from(&c, &opt, CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    assert!(sends.is_empty(), "no 100 for a non-INVITE: {sends:?}");
    let fwd = out.clone();
    let a = from(
        &c,
        &answer(&fwd, 200, "OK").replace("1 INVITE", "1 OPTIONS"),
        &member_addr(&c, m0),
        1,
        &mut out,
        &mut sends,
    );
    assert_eq!(
        a,
        Action::ToAddr(CLIENT.parse().expect("client")),
        "{}",
        String::from_utf8_lossy(&out)
    );
}

/// With `service_source`, requests toward services name it in their Via and leave from it
/// (`Dest::Service`), answers naming it are fulcrum's, and what goes to the client stays a
/// plain datagram from the vserver's address (`Dest::Addr`).
#[test]
fn with_a_service_source_services_answer_there_and_failover_works() {
    let y = "services:\n  - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }\n  - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }\nvservers:\n  - { name: v, protocol: sip-udp, bind: 127.0.0.1:5060, service_source: 127.0.0.2, record_route: true, services: [a, b] }\n";
    let cfg = config::from_str("t", y).expect("config");
    let v = &cfg.vservers[0];
    assert_eq!(v.service_source, Some("127.0.0.2:0".parse().expect("addr")));
    let src: SocketAddr = "127.0.0.2:5060".parse().expect("addr");
    let local = Local::from_addr(US.parse().expect("addr"), Transport::Udp);
    let balancer = Arc::new(Balancer::new(&cfg, v));
    let c = SipCore::new(SipParams::of(&cfg, v, local, balancer).with_service_source(Some(src)))
        .with_failover(v.failover.clone(), Arc::default());
    assert_eq!(c.service_source(), Some(src));
    let mut out = Vec::new();
    let mut raw = Vec::new();
    let client: SocketAddr = CLIENT.parse().expect("client");
    let Action::ToMember(m0) = c.handle_datagram_stateful(
        invite("call-s").as_bytes(),
        client,
        US.parse().expect("dst"),
        0,
        &mut out,
        &mut raw,
    ) else {
        panic!("not forwarded");
    };
    let text = String::from_utf8_lossy(&out).into_owned();
    assert!(
        text.contains("Via: SIP/2.0/UDP 127.0.0.2:5060;branch="),
        "{text}"
    );
    assert!(
        text.contains("Record-Route: <sip:127.0.0.1:5060;lr"),
        "{text}"
    );
    assert!(
        matches!(raw.as_slice(), [Send { dest: Dest::Addr(a), .. }] if *a == client),
        "{raw:?}"
    );
    let first = out.clone();
    raw.clear();
    let a = c.handle_datagram_stateful(
        answer(&first, 503, "Service Unavailable").as_bytes(),
        c.member_addr(m0).expect("m0"),
        src,
        S / 10,
        &mut out,
        &mut raw,
    );
    assert_eq!(a, Action::Drop(DropReason::Absorbed));
    // The ACK of the 503 and the next attempt: both toward services, from the service source.
    assert_eq!(raw.len(), 2, "{raw:?}");
    assert!(
        raw.iter().all(|s| matches!(s.dest, Dest::Service(_))),
        "{raw:?}"
    );
    let next = raw[1].clone();
    let Dest::Service(to) = next.dest else {
        unreachable!()
    };
    assert!(
        String::from_utf8_lossy(&next.bytes).contains("Via: SIP/2.0/UDP 127.0.0.2:5060;branch=")
    );
    raw.clear();
    let a = c.handle_datagram_stateful(
        answer(&next.bytes, 200, "OK").as_bytes(),
        to,
        src,
        S / 5,
        &mut out,
        &mut raw,
    );
    assert_eq!(a, Action::ToAddr(client));
    assert_eq!(first_line(&out), "SIP/2.0 200 OK");
}

/// The client's ACK of a final `code` it got for `invite(call_id)`: same branch, the To tag of
/// the answer (RFC 3261 §17.1.1.3).
fn ack_of(call_id: &str) -> String {
    invite(call_id)
        .replace("INVITE sip", "ACK sip")
        .replace("1 INVITE", "1 ACK")
        .replace(
            "To: <sip:svc@example.com>",
            "To: <sip:svc@example.com>;tag=s1",
        )
}

/// RFC 3261 §17.2.1 through the core: the service's 486 is relayed once at once, then sent
/// again by Timer G, byte for byte, until the client's ACK, which ends at fulcrum.
#[test]
fn a_refusal_is_retransmitted_to_the_udp_client_until_its_ack() {
    let c = core();
    let client: SocketAddr = CLIENT.parse().expect("client");
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(m0) = from(&c, &invite("g-1"), CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let fwd = out.clone();
    let svc = member_addr(&c, m0);
    let a = from(
        &c,
        &answer(&fwd, 486, "Busy Here"),
        &svc,
        S / 10,
        &mut out,
        &mut sends,
    );
    assert_eq!(a, Action::ToAddr(client));
    let relayed = out.clone();
    assert_eq!(first_line(&relayed), "SIP/2.0 486 Busy Here");
    assert!(
        first_line(&sends[0].1).starts_with("ACK "),
        "fulcrum ACKs the 486"
    );
    let mut timers = Vec::new();
    let mut now = S / 10;
    while timers.len() < 3 && now < 10 * S {
        now = poll(&c, now, &mut timers).expect("Timer G");
    }
    assert_eq!(
        timers.len(),
        3,
        "at T1, 2·T1 and 4·T1 after the 486: {timers:?}"
    );
    assert!(timers.iter().all(|(to, b)| *to == client && *b == relayed));
    let a = from(&c, &ack_of("g-1"), CLIENT, now + 1, &mut out, &mut sends);
    assert_eq!(
        a,
        Action::Drop(DropReason::Absorbed),
        "the ACK of a non-2xx ends here"
    );
    assert!(sends.is_empty(), "{sends:?}");
    timers.clear();
    let mut t = now + 1;
    while let Some(next) = poll(&c, t, &mut timers) {
        t = next;
    }
    assert!(timers.is_empty(), "nothing after the ACK: {timers:?}");
    assert!(c.transactions().is_empty(), "the entry is gone");
}

/// §13.2.2.4: the ACK of a 2xx is a request of its own, sent end to end; a client that reuses
/// the INVITE's branch for it must still reach the service.
#[test]
fn the_ack_of_a_2xx_goes_on_to_the_service_even_on_the_invites_branch() {
    let c = core();
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(m0) = from(&c, &invite("g-2"), CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let fwd = out.clone();
    let svc = member_addr(&c, m0);
    from(
        &c,
        &answer(&fwd, 200, "OK"),
        &svc,
        S / 10,
        &mut out,
        &mut sends,
    );
    let a = from(&c, &ack_of("g-2"), CLIENT, S / 5, &mut out, &mut sends);
    assert_eq!(a, Action::ToMember(m0), "{}", String::from_utf8_lossy(&out));
    assert!(first_line(&out).starts_with("ACK "));
    // The INVITE's retransmission is absorbed, not answered with the 2xx again.
    let a = from(&c, &invite("g-2"), CLIENT, S / 4, &mut out, &mut sends);
    assert_eq!(a, Action::Drop(DropReason::Absorbed));
    assert!(sends.is_empty(), "{sends:?}");
}

/// §17.2.2: the best answer relayed once the tries ran out is what a retransmitted request
/// gets again; and with every service silent a non-INVITE gets no 408 (RFC 4320 §4.2).
#[test]
fn the_relayed_best_answer_is_sent_again_and_a_silent_pool_gets_no_408() {
    let c = core();
    let client: SocketAddr = CLIENT.parse().expect("client");
    let msg = |id: &str| {
        invite(id)
            .replace("INVITE sip", "MESSAGE sip")
            .replace("1 INVITE", "1 MESSAGE")
    };
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(m0) = from(&c, &msg("b-1"), CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let mut to = (member_addr(&c, m0), out.clone());
    let mut given = None;
    for (i, code) in [503u16, 500, 503].into_iter().enumerate() {
        let text = answer(&to.1, code, "Trouble").replace("1 INVITE", "1 MESSAGE");
        from(
            &c,
            &text,
            &to.0,
            (i as u64 + 1) * S / 10,
            &mut out,
            &mut sends,
        );
        if let Some(next) = sends
            .iter()
            .find(|s| first_line(&s.1).starts_with("MESSAGE"))
        {
            to = (next.0.to_string(), next.1.to_vec());
        }
        if let Some(s) = sends.iter().find(|s| s.0 == client) {
            given = Some(s.1.clone());
        }
    }
    let given = given.expect("the best answer went to the client");
    assert_eq!(first_line(&given), "SIP/2.0 500 Trouble");
    let a = from(&c, &msg("b-1"), CLIENT, S, &mut out, &mut sends);
    assert_eq!(a, Action::Drop(DropReason::Absorbed));
    assert_eq!(sends, [(client, given)]);
    // A silent pool (a fresh one: these three just failed): Timer E toward the services,
    // never a word to the client.
    let c = core();
    let Action::ToMember(_) = from(&c, &msg("b-2"), CLIENT, 2 * S, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let mut timers = Vec::new();
    let mut t = 2 * S;
    while let Some(next) = poll(&c, t, &mut timers) {
        t = next;
    }
    assert!(timers.iter().all(|(to, _)| *to != client), "{timers:?}");
    assert!(!timers.is_empty());
}

/// A failover attempt carries what the first carried: a REGISTER's Path with the client's
/// flow token (else the registrar that stores it after a 503 could not reach the phone), and
/// an INVITE's Record-Route with it.
#[test]
fn a_failover_attempt_carries_the_first_attempts_path_and_flow_token() {
    let keys = crate::sip::flow::FlowKeys::new(vec![[7; 16]], 1, false).expect("keys");
    let c = core().with_flows(Arc::new(keys), config::PathMode::Always);
    let register = invite("reg-1")
        .replace("INVITE sip:svc@example.com", "REGISTER sip:example.com")
        .replace("1 INVITE", "1 REGISTER");
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(m0) = from(&c, &register, CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let first = String::from_utf8_lossy(&out).into_owned();
    let path_of = |text: &str| {
        text.lines()
            .find(|l| l.starts_with("Path:"))
            .map(str::to_owned)
    };
    let path = path_of(&first).expect("the first attempt has a Path");
    assert!(path.contains("fc-flow="), "{path}");
    let refused =
        answer(first.as_bytes(), 503, "Service Unavailable").replace("1 INVITE", "1 REGISTER");
    from(
        &c,
        &refused,
        &member_addr(&c, m0),
        S / 10,
        &mut out,
        &mut sends,
    );
    let second = sends
        .iter()
        .find(|s| first_line(&s.1).starts_with("REGISTER"))
        .map(|s| String::from_utf8_lossy(&s.1).into_owned())
        .expect("the second attempt");
    assert_eq!(
        path_of(&second),
        Some(path),
        "the same Path, the same token"
    );
}

/// The held table is bounded in bytes as well as in count, and a client retransmitting a held
/// INVITE again and again adds nothing to the timer heap: one queued entry per deadline.
#[test]
fn the_table_is_bounded_in_bytes_and_retransmissions_queue_no_timers() {
    let c = core();
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(_) = from(&c, &invite("w-1"), CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let held = c.transactions().bytes();
    assert!(
        held > 2 * invite("w-1").len(),
        "the request and its attempt: {held}"
    );
    let queued = c.transactions().timers_queued();
    for i in 0..10_000 {
        from(&c, &invite("w-1"), CLIENT, 1 + i, &mut out, &mut sends);
    }
    assert_eq!(c.transactions().timers_queued(), queued);
    assert_eq!(c.transactions().bytes(), held);
    // A budget smaller than two entries: the second request goes statelessly, counted.
    let c = core_with("failover: { max_pending_bytes: 65536 }, ", Arc::default());
    // About 12 KB each, so about 24 KB held with its attempt: two fit, a third does not.
    let big = |id: &str| {
        invite(id)
            .replace("z9hG4bKc1", &format!("z9hG4bK{id}"))
            .replace(
                "Content-Length: 0\r\n\r\n",
                &format!("Content-Length: 12000\r\n\r\n{}", "x".repeat(12_000)),
            )
    };
    for (i, id) in ["w-2", "w-3", "w-4"].into_iter().enumerate() {
        let a = from(&c, &big(id), CLIENT, i as u64, &mut out, &mut sends);
        assert!(matches!(a, Action::ToMember(_)), "{id}: {a:?}");
    }
    assert_eq!(
        c.transactions().len(),
        2,
        "the third one weighs too much to hold"
    );
    assert!(c.transactions().bytes() <= 65_536);
    let full = c
        .transactions()
        .counters
        .table_full
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(full, 1);
    // Finished entries give their bytes back.
    let mut timers = Vec::new();
    let mut t = 1;
    while let Some(next) = poll(&c, t, &mut timers) {
        t = next;
    }
    assert!(c.transactions().is_empty());
    assert_eq!(c.transactions().bytes(), 0);
}

/// A reload that turns failover off lets the requests already held finish: the rebuilt core
/// takes the table over, answers still find their transaction (the 486 is retransmitted to the
/// client until its ACK), and nothing new is held.
#[test]
fn a_reload_that_turns_failover_off_lets_held_requests_finish() {
    let c = core();
    let client: SocketAddr = CLIENT.parse().expect("client");
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(m0) = from(&c, &invite("off-1"), CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let fwd = out.clone();
    let svc = member_addr(&c, m0);
    // The rebuilt core: the same services, failover off, the old table handed over.
    let off = core_with("failover: off, ", Arc::clone(c.transactions()));
    let a = from(
        &off,
        &answer(&fwd, 486, "Busy Here"),
        &svc,
        S / 10,
        &mut out,
        &mut sends,
    );
    assert_eq!(a, Action::ToAddr(client));
    assert!(
        first_line(&sends[0].1).starts_with("ACK "),
        "still ACKed by fulcrum"
    );
    let mut timers = Vec::new();
    let mut t = S / 10;
    while timers.is_empty() && t < 5 * S {
        t = poll(&off, t, &mut timers).expect("Timer G");
    }
    assert_eq!(timers[0].0, client, "Timer G still runs: {timers:?}");
    let ack = invite("off-1")
        .replace("INVITE sip", "ACK sip")
        .replace("1 INVITE", "1 ACK")
        .replace(
            "To: <sip:svc@example.com>",
            "To: <sip:svc@example.com>;tag=s1",
        );
    let a = from(&off, &ack, CLIENT, t + 1, &mut out, &mut sends);
    assert_eq!(a, Action::Drop(DropReason::Absorbed));
    // A new request is not held.
    let fresh = invite("off-2").replace("z9hG4bKc1", "z9hG4bKc2");
    let Action::ToMember(_) = from(&off, &fresh, CLIENT, t + 2, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    assert!(sends.is_empty(), "no 100 from fulcrum: {sends:?}");
    assert_eq!(off.transactions().len(), 1);
}

/// With `aor_hash` a REGISTER that failed over pins nothing: its refresh, and a call to its
/// AoR, go to the registrar the AoR ranks first once that one is usable again, so bindings
/// and calls meet at one registrar.
#[test]
fn with_aor_hash_a_register_that_failed_over_converges_on_the_first_registrar() {
    let c = core_with("method: aor_hash, eject: off, ", Arc::default());
    let register = |cseq: u32, branch: &str| {
        format!(
            "REGISTER sip:example.com SIP/2.0\r\nVia: SIP/2.0/UDP 192.0.2.10:5062;branch=z9hG4bK{branch};rport\r\nMax-Forwards: 70\r\nFrom: <sip:alice@example.com>;tag=f1\r\nTo: <sip:alice@example.com>\r\nCall-ID: reg-conv\r\nCSeq: {cseq} REGISTER\r\nContact: <sip:alice@192.0.2.10:5062>\r\nExpires: 600\r\nContent-Length: 0\r\n\r\n"
        )
    };
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(first) = from(&c, &register(1, "r1"), CLIENT, 0, &mut out, &mut sends)
    else {
        panic!("not forwarded");
    };
    let refused = answer(&out, 503, "Service Unavailable")
        .replace("1 INVITE", "1 REGISTER")
        .replace("Retry-After: 30\r\n", "");
    from(
        &c,
        &refused,
        &member_addr(&c, first),
        S / 10,
        &mut out,
        &mut sends,
    );
    let second = sends
        .iter()
        .find(|s| first_line(&s.1).starts_with("REGISTER"))
        .expect("failed over")
        .clone();
    assert_ne!(second.0, c.member_addr(first).expect("first"));
    let ok = answer(&second.1, 200, "OK").replace("1 INVITE", "1 REGISTER");
    from(&c, &ok, &second.0.to_string(), S / 5, &mut out, &mut sends);
    // The refresh, minutes later: the first-ranked registrar again.
    let a = from(
        &c,
        &register(2, "r2"),
        CLIENT,
        300 * S,
        &mut out,
        &mut sends,
    );
    assert_eq!(
        a,
        Action::ToMember(first),
        "the refresh goes back to the AoR's registrar"
    );
    // And a call to the AoR meets the binding there.
    let call = invite("call-to-alice")
        .replace("INVITE sip:svc@example.com", "INVITE sip:alice@example.com")
        .replace("z9hG4bKc1", "z9hG4bKc9");
    let a = from(&c, &call, CLIENT, 301 * S, &mut out, &mut sends);
    assert_eq!(a, Action::ToMember(first));
}

/// A held request whose attempt its member's link could not take moves on at once inside
/// its transaction (no 503 from the shell beside it); a request nobody holds is left to the
/// shell's 503, and fulcrum's own ACK or CANCEL on the attempt's branch never moves it.
#[test]
fn an_attempt_no_link_took_moves_on_inside_its_transaction() {
    let c = core();
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(m0) = from(&c, &invite("q-1"), CLIENT, 0, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let first = out.clone();
    let cancel = String::from_utf8_lossy(&first)
        .replacen("INVITE sip", "CANCEL sip", 1)
        .replace("1 INVITE", "1 CANCEL");
    let mut raw = Vec::new();
    assert!(!c.attempt_unsent(cancel.as_bytes(), 1, &mut raw));
    assert!(c.attempt_unsent(&first, 1, &mut raw));
    let next = flat(raw);
    assert_eq!(next.len(), 1, "{next:?}");
    assert!(first_line(&next[0].1).starts_with("INVITE"));
    assert_ne!(next[0].0, c.member_addr(m0).expect("m0"));
    // An in-dialog request is forwarded statelessly: nothing holds it.
    let bye = invite("q-2")
        .replace("INVITE sip", "BYE sip")
        .replace("1 INVITE", "2 BYE")
        .replace(
            "To: <sip:svc@example.com>",
            "To: <sip:svc@example.com>;tag=s1",
        )
        .replace("z9hG4bKc1", "z9hG4bKc3");
    let Action::ToMember(_) = from(&c, &bye, CLIENT, 2, &mut out, &mut sends) else {
        panic!("not forwarded");
    };
    let mut raw = Vec::new();
    assert!(!c.attempt_unsent(&out, 3, &mut raw));
    assert!(raw.is_empty());
}

/// RFC 3261 §17.2.3: an RFC 2543 client (no magic cookie in its branch) ACKs a non-2xx final
/// with the final's To tag; fulcrum matches it to the INVITE it held without that tag, absorbs
/// it and stops Timer G. An ACK with another To tag is not the transaction's.
#[test]
fn an_rfc2543_clients_ack_ends_its_refused_invite() {
    let c = core();
    let client: SocketAddr = CLIENT.parse().expect("client");
    let old = |m: &str| m.replace(";branch=z9hG4bKc1", ";branch=2543abc");
    let (mut out, mut sends) = (Vec::new(), Vec::new());
    let Action::ToMember(m0) = from(&c, &old(&invite("o-1")), CLIENT, 0, &mut out, &mut sends)
    else {
        panic!("not forwarded");
    };
    let fwd = out.clone();
    let svc = member_addr(&c, m0);
    let a = from(
        &c,
        &answer(&fwd, 486, "Busy Here"),
        &svc,
        S / 10,
        &mut out,
        &mut sends,
    );
    assert_eq!(a, Action::ToAddr(client));
    let ack = |tag: &str| old(&ack_of("o-1")).replace(";tag=s1", &format!(";tag={tag}"));
    let a = from(&c, &ack("other"), CLIENT, S / 5, &mut out, &mut sends);
    assert_ne!(
        a,
        Action::Drop(DropReason::Absorbed),
        "another To tag: not ours"
    );
    let a = from(&c, &ack("s1"), CLIENT, S / 4, &mut out, &mut sends);
    assert_eq!(a, Action::Drop(DropReason::Absorbed));
    let mut timers = Vec::new();
    let mut t = S / 4;
    while let Some(next) = poll(&c, t, &mut timers) {
        t = next;
    }
    assert!(
        timers.iter().all(|(to, _)| *to != client),
        "Timer G stopped: {timers:?}"
    );
}
