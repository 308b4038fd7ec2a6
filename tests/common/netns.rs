//! Network namespaces a test creates, and this test binary run again inside one as a helper
//! role (`FULCRUM_NETNS_ROLE`). Needs root and `ip`; without them a test passes without
//! running and says why, unless `FULCRUM_REQUIRE_NETNS=1`.

use std::process::{Command, Stdio};

/// The environment variable that names the helper role a run inside a namespace plays.
pub const ROLE: &str = "FULCRUM_NETNS_ROLE";

/// Effective uid 0, from /proc (no libc call in a test).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().nth(1))
            == Some("0")
    })
}

/// `ip ARGS`: its failure with what it said.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A namespace, deleted however the test ends.
pub struct Netns(pub String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.0]);
    }
}

/// Create a namespace named after `prefix` with `lo` up and each of `setup` run in it (`ip -n NS`
/// arguments, or `sysctl NAME VALUE...` set with `ip netns exec`), then run test `helper` of this
/// binary inside it with [`ROLE`] = `role`. Its output, which must end well and say
/// `RESULT ok` (a panic otherwise); `None` when namespaces cannot be made here (a skip).
pub fn run_helper(prefix: &str, setup: &[&str], helper: &str, role: &str) -> Option<String> {
    let skip = |why: String| {
        assert!(
            std::env::var("FULCRUM_REQUIRE_NETNS").as_deref() != Ok("1"),
            "{why}, and FULCRUM_REQUIRE_NETNS=1"
        );
        println!("SKIP: {why} (FULCRUM_REQUIRE_NETNS=1 makes this a failure)");
        None
    };
    if !is_root() {
        return skip("needs root for a network namespace".into());
    }
    let name = format!("{prefix}-{}", std::process::id());
    if let Err(e) = ip(&["netns", "add", &name]) {
        return skip(format!("cannot create a network namespace: {e}"));
    }
    let ns = Netns(name);
    ip(&["-n", &ns.0, "link", "set", "lo", "up"]).unwrap_or_else(|e| panic!("{e}"));
    for step in setup {
        let words: Vec<&str> = step.split_whitespace().collect();
        let r = match words.split_first() {
            Some((&"sysctl", [name, value @ ..])) => {
                let setting = format!("{name}={}", value.join(" "));
                ip(&["netns", "exec", &ns.0, "sysctl", "-qw", &setting])
            }
            _ => {
                let mut args = vec!["-n", ns.0.as_str()];
                args.extend_from_slice(&words);
                ip(&args)
            }
        };
        r.unwrap_or_else(|e| panic!("{e}"));
    }
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.0])
        .arg(exe)
        .args([helper, "--exact", "--nocapture"])
        .env(ROLE, role)
        .stdin(Stdio::null())
        .output()
        .expect("run the helper in the namespace");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("RESULT ok"),
        "{helper} failed in the namespace:\n{text}"
    );
    Some(text)
}
