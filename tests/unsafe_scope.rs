//! The crate denies `unsafe_code` (src/lib.rs); the modules allowed to opt out are
//! `src/uring.rs` (io_uring submissions name buffers by address), `src/memory.rs` (one
//! call to jemalloc's `mallctl` with a constant name and no buffers), `src/bpf/sys.rs`
//! (the `bpf` system call takes its arguments by address) and `src/capture/send_queue.rs`
//! (two `ioctl` calls that each write one `int`), as README says. Another opt-out
//! anywhere under src/ fails here, so the claim cannot drift.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn only_uring_memory_bpf_sys_and_the_send_queue_allow_unsafe_code() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(files.len() > 20, "found the sources: {}", files.len());
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    assert!(
        lib.contains("#![deny(unsafe_code)]"),
        "lib.rs denies unsafe code"
    );
    let mut allowing: Vec<String> = files
        .iter()
        .filter(|f| {
            let text = std::fs::read_to_string(f).expect("read");
            text.contains("allow(unsafe_code)") || text.contains("expect(unsafe_code)")
        })
        .map(|f| {
            f.strip_prefix(&src)
                .unwrap_or(f)
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    allowing.sort();
    assert_eq!(
        allowing,
        [
            "bpf/sys.rs",
            "capture/send_queue.rs",
            "memory.rs",
            "uring.rs"
        ]
    );
}
