//! SIP scanner and stateless rewrite beside rsip, on the same INVITE, in one run.
//!
//! `cargo bench --bench sip_scan`

use std::hint::black_box;
use std::net::SocketAddr;

use criterion::{Criterion, criterion_group, criterion_main};
use fulcrum::config::{HashParams, Method};
use fulcrum::key::{Payload, RequestCtx, extract};
use fulcrum::sip::{Local, RequestRewrite, Transport, forward_request, forward_response, scan};

const INVITE: &[u8] = include_bytes!("../fixtures/sip/invite.sip");
const RESPONSE: &[u8] = include_bytes!("../fixtures/sip/response_200.sip");

fn benches(c: &mut Criterion) {
    let local = Local::new("192.0.2.1", 5060, Transport::Udp);
    let src: SocketAddr = "198.51.100.7:40000".parse().unwrap();
    let rw = RequestRewrite {
        local: &local,
        src,
        record_route: true,
        force_rport: false,
        conn_id: None,
        service: None,
        arrived_on: None,
    };
    let mut g = c.benchmark_group("sip_invite");
    g.bench_function("fulcrum_scan", |b| {
        b.iter(|| {
            let m = scan(black_box(INVITE)).unwrap();
            black_box(m.call_id());
        })
    });
    g.bench_function("fulcrum_scan_key_forward", |b| {
        let mut out = Vec::with_capacity(2048);
        let params = HashParams::default();
        b.iter(|| {
            let m = scan(black_box(INVITE)).unwrap();
            let ctx = RequestCtx {
                src,
                dst: src,
                payload: Payload::Sip(&m),
            };
            black_box(extract(Method::CallIdHash, &params, &ctx));
            out.clear();
            forward_request(&m, &rw, &mut out).unwrap();
            black_box(out.len());
        })
    });
    g.bench_function("fulcrum_scan_forward_response", |b| {
        let mut out = Vec::with_capacity(2048);
        b.iter(|| {
            let m = scan(black_box(RESPONSE)).unwrap();
            out.clear();
            black_box(forward_response(&m, &local, &mut out).unwrap());
        })
    });
    g.bench_function("rsip_parse", |b| {
        b.iter(|| black_box(rsip::SipMessage::try_from(black_box(INVITE)).unwrap()))
    });
    g.finish();
}

criterion_group!(sip, benches);
criterion_main!(sip);
