//! `aor_hash` in front of real registrars: three Kamailio processes (`registrar` + `usrloc`,
//! bindings in memory) behind a sip-udp vserver. Two phones of each user register through
//! fulcrum (each with its own Call-ID, Contact, source port and To form); then each registrar
//! is asked directly for the user's bindings (a REGISTER without Contact, RFC 3261 §10.2.3).
//! With `aor_hash` both phones of every user are bound at one registrar and nowhere else; with
//! `call_id_hash` (the default) some user's phones are split between registrars, so a call to
//! that user would miss one of them. And a registrar that honours Path (`use_path`) calls a
//! phone behind NAT through fulcrum's flow token.

mod common;

use common::sipp::{Proc, Scratch, Transport, spawn_listening};
use common::*;
use std::net::{SocketAddr, UdpSocket};
use std::process::Command;

const USERS: usize = 12;

/// A registrar on 127.0.0.1:`port`, bindings in memory, for any domain.
fn registrar_cfg(port: u16) -> String {
    kamailio_cfg(
        port,
        &["kex", "sl", "usrloc", "registrar"],
        "modparam(\"usrloc\", \"db_mode\", 0)\n",
        "if (method == \"REGISTER\") { if (!save(\"location\")) { sl_reply_error(); } exit; }\n\
         sl_send_reply(\"404\", \"Not Here\"); exit;",
    )
}

/// Start `n` registrars; each with the address it listens on.
fn registrars(scratch: &Scratch, n: usize) -> Vec<(Proc, SocketAddr)> {
    (0..n)
        .map(|i| {
            let (proc, port) =
                spawn_listening(&format!("registrar r{i}"), Transport::Udp, |port| {
                    let cfg = scratch.path(&format!("r{i}-{port}.cfg"));
                    std::fs::write(&cfg, registrar_cfg(port)).expect("write kamailio config");
                    let mut c = Command::new("kamailio");
                    c.arg("-f").arg(cfg).args(["-DD", "-E"]);
                    c
                });
            (proc, SocketAddr::from(([127, 0, 0, 1], port)))
        })
        .collect()
}

/// A REGISTER from `phone` for `user` (a To form per phone), Contact `contact` if any.
fn register(phone: &UdpSocket, to: SocketAddr, user: &str, call_id: &str, contact: bool) -> String {
    let local = phone.local_addr().expect("addr");
    let to_header = if call_id.ends_with("-b") {
        format!("\"{user}\" <sip:{user}@EXAMPLE.com:5060;transport=udp>")
    } else {
        format!("<sip:{user}@example.com>")
    };
    let contact = if contact {
        format!("Contact: <sip:{user}@{local}>\r\n")
    } else {
        String::new()
    };
    let msg = format!(
        "REGISTER sip:example.com SIP/2.0\r\n\
         Via: SIP/2.0/UDP {local};branch=z9hG4bK{call_id};rport\r\n\
         Max-Forwards: 70\r\nFrom: <sip:{user}@example.com>;tag=t{call_id}\r\nTo: {to_header}\r\n\
         Call-ID: {call_id}\r\nCSeq: 1 REGISTER\r\n{contact}Expires: 300\r\nContent-Length: 0\r\n\r\n"
    );
    // A lost datagram is sent again (as a UA's Timer E would).
    for _ in 0..3 {
        phone.send_to(msg.as_bytes(), to).expect("send REGISTER");
        let mut buf = vec![0u8; 65_536];
        if let Ok((n, _)) = recv_from_retrying(phone, &mut buf) {
            let answer = String::from_utf8_lossy(&buf[..n]).into_owned();
            if answer.contains(call_id) {
                return answer;
            }
        }
    }
    panic!("no answer to REGISTER {call_id}");
}

/// For each user, how many of its phones each registrar has bound.
fn bindings(method: &str, tag: &str) -> Vec<Vec<usize>> {
    let scratch = Scratch::new(tag);
    let regs = registrars(&scratch, 3);
    let services: Vec<(String, SocketAddr)> = regs
        .iter()
        .enumerate()
        .map(|(i, (_, a))| (format!("r{i}"), *a))
        .collect();
    let refs: Vec<(&str, SocketAddr)> = services.iter().map(|(n, a)| (n.as_str(), *a)).collect();
    let yaml = config("sip-udp", "127.0.0.1:0", method, "", &refs);
    let rt = start(&yaml);
    let lb = bound(&rt, "v");
    // Every phone keeps its socket to the end: a phone's Contact is its port, and a later
    // phone on a port an earlier one let go would update that binding, not add its own.
    let mut phones = Vec::new();
    for u in 0..USERS {
        let user = format!("user{u}");
        for phone in ["a", "b"] {
            let sock = udp_client("127.0.0.1");
            let answer = register(&sock, lb, &user, &format!("{tag}-{user}-{phone}"), true);
            assert!(answer.starts_with("SIP/2.0 200"), "{answer}");
            phones.push(sock);
        }
    }
    // Each registrar asked directly: the Contacts it holds for each user.
    let ask = udp_client("127.0.0.1");
    (0..USERS)
        .map(|u| {
            let user = format!("user{u}");
            regs.iter()
                .enumerate()
                .map(|(i, (_, addr))| {
                    let answer = register(&ask, *addr, &user, &format!("{tag}-q{u}-{i}"), false);
                    assert!(answer.starts_with("SIP/2.0 200"), "{answer}");
                    answer.matches(&format!("<sip:{user}@127.0.0.1:")).count()
                })
                .collect()
        })
        .collect()
}

#[test]
fn with_aor_hash_both_phones_of_a_user_register_at_one_registrar() {
    if !kamailio_available() {
        return;
    }
    let per_user = bindings("aor_hash", "aor");
    let mut used = std::collections::HashSet::new();
    for (u, counts) in per_user.iter().enumerate() {
        let at: Vec<usize> = (0..counts.len()).filter(|&i| counts[i] > 0).collect();
        assert_eq!(at.len(), 1, "user{u}'s phones are bound at {counts:?}");
        assert_eq!(
            counts[at[0]], 2,
            "user{u}: both phones at one registrar: {counts:?}"
        );
        used.insert(at[0]);
    }
    assert!(
        used.len() >= 2,
        "users spread over the registrars: {per_user:?}"
    );
}

#[test]
fn with_call_id_hash_some_users_phones_are_split() {
    if !kamailio_available() {
        return;
    }
    let per_user = bindings("call_id_hash", "cid");
    // Every phone registered somewhere...
    for counts in &per_user {
        assert_eq!(counts.iter().sum::<usize>(), 2, "{per_user:?}");
    }
    // ...but by Call-ID, so two phones of one user meet only by chance (1 in 3 per user).
    let split = per_user
        .iter()
        .filter(|c| c.iter().filter(|&&n| n > 0).count() > 1)
        .count();
    assert!(split > 0, "no user split among {USERS}: {per_user:?}");
}

/// A phone on 127.0.0.2 registers through fulcrum (`path: always`) with the Contact a NAT's
/// inside address would give (port 9, where nothing listens); a caller asks the Kamailio
/// registrar directly for the user, and the registrar's INVITE, routed along fulcrum's Path,
/// reaches the phone at the address it registered from.
#[test]
fn a_kamailio_registrar_calls_a_phone_behind_nat_along_fulcrums_path() {
    if !kamailio_available() {
        return;
    }
    let scratch = Scratch::new("path");
    let (_proc, port) = spawn_listening("registrar with path", Transport::Udp, |port| {
        let cfg = scratch.path(&format!("path-{port}.cfg"));
        std::fs::write(&cfg, kamailio_path_registrar_cfg(port)).expect("write kamailio config");
        let mut c = Command::new("kamailio");
        c.arg("-f").arg(cfg).args(["-DD", "-E"]);
        c
    });
    let registrar = SocketAddr::from(([127, 0, 0, 1], port));
    let rt = start(&format!(
        "services:\n  - {{ name: r, address: \"{registrar}\", protocol: sip-udp }}\nvservers:\n  - {{ name: v, protocol: sip-udp, bind: 127.0.0.1:0, path: always, services: [r] }}\n"
    ));
    let lb = bound(&rt, "v");
    let phone = udp_client("127.0.0.2");
    let local = phone.local_addr().expect("addr");
    let reg = format!(
        "REGISTER sip:example.com SIP/2.0\r\nVia: SIP/2.0/UDP {local};branch=z9hG4bKnat1;rport\r\nMax-Forwards: 70\r\nFrom: <sip:carol@example.com>;tag=n1\r\nTo: <sip:carol@example.com>\r\nCall-ID: nat-reg\r\nCSeq: 1 REGISTER\r\nContact: <sip:carol@127.0.0.2:9>\r\nExpires: 300\r\nContent-Length: 0\r\n\r\n"
    );
    let mut buf = vec![0u8; 65_536];
    let answer = (0..3)
        .find_map(|_| {
            phone.send_to(reg.as_bytes(), lb).expect("send REGISTER");
            let (n, _) = recv_from_retrying(&phone, &mut buf).ok()?;
            Some(String::from_utf8_lossy(&buf[..n]).into_owned())
        })
        .expect("an answer to the REGISTER");
    assert!(answer.starts_with("SIP/2.0 200"), "{answer}");
    // The caller asks the registrar for carol, directly.
    let caller = udp_client("127.0.0.1");
    let me = caller.local_addr().expect("addr");
    let invite = format!(
        "INVITE sip:carol@example.com SIP/2.0\r\nVia: SIP/2.0/UDP {me};branch=z9hG4bKnatcall;rport\r\nMax-Forwards: 70\r\nFrom: <sip:dave@example.com>;tag=d1\r\nTo: <sip:carol@example.com>\r\nCall-ID: nat-call\r\nCSeq: 1 INVITE\r\nContact: <sip:dave@{me}>\r\nContent-Length: 0\r\n\r\n"
    );
    caller
        .send_to(invite.as_bytes(), registrar)
        .expect("send INVITE");
    let (n, from) = recv_from_retrying(&phone, &mut buf).expect("the call reaches the phone");
    let call = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(
        call.starts_with("INVITE sip:carol@127.0.0.2:9 SIP/2.0"),
        "{call}"
    );
    assert!(call.contains("Call-ID: nat-call"), "{call}");
    assert_eq!(from, lb, "through fulcrum");
    assert!(
        !call.contains("fc-flow"),
        "fulcrum's Route is removed: {call}"
    );
}
