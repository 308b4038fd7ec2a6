use super::*;
use crate::config::from_str;

const S: u64 = 1_000_000_000;

fn cfg(extra: &str) -> Config {
    from_str(
        "t.yaml",
        &format!(
            "admin: {{ listen: null }}\n\
             dns: {{ min_refresh: 2s, max_refresh: 60s }}\n\
             services:\n\
             \x20 - {{ name: fixed, address: 127.0.0.1:7001, protocol: sip-udp }}\n\
             \x20 - {{ name: pool, dns: sip.pool.test, port: 5070, protocol: sip-udp, weight: 3 }}\n\
             \x20 - {{ name: srv, dns: _sip._udp.pool.test, protocol: sip-udp }}\n{extra}\
             vservers:\n  - {{ name: v, protocol: sip-udp, bind: 127.0.0.1:9000, method: call_id_hash, services: [fixed, pool, srv] }}\n"
        ),
    )
    .expect("valid test config")
}

fn t(addr: &str, priority: u16, weight: u16) -> Target {
    Target {
        addr: addr.parse().expect("addr"),
        priority,
        weight,
        share: 1,
    }
}

fn names(c: &Config, idx: &[usize]) -> Vec<String> {
    idx.iter().map(|&i| c.services[i].name.clone()).collect()
}

#[test]
fn the_file_names_its_pools_and_expand_puts_their_members_in_their_place() {
    let file = cfg("");
    let pool = &file.services[1];
    assert_eq!(
        pool.dns,
        Some(DnsName {
            name: "sip.pool.test.".into(),
            kind: DnsKind::Host { port: 5070 }
        })
    );
    assert_eq!(
        file.services[2].dns.as_ref().map(|d| d.kind),
        Some(DnsKind::Srv)
    );
    assert_eq!(
        file.vservers[0].discovered,
        [crate::config::Protocol::SipUdp]
    );
    // Nothing known yet: the pools leave no service.
    let none = expand(&file, &BTreeMap::new());
    assert_eq!(names(&none, &none.vservers[0].services), ["fixed"]);
    let mut found = BTreeMap::new();
    found.insert(
        "pool".to_owned(),
        vec![t("10.0.0.2:5070", 0, 0), t("10.0.0.1:5070", 0, 0)],
    );
    found.insert(
        "srv".to_owned(),
        vec![t("10.0.1.1:5080", 10, 60), t("10.0.1.2:5081", 20, 0)],
    );
    let mut sorted = found.clone();
    for v in sorted.values_mut() {
        v.sort();
    }
    let c = expand(&file, &sorted);
    assert_eq!(
        names(&c, &c.vservers[0].services),
        [
            "fixed",
            "pool@10.0.0.1:5070",
            "pool@10.0.0.2:5070",
            "srv@10.0.1.1:5080",
            "srv@10.0.1.2:5081"
        ]
    );
    let s = |n: &str| c.services.iter().find(|s| s.name == n).expect(n);
    // A / AAAA members: the pool's weight, no priority; SRV members: theirs.
    assert_eq!(
        (
            s("pool@10.0.0.1:5070").weight,
            s("pool@10.0.0.1:5070").tier()
        ),
        (3, 0)
    );
    assert_eq!(
        (s("srv@10.0.1.1:5080").weight, s("srv@10.0.1.1:5080").tier()),
        (60, 10)
    );
    assert_eq!(
        (s("srv@10.0.1.2:5081").weight, s("srv@10.0.1.2:5081").tier()),
        (1, 20)
    );
    assert!(c.services.iter().all(|s| s.dns.is_none()));
    // Hashed by address and port: the same records give the same members everywhere.
    assert_eq!(s("pool@10.0.0.2:5070").hash_id, None);
    assert_eq!(expand(&file, &sorted), c);
}

#[test]
fn srv_weights_above_100_are_scaled_and_zero_is_the_least() {
    let file = cfg("");
    let mut found = BTreeMap::new();
    found.insert(
        "srv".to_owned(),
        vec![
            t("10.0.1.1:5080", 0, 1000),
            t("10.0.1.2:5080", 0, 250),
            t("10.0.1.3:5080", 0, 0),
        ],
    );
    let c = expand(&file, &found);
    let w: Vec<u32> = c.services[1..].iter().map(|s| s.weight).collect();
    assert_eq!(w, [100, 25, 1]);
}

#[test]
fn a_found_answer_sets_the_members_and_the_next_lookup_at_its_ttl() {
    let file = cfg("");
    let mut pools = Pools::default();
    pools.sync(&file, 5);
    assert_eq!(pools.due(5).len(), 2);
    let p = pools.by_service.get_mut("pool").expect("pool");
    let found = Outcome::Found {
        targets: vec![
            t("10.0.0.2:5070", 0, 0),
            t("10.0.0.1:5070", 0, 0),
            t("10.0.0.1:5070", 0, 0),
        ],
        ttl: 30,
    };
    assert!(p.record(found.clone(), 10 * S, &file.dns));
    assert_eq!(p.members.len(), 2, "sorted, one per address");
    // At the TTL, up to a tenth earlier (the jitter of round 1 of this name).
    let name = p.dns.name.clone();
    assert_eq!(p.next, 10 * S + jittered(30 * S, &name, 1, 2 * S));
    assert!((37 * S..=40 * S).contains(&p.next), "{}", p.next);
    assert!(
        !p.record(found, 40 * S, &file.dns),
        "the same answer changes nothing"
    );
    // TTLs are clamped to min_refresh..=max_refresh. A member leaves after two answers in a
    // row without it.
    let tiny = Outcome::Found {
        targets: vec![t("10.0.0.1:5070", 0, 0)],
        ttl: 0,
    };
    assert!(
        !p.record(tiny.clone(), 50 * S, &file.dns),
        "one answer without it: kept"
    );
    assert_eq!(p.next, 52 * S, "min_refresh is a floor, jitter or not");
    assert!(p.record(tiny, 52 * S, &file.dns), "the second: gone");
    assert_eq!(p.members.len(), 1);
    let huge = Outcome::Found {
        targets: vec![t("10.0.0.1:5070", 0, 0)],
        ttl: 86_400,
    };
    p.record(huge, 60 * S, &file.dns);
    assert_eq!(p.next, 60 * S + jittered(60 * S, &name, 5, 2 * S));
    assert!((114 * S..=120 * S).contains(&p.next), "{}", p.next);
    assert_eq!(p.lookups.found, 5);
}

/// The jitter takes at most a tenth off, never goes below the floor, is the same for the
/// same name and round, and spreads names and rounds over the whole tenth.
#[test]
fn refreshes_are_jittered_by_up_to_a_tenth_and_deterministically() {
    let wait = 30 * S;
    let mut seen = Vec::new();
    for round in 0..200 {
        for name in ["a.example.", "b.example.", "sip.pool.test."] {
            let j = jittered(wait, name, round, 0);
            assert!((27 * S..=30 * S).contains(&j), "{j}");
            assert_eq!(j, jittered(wait, name, round, 0));
            seen.push(j);
        }
    }
    let (lo, hi) = (
        seen.iter().min().copied().unwrap_or(0),
        seen.iter().max().copied().unwrap_or(0),
    );
    assert!(lo < 27 * S + S / 5 && hi > 30 * S - S / 5, "{lo}..{hi}");
    assert_eq!(
        jittered(wait, "a.example.", 7, 29 * S).max(29 * S),
        jittered(wait, "a.example.", 7, 29 * S)
    );
    assert_eq!(
        jittered(S, "a.example.", 7, 5 * S),
        S,
        "a floor above the wait leaves it"
    );
}

#[test]
fn a_failed_lookup_keeps_the_last_answer_and_says_so() {
    let file = cfg("");
    let mut pools = Pools::default();
    pools.sync(&file, 0);
    let p = pools.by_service.get_mut("pool").expect("pool");
    p.record(
        Outcome::Found {
            targets: vec![t("10.0.0.1:5070", 0, 0)],
            ttl: 5,
        },
        0,
        &file.dns,
    );
    assert!(pools.notes(0).iter().all(|n| !n.contains("service pool")));
    let p = pools.by_service.get_mut("pool").expect("pool");
    assert!(!p.record(Outcome::Failed("timed out".into()), 5 * S, &file.dns));
    assert_eq!(p.members.len(), 1, "a DNS outage never empties a pool");
    assert!(p.is_stale());
    assert_eq!(p.next, 7 * S, "min_refresh first");
    p.record(Outcome::Failed("timed out".into()), 7 * S, &file.dns);
    assert_eq!(p.next, 11 * S, "then twice the outage so far");
    for i in 0..20 {
        let now = p.next;
        p.record(Outcome::Failed(format!("timed out {i}")), now, &file.dns);
    }
    let at = p.next;
    p.record(Outcome::Failed("x".into()), at, &file.dns);
    assert_eq!(p.next - at, 60 * S, "up to max_refresh");
    let notes = pools.notes(at);
    assert!(
        notes.iter().any(|n| n
            .starts_with("service pool: DNS lookups of sip.pool.test failing for")
            && n.contains("keeping the 1 member(s)")),
        "{notes:?}"
    );
    // The answer comes back: no longer stale.
    let p = pools.by_service.get_mut("pool").expect("pool");
    p.record(
        Outcome::Found {
            targets: vec![t("10.0.0.1:5070", 0, 0)],
            ttl: 5,
        },
        at + S,
        &file.dns,
    );
    assert!(!p.is_stale());
    assert_eq!(p.lookups.failed, 23);
}

#[test]
fn an_authoritative_empty_answer_empties_the_pool() {
    let file = cfg("");
    let mut pools = Pools::default();
    pools.sync(&file, 0);
    let p = pools.by_service.get_mut("srv").expect("srv");
    p.record(
        Outcome::Found {
            targets: vec![t("10.0.1.1:5080", 0, 0)],
            ttl: 5,
        },
        0,
        &file.dns,
    );
    assert!(
        !p.record(Outcome::Empty, S, &file.dns),
        "the first empty answer: kept"
    );
    assert_eq!(p.next, 3 * S);
    assert!(
        p.record(Outcome::Empty, 3 * S, &file.dns),
        "the second: emptied"
    );
    assert!(p.members.is_empty() && p.answered && !p.is_stale());
}

#[test]
fn pools_follow_the_file_a_changed_name_starts_afresh() {
    let file = cfg("");
    let mut pools = Pools::default();
    pools.sync(&file, 0);
    pools.by_service.get_mut("pool").expect("pool").record(
        Outcome::Found {
            targets: vec![t("10.0.0.1:5070", 0, 0)],
            ttl: 5,
        },
        0,
        &file.dns,
    );
    pools.sync(&file, S);
    assert_eq!(pools.members()["pool"].len(), 1, "kept across a reload");
    let mut renamed = file.clone();
    if let Some(d) = renamed.services[1].dns.as_mut() {
        d.name = "other.pool.test.".into();
    }
    renamed.services.remove(2);
    pools.sync(&renamed, 2 * S);
    assert!(pools.members()["pool"].is_empty());
    assert!(!pools.by_service.contains_key("srv"));
    assert_eq!(pools.next_due(), Some(2 * S));
    let notes = pools.notes(2 * S);
    assert_eq!(
        notes,
        ["service pool: no DNS answer yet for other.pool.test (no answer)"]
    );
}

fn part(name: &str, family: Family, srv: (u16, u16, u16), answer: Result<&[&str], &str>) -> Part {
    Part {
        key: (name.to_owned(), family),
        srv,
        answer: answer
            .map(|ips| (ips.iter().map(|ip| ip.parse().expect("ip")).collect(), 30))
            .map_err(str::to_owned),
    }
}

/// A resolver that drops AAAA queries (a failed part) keeps the AAAA part's last addresses
/// and takes the A part's news; with every part failing the lookup is a failure.
#[test]
fn a_failing_family_keeps_its_last_addresses_and_the_other_family_moves_on() {
    let file = cfg("");
    let mut pools = Pools::default();
    pools.sync(&file, 0);
    let p = pools.by_service.get_mut("pool").expect("pool");
    let both = Outcome::Parts(vec![
        part("", Family::V4, (0, 0, 5070), Ok(&["10.0.0.1"])),
        part("", Family::V6, (0, 0, 5070), Ok(&["2001:db8::1"])),
    ]);
    assert!(p.record(both, 0, &file.dns));
    assert_eq!(p.members.len(), 2);
    let aaaa_dropped = Outcome::Parts(vec![
        part("", Family::V4, (0, 0, 5070), Ok(&["10.0.0.1", "10.0.0.2"])),
        part("", Family::V6, (0, 0, 5070), Err("timed out")),
    ]);
    assert!(p.record(aaaa_dropped, 30 * S, &file.dns));
    let addrs: Vec<String> = p.members.iter().map(|t| t.addr.to_string()).collect();
    assert_eq!(
        addrs,
        ["10.0.0.1:5070", "10.0.0.2:5070", "[2001:db8::1]:5070"]
    );
    assert!(!p.is_stale(), "the answer is good, in part");
    let notes = pools.notes(30 * S);
    assert!(
        notes.iter().any(|n| n.contains("part of the DNS answer")),
        "{notes:?}"
    );
    let p = pools.by_service.get_mut("pool").expect("pool");
    let nothing = Outcome::Parts(vec![
        part("", Family::V4, (0, 0, 5070), Err("timed out")),
        part("", Family::V6, (0, 0, 5070), Err("timed out")),
    ]);
    assert!(!p.record(nothing, 60 * S, &file.dns));
    assert!(p.is_stale());
    assert_eq!(p.members.len(), 3, "a DNS outage never empties a pool");
}

/// At start (nothing known yet) a failing AAAA part leaves the A part's members: the pool is
/// not empty for want of IPv6.
#[test]
fn at_start_a_failing_family_does_not_leave_the_pool_empty() {
    let file = cfg("");
    let mut pools = Pools::default();
    pools.sync(&file, 0);
    let p = pools.by_service.get_mut("pool").expect("pool");
    let a_only = Outcome::Parts(vec![
        part("", Family::V4, (0, 0, 5070), Ok(&["10.0.0.1"])),
        part("", Family::V6, (0, 0, 5070), Err("timed out")),
    ]);
    assert!(p.record(a_only, 0, &file.dns));
    assert_eq!(p.members.len(), 1);
    assert!(p.answered);
}

/// SRV: one target whose name fails keeps its last addresses while the others move on; a
/// target's weight is split among its addresses (a dual-stack target gets its share, not
/// twice it).
#[test]
fn srv_targets_are_parts_and_a_targets_weight_is_split_among_its_addresses() {
    let file = cfg("");
    let mut pools = Pools::default();
    pools.sync(&file, 0);
    let p = pools.by_service.get_mut("srv").expect("srv");
    let first = Outcome::Parts(vec![
        part("a.test.", Family::V4, (10, 60, 5080), Ok(&["10.0.1.1"])),
        part("a.test.", Family::V6, (10, 60, 5080), Ok(&["2001:db8::a"])),
        part("b.test.", Family::V4, (10, 60, 5080), Ok(&["10.0.1.2"])),
        part("b.test.", Family::V6, (10, 60, 5080), Ok(&[])),
    ]);
    assert!(p.record(first, 0, &file.dns));
    let mut members = BTreeMap::new();
    members.insert("srv".to_owned(), p.members.clone());
    let c = expand(&file, &members);
    let w: Vec<(String, u32)> = c.services[1..]
        .iter()
        .map(|s| (s.address.to_string(), s.weight))
        .collect();
    assert_eq!(
        w,
        [
            ("10.0.1.1:5080".to_owned(), 30),
            ("10.0.1.2:5080".to_owned(), 60),
            ("[2001:db8::a]:5080".to_owned(), 30)
        ]
    );
    let p = pools.by_service.get_mut("srv").expect("srv");
    let b_fails = Outcome::Parts(vec![
        part(
            "a.test.",
            Family::V4,
            (10, 60, 5080),
            Ok(&["10.0.1.1", "10.0.1.3"]),
        ),
        part("a.test.", Family::V6, (10, 60, 5080), Ok(&[])),
        part("b.test.", Family::V4, (10, 60, 5080), Err("SERVFAIL")),
        part("b.test.", Family::V6, (10, 60, 5080), Err("SERVFAIL")),
    ]);
    p.record(b_fails, 30 * S, &file.dns);
    let addrs: Vec<String> = p.members.iter().map(|t| t.addr.to_string()).collect();
    assert!(
        addrs.contains(&"10.0.1.2:5080".to_owned()),
        "b's last address kept: {addrs:?}"
    );
    assert!(
        addrs.contains(&"10.0.1.3:5080".to_owned()),
        "a's news taken: {addrs:?}"
    );
}

/// A DNS server answering rotating subsets of a large set: no member leaves on one answer
/// without it, so the pool does not churn every TTL.
#[test]
fn rotating_subsets_do_not_churn_the_pool() {
    let file = cfg("");
    let mut pools = Pools::default();
    pools.sync(&file, 0);
    let p = pools.by_service.get_mut("pool").expect("pool");
    let all = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"];
    let subset = |k: usize| {
        let ips: Vec<&str> = (0..3).map(|i| all[(k + i) % 4]).collect();
        Outcome::Found {
            targets: ips
                .iter()
                .map(|ip| t(&format!("{ip}:5070"), 0, 0))
                .collect(),
            ttl: 5,
        }
    };
    p.record(subset(0), 0, &file.dns);
    p.record(subset(1), 5 * S, &file.dns);
    let mut changes = 0;
    for k in 2..20 {
        if p.record(subset(k), k as u64 * 5 * S, &file.dns) {
            changes += 1;
        }
    }
    assert_eq!(
        changes, 0,
        "each address is missing from one answer at a time"
    );
    assert_eq!(p.members.len(), 4);
}
