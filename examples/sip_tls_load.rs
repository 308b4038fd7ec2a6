//! A SIP-over-TLS load generator for `bench/sip_tls.sh` (Debian's SIPp is built without TLS):
//! whole calls (INVITE, 100 / 180 / 200, ACK, BYE, 200; unique Call-IDs; the route set from
//! Record-Route) over N TLS connections, paced to a total call rate, the proxy's certificate
//! verified against a CA file.
//!
//! `sip_tls_load TARGET --ca FILE [--name NAME] [--conns N] [--rate R] [--secs S]
//! [--timeout-ms T] [--tag TAG]`
//!
//! Defaults: 4 connections, 1000 calls/s, 10 s, timeout 2000 ms, NAME = TARGET's IP (the
//! name the certificate must hold), TAG = pid and time (Call-IDs are `TAG-CONN-N`).
//! Connection k starts calls at t0 + (k + N·j)/R, j = 0, 1, ... (R·S calls in all, spread
//! evenly over the connections), then waits for the calls in progress (at most the timeout),
//! so a run lasts at most S + T + 1 s after the handshakes (each bounded by T).
//!
//! Prints one line:
//! `calls= completed= failed= failed_481= failed_status= failed_timeout= failed_closed=
//! late= stray= cps= setup_p50_us= setup_p99_us= bye_p50_us= bye_p99_us= max_us= wall_s= load_cpu_s=`
//! (cps: completed calls per second of the sending period or of the wall time, whichever is
//! longer; conns_lost: connections that ended under the calls, each also said on stderr with
//! its reason; load_cpu_s: its own CPU time, to tell its ceiling from the proxy's). Exit status 1 when a connection could not be set up.
//!
//! The call logic is the PURE call book of `tests/common/sip_load.rs` (tested with the real
//! strict UAS and fulcrum in `tests/sip_tls.rs`); this file is its IO shell: one tokio task
//! per connection on a current-thread runtime (the machine's cores belong to the proxies).
//!
//! Why an example and not a mode of `fulcrum-load`: that binary is a mio loop of datagrams
//! and idle sockets, while this one wants tokio-rustls and the call book the tests already
//! check; as an example it reuses that code by path, like `examples/strict_uas.rs`.

#[allow(dead_code)]
#[path = "../tests/common/sip_load.rs"]
mod sip_load;

use anyhow::{Context, bail};
use fulcrum::sip::{DEFAULT_MAX_MESSAGE, Frame, FrameError, next_frame};
use sip_load::{CallBook, Tally, quantile};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

struct Args {
    target: SocketAddr,
    ca: PathBuf,
    name: Option<String>,
    conns: u64,
    rate: u64,
    secs: u64,
    timeout: Duration,
    tag: String,
}

fn parse() -> anyhow::Result<Args> {
    let usage = "usage: sip_tls_load TARGET --ca FILE [--name NAME] [--conns N] [--rate R] [--secs S] [--timeout-ms T] [--tag TAG]";
    let mut it = std::env::args().skip(1);
    let target = it.next().context(usage)?.parse().context("TARGET")?;
    let mut a = Args {
        target,
        ca: PathBuf::new(),
        name: None,
        conns: 4,
        rate: 1000,
        secs: 10,
        timeout: Duration::from_millis(2000),
        tag: format!("{}-{}", std::process::id(), unix_ms()),
    };
    while let Some(flag) = it.next() {
        let v = it.next().with_context(|| format!("{flag} needs a value"))?;
        let n = || v.parse::<u64>().with_context(|| flag.clone());
        match flag.as_str() {
            "--ca" => a.ca = PathBuf::from(&v),
            "--name" => a.name = Some(v.clone()),
            "--conns" => a.conns = n()?.clamp(1, 10_000),
            "--rate" => a.rate = n()?.clamp(1, 1_000_000),
            "--secs" => a.secs = n()?.clamp(1, 3_600),
            "--timeout-ms" => a.timeout = Duration::from_millis(n()?.clamp(1, 60_000)),
            "--tag" => a.tag = v.clone(),
            _ => bail!("unknown option {flag}\n{usage}"),
        }
    }
    if a.ca.as_os_str().is_empty() {
        bail!("--ca is required\n{usage}");
    }
    Ok(a)
}

fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

async fn connect(
    a: &Args,
    tls: &TlsConnector,
    name: &rustls::pki_types::ServerName<'static>,
) -> anyhow::Result<(TlsStream<TcpStream>, SocketAddr)> {
    let sock = tokio::time::timeout(a.timeout, TcpStream::connect(a.target))
        .await
        .context("connect: timeout")??;
    sock.set_nodelay(true)?;
    let local = sock.local_addr()?;
    let s = tokio::time::timeout(a.timeout, tls.connect(name.clone(), sock))
        .await
        .context("handshake: timeout")??;
    Ok((s, local))
}

/// What one connection's task is to do.
struct Plan {
    /// This connection's index (k) and the number of connections (N).
    k: u64,
    n: u64,
    /// Calls of the whole run (R·S) and the total rate.
    total: u64,
    rate: u64,
    t0: tokio::time::Instant,
    /// No call starts after this, and the task ends by `end`.
    end: tokio::time::Instant,
    tag: String,
}

impl Plan {
    /// When this connection's `j`-th call starts, if it is one of the run's.
    fn due(&self, j: u64) -> Option<tokio::time::Instant> {
        let i = self.k + self.n * j;
        (i < self.total).then(|| self.t0 + Duration::from_nanos(i * 1_000_000_000 / self.rate))
    }
}

/// Write some of `buf`, or flush when it is empty: one future, so that a select loop can
/// poll it beside a read (both halves of the stream are cancel-safe here: a write that
/// returns Pending has taken nothing, a flush can be polled again).
async fn write_or_flush<W: AsyncWrite + Unpin>(w: &mut W, buf: &[u8]) -> std::io::Result<usize> {
    if buf.is_empty() {
        w.flush().await.map(|()| 0)
    } else {
        w.write(buf).await
    }
}

async fn drive(s: TlsStream<TcpStream>, mut book: CallBook, p: Plan) -> Tally {
    // Reading goes on while a write waits (a burst of requests after a stall must not stop
    // the responses from being read: the proxy would rightly take this for a client that
    // does not read).
    let (mut rd, mut wr) = tokio::io::split(s);
    let mut rbuf: Vec<u8> = Vec::with_capacity(65_536);
    // Requests to send: `out[written..]` is not written yet; `dirty`: written but maybe not
    // flushed out of the TLS layer.
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    let (mut written, mut dirty) = (0usize, false);
    let mut j = 0u64;
    // Why the connection ended under the calls, if it did.
    let mut lost: Option<String> = None;
    let mut next_expiry = tokio::time::Instant::now() + Duration::from_millis(100);
    loop {
        let due = p.due(j);
        if due.is_none() && book.in_progress() == 0 {
            break;
        }
        if tokio::time::Instant::now() >= p.end {
            break;
        }
        let wake = due.map_or(next_expiry, |d| d.min(next_expiry)).min(p.end);
        let pending = written < out.len();
        tokio::select! {
            r = rd.read_buf(&mut rbuf) => match r {
                Ok(0) => { lost = Some("closed by the proxy".into()); break; }
                Err(e) => { lost = Some(format!("read: {e}")); break; }
                Ok(_) => {
                    let now = Instant::now();
                    loop {
                        match next_frame(&rbuf, DEFAULT_MAX_MESSAGE) {
                            Ok(Frame::Message { len, .. }) => {
                                book.on_message(&rbuf[..len], now, &mut out);
                                rbuf.drain(..len);
                            }
                            Ok(f) => { rbuf.drain(..f.len()); }
                            Err(FrameError::Incomplete) => break,
                            // A stream that does not frame cannot be read on.
                            Err(e) => { lost = Some(format!("framing: {e}")); break; }
                        }
                    }
                    if lost.is_some() { break; }
                }
            },
            r = write_or_flush(&mut wr, &out[written..]), if pending || dirty => match r {
                // Nothing was left to write: the TLS layer is flushed.
                Ok(0) if !pending => dirty = false,
                Ok(0) => { lost = Some("write: closed".into()); break; }
                Ok(n) => {
                    written += n;
                    dirty = true;
                    if written == out.len() {
                        out.clear();
                        written = 0;
                    }
                }
                Err(e) => { lost = Some(format!("write: {e}")); break; }
            },
            () = tokio::time::sleep_until(wake) => {
                let now = tokio::time::Instant::now();
                while let Some(d) = p.due(j) {
                    if d > now { break; }
                    let call_id = format!("{}-{}-{}", p.tag, p.k, j);
                    book.start(&call_id, now.into_std(), &mut out);
                    j += 1;
                }
                if now >= next_expiry {
                    book.expire(now.into_std());
                    next_expiry = now + Duration::from_millis(100);
                }
            }
        }
    }
    // Calls still in progress at the end had no answer in time; on a closed connection they
    // never will.
    if let Some(why) = lost {
        eprintln!(
            "sip_tls_load: connection {} ended with {} calls in progress: {why}",
            p.k,
            book.in_progress()
        );
        book.close();
        book.tally.conns_lost += 1;
    } else {
        book.expire(Instant::now() + Duration::from_secs(3_600));
        let _ = wr.shutdown().await;
    }
    // Calls of this connection never started (the connection or the run's time ended first)
    // fail too.
    book.tally.unstarted += (j..).take_while(|&j| p.due(j).is_some()).count() as u64;
    book.tally
}

fn main() -> anyhow::Result<()> {
    let a = parse()?;
    let tls = fulcrum::tls::client_config(&fulcrum::tls::ClientFiles {
        ca: &a.ca,
        cert: None,
        key: None,
    })?;
    let name = fulcrum::tls::server_name(a.name.as_deref(), a.target.ip())
        .context("--name is neither a DNS name nor an IP address")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let connector = TlsConnector::from(Arc::clone(&tls));
        let mut conns = Vec::new();
        for _ in 0..a.conns {
            conns.push(connect(&a, &connector, &name).await?);
        }
        let t0 = tokio::time::Instant::now() + Duration::from_millis(50);
        let total = a.rate * a.secs;
        let end = t0 + Duration::from_secs(a.secs) + a.timeout + Duration::from_secs(1);
        let mut tasks = Vec::new();
        for (k, (s, local)) in conns.into_iter().enumerate() {
            let plan = Plan {
                k: k as u64,
                n: a.conns,
                total,
                rate: a.rate,
                t0,
                end,
                tag: a.tag.clone(),
            };
            let book = CallBook::new(local, "TLS", a.timeout);
            tasks.push(tokio::spawn(drive(s, book, plan)));
        }
        let mut t = Tally::default();
        for task in tasks {
            t.merge(task.await?);
        }
        let wall = t0.elapsed().as_secs_f64();
        // Its own CPU, so a run can tell the load generator's ceiling from the proxy's.
        let cpu = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
            .map_or(0.0, |u| {
                let t = |v: nix::sys::time::TimeVal| v.tv_sec() as f64 + v.tv_usec() as f64 / 1e6;
                t(u.user_time()) + t(u.system_time())
            });
        t.setup_us.sort_unstable();
        t.bye_us.sort_unstable();
        let max = t
            .setup_us
            .last()
            .copied()
            .unwrap_or(0)
            .max(t.bye_us.last().copied().unwrap_or(0));
        println!(
            "calls={} completed={} failed={} failed_481={} failed_status={} failed_timeout={} failed_closed={} unstarted={} late={} stray={} conns_lost={} cps={:.0} setup_p50_us={} setup_p99_us={} bye_p50_us={} bye_p99_us={} max_us={} wall_s={:.2} load_cpu_s={:.2}",
            t.started + t.unstarted,
            t.completed,
            t.failed(),
            t.failed_481,
            t.failed_status,
            t.failed_timeout,
            t.failed_closed,
            t.unstarted,
            t.late,
            t.stray,
            t.conns_lost,
            t.completed as f64 / wall.max(a.secs as f64),
            quantile(&t.setup_us, 0.5),
            quantile(&t.setup_us, 0.99),
            quantile(&t.bye_us, 0.5),
            quantile(&t.bye_us, 0.99),
            max,
            wall,
            cpu
        );
        anyhow::Ok(())
    })
}
