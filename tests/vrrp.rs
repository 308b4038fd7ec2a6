//! Two fulcrum instances behind a VRRP address (RFC 5798) that Debian's keepalived moves
//! (docs/deployment.md, "Active/standby with a VIP"), in network namespaces the test builds,
//! all on one Ethernet segment (a bridge in its own namespace):
//!
//! ```text
//!  client (SIPp UACs)   node a: fulcrum + keepalived   node b: fulcrum + keepalived   services
//!  10.97.0.2            10.97.0.11                      10.97.0.12                      10.97.0.21-22
//!      └────────────────────────────── bridge (namespace `br`) ───────────────────────────┘
//!                      VIP 10.97.0.100/24 on whichever node keepalived makes MASTER
//! ```
//!
//! Each node runs fulcrum with the same file (a sip-udp and a sip-tcp vserver on the VIP with
//! `freebind: true`, `call_id_hash`, `record_route: true`, admin on 127.0.0.1:9090) and
//! keepalived with `packaging/keepalived.conf` itself, only its marked values replaced
//! (interface, VIP, priority): its `vrrp_script` polls `/readyz` and a failing check puts the
//! node in FAULT, which gives the VIP away. The services are [`common::strict_uas`] over UDP
//! (481 to a BYE for a dialog they did not set up), run in their namespace by this test binary
//! (`helper_vrrp_uas`), which writes their counts to a file the test reads.
//!
//! Needs root, `ip`, `curl`, `timeout`, SIPp and keepalived. Without root or namespaces the
//! tests print why and pass without running (`FULCRUM_REQUIRE_NETNS=1` makes that a failure);
//! without keepalived likewise (`FULCRUM_REQUIRE_KEEPALIVED=1`); without SIPp likewise
//! (`FULCRUM_REQUIRE_SIPP=1`). Every wait is bounded; namespaces and processes are removed by
//! a guard on every exit path (keepalived with SIGTERM first, so it takes its VRRP child
//! process and the VIP with it).

mod common;

use common::netns::ROLE;
use common::sipp::{Proc, Scratch, sipp_available, uac_counts};
use common::strict_uas::{Counts, StrictUas, read_counts, report_counts_until_stdin_closes};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const VIP: &str = "10.97.0.100";
const CLIENT: &str = "10.97.0.2";
/// (node, its address, keepalived priority): 100 on one node, 90 on the other, as
/// packaging/keepalived.conf says.
const NODES: [(&str, &str, u32); 2] = [("a", "10.97.0.11", 100), ("b", "10.97.0.12", 90)];
const SERVICES: [(&str, &str); 2] = [("s0", "10.97.0.21:5060"), ("s1", "10.97.0.22:5060")];
/// The shipped example, used as is but for the values it marks CHANGE.
const KEEPALIVED_CONF: &str = include_str!("../packaging/keepalived.conf");

/// Services role: the strict UAS on their addresses; their counts are written to
/// `FULCRUM_VRRP_COUNTS` (one line per UAS: name requests dialogs byes_ok r481 stray_acks
/// invites) every 50 ms and once more when stdin closes, which ends the role.
#[test]
fn helper_vrrp_uas() {
    if std::env::var(ROLE).as_deref() != Ok("vrrp-uas") {
        return;
    }
    let out = PathBuf::from(std::env::var("FULCRUM_VRRP_COUNTS").expect("counts file"));
    let uas: Vec<StrictUas> = SERVICES
        .iter()
        .map(|(n, a)| StrictUas::udp_at(n, a.parse().expect("service address")))
        .collect();
    report_counts_until_stdin_closes(&uas, &out);
}

/// The directory holding `program` on PATH or in the sbin directories (keepalived lives in
/// /usr/sbin, which a non-login PATH may lack).
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
    let Some(keepalived) = find_program("keepalived") else {
        return skip(
            "FULCRUM_REQUIRE_KEEPALIVED",
            "keepalived is not installed (apt-get install keepalived)".into(),
        );
    };
    for tool in ["curl", "timeout"] {
        assert!(
            find_program(tool).is_some(),
            "{name}: `{tool}` is not on PATH"
        );
    }
    if !sipp_available() {
        return None;
    }
    match Lab::start(slot, drain_timeout, &keepalived) {
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

/// `packaging/keepalived.conf` for one node: each value the file marks CHANGE replaced, and
/// each of them required to be there as shipped, so the example cannot drift from this test.
fn keepalived_conf(iface: &str, priority: u32) -> Result<String, String> {
    let mut text = KEEPALIVED_CONF.to_owned();
    for (shipped, ours) in [
        ("interface eth0", format!("interface {iface}")),
        ("dev eth0", format!("dev {iface}")),
        ("198.51.100.10/24", format!("{VIP}/24")),
        ("priority 100", format!("priority {priority}")),
        (
            "http://127.0.0.1:9090/readyz",
            "http://127.0.0.1:9090/readyz".into(),
        ),
    ] {
        if text.matches(shipped).count() != 1 {
            return Err(format!(
                "packaging/keepalived.conf: expected `{shipped}` exactly once (tests/vrrp.rs fills it in)"
            ));
        }
        text = text.replace(shipped, &ours);
    }
    Ok(text)
}

/// The SIPp UAC scenario: INVITE; 100 / 180 optional; 200 (its Record-Route set kept); ACK;
/// `hold_ms`; BYE; 200. ACK and BYE go to the 200's Contact with the Record-Route set as Route
/// (RFC 3261 §12.1.2, §12.2.1.1), through the VIP. Over UDP requests are retransmitted from
/// 500 ms (Timer A / E), so a request lost while the VIP moves is sent again.
fn scenario(hold_ms: u32) -> String {
    let headers = |cseq: &str, extra: &str| {
        format!(
            "      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]\n\
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]\n\
      To: uas <sip:uas@[remote_ip]:[remote_port]>{extra}\n\
      Call-ID: [call_id]\n\
      CSeq: {cseq}\n\
      Contact: <sip:sipp@[local_ip]:[local_port];transport=[transport]>\n\
      Max-Forwards: 70\n\
      Content-Length: 0\n"
        )
    };
    format!(
        "<?xml version=\"1.0\" encoding=\"ISO-8859-1\" ?>\n\
<scenario name=\"vrrp uac\">\n\
  <send retrans=\"500\"><![CDATA[\n\
      INVITE sip:uas@[remote_ip]:[remote_port];transport=[transport] SIP/2.0\n{invite}\n    ]]></send>\n\
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

/// One SIPp UAC in the client namespace to the VIP.
struct Uac {
    label: String,
    calls: u32,
    proc: Proc,
    stat: PathBuf,
}

impl Uac {
    /// Wait (bounded) for the end; (label, calls, successful, failed).
    fn finish(mut self) -> (String, u32, u64, u64) {
        self.proc.wait_for(Duration::from_secs(45));
        let (ok, failed) = uac_counts(&self.stat);
        (self.label, self.calls, ok, failed)
    }
}

/// The namespaces, processes and files of one run; all removed when dropped.
struct Lab {
    tag: String,
    names: Vec<String>,
    /// fulcrum and the services role, by name ("fulcrum-a", "uas").
    children: Vec<(String, Child)>,
    /// keepalived per node, ended with SIGTERM (then SIGKILL) before the namespaces go.
    keepalived: Vec<(String, Child)>,
    /// The services role's stdin: dropping it ends the role.
    uas_stdin: Option<std::process::ChildStdin>,
    scratch: Scratch,
    counts: PathBuf,
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
        for (_, c) in &mut self.keepalived {
            terminate(c, Duration::from_secs(3));
        }
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
        format!("fcv-{role}-{}", self.tag)
    }

    /// Build the namespaces and the bridge, the UAS, both fulcrum instances (ready) and both
    /// keepalived daemons, and wait until one node holds the VIP.
    fn start(slot: u32, drain_timeout: &str, keepalived: &Path) -> Result<Lab, LabError> {
        let tag = format!("{}{slot}", std::process::id() % 10_000);
        let mut lab = Lab {
            scratch: Scratch::new(&format!("vrrp-{tag}")),
            counts: PathBuf::new(),
            tag,
            names: Vec::new(),
            children: Vec::new(),
            keepalived: Vec::new(),
            uas_stdin: None,
        };
        lab.counts = lab.scratch.path("uas-counts.txt");
        let t = lab.tag.clone();
        for role in ["br", "cli", "a", "b", "svc"] {
            let n = lab.ns(role);
            match ip(&format!("netns add {n}")) {
                // The first namespace is the probe: refused, there are none to be had here.
                Err(e) if lab.names.is_empty() => return Err(LabError::NoNetns(e)),
                r => r?,
            };
            lab.names.push(n.clone());
            ip(&format!("-n {n} link set lo up"))?;
        }
        let br = lab.ns("br");
        ip(&format!("-n {br} link add br0 type bridge"))?;
        ip(&format!("-n {br} link set br0 up"))?;
        let (svc0, svc1) = (host(SERVICES[0].1), host(SERVICES[1].1));
        let hosts = [
            ("cli", vec![CLIENT]),
            ("a", vec![NODES[0].1]),
            ("b", vec![NODES[1].1]),
            ("svc", vec![svc0, svc1]),
        ];
        for (role, addrs) in hosts {
            let n = lab.ns(role);
            let (end, port) = (lab.iface(role), format!("p{role}{t}"));
            ip(&format!(
                "link add {end} netns {n} type veth peer name {port} netns {br}"
            ))?;
            ip(&format!("-n {br} link set {port} master br0"))?;
            ip(&format!("-n {br} link set {port} up"))?;
            for a in addrs {
                ip(&format!("-n {n} addr add {a}/24 dev {end}"))?;
            }
            ip(&format!("-n {n} link set {end} up"))?;
        }

        let me = std::env::current_exe().map_err(|e| LabError::Failed(e.to_string()))?;
        let mut uas = Command::new("ip")
            .args(["netns", "exec", &lab.ns("svc")])
            .arg(&me)
            .args(["--exact", "helper_vrrp_uas", "--nocapture"])
            .env(ROLE, "vrrp-uas")
            .env("FULCRUM_VRRP_COUNTS", &lab.counts)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("services role: {e}"))?;
        lab.uas_stdin = uas.stdin.take();
        lab.children.push(("uas".into(), uas));

        // One file for both nodes (docs/deployment.md): the VIP bound on both, freebind.
        let services: String = SERVICES
            .iter()
            .map(|(n, a)| format!("  - {{ name: {n}, address: \"{a}\", protocol: sip-udp }}\n"))
            .collect();
        let vserver = |name: &str, protocol: &str| {
            format!(
                "  - name: {name}\n    protocol: {protocol}\n    bind: [\"{VIP}:5060\"]\n    freebind: true\n    method: call_id_hash\n    record_route: true\n    services: [s0, s1]\n"
            )
        };
        let yaml = format!(
            "admin: {{ listen: \"127.0.0.1:9090\" }}\nservices:\n{services}vservers:\n{}{}",
            vserver("vu", "sip-udp"),
            vserver("vt", "sip-tcp")
        );
        let cfg = lab.scratch.path("fulcrum.yaml");
        std::fs::write(&cfg, yaml).map_err(|e| LabError::Failed(e.to_string()))?;
        for (node, _, _) in NODES {
            lab.start_fulcrum(node, &cfg, drain_timeout)?;
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        while !(NODES.iter().all(|(n, _, _)| lab.ready(n)) && lab.counts().len() == SERVICES.len())
        {
            if Instant::now() > deadline {
                let log = |n: &str| {
                    std::fs::read_to_string(lab.scratch.path(&format!("fulcrum-{n}.log")))
                        .unwrap_or_default()
                };
                return Err(LabError::Failed(format!(
                    "instances or services not ready in 15 s: ready a {} b {}, services counted {} of {}; fulcrum a:\n{}\nfulcrum b:\n{}",
                    lab.ready("a"),
                    lab.ready("b"),
                    lab.counts().len(),
                    SERVICES.len(),
                    log("a"),
                    log("b"),
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }

        for (node, _, priority) in NODES {
            let conf = lab.scratch.path(&format!("keepalived-{node}.conf"));
            std::fs::write(&conf, keepalived_conf(&lab.iface(node), priority)?)
                .map_err(|e| LabError::Failed(e.to_string()))?;
            let log = std::fs::File::create(lab.scratch.path(&format!("keepalived-{node}.log")))
                .map_err(|e| LabError::Failed(e.to_string()))?;
            let pid = |f: &str| lab.scratch.path(&format!("keepalived-{node}-{f}.pid"));
            // Two daemons on one host: each its own config, pid files (-p main, -r VRRP
            // child, -c checker child), in the foreground (-n) logging to the console (-l),
            // VRRP only (-P).
            let child = Command::new("ip")
                .args(["netns", "exec", &lab.ns(node)])
                .arg(keepalived)
                .args(["-n", "-l", "-D", "-P", "-f"])
                .arg(&conf)
                .arg("-p")
                .arg(pid("main"))
                .arg("-r")
                .arg(pid("vrrp"))
                .arg("-c")
                .arg(pid("checkers"))
                .stdin(Stdio::null())
                .stdout(
                    log.try_clone()
                        .map_err(|e| LabError::Failed(e.to_string()))?,
                )
                .stderr(log)
                .spawn()
                .map_err(|e| format!("keepalived {node}: {e}"))?;
            lab.keepalived.push((node.into(), child));
        }
        // RFC 5798 §6.4.2: a backup becomes master after Master_Down_Interval (3 s and a skew
        // at advert_int 1) without advertisements.
        lab.wait_master(None, Duration::from_secs(15))?;
        Ok(lab)
    }

    /// The veth end of `role` inside its namespace.
    fn iface(&self, role: &str) -> String {
        format!("e{role}{}", self.tag)
    }

    fn start_fulcrum(&mut self, node: &str, cfg: &Path, drain_timeout: &str) -> Result<(), String> {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.scratch.path(&format!("fulcrum-{node}.log")))
            .map_err(|e| e.to_string())?;
        let child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns(node),
                env!("CARGO_BIN_EXE_fulcrum"),
            ])
            .args(["run", "--drain-timeout", drain_timeout, "--config"])
            .arg(cfg)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("fulcrum {node}: {e}"))?;
        self.children.push((format!("fulcrum-{node}"), child));
        Ok(())
    }

    /// `GET /readyz` of the fulcrum on `node`, from its own namespace (as keepalived asks).
    fn ready(&self, node: &str) -> bool {
        self.admin(node, "readyz")
    }

    /// Whether `GET /PATH` of the fulcrum on `node` answers 2xx.
    fn admin(&self, node: &str, path: &str) -> bool {
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
                "-o",
                "/dev/null",
                &format!("http://127.0.0.1:9090/{path}"),
            ],
        )
        .is_ok()
    }

    /// Whether `node` holds the VIP on its interface.
    fn holds_vip(&self, node: &str) -> bool {
        ip(&format!("-n {} -4 -o addr show", self.ns(node)))
            .is_ok_and(|out| out.contains(&format!(" {VIP}/")))
    }

    /// Wait (at most `limit`) until exactly one node, other than `not`, holds the VIP; its name.
    fn wait_master(&self, not: Option<&str>, limit: Duration) -> Result<&'static str, String> {
        let deadline = Instant::now() + limit;
        loop {
            let holders: Vec<&'static str> = NODES
                .iter()
                .map(|(n, _, _)| *n)
                .filter(|n| self.holds_vip(n))
                .collect();
            if let [one] = holders[..]
                && Some(one) != not
            {
                return Ok(one);
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "no single VRRP master{} within {} s (holders: {holders:?}; logs in {})",
                    not.map(|n| format!(" other than {n}")).unwrap_or_default(),
                    limit.as_secs(),
                    self.scratch.0.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn child(&mut self, name: &str) -> Option<&mut Child> {
        self.children
            .iter_mut()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c)
    }

    /// Start a SIPp UAC from `port` over `transport` ("u1" or "t1"): `calls` calls at
    /// `rate_per_s`, with `scenario`.
    fn uac(
        &self,
        label: &str,
        transport: &str,
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
                .args(["-i", CLIENT, "-p", &port.to_string(), "-t", transport])
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

    /// The keepalived log of `node`, for a failure message.
    fn keepalived_log(&self, node: &str) -> String {
        std::fs::read_to_string(self.scratch.path(&format!("keepalived-{node}.log")))
            .unwrap_or_default()
    }
}

/// The address part of `host:port`.
fn host(addr: &str) -> &str {
    addr.split(':').next().unwrap_or(addr)
}

fn other(node: &str) -> &'static str {
    if node == "a" { "b" } else { "a" }
}

fn sum(counts: &[(String, Counts)], f: impl Fn(&Counts) -> u64) -> u64 {
    counts.iter().map(|(_, c)| f(c)).sum()
}

/// Calls over sip-udp and sip-tcp through the VIP: all must succeed. (label, calls, ok, failed).
fn calls_succeed(lab: &Lab, scen: &Path, label: &str, port: u16) {
    let uacs = [
        lab.uac(&format!("{label}-udp"), "u1", scen, port, 20, 20),
        lab.uac(&format!("{label}-tcp"), "t1", scen, port + 1, 20, 20),
    ];
    for (label, calls, ok, failed) in uacs.map(Uac::finish) {
        println!("{label:12}: {calls} calls, {ok} successful, {failed} failed");
        assert_eq!(
            (ok, failed),
            (u64::from(calls), 0),
            "{label}: (successful, failed); logs in {}",
            lab.scratch.0.display()
        );
    }
}

/// SIGKILL the MASTER's fulcrum: its `/readyz` stops answering, its keepalived goes to FAULT
/// after `fall` checks and the other node takes the VIP (measured from the kill). New calls over
/// sip-udp and sip-tcp then succeed through the other instance; calls set up through the
/// killed one (record-routed, held across the move) are ended by their BYE through the other
/// instance, which routes it to the same service by the same hash (no 481 at any service).
#[test]
fn vrrp_killed_fulcrum_gives_the_vip_away_and_dialogs_end_through_the_other() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let name = "vrrp_killed_fulcrum_gives_the_vip_away_and_dialogs_end_through_the_other";
    let Some(mut lab) = lab_or_skip(name, 0, "1s") else {
        return;
    };
    let master = lab
        .wait_master(None, Duration::from_secs(1))
        .unwrap_or_else(|e| panic!("{e}"));
    let quick = lab.scratch.path("quick.xml");
    std::fs::write(&quick, scenario(200)).expect("scenario");
    let held = lab.scratch.path("held.xml");
    // Held 6 s: every BYE is sent after the VIP has moved (about 2-3 s after the kill).
    std::fs::write(&held, scenario(6000)).expect("scenario");
    calls_succeed(&lab, &quick, "before", 5100);

    let pre_calls = 20;
    let pre = lab.uac("held-udp", "u1", &held, 5110, 20, pre_calls);
    let pre_total = lab.dialogs() + u64::from(pre_calls);
    assert!(
        lab.wait_dialogs(pre_total, Duration::from_secs(10)),
        "only {} of {pre_total} dialogs set up before the kill",
        lab.dialogs()
    );
    let byes_before = sum(&lab.counts(), |c| c.byes_ok);
    let killed = Instant::now();
    if let Some(c) = lab.child(&format!("fulcrum-{master}")) {
        let _ = c.kill();
        let _ = c.wait();
    }
    // Calls placed from the moment of the kill, across the move: reported, retransmitted
    // INVITEs reach the new master.
    let during = lab.uac("during-udp", "u1", &quick, 5120, 10, 40);
    let new_master = lab
        .wait_master(Some(master), Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}\nkeepalived {master}:\n{}", lab.keepalived_log(master)));
    let moved = killed.elapsed();
    assert_eq!(new_master, other(master));
    println!(
        "fulcrum on {master} killed; the VIP on {new_master} {} ms later",
        moved.as_millis()
    );
    assert!(
        lab.keepalived_log(master).contains("Entering FAULT STATE"),
        "keepalived {master} did not go to FAULT:\n{}",
        lab.keepalived_log(master)
    );
    calls_succeed(&lab, &quick, "after", 5130);
    let first_after = killed.elapsed();
    let (label, calls, ok, failed) = pre.finish();
    let (dlabel, dcalls, dok, dfailed) = during.finish();
    let counts = lab.final_counts();
    println!(
        "{label:12}: {calls} calls set up through {master}, ended through {new_master}: {ok} successful, {failed} failed"
    );
    println!(
        "{dlabel:12}: {dcalls} calls placed from the kill on: {dok} successful, {dfailed} failed"
    );
    println!(
        "40 new calls (sip-udp and sip-tcp) through {new_master} done {} ms after the kill",
        first_after.as_millis()
    );
    for (n, c) in &counts {
        println!("{n}: {c:?}");
    }
    assert!(
        moved < Duration::from_secs(5),
        "the VIP moved {} ms after the kill (advert_int 1, interval 1, fall 2: within 5 s)",
        moved.as_millis()
    );
    assert_eq!(
        (ok, failed),
        (u64::from(calls), 0),
        "{label}: (successful, failed); logs in {}",
        lab.scratch.0.display()
    );
    assert!(
        sum(&counts, |c| c.byes_ok) >= byes_before + u64::from(pre_calls),
        "the services did not end the held dialogs"
    );
    assert_eq!(sum(&counts, |c| c.r481), 0, "481s at the services");
    assert_eq!(
        sum(&counts, |c| c.stray_acks),
        0,
        "stray ACKs at the services"
    );
}

/// SIGTERM the MASTER's fulcrum (`systemctl stop`): its `/readyz` turns 503 at once, keepalived
/// gives the VIP away, and only then, at the end of `--drain-timeout`, does the instance stop
/// answering: when the VIP arrives at the other node the draining one still answers
/// `/healthz`, and it exits later. Held dialogs end through the other instance; new calls
/// succeed there.
#[test]
fn vrrp_draining_fulcrum_gives_the_vip_away_before_it_stops_answering() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let name = "vrrp_draining_fulcrum_gives_the_vip_away_before_it_stops_answering";
    let Some(mut lab) = lab_or_skip(name, 1, "8s") else {
        return;
    };
    let master = lab
        .wait_master(None, Duration::from_secs(1))
        .unwrap_or_else(|e| panic!("{e}"));
    let quick = lab.scratch.path("quick.xml");
    std::fs::write(&quick, scenario(200)).expect("scenario");
    let held = lab.scratch.path("held.xml");
    std::fs::write(&held, scenario(6000)).expect("scenario");

    let pre_calls = 20;
    let pre = lab.uac("held-udp", "u1", &held, 5110, 20, pre_calls);
    assert!(
        lab.wait_dialogs(u64::from(pre_calls), Duration::from_secs(10)),
        "only {} of {pre_total} dialogs set up before the stop",
        lab.dialogs(),
        pre_total = pre_calls
    );
    let stopped = Instant::now();
    let pid = lab
        .child(&format!("fulcrum-{master}"))
        .map(|c| c.id())
        .expect("the master's fulcrum");
    run("kill", &["-TERM", &pid.to_string()]).expect("SIGTERM");
    let new_master = lab
        .wait_master(Some(master), Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}\nkeepalived {master}:\n{}", lab.keepalived_log(master)));
    let moved = stopped.elapsed();
    let still_live = lab.admin(master, "healthz");
    let still_ready = lab.ready(master);
    let exit_limit = Duration::from_secs(20);
    let exited = loop {
        let done = lab
            .child(&format!("fulcrum-{master}"))
            .is_none_or(|c| !matches!(c.try_wait(), Ok(None)));
        if done {
            break stopped.elapsed();
        }
        assert!(
            stopped.elapsed() < exit_limit,
            "the draining fulcrum did not exit within {} s",
            exit_limit.as_secs()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    calls_succeed(&lab, &quick, "after", 5130);
    let (label, calls, ok, failed) = pre.finish();
    let counts = lab.final_counts();
    println!(
        "fulcrum on {master} sent SIGTERM; the VIP on {new_master} {} ms later; the instance exited {} ms after the SIGTERM",
        moved.as_millis(),
        exited.as_millis()
    );
    println!(
        "{label:12}: {calls} calls set up through {master}, ended through {new_master}: {ok} successful, {failed} failed"
    );
    for (n, c) in &counts {
        println!("{n}: {c:?}");
    }
    assert!(
        still_live && !still_ready,
        "when the VIP moved, the draining instance answered /healthz: {still_live} (want true), /readyz 200: {still_ready} (want false)"
    );
    assert!(
        moved < exited,
        "the VIP moved ({} ms) after the instance stopped ({} ms)",
        moved.as_millis(),
        exited.as_millis()
    );
    assert!(
        moved < Duration::from_secs(5),
        "the VIP moved {} ms after the SIGTERM",
        moved.as_millis()
    );
    assert_eq!(
        (ok, failed),
        (u64::from(calls), 0),
        "{label}: (successful, failed); logs in {}",
        lab.scratch.0.display()
    );
    assert_eq!(sum(&counts, |c| c.r481), 0, "481s at the services");
    assert_eq!(
        sum(&counts, |c| c.stray_acks),
        0,
        "stray ACKs at the services"
    );
}
