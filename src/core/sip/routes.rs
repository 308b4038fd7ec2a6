//! Routing rules through the SIP decision: each request reaches only its rule's pool, a
//! refusal never reaches a service, affinity beats the rules, failover stays in the pool.

use super::*;
use crate::balancer::Health;
use crate::config;
use crate::sip::Transport;
use bytes::Bytes;
use std::sync::atomic::Ordering;

const CLIENT: &str = "192.0.2.10:5062";
const US: &str = "127.0.0.1:5060";

/// reg1, reg2 (registrars), p1, p2 (call proxies, the default pool), gw (emergency gateway).
const CONFIG: &str = "services:
  - { name: p1, address: 127.0.0.1:5071, protocol: sip-udp }
  - { name: p2, address: 127.0.0.1:5072, protocol: sip-udp }
  - { name: reg1, address: 127.0.0.1:5081, protocol: sip-udp }
  - { name: reg2, address: 127.0.0.1:5082, protocol: sip-udp }
  - { name: gw, address: 127.0.0.1:5091, protocol: sip-udp }
vservers:
  - name: v
    protocol: sip-udp
    bind: 127.0.0.1:5060
    services: [p1, p2]
    routes:
      - { name: registrar, match: { method: REGISTER }, services: [reg1, reg2], method: aor_hash }
      - { name: emergency, normalize: true, match: { ruri_user: { prefix: ['112', '911'] } }, services: [gw] }
      - { name: scanners, match: { header: { name: User-Agent, regex: '(?i)friendly-scanner|sipvicious' } }, drop: true }
      - { name: barred, match: { ruri_user: { prefix: ['00'] } }, reject: { code: 403, reason: International calls barred } }
";

fn core_of(yaml: &str) -> (SipCore, config::Config) {
    let cfg = config::from_str("t", yaml).expect("config");
    let v = &cfg.vservers[0];
    let c = SipCore::new(SipParams::of(
        &cfg,
        v,
        Local::from_addr(US.parse().expect("addr"), Transport::Udp),
        Arc::new(Balancer::new(&cfg, v)),
    ));
    (c, cfg)
}

fn request(method: &str, user: &str, call_id: &str, extra: &str) -> String {
    format!(
        "{method} sip:{user}@example.com SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1:5062;branch=z9hG4bK{call_id}\r\nMax-Forwards: 70\r\nFrom: <sip:alice@example.com>;tag=f1\r\nTo: <sip:{user}@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 {method}\r\n{extra}Content-Length: 0\r\n\r\n"
    )
}

fn send(c: &SipCore, text: &str, out: &mut Vec<u8>) -> Action {
    c.handle_datagram(
        text.as_bytes(),
        CLIENT.parse().expect("src"),
        US.parse().expect("dst"),
        0,
        out,
    )
}

fn member_name(c: &SipCore, a: Action) -> String {
    match a {
        Action::ToMember(m) => c.balancer().members()[m].name.clone(),
        other => format!("{other:?}"),
    }
}

#[test]
fn each_request_reaches_only_its_rules_pool() {
    let (c, _) = core_of(CONFIG);
    let mut out = Vec::new();
    for i in 0..40 {
        let reg = member_name(
            &c,
            send(
                &c,
                &request("REGISTER", &format!("u{i}"), &format!("r{i}"), ""),
                &mut out,
            ),
        );
        assert!(reg == "reg1" || reg == "reg2", "{reg}");
        let call = member_name(
            &c,
            send(
                &c,
                &request("INVITE", &format!("bob{i}"), &format!("c{i}"), ""),
                &mut out,
            ),
        );
        assert!(call == "p1" || call == "p2", "{call}");
    }
    let e = member_name(
        &c,
        send(&c, &request("INVITE", "+9-1-1", "e1", ""), &mut out),
    );
    assert_eq!(e, "gw");
    // The same AoR always reaches the same registrar (aor_hash), whatever its Call-ID.
    let first = member_name(
        &c,
        send(&c, &request("REGISTER", "carol", "x1", ""), &mut out),
    );
    for k in 0..10 {
        let again = member_name(
            &c,
            send(
                &c,
                &request("REGISTER", "carol", &format!("x{k}-b"), ""),
                &mut out,
            ),
        );
        assert_eq!(again, first);
    }
    let routes = c.balancer().routes().expect("routes");
    assert_eq!(routes.rules[0].name, "registrar");
    let matched = |i: usize| {
        c.balancer()
            .route_counters(i)
            .expect("counters")
            .matched
            .load(Ordering::Relaxed)
    };
    assert_eq!((matched(0), matched(1)), (51, 1));
}

#[test]
fn a_refusal_never_reaches_a_service() {
    let (c, _) = core_of(CONFIG);
    let mut out = Vec::new();
    let a = send(&c, &request("INVITE", "0044123", "i1", ""), &mut out);
    assert_eq!(a, Action::Reply(CLIENT.parse().expect("addr")));
    let answer = crate::sip::scan(&out).expect("answer");
    assert_eq!(answer.status_code(), Some(403));
    assert!(out.starts_with(b"SIP/2.0 403 International calls barred\r\n"));
    // Its retransmission gets the same answer; the ACK of it is absorbed, never forwarded.
    assert_eq!(
        send(&c, &request("INVITE", "0044123", "i1", ""), &mut out),
        a
    );
    let answer = crate::sip::scan(&out).expect("answer");
    let tag = String::from_utf8(answer.to_tag().expect("fulcrum's tag").to_vec()).expect("utf8");
    let ack = request("ACK", "0044123", "i1", "").replace(
        "To: <sip:0044123@example.com>",
        &format!("To: <sip:0044123@example.com>;tag={tag}"),
    );
    assert_eq!(send(&c, &ack, &mut out), Action::Drop(DropReason::Absorbed));
    // An ACK with another tag is not fulcrum's to end.
    let other = ack.replace(&tag, "fc0000000000000000");
    assert_ne!(
        send(&c, &other, &mut out),
        Action::Drop(DropReason::Absorbed)
    );
    // A scanner is dropped, with a To tag too (a tag matching no dialog skips nothing).
    let ua = "User-Agent: friendly-scanner\r\n";
    assert_eq!(
        send(&c, &request("OPTIONS", "100", "s1", ua), &mut out),
        Action::Drop(DropReason::Routed)
    );
    let tagged = request("INVITE", "100", "s2", ua).replace(
        "To: <sip:100@example.com>",
        "To: <sip:100@example.com>;tag=t9",
    );
    assert_eq!(
        send(&c, &tagged, &mut out),
        Action::Drop(DropReason::Routed)
    );
    let counters = |i: usize| c.balancer().route_counters(i).expect("counters");
    assert_eq!(counters(2).dropped.load(Ordering::Relaxed), 2);
    assert_eq!(counters(3).rejected.load(Ordering::Relaxed), 2);
    for m in 0..c.balancer().members().len() {
        assert_eq!(c.balancer().counters(m).expect("counters").load(), 0);
    }
}

#[test]
fn a_dialog_follows_its_service_whatever_the_rules() {
    let (c, _) = core_of(CONFIG);
    let mut out = Vec::new();
    // Set up a call to the gateway, then an in-dialog request that no rule would send there.
    let to = send(&c, &request("INVITE", "112", "d1", ""), &mut out);
    assert_eq!(member_name(&c, to), "gw");
    let info = request("INFO", "somebody", "d1", "").replace(
        "To: <sip:somebody@example.com>",
        "To: <sip:somebody@example.com>;tag=uas",
    );
    assert_eq!(member_name(&c, send(&c, &info, &mut out)), "gw");
    // An INVITE sent again with credentials (new CSeq, same Call-ID) reaches the challenger.
    let retry = request("INVITE", "112", "d1", "Proxy-Authorization: Digest x\r\n")
        .replace("CSeq: 1 INVITE", "CSeq: 2 INVITE");
    assert_eq!(member_name(&c, send(&c, &retry, &mut out)), "gw");
}

#[test]
fn a_pools_failover_never_leaves_it() {
    let (c, _) = core_of(CONFIG);
    let gw = c
        .balancer()
        .members()
        .iter()
        .position(|m| m.name == "gw")
        .expect("gw");
    c.balancer().set_health(gw, Health::Down, 0);
    let mut out = Vec::new();
    let a = send(&c, &request("INVITE", "911", "f1", ""), &mut out);
    assert_eq!(a, Action::Reply(CLIENT.parse().expect("addr")));
    assert_eq!(
        crate::sip::scan(&out).expect("answer").status_code(),
        Some(503)
    );
    let defaults = c.balancer().routes().expect("routes").rules.len();
    assert_eq!(
        c.balancer()
            .route_counters(1)
            .expect("c")
            .unavailable
            .load(Ordering::Relaxed),
        1
    );
    assert_eq!(
        c.balancer()
            .route_counters(defaults)
            .expect("c")
            .unavailable
            .load(Ordering::Relaxed),
        0
    );
    // The registrars: one DOWN, the other takes every AoR.
    let reg1 = c
        .balancer()
        .members()
        .iter()
        .position(|m| m.name == "reg1")
        .expect("reg1");
    c.balancer().set_health(reg1, Health::Down, 0);
    for i in 0..20 {
        assert_eq!(
            member_name(
                &c,
                send(
                    &c,
                    &request("REGISTER", &format!("u{i}"), &format!("q{i}"), ""),
                    &mut out
                )
            ),
            "reg2"
        );
    }
    // The default pool never takes a route-only member, even by least connection.
    for i in 0..20 {
        let m = member_name(
            &c,
            send(
                &c,
                &request("MESSAGE", &format!("m{i}"), &format!("m{i}"), ""),
                &mut out,
            ),
        );
        assert!(m == "p1" || m == "p2", "{m}");
    }
}

#[test]
fn a_refusing_default_needs_no_services_of_the_vservers_own() {
    let yaml = "services:\n  - { name: reg, address: 127.0.0.1:5081, protocol: sip-udp }\nvservers:\n  - name: v\n    protocol: sip-udp\n    bind: 127.0.0.1:5060\n    routes:\n      - { name: registrar, match: { method: [REGISTER] }, services: [reg] }\n    default: { reject: { code: 405 } }\n";
    let (c, _) = core_of(yaml);
    let mut out = Vec::new();
    assert_eq!(
        member_name(&c, send(&c, &request("REGISTER", "a", "z1", ""), &mut out)),
        "reg"
    );
    assert!(matches!(
        send(&c, &request("INVITE", "a", "z2", ""), &mut out),
        Action::Reply(_)
    ));
    assert!(out.starts_with(b"SIP/2.0 405 Method Not Allowed\r\n"));
}

/// Two pools of gateways, one with `failover: off`, one with its own codes: a failover code
/// from the first reaches the caller, from the second moves the call to the pool's other
/// gateway (never to the vserver's own pool, whose failover is the default).
const POOL_FAILOVER: &str = "services:
  - { name: p1, address: 127.0.0.1:5071, protocol: sip-udp }
  - { name: ga1, address: 127.0.0.1:5081, protocol: sip-udp }
  - { name: ga2, address: 127.0.0.1:5082, protocol: sip-udp }
  - { name: gb1, address: 127.0.0.1:5091, protocol: sip-udp }
  - { name: gb2, address: 127.0.0.1:5092, protocol: sip-udp }
vservers:
  - name: v
    protocol: sip-udp
    bind: 127.0.0.1:5060
    services: [p1]
    routes:
      - { name: plain, match: { ruri_user: { prefix: ['1'] } }, services: [ga1, ga2], failover: off }
      - { name: busy, match: { ruri_user: { prefix: ['2'] } }, services: [gb1, gb2], failover: { codes: [486], tries: 2 } }
";

/// The core of `yaml`'s vserver with its failover (the vserver's and its pools').
fn stateful_core(yaml: &str) -> SipCore {
    let (c, cfg) = core_of(yaml);
    c.with_failover(cfg.vservers[0].failover.clone(), Arc::default())
}

/// A client's request through the stateful path: the action, `out`, and what else was sent.
fn send_held(
    c: &SipCore,
    text: &str,
    src: &str,
    now: Nanos,
    out: &mut Vec<u8>,
) -> (Action, Vec<Bytes>) {
    let mut sends = Vec::new();
    let a = c.handle_datagram_stateful(
        text.as_bytes(),
        src.parse().expect("src"),
        US.parse().expect("dst"),
        now,
        out,
        &mut sends,
    );
    (a, sends.into_iter().map(|s| s.bytes).collect())
}

#[test]
fn each_pool_fails_over_with_its_own_setting() {
    let c = stateful_core(POOL_FAILOVER);
    let mut out = Vec::new();
    let name = |m: usize| c.balancer().members()[m].name.clone();
    let line = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    // `plain` has failover off: nothing is held, and a 503 goes to the caller as it came.
    let (a, sends) = send_held(&c, &request("INVITE", "100", "a1", ""), CLIENT, 0, &mut out);
    let Action::ToMember(m) = a else {
        panic!("not forwarded: {a:?}");
    };
    assert!(name(m).starts_with("ga"), "{}", name(m));
    assert!(
        sends.is_empty(),
        "no 100 Trying from a stateless forward: {sends:?}"
    );
    assert_eq!(c.transactions().len(), 0);
    let from_ga = c.member_addr(m).expect("addr").to_string();
    let busy = stateful::tests::answer(&out, 503, "Service Unavailable");
    let (a, _) = send_held(&c, &busy, &from_ga, 1_000_000, &mut out);
    assert!(matches!(a, Action::ToAddr(_)), "{a:?}");
    assert_eq!(line(&out), "SIP/2.0 503 Service Unavailable");
    // `busy` fails over on 486 (its own code) to its other gateway.
    let (a, sends) = send_held(&c, &request("INVITE", "200", "b1", ""), CLIENT, 0, &mut out);
    let Action::ToMember(m) = a else {
        panic!("not forwarded: {a:?}");
    };
    assert!(name(m).starts_with("gb"), "{}", name(m));
    assert_eq!(
        sends.iter().map(|b| line(b)).collect::<Vec<_>>(),
        ["SIP/2.0 100 Trying"]
    );
    assert_eq!(c.transactions().len(), 1);
    let from_gb = c.member_addr(m).expect("addr").to_string();
    let (a, sends) = send_held(
        &c,
        &stateful::tests::answer(&out, 486, "Busy Here"),
        &from_gb,
        1_000_000,
        &mut out,
    );
    assert_eq!(a, Action::Drop(DropReason::Absorbed));
    let next = sends
        .iter()
        .find(|b| b.starts_with(b"INVITE"))
        .expect("the next attempt");
    let other = if name(m) == "gb1" { "gb2" } else { "gb1" };
    let other_addr = c
        .balancer()
        .members()
        .iter()
        .position(|x| x.name == other)
        .and_then(|i| c.member_addr(i))
        .expect("other gateway");
    // The attempt goes to the other gateway: its answer finds the transaction.
    let (a, sends) = send_held(
        &c,
        &stateful::tests::answer(next, 486, "Busy Here"),
        &other_addr.to_string(),
        2_000_000,
        &mut out,
    );
    // Two tries, both busy: the caller gets the best answer, 486.
    let finals: Vec<String> = sends.iter().map(|b| line(b)).chain([line(&out)]).collect();
    assert!(
        finals.iter().any(|l| l == "SIP/2.0 486 Busy Here"),
        "{a:?} {finals:?}"
    );
    // A 503 is no failover code of `busy`'s: it goes to the caller.
    let (a, _) = send_held(&c, &request("INVITE", "201", "b2", ""), CLIENT, 0, &mut out);
    let Action::ToMember(m) = a else {
        panic!("not forwarded: {a:?}");
    };
    let from_gb = c.member_addr(m).expect("addr").to_string();
    let (_, sends) = send_held(
        &c,
        &stateful::tests::answer(&out, 503, "Service Unavailable"),
        &from_gb,
        1_000_000,
        &mut out,
    );
    let relayed: Vec<String> = sends.iter().map(|b| line(b)).chain([line(&out)]).collect();
    assert!(
        relayed
            .iter()
            .any(|l| l == "SIP/2.0 503 Service Unavailable"),
        "{relayed:?}"
    );
    assert!(
        !sends.iter().any(|b| b.starts_with(b"INVITE")),
        "no next attempt on 503"
    );
}

#[test]
fn a_vserver_without_failover_holds_for_a_pool_that_has_it() {
    let yaml = POOL_FAILOVER
        .replace(
            "    services: [p1]\n",
            "    services: [p1]\n    failover: off\n",
        )
        .replace(", failover: off }", " }");
    let c = stateful_core(&yaml);
    let mut out = Vec::new();
    // `plain` now takes the vserver's (off); `busy` keeps its own.
    let (a, _) = send_held(&c, &request("INVITE", "100", "a1", ""), CLIENT, 0, &mut out);
    assert!(matches!(a, Action::ToMember(_)));
    assert_eq!(c.transactions().len(), 0);
    let (a, _) = send_held(&c, &request("INVITE", "300", "d1", ""), CLIENT, 0, &mut out);
    assert!(matches!(a, Action::ToMember(_)));
    assert_eq!(
        c.transactions().len(),
        0,
        "the default pool: the vserver's off"
    );
    let (a, _) = send_held(&c, &request("INVITE", "200", "b1", ""), CLIENT, 0, &mut out);
    assert!(matches!(a, Action::ToMember(_)));
    assert_eq!(c.transactions().len(), 1);
}

#[test]
fn a_pools_hash_length_cuts_its_key() {
    // url_hash over the first 12 bytes of the Request-URI (`sip:7000000`): every number that
    // starts alike reaches one gateway, whatever follows.
    let yaml = "services:
  - { name: p1, address: 127.0.0.1:5071, protocol: sip-udp }
  - { name: g1, address: 127.0.0.1:5081, protocol: sip-udp }
  - { name: g2, address: 127.0.0.1:5082, protocol: sip-udp }
  - { name: g3, address: 127.0.0.1:5083, protocol: sip-udp }
vservers:
  - name: v
    protocol: sip-udp
    bind: 127.0.0.1:5060
    services: [p1]
    routes:
      - { name: gw, match: { method: INVITE }, services: [g1, g2, g3], method: url_hash, hash_length: 11 }
";
    let (c, _) = core_of(yaml);
    assert_eq!(c.balancer().pool_hash(1).hash_length, 11);
    assert_eq!(c.balancer().pool_hash(0).hash_length, 80);
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for prefix in 0..12 {
        let first = member_name(
            &c,
            send(
                &c,
                &request("INVITE", &format!("{prefix:07}"), &format!("h{prefix}"), ""),
                &mut out,
            ),
        );
        for tail in 0..5 {
            let again = member_name(
                &c,
                send(
                    &c,
                    &request(
                        "INVITE",
                        &format!("{prefix:07}{tail}{tail}"),
                        &format!("h{prefix}-{tail}"),
                        "",
                    ),
                    &mut out,
                ),
            );
            assert_eq!(again, first, "{prefix:07} then {tail}");
        }
        seen.insert(first);
    }
    assert!(seen.len() > 1, "one gateway took every prefix: {seen:?}");
}

#[test]
fn a_pools_slow_start_caps_its_member_back_from_down() {
    let yaml = "services:
  - { name: p1, address: 127.0.0.1:5071, protocol: sip-udp }
  - { name: g1, address: 127.0.0.1:5081, protocol: sip-udp }
  - { name: g2, address: 127.0.0.1:5082, protocol: sip-udp }
vservers:
  - name: v
    protocol: sip-udp
    bind: 127.0.0.1:5060
    services: [p1]
    routes:
      - { name: gw, match: { method: INVITE }, services: [g1, g2], method: round_robin, slow_start: { new_service_request_rate: 1, unit: per_second, increment_interval: 0s } }
      - { name: reg, match: { method: REGISTER }, services: [g1, g2], method: round_robin }
";
    let (c, cfg) = core_of(yaml);
    assert!(
        cfg.vservers[0].route_pools[1].slow_start.is_none(),
        "the vserver has none"
    );
    let b = c.balancer();
    let g1 = b.members().iter().position(|m| m.name == "g1").expect("g1");
    b.set_health(g1, Health::Down, 0);
    b.set_health(g1, Health::Up, 0);
    assert!(
        b.pool_slow_start(1).is_some_and(|s| s.is_new(0)),
        "g1 is new in `gw`"
    );
    assert!(b.pool_slow_start(2).is_none());
    let mut out = Vec::new();
    let mut count = |method: &str, tag: &str| {
        (0..20)
            .filter(|i| {
                member_name(
                    &c,
                    send(
                        &c,
                        &request(method, &format!("u{i}"), &format!("{tag}{i}"), ""),
                        &mut out,
                    ),
                ) == "g1"
            })
            .count()
    };
    // Within one second the new g1 takes one request of `gw` (manual rate 1/s); `reg`, without
    // slow start, shares round robin.
    assert_eq!(count("INVITE", "i"), 1);
    assert_eq!(count("REGISTER", "r"), 10);
}
