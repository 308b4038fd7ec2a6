//! Open-file limit. IO.
//!
//! Every UDP session owns a socket and every TCP connection two, so the default soft limit
//! (often 1024) would cap a vserver far below its `max_sessions`. The soft limit is raised
//! to the hard limit once per process, and the result logged; a vserver whose
//! `max_sessions` cannot fit in the result says so at start.

use nix::sys::resource::{Resource, getrlimit, setrlimit};
use std::sync::OnceLock;

static LIMIT: OnceLock<Option<u64>> = OnceLock::new();

/// Raise RLIMIT_NOFILE's soft limit to its hard limit (once per process); the soft limit
/// in force afterwards, `None` when it cannot be read.
pub fn raise_nofile_limit() -> Option<u64> {
    *LIMIT.get_or_init(|| match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => {
                tracing::info!(from = soft, to = hard, "open-file limit raised");
                Some(hard)
            }
            Err(e) => {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit");
                Some(soft)
            }
        },
        Ok((soft, _)) => {
            tracing::info!(limit = soft, "open-file limit already at its hard limit");
            Some(soft)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-file limit");
            None
        }
    })
}

/// Raise the limit, and warn when `max_sessions` sessions of `fds_each` descriptors cannot
/// all be open under it (the ones beyond fail to open and are counted as socket errors).
pub fn check_capacity(vserver: &str, max_sessions: usize, fds_each: u64) {
    let Some(limit) = raise_nofile_limit() else {
        return;
    };
    let need = (max_sessions as u64).saturating_mul(fds_each);
    if need > limit {
        tracing::warn!(
            vserver,
            max_sessions,
            open_file_limit = limit,
            about = limit / fds_each.max(1),
            "max_sessions needs more descriptors than the open-file limit allows: sessions beyond `about` will fail to open"
        );
    }
}
