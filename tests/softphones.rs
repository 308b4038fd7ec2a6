//! Real softphones through fulcrum (docs/clients.md): Debian's baresip (`baresip-core`, driven
//! over its `ctrl_tcp` module) and linphone (`linphone-cli`: `linphonec`, driven on its
//! stdin) register through fulcrum to a Kamailio registrar, call each other both ways, put the
//! call on hold and take it back (re-INVITEs with `sendonly` / `sendrecv`) from each side, and
//! hang up, over UDP, TCP and TLS, all on loopback:
//!
//! ```text
//!  baresip alice 127.0.0.2 ─┐                          ┌─ Kamailio 127.0.0.1:K (registrar with
//!                           ├── fulcrum 127.0.0.1 ─────┤   Path, record-routing proxy; UDP, TCP)
//!  linphonec bob 127.0.0.3 ─┘  sip-udp, sip-tcp,       │
//!                              sip-tls vservers        └─ back to the callee along the Path
//! ```
//!
//! fulcrum's vservers add Path (`path: always`) and Record-Route; the sip-tls one bridges to
//! Kamailio over TCP. Kamailio refuses any request that does not come from fulcrum's address
//! (403) and relays none whose next hop is not fulcrum (500): every request of every call
//! crosses fulcrum twice, on the way to the registrar and on the way to the callee. The phones
//! send their audio to each other directly (a WAV file as the source, no sound card).
//!
//! Needs Kamailio, baresip and linphonec; without one, a test prints why and passes, unless
//! `FULCRUM_REQUIRE_KAMAILIO=1`, `FULCRUM_REQUIRE_BARESIP=1` or `FULCRUM_REQUIRE_LINPHONE=1`
//! (CI). Every wait is bounded; the processes are ended by guards on every exit path.

mod common;

use common::ConfigFile;
use common::sipp::{Proc, Scratch, Transport, spawn_listening};
use common::tls::Ca;
use fulcrum::ops::Ops;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

const ALICE_IP: &str = "127.0.0.2";
const BOB_IP: &str = "127.0.0.3";
/// How long a phone may take for one step (a registration, an answer, a re-INVITE).
const STEP: Duration = Duration::from_secs(10);

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
}

/// Whether both phones and Kamailio are here; a failure under the `FULCRUM_REQUIRE_*`
/// variables, a printed skip otherwise.
fn phones_available(name: &str) -> bool {
    if !common::kamailio_available() {
        return false;
    }
    for (program, var, package) in [
        ("baresip", "FULCRUM_REQUIRE_BARESIP", "baresip-core"),
        ("linphonec", "FULCRUM_REQUIRE_LINPHONE", "linphone-cli"),
    ] {
        if !on_path(program) {
            assert!(
                std::env::var(var).as_deref() != Ok("1"),
                "{name}: {program} is not on PATH (apt-get install {package}), and {var}=1"
            );
            println!(
                "SKIP {name}: {program} is not on PATH (apt-get install {package}; {var}=1 makes this a failure)"
            );
            return false;
        }
    }
    true
}

/// A port free on `ip` for TCP and UDP a moment ago (a candidate: the phone that takes it
/// fails loudly if another process took it first).
fn free_port(ip: &str) -> u16 {
    for _ in 0..50 {
        let Ok(l) = TcpListener::bind((ip, 0)) else {
            continue;
        };
        let Ok(port) = l.local_addr().map(|a| a.port()) else {
            continue;
        };
        if std::net::UdpSocket::bind((ip, port)).is_ok() {
            return port;
        }
    }
    panic!("no free port on {ip}");
}

/// The registrar and proxy: `save` with Path (stored whatever the REGISTER's Supported says),
/// `lookup` (a call to a user goes along its Path, to fulcrum), `record_route`, `loose_route`
/// for in-dialog requests. On a stream, `force_tcp_alias()` lets Kamailio send requests for
/// fulcrum's address (the Path and Record-Route name it) back over the connection fulcrum
/// opened, so fulcrum sees them come from its service (docs/clients.md says why).
fn kamailio_cfg(port: u16) -> String {
    format!(
        "#!KAMAILIO\ndebug=1\nlog_stderror=yes\nfork=yes\nchildren=2\n\
         listen=udp:127.0.0.1:{port}\nlisten=tcp:127.0.0.1:{port}\ntcp_children=2\n\
         auto_aliases=no\ndns=no\nrev_dns=no\n\
         mpath=\"/usr/lib/x86_64-linux-gnu/kamailio/modules/\"\n\
         loadmodule \"kex.so\"\nloadmodule \"tm.so\"\nloadmodule \"sl.so\"\nloadmodule \"rr.so\"\n\
         loadmodule \"pv.so\"\nloadmodule \"textops.so\"\nloadmodule \"siputils.so\"\n\
         loadmodule \"usrloc.so\"\nloadmodule \"registrar.so\"\n\
         modparam(\"usrloc\", \"db_mode\", 0)\n\
         modparam(\"registrar\", \"use_path\", 1)\nmodparam(\"registrar\", \"path_mode\", 0)\n\
         request_route {{\n\
           if ($si != \"127.0.0.1\") {{ sl_send_reply(\"403\", \"Only through fulcrum\"); exit; }}\n\
           if (proto == TCP) {{ force_tcp_alias(); }}\n\
           if (has_totag()) {{\n\
             if (loose_route()) {{ route(RELAY); exit; }}\n\
             if (is_method(\"ACK\")) {{ if (t_check_trans()) {{ t_relay(); }} exit; }}\n\
             sl_send_reply(\"404\", \"Not here\"); exit;\n\
           }}\n\
           if (is_method(\"CANCEL\")) {{ if (t_check_trans()) {{ t_relay(); }} exit; }}\n\
           if (is_method(\"REGISTER\")) {{ if (!save(\"location\")) {{ sl_reply_error(); }} exit; }}\n\
           if (is_method(\"OPTIONS\") && uri == myself) {{ sl_send_reply(\"200\", \"OK\"); exit; }}\n\
           if (!lookup(\"location\")) {{ sl_send_reply(\"404\", \"Not Found\"); exit; }}\n\
           record_route();\n\
           route(RELAY);\n\
         }}\n\
         route[RELAY] {{\n\
           if ($du == $null || $(du{{uri.host}}) != \"127.0.0.1\") {{\n\
             if (!is_method(\"ACK\")) {{ sl_send_reply(\"500\", \"Next hop is not fulcrum\"); }}\n\
             exit;\n\
           }}\n\
           if (!t_relay()) {{ sl_reply_error(); }}\n\
         }}\n"
    )
}

/// Prometheus series of one family for one vserver: (label value, count).
type Series = Vec<(String, u64)>;

/// Kamailio, fulcrum and the files of one run.
struct Lab {
    _kamailio: Proc,
    fulcrum: Arc<Ops>,
    /// Where each transport's vserver listens.
    udp: SocketAddr,
    tcp: SocketAddr,
    tls: SocketAddr,
    /// The CA that signed fulcrum's certificate, and one that did not.
    ca: PathBuf,
    other_ca: PathBuf,
    scratch: Scratch,
    _files: ConfigFile,
}

impl Lab {
    fn start(tag: &str) -> Lab {
        let scratch = Scratch::new(&format!("phones-{tag}"));
        let (kamailio, port) = spawn_listening("kamailio", Transport::Udp, |port| {
            let cfg = scratch.path(&format!("kamailio-{port}.cfg"));
            std::fs::write(&cfg, kamailio_cfg(port)).expect("write kamailio config");
            let mut c = Command::new("kamailio");
            c.arg("-f").arg(cfg).args(["-DD", "-E"]);
            c
        });
        let files = ConfigFile::new(&format!("phones-{tag}"), "");
        let ca = Ca::new("fulcrum softphones test CA");
        let ca_path = ca.write(&files, "ca.crt");
        let other_ca = Ca::new("a CA fulcrum's certificate is not from").write(&files, "other.crt");
        // linphone (mbedTLS) matches the name it dialled against the certificate's DNS names
        // and common name; rustls and others against IP addresses: all of them here.
        let cert = ca.issue_for(&files, "sip", &["127.0.0.1", "localhost"], "127.0.0.1");
        let vserver = |name: &str, protocol: &str, service: &str, extra: &str| {
            format!(
                "  - name: {name}\n    protocol: {protocol}\n    bind: [\"127.0.0.1:0\"]\n    record_route: true\n    path: always\n{extra}    services: [{service}]\n"
            )
        };
        let yaml = format!(
            "services:\n  - {{ name: ku, address: \"127.0.0.1:{port}\", protocol: sip-udp }}\n  - {{ name: kt, address: \"127.0.0.1:{port}\", protocol: sip-tcp }}\nvservers:\n{}{}{}",
            vserver("vu", "sip-udp", "ku", ""),
            vserver("vt", "sip-tcp", "kt", ""),
            vserver(
                "vs",
                "sip-tls",
                "kt",
                &format!(
                    "    tls: {{ cert: \"{}\", key: \"{}\" }}\n",
                    cert.cert_path.display(),
                    cert.key_path.display()
                )
            ),
        );
        files.write(&yaml);
        let ops = common::tls::start(&files);
        Lab {
            udp: common::tls::addr(&ops, "vu"),
            tcp: common::tls::addr(&ops, "vt"),
            tls: common::tls::addr(&ops, "vs"),
            _kamailio: kamailio,
            fulcrum: ops,
            ca: ca_path,
            other_ca,
            scratch,
            _files: files,
        }
    }

    /// fulcrum's vserver for `transport` ("udp", "tcp", "tls").
    fn proxy(&self, transport: &str) -> SocketAddr {
        match transport {
            "udp" => self.udp,
            "tcp" => self.tcp,
            _ => self.tls,
        }
    }

    /// `fulcrum_sip_messages_total` of vserver `vserver`, by kind, and
    /// `fulcrum_sip_replies_total` by code (what fulcrum answered itself).
    fn sip_counts(&self, vserver: &str) -> (Series, Series) {
        let text = common::tls::metrics(&self.fulcrum);
        let series = |family: &str, label: &str| -> Series {
            text.lines()
                .filter(|l| l.starts_with(&format!("{family}{{")))
                .filter(|l| l.contains(&format!("vserver=\"{vserver}\"")))
                .filter_map(|l| {
                    let key = l.split(&format!("{label}=\"")).nth(1)?.split('"').next()?;
                    let n = l.rsplit(' ').next()?.parse().ok()?;
                    Some((key.to_owned(), n))
                })
                .collect()
        };
        (
            series("fulcrum_sip_messages_total", "kind"),
            series("fulcrum_sip_replies_total", "code"),
        )
    }

    /// A long WAV (8 kHz, 16 bit, mono; 2 minutes of a 440 Hz tone) for the phones to send:
    /// baresip hangs up when its source file ends.
    fn tone(&self) -> PathBuf {
        let path = self.scratch.path("tone.wav");
        if path.exists() {
            return path;
        }
        let rate = 8000u32;
        let samples: Vec<u8> = (0..rate * 120)
            .flat_map(|i| {
                let t = f64::from(i) / f64::from(rate);
                let v = (8000.0 * (2.0 * std::f64::consts::PI * 440.0 * t).sin()) as i16;
                v.to_le_bytes()
            })
            .collect();
        let mut wav = Vec::with_capacity(44 + samples.len());
        let len = samples.len() as u32;
        wav.extend_from_slice(b"RIFF");
        wav.extend_from_slice(&(36 + len).to_le_bytes());
        wav.extend_from_slice(b"WAVEfmt ");
        wav.extend_from_slice(&16u32.to_le_bytes());
        wav.extend_from_slice(&1u16.to_le_bytes()); // PCM
        wav.extend_from_slice(&1u16.to_le_bytes()); // mono
        wav.extend_from_slice(&rate.to_le_bytes());
        wav.extend_from_slice(&(rate * 2).to_le_bytes());
        wav.extend_from_slice(&2u16.to_le_bytes());
        wav.extend_from_slice(&16u16.to_le_bytes());
        wav.extend_from_slice(b"data");
        wav.extend_from_slice(&len.to_le_bytes());
        wav.extend_from_slice(&samples);
        std::fs::write(&path, wav).expect("tone");
        path
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.fulcrum.shutdown();
    }
}

/// A child killed on drop.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// baresip with one account, driven over `ctrl_tcp` (netstring-framed JSON: commands with a
/// token, answered by a response with that token; events in between).
struct Baresip {
    _child: Guard,
    ctl: TcpStream,
    buf: Vec<u8>,
    /// Every event seen, in order.
    events: Vec<Value>,
    log: PathBuf,
}

impl Baresip {
    /// baresip as `sip:alice@127.0.0.1` over `transport`, its outbound proxy fulcrum's vserver
    /// for it; `cafile` given to its TLS (`sip_cafile`).
    fn start(lab: &Lab, transport: &str, cafile: &Path) -> Baresip {
        let dir = lab.scratch.path(&format!("baresip-{transport}"));
        std::fs::create_dir_all(&dir).expect("baresip dir");
        let (sip_port, ctl_port) = (free_port(ALICE_IP), free_port(ALICE_IP));
        let config = format!(
            "poll_method epoll\n\
             sip_listen {ALICE_IP}:{sip_port}\n\
             sip_cafile {}\n\
             net_interface {ALICE_IP}\n\
             audio_source aufile,{}\n\
             module_path /usr/lib/baresip/modules\n\
             module g711.so\nmodule aufile.so\nmodule menu.so\nmodule ctrl_tcp.so\nmodule account.so\n\
             ctrl_tcp_listen {ALICE_IP}:{ctl_port}\n",
            cafile.display(),
            lab.tone().display()
        );
        std::fs::write(dir.join("config"), config).expect("baresip config");
        let proxy = lab.proxy(transport);
        std::fs::write(
            dir.join("accounts"),
            format!(
                "<sip:alice@127.0.0.1;transport={transport}>;auth_pass=none;outbound=\"sip:{proxy};transport={transport}\";regint=600\n"
            ),
        )
        .expect("baresip accounts");
        let log = lab.scratch.path(&format!("baresip-{transport}.log"));
        let out = std::fs::File::create(&log).expect("baresip log");
        let child = Command::new("baresip")
            .arg("-f")
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("start baresip");
        let child = Guard(child);
        let deadline = Instant::now() + STEP;
        let ctl = loop {
            if let Ok(s) = TcpStream::connect((ALICE_IP, ctl_port)) {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "baresip's ctrl_tcp did not listen:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        ctl.set_read_timeout(Some(Duration::from_millis(100)))
            .expect("timeout");
        Baresip {
            _child: child,
            ctl,
            buf: Vec::new(),
            events: Vec::new(),
            log,
        }
    }

    /// The next complete netstring's JSON, if one arrives within the read timeout.
    fn read_one(&mut self) -> Option<Value> {
        loop {
            if let Some(colon) = self.buf.iter().position(|&b| b == b':') {
                let len: usize = std::str::from_utf8(&self.buf[..colon])
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .expect("netstring length");
                if self.buf.len() > colon + len {
                    let body = self.buf[colon + 1..colon + 1 + len].to_vec();
                    self.buf.drain(..colon + 2 + len);
                    return serde_json::from_slice(&body).ok();
                }
            }
            let mut chunk = [0u8; 4096];
            match self.ctl.read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(_) => return None,
            }
        }
    }

    /// Run `command params`; its answer's data, or the failure it reported.
    fn command(&mut self, command: &str, params: &str) -> Result<String, String> {
        let token = format!("t{}", self.events.len());
        let body =
            serde_json::json!({ "command": command, "params": params, "token": token }).to_string();
        self.ctl
            .write_all(format!("{}:{body},", body.len()).as_bytes())
            .expect("ctrl_tcp write");
        let deadline = Instant::now() + STEP;
        while Instant::now() < deadline {
            let Some(v) = self.read_one() else { continue };
            if v["response"] == true && v["token"] == token.as_str() {
                let data = v["data"].as_str().unwrap_or_default().to_owned();
                return if v["ok"] == true { Ok(data) } else { Err(data) };
            }
            if v["event"] == true {
                self.events.push(v);
            }
        }
        panic!("baresip did not answer `{command} {params}`");
    }

    /// Wait for event `kind` (e.g. "CALL_ESTABLISHED"), at or after event number `from`; the
    /// number after it.
    fn wait_event(&mut self, kind: &str, from: usize) -> usize {
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(i) = (from..self.events.len()).find(|&i| self.events[i]["type"] == kind) {
                return i + 1;
            }
            assert!(
                Instant::now() < deadline,
                "baresip: no {kind} event within {} s; events {:?}\nlog:\n{}",
                STEP.as_secs(),
                &self.events[from.min(self.events.len())..],
                self.log_text()
            );
            if let Some(v) = self.read_one()
                && v["event"] == true
            {
                self.events.push(v);
            }
        }
    }

    /// Wait until `reginfo` says the account is registered (the REGISTER_OK event may come
    /// before the control connection).
    fn wait_registered(&mut self) {
        let deadline = Instant::now() + STEP;
        loop {
            let info = self
                .command("reginfo", "")
                .unwrap_or_else(|e| panic!("reginfo: {e}"));
            if info.contains(" OK ") || info.contains("\u{1b}[32mOK") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "baresip did not register: {info}\nlog:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// How many `kind` events with parameter `param` have been seen.
    fn count(&mut self, kind: &str, param: &str) -> usize {
        while let Some(v) = self.read_one() {
            if v["event"] == true {
                self.events.push(v);
            }
        }
        self.events
            .iter()
            .filter(|e| e["type"] == kind && e["param"] == param)
            .count()
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// linphonec with a configuration of its own, driven on stdin; its output read line by line.
struct Linphone {
    _child: Guard,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    /// Every line seen, in order.
    seen: Vec<String>,
}

impl Linphone {
    /// linphonec (home and config in the scratch directory) listening on 127.0.0.3, random
    /// ports for UDP, TCP and TLS, `root_ca` for TLS with the server's certificate and name
    /// verified.
    fn start(lab: &Lab, transport: &str, root_ca: &Path) -> Linphone {
        let home = lab.scratch.path(&format!("linphone-{transport}"));
        // linphone keeps its call history in this database; without the directory the core
        // never leaves its startup state (no listening point, every request fails).
        std::fs::create_dir_all(home.join(".local/share/linphone")).expect("linphone home");
        let rc = home.join("linphonerc");
        std::fs::write(
            &rc,
            format!(
                "[sip]\nsip_port=-1\nsip_tcp_port=-1\nsip_tls_port=-1\nbind_address={BOB_IP}\n\
                 guess_hostname=0\nroot_ca={}\nverify_server_certs=1\nverify_server_cn=1\n\
                 [rtp]\naudio_rtp_port=-1\nvideo_rtp_port=-1\n\
                 [sound]\nplayback_dev_id=\ncapture_dev_id=\n",
                root_ca.display()
            ),
        )
        .expect("linphonerc");
        let mut child = Command::new("linphonec")
            .arg("-c")
            .arg(&rc)
            .arg("-S")
            .arg("-l")
            .arg(home.join("linphone.log"))
            .args(["-d", "5"])
            .env("HOME", &home)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start linphonec");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut l = Linphone {
            _child: Guard(child),
            stdin,
            lines,
            seen: Vec::new(),
        };
        // Audio from and to files: there is no sound card here.
        l.send("soundcard use files");
        l.wait_line("Using wav files", 0);
        l
    }

    fn send(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").expect("linphonec stdin");
        self.stdin.flush().expect("linphonec stdin");
    }

    /// Wait for a line containing `needle`, at or after line number `from`; the number after.
    fn wait_line(&mut self, needle: &str, from: usize) -> usize {
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(i) = (from..self.seen.len()).find(|&i| self.seen[i].contains(needle)) {
                return i + 1;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "linphonec: no line with `{needle}` within {} s; it said:\n{}",
                STEP.as_secs(),
                self.seen[from.min(self.seen.len())..].join("\n")
            );
            if let Ok(line) = self
                .lines
                .recv_timeout(left.min(Duration::from_millis(100)))
            {
                self.seen.push(line);
            }
        }
    }

    /// Ask `command` every 300 ms until its answer has a line with `needle` (bounded).
    fn poll(&mut self, command: &str, needle: &str) {
        let deadline = Instant::now() + STEP;
        loop {
            let from = self.seen.len();
            self.send(command);
            std::thread::sleep(Duration::from_millis(300));
            while let Ok(line) = self.lines.try_recv() {
                self.seen.push(line);
            }
            if self.seen[from..].iter().any(|l| l.contains(needle)) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "linphonec: `{command}` never said `{needle}`; it said:\n{}",
                self.seen[from..].join("\n")
            );
        }
    }

    /// The state of the current call as `calls` shows it, once it is `state`.
    fn wait_call_state(&mut self, state: &str) {
        self.poll("calls", &format!("| {state} "));
    }

    /// Register as bob through `proxy`; over TLS by the name `localhost`, which fulcrum's
    /// certificate carries (linphone's mbedTLS matches DNS names, not IP addresses).
    fn register(&mut self, proxy: SocketAddr, transport: &str) {
        let host = if transport == "tls" {
            format!("localhost:{}", proxy.port())
        } else {
            proxy.to_string()
        };
        self.send(&format!(
            "register sip:bob@127.0.0.1 sip:{host};transport={transport}"
        ));
        self.poll("status register", "registered,");
    }
}

/// The vserver fulcrum serves `transport` with.
fn vserver_of(transport: &str) -> &'static str {
    match transport {
        "udp" => "vu",
        "tcp" => "vt",
        _ => "vs",
    }
}

/// Both phones registered through fulcrum over `transport`; then a call from each to the
/// other, held and resumed from both sides, hung up by the caller and by the callee. fulcrum
/// added a Path to both registrations and carried the registrar's requests to each phone along
/// its flow (the INVITEs, re-INVITEs and BYEs toward the callee), and refused nothing.
fn calls_both_ways(lab: &Lab, transport: &str) {
    let mut alice = Baresip::start(lab, transport, &lab.ca);
    let mut bob = Linphone::start(lab, transport, &lab.ca);
    alice.wait_registered();
    let ev = alice.events.len();
    bob.register(lab.proxy(transport), transport);
    println!("{transport}: alice (baresip) and bob (linphone) registered through fulcrum");

    // alice calls bob; bob answers.
    let line = bob.seen.len();
    alice
        .command("dial", "sip:bob@127.0.0.1")
        .unwrap_or_else(|e| panic!("dial: {e}"));
    let line = bob.wait_line("Receiving new incoming call from sip:alice@", line);
    bob.send("answer");
    let ev = alice.wait_event("CALL_ESTABLISHED", ev);
    bob.wait_line("connected.", line);
    bob.wait_call_state("StreamsRunning");
    // alice holds (re-INVITE, sendonly) and resumes.
    alice
        .command("hold", "")
        .unwrap_or_else(|e| panic!("hold: {e}"));
    bob.wait_call_state("PausedByRemote");
    alice
        .command("resume", "")
        .unwrap_or_else(|e| panic!("resume: {e}"));
    bob.wait_call_state("StreamsRunning");
    // bob pauses and resumes: his re-INVITEs reach alice, her answers reach him.
    let offers = alice.count("CALL_REMOTE_SDP", "offer");
    bob.send("pause");
    bob.wait_call_state("Paused");
    bob.send("resume");
    bob.wait_call_state("StreamsRunning");
    let offers = alice.count("CALL_REMOTE_SDP", "offer") - offers;
    assert!(
        offers >= 2,
        "{transport}: alice saw {offers} re-INVITEs from bob"
    );
    // alice hangs up.
    let line = bob.seen.len();
    alice
        .command("hangup", "")
        .unwrap_or_else(|e| panic!("hangup: {e}"));
    let ev = alice.wait_event("CALL_CLOSED", ev);
    bob.wait_line("ended", line);
    println!("{transport}: alice -> bob: answered, held and resumed by both, ended by alice");

    // bob calls alice; alice answers.
    let line = bob.seen.len();
    // linphone sends a call through its proxy only when the callee is in the proxy's
    // domain; over TLS that is `localhost` (otherwise it sends the INVITE straight to the
    // callee's domain, past fulcrum).
    let domain = if transport == "tls" {
        "localhost"
    } else {
        "127.0.0.1"
    };
    bob.send(&format!("call sip:alice@{domain}"));
    let ev = alice.wait_event("CALL_INCOMING", ev);
    alice
        .command("accept", "")
        .unwrap_or_else(|e| panic!("accept: {e}"));
    let ev = alice.wait_event("CALL_ESTABLISHED", ev);
    bob.wait_line("connected.", line);
    bob.wait_call_state("StreamsRunning");
    bob.send("pause");
    bob.wait_call_state("Paused");
    bob.send("resume");
    bob.wait_call_state("StreamsRunning");
    alice
        .command("hold", "")
        .unwrap_or_else(|e| panic!("hold: {e}"));
    bob.wait_call_state("PausedByRemote");
    alice
        .command("resume", "")
        .unwrap_or_else(|e| panic!("resume: {e}"));
    bob.wait_call_state("StreamsRunning");
    // bob hangs up.
    bob.send("terminate");
    alice.wait_event("CALL_CLOSED", ev);
    bob.poll("calls", "No active call");
    println!("{transport}: bob -> alice: answered, held and resumed by both, ended by bob");

    let (kinds, replies) = lab.sip_counts(vserver_of(transport));
    println!("{transport}: fulcrum's SIP counts {kinds:?}; its own replies {replies:?}");
    let kind = |k: &str| kinds.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
    assert!(
        kind("paths_added") >= 2,
        "{transport}: Paths added {}",
        kind("paths_added")
    );
    // Toward the callee of each call: the INVITE (by its Path), then the re-INVITEs of the
    // caller's hold and resume and the caller's BYE (by the Record-Route's token).
    assert!(
        kind("routed_by_flow") >= 2 * 4,
        "{transport}: requests routed by a flow token {}",
        kind("routed_by_flow")
    );
    let refused: u64 = replies.iter().map(|(_, n)| n).sum();
    assert_eq!(
        refused, 0,
        "{transport}: fulcrum answered requests itself: {replies:?}"
    );
}

#[test]
fn softphones_register_call_hold_and_hang_up_over_udp() {
    let name = "softphones_register_call_hold_and_hang_up_over_udp";
    if !phones_available(name) {
        return;
    }
    let lab = Lab::start("udp");
    calls_both_ways(&lab, "udp");
}

#[test]
fn softphones_register_call_hold_and_hang_up_over_tcp() {
    let name = "softphones_register_call_hold_and_hang_up_over_tcp";
    if !phones_available(name) {
        return;
    }
    let lab = Lab::start("tcp");
    calls_both_ways(&lab, "tcp");
}

#[test]
fn softphones_register_call_hold_and_hang_up_over_tls() {
    let name = "softphones_register_call_hold_and_hang_up_over_tls";
    if !phones_available(name) {
        return;
    }
    let lab = Lab::start("tls");
    calls_both_ways(&lab, "tls");
}

/// Over TLS each phone is given a CA that did not sign fulcrum's certificate. linphone
/// verifies it (`verify_server_certs`): its handshake fails and it never registers. baresip
/// 1.0 does not (its TLS, from libre, accepts any certificate; `sip_cafile` only adds trust):
/// it registers all the same. docs/clients.md records both.
#[test]
fn softphones_over_tls_with_a_foreign_ca_linphone_refuses_and_baresip_does_not_check() {
    let name = "softphones_over_tls_with_a_foreign_ca_linphone_refuses_and_baresip_does_not_check";
    if !phones_available(name) {
        return;
    }
    let lab = Lab::start("tls-foreign");
    let mut bob = Linphone::start(&lab, "tls", &lab.other_ca);
    bob.send(&format!(
        "register sip:bob@127.0.0.1 sip:localhost:{};transport=tls",
        lab.tls.port()
    ));
    let deadline = Instant::now() + Duration::from_secs(4);
    while Instant::now() < deadline {
        let from = bob.seen.len();
        bob.send("status register");
        std::thread::sleep(Duration::from_millis(300));
        while let Ok(line) = bob.lines.try_recv() {
            bob.seen.push(line);
        }
        assert!(
            !bob.seen[from..].iter().any(|l| l.contains("registered,")),
            "linphone registered over TLS though fulcrum's certificate is not from its CA"
        );
    }
    let log =
        std::fs::read_to_string(lab.scratch.path("linphone-tls/linphone.log")).unwrap_or_default();
    let refusal = log
        .lines()
        .find(|l| l.contains("SSL handshake failed"))
        .unwrap_or_else(|| panic!("linphone logged no failed handshake:\n{log}"));
    println!("linphone, CA not fulcrum's: {}", refusal.trim());
    drop(bob);

    let mut alice = Baresip::start(&lab, "tls", &lab.other_ca);
    alice.wait_registered();
    println!("baresip, CA not fulcrum's: registered over TLS all the same (no verification)");
}
