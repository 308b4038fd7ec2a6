//! Per-service counters that the data paths update and the load-balancing methods read. PURE.
//!
//! Every update is a handful of `Relaxed` atomic operations, so many worker tasks can update the
//! same service at once without a lock. Nothing here reads the clock: operations that depend on
//! time take `now` ([`Nanos`], a monotonic timestamp chosen by the caller), which keeps the
//! methods deterministic and lets the simulator drive them with simulated time.
//!
//! Values are approximate under races only where noted (a second's turnover in [`RateMeter`]);
//! no value can overflow into a panic: counters saturate or wrap by design.

use std::sync::atomic::{AtomicU64, Ordering};

/// A monotonic timestamp in nanoseconds since an arbitrary origin chosen by the caller
/// (the shell converts `tokio::time::Instant`, the simulator counts simulated time).
pub type Nanos = u64;

/// Count one event.
pub fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Logs at most once per second per limiter (bad input must not flood the log).
#[derive(Debug, Default)]
pub struct LogLimiter {
    last_s: AtomicU64,
}

impl LogLimiter {
    pub fn allow(&self, now: Nanos) -> bool {
        let s = now / 1_000_000_000 + 1;
        let last = self.last_s.load(Ordering::Relaxed);
        s != last
            && self
                .last_s
                .compare_exchange(last, s, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

/// Nanoseconds in one second.
pub const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Response-time averages are kept in microseconds and clamped to this bound, so that score
/// products in [`crate::methods`] fit in `u128` whatever a service reports.
pub const MAX_RESPONSE_TIME_US: u64 = u32::MAX as u64;

/// A per-second rate over a sliding one-second window, lock-free.
///
/// Two one-second buckets (the current second and the previous one); each is a single `u64`
/// packing the second it belongs to (upper 24 bits, the second modulo 2^24) and its count (lower
/// 40 bits, saturating), so a bucket is reset and incremented in one compare-and-swap and two
/// tasks can never both "win" a turnover. The rate at `now` is the classic sliding-window
/// estimate `previous × (1 − elapsed fraction) + current`.
#[derive(Debug, Default)]
pub struct RateMeter {
    buckets: [AtomicU64; 2],
}

const STAMP_SHIFT: u32 = 40;
const COUNT_MASK: u64 = (1 << STAMP_SHIFT) - 1;
const STAMP_MASK: u64 = (1 << 24) - 1;

impl RateMeter {
    /// Adds `n` events at time `now`.
    pub fn add(&self, n: u64, now: Nanos) {
        let sec = now / NANOS_PER_SEC;
        let stamp = sec & STAMP_MASK;
        let bucket = &self.buckets[(sec & 1) as usize];
        // `fetch_update` only fails when the closure returns None, which it never does.
        let _ = bucket.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
            let count = if old >> STAMP_SHIFT == stamp {
                (old & COUNT_MASK).saturating_add(n).min(COUNT_MASK)
            } else {
                n.min(COUNT_MASK)
            };
            Some((stamp << STAMP_SHIFT) | count)
        });
    }

    /// Events per second over the sliding second ending at `now`.
    pub fn rate_per_s(&self, now: Nanos) -> f64 {
        let sec = now / NANOS_PER_SEC;
        let current = self.count_in(sec);
        let previous = sec.checked_sub(1).map_or(0, |p| self.count_in(p));
        let elapsed = (now % NANOS_PER_SEC) as f64 / NANOS_PER_SEC as f64;
        previous as f64 * (1.0 - elapsed) + current as f64
    }

    /// The same estimate in integer form (events per second, rounded down), for the methods'
    /// exact integer comparisons.
    pub fn rate_per_s_u64(&self, now: Nanos) -> u64 {
        let sec = now / NANOS_PER_SEC;
        let current = self.count_in(sec);
        let previous = sec.checked_sub(1).map_or(0, |p| self.count_in(p));
        let remaining = NANOS_PER_SEC - now % NANOS_PER_SEC;
        let prev_part = (u128::from(previous) * u128::from(remaining)) / u128::from(NANOS_PER_SEC);
        current.saturating_add(u64::try_from(prev_part).unwrap_or(u64::MAX))
    }

    fn count_in(&self, sec: u64) -> u64 {
        let v = self.buckets[(sec & 1) as usize].load(Ordering::Relaxed);
        if v >> STAMP_SHIFT == sec & STAMP_MASK {
            v & COUNT_MASK
        } else {
            0
        }
    }
}

/// An exponentially weighted moving average of a duration in microseconds, lock-free.
///
/// The gain is 1/8, the smoothing TCP uses for SRTT (RFC 6298 §2): recent enough to follow a
/// service that slows down, smooth enough that one slow reply does not swing the choice.
/// Zero means "no sample yet".
#[derive(Debug, Default)]
pub struct Ewma {
    value_us: AtomicU64,
}

impl Ewma {
    /// Folds in one sample.
    pub fn record(&self, sample_us: u64) {
        // A real sample of 0 µs is stored as 1 so that it is not mistaken for "no sample".
        let sample = sample_us.clamp(1, MAX_RESPONSE_TIME_US);
        let _ = self
            .value_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                if old == 0 {
                    Some(sample)
                } else {
                    // old + (sample - old) / 8, in signed arithmetic on small values.
                    let next = (old as i128) + ((sample as i128) - (old as i128)) / 8;
                    Some(next.clamp(1, MAX_RESPONSE_TIME_US as i128) as u64)
                }
            });
    }

    /// Sets the average directly (a monitor reporting its latest measurement).
    pub fn set(&self, value_us: u64) {
        self.value_us
            .store(value_us.clamp(1, MAX_RESPONSE_TIME_US), Ordering::Relaxed);
    }

    /// The average in microseconds, `None` before the first sample.
    pub fn get_us(&self) -> Option<u64> {
        match self.value_us.load(Ordering::Relaxed) {
            0 => None,
            v => Some(v),
        }
    }
}

/// The counters of one service, shared by every task that sends it traffic.
///
/// The shell owns one per service (inside the service record) and updates it; the methods in
/// [`crate::methods`] only read it.
#[derive(Debug)]
pub struct ServiceCounters {
    active: AtomicU64,
    /// SIP requests that may open a dialog, forwarded and not answered 2xx yet
    /// (`crate::dialog`): load for the methods, not active flows.
    pending: AtomicU64,
    requests_total: AtomicU64,
    bytes_total: AtomicU64,
    packets_total: AtomicU64,
    bytes_rate: RateMeter,
    packets_rate: RateMeter,
    response_time: Ewma,
    monitor_response_time: Ewma,
    /// `u64::MAX` = no load reported yet.
    reported_load: AtomicU64,
}

impl ServiceCounters {
    /// Fresh counters: nothing active, nothing measured, no load reported.
    pub fn new() -> Self {
        ServiceCounters {
            active: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            requests_total: AtomicU64::new(0),
            bytes_total: AtomicU64::new(0),
            packets_total: AtomicU64::new(0),
            bytes_rate: RateMeter::default(),
            packets_rate: RateMeter::default(),
            response_time: Ewma::default(),
            monitor_response_time: Ewma::default(),
            reported_load: AtomicU64::new(u64::MAX),
        }
    }

    /// A connection / session / transaction to this service opened.
    pub fn open(&self) {
        self.active.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection / session / transaction closed. Never goes below zero, so a stray close
    /// (a session that was counted before a reload) cannot wrap the counter.
    pub fn close(&self) {
        let _ = self
            .active
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(1))
            });
    }

    /// Open connections / sessions.
    pub fn active(&self) -> u64 {
        self.active.load(Ordering::Relaxed)
    }

    /// A SIP request that may open a dialog was forwarded (its dialog is not confirmed yet).
    pub fn open_pending(&self) {
        self.pending.fetch_add(1, Ordering::Relaxed);
    }

    /// A pending request was answered, cancelled, pushed out or expired. Never below zero.
    pub fn close_pending(&self) {
        let _ = self
            .pending
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                Some(v.saturating_sub(1))
            });
    }

    /// Pending SIP requests (calls being set up).
    pub fn pending(&self) -> u64 {
        self.pending.load(Ordering::Relaxed)
    }

    /// What the load-aware methods, `max_clients` and bounded loads count: active flows and
    /// calls being set up (a burst of INVITEs would otherwise all go to the same service while
    /// they ring).
    pub fn load(&self) -> u64 {
        self.active().saturating_add(self.pending())
    }

    /// One request (SIP request, datagram session, TCP connection) was sent to this service.
    pub fn record_request(&self) {
        self.requests_total.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests sent to this service since it was created.
    pub fn requests_total(&self) -> u64 {
        self.requests_total.load(Ordering::Relaxed)
    }

    /// `bytes` were relayed in `packets` packets (either direction) at `now`.
    pub fn record_traffic(&self, bytes: u64, packets: u64, now: Nanos) {
        self.bytes_total.fetch_add(bytes, Ordering::Relaxed);
        self.packets_total.fetch_add(packets, Ordering::Relaxed);
        self.bytes_rate.add(bytes, now);
        self.packets_rate.add(packets, now);
    }

    /// Bytes relayed since creation (wraps after 2^64, as Prometheus counters may).
    pub fn bytes_total(&self) -> u64 {
        self.bytes_total.load(Ordering::Relaxed)
    }

    /// Packets relayed since creation.
    pub fn packets_total(&self) -> u64 {
        self.packets_total.load(Ordering::Relaxed)
    }

    /// Bytes per second over the second ending at `now`.
    pub fn bytes_per_s(&self, now: Nanos) -> u64 {
        self.bytes_rate.rate_per_s_u64(now)
    }

    /// Packets per second over the second ending at `now`.
    pub fn packets_per_s(&self, now: Nanos) -> u64 {
        self.packets_rate.rate_per_s_u64(now)
    }

    /// A response time measured passively on the data path (request to first response).
    pub fn record_response_time(&self, us: u64) {
        self.response_time.record(us);
    }

    /// Average passive response time in microseconds, `None` before the first sample.
    pub fn response_time_us(&self) -> Option<u64> {
        self.response_time.get_us()
    }

    /// A response time measured by the service's monitor (used by `lrtm`).
    pub fn record_monitor_response_time(&self, us: u64) {
        self.monitor_response_time.record(us);
    }

    /// Average monitor response time in microseconds, `None` before the first probe answer.
    pub fn monitor_response_time_us(&self) -> Option<u64> {
        self.monitor_response_time.get_us()
    }

    /// The load value last reported by a load monitor (used by `custom_load`; lower is less
    /// loaded, any scale the monitor uses).
    pub fn set_reported_load(&self, load: u32) {
        self.reported_load.store(u64::from(load), Ordering::Relaxed);
    }

    /// The last reported load, `None` before the first report.
    pub fn reported_load(&self) -> Option<u32> {
        u32::try_from(self.reported_load.load(Ordering::Relaxed)).ok()
    }
}

/// Lets the selection methods take owned counters (tests) or shared ones (the balancer).
impl AsRef<ServiceCounters> for ServiceCounters {
    fn as_ref(&self) -> &ServiceCounters {
        self
    }
}

impl Default for ServiceCounters {
    fn default() -> Self {
        ServiceCounters::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_meter_slides_over_one_second() {
        let m = RateMeter::default();
        for i in 0..100u64 {
            m.add(1, 5 * NANOS_PER_SEC + i * NANOS_PER_SEC / 100);
        }
        // At the end of second 5 all 100 are in the current bucket.
        assert_eq!(m.rate_per_s_u64(6 * NANOS_PER_SEC - 1), 100);
        // Half-way through second 6, half of the previous second still counts.
        assert_eq!(m.rate_per_s_u64(6 * NANOS_PER_SEC + NANOS_PER_SEC / 2), 50);
        assert!((m.rate_per_s(6 * NANOS_PER_SEC + NANOS_PER_SEC / 2) - 50.0).abs() < 1e-9);
        // Two seconds later nothing is left.
        assert_eq!(m.rate_per_s_u64(8 * NANOS_PER_SEC), 0);
        // A bucket reused for a later second starts from zero.
        m.add(3, 7 * NANOS_PER_SEC);
        assert_eq!(m.rate_per_s_u64(7 * NANOS_PER_SEC), 3);
    }

    #[test]
    fn rate_meter_saturates_instead_of_overflowing() {
        let m = RateMeter::default();
        m.add(u64::MAX, 0);
        m.add(u64::MAX, 0);
        assert_eq!(m.rate_per_s_u64(0), COUNT_MASK);
        let _ = m.rate_per_s(u64::MAX);
        m.add(1, u64::MAX);
        assert_eq!(m.rate_per_s_u64(u64::MAX), 1);
    }

    #[test]
    fn ewma_follows_samples() {
        let e = Ewma::default();
        assert_eq!(e.get_us(), None);
        e.record(800);
        assert_eq!(e.get_us(), Some(800));
        e.record(0);
        // 800 + (1 - 800) / 8, truncated toward zero.
        assert_eq!(e.get_us(), Some(701));
        e.record(u64::MAX);
        assert!(e.get_us().is_some_and(|v| v <= MAX_RESPONSE_TIME_US));
    }

    #[test]
    fn counters_never_underflow() {
        let c = ServiceCounters::default();
        assert_eq!(c.reported_load(), None);
        c.close();
        assert_eq!(c.active(), 0);
        c.open();
        c.open();
        c.close();
        assert_eq!(c.active(), 1);
        assert_eq!(c.reported_load(), None);
        c.set_reported_load(42);
        assert_eq!(c.reported_load(), Some(42));
        c.record_traffic(1500, 1, 0);
        assert_eq!((c.bytes_total(), c.packets_total()), (1500, 1));
        assert_eq!(c.bytes_per_s(0), 1500);
    }

    #[test]
    fn counters_are_shared_across_threads() {
        let c = std::sync::Arc::new(ServiceCounters::new());
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        c.record_request();
                        c.record_traffic(10, 1, 3 * NANOS_PER_SEC);
                    }
                })
            })
            .collect();
        for h in handles {
            assert!(h.join().is_ok());
        }
        assert_eq!(c.requests_total(), 4000);
        assert_eq!(c.packets_per_s(3 * NANOS_PER_SEC), 4000);
    }
}
