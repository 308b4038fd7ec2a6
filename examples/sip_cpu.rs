//! CPU time of the SIP hot paths, for a machine too loaded for wall-clock benches: run one
//! path 1,000,000 times and read the user time.
//!
//! `cargo build --release --example sip_cpu && /usr/bin/time -f %U target/release/examples/sip_cpu scan`
//! (paths: `scan`, `forward`, `response`, `rsip`; µs per operation = seconds printed).

use fulcrum::config::{HashParams, Method};
use fulcrum::key::{Payload, RequestCtx, extract};
use fulcrum::sip::*;
use std::hint::black_box;
const INVITE: &[u8] = include_bytes!("../fixtures/sip/invite.sip");
const RESPONSE: &[u8] = include_bytes!("../fixtures/sip/response_200.sip");
fn main() {
    let which = std::env::args().nth(1).unwrap_or_default();
    // One million iterations: the user time in seconds reads as µs per operation.
    let n: u64 = 1_000_000;
    let local = Local::new("192.0.2.1", 5060, Transport::Udp);
    let src = "198.51.100.7:40000".parse().unwrap();
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
    let params = HashParams::default();
    let mut out = Vec::with_capacity(4096);
    for _ in 0..n {
        match which.as_str() {
            "scan" => {
                black_box(scan(black_box(INVITE)).unwrap().call_id());
            }
            "forward" => {
                let m = scan(black_box(INVITE)).unwrap();
                let ctx = RequestCtx {
                    src,
                    dst: src,
                    payload: Payload::Sip(&m),
                };
                black_box(extract(Method::CallIdHash, &params, &ctx));
                out.clear();
                forward_request(&m, &rw, &mut out).unwrap();
            }
            "response" => {
                let m = scan(black_box(RESPONSE)).unwrap();
                out.clear();
                black_box(forward_response(&m, &local, &mut out).unwrap());
            }
            "rsip" => {
                black_box(rsip::SipMessage::try_from(black_box(INVITE)).unwrap());
            }
            _ => {}
        }
    }
}
