//! Services a reload removed from a vserver, kept there while their flows finish. PURE:
//! configs, a flow count per member and `now` in; the config the running proxy uses and the
//! drains that are over out.
//!
//! A reload that removes a service from a vserver while flows are pinned to it (SIP dialogs,
//! udp sessions, tcp / http connections) does not drop them: the service stays a member of
//! that vserver, last in its member list ([`crate::config::Vserver::draining`]), where no new
//! flow is given to it and the hash selector does not rank it, until its flows have ended or
//! the vserver's `drain_timeout` has passed. Re-added by a later reload before then, it is
//! an ordinary member again with its flows where they were. `docs/draining.md` tells the
//! operator's side.
//!
//! The file's config stays what reloads compare; [`Drains::effective`] is the config the
//! runtime, the monitors and the status pages see: the file's, plus the draining services
//! (their definitions from the config they were removed from, so a service deleted from
//! `services:` altogether keeps its address and its monitor until its drain ends).

use crate::config::{Config, Monitor, Service};
use crate::stats::Nanos;

/// One service draining from one vserver.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Drain {
    pub vserver: String,
    pub service: Service,
    /// The service's monitor, from the config it was removed from.
    pub monitor: Option<Monitor>,
    /// When its flows are cut (tcp / http connections closed, dialogs and sessions routed
    /// afresh) if they have not ended by then.
    pub until: Nanos,
    pub since: Nanos,
}

/// Why a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DrainEnd {
    /// No flow was left.
    Empty,
    /// `drain_timeout` passed with flows left (they are cut).
    TimedOut,
}

/// A drain that is over.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Finished {
    pub vserver: String,
    pub service: String,
    pub end: DrainEnd,
}

/// Every running drain.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Drains {
    list: Vec<Drain>,
}

/// Flows still pinned to service `service` of vserver `vserver` in the running proxy.
pub(crate) type FlowsOf<'a> = &'a dyn Fn(&str, &str) -> u64;

impl Drains {
    #[cfg(test)]
    pub(crate) fn list(&self) -> &[Drain] {
        &self.list
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The drain of `service` on `vserver`, if it drains there.
    pub(crate) fn get(&self, vserver: &str, service: &str) -> Option<&Drain> {
        self.list
            .iter()
            .find(|d| d.vserver == vserver && d.service.name == service)
    }

    /// A reload replaces the running config `running` (an effective config, draining
    /// members included) by the file config `new`. Every member of a vserver of `running`
    /// that `new` no longer lists there starts draining if flows are pinned to it and its
    /// vserver's `drain_timeout` is not zero (a drain already running keeps its deadline);
    /// a draining service that `new` lists again is revived; drains of vservers `new` lacks
    /// end.
    pub(crate) fn reloaded(
        &mut self,
        running: &Config,
        new: &Config,
        flows: FlowsOf<'_>,
        now: Nanos,
    ) {
        let mut next = Vec::new();
        for v in &running.vservers {
            let Some(nv) = new.vservers.iter().find(|n| n.name == v.name) else {
                continue;
            };
            let listed = |name: &str| {
                nv.services
                    .iter()
                    .copied()
                    .chain(nv.pool_only())
                    .any(|i| new.services.get(i).is_some_and(|s| s.name == name))
            };
            for s in v.members().filter_map(|i| running.services.get(i)) {
                if listed(&s.name) {
                    continue;
                }
                if let Some(d) = self.get(&v.name, &s.name) {
                    next.push(d.clone());
                } else if !nv.drain_timeout.is_zero() && flows(&v.name, &s.name) > 0 {
                    let timeout = u64::try_from(nv.drain_timeout.as_nanos()).unwrap_or(u64::MAX);
                    next.push(Drain {
                        vserver: v.name.clone(),
                        service: s.clone(),
                        monitor: s.monitor.and_then(|m| running.monitors.get(m)).cloned(),
                        until: now.saturating_add(timeout),
                        since: now,
                    });
                }
            }
        }
        self.list = next;
    }

    /// Take out the drains that are over at `now`: no flow left, or past their deadline.
    pub(crate) fn finish(&mut self, flows: FlowsOf<'_>, now: Nanos) -> Vec<Finished> {
        let mut done = Vec::new();
        self.list.retain(|d| {
            let end = if flows(&d.vserver, &d.service.name) == 0 {
                DrainEnd::Empty
            } else if now >= d.until {
                DrainEnd::TimedOut
            } else {
                return true;
            };
            done.push(Finished {
                vserver: d.vserver.clone(),
                service: d.service.name.clone(),
                end,
            });
            false
        });
        done
    }

    /// The config the running proxy uses: `file` with every draining service a member of
    /// its vserver (after the listed ones). A draining service `file` still defines with the
    /// same address is taken from `file`; one it no longer has is added with its old
    /// definition and monitor. A drain whose service `file` defines at another address
    /// cannot be kept (one name, two services) and is left out.
    pub(crate) fn effective(&self, file: &Config) -> Config {
        let mut c = file.clone();
        for d in &self.list {
            let Some(vi) = c.vservers.iter().position(|v| v.name == d.vserver) else {
                continue;
            };
            let si = match c.services.iter().position(|s| s.name == d.service.name) {
                Some(i) if c.services[i].address == d.service.address => i,
                Some(_) => continue,
                None => {
                    let mut s = d.service.clone();
                    s.monitor = d.monitor.as_ref().map(|m| monitor_index(&mut c, m));
                    c.services.push(s);
                    c.services.len() - 1
                }
            };
            let v = &mut c.vservers[vi];
            if !v.members().any(|m| m == si) {
                v.draining.push(si);
            }
        }
        c
    }
}

/// Index of monitor `m` in `c`, added when `c` has no identical one.
fn monitor_index(c: &mut Config, m: &Monitor) -> usize {
    match c.monitors.iter().position(|x| x == m) {
        Some(i) => i,
        None => {
            c.monitors.push(m.clone());
            c.monitors.len() - 1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(members: &str, drain: &str) -> Config {
        crate::config::from_str(
            "t.yaml",
            &format!(
                "admin: {{ listen: null }}\n\
                 monitors:\n  - {{ name: m, type: tcp-connect }}\n\
                 services:\n\
                 \x20 - {{ name: a, address: 127.0.0.1:7001, protocol: udp }}\n\
                 \x20 - {{ name: b, address: 127.0.0.1:7002, protocol: udp }}\n\
                 \x20 - {{ name: c, address: 127.0.0.1:7003, protocol: udp, monitor: m }}\n\
                 vservers:\n  - {{ name: v, protocol: udp, bind: 127.0.0.1:9000, services: [{members}]{drain} }}\n"
            ),
        )
        .expect("valid test config")
    }

    fn names(c: &Config, idx: &[usize]) -> Vec<String> {
        idx.iter().map(|&i| c.services[i].name.clone()).collect()
    }

    #[test]
    fn a_removed_member_with_flows_drains_until_its_flows_end() {
        let (old, new) = (cfg("a, b, c", ""), cfg("a, b", ""));
        let mut d = Drains::default();
        d.reloaded(&old, &new, &|_, _| 3, 10);
        assert_eq!(d.list().len(), 1);
        let e = d.effective(&new);
        assert_eq!(names(&e, &e.vservers[0].services), ["a", "b"]);
        assert_eq!(names(&e, &e.vservers[0].draining), ["c"]);
        // Default drain_timeout: the idle timeout (60 s for udp).
        assert_eq!(d.list()[0].until, 10 + 60_000_000_000);
        assert!(d.finish(&|_, _| 1, 20).is_empty());
        let done = d.finish(&|_, _| 0, 30);
        assert_eq!(done[0].end, DrainEnd::Empty);
        assert!(d.is_empty());
        assert_eq!(d.effective(&new), new);
    }

    #[test]
    fn a_drain_times_out_with_flows_left() {
        let (old, new) = (cfg("a, b, c", ""), cfg("a, b", ", drain_timeout: 5s"));
        let mut d = Drains::default();
        d.reloaded(&old, &new, &|_, _| 1, 0);
        assert!(d.finish(&|_, _| 1, 4_999_999_999).is_empty());
        assert_eq!(
            d.finish(&|_, _| 1, 5_000_000_000)[0].end,
            DrainEnd::TimedOut
        );
    }

    #[test]
    fn no_flows_or_a_zero_timeout_means_no_drain() {
        let (old, new) = (cfg("a, b, c", ""), cfg("a, b", ""));
        let mut d = Drains::default();
        d.reloaded(&old, &new, &|_, _| 0, 0);
        assert!(d.is_empty());
        let new0 = cfg("a, b", ", drain_timeout: 0s");
        d.reloaded(&old, &new0, &|_, _| 9, 0);
        assert!(d.is_empty());
    }

    #[test]
    fn re_added_is_revived_and_a_later_reload_keeps_the_deadline() {
        let (old, new) = (cfg("a, b, c", ""), cfg("a, b", ""));
        let mut d = Drains::default();
        d.reloaded(&old, &new, &|_, _| 2, 0);
        let running = d.effective(&new);
        // Another reload that does not list c either: same drain, same deadline.
        let mut again = d.clone();
        again.reloaded(&running, &cfg("b, a", ""), &|_, _| 2, 7);
        assert_eq!(again.list(), d.list());
        // c listed again: no drain, an ordinary member.
        d.reloaded(&running, &old, &|_, _| 2, 9);
        assert!(d.is_empty());
    }

    #[test]
    fn a_service_deleted_from_the_file_keeps_its_definition_and_monitor() {
        let old = cfg("a, b, c", "");
        let new = crate::config::from_str(
            "t.yaml",
            "admin: { listen: null }\n\
             services:\n  - { name: a, address: 127.0.0.1:7001, protocol: udp }\n\
             vservers:\n  - { name: v, protocol: udp, bind: 127.0.0.1:9000, services: [a] }\n",
        )
        .expect("valid");
        let mut d = Drains::default();
        d.reloaded(&old, &new, &|_, s| u64::from(s == "c"), 0);
        let e = d.effective(&new);
        assert_eq!(names(&e, &e.vservers[0].draining), ["c"]);
        let c = &e.services[e.vservers[0].draining[0]];
        assert_eq!(c.address.port(), 7003);
        let m = c.monitor.map(|i| e.monitors[i].name.clone());
        assert_eq!(m.as_deref(), Some("m"));
    }

    #[test]
    fn a_drain_readdressed_in_the_file_is_left_out() {
        let old = cfg("a, b, c", "");
        let new = cfg("a, b", "").clone();
        let mut moved = new.clone();
        moved.services[2].address = "127.0.0.1:7999".parse().expect("addr");
        let mut d = Drains::default();
        d.reloaded(&old, &new, &|_, _| 1, 0);
        assert!(d.effective(&moved).vservers[0].draining.is_empty());
    }
}
