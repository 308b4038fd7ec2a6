//! Path and flow tokens over real sockets (docs/sip.md, "Path and flow tokens"): a phone
//! registers through fulcrum with a Contact no one can reach (a NAT's inside address); the
//! registrar, here a socket playing one, finds fulcrum's Path in the REGISTER and sends a call
//! along it, and the call reaches the phone where it registered from: its UDP address, or its
//! TCP connection. A tampered token is answered 403, a connection that is gone 430, and a
//! client cannot use another client's token.

mod common;

use common::sip_tcp::read_message;
use common::*;
use std::io::Write;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

fn register(via: &str, from: SocketAddr, call_id: &str) -> String {
    format!(
        "REGISTER sip:example.com SIP/2.0\r\nVia: SIP/2.0/{via} {from};branch=z9hG4bK{call_id};rport\r\nMax-Forwards: 70\r\nFrom: <sip:alice@example.com>;tag=a1\r\nTo: <sip:alice@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 REGISTER\r\nContact: <sip:alice@10.1.2.3:9>\r\nExpires: 600\r\nContent-Length: 0\r\n\r\n"
    )
}

/// The registrar's call toward the registered phone, along `path` (the Path URI it stored).
fn invite_along(registrar: SocketAddr, path: &str, call_id: &str) -> String {
    format!(
        "INVITE sip:alice@10.1.2.3:9 SIP/2.0\r\nVia: SIP/2.0/UDP {registrar};branch=z9hG4bK{call_id}\r\nRoute: {path}\r\nMax-Forwards: 70\r\nFrom: <sip:bob@example.com>;tag=b1\r\nTo: <sip:alice@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContact: <sip:bob@{registrar}>\r\nContent-Length: 0\r\n\r\n"
    )
}

/// The next datagram on `s` (2 s at most), as text.
fn recv_text(s: &UdpSocket) -> Option<String> {
    let mut buf = vec![0u8; 65_536];
    let (n, _) = recv_from_retrying(s, &mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// The value of the first `name:` header of `msg`.
fn header<'a>(msg: &'a str, name: &str) -> Option<&'a str> {
    msg.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// The Path URI's address (`<sip:ADDR;lr;fc-flow=...>`).
fn path_addr(path: &str) -> SocketAddr {
    let inner = path.trim_start_matches("<sip:");
    let end = inner.find(';').expect("params");
    inner[..end].parse().expect("an address")
}

/// A phone on 127.0.0.2 (another address than the registrar's), and its address.
fn udp_phone() -> (UdpSocket, SocketAddr) {
    let phone = UdpSocket::bind("127.0.0.2:0").expect("bind phone");
    phone
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let me = phone.local_addr().expect("addr");
    (phone, me)
}

fn registrar_socket() -> UdpSocket {
    let s = UdpSocket::bind("127.0.0.1:0").expect("bind registrar");
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    s
}

#[test]
fn a_udp_phone_behind_nat_is_reached_through_its_flow_token() {
    let registrar = registrar_socket();
    let reg = registrar.local_addr().expect("addr");
    let rt = start(&format!(
        "services:\n  - {{ name: r, address: {reg}, protocol: sip-udp }}\nvservers:\n  - {{ name: v, protocol: sip-udp, bind: 127.0.0.1:0, path: always, record_route: true, failover: off, services: [r] }}\n"
    ));
    let vs = bound(&rt, "v");
    let (phone, me) = udp_phone();
    phone
        .send_to(register("UDP", me, "reg-u").as_bytes(), vs)
        .expect("send");
    let got = recv_text(&registrar).expect("the REGISTER reaches the registrar");
    let path = header(&got, "Path").expect("fulcrum's Path").to_owned();
    assert!(path.contains(";lr;fc-flow="), "{path}");
    assert_eq!(path_addr(&path), vs, "the Path names the vserver");

    // The call along the Path reaches the phone at the address it registered from, though
    // its Contact says 10.1.2.3:9.
    registrar
        .send_to(
            invite_along(reg, &path, "call-u").as_bytes(),
            path_addr(&path),
        )
        .expect("send");
    let call = recv_text(&phone).expect("the INVITE reaches the phone");
    assert!(
        call.starts_with("INVITE sip:alice@10.1.2.3:9 SIP/2.0"),
        "{call}"
    );
    assert!(
        header(&call, "Route").is_none(),
        "fulcrum's Route removed: {call}"
    );
    let token = path
        .split("fc-flow=")
        .nth(1)
        .expect("token")
        .trim_end_matches('>');
    let rr = header(&call, "Record-Route").expect("record-routed");
    assert!(rr.contains(token), "the dialog keeps the flow: {rr}");

    // A tampered token: 403 to the registrar, nothing to the phone.
    let last = token.chars().last().expect("digit");
    let forged = path.replace(
        token,
        &format!(
            "{}{}",
            &token[..token.len() - 1],
            if last == '0' { '1' } else { '0' }
        ),
    );
    registrar
        .send_to(invite_along(reg, &forged, "call-f").as_bytes(), vs)
        .expect("send");
    let answer = recv_text(&registrar).expect("an answer");
    assert!(answer.starts_with("SIP/2.0 403 Forbidden"), "{answer}");
    assert!(recv_text(&phone).is_none(), "nothing reaches the phone");

    // Another client using the phone's token: its request goes to the services, like any
    // client's, and never to the phone.
    let other = UdpSocket::bind("127.0.0.3:0").expect("bind");
    let mut msg = invite_along(other.local_addr().expect("addr"), &path, "call-o");
    msg = msg
        .replace("INVITE sip:", "MESSAGE sip:")
        .replace("1 INVITE", "1 MESSAGE");
    other.send_to(msg.as_bytes(), vs).expect("send");
    let at_registrar = recv_text(&registrar).expect("the MESSAGE goes to the registrar");
    assert!(at_registrar.starts_with("MESSAGE "), "{at_registrar}");
    assert!(recv_text(&phone).is_none(), "nothing reaches the phone");
}

#[test]
fn a_tcp_phone_is_reached_over_its_connection_and_a_closed_one_gets_430() {
    let registrar = registrar_socket();
    let reg = registrar.local_addr().expect("addr");
    // A stable address for the UDP leg toward the registrar (`service_source`), which the
    // Path names: a registration outlives a restart of fulcrum.
    let leg_at = UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("a free port");
    let rt = start(&format!(
        "services:\n  - {{ name: r, address: {reg}, protocol: sip-udp }}\nvservers:\n  - {{ name: v, protocol: sip-tcp, bind: 127.0.0.1:0, service_source: \"{leg_at}\", failover: off, services: [r] }}\n"
    ));
    let vs = bound(&rt, "v");
    let mut phone = TcpStream::connect(vs).expect("connect");
    phone
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let me = phone.local_addr().expect("addr");
    // `path: auto` (the default): the phone says it supports Path.
    let reg_msg = register("TCP", me, "reg-t")
        .replace("Expires: 600\r\n", "Expires: 600\r\nSupported: path\r\n");
    phone.write_all(reg_msg.as_bytes()).expect("send");
    let got = recv_text(&registrar).expect("the REGISTER reaches the registrar");
    let path = header(&got, "Path").expect("fulcrum's Path").to_owned();
    // The UDP leg toward the registrar, where the call must come back.
    let leg = path_addr(&path);
    assert_eq!(leg, leg_at, "the Path names the leg's stable address");

    registrar
        .send_to(invite_along(reg, &path, "call-t").as_bytes(), leg)
        .expect("send");
    let mut buf = Vec::new();
    let call =
        read_message(&mut phone, &mut buf).expect("the INVITE reaches the phone's connection");
    let call = String::from_utf8_lossy(&call).into_owned();
    assert!(
        call.starts_with("INVITE sip:alice@10.1.2.3:9 SIP/2.0"),
        "{call}"
    );

    // The phone goes away: the same call now gets 430 Flow Failed (RFC 5626 §5.3).
    drop(phone);
    let answered = wait_for("430 Flow Failed", Duration::from_secs(5), || {
        registrar
            .send_to(invite_along(reg, &path, "call-t2").as_bytes(), leg)
            .ok()?;
        let a = recv_text(&registrar)?;
        a.starts_with("SIP/2.0 430 Flow Failed").then_some(a)
    });
    assert!(answered.contains("Call-ID: call-t2"), "{answered}");
}

/// Two instances of a pool behind one address (`advertise`) read one `flow_key_file`: a token
/// one of them wrote is honoured by the other. An instance with its own random key (no key
/// file) refuses it as forged.
#[test]
fn instances_sharing_a_key_file_honour_each_others_tokens() {
    let dir = std::env::temp_dir().join(format!("fulcrum-path-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    // A rotated file: the first key signs, the second is still accepted.
    std::fs::write(
        dir.join("flow.keys"),
        "# current\n00112233445566778899aabbccddeeff\n# previous\nffeeddccbbaa99887766554433221100\n",
    )
    .expect("write keys");
    let registrar = registrar_socket();
    let reg = registrar.local_addr().expect("addr");
    let instance = |keys: bool| {
        let key_line = if keys {
            "flow_key_file: flow.keys\n"
        } else {
            ""
        };
        let file = dir.join(format!("pool-{keys}.yaml"));
        std::fs::write(
            &file,
            format!(
                "{key_line}admin: {{ listen: null }}\nservices:\n  - {{ name: r, address: {reg}, protocol: sip-udp }}\nvservers:\n  - {{ name: v, protocol: sip-udp, bind: 127.0.0.1:0, advertise: \"127.0.0.1:5999\", path: always, failover: off, services: [r] }}\n"
            ),
        )
        .expect("write config");
        let cfg = fulcrum::config::load(&file).expect("config loads");
        let rt = fulcrum::proxy::Runtime::start(&cfg).expect("start");
        let vs = bound(&rt, "v");
        (rt, vs)
    };
    let (_a, a) = instance(true);
    let (_b, b) = instance(true);
    let (_c, c) = instance(false);
    let (phone, me) = udp_phone();
    phone
        .send_to(register("UDP", me, "reg-p").as_bytes(), a)
        .expect("send");
    let got = recv_text(&registrar).expect("the REGISTER reaches the registrar");
    let path = header(&got, "Path").expect("fulcrum's Path").to_owned();
    assert!(
        path.starts_with("<sip:127.0.0.1:5999;lr;fc-flow="),
        "{path}"
    );
    // The call arrives at the other instance of the pool.
    registrar
        .send_to(invite_along(reg, &path, "call-p").as_bytes(), b)
        .expect("send");
    let call = recv_text(&phone).expect("the INVITE reaches the phone through b");
    assert!(call.contains("Call-ID: call-p"), "{call}");
    // An instance without the key file cannot verify it.
    registrar
        .send_to(invite_along(reg, &path, "call-c").as_bytes(), c)
        .expect("send");
    let answer = recv_text(&registrar).expect("an answer");
    assert!(answer.starts_with("SIP/2.0 403 "), "{answer}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `/status` says where the flow-token keys come from: a process's own random key (and that
/// its tokens do not survive it) without `flow_key_file`, the file's keys with one.
#[test]
fn status_says_whether_flow_tokens_outlive_the_process() {
    use fulcrum::admin::router;
    let yaml = "admin: { listen: null }\nservices:\n  - { name: r, address: 127.0.0.1:5999, protocol: sip-udp }\nvservers:\n  - { name: v, protocol: sip-udp, bind: 127.0.0.1:0, services: [r] }\n";
    let file = ConfigFile::new("path-status", yaml);
    let ops = fulcrum::ops::Ops::start(fulcrum::config::load(&file.path).expect("valid"), None)
        .expect("start");
    let tokens = &router::status(&ops)["flow_tokens"];
    assert_eq!(tokens["keys"], "own", "{tokens}");
    assert!(
        tokens["note"]
            .as_str()
            .is_some_and(|n| n.contains("not honoured after a restart")),
        "{tokens}"
    );
    ops.shutdown();
    file.beside("flow.keys", "00112233445566778899aabbccddeeff\n");
    file.write(&format!("flow_key_file: flow.keys\n{yaml}"));
    let ops = fulcrum::ops::Ops::start(fulcrum::config::load(&file.path).expect("valid"), None)
        .expect("start");
    let tokens = &router::status(&ops)["flow_tokens"];
    assert_eq!(tokens["keys"], "flow_key_file", "{tokens}");
    assert!(tokens["note"].is_null(), "{tokens}");
    ops.shutdown();
}
