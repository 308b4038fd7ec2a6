//! Packet vservers (`protocol: ip`, docs/firewall.md): packets forwarded unchanged at the IP
//! layer by a kernel program, only their Ethernet addresses rewritten. IO.
//!
//! [`start`] loads and attaches the vserver's tc program ([`crate::bpf::PacketVserver`]) and
//! gives it a handle like any other vserver's: a balancer that the monitors and the operator
//! set health on, as for every service, and a data path whose counters the admin API reads.
//! One thread per packet vserver follows the balancer: when the set of usable firewalls
//! changes it installs the selector's new bucket table (only the buckets of a firewall that
//! left or came back move), and it copies the program's counters out for the metrics.
//!
//! Where the kernel refuses the program (no BPF permission, no such interface), [`start`]
//! fails with the reason and [`super::Runtime::start`] starts the other vservers beside it.
//!
//! The program and its maps stay attached when fulcrum stops or dies (they are pinned under
//! [`crate::bpf::PIN_ROOT`]): packets keep flowing with the last table while fulcrum is
//! restarted, and the next start replaces the program in place. Removing the pin directory
//! (`/sys/fs/bpf/fulcrum/<vserver>`) detaches it by hand.

use crate::balancer::Balancer;
use crate::bpf::{Counters, Firewall, PacketVserver};
use crate::config::{Config, Protocol, Vserver};
use crate::edge::Edge;
use crate::packet::{PassReason, PathConfig};
use crate::proxy::context::{
    DataPath, Prepared, Rebuild, RebuildCx, RuntimeError, StartCtx, VserverHandle,
};
use crate::proxy::reconfig;
use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the follower thread looks at the firewalls' health: a DOWN firewall's buckets
/// move within this of the monitor's verdict.
const FOLLOW: Duration = Duration::from_millis(50);
/// The follower's beat as the watchdog expects it: a table install is 4,097 map writes,
/// which a loaded machine may stretch well past [`FOLLOW`].
const HEART: Duration = Duration::from_secs(2);
/// How often (in rounds of [`FOLLOW`]) the program's counters are copied out.
const COUNT_EVERY: u32 = 20;

/// The firewall legs of vserver `v`: one per member, with the index (into
/// [`Config::services`]) of its service. (A leg with an IPv6 address carries both families:
/// an IPv4 packet may take an IPv6 next hop, RFC 8950; one with an IPv4 address drops IPv6
/// packets, counted `no_next_hop`.)
pub(crate) fn legs(config: &Config, v: &Vserver) -> Result<Vec<(Firewall, usize)>, String> {
    let mut out = Vec::new();
    for &i in &v.services {
        let Some(s) = config.services.get(i) else {
            continue;
        };
        let Some(interface) = s.interface.as_deref() else {
            return Err(format!("service `{}` has no `interface`", s.name));
        };
        out.push((Firewall::of(s, interface), i));
    }
    Ok(out)
}

/// The program's counters as the admin API reads them, copied from the kernel by the
/// follower thread.
#[derive(Debug, Default)]
pub(crate) struct PacketCounters {
    /// Passed to the stack, per [`PassReason::ALL`].
    pub passed: [AtomicU64; 5],
    pub dropped_no_firewall: AtomicU64,
    pub dropped_no_next_hop: AtomicU64,
    /// Table installs (the usable set changed) and buckets moved by them.
    pub tables: AtomicU64,
    pub buckets_moved: AtomicU64,
}

impl PacketCounters {
    fn store(&self, c: &Counters) {
        for (slot, reason) in self.passed.iter().zip(PassReason::ALL) {
            slot.store(c.passed(reason).packets, Ordering::Relaxed);
        }
        self.dropped_no_firewall
            .store(c.dropped_no_firewall.packets, Ordering::Relaxed);
        self.dropped_no_next_hop
            .store(c.dropped_no_next_hop.packets, Ordering::Relaxed);
    }
}

/// What the follower thread and the handle share.
#[derive(Debug)]
struct Shared {
    name: String,
    program: Mutex<Program>,
    balancer: ArcSwap<Balancer>,
    counters: Arc<PacketCounters>,
}

/// The loaded program with what the follower needs to read the balancer.
#[derive(Debug)]
struct Program {
    vserver: PacketVserver,
    /// The method and masks the program hashes with.
    path: PathConfig,
    interfaces: Vec<String>,
    /// Each leg's service, as an index into `Config::services`.
    services: Vec<usize>,
    /// Each leg's service name.
    names: Vec<String>,
    /// The usable set the table was built for.
    up: Vec<bool>,
    /// Each leg's forwarded (packets, bytes) as last read from this program, so that the
    /// services' traffic counters grow by the difference (`/status` shows them too).
    forwarded: Vec<(u64, u64)>,
}

impl Program {
    /// The balancer's member for leg `leg`'s service.
    fn member(&self, b: &Balancer, leg: usize) -> Option<usize> {
        let s = *self.services.get(leg)?;
        b.members().iter().position(|m| m.service == s)
    }

    /// Add what each leg forwarded since the last read to its service's traffic counters
    /// (`fulcrum_packets_total`, `fulcrum_bytes_total`, `/status`).
    fn charge(&mut self, b: &Balancer, c: &Counters, now: crate::stats::Nanos) {
        for (leg, now_fwd) in c.forwarded.iter().enumerate().take(self.forwarded.len()) {
            let last = self.forwarded[leg];
            let dp = now_fwd.packets.saturating_sub(last.0);
            let db = now_fwd.bytes.saturating_sub(last.1);
            self.forwarded[leg] = (now_fwd.packets, now_fwd.bytes);
            if let Some(counters) = self.member(b, leg).and_then(|m| b.counters(m))
                && dp > 0
            {
                counters.record_traffic(db, dp, now);
            }
        }
    }

    /// Which legs the balancer would give a new flow.
    fn usable(&self, b: &Balancer, now: crate::stats::Nanos) -> Vec<bool> {
        (0..self.services.len())
            .map(|leg| self.member(b, leg).is_some_and(|m| b.is_usable(m, now)))
            .collect()
    }
}

/// A packet vserver's data path as the runtime and the admin API see it.
#[derive(Debug)]
pub(crate) struct PacketPath {
    shared: Arc<Shared>,
    edge: Edge,
}

impl PacketPath {
    /// The program's counters, as last copied from the kernel.
    pub(crate) fn counters(&self) -> &Arc<PacketCounters> {
        &self.shared.counters
    }

    /// The method and masks the program hashes with.
    pub(crate) fn path_config(&self) -> PathConfig {
        crate::sync::lock(&self.shared.program).path
    }

    /// The interfaces the program is attached to.
    pub(crate) fn interfaces(&self) -> Vec<String> {
        crate::sync::lock(&self.shared.program).interfaces.clone()
    }

    /// The live bucket table: the leg (1-based, 0 none) of each bucket.
    pub(crate) fn table(&self) -> Vec<u32> {
        crate::sync::lock(&self.shared.program)
            .vserver
            .table()
            .to_vec()
    }

    /// Each leg's forwarded (packets, bytes), as last read from the kernel.
    pub(crate) fn forwarded(&self) -> Vec<(u64, u64)> {
        crate::sync::lock(&self.shared.program).forwarded.clone()
    }

    /// Each leg's name, in slot order (slot `i + 1` is leg `i`).
    pub(crate) fn legs(&self) -> Vec<String> {
        crate::sync::lock(&self.shared.program).names.clone()
    }
}

fn setup(v: &Vserver, problem: impl std::fmt::Display) -> RuntimeError {
    let problem = problem.to_string();
    // The data path's own errors name the vserver too; once is enough.
    let own = format!("vserver {}: ", v.name);
    RuntimeError::Setup {
        vserver: v.name.clone(),
        problem: problem.strip_prefix(&own).unwrap_or(&problem).to_owned(),
    }
}

/// The method and masks of packet vserver `v`, or why it cannot hash packets.
pub(crate) fn path_of(v: &Vserver) -> Result<PathConfig, String> {
    PathConfig::of(v).ok_or_else(|| format!("method {} cannot hash packets", v.method.name()))
}

/// Load and attach the program of `v`, every firewall UP until its monitor says otherwise.
fn load(config: &Config, v: &Vserver) -> Result<Program, RuntimeError> {
    let path = path_of(v).map_err(|e| setup(v, e))?;
    let legs = legs(config, v).map_err(|e| setup(v, e))?;
    let firewalls: Vec<Firewall> = legs.iter().map(|(f, _)| f.clone()).collect();
    let up = vec![true; firewalls.len()];
    let vserver = PacketVserver::start(&v.name, &v.interfaces, &path, &config.lb, &firewalls, &up)
        .map_err(|e| setup(v, e))?;
    let names = legs
        .iter()
        .map(|&(_, i)| {
            config
                .services
                .get(i)
                .map_or_else(String::new, |s| s.name.clone())
        })
        .collect();
    Ok(Program {
        forwarded: vec![(0, 0); legs.len()],
        vserver,
        path,
        interfaces: v.interfaces.clone(),
        services: legs.into_iter().map(|(_, i)| i).collect(),
        names,
        up,
    })
}

/// Start packet vserver `v` of `config`: load and attach its program and start the thread
/// that follows its firewalls' health.
pub(crate) fn start(
    ctx: &mut StartCtx<'_>,
    config: &Config,
    v: &Vserver,
) -> Result<VserverHandle, RuntimeError> {
    if v.sticky {
        return Err(setup(
            v,
            "`sticky: true` is not carried by this build's packet program (flows follow the hash); set `sticky: false`",
        ));
    }
    let program = load(config, v)?;
    let balancer = Arc::new(Balancer::new(config, v));
    let shared = Arc::new(Shared {
        name: v.name.clone(),
        program: Mutex::new(program),
        balancer: ArcSwap::new(Arc::clone(&balancer)),
        counters: Arc::default(),
    });
    let follower = Arc::clone(&shared);
    let sleeper = ctx.shutdown.sleeper();
    let epoch = ctx.epoch;
    let heart = ctx.liveness.periodic(format!("{}-follower", v.name), HEART);
    let thread = std::thread::Builder::new()
        .name(format!("fulcrum-{}", v.name))
        .spawn(move || follow(&follower, epoch, &sleeper, &heart))
        .map_err(|e| setup(v, format!("cannot start its thread: {e}")))?;
    ctx.threads.push(thread);
    tracing::info!(vserver = %v.name, interfaces = ?v.interfaces, "packet vserver attached");
    Ok(VserverHandle::new(
        v.name.clone(),
        Protocol::Ip,
        Vec::new(),
        balancer,
        Arc::new(PacketPath {
            shared,
            edge: v.edge(None),
        }),
    ))
}

/// The follower: install a new table whenever the usable set changes, copy the counters.
fn follow(
    shared: &Shared,
    epoch: std::time::Instant,
    sleeper: &crate::proxy::shutdown::Sleeper,
    heart: &crate::liveness::Heart,
) {
    let mut round = 0u32;
    loop {
        heart.beat();
        let now = crate::proxy::context::elapsed_nanos(epoch);
        let b = shared.balancer.load_full();
        {
            let mut p = crate::sync::lock(&shared.program);
            let up = p.usable(&b, now);
            if up != p.up {
                match p.vserver.set_up(&up) {
                    Ok(moved) => {
                        shared.counters.tables.fetch_add(1, Ordering::Relaxed);
                        shared
                            .counters
                            .buckets_moved
                            .fetch_add(moved as u64, Ordering::Relaxed);
                        tracing::info!(vserver = %shared.name, up = ?up, moved, "firewall set changed: bucket table replaced");
                        p.up = up;
                    }
                    Err(e) => {
                        tracing::error!(vserver = %shared.name, error = %e, "bucket table not replaced; tried again");
                    }
                }
            }
            if round.is_multiple_of(COUNT_EVERY) {
                match p.vserver.counters() {
                    Ok(c) => {
                        shared.counters.store(&c);
                        p.charge(&b, &c, now);
                    }
                    Err(e) => tracing::debug!(vserver = %shared.name, error = %e, "counters"),
                }
            }
        }
        round = round.wrapping_add(1);
        if sleeper.sleep(FOLLOW) {
            return;
        }
    }
}

impl DataPath for PacketPath {
    fn edge(&self) -> &Edge {
        &self.edge
    }

    fn each_event(&self, visit: &mut dyn FnMut(&'static str, &AtomicU64)) {
        let c = &self.shared.counters;
        const PASSED: [&str; 5] = [
            "packets_passed_non_ip",
            "packets_passed_multicast",
            "packets_passed_link_local",
            "packets_passed_to_host",
            "packets_passed_malformed",
        ];
        for (name, n) in PASSED.iter().zip(&c.passed) {
            visit(name, n);
        }
        visit("packets_dropped_no_firewall", &c.dropped_no_firewall);
        visit("packets_dropped_no_next_hop", &c.dropped_no_next_hop);
        visit("bucket_tables_installed", &c.tables);
        visit("buckets_moved", &c.buckets_moved);
    }

    /// Checked aside: the method and every leg's interface. Installed: a new program with
    /// the new legs, method and table, put in place of the old one in its links.
    fn prepare(&self, config: &Config, v: &Vserver) -> Result<Prepared, RuntimeError> {
        path_of(v).map_err(|e| setup(v, e))?;
        let legs = legs(config, v).map_err(|e| setup(v, e))?;
        for (f, _) in &legs {
            nix::net::if_::if_nametoindex(f.interface.as_str())
                .map_err(|e| setup(v, format!("interface {}: {e}", f.interface)))?;
        }
        let balancer = Arc::new(Balancer::new(config, v));
        let shared = Arc::clone(&self.shared);
        let (config, v) = (config.clone(), v.clone());
        Ok(Prepared::new(move |cx: &RebuildCx<'_>| {
            let old = shared.balancer.load_full();
            let old_names = reconfig::names_of(&old);
            let added = reconfig::settle(&balancer, &old_names, cx.health_of, cx.now());
            // Loading cannot be done aside without attaching: on failure the old program
            // keeps forwarding with its table, and the log says why.
            match load(&config, &v) {
                Ok(program) => *crate::sync::lock(&shared.program) = program,
                Err(e) => {
                    tracing::error!(vserver = %v.name, error = %e, "packet vserver not rebuilt: it forwards as before")
                }
            }
            shared.balancer.store(Arc::clone(&balancer));
            Rebuild {
                rebuilt: reconfig::rebuilt(&old_names, &balancer, &added),
                balancer,
                data: Arc::new(PacketPath {
                    shared,
                    edge: v.edge(None),
                }),
            }
        }))
    }

    fn protocols(&self) -> &'static [Protocol] {
        &[Protocol::Ip]
    }
}
