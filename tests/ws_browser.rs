//! A browser softphone through fulcrum: JsSIP (npm) in Debian's headless chromium
//! (tests/dashboard/jssip.mjs) registers over a `sip-wss` vserver (WebSocket on TLS, with a
//! certificate of a test CA the browser is told to accept) to a real Kamailio registrar
//! (`registrar` + `usrloc` with `use_path`, `rr`, stateless forwarding, over UDP). A caller
//! then asks the registrar for the user: its INVITE (a WebRTC offer: ICE, DTLS fingerprint,
//! SAVPF, which the browser requires) reaches the browser along fulcrum's Path, is answered,
//! the ACK and a BYE from the caller reach it along the dialog's Record-Route; a second call
//! is hung up by the browser, and its BYE reaches the caller.
//!
//! Without chromium, node, the npm packages or Kamailio the test says why and passes, unless
//! `FULCRUM_REQUIRE_BROWSER=1` / `FULCRUM_REQUIRE_KAMAILIO=1` (CI) make that a failure.

mod common;

use common::sipp::{Scratch, Transport, spawn_listening};
use common::*;
use fulcrum::peer::{first_header as first, header_values as values};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Registrar and stateless proxy: REGISTERs saved with their Path; an INVITE record-routed
/// and sent to the user's binding (along its Path); in-dialog requests loose-routed.
fn registrar_cfg(port: u16) -> String {
    kamailio_cfg(
        port,
        &["kex", "pv", "sl", "rr", "siputils", "usrloc", "registrar"],
        "modparam(\"usrloc\", \"db_mode\", 0)\n\
         modparam(\"registrar\", \"use_path\", 1)\nmodparam(\"registrar\", \"path_mode\", 0)\n",
        "if (has_totag()) { if (loose_route()) { forward(); exit; } sl_send_reply(\"404\", \"No Route\"); exit; }\n\
         if (method == \"REGISTER\") { if (!save(\"location\")) { sl_reply_error(); } exit; }\n\
         if (method == \"INVITE\") { record_route(); if (!lookup(\"location\")) { sl_send_reply(\"404\", \"Not Found\"); exit; } forward(); exit; }\n\
         if (method == \"ACK\") { exit; }\n\
         sl_send_reply(\"404\", \"Not Here\"); exit;",
    )
}

/// A WebRTC-shaped offer: the browser refuses plain RTP/AVP.
const OFFER: &str = "v=0\r\no=- 4611731400430051336 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\na=group:BUNDLE 0\r\na=msid-semantic: WMS\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\nc=IN IP4 0.0.0.0\r\na=rtcp:9 IN IP4 0.0.0.0\r\na=candidate:1 1 udp 2122260223 127.0.0.1 40000 typ host\r\na=ice-ufrag:fcTe\r\na=ice-pwd:fulcrumtestfulcrumtest12\r\na=ice-options:trickle\r\na=fingerprint:sha-256 7B:8B:F0:65:5F:78:E2:51:3B:AC:6F:F3:3F:46:1B:35:DC:B8:5F:64:1A:24:C2:43:F0:A1:58:D0:A1:2C:19:08\r\na=setup:actpass\r\na=mid:0\r\na=sendrecv\r\na=rtcp-mux\r\na=rtpmap:111 opus/48000/2\r\n";

struct Caller {
    sock: UdpSocket,
    me: SocketAddr,
    registrar: SocketAddr,
}

/// The URI inside `<...>`.
fn uri_of(v: &str) -> String {
    v.split_once('<')
        .and_then(|(_, r)| r.split_once('>'))
        .map_or_else(|| v.to_owned(), |(u, _)| u.to_owned())
}

impl Caller {
    fn recv(&self) -> Option<String> {
        let mut buf = vec![0u8; 65_536];
        let (n, _) = recv_from_retrying(&self.sock, &mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    /// The final answer to the request of `call_id` and `cseq`, skipping provisional ones.
    fn final_answer(&self, call_id: &str, cseq: &str) -> String {
        wait_for("a final answer", Duration::from_secs(20), || {
            let m = self.recv()?;
            let code: u16 = m.get(8..11)?.parse().ok()?;
            (m.starts_with("SIP/2.0 ")
                && code >= 200
                && first(&m, "Call-ID") == call_id
                && first(&m, "CSeq") == cseq)
                .then_some(m)
        })
    }

    fn invite(&self, call_id: &str) -> String {
        let me = self.me;
        format!(
            "INVITE sip:alice@example.com SIP/2.0\r\nVia: SIP/2.0/UDP {me};branch=z9hG4bK{call_id};rport\r\nMax-Forwards: 70\r\nFrom: <sip:bob@example.com>;tag=bob-{call_id}\r\nTo: <sip:alice@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContact: <sip:bob@{me}>\r\nContent-Type: application/sdp\r\nContent-Length: {}\r\n\r\n{OFFER}",
            OFFER.len()
        )
    }

    /// A request in the dialog the 200 `ok` set up: to its Contact, along the reverse of
    /// its Record-Route, through the registrar.
    fn in_dialog(&self, ok: &str, method: &str, cseq: u32, branch: &str) -> String {
        let me = self.me;
        let call_id = first(ok, "Call-ID");
        let target = uri_of(&first(ok, "Contact"));
        let routes: Vec<String> = values(ok, "Record-Route").into_iter().rev().collect();
        format!(
            "{method} {target} SIP/2.0\r\nVia: SIP/2.0/UDP {me};branch=z9hG4bK{branch};rport\r\nMax-Forwards: 70\r\nRoute: {}\r\nFrom: {}\r\nTo: {}\r\nCall-ID: {call_id}\r\nCSeq: {cseq} {method}\r\nContent-Length: 0\r\n\r\n",
            routes.join(", "),
            first(ok, "From"),
            first(ok, "To"),
        )
    }

    fn send(&self, msg: &str) {
        self.sock
            .send_to(msg.as_bytes(), self.registrar)
            .expect("send");
    }
}

/// The next line of `lines` that starts with `event: {what}`, within `limit`.
fn expect_event(lines: &mpsc::Receiver<String>, what: &str, limit: Duration) -> String {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = lines
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no `event: {what}` from the browser"));
        println!("browser: {line}");
        if line.starts_with(&format!("event: {what}")) {
            return line;
        }
        assert!(
            !line.contains("failed") && !line.contains("pageerror"),
            "{line}"
        );
    }
}

#[test]
fn jssip_in_chromium_registers_over_websocket_and_takes_calls_from_a_kamailio_registrar() {
    let Some((chromium, dir)) = browser(
        &["playwright-core", "jssip", "esbuild"],
        "the JsSIP browser test",
    ) else {
        return;
    };
    if !kamailio_available() {
        return;
    }
    let scratch = Scratch::new("ws-browser");
    let (_kamailio, port) = spawn_listening("registrar", Transport::Udp, |port| {
        let cfg = scratch.path(&format!("registrar-{port}.cfg"));
        std::fs::write(&cfg, registrar_cfg(port)).expect("write kamailio config");
        let mut c = Command::new("kamailio");
        c.arg("-f").arg(cfg).args(["-DD", "-E"]);
        c
    });
    let registrar = SocketAddr::from(([127, 0, 0, 1], port));
    let file = ConfigFile::new("ws-browser", "");
    let cert = tls::Ca::new("fulcrum test CA").issue_for(&file, "wss", &["127.0.0.1"], "127.0.0.1");
    file.write(&format!(
        "admin: {{ listen: null }}\nservices:\n  - {{ name: r, address: \"{registrar}\", protocol: sip-udp }}\nvservers:\n  - {{ name: ws, protocol: sip-wss, bind: 127.0.0.1:0, tls: {{ cert: {}, key: {} }}, services: [r] }}\n",
        cert.cert_path.display(),
        cert.key_path.display()
    ));
    let cfg = fulcrum::config::load(&file.path).expect("config loads");
    let fulcrum = fulcrum::proxy::Runtime::start(&cfg).expect("start");
    let ws = bound(&fulcrum, "ws");

    let mut node = Command::new("node")
        .arg(dir.join("jssip.mjs"))
        .env("FULCRUM_WS", format!("wss://{ws}"))
        .env("FULCRUM_CHROMIUM", &chromium)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run node");
    let mut stdin = node.stdin.take().expect("stdin");
    let stdout = node.stdout.take().expect("stdout");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let long = Duration::from_secs(30);
    expect_event(&lines, "registered", long);

    let sock = UdpSocket::bind("127.0.0.1:0").expect("bind caller");
    sock.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let caller = Caller {
        me: sock.local_addr().expect("addr"),
        sock,
        registrar,
    };

    // Call 1: answered by the browser, hung up by the caller.
    caller.send(&caller.invite("call-1"));
    expect_event(&lines, "incoming", long);
    let ok = caller.final_answer("call-1", "1 INVITE");
    assert!(ok.starts_with("SIP/2.0 200"), "{ok}");
    assert!(ok.contains("a=fingerprint:"), "a WebRTC answer: {ok}");
    caller.send(&caller.in_dialog(&ok, "ACK", 1, "ack-1"));
    expect_event(&lines, "confirmed", long);
    caller.send(&caller.in_dialog(&ok, "BYE", 2, "bye-1"));
    let bye_ok = caller.final_answer("call-1", "2 BYE");
    assert!(bye_ok.starts_with("SIP/2.0 200"), "{bye_ok}");
    expect_event(&lines, "ended remote", long);

    // Call 2: answered, then hung up by the browser; its BYE reaches the caller.
    caller.send(&caller.invite("call-2"));
    expect_event(&lines, "incoming", long);
    let ok = caller.final_answer("call-2", "1 INVITE");
    assert!(ok.starts_with("SIP/2.0 200"), "{ok}");
    caller.send(&caller.in_dialog(&ok, "ACK", 1, "ack-2"));
    expect_event(&lines, "confirmed", long);
    writeln!(stdin, "hangup").expect("command");
    let bye = wait_for("the browser's BYE", long, || {
        let m = caller.recv()?;
        m.starts_with("BYE ").then_some(m)
    });
    assert_eq!(first(&bye, "Call-ID"), "call-2");
    // Answer it back along its Via.
    let mut answer = String::from("SIP/2.0 200 OK\r\n");
    for v in values(&bye, "Via") {
        answer.push_str(&format!("Via: {v}\r\n"));
    }
    for h in ["From", "To", "Call-ID", "CSeq"] {
        answer.push_str(&format!("{h}: {}\r\n", first(&bye, h)));
    }
    answer.push_str("Content-Length: 0\r\n\r\n");
    caller.send(&answer);
    expect_event(&lines, "ended local", long);
    writeln!(stdin, "quit").expect("command");
    drop(stdin);
    let exited = wait_until(Duration::from_secs(10), || {
        node.try_wait().ok().flatten().is_some()
    });
    if !exited {
        let _ = node.kill();
        let _ = node.wait();
    }
}
