//! TLS on `tcp` and `http` vservers over loopback (docs/tls.md): termination to plain
//! services, re-encryption toward a TLS service that checks the SNI, mutual TLS, plaintext
//! and stalled clients dropped and counted beside a good one, certificate reload, and the
//! configured certificate as `curl` and `openssl s_client` see it. Certificates are made in
//! the test (rcgen) into its own temp directory.

mod common;

use common::tls::{
    Ca, Issued, addr, client_config, completed, failed, listener, metrics, server_config,
    service_handshakes, start,
};
use common::*;
use fulcrum::balancer::Path;
use fulcrum::tls::Reason;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConnection, ServerConnection, StreamOwned};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A TLS connection to `to` for `name` (handshake done).
fn tls_connect(
    to: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
    name: &str,
) -> std::io::Result<StreamOwned<ClientConnection, TcpStream>> {
    common::tls::connect(to, cfg, name, ANSWER)
}

/// Send `payload`, close our side (close_notify and FIN), read the answer to the end.
fn finish(
    mut s: StreamOwned<ClientConnection, TcpStream>,
    payload: &[u8],
) -> std::io::Result<Vec<u8>> {
    s.write_all(payload)?;
    s.conn.send_close_notify();
    s.flush()?;
    while s.conn.wants_write() {
        s.conn.write_tls(&mut s.sock)?;
    }
    s.sock.shutdown(Shutdown::Write)?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    Ok(out)
}

/// One exchange over TLS: the service's answer and the certificate fulcrum presented.
fn tls_ask(
    to: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
    name: &str,
    payload: &[u8],
) -> std::io::Result<(Answer, CertificateDer<'static>)> {
    let s = tls_connect(to, cfg, name)?;
    let presented = s
        .conn
        .peer_certificates()
        .and_then(|c| c.first().cloned())
        .ok_or_else(|| std::io::Error::other("no certificate"))?;
    let out = finish(s, payload)?;
    let a = parse_answer(&out).ok_or_else(|| {
        std::io::Error::other(format!("bad answer {:?}", String::from_utf8_lossy(&out)))
    })?;
    Ok((a, presented))
}

/// A TLS service: reads a request to close_notify, answers `NAME|SNI|payload`, closes.
fn tls_service(name: &str, cert: &Issued) -> SocketAddr {
    let cfg = server_config(cert);
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let name = name.to_owned();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(sock) = c else { continue };
            let (cfg, name) = (Arc::clone(&cfg), name.clone());
            std::thread::spawn(move || {
                let _ = sock.set_read_timeout(Some(Duration::from_secs(10)));
                let Ok(conn) = ServerConnection::new(cfg) else {
                    return;
                };
                let mut s = StreamOwned::new(conn, sock);
                let mut data = Vec::new();
                if s.read_to_end(&mut data).is_err() {
                    return;
                }
                let sni = s.conn.server_name().unwrap_or("-").to_owned();
                let mut out = format!("{name}|{sni}|").into_bytes();
                out.extend_from_slice(&data);
                let _ = s.write_all(&out);
                s.conn.send_close_notify();
                let _ = s.flush();
            });
        }
    });
    addr
}

/// An HTTP/1.1 service answering every request with its name (one request per connection).
fn http_service(name: &str) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let name = name.to_owned();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let name = name.clone();
            std::thread::spawn(move || {
                let _ = c.set_read_timeout(Some(Duration::from_secs(10)));
                let mut head = Vec::new();
                let mut b = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut b) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&b[..n]),
                    }
                }
                let _ = write!(
                    c,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{name}",
                    name.len()
                );
            });
        }
    });
    addr
}

/// A tcp vserver `v` terminating TLS with `www` (relative paths: read beside the config), over
/// plain tcp services.
fn tcp_yaml(services: &[(&str, SocketAddr)], tls_extra: &str, extra: &str) -> String {
    let mut y = String::from("admin: { listen: null }\nservices:\n");
    for (n, a) in services {
        y.push_str(&format!(
            "  - {{ name: {n}, address: \"{a}\", protocol: tcp }}\n"
        ));
    }
    let names: Vec<&str> = services.iter().map(|(n, _)| *n).collect();
    y.push_str(&format!(
        "vservers:\n  - name: v\n    protocol: tcp\n    bind: [\"127.0.0.1:0\"]\n    method: round_robin\n    tls: {{ cert: www.crt, key: www.key{tls_extra} }}\n{extra}    services: [{}]\n",
        names.join(", ")
    ));
    y
}

#[test]
fn tcp_termination_reaches_plain_services_and_presents_the_configured_certificate() {
    let f = ConfigFile::new("tls-tcp", "");
    let ca = Ca::new("fulcrum test CA");
    let www = ca.issue(&f, "www", "www.test", "www.test");
    let svc = services("tcp", 2, "127.0.0.1");
    f.write(&tcp_yaml(&refs(&svc), "", ""));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let cfg = client_config(&ca, None);
    let mut seen = std::collections::HashSet::new();
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    for i in 0..6 {
        let payload = if i == 0 {
            big.clone()
        } else {
            format!("hello {i}").into_bytes()
        };
        let (a, cert) = tls_ask(vs, &cfg, "www.test", &payload).expect("answer over TLS");
        assert_eq!(
            a.body, payload,
            "bytes decrypted, forwarded and re-encrypted intact"
        );
        assert_eq!(cert, www.der, "the configured certificate");
        seen.insert(a.service);
    }
    assert_eq!(seen.len(), 2, "round robin over both services: {seen:?}");
    let l = listener(&ops, "v");
    assert_eq!(completed(&l), 6);
    assert!(Reason::ALL.iter().all(|r| failed(&l, *r) == 0));
    let r = fulcrum::admin::router::handle(
        &ops,
        &fulcrum::admin::router::Request::new("GET", "/metrics"),
    );
    let metrics = r.body;
    assert!(
        metrics.contains("fulcrum_tls_handshakes_total{vserver=\"v\"} 6"),
        "{metrics}"
    );
    ops.shutdown();
}

#[test]
fn http_termination_hashes_the_decrypted_head_with_curl() {
    if Command::new("curl").arg("--version").output().is_err() {
        println!("skipped: no curl binary");
        return;
    }
    let f = ConfigFile::new("tls-http", "");
    let ca = Ca::new("fulcrum test CA");
    ca.issue(&f, "www", "www.test", "www.test");
    let ca_path = ca.write(&f, "ca.pem");
    let (a, b) = (http_service("web-a"), http_service("web-b"));
    f.write(&format!(
        "admin: {{ listen: null }}\nservices:\n  - {{ name: web-a, address: \"{a}\", protocol: http }}\n  - {{ name: web-b, address: \"{b}\", protocol: http }}\nvservers:\n  - name: www\n    protocol: http\n    bind: [\"127.0.0.1:0\"]\n    method: token\n    token: {{ header: X-Tenant }}\n    tls: {{ cert: www.crt, key: www.key }}\n    services: [web-a, web-b]\n"
    ));
    let ops = start(&f);
    let port = addr(&ops, "www").port();
    let curl = |tenant: &str| -> String {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "5", "--cacert"])
            .arg(&ca_path)
            .args(["--resolve", &format!("www.test:{port}:127.0.0.1")])
            .args(["-H", &format!("X-Tenant: {tenant}")])
            .arg(format!("https://www.test:{port}/path"))
            .output()
            .expect("run curl");
        assert!(
            out.status.success(),
            "curl: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mut per_tenant = std::collections::HashMap::new();
    for round in 0..3 {
        for t in ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"] {
            let got = curl(t);
            assert!(got == "web-a" || got == "web-b", "{got}");
            let first = per_tenant.entry(t).or_insert_with(|| got.clone());
            assert_eq!(*first, got, "tenant {t} moved in round {round}");
        }
    }
    let core = ops
        .with_vservers(|vs, _| {
            let p = vs[0].path::<fulcrum::proxy::TcpPath>()?;
            Some(Arc::clone(p.core()))
        })
        .flatten()
        .expect("tcp core");
    assert_eq!(
        core.balancer().path_count(Path::Hash),
        18,
        "every request chosen by its decrypted header"
    );
    assert_eq!(core.counters.heads_unparseable.load(Ordering::Relaxed), 0);
    ops.shutdown();
}

/// A TLS client that half-closes its TCP side without close_notify (many do) still gets the
/// answer: the missing alert is read as the end of its stream, passed on to the service as a
/// FIN, and the service's answer comes back.
#[test]
fn a_half_close_without_close_notify_still_gets_the_answer() {
    let f = ConfigFile::new("tls-half-close", "");
    let ca = Ca::new("fulcrum test CA");
    ca.issue(&f, "www", "www.test", "www.test");
    let svc = services("tcp", 1, "127.0.0.1");
    f.write(&tcp_yaml(&refs(&svc), "", ""));
    let ops = start(&f);
    let mut s = tls_connect(addr(&ops, "v"), &client_config(&ca, None), "www.test").expect("TLS");
    s.write_all(b"no alert").expect("write");
    s.flush().expect("flush");
    s.sock.shutdown(Shutdown::Write).expect("half-close");
    let mut out = Vec::new();
    // The answer, then the end of the stream (fulcrum's close_notify, or a bare EOF).
    let _ = s.read_to_end(&mut out);
    let a =
        parse_answer(&out).unwrap_or_else(|| panic!("answer: {:?}", String::from_utf8_lossy(&out)));
    assert_eq!(a.body, b"no alert");
    ops.shutdown();
}

#[test]
fn re_encryption_sends_the_configured_server_name() {
    let f = ConfigFile::new("tls-reencrypt", "");
    let ca = Ca::new("fulcrum test CA");
    ca.issue(&f, "www", "www.test", "www.test");
    ca.write(&f, "ca.pem");
    let backend = ca.issue(&f, "backend", "backend.internal", "backend.internal");
    let svc = tls_service("tls-svc", &backend);
    f.write(&format!(
        "admin: {{ listen: null }}\nservices:\n  - {{ name: t, address: \"{svc}\", protocol: tcp, tls: {{ ca: ca.pem, server_name: backend.internal }} }}\nvservers:\n  - name: v\n    protocol: tcp\n    bind: [\"127.0.0.1:0\"]\n    tls: {{ cert: www.crt, key: www.key }}\n    services: [t]\n  - name: plain\n    protocol: tcp\n    bind: [\"127.0.0.1:0\"]\n    services: [t]\n"
    ));
    let ops = start(&f);
    let cfg = client_config(&ca, None);
    let (a, _) = tls_ask(addr(&ops, "v"), &cfg, "www.test", b"secret").expect("answer");
    assert_eq!(
        (a.service.as_str(), a.proxy_src.as_str(), a.body.as_slice()),
        ("tls-svc", "backend.internal", &b"secret"[..]),
        "TLS both ways, SNI = server_name"
    );
    // A plain vserver adds TLS toward the same service.
    let a = tcp_ask(addr(&ops, "plain"), b"clear").expect("answer");
    assert_eq!(
        (a.service.as_str(), a.proxy_src.as_str()),
        ("tls-svc", "backend.internal")
    );
    assert_eq!(a.body, b"clear");
    ops.shutdown();
}

#[test]
fn a_service_whose_certificate_does_not_verify_is_passed_over() {
    let f = ConfigFile::new("tls-badsvc", "");
    let (bad, good) = bad_and_good_services(&f);
    f.write(&format!(
        "admin: {{ listen: null }}\nservices:\n  - {{ name: bad, address: \"{bad}\", protocol: tcp, tls: {{ ca: ca.pem, server_name: backend.internal }} }}\n  - {{ name: good, address: \"{good}\", protocol: tcp, tls: {{ ca: ca.pem, server_name: backend.internal }} }}\nvservers:\n  - {{ name: v, protocol: tcp, bind: [\"127.0.0.1:0\"], method: round_robin, services: [bad, good] }}\n"
    ));
    let ops = start(&f);
    for _ in 0..4 {
        let a = tcp_ask(addr(&ops, "v"), b"x").expect("served by the good one");
        assert_eq!(a.service, "good");
    }
    let core = tcp_core(&ops, "v");
    assert!(core.counters.connect_failures.load(Ordering::Relaxed) >= 2);
    ops.shutdown();
}

/// Two TLS services for `backend.internal`: `bad`, whose certificate another CA signed, and
/// `good`, signed by the CA written to `f`'s directory as `ca.pem`. Their addresses.
fn bad_and_good_services(f: &ConfigFile) -> (SocketAddr, SocketAddr) {
    let ca = Ca::new("fulcrum test CA");
    let other = Ca::new("another CA");
    ca.write(f, "ca.pem");
    let wrong = other.issue(f, "wrong", "backend.internal", "backend.internal");
    let right = ca.issue(f, "right", "backend.internal", "backend.internal");
    (tls_service("bad", &wrong), tls_service("good", &right))
}

/// The tcp core of vserver `name`.
fn tcp_core(ops: &fulcrum::ops::Ops, name: &str) -> Arc<fulcrum::proxy::TcpCore> {
    ops.with_vservers(|vs, _| {
        let v = vs.iter().find(|v| v.name == name)?;
        Some(Arc::clone(v.path::<fulcrum::proxy::TcpPath>()?.core()))
    })
    .flatten()
    .expect("tcp core")
}

/// The `tls` of service `service` of vserver `vserver` in `/status`.
fn status_tls(ops: &fulcrum::ops::Ops, vserver: &str, service: &str) -> serde_json::Value {
    let status = fulcrum::admin::router::status(ops);
    let vservers = status["vservers"].as_array().expect("vservers");
    let v = vservers
        .iter()
        .find(|v| v["name"] == vserver)
        .expect("vserver");
    let services = v["services"].as_array().expect("services");
    let s = services
        .iter()
        .find(|s| s["name"] == service)
        .expect("service");
    s["tls"].clone()
}

/// Handshakes toward services, per service, in `/metrics` and `/status`: completed toward the
/// good one, failed as `unknown_ca` toward the one whose certificate another CA signed, none
/// for a plain one. A reload that rebuilds the vserver and keeps them keeps their counts; a
/// service removed and added again counts from zero.
#[test]
fn handshakes_toward_services_are_counted_per_service_and_survive_a_reload() {
    let f = ConfigFile::new("tls-svc-metrics", "");
    let (bad, good) = bad_and_good_services(&f);
    let plain = services("tcp", 1, "127.0.0.1");
    let p0 = plain[0].1;
    // `eject: off`: every connection keeps trying `bad`, whose failures are counted here
    // (passive ejection would stop trying it after three, docs/ejection.md).
    let yaml = |members: &str, good_weight: u32| {
        format!(
            "admin: {{ listen: null }}\nservices:\n  - {{ name: bad, address: \"{bad}\", protocol: tcp, tls: {{ ca: ca.pem, server_name: backend.internal }} }}\n  - {{ name: good, address: \"{good}\", protocol: tcp, weight: {good_weight}, tls: {{ ca: ca.pem, server_name: backend.internal }} }}\n  - {{ name: s0, address: \"{p0}\", protocol: tcp }}\nvservers:\n  - {{ name: v, protocol: tcp, bind: [\"127.0.0.1:0\"], method: round_robin, eject: off, services: [{members}] }}\n"
        )
    };
    f.write(&yaml("bad, good, s0", 1));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    // Sends `n` requests; how many the good service answered.
    let ask = |n: usize| -> u64 {
        let mut by_good = 0;
        for _ in 0..n {
            let a = tcp_ask(vs, b"x").expect("served by good or s0");
            assert!(a.service == "good" || a.service == "s0", "{}", a.service);
            by_good += u64::from(a.service == "good");
        }
        by_good
    };
    let good_answers = ask(6);
    let failures = tcp_core(&ops, "v")
        .counters
        .connect_failures
        .load(Ordering::Relaxed);
    assert!(
        good_answers >= 1 && failures >= 1,
        "{good_answers} {failures}"
    );
    let m = metrics(&ops);
    let g = service_handshakes(&m, "v", "good").expect("good's series");
    let b = service_handshakes(&m, "v", "bad").expect("bad's series");
    assert!(g.lists_every_reason() && b.lists_every_reason(), "{m}");
    assert_eq!(g.completed, Some(good_answers), "{m}");
    assert_eq!(g.failed_total(), 0, "{m}");
    assert_eq!(b.completed, Some(0), "{m}");
    // Every connect failure was bad's handshake (its TCP connect succeeds).
    assert_eq!(b.failed(Reason::UnknownCa), failures, "{m}");
    assert_eq!(b.failed_otherwise(Reason::UnknownCa), 0, "{m}");
    assert_eq!(
        service_handshakes(&m, "v", "s0"),
        None,
        "no TLS toward s0: {m}"
    );
    let t = status_tls(&ops, "v", "bad");
    assert_eq!(t["handshakes"], 0, "{t}");
    assert_eq!(t["handshake_failures"]["unknown_ca"], failures, "{t}");
    assert_eq!(
        t["handshake_failures"].as_object().map(|o| o.len()),
        Some(8),
        "{t}"
    );
    assert_eq!(status_tls(&ops, "v", "good")["handshakes"], good_answers);
    assert_eq!(status_tls(&ops, "v", "s0"), serde_json::Value::Null);

    // A new weight rebuilds the vserver (a new core, new connectors): the counts stay.
    let before = tcp_core(&ops, "v");
    f.write(&yaml("bad, good, s0", 2));
    ops.reload().expect("reload");
    let after = tcp_core(&ops, "v");
    assert!(!Arc::ptr_eq(&before, &after), "the vserver was rebuilt");
    let m = metrics(&ops);
    assert_eq!(service_handshakes(&m, "v", "good"), Some(g.clone()), "{m}");
    assert_eq!(service_handshakes(&m, "v", "bad"), Some(b.clone()), "{m}");
    // And count on from there.
    let more = ask(8);
    let failed_since = after.counters.connect_failures.load(Ordering::Relaxed);
    assert!(more >= 1 && failed_since >= 1, "{more} {failed_since}");
    let m = metrics(&ops);
    let g2 = service_handshakes(&m, "v", "good").expect("good");
    let b2 = service_handshakes(&m, "v", "bad").expect("bad");
    assert_eq!(g2.completed, Some(good_answers + more), "{m}");
    assert_eq!(b2.failed(Reason::UnknownCa), failures + failed_since, "{m}");

    // Removed (no flow on it: gone at once), its series go; added back, it counts from zero.
    f.write(&yaml("good, s0", 2));
    ops.reload().expect("reload");
    let m = metrics(&ops);
    assert_eq!(service_handshakes(&m, "v", "bad"), None, "{m}");
    f.write(&yaml("bad, good, s0", 2));
    ops.reload().expect("reload");
    let m = metrics(&ops);
    let b3 = service_handshakes(&m, "v", "bad").expect("bad again");
    assert_eq!(b3.completed, Some(0), "{m}");
    assert_eq!(b3.failed_total(), 0, "{m}");
    assert_eq!(
        service_handshakes(&m, "v", "good").and_then(|h| h.completed),
        g2.completed,
        "good stayed throughout: {m}"
    );
    ops.shutdown();
}

#[test]
fn mutual_tls_admits_a_client_certificate_and_refuses_none_or_a_stranger() {
    let f = ConfigFile::new("tls-mtls", "");
    let ca = Ca::new("fulcrum test CA");
    ca.issue(&f, "www", "www.test", "www.test");
    ca.write(&f, "clients.pem");
    let client = ca.issue(&f, "client", "client.test", "client.test");
    let stranger_ca = Ca::new("stranger CA");
    let stranger = stranger_ca.issue(&f, "stranger", "stranger.test", "stranger.test");
    let svc = services("tcp", 1, "127.0.0.1");
    f.write(&tcp_yaml(&refs(&svc), ", client_ca: clients.pem", ""));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let l = listener(&ops, "v");
    let (a, _) =
        tls_ask(vs, &client_config(&ca, Some(&client)), "www.test", b"me").expect("admitted");
    assert_eq!(a.body, b"me");
    // TLS 1.3: the client's side of the handshake ends before the server has checked its
    // certificate, so the refusal shows as no answer.
    assert!(tls_ask(vs, &client_config(&ca, None), "www.test", b"anon").is_err());
    assert!(wait_until(ANSWER, || failed(&l, Reason::NoCertificate) == 1));
    // A certificate from a CA the vserver does not trust.
    let cfg = client_config(&ca, Some(&stranger));
    assert!(tls_ask(vs, &cfg, "www.test", b"who").is_err());
    assert!(wait_until(ANSWER, || failed(&l, Reason::UnknownCa) == 1));
    assert_eq!(completed(&l), 1);
    ops.shutdown();
}

#[test]
fn plaintext_and_stalled_clients_are_dropped_and_counted_while_a_good_client_is_served() {
    let f = ConfigFile::new("tls-stall", "");
    let ca = Ca::new("fulcrum test CA");
    ca.issue(&f, "www", "www.test", "www.test");
    let svc = services("tcp", 1, "127.0.0.1");
    // One worker thread: stalled handshakes must not hold it.
    f.write(&tcp_yaml(
        &refs(&svc),
        "",
        "    workers: 1\n    tls_handshake_timeout: 1s\n",
    ));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let l = listener(&ops, "v");
    // A plaintext HTTP client on the TLS port: refused at its first bytes.
    let mut plain = TcpStream::connect_timeout(&vs, ANSWER).expect("connect");
    plain.set_read_timeout(Some(ANSWER)).expect("timeout");
    plain
        .write_all(b"GET / HTTP/1.1\r\nHost: www.test\r\n\r\n")
        .expect("write");
    let mut buf = [0u8; 256];
    // Whatever comes back (an alert at most), the connection ends.
    let mut ended = false;
    for _ in 0..4 {
        match plain.read(&mut buf) {
            Ok(0) | Err(_) => {
                ended = true;
                break;
            }
            Ok(_) => {}
        }
    }
    assert!(ended, "a plaintext client is disconnected");
    assert!(wait_until(ANSWER, || failed(&l, Reason::NotTls) == 1));
    // Twenty clients that connect and never send a ClientHello.
    let stalled: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect_timeout(&vs, ANSWER).expect("connect"))
        .collect();
    let started = Instant::now();
    let cfg = client_config(&ca, None);
    let (a, _) = tls_ask(vs, &cfg, "www.test", b"served").expect("the good client is served");
    assert_eq!(a.body, b"served");
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "served before the stalled handshakes time out: {:?}",
        started.elapsed()
    );
    assert_eq!(failed(&l, Reason::Timeout), 0);
    assert!(wait_until(Duration::from_secs(5), || failed(
        &l,
        Reason::Timeout
    ) == 20));
    for mut s in stalled {
        s.set_read_timeout(Some(ANSWER)).expect("timeout");
        assert!(
            matches!(s.read(&mut buf), Ok(0) | Err(_)),
            "closed by fulcrum"
        );
    }
    assert_eq!(completed(&l), 1);
    ops.shutdown();
}

#[test]
fn openssl_s_client_sees_the_configured_certificate() {
    let required = std::env::var_os("FULCRUM_REQUIRE_OPENSSL").is_some_and(|v| v == "1");
    if Command::new("openssl").arg("version").output().is_err() {
        assert!(!required, "FULCRUM_REQUIRE_OPENSSL=1 but no openssl binary");
        println!("skipped: no openssl binary");
        return;
    }
    let f = ConfigFile::new("tls-openssl", "");
    let ca = Ca::new("fulcrum test CA");
    ca.issue(&f, "www", "www.test", "fulcrum-www-subject");
    let ca_path = ca.write(&f, "ca.pem");
    let svc = services("tcp", 1, "127.0.0.1");
    f.write(&tcp_yaml(&refs(&svc), "", ""));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let out = Command::new("openssl")
        .args([
            "s_client",
            "-connect",
            &vs.to_string(),
            "-servername",
            "www.test",
        ])
        .arg("-CAfile")
        .arg(&ca_path)
        .args(["-verify_return_error", "-brief"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run openssl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("fulcrum-www-subject"), "{text}");
    assert!(text.contains("Verification: OK"), "{text}");
    ops.shutdown();
}

/// A TLS 1.2 client that asks for a renegotiation gets its answer at once, the
/// `no_renegotiation` alert (RFC 5246 section 7.2.2), though fulcrum has nothing to write to
/// it; the refusal is counted.
#[test]
fn a_renegotiation_request_is_answered_and_counted() {
    let required = std::env::var_os("FULCRUM_REQUIRE_OPENSSL").is_some_and(|v| v == "1");
    let f = ConfigFile::new("tls-reneg", "");
    let ca = Ca::new("fulcrum test CA");
    ca.issue(&f, "www", "www.test", "www.test");
    let ca_path = ca.write(&f, "ca.pem");
    let svc = services("tcp", 1, "127.0.0.1");
    f.write(&tcp_yaml(&refs(&svc), "", ""));
    let ops = start(&f);
    let wait = Duration::from_secs(5);
    let Some((ended, out)) =
        common::tls::openssl_renegotiate(addr(&ops, "v"), &ca_path, "www.test", wait)
    else {
        assert!(!required, "FULCRUM_REQUIRE_OPENSSL=1 but no openssl binary");
        println!("skipped: no openssl binary");
        return;
    };
    assert!(ended, "s_client still waits for an answer: {out}");
    assert!(out.contains("RENEGOTIATING"), "{out}");
    assert!(out.contains("no renegotiation"), "the alert: {out}");
    let l = listener(&ops, "v");
    assert_eq!(l.counters.renegotiations_refused.load(Ordering::Relaxed), 1);
    assert!(
        metrics(&ops).contains("fulcrum_tls_renegotiations_refused_total{vserver=\"v\"} 1"),
        "{}",
        metrics(&ops)
    );
    ops.shutdown();
}

#[test]
fn reload_swaps_the_certificate_for_new_handshakes_and_keeps_established_ones() {
    let f = ConfigFile::new("tls-reload", "");
    let ca = Ca::new("fulcrum test CA");
    let first = ca.issue(&f, "www", "www.test", "first");
    let svc = services("tcp", 1, "127.0.0.1");
    let yaml = tcp_yaml(&refs(&svc), "", "");
    f.write(&yaml);
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let cfg = client_config(&ca, None);
    let established = tls_connect(vs, &cfg, "www.test").expect("connected");
    assert_eq!(
        established.conn.peer_certificates().and_then(|c| c.first()),
        Some(&first.der)
    );
    // New files under the same names, then a reload: the config text is unchanged.
    let second = ca.issue(&f, "www", "www.test", "second");
    let changes = ops.reload().expect("reload");
    assert!(
        changes
            .iter()
            .any(|c| c == "vservers.v.tls certificate changed"),
        "{changes:?}"
    );
    let (_, cert) = tls_ask(vs, &cfg, "www.test", b"new").expect("answer");
    assert_eq!(cert, second.der, "a new handshake sees the new certificate");
    let out = finish(established, b"still here").expect("the established connection works");
    assert_eq!(parse_answer(&out).expect("answer").body, b"still here");
    // A missing certificate fails the reload at its line and column and changes nothing.
    f.write(&yaml.replace("cert: www.crt", "cert: gone.crt"));
    let e = ops.reload().expect_err("refused").to_string();
    assert!(
        e.contains("f.yaml:9:18: vservers[0].tls.cert: cannot read") && e.contains("gone.crt"),
        "{e}"
    );
    let (_, cert) = tls_ask(vs, &cfg, "www.test", b"after").expect("answer");
    assert_eq!(
        cert, second.der,
        "still the certificate of the last good reload"
    );
    ops.shutdown();
}

/// A session survives a reload that changes nothing about the listener's TLS: the client
/// resumes it (RFC 8446 section 2.2) with the ticket of the connection before the reload.
/// A certificate renewed in place under the same file names is a new server configuration:
/// the next handshake is a full one and presents the new certificate.
#[test]
fn sessions_resume_across_a_reload_that_changes_nothing_and_not_across_a_new_certificate() {
    use rustls::HandshakeKind;
    let f = ConfigFile::new("tls-resume", "");
    let ca = Ca::new("fulcrum test CA");
    let first = ca.issue(&f, "www", "www.test", "first");
    let svc = services("tcp", 1, "127.0.0.1");
    f.write(&tcp_yaml(&refs(&svc), "", ""));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    // One client configuration throughout: its session store keeps the tickets.
    let cfg = client_config(&ca, None);
    // A whole exchange (the tickets arrive after the handshake and are read with the answer):
    // how the handshake went and the certificate the session carries.
    let visit = |payload: &[u8]| {
        let s = tls_connect(vs, &cfg, "www.test").expect("connected");
        let kind = s.conn.handshake_kind();
        let cert = s.conn.peer_certificates().and_then(|c| c.first().cloned());
        let out = finish(s, payload).expect("answer");
        assert_eq!(parse_answer(&out).expect("answer").body, payload);
        (kind, cert)
    };
    assert_eq!(
        visit(b"one"),
        (Some(HandshakeKind::Full), Some(first.der.clone()))
    );
    assert_eq!(
        visit(b"two").0,
        Some(HandshakeKind::Resumed),
        "resumed before any reload"
    );
    let changes = ops.reload().expect("reload");
    assert_eq!(
        visit(b"three").0,
        Some(HandshakeKind::Resumed),
        "resumed across a reload that changed nothing"
    );
    assert!(changes.iter().all(|c| !c.contains("tls")), "{changes:?}");
    // The same file names, a new certificate in them.
    let second = ca.issue(&f, "www", "www.test", "second");
    let changes = ops.reload().expect("reload");
    assert_eq!(
        visit(b"four"),
        (Some(HandshakeKind::Full), Some(second.der.clone())),
        "a full handshake with the renewed certificate"
    );
    assert!(
        changes
            .iter()
            .any(|c| c == "vservers.v.tls certificate changed"),
        "{changes:?}"
    );
    assert_eq!(visit(b"five").0, Some(HandshakeKind::Resumed));
    ops.shutdown();
}

#[test]
fn check_reports_a_key_that_does_not_match_its_certificate() {
    let f = ConfigFile::new("tls-check", "");
    let ca = Ca::new("fulcrum test CA");
    let www = ca.issue(&f, "www", "www.test", "www.test");
    let other = ca.issue(&f, "other", "other.test", "other.test");
    let svc = services("tcp", 1, "127.0.0.1");
    f.write(&tcp_yaml(&refs(&svc), "", "").replace("key: www.key", "key: other.key"));
    let out = Command::new(env!("CARGO_BIN_EXE_fulcrum"))
        .arg("check")
        .arg(&f.path)
        .output()
        .expect("run fulcrum check");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!(
            "{}:9:32: vservers[0].tls.key: the key in {} does not match the certificate in {}",
            f.path.display(),
            other.key_path.display(),
            www.cert_path.display()
        )),
        "{err}"
    );
}
