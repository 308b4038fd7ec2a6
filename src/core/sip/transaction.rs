//! PURE: failover of a request outside a dialog. fulcrum holds such a request statefully
//! until its final answer (RFC 3261 §16, §17), one [`Transaction`] per client transaction,
//! fed events and `now` and returning actions and its next deadline, in the manner of
//! `core::link`: the shell sends what it is told and wakes the machine at
//! [`Transaction::poll_timeout`]. Holding the request makes fulcrum owe both sides the
//! duties of a transaction-stateful proxy:
//!
//! Toward the client (the server transaction, §17.2):
//! - An INVITE is answered 100 (Trying) at once (§16.2); its retransmissions get the 100
//!   again until a final answer.
//! - Every final answer the client is given (relayed or fulcrum's own, the best answer
//!   after the tries included) is remembered and sent again on each retransmission of the
//!   request (§17.2.1, §17.2.2), except a 2xx to an INVITE: after it, the INVITE's
//!   retransmissions are absorbed and the services' own 2xx retransmissions are relayed
//!   (RFC 6026 §7.1, the Accepted state).
//! - Over UDP a non-2xx final answer to an INVITE is retransmitted on Timer G (T1 doubling to
//!   T2) until the client's ACK, for at most Timer H (64·T1), §17.2.1: after its 100 the
//!   client does not retransmit, so one lost datagram would otherwise leave it ringing.
//! - The ACK of a non-2xx final ends at fulcrum; an ACK of a 2xx is not the transaction's
//!   and goes on end to end ([`Transaction::absorbs_ack`]).
//! - A non-INVITE request never gets 408 (RFC 4320 §4.2): when no service answered, fulcrum
//!   stays silent and the client's own Timer F ends it.
//!
//! Toward the services (a client transaction per attempt, §17.1, its own branch, §16.6
//! step 8):
//! - Retransmitted by Timer A (INVITE) or E (others) when its member is reached over UDP
//!   (across the transports bridge one request may try both kinds); a non-INVITE keeps
//!   retransmitting at T2 while Proceeding (§17.1.2.2), until Timer F from its send.
//! - A final answer in the failover codes, or no answer at all (not even 100) within
//!   `no_answer` (INVITE) or `no_answer_non_invite` (others, off by default: RFC 4320 §4.1
//!   lets a service stay silent up to T2 before its 100), sends the request to the
//!   next-ranked usable service, up to `tries` services; the client never sees a failed
//!   attempt's answer. After a 101-199 answer only Timer C (§16.8, restarted by each one,
//!   longer than 3 minutes) ends an INVITE attempt.
//! - fulcrum ACKs every non-2xx final answer of its own attempts (§17.1.1.3); a CANCEL goes
//!   to the attempt in progress (once it has answered provisionally, §9.1), and to an
//!   abandoned attempt that answers provisionally later; over UDP it is retransmitted by
//!   Timer E until its answer or the attempt's final one. A 2xx is relayed whenever it comes
//!   (§16.7 step 5); a 2xx or a 6xx ends the search and CANCELs the attempts still pending
//!   (§16.7 steps 5, 10).
//! - When the tries run out the client gets the best answer (§16.7 step 6): the lowest
//!   class, a 503 turned into 500 (a 503 would tell the client that fulcrum is overloaded);
//!   487 once the client CANCELed; 408 to an INVITE no service answered.

use crate::stats::Nanos;
use bytes::Bytes;
use std::net::SocketAddr;

const MS: Nanos = 1_000_000;
/// RFC 3261 §17.1.1.1: the round-trip estimate, first retransmission interval.
pub const T1: Nanos = 500 * MS;
/// RFC 3261 §17.1.2.2: the longest interval between non-INVITE retransmissions.
pub const T2: Nanos = 4_000 * MS;
/// RFC 3261 §17.1.2.2: how long a message may stay in the network (Timer I: how long an
/// acknowledged non-2xx final lingers to absorb ACK retransmissions).
pub const T4: Nanos = 5_000 * MS;
/// Timers B, F, H, J and L (64·T1): how long a client transaction is waited for, how long a
/// non-2xx final is retransmitted without ACK, how long a finished transaction lingers to
/// absorb the client's retransmissions.
pub const TIMER_64T1: Nanos = 64 * T1;
/// Timer C (§16.6 step 11, §16.8): an INVITE attempt that answered provisionally is
/// cancelled when no 101-199 or final answer came for this long; it "MUST be larger than 3
/// minutes".
pub const TIMER_C: Nanos = 185_000 * MS;

pub use crate::config::Failover;

/// An attempt the core forwarded: to which member, the bytes sent, and how they travel.
#[derive(Debug, Clone)]
pub struct Hop {
    pub member: usize,
    /// The member's address: its identity across rebuilds (indices shift when a reload or a
    /// DNS change inserts members).
    pub addr: SocketAddr,
    pub sent: Bytes,
    /// The member is reached over UDP: fulcrum retransmits toward it (RFC 3261 §17.1.1.2);
    /// over a stream it does not (§17.1.1.2 too: a reliable transport). One held request may
    /// try members of both kinds across the transports bridge.
    pub datagram: bool,
}

/// What a transaction asks of the core: the next attempt, and messages of its own.
pub trait Hops {
    /// Forward the held request as attempt `attempt` to the member ranked next after those in
    /// `tried` (their addresses), or `None` when no member can take it.
    fn forward(&self, attempt: u8, tried: &[SocketAddr]) -> Option<Hop>;
    /// fulcrum's own answer to the client's request (100, 408, 487, 500).
    fn reply(&self, code: u16) -> Option<Bytes>;
    /// An ACK (with the final `response` it acknowledges) or a CANCEL of the request `sent`.
    fn hop(&self, sent: &[u8], method: &[u8], response: Option<&[u8]>) -> Option<Bytes>;
    /// A service's `response` as the client is given it (fulcrum's Via taken off).
    fn relay(&self, response: &[u8]) -> Option<Bytes>;
}

/// What happened to a transaction.
#[derive(Debug, Clone, Copy)]
pub enum Event<'a> {
    /// The client sent the request again.
    Retransmission,
    /// A service answered attempt `attempt` (`bytes`: the response as it arrived).
    Response {
        attempt: u8,
        code: u16,
        retry_after_s: Option<u32>,
        bytes: &'a [u8],
    },
    /// The client cancelled the INVITE.
    Cancel,
    /// A service answered fulcrum's CANCEL of attempt `attempt` (its retransmissions stop).
    CancelAnswered { attempt: u8 },
    /// Attempt `attempt` could not be handed to its member's link (its queue full: the
    /// service is not keeping up): the next member takes it at once, inside this
    /// transaction, so the client still gets one final answer.
    Unsent { attempt: u8 },
    /// The client acknowledged the non-2xx final answer it was given.
    Ack,
    /// A deadline ([`Transaction::poll_timeout`]) may have passed.
    Timer,
}

/// What the shell does for a transaction, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxAction {
    /// Send fulcrum's own bytes to the client: an answer it made, or the best answer it
    /// relays once the tries ran out; a final one ends the client's pending request.
    ToClient(Bytes),
    /// Send the client again what it was sent before (a retransmitted request, Timer G).
    Resend(Bytes),
    /// Relay the response being handled to the client, as the stateless proxy does; the
    /// shell hands a final one back through [`Transaction::relayed`].
    Relay,
    /// Send bytes to a service: an attempt, its retransmission, an ACK or a CANCEL.
    ToMember(SocketAddr, Bytes),
    /// The service at `addr` failed this request (failover code `code`, or no answer when
    /// `None`): for passive health.
    Failed {
        addr: SocketAddr,
        code: Option<u16>,
        retry_after_s: Option<u32>,
    },
    /// The service at `addr` answered this request: for passive health.
    Answered { addr: SocketAddr },
    /// The first 2xx the client gets comes from the service at `addr`: the dialog is its.
    Won { addr: SocketAddr },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Sent, nothing heard: retransmitted, abandoned at `no_answer` or Timer B / F.
    Calling,
    /// Answered provisionally: waits for its final answer (Timer C / F).
    Proceeding,
    /// Answered finally.
    Done,
    /// Given up on (no answer in time, or Timer C): late answers are still handled.
    Abandoned,
}

#[derive(Debug)]
struct Attempt {
    addr: SocketAddr,
    sent: Bytes,
    phase: Phase,
    started: Nanos,
    retransmit_at: Option<Nanos>,
    interval: Nanos,
    /// Timer C (INVITE) or F (others) once provisional.
    proceeding_until: Nanos,
    /// Reached over UDP: its messages are retransmitted.
    datagram: bool,
    cancel_sent: bool,
    /// fulcrum's CANCEL of this attempt, retransmitted over UDP by Timer E (it is a
    /// non-INVITE client transaction of its own, RFC 3261 §9.1, §17.1.2.2) until it is
    /// answered, the attempt answers finally, or Timer F.
    cancel: Option<Retransmit>,
}

/// A message being retransmitted: its bytes, when next, the interval, when to give up.
#[derive(Debug)]
struct Retransmit {
    bytes: Bytes,
    at: Nanos,
    interval: Nanos,
    until: Nanos,
}

/// Timer G: a non-2xx final to an INVITE sent again to a UDP client until its ACK.
#[derive(Debug, Clone, Copy)]
struct TimerG {
    at: Nanos,
    interval: Nanos,
    /// Timer H.
    until: Nanos,
}

/// One request outside a dialog held until its final answer.
#[derive(Debug)]
pub struct Transaction {
    invite: bool,
    /// The client is reached over UDP: fulcrum retransmits a non-2xx final to its INVITE.
    client_datagram: bool,
    codes: Codes,
    /// Silence (not even a 100) this long moves the request on; `None`: only Timer B / F.
    no_answer: Option<Nanos>,
    tries: u8,
    attempts: Vec<Attempt>,
    /// The best failover answer so far (§16.7 step 6).
    best: Option<(u16, Bytes)>,
    /// The 100 (Trying) fulcrum sent, sent again until a final answer.
    trying: Option<Bytes>,
    /// The final answer the client was given: its code, and its bytes once known (a relayed
    /// one arrives through [`Transaction::relayed`]).
    final_code: Option<u16>,
    final_bytes: Option<Bytes>,
    timer_g: Option<TimerG>,
    canceled: bool,
    /// Once final: when the entry may go (retransmissions and the ACK absorbed until then).
    linger_until: Option<Nanos>,
}

impl Transaction {
    /// A transaction for a request forwarded as attempt 0 (`first`), from a client reached
    /// over UDP when `client_datagram`. An INVITE is answered 100 (Trying) at once.
    pub fn start(
        now: Nanos,
        invite: bool,
        client_datagram: bool,
        params: &Failover,
        first: Hop,
        hops: &dyn Hops,
        out: &mut Vec<TxAction>,
    ) -> Transaction {
        let nanos = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let no_answer = if invite {
            Some(nanos(params.no_answer))
        } else {
            params.no_answer_non_invite.map(nanos)
        };
        let mut tx = Transaction {
            invite,
            client_datagram,
            codes: Codes::of(&params.codes),
            no_answer,
            tries: params.tries.max(1),
            attempts: Vec::new(),
            best: None,
            trying: None,
            final_code: None,
            final_bytes: None,
            timer_g: None,
            canceled: false,
            linger_until: None,
        };
        if invite && let Some(trying) = hops.reply(100) {
            tx.trying = Some(trying.clone());
            out.push(TxAction::ToClient(trying));
        }
        tx.push_attempt(now, first);
        tx
    }

    fn push_attempt(&mut self, now: Nanos, hop: Hop) {
        self.attempts.push(Attempt {
            addr: hop.addr,
            sent: hop.sent,
            phase: Phase::Calling,
            started: now,
            retransmit_at: hop.datagram.then(|| now.saturating_add(T1)),
            interval: T1,
            proceeding_until: Nanos::MAX,
            datagram: hop.datagram,
            cancel_sent: false,
            cancel: None,
        });
    }

    /// Whether the transaction is over (its entry may be removed).
    pub fn is_finished(&self, now: Nanos) -> bool {
        self.linger_until.is_some_and(|t| now >= t)
    }

    /// Whether a final answer went to the client.
    pub fn is_answered(&self) -> bool {
        self.final_code.is_some()
    }

    /// The code of the final answer the client was given.
    pub fn final_code(&self) -> Option<u16> {
        self.final_code
    }

    /// The final answer the client was given, as it left (once known).
    pub fn final_answer(&self) -> Option<&Bytes> {
        self.final_bytes.as_ref()
    }

    /// Whether a client's ACK that names this transaction ends here: the ACK of a non-2xx
    /// final (RFC 3261 §17.2.1). The ACK of a 2xx is a request of its own that goes on to
    /// the service end to end (§13.2.2.4), whatever branch it carries; before any final an
    /// ACK is meaningless and absorbed.
    pub fn absorbs_ack(&self) -> bool {
        self.final_code.is_none_or(|c| c >= 300)
    }

    /// The address of the attempt in progress.
    pub fn current_addr(&self) -> Option<SocketAddr> {
        self.attempts.last().map(|a| a.addr)
    }

    /// How many attempts were made.
    pub fn attempts(&self) -> usize {
        self.attempts.len()
    }

    /// The bytes this transaction keeps (each attempt's copy and CANCEL, the answers it may
    /// send again, its own size): what it costs the table's byte budget.
    pub fn weight(&self) -> usize {
        let len = |b: &Option<Bytes>| b.as_ref().map_or(0, Bytes::len);
        let attempts: usize = self
            .attempts
            .iter()
            .map(|a| a.sent.len() + a.cancel.as_ref().map_or(0, |c| c.bytes.len()))
            .sum();
        attempts
            + self.best.as_ref().map_or(0, |(_, b)| b.len())
            + len(&self.trying)
            + len(&self.final_bytes)
            + std::mem::size_of::<Transaction>()
            + self.attempts.capacity() * std::mem::size_of::<Attempt>()
    }

    /// The final answer relayed to the client ([`TxAction::Relay`]) as it left, to send it
    /// again if the client retransmits its request (and on Timer G). Only the first final
    /// counts: a late 2xx relayed after it is the service's to retransmit.
    pub fn relayed(&mut self, bytes: Bytes) {
        if self.final_code.is_some() && self.final_bytes.is_none() {
            self.final_bytes = Some(bytes);
        }
    }

    /// The next time [`Event::Timer`] is due.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        let mut t = self.linger_until;
        let mut take = |x: Nanos| t = Some(t.map_or(x, |y: Nanos| y.min(x)));
        if let Some(g) = &self.timer_g {
            take(g.at);
        }
        let answered = self.final_code.is_some();
        for (i, a) in self.attempts.iter().enumerate() {
            let current = i + 1 == self.attempts.len();
            if let Some(c) = &a.cancel {
                take(c.at);
            }
            match a.phase {
                Phase::Calling => {
                    if let Some(r) = a.retransmit_at {
                        take(r);
                    }
                    if current && !answered {
                        take(self.calling_until(a));
                    }
                }
                Phase::Proceeding => {
                    if let Some(r) = a.retransmit_at {
                        take(r);
                    }
                    if current && !answered {
                        take(a.proceeding_until);
                    }
                }
                _ => {}
            }
        }
        t
    }

    /// When an attempt that has heard nothing is given up: `no_answer`, else Timer B / F.
    fn calling_until(&self, a: &Attempt) -> Nanos {
        let timeout = self.no_answer.unwrap_or(TIMER_64T1).min(TIMER_64T1);
        a.started.saturating_add(timeout)
    }

    /// Handle `event` at `now`; what to do is appended to `out`.
    pub fn handle(
        &mut self,
        now: Nanos,
        event: Event<'_>,
        hops: &dyn Hops,
        out: &mut Vec<TxAction>,
    ) {
        match event {
            Event::Retransmission => self.retransmission(out),
            Event::Ack => {
                if self.final_code.is_some_and(|c| c >= 300) {
                    // §17.2.1: Confirmed; Timer I absorbs the ACK's own retransmissions.
                    self.timer_g = None;
                    let i = now.saturating_add(T4);
                    self.linger_until = Some(self.linger_until.map_or(i, |l| l.min(i)));
                }
            }
            Event::Cancel => self.cancel(now, hops, out),
            Event::CancelAnswered { attempt } => {
                if let Some(a) = self.attempts.get_mut(usize::from(attempt)) {
                    a.cancel = None;
                }
            }
            Event::Response {
                attempt,
                code,
                retry_after_s,
                bytes,
            } => self.response(
                now,
                usize::from(attempt),
                code,
                retry_after_s,
                bytes,
                hops,
                out,
            ),
            Event::Timer => self.timer(now, hops, out),
            Event::Unsent { attempt } => self.unsent(now, usize::from(attempt), hops, out),
        }
    }

    fn unsent(&mut self, now: Nanos, i: usize, hops: &dyn Hops, out: &mut Vec<TxAction>) {
        let current = i + 1 == self.attempts.len();
        let Some(a) = self.attempts.get_mut(i) else {
            return;
        };
        if !current || self.final_code.is_some() || a.phase != Phase::Calling {
            return;
        }
        // Not charged here: the link that could not take it records its own failure (a
        // refused connect is `refused`, not a timeout of the service).
        a.phase = Phase::Abandoned;
        a.retransmit_at = None;
        self.next(now, hops, out);
    }

    /// §17.2.1, §17.2.2: the final the client was given, sent again; before it, the 100; an
    /// INVITE answered 2xx absorbs it (RFC 6026 §7.1).
    fn retransmission(&self, out: &mut Vec<TxAction>) {
        let again = match self.final_code {
            Some(c) if self.invite && (200..300).contains(&c) => None,
            Some(_) => self.final_bytes.as_ref(),
            None => self.trying.as_ref(),
        };
        if let Some(b) = again {
            out.push(TxAction::Resend(b.clone()));
        }
    }

    fn cancel(&mut self, now: Nanos, hops: &dyn Hops, out: &mut Vec<TxAction>) {
        if !self.invite || self.final_code.is_some() || self.canceled {
            return;
        }
        self.canceled = true;
        let Some(a) = self.attempts.last_mut() else {
            return;
        };
        match a.phase {
            // §9.1: a CANCEL only once the attempt answered provisionally; until then the
            // attempt is left to answer (or not) and the cancel is sent when it does.
            Phase::Proceeding => send_cancel(now, a, hops, out),
            Phase::Calling => {}
            Phase::Done | Phase::Abandoned => self.answer(now, 487, hops, out),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn response(
        &mut self,
        now: Nanos,
        i: usize,
        code: u16,
        retry_after_s: Option<u32>,
        bytes: &[u8],
        hops: &dyn Hops,
        out: &mut Vec<TxAction>,
    ) {
        let current = i + 1 == self.attempts.len();
        let answered = self.final_code.is_some();
        let canceled = self.canceled;
        let invite = self.invite;
        let Some(a) = self.attempts.get_mut(i) else {
            return;
        };
        if code < 200 {
            if a.phase == Phase::Calling {
                a.phase = Phase::Proceeding;
                if invite {
                    // §17.1.1.2: Timer A stops in Proceeding; Timer E goes on at T2.
                    a.retransmit_at = None;
                    a.proceeding_until = now.saturating_add(TIMER_C);
                } else {
                    a.interval = T2;
                    // Timer F runs from the send (§17.1.2.2).
                    a.proceeding_until = a.started.saturating_add(TIMER_64T1);
                }
                out.push(TxAction::Answered { addr: a.addr });
            } else if a.phase == Phase::Proceeding && invite && code > 100 {
                // §16.7 step 2: every 101-199 restarts Timer C.
                a.proceeding_until = now.saturating_add(TIMER_C);
            }
            let live = current && !answered;
            if invite && (!live || canceled) && a.phase != Phase::Done {
                // An abandoned attempt, a cancelled one, or one left pending by the final
                // answer of another: it must stop ringing.
                send_cancel(now, a, hops, out);
            } else if invite && live && code > 100 {
                // §16.7 step 5: provisional answers go upstream (100 is hop by hop).
                out.push(TxAction::Relay);
            }
            return;
        }
        let was = a.phase;
        a.phase = Phase::Done;
        a.retransmit_at = None;
        // A final answer: the CANCEL took effect or came too late; either way it is over.
        a.cancel = None;
        if code >= 300
            && invite
            && let Some(ack) = hops.hop(&a.sent, b"ACK", Some(bytes))
        {
            out.push(TxAction::ToMember(a.addr, ack));
        }
        let addr = a.addr;
        if (200..300).contains(&code) {
            // A 2xx goes to the client whenever it comes (§16.7 step 5, late ones too).
            out.push(TxAction::Answered { addr });
            if !answered {
                out.push(TxAction::Won { addr });
            }
            out.push(TxAction::Relay);
            if !answered {
                self.finish(now, code);
                self.cancel_pending(now, hops, out);
            }
            return;
        }
        if was == Phase::Done || answered {
            // A retransmitted final, or a final after the client's: absorbed.
            return;
        }
        if code >= 600 {
            // §16.7 steps 5-6: a 6xx ends the search wherever it comes from, and the
            // attempts still pending are cancelled.
            out.push(TxAction::Answered { addr });
            out.push(TxAction::Relay);
            self.finish(now, code);
            self.cancel_pending(now, hops, out);
            return;
        }
        if !current {
            // The answer of an attempt given up on: absorbed.
            return;
        }
        if !self.codes.contains(code) {
            out.push(TxAction::Answered { addr });
            out.push(TxAction::Relay);
            self.finish(now, code);
            return;
        }
        out.push(TxAction::Failed {
            addr,
            code: Some(code),
            retry_after_s,
        });
        if self.best.as_ref().is_none_or(|(c, _)| better(code, *c)) {
            self.best = Some((code, Bytes::copy_from_slice(bytes)));
        }
        self.next(now, hops, out);
    }

    /// CANCEL every attempt still ringing (those that have not rung yet are cancelled when
    /// they do: their provisional answer then finds the transaction answered).
    fn cancel_pending(&mut self, now: Nanos, hops: &dyn Hops, out: &mut Vec<TxAction>) {
        if !self.invite {
            return;
        }
        for a in &mut self.attempts {
            if a.phase == Phase::Proceeding {
                a.phase = Phase::Abandoned;
                send_cancel(now, a, hops, out);
            }
        }
    }

    fn timer(&mut self, now: Nanos, hops: &dyn Hops, out: &mut Vec<TxAction>) {
        if self.is_finished(now) {
            return;
        }
        if let Some(g) = self.timer_g.as_mut().filter(|g| now >= g.at) {
            if now >= g.until {
                // Timer H: the client never acknowledged; nothing more is owed.
                self.timer_g = None;
            } else {
                if let Some(b) = &self.final_bytes {
                    out.push(TxAction::Resend(b.clone()));
                }
                g.interval = g.interval.saturating_mul(2).min(T2);
                g.at = g.at.max(now).saturating_add(g.interval);
            }
        }
        let invite = self.invite;
        for a in &mut self.attempts {
            let retransmits =
                a.phase == Phase::Calling || (a.phase == Phase::Proceeding && !invite);
            if let Some(r) = a.retransmit_at.filter(|&r| now >= r && retransmits) {
                out.push(TxAction::ToMember(a.addr, a.sent.clone()));
                // Timer A doubles without bound (Timer B ends it); Timer E stops at T2, and
                // is T2 in Proceeding.
                a.interval = if invite {
                    a.interval.saturating_mul(2)
                } else if a.phase == Phase::Proceeding {
                    T2
                } else {
                    a.interval.saturating_mul(2).min(T2)
                };
                a.retransmit_at = Some(r.max(now).saturating_add(a.interval));
            }
            if let Some(c) = a.cancel.as_mut().filter(|c| now >= c.at) {
                if now >= c.until {
                    a.cancel = None;
                } else {
                    out.push(TxAction::ToMember(a.addr, c.bytes.clone()));
                    c.interval = c.interval.saturating_mul(2).min(T2);
                    c.at = c.at.max(now).saturating_add(c.interval);
                }
            }
        }
        if self.final_code.is_some() {
            return;
        }
        let canceled = self.canceled;
        let Some(i) = self.attempts.len().checked_sub(1) else {
            return;
        };
        let calling_until = self.calling_until(&self.attempts[i]);
        let a = &mut self.attempts[i];
        match a.phase {
            Phase::Calling if now >= calling_until => {
                abandon_unanswered(a, out);
                if !canceled && !invite && now >= a.started.saturating_add(TIMER_64T1) {
                    // Timer F: the client's own Timer F has ended its side too.
                    self.give_up(now, hops, out);
                } else {
                    self.next(now, hops, out);
                }
            }
            Phase::Proceeding if now >= a.proceeding_until => {
                a.phase = Phase::Abandoned;
                a.retransmit_at = None;
                if invite {
                    send_cancel(now, a, hops, out);
                }
                self.give_up(now, hops, out);
            }
            _ => {}
        }
    }

    /// The next attempt, or the best answer when the tries ran out or no member is left.
    fn next(&mut self, now: Nanos, hops: &dyn Hops, out: &mut Vec<TxAction>) {
        if self.canceled {
            // §16.10: a CANCELed request ends 487, whatever the attempt said.
            self.answer(now, 487, hops, out);
            return;
        }
        if self.attempts.len() < usize::from(self.tries) {
            let tried: Vec<SocketAddr> = self.attempts.iter().map(|a| a.addr).collect();
            let attempt = u8::try_from(self.attempts.len()).unwrap_or(u8::MAX);
            if let Some(hop) = hops.forward(attempt, &tried) {
                out.push(TxAction::ToMember(hop.addr, hop.sent.clone()));
                self.push_attempt(now, hop);
                return;
            }
        }
        self.give_up(now, hops, out);
    }

    /// No attempt left: the best answer (§16.7 step 6), else 408 to an INVITE and silence to
    /// any other request (RFC 4320 §4.2).
    fn give_up(&mut self, now: Nanos, hops: &dyn Hops, out: &mut Vec<TxAction>) {
        match self.best.take() {
            // §16.7 step 6: a 503 upstream would say fulcrum itself is overloaded.
            Some((503, _)) => self.answer(now, 500, hops, out),
            Some((code, bytes)) => match hops.relay(&bytes) {
                Some(b) => {
                    out.push(TxAction::ToClient(b.clone()));
                    self.finish(now, code);
                    self.final_bytes = Some(b);
                }
                None => self.answer(now, 500, hops, out),
            },
            None if self.invite => self.answer(now, 408, hops, out),
            None => self.finish(now, 408),
        }
    }

    /// Answer the client with fulcrum's own final `code`.
    fn answer(&mut self, now: Nanos, code: u16, hops: &dyn Hops, out: &mut Vec<TxAction>) {
        self.finish(now, code);
        if let Some(b) = hops.reply(code) {
            self.final_bytes = Some(b.clone());
            out.push(TxAction::ToClient(b));
        }
    }

    /// The client has its final answer `code` (or, for a non-INVITE given up on, none).
    fn finish(&mut self, now: Nanos, code: u16) {
        self.final_code = Some(code);
        self.linger_until = Some(now.saturating_add(TIMER_64T1));
        if self.invite && code >= 300 && self.client_datagram {
            self.timer_g = Some(TimerG {
                at: now.saturating_add(T1),
                interval: T1,
                until: now.saturating_add(TIMER_64T1),
            });
        }
    }
}

/// Give up on attempt `a`, which never answered (`no_answer`, Timer B / F, or no link took
/// it): it stops retransmitting and its service is charged a failure without a code. Its
/// late answers are still handled.
fn abandon_unanswered(a: &mut Attempt, out: &mut Vec<TxAction>) {
    a.phase = Phase::Abandoned;
    a.retransmit_at = None;
    out.push(TxAction::Failed {
        addr: a.addr,
        code: None,
        retry_after_s: None,
    });
}

fn send_cancel(now: Nanos, a: &mut Attempt, hops: &dyn Hops, out: &mut Vec<TxAction>) {
    if a.cancel_sent {
        return;
    }
    if let Some(c) = hops.hop(&a.sent, b"CANCEL", None) {
        a.cancel_sent = true;
        if a.datagram {
            a.cancel = Some(Retransmit {
                bytes: c.clone(),
                at: now.saturating_add(T1),
                interval: T1,
                until: now.saturating_add(TIMER_64T1),
            });
        }
        out.push(TxAction::ToMember(a.addr, c));
    }
}

/// The failover codes as a set of final answers (300..=699), copied into each transaction
/// without an allocation.
#[derive(Debug, Clone, Copy)]
struct Codes([u64; 7]);

impl Codes {
    fn of(codes: &[u16]) -> Codes {
        let mut set = Codes([0; 7]);
        for &c in codes {
            if let Some(bit) = c.checked_sub(300).filter(|&b| b < 400) {
                set.0[usize::from(bit / 64)] |= 1 << (bit % 64);
            }
        }
        set
    }

    fn contains(&self, code: u16) -> bool {
        code.checked_sub(300)
            .filter(|&b| b < 400)
            .is_some_and(|b| self.0[usize::from(b / 64)] & (1 << (b % 64)) != 0)
    }
}

/// Whether final answer `a` is a better one to give the client than `b` (§16.7 step 6: the
/// lowest class; within 5xx, anything before a 503).
fn better(a: u16, b: u16) -> bool {
    match (a / 100).cmp(&(b / 100)) {
        std::cmp::Ordering::Less => true,
        std::cmp::Ordering::Greater => false,
        std::cmp::Ordering::Equal => b == 503 && a != 503,
    }
}

#[cfg(test)]
mod tests;
