//! Routing rules' cost per request: ten rules of every kind over a scanned INVITE that none of
//! them matches (every rule read, the default decides), the same with the first rule matching,
//! and the whole sip-udp decision of an INVITE with those ten rules beside the same vserver
//! without rules, in one run.
//!
//! `cargo bench --bench routes`

use criterion::{Criterion, criterion_group, criterion_main};
use fulcrum::balancer::Balancer;
use fulcrum::core::sip::{SipCore, SipParams};
use fulcrum::route::Request;
use fulcrum::sip::{Local, Transport, scan};
use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

const INVITE: &[u8] = include_bytes!("../fixtures/sip/invite.sip");

/// Ten rules, every key kind once or more; none matches the fixture's INVITE (to
/// bob@biloxi.example.com, from alice@atlanta.example.com, no User-Agent).
const RULES: &str = "
    routes:
      - { name: registrar, match: { method: [REGISTER, SUBSCRIBE] }, services: [b] }
      - { name: emergency, normalize: true, match: { ruri_user: { prefix: ['112', '911', '1911', '999'] } }, services: [b] }
      - { name: tenant-b, match: { ruri_host: [b.example.com, '*.b.example.com', '*.tenant.test'] }, services: [b] }
      - { name: tenant-c, match: { to_host: ['*.c.example.com'] }, services: [b] }
      - { name: partner, match: { from_host: [partner.example.net], from_user: ['+4420'] }, services: [b] }
      - { name: lan, match: { source: [10.0.0.0/8, 172.16.0.0/12], local: ['192.0.2.9'] }, services: [b] }
      - { name: scanners, match: { header: { name: User-Agent, regex: '(?i)friendly-scanner|sipvicious|sipcli' } }, drop: true }
      - { name: conference, match: { header: { name: Subject, prefix: [conf-] } }, services: [b] }
      - { name: numbers, match: { ruri_user: { regex: '^\\+?44[0-9]{9,10}$' } }, services: [b] }
      - { name: barred, match: { ruri_user: { prefix: ['00', '+882'] } }, reject: { code: 403 } }
";

fn config(rules: &str) -> fulcrum::config::Config {
    let y = format!(
        "services:\n  - {{ name: a, address: 127.0.0.1:5071, protocol: sip-udp }}\n  - {{ name: b, address: 127.0.0.1:5072, protocol: sip-udp }}\nvservers:\n  - name: v\n    protocol: sip-udp\n    bind: 127.0.0.1:5060\n    services: [a]\n{rules}"
    );
    fulcrum::config::from_str("bench", &y).expect("config")
}

fn core(cfg: &fulcrum::config::Config) -> SipCore {
    let v = &cfg.vservers[0];
    SipCore::new(SipParams::of(
        cfg,
        v,
        Local::from_addr("127.0.0.1:5060".parse().expect("addr"), Transport::Udp),
        Arc::new(Balancer::new(cfg, v)),
    ))
}

fn bench(c: &mut Criterion) {
    let src: SocketAddr = "198.51.100.7:40000".parse().expect("addr");
    let dst: SocketAddr = "192.0.2.1:5060".parse().expect("addr");
    let cfg = config(RULES);
    let routes = cfg.vservers[0].routes.clone().expect("routes");
    let msg = scan(INVITE).expect("scan");
    let mut g = c.benchmark_group("routes");
    g.bench_function("decide_10_rules_none_matching", |b| {
        b.iter(|| {
            let mut r = Request::new(black_box(&msg), src, dst);
            black_box(routes.decide(&mut r).rule)
        })
    });
    let first = INVITE.to_vec();
    let register = String::from_utf8(first)
        .expect("utf8")
        .replacen("INVITE", "REGISTER", 1);
    let reg = scan(register.as_bytes()).expect("scan");
    g.bench_function("decide_first_rule_matching", |b| {
        b.iter(|| {
            let mut r = Request::new(black_box(&reg), src, dst);
            black_box(routes.decide(&mut r).rule)
        })
    });
    // The whole decision and rewrite of an INVITE (scan included), each with a new Call-ID so
    // nothing is found in the dialog table; the table swept as it grows.
    let plain = core(&config(""));
    let routed = core(&cfg);
    let text = String::from_utf8(INVITE.to_vec()).expect("utf8");
    for (name, core) in [
        ("invite_without_rules", &plain),
        ("invite_with_10_rules", &routed),
    ] {
        let n = std::cell::Cell::new(0u64);
        let mut out = Vec::with_capacity(4096);
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    n.set(n.get() + 1);
                    text.replace("a84b4c76e66710", &format!("c{:012}", n.get()))
                },
                |m| {
                    let k = n.get();
                    if k.is_multiple_of(4096) {
                        core.sweep(k * 1_000_000);
                    }
                    black_box(core.handle_datagram(m.as_bytes(), src, dst, k * 1_000, &mut out))
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50).measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
