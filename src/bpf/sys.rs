//! The `bpf(2)` system call and the bpffs mount: maps, program load with the verifier's
//! log, test runs, tcx links, pins. IO; the one module of `crate::bpf` allowed `unsafe`
//! (the system call takes its arguments by address). Attribute layouts: `union bpf_attr`
//! in include/uapi/linux/bpf.h.

#![allow(unsafe_code)]

use nix::libc;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_DETACH: libc::c_long = 34;

/// Map types used here.
pub(crate) const MAP_HASH: u32 = 1;
pub(crate) const MAP_ARRAY: u32 = 2;
pub(crate) const MAP_PERCPU_ARRAY: u32 = 6;
const PROG_SCHED_CLS: u32 = 3;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const LOG_SIZE: usize = 1 << 20;

/// `bpf(cmd, attr)`: a new descriptor (or 0) on success.
fn bpf(cmd: libc::c_long, attr: &mut [u8; 128]) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, writable 128-byte buffer, the size passed; every pointer
    // stored in it by the callers points to memory that outlives this call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn put(attr: &mut [u8; 128], at: usize, bytes: &[u8]) {
    attr[at..at + bytes.len()].copy_from_slice(bytes);
}

fn ptr(p: *const u8) -> [u8; 8] {
    (p as u64).to_ne_bytes()
}

fn owned(fd: libc::c_long) -> io::Result<OwnedFd> {
    let fd = RawFd::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))?;
    // SAFETY: the kernel just returned `fd`, a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A new map; `name` up to 15 bytes.
pub(crate) fn map_create(
    kind: u32,
    key: u32,
    value: u32,
    entries: u32,
    name: &str,
) -> io::Result<OwnedFd> {
    let mut a = [0u8; 128];
    put(&mut a, 0, &kind.to_ne_bytes());
    put(&mut a, 4, &key.to_ne_bytes());
    put(&mut a, 8, &value.to_ne_bytes());
    put(&mut a, 12, &entries.to_ne_bytes());
    let n = name.as_bytes();
    put(&mut a, 32, &n[..n.len().min(15)]);
    owned(bpf(BPF_MAP_CREATE, &mut a)?)
}

fn elem(map: &OwnedFd, key: &[u8]) -> [u8; 128] {
    let mut a = [0u8; 128];
    put(&mut a, 0, &map.as_raw_fd().to_ne_bytes());
    put(&mut a, 8, &ptr(key.as_ptr()));
    a
}

/// Set `key` to `value` (the map's sizes: the caller passes them right).
pub(crate) fn map_update(map: &OwnedFd, key: &[u8], value: &[u8]) -> io::Result<()> {
    let mut a = elem(map, key);
    put(&mut a, 16, &ptr(value.as_ptr()));
    bpf(BPF_MAP_UPDATE_ELEM, &mut a).map(drop)
}

/// Read `key` into `value` (for a per-CPU map, `value` holds every possible CPU's).
pub(crate) fn map_lookup(map: &OwnedFd, key: &[u8], value: &mut [u8]) -> io::Result<()> {
    let mut a = elem(map, key);
    put(&mut a, 16, &ptr(value.as_mut_ptr()));
    bpf(BPF_MAP_LOOKUP_ELEM, &mut a).map(drop)
}

/// Delete `key`.
pub(crate) fn map_delete(map: &OwnedFd, key: &[u8]) -> io::Result<()> {
    bpf(BPF_MAP_DELETE_ELEM, &mut elem(map, key)).map(drop)
}

/// Every key of a hash map whose keys are `N` bytes.
pub(crate) fn map_keys<const N: usize>(map: &OwnedFd) -> io::Result<Vec<[u8; N]>> {
    let mut keys = Vec::new();
    let mut next = [0u8; N];
    let mut a = [0u8; 128];
    put(&mut a, 0, &map.as_raw_fd().to_ne_bytes());
    // A null key asks for the first.
    put(&mut a, 16, &ptr(next.as_mut_ptr()));
    loop {
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut a) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(keys),
            Err(e) => return Err(e),
        }
        keys.push(next);
        let last = keys.last().map_or(std::ptr::null(), |k| k.as_ptr());
        put(&mut a, 8, &ptr(last));
    }
}

/// Load a `BPF_PROG_TYPE_SCHED_CLS` program. A refusal carries the verifier's log.
pub(crate) fn prog_load_sched_cls(code: &[u8], name: &str) -> Result<OwnedFd, (io::Error, String)> {
    let license = b"GPL\0";
    let mut log = vec![0u8; LOG_SIZE];
    let load = |a: &mut [u8; 128], log: &mut [u8], level: u32| {
        put(a, 0, &PROG_SCHED_CLS.to_ne_bytes());
        put(a, 4, &((code.len() / 8) as u32).to_ne_bytes());
        put(a, 8, &ptr(code.as_ptr()));
        put(a, 16, &ptr(license.as_ptr()));
        if level > 0 {
            put(a, 24, &level.to_ne_bytes());
            put(a, 28, &(log.len() as u32).to_ne_bytes());
            put(a, 32, &ptr(log.as_mut_ptr()));
        }
        let n = name.as_bytes();
        put(a, 48, &n[..n.len().min(15)]);
        bpf(BPF_PROG_LOAD, a)
    };
    let mut a = [0u8; 128];
    match load(&mut a, &mut [], 0) {
        Ok(fd) => owned(fd).map_err(|e| (e, String::new())),
        Err(first) => {
            // Again with the log, to say why.
            let mut a = [0u8; 128];
            let _ = load(&mut a, &mut log, 1);
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            Err((first, tail.join("\n")))
        }
    }
}

/// What one `BPF_PROG_TEST_RUN` returned.
#[derive(Debug, Clone)]
pub(crate) struct TestRun {
    pub(crate) retval: u32,
    /// Mean nanoseconds per run, as the kernel measured.
    pub(crate) duration_ns: u32,
    pub(crate) ctx: [u8; SKB_CTX_LEN],
}

/// `sizeof(struct __sk_buff)`.
pub(crate) const SKB_CTX_LEN: usize = 192;

/// Run `prog` once on `frame` (an Ethernet frame, at least 14 bytes).
pub(crate) fn test_run(prog: &OwnedFd, frame: &[u8], repeat: u32) -> io::Result<TestRun> {
    let ctx_in = [0u8; SKB_CTX_LEN];
    let mut ctx_out = [0u8; SKB_CTX_LEN];
    let mut data_out = vec![0u8; frame.len() + 256];
    let mut a = [0u8; 128];
    put(&mut a, 0, &prog.as_raw_fd().to_ne_bytes());
    put(&mut a, 8, &(frame.len() as u32).to_ne_bytes());
    put(&mut a, 12, &(data_out.len() as u32).to_ne_bytes());
    put(&mut a, 16, &ptr(frame.as_ptr()));
    put(&mut a, 24, &ptr(data_out.as_mut_ptr()));
    put(&mut a, 32, &repeat.max(1).to_ne_bytes());
    put(&mut a, 40, &(SKB_CTX_LEN as u32).to_ne_bytes());
    put(&mut a, 44, &(SKB_CTX_LEN as u32).to_ne_bytes());
    put(&mut a, 48, &ptr(ctx_in.as_ptr()));
    put(&mut a, 56, &ptr(ctx_out.as_mut_ptr()));
    bpf(BPF_PROG_TEST_RUN, &mut a)?;
    let retval = u32::from_ne_bytes([a[4], a[5], a[6], a[7]]);
    Ok(TestRun {
        retval,
        duration_ns: u32::from_ne_bytes([a[36], a[37], a[38], a[39]]),
        ctx: ctx_out,
    })
}

/// Attach `prog` at `ifindex`'s tcx ingress: a new link.
pub(crate) fn tcx_attach(prog: &OwnedFd, ifindex: u32) -> io::Result<OwnedFd> {
    let mut a = [0u8; 128];
    put(&mut a, 0, &prog.as_raw_fd().to_ne_bytes());
    put(&mut a, 4, &ifindex.to_ne_bytes());
    put(&mut a, 8, &BPF_TCX_INGRESS.to_ne_bytes());
    owned(bpf(BPF_LINK_CREATE, &mut a)?)
}

/// Put `prog` in `link` in place of its program, at once.
pub(crate) fn link_update(link: &OwnedFd, prog: &OwnedFd) -> io::Result<()> {
    let mut a = [0u8; 128];
    put(&mut a, 0, &link.as_raw_fd().to_ne_bytes());
    put(&mut a, 4, &prog.as_raw_fd().to_ne_bytes());
    bpf(BPF_LINK_UPDATE, &mut a).map(drop)
}

/// Detach `link` (it stays a descriptor, attached to nothing).
pub(crate) fn link_detach(link: &OwnedFd) -> io::Result<()> {
    let mut a = [0u8; 128];
    put(&mut a, 0, &link.as_raw_fd().to_ne_bytes());
    bpf(BPF_LINK_DETACH, &mut a).map(drop)
}

fn c_path(path: &Path) -> io::Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the path"))
}

/// Pin `fd` (a map, program or link) at `path` on a bpffs.
pub(crate) fn obj_pin(fd: &OwnedFd, path: &Path) -> io::Result<()> {
    let p = c_path(path)?;
    let mut a = [0u8; 128];
    put(&mut a, 0, &ptr(p.as_ptr().cast()));
    put(&mut a, 8, &fd.as_raw_fd().to_ne_bytes());
    bpf(BPF_OBJ_PIN, &mut a).map(drop)
}

/// The object pinned at `path`.
pub(crate) fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let p = c_path(path)?;
    let mut a = [0u8; 128];
    put(&mut a, 0, &ptr(p.as_ptr().cast()));
    owned(bpf(BPF_OBJ_GET, &mut a)?)
}

/// Whether `path` is on a bpffs.
pub(crate) fn is_bpffs(path: &Path) -> io::Result<bool> {
    let p = c_path(path)?;
    // SAFETY: `statfs` is plain data (all zeros valid), written by the call; `p` is a live
    // NUL-terminated string.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statfs(p.as_ptr(), &raw mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64 == BPF_FS_MAGIC)
}

/// Mount a bpffs at `path` (an existing directory).
pub(crate) fn mount_bpffs(path: &Path) -> io::Result<()> {
    let target = c_path(path)?;
    let fstype = c"bpf";
    // SAFETY: three live NUL-terminated strings and a null data pointer, as mount(2) takes.
    let r = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
