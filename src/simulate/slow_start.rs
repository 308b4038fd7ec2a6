//! `fulcrum simulate slow-start SCENARIO.yaml [--json] [--plot FILE.svg]`: runs a slow-start
//! scenario through the real [`crate::methods::pick`] and [`crate::slow_start::SlowStart`] with
//! simulated time and reports requests per second per service. PURE (the CLI reads the file and
//! writes the outputs).
//!
//! There is no model of slow start here: every simulated request goes through
//! [`SlowStart::route`] exactly as the data path's requests do, so the tables this prints are
//! what the proxy does.
//!
//! # Scenario
//! ```yaml
//! method: round_robin          # any non-hash method
//! offered_rate: 100            # requests per second, spread evenly within each second
//! slow_start: { new_service_request_rate: 4, unit: per_second, increment_interval: 10s }
//! services: [Service1, Service2, Service3, Service4]   # UP at t=0; or {name: S1, weight: 2}
//! report_every: 10s            # each row = mean rate over the window ending at t
//! duration: 50s
//! hold: 0s                     # optional: how long a request keeps its service busy
//!                              # (open connections, for least_connection and friends)
//! events:
//!   - { at: 0s, add: Service5 }          # optional `weight: N`
//!   - { at: 20s, set_rate: 20 }          # operator sets new_service_request_rate
//!   - { at: 30s, down: Service2 }        # also `up:` and `remove:`
//! ```
//!
//! # Timeline
//! The simulation starts one report window before t=0, with the initial services only, so the
//! first row (t=0) shows the steady state before any event, as in the reference tables of docs/slow_start.md. Events at
//! time `at` apply before the requests at that instant. Rows are emitted at t = 0,
//! `report_every`, 2×`report_every`, ... up to `duration`; each gives the mean rate over the
//! window ending at t. A row's `rates` map holds every service of the scenario (0 while it is
//! absent), keyed by name; maps iterate in name order, while [`SimResult::services`] keeps the
//! scenario order (initial services, then services added by events), which the table and the
//! plot use.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt::Write as _;
use std::time::Duration;

use serde::Deserialize;

use crate::config::{Method, RateUnit, SlowStart as SlowStartParams};
use crate::methods::{self, MethodState};
use crate::slow_start::{ExitReason, SlowStart};
use crate::stats::{NANOS_PER_SEC, Nanos, ServiceCounters};

/// Upper bound on simulated requests, so a typo (`offered_rate: 1000000`, `duration: 10h`)
/// fails fast instead of running for hours.
pub const MAX_REQUESTS: u64 = 20_000_000;

/// Upper bound on report rows (`duration / report_every`): each row is kept for the table and
/// the JSON, so `report_every: 5us` over a minute must be refused, not fill the memory.
pub const MAX_REPORTS: u64 = 100_000;

/// Upper bound on the rates reported (rows × services): each row keeps one rate per service,
/// so a few hundred services over 100,000 rows would fill the memory as surely (300 services
/// over 99,000 rows took 2.4 GB).
pub const MAX_REPORT_VALUES: u64 = 1_000_000;

/// A scenario that cannot be simulated.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("scenario YAML: {0}")]
    Yaml(#[from] serde_saphyr::Error),
    #[error("method: unknown method `{0}`")]
    UnknownMethod(String),
    #[error("method: `{0}` is a hash method; slow start applies only to non-hash methods")]
    HashMethod(String),
    #[error("{field}: `{value}` is not a duration (examples: 10s, 250ms, 1.5s, 2m)")]
    BadDuration { field: String, value: String },
    #[error("slow_start.unit: `{0}` is not per_second or percent")]
    BadUnit(String),
    #[error("offered_rate: must be at least 1 request per second")]
    ZeroOfferedRate,
    #[error("report_every: must be longer than 0")]
    ZeroReportEvery,
    #[error("duration: must be at least report_every")]
    DurationTooShort,
    #[error("services: at least one service is needed")]
    NoServices,
    #[error("{field}: service `{name}` has weight {weight}; weights are 1..=100")]
    BadWeight {
        field: String,
        name: String,
        weight: u32,
    },
    #[error("services: `{0}` appears twice")]
    DuplicateService(String),
    #[error("events[{event}]: needs exactly one of add, remove, up, down, set_rate")]
    EventAction { event: usize },
    #[error("events[{event}]: unknown service `{name}`")]
    UnknownService { event: usize, name: String },
    #[error("events[{event}]: service `{name}` is already part of the vserver")]
    AlreadyPresent { event: usize, name: String },
    #[error("events[{event}]: `at` is negative or beyond duration")]
    EventOutOfRange { event: usize },
    #[error("the scenario needs {requests} requests; the limit is {MAX_REQUESTS}")]
    TooLarge { requests: u64 },
    #[error(
        "report_every: the scenario would report {rows} rows (duration / report_every); the limit is {MAX_REPORTS}"
    )]
    TooManyReports { rows: u64 },
    #[error(
        "report_every: the scenario would report {values} rates ({rows} rows of {services} services); the limit is {MAX_REPORT_VALUES}"
    )]
    TooManyReportValues {
        rows: u64,
        services: usize,
        values: u64,
    },
}

/// One report row: mean requests per second per service over the window ending at `t`.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Seconds from the scenario's t=0 (the end of the window).
    pub t: f64,
    pub rates: BTreeMap<String, f64>,
}

/// A service leaving slow start during the simulation.
#[derive(Debug, Clone, PartialEq)]
pub struct ExitRecord {
    pub t: f64,
    pub service: String,
    pub reason: ExitReason,
}

/// What a scenario produced.
#[derive(Debug, Clone, PartialEq)]
pub struct SimResult {
    pub method: Method,
    pub offered_rate: u64,
    /// Scenario order: initial services, then services added by events.
    pub services: Vec<String>,
    pub rows: Vec<Row>,
    pub exits: Vec<ExitRecord>,
    /// Requests no service could take (every service DOWN or removed).
    pub dropped: u64,
}

impl SimResult {
    /// The rate of `service` in the row at time `t` (seconds), if both exist.
    pub fn rate(&self, t: f64, service: &str) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| (r.t - t).abs() < 1e-9)
            .and_then(|r| r.rates.get(service).copied())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScenario {
    method: String,
    offered_rate: u64,
    #[serde(default)]
    slow_start: Option<RawSlowStart>,
    services: Vec<RawService>,
    report_every: RawDuration,
    duration: RawDuration,
    #[serde(default)]
    hold: Option<RawDuration>,
    #[serde(default)]
    events: Vec<RawEvent>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSlowStart {
    new_service_request_rate: u32,
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    increment_interval: Option<RawDuration>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawService {
    Name(String),
    Full {
        name: String,
        #[serde(default)]
        weight: Option<u32>,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEvent {
    at: RawDuration,
    #[serde(default)]
    add: Option<String>,
    #[serde(default)]
    weight: Option<u32>,
    #[serde(default)]
    remove: Option<String>,
    #[serde(default)]
    up: Option<String>,
    #[serde(default)]
    down: Option<String>,
    #[serde(default)]
    set_rate: Option<u32>,
}

/// A duration as written: `"10s"`, `"250ms"`, or a bare number of seconds.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawDuration {
    Int(u64),
    Text(String),
}

impl RawDuration {
    fn to_nanos(&self, field: &str) -> Result<Nanos, ScenarioError> {
        let bad = || ScenarioError::BadDuration {
            field: field.to_string(),
            value: match self {
                RawDuration::Int(n) => n.to_string(),
                RawDuration::Text(s) => s.clone(),
            },
        };
        match self {
            RawDuration::Int(secs) => secs.checked_mul(NANOS_PER_SEC).ok_or_else(bad),
            RawDuration::Text(s) => parse_duration(s).ok_or_else(bad),
        }
    }
}

/// Parses `<decimal><unit>` with unit `h`, `m`, `s`, `ms`, `us` or `ns` (or none: seconds)
/// exactly into nanoseconds, without going through floating point.
fn parse_duration(s: &str) -> Option<Nanos> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let unit_ns: u64 = match unit.trim() {
        "h" => 3600 * NANOS_PER_SEC,
        "m" | "min" => 60 * NANOS_PER_SEC,
        "s" | "" => NANOS_PER_SEC,
        "ms" => 1_000_000,
        "us" | "µs" => 1_000,
        "ns" => 1,
        _ => return None,
    };
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    let int_v: u64 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let mut total = int_v.checked_mul(unit_ns)?;
    // Fractional digits: value = digits / 10^len × unit_ns, kept exact in u128.
    if !frac.is_empty() {
        if frac.len() > 18 || !frac.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let digits: u128 = frac.parse().ok()?;
        let scale = 10u128.pow(u32::try_from(frac.len()).ok()?);
        let part = u64::try_from(digits * u128::from(unit_ns) / scale).ok()?;
        total = total.checked_add(part)?;
    }
    Some(total)
}

enum Action {
    Add(usize),
    Remove(usize),
    Up(usize),
    Down(usize),
    SetRate(u32),
}

struct Event {
    at: Nanos,
    action: Action,
    /// Position in the file, for error messages.
    index: usize,
}

struct Scenario {
    method: Method,
    offered_rate: u64,
    slow_start: Option<SlowStartParams>,
    names: Vec<String>,
    weights: Vec<u32>,
    initial: usize,
    report_every: Nanos,
    duration: Nanos,
    hold: Nanos,
    events: Vec<Event>,
}

fn check_weight(field: &str, name: &str, weight: u32) -> Result<u32, ScenarioError> {
    if (1..=100).contains(&weight) {
        Ok(weight)
    } else {
        Err(ScenarioError::BadWeight {
            field: field.to_string(),
            name: name.to_string(),
            weight,
        })
    }
}

/// The scenario's clock in nanoseconds: a window longer than 0, a duration of at least one
/// window, at most [`MAX_REPORTS`] rows.
struct Timing {
    report_every: Nanos,
    duration: Nanos,
    hold: Nanos,
    /// `duration / report_every`, the row count the limits are taken on.
    rows: u64,
}

/// Reads and checks a scenario. The checks stop at the first problem, in this order: the
/// YAML, method and rates, timing, services, events, then the size limits.
fn parse(yaml: &str) -> Result<Scenario, ScenarioError> {
    let raw: RawScenario = serde_saphyr::from_str(yaml)?;
    let method = read_method(&raw.method)?;
    if raw.offered_rate == 0 {
        return Err(ScenarioError::ZeroOfferedRate);
    }
    let slow_start = raw.slow_start.as_ref().map(read_slow_start).transpose()?;
    let timing = read_timing(&raw)?;
    let (mut names, mut weights) = read_services(&raw.services)?;
    let initial = names.len();
    let events = read_events(&raw.events, timing.duration, &mut names, &mut weights)?;
    check_membership(&events, &names, initial)?;
    check_size(raw.offered_rate, &timing, names.len())?;
    Ok(Scenario {
        method,
        offered_rate: raw.offered_rate,
        slow_start,
        names,
        weights,
        initial,
        report_every: timing.report_every,
        duration: timing.duration,
        hold: timing.hold,
        events,
    })
}

/// The method called `name`; slow start applies only to non-hash methods.
fn read_method(name: &str) -> Result<Method, ScenarioError> {
    let method = Method::ALL
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, m)| *m)
        .ok_or_else(|| ScenarioError::UnknownMethod(name.to_string()))?;
    if method.is_hash() {
        return Err(ScenarioError::HashMethod(name.to_string()));
    }
    Ok(method)
}

/// The `slow_start` section as the core's parameters: per second and no increment interval
/// unless given.
fn read_slow_start(raw: &RawSlowStart) -> Result<SlowStartParams, ScenarioError> {
    let unit = match raw.unit.as_deref() {
        None | Some("per_second") => RateUnit::PerSecond,
        Some("percent") => RateUnit::Percent,
        Some(other) => return Err(ScenarioError::BadUnit(other.to_string())),
    };
    let interval_ns = match &raw.increment_interval {
        None => 0,
        Some(d) => d.to_nanos("slow_start.increment_interval")?,
    };
    Ok(SlowStartParams {
        new_service_request_rate: raw.new_service_request_rate,
        unit,
        increment_interval: Duration::from_nanos(interval_ns),
    })
}

/// `report_every`, `duration` and `hold` in nanoseconds, checked against each other.
fn read_timing(raw: &RawScenario) -> Result<Timing, ScenarioError> {
    let report_every = raw.report_every.to_nanos("report_every")?;
    let duration = raw.duration.to_nanos("duration")?;
    let hold = match &raw.hold {
        None => 0,
        Some(d) => d.to_nanos("hold")?,
    };
    if report_every == 0 {
        return Err(ScenarioError::ZeroReportEvery);
    }
    if duration < report_every {
        return Err(ScenarioError::DurationTooShort);
    }
    let rows = duration / report_every;
    if rows > MAX_REPORTS {
        return Err(ScenarioError::TooManyReports { rows });
    }
    Ok(Timing {
        report_every,
        duration,
        hold,
        rows,
    })
}

/// The initial services' names and weights in file order (a bare name has weight 1).
fn read_services(raw: &[RawService]) -> Result<(Vec<String>, Vec<u32>), ScenarioError> {
    if raw.is_empty() {
        return Err(ScenarioError::NoServices);
    }
    let mut names: Vec<String> = Vec::new();
    let mut weights = Vec::new();
    for s in raw {
        let (name, weight) = match s {
            RawService::Name(n) => (n.clone(), 1),
            RawService::Full { name, weight } => (
                name.clone(),
                check_weight("services", name, weight.unwrap_or(1))?,
            ),
        };
        if names.contains(&name) {
            return Err(ScenarioError::DuplicateService(name));
        }
        names.push(name);
        weights.push(weight);
    }
    Ok((names, weights))
}

/// The events in the order they apply. A service an event adds joins `names` and `weights`
/// the first time it is named, so later events may refer to it.
fn read_events(
    raw: &[RawEvent],
    duration: Nanos,
    names: &mut Vec<String>,
    weights: &mut Vec<u32>,
) -> Result<Vec<Event>, ScenarioError> {
    let mut events = Vec::new();
    for (index, e) in raw.iter().enumerate() {
        let at = e.at.to_nanos(&format!("events[{index}].at"))?;
        if at > duration {
            return Err(ScenarioError::EventOutOfRange { event: index });
        }
        let action = read_action(index, e, names, weights)?;
        events.push(Event { at, action, index });
    }
    // Stable: events at the same instant apply in file order.
    events.sort_by_key(|e| e.at);
    Ok(events)
}

/// The one action of event number `event`.
fn read_action(
    event: usize,
    e: &RawEvent,
    names: &mut Vec<String>,
    weights: &mut Vec<u32>,
) -> Result<Action, ScenarioError> {
    let actions = [
        e.add.is_some(),
        e.remove.is_some(),
        e.up.is_some(),
        e.down.is_some(),
        e.set_rate.is_some(),
    ];
    if actions.iter().filter(|&&a| a).count() != 1 {
        return Err(ScenarioError::EventAction { event });
    }
    let position = |names: &[String], name: &str| names.iter().position(|x| x == name);
    if let Some(name) = &e.add {
        let weight = check_weight(&format!("events[{event}]"), name, e.weight.unwrap_or(1))?;
        let idx = match position(names, name) {
            Some(i) => i,
            None => {
                names.push(name.clone());
                weights.push(weight);
                names.len() - 1
            }
        };
        return Ok(Action::Add(idx));
    }
    let known = |name: &String| {
        position(names, name).ok_or_else(|| ScenarioError::UnknownService {
            event,
            name: name.clone(),
        })
    };
    Ok(if let Some(name) = &e.remove {
        Action::Remove(known(name)?)
    } else if let Some(name) = &e.up {
        Action::Up(known(name)?)
    } else if let Some(name) = &e.down {
        Action::Down(known(name)?)
    } else {
        Action::SetRate(e.set_rate.unwrap_or(0))
    })
}

/// Replays membership through the sorted events so that adding a service that is already
/// there is reported, not ignored.
fn check_membership(
    events: &[Event],
    names: &[String],
    initial: usize,
) -> Result<(), ScenarioError> {
    let mut present: Vec<bool> = (0..names.len()).map(|i| i < initial).collect();
    for e in events {
        match e.action {
            Action::Add(i) if present[i] => {
                return Err(ScenarioError::AlreadyPresent {
                    event: e.index,
                    name: names[i].clone(),
                });
            }
            Action::Add(i) => present[i] = true,
            Action::Remove(i) => present[i] = false,
            _ => {}
        }
    }
    Ok(())
}

/// The limits on what a run keeps and does: [`MAX_REPORT_VALUES`] rates and
/// [`MAX_REQUESTS`] requests.
fn check_size(offered_rate: u64, timing: &Timing, services: usize) -> Result<(), ScenarioError> {
    // Every row has a rate for every service, those added by events included.
    let values = timing
        .rows
        .saturating_mul(u64::try_from(services).unwrap_or(u64::MAX));
    if values > MAX_REPORT_VALUES {
        return Err(ScenarioError::TooManyReportValues {
            rows: timing.rows,
            services,
            values,
        });
    }
    let requests = request_count(offered_rate, timing.duration, timing.report_every);
    if requests > u128::from(MAX_REQUESTS) {
        return Err(ScenarioError::TooLarge {
            requests: u64::try_from(requests).unwrap_or(u64::MAX),
        });
    }
    Ok(())
}

/// Requests a run makes: `offered_rate` over `duration` and the warm-up window before t=0.
fn request_count(offered_rate: u64, duration: Nanos, report_every: Nanos) -> u128 {
    let span = u128::from(duration) + u128::from(report_every);
    u128::from(offered_rate) * span / u128::from(NANOS_PER_SEC)
}

/// Parses a scenario without running it: the number of requests its simulation makes
/// (at most [`MAX_REQUESTS`]).
pub fn check_scenario(yaml: &str) -> Result<u64, ScenarioError> {
    let sc = parse(yaml)?;
    let requests = request_count(sc.offered_rate, sc.duration, sc.report_every);
    Ok(u64::try_from(requests).unwrap_or(u64::MAX))
}

/// Parses and runs a scenario.
pub fn run_scenario(yaml: &str) -> Result<SimResult, ScenarioError> {
    let sc = parse(yaml)?;
    Ok(simulate(&sc))
}

/// Simulated time: the scenario's t=0 is `report_every` nanoseconds after the start, so the
/// warm-up window fits before it and every timestamp stays a non-negative [`Nanos`].
fn simulate(sc: &Scenario) -> SimResult {
    let n = sc.names.len();
    let origin = sc.report_every;
    let end = origin + sc.duration / sc.report_every * sc.report_every;
    let state = MethodState::new(&sc.weights);
    let counters: Vec<ServiceCounters> = (0..n).map(|_| ServiceCounters::new()).collect();
    let mut present: Vec<bool> = (0..n).map(|i| i < sc.initial).collect();
    let mut up = present.clone();
    let mut ss = SlowStart::new(sc.slow_start);
    for i in 0..sc.initial {
        ss.register(i, sc.weights[i], true);
    }
    let mut was_new = vec![false; n];
    let mut releases: BinaryHeap<Reverse<(Nanos, usize)>> = BinaryHeap::new();
    let mut counts = vec![0u64; n];
    let mut rows = Vec::new();
    let mut exits = Vec::new();
    let mut dropped = 0u64;
    let mut next_event = 0;
    let mut next_report = sc.report_every;
    let to_t = |ns: Nanos| (ns as f64 - origin as f64) / NANOS_PER_SEC as f64;
    // Notes every service that stopped being new since the last call.
    let collect_exits = |ss: &SlowStart, was_new: &mut [bool], exits: &mut Vec<ExitRecord>| {
        for (i, was) in was_new.iter_mut().enumerate() {
            let is = ss.is_new(i);
            if let (true, false, Some(exit)) = (*was, is, ss.last_exit(i)) {
                exits.push(ExitRecord {
                    t: to_t(exit.at),
                    service: sc.names[i].clone(),
                    reason: exit.reason,
                });
            }
            *was = is;
        }
    };
    let window_s = sc.report_every as f64 / NANOS_PER_SEC as f64;

    let emit = |at: Nanos, counts: &mut Vec<u64>, rows: &mut Vec<Row>| {
        let rates = sc
            .names
            .iter()
            .zip(counts.iter())
            .map(|(name, &c)| (name.clone(), c as f64 / window_s))
            .collect();
        rows.push(Row { t: to_t(at), rates });
        counts.iter_mut().for_each(|c| *c = 0);
    };

    let mut j: u64 = 0;
    loop {
        // Request j of the evenly spaced stream, in integer nanoseconds.
        let now =
            u64::try_from(u128::from(j) * u128::from(NANOS_PER_SEC) / u128::from(sc.offered_rate))
                .unwrap_or(u64::MAX);
        while next_report <= end && now >= next_report {
            emit(next_report, &mut counts, &mut rows);
            next_report += sc.report_every;
        }
        if now >= end {
            break;
        }
        while let Some(&Reverse((t, i))) = releases.peek() {
            if t > now {
                break;
            }
            releases.pop();
            counters[i].close();
        }
        while let Some(e) = sc.events.get(next_event) {
            let at = origin + e.at;
            if at > now {
                break;
            }
            apply(e, at, &mut ss, &mut present, &mut up, &sc.weights);
            collect_exits(&ss, &mut was_new, &mut exits);
            next_event += 1;
        }
        let chosen = ss.route(now, |cap| {
            methods::pick(
                sc.method,
                &state,
                &counters,
                &sc.weights,
                |i| present[i] && up[i] && cap(i),
                now,
            )
        });
        match chosen {
            Some(i) => {
                counts[i] += 1;
                counters[i].record_request();
                counters[i].record_traffic(1, 1, now);
                if sc.hold > 0 {
                    counters[i].open();
                    releases.push(Reverse((now.saturating_add(sc.hold), i)));
                }
            }
            None => dropped += 1,
        }
        collect_exits(&ss, &mut was_new, &mut exits);
        j += 1;
    }
    SimResult {
        method: sc.method,
        offered_rate: sc.offered_rate,
        services: sc.names.clone(),
        rows,
        exits,
        dropped,
    }
}

fn apply(
    e: &Event,
    at: Nanos,
    ss: &mut SlowStart,
    present: &mut [bool],
    up: &mut [bool],
    weights: &[u32],
) {
    match e.action {
        Action::Add(i) => {
            if !present[i] {
                present[i] = true;
                up[i] = true;
                ss.add_service(i, weights[i], true, at);
            }
        }
        Action::Remove(i) => {
            present[i] = false;
            up[i] = false;
            ss.remove_service(i, at);
        }
        Action::Up(i) => {
            up[i] = true;
            ss.set_up(i, true, at);
        }
        Action::Down(i) => {
            up[i] = false;
            ss.set_up(i, false, at);
        }
        Action::SetRate(r) => ss.set_rate(r, at),
    }
}

fn reason_text(r: ExitReason) -> &'static str {
    match r {
        ExitReason::BelowRate => "actual request rate below the new-service rate",
        ExitReason::NoTraffic => "no traffic in three consecutive intervals",
        ExitReason::MaxIncreases => "rate increased 200 times",
        ExitReason::FullShare => "percentage reached 100",
        ExitReason::Ended => "operator set the rate to 0",
        ExitReason::Down => "went DOWN",
        ExitReason::Removed => "removed",
    }
}

fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v:.2}")
    }
}

/// A text table: one row per report time, one column per service (scenario order), then the
/// slow-start exits.
pub fn render_table(r: &SimResult) -> String {
    let mut out = String::new();
    let width = r.services.iter().map(|s| s.len()).max().unwrap_or(0).max(8);
    let _ = write!(out, "{:>8}", "t (s)");
    for s in &r.services {
        let _ = write!(out, "  {s:>width$}");
    }
    out.push('\n');
    for row in &r.rows {
        let _ = write!(out, "{:>8}", fmt_num(row.t));
        for s in &r.services {
            let v = row.rates.get(s).copied().unwrap_or(0.0);
            let _ = write!(out, "  {:>width$}", format!("{v:.2}"));
        }
        out.push('\n');
    }
    for e in &r.exits {
        let _ = writeln!(
            out,
            "t={}s: {} left slow start ({})",
            fmt_num(e.t),
            e.service,
            reason_text(e.reason)
        );
    }
    if r.dropped > 0 {
        let _ = writeln!(out, "{} requests found no UP service", r.dropped);
    }
    out
}

/// `{"rows":[{"t":10,"rates":{"Service1":24.0,...}},...]}`, t in seconds (an integer when whole).
pub fn render_json(r: &SimResult) -> String {
    // Structs (not `json!` maps) keep the documented key order: t before rates.
    #[derive(serde::Serialize)]
    struct JsonRow<'a> {
        t: serde_json::Value,
        rates: &'a BTreeMap<String, f64>,
    }
    #[derive(serde::Serialize)]
    struct JsonOut<'a> {
        rows: Vec<JsonRow<'a>>,
    }
    let rows = r
        .rows
        .iter()
        .map(|row| JsonRow {
            t: if row.t.fract() == 0.0 && row.t.abs() < 9.0e15 {
                serde_json::Value::from(row.t as i64)
            } else {
                serde_json::Value::from(row.t)
            },
            rates: &row.rates,
        })
        .collect();
    serde_json::to_string(&JsonOut { rows }).unwrap_or_else(|_| String::from("{\"rows\":[]}"))
}

const PALETTE: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

const DASHES: [&str; 5] = [
    "",
    r#" stroke-dasharray="10 6""#,
    r#" stroke-dasharray="3 5""#,
    r#" stroke-dasharray="14 4 3 4""#,
    r#" stroke-dasharray="6 3""#,
];

/// A tick step of 1, 2 or 5 × 10^k giving about `target` intervals over `span`.
fn nice_step(span: f64, target: f64) -> f64 {
    if !(span.is_finite() && span > 0.0) {
        return 1.0;
    }
    let raw = span / target;
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let m = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;")
}

// The SVG canvas and the margins around the plot area, in pixels; the right margin holds
// the legend.
const SVG_WIDTH_PX: f64 = 760.0;
const SVG_HEIGHT_PX: f64 = 420.0;
const MARGIN_LEFT_PX: f64 = 64.0;
const MARGIN_RIGHT_PX: f64 = 170.0;
const MARGIN_TOP_PX: f64 = 44.0;
const MARGIN_BOTTOM_PX: f64 = 56.0;
const PLOT_WIDTH_PX: f64 = SVG_WIDTH_PX - MARGIN_LEFT_PX - MARGIN_RIGHT_PX;
const PLOT_HEIGHT_PX: f64 = SVG_HEIGHT_PX - MARGIN_TOP_PX - MARGIN_BOTTOM_PX;

/// `v`, or 0 when it is not finite, so one odd value cannot push the plot off the canvas.
fn finite_or_zero(v: f64) -> f64 {
    if v.is_finite() { v } else { 0.0 }
}

/// The data ranges the plot area shows and their tick steps.
struct Frame {
    /// First row time, in seconds.
    t0_s: f64,
    /// Last row time, in seconds, at least one second after `t0_s` when the rows span less.
    t1_s: f64,
    /// Time tick step, in seconds.
    x_step_s: f64,
    /// Top of the rate axis, in requests per second.
    y_max: f64,
    /// Rate tick step, in requests per second.
    y_step: f64,
}

impl Frame {
    /// The rows' time span and a rate axis from 0 to a round value above the largest rate.
    fn of(r: &SimResult) -> Frame {
        let t0_s = r.rows.first().map_or(0.0, |x| finite_or_zero(x.t));
        let t1_s = r.rows.last().map_or(1.0, |x| finite_or_zero(x.t));
        let t1_s = if t1_s > t0_s { t1_s } else { t0_s + 1.0 };
        let v_max = r
            .rows
            .iter()
            .flat_map(|row| row.rates.values().copied())
            .map(finite_or_zero)
            .fold(0.0f64, f64::max);
        let y_step = nice_step(v_max.max(1.0), 5.0);
        let y_max = ((v_max.max(1.0) / y_step).ceil() * y_step).max(y_step);
        Frame {
            t0_s,
            t1_s,
            x_step_s: nice_step(t1_s - t0_s, 8.0),
            y_max,
            y_step,
        }
    }

    /// Horizontal pixel of time `t` (seconds).
    fn x(&self, t: f64) -> f64 {
        MARGIN_LEFT_PX + (finite_or_zero(t) - self.t0_s) / (self.t1_s - self.t0_s) * PLOT_WIDTH_PX
    }

    /// Vertical pixel of rate `v`, clamped to the axis.
    fn y(&self, v: f64) -> f64 {
        MARGIN_TOP_PX + PLOT_HEIGHT_PX
            - finite_or_zero(v).clamp(0.0, self.y_max) / self.y_max * PLOT_HEIGHT_PX
    }
}

/// An SVG line plot of the rows: requests per second per service over time, with axes, grid,
/// and a legend. Hand-written: the figure is simple and a plotting crate would be a large
/// dependency for one picture.
pub fn render_svg(r: &SimResult) -> String {
    let frame = Frame::of(r);
    let mut s = String::new();
    svg_header(&mut s, r);
    svg_rate_grid(&mut s, &frame);
    svg_time_grid(&mut s, &frame);
    svg_axes(&mut s);
    for (k, name) in r.services.iter().enumerate() {
        svg_series(&mut s, &frame, &r.rows, name, k);
        svg_legend_entry(&mut s, name, k);
    }
    s.push_str("</svg>\n");
    s
}

/// Colour and dash pattern of the `k`-th service's line. Services with equal rates draw on
/// top of each other; distinct dash patterns keep every one of them visible.
fn series_style(k: usize) -> (&'static str, &'static str) {
    (PALETTE[k % PALETTE.len()], DASHES[k % DASHES.len()])
}

/// The opening tag, the white background and the title.
fn svg_header(s: &mut String, r: &SimResult) {
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{SVG_WIDTH_PX}" height="{SVG_HEIGHT_PX}" viewBox="0 0 {SVG_WIDTH_PX} {SVG_HEIGHT_PX}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="{SVG_WIDTH_PX}" height="{SVG_HEIGHT_PX}" fill="white"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">Slow start: {}, {} req/s offered</text>"#,
        MARGIN_LEFT_PX + PLOT_WIDTH_PX / 2.0,
        xml_escape(r.method.name()),
        r.offered_rate
    );
}

/// Horizontal grid lines and the rate labels, from 0 to the top of the axis.
fn svg_rate_grid(s: &mut String, f: &Frame) {
    let mut v = 0.0;
    while v <= f.y_max + f.y_step * 1e-9 {
        let yy = f.y(v);
        let _ = writeln!(
            s,
            r##"<line x1="{MARGIN_LEFT_PX}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e0e0e0"/>"##,
            MARGIN_LEFT_PX + PLOT_WIDTH_PX
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            MARGIN_LEFT_PX - 6.0,
            yy + 4.0,
            fmt_num((v * 1000.0).round() / 1000.0)
        );
        v += f.y_step;
    }
}

/// Vertical grid lines and the time labels, at the multiples of the step within the rows'
/// span.
fn svg_time_grid(s: &mut String, f: &Frame) {
    let mut t = (f.t0_s / f.x_step_s).ceil() * f.x_step_s;
    while t <= f.t1_s + f.x_step_s * 1e-9 {
        let xx = f.x(t);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" y1="{MARGIN_TOP_PX}" x2="{xx:.1}" y2="{:.1}" stroke="#e0e0e0"/>"##,
            MARGIN_TOP_PX + PLOT_HEIGHT_PX
        );
        let _ = writeln!(
            s,
            r#"<text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            MARGIN_TOP_PX + PLOT_HEIGHT_PX + 18.0,
            fmt_num((t * 1000.0).round() / 1000.0)
        );
        t += f.x_step_s;
    }
}

/// The two axes and their titles.
fn svg_axes(s: &mut String) {
    let _ = writeln!(
        s,
        r#"<polyline points="{MARGIN_LEFT_PX},{MARGIN_TOP_PX} {MARGIN_LEFT_PX},{:.1} {:.1},{:.1}" fill="none" stroke="black"/>"#,
        MARGIN_TOP_PX + PLOT_HEIGHT_PX,
        MARGIN_LEFT_PX + PLOT_WIDTH_PX,
        MARGIN_TOP_PX + PLOT_HEIGHT_PX
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time (s)</text>"#,
        MARGIN_LEFT_PX + PLOT_WIDTH_PX / 2.0,
        SVG_HEIGHT_PX - 14.0
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">requests per second</text>"#,
        MARGIN_TOP_PX + PLOT_HEIGHT_PX / 2.0,
        MARGIN_TOP_PX + PLOT_HEIGHT_PX / 2.0
    );
}

/// The line of the `k`-th service (0 where a row has no rate for it) and a dot per row.
fn svg_series(s: &mut String, f: &Frame, rows: &[Row], name: &str, k: usize) {
    let (color, dash) = series_style(k);
    let rate = |row: &Row| row.rates.get(name).copied().unwrap_or(0.0);
    let points: Vec<String> = rows
        .iter()
        .map(|row| format!("{:.1},{:.1}", f.x(row.t), f.y(rate(row))))
        .collect();
    let _ = writeln!(
        s,
        r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
        points.join(" ")
    );
    // A dot per row: each is the mean over the window ending there, not a sample.
    for row in rows {
        let _ = writeln!(
            s,
            r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{color}"/>"#,
            f.x(row.t),
            f.y(rate(row))
        );
    }
}

/// The `k`-th line of the legend, in the right margin: a sample of the line and the name.
fn svg_legend_entry(s: &mut String, name: &str, k: usize) {
    let (color, dash) = series_style(k);
    let ly = MARGIN_TOP_PX + 10.0 + 20.0 * k as f64;
    let lx = MARGIN_LEFT_PX + PLOT_WIDTH_PX + 16.0;
    let _ = writeln!(
        s,
        r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"{dash}/>"#,
        lx + 24.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
        lx + 30.0,
        ly + 4.0,
        xml_escape(name)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "method: round_robin\noffered_rate: 100\nservices: [A, B]\nreport_every: 1s\nduration: 2s\n";

    #[test]
    fn durations_parse_exactly() {
        assert_eq!(parse_duration("10s"), Some(10 * NANOS_PER_SEC));
        assert_eq!(parse_duration("250ms"), Some(250_000_000));
        assert_eq!(parse_duration("1.5s"), Some(1_500_000_000));
        assert_eq!(parse_duration("2m"), Some(120 * NANOS_PER_SEC));
        assert_eq!(parse_duration("7"), Some(7 * NANOS_PER_SEC));
        assert_eq!(parse_duration("0.000000001s"), Some(1));
        for bad in ["", "s", "1x", "-1s", "1.2.3s", "99999999999999999999h", "."] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn without_slow_start_round_robin_is_even() {
        let r = run_scenario(BASE).map_err(|e| e.to_string());
        let r = r.as_ref().ok();
        assert_eq!(r.and_then(|r| r.rate(2.0, "A")), Some(50.0));
        assert_eq!(r.and_then(|r| r.rate(0.0, "B")), Some(50.0));
        assert_eq!(r.map(|r| r.rows.len()), Some(3));
    }

    #[test]
    fn scenario_errors_are_reported() {
        let cases: &[(&str, &str)] = &[
            ("method: round_robin\n", "scenario YAML"),
            (&BASE.replace("round_robin", "fastest"), "unknown method"),
            (&BASE.replace("round_robin", "call_id_hash"), "hash method"),
            (&BASE.replace("100", "0"), "offered_rate"),
            (&BASE.replace("[A, B]", "[A, A]"), "appears twice"),
            (&BASE.replace("[A, B]", "[]"), "at least one"),
            (
                &BASE.replace("duration: 2s", "duration: 2 parsecs"),
                "duration",
            ),
            (
                &BASE.replace("report_every: 1s", "report_every: 0s"),
                "report_every",
            ),
            (
                &format!("{BASE}events:\n  - {{ at: 1s, down: C }}\n"),
                "unknown service",
            ),
            (&format!("{BASE}events:\n  - {{ at: 1s }}\n"), "exactly one"),
            (
                &format!("{BASE}events:\n  - {{ at: 5s, down: A }}\n"),
                "beyond",
            ),
            (
                &format!("{BASE}events:\n  - {{ at: 1s, add: A }}\n"),
                "already",
            ),
            (&format!("{BASE}bogus: 1\n"), "scenario YAML"),
            (
                &format!("{BASE}slow_start: {{ new_service_request_rate: 1, unit: furlongs }}\n"),
                "unit",
            ),
            (&BASE.replace("100", "100000000"), "limit"),
            // Four million rows of a few requests each: refused before anything is kept
            // (a fuzzing finding: it ran out of memory).
            (
                &BASE.replace("report_every: 1s", "report_every: 500ns"),
                "report_every: the scenario would report 4000000 rows",
            ),
            // 100,000 rows (within their limit) of 11 services, one of them added by an
            // event: 1.1 million rates, refused (300 services took 2.4 GB).
            (
                &format!(
                    "{}events:\n  - {{ at: 1s, add: K }}\n",
                    BASE.replace("[A, B]", "[A, B, C, D, E, F, G, H, I, J]")
                        .replace("report_every: 1s", "report_every: 1ms")
                        .replace("duration: 2s", "duration: 100s")
                        .replace("offered_rate: 100", "offered_rate: 1")
                ),
                "report_every: the scenario would report 1100000 rates (100000 rows of 11 services)",
            ),
        ];
        for (yaml, want) in cases {
            match run_scenario(yaml) {
                Ok(_) => panic!("accepted: {yaml}"),
                Err(e) => assert!(e.to_string().contains(want), "{yaml}: {e}"),
            }
        }
    }

    #[test]
    fn report_values_up_to_the_limit_are_accepted() {
        // 100,000 rows of 10 services: exactly MAX_REPORT_VALUES.
        let yaml = BASE
            .replace("[A, B]", "[A, B, C, D, E, F, G, H, I, J]")
            .replace("report_every: 1s", "report_every: 1ms")
            .replace("duration: 2s", "duration: 100s");
        assert!(check_scenario(&yaml).is_ok(), "{yaml}");
    }

    #[test]
    fn down_service_gets_nothing_and_restarts_slowly() {
        let yaml = "method: least_connection\noffered_rate: 100\n\
            slow_start: { new_service_request_rate: 10, unit: per_second, increment_interval: 0s }\n\
            services: [A, B]\nreport_every: 1s\nduration: 3s\nhold: 50ms\n\
            events:\n  - { at: 1s, down: B }\n  - { at: 2s, up: B }\n";
        let r = run_scenario(yaml).map_err(|e| e.to_string());
        let r = r.as_ref().ok();
        assert_eq!(r.and_then(|r| r.rate(2.0, "B")), Some(0.0));
        assert_eq!(r.and_then(|r| r.rate(2.0, "A")), Some(100.0));
        assert_eq!(r.and_then(|r| r.rate(3.0, "B")), Some(10.0));
        assert_eq!(r.and_then(|r| r.rate(3.0, "A")), Some(90.0));
    }

    #[test]
    fn everything_down_drops() {
        let yaml =
            format!("{BASE}events:\n  - {{ at: 1s, remove: A }}\n  - {{ at: 1s, down: B }}\n");
        let r = run_scenario(&yaml).map_err(|e| e.to_string());
        assert_eq!(r.map(|r| r.dropped), Ok(100));
    }

    #[test]
    fn renderers_produce_their_formats() {
        let r = run_scenario(BASE).map_err(|e| e.to_string());
        let Ok(r) = r else { panic!("{r:?}") };
        let json = render_json(&r);
        assert!(
            json.starts_with(r#"{"rows":[{"t":0,"rates":{"A":50.0,"B":50.0}}"#),
            "{json}"
        );
        let table = render_table(&r);
        assert!(table.contains("50.00"), "{table}");
        let svg = render_svg(&r);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 3);
        // An empty result renders without panicking.
        let empty = SimResult {
            method: Method::RoundRobin,
            offered_rate: 0,
            services: vec!["<x>".into()],
            rows: vec![],
            exits: vec![],
            dropped: 0,
        };
        assert!(render_svg(&empty).contains("&lt;x&gt;"));
        assert!(render_table(&empty).contains("<x>"));
    }
}
