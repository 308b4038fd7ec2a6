//! Pools published in DNS (docs/discovery.md). PURE: the answers a lookup gave, the time
//! and the file's config in; the member sets, when to ask again and the config the running
//! proxy uses out. The lookups themselves are in [`resolve`].
//!
//! A service with `dns: NAME` stands for the addresses the name has. Each is a member of
//! the vservers that list the service, named `SERVICE@ADDRESS:PORT`, hashed by its address
//! and port (so instances that see the same records choose alike), with the service's
//! protocol, monitor, `tls` and limits. [`expand`] turns the file's config into the
//! running one; a change of the sets is applied as a reload is: a member that left the
//! answer drains ([`crate::drain`]), one that appeared enters slow start.
//!
//! What a lookup may say, and what it does to the set ([`Pool::record`]):
//! - records: the set is what they say; asked again at their TTL, clamped to
//!   `min_refresh..=max_refresh`;
//! - NXDOMAIN or NODATA (the name, or the record type, does not exist): the set empties;
//! - anything else (timeout, SERVFAIL, REFUSED, no server): the set stays the last good one,
//!   and `/status`, the metrics and `/readyz` say the name is not being refreshed. A DNS
//!   outage never empties a pool.
//!
//! A lookup is made of parts, each remembered on its own ([`Outcome::Parts`]): the A and the
//! AAAA records of a name, and for SRV those of each target. A part that fails keeps its last
//! good addresses while the others are what they say, so a resolver that drops AAAA queries,
//! or one SRV target whose name does not resolve, costs nothing of the rest. And a member
//! leaves only after two answers in a row without it (hysteresis): DNS servers that answer
//! rotating subsets of a large set do not churn the pool every TTL; an emptied name empties
//! the pool at the second look.

pub mod resolve;

use crate::config::{Config, DnsKind, DnsName, DnsSettings, Service};
use crate::stats::Nanos;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

/// One address a name gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Target {
    pub addr: SocketAddr,
    /// SRV priority (0 for an A / AAAA name).
    pub priority: u16,
    /// SRV weight (0 for an A / AAAA name).
    pub weight: u16,
    /// How many addresses its SRV target has (1 for an A / AAAA name): the target's weight
    /// is split among them (RFC 2782 weighs targets, not addresses; a dual-stack target
    /// would otherwise get twice its share).
    pub share: u16,
}

/// One part of a lookup: the addresses of one family of one name.
pub type PartKey = (String, Family);

/// An address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

/// What one part of a lookup said: its targets (empty: NODATA / NXDOMAIN) and their TTL, or
/// why it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub key: PartKey,
    /// The SRV record that named it ((priority, weight, port)); for a host name (0, 0,
    /// its port).
    pub srv: (u16, u16, u16),
    pub answer: Result<(Vec<std::net::IpAddr>, u32), String>,
}

/// What one lookup of a name said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Records: the targets (any order, duplicates allowed) and the smallest TTL among the
    /// records that gave them, in seconds.
    Found { targets: Vec<Target>, ttl: u32 },
    /// The name or its records do not exist (NXDOMAIN, NODATA).
    Empty,
    /// No answer to go by (timeout, SERVFAIL, REFUSED, no server): why.
    Failed(String),
    /// Part by part ([`Part`]): those that failed keep their last good addresses.
    Parts(Vec<Part>),
}

/// How many answers in a row must lack a member before it leaves.
pub const MISSES_TO_LEAVE: u8 = 2;

/// Lookups by result, for the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lookups {
    pub found: u64,
    pub empty: u64,
    pub failed: u64,
}

/// One pool: the name it follows and what is known of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    pub dns: DnsName,
    /// The members in force (sorted, one per address and port), the last good answer's.
    pub members: Vec<Target>,
    /// A lookup has answered (records or an authoritative empty answer) at least once.
    pub answered: bool,
    /// When the last good answer came.
    pub last_answer: Option<Nanos>,
    /// Since when lookups fail (the set is the last good one meanwhile), and the last error.
    pub failing_since: Option<Nanos>,
    pub last_error: Option<String>,
    /// When to ask again.
    pub next: Nanos,
    pub lookups: Lookups,
    /// The last good addresses of each part of the answer.
    pub parts: BTreeMap<PartKey, Vec<std::net::IpAddr>>,
    /// Members in force that the last answers lacked, and how many in a row.
    pub missing: BTreeMap<SocketAddr, u8>,
    /// Parts of the last answer that failed (their last good addresses kept): why.
    pub partial: Option<String>,
}

fn nanos(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Refreshes after records come up to this share (in thousandths) earlier than the TTL says,
/// so that pools whose records share a TTL, and instances that started together, do not ask
/// their servers in the same instant every time.
pub const JITTER_PER_MILLE: u64 = 100;

/// `wait` shortened by a jitter of up to [`JITTER_PER_MILLE`], fixed by `name` and `round`
/// (xxh3: the same inputs give the same wait, and every round of every name another one).
/// Never below `floor`.
pub fn jittered(wait: Nanos, name: &str, round: u64, floor: Nanos) -> Nanos {
    let draw = xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), round) % 1000;
    let cut = u128::from(wait) * u128::from(JITTER_PER_MILLE) * u128::from(draw) / 1_000_000;
    wait.saturating_sub(u64::try_from(cut).unwrap_or(0))
        .max(floor.min(wait))
}

impl Pool {
    /// A pool not asked yet: due at `now`.
    pub fn new(dns: DnsName, now: Nanos) -> Pool {
        Pool {
            dns,
            members: Vec::new(),
            answered: false,
            last_answer: None,
            failing_since: None,
            last_error: None,
            next: now,
            lookups: Lookups::default(),
            parts: BTreeMap::new(),
            missing: BTreeMap::new(),
            partial: None,
        }
    }

    /// Outcome `Parts` as the whole answer it stands for, with each failed part's last good
    /// addresses (`None`: every part failed, nothing to go by). Remembers the good parts.
    fn merge_parts(&mut self, parts: Vec<Part>) -> Option<(Vec<Target>, u32, Option<String>)> {
        if parts.iter().all(|p| p.answer.is_err()) {
            return None;
        }
        let mut errors = Vec::new();
        let mut ttl = u32::MAX;
        let mut next = BTreeMap::new();
        let mut by_part: Vec<(Part, Vec<std::net::IpAddr>)> = Vec::new();
        for p in parts {
            let ips = match &p.answer {
                Ok((ips, t)) => {
                    if !ips.is_empty() {
                        ttl = ttl.min(*t);
                    }
                    ips.clone()
                }
                Err(why) => {
                    errors.push(format!("{} {:?}: {why}", p.key.0, p.key.1));
                    self.parts.get(&p.key).cloned().unwrap_or_default()
                }
            };
            next.insert(p.key.clone(), ips.clone());
            by_part.push((p, ips));
        }
        self.parts = next;
        // A target's weight is split among its addresses, both families together.
        let mut per_name: BTreeMap<&str, usize> = BTreeMap::new();
        for (p, ips) in &by_part {
            *per_name.entry(p.key.0.as_str()).or_default() += ips.len();
        }
        let mut targets = Vec::new();
        for (p, ips) in &by_part {
            let share = per_name.get(p.key.0.as_str()).copied().unwrap_or(1);
            let (priority, weight, port) = p.srv;
            for ip in ips {
                targets.push(Target {
                    addr: SocketAddr::new(*ip, port),
                    priority,
                    weight,
                    share: u16::try_from(share.max(1)).unwrap_or(u16::MAX),
                });
            }
        }
        let ttl = if ttl == u32::MAX { 0 } else { ttl };
        Some((
            targets,
            ttl,
            (!errors.is_empty()).then(|| errors.join("; ")),
        ))
    }

    /// The members after an answer that names `found`: those, and those in force it lacked
    /// fewer than [`MISSES_TO_LEAVE`] times in a row.
    fn with_hysteresis(&mut self, mut found: Vec<Target>) -> Vec<Target> {
        found.sort();
        found.dedup_by_key(|t| t.addr);
        let mut missing = BTreeMap::new();
        for m in &self.members {
            if found.iter().any(|t| t.addr == m.addr) {
                continue;
            }
            let misses = self.missing.get(&m.addr).copied().unwrap_or(0) + 1;
            if misses < MISSES_TO_LEAVE {
                missing.insert(m.addr, misses);
                found.push(*m);
            }
        }
        self.missing = missing;
        found.sort();
        found
    }

    /// Take a lookup's outcome at `now`; whether the member set changed. After records the
    /// next lookup is at their TTL (within `min_refresh..=max_refresh`, up to a tenth
    /// earlier: [`jittered`]); after an empty
    /// answer at `min_refresh` (the name may come back soon); after a failure at
    /// `min_refresh`, then at twice the time failures have gone on, up to `max_refresh`.
    pub fn record(&mut self, outcome: Outcome, now: Nanos, s: &DnsSettings) -> bool {
        let (lo, hi) = (nanos(s.min_refresh), nanos(s.max_refresh).max(1));
        // `None`: the set stays as it is.
        let outcome = match outcome {
            Outcome::Parts(parts) => match self.merge_parts(parts) {
                None => Outcome::Failed("every part of the lookup failed".to_owned()),
                Some((targets, _, partial)) if targets.is_empty() && partial.is_none() => {
                    Outcome::Empty
                }
                Some((targets, ttl, partial)) => {
                    self.lookups.found += 1;
                    let wait = nanos(Duration::from_secs(u64::from(ttl))).clamp(lo, hi);
                    let wait = jittered(wait, &self.dns.name, self.lookups.found, lo);
                    self.next = now.saturating_add(wait);
                    self.answered(now);
                    self.partial = partial;
                    let members = self.with_hysteresis(targets);
                    return self.set_members(members);
                }
            },
            other => other,
        };
        let members = match outcome {
            Outcome::Found { targets, ttl } => {
                self.lookups.found += 1;
                let wait = nanos(Duration::from_secs(u64::from(ttl))).clamp(lo, hi);
                let wait = jittered(wait, &self.dns.name, self.lookups.found, lo);
                self.next = now.saturating_add(wait);
                self.answered(now);
                self.partial = None;
                Some(self.with_hysteresis(targets))
            }
            Outcome::Empty => {
                self.lookups.empty += 1;
                self.next = now.saturating_add(lo);
                self.answered(now);
                self.partial = None;
                self.parts.clear();
                Some(self.with_hysteresis(Vec::new()))
            }
            Outcome::Parts(_) => None,
            Outcome::Failed(why) => {
                self.lookups.failed += 1;
                let since = *self.failing_since.get_or_insert(now);
                // min_refresh, then twice the time failures have gone on, up to max_refresh.
                let wait = now.saturating_sub(since).saturating_mul(2).clamp(lo, hi);
                self.next = now.saturating_add(wait);
                self.last_error = Some(why);
                None
            }
        };
        match members {
            Some(m) => self.set_members(m),
            None => false,
        }
    }

    fn set_members(&mut self, m: Vec<Target>) -> bool {
        if m == self.members {
            return false;
        }
        self.members = m;
        true
    }

    fn answered(&mut self, now: Nanos) {
        self.answered = true;
        self.last_answer = Some(now);
        self.failing_since = None;
        self.last_error = None;
    }

    /// The pool is served from an answer that could not be refreshed.
    pub fn is_stale(&self) -> bool {
        self.failing_since.is_some()
    }
}

/// Every pool of the running config, by service name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pools {
    pub by_service: BTreeMap<String, Pool>,
}

impl Pools {
    /// Follow the `dns` services of `config`: new ones (or ones whose name changed) start
    /// unasked, due at `now`; those `config` no longer has are forgotten.
    pub fn sync(&mut self, config: &Config, now: Nanos) {
        let mut next = BTreeMap::new();
        for s in &config.services {
            let Some(dns) = &s.dns else { continue };
            let pool = match self.by_service.remove(&s.name) {
                Some(p) if p.dns == *dns => p,
                _ => Pool::new(dns.clone(), now),
            };
            next.insert(s.name.clone(), pool);
        }
        self.by_service = next;
    }

    /// The member sets, by service name: what [`expand`] takes.
    pub fn members(&self) -> BTreeMap<String, Vec<Target>> {
        self.by_service
            .iter()
            .map(|(n, p)| (n.clone(), p.members.clone()))
            .collect()
    }

    /// The earliest time a pool is due, if any.
    pub fn next_due(&self) -> Option<Nanos> {
        self.by_service.values().map(|p| p.next).min()
    }

    /// The pools due at `now`: (service, name).
    pub fn due(&self, now: Nanos) -> Vec<(String, DnsName)> {
        self.by_service
            .iter()
            .filter(|(_, p)| p.next <= now)
            .map(|(n, p)| (n.clone(), p.dns.clone()))
            .collect()
    }

    /// Lines for `/readyz` that do not withdraw the instance: pools served from an answer
    /// that can no longer be refreshed, and pools never answered.
    pub fn notes(&self, now: Nanos) -> Vec<String> {
        self.by_service
            .iter()
            .filter_map(|(service, p)| {
                let why = p.last_error.as_deref().unwrap_or("no answer");
                let name = p.dns.name.trim_end_matches('.');
                if !p.answered {
                    Some(format!("service {service}: no DNS answer yet for {name} ({why})"))
                } else if let (None, Some(partial)) = (p.failing_since, &p.partial) {
                    Some(format!(
                        "service {service}: part of the DNS answer for {name} failed ({partial}); keeping those parts' last addresses"
                    ))
                } else if let Some(since) = p.failing_since {
                    let secs = now.saturating_sub(since) / 1_000_000_000;
                    Some(format!(
                        "service {service}: DNS lookups of {name} failing for {secs}s ({why}); keeping the {} member(s) of the last answer",
                        p.members.len()
                    ))
                } else {
                    None
                }
            })
            .collect()
    }
}

/// The name of the member at `addr` of the pool `service`.
pub fn member_name(service: &str, addr: SocketAddr) -> String {
    format!("{service}@{addr}")
}

/// Member weights from SRV weights (RFC 2782: relative within a priority): as given when
/// every weight of the answer is at most 100, else scaled so the largest is 100; weight 0
/// (no preference, or a target meant to be used rarely) becomes 1, the smallest a member
/// has. An A / AAAA member has the service's own weight.
fn member_weight(s: &Service, t: &Target, max_weight: u16) -> u32 {
    match s.dns.as_ref().map(|d| d.kind) {
        Some(DnsKind::Srv) if max_weight > 100 => {
            (u32::from(t.weight) * 100 / u32::from(max_weight) / u32::from(t.share.max(1))).max(1)
        }
        Some(DnsKind::Srv) => (u32::from(t.weight) / u32::from(t.share.max(1))).max(1),
        _ => s.weight,
    }
}

/// The config the running proxy uses for `file` and the member sets `members` (by service
/// name): every `dns` service of `file` replaced by one service per member, in address
/// order; the vservers that list it list its members instead, in its place. A pool with no
/// members (not answered yet, or empty) leaves no service.
pub fn expand(file: &Config, members: &BTreeMap<String, Vec<Target>>) -> Config {
    if file.services.iter().all(|s| s.dns.is_none()) {
        return file.clone();
    }
    let mut c = file.clone();
    c.services.clear();
    // Old index -> new indices.
    let mut map: Vec<Vec<usize>> = Vec::with_capacity(file.services.len());
    for s in &file.services {
        let Some(dns) = &s.dns else {
            map.push(vec![c.services.len()]);
            c.services.push(s.clone());
            continue;
        };
        let found = members.get(&s.name).map_or(&[][..], Vec::as_slice);
        let max_weight = found.iter().map(|t| t.weight).max().unwrap_or(0);
        let mut idx = Vec::with_capacity(found.len());
        for t in found {
            idx.push(c.services.len());
            c.services.push(Service {
                name: member_name(&s.name, t.addr),
                address: t.addr,
                weight: member_weight(s, t, max_weight),
                hash_id: None,
                dns: None,
                priority: matches!(dns.kind, DnsKind::Srv).then_some(t.priority),
                ..s.clone()
            });
        }
        map.push(idx);
    }
    for v in &mut c.vservers {
        let remap = |list: &[usize]| -> Vec<usize> {
            list.iter()
                .flat_map(|&i| map.get(i).cloned().unwrap_or_default())
                .collect()
        };
        v.services = remap(&v.services);
        v.draining = remap(&v.draining);
        for p in &mut v.route_pools {
            p.services = remap(&p.services);
        }
    }
    c
}

#[cfg(test)]
mod tests;
