//! The tests' strict SIP UAS (tests/common/strict_uas.rs: 481 to a request for a dialog it
//! did not set up) as a program, for bench/ha.sh: `strict_uas COUNTS NAME=ADDR...` runs one
//! UDP UAS per NAME=ADDR and rewrites COUNTS every 100 ms with one line per UAS:
//! `name requests dialogs byes_ok r481 stray_acks`. Runs until killed. IO.
#![allow(dead_code)]

#[path = "../tests/common/sip_tcp.rs"]
mod sip_tcp;
#[path = "../tests/common/strict_uas.rs"]
mod strict_uas;

use std::time::Duration;
use strict_uas::StrictUas;

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(counts) = args.next() else {
        eprintln!("usage: strict_uas COUNTS NAME=ADDR...");
        std::process::exit(2);
    };
    let uas: Vec<StrictUas> = args
        .map(|a| {
            let (name, addr) = a.split_once('=').unwrap_or_else(|| {
                eprintln!("strict_uas: `{a}` is not NAME=ADDR");
                std::process::exit(2)
            });
            let addr = addr.parse().unwrap_or_else(|e| {
                eprintln!("strict_uas: `{addr}`: {e}");
                std::process::exit(2)
            });
            StrictUas::udp_on(name, addr)
        })
        .collect();
    let tmp = format!("{counts}.tmp");
    loop {
        let text: String = uas
            .iter()
            .map(|u| {
                let c = u.counts();
                format!(
                    "{} {} {} {} {} {}\n",
                    u.name, c.requests, c.dialogs, c.byes_ok, c.r481, c.stray_acks
                )
            })
            .collect();
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, &counts);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
