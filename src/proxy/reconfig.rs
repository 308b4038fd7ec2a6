//! Rebuilding a running vserver for a reload, without touching its sockets. IO.
//!
//! # udp, tcp and http
//! A new core ([`crate::core::udp::UdpCore`], [`crate::proxy::tcp::TcpCore`]) is built
//! aside with a balancer that shares the counters of the members it keeps
//! ([`Balancer::carrying`]), given the current health of every member, and stored in the
//! vserver's cell. tcp / http accept loops load the cell per accepted connection:
//! established connections finish on the core and service they began with. udp workers
//! adopt the new core at their next wake-up (within 100 ms): sessions of members kept with
//! the same address stay on them, sessions of removed members are closed (their next
//! datagram is balanced afresh). Members added by the reload enter slow start. The
//! vserver's own counters (accepted, datagrams...) restart from zero; per-service counters
//! of kept members continue, their TLS handshake counters too (carried by service name
//! into the new core's connectors).
//!
//! # sip-udp
//! The listener, worker threads and Via identity stay; a new [`Balancer`] and
//! [`SipCore`] are built from the new config aside, given the current health of every
//! member, and swapped in atomically (workers load the core per datagram). Dialog affinity
//! of surviving services is migrated (members renumbered by service name) and counted as
//! load again; members added by the reload enter slow start. Dialogs pinned to a removed
//! service are dropped: their next in-dialog request is routed by the method. The workers
//! keep using the old core until the swap, so once it is done, and every worker that began a
//! message with the old core has finished it ([`crate::proxy::handover`]: the workers tell
//! it, nothing is timed), a catch-up pass carries what they did to dialogs meanwhile (new
//! pins, ends, moves) into the new table: without it a call set up during a reload lost its
//! affinity, and its load was never closed. Between the swap and the catch-up the new core
//! already handles messages: each brings its dialog's entry up to date from the old table
//! first, taking it when the new table has none ([`begin_handover`]): without that, the ACK
//! or BYE of a call set up (or answered) on the old core after the migration, handled by the
//! new core before the catch-up, was balanced afresh (a strict service answers such a BYE
//! 481) and its load stayed counted.
//!
//! # sip-tcp
//! The listener, the client connections and the Via identity stay. A new [`SipCore`] is
//! built as for sip-udp, but its balancer shares the counters of the members it keeps
//! ([`Balancer::carrying`]), so migrated dialogs are already counted. It is installed in
//! the vserver's [`crate::proxy::sip_stream::SipStreamShared`] together with the service
//! connections: kept members (same name and address) keep theirs, added members get a new
//! one (connected on first use), removed members' connections are retired (queued requests
//! go to the member the new core chooses, what the service still sends and the clients'
//! responses to it are relayed for a while). Per-service counters of kept members continue
//! (TLS handshakes toward them too, also for a member whose address changed: its new link
//! counts on by name); the SIP counters of the core
//! restart from zero, the transport counters (clients accepted, ...) continue.
//!
//! Slow-start progress is not carried over: members still new before the rebuild are part
//! of the base set after it (only members the reload adds start slow start).
//!
//! Counters of the rebuilt vserver (requests, selection paths, SIP counters) start again
//! from zero, which Prometheus treats as a counter reset.

use crate::balancer::{Balancer, Health};
use crate::config::{Config, Vserver};
use crate::core::sip::{SipCore, SipParams};
use crate::proxy::context::{RebuildCx, Rebuilt};
use arc_swap::ArcSwap;
use std::sync::Arc;

/// Give the members of a freshly built `balancer` their current health, and mark those
/// not in `old_names` as added (slow start). Returns the added members.
pub(crate) fn settle(
    balancer: &Balancer,
    old_names: &[String],
    health_of: &dyn Fn(&str) -> Health,
    now: crate::stats::Nanos,
) -> Vec<usize> {
    let names: Vec<&str> = balancer.members().iter().map(|m| m.name.as_str()).collect();
    for (i, n) in names.iter().enumerate() {
        let h = health_of(n);
        if h != Health::Up {
            balancer.set_health(i, h, now);
        }
    }
    let added: Vec<usize> = (0..names.len())
        .filter(|&i| !old_names.iter().any(|o| o == names[i]))
        .collect();
    balancer.mark_added(&added, now);
    added
}

pub(crate) fn names_of(b: &Balancer) -> Vec<String> {
    b.members().iter().map(|m| m.name.clone()).collect()
}

pub(crate) fn rebuilt(old_names: &[String], new: &Balancer, added: &[usize]) -> Rebuilt {
    let new_names = names_of(new);
    Rebuilt {
        added: added
            .iter()
            .filter_map(|&i| new_names.get(i).cloned())
            .collect(),
        removed: old_names
            .iter()
            .filter(|n| !new_names.contains(n))
            .cloned()
            .collect(),
        dialogs_kept: 0,
    }
}

/// The core of SIP vserver `v` of `config`, with `old`'s Via identities (its listener and
/// the sockets of its other legs are kept).
pub(crate) fn sip_core(
    config: &Config,
    v: &Vserver,
    old: &SipCore,
    balancer: &Arc<Balancer>,
) -> SipCore {
    let (local, legs) = old.identities();
    SipCore::new(
        SipParams::of(config, v, local, Arc::clone(balancer))
            .with_legs(legs)
            .with_service_source(old.service_source()),
    )
    .with_edge(v.edge(Some(old.edge())))
    .with_flows(crate::proxy::flows::keys_for(config), v.path)
    .with_failover(v.failover.clone(), Arc::clone(old.transactions()))
}

/// Copy the live dialogs of `old` into `new`, renumbering members by service name; dialogs
/// of services that left are dropped. Returns the new member of each open dialog.
pub(crate) fn migrate_dialogs(
    old: &SipCore,
    new: &SipCore,
    old_names: &[String],
    new_names: &[String],
    now: crate::stats::Nanos,
) -> crate::dialog::Migration {
    old.dialogs().migrate_to(
        new.dialogs(),
        now / 1_000_000,
        renumber(old_names, new_names),
    )
}

/// After the switch, once no worker uses the old core: carry into the new table what the
/// old core's users did to dialogs between the migration and the switch (see
/// [`crate::dialog::DialogTable::catch_up_to`]).
pub(crate) fn catch_up_dialogs(
    old: &SipCore,
    new: &SipCore,
    first: &crate::dialog::Migration,
    old_names: &[String],
    new_names: &[String],
    now: crate::stats::Nanos,
) -> crate::dialog::CatchUp {
    old.dialogs().catch_up_to(
        new.dialogs(),
        first,
        now / 1_000_000,
        renumber(old_names, new_names),
    )
}

/// Old member index -> new member index, by service name (`None`: the service left). The
/// mapping is worked out once, not per dialog.
fn renumber(old_names: &[String], new_names: &[String]) -> impl Fn(u32) -> Option<u32> + use<> {
    let to = renumbering(old_names, new_names);
    move |m| to.get(m as usize).copied().flatten()
}

/// The new index of each old member, by service name (`None`: the service left).
fn renumbering(old_names: &[String], new_names: &[String]) -> Vec<Option<u32>> {
    old_names
        .iter()
        .map(|n| {
            new_names
                .iter()
                .position(|x| x == n)
                .and_then(|p| u32::try_from(p).ok())
        })
        .collect()
}

/// After the migration pass `first`, before `new` replaces `old` in the cell its users load
/// it from: until [`end_handover`], a message handled by `new` brings its dialog's entry up
/// to date from `old`'s table first, taking it when `new` has none
/// ([`SipCore::begin_handover`]), so that a dialog set up or answered on `old` after the
/// migration pass keeps its service, and its load, while the catch-up pass waits for `old`'s
/// last users. `counts`: `new`'s balancer counts afresh (it does not share `old`'s counters).
pub(crate) fn begin_handover(
    old: &Arc<SipCore>,
    new: &SipCore,
    first: &crate::dialog::Migration,
    old_names: &[String],
    new_names: &[String],
    counts: bool,
) {
    new.begin_handover(
        old,
        renumbering(old_names, new_names),
        first.copied_keys.clone(),
        counts,
    );
}

/// After the catch-up pass: `new` lets `old` go.
pub(crate) fn end_handover(new: &SipCore) {
    new.end_handover();
}

/// Install `core`, built aside from `old` (the core in `cell`): settle its members' health
/// and slow start against the old balancer and swap it into `cell` (udp, tcp and http: see
/// the module doc). What changed.
pub(crate) fn swap_core<C>(
    cell: &ArcSwap<C>,
    old: &C,
    core: &Arc<C>,
    cx: &RebuildCx<'_>,
    balancer: fn(&C) -> &Arc<Balancer>,
) -> Rebuilt {
    let old_names = names_of(balancer(old));
    let added = settle(balancer(core), &old_names, cx.health_of, cx.now());
    cell.store(Arc::clone(core));
    rebuilt(&old_names, balancer(core), &added)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::handover::Readers;
    use crate::sip::{Local, Transport};
    use std::sync::mpsc;
    use std::time::Duration;

    fn core(config: &Config) -> Arc<SipCore> {
        let v = &config.vservers[0];
        let local = Local::from_addr("127.0.0.1:5060".parse().expect("addr"), Transport::Udp);
        let balancer = Arc::new(Balancer::new(config, v));
        Arc::new(SipCore::new(SipParams::of(config, v, local, balancer)))
    }

    fn invite(call_id: &str) -> String {
        format!(
            "INVITE sip:svc@example.com SIP/2.0\r\nVia: SIP/2.0/UDP 10.0.0.1:5062;branch=z9hG4bK{call_id}\r\nMax-Forwards: 70\r\nFrom: <sip:a@x>;tag=f1\r\nTo: <sip:svc@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContent-Length: 0\r\n\r\n"
        )
    }

    /// A worker that loaded the old core just before the switch and is held in the middle of
    /// its message: the hand-over waits for it, so the dialog it pins on the old core after
    /// the switch reaches the new table (a fixed settle time lost it when the worker was
    /// preempted for longer).
    #[test]
    fn the_hand_over_waits_for_a_worker_held_across_the_switch() {
        let config = crate::config::from_str(
            "t",
            "services:\n  - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }\n  - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }\nvservers:\n  - { name: v, protocol: sip-udp, bind: 127.0.0.1:5060, services: [a, b] }\n",
        )
        .expect("config");
        let (old, new) = (core(&config), core(&config));
        let names = names_of(old.balancer());
        let cell = Arc::new(ArcSwap::new(Arc::clone(&old)));
        let readers = Arc::new(Readers::default());
        let (loaded_tx, loaded) = mpsc::channel();
        let (go, go_rx) = mpsc::channel::<()>();
        let worker = {
            let (cell, reader) = (Arc::clone(&cell), readers.register());
            std::thread::spawn(move || {
                let _in = reader.enter();
                let g = cell.load();
                loaded_tx.send(()).expect("loaded");
                go_rx.recv().expect("go");
                let mut out = Vec::new();
                g.handle_datagram(
                    invite("held").as_bytes(),
                    "192.0.2.10:5062".parse().expect("src"),
                    "127.0.0.1:5060".parse().expect("dst"),
                    0,
                    &mut out,
                );
            })
        };
        loaded.recv().expect("worker loaded the old core");
        let first = migrate_dialogs(&old, &new, &names, &names, 0);
        cell.store(Arc::clone(&new));
        let (done_tx, done) = mpsc::channel();
        let switch = {
            let (old, new, names) = (Arc::clone(&old), Arc::clone(&new), names.clone());
            std::thread::spawn(move || {
                readers.wait();
                let late = catch_up_dialogs(&old, &new, &first, &names, &names, 0);
                done_tx.send(()).expect("done");
                late
            })
        };
        // However long the worker is held, the catch-up does not run before it lets go.
        assert!(
            done.recv_timeout(Duration::from_millis(100)).is_err(),
            "the catch-up ran while a worker still used the old core"
        );
        go.send(()).expect("go");
        worker.join().expect("worker");
        let late = switch.join().expect("switch");
        assert_eq!(late.opened.len(), 1, "{late:?}");
        let h = crate::hash::key_hash(b"held");
        assert!(new.dialogs().get(h, 0).is_some());
    }
}
