//! Admin API routing on arbitrary requests (method, path, token, body) against a running
//! proxy (one sip-udp vserver on loopback, two services, a token): every request gets an
//! answer with a status code, none panics. The proxy is started once for the whole run.
#![no_main]

use fulcrum::admin::router::{self, Request};
use fulcrum::config;
use fulcrum::ops::Ops;
use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};

const YAML: &str = "admin: { listen: null, token: s3cret }
services:
  - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }
  - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }
vservers:
  - name: v
    protocol: sip-udp
    bind: [127.0.0.1:0]
    workers: 1
    slow_start: { new_service_request_rate: 5 }
    method: round_robin
    services: [a, b]
";

fn ops() -> &'static Arc<Ops> {
    static OPS: OnceLock<Arc<Ops>> = OnceLock::new();
    OPS.get_or_init(|| {
        let c = config::from_str("fuzz.yaml", YAML).expect("config");
        Ops::start(c, None).expect("start")
    })
}

const METHODS: [&str; 5] = ["GET", "POST", "PUT", "DELETE", "PATCH"];

fuzz_target!(|data: &[u8]| {
    let Some((&k, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    let (path, body) = text.split_once('\n').unwrap_or((&text, ""));
    let mut req = Request::new(METHODS[usize::from(k) % METHODS.len()], path);
    if k & 0x80 != 0 {
        req.authorization = Some("Bearer s3cret".into());
    }
    req.body = body.as_bytes().to_vec();
    let r = router::handle(ops(), &req);
    assert!((100..600).contains(&r.status), "{}", r.status);
});
