//! Two fulcrum instances behind an ECMP route act as one (docs/deployment.md
//! "Active/active with ECMP"), in network namespaces the test builds:
//!
//! ```text
//!  client (SIPp UACs)          router                      instance A (fulcrum, VIP on lo)
//!  10.98.1.2 ──────────── 10.98.1.1  10.98.2.1 ──────────── 10.98.2.2
//!                         10.99.0.1/32 ECMP       10.98.3.1 ──────────── 10.98.3.2 instance B
//!                                                 10.98.4.1 ──────────── 10.98.4.2-4 services
//!                                                                         (3 strict UAS)
//! ```
//!
//! The router holds `10.99.0.1/32 nexthop via A nexthop via B` with the L4 multipath hash
//! (`fib_multipath_hash_policy=1`), so each UDP flow (a SIPp instance's socket; a service's
//! replies to the VIP) stays on one instance while the route is stable. Both instances run
//! the same file: a sip-udp vserver on the VIP (`freebind`, the VIP also on their `lo`),
//! `call_id_hash`, `record_route: true`, `advertise` the VIP. The services answer each
//! request to its source, the VIP, which the router hands to either instance: fulcrum relays
//! responses statelessly (RFC 3261 §16.11) on the Via every instance writes alike.
//!
//! The UAS are [`common::strict_uas`] (481 to a request for a dialog they did not set up),
//! run inside the services namespace by this test binary (`helper_ha_uas`), which writes
//! their counts to a file the test reads. Needs root, `ip`, `curl`, `sysctl`, `timeout` and
//! SIPp. Without root, without `ip`, or where `ip netns add` is refused (no network
//! namespaces here), each test prints why and passes without running; with
//! `FULCRUM_REQUIRE_NETNS=1` (CI) that fails instead, as a missing SIPp does with
//! `FULCRUM_REQUIRE_SIPP=1`. Anything that goes wrong once the first namespace exists (links,
//! routes, the instances' readiness, a missing `curl`) fails. Namespaces and processes are
//! removed by a guard on every exit path.

mod common;

use common::sipp::{Proc, Scratch, sipp_available, uac_counts};
use common::strict_uas::{Counts, Sick, StrictUas, read_counts, report_counts_until_stdin_closes};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::netns::ROLE;
const VIP: &str = "10.99.0.1";
const CLIENT: &str = "10.98.1.2";
const A: &str = "10.98.2.2";
const B: &str = "10.98.3.2";
const SERVICES: [(&str, &str); 3] = [
    ("s0", "10.98.4.2:5060"),
    ("s1", "10.98.4.3:5060"),
    ("s2", "10.98.4.4:5060"),
];

/// Services role: the three strict UAS on their addresses; their counts are written to
/// `FULCRUM_HA_COUNTS` (one line per UAS: name requests dialogs byes_ok r481 stray_acks
/// invites; s1 answers INVITEs 503 when `FULCRUM_HA_SICK=s1`)
/// every 50 ms and once more when stdin closes, which ends the role.
#[test]
fn helper_ha_uas() {
    if std::env::var(ROLE).as_deref() != Ok("ha-uas") {
        return;
    }
    let out = PathBuf::from(std::env::var("FULCRUM_HA_COUNTS").expect("counts file"));
    let uas: Vec<StrictUas> = SERVICES
        .iter()
        .map(|(n, a)| StrictUas::udp_at(n, a.parse().expect("service address")))
        .collect();
    let sick = std::env::var("FULCRUM_HA_SICK").unwrap_or_default();
    for u in uas.iter().filter(|u| u.name == sick) {
        u.set_sick(Sick::Busy);
    }
    report_counts_until_stdin_closes(&uas, &out);
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
}

/// Why network namespaces cannot be built here, if they cannot: the only reasons a test of
/// this file passes without running.
fn netns_unavailable() -> Option<String> {
    if !common::netns::is_root() {
        return Some("needs root for network namespaces".into());
    }
    if !on_path("ip") {
        return Some("`ip` is not on PATH".into());
    }
    None
}

/// A lab for test `name`, or None when it cannot run here (printed, or a panic under
/// `FULCRUM_REQUIRE_NETNS=1`). Every other failure to build it panics.
fn lab_or_skip(name: &str, slot: u32, record_route: bool) -> Option<Lab> {
    lab_or_skip_with(name, slot, record_route, Gray::No)
}

/// Whether the lab's instances fail over (each with its own `service_source`) and one of its
/// services is sick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gray {
    /// `failover: off`, every service healthy.
    No,
    /// Failover on (the default), `service_source: "${FULCRUM_UNICAST}"` set to each
    /// instance's own address, and s1 answering every INVITE 503 (OPTIONS 200).
    SickS1,
}

fn lab_or_skip_with(name: &str, slot: u32, record_route: bool, gray: Gray) -> Option<Lab> {
    let skip = |why: String| {
        assert!(
            std::env::var("FULCRUM_REQUIRE_NETNS").as_deref() != Ok("1"),
            "{name}: {why}, and FULCRUM_REQUIRE_NETNS=1"
        );
        println!("SKIP {name}: {why} (FULCRUM_REQUIRE_NETNS=1 makes this a failure)");
        None
    };
    if let Some(why) = netns_unavailable() {
        return skip(why);
    }
    for tool in ["curl", "sysctl", "timeout"] {
        assert!(on_path(tool), "{name}: `{tool}` is not on PATH");
    }
    if !sipp_available() {
        return None;
    }
    match Lab::start(slot, record_route, gray) {
        Ok(lab) => Some(lab),
        Err(LabError::NoNetns(e)) => skip(format!("cannot create a network namespace: {e}")),
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

/// The SIPp UAC scenario: INVITE; 100 / 180 optional; 200 (its Record-Route set kept);
/// `ack_pause_ms`; ACK; `hold_ms`; BYE; 200. ACK and BYE go to the 200's Contact with the
/// Record-Route set as Route (RFC 3261 §12.1.2, §12.2.1.1), and, like every request of a
/// SIPp scenario, to the VIP. Requests are retransmitted from 500 ms (Timer A / E).
fn scenario(ack_pause_ms: u32, hold_ms: u32) -> String {
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
    let pause = |ms: u32| {
        if ms == 0 {
            String::new()
        } else {
            format!("  <pause milliseconds=\"{ms}\"/>\n")
        }
    };
    format!(
        "<?xml version=\"1.0\" encoding=\"ISO-8859-1\" ?>\n\
<scenario name=\"ha uac\">\n\
  <send retrans=\"500\"><![CDATA[\n\
      INVITE sip:uas@[remote_ip]:[remote_port] SIP/2.0\n{invite}\n    ]]></send>\n\
  <recv response=\"100\" optional=\"true\"/>\n\
  <recv response=\"180\" optional=\"true\"/>\n\
  <recv response=\"200\" rrs=\"true\"/>\n\
{ack_pause}\
  <send><![CDATA[\n\
      ACK [next_url] SIP/2.0\n      [routes]\n{ack}\n    ]]></send>\n\
{hold}\
  <send retrans=\"500\"><![CDATA[\n\
      BYE [next_url] SIP/2.0\n      [routes]\n{bye}\n    ]]></send>\n\
  <recv response=\"200\" crlf=\"true\"/>\n\
</scenario>\n",
        invite = headers("1 INVITE", ""),
        ack = headers("1 ACK", "[peer_tag_param]"),
        bye = headers("2 BYE", "[peer_tag_param]"),
        ack_pause = pause(ack_pause_ms),
        hold = pause(hold_ms),
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

impl Uac {
    /// Wait (bounded) for the end; (successful, failed).
    fn finish(mut self) -> (String, &'static str, u32, u64, u64) {
        self.proc.wait_for(Duration::from_secs(45));
        let (ok, failed) = uac_counts(&self.stat);
        (self.label, self.via, self.calls, ok, failed)
    }
}

/// The namespaces, processes and files of one run; all removed when dropped.
struct Lab {
    tag: String,
    names: Vec<String>,
    children: Vec<(String, Child)>,
    /// The services role's stdin: dropping it ends the role.
    uas_stdin: Option<std::process::ChildStdin>,
    scratch: Scratch,
    counts: PathBuf,
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.uas_stdin = None;
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

impl Lab {
    fn ns(&self, role: &str) -> String {
        format!("fch-{role}-{}", self.tag)
    }

    /// Build the namespaces and links, the router's ECMP route, the UAS and both instances
    /// (ready, as their `/readyz` says from the router).
    fn start(slot: u32, record_route: bool, gray: Gray) -> Result<Lab, LabError> {
        let tag = format!("{}{slot}", std::process::id() % 10_000);
        let mut lab = Lab {
            scratch: Scratch::new(&format!("ha-{tag}")),
            counts: PathBuf::new(),
            tag,
            names: Vec::new(),
            children: Vec::new(),
            uas_stdin: None,
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
            ("cli", "hc", "rc", CLIENT, "10.98.1.1"),
            ("a", "ha", "ra", A, "10.98.2.1"),
            ("b", "hb", "rb", B, "10.98.3.1"),
            (
                "svc",
                "hs",
                "rs",
                SERVICES[0].1.split(':').next().unwrap_or(""),
                "10.98.4.1",
            ),
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
        for (_, a) in &SERVICES[1..] {
            let host = a.split(':').next().unwrap_or("");
            ip(&format!(
                "-n {} addr add {host}/24 dev hs{t}",
                lab.ns("svc")
            ))?;
        }
        for inst in ["a", "b"] {
            ip(&format!("-n {} addr add {VIP}/32 dev lo", lab.ns(inst)))?;
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
        lab.route(&[A, B])?;

        let me = std::env::current_exe().map_err(|e| LabError::Failed(e.to_string()))?;
        let mut uas = Command::new("ip")
            .args(["netns", "exec", &lab.ns("svc")])
            .arg(&me)
            .args(["--exact", "helper_ha_uas", "--nocapture"])
            .env(ROLE, "ha-uas")
            .env("FULCRUM_HA_COUNTS", &lab.counts)
            .env(
                "FULCRUM_HA_SICK",
                if gray == Gray::SickS1 { "s1" } else { "" },
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("services role: {e}"))?;
        lab.uas_stdin = uas.stdin.take();
        lab.children.push(("uas".into(), uas));

        let services: String = SERVICES
            .iter()
            .map(|(n, a)| format!("  - {{ name: {n}, address: \"{a}\", protocol: sip-udp }}\n"))
            .collect();
        for (inst, addr) in [("a", A), ("b", B)] {
            let cfg = lab.scratch.path(&format!("{inst}.yaml"));
            // Gray: one file for both instances, each naming its own address through the
            // environment (docs/deployment.md, "Failover in an ECMP pool").
            let failover = match gray {
                Gray::No => "    failover: off\n",
                Gray::SickS1 => "    service_source: \"${FULCRUM_UNICAST}\"\n",
            };
            let yaml = format!(
                "admin: {{ listen: \"{addr}:9090\" }}\nservices:\n{services}vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [\"{VIP}:5060\"]\n    freebind: true\n    advertise: \"{VIP}:5060\"\n    method: call_id_hash\n    record_route: {record_route}\n    workers: 1\n{failover}    services: [s0, s1, s2]\n"
            );
            std::fs::write(&cfg, yaml).map_err(|e| LabError::Failed(e.to_string()))?;
            let log = std::fs::File::create(lab.scratch.path(&format!("{inst}.log")))
                .map_err(|e| LabError::Failed(e.to_string()))?;
            let child = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &lab.ns(inst),
                    env!("CARGO_BIN_EXE_fulcrum"),
                ])
                .args(["run", "--drain-timeout", "1s", "--config"])
                .arg(&cfg)
                .env("RUST_LOG", "info")
                .env("FULCRUM_UNICAST", addr)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .map_err(|e| format!("fulcrum {inst}: {e}"))?;
            lab.children.push((inst.into(), child));
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(lab.ready(A) && lab.ready(B) && lab.counts().len() == SERVICES.len()) {
            if Instant::now() > deadline {
                return Err(LabError::Failed(format!(
                    "instances or services not ready in 10 s (A ready: {}, B ready: {}, logs in {})",
                    lab.ready(A),
                    lab.ready(B),
                    lab.scratch.0.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(lab)
    }

    /// The router's route to the VIP: one nexthop per instance address given.
    fn route(&self, via: &[&str]) -> Result<(), String> {
        let hops: Vec<String> = via
            .iter()
            .map(|h| format!("nexthop via {h} weight 1"))
            .collect();
        ip(&format!(
            "-n {} route replace {VIP}/32 {}",
            self.ns("rtr"),
            hops.join(" ")
        ))
        .map(drop)
    }

    /// `GET /readyz` of the instance at `addr`, from the router (as a route announcer asks).
    fn ready(&self, addr: &str) -> bool {
        run(
            "ip",
            &[
                "netns",
                "exec",
                &self.ns("rtr"),
                "curl",
                "-fsS",
                "-m",
                "1",
                "-o",
                "/dev/null",
                &format!("http://{addr}:9090/readyz"),
            ],
        )
        .is_ok()
    }

    /// `POST /services/NAME/disable` on the instance at `addr`.
    fn disable(&self, addr: &str, service: &str) -> Result<String, String> {
        run(
            "ip",
            &[
                "netns",
                "exec",
                &self.ns("rtr"),
                "curl",
                "-fsS",
                "-m",
                "2",
                "-X",
                "POST",
                &format!("http://{addr}:9090/services/{service}/disable"),
            ],
        )
    }

    /// `fulcrum_sip_failover_total{event="failover"}` of the instance at `addr` (0 when
    /// absent or unreadable).
    fn failovers(&self, addr: &str) -> u64 {
        let text = run(
            "ip",
            &[
                "netns",
                "exec",
                &self.ns("rtr"),
                "curl",
                "-fsS",
                "-m",
                "2",
                &format!("http://{addr}:9090/metrics"),
            ],
        )
        .unwrap_or_default();
        text.lines()
            .filter(|l| {
                l.starts_with("fulcrum_sip_failover_total{") && l.contains("event=\"failover\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// The instance the router sends a client flow from `port` to, as `ip route get` says.
    fn next_hop(&self, port: u16) -> Result<&'static str, String> {
        let out = ip(&format!(
            "-n {} route get {VIP} from {CLIENT} iif rc{} ipproto udp sport {port} dport 5060",
            self.ns("rtr"),
            self.tag
        ))?;
        if out.contains(&format!("via {A} ")) {
            Ok("A")
        } else if out.contains(&format!("via {B} ")) {
            Ok("B")
        } else {
            Err(format!("unexpected route: {out}"))
        }
    }

    /// `n` client ports whose flows the router sends to instance `want` ("A" or "B").
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

    /// SIGKILL one of the processes started (an instance: "a" or "b").
    fn kill(&mut self, name: &str) {
        for (n, c) in &mut self.children {
            if n == name {
                let _ = c.kill();
                let _ = c.wait();
            }
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
        for (n, c) in &mut self.children {
            if n == "uas" {
                let deadline = Instant::now() + Duration::from_secs(5);
                while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                    std::thread::sleep(Duration::from_millis(20));
                }
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
}

fn sum(counts: &[(String, Counts)], f: impl Fn(&Counts) -> u64) -> u64 {
    counts.iter().map(|(_, c)| f(c)).sum()
}

/// SIGKILL instance A under load, then withdraw its nexthop once its `/readyz` has failed
/// three times 250 ms apart (a route announcer's `fall`). Every call set up before the kill
/// ends through B (A's flows move there), no service answers 481 nor sees a stray ACK, and
/// calls placed after the withdrawal all succeed; calls placed between kill and withdrawal
/// are reported.
#[test]
fn ha_kill_one_instance_under_load() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let Some(mut lab) = lab_or_skip("ha_kill_one_instance_under_load", 0, true) else {
        return;
    };
    let scen = lab.scratch.path("uac.xml");
    std::fs::write(&scen, scenario(0, 2000)).expect("scenario");
    let to_a = lab.ports_to("A", 5, 5100).expect("ports to A");
    let to_b = lab.ports_to("B", 3, 5100).expect("ports to B");

    // Before the kill: 4 flows, 2 per instance, 20 calls each over 2 s, held 2 s.
    let (pre_rate, pre_calls) = (10, 20);
    let pre: Vec<Uac> = [
        ("pre-a0", "A", to_a[0]),
        ("pre-a1", "A", to_a[1]),
        ("pre-b0", "B", to_b[0]),
        ("pre-b1", "B", to_b[1]),
    ]
    .into_iter()
    .map(|(l, via, p)| lab.uac(l, via, &scen, p, pre_rate, pre_calls))
    .collect();
    let pre_total = u64::from(pre_calls) * pre.len() as u64;
    assert!(
        lab.wait_dialogs(pre_total, Duration::from_secs(15)),
        "only {} of {pre_total} calls set up before the kill",
        lab.dialogs()
    );
    let killed = Instant::now();
    lab.kill("a");
    // New calls while the route still names A: one flow to each instance.
    let window = [("window-a", "A", to_a[2]), ("window-b", "B", to_b[2])]
        .into_iter()
        .map(|(l, via, p)| lab.uac(l, via, &scen, p, 10, 10))
        .collect::<Vec<_>>();
    let mut fails = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while fails < 3 {
        assert!(Instant::now() < deadline, "A's /readyz kept answering");
        fails = if lab.ready(A) { 0 } else { fails + 1 };
        std::thread::sleep(Duration::from_millis(250));
    }
    lab.route(&[B]).expect("withdraw A");
    let withdrawn = killed.elapsed();
    assert!(lab.ready(B), "B not ready after the withdrawal");
    // After the withdrawal: flows that went to A, now to B.
    let after = [("after-a3", "A", to_a[3]), ("after-a4", "A", to_a[4])]
        .into_iter()
        .map(|(l, via, p)| lab.uac(l, via, &scen, p, 10, 10))
        .collect::<Vec<_>>();

    let pre: Vec<_> = pre.into_iter().map(Uac::finish).collect();
    let window: Vec<_> = window.into_iter().map(Uac::finish).collect();
    let after: Vec<_> = after.into_iter().map(Uac::finish).collect();
    let counts = lab.final_counts();
    println!(
        "A killed; its nexthop withdrawn {} ms later",
        withdrawn.as_millis()
    );
    for (label, via, calls, ok, failed) in pre.iter().chain(&window).chain(&after) {
        println!("{label:10} flow to {via}: {calls} calls, {ok} successful, {failed} failed");
    }
    for (n, c) in &counts {
        println!("{n}: {c:?}");
    }
    let window_failed: u64 = window.iter().map(|w| w.4).sum();
    println!("calls failed between kill and withdrawal: {window_failed}");
    for (label, _, calls, ok, failed) in pre.iter().chain(&after) {
        assert_eq!(
            (*ok, *failed),
            (u64::from(*calls), 0),
            "{label}: (successful, failed); logs in {}",
            lab.scratch.0.display()
        );
    }
    assert_eq!(sum(&counts, |c| c.r481), 0, "481s at the services");
    assert_eq!(
        sum(&counts, |c| c.stray_acks),
        0,
        "stray ACKs at the services"
    );
}

/// Cross view: s0 is disabled on A only. Calls are set up through A (the route names A
/// alone), so A places none on s0; then the route moves to B before their ACKs, and B, where
/// s0 is UP and which never saw these dialogs, must send ACK and BYE to the service that
/// holds each dialog (`fc-svc` in fulcrum's Record-Route, docs/sip.md): hashing the Call-ID
/// again over B's view would pick s0 for about a third of them, which answers 481.
#[test]
fn ha_in_dialog_requests_follow_fc_svc_across_health_views() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let Some(mut lab) = lab_or_skip(
        "ha_in_dialog_requests_follow_fc_svc_across_health_views",
        1,
        true,
    ) else {
        return;
    };
    lab.route(&[A]).expect("route to A");
    let answer = lab.disable(A, "s0").expect("disable s0 on A");
    assert!(answer.contains("OUT_OF_SERVICE"), "{answer}");
    assert!(lab.ready(A) && lab.ready(B), "both instances ready");
    let scen = lab.scratch.path("uac.xml");
    // ACK 3 s after the 200: every call is set up (30 at 30/s) before the first ACK.
    std::fs::write(&scen, scenario(3000, 1000)).expect("scenario");
    let calls = 30;
    let uac = lab.uac("cross", "A then B", &scen, 5100, 30, calls);
    assert!(
        lab.wait_dialogs(u64::from(calls), Duration::from_secs(10)),
        "only {} of {calls} calls set up through A",
        lab.dialogs()
    );
    lab.route(&[B]).expect("route to B");
    let (_, _, _, ok, failed) = uac.finish();
    let counts = lab.final_counts();
    println!(
        "{calls} calls set up through A, ACK and BYE through B: {ok} successful, {failed} failed"
    );
    for (n, c) in &counts {
        println!("{n}: {c:?}");
    }
    assert_eq!(
        sum(&counts, |c| c.r481),
        0,
        "481s at the services: in-dialog requests reached a service without the dialog; logs in {}",
        lab.scratch.0.display()
    );
    assert_eq!(
        sum(&counts, |c| c.stray_acks),
        0,
        "stray ACKs at the services"
    );
    let s0 = counts.iter().find(|(n, _)| n == "s0").map(|(_, c)| *c);
    assert_eq!(
        s0.map(|c| c.requests),
        Some(0),
        "s0 (disabled on A) got requests"
    );
    assert_eq!((ok, failed), (u64::from(calls), 0), "(successful, failed)");
}

/// Failover in an ECMP pool: both instances run one file with `service_source:
/// "${FULCRUM_UNICAST}"`, so each sends to the services from its own address and gets their
/// answers there, though the router would hand a service's answers to the VIP to one instance
/// only. s1 answers every INVITE 503 (its OPTIONS 200): flows through A and through B lose no
/// call, s1 sets up none, and both instances moved INVITEs on (their failover counters).
#[test]
fn ha_both_instances_fail_over_with_their_own_service_source() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let Some(mut lab) = lab_or_skip_with(
        "ha_both_instances_fail_over_with_their_own_service_source",
        2,
        true,
        Gray::SickS1,
    ) else {
        return;
    };
    let scen = lab.scratch.path("uac.xml");
    std::fs::write(&scen, scenario(0, 500)).expect("scenario");
    let to_a = lab.ports_to("A", 2, 5100).expect("ports to A");
    let to_b = lab.ports_to("B", 2, 5100).expect("ports to B");
    let calls = 30;
    let uacs: Vec<Uac> = [
        ("a0", "A", to_a[0]),
        ("a1", "A", to_a[1]),
        ("b0", "B", to_b[0]),
        ("b1", "B", to_b[1]),
    ]
    .into_iter()
    .map(|(l, via, p)| lab.uac(l, via, &scen, p, 10, calls))
    .collect();
    let done: Vec<_> = uacs.into_iter().map(Uac::finish).collect();
    let failovers = [A, B].map(|addr| lab.failovers(addr));
    let counts = lab.final_counts();
    for (label, via, calls, ok, failed) in &done {
        println!("{label} flow to {via}: {calls} calls, {ok} successful, {failed} failed");
    }
    for (n, c) in &counts {
        println!("{n}: {c:?}");
    }
    println!("INVITEs moved on: A {}, B {}", failovers[0], failovers[1]);
    for (label, _, calls, ok, failed) in &done {
        assert_eq!(
            (*ok, *failed),
            (u64::from(*calls), 0),
            "{label}: (successful, failed); logs in {}",
            lab.scratch.0.display()
        );
    }
    assert_eq!(sum(&counts, |c| c.r481), 0, "481s at the services");
    assert_eq!(sum(&counts, |c| c.stray_acks), 0, "stray ACKs");
    let s1 = counts.iter().find(|(n, _)| n == "s1").map(|(_, c)| *c);
    assert_eq!(s1.map(|c| c.byes_ok), Some(0), "the sick s1 set up calls");
    assert!(
        s1.is_some_and(|c| c.invites > 0),
        "s1 got no INVITE: the test shows nothing"
    );
    assert!(
        failovers.iter().all(|&f| f > 0),
        "each instance moved INVITEs on from s1: A {}, B {}",
        failovers[0],
        failovers[1]
    );
}
