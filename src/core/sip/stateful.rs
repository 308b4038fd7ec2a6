//! PURE: the table of requests fulcrum holds statefully for failover ([`transaction`]), and
//! the core's side of each: the next attempt chosen and forwarded, fulcrum's own answers,
//! ACK and CANCEL built. Shared by every worker of a vserver (a response may arrive on any of
//! its sockets), bounded by `failover.max_pending`; `now` is passed in, and the shell wakes
//! [`SipCore::poll_transactions`] at the deadline it returns.

use super::transaction::{Event, Failover, Hop, Hops, Transaction, TxAction};
use super::*;
use crate::eject::{Cause, Failure};
use bytes::Bytes;
use dashmap::DashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Mutex;

/// Where a message the core sends on a held request's behalf goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dest {
    /// A datagram to this address (a client over UDP).
    Addr(SocketAddr),
    /// A datagram to the member at this address (reached over UDP): from `service_source`
    /// when the vserver has one.
    Service(SocketAddr),
    /// Member `m`'s link (a member reached over a stream).
    Member(usize),
    /// The client connection with this id (streams).
    Conn(u64),
}

/// A message the shell sends on the core's behalf, besides the one its action names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Send {
    pub dest: Dest,
    pub bytes: Bytes,
    /// Whose Call-ID it carries, as far as the core knows without a look.
    pub call_id: Carries,
}

/// Whose Call-ID a [`Send`] carries: what a shell that captures it may hand the capture
/// instead of a search (docs/capture.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carries {
    /// The Call-ID of the message whose handling made it ([`Decision::call_id`]; for
    /// [`SipCore::attempt_unsent`], of the attempt it was given): fulcrum built it from that
    /// message (its 100 Trying, its 200 to a CANCEL, RFC 3261 §8.2.6.2), or from the held
    /// request that message belongs to, whose Call-ID the core found to be the same (an
    /// attempt, the ACK of a non-2xx final, a CANCEL: §16.6, §17.1.1.3, §9.1).
    Handled,
    /// Not known without a look: sent by the transaction timer (no message was handled), an
    /// answer to the client that may be a service's relayed, or a held request's message
    /// while handling one with another Call-ID.
    Unknown,
}

/// Counters of the failover table.
#[derive(Debug, Default)]
pub struct TransactionCounters {
    /// Requests held statefully.
    pub started: AtomicU64,
    /// Requests forwarded statelessly because `max_pending` were held.
    pub table_full: AtomicU64,
    /// Attempts after the first (a request moved to the next service).
    pub failovers: AtomicU64,
    /// Client retransmissions, ACKs and service answers the table absorbed.
    pub absorbed: AtomicU64,
    /// Requests whose every try failed (the client got the best answer, 500 or 408).
    pub exhausted: AtomicU64,
}

/// One held request: its machine and what the core needs to act for it.
#[derive(Debug)]
struct Held {
    tx: Transaction,
    /// The client's request as it arrived, forwarded again for each attempt.
    request: Bytes,
    /// Its method (a CANCEL or ACK matches an INVITE).
    method: SipMethod,
    src: SocketAddr,
    dst: SocketAddr,
    /// Where the client's responses go: its Via (RFC 3581 aware), or its connection.
    client: Dest,
    /// Where its Call-ID is in `request` (`None`: it has none).
    call_id: Option<sip::Span>,
    /// What the entry weighs against `max_pending_bytes` (as last counted).
    weight: usize,
    /// The deadline queued for it in the timer heap (`Nanos::MAX`: none): a later one is not
    /// queued again, so a client retransmitting a held request a million times adds nothing.
    armed: Nanos,
}

impl Held {
    fn weigh(&self) -> usize {
        self.request.len() + self.tx.weight() + std::mem::size_of::<Held>() + ENTRY_OVERHEAD
    }

    /// Whether the held request's Call-ID is `msg`'s (a handled message's).
    fn has_call_id_of(&self, msg: &SipMsg<'_>) -> bool {
        let call_id = msg.call_id();
        call_id.is_some() && self.call_id.map(|s| s.of(&self.request)) == call_id
    }
}

/// What a map entry and its timer cost besides the `Held` itself (hash, shard slot, heap
/// entry), roughly: enough that a flood of tiny requests is bounded by bytes too.
const ENTRY_OVERHEAD: usize = 64;

/// The requests a vserver holds; carried over to the core a reload builds.
#[derive(Debug, Default)]
pub struct Transactions {
    held: DashMap<u64, Held>,
    /// How many are held (read per message; the map's own count locks every shard).
    count: std::sync::atomic::AtomicUsize,
    /// What the held entries weigh, in bytes ([`Held::weigh`]).
    bytes: std::sync::atomic::AtomicUsize,
    /// Deadlines by key; an entry whose transaction has a later deadline (or is gone) is
    /// stale and skipped.
    timers: Mutex<BinaryHeap<Reverse<(Nanos, u64)>>>,
    pub counters: TransactionCounters,
}

impl Transactions {
    /// Requests held now.
    pub fn len(&self) -> usize {
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes the held requests weigh.
    pub fn bytes(&self) -> usize {
        self.bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Timer entries queued (stale ones included): bounded by the transactions' deadline
    /// changes, not by the messages they see.
    pub fn timers_queued(&self) -> usize {
        crate::sync::lock(&self.timers).len()
    }

    fn remove(&self, key: u64) {
        if let Some((_, h)) = self.held.remove(&key) {
            self.count
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            self.bytes
                .fetch_sub(h.weight, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Re-count what `h` weighs after a change.
    fn reweigh(&self, h: &mut Held) {
        use std::sync::atomic::Ordering::Relaxed;
        let w = h.weigh();
        if w > h.weight {
            self.bytes.fetch_add(w - h.weight, Relaxed);
        } else {
            self.bytes.fetch_sub(h.weight - w, Relaxed);
        }
        h.weight = w;
    }

    /// Queue `h`'s deadline `at` unless an earlier or equal one is queued already; the
    /// caller pushes what this returns once the entry's lock is released.
    fn due(h: &mut Held, at: Option<Nanos>) -> Option<Nanos> {
        let at = at.filter(|&at| at < h.armed)?;
        h.armed = at;
        Some(at)
    }

    fn arm(&self, key: u64, at: Option<Nanos>) {
        if let Some(at) = at {
            crate::sync::lock(&self.timers).push(Reverse((at, key)));
        }
    }
}

/// The core's side of one held request.
struct CoreHops<'a> {
    core: &'a SipCore,
    /// The client's request as it arrived, and scanned when the caller has it so.
    request: &'a [u8],
    scanned: Option<SipMsg<'a>>,
    src: SocketAddr,
    dst: SocketAddr,
    /// Where the client is: its connection id goes in every attempt's Via, as in the first.
    client: Dest,
    now: Nanos,
}

impl Hops for CoreHops<'_> {
    fn forward(&self, attempt: u8, tried: &[SocketAddr]) -> Option<Hop> {
        let core = self.core;
        let msg = match self.scanned {
            Some(m) => m,
            None => sip::scan(self.request).ok()?,
        };
        // Any member may take the next attempt, over whichever leg reaches it (every leg's
        // branches share the vserver's seed, so the answer finds this transaction), unless
        // the request could not grow into a datagram toward a sip-udp member.
        let too_long = |m: usize| msg.len() > core.max_forwarded_to(m).saturating_sub(MAX_GROWTH);
        let avoid =
            |m: usize| core.member_addrs.get(m).is_none_or(|a| tried.contains(a)) || too_long(m);
        let member = core.choose_next(&msg, self.src, self.dst, self.now, &avoid)?;
        let addr = *core.member_addrs.get(member)?;
        let conn_id = match self.client {
            Dest::Conn(id) => Some(id),
            _ => None,
        };
        // The same flow token as the first attempt: a REGISTER stored through another
        // registrar keeps its Path, a call its way back to the client.
        let (token, with_path, in_record_route) = core.flow_token_of(&msg, self.src, conn_id);
        let token = token.as_ref().map(sip::flow::Token::as_bytes);
        let rw = RequestRewrite {
            local: core.identity_toward(member),
            src: self.src,
            record_route: core.record_route,
            force_rport: false,
            conn_id,
            service: core.digest_of(Some(member)),
            // Across the bridge, double record-routed as the first attempt (RFC 5658 §3.2).
            arrived_on: core.leg_of(member).map(|_| &core.local),
            flow: token.filter(|_| in_record_route),
            path: token.filter(|_| with_path),
        };
        let mut out = Vec::with_capacity(self.request.len() + 512);
        sip::forward_request_attempt(&msg, &rw, attempt, &mut out).ok()?;
        bump(&core.counters.requests_forwarded);
        bump(&core.transactions.counters.failovers);
        if let Some(c) = core.balancer.counters(member) {
            c.record_request();
        }
        Some(Hop {
            member,
            addr,
            sent: Bytes::from(out),
            datagram: core.member_transport(member) == Transport::Udp,
        })
    }

    fn reply(&self, code: u16) -> Option<Bytes> {
        let msg = match self.scanned {
            Some(m) => m,
            None => sip::scan(self.request).ok()?,
        };
        let reason = match code {
            100 => "Trying",
            408 => "Request Timeout",
            487 => "Request Terminated",
            _ => "Server Internal Error",
        };
        let reply = Reply {
            code,
            reason,
            retry_after_s: None,
        };
        let mut out = Vec::new();
        build_reply(&msg, &reply, self.src, &mut out).ok()?;
        if code >= 400 && code != 487 {
            bump(&self.core.transactions.counters.exhausted);
        }
        Some(Bytes::from(out))
    }

    fn relay(&self, response: &[u8]) -> Option<Bytes> {
        let msg = sip::scan(response).ok()?;
        let mut out = Vec::with_capacity(response.len());
        sip::forward_response(&msg, &self.core.local, &mut out).ok()?;
        bump(&self.core.counters.responses_forwarded);
        Some(Bytes::from(out))
    }

    fn hop(&self, sent: &[u8], method: &[u8], response: Option<&[u8]>) -> Option<Bytes> {
        let sent = sip::scan(sent).ok()?;
        let response = match response {
            Some(r) => Some(sip::scan(r).ok()?),
            None => None,
        };
        let mut out = Vec::new();
        sip::build_hop_request(&sent, method, response.as_ref(), &mut out).ok()?;
        Some(Bytes::from(out))
    }
}

impl SipCore {
    /// The core with failover of requests outside a dialog (`None`: off), holding them in
    /// `table` (a rebuilt core takes over its predecessor's).
    pub fn with_failover(
        mut self,
        failover: Option<Failover>,
        table: Arc<Transactions>,
    ) -> SipCore {
        self.pools_differ = self.pool_failovers.iter().any(|f| *f != failover);
        self.failover = failover;
        self.transactions = table;
        self
    }

    /// Whether any request may be held: failover is on for the vserver's own pool or for
    /// some rule's pool.
    fn fails_over(&self) -> bool {
        self.failover.is_some() || self.pool_failovers.iter().any(Option::is_some)
    }

    /// The failover of the pool a client's request was routed to (its rule's, by the same
    /// decision as [`SipCore::choose_next`]'s); the vserver's where no rule's pool differs.
    fn failover_of(&self, msg: &SipMsg<'_>, src: SocketAddr, dst: SocketAddr) -> Option<&Failover> {
        // Only a request outside a dialog is held ([`SipCore::hold`]).
        if msg.to_tag().is_some() || matches!(msg.method_kind(), SipMethod::Ack | SipMethod::Cancel)
        {
            return None;
        }
        if !self.pools_differ {
            return self.failover.as_ref();
        }
        match self.pool_of(msg, src, dst) {
            Some((_, crate::route::Target::Pool(k))) if *k > 0 => {
                self.pool_failovers.get(k - 1).and_then(Option::as_ref)
            }
            _ => self.failover.as_ref(),
        }
    }

    /// The table of held requests.
    pub fn transactions(&self) -> &Arc<Transactions> {
        &self.transactions
    }

    /// The member ranked next for a request, passing over those `avoid` names: the
    /// method's key (the Call-ID for `call_id_hash`, so every instance agrees), and the
    /// dialog the request pins moved there.
    fn choose_next(
        &self,
        msg: &SipMsg<'_>,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        avoid: &dyn Fn(usize) -> bool,
    ) -> Option<usize> {
        let call_hash = msg.call_id().map(hash::key_hash);
        // The pool its rule gave it (rules read only the request and the listener, so this is
        // the first attempt's): failover never leaves it.
        let pool = match self.pool_of(msg, src, dst) {
            None => 0,
            Some((_, crate::route::Target::Pool(p))) => *p,
            Some(_) => return None,
        };
        let method = self.balancer.pool_method(pool);
        let key = self.key_in(pool, msg, src, dst, call_hash);
        let member = self.balancer.choose_in(pool, key, now, avoid)?.member;
        let now_ms = now / 1_000_000;
        if let (Some(h), Ok(m)) = (call_hash, u32::try_from(member)) {
            self.pull(h, now_ms);
            if requests::pins_with(method, msg) {
                self.pin(h, m, msg.cseq().map_or(0, |c| c.seq), now_ms);
            } else {
                self.dialogs.linger(h, m, now_ms, |c| self.tally(c));
            }
        }
        Some(member)
    }

    /// A datagram handled as [`SipCore::handle_datagram`] does, with failover: requests
    /// outside a dialog are held until their final answer, and what the held requests send
    /// besides the action's datagram is appended to `sends`.
    pub fn handle_datagram_stateful(
        &self,
        buf: &[u8],
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
        sends: &mut Vec<Send>,
    ) -> Action {
        self.decide_datagram_stateful(buf, src, dst, now, out, sends)
            .action
    }

    /// [`SipCore::handle_datagram_stateful`], with the Call-ID its scan read.
    pub fn decide_datagram_stateful<'a>(
        &self,
        buf: &'a [u8],
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
        sends: &mut Vec<Send>,
    ) -> Decision<'a> {
        // With failover off (a reload may turn it off) the requests still held finish.
        if !self.fails_over() && self.transactions.is_empty() {
            return self.decide_datagram(buf, src, dst, now, out);
        }
        let origin = self.datagram_origin(src);
        self.decide_stateful(buf, origin, src, dst, now, out, sends)
    }

    /// A message handled as [`SipCore::handle`] does, with failover (streams: `origin` says
    /// which connection it came on).
    #[allow(clippy::too_many_arguments)]
    pub fn handle_stateful(
        &self,
        buf: &[u8],
        origin: Origin,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
        sends: &mut Vec<Send>,
    ) -> Action {
        self.decide_stateful(buf, origin, src, dst, now, out, sends)
            .action
    }

    /// [`SipCore::handle_stateful`], with the Call-ID its scan read.
    #[allow(clippy::too_many_arguments)]
    pub fn decide_stateful<'a>(
        &self,
        buf: &'a [u8],
        origin: Origin,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
        sends: &mut Vec<Send>,
    ) -> Decision<'a> {
        // With failover off (a reload may turn it off) the requests still held finish: their
        // retransmissions, CANCELs, ACKs and answers still find them; nothing new is held.
        if !self.fails_over() && self.transactions.is_empty() {
            return self.decide(buf, origin, src, dst, now, out);
        }
        if self.refused_by_acl(origin, src) {
            out.clear();
            return Decision {
                action: Action::Drop(DropReason::Acl),
                call_id: Scanned::No,
            };
        }
        // Scanned once: what is not held is decided from the same scan.
        let Ok(msg) = sip::scan(buf) else {
            return self.decide(buf, origin, src, dst, now, out);
        };
        Decision {
            action: self.held_or_handled(&msg, buf, origin, src, dst, now, out, sends),
            call_id: Scanned::CallId(msg.call_id()),
        }
    }

    /// [`SipCore::decide_stateful`]'s decision on a message scanned as `msg`: by the held
    /// request it belongs to, else as [`SipCore::handle`] decides (and held when it is one
    /// that fails over).
    #[allow(clippy::too_many_arguments)]
    fn held_or_handled(
        &self,
        msg: &SipMsg<'_>,
        buf: &[u8],
        origin: Origin,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
        sends: &mut Vec<Send>,
    ) -> Action {
        match origin {
            Origin::Client { conn } if msg.is_request() => {
                let client = match conn {
                    Some(id) => Dest::Conn(id),
                    None => Dest::Addr(reply_target(msg, src)),
                };
                // The branch fulcrum gives the request: the key of its transaction, which a
                // retransmission, the CANCEL and the non-2xx ACK share.
                let key = sip::transaction_key(msg, &self.local);
                if let Some(key) = key
                    && let Some(action) = self.held_request(msg, key, client, src, now, out, sends)
                {
                    return action;
                }
                // An RFC 2543 client's ACK of a non-2xx final: the INVITE's key has no To
                // tag, and the ACK's To tag must be the final's (RFC 3261 §17.2.3).
                if msg.method_kind() == SipMethod::Ack
                    && let Some(k) = sip::rfc2543_invite_key(msg, &self.local)
                    && self.final_to_tag_is(k, msg.to_tag())
                    && let Some(action) = self.held_request(msg, k, client, src, now, out, sends)
                {
                    return action;
                }
                let action = self.handle_scanned(msg, origin, src, dst, now, out);
                if let (Action::ToMember(m), Some(key)) = (action, key)
                    && let Some(failover) = self.failover_of(msg, src, dst)
                {
                    self.hold(failover, msg, key, m, client, src, dst, now, out, sends);
                }
                action
            }
            Origin::Member(_) | Origin::Client { conn: None } if !msg.is_request() => {
                // As `handle` tells them apart: on datagrams a response from a member's host
                // is a service's (RFC 3261 §18.2.2).
                let from_member = matches!(origin, Origin::Member(_)) || self.is_member_ip(src);
                if from_member && let Some(action) = self.held_response(msg, buf, now, out, sends) {
                    return action;
                }
                self.handle_scanned(msg, origin, src, dst, now, out)
            }
            _ => self.handle_scanned(msg, origin, src, dst, now, out),
        }
    }

    /// Whether the final answer held request `key` gave its client carries To tag `tag`.
    fn final_to_tag_is(&self, key: u64, tag: Option<&[u8]>) -> bool {
        let Some(h) = self.transactions.held.get(&key) else {
            return false;
        };
        h.tx.final_answer()
            .and_then(|b| sip::scan(b).ok().map(|m| m.to_tag() == tag))
            .unwrap_or(false)
    }

    /// A client's request that belongs to a held one: a retransmission, its CANCEL or the ACK
    /// of its non-2xx final answer.
    #[allow(clippy::too_many_arguments)]
    fn held_request(
        &self,
        msg: &SipMsg<'_>,
        key: u64,
        from: Dest,
        src: SocketAddr,
        now: Nanos,
        out: &mut Vec<u8>,
        sends: &mut Vec<Send>,
    ) -> Option<Action> {
        if self.transactions.is_empty() {
            return None;
        }
        let method = msg.method_kind();
        let event = match method {
            SipMethod::Cancel => Event::Cancel,
            SipMethod::Ack => Event::Ack,
            _ => Event::Retransmission,
        };
        let (client, acts, same) = self.drive(key, now, Some(msg), |held| {
            // A CANCEL or ACK matches the INVITE it names; another method is another
            // request. And it comes from the same client (over a stream, the same
            // connection: a request on another one that reuses a branch is another
            // request, RFC 3261 §17.2.3).
            let matches = held.client == from
                && match event {
                    Event::Cancel => held.method == SipMethod::Invite,
                    // The ACK of a 2xx goes on end to end (RFC 3261 §13.2.2.4), even when
                    // it reuses the INVITE's branch.
                    Event::Ack => held.method == SipMethod::Invite && held.tx.absorbs_ack(),
                    _ => held.method == method,
                };
            matches.then_some(event)
        })?;
        bump(&self.counters.requests_in);
        let mut action = Action::Drop(DropReason::Absorbed);
        if matches!(event, Event::Cancel) {
            // §16.10: a stateful proxy answers the CANCEL itself, and that 200 goes out ahead
            // of the CANCEL it sends on: the service's 487 to the INVITE, which another worker
            // may relay at once, must not overtake it (a caller expects 200, then 487).
            let ok = Reply {
                code: 200,
                reason: "OK",
                retry_after_s: None,
            };
            match self.reply(msg, src, &ok, out) {
                Action::Reply(to) => {
                    let dest = match from {
                        Dest::Addr(_) => Dest::Addr(to),
                        other => other,
                    };
                    sends.push(Send {
                        dest,
                        bytes: Bytes::copy_from_slice(out),
                        call_id: Carries::Handled,
                    });
                }
                // Not answerable (malformed): dropped and counted as `reply` says.
                other => action = other,
            }
        }
        self.carry(now, client, &acts, None, out, sends, same);
        bump(&self.transactions.counters.absorbed);
        Some(action)
    }

    /// Feed the held request `key` the event `admit` gives for it (none: the message is not
    /// its), then re-arm its timer: where its client is, what it asks for, and whether what
    /// it sends its services carries the Call-ID of `handled`, the message being handled
    /// ([`Carries`]; looked at only when it sends them something).
    fn drive<'e>(
        &self,
        key: u64,
        now: Nanos,
        handled: Option<&SipMsg<'_>>,
        admit: impl FnOnce(&Held) -> Option<Event<'e>>,
    ) -> Option<(Dest, Vec<TxAction>, Carries)> {
        let mut entry = self.transactions.held.get_mut(&key)?;
        let event = admit(&entry)?;
        let Held {
            tx,
            request,
            src,
            dst,
            client,
            ..
        } = &mut *entry;
        let hops = CoreHops {
            core: self,
            request,
            scanned: None,
            src: *src,
            dst: *dst,
            client: *client,
            now,
        };
        let mut acts = Vec::new();
        tx.handle(now, event, &hops, &mut acts);
        let (client, next) = (*client, tx.poll_timeout());
        let same = if let Some(msg) = handled
            && acts.iter().any(|a| matches!(a, TxAction::ToMember(..)))
            && entry.has_call_id_of(msg)
        {
            Carries::Handled
        } else {
            Carries::Unknown
        };
        self.transactions.reweigh(&mut entry);
        let queue = Transactions::due(&mut entry, next);
        drop(entry);
        self.transactions.arm(key, queue);
        Some((client, acts, same))
    }

    /// Hold a request just forwarded to member `m` (its bytes in `out`), when it is one that
    /// fails over: outside a dialog, not ACK or CANCEL, with room left.
    #[allow(clippy::too_many_arguments)]
    fn hold(
        &self,
        failover: &Failover,
        msg: &SipMsg<'_>,
        key: u64,
        m: usize,
        client: Dest,
        src: SocketAddr,
        dst: SocketAddr,
        now: Nanos,
        out: &[u8],
        sends: &mut Vec<Send>,
    ) {
        if msg.to_tag().is_some() || matches!(msg.method_kind(), SipMethod::Ack | SipMethod::Cancel)
        {
            return;
        }
        let Some(&addr) = self.member_addrs.get(m) else {
            return;
        };
        // What this one will weigh at least: the request and its first attempt.
        let weight = msg.len() + out.len() + std::mem::size_of::<Held>() + ENTRY_OVERHEAD;
        if self.transactions.len() >= failover.max_pending
            || self.transactions.bytes().saturating_add(weight) > failover.max_pending_bytes
        {
            bump(&self.transactions.counters.table_full);
            return;
        }
        let request = Bytes::copy_from_slice(msg.buf());
        let mut acts = Vec::new();
        let invite = msg.method_kind() == SipMethod::Invite;
        let sent = Bytes::copy_from_slice(out);
        let hops = CoreHops {
            core: self,
            request: &request,
            scanned: Some(*msg),
            src,
            dst,
            client,
            now,
        };
        let first = Hop {
            member: m,
            addr,
            sent,
            datagram: self.member_transport(m) == Transport::Udp,
        };
        let datagram_client = matches!(client, Dest::Addr(_));
        let tx = Transaction::start(
            now,
            invite,
            datagram_client,
            failover,
            first,
            &hops,
            &mut acts,
        );
        let next = tx.poll_timeout();
        match self.transactions.held.entry(key) {
            dashmap::Entry::Occupied(_) => return,
            dashmap::Entry::Vacant(v) => {
                let mut held = Held {
                    tx,
                    request,
                    call_id: msg.call_id_index().map(|i| i.value),
                    method: msg.method_kind(),
                    src,
                    dst,
                    client,
                    weight: 0,
                    armed: next.unwrap_or(Nanos::MAX),
                };
                held.weight = held.weigh();
                self.transactions
                    .bytes
                    .fetch_add(held.weight, std::sync::atomic::Ordering::Relaxed);
                v.insert(held);
                self.transactions
                    .count
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        bump(&self.transactions.counters.started);
        self.transactions.arm(key, next);
        let mut unused = Vec::new();
        let first = sends.len();
        self.carry(
            now,
            client,
            &acts,
            None,
            &mut unused,
            sends,
            Carries::Handled,
        );
        // The request's own transaction: what it sends at its start (its 100 Trying) was
        // built from this very request.
        for s in &mut sends[first..] {
            s.call_id = Carries::Handled;
        }
    }

    /// A service's response to an attempt of a held request.
    fn held_response(
        &self,
        msg: &SipMsg<'_>,
        buf: &[u8],
        now: Nanos,
        out: &mut Vec<u8>,
        sends: &mut Vec<Send>,
    ) -> Option<Action> {
        if self.transactions.is_empty() {
            return None;
        }
        let branch = msg.top_via()?.branch?;
        let (key, attempt) = sip::transaction_of(branch)?;
        if msg.cseq().is_some_and(|c| c.method == b"CANCEL") {
            // The answer to fulcrum's CANCEL of an attempt: it carries the attempt's branch
            // (RFC 3261 §9.1) but ends a transaction of fulcrum's own, not the INVITE's, and
            // the client's CANCEL was answered already (§16.10). Absorbed (its retransmissions
            // stop); the INVITE's own final answer (487) follows.
            self.drive(key, now, None, |_| Some(Event::CancelAnswered { attempt }))?;
            bump(&self.counters.responses_in);
            bump(&self.transactions.counters.absorbed);
            out.clear();
            return Some(Action::Drop(DropReason::Absorbed));
        }
        let code = msg.status_code()?;
        if code < 200 {
            // The request is alive at its service (absorbed or relayed): its pending entry
            // holds until Timer C, as the transaction does.
            self.track_answer(msg, Answerer::Unknown, now);
        }
        let retry_after_s = msg.header(b"Retry-After").and_then(sip::parse_retry_after);
        let event = Event::Response {
            attempt,
            code,
            retry_after_s,
            bytes: buf,
        };
        let (client, acts, same) = self.drive(key, now, Some(msg), |_| Some(event))?;
        bump(&self.counters.responses_in);
        let relayed = self.carry(now, client, &acts, Some(msg), out, sends, same);
        if code >= 200
            && let Some(Action::ToAddr(_) | Action::ToConn(_)) = relayed
            && let Some(mut e) = self.transactions.held.get_mut(&key)
        {
            e.tx.relayed(Bytes::copy_from_slice(out));
        }
        Some(relayed.unwrap_or_else(|| {
            bump(&self.transactions.counters.absorbed);
            Action::Drop(DropReason::Absorbed)
        }))
    }

    /// Carry out a held request's actions: datagrams into `sends`; a relay of the response
    /// being handled (`response`) into `out`, returned as the action. `members`: whose
    /// Call-ID what goes to its services carries (built from the held request, they carry
    /// its Call-ID); what goes to the client may be a service's answer, of its own Call-ID.
    #[allow(clippy::too_many_arguments)]
    fn carry(
        &self,
        now: Nanos,
        client: Dest,
        acts: &[TxAction],
        response: Option<&SipMsg<'_>>,
        out: &mut Vec<u8>,
        sends: &mut Vec<Send>,
        members: Carries,
    ) -> Option<Action> {
        let unknown = |dest, b: &Bytes| Send {
            dest,
            bytes: b.clone(),
            call_id: Carries::Unknown,
        };
        let mut action = None;
        for a in acts {
            match a {
                TxAction::ToClient(b) => {
                    // fulcrum's own final answer (408, 500, 487) ends the pending entry as a
                    // service's would.
                    if !b.starts_with(b"SIP/2.0 1")
                        && let Ok(msg) = sip::scan(b)
                    {
                        self.track_answer(&msg, Answerer::Unknown, now);
                    }
                    sends.push(unknown(client, b));
                }
                TxAction::Resend(b) => sends.push(unknown(client, b)),
                TxAction::ToMember(addr, b) => sends.push(Send {
                    dest: self.member_dest(*addr),
                    bytes: b.clone(),
                    call_id: members,
                }),
                TxAction::Relay => {
                    if let Some(msg) = response {
                        out.clear();
                        action = Some(self.response(msg, true, out));
                        self.track_answer(msg, Answerer::Unknown, now);
                    }
                }
                // Passive health: the monitor hears of it before its next probe, and ejection
                // counts it (a live request's answer is what ends a service's ejection).
                TxAction::Failed {
                    addr,
                    code,
                    retry_after_s,
                } => {
                    // By address: a rebuild since the attempt may have moved the indices.
                    let Some(member) = self.member_of(*addr) else {
                        continue;
                    };
                    self.balancer.report_failure(member);
                    let cause = code.map_or(Cause::Timeout, Cause::Code);
                    let retry = retry_after_s.map(|s| Duration::from_secs(u64::from(s)));
                    let failure = Failure::new(cause).with_retry_after(retry);
                    self.balancer.report_failure_with(member, failure, now);
                }
                TxAction::Answered { addr } => {
                    if let Some(member) = self.member_of(*addr) {
                        self.balancer.report_success(member, now);
                    }
                }
                TxAction::Won { addr } => {
                    if let (Some(msg), Some(member)) = (response, self.member_of(*addr)) {
                        self.pin_to(msg, member, now);
                    }
                }
            }
        }
        action
    }

    /// Confirm the dialog of `msg`'s Call-ID on `member`, whose 2xx the client got first: the
    /// request may have been forwarded to another member since (an attempt given up on that
    /// answered late), and its in-dialog requests must reach the service that holds the call.
    fn pin_to(&self, msg: &SipMsg<'_>, member: usize, now: Nanos) {
        if let Ok(m) = u32::try_from(member) {
            self.track_answer(msg, Answerer::Winner(m), now);
        }
    }

    /// Where a message to the member at `addr` goes: a datagram over UDP, else its link.
    fn member_dest(&self, addr: SocketAddr) -> Dest {
        match self.member_of(addr) {
            Some(m) if self.member_transport(m) != Transport::Udp => Dest::Member(m),
            _ => Dest::Service(addr),
        }
    }

    /// The attempt `forwarded` (the bytes fulcrum made for a member) could not be handed to
    /// its member's link: when it belongs to a held request, the transaction moves on to the
    /// next member at once (what it sends appended to `sends`) and this says `true`; the
    /// shell answers 503 only to a request nobody holds, so a client never gets fulcrum's
    /// 503 while its transaction goes on.
    pub fn attempt_unsent(&self, forwarded: &[u8], now: Nanos, sends: &mut Vec<Send>) -> bool {
        if self.transactions.is_empty() {
            return false;
        }
        let Ok(msg) = sip::scan(forwarded) else {
            return false;
        };
        // fulcrum's ACK and CANCEL carry the attempt's branch but are not the attempt.
        if !msg.is_request() || matches!(msg.method_kind(), SipMethod::Ack | SipMethod::Cancel) {
            return false;
        }
        let Some((key, attempt)) = msg
            .top_via()
            .and_then(|v| v.branch)
            .and_then(sip::transaction_of)
        else {
            return false;
        };
        let Some((client, acts, same)) =
            self.drive(key, now, Some(&msg), |_| Some(Event::Unsent { attempt }))
        else {
            return false;
        };
        let mut unused = Vec::new();
        self.carry(now, client, &acts, None, &mut unused, sends, same);
        true
    }

    /// Wake the held requests whose deadline passed: their sends appended to `sends`,
    /// finished ones removed. The next deadline, if any.
    pub fn poll_transactions(&self, now: Nanos, sends: &mut Vec<Send>) -> Option<Nanos> {
        loop {
            let key = {
                let mut timers = crate::sync::lock(&self.transactions.timers);
                match timers.peek() {
                    Some(Reverse((at, _))) if *at > now => return Some(*at),
                    None => return None,
                    Some(_) => timers.pop().map(|Reverse(entry)| entry),
                }
            };
            let Some((at, key)) = key else { continue };
            let finished = match self.transactions.held.get_mut(&key) {
                None => continue,
                // A stale entry: the transaction's deadline moved since it was queued (the
                // live one is queued too).
                Some(h) if h.armed != at => continue,
                Some(mut h) => {
                    h.armed = Nanos::MAX;
                    h.tx.is_finished(now)
                }
            };
            if finished {
                self.transactions.remove(key);
                continue;
            }
            // The machine does what is due (maybe nothing: its deadline may have moved
            // later) and the entry is queued again at its next deadline.
            let Some((client, acts, _)) = self.drive(key, now, None, |_| Some(Event::Timer)) else {
                continue;
            };
            let mut unused = Vec::new();
            self.carry(
                now,
                client,
                &acts,
                None,
                &mut unused,
                sends,
                Carries::Unknown,
            );
        }
    }
}

#[cfg(test)]
pub(super) mod tests;
