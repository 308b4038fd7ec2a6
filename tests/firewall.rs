//! A pool of strict stateful firewalls between two balancers (docs/firewall.md), in network
//! namespaces (tests/common/fwbed.rs). The bed is checked against nftables on the
//! balancers before fulcrum steers it: `symhash` + `fwd` on both sides carries every TCP,
//! UDP and ping flow with no firewall dropping a packet (the positive control); hashing the
//! inside by source only, or ECMP routes that hash each direction on its own, cuts flows and
//! raises the firewalls' drop counters (the negative controls: the test can fail). Then
//! fulcrum `protocol: ip` vservers on both balancers: 300 concurrent TCP connections, UDP
//! flows and pings with no drop; the outside instance killed and started again under
//! load; a firewall going DOWN and coming back.
//!
//! Needs root and nftables (FULCRUM_REQUIRE_NETNS=1 makes their absence a failure) and BPF
//! (FULCRUM_REQUIRE_BPF=1 makes a refused packet vserver a failure).

mod common;

use common::fwbed::{self, Balancing, Bed, FIREWALLS, Load};
use common::netns::ROLE;
use std::time::Duration;

const LOAD: Load = Load {
    tcp: 24,
    udp: 24,
    pings: 12,
    addrs: 0,
    pause_ms: 0,
};

#[test]
fn helper_serve() {
    if std::env::var(ROLE).as_deref() == Ok("fw-serve") {
        fwbed::serve();
    }
}

#[test]
fn helper_client() {
    if std::env::var(ROLE).as_deref() == Ok("fw-client") {
        fwbed::client();
    }
}

#[test]
fn helper_blast() {
    if std::env::var(ROLE).as_deref() == Ok("fw-blast") {
        fwbed::blast();
    }
}

/// The bed with `balancing`, the load through it; (what came through, drops per firewall,
/// new flows per firewall). `None`: skipped.
fn run(tag: &str, balancing: Balancing) -> Option<(fwbed::Traffic, Vec<u64>, Vec<u64>)> {
    let bed = Bed::build(tag, balancing)?;
    let t = bed.traffic("helper_serve", "helper_client", LOAD);
    let drops = bed.counters("dropped");
    let new = bed.counters("new_flows");
    println!("{balancing:?}: {t:?} drops {drops:?} new flows {new:?}");
    Some((t, drops, new))
}

/// Positive control: nftables `symhash mod 3` + `fwd` on both balancers. Every flow
/// completes, no firewall drops a packet, and every firewall carries some of the flows.
#[test]
fn symhash_on_both_sides_carries_every_flow() {
    let Some((t, drops, new)) = run("y", Balancing::Symhash) else {
        return;
    };
    assert!(t.all_ok(), "{t:?}");
    assert_eq!(drops, vec![0; FIREWALLS], "{t:?}");
    assert!(
        new.iter().all(|n| *n > 0),
        "one firewall got no flow: {new:?}"
    );
    // No flow began twice (at a second firewall). Not "exactly one per flow": once in CI a
    // run that carried every flow with no drop counted 59 new flows for 60, a flow whose
    // start the counter did not see as new (cause not found), which is not what this
    // control is about.
    assert!(
        new.iter().sum::<u64>() <= (LOAD.tcp + LOAD.udp + LOAD.pings) as u64,
        "a flow began twice: {new:?}"
    );
}

/// Negative control: the inside balancer hashes the source address only, so the server's
/// replies all take one firewall: the flows that went out through another are cut there.
#[test]
fn hashing_the_inside_by_source_cuts_flows() {
    let Some((t, drops, _)) = run("n", Balancing::InsideBySource) else {
        return;
    };
    assert!(!t.all_ok(), "every flow came through: {t:?}");
    assert!(t.tcp_ok < t.tcp && t.udp_ok < t.udp, "{t:?}");
    assert!(drops.iter().sum::<u64>() > 0, "{drops:?}");
}

/// Negative control: ECMP routes on each side choose each direction's next hop on its own.
/// In one kernel the L4 route hash of UDP and ICMP came out symmetric in this bed (one
/// seed for both balancers, addresses and ports ordered before hashing), but a TCP packet
/// carries its socket's own flow hash, which the route hash takes as it is: a TCP flow's two
/// directions take unrelated firewalls, and the firewalls drop what they see without its
/// start. A retransmitted SYN gets a new hash, so some connections get through on a later
/// try; the drops are the steady signal.
#[test]
fn ecmp_on_each_side_drops_tcp_flows() {
    let Some((t, drops, _)) = run("e", Balancing::Ecmp) else {
        return;
    };
    assert!(
        drops.iter().sum::<u64>() > 0,
        "no firewall dropped a packet: {t:?}"
    );
}

/// The outside or inside balancer's fulcrum config: one `protocol: ip` vserver `name`
/// taking the packets of `from`, a service per firewall leg. Each bed names its vservers
/// apart: the program's pins are named by vserver and interface, and beds run at once.
fn fulcrum_config(side: &str, name: &str, from: &str, net: u8) -> String {
    fulcrum_config_of(side, name, from, net, &(1..=FIREWALLS).collect::<Vec<_>>())
}

/// [`fulcrum_config`] with firewalls `fws` only.
fn fulcrum_config_of(side: &str, name: &str, from: &str, net: u8, fws: &[usize]) -> String {
    let mut y = String::from(
        "admin: { listen: \"127.0.0.1:9090\" }\nmonitors:\n  - { name: fw-ping, type: icmp, interval: 500ms, timeout: 300ms, failures_to_down: 2, successes_to_up: 2 }\nservices:\n",
    );
    for &i in fws {
        y += &format!(
            "  - {{ name: fw{i}-{side}, protocol: ip, address: 10.{net}.{i}.2, interface: lb{side}-f{i}, hash_id: fw{i}, monitor: fw-ping }}\n"
        );
    }
    let names: Vec<String> = fws.iter().map(|i| format!("fw{i}-{side}")).collect();
    y += &format!(
        "vservers:\n  - {{ name: {name}, protocol: ip, interface: [{from}], method: source_dest_ip_hash, services: [{}] }}\n",
        names.join(", ")
    );
    y
}

/// fulcrum on both balancers of a bed: the two processes and their log lines.
struct Pair {
    dir: std::path::PathBuf,
    /// Outside, then inside: the process and its stderr lines.
    running: Vec<(Killed, std::sync::mpsc::Receiver<String>)>,
    namespaces: [String; 2],
    /// The vservers' names, outside then inside.
    names: [String; 2],
}

impl Pair {
    /// Start fulcrum in both balancers; `None` (after saying why) when the kernel refuses
    /// the packet vserver and FULCRUM_REQUIRE_BPF is not set.
    fn start(bed: &Bed, tag: &str) -> Option<Pair> {
        let dir = std::env::temp_dir().join(format!("fulcrum-fwbed-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let mut pair = Pair {
            dir,
            running: Vec::new(),
            namespaces: [bed.lbo.0.clone(), bed.lbi.0.clone()],
            names: [format!("outside-{tag}"), format!("inside-{tag}")],
        };
        for (k, side, from, net) in [(0, "o", "lbo-c", 2u8), (1, "i", "lbi-s", 3)] {
            std::fs::write(
                pair.dir.join(format!("{side}.yaml")),
                fulcrum_config(side, &pair.names[k], from, net),
            )
            .expect("write");
        }
        for k in 0..2 {
            let p = pair.spawn(k);
            pair.running.push(p);
        }
        for k in 0..2 {
            if let Err(line) = pair.wait_log(k, "packet vserver attached", Duration::from_secs(10))
            {
                assert!(
                    std::env::var("FULCRUM_REQUIRE_BPF").as_deref() != Ok("1"),
                    "the packet vserver did not start, and FULCRUM_REQUIRE_BPF=1: {line}"
                );
                println!(
                    "NOT RUN: the packet vserver did not start: {line} (FULCRUM_REQUIRE_BPF=1 makes this a failure)"
                );
                return None;
            }
        }
        Some(pair)
    }

    fn spawn(&self, k: usize) -> (Killed, std::sync::mpsc::Receiver<String>) {
        let side = ["o", "i"][k];
        // `nsenter --net`, not `ip netns exec`: the latter gives the process a mount
        // namespace of its own, and so a bpffs of its own whose pins die with it; a
        // restarted instance must find its predecessor's pinned links, as under systemd.
        let mut child = std::process::Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", self.namespaces[k]))
            .args([env!("CARGO_BIN_EXE_fulcrum"), "run", "--config"])
            .arg(self.dir.join(format!("{side}.yaml")))
            .env("RUST_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("fulcrum");
        let lines = lines_of(child.stderr.take().expect("stderr"));
        (Killed(child), lines)
    }

    /// Wait for a log line of instance `k` containing `what`; the line, or what was seen
    /// instead (the refusal, or nothing).
    fn wait_log(&self, k: usize, what: &str, within: Duration) -> Result<String, String> {
        let deadline = std::time::Instant::now() + within;
        let mut last = String::from("no such line");
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            match self.running[k].1.recv_timeout(left) {
                Ok(l) if l.contains(what) => return Ok(l),
                Ok(l) if l.contains("not started") || l.contains("ERROR") => last = l,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        Err(last)
    }

    /// Give both instances a config with firewalls `fws` only and reload them (SIGHUP);
    /// returns once both have rebuilt their vserver.
    fn reload_with(&self, fws: &[usize]) {
        for (k, side, from, net) in [(0, "o", "lbo-c", 2u8), (1, "i", "lbi-s", 3)] {
            std::fs::write(
                self.dir.join(format!("{side}.yaml")),
                fulcrum_config_of(side, &self.names[k], from, net, fws),
            )
            .expect("write");
            let pid = self.running[k].0.0.id().to_string();
            let ok = std::process::Command::new("kill")
                .args(["-HUP", &pid])
                .status()
                .expect("kill");
            assert!(ok.success());
        }
        for k in 0..2 {
            self.wait_log(k, "vserver rebuilt", Duration::from_secs(10))
                .expect("reloaded");
        }
    }

    /// `GET /vservers/NAME/flow/TAIL` on instance `k`'s admin API (inside its namespace).
    fn flow(&self, k: usize, tail: &str) -> serde_json::Value {
        let url = format!(
            "http://127.0.0.1:9090/vservers/{}/flow/{tail}",
            self.names[k]
        );
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.namespaces[k],
                "curl",
                "-sS",
                "--max-time",
                "5",
                &url,
            ])
            .output()
            .expect("curl");
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{url}: {e}: {}", String::from_utf8_lossy(&out.stdout)))
    }

    /// Kill instance `k` (SIGKILL: no goodbye) and start it again.
    fn kill_and_restart(&mut self, k: usize, gap: Duration) {
        let _ = self.running[k].0.0.kill();
        let _ = self.running[k].0.0.wait();
        std::thread::sleep(gap);
        let p = self.spawn(k);
        self.running[k] = p;
        self.wait_log(k, "packet vserver attached", Duration::from_secs(10))
            .expect("restarted");
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.running.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
        // The pinned links outlive the processes by design: unpin them.
        for n in &self.names {
            let _ = std::fs::remove_dir_all(std::path::Path::new("/sys/fs/bpf/fulcrum").join(n));
        }
    }
}

/// Firewall `fw` stops (`true`: every packet arriving at it dropped before it is routed or
/// answered, as a hung box; its routes and connection state stay) or runs again.
fn hang(fw: &common::netns::Netns, hung: bool) {
    let script = if hung {
        "table inet dead {\n  chain in {\n    type filter hook prerouting priority -300; policy drop;\n  }\n}\n"
    } else {
        "delete table inet dead\n"
    };
    let mut c = std::process::Command::new("ip")
        .args(["netns", "exec", &fw.0, "nft", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("nft");
    use std::io::Write;
    c.stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("script");
    assert!(c.wait().expect("nft").success(), "nft {script}");
}

/// fulcrum on both balancers, hashing by source and destination address (symmetric): 300
/// concurrent TCP connections from 32 client addresses, UDP flows and pings all complete,
/// no firewall drops a packet and every firewall carries some flows.
#[test]
fn fulcrum_on_both_sides_carries_every_flow() {
    let Some(bed) = Bed::build("f", Balancing::Fulcrum) else {
        return;
    };
    let Some(pair) = Pair::start(&bed, "f") else {
        return;
    };
    let load = Load {
        tcp: 300,
        udp: 60,
        pings: 12,
        addrs: fwbed::CLIENT_ALIASES,
        pause_ms: 0,
    };
    let t = bed.traffic("helper_serve", "helper_client", load);
    let drops = bed.counters("dropped");
    let new = bed.counters("new_flows");
    println!("fulcrum: {t:?} drops {drops:?} new flows {new:?}");
    assert!(t.all_ok(), "{t:?}");
    assert_eq!(drops, vec![0; FIREWALLS]);
    assert!(
        new.iter().all(|n| *n > 0),
        "one firewall got no flow: {new:?}"
    );
    // Each instance's admin API says where a flow goes by its live table: the outside one
    // for the client's packets, the inside one for the server's replies, the same firewall.
    let mut seen = std::collections::BTreeSet::new();
    for k in 0..16 {
        let client = format!("10.1.0.{}", 100 + k);
        let port = 40000 + k;
        let out = pair.flow(0, &format!("tcp/{client}/{}/{port}/7000", fwbed::SERVER));
        let back = pair.flow(1, &format!("tcp/{}/{client}/7000/{port}", fwbed::SERVER));
        let fw = |v: &serde_json::Value, at: &str| {
            v[at]["firewall"]
                .as_str()
                .and_then(|f| f.split('-').next())
                .map(str::to_owned)
        };
        assert_eq!(fw(&out, "forward"), fw(&back, "forward"), "{out} {back}");
        assert_eq!(fw(&out, "forward"), fw(&out, "reply"), "{out}");
        seen.insert(fw(&out, "forward").expect("a firewall"));
    }
    assert!(seen.len() > 1, "{seen:?}");
}

/// The outside instance killed (SIGKILL) while 60 TCP connections and 30 UDP flows exchange
/// data, and started again a second later: its program stays attached meanwhile and the
/// new instance puts its own in place with the same table, so every flow completes and no
/// firewall drops a packet (a flow sent through another firewall would be dropped there).
#[test]
fn the_outside_instance_killed_and_restarted_loses_no_flow() {
    let Some(bed) = Bed::build("k", Balancing::Fulcrum) else {
        return;
    };
    let Some(mut pair) = Pair::start(&bed, "k") else {
        return;
    };
    let load = Load {
        tcp: 60,
        udp: 30,
        pings: 0,
        addrs: fwbed::CLIENT_ALIASES,
        pause_ms: 250,
    };
    let mut running = bed.start_traffic("helper_serve", "helper_client", load);
    let connected = running.connected();
    assert_eq!(connected, "CONNECTED 60/60");
    pair.kill_and_restart(0, Duration::from_secs(1));
    let t = running.finish();
    let drops = bed.counters("dropped");
    println!("kill and restart: {t:?} drops {drops:?}");
    assert!(t.all_ok(), "{t:?}");
    assert_eq!(drops, vec![0; FIREWALLS]);
}

/// A reload takes firewall 3 out of both vservers: new flows avoid it and every flow
/// completes with no drop; a second reload brings it back and it takes new flows again.
#[test]
fn a_reload_takes_a_firewall_out_and_brings_it_back() {
    let Some(bed) = Bed::build("r", Balancing::Fulcrum) else {
        return;
    };
    let Some(pair) = Pair::start(&bed, "r") else {
        return;
    };
    let load = Load {
        tcp: 60,
        udp: 30,
        pings: 0,
        addrs: fwbed::CLIENT_ALIASES,
        pause_ms: 0,
    };
    pair.reload_with(&[1, 2]);
    let t = bed.traffic("helper_serve", "helper_client", load);
    let new = bed.counters("new_flows");
    println!("firewall 3 reloaded out: {t:?} new flows {new:?}");
    assert!(t.all_ok(), "{t:?}");
    assert_eq!(new[2], 0, "a flow went to the firewall reloaded out");
    assert_eq!(bed.counters("dropped"), vec![0; FIREWALLS]);
    pair.reload_with(&[1, 2, 3]);
    let t = bed.traffic("helper_serve", "helper_client", load);
    let after = bed.counters("new_flows");
    println!("firewall 3 reloaded in: {t:?} new flows {after:?}");
    assert!(t.all_ok(), "{t:?}");
    assert!(after[2] > 0, "firewall 3 took no flow back: {after:?}");
    assert_eq!(bed.counters("dropped"), vec![0; FIREWALLS]);
}

/// Firewall 2 hangs (drops everything it receives) under load: both balancers' monitors take it
/// DOWN and move its buckets, so exactly the TCP connections that had started through it
/// break (their packets reach a firewall without their state) and the rest complete. New
/// flows then avoid it. Back UP, it takes its share of new flows again.
#[test]
fn a_dead_firewall_loses_only_its_own_flows_and_new_ones_avoid_it() {
    let Some(bed) = Bed::build("d", Balancing::Fulcrum) else {
        return;
    };
    let Some(pair) = Pair::start(&bed, "d") else {
        return;
    };
    let tcp_only = Load {
        tcp: 60,
        udp: 0,
        pings: 0,
        addrs: fwbed::CLIENT_ALIASES,
        pause_ms: 250,
    };
    let mut running = bed.start_traffic("helper_serve", "helper_client", tcp_only);
    assert_eq!(running.connected(), "CONNECTED 60/60");
    let on_fw2 = bed.counters("new_flows")[1];
    assert!(on_fw2 > 0, "no connection through firewall 2");
    let fw2 = &bed.fws[1];
    hang(fw2, true);
    for k in 0..2 {
        pair.wait_log(k, "firewall set changed", Duration::from_secs(10))
            .expect("the monitors take firewall 2 down");
    }
    let t = running.finish();
    println!("firewall 2 down under load: {t:?}, {on_fw2} connections had started through it");
    assert_eq!(t.tcp - t.tcp_ok, on_fw2 as usize, "{t:?}");

    let quick = Load {
        pause_ms: 0,
        udp: 30,
        ..tcp_only
    };
    let t = bed.traffic("helper_serve", "helper_client", quick);
    let new = bed.counters("new_flows");
    println!("firewall 2 down, new flows: {t:?} new flows {new:?}");
    assert!(t.all_ok(), "{t:?}");
    assert_eq!(new[1], on_fw2, "a new flow went to the dead firewall");

    hang(fw2, false);
    for k in 0..2 {
        pair.wait_log(k, "firewall set changed", Duration::from_secs(15))
            .expect("the monitors bring firewall 2 back");
    }
    let t = bed.traffic("helper_serve", "helper_client", quick);
    let after = bed.counters("new_flows");
    println!("firewall 2 back: {t:?} new flows {after:?}");
    assert!(t.all_ok(), "{t:?}");
    assert!(
        after[1] > new[1],
        "firewall 2 took no new flow back: {after:?}"
    );
}

/// A child process killed and reaped when dropped (it is ours: started above).
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn lines_of(r: impl std::io::Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// A packet vserver the kernel cannot start (here: its firewall leg's interface does not
/// exist in this namespace) is refused with a message that names it and says why; the
/// vservers beside it start and carry traffic.
#[test]
fn a_packet_vserver_is_refused_and_the_others_start() {
    let (svc, _) = common::udp_service("u", "127.0.0.1");
    let yaml = format!(
        "admin: {{ listen: null }}\nservices:\n  - {{ name: fw1, protocol: ip, address: 10.2.1.2, interface: lbo-f1 }}\n  - {{ name: u, protocol: udp, address: \"{svc}\" }}\nvservers:\n  - {{ name: outside, protocol: ip, interface: [lbo-c], services: [fw1] }}\n  - {{ name: plain, protocol: udp, bind: 127.0.0.1:0, services: [u] }}\n"
    );
    let config = fulcrum::config::from_str("t.yaml", &yaml).expect("valid");
    let rt = fulcrum::proxy::Runtime::start(&config).expect("the others start");
    let refused = rt.refused();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].0, "outside");
    assert!(
        refused[0].1.contains("vserver `outside`") && refused[0].1.contains("no interface lbo-f1"),
        "{refused:?}"
    );
    assert!(rt.vserver("outside").is_none());
    let bound = common::bound(&rt, "plain");
    let c = common::udp_client("127.0.0.1");
    let answer = common::udp_ask(&c, bound, b"hello");
    assert!(answer.is_some(), "the udp vserver beside it answers");
}

/// `/status` lists a refused packet vserver with its reason; a reload that changes its
/// members leaves it refused and applies the rest: the vserver beside it is rebuilt with its
/// new member.
#[test]
fn a_reload_leaves_a_refused_packet_vserver_refused() {
    let (a, _) = common::udp_service("a", "127.0.0.1");
    let (b, _) = common::udp_service("b", "127.0.0.1");
    let yaml = |fws: &str, members: &str| {
        format!(
            "admin: {{ listen: null }}\nservices:\n  - {{ name: fw1, protocol: ip, address: 10.2.1.2, interface: lbo-f1, hash_id: fw1 }}\n  - {{ name: fw2, protocol: ip, address: 10.2.2.2, interface: lbo-f2, hash_id: fw2 }}\n  - {{ name: a, protocol: udp, address: \"{a}\" }}\n  - {{ name: b, protocol: udp, address: \"{b}\" }}\nvservers:\n  - {{ name: outside, protocol: ip, interface: [lbo-c], services: [{fws}] }}\n  - {{ name: plain, protocol: udp, bind: 127.0.0.1:0, services: [{members}] }}\n"
        )
    };
    let file = common::ConfigFile::new("fw-reload", &yaml("fw1", "a"));
    let config = fulcrum::config::load(&file.path).expect("valid");
    let ops = fulcrum::ops::Ops::start(config, Some(file.path.clone())).expect("start");
    let status = fulcrum::admin::router::status(&ops);
    assert_eq!(status["not_started"][0]["name"], "outside", "{status}");
    assert!(
        status["not_started"][0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("no interface lbo-f1")),
        "{status}"
    );
    file.write(&yaml("fw1, fw2", "a, b"));
    let r = ops.reload();
    assert!(r.is_ok(), "{r:?}");
    let members = ops
        .with_vservers(|v, _| {
            assert!(v.iter().all(|h| h.name != "outside"));
            v.iter()
                .find(|h| h.name == "plain")
                .map(|h| h.balancer().members().len())
        })
        .flatten();
    assert_eq!(members, Some(2), "the udp vserver got its new member");
}

/// The forwarding cost through the sandwich (bench/firewall.sh): a fixed UDP rate from the
/// client to the server's sink, the machine's CPU per forwarded packet from /proc/stat,
/// for plain routing and for nftables `symhash` + `fwd`, in alternating rounds. Two figures
/// per row, each less the background measured over 2 s just before: all busy time (on a
/// machine shared with builders, mostly theirs), and softirq time alone, where the kernel
/// forwards a packet that crosses veth links (receive processing, routing, the nftables
/// hooks, `fwd`) and which the machine's other users hardly add to. Run with `--ignored`.
#[test]
#[ignore = "a measurement, run by bench/firewall.sh"]
fn bench_forwarding() {
    let rate: usize = env_or("FWBENCH_RATE", 20_000);
    let seconds: usize = env_or("FWBENCH_SECONDS", 5);
    let rounds: usize = env_or("FWBENCH_ROUNDS", 2);
    let modes: Vec<Balancing> = std::env::var("FWBENCH_MODES")
        .unwrap_or_else(|_| "route,symhash".into())
        .split(',')
        .filter_map(|m| match m.trim() {
            "route" => Some(Balancing::Route),
            "symhash" => Some(Balancing::Symhash),
            // fulcrum's two instances as in `fulcrum_on_both_sides_carries_every_flow`,
            // started before the blast.
            "fulcrum" => Some(Balancing::Fulcrum),
            _ => None,
        })
        .collect();
    println!("BENCH rate {rate}/s for {seconds} s, 64 flows, 64-byte payloads, {rounds} rounds");
    for round in 1..=rounds {
        for &mode in &modes {
            let Some(bed) = Bed::build("b", mode) else {
                return;
            };
            let _pair = match mode {
                Balancing::Fulcrum => match Pair::start(&bed, "b") {
                    Some(p) => Some(p),
                    None => return,
                },
                _ => None,
            };
            let mut server = Bed::helper(&bed.srv, "helper_serve", "fw-serve", &[]);
            server.expect("READY");
            let quiet = Duration::from_secs(2);
            let (q0, q1) = (cpu_times(), {
                std::thread::sleep(quiet);
                cpu_times()
            });
            let before = cpu_times();
            let mut blaster = Bed::helper(
                &bed.cli,
                "helper_blast",
                "fw-blast",
                &[
                    ("FWBED_RATE", rate.to_string()),
                    ("FWBED_FLOWS", "64".into()),
                    ("FWBED_SIZE", "64".into()),
                    ("FWBED_SECONDS", seconds.to_string()),
                ],
            );
            let sent = last_number(&blaster.expect("BLAST"));
            let after = cpu_times();
            let got = last_number(&server.expect("SINK"));
            let drops = bed.counters("dropped");
            let wall = after.wall.saturating_sub(before.wall);
            let scale = |q: u64| {
                let r = u128::from(q) * u128::from(wall)
                    / u128::from(q1.wall.saturating_sub(q0.wall).max(1));
                u64::try_from(r).unwrap_or(u64::MAX)
            };
            let bg_busy = scale(q1.busy.saturating_sub(q0.busy));
            let bg_softirq = scale(q1.softirq.saturating_sub(q0.softirq));
            let busy = after.busy.saturating_sub(before.busy);
            let softirq = after.softirq.saturating_sub(before.softirq);
            let per = |v: u64, bg: u64| v.saturating_sub(bg) as f64 / got.max(1) as f64;
            println!(
                "BENCH round {round} {mode:?}: sent {sent} received {got} ({:.1}%) in {:.2} s; busy {:.2} s (background {:.2} s) = {:.0} ns/pkt; softirq {:.3} s (background {:.3} s) = {:.0} ns/pkt; firewalls dropped {drops:?}",
                100.0 * got as f64 / sent.max(1) as f64,
                wall as f64 / 1e9,
                busy as f64 / 1e9,
                bg_busy as f64 / 1e9,
                per(busy, bg_busy),
                softirq as f64 / 1e9,
                bg_softirq as f64 / 1e9,
                per(softirq, bg_softirq),
            );
        }
    }
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn last_number(line: &str) -> u64 {
    line.split_whitespace()
        .last()
        .and_then(|w| w.parse().ok())
        .unwrap_or(0)
}

/// The whole machine's CPU time so far, in nanoseconds, from /proc/stat (USER_HZ = 100).
struct CpuTimes {
    /// Everything but idle and iowait.
    busy: u64,
    /// softirq: where the kernel forwards packets.
    softirq: u64,
    /// Wall clock, for scaling the background.
    wall: u64,
}

fn cpu_times() -> CpuTimes {
    let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
    // cpu user nice system idle iowait irq softirq steal ...
    let f: Vec<u64> = stat
        .lines()
        .next()
        .map(|l| {
            l.split_whitespace()
                .skip(1)
                .filter_map(|w| w.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    let tick = 10_000_000;
    let wall = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    )
    .unwrap_or(0);
    CpuTimes {
        busy: (at(0) + at(1) + at(2) + at(5) + at(6) + at(7)) * tick,
        softirq: at(6) * tick,
        wall,
    }
}
