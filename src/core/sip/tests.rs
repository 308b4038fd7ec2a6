use super::*;
use crate::balancer::Health;
use crate::config;
use crate::sip::Transport;
use std::sync::atomic::Ordering;

const CLIENT: &str = "192.0.2.10:5062";
const US: &str = "127.0.0.1:5060";

fn core(record_route: bool) -> SipCore {
    core_with(record_route, "call_id_hash")
}

fn core_with(record_route: bool, method: &str) -> SipCore {
    let y = format!(
        "services:\n  - {{ name: a, address: 127.0.0.1:5071, protocol: sip-udp }}\n  - {{ name: b, address: 127.0.0.1:5072, protocol: sip-udp }}\nvservers:\n  - {{ name: v, protocol: sip-udp, bind: 127.0.0.1:5060, method: {method}, services: [a, b] }}\n"
    );
    let cfg = config::from_str("t", &y).expect("config");
    let v = &cfg.vservers[0];
    SipCore::new(SipParams {
        name: "v".into(),
        local: Local::from_addr(US.parse().expect("addr"), Transport::Udp),
        record_route,
        method: v.method,
        hash_params: v.hash.clone(),
        balancer: Arc::new(Balancer::new(&cfg, v)),
        member_addrs: vec![
            "127.0.0.1:5071".parse().expect("addr"),
            "127.0.0.1:5072".parse().expect("addr"),
        ],
        max_dialogs: 100,
        dialog_idle: Duration::from_secs(3600),
        member_transports: Vec::new(),
        legs: Vec::new(),
        service_source: None,
        pool_failovers: Vec::new(),
    })
}

fn invite(call_id: &str, max_forwards: u32) -> String {
    format!(
        "INVITE sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1:5062;branch=z9hG4bKc1;rport\r\nMax-Forwards: {max_forwards}\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n"
    )
}

fn handle(c: &SipCore, bytes: &str, src: &str, out: &mut Vec<u8>) -> Action {
    c.handle_datagram(
        bytes.as_bytes(),
        src.parse().expect("src"),
        US.parse().expect("dst"),
        0,
        out,
    )
}

#[test]
fn request_goes_to_a_member_with_our_via_and_rport_filled() {
    let c = core(true);
    let mut out = Vec::new();
    let a = handle(&c, &invite("x1", 70), CLIENT, &mut out);
    assert!(matches!(a, Action::ToMember(_)), "{a:?}");
    let msg = crate::sip::scan(&out).expect("rewritten request scans");
    let vias: Vec<_> = msg.vias().collect();
    assert_eq!(vias.len(), 2);
    assert_eq!(vias[0].host, b"127.0.0.1");
    assert!(vias[0].branch.is_some_and(|b| b.starts_with(b"z9hG4bK")));
    assert_eq!(vias[1].received, Some(&b"192.0.2.10"[..]));
    assert_eq!(msg.max_forwards(), MaxForwards::Value(69));
    assert!(msg.record_route().is_some());
    // Same request again (a retransmission): same member, same bytes.
    let mut again = Vec::new();
    assert_eq!(handle(&c, &invite("x1", 70), CLIENT, &mut again), a);
    assert_eq!(again, out);
}

#[test]
fn dialog_key_is_the_call_id_hash_key_whatever_the_spacing() {
    let text = "INVITE sip:a@b SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1;branch=z9hG4bKq\r\ni:   spaced-id@x  \t\r\nCSeq: 1 INVITE\r\nFrom: <sip:a@x>;tag=1\r\nTo: <sip:b@y>\r\nMax-Forwards: 70\r\n\r\n";
    let msg = crate::sip::scan(text.as_bytes()).expect("scan");
    let ctx = RequestCtx {
        src: CLIENT.parse().expect("addr"),
        dst: US.parse().expect("addr"),
        payload: Payload::Sip(&msg),
    };
    let KeyOutcome::Key(k) = key::extract(Method::CallIdHash, &HashParams::default(), &ctx) else {
        panic!("no key")
    };
    assert_eq!(msg.call_id(), Some(&b"spaced-id@x"[..]));
    assert_eq!(hash::key_hash(k.as_bytes()), hash::key_hash(b"spaced-id@x"));
}

#[test]
fn replies_483_and_503() {
    let c = core(false);
    let mut out = Vec::new();
    let a = handle(&c, &invite("x2", 0), CLIENT, &mut out);
    assert_eq!(a, Action::Reply(CLIENT.parse().expect("addr")));
    assert_eq!(
        crate::sip::scan(&out).expect("scan").status_code(),
        Some(483)
    );
    let now = 0;
    c.balancer().set_health(0, Health::Down, now);
    c.balancer().set_health(1, Health::Down, now);
    let a = handle(&c, &invite("x3", 70), CLIENT, &mut out);
    assert!(matches!(a, Action::Reply(_)));
    let msg = crate::sip::scan(&out).expect("scan");
    assert_eq!(msg.status_code(), Some(503));
    assert!(msg.header(b"Retry-After").is_some());
    assert_eq!(c.counters.replies_503.load(Ordering::Relaxed), 1);
}

#[test]
fn response_from_member_loses_our_via_and_goes_to_the_client() {
    let c = core(false);
    let mut fwd = Vec::new();
    let Action::ToMember(m) = handle(&c, &invite("x4", 70), CLIENT, &mut fwd) else {
        panic!("not forwarded")
    };
    let req = crate::sip::scan(&fwd).expect("scan");
    let mut resp = Vec::new();
    crate::sip::build_response(
        &req,
        &crate::sip::Reply {
            code: 200,
            reason: "OK",
            retry_after_s: None,
        },
        &mut resp,
    )
    .expect("response");
    let member = c.member_addr(m).expect("member").to_string();
    let mut out = Vec::new();
    let a = handle(
        &c,
        std::str::from_utf8(&resp).expect("utf8"),
        &member,
        &mut out,
    );
    // rport was requested: back to the source address and port (RFC 3581 §4).
    assert_eq!(a, Action::ToAddr(CLIENT.parse().expect("addr")));
    assert_eq!(crate::sip::scan(&out).expect("scan").vias().count(), 1);
}

#[test]
fn foreign_responses_loops_and_garbage_are_dropped_and_counted() {
    let c = core(false);
    let mut out = Vec::new();
    let foreign = "SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP 10.9.9.9:5060;branch=z9hG4bKzz\r\nFrom: <sip:a@x>;tag=1\r\nTo: <sip:b@y>;tag=2\r\nCall-ID: f\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n";
    assert_eq!(
        handle(&c, foreign, CLIENT, &mut out),
        Action::Drop(DropReason::NotOurs)
    );
    let to_us = "BYE sip:a@127.0.0.1:5060 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:5071;branch=z9hG4bKb\r\nMax-Forwards: 70\r\nFrom: <sip:b@y>;tag=2\r\nTo: <sip:a@x>;tag=1\r\nCall-ID: l\r\nCSeq: 2 BYE\r\nContent-Length: 0\r\n\r\n";
    assert_eq!(
        handle(&c, to_us, "127.0.0.1:5071", &mut out),
        Action::Drop(DropReason::Loop)
    );
    assert_eq!(
        handle(&c, "\u{1}\u{2}garbage", CLIENT, &mut out),
        Action::Drop(DropReason::Malformed)
    );
    assert_eq!(c.counters.not_ours.load(Ordering::Relaxed), 1);
    assert_eq!(c.counters.loops.load(Ordering::Relaxed), 1);
    assert_eq!(c.counters.malformed.load(Ordering::Relaxed), 1);
}

/// A call whose service went DOWN: its BYE goes to another service and ends the dialog,
/// so the dead service's load count falls back (it stayed up for the idle timeout).
#[test]
fn a_bye_rerouted_from_a_down_member_ends_its_dialog() {
    let c = core(false);
    let mut out = Vec::new();
    let Action::ToMember(m) = handle(&c, &invite("gone-1", 70), CLIENT, &mut out) else {
        panic!("forwarded")
    };
    let active = |m: usize| c.balancer().counters(m).map_or(0, |k| k.load());
    assert_eq!(active(m), 1);
    c.balancer().set_health(m, Health::Down, 0);
    let bye = invite("gone-1", 70)
        .replace("INVITE sip", "BYE sip")
        .replace("1 INVITE", "2 BYE")
        .replace(
            "To: <sip:svc@example.com>",
            "To: <sip:svc@example.com>;tag=t1",
        );
    let Action::ToMember(other) = handle(&c, &bye, CLIENT, &mut out) else {
        panic!("forwarded")
    };
    assert_ne!(other, m);
    assert_eq!((active(m), active(other)), (0, 0));
}

#[test]
fn a_forwarded_request_that_cannot_be_delivered_is_answered_503_to_its_sender() {
    let c = core(false);
    let mut fwd = Vec::new();
    assert!(matches!(
        handle(&c, &invite("u1", 70), CLIENT, &mut fwd),
        Action::ToMember(_)
    ));
    let mut out = Vec::new();
    // rport was requested: back to the source address and port (RFC 3581 §4).
    assert_eq!(
        c.unavailable(&fwd, 0, &mut out),
        Action::ToAddr(CLIENT.parse().expect("addr"))
    );
    let msg = crate::sip::scan(&out).expect("scan");
    assert_eq!(msg.status_code(), Some(503));
    assert!(msg.header(b"Retry-After").is_some());
    assert_eq!(msg.vias().count(), 1, "fulcrum's Via is gone");
    assert_eq!(c.counters.replies_503.load(Ordering::Relaxed), 1);
    // An ACK is never answered.
    let ack = invite("u2", 70).replace("INVITE", "ACK");
    let mut fwd = Vec::new();
    assert!(matches!(
        handle(&c, &ack, CLIENT, &mut fwd),
        Action::ToMember(_)
    ));
    assert_eq!(
        c.unavailable(&fwd, 0, &mut out),
        Action::Drop(DropReason::AckNotForwarded)
    );
}

#[test]
fn dialog_stays_on_its_member_when_another_returns() {
    // A twin core (same config, so same hashing) finds a call that ranks member 0 first.
    let probe = core(false);
    let mut out = Vec::new();
    let call = (0..)
        .map(|i| format!("aff-{i}"))
        .find(|id| handle(&probe, &invite(id, 70), CLIENT, &mut out) == Action::ToMember(0))
        .expect("some call ranks member 0 first");
    let c = core(false);
    c.balancer().set_health(0, Health::Down, 0);
    assert_eq!(
        handle(&c, &invite(&call, 70), CLIENT, &mut out),
        Action::ToMember(1)
    );
    c.balancer().set_health(0, Health::Up, 0);
    // Established on 1: it stays there although 0, its first choice, is back.
    assert_eq!(
        handle(&c, &invite(&call, 70), CLIENT, &mut out),
        Action::ToMember(1)
    );
    // A new call with the same ranking goes to 0 again.
    let other = (0..)
        .map(|i| format!("aff-new-{i}"))
        .find(|id| handle(&probe, &invite(id, 70), CLIENT, &mut out) == Action::ToMember(0))
        .expect("another call ranking 0 first");
    assert_eq!(
        handle(&c, &invite(&other, 70), CLIENT, &mut out),
        Action::ToMember(0)
    );
}

/// A message of `method` in dialog `call_id` (`to_tag` set when in-dialog), from `via`.
fn request(method: &str, call_id: &str, to_tag: Option<&str>, via: &str) -> String {
    let to_tag = to_tag.map(|t| format!(";tag={t}")).unwrap_or_default();
    format!(
        "{method} sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/UDP {via};branch=z9hG4bK{method}{call_id};rport\r\nMax-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>{to_tag}\r\nCall-ID: {call_id}\r\nCSeq: 2 {method}\r\nContent-Length: 0\r\n\r\n"
    )
}

/// Load counted on the members: open dialogs and requests pending their 2xx.
fn open(c: &SipCore) -> u64 {
    (0..c.member_count())
        .map(|m| c.balancer().counters(m).map_or(0, |k| k.load()))
        .sum()
}

/// Active flows (dialogs confirmed by a 2xx) and pending requests counted on the members.
fn counts(c: &SipCore) -> (u64, u64) {
    (0..c.member_count())
        .filter_map(|m| c.balancer().counters(m))
        .fold((0, 0), |(a, p), k| (a + k.active(), p + k.pending()))
}

/// Only requests that make (or belong to) a dialog are pinned for the dialog and counted
/// as load: other requests are pinned for their transaction only (their retransmissions
/// reach the same service, even under round robin), uncounted, and gone after Timer F.
#[test]
fn only_dialog_requests_are_pinned() {
    let c = core_with(false, "round_robin");
    let mut out = Vec::new();
    for i in 0..5 {
        let opt = request("OPTIONS", &format!("o{i}"), None, "10.0.0.1:5062");
        let Action::ToMember(m) = handle(&c, &opt, CLIENT, &mut out) else {
            panic!("not forwarded")
        };
        let msg = request("MESSAGE", &format!("m{i}"), None, "10.0.0.1:5062");
        let Action::ToMember(k) = handle(&c, &msg, CLIENT, &mut out) else {
            panic!("not forwarded")
        };
        // Retransmissions: the same services again, whatever round robin would pick.
        assert_eq!(handle(&c, &opt, CLIENT, &mut out), Action::ToMember(m));
        assert_eq!(handle(&c, &msg, CLIENT, &mut out), Action::ToMember(k));
    }
    assert_eq!(open(&c), 0, "no load counted");
    c.sweep(33_000_000_000);
    assert_eq!(c.dialogs().len(), 0, "gone after Timer F");
    for (i, method) in ["INVITE", "SUBSCRIBE", "REFER", "REGISTER"]
        .iter()
        .enumerate()
    {
        let r = request(method, &format!("d{i}"), None, "10.0.0.1:5062");
        assert!(matches!(
            handle(&c, &r, CLIENT, &mut out),
            Action::ToMember(_)
        ));
    }
    // An in-dialog request of a dialog fulcrum has not seen (after a restart, say).
    let info = request("INFO", "d9", Some("t9"), "10.0.0.1:5062");
    assert!(matches!(
        handle(&c, &info, CLIENT, &mut out),
        Action::ToMember(_)
    ));
    assert_eq!((c.dialogs().len(), open(&c)), (5, 5));
}

/// A CANCEL of a re-INVITE (To tag) leaves the call established; a CANCEL of the initial
/// INVITE, and a BYE from either side, end it.
#[test]
fn cancel_of_a_reinvite_keeps_the_dialog_and_a_service_bye_ends_it() {
    let c = core(false);
    let mut out = Vec::new();
    let Action::ToMember(m) = handle(&c, &invite("call-1", 70), CLIENT, &mut out) else {
        panic!("not forwarded")
    };
    assert_eq!(open(&c), 1);
    let cancel_re = request("CANCEL", "call-1", Some("t1"), "10.0.0.1:5062");
    assert_eq!(
        handle(&c, &cancel_re, CLIENT, &mut out),
        Action::ToMember(m)
    );
    assert_eq!(open(&c), 1, "re-INVITE cancelled, call still up");
    // The service hangs up: routed to the client, and the call no longer counts.
    let member = c.member_addr(m).expect("member").to_string();
    let bye = request("BYE", "call-1", Some("f1"), &member)
        .replace("sip:svc@example.com SIP", "sip:a@10.0.0.1:5062 SIP");
    assert_eq!(
        handle(&c, &bye, &member, &mut out),
        Action::ToAddr("10.0.0.1:5062".parse().expect("addr"))
    );
    assert_eq!(open(&c), 0);
    // The initial INVITE's CANCEL ends a call.
    assert!(matches!(
        handle(&c, &invite("call-2", 70), CLIENT, &mut out),
        Action::ToMember(_)
    ));
    assert_eq!(open(&c), 1);
    let cancel = request("CANCEL", "call-2", None, "10.0.0.1:5062");
    assert!(matches!(
        handle(&c, &cancel, CLIENT, &mut out),
        Action::ToMember(_)
    ));
    assert_eq!(open(&c), 0);
}

/// A response from someone who is not a service goes only to a service's host: a forged
/// fulcrum Via cannot make fulcrum relay datagrams to any address.
#[test]
fn a_response_from_a_non_member_goes_only_to_a_service() {
    let c = core(false);
    let mut out = Vec::new();
    let ours = "SIP/2.0/UDP 127.0.0.1:5060;branch=z9hG4bK-fc-0000000000000000";
    let forged = format!(
        "SIP/2.0 200 OK\r\nVia: {ours}\r\nVia: SIP/2.0/UDP 198.51.100.66:9;branch=z9hG4bKx\r\nFrom: <sip:a@x>;tag=1\r\nTo: <sip:b@y>;tag=2\r\nCall-ID: r\r\nCSeq: 1 OPTIONS\r\nContent-Length: 7\r\n\r\npayload"
    );
    assert_eq!(
        handle(&c, &forged, CLIENT, &mut out),
        Action::Drop(DropReason::NotOurs)
    );
    assert!(out.is_empty());
    assert_eq!(c.counters.not_ours.load(Ordering::Relaxed), 1);
    // The same from a service is its business (it answers a client's request).
    assert_eq!(
        handle(&c, &forged, "127.0.0.1:5071", &mut out),
        Action::ToAddr("198.51.100.66:9".parse().expect("addr"))
    );
    // A service answering from another port of its host is still a service.
    assert_eq!(
        handle(&c, &forged, "127.0.0.1:6000", &mut out),
        Action::ToAddr("198.51.100.66:9".parse().expect("addr"))
    );
    // A client's response to a service's in-dialog request goes back to the service.
    let answer = forged.replace("198.51.100.66:9", "127.0.0.1:5072");
    assert_eq!(
        handle(&c, &answer, CLIENT, &mut out),
        Action::ToAddr("127.0.0.1:5072".parse().expect("addr"))
    );
}

/// An ACK that cannot be forwarded is dropped and counted as such, never as a reply.
#[test]
fn an_unforwardable_ack_counts_no_reply() {
    let c = core(false);
    let mut out = Vec::new();
    let ack = invite("ack-1", 0).replace("INVITE", "ACK");
    assert_eq!(
        handle(&c, &ack, CLIENT, &mut out),
        Action::Drop(DropReason::AckNotForwarded)
    );
    c.balancer().set_health(0, Health::Down, 0);
    c.balancer().set_health(1, Health::Down, 0);
    let ack = invite("ack-2", 70).replace("INVITE", "ACK");
    assert_eq!(
        handle(&c, &ack, CLIENT, &mut out),
        Action::Drop(DropReason::AckNotForwarded)
    );
    assert_eq!(c.counters.acks_not_forwarded.load(Ordering::Relaxed), 2);
    assert_eq!(c.counters.replies_483.load(Ordering::Relaxed), 0);
    assert_eq!(c.counters.replies_503.load(Ordering::Relaxed), 0);
}

/// The fuzz finding: an INVITE of 255 header lines scans, but forwarded with fulcrum's Via
/// and Record-Route it would have 257, which fulcrum itself would refuse when the answer
/// came back. It is answered 513 (RFC 3261 §21.5.14) and nothing is forwarded; with 254
/// lines it is forwarded and the forwarded request scans.
#[test]
fn a_request_fulcrum_could_not_take_back_is_answered_513() {
    let c = core(true);
    let mut out = Vec::new();
    let padded = |lines: usize| {
        let base = invite("hdr-1", 70);
        let n = base.matches("\r\n").count() - 2;
        let pad: String = (0..lines - n).map(|i| format!("X-Pad: {i}\r\n")).collect();
        base.replace(
            "Content-Length: 0\r\n",
            &format!("{pad}Content-Length: 0\r\n"),
        )
    };
    let big = padded(255);
    assert_eq!(
        crate::sip::scan(big.as_bytes())
            .expect("scans")
            .header_count(),
        255
    );
    assert!(matches!(
        handle(&c, &big, CLIENT, &mut out),
        Action::Reply(_)
    ));
    assert_eq!(
        crate::sip::scan(&out).expect("scan").status_code(),
        Some(513)
    );
    assert_eq!(c.counters.replies_513.load(Ordering::Relaxed), 1);
    let fits = padded(254);
    assert!(matches!(
        handle(&c, &fits, CLIENT, &mut out),
        Action::ToMember(_)
    ));
    assert_eq!(
        crate::sip::scan(&out)
            .expect("forwarded scans")
            .header_count(),
        256
    );
}

/// A datagram too large to carry fulcrum's additions is answered 513.
#[test]
fn an_oversized_datagram_request_is_answered_513() {
    let c = core(false);
    let mut out = Vec::new();
    let big = invite("big-1", 70).replace(
        "Content-Length: 0\r\n\r\n",
        &format!("Content-Length: 65200\r\n\r\n{}", "x".repeat(65_200)),
    );
    assert!(matches!(
        handle(&c, &big, CLIENT, &mut out),
        Action::Reply(_)
    ));
    assert_eq!(
        crate::sip::scan(&out).expect("scan").status_code(),
        Some(513)
    );
    assert_eq!(c.counters.replies_513.load(Ordering::Relaxed), 1);
    assert_eq!(c.dialogs().len(), 0, "nothing pinned");
}

/// `forwarded`'s answer `code` from member `m`, handled at `now`.
fn answer_at(c: &SipCore, forwarded: &[u8], m: usize, code: u16, now: Nanos) -> Action {
    let req = crate::sip::scan(forwarded).expect("scan");
    let mut resp = Vec::new();
    let reply = crate::sip::Reply {
        code,
        reason: "Answer",
        retry_after_s: None,
    };
    crate::sip::build_response(&req, &reply, &mut resp).expect("response");
    let mut out = Vec::new();
    c.handle_datagram(
        &resp,
        c.member_addr(m).expect("member"),
        US.parse().expect("dst"),
        now,
        &mut out,
    )
}

fn invite_at(c: &SipCore, call_id: &str, now: Nanos, fwd: &mut Vec<u8>) -> usize {
    let a = c.handle_datagram(
        invite(call_id, 70).as_bytes(),
        CLIENT.parse().expect("src"),
        US.parse().expect("dst"),
        now,
        fwd,
    );
    let Action::ToMember(m) = a else {
        panic!("not forwarded: {a:?}")
    };
    m
}

const SEC: Nanos = 1_000_000_000;

/// An INVITE nobody answers is pending load, never an active flow, and is gone with its
/// count at Timer B.
#[test]
fn an_unanswered_invite_is_pending_until_timer_b() {
    let c = core(false);
    let mut fwd = Vec::new();
    invite_at(&c, "nobody-1", 0, &mut fwd);
    assert_eq!(counts(&c), (0, 1));
    c.sweep(32 * SEC);
    assert_eq!((c.dialogs().len(), counts(&c)), (1, (0, 1)));
    c.sweep(33 * SEC);
    assert_eq!((c.dialogs().len(), counts(&c)), (0, (0, 0)));
}

/// The service's 2xx on its way to the client makes the dialog: an active flow, kept for
/// the idle timeout; a provisional answer before it holds the request past Timer B.
#[test]
fn a_2xx_from_the_service_confirms_the_dialog() {
    let c = core(false);
    let mut fwd = Vec::new();
    let m = invite_at(&c, "ok-1", 0, &mut fwd);
    assert!(matches!(
        answer_at(&c, &fwd, m, 180, SEC),
        Action::ToAddr(_)
    ));
    c.sweep(40 * SEC);
    assert_eq!(counts(&c), (0, 1), "ringing: still pending past Timer B");
    assert!(matches!(
        answer_at(&c, &fwd, m, 200, 50 * SEC),
        Action::ToAddr(_)
    ));
    assert_eq!(counts(&c), (1, 0));
    assert!(c.dialogs().is_confirmed(hash::key_hash(b"ok-1")));
    c.sweep(1800 * SEC);
    assert_eq!(counts(&c), (1, 0), "a dialog lives for the idle timeout");
}

/// A final answer above 2xx ends the pending request at once; the client's ACK of it (hop
/// by hop, forwarded by the stateless proxy) still reaches the service that answered, even
/// under round robin.
#[test]
fn a_non_2xx_answer_ends_the_request_and_its_ack_reaches_the_service() {
    let c = core_with(false, "round_robin");
    let mut fwd = Vec::new();
    let m = invite_at(&c, "busy-1", 0, &mut fwd);
    assert!(matches!(
        answer_at(&c, &fwd, m, 486, SEC),
        Action::ToAddr(_)
    ));
    assert_eq!(counts(&c), (0, 0));
    let ack = request("ACK", "busy-1", Some("uas"), "10.0.0.1:5062").replace("2 ACK", "1 ACK");
    let mut out = Vec::new();
    for _ in 0..3 {
        let a = c.handle_datagram(
            ack.as_bytes(),
            CLIENT.parse().expect("src"),
            US.parse().expect("dst"),
            2 * SEC,
            &mut out,
        );
        assert_eq!(a, Action::ToMember(m));
    }
    assert!(!c.dialogs().is_confirmed(hash::key_hash(b"busy-1")));
    c.sweep(6 * SEC);
    assert_eq!(c.dialogs().len(), 0, "gone after the ACK window");
}

/// Least connection sees calls being set up: two INVITEs in a row, unanswered, go to the
/// two services.
#[test]
fn least_connection_counts_pending_requests() {
    let c = core_with(false, "least_connection");
    let mut fwd = Vec::new();
    let a = invite_at(&c, "lc-1", 0, &mut fwd);
    let b = invite_at(&c, "lc-2", 0, &mut fwd);
    assert_ne!(a, b);
    assert_eq!(counts(&c), (0, 2));
}

/// `max_sessions` of 8, four dialogs up, then a flood of INVITEs with fresh Call-IDs nobody
/// answers: the dialogs stay pinned (their BYEs reach their services, under round robin) and
/// counted; a call set up during the flood gets its dialog too.
#[test]
fn a_flood_of_unanswered_invites_never_evicts_confirmed_dialogs() {
    let cfg = config::from_str(
        "t",
        "services:\n  - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }\n  - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }\nvservers:\n  - { name: v, protocol: sip-udp, bind: 127.0.0.1:5060, method: round_robin, max_sessions: 8, services: [a, b] }\n",
    )
    .expect("config");
    let v = &cfg.vservers[0];
    let c = SipCore::new(SipParams::of(
        &cfg,
        v,
        Local::from_addr(US.parse().expect("addr"), Transport::Udp),
        Arc::new(Balancer::new(&cfg, v)),
    ));
    let mut fwd = Vec::new();
    let mut calls = Vec::new();
    let mut call = |c: &SipCore, id: String, now: Nanos, calls: &mut Vec<(String, usize)>| {
        let m = invite_at(c, &id, now, &mut fwd);
        assert!(matches!(answer_at(c, &fwd, m, 200, now), Action::ToAddr(_)));
        calls.push((id, m));
    };
    for i in 0..4 {
        call(&c, format!("up-{i}"), 0, &mut calls);
    }
    for i in 0..200u64 {
        invite_at(&c, &format!("flood-{i}"), i * 1_000_000, &mut Vec::new());
        if i == 100 {
            call(&c, "mid".to_owned(), i * 1_000_000, &mut calls);
        }
    }
    assert_eq!(c.dialogs().len(), 8);
    assert_eq!(counts(&c), (5, 3));
    assert_eq!(c.dialogs().refused(), 0);
    let mut out = Vec::new();
    for (id, m) in &calls {
        let bye = request("BYE", id, Some("uas"), "10.0.0.1:5062");
        let a = c.handle_datagram(
            bye.as_bytes(),
            CLIENT.parse().expect("src"),
            US.parse().expect("dst"),
            SEC,
            &mut out,
        );
        assert_eq!(a, Action::ToMember(*m), "{id}");
    }
    assert_eq!(counts(&c).0, 0);
}

/// An INVITE from `CLIENT` whose `vias` Via lines (as a routing loop stacks them) come first,
/// the client's own on top, and whose Call-ID is `call_id` (none when empty).
fn stacked_vias(vias: usize, call_id: &str) -> String {
    let mut m = String::from(
        "INVITE sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1:5062;branch=z9hG4bKtop;rport\r\n",
    );
    for i in 1..vias {
        m.push_str(&format!(
            "Via: SIP/2.0/UDP 10.1.{}.{}:5060;branch=z9hG4bKloop{i}\r\n",
            i / 256,
            i % 256
        ));
    }
    if !call_id.is_empty() {
        m.push_str(&format!("Call-ID: {call_id}\r\n"));
    }
    m.push_str("Max-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n");
    m
}

/// A client's request with more header lines than the scanner reads (300 Vias) is answered
/// 513 (RFC 3261 §21.5.14), on a datagram and on a stream connection alike, with every Via
/// value in order, its Call-ID, CSeq, From and To (§8.2.6.2), to where its top Via says
/// (RFC 3581 §4); counted as over the header-line limit and as a 513.
#[test]
fn a_request_past_the_line_limit_is_answered_513_with_every_via() {
    let c = core(true);
    let req = stacked_vias(300, "loop-1");
    let want = crate::sip::scan_for_reply(req.as_bytes()).expect("scans for a reply");
    assert_eq!(
        crate::sip::scan(req.as_bytes()).err(),
        Some(crate::sip::ScanError::TooManyHeaders)
    );
    let client: SocketAddr = CLIENT.parse().expect("addr");
    for (i, origin) in [
        Origin::Client { conn: None },
        Origin::Client { conn: Some(7) },
    ]
    .into_iter()
    .enumerate()
    {
        let mut out = Vec::new();
        let a = c.handle(
            req.as_bytes(),
            origin,
            client,
            US.parse().expect("dst"),
            0,
            &mut out,
        );
        assert_eq!(a, Action::Reply(client), "{origin:?}");
        let r = crate::sip::scan(&out).expect("the 513 scans");
        assert_eq!(r.status_code(), Some(513));
        assert!(r.header_count() <= crate::sip::MAX_HEADERS);
        let branches: Vec<_> = r.vias().map(|v| v.branch).collect();
        assert_eq!(branches, want.vias().map(|v| v.branch).collect::<Vec<_>>());
        assert_eq!(branches.len(), 300);
        assert_eq!(r.call_id(), Some(&b"loop-1"[..]));
        assert_eq!(
            r.cseq().map(|c| (c.seq, c.method)),
            Some((1, &b"INVITE"[..]))
        );
        assert_eq!(r.from_tag(), Some(&b"f1"[..]));
        assert!(r.to_tag().is_some());
        let n = i as u64 + 1;
        assert_eq!(c.counters.replies_513.load(Ordering::Relaxed), n);
        assert_eq!(c.counters.over_header_limit.load(Ordering::Relaxed), n);
        assert_eq!(c.counters.requests_in.load(Ordering::Relaxed), n);
    }
    assert_eq!(c.counters.malformed.load(Ordering::Relaxed), 0);
    assert_eq!(c.dialogs().len(), 0, "nothing pinned");
}

/// Past the line limit, what cannot be answered is dropped and counted as before, and as over
/// the limit: a request without a Call-ID to copy, a response, a service's request.
#[test]
fn past_the_line_limit_what_cannot_be_answered_is_dropped() {
    let c = core(false);
    let mut out = Vec::new();
    let no_call_id = stacked_vias(300, "");
    assert_eq!(
        handle(&c, &no_call_id, CLIENT, &mut out),
        Action::Drop(DropReason::Malformed)
    );
    let response =
        stacked_vias(300, "r-1").replace("INVITE sip:svc@example.com SIP/2.0", "SIP/2.0 200 OK");
    assert_eq!(
        handle(&c, &response, CLIENT, &mut out),
        Action::Drop(DropReason::Malformed)
    );
    let from_service = c.handle(
        stacked_vias(300, "s-1").as_bytes(),
        Origin::Member(0),
        "127.0.0.1:5071".parse().expect("addr"),
        US.parse().expect("dst"),
        0,
        &mut out,
    );
    assert_eq!(from_service, Action::Drop(DropReason::Malformed));
    assert_eq!(c.counters.over_header_limit.load(Ordering::Relaxed), 3);
    assert_eq!(c.counters.malformed.load(Ordering::Relaxed), 3);
    assert_eq!(c.counters.replies_513.load(Ordering::Relaxed), 0);
}

/// A stream request longer than the frame limit, whose header section arrived whole, is
/// answered 513; one whose header section was cut at the limit is not (Vias may be missing),
/// nor is a service's. Each is counted as over the size limit.
#[test]
fn a_stream_request_past_the_size_limit_is_answered_513_from_its_head() {
    let c = core(false);
    let client: SocketAddr = CLIENT.parse().expect("addr");
    let stream = Origin::Client { conn: Some(3) };
    let limit = crate::sip::DEFAULT_MAX_MESSAGE;
    let big = invite("big-stream", 70).replace(
        "Content-Length: 0\r\n\r\n",
        &format!("Content-Length: 70000\r\n\r\n{}", "v".repeat(70_000)),
    );
    let head = &big.as_bytes()[..limit];
    let mut out = Vec::new();
    assert_eq!(
        c.too_large(head, stream, client, &mut out),
        Action::Reply(client)
    );
    let r = crate::sip::scan(&out).expect("the 513 scans");
    assert_eq!(r.status_code(), Some(513));
    assert_eq!(r.call_id(), Some(&b"big-stream"[..]));
    // A header section longer than the limit: cut before its empty line.
    let long_head = invite("long-head", 70).replace(
        "Content-Length: 0\r\n",
        &format!("X-Pad: {}\r\nContent-Length: 0\r\n", "p".repeat(limit)),
    );
    let cut = &long_head.as_bytes()[..limit];
    assert_eq!(
        c.too_large(cut, stream, client, &mut out),
        Action::Drop(DropReason::Malformed)
    );
    assert!(out.is_empty());
    assert_eq!(
        c.too_large(head, Origin::Member(0), client, &mut out),
        Action::Drop(DropReason::Malformed)
    );
    assert_eq!(c.counters.over_size_limit.load(Ordering::Relaxed), 3);
    assert_eq!(c.counters.replies_513.load(Ordering::Relaxed), 1);
    assert_eq!(c.counters.malformed.load(Ordering::Relaxed), 2);
}

fn with_flows(c: SipCore, path: config::PathMode, nonce: u64) -> SipCore {
    let keys = crate::sip::flow::FlowKeys::new(vec![[7; 16]], nonce, false).expect("keys");
    c.with_flows(Arc::new(keys), path)
}

fn register(extra: &str) -> String {
    format!(
        "REGISTER sip:example.com SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1:5062;branch=z9hG4bKr1;rport\r\nMax-Forwards: 70\r\nFrom: <sip:alice@example.com>;tag=f1\r\nTo: <sip:alice@example.com>\r\nCall-ID: reg1\r\nCSeq: 1 REGISTER\r\nContact: <sip:alice@10.0.0.1:5062>\r\n{extra}Content-Length: 0\r\n\r\n"
    )
}

/// The token of the Path a forwarded request carries, if any.
fn path_token(out: &[u8]) -> Option<Vec<u8>> {
    let msg = crate::sip::scan(out).expect("scans");
    let path = msg.header(b"Path")?;
    let uri = crate::sip::parse_uri(crate::sip::parse_name_addr(path)?.uri)?;
    assert_eq!(uri.host, b"127.0.0.1", "the Path names fulcrum");
    assert_eq!(uri.port, Some(5060));
    assert!(uri.param(b"lr").is_some(), "a loose route (RFC 3327 §5.2)");
    uri.param(crate::sip::flow::FLOW_PARAM).map(<[u8]>::to_vec)
}

#[test]
fn a_register_gets_a_path_naming_its_flow_as_the_path_setting_says() {
    use config::PathMode;
    let client: SocketAddr = CLIENT.parse().expect("addr");
    for (mode, extra, wanted) in [
        (PathMode::Auto, "", false),
        (PathMode::Auto, "Supported: path\r\n", true),
        (
            PathMode::Auto,
            "Supported: gruu, outbound\r\nk: replaces,path\r\n",
            true,
        ),
        (PathMode::Auto, "Supported: pathology\r\n", false),
        (PathMode::Always, "", true),
        (PathMode::Off, "Supported: path\r\n", false),
    ] {
        let c = with_flows(core(false), mode, 1);
        let mut out = Vec::new();
        let a = handle(&c, &register(extra), CLIENT, &mut out);
        assert!(matches!(a, Action::ToMember(_)), "{a:?}");
        let token = path_token(&out);
        assert_eq!(token.is_some(), wanted, "{mode:?} {extra:?}");
        if let Some(t) = token {
            let keys = crate::sip::flow::FlowKeys::new(vec![[7; 16]], 1, false)
                .expect("keys")
                .for_listener("v");
            let flow = keys.verify(&t, 0).expect("fulcrum's token");
            assert_eq!(
                (flow.transport, flow.addr, flow.conn),
                (Transport::Udp, client, None)
            );
            assert_eq!(c.counters.paths_added.load(Ordering::Relaxed), 1);
        }
    }
    // Without flow keys (a core built without them), no Path at all.
    let mut out = Vec::new();
    handle(
        &core(false),
        &register("Supported: path\r\n"),
        CLIENT,
        &mut out,
    );
    assert_eq!(path_token(&out), None);
}

/// A request from the registrar toward the registered client, routed by the Path it stored.
fn toward_client(route_token: &[u8], method: &str) -> String {
    let token = String::from_utf8_lossy(route_token);
    format!(
        "{method} sip:alice@10.0.0.1:9 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:5071;branch=z9hG4bKs1\r\nRoute: <sip:127.0.0.1:5060;lr;fc-flow={token}>\r\nMax-Forwards: 70\r\nFrom: <sip:bob@example.com>;tag=b1\r\nTo: <sip:alice@example.com>\r\nCall-ID: in1\r\nCSeq: 1 {method}\r\nContent-Length: 0\r\n\r\n"
    )
}

#[test]
fn a_service_request_with_a_flow_token_reaches_the_client_where_it_registered_from() {
    let c = with_flows(core(true), config::PathMode::Always, 1);
    let mut out = Vec::new();
    handle(&c, &register(""), CLIENT, &mut out);
    let token = path_token(&out).expect("a Path");
    let a = handle(
        &c,
        &toward_client(&token, "INVITE"),
        "127.0.0.1:5071",
        &mut out,
    );
    // To the address the REGISTER came from, not the Contact's 10.0.0.1:9.
    assert_eq!(a, Action::ToAddr(CLIENT.parse().expect("addr")));
    let msg = crate::sip::scan(&out).expect("scans");
    assert_eq!(msg.route(), None, "fulcrum's own Route is removed");
    assert_eq!(msg.vias().count(), 2);
    // The dialog's Record-Route carries the token, so its later requests find the flow too.
    let rr = msg.record_route().expect("record-routed");
    assert!(
        rr.windows(token.len()).any(|w| w == token.as_slice()),
        "{}",
        String::from_utf8_lossy(rr)
    );
    assert_eq!(c.counters.routed_by_flow.load(Ordering::Relaxed), 1);
}

#[test]
fn a_forged_token_is_refused_403_and_a_flow_of_another_start_430() {
    let c = with_flows(core(false), config::PathMode::Always, 1);
    let member = "127.0.0.1:5071";
    let mut out = Vec::new();
    handle(&c, &register(""), CLIENT, &mut out);
    let mut token = path_token(&out).expect("a Path");
    let last = token.len() - 1;
    token[last] = if token[last] == b'0' { b'1' } else { b'0' };
    let a = handle(&c, &toward_client(&token, "INVITE"), member, &mut out);
    assert_eq!(a, Action::Reply(member.parse().expect("addr")));
    assert!(
        out.starts_with(b"SIP/2.0 403 "),
        "{}",
        String::from_utf8_lossy(&out)
    );
    assert_eq!(c.counters.flow_forged.load(Ordering::Relaxed), 1);
    // A stream token made by another start of fulcrum (another nonce): the flow is gone.
    let other = crate::sip::flow::FlowKeys::new(vec![[7; 16]], 2, false)
        .expect("keys")
        .for_listener("v");
    let stream = other.sign(Transport::Tcp, CLIENT.parse().expect("addr"), Some(5));
    handle(
        &c,
        &toward_client(stream.as_bytes(), "INVITE"),
        member,
        &mut out,
    );
    assert!(
        out.starts_with(b"SIP/2.0 430 Flow Failed"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    // A sound stream token of this start, on a UDP vserver: not a flow it can reach.
    let here = crate::sip::flow::FlowKeys::new(vec![[7; 16]], 1, false)
        .expect("keys")
        .for_listener("v");
    let stream = here.sign(Transport::Tcp, CLIENT.parse().expect("addr"), Some(5));
    handle(
        &c,
        &toward_client(stream.as_bytes(), "INVITE"),
        member,
        &mut out,
    );
    assert!(out.starts_with(b"SIP/2.0 430 "));
    assert_eq!(c.counters.flow_failed.load(Ordering::Relaxed), 2);
}

/// Two vservers on one address with the same keys: a token made on one addresses nothing on
/// the other, which answers it as a forgery (docs/sip.md, "Path and flow tokens").
#[test]
fn a_token_from_one_vserver_is_refused_403_on_another() {
    let a = with_flows(core(true), config::PathMode::Always, 1);
    let mut b = core(true);
    b.name = "w".into();
    let b = with_flows(b, config::PathMode::Always, 1);
    let member = "127.0.0.1:5071";
    let mut out = Vec::new();
    handle(&a, &register(""), CLIENT, &mut out);
    let token = path_token(&out).expect("a Path");
    let on_b = handle(&b, &toward_client(&token, "INVITE"), member, &mut out);
    assert_eq!(on_b, Action::Reply(member.parse().expect("addr")));
    assert!(
        out.starts_with(b"SIP/2.0 403 "),
        "{}",
        String::from_utf8_lossy(&out)
    );
    assert_eq!(b.counters.flow_forged.load(Ordering::Relaxed), 1);
    assert_eq!(b.counters.routed_by_flow.load(Ordering::Relaxed), 0);
    // The vserver that made it still routes it.
    let on_a = handle(&a, &toward_client(&token, "INVITE"), member, &mut out);
    assert_eq!(on_a, Action::ToAddr(CLIENT.parse().expect("addr")));
    assert_eq!(a.counters.flow_forged.load(Ordering::Relaxed), 0);
}

#[test]
fn a_client_cannot_use_a_flow_token_to_reach_another_client() {
    let c = with_flows(core(false), config::PathMode::Always, 1);
    let mut out = Vec::new();
    handle(&c, &register(""), "192.0.2.99:5060", &mut out);
    let victim = path_token(&out).expect("a Path");
    // The same request from a client: balanced to a service like any client request.
    let a = handle(&c, &toward_client(&victim, "MESSAGE"), CLIENT, &mut out);
    assert!(matches!(a, Action::ToMember(_)), "{a:?}");
    assert_eq!(c.counters.routed_by_flow.load(Ordering::Relaxed), 0);
}

#[test]
fn a_clients_dialog_carries_its_flow_in_record_route_unless_path_is_off() {
    for (mode, wanted) in [
        (config::PathMode::Auto, true),
        (config::PathMode::Off, false),
    ] {
        let c = with_flows(core(true), mode, 1);
        let mut out = Vec::new();
        handle(&c, &invite("rr1", 70), CLIENT, &mut out);
        let msg = crate::sip::scan(&out).expect("scans");
        let rr = msg.record_route().expect("record-routed");
        assert_eq!(
            rr.windows(8).any(|w| w == b"fc-flow="),
            wanted,
            "{mode:?}: {}",
            String::from_utf8_lossy(rr)
        );
        // An OPTIONS sets up no dialog: no token.
        handle(
            &c,
            &request("OPTIONS", "o1", None, "10.0.0.1:5062"),
            CLIENT,
            &mut out,
        );
        let msg = crate::sip::scan(&out).expect("scans");
        let rr = msg.record_route().expect("record-routed");
        assert!(!rr.windows(8).any(|w| w == b"fc-flow="));
    }
}

#[test]
fn only_a_register_that_gets_a_path_marks_its_connection_as_a_registration() {
    let auto = with_flows(core(false), config::PathMode::Auto, 1);
    let always = with_flows(core(false), config::PathMode::Always, 1);
    let plain = register("");
    let asks = register("Supported: path\r\n");
    assert!(
        !auto.registers_flow(plain.as_bytes()),
        "auto, no Supported: path"
    );
    assert!(auto.registers_flow(asks.as_bytes()));
    assert!(always.registers_flow(plain.as_bytes()));
    assert!(!always.registers_flow(invite("i1", 70).as_bytes()));
    assert!(
        !core(false).registers_flow(asks.as_bytes()),
        "no flow keys, no Path"
    );
    assert!(!always.registers_flow(b"REGISTER garbage"));
}
