//! PURE: the receive side of one SIP stream (a client's connection or a service link's):
//! the buffer messages are framed from (RFC 3261 §18.3, Content-Length framing) and the
//! deadline of a message that is arriving ([`MESSAGE_DEADLINE`]), with time passed in. The
//! IO shell (`proxy::sip_stream`'s `read_messages`) reads bytes into [`Inbound::read_buf`], hands each
//! frame to the core and waits until [`Inbound::wait_until`].
//!
//! The buffer holds bytes only while a message is incomplete: an idle connection (a
//! registered phone between requests) holds none.

use crate::sip::{Frame, FrameError, Framer};
use bytes::{Buf, BytesMut};
use std::time::{Duration, Instant};

/// How long a started message may take to arrive whole (however slowly its bytes come): a
/// peer cannot hold a partial message's buffer for longer.
pub(crate) const MESSAGE_DEADLINE: Duration = Duration::from_secs(10);

/// Free room below which a read first grows the buffer, and by how much.
const READ_ROOM: usize = 1024;
const READ_GROW: usize = 4096;
/// The buffer a stream that must wait holding one (TLS) waits with while no message is under
/// way: a silent client holds this much, not [`READ_GROW`]; the bytes of a message that
/// arrives are taken in a first small read, then as usual.
const IDLE_ROOM: usize = 256;

/// A stream's receive buffer. See the module documentation.
#[derive(Debug)]
pub(crate) struct Inbound {
    buf: BytesMut,
    /// How far the message at the front has been read: each read's bytes are framed once.
    framer: Framer,
    max_message: usize,
    /// When the first bytes of the message now at the front arrived.
    started: Option<Instant>,
}

impl Inbound {
    /// Messages longer than `max_message` bytes are a framing error.
    pub(crate) fn new(max_message: usize) -> Inbound {
        Inbound {
            buf: BytesMut::new(),
            framer: Framer::default(),
            max_message,
            started: None,
        }
    }

    /// The frame at the front, if it is whole (`Ok(None)`: more bytes are needed). Its bytes
    /// are [`Inbound::front`]`(frame.len())` until [`Inbound::consume`] takes them.
    pub(crate) fn frame(&mut self) -> Result<Option<Frame>, FrameError> {
        match self.framer.frame(&self.buf, self.max_message) {
            Ok(frame) => Ok(Some(frame)),
            Err(FrameError::Incomplete) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The first `len` bytes buffered (at most what there is).
    pub(crate) fn front(&self, len: usize) -> &[u8] {
        &self.buf[..len.min(self.buf.len())]
    }

    /// What is buffered, at most the frame limit: the start of a message that framing found
    /// too large, for the answer to it.
    pub(crate) fn head(&self) -> &[u8] {
        self.front(self.max_message)
    }

    /// Throw away everything buffered (the stream is closing).
    pub(crate) fn discard(&mut self) {
        self.buf.clear();
        self.framer = Framer::default();
        self.started = None;
    }

    /// Take the frame of `len` bytes at the front away. The deadline then times the message
    /// that follows, not the first one that was ever incomplete.
    pub(crate) fn consume(&mut self, len: usize) {
        self.buf.advance(len.min(self.buf.len()));
        self.framer = Framer::default();
        self.started = None;
    }

    /// Once every whole frame is consumed, at `now`: an empty buffer is given back; what is
    /// left is the start of a message, whose deadline starts now if it has not yet.
    pub(crate) fn settle(&mut self, now: Instant) {
        if self.buf.is_empty() {
            if self.buf.capacity() > 0 {
                self.buf = BytesMut::new();
            }
        } else {
            self.started.get_or_insert(now);
        }
    }

    /// The end of the wait for more bytes: the earlier of `idle_until` (a client's idle
    /// timeout; none for a service) and the partial message's deadline.
    pub(crate) fn wait_until(&self, idle_until: Option<Instant>) -> Option<Instant> {
        match (idle_until, self.started.map(|t| t + MESSAGE_DEADLINE)) {
            (Some(i), Some(m)) => Some(i.min(m)),
            (i, m) => i.or(m),
        }
    }

    /// Whether the partial message has had its [`MESSAGE_DEADLINE`] at `now` (the wait that
    /// ended was its deadline, not the idle timeout).
    pub(crate) fn is_overdue(&self, now: Instant) -> bool {
        self.started
            .is_some_and(|t| now.saturating_duration_since(t) >= MESSAGE_DEADLINE)
    }

    /// The reader did not read for `paused` (the client's write queue was full): that time
    /// does not count against the message under way, whose bytes fulcrum was not taking.
    pub(crate) fn postpone(&mut self, paused: Duration) {
        if let Some(t) = self.started.as_mut() {
            *t += paused;
        }
    }

    /// The buffer to read into, with room made first (taken only once bytes are there).
    pub(crate) fn read_buf(&mut self) -> &mut BytesMut {
        if self.buf.capacity() - self.buf.len() < READ_ROOM {
            self.buf.reserve(READ_GROW);
        }
        &mut self.buf
    }

    /// [`Inbound::read_buf`] for a wait that must hold the buffer (a TLS stream cannot wait
    /// for readiness without one): while no message is under way, a small one.
    pub(crate) fn idle_read_buf(&mut self) -> &mut BytesMut {
        if self.buf.is_empty() {
            if self.buf.capacity() < IDLE_ROOM {
                self.buf.reserve(IDLE_ROOM);
            }
            return &mut self.buf;
        }
        self.read_buf()
    }

    /// Bytes held (a message under way), and the buffer's capacity.
    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        (self.buf.len(), self.buf.capacity())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sip::framing::DEFAULT_MAX_MESSAGE;

    #[test]
    fn a_wait_holding_the_buffer_holds_a_small_one_until_a_message_is_under_way() {
        let mut b = Inbound::new(DEFAULT_MAX_MESSAGE);
        let cap = b.idle_read_buf().capacity();
        assert!((IDLE_ROOM..READ_ROOM).contains(&cap), "{cap}");
        // Part of a message arrived: the next read makes the usual room.
        b.idle_read_buf()
            .extend_from_slice(b"OPTIONS sip:a@b SIP/2.0\r\n");
        let room = {
            let r = b.idle_read_buf();
            r.capacity() - r.len()
        };
        assert!(room >= READ_ROOM, "{room}");
    }

    const MSG: &[u8] = b"OPTIONS sip:a@b SIP/2.0\r\nVia: SIP/2.0/TCP h;branch=z9hG4bK1\r\nContent-Length: 0\r\n\r\n";

    fn push(i: &mut Inbound, bytes: &[u8]) {
        i.read_buf().extend_from_slice(bytes);
    }

    /// Every whole frame at the front, consumed: their lengths (0 for a ping).
    fn drain(i: &mut Inbound) -> Vec<usize> {
        let mut seen = Vec::new();
        while let Ok(Some(f)) = i.frame() {
            let len = f.len();
            seen.push(if matches!(f, Frame::Ping) { 0 } else { len });
            assert_eq!(i.front(len).len(), len);
            i.consume(len);
        }
        seen
    }

    #[test]
    fn frames_back_to_back_messages_and_keepalives_from_one_read() {
        let t0 = Instant::now();
        let mut i = Inbound::new(DEFAULT_MAX_MESSAGE);
        let mut bytes = MSG.to_vec();
        bytes.extend_from_slice(b"\r\n\r\n");
        bytes.extend_from_slice(MSG);
        push(&mut i, &bytes);
        assert_eq!(drain(&mut i), vec![MSG.len(), 0, MSG.len()]);
        i.settle(t0);
        assert_eq!(i.held(), (0, 0), "an idle stream holds no buffer");
        assert_eq!(i.wait_until(None), None);
    }

    #[test]
    fn a_partial_message_is_timed_from_its_first_bytes() {
        let t0 = Instant::now();
        let mut i = Inbound::new(DEFAULT_MAX_MESSAGE);
        push(&mut i, &MSG[..10]);
        assert_eq!(drain(&mut i), Vec::<usize>::new());
        i.settle(t0);
        // More bytes later do not move the deadline.
        push(&mut i, &MSG[10..20]);
        i.settle(t0 + Duration::from_secs(6));
        assert_eq!(i.wait_until(None), Some(t0 + MESSAGE_DEADLINE));
        assert!(!i.is_overdue(t0 + MESSAGE_DEADLINE - Duration::from_millis(1)));
        assert!(i.is_overdue(t0 + MESSAGE_DEADLINE));
        // A client's idle timeout ends the wait first when it is earlier, and the other way.
        let soon = t0 + Duration::from_secs(2);
        assert_eq!(i.wait_until(Some(soon)), Some(soon));
        let late = t0 + Duration::from_secs(60);
        assert_eq!(i.wait_until(Some(late)), Some(t0 + MESSAGE_DEADLINE));
    }

    #[test]
    fn the_deadline_times_the_message_at_the_front_not_the_first_incomplete_one() {
        let t0 = Instant::now();
        let mut i = Inbound::new(DEFAULT_MAX_MESSAGE);
        push(&mut i, &MSG[..30]);
        i.settle(t0);
        // 9 s later the first message completes together with the start of the next.
        let t9 = t0 + Duration::from_secs(9);
        push(&mut i, &MSG[30..]);
        push(&mut i, &MSG[..30]);
        assert_eq!(drain(&mut i), vec![MSG.len()]);
        i.settle(t9);
        assert_eq!(i.wait_until(None), Some(t9 + MESSAGE_DEADLINE));
        assert!(!i.is_overdue(t0 + MESSAGE_DEADLINE + Duration::from_secs(1)));
        // Whole at last: nothing held, nothing timed.
        push(&mut i, &MSG[30..]);
        assert_eq!(drain(&mut i), vec![MSG.len()]);
        i.settle(t9 + Duration::from_secs(1));
        assert_eq!(i.wait_until(None), None);
        assert!(!i.is_overdue(t9 + Duration::from_secs(100)));
        assert_eq!(i.held(), (0, 0));
    }

    #[test]
    fn time_paused_by_the_reader_does_not_count_against_a_message() {
        let t0 = Instant::now();
        let mut i = Inbound::new(DEFAULT_MAX_MESSAGE);
        // Nothing under way: nothing to move.
        i.postpone(Duration::from_secs(5));
        assert_eq!(i.wait_until(None), None);
        push(&mut i, &MSG[..10]);
        i.settle(t0);
        i.postpone(Duration::from_secs(8));
        assert_eq!(
            i.wait_until(None),
            Some(t0 + Duration::from_secs(8) + MESSAGE_DEADLINE)
        );
        assert!(!i.is_overdue(t0 + MESSAGE_DEADLINE));
        assert!(i.is_overdue(t0 + Duration::from_secs(8) + MESSAGE_DEADLINE));
    }

    #[test]
    fn a_message_over_the_limit_is_a_framing_error() {
        let mut i = Inbound::new(40);
        push(&mut i, MSG);
        assert!(i.frame().is_err());
    }
}
