//! Flood control keys IPv6 sources by prefix (docs/edge.md, "Flood control"): 100,000 addresses
//! of one /64 flood a sip-udp vserver, and the /64 is banned as one source while a client from
//! another /64 completes its calls. It runs in a network namespace the test creates, whose `lo`
//! routes two /64s locally (sources bind any address of them with IPV6_FREEBIND); the body is
//! this test binary run again inside it (`helper_flood64`). Needs root and `ip`; otherwise it
//! prints why and passes without running, unless `FULCRUM_REQUIRE_NETNS=1`.

mod common;

use common::sip_tcp::request;
use common::sip_uac::{Uac, UdpStream};
use common::strict_uas::StrictUas;
use fulcrum::admin::router;
use fulcrum::config;
use fulcrum::ops::Ops;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::netns::ROLE;
const FLOODERS: u32 = 100_000;
const LIMIT: u64 = 50;

/// A UDP socket bound to `ip` (any port), which need not be configured: the namespace
/// routes its /64 to `lo`.
fn bound_to(ip: Ipv6Addr) -> std::io::Result<UdpSocket> {
    let s = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::DGRAM, None)?;
    s.set_freebind_v6(true)?;
    s.bind(&SocketAddr::new(IpAddr::V6(ip), 0).into())?;
    Ok(s.into())
}

/// An OPTIONS over UDP from `local`: a new request each time (its own Call-ID).
fn options(local: SocketAddr, tag: &str) -> String {
    request("OPTIONS", &format!("{tag}@x"), local, tag).replace("SIP/2.0/TCP", "SIP/2.0/UDP")
}

/// Whether `s` gets a 200 to an OPTIONS sent to `to` within a second.
fn answered(s: &UdpSocket, to: SocketAddr, tag: &str) -> bool {
    let Ok(local) = s.local_addr() else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    if s.send_to(options(local, tag).as_bytes(), to).is_err() {
        return false;
    }
    let mut b = [0u8; 4096];
    s.recv_from(&mut b)
        .ok()
        .and_then(|(n, _)| fulcrum::sip::scan(&b[..n]).ok()?.status_code())
        == Some(200)
}

/// UDP datagrams over IPv6 this network namespace dropped for a full receive buffer
/// (`Udp6RcvbufErrors` of /proc/net/snmp6).
fn udp6_rcvbuf_errors() -> u64 {
    std::fs::read_to_string("/proc/net/snmp6")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Udp6RcvbufErrors"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Inside the namespace: the flood, then the checks; panics on a failed check.
#[test]
fn helper_flood64() {
    if std::env::var(ROLE).as_deref() != Ok("flood64") {
        return;
    }
    let uas = StrictUas::udp_at("s", "[::1]:0".parse().expect("addr"));
    let yaml = format!(
        "admin: {{ listen: null }}\nservices:\n  - {{ name: s, address: \"{}\", protocol: sip-udp }}\nvservers:\n  - {{ name: v, protocol: sip-udp, bind: [\"[::1]:0\"], record_route: true, flood: {{ limit: {LIMIT}, window: 1s, ban: 5m }}, services: [s] }}\n",
        uas.addr
    );
    let c = config::from_str("flood.yaml", &yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    let ops = Ops::start(c, None).expect("start");
    let vs: SocketAddr = ops.with_vservers(|v, _| v[0].bound[0]).expect("running");
    // The flood: one new request from each of 100,000 addresses of 2001:db8:64::/64, bounded
    // in time.
    let deadline = Instant::now() + Duration::from_secs(60);
    let overflowed_before = udp6_rcvbuf_errors();
    let mut sent = 0u64;
    for i in 1..=FLOODERS {
        if Instant::now() > deadline {
            break;
        }
        let ip = Ipv6Addr::new(0x2001, 0xdb8, 0x64, 0, 0, 0, (i >> 16) as u16, i as u16);
        let s = bound_to(ip).expect("bind a flooding address");
        let local = s.local_addr().expect("addr");
        if s.send_to(options(local, &format!("f{i}")).as_bytes(), vs)
            .is_ok()
        {
            sent += 1;
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let status = router::status(&ops);
    let edge = &status["vservers"][0]["edge"];
    println!("sent {sent} from one /64; edge {edge}");
    assert_eq!(sent, u64::from(FLOODERS), "the flood was cut short");
    assert_eq!(edge["banned_now"], 1, "one ban for the whole /64: {edge}");
    let dropped = edge["dropped"]["flood"].as_u64().unwrap_or(0);
    // Datagrams the kernel dropped because the vserver's socket buffer was full never
    // reached fulcrum (a loaded machine falls behind a sender this fast); this namespace's
    // own counter says how many.
    let overflowed = udp6_rcvbuf_errors().saturating_sub(overflowed_before);
    assert!(
        dropped + overflowed >= sent - LIMIT - 1,
        "{dropped} of {sent} dropped, {overflowed} lost in socket buffers: {edge}"
    );
    // Another address of the banned /64 is refused too.
    let late = bound_to(Ipv6Addr::new(0x2001, 0xdb8, 0x64, 0, 0xffff, 0, 0, 1)).expect("bind");
    assert!(!answered(&late, vs, "late"), "the banned /64 was answered");
    // A client of another /64 completes its requests and calls.
    let legit_ip = Ipv6Addr::new(0x2001, 0xdb8, 0x99, 0, 0, 0, 0, 1);
    let legit = bound_to(legit_ip).expect("bind");
    for i in 0..5 {
        assert!(answered(&legit, vs, &format!("legit{i}")), "OPTIONS {i}");
    }
    let s = bound_to(legit_ip).expect("bind");
    s.connect(vs).expect("connect");
    let local = s.local_addr().expect("addr");
    let mut uac = Uac::new(UdpStream(s), local, "UDP");
    for i in 0..5 {
        let call = uac.call(&format!("legit-call-{i}"));
        assert_eq!((call.invite, call.bye), (200, 200), "call {i}: {call:?}");
    }
    assert_eq!(uas.counts().r481, 0);
    println!("RESULT ok");
}

#[test]
fn a_flood_from_100000_addresses_of_one_64_is_banned_as_one_source() {
    let routes = [
        "-6 route add local 2001:db8:64::/64 dev lo",
        "-6 route add local 2001:db8:99::/64 dev lo",
    ];
    if let Some(out) = common::netns::run_helper("fc-flood64", &routes, "helper_flood64", "flood64")
    {
        println!("{out}");
    }
}
