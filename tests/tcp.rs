//! `tcp` and `http` vservers over loopback: distribution, affinity, HTTP keys and their
//! round-robin fallback, half-close, connect-failure retry, idle timeout, connection limit,
//! least_connection on live connections, worker threads, IPv6, PROXY v2, and two instances
//! agreeing.

mod common;

use common::*;
use fulcrum::balancer::Path;
use fulcrum::proxy::TcpPath;
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

fn tcp_core(rt: &fulcrum::proxy::Runtime, name: &str) -> Arc<fulcrum::proxy::TcpCore> {
    let v = rt.vserver(name).expect("vserver");
    match v.path::<TcpPath>() {
        Some(p) => Arc::clone(p.core()),
        None => panic!("not tcp: {:?}", v.data),
    }
}

#[test]
fn round_robin_distributes_connections() {
    let (rt, vs) = start_loopback("tcp", 3, "round_robin", "");
    let mut per: HashMap<String, usize> = HashMap::new();
    for i in 0..30 {
        let msg = format!("hello {i}");
        let a = tcp_ask(vs, msg.as_bytes()).expect("answer");
        assert_eq!(
            a.body,
            msg.as_bytes(),
            "bytes forwarded unchanged, both ways"
        );
        *per.entry(a.service).or_default() += 1;
    }
    assert!(per.values().all(|&n| n == 10), "{per:?}");
    let core = tcp_core(&rt, "v");
    assert!(wait_until(ANSWER, || core.connections() == 0));
}

#[test]
fn source_ip_hash_keeps_a_client_on_one_service() {
    let (_rt, vs) = start_loopback("tcp", 3, "source_ip_hash", "");
    let first = tcp_ask(vs, b"a").expect("answer").service;
    for _ in 0..10 {
        assert_eq!(tcp_ask(vs, b"a").expect("answer").service, first);
    }
}

/// A large transfer in both directions with a half-close in the middle: the client's FIN
/// reaches the service (it answers only after EOF), and the answer still flows back.
#[test]
fn half_close_passes_through_and_large_payloads_are_intact() {
    let (rt, vs) = start_loopback("tcp", 1, "round_robin", "");
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let a = tcp_ask(vs, &big).expect("answer");
    assert_eq!(a.body.len(), big.len());
    assert!(
        a.body == big,
        "3 MB echoed intact through the half-closed connection"
    );
    let core = tcp_core(&rt, "v");
    assert!(
        wait_until(ANSWER, || core.connections() == 0),
        "both sides finished: closed"
    );
    assert!(core.counters.bytes_in.load(Ordering::Relaxed) >= big.len() as u64);
}

#[test]
fn connect_failure_tries_the_next_service_and_counts() {
    let svc = services("tcp", 2, "127.0.0.1");
    let mut all = refs(&svc);
    let dead = closed_port("127.0.0.1");
    all.insert(0, ("dead", dead));
    for method in ["round_robin", "source_ip_source_port_hash"] {
        let rt = start(&config("tcp", "127.0.0.1:0", method, "", &all));
        let vs = bound(&rt, "v");
        let core = tcp_core(&rt, "v");
        // A hash method ranks "dead" first for about a third of the source ports: keep
        // connecting (bounded) until one such connection has had to try the next service.
        for n in 0..300 {
            let a = tcp_ask(vs, b"x").expect("every connection is served");
            assert_ne!(a.service, "dead");
            if n >= 11 && core.counters.connect_failures.load(Ordering::Relaxed) >= 1 {
                break;
            }
        }
        assert!(
            core.counters.connect_failures.load(Ordering::Relaxed) >= 1,
            "{method}"
        );
        assert_eq!(core.counters.no_service.load(Ordering::Relaxed), 0);
    }
}

#[test]
fn all_services_failing_closes_the_client() {
    let dead = closed_port("127.0.0.1");
    let rt = start(&config(
        "tcp",
        "127.0.0.1:0",
        "round_robin",
        "",
        &[("dead", dead)],
    ));
    let vs = bound(&rt, "v");
    assert!(tcp_ask(vs, b"x").is_err(), "closed without an answer");
    let core = tcp_core(&rt, "v");
    assert!(wait_until(ANSWER, || core
        .counters
        .no_service
        .load(Ordering::Relaxed)
        == 1));
}

#[test]
fn idle_connections_time_out() {
    let (rt, vs) = start_loopback("tcp", 1, "round_robin", "idle_timeout: 200ms");
    let mut s = TcpStream::connect(vs).expect("connect");
    s.set_read_timeout(Some(ANSWER)).expect("timeout");
    let mut buf = [0u8; 16];
    // Nothing is sent: fulcrum closes both sides after the idle timeout (EOF here).
    assert_eq!(s.read(&mut buf).expect("EOF, not a timeout"), 0);
    let core = tcp_core(&rt, "v");
    assert_eq!(core.counters.idle_timeouts.load(Ordering::Relaxed), 1);
    assert!(wait_until(ANSWER, || core.connections() == 0));
}

#[test]
fn connection_limit_refuses_and_least_connection_counts_live_connections() {
    let (rt, vs) = start_loopback("tcp", 2, "least_connection", "max_sessions: 2");
    let core = tcp_core(&rt, "v");
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(vs).expect("connect");
        s.write_all(b"held").expect("write");
        held.push(s);
    }
    let b = Arc::clone(core.balancer());
    assert!(
        wait_until(ANSWER, || (0..2)
            .all(|m| b.counters(m).map_or(0, |c| c.active()) == 1)),
        "two live connections, one per service"
    );
    let mut third = TcpStream::connect(vs).expect("accepted by the kernel");
    third.set_read_timeout(Some(ANSWER)).expect("timeout");
    let mut buf = [0u8; 8];
    assert!(
        matches!(third.read(&mut buf), Ok(0) | Err(_)),
        "refused: closed at once"
    );
    assert_eq!(core.counters.refused.load(Ordering::Relaxed), 1);
    // Finishing the held connections frees their slots and their counts.
    let mut names = HashSet::new();
    for mut s in held {
        s.shutdown(Shutdown::Write).expect("shutdown");
        s.set_read_timeout(Some(ANSWER)).expect("timeout");
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("answer");
        names.insert(parse_answer(&out).expect("answer").service);
    }
    assert_eq!(names.len(), 2);
    assert!(wait_until(ANSWER, || (0..2)
        .all(|m| b.counters(m).map_or(1, |c| c.active()) == 0)));
    assert!(tcp_ask(vs, b"again").is_ok());
}

/// A TCP service that answers each chunk it reads with `name` after `delay`.
fn delayed_service(name: &'static str, delay: Duration) -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 256];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 {
                        return;
                    }
                    std::thread::sleep(delay);
                    if c.write_all(name.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// least_response_time learns the services' response times from the traffic it relays
/// (request to first byte back) and sends new connections to the quicker one.
#[test]
fn least_response_time_measures_the_relayed_traffic() {
    let fast = delayed_service("fast", Duration::from_millis(1));
    let slow = delayed_service("slow", Duration::from_millis(150));
    let svc = vec![("fast".to_owned(), fast), ("slow".to_owned(), slow)];
    let (rt, vs) = start_over("tcp", "127.0.0.1:0", "least_response_time", "", &svc);
    let ask = || {
        let mut c = TcpStream::connect(vs).expect("connect");
        c.set_read_timeout(Some(ANSWER)).expect("timeout");
        c.write_all(b"ping").expect("write");
        let mut got = [0u8; 4];
        c.read_exact(&mut got).expect("answer");
        String::from_utf8_lossy(&got).into_owned()
    };
    // Until both are measured every service is alike; afterwards the quick one wins.
    let first: Vec<String> = (0..2).map(|_| ask()).collect();
    assert!(
        first.contains(&"fast".to_owned()) && first.contains(&"slow".to_owned()),
        "{first:?}"
    );
    let core = tcp_core(&rt, "v");
    let b = Arc::clone(core.balancer());
    let time = |m: usize| b.counters(m).and_then(|c| c.response_time_us());
    assert!(
        wait_until(ANSWER, || time(0).is_some() && time(1).is_some()),
        "both services measured: {:?} {:?}",
        time(0),
        time(1)
    );
    let times: Vec<u64> = (0..2).map(|m| time(m).unwrap_or(0)).collect();
    assert!(times[0] < 50_000 && times[1] >= 140_000, "{times:?}");
    let later: Vec<String> = (0..6).map(|_| ask()).collect();
    assert!(later.iter().all(|s| s == "fast"), "{later:?}");
}

/// A burst of connections, all chosen before any of their connects completes, still sees
/// `max_clients`: each counts on its service from the moment it is chosen.
#[test]
fn max_clients_holds_for_a_burst_of_connections() {
    let svc = services("tcp", 3, "127.0.0.1");
    let text = config("tcp", "127.0.0.1:0", "least_connection", "", &refs(&svc))
        .replace("protocol: tcp }", "protocol: tcp, max_clients: 1 }");
    assert_eq!(text.matches("max_clients: 1").count(), 3, "{text}");
    let rt = start(&text);
    let vs = bound(&rt, "v");
    // Ten connections at once, each sending before any is answered.
    let mut conns: Vec<TcpStream> = (0..10)
        .map(|_| TcpStream::connect(vs).expect("connect"))
        .collect();
    for (i, c) in conns.iter_mut().enumerate() {
        c.write_all(format!("burst {i}").as_bytes()).expect("write");
    }
    // Every connection has been given a service or refused before any of them ends (an
    // ending one frees its place, which a later one may then take).
    let core = tcp_core(&rt, "v");
    let b = Arc::clone(core.balancer());
    let decided = || {
        let active: u64 = (0..3)
            .map(|m| b.counters(m).map_or(0, |c| c.active()))
            .sum();
        active + core.counters.no_service.load(Ordering::Relaxed) == 10
    };
    assert!(wait_until(ANSWER, decided), "all ten decided");
    let mut served = HashMap::new();
    for c in &mut conns {
        let _ = c.shutdown(Shutdown::Write);
        c.set_read_timeout(Some(ANSWER)).expect("timeout");
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        if let Some(a) = parse_answer(&out) {
            *served.entry(a.service).or_insert(0) += 1;
        }
    }
    assert!(
        served.values().all(|&n| n == 1) && served.len() <= 3,
        "at most one connection per service: {served:?}"
    );
    assert!(!served.is_empty());
}

/// `workers: 3`: three threads, each with its own listener on the vserver's one port.
/// Connections are served whichever thread accepted them, the connection bound and the
/// services' live-connection counts (least_connection's input) see them all, and a
/// shutdown closes those still open.
#[test]
fn worker_threads_share_the_port_the_bound_and_the_shutdown() {
    let (rt, vs) = start_loopback("tcp", 2, "least_connection", "workers: 3\nmax_sessions: 40");
    let core = tcp_core(&rt, "v");
    let b = Arc::clone(core.balancer());
    let active = |m| b.counters(m).map_or(0, |c| c.active());
    let mut held = Vec::new();
    for _ in 0..40 {
        let mut s = TcpStream::connect(vs).expect("connect");
        s.write_all(b"held").expect("write");
        held.push(s);
    }
    assert!(
        wait_until(ANSWER, || active(0) + active(1) == 40),
        "every connection reached a service: {} + {}",
        active(0),
        active(1)
    );
    assert_eq!(core.connections(), 40);
    let mut extra = TcpStream::connect(vs).expect("accepted by the kernel");
    extra.set_read_timeout(Some(ANSWER)).expect("timeout");
    let mut buf = [0u8; 8];
    assert!(matches!(extra.read(&mut buf), Ok(0) | Err(_)), "refused");
    assert_eq!(core.counters.refused.load(Ordering::Relaxed), 1);
    // One connection finishes normally, the others are closed by the shutdown.
    let mut one = held.pop().expect("held");
    one.shutdown(Shutdown::Write).expect("shutdown");
    one.set_read_timeout(Some(ANSWER)).expect("timeout");
    let mut out = Vec::new();
    one.read_to_end(&mut out).expect("answer");
    assert_eq!(parse_answer(&out).expect("answer").body, b"held");
    let t0 = std::time::Instant::now();
    rt.shutdown();
    assert!(t0.elapsed() < ANSWER, "worker threads stop promptly");
    for mut s in held {
        s.set_read_timeout(Some(ANSWER)).expect("timeout");
        let mut rest = Vec::new();
        assert!(
            !matches!(s.read_to_end(&mut rest), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "closed by the shutdown, not left open"
        );
        assert!(rest.is_empty(), "no answer without the client's EOF");
    }
}

#[test]
fn ipv6_and_dest_ip_hash_on_the_accepted_address() {
    let svc = services("tcp", 2, "[::1]");
    let (_rt, vs) = start_over("tcp", "[::1]:0", "dest_ip_hash", "", &svc);
    let first = tcp_ask(vs, b"six").expect("answer");
    assert_eq!(first.body, b"six");
    for _ in 0..5 {
        assert_eq!(tcp_ask(vs, b"six").expect("answer").service, first.service);
    }
    // On a wildcard bind the accepted socket's local address is the key.
    let svc4 = services("tcp", 3, "127.0.0.1");
    let (_rt4, vs4) = start_over("tcp", "0.0.0.0:0", "dest_ip_hash", "", &svc4);
    let port = vs4.port();
    let mut by_dst = HashMap::new();
    for i in 1..=12u8 {
        let dst: SocketAddr = format!("127.0.0.{i}:{port}").parse().expect("addr");
        by_dst.insert(i, tcp_ask(dst, b"d").expect("answer").service);
    }
    assert!(
        by_dst.values().collect::<HashSet<_>>().len() >= 2,
        "{by_dst:?}"
    );
    for i in 1..=12u8 {
        let dst: SocketAddr = format!("127.0.0.{i}:{port}").parse().expect("addr");
        assert_eq!(tcp_ask(dst, b"d").expect("answer").service, by_dst[&i]);
    }
}

#[test]
fn proxy_v2_header_precedes_the_stream() {
    let (rt, vs) = start_loopback("tcp", 1, "round_robin", "send_proxy: v2");
    let (_reserved, me) = reserved_client_addr("127.0.0.7");
    let a = tcp_ask_from(vs, Some(me), b"GET / HTTP/1.0\r\n\r\n").expect("answer");
    assert_eq!(a.proxy_src, me.to_string());
    assert_eq!(a.body, b"GET / HTTP/1.0\r\n\r\n");
    // fulcrum's header is not the client's traffic.
    let core = tcp_core(&rt, "v");
    assert!(wait_until(ANSWER, || core.connections() == 0));
    assert_eq!(core.counters.bytes_in.load(Ordering::Relaxed), 18);
}

#[test]
fn http_url_hash_affinity_and_round_robin_fallback() {
    let (rt, vs) = start_loopback("http", 3, "url_hash", "");
    let mut by_url = HashMap::new();
    for i in 0..15 {
        let req = format!("GET /obj/{i} HTTP/1.1\r\nHost: cache\r\n\r\n");
        let a = tcp_ask(vs, req.as_bytes()).expect("answer");
        assert_eq!(a.body, req.as_bytes(), "head forwarded unchanged");
        by_url.insert(i, a.service);
    }
    assert!(by_url.values().collect::<HashSet<_>>().len() >= 2);
    for i in 0..15 {
        // Split writes: the head arrives in pieces and is still read whole.
        let req = format!("GET /obj/{i} HTTP/1.1\r\nHost: other\r\nX: y\r\n\r\nbody");
        let mut s = TcpStream::connect(vs).expect("connect");
        s.set_read_timeout(Some(ANSWER)).expect("timeout");
        let (a, b) = req.as_bytes().split_at(9);
        s.write_all(a).expect("write");
        s.flush().expect("flush");
        std::thread::yield_now();
        s.write_all(b).expect("write");
        s.shutdown(Shutdown::Write).expect("shutdown");
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("read");
        let ans = parse_answer(&out).expect("answer");
        assert_eq!(ans.service, by_url[&i]);
        assert_eq!(ans.body, req.as_bytes());
    }
    // Not HTTP: round robin, bytes still forwarded.
    let mut per = HashMap::new();
    for _ in 0..6 {
        let a = tcp_ask(vs, b"\x16\x03\x01 not http\r\n\r\n").expect("answer");
        assert_eq!(a.body, b"\x16\x03\x01 not http\r\n\r\n");
        *per.entry(a.service).or_insert(0) += 1;
    }
    assert_eq!(per.len(), 3, "round robin over all: {per:?}");
    let core = tcp_core(&rt, "v");
    assert_eq!(core.balancer().path_count(Path::FallbackRoundRobin), 6);
    assert_eq!(core.counters.heads_unparseable.load(Ordering::Relaxed), 6);
}

#[test]
fn http_head_cut_short_by_eof_or_timeout_falls_back() {
    let (rt, vs) = start_loopback("http", 2, "domain_hash", "idle_timeout: 300ms");
    // The client half-closes mid-head: what came is forwarded to a fallback service.
    let a = tcp_ask(vs, b"GET /x HTTP/1.1\r\nHost: exa").expect("answer");
    assert_eq!(a.body, b"GET /x HTTP/1.1\r\nHost: exa");
    // The client stalls mid-head: after the first-bytes timeout it is balanced anyway.
    let mut s = TcpStream::connect(vs).expect("connect");
    s.set_read_timeout(Some(ANSWER)).expect("timeout");
    s.write_all(b"GET /slow HTTP/1.1\r\n").expect("write");
    let core = tcp_core(&rt, "v");
    assert!(wait_until(ANSWER, || core
        .counters
        .first_bytes_timeouts
        .load(Ordering::Relaxed)
        == 1));
    s.shutdown(Shutdown::Write).expect("shutdown");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read");
    assert_eq!(
        parse_answer(&out).expect("answer").body,
        b"GET /slow HTTP/1.1\r\n"
    );
}

/// The service answering `request(k)` for each key `k` in `0..12`, one connection each.
fn service_per_key(vs: SocketAddr, request: impl Fn(u32) -> String) -> Vec<String> {
    (0..12)
        .map(|k| tcp_ask(vs, request(k).as_bytes()).expect("answer").service)
        .collect()
}

#[test]
fn http_domain_and_token_keys() {
    let svc = services("tcp", 3, "127.0.0.1");
    let (_rt, vs) = start_over("http", "127.0.0.1:0", "domain_hash", "", &svc);
    let by_host = service_per_key(vs, |h| {
        format!("GET /{h} HTTP/1.1\r\nHost: site{h}.example\r\n\r\n")
    });
    assert!(by_host.iter().collect::<HashSet<_>>().len() >= 2);
    let again = service_per_key(vs, |h| {
        format!("POST /other HTTP/1.1\r\nHost: SITE{h}.example\r\n\r\n")
    });
    assert_eq!(
        again, by_host,
        "the same host, in any case, the same service"
    );
    let (_rt2, vs2) = start_over(
        "http",
        "127.0.0.1:0",
        "token",
        "token: { header: X-Tenant }",
        &svc,
    );
    let by_tenant = service_per_key(vs2, |t| {
        format!("GET /a HTTP/1.1\r\nX-Tenant: t{t}\r\n\r\n")
    });
    let again = service_per_key(vs2, |t| {
        format!("GET /b HTTP/1.1\r\nHost: z\r\nX-Tenant: t{t}\r\n\r\n")
    });
    assert_eq!(again, by_tenant, "the same tenant, the same service");
}

#[test]
fn tcp_token_on_payload_bytes() {
    let (_rt, vs) = start_loopback("tcp", 3, "token", "token: { offset: 2, length: 3 }");
    let by_tok = service_per_key(vs, |t| format!("..{t:03}-payload"));
    assert!(by_tok.iter().collect::<HashSet<_>>().len() >= 2);
    let again = service_per_key(vs, |t| format!("xx{t:03}"));
    assert_eq!(again, by_tok, "the same token, the same service");
}

#[test]
fn two_instances_choose_the_same_service_per_connection() {
    let [(_rt1, v1), (_rt2, v2)] = start_pair("tcp", 4, "source_ip_source_port_hash");
    let mut used = HashSet::new();
    for _ in 0..16 {
        // The same client address and port toward both instances (a mirrored connection).
        let (_reserved, from) = reserved_client_addr("127.0.0.1");
        let a = tcp_ask_from(v1, Some(from), b"m").expect("answer").service;
        let b = tcp_ask_from(v2, Some(from), b"m").expect("answer").service;
        assert_eq!(a, b, "{from}");
        used.insert(a);
    }
    assert!(used.len() >= 3);
}

#[test]
fn idle_tcp_connection_holds_no_buffer_of_its_own() {
    // Indirect check of the memory rule: 200 idle connections do not grow the process by
    // more than ~4 KiB each (measured precisely by bench/tcp.sh).
    let (rt, vs) = start_loopback("tcp", 1, "round_robin", "");
    let core = tcp_core(&rt, "v");
    let mut conns = Vec::new();
    for _ in 0..200 {
        conns.push(TcpStream::connect(vs).expect("connect"));
    }
    assert!(wait_until(Duration::from_secs(5), || core
        .balancer()
        .counters(0)
        .map_or(0, |c| c.active())
        == 200));
    drop(conns);
    assert!(wait_until(Duration::from_secs(5), || core.connections() == 0));
}

/// `/status` of `ops` as JSON, through the admin router (no socket).
fn status(ops: &fulcrum::ops::Ops) -> serde_json::Value {
    use fulcrum::admin::router::{self, Request};
    let r = router::handle(ops, &Request::new("GET", "/status"));
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).expect("JSON")
}

/// Service `name` of the first vserver in `status`.
fn service_status(status: &serde_json::Value, name: &str) -> serde_json::Value {
    status["vservers"][0]["services"]
        .as_array()
        .and_then(|s| s.iter().find(|x| x["name"] == name))
        .cloned()
        .expect("service in /status")
}

/// Passive ejection (docs/ejection.md) over real sockets: a tcp vserver over three services,
/// one of which refuses connections. After `after` refused connects it is EJECTED (`/status`
/// says why and for how long) and new connections no longer try it; once `base` has passed
/// one trial connect goes to it (refused: ejected again, for twice as long); `enable` ends
/// the ejection. Every client connection is served throughout.
#[test]
fn a_refusing_service_is_ejected_tried_once_after_base_and_enabled_again() {
    use fulcrum::admin::router::{self, Request};
    let svc = services("tcp", 2, "127.0.0.1");
    let mut all = refs(&svc);
    all.insert(1, ("dead", closed_port("127.0.0.1")));
    let yaml = config(
        "tcp",
        "127.0.0.1:0",
        "round_robin",
        "eject: { after: 2, base: 300ms, max: 5s }",
        &all,
    );
    let cfg = fulcrum::config::from_str("t.yaml", &yaml).expect("valid");
    let ops = fulcrum::ops::Ops::start(cfg, None).expect("start");
    let (vs, core) = ops
        .with_vservers(|v, _| {
            let p = v[0].path::<TcpPath>().expect("tcp");
            (v[0].bound[0], Arc::clone(p.core()))
        })
        .expect("running");
    let failures = || core.counters.connect_failures.load(Ordering::Relaxed);
    let served = |n: usize| {
        for _ in 0..n {
            let a = tcp_ask(vs, b"x").expect("every connection is served");
            assert_ne!(a.service, "dead");
        }
    };
    // Round robin passes "dead" every third connection: two refusals within six.
    served(6);
    assert_eq!(failures(), 2);
    let dead = service_status(&status(&ops), "dead");
    assert_eq!(dead["state"], "EJECTED", "{dead}");
    assert_eq!(dead["ejection"]["phase"], "ejected", "{dead}");
    assert_eq!(dead["ejection"]["reason"], "refused", "{dead}");
    let left = dead["ejection"]["remaining_s"].as_f64().expect("seconds");
    assert!(left > 0.0 && left <= 0.3, "{left}");
    // Ejected: new connections do not try it (two rounds of the others).
    served(4);
    assert_eq!(failures(), 2, "no connect tried while ejected");
    // Once `base` has passed it is half-open: one trial among the next connections.
    assert!(wait_until(ANSWER, || service_status(&status(&ops), "dead")
        ["ejection"]["phase"]
        == "half_open"));
    served(4);
    assert_eq!(failures(), 3, "exactly one trial connect");
    let dead = service_status(&status(&ops), "dead");
    assert_eq!(dead["state"], "EJECTED", "{dead}");
    assert_eq!(dead["ejection"]["ejections_total"], 2, "{dead}");
    let left = dead["ejection"]["remaining_s"].as_f64().expect("seconds");
    assert!(left > 0.0 && left <= 0.6, "doubled: {left}");
    // The operator ends the ejection: connections try it again at once.
    let r = router::handle(&ops, &Request::new("POST", "/services/dead/enable"));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(service_status(&status(&ops), "dead")["state"], "UP");
    served(3);
    assert_eq!(failures(), 4, "tried again after enable");
    ops.shutdown();
}
