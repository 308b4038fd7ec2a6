//! Open-file limit. IO.
//!
//! Every UDP session owns a socket and every TCP connection two, so the default soft limit
//! (often 1024) would cap a vserver far below its `max_sessions`. The soft limit is raised
//! to the hard limit once per process, and the result logged.

use nix::sys::resource::{Resource, getrlimit, setrlimit};
use std::sync::Once;

static RAISE: Once = Once::new();

/// Raise RLIMIT_NOFILE's soft limit to its hard limit (once per process).
pub fn raise_nofile_limit() {
    RAISE.call_once(|| match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::info!(from = soft, to = hard, "open-file limit raised"),
            Err(e) => tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit"),
        },
        Ok((soft, _)) => tracing::info!(limit = soft, "open-file limit already at its hard limit"),
        Err(e) => tracing::warn!(error = %e, "cannot read the open-file limit"),
    });
}
