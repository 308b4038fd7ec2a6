//! Operations over loopback: monitors, admin API (through its router, and once over a
//! socket), disable/drain, reload, /metrics, and the binary's signals.
//! Synchronisation is by polling with deadlines, never by bare sleeps.

mod common;

use common::strict_uas::StrictUas;
use common::{ConfigFile, wait_for};
use fulcrum::admin::router::{self, Request};
use fulcrum::config;
use fulcrum::ops::Ops;
use fulcrum::peer::{Uac, Uas};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn any() -> SocketAddr {
    "127.0.0.1:0".parse().expect("addr")
}

fn yaml(ports: &[u16], token: &str, monitor: &str, slow: &str, method: &str) -> String {
    let mut y = format!(
        "admin: {{ listen: null, token: {token} }}\nmonitors:\n  - {{ name: ping, type: sip-options, {monitor} }}\nservices:\n"
    );
    for (i, p) in ports.iter().enumerate() {
        y.push_str(&format!(
            "  - {{ name: s{i}, address: 127.0.0.1:{p}, protocol: sip-udp, monitor: ping }}\n"
        ));
    }
    let names: Vec<String> = (0..ports.len()).map(|i| format!("s{i}")).collect();
    y.push_str(&format!(
        "vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [127.0.0.1:0]\n    method: {method}\n{slow}    workers: 1\n    services: [{}]\n",
        names.join(", ")
    ));
    y
}

/// Ops running `yaml` (see [`yaml`]), with no file to reload from.
fn start(yaml: &str) -> Arc<Ops> {
    let cfg = config::from_str("t.yaml", yaml).expect("valid");
    Ops::start(cfg, None).expect("start")
}

const FAST: &str = "interval: 300ms, timeout: 200ms, failures_to_down: 2, successes_to_up: 2";

fn get(ops: &Ops, path: &str) -> Value {
    let r = router::handle(ops, &Request::new("GET", path));
    assert_eq!(r.status, 200, "{path}: {}", r.body);
    serde_json::from_str(&r.body).expect("status is JSON")
}

fn service<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["vservers"][0]["services"]
        .as_array()
        .and_then(|s| s.iter().find(|x| x["name"] == name))
        .expect("service in status")
}

fn proxy_addr(ops: &Ops) -> SocketAddr {
    ops.with_vservers(|vs, _| vs[0].bound[0]).expect("running")
}

/// INVITE → 200 → ACK; returns the To tag.
fn establish(uac: &mut Uac, call_id: &str) -> String {
    let inv = uac.request("INVITE", call_id, 1, &format!("{call_id}i"), None);
    uac.send_raw(inv.as_bytes()).expect("send");
    let (code, to, _) = uac
        .final_response(Duration::from_secs(2))
        .expect("INVITE answered");
    assert_eq!(code, 200);
    let tag = to
        .split(";tag=")
        .nth(1)
        .map(|t| t.split(';').next().unwrap_or(t).to_owned())
        .expect("to tag");
    let ack = uac.request("ACK", call_id, 1, &format!("{call_id}a"), Some(&tag));
    uac.send_raw(ack.as_bytes()).expect("send");
    tag
}

fn bye(uac: &mut Uac, call_id: &str, tag: &str) -> u16 {
    let b = uac.request("BYE", call_id, 2, &format!("{call_id}b"), Some(tag));
    uac.send_raw(b.as_bytes()).expect("send");
    uac.final_response(Duration::from_secs(2))
        .expect("BYE answered")
        .0
}

#[test]
fn monitor_marks_down_then_up_with_slow_start() {
    let mut uas: Vec<Uas> = (0..2).map(|_| Uas::start(any()).expect("uas")).collect();
    let ports: Vec<u16> = uas.iter().map(|u| u.addr.port()).collect();
    let slow = "    slow_start: { new_service_request_rate: 5, unit: per_second, increment_interval: 0s }\n";
    let ops = start(&yaml(&ports, "null", FAST, slow, "round_robin"));
    wait_for("s1 confirmed UP", Duration::from_secs(5), || {
        (service(&get(&ops, "/status"), "s1")["monitor"]["state"] == "UP").then_some(())
    });

    uas[1].stop();
    let stopped = Instant::now();
    wait_for("s1 DOWN", Duration::from_secs(5), || {
        (service(&get(&ops, "/status"), "s1")["state"] == "DOWN").then_some(())
    });
    // interval × failures_to_down, + 1 interval, + scheduling slack on a shared machine.
    let bound = Duration::from_millis(300 * 2 + 300 + 400);
    assert!(
        stopped.elapsed() <= bound,
        "DOWN after {:?}, bound {bound:?}",
        stopped.elapsed()
    );
    assert_eq!(service(&get(&ops, "/status"), "s0")["state"], "UP");

    uas[1] = Uas::start(SocketAddr::from(([127, 0, 0, 1], ports[1]))).expect("restart");
    let back = wait_for("s1 UP again", Duration::from_secs(5), || {
        let st = get(&ops, "/status");
        (service(&st, "s1")["state"] == "UP").then_some(st)
    });
    let ss = &service(&back, "s1")["slow_start"];
    assert_eq!(ss["rate"], 5, "returning service is in slow start: {back}");
    assert_eq!(ss["phase"], "manual");
    assert!(service(&back, "s0")["slow_start"].is_null());

    // Manual slow start is driven through the admin API: rate 0 ends it.
    let r = router::handle(
        &ops,
        &Request::new("PUT", "/vservers/v/slow-start").body(r#"{"new_service_request_rate": 0}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(service(&get(&ops, "/status"), "s1")["slow_start"].is_null());
    let r = router::handle(
        &ops,
        &Request::new("PUT", "/vservers/v/slow-start")
            .body(r#"{"new_service_request_rate": 3, "unit": "percent"}"#),
    );
    assert_eq!(r.status, 409, "unit changes need a restart");
    // `unit` / `increment_interval` of the wrong kind are refused, not ignored; the configured
    // interval is accepted as the config writes it (`0s`, or whole seconds).
    for (body, status) in [
        (r#"{"new_service_request_rate": 3, "unit": 5}"#, 400),
        (
            r#"{"new_service_request_rate": 3, "increment_interval": true}"#,
            400,
        ),
        (
            r#"{"new_service_request_rate": 3, "increment_interval": 10}"#,
            409,
        ),
        (
            r#"{"new_service_request_rate": 3, "increment_interval": "10s"}"#,
            409,
        ),
        (
            r#"{"new_service_request_rate": 0, "increment_interval": 0}"#,
            200,
        ),
        (
            r#"{"new_service_request_rate": 0, "unit": "per_second", "increment_interval": "0s"}"#,
            200,
        ),
    ] {
        let r = router::handle(
            &ops,
            &Request::new("PUT", "/vservers/v/slow-start").body(body),
        );
        assert_eq!(r.status, status, "{body}: {}", r.body);
    }
    assert!(
        service(&back, "s1")["monitor"]["response_time_us"]
            .as_u64()
            .is_some()
    );
    ops.shutdown();
}

#[test]
fn disable_drains_established_calls() {
    let uas: Vec<StrictUas> = (0..2).map(|i| StrictUas::udp(&format!("s{i}"))).collect();
    let ports: Vec<u16> = uas.iter().map(|u| u.addr.port()).collect();
    let ops = start(&yaml(
        &ports,
        "null",
        "interval: 1s, timeout: 500ms, failures_to_down: 3, successes_to_up: 1",
        "",
        "call_id_hash",
    ));
    let mut uac = Uac::new(any(), proxy_addr(&ops), "drain").expect("uac");
    let tag = establish(&mut uac, "call-before");
    let owner = (0..2)
        .find(|&i| !uas[i].methods_of("call-before").is_empty())
        .expect("some service took the call");
    let other = 1 - owner;

    let r = router::handle(
        &ops,
        &Request::new("POST", &format!("/services/s{owner}/disable")),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        service(&get(&ops, "/status"), &format!("s{owner}"))["state"],
        "OUT_OF_SERVICE"
    );
    // New calls avoid the disabled service...
    for n in 0..10 {
        let id = format!("new-{n}");
        let t = establish(&mut uac, &id);
        assert!(
            uas[owner].methods_of(&id).is_empty(),
            "{id} went to the disabled service"
        );
        assert_eq!(bye(&mut uac, &id, &t), 200);
    }
    assert!(uas[other].counts().dialogs >= 10);
    // ...while the established call finishes where it started.
    assert_eq!(bye(&mut uac, "call-before", &tag), 200);
    assert_eq!(
        uas[owner].methods_of("call-before"),
        vec!["INVITE", "ACK", "BYE"]
    );
    for u in &uas {
        let c = u.counts();
        assert_eq!((c.r481, c.stray_acks), (0, 0), "{}: {c:?}", u.name);
    }
    let r = router::handle(
        &ops,
        &Request::new("POST", &format!("/services/s{owner}/enable")),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        service(&get(&ops, "/status"), &format!("s{owner}"))["state"],
        "UP"
    );
    assert_eq!(
        router::handle(&ops, &Request::new("POST", "/services/nope/disable")).status,
        404
    );
    // A path with an empty segment is an unknown path (404), not a spelling of a route.
    for path in [
        format!("//services/s{owner}/disable"),
        format!("/services//s{owner}/disable"),
        format!("/services/s{owner}//disable"),
        format!("/services/s{owner}/disable/"),
    ] {
        let r = router::handle(&ops, &Request::new("POST", &path));
        assert_eq!(r.status, 404, "{path}: {}", r.body);
    }
    assert_eq!(
        service(&get(&ops, "/status"), &format!("s{owner}"))["state"],
        "UP",
        "no disable went through"
    );
    // Names in the path are percent-decoded (`%73` is `s`); a broken escape is a 400.
    assert_eq!(
        router::handle(
            &ops,
            &Request::new("POST", &format!("/services/%73{owner}/enable"))
        )
        .status,
        200
    );
    assert_eq!(
        router::handle(&ops, &Request::new("POST", "/services/s%zz/enable")).status,
        400
    );
    ops.shutdown();
}

#[test]
fn admin_requires_the_token_when_set() {
    let uas = Uas::start(any()).expect("uas");
    let ops = start(&yaml(&[uas.addr.port()], "s3cret", FAST, "", "round_robin"));
    for (method, path) in [
        ("GET", "/status"),
        ("GET", "/metrics"),
        ("POST", "/services/s0/disable"),
        ("POST", "/reload"),
    ] {
        assert_eq!(
            router::handle(&ops, &Request::new(method, path)).status,
            401,
            "{path}"
        );
        assert_eq!(
            router::handle(&ops, &Request::new(method, path).bearer("wrong")).status,
            401,
            "{path}"
        );
    }
    assert_eq!(
        service(&get_with(&ops, "s3cret"), "s0")["state"],
        "UP",
        "the disable above was refused"
    );
    // `//healthz` is not the probe: an unknown path, behind the token like any other.
    assert_eq!(
        router::handle(&ops, &Request::new("GET", "//healthz")).status,
        401
    );
    assert_eq!(
        router::handle(&ops, &Request::new("GET", "//healthz").bearer("s3cret")).status,
        404
    );
    assert_eq!(
        router::handle(&ops, &Request::new("GET", "/healthz")).status,
        200
    );

    // Once over a real socket, to exercise the HTTP server around the router.
    let ops2 = Arc::clone(&ops);
    let (addr, _task) = ops
        .tokio()
        .block_on(fulcrum::admin::serve(ops2, any()))
        .expect("admin listener");
    assert!(http(addr, "GET /status HTTP/1.1\r\nHost: x\r\n\r\n").starts_with("HTTP/1.1 401"));
    let ok = http(
        addr,
        "GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n\r\n",
    );
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(ok.contains("\"vservers\""));
    ops.shutdown();
}

fn get_with(ops: &Ops, token: &str) -> Value {
    let r = router::handle(ops, &Request::new("GET", "/status").bearer(token));
    assert_eq!(r.status, 200);
    serde_json::from_str(&r.body).expect("json")
}

/// One request on its own connection, read to its end: the server keeps connections alive, so
/// the request asks it to close this one.
fn http(addr: SocketAddr, req: &str) -> String {
    use std::io::{Read, Write};
    let req = req.replacen("\r\n", "\r\nConnection: close\r\n", 1);
    let mut s = std::net::TcpStream::connect(addr).expect("connect admin");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    s.write_all(req.as_bytes()).expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn reload_adds_and_removes_services_keeping_established_calls() {
    let uas: Vec<StrictUas> = (0..3).map(|i| StrictUas::udp(&format!("s{i}"))).collect();
    let ports: Vec<u16> = uas.iter().map(|u| u.addr.port()).collect();
    let slow = "    slow_start: { new_service_request_rate: 5, unit: per_second, increment_interval: 0s }\n";
    let text = yaml(&ports[..2], "null", FAST, slow, "round_robin");
    let file = ConfigFile::new("reload", &text);
    let path = file.path.clone();
    let ops = Ops::start(config::load(&path).expect("valid"), Some(path.clone())).expect("start");
    let mut uac = Uac::new(any(), proxy_addr(&ops), "reload").expect("uac");
    let tag = establish(&mut uac, "long-call");
    let owner = (0..2)
        .find(|&i| !uas[i].methods_of("long-call").is_empty())
        .expect("a service took the call");

    // In place: new monitor timing, a new slow-start rate, a third service.
    let with_s2 = yaml(&ports, "null", FAST, slow, "round_robin")
        .replace("interval: 300ms", "interval: 400ms")
        .replace("new_service_request_rate: 5", "new_service_request_rate: 9");
    std::fs::write(&path, &with_s2).expect("write");
    let r = router::handle(&ops, &Request::new("POST", "/reload"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("vservers.v rebuilt"), "{}", r.body);
    let st = get(&ops, "/status");
    assert_eq!(
        st["vservers"][0]["services"].as_array().map(Vec::len),
        Some(3)
    );
    assert_eq!(
        service(&st, "s2")["slow_start"]["rate"],
        9,
        "added service is new: {st}"
    );
    assert!(service(&st, "s0")["slow_start"].is_null());
    assert_eq!(
        service(&st, &format!("s{owner}"))["active"],
        1,
        "the dialog moved over"
    );

    // A bad file changes nothing.
    std::fs::write(&path, "services: [").expect("write");
    let r = router::handle(&ops, &Request::new("POST", "/reload"));
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(
        ops.config().monitors[0].interval,
        Duration::from_millis(400)
    );

    // A listener change needs a restart: refused, nothing changes.
    std::fs::write(&path, with_s2.replace("workers: 1", "workers: 2")).expect("write");
    let r = router::handle(&ops, &Request::new("POST", "/reload"));
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(
        get(&ops, "/status")["vservers"][0]["services"]
            .as_array()
            .map(Vec::len),
        Some(3)
    );

    // A rate set at run time survives a later rebuild that leaves the configured rate alone.
    let r = router::handle(
        &ops,
        &Request::new("PUT", "/vservers/v/slow-start").body(r#"{"new_service_request_rate": 4}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Remove the service that does not carry the call.
    let other = 1 - owner;
    let keep: Vec<String> = (0..3)
        .filter(|&i| i != other)
        .map(|i| format!("s{i}"))
        .collect();
    let without = with_s2.replace(
        "services: [s0, s1, s2]",
        &format!("services: [{}]", keep.join(", ")),
    );
    assert_ne!(without, with_s2);
    std::fs::write(&path, &without).expect("write");
    let r = router::handle(&ops, &Request::new("POST", "/reload"));
    assert_eq!(r.status, 200, "{}", r.body);
    let st = get(&ops, "/status");
    assert_eq!(
        st["vservers"][0]["services"].as_array().map(Vec::len),
        Some(2),
        "{st}"
    );

    // The call established before the reloads finishes on its service.
    assert_eq!(bye(&mut uac, "long-call", &tag), 200);
    assert_eq!(
        uas[owner].methods_of("long-call"),
        vec!["INVITE", "ACK", "BYE"]
    );
    // New calls still work after the reloads.
    uac.call(Duration::from_secs(2)).expect("call after reload");
    // Strict services: no request reached a service outside its dialog.
    for u in &uas {
        let c = u.counts();
        assert_eq!((c.r481, c.stray_acks), (0, 0), "{}: {c:?}", u.name);
    }
    ops.shutdown();
}

/// (family, labels, value).
type Sample = (String, Vec<(String, String)>, f64);

/// A minimal Prometheus text-format (0.0.4) parser: returns (family, labels, value) samples
/// and fails on any malformed line, sample without a TYPE, or duplicate series.
fn parse_prometheus(text: &str) -> Result<Vec<Sample>, String> {
    use std::collections::{HashMap, HashSet};
    let mut types: HashMap<String, String> = HashMap::new();
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let is_name = |s: &str| {
        let mut c = s.chars();
        c.next()
            .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
            && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
    };
    for (n, line) in text.lines().enumerate() {
        let err = |m: &str| format!("line {}: {m}: {line}", n + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("TYPE"), Some(name), Some(kind)) => {
                    if !is_name(name) {
                        return Err(err("bad family name"));
                    }
                    if !["counter", "gauge", "summary", "histogram", "untyped"].contains(&kind) {
                        return Err(err("bad type"));
                    }
                    if types.insert(name.to_owned(), kind.to_owned()).is_some() {
                        return Err(err("TYPE twice"));
                    }
                }
                (Some("HELP"), Some(name), _) if is_name(name) => {}
                _ => return Err(err("bad comment")),
            }
            continue;
        }
        let name_end = line.find(['{', ' ']).ok_or_else(|| err("no value"))?;
        let name = &line[..name_end];
        if !is_name(name) {
            return Err(err("bad metric name"));
        }
        let mut labels = Vec::new();
        let mut rest = &line[name_end..];
        if let Some(r) = rest.strip_prefix('{') {
            let mut chars = r.char_indices().peekable();
            let end;
            loop {
                let (i, c) = chars.next().ok_or_else(|| err("unterminated labels"))?;
                if c == '}' {
                    end = Some(i);
                    break;
                }
                let start = i;
                let mut eq = None;
                while let Some(&(j, c)) = chars.peek() {
                    if c == '=' {
                        eq = Some(j);
                        break;
                    }
                    chars.next();
                }
                let eq = eq.ok_or_else(|| err("label without ="))?;
                let key = &r[start..eq];
                if !is_name(key) {
                    return Err(err("bad label name"));
                }
                chars.next();
                if chars.next().map(|x| x.1) != Some('"') {
                    return Err(err("label value not quoted"));
                }
                let mut val = String::new();
                loop {
                    match chars.next().map(|x| x.1) {
                        Some('\\') => match chars.next().map(|x| x.1) {
                            Some('\\') => val.push('\\'),
                            Some('"') => val.push('"'),
                            Some('n') => val.push('\n'),
                            _ => return Err(err("bad escape")),
                        },
                        Some('"') => break,
                        Some(c) => val.push(c),
                        None => return Err(err("unterminated label value")),
                    }
                }
                labels.push((key.to_owned(), val));
                match chars.peek().map(|x| x.1) {
                    Some(',') => {
                        chars.next();
                    }
                    Some('}') => {}
                    _ => return Err(err("expected , or }")),
                }
            }
            rest = &r[end.map_or(r.len(), |e| e + 1)..];
        }
        let value = rest.trim();
        let v: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v.parse().map_err(|_| err("bad value"))?,
        };
        let family = types
            .keys()
            .filter(|f| {
                name == f.as_str()
                    || (name.starts_with(f.as_str())
                        && ["_sum", "_count", "_bucket"].contains(&&name[f.len()..]))
            })
            .max_by_key(|f| f.len())
            .ok_or_else(|| err("sample before its TYPE"))?
            .clone();
        if !seen.insert(line[..line.len() - value.len()].trim().to_owned()) {
            return Err(err("duplicate series"));
        }
        out.push((family, labels, v));
    }
    Ok(out)
}

#[test]
fn metrics_parse_and_cover_the_proxy() {
    assert!(
        parse_prometheus("x 1\n").is_err(),
        "the parser rejects untyped samples"
    );
    assert!(parse_prometheus("# TYPE x counter\nx{a=\"b} 1\n").is_err());
    let uas = Uas::start(any()).expect("uas");
    let ops = start(&yaml(&[uas.addr.port()], "null", FAST, "", "call_id_hash"));
    let mut uac = Uac::new(any(), proxy_addr(&ops), "metrics").expect("uac");
    uac.call(Duration::from_secs(2)).expect("call");
    uac.send_raw(b"garbage\r\n\r\n").expect("send");
    wait_for("a probe", Duration::from_secs(5), || {
        let m = router::handle(&ops, &Request::new("GET", "/metrics")).body;
        m.contains("fulcrum_monitor_probes_total{service=\"s0\",monitor=\"ping\",result=\"ok\"} 1")
            .then_some(())
            .or_else(|| {
                parse_prometheus(&m)
                    .ok()?
                    .iter()
                    .any(|(f, l, v)| {
                        f == "fulcrum_monitor_probes_total"
                            && l.iter().any(|x| x.1 == "ok")
                            && *v >= 1.0
                    })
                    .then_some(())
            })
    });
    let r = router::handle(&ops, &Request::new("GET", "/metrics"));
    assert_eq!(r.status, 200);
    assert!(r.content_type.starts_with("text/plain"));
    let samples = parse_prometheus(&r.body).unwrap_or_else(|e| panic!("{e}\n{}", r.body));
    let find = |fam: &str, label: (&str, &str)| {
        samples
            .iter()
            .find(|(f, l, _)| f == fam && l.iter().any(|(k, v)| k == label.0 && v == label.1))
            .map(|s| s.2)
    };
    assert!(find("fulcrum_requests_total", ("service", "s0")).is_some_and(|v| v >= 1.0));
    assert_eq!(
        find("fulcrum_selections_total", ("path", "hash")),
        Some(1.0)
    );
    assert!(find("fulcrum_selections_total", ("path", "affinity")).is_some_and(|v| v >= 1.0));
    let malformed = wait_for("malformed counted", Duration::from_secs(2), || {
        let m = router::handle(&ops, &Request::new("GET", "/metrics")).body;
        let s = parse_prometheus(&m).ok()?;
        s.iter()
            .find(|(f, l, v)| {
                f == "fulcrum_dropped_total" && l.iter().any(|x| x.1 == "malformed") && *v >= 1.0
            })
            .map(|x| x.2)
    });
    assert!(malformed >= 1.0);
    assert_eq!(
        find("fulcrum_service_state", ("state", "UP")).map(|v| v >= 0.0),
        Some(true)
    );
    assert!(
        samples
            .iter()
            .any(|(f, _, _)| f == "fulcrum_monitor_latency_seconds")
    );
    ops.shutdown();
}

#[test]
fn drain_refuses_new_calls_and_waits_for_established_ones() {
    let uas = Uas::start(any()).expect("uas");
    let ops = start(&yaml(&[uas.addr.port()], "null", FAST, "", "call_id_hash"));
    let mut uac = Uac::new(any(), proxy_addr(&ops), "term").expect("uac");
    let tag = establish(&mut uac, "in-flight");
    let ops2 = Arc::clone(&ops);
    let drain = std::thread::spawn(move || ops2.drain(Duration::from_secs(10)));
    wait_for("draining", Duration::from_secs(5), || {
        (service(&get(&ops, "/status"), "s0")["state"] == "OUT_OF_SERVICE").then_some(())
    });
    let inv = uac.request("INVITE", "too-late", 1, "late1", None);
    uac.send_raw(inv.as_bytes()).expect("send");
    let (code, _, _) = uac
        .final_response(Duration::from_secs(2))
        .expect("answered");
    assert_eq!(code, 503, "new calls are refused while draining");
    // Nothing undoes the drain: enabling a service or reloading is refused.
    for (method, path) in [("POST", "/services/s0/enable"), ("POST", "/reload")] {
        assert_eq!(
            router::handle(&ops, &Request::new(method, path)).status,
            503,
            "{path}"
        );
    }
    assert_eq!(
        service(&get(&ops, "/status"), "s0")["state"],
        "OUT_OF_SERVICE"
    );
    assert_eq!(
        bye(&mut uac, "in-flight", &tag),
        200,
        "established call continues"
    );
    let left = drain.join().expect("drain thread");
    assert_eq!(left, 0, "drain ended when the last dialog ended");
    ops.shutdown();
}

/// A reload that shortens the idle timeout also shortens how often dialogs are swept: an
/// idle dialog is gone about one (new) idle timeout later, not at the old sweep cadence.
#[test]
fn reload_to_a_shorter_idle_timeout_expires_dialogs_on_the_new_timeout() {
    let uas = Uas::start(any()).expect("uas");
    let long = yaml(
        &[uas.addr.port()],
        "null",
        FAST,
        "    idle_timeout: 600s\n",
        "round_robin",
    );
    let file = ConfigFile::new("reload-idle", &long);
    let path = file.path.clone();
    let ops = Ops::start(config::load(&path).expect("valid"), Some(path)).expect("start");
    file.write(&long.replace("idle_timeout: 600s", "idle_timeout: 1s"));
    let r = router::handle(&ops, &Request::new("POST", "/reload"));
    assert_eq!(r.status, 200, "{}", r.body);
    let mut uac = Uac::new(any(), proxy_addr(&ops), "idle").expect("uac");
    establish(&mut uac, "idle-call");
    assert_eq!(service(&get(&ops, "/status"), "s0")["active"], 1);
    let started = Instant::now();
    wait_for("the idle dialog to expire", Duration::from_secs(4), || {
        (service(&get(&ops, "/status"), "s0")["active"] == 0).then_some(())
    });
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "expired before its idle timeout"
    );
    ops.shutdown();
}

fn readyz(ops: &Ops) -> (u16, Value) {
    let r = router::handle(ops, &Request::new("GET", "/readyz"));
    (
        r.status,
        serde_json::from_str(&r.body).expect("readyz is JSON"),
    )
}

/// `/readyz` follows the usable services and the drain, `/healthz` the process; neither asks
/// for the token, which is set here and never given.
#[test]
fn readyz_follows_usable_services_and_the_drain() {
    let uas: Vec<Uas> = (0..2).map(|_| Uas::start(any()).expect("uas")).collect();
    let ports: Vec<u16> = uas.iter().map(|u| u.addr.port()).collect();
    let ops = start(&yaml(&ports, "s3cret", FAST, "", "call_id_hash"));
    assert_eq!(readyz(&ops), (200, serde_json::json!({ "ready": true })));
    assert_eq!(
        router::handle(&ops, &Request::new("POST", "/readyz")).status,
        405
    );
    let set = |action: &str| {
        for s in ["s0", "s1"] {
            let req = Request::new("POST", &format!("/services/{s}/{action}")).bearer("s3cret");
            assert_eq!(router::handle(&ops, &req).status, 200, "{action} {s}");
        }
    };
    set("disable");
    let (code, body) = readyz(&ops);
    assert_eq!(code, 503);
    assert_eq!(
        body["reasons"],
        serde_json::json!(["vserver v: no usable service"])
    );
    set("enable");
    wait_for("ready again", Duration::from_secs(5), || {
        (readyz(&ops).0 == 200).then_some(())
    });

    // Over the socket: no token, the status line of each verdict.
    let (addr, _task) = ops
        .tokio()
        .block_on(fulcrum::admin::serve(Arc::clone(&ops), any()))
        .expect("admin listener");
    let health = http(addr, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(
        health.starts_with("HTTP/1.1 200") && health.ends_with("\r\n\r\nok\n"),
        "{health}"
    );
    assert!(http(addr, "GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n").starts_with("HTTP/1.1 200"));

    // A call keeps the drain going while readiness is checked.
    let mut uac = Uac::new(any(), proxy_addr(&ops), "ready").expect("uac");
    let tag = establish(&mut uac, "ready-call");
    let ops2 = Arc::clone(&ops);
    let drain = std::thread::spawn(move || ops2.drain(Duration::from_secs(10)));
    let (_, body) = wait_for("not ready while draining", Duration::from_secs(5), || {
        Some(readyz(&ops)).filter(|(code, _)| *code == 503)
    });
    assert_eq!(body["reasons"][0], "draining", "{body}");
    let over_socket = http(addr, "GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(
        over_socket.starts_with("HTTP/1.1 503 Service Unavailable"),
        "{over_socket}"
    );
    assert!(over_socket.contains("\"draining\""), "{over_socket}");
    assert!(http(addr, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").starts_with("HTTP/1.1 200"));
    assert_eq!(bye(&mut uac, "ready-call", &tag), 200);
    assert_eq!(drain.join().expect("drain thread"), 0);
    ops.shutdown();
    assert_eq!(
        router::handle(&ops, &Request::new("GET", "/healthz")).status,
        503
    );
}

/// Passive ejection on the operator surface, through the router: a service whose requests
/// failed in a row is EJECTED in `/status` (reason, seconds left) and in `/metrics`, and
/// `POST /services/NAME/enable` ends the ejection.
#[test]
fn an_ejection_shows_in_status_and_metrics_and_enable_ends_it() {
    use fulcrum::eject::{Cause, Failure};
    let y = "admin: { listen: null }\nservices:\n  - { name: s0, address: 127.0.0.1:9, protocol: udp }\n  - { name: s1, address: 127.0.0.1:10, protocol: udp }\n  - { name: s2, address: 127.0.0.1:11, protocol: udp }\nvservers:\n  - { name: v, protocol: udp, bind: [127.0.0.1:0], method: round_robin, workers: 1, eject: { after: 2, base: 1m }, services: [s0, s1, s2] }\n";
    let ops = start(y);
    ops.with_vservers(|vs, now| {
        for _ in 0..2 {
            vs[0]
                .balancer()
                .report_failure_with(1, Failure::new(Cause::Refused), now);
        }
    })
    .expect("running");
    let st = get(&ops, "/status");
    let s1 = service(&st, "s1");
    assert_eq!(s1["state"], "EJECTED", "{s1}");
    assert_eq!(s1["health"], "UP", "{s1}");
    assert_eq!(s1["ejection"]["phase"], "ejected", "{s1}");
    assert_eq!(s1["ejection"]["reason"], "refused", "{s1}");
    assert_eq!(s1["ejection"]["ejections_total"], 1, "{s1}");
    let left = s1["ejection"]["remaining_s"]
        .as_f64()
        .expect("seconds left");
    assert!(left > 30.0 && left <= 60.0, "{left}");
    assert_eq!(service(&st, "s0")["state"], "UP");
    assert_eq!(st["vservers"][0]["eject"]["after"], 2);
    assert_eq!(st["vservers"][0]["eject"]["max_fraction"], 0.5);
    let metrics = router::handle(&ops, &Request::new("GET", "/metrics")).body;
    for line in [
        "fulcrum_service_ejected{vserver=\"v\",service=\"s1\"} 1",
        "fulcrum_service_ejected{vserver=\"v\",service=\"s0\"} 0",
        "fulcrum_service_ejections_total{vserver=\"v\",service=\"s1\"} 1",
        "fulcrum_service_state{vserver=\"v\",service=\"s1\",state=\"EJECTED\"} 1",
        "fulcrum_service_state{vserver=\"v\",service=\"s1\",state=\"UP\"} 0",
        "fulcrum_ejections_refused_total{vserver=\"v\"} 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} missing");
    }
    let r = router::handle(&ops, &Request::new("POST", "/services/s1/enable"));
    assert_eq!(r.status, 200, "{}", r.body);
    let st = get(&ops, "/status");
    let s1 = service(&st, "s1");
    assert_eq!(s1["state"], "UP", "{s1}");
    assert!(s1["ejection"]["phase"].is_null(), "{s1}");
    assert_eq!(s1["ejection"]["consecutive_failures"], 0, "{s1}");
    assert_eq!(s1["ejection"]["ejections_total"], 1, "{s1}");
    ops.shutdown();
}

/// A reload holds the runtime while it rebuilds vservers (building them aside, then waiting
/// for every worker to finish with the old ones); one that takes 5 s must not stop what runs
/// beside it. The test holds the runtime's lock for 5 s, as such a rebuild does, and
/// meanwhile the admin API answers `/readyz` and `/healthz` over its socket, what the
/// watchdog reads each tick answers at once, and a SIP request over TCP (the streams run on
/// the runtime the admin API shares) is answered.
#[test]
fn a_five_second_reload_leaves_the_admin_api_the_watchdog_and_sip_streams_answering() {
    use common::sip_tcp::{TcpUas, read_message, request};
    use std::io::Write;
    let uas = TcpUas::start();
    let yaml = format!(
        "admin: {{ listen: null }}\nservices:\n  - {{ name: s0, address: \"{}\", protocol: sip-tcp }}\n\
         vservers:\n  - name: v\n    protocol: sip-tcp\n    bind: [127.0.0.1:0]\n    method: call_id_hash\n    services: [s0]\n",
        uas.addr
    );
    let ops = start(&yaml);
    let proxy = proxy_addr(&ops);
    let (admin, _task) = ops
        .tokio()
        .block_on(fulcrum::admin::serve(Arc::clone(&ops), any()))
        .expect("admin API");
    let mut client = std::net::TcpStream::connect(proxy).expect("connect");
    client
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let local = client.local_addr().expect("local");
    let mut buf = Vec::new();
    client
        .write_all(request("OPTIONS", "before@x", local, "z9hG4bKbefore").as_bytes())
        .expect("write");
    assert!(
        read_message(&mut client, &mut buf).is_some(),
        "answered before"
    );
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let holder = {
        let ops = Arc::clone(&ops);
        std::thread::spawn(move || {
            ops.with_vservers(|_, _| {
                let _ = held_tx.send(());
                std::thread::sleep(Duration::from_secs(5));
            })
        })
    };
    held_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the runtime is held");
    let started = Instant::now();
    let ready = http(admin, "GET /readyz HTTP/1.1\r\nHost: t\r\n\r\n");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    let live = http(admin, "GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n");
    assert!(live.starts_with("HTTP/1.1 200"), "{live}");
    assert!(ops.is_serving(), "what the watchdog reads");
    client
        .write_all(request("OPTIONS", "during@x", local, "z9hG4bKduring").as_bytes())
        .expect("write");
    assert!(
        read_message(&mut client, &mut buf).is_some(),
        "a SIP request over TCP is answered during the reload"
    );
    let took = started.elapsed();
    assert!(
        !holder.is_finished() && took < Duration::from_secs(3),
        "all of it answered while the runtime was held: {took:?}"
    );
    holder.join().expect("holder");
    ops.shutdown();
}

/// A rule's pool shows its own fields in `/status` (method, `hash_length`, slow start,
/// failover; each the vserver's where the rule gives none), and the slow-start rate can be set
/// through the admin API when only a rule has slow start.
#[test]
fn a_rules_pool_shows_its_fields_and_takes_the_slow_start_rate() {
    let ops = start(
        "admin: { listen: null }\nservices:\n  - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }\n  - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }\nvservers:\n  - name: v\n    protocol: sip-udp\n    bind: [127.0.0.1:0]\n    method: call_id_hash\n    workers: 1\n    failover: { codes: [503], tries: 2 }\n    services: [a]\n    routes:\n      - { name: same, match: { method: REGISTER }, services: [b] }\n      - { name: own, match: { method: MESSAGE }, services: [a, b], method: least_connection, slow_start: { new_service_request_rate: 5 }, failover: off }\n      - { name: urls, match: { method: OPTIONS }, services: [b], method: url_hash, hash_length: 12 }\n",
    );
    let status = get(&ops, "/status");
    let routes = &status["vservers"][0]["routes"];
    let rule = |name: &str| -> Value {
        routes["rules"]
            .as_array()
            .and_then(|r| r.iter().find(|x| x["name"] == name))
            .cloned()
            .unwrap_or_else(|| panic!("rule {name} in {routes}"))
    };
    let same = rule("same");
    assert_eq!(same["method"], "call_id_hash", "{same}");
    assert_eq!(same["failover"]["tries"], 2, "inherited: {same}");
    assert!(same["slow_start"].is_null(), "{same}");
    let own = rule("own");
    assert_eq!(own["method"], "least_connection", "{own}");
    assert!(own["failover"].is_null(), "failover off: {own}");
    assert_eq!(own["slow_start"]["new_service_request_rate"], 5, "{own}");
    let urls = rule("urls");
    assert_eq!(urls["hash_length"], 12, "{urls}");
    assert_eq!(routes["default"]["failover"]["codes"][0], 503, "{routes}");
    assert!(status["vservers"][0]["slow_start"].is_null());

    // The vserver has no slow start, its rule has: the rate is the rule's to change.
    let r = router::handle(
        &ops,
        &Request::new("PUT", "/vservers/v/slow-start").body(r#"{"new_service_request_rate": 9}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let own = get(&ops, "/status")["vservers"][0]["routes"]["rules"][1].clone();
    assert_eq!(own["slow_start"]["new_service_request_rate"], 9, "{own}");
    assert_eq!(own["slow_start"]["manual"], true, "{own}");
    let r = router::handle(
        &ops,
        &Request::new("PUT", "/vservers/v/slow-start")
            .body(r#"{"new_service_request_rate": 3, "unit": "percent"}"#),
    );
    assert_eq!(r.status, 409, "the rule's unit is per_second: {}", r.body);
    ops.shutdown();
}
