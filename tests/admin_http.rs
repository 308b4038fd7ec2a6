//! The admin API over real sockets: keep-alive, the head / body / connection bounds, the
//! dashboard page without a token, and the stop on the shutdown signal. The routes themselves
//! are tested through the router (tests/ops.rs).

use fulcrum::admin::{self, Limits};
use fulcrum::config;
use fulcrum::ops::Ops;
use fulcrum::peer::Uas;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn any() -> SocketAddr {
    "127.0.0.1:0".parse().expect("addr")
}

/// A proxy with one unmonitored service and an admin token, and its admin API on `limits`.
fn start(limits: Limits) -> (Arc<Ops>, SocketAddr, tokio::task::JoinHandle<()>, Uas) {
    let uas = Uas::start(any()).expect("uas");
    let yaml = format!(
        "admin: {{ listen: null, token: s3cret }}\nservices:\n  - {{ name: s0, address: {}, protocol: sip-udp }}\nvservers:\n  - name: v\n    protocol: sip-udp\n    bind: [127.0.0.1:0]\n    method: round_robin\n    workers: 1\n    services: [s0]\n",
        uas.addr
    );
    let ops = Ops::start(config::from_str("t.yaml", &yaml).expect("valid"), None).expect("start");
    let (addr, task) = ops
        .tokio()
        .block_on(admin::serve_with(Arc::clone(&ops), any(), limits))
        .expect("admin listener");
    (ops, addr, task, uas)
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect admin");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s
}

/// One response read off `s`: status, head, body (by its Content-Length). `None` when the
/// connection ends (or stays silent) before a whole response.
fn response(s: &mut TcpStream) -> Option<(u16, String, String)> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => buf.push(byte[0]),
            _ => return None,
        }
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let status = head.get(9..12)?.parse().ok()?;
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).ok()?;
    Some((status, head, String::from_utf8_lossy(&body).into_owned()))
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[test]
fn keep_alive_serves_several_requests_on_one_connection() {
    let (ops, addr, _task, _uas) = start(Limits::default());
    let mut s = connect(addr);
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write");
    let (code, _, body) = response(&mut s).expect("first response");
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    s.write_all(b"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n\r\n")
        .expect("write on the same connection");
    let (code, _, body) = response(&mut s).expect("second response");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"vservers\""), "{body}");
    // Pipelined: both answered, in order.
    s.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\nGET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write");
    assert_eq!(response(&mut s).expect("third").0, 200);
    let (code, head, _) = response(&mut s).expect("fourth");
    assert_eq!(code, 401);
    assert_eq!(header(&head, "www-authenticate"), Some("Bearer"));
    ops.shutdown();
}

#[test]
fn bodies_and_heads_over_the_bounds_are_refused() {
    let (ops, addr, _task, _uas) = start(Limits::default());
    let put = "PUT /vservers/v/slow-start HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n";

    // Declared too large: refused before the body is sent.
    let mut s = connect(addr);
    s.write_all(format!("{put}Content-Length: {}\r\n\r\n", 64 * 1024 + 1).as_bytes())
        .expect("write");
    let (code, head, body) = response(&mut s).expect("413");
    assert_eq!(code, 413, "{body}");
    assert_eq!(header(&head, "connection"), Some("close"));

    // Chunked, found too large while reading.
    let mut s = connect(addr);
    s.write_all(format!("{put}Transfer-Encoding: chunked\r\n\r\n").as_bytes())
        .expect("write");
    // One chunk a byte over the bound, and nothing after it: the server has read everything
    // sent when it refuses, so its close is clean (unread data would reset the connection).
    let over = 64 * 1024 + 1;
    s.write_all(format!("{over:x}\r\n").as_bytes())
        .expect("write");
    s.write_all(&vec![b'x'; over]).expect("write");
    assert_eq!(response(&mut s).expect("413").0, 413);

    // At the bound: read, and answered by the route (not JSON: 400).
    let mut s = connect(addr);
    let body = " ".repeat(64 * 1024);
    s.write_all(format!("{put}Content-Length: {}\r\n\r\n{body}", body.len()).as_bytes())
        .expect("write");
    assert_eq!(response(&mut s).expect("400").0, 400);

    // A head over 16 KiB.
    let mut s = connect(addr);
    let big = "a".repeat(20 * 1024);
    let _ =
        s.write_all(format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n").as_bytes());
    assert_eq!(response(&mut s).map(|r| r.0), Some(431));
    ops.shutdown();
}

/// `GET /healthz` with `fields` header field lines `line` (each with its CRLF) after `Host`.
fn head_with_fields(fields: usize, line: &str) -> String {
    format!(
        "GET /healthz HTTP/1.1\r\nHost: x\r\n{}\r\n",
        line.repeat(fields)
    )
}

/// The head's size is the one bound: a head under 16 KiB is served however many fields it
/// holds (hyper alone refuses more than 100), one over it is refused with 431 whatever its
/// fields.
#[test]
fn a_head_under_the_size_bound_is_served_however_many_fields_it_holds() {
    let (ops, addr, _task, _uas) = start(Limits::default());
    let bound = Limits::default().max_head_bytes;
    let value = "v".repeat(140);
    let cases = [
        // 100 ordinary fields, ~15 KB.
        (100, format!("X-Field: {value}\r\n"), 200),
        (101, format!("X-Field: {value}\r\n"), 200),
        // The shortest field there is, as many as fit under the bound.
        ((bound - 64) / 4, "a:\r\n".to_owned(), 200),
        // Over the bound: ordinary fields, or the shortest, one more than fits.
        (110, format!("X-Field: {value}\r\n"), 431),
        (bound / 4 + 1, "a:\r\n".to_owned(), 431),
    ];
    for (fields, line, want) in cases {
        let head = head_with_fields(fields, &line);
        assert_eq!(
            head.len() <= bound,
            want == 200,
            "{fields} fields: {} bytes",
            head.len()
        );
        let mut s = connect(addr);
        let _ = s.write_all(head.as_bytes());
        let got = response(&mut s).map(|r| r.0);
        assert_eq!(
            got,
            Some(want),
            "{fields} fields of {:?}, {} bytes",
            line,
            head.len()
        );
    }
    ops.shutdown();
}

#[test]
fn connections_past_the_bound_wait_their_turn() {
    let limits = Limits {
        max_connections: 2,
        ..Limits::default()
    };
    let (ops, addr, _task, _uas) = start(limits);
    // Two connections hold both slots (a request each keeps them kept alive).
    let mut held: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = connect(addr);
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                .expect("write");
            assert_eq!(response(&mut s).expect("served").0, 200);
            s
        })
        .collect();
    // The third connects (the listen backlog) but is not served while both are open...
    let mut third = connect(addr);
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write");
    third
        .set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let mut line = [0u8; 12];
    match third.read(&mut line) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) => {}
        other => panic!("the third connection was served past the bound: {other:?}"),
    }
    // ...and is, as soon as one of them ends, with its request intact.
    drop(held.pop());
    third
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    third
        .read_exact(&mut line)
        .expect("served once a slot is free");
    assert_eq!(&line, b"HTTP/1.1 200");
    ops.shutdown();
}

#[test]
fn a_silent_client_is_dropped_after_the_head_timeout() {
    let limits = Limits {
        head_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let (ops, addr, _task, _uas) = start(limits);
    let started = Instant::now();
    let mut s = connect(addr);
    s.write_all(b"GET /healthz HTTP/1.1\r\n").expect("write");
    let mut rest = Vec::new();
    // Closed (possibly after a 408): the read ends, well before the client's own timeout.
    let _ = s.read_to_end(&mut rest);
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "closed after {:?}",
        started.elapsed()
    );
    let text = String::from_utf8_lossy(&rest);
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 408"),
        "{text}"
    );
    ops.shutdown();
}

#[test]
fn dashboard_loads_without_a_token_and_the_server_stops_on_shutdown() {
    let (ops, addr, task, _uas) = start(Limits::default());
    let mut s = connect(addr);
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write");
    let (code, head, body) = response(&mut s).expect("page");
    assert_eq!(code, 200);
    assert_eq!(
        header(&head, "content-type"),
        Some("text/html; charset=utf-8")
    );
    assert!(
        header(&head, "content-security-policy").is_some_and(|c| c.contains("default-src 'none'")),
        "{head}"
    );
    assert!(body.contains("/status"));

    // A change from another site's page is refused; from the page's own origin it is not.
    let disable = |origin: &str| {
        format!(
            "POST /services/s0/disable HTTP/1.1\r\nHost: {addr}\r\nOrigin: {origin}\r\nAuthorization: Bearer s3cret\r\nContent-Length: 0\r\n\r\n"
        )
    };
    s.write_all(disable("https://evil.example").as_bytes())
        .expect("write");
    assert_eq!(response(&mut s).expect("refused").0, 403);
    s.write_all(disable(&format!("http://{addr}")).as_bytes())
        .expect("write");
    assert_eq!(response(&mut s).expect("applied").0, 200);

    // The kept-alive connection above, idle, is closed by the shutdown; the listener goes.
    ops.shutdown();
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut rest = Vec::new();
    assert!(s.read_to_end(&mut rest).is_ok(), "closed, not timed out");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !task.is_finished() {
        assert!(Instant::now() < deadline, "the server task ended");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        TcpStream::connect(addr).is_err(),
        "nothing listens any more"
    );
}

/// `POST /vservers/NAME/route` over a socket: the SIP request in the body (LF line ends as
/// a file has them), the client's address in the query; the answer follows the running
/// balancer's health (a service disabled through the API is passed over) and asking moves
/// nothing. Unknown vserver 404, a vserver without routes 409, a body that is no request the
/// rules route 400, no token 401.
#[test]
fn the_route_endpoint_answers_from_the_running_balancer() {
    let yaml = "admin: { listen: null, token: s3cret }
services:
  - { name: p1, address: 127.0.0.1:5071, protocol: sip-udp }
  - { name: r1, address: 127.0.0.1:5081, protocol: sip-udp }
  - { name: r2, address: 127.0.0.1:5082, protocol: sip-udp }
vservers:
  - name: v
    protocol: sip-udp
    bind: [127.0.0.1:0]
    workers: 1
    services: [p1]
    routes:
      - { name: registrar, match: { method: REGISTER }, services: [r1, r2], method: round_robin }
      - { name: lan, match: { source: 10.0.0.0/8 }, reject: { code: 403, reason: Not From Here } }
  - { name: plain, protocol: sip-udp, bind: [127.0.0.1:0], workers: 1, services: [p1] }
";
    let ops = Ops::start(config::from_str("t.yaml", yaml).expect("valid"), None).expect("start");
    let (addr, _task) = ops
        .tokio()
        .block_on(admin::serve_with(
            Arc::clone(&ops),
            any(),
            Limits::default(),
        ))
        .expect("admin listener");
    let register = "REGISTER sip:example.com SIP/2.0\nVia: SIP/2.0/UDP 192.0.2.7:5070;branch=z9hG4bK1\nFrom: <sip:alice@example.com>;tag=1\nTo: <sip:alice@example.com>\nCall-ID: reg-1\nCSeq: 1 REGISTER\nMax-Forwards: 70\n";
    let mut s = connect(addr);
    let mut ask = |target: &str, body: &str, token: bool| {
        let auth = if token {
            "Authorization: Bearer s3cret\r\n"
        } else {
            ""
        };
        s.write_all(
            format!(
                "POST {target} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .expect("write");
        let (code, _, body) = response(&mut s).expect("response");
        let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        (code, json)
    };
    for _ in 0..3 {
        let (code, a) = ask("/vservers/v/route", register, true);
        assert_eq!(code, 200, "{a}");
        assert_eq!(a["rule"], "registrar", "{a}");
        assert_eq!(a["target"]["action"], "pool", "{a}");
        assert_eq!(
            a["target"]["services"],
            serde_json::json!(["r1", "r2"]),
            "{a}"
        );
        assert_eq!(
            a["service"], "r1",
            "asking moves no round-robin position: {a}"
        );
        assert_eq!(a["source"], "192.0.2.7:5070", "{a}");
    }
    let (code, a) = ask("/services/r1/disable", "", true);
    assert_eq!(code, 200, "{a}");
    let (_, a) = ask("/vservers/v/route", register, true);
    assert_eq!(a["service"], "r2", "r1 is out of service: {a}");
    let (code, a) = ask("/vservers/v/route?source=10.1.2.3:5060", register, true);
    assert_eq!(code, 200, "{a}");
    assert_eq!(a["rule"], "registrar", "{a}");
    let invite = register.replace("REGISTER", "INVITE");
    let (_, a) = ask("/vservers/v/route?source=10.1.2.3%3A5060", &invite, true);
    assert_eq!(a["rule"], "lan", "{a}");
    assert_eq!(
        a["target"],
        serde_json::json!({ "action": "reject", "code": 403, "reason": "Not From Here" }),
        "{a}"
    );
    assert_eq!(a["service"], serde_json::Value::Null, "{a}");
    let (_, a) = ask("/vservers/v/route?source=192.0.2.9:5060", &invite, true);
    assert_eq!(
        (&a["rule"], &a["service"]),
        (&serde_json::Value::Null, &serde_json::json!("p1")),
        "the default: {a}"
    );
    assert_eq!(ask("/vservers/nope/route", register, true).0, 404);
    assert_eq!(ask("/vservers/plain/route", register, true).0, 409);
    assert_eq!(ask("/vservers/v/route", "hello\n", true).0, 400);
    assert_eq!(
        ask(
            "/vservers/v/route",
            &register.replace("REGISTER sip", "ACK sip"),
            true
        )
        .0,
        400
    );
    assert_eq!(
        ask("/vservers/v/route?source=nowhere", register, true).0,
        400
    );
    assert_eq!(ask("/vservers/v/route", register, false).0, 401);
    ops.shutdown();
}
