//! Carrying out the core's decisions for a SIP stream vserver: toward a client's queue, a
//! member's link, the UDP leg or a draining connection; requests whose link failed chosen
//! again, and fulcrum's 503 when none can take them. IO.

use super::*;
use crate::core::sip::stateful::{Carries, Dest, Send};

/// Where fulcrum's own answers to a message go (a reply it makes, a pong): back on the
/// connection the message came on.
#[derive(Clone, Copy)]
pub(super) enum ReplyTo<'a> {
    /// A client connection, through its outbox.
    Client(u64),
    /// A service link's connection.
    Link(&'a mpsc::Sender<Outgoing>),
    /// Nowhere: the UDP leg sends its replies itself.
    Nowhere,
}

/// `send` with the Call-ID it carries for the capture of its write: `handled`, the Call-ID
/// of the message whose handling made it, when the core says it carries that one.
fn resolved(send: Send, handled: &CallIdBuf) -> (Dest, Outgoing) {
    let call_id = match send.call_id {
        Carries::Handled => handled.clone(),
        Carries::Unknown => CallIdBuf::Find,
    };
    (send.dest, Outgoing::new(send.bytes, call_id))
}

impl SipStreamShared {
    /// Send what held requests asked for (100 Trying, the next attempt, ACK, CANCEL, the
    /// best answer): to a client's connection, a member's link or over the UDP leg.
    /// `handled`: the Call-ID of the message whose handling made them ([`resolved`]).
    pub(super) fn carry_sends(&self, g: &Generation, sends: Vec<Send>, handled: &CallIdBuf) {
        let mut more = Vec::new();
        for send in sends {
            let (dest, msg) = resolved(send, handled);
            self.carry_send(g, dest, msg, &mut more);
        }
        // An attempt a link cannot take moves its transaction on, which may send more
        // (bounded by the transaction's tries).
        while !more.is_empty() {
            for (dest, msg) in std::mem::take(&mut more) {
                self.carry_send(g, dest, msg, &mut more);
            }
        }
    }

    fn carry_send(
        &self,
        g: &Generation,
        dest: Dest,
        msg: Outgoing,
        more: &mut Vec<(Dest, Outgoing)>,
    ) {
        match dest {
            Dest::Conn(id) => {
                self.to_client(id, msg);
            }
            Dest::Member(m) => {
                if !self.to_service(g, m, msg.clone()) && !scan::is_response(&msg) {
                    // What the transaction sends next carries the attempt's Call-ID.
                    let mut sends = Vec::new();
                    g.core.attempt_unsent(&msg, self.now(), &mut sends);
                    more.extend(sends.into_iter().map(|s| resolved(s, &msg.call_id)));
                }
            }
            Dest::Addr(addr) => {
                self.to_udp(&msg, addr, msg.call_id.as_call_id());
            }
            Dest::Service(addr) => {
                self.to_udp_member(&msg, addr, msg.call_id.as_call_id());
            }
        }
    }

    /// A request `out` (its Call-ID `call_id`) that member `m`'s link could not take: its
    /// held transaction moves on to the next member; one nobody holds is answered 503 +
    /// Retry-After now rather than left to a transaction timeout.
    fn not_queued(&self, g: &Generation, out: &[u8], call_id: &CallIdBuf) {
        let mut sends = Vec::new();
        if g.core.attempt_unsent(out, self.now(), &mut sends) {
            self.carry_sends(g, sends, call_id);
        } else {
            self.answer_unavailable(g, out, call_id);
        }
    }

    /// Queue `msg` toward client `id`; a full queue disconnects that client only.
    pub(super) fn to_client(&self, id: u64, msg: Outgoing) -> bool {
        let Some(c) = self.clients.get(&id) else {
            return false;
        };
        match c.outbox.push(msg) {
            Push::Queued => true,
            Push::Full => {
                drop(c);
                self.disconnect_slow_client(id, "its write queue is full");
                false
            }
            Push::Closed => false,
        }
    }

    /// Disconnect client `id`, which does not read what is written to it: its task (reader,
    /// writer, socket) ends. Counted once, by whoever removes it (two messages may find its
    /// queue full at once).
    pub(super) fn disconnect_slow_client(&self, id: u64, why: &str) {
        let Some((abort, remote)) = self.clients.get(&id).map(|c| (c.abort.clone(), c.remote))
        else {
            return;
        };
        if self.forget_client(id, remote) {
            bump(&self.counters.slow_clients_closed);
            tracing::info!(vserver = %self.name, %remote, why, "client does not read: disconnected");
            abort.abort();
        }
    }

    /// Admit a new client from `ip` ([`crate::budget::Gate`]). While the process's file pool
    /// runs low, each new client first evicts one, of any vserver: connections that never
    /// completed a message or request before any that did, the longest idle first; a new
    /// client whose files are not back yet from the eviction waits for them in its own task
    /// ([`crate::proxy::evict::Admitted::files`]), never in the accept loop.
    pub(super) fn admit_client(
        &self,
        ip: std::net::IpAddr,
    ) -> Result<crate::proxy::evict::Admitted, crate::budget::Refusal> {
        crate::proxy::evict::admit_evicting(&self.gate, ip, || self.evictors.evict(self.now()))
    }

    /// Admit a connection from one of the vserver's members (a service opening a flow
    /// toward fulcrum, e.g. a PBX): not limited per source, and never evicted as a client;
    /// its file is the pool's like any other.
    pub(super) fn admit_member(
        &self,
    ) -> Result<crate::proxy::evict::Admitted, crate::budget::Refusal> {
        crate::proxy::evict::admit_member(&self.gate, || self.evictors.evict(self.now()))
    }
}

/// A stream vserver's clients, as the process-wide eviction sees them.
impl crate::proxy::evict::IdleClients for SipStreamShared {
    fn evict_one(&self, id: u64, now: crate::stats::Nanos) -> bool {
        let Some((abort, remote)) = self.clients.get(&id).map(|c| (c.abort.clone(), c.remote))
        else {
            return false;
        };
        if !self.forget_client(id, remote) {
            return false;
        }
        bump(&self.counters.clients_evicted);
        if self.log.allow(now) {
            tracing::info!(vserver = %self.name, %remote, "idle client evicted: the open-file pool runs low");
        }
        abort.abort();
        true
    }

    fn shrink(&self) {
        crate::proxy::evict::shrink_spare(&self.clients);
        crate::proxy::evict::shrink_spare(&self.by_remote);
    }
}

impl SipStreamShared {
    /// Send one of fulcrum's own replies (or a pong) back on the connection of `to`.
    pub(super) fn reply(&self, to: ReplyTo<'_>, msg: Outgoing) {
        match to {
            ReplyTo::Client(id) => {
                self.to_client(id, msg);
            }
            ReplyTo::Link(tx) => {
                let _ = tx.try_send(msg);
            }
            ReplyTo::Nowhere => {}
        }
    }

    /// Queue `msg` toward member `member` of `g`. A link retired meanwhile (a reload
    /// removed its member after `g` was loaded) no longer takes requests: they are chosen
    /// again by the current core.
    pub(super) fn to_service(&self, g: &Generation, member: usize, msg: Outgoing) -> bool {
        let Some(link) = g.links.get(member) else {
            bump(&self.counters.service_queue_full);
            return false;
        };
        if link.udp {
            return self.to_udp_member(&msg, link.addr, msg.call_id.as_call_id());
        }
        match link.tx.try_send(msg) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(msg)) => {
                self.redispatch(link, msg);
                true
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                bump(&self.counters.service_queue_full);
                false
            }
        }
    }

    /// Carry out, for a sip-udp vserver's worker, a decision its core `core` made for a
    /// datagram that involves a stream member: a request to member `m`, or a client's
    /// response to a stream service's in-dialog request (to that service's address). Queues
    /// it on the member's link, with its Call-ID `call_id` for the capture of its write, and
    /// returns `None`, or returns where the datagram goes over UDP (a sip-udp member, or an
    /// address that is no stream member's).
    pub(crate) fn carry_datagram(
        &self,
        core: &Arc<SipCore>,
        action: Action,
        out: &[u8],
        call_id: CallId<'_>,
    ) -> Option<SocketAddr> {
        let g = self.current.load();
        let queued = || Outgoing::new(Bytes::copy_from_slice(out), CallIdBuf::of(call_id));
        match action {
            Action::ToMember(m) => {
                // A reload between the worker's decision and this load: the member's index in
                // the current generation, by name.
                let m = if Arc::ptr_eq(&g.core, core) {
                    Some(m)
                } else {
                    let name = core.balancer().members().get(m).map(|x| x.name.as_str());
                    g.core
                        .balancer()
                        .members()
                        .iter()
                        .position(|x| Some(x.name.as_str()) == name)
                };
                match m {
                    Some(m) if g.core.member_transport(m) == Transport::Udp => {
                        g.core.member_addr(m)
                    }
                    Some(m) => {
                        let msg = queued();
                        let call_id = msg.call_id.clone();
                        if !self.to_service(&g, m, msg) {
                            self.not_queued(&g, out, &call_id);
                        }
                        None
                    }
                    None => {
                        self.redispatch_request(&g, None, queued());
                        None
                    }
                }
            }
            Action::ToAddr(addr) => {
                let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
                match g.core.member_of(addr) {
                    Some(m) if g.core.member_transport(m) != Transport::Udp => {
                        self.to_service(&g, m, queued());
                        None
                    }
                    _ => match self.draining_tx(addr) {
                        Some(tx) => {
                            let _ = tx.try_send(queued());
                            None
                        }
                        None => Some(addr),
                    },
                }
            }
            Action::Reply(addr) => Some(addr),
            // Connection ids and flow tokens of streams never come from a sip-udp vserver.
            Action::ToConn(_) | Action::ToFlow(_) | Action::Drop(_) => None,
        }
    }

    /// The queue of the draining connection to a service a reload removed, if there is one.
    pub(super) fn draining_tx(&self, addr: SocketAddr) -> Option<mpsc::Sender<Outgoing>> {
        self.draining.get(&addr).map(|t| t.clone())
    }

    /// Send a request that could not go over `link` to the member the current core chooses
    /// now (a failed member is DOWN and a removed one absent, so the ranking passes it
    /// over). With none, it is counted lost and its client gets fulcrum's 503.
    pub(super) fn redispatch(&self, link: &ServiceLink, msg: Outgoing) {
        // A client's response to the service's in-dialog request cannot be chosen again:
        // it goes to the service's draining connection if there is one.
        if scan::is_response(&msg) {
            match self.draining_tx(link.addr) {
                Some(tx) if tx.try_send(msg).is_ok() => {}
                _ => bump(&self.counters.responses_no_client),
            }
            return;
        }
        let g = self.current.load();
        self.redispatch_request(&g, Some(link), msg);
    }

    /// Send a forwarded request to the member `g`'s core chooses now, other than `failed`'s;
    /// with none, it is counted lost and its client gets fulcrum's 503. A request fulcrum
    /// holds (failover) moves on inside its transaction instead: the failed member is
    /// charged and the next attempt, with its own branch, goes where the transaction says,
    /// so the answer of the member that took it is matched to it, and the client gets one
    /// final, never fulcrum's 503 beside the transaction's.
    pub(super) fn redispatch_request(
        &self,
        g: &Generation,
        failed_link: Option<&ServiceLink>,
        msg: Outgoing,
    ) {
        let mut sends = Vec::new();
        if g.core.attempt_unsent(&msg, self.now(), &mut sends) {
            // Nothing to send: the attempt was no longer the transaction's current one, or
            // it is answered already; the request is not lost.
            if !sends.is_empty() {
                bump(&self.counters.requests_rerouted);
            }
            self.carry_sends(g, sends, &msg.call_id);
            return;
        }
        let failed = failed_link.and_then(|l| g.index_of(l));
        let dst = failed_link.map_or(SocketAddr::from(([0, 0, 0, 0], 0)), |l| l.addr);
        let sent = match g.core.rechoose(&msg, dst, self.now()) {
            Some(m) if Some(m) != failed => g.links.get(m).is_some_and(|l| {
                if l.udp {
                    self.to_udp_member(&msg, l.addr, msg.call_id.as_call_id())
                } else {
                    l.tx.try_send(msg.clone()).is_ok()
                }
            }),
            _ => false,
        };
        if sent {
            bump(&self.counters.requests_rerouted);
            return;
        }
        bump(&self.counters.requests_lost);
        self.answer_unavailable(g, &msg, &msg.call_id);
    }

    /// Answer a forwarded request no service took with fulcrum's 503 on its client's
    /// connection (nothing for ACK, see `SipCore::unavailable`); `call_id`: the request's,
    /// which the 503 carries (RFC 3261 §8.2.6.2), for the capture.
    pub(super) fn answer_unavailable(&self, g: &Generation, forwarded: &[u8], call_id: &CallIdBuf) {
        let mut out = Vec::new();
        match g.core.unavailable(forwarded, self.now(), &mut out) {
            Action::ToConn(id) => {
                self.to_client(id, Outgoing::new(Bytes::from(out), call_id.clone()));
            }
            // A sip-udp vserver's client: the 503 goes where its Via says.
            Action::ToAddr(addr) if self.front.is_some() => {
                self.to_udp(&out, addr, call_id.as_call_id());
            }
            _ => {}
        }
    }

    /// Redispatch `pending` and everything queued on `rx` (the receiving end of `link`).
    pub(super) fn redispatch_queued(
        &self,
        link: &ServiceLink,
        pending: Option<Outgoing>,
        rx: &mut mpsc::Receiver<Outgoing>,
    ) {
        for msg in pending
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            self.redispatch(link, msg);
        }
    }

    /// Remove client `id` from the tables; true when this call removed it.
    pub(super) fn forget_client(&self, id: u64, remote: SocketAddr) -> bool {
        let removed = self.clients.remove(&id).is_some();
        if removed {
            self.counters.clients_open.fetch_sub(1, Ordering::Relaxed);
        }
        self.by_remote.remove_if(&remote, |_, v| *v == id);
        removed
    }

    /// Carry out the decision `g`'s core made for a message that arrived from `origin`;
    /// `call_id`: the Call-ID of that message, which what its decision sends carries
    /// ([`crate::core::sip::Scanned`]), for the capture of its write.
    pub(super) fn dispatch(
        &self,
        g: &Generation,
        action: Action,
        out: &[u8],
        origin: Origin,
        reply: ReplyTo<'_>,
        call_id: &CallIdBuf,
    ) {
        let bytes = || Outgoing::new(Bytes::copy_from_slice(out), call_id.clone());
        match action {
            Action::ToMember(m) => {
                if !self.to_service(g, m, bytes()) {
                    // The service's queue is full (it is not keeping up).
                    self.not_queued(g, out, call_id);
                }
            }
            Action::ToConn(id) => {
                if !self.to_client(id, bytes()) {
                    bump(&self.counters.responses_no_client);
                }
            }
            Action::ToFlow(id) => {
                if !self.to_client(id, bytes()) {
                    // The client's connection is gone: the service hears 430 Flow Failed
                    // (RFC 5626 §5.3), routed back as any response to it.
                    let mut answer = Vec::new();
                    let action = g.core.flow_failed(out, &mut answer);
                    let origin = Origin::Client { conn: None };
                    self.dispatch(g, action, &answer, origin, reply, call_id);
                }
            }
            Action::ToAddr(addr) => {
                let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
                // A client's response may go to another port of a sip-udp service's host (its
                // Via says where); anything else only to a member's own address, so that a
                // service's request toward a client on the same host reaches the client.
                let udp_member = match origin {
                    Origin::Client { .. } => g.core.udp_member_of(addr),
                    Origin::Member(_) => g
                        .core
                        .member_of(addr)
                        .filter(|&m| g.core.member_transport(m) == Transport::Udp),
                };
                if self.udp.is_some() && udp_member.is_some() {
                    // A client's response to a sip-udp service's in-dialog request: to the
                    // address its Via names, on the UDP leg.
                    self.to_udp(out, addr, call_id.as_call_id());
                } else if let Some(m) = g.core.member_of(addr) {
                    // A client's response to a service's in-dialog request.
                    self.to_service(g, m, bytes());
                } else if let Some(tx) = self.draining_tx(addr) {
                    // The same, toward a service a reload removed (its connection drains).
                    let _ = tx.try_send(bytes());
                } else if let (Origin::Member(_), true) = (origin, self.front.is_some()) {
                    // A stream service's response or in-dialog request toward a client of a
                    // sip-udp vserver: a datagram, as the vserver sends any.
                    self.to_udp(out, addr, call_id.as_call_id());
                } else if let Origin::Member(_) = origin {
                    // A service's in-dialog request toward a client: only over a live
                    // connection from that client's address. Never for a message from a
                    // client, which could otherwise be injected into another client's
                    // connection.
                    match self.by_remote.get(&addr).map(|v| *v) {
                        Some(id) => {
                            self.to_client(id, bytes());
                        }
                        None => bump(&self.counters.in_dialog_no_client),
                    }
                } else {
                    bump(&self.counters.responses_no_client);
                }
            }
            Action::Reply(_) => {
                // On streams a reply goes back on the connection it answers.
                self.reply(reply, bytes());
            }
            Action::Drop(reason) => {
                if self.log.allow(self.now()) {
                    tracing::debug!(vserver = %self.name, ?reason, "message dropped");
                }
            }
        }
    }
}
