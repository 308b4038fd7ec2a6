//! A reload-churn lab: `n` [`StrictUas`] on 127.0.0.1, a `fulcrum run` child process with
//! one SIP vserver `v` (`call_id_hash`, no Record-Route) over some of them, and reloads by
//! rewriting its config and sending SIGHUP, each confirmed by fulcrum's log line. IO.

use super::sipp::Transport;
use super::strict_uas::{Counts, StrictUas};
use super::{ConfigFile, expect_line, spawn_fulcrum};
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub struct ChurnLab {
    pub transport: Transport,
    pub uas: Vec<StrictUas>,
    /// The vserver's address.
    pub proxy: SocketAddr,
    file: ConfigFile,
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl ChurnLab {
    /// `n` strict UAS named `s0..` and fulcrum with `v` over the services `members`.
    pub fn start(tag: &str, transport: Transport, n: usize, members: &[usize]) -> ChurnLab {
        let uas: Vec<StrictUas> = (0..n)
            .map(|i| match transport {
                Transport::Udp => StrictUas::udp(&format!("s{i}")),
                Transport::Tcp => StrictUas::tcp(&format!("s{i}")),
            })
            .collect();
        let file = ConfigFile::new(tag, &config(transport, &uas, members));
        let (child, lines) = spawn_fulcrum(&file.path, "2s");
        let listening = expect_line(&lines, "listening");
        let proxy = listening
            .split("bound=[")
            .nth(1)
            .and_then(|r| r.split(']').next())
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no bound address in `{listening}`"));
        ChurnLab {
            transport,
            uas,
            proxy,
            file,
            child,
            lines,
        }
    }

    /// Make `v` run over `members`: rewrite the file, SIGHUP, wait for the reload's log line.
    pub fn reload(&self, members: &[usize]) {
        self.file.write(&config(self.transport, &self.uas, members));
        let ok = Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -HUP fulcrum");
        let line = expect_line(&self.lines, "SIGHUP: reloaded");
        assert!(line.contains("vservers.v rebuilt"), "{line}");
    }

    pub fn counts(&self) -> Vec<Counts> {
        self.uas.iter().map(StrictUas::counts).collect()
    }
}

impl Drop for ChurnLab {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every UAS is a service (so one left out of `v` still exists, unused); `v` is over
/// `members`.
pub fn config(t: Transport, uas: &[StrictUas], members: &[usize]) -> String {
    let proto = t.protocol();
    let mut y = String::from("admin: { listen: null }\nservices:\n");
    for u in uas {
        y += &format!(
            "  - {{ name: {}, address: \"{}\", protocol: {proto} }}\n",
            u.name, u.addr
        );
    }
    let names: Vec<&str> = members.iter().map(|&i| uas[i].name.as_str()).collect();
    y += &format!(
        "vservers:\n  - name: v\n    protocol: {proto}\n    bind: [\"127.0.0.1:0\"]\n    method: call_id_hash\n    record_route: false\n    workers: 1\n    services: [{}]\n",
        names.join(", ")
    );
    y
}
