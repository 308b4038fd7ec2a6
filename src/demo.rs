//! `fulcrum demo`: a self-contained run on loopback. IO.
//!
//! Three built-in SIP UAS backends, a sip-udp vserver in front of them (round robin with
//! automatic slow start, dialog affinity), and a built-in UAC load placing whole calls. A
//! live table shows each service's state, calls and call rate. Part way through, one
//! service stops; its sip-options monitor (every 500 ms, DOWN after 2 failures) marks it
//! DOWN; later it returns, the monitor marks it UP after 2 successes and it ramps up under
//! slow start. The config is ordinary YAML run through the real loader.

use crate::config;
use crate::ops::Ops;
use crate::peer::{Uac, Uas};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Demo knobs.
#[derive(Debug, Clone, Copy)]
pub struct DemoOptions {
    pub duration: Duration,
    /// Offered calls per second.
    pub rate: u32,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            duration: Duration::from_secs(30),
            rate: 120,
        }
    }
}

/// What the demo measured.
#[derive(Debug, Clone, Default)]
pub struct DemoReport {
    pub calls_ok: u64,
    pub calls_failed: u64,
    /// Calls answered by each service (in config order).
    pub per_service: Vec<u64>,
}

fn demo_yaml(ports: &[u16]) -> String {
    let mut y = String::from(
        "# fulcrum demo: generated at run time\nadmin: { listen: null }\nmonitors:\n  - { name: ping, type: sip-options, interval: 500ms, timeout: 300ms, failures_to_down: 2, successes_to_up: 2 }\nservices:\n",
    );
    for (i, p) in ports.iter().enumerate() {
        let _ = writeln!(
            y,
            "  - {{ name: sip{n}, address: 127.0.0.1:{p}, protocol: sip-udp, monitor: ping }}",
            n = i + 1
        );
    }
    y.push_str(
        "vservers:\n  - name: demo\n    protocol: sip-udp\n    bind: [127.0.0.1:0]\n    method: round_robin\n    slow_start: { new_service_request_rate: 5, unit: per_second, increment_interval: 2s }\n    workers: 2\n    services: [sip1, sip2, sip3]\n",
    );
    y
}

/// Run the demo, printing the live table to stdout. A message on `stop` ends it early
/// (Ctrl-C), at once rather than at the next line of the table.
pub fn run(opts: DemoOptions, stop: Receiver<()>) -> anyhow::Result<DemoReport> {
    let any: SocketAddr = "127.0.0.1:0".parse()?;
    let mut uas: Vec<Uas> = (0..3).map(|_| Uas::start(any)).collect::<Result<_, _>>()?;
    let ports: Vec<u16> = uas.iter().map(|u| u.addr.port()).collect();
    let cfg = config::from_str("demo.yaml", &demo_yaml(&ports))?;
    let ops = Ops::start(cfg, None)?;
    let (b, proxy) = ops
        .with_vservers(|vs, _| {
            vs.iter()
                .find(|v| v.name == "demo")
                .and_then(|v| Some((std::sync::Arc::clone(v.balancer()), *v.bound.first()?)))
        })
        .flatten()
        .ok_or_else(|| anyhow::anyhow!("demo vserver did not start"))?;
    println!("fulcrum demo: 3 SIP services on 127.0.0.1:{ports:?}, proxy on {proxy}");
    println!(
        "round robin + slow start (5 calls/s, +5 every 2 s), {} calls/s offered, {} s",
        opts.rate,
        opts.duration.as_secs()
    );

    // Load: a few UAC threads, each pacing its share of the rate.
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let load_stop = Arc::new(AtomicBool::new(false));
    let threads = 4u32;
    let per_thread = f64::from(opts.rate.max(1)) / f64::from(threads);
    let mut handles = Vec::new();
    for t in 0..threads {
        let (ok, failed, load_stop) =
            (Arc::clone(&ok), Arc::clone(&failed), Arc::clone(&load_stop));
        let mut uac = Uac::new(any, proxy, &format!("uac{t}"))?;
        handles.push(std::thread::spawn(move || {
            let start = Instant::now();
            let mut n = 0u64;
            // Looked at between two calls (each turn is a call, paced to the rate, not a
            // timer that only watches the flag): the join below waits at most one call.
            while !load_stop.load(Ordering::Relaxed) {
                let due = start + Duration::from_secs_f64(n as f64 / per_thread);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                n += 1;
                match uac.call(Duration::from_millis(500)) {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }

    let start = Instant::now();
    let down_at = opts.duration.mul_f64(0.3);
    let up_at = opts.duration.mul_f64(0.55);
    let (mut went_down, mut came_back) = (false, false);
    let mut last: Vec<u64> = vec![0; uas.len()];
    let mut tick = start;
    let mut last_state = b.health(1);
    while start.elapsed() < opts.duration {
        tick += Duration::from_secs(1);
        let wait = tick.saturating_duration_since(Instant::now());
        match stop.recv_timeout(wait) {
            Ok(()) => break,
            Err(RecvTimeoutError::Timeout) => {}
            // Nobody can ask for a stop any more: pace the table by the clock alone.
            Err(RecvTimeoutError::Disconnected) => std::thread::sleep(wait),
        }
        let t = start.elapsed();
        if !went_down && t >= down_at {
            uas[1].stop();
            println!(
                "-- t={:>2}s sip2 stopped: its sip-options monitor will notice",
                t.as_secs()
            );
            went_down = true;
        }
        if went_down && !came_back && t >= up_at {
            uas[1] = Uas::start(SocketAddr::from(([127, 0, 0, 1], ports[1])))?;
            println!(
                "-- t={:>2}s sip2 restarted: the monitor brings it UP, slow start ramps it up",
                t.as_secs()
            );
            came_back = true;
        }
        let state_now = b.health(1);
        if state_now != last_state {
            println!(
                "-- t={:>2}s monitor: sip2 is {}",
                t.as_secs(),
                state_now.map_or("?", |h| h.name())
            );
            last_state = state_now;
        }
        let slow = b.slow_start();
        let mut line = format!("t={:>3}s ", t.as_secs());
        for (i, u) in uas.iter().enumerate() {
            let total = u.log.invites.load(Ordering::Relaxed);
            let rate = total.saturating_sub(last[i]);
            last[i] = total;
            let state = b.health(i).map_or("?", |h| h.name());
            let new = slow
                .as_ref()
                .and_then(|s| s.status(i))
                .map_or(String::new(), |s| format!(" new@{}/s", s.rate));
            let _ = write!(
                line,
                "| sip{} {:<4} {:>5} calls {:>4}/s{:<10}",
                i + 1,
                state,
                total,
                rate,
                new
            );
        }
        let _ = write!(
            line,
            "| ok {} failed {}",
            ok.load(Ordering::Relaxed),
            failed.load(Ordering::Relaxed)
        );
        println!("{line}");
    }
    load_stop.store(true, Ordering::Relaxed);
    for h in handles {
        let _ = h.join();
    }
    let report = DemoReport {
        calls_ok: ok.load(Ordering::Relaxed),
        calls_failed: failed.load(Ordering::Relaxed),
        per_service: uas
            .iter()
            .map(|u| u.log.invites.load(Ordering::Relaxed))
            .collect(),
    };
    ops.shutdown();
    println!(
        "done: {} calls completed, {} failed (calls in flight on sip2 when it stopped fail by design)",
        report.calls_ok, report.calls_failed
    );
    Ok(report)
}
