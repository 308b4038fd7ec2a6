//! HEP capture (docs/capture.md) read by a real collector: sngrep (Debian `sngrep`) in
//! headless mode, listening for HEP over UDP and writing what it receives to a pcap file,
//! while SIPp calls (over sip-tls, a TLS client of the tests' own) go through fulcrum to
//! strict services (tests/common/strict_uas.rs).
//!
//! - every message of each call appears on both legs, client side and service side, with the
//!   addresses and ports as on the wire, over sip-udp, sip-tcp and sip-tls (decrypted), each
//!   forwarded message first on the leg it came in on (by the HEP time sngrep writes as the
//!   frame's time);
//! - fulcrum's own messages are captured: its 100 Trying and its ACK of a service's 503
//!   before the failover;
//! - a dead collector costs no call, and a reload turns capture on and off;
//! - Kamailio's `sipcapture` (Debian `kamailio`) stores every message of each call on both
//!   legs (db_text), over IPv4 and over IPv6;
//! - the health monitors' OPTIONS are captured with `probes: true` and only then.
//!
//! Without `sngrep` or `sipp` on the PATH a test says why and passes without running, unless
//! `FULCRUM_REQUIRE_SNGREP=1` (`FULCRUM_REQUIRE_SIPP=1`, `FULCRUM_REQUIRE_KAMAILIO=1` for
//! `kamailio`), as in CI. Every child process runs
//! under `timeout` and is ended when its guard drops.

mod common;

use common::sipp::{Proc, Scratch, Transport, Uac, UacLoad, spawn_listening};
use common::strict_uas::{Sick, StrictUas};
use fulcrum::admin::router;
use fulcrum::config;
use fulcrum::ops::Ops;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn sngrep_available() -> bool {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("sngrep").is_file()))
        .unwrap_or(false);
    if found {
        return true;
    }
    if std::env::var("FULCRUM_REQUIRE_SNGREP").as_deref() == Ok("1") {
        panic!(
            "sngrep is not on PATH and FULCRUM_REQUIRE_SNGREP=1 (install Debian package sngrep)"
        );
    }
    eprintln!(
        "SKIPPED: sngrep is not on PATH (apt-get install sngrep); set FULCRUM_REQUIRE_SNGREP=1 to make this a failure"
    );
    false
}

fn tools_available() -> bool {
    sngrep_available() && common::sipp::sipp_available()
}

/// sngrep receiving HEP on a UDP port of 127.0.0.1 and writing every packet to a pcap file.
struct Sngrep {
    _proc: Proc,
    port: u16,
    pcap: PathBuf,
}

impl Sngrep {
    fn start(dir: &Scratch) -> Sngrep {
        let pcap = dir.path("capture.pcap");
        let out = pcap.clone();
        let (proc, port) = spawn_listening("sngrep", Transport::Udp, move |port| {
            let mut cmd = Command::new("timeout");
            cmd.args(["-s", "KILL", "120", "sngrep", "-N", "-q"])
                .arg("-L")
                .arg(format!("udp:127.0.0.1:{port}"))
                .arg("-O")
                .arg(&out);
            cmd
        });
        Sngrep {
            _proc: proc,
            port,
            pcap,
        }
    }

    fn frames(&self) -> Vec<Frame> {
        read_pcap(&std::fs::read(&self.pcap).unwrap_or_default())
    }
}

/// One frame of the pcap: a captured SIP message as sngrep rebuilt it from the HEP packet.
#[derive(Debug, Clone)]
struct Frame {
    /// The HEP time, in microseconds since the Unix epoch.
    time_us: u64,
    ip_proto: u8,
    src: SocketAddr,
    dst: SocketAddr,
    payload: Vec<u8>,
}

impl Frame {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.payload).into_owned()
    }

    fn call_id(&self) -> String {
        header(&self.text(), &["call-id", "i"]).unwrap_or_default()
    }

    /// `INVITE`, `ACK` for a request; `200 INVITE`, `200 BYE` for a response (status code
    /// and CSeq method).
    fn label(&self) -> String {
        let text = self.text();
        let first = text.lines().next().unwrap_or_default().to_owned();
        if let Some(rest) = first.strip_prefix("SIP/2.0 ") {
            let code = rest.split(' ').next().unwrap_or_default();
            let method = header(&text, &["cseq"])
                .and_then(|c| c.split_whitespace().nth(1).map(str::to_owned))
                .unwrap_or_default();
            format!("{code} {method}")
        } else {
            first.split(' ').next().unwrap_or_default().to_owned()
        }
    }

    fn is_request(&self) -> bool {
        !self.payload.starts_with(b"SIP/2.0 ")
    }
}

fn header(text: &str, names: &[&str]) -> Option<String> {
    text.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        names
            .iter()
            .any(|n| name.trim().eq_ignore_ascii_case(n))
            .then(|| value.trim().to_owned())
    })
}

/// The frames of a pcap file (little-endian, Ethernet or raw IP; IPv4 or IPv6; UDP or TCP).
fn read_pcap(b: &[u8]) -> Vec<Frame> {
    let u16be = |o: usize| u16::from_be_bytes([b[o], b[o + 1]]);
    let u32le = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    if b.len() < 24 {
        return Vec::new();
    }
    assert_eq!(u32le(0), 0xa1b2_c3d4, "a little-endian microsecond pcap");
    let linktype = u32le(20);
    let mut frames = Vec::new();
    let mut at = 24;
    while at + 16 <= b.len() {
        let (sec, usec, caplen) = (u32le(at), u32le(at + 4), u32le(at + 8) as usize);
        let start = at + 16;
        at = start + caplen;
        if at > b.len() {
            break; // a record still being written
        }
        let mut o = start + if linktype == 1 { 14 } else { 0 };
        let (src_ip, dst_ip, proto): (IpAddr, IpAddr, u8);
        match b[o] >> 4 {
            4 => {
                let ihl = usize::from(b[o] & 0x0f) * 4;
                proto = b[o + 9];
                src_ip = IpAddr::from([b[o + 12], b[o + 13], b[o + 14], b[o + 15]]);
                dst_ip = IpAddr::from([b[o + 16], b[o + 17], b[o + 18], b[o + 19]]);
                o += ihl;
            }
            6 => {
                proto = b[o + 6];
                let ip = |p: usize| {
                    let mut a = [0u8; 16];
                    a.copy_from_slice(&b[p..p + 16]);
                    IpAddr::from(a)
                };
                src_ip = ip(o + 8);
                dst_ip = ip(o + 24);
                o += 40;
            }
            v => panic!("IP version {v} in the pcap"),
        }
        let (sport, dport) = (u16be(o), u16be(o + 2));
        let body = match proto {
            17 => o + 8,
            6 => o + usize::from(b[o + 12] >> 4) * 4,
            p => panic!("IP protocol {p} in the pcap"),
        };
        frames.push(Frame {
            time_us: u64::from(sec) * 1_000_000 + u64::from(usec),
            ip_proto: proto,
            src: SocketAddr::new(src_ip, sport),
            dst: SocketAddr::new(dst_ip, dport),
            payload: b[body..at].to_vec(),
        });
    }
    frames
}

fn yaml(services: &[(&str, SocketAddr)], capture: Option<u16>) -> String {
    yaml_over(Transport::Udp, services, capture)
}

/// [`yaml`], with the collector's packets sent in UDP GSO groups when `gso` (each padded by
/// a chunk the collectors skip, docs/capture.md).
fn yaml_gso(services: &[(&str, SocketAddr)], capture: Option<u16>, gso: bool) -> String {
    let y = yaml(services, capture);
    if gso {
        y.replace("id: 2001 }", "id: 2001, udp_gso: true }")
    } else {
        y
    }
}

/// A vserver `v` of `t`'s protocol over `services` of the same, capturing to sngrep at
/// `capture`.
fn yaml_over(t: Transport, services: &[(&str, SocketAddr)], capture: Option<u16>) -> String {
    let protocol = t.protocol();
    let mut y = String::from("admin: { listen: null }\n");
    if let Some(port) = capture {
        y.push_str(&format!(
            "capture: {{ hep: {{ address: \"127.0.0.1:{port}\", id: 2001 }} }}\n"
        ));
    }
    y.push_str("services:\n");
    for (name, addr) in services {
        y.push_str(&format!(
            "  - {{ name: {name}, address: \"{addr}\", protocol: {protocol} }}\n"
        ));
    }
    let names: Vec<&str> = services.iter().map(|s| s.0).collect();
    y.push_str(&format!(
        "vservers:\n  - {{ name: v, protocol: {protocol}, bind: [\"127.0.0.1:0\"], record_route: true, method: round_robin, eject: off, services: [{}] }}\n",
        names.join(", ")
    ));
    y
}

fn ops_of(yaml: &str) -> Arc<Ops> {
    let c = config::from_str("capture.yaml", yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    Ops::start(c, None).expect("start")
}

fn vserver_addr(ops: &Ops) -> SocketAddr {
    ops.with_vservers(|v, _| v[0].bound[0]).expect("running")
}

fn sent(ops: &Ops) -> u64 {
    ops.capture()
        .map(|c| c.stats().sent.load(Ordering::Relaxed))
        .unwrap_or(0)
}

/// `calls` calls of SIPp's built-in `uac` scenario (INVITE, ACK, BYE) through `ops`'s vserver,
/// every one successful.
fn calls(ops: &Ops, dir: &Scratch, calls: u32, tag: &str) {
    calls_over(Transport::Udp, ops, dir, calls, tag)
}

fn calls_over(t: Transport, ops: &Ops, dir: &Scratch, calls: u32, tag: &str) {
    let load = UacLoad {
        calls,
        rate_per_s: 10,
        hold_ms: 100,
    };
    let out = Uac::start(dir, t, vserver_addr(ops), load, tag).finish();
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(calls), 0),
        "{}",
        out.errors
    );
}

/// Wait (bounded) until sngrep has written every packet fulcrum sent, and read them: the
/// calls are over, so what they captured is queued; the sender takes the queue every few
/// milliseconds, so a count unchanged over two reads 50 ms apart is the whole of it.
fn settled(ops: &Ops, sngrep: &Sngrep) -> Vec<Frame> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut before = 0;
    loop {
        let n = sent(ops);
        let frames = sngrep.frames();
        if n > 0 && frames.len() as u64 == n && n == before {
            return frames;
        }
        before = n;
        assert!(
            Instant::now() < deadline,
            "sngrep wrote {} frames, fulcrum sent {n}",
            frames.len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The calls' frames by Call-ID, each in the collector's order.
fn by_call(frames: &[Frame]) -> std::collections::BTreeMap<String, Vec<Frame>> {
    let mut calls = std::collections::BTreeMap::<String, Vec<Frame>>::new();
    for f in frames {
        calls.entry(f.call_id()).or_default().push(f.clone());
    }
    calls
}

/// The frames of one leg in time order (ties in the collector's order), retransmissions
/// (byte-identical copies) left out.
fn leg(frames: &[Frame], on_leg: impl Fn(&Frame) -> bool) -> Vec<Frame> {
    let mut l: Vec<Frame> = frames.iter().filter(|f| on_leg(f)).cloned().collect();
    l.sort_by_key(|f| f.time_us);
    let mut seen = Vec::<Vec<u8>>::new();
    l.retain(|f| {
        let new = !seen.contains(&f.payload);
        seen.push(f.payload.clone());
        new
    });
    l
}

fn labels(l: &[Frame]) -> Vec<String> {
    l.iter().map(Frame::label).collect()
}

const CALL: [&str; 7] = [
    "INVITE",
    "100 INVITE",
    "180 INVITE",
    "200 INVITE",
    "ACK",
    "BYE",
    "200 BYE",
];

/// The client leg of a call: requests from the client to the vserver, responses back, the
/// client the same for all.
fn check_client_leg(client: &[Frame], vserver: SocketAddr) {
    let caller = client[0].src;
    assert_eq!(caller.ip(), vserver.ip());
    assert_ne!(caller, vserver);
    for f in client {
        let (from, to) = if f.is_request() {
            (caller, vserver)
        } else {
            (vserver, caller)
        };
        assert_eq!((f.src, f.dst), (from, to), "{}", f.label());
        assert_eq!(f.ip_proto, 17, "sngrep writes every message as a UDP frame");
    }
}

/// The leg toward service `service`: requests from the vserver's address, responses back.
fn check_service_leg(l: &[Frame], vserver: SocketAddr, service: SocketAddr) {
    for f in l {
        let (from, to) = if f.is_request() {
            (vserver, service)
        } else {
            (service, vserver)
        };
        assert_eq!((f.src, f.dst), (from, to), "{}", f.label());
        assert_eq!(f.ip_proto, 17);
    }
}

/// Every forwarded message (all but the hop-by-hop 100) is captured first on the leg it came
/// in on: requests on the client leg, responses on the service leg.
fn check_forwarding_times(client: &[Frame], service: &[Frame]) {
    for c in client.iter().filter(|f| !f.label().starts_with("100 ")) {
        let s = service
            .iter()
            .find(|s| s.label() == c.label())
            .unwrap_or_else(|| panic!("{} on the service leg", c.label()));
        let (first, then) = if c.is_request() { (c, s) } else { (s, c) };
        assert!(
            first.time_us <= then.time_us,
            "{} forwarded before it was received: {} > {}",
            c.label(),
            first.time_us,
            then.time_us
        );
    }
}

#[test]
fn every_message_of_each_call_is_captured_on_both_legs_over_sip_udp() {
    legs_over_sip_udp(false);
}

/// The same with UDP GSO: sngrep reads every padded packet.
#[test]
fn every_message_of_each_call_is_captured_on_both_legs_with_udp_gso() {
    legs_over_sip_udp(true);
}

fn legs_over_sip_udp(gso: bool) {
    if !tools_available() {
        return;
    }
    let dir = Scratch::new(if gso {
        "capture-legs-gso"
    } else {
        "capture-legs"
    });
    let sngrep = Sngrep::start(&dir);
    let uas = StrictUas::udp("s0");
    let ops = ops_of(&yaml_gso(&[("s0", uas.addr)], Some(sngrep.port), gso));
    let vserver = vserver_addr(&ops);
    let n = 5;
    calls(&ops, &dir, n, "legs");
    let frames = settled(&ops, &sngrep);
    let calls = by_call(&frames);
    assert_eq!(calls.len(), n as usize, "{:?}", calls.keys());
    for (call_id, frames) in &calls {
        let client = leg(frames, |f| f.src != uas.addr && f.dst != uas.addr);
        let service = leg(frames, |f| f.src == uas.addr || f.dst == uas.addr);
        assert_eq!(labels(&client), CALL, "client leg of {call_id}");
        assert_eq!(labels(&service), CALL, "service leg of {call_id}");
        check_client_leg(&client, vserver);
        check_service_leg(&service, vserver, uas.addr);
        check_forwarding_times(&client, &service);
    }
    let status = router::status(&ops);
    let capture = &status["capture"];
    assert_eq!(capture["connected"], true, "{capture}");
    assert_eq!(capture["sent"].as_u64(), Some(frames.len() as u64));
    assert_eq!(capture["id"], 2001);
    let metrics = router::handle(&ops, &router::Request::new("GET", "/metrics")).body;
    assert!(
        metrics.contains(&format!(
            "fulcrum_capture_packets_total{{result=\"sent\"}} {}",
            frames.len()
        )),
        "{metrics}"
    );
    assert!(metrics.contains("fulcrum_capture_connected 1"), "{metrics}");
}

/// A busy service's 503 ends at fulcrum, which ACKs it (its own message, captured on that
/// service's leg) and tries the next service; the caller sees only the call that succeeded.
#[test]
fn fulcrums_own_ack_of_a_503_before_failover_is_captured() {
    if !tools_available() {
        return;
    }
    let dir = Scratch::new("capture-failover");
    let sngrep = Sngrep::start(&dir);
    let busy = StrictUas::udp("s0");
    busy.set_sick(Sick::Busy);
    let fine = StrictUas::udp("s1");
    let ops = ops_of(&yaml(
        &[("s0", busy.addr), ("s1", fine.addr)],
        Some(sngrep.port),
    ));
    let vserver = vserver_addr(&ops);
    let n = 4;
    calls(&ops, &dir, n, "failover");
    let frames = settled(&ops, &sngrep);
    let calls = by_call(&frames);
    assert_eq!(calls.len(), n as usize, "{:?}", calls.keys());
    let mut failed_over = 0;
    for (call_id, frames) in &calls {
        let services = [busy.addr, fine.addr];
        let client = leg(frames, |f| {
            !services.contains(&f.src) && !services.contains(&f.dst)
        });
        let on_fine = leg(frames, |f| f.src == fine.addr || f.dst == fine.addr);
        let on_busy = leg(frames, |f| f.src == busy.addr || f.dst == busy.addr);
        assert_eq!(labels(&client), CALL, "client leg of {call_id}");
        assert_eq!(labels(&on_fine), CALL, "s1 leg of {call_id}");
        check_client_leg(&client, vserver);
        check_service_leg(&on_fine, vserver, fine.addr);
        if on_busy.is_empty() {
            continue;
        }
        failed_over += 1;
        let busy_labels: Vec<String> = labels(&on_busy)
            .into_iter()
            .filter(|l| l != "100 INVITE")
            .collect();
        assert_eq!(
            busy_labels,
            ["INVITE", "503 INVITE", "ACK"],
            "s0 leg of {call_id}"
        );
        check_service_leg(&on_busy, vserver, busy.addr);
        let first_invite = on_busy[0].time_us;
        let second_invite = on_fine[0].time_us;
        assert!(first_invite <= second_invite, "s0 asked before s1");
    }
    assert!(failed_over > 0, "round robin sent some calls to s0 first");
}

/// Nothing listens where capture goes: every call succeeds and the packets are counted as
/// dropped. A reload then points capture at sngrep (the next calls are captured) and turns it
/// off (nothing more is).
#[test]
fn a_dead_collector_costs_no_call_and_reload_turns_capture_on_and_off() {
    if !tools_available() {
        return;
    }
    let dir = Scratch::new("capture-reload");
    let uas = StrictUas::udp("s0");
    let dead = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("a port")
        .port();
    let ops = ops_of(&yaml(&[("s0", uas.addr)], Some(dead)));
    calls(&ops, &dir, 10, "dead");
    let capture = ops.capture().expect("running");
    let stats = capture.stats();
    assert!(common::wait_until(Duration::from_secs(5), || {
        let dropped: u64 = stats.dropped().iter().map(|d| d.1).sum();
        stats.sent.load(Ordering::Relaxed) + dropped >= 10 * 14
    }));
    assert!(stats.dropped_send_error.load(Ordering::Relaxed) > 0);
    assert!(!capture.is_connected());

    let sngrep = Sngrep::start(&dir);
    let on =
        config::from_str("on.yaml", &yaml(&[("s0", uas.addr)], Some(sngrep.port))).expect("config");
    let changes = ops.apply(on).expect("reload");
    assert!(changes.iter().any(|c| c == "capture"), "{changes:?}");
    let sent_before = sent(&ops);
    calls(&ops, &dir, 2, "on");
    assert!(common::wait_until(Duration::from_secs(5), || {
        sngrep.frames().len() as u64 == sent(&ops) - sent_before && sngrep.frames().len() >= 2 * 14
    }));
    assert_eq!(by_call(&sngrep.frames()).len(), 2);

    let off = config::from_str("off.yaml", &yaml(&[("s0", uas.addr)], None)).expect("config");
    ops.apply(off).expect("reload");
    assert!(!capture.is_on());
    let (frames, sent_on) = (sngrep.frames().len(), sent(&ops));
    calls(&ops, &dir, 2, "off");
    std::thread::sleep(common::SILENCE);
    assert_eq!((sngrep.frames().len(), sent(&ops)), (frames, sent_on));
    assert!(
        router::status(&ops)["capture"].is_null(),
        "capture off in /status"
    );
}

/// Over sip-tcp: the client's connection and fulcrum's link to the service are the two legs,
/// each message captured as TCP (IP protocol 6) with the connection's addresses.
#[test]
fn every_message_of_each_call_is_captured_on_both_legs_over_sip_tcp() {
    if !tools_available() {
        return;
    }
    let dir = Scratch::new("capture-tcp");
    let sngrep = Sngrep::start(&dir);
    let uas = StrictUas::tcp("s0");
    let ops = ops_of(&yaml_over(
        Transport::Tcp,
        &[("s0", uas.addr)],
        Some(sngrep.port),
    ));
    let vserver = vserver_addr(&ops);
    let n = 3;
    calls_over(Transport::Tcp, &ops, &dir, n, "tcp");
    let frames = settled(&ops, &sngrep);
    let calls = by_call(&frames);
    assert_eq!(calls.len(), n as usize, "{:?}", calls.keys());
    for (call_id, frames) in &calls {
        let client = leg(frames, |f| f.src != uas.addr && f.dst != uas.addr);
        let service = leg(frames, |f| f.src == uas.addr || f.dst == uas.addr);
        assert_eq!(labels(&client), CALL, "client leg of {call_id}");
        assert_eq!(labels(&service), CALL, "service leg of {call_id}");
        check_client_leg(&client, vserver);
        // fulcrum's end of its link: one connection from an ephemeral port of its own.
        let link = service[0].src;
        assert_eq!(link.ip(), uas.addr.ip());
        assert!(link != vserver && link != uas.addr);
        for f in &service {
            let (from, to) = if f.is_request() {
                (link, uas.addr)
            } else {
                (uas.addr, link)
            };
            assert_eq!((f.src, f.dst), (from, to), "{}", f.label());
        }
        check_forwarding_times(&client, &service);
    }
    // sngrep writes UDP frames whatever the packet says: the IP protocol is read from the
    // HEP packets themselves, at a collector of the test's own that a reload points to.
    let own = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    own.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let port = own.local_addr().expect("addr").port();
    let to_own = yaml_over(Transport::Tcp, &[("s0", uas.addr)], Some(port));
    ops.apply(config::from_str("own.yaml", &to_own).expect("config"))
        .expect("reload");
    calls_over(Transport::Tcp, &ops, &dir, 1, "tcp-own");
    let mut buf = vec![0u8; 65_536];
    for _ in 0..14 {
        let n = own.recv(&mut buf).expect("a HEP packet");
        let d = fulcrum::capture::hep::decode(&buf[..n]).expect("HEP3");
        assert_eq!((d.family, d.ip_proto), (Some(2), Some(6)));
        assert_eq!(d.agent_id, Some(2001));
    }
}

/// Over sip-tls, on both legs (a TLS client, a TLS service): what no network capture can read,
/// fulcrum's capture shows decrypted, every message of each call on both legs.
#[test]
fn every_message_of_each_call_over_sip_tls_is_captured_decrypted_on_both_legs() {
    if !sngrep_available() {
        return;
    }
    use common::tls::{Ca, client_config, connect, server_config};
    let dir = Scratch::new("capture-tls");
    let sngrep = Sngrep::start(&dir);
    let f = common::ConfigFile::new("capture-tls", "");
    let ca = Ca::new("fulcrum capture test CA");
    ca.write(&f, "ca.crt");
    ca.issue(&f, "sip", "fulcrum.test", "fulcrum");
    let uas_cert = ca.issue(&f, "uas", "uas.test", "uas");
    let uas = StrictUas::tls_at(
        "s0",
        SocketAddr::from(([127, 0, 0, 1], 0)),
        server_config(&uas_cert),
    );
    f.write(&format!(
        "admin: {{ listen: null }}\n\
         capture: {{ hep: {{ address: \"127.0.0.1:{}\", id: 2001 }} }}\n\
         services:\n  - {{ name: s0, address: \"{}\", protocol: sip-tls, tls: {{ ca: ca.crt, server_name: uas.test }} }}\n\
         vservers:\n  - {{ name: v, protocol: sip-tls, bind: [\"127.0.0.1:0\"], record_route: true, tls: {{ cert: sip.crt, key: sip.key }}, services: [s0] }}\n",
        sngrep.port, uas.addr
    ));
    let ops = common::tls::start(&f);
    let vserver = vserver_addr(&ops);
    let s = connect(
        vserver,
        &client_config(&ca, None),
        "fulcrum.test",
        common::ANSWER,
    )
    .expect("TLS client");
    let caller = s.sock.local_addr().expect("addr");
    let mut uac = common::sip_uac::Uac::new(s, caller, "TLS");
    let n = 3;
    for i in 0..n {
        let call = uac.call(&format!("tls-capture-{i}"));
        assert_eq!((call.invite, call.bye), (200, 200), "call {i}: {call:?}");
    }
    let frames = settled(&ops, &sngrep);
    let calls = by_call(&frames);
    assert_eq!(calls.len(), n, "{:?}", calls.keys());
    for (call_id, frames) in &calls {
        let client = leg(frames, |f| f.src != uas.addr && f.dst != uas.addr);
        let service = leg(frames, |f| f.src == uas.addr || f.dst == uas.addr);
        assert_eq!(labels(&client), CALL, "client leg of {call_id}");
        assert_eq!(labels(&service), CALL, "service leg of {call_id}");
        check_client_leg(&client, vserver);
        assert_eq!(client[0].src, caller);
        let link = service[0].src;
        assert!(link.ip() == uas.addr.ip() && link != vserver && link != uas.addr);
        for f in &service {
            let (from, to) = if f.is_request() {
                (link, uas.addr)
            } else {
                (uas.addr, link)
            };
            assert_eq!((f.src, f.dst), (from, to), "{}", f.label());
            // Readable SIP: fulcrum's Via toward the service says TLS.
            if f.label() == "INVITE" {
                assert!(f.text().contains("Via: SIP/2.0/TLS "), "{}", f.text());
            }
        }
        check_forwarding_times(&client, &service);
    }
    ops.shutdown();
}

/// A HEP collector of the test's own: a UDP socket whose packets are decoded by the crate's
/// decoder (the one its unit tests check against the HEP3 layout).
struct OwnCollector {
    socket: std::net::UdpSocket,
}

impl OwnCollector {
    fn new() -> OwnCollector {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        socket
            .set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        OwnCollector { socket }
    }

    fn port(&self) -> u16 {
        self.socket.local_addr().expect("addr").port()
    }

    /// Every packet received until `until` holds of them or `within` passes.
    fn collect(
        &self,
        within: Duration,
        mut until: impl FnMut(&[fulcrum::capture::hep::Decoded]) -> bool,
    ) -> Vec<fulcrum::capture::hep::Decoded> {
        let deadline = Instant::now() + within;
        let mut got = Vec::new();
        let mut buf = vec![0u8; 65_536];
        while Instant::now() < deadline && !until(&got) {
            if let Ok(n) = self.socket.recv(&mut buf) {
                got.push(fulcrum::capture::hep::decode(&buf[..n]).expect("HEP3"));
            }
        }
        got
    }
}

/// A sip-udp vserver over one monitored sip-udp service (`sip-options` every 200 ms),
/// capturing to `port` with `probes` as given.
fn probes_yaml(service: SocketAddr, port: u16, probes: bool) -> String {
    format!(
        "admin: {{ listen: null }}\n\
         capture: {{ hep: {{ address: \"127.0.0.1:{port}\", id: 7, probes: {probes} }} }}\n\
         monitors:\n  - {{ name: ping, type: sip-options, interval: 200ms, timeout: 150ms, failures_to_down: 2, successes_to_up: 1 }}\n\
         services:\n  - {{ name: s0, address: \"{service}\", protocol: sip-udp, monitor: ping }}\n\
         vservers:\n  - {{ name: v, protocol: sip-udp, bind: [\"127.0.0.1:0\"], services: [s0] }}\n"
    )
}

/// `probes: true` captures the monitor's OPTIONS and the service's 200, each on its leg
/// (fulcrum's probe socket and the service); `probes: false`, and a reload to it, none.
#[test]
fn the_monitors_options_are_captured_only_with_probes_on() {
    let uas = StrictUas::udp("s0");
    let collector = OwnCollector::new();
    let is_options = |d: &fulcrum::capture::hep::Decoded| {
        d.payload
            .as_deref()
            .is_some_and(|p| p.starts_with(b"OPTIONS "))
    };
    let is_answer = |d: &fulcrum::capture::hep::Decoded| {
        d.payload.as_deref().is_some_and(|p| {
            p.starts_with(b"SIP/2.0 200 ") && p.windows(8).any(|w| w == b" OPTIONS")
        })
    };
    let ops = ops_of(&probes_yaml(uas.addr, collector.port(), true));
    let got = collector.collect(Duration::from_secs(5), |g| {
        g.iter().filter(|d| is_options(d)).count() >= 2
            && g.iter().filter(|d| is_answer(d)).count() >= 2
    });
    let options: Vec<_> = got.iter().filter(|d| is_options(d)).collect();
    let answers: Vec<_> = got.iter().filter(|d| is_answer(d)).collect();
    assert!(options.len() >= 2 && answers.len() >= 2, "{got:?}");
    for o in &options {
        assert_eq!((o.ip_proto, o.agent_id), (Some(17), Some(7)));
        assert_eq!(
            (o.dst, o.dst_port),
            (Some(uas.addr.ip()), Some(uas.addr.port()))
        );
        assert_eq!(
            o.src,
            Some(uas.addr.ip()),
            "the probe's source is the address it left from"
        );
        // The probe's Call-ID, the correlation id.
        let cid = o.correlation_id.as_deref().expect("a Call-ID");
        assert!(
            cid.starts_with(b"fmon-"),
            "{}",
            String::from_utf8_lossy(cid)
        );
        // Its answer, from the service to the probe's own port.
        let a = answers
            .iter()
            .find(|a| a.correlation_id.as_deref() == Some(cid))
            .unwrap_or_else(|| panic!("no answer to {}", String::from_utf8_lossy(cid)));
        assert_eq!(
            (a.src, a.src_port),
            (Some(uas.addr.ip()), Some(uas.addr.port()))
        );
        assert_eq!((a.dst, a.dst_port), (o.src, o.src_port));
        let t = |d: &fulcrum::capture::hep::Decoded| {
            u64::from(d.time_s.unwrap_or(0)) * 1_000_000 + u64::from(d.time_us.unwrap_or(0))
        };
        assert!(t(a) >= t(o), "the answer after its request");
    }
    // probes: false (by reload): the monitor goes on, nothing of it is captured.
    ops.apply(
        config::from_str("off.yaml", &probes_yaml(uas.addr, collector.port(), false))
            .expect("config"),
    )
    .expect("reload");
    // What the old sender still had queued, then silence.
    collector.collect(Duration::from_millis(300), |_| false);
    let probed_before = uas.counts().requests;
    let got = collector.collect(Duration::from_secs(1), |_| false);
    assert!(
        uas.counts().requests >= probed_before + 3,
        "the monitor still probes"
    );
    assert!(got.is_empty(), "{got:?}");
}

/// The columns of the `sip_capture` table Kamailio's `sipcapture` module writes (its
/// `sip_capture()` insert), in the order of the test's db_text schema.
const SIP_CAPTURE_COLUMNS: [&str; 45] = [
    "date",
    "micro_ts",
    "method",
    "reply_reason",
    "correlation_id",
    "ruri",
    "ruri_user",
    "ruri_domain",
    "from_user",
    "from_domain",
    "from_tag",
    "to_user",
    "to_domain",
    "to_tag",
    "pid_user",
    "contact_user",
    "auth_user",
    "callid",
    "callid_aleg",
    "via_1",
    "via_1_branch",
    "cseq",
    "diversion",
    "reason",
    "content_type",
    "auth",
    "user_agent",
    "source_ip",
    "source_port",
    "destination_ip",
    "destination_port",
    "contact_ip",
    "contact_port",
    "originator_ip",
    "originator_port",
    "expires",
    "proto",
    "family",
    "rtp_stat",
    "type",
    "node",
    "msg",
    "custom_field1",
    "custom_field2",
    "custom_field3",
];

/// Kamailio with `sipcapture` receiving HEP on UDP 127.0.0.1:PORT and [::1]:PORT, each SIP
/// message stored by `sip_capture()` into a db_text `sip_capture` table (written to its file
/// when Kamailio ends).
struct KamailioCapture {
    proc: Proc,
    port: u16,
    db: PathBuf,
}

impl KamailioCapture {
    fn start(dir: &Scratch) -> KamailioCapture {
        let db = dir.path("db");
        std::fs::create_dir_all(&db).expect("db dir");
        let ints = [
            "date",
            "micro_ts",
            "source_port",
            "destination_port",
            "contact_port",
            "originator_port",
            "expires",
            "proto",
            "family",
            "type",
        ];
        let mut schema = String::from("id(int,auto)");
        for c in SIP_CAPTURE_COLUMNS {
            let t = if ints.contains(&c) { "int" } else { "string" };
            schema.push_str(&format!(" {c}({t},null)"));
        }
        schema.push('\n');
        std::fs::write(db.join("sip_capture"), schema).expect("table");
        std::fs::write(
            db.join("version"),
            "id(int,auto) table_name(string) table_version(int)\nsip_capture:4\n",
        )
        .expect("version");
        let url = db.display().to_string();
        let (proc, port) = spawn_listening("kamailio sipcapture", Transport::Udp, |port| {
            let cfg = dir.path(&format!("sipcapture-{port}.cfg"));
            std::fs::write(
                &cfg,
                format!(
                    "#!KAMAILIO\ndebug=1\nlog_stderror=yes\nfork=yes\nchildren=1\n\
                     listen=udp:127.0.0.1:{port}\nlisten=udp:[::1]:{port}\n\
                     disable_tcp=yes\nauto_aliases=no\ndns=no\nrev_dns=no\n\
                     mpath=\"/usr/lib/x86_64-linux-gnu/kamailio/modules/\"\n\
                     loadmodule \"db_text.so\"\nloadmodule \"sipcapture.so\"\n\
                     modparam(\"sipcapture\", \"db_url\", \"text://{url}\")\n\
                     modparam(\"sipcapture\", \"hep_capture_on\", 1)\n\
                     modparam(\"sipcapture\", \"capture_on\", 1)\n\
                     request_route {{ sip_capture(); drop; }}\n\
                     onreply_route {{ sip_capture(); drop; }}\n"
                ),
            )
            .expect("write kamailio config");
            let mut c = Command::new("kamailio");
            c.arg("-f").arg(cfg).args(["-DD", "-E"]);
            c
        });
        KamailioCapture { proc, port, db }
    }

    /// End Kamailio (SIGTERM: db_text writes its table on the way out) and read every row
    /// as a frame with the HEP time Kamailio stored, in the order it stored them.
    fn frames(mut self) -> Vec<(Frame, Row)> {
        let killed = Command::new("kill")
            .args(["-TERM", &self.proc.id().to_string()])
            .status()
            .expect("kill");
        assert!(killed.success(), "SIGTERM to Kamailio");
        assert!(
            self.proc.wait_for(Duration::from_secs(10)).is_some(),
            "Kamailio ends on SIGTERM"
        );
        let text = std::fs::read_to_string(self.db.join("sip_capture")).expect("table");
        let mut rows: Vec<Row> = text.lines().skip(1).filter_map(Row::parse).collect();
        rows.sort_by_key(|r| r.id);
        rows.into_iter()
            .map(|r| {
                let addr = |ip: &str, port: &str| {
                    SocketAddr::new(
                        ip.parse().unwrap_or_else(|_| panic!("address {ip}")),
                        port.parse().unwrap_or_else(|_| panic!("port {port}")),
                    )
                };
                let f = Frame {
                    time_us: r.hep_time_us(),
                    // Kamailio's own protocol numbers: 1 UDP, 2 TCP.
                    ip_proto: match r.get("proto") {
                        "1" => 17,
                        "2" => 6,
                        p => panic!("proto {p}"),
                    },
                    src: addr(r.get("source_ip"), r.get("source_port")),
                    dst: addr(r.get("destination_ip"), r.get("destination_port")),
                    payload: r.get("msg").as_bytes().to_vec(),
                };
                (f, r)
            })
            .collect()
    }
}

/// One row of a db_text table: fields split at `:`, `\:` and `\\` unescaped, `\r` `\n`
/// turned back into the characters.
#[derive(Debug, Clone)]
struct Row {
    id: u64,
    fields: Vec<String>,
}

impl Row {
    fn parse(line: &str) -> Option<Row> {
        let mut fields = vec![String::new()];
        let mut chars = line.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('r') => fields.last_mut()?.push('\r'),
                    Some('n') => fields.last_mut()?.push('\n'),
                    Some('t') => fields.last_mut()?.push('\t'),
                    Some('0') => fields.last_mut()?.push('\0'),
                    Some(other) => fields.last_mut()?.push(other),
                    None => {}
                },
                ':' => fields.push(String::new()),
                c => fields.last_mut()?.push(c),
            }
        }
        Some(Row {
            id: fields.first()?.parse().ok()?,
            fields,
        })
    }

    /// The HEP time in microseconds: db_text has no 64-bit integers and keeps the low 32
    /// bits of `micro_ts`; `date` (seconds) gives the rest.
    fn hep_time_us(&self) -> u64 {
        let base = self.get("date").parse::<u64>().expect("date") * 1_000_000;
        let low = self.get("micro_ts").parse::<i64>().expect("micro_ts") as u32;
        base + u64::from(low.wrapping_sub(base as u32))
    }

    fn get(&self, column: &str) -> &str {
        let i = SIP_CAPTURE_COLUMNS
            .iter()
            .position(|c| *c == column)
            .expect("a column");
        self.fields.get(i + 1).map_or("", String::as_str)
    }
}

/// Wait (bounded) until fulcrum's sender has sent everything the calls captured: the same
/// count over two reads 50 ms apart.
fn all_sent(ops: &Ops) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut before = u64::MAX;
    loop {
        let n = sent(ops);
        if n > 0 && n == before {
            return n;
        }
        assert!(Instant::now() < deadline, "capture still sending: {n}");
        before = n;
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A real HEP receiver from Debian: Kamailio's `sipcapture` stores (db_text) every message of
/// SIPp calls through a sip-udp vserver on both legs with their addresses, Call-ID as
/// correlation id, fulcrum's capture id as the node, IPv4 family; and, from a second fulcrum
/// on [::1] sending to Kamailio's IPv6 address, an OPTIONS and its 200 on both IPv6 legs
/// (family 10), which sngrep cannot show.
#[test]
fn kamailio_sipcapture_stores_every_message_of_each_call_on_both_legs() {
    kamailio_stores_every_message(false);
}

/// The same with UDP GSO: Kamailio skips the padding chunk and stores the same rows.
#[test]
fn kamailio_sipcapture_stores_every_message_sent_with_udp_gso() {
    kamailio_stores_every_message(true);
}

fn kamailio_stores_every_message(gso: bool) {
    if !common::kamailio_available() || !common::sipp::sipp_available() {
        return;
    }
    let dir = Scratch::new(if gso {
        "capture-kamailio-gso"
    } else {
        "capture-kamailio"
    });
    let kamailio = KamailioCapture::start(&dir);
    // IPv4: SIPp calls.
    let uas = StrictUas::udp("s0");
    let ops = ops_of(&yaml_gso(&[("s0", uas.addr)], Some(kamailio.port), gso));
    let vserver = vserver_addr(&ops);
    let n = 3;
    calls(&ops, &dir, n, "kamailio");
    let sent_v4 = all_sent(&ops);
    // IPv6: an OPTIONS from the test's own socket.
    let uas6 = StrictUas::udp_at("s6", "[::1]:0".parse().expect("addr"));
    let v6 = format!(
        "admin: {{ listen: null }}\n\
         capture: {{ hep: {{ address: \"[::1]:{}\", id: 2006 }} }}\n\
         services:\n  - {{ name: s6, address: \"{}\", protocol: sip-udp }}\n\
         vservers:\n  - {{ name: v6, protocol: sip-udp, bind: [\"[::1]:0\"], services: [s6] }}\n",
        kamailio.port, uas6.addr
    );
    let ops6 = ops_of(&v6);
    let vserver6 = vserver_addr(&ops6);
    let phone = std::net::UdpSocket::bind("[::1]:0").expect("bind");
    phone
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    let me = phone.local_addr().expect("addr");
    let options = format!(
        "OPTIONS sip:s6@example.com SIP/2.0\r\nVia: SIP/2.0/UDP {me};branch=z9hG4bK-v6-1\r\nMax-Forwards: 70\r\nFrom: <sip:t@example.com>;tag=v6\r\nTo: <sip:s6@example.com>\r\nCall-ID: v6-options@test\r\nCSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n"
    );
    phone
        .send_to(options.as_bytes(), vserver6)
        .expect("send OPTIONS");
    let mut buf = vec![0u8; 65_536];
    let (k, _) = phone.recv_from(&mut buf).expect("an answer");
    assert!(
        buf[..k].starts_with(b"SIP/2.0 200 "),
        "{}",
        String::from_utf8_lossy(&buf[..k])
    );
    let sent_v6 = all_sent(&ops6);
    drop((ops, ops6));

    let rows = kamailio.frames();
    eprintln!("sipcapture stored {} rows", rows.len());
    assert_eq!(rows.len() as u64, sent_v4 + sent_v6, "every packet stored");
    let (v4, v6): (Vec<_>, Vec<_>) = rows.into_iter().partition(|(_, r)| r.get("family") == "2");
    let frames: Vec<Frame> = v4.iter().map(|(f, _)| f.clone()).collect();
    let calls = by_call(&frames);
    assert_eq!(calls.len(), n as usize, "{:?}", calls.keys());
    for (call_id, frames) in &calls {
        let client = leg(frames, |f| f.src != uas.addr && f.dst != uas.addr);
        let service = leg(frames, |f| f.src == uas.addr || f.dst == uas.addr);
        assert_eq!(labels(&client), CALL, "client leg of {call_id}");
        assert_eq!(labels(&service), CALL, "service leg of {call_id}");
        check_client_leg(&client, vserver);
        check_service_leg(&service, vserver, uas.addr);
        check_forwarding_times(&client, &service);
    }
    for (f, r) in &v4 {
        assert_eq!(r.get("correlation_id"), f.call_id(), "{}", f.label());
        assert_eq!(r.get("callid"), f.call_id());
        assert!(r.get("node").ends_with(":2001"), "{}", r.get("node"));
    }
    // IPv6: the OPTIONS and its 200, client leg and service leg, in order of HEP time.
    let mut v6 = v6;
    v6.sort_by_key(|(f, _)| f.time_us);
    let legs: Vec<(SocketAddr, SocketAddr, String)> = v6
        .iter()
        .map(|(f, r)| {
            assert_eq!(r.get("family"), "10");
            assert_eq!(r.get("correlation_id"), "v6-options@test");
            assert!(r.get("node").ends_with(":2006"), "{}", r.get("node"));
            (f.src, f.dst, f.label())
        })
        .collect();
    assert_eq!(
        legs,
        vec![
            (me, vserver6, "OPTIONS".to_owned()),
            (vserver6, uas6.addr, "OPTIONS".to_owned()),
            (uas6.addr, vserver6, "200 OPTIONS".to_owned()),
            (vserver6, me, "200 OPTIONS".to_owned()),
        ]
    );
}
