//! PURE: the decisions of one sip-tcp service link (the connection fulcrum keeps to one
//! member), as a state machine fed events and `now` and returning actions and its next
//! deadline, in the manner of quinn-proto's `Connection` (`handle_event` / `poll_timeout`).
//! No socket, task, clock or queue here: the IO shell (`proxy::sip_stream`'s `service_loop`) waits for
//! what [`Link::phase`] says it may, turns what happened into a [`LinkEvent`], and carries
//! out the [`LinkAction`]s in order. The stream under it is the shell's business (TCP today,
//! TLS on the same machine later).
//!
//! What the link does:
//! - Connects only when a request is queued, or, once a failure marked the service DOWN, to
//!   probe it: each failure waits a backoff from [`BACKOFF_MIN`] doubled up to
//!   [`BACKOFF_MAX`], and a connection that lives [`SHORT_LIVED`] marks it UP again.
//! - A connection that ends within [`SHORT_LIVED`] without the service having sent anything
//!   counts as a refused connect (a service that accepts and closes must not swallow
//!   requests while staying UP): the backoff it would have had is kept, and the requests
//!   written on it (up to [`UNANSWERED_KEPT`]) are chosen again. A service that answered,
//!   then closed, is only reconnected.
//! - A write that makes no progress for the service's `write_timeout` (a service that stopped
//!   reading) ends the connection as a refused connect does: the service is marked DOWN and
//!   counted as failed, the request cut short and the requests it was given unanswered are
//!   chosen again, and the link backs off.
//! - Retired (a reload removed its member) between two writes, the connection drains for
//!   [`RETIRED_DRAIN`]: what the service still sends is relayed and replies are written to
//!   it, but no new request; retired in the middle of a write, it closes at once (the
//!   service holds part of a message and has stopped reading).
//!
//! The messages it holds are opaque to it (`M`: bytes, or bytes with what the shell keeps
//! beside them, such as their Call-ID for the capture of their write).

use bytes::Bytes;
use std::time::{Duration, Instant};

pub(crate) use super::CONNECT_TIMEOUT;
/// First and last reconnect delay toward a service.
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(100);
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How long the connection of a member removed by a reload stays open for what the service
/// still sends: 64·T1, the non-INVITE transaction timeout (RFC 3261 §17.1.2.2, Timer F).
pub(crate) const RETIRED_DRAIN: Duration = Duration::from_secs(32);
/// A service connection that ends this soon after it was made counts as a failed connect
/// (a service that accepts and closes must not swallow requests while staying UP).
pub(crate) const SHORT_LIVED: Duration = Duration::from_secs(1);
/// How long a write toward a service may make no progress unless the service says otherwise
/// (its `write_timeout`).
pub(crate) const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Requests written on a service connection that has not answered yet, kept to be chosen
/// again should it close first.
pub(crate) const UNANSWERED_KEPT: usize = 256;

/// What happened to the link, as the shell saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LinkEvent<M = Bytes> {
    /// A request taken from the link's queue (in the phases [`Phase::Idle`] and
    /// [`Phase::Connected`]).
    Queued(M),
    /// The queue has no sender left.
    QueueClosed,
    /// Something fulcrum writes on the connection for the service itself: a pong, a reply to
    /// the service's request, a client's response to it while draining.
    Reply(M),
    ConnectOk,
    ConnectFailed,
    /// The service sent its first message on this connection.
    MessageRead,
    WriteDone,
    WriteFailed,
    /// The connection's reader ended (the service closed it, reset it, or sent what does
    /// not frame).
    ReaderClosed,
    /// A reload removed the link's member.
    Retired,
    /// [`Link::poll_timeout`] has passed.
    TimerFired,
}

impl<M> LinkEvent<M> {
    /// The event's name, for [`LinkAction::Unexpected`].
    pub(crate) fn name(&self) -> &'static str {
        match self {
            LinkEvent::Queued(_) => "queued",
            LinkEvent::QueueClosed => "queue_closed",
            LinkEvent::Reply(_) => "reply",
            LinkEvent::ConnectOk => "connect_ok",
            LinkEvent::ConnectFailed => "connect_failed",
            LinkEvent::MessageRead => "message_read",
            LinkEvent::WriteDone => "write_done",
            LinkEvent::WriteFailed => "write_failed",
            LinkEvent::ReaderClosed => "reader_closed",
            LinkEvent::Retired => "retired",
            LinkEvent::TimerFired => "timer_fired",
        }
    }
}

/// What the shell must do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LinkAction<M = Bytes> {
    /// Open a connection to the service (within the deadline [`Link::poll_timeout`] gives).
    Connect,
    /// Write these bytes whole on the connection, then report `WriteDone` or `WriteFailed`.
    Write(M),
    /// Choose a member again for this request (or, for a response, the service's
    /// draining connection).
    Redispatch(M),
    /// Choose a member again for everything still in the link's queue.
    RedispatchQueue,
    /// Refuse further senders on the link's queue (before it is handed back).
    CloseQueue,
    /// Count a failed connect, report it to the member's monitor and mark the service DOWN.
    MarkDown,
    /// The service a failure marked DOWN has kept a connection: mark it UP again.
    MarkUp,
    /// Count a connection the service ended.
    CountLost,
    /// Count a write the service stopped taking (its `write_timeout` passed).
    CountStalled,
    /// The shell sent an event the phase does not wait for (a bug in the shell): nothing
    /// changed; count it and say which.
    Unexpected(&'static str),
    /// Count the link's retirement.
    CountRetired,
    /// Drop the connection (its reader and writer).
    Disconnect,
    /// Register the connection as the service's draining one (clients' responses to its
    /// in-dialog requests reach it).
    StartDrain,
    /// Unregister the draining connection and shut its write side down.
    EndDrain,
    /// The link's work is over: end its task.
    Close,
}

/// What the shell waits for; each phase names the events it may deliver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Nothing to send: `Queued` / `QueueClosed`, `Retired`.
    Idle,
    /// `ConnectOk` / `ConnectFailed`, `Retired`, `TimerFired` (the connect timeout).
    Connecting,
    /// `Retired`, `TimerFired`.
    Backoff,
    /// A write is under way: `WriteDone` / `WriteFailed`, `Retired`, `TimerFired` (the write
    /// timeout).
    Writing,
    /// Connected and between writes: `Queued` / `QueueClosed`, `Reply`, `ReaderClosed`,
    /// `Retired`, `TimerFired`.
    Connected,
    /// Retired and draining, between writes: `Reply`, `ReaderClosed`, `TimerFired`.
    Draining,
    /// Retired and draining, a write under way: `WriteDone` / `WriteFailed`, `TimerFired`.
    DrainWriting,
    /// Over.
    Closed,
}

/// The write under way on a live connection.
#[derive(Debug)]
enum Writing<M> {
    Request(M),
    Reply,
}

#[derive(Debug)]
struct Conn<M> {
    connected_at: Instant,
    /// The backoff the link had before this connection: kept until it proves itself.
    failed_backoff: Duration,
    /// The service has sent something on this connection.
    heard: bool,
    /// It has lived [`SHORT_LIVED`] (its proof timer fired).
    proven: bool,
    /// Requests written before the service said anything.
    unanswered: Vec<M>,
    writing: Option<Writing<M>>,
    /// When the write under way started.
    write_started: Instant,
}

#[derive(Debug)]
enum State<M> {
    Idle,
    Connecting {
        pending: Option<M>,
        deadline: Instant,
    },
    Backoff {
        until: Instant,
    },
    /// Boxed: the state moves on every event, and a connection's fields are most of it (a
    /// move of the whole would be a call to `memcpy` per event once the messages are larger
    /// than bytes alone).
    Connected(Box<Conn<M>>),
    Draining {
        until: Instant,
        writing: bool,
    },
    Closed,
}

/// One service link's state. See the module documentation.
#[derive(Debug)]
pub(crate) struct Link<M = Bytes> {
    state: State<M>,
    /// The wait after the next failure.
    backoff: Duration,
    /// A failure marked the service DOWN: keep probing until a connection proves itself.
    down: bool,
    retired: bool,
    /// How long a write may make no progress ([`Link::set_write_timeout`]).
    write_timeout: Duration,
}

impl<M: Clone> Default for Link<M> {
    fn default() -> Self {
        Link::new()
    }
}

impl<M: Clone> Link<M> {
    pub(crate) fn new() -> Link<M> {
        Link {
            state: State::Idle,
            backoff: BACKOFF_MIN,
            down: false,
            retired: false,
            write_timeout: WRITE_TIMEOUT,
        }
    }

    /// The service's `write_timeout` (a reload may change it; the write under way is measured
    /// against the current one).
    pub(crate) fn set_write_timeout(&mut self, d: Duration) {
        self.write_timeout = d;
    }

    pub(crate) fn phase(&self) -> Phase {
        match &self.state {
            State::Idle => Phase::Idle,
            State::Connecting { .. } => Phase::Connecting,
            State::Backoff { .. } => Phase::Backoff,
            State::Connected(c) if c.writing.is_some() => Phase::Writing,
            State::Connected(_) => Phase::Connected,
            State::Draining { writing: false, .. } => Phase::Draining,
            State::Draining { writing: true, .. } => Phase::DrainWriting,
            State::Closed => Phase::Closed,
        }
    }

    pub(crate) fn is_retired(&self) -> bool {
        self.retired
    }

    /// Whether the current connection has heard from the service (false with none).
    pub(crate) fn is_heard(&self) -> bool {
        matches!(&self.state, State::Connected(c) if c.heard)
    }

    /// The next instant at which the link wants `TimerFired`: the connect timeout, the end
    /// of the backoff, the write timeout during a write, else a new connection's proof, the
    /// end of a drain.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::Connecting { deadline, .. } => Some(*deadline),
            State::Backoff { until } | State::Draining { until, .. } => Some(*until),
            State::Connected(c) if c.writing.is_some() => {
                Some(c.write_started + self.write_timeout)
            }
            State::Connected(c) if !c.proven => Some(c.connected_at + SHORT_LIVED),
            _ => None,
        }
    }

    /// Take `event` in at `now`; what to do is appended to `out`, in order.
    pub(crate) fn handle(
        &mut self,
        now: Instant,
        event: LinkEvent<M>,
        out: &mut Vec<LinkAction<M>>,
    ) {
        use LinkEvent as E;
        let state = std::mem::replace(&mut self.state, State::Closed);
        self.state = match (state, event) {
            (State::Closed, _) => State::Closed,
            (state, E::Retired) => {
                self.retired = true;
                self.retire(now, state, out)
            }
            (State::Idle, E::Queued(b)) => self.connect(now, Some(b), out),
            (State::Idle | State::Connected(_), E::QueueClosed) => {
                out.push(LinkAction::Close);
                State::Closed
            }
            (State::Connecting { pending, deadline }, event) => {
                self.on_connecting(now, pending, deadline, event, out)
            }
            (State::Backoff { until }, E::TimerFired) => {
                if now >= until {
                    // After a failure the service is DOWN: probe it with or without a request.
                    self.connect(now, None, out)
                } else {
                    State::Backoff { until }
                }
            }
            (State::Connected(c), event) => self.on_connected(now, c, event, out),
            (State::Draining { until, writing }, event) => {
                self.on_draining(now, until, writing, event, out)
            }
            // A timer fired early (its deadline moved) or a message read with none to note:
            // nothing to do.
            (state, E::TimerFired | E::MessageRead) => state,
            // Anything else is not what the phase waits for: nothing changes, but the shell
            // hears of it.
            (state, event) => {
                out.push(LinkAction::Unexpected(event.name()));
                state
            }
        };
    }

    /// An event while connecting: the connection made, failed, or out of time.
    fn on_connecting(
        &mut self,
        now: Instant,
        pending: Option<M>,
        deadline: Instant,
        event: LinkEvent<M>,
        out: &mut Vec<LinkAction<M>>,
    ) -> State<M> {
        use LinkEvent as E;
        match event {
            E::ConnectOk => {
                let mut conn = Conn {
                    connected_at: now,
                    failed_backoff: self.backoff,
                    heard: false,
                    proven: false,
                    unanswered: Vec::new(),
                    writing: None,
                    write_started: now,
                };
                self.backoff = BACKOFF_MIN;
                if let Some(b) = pending {
                    conn.writing = Some(Writing::Request(b.clone()));
                    out.push(LinkAction::Write(b));
                }
                State::Connected(Box::new(conn))
            }
            E::ConnectFailed => self.connect_failed(now, pending, Vec::new(), out),
            E::TimerFired if now >= deadline => self.connect_failed(now, pending, Vec::new(), out),
            E::TimerFired | E::MessageRead => State::Connecting { pending, deadline },
            event => {
                out.push(LinkAction::Unexpected(event.name()));
                State::Connecting { pending, deadline }
            }
        }
    }

    /// An event on a live connection: what the service sent, a write to start or finished,
    /// the connection lost, or the time it has lived.
    fn on_connected(
        &mut self,
        now: Instant,
        mut c: Box<Conn<M>>,
        event: LinkEvent<M>,
        out: &mut Vec<LinkAction<M>>,
    ) -> State<M> {
        use LinkEvent as E;
        match event {
            E::MessageRead => {
                c.heard = true;
                State::Connected(c)
            }
            E::Queued(b) if c.writing.is_none() => {
                c.writing = Some(Writing::Request(b.clone()));
                c.write_started = now;
                out.push(LinkAction::Write(b));
                State::Connected(c)
            }
            E::Reply(b) if c.writing.is_none() => {
                c.writing = Some(Writing::Reply);
                c.write_started = now;
                out.push(LinkAction::Write(b));
                State::Connected(c)
            }
            E::WriteDone => {
                if let Some(Writing::Request(b)) = c.writing.take() {
                    if c.heard {
                        c.unanswered = Vec::new();
                    } else if c.unanswered.len() < UNANSWERED_KEPT {
                        c.unanswered.push(b);
                    }
                }
                State::Connected(c)
            }
            E::WriteFailed => {
                let request = match c.writing.take() {
                    Some(Writing::Request(b)) => Some(b),
                    _ => None,
                };
                self.connection_failed(now, *c, request, out)
            }
            E::ReaderClosed if c.writing.is_none() => {
                out.push(LinkAction::CountLost);
                self.connection_failed(now, *c, None, out)
            }
            E::TimerFired if c.writing.is_some() && now >= c.write_started + self.write_timeout => {
                // The service stopped reading: as good as refused.
                out.push(LinkAction::CountStalled);
                out.push(LinkAction::Disconnect);
                let request = match c.writing.take() {
                    Some(Writing::Request(b)) => Some(b),
                    _ => None,
                };
                let unanswered = if c.heard { Vec::new() } else { c.unanswered };
                self.connect_failed(now, request, unanswered, out)
            }
            E::TimerFired => {
                if c.writing.is_none() && !c.proven && now >= c.connected_at + SHORT_LIVED {
                    c.proven = true;
                    if self.down {
                        self.down = false;
                        out.push(LinkAction::MarkUp);
                    }
                }
                State::Connected(c)
            }
            event => {
                out.push(LinkAction::Unexpected(event.name()));
                State::Connected(c)
            }
        }
    }

    /// An event while a retired link drains: replies still written, the end at its time or
    /// when the connection fails.
    fn on_draining(
        &mut self,
        now: Instant,
        until: Instant,
        writing: bool,
        event: LinkEvent<M>,
        out: &mut Vec<LinkAction<M>>,
    ) -> State<M> {
        use LinkEvent as E;
        match event {
            E::Reply(b) if !writing => {
                out.push(LinkAction::Write(b));
                State::Draining {
                    until,
                    writing: true,
                }
            }
            E::WriteDone => State::Draining {
                until,
                writing: false,
            },
            E::WriteFailed | E::ReaderClosed => self.end_drain(out),
            E::TimerFired if now >= until => self.end_drain(out),
            E::TimerFired | E::MessageRead => State::Draining { until, writing },
            event => {
                out.push(LinkAction::Unexpected(event.name()));
                State::Draining { until, writing }
            }
        }
    }

    /// The top of the link's loop with `pending` to send (or none): connect when there is
    /// something to send or the service is DOWN, else wait for a request.
    fn connect(
        &mut self,
        now: Instant,
        pending: Option<M>,
        out: &mut Vec<LinkAction<M>>,
    ) -> State<M> {
        if pending.is_none() && !self.down {
            return State::Idle;
        }
        out.push(LinkAction::Connect);
        State::Connecting {
            pending,
            deadline: now + CONNECT_TIMEOUT,
        }
    }

    /// A connect failed (or a connection closed at once, as good as refused): mark the
    /// service DOWN first, so that the choice for the requests it had passes it over, hand
    /// them (and the queue) to the next-ranked members, and wait out the backoff (doubled
    /// for next time).
    fn connect_failed(
        &mut self,
        now: Instant,
        pending: Option<M>,
        unanswered: Vec<M>,
        out: &mut Vec<LinkAction<M>>,
    ) -> State<M> {
        out.push(LinkAction::MarkDown);
        out.extend(unanswered.into_iter().map(LinkAction::Redispatch));
        out.extend(pending.map(LinkAction::Redispatch));
        out.push(LinkAction::RedispatchQueue);
        let until = now + self.backoff;
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        self.down = true;
        State::Backoff { until }
    }

    /// The connection ended (a write failed, or the service closed it) with `request` cut
    /// short if it was being written.
    fn connection_failed(
        &mut self,
        now: Instant,
        c: Conn<M>,
        request: Option<M>,
        out: &mut Vec<LinkAction<M>>,
    ) -> State<M> {
        out.push(LinkAction::Disconnect);
        // Closed before answering anything: what it was given goes elsewhere.
        let unanswered = if c.heard { Vec::new() } else { c.unanswered };
        if !c.heard && now.saturating_duration_since(c.connected_at) < SHORT_LIVED {
            // Closed at once and without a word: as good as refused, with the backoff the
            // link had before this connection.
            self.backoff = c.failed_backoff;
            return self.connect_failed(now, request, unanswered, out);
        }
        out.extend(unanswered.into_iter().map(LinkAction::Redispatch));
        self.connect(now, request, out)
    }

    /// Take the retirement in, in `state`: the queue (and what was about to be sent) goes
    /// back to the current core; a connection between writes drains, one cut in the middle
    /// of a write closes at once.
    fn retire(&mut self, now: Instant, state: State<M>, out: &mut Vec<LinkAction<M>>) -> State<M> {
        let hand_back = |pending: Option<M>, out: &mut Vec<LinkAction<M>>| {
            out.push(LinkAction::CloseQueue);
            out.extend(pending.map(LinkAction::Redispatch));
            out.push(LinkAction::RedispatchQueue);
            out.push(LinkAction::CountRetired);
        };
        match state {
            State::Idle | State::Backoff { .. } => {
                hand_back(None, out);
                out.push(LinkAction::Close);
                State::Closed
            }
            State::Connecting { pending, .. } => {
                hand_back(pending, out);
                out.push(LinkAction::Close);
                State::Closed
            }
            State::Connected(c) => match c.writing {
                None => {
                    // Between writes: the service may still answer what it was given.
                    hand_back(None, out);
                    out.push(LinkAction::StartDrain);
                    State::Draining {
                        until: now + RETIRED_DRAIN,
                        writing: false,
                    }
                }
                Some(writing) => {
                    // The service stopped reading: what it never answered goes elsewhere.
                    if !c.heard {
                        out.extend(c.unanswered.into_iter().map(LinkAction::Redispatch));
                    }
                    let cut = match writing {
                        Writing::Request(b) => Some(b),
                        Writing::Reply => None,
                    };
                    hand_back(cut, out);
                    out.push(LinkAction::Disconnect);
                    out.push(LinkAction::Close);
                    State::Closed
                }
            },
            state @ (State::Draining { .. } | State::Closed) => state,
        }
    }

    fn end_drain(&mut self, out: &mut Vec<LinkAction<M>>) -> State<M> {
        out.push(LinkAction::EndDrain);
        out.push(LinkAction::Close);
        State::Closed
    }
}

#[cfg(test)]
impl Link {
    /// The request the link holds, about to be written or being written.
    fn held(&self) -> Option<&Bytes> {
        match &self.state {
            State::Connecting { pending, .. } => pending.as_ref(),
            State::Connected(c) => match &c.writing {
                Some(Writing::Request(b)) => Some(b),
                _ => None,
            },
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LinkAction as A;
    use super::LinkEvent as E;
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    /// A link driven with simulated time.
    struct Sim {
        link: Link,
        now: Instant,
    }

    impl Sim {
        fn new() -> Sim {
            Sim {
                link: Link::new(),
                now: Instant::now(),
            }
        }

        fn ev(&mut self, e: LinkEvent) -> Vec<LinkAction> {
            let mut out = Vec::new();
            self.link.handle(self.now, e, &mut out);
            out
        }

        fn after(&mut self, d: Duration, e: LinkEvent) -> Vec<LinkAction> {
            self.now += d;
            self.ev(e)
        }

        /// How long until the link's deadline (from now).
        fn wait(&self) -> Option<Duration> {
            self.link.poll_timeout().map(|t| t - self.now)
        }

        /// Jump to the deadline and fire it.
        fn fire(&mut self) -> Vec<LinkAction> {
            let t = self.link.poll_timeout().expect("a deadline");
            self.now = t;
            self.ev(E::TimerFired)
        }

        /// Queue `b` on an idle link and connect: the link writes it.
        fn connected_with(&mut self, b: &Bytes) {
            assert_eq!(self.ev(E::Queued(b.clone())), vec![A::Connect]);
            assert_eq!(self.ev(E::ConnectOk), vec![A::Write(b.clone())]);
        }

        /// Fail connects until the next wait would be `backoff`; the link is DOWN, probing.
        fn fail_until_backoff(&mut self, backoff: Duration) {
            assert_eq!(self.ev(E::Queued(msg(999))), vec![A::Connect]);
            loop {
                self.ev(E::ConnectFailed);
                assert_eq!(self.fire(), vec![A::Connect]);
                if self.link.backoff == backoff {
                    return;
                }
            }
        }
    }

    fn msg(n: u32) -> Bytes {
        Bytes::from(format!("INVITE {n}"))
    }

    /// A service that stops reading: the write makes no progress for `write_timeout`, the
    /// connection ends as a refused connect (DOWN, the cut request and the unanswered ones
    /// chosen again, backoff), counted; a write that finishes in time is not touched.
    #[test]
    fn a_write_without_progress_ends_the_connection_at_write_timeout() {
        let mut s = Sim::new();
        s.link.set_write_timeout(2 * Duration::from_secs(1));
        s.connected_with(&msg(1));
        assert_eq!(s.link.phase(), Phase::Writing);
        assert_eq!(s.wait(), Some(Duration::from_secs(2)));
        // In time: done, and the next write has its own deadline.
        assert_eq!(s.after(Duration::from_millis(1900), E::WriteDone), vec![]);
        assert_eq!(
            s.after(Duration::from_secs(1), E::Queued(msg(2))),
            vec![A::Write(msg(2))]
        );
        assert_eq!(s.wait(), Some(Duration::from_secs(2)));
        assert_eq!(
            s.after(Duration::from_secs(1), E::TimerFired),
            vec![],
            "not yet"
        );
        assert_eq!(
            s.fire(),
            vec![
                A::CountStalled,
                A::Disconnect,
                A::MarkDown,
                A::Redispatch(msg(1)),
                A::Redispatch(msg(2)),
                A::RedispatchQueue,
            ]
        );
        assert_eq!(s.link.phase(), Phase::Backoff);
        // Once the service has answered, only the request cut short goes elsewhere.
        let mut s = Sim::new();
        s.connected_with(&msg(1));
        s.ev(E::MessageRead);
        assert_eq!(s.after(MS, E::WriteDone), vec![]);
        assert_eq!(s.ev(E::Queued(msg(2))), vec![A::Write(msg(2))]);
        assert_eq!(s.wait(), Some(WRITE_TIMEOUT));
        assert_eq!(
            s.fire(),
            vec![
                A::CountStalled,
                A::Disconnect,
                A::MarkDown,
                A::Redispatch(msg(2)),
                A::RedispatchQueue,
            ]
        );
    }

    /// What a phase does not wait for changes nothing and is reported, never swallowed.
    #[test]
    fn events_a_phase_does_not_wait_for_are_reported() {
        let mut s = Sim::new();
        assert_eq!(s.ev(E::WriteDone), vec![A::Unexpected("write_done")]);
        assert_eq!(s.link.phase(), Phase::Idle);
        assert_eq!(s.ev(E::TimerFired), vec![], "an early timer is not a bug");
        s.connected_with(&msg(1));
        assert_eq!(s.ev(E::ConnectOk), vec![A::Unexpected("connect_ok")]);
        assert_eq!(s.link.phase(), Phase::Writing);
        assert_eq!(s.ev(E::WriteDone), vec![]);
        assert_eq!(
            s.ev(E::ConnectFailed),
            vec![A::Unexpected("connect_failed")]
        );
        assert_eq!(s.link.phase(), Phase::Connected);
    }

    #[test]
    fn connects_only_when_something_is_queued() {
        let mut s = Sim::new();
        assert_eq!(s.link.phase(), Phase::Idle);
        assert_eq!(s.wait(), None);
        assert_eq!(s.after(Duration::from_secs(60), E::TimerFired), vec![]);
        assert_eq!(s.link.phase(), Phase::Idle);
        let a = msg(1);
        assert_eq!(s.ev(E::Queued(a.clone())), vec![A::Connect]);
        assert_eq!(s.link.phase(), Phase::Connecting);
        assert_eq!(s.ev(E::ConnectOk), vec![A::Write(a)]);
        assert_eq!(s.link.phase(), Phase::Writing);
        assert_eq!(s.ev(E::WriteDone), vec![]);
        assert_eq!(s.link.phase(), Phase::Connected);
    }

    #[test]
    fn a_connect_that_takes_longer_than_its_timeout_fails() {
        let mut s = Sim::new();
        let a = msg(1);
        s.ev(E::Queued(a.clone()));
        assert_eq!(s.wait(), Some(CONNECT_TIMEOUT));
        assert_eq!(s.after(CONNECT_TIMEOUT - MS, E::TimerFired), vec![]);
        assert_eq!(s.link.phase(), Phase::Connecting);
        assert_eq!(
            s.after(MS, E::TimerFired),
            vec![A::MarkDown, A::Redispatch(a), A::RedispatchQueue]
        );
        assert_eq!(s.link.phase(), Phase::Backoff);
        assert_eq!(s.wait(), Some(BACKOFF_MIN));
    }

    #[test]
    fn backoff_doubles_per_failure_up_to_its_cap_and_a_down_link_keeps_probing() {
        let mut s = Sim::new();
        s.ev(E::Queued(msg(1)));
        let mut waits = Vec::new();
        for _ in 0..9 {
            assert_eq!(s.ev(E::ConnectFailed)[0], A::MarkDown);
            waits.push(s.wait().expect("backoff"));
            // Nothing earlier than the backoff's end; then a probe, with nothing queued.
            assert_eq!(s.after(waits[waits.len() - 1] - MS, E::TimerFired), vec![]);
            assert_eq!(s.after(MS, E::TimerFired), vec![A::Connect]);
            assert_eq!(s.link.held(), None);
        }
        let ms = |v: u64| Duration::from_millis(v);
        assert_eq!(
            waits,
            [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000].map(ms)
        );
        assert_eq!((BACKOFF_MIN, BACKOFF_MAX), (ms(100), ms(5000)));
    }

    #[test]
    fn a_connection_that_closes_at_once_without_a_word_counts_as_refused() {
        let mut s = Sim::new();
        s.fail_until_backoff(Duration::from_millis(400));
        let (a, b) = (msg(1), msg(2));
        assert_eq!(s.ev(E::ConnectOk), vec![]);
        for m in [&a, &b] {
            s.ev(E::Queued(m.clone()));
            s.ev(E::WriteDone);
        }
        assert_eq!(
            s.after(SHORT_LIVED - MS, E::ReaderClosed),
            vec![
                A::CountLost,
                A::Disconnect,
                A::MarkDown,
                A::Redispatch(a),
                A::Redispatch(b),
                A::RedispatchQueue,
            ]
        );
        // The backoff the link had before that connection, not a fresh one.
        assert_eq!(s.wait(), Some(Duration::from_millis(400)));
        assert_eq!(s.fire(), vec![A::Connect]);
    }

    #[test]
    fn a_write_that_fails_at_once_counts_as_refused_and_hands_the_request_on() {
        let mut s = Sim::new();
        let a = msg(1);
        s.connected_with(&a);
        assert_eq!(
            s.after(10 * MS, E::WriteFailed),
            vec![
                A::Disconnect,
                A::MarkDown,
                A::Redispatch(a),
                A::RedispatchQueue
            ]
        );
        assert_eq!(s.wait(), Some(BACKOFF_MIN));
    }

    #[test]
    fn a_service_that_answered_then_closed_is_only_reconnected() {
        let mut s = Sim::new();
        let a = msg(1);
        s.connected_with(&a);
        s.ev(E::WriteDone);
        s.ev(E::MessageRead);
        assert_eq!(
            s.after(10 * MS, E::ReaderClosed),
            vec![A::CountLost, A::Disconnect]
        );
        // UP and nothing to send: it waits for the next request.
        assert_eq!(s.link.phase(), Phase::Idle);
        // Cut in the middle of a write after it answered: the request is sent again on a
        // new connection, not chosen again.
        let b = msg(2);
        s.connected_with(&b);
        s.ev(E::MessageRead);
        assert_eq!(s.ev(E::WriteFailed), vec![A::Disconnect, A::Connect]);
        assert_eq!(s.link.held(), Some(&b));
    }

    #[test]
    fn a_connection_that_lived_short_lived_is_not_a_refusal_and_its_unanswered_go_elsewhere() {
        let mut s = Sim::new();
        let a = msg(1);
        s.connected_with(&a);
        s.ev(E::WriteDone);
        assert_eq!(s.wait(), Some(SHORT_LIVED));
        assert_eq!(s.fire(), vec![], "never DOWN: nothing to mark UP");
        assert_eq!(
            s.after(MS, E::ReaderClosed),
            vec![A::CountLost, A::Disconnect, A::Redispatch(a)]
        );
        assert_eq!(s.link.phase(), Phase::Idle);
    }

    #[test]
    fn a_down_service_is_marked_up_once_a_connection_lives_short_lived() {
        let mut s = Sim::new();
        s.fail_until_backoff(Duration::from_millis(800));
        assert_eq!(s.ev(E::ConnectOk), vec![]);
        assert_eq!(s.wait(), Some(SHORT_LIVED));
        assert_eq!(s.after(SHORT_LIVED - MS, E::TimerFired), vec![]);
        // The proof waits for a write under way (whose own deadline is the write timeout).
        let a = msg(1);
        assert_eq!(s.ev(E::Queued(a.clone())), vec![A::Write(a)]);
        assert_eq!(s.wait(), Some(WRITE_TIMEOUT));
        assert_eq!(s.after(MS, E::TimerFired), vec![]);
        assert_eq!(s.ev(E::WriteDone), vec![]);
        assert_eq!(s.ev(E::TimerFired), vec![A::MarkUp]);
        assert_eq!(s.wait(), None, "proven once");
        // UP again: the backoff starts over, and a lost connection is not a refusal.
        s.ev(E::MessageRead);
        assert_eq!(
            s.after(MS, E::ReaderClosed),
            vec![A::CountLost, A::Disconnect]
        );
        assert_eq!(s.link.phase(), Phase::Idle);
        s.ev(E::Queued(msg(2)));
        s.ev(E::ConnectFailed);
        assert_eq!(s.wait(), Some(BACKOFF_MIN));
    }

    #[test]
    fn unanswered_requests_are_kept_up_to_a_bound_and_forgotten_once_the_service_speaks() {
        let mut s = Sim::new();
        let first = msg(0);
        s.connected_with(&first);
        s.ev(E::WriteDone);
        for n in 1..300 {
            s.ev(E::Queued(msg(n)));
            s.ev(E::WriteDone);
        }
        let out = s.after(MS, E::ReaderClosed);
        let redispatched: Vec<&LinkAction> = out
            .iter()
            .filter(|a| matches!(a, A::Redispatch(_)))
            .collect();
        assert_eq!(redispatched.len(), UNANSWERED_KEPT);
        assert_eq!(redispatched[0], &A::Redispatch(msg(0)));
        assert_eq!(
            redispatched[UNANSWERED_KEPT - 1],
            &A::Redispatch(msg(UNANSWERED_KEPT as u32 - 1))
        );

        let mut s = Sim::new();
        s.connected_with(&msg(1));
        s.ev(E::WriteDone);
        s.ev(E::MessageRead);
        s.ev(E::Queued(msg(2)));
        s.ev(E::WriteDone);
        assert_eq!(
            s.after(MS, E::ReaderClosed),
            vec![A::CountLost, A::Disconnect]
        );
    }

    #[test]
    fn retired_between_writes_the_connection_drains_for_32_s() {
        let mut s = Sim::new();
        let a = msg(1);
        s.connected_with(&a);
        s.ev(E::WriteDone);
        // The service may still answer `a`: it is not chosen again.
        assert_eq!(
            s.ev(E::Retired),
            vec![
                A::CloseQueue,
                A::RedispatchQueue,
                A::CountRetired,
                A::StartDrain
            ]
        );
        assert_eq!(s.link.phase(), Phase::Draining);
        assert_eq!(RETIRED_DRAIN, Duration::from_secs(32));
        assert_eq!(s.wait(), Some(RETIRED_DRAIN));
        // No new request is taken (the shell closed the queue: one is reported as unexpected);
        // replies are written.
        assert_eq!(s.ev(E::Queued(msg(2))), vec![A::Unexpected("queued")]);
        let r = Bytes::from_static(b"SIP/2.0 200 OK");
        assert_eq!(
            s.after(Duration::from_secs(20), E::Reply(r.clone())),
            vec![A::Write(r)]
        );
        assert_eq!(s.link.phase(), Phase::DrainWriting);
        assert_eq!(s.ev(E::WriteDone), vec![]);
        assert_eq!(s.after(Duration::from_secs(12) - MS, E::TimerFired), vec![]);
        assert_eq!(s.after(MS, E::TimerFired), vec![A::EndDrain, A::Close]);
        assert_eq!(s.link.phase(), Phase::Closed);
        assert_eq!(s.wait(), None);
    }

    #[test]
    fn a_drain_ends_early_when_the_service_closes_and_cuts_a_write_at_its_end() {
        let mut s = Sim::new();
        s.connected_with(&msg(1));
        s.ev(E::WriteDone);
        s.ev(E::Retired);
        assert_eq!(
            s.after(Duration::from_secs(3), E::ReaderClosed),
            vec![A::EndDrain, A::Close]
        );

        let mut s = Sim::new();
        s.connected_with(&msg(1));
        s.ev(E::WriteDone);
        s.ev(E::Retired);
        s.ev(E::Reply(Bytes::from_static(b"SIP/2.0 200 OK")));
        // A write that does not finish does not stretch the drain.
        assert_eq!(s.wait(), Some(RETIRED_DRAIN));
        assert_eq!(s.fire(), vec![A::EndDrain, A::Close]);
    }

    #[test]
    fn retired_in_the_middle_of_a_write_the_connection_closes_at_once() {
        let mut s = Sim::new();
        let (a, b) = (msg(1), msg(2));
        s.connected_with(&a);
        s.ev(E::WriteDone);
        s.ev(E::Queued(b.clone()));
        assert_eq!(
            s.ev(E::Retired),
            vec![
                A::Redispatch(a),
                A::CloseQueue,
                A::Redispatch(b),
                A::RedispatchQueue,
                A::CountRetired,
                A::Disconnect,
                A::Close,
            ]
        );
        assert_eq!(s.link.phase(), Phase::Closed);

        // Heard from: what it was given stays with it; a reply cut short is not redispatched.
        let mut s = Sim::new();
        s.connected_with(&msg(1));
        s.ev(E::WriteDone);
        s.ev(E::MessageRead);
        s.ev(E::Reply(Bytes::from_static(b"SIP/2.0 200 OK")));
        assert_eq!(
            s.ev(E::Retired),
            vec![
                A::CloseQueue,
                A::RedispatchQueue,
                A::CountRetired,
                A::Disconnect,
                A::Close,
            ]
        );
    }

    #[test]
    fn retired_before_a_connection_hands_everything_back_and_closes() {
        let mut s = Sim::new();
        let a = msg(1);
        s.ev(E::Queued(a.clone()));
        let handed = |pending: Option<Bytes>| {
            let mut v = vec![A::CloseQueue];
            v.extend(pending.map(A::Redispatch));
            v.extend([A::RedispatchQueue, A::CountRetired, A::Close]);
            v
        };
        assert_eq!(s.ev(E::Retired), handed(Some(a)));
        assert_eq!(s.ev(E::ConnectOk), vec![], "over");

        let mut s = Sim::new();
        s.ev(E::Queued(msg(1)));
        s.ev(E::ConnectFailed);
        assert_eq!(s.ev(E::Retired), handed(None));
        assert_eq!(s.fire_if_any(), None);

        let mut s = Sim::new();
        assert_eq!(s.ev(E::Retired), handed(None));
        assert_eq!(s.ev(E::QueueClosed), vec![]);
    }

    #[test]
    fn a_closed_queue_ends_the_link() {
        let mut s = Sim::new();
        assert_eq!(s.ev(E::QueueClosed), vec![A::Close]);
        let mut s = Sim::new();
        s.connected_with(&msg(1));
        s.ev(E::WriteDone);
        assert_eq!(s.ev(E::QueueClosed), vec![A::Close]);
    }

    impl Sim {
        fn fire_if_any(&mut self) -> Option<Vec<LinkAction>> {
            self.link.poll_timeout()?;
            Some(self.fire())
        }
    }

    /// How a connection attempt fails.
    #[derive(Debug, Clone, Copy)]
    enum Failure {
        Refused,
        TimedOut,
        /// Accepted, then closed without a word before SHORT_LIVED.
        ClosedAtOnce(u64),
    }

    fn failure() -> impl Strategy<Value = Failure> {
        prop_oneof![
            Just(Failure::Refused),
            Just(Failure::TimedOut),
            (0..SHORT_LIVED.as_millis() as u64).prop_map(Failure::ClosedAtOnce),
        ]
    }

    proptest! {
        /// However consecutive failures happen, each marks the service DOWN once and the link
        /// waits min(100 ms · 2^k, 5 s) before the k-th probe, never less.
        #[test]
        fn backoff_follows_consecutive_failures_of_any_kind(fails in proptest::collection::vec(failure(), 1..14)) {
            let mut s = Sim::new();
            s.ev(E::Queued(msg(1)));
            for (k, f) in fails.iter().enumerate() {
                let out = match *f {
                    Failure::Refused => s.ev(E::ConnectFailed),
                    Failure::TimedOut => s.fire(),
                    Failure::ClosedAtOnce(ms) => {
                        // The first connection writes the request that asked for it.
                        if s.ev(E::ConnectOk) == vec![A::Write(msg(1))] {
                            s.ev(E::WriteDone);
                        }
                        s.after(Duration::from_millis(ms), E::ReaderClosed)
                    }
                };
                prop_assert_eq!(out.iter().filter(|a| **a == A::MarkDown).count(), 1);
                let expect = (BACKOFF_MIN * 2u32.pow(k.min(10) as u32)).min(BACKOFF_MAX);
                prop_assert_eq!(s.wait(), Some(expect));
                prop_assert_eq!(s.after(expect - MS, E::TimerFired), vec![]);
                prop_assert_eq!(s.after(MS, E::TimerFired), vec![A::Connect]);
            }
        }

        /// Driven at random through the events its phases allow, the link never loses or
        /// duplicates a request: each queued one is, at the end, written, chosen again
        /// (once, and never written after that) or still held; nothing is connected or
        /// written for a new request once it is retired.
        #[test]
        fn a_request_is_written_handed_back_or_held(steps in proptest::collection::vec((0u8..8, 0u64..1500), 1..200)) {
            let mut s = Sim::new();
            let mut next = 0u32;
            let mut queued = Vec::new();
            let mut written = std::collections::HashSet::new();
            let mut handed = std::collections::HashSet::new();
            let mut in_write: Option<Bytes> = None;
            for (pick, ms) in steps {
                s.now += Duration::from_millis(ms);
                let phase = s.link.phase();
                let e = match (phase, pick) {
                    (Phase::Closed, _) => break,
                    (_, 7) if !s.link.is_retired() => E::Retired,
                    (Phase::Idle | Phase::Connected, 0..=2) => {
                        next += 1;
                        queued.push(msg(next));
                        E::Queued(msg(next))
                    }
                    (Phase::Connecting, 0..=3) => E::ConnectOk,
                    (Phase::Connecting, _) => E::ConnectFailed,
                    (Phase::Writing | Phase::DrainWriting, 0..=4) => E::WriteDone,
                    (Phase::Writing | Phase::DrainWriting, _) => E::WriteFailed,
                    (Phase::Connected | Phase::Draining, 3) => E::Reply(Bytes::from_static(b"\r\n\r\n")),
                    (Phase::Connected | Phase::Draining, 4) => E::MessageRead,
                    (Phase::Connected | Phase::Draining, 5) => E::ReaderClosed,
                    _ => E::TimerFired,
                };
                if e == E::TimerFired {
                    match s.link.poll_timeout() {
                        Some(t) if t <= s.now => {}
                        Some(t) => s.now = t,
                        None => continue,
                    }
                }
                let done = e == E::WriteDone;
                let retired_before = s.link.is_retired();
                for a in s.ev(e) {
                    match a {
                        A::Write(b) => {
                            prop_assert!(!handed.contains(&b), "written after being handed back");
                            prop_assert!(!(retired_before && b.starts_with(b"INVITE")), "new request written after retirement");
                            in_write = Some(b);
                        }
                        A::Redispatch(b) => prop_assert!(handed.insert(b), "handed back twice"),
                        A::Connect => prop_assert!(!s.link.is_retired()),
                        A::Unexpected(e) => prop_assert!(false, "{} in {:?} is what the phase allows", e, phase),
                        _ => {}
                    }
                }
                if done && let Some(b) = in_write.take() {
                    written.insert(b);
                }
            }
            let held = s.link.held().cloned();
            for q in &queued {
                prop_assert!(
                    written.contains(q) || handed.contains(q) || held.as_ref() == Some(q),
                    "request {:?} lost", q
                );
            }
        }
    }
}
