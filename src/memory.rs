//! Giving freed heap memory back to the system after a burst of connections closes. PURE
//! decision ([`TrimPolicy`]: open-file counts and `now` in, "trim now" out) with a thin IO
//! edge ([`release`]) that asks jemalloc, the binary's allocator (src/main.rs), to purge.
//!
//! An allocator keeps the memory a connection's task and TLS buffers freed, to reuse it:
//! jemalloc gives unused pages back on its own only after they stay unused for its decay time
//! (10 s) and only when the arena that holds them is used again, so an arena left idle after
//! a burst keeps them. `arena.<all>.purge` gives back every unused page of every arena at
//! once. It takes each arena's lock while it walks it, so it runs only after the pool's count
//! of open files fell by [`MIN_DROP`] or more, and at most once per [`MIN_INTERVAL`]: never
//! per message or per connection. The connection tables grown by the burst are shrunk first
//! (`Evictors::shrink`), so their room is among what is given back.
use crate::stats::Nanos;

/// The fall in files in use (from the highest count seen since the last trim) that makes a
/// trim worth its walk: a thousand TLS connections hold some 15 MB.
pub const MIN_DROP: u64 = 1000;
/// The least time between two trims.
pub const MIN_INTERVAL: Nanos = 5_000_000_000;

/// When to give freed memory back, from the pool's count of files in use sampled now and
/// then. See the module documentation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrimPolicy {
    /// The highest count seen since the last trim (or since start).
    peak: u64,
    /// When the last trim was decided.
    last: Option<Nanos>,
}

impl TrimPolicy {
    /// Feed the count of files in use at `now` and the highest count since the last look
    /// (`high`: a burst that came and went between two looks counts); true when a trim
    /// should run now (the policy then counts from `used` afresh).
    pub fn observe(&mut self, now: Nanos, used: u64, high: u64) -> bool {
        self.peak = self.peak.max(used).max(high);
        let is_spaced = self
            .last
            .is_none_or(|t| now.saturating_sub(t) >= MIN_INTERVAL);
        if self.peak - used < MIN_DROP || !is_spaced {
            return false;
        }
        self.peak = used;
        self.last = Some(now);
        true
    }
}

/// Give the unused pages of every jemalloc arena back to the system now
/// (`arena.<all>.purge`), rather than at the end of their decay; whether jemalloc accepted
/// the call. Takes each arena's lock in turn: call it from a blocking thread, rarely. In a
/// program whose allocator is not jemalloc (the test binaries), jemalloc holds nothing and
/// the call does nothing.
#[allow(unsafe_code)]
pub fn release() -> bool {
    // MALLCTL_ARENAS_ALL: the pseudo-index that names every arena (jemalloc.h).
    const PURGE_ALL: &[u8] = b"arena.4096.purge\0";
    // SAFETY: the name is a NUL-terminated string; `arena.<i>.purge` reads and writes nothing,
    // and jemalloc requires exactly the null pointers and zero length passed here for it.
    let r = unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    r == 0
}

/// What jemalloc holds, in KiB: (in use by live allocations, resident but not in use: its
/// own metadata and the unused parts of pages that hold live blocks). Tells a retained
/// block (live) from what the allocator keeps after a purge.
pub fn allocator_kib() -> Option<(u64, u64)> {
    use tikv_jemalloc_ctl::{epoch, stats};
    epoch::advance().ok()?;
    let allocated = stats::allocated::read().ok()?;
    let resident = stats::resident::read().ok()?;
    let kib = |b: usize| u64::try_from(b / 1024).unwrap_or(u64::MAX);
    Some((kib(allocated), kib(resident.saturating_sub(allocated))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jemalloc_accepts_the_purge_and_reports_what_it_holds() {
        // The test binary allocates with the system's malloc, but jemalloc is linked: the
        // purge's name and arguments are checked by jemalloc itself (a wrong one is refused
        // with an error code, and `release` says false).
        assert!(release());
        assert!(allocator_kib().is_some());
    }

    const S: Nanos = 1_000_000_000;

    #[test]
    fn a_burst_that_closes_is_trimmed_once_then_not_until_it_falls_again() {
        let mut p = TrimPolicy::default();
        // Connections arrive: no trim while the count rises or holds.
        for (t, used) in [(0, 0), (1, 5_000), (2, 20_000), (3, 20_000)] {
            assert!(!p.observe(t * S, used, used), "at {t} s");
        }
        // They close: one trim once the fall reaches MIN_DROP.
        assert!(!p.observe(4 * S, 19_500, 19_500));
        assert!(p.observe(5 * S, 17, 17));
        // Nothing more to give back until the count rises and falls again.
        for t in 6..30 {
            assert!(!p.observe(t * S, 17, 17), "at {t} s");
        }
    }

    #[test]
    fn a_slow_fall_is_trimmed_at_most_once_per_interval() {
        let mut p = TrimPolicy::default();
        assert!(!p.observe(0, 20_000, 20_000));
        let mut trims = Vec::new();
        // 2,000 fewer files every second, for ten seconds.
        for t in 1..=10u64 {
            if p.observe(t * S, 20_000 - 2_000 * t, 20_000 - 2_000 * t) {
                trims.push(t);
            }
        }
        assert_eq!(trims, vec![1, 6]);
        // What fell since the last trim is trimmed once the interval has passed.
        assert!(p.observe(11 * S, 0, 0));
    }

    #[test]
    fn churn_at_a_steady_count_never_trims() {
        let mut p = TrimPolicy::default();
        for t in 0..100u64 {
            let used = 10_000 + (t % 7) * 100;
            assert!(!p.observe(t * S, used, used), "at {t} s");
        }
    }

    #[test]
    fn a_fall_smaller_than_min_drop_does_not_trim() {
        let mut p = TrimPolicy::default();
        assert!(!p.observe(0, MIN_DROP, MIN_DROP));
        assert!(!p.observe(10 * S, 1, 1));
        assert!(p.observe(11 * S, 0, 0));
    }

    #[test]
    fn a_burst_between_two_looks_is_trimmed_after() {
        let mut p = TrimPolicy::default();
        assert!(!p.observe(0, 0, 0));
        // 5,000 files taken and given back between the looks at 0 s and 1 s.
        assert!(p.observe(S, 0, 5_000));
        assert!(!p.observe(2 * S, 0, 0));
    }
}
