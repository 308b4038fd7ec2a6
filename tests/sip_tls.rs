//! SIP over TLS (`sip-tls`, docs/tls.md) over loopback: whole calls from a TLS client through
//! fulcrum to strict SIP services over TLS (each answers 481 to a BYE for a dialog it did not
//! set up), with fulcrum's Via and Record-Route saying TLS; `sip-options` monitors over TLS;
//! plaintext and stalled clients dropped and counted while calls go on; mutual TLS; a
//! certificate reload. Certificates are made in the test (rcgen) into its own directory.

mod common;

use common::sip_uac::Uac;
use common::strict_uas::StrictUas;
use common::tls::{Ca, client_config, connect, server_config};
use common::*;
use fulcrum::config;
use fulcrum::ops::Ops;
use fulcrum::tls::{Reason, TlsListener};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const CALLS: usize = 20;

fn start(f: &ConfigFile) -> Arc<Ops> {
    let cfg = config::load(&f.path).unwrap_or_else(|e| panic!("config: {e}"));
    Ops::start(cfg, Some(f.path.clone())).expect("start")
}

fn addr(ops: &Ops, name: &str) -> SocketAddr {
    ops.with_vservers(|vs, _| vs.iter().find(|v| v.name == name).map(|v| v.bound[0]))
        .flatten()
        .expect("vserver")
}

fn listener(ops: &Ops, name: &str) -> Arc<TlsListener> {
    ops.with_vservers(|vs, _| {
        vs.iter()
            .find(|v| v.name == name)
            .and_then(|v| v.tls().cloned())
    })
    .flatten()
    .expect("a TLS vserver")
}

fn failed(l: &TlsListener, r: Reason) -> u64 {
    l.counters.failed(r).load(Ordering::Relaxed)
}

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

#[test]
fn calls_over_tls_reach_strict_services_over_tls_and_every_hop_says_tls() {
    let lab = Lab::new("sip-tls-calls");
    let ops = lab.start(&lab.yaml("", ""));
    let vs = addr(&ops, "v");
    let mut uac = lab.client(&ops, None).expect("TLS client");
    let before: u64 = lab.uas.iter().map(|u| u.counts().requests).sum();
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
    assert!(counts.iter().map(|c| c.requests).sum::<u64>() > before);
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
            .any(|c| c == "vservers.v.tls certificate re-read"),
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
