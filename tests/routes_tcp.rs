//! Routing rules on `tcp` and `http` vservers over loopback (docs/routing.md): TLS routed by
//! its server name without terminating it (`openssl s_client` as the client, each backend's
//! own certificate seen end to end, the ClientHello forwarded byte for byte even when it
//! arrives in pieces, a hello that never completes routed as nameless after
//! `client_hello_timeout`); TLS terminated and routed by server name and negotiated ALPN;
//! HTTP requests routed by path, host, method and header, and refused with an HTTP answer.
//! Certificates are made in the test (rcgen) into its own temp directory.

mod common;

use common::tls::{Ca, Issued, addr, metrics, server_config, start};
use common::*;
use rustls::pki_types::ServerName;
use rustls::{ClientConnection, ServerConnection, StreamOwned};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Whether `openssl` runs here; `FULCRUM_REQUIRE_OPENSSL=1` (CI) makes its absence a failure.
fn openssl_available() -> bool {
    let required = std::env::var_os("FULCRUM_REQUIRE_OPENSSL").is_some_and(|v| v == "1");
    let ok = Command::new("openssl").arg("version").output().is_ok();
    assert!(
        ok || !required,
        "FULCRUM_REQUIRE_OPENSSL=1 but no openssl binary"
    );
    if !ok {
        println!("skipped: no openssl binary");
    }
    ok
}

/// A TLS service presenting `cert` (offering h2 and http/1.1): after its handshake it writes
/// `from NAME` and closes. Counts its connections.
fn tls_backend(name: &str, cert: &Issued) -> (SocketAddr, Arc<AtomicU64>) {
    let mut cfg = (*server_config(cert)).clone();
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let cfg = Arc::new(cfg);
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let at = l.local_addr().expect("addr");
    let hits = Arc::new(AtomicU64::new(0));
    let (name, h) = (name.to_owned(), Arc::clone(&hits));
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(sock) = conn else { continue };
            h.fetch_add(1, Ordering::Relaxed);
            let (cfg, name) = (Arc::clone(&cfg), name.clone());
            std::thread::spawn(move || {
                let _ = sock.set_read_timeout(Some(Duration::from_secs(5)));
                let Ok(conn) = ServerConnection::new(cfg) else {
                    return;
                };
                let mut s = StreamOwned::new(conn, sock);
                while s.conn.is_handshaking() {
                    if s.conn.complete_io(&mut s.sock).is_err() {
                        return;
                    }
                }
                let _ = s.write_all(format!("from {name}\n").as_bytes());
                s.conn.send_close_notify();
                let _ = s.flush();
            });
        }
    });
    (at, hits)
}

/// A plain TCP service that writes `from NAME` at once, keeps what it reads (up to its
/// `keep` bytes or the client's close) and closes.
struct Recorder {
    addr: SocketAddr,
    got: Arc<Mutex<Vec<Vec<u8>>>>,
}

fn recorder(name: &str, keep: usize) -> Recorder {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let got = Arc::new(Mutex::new(Vec::new()));
    let (name, g) = (name.to_owned(), Arc::clone(&got));
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            let (name, g) = (name.clone(), Arc::clone(&g));
            std::thread::spawn(move || {
                let _ = c.write_all(format!("from {name}\n").as_bytes());
                let _ = c.set_read_timeout(Some(Duration::from_secs(3)));
                let mut data = Vec::new();
                let mut buf = [0u8; 4096];
                while data.len() < keep {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => data.extend_from_slice(&buf[..n]),
                    }
                }
                g.lock().expect("lock").push(data);
            });
        }
    });
    Recorder { addr, got }
}

impl Recorder {
    fn received(&self) -> Vec<Vec<u8>> {
        self.got.lock().expect("lock").clone()
    }
}

/// What `openssl s_client` printed for a connection to `to` asking for `name` (and offering
/// `alpn` when given), verifying against the CA file `ca`: it waits for the service to close.
fn s_client(to: SocketAddr, name: &str, alpn: Option<&str>, ca: &std::path::Path) -> String {
    let mut cmd = Command::new("timeout");
    cmd.args(["10", "openssl", "s_client", "-connect", &to.to_string()])
        .args(["-servername", name, "-ign_eof", "-verify_return_error"])
        .arg("-CAfile")
        .arg(ca);
    if let Some(p) = alpn {
        cmd.args(["-alpn", p]);
    }
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run openssl");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The value of `fulcrum_route_requests_total` for vserver `v`, route `route`, `result`.
fn route_count(text: &str, v: &str, route: &str, result: &str) -> u64 {
    let series = format!(
        "fulcrum_route_requests_total{{vserver=\"{v}\",route=\"{route}\",result=\"{result}\"}} "
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// A config of services `services` (each `(name, address)`, speaking `protocol`) and one
/// vserver `v` of `protocol` on an ephemeral loopback port, with the fields `body` (YAML lines
/// indented by four spaces).
fn yaml(protocol: &str, services: &[(&str, SocketAddr)], body: &str) -> String {
    let mut y = String::from("admin: { listen: null }\nservices:\n");
    for (name, at) in services {
        y.push_str(&format!(
            "  - {{ name: {name}, address: \"{at}\", protocol: {protocol} }}\n"
        ));
    }
    y.push_str(&format!(
        "vservers:\n  - name: v\n    protocol: {protocol}\n    bind: [\"127.0.0.1:0\"]\n{body}"
    ));
    y
}

/// The ClientHello a rustls client sends for `name` (its first flight).
fn client_hello_for(name: &str) -> Vec<u8> {
    let ca = Ca::new("unused");
    let cfg = common::tls::client_config(&ca, None);
    let server = ServerName::try_from(name.to_owned()).expect("name");
    let mut c = ClientConnection::new(cfg, server).expect("client");
    let mut out = Vec::new();
    while c.wants_write() {
        c.write_tls(&mut out).expect("hello");
    }
    out
}

/// TLS passthrough: two TLS services chosen by the ClientHello's server name, each one's own
/// certificate verified by `openssl s_client` through fulcrum; a name no rule knows is
/// dropped (the default) and reaches no service; each outcome is counted per rule.
#[test]
fn tls_is_routed_by_its_server_name_without_being_terminated() {
    if !openssl_available() {
        return;
    }
    let f = ConfigFile::new("routes-sni", "");
    let ca = Ca::new("fulcrum test CA");
    let cert_a = ca.issue(&f, "a", "a.test", "cert-A");
    let cert_b = ca.issue_for(&f, "b", &["b.test", "*.b.test"], "cert-B");
    let ca_path = ca.write(&f, "ca.pem");
    let (a, hits_a) = tls_backend("A", &cert_a);
    let (b, hits_b) = tls_backend("B", &cert_b);
    f.write(&yaml(
        "tcp",
        &[("ta", a), ("tb", b)],
        r#"    routes:
      - { name: a, match: { sni: a.test }, services: [ta] }
      - { name: b, match: { sni: [b.test, "*.b.test"] }, services: [tb] }
    default: { drop: true }
    services: []
"#,
    ));
    let ops = start(&f);
    let vs = addr(&ops, "v");

    let out = s_client(vs, "a.test", None, &ca_path);
    assert!(out.contains("cert-A") && out.contains("from A"), "{out}");
    assert!(out.contains("Verify return code: 0 (ok)"), "{out}");
    let out = s_client(vs, "x.B.test", None, &ca_path);
    assert!(out.contains("cert-B") && out.contains("from B"), "{out}");
    assert!(out.contains("Verify return code: 0 (ok)"), "{out}");
    let out = s_client(vs, "c.test", None, &ca_path);
    assert!(
        !out.contains("from "),
        "an unknown name reached a service: {out}"
    );
    assert_eq!(
        (
            hits_a.load(Ordering::Relaxed),
            hits_b.load(Ordering::Relaxed)
        ),
        (1, 1)
    );
    let m = metrics(&ops);
    assert_eq!(route_count(&m, "v", "a", "matched"), 1, "{m}");
    assert_eq!(route_count(&m, "v", "b", "matched"), 1);
    assert_eq!(route_count(&m, "v", "default", "dropped"), 1);
    ops.shutdown();
}

/// A ClientHello that arrives in three segments is routed by its name and reaches the
/// service byte for byte; one that stops halfway is routed as nameless (the default pool)
/// once `client_hello_timeout` has passed, with what it sent; bytes that are not TLS at all
/// go to the default pool too.
#[test]
fn a_hello_in_pieces_or_never_finished_and_bytes_that_are_not_tls() {
    let f = ConfigFile::new("routes-hello", "");
    let named = recorder("named", 64 * 1024);
    let other = recorder("other", 64 * 1024);
    f.write(&yaml(
        "tcp",
        &[("named", named.addr), ("other", other.addr)],
        r#"    client_hello_timeout: 1500ms
    routes:
      - { name: named, match: { sni: b.test }, services: [named] }
    services: [other]
"#,
    ));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let hello = client_hello_for("b.test");
    assert!(hello.len() > 100, "a ClientHello: {} bytes", hello.len());

    // In three pieces, 150 ms apart (within the 1.5 s bound).
    let mut c = TcpStream::connect(vs).expect("connect");
    c.set_nodelay(true).expect("nodelay");
    let cuts = [0, 3, hello.len() / 2, hello.len()];
    for w in cuts.windows(2) {
        c.write_all(&hello[w[0]..w[1]]).expect("send");
        std::thread::sleep(Duration::from_millis(90));
    }
    c.shutdown(std::net::Shutdown::Write).expect("half-close");
    let mut answer = String::new();
    c.set_read_timeout(Some(ANSWER)).expect("timeout");
    let _ = c.read_to_string(&mut answer);
    assert_eq!(answer, "from named\n");

    // Half a hello, then nothing: the default pool, after the bound, with the half.
    let mut c = TcpStream::connect(vs).expect("connect");
    c.write_all(&hello[..hello.len() / 2]).expect("send");
    c.set_read_timeout(Some(ANSWER)).expect("timeout");
    let mut first = [0u8; 11];
    c.read_exact(&mut first).expect("an answer after the bound");
    assert_eq!(&first, b"from other\n");
    drop(c);

    // Not TLS: the default pool at once.
    let mut c = TcpStream::connect(vs).expect("connect");
    c.write_all(b"GET / HTTP/1.0\r\n\r\n").expect("send");
    c.shutdown(std::net::Shutdown::Write).expect("half-close");
    let mut answer = String::new();
    c.set_read_timeout(Some(ANSWER)).expect("timeout");
    let _ = c.read_to_string(&mut answer);
    assert_eq!(answer, "from other\n");

    assert!(wait_until(ANSWER, || named.received().len() == 1
        && other.received().len() == 2));
    assert_eq!(
        named.received(),
        vec![hello.clone()],
        "the hello, untouched"
    );
    let mut got = other.received();
    got.sort();
    let mut want = vec![
        hello[..hello.len() / 2].to_vec(),
        b"GET / HTTP/1.0\r\n\r\n".to_vec(),
    ];
    want.sort();
    assert_eq!(got, want);
    ops.shutdown();
}

/// TLS terminated by fulcrum (one certificate for both names) and routed by the server name
/// and the protocol negotiated with the client: fulcrum offers the rules' ALPN names, so
/// `openssl s_client -alpn h2` gets h2 and the h2 pool, `-alpn http/1.1` the other.
#[test]
fn terminated_tls_is_routed_by_server_name_and_negotiated_protocol() {
    if !openssl_available() {
        return;
    }
    let f = ConfigFile::new("routes-alpn", "");
    let ca = Ca::new("fulcrum test CA");
    ca.issue_for(&f, "www", &["a.test", "b.test"], "fulcrum-front");
    let ca_path = ca.write(&f, "ca.pem");
    let (h2a, h1a, pb, dflt) = (
        recorder("h2a", 0),
        recorder("h1a", 0),
        recorder("pb", 0),
        recorder("dflt", 0),
    );
    f.write(&yaml(
        "tcp",
        &[
            ("h2a", h2a.addr),
            ("h1a", h1a.addr),
            ("pb", pb.addr),
            ("dflt", dflt.addr),
        ],
        r#"    tls: { cert: www.crt, key: www.key }
    routes:
      - { name: a-h2, match: { sni: a.test, alpn: h2 }, services: [h2a] }
      - { name: a-h1, match: { sni: a.test, alpn: http/1.1 }, services: [h1a] }
      - { name: b, match: { sni: b.test }, services: [pb] }
    services: [dflt]
"#,
    ));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    for (name, alpn, want, proto) in [
        ("a.test", Some("h2"), "from h2a", Some("h2")),
        ("a.test", Some("http/1.1"), "from h1a", Some("http/1.1")),
        ("a.test", Some("spdy/1,h2"), "from h2a", Some("h2")),
        ("a.test", None, "from dflt", None),
        ("b.test", Some("h2"), "from pb", Some("h2")),
    ] {
        let out = s_client(vs, name, alpn, &ca_path);
        assert!(out.contains("fulcrum-front"), "{name} {alpn:?}: {out}");
        assert!(out.contains(want), "{name} {alpn:?}: {out}");
        match proto {
            Some(p) => assert!(
                out.contains(&format!("ALPN protocol: {p}")),
                "{name} {alpn:?}: {out}"
            ),
            None => assert!(out.contains("No ALPN negotiated"), "{out}"),
        }
    }
    let m = metrics(&ops);
    assert_eq!(route_count(&m, "v", "a-h2", "matched"), 2, "{m}");
    assert_eq!(route_count(&m, "v", "a-h1", "matched"), 1);
    assert_eq!(route_count(&m, "v", "b", "matched"), 1);

    // A reload that drops the h2 rule: fulcrum no longer offers h2, so a client offering
    // h2 and http/1.1 negotiates http/1.1 and reaches that rule's pool; the counts of the
    // rules kept carry over.
    let text = std::fs::read_to_string(&f.path).expect("config");
    let kept: String = text
        .lines()
        .filter(|l| !l.contains("a-h2"))
        .map(|l| format!("{l}\n"))
        .collect();
    f.write(&kept);
    ops.reload().expect("reload");
    let out = s_client(vs, "a.test", Some("h2,http/1.1"), &ca_path);
    assert!(out.contains("ALPN protocol: http/1.1"), "{out}");
    assert!(out.contains("from h1a"), "{out}");
    let m = metrics(&ops);
    assert_eq!(route_count(&m, "v", "a-h1", "matched"), 2, "{m}");
    assert_eq!(route_count(&m, "v", "b", "matched"), 1);
    ops.shutdown();
}

/// HTTP requests by path prefix, host (exact and `*.suffix`), method with a header, and a
/// rejecting rule that answers 403 itself; what no rule matches goes to the vserver's pool.
#[test]
fn http_requests_are_routed_by_path_host_method_and_header() {
    let (api, _) = tcp_service("api", "127.0.0.1");
    let (b, _) = tcp_service("b", "127.0.0.1");
    let (gold, _) = tcp_service("gold", "127.0.0.1");
    let (web, _) = tcp_service("web", "127.0.0.1");
    let f = ConfigFile::new("routes-http", "");
    f.write(&yaml(
        "http",
        &[("api", api), ("b", b), ("gold", gold), ("web", web)],
        r#"    routes:
      - { name: api, match: { path_prefix: /api/ }, services: [api], method: url_hash }
      - { name: admin, match: { path_prefix: [/admin, /.git] }, reject: { code: 403 } }
      - { name: tenant-b, match: { host: [b.example, "*.b.example"] }, services: [b] }
      - { name: gold, match: { method: POST, header: { name: X-Tenant, exact: gold } }, services: [gold] }
    services: [web]
"#,
    ));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    let ask = |req: &str| {
        let mut c = TcpStream::connect(vs).expect("connect");
        c.set_read_timeout(Some(ANSWER)).expect("timeout");
        c.write_all(req.as_bytes()).expect("send");
        c.shutdown(std::net::Shutdown::Write).expect("half-close");
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    let service = |req: &str| {
        let out = ask(req);
        out.split('|').next().unwrap_or_default().to_owned()
    };
    assert_eq!(
        service("GET /api/v1/x?y=1 HTTP/1.1\r\nHost: a\r\n\r\n"),
        "api"
    );
    assert_eq!(
        service("GET http://a.example/api/z HTTP/1.1\r\nHost: a\r\n\r\n"),
        "api",
        "an absolute-form target's path"
    );
    assert_eq!(service("GET /apix HTTP/1.1\r\nHost: a\r\n\r\n"), "web");
    assert_eq!(
        service("GET / HTTP/1.1\r\nHost: B.Example:8080\r\n\r\n"),
        "b"
    );
    assert_eq!(service("GET / HTTP/1.1\r\nHost: x.b.example\r\n\r\n"), "b");
    assert_eq!(service("GET / HTTP/1.1\r\nHost: nb.example\r\n\r\n"), "web");
    assert_eq!(
        service("POST /o HTTP/1.1\r\nHost: a\r\nx-tenant: gold\r\nContent-Length: 0\r\n\r\n"),
        "gold"
    );
    assert_eq!(
        service("GET /o HTTP/1.1\r\nHost: a\r\nX-Tenant: gold\r\n\r\n"),
        "web",
        "the method must hold too"
    );
    let out = ask("GET /admin/users HTTP/1.1\r\nHost: a\r\n\r\n");
    assert!(out.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{out}");
    assert!(!out.contains('|'), "no service answered: {out}");
    let m = metrics(&ops);
    assert_eq!(route_count(&m, "v", "api", "matched"), 2, "{m}");
    assert_eq!(route_count(&m, "v", "admin", "rejected"), 1);
    assert_eq!(route_count(&m, "v", "tenant-b", "matched"), 2);
    assert_eq!(route_count(&m, "v", "gold", "matched"), 1);
    ops.shutdown();
}

/// A rule's pool whose first choice refuses connections: each connection moves on to the
/// pool's next service, never to a service outside the pool (the vserver's own).
#[test]
fn a_connection_fails_over_inside_its_rules_pool_only() {
    let (live, live_hits) = tcp_service("live", "127.0.0.1");
    let dead = closed_port("127.0.0.1");
    let (web, web_hits) = tcp_service("web", "127.0.0.1");
    let f = ConfigFile::new("routes-failover", "");
    f.write(&yaml(
        "tcp",
        &[("dead", dead), ("live", live), ("web", web)],
        r#"    routes:
      - { name: lan, match: { source: 127.0.0.0/8 }, services: [dead, live], method: round_robin }
    services: [web]
"#,
    ));
    let ops = start(&f);
    let vs = addr(&ops, "v");
    for i in 0..6 {
        let a = tcp_ask(vs, format!("n{i}").as_bytes()).expect("answer");
        assert_eq!(a.service, "live", "connection {i}");
    }
    assert_eq!(live_hits.load(Ordering::Relaxed), 6);
    assert_eq!(web_hits.load(Ordering::Relaxed), 0);
    ops.shutdown();
}

/// `fulcrum route` with `args`; exit code, stdout, stderr.
fn route_cli(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fulcrum"))
        .arg("route")
        .args(args)
        .output()
        .expect("run fulcrum route");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `fulcrum route` over the shipped TLS example (config/tls-edge.yaml): by `--sni`, by a
/// captured ClientHello in a file, and a name no rule knows (the default drops it); an http
/// vserver's request head from a file; --sni refused where there is no TLS to describe.
#[test]
fn fulcrum_route_answers_for_tls_names_hellos_and_http_heads() {
    let cfg = concat!(env!("CARGO_MANIFEST_DIR"), "/config/tls-edge.yaml");
    let (code, out, err) = route_cli(&[
        "--config",
        cfg,
        "--vserver",
        "tls-edge",
        "--sni",
        "x.tenants.example.com",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("rule: tenants"), "{out}");
    assert!(
        out.contains("tenants-1") && out.contains("tenants-2"),
        "{out}"
    );
    let f = ConfigFile::new("route-cli", "");
    let hello = f.beside("hello.bin", "");
    std::fs::write(&hello, client_hello_for("api.example.com")).expect("write hello");
    let hello = hello.to_str().expect("utf-8 path");
    let (code, out, err) = route_cli(&["--config", cfg, "--vserver", "tls-edge", "--json", hello]);
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["rule"], "api", "{out}");
    assert_eq!(v["target"]["method"], "source_ip_hash", "{out}");
    let (code, out, _) = route_cli(&[
        "--config",
        cfg,
        "--vserver",
        "tls-edge",
        "--sni",
        "other.example",
    ]);
    assert_eq!(code, Some(0));
    assert!(out.contains("drop"), "{out}");

    f.write(&yaml(
        "http",
        &[
            ("api", "127.0.0.1:9001".parse().expect("addr")),
            ("web", "127.0.0.1:9002".parse().expect("addr")),
        ],
        r#"    routes:
      - { name: api, match: { path_prefix: /api/ }, services: [api] }
    services: [web]
"#,
    ));
    let head = f.beside("head.txt", "GET /api/v1 HTTP/1.1\nHost: a\n");
    let (code, out, err) = route_cli(&[
        "--config",
        f.arg(),
        "--vserver",
        "v",
        head.to_str().expect("path"),
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("rule: api") && out.contains("service: api"),
        "{out}"
    );
    let (code, _, err) = route_cli(&[
        "--config",
        f.arg(),
        "--vserver",
        "v",
        "--sni",
        "a",
        head.to_str().expect("path"),
    ]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--sni"), "{err}");
}

/// `POST /vservers/v/route` on a running tcp vserver: by `sni` in the query, by a ClientHello
/// in the body, from the live balancer (a pool whose only service is disabled has none).
#[test]
fn the_route_endpoint_answers_for_a_running_tcp_vserver() {
    let a = recorder("a", 0);
    let b = recorder("b", 0);
    let f = ConfigFile::new("route-endpoint", "");
    f.write(&yaml(
        "tcp",
        &[("a", a.addr), ("b", b.addr)],
        r#"    routes:
      - { name: a, match: { sni: a.test }, services: [a] }
    default: { drop: true }
    services: [b]
"#,
    ));
    let ops = start(&f);
    let ask = |query: &str, body: Vec<u8>| {
        let mut req = fulcrum::admin::router::Request::new("POST", "/vservers/v/route");
        req.query = Some(query.to_owned());
        req.body = body;
        let r = fulcrum::admin::router::handle(&ops, &req);
        (r.status, r.body)
    };
    let (status, body) = ask("sni=a.test", Vec::new());
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert_eq!(
        (v["rule"].as_str(), v["service"].as_str()),
        (Some("a"), Some("a")),
        "{body}"
    );
    let (status, body) = ask("", client_hello_for("A.test"));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"rule\":\"a\""), "{body}");
    let (status, body) = ask("sni=z.test", Vec::new());
    assert_eq!(status, 200);
    assert!(body.contains("\"action\":\"drop\""), "{body}");
    let disable = fulcrum::admin::router::Request::new("POST", "/services/a/disable");
    assert_eq!(fulcrum::admin::router::handle(&ops, &disable).status, 200);
    let (_, body) = ask("sni=a.test", Vec::new());
    let v: serde_json::Value = serde_json::from_str(&body).expect("json");
    assert!(
        v["service"].is_null(),
        "a disabled service is not chosen: {body}"
    );
    assert_eq!(ask("bogus=1", Vec::new()).0, 400);
    ops.shutdown();
}
