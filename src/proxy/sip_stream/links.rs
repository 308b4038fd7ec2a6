//! Service links: the one connection per member a SIP stream vserver (or a sip-udp vserver's
//! bridge) keeps, driven by the pure [`Link`] machine: connect on demand with backoff,
//! write (ending a connection whose write makes no progress for the service's
//! `write_timeout`), read what the service sends, retire on reload, mark the service DOWN /
//! UP, and report failed connects and stalled writes (and, in the reader, answers) for
//! passive ejection (docs/ejection.md). IO.

use super::*;

/// The way to one member's connection task. A reload keeps the link of a member that stays
/// (same service name and address) and retires the others.
pub(super) struct ServiceLink {
    pub(super) name: String,
    pub(super) addr: SocketAddr,
    /// TLS toward the service (a sip-tls service's `tls`); a reload stores new certificates
    /// in it for the next connection.
    pub(super) tls: Option<Arc<crate::tls::TlsConnector>>,
    pub(super) tx: mpsc::Sender<Outgoing>,
    /// Reached over the vserver's UDP leg (a sip-udp member): no connection, no task.
    pub(super) udp: bool,
    pub(super) retired: AtomicBool,
    pub(super) retire: Notify,
    /// The service's `write_timeout` in nanoseconds (a reload may change it).
    write_timeout: AtomicU64,
}

impl ServiceLink {
    pub(super) fn new(
        name: &str,
        addr: SocketAddr,
        tls: Option<crate::tls::TlsConnector>,
        udp: bool,
    ) -> (Arc<ServiceLink>, mpsc::Receiver<Outgoing>) {
        let (tx, rx) = mpsc::channel(SERVICE_QUEUE);
        let link = ServiceLink {
            name: name.to_owned(),
            addr,
            tls: tls.map(Arc::new),
            tx,
            udp,
            retired: AtomicBool::new(false),
            retire: Notify::new(),
            write_timeout: AtomicU64::new(
                u64::try_from(crate::core::link::WRITE_TIMEOUT.as_nanos()).unwrap_or(u64::MAX),
            ),
        };
        (Arc::new(link), rx)
    }

    /// How long a write toward the service may make no progress (its `write_timeout`).
    pub(super) fn set_write_timeout(&self, d: std::time::Duration) {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.write_timeout.store(nanos, Ordering::Relaxed);
    }

    fn write_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.write_timeout.load(Ordering::Relaxed))
    }

    pub(super) fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        self.retire.notify_waiters();
    }

    pub(super) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Resolves once the link is retired (at once if it already is).
    pub(super) async fn retired(&self) {
        loop {
            // Created before the check: `notify_waiters` reaches it from here on.
            let wake = self.retire.notified();
            if self.is_retired() {
                return;
            }
            wake.await;
        }
    }
}

/// How long closing a service connection's write side (a TLS close_notify) may take.
pub(super) const CLOSE_LIMIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Own the connection over `link` (TCP, or TLS for a sip-tls service): see [`drive_link`].
pub(super) async fn service_loop(
    shared: Arc<SipStreamShared>,
    link: Arc<ServiceLink>,
    rx: mpsc::Receiver<Outgoing>,
) {
    match link.tls.clone() {
        Some(tls) => drive_link(shared, link, rx, TlsLinkConnector(tls)).await,
        None => drive_link(shared, link, rx, TcpConnector).await,
    }
}

/// The live connection of a link: the write half, the reader task, and the queue of what
/// fulcrum writes for the service itself (pongs, replies to its requests, and while it
/// drains, clients' responses to its in-dialog requests).
pub(super) struct LinkConn<W> {
    pub(super) write: W,
    /// fulcrum's end of the connection (what a capture names as the source of its writes).
    pub(super) local: SocketAddr,
    /// Ends with the connection too: a shutdown aborts the link's task, not its reader.
    pub(super) reader: AbortOnDrop,
    pub(super) replies: mpsc::Receiver<Outgoing>,
    /// A sender on `replies`, registered in `draining` while the connection drains.
    pub(super) drain_tx: mpsc::Sender<Outgoing>,
    /// Set by the reader once the service has sent anything.
    pub(super) heard: Arc<AtomicBool>,
}

/// Drive `link`'s [`Link`] machine: wait for what its phase allows (a queued request, the
/// connect, a write, a reply to write, the reader's end, the retirement, the next deadline),
/// feed it in with `now`, and carry out the actions it returns. The member's index, health
/// and failure reports are looked up in the current generation each time, so they follow
/// reloads.
pub(super) async fn drive_link<C: Connector>(
    shared: Arc<SipStreamShared>,
    link: Arc<ServiceLink>,
    mut rx: mpsc::Receiver<Outgoing>,
    connector: C,
) {
    let addr = link.addr;
    let mut machine: Link<Outgoing> = Link::new();
    let mut conn: Option<LinkConn<<C::Stream as SipStream>::Write>> = None;
    // The message of the write `machine` asked for.
    let mut writing: Option<Outgoing> = None;
    let mut actions = Vec::new();
    // The error of the connect that just failed, for what it says of the service.
    let mut connect_error: Option<std::io::Error> = None;
    // Requests chosen again and the service's state go to the current generation: marked as
    // messages, so a reload waits for them (never across an await).
    let reader = shared.readers.register();
    loop {
        let event = match machine.phase() {
            Phase::Idle => tokio::select! {
                msg = rx.recv() => queued(msg),
                () = link.retired() => LinkEvent::Retired,
            },
            // The connect first: a TLS handshake bounded by the same deadline as the timer
            // is counted as timed out rather than dropped uncounted.
            Phase::Connecting => tokio::select! {
                biased;
                r = connector.connect(addr, connect_deadline(&machine)) => match r {
                    Ok(stream) => {
                        conn = Some(open_link_conn(&shared, &link, stream));
                        LinkEvent::ConnectOk
                    }
                    Err(e) => {
                        connect_error = Some(e);
                        LinkEvent::ConnectFailed
                    }
                },
                () = sleep_until(machine.poll_timeout()) => LinkEvent::TimerFired,
                () = link.retired() => LinkEvent::Retired,
            },
            Phase::Backoff => tokio::select! {
                () = sleep_until(machine.poll_timeout()) => LinkEvent::TimerFired,
                () = link.retired() => LinkEvent::Retired,
            },
            // A write ends early only if the link is retired meanwhile (a removed service that
            // stopped reading must not hold the task and the requests queued behind it) or,
            // while draining, when the drain ends.
            Phase::Writing | Phase::DrainWriting => match (conn.as_mut(), writing.take()) {
                (Some(c), Some(b)) => tokio::select! {
                    r = write_captured(&mut c.write, &b, &shared.tap, c.local, addr) => if r.is_ok() { LinkEvent::WriteDone } else { LinkEvent::WriteFailed },
                    () = link.retired(), if !machine.is_retired() => LinkEvent::Retired,
                    () = sleep_until(machine.poll_timeout()) => LinkEvent::TimerFired,
                },
                _ => LinkEvent::WriteFailed,
            },
            Phase::Connected => match conn.as_mut() {
                Some(c) => tokio::select! {
                    msg = rx.recv() => queued(msg),
                    Some(b) = c.replies.recv() => LinkEvent::Reply(b),
                    _ = &mut c.reader.0 => LinkEvent::ReaderClosed,
                    () = link.retired() => LinkEvent::Retired,
                    () = sleep_until(machine.poll_timeout()) => LinkEvent::TimerFired,
                },
                None => LinkEvent::ReaderClosed,
            },
            Phase::Draining => match conn.as_mut() {
                Some(c) => tokio::select! {
                    Some(b) = c.replies.recv() => LinkEvent::Reply(b),
                    _ = &mut c.reader.0 => LinkEvent::ReaderClosed,
                    () = sleep_until(machine.poll_timeout()) => LinkEvent::TimerFired,
                },
                None => LinkEvent::ReaderClosed,
            },
            Phase::Closed => return,
        };
        let now = tokio::time::Instant::now().into_std();
        machine.set_write_timeout(link.write_timeout());
        if !machine.is_heard()
            && conn
                .as_ref()
                .is_some_and(|c| c.heard.load(Ordering::Relaxed))
        {
            machine.handle(now, LinkEvent::MessageRead, &mut actions);
        }
        let blame = failure_blame(&event, machine.phase(), connect_error.take());
        machine.handle(now, event, &mut actions);
        let io = LinkIo {
            shared: &shared,
            link: &link,
            reader: &reader,
        };
        if !io
            .carry_out(&mut actions, &mut rx, &mut conn, &mut writing, &blame)
            .await
        {
            return;
        }
    }
}

/// What a link's task acts on besides its machine: the vserver, the link and the reader its
/// messages are marked on.
struct LinkIo<'a> {
    shared: &'a Arc<SipStreamShared>,
    link: &'a Arc<ServiceLink>,
    reader: &'a crate::proxy::handover::Reader,
}

impl LinkIo<'_> {
    /// Carry out what the machine asked for, in order: writes to start, requests to choose
    /// again, the queue and the connection to close, a drain to begin or end, states and
    /// counters to report. False once the link is closed.
    async fn carry_out<W: AsyncWrite + Unpin>(
        &self,
        actions: &mut Vec<LinkAction<Outgoing>>,
        rx: &mut mpsc::Receiver<Outgoing>,
        conn: &mut Option<LinkConn<W>>,
        writing: &mut Option<Outgoing>,
        blame: &Blame,
    ) -> bool {
        let (shared, link, reader, addr) = (self.shared, self.link, self.reader, self.link.addr);
        for action in actions.drain(..) {
            match action {
                // The phase (Connecting) does it.
                LinkAction::Connect => {}
                LinkAction::Write(b) => *writing = Some(b),
                LinkAction::Redispatch(b) => {
                    let _in = reader.enter();
                    shared.redispatch(link, b);
                }
                LinkAction::RedispatchQueue => {
                    let _in = reader.enter();
                    shared.redispatch_queued(link, None, rx);
                }
                LinkAction::CloseQueue => rx.close(),
                LinkAction::Disconnect => *conn = None,
                LinkAction::StartDrain => {
                    if let Some(c) = conn.as_ref() {
                        shared.draining.insert(addr, c.drain_tx.clone());
                    }
                }
                LinkAction::EndDrain => {
                    if let Some(mut c) = conn.take() {
                        shared
                            .draining
                            .remove_if(&addr, |_, tx| tx.same_channel(&c.drain_tx));
                        c.reader.0.abort();
                        // Bounded: a TLS close_notify toward a service that stopped
                        // reading would wait for ever.
                        let _ = tokio::time::timeout(CLOSE_LIMIT, c.write.shutdown()).await;
                        tracing::debug!(vserver = %shared.name, service = %addr, "connection of a removed service closed");
                    }
                }
                LinkAction::Close => return false,
                reported => {
                    let _in = reader.enter();
                    report(shared, link, reported, blame);
                }
            }
        }
        true
    }
}

/// Carry out a link action that only reports: the service's state (DOWN, UP again, or
/// fulcrum's own trouble), and the link's counters and logs.
fn report(
    shared: &SipStreamShared,
    link: &ServiceLink,
    action: LinkAction<Outgoing>,
    blame: &Blame,
) {
    let addr = link.addr;
    match action {
        LinkAction::MarkDown => match blame {
            Blame::Service(cause) => mark_down(shared, link, *cause),
            Blame::Local => local_trouble(shared, link),
        },
        LinkAction::MarkUp => mark_up_again(shared, link),
        LinkAction::CountLost => bump(&shared.counters.service_connections_lost),
        LinkAction::CountRetired => bump(&shared.counters.services_retired),
        LinkAction::CountStalled => {
            bump(&shared.counters.service_writes_stalled);
            tracing::warn!(vserver = %shared.name, service = %addr, "a write made no progress for the service's write_timeout: connection closed, its requests chosen again");
        }
        LinkAction::Unexpected(event) => {
            bump(&shared.counters.link_unexpected_events);
            if shared.log.allow(shared.now()) {
                tracing::warn!(vserver = %shared.name, service = %addr, event, "service link got an event its phase does not wait for (ignored)");
            }
        }
        // The others change the link's connection or queue: `drive_link` carries them out.
        LinkAction::Connect
        | LinkAction::Write(_)
        | LinkAction::Redispatch(_)
        | LinkAction::RedispatchQueue
        | LinkAction::CloseQueue
        | LinkAction::Disconnect
        | LinkAction::StartDrain
        | LinkAction::EndDrain
        | LinkAction::Close => {}
    }
}

/// Whose a link failure is.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Blame {
    /// fulcrum's own: a connect that failed for want of a descriptor, buffer, memory or local
    /// port ([`crate::eject::is_local_error`]). The service is not marked DOWN, nor does its
    /// monitor or ejection hear of it.
    Local,
    /// The service's, for its monitor; for passive ejection too when the cause is known.
    Service(Option<Cause>),
}

/// Whose a link failure on `event` (in `phase`) is, should the machine mark the service
/// DOWN: a connect's error (fulcrum's own local errors are [`Blame::Local`]; an error of no
/// other kind is the TLS connector's failed handshake; another one that names no cause counts
/// for the monitor only), a connect that ran out of time, or else a connection the service
/// closed at once.
pub(super) fn failure_blame(
    event: &LinkEvent<Outgoing>,
    phase: Phase,
    connect_error: Option<std::io::Error>,
) -> Blame {
    match (event, phase, connect_error) {
        (LinkEvent::ConnectFailed, _, Some(e)) if crate::eject::is_local_error(&e) => Blame::Local,
        (LinkEvent::ConnectFailed, _, Some(e)) => Blame::Service(
            Cause::of_stream_error(&e)
                .or_else(|| (e.kind() == std::io::ErrorKind::Other).then_some(Cause::Handshake)),
        ),
        (LinkEvent::TimerFired, Phase::Connecting, _) => Blame::Service(Some(Cause::Timeout)),
        (LinkEvent::TimerFired, Phase::Writing, _) => Blame::Service(Some(Cause::WriteStalled)),
        _ => Blame::Service(Some(Cause::Refused)),
    }
}

pub(super) fn queued(msg: Option<Outgoing>) -> LinkEvent<Outgoing> {
    match msg {
        Some(b) => LinkEvent::Queued(b),
        None => LinkEvent::QueueClosed,
    }
}

/// Until when a connect of `machine` (connecting) may run: its timer's deadline.
pub(super) fn connect_deadline(machine: &Link<Outgoing>) -> std::time::Instant {
    let fallback = || std::time::Instant::now() + link::CONNECT_TIMEOUT;
    machine.poll_timeout().unwrap_or_else(fallback)
}

/// Until `t`, or for ever.
pub(super) async fn sleep_until(t: Option<std::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
        None => std::future::pending().await,
    }
}

/// Set up a new connection to `link`'s service: its options, and the reader task that hands
/// what the service sends to the current core.
pub(super) fn open_link_conn<S: SipStream>(
    shared: &Arc<SipStreamShared>,
    link: &Arc<ServiceLink>,
    stream: S,
) -> LinkConn<S::Write> {
    let addr = link.addr;
    if let Err(e) = stream.prepare_link()
        && shared.log.allow(shared.now())
    {
        tracing::debug!(vserver = %shared.name, service = %addr, error = %e, "cannot set TCP keepalive");
    }
    let dst = stream.local_addr().unwrap_or(addr);
    let (read, write) = stream.split();
    // Replies fulcrum makes to a service's request go back on this connection.
    let (reply_tx, replies) = mpsc::channel::<Outgoing>(LINK_REPLY_QUEUE);
    let drain_tx = reply_tx.clone();
    // The core reads a member origin only to tell a service from a client, so the index at
    // connect time serves for the life of the connection.
    let origin = Origin::Member(shared.current.load().index_of(link).unwrap_or(0));
    let heard = Arc::new(AtomicBool::new(false));
    let reader = AbortOnDrop(tokio::spawn({
        let shared = Arc::clone(shared);
        let heard = Arc::clone(&heard);
        let link = Arc::clone(link);
        async move {
            let peer = Peer {
                origin,
                src: addr,
                dst,
                reply: ReplyTo::Link(&reply_tx),
                heard: Some(&heard),
                queue: None,
                link: Some(&link),
                activity: None,
            };
            read_messages(&shared, read, peer).await;
        }
    }));
    LinkConn {
        write,
        local: dst,
        reader,
        replies,
        drain_tx,
        heard,
    }
}

/// [`write_out`] of one message to the service at `to`, captured (docs/capture.md) with the
/// time taken before the write once the write is done, and the Call-ID queued beside it.
async fn write_captured<W: AsyncWrite + Unpin>(
    write: &mut W,
    msg: &Outgoing,
    tap: &crate::capture::Tap,
    local: SocketAddr,
    to: SocketAddr,
) -> std::io::Result<()> {
    let at = tap.stamp();
    write_out(write, &msg.bytes).await?;
    if let Some(at) = at {
        let leg = (crate::capture::Transport::Tcp, local, to);
        tap.tap_as(at, leg, &msg.bytes, msg.call_id.as_call_id());
    }
    Ok(())
}

/// A connect to `link`'s service failed on fulcrum's own side: counted as a failed connect and
/// logged as fulcrum's trouble (once a second at most), the service left as it was.
pub(super) fn local_trouble(shared: &SipStreamShared, link: &ServiceLink) {
    bump(&shared.counters.service_connect_failures);
    if shared.log.allow(shared.now()) {
        tracing::warn!(vserver = %shared.name, service = %link.addr, "cannot connect for want of local resources (descriptors, buffers, memory or ports): the service is not marked DOWN");
    }
}

/// A connect to `link`'s service failed (or the connection closed at once): count it, report
/// it to the service's monitor and, when `cause` is the service's (not a local error), for
/// passive ejection, and mark the service DOWN (a member the operator took OUT_OF_SERVICE
/// stays so).
pub(super) fn mark_down(shared: &SipStreamShared, link: &ServiceLink, cause: Option<Cause>) {
    bump(&shared.counters.service_connect_failures);
    let g = shared.current.load();
    if let Some(m) = g.index_of(link) {
        let b = g.core.balancer();
        b.report_failure(m);
        if let Some(cause) = cause {
            b.report_failure_with(m, Failure::new(cause), shared.now());
        }
        // Checked against the current balancer: a reload may have built one that starts
        // this member UP again.
        if b.health(m) == Some(Health::Up) {
            b.set_health(m, Health::Down, shared.now());
            tracing::warn!(vserver = %shared.name, service = %link.addr, "cannot connect: service marked DOWN");
        }
    }
}

/// The service a failed connect marked DOWN has kept a connection for [`link::SHORT_LIVED`]: UP
/// again (unless something else, such as its monitor, has set it otherwise meanwhile).
pub(super) fn mark_up_again(shared: &SipStreamShared, link: &ServiceLink) {
    let g = shared.current.load();
    if let Some(m) = g.index_of(link)
        && g.core.balancer().health(m) == Some(Health::Down)
    {
        g.core.balancer().set_health(m, Health::Up, shared.now());
        tracing::info!(vserver = %shared.name, service = %link.addr, "connected again: service marked UP");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a link's failure tells of its service: local errors are fulcrum's, a TLS
    /// handshake (the connector's `Other` error) its own cause, a connect timer a timeout, a
    /// connection closed at once a refusal; an error naming nothing counts for the monitor.
    #[test]
    fn failure_blames() {
        let os = |e: nix::errno::Errno| Some(std::io::Error::from_raw_os_error(e as i32));
        let failed = LinkEvent::ConnectFailed;
        let connecting = Phase::Connecting;
        let service = |c| Blame::Service(Some(c));
        use nix::errno::Errno::{EACCES, EADDRNOTAVAIL, ECONNREFUSED, EMFILE, ENFILE, ENOBUFS};
        assert_eq!(
            failure_blame(&failed, connecting, os(ECONNREFUSED)),
            service(Cause::Refused)
        );
        for local in [EMFILE, ENFILE, ENOBUFS, EADDRNOTAVAIL] {
            assert_eq!(
                failure_blame(&failed, connecting, os(local)),
                Blame::Local,
                "{local}"
            );
        }
        assert_eq!(
            failure_blame(&failed, connecting, os(EACCES)),
            Blame::Service(None)
        );
        let tls = Some(std::io::Error::other("TLS handshake failed: unknown_ca"));
        assert_eq!(
            failure_blame(&failed, connecting, tls),
            service(Cause::Handshake)
        );
        assert_eq!(
            failure_blame(&LinkEvent::TimerFired, connecting, None),
            service(Cause::Timeout)
        );
        assert_eq!(
            failure_blame(&LinkEvent::TimerFired, Phase::Writing, None),
            service(Cause::WriteStalled)
        );
        assert_eq!(
            failure_blame(&LinkEvent::ReaderClosed, Phase::Connected, None),
            service(Cause::Refused)
        );
    }
}
