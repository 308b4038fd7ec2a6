//! fulcrum's own load generator for the UDP benchmarks (bench/udp.sh). IO.
//!
//! `fulcrum-load udp TARGET [--sockets N] [--secs S] [--size B] [--warmup S]`: closed loop,
//! one datagram in flight per socket, sockets bound to 127.0.1.x source addresses (so
//! source hashing spreads them); prints `rps= p50_us= p90_us= p99_us= p999_us= max_us= lost=`.
//! A datagram not answered within 200 ms counts as lost and the socket sends again.
//!
//! `fulcrum-load udp-idle TARGET --sockets N`: opens N flows (one datagram each, answered),
//! prints `ready=N`, then holds them until killed (idle-session memory measurement).
//!
//! `fulcrum-load tcp-idle TARGET --sockets N`: the same with N idle TCP connections.

use mio::net::UdpSocket;
use mio::{Events, Interest, Poll, Token};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

const LOSS_TIMEOUT: Duration = Duration::from_millis(200);

struct Args {
    mode: String,
    target: SocketAddr,
    sockets: usize,
    secs: u64,
    warmup: u64,
    size: usize,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mode = it
        .next()
        .ok_or("usage: fulcrum-load udp|udp-idle TARGET [options]")?;
    let target = it
        .next()
        .ok_or("missing TARGET")?
        .parse()
        .map_err(|e| format!("TARGET: {e}"))?;
    let mut a = Args {
        mode,
        target,
        sockets: 256,
        secs: 10,
        warmup: 1,
        size: 64,
    };
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let n: u64 = v.parse().map_err(|e| format!("{flag}: {e}"))?;
        match flag.as_str() {
            "--sockets" => a.sockets = n as usize,
            "--secs" => a.secs = n,
            "--warmup" => a.warmup = n,
            "--size" => a.size = (n as usize).clamp(16, 65_000),
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(a)
}

fn source_ip(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(
        127,
        0,
        1 + (i / 250 % 200) as u8,
        1 + (i % 250) as u8,
    ))
}

fn open(n: usize, target: SocketAddr, poll: &Poll) -> std::io::Result<Vec<UdpSocket>> {
    fulcrum::proxy::fd_limit::raise_nofile_limit();
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let mut s = UdpSocket::bind(SocketAddr::new(source_ip(i), 0))?;
        s.connect(target)?;
        poll.registry()
            .register(&mut s, Token(i), Interest::READABLE)?;
        v.push(s);
    }
    Ok(v)
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&a) {
        eprintln!("fulcrum-load: {e}");
        std::process::exit(1);
    }
}

/// Open `n` TCP connections to `target` and hold them (idle-connection memory).
fn tcp_idle(target: SocketAddr, n: usize) -> std::io::Result<()> {
    fulcrum::proxy::fd_limit::raise_nofile_limit();
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        s.bind(&SocketAddr::new(source_ip(i), 0).into())?;
        s.connect(&target.into())?;
        held.push(s);
    }
    println!("ready={}", held.len());
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn run(a: &Args) -> std::io::Result<()> {
    if a.mode == "tcp-idle" {
        return tcp_idle(a.target, a.sockets);
    }
    let mut poll = Poll::new()?;
    let socks = open(a.sockets, a.target, &poll)?;
    let mut events = Events::with_capacity(1024);
    let start = Instant::now();
    let mut buf = vec![0u8; 65_536];
    let mut payload = vec![b'x'; a.size];
    let stamp = |p: &mut [u8], t: Instant| {
        p[..8].copy_from_slice(&(t.duration_since(start).as_nanos() as u64).to_le_bytes())
    };
    let mut sent_at = vec![start; socks.len()];
    for (i, s) in socks.iter().enumerate() {
        let now = Instant::now();
        stamp(&mut payload, now);
        s.send(&payload)?;
        sent_at[i] = now;
    }
    if a.mode == "udp-idle" {
        let mut answered = vec![false; socks.len()];
        let mut n = 0;
        let end = Instant::now() + Duration::from_secs(30);
        let mut last_resend = Instant::now();
        while n < socks.len() && Instant::now() < end {
            poll.poll(&mut events, Some(Duration::from_millis(100)))?;
            // A burst of thousands of first datagrams can overflow a socket buffer: resend
            // to flows not answered yet (a session is idempotent per flow).
            if last_resend.elapsed() >= Duration::from_millis(500) {
                last_resend = Instant::now();
                for (i, s) in socks.iter().enumerate() {
                    if !answered[i] {
                        let _ = s.send(&payload);
                    }
                }
            }
            for e in events.iter() {
                let i = e.token().0;
                while socks[i].recv(&mut buf).is_ok() {
                    if !answered[i] {
                        answered[i] = true;
                        n += 1;
                    }
                }
            }
        }
        println!("ready={n}");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    let measure_from = start + Duration::from_secs(a.warmup);
    let end = measure_from + Duration::from_secs(a.secs);
    let mut rtts: Vec<u32> = Vec::with_capacity(4_000_000);
    let mut lost = 0u64;
    let mut last_check = Instant::now();
    while Instant::now() < end {
        poll.poll(&mut events, Some(Duration::from_millis(20)))?;
        for e in events.iter() {
            let i = e.token().0;
            loop {
                match socks[i].recv(&mut buf) {
                    Ok(n) if n >= 8 => {
                        let now = Instant::now();
                        let mut t = [0u8; 8];
                        t.copy_from_slice(&buf[..8]);
                        let sent_ns = u64::from_le_bytes(t);
                        // Only the answer to the datagram in flight closes the loop; a late
                        // answer to a datagram already counted lost is ignored.
                        if sent_ns != sent_at[i].duration_since(start).as_nanos() as u64 {
                            continue;
                        }
                        if now >= measure_from {
                            rtts.push(
                                now.duration_since(sent_at[i])
                                    .as_micros()
                                    .min(u128::from(u32::MAX))
                                    as u32,
                            );
                        }
                        stamp(&mut payload, now);
                        let _ = socks[i].send(&payload);
                        sent_at[i] = now;
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        }
        let now = Instant::now();
        if now.duration_since(last_check) >= Duration::from_millis(50) {
            last_check = now;
            for (i, s) in socks.iter().enumerate() {
                if now.duration_since(sent_at[i]) > LOSS_TIMEOUT {
                    if now >= measure_from {
                        lost += 1;
                    }
                    stamp(&mut payload, now);
                    let _ = s.send(&payload);
                    sent_at[i] = now;
                }
            }
        }
    }
    rtts.sort_unstable();
    let pct = |p: f64| {
        rtts.get(((rtts.len() as f64 * p) as usize).min(rtts.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    println!(
        "rps={:.0} p50_us={} p90_us={} p99_us={} p999_us={} max_us={} lost={}",
        rtts.len() as f64 / a.secs as f64,
        pct(0.50),
        pct(0.90),
        pct(0.99),
        pct(0.999),
        rtts.last().copied().unwrap_or(0),
        lost
    );
    Ok(())
}
