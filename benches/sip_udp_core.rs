//! CPU cost of the sip-udp decision and rewrite (`SipCore::handle`), without sockets:
//! one whole call (INVITE, 180, 200, ACK, BYE, 200 — the six messages a proxy carries) per
//! iteration, each call with a new Call-ID, so the dialog table grows as under real load.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
#[path = "common/sip_calls.rs"]
mod sip_calls;

use fulcrum::core::sip::Action;
use sip_calls::{request, response};
use std::hint::black_box;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

fn bench(c: &mut Criterion) {
    let core = sip_calls::core(false);
    let client: SocketAddr = "127.0.0.1:5070".parse().expect("addr");
    let dst: SocketAddr = "127.0.0.1:5060".parse().expect("addr");
    let mut out = Vec::with_capacity(65_536);
    let mut now: u64 = 1;
    let mut n: u64 = 0;
    let mut g = c.benchmark_group("sip_udp_core");
    g.throughput(Throughput::Elements(6));
    // Only `handle` is timed: building the test messages is not the proxy's work.
    g.bench_function("call_6_messages", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            let mut timed = |msg: &[u8], src: SocketAddr, now: u64, out: &mut Vec<u8>| {
                let t = Instant::now();
                let a = black_box(core.handle_datagram(msg, src, dst, now, out));
                spent += t.elapsed();
                a
            };
            for _ in 0..iters {
                n += 1;
                if n.is_multiple_of(1024) {
                    // The runtime's sweeper: keeps the table at its real steady-state size.
                    core.sweep(now);
                }
                now += 250_000; // 4 000 calls/s of simulated time
                let inv = request("INVITE", n, &format!("z9hG4bK-i{n}"), "", "1 INVITE", true);
                let Action::ToMember(m) = timed(&inv, client, now, &mut out) else {
                    panic!("INVITE not forwarded")
                };
                let svc = core.member_addr(m).expect("member address");
                let fwd = out.clone();
                for st in ["180 Ringing", "200 OK"] {
                    timed(&response(&fwd, st), svc, now, &mut out);
                }
                let ack = request(
                    "ACK",
                    n,
                    &format!("z9hG4bK-a{n}"),
                    ";tag=uas1",
                    "1 ACK",
                    false,
                );
                timed(&ack, client, now, &mut out);
                let bye = request(
                    "BYE",
                    n,
                    &format!("z9hG4bK-b{n}"),
                    ";tag=uas1",
                    "2 BYE",
                    false,
                );
                timed(&bye, client, now, &mut out);
                let fwd = out.clone();
                timed(&response(&fwd, "200 OK"), svc, now, &mut out);
            }
            spent
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(Duration::from_secs(4));
    targets = bench
}
criterion_main!(benches);
