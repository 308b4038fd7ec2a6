//! SIP over WebSocket (RFC 7118) through a `sip-ws` vserver, with tokio-tungstenite as the
//! browser: the upgrade (the `sip` subprotocol, `allowed_origins`), a REGISTER carried as one
//! WebSocket message (no Content-Length) to a UDP registrar and its 200 back, the call the
//! registrar sends along fulcrum's Path reaching the WebSocket, double record-routed with
//! `;transport=ws`; refusals (wrong subprotocol 400, bad Origin 403) and an oversize message
//! (the connection closes, nothing else is disturbed); the edges: the subprotocol answered
//! as the client spelt it, a Content-Length past the message's end (a request 400, a response
//! dropped), and the close codes of a failed connection (1002, 1007, 1009). Reloads: a
//! WebSocket client's dialog keeps its service (strict UAS: a BYE elsewhere is answered 481)
//! and its load count across a reload that moves every member's index, also while calls go
//! on during hundreds of reloads.

mod common;

use common::strict_uas::StrictUas;
use common::*;
use fulcrum::ops::Ops;
use futures_util::{SinkExt, StreamExt};
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;

type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

/// Connect to `vs` offering `protocol`, from a page of `origin`.
async fn connect(
    vs: SocketAddr,
    protocol: &str,
    origin: Option<&str>,
) -> Result<(Ws, Option<String>), tokio_tungstenite::tungstenite::Error> {
    let mut req = format!("ws://{vs}/").into_client_request()?;
    req.headers_mut().insert(
        "sec-websocket-protocol",
        HeaderValue::from_str(protocol).expect("header"),
    );
    if let Some(o) = origin {
        req.headers_mut()
            .insert("origin", HeaderValue::from_str(o).expect("header"));
    }
    let tcp = tokio::net::TcpStream::connect(vs).await.expect("connect");
    // As browsers do: a request sent right after another (a BYE after its ACK) is not held
    // back until the first is acknowledged.
    tcp.set_nodelay(true).expect("nodelay");
    let (ws, resp) = tokio_tungstenite::client_async(req, tcp).await?;
    let agreed = resp
        .headers()
        .get("sec-websocket-protocol")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    Ok((ws, agreed))
}

/// The next SIP message on `ws` (pings are answered by the library), 3 s at most.
async fn next_sip(ws: &mut Ws) -> Option<String> {
    loop {
        match tokio::time::timeout(Duration::from_secs(3), ws.next()).await {
            Ok(Some(Ok(Message::Text(t)))) => return Some(t.to_string()),
            Ok(Some(Ok(Message::Binary(b)))) => {
                return Some(String::from_utf8_lossy(&b).into_owned());
            }
            Ok(Some(Ok(_))) => continue,
            _ => return None,
        }
    }
}

/// Whether fulcrum closes `ws` within 3 s: a close frame, the end of the stream or a broken
/// one (not merely silence).
async fn closed(ws: &mut Ws) -> bool {
    loop {
        match tokio::time::timeout(Duration::from_secs(3), ws.next()).await {
            Ok(None | Some(Err(_)) | Some(Ok(Message::Close(_)))) => return true,
            Ok(Some(Ok(_))) => continue,
            Err(_) => return false,
        }
    }
}

/// The code of the Close frame fulcrum fails `ws` with, within 3 s (`None`: closed without
/// one, or not closed).
async fn close_code(ws: &mut Ws) -> Option<u16> {
    loop {
        match tokio::time::timeout(Duration::from_secs(3), ws.next()).await {
            Ok(Some(Ok(Message::Close(frame)))) => return frame.map(|f| u16::from(f.code)),
            Ok(Some(Ok(_))) => continue,
            _ => return None,
        }
    }
}

fn vserver_shared(
    rt: &fulcrum::proxy::Runtime,
    name: &str,
) -> std::sync::Arc<fulcrum::proxy::SipStreamShared> {
    match rt
        .vserver(name)
        .expect("vserver")
        .path::<fulcrum::proxy::SipStreamPath>()
    {
        Some(p) => std::sync::Arc::clone(p.shared()),
        None => panic!("not a SIP stream vserver"),
    }
}

fn recv_text(s: &UdpSocket) -> Option<(String, SocketAddr)> {
    let mut buf = vec![0u8; 65_536];
    let (n, from) = recv_from_retrying(s, &mut buf).ok()?;
    Some((String::from_utf8_lossy(&buf[..n]).into_owned(), from))
}

fn header<'a>(msg: &'a str, name: &str) -> Vec<&'a str> {
    msg.lines()
        .filter_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
        .collect()
}

/// A 200 to `req` as the registrar sends it: every Via, From, To with a tag, Call-ID, CSeq.
fn ok_to(req: &str) -> String {
    let mut out = String::from("SIP/2.0 200 OK\r\n");
    for v in header(req, "Via") {
        out.push_str(&format!("Via: {v}\r\n"));
    }
    out.push_str(&format!("From: {}\r\n", header(req, "From")[0]));
    out.push_str(&format!("To: {};tag=reg1\r\n", header(req, "To")[0]));
    out.push_str(&format!("Call-ID: {}\r\n", header(req, "Call-ID")[0]));
    out.push_str(&format!("CSeq: {}\r\n", header(req, "CSeq")[0]));
    out.push_str("Content-Length: 0\r\n\r\n");
    out
}

/// A registrar played by a UDP socket, and fulcrum with sip-ws vserver `v` in front of it
/// (and `more` vservers over the same service `r`).
fn lab(more: &str) -> (UdpSocket, SocketAddr, fulcrum::proxy::Runtime) {
    let registrar = UdpSocket::bind("127.0.0.1:0").expect("bind");
    registrar
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    let reg = registrar.local_addr().expect("addr");
    let fulcrum = start(&format!(
        "services:\n  - {{ name: r, address: {reg}, protocol: sip-udp }}\nvservers:\n  - {{ name: v, protocol: sip-ws, bind: 127.0.0.1:0, failover: off, services: [r] }}\n{more}"
    ));
    (registrar, reg, fulcrum)
}

const REGISTER: &str = "REGISTER sip:example.com SIP/2.0\r\nVia: SIP/2.0/WS df7jal23ls0d.invalid;branch=z9hG4bKws1\r\nMax-Forwards: 70\r\nFrom: <sip:alice@example.com>;tag=w1\r\nTo: <sip:alice@example.com>\r\nCall-ID: ws-reg\r\nCSeq: 1 REGISTER\r\nSupported: path, outbound\r\nContact: <sip:alice@df7jal23ls0d.invalid;transport=ws>\r\nExpires: 600\r\n\r\n";

#[test]
fn a_browser_registers_over_websocket_and_is_called_along_the_path() {
    let (registrar, reg, fulcrum) = lab(
        "  - { name: o, protocol: sip-ws, bind: 127.0.0.1:0, allowed_origins: [\"https://phone.example.com\"], services: [r] }\n",
    );
    let (vs, only) = (bound(&fulcrum, "v"), bound(&fulcrum, "o"));
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    client.block_on(async {
        let (mut ws, agreed) = connect(vs, "sip", Some("https://any.example"))
            .await
            .expect("upgraded");
        assert_eq!(agreed.as_deref(), Some("sip"));
        // One WebSocket message, one SIP message: no Content-Length needed.
        ws.send(Message::text(REGISTER)).await.expect("send");
        let (got, leg) = recv_text(&registrar).expect("the REGISTER reaches the registrar");
        assert!(got.starts_with("REGISTER sip:example.com SIP/2.0"), "{got}");
        let vias = header(&got, "Via");
        assert!(vias[0].starts_with("SIP/2.0/UDP "), "fulcrum's UDP leg: {vias:?}");
        assert!(
            vias[1].starts_with("SIP/2.0/WS df7jal23ls0d.invalid;branch=z9hG4bKws1;received=127.0.0.1"),
            "{vias:?}"
        );
        let path = header(&got, "Path")[0].to_owned();
        assert!(path.contains(";lr;fc-flow="), "{path}");

        // The registrar's 200 comes back on the WebSocket.
        registrar
            .send_to(ok_to(&got).as_bytes(), leg)
            .expect("send 200");
        let ok = next_sip(&mut ws).await.expect("the 200 reaches the browser");
        assert!(ok.starts_with("SIP/2.0 200 OK"), "{ok}");
        assert_eq!(header(&ok, "Via").len(), 1, "fulcrum's Via removed: {ok}");

        // A call along the Path reaches the browser, whose Contact is `.invalid`.
        let invite = format!(
            "INVITE sip:alice@df7jal23ls0d.invalid;transport=ws SIP/2.0\r\nVia: SIP/2.0/UDP {reg};branch=z9hG4bKcall1\r\nRoute: {path}\r\nMax-Forwards: 70\r\nFrom: <sip:bob@example.com>;tag=b1\r\nTo: <sip:alice@example.com>\r\nCall-ID: ws-call\r\nCSeq: 1 INVITE\r\nContact: <sip:bob@{reg}>\r\nContent-Length: 0\r\n\r\n"
        );
        registrar.send_to(invite.as_bytes(), leg).expect("send");
        let call = next_sip(&mut ws).await.expect("the INVITE reaches the browser");
        assert!(call.starts_with("INVITE sip:alice@df7jal23ls0d.invalid"), "{call}");
        let rr = header(&call, "Record-Route");
        assert!(
            rr.iter().any(|r| r.contains(";transport=ws;lr")),
            "the client leg's entry names WebSocket: {rr:?}"
        );
        assert!(call.contains("Via: SIP/2.0/WS "), "the client leg's Via: {call}");

        // Too large for a message (64 KiB): the connection closes; another client is served.
        let big = format!("{REGISTER}{}", "x".repeat(70_000));
        let _ = ws.send(Message::text(big)).await;
        assert!(closed(&mut ws).await, "closed");
        let (mut again, _) = connect(vs, "sip", None).await.expect("upgraded");
        again
            .send(Message::text(REGISTER.replace("ws-reg", "ws-reg2")))
            .await
            .expect("send");
        let (got, _) = recv_text(&registrar).expect("the next client is served");
        assert!(got.contains("Call-ID: ws-reg2"), "{got}");

        // Refusals at the upgrade.
        let e = connect(vs, "chat", None).await.expect_err("refused");
        assert!(e.to_string().contains("400"), "{e}");
        let e = connect(only, "sip", Some("https://evil.example"))
            .await
            .expect_err("refused");
        assert!(e.to_string().contains("403"), "{e}");
        connect(only, "sip", Some("https://phone.example.com"))
            .await
            .expect("an allowed origin is upgraded");
    });
    drop(fulcrum);
}

/// A SIP message sent as a fragmented WebSocket message (a text frame and a continuation) is
/// one message; a connection that never completes its upgrade is closed, and neither
/// disturbs a client that upgrades meanwhile.
#[test]
fn fragments_make_one_message_and_a_stalled_upgrade_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
    let (registrar, _, fulcrum) = lab("");
    let vs = bound(&fulcrum, "v");
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    client.block_on(async {
        // A connection that sends half an upgrade request and stops.
        let mut stalled = tokio::net::TcpStream::connect(vs).await.expect("connect");
        stalled
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("send");
        // Meanwhile a browser upgrades and sends a REGISTER in two fragments.
        let (mut ws, _) = connect(vs, "sip", None).await.expect("upgraded");
        let text = REGISTER.replace("ws-reg", "ws-frag");
        let (a, b) = text.split_at(text.len() / 2);
        ws.send(Message::Frame(Frame::message(
            a.as_bytes().to_vec(),
            OpCode::Data(Data::Text),
            false,
        )))
        .await
        .expect("first fragment");
        ws.send(Message::Frame(Frame::message(
            b.as_bytes().to_vec(),
            OpCode::Data(Data::Continue),
            true,
        )))
        .await
        .expect("last fragment");
        let (got, _) = recv_text(&registrar).expect("the REGISTER reaches the registrar");
        assert!(got.contains("Call-ID: ws-frag"), "{got}");
        // The CRLF keep-alive browser stacks send (SIP.js: two CRLFs) gets one CRLF back.
        ws.send(Message::text("\r\n\r\n"))
            .await
            .expect("keep-alive");
        let pong = tokio::time::timeout(Duration::from_secs(3), ws.next()).await;
        assert!(
            matches!(&pong, Ok(Some(Ok(Message::Text(t)))) if t.as_str() == "\r\n"),
            "{pong:?}"
        );
        assert!(got.contains("Expires: 600"), "whole: {got}");
        // The stalled upgrade is closed within its 10 s.
        let mut buf = [0u8; 512];
        let closed = tokio::time::timeout(Duration::from_secs(12), async {
            loop {
                match stalled.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => continue,
                }
            }
        })
        .await;
        assert!(
            closed.is_ok(),
            "the stalled upgrade is closed within its 10 s"
        );
    });
}

/// The edges of RFC 7118 and RFC 6455: the `sip` subprotocol answered as the client spelt it;
/// a SIP message whose Content-Length promises more than its WebSocket message holds (RFC 3261
/// §18.3, as for a datagram): a request answered 400, a response dropped and counted, the
/// connection kept; a client breaking WebSocket itself failed with the close code that says
/// why (RFC 6455 §7.4.1).
#[test]
fn websocket_edges_subprotocol_case_short_bodies_and_close_codes() {
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
    let (registrar, _, fulcrum) = lab("");
    let vs = bound(&fulcrum, "v");
    let shared = vserver_shared(&fulcrum, "v");
    let counters = &shared.core().counters;
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    client.block_on(async {
        // A client that offered `SIP` hears `SIP` (its library checks the answer is one of
        // its offers, RFC 6455 §4.1), and is served.
        let (mut ws, agreed) = connect(vs, "chat, SIP", None).await.expect("upgraded");
        assert_eq!(agreed.as_deref(), Some("SIP"));

        let short = "MESSAGE sip:bob@example.com SIP/2.0\r\nVia: SIP/2.0/WS df7jal23ls0d.invalid;branch=z9hG4bKcl1\r\nMax-Forwards: 70\r\nFrom: <sip:alice@example.com>;tag=c1\r\nTo: <sip:bob@example.com>\r\nCall-ID: ws-short\r\nCSeq: 1 MESSAGE\r\nContent-Type: text/plain\r\nContent-Length: 50\r\n\r\nhello";
        ws.send(Message::text(short)).await.expect("send");
        let answer = next_sip(&mut ws).await.expect("the short request is answered");
        assert!(answer.starts_with("SIP/2.0 400 "), "{answer}");
        assert!(answer.contains("Call-ID: ws-short"), "{answer}");
        assert!(answer.contains(";received=127.0.0.1"), "{answer}");
        let malformed = counters.malformed.load(Ordering::Relaxed);
        let short_answer = "SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP 127.0.0.1:5071;branch=z9hG4bK-fc-0000000000000001\r\nFrom: <sip:bob@example.com>;tag=b1\r\nTo: <sip:alice@example.com>;tag=a1\r\nCall-ID: ws-short-answer\r\nCSeq: 1 MESSAGE\r\nContent-Length: 50\r\n\r\nhi";
        ws.send(Message::text(short_answer)).await.expect("send");
        // The connection carries on, and the registrar saw neither.
        ws.send(Message::text(REGISTER.replace("ws-reg", "ws-after")))
            .await
            .expect("send");
        let (got, _) = recv_text(&registrar).expect("the next request is forwarded");
        assert!(got.contains("Call-ID: ws-after"), "{got}");
        assert_eq!(counters.malformed.load(Ordering::Relaxed), malformed + 1);
        assert_eq!(counters.replies_400.load(Ordering::Relaxed), 1);

        // Counted inside: a client dropped at the end of this block, without a close
        // handshake, is one more.
        let framing_errors = shared.counters.framing_errors.load(Ordering::Relaxed);
        // A text frame that is not UTF-8: 1007.
        let (mut ws, _) = connect(vs, "sip", None).await.expect("upgraded");
        ws.send(Message::Frame(Frame::message(
            b"REGISTER \xff\xfe".to_vec(),
            OpCode::Data(Data::Text),
            true,
        )))
        .await
        .expect("send");
        assert_eq!(close_code(&mut ws).await, Some(1007));
        // A continuation frame with nothing to continue: a protocol error, 1002.
        let (mut ws, _) = connect(vs, "sip", None).await.expect("upgraded");
        ws.send(Message::Frame(Frame::message(
            b"REGISTER".to_vec(),
            OpCode::Data(Data::Continue),
            true,
        )))
        .await
        .expect("send");
        assert_eq!(close_code(&mut ws).await, Some(1002));
        // A message past 64 KiB: 1009, read to its end rather than reset, so the close
        // frame is not lost.
        let (mut ws, _) = connect(vs, "sip", None).await.expect("upgraded");
        let _ = ws
            .send(Message::text(format!("{REGISTER}{}", "x".repeat(200_000))))
            .await;
        assert_eq!(close_code(&mut ws).await, Some(1009));
        assert_eq!(
            shared.counters.framing_errors.load(Ordering::Relaxed),
            framing_errors + 3
        );
    });
}

/// A browser's call over a `sip-ws` vserver: the INVITE, then the ACK and BYE of the dialog
/// it set up, each request and its answer as one WebSocket message.
///
/// The in-dialog requests carry no Route: fulcrum's Record-Route names the dialog's service
/// (`fc-svc`) and would take them there whatever fulcrum's dialog table says; without it only
/// the dialog's pin does, and the pin (with the load it counts) is what a reload must hand
/// over.
struct Caller {
    ws: Ws,
    /// Prefix of this caller's Call-IDs and tags.
    name: String,
    calls: u32,
}

/// The dialog a [`Caller`] set up: what its in-dialog requests need.
struct Dialog {
    call_id: String,
    from_tag: String,
    /// The To header of the 200, with the service's tag.
    to: String,
    /// The service's Contact URI (the Request-URI of the in-dialog requests).
    target: String,
}

impl Caller {
    async fn connect(vs: SocketAddr, name: &str) -> Caller {
        let (ws, _) = connect(vs, "sip", None).await.expect("upgraded");
        Caller {
            ws,
            name: name.to_owned(),
            calls: 0,
        }
    }

    fn request(&self, method: &str, uri: &str, d: &Dialog, to: &str, cseq: u32) -> String {
        format!(
            "{method} {uri} SIP/2.0\r\nVia: SIP/2.0/WS {name}.invalid;branch=z9hG4bK{name}-{call}-{method}\r\nMax-Forwards: 70\r\nFrom: <sip:{name}@example.com>;tag={tag}\r\nTo: {to}\r\nCall-ID: {call}\r\nCSeq: {cseq} {method}\r\nContact: <sip:{name}@{name}.invalid;transport=ws>\r\n\r\n",
            name = self.name,
            call = d.call_id,
            tag = d.from_tag,
        )
    }

    /// The final answer to this caller's request `method` (provisional answers skipped):
    /// its status and text, or why there is none.
    async fn answer(&mut self, method: &str) -> Result<(u16, String), String> {
        loop {
            let Some(m) = next_sip(&mut self.ws).await else {
                return Err(format!("{}: no final answer to {method}", self.name));
            };
            let status = fulcrum::sip::scan(m.as_bytes())
                .ok()
                .and_then(|s| s.status_code());
            let cseq = header(&m, "CSeq")
                .first()
                .copied()
                .unwrap_or_default()
                .to_owned();
            match status {
                Some(s) if s >= 200 && cseq.ends_with(method) => return Ok((s, m)),
                Some(_) => continue,
                None => return Err(format!("{}: a request came: {m}", self.name)),
            }
        }
    }

    /// An INVITE outside any dialog, answered 200, and its ACK.
    async fn invite(&mut self) -> Result<Dialog, String> {
        self.calls += 1;
        let mut d = Dialog {
            call_id: format!("{}-{}", self.name, self.calls),
            from_tag: format!("{}t{}", self.name, self.calls),
            to: "<sip:svc@example.com>".to_owned(),
            target: "sip:svc@example.com".to_owned(),
        };
        let invite = self.request("INVITE", &d.target, &d, &d.to, 1);
        self.ws
            .send(Message::text(invite))
            .await
            .map_err(|e| e.to_string())?;
        let (status, ok) = self.answer("INVITE").await?;
        if status != 200 {
            return Err(format!("{}: INVITE answered {status}", d.call_id));
        }
        d.to = header(&ok, "To")[0].to_owned();
        let contact = header(&ok, "Contact")[0];
        d.target = contact
            .trim_start_matches('<')
            .split('>')
            .next()
            .unwrap_or(contact)
            .to_owned();
        let ack = self.request("ACK", &d.target, &d, &d.to, 1);
        self.ws
            .send(Message::text(ack))
            .await
            .map_err(|e| e.to_string())?;
        Ok(d)
    }

    /// The BYE of dialog `d`: the status it is answered with.
    async fn bye(&mut self, d: &Dialog) -> Result<u16, String> {
        let bye = self.request("BYE", &d.target, d, &d.to, 2);
        self.ws
            .send(Message::text(bye))
            .await
            .map_err(|e| e.to_string())?;
        Ok(self.answer("BYE").await?.0)
    }
}

/// A sip-ws vserver `v` over the strict UDP services `uas` named by `order` (indices into
/// `uas`), round robin, with the admin API off: the config a reload test rewrites.
fn ws_over(uas: &[StrictUas], order: &[usize]) -> String {
    let mut y = String::from("admin:\n  listen: null\nservices:\n");
    for u in uas {
        y += &format!(
            "  - {{ name: {}, address: \"{}\", protocol: sip-udp }}\n",
            u.name, u.addr
        );
    }
    let names: Vec<&str> = order.iter().map(|&i| uas[i].name.as_str()).collect();
    y += &format!(
        "vservers:\n  - {{ name: v, protocol: sip-ws, bind: 127.0.0.1:0, method: round_robin, services: [{}] }}\n",
        names.join(", ")
    );
    y
}

/// Reload the config in `file` as `yaml`; the reload must rebuild `v`.
fn reload_to(ops: &Ops, file: &ConfigFile, yaml: &str) {
    file.write(yaml);
    let changes = ops
        .reload()
        .unwrap_or_else(|e| panic!("reload: {e}\n{yaml}"));
    assert!(
        changes.iter().any(|c| c == "vservers.v rebuilt"),
        "{changes:?}"
    );
}

/// The load `/status` shows on each service of `v` (name, active), in the vserver's order.
fn loads(ops: &Ops) -> Vec<(String, u64)> {
    let status = fulcrum::admin::router::status(ops);
    status["vservers"][0]["services"]
        .as_array()
        .map(|s| {
            s.iter()
                .map(|s| {
                    (
                        s["name"].as_str().unwrap_or("?").to_owned(),
                        s["active"].as_u64().unwrap_or(u64::MAX),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn start_ops(file: &ConfigFile) -> std::sync::Arc<Ops> {
    let cfg = fulcrum::config::load(&file.path).expect("valid");
    Ops::start(cfg, Some(file.path.clone())).expect("start")
}

fn ws_addr(ops: &Ops) -> SocketAddr {
    ops.with_vservers(|vs, _| vs[0].bound[0]).expect("running")
}

/// A WebSocket client's dialog across a reload that adds a service in front and reorders the
/// others (every member's index moves): its BYE, sent on the same WebSocket after the reload,
/// reaches the service that set the dialog up (a strict UAS, which answers 481 to a dialog
/// it does not have) and is answered 200; the dialog's load is counted on that service
/// across the reload and nowhere once it ended, and nothing is counted after the client is
/// gone.
#[test]
fn a_websocket_dialog_keeps_its_service_and_its_count_across_a_reload() {
    let uas: Vec<StrictUas> = ["s0", "s1", "s2"]
        .iter()
        .map(|n| StrictUas::udp(n))
        .collect();
    let file = ConfigFile::new("ws-reload", &ws_over(&uas, &[1, 2]));
    let ops = start_ops(&file);
    let vs = ws_addr(&ops);
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    client.block_on(async {
        let mut alice = Caller::connect(vs, "alice").await;
        // Round robin: two calls, one on each service.
        let calls = [
            alice.invite().await.expect("call 1"),
            alice.invite().await.expect("call 2"),
        ];
        let owner = |d: &Dialog| {
            let at: Vec<&str> = uas
                .iter()
                .filter(|u| !u.methods_of(&d.call_id).is_empty())
                .map(|u| u.name.as_str())
                .collect();
            assert_eq!(at.len(), 1, "{} reached {at:?}", d.call_id);
            at[0].to_owned()
        };
        let owners: Vec<String> = calls.iter().map(owner).collect();
        assert_eq!(
            loads(&ops),
            [("s1".to_owned(), 1), ("s2".to_owned(), 1)],
            "{owners:?}"
        );

        // s0 added, and the order changed: s1 moves from 0 to 2, s2 from 1 to 0.
        reload_to(&ops, &file, &ws_over(&uas, &[2, 0, 1]));
        assert_eq!(
            loads(&ops),
            [
                ("s2".to_owned(), 1),
                ("s0".to_owned(), 0),
                ("s1".to_owned(), 1)
            ],
            "the dialogs are still counted, on their services"
        );
        for (d, o) in calls.iter().zip(&owners) {
            assert_eq!(alice.bye(d).await, Ok(200), "{}", d.call_id);
            assert_eq!(owner(d), *o, "the BYE of {} stayed on {o}", d.call_id);
        }
        for u in &uas {
            let c = u.counts();
            assert_eq!((c.r481, c.stray_acks), (0, 0), "{}: {c:?}", u.name);
        }
        assert_eq!(
            loads(&ops).iter().map(|(_, a)| a).sum::<u64>(),
            0,
            "the ended dialogs are counted nowhere"
        );
        // A new call after the reload is counted, and uncounted by its BYE, too.
        let d = alice.invite().await.expect("call 3");
        assert_eq!(loads(&ops).iter().map(|(_, a)| a).sum::<u64>(), 1);
        assert_eq!(alice.bye(&d).await, Ok(200));
        drop(alice);
    });
    assert!(
        wait_until(Duration::from_secs(3), || loads(&ops)
            .iter()
            .all(|(_, a)| *a == 0)),
        "nothing is counted once the client is gone: {:?}",
        loads(&ops)
    );
    ops.shutdown();
}

/// WebSocket calls while the config is reloaded back and forth (every member's index moving
/// each time): a reload that swapped the core while a WebSocket client's message was still
/// using the old one, without waiting for it, would lose what that message did to the
/// dialog table (a pin set, or ended, in the old table after it was carried over). Every
/// call completes, each on one service (no 481, no stray ACK at the strict services), and
/// once the clients are gone no load is left counted.
#[test]
fn websocket_calls_during_reloads_keep_their_services_and_leave_no_load() {
    const CALLERS: usize = 4;
    /// Reloads, one after another, for this long (each takes a few milliseconds).
    const RELOADING: Duration = Duration::from_secs(3);
    let uas: Vec<StrictUas> = ["s0", "s1", "s2"]
        .iter()
        .map(|n| StrictUas::udp(n))
        .collect();
    let orders: [&[usize]; 2] = [&[0, 1, 2], &[2, 0, 1]];
    let file = ConfigFile::new("ws-reloads", &ws_over(&uas, orders[0]));
    let ops = start_ops(&file);
    let vs = ws_addr(&ops);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let callers = std::thread::spawn({
        let stop = std::sync::Arc::clone(&stop);
        move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let tasks: Vec<_> = (0..CALLERS)
                    .map(|i| {
                        let stop = std::sync::Arc::clone(&stop);
                        tokio::spawn(async move {
                            let mut c = Caller::connect(vs, &format!("c{i}")).await;
                            let (mut done, mut failed) = (0u32, Vec::new());
                            while !stop.load(Ordering::Relaxed) {
                                match c.invite().await {
                                    Ok(d) => match c.bye(&d).await {
                                        Ok(200) => done += 1,
                                        other => {
                                            failed.push(format!("{}: BYE {other:?}", d.call_id))
                                        }
                                    },
                                    Err(e) => failed.push(e),
                                }
                                if failed.len() > 10 {
                                    break;
                                }
                            }
                            (done, failed)
                        })
                    })
                    .collect();
                let mut all = (0, Vec::new());
                for t in tasks {
                    let (done, failed) = t.await.expect("caller");
                    all.0 += done;
                    all.1.extend(failed);
                }
                all
            })
        }
    });
    // Calls under way before the first reload.
    assert!(
        wait_until(Duration::from_secs(5), || uas
            .iter()
            .map(|u| u.counts().byes_ok)
            .sum::<u64>()
            >= 20),
        "no calls: {:?}",
        uas.iter().map(StrictUas::counts).collect::<Vec<_>>()
    );
    let began = std::time::Instant::now();
    let mut reloads = 0;
    while began.elapsed() < RELOADING {
        reloads += 1;
        reload_to(&ops, &file, &ws_over(&uas, orders[reloads % 2]));
    }
    let during = uas.iter().map(|u| u.counts().byes_ok).sum::<u64>();
    stop.store(true, Ordering::Relaxed);
    let (done, failed) = callers.join().expect("callers");
    let counts: Vec<_> = uas.iter().map(StrictUas::counts).collect();
    let report = format!(
        "{reloads} reloads in {:?}, {done} calls ({during} ended by the last reload), failed: {failed:?}; per service: {counts:?}",
        began.elapsed()
    );
    // Where the requests of the first failed calls went.
    let seen: Vec<String> = failed
        .iter()
        .take(5)
        .map(|f| {
            let id = f.split(':').next().unwrap_or_default();
            let at: Vec<_> = uas.iter().map(|u| (&u.name, u.methods_of(id))).collect();
            format!("{id}: {at:?}")
        })
        .collect();
    let report = format!("{report}; {seen:?}");
    eprintln!("{report}");
    assert!(failed.is_empty(), "{report}");
    assert!(done >= 100, "too few calls to tell: {report}");
    for c in &counts {
        assert_eq!((c.r481, c.stray_acks), (0, 0), "{report}");
        assert_eq!(c.dialogs, c.byes_ok, "{report}");
    }
    assert!(
        wait_until(Duration::from_secs(3), || loads(&ops)
            .iter()
            .all(|(_, a)| *a == 0)),
        "load left counted: {:?}; {report}",
        loads(&ops)
    );
    ops.shutdown();
}

/// Capture (docs/capture.md) on a sip-ws vserver: the WebSocket payloads on the client's
/// connection (IP protocol 6, the payload as sent, without the Content-Length fulcrum adds
/// for the service) and the UDP leg to the registrar (17), each message on both legs with its
/// addresses, in order of time, read from the HEP packets by the crate's own decoder.
#[test]
fn a_websocket_vservers_messages_are_captured_on_both_legs() {
    use fulcrum::capture::hep::{Decoded, decode};
    let collector = UdpSocket::bind("127.0.0.1:0").expect("bind");
    collector
        .set_read_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    let port = collector.local_addr().expect("addr").port();
    let (registrar, reg, fulcrum) = lab(&format!(
        "capture: {{ hep: {{ address: \"127.0.0.1:{port}\", id: 9 }} }}\n"
    ));
    let vs = bound(&fulcrum, "v");
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (browser, leg, ok) = client.block_on(async {
        let (mut ws, _) = connect(vs, "sip", None).await.expect("upgraded");
        let browser = ws.get_ref().local_addr().expect("addr");
        ws.send(Message::text(REGISTER)).await.expect("send");
        let (got, leg) = recv_text(&registrar).expect("the REGISTER reaches the registrar");
        let ok = ok_to(&got);
        registrar.send_to(ok.as_bytes(), leg).expect("send 200");
        let back = next_sip(&mut ws)
            .await
            .expect("the 200 reaches the browser");
        (browser, leg, back)
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut got: Vec<Decoded> = Vec::new();
    let mut buf = vec![0u8; 65_536];
    while got.len() < 4 && std::time::Instant::now() < deadline {
        if let Ok(n) = collector.recv(&mut buf) {
            got.push(decode(&buf[..n]).expect("HEP3"));
        }
    }
    let time = |d: &Decoded| {
        u64::from(d.time_s.unwrap_or(0)) * 1_000_000 + u64::from(d.time_us.unwrap_or(0))
    };
    got.sort_by_key(time);
    let legs: Vec<(Option<u8>, SocketAddr, SocketAddr, String)> = got
        .iter()
        .map(|d| {
            let a = |ip: Option<std::net::IpAddr>, port: Option<u16>| {
                SocketAddr::new(ip.expect("address"), port.expect("port"))
            };
            let text = String::from_utf8_lossy(d.payload.as_deref().unwrap_or_default());
            let first = text.lines().next().unwrap_or_default().to_owned();
            (
                d.ip_proto,
                a(d.src, d.src_port),
                a(d.dst, d.dst_port),
                first,
            )
        })
        .collect();
    let register = "REGISTER sip:example.com SIP/2.0".to_owned();
    let ok200 = "SIP/2.0 200 OK".to_owned();
    assert_eq!(
        legs,
        vec![
            (Some(6), browser, vs, register.clone()),
            (Some(17), leg, reg, register),
            (Some(17), reg, leg, ok200.clone()),
            (Some(6), vs, browser, ok200),
        ]
    );
    // The client leg's payloads as they crossed the WebSocket: the REGISTER without the
    // Content-Length the UDP leg was given, the 200 as the browser read it.
    assert_eq!(got[0].payload.as_deref(), Some(REGISTER.as_bytes()));
    assert!(
        String::from_utf8_lossy(got[1].payload.as_deref().unwrap_or_default())
            .contains("Content-Length: 0")
    );
    assert_eq!(got[3].payload.as_deref(), Some(ok.as_bytes()));
    for d in &got {
        assert_eq!(d.correlation_id.as_deref(), Some(&b"ws-reg"[..]));
        assert_eq!(d.agent_id, Some(9));
    }
    drop(fulcrum);
}
