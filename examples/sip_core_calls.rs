//! Instructions per SIP message of the sip-udp decision and rewrite (`SipCore::handle`),
//! without sockets, for a fixed number of calls: the calls of `benches/sip_udp_core.rs`
//! (INVITE, 180, 200, ACK, BYE, 200, a new Call-ID each) driven N times, so that callgrind
//! counts a repeatable total whatever else the machine is doing:
//!
//! `cargo build --release --example sip_core_calls && valgrind --tool=callgrind
//! --callgrind-out-file=cg.out target/release/examples/sip_core_calls 10000 [rr]`
//!
//! then `callgrind_annotate --inclusive=yes cg.out | grep 'SipCore::handle_datagram '`:
//! instructions per message = that count / (6 × N); `rr` turns Record-Route on. `fo` turns
//! failover on (the default of a sip-udp vserver): every message goes through
//! `SipCore::handle_datagram_stateful` (its inclusive count is the one to read), the INVITE is
//! held until its 200, and the held requests' timers are run as the shell's thread would.

#[path = "../benches/common/sip_calls.rs"]
mod sip_calls;

use fulcrum::core::sip::Action;
use sip_calls::{core, request, response};
use std::hint::black_box;
use std::net::SocketAddr;

fn main() {
    let mut args = std::env::args().skip(1);
    let calls: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let flags: Vec<String> = args.collect();
    let failover = flags.iter().any(|f| f == "fo");
    let mut core = core(flags.iter().any(|f| f == "rr"));
    if failover {
        core = core.with_failover(Some(Default::default()), Default::default());
    }
    let mut sends = Vec::new();
    // Every message through the path the sip-udp worker takes.
    let handle = |core: &fulcrum::core::sip::SipCore,
                  bytes: &[u8],
                  src: SocketAddr,
                  now: u64,
                  out: &mut Vec<u8>,
                  sends: &mut Vec<_>| {
        if failover {
            core.handle_datagram_stateful(bytes, src, dst_addr(), now, out, sends)
        } else {
            core.handle_datagram(bytes, src, dst_addr(), now, out)
        }
    };
    let client: SocketAddr = "127.0.0.1:5070".parse().expect("addr");
    let mut out = Vec::with_capacity(65_536);
    let mut now: u64 = 1;
    for n in 1..=calls {
        if n.is_multiple_of(1024) {
            core.sweep(now);
        }
        if failover && n.is_multiple_of(64) {
            core.poll_transactions(now, &mut sends);
        }
        sends.clear();
        now += 250_000;
        let inv = request("INVITE", n, &format!("z9hG4bK-i{n}"), "", "1 INVITE", true);
        let Action::ToMember(m) = black_box(handle(&core, &inv, client, now, &mut out, &mut sends))
        else {
            panic!("INVITE not forwarded")
        };
        let svc = core.member_addr(m).expect("member address");
        let fwd = out.clone();
        for st in ["180 Ringing", "200 OK"] {
            black_box(handle(
                &core,
                &response(&fwd, st),
                svc,
                now,
                &mut out,
                &mut sends,
            ));
        }
        let ack = request(
            "ACK",
            n,
            &format!("z9hG4bK-a{n}"),
            ";tag=uas1",
            "1 ACK",
            false,
        );
        black_box(handle(&core, &ack, client, now, &mut out, &mut sends));
        let bye = request(
            "BYE",
            n,
            &format!("z9hG4bK-b{n}"),
            ";tag=uas1",
            "2 BYE",
            false,
        );
        black_box(handle(&core, &bye, client, now, &mut out, &mut sends));
        let fwd = out.clone();
        black_box(handle(
            &core,
            &response(&fwd, "200 OK"),
            svc,
            now,
            &mut out,
            &mut sends,
        ));
    }
    println!("{calls} calls, {} messages", calls * 6);
}

fn dst_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 5060))
}
