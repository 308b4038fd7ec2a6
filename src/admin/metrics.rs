//! `GET /metrics`: Prometheus text exposition format 0.0.4. IO-free rendering of the
//! counters the data paths, balancers and monitors keep.

use crate::balancer::{Balancer, Path, STATE_NAMES};
use crate::health::ServiceHealth;
use crate::ops::Ops;
use crate::proxy::VserverHandle;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Escape a label value (backslash, double quote, newline).
pub(crate) fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

struct Family {
    name: &'static str,
    help: &'static str,
    kind: &'static str,
    samples: Vec<(String, String)>,
}

impl Family {
    fn new(name: &'static str, kind: &'static str, help: &'static str) -> Family {
        Family {
            name,
            help,
            kind,
            samples: Vec::new(),
        }
    }

    fn add(&mut self, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.add_suffixed("", labels, value);
    }

    fn add_suffixed(
        &mut self,
        suffix: &str,
        labels: &[(&str, &str)],
        value: impl std::fmt::Display,
    ) {
        let mut l = String::new();
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                l.push(',');
            }
            let _ = write!(l, "{k}=\"{}\"", escape(v));
        }
        let series = if l.is_empty() {
            format!("{}{suffix}", self.name)
        } else {
            format!("{}{suffix}{{{l}}}", self.name)
        };
        self.samples.push((series, value.to_string()));
    }

    fn render(&self, out: &mut String) {
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind);
        for (s, v) in &self.samples {
            let _ = writeln!(out, "{s} {v}");
        }
    }
}

fn load(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// The whole exposition: per-service families, selection paths, SIP families, transport
/// events, then monitors.
pub(crate) fn render(ops: &Ops) -> String {
    let mut services = ServiceFamilies::new();
    let mut paths = Family::new(
        "fulcrum_selections_total",
        "counter",
        "Decisions per selection path.",
    );
    let mut sip = SipFamilies::new();
    let mut events = Family::new(
        "fulcrum_transport_events_total",
        "counter",
        "Transport events of a vserver's data path (sessions, connections, refusals, errors).",
    );
    let mut refused = Family::new(
        "fulcrum_refused_total",
        "counter",
        "Client connections a stream listener refused at accept, by reason: budget (no open files left in the pool), per_source (its source at max_per_source) (docs/limits.md).",
    );
    let mut files = Family::new(
        "fulcrum_open_files",
        "gauge",
        "The process's open files for client connections and sessions: the limit, the reserve kept for monitors, admin and service links, the pool, the pool's files in use (docs/limits.md).",
    );
    if let Some(b) = ops.budget() {
        for (kind, n) in [
            ("limit", b.limit()),
            ("reserve", b.reserve()),
            ("pool", b.pool()),
            ("used", b.used()),
        ] {
            files.add(&[("kind", kind)], n);
        }
    }
    let (trims, returned) = ops.memory_trims();
    let mut trim_runs = Family::new(
        "fulcrum_memory_trims_total",
        "counter",
        "Times freed memory was given back to the system after a burst of connections closed (docs/limits.md).",
    );
    trim_runs.add(&[], trims);
    let mut trim_kib = Family::new(
        "fulcrum_memory_returned_kib_total",
        "counter",
        "Resident memory (KiB) those trims gave back.",
    );
    trim_kib.add(&[], returned);
    let mut dns_lookups = Family::new(
        "fulcrum_dns_lookups_total",
        "counter",
        "Lookups of each pool published in DNS, by result: found (records), empty (NXDOMAIN or NODATA: the pool empties), failed (timeout, SERVFAIL, no server: the pool keeps its last answer) (docs/discovery.md).",
    );
    let mut dns_members = Family::new(
        "fulcrum_dns_members",
        "gauge",
        "Members of each pool published in DNS, from its last answer.",
    );
    let mut dns_stale = Family::new(
        "fulcrum_dns_stale",
        "gauge",
        "1 while a pool's lookups fail and it is served from its last answer, else 0.",
    );
    for (service, p) in &ops.pools().by_service {
        let l = p.lookups;
        for (result, n) in [("found", l.found), ("empty", l.empty), ("failed", l.failed)] {
            dns_lookups.add(&[("service", service), ("result", result)], n);
        }
        dns_members.add(&[("service", service)], p.members.len());
        dns_stale.add(&[("service", service)], u8::from(p.is_stale()));
    }
    let (capture_packets, capture_connected) = capture_families(ops);
    let mut routes = Family::new(
        "fulcrum_route_requests_total",
        "counter",
        "Requests (tcp: connections) each routing rule of a vserver decided (route=\"default\": what no rule matched), by result: matched (the rule held), rejected (its reject answered), dropped, unavailable (its pool had no usable service: SIP answers 503, tcp and http close) (docs/routing.md).",
    );
    let mut edge = EdgeFamilies::new();
    let mut tls = TlsFamilies::new();
    let health = ops.health();
    ops.with_vservers(|vs, now| {
        for v in vs {
            services.add(v, now);
            add_selections(&mut paths, v);
            add_routes(&mut routes, v);
            if let Some(core) = v.data.sip_core() {
                sip.add(&v.name, core);
            }
            edge.add(&mut sip.dropped, v, now);
            tls.add(v);
            add_transport_events(&mut events, v);
            if let Some(g) = v.data.gate() {
                for (r, n) in g.refusals() {
                    refused.add(&[("vserver", &v.name), ("reason", r.name())], n);
                }
            }
        }
    });
    let mut monitors = MonitorFamilies::new();
    for s in health.services() {
        monitors.add(&s);
    }
    let mut out = String::new();
    let families = (services.families().into_iter())
        .chain([&paths, &routes])
        .chain(sip.families())
        .chain(edge.families())
        .chain(tls.families())
        .chain([&events, &refused, &files, &trim_runs, &trim_kib])
        .chain([&dns_lookups, &dns_members, &dns_stale])
        .chain([&capture_packets, &capture_connected])
        .chain(monitors.families());
    for f in families {
        f.render(&mut out);
    }
    out
}

/// `fulcrum_capture_packets_total` and `fulcrum_capture_connected` (docs/capture.md).
fn capture_families(ops: &Ops) -> (Family, Family) {
    let mut packets = Family::new(
        "fulcrum_capture_packets_total",
        "counter",
        "SIP messages captured to the HEP collector, by result: sent, or dropped by reason: queue_full (the sender or collector too slow), too_big (past one HEP packet), send_error (collector unreachable or not connected) (docs/capture.md).",
    );
    let mut connected = Family::new(
        "fulcrum_capture_connected",
        "gauge",
        "1 while the HEP collector is reachable (UDP socket set up, TCP connection open), else 0.",
    );
    if let Some(c) = ops.capture() {
        let s = c.stats();
        packets.add(&[("result", "sent")], load(&s.sent));
        for (reason, n) in s.dropped() {
            packets.add(&[("result", "dropped"), ("reason", reason)], n);
        }
        connected.add(&[], u8::from(c.is_connected()));
    }
    (packets, connected)
}

/// One sample per `(value label, counter)` of `list`, labelled with the vserver `n` and
/// `label`.
fn add_each(f: &mut Family, n: &str, label: &str, list: &[(&str, &AtomicU64)]) {
    for (name, val) in list {
        f.add(&[("vserver", n), (label, name)], load(val));
    }
}

/// The families with one series per (vserver, service): traffic counters, state, weight,
/// slow-start rate and passive ejection; and per vserver the ejections refused by
/// `max_fraction`.
struct ServiceFamilies {
    requests: Family,
    bytes: Family,
    packets: Family,
    active: Family,
    pending: Family,
    state: Family,
    weight: Family,
    slow: Family,
    ejections: Family,
    ejected: Family,
    refused: Family,
}

impl ServiceFamilies {
    fn new() -> ServiceFamilies {
        ServiceFamilies {
            requests: Family::new(
                "fulcrum_requests_total",
                "counter",
                "Requests sent to a service by a vserver.",
            ),
            bytes: Family::new(
                "fulcrum_bytes_total",
                "counter",
                "Bytes relayed to and from a service.",
            ),
            packets: Family::new(
                "fulcrum_packets_total",
                "counter",
                "Packets relayed to and from a service.",
            ),
            active: Family::new(
                "fulcrum_active",
                "gauge",
                "Open connections, sessions or dialogs of a service.",
            ),
            pending: Family::new(
                "fulcrum_pending",
                "gauge",
                "SIP requests that may open a dialog, forwarded to a service and not answered 2xx yet.",
            ),
            state: Family::new(
                "fulcrum_service_state",
                "gauge",
                "1 for the service's current state in a vserver.",
            ),
            weight: Family::new("fulcrum_service_weight", "gauge", "Configured weight."),
            slow: Family::new(
                "fulcrum_slow_start_rate",
                "gauge",
                "Current slow-start limit of a new service (requests/s or percent).",
            ),
            ejections: Family::new(
                "fulcrum_service_ejections_total",
                "counter",
                "Passive ejections of a service by a vserver (its requests failed in a row).",
            ),
            ejected: Family::new(
                "fulcrum_service_ejected",
                "gauge",
                "1 while a service is ejected or half-open on a vserver.",
            ),
            refused: Family::new(
                "fulcrum_ejections_refused_total",
                "counter",
                "Ejections not made because max_fraction of the vserver's services were ejected.",
            ),
        }
    }

    /// Every member of vserver `v` at `now`.
    fn add(&mut self, v: &VserverHandle, now: u64) {
        let b = v.balancer();
        if b.eject_params().is_some() {
            self.refused
                .add(&[("vserver", v.name.as_str())], b.ejections_refused());
        }
        let slow_state = b.slow_start();
        for (mi, m) in b.members().iter().enumerate() {
            let l = [("vserver", v.name.as_str()), ("service", m.name.as_str())];
            if let Some(c) = b.counters(mi) {
                self.requests.add(&l, c.requests_total());
                self.bytes.add(&l, c.bytes_total());
                self.packets.add(&l, c.packets_total());
                self.active.add(&l, c.active());
                self.pending.add(&l, c.pending());
            }
            self.add_state(b, mi, l, now);
            self.weight.add(&l, m.weight);
            if let Some(st) = slow_state.as_ref().and_then(|s| s.status(mi)) {
                self.slow.add(&l, st.rate);
            }
            if let Some(e) = b.ejection(mi, now) {
                self.ejections.add(&l, e.ejections);
                self.ejected.add(&l, u8::from(e.is_ejected()));
            }
        }
    }

    /// One series per state, 1 for member `mi`'s (as `/status` names it: a draining member
    /// is DRAINING alone, an ejected one that is otherwise UP is EJECTED).
    fn add_state(&mut self, b: &Balancer, mi: usize, l: [(&str, &str); 2], now: u64) {
        let cur = b.state_name(mi, now);
        for name in STATE_NAMES {
            let s = [l[0], l[1], ("state", name)];
            self.state.add(&s, u8::from(cur == name));
        }
    }

    fn families(&self) -> [&Family; 11] {
        [
            &self.requests,
            &self.bytes,
            &self.packets,
            &self.active,
            &self.pending,
            &self.state,
            &self.weight,
            &self.slow,
            &self.ejections,
            &self.ejected,
            &self.refused,
        ]
    }
}

/// What each routing rule of vserver `v` decided, and its default.
fn add_routes(family: &mut Family, v: &VserverHandle) {
    let b = v.balancer();
    let Some(routes) = b.routes() else {
        return;
    };
    let names = routes
        .rules
        .iter()
        .map(|r| r.name.as_str())
        .chain(["default"]);
    for (i, name) in names.enumerate() {
        let Some(c) = b.route_counters(i) else {
            continue;
        };
        for (result, n) in [
            ("matched", &c.matched),
            ("rejected", &c.rejected),
            ("dropped", &c.dropped),
            ("unavailable", &c.unavailable),
        ] {
            family.add(
                &[
                    ("vserver", v.name.as_str()),
                    ("route", name),
                    ("result", result),
                ],
                load(n),
            );
        }
    }
}

/// Decisions of vserver `v` per selection path.
fn add_selections(paths: &mut Family, v: &VserverHandle) {
    let b = v.balancer();
    for p in Path::ALL {
        paths.add(
            &[("vserver", v.name.as_str()), ("path", p.name())],
            b.path_count(p),
        );
    }
}

/// The SIP core's families (sip-udp and sip-tcp vservers): messages by kind, drops by
/// reason, own replies by code, socket errors by operation.
struct SipFamilies {
    sip_in: Family,
    dropped: Family,
    replies: Family,
    io_err: Family,
    failover: Family,
    held: Family,
    held_bytes: Family,
    over_limit: Family,
}

impl SipFamilies {
    fn new() -> SipFamilies {
        SipFamilies {
            sip_in: Family::new(
                "fulcrum_sip_messages_total",
                "counter",
                "SIP messages handled by a sip-udp vserver.",
            ),
            dropped: Family::new(
                "fulcrum_dropped_total",
                "counter",
                "Input dropped, by reason.",
            ),
            replies: Family::new(
                "fulcrum_sip_replies_total",
                "counter",
                "Responses generated by fulcrum itself.",
            ),
            io_err: Family::new(
                "fulcrum_io_errors_total",
                "counter",
                "Socket errors on the data path.",
            ),
            failover: Family::new(
                "fulcrum_sip_failover_total",
                "counter",
                "Requests outside a dialog held for failover, by event (docs/sip.md, Failover).",
            ),
            held: Family::new(
                "fulcrum_sip_failover_held",
                "gauge",
                "Requests outside a dialog held for failover now.",
            ),
            held_bytes: Family::new(
                "fulcrum_sip_failover_held_bytes",
                "gauge",
                "What the requests held for failover weigh now, in bytes (bounded by failover.max_pending_bytes).",
            ),
            over_limit: Family::new(
                "fulcrum_sip_over_limit_total",
                "counter",
                "SIP messages past fulcrum's header-line or message-size limit (a client's request answered 513 where it can be), by limit.",
            ),
        }
    }

    /// The counters of vserver `n`'s SIP core, and of the requests it holds for failover.
    fn add(&mut self, n: &str, core: &crate::core::sip::SipCore) {
        let c = &core.counters;
        let t = core.transactions();
        let events = [
            ("held", &t.counters.started),
            ("failover", &t.counters.failovers),
            ("absorbed", &t.counters.absorbed),
            ("exhausted", &t.counters.exhausted),
            ("table_full", &t.counters.table_full),
        ];
        add_each(&mut self.failover, n, "event", &events);
        self.held.add(&[("vserver", n)], t.len() as u64);
        self.held_bytes.add(&[("vserver", n)], t.bytes() as u64);
        let kinds = [
            ("requests_in", &c.requests_in),
            ("responses_in", &c.responses_in),
            ("requests_forwarded", &c.requests_forwarded),
            ("responses_forwarded", &c.responses_forwarded),
            ("in_dialog_from_services", &c.in_dialog_from_services),
            ("routed_by_record_route", &c.routed_by_record_route),
            ("paths_added", &c.paths_added),
            ("routed_by_flow", &c.routed_by_flow),
        ];
        add_each(&mut self.sip_in, n, "kind", &kinds);
        let reasons = [
            ("malformed", &c.malformed),
            ("not_ours", &c.not_ours),
            ("loop", &c.loops),
            ("unroutable", &c.unroutable),
            ("ack_not_forwarded", &c.acks_not_forwarded),
        ];
        add_each(&mut self.dropped, n, "reason", &reasons);
        let codes = [
            ("400", &c.replies_400),
            ("403", &c.flow_forged),
            ("420", &c.replies_420),
            ("430", &c.flow_failed),
            ("483", &c.replies_483),
            ("501", &c.replies_501),
            ("503", &c.replies_503),
            ("505", &c.replies_505),
            ("513", &c.replies_513),
        ];
        add_each(&mut self.replies, n, "code", &codes);
        let ops = [("send", &c.send_errors), ("recv", &c.recv_errors)];
        add_each(&mut self.io_err, n, "op", &ops);
        let limits = [
            ("header_lines", &c.over_header_limit),
            ("size", &c.over_size_limit),
        ];
        add_each(&mut self.over_limit, n, "limit", &limits);
    }

    fn families(&self) -> [&Family; 8] {
        [
            &self.sip_in,
            &self.dropped,
            &self.replies,
            &self.io_err,
            &self.failover,
            &self.held,
            &self.held_bytes,
            &self.over_limit,
        ]
    }
}

/// Edge protection of every vserver (docs/edge.md): drops by the access lists and flood
/// control (in `fulcrum_dropped_total` beside the SIP reasons), bans started, sources banned.
struct EdgeFamilies {
    bans: Family,
    banned: Family,
}

impl EdgeFamilies {
    fn new() -> EdgeFamilies {
        EdgeFamilies {
            bans: Family::new(
                "fulcrum_flood_bans_total",
                "counter",
                "Sources banned by flood control.",
            ),
            banned: Family::new(
                "fulcrum_flood_banned_sources",
                "gauge",
                "Sources banned by flood control now.",
            ),
        }
    }

    fn add(&mut self, dropped: &mut Family, v: &VserverHandle, now: u64) {
        let e = v.data.edge();
        let c = e.counters();
        let n = v.name.as_str();
        add_each(
            dropped,
            n,
            "reason",
            &[("acl", &c.acl), ("flood", &c.flood)],
        );
        self.bans.add(&[("vserver", n)], load(&c.bans));
        self.banned.add(&[("vserver", n)], e.bans(now).len());
    }

    fn families(&self) -> [&Family; 2] {
        [&self.bans, &self.banned]
    }
}

/// Handshakes of the vservers that terminate TLS, and of every vserver toward its services
/// with `tls` (docs/tls.md): completed, failed by reason (every reason listed, zero or not),
/// and renegotiations refused.
struct TlsFamilies {
    completed: Family,
    failed: Family,
    refused: Family,
    service_completed: Family,
    service_failed: Family,
    service_refused: Family,
}

impl TlsFamilies {
    fn new() -> TlsFamilies {
        TlsFamilies {
            completed: Family::new(
                "fulcrum_tls_handshakes_total",
                "counter",
                "TLS handshakes completed on a vserver's listener.",
            ),
            failed: Family::new(
                "fulcrum_tls_handshake_failures_total",
                "counter",
                "TLS handshakes that failed on a vserver's listener, by reason.",
            ),
            refused: Family::new(
                "fulcrum_tls_renegotiations_refused_total",
                "counter",
                "TLS 1.2 renegotiations clients asked for on a vserver's listener, refused.",
            ),
            service_completed: Family::new(
                "fulcrum_tls_service_handshakes_total",
                "counter",
                "TLS handshakes a vserver completed toward a service.",
            ),
            service_failed: Family::new(
                "fulcrum_tls_service_handshake_failures_total",
                "counter",
                "TLS handshakes toward a service that failed, by reason.",
            ),
            service_refused: Family::new(
                "fulcrum_tls_service_renegotiations_refused_total",
                "counter",
                "TLS 1.2 renegotiations a service asked for, refused.",
            ),
        }
    }

    fn add(&mut self, v: &VserverHandle) {
        let n = v.name.as_str();
        if let Some(listener) = v.tls() {
            let c = &listener.counters;
            let l = [("vserver", n)];
            add_handshakes(&mut self.completed, &mut self.failed, &l, c);
            self.refused.add(&l, load(&c.renegotiations_refused));
        }
        for (service, c) in v.service_tls() {
            let l = [("vserver", n), ("service", service.as_str())];
            add_handshakes(
                &mut self.service_completed,
                &mut self.service_failed,
                &l,
                &c,
            );
            self.service_refused
                .add(&l, load(&c.renegotiations_refused));
        }
    }

    fn families(&self) -> [&Family; 6] {
        [
            &self.completed,
            &self.failed,
            &self.refused,
            &self.service_completed,
            &self.service_failed,
            &self.service_refused,
        ]
    }
}

/// The handshakes of `c` labelled `l`: completed into `completed`, failed into `failed`
/// with one series per reason.
fn add_handshakes(
    completed: &mut Family,
    failed: &mut Family,
    l: &[(&str, &str)],
    c: &crate::tls::HandshakeCounters,
) {
    completed.add(l, load(&c.completed));
    for r in crate::tls::Reason::ALL {
        let mut with_reason = l.to_vec();
        with_reason.push(("reason", r.name()));
        failed.add(&with_reason, load(c.failed(r)));
    }
}

/// Transport-specific counters of vserver `v`, one series per event (a sip-udp vserver has
/// some only for its links toward stream services: its own are in the SIP families).
fn add_transport_events(events: &mut Family, v: &VserverHandle) {
    let n = v.name.as_str();
    v.data
        .each_event(&mut |event, c| events.add(&[("vserver", n), ("event", event)], load(c)));
}

/// The monitor families, one series per monitored service: probes by result, probe
/// latency, and whether the monitor considers the service alive.
struct MonitorFamilies {
    probes: Family,
    local_errors: Family,
    latency: Family,
    mon_up: Family,
}

impl MonitorFamilies {
    fn new() -> MonitorFamilies {
        MonitorFamilies {
            probes: Family::new(
                "fulcrum_monitor_probes_total",
                "counter",
                "Monitor probes by result.",
            ),
            local_errors: Family::new(
                "fulcrum_monitor_local_errors_total",
                "counter",
                "Monitor probes that failed on fulcrum's own side (no descriptor, buffer, memory or local address): not counted against the service.",
            ),
            latency: Family::new(
                "fulcrum_monitor_latency_seconds",
                "summary",
                "Round-trip time of successful monitor probes.",
            ),
            mon_up: Family::new(
                "fulcrum_monitor_up",
                "gauge",
                "1 when the monitor considers the service alive.",
            ),
        }
    }

    /// Service `s`, when it has a monitor.
    fn add(&mut self, s: &ServiceHealth) {
        let Some((mon, phase)) = s.monitor() else {
            return;
        };
        let l = [("service", s.name.as_str()), ("monitor", mon.as_str())];
        let probes = &mut self.probes;
        probes.add(&[l[0], l[1], ("result", "ok")], load(&s.probes_ok));
        probes.add(&[l[0], l[1], ("result", "failed")], load(&s.probes_failed));
        self.local_errors.add(&l, load(&s.local_errors));
        let latency = &mut self.latency;
        latency.add_suffixed("_sum", &l, load(&s.rtt_sum_us) as f64 / 1e6);
        latency.add_suffixed("_count", &l, load(&s.probes_ok));
        self.mon_up.add(&l, u8::from(phase.is_up()));
    }

    fn families(&self) -> [&Family; 4] {
        [
            &self.probes,
            &self.local_errors,
            &self.latency,
            &self.mon_up,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::balancer::Health;
    use crate::eject::{Cause, Failure};
    use std::sync::Arc;

    /// The golden exposition, `fixtures/golden/metrics.prom`: [`render`] over [`GOLDEN_CONFIG`]
    /// with every counter set by [`fill`]. Regenerate (only for a deliberate change of the
    /// exposition) with `FULCRUM_BLESS=1 cargo test --lib admin::metrics`.
    const GOLDEN: &str = "fixtures/golden/metrics.prom";

    /// One vserver per data path; `m1`'s monitor would first probe half an hour after start.
    const GOLDEN_CONFIG: &str = "admin: { listen: null }
dns: { servers: [127.0.0.1:9], min_refresh: 1h, max_refresh: 2h }
monitors:
  - { name: opt, type: sip-options, interval: 1h, timeout: 1s }
services:
  - { name: a1, address: 127.0.0.1:9, protocol: udp }
  - { name: a2, address: 127.0.0.1:10, protocol: udp, weight: 2 }
  - { name: a3, address: 127.0.0.1:15, protocol: udp }
  - { name: t1, address: 127.0.0.1:11, protocol: tcp }
  - { name: m1, address: 127.0.0.1:12, protocol: sip-udp, monitor: opt, weight: 3 }
  - { name: s2, address: 127.0.0.1:13, protocol: sip-udp }
  - { name: k1, address: 127.0.0.1:14, protocol: sip-tcp }
  - { name: pool, dns: pool.test, port: 5060, protocol: sip-udp }
vservers:
  - { name: vu, protocol: udp, bind: [127.0.0.1:0], method: round_robin, drain_timeout: 1h, services: [a1, a2, a3] }
  - { name: vt, protocol: tcp, bind: [127.0.0.1:0], method: round_robin, services: [t1] }
  - name: vs
    protocol: sip-udp
    bind: [127.0.0.1:0]
    method: round_robin
    slow_start: { new_service_request_rate: 7, unit: per_second, increment_interval: 0s }
    services: [m1, s2]
    routes:
      - { name: reg, match: { method: REGISTER }, services: [s2] }
      - { name: scan, match: { header: { name: User-Agent, present: true } }, drop: true }
  - { name: vk, protocol: sip-tcp, bind: [127.0.0.1:0], method: round_robin, services: [k1] }
";

    /// Store `base`, `base + 1`, ... into `counters`, so a series reading the wrong counter
    /// shows in the golden file.
    fn store(counters: &[&AtomicU64], base: u64) {
        for (i, c) in counters.iter().enumerate() {
            c.store(base + i as u64, Ordering::Relaxed);
        }
    }

    fn fill_sip(c: &crate::core::sip::SipCounters, base: u64) {
        store(
            &[
                &c.requests_in,
                &c.responses_in,
                &c.requests_forwarded,
                &c.responses_forwarded,
                &c.in_dialog_from_services,
                &c.routed_by_record_route,
                &c.paths_added,
                &c.routed_by_flow,
                &c.flow_forged,
                &c.flow_failed,
                &c.replies_400,
                &c.replies_483,
                &c.replies_503,
                &c.replies_513,
                &c.malformed,
                &c.not_ours,
                &c.loops,
                &c.unroutable,
                &c.acks_not_forwarded,
                &c.send_errors,
                &c.recv_errors,
            ],
            base,
        );
        store(&[&c.over_header_limit, &c.over_size_limit], base + 40);
    }

    fn fill_transport(data: &dyn crate::proxy::DataPath, base: u64) {
        let mut i = 0;
        data.each_event(&mut |_, c| {
            c.store(base + i, Ordering::Relaxed);
            i += 1;
        });
    }

    /// Distinct values in every counter [`render`] reads; `a2` disabled, `a3` draining (a
    /// reload dropped it while it held a flow), `s2` new in slow start, `a1` ejected, and
    /// an ejection refused on `vt`.
    fn fill(ops: &Ops) {
        assert!(ops.set_disabled("a2", true));
        ops.with_vservers(|vs, _| vs[0].balancer().counters(2).expect("a3").open());
        let without_a3 = GOLDEN_CONFIG.replace("[a1, a2, a3]", "[a1, a2]");
        let cfg = crate::config::from_str("golden.yaml", &without_a3).expect("valid");
        ops.apply(cfg).expect("reload");
        ops.with_vservers(|vs, now| {
            for (vi, v) in vs.iter().enumerate() {
                let base = 1000 * (vi as u64 + 1);
                let b = v.balancer();
                for mi in 0..b.members().len() {
                    let c = b.counters(mi).expect("counters");
                    for _ in 0..=(vi + mi) {
                        c.record_request();
                        c.open();
                    }
                    c.record_traffic(base + 10 * mi as u64, 3 + mi as u64, now);
                }
                for _ in 0..vi {
                    b.count_affinity();
                }
                if v.name == "vs" {
                    b.set_health(1, Health::Down, now);
                    b.set_health(1, Health::Up, now);
                }
                // `a1` ejected (one of vu's two serving members); `t1`, vt's only member,
                // may not be: a refusal.
                if matches!(v.name.as_str(), "vu" | "vt") {
                    for _ in 0..3 {
                        b.report_failure_with(0, Failure::new(Cause::Refused), now);
                    }
                }
                for i in 0..3 {
                    if let Some(r) = b.route_counters(i) {
                        let c = [&r.matched, &r.rejected, &r.dropped, &r.unavailable];
                        store(&c, base + 170 + 10 * i as u64);
                    }
                }
                if let Some(core) = v.data.sip_core() {
                    fill_sip(&core.counters, base + 100);
                    let t = &core.transactions().counters;
                    let held = [&t.started, &t.failovers, &t.absorbed, &t.exhausted];
                    store(&held, base + 150);
                    store(&[&t.table_full], base + 160);
                }
                fill_transport(&*v.data, base + 200);
            }
        })
        .expect("running");
        for (i, s) in ops.health().services().iter().enumerate() {
            let i = i as u64;
            store(
                &[&s.probes_ok, &s.probes_failed, &s.local_errors],
                10 * i + 1,
            );
            s.rtt_sum_us.store(1_234_567 * (i + 1), Ordering::Relaxed);
        }
    }

    #[test]
    fn exposition_matches_the_golden_file() {
        let interval_ms = 3_600_000;
        assert!(crate::health::state::first_probe_delay_ms("m1", interval_ms) > 600_000);
        let cfg = crate::config::from_str("golden.yaml", GOLDEN_CONFIG).expect("valid");
        let ops: Arc<Ops> = Ops::start(cfg, None).expect("start");
        fill(&ops);
        // The open files are this machine's: their values are masked.
        let got: String = render(&ops)
            .lines()
            .map(|l| match l.rsplit_once(' ') {
                Some((series, _)) if l.starts_with("fulcrum_open_files{") => {
                    format!("{series} N\n")
                }
                _ => format!("{l}\n"),
            })
            .collect();
        ops.shutdown();
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(GOLDEN);
        if std::env::var_os("FULCRUM_BLESS").is_some() {
            std::fs::write(&path, &got).expect("write golden file");
        }
        let want = std::fs::read_to_string(&path).expect("golden file present");
        for (n, (g, w)) in got.lines().zip(want.lines()).enumerate() {
            assert_eq!(g, w, "golden line {} differs", n + 1);
        }
        assert_eq!(got, want);
    }
}
