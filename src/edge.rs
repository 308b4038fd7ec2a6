//! Edge protection of one vserver: its access lists and its flood table, with the drop
//! counters the metrics and the status page read. PURE (the data paths pass the source and
//! `now`; nothing here touches a socket or the clock).
//!
//! Two checks, made where each data path can make them cheapest:
//! - [`Edge::admits`] before anything is parsed: a datagram from a source the lists refuse is
//!   dropped, a connection from one closed at once (`reason="acl"`). Traffic from the
//!   vserver's own services is never checked (the data paths know their members).
//! - [`Edge::admits_new`] for what would open a new flow only (a SIP request outside a
//!   dialog, a new udp session, a new tcp / http connection): a source over its limit is
//!   banned and its new flows dropped (`reason="flood"`); its established dialogs and
//!   sessions go on.
//!
//! Both are free when the vserver configures nothing (`allow` / `deny` / `flood` absent):
//! one branch on a flag known at build time.

use crate::acl::Acl;
use crate::flood::{Ban, FloodParams, FloodTable, Verdict};
use crate::stats::Nanos;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Slots of a vserver's flood table (see [`crate::flood`]: under 1 MiB).
pub(crate) const FLOOD_SLOTS: usize = 16_384;

/// Drops and bans of one vserver, kept across reloads that keep its edge settings.
#[derive(Debug, Default)]
pub struct EdgeCounters {
    /// Datagrams dropped and connections closed by the access lists.
    pub acl: AtomicU64,
    /// New flows dropped because their source is banned.
    pub flood: AtomicU64,
    /// Bans started.
    pub bans: AtomicU64,
    /// New flows let through untracked (their bucket full of running bans).
    pub untracked: AtomicU64,
}

/// The edge settings and state of one vserver.
#[derive(Debug)]
pub struct Edge {
    acl: Acl,
    flood: Option<Arc<FloodTable>>,
    counters: Arc<EdgeCounters>,
}

impl Default for Edge {
    fn default() -> Edge {
        Edge::new(Acl::default(), None, None)
    }
}

impl Edge {
    /// `previous`: the edge of the vserver this one replaces (a reload); its counters carry
    /// over, and so do its flood table and bans when the flood parameters are unchanged.
    pub fn new(acl: Acl, flood: Option<FloodParams>, previous: Option<&Edge>) -> Edge {
        let table = flood.map(|p| match previous.and_then(|e| e.flood.as_ref()) {
            Some(t) if t.params() == p => Arc::clone(t),
            _ => Arc::new(FloodTable::new(p, FLOOD_SLOTS)),
        });
        Edge {
            acl,
            flood: table,
            counters: previous.map_or_else(Default::default, |e| Arc::clone(&e.counters)),
        }
    }

    pub fn counters(&self) -> &EdgeCounters {
        &self.counters
    }

    /// Whether a datagram or connection from `src` may reach the vserver (the access
    /// lists); a refusal is counted.
    pub fn admits(&self, src: IpAddr) -> bool {
        if self.acl.permits(src) {
            return true;
        }
        self.counters.acl.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Whether `src` may open one more flow at `now` (flood control); a refusal is counted.
    pub fn admits_new(&self, src: IpAddr, now: Nanos) -> bool {
        let Some(t) = &self.flood else {
            return true;
        };
        match t.check(src, now) {
            Verdict::Pass => true,
            Verdict::Untracked => {
                self.counters.untracked.fetch_add(1, Ordering::Relaxed);
                true
            }
            Verdict::Banned => {
                self.counters.bans.fetch_add(1, Ordering::Relaxed);
                self.counters.flood.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(source = %src, "flood: source banned");
                false
            }
            Verdict::Refused => {
                self.counters.flood.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Whether access lists are configured (without them [`Edge::admits`] lets everyone in,
    /// and callers skip the work of exempting their services).
    pub fn has_acl(&self) -> bool {
        !self.acl.is_open()
    }

    /// Whether flood control is on (callers skip finding out whether a request is new).
    pub fn has_flood(&self) -> bool {
        self.flood.is_some()
    }

    /// Sources banned at `now`.
    pub fn bans(&self, now: Nanos) -> Vec<Ban> {
        self.flood.as_ref().map_or_else(Vec::new, |t| t.bans(now))
    }

    /// Lift `ip`'s ban; `false` when it was not banned here.
    pub fn unban(&self, ip: IpAddr, now: Nanos) -> bool {
        self.flood.as_ref().is_some_and(|t| t.unban(ip, now))
    }

    /// Bytes the flood table holds (its fixed bound), 0 without flood control.
    pub fn flood_memory_bytes(&self) -> usize {
        self.flood.as_ref().map_or(0, |t| t.memory_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acl::Cidr;

    const S: Nanos = 1_000_000_000;

    fn params(limit: u32) -> FloodParams {
        FloodParams {
            limit,
            window_ns: S,
            ban_ns: 60 * S,
            ipv6_prefix: crate::flood::DEFAULT_IPV6_PREFIX,
        }
    }

    #[test]
    fn counts_acl_drops_and_flood_bans() {
        let deny = vec![Cidr::parse("192.0.2.0/24").expect("cidr")];
        let e = Edge::new(Acl::new(None, deny), Some(params(2)), None);
        let bad: IpAddr = "192.0.2.9".parse().expect("ip");
        let src: IpAddr = "198.51.100.1".parse().expect("ip");
        assert!(!e.admits(bad));
        assert!(e.admits(src));
        assert!(e.admits_new(src, 0) && e.admits_new(src, 0));
        assert!(!e.admits_new(src, 0));
        assert!(!e.admits_new(src, S));
        let c = e.counters();
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!((n(&c.acl), n(&c.flood), n(&c.bans)), (1, 2, 1));
        assert_eq!(e.bans(S).len(), 1);
        assert!(e.unban(src, S));
        assert!(e.admits_new(src, S));
    }

    #[test]
    fn a_reload_keeps_bans_and_counters_while_the_flood_settings_hold() {
        let src: IpAddr = "198.51.100.1".parse().expect("ip");
        let e = Edge::new(Acl::default(), Some(params(1)), None);
        assert!(e.admits_new(src, 0));
        assert!(!e.admits_new(src, 0));
        let same = Edge::new(Acl::default(), Some(params(1)), Some(&e));
        assert!(!same.admits_new(src, S), "still banned");
        assert_eq!(same.counters().flood.load(Ordering::Relaxed), 2);
        let changed = Edge::new(Acl::default(), Some(params(5)), Some(&same));
        assert!(changed.admits_new(src, S), "new settings, new table");
        let off = Edge::new(Acl::default(), None, Some(&changed));
        assert!(off.admits(src) && off.admits_new(src, S));
        assert_eq!(off.flood_memory_bytes(), 0);
    }
}
