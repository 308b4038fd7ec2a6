//! PURE: failover of a request outside a dialog. fulcrum holds such a request statefully
//! until its final answer (RFC 3261 §16, §17), one [`Transaction`] per client transaction,
//! fed events and `now` and returning actions and its next deadline, in the manner of
//! `core::link`: the shell sends what it is told and wakes the machine at
//! [`Transaction::poll_timeout`].
//!
//! - An INVITE is answered 100 (Trying) at once (§16.2); the client's retransmissions are
//!   absorbed (the 100, or the final answer, is sent again).
//! - Each attempt is its own client transaction toward its service (its own branch,
//!   §16.6 step 8), retransmitted by Timer A (INVITE) or E (others), §17.1, when its member
//!   is reached over UDP (across the transports bridge one request may try both kinds).
//! - A final answer in the failover codes, or no answer at all (not even 100) within
//!   `no_answer`, sends the request to the next-ranked usable service, up to `tries`
//!   services; the client never sees a failed attempt's answer. After a provisional answer
//!   only Timer C (§16.8) ends an INVITE attempt, Timer F a non-INVITE one.
//! - fulcrum ACKs every non-2xx final answer of its own attempts (§17.1.1.3) and absorbs the
//!   client's ACK of the final it was given; a CANCEL goes to the attempt in progress (once it
//!   has answered provisionally, §9.1), and to an abandoned attempt that answers
//!   provisionally later; over UDP that CANCEL is retransmitted by Timer E until its answer
//!   or the attempt's final one. A 2xx is relayed whenever it comes, late ones too (§16.7
//!   step 5).
//! - When the tries run out the client gets the best answer (§16.7 step 6): the last failover
//!   answer, a 503 turned into 500 (a 503 would tell the client that fulcrum is overloaded);
//!   408 when no service answered at all.

use crate::stats::Nanos;
use bytes::Bytes;
use std::net::SocketAddr;

const MS: Nanos = 1_000_000;
/// RFC 3261 §17.1.1.1: the round-trip estimate, first retransmission interval.
pub const T1: Nanos = 500 * MS;
/// RFC 3261 §17.1.2.2: the longest interval between non-INVITE retransmissions.
pub const T2: Nanos = 4_000 * MS;
/// Timers B and F (64·T1): how long an attempt that answered provisionally but never finally
/// is waited for (non-INVITE), and how long a finished transaction lingers to absorb the
/// client's retransmissions and ACK (Timers H, J).
pub const TIMER_64T1: Nanos = 64 * T1;
/// Timer C (§16.8): an INVITE attempt that answered provisionally is cancelled after it.
pub const TIMER_C: Nanos = 180_000 * MS;

pub use crate::config::Failover;

/// An attempt the core forwarded: to which member, the bytes sent, and how they travel.
#[derive(Debug, Clone)]
pub struct Hop {
    pub member: usize,
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
    /// The client acknowledged the non-2xx final answer it was given.
    Ack,
    /// A deadline ([`Transaction::poll_timeout`]) may have passed.
    Timer,
}

/// What the shell does for a transaction, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxAction {
    /// Send fulcrum's own bytes to the client (an answer it made, or one sent again).
    ToClient(Bytes),
    /// Relay the response being handled to the client, as the stateless proxy does.
    Relay,
    /// Relay a response that arrived earlier (the best answer, once the tries ran out).
    RelayStored(Bytes),
    /// Send bytes to a service: an attempt, its retransmission, an ACK or a CANCEL.
    ToMember(SocketAddr, Bytes),
    /// A service failed this request (failover code `code`, or no answer when `None`): for
    /// passive health.
    Failed {
        member: usize,
        code: Option<u16>,
        retry_after_s: Option<u32>,
    },
    /// A service answered this request: for passive health.
    Answered { member: usize },
    /// The first 2xx the client gets comes from `member`: the dialog is its.
    Won { member: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Sent, nothing heard: retransmitted, abandoned at `no_answer`.
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
    member: usize,
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

/// A CANCEL being retransmitted: its bytes, when next, the interval, when to give up.
#[derive(Debug)]
struct Retransmit {
    bytes: Bytes,
    at: Nanos,
    interval: Nanos,
    until: Nanos,
}

/// One request outside a dialog held until its final answer.
#[derive(Debug)]
pub struct Transaction {
    invite: bool,
    codes: Codes,
    no_answer: Nanos,
    tries: u8,
    attempts: Vec<Attempt>,
    /// The best failover answer so far (§16.7 step 6).
    best: Option<(u16, Bytes)>,
    /// What the client was last sent by fulcrum itself (the 100, a final it built or relayed).
    last_to_client: Option<Bytes>,
    final_sent: bool,
    canceled: bool,
    /// Once final: when the entry may go (retransmissions and the ACK absorbed until then).
    linger_until: Option<Nanos>,
}

impl Transaction {
    /// A transaction for a request forwarded as attempt 0 (`first`). An INVITE is answered
    /// 100 (Trying) at once.
    pub fn start(
        now: Nanos,
        invite: bool,
        params: &Failover,
        first: Hop,
        hops: &dyn Hops,
        out: &mut Vec<TxAction>,
    ) -> Transaction {
        let mut tx = Transaction {
            invite,
            codes: Codes::of(&params.codes),
            no_answer: u64::try_from(params.no_answer.as_nanos()).unwrap_or(u64::MAX),
            tries: params.tries.max(1),
            attempts: Vec::new(),
            best: None,
            last_to_client: None,
            final_sent: false,
            canceled: false,
            linger_until: None,
        };
        if invite && let Some(trying) = hops.reply(100) {
            tx.last_to_client = Some(trying.clone());
            out.push(TxAction::ToClient(trying));
        }
        tx.push_attempt(now, first);
        tx
    }

    fn push_attempt(&mut self, now: Nanos, hop: Hop) {
        self.attempts.push(Attempt {
            member: hop.member,
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
        self.final_sent
    }

    /// The member of the attempt in progress.
    pub fn current_member(&self) -> Option<usize> {
        self.attempts.last().map(|a| a.member)
    }

    /// How many attempts were made.
    pub fn attempts(&self) -> usize {
        self.attempts.len()
    }

    /// Remember the final answer relayed to the client, to send it again if the client
    /// retransmits its request.
    pub fn relayed(&mut self, bytes: Bytes) {
        self.last_to_client = Some(bytes);
    }

    /// The next time [`Event::Timer`] is due.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        let mut t = self.linger_until;
        let mut take = |x: Nanos| t = Some(t.map_or(x, |y: Nanos| y.min(x)));
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
                    if current && !self.final_sent {
                        take(a.started.saturating_add(self.no_answer));
                    }
                }
                Phase::Proceeding if current && !self.final_sent => take(a.proceeding_until),
                _ => {}
            }
        }
        t
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
            Event::Retransmission => {
                if let Some(b) = &self.last_to_client {
                    out.push(TxAction::ToClient(b.clone()));
                }
            }
            Event::Ack => {}
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
        }
    }

    fn cancel(&mut self, now: Nanos, hops: &dyn Hops, out: &mut Vec<TxAction>) {
        if !self.invite || self.final_sent || self.canceled {
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
        let final_sent = self.final_sent;
        let canceled = self.canceled;
        let invite = self.invite;
        let Some(a) = self.attempts.get_mut(i) else {
            return;
        };
        if code < 200 {
            if a.phase == Phase::Calling {
                a.phase = Phase::Proceeding;
                a.retransmit_at = None;
                a.proceeding_until = now.saturating_add(if invite { TIMER_C } else { TIMER_64T1 });
                out.push(TxAction::Answered { member: a.member });
            }
            let live = current && !final_sent;
            if invite && (!live || canceled) && a.phase != Phase::Done {
                // An abandoned attempt, or a cancelled one: it must stop ringing.
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
        let member = a.member;
        if (200..300).contains(&code) {
            // A 2xx goes to the client whenever it comes (§16.7 step 5, late ones too).
            out.push(TxAction::Answered { member });
            if !final_sent {
                out.push(TxAction::Won { member });
            }
            out.push(TxAction::Relay);
            self.finish(now);
            return;
        }
        if was == Phase::Done || final_sent || !current {
            // A retransmitted final, or the answer of an attempt given up on: absorbed.
            return;
        }
        if !self.codes.contains(code) {
            out.push(TxAction::Answered { member });
            out.push(TxAction::Relay);
            self.finish(now);
            return;
        }
        out.push(TxAction::Failed {
            member,
            code: Some(code),
            retry_after_s,
        });
        if self.best.as_ref().is_none_or(|(c, _)| better(code, *c)) {
            self.best = Some((code, Bytes::copy_from_slice(bytes)));
        }
        self.next(now, hops, out);
    }

    fn timer(&mut self, now: Nanos, hops: &dyn Hops, out: &mut Vec<TxAction>) {
        if self.is_finished(now) {
            return;
        }
        let n = self.attempts.len();
        for a in &mut self.attempts {
            if let Some(r) = a
                .retransmit_at
                .filter(|&r| now >= r && a.phase == Phase::Calling)
            {
                out.push(TxAction::ToMember(a.addr, a.sent.clone()));
                // Timer A doubles without bound (Timer B ends it); Timer E stops at T2.
                a.interval = if self.invite {
                    a.interval.saturating_mul(2)
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
        if self.final_sent {
            return;
        }
        let no_answer = self.no_answer;
        let canceled = self.canceled;
        let Some(a) = self.attempts.last_mut() else {
            return;
        };
        match a.phase {
            Phase::Calling if now >= a.started.saturating_add(no_answer) => {
                a.phase = Phase::Abandoned;
                a.retransmit_at = None;
                out.push(TxAction::Failed {
                    member: a.member,
                    code: None,
                    retry_after_s: None,
                });
                if canceled {
                    self.answer(now, 487, hops, out);
                } else {
                    self.next(now, hops, out);
                }
            }
            Phase::Proceeding if now >= a.proceeding_until => {
                a.phase = Phase::Abandoned;
                if self.invite {
                    send_cancel(now, a, hops, out);
                }
                self.answer(now, 408, hops, out);
            }
            _ => {}
        }
        debug_assert!(self.attempts.len() >= n);
    }

    /// The next attempt, or the best answer when the tries ran out or no member is left.
    fn next(&mut self, now: Nanos, hops: &dyn Hops, out: &mut Vec<TxAction>) {
        if self.attempts.len() < usize::from(self.tries) && !self.canceled {
            let tried: Vec<SocketAddr> = self.attempts.iter().map(|a| a.addr).collect();
            let attempt = u8::try_from(self.attempts.len()).unwrap_or(u8::MAX);
            if let Some(hop) = hops.forward(attempt, &tried) {
                out.push(TxAction::ToMember(hop.addr, hop.sent.clone()));
                self.push_attempt(now, hop);
                return;
            }
        }
        match self.best.take() {
            // §16.7 step 6: a 503 upstream would say fulcrum itself is overloaded.
            Some((503, _)) => self.answer(now, 500, hops, out),
            Some((_, bytes)) => {
                out.push(TxAction::RelayStored(bytes));
                self.finish(now);
            }
            None => self.answer(now, 408, hops, out),
        }
    }

    /// Answer the client with fulcrum's own final `code`.
    fn answer(&mut self, now: Nanos, code: u16, hops: &dyn Hops, out: &mut Vec<TxAction>) {
        if let Some(b) = hops.reply(code) {
            self.last_to_client = Some(b.clone());
            out.push(TxAction::ToClient(b));
        }
        self.finish(now);
    }

    fn finish(&mut self, now: Nanos) {
        self.final_sent = true;
        self.linger_until = Some(now.saturating_add(TIMER_64T1));
    }
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
