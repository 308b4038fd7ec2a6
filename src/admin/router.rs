//! The admin API's routes: a request value in, a response value out. No socket here, so the
//! whole API is tested without a listener; [`super::serve`] carries it over HTTP/1.1.
//!
//! | route | does |
//! |---|---|
//! | `GET /` | the dashboard: one self-contained HTML page, a live view of `/status` (`dashboard.html`) |
//! | `GET /status` | JSON: vservers, services with state, weight, load, rates, slow start |
//! | `GET /metrics` | Prometheus text format ([`super::metrics`]) |
//! | `POST /services/{name}/disable` | OUT_OF_SERVICE: no new flows, established ones continue |
//! | `POST /services/{name}/enable` | back to the monitor's state (UP when unmonitored), ending a passive ejection |
//! | `PUT /vservers/{name}/slow-start` | body `{"new_service_request_rate": N}` (optionally with the configured `unit` / `increment_interval`) |
//! | `POST /vservers/{name}/route` | body a SIP request (http: a request head; tcp: first bytes, or query `sni=NAME` / `alpn=P1,P2`), query `source=IP:PORT` / `local=IP:PORT` optional: JSON `{rule, target, service}` from the running balancer ([`crate::simulate::route`]); 404 unknown vserver, 409 no routes, 400 not a request the rules route |
//! | `POST /reload` | re-read the config file; 200 with the changes, 400 invalid, 409 needs restart |
//! | `GET /healthz` | 200 `ok` while the proxy serves (liveness) |
//! | `GET /readyz` | 200 when it should get new traffic, else 503 with the reasons ([`crate::readiness`]) |
//!
//! A path is read as written: one with an empty segment (`//status`, `/services//disable`, a
//! trailing `/`) is an unknown path (404), never a spelling of a route ([`Path`]).
//!
//! With `admin.token` set every route but the two probes and the page needs
//! `Authorization: Bearer TOKEN` (compared in constant time), else 401. The probes are asked by
//! keepalived, BIRD or ExaBGP scripts, which hold no token, and say nothing but their verdict
//! (docs/deployment.md). A change sent by a browser from another site's page is refused (403)
//! before the token is looked at. The page holds no data: the browser loads it, asks the operator for
//! the token and sends it with every request of its own.

use crate::config::{Protocol, RateUnit};
use crate::ops::{Ops, ReloadError};
use crate::readiness::Readiness;
use serde_json::{Value, json};

/// An HTTP request as the router sees it.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub method: String,
    /// Path without query string.
    pub path: String,
    /// The query string (after `?`), if any.
    pub query: Option<String>,
    /// Value of the `Authorization` header.
    pub authorization: Option<String>,
    /// Values of the `Origin` and `Host` headers: a browser names the page that sent a
    /// request in `Origin` (RFC 6454 section 7).
    pub origin: Option<String>,
    pub host: Option<String>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn new(method: &str, path: &str) -> Request {
        Request {
            method: method.to_owned(),
            path: path.to_owned(),
            ..Request::default()
        }
    }

    pub fn bearer(mut self, token: &str) -> Request {
        self.authorization = Some(format!("Bearer {token}"));
        self
    }

    /// As a browser sends it from a page of `origin` to the server named `host`.
    pub fn from_page(mut self, origin: &str, host: &str) -> Request {
        self.origin = Some(origin.to_owned());
        self.host = Some(host.to_owned());
        self
    }

    pub fn body(mut self, body: &str) -> Request {
        self.body = body.as_bytes().to_vec();
        self
    }

    pub fn query(mut self, query: &str) -> Request {
        self.query = Some(query.to_owned());
        self
    }
}

/// The response to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Response {
    fn json(status: u16, v: &Value) -> Response {
        Response {
            status,
            content_type: "application/json",
            body: format!("{v}\n"),
        }
    }

    fn error(status: u16, msg: &str) -> Response {
        Response::json(status, &json!({ "error": msg }))
    }

    fn text(status: u16, body: &str) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: format!("{body}\n"),
        }
    }
}

/// Equal strings, in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn authorized(expected: Option<&str>, header: Option<&str>) -> bool {
    let Some(expected) = expected else {
        return true;
    };
    let Some(given) = header.and_then(|h| {
        let (scheme, rest) = h.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then_some(rest.trim())
    }) else {
        return false;
    };
    constant_time_eq(given.as_bytes(), expected.as_bytes())
}

/// The dashboard page, embedded at build time.
pub const DASHBOARD_HTML: &str = include_str!("dashboard.html");

/// Answer one request.
pub fn handle(ops: &Ops, req: &Request) -> Response {
    let path = parse_path(&req.path);
    if let Some(r) = probe(ops, req, &path) {
        return r;
    }
    if matches!(&path, Path::Segments(s) if s.is_empty()) {
        return dashboard(&req.method);
    }
    if is_cross_site_change(req) {
        return Response::error(403, "a change from another site's page is refused");
    }
    if !authorized(ops.token().as_deref(), req.authorization.as_deref()) {
        let mut r = Response::error(401, "missing or wrong bearer token");
        r.content_type = "application/json";
        return r;
    }
    // An unknown path goes on as one with no segments, which no route below matches (the
    // dashboard, which has none, was answered above): a 404 like any other unknown path.
    let segs: Vec<&str> = match &path {
        Path::Segments(s) => s.iter().map(String::as_str).collect(),
        Path::Unknown => Vec::new(),
        Path::BadEncoding => return Response::error(400, "bad percent-encoding in the path"),
    };
    // During a graceful stop every service is draining: nothing may bring one back.
    if ops.is_draining() && matches!(req.method.as_str(), "POST" | "PUT") {
        return Response::error(503, "the proxy is shutting down");
    }
    match (req.method.as_str(), segs.as_slice()) {
        ("GET", ["status"]) => Response::json(200, &status(ops)),
        ("GET", ["metrics"]) => Response {
            status: 200,
            content_type: "text/plain; version=0.0.4",
            body: super::metrics::render(ops),
        },
        ("POST", ["services", name, action @ ("disable" | "enable")]) => {
            let disable = *action == "disable";
            if ops.set_disabled(name, disable) {
                Response::json(
                    200,
                    &json!({ "service": name, "state": if disable { "OUT_OF_SERVICE" } else { "enabled" } }),
                )
            } else {
                Response::error(404, &format!("no service `{name}`"))
            }
        }
        ("PUT", ["vservers", name, "slow-start"]) => slow_start(ops, name, &req.body),
        ("POST", ["vservers", name, "route"]) => {
            route_request(ops, name, req.query.as_deref(), &req.body)
        }
        ("GET", ["vservers", name, "flow", proto, src, dst, ports @ ..]) => {
            packet_flow(ops, name, proto, src, dst, ports)
        }
        ("GET", ["bans"]) => {
            let bans: Vec<Value> = ops
                .bans()
                .into_iter()
                .map(|(v, ip, left)| json!({ "vserver": v, "source": ip.to_string(), "remaining_s": left }))
                .collect();
            Response::json(200, &json!({ "bans": bans }))
        }
        ("DELETE", ["bans", ip]) => match ip.parse::<std::net::IpAddr>() {
            Ok(ip) => {
                let lifted = ops.unban(ip);
                if lifted.is_empty() {
                    Response::error(404, &format!("{ip} is not banned"))
                } else {
                    Response::json(
                        200,
                        &json!({ "source": ip.to_string(), "lifted_in": lifted }),
                    )
                }
            }
            Err(_) => Response::error(400, &format!("`{ip}` is not an IP address")),
        },
        ("POST", ["reload"]) => match ops.reload() {
            Ok(changes) => Response::json(200, &json!({ "reloaded": true, "changes": changes })),
            Err(e @ ReloadError::NeedsRestart(_)) => Response::error(409, &e.to_string()),
            Err(e @ ReloadError::Invalid(_)) => Response::error(400, &e.to_string()),
            Err(e) => Response::error(503, &e.to_string()),
        },
        (_, ["status" | "metrics" | "reload"])
        | (_, ["services", _, "disable" | "enable"])
        | (_, ["vservers", _, "slow-start" | "route"])
        | (_, ["bans"])
        | (_, ["bans", _]) => Response::error(405, "method not allowed"),
        _ => Response::error(404, "no such endpoint"),
    }
}

/// A vserver's edge protection in `/status`: drops by reason, bans.
fn edge_status(e: &crate::edge::Edge, now: u64) -> Value {
    let c = e.counters();
    let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    json!({
        "dropped": { "acl": n(&c.acl), "flood": n(&c.flood) },
        "bans_total": n(&c.bans),
        "banned_now": e.bans(now).len(),
        "flood_untracked": n(&c.untracked),
        "flood_memory_bytes": e.flood_memory_bytes(),
    })
}

/// A service's passive ejection in `/status` (docs/ejection.md): `phase` is `null` while it
/// serves, else `ejected` (`remaining_s` left) or `half_open` (one trial flow at a time);
/// `reason` is the cause of the failure that ejected it.
fn ejection_status(e: &crate::eject::EjectStatus) -> Value {
    let phase = e.phase.map(|p| match p {
        crate::eject::Phase::HalfOpen { .. } => "half_open",
        _ => "ejected",
    });
    json!({
        "phase": phase,
        "reason": e.reason.map(crate::eject::Cause::name),
        "remaining_s": e.remaining_ns as f64 / 1e9,
        "consecutive_failures": e.consecutive_failures,
        "ejections_total": e.ejections,
    })
}

/// The handshakes toward a service reached over TLS, in `/status`: completed, failed by
/// reason (every reason listed), and the service's renegotiations refused.
fn handshakes_status(c: &crate::tls::HandshakeCounters) -> Value {
    let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let failures: serde_json::Map<String, Value> = crate::tls::Reason::ALL
        .iter()
        .map(|r| (r.name().to_owned(), json!(n(c.failed(*r)))))
        .collect();
    json!({
        "handshakes": n(&c.completed),
        "handshake_failures": failures,
        "renegotiations_refused": n(&c.renegotiations_refused),
    })
}

/// `/healthz` and `/readyz`, answered before the token check; `None` for any other path.
fn probe(ops: &Ops, req: &Request, path: &Path) -> Option<Response> {
    let Path::Segments(segs) = path else {
        return None;
    };
    let [route] = segs.as_slice() else {
        return None;
    };
    if !matches!(route.as_str(), "healthz" | "readyz") {
        return None;
    }
    if req.method != "GET" {
        return Some(Response::error(405, "method not allowed"));
    }
    Some(if route == "healthz" {
        healthz(ops.is_serving())
    } else {
        readyz(&ops.readiness())
    })
}

/// A change (any method but GET and HEAD) a browser sends from a page of another origin than
/// this server: a form on any web site can POST to a loopback admin API (cross-site request
/// forgery), and without a token nothing else would stop it. Tools that are not browsers send
/// no `Origin`; the dashboard's own requests carry this server's.
fn is_cross_site_change(req: &Request) -> bool {
    if matches!(req.method.as_str(), "GET" | "HEAD") {
        return false;
    }
    let Some(origin) = req.origin.as_deref() else {
        return false;
    };
    let own = req.host.as_deref().is_some_and(|host| {
        ["http://", "https://"]
            .iter()
            .any(|scheme| origin.strip_prefix(scheme) == Some(host))
    });
    !own
}

fn dashboard(method: &str) -> Response {
    if method != "GET" {
        return Response::error(405, "method not allowed");
    }
    Response {
        status: 200,
        content_type: "text/html; charset=utf-8",
        body: DASHBOARD_HTML.to_owned(),
    }
}

fn healthz(is_serving: bool) -> Response {
    if is_serving {
        Response::text(200, "ok")
    } else {
        Response::text(503, "stopped")
    }
}

fn readyz(r: &Readiness) -> Response {
    match r {
        Readiness::Ready => Response::json(200, &json!({ "ready": true })),
        Readiness::ReadyWith(notes) => {
            Response::json(200, &json!({ "ready": true, "notes": notes }))
        }
        Readiness::NotReady(reasons) => {
            Response::json(503, &json!({ "ready": false, "reasons": reasons }))
        }
    }
}

/// `seg` with its `%XX` escapes decoded; `None` when an escape is malformed or the result is
/// not UTF-8.
/// A request path as the routes read it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Path {
    /// Its segments, percent-decoded (RFC 3986 section 2.1), so that
    /// `curl .../services/my%20svc/disable` reaches the service `my svc`; none for `/`.
    Segments(Vec<String>),
    /// A path with an empty segment (`//status`, `/services//disable`, `/status/`), or one
    /// that does not start with `/`: no route has one, and none is read as if it were a
    /// route's spelling (RFC 3986 section 3.3 makes `/a//b` and `/a/b` different paths).
    Unknown,
    /// A segment with a broken `%` escape.
    BadEncoding,
}

/// The [`Path`] of `path` (without its query string).
fn parse_path(path: &str) -> Path {
    let Some(rest) = path.strip_prefix('/') else {
        return Path::Unknown;
    };
    if rest.is_empty() {
        return Path::Segments(Vec::new());
    }
    let mut segs = Vec::new();
    for raw in rest.split('/') {
        if raw.is_empty() {
            return Path::Unknown;
        }
        match percent_decode(raw) {
            Some(s) => segs.push(s),
            None => return Path::BadEncoding,
        }
    }
    Path::Segments(segs)
}

fn percent_decode(seg: &str) -> Option<String> {
    let bytes = seg.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn slow_start(ops: &Ops, name: &str, body: &[u8]) -> Response {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Response::error(400, "body must be JSON: {\"new_service_request_rate\": N}");
    };
    let Some(rate) = v
        .get("new_service_request_rate")
        .and_then(Value::as_u64)
        .and_then(|r| u32::try_from(r).ok())
    else {
        return Response::error(
            400,
            "new_service_request_rate: a non-negative integer is required",
        );
    };
    let cfg = ops.config();
    let Some(vs) = cfg.vservers.iter().find(|v| v.name == name) else {
        return Response::error(404, &format!("no vserver `{name}`"));
    };
    // The vserver's slow start and its rules' pools' (a rule may have one of its own where
    // the vserver has none): the rate applies to each.
    let configured: Vec<_> = vs
        .slow_start
        .iter()
        .chain(vs.route_pools.iter().filter_map(|p| p.slow_start.as_ref()))
        .filter(|s| s.new_service_request_rate > 0)
        .copied()
        .collect();
    if configured.is_empty() {
        return Response::error(
            409,
            &format!("vserver `{name}` has no slow start configured"),
        );
    }
    // `unit` and `increment_interval` may be given only as the configured values, written as
    // the config file writes them.
    if let Some(u) = v.get("unit") {
        let Some(u) = u.as_str().filter(|u| ["per_second", "percent"].contains(u)) else {
            return Response::error(400, "unit: `per_second` or `percent` is required");
        };
        if configured.iter().any(|p| u != unit_name(p.unit)) {
            return Response::error(409, "changing the unit needs a config change and a restart");
        }
    }
    if let Some(i) = v.get("increment_interval") {
        let given = match i {
            Value::String(s) => crate::config::parse_duration(s),
            Value::Number(n) => n.as_u64().map(std::time::Duration::from_secs),
            _ => None,
        };
        let Some(given) = given else {
            return Response::error(
                400,
                "increment_interval: a duration such as `10s` (or whole seconds) is required",
            );
        };
        if configured.iter().any(|p| given != p.increment_interval) {
            return Response::error(
                409,
                "changing increment_interval needs a config change and a restart",
            );
        }
    }
    match ops.set_slow_start_rate(name, rate) {
        Some(true) => Response::json(
            200,
            &json!({ "vserver": name, "new_service_request_rate": rate }),
        ),
        Some(false) => Response::error(409, &format!("vserver `{name}` has no slow start")),
        None => Response::error(404, &format!("no vserver `{name}`")),
    }
}

/// The `/status` document.
pub fn status(ops: &Ops) -> Value {
    let health = ops.health();
    let cfg = ops.config();
    // Monitor holds run on the health board's clock.
    let health_now = health.now();
    let vservers = ops
        .with_vservers(|vs, now| {
            vs.iter()
                .enumerate()
                .map(|(vi, v)| {
                    let b = v.balancer();
                    let slow = b.slow_start();
                    let service_tls = v.service_tls();
                    let services: Vec<Value> = b
                        .members()
                        .iter()
                        .enumerate()
                        .map(|(mi, m)| {
                            let c = b.counters(mi);
                            let rec = health.service(&m.name);
                            let monitor = rec.as_ref().and_then(|r| r.monitor()).map(|(name, phase)| {
                                json!({
                                    "name": name,
                                    "state": phase.name(),
                                    "probes_ok": r_load(&rec, |r| r.probes_ok.load(std::sync::atomic::Ordering::Relaxed)),
                                    "probes_failed": r_load(&rec, |r| r.probes_failed.load(std::sync::atomic::Ordering::Relaxed)),
                                    "local_errors": r_load(&rec, |r| r.local_errors.load(std::sync::atomic::Ordering::Relaxed)),
                                    "response_time_us": c.and_then(|c| c.monitor_response_time_us()),
                                    "hold": rec.as_ref().and_then(|r| r.hold(health_now)).map(|h| hold_status(&h, health_now)),
                                })
                            });
                            let ss = slow.as_ref().and_then(|s| s.status(mi)).map(|s| {
                                json!({
                                    "phase": if slow.as_ref().is_some_and(|x| x.is_manual()) { "manual" } else { "automatic" },
                                    "rate": s.rate,
                                    "unit": unit_name(s.unit),
                                    "increases": s.increases,
                                    "since_s": now.saturating_sub(s.since) as f64 / 1e9,
                                })
                            });
                            let health = b.health(mi).map_or("?", |h| h.name());
                            // Removed by a reload, kept for its flows (`active`) until they
                            // end or the drain deadline.
                            let drain = ops.drain_of(&v.name, &m.name).filter(|_| b.is_draining(mi)).map(|(since, until)| {
                                json!({
                                    "since_s": now.saturating_sub(since) as f64 / 1e9,
                                    "deadline_in_s": until.saturating_sub(now) as f64 / 1e9,
                                })
                            });
                            json!({
                                "name": m.name,
                                "state": b.state_name(mi, now),
                                "health": health,
                                "draining": drain,
                                "ejection": b.ejection(mi, now).map(|e| ejection_status(&e)),
                                "weight": m.weight,
                                "tier": m.tier_name(),
                                "active": c.map_or(0, |c| c.active()),
                                "pending": c.map_or(0, |c| c.pending()),
                                "requests_total": c.map_or(0, |c| c.requests_total()),
                                "requests_per_s": ops.request_rate(vi, mi),
                                "reported_load": c.and_then(|c| c.reported_load()),
                                "monitor": monitor,
                                "slow_start": ss,
                                "tls": service_tls.iter().find(|(n, _)| *n == m.name).map(|(_, c)| handshakes_status(c)),
                            })
                        })
                        .collect();
                    json!({
                        "name": v.name,
                        "protocol": v.protocol.name(),
                        "bound": v.bound.iter().map(ToString::to_string).collect::<Vec<_>>(),
                        "method": b.method().name(),
                        "slow_start": slow.as_ref().map(|s| json!({
                            "new_service_request_rate": s.rate(),
                            "manual": s.is_manual(),
                            "active": s.is_active(),
                        })),
                        "services": services,
                        "edge": edge_status(v.data.edge(), now),
                        "admission": v.data.gate().map(|g| json!({
                            "max_per_source": g.sources().max(),
                            "sources": g.sources().sources(),
                            "refused": g.refusals().iter().map(|(r, n)| (r.name().to_owned(), json!(n))).collect::<serde_json::Map<_, _>>(),
                        })),
                        "packet": packet_status(v),
                        "routes": routes_status(b, cfg.vservers.iter().find(|c| c.name == v.name)),
                        "eject": b.eject_params().map(|p| json!({
                            "after": p.after,
                            "base_s": p.base_ns as f64 / 1e9,
                            "max_s": p.max_ns as f64 / 1e9,
                            "max_fraction": f64::from(p.max_fraction_e4) / 1e4,
                            "refused_total": b.ejections_refused(),
                        })),
                    })
                })
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let not_started: Vec<Value> = ops
        .not_started()
        .into_iter()
        .map(|(name, reason)| json!({ "name": name, "reason": reason }))
        .collect();
    json!({
        "vservers": vservers,
        // Vservers of the config that did not start, and why (docs/firewall.md).
        "not_started": not_started,
        "open_files": files_status(ops),
        "flow_tokens": flow_tokens_status(ops),
        "dns": dns_status(ops),
        "capture": capture_status(ops),
    })
}

/// `/status` `routes` of a SIP vserver with routing rules (docs/routing.md): each rule in
/// order, then the default, with what it does (its pool's services and method, or its
/// refusal) and what it decided; `null` without rules.
fn routes_status(
    b: &crate::balancer::Balancer,
    config: Option<&crate::config::Vserver>,
) -> Option<Value> {
    use crate::route::Target;
    use std::sync::atomic::Ordering::Relaxed;
    let routes = b.routes()?;
    let entry = |i: usize, name: &str, target: &Target| {
        let c = b.route_counters(i);
        let n = |f: fn(&crate::balancer::RouteCounters) -> &std::sync::atomic::AtomicU64| {
            c.map_or(0, |c| f(c).load(Relaxed))
        };
        let mut e = json!({
            "name": name,
            "matched": n(|c| &c.matched),
            "rejected": n(|c| &c.rejected),
            "dropped": n(|c| &c.dropped),
            "unavailable": n(|c| &c.unavailable),
        });
        let what = match target {
            Target::Pool(p) => {
                // A rule's pool (pool 0 is the vserver's own) has its own fields, each the
                // vserver's where the rule gives none (docs/routing.md).
                let own = p.checked_sub(1).and_then(|k| config?.route_pools.get(k));
                let failover = match own {
                    Some(pool) => pool.failover.as_ref(),
                    None => config.and_then(|v| v.failover.as_ref()),
                };
                json!({
                    "action": "pool",
                    "method": b.pool_method(*p).name(),
                    "services": b.pool_members(*p).iter().filter_map(|&m| b.members().get(m)).map(|m| m.name.clone()).collect::<Vec<_>>(),
                    "hash_length": b.pool_hash(*p).hash_length,
                    "slow_start": b.pool_slow_start(*p).map(|s| json!({
                        "new_service_request_rate": s.rate(),
                        "manual": s.is_manual(),
                        "active": s.is_active(),
                    })),
                    "failover": failover.map(|f| json!({ "codes": f.codes, "tries": f.tries })),
                })
            }
            Target::Reject { code, reason } => {
                json!({ "action": "reject", "code": code, "reason": reason })
            }
            Target::Drop => json!({ "action": "drop" }),
        };
        if let (Some(e), Value::Object(w)) = (e.as_object_mut(), what) {
            e.extend(w);
        }
        e
    };
    let rules: Vec<Value> = routes
        .rules
        .iter()
        .enumerate()
        .map(|(i, r)| entry(i, &r.name, &r.target))
        .collect();
    Some(json!({
        "rules": rules,
        "default": entry(routes.rules.len(), "default", &routes.default),
    }))
}

/// `/status` of a packet vserver (docs/firewall.md): its interfaces, each firewall leg's
/// share of the bucket table and what it forwarded, what went to the stack and what was
/// dropped, as last read from the kernel (every second).
fn packet_status(v: &crate::proxy::VserverHandle) -> Option<Value> {
    use std::sync::atomic::Ordering::Relaxed;
    let p = v
        .data
        .as_any()
        .downcast_ref::<crate::proxy::packet::PacketPath>()?;
    let table = p.table();
    let c = p.counters();
    let forwarded = p.forwarded();
    let legs: Vec<Value> = p
        .legs()
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let slot = i as u32 + 1;
            let (packets, bytes) = forwarded.get(i).copied().unwrap_or_default();
            json!({
                "name": name,
                "buckets": table.iter().filter(|&&s| s == slot).count(),
                "packets": packets,
                "bytes": bytes,
            })
        })
        .collect();
    Some(json!({
        "interfaces": p.interfaces(),
        "buckets": table.len(),
        "legs": legs,
        "passed": crate::packet::PassReason::ALL
            .iter()
            .zip(&c.passed)
            .map(|(r, n)| (r.name().to_owned(), json!(n.load(Relaxed))))
            .collect::<serde_json::Map<_, _>>(),
        "dropped": {
            "no_firewall": c.dropped_no_firewall.load(Relaxed),
            "no_next_hop": c.dropped_no_next_hop.load(Relaxed),
        },
        "tables_installed": c.tables.load(Relaxed),
    }))
}

/// `GET /vservers/NAME/flow/PROTO/SRC/DST[/SPORT/DPORT]`: which firewall packet vserver
/// NAME sends that flow to now, and its reply, by the live bucket table and the program's
/// twin (docs/firewall.md).
fn packet_flow(
    ops: &Ops,
    name: &str,
    proto: &str,
    src: &str,
    dst: &str,
    ports: &[&str],
) -> Response {
    let (Ok(src), Ok(dst)) = (
        src.parse::<std::net::IpAddr>(),
        dst.parse::<std::net::IpAddr>(),
    ) else {
        return Response::error(400, "source and destination must be IP addresses");
    };
    let ports = match ports {
        [] => None,
        [s, d] => match (s.parse::<u16>(), d.parse::<u16>()) {
            (Ok(s), Ok(d)) => Some((s, d)),
            _ => return Response::error(400, "ports must be numbers 0..=65535"),
        },
        _ => return Response::error(400, "ports are /SPORT/DPORT"),
    };
    let q = match crate::simulate::flow::FlowQuery::parse(proto, src, dst, ports) {
        Ok(q) => q,
        Err(e) => return Response::error(400, &e),
    };
    let answer = ops.with_vservers(|vs, _| {
        let v = vs.iter().find(|v| v.name == name)?;
        let p = v
            .data
            .as_any()
            .downcast_ref::<crate::proxy::packet::PacketPath>()?;
        let (path, table, legs) = (p.path_config(), p.table(), p.legs());
        Some(json!({
            "vserver": name,
            "forward": crate::simulate::flow::choice(&path, &table, &legs, &q),
            "reply": crate::simulate::flow::choice(&path, &table, &legs, &q.reply()),
        }))
    });
    match answer.flatten() {
        Some(a) => Response::json(200, &a),
        None => Response::error(404, &format!("no packet vserver `{name}` running")),
    }
}

/// `POST /vservers/{name}/route`: what the vserver's rules decide for the SIP request in
/// `body`, and the service its pool would choose now, from a snapshot of the running balancer
/// (actual health, load and positions; the question moves nothing). `source` and `local`
/// default to the request's top Via and the vserver's first bound address.
fn route_request(ops: &Ops, name: &str, query: Option<&str>, body: &[u8]) -> Response {
    use crate::simulate::route as r;
    let (mut source, mut local) = (None, None);
    let (mut sni, mut alpn): (Option<String>, Vec<Vec<u8>>) = (None, Vec::new());
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match k {
            "source" => &mut source,
            "local" => &mut local,
            "sni" | "alpn" => {
                let Some(v) = percent_decode(v).filter(|v| !v.is_empty()) else {
                    return Response::error(400, &format!("{k}: a value is required"));
                };
                if k == "sni" {
                    sni = Some(v);
                } else {
                    alpn = v.split(',').map(|p| p.trim().as_bytes().to_vec()).collect();
                }
                continue;
            }
            _ => return Response::error(400, &format!("unknown query parameter `{k}`")),
        };
        match percent_decode(v).and_then(|v| v.parse::<std::net::SocketAddr>().ok()) {
            Some(a) => *slot = Some(a),
            None => {
                return Response::error(
                    400,
                    &format!("{k}: IP:PORT is required (IPv6 as [ADDR]:PORT)"),
                );
            }
        }
    }
    let answer = ops.with_vservers(|vs, now| {
        let Some(v) = vs.iter().find(|v| v.name == name) else {
            return Response::error(404, &format!("no vserver `{name}`"));
        };
        if v.balancer().routes().is_none() {
            return Response::error(409, &format!("vserver `{name}` has no routes"));
        }
        if matches!(v.protocol, Protocol::Tcp | Protocol::Http) {
            return route_connection(ops, v, (body, sni.as_deref(), &alpn), (source, local), now);
        }
        if sni.is_some() || !alpn.is_empty() {
            return Response::error(400, "sni and alpn describe TLS on tcp vservers");
        }
        let bytes = r::normalize_message(body);
        let msg = match r::scan_request(&bytes) {
            Ok(m) => m,
            Err(e) => return Response::error(400, &e.to_string()),
        };
        let src = source.unwrap_or_else(|| r::default_source(&msg));
        let Some(local) = local.or_else(|| v.bound.first().copied()) else {
            return Response::error(400, "local: IP:PORT is required (the vserver binds none)");
        };
        let live = v.balancer().snapshot();
        match r::decide(&live, name, &msg, src, local, now) {
            Ok(a) => {
                let mut out = serde_json::to_value(&a).unwrap_or(Value::Null);
                if let Some(o) = out.as_object_mut() {
                    o.insert("vserver".into(), json!(name));
                    o.insert("source".into(), json!(src.to_string()));
                    o.insert("local".into(), json!(local.to_string()));
                }
                Response::json(200, &out)
            }
            Err(e @ r::RouteError::NoRoutes(_)) => Response::error(409, &e.to_string()),
            Err(e) => Response::error(400, &e.to_string()),
        }
    });
    answer.unwrap_or_else(|| Response::error(503, "the proxy is not running"))
}

/// [`route_request`] for a `tcp` or `http` vserver: `body` is the connection's first bytes (an
/// HTTP request head; a ClientHello), or `sni` / `alpn` stand for TLS's names. `source`
/// defaults to the unspecified address.
fn route_connection(
    ops: &Ops,
    v: &crate::proxy::VserverHandle,
    (body, sni, alpn): (&[u8], Option<&str>, &[Vec<u8>]),
    (source, local): (Option<std::net::SocketAddr>, Option<std::net::SocketAddr>),
    now: crate::stats::Nanos,
) -> Response {
    use crate::simulate::route as r;
    if (sni.is_some() || !alpn.is_empty()) && v.protocol != Protocol::Tcp {
        return Response::error(400, "sni and alpn describe TLS on tcp vservers");
    }
    let config = ops.config();
    let Some(vs) = config.vservers.iter().find(|c| c.name == v.name) else {
        return Response::error(404, &format!("no vserver `{}`", v.name));
    };
    let first = if v.protocol == Protocol::Http {
        r::normalize_message(body)
    } else {
        body.to_vec()
    };
    let handshake = (sni.is_some() || !alpn.is_empty()).then_some(crate::core::tcp::Handshake {
        sni: sni.map(str::as_bytes),
        alpn,
    });
    let src = source.unwrap_or_else(|| std::net::SocketAddr::from(([0, 0, 0, 0], 0)));
    let Some(local) = local.or_else(|| v.bound.first().copied()) else {
        return Response::error(400, "local: IP:PORT is required (the vserver binds none)");
    };
    let keys = crate::core::tcp::ConnectionKeys::new(vs);
    let live = v.balancer().snapshot();
    match r::decide_connection(&live, &keys, &v.name, &first, handshake, (src, local), now) {
        Ok(a) => {
            let mut out = serde_json::to_value(&a).unwrap_or(Value::Null);
            if let Some(o) = out.as_object_mut() {
                o.insert("vserver".into(), json!(v.name));
                o.insert("source".into(), json!(src.to_string()));
                o.insert("local".into(), json!(local.to_string()));
            }
            Response::json(200, &out)
        }
        Err(e @ r::RouteError::NoRoutes(_)) => Response::error(409, &e.to_string()),
        Err(e) => Response::error(400, &e.to_string()),
    }
}

/// `/status` `capture`: the HEP collector, `null` when capture is off (docs/capture.md).
fn capture_status(ops: &Ops) -> Option<Value> {
    use std::sync::atomic::Ordering::Relaxed;
    let c = ops.capture()?;
    let config = c.config()?;
    let s = c.stats();
    let dropped: serde_json::Map<String, Value> = s
        .dropped()
        .iter()
        .map(|(r, n)| ((*r).to_owned(), json!(n)))
        .collect();
    Some(json!({
        "address": config.address.to_string(),
        "transport": match config.transport {
            crate::config::CaptureTransport::Udp => "udp",
            crate::config::CaptureTransport::Tcp => "tcp",
        },
        "id": config.id,
        "connected": c.is_connected(),
        "sent": s.sent.load(Relaxed),
        "dropped": dropped,
    }))
}

/// `/status` `open_files`: the file budget ([`crate::budget`]).
fn files_status(ops: &Ops) -> Option<Value> {
    ops.budget().map(|b| {
        json!({
            "limit": b.limit(),
            "reserve": b.reserve(),
            "pool": b.pool(),
            "used": b.used(),
            "refused": b.refused.load(std::sync::atomic::Ordering::Relaxed),
        })
    })
}

/// `/status` `flow_tokens`: whether flow tokens outlive this process.
fn flow_tokens_status(ops: &Ops) -> Value {
    let keys = crate::proxy::flows::keys_for(&ops.config());
    json!({
        "keys": if keys.ephemeral { "own" } else { "flow_key_file" },
        "note": keys.ephemeral.then_some(
            "no flow_key_file: flow tokens are signed with this process's own random key and are not honoured after a restart or by another instance",
        ),
    })
}

/// `/status` `dns`: each pool published in DNS and what its lookups said.
fn dns_status(ops: &Ops) -> Vec<Value> {
    let now = ops.with_vservers(|_, now| now).unwrap_or(0);
    let secs = |t: u64| now.saturating_sub(t) as f64 / 1e9;
    ops
        .pools()
        .by_service
        .iter()
        .map(|(service, p)| {
            json!({
                "service": service,
                "name": p.dns.name.trim_end_matches('.'),
                "type": match p.dns.kind {
                    crate::config::DnsKind::Srv => "SRV",
                    crate::config::DnsKind::Host { .. } => "A/AAAA",
                },
                "members": p.members.iter().map(|t| json!({
                    "name": crate::discovery::member_name(service, t.addr),
                    "address": t.addr.to_string(),
                    "priority": t.priority,
                    "weight": t.weight,
                })).collect::<Vec<_>>(),
                "answered": p.answered,
                "last_answer_s_ago": p.last_answer.map(secs),
                "stale": p.is_stale(),
                "failing_for_s": p.failing_since.map(secs),
                "last_error": p.last_error,
                "next_lookup_in_s": p.next.saturating_sub(now) as f64 / 1e9,
                "lookups": { "found": p.lookups.found, "empty": p.lookups.empty, "failed": p.lookups.failed },
            })
        })
        .collect()
}

/// A monitor's hold: the service said 503 with Retry-After (RFC 3261 §21.5.4) and stays
/// DOWN for `remaining_s` more (the Retry-After, capped).
fn hold_status(h: &crate::health::Hold, now: u64) -> Value {
    json!({
        "reason": "retry_after",
        "retry_after_s": h.retry_after_s,
        "remaining_s": h.remaining(now) as f64 / 1e9,
    })
}

fn r_load(
    rec: &Option<std::sync::Arc<crate::health::ServiceHealth>>,
    f: impl Fn(&crate::health::ServiceHealth) -> u64,
) -> u64 {
    rec.as_deref().map_or(0, f)
}

fn unit_name(u: RateUnit) -> &'static str {
    match u {
        RateUnit::PerSecond => "per_second",
        RateUnit::Percent => "percent",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_check() {
        assert!(authorized(None, None));
        assert!(!authorized(Some("s3cret"), None));
        assert!(!authorized(Some("s3cret"), Some("Bearer nope")));
        assert!(!authorized(Some("s3cret"), Some("Basic s3cret")));
        assert!(authorized(Some("s3cret"), Some("Bearer s3cret")));
        assert!(authorized(Some("s3cret"), Some("bearer  s3cret ")));
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"a", b"ab"));
    }

    #[test]
    fn probes_render_their_verdict_only() {
        assert_eq!(healthz(true), Response::text(200, "ok"));
        assert_eq!(healthz(false).status, 503);
        let ok = readyz(&Readiness::Ready);
        assert_eq!((ok.status, ok.body.as_str()), (200, "{\"ready\":true}\n"));
        let noted = readyz(&Readiness::Ready.with_notes(vec!["service p: stale".to_owned()]));
        assert_eq!(noted.status, 200);
        let body: Value = serde_json::from_str(&noted.body).expect("JSON");
        assert_eq!(
            body,
            json!({ "ready": true, "notes": ["service p: stale"] })
        );
        let no = readyz(&Readiness::NotReady(vec![
            "draining".to_owned(),
            "vserver v: no usable service".to_owned(),
        ]));
        assert_eq!(no.status, 503);
        let body: Value = serde_json::from_str(&no.body).expect("JSON");
        assert_eq!(
            body,
            json!({ "ready": false, "reasons": ["draining", "vserver v: no usable service"] })
        );
    }

    #[test]
    fn changes_from_other_sites_pages_are_told_apart() {
        let post = Request::new("POST", "/services/s/disable");
        assert!(!is_cross_site_change(&post), "curl: no Origin");
        let own = post
            .clone()
            .from_page("http://127.0.0.1:9090", "127.0.0.1:9090");
        assert!(!is_cross_site_change(&own));
        for (origin, host) in [
            ("https://evil.example", "127.0.0.1:9090"),
            ("null", "127.0.0.1:9090"),
            ("http://127.0.0.1:9091", "127.0.0.1:9090"),
            ("http://127.0.0.1:9090.evil.example", "127.0.0.1:9090"),
        ] {
            let r = post.clone().from_page(origin, host);
            assert!(is_cross_site_change(&r), "{origin}");
        }
        let read = Request::new("GET", "/status").from_page("https://evil.example", "x");
        assert!(
            !is_cross_site_change(&read),
            "reads are the token's and CORS's business"
        );
    }

    #[test]
    fn dashboard_is_one_self_contained_page() {
        let page = dashboard("GET");
        assert_eq!(
            (page.status, page.content_type),
            (200, "text/html; charset=utf-8")
        );
        assert!(page.body.starts_with("<!doctype html>"));
        // No asset from elsewhere: the admin API may run where nothing else is reachable.
        for outside in ["https://", "<link", " src=", "@import", "url("] {
            assert!(!page.body.contains(outside), "{outside}");
        }
        assert_eq!(dashboard("POST").status, 405);
    }

    #[test]
    fn a_path_with_an_empty_segment_is_unknown() {
        let segs = |v: &[&str]| Path::Segments(v.iter().map(|s| (*s).to_owned()).collect());
        assert_eq!(parse_path("/"), segs(&[]));
        assert_eq!(parse_path("/status"), segs(&["status"]));
        assert_eq!(
            parse_path("/services/my%20svc/disable"),
            segs(&["services", "my svc", "disable"])
        );
        for unknown in [
            "",
            "//",
            "//status",
            "//services/s/disable",
            "/services//disable",
            "/services/s//disable",
            "/services/s/disable/",
            "/status/",
            "/healthz/",
            "status",
            "*",
        ] {
            assert_eq!(parse_path(unknown), Path::Unknown, "{unknown:?}");
        }
        assert_eq!(parse_path("/services/s%zz/enable"), Path::BadEncoding);
    }

    #[test]
    fn path_segments_are_percent_decoded() {
        assert_eq!(percent_decode("sip1").as_deref(), Some("sip1"));
        assert_eq!(percent_decode("my%20svc").as_deref(), Some("my svc"));
        assert_eq!(
            percent_decode("we%22ird%5Cx").as_deref(),
            Some("we\"ird\\x")
        );
        assert_eq!(percent_decode("caf%C3%A9").as_deref(), Some("café"));
        for bad in ["%", "%2", "%zz", "%C3", "a%2"] {
            assert_eq!(percent_decode(bad), None, "{bad}");
        }
    }
}
