//! The open-file budget and per-source connection limits. PURE (atomics, a map and a
//! notification for whoever waits for files; no IO, no clock).
//!
//! Every client connection or session costs open files: one per SIP stream client (sip-tcp,
//! sip-tls), two per tcp / http connection (the client's and the service's), one per udp
//! session; a sip-udp dialog costs none. The process's open-file limit is divided once at
//! start into a **reserve** for what must keep working whatever clients do (monitors' probes,
//! the admin API, service links, logs, reloads) and one **pool** that every vserver's client
//! connections and sessions draw from. A connection the pool cannot take is closed at once and
//! counted; the reserve is never lent out, so one client holding idle connections cannot take
//! the process down (docs/limits.md).
//!
//! Per source, a stream listener admits at most `max_per_source` concurrent connections from
//! one address (IPv6 grouped by /64, the prefix one subscriber is given), so that one or two
//! sources cannot take the whole pool; a udp vserver, when asked, as many sessions.

use dashmap::DashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Connections the admin API serves at once by default, each kept a file in the reserve
/// (`admin::Limits`).
pub const ADMIN_CONNECTIONS: usize = 256;
/// The least reserve, whatever the limit.
pub const MIN_RESERVE: u64 = 64;
/// The reserve's share of the open-file limit (a tenth), at most [`MAX_RESERVE`] besides what
/// the config itself needs.
pub const RESERVE_DIVISOR: u64 = 10;
/// The largest share-based reserve: past it, a larger limit all goes to the pool.
pub const MAX_RESERVE: u64 = 4096;
/// Files the process holds besides its configured parts: standard streams, the runtime's
/// event descriptors, the binary and its libraries, the config file read on reload.
pub const BASE_FILES: u64 = 64;

/// The files the config itself needs kept: a socket per worker and listener, a probe socket
/// per monitored service, a link per stream member, the admin listener and its connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    pub listeners: u64,
    pub probes: u64,
    pub links: u64,
    pub admin: u64,
}

impl Needs {
    pub fn total(&self) -> u64 {
        BASE_FILES + self.listeners + self.probes + self.links + self.admin
    }
}

/// How `limit` open files are split: (reserve, pool). The reserve is a tenth of the limit
/// (between [`MIN_RESERVE`] and [`MAX_RESERVE`]) plus what the config needs; the pool is the
/// rest (none when the reserve takes all).
pub fn split(limit: u64, needs: &Needs) -> (u64, u64) {
    let share = (limit / RESERVE_DIVISOR).clamp(MIN_RESERVE, MAX_RESERVE);
    let reserve = share.saturating_add(needs.total()).min(limit);
    (reserve, limit - reserve)
}

/// Why a connection was refused at accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The pool has no files left for it.
    Budget,
    /// Its source already holds `max_per_source` connections.
    PerSource,
}

impl Refusal {
    pub fn name(self) -> &'static str {
        match self {
            Refusal::Budget => "budget",
            Refusal::PerSource => "per_source",
        }
    }
}

/// The pool of files client connections and sessions draw from, shared by every vserver of
/// a process.
#[derive(Debug)]
pub struct FileBudget {
    limit: u64,
    reserve: u64,
    pool: u64,
    used: AtomicU64,
    /// The highest `used` since the last [`FileBudget::take_high`]: a burst shorter than the
    /// sampling of `used` is seen too.
    high: AtomicU64,
    /// Connections and sessions refused for want of files.
    pub refused: AtomicU64,
    /// Raised when files are given back while someone waits for them ([`FileBudget::freed`]).
    freed: tokio::sync::Notify,
    /// How many wait for files.
    waiting: AtomicU64,
}

impl FileBudget {
    /// A budget of `limit` open files with `needs` kept in reserve.
    pub fn new(limit: u64, needs: &Needs) -> FileBudget {
        let (reserve, pool) = split(limit, needs);
        FileBudget {
            limit,
            reserve,
            pool,
            used: AtomicU64::new(0),
            high: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            freed: tokio::sync::Notify::new(),
            waiting: AtomicU64::new(0),
        }
    }

    /// A budget that never refuses (the limit could not be read).
    pub fn unlimited() -> FileBudget {
        FileBudget {
            limit: u64::MAX,
            reserve: 0,
            pool: u64::MAX,
            used: AtomicU64::new(0),
            high: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            freed: tokio::sync::Notify::new(),
            waiting: AtomicU64::new(0),
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn reserve(&self) -> u64 {
        self.reserve
    }

    pub fn pool(&self) -> u64 {
        self.pool
    }

    /// Files of the pool in use now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// The highest count of files in use since the last call (or start); counting starts
    /// again from the count now.
    pub fn take_high(&self) -> u64 {
        self.high.swap(self.used(), Ordering::Relaxed)
    }

    /// Take `files` from the pool, or nothing (counted) when they are not all there.
    pub fn take(&self, files: u64) -> bool {
        let ok = self.take_uncounted(files);
        if !ok {
            self.count_refusal();
        }
        ok
    }

    /// [`FileBudget::take`] without counting a refusal (for a caller that tries again).
    pub fn take_uncounted(&self, files: u64) -> bool {
        let ok = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                let next = u.checked_add(files)?;
                (next <= self.pool).then_some(next)
            });
        if let Ok(before) = ok {
            self.high.fetch_max(before + files, Ordering::Relaxed);
        }
        ok.is_ok()
    }

    /// Count one connection or session refused for want of files.
    pub fn count_refusal(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Give back `files` taken with [`FileBudget::take`], waking whoever waits for files.
    pub fn give_back(&self, files: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.saturating_sub(files))
            });
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.freed.notify_waiters();
        }
    }

    /// Completes when files are next given back (enable it before looking at the pool, so
    /// that a file given back in between is not missed); only while a [`FileBudget::waiter`]
    /// is held.
    pub fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    /// Count one more waiter for files while the guard lives: [`FileBudget::give_back`]
    /// wakes waiters only while there are some.
    pub fn waiter(&self) -> Waiter<'_> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        Waiter(self)
    }

    /// [`FileBudget::take`] as a guard that gives the files back when dropped.
    pub fn permit(self: &Arc<Self>, files: u64) -> Option<Permit> {
        self.take(files).then(|| Permit {
            budget: Arc::clone(self),
            files,
        })
    }

    /// [`FileBudget::permit`] without counting a refusal.
    pub fn permit_uncounted(self: &Arc<Self>, files: u64) -> Option<Permit> {
        self.take_uncounted(files).then(|| Permit {
            budget: Arc::clone(self),
            files,
        })
    }

    /// Whether the pool is running low: at least nine tenths used, the point from which idle
    /// connections are evicted to make room for new ones.
    pub fn is_low(&self) -> bool {
        self.used().saturating_mul(10) >= self.pool.saturating_mul(9)
    }
}

/// One waiter for files, counted while it lives ([`FileBudget::waiter`]).
#[derive(Debug)]
pub struct Waiter<'a>(&'a FileBudget);

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Files taken from a [`FileBudget`], given back on drop.
#[derive(Debug)]
pub struct Permit {
    budget: Arc<FileBudget>,
    files: u64,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.budget.give_back(self.files);
    }
}

/// The default `max_per_source`: above an office NAT or a carrier-grade NAT in front of many
/// phones, far under any useful pool.
pub const DEFAULT_MAX_PER_SOURCE: u32 = 1000;

/// The key a source is counted under: an IPv4 address as it is, an IPv6 address by its /64.
/// IPv4-mapped IPv6 addresses count as the IPv4 address they carry.
pub fn source_key(ip: IpAddr) -> u128 {
    match ip.to_canonical() {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => (u128::from(v6) & !((1u128 << 64) - 1)) | 1,
    }
}

/// Concurrent connections per source on one listener, bounded by `max` (which a reload may
/// change).
#[derive(Debug)]
pub struct SourceLimit {
    max: AtomicU64,
    counts: DashMap<u128, u32>,
    /// Connections refused because their source was at its limit.
    pub refused: AtomicU64,
}

impl SourceLimit {
    pub fn new(max: u32) -> SourceLimit {
        SourceLimit {
            max: AtomicU64::new(u64::from(max)),
            counts: DashMap::new(),
            refused: AtomicU64::new(0),
        }
    }

    pub fn set_max(&self, max: u32) {
        self.max.store(u64::from(max), Ordering::Relaxed);
    }

    pub fn max(&self) -> u32 {
        u32::try_from(self.max.load(Ordering::Relaxed)).unwrap_or(u32::MAX)
    }

    /// Count one more connection from `ip`, unless its source is at the limit (counted).
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<SourceSlot> {
        let key = source_key(ip);
        let max = self.max();
        let mut e = self.counts.entry(key).or_insert(0);
        if *e >= max {
            drop(e);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *e += 1;
        Some(SourceSlot {
            limit: Arc::clone(self),
            key,
        })
    }

    /// Connections counted from `ip`'s source now.
    pub fn count(&self, ip: IpAddr) -> u32 {
        self.counts.get(&source_key(ip)).map_or(0, |c| *c)
    }

    /// Sources with at least one connection.
    pub fn sources(&self) -> usize {
        self.counts.len()
    }

    fn release(&self, key: u128) {
        // The entry goes with its last connection, so the map holds live sources only.
        self.counts.remove_if_mut(&key, |_, c| {
            *c = c.saturating_sub(1);
            *c == 0
        });
    }
}

/// One connection counted against its source, released on drop.
#[derive(Debug)]
pub struct SourceSlot {
    limit: Arc<SourceLimit>,
    key: u128,
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        self.limit.release(self.key);
    }
}

/// What a connection holds while it lives: its files and its place among its source's.
#[derive(Debug)]
pub struct Admission {
    pub files: Permit,
    pub source: Option<SourceSlot>,
}

/// Admit a connection from `ip` costing `files`: its source's limit first (a source at its
/// limit takes nothing from the pool), then the pool.
pub fn admit(
    budget: &Arc<FileBudget>,
    per_source: Option<&Arc<SourceLimit>>,
    ip: IpAddr,
    files: u64,
) -> Result<Admission, Refusal> {
    let source = match per_source {
        Some(l) => Some(l.admit(ip).ok_or(Refusal::PerSource)?),
        None => None,
    };
    let files = budget.permit(files).ok_or(Refusal::Budget)?;
    Ok(Admission { files, source })
}

/// What a client connection has done, for eviction under pressure: when it was last active
/// and whether it ever completed a message or request. Every vserver stamps it in
/// nanoseconds of the runtime's one epoch (`proxy::context::elapsed_nanos`): eviction
/// compares connections of every vserver, so a unit of its own (a SIP stream once counted
/// milliseconds) would make a phone that spoke a second ago look older than a tcp
/// connection silent for an hour.
#[derive(Debug, Default)]
pub struct Activity {
    last: AtomicU64,
    proven: std::sync::atomic::AtomicBool,
    /// The client registered through this connection with a flow token (a Path): the
    /// registrar reaches it only over this connection.
    registered: std::sync::atomic::AtomicBool,
}

/// What an eviction rank says of a connection, lowest evicted first.
pub mod class {
    /// Never completed a message or request.
    pub const UNPROVEN: u8 = 0;
    /// Completed one.
    pub const PROVEN: u8 = 1;
    /// Carries a registration flow (its client registered through it with a Path).
    pub const REGISTERED: u8 = 2;
}

impl Activity {
    /// A connection opened at `now_ns`.
    pub fn new(now_ns: u64) -> Activity {
        Activity {
            last: AtomicU64::new(now_ns),
            proven: std::sync::atomic::AtomicBool::new(false),
            registered: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Its client registered through it with a flow token: evicted after every other.
    pub fn mark_registered(&self) {
        if !self.registered.load(Ordering::Relaxed) {
            self.registered.store(true, Ordering::Relaxed);
        }
    }

    /// Something arrived at `now_ns`: a whole message (`message`), or only a keep-alive.
    pub fn touch(&self, now_ns: u64, message: bool) {
        self.last.store(now_ns, Ordering::Relaxed);
        if message && !self.proven.load(Ordering::Relaxed) {
            self.proven.store(true, Ordering::Relaxed);
        }
    }

    /// When it was last active, for a relay that keeps its idle clock here (a store per
    /// movement, no second clock).
    pub fn stamp(&self) -> &AtomicU64 {
        &self.last
    }

    /// The eviction rank: lower goes first ([`class`], then when it was last active).
    pub fn rank(&self) -> (u8, u64) {
        let class = if self.registered.load(Ordering::Relaxed) {
            class::REGISTERED
        } else if self.proven.load(Ordering::Relaxed) {
            class::PROVEN
        } else {
            class::UNPROVEN
        };
        (class, self.last.load(Ordering::Relaxed))
    }
}

/// A stream listener's admission: the process's pool, the listener's per-source limit, the
/// files each connection costs, and what it refused.
#[derive(Debug)]
pub struct Gate {
    budget: Arc<FileBudget>,
    sources: Arc<SourceLimit>,
    files: u64,
    /// Connections refused for want of files.
    pub refused_budget: AtomicU64,
}

impl Gate {
    /// A gate on `budget` charging `files` per connection, `max_per_source` from one source
    /// (`None`: no limit).
    pub fn new(budget: Arc<FileBudget>, files: u64, max_per_source: Option<u32>) -> Gate {
        Gate {
            budget,
            sources: Arc::new(SourceLimit::new(max_per_source.unwrap_or(u32::MAX))),
            files,
            refused_budget: AtomicU64::new(0),
        }
    }

    /// A reload's new `max_per_source` (for new connections; live ones stay).
    pub fn set_max_per_source(&self, max: Option<u32>) {
        self.sources.set_max(max.unwrap_or(u32::MAX));
    }

    /// Admit a connection from `ip`, or say why not (counted).
    pub fn admit(&self, ip: IpAddr) -> Result<Admission, Refusal> {
        let r = admit(&self.budget, Some(&self.sources), ip, self.files);
        if r.as_ref().err() == Some(&Refusal::Budget) {
            self.refused_budget.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// Its source's place alone (the first check of [`Gate::admit`]), refused when the
    /// source is at its limit (counted).
    pub fn admit_source(&self, ip: IpAddr) -> Result<SourceSlot, Refusal> {
        self.sources.admit(ip).ok_or(Refusal::PerSource)
    }

    /// The files each connection costs.
    pub fn files(&self) -> u64 {
        self.files
    }

    /// Count a refusal for want of files, and say so.
    pub fn refused_for_files(&self) -> Refusal {
        self.refused_budget.fetch_add(1, Ordering::Relaxed);
        Refusal::Budget
    }

    pub fn budget(&self) -> &Arc<FileBudget> {
        &self.budget
    }

    pub fn sources(&self) -> &SourceLimit {
        &self.sources
    }

    /// What this listener refused, by reason.
    pub fn refusals(&self) -> [(Refusal, u64); 2] {
        [
            (Refusal::Budget, self.refused_budget.load(Ordering::Relaxed)),
            (
                Refusal::PerSource,
                self.sources.refused.load(Ordering::Relaxed),
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_reserve_is_a_tenth_and_what_the_config_needs() {
        let none = Needs::default();
        assert_eq!(split(20_000, &none), (2_000 + 64, 20_000 - 2_064));
        assert_eq!(split(1_024, &none), (102 + 64, 1_024 - 166));
        // Small limits keep the least reserve; large ones give the rest to the pool.
        assert_eq!(split(300, &none).0, 64 + 64);
        assert_eq!(split(1_048_576, &none).0, 4_096 + 64);
        let needs = Needs {
            listeners: 8,
            probes: 30,
            links: 30,
            admin: 64,
        };
        assert_eq!(split(20_000, &needs).0, 2_000 + 64 + 132);
        // A limit the reserve takes whole leaves no pool, never a negative one.
        assert_eq!(split(100, &needs), (100, 0));
    }

    #[test]
    fn the_pool_refuses_past_its_size_and_counts() {
        let b = Arc::new(FileBudget::new(1_000, &Needs::default()));
        let pool = b.pool();
        let mut held = Vec::new();
        while let Some(p) = b.permit(2) {
            held.push(p);
        }
        assert_eq!(held.len() as u64, pool / 2);
        assert!(b.is_low());
        assert_eq!(b.refused.load(Ordering::Relaxed), 1);
        // One file may still fit where two do not.
        assert_eq!(b.take(1), pool % 2 == 1);
        held.clear();
        assert_eq!(b.used(), u64::from(pool % 2 == 1));
        assert!(!b.is_low());
    }

    #[test]
    fn a_source_is_limited_and_ipv6_counts_by_its_64() {
        let l = Arc::new(SourceLimit::new(2));
        let a: IpAddr = "192.0.2.7".parse().unwrap();
        let s1 = l.admit(a).expect("first");
        let _s2 = l.admit(a).expect("second");
        assert!(l.admit(a).is_none());
        assert_eq!(l.refused.load(Ordering::Relaxed), 1);
        // Another address is another source; the mapped form is the same one.
        let _s8 = l
            .admit("192.0.2.8".parse().unwrap())
            .expect("another source");
        assert!(l.admit("::ffff:192.0.2.7".parse().unwrap()).is_none());
        drop(s1);
        assert_eq!(l.count(a), 1);
        assert!(l.admit(a).is_some());
        let v6 = Arc::new(SourceLimit::new(1));
        let _p = v6.admit("2001:db8:1:2::1".parse().unwrap()).expect("first");
        assert!(
            v6.admit("2001:db8:1:2:ffff::9".parse().unwrap()).is_none(),
            "same /64"
        );
        assert!(
            v6.admit("2001:db8:1:3::1".parse().unwrap()).is_some(),
            "next /64"
        );
        // Lowered by a reload: new connections see it, live ones stay.
        l.set_max(1);
        assert!(l.admit("192.0.2.8".parse().unwrap()).is_none());
    }

    #[test]
    fn a_source_at_its_limit_takes_nothing_from_the_pool() {
        let b = Arc::new(FileBudget::new(1_000, &Needs::default()));
        let l = Arc::new(SourceLimit::new(1));
        let ip: IpAddr = "198.51.100.1".parse().unwrap();
        let a = admit(&b, Some(&l), ip, 2).expect("admitted");
        assert_eq!(b.used(), 2);
        assert_eq!(admit(&b, Some(&l), ip, 2).err(), Some(Refusal::PerSource));
        assert_eq!(b.used(), 2);
        drop(a);
        assert_eq!((b.used(), l.sources()), (0, 0));
    }

    #[test]
    fn a_rank_is_the_class_then_the_last_activity() {
        use class::{PROVEN, REGISTERED, UNPROVEN};
        let a = Activity::new(10);
        assert_eq!(a.rank(), (UNPROVEN, 10));
        a.touch(20, false);
        assert_eq!(
            a.rank(),
            (UNPROVEN, 20),
            "a keep-alive is activity, not a message"
        );
        a.touch(30, true);
        assert_eq!(a.rank(), (PROVEN, 30));
        a.mark_registered();
        a.touch(40, false);
        assert_eq!(a.rank(), (REGISTERED, 40));
    }

    proptest! {
        /// Whatever is admitted and dropped, in any order, the pool's count is what the live
        /// admissions hold, never above the pool, and no source holds more than its limit.
        #[test]
        fn counts_match_the_live_admissions(
            ops in proptest::collection::vec((0u8..6, any::<bool>(), 0usize..64), 1..400),
            max in 1u32..5,
        ) {
            let b = Arc::new(FileBudget::new(400, &Needs::default()));
            let l = Arc::new(SourceLimit::new(max));
            let mut live: Vec<(u8, Admission)> = Vec::new();
            for (src, add, pick) in ops {
                let ip = IpAddr::from([10, 0, 0, src]);
                if add {
                    if let Ok(a) = admit(&b, Some(&l), ip, 1 + u64::from(src % 2)) {
                        live.push((src, a));
                    }
                } else if !live.is_empty() {
                    live.swap_remove(pick % live.len());
                }
                let held: u64 = live.iter().map(|(s, _)| 1 + u64::from(s % 2)).sum();
                prop_assert_eq!(b.used(), held);
                prop_assert!(b.used() <= b.pool());
                for s in 0..6u8 {
                    let n = live.iter().filter(|(x, _)| *x == s).count() as u32;
                    prop_assert!(n <= max);
                    prop_assert_eq!(l.count(IpAddr::from([10, 0, 0, s])), n);
                }
            }
        }
    }
}
