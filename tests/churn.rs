//! Reload churn under SIP load (docs/draining.md): a SIPp UAC places calls that last ~1.5 s through a
//! `fulcrum run` child process while the config is reloaded every second, alternately
//! removing and re-adding a fourth service. The services are strict UAS
//! (`common::strict_uas`): a BYE that reaches a service that did not set its dialog up is
//! answered 481 and the call fails at SIPp, so a dialog moved by a reload cannot hide.
//!
//! Also the strict UAS's own rules (through its pure core and over a TCP connection), and
//! the other flows a removed service must drain: a udp session keeps its replies, a tcp
//! connection finishes.
//!
//! SIPp missing: skipped with a message, unless `FULCRUM_REQUIRE_SIPP=1`.

mod common;

use common::churn::ChurnLab;
use common::sip_tcp::read_message;
use common::sipp::{Scratch, Transport, Uac, UacLoad, sipp_available};
use common::strict_uas::{Counts, Sick, StrictUas, UasCore};
use common::*;
use fulcrum::config;
use fulcrum::ops::Ops;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

/// 80 calls/s for 8 s, each held 1.5 s: about 120 dialogs alive at any time, 30 of them on
/// each of four services.
const LOAD: UacLoad = UacLoad {
    calls: 640,
    rate_per_s: 80,
    hold_ms: 1500,
};

/// Reloads during the load, one a second: remove s3, re-add it, ...
const RELOADS: usize = 6;

fn total(c: &[Counts], f: impl Fn(&Counts) -> u64) -> u64 {
    c.iter().map(f).sum()
}

/// Run [`LOAD`] through a vserver over s0..s3 with `reloads` reloads, and check that every
/// call succeeded and no service saw a request of a dialog it does not have.
fn churn(t: Transport, reloads: usize) {
    if !sipp_available() {
        return;
    }
    let tag = format!("churn-{t:?}-{reloads}");
    let lab = ChurnLab::start(&tag, t, 4, &[0, 1, 2, 3]);
    let dir = Scratch::new(&tag);
    let uac = Uac::start(&dir, t, lab.proxy, LOAD, "churn");
    // The fourth service holds dialogs before the first reload removes it.
    let ready = wait_until(Duration::from_secs(10), || {
        lab.uas[3].counts().dialogs >= 20
    });
    assert!(ready, "s3 set up no dialogs: {:?}", lab.counts());
    let mut live_at_removal = Vec::new();
    let mut tick = Instant::now();
    for i in 0..reloads {
        if i % 2 == 0 {
            let c = lab.uas[3].counts();
            live_at_removal.push(c.dialogs - c.byes_ok);
            lab.reload(&[0, 1, 2]);
        } else {
            lab.reload(&[0, 1, 2, 3]);
        }
        // Pacing of the churn, not synchronisation: each reload was confirmed by its log line.
        tick += Duration::from_secs(1);
        std::thread::sleep(tick.saturating_duration_since(Instant::now()));
    }
    let out = uac.finish();
    // Every removal took dialogs away from s3: the drain was exercised each time.
    assert!(
        live_at_removal.iter().all(|&n| n > 0),
        "{live_at_removal:?}"
    );
    let counts = lab.counts();
    let report = format!(
        "{t:?}, {reloads} reloads: SIPp exit {:?}, successful {}, failed {}; per service \
         (dialogs, BYE 200, 481, stray ACK): {:?}; s3's live dialogs at each removal: \
         {live_at_removal:?}; SIPp errors:\n{}",
        out.exit,
        out.successful,
        out.failed,
        counts
            .iter()
            .map(|c| (c.dialogs, c.byes_ok, c.r481, c.stray_acks))
            .collect::<Vec<_>>(),
        out.errors
    );
    eprintln!("{report}");
    assert_eq!(out.failed, 0, "{report}");
    assert_eq!(total(&counts, |c| c.r481), 0, "{report}");
    assert_eq!(total(&counts, |c| c.stray_acks), 0, "{report}");
    assert_eq!(out.successful, u64::from(LOAD.calls), "{report}");
    assert_eq!(out.exit, Some(0), "{report}");
    assert_eq!(
        total(&counts, |c| c.dialogs),
        u64::from(LOAD.calls),
        "{report}"
    );
    assert_eq!(
        total(&counts, |c| c.byes_ok),
        u64::from(LOAD.calls),
        "{report}"
    );
}

/// Fails until removed services drain: today their dialogs are routed afresh and the
/// BYEs are answered 481.
#[test]
fn sip_udp_reload_churn_loses_no_call() {
    churn(Transport::Udp, RELOADS);
}

/// Fails until removed services drain (see above), over sip-tcp.
#[test]
fn sip_tcp_reload_churn_loses_no_call() {
    churn(Transport::Tcp, RELOADS);
}

/// Control: the same load without reloads loses nothing.
#[test]
fn sip_udp_load_without_reloads_loses_no_call() {
    churn(Transport::Udp, 0);
}

/// Control over sip-tcp.
#[test]
fn sip_tcp_load_without_reloads_loses_no_call() {
    churn(Transport::Tcp, 0);
}

// The strict UAS itself.

const CALLER: &str = "127.0.0.1:5999";

fn req(method: &str, call_id: &str, to_tag: Option<&str>, cseq: u32, branch: &str) -> String {
    let to_tag = to_tag.map(|t| format!(";tag={t}")).unwrap_or_default();
    format!(
        "{method} sip:uas@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/UDP {CALLER};branch=z9hG4bK{branch}\r\n\
         Record-Route: <sip:proxy.example;lr>\r\nMax-Forwards: 70\r\n\
         From: <sip:a@client>;tag=caller\r\nTo: <sip:uas@server>{to_tag}\r\nCall-ID: {call_id}\r\n\
         CSeq: {cseq} {method}\r\nContact: <sip:a@{CALLER}>\r\nContent-Length: 0\r\n\r\n"
    )
}

fn status(r: &[u8]) -> u16 {
    fulcrum::sip::scan(r)
        .ok()
        .and_then(|m| m.status_code())
        .unwrap_or(0)
}

fn to_tag(r: &[u8]) -> String {
    let m = fulcrum::sip::scan(r).expect("response scans");
    String::from_utf8_lossy(m.to_tag().expect("To tag")).into_owned()
}

/// RFC 3261 §9.2 at the strict UAS: a CANCEL of its ringing INVITE (same Call-ID and branch)
/// gets 200 and the INVITE 487, whose ACK is expected; a CANCEL of no transaction it has,
/// 481. A late UAS answers nothing at once and hands its 200 to the shell to send later.
#[test]
fn strict_uas_cancels_its_ringing_invites_and_refuses_stray_cancels() {
    let at: SocketAddr = "127.0.0.1:5060".parse().expect("addr");
    let mut uas = UasCore::new("s0", at, "udp");
    uas.set_sick(Sick::Ringing);
    let out = uas.handle(req("INVITE", "c1", None, 1, "i1").as_bytes());
    assert_eq!(
        out.iter().map(|r| status(r)).collect::<Vec<_>>(),
        [100, 180]
    );
    let tag = to_tag(&out[1]);
    let stray = uas.handle(req("CANCEL", "c1", None, 1, "other").as_bytes());
    assert_eq!(stray.iter().map(|r| status(r)).collect::<Vec<_>>(), [481]);
    let cancel = uas.handle(req("CANCEL", "c1", None, 1, "i1").as_bytes());
    assert_eq!(
        cancel.iter().map(|r| status(r)).collect::<Vec<_>>(),
        [200, 487]
    );
    assert!(String::from_utf8_lossy(&cancel[1]).contains("CSeq: 1 INVITE\r\n"));
    assert_eq!(to_tag(&cancel[1]), tag);
    assert!(
        uas.handle(req("ACK", "c1", Some(&tag), 1, "i1").as_bytes())
            .is_empty()
    );
    let c = uas.counts();
    assert_eq!(
        (c.cancels, c.stray_cancels, c.r481, c.stray_acks, c.dialogs),
        (1, 1, 1, 0, 0)
    );
    uas.set_sick(Sick::Late(1500));
    assert!(
        uas.handle(req("INVITE", "c2", None, 1, "i2").as_bytes())
            .is_empty()
    );
    assert!(
        uas.handle(req("INVITE", "c2", None, 1, "i2").as_bytes())
            .is_empty()
    );
    let later = uas.take_later();
    assert_eq!(later.len(), 1, "one 200, not one per retransmission");
    assert_eq!(later[0].0, Duration::from_millis(1500));
    assert_eq!(status(&later[0].1), 200);
    assert_eq!(uas.counts().dialogs, 1);
}

/// RFC 3261 §22.3 at a challenging UAS: an INVITE without Proxy-Authorization gets 407 with a
/// Proxy-Authenticate challenge (again for its retransmission, counted once), its ACK is
/// expected; the INVITE sent again with credentials (CSeq 2, new branch) sets up the call.
#[test]
fn strict_uas_challenges_an_invite_without_credentials_and_answers_the_retry() {
    let at: SocketAddr = "127.0.0.1:5060".parse().expect("addr");
    let mut uas = UasCore::new("s0", at, "udp");
    uas.set_sick(Sick::Challenging);
    for _ in 0..2 {
        let out = uas.handle(req("INVITE", "c1", None, 1, "i1").as_bytes());
        assert_eq!(out.iter().map(|r| status(r)).collect::<Vec<_>>(), [407]);
        assert!(String::from_utf8_lossy(&out[0]).contains("\r\nProxy-Authenticate: Digest "));
    }
    let tag = to_tag(&uas.handle(req("INVITE", "c1", None, 1, "i1").as_bytes())[0]);
    assert!(
        uas.handle(req("ACK", "c1", Some(&tag), 1, "i1").as_bytes())
            .is_empty()
    );
    let retry = req("INVITE", "c1", None, 2, "i2").replace(
        "Content-Length: 0",
        "Proxy-Authorization: Digest username=\"a\"\r\nContent-Length: 0",
    );
    let out = uas.handle(retry.as_bytes());
    assert_eq!(
        out.iter().map(|r| status(r)).collect::<Vec<_>>(),
        [100, 180, 200]
    );
    assert!(
        uas.handle(req("ACK", "c1", Some(&tag), 2, "a2").as_bytes())
            .is_empty()
    );
    let c = uas.counts();
    assert_eq!(
        (c.challenges, c.dialogs, c.acked, c.stray_acks, c.invites),
        (1, 1, 1, 0, 2)
    );
}

#[test]
fn strict_uas_answers_only_its_own_dialogs_and_retransmissions_alike() {
    let at: SocketAddr = "127.0.0.1:5060".parse().expect("addr");
    let mut uas = UasCore::new("s0", at, "udp");
    let invite = req("INVITE", "c1", None, 1, "i1");
    let out = uas.handle(invite.as_bytes());
    assert_eq!(
        out.iter().map(|r| status(r)).collect::<Vec<_>>(),
        [100, 180, 200]
    );
    let ok = String::from_utf8_lossy(&out[2]).into_owned();
    assert!(
        ok.contains("Record-Route: <sip:proxy.example;lr>\r\n"),
        "{ok}"
    );
    assert!(
        ok.contains("Contact: <sip:s0@127.0.0.1:5060;transport=udp>\r\n"),
        "{ok}"
    );
    assert!(
        ok.contains(&format!("Via: SIP/2.0/UDP {CALLER};branch=z9hG4bKi1\r\n")),
        "{ok}"
    );
    let tag = to_tag(&out[2]);
    assert_eq!(to_tag(&out[1]), tag);
    // A retransmitted INVITE: the same answers, no second dialog.
    let again = uas.handle(invite.as_bytes());
    assert_eq!(again, out);
    assert!(
        uas.handle(req("ACK", "c1", Some(&tag), 1, "a1").as_bytes())
            .is_empty()
    );
    // A BYE with another UAS's tag, or for another call: 481.
    let bye_other = uas.handle(req("BYE", "c1", Some("s1-x"), 2, "b0").as_bytes());
    assert_eq!(status(&bye_other[0]), 481);
    let bye_unknown = uas.handle(req("BYE", "c2", Some(&tag), 2, "b9").as_bytes());
    assert_eq!(status(&bye_unknown[0]), 481);
    // Its own dialog: 200, and 200 again for the retransmission; then the dialog is gone.
    let bye = req("BYE", "c1", Some(&tag), 2, "b1");
    assert_eq!(status(&uas.handle(bye.as_bytes())[0]), 200);
    assert_eq!(status(&uas.handle(bye.as_bytes())[0]), 200);
    let info = uas.handle(req("INFO", "c1", Some(&tag), 3, "n1").as_bytes());
    assert_eq!(status(&info[0]), 481);
    // A stray ACK is counted, never answered; OPTIONS outside a dialog is answered 200.
    assert!(
        uas.handle(req("ACK", "c3", Some("s0-y"), 1, "a3").as_bytes())
            .is_empty()
    );
    let options = uas.handle(req("OPTIONS", "o1", None, 1, "o1").as_bytes());
    assert_eq!(status(&options[0]), 200);
    assert_eq!(
        uas.counts(),
        Counts {
            requests: 10,
            dialogs: 1,
            byes_ok: 1,
            r481: 3,
            stray_acks: 1,
            invites: 1,
            acked: 1,
            ..Counts::default()
        }
    );
    assert_eq!(
        uas.methods_of("c1"),
        ["INVITE", "INVITE", "ACK", "BYE", "BYE", "BYE", "INFO"]
    );
}

#[test]
fn strict_uas_over_tcp_frames_and_answers_on_the_connection() {
    let uas = StrictUas::tcp("t0");
    let mut s = TcpStream::connect_timeout(&uas.addr, ANSWER).expect("connect");
    // Two requests in one write, then one split across writes.
    let invite = req("INVITE", "tc1", None, 1, "ti1");
    let options = req("OPTIONS", "to1", None, 1, "to1");
    s.write_all(format!("{invite}{options}").as_bytes())
        .expect("write");
    let mut buf = Vec::new();
    let mut codes = Vec::new();
    let mut tag = String::new();
    for _ in 0..4 {
        let m = read_message(&mut s, &mut buf).expect("a response");
        if status(&m) == 200 && tag.is_empty() {
            tag = to_tag(&m);
        }
        codes.push(status(&m));
    }
    assert_eq!(codes, [100, 180, 200, 200]);
    let bye = req("BYE", "tc1", Some(&tag), 2, "tb1");
    let (a, b) = bye.as_bytes().split_at(40);
    s.write_all(a).expect("write");
    s.flush().expect("flush");
    s.write_all(b).expect("write");
    assert_eq!(status(&read_message(&mut s, &mut buf).expect("200")), 200);
    let stray = req("BYE", "nobody", Some("t0-z"), 2, "tb2");
    s.write_all(stray.as_bytes()).expect("write");
    assert_eq!(status(&read_message(&mut s, &mut buf).expect("481")), 481);
    let c = uas.counts();
    assert_eq!((c.dialogs, c.byes_ok, c.r481), (1, 1, 1), "{c:?}");
}

// Other flows of a removed service.

fn reload(file: &ConfigFile, ops: &Ops, yaml: &str) {
    file.write(yaml);
    let changes = ops
        .reload()
        .unwrap_or_else(|e| panic!("reload: {e}\n{yaml}"));
    assert!(
        changes.iter().any(|c| c == "vservers.v rebuilt"),
        "{changes:?}"
    );
}

fn start_ops(file: &ConfigFile) -> std::sync::Arc<Ops> {
    let path = &file.path;
    Ops::start(config::load(path).expect("valid"), Some(path.clone())).expect("start")
}

fn vserver(ops: &Ops) -> SocketAddr {
    ops.with_vservers(|vs, _| vs[0].bound[0]).expect("running")
}

/// Fails until removed services drain: a udp session on a removed service keeps its service
/// (today it is balanced afresh).
#[test]
fn udp_session_on_a_removed_service_keeps_its_replies() {
    let (a0, _) = udp_service("s0", "127.0.0.1");
    let (a1, _) = udp_service("s1", "127.0.0.1");
    let both = config(
        "udp",
        "127.0.0.1:0",
        "round_robin",
        "workers: 1",
        &[("s0", a0), ("s1", a1)],
    );
    let file = ConfigFile::new("churn-udp-drain", &both);
    let ops = start_ops(&file);
    let vs = vserver(&ops);
    let client = udp_client("127.0.0.1");
    let first = udp_ask(&client, vs, b"hello").expect("answer").0.service;
    let (gone, (_, kept_addr)) = if first == "s0" {
        ("s0", ("s1", a1))
    } else {
        ("s1", ("s0", a0))
    };
    let remaining = if gone == "s0" { "s1" } else { "s0" };
    let one = config(
        "udp",
        "127.0.0.1:0",
        "round_robin",
        "workers: 1",
        &[(remaining, kept_addr)],
    );
    reload(&file, &ops, &one);
    for i in 0..5 {
        let a = udp_ask(&client, vs, format!("more-{i}").as_bytes()).expect("answer");
        assert_eq!(
            a.0.service, gone,
            "datagram {i} of the session left its removed service"
        );
    }
    // New sessions go to the remaining service only.
    for i in 0..4 {
        let c = udp_client("127.0.0.1");
        let a = udp_ask(&c, vs, format!("new-{i}").as_bytes()).expect("answer");
        assert_eq!(a.0.service, remaining);
    }
    ops.shutdown();
}

/// A TCP service that reads a line, reports it has it, waits for `go`, then answers
/// `NAME|line` and closes.
fn slow_tcp_service(name: &'static str) -> (SocketAddr, Receiver<()>, Sender<()>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let (tx, rx) = channel::<()>();
    let (got_tx, got_rx) = channel::<()>();
    std::thread::spawn(move || {
        let Ok((mut c, _)) = l.accept() else { return };
        let _ = c.set_read_timeout(Some(Duration::from_secs(10)));
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while let Ok(1) = c.read(&mut byte) {
            if byte[0] == b'\n' {
                break;
            }
            line.push(byte[0]);
        }
        let _ = got_tx.send(());
        if rx.recv_timeout(Duration::from_secs(10)).is_ok() {
            let mut out = format!("{name}|").into_bytes();
            out.extend_from_slice(&line);
            let _ = c.write_all(&out);
        }
    });
    (addr, got_rx, tx)
}

/// A tcp connection whose service is removed while the service is still working on its
/// answer gets that answer.
#[test]
fn tcp_connection_on_a_removed_service_finishes() {
    let (slow, got, go) = slow_tcp_service("slow");
    let (other, _) = tcp_service("other", "127.0.0.1");
    let only_slow = config("tcp", "127.0.0.1:0", "round_robin", "", &[("slow", slow)]);
    let file = ConfigFile::new("churn-tcp-drain", &only_slow);
    let ops = start_ops(&file);
    let vs = vserver(&ops);
    let mut c = TcpStream::connect_timeout(&vs, ANSWER).expect("connect");
    c.set_read_timeout(Some(ANSWER)).expect("timeout");
    c.write_all(b"question\n").expect("write");
    got.recv_timeout(ANSWER)
        .expect("the service has the question before the reload");
    let only_other = config("tcp", "127.0.0.1:0", "round_robin", "", &[("other", other)]);
    reload(&file, &ops, &only_other);
    // New connections go to the remaining service.
    assert_eq!(tcp_ask(vs, b"new").expect("answer").service, "other");
    go.send(()).expect("slow service waiting");
    c.shutdown(Shutdown::Write).expect("half-close");
    let mut out = Vec::new();
    c.read_to_end(&mut out).expect("read");
    assert_eq!(String::from_utf8_lossy(&out), "slow|question");
    ops.shutdown();
}
