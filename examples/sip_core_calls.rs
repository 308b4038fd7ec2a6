//! Instructions per SIP message of the sip-udp decision and rewrite (`SipCore::handle`),
//! without sockets, for a fixed number of calls: the calls of `benches/sip_udp_core.rs`
//! (INVITE, 180, 200, ACK, BYE, 200, a new Call-ID each) driven N times, so that callgrind
//! counts a repeatable total whatever else the machine is doing:
//!
//! `cargo build --release --example sip_core_calls && valgrind --tool=callgrind
//! --callgrind-out-file=cg.out target/release/examples/sip_core_calls 10000 [rr]`
//!
//! then `callgrind_annotate --inclusive=yes cg.out | grep 'SipCore::handle_datagram '`:
//! instructions per message = that count / (6 × N); `rr` turns Record-Route on.

#[path = "../benches/common/sip_calls.rs"]
mod sip_calls;

use fulcrum::core::sip::Action;
use sip_calls::{core, request, response};
use std::hint::black_box;
use std::net::SocketAddr;

fn main() {
    let mut args = std::env::args().skip(1);
    let calls: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let core = core(args.next().as_deref() == Some("rr"));
    let client: SocketAddr = "127.0.0.1:5070".parse().expect("addr");
    let dst: SocketAddr = "127.0.0.1:5060".parse().expect("addr");
    let mut out = Vec::with_capacity(65_536);
    let mut now: u64 = 1;
    for n in 1..=calls {
        if n.is_multiple_of(1024) {
            core.sweep(now);
        }
        now += 250_000;
        let inv = request("INVITE", n, &format!("z9hG4bK-i{n}"), "", "1 INVITE", true);
        let Action::ToMember(m) = black_box(core.handle_datagram(&inv, client, dst, now, &mut out))
        else {
            panic!("INVITE not forwarded")
        };
        let svc = core.member_addr(m).expect("member address");
        let fwd = out.clone();
        for st in ["180 Ringing", "200 OK"] {
            black_box(core.handle_datagram(&response(&fwd, st), svc, dst, now, &mut out));
        }
        let ack = request(
            "ACK",
            n,
            &format!("z9hG4bK-a{n}"),
            ";tag=uas1",
            "1 ACK",
            false,
        );
        black_box(core.handle_datagram(&ack, client, dst, now, &mut out));
        let bye = request(
            "BYE",
            n,
            &format!("z9hG4bK-b{n}"),
            ";tag=uas1",
            "2 BYE",
            false,
        );
        black_box(core.handle_datagram(&bye, client, dst, now, &mut out));
        let fwd = out.clone();
        black_box(core.handle_datagram(&response(&fwd, "200 OK"), svc, dst, now, &mut out));
    }
    println!("{calls} calls, {} messages", calls * 6);
}
