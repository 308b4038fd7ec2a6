//! The kernel side of a packet vserver (a pool of firewalls): a tc ingress BPF program that
//! forwards every IP packet not for this host to the firewall its bucket names, rewriting
//! only the Ethernet addresses (`bpf_redirect_neigh`, so the kernel's neighbour table finds
//! and refreshes the firewall's MAC), and the control plane that loads, attaches, feeds and
//! reads it. IO. What the program decides is `crate::packet`'s module doc; the program is
//! `program.rs`, the system calls `sys.rs` (the one file here allowed `unsafe`).
//!
//! # Why assembled in Rust
//! The program is written with a small label-resolving assembler (`asm.rs`) rather than in
//! C: fulcrum builds with cargo alone on a machine without clang, LLVM or libbpf, adds no
//! crate and needs no CI step to check a committed object against its source. The program
//! is straight-line parsing, forty hash operations and a few map lookups (591 instructions,
//! no loop), which Rust functions emitting instructions express well: a loop in the
//! generator is unrolled code in the program. Its twin (`crate::packet::decide`) is
//! compared with it packet by packet through `BPF_PROG_TEST_RUN` (`tests/packet_bpf.rs`).
//!
//! # Maps
//! - `config`: the method and masks (`PathConfig::value`).
//! - `table`: two bucket tables of `BUCKETS` slots; `active` (one entry) names the live one.
//!   [`PacketPath::install_table`] writes the other and then flips `active`: a program run
//!   reads `active` once, so it sees one whole table, never a mix.
//! - `legs`: per firewall slot, its interface and next hop (`struct bpf_redir_neigh`).
//! - `local`: this host's addresses (to the stack, never forwarded).
//! - `counters`: per CPU, {packets, bytes} per pass reason, for drops, and per firewall slot.
//!
//! # Attachment
//! tcx (`BPF_LINK_CREATE` with `BPF_TCX_INGRESS`, Linux 6.6 or later), one link per
//! interface, pinned at `<root>/<vserver>/<interface>` on a bpffs (default root
//! [`PIN_ROOT`]; bpffs is mounted on /sys/fs/bpf when it is not). The pinned link outlives
//! the process: a restarted fulcrum finds it and puts its new program in at once
//! (`BPF_LINK_UPDATE`), with its table already installed, so no packet finds no program.
//! [`PacketPath::detach`] ends it. Where the kernel has no tcx, the program goes on as a
//! direct-action cls_bpf filter on a `clsact` qdisc (`tc.rs`), at a fixed priority and
//! handle that a restart replaces in place. Without BPF or the permission, every call here
//! fails with an error naming the vserver, and the caller refuses that vserver.

mod asm;
mod program;
mod sys;
mod tc;
mod vserver;

pub use asm::AsmError;
pub use vserver::{Firewall, PacketVserver};

use crate::packet::{
    BUCKETS, COUNTER_DROP_NO_FIREWALL, COUNTER_DROP_NO_NEXT_HOP, COUNTER_LEGS, COUNTERS, MAX_LEGS,
    PassReason, PathConfig, local_key, next_hops,
};
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// Where links are pinned: one directory per vserver.
pub const PIN_ROOT: &str = "/sys/fs/bpf/fulcrum";
/// `TC_ACT_OK`: to the stack.
pub const TC_ACT_OK: u32 = 0;
/// `TC_ACT_SHOT`: dropped.
pub const TC_ACT_SHOT: u32 = 2;
/// `TC_ACT_REDIRECT`: redirected (`bpf_redirect_neigh`).
pub const TC_ACT_REDIRECT: u32 = 7;

const LEG_LEN: usize = 44;
const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// What the kernel side could not do, naming the vserver.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    /// A system call failed.
    #[error("vserver {vserver}: cannot {what}: {source}{}", hint(source))]
    Kernel {
        /// The vserver.
        vserver: String,
        /// What was being done.
        what: &'static str,
        /// The kernel's answer.
        source: io::Error,
    },
    /// The verifier refused the program (a bug here, or a kernel too old).
    #[error("vserver {vserver}: the kernel refused the program ({source}); verifier log:\n{log}")]
    Verifier {
        /// The vserver.
        vserver: String,
        /// The kernel's answer.
        source: io::Error,
        /// The end of the verifier's log.
        log: String,
    },
    /// The program did not assemble.
    #[error("vserver {vserver}: {source}")]
    Asm {
        /// The vserver.
        vserver: String,
        /// Why.
        source: AsmError,
    },
    /// A firewall slot outside 1..=MAX_LEGS.
    #[error("vserver {vserver}: firewall slot {slot} outside 1..={MAX_LEGS}")]
    Slot {
        /// The vserver.
        vserver: String,
        /// The slot asked for.
        slot: u32,
    },
    /// A bucket table of the wrong length or naming a slot past MAX_LEGS.
    #[error("vserver {vserver}: a bucket table needs {BUCKETS} entries of 0..={MAX_LEGS}")]
    Table {
        /// The vserver.
        vserver: String,
    },
    /// No interface of that name.
    #[error("vserver {vserver}: no interface {interface}: {source}")]
    Interface {
        /// The vserver.
        vserver: String,
        /// The name.
        interface: String,
        /// The lookup's error.
        source: io::Error,
    },
}

fn hint(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(nix::libc::EPERM) | Some(nix::libc::EACCES) => {
            " (BPF needs CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN for bpffs, or root)"
        }
        Some(nix::libc::ENOSYS) => " (this kernel has no BPF)",
        _ => "",
    }
}

/// Packets and bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Packets {
    /// Packets.
    pub packets: u64,
    /// Bytes (of the frames, Ethernet header included).
    pub bytes: u64,
}

/// The program's counters, summed over CPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// To the stack, per reason (in `PassReason::ALL` order).
    pub passed: [Packets; 5],
    /// Dropped: the bucket named no usable firewall.
    pub dropped_no_firewall: Packets,
    /// Dropped: the firewall has no next hop of the packet's family.
    pub dropped_no_next_hop: Packets,
    /// Forwarded, per firewall slot (index 0 is slot 1).
    pub forwarded: Vec<Packets>,
}

impl Counters {
    /// Passed for `reason`.
    pub fn passed(&self, reason: PassReason) -> Packets {
        self.passed[reason as usize]
    }
}

/// One run of the program on one frame (`BPF_PROG_TEST_RUN`: nothing is sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgramRun {
    /// The return code: [`TC_ACT_OK`], [`TC_ACT_SHOT`] or [`TC_ACT_REDIRECT`].
    pub action: u32,
    /// The flow hash (0 when the frame passed).
    pub hash: u32,
    /// Its bucket.
    pub bucket: u32,
    /// The firewall slot it went to (0 when none).
    pub slot: u32,
    /// The counter it counted under.
    pub counter: u32,
}

struct Maps {
    config: OwnedFd,
    active: OwnedFd,
    table: OwnedFd,
    legs: OwnedFd,
    local: OwnedFd,
    counters: OwnedFd,
}

/// A packet vserver's program and maps, and its links.
pub struct PacketPath {
    vserver: String,
    dir: PathBuf,
    maps: Maps,
    prog: OwnedFd,
    live: u32,
    links: Vec<(String, Attachment)>,
}

/// How the program sits on an interface.
enum Attachment {
    /// A tcx link (pinned).
    Tcx(OwnedFd),
    /// A cls_bpf filter on the clsact qdisc of this ifindex (the fallback).
    ClsBpf(u32),
}

impl std::fmt::Debug for PacketPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketPath")
            .field("vserver", &self.vserver)
            .field("dir", &self.dir)
            .field("live", &self.live)
            .finish_non_exhaustive()
    }
}

impl PacketPath {
    /// Create the maps and load the program for `vserver`, pinning under [`PIN_ROOT`].
    /// Nothing is attached yet; every bucket drops until [`PacketPath::install_table`].
    pub fn load(vserver: &str, config: &PathConfig) -> Result<PacketPath, BpfError> {
        PacketPath::load_at(vserver, config, Path::new(PIN_ROOT))
    }

    /// [`PacketPath::load`], pinning under `root` (a directory on a bpffs, or under one).
    pub fn load_at(
        vserver: &str,
        config: &PathConfig,
        root: &Path,
    ) -> Result<PacketPath, BpfError> {
        let kernel = |what: &'static str| {
            let vserver = vserver.to_string();
            move |source| BpfError::Kernel {
                vserver,
                what,
                source,
            }
        };
        let create = |kind, key, value, entries, name| {
            sys::map_create(kind, key, value, entries, name).map_err(kernel("create a BPF map"))
        };
        let maps = Maps {
            config: create(sys::MAP_ARRAY, 4, 24, 1, "fc_config")?,
            active: create(sys::MAP_ARRAY, 4, 4, 1, "fc_active")?,
            table: create(sys::MAP_ARRAY, 4, 4, 2 * BUCKETS as u32, "fc_buckets")?,
            legs: create(
                sys::MAP_ARRAY,
                4,
                LEG_LEN as u32,
                MAX_LEGS as u32,
                "fc_legs",
            )?,
            local: create(sys::MAP_HASH, 16, 4, 1024, "fc_local")?,
            counters: create(sys::MAP_PERCPU_ARRAY, 4, 16, COUNTERS, "fc_counters")?,
        };
        sys::map_update(&maps.config, &0u32.to_ne_bytes(), &config.value())
            .map_err(kernel("write the config map"))?;
        let fds = program::MapFds {
            config: maps.config.as_raw_fd(),
            active: maps.active.as_raw_fd(),
            table: maps.table.as_raw_fd(),
            legs: maps.legs.as_raw_fd(),
            local: maps.local.as_raw_fd(),
            counters: maps.counters.as_raw_fd(),
        };
        let code = program::program(&fds).map_err(|source| BpfError::Asm {
            vserver: vserver.to_string(),
            source,
        })?;
        let prog = sys::prog_load_sched_cls(&code, "fulcrum_fw").map_err(|(source, log)| {
            if source.raw_os_error() == Some(nix::libc::EPERM) || log.is_empty() {
                kernel("load the BPF program")(source)
            } else {
                BpfError::Verifier {
                    vserver: vserver.to_string(),
                    source,
                    log,
                }
            }
        })?;
        // One directory per vserver, whatever its name: no separator, no `.` or `..`.
        let mut safe: String = vserver
            .chars()
            .map(|c| if c == '/' || c == '\0' { '_' } else { c })
            .collect();
        if safe.is_empty() || safe.chars().all(|c| c == '.') {
            safe = format!("_{safe}");
        }
        Ok(PacketPath {
            vserver: vserver.to_string(),
            dir: root.join(safe),
            maps,
            prog,
            live: 0,
            links: Vec::new(),
        })
    }

    fn kernel(&self, what: &'static str) -> impl FnOnce(io::Error) -> BpfError + '_ {
        move |source| BpfError::Kernel {
            vserver: self.vserver.clone(),
            what,
            source,
        }
    }

    fn check_slot(&self, slot: u32) -> Result<(), BpfError> {
        if slot == 0 || slot as usize > MAX_LEGS {
            return Err(BpfError::Slot {
                vserver: self.vserver.clone(),
                slot,
            });
        }
        Ok(())
    }

    /// Hash by `config` from the next packet on (a reload that changes the method or masks).
    pub fn set_config(&self, config: &PathConfig) -> Result<(), BpfError> {
        sys::map_update(&self.maps.config, &0u32.to_ne_bytes(), &config.value())
            .map_err(self.kernel("write the config map"))
    }

    /// Firewall `slot` (1-based: the service's index + 1) is reached on `ifindex` through
    /// `hops`, whose MAC the kernel's neighbour table resolves: its first IPv4 address for
    /// IPv4 packets (else its IPv6 one), its first IPv6 address for IPv6 packets (without
    /// one, IPv6 packets for this firewall are dropped and counted).
    pub fn set_leg(&self, slot: u32, ifindex: u32, hops: &[IpAddr]) -> Result<(), BpfError> {
        self.check_slot(slot)?;
        let mut v = [0u8; LEG_LEN];
        v[..4].copy_from_slice(&ifindex.to_ne_bytes());
        let neigh = |v: &mut [u8; LEG_LEN], at: usize, hop: IpAddr| match hop {
            IpAddr::V4(a) => {
                v[at..at + 4].copy_from_slice(&AF_INET.to_ne_bytes());
                v[at + 4..at + 8].copy_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                v[at..at + 4].copy_from_slice(&AF_INET6.to_ne_bytes());
                v[at + 4..at + 20].copy_from_slice(&a.octets());
            }
        };
        let (for_v4, for_v6) = next_hops(hops);
        if let Some(h) = for_v4 {
            neigh(&mut v, 4, h);
        }
        if let Some(h) = for_v6 {
            neigh(&mut v, 24, IpAddr::V6(h));
        }
        sys::map_update(&self.maps.legs, &(slot - 1).to_ne_bytes(), &v)
            .map_err(self.kernel("set a firewall leg"))
    }

    /// Firewall `slot` has no leg: its buckets drop.
    pub fn clear_leg(&self, slot: u32) -> Result<(), BpfError> {
        self.check_slot(slot)?;
        sys::map_update(&self.maps.legs, &(slot - 1).to_ne_bytes(), &[0u8; LEG_LEN])
            .map_err(self.kernel("clear a firewall leg"))
    }

    /// This host's addresses are exactly `addrs` (packets to them pass to the stack).
    pub fn set_local_addresses(&self, addrs: &[IpAddr]) -> Result<(), BpfError> {
        let want: Vec<[u8; 16]> = addrs.iter().map(|a| local_key(*a)).collect();
        for k in &want {
            sys::map_update(&self.maps.local, k, &1u32.to_ne_bytes())
                .map_err(self.kernel("add a local address"))?;
        }
        let have = sys::map_keys::<16>(&self.maps.local)
            .map_err(self.kernel("list the local addresses"))?;
        for k in have.iter().filter(|k| !want.contains(k)) {
            match sys::map_delete(&self.maps.local, k) {
                Err(e) if e.raw_os_error() != Some(nix::libc::ENOENT) => {
                    return Err(self.kernel("remove a local address")(e));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Make `table` (`crate::packet::build_table`) the live bucket table: written into the
    /// idle half, then `active` flipped, so each packet sees the old table or the new one. (A
    /// program run reads `active` and then one bucket, within microseconds; the next install
    /// rewrites that half only after this one returned, thousands of map writes later.)
    pub fn install_table(&mut self, table: &[u32]) -> Result<(), BpfError> {
        if table.len() != BUCKETS || table.iter().any(|&s| s as usize > MAX_LEGS) {
            return Err(BpfError::Table {
                vserver: self.vserver.clone(),
            });
        }
        let idle = 1 - self.live;
        let base = idle * BUCKETS as u32;
        for (b, slot) in table.iter().enumerate() {
            sys::map_update(
                &self.maps.table,
                &(base + b as u32).to_ne_bytes(),
                &slot.to_ne_bytes(),
            )
            .map_err(self.kernel("write the bucket table"))?;
        }
        sys::map_update(&self.maps.active, &0u32.to_ne_bytes(), &idle.to_ne_bytes())
            .map_err(self.kernel("switch bucket tables"))?;
        self.live = idle;
        Ok(())
    }

    /// The counters, summed over CPUs.
    pub fn counters(&self) -> Result<Counters, BpfError> {
        let cpus = possible_cpus().map_err(self.kernel("count the CPUs"))?;
        let mut buf = vec![0u8; 16 * cpus];
        let mut read = |i: u32| -> Result<Packets, BpfError> {
            sys::map_lookup(&self.maps.counters, &i.to_ne_bytes(), &mut buf)
                .map_err(self.kernel("read the counters"))?;
            let mut p = Packets::default();
            for c in buf.chunks_exact(16) {
                let word = |at: usize| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&c[at..at + 8]);
                    u64::from_ne_bytes(w)
                };
                p.packets += word(0);
                p.bytes += word(8);
            }
            Ok(p)
        };
        let mut c = Counters::default();
        for r in PassReason::ALL {
            c.passed[r as usize] = read(r as u32)?;
        }
        c.dropped_no_firewall = read(COUNTER_DROP_NO_FIREWALL)?;
        c.dropped_no_next_hop = read(COUNTER_DROP_NO_NEXT_HOP)?;
        for s in 0..MAX_LEGS as u32 {
            c.forwarded.push(read(COUNTER_LEGS + s)?);
        }
        Ok(c)
    }

    /// Run the program once on `frame` (an Ethernet frame) as if it had arrived; nothing is
    /// sent, the counters count it.
    pub fn run(&self, frame: &[u8]) -> Result<ProgramRun, BpfError> {
        let r = sys::test_run(&self.prog, frame, 1).map_err(self.kernel("test-run the program"))?;
        let cb = |i: usize| {
            let at = 48 + 4 * i;
            u32::from_ne_bytes([r.ctx[at], r.ctx[at + 1], r.ctx[at + 2], r.ctx[at + 3]])
        };
        Ok(ProgramRun {
            action: r.retval,
            hash: cb(0),
            bucket: cb(1),
            slot: cb(2),
            counter: cb(3),
        })
    }

    /// The program's mean time per packet on `frame`, run `repeat` times in the kernel
    /// (`BPF_PROG_TEST_RUN`'s own clock; the counters count every run).
    pub fn time_per_packet(
        &self,
        frame: &[u8],
        repeat: u32,
    ) -> Result<std::time::Duration, BpfError> {
        let r = sys::test_run(&self.prog, frame, repeat)
            .map_err(self.kernel("test-run the program"))?;
        Ok(std::time::Duration::from_nanos(u64::from(r.duration_ns)))
    }

    /// The pin directory of this vserver's links.
    pub fn pin_dir(&self) -> &Path {
        &self.dir
    }

    /// Attach the program at `interface`'s ingress: into the link pinned for it when there
    /// is one (a restart: replaced at once), else a new tcx link, pinned; where the kernel
    /// has no tcx (before Linux 6.6), a direct-action cls_bpf filter instead.
    pub fn attach(&mut self, interface: &str) -> Result<(), BpfError> {
        let ifindex = self.ifindex(interface)?;
        ensure_bpffs(&self.dir).map_err(self.kernel("prepare the bpffs pin directory"))?;
        let pin = self.dir.join(interface);
        let attachment = match sys::obj_get(&pin) {
            Ok(link) => {
                sys::link_update(&link, &self.prog)
                    .map_err(self.kernel("replace the program in its pinned link"))?;
                Attachment::Tcx(link)
            }
            Err(e) if e.raw_os_error() == Some(nix::libc::ENOENT) => {
                match sys::tcx_attach(&self.prog, ifindex) {
                    Ok(link) => {
                        sys::obj_pin(&link, &pin).map_err(self.kernel("pin the link"))?;
                        Attachment::Tcx(link)
                    }
                    // An attach type this kernel does not know.
                    Err(e) if e.raw_os_error() == Some(nix::libc::EINVAL) => {
                        return self.attach_cls_bpf(interface);
                    }
                    Err(e) => return Err(self.kernel("attach the program (tcx ingress)")(e)),
                }
            }
            Err(e) => return Err(self.kernel("open the pinned link")(e)),
        };
        self.links.retain(|(name, _)| name != interface);
        self.links.push((interface.to_string(), attachment));
        Ok(())
    }

    /// Attach the program at `interface`'s ingress as a direct-action cls_bpf filter (the
    /// fallback [`PacketPath::attach`] takes without tcx), replacing fulcrum's filter there.
    pub fn attach_cls_bpf(&mut self, interface: &str) -> Result<(), BpfError> {
        let ifindex = self.ifindex(interface)?;
        tc::attach(ifindex, self.prog.as_raw_fd(), "fulcrum_fw")
            .map_err(self.kernel("attach the program (cls_bpf ingress)"))?;
        self.links.retain(|(name, _)| name != interface);
        self.links
            .push((interface.to_string(), Attachment::ClsBpf(ifindex)));
        Ok(())
    }

    fn ifindex(&self, interface: &str) -> Result<u32, BpfError> {
        nix::net::if_::if_nametoindex(interface).map_err(|e| BpfError::Interface {
            vserver: self.vserver.clone(),
            interface: interface.to_string(),
            source: io::Error::from(e),
        })
    }

    /// Detach the program from `interface`: its tcx link and pin, or its cls_bpf filter
    /// (this process's or a previous one's).
    pub fn detach(&mut self, interface: &str) -> Result<(), BpfError> {
        let pin = self.dir.join(interface);
        let attachment = match self.links.iter().position(|(n, _)| n == interface) {
            Some(i) => Some(self.links.remove(i).1),
            None => match sys::obj_get(&pin) {
                Ok(l) => Some(Attachment::Tcx(l)),
                Err(e) if e.raw_os_error() == Some(nix::libc::ENOENT) => None,
                Err(e) => return Err(self.kernel("open the pinned link")(e)),
            },
        };
        match attachment {
            Some(Attachment::Tcx(link)) => {
                sys::link_detach(&link).map_err(self.kernel("detach the program"))?;
            }
            Some(Attachment::ClsBpf(ifindex)) => {
                tc::remove(ifindex).map_err(self.kernel("remove the cls_bpf filter"))?;
            }
            None => {
                if let Ok(ifindex) = self.ifindex(interface) {
                    // A previous start's filter; none (or no clsact qdisc) is fine.
                    match tc::remove(ifindex) {
                        Err(e) if e.raw_os_error() != Some(nix::libc::EINVAL) => {
                            return Err(self.kernel("remove the cls_bpf filter")(e));
                        }
                        _ => {}
                    }
                }
            }
        }
        match std::fs::remove_file(&pin) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                Err(self.kernel("remove the pinned link")(e))
            }
            _ => Ok(()),
        }
    }

    /// Detach from every interface attached here and remove the vserver's pin directory.
    pub fn detach_all(&mut self) -> Result<(), BpfError> {
        let names: Vec<String> = self.links.iter().map(|(n, _)| n.clone()).collect();
        for n in names {
            self.detach(&n)?;
        }
        match std::fs::remove_dir(&self.dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                Err(self.kernel("remove the pin directory")(e))
            }
            _ => Ok(()),
        }
    }
}

/// The number of possible CPUs (/sys/devices/system/cpu/possible, e.g. "0-3" or "0,2-5"):
/// a per-CPU map's value is read for each.
fn possible_cpus() -> io::Result<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "unreadable CPU list");
    let mut n = 0;
    for part in text.trim().split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let lo: usize = lo.parse().map_err(|_| bad())?;
        let hi: usize = hi.parse().map_err(|_| bad())?;
        n += hi.checked_sub(lo).ok_or_else(bad)? + 1;
    }
    Ok(n.max(1))
}

/// `dir` exists on a bpffs: /sys/fs/bpf mounted when it is not one.
fn ensure_bpffs(dir: &Path) -> io::Result<()> {
    let fs = Path::new("/sys/fs/bpf");
    if dir.starts_with(fs) && !sys::is_bpffs(fs)? {
        sys::mount_bpffs(fs)?;
    }
    std::fs::create_dir_all(dir)
}

/// This host's addresses, for [`PacketPath::set_local_addresses`].
pub fn host_addresses() -> io::Result<Vec<IpAddr>> {
    let mut out = Vec::new();
    for ifa in nix::ifaddrs::getifaddrs().map_err(io::Error::from)? {
        let Some(a) = ifa.address else { continue };
        if let Some(v4) = a.as_sockaddr_in() {
            out.push(IpAddr::V4(v4.ip()));
        } else if let Some(v6) = a.as_sockaddr_in6() {
            out.push(IpAddr::V6(v6.ip()));
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}
