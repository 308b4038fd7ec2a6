//! The health state machine of one monitored service. PURE: probe outcomes and `now` in,
//! state changes out; no clock, no I/O.
//!
//! # Initial state
//! A monitored service starts **UP, unconfirmed** (HAProxy's `init-state up`): traffic flows
//! from the first second, as an operator restarting fulcrum in front of a healthy pool
//! expects, but the first failed probe before any success marks it DOWN at once, so a
//! service that is dead at start is taken out after one interval (+ timeout), not after
//! `failures_to_down` intervals. After its first success the thresholds apply:
//! `failures_to_down` consecutive failures take an UP service DOWN, `successes_to_up`
//! consecutive successes bring a DOWN service back UP.
//!
//! # Held DOWN by Retry-After
//! A service that answers its probe 503 with a Retry-After (RFC 3261 §21.5.4, §20.33) says
//! it is unavailable for that long: it goes DOWN at once, whatever `failures_to_down`, and
//! stays DOWN until the Retry-After has passed (at most [`RETRY_AFTER_HOLD_MAX`]). Probes go
//! on meanwhile; their successes do not count toward `successes_to_up`, which counts from the
//! end of the hold. A later 503 with Retry-After replaces the hold: the service's newest word
//! on when to come back is the one that holds.

use crate::stats::Nanos;
use std::time::Duration;

/// The longest a 503's Retry-After holds a service DOWN. A Retry-After of hours (or a
/// mistaken one of 2^32 s) would otherwise take a service out for longer than an operator
/// would look for the reason; past this the monitor's own probes decide again.
pub(crate) const RETRY_AFTER_HOLD_MAX: Duration = Duration::from_secs(5 * 60);

/// What one probe says about the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It answered as a live service does.
    Alive,
    /// It did not answer, or answered as a failing service does.
    Dead,
    /// It answered 503 with a Retry-After of this many seconds: DOWN for that long.
    Unavailable { retry_after_s: u32 },
}

impl Outcome {
    pub fn is_alive(self) -> bool {
        matches!(self, Outcome::Alive)
    }
}

/// A hold in force: the service stays DOWN until `until`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    /// The Retry-After the service sent, in seconds (before the cap).
    pub retry_after_s: u32,
    /// When the hold ends (the Retry-After, capped, after the answer that set it).
    pub until: Nanos,
}

impl Hold {
    /// Time left at `now`, in nanoseconds.
    pub fn remaining(&self, now: Nanos) -> Nanos {
        self.until.saturating_sub(now)
    }
}

/// Threshold counts of a monitor (both >= 1; 0 is treated as 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Thresholds {
    pub failures_to_down: u32,
    pub successes_to_up: u32,
}

/// Where the state machine is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// UP, no probe has succeeded yet: one failure takes it DOWN.
    Unconfirmed,
    Up,
    Down,
}

impl Phase {
    pub fn is_up(self) -> bool {
        !matches!(self, Phase::Down)
    }

    pub fn name(self) -> &'static str {
        match self {
            Phase::Unconfirmed => "UP (unconfirmed)",
            Phase::Up => "UP",
            Phase::Down => "DOWN",
        }
    }
}

/// A change of the service's monitored state the shell must apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transition {
    /// UP → DOWN.
    WentDown,
    /// DOWN → UP (slow start begins where the vserver has it).
    CameUp,
}

/// Consecutive-result counting with hysteresis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HealthState {
    thresholds: Thresholds,
    phase: Phase,
    /// Consecutive failures while UP, consecutive successes while DOWN.
    run: u32,
    /// Set by a 503 with Retry-After; while in force the phase is DOWN.
    hold: Option<Hold>,
}

impl HealthState {
    /// A fresh state: UP, unconfirmed.
    pub(crate) fn new(thresholds: Thresholds) -> HealthState {
        HealthState {
            thresholds: Thresholds {
                failures_to_down: thresholds.failures_to_down.max(1),
                successes_to_up: thresholds.successes_to_up.max(1),
            },
            phase: Phase::Unconfirmed,
            run: 0,
            hold: None,
        }
    }

    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    pub(crate) fn is_up(&self) -> bool {
        self.phase.is_up()
    }

    /// The hold in force at `now`, if any.
    pub(crate) fn hold(&self, now: Nanos) -> Option<Hold> {
        self.hold.filter(|h| now < h.until)
    }

    /// Fold in one probe outcome observed at `now`; returns the transition it causes, if any.
    pub(crate) fn observe(&mut self, now: Nanos, outcome: Outcome) -> Option<Transition> {
        match outcome {
            Outcome::Unavailable { retry_after_s } => {
                let held = Duration::from_secs(u64::from(retry_after_s)).min(RETRY_AFTER_HOLD_MAX);
                let held = u64::try_from(held.as_nanos()).unwrap_or(u64::MAX);
                self.hold = Some(Hold {
                    retry_after_s,
                    until: now.saturating_add(held),
                });
                self.run = 0;
                if self.phase.is_up() {
                    self.phase = Phase::Down;
                    Some(Transition::WentDown)
                } else {
                    None
                }
            }
            // Held: DOWN, and a success before the Retry-After has passed does not count.
            Outcome::Alive if self.hold(now).is_some() => {
                self.run = 0;
                None
            }
            Outcome::Alive => {
                self.hold = None;
                self.count(true)
            }
            Outcome::Dead => self.count(false),
        }
    }

    /// Consecutive-result counting.
    fn count(&mut self, alive: bool) -> Option<Transition> {
        match (self.phase, alive) {
            (Phase::Unconfirmed, true) => {
                self.phase = Phase::Up;
                self.run = 0;
                None
            }
            (Phase::Unconfirmed, false) => {
                self.phase = Phase::Down;
                self.run = 0;
                Some(Transition::WentDown)
            }
            (Phase::Up, true) | (Phase::Down, false) => {
                self.run = 0;
                None
            }
            (Phase::Up, false) => {
                self.run += 1;
                if self.run >= self.thresholds.failures_to_down {
                    self.phase = Phase::Down;
                    self.run = 0;
                    Some(Transition::WentDown)
                } else {
                    None
                }
            }
            (Phase::Down, true) => {
                self.run += 1;
                if self.run >= self.thresholds.successes_to_up {
                    self.phase = Phase::Up;
                    self.run = 0;
                    Some(Transition::CameUp)
                } else {
                    None
                }
            }
        }
    }
}

/// Delay before a service's first probe: a fixed fraction of the interval derived from
/// the service name, so monitors of many services do not fire in lockstep, and the same
/// config gives the same schedule on every run (no per-process randomness).
pub(crate) fn first_probe_delay_ms(service: &str, interval_ms: u64) -> u64 {
    if interval_ms == 0 {
        return 0;
    }
    crate::hash::key_hash(service.as_bytes()) % interval_ms
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn t(f: u32, s: u32) -> HealthState {
        HealthState::new(Thresholds {
            failures_to_down: f,
            successes_to_up: s,
        })
    }

    #[test]
    fn unconfirmed_goes_down_on_first_failure() {
        let mut h = t(3, 2);
        assert!(h.is_up());
        assert_eq!(h.observe(0, Outcome::Dead), Some(Transition::WentDown));
        assert_eq!(h.phase(), Phase::Down);
    }

    #[test]
    fn thresholds_apply_after_first_success() {
        let mut h = t(3, 2);
        assert_eq!(h.observe(0, Outcome::Alive), None);
        assert_eq!(h.observe(0, Outcome::Dead), None);
        assert_eq!(h.observe(0, Outcome::Dead), None);
        assert_eq!(
            h.observe(0, Outcome::Alive),
            None,
            "a success resets the failure run"
        );
        assert_eq!(h.observe(0, Outcome::Dead), None);
        assert_eq!(h.observe(0, Outcome::Dead), None);
        assert_eq!(h.observe(0, Outcome::Dead), Some(Transition::WentDown));
        assert_eq!(h.observe(0, Outcome::Alive), None);
        assert_eq!(
            h.observe(0, Outcome::Dead),
            None,
            "a failure resets the success run"
        );
        assert_eq!(h.observe(0, Outcome::Alive), None);
        assert_eq!(h.observe(0, Outcome::Alive), Some(Transition::CameUp));
        assert_eq!(h.phase(), Phase::Up);
    }

    #[test]
    fn zero_thresholds_act_as_one() {
        let mut h = t(0, 0);
        h.observe(0, Outcome::Alive);
        assert_eq!(h.observe(0, Outcome::Dead), Some(Transition::WentDown));
        assert_eq!(h.observe(0, Outcome::Alive), Some(Transition::CameUp));
    }

    #[test]
    fn jitter_is_deterministic_and_bounded() {
        assert_eq!(
            first_probe_delay_ms("sip1", 5000),
            first_probe_delay_ms("sip1", 5000)
        );
        assert!(first_probe_delay_ms("sip1", 5000) < 5000);
        assert_eq!(first_probe_delay_ms("sip1", 0), 0);
    }

    const S: Nanos = 1_000_000_000;

    fn unavailable(retry_after_s: u32) -> Outcome {
        Outcome::Unavailable { retry_after_s }
    }

    /// A 503 with Retry-After takes a confirmed UP service DOWN at once (not after
    /// `failures_to_down`), successes before the Retry-After passes do not count, and
    /// `successes_to_up` counts from its end.
    #[test]
    fn retry_after_takes_down_at_once_and_holds() {
        let mut h = t(3, 2);
        assert_eq!(h.observe(0, Outcome::Alive), None);
        assert_eq!(h.phase(), Phase::Up);
        assert_eq!(
            h.observe(10 * S, unavailable(2)),
            Some(Transition::WentDown)
        );
        assert_eq!(
            h.hold(10 * S),
            Some(Hold {
                retry_after_s: 2,
                until: 12 * S
            })
        );
        assert_eq!(h.hold(10 * S).map(|x| x.remaining(11 * S)), Some(S));
        for at in [10 * S + 1, 11 * S, 12 * S - 1] {
            assert_eq!(h.observe(at, Outcome::Alive), None, "held at {at}");
            assert_eq!(h.phase(), Phase::Down);
        }
        assert_eq!(h.hold(12 * S), None, "the hold ends with the Retry-After");
        assert_eq!(
            h.observe(12 * S, Outcome::Alive),
            None,
            "first of two successes"
        );
        assert_eq!(h.observe(13 * S, Outcome::Alive), Some(Transition::CameUp));
        assert_eq!(h.hold(13 * S), None);
    }

    /// Before any success the 503 takes the service DOWN too; a failure while held changes
    /// nothing; a later 503 replaces the hold, shorter or longer.
    #[test]
    fn a_later_retry_after_replaces_the_hold() {
        let mut h = t(1, 1);
        assert_eq!(h.observe(0, unavailable(60)), Some(Transition::WentDown));
        assert_eq!(h.observe(S, Outcome::Dead), None);
        assert_eq!(h.hold(S).map(|x| x.until), Some(60 * S));
        assert_eq!(h.observe(2 * S, unavailable(1)), None, "already DOWN");
        assert_eq!(h.hold(2 * S).map(|x| x.until), Some(3 * S));
        assert_eq!(h.observe(3 * S - 1, Outcome::Alive), None);
        assert_eq!(h.observe(3 * S, Outcome::Alive), Some(Transition::CameUp));
        assert_eq!(h.observe(4 * S, unavailable(5)), Some(Transition::WentDown));
        assert_eq!(h.observe(5 * S, unavailable(100)), None);
        assert_eq!(h.hold(5 * S).map(|x| x.until), Some(105 * S));
    }

    #[test]
    fn the_hold_is_capped() {
        let mut h = t(3, 1);
        h.observe(0, unavailable(u32::MAX));
        let cap = u64::try_from(RETRY_AFTER_HOLD_MAX.as_nanos()).unwrap_or(u64::MAX);
        assert_eq!(
            h.hold(S),
            Some(Hold {
                retry_after_s: u32::MAX,
                until: cap
            })
        );
        assert_eq!(h.observe(cap - 1, Outcome::Alive), None);
        assert_eq!(h.observe(cap, Outcome::Alive), Some(Transition::CameUp));
        // Near the end of the clock the hold saturates rather than wraps.
        h.observe(u64::MAX - 1, unavailable(10));
        assert_eq!(h.hold(u64::MAX - 1).map(|x| x.until), Some(u64::MAX));
    }

    /// Retry-After: 0 still marks the service DOWN at once, with nothing to wait for.
    #[test]
    fn retry_after_zero_takes_down_without_a_hold() {
        let mut h = t(3, 1);
        h.observe(0, Outcome::Alive);
        assert_eq!(h.observe(S, unavailable(0)), Some(Transition::WentDown));
        assert_eq!(h.hold(S), None);
        assert_eq!(h.observe(S, Outcome::Alive), Some(Transition::CameUp));
    }

    proptest! {
        /// Transitions alternate, and each one is justified by the run of outcomes before it.
        #[test]
        fn transitions_follow_thresholds(f in 1u32..5, s in 1u32..5,
                                         outcomes in proptest::collection::vec(any::<bool>(), 0..200)) {
            let mut h = t(f, s);
            let mut last: Option<Transition> = None;
            let mut confirmed = false;
            for (i, &o) in outcomes.iter().enumerate() {
                let was_up = h.is_up();
                let tr = h.observe(0, if o { Outcome::Alive } else { Outcome::Dead });
                if let Some(tr) = tr {
                    prop_assert_ne!(Some(tr), last);
                    last = Some(tr);
                    let need = match tr {
                        Transition::WentDown => if confirmed { f } else { 1 },
                        Transition::CameUp => s,
                    } as usize;
                    prop_assert!(i + 1 >= need);
                    let want = tr == Transition::CameUp;
                    prop_assert!(outcomes[i + 1 - need..=i].iter().all(|&x| x == want));
                    prop_assert_eq!(h.is_up(), want);
                } else {
                    prop_assert_eq!(h.is_up(), was_up);
                }
                confirmed |= o || h.phase() != Phase::Unconfirmed;
            }
        }

        /// Under any timing of outcomes: a service held by a Retry-After is DOWN and never
        /// comes UP before the hold ends; a 503 with Retry-After always leaves it DOWN.
        #[test]
        fn no_service_comes_up_while_held(f in 1u32..4, s in 1u32..4,
                                          steps in proptest::collection::vec(
                                              (0u64..3_000_000_000, 0u8..3, 0u32..4), 0..200)) {
            let mut h = t(f, s);
            let mut now: Nanos = 0;
            let mut held_until: Nanos = 0;
            for (dt, kind, secs) in steps {
                now += dt;
                let outcome = match kind {
                    0 => Outcome::Alive,
                    1 => Outcome::Dead,
                    _ => unavailable(secs),
                };
                let tr = h.observe(now, outcome);
                if let Outcome::Unavailable { retry_after_s } = outcome {
                    held_until = now + u64::from(retry_after_s) * S;
                    prop_assert_eq!(h.phase(), Phase::Down);
                    prop_assert_ne!(tr, Some(Transition::CameUp));
                }
                if now < held_until {
                    prop_assert_eq!(h.phase(), Phase::Down);
                    prop_assert_ne!(tr, Some(Transition::CameUp));
                    prop_assert_eq!(h.hold(now).map(|x| x.until), Some(held_until));
                } else {
                    prop_assert_eq!(h.hold(now), None);
                }
            }
        }
    }
}
