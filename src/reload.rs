//! What a reload may change in place, and what needs a restart. PURE: two configs in, a
//! plan or the list of reasons out.
//!
//! # Applied in place (atomically, after the whole new file validated)
//! - `monitors` and each service's `monitor`: the probe task of a service restarts when its
//!   monitor definition, or the service's address or protocol, changes; the others run on
//!   with the timing of their probes ([`crate::health::HealthBoard::start_monitors`]). A
//!   service whose monitor definition is unchanged keeps its state, a new or changed monitor
//!   starts UP, unconfirmed (see [`crate::health::state`]).
//! - `admin.token`.
//! - a vserver whose only change is `slow_start.new_service_request_rate`: the rate is set
//!   (as `PUT /vservers/{name}/slow-start`), nothing else moves.
//! - a vserver of any protocol whose services (added, removed, reordered, or their
//!   address, weight, max_clients, hash_id), method, hash parameters, slow start, eject,
//!   record_route, idle_timeout or max_sessions changed is rebuilt behind its unchanged
//!   sockets ([`crate::proxy::reconfig`]): dialogs, sessions and connections of surviving
//!   services stay on them, added services enter slow start, removed services get no new
//!   flows and drain while flows are pinned to them ([`crate::drain`], `docs/draining.md`;
//!   requests queued for a removed sip-tcp service that does not drain go to the service
//!   the new config chooses).
//! - `tls` certificates and keys (vservers) and CAs (services) are read again on every
//!   reload, changed or not, and stored for new handshakes, a monitor's next probe included;
//!   established connections keep theirs (docs/tls.md). A vserver's listener whose files
//!   (by content) did not change keeps its server configuration and session cache, so
//!   clients resume their sessions across the reload ([`crate::tls::TlsListener::store`]). A vserver's `tls` files and
//!   `tls_handshake_timeout` change in place this way; a service's `tls` fields are part of
//!   its data (a change rebuilds its vservers; its monitor runs on, probing with the new
//!   `tls`).
//! - `capture`: a changed collector, id, password, vserver list or `probes` starts a new
//!   sender; the old one ends when its queue is empty (docs/capture.md).
//! - `logging` is ignored (the subscriber is set once).
//! - services that belong to no vserver may be added, changed or removed freely.
//!
//! # Needs a restart (the reload is refused and nothing changes)
//! - `lb` (hash algorithm, fingers), `admin.listen`;
//! - adding, removing, renaming or reordering vservers;
//! - a vserver's `bind`, `protocol`, `workers`, `advertise`, `service_source`, `transparent`,
//!   `freebind`, `send_proxy` (its sockets, threads and Via identity), and adding or removing
//!   its `tls`.

use crate::config::{Config, Protocol, Service, Vserver};

/// What a reload does to `admin.token`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TokenChange {
    /// The same token (or none) before and after.
    #[default]
    Unchanged,
    /// The new token; `None` when the new configuration removes it.
    Set(Option<String>),
}

/// Changes an in-place reload applies.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Monitors or service→monitor assignments differ.
    pub monitors_changed: bool,
    /// Whether the admin token changes, and to what.
    pub token: TokenChange,
    /// (vserver, new rate) for every changed slow-start rate.
    pub slow_start_rates: Vec<(String, u32)>,
    /// Vservers rebuilt in place (services, weights, method, slow start or timeouts
    /// changed).
    pub rebuild: Vec<String>,
    /// The `capture` block changed (applied in place).
    pub capture_changed: bool,
}

impl Plan {
    /// Human-readable list of what the plan changes.
    pub fn describe(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.monitors_changed {
            v.push("monitors".to_owned());
        }
        if self.token != TokenChange::Unchanged {
            v.push("admin.token".to_owned());
        }
        if self.capture_changed {
            v.push("capture".to_owned());
        }
        for vs in &self.rebuild {
            v.push(format!("vservers.{vs} rebuilt"));
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

/// Fields that belong to the sockets and threads of a vserver.
fn same_listener(a: &Vserver, b: &Vserver) -> bool {
    a.bind == b.bind
        && a.protocol == b.protocol
        && a.workers == b.workers
        && a.advertise == b.advertise
        && a.service_source == b.service_source
        && a.transparent == b.transparent
        && a.freebind == b.freebind
        && a.send_proxy == b.send_proxy
        && a.tls.is_some() == b.tls.is_some()
}

fn same_data(a: &Service, b: &Service) -> bool {
    a.address == b.address
        && a.protocol == b.protocol
        && a.weight == b.weight
        && a.max_clients == b.max_clients
        && a.hash_id == b.hash_id
        && a.tls == b.tls
        && a.tier() == b.tier()
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
        if !same_listener(a, b) {
            restart.push(format!(
                "vservers.{}: bind, protocol, workers, advertise, service_source, transparent, freebind, send_proxy or tls (on or off) changed (the listener is only set up at start)",
                a.name
            ));
            continue;
        }
        if let Some(why) = new_sip_leg(old, a, new, b) {
            restart.push(format!("vservers.{}: {why}", a.name));
            continue;
        }
        let ma = member_names(old, a);
        let mb = member_names(new, b);
        let data_changed = mb.iter().any(|name| {
            match (
                old.services.iter().find(|s| &s.name == name),
                new.services.iter().find(|s| &s.name == name),
            ) {
                (Some(sa), Some(sb)) => !same_data(sa, sb),
                _ => false,
            }
        });
        let mut a2 = a.clone();
        let mut b2 = b.clone();
        a2.services.clear();
        b2.services.clear();
        // Certificates are stored into the running listener on every reload, not rebuilt.
        a2.tls = None;
        b2.tls = None;
        let (ra, rb) = (
            a2.slow_start.map(|s| s.new_service_request_rate),
            b2.slow_start.map(|s| s.new_service_request_rate),
        );
        if let (Some(sa), Some(sb)) = (a2.slow_start.as_mut(), b2.slow_start.as_mut()) {
            sb.new_service_request_rate = sa.new_service_request_rate;
        }
        if ma != mb || data_changed || a2 != b2 {
            p.rebuild.push(b.name.clone());
        } else if ra != rb
            && let Some(r) = rb
        {
            p.slow_start_rates.push((b.name.clone(), r));
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
        p.token = TokenChange::Set(new.admin.token.clone());
    }
    p.capture_changed = old.capture != new.capture;
    Ok(p)
}

/// The transports bridge sets up a SIP vserver's other legs at start: the UDP leg of a
/// sip-tcp / sip-tls vserver with sip-udp services, the stream links of a sip-udp vserver
/// with sip-tcp / sip-tls services. A reload that would need one the running vserver was not
/// started with is refused before anything changes (why, when it is).
fn new_sip_leg(old: &Config, a: &Vserver, new: &Config, b: &Vserver) -> Option<&'static str> {
    if !b.protocol.is_sip() {
        return None;
    }
    let kinds = |c: &Config, v: &Vserver| {
        (
            v.forwards_to(c, |p| p == Protocol::SipUdp),
            v.forwards_to(c, Protocol::is_sip_stream),
        )
    };
    let (udp_before, stream_before) = kinds(old, a);
    let (udp_after, stream_after) = kinds(new, b);
    if b.protocol.is_sip_stream() && udp_after && !udp_before {
        Some("its first sip-udp service needs a restart (the UDP leg is bound at start)")
    } else if b.protocol == Protocol::SipUdp && stream_after && !stream_before {
        Some(
            "its first sip-tcp or sip-tls service needs a restart (the links toward stream services are set up at start)",
        )
    } else {
        None
    }
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

    /// The balancer holds the ejection parameters: a change rebuilds the vserver in place.
    #[test]
    fn an_eject_change_rebuilds_in_place() {
        let old = cfg("", "a, b", 10, "1s");
        let mut new = old.clone();
        new.vservers[0].eject = None;
        let p = plan(&old, &new).expect("in place");
        assert_eq!(p.rebuild, vec!["v".to_owned()]);
    }

    #[test]
    fn membership_change_rebuilds_a_sip_udp_vserver() {
        let old = cfg("", "a, b", 10, "1s");
        let new = cfg("", "a", 10, "1s");
        let p = plan(&old, &new).expect("in place");
        assert_eq!(p.rebuild, vec!["v".to_owned()]);
        assert!(p.slow_start_rates.is_empty());
    }

    #[test]
    fn a_bridge_leg_the_vserver_was_not_started_with_is_refused_before_anything_changes() {
        let y = |vs_proto: &str, services: &str, members: &str| {
            format!(
                "admin: {{ listen: null }}\n\
                 services:\n{services}\
                 vservers:\n  - {{ name: first, protocol: sip-udp, bind: [127.0.0.1:0], services: [u] }}\n  \
                   - {{ name: v, protocol: {vs_proto}, bind: [127.0.0.1:0], services: [{members}] }}\n"
            )
        };
        let services = "  - { name: u, address: 127.0.0.1:5071, protocol: sip-udp }\n  \
                        - { name: u2, address: 127.0.0.1:5072, protocol: sip-udp }\n  \
                        - { name: t, address: 127.0.0.1:5073, protocol: sip-tcp }\n  \
                        - { name: t2, address: 127.0.0.1:5074, protocol: sip-tcp }\n";
        let parse = |t: String| crate::config::from_str("t.yaml", &t).expect("valid config");
        // A sip-udp vserver's first stream service; the other vserver's change is refused too
        // (the whole reload is).
        let old = parse(y("sip-udp", services, "u"));
        let new =
            parse(y("sip-udp", services, "u, t").replace("services: [u] }", "services: [u, u2] }"));
        let why = plan(&old, &new).expect_err("restart");
        assert!(
            why.iter()
                .any(|w| w
                    .contains("vservers.v: its first sip-tcp or sip-tls service needs a restart")),
            "{why:?}"
        );
        // A second stream service is an ordinary rebuild.
        let old = parse(y("sip-udp", services, "u, t"));
        let p = plan(&old, &parse(y("sip-udp", services, "u, t, t2"))).expect("in place");
        assert_eq!(p.rebuild, vec!["v".to_owned()]);
        // A stream vserver's first sip-udp service.
        let old = parse(y("sip-tcp", services, "t"));
        let why = plan(&old, &parse(y("sip-tcp", services, "t, u2"))).expect_err("restart");
        assert!(
            why.iter()
                .any(|w| w.contains("its first sip-udp service needs a restart")),
            "{why:?}"
        );
    }

    #[test]
    fn membership_change_rebuilds_every_protocol_but_a_bind_change_does_not() {
        for proto in ["sip-udp", "sip-tcp", "udp", "tcp", "http"] {
            let y = |bind: &str, members: &str| {
                format!(
                    "admin: {{ listen: null }}\n\
                     services:\n  - {{ name: a, address: 127.0.0.1:5071, protocol: {proto} }}\n  - {{ name: b, address: 127.0.0.1:5072, protocol: {proto} }}\n\
                     vservers:\n  - {{ name: v, protocol: {proto}, bind: [{bind}], method: round_robin, services: [{members}] }}\n"
                )
            };
            let parse = |t: String| crate::config::from_str("t.yaml", &t).expect("valid config");
            let old = parse(y("127.0.0.1:0", "a"));
            let p = plan(&old, &parse(y("127.0.0.1:0", "a, b"))).expect("in place");
            assert_eq!(p.rebuild, vec!["v".to_owned()], "{proto}");
            let why = plan(&old, &parse(y("127.0.0.1:7", "a, b"))).expect_err("restart");
            assert!(why[0].contains("vservers.v: bind"), "{proto}: {why:?}");
        }
    }

    /// New certificate files are stored into the running listener, not a rebuild; turning
    /// TLS on or off is a listener change; a service's `tls` is its data.
    #[test]
    fn tls_changes_are_planned() {
        let y = |vtls: &str, stls: &str| {
            format!(
                "admin: {{ listen: null }}\nservices:\n  - {{ name: a, address: 127.0.0.1:5071, protocol: tcp{stls} }}\nvservers:\n  - {{ name: v, protocol: tcp, bind: [127.0.0.1:0], method: round_robin, services: [a]{vtls} }}\n"
            )
        };
        let parse = |t: String| crate::config::from_str("t.yaml", &t).expect("valid config");
        let on = parse(y(", tls: { cert: a.crt, key: a.key }", ""));
        let moved = parse(y(
            ", tls: { cert: b.crt, key: b.key }, tls_handshake_timeout: 1s",
            "",
        ));
        assert_eq!(plan(&on, &moved), Ok(Plan::default()));
        let off = parse(y("", ""));
        let why = plan(&on, &off).expect_err("restart");
        assert!(why[0].contains("tls"), "{why:?}");
        let to_service = parse(y("", ", tls: { ca: ca.pem }"));
        assert_eq!(
            plan(&off, &to_service).expect("in place").rebuild,
            vec!["v".to_owned()]
        );
    }

    #[test]
    fn listener_change_needs_restart() {
        let old = cfg("", "a, b", 10, "1s");
        let mut new = old.clone();
        new.vservers[0].workers = 7;
        let why = plan(&old, &new).expect_err("restart");
        assert!(why[0].contains("vservers.v: bind"), "{why:?}");
        // IP_FREEBIND is set on the sockets before they bind.
        let mut new = old.clone();
        new.vservers[0].freebind = true;
        let why = plan(&old, &new).expect_err("restart");
        assert!(why[0].contains("freebind"), "{why:?}");
        let mut new = old.clone();
        new.lb.hash_fingers = 3;
        assert!(plan(&old, &new).is_err());
    }
}
