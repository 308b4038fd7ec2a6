//! What a reload may change in place, and what needs a restart. PURE: two configs in, a
//! plan or the list of reasons out.
//!
//! # Applied in place (atomically, after the whole new file validated)
//! - `monitors` and each service's `monitor`: probe tasks restart with the new
//!   definitions; a service whose monitor definition is unchanged keeps its state, a new
//!   or changed monitor starts UP, unconfirmed (see [`crate::health::state`]).
//! - `admin.token`.
//! - each vserver's `slow_start.new_service_request_rate` (as `PUT /vservers/{name}/slow-start`).
//! - `logging` is ignored (the subscriber is set once).
//! - services that belong to no vserver may be added, changed or removed freely.
//!
//! # Needs a restart (the reload is refused and nothing changes)
//! - `lb` (hash algorithm, fingers), `admin.listen`;
//! - the set of vservers, and any vserver field other than the slow-start rate (bind,
//!   protocol, method, hash parameters, slow-start unit or interval, timeouts, workers,
//!   and the list of its services — adding or removing a member);
//! - `address`, `protocol`, `weight`, `max_clients` or `hash_id` of a service that a
//!   vserver uses.
//!
//! Listeners, sessions, dialog affinity and counters are untouched by an in-place reload.

use crate::config::{Config, Service, Vserver};

/// Changes an in-place reload applies.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Monitors or service→monitor assignments differ.
    pub monitors_changed: bool,
    /// New admin token, when it differs.
    pub token: Option<Option<String>>,
    /// (vserver, new rate) for every changed slow-start rate.
    pub slow_start_rates: Vec<(String, u32)>,
}

impl Plan {
    /// Human-readable list of what the plan changes.
    pub fn describe(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.monitors_changed {
            v.push("monitors".to_owned());
        }
        if self.token.is_some() {
            v.push("admin.token".to_owned());
        }
        for (vs, r) in &self.slow_start_rates {
            v.push(format!(
                "vservers.{vs}.slow_start.new_service_request_rate = {r}"
            ));
        }
        v
    }
}

fn member_names(c: &Config, v: &Vserver) -> Vec<String> {
    v.services
        .iter()
        .filter_map(|&i| c.services.get(i).map(|s| s.name.clone()))
        .collect()
}

fn same_data(a: &Service, b: &Service) -> bool {
    a.address == b.address
        && a.protocol == b.protocol
        && a.weight == b.weight
        && a.max_clients == b.max_clients
        && a.hash_id == b.hash_id
}

fn monitor_of<'a>(c: &'a Config, s: &Service) -> Option<&'a crate::config::Monitor> {
    s.monitor.and_then(|i| c.monitors.get(i))
}

/// Compare the running config with a new, validated one.
pub fn plan(old: &Config, new: &Config) -> Result<Plan, Vec<String>> {
    let mut restart = Vec::new();
    if old.lb != new.lb {
        restart.push("lb: hash parameters changed".to_owned());
    }
    if old.admin.listen != new.admin.listen {
        restart.push("admin.listen changed".to_owned());
    }
    let old_names: Vec<&str> = old.vservers.iter().map(|v| v.name.as_str()).collect();
    let new_names: Vec<&str> = new.vservers.iter().map(|v| v.name.as_str()).collect();
    if old_names != new_names {
        restart.push(format!(
            "vservers added, removed or reordered ({old_names:?} -> {new_names:?})"
        ));
    }
    let mut p = Plan::default();
    for (a, b) in old.vservers.iter().zip(&new.vservers) {
        if a.name != b.name {
            continue;
        }
        let ma = member_names(old, a);
        let mb = member_names(new, b);
        if ma != mb {
            restart.push(format!(
                "vservers.{}.services changed ({ma:?} -> {mb:?})",
                a.name
            ));
        }
        let mut a2 = a.clone();
        let mut b2 = b.clone();
        a2.services.clear();
        b2.services.clear();
        let (ra, rb) = (
            a2.slow_start.map(|s| s.new_service_request_rate),
            b2.slow_start.map(|s| s.new_service_request_rate),
        );
        if let (Some(sa), Some(sb)) = (a2.slow_start.as_mut(), b2.slow_start.as_mut()) {
            sb.new_service_request_rate = sa.new_service_request_rate;
        }
        if a2 != b2 {
            restart.push(format!(
                "vservers.{}: listener, method or slow-start unit/interval changed",
                a.name
            ));
        } else if ra != rb
            && let Some(r) = rb
        {
            p.slow_start_rates.push((b.name.clone(), r));
        }
        for name in &mb {
            let (Some(sa), Some(sb)) = (
                old.services.iter().find(|s| &s.name == name),
                new.services.iter().find(|s| &s.name == name),
            ) else {
                continue;
            };
            if !same_data(sa, sb) {
                let msg = format!(
                    "services.{name}: address, protocol, weight, max_clients or hash_id changed"
                );
                if !restart.contains(&msg) {
                    restart.push(msg);
                }
            }
        }
    }
    if !restart.is_empty() {
        return Err(restart);
    }
    let old_mon: Vec<(&str, Option<&crate::config::Monitor>)> = old
        .services
        .iter()
        .map(|s| (s.name.as_str(), monitor_of(old, s)))
        .collect();
    let new_mon: Vec<(&str, Option<&crate::config::Monitor>)> = new
        .services
        .iter()
        .map(|s| (s.name.as_str(), monitor_of(new, s)))
        .collect();
    p.monitors_changed = old_mon != new_mon;
    if old.admin.token != new.admin.token {
        p.token = Some(new.admin.token.clone());
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra_service: &str, members: &str, rate: u32, interval: &str) -> Config {
        let y = format!(
            "admin: {{ listen: null, token: null }}\n\
             monitors:\n  - {{ name: m, type: tcp-connect, interval: {interval}, timeout: 1s, failures_to_down: 2, successes_to_up: 1 }}\n\
             services:\n  - {{ name: a, address: 127.0.0.1:5071, protocol: sip-udp, monitor: m }}\n  - {{ name: b, address: 127.0.0.1:5072, protocol: sip-udp }}\n{extra_service}\
             vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [127.0.0.1:0]\n    method: round_robin\n    slow_start: {{ new_service_request_rate: {rate}, unit: per_second, increment_interval: 0s }}\n    services: [{members}]\n"
        );
        crate::config::from_str("t.yaml", &y).expect("valid test config")
    }

    #[test]
    fn identical_configs_change_nothing() {
        let c = cfg("", "a, b", 10, "1s");
        assert_eq!(plan(&c, &c), Ok(Plan::default()));
    }

    #[test]
    fn in_place_changes_are_planned() {
        let old = cfg("", "a, b", 10, "1s");
        let new = cfg(
            "  - { name: spare, address: 127.0.0.1:5999, protocol: sip-udp }\n",
            "a, b",
            20,
            "2s",
        );
        let p = plan(&old, &new).expect("in place");
        assert!(p.monitors_changed);
        assert_eq!(p.slow_start_rates, vec![("v".to_owned(), 20)]);
    }

    #[test]
    fn membership_change_needs_restart() {
        let old = cfg("", "a, b", 10, "1s");
        let new = cfg("", "a", 10, "1s");
        let why = plan(&old, &new).expect_err("restart");
        assert!(why[0].contains("vservers.v.services"), "{why:?}");
    }
}
