//! `fulcrum demo`: a self-contained run on loopback. IO.
//!
//! Three built-in SIP UAS backends, a sip-udp vserver in front of them (round robin with
//! automatic slow start, dialog affinity, INVITE failover and passive ejection, both on by
//! default) and a built-in UAC load placing whole calls at a steady rate. A live table shows
//! each service's state as the vserver sees it, its calls and call rate. The run goes
//! through five phases, at fixed shares of its length:
//!
//! 1. all healthy: round robin shares the calls evenly;
//! 2. sip2 stops: the INVITEs already sent there get no answer and fail over to the others
//!    after `no_answer` (1 s); its sip-options monitor (every 500 ms, DOWN after 2 failures)
//!    marks it DOWN and new calls skip it;
//! 3. sip2 returns: the monitor marks it UP after 2 successes and it ramps up under slow start;
//! 4. sip3 turns sick: it answers INVITEs 503 with Retry-After while its OPTIONS still get 200,
//!    so its monitor keeps it UP. Failover takes each refused INVITE to another service, and
//!    after 3 refusals in a row the vserver EJECTS sip3 (for the Retry-After, 3 s; doubled
//!    per repeat up to 4 s here): new calls skip it;
//! 5. sip3 recovers: when its ejection ends it is half-open, its one trial call succeeds and
//!    it takes its full share again.
//!
//! No new call fails at the client. A call sip2 answered just before it stopped whose BYE
//! then goes unanswered is lost with its service: the demo counts those as "cut", apart.
//! The load is paced by one thread handing calls to a pool of call threads, so calls
//! waiting on a failover never hold the others back. The config is ordinary YAML run
//! through the real loader.

use crate::balancer::Balancer;
use crate::config;
use crate::eject::Phase;
use crate::ops::Ops;
use crate::peer::{Uac, Uas};
use crate::stats::Nanos;
use crate::sync::lock;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
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
    /// Calls completed (INVITE and BYE answered 200).
    pub calls_ok: u64,
    /// Calls never set up: the client got no 200 to its INVITE in time.
    pub calls_failed: u64,
    /// Calls cut by the outage: set up (INVITE answered 200) and then lost, their BYE
    /// unanswered because the service holding them had stopped.
    pub calls_cut: u64,
    /// INVITEs each service received (in config order), answered or refused.
    pub per_service: Vec<u64>,
    /// Whether the table saw each service EJECTED at some point.
    pub ejected_seen: Vec<bool>,
    /// INVITEs each service received while sip3 was sick (from its turning sick to its
    /// recovery, or to the end of the run); empty when the run ended before it turned sick.
    pub sick_phase_invites: Vec<u64>,
}

/// The service the demo takes down and brings back: sip2.
const OUTAGE_SERVICE: usize = 1;
/// The service that turns sick and recovers: sip3.
const SICK_SERVICE: usize = 2;
/// The Retry-After of sip3's 503s while it is sick, in seconds.
const SICK_RETRY_AFTER_S: u32 = 3;
/// How long a call waits for each final answer. Above the failover's worst case (3 tries of
/// `no_answer` 1 s), so a call the vserver moves to another service is never given up on.
const CALL_TIMEOUT: Duration = Duration::from_secs(4);
/// How often the table looks at the services' states between two lines, so a change is
/// noted when it happens rather than at the next line.
const POLL: Duration = Duration::from_millis(100);

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
    // Ejections short enough for a 30 s run (the default is 10 s, up to 5 min), and an
    // INVITE's `no_answer` at 1 s (the default, 2 s, leaves room for a stateful service's
    // 100 behind a slow database; the built-in services answer at once).
    y.push_str(
        "vservers:\n  - name: demo\n    protocol: sip-udp\n    bind: [127.0.0.1:0]\n    method: round_robin\n    slow_start: { new_service_request_rate: 10, unit: per_second, increment_interval: 1s }\n    eject: { after: 3, base: 2s, max: 4s }\n    failover: { no_answer: 1s }\n    workers: 2\n    services: [sip1, sip2, sip3]\n",
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
        "round robin + slow start (10 calls/s, +10 every 1 s), INVITE failover (503 or no answer \
         in 1 s: next service), ejection (3 failures in a row: 2-4 s), {} calls/s offered, {} s",
        opts.rate,
        opts.duration.as_secs()
    );
    let load = Load::start(any, proxy, opts.rate)?;
    let watch = live_table(opts.duration, &stop, &mut uas, &ops, &b, &load)?;
    let tally = load.finish();
    ops.shutdown();
    let report = DemoReport {
        calls_ok: tally.ok.load(Ordering::Relaxed),
        calls_failed: tally.failed.load(Ordering::Relaxed),
        calls_cut: tally.cut.load(Ordering::Relaxed),
        per_service: invites(&uas),
        ejected_seen: watch.ejected_seen,
        sick_phase_invites: watch.sick_phase_invites.unwrap_or_default(),
    };
    println!(
        "done: {} calls completed, {} failed, {} cut by the outage (answered by sip2 just \
         before it stopped, their BYE unanswered)",
        report.calls_ok, report.calls_failed, report.calls_cut
    );
    Ok(report)
}

/// Starts the proxy on the demo config in front of the UAS `ports`: the running ops, the
/// demo vserver's balancer (the table reads health, ejection and slow start from it) and the
/// address it listens on.
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

/// INVITEs each UAS received so far.
fn invites(uas: &[Uas]) -> Vec<u64> {
    uas.iter()
        .map(|u| u.log.invites.load(Ordering::Relaxed))
        .collect()
}

/// How the load's calls ended.
#[derive(Debug, Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
    cut: AtomicU64,
}

/// The UAC load: a pacer thread hands out calls at the offered rate to a pool of call
/// threads, each with its own UAC.
struct Load {
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    /// Starts the pacer and the call threads, their UACs bound to `bind`, calling through
    /// `proxy`. A call whose INVITE went to a service that has just stopped waits the
    /// failover's `no_answer` (1 s) before another service answers, and until the monitor
    /// notices, a third of the calls go there: one call thread per call a second offered
    /// leaves room for that second of calls waiting at once, so the pace never stalls.
    fn start(bind: SocketAddr, proxy: SocketAddr, rate_per_s: u32) -> anyhow::Result<Load> {
        let tally = Arc::new(Tally::default());
        let stop = Arc::new(AtomicBool::new(false));
        let rate_per_s = rate_per_s.max(1);
        // A rendezvous: the pacer waits only while every call thread is on a call.
        let (give, take) = std::sync::mpsc::sync_channel::<()>(0);
        let take = Arc::new(Mutex::new(take));
        let mut threads = Vec::new();
        for t in 0..rate_per_s.clamp(8, 1_000) {
            let (take, tally) = (Arc::clone(&take), Arc::clone(&tally));
            let uac = Uac::new(bind, proxy, &format!("uac{t}"))?;
            threads.push(
                std::thread::Builder::new()
                    .name(format!("uac{t}"))
                    .stack_size(256 * 1024)
                    .spawn(move || place_calls(uac, &take, &tally))?,
            );
        }
        let stop2 = Arc::clone(&stop);
        threads.push(
            std::thread::Builder::new()
                .name("uac-pacer".into())
                .spawn(move || pace(&give, rate_per_s, &stop2))?,
        );
        Ok(Load {
            tally,
            stop,
            threads,
        })
    }

    /// Calls completed, failed and cut so far.
    fn calls(&self) -> (u64, u64, u64) {
        (
            self.tally.ok.load(Ordering::Relaxed),
            self.tally.failed.load(Ordering::Relaxed),
            self.tally.cut.load(Ordering::Relaxed),
        )
    }

    /// Stops the pacer, waits for the calls under way and returns how the calls ended.
    fn finish(self) -> Arc<Tally> {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.threads {
            let _ = h.join();
        }
        self.tally
    }
}

/// The pacer: one call handed out every 1/`rate_per_s` s from its start until `stop` is set;
/// a call it could not hand out on time (every call thread busy) goes as soon as one is free.
/// Returning drops `give`, which ends the call threads once they are idle.
fn pace(give: &SyncSender<()>, rate_per_s: u32, stop: &AtomicBool) {
    let start = Instant::now();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let due = start + Duration::from_secs_f64(n as f64 / f64::from(rate_per_s));
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        n += 1;
        if give.send(()).is_err() {
            return;
        }
    }
}

/// One call thread: a whole call for each one handed out on `take`, counted in `tally`,
/// until the pacer is gone.
fn place_calls(mut uac: Uac, take: &Mutex<Receiver<()>>, tally: &Tally) {
    // The lock is held while waiting: the idle threads queue on it, one waits on the channel.
    while lock(take).recv().is_ok() {
        let n = match uac.call(CALL_TIMEOUT) {
            Ok(_) => &tally.ok,
            Err(e) if e.is_cut() => &tally.cut,
            Err(_) => &tally.failed,
        };
        n.fetch_add(1, Ordering::Relaxed);
    }
}

/// A step of the script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// sip2 stops answering.
    Stop,
    /// sip2 starts again on its port.
    Restart,
    /// sip3 answers INVITEs 503 with Retry-After, OPTIONS still 200.
    Sicken,
    /// sip3 answers normally again.
    Heal,
}

/// The steps in order, each at its share of the run.
const PLAN: [(f64, Step); 4] = [
    (0.2, Step::Stop),
    (0.4, Step::Restart),
    (0.6, Step::Sicken),
    (0.8, Step::Heal),
];

/// The scripted run: each step of [`PLAN`] once, in order, at its share of `duration`.
struct Script {
    at: [Duration; PLAN.len()],
    next: usize,
}

impl Script {
    fn new(duration: Duration) -> Script {
        Script {
            at: PLAN.map(|(share, _)| duration.mul_f64(share)),
            next: 0,
        }
    }

    /// The next step due at `t` (from the start of the run), if any; a late look gets every
    /// step due, one per call, in order.
    fn due(&mut self, t: Duration) -> Option<Step> {
        let at = *self.at.get(self.next)?;
        if t < at {
            return None;
        }
        self.next += 1;
        Some(PLAN[self.next - 1].1)
    }
}

/// What the table saw over the run.
struct Watch {
    ejected_seen: Vec<bool>,
    /// INVITE totals when sip3 turned sick, then the INVITEs of the sick phase once it ended.
    sick_from: Option<Vec<u64>>,
    sick_phase_invites: Option<Vec<u64>>,
}

impl Watch {
    /// The INVITEs of the sick phase, ending it at `now_totals` if it has not ended yet.
    fn close_sick_phase(&mut self, now_totals: &[u64]) {
        if let Some(from) = self.sick_from.take() {
            self.sick_phase_invites = Some(
                now_totals
                    .iter()
                    .zip(from)
                    .map(|(n, f)| n.saturating_sub(f))
                    .collect(),
            );
        }
    }
}

/// One line of the table a second until `duration` has passed or `stop` asks to end, with
/// the script carried out on the way and the services' state changes noted as they happen.
fn live_table(
    duration: Duration,
    stop: &Receiver<()>,
    uas: &mut [Uas],
    ops: &Ops,
    b: &Balancer,
    load: &Load,
) -> anyhow::Result<Watch> {
    let start = Instant::now();
    let mut script = Script::new(duration);
    let mut watch = Watch {
        ejected_seen: vec![false; uas.len()],
        sick_from: None,
        sick_phase_invites: None,
    };
    let mut last_calls: Vec<u64> = vec![0; uas.len()];
    let mut tick = start + Duration::from_secs(1);
    let mut last_state: Vec<Option<Cell>> = vec![None; uas.len()];
    loop {
        let end = start + duration;
        let wake = tick.min(Instant::now() + POLL).min(end);
        if is_stopped_before(stop, wake) {
            break;
        }
        let t = start.elapsed();
        while let Some(step) = script.due(t) {
            carry_out(step, t, uas, &mut watch)?;
        }
        let now = ops.with_vservers(|_, now| now).unwrap_or_default();
        for (i, last) in last_state.iter_mut().enumerate() {
            let cell = Cell::of(b, i, now);
            watch.ejected_seen[i] |= cell.state == "EJECTED";
            if last.as_ref().is_some_and(|l| l.is_same_state(&cell)) {
                continue;
            }
            if let Some(l) = last {
                println!(
                    "-- t={:>2}s sip{} is {}",
                    t.as_secs(),
                    i + 1,
                    cell.describe(l)
                );
            }
            *last = Some(cell);
        }
        if Instant::now() >= tick {
            tick += Duration::from_secs(1);
            let rows = sample_services(uas, b, now, &mut last_calls);
            let (ok, failed, cut) = load.calls();
            println!("{}", table_line(t, &rows, ok, failed, cut));
        }
        if Instant::now() >= end {
            break;
        }
    }
    watch.close_sick_phase(&invites(uas));
    Ok(watch)
}

/// Waits until `until`; true when a message on `stop` came first.
fn is_stopped_before(stop: &Receiver<()>, until: Instant) -> bool {
    let wait = until.saturating_duration_since(Instant::now());
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

/// Carries out `step` on the UAS and says so.
fn carry_out(step: Step, t: Duration, uas: &mut [Uas], watch: &mut Watch) -> anyhow::Result<()> {
    let at = format!("-- t={:>2}s", t.as_secs());
    match step {
        Step::Stop => {
            uas[OUTAGE_SERVICE].stop();
            println!(
                "{at} sip2 stopped: INVITEs sent there fail over after 1 s; its monitor will \
                 notice"
            );
        }
        Step::Restart => {
            uas[OUTAGE_SERVICE].restart()?;
            println!("{at} sip2 restarted: the monitor brings it UP, slow start ramps it up");
        }
        Step::Sicken => {
            watch.sick_from = Some(invites(uas));
            uas[SICK_SERVICE].set_sick(Some(SICK_RETRY_AFTER_S));
            println!(
                "{at} sip3 sick: INVITEs answered 503 (Retry-After: {SICK_RETRY_AFTER_S}), \
                 OPTIONS still 200; failover moves its calls, ejection will follow"
            );
        }
        Step::Heal => {
            uas[SICK_SERVICE].set_sick(None);
            watch.close_sick_phase(&invites(uas));
            println!(
                "{at} sip3 healthy again: after its ejection, one trial call (half-open), then \
                 its full share"
            );
        }
    }
    Ok(())
}

/// A service's state as the vserver sees it, with what goes with it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cell {
    /// One of [`crate::balancer::STATE_NAMES`], as `/status` shows it.
    state: &'static str,
    /// Under ejection: whole seconds left, or `None` in half-open.
    ejected_for_s: Option<Option<u64>>,
    /// Why it was ejected (`code_503`, `timeout`, ...).
    reason: Option<String>,
}

impl Cell {
    fn of(b: &Balancer, member: usize, now: Nanos) -> Cell {
        let state = b.state_name(member, now);
        // A service DOWN (or out of service) says so; its ejection is beside the point.
        let ejection = b
            .ejection(member, now)
            .filter(|e| state == "EJECTED" && e.is_ejected());
        Cell {
            state,
            ejected_for_s: ejection.map(|e| match e.phase {
                Some(Phase::Ejected { .. }) => Some(e.remaining_ns.div_ceil(1_000_000_000)),
                _ => None,
            }),
            reason: ejection.and_then(|e| e.reason).map(|c| c.name()),
        }
    }

    /// Same state and ejection phase (the seconds left aside).
    fn is_same_state(&self, other: &Cell) -> bool {
        self.state == other.state
            && self.ejected_for_s.map(|s| s.is_some()) == other.ejected_for_s.map(|s| s.is_some())
    }

    /// The state in words, for the event lines, coming from `before`.
    fn describe(&self, before: &Cell) -> String {
        match (self.state, self.ejected_for_s) {
            ("UP", _) if before.state == "EJECTED" => {
                "UP: its trial call after the ejection succeeded, it takes its full share".into()
            }
            ("EJECTED", Some(Some(s))) => format!(
                "EJECTED by the vserver ({}, {s} s): new calls skip it",
                self.reason.as_deref().unwrap_or("?")
            ),
            ("EJECTED", _) => "EJECTED, half-open: one trial call at a time".into(),
            (state, _) => state.into(),
        }
    }
}

/// One service's cells in a line of the table.
struct ServiceRow {
    state: &'static str,
    calls: u64,
    calls_per_s: u64,
    /// Its slow-start limit while it is new, in calls per second.
    new_rate_per_s: Option<u64>,
    /// Under ejection: whole seconds left, or `None` in half-open.
    ejected_for_s: Option<Option<u64>>,
}

/// Each service's row at `now`. `last_calls` holds the totals of the previous line (one
/// second ago, so the difference is the rate) and is updated.
fn sample_services(
    uas: &[Uas],
    b: &Balancer,
    now: Nanos,
    last_calls: &mut [u64],
) -> Vec<ServiceRow> {
    let slow = b.slow_start();
    uas.iter()
        .enumerate()
        .map(|(i, u)| {
            let calls = u.log.invites.load(Ordering::Relaxed);
            let calls_per_s = calls.saturating_sub(last_calls[i]);
            last_calls[i] = calls;
            let cell = Cell::of(b, i, now);
            ServiceRow {
                state: cell.state,
                calls,
                calls_per_s,
                new_rate_per_s: slow.as_ref().and_then(|s| s.status(i)).map(|s| s.rate),
                ejected_for_s: cell.ejected_for_s,
            }
        })
        .collect()
}

/// A line of the table: the time, each service's cells, the load's totals.
fn table_line(t: Duration, rows: &[ServiceRow], ok: u64, failed: u64, cut: u64) -> String {
    let mut line = format!("t={:>3}s ", t.as_secs());
    for (i, r) in rows.iter().enumerate() {
        let note = match (r.ejected_for_s, r.new_rate_per_s) {
            (Some(Some(s)), _) => format!(" {s}s left"),
            (Some(None), _) => " half-open".into(),
            (None, Some(rate)) => format!(" new@{rate}/s"),
            (None, None) => String::new(),
        };
        let _ = write!(
            line,
            "| sip{} {:<7} {:>5} calls {:>3}/s{:<10} ",
            i + 1,
            r.state,
            r.calls,
            r.calls_per_s,
            note
        );
    }
    let _ = write!(line, "| ok {ok} failed {failed} cut {cut}");
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_runs_its_steps_once_and_in_order() {
        let mut s = Script::new(Duration::from_secs(30));
        assert_eq!(s.due(Duration::from_secs(5)), None);
        assert_eq!(s.due(Duration::from_secs(6)), Some(Step::Stop));
        assert_eq!(s.due(Duration::from_secs(7)), None);
        assert_eq!(s.due(Duration::from_secs(12)), Some(Step::Restart));
        assert_eq!(s.due(Duration::from_secs(17)), None);
        assert_eq!(s.due(Duration::from_secs(18)), Some(Step::Sicken));
        assert_eq!(s.due(Duration::from_secs(23)), None);
        assert_eq!(s.due(Duration::from_secs(24)), Some(Step::Heal));
        assert_eq!(s.due(Duration::from_secs(29)), None);
        // A look late enough for every step gets them all, in the order of the plan.
        let mut late = Script::new(Duration::from_secs(30));
        let got: Vec<Step> = std::iter::from_fn(|| late.due(Duration::from_secs(30))).collect();
        assert_eq!(got, PLAN.map(|(_, step)| step));
    }

    #[test]
    fn the_phases_leave_time_for_what_they_show() {
        // sip2 is back (its monitor needs 2 probes, 1 s) before sip3 turns sick: an
        // ejection of sip3 while sip2 is still half-open would pass max_fraction.
        let s = Script::new(Duration::from_secs(30));
        assert!(s.at[2] - s.at[1] >= Duration::from_secs(5));
        // sip3's second ejection (Retry-After then 4 s) ends after it has healed, so its
        // trial call then succeeds: 3 s + 4 s after it turned sick.
        let second_ends = s.at[2] + Duration::from_secs(u64::from(SICK_RETRY_AFTER_S) + 4);
        assert!(second_ends > s.at[3] && second_ends < Duration::from_secs(30));
    }

    #[test]
    fn the_sick_phase_counts_the_invites_between_its_ends() {
        let mut w = Watch {
            ejected_seen: vec![false; 3],
            sick_from: Some(vec![10, 20, 30]),
            sick_phase_invites: None,
        };
        w.close_sick_phase(&[50, 60, 31]);
        assert_eq!(w.sick_phase_invites, Some(vec![40, 40, 1]));
        // Closed once: the end of the run does not close it again.
        w.close_sick_phase(&[90, 90, 90]);
        assert_eq!(w.sick_phase_invites, Some(vec![40, 40, 1]));
    }

    #[test]
    fn table_line_keeps_its_columns() {
        let row = |state, calls, calls_per_s, new_rate_per_s, ejected_for_s| ServiceRow {
            state,
            calls,
            calls_per_s,
            new_rate_per_s,
            ejected_for_s,
        };
        let rows = [
            row("UP", 397, 60, None, None),
            row("DOWN", 1, 1, Some(5), None),
            row("EJECTED", 120, 0, None, Some(Some(3))),
            row("EJECTED", 121, 1, None, Some(None)),
        ];
        assert_eq!(
            table_line(Duration::from_millis(8_400), &rows, 956, 0, 1),
            "t=  8s | sip1 UP        397 calls  60/s           \
             | sip2 DOWN        1 calls   1/s new@5/s   \
             | sip3 EJECTED   120 calls   0/s 3s left   \
             | sip4 EJECTED   121 calls   1/s half-open | ok 956 failed 0 cut 1"
        );
    }
}
