//! SIP over TLS (`sip-tls`, docs/tls.md) over loopback: whole calls from a TLS client through
//! fulcrum to strict SIP services over TLS (each answers 481 to a BYE for a dialog it did not
//! set up), with fulcrum's Via and Record-Route saying TLS; `sip-options` monitors over TLS;
//! plaintext and stalled clients dropped and counted while calls go on; mutual TLS; a
//! certificate reload; monitors over TLS kept running through reloads, with the CA a reload
//! read; the call book of the TLS load generator (`examples/sip_tls_load.rs`)
//! against the strict UAS, alone and through fulcrum. Certificates are made in the test
//! (rcgen) into its own directory.

mod common;

use common::sip_load::CallBook;
use common::sip_tcp::{Next, next_message};
use common::sip_uac::Uac;
use common::strict_uas::{Sick, StrictUas, UasCore};
use common::tls::{
    Ca, addr, client_config, connect, failed, listener, metrics, server_config, service_handshakes,
    start,
};
use common::*;
use fulcrum::balancer::Health;
use fulcrum::ops::Ops;
use fulcrum::sip::{self, DEFAULT_MAX_MESSAGE, Frame, next_frame};
use fulcrum::tls::Reason;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CALLS: usize = 20;

/// Two strict UAS over TLS (certificate for `uas.test`), a sip-tls vserver `v` over them
/// presenting `sip.crt` for `fulcrum.test`, each service probed by OPTIONS over TLS.
struct Lab {
    f: ConfigFile,
    ca: Ca,
    uas: Vec<StrictUas>,
}

impl Lab {
    fn new(tag: &str) -> Lab {
        let f = ConfigFile::new(tag, "");
        let ca = Ca::new("fulcrum sip-tls test CA");
        ca.write(&f, "ca.crt");
        ca.issue(&f, "sip", "fulcrum.test", "fulcrum");
        let uas_cert = ca.issue(&f, "uas", "uas.test", "uas");
        let tls = server_config(&uas_cert);
        let uas = (0..2)
            .map(|i| {
                StrictUas::tls_at(
                    &format!("s{i}"),
                    SocketAddr::from(([127, 0, 0, 1], 0)),
                    Arc::clone(&tls),
                )
            })
            .collect();
        Lab { f, ca, uas }
    }

    fn yaml(&self, vserver_tls_extra: &str, extra: &str) -> String {
        let mut y = String::from(
            "admin: { listen: null }\n\
             monitors:\n  - { name: ping, type: sip-options, interval: 500ms, timeout: 500ms, failures_to_down: 1, successes_to_up: 1 }\n\
             services:\n",
        );
        for u in &self.uas {
            y.push_str(&format!(
                "  - {{ name: {}, address: \"{}\", protocol: sip-tls, monitor: ping, tls: {{ ca: ca.crt, server_name: uas.test }} }}\n",
                u.name, u.addr
            ));
        }
        y.push_str(&format!(
            "vservers:\n  - name: v\n    protocol: sip-tls\n    bind: [\"127.0.0.1:0\"]\n    method: call_id_hash\n    record_route: true\n    tls: {{ cert: sip.crt, key: sip.key{vserver_tls_extra} }}\n{extra}    services: [s0, s1]\n"
        ));
        y
    }

    fn start(&self, yaml: &str) -> Arc<Ops> {
        self.f.write(yaml);
        let ops = start(&self.f);
        // Both services answered a monitor's OPTIONS over TLS.
        assert!(
            wait_until(Duration::from_secs(10), || self
                .uas
                .iter()
                .all(|u| u.counts().requests > 0)),
            "the sip-options monitors reached both services over TLS"
        );
        ops
    }

    fn client(
        &self,
        ops: &Ops,
        cert: Option<&common::tls::Issued>,
    ) -> std::io::Result<Uac<common::tls::ClientStream>> {
        let cfg = client_config(&self.ca, cert);
        let s = connect(addr(ops, "v"), &cfg, "fulcrum.test", ANSWER)?;
        let local = s.sock.local_addr()?;
        Ok(Uac::new(s, local, "TLS"))
    }
}

/// A TLS 1.2 client that asks for a renegotiation gets the `no_renegotiation` alert at once,
/// though it has sent no SIP message fulcrum could answer; the refusal is counted.
#[test]
fn a_renegotiation_request_is_answered_and_counted() {
    let required = std::env::var_os("FULCRUM_REQUIRE_OPENSSL").is_some_and(|v| v == "1");
    let lab = Lab::new("sip-tls-reneg");
    let ops = lab.start(&lab.yaml("", ""));
    let ca = lab.f.path.with_file_name("ca.crt");
    let wait = Duration::from_secs(5);
    let Some((ended, out)) =
        common::tls::openssl_renegotiate(addr(&ops, "v"), &ca, "fulcrum.test", wait)
    else {
        assert!(!required, "FULCRUM_REQUIRE_OPENSSL=1 but no openssl binary");
        println!("skipped: no openssl binary");
        return;
    };
    assert!(ended, "s_client still waits for an answer: {out}");
    assert!(out.contains("no renegotiation"), "the alert: {out}");
    let refused = &listener(&ops, "v").counters.renegotiations_refused;
    assert_eq!(refused.load(Ordering::Relaxed), 1);
    let m = metrics(&ops);
    assert!(
        m.contains("fulcrum_tls_renegotiations_refused_total{vserver=\"v\"} 1"),
        "{m}"
    );
    ops.shutdown();
}

#[test]
fn calls_over_tls_reach_strict_services_over_tls_and_every_hop_says_tls() {
    let lab = Lab::new("sip-tls-calls");
    let ops = lab.start(&lab.yaml("", ""));
    let vs = addr(&ops, "v");
    let mut uac = lab.client(&ops, None).expect("TLS client");
    for i in 0..CALLS {
        let call = uac.call(&format!("tls-call-{i}"));
        assert_eq!((call.invite, call.bye), (200, 200), "call {i}: {call:?}");
        // fulcrum's Record-Route names its TLS listener (RFC 3261 §16.6 step 4 with the
        // transport of the leg, RFC 5630).
        assert_eq!(call.record_route.len(), 1, "{call:?}");
        let rr = &call.record_route[0];
        assert!(
            rr.starts_with(&format!("<sip:{vs};transport=tls;lr")),
            "{rr}"
        );
    }
    let counts: Vec<_> = lab.uas.iter().map(|u| u.counts()).collect();
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
    for u in &lab.uas {
        let via = u.last_via().expect("a request reached it");
        assert!(
            via.starts_with("SIP/2.0/TLS "),
            "fulcrum's Via toward a TLS service: {via}"
        );
    }
    assert!(
        listener(&ops, "v")
            .counters
            .completed
            .load(Ordering::Relaxed)
            >= 1
    );
    ops.shutdown();
}

/// Over TLS on both legs, with one of the two services sick (INVITEs answered 503 while its
/// OPTIONS get 200, or never answered): no call fails, the sick service sets up none and the
/// healthy one ends every call (no BYE misrouted).
fn no_call_fails_over_tls_with(sick: Sick) {
    let lab = Lab::new(&format!("sip-tls-sick-{sick:?}"));
    lab.uas[1].set_sick(sick);
    let ops = lab.start(&lab.yaml("", ""));
    let mut uac = lab.client(&ops, None).expect("TLS client");
    for i in 0..CALLS {
        let call = uac.call(&format!("tls-sick-{i}"));
        assert_eq!((call.invite, call.bye), (200, 200), "call {i}: {call:?}");
    }
    let counts: Vec<_> = lab.uas.iter().map(|u| u.counts()).collect();
    assert_eq!(counts[1].dialogs, 0, "{counts:?}");
    assert!(
        counts[1].invites > 0,
        "the sick service was tried: {counts:?}"
    );
    assert_eq!(counts[0].byes_ok, CALLS as u64, "{counts:?}");
    assert_eq!(counts.iter().map(|c| c.r481).sum::<u64>(), 0, "{counts:?}");
    ops.shutdown();
}

#[test]
fn over_tls_a_service_answering_invites_503_fails_no_call() {
    no_call_fails_over_tls_with(Sick::Busy);
}

#[test]
fn over_tls_a_service_that_never_answers_invites_fails_no_call() {
    no_call_fails_over_tls_with(Sick::Silent);
}

#[test]
fn plaintext_and_stalled_clients_are_dropped_and_counted_while_calls_go_on() {
    let lab = Lab::new("sip-tls-bad-clients");
    let ops = lab.start(&lab.yaml("", "    tls_handshake_timeout: 1s\n"));
    let vs = addr(&ops, "v");
    let l = listener(&ops, "v");
    // A client that opens the TCP connection and never starts the handshake.
    let stalled = TcpStream::connect(vs).expect("connect");
    // A SIP-over-TCP client on the TLS port.
    let mut plain = TcpStream::connect(vs).expect("connect");
    plain
        .write_all(
            b"OPTIONS sip:fulcrum.test SIP/2.0\r\nVia: SIP/2.0/TCP 127.0.0.1:1;branch=z9hG4bK-p\r\n\
              Max-Forwards: 70\r\nFrom: <sip:a@b>;tag=1\r\nTo: <sip:c@d>\r\nCall-ID: plain\r\n\
              CSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n",
        )
        .expect("write");
    plain.set_read_timeout(Some(ANSWER)).expect("timeout");
    let mut buf = [0u8; 512];
    let n = plain.read(&mut buf).unwrap_or(0);
    assert!(
        !String::from_utf8_lossy(&buf[..n]).contains("SIP/2.0"),
        "no SIP answer in clear"
    );
    assert!(
        wait_until(ANSWER, || failed(&l, Reason::NotTls) >= 1),
        "plaintext counted as not_tls"
    );
    // Calls go on meanwhile.
    let mut uac = lab.client(&ops, None).expect("TLS client");
    for i in 0..5 {
        let call = uac.call(&format!("beside-{i}"));
        assert_eq!((call.invite, call.bye), (200, 200), "{call:?}");
    }
    // The stalled one is dropped once its handshake time is up.
    let t0 = Instant::now();
    assert!(
        wait_until(Duration::from_secs(5), || failed(&l, Reason::Timeout) >= 1),
        "a stalled handshake is counted as timeout"
    );
    stalled.set_read_timeout(Some(ANSWER)).expect("timeout");
    let mut one = [0u8; 1];
    assert!(
        matches!((&stalled).read(&mut one), Ok(0) | Err(_)),
        "the stalled connection is closed"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    ops.shutdown();
}

#[test]
fn mutual_tls_admits_a_client_certificate_and_refuses_none() {
    let lab = Lab::new("sip-tls-mtls");
    let ops = lab.start(&lab.yaml(", client_ca: ca.crt", ""));
    let l = listener(&ops, "v");
    let phone = lab.ca.issue(&lab.f, "phone", "phone.test", "phone");
    let mut uac = lab.client(&ops, Some(&phone)).expect("with a certificate");
    let call = uac.call("mtls-1");
    assert_eq!((call.invite, call.bye), (200, 200), "{call:?}");
    // Without a certificate the server refuses the handshake (TLS 1.3 reports it on the
    // first read, so a call is tried and must fail).
    let refused = lab
        .client(&ops, None)
        .map(|mut u| u.call("mtls-none").invite)
        .unwrap_or(0);
    assert_eq!(refused, 0, "no call without a client certificate");
    assert!(
        wait_until(ANSWER, || failed(&l, Reason::NoCertificate) >= 1),
        "counted as no_certificate"
    );
    ops.shutdown();
}

#[test]
fn reload_swaps_the_certificate_for_new_handshakes_and_established_calls_go_on() {
    let lab = Lab::new("sip-tls-reload");
    let ops = lab.start(&lab.yaml("", ""));
    let vs = addr(&ops, "v");
    let mut established = lab.client(&ops, None).expect("TLS client");
    let second = lab.ca.issue(&lab.f, "sip", "fulcrum.test", "second");
    let changes = ops.reload().expect("reload");
    assert!(
        changes
            .iter()
            .any(|c| c == "vservers.v.tls certificate changed"),
        "{changes:?}"
    );
    let fresh = connect(vs, &client_config(&lab.ca, None), "fulcrum.test", ANSWER).expect("new");
    assert_eq!(
        fresh.conn.peer_certificates().and_then(|c| c.first()),
        Some(&second.der),
        "a new handshake sees the new certificate"
    );
    let call = established.call("after-reload");
    assert_eq!((call.invite, call.bye), (200, 200), "{call:?}");
    ops.shutdown();
}

/// Probes of service `name` so far: (answered, failed).
fn probes(ops: &Ops, name: &str) -> (u64, u64) {
    ops.health().service(name).map_or((0, 0), |r| {
        (
            r.probes_ok.load(Ordering::Relaxed),
            r.probes_failed.load(Ordering::Relaxed),
        )
    })
}

fn health(ops: &Ops, name: &str) -> Option<Health> {
    ops.health().service(name).map(|r| r.effective())
}

/// A config of the sip-tls vserver `v` over `services` (YAML lines), monitored by `ping`.
fn monitored(monitor: &str, services: &str, members: &str) -> String {
    format!(
        "admin: {{ listen: null }}\n\
         monitors:\n  - {{ name: ping, type: sip-options, {monitor} }}\n\
         services:\n{services}\
         vservers:\n  - {{ name: v, protocol: sip-tls, bind: [\"127.0.0.1:0\"], method: call_id_hash, tls: {{ cert: sip.crt, key: sip.key }}, services: [{members}] }}\n"
    )
}

/// A reload re-reads the CA of a monitored sip-tls service and restarts no probe task, not
/// even when it rebuilds the vserver: under a reload every 100 ms (every other one changing a
/// weight), the service over TLS and a plain sip-tcp one are still probed on their 2 s
/// interval. Their first probes wait a fraction of the interval derived from the name (about
/// 1 s for `s0` and `s1`), so probe tasks restarted by each reload would not probe at all
/// while the reloads go on.
#[test]
fn frequent_reloads_keep_the_probe_cadence_of_tls_and_plain_services() {
    let f = ConfigFile::new("sip-tls-monitor-cadence", "");
    let ca = Ca::new("fulcrum monitor cadence CA");
    ca.write(&f, "ca.crt");
    ca.issue(&f, "sip", "fulcrum.test", "fulcrum");
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let over_tls = StrictUas::tls_at(
        "s0",
        any,
        server_config(&ca.issue(&f, "uas", "uas.test", "uas")),
    );
    let plain = StrictUas::tcp("s1");
    let yaml = |weight: u32| {
        monitored(
            "interval: 2s, timeout: 1s",
            &format!(
                "  - {{ name: s0, address: \"{}\", protocol: sip-tls, monitor: ping, tls: {{ ca: ca.crt, server_name: uas.test }} }}\n\
                 \x20 - {{ name: s1, address: \"{}\", protocol: sip-tcp, weight: {weight}, monitor: ping }}\n",
                over_tls.addr, plain.addr
            ),
            "s0, s1",
        )
    };
    f.write(&yaml(1));
    let ops = start(&f);
    let answered = |ops: &Ops| [probes(ops, "s0").0, probes(ops, "s1").0];
    assert!(
        wait_until(Duration::from_secs(10), || answered(&ops)
            .iter()
            .all(|&n| n >= 1)),
        "first probes: {:?}",
        answered(&ops)
    );
    let before = answered(&ops);
    // Five seconds of reloads: two intervals after the first probes, and one to spare.
    let until = Instant::now() + Duration::from_secs(5);
    let (mut reloads, mut weight) = (0, 1);
    while Instant::now() < until && reloads < 100 {
        // The vserver's certificate files do not change: its listener is left as it is.
        let mut expected = Vec::<String>::new();
        if reloads % 2 == 1 {
            weight = 3 - weight;
            f.write(&yaml(weight));
            expected.push("vservers.v rebuilt".to_owned());
        }
        let changes = ops.reload().expect("reload");
        assert_eq!(changes, expected, "reload {reloads}");
        reloads += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    let after = answered(&ops);
    assert!(
        after.iter().zip(&before).all(|(a, b)| a > b),
        "probes went on through {reloads} reloads: {before:?} -> {after:?}"
    );
    assert_eq!(
        (probes(&ops, "s0").1, probes(&ops, "s1").1),
        (0, 0),
        "no probe failed"
    );
    assert!(over_tls.counts().requests > 0 && plain.counts().requests > 0);
    ops.shutdown();
}

/// A reload that swaps the CA of a monitored sip-tls service (its certificate re-issued by a
/// new CA) reaches the running monitor: its probes fail from the re-issue to the reload, then
/// pass. A reload whose CA file holds no certificate is refused and the monitor probes on
/// with the CA in force.
#[test]
fn a_reloaded_ca_reaches_the_running_monitor_and_a_refused_reload_keeps_the_last() {
    let f = ConfigFile::new("sip-tls-monitor-ca", "");
    let first_ca = Ca::new("fulcrum monitor CA 1");
    first_ca.write(&f, "ca.crt");
    first_ca.issue(&f, "sip", "fulcrum.test", "fulcrum");
    let served = Arc::new(Mutex::new(server_config(
        &first_ca.issue(&f, "uas", "uas.test", "uas"),
    )));
    let uas = StrictUas::tls_from(
        "s0",
        SocketAddr::from(([127, 0, 0, 1], 0)),
        Arc::clone(&served),
    );
    f.write(&monitored(
        "interval: 300ms, timeout: 300ms, failures_to_down: 1, successes_to_up: 1",
        &format!(
            "  - {{ name: s0, address: \"{}\", protocol: sip-tls, monitor: ping, tls: {{ ca: ca.crt, server_name: uas.test }} }}\n",
            uas.addr
        ),
        "s0",
    ));
    let ops = start(&f);
    let limit = Duration::from_secs(10);
    assert!(
        wait_until(limit, || probes(&ops, "s0").0 >= 1),
        "the monitor reached the service over TLS"
    );
    assert_eq!(health(&ops, "s0"), Some(Health::Up));

    // The service's certificate re-issued by a new CA: the CA in force refuses it.
    let second_ca = Ca::new("fulcrum monitor CA 2");
    *served.lock().expect("uas tls") =
        server_config(&second_ca.issue(&f, "uas2", "uas.test", "uas"));
    assert!(
        wait_until(limit, || health(&ops, "s0") == Some(Health::Down)),
        "the old CA refuses the re-issued certificate: {:?}",
        probes(&ops, "s0")
    );

    // The new CA in the file, a reload: the running monitor's next probes use it.
    second_ca.write(&f, "ca.crt");
    ops.reload().expect("reload");
    let (ok, _) = probes(&ops, "s0");
    assert!(
        wait_until(limit, || health(&ops, "s0") == Some(Health::Up)
            && probes(&ops, "s0").0 > ok),
        "the new CA verifies the re-issued certificate: {:?}",
        probes(&ops, "s0")
    );

    // A CA file that holds no certificate: refused, and the probes go on with the new CA.
    f.beside("ca.crt", "no certificate here\n");
    let e = ops.reload().expect_err("refused").to_string();
    assert!(e.contains("ca"), "{e}");
    let (ok, failed) = probes(&ops, "s0");
    assert!(
        wait_until(limit, || probes(&ops, "s0").0 >= ok + 2),
        "probes go on: {:?}",
        probes(&ops, "s0")
    );
    assert_eq!(probes(&ops, "s0").1, failed, "none failed");
    assert_eq!(health(&ops, "s0"), Some(Health::Up));
    ops.shutdown();
}

/// The SIP core of vserver `name` (a reload that rebuilds the vserver makes a new one).
fn sip_core(ops: &Ops, name: &str) -> Arc<fulcrum::core::sip::SipCore> {
    ops.with_vservers(|vs, _| {
        let v = vs.iter().find(|v| v.name == name)?;
        let p = v.path::<fulcrum::proxy::SipStreamPath>()?;
        Some(Arc::clone(p.core()))
    })
    .flatten()
    .expect("a sip stream vserver")
}

/// Handshakes of the links toward sip-tls services, per service in `/metrics`: completed
/// toward the good ones, failed as `unknown_ca` toward one whose certificate another CA
/// signed (its calls go to the others). A reload that rebuilds the vserver keeps the counts,
/// of the links it keeps and of a service it moves to another address (a new link).
#[test]
fn handshakes_toward_tls_services_are_counted_per_service_and_survive_a_reload() {
    let lab = Lab::new("sip-tls-svc-metrics");
    let other = Ca::new("another CA");
    let wrong = server_config(&other.issue(&lab.f, "wrong", "uas.test", "uas"));
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let (bad, moved) = (
        StrictUas::tls_at("bad", any, Arc::clone(&wrong)),
        StrictUas::tls_at("bad", any, wrong),
    );
    // `bad` unmonitored: UP until its link fails, so calls are sent its way.
    let yaml = |bad_at: SocketAddr, weight: u32| {
        lab.yaml("", "")
            .replace(
                "vservers:",
                &format!("  - {{ name: bad, address: \"{bad_at}\", protocol: sip-tls, tls: {{ ca: ca.crt, server_name: uas.test }} }}\nvservers:"),
            )
            .replace("protocol: sip-tls, monitor: ping", &format!("protocol: sip-tls, weight: {weight}, monitor: ping"))
            .replace("services: [s0, s1]", "services: [s0, s1, bad]")
    };
    let ops = lab.start(&yaml(bad.addr, 1));
    let mut uac = lab.client(&ops, None).expect("TLS client");
    for i in 0..CALLS {
        let call = uac.call(&format!("svc-metrics-{i}"));
        assert_eq!((call.invite, call.bye), (200, 200), "call {i}: {call:?}");
    }
    assert_eq!(bad.counts().requests, 0, "nothing reached bad over TLS");
    let m = metrics(&ops);
    let b = service_handshakes(&m, "v", "bad").expect("bad's series");
    assert!(b.lists_every_reason(), "{m}");
    assert_eq!(b.completed, Some(0), "{m}");
    assert!(b.failed(Reason::UnknownCa) >= 1, "{m}");
    assert_eq!(b.failed_otherwise(Reason::UnknownCa), 0, "{m}");
    let mut good = Vec::new();
    for s in ["s0", "s1"] {
        let h = service_handshakes(&m, "v", s).expect("a good service's series");
        assert!(h.lists_every_reason(), "{m}");
        assert!(h.completed >= Some(1), "{s}'s link connected: {m}");
        assert_eq!(h.failed_total(), 0, "{m}");
        good.push(h.completed);
    }

    // New weights for s0 and s1 and a new address for bad rebuild the vserver: s0 and s1 keep
    // their links, bad gets a new one; every count carries on.
    let before = sip_core(&ops, "v");
    lab.f.write(&yaml(moved.addr, 2));
    ops.reload().expect("reload");
    assert!(
        !Arc::ptr_eq(&before, &sip_core(&ops, "v")),
        "the vserver was rebuilt"
    );
    let m = metrics(&ops);
    let b2 = service_handshakes(&m, "v", "bad").expect("bad's series");
    assert!(
        b2.failed(Reason::UnknownCa) >= b.failed(Reason::UnknownCa),
        "{m}"
    );
    for (s, was) in ["s0", "s1"].iter().zip(&good) {
        let h = service_handshakes(&m, "v", s).expect("series");
        assert!(h.completed >= *was, "{s}: {m}");
    }
    ops.shutdown();
}

/// A sip-tls service that accepts the TCP connection and never answers the handshake: a
/// call sent its way fails over to another service (no answer within `no_answer`), and the
/// link's connect bound (3 s) counts a `timeout` toward the stalled service when it passes,
/// not before.
#[test]
fn a_service_that_never_answers_the_handshake_is_counted_as_timeout() {
    let lab = Lab::new("sip-tls-svc-stall");
    // Never accepted: the kernel completes the TCP handshake, the ClientHello stays unread.
    let stalled = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let at = stalled.local_addr().expect("addr");
    // Unmonitored: UP until its link fails, so calls are sent its way.
    let yaml = lab
        .yaml("", "")
        .replace(
            "vservers:",
            &format!("  - {{ name: stall, address: \"{at}\", protocol: sip-tls, tls: {{ ca: ca.crt, server_name: uas.test }} }}\nvservers:"),
        )
        .replace("services: [s0, s1]", "services: [s0, s1, stall]");
    let ops = lab.start(&yaml);
    let mut uac = lab.client(&ops, None).expect("TLS client");
    uac.wait = Duration::from_secs(8);
    let t0 = Instant::now();
    for i in 0..CALLS {
        let call = uac.call(&format!("stall-{i}"));
        assert_eq!((call.invite, call.bye), (200, 200), "call {i}: {call:?}");
    }
    // The link's connect bound counts the timeout when it passes, which the calls (moved on
    // by failover) need not wait for.
    wait_until(Duration::from_secs(5), || {
        service_handshakes(&metrics(&ops), "v", "stall")
            .is_some_and(|h| h.failed(Reason::Timeout) >= 1)
    });
    let h = service_handshakes(&metrics(&ops), "v", "stall").expect("stall's series");
    assert!(h.failed(Reason::Timeout) >= 1, "{h:?}");
    assert_eq!(h.failed_otherwise(Reason::Timeout), 0, "{h:?}");
    assert_eq!(h.completed, Some(0));
    assert!(
        t0.elapsed() >= Duration::from_millis(2900),
        "the timeout is counted at the connect bound, not before: {:?}",
        t0.elapsed()
    );
    drop(stalled);
    ops.shutdown();
}

/// The framed messages of `bytes`.
fn frames(mut bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    while let Ok(Frame::Message { len, .. }) = next_frame(bytes, DEFAULT_MAX_MESSAGE) {
        v.push(bytes[..len].to_vec());
        bytes = &bytes[len..];
    }
    v
}

/// `msg` with a Record-Route header added after its start line (what a proxy on the way does).
fn with_record_route(msg: &[u8], rr: &str) -> Vec<u8> {
    let s = String::from_utf8_lossy(msg);
    s.replacen("\r\n", &format!("\r\nRecord-Route: {rr}\r\n"), 1)
        .into_bytes()
}

#[test]
fn the_load_generators_call_book_completes_calls_and_fails_a_481_silence_and_counts_reordering() {
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let local = SocketAddr::from(([127, 0, 0, 1], 40_000));
    let at = SocketAddr::from(([127, 0, 0, 1], 5061));
    let mut book = CallBook::new(local, "TLS", Duration::from_secs(2));
    let mut uas = UasCore::new("s0", at, "tls");
    let mut elsewhere = UasCore::new("s1", at, "tls");
    let rr = "<sip:127.0.0.1:5060;transport=tls;lr>";
    let mut out = Vec::new();

    // A whole call: the answers of a real strict UAS, ACK and BYE along the route set to
    // its Contact.
    book.start("c1", ms(0), &mut out);
    let answers = uas.handle(&with_record_route(&out, rr));
    assert_eq!(answers.len(), 3, "100, 180, 200");
    out.clear();
    for a in &answers {
        book.on_message(a, ms(10), &mut out);
    }
    let sent = frames(&out);
    assert_eq!(sent.len(), 2, "ACK and BYE");
    for (m, method) in sent.iter().zip(["ACK", "BYE"]) {
        let msg = sip::scan(m).expect("a request");
        assert_eq!(msg.method(), Some(method.as_bytes()));
        let text = String::from_utf8_lossy(m);
        assert!(
            text.starts_with(&format!("{method} sip:s0@{at};transport=tls SIP/2.0\r\n")),
            "to the Contact: {text}"
        );
        assert!(text.contains(&format!("\r\nRoute: {rr}\r\n")), "{text}");
    }
    assert!(uas.handle(&sent[0]).is_empty(), "an ACK is not answered");
    let ok = uas.handle(&sent[1]);
    out.clear();
    book.on_message(&ok[0], ms(25), &mut out);
    assert!(out.is_empty());
    assert_eq!(book.tally.completed, 1);
    assert_eq!(book.tally.setup_us, vec![10_000]);
    assert_eq!(book.tally.bye_us, vec![15_000]);
    assert_eq!(uas.counts().byes_ok, 1);
    // An answer for a call no longer in progress is stray.
    book.on_message(&ok[0], ms(26), &mut out);
    assert_eq!(book.tally.stray, 1);

    // A BYE that reaches another service gets 481: the call fails, counted as such.
    book.start("c2", ms(100), &mut out);
    let invite = frames(&out).pop().expect("INVITE");
    out.clear();
    for a in uas.handle(&invite) {
        book.on_message(&a, ms(110), &mut out);
    }
    let bye = frames(&out).pop().expect("BYE");
    out.clear();
    for a in elsewhere.handle(&bye) {
        book.on_message(&a, ms(120), &mut out);
    }
    assert_eq!(elsewhere.counts().r481, 1);
    assert_eq!((book.tally.failed_481, book.tally.completed), (1, 1));
    assert_eq!(book.in_progress(), 0);

    // A provisional overtaken by the 200 is counted late; the call still completes.
    out.clear();
    book.start("c3", ms(200), &mut out);
    let answers = uas.handle(&frames(&out).pop().expect("INVITE"));
    out.clear();
    book.on_message(&answers[2], ms(210), &mut out);
    book.on_message(&answers[1], ms(211), &mut out);
    assert_eq!(book.tally.late, 1);
    let bye = frames(&out).pop().expect("BYE");
    book.on_message(&uas.handle(&bye)[0], ms(220), &mut out);
    assert_eq!(book.tally.completed, 2);

    // No answer: the call fails once the timeout has passed, not before.
    out.clear();
    book.start("c4", ms(1_000), &mut out);
    book.expire(ms(3_000));
    assert_eq!((book.tally.failed_timeout, book.in_progress()), (0, 1));
    book.expire(ms(3_001));
    assert_eq!((book.tally.failed_timeout, book.in_progress()), (1, 0));

    // A closed connection fails what is in progress.
    book.start("c5", ms(4_000), &mut out);
    book.close();
    assert_eq!(book.tally.failed_closed, 1);
    assert_eq!(book.tally.failed(), 3);
    assert_eq!(book.tally.started, 5);
}

#[test]
fn the_load_generators_call_book_through_fulcrum_completes_calls_in_flight_and_sees_a_481() {
    let lab = Lab::new("sip-tls-load-book");
    let ops = lab.start(&lab.yaml("", ""));
    let s = connect(
        addr(&ops, "v"),
        &client_config(&lab.ca, None),
        "fulcrum.test",
        ANSWER,
    )
    .expect("TLS client");
    let local = s.sock.local_addr().expect("local");
    let mut s = s;
    let mut book = CallBook::new(local, "TLS", ANSWER);
    let (mut buf, mut out) = (Vec::new(), Vec::new());
    // Every call in flight at once on one connection; one BYE carries a To tag the service
    // never gave (as a BYE reaching the wrong service would), so fulcrum delivers it to the
    // right service, which answers 481.
    for i in 0..CALLS {
        book.start(&format!("load-{i}"), Instant::now(), &mut out);
    }
    book.start("load-bad", Instant::now(), &mut out);
    s.write_all(&out).expect("write");
    out.clear();
    let end = Instant::now() + Duration::from_secs(10);
    while book.in_progress() > 0 && Instant::now() < end {
        match next_message(&mut s, &mut buf, Duration::from_millis(200)) {
            Next::Message(m) => book.on_message(&m, Instant::now(), &mut out),
            Next::Timeout => book.expire(Instant::now()),
            Next::Closed => book.close(),
        }
        if !out.is_empty() {
            let text = String::from_utf8_lossy(&out).into_owned();
            let text = if text.contains("Call-ID: load-bad\r\n") {
                text.replace(";tag=s", ";tag=x")
            } else {
                text
            };
            s.write_all(text.as_bytes()).expect("write");
            out.clear();
        }
    }
    let t = &book.tally;
    assert_eq!(t.completed, CALLS as u64, "{t:?}");
    assert_eq!((t.failed_481, t.failed()), (1, 1), "{t:?}");
    assert_eq!((t.late, t.stray), (0, 0), "{t:?}");
    assert_eq!(t.setup_us.len(), CALLS + 1);
    let counts: Vec<_> = lab.uas.iter().map(|u| u.counts()).collect();
    assert_eq!(counts.iter().map(|c| c.r481).sum::<u64>(), 1, "{counts:?}");
    assert_eq!(
        counts.iter().map(|c| c.byes_ok).sum::<u64>(),
        CALLS as u64,
        "{counts:?}"
    );
    ops.shutdown();
}
