//! Loopback peers for the data-path tests: UDP and TCP services that say who they are and
//! what PROXY header (if any) they received, configs built around them, and clients that
//! wait with read timeouts (never bare sleeps).
#![allow(dead_code)]

pub mod churn;
pub mod dns;
pub mod fwbed;
pub mod netns;
pub mod sip_load;
pub mod sip_tcp;
pub mod sip_uac;
pub mod sipp;
pub mod strict_uas;
pub mod tls;

use fulcrum::proxy::proxy_protocol::decode_v2;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a client waits for an answer that must come.
pub const ANSWER: Duration = Duration::from_secs(3);
/// How long a client waits for an answer that must not come.
pub const SILENCE: Duration = Duration::from_millis(400);

/// Reply of every test service: `NAME|PROXY_SRC|payload` (`-` when no PROXY header).
fn reply(name: &str, data: &[u8]) -> Vec<u8> {
    let (src, body) = match decode_v2(data) {
        Ok(h) => (h.src.to_string(), &data[h.len.min(data.len())..]),
        Err(_) => ("-".to_string(), data),
    };
    let mut out = format!("{name}|{src}|").into_bytes();
    out.extend_from_slice(body);
    out
}

pub struct Answer {
    pub service: String,
    pub proxy_src: String,
    pub body: Vec<u8>,
}

pub fn parse_answer(b: &[u8]) -> Option<Answer> {
    let mut it = b.splitn(3, |&c| c == b'|');
    Some(Answer {
        service: String::from_utf8(it.next()?.to_vec()).ok()?,
        proxy_src: String::from_utf8(it.next()?.to_vec()).ok()?,
        body: it.next()?.to_vec(),
    })
}

/// A UDP service on `ip:0` answering each datagram to its sender.
pub fn udp_service(name: &str, ip: &str) -> (SocketAddr, Arc<AtomicU64>) {
    let s = UdpSocket::bind(format!("{ip}:0")).expect("bind udp service");
    let addr = s.local_addr().expect("addr");
    let hits = Arc::new(AtomicU64::new(0));
    let (name, h) = (name.to_string(), Arc::clone(&hits));
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65_536];
        // Ends with the test process.
        while let Ok((n, from)) = s.recv_from(&mut buf) {
            h.fetch_add(1, Ordering::Relaxed);
            let _ = s.send_to(&reply(&name, &buf[..n]), from);
        }
    });
    (addr, hits)
}

/// A TCP service on `ip:0`: reads until the client half-closes, then answers and closes.
pub fn tcp_service(name: &str, ip: &str) -> (SocketAddr, Arc<AtomicU64>) {
    let l = listener_with_backlog(ip);
    let addr = l.local_addr().expect("addr");
    let hits = Arc::new(AtomicU64::new(0));
    let (name, h) = (name.to_string(), Arc::clone(&hits));
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            h.fetch_add(1, Ordering::Relaxed);
            let name = name.clone();
            std::thread::spawn(move || {
                let _ = c.set_read_timeout(Some(Duration::from_secs(20)));
                let mut data = Vec::new();
                if c.read_to_end(&mut data).is_ok() {
                    let _ = c.write_all(&reply(&name, &data));
                }
            });
        }
    });
    (addr, hits)
}

/// A TCP listener on `ip:0` whose accept queue holds 4096 connections (std's holds 128): a
/// test that opens a thousand connections at once must not overflow it, or the kernel's SYN
/// cookies answer some of them with a reset once data arrives.
pub fn listener_with_backlog(ip: &str) -> TcpListener {
    let s = bound_stream_socket(ip);
    s.listen(4096).expect("listen");
    s.into()
}

/// A TCP socket bound to `ip:0` (brackets around an IPv6 address allowed), not listening.
fn bound_stream_socket(ip: &str) -> socket2::Socket {
    let ip: std::net::IpAddr = ip.trim_matches(['[', ']']).parse().expect("ip");
    let addr = SocketAddr::new(ip, 0);
    let s = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )
    .expect("socket");
    s.bind(&addr.into()).expect("bind");
    s
}

/// A TCP port nothing listens on, kept reserved for the rest of the test binary: a socket is
/// bound to it and never listens, so connections are refused, and no other socket (another
/// test's vserver or service, SO_REUSEPORT or not) can be given the port meanwhile — a port
/// bound and released at once could be, and then the "dead" service answers.
pub fn closed_port(ip: &str) -> SocketAddr {
    let s = bound_stream_socket(ip);
    let local = s
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .expect("addr");
    std::mem::forget(s);
    local
}

/// A client address on `ip` reserved while the returned socket lives: a TCP socket bound to
/// `ip:0` with SO_REUSEADDR that never listens. [`tcp_ask_from`] binds its connection beside it
/// (SO_REUSEADDR on both and neither listening, which Linux allows for an explicit port).
/// Meanwhile no other socket is given the port: a port-0 bind and a connect's automatic bind
/// both skip a port some socket is bound to, whereas a port bound and released at once is
/// free for either to take before the test uses it.
pub fn reserved_client_addr(ip: &str) -> (socket2::Socket, SocketAddr) {
    let ip: std::net::IpAddr = ip.parse().expect("ip");
    let addr = SocketAddr::new(ip, 0);
    let s = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )
    .expect("socket");
    s.set_reuse_address(true).expect("SO_REUSEADDR");
    s.bind(&addr.into()).expect("bind");
    let local = s
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .expect("addr");
    (s, local)
}

/// A config with one vserver `v` over `services` (name, address).
pub fn config(
    protocol: &str,
    bind: &str,
    method: &str,
    extra: &str,
    services: &[(&str, SocketAddr)],
) -> String {
    config_with("", protocol, bind, method, extra, services)
}

pub fn config_with(
    top: &str,
    protocol: &str,
    bind: &str,
    method: &str,
    extra: &str,
    services: &[(&str, SocketAddr)],
) -> String {
    let svc_proto = if protocol == "http" { "http" } else { protocol };
    let mut y = format!("{top}admin:\n  listen: null\nservices:\n");
    for (n, a) in services {
        y += &format!("  - {{ name: {n}, address: \"{a}\", protocol: {svc_proto} }}\n");
    }
    let names: Vec<&str> = services.iter().map(|(n, _)| *n).collect();
    y += &format!(
        "vservers:\n  - name: v\n    protocol: {protocol}\n    bind: [\"{bind}\"]\n    method: {method}\n    services: [{}]\n",
        names.join(", ")
    );
    for line in extra.lines().filter(|l| !l.trim().is_empty()) {
        y += &format!("    {}\n", line.trim());
    }
    y
}

pub fn start(yaml: &str) -> fulcrum::proxy::Runtime {
    let cfg =
        fulcrum::config::from_str("test.yaml", yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    fulcrum::proxy::Runtime::start(&cfg).expect("start runtime")
}

pub fn bound(rt: &fulcrum::proxy::Runtime, vserver: &str) -> SocketAddr {
    rt.vserver(vserver).expect("vserver").bound[0]
}

/// fulcrum running [`config`]'s vserver `v` over `svc`, and the address `v` bound.
pub fn start_over(
    protocol: &str,
    bind: &str,
    method: &str,
    extra: &str,
    svc: &[(String, SocketAddr)],
) -> (fulcrum::proxy::Runtime, SocketAddr) {
    let rt = start(&config(protocol, bind, method, extra, &refs(svc)));
    let vs = bound(&rt, "v");
    (rt, vs)
}

/// [`start_over`] `n` fresh services on 127.0.0.1 (UDP ones for a `udp` vserver, TCP ones
/// for `tcp` and `http`), the vserver bound to 127.0.0.1:0.
pub fn start_loopback(
    protocol: &str,
    n: usize,
    method: &str,
    extra: &str,
) -> (fulcrum::proxy::Runtime, SocketAddr) {
    let kind = if protocol == "udp" { "udp" } else { "tcp" };
    start_over(
        protocol,
        "127.0.0.1:0",
        method,
        extra,
        &services(kind, n, "127.0.0.1"),
    )
}

/// Two fulcrum instances started from one [`start_loopback`] config (over the same `n`
/// services): a mirrored pair, each with the address its vserver `v` bound.
pub fn start_pair(
    protocol: &str,
    n: usize,
    method: &str,
) -> [(fulcrum::proxy::Runtime, SocketAddr); 2] {
    let kind = if protocol == "udp" { "udp" } else { "tcp" };
    let svc = services(kind, n, "127.0.0.1");
    let yaml = config(protocol, "127.0.0.1:0", method, "", &refs(&svc));
    [start(&yaml), start(&yaml)].map(|rt| {
        let vs = bound(&rt, "v");
        (rt, vs)
    })
}

/// A UDP client on `ip:0` with the answer timeout.
pub fn udp_client(ip: &str) -> UdpSocket {
    let c = UdpSocket::bind(format!("{ip}:0")).expect("bind client");
    c.set_read_timeout(Some(ANSWER)).expect("timeout");
    c
}

/// Send `payload` to `to` and wait for the answer (None on timeout).
pub fn udp_ask(c: &UdpSocket, to: SocketAddr, payload: &[u8]) -> Option<(Answer, SocketAddr)> {
    c.send_to(payload, to).expect("send");
    let mut buf = vec![0u8; 65_536];
    let (n, from) = recv_from_retrying(c, &mut buf).ok()?;
    Some((parse_answer(&buf[..n])?, from))
}

/// `recv_from` that goes on after an interruption, as a real client does. A socket with a
/// read timeout is never restarted by the kernel (signal(7)): any signal or task-work
/// notification to the thread (an io_uring this process opened and dropped, say) ends the
/// wait with EINTR long before the timeout.
pub fn recv_from_retrying(c: &UdpSocket, buf: &mut [u8]) -> std::io::Result<(usize, SocketAddr)> {
    let deadline = Instant::now() + c.read_timeout()?.unwrap_or(ANSWER);
    loop {
        match c.recv_from(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted && Instant::now() < deadline => {}
            r => return r,
        }
    }
}

/// One TCP exchange: connect (from `from` when given), write, half-close, read to EOF.
pub fn tcp_ask_from(
    to: SocketAddr,
    from: Option<SocketAddr>,
    payload: &[u8],
) -> std::io::Result<Answer> {
    let mut s = match from {
        Some(f) => {
            let sock =
                socket2::Socket::new(socket2::Domain::for_address(f), socket2::Type::STREAM, None)?;
            sock.set_reuse_address(true)?;
            sock.bind(&f.into())?;
            sock.connect_timeout(&to.into(), ANSWER)?;
            TcpStream::from(sock)
        }
        None => TcpStream::connect_timeout(&to, ANSWER)?,
    };
    s.set_read_timeout(Some(ANSWER))?;
    s.write_all(payload)?;
    s.shutdown(Shutdown::Write)?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    parse_answer(&out).ok_or_else(|| {
        std::io::Error::other(format!("bad answer {:?}", String::from_utf8_lossy(&out)))
    })
}

pub fn tcp_ask(to: SocketAddr, payload: &[u8]) -> std::io::Result<Answer> {
    tcp_ask_from(to, None, payload)
}

/// Poll `f` every 10 ms until it returns `Some`, or panic naming `what` after `limit`.
pub fn wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Wait until `cond` holds, checking every few milliseconds, for at most `limit`.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    cond()
}

/// `n` test services named `s0..` of `kind` ("udp" or "tcp") on `ip`.
pub fn services(kind: &str, n: usize, ip: &str) -> Vec<(String, SocketAddr)> {
    let make = if kind == "udp" {
        udp_service
    } else {
        tcp_service
    };
    (0..n)
        .map(|i| (format!("s{i}"), make(&format!("s{i}"), ip).0))
        .collect()
}

/// Borrowed view of [`services`] for [`config`].
pub fn refs(s: &[(String, SocketAddr)]) -> Vec<(&str, SocketAddr)> {
    s.iter().map(|(n, a)| (n.as_str(), *a)).collect()
}

/// `fulcrum run --drain-timeout DRAIN --config CONFIG` as a child process (`RUST_LOG=info`),
/// with its stderr lines; a thread reads them for the process's whole life, so its logging
/// never blocks.
pub fn spawn_fulcrum(config: &Path, drain: &str) -> (Child, mpsc::Receiver<String>) {
    spawn_fulcrum_env(config, drain, &[])
}

/// [`spawn_fulcrum`] with extra environment variables.
pub fn spawn_fulcrum_env(
    config: &Path,
    drain: &str,
    env: &[(&str, &str)],
) -> (Child, mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fulcrum"))
        .args(["run", "--drain-timeout", drain, "--config"])
        .arg(config)
        .env("RUST_LOG", "info")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn fulcrum");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Wait (at most 10 s) for a log line containing `needle`; the lines before it are dropped.
pub fn expect_line(lines: &mpsc::Receiver<String>, needle: &str) -> String {
    expect_line_keeping(lines, needle, &mut Vec::new())
}

/// [`expect_line`] over the lines `seen` keeps: the first of them containing `needle` is
/// taken, else the next lines are read, and those before the one found are kept in `seen`
/// (log lines of different threads come in no fixed order).
pub fn expect_line_keeping(
    lines: &mpsc::Receiver<String>,
    needle: &str,
    seen: &mut Vec<String>,
) -> String {
    if let Some(i) = seen.iter().position(|l| l.contains(needle)) {
        return seen.remove(i);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(l) if l.contains(needle) => return l,
            Ok(l) => seen.push(l),
            Err(_) => panic!("no log line containing `{needle}`; read: {seen:?}"),
        }
    }
}

/// A config file in a directory of its own under the temp dir (named by `tag` and the test
/// process), removed when dropped, however the test ends.
pub struct ConfigFile {
    pub dir: PathBuf,
    pub path: PathBuf,
}

impl ConfigFile {
    pub fn new(tag: &str, yaml: &str) -> ConfigFile {
        let dir = std::env::temp_dir().join(format!("fulcrum-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        let path = dir.join("f.yaml");
        std::fs::write(&path, yaml).expect("write config");
        ConfigFile { dir, path }
    }

    /// Replace the file's text.
    pub fn write(&self, yaml: &str) {
        std::fs::write(&self.path, yaml).expect("write config");
    }

    /// Another file `name` beside it, holding `text`.
    pub fn beside(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.join(name);
        std::fs::write(&p, text).expect("write file");
        p
    }

    /// The path as the command line takes it.
    pub fn arg(&self) -> &str {
        self.path.to_str().expect("utf-8 temp path")
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Debian's chromium and the directory of the browser drivers (tests/dashboard, where
/// `npm ci --prefix tests/dashboard` installs `packages`), or `None` after saying why `test`
/// is skipped; a failure instead under `FULCRUM_REQUIRE_BROWSER=1` (CI, which installs them).
pub fn browser(packages: &[&str], test: &str) -> Option<(PathBuf, PathBuf)> {
    let why = match browser_parts(packages) {
        Ok(b) => return Some(b),
        Err(why) => why,
    };
    assert!(
        std::env::var("FULCRUM_REQUIRE_BROWSER").as_deref() != Ok("1"),
        "FULCRUM_REQUIRE_BROWSER=1 but {why}"
    );
    eprintln!("skipping {test}: {why}");
    None
}

fn browser_parts(packages: &[&str]) -> Result<(PathBuf, PathBuf), String> {
    let chromium = std::env::var_os("FULCRUM_CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    if !chromium.exists() {
        return Err(format!(
            "no browser at {} (apt-get install chromium)",
            chromium.display()
        ));
    }
    match Command::new("node").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => return Err("no node on PATH".into()),
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/dashboard");
    if let Some(p) = packages
        .iter()
        .find(|p| !dir.join("node_modules").join(p).exists())
    {
        return Err(format!(
            "{p} is not installed (npm ci --prefix tests/dashboard)"
        ));
    }
    Ok((chromium, dir))
}

/// Whether Kamailio can be run here; a failure under `FULCRUM_REQUIRE_KAMAILIO=1` (CI).
pub fn kamailio_available() -> bool {
    let found = Command::new("kamailio")
        .arg("-v")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found && std::env::var("FULCRUM_REQUIRE_KAMAILIO").as_deref() == Ok("1") {
        panic!("kamailio is not on PATH and FULCRUM_REQUIRE_KAMAILIO=1 (apt-get install kamailio)");
    }
    if !found {
        eprintln!("SKIPPED: kamailio is not on PATH (apt-get install kamailio)");
    }
    found
}

/// A Kamailio config listening on UDP 127.0.0.1:`port` (one child, no DNS), loading `modules`
/// (`"kex"`, `"sl"`...), then `params` (modparam lines) and `route` (the request_route body).
pub fn kamailio_cfg(port: u16, modules: &[&str], params: &str, route: &str) -> String {
    let mut cfg = format!(
        "#!KAMAILIO\ndebug=1\nlog_stderror=yes\nfork=yes\nchildren=1\n\
         listen=udp:127.0.0.1:{port}\ndisable_tcp=yes\nauto_aliases=no\ndns=no\nrev_dns=no\n\
         mpath=\"/usr/lib/x86_64-linux-gnu/kamailio/modules/\"\n"
    );
    for m in modules {
        cfg.push_str(&format!("loadmodule \"{m}.so\"\n"));
    }
    cfg.push_str(params);
    cfg.push_str(&format!("request_route {{\n{route}\n}}\n"));
    cfg
}

/// A registrar that stores Path (`use_path`, saved whatever the REGISTER's Supported says)
/// and calls a registered user along it: `lookup` sets the destination to the first Path URI
/// and the Path as the Route set; `forward` sends statelessly.
pub fn kamailio_path_registrar_cfg(port: u16) -> String {
    kamailio_cfg(
        port,
        &["kex", "sl", "usrloc", "registrar"],
        "modparam(\"usrloc\", \"db_mode\", 0)\n\
         modparam(\"registrar\", \"use_path\", 1)\nmodparam(\"registrar\", \"path_mode\", 0)\n",
        "if (method == \"REGISTER\") { if (!save(\"location\")) { sl_reply_error(); } exit; }\n\
         if (method == \"INVITE\") { if (!lookup(\"location\")) { sl_send_reply(\"404\", \"Not Found\"); exit; } forward(); exit; }\n\
         sl_send_reply(\"404\", \"Not Here\"); exit;",
    )
}
