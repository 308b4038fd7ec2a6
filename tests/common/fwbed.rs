//! The firewall sandwich in network namespaces (docs/firewall.md): client -- outside
//! balancer -- three strict stateful firewalls -- inside balancer -- server, and the
//! traffic that tells a symmetric sandwich from a broken one. Used by tests/firewall.rs and
//! bench/firewall.sh (through that test binary).
//!
//! ```text
//!  cli  10.1.0.2 --- 10.1.0.1 lbo-c  [lbo]  lbo-fN 10.2.N.1 --- 10.2.N.2 fw-o [fwN]
//!  fwN  fw-i 10.3.N.2 --- 10.3.N.1 lbi-fN  [lbi]  lbi-s 10.4.0.1 --- 10.4.0.2  srv
//! ```
//!
//! Each firewall forwards with a strict nftables ruleset: a flow may begin only from the
//! outside leg and only with a TCP SYN, a UDP datagram or an ICMP echo request;
//! established and related packets pass; everything else is dropped and counted in the
//! named counter `dropped`, which the tests read. A flow whose return packets cross
//! another firewall than its first packet is therefore cut there, and counted.
//!
//! The balancers' `rp_filter` is off: a flow's return packets come in on whichever leg its
//! firewall is on, not the one the balancer's route to their source names.
//!
//! The helper roles run as this test binary again inside a namespace
//! ([`super::netns::ROLE`]): [`serve`] in the server's, [`client`] and [`blast`] in the
//! client's.

use super::netns::{Netns, ip, is_root};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const FIREWALLS: usize = 3;
pub const CLIENT: &str = "10.1.0.2";
pub const SERVER: &str = "10.4.0.2";
pub const TCP_PORT: u16 = 7000;
pub const UDP_PORT: u16 = 7001;
pub const SINK_PORT: u16 = 7002;

/// What the balancers do with the packets that reach them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balancing {
    /// No balancer: both route every flow through firewall 1 (the forwarding baseline).
    Route,
    /// nftables on both: `symhash mod 3` then `fwd` to that firewall's leg (netdev ingress,
    /// neighbour resolved). Symmetric here because both balancers share one kernel's hash
    /// seed.
    Symhash,
    /// The outside balancer by `symhash`, the inside one by the source address only: the
    /// negative control (the server's replies all take one firewall).
    InsideBySource,
    /// Plain ECMP routes on both sides, each direction hashed on its own (L4 policy).
    Ecmp,
    /// Nothing on the balancers but forwarding: a fulcrum `protocol: ip` vserver on each is
    /// to steer the flows.
    Fulcrum,
}

/// The namespaces of one bed, deleted on drop.
pub struct Bed {
    pub tag: String,
    pub cli: Netns,
    pub lbo: Netns,
    pub lbi: Netns,
    pub srv: Netns,
    pub fws: Vec<Netns>,
}

/// Why no bed: the FULCRUM_REQUIRE_NETNS convention of [`super::netns`].
pub fn skip(why: &str) -> Option<Bed> {
    assert!(
        std::env::var("FULCRUM_REQUIRE_NETNS").as_deref() != Ok("1"),
        "{why}, and FULCRUM_REQUIRE_NETNS=1"
    );
    println!("SKIP: {why} (FULCRUM_REQUIRE_NETNS=1 makes this a failure)");
    None
}

fn must(r: Result<(), String>) {
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// `ip -n NS WORDS...`.
fn ipn(ns: &Netns, cmd: &str) {
    let mut args = vec!["-n", ns.0.as_str()];
    args.extend(cmd.split_whitespace());
    must(ip(&args));
}

/// Run `program ARGS` inside `ns`, with `stdin` given; its stdout, or a panic with what it
/// said.
pub fn exec(ns: &Netns, program: &str, args: &[&str], stdin: &str) -> String {
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ns.0, program])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    if let Some(mut i) = child.stdin.take() {
        i.write_all(stdin.as_bytes()).expect("stdin");
    }
    let out = child.wait_with_output().expect("wait");
    assert!(
        out.status.success(),
        "{program} {args:?} in {}: {}\n{stdin}",
        ns.0,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sysctl(ns: &Netns, settings: &[&str]) {
    for s in settings {
        exec(ns, "sysctl", &["-qw", s], "");
    }
}

/// The firewall's ruleset: new flows only from the outside leg, only from a TCP SYN, UDP or
/// an ICMP echo request; the rest of a flow only as established or related.
const FIREWALL_RULES: &str = r#"
table inet fw {
    counter dropped {}
    counter new_flows {}
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "fw-o" ct state new tcp flags & (fin|syn|rst|ack) == syn counter name new_flows accept
        iifname "fw-o" ct state new meta l4proto udp counter name new_flows accept
        iifname "fw-o" ct state new icmp type echo-request counter name new_flows accept
        counter name dropped drop
    }
}
"#;

impl Bed {
    /// Build the sandwich with `balancing` on the balancers; `None` (a skip, or a failure
    /// under FULCRUM_REQUIRE_NETNS=1) where namespaces or nftables cannot be had.
    pub fn build(tag: &str, balancing: Balancing) -> Option<Bed> {
        if !is_root() {
            return skip("needs root for network namespaces");
        }
        if Command::new("nft").arg("--version").output().is_err() {
            return skip("needs nft (nftables) for the firewalls' rulesets");
        }
        let pid = std::process::id();
        let name = |role: &str| format!("fw{tag}{role}-{pid}");
        let mk = |role: &str| -> Result<Netns, String> {
            let n = name(role);
            ip(&["netns", "add", &n])?;
            let ns = Netns(n);
            ip(&["-n", &ns.0, "link", "set", "lo", "up"])?;
            Ok(ns)
        };
        let cli = match mk("c") {
            Ok(n) => n,
            Err(e) => return skip(&format!("cannot create a network namespace: {e}")),
        };
        let lbo = mk("o").unwrap_or_else(|e| panic!("{e}"));
        let lbi = mk("i").unwrap_or_else(|e| panic!("{e}"));
        let srv = mk("s").unwrap_or_else(|e| panic!("{e}"));
        let fws: Vec<Netns> = (1..=FIREWALLS)
            .map(|i| mk(&format!("f{i}")).unwrap_or_else(|e| panic!("{e}")))
            .collect();
        let bed = Bed {
            tag: tag.to_owned(),
            cli,
            lbo,
            lbi,
            srv,
            fws,
        };
        // Before any link exists, so that every link is made with these defaults.
        for ns in [&bed.lbo, &bed.lbi] {
            sysctl(
                ns,
                &[
                    "net.ipv4.conf.all.rp_filter=0",
                    "net.ipv4.conf.default.rp_filter=0",
                    "net.ipv4.conf.all.send_redirects=0",
                    "net.ipv4.conf.default.send_redirects=0",
                    "net.ipv4.ip_forward=1",
                    "net.ipv4.fib_multipath_hash_policy=1",
                ],
            );
        }
        for ns in &bed.fws {
            sysctl(
                ns,
                &[
                    "net.ipv4.ip_forward=1",
                    "net.ipv4.conf.all.send_redirects=0",
                    "net.ipv4.conf.default.send_redirects=0",
                ],
            );
        }
        bed.link(&bed.cli, "cli0", CLIENT, &bed.lbo, "lbo-c", "10.1.0.1");
        bed.link(&bed.srv, "srv0", SERVER, &bed.lbi, "lbi-s", "10.4.0.1");
        ipn(&bed.cli, "route add default via 10.1.0.1");
        ipn(&bed.srv, "route add default via 10.4.0.1");
        for (k, fw) in bed.fws.iter().enumerate() {
            let i = k + 1;
            bed.link(
                &bed.lbo,
                &format!("lbo-f{i}"),
                &format!("10.2.{i}.1"),
                fw,
                "fw-o",
                &format!("10.2.{i}.2"),
            );
            bed.link(
                &bed.lbi,
                &format!("lbi-f{i}"),
                &format!("10.3.{i}.1"),
                fw,
                "fw-i",
                &format!("10.3.{i}.2"),
            );
            ipn(fw, &format!("route add 10.1.0.0/24 via 10.2.{i}.1"));
            ipn(fw, &format!("route add 10.4.0.0/24 via 10.3.{i}.1"));
            exec(fw, "nft", &["-f", "-"], FIREWALL_RULES);
        }
        bed.balance(balancing);
        Some(bed)
    }

    /// A veth pair: `a_if` with `a_addr`/24 in `a`, `b_if` with `b_addr`/24 in `b`, both up.
    fn link(&self, a: &Netns, a_if: &str, a_addr: &str, b: &Netns, b_if: &str, b_addr: &str) {
        ipn(
            a,
            &format!(
                "link add name {a_if} type veth peer name {b_if} netns {}",
                b.0
            ),
        );
        ipn(a, &format!("addr add {a_addr}/24 dev {a_if}"));
        ipn(b, &format!("addr add {b_addr}/24 dev {b_if}"));
        ipn(a, &format!("link set {a_if} up"));
        ipn(b, &format!("link set {b_if} up"));
    }

    /// The balancers' routes and rulesets for `balancing`.
    fn balance(&self, balancing: Balancing) {
        let via = |side: u8| -> String {
            (1..=FIREWALLS)
                .map(|i| format!("nexthop via 10.{side}.{i}.2"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        match balancing {
            Balancing::Ecmp => {
                ipn(&self.lbo, &format!("route add 10.4.0.0/24 {}", via(2)));
                ipn(&self.lbi, &format!("route add 10.1.0.0/24 {}", via(3)));
            }
            _ => {
                // The route a packet takes when no balancer steers it: firewall 1.
                ipn(&self.lbo, "route add 10.4.0.0/24 via 10.2.1.2");
                ipn(&self.lbi, "route add 10.1.0.0/24 via 10.3.1.2");
            }
        }
        let steer = |ns: &Netns, dev: &str, legs: &str, side: u8, by: &str| {
            let rules: String = (1..=FIREWALLS)
                .map(|i| {
                    format!(
                        "        {by} mod {FIREWALLS} {} fwd ip to 10.{side}.{i}.2 device \"{legs}{i}\"\n",
                        i - 1
                    )
                })
                .collect();
            let table = format!(
                "table netdev lb {{\n    chain steer {{\n        type filter hook ingress device \"{dev}\" priority 0;\n        meta protocol != ip accept\n{rules}    }}\n}}\n"
            );
            exec(ns, "nft", &["-f", "-"], &table);
        };
        match balancing {
            Balancing::Symhash => {
                steer(&self.lbo, "lbo-c", "lbo-f", 2, "symhash");
                steer(&self.lbi, "lbi-s", "lbi-f", 3, "symhash");
            }
            Balancing::InsideBySource => {
                steer(&self.lbo, "lbo-c", "lbo-f", 2, "symhash");
                steer(&self.lbi, "lbi-s", "lbi-f", 3, "jhash ip saddr");
            }
            Balancing::Route | Balancing::Ecmp | Balancing::Fulcrum => {}
        }
    }

    /// A named counter of every firewall's ruleset: packets.
    pub fn counters(&self, name: &str) -> Vec<u64> {
        self.fws
            .iter()
            .map(|fw| {
                let out = exec(
                    fw,
                    "nft",
                    &["-j", "list", "counter", "inet", "fw", name],
                    "",
                );
                let v: serde_json::Value = serde_json::from_str(&out).expect("nft -j");
                v["nftables"]
                    .as_array()
                    .and_then(|a| a.iter().find_map(|o| o["counter"]["packets"].as_u64()))
                    .unwrap_or_else(|| panic!("no counter {name} in {out}"))
            })
            .collect()
    }

    /// Start this test binary's helper `helper` in `ns` with role `role` and `env`; its
    /// stdout lines come through the reader (the child ends by itself; [`Helper`] kills it
    /// on drop should it not).
    pub fn helper(ns: &Netns, helper: &str, role: &str, env: &[(&str, String)]) -> Helper {
        let exe = std::env::current_exe().expect("test binary");
        let mut child = Command::new("ip")
            .args(["netns", "exec", &ns.0])
            .arg(exe)
            .args([helper, "--exact", "--nocapture", "--test-threads", "1"])
            .env(super::netns::ROLE, role)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn helper");
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        Helper { child, out }
    }

    /// Run `tcp` concurrent TCP connections, `udp` UDP flows and `pings` echoes from the
    /// client to the server through the sandwich; what came through.
    pub fn traffic(&self, helper_serve: &str, helper_client: &str, load: Load) -> Traffic {
        let mut server = Bed::helper(&self.srv, helper_serve, "fw-serve", &[]);
        server.expect("READY");
        let mut client = Bed::helper(
            &self.cli,
            helper_client,
            "fw-client",
            &[
                ("FWBED_TCP", load.tcp.to_string()),
                ("FWBED_UDP", load.udp.to_string()),
                ("FWBED_PING", load.pings.to_string()),
            ],
        );
        let line = client.expect("TRAFFIC");
        Traffic::parse(&line).unwrap_or_else(|| panic!("bad report: {line}"))
    }
}

/// How much traffic [`Bed::traffic`] offers.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub tcp: usize,
    pub udp: usize,
    pub pings: usize,
}

/// What came through: flows that completed of those tried, per kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Traffic {
    pub tcp_ok: usize,
    pub tcp: usize,
    pub udp_ok: usize,
    pub udp: usize,
    pub ping_ok: usize,
    pub ping: usize,
}

impl Traffic {
    fn line(&self) -> String {
        format!(
            "TRAFFIC tcp {}/{} udp {}/{} ping {}/{}",
            self.tcp_ok, self.tcp, self.udp_ok, self.udp, self.ping_ok, self.ping
        )
    }

    fn parse(line: &str) -> Option<Traffic> {
        let w: Vec<&str> = line.split_whitespace().collect();
        let pair = |i: usize| -> Option<(usize, usize)> {
            let (a, b) = w.get(i)?.split_once('/')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        };
        let ((tcp_ok, tcp), (udp_ok, udp), (ping_ok, ping)) = (pair(2)?, pair(4)?, pair(6)?);
        Some(Traffic {
            tcp_ok,
            tcp,
            udp_ok,
            udp,
            ping_ok,
            ping,
        })
    }

    pub fn all_ok(&self) -> bool {
        self.tcp_ok == self.tcp && self.udp_ok == self.udp && self.ping_ok == self.ping
    }
}

/// A helper process in a namespace.
pub struct Helper {
    child: Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Helper {
    /// The first stdout line starting with `what` (at most 60 s: every helper is bounded
    /// well within that).
    pub fn expect(&mut self, what: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut line = String::new();
        while Instant::now() < deadline {
            line.clear();
            match self.out.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                // The test harness's `test NAME ... ` may precede the first line.
                Ok(_) => {
                    if let Some(at) = line.find(what) {
                        return line[at..].trim().to_owned();
                    }
                }
            }
        }
        panic!("helper ended without a `{what}` line");
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn env_usize(name: &str) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Role `fw-serve`, in the server's namespace: a TCP echo, a UDP echo and a UDP sink (which
/// reports what it received on `SINK` lines), for at most `FWBED_LIFETIME_S` (90 s).
pub fn serve() {
    let life = Duration::from_secs(
        std::env::var("FWBED_LIFETIME_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(90),
    );
    let tcp = TcpListener::bind((SERVER, TCP_PORT)).expect("tcp bind");
    let udp = UdpSocket::bind((SERVER, UDP_PORT)).expect("udp bind");
    let sink = UdpSocket::bind((SERVER, SINK_PORT)).expect("sink bind");
    std::thread::spawn(move || {
        for s in tcp.incoming() {
            let Ok(mut s) = s else { continue };
            std::thread::spawn(move || {
                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 || s.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((n, from)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(&buf[..n], from);
        }
    });
    std::thread::spawn(move || {
        let _ = sink.set_read_timeout(Some(Duration::from_millis(200)));
        let mut buf = [0u8; 2048];
        let (mut n, mut told) = (0u64, 0u64);
        loop {
            match sink.recv_from(&mut buf) {
                Ok(_) => n += 1,
                // A pause in the stream: say how much came.
                Err(_) if n != told => {
                    println!("SINK {n}");
                    told = n;
                }
                Err(_) => {}
            }
        }
    });
    println!("READY");
    std::thread::sleep(life);
}

/// One TCP flow: connect, 20 exchanges of 1,000 bytes echoed, close; every wait bounded.
fn tcp_flow(i: usize) -> bool {
    let to: SocketAddr = format!("{SERVER}:{TCP_PORT}").parse().expect("addr");
    let Ok(mut s) = TcpStream::connect_timeout(&to, Duration::from_secs(3)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(3)));
    let msg: Vec<u8> = (0..1000).map(|k| (i + k) as u8).collect();
    let mut back = vec![0u8; msg.len()];
    (0..20).all(|_| s.write_all(&msg).is_ok() && s.read_exact(&mut back).is_ok() && back == msg)
}

/// One UDP flow (its own source port): 5 requests, each answered within 1 s (three tries:
/// a busy machine may stall one; a flow through the wrong firewall fails every try).
fn udp_flow(i: usize) -> bool {
    let Ok(s) = UdpSocket::bind((CLIENT, 0)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let mut buf = [0u8; 256];
    (0..5).all(|k| {
        let msg = format!("flow {i} request {k}");
        (0..3).any(|_| {
            s.send_to(msg.as_bytes(), (SERVER, UDP_PORT)).is_ok()
                && s.recv_from(&mut buf)
                    .is_ok_and(|(n, _)| &buf[..n] == msg.as_bytes())
        })
    })
}

/// Role `fw-client`, in the client's namespace: the flows of `FWBED_TCP`, `FWBED_UDP` and
/// `FWBED_PING`, all at once, then one `TRAFFIC` line.
pub fn client() {
    let (tcp, udp, pings) = (
        env_usize("FWBED_TCP"),
        env_usize("FWBED_UDP"),
        env_usize("FWBED_PING"),
    );
    let tcp_threads: Vec<_> = (0..tcp)
        .map(|i| std::thread::spawn(move || tcp_flow(i)))
        .collect();
    let udp_threads: Vec<_> = (0..udp)
        .map(|i| std::thread::spawn(move || udp_flow(i)))
        .collect();
    let rt = tokio::runtime::Runtime::new().expect("tokio");
    let server: std::net::IpAddr = SERVER.parse().expect("ip");
    let ping_ok = rt.block_on(async {
        let tasks: Vec<_> = (0..pings)
            .map(|i| {
                tokio::spawn(tokio::time::timeout(
                    Duration::from_secs(2),
                    // A distinct identifier (the nonce's top 16 bits on a raw socket) per
                    // echo: each is a flow of its own to conntrack and the hashes.
                    fulcrum::health::icmp::ping(server, i as u16, ((i as u64 + 1) << 48) | 0x5eed),
                ))
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            if matches!(t.await, Ok(Ok(Ok(_)))) {
                ok += 1;
            }
        }
        ok
    });
    let count = |ts: Vec<std::thread::JoinHandle<bool>>| {
        ts.into_iter()
            .map(|t| t.join().unwrap_or(false))
            .filter(|ok| *ok)
            .count()
    };
    let t = Traffic {
        tcp_ok: count(tcp_threads),
        tcp,
        udp_ok: count(udp_threads),
        udp,
        ping_ok,
        ping: pings,
    };
    println!("{}", t.line());
}

/// Role `fw-blast`, in the client's namespace: UDP datagrams of `FWBED_SIZE` bytes to the
/// sink at `FWBED_RATE` per second over `FWBED_FLOWS` source ports for `FWBED_SECONDS`,
/// paced in 1 ms steps; then `BLAST sent N`.
pub fn blast() {
    let rate = env_usize("FWBED_RATE").max(1);
    let flows = env_usize("FWBED_FLOWS").max(1);
    let size = env_usize("FWBED_SIZE").clamp(1, 1400);
    let seconds = env_usize("FWBED_SECONDS").clamp(1, 60);
    let socks: Vec<UdpSocket> = (0..flows)
        .map(|_| UdpSocket::bind((CLIENT, 0)).expect("bind"))
        .collect();
    for s in &socks {
        s.connect((SERVER, SINK_PORT)).expect("connect");
    }
    let payload = vec![0x42u8; size];
    let start = Instant::now();
    let end = start + Duration::from_secs(seconds as u64);
    let mut sent = 0u64;
    while Instant::now() < end {
        let due = (start.elapsed().as_secs_f64() * rate as f64) as u64;
        while sent < due {
            if socks[(sent as usize) % flows].send(&payload).is_ok() {
                sent += 1;
            } else {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    println!("BLAST sent {sent}");
}
