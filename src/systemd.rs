//! The service manager's notify protocol (`sd_notify(3)`, `systemd.service(5)` `Type=notify`):
//! READY when fulcrum serves, RELOADING / READY around a reload, STOPPING when a graceful stop
//! begins, and watchdog keep-alives. PURE decisions ([`messages`], [`pet_interval`]) with a
//! thin IO edge ([`notify`], [`watchdog_interval`]) that does nothing unless the manager set
//! `NOTIFY_SOCKET` (and `WATCHDOG_USEC` for the watchdog).

use sd_notify::NotifyState;
use std::time::Duration;

/// What the process is doing, as the service manager should hear it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Every vserver is bound and the admin API listens; also after a reload, applied or
    /// refused (a refused one changed nothing, so the process serves as before).
    Serving,
    /// A reload has begun at `monotonic_usec` (CLOCK_MONOTONIC, µs): systemd 253 and later
    /// time the reload from it and fail one announced without it.
    Reloading { monotonic_usec: u64 },
    /// A graceful stop (the drain) has begun.
    Stopping,
    /// Still serving: a watchdog keep-alive.
    Alive,
}

/// The notify message (its `KEY=VALUE` lines) for `state`.
pub fn messages(state: State) -> Vec<NotifyState<'static>> {
    match state {
        State::Serving => vec![NotifyState::Ready, NotifyState::Status("serving")],
        State::Reloading { monotonic_usec } => vec![
            NotifyState::Reloading,
            NotifyState::MonotonicUsec(i128::from(monotonic_usec)),
            NotifyState::Status("reloading the config"),
        ],
        State::Stopping => vec![
            NotifyState::Stopping,
            NotifyState::Status("draining established flows"),
        ],
        State::Alive => vec![NotifyState::Watchdog],
    }
}

/// How often to pet a watchdog that fires after `timeout` without a keep-alive: at half of
/// it, as `sd_watchdog_enabled(3)` advises, so one late tick does not trip it.
pub fn pet_interval(timeout: Duration) -> Option<Duration> {
    let half = timeout / 2;
    (!half.is_zero()).then_some(half)
}

/// Tell the service manager `state`. Nothing without `NOTIFY_SOCKET`; a failed send is
/// logged and otherwise ignored (the proxy serves whether or not its manager listens).
pub fn notify(state: State) {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    if let Err(e) = sd_notify::notify(&messages(state)) {
        tracing::warn!(error = %e, ?state, "service manager notification failed");
    }
}

/// [`State::Reloading`] now.
pub fn reloading_now() -> State {
    let monotonic_usec = match NotifyState::monotonic_usec_now() {
        Ok(NotifyState::MonotonicUsec(us)) => u64::try_from(us).unwrap_or(0),
        _ => 0,
    };
    State::Reloading { monotonic_usec }
}

/// How often to pet the manager's watchdog: `None` unless `NOTIFY_SOCKET` and `WATCHDOG_USEC`
/// are set (and `WATCHDOG_PID`, when set, is this process).
pub fn watchdog_interval() -> Option<Duration> {
    std::env::var_os("NOTIFY_SOCKET")?;
    sd_notify::watchdog_enabled().and_then(pet_interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(state: State) -> String {
        messages(state).iter().map(|m| format!("{m}\n")).collect()
    }

    #[test]
    fn each_state_has_its_message() {
        assert_eq!(text(State::Serving), "READY=1\nSTATUS=serving\n");
        assert_eq!(
            text(State::Reloading {
                monotonic_usec: 12_345
            }),
            "RELOADING=1\nMONOTONIC_USEC=12345\nSTATUS=reloading the config\n"
        );
        assert_eq!(
            text(State::Stopping),
            "STOPPING=1\nSTATUS=draining established flows\n"
        );
        assert_eq!(text(State::Alive), "WATCHDOG=1\n");
    }

    #[test]
    fn the_watchdog_is_petted_at_half_its_timeout() {
        assert_eq!(
            pet_interval(Duration::from_micros(400_000)),
            Some(Duration::from_millis(200))
        );
        assert_eq!(
            pet_interval(Duration::from_secs(30)),
            Some(Duration::from_secs(15))
        );
        assert_eq!(pet_interval(Duration::ZERO), None);
        assert_eq!(pet_interval(Duration::from_nanos(1)), None);
    }

    #[test]
    fn reloading_now_reads_a_monotonic_clock() {
        let State::Reloading { monotonic_usec: a } = reloading_now() else {
            panic!("not a reload")
        };
        let State::Reloading { monotonic_usec: b } = reloading_now() else {
            panic!("not a reload")
        };
        assert!(a > 0 && b >= a, "{a} then {b}");
    }
}
