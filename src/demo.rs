//! `fulcrum demo`: a self-contained run on loopback. IO.
//!
//! Three built-in SIP UAS backends, a sip-udp vserver in front of them (round robin with
//! automatic slow start, dialog affinity), and a built-in UAC load placing whole calls. A
//! live table shows each service's state, calls and call rate. Part way through, one
//! service stops; its sip-options monitor (every 500 ms, DOWN after 2 failures) marks it
//! DOWN; later it returns, the monitor marks it UP after 2 successes and it ramps up under
//! slow start. The config is ordinary YAML run through the real loader.

use crate::balancer::Balancer;
use crate::config;
use crate::ops::Ops;
use crate::peer::{Uac, Uas};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
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
    let (ops, b, proxy) = start_proxy(&ports)?;
    println!("fulcrum demo: 3 SIP services on 127.0.0.1:{ports:?}, proxy on {proxy}");
    println!(
        "round robin + slow start (5 calls/s, +5 every 2 s), {} calls/s offered, {} s",
        opts.rate,
        opts.duration.as_secs()
    );
    let load = Load::start(any, proxy, opts.rate)?;
    live_table(opts.duration, &stop, &mut uas, &ports, &b, &load)?;
    let report = load.finish(&uas);
    ops.shutdown();
    println!(
        "done: {} calls completed, {} failed (calls in flight on sip2 when it stopped fail by design)",
        report.calls_ok, report.calls_failed
    );
    Ok(report)
}

/// Starts the proxy on the demo config in front of the UAS `ports`: the running ops, the
/// demo vserver's balancer (the table reads health and slow start from it) and the address
/// it listens on.
fn start_proxy(ports: &[u16]) -> anyhow::Result<(Arc<Ops>, Arc<Balancer>, SocketAddr)> {
    let cfg = config::from_str("demo.yaml", &demo_yaml(ports))?;
    let ops = Ops::start(cfg, None)?;
    let (b, proxy) = ops
        .with_vservers(|vs, _| {
            vs.iter()
                .find(|v| v.name == "demo")
                .and_then(|v| Some((Arc::clone(v.balancer()), *v.bound.first()?)))
        })
        .flatten()
        .ok_or_else(|| anyhow::anyhow!("demo vserver did not start"))?;
    Ok((ops, b, proxy))
}

/// The UAC load: a few threads, each placing whole calls at its share of the offered rate.
struct Load {
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    const THREADS: u32 = 4;

    /// Starts the threads, their UACs bound to `bind`, calling through `proxy`.
    fn start(bind: SocketAddr, proxy: SocketAddr, rate_per_s: u32) -> anyhow::Result<Load> {
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let per_thread_per_s = f64::from(rate_per_s.max(1)) / f64::from(Self::THREADS);
        let mut threads = Vec::new();
        for t in 0..Self::THREADS {
            let (ok, failed, stop) = (Arc::clone(&ok), Arc::clone(&failed), Arc::clone(&stop));
            let uac = Uac::new(bind, proxy, &format!("uac{t}"))?;
            threads.push(std::thread::spawn(move || {
                place_calls(uac, per_thread_per_s, &ok, &failed, &stop);
            }));
        }
        Ok(Load {
            ok,
            failed,
            stop,
            threads,
        })
    }

    /// Calls completed and failed so far.
    fn calls(&self) -> (u64, u64) {
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }

    /// Stops the threads, waits for them and reports, with the calls each of `uas` answered.
    fn finish(self, uas: &[Uas]) -> DemoReport {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.threads {
            let _ = h.join();
        }
        DemoReport {
            calls_ok: self.ok.load(Ordering::Relaxed),
            calls_failed: self.failed.load(Ordering::Relaxed),
            per_service: uas
                .iter()
                .map(|u| u.log.invites.load(Ordering::Relaxed))
                .collect(),
        }
    }
}

/// One load thread: calls paced to `rate_per_s` from its start, counted in `ok` or
/// `failed`, until `stop` is set.
fn place_calls(
    mut uac: Uac,
    rate_per_s: f64,
    ok: &AtomicU64,
    failed: &AtomicU64,
    stop: &AtomicBool,
) {
    let start = Instant::now();
    let mut n = 0u64;
    // Looked at between two calls (each turn is a call, paced to the rate, not a
    // timer that only watches the flag): the join in Load::finish waits at most one call.
    while !stop.load(Ordering::Relaxed) {
        let due = start + Duration::from_secs_f64(n as f64 / rate_per_s);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        n += 1;
        match uac.call(Duration::from_millis(500)) {
            Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
            Err(_) => failed.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// The service the demo takes down and brings back: sip2.
const OUTAGE_SERVICE: usize = 1;

/// A step of the scripted outage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OutageStep {
    Stop,
    Restart,
}

/// The scripted outage: sip2 stops at 30 % of the run and returns at 55 %, each once.
struct Outage {
    down_at: Duration,
    up_at: Duration,
    went_down: bool,
    came_back: bool,
}

impl Outage {
    fn new(duration: Duration) -> Outage {
        Outage {
            down_at: duration.mul_f64(0.3),
            up_at: duration.mul_f64(0.55),
            went_down: false,
            came_back: false,
        }
    }

    /// The next step due at `t` (from the start of the run), if any; a late tick gets both
    /// steps, in order.
    fn due(&mut self, t: Duration) -> Option<OutageStep> {
        if !self.went_down && t >= self.down_at {
            self.went_down = true;
            return Some(OutageStep::Stop);
        }
        if self.went_down && !self.came_back && t >= self.up_at {
            self.came_back = true;
            return Some(OutageStep::Restart);
        }
        None
    }
}

/// One line of the table a second until `duration` has passed or `stop` asks to end, with
/// the outage carried out on the way and sip2's health changes noted as they happen.
fn live_table(
    duration: Duration,
    stop: &Receiver<()>,
    uas: &mut [Uas],
    ports: &[u16],
    b: &Balancer,
    load: &Load,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut outage = Outage::new(duration);
    let mut last_calls: Vec<u64> = vec![0; uas.len()];
    let mut tick = start;
    let mut last_state = b.health(OUTAGE_SERVICE);
    while start.elapsed() < duration {
        tick += Duration::from_secs(1);
        if is_stopped_before(stop, tick) {
            break;
        }
        let t = start.elapsed();
        while let Some(step) = outage.due(t) {
            carry_out(step, t, uas, ports)?;
        }
        let state_now = b.health(OUTAGE_SERVICE);
        if state_now != last_state {
            println!(
                "-- t={:>2}s monitor: sip2 is {}",
                t.as_secs(),
                state_now.map_or("?", |h| h.name())
            );
            last_state = state_now;
        }
        let rows = sample_services(uas, b, &mut last_calls);
        let (ok, failed) = load.calls();
        println!("{}", table_line(t, &rows, ok, failed));
    }
    Ok(())
}

/// Waits until `tick`; true when a message on `stop` came first.
fn is_stopped_before(stop: &Receiver<()>, tick: Instant) -> bool {
    let wait = tick.saturating_duration_since(Instant::now());
    match stop.recv_timeout(wait) {
        Ok(()) => true,
        Err(RecvTimeoutError::Timeout) => false,
        // Nobody can ask for a stop any more: pace the table by the clock alone.
        Err(RecvTimeoutError::Disconnected) => {
            std::thread::sleep(wait);
            false
        }
    }
}

/// Stops sip2's UAS, or starts a new one on its port, and says so.
fn carry_out(step: OutageStep, t: Duration, uas: &mut [Uas], ports: &[u16]) -> anyhow::Result<()> {
    match step {
        OutageStep::Stop => {
            uas[OUTAGE_SERVICE].stop();
            println!(
                "-- t={:>2}s sip2 stopped: its sip-options monitor will notice",
                t.as_secs()
            );
        }
        OutageStep::Restart => {
            uas[OUTAGE_SERVICE] =
                Uas::start(SocketAddr::from(([127, 0, 0, 1], ports[OUTAGE_SERVICE])))?;
            println!(
                "-- t={:>2}s sip2 restarted: the monitor brings it UP, slow start ramps it up",
                t.as_secs()
            );
        }
    }
    Ok(())
}

/// One service's cells in a line of the table.
struct ServiceRow {
    state: &'static str,
    calls: u64,
    calls_per_s: u64,
    /// Its slow-start limit while it is new, in calls per second.
    new_rate_per_s: Option<u64>,
}

/// Each service's row now. `last_calls` holds the totals of the previous line (one second
/// ago, so the difference is the rate) and is updated.
fn sample_services(uas: &[Uas], b: &Balancer, last_calls: &mut [u64]) -> Vec<ServiceRow> {
    let slow = b.slow_start();
    uas.iter()
        .enumerate()
        .map(|(i, u)| {
            let calls = u.log.invites.load(Ordering::Relaxed);
            let calls_per_s = calls.saturating_sub(last_calls[i]);
            last_calls[i] = calls;
            ServiceRow {
                state: b.health(i).map_or("?", |h| h.name()),
                calls,
                calls_per_s,
                new_rate_per_s: slow.as_ref().and_then(|s| s.status(i)).map(|s| s.rate),
            }
        })
        .collect()
}

/// A line of the table: the time, each service's cells, the load's totals.
fn table_line(t: Duration, rows: &[ServiceRow], ok: u64, failed: u64) -> String {
    let mut line = format!("t={:>3}s ", t.as_secs());
    for (i, r) in rows.iter().enumerate() {
        let new = r
            .new_rate_per_s
            .map_or(String::new(), |rate| format!(" new@{rate}/s"));
        let _ = write!(
            line,
            "| sip{} {:<4} {:>5} calls {:>4}/s{:<10}",
            i + 1,
            r.state,
            r.calls,
            r.calls_per_s,
            new
        );
    }
    let _ = write!(line, "| ok {ok} failed {failed}");
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outage_steps_come_once_and_in_order() {
        let mut o = Outage::new(Duration::from_secs(20));
        assert_eq!(o.due(Duration::from_secs(5)), None);
        assert_eq!(o.due(Duration::from_secs(6)), Some(OutageStep::Stop));
        assert_eq!(o.due(Duration::from_secs(7)), None);
        assert_eq!(o.due(Duration::from_secs(11)), Some(OutageStep::Restart));
        assert_eq!(o.due(Duration::from_secs(19)), None);
        // A tick late enough for both gets them both, the stop first.
        let mut late = Outage::new(Duration::from_secs(20));
        assert_eq!(late.due(Duration::from_secs(12)), Some(OutageStep::Stop));
        assert_eq!(late.due(Duration::from_secs(12)), Some(OutageStep::Restart));
        assert_eq!(late.due(Duration::from_secs(12)), None);
    }

    #[test]
    fn table_line_keeps_its_columns() {
        let rows = [
            ServiceRow {
                state: "UP",
                calls: 397,
                calls_per_s: 60,
                new_rate_per_s: None,
            },
            ServiceRow {
                state: "DOWN",
                calls: 1,
                calls_per_s: 1,
                new_rate_per_s: Some(5),
            },
        ];
        assert_eq!(
            table_line(Duration::from_millis(8_400), &rows, 956, 8),
            "t=  8s | sip1 UP     397 calls   60/s          \
             | sip2 DOWN     1 calls    1/s new@5/s  | ok 956 failed 8"
        );
    }
}
