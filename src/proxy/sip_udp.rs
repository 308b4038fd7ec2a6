//! The `sip-udp` vserver's IO shell: one blocking SO_REUSEPORT socket per worker thread,
//! receive → [`SipCore::handle_datagram`] → send from the same socket. Because the kernel
//! keeps each 4-tuple on one socket and each worker sends in the order it received, the
//! messages of one call leave fulcrum in the order they arrived.
//!
//! With `service_source`, requests toward services leave from sockets bound there instead
//! (and name it in their Via), so that the services' answers come back to this instance even
//! where the vserver's address is shared (an ECMP pool); each of those sockets has its own
//! worker, and what they relay to clients leaves from one of the vserver's sockets.
//!
//! Members that speak sip-tcp or sip-tls (the transports bridge, docs/sip.md) are reached
//! over the stream shell's links ([`crate::proxy::sip_stream::start_bridge`]): a worker hands
//! what its core sends them to the links, which connect on demand and hand what the services
//! send to the core; what goes to a client from there leaves from one of this vserver's
//! sockets.

use crate::balancer::Balancer;
use crate::capture::CallId;
use crate::config::{Config, Protocol, Vserver};
use crate::core::sip::SipParams;
use crate::core::sip::{Action, SipCore};
use crate::dialog::Change;
use crate::net;
use crate::proxy::context::{
    DataPath, Prepared, Rebuild, RuntimeError, StartCtx, VserverHandle, bind_service_source,
    bind_udp, local_identity,
};
use crate::proxy::context::{POLL, Rebuilt, elapsed_nanos};
use crate::proxy::handover::{Reader, Readers};
use crate::proxy::reconfig::{
    begin_handover, catch_up_dialogs, end_handover, migrate_dialogs, names_of, rebuilt, settle,
    sip_core,
};
use crate::proxy::shutdown::Shutdown;
use crate::proxy::sip_front::Senders;
use crate::proxy::sip_front::{Fronts, handed, needs_arrivals};
use crate::proxy::sip_stream::{Install, SipStreamShared};
use crate::sip::Transport;
use crate::stats::{LogLimiter, bump};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// The receive loop of one worker socket. Runs until `stop` is set; the socket blocks in
/// `recv_from` without a timeout, so whoever sets `stop` must also end that call (see
/// [`wake_on_shutdown`]). Errors are counted and never end the loop.
///
/// The vserver's core is loaded from `cell` per datagram, so a reload that rebuilds it
/// (`proxy::reconfig`) takes effect at the next datagram without touching the socket; each
/// datagram is marked on `reader`, so the reload knows when this worker has finished with
/// the old core ([`crate::proxy::handover`]).
/// `bridge` carries what goes to the vserver's stream members: `()` when it has none (the
/// loop is then compiled as if there were no bridge at all), else their links.
pub(crate) fn run_worker<B: Bridge>(
    socket: UdpSocket,
    out_socks: Senders,
    cell: SipUdpCell,
    bridge: B,
    epoch: Instant,
    stop: Arc<AtomicBool>,
    reader: Reader,
) {
    // Only the name is kept: holding the first core would keep its dialog table alive, and
    // count this worker's receive errors on it, after a reload replaced it.
    let name = cell.load().name.clone();
    let bound = match socket.local_addr() {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(vserver = %name, error = %e, "worker socket has no address");
            return;
        }
    };
    // A wildcard socket learns where each datagram was sent (IP_PKTINFO); every socket of a
    // vserver with several addresses or a wildcard notes it for the answers (sip_front).
    let pktinfo = bound.ip().is_unspecified()
        && match net::set_pktinfo(&socket) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(vserver = %name, error = %e, "no IP_PKTINFO: answers leave from the kernel's choice of source");
                false
            }
        };
    let mut cmsg = net::pktinfo_buffer();
    let arrivals = out_socks.arrivals_at(bound);
    let mut buf = vec![0u8; 65_536];
    let mut out: Vec<u8> = Vec::with_capacity(65_536 + 1024);
    // What held requests send besides the datagram a decision names (failover).
    let mut sends = Vec::new();
    let recv_log = LogLimiter::default();
    let send_log = LogLimiter::default();
    let drop_log = LogLimiter::default();
    while !stop.load(Ordering::Acquire) {
        let received = if pktinfo {
            net::recv_with_local(&socket, &mut buf, &mut cmsg, bound)
        } else {
            net::recv_from(&socket, &mut buf).map(|(n, src)| (n, src, bound))
        };
        let (n, src, dst) = match received {
            Ok((n, Some(src), dst)) => (n, src, dst),
            // The wake-up of the shutdown (a receive on a shut-down socket: no sender), not a
            // datagram; nothing else arrives without a sender address.
            Ok((_, None, _)) if stop.load(Ordering::Acquire) => break,
            Ok((_, None, _)) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            // The wake-up of the shutdown, not a receive error.
            Err(_) if stop.load(Ordering::Acquire) => break,
            Err(e) => {
                // ICMP errors from an earlier send surface here (ECONNREFUSED); not fatal.
                bump(&cell.load().counters.recv_errors);
                let now = elapsed_nanos(epoch);
                if recv_log.allow(now) {
                    tracing::debug!(vserver = %name, error = %e, "receive error");
                }
                continue;
            }
        };
        let at = out_socks.tap().and_then(crate::capture::Tap::stamp);
        let now = elapsed_nanos(epoch);
        if let Some(arrivals) = arrivals {
            arrivals.note(src, dst, now);
            arrivals.sweep_if_due(now);
        }
        // Until the end of this iteration, after the sends (dropped after `core`).
        let _in = reader.enter();
        let core = cell.load();
        let decision =
            core.decide_datagram_stateful(&buf[..n], src, dst, now, &mut out, &mut sends);
        let action = decision.action;
        // The Call-ID the core's scan read, for the capture of the message, of what is
        // forwarded of it and of fulcrum's answer to it (the same Call-ID, RFC 3261 §16.6,
        // §8.2.6.2), when it will be captured: never searched on the way.
        let call_id = match at {
            Some(at) if at.is_taken() => handed(decision.call_id),
            _ => CallId::Find,
        };
        // Captured as received unless dropped; before its sends, so the collector sees them
        // in order.
        if let (Some(t), Some(at)) = (out_socks.tap(), at)
            && crate::proxy::sip_front::is_captured(&action)
        {
            let leg = (crate::capture::Transport::Udp, src, dst);
            t.tap_as(at, leg, &buf[..n], call_id);
        }
        // A held request's own sends first: an INVITE's 100 (Trying) must reach the client
        // before the service's answers, which another worker may relay at once.
        send_all(
            &out_socks, &core, &bridge, &mut sends, call_id, &send_log, now,
        );
        let to = match action {
            Action::ToMember(m) => bridge.to_member(&core, m, &out, call_id).map(|a| (true, a)),
            Action::ToAddr(a) => bridge.to_addr(&core, a, &out, call_id).map(|a| (false, a)),
            Action::Reply(a) => Some((false, a)),
            // Connection ids exist only on streams.
            Action::ToConn(_) | Action::ToFlow(_) => None,
            Action::Drop(reason) => {
                if drop_log.allow(now) {
                    tracing::debug!(vserver = %core.name, %src, ?reason, "datagram dropped");
                }
                None
            }
        };
        if let Some((to_service, to)) = to
            && let Err(e) = if to_service {
                out_socks.to_service(&out, to, call_id)
            } else {
                out_socks.to_client(&out, to, false, call_id)
            }
        {
            bump(&core.counters.send_errors);
            if send_log.allow(now) {
                tracing::warn!(vserver = %core.name, %to, error = %e, "send failed");
            }
        }
    }
}

/// Send what held requests asked for (100 Trying, retransmissions, the next attempt, ACK,
/// CANCEL): datagrams to clients and sip-udp members, and to a stream member over its link;
/// a failed send is counted like any other. `handled`: the Call-ID of the message whose
/// handling made them, for the capture of those the core says carry it.
fn send_all<B: Bridge>(
    socks: &Senders,
    core: &Arc<SipCore>,
    bridge: &B,
    sends: &mut Vec<crate::core::sip::stateful::Send>,
    handled: CallId<'_>,
    log: &LogLimiter,
    now: crate::stats::Nanos,
) {
    use crate::core::sip::stateful::{Carries, Dest, Send};
    for Send {
        dest,
        bytes,
        call_id,
    } in sends.drain(..)
    {
        let call_id = match call_id {
            Carries::Handled => handled,
            Carries::Unknown => CallId::Find,
        };
        let (to_service, to) = match dest {
            Dest::Addr(a) => (false, a),
            Dest::Service(a) => (true, a),
            Dest::Member(m) => match bridge.to_member(core, m, &bytes, call_id) {
                Some(a) => (true, a),
                None => continue,
            },
            // Connection ids exist only on streams.
            Dest::Conn(_) => continue,
        };
        let sent = if to_service {
            socks.to_service(&bytes, to, call_id)
        } else {
            socks.to_client(&bytes, to, false, call_id)
        };
        if let Err(e) = sent {
            bump(&core.counters.send_errors);
            if log.allow(now) {
                tracing::warn!(vserver = %core.name, %to, error = %e, "send failed");
            }
        }
    }
}

/// How often the transaction timer thread looks at the held requests at most: the
/// granularity of retransmissions and `no_answer` (RFC 3261's timers are 500 ms and up).
const TRANSACTION_TICK: std::time::Duration = std::time::Duration::from_millis(10);

/// The thread that wakes held requests at their deadlines (retransmissions toward services,
/// `no_answer`, Timer C, the end of lingering), in whatever core is current; it sends from
/// `socks`, so services see the address the workers send them from. A vserver with stream
/// members has its held requests woken by their links' task instead.
fn start_transaction_timers(
    ctx: &mut StartCtx<'_>,
    v: &Vserver,
    socks: Senders,
    cell: SipUdpCell,
    reader: Reader,
) -> Result<(), RuntimeError> {
    let (sleeper, epoch) = (ctx.shutdown.sleeper(), ctx.epoch);
    ctx.liveness
        .periodic_mark(format!("{}-timers", v.name), reader.mark(), POLL);
    let t = std::thread::Builder::new()
        .name(format!("{}-timers", v.name))
        .spawn(move || {
            let mut sends = Vec::new();
            let log = LogLimiter::default();
            loop {
                let now = elapsed_nanos(epoch);
                let next = {
                    let _in = reader.enter();
                    let core = cell.load();
                    let next = core.poll_transactions(now, &mut sends);
                    // No message was handled: each one's Call-ID is found in it.
                    send_all(&socks, &core, &(), &mut sends, CallId::Find, &log, now);
                    next
                };
                let wait = next.map_or(POLL, |t| {
                    std::time::Duration::from_nanos(t.saturating_sub(now)).min(POLL)
                });
                if sleeper.sleep(wait.max(TRANSACTION_TICK)) {
                    return;
                }
            }
        })?;
    ctx.threads.push(t);
    Ok(())
}

/// Where a worker's datagram for a member, or for an address, goes: over its own socket (the
/// address returned) or, for a stream member, over that member's link (`None`), its Call-ID
/// (`call_id`) going along for the capture of its write.
pub(crate) trait Bridge: Send + 'static {
    fn to_member(
        &self,
        core: &Arc<SipCore>,
        m: usize,
        out: &[u8],
        call_id: CallId<'_>,
    ) -> Option<SocketAddr>;
    fn to_addr(
        &self,
        core: &Arc<SipCore>,
        a: SocketAddr,
        out: &[u8],
        call_id: CallId<'_>,
    ) -> Option<SocketAddr>;
}

/// No stream member: every datagram goes over the socket.
impl Bridge for () {
    #[inline(always)]
    fn to_member(
        &self,
        core: &Arc<SipCore>,
        m: usize,
        _: &[u8],
        _: CallId<'_>,
    ) -> Option<SocketAddr> {
        core.member_addr(m)
    }

    #[inline(always)]
    fn to_addr(
        &self,
        _: &Arc<SipCore>,
        a: SocketAddr,
        _: &[u8],
        _: CallId<'_>,
    ) -> Option<SocketAddr> {
        Some(a)
    }
}

/// The links of the stream members ([`SipStreamShared::carry_datagram`]).
impl Bridge for Arc<SipStreamShared> {
    fn to_member(
        &self,
        core: &Arc<SipCore>,
        m: usize,
        out: &[u8],
        call_id: CallId<'_>,
    ) -> Option<SocketAddr> {
        self.carry_datagram(core, Action::ToMember(m), out, call_id)
    }

    fn to_addr(
        &self,
        core: &Arc<SipCore>,
        a: SocketAddr,
        out: &[u8],
        call_id: CallId<'_>,
    ) -> Option<SocketAddr> {
        self.carry_datagram(core, Action::ToAddr(a), out, call_id)
    }
}

/// End a worker's blocking `recv_from` when the runtime shuts down: `shutdown(SHUT_RD)` on
/// a clone of its socket wakes the call (Linux does so even on an unconnected UDP socket,
/// and then reports ENOTCONN, which is expected here), and every later receive returns at
/// once, so the worker sees the flag. No timer wakes an idle worker, and the receive path
/// makes no extra system call.
fn wake_on_shutdown(shutdown: &Shutdown, socket: &UdpSocket) -> Result<(), RuntimeError> {
    let clone = socket.try_clone()?;
    shutdown.on_raise(move || {
        let _ = socket2::SockRef::from(&clone).shutdown(std::net::Shutdown::Read);
    });
    Ok(())
}

/// The current core of a sip-udp vserver; a reload stores a rebuilt one.
pub(crate) type SipUdpCell = Arc<arc_swap::ArcSwap<SipCore>>;

/// A running sip-udp vserver: the core it runs now, the cell its workers load it from, and
/// its links toward stream services when it has any (kept across rebuilds; a reload
/// installs its core there too).
#[derive(Debug)]
pub struct SipUdpPath {
    core: Arc<SipCore>,
    cell: SipUdpCell,
    bridge: Option<Arc<SipStreamShared>>,
    /// Every worker that loads the core from `cell` (and the bridge's tasks, which load it
    /// from its generation): a reload waits for them to finish with the old core.
    readers: Arc<Readers>,
}

impl SipUdpPath {
    /// The core the vserver runs now.
    pub fn core(&self) -> &Arc<SipCore> {
        &self.core
    }

    /// The links toward the vserver's stream services, when it has any.
    pub fn bridge(&self) -> Option<&Arc<SipStreamShared>> {
        self.bridge.as_ref()
    }
}

impl DataPath for SipUdpPath {
    fn edge(&self) -> &crate::edge::Edge {
        self.core.edge()
    }

    fn sip_core(&self) -> Option<&Arc<SipCore>> {
        Some(&self.core)
    }

    fn service_tls(&self) -> Vec<(String, Arc<crate::tls::HandshakeCounters>)> {
        self.bridge
            .as_ref()
            .map_or_else(Vec::new, |b| b.service_tls())
    }

    fn store_client_tls(&self, config: &Config) {
        if let Some(b) = &self.bridge {
            b.store_client_tls(config);
        }
    }

    /// A sip-udp vserver's links toward its stream services count as a stream vserver's.
    fn each_event(&self, visit: &mut dyn FnMut(&'static str, &std::sync::atomic::AtomicU64)) {
        if let Some(b) = &self.bridge {
            for (name, c) in b.counters.events() {
                visit(name, c);
            }
        }
    }

    /// Same listener, worker threads and Via identity; a new balancer and core built aside,
    /// installed with the dialogs migrated (`proxy::reconfig`).
    fn prepare(&self, config: &Config, v: &Vserver) -> Result<Prepared, RuntimeError> {
        // The links toward sip-tcp / sip-tls services (and the core's legs naming their
        // transports) are set up at start; a reload cannot add the first.
        let bridge = self.bridge.clone();
        let wants_streams = v.forwards_to(config, Protocol::is_sip_stream);
        if wants_streams && bridge.is_none() {
            return Err(RuntimeError::Setup {
                vserver: v.name.clone(),
                problem: "its first sip-tcp or sip-tls service needs a restart (the links toward stream services are set up at start)".to_owned(),
            });
        }
        let old = self.cell.load_full();
        // Counted afresh (the dialogs are migrated and counted below), but the ejections go
        // on: a reload, a DNS change or the end of a drain does not forgive a sick service.
        let balancer = Arc::new(Balancer::carrying_ejections(config, v, old.balancer()));
        let core = Arc::new(sip_core(config, v, &old, &balancer));
        let links = bridge.as_ref().map(|_| Install {
            core: Arc::clone(&core),
            max_clients: 0,
            idle: v.idle_timeout,
            tls: Install::member_tls(config, v),
            write_timeouts: Install::member_write_timeouts(config, v),
        });
        let (cell, readers) = (Arc::clone(&self.cell), Arc::clone(&self.readers));
        Ok(Prepared::new(move |cx| {
            let now = cx.now();
            let old_names = names_of(old.balancer());
            let added = settle(&balancer, &old_names, cx.health_of, now);
            let new_names = names_of(&balancer);
            // A fresh balancer: what moved is counted as load again (what did not was never
            // counted there).
            let first = migrate_dialogs(&old, &core, &old_names, &new_names, now);
            for &(m, count) in &first.counted {
                core.tally(Change::Open(m, count));
            }
            // A fresh balancer: what the new core takes from the old one on demand is
            // counted as it is taken (and reported by the catch-up in `late.pulled`).
            begin_handover(&old, &core, &first, &old_names, &new_names, true);
            if let (Some(bridge), Some(links)) = (&bridge, links) {
                // The links first: a worker's decision by the new core finds its member's link
                // (one by the old core is matched by name, `SipStreamShared::carry_datagram`).
                bridge.install(links);
            }
            cell.store(Arc::clone(&core));
            // The workers and the bridge's tasks share `readers`: once they have finished
            // the messages they began before the two stores, none uses the old core.
            readers.wait();
            // This balancer counted only what the first pass migrated, and what the new core
            // pinned itself (`late.doubled`: the old core's pin was counted on the old balancer).
            let late = catch_up_dialogs(&old, &core, &first, &old_names, &new_names, cx.now());
            for &(m, count) in &late.opened {
                core.tally(Change::Open(m, count));
            }
            for &c in late.changed.iter().chain(&late.pushed_out) {
                core.tally(c);
            }
            end_handover(&core);
            let r = Rebuilt {
                dialogs_kept: late.kept(&first),
                ..rebuilt(&old_names, &balancer, &added)
            };
            Rebuild {
                rebuilt: r,
                balancer,
                data: Arc::new(SipUdpPath {
                    core,
                    cell,
                    bridge,
                    readers,
                }),
            }
        }))
    }

    fn protocols(&self) -> &'static [Protocol] {
        &[Protocol::SipUdp]
    }
}

/// Start a sip-udp vserver: worker threads with SO_REUSEPORT sockets, and a dialog sweeper;
/// with sip-tcp / sip-tls members, the links toward them (whose task sweeps dialogs instead).
pub(crate) fn start(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
) -> Result<VserverHandle, RuntimeError> {
    let tap = crate::capture::Tap::new(ctx.capture, &v.name);
    let workers = net::worker_count(v.workers);
    let (per_addr, bound) = bind_udp(v, workers)?;
    let fronts = if needs_arrivals(&bound) {
        Some(Arc::new(Fronts::of(&bound, &per_addr)?))
    } else {
        None
    };
    // Each socket's bound address's rank (its front).
    let ranks: Vec<usize> = per_addr
        .iter()
        .enumerate()
        .flat_map(|(i, socks)| std::iter::repeat_n(i, socks.len()))
        .collect();
    let sockets: Vec<UdpSocket> = per_addr.into_iter().flatten().collect();
    let member_addrs = config.member_addrs(v);
    let local = local_identity(v, &bound, &member_addrs, Transport::Udp)?;
    let service_side = bind_service_source(v, &bound, workers)?;
    let balancer = Arc::new(Balancer::new(config, v));
    let streams = v.forwards_to(config, Protocol::is_sip_stream);
    let mut params = SipParams::of(config, v, local.clone(), balancer)
        .with_service_source(service_side.as_ref().map(|(_, a)| *a));
    if streams {
        // The stream legs share the vserver's address (their links connect out; a service's
        // requests come back on them). Both are given, so a reload may add either kind.
        params = params.with_legs(vec![
            local.with_transport(Transport::Tcp),
            local.with_transport(Transport::Tls),
        ]);
    }
    let core = Arc::new(
        SipCore::new(params)
            .with_edge(v.edge(None))
            .with_flows(crate::proxy::flows::keys_for(config), v.path)
            .with_failover(v.failover.clone(), Arc::default()),
    );
    let cell: SipUdpCell = Arc::new(arc_swap::ArcSwap::new(Arc::clone(&core)));
    let readers = Arc::new(Readers::default());
    let (service_socks, service_addr) = match service_side {
        Some((socks, a)) => (socks, Some(a)),
        None => (Vec::new(), None),
    };
    let bridge = match sockets.first() {
        Some(first) if streams => {
            let front = Senders::of(first, service_socks.first())?
                .with_fronts(&fronts, 0)
                .with_tap(tap.clone());
            Some(crate::proxy::sip_stream::start_bridge(
                ctx, config, v, &core, front, &readers,
            ))
        }
        Some(first) => {
            let socks = Senders::of(first, service_socks.first())?
                .with_fronts(&fronts, 0)
                .with_tap(tap.clone());
            start_transaction_timers(ctx, v, socks, Arc::clone(&cell), readers.register())?;
            None
        }
        None => None,
    };
    // A worker per socket: the vserver's, then the service source's (which relay what they
    // receive for clients from the vserver's socket of the same rank).
    let mut receivers = Vec::new();
    for (i, socket) in sockets.iter().enumerate() {
        let senders = Senders::of(socket, service_socks.get(i % service_socks.len().max(1)))?
            .with_fronts(&fronts, ranks.get(i).copied().unwrap_or(0))
            .with_tap(tap.clone());
        receivers.push((format!("{}-{i}", v.name), socket.try_clone()?, senders));
    }
    for (i, socket) in service_socks.iter().enumerate() {
        let Some(front) = sockets.get(i % sockets.len().max(1)) else {
            break;
        };
        let rank = ranks.get(i % sockets.len().max(1)).copied().unwrap_or(0);
        let senders = Senders::of(front, Some(socket))?
            .with_fronts(&fronts, rank)
            .with_tap(tap.clone());
        receivers.push((format!("{}-svc{i}", v.name), socket.try_clone()?, senders));
    }
    drop((sockets, service_socks));
    for (name, socket, senders) in receivers {
        wake_on_shutdown(ctx.shutdown, &socket)?;
        let cell = Arc::clone(&cell);
        let bridge = bridge.clone();
        let stop = ctx.shutdown.flag();
        let (epoch, reader) = (ctx.epoch, readers.register());
        // Watched by its mark and its socket; the socket stays open while the mark does
        // (both end with the thread).
        ctx.liveness
            .receiver(name.clone(), reader.mark(), socket.as_raw_fd());
        let t = std::thread::Builder::new()
            .name(name)
            .spawn(move || match bridge {
                None => run_worker(socket, senders, cell, (), epoch, stop, reader),
                Some(b) => run_worker(socket, senders, cell, b, epoch, stop, reader),
            })?;
        ctx.threads.push(t);
    }
    if let Some(a) = service_addr {
        tracing::info!(vserver = %v.name, service_source = %a, "requests toward services leave from the service source");
    }
    if bridge.is_some() {
        tracing::info!(vserver = %v.name, "links toward sip-tcp / sip-tls services started");
        return Ok(started(v, bound, workers, core, cell, bridge, readers));
    }
    // Dialog expiry, in whatever core is current (a reload may change the idle timeout, so
    // the interval is looked at every POLL); the shutdown ends the sleep at once.
    let (cell2, sleeper, epoch) = (Arc::clone(&cell), ctx.shutdown.sleeper(), ctx.epoch);
    let reader = readers.register();
    ctx.liveness
        .periodic_mark(format!("{}-sweep", v.name), reader.mark(), POLL);
    let t = std::thread::Builder::new()
        .name(format!("{}-sweep", v.name))
        .spawn(move || {
            let mut last = Instant::now();
            while !sleeper.sleep(POLL) {
                let _in = reader.enter();
                let core = cell2.load();
                if last.elapsed() >= core.sweep_interval() {
                    core.sweep(elapsed_nanos(epoch));
                    last = Instant::now();
                }
            }
        })?;
    ctx.threads.push(t);
    Ok(started(v, bound, workers, core, cell, None, readers))
}

/// The handle of a started sip-udp vserver.
fn started(
    v: &Vserver,
    bound: Vec<std::net::SocketAddr>,
    workers: usize,
    core: Arc<SipCore>,
    cell: SipUdpCell,
    bridge: Option<Arc<SipStreamShared>>,
    readers: Arc<Readers>,
) -> VserverHandle {
    tracing::info!(
        vserver = %v.name,
        bind = ?bound,
        workers,
        method = v.method.name(),
        "sip-udp vserver started"
    );
    VserverHandle::new(
        v.name.clone(),
        v.protocol,
        bound,
        Arc::clone(core.balancer()),
        Arc::new(SipUdpPath {
            core,
            cell,
            bridge,
            readers,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn shutdown_ends_a_blocking_receive() {
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let shutdown = Shutdown::new();
        wake_on_shutdown(&shutdown, &socket).expect("clone");
        let (done_tx, done) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            let r = net::recv_from(&socket, &mut buf).map(|(n, _)| n);
            let _ = done_tx.send(());
            r
        });
        shutdown.raise();
        done.recv_timeout(Duration::from_secs(5))
            .expect("the receive returned");
        let _ = t.join().expect("thread");
    }
}
