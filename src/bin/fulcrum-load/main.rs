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
//! `fulcrum-load ws-sip URL --sockets N --secs S`: SIP calls over WebSocket, one phone per
//! connection ([`ws`], bench/ws.sh).
//!
//! `fulcrum-load tcp-sink ADDR --sockets N --secs S`: a service that accepts up to N
//! connections on ADDR and holds them, never reading, for S seconds (the backend of the
//! idle-connection measurement: unlike an HTTP server it never times an idle client out).

mod ws;

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
    let _ = fulcrum::fd_limit::raise_nofile_limit();
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
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("ws-sip") {
        let url = args.get(2).cloned().unwrap_or_default();
        let opt = |name: &str, default: u64| {
            args.iter()
                .position(|a| a == name)
                .and_then(|i| args.get(i + 1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        if let Err(e) = ws::run(&url, opt("--sockets", 16) as usize, opt("--secs", 10)) {
            eprintln!("fulcrum-load: {e}");
            std::process::exit(1);
        }
        return;
    }
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
    let _ = fulcrum::fd_limit::raise_nofile_limit();
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
    let _ = fulcrum::fd_limit::raise_nofile_limit();
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

/// Runs the mode `a.mode` names; any mode not named here is the `udp` closed loop.
fn run(a: &Args) -> std::io::Result<()> {
    match a.mode.as_str() {
        "tcp-idle" => tcp_idle(a.target, a.sockets, a.secs),
        "tcp-sink" => tcp_sink(a.target, a.sockets, a.secs),
        "udp-idle" => udp_idle(a),
        _ => udp_closed_loop(a),
    }
}

/// UDP flows toward the target, one datagram in flight on each. A datagram starts with the
/// nanoseconds from `start` at which it was sent, so an answer names the datagram it answers.
struct Flows {
    socks: Vec<UdpSocket>,
    start: Instant,
    payload: Vec<u8>,
    sent_at: Vec<Instant>,
    buf: Vec<u8>,
}

impl Flows {
    /// Opens `a.sockets` flows from `port`, registered with `poll`, and sends each its first
    /// datagram.
    fn open(a: &Args, port: u16, poll: &Poll) -> std::io::Result<Flows> {
        let socks = open(a.sockets, a.target, port, poll)?;
        let start = Instant::now();
        let mut flows = Flows {
            sent_at: vec![start; socks.len()],
            socks,
            start,
            payload: vec![b'x'; a.size],
            buf: vec![0u8; 65_536],
        };
        for i in 0..flows.socks.len() {
            let now = Instant::now();
            flows.stamp(now);
            flows.socks[i].send(&flows.payload)?;
            flows.sent_at[i] = now;
        }
        Ok(flows)
    }

    fn since_start_ns(&self, t: Instant) -> u64 {
        t.duration_since(self.start).as_nanos() as u64
    }

    fn stamp(&mut self, t: Instant) {
        let ns = self.since_start_ns(t);
        self.payload[..8].copy_from_slice(&ns.to_le_bytes());
    }

    /// Sends flow `i` its next datagram, stamped `now`. A failed send needs no handling here:
    /// its flow is counted lost and sent to again after [`LOSS_TIMEOUT`].
    fn send_next(&mut self, i: usize, now: Instant) {
        self.stamp(now);
        let _ = self.socks[i].send(&self.payload);
        self.sent_at[i] = now;
    }

    /// Reads every answer waiting on flow `i`. The answer to the datagram in flight records
    /// its round trip (when `measure_from` has passed) and sends the next datagram.
    fn take_answers(&mut self, i: usize, measure_from: Instant, rtts_us: &mut Vec<u32>) {
        loop {
            match self.socks[i].recv(&mut self.buf) {
                Ok(n) if n >= 8 => {
                    let now = Instant::now();
                    let mut t = [0u8; 8];
                    t.copy_from_slice(&self.buf[..8]);
                    let sent_ns = u64::from_le_bytes(t);
                    // Only the answer to the datagram in flight closes the loop; a late
                    // answer to a datagram already counted lost is ignored.
                    if sent_ns != self.since_start_ns(self.sent_at[i]) {
                        continue;
                    }
                    if now >= measure_from {
                        rtts_us.push(
                            now.duration_since(self.sent_at[i])
                                .as_micros()
                                .min(u128::from(u32::MAX)) as u32,
                        );
                    }
                    self.send_next(i, now);
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }

    /// Sends the next datagram on every flow whose datagram has been in flight longer than
    /// [`LOSS_TIMEOUT`]; returns how many of those count as lost (when `measure_from` has
    /// passed).
    fn resend_lost(&mut self, now: Instant, measure_from: Instant) -> u64 {
        let mut lost = 0;
        for i in 0..self.socks.len() {
            if now.duration_since(self.sent_at[i]) > LOSS_TIMEOUT {
                if now >= measure_from {
                    lost += 1;
                }
                self.send_next(i, now);
            }
        }
        lost
    }

    /// Waits (30 s at most) until every flow has had an answer; returns how many have.
    fn await_answers(&mut self, poll: &mut Poll, events: &mut Events) -> std::io::Result<usize> {
        let mut answered = vec![false; self.socks.len()];
        let mut n = 0;
        let end = Instant::now() + Duration::from_secs(30);
        let mut last_resend = Instant::now();
        while n < self.socks.len() && Instant::now() < end {
            poll.poll(events, Some(Duration::from_millis(100)))?;
            // A burst of thousands of first datagrams can overflow a socket buffer: resend
            // to flows not answered yet (a session is idempotent per flow).
            if last_resend.elapsed() >= Duration::from_millis(500) {
                last_resend = Instant::now();
                for (i, s) in self.socks.iter().enumerate() {
                    if !answered[i] {
                        let _ = s.send(&self.payload);
                    }
                }
            }
            for e in events.iter() {
                let i = e.token().0;
                while self.socks[i].recv(&mut self.buf).is_ok() {
                    if !answered[i] {
                        answered[i] = true;
                        n += 1;
                    }
                }
            }
        }
        Ok(n)
    }
}

/// `udp-idle`: opens the flows, prints how many were answered, then holds them.
fn udp_idle(a: &Args) -> std::io::Result<()> {
    let mut poll = Poll::new()?;
    let mut flows = Flows::open(a, IDLE_PORT, &poll)?;
    let mut events = Events::with_capacity(1024);
    let n = flows.await_answers(&mut poll, &mut events)?;
    println!("ready={n}");
    hold(a.secs);
    Ok(())
}

/// `udp`: the closed loop, `a.warmup` seconds unmeasured then `a.secs` measured; prints
/// the summary.
fn udp_closed_loop(a: &Args) -> std::io::Result<()> {
    let mut poll = Poll::new()?;
    let mut flows = Flows::open(a, 0, &poll)?;
    let mut events = Events::with_capacity(1024);
    let measure_from = flows.start + Duration::from_secs(a.warmup);
    let end = measure_from + Duration::from_secs(a.secs);
    let mut rtts_us: Vec<u32> = Vec::with_capacity(4_000_000);
    let mut lost = 0u64;
    let mut last_check = Instant::now();
    while Instant::now() < end {
        poll.poll(&mut events, Some(Duration::from_millis(20)))?;
        for e in events.iter() {
            flows.take_answers(e.token().0, measure_from, &mut rtts_us);
        }
        let now = Instant::now();
        if now.duration_since(last_check) >= Duration::from_millis(50) {
            last_check = now;
            lost += flows.resend_lost(now, measure_from);
        }
    }
    rtts_us.sort_unstable();
    println!("{}", summary(&rtts_us, a.secs, lost));
    Ok(())
}

/// The result line over the sorted round trips of `secs` measured seconds.
fn summary(rtts_us: &[u32], secs: u64, lost: u64) -> String {
    let pct = |p: f64| {
        rtts_us
            .get(((rtts_us.len() as f64 * p) as usize).min(rtts_us.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    format!(
        "rps={:.0} p50_us={} p90_us={} p99_us={} p999_us={} max_us={} lost={}",
        rtts_us.len() as f64 / secs as f64,
        pct(0.50),
        pct(0.90),
        pct(0.99),
        pct(0.999),
        rtts_us.last().copied().unwrap_or(0),
        lost
    )
}
