//! RFC 4475 torture messages (`fixtures/sip/rfc4475/`, see its README) sent as they are to a
//! sip-udp vserver with one service, and the stream-valid ones to a sip-tcp vserver: each
//! must get the behaviour a stateless proxy owes it (RFC 3261 §16.3, §16.11), with the reason
//! beside it.

mod common;

use common::sip_tcp::{Next, TcpUas, next_message};
use fulcrum::sip::scan;
use std::io::Write;
use std::net::{TcpStream, UdpSocket};
use std::path::PathBuf;
use std::time::Duration;

/// What fulcrum must do with one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// Forwarded to the service (over TCP: the service's 200 comes back).
    Forward,
    /// Answered by fulcrum with this status code.
    Reply(u16),
    /// Neither forwarded nor answered.
    Drop,
}
use Want::*;

/// Every message of RFC 4475 §3, and the completed `baddn` beside the archived one (README):
/// (file stem, RFC 4475 section, behaviour, stream-valid, reason).
const CASES: &[(&str, &str, Want, bool, &str)] = &[
    (
        "wsinv",
        "3.1.1.1",
        Forward,
        true,
        "valid: folding, LWS, compact forms, leading zeros",
    ),
    (
        "intmeth",
        "3.1.1.2",
        Forward,
        true,
        "unknown method, same in CSeq: a proxy forwards it (RFC 3261 §16.6)",
    ),
    ("esc01", "3.1.1.3", Forward, true, "valid % escapes"),
    (
        "escnull",
        "3.1.1.4",
        Forward,
        true,
        "escaped NUL is valid URI text",
    ),
    (
        "esc02",
        "3.1.1.5",
        Forward,
        true,
        "% in method and CSeq method alike: they match",
    ),
    (
        "lwsdisp",
        "3.1.1.6",
        Forward,
        true,
        "no LWS before < is valid",
    ),
    (
        "longreq",
        "3.1.1.7",
        Forward,
        true,
        "long values, 34 Via headers: valid",
    ),
    (
        "dblreq",
        "3.1.1.8",
        Forward,
        false,
        "the REGISTER is forwarded, the trailing INVITE ignored (RFC 3261 §18.3)",
    ),
    (
        "semiuri",
        "3.1.1.9",
        Forward,
        true,
        "; in the userinfo is valid",
    ),
    (
        "transports",
        "3.1.1.10",
        Forward,
        true,
        "unknown transports in lower Vias are not fulcrum's",
    ),
    (
        "mpart01",
        "3.1.1.11",
        Forward,
        true,
        "a binary multipart body is the endpoints' business",
    ),
    (
        "unreason",
        "3.1.1.12",
        Drop,
        false,
        "a response whose top Via is not fulcrum's (RFC 3261 §16.11)",
    ),
    (
        "noreason",
        "3.1.1.13",
        Drop,
        false,
        "a response whose top Via is not fulcrum's (RFC 3261 §16.11)",
    ),
    (
        "badinv01",
        "3.1.2.1",
        Reply(400),
        true,
        "top Via does not parse",
    ),
    (
        "clerr",
        "3.1.2.2",
        Reply(400),
        false,
        "Content-Length larger than the datagram",
    ),
    (
        "ncl",
        "3.1.2.3",
        Reply(400),
        false,
        "negative Content-Length",
    ),
    (
        "scalar02",
        "3.1.2.4",
        Reply(400),
        true,
        "CSeq number beyond 2^32-1 (RFC 3261 §8.1.1.5)",
    ),
    (
        "scalarlg",
        "3.1.2.5",
        Drop,
        false,
        "a response not through fulcrum",
    ),
    (
        "quotbal",
        "3.1.2.6",
        Reply(400),
        true,
        "unbalanced quote in To hides its URI",
    ),
    (
        "ltgtruri",
        "3.1.2.7",
        Reply(400),
        true,
        "Request-URI in <> (RFC 3261 §7.1)",
    ),
    (
        "lwsruri",
        "3.1.2.8",
        Reply(400),
        true,
        "LWS inside the Request-URI",
    ),
    (
        "lwsstart",
        "3.1.2.9",
        Reply(400),
        true,
        "several SPs in the Request-Line",
    ),
    (
        "trws",
        "3.1.2.10",
        Reply(400),
        true,
        "trailing whitespace after SIP/2.0",
    ),
    (
        "escruri",
        "3.1.2.11",
        Reply(400),
        true,
        "escaped headers in the Request-URI: refused, never forwarded",
    ),
    (
        "baddate",
        "3.1.2.12",
        Forward,
        true,
        "a bad Date is the endpoints' business",
    ),
    (
        "regbadct",
        "3.1.2.13",
        Forward,
        true,
        "a bad Contact is the registrar's business",
    ),
    (
        "badaspec",
        "3.1.2.14",
        Forward,
        true,
        "lenient: the URI in To still parses",
    ),
    (
        "baddn",
        "3.1.2.15",
        Drop,
        false,
        "as archived, no empty line closes the headers: truncated (RFC 3261 §7), nothing to answer",
    ),
    (
        "baddn-completed",
        "3.1.2.15",
        Forward,
        true,
        "completed with the empty line: a proxy need not judge display names",
    ),
    (
        "badvers",
        "3.1.2.16",
        Reply(505),
        true,
        "SIP/7.0 (RFC 3261 §21.5.6)",
    ),
    (
        "mismatch01",
        "3.1.2.17",
        Reply(400),
        true,
        "CSeq method differs from the request's (RFC 3261 §8.1.1.5)",
    ),
    (
        "mismatch02",
        "3.1.2.18",
        Reply(501),
        true,
        "unknown method and another CSeq method: 501 at a proxy",
    ),
    (
        "bigcode",
        "3.1.2.19",
        Drop,
        false,
        "status code out of range: not a message",
    ),
    (
        "badbranch",
        "3.2.1",
        Forward,
        true,
        "a bare cookie: handled as an RFC 2543 branch",
    ),
    (
        "insuf",
        "3.3.1",
        Reply(400),
        true,
        "no Call-ID, From, To (RFC 3261 §8.1.1)",
    ),
    (
        "unkscm",
        "3.3.2",
        Forward,
        true,
        "fulcrum does not route by the Request-URI",
    ),
    (
        "novelsc",
        "3.3.3",
        Forward,
        true,
        "fulcrum does not route by the Request-URI",
    ),
    (
        "unksm2",
        "3.3.4",
        Forward,
        true,
        "To and From schemes are the endpoints' business",
    ),
    (
        "bext01",
        "3.3.5",
        Reply(420),
        true,
        "Proxy-Require: fulcrum supports no option tag (RFC 3261 §16.3 step 5)",
    ),
    (
        "invut",
        "3.3.6",
        Forward,
        true,
        "body types are the endpoints' business",
    ),
    (
        "regaut01",
        "3.3.7",
        Forward,
        true,
        "authorization is the registrar's business",
    ),
    (
        "multi01",
        "3.3.8",
        Reply(400),
        true,
        "two Call-ID, CSeq, To, From, Max-Forwards",
    ),
    (
        "mcl01",
        "3.3.9",
        Reply(400),
        false,
        "two different Content-Length values",
    ),
    (
        "bcast",
        "3.3.10",
        Drop,
        false,
        "a response not through fulcrum",
    ),
    (
        "zeromf",
        "3.3.11",
        Reply(483),
        true,
        "Max-Forwards 0 (RFC 3261 §16.3 step 3)",
    ),
    (
        "cparam01",
        "3.3.12",
        Forward,
        true,
        "Contact parameters are the registrar's business",
    ),
    (
        "cparam02",
        "3.3.13",
        Forward,
        true,
        "Contact parameters are the registrar's business",
    ),
    (
        "regescrt",
        "3.3.14",
        Forward,
        true,
        "Contact URI headers are the registrar's business",
    ),
    (
        "sdp01",
        "3.3.15",
        Forward,
        true,
        "Accept is the endpoints' business",
    ),
    (
        "inv2543",
        "3.4.1",
        Forward,
        false,
        "RFC 2543 request: no branch, no Max-Forwards, no Content-Length",
    ),
];

fn fixture(stem: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/sip/rfc4475")
        .join(format!("{stem}.sip"));
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The status code of a response, if `b` is one.
fn code(b: &[u8]) -> Option<u16> {
    scan(b).ok()?.status_code()
}

fn call_id(b: &[u8]) -> String {
    let m = fulcrum::sip::scan_for_reply(b).expect("fixture scans for a reply");
    String::from_utf8_lossy(m.call_id().unwrap_or(b"")).into_owned()
}

/// Every fixture is listed, and each Content-Length that is meant to be right is (a check of
/// the transcription, README).
#[test]
fn fixtures_are_complete_and_consistent() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/sip/rfc4475");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("dir")
        .filter_map(|e| {
            let n = e.ok()?.file_name().into_string().ok()?;
            n.strip_suffix(".sip").map(str::to_owned)
        })
        .collect();
    files.sort();
    let mut listed: Vec<String> = CASES.iter().map(|c| c.0.to_owned()).collect();
    listed.sort();
    assert_eq!(files, listed);
    for (stem, _, _, stream_valid, _) in CASES {
        let b = fixture(stem);
        // Line ends are CRLF, in the head always and in the body unless it is declared binary
        // (mpart01's DER part holds 0x0a octets that are data).
        let head_len = b
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map_or(b.len(), |i| i + 4);
        let binary_body = scan(&b).is_ok_and(|m| {
            m.header(b"Content-Transfer-Encoding")
                .is_some_and(|v| v.eq_ignore_ascii_case(b"binary"))
        });
        let checked = if binary_body { &b[..head_len] } else { &b[..] };
        assert!(
            checked.windows(2).all(|w| w[1] != b'\n' || w[0] == b'\r'),
            "{stem}: bare LF"
        );
        if *stream_valid {
            // Content-Length frames exactly the whole file.
            let f = fulcrum::sip::next_frame(&b, fulcrum::sip::DEFAULT_MAX_MESSAGE);
            assert_eq!(f.map(|f| f.len()), Ok(b.len()), "{stem}");
        }
    }
}

/// Fixtures that are not archive members: each is an archived message completed, with the
/// bytes appended to it (README).
const COMPLETED: &[(&str, &str, &[u8])] = &[("baddn-completed", "baddn", b"\r\n")];

/// Each archived fixture's bytes are the ones the digests of the RFC's archive name
/// (`SHA256SUMS`, `sha256sum -c` format, README): the manifest names every fixture but the
/// completed ones, which are their archived message and the bytes added, nothing else. A
/// change of one byte (an editor, a line-end conversion) fails here.
#[test]
fn fixtures_match_the_archive_digests() {
    use sha2::{Digest, Sha256};
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/sip/rfc4475");
    let manifest = std::fs::read_to_string(dir.join("SHA256SUMS")).expect("SHA256SUMS");
    let mut named = Vec::new();
    let mut failures = Vec::new();
    for line in manifest.lines() {
        let (sum, name) = line.split_once("  ").expect("`SUM  NAME` lines");
        let stem = name.strip_suffix(".sip").expect("NAME.sip");
        let got: String = Sha256::digest(&fixture(stem))
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if got != sum {
            failures.push(format!("{name}: archive {sum}, file {got}"));
        }
        named.push(stem.to_owned());
    }
    assert_eq!(named.len(), 49, "the 49 messages of RFC 4475 §3");
    for (stem, archived, added) in COMPLETED {
        assert!(
            named.iter().any(|n| n == archived),
            "{archived} is archived"
        );
        assert_eq!(
            fixture(stem),
            [fixture(archived).as_slice(), added].concat(),
            "{stem} is {archived} and the bytes added"
        );
        named.push((*stem).to_owned());
    }
    named.sort();
    let mut listed: Vec<String> = CASES.iter().map(|c| c.0.to_owned()).collect();
    listed.sort();
    assert_eq!(
        named, listed,
        "every fixture is archived or completed, once"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `baddn` as archived ends after its last header line (`l: 0` CRLF) with no empty line: the
/// scanner says the header section is not complete, on a datagram (truncated, RFC 3261 §18.3)
/// as for a reply, and a stream waits for more bytes.
#[test]
fn archived_baddn_is_incomplete() {
    use fulcrum::sip::ScanError;
    let b = fixture("baddn");
    assert!(b.ends_with(b"\r\nl: 0\r\n"));
    assert_eq!(scan(&b).err(), Some(ScanError::Incomplete));
    assert_eq!(
        fulcrum::sip::scan_for_reply(&b).err(),
        Some(ScanError::Incomplete)
    );
    assert_eq!(
        fulcrum::sip::next_frame(&b, fulcrum::sip::DEFAULT_MAX_MESSAGE),
        Err(fulcrum::sip::FrameError::Incomplete)
    );
    let completed = fixture("baddn-completed");
    let m = scan(&completed).expect("the completed one scans");
    assert_eq!(m.content_length(), Some(0));
}

/// A UDP client on `ip` at `port` (a reply goes to the Via sent-by port when the request
/// asks for no rport, RFC 3261 §18.2.2).
fn udp_at(ip: &str, port: u16) -> UdpSocket {
    let s = UdpSocket::bind((ip, port)).expect("bind test socket");
    s.set_read_timeout(Some(Duration::from_millis(20)))
        .expect("timeout");
    s
}

/// The first datagram on any of `socks` within `wait`.
fn recv_any(socks: &[&UdpSocket], wait: Duration) -> Option<Vec<u8>> {
    let deadline = std::time::Instant::now() + wait;
    let mut buf = vec![0u8; 65_536];
    while std::time::Instant::now() < deadline {
        for s in socks {
            if let Ok((n, _)) = s.recv_from(&mut buf) {
                return Some(buf[..n].to_vec());
            }
        }
    }
    None
}

#[test]
fn every_message_over_sip_udp() {
    // A loopback address of its own, so that the Via ports (5060, 5050) can be bound.
    let ip = "127.44.75.1";
    let service = udp_at("127.0.0.1", 0);
    let svc = service.local_addr().expect("addr");
    // The stateless proxy's answer to each message: a held INVITE would add fulcrum's 100
    // (Trying) to what this test reads (failover is tested in tests/failover.rs).
    let (_rt, proxy) = common::start_over(
        "sip-udp",
        "127.0.0.1:0",
        "call_id_hash",
        "failover: off",
        &[("s0".to_owned(), svc)],
    );
    let client = udp_at(ip, 5060);
    let client_5050 = udp_at(ip, 5050);
    // TLS in a Via without a port means 5061 (RFC 3261 §18.2.2 with §19.1.2's default).
    let client_5061 = udp_at(ip, 5061);
    let replies = [&client, &client_5050, &client_5061];
    let marker = |i: usize| {
        format!(
            "OPTIONS sip:m@example.com SIP/2.0\r\nVia: SIP/2.0/UDP {ip}:5060;branch=z9hG4bKmark{i}\r\nMax-Forwards: 70\r\nFrom: <sip:m@x>;tag=m\r\nTo: <sip:m@example.com>\r\nCall-ID: marker-{i}\r\nCSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n"
        )
    };
    let wait = Duration::from_secs(3);
    let mut failures = Vec::new();
    for (i, (stem, section, want, _, reason)) in CASES.iter().enumerate() {
        let msg = fixture(stem);
        client.send_to(&msg, proxy).expect("send");
        let got = match want {
            Forward => match recv_any(&[&service], wait) {
                Some(fwd) => {
                    let m = scan(&fwd).expect("a forwarded request scans");
                    let ok = m.call_id().map(|c| c.to_vec()) == Some(call_id(&msg).into_bytes())
                        && m.top_via().is_some_and(|v| {
                            v.branch.is_some_and(|b| b.starts_with(b"z9hG4bK-fc-"))
                        });
                    if ok { Forward } else { Drop }
                }
                None => recv_any(&replies, Duration::ZERO)
                    .and_then(|r| code(&r))
                    .map_or(Drop, Reply),
            },
            Reply(_) => match recv_any(&replies, wait).and_then(|r| code(&r)) {
                Some(c) => Reply(c),
                None => recv_any(&[&service], Duration::ZERO).map_or(Drop, |_| Forward),
            },
            Drop => {
                client.send_to(marker(i).as_bytes(), proxy).expect("marker");
                match recv_any(&[&service], wait) {
                    Some(first) if call_id(&first) == format!("marker-{i}") => {
                        recv_any(&replies, Duration::from_millis(50))
                            .and_then(|r| code(&r))
                            .map_or(Drop, Reply)
                    }
                    _ => Forward,
                }
            }
        };
        if got != *want {
            failures.push(format!(
                "{stem} (RFC 4475 §{section}, {reason}): want {want:?}, got {got:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn stream_valid_messages_over_sip_tcp() {
    let uas = TcpUas::start();
    let (_rt, proxy) = common::start_over(
        "sip-tcp",
        "127.0.0.1:0",
        "call_id_hash",
        "",
        &[("s0".to_owned(), uas.addr)],
    );
    let mut failures = Vec::new();
    for (stem, section, want, stream_valid, reason) in CASES {
        if !stream_valid {
            continue;
        }
        let msg = fixture(stem);
        let mut conn = TcpStream::connect(proxy).expect("connect");
        conn.write_all(&msg).expect("write");
        let mut buf = Vec::new();
        // The final answer: fulcrum holds an INVITE (failover) and answers it 100 first.
        let mut next = next_message(&mut conn, &mut buf, Duration::from_secs(5));
        while let Next::Message(r) = &next
            && code(r).is_some_and(|c| c < 200)
        {
            next = next_message(&mut conn, &mut buf, Duration::from_secs(5));
        }
        let got = match next {
            Next::Message(r) => match code(&r) {
                // The service's answer to a forwarded request.
                Some(200) if !uas.methods_of(&call_id(&msg)).is_empty() => Forward,
                Some(c) => Reply(c),
                None => Drop,
            },
            Next::Timeout | Next::Closed => Drop,
        };
        if got != *want {
            failures.push(format!(
                "{stem} (RFC 4475 §{section}, {reason}): want {want:?}, got {got:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The Unsupported header of fulcrum's 420 lists the Proxy-Require tags (RFC 3261 §16.3
/// step 5, RFC 4475 §3.3.5).
#[test]
fn bad_extension_lists_the_proxy_require_tags() {
    let uas = TcpUas::start();
    let (_rt, proxy) = common::start_over(
        "sip-tcp",
        "127.0.0.1:0",
        "call_id_hash",
        "",
        &[("s0".to_owned(), uas.addr)],
    );
    let mut conn = TcpStream::connect(proxy).expect("connect");
    conn.write_all(&fixture("bext01")).expect("write");
    let mut buf = Vec::new();
    let Next::Message(r) = next_message(&mut conn, &mut buf, Duration::from_secs(5)) else {
        panic!("no answer")
    };
    let m = scan(&r).expect("scans");
    assert_eq!(m.status_code(), Some(420));
    assert_eq!(
        m.header(b"Unsupported"),
        Some(&b"noProxiesSupportThis, norDoAnyProxiesSupportThis"[..])
    );
}
