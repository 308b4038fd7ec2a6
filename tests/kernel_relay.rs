//! The in-kernel TCP relay (docs/kernel-relay.md) over real sockets: once fulcrum has chosen
//! the service, a BPF sockmap moves the bytes. Each test runs whichever relay this process
//! has: the kernel's where it starts (root, Linux 5.13 or later), the user-space fallback
//! where it does not or where `FULCRUM_KERNEL_RELAY=off` forces it (CI runs this file both
//! ways), and checks the same outcome, plus that `kernel_relayed` counted each connection
//! the kernel took and no other. Large payloads both ways through a half-close, bytes sent
//! before the hand-over, resets from either side, the idle timeout, the drain's cut, a
//! thousand connections at once, `kernel_relay: off`, and the fallback's reason at start.
//!
//! `FULCRUM_REQUIRE_BPF=1` (set by CI, which runs as root) makes a kernel relay that cannot
//! start a failure instead of a fallback, unless the fallback is what was asked for.

mod common;

use common::*;
use fulcrum::config;
use fulcrum::ops::Ops;
use fulcrum::proxy::{TcpCore, TcpPath};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// The vserver field that asks for the kernel relay (the default is the user-space relay).
const AUTO: &str = "kernel_relay: auto";

fn tcp_core(rt: &fulcrum::proxy::Runtime) -> Arc<TcpCore> {
    let v = rt.vserver("v").expect("vserver");
    Arc::clone(v.path::<TcpPath>().expect("tcp").core())
}

fn relayed(core: &TcpCore) -> u64 {
    core.counters.kernel_relayed.load(Ordering::Relaxed)
}

/// Whether this vserver's connections go through the kernel: checked against what the
/// environment asks for.
fn in_kernel(core: &TcpCore) -> bool {
    match core.kernel_relay() {
        Ok(()) => true,
        Err(why) => {
            let forced_off = std::env::var("FULCRUM_KERNEL_RELAY").is_ok_and(|v| v == "off");
            assert!(
                forced_off || std::env::var_os("FULCRUM_REQUIRE_BPF").is_none(),
                "the kernel relay cannot start ({why}) and FULCRUM_REQUIRE_BPF is set"
            );
            eprintln!("the user-space relay is tested: {why}");
            false
        }
    }
}

/// A client connection to `vs` whose reads give up after `secs`.
fn client(vs: SocketAddr, secs: u64) -> TcpStream {
    let s = TcpStream::connect(vs).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(secs)))
        .expect("timeout");
    s
}

/// Whether fulcrum closed `s` (end of file or a reset) rather than answered, before the
/// read timeout (a timeout is neither).
fn closed_by_fulcrum(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 16];
    match s.read(&mut buf) {
        Ok(n) => n == 0,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

/// Connect, give fulcrum time to choose and splice (only established sockets enter the
/// sockmap), then send `payload`, half-close and read the answer.
fn ask_after_splice(vs: SocketAddr, payload: &[u8]) -> Answer {
    let mut s = client(vs, 20);
    std::thread::sleep(Duration::from_millis(30));
    s.write_all(payload).expect("send");
    s.shutdown(Shutdown::Write).expect("half-close");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read");
    whole(&out)
}

fn whole(out: &[u8]) -> Answer {
    parse_answer(out).unwrap_or_else(|| {
        panic!(
            "no whole answer: {} bytes, starting {:?}",
            out.len(),
            String::from_utf8_lossy(&out[..out.len().min(60)])
        )
    })
}

#[test]
fn large_payloads_both_ways_intact_with_a_half_close_and_counted() {
    let (rt, vs) = start_loopback("tcp", 1, "round_robin", AUTO);
    let core = tcp_core(&rt);
    let kernel = in_kernel(&core);
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let a = ask_after_splice(vs, &big);
    assert_eq!(a.body.len(), big.len());
    assert!(a.body == big, "3 MB echoed intact");
    assert_eq!(relayed(&core), u64::from(kernel));
    assert!(wait_until(Duration::from_secs(5), || core.connections() == 0));
    // Counted from TCP_INFO by the kernel relay's owner: every byte, the FINs not.
    let bytes_in = core.counters.bytes_in.load(Ordering::Relaxed);
    assert_eq!(bytes_in, big.len() as u64);
    let answer_len = (a.service.len() + a.proxy_src.len() + 2 + big.len()) as u64;
    assert_eq!(core.counters.bytes_out.load(Ordering::Relaxed), answer_len);
    assert_eq!(core.counters.client_errors.load(Ordering::Relaxed), 0);
    assert_eq!(core.counters.service_errors.load(Ordering::Relaxed), 0);
}

/// Bytes the client sent before the sockets entered the sockmap (queued, unread by user
/// space) are relayed at the hand-over, ahead of later ones, without waiting for more.
#[test]
fn bytes_sent_before_the_hand_over_are_relayed_first() {
    let (rt, vs) = start_loopback("tcp", 1, "round_robin", AUTO);
    let core = tcp_core(&rt);
    let kernel = in_kernel(&core);
    for round in 0..20u64 {
        let mut s = client(vs, 10);
        // At once: these are in the socket before fulcrum splices it.
        s.write_all(b"first;").expect("send");
        std::thread::sleep(Duration::from_millis(5));
        s.write_all(b"second").expect("send");
        std::thread::sleep(Duration::from_millis(5));
        s.shutdown(Shutdown::Write).expect("half-close");
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("read");
        assert_eq!(whole(&out).body, b"first;second", "round {round}");
        if !kernel {
            assert_eq!(relayed(&core), 0);
        }
    }
    assert!(
        !kernel || relayed(&core) > 0,
        "some went through the kernel"
    );
}

/// A service that accepts, reads what comes and then resets the connection (SO_LINGER 0).
fn resetting_service() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let at = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                let _ = c.read(&mut buf);
                let _ = socket2::SockRef::from(&c).set_linger(Some(Duration::ZERO));
            });
        }
    });
    at
}

#[test]
fn a_reset_from_either_side_ends_the_connection_and_is_counted() {
    // The client resets: the service sees the connection end, fulcrum counts a client error.
    let (rt, vs) = start_loopback("tcp", 1, "round_robin", AUTO);
    let core = tcp_core(&rt);
    let kernel = in_kernel(&core);
    let s = TcpStream::connect(vs).expect("connect");
    std::thread::sleep(Duration::from_millis(30));
    (&s).write_all(b"then a reset").expect("send");
    assert!(wait_until(Duration::from_secs(5), || core.connections() == 1));
    socket2::SockRef::from(&s)
        .set_linger(Some(Duration::ZERO))
        .expect("linger");
    drop(s);
    assert!(wait_until(Duration::from_secs(5), || core.connections() == 0));
    assert_eq!(core.counters.client_errors.load(Ordering::Relaxed), 1);
    assert_eq!(relayed(&core), u64::from(kernel));

    // The service resets: the client's connection ends, fulcrum counts a service error.
    let svc = resetting_service();
    let rt = start(&config(
        "tcp",
        "127.0.0.1:0",
        "round_robin",
        AUTO,
        &[("s0", svc)],
    ));
    let vs = bound(&rt, "v");
    let core = tcp_core(&rt);
    let mut s = client(vs, 5);
    std::thread::sleep(Duration::from_millis(30));
    s.write_all(b"hello").expect("send");
    // End of file or a reset, never an answer and never a hang.
    assert!(closed_by_fulcrum(&mut s));
    assert!(wait_until(Duration::from_secs(5), || core.connections() == 0));
    assert_eq!(core.counters.service_errors.load(Ordering::Relaxed), 1);
    assert_eq!(relayed(&core), u64::from(kernel));
}

#[test]
fn an_idle_connection_times_out() {
    let (rt, vs) = start_loopback(
        "tcp",
        1,
        "round_robin",
        "idle_timeout: 400ms\n    kernel_relay: auto",
    );
    let core = tcp_core(&rt);
    let kernel = in_kernel(&core);
    let mut s = client(vs, 5);
    std::thread::sleep(Duration::from_millis(50));
    s.write_all(b"then silence").expect("send");
    let started = std::time::Instant::now();
    // Closed by fulcrum within a check or two of the timeout (the service never answers: it
    // waits for the half-close).
    assert!(closed_by_fulcrum(&mut s), "closed, nothing sent");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    assert_eq!(relayed(&core), u64::from(kernel));
    assert_eq!(core.counters.idle_timeouts.load(Ordering::Relaxed), 1);
}

/// A reload removes the connection's service: the connection keeps its bytes moving until
/// the drain deadline, then is cut.
#[test]
fn a_draining_service_keeps_its_connection_until_the_cut() {
    let (a0, _) = tcp_service("s0", "127.0.0.1");
    let (a1, _) = tcp_service("s1", "127.0.0.1");
    let yaml = |svcs: &[(&str, SocketAddr)]| {
        config(
            "tcp",
            "127.0.0.1:0",
            "round_robin",
            "drain_timeout: 1s\n    kernel_relay: auto",
            svcs,
        )
    };
    let file = ConfigFile::new("kernel-drain", &yaml(&[("s0", a0)]));
    let ops = Ops::start(
        config::load(&file.path).expect("valid"),
        Some(file.path.clone()),
    )
    .expect("start");
    let vs = ops.with_vservers(|vs, _| vs[0].bound[0]).expect("running");
    let core = ops
        .with_vservers(|vs, _| Arc::clone(vs[0].path::<TcpPath>().expect("tcp").core()))
        .expect("core");
    let kernel = in_kernel(&core);
    let mut kept = client(vs, 10);
    std::thread::sleep(Duration::from_millis(30));
    kept.write_all(b"before the reload;").expect("send");
    assert!(wait_until(Duration::from_secs(5), || core.connections() == 1));
    assert_eq!(relayed(&core), u64::from(kernel));
    file.write(&yaml(&[("s1", a1)]));
    ops.reload().expect("reload");
    // Still open and relayed while draining.
    kept.write_all(b"during the drain").expect("send");
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(core.connections(), 1, "kept until the deadline");
    std::thread::sleep(Duration::from_millis(900));
    // Past the deadline: cut, nothing answered.
    assert!(closed_by_fulcrum(&mut kept));
    assert!(wait_until(Duration::from_secs(5), || core.connections() == 0));
    // And one finishing inside the deadline is whole (a fresh connection on s1).
    let a = ask_after_splice(vs, b"after");
    assert_eq!(
        (a.service.as_str(), a.body.as_slice()),
        ("s1", &b"after"[..])
    );
    ops.shutdown();
}

#[test]
fn a_thousand_connections_at_once() {
    let (rt, vs) = start_loopback("tcp", 2, "round_robin", AUTO);
    let core = tcp_core(&rt);
    let kernel = in_kernel(&core);
    let clients: Vec<_> = (0..1000u32)
        .map(|i| {
            let s = client(vs, 20);
            (i, s)
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut clients: Vec<_> = clients
        .into_iter()
        .map(|(i, mut s)| {
            let payload = format!("client {i} ").repeat(100);
            s.write_all(payload.as_bytes()).expect("send");
            s.shutdown(Shutdown::Write).expect("half-close");
            (payload, s)
        })
        .collect();
    for (payload, s) in &mut clients {
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("read");
        assert_eq!(whole(&out).body, payload.as_bytes());
    }
    // Every one is handed over (a client whose FIN came before fulcrum got to it cannot
    // enter the map; its owner then copies both ways itself, `kernel_relay_kept`).
    assert_eq!(relayed(&core), if kernel { 1000 } else { 0 });
    assert!(wait_until(Duration::from_secs(5), || core.connections() == 0));
    assert_eq!(core.counters.service_errors.load(Ordering::Relaxed), 0);
    assert_eq!(core.counters.client_errors.load(Ordering::Relaxed), 0);
}

/// `kernel_relay: off`, the default: the user-space relay, the same bytes, and `/status`
/// says why.
#[test]
fn kernel_relay_off_keeps_the_user_space_relay() {
    let (rt, vs) = start_loopback("tcp", 1, "round_robin", "");
    let core = tcp_core(&rt);
    match std::env::var("FULCRUM_KERNEL_RELAY").ok().as_deref() {
        Some("auto") => assert!(core.kernel_relay() != Err("kernel_relay: off")),
        Some("off") => assert_eq!(core.kernel_relay(), Err("FULCRUM_KERNEL_RELAY=off")),
        _ => assert_eq!(core.kernel_relay(), Err("kernel_relay: off")),
    }
    let kernel = core.kernel_relay().is_ok();
    let big: Vec<u8> = (0..500_000u32).map(|i| (i % 241) as u8).collect();
    let a = ask_after_splice(vs, &big);
    assert!(a.body == big);
    assert_eq!(relayed(&core), u64::from(kernel));
    // So does a method that samples every response (unless the relay is off for all).
    let (rt, _) = start_loopback("tcp", 1, "least_response_time", AUTO);
    let why = tcp_core(&rt).kernel_relay().map_err(str::to_owned);
    if std::env::var("FULCRUM_KERNEL_RELAY").as_deref() != Ok("off") {
        assert!(
            why.as_ref()
                .is_err_and(|w| w.contains("least_response_time")),
            "{why:?}"
        );
    }
}

/// The relay unavailable (forced in a child process): fulcrum says why once at start and
/// in `/status`, and relays in user space.
#[test]
fn without_the_kernel_relay_the_user_space_relay_serves_and_says_why() {
    let (svc, _) = tcp_service("s0", "127.0.0.1");
    let free = || {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port()
    };
    let (port, admin) = (free(), free());
    let file = ConfigFile::new(
        "kernel-off",
        &format!(
            "admin: {{ listen: \"127.0.0.1:{admin}\" }}\nservices:\n  - {{ name: s0, address: \"{svc}\", protocol: tcp }}\nvservers:\n  - {{ name: v, protocol: tcp, bind: [\"127.0.0.1:{port}\"], method: round_robin, kernel_relay: auto, services: [s0] }}\n"
        ),
    );
    let (mut child, lines) =
        spawn_fulcrum_env(&file.path, "1s", &[("FULCRUM_KERNEL_RELAY", "off")]);
    let line = expect_line(&lines, "kernel relay unavailable");
    assert!(line.contains("FULCRUM_KERNEL_RELAY=off"), "{line}");
    let at = SocketAddr::from(([127, 0, 0, 1], port));
    assert!(wait_until(Duration::from_secs(5), || TcpStream::connect(
        at
    )
    .is_ok()));
    let a = ask_after_splice(at, b"hello");
    assert_eq!(a.body, b"hello");
    let status = http_get(SocketAddr::from(([127, 0, 0, 1], admin)), "/status");
    let v: serde_json::Value = serde_json::from_str(&status).expect("json");
    assert_eq!(
        v["vservers"][0]["kernel_relay"]["in_use"], false,
        "{status}"
    );
    assert_eq!(
        v["vservers"][0]["kernel_relay"]["reason"],
        "FULCRUM_KERNEL_RELAY=off"
    );
    let _ = child.kill();
    let _ = child.wait();
}

/// The body of a plain HTTP/1.0 GET.
fn http_get(at: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(at).expect("admin");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").expect("ask");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}
