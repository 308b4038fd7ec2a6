//! The decision of one vserver: which service takes a request. PURE: the caller passes
//! the key (already extracted and hashed) and `now`; the balancer reads per-member
//! counters and health, and returns the member chosen and the path that chose it.
//!
//! Order of decision (docs/methods.md, docs/slow_start.md):
//! 1. Hash methods rank members by the consistent-hash selector (built for the current UP
//!    set, swapped in atomically on health change, so lookups never lock); the first
//!    member that is UP, below `max_clients` and, with bounded loads, not overloaded wins.
//! 2. No key, or no usable ranked member: fall back to `least_connection`
//!    (`round_robin` for an unparseable `url_hash` / `domain_hash` request).
//! 3. Non-hash methods run through slow start, which withholds requests from new members
//!    beyond their allowed rate; those requests go to the others by the same method.
//!
//! Passive ejection ([`crate::eject`], docs/ejection.md): the data paths report each
//! request's outcome ([`Balancer::report_outcome`]); a member ejected there is not usable for
//! new flows (the hash ranking passes it over like a member that is not UP, the methods skip
//! it) but still accepts its established ones; a member in half-open is chosen for one trial
//! flow at a time. The per-request path reads one atomic per member for it, and takes the
//! ejection lock only when it chooses a member under ejection or an outcome changes something.

use crate::config::{Config, HashParams, Method, Vserver};
use crate::eject::{EjectParams, EjectStatus, EjectView, Failure, Outcome, Report};
use crate::hash;
use crate::methods::{self, MethodState};
use crate::select::{self, HashSelector};
use crate::slow_start::SlowStart;
use crate::stats::{Nanos, ServiceCounters};
use crate::sync::lock;
use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Operational state of a member (docs/config.md, Model).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    Up = 0,
    Down = 1,
    /// Disabled by the operator: no new flows, existing ones drain.
    OutOfService = 2,
}

impl Health {
    fn from_u8(v: u8) -> Health {
        match v {
            0 => Health::Up,
            1 => Health::Down,
            _ => Health::OutOfService,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Health::Up => "UP",
            Health::Down => "DOWN",
            Health::OutOfService => "OUT_OF_SERVICE",
        }
    }
}

/// Every state [`Balancer::state_name`] may give, in the order the metrics list them.
pub const STATE_NAMES: [&str; 5] = ["UP", "DOWN", "OUT_OF_SERVICE", "EJECTED", "DRAINING"];

/// What the key extraction produced, hashed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyInput {
    /// `hash::key_hash` of the extracted key.
    Hash(u64),
    /// No key could be extracted: least_connection fallback.
    NoKey,
    /// url_hash / domain_hash on a request that could not be parsed or carries no domain:
    /// round_robin fallback.
    Unparseable,
}

/// Which path chose the member, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// The key's first-ranked member.
    Hash,
    /// A lower-ranked member because the higher ones were not usable.
    NextRanked,
    /// A pinned dialog / session (decided by the caller, counted here for uniformity).
    Affinity,
    /// A non-hash method.
    Method,
    /// Hash method fell back to least_connection.
    FallbackLeastConnection,
    /// url_hash / domain_hash fell back to round_robin.
    FallbackRoundRobin,
}

impl Path {
    pub const ALL: [Path; 6] = [
        Path::Hash,
        Path::NextRanked,
        Path::Affinity,
        Path::Method,
        Path::FallbackLeastConnection,
        Path::FallbackRoundRobin,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Path::Hash => "hash",
            Path::NextRanked => "next_ranked",
            Path::Affinity => "affinity",
            Path::Method => "method",
            Path::FallbackLeastConnection => "fallback_least_connection",
            Path::FallbackRoundRobin => "fallback_round_robin",
        }
    }
}

/// A decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    /// Index into the vserver's member list.
    pub member: usize,
    pub path: Path,
}

/// Static facts about one member of a vserver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberInfo {
    /// Index into `Config::services`.
    pub service: usize,
    pub name: String,
    pub weight: u32,
    /// 0 = unlimited.
    pub max_clients: u32,
    pub id_hash: u64,
    /// Removed from the vserver by a reload, kept only for the flows pinned to it: never
    /// given a new flow, outside the hash ranking (see `docs/draining.md`).
    pub draining: bool,
    /// Listed only by routing rules' pools, not by the vserver's own `services`: outside the
    /// vserver's own ranking and methods, chosen only in the pools that list it
    /// (docs/routing.md).
    pub pool_only: bool,
    /// Its tier ([`crate::config::Service::tier`]): new flows go to the best (lowest) tier
    /// with an available member (docs/methods.md, Tiers).
    pub tier: u32,
}

/// The pool of a routing rule: its own ranking, method, hash parameters and slow start over the
/// members it lists; health, ejection and counters are the members' own, shared with every
/// pool that lists them.
struct RoutePool {
    /// The rule's name (a reload carries the pool's slow start by it).
    route: String,
    method: Method,
    hash: HashParams,
    /// Present for non-hash methods with slow start: over the pool's own indices.
    slow_start: Option<Mutex<SlowStart>>,
    /// Mirrors `SlowStart::is_active` of `slow_start`, as [`Balancer::slow_start_active`].
    slow_start_active: AtomicBool,
    /// The balancer's member index of each of the pool's members (pool order).
    members: Vec<usize>,
    weights: Vec<u32>,
    counters: Vec<Arc<ServiceCounters>>,
    selector: ArcSwap<HashSelector>,
    state: MethodState,
}

/// What the routing rules of a vserver decided, per rule (and for the default, last).
#[derive(Debug, Default)]
pub struct RouteCounters {
    /// Requests the rule matched (whatever became of them).
    pub matched: AtomicU64,
    /// Requests the rule (or the default) refused with its code.
    pub rejected: AtomicU64,
    pub dropped: AtomicU64,
    /// Requests its pool had no usable member for (answered 503).
    pub unavailable: AtomicU64,
}

/// Passive ejection of a vserver's members (`eject:`): the pure [`EjectView`] behind a lock,
/// and per member the mirrors of it that the per-request path reads without the lock.
struct Ejector {
    view: Mutex<EjectView>,
    /// New flows from this time on (0: any time): [`EjectView::not_before`].
    gate: Vec<AtomicU64>,
    /// Ejected or half-open: a new flow must take the trial through the view.
    restricted: Vec<AtomicBool>,
    /// Failures in a row, so that a success with nothing to reset takes no lock.
    failures: Vec<AtomicU32>,
}

impl Ejector {
    fn new(params: EjectParams, members: usize, serving: usize) -> Ejector {
        Ejector {
            view: Mutex::new(EjectView::new(params, members, serving)),
            gate: (0..members).map(|_| AtomicU64::new(0)).collect(),
            restricted: (0..members).map(|_| AtomicBool::new(false)).collect(),
            failures: (0..members).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// Store member `m`'s mirrors of `v` (with `v`'s lock held, so they follow its order).
    fn mirror(&self, v: &EjectView, m: usize) {
        let not_before = v.not_before(m);
        if let (Some(g), Some(r), Some(f)) = (
            self.gate.get(m),
            self.restricted.get(m),
            self.failures.get(m),
        ) {
            g.store(not_before.unwrap_or(0), Ordering::Release);
            r.store(not_before.is_some(), Ordering::Release);
            let n = v.get(m).map_or(0, |s| s.consecutive_failures());
            f.store(n, Ordering::Relaxed);
        }
    }

    /// Whether member `m` may take a new flow at `now` as far as ejection goes, taking
    /// nothing (the trial is taken once the member is chosen, [`Balancer::takes_new_flow`]).
    fn admits(&self, m: usize, now: Nanos) -> bool {
        self.gate
            .get(m)
            .is_none_or(|g| now >= g.load(Ordering::Relaxed))
    }
}

/// The balancer of one vserver. Shared by all workers (`&self` everywhere).
pub struct Balancer {
    /// The vserver's name (for the logs).
    name: String,
    method: Method,
    /// The vserver's hash parameters (pool 0's).
    hash: HashParams,
    balance_factor: Option<u32>,
    members: Vec<MemberInfo>,
    /// The members the hash selector ranks: the leading ones, those not draining (draining
    /// members come last, [`MemberInfo::of`]). The selector is the one a config without the
    /// draining members builds, so every instance chooses alike whatever it still drains.
    serving: usize,
    weights: Vec<u32>,
    health: Vec<AtomicU8>,
    /// Shared with the balancer a reload rebuilds from this one, for the members both
    /// have: connections and sessions opened before the reload are counted (and closed) on
    /// the same counters the new balancer reads.
    counters: Vec<Arc<ServiceCounters>>,
    selector: ArcSwap<HashSelector>,
    method_state: MethodState,
    /// Present for non-hash methods with slow start configured.
    slow_start: Option<Mutex<SlowStart>>,
    /// Mirrors `SlowStart::is_active` (some member is new) after every locked call, so the
    /// per-request path takes the lock only while slow start has work to do.
    slow_start_active: AtomicBool,
    /// Serialises health changes (rebuild + swap); never taken by lookups.
    control: Mutex<()>,
    paths: [AtomicU64; 6],
    /// Failures the data paths saw since the monitor last looked (connect refused, ICMP
    /// unreachable on a connected socket); the monitor counts them toward DOWN.
    passive_failures: Vec<AtomicU64>,
    /// Passive ejection; `None` with `eject: off`.
    eject: Option<Ejector>,
    /// The serving members are in more than one tier.
    has_tiers: bool,
    /// The vserver's routing rules (docs/routing.md); `None` without `routes`.
    routes: Option<Arc<crate::route::Routes>>,
    /// The rules' pools: pool `k` is `pools[k - 1]`, pool 0 the vserver's own members.
    pools: Vec<RoutePool>,
    /// Per rule, then the default; carried across a reload by rule name.
    route_counters: Vec<Arc<RouteCounters>>,
}

impl std::fmt::Debug for Balancer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Balancer")
            .field("method", &self.method)
            .field("members", &self.members)
            .finish_non_exhaustive()
    }
}

/// The UP set of the first `serving` members (those the selector ranks).
fn up_set(health: &[AtomicU8], serving: usize) -> Vec<bool> {
    health[..serving.min(health.len())]
        .iter()
        .map(|h| Health::from_u8(h.load(Ordering::Acquire)) == Health::Up)
        .collect()
}

impl MemberInfo {
    /// The tier as `/status`, the dashboard and `simulate hash` name it: `primary` (0),
    /// `backup` (`backup: true`), else the SRV priority (`priority 10`, `backup priority 10`).
    pub fn tier_name(&self) -> String {
        let (backup, priority) = (self.tier >> 16, self.tier & 0xffff);
        match (backup, priority) {
            (0, 0) => "primary".to_owned(),
            (_, 0) => "backup".to_owned(),
            (0, p) => format!("priority {p}"),
            (_, p) => format!("backup priority {p}"),
        }
    }

    /// The members of `vserver`, in its order: what hashing sees of each service (identity:
    /// `hash_id` or address; weight at least 1). The balancer and `simulate hash --config`
    /// both start here.
    /// Draining members (`vserver.draining`) follow the others.
    /// Services only routing rules list follow the vserver's own (`pool_only`).
    pub fn of(config: &Config, vserver: &Vserver) -> Vec<MemberInfo> {
        let serving = vserver.services.len();
        let routed = serving + vserver.pool_only().len();
        vserver
            .members()
            .enumerate()
            .map(|(k, i)| (i, k >= routed, (serving..routed).contains(&k)))
            .filter_map(|(i, d, p)| config.services.get(i).map(|s| (i, s, d, p)))
            .map(|(i, s, draining, pool_only)| MemberInfo {
                service: i,
                name: s.name.clone(),
                weight: s.weight.max(1),
                max_clients: s.max_clients,
                id_hash: hash::service_identity_hash(s.hash_id.as_deref(), &s.address),
                draining,
                pool_only,
                tier: s.tier(),
            })
            .collect()
    }

    /// The member as the hash selectors take it.
    pub fn select_member(&self) -> select::Member {
        select::Member {
            id_hash: self.id_hash,
            weight: self.weight,
        }
    }
}

impl Balancer {
    /// Build the balancer of `vserver`; every member starts UP.
    pub fn new(config: &Config, vserver: &Vserver) -> Balancer {
        let members = MemberInfo::of(config, vserver);
        let serving = members
            .iter()
            .take_while(|m| !m.draining && !m.pool_only)
            .count();
        let weights: Vec<u32> = members.iter().map(|m| m.weight).collect();
        let select_members: Vec<select::Member> = members[..serving]
            .iter()
            .map(MemberInfo::select_member)
            .collect();
        let up = vec![true; serving];
        let has_tiers = members[..serving].iter().any(|m| m.tier != members[0].tier);
        let passive_failures = members.iter().map(|_| AtomicU64::new(0)).collect();
        let selector = HashSelector::build_bounded(
            config.lb.hash_algorithm,
            config.lb.hash_fingers,
            config.lb.prac_max_share,
            &select_members,
            &up,
        );
        let slow_start = vserver
            .slow_start
            .filter(|s| !vserver.method.is_hash() && s.new_service_request_rate > 0)
            .map(|s| {
                // Members present when the vserver starts are its base: with every member
                // new there would be nobody to take the withheld requests. Members added by
                // reload or returning from DOWN are new.
                // Draining members take no new request: slow start never counts them.
                let mut ss = SlowStart::new(Some(s));
                for (i, m) in members[..serving].iter().enumerate() {
                    ss.register(i, m.weight, true);
                }
                Mutex::new(ss)
            });
        Balancer {
            name: vserver.name.clone(),
            eject: vserver
                .eject
                .map(|p| Ejector::new(p, members.len(), serving)),
            method: vserver.method,
            hash: vserver.hash.clone(),
            balance_factor: vserver.hash.hash_balance_factor,
            health: members
                .iter()
                .map(|_| AtomicU8::new(Health::Up as u8))
                .collect(),
            counters: members
                .iter()
                .map(|_| Arc::new(ServiceCounters::new()))
                .collect(),
            members,
            serving,
            weights,
            selector: ArcSwap::from_pointee(selector),
            method_state: MethodState::new(&[]),
            slow_start,
            slow_start_active: AtomicBool::new(false),
            control: Mutex::new(()),
            paths: Default::default(),
            passive_failures,
            has_tiers,
            routes: vserver.routes.clone().map(Arc::new),
            pools: Vec::new(),
            route_counters: vserver.routes.as_ref().map_or_else(Vec::new, |r| {
                (0..=r.rules.len())
                    .map(|_| Arc::new(RouteCounters::default()))
                    .collect()
            }),
        }
        .with_method_state()
        .with_pools(config, vserver)
    }

    /// The routing rules' pools, over the members built already.
    fn with_pools(mut self, config: &Config, vserver: &Vserver) -> Balancer {
        let mut pools = Vec::with_capacity(vserver.route_pools.len());
        for p in &vserver.route_pools {
            let members: Vec<usize> = p
                .services
                .iter()
                .filter_map(|s| {
                    self.members
                        .iter()
                        .position(|m| m.service == *s && !m.draining)
                })
                .collect();
            let weights: Vec<u32> = members.iter().map(|&m| self.weights[m]).collect();
            let select_members: Vec<select::Member> = members
                .iter()
                .map(|&m| self.members[m].select_member())
                .collect();
            let up = vec![true; members.len()];
            let method = p.method.unwrap_or(vserver.method);
            // As the vserver's: the members present at the start are the pool's base.
            let slow_start = p
                .slow_start
                .filter(|s| !method.is_hash() && s.new_service_request_rate > 0)
                .map(|s| {
                    let mut ss = SlowStart::new(Some(s));
                    for (l, w) in weights.iter().enumerate() {
                        ss.register(l, *w, true);
                    }
                    Mutex::new(ss)
                });
            pools.push(RoutePool {
                route: p.route.clone(),
                method,
                hash: HashParams {
                    hash_length: p.hash_length,
                    ..vserver.hash.clone()
                },
                slow_start,
                slow_start_active: AtomicBool::new(false),
                counters: members
                    .iter()
                    .map(|&m| Arc::clone(&self.counters[m]))
                    .collect(),
                selector: ArcSwap::from_pointee(HashSelector::build_bounded(
                    config.lb.hash_algorithm,
                    config.lb.hash_fingers,
                    config.lb.prac_max_share,
                    &select_members,
                    &up,
                )),
                state: MethodState::new(&weights),
                weights,
                members,
            });
        }
        self.pools = pools;
        self
    }

    /// Build the balancer of `vserver` for a reload of the vserver `old` balanced: members
    /// present in both (by service name) share their counters with `old`, so flows
    /// established before the reload keep counting (and closing) where the new balancer
    /// reads them; every member starts UP. Their ejections go on (passive ejection, within
    /// the new vserver's `max_fraction`).
    pub fn carrying(config: &Config, vserver: &Vserver, old: &Balancer) -> Balancer {
        Balancer::carried(config, vserver, old, true)
    }

    /// Build the balancer of `vserver` for a reload that counts its flows afresh (sip-udp
    /// migrates its dialogs and counts them on the new balancer): only the members' ejections
    /// go on (docs/ejection.md: a reload does not end one); their counters start empty.
    pub fn carrying_ejections(config: &Config, vserver: &Vserver, old: &Balancer) -> Balancer {
        Balancer::carried(config, vserver, old, false)
    }

    fn carried(config: &Config, vserver: &Vserver, old: &Balancer, counters: bool) -> Balancer {
        let mut b = Balancer::new(config, vserver);
        let old_view = old.eject.as_ref().map(|e| lock(&e.view).clone());
        let mut view = b.eject.as_mut().map(|e| {
            e.view
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        });
        let old_ss = old.slow_start().filter(SlowStart::is_active);
        let mut ss = b.slow_start.as_mut().map(|s| {
            s.get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        });
        if let (Some(ss), Some(o)) = (ss.as_deref_mut(), old_ss.as_ref()) {
            ss.carry_totals(o);
        }
        for (i, m) in b.members.iter().enumerate() {
            let Some(j) = old.members.iter().position(|o| o.name == m.name) else {
                continue;
            };
            // A member still in slow start stays in it, where its ramp had reached.
            if let (Some(ss), Some(o)) = (ss.as_deref_mut(), old_ss.as_ref())
                && !m.draining
            {
                ss.carry(i, o, j);
            }
            if counters && let (Some(slot), Some(c)) = (b.counters.get_mut(i), old.counters.get(j))
            {
                *slot = Arc::clone(c);
            }
            if let (Some(v), Some(state)) = (
                view.as_deref_mut(),
                old_view.as_ref().and_then(|o| o.get(j)),
            ) {
                v.carry(i, state.clone());
            }
        }
        if let Some(e) = &b.eject {
            let v = lock(&e.view);
            for i in 0..b.members.len() {
                e.mirror(&v, i);
            }
        }
        if let Some(ss) = &b.slow_start {
            b.slow_start_active
                .store(lock(ss).is_active(), Ordering::Release);
        }
        for p in &mut b.pools {
            p.counters = p
                .members
                .iter()
                .map(|&m| Arc::clone(&b.counters[m]))
                .collect();
            // A pool's member still in slow start stays in it, found by rule and service name.
            let Some(old_p) = old.pools.iter().find(|o| o.route == p.route) else {
                continue;
            };
            let Some(o) = old_p
                .slow_start
                .as_ref()
                .map(|ss| lock(ss).clone())
                .filter(SlowStart::is_active)
            else {
                continue;
            };
            if let Some(ss) = p.slow_start.as_mut() {
                let ss = ss
                    .get_mut()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                ss.carry_totals(&o);
                for (l, &m) in p.members.iter().enumerate() {
                    let name = &b.members[m].name;
                    if let Some(j) = old_p
                        .members
                        .iter()
                        .position(|&om| old.members[om].name == *name)
                    {
                        ss.carry(l, &o, j);
                    }
                }
                p.slow_start_active.store(ss.is_active(), Ordering::Release);
            }
        }
        // A rule keeps its counts across a reload by name; the default keeps the default's.
        if let (Some(new), Some(old_routes)) = (&b.routes, &old.routes) {
            for (i, r) in new.rules.iter().enumerate() {
                if let Some(j) = old_routes.rules.iter().position(|o| o.name == r.name)
                    && let (Some(slot), Some(c)) =
                        (b.route_counters.get_mut(i), old.route_counters.get(j))
                {
                    *slot = Arc::clone(c);
                }
            }
            if let (Some(slot), Some(c)) = (b.route_counters.last_mut(), old.route_counters.last())
            {
                *slot = Arc::clone(c);
            }
        }
        b.rebuild_selector();
        b
    }

    /// A copy to try a decision on: the same health, ejections, rankings, method positions
    /// and slow start, the members' counters shared (choosing reads them, never changes
    /// them). What the copy chooses changes nothing here: no round-robin position moves, no
    /// half-open trial is taken, no path is counted (`POST /vservers/NAME/route`).
    pub fn snapshot(&self) -> Balancer {
        let copy_u8 = |v: &[AtomicU8]| -> Vec<AtomicU8> {
            v.iter()
                .map(|a| AtomicU8::new(a.load(Ordering::Acquire)))
                .collect()
        };
        let slow = |ss: &Option<Mutex<SlowStart>>| ss.as_ref().map(|s| Mutex::new(lock(s).clone()));
        let copy_bool = |a: &AtomicBool| AtomicBool::new(a.load(Ordering::Acquire));
        Balancer {
            name: self.name.clone(),
            method: self.method,
            hash: self.hash.clone(),
            balance_factor: self.balance_factor,
            members: self.members.clone(),
            serving: self.serving,
            weights: self.weights.clone(),
            health: copy_u8(&self.health),
            counters: self.counters.clone(),
            selector: ArcSwap::new(self.selector.load_full()),
            method_state: self.method_state.snapshot(),
            slow_start: slow(&self.slow_start),
            slow_start_active: copy_bool(&self.slow_start_active),
            control: Mutex::new(()),
            paths: Default::default(),
            passive_failures: self.members.iter().map(|_| AtomicU64::new(0)).collect(),
            eject: self.eject.as_ref().map(|e| {
                let view = lock(&e.view).clone();
                let copy = Ejector {
                    gate: (0..self.members.len()).map(|_| AtomicU64::new(0)).collect(),
                    restricted: (0..self.members.len())
                        .map(|_| AtomicBool::new(false))
                        .collect(),
                    failures: (0..self.members.len()).map(|_| AtomicU32::new(0)).collect(),
                    view: Mutex::new(view),
                };
                {
                    let v = lock(&copy.view);
                    for m in 0..self.members.len() {
                        copy.mirror(&v, m);
                    }
                }
                copy
            }),
            has_tiers: self.has_tiers,
            routes: self.routes.clone(),
            pools: self
                .pools
                .iter()
                .map(|p| RoutePool {
                    route: p.route.clone(),
                    method: p.method,
                    hash: p.hash.clone(),
                    slow_start: slow(&p.slow_start),
                    slow_start_active: copy_bool(&p.slow_start_active),
                    members: p.members.clone(),
                    weights: p.weights.clone(),
                    counters: p.counters.clone(),
                    selector: ArcSwap::new(p.selector.load_full()),
                    state: p.state.snapshot(),
                })
                .collect(),
            route_counters: self.route_counters.clone(),
        }
    }

    fn with_method_state(mut self) -> Balancer {
        self.method_state = MethodState::new(&self.weights);
        self
    }

    pub fn method(&self) -> Method {
        self.method
    }

    pub fn members(&self) -> &[MemberInfo] {
        &self.members
    }

    /// Whether `member` drains: removed by a reload, kept for the flows pinned to it.
    pub fn is_draining(&self, member: usize) -> bool {
        self.members.get(member).is_some_and(|m| m.draining)
    }

    pub fn counters(&self, member: usize) -> Option<&ServiceCounters> {
        self.counters.get(member).map(|c| &**c)
    }

    pub fn health(&self, member: usize) -> Option<Health> {
        self.health
            .get(member)
            .map(|h| Health::from_u8(h.load(Ordering::Acquire)))
    }

    /// A data path saw `member` fail (connect refused, ICMP port unreachable on a
    /// connected socket): passive failure detection, counted toward DOWN by its monitor.
    pub fn report_failure(&self, member: usize) {
        if let Some(c) = self.passive_failures.get(member) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Report the outcome of a request (or connection) a data path gave `member` at `now`,
    /// for passive ejection (docs/ejection.md). The data path decides what is a failure and
    /// reports only what is the service's: a SIP failover code answer (with the response's
    /// Retry-After, RFC 3261 §20.33, in [`Failure::retry_after`]), no answer in time, a
    /// refused connect, a write without progress; never fulcrum's own local errors (EMFILE,
    /// EADDRNOTAVAIL: [`crate::eject::Cause::of_stream_error`] tells them apart), and on a
    /// `udp` vserver only ICMP errors, never silence
    /// ([`crate::eject::Cause::of_datagram_error`]). A success is an answer that is not a
    /// failure.
    ///
    /// Cheap on the per-request path: a success with no failure on record and no ejection
    /// running reads two atomics and takes no lock. Returns what a failure led to (`None` for
    /// a success, with `eject: off`, or for a member the vserver does not have). Independent of
    /// [`Balancer::report_failure`] (the monitor's passive detection), which a data path
    /// calls too where it applies.
    pub fn report_outcome(&self, member: usize, outcome: Outcome, now: Nanos) -> Option<Report> {
        let e = self.eject.as_ref()?;
        let info = self.members.get(member)?;
        match outcome {
            Outcome::Success => {
                let quiet = e.failures[member].load(Ordering::Relaxed) == 0
                    && !e.restricted[member].load(Ordering::Relaxed);
                if !quiet {
                    let mut v = lock(&e.view);
                    v.success(member, now);
                    e.mirror(&v, member);
                }
                None
            }
            Outcome::Failure(f) => {
                let report = {
                    let mut v = lock(&e.view);
                    let r = v.failure(member, now, f);
                    e.mirror(&v, member);
                    r
                };
                match report {
                    Report::Ejected { until } => tracing::warn!(
                        vserver = %self.name,
                        service = %info.name,
                        reason = %f.cause.name(),
                        for_s = until.saturating_sub(now) as f64 / 1e9,
                        "service ejected"
                    ),
                    Report::Refused => tracing::debug!(
                        vserver = %self.name,
                        service = %info.name,
                        reason = %f.cause.name(),
                        "not ejected: max_fraction of the services are ejected already"
                    ),
                    Report::Counted | Report::Ignored => {}
                }
                Some(report)
            }
        }
    }

    /// [`Balancer::report_outcome`] of a success.
    pub fn report_success(&self, member: usize, now: Nanos) {
        self.report_outcome(member, Outcome::Success, now);
    }

    /// [`Balancer::report_outcome`] of a failure.
    pub fn report_failure_with(
        &self,
        member: usize,
        failure: Failure,
        now: Nanos,
    ) -> Option<Report> {
        self.report_outcome(member, Outcome::Failure(failure), now)
    }

    /// End `member`'s ejection now (the operator's enable): true when it was ejected.
    pub fn end_ejection(&self, member: usize) -> bool {
        let Some(e) = &self.eject else {
            return false;
        };
        let mut v = lock(&e.view);
        let ended = v.end(member);
        e.mirror(&v, member);
        ended
    }

    /// `member`'s ejection as status pages show it at `now`; `None` with `eject: off`.
    pub fn ejection(&self, member: usize, now: Nanos) -> Option<EjectStatus> {
        let e = self.eject.as_ref()?;
        lock(&e.view).status(member, now)
    }

    /// The vserver's ejection parameters; `None` with `eject: off`.
    pub fn eject_params(&self) -> Option<EjectParams> {
        self.eject.as_ref().map(|e| *lock(&e.view).params())
    }

    /// Ejections not made because `max_fraction` of the members were ejected already.
    pub fn ejections_refused(&self) -> u64 {
        self.eject.as_ref().map_or(0, |e| lock(&e.view).refused())
    }

    /// Passive failures reported since the last call (the monitor drains them).
    pub fn take_failures(&self, member: usize) -> u64 {
        self.passive_failures
            .get(member)
            .map_or(0, |c| c.swap(0, Ordering::Relaxed))
    }

    /// How many requests each path has decided.
    pub fn path_count(&self, path: Path) -> u64 {
        self.paths[path as usize].load(Ordering::Relaxed)
    }

    /// Change a member's state. A change of the UP set rebuilds the hash selector aside and
    /// swaps it in; DOWN→UP makes the member new for slow start (docs/slow_start.md).
    pub fn set_health(&self, member: usize, health: Health, now: Nanos) {
        let Some(slot) = self.health.get(member) else {
            return;
        };
        let _guard = lock(&self.control);
        let old = Health::from_u8(slot.swap(health as u8, Ordering::AcqRel));
        if old == health {
            return;
        }
        if (old == Health::Up) != (health == Health::Up) {
            self.rebuild_selector();
            if let Some(ss) = &self.slow_start {
                let mut ss = lock(ss);
                ss.set_up(member, health == Health::Up, now);
                self.slow_start_active
                    .store(ss.is_active(), Ordering::Release);
            }
            for p in &self.pools {
                if let (Some(ss), Some(l)) =
                    (&p.slow_start, p.members.iter().position(|&m| m == member))
                {
                    let mut ss = lock(ss);
                    ss.set_up(l, health == Health::Up, now);
                    p.slow_start_active.store(ss.is_active(), Ordering::Release);
                }
            }
        }
    }

    fn rebuild_selector(&self) {
        let up = up_set(&self.health, self.serving);
        let built = self.selector.load().with_up(&up);
        self.selector.store(Arc::new(built));
        for p in &self.pools {
            let up: Vec<bool> = p
                .members
                .iter()
                .map(|&m| self.health(m) == Some(Health::Up))
                .collect();
            let built = p.selector.load().with_up(&up);
            p.selector.store(Arc::new(built));
        }
    }

    /// The vserver's routing rules, when it has any.
    pub fn routes(&self) -> Option<&Arc<crate::route::Routes>> {
        self.routes.as_ref()
    }

    /// The counters of rule `i` (`rules.len()`: the default).
    pub fn route_counters(&self, i: usize) -> Option<&RouteCounters> {
        self.route_counters.get(i).map(|c| &**c)
    }

    /// Count what a rule (`None`: the default) decided.
    pub fn count_route(&self, rule: Option<usize>, target: &crate::route::Target) {
        let Some(c) = self.counters_of_rule(rule) else {
            return;
        };
        if rule.is_some() {
            c.matched.fetch_add(1, Ordering::Relaxed);
        }
        match target {
            crate::route::Target::Reject { .. } => c.rejected.fetch_add(1, Ordering::Relaxed),
            crate::route::Target::Drop => c.dropped.fetch_add(1, Ordering::Relaxed),
            crate::route::Target::Pool(_) => 0,
        };
    }

    /// Count a request a rule's (`None`: the default's) pool had no usable member for.
    pub fn count_route_unavailable(&self, rule: Option<usize>) {
        if let Some(c) = self.counters_of_rule(rule) {
            c.unavailable.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The counters of a rule (`None`: the default's).
    fn counters_of_rule(&self, rule: Option<usize>) -> Option<&RouteCounters> {
        let default = self.routes.as_ref()?.rules.len();
        self.route_counters(rule.unwrap_or(default))
    }

    /// The members of pool `pool` (0: the vserver's own, ranked ones), by member index.
    pub fn pool_members(&self, pool: usize) -> Vec<usize> {
        match pool {
            0 => (0..self.serving).collect(),
            k => self
                .pools
                .get(k - 1)
                .map_or_else(Vec::new, |p| p.members.clone()),
        }
    }

    /// The method of pool `pool`.
    pub fn pool_method(&self, pool: usize) -> Method {
        match pool {
            0 => self.method,
            k => self.pools.get(k - 1).map_or(self.method, |p| p.method),
        }
    }

    /// The hash parameters of pool `pool`'s keys: a rule's pool has its own `hash_length`.
    pub fn pool_hash(&self, pool: usize) -> &HashParams {
        match pool.checked_sub(1).and_then(|k| self.pools.get(k)) {
            Some(p) => &p.hash,
            None => &self.hash,
        }
    }

    /// Slow-start view of pool `pool` (0: the vserver's own), for status pages.
    pub fn pool_slow_start(&self, pool: usize) -> Option<SlowStart> {
        match pool.checked_sub(1) {
            None => self.slow_start(),
            Some(k) => self
                .pools
                .get(k)?
                .slow_start
                .as_ref()
                .map(|ss| lock(ss).clone()),
        }
    }

    /// Choose within pool `pool` (0: the vserver's own members, as [`Balancer::choose_avoiding`];
    /// a rule's pool: its own ranking and method, never a member outside it).
    pub fn choose_in(
        &self,
        pool: usize,
        key: KeyInput,
        now: Nanos,
        avoid: &dyn Fn(usize) -> bool,
    ) -> Option<Choice> {
        let Some(p) = pool.checked_sub(1).and_then(|k| self.pools.get(k)) else {
            return self.choose_avoiding(key, now, avoid);
        };
        let mut passed: Vec<usize> = Vec::new();
        loop {
            let skip = |i: usize| avoid(i) || passed.contains(&i);
            let choice = self.choose_pool_once(p, key, now, &skip)?;
            if self.takes_new_flow(choice.member, now, &|_| false) {
                self.paths[choice.path as usize].fetch_add(1, Ordering::Relaxed);
                return Some(choice);
            }
            passed.push(choice.member);
        }
    }

    fn choose_pool_once(
        &self,
        p: &RoutePool,
        key: KeyInput,
        now: Nanos,
        avoid: &dyn Fn(usize) -> bool,
    ) -> Option<Choice> {
        // A rule's pool is outside the vserver's bounded loads (`hash_balance_factor` weighs
        // the vserver's own members): usable is UP, not draining or ejected, below max_clients.
        let usable = |local: usize| {
            let m = p.members[local];
            !avoid(m) && self.is_usable_unbounded(m, now)
        };
        let fallback = |method: Method, path: Path| {
            let pick = |cap: &dyn Fn(usize) -> bool| {
                methods::pick(
                    method,
                    &p.state,
                    &p.counters,
                    &p.weights,
                    |l| usable(l) && cap(l),
                    now,
                )
            };
            let local = match &p.slow_start {
                Some(ss) if p.slow_start_active.load(Ordering::Acquire) => {
                    let mut ss = lock(ss);
                    let chosen = ss.route(now, pick);
                    p.slow_start_active.store(ss.is_active(), Ordering::Release);
                    chosen
                }
                _ => pick(&|_| true),
            };
            local.map(|l| Choice {
                member: p.members[l],
                path,
            })
        };
        if !p.method.is_hash() {
            return fallback(p.method, Path::Method);
        }
        match key {
            KeyInput::Hash(h) => {
                if let Some((local, rank)) = p.selector.load().pick(h, usable) {
                    let path = if rank == 0 {
                        Path::Hash
                    } else {
                        Path::NextRanked
                    };
                    return Some(Choice {
                        member: p.members[local],
                        path,
                    });
                }
                fallback(Method::LeastConnection, Path::FallbackLeastConnection)
            }
            KeyInput::NoKey => fallback(Method::LeastConnection, Path::FallbackLeastConnection),
            KeyInput::Unparseable => match methods::fallback(p.method) {
                Method::RoundRobin => fallback(Method::RoundRobin, Path::FallbackRoundRobin),
                m => fallback(m, Path::FallbackLeastConnection),
            },
        }
    }

    /// Operator change of the slow-start rate (manual mode, docs/slow_start.md).
    /// The rate applies to the rules' pools with slow start too; false when neither the
    /// vserver nor any rule's pool has slow start.
    pub fn set_slow_start_rate(&self, rate: u32, now: Nanos) -> bool {
        let mut any = false;
        for p in &self.pools {
            if let Some(ss) = &p.slow_start {
                let mut ss = lock(ss);
                ss.set_rate(rate, now);
                p.slow_start_active.store(ss.is_active(), Ordering::Release);
                any = true;
            }
        }
        if let Some(ss) = &self.slow_start {
            let mut ss = lock(ss);
            ss.set_rate(rate, now);
            self.slow_start_active
                .store(ss.is_active(), Ordering::Release);
            any = true;
        }
        any
    }

    /// Members added by a reload: new for slow start from `now` if UP, else from when they
    /// come UP (docs/slow_start.md). [`Balancer::new`] treats every member as part of the base set.
    pub fn mark_added(&self, added: &[usize], now: Nanos) {
        for p in &self.pools {
            let Some(ss) = &p.slow_start else {
                continue;
            };
            let mut ss = lock(ss);
            for &m in added {
                if let Some(l) = p.members.iter().position(|&pm| pm == m) {
                    let up = self.health(m) == Some(Health::Up);
                    ss.add_service(l, p.weights[l], up, now);
                }
            }
            p.slow_start_active.store(ss.is_active(), Ordering::Release);
        }
        if let Some(ss) = &self.slow_start {
            let mut ss = lock(ss);
            for &m in added {
                if let Some(info) = self.members.get(m) {
                    ss.add_service(m, info.weight, self.health(m) == Some(Health::Up), now);
                }
            }
            self.slow_start_active
                .store(ss.is_active(), Ordering::Release);
        }
    }

    /// Slow-start view for status pages.
    pub fn slow_start(&self) -> Option<SlowStart> {
        self.slow_start.as_ref().map(|ss| lock(ss).clone())
    }

    /// The state status pages show for `member` at `now` (one of [`STATE_NAMES`]): DRAINING
    /// while a reload's drain keeps it, else its health when that is not UP, else EJECTED
    /// while under passive ejection (ejected or half-open), else UP.
    pub fn state_name(&self, member: usize, now: Nanos) -> &'static str {
        if self.is_draining(member) {
            return "DRAINING";
        }
        match self.health(member) {
            Some(Health::Up) => {}
            Some(h) => return h.name(),
            None => return "?",
        }
        if self.ejection(member, now).is_some_and(|e| e.is_ejected()) {
            "EJECTED"
        } else {
            "UP"
        }
    }

    /// Whether an established flow (dialog, session, connection) pinned to `member` may
    /// continue there: UP, or OUT_OF_SERVICE (the operator's graceful drain), draining or
    /// not, ejected or not (ejection bars new flows only); a DOWN member's flows go
    /// elsewhere.
    pub fn accepts_existing(&self, member: usize) -> bool {
        matches!(self.health(member), Some(Health::Up | Health::OutOfService))
    }

    /// UP, not ejected at `now` (a member in half-open counts while its trial is free),
    /// below `max_clients`, and (with bounded loads) not above factor × average load.
    pub fn is_usable(&self, member: usize, now: Nanos) -> bool {
        if !self.is_usable_unbounded(member, now) {
            return false;
        }
        if let Some(factor) = self.balance_factor {
            let active = self.counters[member].load();
            return !self.is_overloaded(member, active, factor);
        }
        true
    }

    /// [`Balancer::is_usable`] without bounded loads.
    fn is_usable_unbounded(&self, member: usize, now: Nanos) -> bool {
        let Some(h) = self.health.get(member) else {
            return false;
        };
        if Health::from_u8(h.load(Ordering::Acquire)) != Health::Up {
            return false;
        }
        let info = &self.members[member];
        if info.draining {
            return false;
        }
        if let Some(e) = &self.eject
            && !e.admits(member, now)
        {
            return false;
        }
        let active = self.counters[member].load();
        !(info.max_clients > 0 && active >= u64::from(info.max_clients))
    }

    /// Consistent hashing with bounded loads: a member may take a new flow while its load
    /// (after taking it) stays within factor% of its weighted fair share of the UP members'
    /// total load (plus the new flow).
    fn is_overloaded(&self, member: usize, active: u64, factor: u32) -> bool {
        let (total, weight_sum) = (0..self.serving)
            .filter(|&i| self.health(i) == Some(Health::Up))
            .fold((0u128, 0u128), |(t, w), i| {
                (
                    t + u128::from(self.counters[i].load()),
                    w + u128::from(self.weights[i]),
                )
            });
        if weight_sum == 0 {
            return false;
        }
        let w = u128::from(self.weights[member]);
        // (active + 1) > factor/100 × (total + 1) × w / weight_sum, in integers; the +1 on
        // the right keeps an idle vserver from refusing its first flows.
        let lhs = (u128::from(active) + 1) * 100 * weight_sum;
        let rhs = u128::from(factor) * (total + 1) * w;
        lhs > rhs.max(100 * weight_sum)
    }

    /// Choose a member for a request.
    pub fn choose(&self, key: KeyInput, now: Nanos) -> Option<Choice> {
        self.choose_avoiding(key, now, &|_| false)
    }

    /// Choose a member for a request, passing over the members `avoid` names as if they
    /// were not usable: a connection whose connect to its first choice failed retries on the
    /// next member of the key's ranking (or the method's next pick) without a health change.
    pub fn choose_avoiding(
        &self,
        key: KeyInput,
        now: Nanos,
        avoid: &dyn Fn(usize) -> bool,
    ) -> Option<Choice> {
        self.choose_with(key, now, avoid, &|_| false)
    }

    /// Choose for a key whose flow may already be established on some members (`holds`):
    /// such a member takes it whenever it still accepts existing flows (UP or draining),
    /// even at its `max_clients` or above its bounded load, which the flow itself counts
    /// toward. Used where one client's flows are chosen datagram by datagram (udp `token`
    /// on the payload), so that a flow's own session does not push it off its service.
    pub fn choose_holding(
        &self,
        key: KeyInput,
        now: Nanos,
        holds: &dyn Fn(usize) -> bool,
    ) -> Option<Choice> {
        self.choose_with(key, now, &|_| false, holds)
    }

    fn choose_with(
        &self,
        key: KeyInput,
        now: Nanos,
        avoid: &dyn Fn(usize) -> bool,
        holds: &dyn Fn(usize) -> bool,
    ) -> Option<Choice> {
        let mut choice = self.choose_once(key, now, avoid, holds)?;
        // A member in half-open whose one trial another flow took between the look and the
        // take is passed over like `avoid`'s. Rare, so only then is there a list to keep;
        // each round passes over one more member, so the loop ends.
        let mut passed: Vec<usize> = Vec::new();
        while !self.takes_new_flow(choice.member, now, holds) {
            passed.push(choice.member);
            let skip = |i: usize| avoid(i) || passed.contains(&i);
            choice = self.choose_once(key, now, &skip, holds)?;
        }
        self.paths[choice.path as usize].fetch_add(1, Ordering::Relaxed);
        Some(choice)
    }

    fn choose_once(
        &self,
        key: KeyInput,
        now: Nanos,
        avoid: &dyn Fn(usize) -> bool,
        holds: &dyn Fn(usize) -> bool,
    ) -> Option<Choice> {
        if !self.has_tiers {
            return self.choose_in_tier(key, now, avoid, holds);
        }
        // Tiers: the best tier with an available member serves (the last one when none
        // has: a flow there may still be taken by a member DOWN by its monitor alone); a
        // flow a member holds already stays on it whichever tier serves.
        let serving = (0..self.serving).filter(|&i| !avoid(i));
        let tier = serving
            .clone()
            .filter(|&i| self.is_available(i, now))
            .map(|i| self.members[i].tier)
            .min()
            .or_else(|| serving.map(|i| self.members[i].tier).max())
            .unwrap_or(0);
        let in_tier = |i: usize| avoid(i) || self.members[i].tier != tier && !holds(i);
        self.choose_in_tier(key, now, &in_tier, holds)
    }

    /// Whether member `i` counts toward its tier being served: UP, not draining, not
    /// ejected. (At `max_clients` or above its bounded load it is busy, not gone: its tier
    /// stays the one served, as a backup pool is for members that are down.)
    fn is_available(&self, i: usize, now: Nanos) -> bool {
        self.health(i) == Some(Health::Up)
            && !self.members[i].draining
            && self.eject.as_ref().is_none_or(|e| e.admits(i, now))
    }

    fn choose_in_tier(
        &self,
        key: KeyInput,
        now: Nanos,
        avoid: &dyn Fn(usize) -> bool,
        holds: &dyn Fn(usize) -> bool,
    ) -> Option<Choice> {
        if self.method.is_hash() {
            self.choose_hash(key, now, avoid, holds)
        } else {
            self.choose_method(self.method, now, avoid)
                .map(|member| Choice {
                    member,
                    path: Path::Method,
                })
        }
    }

    /// Whether the chosen `member` takes the flow: always unless it is under ejection; in
    /// half-open only as its one trial (taken here); a flow it holds already always.
    fn takes_new_flow(&self, member: usize, now: Nanos, holds: &dyn Fn(usize) -> bool) -> bool {
        let Some(e) = &self.eject else {
            return true;
        };
        if !e.restricted[member].load(Ordering::Acquire) || holds(member) {
            return true;
        }
        let mut v = lock(&e.view);
        let took = v.take_for_new(member, now);
        e.mirror(&v, member);
        took
    }

    /// Count a decision made outside [`Balancer::choose`] (dialog / session affinity).
    pub fn count_affinity(&self) {
        self.paths[Path::Affinity as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn choose_hash(
        &self,
        key: KeyInput,
        now: Nanos,
        avoid: &dyn Fn(usize) -> bool,
        holds: &dyn Fn(usize) -> bool,
    ) -> Option<Choice> {
        match key {
            KeyInput::Hash(h) => {
                let selector = self.selector.load();
                let eligible = |i: usize| {
                    !avoid(i) && (self.is_usable(i, now) || holds(i) && self.accepts_existing(i))
                };
                if let Some((member, rank)) = selector.pick(h, eligible) {
                    let path = if rank == 0 {
                        Path::Hash
                    } else {
                        Path::NextRanked
                    };
                    return Some(Choice { member, path });
                }
                self.fallback(Method::LeastConnection, now, avoid)
            }
            KeyInput::NoKey => self.fallback(Method::LeastConnection, now, avoid),
            KeyInput::Unparseable => self.fallback(methods::fallback(self.method), now, avoid),
        }
    }

    fn fallback(
        &self,
        method: Method,
        now: Nanos,
        avoid: &dyn Fn(usize) -> bool,
    ) -> Option<Choice> {
        let path = if method == Method::RoundRobin {
            Path::FallbackRoundRobin
        } else {
            Path::FallbackLeastConnection
        };
        self.choose_method(method, now, avoid)
            .map(|member| Choice { member, path })
    }

    fn choose_method(
        &self,
        method: Method,
        now: Nanos,
        avoid: &dyn Fn(usize) -> bool,
    ) -> Option<usize> {
        let pick = |cap: &dyn Fn(usize) -> bool| {
            methods::pick(
                method,
                &self.method_state,
                &self.counters,
                &self.weights,
                |i| i < self.serving && self.is_usable(i, now) && !avoid(i) && cap(i),
                now,
            )
        };
        match &self.slow_start {
            // While no member is new slow start has nothing to limit or count: its counters
            // only matter as differences from the moment a member became new.
            Some(ss) if self.slow_start_active.load(Ordering::Acquire) => {
                let mut ss = lock(ss);
                let chosen = ss.route(now, pick);
                self.slow_start_active
                    .store(ss.is_active(), Ordering::Release);
                chosen
            }
            _ => pick(&|_| true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

    fn config(method: &str, extra: &str, services: usize) -> Config {
        let proto = if method.starts_with("url") {
            "http"
        } else {
            "udp"
        };
        let mut y = String::from("services:\n");
        for i in 0..services {
            y.push_str(&format!(
                "  - {{ name: s{i}, address: 127.0.0.1:{}, protocol: {proto}{} }}\n",
                7000 + i,
                if i == 0 { ", max_clients: 2" } else { "" }
            ));
        }
        let names: Vec<String> = (0..services).map(|i| format!("s{i}")).collect();
        y.push_str(&format!(
            "vservers:\n  - name: v\n    protocol: {proto}\n    bind: 127.0.0.1:9000\n    method: {method}\n{extra}    services: [{}]\n",
            names.join(", ")
        ));
        config::from_str("t", &y).expect("valid test config")
    }

    fn balancer(method: &str, extra: &str, services: usize) -> Balancer {
        let c = config(method, extra, services);
        Balancer::new(&c, &c.vservers[0])
    }

    /// s0..s3 with s2 and s3 `backup: true` (s0 has `max_clients: 2`).
    fn tiered(method: &str) -> Balancer {
        let c = config(method, "", 4);
        let mut c = c;
        c.services[2].backup = true;
        c.services[3].backup = true;
        assert_eq!(c.services[2].tier(), 1 << 16);
        Balancer::new(&c, &c.vservers[0])
    }

    #[test]
    fn the_backup_tier_serves_only_while_every_primary_is_gone() {
        for method in [
            "round_robin",
            "least_connection",
            "source_ip_hash",
            "source_ip_source_port_hash",
        ] {
            let b = tiered(method);
            let keys: Vec<KeyInput> = (0..200u64)
                .map(KeyInput::Hash)
                .chain([KeyInput::NoKey])
                .collect();
            let chosen = |b: &Balancer| -> std::collections::BTreeSet<usize> {
                keys.iter()
                    .filter_map(|k| b.choose(*k, 0))
                    .map(|c| c.member)
                    .collect()
            };
            assert_eq!(chosen(&b), [0, 1].into(), "{method}: primaries only");
            // One primary gone: the other takes everything.
            b.set_health(0, Health::Down, 0);
            assert_eq!(chosen(&b), [1].into(), "{method}");
            // Every primary gone (DOWN, out of service): the backups share the flows.
            b.set_health(1, Health::OutOfService, 0);
            assert_eq!(chosen(&b), [2, 3].into(), "{method}: backups");
            // One primary back: new flows leave the backups at once.
            b.set_health(1, Health::Up, 0);
            assert_eq!(chosen(&b), [1].into(), "{method}: back to the primary");
        }
    }

    #[test]
    fn a_busy_primary_keeps_its_tier_and_a_held_flow_stays_on_its_backup() {
        let b = tiered("source_ip_hash");
        // s0 at its max_clients and s1 DOWN: s0 is busy, not gone; nothing spills over.
        b.set_health(1, Health::Down, 0);
        let c = b.counters(0).expect("counters");
        c.open();
        c.open();
        assert_eq!(b.choose(KeyInput::Hash(7), 0), None);
        // A flow established on a backup (datagram by datagram) keeps it.
        let held = b
            .choose_holding(KeyInput::Hash(7), 0, &|i| i == 3)
            .map(|c| c.member);
        assert_eq!(held, Some(3));
    }

    #[test]
    fn failover_follows_the_ranking_and_returns() {
        let b = balancer("source_ip_hash", "", 3);
        let key = KeyInput::Hash(hash::key_hash(b"U1"));
        let order: Vec<usize> = b.selector.load().ranking(hash::key_hash(b"U1"));
        let first = b.choose(key, 0).expect("choice");
        assert_eq!(
            first,
            Choice {
                member: order[0],
                path: Path::Hash
            }
        );
        b.set_health(order[0], Health::Down, 0);
        assert_eq!(b.choose(key, 0).map(|c| c.member), Some(order[1]));
        b.set_health(order[1], Health::OutOfService, 0);
        assert_eq!(b.choose(key, 0).map(|c| c.member), Some(order[2]));
        b.set_health(order[1], Health::Up, 0);
        assert_eq!(b.choose(key, 0).map(|c| c.member), Some(order[1]));
        b.set_health(order[0], Health::Up, 0);
        assert_eq!(b.choose(key, 0).map(|c| c.member), Some(order[0]));
        assert!(b.path_count(Path::Hash) >= 2);
    }

    #[test]
    fn nothing_up_means_no_choice() {
        let b = balancer("source_ip_hash", "", 2);
        b.set_health(0, Health::Down, 0);
        b.set_health(1, Health::Down, 0);
        assert_eq!(b.choose(KeyInput::Hash(1), 0), None);
        assert_eq!(b.choose(KeyInput::NoKey, 0), None);
    }

    #[test]
    fn fallbacks_name_their_path() {
        let b = balancer("source_ip_hash", "", 3);
        assert_eq!(
            b.choose(KeyInput::NoKey, 0).map(|c| c.path),
            Some(Path::FallbackLeastConnection)
        );
        let b = balancer("url_hash", "", 3);
        assert_eq!(
            b.choose(KeyInput::Unparseable, 0).map(|c| c.path),
            Some(Path::FallbackRoundRobin)
        );
        assert_eq!(
            b.choose(KeyInput::NoKey, 0).map(|c| c.path),
            Some(Path::FallbackLeastConnection)
        );
    }

    #[test]
    fn max_clients_passes_the_key_to_the_next_ranked() {
        let b = balancer("source_ip_hash", "", 3);
        // Find a key whose first choice is s0 (max_clients 2).
        let h = (0u64..)
            .map(|i| hash::key_hash(&i.to_le_bytes()))
            .find(|&h| b.selector.load().ranking(h).first() == Some(&0))
            .expect("some key ranks s0 first");
        let c0 = b.counters(0).expect("counters");
        c0.open();
        assert_eq!(b.choose(KeyInput::Hash(h), 0).map(|c| c.member), Some(0));
        c0.open();
        let next = b.choose(KeyInput::Hash(h), 0).expect("choice");
        assert_ne!(next.member, 0);
        assert_eq!(next.path, Path::NextRanked);
        c0.close();
        assert_eq!(b.choose(KeyInput::Hash(h), 0).map(|c| c.member), Some(0));
    }

    #[test]
    fn bounded_loads_pass_over_a_hot_member() {
        let b = balancer("source_ip_hash", "    hash_balance_factor: 150\n", 3);
        let h = (0u64..)
            .map(|i| hash::key_hash(&i.to_le_bytes()))
            .find(|&h| b.selector.load().ranking(h).first() == Some(&1))
            .expect("some key ranks s1 first");
        for _ in 0..10 {
            b.counters(1).expect("counters").open();
        }
        b.counters(0).expect("counters").open();
        // s1 carries 10 of 11 flows: far above 150% of its fair third.
        let c = b.choose(KeyInput::Hash(h), 0).expect("choice");
        assert_ne!(c.member, 1);
    }

    #[test]
    fn down_to_up_starts_slow_start_and_caps_the_member() {
        let b = balancer(
            "round_robin",
            "    slow_start: { new_service_request_rate: 2, unit: per_second, increment_interval: 0s }\n",
            3,
        );
        b.set_health(2, Health::Down, 0);
        b.set_health(2, Health::Up, 0);
        assert!(b.slow_start().is_some_and(|s| s.is_new(2)));
        let mut to_new = 0;
        // 90 requests spread over one second: the new member may take at most 2.
        for i in 0..90u64 {
            let now = i * 1_000_000_000 / 90;
            if b.choose(KeyInput::NoKey, now).map(|c| c.member) == Some(2) {
                to_new += 1;
            }
        }
        assert!(to_new <= 2, "{to_new}");
        assert!(to_new >= 1, "{to_new}");
        // The operator ends slow start: full share again.
        assert!(b.set_slow_start_rate(0, 1_000_000_000));
        let mut to_new = 0;
        for i in 0..90u64 {
            if b.choose(KeyInput::NoKey, 1_000_000_000 + i)
                .map(|c| c.member)
                == Some(2)
            {
                to_new += 1;
            }
        }
        assert_eq!(to_new, 30);
    }

    const S: Nanos = 1_000_000_000;

    fn refused() -> Failure {
        Failure::new(crate::eject::Cause::Refused)
    }

    /// A key whose ranking puts member `m` first.
    fn key_ranking_first(b: &Balancer, m: usize) -> u64 {
        (0u64..)
            .map(|i| hash::key_hash(&i.to_le_bytes()))
            .find(|&h| b.selector.load().ranking(h).first() == Some(&m))
            .expect("some key ranks the member first")
    }

    #[test]
    fn an_ejected_member_passes_its_keys_to_the_next_ranked_and_gets_them_back() {
        let b = balancer("source_ip_hash", "", 3);
        let h = key_ranking_first(&b, 1);
        let next = b.selector.load().ranking(h)[1];
        for k in 0..3 {
            let r = b.report_failure_with(1, refused(), S);
            assert_eq!(
                r.is_some_and(|r| matches!(r, Report::Ejected { .. })),
                k == 2
            );
        }
        let c = b.choose(KeyInput::Hash(h), 2 * S).expect("choice");
        assert_eq!((c.member, c.path), (next, Path::NextRanked));
        // Established flows go on; the status tells why and for how long.
        assert!(b.accepts_existing(1));
        assert_eq!(b.state_name(1, 2 * S), "EJECTED");
        b.set_health(1, Health::OutOfService, 2 * S);
        assert_eq!(b.state_name(1, 2 * S), "OUT_OF_SERVICE");
        b.set_health(1, Health::Up, 2 * S);
        let st = b.ejection(1, 2 * S).expect("eject on");
        assert!(st.is_ejected());
        assert_eq!(st.remaining_ns, 9 * S);
        // After `base` (10 s): one trial; the key's next new flows wait for its outcome.
        let at = 11 * S;
        assert_eq!(b.choose(KeyInput::Hash(h), at).map(|c| c.member), Some(1));
        assert_eq!(
            b.choose(KeyInput::Hash(h), at).map(|c| c.member),
            Some(next)
        );
        b.report_success(1, at);
        assert_eq!(
            b.choose(KeyInput::Hash(h), at),
            Some(Choice {
                member: 1,
                path: Path::Hash
            })
        );
        assert!(b.ejection(1, at).is_some_and(|s| !s.is_ejected()));
        assert_eq!(b.state_name(1, at), "UP");
    }

    #[test]
    fn methods_skip_an_ejected_member_and_the_bound_holds() {
        let b = balancer("round_robin", "", 4);
        for m in [0, 1, 2] {
            for _ in 0..3 {
                b.report_failure_with(m, refused(), 0);
            }
        }
        // At most half of the four.
        let ejected: Vec<usize> = (0..4)
            .filter(|&m| b.ejection(m, 0).is_some_and(|s| s.is_ejected()))
            .collect();
        assert_eq!(ejected, [0, 1]);
        assert_eq!(b.ejections_refused(), 1);
        for _ in 0..10 {
            let c = b.choose(KeyInput::NoKey, S).expect("choice");
            assert!(c.member >= 2, "{c:?}");
        }
    }

    #[test]
    fn a_held_flow_stays_on_an_ejected_member() {
        let b = balancer("source_ip_hash", "", 3);
        let h = key_ranking_first(&b, 2);
        for _ in 0..3 {
            b.report_failure_with(2, refused(), 0);
        }
        let held = b.choose_holding(KeyInput::Hash(h), S, &|m| m == 2);
        assert_eq!(held.map(|c| c.member), Some(2));
        assert_ne!(b.choose(KeyInput::Hash(h), S).map(|c| c.member), Some(2));
    }

    #[test]
    fn the_operator_ends_an_ejection_and_a_reload_keeps_one() {
        let c = config("round_robin", "", 3);
        let b = Balancer::new(&c, &c.vservers[0]);
        for _ in 0..3 {
            b.report_failure_with(1, refused(), 0);
        }
        let rebuilt = Balancer::carrying(&c, &c.vservers[0], &b);
        assert!(rebuilt.ejection(1, S).is_some_and(|s| s.is_ejected()));
        assert!((0..6).all(|_| rebuilt.choose(KeyInput::NoKey, S).map(|c| c.member) != Some(1)));
        assert!(rebuilt.end_ejection(1));
        assert!(!rebuilt.end_ejection(1));
        assert!((0..6).any(|_| rebuilt.choose(KeyInput::NoKey, S).map(|c| c.member) == Some(1)));
        // A sip-udp rebuild counts its flows afresh but keeps the ejection too.
        let fresh = Balancer::carrying_ejections(&c, &c.vservers[0], &b);
        assert!(fresh.ejection(1, S).is_some_and(|s| s.is_ejected()));
        assert!((0..6).all(|_| fresh.choose(KeyInput::NoKey, S).map(|c| c.member) != Some(1)));
        let counters = |x: &Balancer| x.counters(0).map(std::ptr::from_ref);
        assert_ne!(counters(&fresh), counters(&b), "its own counters");
        assert_eq!(
            counters(&Balancer::carrying(&c, &c.vservers[0], &b)),
            counters(&b)
        );
    }

    #[test]
    fn eject_off_reports_nothing() {
        let b = balancer("round_robin", "    eject: off\n", 3);
        for _ in 0..10 {
            assert_eq!(b.report_failure_with(0, refused(), 0), None);
        }
        assert_eq!(b.ejection(0, 0), None);
        assert!((0..3).any(|_| b.choose(KeyInput::NoKey, 0).map(|c| c.member) == Some(0)));
    }

    #[test]
    fn a_success_with_nothing_on_record_changes_nothing() {
        let b = balancer("round_robin", "", 3);
        b.report_success(0, 0);
        let e = b.eject.as_ref().expect("on by default");
        assert_eq!(e.failures[0].load(Ordering::Relaxed), 0);
        b.report_failure_with(0, refused(), 0);
        assert_eq!(e.failures[0].load(Ordering::Relaxed), 1);
        b.report_success(0, 0);
        assert_eq!(e.failures[0].load(Ordering::Relaxed), 0);
    }

    /// A rebuild (here: a reload that adds s3) keeps s2, added earlier and still warming up,
    /// in slow start where its ramp had reached, at its new index too; it does not take its
    /// full share because another member came.
    #[test]
    fn a_rebuild_keeps_a_member_still_in_slow_start_in_it() {
        let extra = "    slow_start: { new_service_request_rate: 2, unit: per_second, increment_interval: 1s }\n";
        let c3 = config("least_connection", extra, 3);
        let old = Balancer::new(&c3, &c3.vservers[0]);
        old.mark_added(&[2], 0);
        // Two seconds of traffic: s2's rate has been raised twice (2, 4, 6 per second).
        for i in 0..200u64 {
            let _ = old.choose(KeyInput::NoKey, i * 10_000_000);
        }
        let before = old
            .slow_start()
            .and_then(|s| s.status(2))
            .expect("s2 is new");
        // The reload lists s2 first: its index moves from 2 to 0.
        let mut c4 = config("least_connection", extra, 4);
        c4.vservers[0].services = vec![2, 0, 1, 3];
        let b = Balancer::carrying(&c4, &c4.vservers[0], &old);
        assert_eq!(b.members()[0].name, "s2");
        b.mark_added(&[3], 2_000_000_000);
        let ss = b.slow_start().expect("slow start");
        let after = ss.status(0).expect("s2 is still new after the rebuild");
        assert_eq!(
            (after.rate, after.increases, after.since),
            (before.rate, before.increases, before.since)
        );
        assert!(ss.is_new(3), "the member the reload added is new");
        assert!(!ss.is_new(1) && !ss.is_new(2), "the base stays the base");
        // Without carrying, s2 would be part of the base: full share at once.
        let fresh = Balancer::new(&c4, &c4.vservers[0]);
        assert!(!fresh.slow_start().is_some_and(|s| s.is_new(0)));
    }

    /// A rule's pool ramps its members with its own slow start, and a reload keeps a member's
    /// ramp in the pool of the same rule, found by name whatever its index.
    #[test]
    fn a_pools_slow_start_ramps_its_own_members_and_a_reload_keeps_it() {
        let yaml = |pool: &str| {
            format!(
                "services:\n  - {{ name: p, address: 127.0.0.1:7000, protocol: sip-udp }}\n  - {{ name: g1, address: 127.0.0.1:7001, protocol: sip-udp }}\n  - {{ name: g2, address: 127.0.0.1:7002, protocol: sip-udp }}\nvservers:\n  - name: v\n    protocol: sip-udp\n    bind: 127.0.0.1:9000\n    services: [p]\n    routes:\n      - {{ name: gw, match: {{ method: INVITE }}, services: [{pool}], method: least_connection, slow_start: {{ new_service_request_rate: 2, increment_interval: 1s }} }}\n"
            )
        };
        let c = config::from_str("t", &yaml("g1, g2")).expect("config");
        let old = Balancer::new(&c, &c.vservers[0]);
        let g2 = old
            .members()
            .iter()
            .position(|m| m.name == "g2")
            .expect("g2");
        old.set_health(g2, Health::Down, 0);
        old.set_health(g2, Health::Up, 0);
        assert!(old.pool_slow_start(1).is_some_and(|s| s.is_new(1)));
        assert!(
            old.slow_start().is_none(),
            "the vserver's own pool has none"
        );
        // Within the first second g2 takes at most its rate (2/s), g1 the rest.
        let taken = (0..20u64)
            .filter_map(|i| old.choose_in(1, KeyInput::NoKey, i * 1_000_000, &|_| false))
            .filter(|c| c.member == g2)
            .count();
        assert!((1..=2).contains(&taken), "{taken}");
        let before = old
            .pool_slow_start(1)
            .and_then(|s| s.status(1))
            .expect("new");
        // The reload lists g2 first in the pool.
        let c2 = config::from_str("t", &yaml("g2, g1")).expect("config");
        let b = Balancer::carrying(&c2, &c2.vservers[0], &old);
        let ss = b.pool_slow_start(1).expect("slow start");
        let after = ss.status(0).expect("g2 is still new after the reload");
        assert_eq!((after.rate, after.since), (before.rate, before.since));
        assert!(!ss.is_new(1), "g1 stays the base");
    }

    #[test]
    fn slow_start_is_locked_only_while_a_member_is_new() {
        let b = balancer(
            "least_connection",
            "    slow_start: { new_service_request_rate: 2, unit: per_second, increment_interval: 0s }\n",
            3,
        );
        assert!(!b.slow_start_active.load(Ordering::Acquire));
        // A member added by reload is new at once: capped from its first second.
        b.mark_added(&[2], 0);
        assert!(b.slow_start_active.load(Ordering::Acquire));
        let to_new = (0..90u64)
            .filter(|i| {
                b.choose(KeyInput::NoKey, i * 1_000_000_000 / 90)
                    .map(|c| c.member)
                    == Some(2)
            })
            .count();
        assert_eq!(to_new, 2);
        // Ending slow start lets the per-request path skip the lock again.
        b.set_slow_start_rate(0, 1_000_000_000);
        assert!(!b.slow_start_active.load(Ordering::Acquire));
        assert!(b.slow_start().is_some_and(|s| !s.is_active()));
    }
}
