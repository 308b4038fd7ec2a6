//! SIP scanner and stateless rewrite beside rsip, on the same INVITE, in one run; and the
//! stream framing of a message that trickles in a byte per read, resumed (`Framer`, what a
//! connection's reader does) beside framed afresh at every read (`next_frame`).
//!
//! `cargo bench --bench sip_scan`

use std::hint::black_box;
use std::net::SocketAddr;

use criterion::{Criterion, criterion_group, criterion_main};
use fulcrum::config::{HashParams, Method};
use fulcrum::key::{Payload, RequestCtx, extract};
use fulcrum::sip::{
    DEFAULT_MAX_MESSAGE, Framer, Local, RequestRewrite, Transport, forward_request,
    forward_response, next_frame, scan,
};

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
        flow: None,
        path: None,
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
    // The key alone, on a scanned INVITE: the Call-ID as it stands against the canonical
    // address-of-record (parsed, lowercased and copied into an inline key).
    for (name, method) in [
        ("key_call_id_hash", Method::CallIdHash),
        ("key_aor_hash", Method::AorHash),
    ] {
        let params = HashParams::default();
        let m = scan(INVITE).unwrap();
        g.bench_function(name, |b| {
            b.iter(|| {
                let ctx = RequestCtx {
                    src,
                    dst: src,
                    payload: Payload::Sip(black_box(&m)),
                };
                let key = extract(method, &params, &ctx);
                black_box(key.key().map(|k| fulcrum::hash::key_hash(k.as_bytes())));
            })
        });
    }
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
    trickle(c);
}

/// An INVITE of about 4 KiB (padded with 60 header lines) arriving one byte per read: the
/// framing work of all its reads.
fn trickle(c: &mut Criterion) {
    let mut msg = INVITE[..INVITE.len() - 2].to_vec();
    let head_end = memchr_crlf2(&msg);
    let mut padded = msg[..head_end].to_vec();
    for i in 0..60 {
        padded.extend_from_slice(format!("X-Pad-{i:02}: {}\r\n", "p".repeat(48)).as_bytes());
    }
    padded.extend_from_slice(&msg.split_off(head_end));
    padded.extend_from_slice(b"\r\n");
    let msg = padded;
    let mut g = c.benchmark_group("sip_stream_trickle");
    g.bench_function("framer_resumed", |b| {
        b.iter(|| {
            let mut f = Framer::default();
            let mut last = None;
            for n in 1..=msg.len() {
                last = Some(f.frame(black_box(&msg[..n]), DEFAULT_MAX_MESSAGE));
            }
            black_box(last)
        })
    });
    g.bench_function("next_frame_afresh", |b| {
        b.iter(|| {
            let mut last = None;
            for n in 1..=msg.len() {
                last = Some(next_frame(black_box(&msg[..n]), DEFAULT_MAX_MESSAGE));
            }
            black_box(last)
        })
    });
    g.finish();
}

/// Where the header section's closing CRLF starts (the empty line).
fn memchr_crlf2(m: &[u8]) -> usize {
    m.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(m.len(), |i| i + 2)
}

criterion_group!(sip, benches);
criterion_main!(sip);
