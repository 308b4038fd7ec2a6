//! Pools published in DNS (docs/discovery.md), against a real DNS server: dnsmasq on
//! loopback (`common::dns`), whose records the tests change while SIPp places calls through
//! fulcrum to strict UAS (a BYE that reaches a service that did not set its dialog up is
//! answered 481 and fails the call). The members are UAS on 127.0.0.10, .11, ... at one
//! port, as a headless service's pods are.
//!
//! dnsmasq or SIPp missing: skipped with a message, unless `FULCRUM_REQUIRE_DNS=1` /
//! `FULCRUM_REQUIRE_SIPP=1`.

mod common;

use common::dns::{Dns, Records, dnsmasq_available};
use common::sipp::{Scratch, Transport, Uac, UacLoad, sipp_available};
use common::strict_uas::{Counts, StrictUas};
use common::wait_until;
use fulcrum::admin::router::{self, Request};
use fulcrum::config;
use fulcrum::ops::Ops;
use serde_json::Value;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ZONE: &str = "pool.test";

/// `n` strict UAS on 127.0.0.10.. at one port.
fn farm(n: usize) -> (Vec<StrictUas>, u16) {
    for _ in 0..20 {
        let first = StrictUas::udp_at("s0", SocketAddr::from(([127, 0, 0, 10], 0)));
        let port = first.addr.port();
        let mut uas = vec![first];
        for i in 1..n {
            let at = SocketAddr::from(([127, 0, 0, 10 + i as u8], port));
            // Taken there by another test: start over on another port.
            if std::net::UdpSocket::bind(at).is_err() {
                break;
            }
            uas.push(StrictUas::udp_at(&format!("s{i}"), at));
        }
        if uas.len() == n {
            return (uas, port);
        }
    }
    panic!("no port free on 127.0.0.10..{}", 10 + n);
}

fn ip(i: usize) -> IpAddr {
    IpAddr::from([127, 0, 0, 10 + i as u8])
}

/// A records of `sip.pool.test` for the UAS `members`.
fn hosts(members: &[usize]) -> Records {
    members
        .iter()
        .fold(Records::new(), |r, &i| r.a("sip.pool.test", ip(i)))
}

/// fulcrum over the pool `service` (`dns: NAME` and what follows), asking `dns`.
fn start(dns: &Dns, service: &str, method: &str) -> Arc<Ops> {
    let yaml = format!(
        "admin: {{ listen: null }}\n\
         dns: {{ servers: [\"{}\"], min_refresh: 200ms, max_refresh: 1s }}\n\
         services:\n  - {{ name: pool, protocol: sip-udp, {service} }}\n\
         vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [127.0.0.1:0]\n    method: {method}\n    record_route: false\n    workers: 1\n    services: [pool]\n",
        dns.addr()
    );
    let cfg = config::from_str("discovery.yaml", &yaml).expect("valid");
    Ops::start(cfg, None).expect("start")
}

fn proxy(ops: &Ops) -> SocketAddr {
    ops.with_vservers(|vs, _| vs[0].bound[0]).expect("running")
}

fn status(ops: &Ops) -> Value {
    let r = router::handle(ops, &Request::new("GET", "/status"));
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).expect("JSON")
}

/// The vserver's members as `/status` lists them: (name, draining, tier).
fn members(ops: &Ops) -> Vec<(String, bool, String)> {
    status(ops)["vservers"][0]["services"]
        .as_array()
        .expect("services")
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap_or("?").to_owned(),
                !s["draining"].is_null(),
                s["tier"].as_str().unwrap_or("?").to_owned(),
            )
        })
        .collect()
}

fn member_name(uas: &StrictUas) -> String {
    format!("pool@{}", uas.addr)
}

/// Wait until the vserver's serving (not draining) members are exactly those of `uas`.
fn wait_serving(ops: &Ops, uas: &[&StrictUas]) {
    let mut want: Vec<String> = uas.iter().map(|u| member_name(u)).collect();
    want.sort();
    let ok = wait_until(Duration::from_secs(10), || {
        let mut got: Vec<String> = members(ops)
            .into_iter()
            .filter(|m| !m.1)
            .map(|m| m.0)
            .collect();
        got.sort();
        got == want
    });
    assert!(ok, "serving members {:?}, wanted {want:?}", members(ops));
}

fn ready(ops: &Ops) -> Value {
    let r = router::handle(ops, &Request::new("GET", "/readyz"));
    let mut v: Value = serde_json::from_str(&r.body).expect("JSON");
    v["status"] = r.status.into();
    v
}

fn available() -> bool {
    dnsmasq_available() && sipp_available()
}

fn report(counts: &[Counts]) -> String {
    counts
        .iter()
        .enumerate()
        .map(|(i, c)| format!("s{i}: {c:?}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The pool grows and shrinks while SIPp holds about 60 calls: a member that appears takes
/// new calls, one that leaves the answer drains (its calls end there), and no call fails.
#[test]
fn a_pool_followed_under_load_loses_no_call() {
    if !available() {
        return;
    }
    let (uas, port) = farm(3);
    let mut dns = Dns::start("grow", ZONE, &hosts(&[0, 1]));
    let ops = start(
        &dns,
        &format!("dns: sip.pool.test, port: {port}"),
        "call_id_hash",
    );
    wait_serving(&ops, &[&uas[0], &uas[1]]);
    let dir = Scratch::new("discovery-grow");
    let load = UacLoad {
        calls: 360,
        rate_per_s: 40,
        hold_ms: 1500,
    };
    let sipp = Uac::start(&dir, Transport::Udp, proxy(&ops), load, "grow");
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    dns.set(&hosts(&[0, 1, 2]));
    wait_serving(&ops, &[&uas[0], &uas[1], &uas[2]]);
    let added_after = t0.elapsed();
    std::thread::sleep(Duration::from_secs(2));
    let s0_live = uas[0].counts().dialogs - uas[0].counts().byes_ok;
    dns.set(&hosts(&[1, 2]));
    wait_serving(&ops, &[&uas[1], &uas[2]]);
    let removed = members(&ops);
    let s0_at_removal = uas[0].counts().dialogs;
    let out = sipp.finish();
    let counts: Vec<Counts> = uas.iter().map(StrictUas::counts).collect();
    let r = format!(
        "added after {added_after:?}; at removal s0 had {s0_live} live dialogs; members then {removed:?}\nSIPp: {} ok, {} failed\n{}\n{}",
        out.successful,
        out.failed,
        report(&counts),
        out.errors
    );
    eprintln!("{r}");
    assert_eq!((out.successful, out.failed), (360, 0), "{r}");
    assert!(
        counts.iter().all(|c| c.r481 == 0 && c.stray_acks == 0),
        "{r}"
    );
    assert!(counts[2].dialogs > 20, "the new member took calls: {r}");
    assert!(s0_live > 0, "the leaving member held calls: {r}");
    assert!(
        removed.iter().any(|m| m.0 == member_name(&uas[0]) && m.1),
        "the leaving member drains: {r}"
    );
    // Nothing new after it left (a call or two may have been on their way).
    assert!(counts[0].dialogs <= s0_at_removal + 2, "{r}");
    assert_eq!(
        counts[0].dialogs, counts[0].byes_ok,
        "every s0 call ended at s0: {r}"
    );
}

/// SRV: weights give the shares within the best priority; the lower priority serves only
/// while the better one is unusable, and when it returns new calls go back to it while
/// the calls set up meanwhile end where they are.
#[test]
fn srv_weights_share_and_a_lower_priority_serves_only_while_the_better_is_gone() {
    if !available() {
        return;
    }
    let (uas, port) = farm(3);
    let records = Records::new()
        .a("a.pool.test", ip(0))
        .a("b.pool.test", ip(1))
        .a("c.pool.test", ip(2))
        .srv("_sip._udp.pool.test", "a.pool.test", port, 10, 30)
        .srv("_sip._udp.pool.test", "b.pool.test", port, 10, 10)
        .srv("_sip._udp.pool.test", "c.pool.test", port, 20, 10);
    let dns = Dns::start("srv", ZONE, &records);
    let ops = start(&dns, "dns: _sip._udp.pool.test", "call_id_hash");
    wait_serving(&ops, &[&uas[0], &uas[1], &uas[2]]);
    let tiers = members(&ops);
    assert!(
        tiers
            .iter()
            .any(|m| m.0 == member_name(&uas[2]) && m.2 == "priority 20"),
        "{tiers:?}"
    );
    // Shares: 400 short calls.
    let dir = Scratch::new("discovery-srv-share");
    let load = UacLoad {
        calls: 400,
        rate_per_s: 100,
        hold_ms: 0,
    };
    let out = Uac::start(&dir, Transport::Udp, proxy(&ops), load, "share").finish();
    let c: Vec<Counts> = uas.iter().map(StrictUas::counts).collect();
    let r = format!(
        "{} ok, {} failed\n{}",
        out.successful,
        out.failed,
        report(&c)
    );
    eprintln!("shares: {r}");
    assert_eq!((out.successful, out.failed), (400, 0), "{r}");
    assert_eq!(c[2].dialogs, 0, "priority 20 is not used while 10 is: {r}");
    let share = c[0].dialogs as f64 / 400.0;
    assert!(
        (0.65..=0.85).contains(&share),
        "weight 30 of 40: {share}\n{r}"
    );

    // The better priority taken out of service under load; then back.
    let dir = Scratch::new("discovery-srv-tiers");
    let load = UacLoad {
        calls: 200,
        rate_per_s: 40,
        hold_ms: 2000,
    };
    let sipp = Uac::start(&dir, Transport::Udp, proxy(&ops), load, "tiers");
    std::thread::sleep(Duration::from_millis(1200));
    for u in &uas[..2] {
        assert!(ops.set_disabled(&member_name(u), true));
    }
    std::thread::sleep(Duration::from_millis(1500));
    for u in &uas[..2] {
        assert!(ops.set_disabled(&member_name(u), false));
    }
    std::thread::sleep(Duration::from_millis(300));
    let on_c = uas[2].counts().dialogs;
    let out = sipp.finish();
    let c: Vec<Counts> = uas.iter().map(StrictUas::counts).collect();
    let r = format!(
        "{} ok, {} failed; c had {on_c} once a and b returned\n{}\n{}",
        out.successful,
        out.failed,
        report(&c),
        out.errors
    );
    eprintln!("tiers: {r}");
    assert_eq!((out.successful, out.failed), (200, 0), "{r}");
    assert!(on_c >= 30, "priority 20 served while 10 was out: {r}");
    assert_eq!(
        c[2].dialogs, on_c,
        "no new call on c once a and b returned: {r}"
    );
    assert!(
        c.iter().all(|c| c.r481 == 0 && c.dialogs == c.byes_ok),
        "{r}"
    );
}

/// The DNS server stops: the pool keeps its members, calls go on, `/readyz` stays ready and
/// says why the pool is not refreshed, `/metrics` marks it stale; the server returns and
/// the note goes.
#[test]
fn a_dns_outage_changes_nothing_and_readiness_says_why() {
    if !available() {
        return;
    }
    let (uas, port) = farm(2);
    let mut dns = Dns::start("outage", ZONE, &hosts(&[0, 1]));
    let ops = start(
        &dns,
        &format!("dns: sip.pool.test, port: {port}"),
        "round_robin",
    );
    wait_serving(&ops, &[&uas[0], &uas[1]]);
    assert_eq!(
        ready(&ops),
        serde_json::json!({ "ready": true, "status": 200 })
    );
    dns.stop();
    let noted = wait_until(Duration::from_secs(10), || {
        ready(&ops)["notes"][0]
            .as_str()
            .is_some_and(|n| n.contains("DNS lookups of sip.pool.test failing"))
    });
    let r = ready(&ops);
    assert!(noted, "{r}");
    assert_eq!(r["status"], 200, "{r}");
    assert!(
        r["notes"][0]
            .as_str()
            .unwrap_or("")
            .contains("keeping the 2 member(s)"),
        "{r}"
    );
    // Several lookups fail meanwhile; nothing changes.
    std::thread::sleep(Duration::from_secs(3));
    wait_serving(&ops, &[&uas[0], &uas[1]]);
    let metrics = router::handle(&ops, &Request::new("GET", "/metrics")).body;
    assert!(
        metrics.contains("fulcrum_dns_stale{service=\"pool\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("fulcrum_dns_members{service=\"pool\"} 2"),
        "{metrics}"
    );
    let dir = Scratch::new("discovery-outage");
    let load = UacLoad {
        calls: 40,
        rate_per_s: 40,
        hold_ms: 0,
    };
    let out = Uac::start(&dir, Transport::Udp, proxy(&ops), load, "outage").finish();
    assert_eq!((out.successful, out.failed), (40, 0), "{}", out.errors);
    assert!(uas.iter().all(|u| u.counts().dialogs >= 15));
    let st = status(&ops);
    assert_eq!(st["dns"][0]["stale"], true, "{st}");
    assert!(st["dns"][0]["last_error"].is_string(), "{st}");
    dns.resume();
    let cleared = wait_until(Duration::from_secs(10), || {
        ready(&ops) == serde_json::json!({ "ready": true, "status": 200 })
    });
    assert!(cleared, "{}", ready(&ops));
}

/// The name stops existing (NXDOMAIN): its members drain, the calls they hold end there,
/// and with no member left the vserver is not ready.
#[test]
fn a_name_that_stops_existing_drains_its_members() {
    if !available() {
        return;
    }
    let (uas, port) = farm(2);
    let mut dns = Dns::start("gone", ZONE, &hosts(&[0, 1]));
    let ops = start(
        &dns,
        &format!("dns: sip.pool.test, port: {port}"),
        "call_id_hash",
    );
    wait_serving(&ops, &[&uas[0], &uas[1]]);
    let dir = Scratch::new("discovery-gone");
    let load = UacLoad {
        calls: 20,
        rate_per_s: 20,
        hold_ms: 4000,
    };
    let sipp = Uac::start(&dir, Transport::Udp, proxy(&ops), load, "gone");
    let up = wait_until(Duration::from_secs(10), || {
        uas.iter().map(|u| u.counts().dialogs).sum::<u64>() == 20
    });
    assert!(
        up,
        "calls set up: {:?}",
        uas.iter().map(StrictUas::counts).collect::<Vec<_>>()
    );
    dns.set(&Records::new().a("other.pool.test", ip(0)));
    wait_serving(&ops, &[]);
    let m = members(&ops);
    assert!(m.len() == 2 && m.iter().all(|m| m.1), "both drain: {m:?}");
    let st = status(&ops);
    assert_eq!(st["dns"][0]["members"], serde_json::json!([]), "{st}");
    assert_eq!(
        st["dns"][0]["stale"], false,
        "an empty answer is an answer: {st}"
    );
    let r = ready(&ops);
    assert_eq!(r["status"], 503, "{r}");
    let out = sipp.finish();
    let c: Vec<Counts> = uas.iter().map(StrictUas::counts).collect();
    assert_eq!(
        (out.successful, out.failed),
        (20, 0),
        "{}\n{}",
        report(&c),
        out.errors
    );
    assert!(
        c.iter().all(|c| c.r481 == 0 && c.dialogs == c.byes_ok),
        "{}",
        report(&c)
    );
}

/// No answer at start (the server is not there yet): the vserver starts with no member and
/// says why; the pool fills when the server comes.
#[test]
fn a_pool_not_answered_at_start_fills_when_the_server_comes() {
    if !dnsmasq_available() {
        return;
    }
    let (uas, port) = farm(1);
    let mut dns = Dns::start("late", ZONE, &hosts(&[0]));
    dns.stop();
    let ops = start(
        &dns,
        &format!("dns: sip.pool.test, port: {port}"),
        "round_robin",
    );
    assert!(members(&ops).is_empty());
    let r = ready(&ops);
    assert_eq!(r["status"], 503, "{r}");
    let reasons: Vec<&str> = r["reasons"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    assert!(
        reasons
            .iter()
            .any(|x| x.starts_with("service pool: no DNS answer yet for sip.pool.test")),
        "{r}"
    );
    dns.resume();
    wait_serving(&ops, &[&uas[0]]);
    let ok = wait_until(Duration::from_secs(5), || ready(&ops)["status"] == 200);
    assert!(ok, "{}", ready(&ops));
}

/// `fulcrum simulate hash --config` looks the pools up: the members of an SRV name (an IPv4
/// and an IPv6 target) with their weights in the best priority, the lower priority listed
/// with no share.
#[test]
fn simulate_hash_shows_the_members_and_tiers_a_pool_has_now() {
    if !dnsmasq_available() {
        return;
    }
    let records = Records::new()
        .a("a.pool.test", ip(0))
        .a("six.pool.test", "::1".parse().expect("v6"))
        .a("c.pool.test", ip(2))
        .srv("_sip._udp.pool.test", "a.pool.test", 5070, 10, 30)
        .srv("_sip._udp.pool.test", "six.pool.test", 5071, 10, 10)
        .srv("_sip._udp.pool.test", "c.pool.test", 5072, 20, 10);
    let dns = Dns::start("simulate", ZONE, &records);
    let file = common::ConfigFile::new(
        "simulate-dns",
        &format!(
            "dns: {{ servers: [\"{}\"] }}\n\
             services:\n  - {{ name: pool, dns: _sip._udp.pool.test, protocol: sip-udp }}\n\
             vservers:\n  - {{ name: v, protocol: sip-udp, bind: [127.0.0.1:5060], services: [pool] }}\n",
            dns.addr()
        ),
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fulcrum"))
        .args([
            "simulate",
            "hash",
            "--config",
            file.arg(),
            "--keys",
            "20000",
            "--json",
        ])
        .output()
        .expect("run fulcrum");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    let per: Vec<(String, String, u64)> = v["per_service"]
        .as_array()
        .expect("per service")
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap_or("?").to_owned(),
                s["tier"].as_str().unwrap_or("?").to_owned(),
                s["weight"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        per,
        [
            (
                "pool@127.0.0.10:5070".to_owned(),
                "priority 10".to_owned(),
                30
            ),
            ("pool@[::1]:5071".to_owned(), "priority 10".to_owned(), 10),
            (
                "pool@127.0.0.12:5072".to_owned(),
                "priority 20".to_owned(),
                10
            ),
        ],
        "{v}"
    );
    let share = v["per_service"][0]["share"].as_f64().unwrap_or(0.0);
    assert!((0.7..=0.8).contains(&share), "weight 30 of 40: {share}");
    assert_eq!(v["per_service"][2]["keys"], 0);
}

/// A member that appears enters slow start (the vserver's `slow_start`), as a service a
/// reload adds; the members already there do not.
#[test]
fn a_member_that_appears_enters_slow_start() {
    if !dnsmasq_available() {
        return;
    }
    let (uas, port) = farm(2);
    let mut dns = Dns::start("slow", ZONE, &hosts(&[0]));
    let ops = start(
        &dns,
        &format!("dns: sip.pool.test, port: {port}"),
        "round_robin\n    slow_start: { new_service_request_rate: 5, unit: per_second, increment_interval: 1h }",
    );
    wait_serving(&ops, &[&uas[0]]);
    dns.set(&hosts(&[0, 1]));
    wait_serving(&ops, &[&uas[0], &uas[1]]);
    let st = status(&ops);
    let services = st["vservers"][0]["services"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let slow = |u: &StrictUas| {
        services
            .iter()
            .find(|s| s["name"] == member_name(u).as_str())
            .map(|s| s["slow_start"].clone())
            .unwrap_or(Value::Null)
    };
    assert!(slow(&uas[0]).is_null(), "{st}");
    assert_eq!(slow(&uas[1])["rate"], 5, "{st}");
}

/// A DNS server that answers A queries for every name with `a` (TTL 1 s) and never answers
/// any other query: a resolver that drops AAAA, as some middleboxes and broken resolvers do.
fn a_only_dns(a: std::net::Ipv4Addr) -> (SocketAddr, Arc<std::sync::atomic::AtomicU64>) {
    a_only_dns_at(SocketAddr::from(([127, 0, 0, 1], 0)), a, false).expect("bind")
}

/// [`a_only_dns`] listening at `at`; `nodata`: other queries are answered NODATA (no
/// records, at once) instead of dropped.
fn a_only_dns_at(
    at: SocketAddr,
    a: std::net::Ipv4Addr,
    nodata: bool,
) -> std::io::Result<(SocketAddr, Arc<std::sync::atomic::AtomicU64>)> {
    let sock = std::net::UdpSocket::bind(at)?;
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let addr = sock.local_addr().expect("addr");
    let dropped = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = Arc::clone(&dropped);
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        // Bounded: the test binary ends long before.
        let until = Instant::now() + Duration::from_secs(120);
        while Instant::now() < until {
            let Ok((n, from)) = sock.recv_from(&mut buf) else {
                continue;
            };
            let q = &buf[..n];
            // Header (12 bytes), then QNAME's labels, QTYPE, QCLASS.
            let mut i = 12;
            while i < q.len() && q[i] != 0 {
                i += 1 + usize::from(q[i]);
            }
            let Some(qtype) = q.get(i + 1..i + 3) else {
                continue;
            };
            let Some(question) = q.get(12..i + 5) else {
                continue;
            };
            if qtype != [0, 1] {
                seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if nodata {
                    let mut r = Vec::with_capacity(64);
                    r.extend_from_slice(&q[..2]);
                    r.extend_from_slice(&[0x85, 0x80, 0, 1, 0, 0, 0, 0, 0, 0]);
                    r.extend_from_slice(question);
                    let _ = sock.send_to(&r, from);
                }
                continue;
            }
            let mut r = Vec::with_capacity(64);
            r.extend_from_slice(&q[..2]);
            r.extend_from_slice(&[0x85, 0x80, 0, 1, 0, 1, 0, 0, 0, 0]);
            r.extend_from_slice(question);
            r.extend_from_slice(&[0xC0, 0x0C, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4]);
            r.extend_from_slice(&a.octets());
            let _ = sock.send_to(&r, from);
        }
    });
    Ok((addr, dropped))
}

/// A resolver that never answers AAAA queries: the A records still make the pool, at start
/// and after (each family is its own part of the answer, docs/discovery.md), and the pool
/// is not reported stale.
#[test]
fn a_resolver_that_drops_aaaa_still_fills_the_pool() {
    let uas = StrictUas::udp_at("s0", SocketAddr::from(([127, 0, 0, 10], 0)));
    let (dns, dropped) = a_only_dns(std::net::Ipv4Addr::new(127, 0, 0, 10));
    let yaml = format!(
        "admin: {{ listen: null }}\n\
         dns: {{ servers: [\"{dns}\"], min_refresh: 200ms, max_refresh: 1s }}\n\
         services:\n  - {{ name: pool, protocol: sip-udp, dns: sip.pool.test, port: {} }}\n\
         vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [127.0.0.1:0]\n    method: call_id_hash\n    workers: 1\n    services: [pool]\n",
        uas.addr.port()
    );
    let cfg = config::from_str("discovery.yaml", &yaml).expect("valid");
    let ops = Ops::start(cfg, None).expect("start");
    wait_serving(&ops, &[&uas]);
    assert!(
        dropped.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "AAAA was asked and dropped"
    );
    let st = status(&ops);
    assert_eq!(st["dns"][0]["stale"], false, "{st}");
    let r = ready(&ops);
    assert_eq!(r["status"], 200, "{r}");
    ops.shutdown();
}

/// Without `servers` the system's configuration is used, and read again when it changes (a
/// DHCP lease or systemd-resolved rewrites /etc/resolv.conf while fulcrum runs): the pool
/// follows the server the file names now. resolv.conf names servers without a port, so the
/// two stub servers listen on port 53 of their own loopback addresses (root only).
#[test]
fn a_rewritten_resolv_conf_is_read_again() {
    let one = a_only_dns_at(
        "127.0.53.1:53".parse().expect("addr"),
        [127, 0, 0, 10].into(),
        true,
    );
    let two = a_only_dns_at(
        "127.0.53.2:53".parse().expect("addr"),
        [127, 0, 0, 11].into(),
        true,
    );
    let (Ok(_), Ok(_)) = (&one, &two) else {
        assert!(
            std::env::var_os("FULCRUM_REQUIRE_NETNS").is_none(),
            "port 53 on 127.0.53.x: {one:?} {two:?}"
        );
        eprintln!("skipped: cannot listen on port 53 (not root?)");
        return;
    };
    let first = StrictUas::udp_at("s0", SocketAddr::from(([127, 0, 0, 10], 0)));
    let second = StrictUas::udp_at("s1", SocketAddr::from(([127, 0, 0, 11], first.addr.port())));
    let dir = std::env::temp_dir().join(format!("fulcrum-resolv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let conf = dir.join("resolv.conf");
    std::fs::write(&conf, "nameserver 127.0.53.1\n").expect("write");
    let yaml = format!(
        "admin: {{ listen: null }}\n\
         dns: {{ resolv_conf: \"{}\", min_refresh: 200ms, max_refresh: 1s }}\n\
         services:\n  - {{ name: pool, protocol: sip-udp, dns: sip.pool.test, port: {} }}\n\
         vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [127.0.0.1:0]\n    method: call_id_hash\n    workers: 1\n    services: [pool]\n",
        conf.display(),
        first.addr.port()
    );
    let cfg = config::from_str("discovery.yaml", &yaml).expect("valid");
    let ops = Ops::start(cfg, None).expect("start");
    wait_serving(&ops, &[&first]);
    // Rewritten in place (a new file renamed over it, as resolvconf does).
    let staged = dir.join("resolv.conf.new");
    std::fs::write(&staged, "nameserver 127.0.53.2\n").expect("write");
    std::fs::rename(&staged, &conf).expect("rename");
    wait_serving(&ops, &[&second]);
    ops.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
}
