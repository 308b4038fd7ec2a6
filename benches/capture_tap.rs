//! What capture costs a data path per message (docs/capture.md): one `Tap::stamp` and one
//! `Capture::tap` of an INVITE, with capture off, toward a collector known to be down (a TCP
//! port nothing listens on: dropped at once), and toward a live UDP collector (the packet
//! written into the queue; the sender thread's sends are not in this figure, see
//! BENCHMARKS.md).
//!
//! `cargo bench --bench capture_tap`

use std::hint::black_box;
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use fulcrum::capture::{Capture, Stamp, Tap, Transport};
use fulcrum::config::{CaptureTransport, HepCapture};

const INVITE: &[u8] = include_bytes!("../fixtures/sip/invite.sip");

fn hep(address: SocketAddr, transport: CaptureTransport) -> HepCapture {
    HepCapture {
        address,
        transport,
        id: 1,
        password: None,
        vservers: None,
        probes: false,
        udp_gso: false,
    }
}

fn bench_taps(c: &mut Criterion, name: &str, capture: Capture) {
    let capture = Arc::new(capture);
    let tap = Tap::new(&capture, "v");
    let (a, b): (SocketAddr, SocketAddr) = (
        "192.0.2.7:40000".parse().unwrap(),
        "192.0.2.1:5060".parse().unwrap(),
    );
    c.bench_function(name, |bn| {
        bn.iter(|| {
            if let Some(at) = tap.stamp() {
                tap.tap(at, Transport::Udp, a, b, black_box(INVITE));
            }
        })
    });
}

fn benches(c: &mut Criterion) {
    bench_taps(c, "tap_off", Capture::new(None));

    // Nothing listens on the port once the listener is dropped: the sender's first connect
    // is refused and the taps drop from then on.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let dead = Capture::new(Some(&hep(port, CaptureTransport::Tcp)));
    let until = Instant::now() + Duration::from_secs(2);
    while dead
        .stats()
        .dropped_send_error
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0
        && Instant::now() < until
    {
        dead.tap("v", Stamp::now(), Transport::Udp, port, port, INVITE);
        std::thread::sleep(Duration::from_millis(10));
    }
    bench_taps(c, "tap_collector_down", dead);

    let sink = UdpSocket::bind("127.0.0.1:0").unwrap();
    let live = Capture::new(Some(&hep(
        sink.local_addr().unwrap(),
        CaptureTransport::Udp,
    )));
    bench_taps(c, "tap_udp_collector_live", live);
}

criterion_group!(capture_tap, benches);
criterion_main!(capture_tap);
