//! The strict SIP UAS of the tests (`tests/common/strict_uas.rs`, included here by path so the
//! logic lives in one place) as a standalone process, for `bench/churn.sh`, `bench/sip_tls.sh`
//! and `bench/gray.sh`: it answers 481 to a BYE for a dialog it did not set up, and prints its
//! counts.
//!
//! `strict_uas [--sick busy|down|silent|refusing|overloaded] NAME IP:PORT [udp|tcp|tls CERT KEY] [SECONDS]`
//! (defaults healthy, `udp`, `600`): binds IP:PORT (over TLS presenting the PEM certificate
//! chain CERT with its key KEY), sick from the start when `--sick` is given (busy: INVITE
//! answered 503 + Retry-After, OPTIONS 200; down: INVITE and OPTIONS 503; silent: INVITE never
//! answered, OPTIONS 200; refusing: INVITE answered 486 Busy Here; overloaded: every request
//! outside a dialog answered 503 + Retry-After), then prints `ready NAME ADDR`, a counts line whenever they changed
//! (at most every 200 ms, so a SIGKILLed UAS leaves counts at most 200 ms old) and a final one
//! on SIGTERM, SIGINT or after SECONDS:
//!
//! `counts name=s0 requests=R dialogs=D byes_ok=B r481=N stray_acks=A invites=I`
//!
//! (dialogs set up, dialogs ended by a BYE answered 200, 481s sent, ACKs for no dialog, INVITE
//! transactions outside a dialog: a retransmission is not counted again, a proxy's new attempt
//! with a branch of its own is).
//!
//! `cargo build --release --example strict_uas && target/release/examples/strict_uas s0 127.0.0.1:5071`

#[allow(dead_code)]
#[path = "../tests/common/sip_tcp.rs"]
mod sip_tcp;
#[allow(dead_code)]
#[path = "../tests/common/strict_uas.rs"]
mod strict_uas;

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;
use strict_uas::{Counts, Sick, StrictUas};
use tokio::signal::unix::{SignalKind, signal};

fn line(name: &str, c: Counts) -> String {
    format!(
        "counts name={name} requests={} dialogs={} byes_ok={} r481={} stray_acks={} invites={}",
        c.requests, c.dialogs, c.byes_ok, c.r481, c.stray_acks, c.invites
    )
}

/// The value of `--sick`.
fn sick_of(s: &str) -> Option<Sick> {
    match s {
        "busy" => Some(Sick::Busy),
        "down" => Some(Sick::Down),
        "silent" => Some(Sick::Silent),
        "refusing" => Some(Sick::Refusing),
        "overloaded" => Some(Sick::Overloaded),
        "healthy" | "none" => Some(Sick::Healthy),
        _ => None,
    }
}

/// `--sick VALUE` (or `--sick=VALUE`) taken out of `args`, wherever it stands.
fn take_sick(args: &mut Vec<String>, usage: &str) -> anyhow::Result<Sick> {
    let Some(i) = args.iter().position(|a| a.starts_with("--sick")) else {
        return Ok(Sick::Healthy);
    };
    let flag = args.remove(i);
    let value = match flag.strip_prefix("--sick=") {
        Some(v) => v.to_owned(),
        None if flag == "--sick" && i < args.len() => args.remove(i),
        None => anyhow::bail!("`{flag}`: {usage}"),
    };
    sick_of(&value).ok_or_else(|| anyhow::anyhow!("--sick `{value}`: {usage}"))
}

fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: strict_uas [--sick busy|down|silent|refusing|overloaded] NAME IP:PORT [udp|tcp|tls CERT KEY] [SECONDS]";
    let sick = take_sick(&mut args, usage)?;
    let (Some(name), Some(addr)) = (args.first(), args.get(1)) else {
        anyhow::bail!(usage);
    };
    let at: SocketAddr = addr.parse()?;
    let transport = args.get(2).map_or("udp", String::as_str);
    // `tls CERT KEY` takes two more arguments before SECONDS.
    let secs_at = if transport == "tls" { 5 } else { 3 };
    let seconds: u64 = args.get(secs_at).map_or(Ok(600), |s| s.parse())?;
    let uas = match transport {
        "udp" => StrictUas::udp_at(name, at),
        "tcp" => StrictUas::tcp_at(name, at),
        "tls" => {
            let (Some(cert), Some(key)) = (args.get(3), args.get(4)) else {
                anyhow::bail!("tls needs CERT and KEY: {usage}");
            };
            let (tls, _) = fulcrum::tls::server_config(&fulcrum::tls::ServerFiles {
                cert: Path::new(cert),
                key: Path::new(key),
                client_ca: None,
            })?;
            StrictUas::tls_at(name, at, tls)
        }
        other => anyhow::bail!("transport `{other}`: {usage}"),
    };
    uas.set_sick(sick);
    let mut out = std::io::stdout();
    writeln!(out, "ready {name} {}", uas.addr)?;
    out.flush()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let end = tokio::time::sleep(Duration::from_secs(seconds));
        tokio::pin!(end);
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let mut last = Counts::default();
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = int.recv() => break,
                () = &mut end => break,
                _ = tick.tick() => {
                    let c = uas.counts();
                    if c != last {
                        last = c;
                        writeln!(out, "{}", line(name, c))?;
                        out.flush()?;
                    }
                }
            }
        }
        writeln!(out, "{}", line(name, uas.counts()))?;
        out.flush()?;
        anyhow::Ok(())
    })
}
