//! Every entry point of the message layer on arbitrary bytes: the scanner (and the lenient
//! scan a refused request is answered from), the stateless rewrites (and that what they write
//! scans again), TCP framing, the HTTP head parser and key extraction for every hash method.
//! Nothing may panic.
#![no_main]

use std::net::SocketAddr;

use fulcrum::config::{HashParams, Method, TokenRule};
use fulcrum::http::parse_head;
use fulcrum::key::{Payload, RequestCtx, extract};
use fulcrum::sip::{
    Local, MAX_HEADERS, Reply, RequestRewrite, Transport, build_reply, build_response,
    forward_request, forward_response, next_frame, reply_target, request_target, routed_service,
    scan, scan_for_reply,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let src: SocketAddr = "[::ffff:198.51.100.7]:40000".parse().unwrap();
    let dst: SocketAddr = "192.0.2.1:5060".parse().unwrap();
    let local = Local::new("192.0.2.1", 5060, Transport::Udp);
    let _ = next_frame(data, 65536);
    let sip = scan(data).ok();
    // A message the scanner refuses (more lines than it reads, say) that fulcrum still answers:
    // the answer is one it would read itself.
    if sip.is_none()
        && let Ok(m) = scan_for_reply(data)
    {
        let mut out = Vec::new();
        if build_reply(&m, &Reply::MESSAGE_TOO_LARGE, src, &mut out).is_ok() {
            let r = scan(&out).expect("a reply to a refused request scans");
            assert!(r.header_count() <= MAX_HEADERS);
        }
    }
    if let Some(m) = &sip {
        let mut out = Vec::new();
        let rw = RequestRewrite {
            local: &local,
            src,
            record_route: true,
            force_rport: data.len() % 2 == 0,
            conn_id: Some(data.len() as u64),
            service: (data.len() % 3 == 0).then_some(0x0123_4567_89ab_cdef),
            arrived_on: None,
            flow: None,
            path: None,
        };
        if forward_request(m, &rw, &mut out).is_ok() {
            let again = scan(&out).expect("a forwarded request scans");
            assert_eq!(again.call_id(), m.call_id());
        }
        out.clear();
        if build_response(m, &Reply::service_unavailable(5), &mut out).is_ok() {
            scan(&out).expect("a built response scans");
        }
        out.clear();
        if forward_response(m, &local, &mut out).is_ok() {
            scan(&out).expect("a forwarded response scans");
        }
        let _ = request_target(m, &local);
        let _ = routed_service(m, &local);
        let _ = reply_target(m, src);
        let _ = m.vias().count();
        let _ = m.routes().count();
    }
    let http = parse_head(data).ok();
    let mut payloads = vec![Payload::Raw(data), Payload::None];
    if let Some(m) = &sip {
        payloads.push(Payload::Sip(m));
    }
    if let Some(h) = &http {
        payloads.push(Payload::Http(h));
    }
    let rules = [
        TokenRule::Header("X-Tenant".into()),
        TokenRule::Query("sid".into()),
        TokenRule::Payload {
            offset: 3,
            length: 8,
        },
    ];
    for payload in payloads {
        let ctx = RequestCtx { src, dst, payload };
        for (_, method) in Method::ALL {
            for rule in &rules {
                let params = HashParams {
                    hash_length: 1 + data.len() % 100,
                    token: Some(rule.clone()),
                    ..HashParams::default()
                };
                let _ = extract(method, &params, &ctx);
            }
        }
    }
});
