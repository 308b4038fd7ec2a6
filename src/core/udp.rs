//! PURE: the decision of a `udp` vserver: per datagram, the client's session or a new one
//! and its member (sessions, flood control, the method's key over the payload and the
//! addresses), with `now` passed in. The shell (`proxy::udp`) owns the sockets and the
//! session tables' sockets, and carries the [`Decision`] out.

use crate::balancer::{Balancer, Health, KeyInput};
use crate::config::{Config, HashParams, Method, ProxyProtocol, TokenRule, Vserver};
use crate::hash;
use crate::key::{self, KeyOutcome, Payload, RequestCtx};
use crate::session::{SessionId, SessionKey, SessionTable};
use crate::stats::Nanos;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Counters of one udp vserver (all workers).
#[derive(Debug, Default)]
pub struct UdpCounters {
    pub datagrams_in: AtomicU64,
    pub datagrams_out: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub sessions_created: AtomicU64,
    pub sessions_expired: AtomicU64,
    /// New sessions refused because the table was full (their datagrams dropped).
    pub sessions_refused: AtomicU64,
    /// New sessions refused because their source held `max_per_source` (counted in
    /// `sessions_refused` too).
    pub sessions_refused_per_source: AtomicU64,
    /// Idle sessions closed to make room when the open-file pool ran low (docs/limits.md).
    pub sessions_evicted: AtomicU64,
    /// Sessions moved because their member went DOWN.
    pub sessions_rerouted: AtomicU64,
    /// Datagrams dropped because no member could take them.
    pub no_service: AtomicU64,
    /// Upstream socket could not be created (fd limit, transparent bind refused...).
    pub socket_errors: AtomicU64,
    /// Receive errors on a service socket (ICMP port unreachable shows up here).
    pub service_errors: AtomicU64,
    pub recv_errors: AtomicU64,
    pub send_errors: AtomicU64,
}

impl UdpCounters {
    /// Each counter by its event name, in the order metrics lists them.
    pub fn events(&self) -> [(&'static str, &AtomicU64); 13] {
        [
            ("datagrams_in", &self.datagrams_in),
            ("datagrams_out", &self.datagrams_out),
            ("sessions_created", &self.sessions_created),
            ("sessions_expired", &self.sessions_expired),
            ("sessions_refused", &self.sessions_refused),
            (
                "sessions_refused_per_source",
                &self.sessions_refused_per_source,
            ),
            ("sessions_evicted", &self.sessions_evicted),
            ("sessions_rerouted", &self.sessions_rerouted),
            ("no_service", &self.no_service),
            ("socket_errors", &self.socket_errors),
            ("service_errors", &self.service_errors),
            ("recv_errors", &self.recv_errors),
            ("send_errors", &self.send_errors),
        ]
    }
}

/// What to do with a datagram from a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Relay on this live session.
    Existing(SessionId),
    /// Open a session toward `member` (after closing `replace`, a session whose member is
    /// no longer UP).
    New {
        key: SessionKey,
        member: usize,
        replace: Option<SessionId>,
    },
    /// No member can take it: drop (UDP has no way to say "unavailable").
    NoService,
    /// It would open a new session and flood control refuses its source (counted by the
    /// edge): drop, with nothing chosen for it.
    Flood,
}

/// Shared, immutable-after-build state of one udp vserver.
pub struct UdpCore {
    pub name: String,
    method: Method,
    hash_params: HashParams,
    pub(crate) balancer: Arc<Balancer>,
    member_addrs: Vec<SocketAddr>,
    /// `token` on the payload chooses per datagram: sessions are per (client, member).
    per_datagram: bool,
    pub(crate) idle_ns: Nanos,
    pub(crate) max_sessions: usize,
    /// `max_sessions` was written in the config (else it is clamped to the pool).
    max_sessions_set: bool,
    /// Sessions per source (`max_per_source`), when limited: shared by every worker and
    /// kept across reloads.
    pub(crate) sources: Option<Arc<crate::budget::SourceLimit>>,
    live: Arc<AtomicUsize>,
    /// The process's open files: each session's socket is one ([`crate::budget`]).
    budget: Arc<crate::budget::FileBudget>,
    pub(crate) transparent: bool,
    pub(crate) send_proxy: bool,
    /// Access lists (every client datagram) and flood control (new sessions).
    pub(crate) edge: crate::edge::Edge,
    pub counters: UdpCounters,
}

impl std::fmt::Debug for UdpCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpCore")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

pub(crate) fn nanos(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl UdpCore {
    pub fn new(config: &Config, v: &Vserver) -> UdpCore {
        let member_addrs = v
            .members()
            .filter_map(|i| config.services.get(i))
            .map(|s| s.address)
            .collect();
        UdpCore {
            name: v.name.clone(),
            method: v.method,
            hash_params: v.hash.clone(),
            balancer: Arc::new(Balancer::new(config, v)),
            member_addrs,
            per_datagram: v.method == Method::Token
                && matches!(v.hash.token, Some(TokenRule::Payload { .. })),
            idle_ns: nanos(v.idle_timeout),
            max_sessions: v.max_sessions,
            max_sessions_set: v.max_sessions_set,
            sources: v
                .max_per_source
                .map(|m| Arc::new(crate::budget::SourceLimit::new(m))),
            live: Arc::new(AtomicUsize::new(0)),
            budget: Arc::new(crate::budget::FileBudget::unlimited()),
            transparent: v.transparent,
            send_proxy: v.send_proxy == Some(ProxyProtocol::V2),
            edge: v.edge(None),
            counters: UdpCounters::default(),
        }
    }

    /// The core of a reload of the vserver `old` served: members it keeps share their
    /// counters with `old` (sessions established before the reload stay counted on their
    /// service), and the session bound carries over.
    pub fn rebuilt(config: &Config, v: &Vserver, old: &UdpCore) -> UdpCore {
        let mut core = UdpCore::new(config, v);
        core.balancer = Arc::new(Balancer::carrying(config, v, &old.balancer));
        core.live = Arc::clone(&old.live);
        core.edge = v.edge(Some(&old.edge));
        // Sessions established before the reload stay counted on their source.
        if let (Some(old), Some(max)) = (&old.sources, v.max_per_source) {
            old.set_max(max);
            core.sources = Some(Arc::clone(old));
        }
        core.with_budget(Arc::clone(&old.budget))
    }

    pub fn edge(&self) -> &crate::edge::Edge {
        &self.edge
    }

    /// Where a session toward member `m` of `old` goes in this core: the member with the
    /// same service name and address, if this core has one (a session's socket is
    /// connected to the address). `None` when the keying changed (per-datagram or not).
    pub(crate) fn carried_member(&self, old: &UdpCore, m: usize) -> Option<u32> {
        if self.per_datagram != old.per_datagram {
            return None;
        }
        let name = &old.balancer.members().get(m)?.name;
        let addr = old.member_addr(m)?;
        let n = self
            .balancer
            .members()
            .iter()
            .position(|x| &x.name == name)?;
        (self.member_addr(n)? == addr)
            .then(|| u32::try_from(n).ok())
            .flatten()
    }

    pub fn balancer(&self) -> &Arc<Balancer> {
        &self.balancer
    }

    /// Live sessions of the vserver (all workers).
    pub fn sessions(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// The core drawing its sessions' files from `budget`. An unset `max_sessions` above
    /// the pool is clamped to the pool (said once, at info): past it sessions are refused
    /// for want of files anyway, and the bound is what `/status` shows.
    pub fn with_budget(mut self, budget: Arc<crate::budget::FileBudget>) -> UdpCore {
        let pool = usize::try_from(budget.pool()).unwrap_or(usize::MAX);
        if !self.max_sessions_set && self.max_sessions > pool {
            tracing::info!(vserver = %self.name, max_sessions = pool, default = self.max_sessions, "max_sessions unset: clamped to the open-file pool, one file per session (docs/limits.md)");
            self.max_sessions = pool;
        }
        self.budget = budget;
        self
    }

    /// A new, empty session table for one worker.
    pub fn table<R>(&self) -> SessionTable<R> {
        SessionTable::new(self.idle_ns, self.max_sessions, Arc::clone(&self.live))
            .with_budget(Arc::clone(&self.budget))
    }

    pub fn member_addr(&self, member: usize) -> Option<SocketAddr> {
        self.member_addrs.get(member).copied()
    }

    /// The member for a datagram; `holds(m)`: this flow already has a session on `m` (see
    /// [`Balancer::choose_holding`]).
    fn choose(
        &self,
        payload: &[u8],
        client: SocketAddr,
        local: SocketAddr,
        now: Nanos,
        holds: &dyn Fn(usize) -> bool,
    ) -> Option<usize> {
        let ctx = RequestCtx {
            src: client,
            dst: local,
            payload: Payload::Raw(payload),
        };
        let key = match key::extract(self.method, &self.hash_params, &ctx) {
            KeyOutcome::Key(k) => KeyInput::Hash(hash::key_hash(k.as_bytes())),
            KeyOutcome::NoKey => KeyInput::NoKey,
            KeyOutcome::Unparseable => KeyInput::Unparseable,
        };
        self.balancer
            .choose_holding(key, now, holds)
            .map(|c| c.member)
    }

    /// Decide where a datagram from `client` to `local` goes. A session keeps its member
    /// while that member is not DOWN (OUT_OF_SERVICE drains: existing flows continue). A new
    /// session is a new flow: flood control is asked before the balancer chooses, so a
    /// refused one neither counts as a decision nor moves a round-robin or least-requests
    /// state. One replacing a session whose member went DOWN is the same flow, not asked.
    pub fn decide<R>(
        &self,
        table: &SessionTable<R>,
        payload: &[u8],
        client: SocketAddr,
        local: SocketAddr,
        now: Nanos,
    ) -> Decision {
        // Flood control asked already for this datagram (at most once: it counts).
        let mut admitted = false;
        let (key, chosen) = if self.per_datagram {
            // Each datagram is chosen for; the member already holding this client's session
            // for the key keeps it (its own session must not count against it).
            let holds = |m: usize| {
                let key = SessionKey {
                    client,
                    local,
                    member: u32::try_from(m).ok(),
                };
                table.find(&key, now).is_some()
            };
            // A flow holding no session on any member opens one whatever is chosen. One
            // holding some is asked below, after the choice, if that lands on a new member.
            if self.edge.has_flood() && !(0..self.member_addrs.len()).any(&holds) {
                if !self.edge.admits_new(client.ip(), now) {
                    return Decision::Flood;
                }
                admitted = true;
            }
            match self.choose(payload, client, local, now, &holds) {
                Some(m) => (
                    SessionKey {
                        client,
                        local,
                        member: Some(m as u32),
                    },
                    Some(m),
                ),
                None => return Decision::NoService,
            }
        } else {
            (
                SessionKey {
                    client,
                    local,
                    member: None,
                },
                None,
            )
        };
        let mut replace = None;
        if let Some(id) = table.find(&key, now) {
            let member = table.get(id).map_or(0, |s| s.member as usize);
            if self.balancer.health(member) != Some(Health::Down) {
                // Per datagram, the choice above was counted already.
                if chosen.is_none() {
                    self.balancer.count_affinity();
                }
                return Decision::Existing(id);
            }
            replace = Some(id);
        }
        if replace.is_none() && !admitted && !self.edge.admits_new(client.ip(), now) {
            return Decision::Flood;
        }
        let member = match chosen {
            Some(m) => Some(m),
            None => self.choose(payload, client, local, now, &|_| false),
        };
        match member {
            Some(member) => Decision::New {
                key,
                member,
                replace,
            },
            None => Decision::NoService,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::Admit;

    fn core(method: &str, extra: &str) -> UdpCore {
        let yaml = format!(
            "admin: {{ listen: null }}\nservices:\n\
  - {{ name: a, address: \"127.0.0.1:7001\", protocol: udp }}\n\
  - {{ name: b, address: \"127.0.0.1:7002\", protocol: udp }}\n\
vservers:\n  - {{ name: v, protocol: udp, bind: [\"127.0.0.1:0\"], method: {method}, services: [a, b]{extra} }}\n"
        );
        let cfg = crate::config::from_str("t.yaml", &yaml).expect("config");
        UdpCore::new(&cfg, &cfg.vservers[0])
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    /// An unset `max_sessions` above the pool is the pool; a set one stays as written (the
    /// start warns about it instead), and one under the pool is left alone.
    #[test]
    fn an_unset_max_sessions_is_clamped_to_the_pool() {
        let needs = crate::budget::Needs::default();
        let pool = |limit: u64| Arc::new(crate::budget::FileBudget::new(limit, &needs));
        let small = pool(1_000);
        let n = small.pool() as usize;
        assert_eq!(
            core("round_robin", "")
                .with_budget(Arc::clone(&small))
                .max_sessions,
            n
        );
        let set = core("round_robin", ", max_sessions: 5000").with_budget(Arc::clone(&small));
        assert_eq!(set.max_sessions, 5_000);
        let under = core("round_robin", ", max_sessions: 10").with_budget(small);
        assert_eq!(under.max_sessions, 10);
        let large = core("round_robin", "").with_budget(pool(10_000_000));
        assert_eq!(large.max_sessions, 100_000);
    }

    #[test]
    fn sessions_stick_until_their_member_is_down() {
        let c = core("round_robin", "");
        let mut t: SessionTable<()> = c.table();
        let (cl, lo) = (addr("10.0.0.1:5000"), addr("127.0.0.1:53"));
        let Decision::New {
            key,
            member,
            replace: None,
        } = c.decide(&t, b"x", cl, lo, 0)
        else {
            panic!("first datagram opens a session");
        };
        assert_eq!(t.admit(), Admit::Reserved);
        let (id, _) = t.insert(key, member as u32, 0, (), 0);
        assert_eq!(c.decide(&t, b"x", cl, lo, 10), Decision::Existing(id));
        // Another local address is another session (replies must leave from it).
        assert!(matches!(
            c.decide(&t, b"x", cl, addr("127.0.0.2:53"), 10),
            Decision::New { .. }
        ));
        c.balancer().set_health(member, Health::OutOfService, 20);
        assert_eq!(
            c.decide(&t, b"x", cl, lo, 30),
            Decision::Existing(id),
            "drain keeps flows"
        );
        c.balancer().set_health(member, Health::Down, 40);
        match c.decide(&t, b"x", cl, lo, 50) {
            Decision::New {
                member: m, replace, ..
            } => {
                assert_ne!(m, member);
                assert_eq!(replace, Some(id));
            }
            d => panic!("{d:?}"),
        }
        c.balancer().set_health(1 - member, Health::Down, 60);
        assert_eq!(
            c.decide(&t, b"x", addr("10.0.0.9:1"), lo, 70),
            Decision::NoService
        );
    }

    /// A banned source's new session is refused before the balancer chooses: the refused
    /// datagrams count no decision and leave round robin where it was, so the next client
    /// gets the member after the last one given out.
    #[test]
    fn flood_refuses_a_new_session_before_anything_is_chosen() {
        use crate::balancer::Path;
        let c = core("round_robin", ", flood: { limit: 1, window: 1s, ban: 60s }");
        let t: SessionTable<()> = c.table();
        let lo = addr("127.0.0.1:53");
        let new_member = |d: Decision| match d {
            Decision::New { member, .. } => member,
            d => panic!("{d:?}"),
        };
        let first = new_member(c.decide(&t, b"x", addr("10.0.0.1:5000"), lo, 0));
        // 10.0.0.9 opens one session (its limit), then is banned: three more refused.
        new_member(c.decide(&t, b"x", addr("10.0.0.9:1"), lo, 0));
        let chosen = c.balancer().path_count(Path::Method);
        for port in 2..5 {
            assert_eq!(
                c.decide(&t, b"x", addr(&format!("10.0.0.9:{port}")), lo, 0),
                Decision::Flood
            );
        }
        assert_eq!(
            c.balancer().path_count(Path::Method),
            chosen,
            "nothing chosen"
        );
        assert_eq!(c.edge().counters().flood.load(Ordering::Relaxed), 3);
        // Round robin over two: 10.0.0.1 got `first`, 10.0.0.9 the other, so `first` again.
        assert_eq!(
            new_member(c.decide(&t, b"x", addr("10.0.0.2:5000"), lo, 0)),
            first
        );
    }

    /// Per datagram (`token` on the payload), a flow with no session anywhere is asked
    /// before the choice too.
    #[test]
    fn flood_refuses_a_per_datagram_flow_before_anything_is_chosen() {
        use crate::balancer::Path;
        let c = core(
            "token",
            ", token: { offset: 0, length: 2 }, flood: { limit: 1, window: 1s, ban: 60s }",
        );
        let t: SessionTable<()> = c.table();
        let lo = addr("127.0.0.1:53");
        assert!(matches!(
            c.decide(&t, b"k1z", addr("10.0.0.9:1"), lo, 0),
            Decision::New { .. }
        ));
        let decisions = || {
            [Path::Hash, Path::NextRanked, Path::FallbackLeastConnection]
                .into_iter()
                .map(|p| c.balancer().path_count(p))
                .sum::<u64>()
        };
        let chosen = decisions();
        assert_eq!(
            c.decide(&t, b"k2z", addr("10.0.0.9:2"), lo, 0),
            Decision::Flood
        );
        assert_eq!(decisions(), chosen, "nothing chosen");
    }

    #[test]
    fn payload_token_sessions_are_per_member() {
        let c = core("token", ", token: { offset: 0, length: 2 }");
        let t: SessionTable<()> = c.table();
        let (cl, lo) = (addr("10.0.0.1:5000"), addr("127.0.0.1:53"));
        let members: std::collections::HashSet<Option<u32>> = (0..20u8)
            .filter_map(|i| match c.decide(&t, &[b'k', i, b'z'], cl, lo, 0) {
                Decision::New { key, .. } => Some(key.member),
                _ => None,
            })
            .collect();
        assert_eq!(
            members.len(),
            2,
            "one client, two member-keyed sessions: {members:?}"
        );
    }
}
