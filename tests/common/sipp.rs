//! SIPp (Debian `sip-tester`) as a test peer: whether it is installed, its processes (each
//! with a deadline, terminated when its guard drops), scratch directories for its logs, and
//! a UAC placing load through a vserver whose outcome is read from its stat file. IO.

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Bound of the wait for a SIPp UAS to bind its port.
pub const UP_DEADLINE: Duration = Duration::from_secs(10);

/// Candidate ports tried before a listening SIPp is given up on.
const BIND_ATTEMPTS: usize = 8;

/// SIP transport of a run: SIPp's `-t` mode and fulcrum's protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

impl Transport {
    /// SIPp transport mode: one socket (UDP) or one connection (TCP) per instance.
    pub fn sipp_mode(self) -> &'static str {
        match self {
            Transport::Udp => "u1",
            Transport::Tcp => "t1",
        }
    }

    pub fn protocol(self) -> &'static str {
        match self {
            Transport::Udp => "sip-udp",
            Transport::Tcp => "sip-tcp",
        }
    }
}

pub fn sipp_available() -> bool {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("sipp").is_file()))
        .unwrap_or(false);
    if found {
        return true;
    }
    if std::env::var("FULCRUM_REQUIRE_SIPP").as_deref() == Ok("1") {
        panic!(
            "sipp is not on PATH and FULCRUM_REQUIRE_SIPP=1 (install Debian package sip-tester)"
        );
    }
    eprintln!(
        "SKIPPED: sipp is not on PATH (apt-get install sip-tester); set FULCRUM_REQUIRE_SIPP=1 to make this a failure"
    );
    false
}

/// A child process terminated (SIGTERM, then SIGKILL after a grace period) on drop.
pub struct Proc {
    child: Child,
    name: String,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command) -> Proc {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc {
            child,
            name: name.to_owned(),
        }
    }

    /// Process id of the child (`timeout`, whose child is SIPp).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// True once the child has exited.
    pub fn has_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Wait for exit up to `limit`; kill on timeout. Returns the exit code (None if killed).
    pub fn wait_for(&mut self, limit: Duration) -> Option<i32> {
        let deadline = Instant::now() + limit;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => return st.code(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => {
                    eprintln!("{}: deadline passed, killing", self.name);
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return None;
                }
            }
        }
    }

    /// SIGTERM (SIPp flushes its logs and exits), then SIGKILL after a grace period.
    pub fn terminate(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.wait_for(Duration::from_secs(5));
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.terminate();
    }
}

/// A port free on 127.0.0.1 for `t` a moment ago (bound to port 0, then released): only a
/// candidate, since another process may take it before SIPp does; [`spawn_listening`] copes
/// with that.
fn candidate_port(t: Transport) -> u16 {
    match t {
        Transport::Udp => UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()),
        Transport::Tcp => TcpListener::bind("127.0.0.1:0").and_then(|s| s.local_addr()),
    }
    .expect("candidate port")
    .port()
}

/// Start a SIPp that listens on a port of its own (`command(port)` builds its command line
/// with `-p port`) and return it with that port, once SIPp holds it.
///
/// Why this cannot race: the port is a [`candidate_port`], which another process may take
/// before SIPp binds it. SIPp then fails its own bind ("Unable to bind main socket, errno =
/// 98") and exits; that exit is seen here and SIPp is started again on a new candidate. The
/// port is handed out only once SIPp itself holds it: the socket bound to it (UDP, or TCP in
/// LISTEN) is among the open files of SIPp's process, read from /proc. A port that is merely
/// busy (which is all a bind or connect attempt can tell) proves nothing, since its holder
/// may be the process that took it first.
pub fn spawn_listening(name: &str, t: Transport, command: impl Fn(u16) -> Command) -> (Proc, u16) {
    for _ in 0..BIND_ATTEMPTS {
        let port = candidate_port(t);
        let mut proc = Proc::spawn(&format!("{name} :{port}"), &mut command(port));
        let deadline = Instant::now() + UP_DEADLINE;
        loop {
            if holds_port(proc.id(), t, port) {
                return (proc, port);
            }
            if proc.has_exited() {
                eprintln!("{name}: SIPp exited before holding port {port}; another port");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{name}: SIPp did not bind port {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    panic!("{name}: SIPp could not bind any of {BIND_ATTEMPTS} ports");
}

/// True when a process in the tree under `root` holds the socket bound to `port` on `t` (a
/// UDP socket, or a listening TCP one).
fn holds_port(root: u32, t: Transport, port: u16) -> bool {
    let table = match t {
        Transport::Udp => "/proc/net/udp",
        Transport::Tcp => "/proc/net/tcp",
    };
    let text = std::fs::read_to_string(table).unwrap_or_default();
    // Columns: sl local_address rem_address st ... inode (10th).
    let sockets: Vec<String> = text
        .lines()
        .skip(1)
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let local_port = u16::from_str_radix(cols.get(1)?.rsplit(':').next()?, 16).ok()?;
            let bound = t == Transport::Udp || cols.get(3) == Some(&"0A");
            let inode = cols.get(9)?;
            (local_port == port && bound).then(|| format!("socket:[{inode}]"))
        })
        .collect();
    if sockets.is_empty() {
        return false;
    }
    process_tree(root).into_iter().any(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|fds| {
                fds.flatten().any(|fd| {
                    std::fs::read_link(fd.path()).is_ok_and(|target| {
                        sockets.iter().any(|s| target.as_os_str() == s.as_str())
                    })
                })
            })
            .unwrap_or(false)
    })
}

/// `root` and its descendants (`timeout` runs SIPp as its child).
fn process_tree(root: u32) -> Vec<u32> {
    let mut tree = vec![root];
    let mut next = 0;
    while let Some(&pid) = tree.get(next) {
        next += 1;
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        tree.extend(
            children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok()),
        );
    }
    tree
}

pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("fulcrum-sipp-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("scratch dir");
        Scratch(d)
    }
    pub fn path(&self, f: &str) -> PathBuf {
        self.0.join(f)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        } else {
            eprintln!("SIPp logs kept in {}", self.0.display());
        }
    }
}

/// SuccessfulCall(C) and FailedCall(C) from the last line of a SIPp stat file.
pub fn uac_counts(stat: &Path) -> (u64, u64) {
    let text = std::fs::read_to_string(stat).unwrap_or_default();
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let head: Vec<&str> = lines.next().unwrap_or("").split(';').collect();
    let last: Vec<&str> = lines.next_back().unwrap_or("").split(';').collect();
    let col = |name: &str| {
        head.iter()
            .position(|h| *h == name)
            .and_then(|i| last.get(i))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name} in {}", stat.display()))
    };
    (col("SuccessfulCall(C)"), col("FailedCall(C)"))
}

/// A SIPp UAC load: `calls` calls (`-m`) at `rate_per_s` (`-r`), each held `hold_ms` (`-d`)
/// between its ACK and its BYE.
#[derive(Debug, Clone, Copy)]
pub struct UacLoad {
    pub calls: u32,
    pub rate_per_s: u32,
    pub hold_ms: u32,
}

impl UacLoad {
    /// A bound on the run: placing the calls, holding the last one, and slack for a loaded
    /// machine.
    pub fn deadline(&self) -> Duration {
        let placing_ms = u64::from(self.calls) * 1000 / u64::from(self.rate_per_s.max(1));
        Duration::from_millis(placing_ms + u64::from(self.hold_ms)) + Duration::from_secs(20)
    }
}

/// A running SIPp UAC (built-in `uac` scenario) placing a [`UacLoad`] through `proxy`.
pub struct Uac {
    proc: Proc,
    load: UacLoad,
    stat: PathBuf,
    errors: PathBuf,
}

/// How a UAC run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UacOutcome {
    /// SIPp's exit code (0: every call successful, 1: some failed); None when killed at the
    /// deadline.
    pub exit: Option<i32>,
    pub successful: u64,
    pub failed: u64,
    /// The first lines of SIPp's error log (unexpected messages, timeouts).
    pub errors: String,
}

impl Uac {
    /// Start the UAC at once; [`Uac::finish`] waits for it. A call that sees no expected
    /// message within 5 s fails (`-recv_timeout`), so a lost message fails its call instead
    /// of stalling the run.
    pub fn start(dir: &Scratch, t: Transport, proxy: SocketAddr, load: UacLoad, tag: &str) -> Uac {
        Uac::start_with(dir, t, proxy, load, tag, None)
    }

    /// As [`Uac::start`], from loopback address `source` (127.0.0.2 and up are other
    /// clients on `lo`) instead of 127.0.0.1.
    #[allow(dead_code)]
    pub fn start_from(
        dir: &Scratch,
        t: Transport,
        proxy: SocketAddr,
        load: UacLoad,
        tag: &str,
        source: &str,
    ) -> Uac {
        Uac::start_full(dir, t, proxy, load, tag, None, source)
    }

    /// As [`Uac::start`], with the scenario file `scenario` instead of the built-in `uac`.
    pub fn start_with(
        dir: &Scratch,
        t: Transport,
        proxy: SocketAddr,
        load: UacLoad,
        tag: &str,
        scenario: Option<&Path>,
    ) -> Uac {
        Uac::start_full(dir, t, proxy, load, tag, scenario, "127.0.0.1")
    }

    fn start_full(
        dir: &Scratch,
        t: Transport,
        proxy: SocketAddr,
        load: UacLoad,
        tag: &str,
        scenario: Option<&Path>,
        source: &str,
    ) -> Uac {
        let stat = dir.path(&format!("uac-{tag}.csv"));
        let errors = dir.path(&format!("uac-{tag}-errors.log"));
        let limit = load.deadline().as_secs().to_string();
        // SIPp's own port search is not safe beside another SIPp starting at the same moment
        // over TCP: both bind 5060 (SO_REUSEADDR), and the second's listen fails ("Unable to
        // listen main socket, errno = 98"), so the UAC gets a port of its own that it is seen
        // to hold before the load counts.
        let (proc, _port) = spawn_listening(&format!("sipp uac {tag}"), t, |port| {
            let mut cmd = Command::new("timeout");
            cmd.args(["-s", "KILL", &limit, "sipp", "-t", t.sipp_mode()]);
            match scenario {
                Some(f) => cmd.arg("-sf").arg(f),
                None => cmd.args(["-sn", "uac"]),
            }
            .arg(proxy.to_string())
            .args(["-i", source, "-p", &port.to_string()])
            .args(["-r", &load.rate_per_s.to_string()])
            .args(["-m", &load.calls.to_string()])
            .args(["-d", &load.hold_ms.to_string()])
            .args(["-nostdin", "-timeout", &format!("{limit}s")])
            .args(["-recv_timeout", "5000", "-trace_stat", "-stf"])
            .arg(&stat)
            .args(["-trace_err", "-error_file"])
            .arg(&errors)
            .current_dir(&dir.0);
            cmd
        });
        Uac {
            proc,
            load,
            stat,
            errors,
        }
    }

    /// Wait (bounded) for the UAC to end and read its outcome.
    pub fn finish(mut self) -> UacOutcome {
        let exit = self
            .proc
            .wait_for(self.load.deadline() + Duration::from_secs(5));
        let (successful, failed) = uac_counts(&self.stat);
        let errors = std::fs::read_to_string(&self.errors)
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .take(12)
            .collect::<Vec<_>>()
            .join("\n");
        UacOutcome {
            exit,
            successful,
            failed,
            errors,
        }
    }
}
