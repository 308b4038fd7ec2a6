//! Each probe kind against a live and a dead loopback endpoint, and how the answers of a
//! `sip-options` monitor move a service's state: real SIP peers on 127.0.0.1 answering
//! OPTIONS 5xx, 408, 4xx, 2xx, and 503 with Retry-After (RFC 3261 §21.5.4, §20.33), the
//! state read through the admin router's `/status`. Synchronisation is by the peers' own log
//! of answers and bounded polling of state, never by bare sleeps.

mod common;

use common::wait_for;

use fulcrum::admin::router::{self, Request};
use fulcrum::config::{MonitorKind, Protocol};
use fulcrum::health::probe::{ProbeError, probe};
use fulcrum::ops::Ops;
use serde_json::Value;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};

const T: Duration = Duration::from_secs(2);

/// A loopback port with nothing listening, reserved for the test binary's lifetime.
async fn dead_port() -> SocketAddr {
    common::closed_port("127.0.0.1")
}

#[tokio::test]
async fn tcp_connect() {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let r = probe(&MonitorKind::TcpConnect, addr, Protocol::Tcp, T).await;
    assert!(r.is_ok(), "{r:?}");
    let dead = dead_port().await;
    assert!(
        probe(&MonitorKind::TcpConnect, dead, Protocol::Tcp, T)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn udp_send_expect() {
    let echo = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    let addr = echo.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut buf = [0u8; 64];
        while let Ok((n, from)) = echo.recv_from(&mut buf).await {
            let reply = if &buf[..n] == b"ping" {
                &b"pong!"[..]
            } else {
                &b"?"[..]
            };
            let _ = echo.send_to(reply, from).await;
        }
    });
    let kind = |send: &[u8], expect: &[u8]| MonitorKind::Udp {
        send: send.to_vec(),
        expect: Some(expect.to_vec()),
    };
    assert!(
        probe(&kind(b"ping", b"pong"), addr, Protocol::Udp, T)
            .await
            .is_ok()
    );
    assert!(matches!(
        probe(&kind(b"other", b"pong"), addr, Protocol::Udp, T).await,
        Err(ProbeError::Mismatch)
    ));
    // A dead port that stays reserved: the socket holds it (so nothing else can be given it)
    // but, connected to another peer, receives nothing from the probe, which then fails as
    // on a closed port.
    let dead = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    dead.connect("127.0.0.1:9").await.expect("connect");
    let dead_addr = dead.local_addr().expect("addr");
    assert!(
        probe(&kind(b"ping", b"pong"), dead_addr, Protocol::Udp, T)
            .await
            .is_err()
    );
}

async fn http_server(status: &'static str, body: &'static str) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            let mut buf = [0u8; 1024];
            let _ = c.read(&mut buf).await;
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = c.write_all(resp.as_bytes()).await;
        }
    });
    addr
}

#[tokio::test]
async fn http_status_and_load() {
    let kind = MonitorKind::Http {
        path: "/health".into(),
        expect_codes: vec![],
    };
    let ok = http_server("200 OK", "42\n").await;
    let r = probe(&kind, ok, Protocol::Http, T).await.expect("alive");
    assert_eq!((r.status, r.load), (Some(200), Some(42)));
    let bad = http_server("503 Busy", "").await;
    assert!(matches!(
        probe(&kind, bad, Protocol::Http, T).await,
        Err(ProbeError::UnexpectedStatus(503))
    ));
}

#[tokio::test]
async fn sip_options_udp_and_tcp() {
    let uas = fulcrum::peer::Uas::start("127.0.0.1:0".parse().expect("addr")).expect("uas");
    let any = MonitorKind::SipOptions {
        expect_codes: vec![],
    };
    let r = probe(&any, uas.addr, Protocol::SipUdp, T)
        .await
        .expect("alive");
    assert_eq!(r.status, Some(200));
    let only_404 = MonitorKind::SipOptions {
        expect_codes: vec![404],
    };
    assert!(matches!(
        probe(&only_404, uas.addr, Protocol::SipUdp, T).await,
        Err(ProbeError::UnexpectedStatus(200))
    ));

    // SIP over TCP: a tiny responder that echoes the Call-ID in a 200 with a load header.
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            let mut buf = vec![0u8; 4096];
            let n = c.read(&mut buf).await.unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]).into_owned();
            let call_id = req
                .lines()
                .find_map(|l| l.strip_prefix("Call-ID: "))
                .unwrap_or("")
                .to_owned();
            let resp = format!(
                "SIP/2.0 100 Trying\r\nCall-ID: {call_id}\r\nCSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n\
                 SIP/2.0 200 OK\r\nCall-ID: {call_id}\r\nCSeq: 1 OPTIONS\r\nX-Load: 7\r\nContent-Length: 0\r\n\r\n"
            );
            let _ = c.write_all(resp.as_bytes()).await;
        }
    });
    let r = probe(&any, addr, Protocol::SipTcp, T)
        .await
        .expect("alive over tcp");
    assert_eq!((r.status, r.load), (Some(200), Some(7)));
    let dead = dead_port().await;
    assert!(probe(&any, dead, Protocol::SipTcp, T).await.is_err());
}

/// An `http` monitor of a service with `tls` asks over TLS, with the service's CA and name
/// (a plain GET to a TLS port is refused, and the service would stay DOWN for ever).
#[tokio::test]
async fn http_over_tls_with_the_services_tls() {
    let f = common::ConfigFile::new("probe-https", "");
    let ca = common::tls::Ca::new("fulcrum probe test CA");
    let ca_path = ca.write(&f, "ca.crt");
    let cert = ca.issue(&f, "svc", "svc.test", "svc");
    let acceptor = tokio_rustls::TlsAcceptor::from(common::tls::server_config(&cert));
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((c, _)) = l.accept().await {
            let Ok(mut s) = acceptor.accept(c).await else {
                continue;
            };
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\n42\n")
                .await;
            let _ = s.shutdown().await;
        }
    });
    let config = fulcrum::tls::client_config(&fulcrum::tls::ClientFiles {
        ca: &ca_path,
        cert: None,
        key: None,
    })
    .expect("client config");
    let tls = fulcrum::tls::ClientTls {
        config,
        server_name: fulcrum::tls::server_name(Some("svc.test"), addr.ip()).expect("name"),
    };
    let kind = MonitorKind::Http {
        path: "/health".into(),
        expect_codes: vec![],
    };
    let r = fulcrum::health::probe::probe_tls(&kind, addr, Protocol::Http, Some(&tls), T)
        .await
        .expect("alive over TLS");
    assert_eq!((r.status, r.load), (Some(200), Some(42)));
}

/// How a scripted peer answers one OPTIONS: a status code and, when set, a Retry-After value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reply {
    code: u16,
    retry_after: Option<&'static str>,
}

const fn reply(code: u16) -> Reply {
    Reply {
        code,
        retry_after: None,
    }
}

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        500 => "Server Internal Error",
        503 => "Service Unavailable",
        603 => "Decline",
        _ => "Whatever",
    }
}

/// The answer `r` to the OPTIONS in `req` (its Via, From, To, Call-ID and CSeq echoed,
/// RFC 3261 §8.2.6.2); `None` for anything that is not a whole OPTIONS.
fn answer_to(req: &[u8], r: Reply) -> Option<Vec<u8>> {
    let msg = fulcrum::sip::scan(req).ok()?;
    if msg.method() != Some(&b"OPTIONS"[..]) {
        return None;
    }
    let h = |name: &[u8]| {
        msg.header(name)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    let retry_after = r
        .retry_after
        .map(|v| format!("Retry-After: {v}\r\n"))
        .unwrap_or_default();
    Some(
        format!(
            "SIP/2.0 {} {}\r\nVia: {}\r\nFrom: {}\r\nTo: {};tag=peer\r\nCall-ID: {}\r\nCSeq: {}\r\n{retry_after}Content-Length: 0\r\n\r\n",
            r.code,
            reason(r.code),
            h(b"Via")?,
            h(b"From")?,
            h(b"To")?,
            h(b"Call-ID")?,
            h(b"CSeq")?,
        )
        .into_bytes(),
    )
}

/// What a scripted peer answers: the queued replies first, then `steady`; and the code and
/// time of every answer it sent since the script was last set.
#[derive(Debug)]
struct Script {
    queued: VecDeque<Reply>,
    steady: Reply,
    sent: Vec<(u16, Instant)>,
}

impl Script {
    fn next(&mut self) -> Reply {
        let r = self.queued.pop_front().unwrap_or(self.steady);
        self.sent.push((r.code, Instant::now()));
        r
    }
}

/// A SIP service over UDP on 127.0.0.1 answering OPTIONS as scripted, bound before `start`
/// returns; its thread ends when it is dropped.
struct ScriptedPeer {
    addr: SocketAddr,
    script: Arc<Mutex<Script>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ScriptedPeer {
    fn start(steady: Reply) -> ScriptedPeer {
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind peer");
        sock.set_read_timeout(Some(Duration::from_millis(50)))
            .expect("timeout");
        let addr = sock.local_addr().expect("addr");
        let script = Arc::new(Mutex::new(Script {
            queued: VecDeque::new(),
            steady,
            sent: Vec::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (sc, st) = (Arc::clone(&script), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 65_536];
            while !st.load(Ordering::Relaxed) {
                let Ok((n, from)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                let r = lock(&sc).next();
                if let Some(out) = answer_to(&buf[..n], r) {
                    let _ = sock.send_to(&out, from);
                }
            }
        });
        ScriptedPeer {
            addr,
            script,
            stop,
            thread: Some(thread),
        }
    }

    /// Answer the next probes `first`, then `steady`; the log of answers starts afresh.
    fn set(&self, first: &[Reply], steady: Reply) {
        let mut s = lock(&self.script);
        s.queued = first.iter().copied().collect();
        s.steady = steady;
        s.sent.clear();
    }

    /// Answers sent since the script was last set.
    fn sent(&self) -> Vec<(u16, Instant)> {
        lock(&self.script).sent.clone()
    }
}

impl Drop for ScriptedPeer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The `/status` entry of service `name` of vserver `v`.
fn service_status(ops: &Ops, name: &str) -> Value {
    let r = router::handle(ops, &Request::new("GET", "/status"));
    assert_eq!(r.status, 200, "{}", r.body);
    let st: Value = serde_json::from_str(&r.body).expect("status is JSON");
    st["vservers"][0]["services"]
        .as_array()
        .and_then(|s| s.iter().find(|x| x["name"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("{name} not in {st}"))
}

/// The monitor probes every 100 ms and wants three failures for DOWN, two successes for UP.
const FAILURES_TO_DOWN: usize = 3;
const MONITOR: &str = "interval: 100ms, timeout: 80ms, failures_to_down: 3, successes_to_up: 2";

/// Every peer answers 200 until the monitor has confirmed its service UP; then each answers
/// its code. 5xx and 408 take the service DOWN within `failures_to_down` probes; 404, 405
/// and 200 keep it UP through more probes than that. A 503 with `Retry-After: 2` followed by
/// 200s takes its service DOWN after that one answer, holds it DOWN for the 2 s though every
/// later answer is 200, and lets it come UP after.
#[test]
fn sip_options_answers_move_the_service_state() {
    let held = "ra";
    let cases: [(&str, Reply); 6] = [
        ("s503", reply(503)),
        ("s500", reply(500)),
        ("s408", reply(408)),
        ("s404", reply(404)),
        ("s405", reply(405)),
        ("s200", reply(200)),
    ];
    let peers: Vec<(&str, ScriptedPeer)> = cases
        .iter()
        .map(|(n, _)| *n)
        .chain([held])
        .map(|n| (n, ScriptedPeer::start(reply(200))))
        .collect();
    let mut yaml = format!(
        "admin: {{ listen: null }}\nmonitors:\n  - {{ name: ping, type: sip-options, {MONITOR} }}\nservices:\n"
    );
    for (n, p) in &peers {
        yaml += &format!(
            "  - {{ name: {n}, address: \"{}\", protocol: sip-udp, monitor: ping }}\n",
            p.addr
        );
    }
    let names: Vec<&str> = peers.iter().map(|(n, _)| *n).collect();
    yaml += &format!(
        "vservers:\n  - {{ name: v, protocol: sip-udp, bind: [\"127.0.0.1:0\"], method: round_robin, workers: 1, services: [{}] }}\n",
        names.join(", ")
    );
    let ops = Ops::start(
        fulcrum::config::from_str("t.yaml", &yaml).expect("valid"),
        None,
    )
    .expect("start");
    let peer = |name: &str| {
        peers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, p)| p)
            .expect("peer")
    };
    for n in &names {
        wait_for(&format!("{n} confirmed UP"), Duration::from_secs(5), || {
            (service_status(&ops, n)["monitor"]["state"] == "UP").then_some(())
        });
    }

    for (n, r) in &cases {
        peer(n).set(&[], *r);
    }
    let retry_after = reply_with_retry_after(503, "2;duration=60");
    peer(held).set(&[retry_after], reply(200));

    // The probe after the k-th answer goes out once the k-th is recorded: a peer that has
    // answered one more time than `failures_to_down` was judged on that many answers.
    for (n, r) in &cases {
        wait_for(&format!("{n}: answered"), Duration::from_secs(5), || {
            (peer(n).sent().len() > FAILURES_TO_DOWN).then_some(())
        });
        let st = service_status(&ops, n);
        let want = if matches!(r.code, 500..=599 | 408) {
            "DOWN"
        } else {
            "UP"
        };
        assert_eq!(st["state"], want, "{n}: {st}");
        assert_eq!(st["monitor"]["state"], want, "{n}: {st}");
        assert!(st["monitor"]["hold"].is_null(), "{n}: {st}");
    }

    // One 503 with Retry-After took `ra` DOWN: the second probe went out after it was
    // recorded, far fewer failures than `failures_to_down`.
    let p = peer(held);
    let sent = wait_for("ra: answered twice", Duration::from_secs(5), || {
        let s = p.sent();
        (s.len() >= 2).then_some(s)
    });
    assert_eq!(sent[0].0, 503);
    assert!(sent[1..].iter().all(|(c, _)| *c == 200), "{sent:?}");
    let t503 = sent[0].1;
    let until = t503 + Duration::from_secs(2);
    let st = service_status(&ops, held);
    assert_eq!(st["state"], "DOWN", "{st}");
    let hold = &st["monitor"]["hold"];
    assert_eq!(hold["reason"], "retry_after", "{st}");
    assert_eq!(hold["retry_after_s"], 2, "{st}");
    let remaining = hold["remaining_s"].as_f64().expect("remaining_s");
    assert!(remaining > 0.0 && remaining <= 2.0, "{st}");

    // Held DOWN until the Retry-After has passed, however many 200s came meanwhile (the
    // time is read after the status: a status read before `until` must say DOWN).
    let mut polls = 0;
    loop {
        let st = service_status(&ops, held);
        if Instant::now() >= until {
            break;
        }
        assert_eq!(st["state"], "DOWN", "held: {st}");
        polls += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    let ok_during_hold = p
        .sent()
        .iter()
        .filter(|(c, t)| *c == 200 && *t + Duration::from_millis(500) < until)
        .count();
    assert!(
        ok_during_hold >= 2,
        "the peer answered 200 during the hold: {ok_during_hold}"
    );
    assert!(polls > 0);

    // Then `successes_to_up` answers after the hold bring it UP.
    let up = wait_for("ra UP after the hold", Duration::from_secs(5), || {
        let st = service_status(&ops, held);
        (st["state"] == "UP").then_some(st)
    });
    assert!(up["monitor"]["hold"].is_null(), "{up}");
    ops.shutdown();
}

fn reply_with_retry_after(code: u16, value: &'static str) -> Reply {
    Reply {
        code,
        retry_after: Some(value),
    }
}

/// Answer every OPTIONS on stream `s` with `r` until the client closes.
async fn answer_stream<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, r: Reply) {
    let mut buf = Vec::new();
    loop {
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        // The monitor's OPTIONS has no body: a request ends at its blank line.
        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let req: Vec<u8> = buf.drain(..end + 4).collect();
            let Some(out) = answer_to(&req, r) else {
                continue;
            };
            if s.write_all(&out).await.is_err() || s.flush().await.is_err() {
                return;
            }
        }
    }
}

/// A sip-tcp service answering every OPTIONS `r`.
async fn tcp_peer(r: Reply) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((c, _)) = l.accept().await {
            tokio::spawn(answer_stream(c, r));
        }
    });
    addr
}

/// A sip-udp service answering every OPTIONS `r`.
async fn udp_peer(r: Reply) -> SocketAddr {
    let sock = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    let addr = sock.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        while let Ok((n, from)) = sock.recv_from(&mut buf).await {
            if let Some(out) = answer_to(&buf[..n], r) {
                let _ = sock.send_to(&out, from).await;
            }
        }
    });
    addr
}

/// What one probe makes of an answer: alive (its code), a plain failure (its code), or a
/// Retry-After hold.
fn verdict(r: Result<fulcrum::health::probe::ProbeReply, ProbeError>) -> String {
    match r {
        Ok(ok) => format!("alive {:?}", ok.status),
        Err(ProbeError::UnexpectedStatus(c)) => format!("failed {c}"),
        Err(ProbeError::RetryAfter {
            code,
            retry_after_s,
        }) => format!("held {code} {retry_after_s}"),
        Err(e) => format!("error {e}"),
    }
}

/// The same judgement over UDP and TCP (one probe code path for every SIP transport), by
/// default and with `expect_codes`.
#[tokio::test]
async fn sip_options_judges_the_answer_over_udp_and_tcp() {
    let any = MonitorKind::SipOptions {
        expect_codes: vec![],
    };
    let only_200 = MonitorKind::SipOptions {
        expect_codes: vec![200],
    };
    let cases = [
        (reply(200), &any, "alive Some(200)"),
        (reply(404), &any, "alive Some(404)"),
        (reply(405), &any, "alive Some(405)"),
        (reply(603), &any, "alive Some(603)"),
        (reply(408), &any, "failed 408"),
        (reply(500), &any, "failed 500"),
        (reply(503), &any, "failed 503"),
        (reply_with_retry_after(503, "2"), &any, "held 503 2"),
        (
            reply_with_retry_after(503, "120 (maintenance)"),
            &any,
            "held 503 120",
        ),
        (reply_with_retry_after(503, "soon"), &any, "failed 503"),
        (reply_with_retry_after(500, "5"), &any, "failed 500"),
        (reply(404), &only_200, "failed 404"),
        (reply_with_retry_after(503, "7"), &only_200, "held 503 7"),
    ];
    for (r, kind, want) in cases {
        let udp = udp_peer(r).await;
        let got = verdict(probe(kind, udp, Protocol::SipUdp, T).await);
        assert_eq!(got, want, "udp {r:?} {kind:?}");
        let tcp = tcp_peer(r).await;
        let got = verdict(probe(kind, tcp, Protocol::SipTcp, T).await);
        assert_eq!(got, want, "tcp {r:?} {kind:?}");
    }
}

/// Over TLS too: a sip-tls service's 503 with Retry-After holds, its 405 is alive.
#[tokio::test]
async fn sip_options_judges_the_answer_over_tls() {
    let f = common::ConfigFile::new("probe-sip-tls", "");
    let ca = common::tls::Ca::new("fulcrum probe test CA");
    let ca_path = ca.write(&f, "ca.crt");
    let cert = ca.issue(&f, "svc", "svc.test", "svc");
    let config = fulcrum::tls::client_config(&fulcrum::tls::ClientFiles {
        ca: &ca_path,
        cert: None,
        key: None,
    })
    .expect("client config");
    let any = MonitorKind::SipOptions {
        expect_codes: vec![],
    };
    for (r, want) in [
        (reply_with_retry_after(503, "2"), "held 503 2"),
        (reply(405), "alive Some(405)"),
        (reply(500), "failed 500"),
    ] {
        let acceptor = tokio_rustls::TlsAcceptor::from(common::tls::server_config(&cert));
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((c, _)) = l.accept().await {
                if let Ok(s) = acceptor.accept(c).await {
                    tokio::spawn(answer_stream(s, r));
                }
            }
        });
        let tls = fulcrum::tls::ClientTls {
            config: Arc::clone(&config),
            server_name: fulcrum::tls::server_name(Some("svc.test"), addr.ip()).expect("name"),
        };
        let got = verdict(
            fulcrum::health::probe::probe_tls(&any, addr, Protocol::SipTls, Some(&tls), T).await,
        );
        assert_eq!(got, want, "tls {r:?}");
    }
}

/// RFC 3261 §17.1.2.2: a probe's OPTIONS over UDP is a non-INVITE client transaction, so it
/// is retransmitted (Timer E) until answered: a peer that loses the first copy (a lossy
/// network) is still alive within a 500 ms timeout; the copies are the same request.
#[tokio::test]
async fn a_lost_options_is_retransmitted_within_the_timeout() {
    let sock = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    let addr = sock.local_addr().expect("addr");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        let mut seen = 0;
        while let Ok((n, from)) = sock.recv_from(&mut buf).await {
            seen += 1;
            let _ = tx.send(buf[..n].to_vec());
            // The first copy is "lost": only the second is answered.
            if seen == 2
                && let Some(a) = answer_to(&buf[..n], reply(200))
            {
                let _ = sock.send_to(&a, from).await;
            }
        }
    });
    let any = MonitorKind::SipOptions {
        expect_codes: vec![],
    };
    let timeout = Duration::from_millis(500);
    let r = probe(&any, addr, Protocol::SipUdp, timeout)
        .await
        .expect("alive despite the lost copy");
    assert_eq!(r.status, Some(200));
    assert!(
        r.rtt_us >= 100_000,
        "answered at the retransmission: {}",
        r.rtt_us
    );
    let first = rx.recv().await.expect("first copy");
    let second = rx.recv().await.expect("second copy");
    assert_eq!(first, second, "a retransmission is the same request");
    assert_eq!(
        fulcrum::health::probe::options_retransmit_first(timeout),
        Duration::from_millis(125)
    );
    assert_eq!(
        fulcrum::health::probe::options_retransmit_first(Duration::from_secs(5)),
        Duration::from_millis(500),
        "T1 when the timeout allows"
    );
}
