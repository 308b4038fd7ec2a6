//! fulcrum's own load generator for the UDP benchmarks (bench/udp.sh). IO.
//!
//! `fulcrum-load udp TARGET [--sockets N] [--secs S] [--size B] [--warmup S]`: closed loop,
//! one datagram in flight per socket, sockets bound to 127.0.1.x source addresses (so
//! source hashing spreads them); prints `rps= p50_us= p90_us= p99_us= p999_us= max_us= lost=`.
//! A datagram not answered within 200 ms counts as lost and the socket sends again.
//!
//! `fulcrum-load udp-idle TARGET --sockets N --secs S`: opens N flows (one datagram each,
//! answered), prints `ready=N`, then holds them for S seconds or until killed (idle-session
//! memory measurement).
//!
//! `fulcrum-load tcp-idle TARGET --sockets N --secs S`: the same with N idle TCP connections.
//!
//! `fulcrum-load tcp-sink ADDR --sockets N --secs S`: a service that accepts up to N
//! connections on ADDR and holds them, never reading, for S seconds (the backend of the
//! idle-connection measurement: unlike an HTTP server it never times an idle client out).

use mio::net::UdpSocket;
use mio::{Events, Interest, Poll, Token};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

const LOSS_TIMEOUT: Duration = Duration::from_millis(200);

/// Source port of the idle modes' flows: every flow has an address of its own, so they can
/// all share one port, chosen below the ephemeral range so that the flows leave every
/// ephemeral port to the proxy's upstream sockets (a UDP socket's port is chosen before it
/// has an address, so it may not collide with a port any local socket holds).
const IDLE_PORT: u16 = 29_999;

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
        .ok_or("usage: fulcrum-load udp|udp-idle|tcp-idle|tcp-sink TARGET [options]")?;
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

/// Source address of flow `i`: 127.k.x.y, 50,000 flows per k (so flows never share an
/// address and port, up to 12.5 million of them).
fn source_ip(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(
        127,
        (i / 50_000 % 250) as u8,
        1 + (i / 250 % 200) as u8,
        1 + (i % 250) as u8,
    ))
}

fn open(n: usize, target: SocketAddr, port: u16, poll: &Poll) -> std::io::Result<Vec<UdpSocket>> {
    let _ = fulcrum::proxy::raise_nofile_limit();
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let mut s = UdpSocket::bind(SocketAddr::new(source_ip(i), port))?;
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
fn tcp_idle(target: SocketAddr, n: usize, secs: u64) -> std::io::Result<()> {
    let _ = fulcrum::proxy::raise_nofile_limit();
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        // An earlier run's connections from this address and port may linger in TIME_WAIT;
        // toward another target (or port) the connection is a different one.
        s.set_reuse_address(true)?;
        s.bind(&SocketAddr::new(source_ip(i), IDLE_PORT).into())?;
        s.connect(&target.into())?;
        held.push(s);
    }
    println!("ready={}", held.len());
    hold(secs);
    Ok(())
}

/// Keep the flows open for `secs` seconds (stdout flushed first: the caller waits for it).
fn hold(secs: u64) {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    std::thread::sleep(Duration::from_secs(secs));
}

/// Accept up to `n` connections on `addr` and hold them until `secs` have passed.
fn tcp_sink(addr: SocketAddr, n: usize, secs: u64) -> std::io::Result<()> {
    let _ = fulcrum::proxy::raise_nofile_limit();
    let l = std::net::TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    let end = Instant::now() + Duration::from_secs(secs);
    let mut held = Vec::with_capacity(n);
    while Instant::now() < end {
        match l.accept() {
            Ok((s, _)) if held.len() < n => held.push(s),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                eprintln!("fulcrum-load: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    println!("held={}", held.len());
    Ok(())
}

fn run(a: &Args) -> std::io::Result<()> {
    match a.mode.as_str() {
        "tcp-idle" => return tcp_idle(a.target, a.sockets, a.secs),
        "tcp-sink" => return tcp_sink(a.target, a.sockets, a.secs),
        _ => {}
    }
    let mut poll = Poll::new()?;
    let port = if a.mode == "udp-idle" { IDLE_PORT } else { 0 };
    let socks = open(a.sockets, a.target, port, &poll)?;
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
        hold(a.secs);
        return Ok(());
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
