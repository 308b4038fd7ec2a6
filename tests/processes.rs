//! Firewall pools across processes (docs/methods.md, Determinism): two `fulcrum run`
//! processes started from one config choose the same service for the same flow, over UDP and
//! TCP. Separate processes,
//! not two runtimes in this one, so nothing process-wide (a seeded hasher, a static) can make
//! them agree by accident. Synchronised on the processes' log lines, with deadlines.

mod common;

use common::*;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::process::Child;

/// A `fulcrum run` child process over a config file of its own; killed when dropped.
struct Fulcrum {
    child: Child,
    /// Its config, removed after the child is killed (fields drop in order).
    _file: ConfigFile,
    /// The address its vserver bound (from its `listening` log line).
    addr: SocketAddr,
    /// Its stderr lines, read for as long as it runs.
    log: std::sync::mpsc::Receiver<String>,
    /// Lines read from `log` before the one looked for (the log's order across threads is
    /// not fixed: a worker may log before the `listening` line).
    seen: Vec<String>,
}

impl Fulcrum {
    fn start(tag: &str, yaml: &str, env: &[(&str, &str)]) -> Fulcrum {
        let file = ConfigFile::new(&format!("proc-{tag}"), yaml);
        let (child, rx) = spawn_fulcrum_env(&file.path, "0s", env);
        // Guarded from here on: a failed start below still kills the child.
        let mut f = Fulcrum {
            child,
            _file: file,
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            log: rx,
            seen: Vec::new(),
        };
        let line = f.line("listening");
        assert!(
            !line.contains('\u{1b}'),
            "log to a pipe is plain text: {line:?}"
        );
        f.addr = bound_in(&line).unwrap_or_else(|| panic!("{tag}: no address in {line:?}"));
        f
    }

    /// The first log line containing `needle`, among the lines already read or else the
    /// next ones (at most 10 s).
    fn line(&mut self, needle: &str) -> String {
        expect_line_keeping(&self.log, needle, &mut self.seen)
    }
}

impl Drop for Fulcrum {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The first address of a `listening ... bound=[A, B]` log line.
fn bound_in(line: &str) -> Option<SocketAddr> {
    if !line.contains("listening") {
        return None;
    }
    let rest = &line[line.find("bound=[")? + "bound=[".len()..];
    let list = &rest[..rest.find(']')?];
    list.split(", ").next()?.parse().ok()
}

/// Two processes over one config of `protocol` vserver `v` with `n` services, `method`. The
/// second sends to services with one `send` per datagram (io_uring switched off), so the UDP
/// test also checks that both send paths carry the same flows.
fn pair(protocol: &str, n: usize, method: &str) -> [Fulcrum; 2] {
    // The services' threads live as long as this test process.
    let svc = services(protocol, n, "127.0.0.1");
    let yaml = config(protocol, "127.0.0.1:0", method, "", &refs(&svc));
    [
        Fulcrum::start(&format!("{protocol}-a"), &yaml, &[]),
        Fulcrum::start(
            &format!("{protocol}-b"),
            &yaml,
            &[(fulcrum::uring::ENV_SWITCH, "off")],
        ),
    ]
}

#[test]
fn two_processes_choose_the_same_service_per_udp_flow() {
    let [mut a, mut b] = pair("udp", 4, "source_ip_source_port_hash");
    assert_ne!(a.addr, b.addr);
    // Each worker says how it sends: b was told to send plainly; a uses io_uring where this
    // machine allows it (then the flows below cross both send paths).
    let plain = b.line("udp worker ready");
    assert!(plain.contains("io_uring=false"), "{plain}");
    let ring = a.line("udp worker ready");
    if fulcrum::uring::SendBatch::new().uses_io_uring() {
        assert!(ring.contains("io_uring=true"), "{ring}");
    } else {
        eprintln!("io_uring is not available here: both processes send plainly");
    }
    let mut used = HashSet::new();
    for _ in 0..24 {
        // One client socket toward both: the same flow key (source address and port).
        let c = udp_client("127.0.0.1");
        let x = udp_ask(&c, a.addr, b"m").expect("answer via a").0.service;
        let y = udp_ask(&c, b.addr, b"m").expect("answer via b").0.service;
        assert_eq!(x, y, "flow {:?}", c.local_addr());
        used.insert(x);
    }
    assert!(used.len() >= 3, "flows spread: {used:?}");
}

#[test]
fn two_processes_choose_the_same_service_per_tcp_connection() {
    let [a, b] = pair("tcp", 4, "source_ip_source_port_hash");
    let mut used = HashSet::new();
    for _ in 0..16 {
        // The same client address and port toward both (a mirrored connection).
        let (_reserved, from) = reserved_client_addr("127.0.0.1");
        let x = tcp_ask_from(a.addr, Some(from), b"m")
            .expect("answer via a")
            .service;
        let y = tcp_ask_from(b.addr, Some(from), b"m")
            .expect("answer via b")
            .service;
        assert_eq!(x, y, "{from}");
        used.insert(x);
    }
    assert!(used.len() >= 3, "connections spread: {used:?}");
}

#[test]
fn bound_address_is_read_from_the_listening_line() {
    assert_eq!(
        bound_in(
            "2026-11-30T03:21:42Z  INFO fulcrum: listening vserver=u bound=[127.0.0.1:46579, [::1]:46580]"
        ),
        Some("127.0.0.1:46579".parse().expect("addr"))
    );
    assert_eq!(bound_in("udp vserver started bind=[127.0.0.1:1]"), None);
}

/// README's first command, shortened: the demo runs its calls and its sip-udp workers end
/// cleanly (a shutdown's wake-up of a blocking receive once panicked in std's address
/// decoding, printing a backtrace per worker at the end of every demo).
#[test]
fn the_demo_completes_calls_and_ends_without_a_panic() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fulcrum"))
        .args(["demo", "--duration", "3s"])
        .output()
        .expect("run the demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let done = stdout.lines().last().unwrap_or_default();
    let completed: u64 = done
        .strip_prefix("done: ")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no summary line: {stdout}"));
    assert!(completed > 100, "{done}");
}
