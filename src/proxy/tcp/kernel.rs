//! A plain tcp / http connection relayed by the kernel ([`crate::sockmap`]) once its
//! service is chosen: user space keeps the sockets for the half-close, the idle timeout, a
//! drain's cut and the close, and reads the byte counts from `TCP_INFO`. IO.

use super::TcpCore;
use crate::budget::Activity;
use crate::config::{KernelRelay, Vserver};
use crate::sockmap::{self, Flow, Pair, Relay};
use crate::stats::{ServiceCounters, bump};
use socket2::SockRef;
use std::io;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::net::TcpStream;

/// Connections the kernel relays at once (two sockets each); beyond, the user-space relay.
const CAPACITY: u32 = 65_536;

/// How often the idle timeout and the byte counts are looked at while the kernel relays.
const CHECK_EVERY: Duration = Duration::from_secs(1);

static RELAY: OnceLock<Result<Arc<Relay>, String>> = OnceLock::new();

/// The process's relay: made and self-tested once ([`Relay::self_test`]), on the first
/// vserver that asks for it; why not, when it cannot be used here.
pub(crate) fn relay() -> &'static Result<Arc<Relay>, String> {
    RELAY.get_or_init(|| {
        let r = if forced() == Some(KernelRelay::Off) {
            Err("FULCRUM_KERNEL_RELAY=off".to_owned())
        } else {
            Relay::new(CAPACITY)
                .map_err(|e| format!("the kernel refuses the sockmap or its program: {e}"))
                .and_then(|r| {
                    r.self_test()
                        .map_err(|e| format!("the self-test failed: {e}"))
                        .map(|()| r)
                })
        };
        match &r {
            Ok(_) => tracing::info!("kernel relay ready: tcp connections are relayed in the kernel"),
            Err(why) => tracing::warn!(reason = %why, "kernel relay unavailable: the user-space relay is used"),
        }
        r
    })
}

/// `FULCRUM_KERNEL_RELAY=auto` or `=off` in the environment: every tcp / http vserver's
/// `kernel_relay`, whatever its config says (tests run whole files both ways with it; an
/// operator can turn the relay off everywhere at once).
fn forced() -> Option<KernelRelay> {
    let v = std::env::var("FULCRUM_KERNEL_RELAY").ok()?;
    KernelRelay::ALL
        .iter()
        .find(|(name, _)| *name == v)
        .map(|(_, k)| *k)
}

/// The relay a vserver uses: with `kernel_relay: auto`, without TLS, for a method that
/// needs no per-byte or per-response samples, where the self-test passed; else why not.
pub(crate) fn for_vserver(v: &Vserver) -> Result<Arc<Relay>, String> {
    let forced = forced();
    if forced == Some(KernelRelay::Off) {
        // Said once, by the relay that is not made.
        relay().clone()
    } else if forced.unwrap_or(v.kernel_relay) == KernelRelay::Off {
        Err("kernel_relay: off".to_owned())
    } else if v.tls.is_some() {
        Err("TLS is terminated here".to_owned())
    } else if v.method.samples_traffic() {
        Err(format!(
            "method {} samples every byte or response",
            v.method.name()
        ))
    } else {
        relay().clone()
    }
}

/// A connection in the kernel's hands: its pair in the maps and its sockets' counts when
/// it went in (bytes queued before the splice are counted after).
pub(crate) struct Spliced {
    pair: Pair,
    base: (Flow, Flow),
}

/// Hand `client` and `upstream` to the kernel; `None` (the user-space relay goes on) when
/// every slot is taken, a socket's counts cannot be read, or the splice fails.
pub(crate) fn splice(core: &TcpCore, client: &TcpStream, upstream: &TcpStream) -> Option<Spliced> {
    let relay = core.kernel.as_ref().ok()?;
    // Before the sockets go in: everything after is the kernel's to move.
    let base = (flow(client).ok()?, flow(upstream).ok()?);
    match relay.splice(client.as_raw_fd(), upstream.as_raw_fd()) {
        Ok(Some(pair)) => {
            bump(&core.counters.kernel_relayed);
            Some(Spliced { pair, base })
        }
        Ok(None) => None,
        // The service's socket is no longer established (the service closed at once): only
        // established sockets enter a sockmap; user space relays it.
        Err(e) if e.raw_os_error() == Some(nix::libc::EOPNOTSUPP) => None,
        Err(e) => {
            bump(&core.counters.kernel_relay_errors);
            if core.log.allow(core.now()) {
                tracing::warn!(vserver = %core.name, error = %e, "kernel relay: splice failed; the user-space relay takes the connection");
            }
            None
        }
    }
}

fn flow(s: &TcpStream) -> io::Result<Flow> {
    sockmap::flow(s.as_raw_fd())
}

/// What a readiness on a relayed socket means: its peer's FIN (end of file), a reset (an
/// error reading), or bytes the verdict program kept on this socket (a direction that stays
/// in user space, `sockmap` module doc), which are written on here (an error writing);
/// `kept` notes them.
async fn ended(from: &TcpStream, to: &TcpStream, kept: &AtomicBool) -> Result<(), Failed> {
    loop {
        from.readable().await.map_err(|_| Failed::Reading)?;
        // Read into the worker's scratch buffer: a copy is made only of bytes that came
        // (rare: a kept direction), not a buffer held per connection.
        let got = super::SCRATCH
            .with_borrow_mut(|buf| super::read_draining(from, buf).map(|n| buf[..n].to_vec()));
        match got {
            Ok(bytes) if bytes.is_empty() => return Ok(()),
            Ok(bytes) => {
                kept.store(true, Ordering::Relaxed);
                super::write_all(to, &bytes)
                    .await
                    .map_err(|_| Failed::Writing)?;
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => return Err(Failed::Reading),
        }
    }
}

/// Which side of a direction failed.
enum Failed {
    Reading,
    Writing,
}

/// After `from`'s FIN: wait until every byte `from` received since the splice was handed to
/// `to` (the kernel queues redirected bytes to it asynchronously, as fast as `to`'s peer
/// reads), then pass the half-close on, so the FIN cuts off no byte. Waits as long as bytes
/// keep moving; gives up (and passes the FIN) after `patience` without progress, or when
/// the counts cannot be read.
async fn pass_fin(from: &TcpStream, to: &TcpStream, base: (Flow, Flow), patience: Duration) {
    let mut pause = Duration::from_millis(1);
    let mut last_put = 0;
    let mut since = tokio::time::Instant::now();
    while let (Ok(f), Ok(t)) = (flow(from), flow(to)) {
        let got = f.received.saturating_sub(base.0.received);
        let put = t.written.saturating_sub(base.1.written);
        if put >= got {
            break;
        }
        if put > last_put {
            (last_put, since) = (put, tokio::time::Instant::now());
            pause = Duration::from_millis(1);
        } else if since.elapsed() >= patience {
            break;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
    let _ = SockRef::from(to).shutdown(Shutdown::Write);
}

/// One direction of a spliced connection, `from` → `to`: until `from`'s FIN has been passed
/// on; on a failure, the side that failed (`sides`: `from`'s, `to`'s).
async fn direction(
    core: &TcpCore,
    (from, to): (&TcpStream, &TcpStream),
    base: (Flow, Flow),
    kept: &AtomicBool,
    sides: (Side, Side),
) -> Result<(), Side> {
    match ended(from, to, kept).await {
        Ok(()) => {}
        Err(Failed::Reading) => return Err(sides.0),
        Err(Failed::Writing) => return Err(sides.1),
    }
    pass_fin(from, to, base, core.idle_timeout).await;
    Ok(())
}

/// Own a spliced connection until both sides ended, an error, the idle timeout, or `cut`
/// (a drain's deadline); count its bytes. The pair leaves the maps when this returns.
pub(crate) async fn own(
    core: &TcpCore,
    (client, upstream): (&TcpStream, &TcpStream),
    spliced: Spliced,
    counters: Option<&ServiceCounters>,
    activity: &Activity,
    cut: impl std::future::Future<Output = ()>,
) {
    let Spliced { pair, base } = spliced;
    activity.stamp().store(core.now(), Ordering::Relaxed);
    let kept = AtomicBool::new(false);
    let moved = Moved::default();
    moved.written.store(
        base.0.written.wrapping_add(base.1.written),
        Ordering::Relaxed,
    );
    // Reads both sockets' counts; books what moved since the last call; returns how long
    // nothing has moved either way, in milliseconds (0 when the counts cannot be read).
    let account = || {
        let (Ok(c), Ok(u)) = (flow(client), flow(upstream)) else {
            return 0;
        };
        let now_in = c.received.saturating_sub(base.0.received);
        let now_out = u.received.saturating_sub(base.1.received);
        let written = c.written.wrapping_add(u.written);
        let din = now_in.saturating_sub(moved.inbound.swap(now_in, Ordering::Relaxed));
        let dout = now_out.saturating_sub(moved.outbound.swap(now_out, Ordering::Relaxed));
        let wrote = moved.written.swap(written, Ordering::Relaxed) != written;
        let now = core.now();
        if din > 0 || dout > 0 || wrote {
            activity.touch(now, din > 0);
            moved.at.store(now, Ordering::Relaxed);
        }
        core.counters.bytes_in.fetch_add(din, Ordering::Relaxed);
        core.counters.bytes_out.fetch_add(dout, Ordering::Relaxed);
        if let Some(c) = counters {
            for d in [din, dout] {
                if d > 0 {
                    c.record_traffic(d, 1, now);
                }
            }
        }
        // The finer of the kernel's clock of the last byte received and ours of the last
        // movement seen (writes included: a slow reader still draining counts as activity).
        let ours = now.saturating_sub(moved.at.load(Ordering::Relaxed)) / 1_000_000;
        u64::from(c.idle_ms.min(u.idle_ms)).min(ours)
    };
    moved.at.store(core.now(), Ordering::Relaxed);
    let idle_ms = u64::try_from(core.idle_timeout.as_millis()).unwrap_or(u64::MAX);
    let watch = async {
        let mut tick = tokio::time::interval(CHECK_EVERY.min(core.idle_timeout));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            if account() >= idle_ms {
                return;
            }
        }
    };
    let both = async {
        tokio::try_join!(
            direction(
                core,
                (client, upstream),
                base,
                &kept,
                (Side::Client, Side::Service)
            ),
            direction(
                core,
                (upstream, client),
                (base.1, base.0),
                &kept,
                (Side::Service, Side::Client)
            ),
        )
    };
    tokio::select! {
        r = both => match r {
            Ok(_) => {}
            Err(Side::Client) => bump(&core.counters.client_errors),
            Err(Side::Service) => bump(&core.counters.service_errors),
        },
        () = watch => bump(&core.counters.idle_timeouts),
        // Counted by the drain that cut it.
        () = cut => {}
    }
    account();
    if kept.load(Ordering::Relaxed) {
        bump(&core.counters.kernel_relay_kept);
    }
    drop(pair);
}

/// What [`own`]'s accounting saw last: bytes each way, both sockets' written counts, and
/// when anything last moved.
#[derive(Default)]
struct Moved {
    inbound: AtomicU64,
    outbound: AtomicU64,
    written: AtomicU64,
    at: AtomicU64,
}

enum Side {
    Client,
    Service,
}
