//! Carrying out the core's decisions for a SIP stream vserver: toward a client's queue, a
//! member's link, the UDP leg or a draining connection; requests whose link failed chosen
//! again, and fulcrum's 503 when none can take them. IO.

use super::*;
use crate::core::sip::stateful::{Dest, Send};

/// Where fulcrum's own answers to a message go (a reply it makes, a pong): back on the
/// connection the message came on.
#[derive(Clone, Copy)]
pub(super) enum ReplyTo<'a> {
    /// A client connection, through its outbox.
    Client(u64),
    /// A service link's connection.
    Link(&'a mpsc::Sender<Bytes>),
    /// Nowhere: the UDP leg sends its replies itself.
    Nowhere,
}

impl SipStreamShared {
    /// Send what held requests asked for (100 Trying, the next attempt, ACK, CANCEL, the
    /// best answer): to a client's connection, a member's link or over the UDP leg.
    pub(super) fn carry_sends(&self, g: &Generation, sends: Vec<Send>) {
        let mut sends = sends;
        // An attempt a link cannot take moves its transaction on, which may send more
        // (bounded by the transaction's tries).
        while !sends.is_empty() {
            let mut more = Vec::new();
            for Send { dest, bytes, .. } in sends {
                self.carry_send(g, dest, bytes, &mut more);
            }
            sends = more;
        }
    }

    fn carry_send(&self, g: &Generation, dest: Dest, bytes: Bytes, more: &mut Vec<Send>) {
        match dest {
            Dest::Conn(id) => {
                self.to_client(id, bytes);
            }
            Dest::Member(m) => {
                if !self.to_service(g, m, bytes.clone()) && !scan::is_response(&bytes) {
                    g.core.attempt_unsent(&bytes, self.now(), more);
                }
            }
            Dest::Addr(addr) => {
                self.to_udp(&bytes, addr);
            }
            Dest::Service(addr) => {
                self.to_udp_member(&bytes, addr);
            }
        }
    }

    /// A request `out` that member `m`'s link could not take: its held transaction moves
    /// on to the next member; one nobody holds is answered 503 + Retry-After now rather
    /// than left to a transaction timeout.
    fn not_queued(&self, g: &Generation, out: &[u8]) {
        let mut sends = Vec::new();
        if g.core.attempt_unsent(out, self.now(), &mut sends) {
            self.carry_sends(g, sends);
        } else {
            self.answer_unavailable(g, out);
        }
    }

    /// Queue `bytes` toward client `id`; a full queue disconnects that client only.
    pub(super) fn to_client(&self, id: u64, bytes: Bytes) -> bool {
        let Some(c) = self.clients.get(&id) else {
            return false;
        };
        match c.outbox.push(bytes) {
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
    pub(super) fn reply(&self, to: ReplyTo<'_>, bytes: Bytes) {
        match to {
            ReplyTo::Client(id) => {
                self.to_client(id, bytes);
            }
            ReplyTo::Link(tx) => {
                let _ = tx.try_send(bytes);
            }
            ReplyTo::Nowhere => {}
        }
    }

    /// Queue `bytes` toward member `member` of `g`. A link retired meanwhile (a reload
    /// removed its member after `g` was loaded) no longer takes requests: they are chosen
    /// again by the current core.
    pub(super) fn to_service(&self, g: &Generation, member: usize, bytes: Bytes) -> bool {
        let Some(link) = g.links.get(member) else {
            bump(&self.counters.service_queue_full);
            return false;
        };
        if link.udp {
            return self.to_udp_member(&bytes, link.addr);
        }
        match link.tx.try_send(bytes) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(bytes)) => {
                self.redispatch(link, bytes);
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
    /// it on the member's link and returns `None`, or returns where the datagram goes over
    /// UDP (a sip-udp member, or an address that is no stream member's).
    pub(crate) fn carry_datagram(
        &self,
        core: &Arc<SipCore>,
        action: Action,
        out: &[u8],
        _call_id: crate::capture::CallId<'_>,
    ) -> Option<SocketAddr> {
        let g = self.current.load();
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
                        if !self.to_service(&g, m, Bytes::copy_from_slice(out)) {
                            self.not_queued(&g, out);
                        }
                        None
                    }
                    None => {
                        self.redispatch_request(&g, None, Bytes::copy_from_slice(out));
                        None
                    }
                }
            }
            Action::ToAddr(addr) => {
                let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
                match g.core.member_of(addr) {
                    Some(m) if g.core.member_transport(m) != Transport::Udp => {
                        self.to_service(&g, m, Bytes::copy_from_slice(out));
                        None
                    }
                    _ => match self.draining_tx(addr) {
                        Some(tx) => {
                            let _ = tx.try_send(Bytes::copy_from_slice(out));
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
    pub(super) fn draining_tx(&self, addr: SocketAddr) -> Option<mpsc::Sender<Bytes>> {
        self.draining.get(&addr).map(|t| t.clone())
    }

    /// Send a request that could not go over `link` to the member the current core chooses
    /// now (a failed member is DOWN and a removed one absent, so the ranking passes it
    /// over). With none, it is counted lost and its client gets fulcrum's 503.
    pub(super) fn redispatch(&self, link: &ServiceLink, bytes: Bytes) {
        // A client's response to the service's in-dialog request cannot be chosen again:
        // it goes to the service's draining connection if there is one.
        if scan::is_response(&bytes) {
            match self.draining_tx(link.addr) {
                Some(tx) if tx.try_send(bytes).is_ok() => {}
                _ => bump(&self.counters.responses_no_client),
            }
            return;
        }
        let g = self.current.load();
        self.redispatch_request(&g, Some(link), bytes);
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
        bytes: Bytes,
    ) {
        let mut sends = Vec::new();
        if g.core.attempt_unsent(&bytes, self.now(), &mut sends) {
            // Nothing to send: the attempt was no longer the transaction's current one, or
            // it is answered already; the request is not lost.
            if !sends.is_empty() {
                bump(&self.counters.requests_rerouted);
            }
            self.carry_sends(g, sends);
            return;
        }
        let failed = failed_link.and_then(|l| g.index_of(l));
        let dst = failed_link.map_or(SocketAddr::from(([0, 0, 0, 0], 0)), |l| l.addr);
        let sent = match g.core.rechoose(&bytes, dst, self.now()) {
            Some(m) if Some(m) != failed => g.links.get(m).is_some_and(|l| {
                if l.udp {
                    self.to_udp_member(&bytes, l.addr)
                } else {
                    l.tx.try_send(bytes.clone()).is_ok()
                }
            }),
            _ => false,
        };
        if sent {
            bump(&self.counters.requests_rerouted);
            return;
        }
        bump(&self.counters.requests_lost);
        self.answer_unavailable(g, &bytes);
    }

    /// Answer a forwarded request no service took with fulcrum's 503 on its client's
    /// connection (nothing for ACK, see `SipCore::unavailable`).
    pub(super) fn answer_unavailable(&self, g: &Generation, forwarded: &[u8]) {
        let mut out = Vec::new();
        match g.core.unavailable(forwarded, self.now(), &mut out) {
            Action::ToConn(id) => {
                self.to_client(id, Bytes::from(out));
            }
            // A sip-udp vserver's client: the 503 goes where its Via says.
            Action::ToAddr(addr) if self.front.is_some() => {
                self.to_udp(&out, addr);
            }
            _ => {}
        }
    }

    /// Redispatch `pending` and everything queued on `rx` (the receiving end of `link`).
    pub(super) fn redispatch_queued(
        &self,
        link: &ServiceLink,
        pending: Option<Bytes>,
        rx: &mut mpsc::Receiver<Bytes>,
    ) {
        for bytes in pending
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            self.redispatch(link, bytes);
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

    /// Carry out the decision `g`'s core made for a message that arrived from `origin`.
    pub(super) fn dispatch(
        &self,
        g: &Generation,
        action: Action,
        out: &[u8],
        origin: Origin,
        reply: ReplyTo<'_>,
    ) {
        let bytes = || Bytes::copy_from_slice(out);
        match action {
            Action::ToMember(m) => {
                if !self.to_service(g, m, bytes()) {
                    // The service's queue is full (it is not keeping up).
                    self.not_queued(g, out);
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
                    self.dispatch(g, action, &answer, Origin::Client { conn: None }, reply);
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
                    self.to_udp(out, addr);
                } else if let Some(m) = g.core.member_of(addr) {
                    // A client's response to a service's in-dialog request.
                    self.to_service(g, m, bytes());
                } else if let Some(tx) = self.draining_tx(addr) {
                    // The same, toward a service a reload removed (its connection drains).
                    let _ = tx.try_send(bytes());
                } else if let (Origin::Member(_), true) = (origin, self.front.is_some()) {
                    // A stream service's response or in-dialog request toward a client of a
                    // sip-udp vserver: a datagram, as the vserver sends any.
                    self.to_udp(out, addr);
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
