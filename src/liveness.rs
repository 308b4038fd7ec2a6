//! Whether every worker still makes progress, for the service manager's watchdog: the
//! keep-alive is sent only while none is stalled ([`crate::ops::Ops::start_watchdog`]).
//!
//! Each worker has a heart, a counter it moves as it works, and the watchdog looks at every
//! heart once per keep-alive interval. What "stalled" means depends on how the worker waits:
//! - a **receiver** (a sip-udp thread) blocks in a receive between datagrams, possibly for
//!   hours; its heart is its hand-over mark ([`crate::proxy::handover`]), odd while it handles
//!   a datagram. It is stalled when found in the same datagram a whole interval later, or
//!   when its socket had a datagram waiting at two looks an interval apart with no datagram
//!   taken in between (a worker frozen between datagrams). No cost on the datagram's path.
//! - a **periodic** worker (a udp event loop, a timer or sweep thread, a monitor) wakes at
//!   least every `at_most` and beats each time: stalled when its heart has not moved for the
//!   interval (or twice `at_most`, whichever is longer).
//! - a **runtime** (the tokio runtime of the SIP streams, admin API and monitors; each tcp
//!   worker's) gets a probe task at every look, which beats when it runs: stalled when a
//!   probe has waited the interval without running.
//!
//! The decision per worker ([`observe`], [`Seen::stalled`]) is PURE, with the time injected;
//! the looks (atomic loads, a non-blocking peek, spawning the probes) are the IO edge.

use crate::stats::Nanos;
use crate::sync::lock;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// A worker's heart, held by the worker for as long as it runs (its entry goes with it).
#[derive(Clone, Debug)]
pub(crate) struct Heart(Arc<AtomicU64>);

impl Heart {
    /// Progress: one relaxed increment (per wake-up, never per packet).
    #[inline]
    pub(crate) fn beat(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// How a worker waits, and so what counts as stalled.
#[derive(Debug)]
enum Kind {
    /// Between datagrams blocked in a receive on `fd`; the heart is its hand-over mark.
    Receiver { fd: RawFd },
    /// Wakes and beats at least every `at_most`.
    Periodic { at_most: Duration },
    /// A tokio runtime, probed at each look; `sent` probes so far.
    Runtime {
        handle: tokio::runtime::Handle,
        sent: u64,
    },
}

#[derive(Debug)]
struct Entry {
    name: String,
    heart: Weak<AtomicU64>,
    kind: Kind,
    seen: Option<Seen>,
}

/// Every worker of the process that the watchdog vouches for.
#[derive(Debug, Default)]
pub struct Liveness {
    entries: Mutex<Vec<Entry>>,
}

impl Liveness {
    fn add(&self, name: String, heart: Weak<AtomicU64>, kind: Kind) {
        let mut entries = lock(&self.entries);
        entries.retain(|e| e.heart.strong_count() > 0);
        entries.push(Entry {
            name,
            heart,
            kind,
            seen: None,
        });
    }

    /// A worker that blocks in a receive on `fd` between datagrams and marks each datagram
    /// on `mark` (its hand-over reader's slot).
    pub(crate) fn receiver(&self, name: String, mark: Weak<AtomicU64>, fd: RawFd) {
        self.add(name, mark, Kind::Receiver { fd });
    }

    /// A worker that moves `mark` (its hand-over reader's slot) at least every `at_most`.
    pub(crate) fn periodic_mark(&self, name: String, mark: Weak<AtomicU64>, at_most: Duration) {
        self.add(name, mark, Kind::Periodic { at_most });
    }

    /// A worker that beats the returned heart at least every `at_most`.
    pub(crate) fn periodic(&self, name: String, at_most: Duration) -> Heart {
        let heart = Arc::new(AtomicU64::new(0));
        self.add(name, Arc::downgrade(&heart), Kind::Periodic { at_most });
        Heart(heart)
    }

    /// A tokio runtime, probed at every look for as long as the returned heart is held (by
    /// the runtime's owner).
    pub(crate) fn runtime(&self, name: String, handle: tokio::runtime::Handle) -> Heart {
        let heart = Arc::new(AtomicU64::new(0));
        self.add(
            name,
            Arc::downgrade(&heart),
            Kind::Runtime { handle, sent: 0 },
        );
        Heart(heart)
    }

    /// Look at every worker at `now` (the runtime's clock): the names of those stalled for
    /// `interval` or longer, and probes sent to the runtimes for the next look.
    pub fn stalled(&self, now: Nanos, interval: Duration) -> Vec<String> {
        let mut out = Vec::new();
        let mut entries = lock(&self.entries);
        entries.retain(|e| e.heart.strong_count() > 0);
        for e in entries.iter_mut() {
            let Some(heart) = e.heart.upgrade() else {
                continue;
            };
            let value = heart.load(Ordering::Relaxed);
            let (busy, limit) = match &e.kind {
                Kind::Receiver { fd } => (value & 1 == 1 || input_waiting(*fd), interval),
                Kind::Periodic { at_most } => (true, interval.max(*at_most * 2)),
                // A probe sent at an earlier look has not run.
                Kind::Runtime { sent, .. } => (value < *sent, interval),
            };
            let seen = observe(e.seen, value, busy, now);
            e.seen = Some(seen);
            if seen.stalled(now, limit) {
                out.push(e.name.clone());
            }
            if let Kind::Runtime { handle, sent } = &mut e.kind {
                *sent += 1;
                let heart = Arc::downgrade(&heart);
                // The runtime may be gone (its vserver removed): then the probe is dropped
                // unrun, and the entry with the heart its owner held.
                drop(handle.spawn(async move {
                    if let Some(h) = heart.upgrade() {
                        h.fetch_add(1, Ordering::Relaxed);
                    }
                }));
            }
        }
        out
    }
}

/// Whether a datagram waits on `fd`: a peek that neither blocks nor takes it.
fn input_waiting(fd: RawFd) -> bool {
    use nix::sys::socket::{MsgFlags, recv};
    let mut one = [0u8; 1];
    recv(fd, &mut one, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT).is_ok()
}

/// What the watchdog knew of one worker after a look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Seen {
    /// Its heart then.
    value: u64,
    /// Since when it has been expected to move its heart without doing so (`None`: it was
    /// not expected to, or it just did).
    waiting_since: Option<Nanos>,
}

/// Fold a look at `now` into what was known: the heart read `value`, and `busy` says whether
/// the worker had work it should have moved the heart for (in a message, input waiting, a
/// probe unrun, or always for a periodic worker). PURE.
pub(crate) fn observe(prev: Option<Seen>, value: u64, busy: bool, now: Nanos) -> Seen {
    let waiting_since = match prev {
        Some(p) if busy && p.value == value => Some(p.waiting_since.unwrap_or(now)),
        _ => busy.then_some(now),
    };
    Seen {
        value,
        waiting_since,
    }
}

impl Seen {
    /// Whether the worker has been expected to move its heart for `limit` or longer at `now`.
    pub(crate) fn stalled(&self, now: Nanos, limit: Duration) -> bool {
        let limit = u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX);
        self.waiting_since
            .is_some_and(|t| now.saturating_sub(t) >= limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn looks(samples: &[(u64, bool, Nanos)]) -> Vec<Seen> {
        let mut seen = None;
        samples
            .iter()
            .map(|&(v, busy, now)| {
                let s = observe(seen, v, busy, now);
                seen = Some(s);
                s
            })
            .collect()
    }

    #[test]
    fn an_idle_worker_is_never_stalled() {
        // A receiver between datagrams with nothing waiting, for an hour.
        let seen = looks(&[(4, false, 0), (4, false, S), (4, false, 3600 * S)]);
        assert!(
            seen.iter()
                .all(|s| !s.stalled(3600 * S, Duration::from_secs(1)))
        );
    }

    #[test]
    fn a_worker_found_in_one_message_an_interval_later_is_stalled() {
        let seen = looks(&[(7, true, 0), (7, true, S / 2), (7, true, S)]);
        assert!(!seen[1].stalled(S / 2, Duration::from_secs(1)));
        assert!(seen[2].stalled(S, Duration::from_secs(1)));
    }

    #[test]
    fn a_worker_that_moved_is_not_stalled() {
        // In a message at each look, but a different one each time.
        let seen = looks(&[(7, true, 0), (9, true, S), (11, true, 2 * S)]);
        assert!(
            seen.iter()
                .zip([0, S, 2 * S])
                .all(|(s, now)| !s.stalled(now, Duration::from_secs(1)))
        );
    }

    #[test]
    fn waiting_is_timed_from_the_first_look_that_found_work() {
        // Idle, then input waiting at 2 s and still at 2.5 s and 3 s with no datagram taken.
        let seen = looks(&[
            (4, false, 0),
            (4, false, 2 * S),
            (4, true, 2 * S + S / 2),
            (4, true, 3 * S),
            (4, true, 3 * S + S / 2),
        ]);
        let limit = Duration::from_secs(1);
        assert!(!seen[3].stalled(3 * S, limit), "waiting for 0.5 s only");
        assert!(seen[4].stalled(3 * S + S / 2, limit));
    }

    #[test]
    fn work_taken_ends_the_wait() {
        let seen = looks(&[(4, true, 0), (6, false, S), (6, true, 2 * S)]);
        assert_eq!(seen[1].waiting_since, None);
        assert!(!seen[2].stalled(2 * S, Duration::from_secs(1)));
    }

    #[test]
    fn the_registry_judges_each_kind() {
        let live = Liveness::default();
        let tick = Duration::from_secs(1);
        // A periodic worker that beats, and one that stopped.
        let beating = live.periodic("beating".into(), Duration::from_millis(100));
        let frozen = live.periodic("frozen".into(), Duration::from_millis(100));
        // A receiver idle on a socket with nothing waiting, and one with a datagram waiting.
        let idle = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let full = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        idle.send_to(b"x", full.local_addr().expect("addr"))
            .expect("send");
        use std::os::fd::AsRawFd;
        let (idle_mark, full_mark) = (Arc::new(AtomicU64::new(2)), Arc::new(AtomicU64::new(2)));
        live.receiver("idle".into(), Arc::downgrade(&idle_mark), idle.as_raw_fd());
        live.receiver("full".into(), Arc::downgrade(&full_mark), full.as_raw_fd());
        // A runtime that runs its probes, and one whose only thread is held.
        let running = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("rt");
        let held = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .expect("rt");
        let _r = live.runtime("running".into(), running.handle().clone());
        let _h = live.runtime("held".into(), held.handle().clone());
        let (hold, release) = std::sync::mpsc::channel::<()>();
        held.spawn(async move {
            let _ = release.recv();
        });
        let mut last = Vec::new();
        for i in 0..3u64 {
            beating.beat();
            // The current-thread runtime runs what was spawned on it while it is driven.
            running.block_on(tokio::task::yield_now());
            last = live.stalled(i * S, tick);
        }
        running.block_on(tokio::task::yield_now());
        last.sort();
        assert_eq!(last, ["frozen", "full", "held"]);
        // A worker that ended leaves with its heart.
        drop(frozen);
        drop(hold);
        assert!(!live.stalled(4 * S, tick).contains(&"frozen".to_string()));
    }
}
