//! Golden tests over `fixtures/sip/*.sip`, and a cross-check against rsip.

use std::path::PathBuf;

use fulcrum::sip::{ScanError, SipMethod, StartLine, scan};

fn fixture(name: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/sip")
        .join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

type ViaParts = (&'static str, &'static str, Option<u16>, &'static str);

/// What a fixture must scan to.
struct Golden {
    file: &'static str,
    start: &'static str,
    call_id: &'static str,
    cseq: Option<(u32, &'static str)>,
    /// (transport, host, port, branch) of every Via value in order.
    vias: &'static [ViaParts],
    max_forwards: Option<u32>,
    content_length: Option<usize>,
    body_len: usize,
    to_host: Option<&'static str>,
}

/// The Call-ID of the RFC 3665 call from pc33.atlanta.example.com (several fixtures).
const ATLANTA_CALL: &str = "a84b4c76e66710@pc33.atlanta.example.com";
/// That call's UAC Via, and the proxy's Via stacked above it on the responses.
const UAC_VIA: ViaParts = (
    "UDP",
    "pc33.atlanta.example.com",
    Some(5060),
    "z9hG4bK776asdhds",
);
const PROXY_VIA: ViaParts = (
    "UDP",
    "192.0.2.1",
    Some(5060),
    "z9hG4bK-fc-0123456789abcdef",
);

/// What a request scans to unless its entry says otherwise: Max-Forwards 70, no body. Every
/// entry of [`GOLDEN`] names its own `file`, `start`, `call_id`, `cseq`, `vias` and `to_host`.
const REQUEST: Golden = Golden {
    file: "",
    start: "",
    call_id: "",
    cseq: None,
    vias: &[],
    max_forwards: Some(70),
    content_length: Some(0),
    body_len: 0,
    to_host: None,
};
/// A response: no Max-Forwards (and, where an entry does not say otherwise, no body).
const RESPONSE: Golden = Golden {
    max_forwards: None,
    ..REQUEST
};

const GOLDEN: &[Golden] = &[
    Golden {
        file: "invite.sip",
        start: "INVITE sip:bob@biloxi.example.com",
        call_id: ATLANTA_CALL,
        cseq: Some((314159, "INVITE")),
        vias: &[UAC_VIA],
        content_length: Some(149),
        body_len: 149,
        to_host: Some("biloxi.example.com"),
        ..REQUEST
    },
    Golden {
        file: "ack.sip",
        start: "ACK sip:bob@192.0.2.4",
        call_id: ATLANTA_CALL,
        cseq: Some((314159, "ACK")),
        vias: &[("UDP", "pc33.atlanta.example.com", None, "z9hG4bKnashds9")],
        to_host: Some("biloxi.example.com"),
        ..REQUEST
    },
    Golden {
        file: "bye.sip",
        start: "BYE sip:alice@pc33.atlanta.example.com",
        call_id: ATLANTA_CALL,
        cseq: Some((231, "BYE")),
        vias: &[("UDP", "192.0.2.4", None, "z9hG4bKnashds10")],
        to_host: Some("atlanta.example.com"),
        ..REQUEST
    },
    Golden {
        file: "cancel.sip",
        start: "CANCEL sip:bob@biloxi.example.com",
        call_id: ATLANTA_CALL,
        cseq: Some((314159, "CANCEL")),
        vias: &[UAC_VIA],
        to_host: Some("biloxi.example.com"),
        ..REQUEST
    },
    Golden {
        file: "options.sip",
        start: "OPTIONS sip:carol@chicago.example.com",
        call_id: "a84b4c76e66710",
        cseq: Some((63104, "OPTIONS")),
        vias: &[(
            "UDP",
            "pc33.atlanta.example.com",
            None,
            "z9hG4bKhjhs8ass877",
        )],
        to_host: Some("chicago.example.com"),
        ..REQUEST
    },
    Golden {
        file: "register.sip",
        start: "REGISTER sip:registrar.biloxi.example.com",
        call_id: "843817637684230@998sdasdh09",
        cseq: Some((1826, "REGISTER")),
        vias: &[(
            "UDP",
            "bobspc.biloxi.example.com",
            Some(5060),
            "z9hG4bKnashds7",
        )],
        to_host: Some("biloxi.example.com"),
        ..REQUEST
    },
    Golden {
        file: "response_180.sip",
        start: "180",
        call_id: ATLANTA_CALL,
        cseq: Some((314159, "INVITE")),
        vias: &[PROXY_VIA, UAC_VIA],
        to_host: Some("biloxi.example.com"),
        ..RESPONSE
    },
    Golden {
        file: "response_200.sip",
        start: "200",
        call_id: ATLANTA_CALL,
        cseq: Some((314159, "INVITE")),
        vias: &[PROXY_VIA, UAC_VIA],
        content_length: Some(140),
        body_len: 140,
        to_host: Some("biloxi.example.com"),
        ..RESPONSE
    },
    Golden {
        file: "compact.sip",
        start: "INVITE sip:bob@biloxi.example.com",
        call_id: "compact-call-1@192.0.2.10",
        cseq: Some((1, "INVITE")),
        vias: &[("UDP", "192.0.2.10", Some(5062), "z9hG4bKcompact1")],
        to_host: Some("Biloxi.Example.com"),
        ..REQUEST
    },
    Golden {
        file: "folded.sip",
        start: "OPTIONS sip:carol@chicago.example.com",
        call_id: "folded-1@pc33.atlanta.example.com",
        cseq: Some((9, "OPTIONS")),
        vias: &[("UDP", "pc33.atlanta.example.com", None, "z9hG4bKfolded1")],
        to_host: Some("chicago.example.com"),
        ..REQUEST
    },
    Golden {
        file: "multi_via.sip",
        start: "200",
        call_id: "multivia-1@example.com",
        cseq: Some((2, "BYE")),
        vias: &[
            ("UDP", "192.0.2.1", None, "z9hG4bK-fc-aaaa"),
            ("TCP", "proxy2.example.com", Some(5070), "z9hG4bKp2"),
            ("UDP", "2001:db8::5", Some(5080), "z9hG4bKp3"),
            ("UDP", "client.example.com", None, "z9hG4bKp4"),
        ],
        to_host: Some("example.com"),
        ..RESPONSE
    },
    Golden {
        file: "ipv6.sip",
        start: "REGISTER sip:[2001:db8::10]",
        call_id: "SSG9559905523997077@hlau_4100",
        cseq: Some((98176, "REGISTER")),
        vias: &[("UDP", "2001:db8::9:1", None, "z9hG4bKas3-111")],
        to_host: Some("example.com"),
        ..REQUEST
    },
    Golden {
        file: "rfc4475_wsinv.sip",
        start: "INVITE sip:vivekg@chair-dnrc.example.com;unknownparam",
        call_id: "wsinv.ndaksdj@192.0.2.1",
        cseq: Some((9, "INVITE")),
        vias: &[
            ("UDP", "192.0.2.2", None, "390skdjuw"),
            ("TCP", "spindle.example.com", None, "z9hG4bK9ikj8"),
            ("UDP", "192.168.255.111", None, "z9hG4bK30239"),
        ],
        max_forwards: Some(68),
        content_length: Some(150),
        body_len: 150,
        to_host: Some("chair-dnrc.example.com"),
    },
    Golden {
        file: "rfc4475_lwsdisp.sip",
        start: "OPTIONS sip:user@example.com",
        call_id: "lwsdisp.1234abcd@funky.example.com",
        cseq: Some((60, "OPTIONS")),
        vias: &[("UDP", "funky.example.com", None, "z9hG4bKkdjuw")],
        to_host: Some("example.com"),
        ..REQUEST
    },
    Golden {
        file: "rfc4475_dblreq.sip",
        start: "REGISTER sip:example.com",
        call_id: "dblreq.0ha0isndaksdj99sdfafnl3lk233412",
        cseq: Some((8, "REGISTER")),
        vias: &[("UDP", "192.0.2.125", None, "z9hG4bKkdjuw23492")],
        max_forwards: Some(8),
        to_host: Some("example.com"),
        ..REQUEST
    },
    Golden {
        file: "rfc4475_mismatch01.sip",
        start: "OPTIONS sip:user@example.com",
        call_id: "mismatch01.dj0234sxdfl3",
        cseq: Some((8, "INVITE")),
        vias: &[("UDP", "host.example.com", None, "z9hG4bKkdjuw")],
        max_forwards: Some(6),
        to_host: Some("example.com"),
        ..REQUEST
    },
];

const BROKEN: &[(&str, ScanError)] = &[
    ("rfc4475_clerr.sip", ScanError::Incomplete),
    ("rfc4475_ncl.sip", ScanError::BadContentLength),
    ("rfc4475_badvers.sip", ScanError::BadVersion),
    ("rfc4475_bigcode.sip", ScanError::BadStartLine),
    ("truncated.sip", ScanError::Incomplete),
    ("no_crlf.sip", ScanError::Incomplete),
    ("too_many_vias.sip", ScanError::TooManyHeaders),
];

fn s(b: &[u8]) -> &str {
    std::str::from_utf8(b).expect("fixture text is UTF-8")
}

#[test]
fn golden_fixtures() {
    for g in GOLDEN {
        let bytes = fixture(g.file);
        let m = scan(&bytes).unwrap_or_else(|e| panic!("{}: {e}", g.file));
        let start = match m.start_line() {
            StartLine::Request { method, uri } => format!("{} {}", s(method), s(uri)),
            StartLine::Response { code, .. } => code.to_string(),
        };
        assert_eq!(start, g.start, "{}", g.file);
        assert_eq!(m.call_id().map(s), Some(g.call_id), "{}", g.file);
        assert_eq!(m.cseq().map(|c| (c.seq, s(c.method))), g.cseq, "{}", g.file);
        let vias: Vec<_> = m
            .vias()
            .map(|v| {
                (
                    s(v.transport),
                    s(v.host),
                    v.port,
                    s(v.branch.unwrap_or_default()),
                )
            })
            .collect();
        assert_eq!(vias, g.vias, "{}", g.file);
        assert_eq!(m.max_forwards().value(), g.max_forwards, "{}", g.file);
        assert_eq!(m.content_length(), g.content_length, "{}", g.file);
        assert_eq!(m.body().len(), g.body_len, "{}", g.file);
        assert_eq!(m.to_host().map(s), g.to_host, "{}", g.file);
        assert_eq!(m.missing_mandatory(), None, "{}", g.file);
    }
}

#[test]
fn golden_broken() {
    for (file, err) in BROKEN {
        assert_eq!(scan(&fixture(file)).err(), Some(*err), "{file}");
    }
    assert!(scan(&fixture("binary.sip")).is_err(), "binary.sip");
}

#[test]
fn fixture_details() {
    let b = fixture("rfc4475_dblreq.sip");
    let m = scan(&b).unwrap();
    // RFC 4475 §3.1.1.8: the INVITE after the REGISTER is not part of the message.
    assert_eq!(m.method_kind(), SipMethod::Register);
    assert!(m.len() < b.len());
    assert!(!m.as_bytes().windows(6).any(|w| w == b"INVITE"));

    let b = fixture("rfc4475_wsinv.sip");
    let m = scan(&b).unwrap();
    assert_eq!(m.from_tag(), Some(&b"98asjd8"[..]));
    assert_eq!(m.to_tag(), Some(&b"1918181833n"[..]));
    assert_eq!(
        m.route_uri(),
        Some(&b"sip:services.example.com;lr;unknownwith=value;unknown-no-value"[..])
    );
    assert_eq!(
        m.header(b"newfangledheader"),
        Some(&b"newfangled value\r\n continued newfangled value"[..])
    );
    assert!(m.contact().unwrap().starts_with(b"\"Quoted string"));

    let b = fixture("multi_via.sip");
    let m = scan(&b).unwrap();
    let v: Vec<_> = m.vias().collect();
    assert_eq!(v[1].received, Some(&b"192.0.2.77"[..]));
    assert_eq!(v[2].rport, fulcrum::sip::Rport::Filled(5999));
    assert_eq!(v[2].received, Some(&b"2001:db8::99"[..]));

    let b = fixture("ipv6.sip");
    let m = scan(&b).unwrap();
    let u = fulcrum::sip::parse_uri(m.request_uri().unwrap()).unwrap();
    assert_eq!(u.host, b"2001:db8::10");
    assert!(
        m.contact()
            .unwrap()
            .ends_with(b"<sip:caller@[2001:db8::1]>")
    );
}

/// Every prefix of every fixture scans and frames to a value or an error, never a panic.
#[test]
fn prefixes_never_panic() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/sip");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "sip") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        for cut in 0..=bytes.len() {
            let _ = scan(&bytes[..cut]);
            let _ = fulcrum::sip::next_frame(&bytes[..cut], 65536);
        }
    }
}

/// The scanner agrees with rsip on Call-ID, CSeq and the top Via branch.
#[test]
fn agrees_with_rsip() {
    use rsip::prelude::*;
    let mut compared = 0;
    for g in GOLDEN {
        // rsip 0.4 knows no compact forms, folded lines or IPv6 references, and rejects parts of
        // the torture messages.
        if matches!(g.file, "compact.sip" | "folded.sip" | "ipv6.sip")
            || g.file.starts_with("rfc4475_")
        {
            continue;
        }
        let bytes = fixture(g.file);
        let ours = scan(&bytes).unwrap();
        let theirs = rsip::SipMessage::try_from(&bytes[..])
            .unwrap_or_else(|e| panic!("rsip on {}: {e}", g.file));
        let call_id = theirs.call_id_header().unwrap().value().to_string();
        assert_eq!(ours.call_id().map(s), Some(call_id.as_str()), "{}", g.file);
        let cseq = theirs.cseq_header().unwrap().typed().unwrap();
        assert_eq!(ours.cseq().unwrap().seq, cseq.seq, "{}", g.file);
        assert_eq!(
            s(ours.cseq().unwrap().method),
            cseq.method.to_string(),
            "{}",
            g.file
        );
        let via = theirs.via_header().unwrap().typed().unwrap();
        assert_eq!(
            ours.top_via().unwrap().branch.map(s),
            via.branch().map(|b| b.to_string()).as_deref(),
            "{}",
            g.file
        );
        compared += 1;
    }
    assert!(compared >= 8, "compared only {compared}");
}
