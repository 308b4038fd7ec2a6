//! Transparent mode (`transparent: true`, IP_TRANSPARENT toward the service) in network
//! namespaces the test builds: client ns ── lb ns (fulcrum) ── service ns. The service must
//! see the client's own address, not fulcrum's. Needs root and `ip`; otherwise the test
//! prints why and passes without running (skip).
//!
//! The lb namespace delivers the service's replies (addressed to the client) locally with a
//! policy rule (`from SERVICE iif LEG lookup 100` + `local 0.0.0.0/0 dev lo table 100`),
//! the routing an IP_TRANSPARENT deployment needs. The client and the service are this test
//! binary run again inside their namespaces (`helper_*` tests driven by an env variable).

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::netns::ROLE;

/// Service role: accept, answer `PEER=<client address>`, close.
#[test]
fn helper_service() {
    if std::env::var(ROLE).as_deref() != Ok("service") {
        return;
    }
    let addr = std::env::var("FULCRUM_NETNS_ADDR").unwrap_or_default();
    let l = TcpListener::bind(&addr).expect("bind service");
    for c in l.incoming() {
        let Ok(mut c) = c else { continue };
        let peer = c.peer_addr().map(|p| p.to_string()).unwrap_or_default();
        let _ = c.write_all(format!("PEER={peer}\n").as_bytes());
    }
}

/// UDP service role: answer each datagram with `PEER=<sender address>`.
#[test]
fn helper_udp_service() {
    if std::env::var(ROLE).as_deref() != Ok("udp-service") {
        return;
    }
    let addr = std::env::var("FULCRUM_NETNS_ADDR").unwrap_or_default();
    let s = std::net::UdpSocket::bind(&addr).expect("bind service");
    let mut buf = [0u8; 2048];
    while let Ok((_, from)) = s.recv_from(&mut buf) {
        let _ = s.send_to(format!("PEER={from}").as_bytes(), from);
    }
}

/// UDP client role: send until answered, print the answer.
#[test]
fn helper_udp_client() {
    if std::env::var(ROLE).as_deref() != Ok("udp-client") {
        return;
    }
    let addr: std::net::SocketAddr = std::env::var("FULCRUM_NETNS_ADDR")
        .unwrap_or_default()
        .parse()
        .expect("addr");
    let s = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let mut buf = [0u8; 2048];
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        let _ = s.send_to(b"hello", addr);
        if let Ok((n, _)) = s.recv_from(&mut buf) {
            println!("ANSWER {}", String::from_utf8_lossy(&buf[..n]));
            return;
        }
    }
    println!("ANSWER none");
}

/// Client role: connect (retrying while fulcrum starts), print what the service said.
#[test]
fn helper_client() {
    if std::env::var(ROLE).as_deref() != Ok("client") {
        return;
    }
    let addr = std::env::var("FULCRUM_NETNS_ADDR").unwrap_or_default();
    let end = Instant::now() + Duration::from_secs(10);
    while Instant::now() < end {
        if let Ok(mut s) =
            TcpStream::connect_timeout(&addr.parse().expect("addr"), Duration::from_secs(1))
        {
            let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            if out.starts_with("PEER=") {
                println!("ANSWER {}", out.trim());
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("ANSWER none");
}

struct Netns {
    names: Vec<String>,
    children: Vec<Child>,
}

impl Drop for Netns {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for n in &self.names {
            let _ = ip(&format!("netns del {n}"));
        }
    }
}

/// `ip ARGS` with the arguments in one string ([`common::netns::ip`]).
fn ip(args: &str) -> Result<(), String> {
    common::netns::ip(&args.split_whitespace().collect::<Vec<_>>())
}

fn setup(ns: &mut Netns, tag: &str) -> Result<(), String> {
    let (cli, lb, svc) = (
        format!("fc-cli-{tag}"),
        format!("fc-lb-{tag}"),
        format!("fc-svc-{tag}"),
    );
    for n in [&cli, &lb, &svc] {
        ip(&format!("netns add {n}"))?;
        ns.names.push(n.clone());
        ip(&format!("-n {n} link set lo up"))?;
    }
    ip(&format!(
        "link add fcc{tag} netns {cli} type veth peer name fcl{tag} netns {lb}"
    ))?;
    ip(&format!(
        "link add fcs{tag} netns {svc} type veth peer name fcm{tag} netns {lb}"
    ))?;
    ip(&format!("-n {cli} addr add 10.71.1.2/24 dev fcc{tag}"))?;
    ip(&format!("-n {lb} addr add 10.71.1.1/24 dev fcl{tag}"))?;
    ip(&format!("-n {lb} addr add 10.71.2.1/24 dev fcm{tag}"))?;
    ip(&format!("-n {svc} addr add 10.71.2.2/24 dev fcs{tag}"))?;
    for (n, d) in [
        (&cli, format!("fcc{tag}")),
        (&lb, format!("fcl{tag}")),
        (&lb, format!("fcm{tag}")),
        (&svc, format!("fcs{tag}")),
    ] {
        ip(&format!("-n {n} link set {d} up"))?;
    }
    ip(&format!("-n {cli} route add default via 10.71.1.1"))?;
    ip(&format!("-n {svc} route add default via 10.71.2.1"))?;
    // Replies from the service to the client's address are for fulcrum's transparent socket.
    ip(&format!(
        "-n {lb} rule add from 10.71.2.2 iif fcm{tag} lookup 100"
    ))?;
    ip(&format!(
        "-n {lb} route add local 0.0.0.0/0 dev lo table 100"
    ))?;
    Ok(())
}

fn spawn_in(ns: &str, program: &str, args: &[&str], env: &[(&str, &str)]) -> Result<Child, String> {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, program])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().map_err(|e| format!("spawn in {ns}: {e}"))
}

#[test]
fn transparent_tcp_service_sees_the_client_address() {
    transparent_case("tcp", 0);
}

#[test]
fn transparent_udp_service_sees_the_client_address() {
    transparent_case("udp", 1);
}

/// One namespace triple per protocol (`slot` keeps their names and subnets apart).
fn transparent_case(protocol: &str, slot: u32) {
    let name = format!("transparent_{protocol}_service_sees_the_client_address");
    if std::env::var(ROLE).is_ok() {
        return;
    }
    if !common::netns::is_root() {
        println!("SKIP {name}: needs root for network namespaces");
        return;
    }
    let tag = format!("{}{slot}", std::process::id() % 10_000);
    let mut ns = Netns {
        names: Vec::new(),
        children: Vec::new(),
    };
    if let Err(e) = setup(&mut ns, &tag) {
        println!("SKIP {name}: cannot build namespaces: {e}");
        return;
    }
    let (svc_role, cli_role, svc_helper, cli_helper) = if protocol == "udp" {
        (
            "udp-service",
            "udp-client",
            "helper_udp_service",
            "helper_udp_client",
        )
    } else {
        ("service", "client", "helper_service", "helper_client")
    };
    let me = std::env::current_exe().expect("test binary");
    let me = me.to_str().expect("utf-8 path");
    let svc = spawn_in(
        &format!("fc-svc-{tag}"),
        me,
        &["--exact", svc_helper, "--nocapture"],
        &[(ROLE, svc_role), ("FULCRUM_NETNS_ADDR", "10.71.2.2:9000")],
    )
    .expect("service");
    ns.children.push(svc);
    let dir = std::env::temp_dir().join(format!("fulcrum-transparent-{tag}"));
    std::fs::create_dir_all(&dir).expect("dir");
    let cfg = dir.join("t.yaml");
    std::fs::write(
        &cfg,
        format!("admin:\n  listen: null\nservices:\n  - {{ name: s, address: \"10.71.2.2:9000\", protocol: {protocol} }}\n\
vservers:\n  - name: t\n    protocol: {protocol}\n    bind: [\"10.71.1.1:8000\"]\n    method: round_robin\n    transparent: true\n    services: [s]\n"),
    )
    .expect("config");
    let lb = spawn_in(
        &format!("fc-lb-{tag}"),
        env!("CARGO_BIN_EXE_fulcrum"),
        &["run", "--config", cfg.to_str().expect("path")],
        &[],
    )
    .expect("fulcrum");
    ns.children.push(lb);
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &format!("fc-cli-{tag}"),
            me,
            "--exact",
            cli_helper,
            "--nocapture",
        ])
        .env(ROLE, cli_role)
        .env("FULCRUM_NETNS_ADDR", "10.71.1.1:8000")
        .output()
        .expect("client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let answer = stdout
        .lines()
        .find_map(|l| l.strip_prefix("ANSWER "))
        .unwrap_or("none")
        .to_string();
    let _ = std::fs::remove_dir_all(&dir);
    println!("transparent {protocol}: the service saw {answer}");
    assert!(
        answer.starts_with("PEER=10.71.1.2:"),
        "service saw {answer}; client output: {stdout}"
    );
}
