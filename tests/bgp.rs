//! Two fulcrum instances behind an ECMP route that BGP builds (docs/deployment.md,
//! "Active/active with ECMP"): Debian's BIRD 2 on a router and on each node, in network
//! namespaces the test builds:
//!
//! ```text
//!  client (SIPp UACs)      router (BIRD, AS 65000)        node a: fulcrum + BIRD + health check
//!  10.95.1.2 ──────────── 10.95.1.1  10.95.2.1 ──────────── 10.95.2.2   (VIP 10.95.0.1 on lo)
//!                                    10.95.3.1 ──────────── 10.95.3.2   node b: the same
//!                                    10.95.4.1 ──────────── 10.95.4.2-3 services (2 strict UAS)
//! ```
//!
//! Each node runs BIRD with `packaging/bird.conf` itself, only its marked values replaced (its
//! address, the router's, the VIP), and `packaging/fulcrum-bgp-health` as shipped (interval 1 s,
//! fall 2, rise 2), which enables the static protocol holding the VIP while fulcrum's
//! `/readyz` answers 200 and disables it otherwise. The router's BIRD has one eBGP session per
//! node (hold time 3 s) and exports to the kernel with `merge paths yes`, so the equal routes
//! from both nodes become one route with two next hops; the kernel hashes each flow by its
//! ports too (`fib_multipath_hash_policy=1`). Both nodes run one fulcrum file: a sip-udp
//! vserver on the VIP (`freebind`), `call_id_hash`, `record_route: true`, `advertise` the VIP
//! and `service_source: "${FULCRUM_UNICAST}"` (each node's own address), admin on
//! 127.0.0.1:9090.
//!
//! The services are [`common::strict_uas`] (481 to a BYE for a dialog they did not set up),
//! run in their namespace by this test binary (`helper_bgp_uas`), which writes their counts to
//! a file the test reads. Needs root, `ip`, `curl`, `sysctl`, `timeout`, `sh`, SIPp and BIRD 2
//! (`bird`, `birdc`); the dead-node test needs `nft` too. Without root or namespaces the tests
//! print why and pass without running (`FULCRUM_REQUIRE_NETNS=1` makes that a failure);
//! without BIRD likewise (`FULCRUM_REQUIRE_BIRD=1`); without SIPp likewise
//! (`FULCRUM_REQUIRE_SIPP=1`). Every wait is bounded; namespaces and processes are removed by a
//! guard on every exit path.

mod common;

use common::netns::ROLE;
use common::sipp::{Proc, Scratch, sipp_available, uac_counts};
use common::strict_uas::{Counts, StrictUas, read_counts, report_counts_until_stdin_closes};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const VIP: &str = "10.95.0.1";
const CLIENT: &str = "10.95.1.2";
/// (node, its address, the router's address on its link, the router's end of the link).
const NODES: [(&str, &str, &str, &str); 2] = [
    ("a", "10.95.2.2", "10.95.2.1", "ra"),
    ("b", "10.95.3.2", "10.95.3.1", "rb"),
];
const SERVICES: [(&str, &str); 2] = [("s0", "10.95.4.2:5060"), ("s1", "10.95.4.3:5060")];
/// The shipped node config, used as is but for the values it marks CHANGE.
const BIRD_CONF: &str = include_str!("../packaging/bird.conf");
/// The shipped health check, run from the repository as is.
const HEALTH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/fulcrum-bgp-health");
/// The health check's defaults (packaging/fulcrum-bgp-health): a route is withdrawn within
/// INTERVAL x FALL + 1 s of `/readyz` going false.
const INTERVAL_S: u64 = 1;
const FALL: u64 = 2;
/// The BGP hold time on both ends of each session (packaging/bird.conf, the router below).
const HOLD_TIME_S: u64 = 3;

/// The router's BIRD: one eBGP session per node, every route learnt exported to the kernel,
/// equal ones merged into one multipath route (docs/deployment.md shows this file).
const ROUTER_CONF: &str = "\
router id 10.95.1.1;

protocol device {
}

# Equal BGP routes to the VIP (same AS path, origin, MED) become one route with a next hop
# per node.
protocol kernel {
    merge paths yes;
    ipv4 {
        import none;
        export all;
    };
}

template bgp fulcrum_node {
    local as 65000;
    hold time 3;
    keepalive time 1;
    connect retry time 1;
    ipv4 {
        import where net = 10.95.0.1/32;
        export none;
    };
}

protocol bgp node_a from fulcrum_node {
    neighbor 10.95.2.2 as 65010;
}

protocol bgp node_b from fulcrum_node {
    neighbor 10.95.3.2 as 65010;
}
";

/// Services role: the strict UAS on their addresses; their counts are written to
/// `FULCRUM_BGP_COUNTS` every 50 ms and once more when stdin closes, which ends the role.
#[test]
fn helper_bgp_uas() {
    if std::env::var(ROLE).as_deref() != Ok("bgp-uas") {
        return;
    }
    let out = PathBuf::from(std::env::var("FULCRUM_BGP_COUNTS").expect("counts file"));
    let uas: Vec<StrictUas> = SERVICES
        .iter()
        .map(|(n, a)| StrictUas::udp_at(n, a.parse().expect("service address")))
        .collect();
    report_counts_until_stdin_closes(&uas, &out);
}

/// `program` on PATH or in the sbin directories (bird lives in /usr/sbin, which a non-login
/// PATH may lack).
fn find_program(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// A lab for test `name`, or None when it cannot run here (printed, or a panic under the
/// `FULCRUM_REQUIRE_*` variables). Every other failure to build it panics.
fn lab_or_skip(name: &str, slot: u32, drain_timeout: &str) -> Option<Lab> {
    let skip = |var: &str, why: String| {
        assert!(
            std::env::var(var).as_deref() != Ok("1"),
            "{name}: {why}, and {var}=1"
        );
        println!("SKIP {name}: {why} ({var}=1 makes this a failure)");
        None
    };
    if !common::netns::is_root() {
        return skip(
            "FULCRUM_REQUIRE_NETNS",
            "needs root for network namespaces".into(),
        );
    }
    if find_program("ip").is_none() {
        return skip("FULCRUM_REQUIRE_NETNS", "`ip` is not on PATH".into());
    }
    let (Some(bird), Some(birdc)) = (find_program("bird"), find_program("birdc")) else {
        return skip(
            "FULCRUM_REQUIRE_BIRD",
            "BIRD 2 is not installed (apt-get install bird2)".into(),
        );
    };
    for tool in ["curl", "sysctl", "timeout", "sh"] {
        assert!(
            find_program(tool).is_some(),
            "{name}: `{tool}` is not on PATH"
        );
    }
    if !sipp_available() {
        return None;
    }
    match Lab::start(slot, drain_timeout, &bird, &birdc) {
        Ok(lab) => Some(lab),
        Err(LabError::NoNetns(e)) => skip(
            "FULCRUM_REQUIRE_NETNS",
            format!("cannot create a network namespace: {e}"),
        ),
        Err(LabError::Failed(e)) => panic!("{name}: {e}"),
    }
}

/// Why [`Lab::start`] failed: namespaces cannot be made here at all (a skip), or something
/// after the first one was made (a failure).
enum LabError {
    NoNetns(String),
    Failed(String),
}

impl From<String> for LabError {
    fn from(e: String) -> Self {
        LabError::Failed(e)
    }
}

fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn ip(args: &str) -> Result<String, String> {
    run("ip", &args.split_whitespace().collect::<Vec<_>>())
}

/// `packaging/bird.conf` for one node: each value the file marks CHANGE replaced, and each
/// of them required to be there as shipped, so the example cannot drift from this test; its
/// log goes to `log` instead of syslog.
fn bird_conf(addr: &str, router: &str, log: &Path) -> Result<String, String> {
    let mut text = BIRD_CONF.to_owned();
    for (shipped, ours) in [
        ("log syslog all;", format!("log \"{}\" all;", log.display())),
        ("router id 192.0.2.11;", format!("router id {addr};")),
        (
            "local 192.0.2.11 as 65010;",
            format!("local {addr} as 65010;"),
        ),
        (
            "neighbor 192.0.2.254 as 65000;",
            format!("neighbor {router} as 65000;"),
        ),
        (
            "route 198.51.100.10/32 via \"lo\";",
            format!("route {VIP}/32 via \"lo\";"),
        ),
    ] {
        if text.matches(shipped).count() != 1 {
            return Err(format!(
                "packaging/bird.conf: expected `{shipped}` exactly once (tests/bgp.rs fills it in)"
            ));
        }
        text = text.replace(shipped, &ours);
    }
    Ok(text)
}

/// The SIPp UAC scenario: INVITE; 100 / 180 optional; 200 (its Record-Route set kept); ACK;
/// `hold_ms`; BYE; 200. ACK and BYE go to the 200's Contact with the Record-Route set as Route
/// (RFC 3261 §12.1.2, §12.2.1.1), through the VIP. Requests are retransmitted from 500 ms
/// (Timer A / E), so a request lost while a route changes is sent again.
fn scenario(hold_ms: u32) -> String {
    let headers = |cseq: &str, extra: &str| {
        format!(
            "      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]\n\
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]\n\
      To: uas <sip:uas@[remote_ip]:[remote_port]>{extra}\n\
      Call-ID: [call_id]\n\
      CSeq: {cseq}\n\
      Contact: <sip:sipp@[local_ip]:[local_port]>\n\
      Max-Forwards: 70\n\
      Content-Length: 0\n"
        )
    };
    format!(
        "<?xml version=\"1.0\" encoding=\"ISO-8859-1\" ?>\n\
<scenario name=\"bgp uac\">\n\
  <send retrans=\"500\"><![CDATA[\n\
      INVITE sip:uas@[remote_ip]:[remote_port] SIP/2.0\n{invite}\n    ]]></send>\n\
  <recv response=\"100\" optional=\"true\"/>\n\
  <recv response=\"180\" optional=\"true\"/>\n\
  <recv response=\"200\" rrs=\"true\"/>\n\
  <send><![CDATA[\n\
      ACK [next_url] SIP/2.0\n      [routes]\n{ack}\n    ]]></send>\n\
  <pause milliseconds=\"{hold_ms}\"/>\n\
  <send retrans=\"500\"><![CDATA[\n\
      BYE [next_url] SIP/2.0\n      [routes]\n{bye}\n    ]]></send>\n\
  <recv response=\"200\" crlf=\"true\"/>\n\
</scenario>\n",
        invite = headers("1 INVITE", ""),
        ack = headers("1 ACK", "[peer_tag_param]"),
        bye = headers("2 BYE", "[peer_tag_param]"),
    )
}

/// One SIPp UAC in the client namespace, from `CLIENT:port` (one UDP flow) to the VIP.
struct Uac {
    label: String,
    via: &'static str,
    calls: u32,
    proc: Proc,
    stat: PathBuf,
}

/// What a UAC did: (label, the node its flow went to first, calls, successful, failed).
type Outcome = (String, &'static str, u32, u64, u64);

impl Uac {
    /// Wait (bounded) for the end.
    fn finish(mut self) -> Outcome {
        self.proc.wait_for(Duration::from_secs(45));
        let (ok, failed) = uac_counts(&self.stat);
        (self.label, self.via, self.calls, ok, failed)
    }
}

/// The namespaces, processes and files of one run; all removed when dropped.
struct Lab {
    tag: String,
    names: Vec<String>,
    /// Every process started, by name ("uas", "fulcrum-a", "bird-a", "health-a", "bird-rtr"),
    /// ended with SIGTERM (then SIGKILL) before the namespaces go.
    children: Vec<(String, Child)>,
    /// The services role's stdin: dropping it ends the role.
    uas_stdin: Option<std::process::ChildStdin>,
    scratch: Scratch,
    counts: PathBuf,
    bird: PathBuf,
    birdc: PathBuf,
}

/// SIGTERM, then SIGKILL if `child` has not exited within `grace`.
fn terminate(child: &mut Child, grace: Duration) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.uas_stdin = None;
        for (_, c) in &mut self.children {
            terminate(c, Duration::from_secs(2));
        }
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

impl Lab {
    fn ns(&self, role: &str) -> String {
        format!("fcb-{role}-{}", self.tag)
    }

    /// Build the namespaces and links, the UAS, both fulcrum instances (ready), every BIRD
    /// and both health checks, and wait until the router holds a route with both next hops.
    fn start(slot: u32, drain_timeout: &str, bird: &Path, birdc: &Path) -> Result<Lab, LabError> {
        let tag = format!("{}{slot}", std::process::id() % 10_000);
        let mut lab = Lab {
            scratch: Scratch::new(&format!("bgp-{tag}")),
            counts: PathBuf::new(),
            tag,
            names: Vec::new(),
            children: Vec::new(),
            uas_stdin: None,
            bird: bird.to_owned(),
            birdc: birdc.to_owned(),
        };
        lab.counts = lab.scratch.path("uas-counts.txt");
        let t = lab.tag.clone();
        for role in ["cli", "rtr", "a", "b", "svc"] {
            let n = lab.ns(role);
            match ip(&format!("netns add {n}")) {
                // The first namespace is the probe: refused, there are none to be had here.
                Err(e) if lab.names.is_empty() => return Err(LabError::NoNetns(e)),
                r => r?,
            };
            lab.names.push(n.clone());
            ip(&format!("-n {n} link set lo up"))?;
        }
        let rtr = lab.ns("rtr");
        // (role, its end, the router's end, its address, the router's address)
        let links = [
            ("cli", "hc", "rc", CLIENT, "10.95.1.1"),
            ("a", "ha", NODES[0].3, NODES[0].1, NODES[0].2),
            ("b", "hb", NODES[1].3, NODES[1].1, NODES[1].2),
            ("svc", "hs", "rs", host(SERVICES[0].1), "10.95.4.1"),
        ];
        for (role, end, rend, addr, gw) in links {
            let n = lab.ns(role);
            ip(&format!(
                "link add {end}{t} netns {n} type veth peer name {rend}{t} netns {rtr}"
            ))?;
            ip(&format!("-n {n} addr add {addr}/24 dev {end}{t}"))?;
            ip(&format!("-n {rtr} addr add {gw}/24 dev {rend}{t}"))?;
            ip(&format!("-n {n} link set {end}{t} up"))?;
            ip(&format!("-n {rtr} link set {rend}{t} up"))?;
            ip(&format!("-n {n} route add default via {gw}"))?;
        }
        ip(&format!(
            "-n {} addr add {}/24 dev hs{t}",
            lab.ns("svc"),
            host(SERVICES[1].1)
        ))?;
        for (node, ..) in NODES {
            ip(&format!("-n {} addr add {VIP}/32 dev lo", lab.ns(node)))?;
        }
        run(
            "ip",
            &[
                "netns",
                "exec",
                &rtr,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
                "net.ipv4.fib_multipath_hash_policy=1",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ],
        )?;

        let me = std::env::current_exe().map_err(|e| LabError::Failed(e.to_string()))?;
        let mut uas = Command::new("ip")
            .args(["netns", "exec", &lab.ns("svc")])
            .arg(&me)
            .args(["--exact", "helper_bgp_uas", "--nocapture"])
            .env(ROLE, "bgp-uas")
            .env("FULCRUM_BGP_COUNTS", &lab.counts)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("services role: {e}"))?;
        lab.uas_stdin = uas.stdin.take();
        lab.children.push(("uas".into(), uas));

        // One file for both nodes (docs/deployment.md, "Failover in an ECMP pool").
        let services: String = SERVICES
            .iter()
            .map(|(n, a)| format!("  - {{ name: {n}, address: \"{a}\", protocol: sip-udp }}\n"))
            .collect();
        let yaml = format!(
            "admin: {{ listen: \"127.0.0.1:9090\" }}\nservices:\n{services}vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [\"{VIP}:5060\"]\n    freebind: true\n    advertise: \"{VIP}:5060\"\n    service_source: \"${{FULCRUM_UNICAST}}\"\n    method: call_id_hash\n    record_route: true\n    services: [s0, s1]\n"
        );
        let cfg = lab.scratch.path("fulcrum.yaml");
        std::fs::write(&cfg, yaml).map_err(|e| LabError::Failed(e.to_string()))?;
        for (node, addr, ..) in NODES {
            lab.start_fulcrum(node, addr, &cfg, drain_timeout)?;
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        while !(NODES.iter().all(|(n, ..)| lab.admin(n, "readyz"))
            && lab.counts().len() == SERVICES.len())
        {
            if Instant::now() > deadline {
                return Err(LabError::Failed(format!(
                    "instances or services not ready in 15 s (a: {}, b: {}, services counted {} of {}; logs in {})",
                    lab.admin("a", "readyz"),
                    lab.admin("b", "readyz"),
                    lab.counts().len(),
                    SERVICES.len(),
                    lab.scratch.0.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }

        let rtr_conf = lab.scratch.path("bird-rtr.conf");
        let rtr_log = lab.scratch.path("bird-rtr.log");
        std::fs::write(
            &rtr_conf,
            format!("log \"{}\" all;\n{ROUTER_CONF}", rtr_log.display()),
        )
        .map_err(|e| LabError::Failed(e.to_string()))?;
        lab.start_bird("rtr", bird, &rtr_conf)?;
        for (node, addr, router, _) in NODES {
            let conf = lab.scratch.path(&format!("bird-{node}.conf"));
            let log = lab.scratch.path(&format!("bird-{node}.log"));
            std::fs::write(&conf, bird_conf(addr, router, &log)?)
                .map_err(|e| LabError::Failed(e.to_string()))?;
            lab.start_bird(node, bird, &conf)?;
        }
        for (node, ..) in NODES {
            lab.start_health(node)?;
        }
        lab.wait_hops(&["a", "b"], Duration::from_secs(20))
            .map_err(|e| format!("{e}\n{}", lab.logs()))?;
        Ok(lab)
    }

    fn spawn(&mut self, name: &str, ns: &str, cmd: &mut Command) -> Result<(), String> {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.scratch.path(&format!("{name}.log")))
            .map_err(|e| e.to_string())?;
        let child = Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(cmd.get_program())
            .args(cmd.get_args())
            .envs(cmd.get_envs().filter_map(|(k, v)| Some((k, v?))))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("{name}: {e}"))?;
        self.children.push((name.to_owned(), child));
        Ok(())
    }

    fn start_fulcrum(
        &mut self,
        node: &str,
        addr: &str,
        cfg: &Path,
        drain_timeout: &str,
    ) -> Result<(), String> {
        let ns = self.ns(node);
        self.spawn(
            &format!("fulcrum-{node}"),
            &ns,
            Command::new(env!("CARGO_BIN_EXE_fulcrum"))
                .args(["run", "--drain-timeout", drain_timeout, "--config"])
                .arg(cfg)
                .env("RUST_LOG", "info")
                .env("FULCRUM_UNICAST", addr),
        )
    }

    /// BIRD in the foreground (-f), with its own control socket and pid file.
    fn start_bird(&mut self, node: &str, bird: &Path, conf: &Path) -> Result<(), String> {
        let ns = self.ns(node);
        let (ctl, pid) = (
            self.ctl(node),
            self.scratch.path(&format!("bird-{node}.pid")),
        );
        self.spawn(
            &format!("bird-{node}"),
            &ns,
            Command::new(bird)
                .arg("-f")
                .arg("-c")
                .arg(conf)
                .arg("-s")
                .arg(ctl)
                .arg("-P")
                .arg(pid),
        )
    }

    /// The shipped health check with its defaults, but for bird's control socket.
    fn start_health(&mut self, node: &str) -> Result<(), String> {
        let ns = self.ns(node);
        let ctl = self.ctl(node);
        let path = std::env::var_os("PATH").unwrap_or_default();
        let birdc_dir = self.birdc.parent().map(Path::to_owned).unwrap_or_default();
        let path = std::env::join_paths(std::env::split_paths(&path).chain([birdc_dir]))
            .map_err(|e| e.to_string())?;
        self.spawn(
            &format!("health-{node}"),
            &ns,
            Command::new("sh")
                .arg(HEALTH)
                .env("BIRD_SOCKET", ctl)
                .env("PATH", path),
        )
    }

    fn ctl(&self, node: &str) -> PathBuf {
        self.scratch.path(&format!("bird-{node}.ctl"))
    }

    /// Whether `GET /PATH` of the fulcrum on `node` answers 2xx, from its own namespace.
    fn admin(&self, node: &str, path: &str) -> bool {
        self.admin_text(node, path).is_ok()
    }

    fn admin_text(&self, node: &str, path: &str) -> Result<String, String> {
        run(
            "ip",
            &[
                "netns",
                "exec",
                &self.ns(node),
                "curl",
                "-fsS",
                "-m",
                "1",
                &format!("http://127.0.0.1:9090/{path}"),
            ],
        )
    }

    /// Requests the fulcrum on `node` sent to services (`fulcrum_requests_total`, summed).
    fn requests(&self, node: &str) -> u64 {
        let text = self.admin_text(node, "metrics").unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with("fulcrum_requests_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// The nodes the router's kernel route to the VIP names as next hops, in order.
    fn hops(&self) -> Vec<&'static str> {
        let out = ip(&format!("-n {} -4 route show {VIP}/32", self.ns("rtr"))).unwrap_or_default();
        NODES
            .iter()
            .filter(|(_, addr, ..)| out.contains(&format!("via {addr} ")))
            .map(|(n, ..)| *n)
            .collect()
    }

    /// Wait (at most `limit`) until the router's route names exactly the nodes `want`; the
    /// time it took.
    fn wait_hops(&self, want: &[&str], limit: Duration) -> Result<Duration, String> {
        let start = Instant::now();
        loop {
            let hops = self.hops();
            if hops == want {
                return Ok(start.elapsed());
            }
            if start.elapsed() > limit {
                return Err(format!(
                    "the router's route to {VIP} names {hops:?}, not {want:?}, after {} s",
                    limit.as_secs()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The node the router sends a client flow from `port` to, as `ip route get` says.
    fn next_hop(&self, port: u16) -> Result<&'static str, String> {
        let out = ip(&format!(
            "-n {} route get {VIP} from {CLIENT} iif rc{} ipproto udp sport {port} dport 5060",
            self.ns("rtr"),
            self.tag
        ))?;
        NODES
            .iter()
            .find(|(_, addr, ..)| out.contains(&format!("via {addr} ")))
            .map(|(n, ..)| *n)
            .ok_or_else(|| format!("unexpected route: {out}"))
    }

    /// `n` client ports whose flows the router sends to `want` ("a" or "b").
    fn ports_to(&self, want: &str, n: usize, from: u16) -> Result<Vec<u16>, String> {
        let mut out = Vec::new();
        for p in from..from + 200 {
            if self.next_hop(p)? == want {
                out.push(p);
                if out.len() == n {
                    return Ok(out);
                }
            }
        }
        Err(format!("no {n} ports to {want} from {from}"))
    }

    fn child(&mut self, name: &str) -> Option<&mut Child> {
        self.children
            .iter_mut()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c)
    }

    /// SIGKILL one of the processes started ("fulcrum-a", "bird-a", ...).
    fn kill(&mut self, name: &str) {
        if let Some(c) = self.child(name) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start a SIPp UAC from `port`: `calls` calls at `rate_per_s`, with `scenario`.
    fn uac(
        &self,
        label: &str,
        via: &'static str,
        scenario: &Path,
        port: u16,
        rate_per_s: u32,
        calls: u32,
    ) -> Uac {
        let stat = self.scratch.path(&format!("uac-{label}.csv"));
        let errors = self.scratch.path(&format!("uac-{label}-errors.log"));
        let proc = Proc::spawn(
            &format!("sipp {label}"),
            Command::new("ip")
                .args(["netns", "exec", &self.ns("cli")])
                .args(["timeout", "-s", "KILL", "40", "sipp", "-sf"])
                .arg(scenario)
                .arg(format!("{VIP}:5060"))
                .args(["-i", CLIENT, "-p", &port.to_string(), "-t", "u1"])
                .args(["-r", &rate_per_s.to_string(), "-m", &calls.to_string()])
                .args(["-nostdin", "-timeout", "40s", "-recv_timeout", "15000"])
                .args(["-trace_stat", "-stf"])
                .arg(&stat)
                .args(["-trace_err", "-error_file"])
                .arg(&errors)
                .current_dir(&self.scratch.0),
        );
        Uac {
            label: label.to_owned(),
            via,
            calls,
            proc,
            stat,
        }
    }

    /// The services' counts as last written by the services role, by name.
    fn counts(&self) -> Vec<(String, Counts)> {
        read_counts(&self.counts)
    }

    /// The services' final counts: stop the role (stdin closed), which writes them once more.
    fn final_counts(&mut self) -> Vec<(String, Counts)> {
        self.uas_stdin = None;
        if let Some(c) = self.child("uas") {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.counts()
    }

    fn dialogs(&self) -> u64 {
        self.counts().iter().map(|(_, c)| c.dialogs).sum()
    }

    /// Wait (at most `limit`) until the services have set up `n` dialogs in all.
    fn wait_dialogs(&self, n: u64, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while self.dialogs() < n {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    /// A process's log ("health-a", "bird-rtr", ...).
    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.scratch.path(&format!("{name}.log"))).unwrap_or_default()
    }

    /// The BIRD and health-check logs, for a failure message.
    fn logs(&self) -> String {
        let mut out = String::new();
        for name in ["bird-rtr", "bird-a", "bird-b", "health-a", "health-b"] {
            let text = self.log(name);
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out.push_str(&format!("--- {name} (last lines)\n"));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// Flows before a failure: `n` from ports the router sends to each node, with `scenario`,
    /// `calls` calls each at 10/s.
    fn flows_to_both(&self, label: &str, scenario: &Path, n: usize, from: u16) -> Vec<Uac> {
        let mut out = Vec::new();
        for node in ["a", "b"] {
            let ports = self
                .ports_to(node, n, from)
                .unwrap_or_else(|e| panic!("{e}"));
            for (i, p) in ports.into_iter().enumerate() {
                let via = if node == "a" { "a" } else { "b" };
                out.push(self.uac(&format!("{label}-{node}{i}"), via, scenario, p, 10, 10));
            }
        }
        out
    }
}

/// The address part of `host:port`.
fn host(addr: &str) -> &str {
    addr.split(':').next().unwrap_or(addr)
}

fn sum(counts: &[(String, Counts)], f: impl Fn(&Counts) -> u64) -> u64 {
    counts.iter().map(|(_, c)| f(c)).sum()
}

/// Print the outcomes and require each to have succeeded in full.
fn all_succeed(lab: &Lab, outcomes: &[Outcome]) {
    for (label, via, calls, ok, failed) in outcomes {
        println!("{label:14} flow to {via}: {calls} calls, {ok} successful, {failed} failed");
    }
    for (label, _, calls, ok, failed) in outcomes {
        assert_eq!(
            (*ok, *failed),
            (u64::from(*calls), 0),
            "{label}: (successful, failed); logs in {}",
            lab.scratch.0.display()
        );
    }
}

fn no_stray_requests(counts: &[(String, Counts)]) {
    for (n, c) in counts {
        println!("{n}: {c:?}");
    }
    assert_eq!(sum(counts, |c| c.r481), 0, "481s at the services");
    assert_eq!(
        sum(counts, |c| c.stray_acks),
        0,
        "stray ACKs at the services"
    );
}

/// How a node fails in [`node_loss`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Loss {
    /// fulcrum SIGKILLed: `/readyz` stops answering, the health check withdraws the route.
    Fulcrum,
    /// SIGTERM: `/readyz` turns 503 at once, the health check withdraws the route, and the
    /// instance answers until the end of its drain.
    Drain,
    /// A planned stop in the order docs/deployment.md gives: the health check stopped first
    /// (SIGTERM: it withdraws the route on its way out), fulcrum sent SIGTERM once the router has
    /// dropped the node. No call is refused: fulcrum takes new calls until no flow reaches it.
    PlannedStop,
    /// The node falls silent, its link up (every packet in and out dropped by nftables, then
    /// every process killed): the router ends the session when the hold time runs out.
    Silent,
    /// The node's link is cut (its veth deleted): BIRD on the router sees the interface go and
    /// ends the session at once.
    LinkCut,
}

/// Both nodes announce and flows spread over them; then node a fails as `loss` says. The
/// router's route loses a's next hop within `limit` of the failure; calls set up through a
/// before (record-routed, held across the change) are ended by their BYE through b, which
/// sends it to the same service (no 481 at any service); calls from flows that went to a,
/// placed once the route has changed, succeed through b. Calls placed in between are
/// reported. The withdrawal time is printed.
fn node_loss(name: &str, slot: u32, loss: Loss, limit: Duration) {
    let drain = match loss {
        Loss::Drain | Loss::PlannedStop => "8s",
        _ => "1s",
    };
    let Some(mut lab) = lab_or_skip(name, slot, drain) else {
        return;
    };
    if loss == Loss::Silent && find_program("nft").is_none() {
        assert!(
            std::env::var("FULCRUM_REQUIRE_NETNS").as_deref() != Ok("1"),
            "{name}: nft is not installed (apt-get install nftables), and FULCRUM_REQUIRE_NETNS=1"
        );
        println!("SKIP {name}: nft is not installed (apt-get install nftables)");
        return;
    }
    let quick = lab.scratch.path("quick.xml");
    std::fs::write(&quick, scenario(200)).expect("scenario");
    let held = lab.scratch.path("held.xml");
    // Held 7 s: every BYE is sent after the route has changed.
    std::fs::write(&held, scenario(7000)).expect("scenario");

    // Spread: two flows to each node, every call successful, both instances carrying calls.
    let before = [lab.requests("a"), lab.requests("b")];
    let spread: Vec<Outcome> = lab
        .flows_to_both("spread", &quick, 2, 5100)
        .into_iter()
        .map(Uac::finish)
        .collect();
    let carried = [
        lab.requests("a").saturating_sub(before[0]),
        lab.requests("b").saturating_sub(before[1]),
    ];
    println!(
        "route to {VIP}: next hops {:?}; requests sent to services by a: {}, by b: {}",
        lab.hops(),
        carried[0],
        carried[1]
    );
    all_succeed(&lab, &spread);
    assert!(
        carried.iter().all(|&c| c >= 20),
        "flows did not spread over both instances: a {}, b {}",
        carried[0],
        carried[1]
    );

    // Held calls through both nodes, set up before the failure.
    let held_uacs = lab.flows_to_both("held", &held, 1, 5200);
    let held_total = lab.dialogs() + 20;
    assert!(
        lab.wait_dialogs(held_total, Duration::from_secs(10)),
        "only {} of {held_total} dialogs set up before the failure",
        lab.dialogs()
    );
    let to_a = lab.ports_to("a", 2, 5300).expect("ports to a");
    let failed_at = Instant::now();
    match loss {
        Loss::Fulcrum => lab.kill("fulcrum-a"),
        Loss::Drain => {
            let pid = lab.child("fulcrum-a").map(|c| c.id()).expect("fulcrum a");
            run("kill", &["-TERM", &pid.to_string()]).expect("SIGTERM");
        }
        Loss::PlannedStop => {
            let pid = lab
                .child("health-a")
                .map(|c| c.id())
                .expect("health check a");
            run("kill", &["-TERM", &pid.to_string()]).expect("SIGTERM");
        }
        Loss::Silent => {
            let mut nft = Command::new("ip")
                .args(["netns", "exec", &lab.ns("a"), "nft", "-f", "-"])
                .stdin(Stdio::piped())
                .spawn()
                .expect("nft");
            if let Some(mut stdin) = nft.stdin.take() {
                use std::io::Write;
                stdin
                    .write_all(
                        b"table inet silent {\n\
                          chain in { type filter hook input priority -300; policy drop; }\n\
                          chain out { type filter hook output priority -300; policy drop; }\n\
                          }\n",
                    )
                    .expect("nft script");
            }
            assert!(nft.wait().expect("nft").success(), "nft refused the table");
            for p in ["health-a", "bird-a", "fulcrum-a"] {
                lab.kill(p);
            }
        }
        Loss::LinkCut => {
            ip(&format!("-n {} link del ra{}", lab.ns("rtr"), lab.tag)).expect("cut a's link");
        }
    }
    // A flow that went to a, from the moment of the failure: reported.
    let window = lab.uac("window-a", "a", &quick, to_a[0], 10, 20);
    let withdrawn = lab
        .wait_hops(&["b"], Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}\n{}", lab.logs()));
    if loss == Loss::PlannedStop {
        let pid = lab.child("fulcrum-a").map(|c| c.id()).expect("fulcrum a");
        run("kill", &["-TERM", &pid.to_string()]).expect("SIGTERM");
    }
    let still_live = lab.admin("a", "healthz");
    let still_running = lab
        .child("fulcrum-a")
        .is_some_and(|c| matches!(c.try_wait(), Ok(None)));
    println!(
        "{loss:?} on a: its next hop withdrawn at the router {} ms later (a answering /healthz then: {still_live})",
        withdrawn.as_millis()
    );
    let after = lab.uac("after-a", "a", &quick, to_a[1], 10, 20).finish();
    let held_done: Vec<Outcome> = held_uacs.into_iter().map(Uac::finish).collect();
    let window = window.finish();
    println!(
        "{:14} flow to a, placed from the failure on: {} calls, {} successful, {} failed",
        window.0, window.2, window.3, window.4
    );
    let exited = matches!(loss, Loss::Drain | Loss::PlannedStop).then(|| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let done = lab
                .child("fulcrum-a")
                .is_none_or(|c| !matches!(c.try_wait(), Ok(None)));
            if done {
                break failed_at.elapsed();
            }
            assert!(
                Instant::now() < deadline,
                "the draining fulcrum did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let counts = lab.final_counts();
    all_succeed(&lab, &held_done);
    all_succeed(&lab, &[after]);
    no_stray_requests(&counts);
    assert!(
        withdrawn <= limit,
        "{loss:?}: a's next hop withdrawn {} ms after the failure, more than {} ms\n{}",
        withdrawn.as_millis(),
        limit.as_millis(),
        lab.logs()
    );
    match loss {
        Loss::PlannedStop => {
            assert!(
                lab.log("health-a")
                    .contains("stopped: fulcrum_vip withdrawn"),
                "the health check did not withdraw on its way out:\n{}",
                lab.log("health-a")
            );
            assert_eq!(
                (window.3, window.4),
                (u64::from(window.2), 0),
                "{}: calls refused or lost in a planned stop",
                window.0
            );
        }
        Loss::Fulcrum | Loss::Drain => assert!(
            lab.log("health-a")
                .contains("withdrawing (fulcrum_vip disabled)"),
            "the health check did not withdraw:\n{}",
            lab.log("health-a")
        ),
        Loss::Silent => assert!(
            lab.log("bird-rtr").contains("Hold timer expired"),
            "the router did not end the session on its hold timer:\n{}",
            lab.log("bird-rtr")
        ),
        Loss::LinkCut => {}
    }
    if let Some(exited) = exited {
        println!(
            "the draining instance exited {} ms after the SIGTERM",
            exited.as_millis()
        );
        assert!(
            still_live && still_running,
            "when its route was withdrawn the draining instance no longer answered (healthz {still_live}, running {still_running})"
        );
        assert!(withdrawn < exited, "withdrawn after the instance stopped");
    }
}

/// fulcrum on node a SIGKILLed: the health check withdraws a's route within interval x fall +
/// 1 s (3 s); held dialogs end through b, new calls succeed.
#[test]
fn bgp_killed_fulcrum_is_withdrawn_and_dialogs_end_through_the_other() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    node_loss(
        "bgp_killed_fulcrum_is_withdrawn_and_dialogs_end_through_the_other",
        0,
        Loss::Fulcrum,
        Duration::from_secs(INTERVAL_S * FALL + 1),
    );
}

/// fulcrum on node a sent SIGTERM (`systemctl stop`): `/readyz` turns 503, the route is
/// withdrawn within interval x fall + 1 s while the instance still answers, and it exits only
/// at the end of its drain (8 s).
#[test]
fn bgp_draining_fulcrum_is_withdrawn_before_it_stops_answering() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    node_loss(
        "bgp_draining_fulcrum_is_withdrawn_before_it_stops_answering",
        1,
        Loss::Drain,
        Duration::from_secs(INTERVAL_S * FALL + 1),
    );
}

/// A planned stop of node a: its health check stopped first withdraws the route at once (within
/// 1 s), then fulcrum drains; no call placed meanwhile fails.
#[test]
fn bgp_planned_stop_withdraws_first_and_refuses_no_call() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    node_loss(
        "bgp_planned_stop_withdraws_first_and_refuses_no_call",
        4,
        Loss::PlannedStop,
        Duration::from_secs(1),
    );
}

/// Node a falls silent with its link up: the router withdraws its route when the BGP hold time
/// (3 s) runs out, and calls continue through b.
#[test]
fn bgp_silent_node_is_withdrawn_after_the_hold_time() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    node_loss(
        "bgp_silent_node_is_withdrawn_after_the_hold_time",
        2,
        Loss::Silent,
        Duration::from_secs(HOLD_TIME_S + 1),
    );
}

/// Node a's link cut: the router's BIRD sees its interface go and withdraws the route at once;
/// calls continue through b.
#[test]
fn bgp_cut_link_is_withdrawn_at_once() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    node_loss(
        "bgp_cut_link_is_withdrawn_at_once",
        3,
        Loss::LinkCut,
        Duration::from_secs(1),
    );
}

/// bird on node a restarted (SIGKILL, then started again from the same file, which starts the
/// VIP's protocol disabled): the router drops a's route when the session goes, and the health
/// check, which states its decision every round, announces it again once bird is back.
#[test]
fn bgp_restarted_bird_is_put_right_by_the_health_check() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let name = "bgp_restarted_bird_is_put_right_by_the_health_check";
    let Some(mut lab) = lab_or_skip(name, 5, "1s") else {
        return;
    };
    lab.kill("bird-a");
    let gone = lab
        .wait_hops(&["b"], Duration::from_secs(HOLD_TIME_S + 1))
        .unwrap_or_else(|e| panic!("{e}\n{}", lab.logs()));
    let (bird, conf) = (lab.bird.clone(), lab.scratch.path("bird-a.conf"));
    lab.children.retain(|(n, _)| n != "bird-a");
    lab.start_bird("a", &bird, &conf).expect("bird a again");
    // The session comes up (connect retry 1 s), then the next round of the check (1 s)
    // enables the protocol.
    let back = lab
        .wait_hops(&["a", "b"], Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}\n{}", lab.logs()));
    println!(
        "bird on a killed: its route gone {} ms later; bird started again: the route back {} ms after the start",
        gone.as_millis(),
        back.as_millis()
    );
    assert!(
        lab.log("bird-a")
            .matches("Enabling protocol fulcrum_vip")
            .count()
            >= 2,
        "the health check did not enable the protocol again:\n{}",
        lab.log("bird-a")
    );
}
