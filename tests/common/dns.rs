//! A real DNS server on loopback for the tests of DNS-based service discovery.
//!
//! The server is dnsmasq (Debian package `dnsmasq-base`), started in the foreground on
//! 127.0.0.1 with a config written by the test. A DNS server no one here wrote keeps the
//! tests honest: a resolver that only ever talks to a stub of our own making would share
//! its misreadings of the protocol. dnsmasq answers only from the records given (no
//! upstream servers, no /etc/hosts, no /etc/resolv.conf), answers names under the zone it
//! does not know with NXDOMAIN, and gives every answer a TTL of 1 s so changes show quickly.
//!
//! Machines without dnsmasq skip: tests call [`dnsmasq_available`] first, which panics
//! instead when `FULCRUM_REQUIRE_DNS` is set (CI sets it).

use std::fs::{self, File};
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

/// Query type A (IPv4 address).
const QTYPE_A: u16 = 1;

/// How long the server may take to answer its first query after a (re)start.
const READY: Duration = Duration::from_secs(5);
/// How long a restart on the same port keeps trying while the port is briefly busy.
const SAME_PORT: Duration = Duration::from_secs(2);
/// TTL of every record, positive and negative.
const TTL: u32 = 1;

/// Tags of the servers alive in this process: each owns the scratch directory named after it.
static LIVE_TAGS: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Query ids, so a late response to an earlier query is never taken for the current one.
static NEXT_ID: AtomicU16 = AtomicU16::new(0x5a00);

fn dnsmasq_path() -> Option<PathBuf> {
    let fixed = Path::new("/usr/sbin/dnsmasq");
    if fixed.is_file() {
        return Some(fixed.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("dnsmasq"))
        .find(|p| p.is_file())
}

/// Whether dnsmasq is installed (/usr/sbin/dnsmasq or `dnsmasq` on PATH).
///
/// Panics when it is missing and `FULCRUM_REQUIRE_DNS` is set, so CI cannot skip silently.
pub fn dnsmasq_available() -> bool {
    let found = dnsmasq_path().is_some();
    if !found && std::env::var_os("FULCRUM_REQUIRE_DNS").is_some() {
        panic!(
            "FULCRUM_REQUIRE_DNS is set but dnsmasq is not installed \
             (looked for /usr/sbin/dnsmasq and dnsmasq on PATH; Debian package dnsmasq-base)"
        );
    }
    found
}

/// DNS records to serve, built up with [`Records::a`] and [`Records::srv`]. Names are
/// given in full (`sip.pool.test`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Records {
    entries: Vec<Entry>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    Host {
        name: String,
        ip: IpAddr,
    },
    Srv {
        name: String,
        target: String,
        port: u16,
        priority: u16,
        weight: u16,
    },
}

impl Records {
    /// No records: every name under the zone is NXDOMAIN.
    pub fn new() -> Records {
        Records::default()
    }

    /// An A record (IPv4) or AAAA record (IPv6) for `name`; repeat for more addresses.
    pub fn a(mut self, name: &str, ip: IpAddr) -> Records {
        self.entries.push(Entry::Host {
            name: checked_name(name),
            ip,
        });
        self
    }

    /// An SRV record `name` (`_sip._udp.pool.test`) pointing at `target:port`; repeat for
    /// more targets.
    pub fn srv(
        mut self,
        name: &str,
        target: &str,
        port: u16,
        priority: u16,
        weight: u16,
    ) -> Records {
        self.entries.push(Entry::Srv {
            name: checked_name(name),
            target: checked_name(target),
            port,
            priority,
            weight,
        });
        self
    }

    /// The records as dnsmasq config lines.
    fn conf(&self) -> String {
        let mut out = String::from("# Written by tests/common/dns.rs.\n");
        for entry in &self.entries {
            let line = match entry {
                Entry::Host { name, ip } => format!("host-record={name},{ip},{TTL}\n"),
                Entry::Srv {
                    name,
                    target,
                    port,
                    priority,
                    weight,
                } => format!("srv-host={name},{target},{port},{priority},{weight}\n"),
            };
            out.push_str(&line);
        }
        out
    }
}

/// `name` without a trailing dot, after checking it cannot break the config line.
fn checked_name(name: &str) -> String {
    let name = name.trim_end_matches('.');
    assert!(
        !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
            && name.split('.').all(|l| !l.is_empty() && l.len() <= 63),
        "not a DNS name the test server can serve: {name:?}"
    );
    name.to_string()
}

/// A running dnsmasq on 127.0.0.1, serving a zone from a [`Records`] set.
///
/// Dropping it stops the server and removes its scratch directory (kept, with the query
/// log, when the test is panicking).
pub struct Dns {
    binary: PathBuf,
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    tag: String,
    zone: String,
    records: Records,
}

/// Why one launch of dnsmasq failed.
enum LaunchError {
    /// Someone else holds the port: try again (another port, or the same one a bit later).
    PortBusy(String),
    /// Anything else: the test cannot go on.
    Failed(String),
}

impl Dns {
    /// Starts dnsmasq on a free UDP+TCP port of 127.0.0.1, serving `records` for `zone`
    /// (`pool.test`); names under the zone not in `records` are NXDOMAIN, nothing is ever
    /// forwarded. Returns once the server answers. `tag` names the scratch directory
    /// (`fulcrum-dns-{pid}-{tag}` under the temp dir) and must be unique among the servers
    /// alive in this process.
    pub fn start(tag: &str, zone: &str, records: &Records) -> Dns {
        let binary = dnsmasq_path().expect(
            "dnsmasq is not installed: call dns::dnsmasq_available() first and skip the test",
        );
        let zone = checked_name(zone);
        let dir = claim_dir(tag);
        let mut dns = Dns {
            binary,
            child: None,
            port: 0,
            dir,
            tag: tag.to_string(),
            zone,
            records: records.clone(),
        };
        let mut last = String::new();
        for _ in 0..5 {
            dns.port = free_port();
            match dns.launch() {
                Ok(()) => return dns,
                Err(LaunchError::PortBusy(why)) => last = why,
                Err(LaunchError::Failed(why)) => panic!("{why}"),
            }
        }
        panic!("dnsmasq found no free port on 127.0.0.1 in 5 tries; last: {last}");
    }

    /// The server's address, 127.0.0.1:PORT (UDP and TCP).
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), self.port)
    }

    /// Serves `records` instead. dnsmasq re-reads only hosts files on SIGHUP, not the
    /// records in its config, so this restarts it on the same port: for the few ms of the
    /// restart queries get no answer. Returns once the new records are served. A stopped
    /// server stays stopped and serves `records` when resumed.
    pub fn set(&mut self, records: &Records) {
        self.records = records.clone();
        if self.child.is_some() {
            self.halt();
            self.relaunch();
        }
    }

    /// Stops the server: queries to its port get no answer (ICMP port unreachable).
    pub fn stop(&mut self) {
        self.halt();
    }

    /// Starts the server again on the same port with the current records; returns once it
    /// answers. Does nothing if it is running.
    pub fn resume(&mut self) {
        if self.child.is_none() {
            self.relaunch();
        }
    }

    /// The query log so far (empty if it cannot be read).
    pub fn log(&self) -> String {
        let mut out = fs::read_to_string(self.dir.join("dnsmasq.log")).unwrap_or_default();
        let stderr = fs::read_to_string(self.dir.join("dnsmasq.stderr")).unwrap_or_default();
        if !stderr.trim().is_empty() {
            out.push_str("--- stderr ---\n");
            out.push_str(&stderr);
        }
        out
    }

    /// dnsmasq's command line, all but the binary.
    fn args(&self) -> Vec<String> {
        let mut args = vec![
            "--keep-in-foreground".to_string(),
            format!("--conf-file={}", self.dir.join("dnsmasq.conf").display()),
            "--no-resolv".to_string(),
            "--no-hosts".to_string(),
            "--no-poll".to_string(),
            "--listen-address=127.0.0.1".to_string(),
            "--bind-interfaces".to_string(),
            format!("--port={}", self.port),
            // Empty: no pid file.
            "--pid-file=".to_string(),
            format!("--log-facility={}", self.dir.join("dnsmasq.log").display()),
            "--log-queries".to_string(),
            format!("--local=/{}/", self.zone),
            format!("--local-ttl={TTL}"),
            format!("--neg-ttl={TTL}"),
            format!("--auth-ttl={TTL}"),
            "--cache-size=0".to_string(),
        ];
        // As root dnsmasq would drop to `nobody`, who may not write the log in our directory.
        if running_as_root() {
            args.push("--user=root".to_string());
        }
        args
    }

    /// Starts dnsmasq on `self.port` and waits until it answers.
    fn launch(&mut self) -> Result<(), LaunchError> {
        assert!(self.child.is_none(), "dnsmasq launched twice");
        let conf = self.dir.join("dnsmasq.conf");
        fs::write(&conf, self.records.conf())
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", conf.display()));
        let stderr_path = self.dir.join("dnsmasq.stderr");
        // Truncated on each launch, so the text read after a failure is this launch's.
        let stderr = File::create(&stderr_path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", stderr_path.display()));
        let child = Command::new(&self.binary)
            .args(self.args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.binary.display()));
        self.child = Some(child);

        let deadline = Instant::now() + READY;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                let stderr = fs::read_to_string(&stderr_path).unwrap_or_default();
                let why = format!(
                    "dnsmasq on 127.0.0.1:{} exited at startup ({status}); stderr:\n{stderr}",
                    self.port
                );
                return Err(if stderr.contains("in use") {
                    LaunchError::PortBusy(why)
                } else {
                    LaunchError::Failed(why)
                });
            }
            // Any response at all (NXDOMAIN or NODATA for the zone apex) means it serves.
            if query_at(self.addr(), &self.zone, QTYPE_A, Duration::from_millis(50)).is_some() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.halt();
                return Err(LaunchError::Failed(format!(
                    "dnsmasq on 127.0.0.1:{} did not answer within {READY:?}; log in {}:\n{}",
                    self.port,
                    self.dir.display(),
                    self.log()
                )));
            }
            // A refused query returns at once: do not spin.
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Launches again on the same port, waiting out a briefly busy port.
    fn relaunch(&mut self) {
        let deadline = Instant::now() + SAME_PORT;
        loop {
            match self.launch() {
                Ok(()) => return,
                Err(LaunchError::PortBusy(why)) if Instant::now() >= deadline => {
                    panic!(
                        "port 127.0.0.1:{} stayed busy for {SAME_PORT:?}: {why}",
                        self.port
                    )
                }
                Err(LaunchError::PortBusy(_)) => std::thread::sleep(Duration::from_millis(20)),
                Err(LaunchError::Failed(why)) => panic!("{why}"),
            }
        }
    }

    /// Stops dnsmasq (SIGTERM, SIGKILL after 2 s) and reaps it.
    fn halt(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(None) = child.try_wait() {
            let termed = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !termed {
                let _ = child.kill();
            }
            let deadline = Instant::now() + Duration::from_secs(2);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => return,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    _ => break,
                }
            }
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.halt();
        let mut live = LIVE_TAGS.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|t| t != &self.tag);
        drop(live);
        if std::thread::panicking() {
            eprintln!(
                "dns: dnsmasq config and query log kept in {}",
                self.dir.display()
            );
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Creates the scratch directory for `tag`, after checking no live server in this process
/// uses it (a leftover from an earlier process with the same pid is removed).
fn claim_dir(tag: &str) -> PathBuf {
    assert!(
        !tag.is_empty()
            && tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
        "dns tag must be a non-empty [A-Za-z0-9_-]+ string, got {tag:?}"
    );
    let mut live = LIVE_TAGS.lock().unwrap_or_else(|e| e.into_inner());
    assert!(
        !live.iter().any(|t| t == tag),
        "two DNS servers alive with the same tag {tag:?}"
    );
    let dir = std::env::temp_dir().join(format!("fulcrum-dns-{}-{tag}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    live.push(tag.to_string());
    dir
}

/// A port of 127.0.0.1 free for both UDP and TCP right now.
fn free_port() -> u16 {
    for _ in 0..20 {
        let udp =
            UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a UDP socket on 127.0.0.1");
        let port = udp
            .local_addr()
            .expect("local address of a bound UDP socket")
            .port();
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
    }
    panic!("no port of 127.0.0.1 free for both UDP and TCP in 20 tries");
}

fn running_as_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("Uid:"))?;
            // Real, effective, saved, filesystem: the effective one decides.
            Some(line.split_whitespace().nth(2)? == "0")
        })
        .unwrap_or(false)
}

/// A DNS query for `name`, type `qtype`, class IN, with recursion desired.
fn query_packet(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut p = Vec::with_capacity(17 + name.len());
    p.extend_from_slice(&id.to_be_bytes());
    p.extend_from_slice(&0x0100u16.to_be_bytes()); // RD
    p.extend_from_slice(&1u16.to_be_bytes()); // QDCOUNT
    p.extend_from_slice(&[0; 6]); // ANCOUNT, NSCOUNT, ARCOUNT
    for label in name
        .trim_end_matches('.')
        .split('.')
        .filter(|l| !l.is_empty())
    {
        assert!(
            label.len() <= 63,
            "DNS label longer than 63 bytes in {name:?}"
        );
        p.push(label.len() as u8);
        p.extend_from_slice(label.as_bytes());
    }
    p.push(0);
    p.extend_from_slice(&qtype.to_be_bytes());
    p.extend_from_slice(&1u16.to_be_bytes()); // IN
    p
}

/// One UDP query to `server`; the response with the query's id, or `None` on timeout,
/// refusal (nothing listening) or any other error.
fn query_at(server: SocketAddr, name: &str, qtype: u16, timeout: Duration) -> Option<Vec<u8>> {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).ok()?;
    // Connected, so an ICMP port unreachable surfaces as an error instead of a timeout.
    socket.connect(server).ok()?;
    socket.send(&query_packet(id, name, qtype)).ok()?;
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        if left.is_zero() {
            return None;
        }
        socket.set_read_timeout(Some(left)).ok()?;
        match socket.recv(&mut buf) {
            Ok(n) if n >= 12 && buf[..2] == id.to_be_bytes() => return Some(buf[..n].to_vec()),
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return None,
        }
    }
}
