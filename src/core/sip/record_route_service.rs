//! `fc-svc`: the dialog's service carried in fulcrum's Record-Route, so that any instance
//! with the same services routes the dialog's later requests to it.
use super::*;
use crate::balancer::Health;
use crate::config;
use crate::sip::{Local, Transport};
use std::sync::atomic::Ordering;

const US: &str = "127.0.0.1:5060";
const CLIENT: &str = "192.0.2.10:5062";

/// One instance: three services, Record-Route on.
fn instance() -> SipCore {
    let cfg = config::from_str(
        "t",
        "services:\n  - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }\n  - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }\n  - { name: c, address: 127.0.0.1:5073, protocol: sip-udp, hash_id: fw-c }\nvservers:\n  - { name: v, protocol: sip-udp, bind: 127.0.0.1:5060, record_route: true, services: [a, b, c] }\n",
    )
    .expect("config");
    let v = &cfg.vservers[0];
    let local = Local::from_addr(US.parse().expect("addr"), Transport::Udp);
    SipCore::new(SipParams::of(
        &cfg,
        v,
        local,
        Arc::new(Balancer::new(&cfg, v)),
    ))
}

fn send(c: &SipCore, text: &str) -> (Option<usize>, Vec<u8>) {
    send_at(c, text, 0)
}

fn send_at(c: &SipCore, text: &str, now: Nanos) -> (Option<usize>, Vec<u8>) {
    let mut out = Vec::new();
    let a = c.handle_datagram(
        text.as_bytes(),
        CLIENT.parse().expect("src"),
        US.parse().expect("dst"),
        now,
        &mut out,
    );
    match a {
        Action::ToMember(m) => (Some(m), out),
        _ => (None, out),
    }
}

fn invite(call_id: &str) -> String {
    format!(
        "INVITE sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1:5062;branch=z9hG4bK{call_id}\r\nMax-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n"
    )
}

fn bye(call_id: &str, route: &str) -> String {
    format!(
        "BYE sip:svc@10.0.0.9 SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1:5062;branch=z9hG4bKbye{call_id}\r\nRoute: {route}\r\nMax-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>;tag=s1\r\nCall-ID: {call_id}\r\nCSeq: 2 BYE\r\nContent-Length: 0\r\n\r\n"
    )
}

/// The Record-Route value fulcrum wrote into a forwarded request.
fn record_route(out: &[u8]) -> String {
    let msg = crate::sip::scan(out).expect("forwarded request scans");
    String::from_utf8_lossy(msg.record_route().expect("Record-Route")).into_owned()
}

#[test]
fn record_route_names_the_chosen_service_by_digest_only() {
    let c = instance();
    let (m, out) = send(&c, &invite("rr-1"));
    let m = m.expect("forwarded");
    let rr = record_route(&out);
    let id = c.balancer().members()[m].id_hash;
    let want = format!(
        "<sip:127.0.0.1:5060;lr;fc-svc={:016x}>",
        hash::service_digest(id)
    );
    assert_eq!(rr, want);
    // Neither the address nor the position of the service is in it.
    assert!(!rr.contains(":507"), "{rr}");
}

/// A dialog set up on instance A while its first-ranked service was disabled there
/// reaches the same service through instance B, which has every service UP and would
/// hash the Call-ID elsewhere, and which never saw the dialog.
#[test]
fn another_instance_with_another_health_view_routes_the_dialog_to_its_service() {
    let (a, b) = (instance(), instance());
    for i in 0..40 {
        let call = format!("cross-{i}");
        // Where B's hash puts the call (every service UP there).
        let ranked = send(&b, &invite(&call)).0.expect("b chooses");
        // On A that service is disabled: A sets the dialog up on another one.
        a.balancer().set_health(ranked, Health::OutOfService, 0);
        let (on_a, out) = send(&a, &invite(&call));
        a.balancer().set_health(ranked, Health::Up, 0);
        let on_a = on_a.expect("a chooses another");
        assert_ne!(on_a, ranked);
        let fresh = instance();
        let rr = record_route(&out);
        // The dialog's BYE reaches B (which pinned the call elsewhere itself) and an
        // instance that never saw the call: both follow the Route to A's choice.
        assert_eq!(send(&b, &bye(&call, &rr)).0, Some(on_a), "{call}: {rr}");
        assert_eq!(send(&fresh, &bye(&call, &rr)).0, Some(on_a), "{call}: {rr}");
    }
    assert_eq!(
        b.counters.routed_by_record_route.load(Ordering::Relaxed),
        40
    );
}

/// A request refused 513 (too many lines once forwarded) is refused before a member is
/// chosen: no dialog is pinned, nothing is counted as load (a flood of such INVITEs once
/// filled the services' counts for the idle timeout).
#[test]
fn a_request_refused_513_leaves_nothing_counted() {
    let c = instance();
    let extra: String = (0..crate::sip::MAX_HEADERS - 8)
        .map(|i| format!("X-H{i}: v\r\n"))
        .collect();
    let big = invite("big-1").replace("Content-Length: 0", &format!("{extra}Content-Length: 0"));
    assert!(
        crate::sip::scan(big.as_bytes()).is_ok(),
        "the request itself scans"
    );
    let (to_member, out) = send(&c, &big);
    assert_eq!(to_member, None);
    let reply = crate::sip::scan(&out).expect("a reply");
    assert_eq!(reply.status_code(), Some(513));
    let loads: Vec<u64> = (0..3)
        .map(|m| c.balancer().counters(m).map_or(0, |k| k.load()))
        .collect();
    assert_eq!(loads, [0, 0, 0]);
}

/// In-dialog requests routed by `fc-svc` keep the local pin fresh: a call longer than
/// the idle timeout (1 h here) stays counted on its service while requests flow.
#[test]
fn requests_routed_by_record_route_keep_a_long_call_counted() {
    const MIN: Nanos = 60 * 1_000_000_000;
    let c = instance();
    let (m, out) = send_at(&c, &invite("long-1"), 0);
    let m = m.expect("forwarded");
    let rr = record_route(&out);
    // The service's 200 makes it a dialog.
    let mut ok = Vec::new();
    let reply = crate::sip::Reply {
        code: 200,
        reason: "OK",
        retry_after_s: None,
    };
    crate::sip::build_response(&crate::sip::scan(&out).expect("scan"), &reply, &mut ok)
        .expect("200");
    let member = c.member_addr(m).expect("member");
    let us = "127.0.0.1:5060".parse().expect("addr");
    assert!(matches!(
        c.handle_datagram(&ok, member, us, 0, &mut Vec::new()),
        Action::ToAddr(_)
    ));
    let info = bye("long-1", &rr)
        .replace("BYE sip", "INFO sip")
        .replace("2 BYE", "3 INFO");
    assert_eq!(send_at(&c, &info, 40 * MIN).0, Some(m));
    c.sweep(70 * MIN);
    let active = c.balancer().counters(m).map_or(0, |k| k.active());
    assert_eq!(active, 1, "swept while its requests still flowed");
    assert_eq!(send_at(&c, &bye("long-1", &rr), 71 * MIN).0, Some(m));
    assert_eq!(c.balancer().counters(m).map_or(9, |k| k.active()), 0);
}

#[test]
fn forged_stale_or_foreign_values_fall_back_to_the_normal_choice() {
    let c = instance();
    let normal = send(&c, &bye("fb-1", "<sip:10.9.9.9;lr>")).0;
    assert!(normal.is_some());
    for route in [
        // A digest no member has.
        "<sip:127.0.0.1:5060;lr;fc-svc=0123456789abcdef>".to_owned(),
        // Not 16 hex digits.
        "<sip:127.0.0.1:5060;lr;fc-svc=zz>".to_owned(),
        "<sip:127.0.0.1:5060;lr;fc-svc=0123456789abcdef0>".to_owned(),
    ] {
        assert_eq!(send(&c, &bye("fb-1", &route)).0, normal, "{route}");
    }
    assert_eq!(c.counters.routed_by_record_route.load(Ordering::Relaxed), 0);
    // A real digest, but in a Route that is not fulcrum's: not ours to follow.
    let d = hash::service_digest(c.balancer().members()[2].id_hash);
    let foreign = format!("<sip:10.9.9.9;lr;fc-svc={d:016x}>");
    assert_eq!(send(&c, &bye("fb-1", &foreign)).0, normal);
    assert_eq!(c.counters.routed_by_record_route.load(Ordering::Relaxed), 0);
}

#[test]
fn a_named_service_that_is_down_is_not_followed_but_a_disabled_one_is() {
    let c = instance();
    let d = hash::service_digest(c.balancer().members()[1].id_hash);
    let route = format!("<sip:127.0.0.1:5060;lr;fc-svc={d:016x}>");
    assert_eq!(send(&c, &bye("dn-1", &route)).0, Some(1));
    c.balancer().set_health(1, Health::OutOfService, 0);
    assert_eq!(send(&c, &bye("dn-2", &route)).0, Some(1));
    c.balancer().set_health(1, Health::Down, 0);
    let other = send(&c, &bye("dn-3", &route)).0;
    assert!(other.is_some_and(|m| m != 1), "{other:?}");
}
