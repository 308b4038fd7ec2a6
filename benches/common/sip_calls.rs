//! The SIPp-shaped calls of `benches/sip_udp_core.rs` and `examples/sip_core_calls.rs`
//! (included by path by both): the vserver, its core, and the messages of one call as SIPp's
//! `uac` / `uas` write them.

use fulcrum::balancer::Balancer;
use fulcrum::config;
use fulcrum::core::sip::{SipCore, SipParams};
use fulcrum::sip::{Local, Transport};
use std::sync::Arc;
use std::time::Duration;

const YAML: &str = "admin: { listen: null }
services:
  - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }
  - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }
  - { name: c, address: 127.0.0.1:5073, protocol: sip-udp }
vservers:
  - name: v
    protocol: sip-udp
    bind: [127.0.0.1:5060]
    method: call_id_hash
    services: [a, b, c]
";

pub fn core(record_route: bool) -> SipCore {
    let cfg = config::from_str("bench.yaml", YAML).expect("config");
    let v = &cfg.vservers[0];
    let members = cfg.services.iter().map(|s| s.address).collect();
    SipCore::new(SipParams {
        name: "v".into(),
        local: Local::from_addr("127.0.0.1:5060".parse().expect("addr"), Transport::Udp),
        record_route,
        method: v.method,
        hash_params: v.hash.clone(),
        balancer: Arc::new(Balancer::new(&cfg, v)),
        member_addrs: members,
        max_dialogs: 1_000_000,
        dialog_idle: Duration::from_secs(3600),
        member_transports: Vec::new(),
        legs: Vec::new(),
        service_source: None,
        pool_failovers: Vec::new(),
    })
}

/// The SIPp `uac` / `uas` messages of call `n` (as SIPp writes them, SDP included).
pub fn request(method: &str, n: u64, branch: &str, to_tag: &str, cseq: &str, sdp: bool) -> Vec<u8> {
    let body = if sdp {
        "v=0\r\no=user1 53655765 2353687637 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\nm=audio 6004 RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n"
    } else {
        ""
    };
    format!(
        "{method} sip:service@127.0.0.1:5060 SIP/2.0\r\n\
         Via: SIP/2.0/UDP 127.0.0.1:5070;branch={branch}\r\n\
         From: sipp <sip:sipp@127.0.0.1:5070>;tag=1SIPpTag00{n}\r\n\
         To: service <sip:service@127.0.0.1:5060>{to_tag}\r\n\
         Call-ID: {n}-1234@127.0.0.1\r\n\
         CSeq: {cseq}\r\n\
         Contact: sip:sipp@127.0.0.1:5070\r\n\
         Max-Forwards: 70\r\n\
         Subject: Performance Test\r\n\
         Content-Type: application/sdp\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A response the UAS writes for the forwarded request `fwd`: its Vias copied.
pub fn response(fwd: &[u8], status: &str) -> Vec<u8> {
    let text = String::from_utf8_lossy(fwd);
    let mut out = format!("SIP/2.0 {status}\r\n");
    for line in text.split("\r\n").skip(1).take_while(|l| !l.is_empty()) {
        let name = line.split(':').next().unwrap_or("");
        if ["Via", "From", "Call-ID", "CSeq"].contains(&name) {
            out.push_str(line);
            out.push_str("\r\n");
        } else if name == "To" {
            out.push_str(line);
            out.push_str(";tag=uas1\r\n");
        }
    }
    out.push_str("Contact: <sip:127.0.0.1:5071;transport=UDP>\r\nContent-Length: 0\r\n\r\n");
    out.into_bytes()
}
