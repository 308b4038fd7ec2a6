//! The packet program on real interfaces, in network namespaces the test builds:
//!
//! ```text
//!  cl ── lb ──┬── fw1 ──┬── srv (10.2.0.1)
//!             └── fw2 ──┘
//! ```
//!
//! `lb` does not forward by itself (ip_forward=0): only the program carries a datagram on.
//! Its "outside" program (on the client's link) sends the client's datagrams to the firewall
//! the bucket table names; its "inside" program (on the firewalls' links) sends the replies
//! to the client. Checked: a UDP echo through fw1 (IPv4 and IPv6), then fw2 after a new
//! table (IPv4; fw2 has no IPv6 next hop, so IPv6 for it is dropped and counted), nothing when
//! the table names no firewall (dropped, counted), a restart that puts a new program into
//! the pinned link, nothing after detach; the same with the cls_bpf fallback; then `PacketVserver` as the runtime drives it: a
//! firewall marked DOWN gets nothing, the other everything, none UP drops. Needs root and `ip`; skipped with a message
//! otherwise, a failure when FULCRUM_REQUIRE_NETNS=1.

mod common;

use common::netns::{Netns, ROLE, ip, is_root};
use fulcrum::bpf::{Firewall, PacketPath, PacketVserver, host_addresses};
use fulcrum::config::LbParams;
use fulcrum::packet::{BUCKETS, Masks, PacketMethod, PathConfig};
use std::net::{IpAddr, Ipv4Addr, UdpSocket};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SERVER: &str = "10.2.0.1:7007";
const SERVER6: &str = "[fd02::1]:7007";

/// Server role: echo datagrams on both addresses, for at most a minute.
#[test]
fn helper_packet_server() {
    if std::env::var(ROLE).as_deref() != Ok("packet-server") {
        return;
    }
    let sockets: Vec<UdpSocket> = [SERVER, SERVER6]
        .iter()
        .map(|a| {
            let s = UdpSocket::bind(a).expect("bind");
            s.set_read_timeout(Some(Duration::from_millis(50)))
                .expect("timeout");
            s
        })
        .collect();
    let end = Instant::now() + Duration::from_secs(60);
    let mut buf = [0u8; 1500];
    while Instant::now() < end {
        for s in &sockets {
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                let _ = s.send_to(&buf[..n], from);
            }
        }
    }
}

/// Client role: send until echoed (FULCRUM_PACKET_WAIT_MS, 4 s by default: the first
/// datagrams wait for neighbour discovery at three hops), say whether it was.
#[test]
fn helper_packet_client() {
    if std::env::var(ROLE).as_deref() != Ok("packet-client") {
        return;
    }
    let to = std::env::var("FULCRUM_PACKET_TO").unwrap_or_else(|_| SERVER.to_string());
    let s = UdpSocket::bind(if to.starts_with('[') {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    })
    .expect("bind");
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .expect("timeout");
    let wait_ms = std::env::var("FULCRUM_PACKET_WAIT_MS")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(4000);
    let end = Instant::now() + Duration::from_millis(wait_ms);
    let mut buf = [0u8; 64];
    while Instant::now() < end {
        let _ = s.send_to(b"through a firewall", to.as_str());
        if let Ok((n, _)) = s.recv_from(&mut buf)
            && &buf[..n] == b"through a firewall"
        {
            println!("ANSWER ok");
            return;
        }
    }
    println!("ANSWER none");
}

fn in_ns(ns: &str, role: &str, helper: &str) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns])
        .arg(std::env::current_exe().expect("test binary"))
        .args([helper, "--exact", "--nocapture"])
        .env(ROLE, role)
        .stdin(Stdio::null());
    c
}

/// Whether the client's datagram to the server's IPv4 address came back.
fn echoed() -> bool {
    echoed_to(SERVER, 4000)
}

/// Whether no datagram to `to` comes back within a second (the neighbours are known by
/// then: an echo would take milliseconds).
fn not_echoed(to: &str) -> bool {
    !echoed_to(to, 1000)
}

/// Whether the client's datagram to `to` came back within `wait_ms`.
fn echoed_to(to: &str, wait_ms: u32) -> bool {
    let cl = std::env::var("FULCRUM_PACKET_CL").expect("client namespace");
    let out = in_ns(&cl, "packet-client", "helper_packet_client")
        .env("FULCRUM_PACKET_TO", to)
        .env("FULCRUM_PACKET_WAIT_MS", wait_ms.to_string())
        .output()
        .expect("run the client");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ANSWER"), "the client did not run: {text}");
    text.contains("ANSWER ok")
}

fn index(name: &str) -> u32 {
    nix::net::if_::if_nametoindex(name).expect("interface")
}

fn v4(a: &str) -> IpAddr {
    IpAddr::V4(a.parse::<Ipv4Addr>().expect("ipv4"))
}

fn v6(a: &str) -> IpAddr {
    IpAddr::V6(a.parse::<std::net::Ipv6Addr>().expect("ipv6"))
}

fn all(slot: u32) -> Vec<u32> {
    vec![slot; BUCKETS]
}

/// Load balancer role: everything the module doc lists, from inside `lb`.
#[test]
fn helper_packet_lb() {
    if std::env::var(ROLE).as_deref() != Ok("packet-lb") {
        return;
    }
    let config = PathConfig {
        method: PacketMethod::SourceDestIp,
        masks: Masks::full(),
    };
    let locals = host_addresses().expect("addresses");
    let outside_path = |table: &[u32]| {
        let mut p = PacketPath::load("outside", &config).expect("load outside");
        p.set_leg(1, index("lbo-f1"), &[v4("10.3.1.1"), v6("fd03:1::1")])
            .expect("leg 1");
        p.set_leg(2, index("lbo-f2"), &[v4("10.3.2.1")])
            .expect("leg 2");
        p.set_local_addresses(&locals).expect("locals");
        p.install_table(table).expect("table");
        p.attach("lbo-c").expect("attach outside");
        p
    };
    let mut inside = PacketPath::load("inside", &config).expect("load inside");
    inside
        .set_leg(1, index("lbo-c"), &[v4("10.1.0.1"), v6("fd01::1")])
        .expect("client leg");
    inside.set_local_addresses(&locals).expect("locals");
    inside.install_table(&all(1)).expect("table");
    inside.attach("lbo-f1").expect("attach inside");
    inside.attach("lbo-f2").expect("attach inside");

    let mut outside = outside_path(&all(1));
    assert!(echoed(), "through fw1");
    let c = outside.counters().expect("counters");
    assert!(c.forwarded[0].packets >= 1, "{c:?}");
    assert_eq!(c.forwarded[1].packets, 0, "{c:?}");
    let ok6 = echoed_to(SERVER6, 4000);
    if !ok6 {
        // What neighbour discovery got to, for the failure's reader.
        for args in [
            vec!["-6", "neigh"],
            vec!["-s", "link"],
            vec![
                "-n",
                &std::env::var("FULCRUM_PACKET_FW1").unwrap_or_default(),
                "-6",
                "neigh",
            ],
            vec![
                "-n",
                &std::env::var("FULCRUM_PACKET_FW1").unwrap_or_default(),
                "-s",
                "link",
            ],
            vec![
                "-n",
                &std::env::var("FULCRUM_PACKET_FW1").unwrap_or_default(),
                "-6",
                "addr",
            ],
        ] {
            let o = Command::new("ip").args(&args).output().expect("ip");
            eprintln!("DEBUG ip {args:?}\n{}", String::from_utf8_lossy(&o.stdout));
        }
    }
    assert!(
        ok6,
        "IPv6 through fw1: outside {:?} inside {:?}",
        outside.counters().expect("counters"),
        inside.counters().expect("counters")
    );
    let c6 = outside.counters().expect("counters");
    assert!(c6.forwarded[0].packets > c.forwarded[0].packets, "{c6:?}");

    outside.install_table(&all(2)).expect("table");
    assert!(echoed(), "through fw2");
    let c = outside.counters().expect("counters");
    assert!(c.forwarded[1].packets >= 1, "{c:?}");
    // fw2 is known by its IPv4 address only: IPv6 for it is dropped and counted.
    assert!(not_echoed(SERVER6), "no IPv6 next hop for fw2");
    assert!(
        outside
            .counters()
            .expect("counters")
            .dropped_no_next_hop
            .packets
            >= 1
    );

    outside.install_table(&all(0)).expect("table");
    assert!(not_echoed(SERVER), "a table with no firewall drops");
    assert!(
        outside
            .counters()
            .expect("counters")
            .dropped_no_firewall
            .packets
            >= 1
    );

    // A restart: the old program's process state is gone, its pinned link stays; the new
    // program goes into that link with its table already in place.
    drop(outside);
    let mut outside = outside_path(&all(1));
    assert!(echoed(), "after the restart");
    assert!(
        outside.counters().expect("counters").forwarded[0].packets >= 1,
        "the new program carried it"
    );
    assert!(outside.pin_dir().join("lbo-c").exists());

    outside.detach_all().expect("detach");
    assert!(!outside.pin_dir().exists());
    assert!(not_echoed(SERVER), "nothing forwards without the program");
    drop(outside);

    // The cls_bpf fallback (kernels without tcx): a filter on clsact, replaced in place by
    // a restart, removed by detach.
    for round in 0..2 {
        let mut p = PacketPath::load("outside", &config).expect("load");
        p.set_leg(1, index("lbo-f1"), &[v4("10.3.1.1")])
            .expect("leg");
        p.set_local_addresses(&locals).expect("locals");
        p.install_table(&all(1)).expect("table");
        p.attach_cls_bpf("lbo-c").expect("cls_bpf");
        assert!(echoed(), "cls_bpf, round {round}");
        assert!(
            p.counters().expect("counters").forwarded[0].packets >= 1,
            "round {round}: this program carried it"
        );
        if round == 1 {
            p.detach("lbo-c").expect("detach");
            assert!(not_echoed(SERVER), "cls_bpf filter removed");
        }
    }

    // The runtime's shell: firewalls ranked by the selector, health changes as new tables.
    let firewalls = [
        Firewall::new(
            IpAddr::V4(Ipv4Addr::new(10, 3, 1, 1)),
            "lbo-f1",
            Some("fw1"),
            1,
        ),
        Firewall::new(
            IpAddr::V4(Ipv4Addr::new(10, 3, 2, 1)),
            "lbo-f2",
            Some("fw2"),
            1,
        ),
    ];
    let mut v = PacketVserver::start(
        "outside",
        &["lbo-c".to_string()],
        &config,
        &LbParams::default(),
        &firewalls,
        &[true, true],
    )
    .expect("start");
    assert!(echoed(), "both firewalls UP");
    for (up, via) in [([false, true], 1), ([true, false], 0)] {
        let before = v.counters().expect("counters");
        v.set_up(&up).expect("health");
        assert!(v.table().iter().all(|&s| s == via as u32 + 1), "{up:?}");
        assert!(echoed(), "{up:?}");
        let after = v.counters().expect("counters");
        assert!(after.forwarded[via].packets > before.forwarded[via].packets);
        assert_eq!(
            after.forwarded[1 - via].packets,
            before.forwarded[1 - via].packets,
            "{up:?}: nothing through the DOWN firewall"
        );
    }
    v.set_up(&[false, false]).expect("health");
    assert!(not_echoed(SERVER), "no firewall UP");
    v.stop().expect("stop");
    inside.detach_all().expect("detach inside");
    println!("RESULT ok");
}

#[test]
fn a_datagram_crosses_the_firewall_the_table_names() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let skip = |why: String| {
        assert!(
            std::env::var("FULCRUM_REQUIRE_NETNS").as_deref() != Ok("1"),
            "{why}, and FULCRUM_REQUIRE_NETNS=1"
        );
        println!("SKIP: {why} (FULCRUM_REQUIRE_NETNS=1 makes this a failure)");
    };
    if !is_root() {
        return skip("needs root for network namespaces".into());
    }
    let pid = std::process::id();
    let name = |n: &str| format!("pk{n}-{pid}");
    let (cl, lb, fw1, fw2, srv) = (name("cl"), name("lb"), name("f1"), name("f2"), name("sv"));
    let mut guards = Vec::new();
    for n in [&cl, &lb, &fw1, &fw2, &srv] {
        if let Err(e) = ip(&["netns", "add", n]) {
            return skip(format!("cannot create a network namespace: {e}"));
        }
        guards.push(Netns(n.clone()));
        ip(&["-n", n, "link", "set", "lo", "up"]).expect("lo");
    }
    let run = |ns: &str, cmd: &str| {
        let mut args = vec!["-n", ns];
        args.extend(cmd.split_whitespace());
        ip(&args).unwrap_or_else(|e| panic!("{e}"));
    };
    let sysctl = |ns: &str, setting: &str| {
        ip(&["netns", "exec", ns, "sysctl", "-qw", setting]).unwrap_or_else(|e| panic!("{e}"));
    };
    run(
        &lb,
        &format!("link add lbo-c type veth peer name c0 netns {cl}"),
    );
    run(
        &lb,
        &format!("link add lbo-f1 type veth peer name f1a netns {fw1}"),
    );
    run(
        &lb,
        &format!("link add lbo-f2 type veth peer name f2a netns {fw2}"),
    );
    run(
        &fw1,
        &format!("link add f1b type veth peer name s1 netns {srv}"),
    );
    run(
        &fw2,
        &format!("link add f2b type veth peer name s2 netns {srv}"),
    );
    for (ns, dev, addr) in [
        (&cl, "c0", "10.1.0.1/24"),
        (&lb, "lbo-c", "10.1.0.254/24"),
        (&lb, "lbo-f1", "10.3.1.254/24"),
        (&lb, "lbo-f2", "10.3.2.254/24"),
        (&fw1, "f1a", "10.3.1.1/24"),
        (&fw1, "f1b", "10.2.1.1/24"),
        (&fw2, "f2a", "10.3.2.1/24"),
        (&fw2, "f2b", "10.2.2.1/24"),
        (&srv, "s1", "10.2.1.2/24"),
        (&srv, "s2", "10.2.2.2/24"),
    ] {
        run(ns, &format!("addr add {addr} dev {dev}"));
        run(ns, &format!("link set {dev} up"));
    }
    for (ns, dev, addr) in [
        (&cl, "c0", "fd01::1/64"),
        (&lb, "lbo-c", "fd01::fe/64"),
        (&lb, "lbo-f1", "fd03:1::fe/64"),
        (&fw1, "f1a", "fd03:1::1/64"),
        (&fw1, "f1b", "fd02:1::1/64"),
        (&srv, "s1", "fd02:1::2/64"),
    ] {
        run(ns, &format!("addr add {addr} dev {dev} nodad"));
    }
    run(&srv, "addr add fd02::1/128 dev lo");
    run(&cl, "-6 route add default via fd01::fe");
    sysctl(&lb, "net.ipv6.conf.all.forwarding=0");
    sysctl(&fw1, "net.ipv6.conf.all.forwarding=1");
    run(&fw1, "-6 route add fd01::/64 via fd03:1::fe");
    run(&fw1, "-6 route add fd02::1/128 via fd02:1::2");
    run(&srv, "-6 route add fd01::/64 via fd02:1::1");
    run(&srv, "addr add 10.2.0.1/32 dev lo");
    run(&cl, "route add default via 10.1.0.254");
    sysctl(&lb, "net.ipv4.ip_forward=0");
    for (fw, n) in [(&fw1, 1), (&fw2, 2)] {
        sysctl(fw, "net.ipv4.ip_forward=1");
        run(fw, &format!("route add 10.1.0.0/24 via 10.3.{n}.254"));
        run(fw, &format!("route add 10.2.0.1/32 via 10.2.{n}.2"));
    }
    // The server answers through fw1 whichever firewall the request took.
    run(&srv, "route add 10.1.0.0/24 via 10.2.1.1");

    let mut server = in_ns(&srv, "packet-server", "helper_packet_server")
        .stdout(Stdio::null())
        .spawn()
        .expect("server");
    let out = in_ns(&lb, "packet-lb", "helper_packet_lb")
        .env("FULCRUM_PACKET_CL", &cl)
        .env("FULCRUM_PACKET_FW1", &fw1)
        .output()
        .expect("lb");
    let _ = server.kill();
    let _ = server.wait();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if text.contains("Operation not permitted") && std::env::var_os("FULCRUM_REQUIRE_BPF").is_none()
    {
        return skip(format!("BPF unavailable: {text}"));
    }
    assert!(
        out.status.success() && text.contains("RESULT ok"),
        "the lb helper failed:\n{text}"
    );
}
