//! One client cannot take fulcrum down by holding connections (docs/limits.md): fulcrum runs
//! as its own process under a small open-file limit (`prlimit`), attackers on other loopback
//! addresses hold silent connections, and what must keep working keeps working: legitimate
//! clients from other addresses, the services' monitors, the sip-udp vserver beside, the admin
//! API. Needs `prlimit` (util-linux) and Linux's whole 127.0.0.0/8 on `lo`.

mod common;

use common::sip_tcp::{read_message, request};
use common::strict_uas::StrictUas;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// fulcrum under `prlimit --nofile=N:N`, its log lines, the addresses it bound.
struct Fulcrum {
    child: Child,
    lines: mpsc::Receiver<String>,
    admin: SocketAddr,
    sip_tcp: SocketAddr,
    sip_udp: SocketAddr,
    /// Every vserver's address, by name.
    bound: std::collections::HashMap<String, SocketAddr>,
    pool: u64,
    _dir: common::sipp::Scratch,
}

impl Drop for Fulcrum {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value after `key=` in a log line (up to a space; `[...]` whole).
fn field(line: &str, key: &str) -> Option<String> {
    let at = line.find(&format!("{key}="))? + key.len() + 1;
    let rest = &line[at..];
    let end = if rest.starts_with('[') {
        rest.find(']')? + 1
    } else {
        rest.find(' ').unwrap_or(rest.len())
    };
    Some(rest[..end].trim_matches(['[', ']', '"']).to_owned())
}

fn start(nofile: u32, max_per_source: &str, udp: &StrictUas, tcp: &StrictUas) -> Fulcrum {
    let yaml = format!(
        "admin: {{ listen: \"127.0.0.1:0\" }}\nmonitors:\n  - {{ name: ping, type: sip-options, interval: 500ms, timeout: 400ms, failures_to_down: 2, successes_to_up: 2 }}\nservices:\n  - {{ name: u, address: \"{}\", protocol: sip-udp, monitor: ping }}\n  - {{ name: t, address: \"{}\", protocol: sip-tcp, monitor: ping }}\nvservers:\n  - {{ name: udp, protocol: sip-udp, bind: [\"127.0.0.1:0\"], workers: 1, services: [u] }}\n  - {{ name: tcp, protocol: sip-tcp, bind: [\"127.0.0.1:0\"], workers: 1, max_per_source: {max_per_source}, services: [t] }}\n",
        udp.addr, tcp.addr
    );
    start_with(nofile, &yaml)
}

/// fulcrum under `prlimit --nofile=N:N` running `yaml`, whose vservers are named `udp` and
/// `tcp` (the addresses of those it has), once ready.
fn start_with(nofile: u32, yaml: &str) -> Fulcrum {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = common::sipp::Scratch::new(&format!("limits-{nofile}-{run}"));
    let cfg = dir.path("fulcrum.yaml");
    std::fs::write(&cfg, yaml).expect("config");
    let wants_udp = yaml.contains("name: udp,");
    let mut child = Command::new("prlimit")
        .arg(format!("--nofile={nofile}:{nofile}"))
        .arg(env!("CARGO_BIN_EXE_fulcrum"))
        .args(["run", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn prlimit fulcrum");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let (mut admin, mut sip_tcp, mut sip_udp, mut pool) = (None, None, None, None);
    let mut bound = std::collections::HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let unspecified = SocketAddr::from(([0, 0, 0, 0], 0));
    if !wants_udp {
        sip_udp = Some(unspecified);
    }
    while admin.is_none() || sip_tcp.is_none() || sip_udp.is_none() || pool.is_none() {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).expect("fulcrum's start lines");
        if line.contains("open files") {
            pool = field(&line, "pool").and_then(|p| p.parse::<u64>().ok());
        } else if line.contains("admin API listening") {
            admin = field(&line, "bound").and_then(|a| a.parse().ok());
        } else if line.contains("listening")
            && let (Some(name), Some(addr)) = (
                field(&line, "vserver"),
                field(&line, "bound").and_then(|a| a.parse::<SocketAddr>().ok()),
            )
        {
            match name.as_str() {
                "tcp" => sip_tcp = Some(addr),
                "udp" => sip_udp = Some(addr),
                _ => {}
            }
            bound.insert(name, addr);
        }
    }
    let f = Fulcrum {
        child,
        lines: rx,
        bound,
        admin: admin.expect("admin"),
        sip_tcp: sip_tcp.expect("tcp"),
        sip_udp: sip_udp.expect("udp"),
        pool: pool.expect("pool"),
        _dir: dir,
    };
    assert!(
        common::wait_until(Duration::from_secs(10), || f.get("/readyz").0 == 200),
        "not ready: {:?}",
        f.get("/readyz")
    );
    f
}

impl Fulcrum {
    /// The address vserver `name` bound (its `listening` line, read now if not yet).
    fn vserver(&mut self, name: &str) -> SocketAddr {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.bound.contains_key(name) {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).expect("a listening line");
            if line.contains("listening")
                && let (Some(n), Some(a)) = (
                    field(&line, "vserver"),
                    field(&line, "bound").and_then(|a| a.parse().ok()),
                )
            {
                self.bound.insert(n, a);
            }
        }
        self.bound[name]
    }

    /// `GET path` on the admin API: (status, body); (0, error) when it does not answer in 3 s.
    fn get(&self, path: &str) -> (u16, String) {
        let mut s = match TcpStream::connect_timeout(&self.admin, Duration::from_secs(3)) {
            Ok(s) => s,
            Err(e) => return (0, e.to_string()),
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        if let Err(e) = s.write_all(req.as_bytes()) {
            return (0, e.to_string());
        }
        let mut out = String::new();
        if let Err(e) = s.read_to_string(&mut out) {
            return (0, e.to_string());
        }
        let code = out
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (code, out)
    }

    /// A value of the metrics exposition: the sample whose line starts with `prefix`.
    fn metric(&self, prefix: &str) -> u64 {
        let (_, body) = self.get("/metrics");
        body.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    }

    /// The services' states in `/status` (every vserver's), e.g. "UP".
    fn states(&self) -> Vec<String> {
        let (_, body) = self.get("/status");
        let json = body.split("\r\n\r\n").nth(1).unwrap_or_default();
        let v: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
        v["vservers"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|vs| vs["services"].as_array().into_iter().flatten())
            .map(|s| s["state"].as_str().unwrap_or("?").to_owned())
            .collect()
    }
}

/// A silent TCP connection to `to` from `ip` (any port).
fn hold_from(ip: IpAddr, to: SocketAddr) -> Option<TcpStream> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
    s.bind(&SocketAddr::new(ip, 0).into()).ok()?;
    s.connect_timeout(&to.into(), Duration::from_secs(2)).ok()?;
    Some(s.into())
}

/// How many of `held` fulcrum has closed (a read sees EOF or a reset at once).
fn closed_by_peer(held: &[TcpStream]) -> usize {
    held.iter()
        .filter(|s| {
            let _ = s.set_nonblocking(true);
            let mut b = [0u8; 1];
            let gone = match (&**s).read(&mut b) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            };
            let _ = s.set_nonblocking(false);
            gone
        })
        .count()
}

/// An OPTIONS over a new sip-tcp connection from 127.0.0.1: its answer's status code.
fn sip_tcp_options(to: SocketAddr, tag: &str) -> Option<u16> {
    let mut c = TcpStream::connect_timeout(&to, Duration::from_secs(3)).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    let local = c.local_addr().ok()?;
    c.write_all(request("OPTIONS", &format!("{tag}@x"), local, tag).as_bytes())
        .ok()?;
    let mut buf = Vec::new();
    let m = read_message(&mut c, &mut buf)?;
    fulcrum::sip::scan(&m).ok()?.status_code()
}

/// An OPTIONS over a new sip-tcp connection from `ip`: its answer's status code.
fn sip_tcp_options_from(ip: IpAddr, to: SocketAddr, tag: &str) -> Option<u16> {
    let mut c = hold_from(ip, to)?;
    c.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    let local = c.local_addr().ok()?;
    c.write_all(request("OPTIONS", &format!("{tag}@x"), local, tag).as_bytes())
        .ok()?;
    let mut buf = Vec::new();
    let m = read_message(&mut c, &mut buf)?;
    fulcrum::sip::scan(&m).ok()?.status_code()
}

/// An OPTIONS to the sip-udp vserver: its answer's status code.
fn sip_udp_options(to: SocketAddr, tag: &str) -> Option<u16> {
    let c = UdpSocket::bind("127.0.0.1:0").ok()?;
    c.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    let local = c.local_addr().ok()?;
    let req =
        request("OPTIONS", &format!("{tag}@x"), local, tag).replace("SIP/2.0/TCP", "SIP/2.0/UDP");
    c.send_to(req.as_bytes(), to).ok()?;
    let mut b = [0u8; 4096];
    let (n, _) = c.recv_from(&mut b).ok()?;
    fulcrum::sip::scan(&b[..n]).ok()?.status_code()
}

/// Raise this test process's open-file soft limit to at least `n` (within its hard limit).
/// Silent connections to `to` from `n` sources of `net`.0.0/16 (`127.1`, `127.2`, ...), one
/// each; those refused or closed at once are not counted.
fn hold_many(net: [u8; 2], n: u64, to: SocketAddr) -> Vec<TcpStream> {
    (0..n)
        .filter_map(|i| {
            let ip = IpAddr::from([net[0], net[1], (i / 250) as u8, (i % 250) as u8 + 1]);
            hold_from(ip, to)
        })
        .collect()
}

/// A config of one `tcp` vserver named `tcp` (one worker, no per-source limit) over the tcp
/// service at `svc`, with the admin API on an ephemeral port.
fn tcp_vserver_yaml(svc: SocketAddr) -> String {
    format!(
        "admin: {{ listen: \"127.0.0.1:0\" }}\nservices:\n  - {{ name: s0, address: \"{svc}\", protocol: tcp }}\nvservers:\n  - {{ name: tcp, protocol: tcp, bind: [\"127.0.0.1:0\"], workers: 1, max_per_source: off, services: [s0] }}\n"
    )
}

fn raise_own_limit(n: u64) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < n
    {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, n.min(hard), hard);
    }
}

fn prlimit_available() -> bool {
    Command::new("prlimit")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Two sources each open many more silent connections than `max_per_source` allows: each
/// keeps its limit and no more (the rest closed at once, counted), while a third address is
/// served, the monitors keep both services UP and the admin API answers.
#[test]
fn two_sources_holding_connections_keep_their_limit_and_others_are_served() {
    if !prlimit_available() {
        println!("SKIP: no prlimit");
        return;
    }
    let (udp, tcp) = (StrictUas::udp("u"), StrictUas::tcp("t"));
    let f = start(2_000, "100", &udp, &tcp);
    let mut held = Vec::new();
    for src in ["127.0.0.2", "127.0.0.3"] {
        let ip: IpAddr = src.parse().expect("ip");
        held.push(
            (0..160)
                .filter_map(|_| hold_from(ip, f.sip_tcp))
                .collect::<Vec<_>>(),
        );
    }
    std::thread::sleep(Duration::from_millis(300));
    let closed: Vec<usize> = held.iter().map(|h| closed_by_peer(h)).collect();
    let refused = f.metric("fulcrum_refused_total{vserver=\"tcp\",reason=\"per_source\"}");
    println!(
        "held {:?}, closed by fulcrum {closed:?}, per-source refusals {refused}",
        held.iter().map(Vec::len).collect::<Vec<_>>()
    );
    for (h, c) in held.iter().zip(&closed) {
        assert_eq!(h.len() - c, 100, "a source keeps exactly its limit");
    }
    assert_eq!(refused, 120);
    assert_eq!(sip_tcp_options(f.sip_tcp, "legit1"), Some(200));
    assert_eq!(sip_udp_options(f.sip_udp, "legit2"), Some(200));
    assert_eq!(f.get("/healthz").0, 200);
    assert_eq!(f.get("/readyz").0, 200);
    std::thread::sleep(Duration::from_millis(1_200));
    assert_eq!(f.states(), ["UP", "UP"]);
}

/// Many sources (addresses of 127.1.0.0/16) hold silent connections until the file pool is
/// full: fulcrum refuses or evicts beyond it and never touches its reserve, so the monitors
/// keep the services UP (no "Too many open files"), the sip-udp vserver and the admin API
/// answer, and a new legitimate sip-tcp client is served by evicting an idle one. When the
/// attackers leave, the pool is empty again.
#[test]
fn sources_filling_the_pool_never_take_the_reserve_and_a_new_client_is_served() {
    if !prlimit_available() {
        println!("SKIP: no prlimit");
        return;
    }
    let (udp, tcp) = (StrictUas::udp("u"), StrictUas::tcp("t"));
    let f = start(700, "off", &udp, &tcp);
    assert!(f.pool > 50 && f.pool < 700, "pool {}", f.pool);
    // More than fulcrum's whole open-file limit: without the pool, it would run out of files
    // for its monitors and its other listeners.
    raise_own_limit(2_000);
    let held = hold_many([127, 1], 800, f.sip_tcp);
    std::thread::sleep(Duration::from_millis(500));
    let used = f.metric("fulcrum_open_files{kind=\"used\"}");
    let open = held.len() - closed_by_peer(&held);
    println!(
        "pool {}, {} attacker connections made, {open} still open, pool used {used}",
        f.pool,
        held.len()
    );
    assert!(used <= f.pool, "the pool was passed: {used} > {}", f.pool);
    assert!(
        used * 10 >= f.pool * 8,
        "the attack did not fill the pool: {used} of {}",
        f.pool
    );
    // What must keep working does.
    assert_eq!(f.get("/healthz").0, 200);
    assert_eq!(f.get("/readyz").0, 200, "{}", f.get("/readyz").1);
    assert_eq!(sip_udp_options(f.sip_udp, "legit-udp"), Some(200));
    assert_eq!(
        sip_tcp_options(f.sip_tcp, "legit-tcp"),
        Some(200),
        "a new client is served by eviction"
    );
    std::thread::sleep(Duration::from_millis(1_200));
    assert_eq!(f.states(), ["UP", "UP"], "monitors kept the services UP");
    let evicted =
        f.metric("fulcrum_transport_events_total{vserver=\"tcp\",event=\"clients_evicted\"}");
    assert!(evicted >= 1, "no client was evicted");
    let local_errors = f.get("/status").1.matches("\"local_errors\":0").count();
    assert_eq!(local_errors, 2, "monitors met no local error");
    drop(held);
    assert!(
        common::wait_until(Duration::from_secs(5), || f
            .metric("fulcrum_open_files{kind=\"used\"}")
            == 0),
        "the pool is empty again once the attackers leave"
    );
}

/// A TLS connection to `to` from `ip` (any port), handshake done: silent afterwards.
fn tls_from(
    ip: IpAddr,
    to: SocketAddr,
    cfg: &std::sync::Arc<rustls::ClientConfig>,
) -> Option<common::tls::ClientStream> {
    let sock = hold_from(ip, to)?;
    sock.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    let name = rustls::pki_types::ServerName::try_from("sip.test").ok()?;
    let conn = rustls::ClientConnection::new(std::sync::Arc::clone(cfg), name).ok()?;
    let mut s = rustls::StreamOwned::new(conn, sock);
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock).ok()?;
    }
    Some(s)
}

/// The same on a sip-tls vserver, in process: two sources complete TLS handshakes and stay
/// silent, up to and past their `max_per_source`; each keeps its limit (the rest closed and
/// counted before any handshake), and a third source completes a TLS exchange.
#[test]
fn two_sources_holding_tls_connections_keep_their_limit_and_a_third_is_served() {
    let uas = StrictUas::tcp("t");
    let f = common::ConfigFile::new("limits-tls", "");
    let ca = common::tls::Ca::new("limits CA");
    let cert = ca.issue(&f, "sip", "sip.test", "sip.test");
    f.write(&format!(
        "admin: {{ listen: null }}\nservices:\n  - {{ name: t, address: \"{}\", protocol: sip-tcp }}\nvservers:\n  - {{ name: v, protocol: sip-tls, bind: [\"127.0.0.1:0\"], max_per_source: 20, tls: {{ cert: {}, key: {} }}, services: [t] }}\n",
        uas.addr,
        cert.cert_path.display(),
        cert.key_path.display()
    ));
    let ops = common::tls::start(&f);
    let to = common::tls::addr(&ops, "v");
    let cfg = common::tls::client_config(&ca, None);
    let mut held = Vec::new();
    for src in ["127.0.0.2", "127.0.0.3"] {
        let ip: IpAddr = src.parse().expect("ip");
        let made: Vec<_> = (0..30).filter_map(|_| tls_from(ip, to, &cfg)).collect();
        assert_eq!(made.len(), 20, "{src}: handshakes completed");
        held.push(made);
    }
    let text = common::tls::metrics(&ops);
    assert!(
        text.contains("fulcrum_refused_total{vserver=\"v\",reason=\"per_source\"} 20"),
        "{}",
        text.lines()
            .filter(|l| l.contains("refused"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let mut legit =
        tls_from("127.0.0.1".parse().expect("ip"), to, &cfg).expect("a third source's handshake");
    let local = legit.sock.local_addr().expect("local");
    let req = request("OPTIONS", "tls-legit@x", local, "tl1").replace("SIP/2.0/TCP", "SIP/2.0/TLS");
    legit.write_all(req.as_bytes()).expect("write");
    let mut buf = Vec::new();
    let m = read_message(&mut legit, &mut buf).expect("answered");
    assert_eq!(
        fulcrum::sip::scan(&m).ok().and_then(|m| m.status_code()),
        Some(200)
    );
    drop(held);
    ops.shutdown();
}

/// A `tcp` vserver (two files per connection: the client's and the service's) whose pool
/// sources on 127.1.0.0/16 fill with silent connections: a new client is served by evicting
/// the longest idle of those that never sent a byte, counted as `evicted`, and the admin API
/// answers throughout.
#[test]
fn a_tcp_vserver_full_of_silent_connections_serves_a_new_client_by_eviction() {
    if !prlimit_available() {
        println!("SKIP: no prlimit");
        return;
    }
    let (svc, _) = common::tcp_service("s0", "127.0.0.1");
    let f = start_with(700, &tcp_vserver_yaml(svc));
    raise_own_limit(2_000);
    let held = hold_many([127, 1], 600, f.sip_tcp);
    std::thread::sleep(Duration::from_millis(500));
    let used = f.metric("fulcrum_open_files{kind=\"used\"}");
    println!("pool {}, {} held, pool used {used}", f.pool, held.len());
    assert!(used <= f.pool, "the pool was passed: {used} > {}", f.pool);
    assert!(
        used * 10 >= f.pool * 8,
        "the attack did not fill the pool: {used}"
    );
    let answer = common::tcp_ask_from(f.sip_tcp, None, b"legit").expect("a new client is served");
    assert_eq!(answer.service, "s0");
    assert_eq!(answer.body, b"legit");
    assert!(
        f.metric("fulcrum_transport_events_total{vserver=\"tcp\",event=\"evicted\"}") >= 1,
        "no connection was evicted"
    );
    assert!(
        closed_by_peer(&held) >= 1,
        "an attacker's connection was closed"
    );
    assert_eq!(f.get("/healthz").0, 200);
}

/// The pool is the process's, and so is eviction: silent connections from sources on
/// 127.1.0.0/16 to a `tcp` vserver take 85% of it (under the low mark, so none is evicted
/// yet), udp sessions opened after them (as idle and unproven, but younger) the rest, then a
/// new client of a `sip-tcp` vserver, which holds no connection of its own to give up, is
/// served by evicting the longest idle: one of the tcp vserver's (counted there as
/// `evicted`).
#[test]
fn a_new_client_of_one_vserver_is_served_by_evicting_another_vservers_idle_connection() {
    if !prlimit_available() {
        println!("SKIP: no prlimit");
        return;
    }
    let (svc, _) = common::tcp_service("s0", "127.0.0.1");
    let (echo, _) = common::udp_service("e0", "127.0.0.1");
    let uas = StrictUas::tcp("t");
    let yaml = format!(
        "admin: {{ listen: \"127.0.0.1:0\" }}\nservices:\n  - {{ name: s0, address: \"{svc}\", protocol: tcp }}\n  - {{ name: e0, address: \"{echo}\", protocol: udp }}\n  - {{ name: t, address: \"{}\", protocol: sip-tcp }}\nvservers:\n  - {{ name: flood, protocol: tcp, bind: [\"127.0.0.1:0\"], workers: 1, max_per_source: off, services: [s0] }}\n  - {{ name: gen, protocol: udp, bind: [\"127.0.0.1:0\"], workers: 1, services: [e0] }}\n  - {{ name: tcp, protocol: sip-tcp, bind: [\"127.0.0.1:0\"], workers: 1, max_per_source: off, services: [t] }}\n",
        uas.addr
    );
    let mut f = start_with(700, &yaml);
    let (flood, gen_udp) = (f.vserver("flood"), f.vserver("gen"));
    raise_own_limit(2_000);
    let n = f.pool * 85 / 200;
    let held = hold_many([127, 1], n, flood);
    assert!(
        common::wait_until(Duration::from_secs(5), || {
            f.metric("fulcrum_open_files{kind=\"used\"}") == 2 * n
        }),
        "{n} tcp connections, two files each"
    );
    // Each relaying (its service connected): a relay's start is its last activity, and the
    // udp sessions opened next must be younger than every one of them.
    assert!(
        common::wait_until(Duration::from_secs(5), || {
            f.metric("fulcrum_active{vserver=\"flood\",service=\"s0\"}") == n
        }),
        "{n} tcp connections relaying"
    );
    // Udp sessions take the rest of the pool, ten new flows at a time (at most 50 rounds).
    let mut flows: Vec<UdpSocket> = Vec::new();
    let mut used = 0;
    for _ in 0..50 {
        for _ in 0..10 {
            let c = UdpSocket::bind("127.0.0.1:0").expect("bind");
            c.send_to(b"hold", gen_udp).expect("send");
            flows.push(c);
        }
        std::thread::sleep(Duration::from_millis(100));
        used = f.metric("fulcrum_open_files{kind=\"used\"}");
        if used >= f.pool {
            break;
        }
    }
    println!(
        "pool {}, {} tcp connections held, {} udp flows, pool used {used}",
        f.pool,
        held.len(),
        flows.len()
    );
    assert_eq!(used, f.pool, "the pool is full");
    assert_eq!(
        f.metric("fulcrum_transport_events_total{vserver=\"flood\",event=\"evicted\"}"),
        0,
        "nothing evicted yet"
    );
    assert_eq!(
        sip_tcp_options(f.sip_tcp, "cross"),
        Some(200),
        "a new sip-tcp client is served"
    );
    assert_eq!(
        f.metric("fulcrum_transport_events_total{vserver=\"flood\",event=\"evicted\"}"),
        1,
        "one connection of the tcp vserver was evicted (udp sessions evicted: {})",
        f.metric("fulcrum_transport_events_total{vserver=\"gen\",event=\"sessions_evicted\"}")
    );
    assert_eq!(closed_by_peer(&held), 1, "one held connection was closed");
    assert_eq!(f.get("/healthz").0, 200);
}

/// After a burst of connections closes, fulcrum gives the memory they freed back to the
/// system once (docs/limits.md, "Memory after the connections close") and counts it:
/// `fulcrum_memory_trims_total` goes from 0 to 1 when 1,100 held tcp connections (2,200
/// files) close, and not before; the connections are closed at once, before the once-a-second
/// look at the files in use may have seen them (the budget keeps its high mark between looks).
#[test]
fn a_burst_of_closes_is_followed_by_one_counted_trim() {
    if !prlimit_available() {
        println!("SKIP: no prlimit");
        return;
    }
    let (svc, _) = common::tcp_service("s0", "127.0.0.1");
    let f = start_with(4_000, &tcp_vserver_yaml(svc));
    raise_own_limit(6_000);
    let held = hold_many([127, 2], 1_100, f.sip_tcp);
    assert!(
        common::wait_until(Duration::from_secs(10), || {
            f.metric("fulcrum_open_files{kind=\"used\"}") >= 2_000
        }),
        "{} connections held",
        held.len()
    );
    assert_eq!(
        f.metric("fulcrum_memory_trims_total"),
        0,
        "no trim while they are open"
    );
    drop(held);
    assert!(
        common::wait_until(Duration::from_secs(10), || f
            .metric("fulcrum_memory_trims_total")
            == 1),
        "one trim after the close: {}",
        f.metric("fulcrum_memory_trims_total")
    );
}

/// A connection that carries a registration (its client registered through it and got
/// fulcrum's Path) is evicted after every other: a phone registers first, so it is the
/// longest idle of all, then proven connections (each completed an OPTIONS) fill nine tenths
/// of the pool; a new client then evicts the oldest proven connection, not the phone's.
#[test]
fn a_connection_carrying_a_registration_is_evicted_after_every_other() {
    if !prlimit_available() {
        println!("SKIP: no prlimit");
        return;
    }
    let uas = StrictUas::tcp("t");
    let yaml = format!(
        "admin: {{ listen: \"127.0.0.1:0\" }}\nservices:\n  - {{ name: t, address: \"{}\", protocol: sip-tcp }}\nvservers:\n  - {{ name: tcp, protocol: sip-tcp, bind: [\"127.0.0.1:0\"], workers: 1, max_per_source: off, path: always, services: [t] }}\n",
        uas.addr
    );
    let mut f = start_with(700, &yaml);
    let v = f.vserver("tcp");
    raise_own_limit(2_000);
    let mut phone = TcpStream::connect_timeout(&v, Duration::from_secs(3)).expect("connect");
    phone
        .set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    let local = phone.local_addr().expect("addr");
    phone
        .write_all(request("REGISTER", "reg@x", local, "reg").as_bytes())
        .expect("send REGISTER");
    let mut buf = Vec::new();
    read_message(&mut phone, &mut buf).expect("the REGISTER is answered");
    std::thread::sleep(Duration::from_millis(20));
    // Proven connections, each from its own source, up to nine tenths of the pool.
    let n = f.pool * 9 / 10;
    let mut proven = Vec::new();
    for i in 0..n {
        let ip = IpAddr::from([127, 1, (i / 250) as u8, (i % 250 + 1) as u8]);
        let Some(mut c) = hold_from(ip, v) else { break };
        c.set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        let me = c.local_addr().expect("addr");
        c.write_all(request("OPTIONS", &format!("p{i}@x"), me, &format!("p{i}")).as_bytes())
            .expect("send OPTIONS");
        let mut b = Vec::new();
        read_message(&mut c, &mut b).expect("the OPTIONS is answered");
        proven.push(c);
    }
    let used = f.metric("fulcrum_open_files{kind=\"used\"}");
    println!("pool {}, {} proven, used {used}", f.pool, proven.len());
    assert!(used * 10 >= f.pool * 9, "the pool runs low: {used}");
    assert_eq!(
        sip_tcp_options(v, "new"),
        Some(200),
        "a new client is served"
    );
    assert!(
        f.metric("fulcrum_transport_events_total{vserver=\"tcp\",event=\"clients_evicted\"}") >= 1,
        "a connection was evicted"
    );
    assert_eq!(
        closed_by_peer(std::slice::from_ref(&phone)),
        0,
        "the registration's connection stays"
    );
    assert_eq!(
        closed_by_peer(&proven[..1]),
        1,
        "the longest idle proven connection went"
    );
}

/// One UDP datagram from `src` to `dst` with `payload`, as an IPv4 packet for a raw socket
/// with IP_HDRINCL: the kernel fills in the header checksum and id; the UDP checksum is 0
/// (none, RFC 768).
fn spoofed_udp(
    src: std::net::SocketAddrV4,
    dst: std::net::SocketAddrV4,
    payload: &[u8],
) -> Vec<u8> {
    let total = 20 + 8 + payload.len();
    let mut p = Vec::with_capacity(total);
    p.extend_from_slice(&[
        0x45,
        0,
        (total >> 8) as u8,
        total as u8,
        0,
        0,
        0,
        0,
        64,
        17,
        0,
        0,
    ]);
    p.extend_from_slice(&src.ip().octets());
    p.extend_from_slice(&dst.ip().octets());
    let udp_len = 8 + payload.len();
    p.extend_from_slice(&src.port().to_be_bytes());
    p.extend_from_slice(&dst.port().to_be_bytes());
    p.extend_from_slice(&[(udp_len >> 8) as u8, udp_len as u8, 0, 0]);
    p.extend_from_slice(payload);
    p
}

/// The namespace's side of
/// [`spoofed_udp_sources_neither_disconnect_a_keep_alive_client_nor_evict_for_a_limited_source`]:
/// run again inside a namespace where 10.0.0.0/8 goes out of a veth pair toward a peer that
/// does not forward (the replies to spoofed sources vanish there) and loopback accepts any
/// source.
#[test]
fn helper_spoofed_udp_flood() {
    if std::env::var(common::netns::ROLE).as_deref() != Ok("udp-flood") {
        return;
    }
    const SOURCES: u32 = 100_000;
    let tcp = StrictUas::tcp("t");
    // The udp service: echoes every datagram (so each session is answered).
    let echo = UdpSocket::bind("127.0.0.1:0").expect("echo");
    let echo_addr = echo.local_addr().expect("echo addr");
    std::thread::spawn(move || {
        let mut b = [0u8; 2048];
        while let Ok((n, from)) = echo.recv_from(&mut b) {
            let _ = echo.send_to(&b[..n], from);
        }
    });
    let yaml = format!(
        "admin: {{ listen: \"127.0.0.1:0\" }}\nservices:\n  - {{ name: e, address: \"{echo_addr}\", protocol: udp }}\n  - {{ name: t, address: \"{}\", protocol: sip-tcp }}\nvservers:\n  - {{ name: udp, protocol: udp, bind: [\"127.0.0.1:0\"], method: round_robin, workers: 1, services: [e] }}\n  - {{ name: tcp, protocol: sip-tcp, bind: [\"127.0.0.1:0\"], workers: 1, max_per_source: 2, services: [t] }}\n  - {{ name: lim, protocol: udp, bind: [\"127.0.0.1:0\"], method: round_robin, workers: 1, max_per_source: 3, services: [e] }}\n",
        tcp.addr
    );
    let mut f = start_with(1_200, &yaml);
    let lim = f.vserver("lim");
    let ev = |v: &str, e: &str| {
        f.metric(&format!(
            "fulcrum_transport_events_total{{vserver=\"{v}\",event=\"{e}\"}}"
        ))
    };
    let std::net::SocketAddr::V4(udp_to) = f.sip_udp else {
        panic!("udp vserver on IPv4")
    };
    let std::net::SocketAddr::V4(lim_to) = lim else {
        panic!("lim vserver on IPv4")
    };
    let raw = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::RAW,
        Some(socket2::Protocol::from(255)),
    )
    .expect("raw socket (IPPROTO_RAW)");
    // The limited vserver: one source from five ports keeps three sessions, the rest refused
    // without anything evicted.
    for port in 1..=5u16 {
        let src = std::net::SocketAddrV4::new([10, 250, 0, 1].into(), 40_000 + port);
        raw.send_to(
            &spoofed_udp(src, lim_to, b"x"),
            &std::net::SocketAddr::V4(lim_to).into(),
        )
        .expect("send");
    }
    assert!(
        common::wait_until(Duration::from_secs(5), || ev(
            "lim",
            "sessions_refused_per_source"
        ) == 2),
        "refused per source: {}",
        ev("lim", "sessions_refused_per_source")
    );
    assert_eq!(ev("lim", "sessions_created"), 3);
    // The sip-tcp service's own address (a member, as a PBX opening flows toward fulcrum)
    // holds more silent connections than max_per_source: none is refused, none evicted.
    let member_ip: IpAddr = "127.0.0.1".parse().expect("ip");
    let members: Vec<TcpStream> = (0..4)
        .filter_map(|_| hold_from(member_ip, f.sip_tcp))
        .collect();
    assert_eq!(members.len(), 4);
    // A sip-tcp client that made itself known with a request, then only keeps the
    // connection alive with CRLFCRLF pings (RFC 5626 §4.4.1).
    let mut keep = hold_from("127.0.0.5".parse().expect("ip"), f.sip_tcp).expect("connect");
    keep.set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    let local = keep.local_addr().expect("local");
    keep.write_all(request("OPTIONS", "keep@x", local, "keep").as_bytes())
        .expect("options");
    let mut buf = Vec::new();
    let m = read_message(&mut keep, &mut buf).expect("answer");
    assert_eq!(
        fulcrum::sip::scan(&m).ok().and_then(|m| m.status_code()),
        Some(200)
    );
    let pinger = {
        let mut s = keep.try_clone().expect("clone");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = std::sync::Arc::clone(&stop);
        let t = std::thread::spawn(move || {
            let mut failed = None;
            while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                if let Err(e) = s.write_all(b"\r\n\r\n") {
                    failed = Some(e.to_string());
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            failed
        });
        (stop, t)
    };
    // The flood: one datagram from each of SOURCES spoofed addresses of 10.0.0.0/8, bounded
    // in time; new sip-tcp clients arrive meanwhile.
    let started = Instant::now();
    let (mut sent, mut served, mut asked) = (0u32, 0u32, 0u32);
    let to = std::net::SocketAddr::V4(udp_to).into();
    while sent < SOURCES && started.elapsed() < Duration::from_secs(60) {
        let i = sent + 1;
        let src = std::net::SocketAddrV4::new(
            [10, (i >> 16) as u8, (i >> 8) as u8, i as u8].into(),
            5_060,
        );
        if raw
            .send_to(&spoofed_udp(src, udp_to, b"spoofed"), &to)
            .is_err()
        {
            // The loopback queue is full (ENOBUFS): let it drain.
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        sent += 1;
        // Paced to about 100 per ms, near what a worker turns into sessions or refusals,
        // so that the flood reaches fulcrum rather than overflowing its socket buffer.
        if sent.is_multiple_of(100) {
            std::thread::sleep(Duration::from_millis(1));
        }
        if sent.is_multiple_of(10_000) {
            asked += 1;
            let from = IpAddr::from([127, 0, 1, (asked % 250) as u8 + 1]);
            if sip_tcp_options_from(from, f.sip_tcp, &format!("new{sent}")) == Some(200) {
                served += 1;
            }
        }
    }
    let flood_secs = started.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(300));
    let used = f.metric("fulcrum_open_files{kind=\"used\"}");
    let (created, refused, evicted) = (
        ev("udp", "sessions_created"),
        ev("udp", "sessions_refused"),
        ev("udp", "sessions_evicted"),
    );
    let stream_evicted = ev("tcp", "clients_evicted");
    println!(
        "FIGURES sent {sent} spoofed datagrams in {flood_secs:.1} s; pool {} used {used}; udp sessions created {created}, refused {refused}, evicted {evicted}; new sip-tcp clients served {served} of {asked}; sip-tcp clients evicted {stream_evicted}",
        f.pool
    );
    assert_eq!(sent, SOURCES, "the flood was cut short by its time bound");
    assert!(used <= f.pool, "the pool was passed: {used} > {}", f.pool);
    assert!(
        created + refused >= u64::from(SOURCES) / 2,
        "fulcrum did not see the flood: {created} created, {refused} refused"
    );
    assert!(refused > 0, "the pool never filled");
    assert_eq!(served, asked, "every new sip-tcp client is served");
    assert!(evicted >= 1, "no udp session was evicted to make room");
    assert_eq!(
        stream_evicted, 0,
        "a sip-tcp client was evicted for the udp flood"
    );
    assert_eq!(
        closed_by_peer(&members),
        0,
        "a member's connection was closed"
    );
    assert_eq!(
        f.metric("fulcrum_refused_total{vserver=\"tcp\",reason=\"per_source\"}"),
        0,
        "a member's connection was limited per source"
    );
    // The keep-alive client is still connected: its pings went through, and a request on it
    // is answered.
    let (stop, t) = pinger;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(t.join().expect("pinger"), None, "a ping failed");
    keep.write_all(request("OPTIONS", "keep2@x", local, "keep2").as_bytes())
        .expect("options on the kept connection");
    let answered = loop {
        let Some(m) = read_message(&mut keep, &mut buf) else {
            break None;
        };
        // Pongs (a CRLF each) come before the answer.
        if let Some(code) = fulcrum::sip::scan(&m).ok().and_then(|m| m.status_code()) {
            break Some(code);
        }
    };
    assert_eq!(
        answered,
        Some(200),
        "the keep-alive client was disconnected"
    );
    // A udp datagram never evicts, even with the pool full: neither the limited source's
    // (its sessions were among the oldest idle, evicted for the new sip-tcp clients) nor
    // new sources'; they are refused and counted.
    let evictions = || {
        ev("udp", "sessions_evicted") + ev("lim", "sessions_evicted") + ev("tcp", "clients_evicted")
    };
    // Every datagram is decided: a session (while a file is left) or a refusal.
    let decided = || {
        ["lim", "udp"]
            .iter()
            .map(|v| ev(v, "sessions_refused") + ev(v, "sessions_created"))
            .sum::<u64>()
    };
    let before = (evictions(), decided());
    for port in 6..=8u16 {
        let src = std::net::SocketAddrV4::new([10, 250, 0, 1].into(), 40_000 + port);
        raw.send_to(
            &spoofed_udp(src, lim_to, b"x"),
            &std::net::SocketAddr::V4(lim_to).into(),
        )
        .expect("send");
    }
    for i in 1..=100u8 {
        let src = std::net::SocketAddrV4::new([10, 251, 0, i].into(), 5_060);
        raw.send_to(&spoofed_udp(src, udp_to, b"late"), &to)
            .expect("send");
    }
    assert!(
        common::wait_until(Duration::from_secs(5), || decided() >= before.1 + 103),
        "decided {} after {}",
        decided(),
        before.1
    );
    assert_eq!(evictions(), before.0, "a udp datagram evicted something");
    println!("RESULT ok");
}

/// 100,000 spoofed UDP sources (raw packets from 10.0.0.0/8, in a network namespace the
/// test makes) fill the open-file pool with udp sessions while new sip-tcp clients arrive:
/// each is served by evicting an idle udp session, never the sip-tcp client that keeps its
/// connection alive with CRLFCRLF pings; and a udp source at its `max_per_source` is refused
/// without anything evicted. Needs root (FULCRUM_REQUIRE_NETNS=1 makes a skip a failure).
#[test]
fn spoofed_udp_sources_neither_disconnect_a_keep_alive_client_nor_evict_for_a_limited_source() {
    if std::env::var(common::netns::ROLE).is_ok() {
        return;
    }
    if !prlimit_available() {
        println!("SKIP: no prlimit");
        return;
    }
    let Some(out) = common::netns::run_helper(
        "fc-udpflood",
        &[
            "link add v0 type veth peer name v1",
            "link set v0 up",
            "link set v1 up",
            "addr add 192.0.2.1/30 dev v0",
            "addr add 192.0.2.2/30 dev v1",
            "route add 10.0.0.0/8 via 192.0.2.2",
            "sysctl net.ipv4.conf.all.rp_filter 0",
            "sysctl net.ipv4.conf.default.rp_filter 0",
            "sysctl net.ipv4.conf.lo.rp_filter 0",
        ],
        "helper_spoofed_udp_flood",
        "udp-flood",
    ) else {
        return;
    };
    for l in out.lines().filter(|l| l.starts_with("FIGURES")) {
        println!("{l}");
    }
}
