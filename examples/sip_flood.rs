//! A SIP OPTIONS flooder for `bench/flood.sh`: one source address sending out-of-dialog
//! OPTIONS (RFC 3261 §11), each with a fresh Call-ID, branch and From tag, at a target rate
//! paced by a token bucket, bounded in time and in count.
//!
//! `sip_flood SRC_IP TARGET RATE SECONDS MAX`: binds `SRC_IP:0` (any 127.0.0.0/8 address
//! is on `lo`), sends to TARGET (`IP:PORT`) at RATE datagrams/s (0 = as fast as it can) for
//! at most SECONDS seconds and at most MAX datagrams, then prints one line:
//!
//! `flood sent=N seconds=S rate=R errors=E answered=A`
//!
//! (datagrams sent, seconds spent sending, achieved rate, failed sends, responses received on
//! the flooder's socket, counted by a second thread up to half a second after the last send).
//!
//! The pacer: tokens accrue at RATE per second up to a bucket of 20 ms worth (at least one);
//! every whole token is one datagram; with none, the sender sleeps until the next is due, so a
//! descheduled sender catches up by at most one bucket instead of bursting without bound.
//!
//! `cargo build --release --example sip_flood && target/release/examples/sip_flood 127.0.0.3 127.0.0.1:5060 20000 10 1000000`

use std::io::Write;
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One OPTIONS, numbered `i`, into `buf` (cleared first).
fn options(buf: &mut Vec<u8>, i: u64, pid: u32, from: SocketAddr, to: SocketAddr) {
    buf.clear();
    let _ = write!(
        buf,
        "OPTIONS sip:probe@{to} SIP/2.0\r\n\
         Via: SIP/2.0/UDP {from};branch=z9hG4bK-fl{pid}-{i};rport\r\n\
         Max-Forwards: 70\r\n\
         From: <sip:scan@{from}>;tag=fl{i}\r\n\
         To: <sip:probe@{to}>\r\n\
         Call-ID: flood-{pid}-{i}@{from}\r\n\
         CSeq: 1 OPTIONS\r\n\
         Content-Length: 0\r\n\r\n"
    );
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: sip_flood SRC_IP TARGET RATE SECONDS MAX";
    if args.len() != 5 {
        anyhow::bail!(usage);
    }
    let src: std::net::IpAddr = args[0].parse()?;
    let target: SocketAddr = args[1].parse()?;
    let rate: u64 = args[2].parse()?;
    let seconds: f64 = args[3].parse()?;
    let max: u64 = args[4].parse()?;
    let limit = Duration::from_secs_f64(seconds);

    let sock = UdpSocket::bind(SocketAddr::new(src, 0))?;
    let from = sock.local_addr()?;
    let pid = std::process::id();

    // Responses (what got through the proxy and was answered), counted on a second thread.
    let answered = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let receiver = {
        let rx = sock.try_clone()?;
        rx.set_read_timeout(Some(Duration::from_millis(100)))?;
        let (answered, done) = (Arc::clone(&answered), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 65_536];
            let mut quiet_since: Option<Instant> = None;
            loop {
                match rx.recv_from(&mut buf) {
                    Ok(_) => {
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) if done.load(Ordering::Relaxed) => {
                        let t = *quiet_since.get_or_insert_with(Instant::now);
                        if t.elapsed() >= Duration::from_millis(500) {
                            break;
                        }
                    }
                    Err(_) => {}
                }
            }
        })
    };

    let bucket = (rate / 50).max(1) as f64;
    let mut tokens = bucket;
    let mut buf = Vec::with_capacity(512);
    let (mut sent, mut errors) = (0u64, 0u64);
    let start = Instant::now();
    let mut last = start;
    'send: while sent < max {
        let now = Instant::now();
        if now.duration_since(start) >= limit {
            break;
        }
        let n = if rate == 0 {
            64
        } else {
            tokens = (tokens + now.duration_since(last).as_secs_f64() * rate as f64).min(bucket);
            last = now;
            if tokens < 1.0 {
                std::thread::sleep(Duration::from_secs_f64((1.0 - tokens) / rate as f64));
                continue;
            }
            let n = tokens as u64;
            tokens -= n as f64;
            n
        };
        for _ in 0..n {
            if sent >= max {
                break 'send;
            }
            options(&mut buf, sent, pid, from, target);
            if sock.send_to(&buf, target).is_err() {
                errors += 1;
            }
            sent += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let _ = receiver.join();
    println!(
        "flood sent={sent} seconds={secs:.2} rate={:.0} errors={errors} answered={}",
        sent as f64 / secs.max(1e-9),
        answered.load(Ordering::Relaxed)
    );
    Ok(())
}
