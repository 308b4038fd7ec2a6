//! Reading one SIP stream connection (a client's or a service link's): framed messages
//! handed to the current core and carried out, pings answered, within the idle timeout and
//! a message's deadline ([`Inbound`]). IO.

use super::*;
use crate::proxy::handover::Reader;
use crate::sip::FrameError;

thread_local! {
    /// Where a message is rewritten before it is copied into its queue: one per thread.
    pub(super) static OUT: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(Vec::with_capacity(4096));
}

/// Who is on the other side of a connection being read, and where its reader's own answers go.
pub(super) struct Peer<'a> {
    pub(super) origin: Origin,
    pub(super) src: SocketAddr,
    pub(super) dst: SocketAddr,
    /// Where pongs and fulcrum's own replies go.
    pub(super) reply: ReplyTo<'a>,
    /// Set once anything arrives (a service link's: the service has spoken).
    pub(super) heard: Option<&'a AtomicBool>,
    /// A client's write queue.
    pub(super) queue: Option<&'a Level>,
    /// A service link's: its answers count as successes for passive ejection.
    pub(super) link: Option<&'a ServiceLink>,
    /// A client's: what it has done, for eviction under pressure.
    pub(super) activity: Option<&'a crate::budget::Activity>,
}

/// Read framed SIP messages from `read`, hand each to the current core, until EOF, error,
/// idle timeout (clients only: a service connection stays while the service keeps it), a
/// message that takes longer than [`inbound::MESSAGE_DEADLINE`] to arrive, or a framing error
/// (the buffer and the deadline are [`Inbound`]'s). A client's requests are not read while
/// its write queue is full ([`outbox`]).
pub(super) async fn read_messages<R: StreamRead>(
    shared: &SipStreamShared,
    mut read: R,
    peer: Peer<'_>,
) {
    let (max_message, is_client) = match peer.origin {
        Origin::Member(_) => (SERVICE_MAX_MESSAGE, false),
        Origin::Client { .. } => (DEFAULT_MAX_MESSAGE, true),
    };
    let mut inbound = Inbound::new(max_message);
    let reader = shared.readers.register();
    loop {
        match frame_buffered(shared, &mut inbound, &peer, &reader) {
            Framed::ReadMore => {}
            Framed::Close => return,
            Framed::Answered => return linger(&mut read, &mut inbound).await,
        }
        // A client that sends faster than it reads: its next requests wait in its socket
        // until the writer has drained its queue (or has given up on it). The time paused
        // does not count against a message under way.
        if let Some(level) = peer.queue.filter(|l| l.should_pause()) {
            bump(&shared.counters.client_reads_paused);
            let paused = tokio::time::Instant::now();
            level.drained().await;
            inbound.postpone(paused.elapsed());
        }
        // Wait with no buffer; take one once bytes are there. A client waits at most its
        // idle timeout, and a partial message at most what is left of its deadline.
        let now = tokio::time::Instant::now().into_std();
        inbound.settle(now);
        let idle_until = is_client.then(|| now + shared.current.load().idle);
        let more = if R::WAITS_WITHOUT_BUFFER {
            read_when_ready(&mut read, &mut inbound, idle_until).await
        } else {
            read_holding_buffer(&mut read, &mut inbound, idle_until).await
        };
        match more {
            More::Bytes => {}
            More::Closed => return,
            More::TimedOut => {
                if inbound.is_overdue(tokio::time::Instant::now().into_std()) {
                    bump(&shared.counters.framing_errors);
                    if shared.log.allow(shared.now()) {
                        tracing::info!(vserver = %shared.name, src = %peer.src, "closing stream: a message did not arrive whole in time");
                    }
                }
                return;
            }
        }
    }
}

/// How long, and for how many bytes at most, a connection closed after fulcrum answered a
/// message past the size limit is still read: closing with unread bytes resets it (RFC 1122
/// §4.2.2.13), which may discard the answer before the client has read it.
pub(super) const LINGER: Duration = Duration::from_secs(1);
pub(super) const LINGER_BYTES: usize = 1 << 20;

/// What framing the buffered bytes came to.
enum Framed {
    /// Every whole frame was handed on: read more.
    ReadMore,
    /// A framing error: the stream must close.
    Close,
    /// A message past the size limit, answered: the stream must close once the client had
    /// the time to read the answer ([`linger`]).
    Answered,
}

/// Read and throw away what the client still sends, until it closes, [`LINGER`] passes or
/// [`LINGER_BYTES`] arrived, while its writer sends the answer ([`Framed::Answered`]).
async fn linger<R: StreamRead>(read: &mut R, inbound: &mut Inbound) {
    let until = tokio::time::Instant::now() + LINGER;
    let mut discarded = 0;
    while discarded < LINGER_BYTES {
        inbound.discard();
        match tokio::time::timeout_at(until, read.read_buf(inbound.read_buf())).await {
            Ok(Ok(n)) if n > 0 => discarded += n,
            _ => return,
        }
    }
}

/// Frame everything already buffered (several messages may arrive in one read) and hand each
/// message to the current core, answer pings; see [`Framed`] for what comes after a framing
/// error. Rewritten messages are built in a per-thread buffer and copied out.
fn frame_buffered(
    shared: &SipStreamShared,
    inbound: &mut Inbound,
    peer: &Peer<'_>,
    reader: &Reader,
) -> Framed {
    loop {
        match inbound.frame() {
            Ok(Some(frame)) => {
                let len = frame.len();
                match frame {
                    Frame::Message { .. } => OUT.with_borrow_mut(|out| {
                        if let Some(h) = peer.heard.filter(|h| !h.load(Ordering::Relaxed)) {
                            h.store(true, Ordering::Relaxed);
                        }
                        let at = shared.tap.stamp();
                        let now = shared.now();
                        if let Some(a) = peer.activity {
                            a.touch(now, true);
                        }
                        let _in = reader.enter();
                        let g = shared.current.load();
                        let msg = inbound.front(len);
                        if let Some(a) = peer.activity
                            && g.core.registers_flow(msg)
                        {
                            a.mark_registered();
                        }
                        if let Some(link) = peer.link
                            && is_answer(msg)
                            && let Some(m) = g.index_of(link)
                        {
                            g.core.balancer().report_success(m, now);
                        }
                        let mut sends = Vec::new();
                        let d = g.core.decide_stateful(
                            msg,
                            peer.origin,
                            peer.src,
                            peer.dst,
                            now,
                            out,
                            &mut sends,
                        );
                        let (call_id, queued) = handed_on(at, &d, &sends);
                        if let Some(at) = at
                            && crate::proxy::sip_front::is_captured(&d.action)
                        {
                            let leg = (crate::capture::Transport::Tcp, peer.src, peer.dst);
                            shared.tap.tap_as(at, leg, msg, call_id);
                        }
                        // A held request's own messages first: an INVITE's 100 (Trying)
                        // goes to the client before what the service answers.
                        shared.carry_sends(&g, sends, &queued);
                        shared.dispatch(&g, d.action, out, peer.origin, peer.reply, &queued);
                    }),
                    Frame::Ping => {
                        bump(&shared.counters.keepalive_pings);
                        if let Some(a) = peer.activity {
                            a.touch(shared.now(), false);
                        }
                        shared.reply(peer.reply, Bytes::from_static(PONG).into());
                    }
                    Frame::Pong => {}
                }
                inbound.consume(len);
            }
            Ok(None) => return Framed::ReadMore,
            Err(e) => {
                bump(&shared.counters.framing_errors);
                if shared.log.allow(shared.now()) {
                    tracing::info!(vserver = %shared.name, src = %peer.src, error = %e, "closing stream after framing error");
                }
                if e != FrameError::TooLarge {
                    return Framed::Close;
                }
                // Past the size limit: the core counts it and may answer 513 before the close.
                let answered = OUT.with_borrow_mut(|out| {
                    let g = shared.current.load();
                    let action = g.core.too_large(inbound.head(), peer.origin, peer.src, out);
                    let answered = matches!(action, Action::Reply(_));
                    let found = CallIdBuf::Find;
                    shared.dispatch(&g, action, out, peer.origin, peer.reply, &found);
                    answered
                });
                return if answered {
                    Framed::Answered
                } else {
                    Framed::Close
                };
            }
        }
    }
}

/// The Call-ID the core's scan read in a message (`d`), for the capture of the message and,
/// copied once, of what is queued of it and for it ([`Outgoing`]), when the message is
/// captured (`at` taken): with capture off or the collector down, nothing is copied.
pub(super) fn handed_on<'a>(
    at: Option<crate::capture::Stamp>,
    d: &crate::core::sip::Decision<'a>,
    sends: &[crate::core::sip::stateful::Send],
) -> (CallId<'a>, CallIdBuf) {
    if !at.is_some_and(crate::capture::Stamp::is_taken) {
        return (CallId::Find, CallIdBuf::Find);
    }
    let call_id = crate::proxy::sip_front::handed(d.call_id);
    // A message dropped (or absorbed) with nothing sent for it queues nothing.
    let queued = if matches!(d.action, Action::Drop(_)) && sends.is_empty() {
        CallIdBuf::Find
    } else {
        CallIdBuf::of(call_id)
    };
    (call_id, queued)
}

/// Whether a service's message is an answer that shows it working, a success for passive
/// ejection (docs/ejection.md): a response of any class but 5xx (RFC 3261 §21.5, server
/// failure; which of those count as failures the SIP failover decides and reports).
fn is_answer(msg: &[u8]) -> bool {
    scan::is_response(msg) && msg.get(8).is_some_and(|c| matches!(c, b'1'..=b'4' | b'6'))
}

/// How a wait for more bytes ended.
enum More {
    /// Bytes were read into the buffer (or a read may be tried again).
    Bytes,
    /// The peer closed the stream, or it failed.
    Closed,
    /// The idle timeout or the deadline of the message under way passed.
    TimedOut,
}

/// TLS: the read waits, with the buffer, until `idle_until` or the message's deadline.
async fn read_holding_buffer<R: StreamRead>(
    read: &mut R,
    inbound: &mut Inbound,
    idle_until: Option<Instant>,
) -> More {
    let until = inbound.wait_until(idle_until);
    let read_once = read.read_buf(inbound.idle_read_buf());
    let got = match until {
        Some(u) => tokio::time::timeout_at(tokio::time::Instant::from_std(u), read_once)
            .await
            .ok(),
        None => Some(read_once.await),
    };
    match got {
        Some(Ok(0) | Err(_)) => More::Closed,
        Some(Ok(_)) => More::Bytes,
        None => More::TimedOut,
    }
}

/// TCP: wait for readiness without a buffer, then one read attempt.
async fn read_when_ready<R: StreamRead>(
    read: &mut R,
    inbound: &mut Inbound,
    idle_until: Option<Instant>,
) -> More {
    let ready = match inbound.wait_until(idle_until) {
        Some(u) => {
            tokio::time::timeout_at(tokio::time::Instant::from_std(u), read.readable()).await
        }
        None => Ok(read.readable().await),
    };
    match ready {
        Ok(Ok(())) => {}
        Ok(Err(_)) => return More::Closed,
        Err(_) => return More::TimedOut,
    }
    // One read attempt, never a wait with the buffer held: a readiness can be stale (a
    // fresh connection starts out readable), and then the attempt clears it and the loop
    // waits again without the buffer. A short read clears it too (the receive queue is
    // empty), so a burst costs one `recv`.
    let attempt = {
        let mut read_buf = std::pin::pin!(read.read_buf(inbound.read_buf()));
        std::future::poll_fn(|cx| std::task::Poll::Ready(read_buf.as_mut().poll(cx))).await
    };
    match attempt {
        std::task::Poll::Ready(Ok(0) | Err(_)) => More::Closed,
        std::task::Poll::Ready(Ok(_)) => More::Bytes,
        // Also what the read says once this task has used up its scheduling budget (the
        // readiness is then still set, and `readable` would not wait): give the thread
        // back before trying again, or a busy connection would spin on it.
        std::task::Poll::Pending => {
            tokio::task::yield_now().await;
            More::Bytes
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_that_show_a_service_working() {
        for ok in [
            &b"SIP/2.0 100 Trying\r\n"[..],
            b"SIP/2.0 200 OK\r\n",
            b"sip/2.0 486 Busy Here\r\n",
            b"SIP/2.0 603 Decline\r\n",
        ] {
            assert!(is_answer(ok), "{}", String::from_utf8_lossy(ok));
        }
        for not in [
            &b"SIP/2.0 503 Service Unavailable\r\n"[..],
            b"SIP/2.0 500 Server Internal Error\r\n",
            b"INVITE sip:a@b SIP/2.0\r\n",
            b"SIP/2.0 ",
            b"",
        ] {
            assert!(!is_answer(not), "{}", String::from_utf8_lossy(not));
        }
    }
}
