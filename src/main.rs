//! The `fulcrum` command line: arguments, tracing setup, config loading; the work is
//! handed to the library.

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use fulcrum::config::{self, Config, LogFormat};
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// jemalloc, not the C library's malloc: it gives freed pages back on demand
/// (src/memory.rs), where glibc's malloc kept most of what a burst of connections freed.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "fulcrum",
    version,
    about = "SIP-aware UDP/TCP load-balancing proxy"
)]
struct Cli {
    /// Log format (overrides `logging.format` of the config).
    #[arg(long, global = true, value_enum)]
    log_format: Option<CliLogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum CliLogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy until SIGTERM / Ctrl-C.
    Run {
        /// Config file.
        #[arg(long, short, default_value = "config/fulcrum.yaml")]
        config: PathBuf,
        /// On SIGTERM, how long established flows may drain before exit (e.g. 10s).
        #[arg(long, default_value = "10s", value_parser = parse_duration_arg)]
        drain_timeout: Duration,
    },
    /// Hash-distribution and slow-start tables from the real core, without sockets.
    Simulate {
        #[command(subcommand)]
        what: Simulate,
    },
    /// Self-contained run on loopback: built-in SIP backends, the proxy and a client load,
    /// with a live per-service table. Needs nothing installed.
    Demo {
        /// How long to run, e.g. 30s.
        #[arg(long, default_value = "30s", value_parser = parse_duration_arg)]
        duration: Duration,
        /// Offered calls per second.
        #[arg(long, default_value_t = 120)]
        rate: u32,
    },
    /// Validate a config file: exit 0 with a summary per vserver, or exit 2 with
    /// `FILE:LINE:COL: field.path: problem` lines on stderr.
    Check {
        /// Config files to check.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Which routing rule of a SIP vserver a SIP request (a file, or `-` for stdin) matches,
    /// its target, and the service its pool's method would choose on a fresh balancer (every
    /// service UP). Exit 0 when decided, 2 for a bad config or an unreadable message.
    Route {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long)]
        vserver: String,
        /// The message (`-`: standard input): a SIP request; an http vserver's request head;
        /// a tcp vserver's first bytes (a captured ClientHello), or none with --sni / --alpn.
        /// LF line ends are taken as CRLF (SIP, HTTP).
        message: Option<PathBuf>,
        /// tcp vservers: the TLS server name the client asks for (instead of a ClientHello).
        #[arg(long)]
        sni: Option<String>,
        /// tcp vservers: ALPN protocols, comma-separated (those the client offers; for a
        /// vserver with `tls`, give the one negotiated).
        #[arg(long)]
        alpn: Option<String>,
        /// The client's address (default: the top Via's received / sent-by).
        #[arg(long)]
        source: Option<std::net::SocketAddr>,
        /// The address it arrived on (default: the vserver's first bind address).
        #[arg(long)]
        local: Option<std::net::SocketAddr>,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum Simulate {
    /// Hash K synthetic Call-ID-like keys over N services (or over a config's vserver) and
    /// report balance, disruption, lookup time and memory.
    Hash {
        /// Default: the config's `lb.hash_algorithm` with --config, else carp.
        #[arg(long, value_enum)]
        algorithm: Option<CliAlgorithm>,
        /// Synthetic services (10.a.b.c:5060, weight 1); not with --config.
        #[arg(long, conflicts_with = "config")]
        services: Option<usize>,
        #[arg(long, default_value_t = 1_000_000)]
        keys: usize,
        /// Table resolution of prac / jarh (1..=1024). Default: the config's `lb.hash_fingers`
        /// with --config, else 256.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
        fingers: Option<u32>,
        /// prac's balance bound (1.005..=1.5): the largest share of a service over its fair
        /// share. Default: the config's `lb.prac_max_share` with --config, else 1.005.
        #[arg(long, value_parser = parse_max_share)]
        prac_max_share: Option<config::PracMaxShare>,
        /// Use the services (addresses, hash_id, weights) of a vserver of this config.
        #[arg(long)]
        config: Option<PathBuf>,
        /// The vserver of --config (may be left out when the config has one hashing vserver).
        #[arg(long, requires = "config")]
        vserver: Option<String>,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Which firewall a `protocol: ip` vserver of a config sends a flow to (and its reply),
    /// by the Rust twin of the kernel program.
    Flow {
        #[arg(long)]
        config: PathBuf,
        /// The packet vserver (may be left out when the config has one).
        #[arg(long)]
        vserver: Option<String>,
        #[arg(long)]
        src: std::net::IpAddr,
        #[arg(long)]
        dst: std::net::IpAddr,
        /// tcp, udp, sctp, icmp, icmpv6 or a protocol number.
        #[arg(long, default_value = "tcp")]
        proto: String,
        #[arg(long, requires = "dport")]
        sport: Option<u16>,
        #[arg(long, requires = "sport")]
        dport: Option<u16>,
        /// Services taken DOWN for the answer (comma-separated).
        #[arg(long, value_delimiter = ',')]
        down: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Run a slow-start scenario (YAML) and print requests per second per service.
    SlowStart {
        scenario: PathBuf,
        #[arg(long)]
        json: bool,
        /// Also write an SVG plot of the rates over time.
        #[arg(long)]
        plot: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum CliAlgorithm {
    Carp,
    Prac,
    Jarh,
}

/// `--prac-max-share`: a ratio in the range `lb.prac_max_share` accepts.
fn parse_max_share(s: &str) -> Result<config::PracMaxShare, String> {
    s.parse::<f64>()
        .ok()
        .and_then(config::PracMaxShare::from_ratio)
        .ok_or_else(|| {
            format!(
                "expected a number in {}..={}",
                config::PracMaxShare::DEFAULT.ratio(),
                config::PracMaxShare::MAX.ratio()
            )
        })
}

/// Exit status for an invalid config (README.md, "Command line"; docs/config.md, Checking a file).
const EXIT_INVALID: u8 = 2;

/// `print!` for the commands' output, ending the process quietly when the reader has gone
/// (`fulcrum check FILE | head`): exit status 141, as a shell shows a process ended by
/// SIGPIPE, where `print!` would panic (Rust ignores SIGPIPE, which the proxy wants).
macro_rules! out {
    ($($arg:tt)*) => {
        stdout_or_exit(|w| write!(w, $($arg)*))
    };
}

/// [`out!`] with a line end.
macro_rules! outln {
    ($($arg:tt)*) => {
        stdout_or_exit(|w| writeln!(w, $($arg)*))
    };
}

/// Write to stdout with `f`; exit 141 if stdout is a closed pipe, 74 (EX_IOERR) on another
/// write error.
fn stdout_or_exit(f: impl FnOnce(&mut std::io::StdoutLock<'_>) -> std::io::Result<()>) {
    let mut w = std::io::stdout().lock();
    if let Err(e) = f(&mut w).and_then(|()| std::io::Write::flush(&mut w)) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        eprintln!("fulcrum: stdout: {e}");
        std::process::exit(74);
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("fulcrum: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Check { files } => Ok(check(&files)),
        Command::Route {
            config: path,
            vserver,
            message,
            sni,
            alpn,
            source,
            local,
            json,
        } => route(
            &path,
            &vserver,
            (message.as_deref(), sni.as_deref(), alpn.as_deref()),
            (source, local),
            json,
        ),
        Command::Run {
            config: path,
            drain_timeout,
        } => {
            let cfg = match load_or_report(&path) {
                Ok(c) => c,
                Err(code) => return Ok(code),
            };
            init_tracing(cli.log_format, Some(&cfg))?;
            let name = path.display().to_string();
            for w in cfg.warning_lines(&name) {
                tracing::warn!("{w}");
            }
            run_proxy(cfg, path, drain_timeout)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Simulate { what } => simulate(what),
        Command::Demo { duration, rate } => {
            init_tracing(cli.log_format, None)?;
            let (stop_tx, stop) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                if wait_for_signal().is_ok() {
                    let _ = stop_tx.send(());
                }
            });
            let report = fulcrum::demo::run(fulcrum::demo::DemoOptions { duration, rate }, stop)?;
            Ok(if report.calls_ok > 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}

/// Set up tracing: `RUST_LOG` wins over the config's `logging.level`, which wins over `info`.
fn init_tracing(cli_format: Option<CliLogFormat>, config: Option<&Config>) -> anyhow::Result<()> {
    use tracing_subscriber::EnvFilter;
    let level = config
        .and_then(|c| c.logging.level.clone())
        .unwrap_or_else(|| "info".into());
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.is_empty() => EnvFilter::try_new(v).context("RUST_LOG")?,
        _ => EnvFilter::try_new(level).context("logging.level")?,
    };
    let json = match cli_format {
        Some(CliLogFormat::Json) => true,
        Some(CliLogFormat::Text) => false,
        None => config.is_some_and(|c| c.logging.format == LogFormat::Json),
    };
    // Colours only for a person at a terminal: a file, a pipe or journald gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
    Ok(())
}

fn parse_duration_arg(s: &str) -> Result<Duration, String> {
    config::parse_duration(s).ok_or_else(|| format!("`{s}` is not a duration such as 30s"))
}

/// Block until SIGTERM or SIGINT.
fn wait_for_signal() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    })?;
    Ok(())
}

/// Run until SIGTERM / Ctrl-C: admin API, monitors, SIGHUP reload, then a graceful drain.
fn run_proxy(cfg: Config, path: PathBuf, drain_timeout: Duration) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    // Handlers first: a SIGHUP or SIGTERM right after the `listening` lines (or READY) must
    // reload or drain, not kill the process with the default action.
    let signals = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut int, mut term, mut hup) = {
        let _in_runtime = signals.enter();
        (
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
            signal(SignalKind::hangup())?,
        )
    };
    let admin_addr = cfg.admin.listen;
    let ops = fulcrum::ops::Ops::start(cfg, Some(path)).context("starting vservers")?;
    ops.with_vservers(|vs, _| {
        for v in vs {
            tracing::info!(vserver = %v.name, bound = ?v.bound, "listening");
        }
    });
    if let Some(addr) = admin_addr {
        let (bound, _task) = ops
            .tokio()
            .block_on(fulcrum::admin::serve(Arc::clone(&ops), addr))
            .with_context(|| format!("admin API on {addr}"))?;
        tracing::info!(%bound, "admin API listening");
    }
    // Every vserver is bound (start failed otherwise) and the admin API listens.
    fulcrum::systemd::notify(fulcrum::systemd::State::Serving);
    if let Some(every) = fulcrum::systemd::watchdog_interval() {
        ops.start_watchdog(every);
    }
    signals.block_on(async {
        loop {
            tokio::select! {
                _ = int.recv() => return Ok::<(), anyhow::Error>(()),
                _ = term.recv() => return Ok(()),
                _ = hup.recv() => {
                    let ops = Arc::clone(&ops);
                    // Reload reads the file: off this signal loop.
                    let r = tokio::task::spawn_blocking(move || ops.reload()).await;
                    match r {
                        Ok(Ok(changes)) => tracing::info!(?changes, "SIGHUP: reloaded"),
                        Ok(Err(e)) => tracing::error!(error = %e, "SIGHUP: reload refused, nothing changed"),
                        Err(e) => tracing::error!(error = %e, "SIGHUP: reload task failed"),
                    }
                }
            }
        }
    })?;
    tracing::info!(drain_timeout = ?drain_timeout, "signal received: draining");
    // The drain tells the service manager it is stopping.
    let left = ops.drain(drain_timeout);
    if left > 0 {
        tracing::warn!(flows = left, "drain timeout: closing remaining flows");
    }
    ops.shutdown();
    tracing::info!("stopped");
    Ok(())
}

/// Load and validate the config at `path`; an invalid one is printed (file, line, field) and
/// becomes the invalid-config exit code.
fn load_or_report(path: &std::path::Path) -> Result<config::Config, ExitCode> {
    config::load(path).map_err(|e| {
        eprintln!("{e}");
        ExitCode::from(EXIT_INVALID)
    })
}

/// The vserver `simulate hash --config` reports on: the named one, else the only vserver with a
/// hash method.
fn pick_hash_vserver<'a>(
    cfg: &'a config::Config,
    name: Option<&str>,
) -> anyhow::Result<&'a config::Vserver> {
    let hashing: Vec<&config::Vserver> =
        cfg.vservers.iter().filter(|v| v.method.is_hash()).collect();
    let names = |list: &[&config::Vserver]| {
        list.iter()
            .map(|v| v.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let vs = match name {
        Some(name) => cfg
            .vservers
            .iter()
            .find(|v| v.name == name)
            .ok_or_else(|| anyhow::anyhow!("no vserver named {name:?} in the config"))?,
        None => match hashing.as_slice() {
            [one] => one,
            [] => anyhow::bail!("no vserver of this config uses a hash method"),
            _ => anyhow::bail!(
                "several vservers use a hash method ({}): choose one with --vserver",
                names(&hashing)
            ),
        },
    };
    anyhow::ensure!(
        vs.method.is_hash(),
        "vserver {:?} uses {}, which does not hash; hashing vservers: {}",
        vs.name,
        vs.method.name(),
        if hashing.is_empty() {
            "none".to_string()
        } else {
            names(&hashing)
        }
    );
    anyhow::ensure!(
        !vs.services.is_empty(),
        "vserver {:?} has no services",
        vs.name
    );
    Ok(vs)
}

fn simulate(what: Simulate) -> anyhow::Result<ExitCode> {
    use fulcrum::simulate::{hash, slow_start};
    match what {
        Simulate::Hash {
            algorithm,
            services,
            keys,
            fingers,
            prac_max_share,
            config: config_path,
            vserver,
            seed,
            json,
        } => {
            let algorithm = algorithm.map(|a| match a {
                CliAlgorithm::Carp => config::HashAlgorithm::Carp,
                CliAlgorithm::Prac => config::HashAlgorithm::Prac,
                CliAlgorithm::Jarh => config::HashAlgorithm::Jarh,
            });
            let report = if let Some(path) = config_path {
                let mut cfg = match load_or_report(&path) {
                    Ok(c) => c,
                    Err(code) => return Ok(code),
                };
                if let Some(m) = prac_max_share {
                    cfg.lb.prac_max_share = m;
                }
                // Pools in DNS: their members as the name has them now.
                let (cfg, _) = fulcrum::discovery::resolve::resolved(&cfg, 0);
                let vs = pick_hash_vserver(&cfg, vserver.as_deref())?;
                hash::simulate_config(
                    &cfg,
                    vs,
                    algorithm.unwrap_or(cfg.lb.hash_algorithm),
                    fingers.unwrap_or(cfg.lb.hash_fingers),
                    keys,
                    seed,
                )
            } else {
                let services = services.unwrap_or(1000);
                anyhow::ensure!(services >= 1, "--services must be at least 1");
                hash::simulate_hash(&hash::HashSimParams {
                    algorithm: algorithm.unwrap_or(config::HashAlgorithm::Carp),
                    services,
                    keys,
                    fingers: fingers.unwrap_or(256),
                    prac_max_share: prac_max_share.unwrap_or(config::PracMaxShare::DEFAULT),
                    seed,
                })
            };
            if json {
                outln!("{}", serde_json::to_string(&report)?);
            } else {
                out!("{}", hash::render_text(&report));
            }
        }
        Simulate::Flow {
            config: path,
            vserver,
            src,
            dst,
            proto,
            sport,
            dport,
            down,
            json,
        } => {
            let cfg = match load_or_report(&path) {
                Ok(c) => c,
                Err(code) => return Ok(code),
            };
            let packet: Vec<&config::Vserver> = cfg
                .vservers
                .iter()
                .filter(|v| v.protocol.is_packet())
                .collect();
            let vs = match vserver.as_deref() {
                Some(n) => cfg
                    .vservers
                    .iter()
                    .find(|v| v.name == n)
                    .ok_or_else(|| anyhow::anyhow!("no vserver named {n:?} in the config"))?,
                None => match packet.as_slice() {
                    [one] => one,
                    [] => anyhow::bail!("no `protocol: ip` vserver in this config"),
                    _ => {
                        anyhow::bail!("several `protocol: ip` vservers: choose one with --vserver")
                    }
                },
            };
            let q = fulcrum::simulate::flow::FlowQuery::parse(&proto, src, dst, sport.zip(dport))
                .map_err(|e| anyhow::anyhow!(e))?;
            let r = fulcrum::simulate::flow::which_firewall(&cfg, vs, &q, &down)
                .map_err(|e| anyhow::anyhow!(e))?;
            if json {
                outln!("{}", serde_json::to_string(&r)?);
            } else {
                let fw = |c: &fulcrum::simulate::flow::Choice| {
                    c.firewall
                        .clone()
                        .unwrap_or_else(|| "none (dropped: every firewall DOWN)".into())
                };
                outln!(
                    "vserver {} ({}): {src} -> {dst}: bucket {} -> {}; reply: bucket {} -> {}",
                    r.vserver,
                    r.method,
                    r.forward.bucket,
                    fw(&r.forward),
                    r.reply.bucket,
                    fw(&r.reply)
                );
            }
        }
        Simulate::SlowStart {
            scenario,
            json,
            plot,
        } => {
            let text = std::fs::read_to_string(&scenario)
                .with_context(|| format!("reading {}", scenario.display()))?;
            let result = match slow_start::run_scenario(&text) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("{}: {e}", scenario.display());
                    return Ok(ExitCode::from(EXIT_INVALID));
                }
            };
            if json {
                outln!("{}", slow_start::render_json(&result));
            } else {
                out!("{}", slow_start::render_table(&result));
            }
            if let Some(path) = plot {
                std::fs::write(&path, slow_start::render_svg(&result))
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `fulcrum route`: the shared decision ([`fulcrum::simulate::route::decide`], and
/// [`fulcrum::simulate::route::decide_connection`] for tcp and http vservers) on a balancer
/// built from the config.
fn route(
    path: &std::path::Path,
    name: &str,
    (message, sni, alpn): (Option<&std::path::Path>, Option<&str>, Option<&str>),
    (source, local): (Option<std::net::SocketAddr>, Option<std::net::SocketAddr>),
    json: bool,
) -> anyhow::Result<ExitCode> {
    use fulcrum::config::Protocol;
    use fulcrum::simulate::route as r;
    use std::io::Read;
    let invalid = |e: &dyn std::fmt::Display| {
        eprintln!("fulcrum: {e}");
        Ok(ExitCode::from(EXIT_INVALID))
    };
    let cfg = match load_or_report(path) {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    // Pools in DNS: their members as the name has them now.
    let (cfg, _) = fulcrum::discovery::resolve::resolved(&cfg, 0);
    let Some(vs) = cfg.vservers.iter().find(|v| v.name == name) else {
        return invalid(&format!("no vserver `{name}` in {}", path.display()));
    };
    let connection = matches!(vs.protocol, Protocol::Tcp | Protocol::Http);
    if (sni.is_some() || alpn.is_some()) && vs.protocol != Protocol::Tcp {
        return invalid(&"--sni and --alpn describe TLS on tcp vservers");
    }
    let mut text = Vec::new();
    match message {
        None if vs.protocol == Protocol::Tcp => {}
        None => return invalid(&"give the message file (or - for standard input)"),
        Some(m) => {
            let read = if m.as_os_str() == "-" {
                std::io::stdin().read_to_end(&mut text).map(|_| ())
            } else {
                std::fs::read(m).map(|t| text = t)
            };
            if let Err(e) = read {
                return invalid(&format!("reading {}: {e}", m.display()));
            }
        }
    }
    let Some(local) = local.or_else(|| vs.bind.first().copied()) else {
        return invalid(&format!("vserver `{name}` binds no address: give --local"));
    };
    let balancer = fulcrum::balancer::Balancer::new(&cfg, vs);
    let (answer, src) = if connection {
        let first = if vs.protocol == Protocol::Http {
            r::normalize_message(&text)
        } else {
            text
        };
        let alpn: Vec<Vec<u8>> = alpn
            .map(|a| a.split(',').map(|p| p.trim().as_bytes().to_vec()).collect())
            .unwrap_or_default();
        let handshake =
            (sni.is_some() || !alpn.is_empty()).then(|| fulcrum::core::tcp::Handshake {
                sni: sni.map(str::as_bytes),
                alpn: &alpn,
            });
        let src = source.unwrap_or_else(|| std::net::SocketAddr::from(([0, 0, 0, 0], 0)));
        let keys = fulcrum::core::tcp::ConnectionKeys::new(vs);
        let a = r::decide_connection(&balancer, &keys, name, &first, handshake, (src, local), 0);
        (a, src)
    } else {
        let bytes = r::normalize_message(&text);
        let msg = match r::scan_request(&bytes) {
            Ok(m) => m,
            Err(e) => {
                let file = message.map(|m| m.display().to_string()).unwrap_or_default();
                return invalid(&format!("{file}: {e}"));
            }
        };
        let src = source.unwrap_or_else(|| r::default_source(&msg));
        (r::decide(&balancer, name, &msg, src, local, 0), src)
    };
    match answer {
        Ok(a) if json => outln!("{}", serde_json::to_string(&a)?),
        Ok(a) => out!("{}", r::render_text(&a, src, local, true)),
        Err(e) => return invalid(&e),
    }
    Ok(ExitCode::SUCCESS)
}

fn check(files: &[PathBuf]) -> ExitCode {
    let mut ok = true;
    for file in files {
        match config::load(file) {
            Ok(cfg) => {
                // Warnings on stderr like problems, and the exit code left alone.
                let name = file.display().to_string();
                for w in cfg.warning_lines(&name) {
                    eprintln!("{w}");
                }
                outln!("{}: ok", file.display());
                for line in fulcrum::config::summary(&cfg) {
                    outln!("  {line}");
                }
            }
            Err(e) => {
                eprintln!("{e}");
                ok = false;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_INVALID)
    }
}
