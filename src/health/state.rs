//! The health state machine of one monitored service. PURE: probe outcomes in, state
//! changes out; no clock, no I/O.
//!
//! # Initial state
//! A monitored service starts **UP, unconfirmed** (HAProxy's `init-state up`): traffic flows
//! from the first second, as an operator restarting fulcrum in front of a healthy pool
//! expects, but the first failed probe before any success marks it DOWN at once, so a
//! service that is dead at start is taken out after one interval (+ timeout), not after
//! `failures_to_down` intervals. After its first success the thresholds apply:
//! `failures_to_down` consecutive failures take an UP service DOWN, `successes_to_up`
//! consecutive successes bring a DOWN service back UP.

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
        }
    }

    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    pub(crate) fn is_up(&self) -> bool {
        self.phase.is_up()
    }

    /// Fold in one probe outcome; returns the transition it causes, if any.
    pub(crate) fn observe(&mut self, alive: bool) -> Option<Transition> {
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
        assert_eq!(h.observe(false), Some(Transition::WentDown));
        assert_eq!(h.phase(), Phase::Down);
    }

    #[test]
    fn thresholds_apply_after_first_success() {
        let mut h = t(3, 2);
        assert_eq!(h.observe(true), None);
        assert_eq!(h.observe(false), None);
        assert_eq!(h.observe(false), None);
        assert_eq!(h.observe(true), None, "a success resets the failure run");
        assert_eq!(h.observe(false), None);
        assert_eq!(h.observe(false), None);
        assert_eq!(h.observe(false), Some(Transition::WentDown));
        assert_eq!(h.observe(true), None);
        assert_eq!(h.observe(false), None, "a failure resets the success run");
        assert_eq!(h.observe(true), None);
        assert_eq!(h.observe(true), Some(Transition::CameUp));
        assert_eq!(h.phase(), Phase::Up);
    }

    #[test]
    fn zero_thresholds_act_as_one() {
        let mut h = t(0, 0);
        h.observe(true);
        assert_eq!(h.observe(false), Some(Transition::WentDown));
        assert_eq!(h.observe(true), Some(Transition::CameUp));
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
                let tr = h.observe(o);
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
    }
}
