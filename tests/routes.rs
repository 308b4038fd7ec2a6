//! Routing rules on a sip-udp vserver (`routes:`, src/route.rs) with real peers: one listener
//! in front of a Kamailio registrar, call proxies, a gateway pool and a tenant's PBXs, each a
//! strict service (tests/common/strict_uas.rs: a BYE for a dialog it did not set
//! up gets 481), driven by SIPp and Debian's SIPVicious.
//!
//! - REGISTERs reach only the registrar, calls by number prefix only the gateways, calls by
//!   domain only the tenant's pool, other calls only the call proxies; the BYEs follow their
//!   dialogs although a rule drops every BYE outside a dialog;
//! - an INVITE sent again with credentials after a 407 reaches the service that challenged it
//!   (round robin would send it to the other);
//! - a gateway answering 503 fails over to the other gateway, never to the call proxies;
//! - a rule with `failover: off` relays a sick gateway's 503 to the caller, while a rule that
//!   keeps failover on moves those calls to its pool's other gateway;
//! - `svmap` is dropped by a User-Agent rule: the services never see it and it finds nothing,
//!   while it finds a vserver without the rule;
//! - a barred prefix gets the rule's 403 with its reason, and no service sees the call.
//!
//! Without `sipp` (or `kamailio`, or SIPVicious) on the PATH a test says why and passes
//! without running, unless `FULCRUM_REQUIRE_SIPP=1` (`FULCRUM_REQUIRE_KAMAILIO=1`,
//! `FULCRUM_REQUIRE_SIPVICIOUS=1`), as in CI. Every peer process runs under `timeout` and is
//! ended when its guard drops; everything stays on loopback.

mod common;

use common::sipp::{Proc, Scratch, Transport, sipp_available, spawn_listening, uac_counts};
use common::strict_uas::{Counts, Sick, StrictUas};
use common::*;
use fulcrum::proxy::Runtime;
use std::net::{SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Calls (or registrations) per kind in one SIPp run.
const CALLS: u32 = 10;

/// A call along the Record-Route: INVITE to `sip:RURI`, 200, then ACK and BYE to the callee's
/// Contact with the route set (RFC 3261 §12.1.2).
const CALL: &str = r#"<?xml version="1.0" encoding="ISO-8859-1" ?>
<!DOCTYPE scenario SYSTEM "sipp.dtd">
<scenario name="call">
  <send retrans="500">
    <![CDATA[

      INVITE sip:RURI SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:RURI>
      Call-ID: [call_id]
      CSeq: 1 INVITE
      Contact: sip:sipp@[local_ip]:[local_port]
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <recv response="100" optional="true"/>
  <recv response="180" optional="true"/>
  <recv response="200" rrs="true"/>
  <send>
    <![CDATA[

      ACK [next_url] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      [routes]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:RURI>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 1 ACK
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <send retrans="500">
    <![CDATA[

      BYE [next_url] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      [routes]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:RURI>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 2 BYE
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <recv response="200" crlf="true"/>
</scenario>
"#;

/// A phone registering `userN@example.com` with its own Contact.
const REGISTER: &str = r#"<?xml version="1.0" encoding="ISO-8859-1" ?>
<!DOCTYPE scenario SYSTEM "sipp.dtd">
<scenario name="register">
  <send retrans="500">
    <![CDATA[

      REGISTER sip:example.com SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: <sip:user[call_number]@example.com>;tag=[pid]SIPpTag00[call_number]
      To: <sip:user[call_number]@example.com>
      Call-ID: [call_id]
      CSeq: 1 REGISTER
      Contact: <sip:user[call_number]@[local_ip]:[local_port]>
      Expires: 300
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <recv response="200"/>
</scenario>
"#;

/// A call challenged by a proxy: INVITE, 407, ACK of it (the INVITE's branch, RFC 3261
/// §17.1.1.3), the INVITE again with credentials (same Call-ID, CSeq 2, new branch, §22.2),
/// 200, ACK and BYE along the route set.
const CHALLENGED_CALL: &str = r#"<?xml version="1.0" encoding="ISO-8859-1" ?>
<!DOCTYPE scenario SYSTEM "sipp.dtd">
<scenario name="challenged call">
  <send retrans="500">
    <![CDATA[

      INVITE sip:RURI SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=z9hG4bK-[pid]-[call_number]-inv1
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:RURI>
      Call-ID: [call_id]
      CSeq: 1 INVITE
      Contact: sip:sipp@[local_ip]:[local_port]
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <recv response="100" optional="true"/>
  <recv response="407" auth="true"/>
  <send>
    <![CDATA[

      ACK sip:RURI SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=z9hG4bK-[pid]-[call_number]-inv1
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:RURI>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 1 ACK
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <send retrans="500">
    <![CDATA[

      INVITE sip:RURI SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=z9hG4bK-[pid]-[call_number]-inv2
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:RURI>
      Call-ID: [call_id]
      CSeq: 2 INVITE
      Contact: sip:sipp@[local_ip]:[local_port]
      [authentication username=alice password=secret]
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <recv response="100" optional="true"/>
  <recv response="180" optional="true"/>
  <recv response="200" rrs="true"/>
  <send>
    <![CDATA[

      ACK [next_url] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      [routes]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:RURI>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 2 ACK
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <send retrans="500">
    <![CDATA[

      BYE [next_url] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      [routes]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:RURI>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 3 BYE
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <recv response="200" crlf="true"/>
</scenario>
"#;

/// A call refused: INVITE, 403, ACK of it (the INVITE's branch and Request-URI, the 403's
/// To tag).
const REFUSED_CALL: &str = r#"<?xml version="1.0" encoding="ISO-8859-1" ?>
<!DOCTYPE scenario SYSTEM "sipp.dtd">
<scenario name="refused call">
  <send retrans="500">
    <![CDATA[

      INVITE sip:RURI SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=z9hG4bK-[pid]-[call_number]-inv
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:RURI>
      Call-ID: [call_id]
      CSeq: 1 INVITE
      Contact: sip:sipp@[local_ip]:[local_port]
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <recv response="403"/>
  <send>
    <![CDATA[

      ACK sip:RURI SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=z9hG4bK-[pid]-[call_number]-inv
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:RURI>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 1 ACK
      Max-Forwards: 70
      Content-Length: 0

    ]]>
  </send>
  <pause milliseconds="600"/>
</scenario>
"#;

/// How one SIPp UAC run ended.
#[derive(Debug)]
struct Outcome {
    exit: Option<i32>,
    successful: u64,
    failed: u64,
    /// The first lines of SIPp's error log.
    errors: String,
    /// The -trace_msg log: every message SIPp sent and received.
    messages: String,
}

/// Run `template` (a scenario above) with its `RURI` replaced, `CALLS` calls at 20 per
/// second through `proxy`, to its end (bounded by `timeout`; a call failing after 5 s without
/// an expected message). Call N's Call-ID is `KIND-N@routes.test`.
fn run_uac(dir: &Scratch, proxy: SocketAddr, template: &str, ruri: &str, kind: &str) -> Outcome {
    let run = dir.path(kind);
    std::fs::create_dir_all(&run).expect("run dir");
    let scenario = run.join("scenario.xml");
    std::fs::write(&scenario, template.replace("RURI", ruri)).expect("write scenario");
    let (stat, errors, messages) = (
        run.join("stat.csv"),
        run.join("errors.log"),
        run.join("messages.log"),
    );
    let limit = Duration::from_secs(25);
    let secs = limit.as_secs().to_string();
    let (mut proc, _port): (Proc, u16) =
        spawn_listening(&format!("sipp uac {kind}"), Transport::Udp, |port| {
            let mut cmd = Command::new("timeout");
            cmd.args(["-s", "KILL", &secs, "sipp", "-t", "u1", "-sf"])
                .arg(&scenario)
                .arg(proxy.to_string())
                .args(["-i", "127.0.0.1", "-p", &port.to_string()])
                .args(["-r", "20", "-m", &CALLS.to_string()])
                .args(["-cid_str", &format!("{kind}-%u@routes.test")])
                .args(["-nostdin", "-timeout", &format!("{secs}s")])
                .args(["-recv_timeout", "5000", "-trace_stat", "-stf"])
                .arg(&stat)
                .args(["-trace_err", "-error_file"])
                .arg(&errors)
                .args(["-trace_msg", "-message_file"])
                .arg(&messages)
                .current_dir(&run);
            cmd
        });
    let exit = proc.wait_for(limit + Duration::from_secs(5));
    let (successful, failed) = uac_counts(&stat);
    Outcome {
        exit,
        successful,
        failed,
        errors: std::fs::read_to_string(&errors)
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .take(12)
            .collect::<Vec<_>>()
            .join("\n"),
        messages: std::fs::read_to_string(&messages).unwrap_or_default(),
    }
}

/// Every call of `out` completed.
fn all_completed(out: &Outcome, what: &str) {
    assert_eq!(
        (out.exit, out.successful, out.failed),
        (Some(0), u64::from(CALLS), 0),
        "{what}: {}",
        out.errors
    );
}

/// The Call-IDs a [`run_uac`] of `kind` used.
fn call_ids(kind: &str) -> Vec<String> {
    (1..=CALLS)
        .map(|n| format!("{kind}-{n}@routes.test"))
        .collect()
}

/// A config: `services` (name, address), then vserver `v` over `default_pool` with `body`
/// (its `routes:` and `default:` lines, indented for the vserver).
fn farm(services: &[(&str, SocketAddr)], default_pool: &[&str], body: &str) -> String {
    let mut y = String::from("admin: { listen: null }\nservices:\n");
    for (name, addr) in services {
        y.push_str(&format!(
            "  - {{ name: {name}, address: \"{addr}\", protocol: sip-udp, hash_id: {name} }}\n"
        ));
    }
    y.push_str(&format!(
        "vservers:\n  - name: v\n    protocol: sip-udp\n    bind: [\"127.0.0.1:0\"]\n    record_route: true\n    services: [{}]\n{body}",
        default_pool.join(", ")
    ));
    y
}

/// The counters of rule `name` (or of the default, for `None`) of vserver `v`.
fn rule_counter(
    rt: &Runtime,
    name: Option<&str>,
    f: impl Fn(&fulcrum::balancer::RouteCounters) -> &std::sync::atomic::AtomicU64,
) -> u64 {
    let b = rt.vserver("v").expect("vserver").balancer();
    let routes = b.routes().expect("routes");
    let i = match name {
        Some(n) => routes
            .rules
            .iter()
            .position(|r| r.name == n)
            .unwrap_or_else(|| panic!("no rule {n}")),
        None => routes.rules.len(),
    };
    f(b.route_counters(i).expect("counters")).load(Ordering::Relaxed)
}

/// The services of `uas` that received anything of the calls `ids`.
fn reached(uas: &[&StrictUas], ids: &[String]) -> Vec<String> {
    uas.iter()
        .filter(|u| ids.iter().any(|id| !u.methods_of(id).is_empty()))
        .map(|u| u.name.clone())
        .collect()
}

fn sum(uas: &[&StrictUas], f: impl Fn(&Counts) -> u64) -> u64 {
    uas.iter().map(|u| f(&u.counts())).sum()
}

/// No service of `uas` answered 481 or got an ACK for no dialog of its own.
fn nothing_stray(uas: &[&StrictUas]) {
    for u in uas {
        let c = u.counts();
        assert_eq!((c.r481, c.stray_acks), (0, 0), "{}: {c:?}", u.name);
    }
}

/// A Kamailio registrar on 127.0.0.1 (bindings in memory, any domain; anything but a
/// REGISTER answered 404), and its address.
fn kamailio_registrar(scratch: &Scratch) -> (Proc, SocketAddr) {
    let (proc, port) = spawn_listening("registrar", Transport::Udp, |port| {
        let cfg = scratch.path(&format!("registrar-{port}.cfg"));
        let text = kamailio_cfg(
            port,
            &["kex", "sl", "usrloc", "registrar"],
            "modparam(\"usrloc\", \"db_mode\", 0)\n",
            "if (method == \"REGISTER\") { if (!save(\"location\")) { sl_reply_error(); } exit; }\n\
             sl_send_reply(\"404\", \"Not Here\"); exit;",
        );
        std::fs::write(&cfg, text).expect("write kamailio config");
        let mut c = Command::new("timeout");
        c.args(["-s", "KILL", "60", "kamailio", "-f"])
            .arg(cfg)
            .args(["-DD", "-E"]);
        c
    });
    (proc, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// Send `request` from `sock` to `to` (again, as Timer E would, when no answer comes) and
/// return the first final answer of its Call-ID.
fn final_answer(sock: &UdpSocket, to: SocketAddr, request: &str, call_id: &str) -> String {
    let mut buf = vec![0u8; 65_536];
    for _ in 0..3 {
        sock.send_to(request.as_bytes(), to).expect("send");
        let deadline = Instant::now() + ANSWER;
        while Instant::now() < deadline {
            let Ok((n, _)) = recv_from_retrying(sock, &mut buf) else {
                break;
            };
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            let code = fulcrum::sip::scan(&buf[..n])
                .ok()
                .and_then(|m| m.status_code());
            if text.contains(call_id) && code.is_some_and(|c| c >= 200) {
                return text;
            }
        }
    }
    panic!("no final answer to {call_id}");
}

/// A request from `sock` for `user@example.com` with Call-ID `call_id`, `extra` header lines.
fn request(sock: &UdpSocket, method: &str, user: &str, call_id: &str, extra: &str) -> String {
    let local = sock.local_addr().expect("addr");
    format!(
        "{method} sip:{user}@example.com SIP/2.0\r\nVia: SIP/2.0/UDP {local};branch=z9hG4bK-{call_id};rport\r\n\
         Max-Forwards: 70\r\nFrom: <sip:carol@example.com>;tag=c-{call_id}\r\nTo: <sip:{user}@example.com>{extra}\r\n\
         Call-ID: {call_id}\r\nCSeq: 1 {method}\r\nContact: <sip:carol@{local}>\r\nContent-Length: 0\r\n\r\n"
    )
}

/// One sip-udp listener in front of a Kamailio registrar (`aor_hash`), two call proxies (the
/// default pool), two gateways (numbers starting 112 or 911, written with a `+` and
/// separators) and a tenant's two PBXs (`b.example.com` and its subdomains): each kind of
/// request reaches only its pool, and every BYE its dialog's service, although a rule drops
/// each BYE outside a dialog (as one sent by hand is).
#[test]
fn each_kind_of_request_reaches_only_its_pool_and_byes_follow_their_dialogs() {
    if !sipp_available() || !kamailio_available() {
        return;
    }
    let scratch = Scratch::new("routes-farm");
    let (_kamailio, registrar) = kamailio_registrar(&scratch);
    let proxies = [StrictUas::udp("p0"), StrictUas::udp("p1")];
    let gateways = [StrictUas::udp("gw0"), StrictUas::udp("gw1")];
    let pbxs = [StrictUas::udp("pbx-b0"), StrictUas::udp("pbx-b1")];
    let mut services: Vec<(&str, SocketAddr)> = vec![("reg", registrar)];
    for u in proxies.iter().chain(&gateways).chain(&pbxs) {
        services.push((u.name.as_str(), u.addr));
    }
    let yaml = farm(
        &services,
        &["p0", "p1"],
        "    routes:
      - { name: registrar, match: { method: REGISTER }, services: [reg], method: aor_hash }
      - { name: stray-bye, match: { method: BYE }, drop: true }
      - { name: emergency, normalize: true, match: { ruri_user: { prefix: ['112', '911'] } }, services: [gw0, gw1] }
      - { name: tenant-b, match: { ruri_host: ['b.example.com', '*.b.example.com'] }, services: [pbx-b0, pbx-b1] }
    default: pool
",
    );
    let rt = start(&yaml);
    let lb = bound(&rt, "v");
    // The four kinds at once, each from a SIPp of its own.
    let runs = [
        ("reg", REGISTER, "example.com"),
        ("gw", CALL, "+9-11-[call_number]@gw.example.com;user=phone"),
        ("tenant", CALL, "alice[call_number]@eu.B.example.com"),
        ("other", CALL, "bob[call_number]@example.com"),
    ];
    let outcomes: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = runs
            .iter()
            .map(|(kind, template, ruri)| {
                let scratch = &scratch;
                s.spawn(move || run_uac(scratch, lb, template, ruri, kind))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("sipp thread"))
            .collect()
    });
    for ((kind, _, _), out) in runs.iter().zip(&outcomes) {
        all_completed(out, kind);
    }
    let all: Vec<&StrictUas> = proxies.iter().chain(&gateways).chain(&pbxs).collect();
    for (kind, own) in [
        ("gw", gateways.iter().collect::<Vec<_>>()),
        ("tenant", pbxs.iter().collect()),
        ("other", proxies.iter().collect()),
    ] {
        let ids = call_ids(kind);
        let got = reached(&all, &ids);
        let names: Vec<String> = own.iter().map(|u| u.name.clone()).collect();
        assert!(
            !got.is_empty() && got.iter().all(|n| names.contains(n)),
            "calls `{kind}` reached {got:?}, not only {names:?}"
        );
        // Every call set up, acknowledged and ended at the service that has it.
        assert_eq!(sum(&own, |c| c.dialogs), u64::from(CALLS), "{kind}");
        assert_eq!(sum(&own, |c| c.acked), u64::from(CALLS), "{kind}");
        assert_eq!(sum(&own, |c| c.byes_ok), u64::from(CALLS), "{kind}");
    }
    nothing_stray(&all);
    // No REGISTER reached a strict service: every one reached Kamailio, which holds each
    // phone's binding (asked directly, RFC 3261 §10.2.3: a REGISTER without Contact).
    assert_eq!(reached(&all, &call_ids("reg")), Vec::<String>::new());
    let ask = udp_client("127.0.0.1");
    for n in 1..=CALLS {
        let user = format!("user{n}");
        let id = format!("query-{n}");
        let query = format!(
            "REGISTER sip:example.com SIP/2.0\r\nVia: SIP/2.0/UDP {me};branch=z9hG4bK-{id}\r\n\
             Max-Forwards: 70\r\nFrom: <sip:{user}@example.com>;tag=q{n}\r\nTo: <sip:{user}@example.com>\r\n\
             Call-ID: {id}\r\nCSeq: 1 REGISTER\r\nContent-Length: 0\r\n\r\n",
            me = ask.local_addr().expect("addr")
        );
        let answer = final_answer(&ask, registrar, &query, &id);
        assert!(answer.starts_with("SIP/2.0 200"), "{answer}");
        assert!(
            answer.contains(&format!("<sip:{user}@127.0.0.1:")),
            "{user} is not bound at the registrar: {answer}"
        );
    }
    // A BYE outside any dialog (a To tag, no Route of fulcrum's) is dropped by its rule.
    let stray = udp_client("127.0.0.1");
    stray.set_read_timeout(Some(SILENCE)).expect("read timeout");
    let bye = request(&stray, "BYE", "bob1", "stray-bye", ";tag=nobody");
    stray.send_to(bye.as_bytes(), lb).expect("send BYE");
    let mut buf = vec![0u8; 65_536];
    assert!(
        recv_from_retrying(&stray, &mut buf).is_err(),
        "the stray BYE was answered: {}",
        String::from_utf8_lossy(&buf)
    );
    assert_eq!(
        reached(&all, &["stray-bye".to_owned()]),
        Vec::<String>::new()
    );
    assert_eq!(rule_counter(&rt, Some("stray-bye"), |c| &c.dropped), 1);
    for (rule, at_least) in [
        ("registrar", CALLS),
        ("emergency", CALLS),
        ("tenant-b", CALLS),
    ] {
        let matched = rule_counter(&rt, Some(rule), |c| &c.matched);
        assert!(matched >= u64::from(at_least), "{rule} matched {matched}");
    }
}

/// Two proxies that authenticate their callers (407 to an INVITE without credentials), in a
/// round-robin route pool: each INVITE sent again with credentials (same Call-ID, CSeq 2)
/// reaches the proxy that challenged it, where round robin alone would send it to the other.
#[test]
fn a_challenged_invites_retry_reaches_the_challenger() {
    if !sipp_available() {
        return;
    }
    let auth = [StrictUas::udp("auth0"), StrictUas::udp("auth1")];
    for u in &auth {
        u.set_sick(Sick::Challenging);
    }
    let proxy = StrictUas::udp("p0");
    let services = [
        ("auth0", auth[0].addr),
        ("auth1", auth[1].addr),
        ("p0", proxy.addr),
    ];
    let yaml = farm(
        &services,
        &["p0"],
        "    routes:
      - { name: pbx, match: { ruri_host: auth.example.com }, services: [auth0, auth1], method: round_robin }
",
    );
    let rt = start(&yaml);
    let scratch = Scratch::new("routes-challenge");
    let out = run_uac(
        &scratch,
        bound(&rt, "v"),
        CHALLENGED_CALL,
        "dave[call_number]@auth.example.com",
        "auth",
    );
    all_completed(&out, "challenged calls");
    let all = [&auth[0], &auth[1], &proxy];
    for id in call_ids("auth") {
        let got = reached(&all, std::slice::from_ref(&id));
        assert_eq!(got.len(), 1, "{id} reached {got:?}");
        let holder = all
            .iter()
            .find(|u| u.name == got[0])
            .expect("the service reached");
        let methods = holder.methods_of(&id);
        assert_eq!(
            methods.iter().filter(|m| *m == "INVITE").count(),
            2,
            "{id} at {}: {methods:?}",
            holder.name
        );
        assert_ne!(holder.name, "p0", "{id} left its route's pool");
    }
    // Round robin shared the first INVITEs; each proxy set up the calls it challenged.
    for u in &auth {
        let c = u.counts();
        assert!(c.challenges > 0, "{}: {c:?}", u.name);
        assert_eq!(c.dialogs, c.challenges, "{}: {c:?}", u.name);
        assert_eq!(c.byes_ok, c.dialogs, "{}: {c:?}", u.name);
    }
    assert_eq!(sum(&all, |c| c.dialogs), u64::from(CALLS));
    assert_eq!(proxy.counts(), Counts::default());
    nothing_stray(&all);
}

/// A gateway answering every INVITE 503: the calls of its route fail over to the other
/// gateway and complete, never reaching the default pool; with both gateways refusing, the
/// caller gets a 5xx (fulcrum's 500 after every try) and still nothing reaches the default
/// pool.
#[test]
fn a_route_pools_sick_service_fails_over_inside_the_pool_only() {
    if !sipp_available() {
        return;
    }
    let gateways = [StrictUas::udp("gw0"), StrictUas::udp("gw1")];
    gateways[0].set_sick(Sick::Busy);
    let proxies = [StrictUas::udp("p0"), StrictUas::udp("p1")];
    let mut services: Vec<(&str, SocketAddr)> = Vec::new();
    for u in gateways.iter().chain(&proxies) {
        services.push((u.name.as_str(), u.addr));
    }
    let yaml = farm(
        &services,
        &["p0", "p1"],
        "    routes:
      - { name: emergency, match: { ruri_user: { prefix: ['112', '911'] } }, services: [gw0, gw1], method: round_robin }
",
    );
    let rt = start(&yaml);
    let lb = bound(&rt, "v");
    let scratch = Scratch::new("routes-failover");
    let out = run_uac(&scratch, lb, CALL, "112[call_number]@example.com", "sos");
    all_completed(&out, "calls to the gateways");
    let (sick, well) = (gateways[0].counts(), gateways[1].counts());
    // Round robin asked the sick gateway first for one of the first two calls at least.
    assert!(sick.invites > 0, "gw0 was never asked: {sick:?}");
    assert_eq!(sick.dialogs, 0, "{sick:?}");
    assert_eq!(
        (well.dialogs, well.acked, well.byes_ok),
        (u64::from(CALLS), u64::from(CALLS), u64::from(CALLS)),
        "{well:?}"
    );
    for p in &proxies {
        assert_eq!(p.counts(), Counts::default(), "{}", p.name);
    }
    nothing_stray(&[&gateways[0], &gateways[1]]);
    // Both gateways refusing: the caller gets a server error, the call proxies nothing.
    gateways[1].set_sick(Sick::Busy);
    let asked = |g: &[StrictUas; 2]| g[0].counts().invites + g[1].counts().invites;
    let before = asked(&gateways);
    let phone = udp_client("127.0.0.1");
    for n in 0..3 {
        let id = format!("sos-exhausted-{n}");
        let invite = request(&phone, "INVITE", &format!("911{n}"), &id, "");
        let answer = final_answer(&phone, lb, &invite, &id);
        let code = fulcrum::sip::scan(answer.as_bytes())
            .ok()
            .and_then(|m| m.status_code());
        println!("{id}: {}", answer.lines().next().unwrap_or_default());
        assert!(code.is_some_and(|c| (500..600).contains(&c)), "{answer}");
    }
    assert!(
        asked(&gateways) >= before + 3,
        "the gateways were not asked: {before} INVITEs before, {} after",
        asked(&gateways)
    );
    for p in &proxies {
        assert_eq!(p.counts(), Counts::default(), "{}", p.name);
    }
    assert_eq!(rule_counter(&rt, None, |c| &c.unavailable), 0);
}

/// Two gateway pools, each with one gateway answering every INVITE 503: the rule with
/// `failover: off` forwards statelessly, so the sick gateway's 503 reaches the caller and its
/// calls fail; the rule that keeps the vserver's failover moves those calls to its other
/// gateway, and every call completes. Neither pool's calls reach the other's gateways or the
/// default pool.
#[test]
fn a_rule_with_failover_off_relays_the_503_and_one_with_it_on_fails_over() {
    if !sipp_available() {
        return;
    }
    let kept = [StrictUas::udp("gk0"), StrictUas::udp("gk1")];
    let plain = [StrictUas::udp("gp0"), StrictUas::udp("gp1")];
    kept[0].set_sick(Sick::Busy);
    plain[0].set_sick(Sick::Busy);
    let proxies = [StrictUas::udp("p0")];
    let mut services: Vec<(&str, SocketAddr)> = Vec::new();
    for u in kept.iter().chain(&plain).chain(&proxies) {
        services.push((u.name.as_str(), u.addr));
    }
    let yaml = farm(
        &services,
        &["p0"],
        "    routes:
      - { name: kept, match: { ruri_user: { prefix: ['4'] } }, services: [gk0, gk1], method: round_robin }
      - { name: plain, match: { ruri_user: { prefix: ['3'] } }, services: [gp0, gp1], method: round_robin, failover: off }
",
    );
    let rt = start(&yaml);
    let lb = bound(&rt, "v");
    let scratch = Scratch::new("routes-pool-failover");
    // Failover on: every call completes on the well gateway.
    let out = run_uac(&scratch, lb, CALL, "4[call_number]@example.com", "kept");
    all_completed(&out, "calls with failover");
    let (sick, well) = (kept[0].counts(), kept[1].counts());
    assert!(sick.invites > 0, "gk0 was never asked: {sick:?}");
    assert_eq!(sick.dialogs, 0, "{sick:?}");
    assert_eq!(
        (well.dialogs, well.byes_ok),
        (u64::from(CALLS), u64::from(CALLS)),
        "{well:?}"
    );
    // Failover off: the calls round robin gave the sick gateway get its 503.
    let out = run_uac(&scratch, lb, CALL, "3[call_number]@example.com", "plain");
    let (sick, well) = (plain[0].counts(), plain[1].counts());
    println!("failover off: {out:?}, sick {sick:?}, well {well:?}");
    assert!(out.failed > 0, "no call failed: {out:?}");
    assert_eq!(out.successful + out.failed, u64::from(CALLS), "{out:?}");
    assert_eq!(
        out.failed, sick.invites,
        "each failed call asked gp0 once: {sick:?}"
    );
    assert_eq!(
        (well.invites, well.dialogs, well.byes_ok),
        (out.successful, out.successful, out.successful),
        "gp1 got no call of gp0's: {well:?}"
    );
    assert!(
        out.messages.contains("SIP/2.0 503 Service Unavailable"),
        "the caller never saw the 503"
    );
    for p in &proxies {
        assert_eq!(p.counts(), Counts::default(), "{}", p.name);
    }
    assert_eq!(
        reached(&[&kept[0], &kept[1]], &call_ids("plain")),
        Vec::<String>::new()
    );
    assert_eq!(
        reached(&[&plain[0], &plain[1]], &call_ids("kept")),
        Vec::<String>::new()
    );
}

/// Whether SIPVicious's `svmap` is installed; a failure under FULCRUM_REQUIRE_SIPVICIOUS=1.
fn svmap_available() -> bool {
    let found = ["/usr/bin", "/usr/local/bin"]
        .iter()
        .any(|d| std::path::Path::new(d).join("svmap").is_file());
    if !found {
        assert!(
            std::env::var("FULCRUM_REQUIRE_SIPVICIOUS").as_deref() != Ok("1"),
            "svmap (SIPVicious) is not installed, and FULCRUM_REQUIRE_SIPVICIOUS=1"
        );
        println!(
            "SKIP: svmap is not installed (apt-get install sipvicious; FULCRUM_REQUIRE_SIPVICIOUS=1 makes this a failure)"
        );
    }
    found
}

/// `svmap -m METHOD` from 127.0.0.1:`source` against `ports` of 127.0.0.1, for at most 20 s;
/// its output.
fn svmap(method: &str, ports: &str, source: u16) -> String {
    let out = Command::new("timeout")
        .args(["20", "svmap", "-m", method, "-p", ports])
        .args(["-b", "127.0.0.1", "-P", &source.to_string()])
        .arg("127.0.0.1")
        .stdin(Stdio::null())
        .output()
        .expect("run svmap");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// svmap (User-Agent `friendly-scanner`) scans two vservers at once: the one with the
/// `scanners` rule drops it, its services see nothing and svmap does not find it; it finds
/// the other, whose services answered. A phone's request still passes the first.
#[test]
fn svmap_is_dropped_by_a_user_agent_rule_and_costs_the_services_nothing() {
    if !svmap_available() {
        return;
    }
    let guarded = [StrictUas::udp("p0"), StrictUas::udp("p1")];
    let open = StrictUas::udp("open0");
    let yaml = format!(
        "{}  - {{ name: w, protocol: sip-udp, bind: [\"127.0.0.1:0\"], services: [open0] }}\n",
        farm(
            &[
                ("p0", guarded[0].addr),
                ("p1", guarded[1].addr),
                ("open0", open.addr)
            ],
            &["p0", "p1"],
            "    routes:
      - { name: scanners, match: { header: { name: User-Agent, regex: '(?i)friendly-scanner|sipvicious' } }, drop: true }
",
        )
    );
    let rt = start(&yaml);
    let (v, w) = (bound(&rt, "v"), bound(&rt, "w"));
    let ports = format!("{},{}", v.port(), w.port());
    for method in ["OPTIONS", "INVITE"] {
        // svmap's source port, given explicitly: one free a moment ago.
        let source = UdpSocket::bind("127.0.0.1:0")
            .and_then(|s| s.local_addr())
            .expect("a free port")
            .port();
        let out = svmap(method, &ports, source);
        println!("svmap -m {method}: {out}");
        assert!(
            out.contains(&format!("127.0.0.1:{}", w.port())),
            "svmap -m {method} did not find the vserver without the rule: {out}"
        );
        assert!(
            !out.contains(&format!("127.0.0.1:{}", v.port())),
            "svmap -m {method} found the guarded vserver: {out}"
        );
    }
    for u in &guarded {
        assert_eq!(u.counts(), Counts::default(), "{}", u.name);
    }
    assert!(open.counts().requests >= 2, "{:?}", open.counts());
    assert!(rule_counter(&rt, Some("scanners"), |c| &c.dropped) >= 2);
    // A phone's OPTIONS passes the guarded vserver.
    let phone = udp_client("127.0.0.1");
    let options = request(&phone, "OPTIONS", "100", "phone-options", "");
    let answer = final_answer(&phone, v, &options, "phone-options");
    assert!(answer.starts_with("SIP/2.0 200"), "{answer}");
    assert_eq!(sum(&[&guarded[0], &guarded[1]], |c| c.requests), 1);
}

/// A call to a barred prefix gets the rule's 403 with its reason, from fulcrum itself (no
/// 100 Trying before it), and its ACK ends the transaction; no service sees any of it.
#[test]
fn a_barred_prefix_gets_the_rules_403_and_reaches_no_service() {
    if !sipp_available() {
        return;
    }
    let proxies = [StrictUas::udp("p0"), StrictUas::udp("p1")];
    let yaml = farm(
        &[("p0", proxies[0].addr), ("p1", proxies[1].addr)],
        &["p0", "p1"],
        "    routes:
      - { name: barred, match: { ruri_user: { prefix: ['00'] } }, reject: { code: 403, reason: Barred } }
",
    );
    let rt = start(&yaml);
    let scratch = Scratch::new("routes-reject");
    let out = run_uac(
        &scratch,
        bound(&rt, "v"),
        REFUSED_CALL,
        "0044207946[call_number]@example.com",
        "barred",
    );
    all_completed(&out, "barred calls");
    let finals = out.messages.matches("SIP/2.0 403 Barred\r\n").count();
    assert!(
        finals >= CALLS as usize,
        "{finals} copies of `403 Barred` for {CALLS} calls"
    );
    assert!(
        !out.messages.contains("SIP/2.0 100 "),
        "a 100 Trying came before the refusal"
    );
    for p in &proxies {
        assert_eq!(p.counts(), Counts::default(), "{}", p.name);
    }
    assert!(rule_counter(&rt, Some("barred"), |c| &c.rejected) >= u64::from(CALLS));
}

/// `fulcrum route` with `args`, `stdin` given to it; exit code, stdout, stderr.
fn route_cli(args: &[&str], stdin: &str) -> (Option<i32>, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_fulcrum"))
        .arg("route")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run fulcrum route");
    if let Some(mut i) = child.stdin.take() {
        i.write_all(stdin.as_bytes()).expect("stdin");
    }
    let out = child.wait_with_output().expect("fulcrum route");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `fulcrum route` over the shipped example (config/routes.yaml): a message file with LF line
/// ends, and stdin; each rule kind named with its target and the service a fresh balancer
/// picks; exit 2 for a bad config (printed as `fulcrum check` prints it), an unknown vserver, a
/// vserver without routes, an unreadable file and a message that is no request.
#[test]
fn the_route_command_names_the_rule_its_target_and_the_service() {
    let scratch = Scratch::new("route-cli");
    let invite = |ruri: &str, extra: &str| {
        format!(
            "INVITE sip:{ruri} SIP/2.0\nVia: SIP/2.0/UDP 192.0.2.7:5070;branch=z9hG4bK1\nFrom: <sip:carol@example.com>;tag=1\nTo: <sip:{ruri}>\nCall-ID: cli-1\nCSeq: 1 INVITE\nMax-Forwards: 70\n{extra}"
        )
    };
    let file = scratch.path("invite.sip");
    std::fs::write(&file, invite("+1-911@example.com", "")).expect("write");
    let file = file.to_string_lossy().into_owned();
    let cfg = ["--config", "config/routes.yaml", "--vserver", "edge"];
    let (code, out, err) = route_cli(&[&cfg[..], &[file.as_str()]].concat(), "");
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("rule: emergency\n"), "{out}");
    assert!(
        out.contains("target: pool emergency (call_id_hash): e911-1, e911-2\n"),
        "{out}"
    );
    assert!(
        out.contains("service: e911-") && out.contains("every service considered UP"),
        "{out}"
    );
    assert!(out.contains("source: 192.0.2.7:5070\n"), "{out}");
    // From stdin, with the source given: the default pool, a refusal, a drop.
    let stdin = |extra: &[&str], text: &str| route_cli(&[&cfg[..], extra, &["-"]].concat(), text);
    let (code, out, _) = stdin(
        &["--source", "203.0.113.9:5060"],
        &invite("bob@example.com", ""),
    );
    assert_eq!(code, Some(0));
    assert!(out.contains("rule: (none matched: the default)\n"), "{out}");
    assert!(
        out.contains("target: pool default (call_id_hash): proxy-1, proxy-2\n"),
        "{out}"
    );
    assert!(out.contains("source: 203.0.113.9:5060\n"), "{out}");
    let (_, out, _) = stdin(&[], &invite("0044123@example.com", ""));
    assert!(
        out.contains("rule: international\ntarget: reject 403 International calls barred\n"),
        "{out}"
    );
    let (_, out, _) = stdin(
        &["--json"],
        &invite("bob@example.com", "User-Agent: sipvicious\n"),
    );
    let a: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(a["rule"], "scanners");
    assert_eq!(a["target"]["action"], "drop");
    // Failures: exit 2 with the reason on stderr.
    let bad = scratch.path("bad.yaml");
    std::fs::write(&bad, "vservers:\n  - { name: v, protocol: sip-udp }\n").expect("write");
    let bad = bad.to_string_lossy().into_owned();
    let (code, out, err) = route_cli(&["--config", &bad, "--vserver", "v", "-"], "");
    assert_eq!(code, Some(2), "{out}");
    assert!(
        err.contains(&format!("{bad}:2:")),
        "as `fulcrum check` prints it: {err}"
    );
    for (args, text, why) in [
        (
            &["--config", "config/routes.yaml", "--vserver", "nope", "-"][..],
            "",
            "no vserver `nope`",
        ),
        (
            &[
                "--config",
                "config/sip-udp.yaml",
                "--vserver",
                "sip-lb",
                "-",
            ][..],
            "INVITE sip:a@b SIP/2.0\nVia: SIP/2.0/UDP 1.2.3.4\nCall-ID: x\nCSeq: 1 INVITE\n",
            "has no routes",
        ),
        (
            &[&cfg[..], &["/nonexistent/message.sip"]].concat()[..],
            "",
            "reading /nonexistent/message.sip",
        ),
        (
            &[&cfg[..], &["-"]].concat()[..],
            "hello\n",
            "not a SIP message",
        ),
        (
            &[&cfg[..], &["-"]].concat()[..],
            "SIP/2.0 200 OK\nVia: SIP/2.0/UDP 1.2.3.4\nCall-ID: x\nCSeq: 1 INVITE\n",
            "a response",
        ),
    ] {
        let (code, out, err) = route_cli(args, text);
        assert_eq!(code, Some(2), "{args:?}: {out}{err}");
        assert!(err.contains(why), "{args:?}: {err}");
    }
}
