//! Passive ejection (outlier detection) of a vserver's services. PURE: outcomes and `now`
//! in, decisions out; nothing here reads the clock, and nothing here decides what counts as
//! a failure (the data paths do, [`Cause`]).
//!
//! A service that fails `after` requests in a row on a vserver is EJECTED there for `base`,
//! twice as long on each repeated ejection up to `max` (a 503's Retry-After, RFC 3261
//! §21.5.4 and §20.33, asks for at least that long, capped at `max`). When the ejection ends
//! the service is half-open: it takes one new flow at a time (the trial) until one succeeds,
//! so a service still sick costs one request per ejection, not a burst; a failure there ejects
//! it again, doubled. A success resets the count of failures in a row, and a success in
//! half-open ends the ejection and the doubling. A vserver never has more than `max_fraction`
//! of its services ejected (half-open ones count) at once: an ejection that would pass that
//! is not made, and counted ([`EjectView::refused`]).
//!
//! Ejection only bars NEW flows. Dialogs, sessions and connections already pinned to an
//! ejected service continue there (a BYE of a live call still reaches it); monitors neither
//! end an ejection nor reset its count — only live requests do. docs/ejection.md tells the
//! operator's side.
//!
//! A trial whose outcome is never reported (a request whose answer the data path does not
//! judge) would bar the service for ever: a trial older than `base` lapses, and the next new
//! flow may take another. So even then the service gets at most one request per `base`.

use crate::stats::Nanos;
use std::io;
use std::time::Duration;

/// Nanoseconds of a [`Duration`], saturating.
fn nanos(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A vserver's `eject:` parameters (README.md, "Configuration reference").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EjectParams {
    /// Failures in a row that eject a service (at least 1).
    pub after: u32,
    /// Length of a first ejection.
    pub base_ns: Nanos,
    /// Longest ejection, whatever the doubling or a Retry-After asks.
    pub max_ns: Nanos,
    /// The largest share of a vserver's services ejected at once, in ten-thousandths
    /// (5000 is one half).
    pub max_fraction_e4: u32,
}

impl EjectParams {
    /// `{ after: 3, base: 10s, max: 5m, max_fraction: 0.5 }`: on by default.
    pub const DEFAULT: EjectParams = EjectParams {
        after: 3,
        base_ns: 10_000_000_000,
        max_ns: 300_000_000_000,
        max_fraction_e4: 5_000,
    };

    /// The most services of `services` that may be ejected at once (rounded down: a vserver
    /// of one service never ejects it, one of two at one half ejects one).
    pub fn max_ejected(&self, services: usize) -> usize {
        let e4 = u128::from(self.max_fraction_e4.min(10_000));
        usize::try_from(services as u128 * e4 / 10_000).unwrap_or(services)
    }

    /// Length of an ejection that follows `repeats` ejections since the service last
    /// proved itself: `base` × 2^repeats, at most `max`.
    pub fn backoff_ns(&self, repeats: u32) -> Nanos {
        let factor = 1u64.checked_shl(repeats).unwrap_or(u64::MAX);
        self.base_ns.saturating_mul(factor).min(self.max_ns)
    }

    /// How long a half-open trial may go without an outcome before another is allowed.
    pub fn trial_timeout_ns(&self) -> Nanos {
        self.base_ns.max(1)
    }
}

impl Default for EjectParams {
    fn default() -> Self {
        EjectParams::DEFAULT
    }
}

/// What a data path saw go wrong with a service. The data path decides what is a failure:
/// fulcrum's own local errors (no file descriptor left, no local address) never are, and on
/// a `udp` vserver only ICMP errors are (silence is how many UDP services answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// A SIP final response the failover treats as the service's failure (such as 503,
    /// RFC 3261 §21.5.4).
    Code(u16),
    /// No answer in time: a SIP transaction timeout (RFC 3261 §17.1.1.2 Timer B, §17.1.2.2
    /// Timer F) or a connect that did not complete.
    Timeout,
    /// The service refused the connection (TCP reset to the SYN), or closed it at once.
    Refused,
    /// ICMP destination unreachable on a connected datagram socket (RFC 1122 §4.1.3.3).
    Unreachable,
    /// A write toward the service made no progress in time.
    WriteStalled,
    /// The TLS handshake toward the service failed.
    Handshake,
}

impl Cause {
    /// The service's failure a stream connect or write error names; `None` when the error
    /// is fulcrum's own (no descriptor or buffer left, no local address or port, a local
    /// policy refusing the socket) and says nothing of the service.
    pub fn of_stream_error(e: &io::Error) -> Option<Cause> {
        if is_local_error(e) {
            return None;
        }
        match e.kind() {
            io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof => Some(Cause::Refused),
            io::ErrorKind::TimedOut => Some(Cause::Timeout),
            io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => {
                Some(Cause::Unreachable)
            }
            _ => None,
        }
    }

    /// The service's failure a datagram socket's error names: only ICMP errors reported on
    /// a connected socket (port or host unreachable, RFC 1122 §4.1.3.3) are; silence never
    /// is, nor a local error.
    pub fn of_datagram_error(e: &io::Error) -> Option<Cause> {
        if is_local_error(e) {
            return None;
        }
        match e.kind() {
            io::ErrorKind::ConnectionRefused
            | io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable => Some(Cause::Unreachable),
            _ => None,
        }
    }

    /// The reason as `/status` and the logs show it: `refused`, `timeout`, `unreachable`,
    /// `write_stalled`, `handshake`, or `code_503` (the response code).
    pub fn name(self) -> String {
        match self {
            Cause::Code(c) => format!("code_{c}"),
            Cause::Timeout => "timeout".into(),
            Cause::Refused => "refused".into(),
            Cause::Unreachable => "unreachable".into(),
            Cause::WriteStalled => "write_stalled".into(),
            Cause::Handshake => "handshake".into(),
        }
    }
}

/// Whether `e` is fulcrum's own trouble, which says nothing of the service it was meant for:
/// no file descriptor left (EMFILE, ENFILE), no buffer or memory (ENOBUFS, ENOMEM), no local
/// address or port (EADDRNOTAVAIL, EADDRINUSE). A monitor's probe that meets one leaves the
/// service's state as it was (docs/ejection.md, README.md "Health monitors"), a data path's
/// connect that meets one is no failure of the service, for ejection nor for its monitor.
pub fn is_local_error(e: &io::Error) -> bool {
    use nix::libc;
    matches!(
        e.raw_os_error(),
        Some(
            libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::EADDRNOTAVAIL
                | libc::EADDRINUSE
        )
    )
}

/// One failure as a data path reports it: its cause and, for a 503 that carried one, the
/// Retry-After (RFC 3261 §20.33) — the service asked not to be sent anything for that long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    pub cause: Cause,
    pub retry_after: Option<Duration>,
}

impl Failure {
    /// A failure without Retry-After.
    pub fn new(cause: Cause) -> Failure {
        Failure {
            cause,
            retry_after: None,
        }
    }

    /// The same failure carrying the response's Retry-After.
    pub fn with_retry_after(self, retry_after: Option<Duration>) -> Failure {
        Failure {
            retry_after,
            ..self
        }
    }
}

/// The outcome of one request (or connection) as a data path reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The service answered (a SIP response that is not a failover code, a completed
    /// connect).
    Success,
    Failure(Failure),
}

/// Where a service stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Takes new flows.
    Serving,
    /// No new flow before `until`.
    Ejected { since: Nanos, until: Nanos },
    /// Ejection over: one new flow at a time until one succeeds. `trial` is when the
    /// trial under way was taken.
    HalfOpen { trial: Option<Nanos> },
}

/// The ejection state of one service on one vserver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceEjection {
    phase: Phase,
    /// Failures in a row since the last success.
    consecutive: u32,
    /// Ejections since the service last succeeded in half-open: the doubling's exponent.
    repeats: u32,
    /// The latest time a Retry-After among those failures asked the service be left alone.
    retry_until: Option<Nanos>,
    /// Ejections made, ever (for the metrics).
    ejections: u64,
    /// Cause of the failure that made the latest ejection.
    reason: Option<Cause>,
}

/// What a failure led to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Report {
    /// Counted; not (yet) enough to eject.
    Counted,
    /// The service is ejected until then.
    Ejected { until: Nanos },
    /// Enough to eject, but the vserver has `max_fraction` of its services ejected already.
    Refused,
    /// The service is ejected already (a flow it took before): nothing changes.
    Ignored,
}

/// A service's ejection as status pages show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EjectStatus {
    /// `None` while the service serves.
    pub phase: Option<Phase>,
    /// Nanoseconds until the ejection ends (0 in half-open).
    pub remaining_ns: Nanos,
    pub reason: Option<Cause>,
    pub consecutive_failures: u32,
    pub ejections: u64,
}

impl EjectStatus {
    /// Whether the service is under an ejection (ejected or half-open).
    pub fn is_ejected(&self) -> bool {
        self.phase.is_some()
    }
}

impl Default for ServiceEjection {
    fn default() -> Self {
        ServiceEjection::new()
    }
}

impl ServiceEjection {
    /// A serving service with no failure on record.
    pub fn new() -> ServiceEjection {
        ServiceEjection {
            phase: Phase::Serving,
            consecutive: 0,
            repeats: 0,
            retry_until: None,
            ejections: 0,
            reason: None,
        }
    }

    /// The phase at `now`: an ejection whose time is up is half-open, a trial older than
    /// the trial timeout has lapsed.
    pub fn phase(&self, now: Nanos, p: &EjectParams) -> Phase {
        match self.phase {
            Phase::Ejected { until, .. } if now >= until => Phase::HalfOpen { trial: None },
            Phase::HalfOpen { trial: Some(t) } if now >= t.saturating_add(p.trial_timeout_ns()) => {
                Phase::HalfOpen { trial: None }
            }
            other => other,
        }
    }

    fn settle(&mut self, now: Nanos, p: &EjectParams) {
        self.phase = self.phase(now, p);
    }

    /// Ejected or half-open: the state the vserver's `max_fraction` counts.
    pub fn is_restricted(&self) -> bool {
        self.phase != Phase::Serving
    }

    /// Failures in a row since the last success.
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive
    }

    /// Ejections made, ever.
    pub fn ejections(&self) -> u64 {
        self.ejections
    }

    /// From when a new flow may be given to the service: `None` while it serves (always),
    /// else the end of its ejection or of the trial under way (and then only by taking the
    /// trial, [`ServiceEjection::take_for_new`]).
    pub fn not_before(&self, p: &EjectParams) -> Option<Nanos> {
        match self.phase {
            Phase::Serving => None,
            Phase::Ejected { until, .. } => Some(until),
            Phase::HalfOpen { trial: None } => Some(0),
            Phase::HalfOpen { trial: Some(t) } => Some(t.saturating_add(p.trial_timeout_ns())),
        }
    }

    /// Whether a new flow may be given to the service at `now` (without taking anything).
    pub fn is_usable_for_new(&self, now: Nanos, p: &EjectParams) -> bool {
        self.not_before(p).is_none_or(|t| now >= t)
    }

    /// Give the service a new flow at `now` if it may take one: always while it serves; in
    /// half-open only the one trial (taken here). False when ejected or a trial is under way.
    pub fn take_for_new(&mut self, now: Nanos, p: &EjectParams) -> bool {
        self.settle(now, p);
        match self.phase {
            Phase::Serving => true,
            Phase::Ejected { .. } | Phase::HalfOpen { trial: Some(_) } => false,
            Phase::HalfOpen { trial: None } => {
                self.phase = Phase::HalfOpen { trial: Some(now) };
                true
            }
        }
    }

    /// Record a failure at `now`; true when it calls for an ejection (the `after`-th in a
    /// row, or any failure in half-open), which the caller makes with
    /// [`ServiceEjection::eject`] if the vserver allows it.
    fn failure(&mut self, now: Nanos, f: &Failure, p: &EjectParams) -> Option<bool> {
        self.settle(now, p);
        if let Some(ra) = f.retry_after {
            let until = now.saturating_add(nanos(ra));
            self.retry_until = Some(self.retry_until.map_or(until, |u| u.max(until)));
        }
        match self.phase {
            Phase::Ejected { .. } => None,
            Phase::HalfOpen { .. } => Some(true),
            Phase::Serving => {
                self.consecutive = self.consecutive.saturating_add(1);
                Some(self.consecutive >= p.after.max(1))
            }
        }
    }

    /// Eject the service at `now` for `cause`: `base` doubled per repeat, at least until a
    /// reported Retry-After, at most `max`. Returns the end of the ejection.
    fn eject(&mut self, now: Nanos, cause: Cause, p: &EjectParams) -> Nanos {
        let longest = now.saturating_add(p.max_ns);
        let backoff = now.saturating_add(p.backoff_ns(self.repeats));
        let until = self
            .retry_until
            .map_or(backoff, |r| r.max(backoff))
            .min(longest);
        self.phase = Phase::Ejected { since: now, until };
        self.repeats = self.repeats.saturating_add(1);
        self.ejections = self.ejections.saturating_add(1);
        self.consecutive = 0;
        self.retry_until = None;
        self.reason = Some(cause);
        until
    }

    /// Record a success at `now`: the failures in a row start again from zero; in half-open
    /// the ejection ends and so does the doubling. An ejection still running goes on (the
    /// success is of a flow it took before).
    pub fn success(&mut self, now: Nanos, p: &EjectParams) {
        self.settle(now, p);
        self.consecutive = 0;
        self.retry_until = None;
        if let Phase::HalfOpen { .. } = self.phase {
            self.phase = Phase::Serving;
            self.repeats = 0;
        }
    }

    /// End the ejection now (the operator's enable): serving, no failure on record.
    pub fn end(&mut self) -> bool {
        let was = self.is_restricted();
        self.phase = Phase::Serving;
        self.consecutive = 0;
        self.repeats = 0;
        self.retry_until = None;
        was
    }

    /// The state as status pages show it at `now`.
    pub fn status(&self, now: Nanos, p: &EjectParams) -> EjectStatus {
        let phase = self.phase(now, p);
        let remaining_ns = match phase {
            Phase::Ejected { until, .. } => until.saturating_sub(now),
            _ => 0,
        };
        EjectStatus {
            phase: (phase != Phase::Serving).then_some(phase),
            remaining_ns,
            reason: self.reason.filter(|_| phase != Phase::Serving),
            consecutive_failures: self.consecutive,
            ejections: self.ejections,
        }
    }
}

/// The ejection state of every service of one vserver, which enforces `max_fraction`.
/// Members are indexed as the vserver's balancer indexes them; only the first `counted`
/// (those that take new flows, not the ones draining after a reload) may be ejected and
/// count toward `max_fraction`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EjectView {
    params: EjectParams,
    services: Vec<ServiceEjection>,
    counted: usize,
    /// Ejections not made because `max_fraction` of the services were ejected already.
    refused: u64,
}

impl EjectView {
    /// A view of `members` services, none ejected, the first `counted` of which take new
    /// flows.
    pub fn new(params: EjectParams, members: usize, counted: usize) -> EjectView {
        EjectView {
            params,
            services: vec![ServiceEjection::new(); members],
            counted: counted.min(members),
            refused: 0,
        }
    }

    pub fn params(&self) -> &EjectParams {
        &self.params
    }

    /// The state of member `i`.
    pub fn get(&self, i: usize) -> Option<&ServiceEjection> {
        self.services.get(i)
    }

    /// Put `state` (the member's state in the view a reload replaces) in place of member
    /// `i`'s.
    pub fn carry(&mut self, i: usize, state: ServiceEjection) {
        if i < self.counted
            && let Some(s) = self.services.get_mut(i)
        {
            *s = state;
        }
        // A carried ejection may exceed what the new view allows (fewer members): those
        // beyond the bound end, the latest first.
        while self.restricted() > self.max_ejected() {
            let Some(last) = self.services[..self.counted]
                .iter()
                .rposition(ServiceEjection::is_restricted)
            else {
                break;
            };
            self.services[last].end();
        }
    }

    /// Members ejected or half-open now.
    pub fn restricted(&self) -> usize {
        self.services[..self.counted]
            .iter()
            .filter(|s| s.is_restricted())
            .count()
    }

    /// The most members that may be ejected at once.
    pub fn max_ejected(&self) -> usize {
        self.params.max_ejected(self.counted)
    }

    /// Ejections refused by `max_fraction` so far.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Member `i` failed at `now`.
    pub fn failure(&mut self, i: usize, now: Nanos, f: Failure) -> Report {
        let restricted = self.restricted();
        let max = self.max_ejected();
        let p = self.params;
        if i >= self.counted {
            return Report::Ignored;
        }
        let Some(s) = self.services.get_mut(i) else {
            return Report::Ignored;
        };
        let already = s.is_restricted();
        match s.failure(now, &f, &p) {
            None => Report::Ignored,
            Some(false) => Report::Counted,
            // A half-open member ejected again is counted already.
            Some(true) if already || restricted < max => Report::Ejected {
                until: s.eject(now, f.cause, &p),
            },
            Some(true) => {
                self.refused = self.refused.saturating_add(1);
                Report::Refused
            }
        }
    }

    /// Member `i` succeeded at `now`.
    pub fn success(&mut self, i: usize, now: Nanos) {
        let p = self.params;
        if let Some(s) = self.services.get_mut(i) {
            s.success(now, &p);
        }
    }

    /// Whether member `i` may take a new flow at `now`, taking its half-open trial if it is
    /// in half-open ([`ServiceEjection::take_for_new`]).
    pub fn take_for_new(&mut self, i: usize, now: Nanos) -> bool {
        let p = self.params;
        self.services
            .get_mut(i)
            .is_none_or(|s| s.take_for_new(now, &p))
    }

    /// Whether member `i` may take a new flow at `now`, taking nothing.
    pub fn is_usable_for_new(&self, i: usize, now: Nanos) -> bool {
        self.services
            .get(i)
            .is_none_or(|s| s.is_usable_for_new(now, &self.params))
    }

    /// From when member `i` may take a new flow (see [`ServiceEjection::not_before`]).
    pub fn not_before(&self, i: usize) -> Option<Nanos> {
        self.services
            .get(i)
            .and_then(|s| s.not_before(&self.params))
    }

    /// End member `i`'s ejection (the operator's enable); true when it was ejected.
    pub fn end(&mut self, i: usize) -> bool {
        self.services.get_mut(i).is_some_and(ServiceEjection::end)
    }

    /// Member `i`'s state for status pages.
    pub fn status(&self, i: usize, now: Nanos) -> Option<EjectStatus> {
        self.services.get(i).map(|s| s.status(now, &self.params))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: Nanos = 1_000_000_000;

    fn params() -> EjectParams {
        EjectParams {
            after: 3,
            base_ns: 10 * S,
            max_ns: 300 * S,
            max_fraction_e4: 5_000,
        }
    }

    fn refused() -> Failure {
        Failure::new(Cause::Refused)
    }

    #[test]
    fn after_failures_in_a_row_eject_for_base() {
        let mut v = EjectView::new(params(), 3, 3);
        assert_eq!(v.failure(0, S, refused()), Report::Counted);
        assert_eq!(v.failure(0, 2 * S, refused()), Report::Counted);
        assert!(v.is_usable_for_new(0, 2 * S));
        assert_eq!(
            v.failure(0, 3 * S, refused()),
            Report::Ejected { until: 13 * S }
        );
        assert!(!v.is_usable_for_new(0, 3 * S));
        assert!(!v.take_for_new(0, 13 * S - 1));
        let st = v.status(0, 4 * S).expect("member");
        assert_eq!(st.remaining_ns, 9 * S);
        assert_eq!(st.reason, Some(Cause::Refused));
        assert_eq!(st.ejections, 1);
        // Ended: half-open, one trial at a time.
        assert!(v.is_usable_for_new(0, 13 * S));
        assert!(v.take_for_new(0, 13 * S));
        assert!(!v.is_usable_for_new(0, 13 * S));
        assert!(!v.take_for_new(0, 14 * S));
        v.success(0, 14 * S);
        assert!(v.take_for_new(0, 14 * S) && v.take_for_new(0, 14 * S));
        assert!(!v.status(0, 14 * S).expect("member").is_ejected());
    }

    #[test]
    fn a_success_resets_the_failures_in_a_row() {
        let mut v = EjectView::new(params(), 2, 2);
        v.failure(0, S, refused());
        v.failure(0, S, refused());
        v.success(0, S);
        assert_eq!(v.get(0).map(ServiceEjection::consecutive_failures), Some(0));
        assert_eq!(v.failure(0, S, refused()), Report::Counted);
        assert_eq!(v.failure(0, S, refused()), Report::Counted);
        assert!(matches!(v.failure(0, S, refused()), Report::Ejected { .. }));
    }

    #[test]
    fn a_failed_trial_ejects_again_doubled_up_to_max() {
        let p = EjectParams {
            max_ns: 35 * S,
            ..params()
        };
        let mut v = EjectView::new(p, 2, 2);
        let mut now = 0;
        for _ in 0..3 {
            v.failure(0, now, refused());
        }
        let mut lengths = Vec::new();
        let mut until = v.not_before(0).expect("ejected");
        lengths.push(until - now);
        for _ in 0..4 {
            now = until;
            assert!(v.take_for_new(0, now));
            match v.failure(0, now, Failure::new(Cause::Timeout)) {
                Report::Ejected { until: u } => until = u,
                r => panic!("{r:?}"),
            }
            lengths.push(until - now);
        }
        assert_eq!(lengths, [10 * S, 20 * S, 35 * S, 35 * S, 35 * S]);
        assert_eq!(
            v.status(0, now).and_then(|s| s.reason),
            Some(Cause::Timeout)
        );
        // A success in half-open ends the doubling: the next ejection is `base` again.
        now = until;
        assert!(v.take_for_new(0, now));
        v.success(0, now);
        for _ in 0..3 {
            v.failure(0, now, refused());
        }
        assert_eq!(v.not_before(0), Some(now + 10 * S));
    }

    #[test]
    fn retry_after_ejects_at_least_that_long_capped_at_max() {
        let mut v = EjectView::new(params(), 2, 2);
        let f = Failure::new(Cause::Code(503)).with_retry_after(Some(Duration::from_secs(60)));
        v.failure(0, 0, f);
        v.failure(0, S, refused());
        assert_eq!(
            v.failure(0, 2 * S, refused()),
            Report::Ejected { until: 60 * S }
        );
        assert_eq!(
            v.status(0, 2 * S).and_then(|s| s.reason).map(Cause::name),
            Some("refused".to_owned())
        );
        let mut v = EjectView::new(params(), 2, 2);
        let long = f.with_retry_after(Some(Duration::from_secs(3600)));
        for _ in 0..3 {
            v.failure(1, 0, long);
        }
        assert_eq!(v.not_before(1), Some(300 * S));
        // A success forgets an earlier Retry-After.
        let mut v = EjectView::new(params(), 2, 2);
        v.failure(0, 0, long);
        v.success(0, 0);
        for _ in 0..3 {
            v.failure(0, 0, refused());
        }
        assert_eq!(v.not_before(0), Some(10 * S));
    }

    #[test]
    fn no_more_than_max_fraction_is_ejected_and_the_refusal_is_counted() {
        let mut v = EjectView::new(params(), 5, 4);
        assert_eq!(v.max_ejected(), 2);
        for m in 0..4 {
            for _ in 0..3 {
                v.failure(m, 0, refused());
            }
        }
        assert_eq!(v.restricted(), 2);
        assert_eq!(v.refused(), 2);
        assert!(v.is_usable_for_new(2, 0) && v.is_usable_for_new(3, 0));
        // Half-open still counts; a failure there ejects again without a refusal.
        assert!(v.take_for_new(0, 10 * S));
        assert!(matches!(
            v.failure(0, 10 * S, refused()),
            Report::Ejected { .. }
        ));
        assert_eq!(v.failure(2, 10 * S, refused()), Report::Refused);
        // A draining member (beyond `counted`) is never ejected.
        for _ in 0..5 {
            assert_eq!(v.failure(4, 0, refused()), Report::Ignored);
        }
        // One service alone is never ejected.
        let mut one = EjectView::new(params(), 1, 1);
        for _ in 0..10 {
            one.failure(0, 0, refused());
        }
        assert!(one.take_for_new(0, 0));
    }

    #[test]
    fn failures_of_flows_taken_before_the_ejection_change_nothing() {
        let mut v = EjectView::new(params(), 2, 2);
        for _ in 0..3 {
            v.failure(0, 0, refused());
        }
        assert_eq!(v.failure(0, S, refused()), Report::Ignored);
        v.success(0, 2 * S);
        assert_eq!(v.not_before(0), Some(10 * S), "a success does not end it");
    }

    #[test]
    fn a_trial_without_outcome_lapses_after_base() {
        let mut v = EjectView::new(params(), 2, 2);
        for _ in 0..3 {
            v.failure(0, 0, refused());
        }
        assert!(v.take_for_new(0, 10 * S));
        assert!(!v.take_for_new(0, 20 * S - 1));
        assert!(v.take_for_new(0, 20 * S));
    }

    #[test]
    fn the_operator_ends_an_ejection() {
        let mut v = EjectView::new(params(), 2, 2);
        for _ in 0..3 {
            v.failure(1, 0, refused());
        }
        assert!(v.end(1));
        assert!(!v.end(1));
        assert!(v.take_for_new(1, 0) && v.take_for_new(1, 0));
        assert_eq!(v.restricted(), 0);
    }

    #[test]
    fn carried_ejections_keep_within_the_new_bound() {
        let mut old = EjectView::new(params(), 4, 4);
        for m in 0..2 {
            for _ in 0..3 {
                old.failure(m, 0, refused());
            }
        }
        let mut new = EjectView::new(params(), 2, 2);
        for m in 0..2 {
            new.carry(m, old.get(m).cloned().unwrap_or_default());
        }
        assert_eq!(new.restricted(), 1);
        assert!(new.get(0).is_some_and(ServiceEjection::is_restricted));
    }

    /// fulcrum's own errors are never the service's; on datagrams only ICMP errors are.
    #[test]
    fn local_errors_are_not_failures() {
        let os = |e: nix::errno::Errno| io::Error::from_raw_os_error(e as i32);
        use nix::errno::Errno::*;
        for local in [EMFILE, ENFILE, ENOBUFS, ENOMEM, EADDRNOTAVAIL, EADDRINUSE] {
            assert!(is_local_error(&os(local)), "{local}");
        }
        // The service's (or the path's) doing, or nothing the kernel said.
        for theirs in [
            ECONNREFUSED,
            ECONNRESET,
            ETIMEDOUT,
            EHOSTUNREACH,
            ENETUNREACH,
            EPERM,
            EACCES,
        ] {
            assert!(!is_local_error(&os(theirs)), "{theirs}");
        }
        assert!(!is_local_error(&io::ErrorKind::OutOfMemory.into()));
        assert!(!is_local_error(&io::Error::other("TLS handshake failed")));
        for local in [
            EMFILE,
            ENFILE,
            EADDRNOTAVAIL,
            EADDRINUSE,
            ENOBUFS,
            ENOMEM,
            EACCES,
            EPERM,
        ] {
            assert_eq!(Cause::of_stream_error(&os(local)), None, "{local}");
            assert_eq!(Cause::of_datagram_error(&os(local)), None, "{local}");
        }
        assert_eq!(
            Cause::of_stream_error(&os(ECONNREFUSED)),
            Some(Cause::Refused)
        );
        assert_eq!(Cause::of_stream_error(&os(ETIMEDOUT)), Some(Cause::Timeout));
        assert_eq!(
            Cause::of_stream_error(&os(EHOSTUNREACH)),
            Some(Cause::Unreachable)
        );
        assert_eq!(
            Cause::of_datagram_error(&os(ECONNREFUSED)),
            Some(Cause::Unreachable)
        );
        assert_eq!(Cause::of_datagram_error(&os(ETIMEDOUT)), None);
    }

    #[test]
    fn max_ejected_rounds_down() {
        let p = params();
        assert_eq!(
            (0..6).map(|n| p.max_ejected(n)).collect::<Vec<_>>(),
            [0, 0, 1, 1, 2, 2]
        );
        let all = EjectParams {
            max_fraction_e4: 10_000,
            ..p
        };
        assert_eq!(all.max_ejected(3), 3);
        assert_eq!(p.backoff_ns(200), p.max_ns);
    }

    /// One step of a random schedule over a vserver's members.
    #[derive(Debug, Clone)]
    enum Op {
        Fail(usize, Option<u16>),
        Succeed(usize),
        New(usize),
        End(usize),
        Wait(u64),
    }

    fn op(members: usize) -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..members, proptest::option::of(0u16..400)).prop_map(|(m, r)| Op::Fail(m, r)),
            2 => (0..members).prop_map(Op::Succeed),
            3 => (0..members).prop_map(Op::New),
            1 => (0..members).prop_map(Op::End),
            2 => (0u64..40_000).prop_map(Op::Wait),
        ]
    }

    fn params_strategy() -> impl Strategy<Value = EjectParams> {
        (1u32..6, 1u64..5_000, 0u32..10, 0u32..=10_000).prop_map(|(after, base, shift, frac)| {
            EjectParams {
                after,
                base_ns: base * 1_000_000,
                max_ns: base * 1_000_000 * (1 << shift),
                max_fraction_e4: frac,
            }
        })
    }

    proptest! {
        /// Whatever fails or succeeds, no more than `max_fraction` of the members are
        /// ejected (or half-open) at once, every ejection lasts at most `max`, and a member
        /// usable before taking a flow takes it.
        #[test]
        fn never_more_than_max_fraction_ejected(
            p in params_strategy(),
            members in 1usize..9,
            ops in proptest::collection::vec(op(8), 1..300),
        ) {
            let mut v = EjectView::new(p, members, members);
            let mut now: Nanos = 0;
            for o in ops {
                match o {
                    Op::Fail(m, ra) => {
                        let f = Failure::new(Cause::Timeout)
                            .with_retry_after(ra.map(|s| Duration::from_millis(u64::from(s) * 37)));
                        if let Report::Ejected { until } = v.failure(m % members, now, f) {
                            prop_assert!(until > now && until - now <= p.max_ns);
                        }
                    }
                    Op::Succeed(m) => v.success(m % members, now),
                    Op::New(m) => {
                        let usable = v.is_usable_for_new(m % members, now);
                        prop_assert_eq!(v.take_for_new(m % members, now), usable);
                    }
                    Op::End(m) => { v.end(m % members); }
                    Op::Wait(ms) => now += ms * 1_000_000,
                }
                prop_assert!(v.restricted() <= p.max_ejected(members));
            }
        }

        /// A member that fails every request it gets, reported at once, gets its first
        /// `after` requests, then one per ejection: two requests it takes after that are at
        /// least the ejection between them apart (at least `base`), that ejection doubles up
        /// to `max`, and a success afterwards resets it all.
        #[test]
        fn a_sick_service_gets_one_request_per_ejection(
            p in params_strategy(),
            step_ms in 1u64..2_000,
            steps in 2usize..600,
            answered in proptest::bool::ANY,
        ) {
            let p = EjectParams { max_fraction_e4: 10_000, ..p };
            let mut v = EjectView::new(p, 1, 1);
            let mut now: Nanos = 0;
            let mut taken: Vec<Nanos> = Vec::new();
            let mut lengths: Vec<Nanos> = Vec::new();
            let mut before_first_ejection = None;
            for _ in 0..steps {
                // A burst of new flows every step: a sick member takes one at most.
                for _ in 0..4 {
                    if !v.take_for_new(0, now) {
                        continue;
                    }
                    taken.push(now);
                    // Without answers (`answered` false) the trials are never judged.
                    let judged = answered || taken.len() <= p.after as usize;
                    if judged
                        && let Report::Ejected { until } =
                            v.failure(0, now, Failure::new(Cause::Refused))
                    {
                        before_first_ejection.get_or_insert(taken.len());
                        lengths.push(until - now);
                    }
                }
                now += step_ms * 1_000_000;
            }
            prop_assert_eq!(before_first_ejection, Some(p.after as usize));
            let first = p.after as usize;
            for w in taken[first - 1..].windows(2) {
                prop_assert!(w[1] - w[0] >= p.base_ns.min(p.max_ns), "{:?}", w);
            }
            for (k, l) in lengths.iter().enumerate() {
                let want = if answered { p.backoff_ns(k as u32) } else { p.base_ns.min(p.max_ns) };
                prop_assert_eq!(*l, want);
                prop_assert!(*l <= p.max_ns);
            }
            // Recovery: a success in half-open, then `after - 1` failures never eject.
            now += p.max_ns + p.trial_timeout_ns();
            prop_assert!(v.take_for_new(0, now));
            v.success(0, now);
            for _ in 1..p.after {
                prop_assert_eq!(v.failure(0, now, Failure::new(Cause::Refused)), Report::Counted);
            }
            prop_assert!(v.take_for_new(0, now));
        }
    }
}
