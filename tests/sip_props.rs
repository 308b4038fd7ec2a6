//! Property tests of the SIP layer: no input makes it panic, and what the rewrite writes is
//! a message the scanner reads back with the promised changes.

use std::net::SocketAddr;
use std::path::PathBuf;

use fulcrum::sip::{
    Local, Reply, RequestRewrite, Transport, build_response, forward_request, forward_response,
    next_frame, reply_target, request_target, route_response, scan,
};
use proptest::prelude::*;

fn fixtures() -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/sip");
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sip"))
        .collect();
    v.sort();
    v.into_iter().map(|p| std::fs::read(p).unwrap()).collect()
}

fn local() -> Local {
    Local::new("192.0.2.1", 5060, Transport::Udp)
}

/// Run every entry point on `bytes`; only panics matter.
fn exercise(bytes: &[u8], src: SocketAddr) {
    let _ = next_frame(bytes, 65536);
    let Ok(m) = scan(bytes) else { return };
    let l = local();
    let mut out = Vec::new();
    let rw = RequestRewrite {
        local: &l,
        src,
        record_route: true,
        force_rport: true,
        conn_id: Some(7),
        service: None,
        arrived_on: None,
        flow: None,
        path: None,
    };
    if forward_request(&m, &rw, &mut out).is_ok() {
        // Our output must scan again.
        let again = scan(&out).expect("forwarded request scans");
        assert_eq!(again.call_id(), m.call_id());
    }
    out.clear();
    let _ = build_response(&m, &Reply::service_unavailable(3), &mut out);
    out.clear();
    let _ = forward_response(&m, &l, &mut out);
    let _ = route_response(&m, &l);
    let _ = request_target(&m, &l);
    let _ = reply_target(&m, src);
    let _ = m.vias().count();
    let _ = m.routes().count();
    let _ = (
        m.to_host(),
        m.from_tag(),
        m.to_tag(),
        m.cseq(),
        m.max_forwards(),
    );
    let _ = m.missing_mandatory();
}

fn arb_src() -> impl Strategy<Value = SocketAddr> {
    prop_oneof![
        Just("198.51.100.7:40000".parse().unwrap()),
        Just("[2001:db8::7]:5060".parse().unwrap()),
        Just("[::ffff:10.0.0.5]:5062".parse().unwrap()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048),
                                   src in arb_src()) {
        exercise(&bytes, src);
    }

    /// Fixtures with bytes replaced, inserted or removed: inputs close to valid messages reach
    /// far deeper than random bytes.
    #[test]
    fn mutated_fixtures_never_panic(idx in 0usize..64,
                                    edits in proptest::collection::vec((any::<u16>(), any::<u8>(), 0u8..3), 1..8),
                                    src in arb_src()) {
        let all = fixtures();
        let mut bytes = all[idx % all.len()].clone();
        for (pos, byte, op) in edits {
            let at = usize::from(pos) % (bytes.len() + 1);
            match op {
                0 if at < bytes.len() => bytes[at] = byte,
                1 => bytes.insert(at, byte),
                _ if at < bytes.len() => { bytes.remove(at); }
                _ => {}
            }
        }
        exercise(&bytes, src);
    }
}

/// Forwarding a request then forwarding the service's response restores the client's view:
/// the Via list is the client's (with received/rport), the target is the client's address.
#[test]
fn request_response_roundtrip_on_fixtures() {
    let l = local();
    let src: SocketAddr = "198.51.100.7:40000".parse().unwrap();
    let mut checked = 0;
    for bytes in fixtures() {
        let Ok(m) = scan(&bytes) else { continue };
        if !m.is_request() || m.missing_mandatory().is_some() {
            continue;
        }
        let rw = RequestRewrite {
            local: &l,
            src,
            record_route: false,
            force_rport: true,
            conn_id: None,
            service: None,
            arrived_on: None,
            flow: None,
            path: None,
        };
        let mut fwd = Vec::new();
        forward_request(&m, &rw, &mut fwd).unwrap();
        let f = scan(&fwd).unwrap();
        assert_eq!(f.vias().count(), m.vias().count() + 1);
        assert_eq!(f.body(), m.body());
        assert_eq!(f.call_id(), m.call_id());
        if m.method_kind() == fulcrum::sip::SipMethod::Ack {
            continue;
        }
        let mut resp = Vec::new();
        build_response(&f, &Reply::service_unavailable(1), &mut resp).unwrap();
        let r = scan(&resp).unwrap();
        let mut back = Vec::new();
        let route = forward_response(&r, &l, &mut back).unwrap();
        assert_eq!(route.target.socket_addr(), Some(src));
        let b = scan(&back).unwrap();
        assert_eq!(b.vias().count(), m.vias().count());
        checked += 1;
    }
    assert!(checked >= 8, "checked only {checked}");
}
