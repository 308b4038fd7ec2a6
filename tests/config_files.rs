//! `fulcrum check` over the shipped examples (all valid), the invalid fixtures (each must
//! print exactly its `.expected` lines and exit 2) and the valid but warned ones (each prints
//! exactly its `.expected` warning lines and exits 0); `fulcrum run` logs the warnings at start.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn check(path: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fulcrum"))
        .arg("check")
        .arg(path)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run fulcrum check")
}

/// `*.yaml` files of `dir`, as paths relative to the crate root (as error lines print them).
fn yaml_files(dir: &str) -> Vec<PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(dir))
        .expect("read dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .filter_map(|p| p.file_name().map(|n| Path::new(dir).join(n)))
        .collect();
    files.sort();
    files
}

#[test]
fn every_example_config_is_valid() {
    let files = yaml_files("config");
    assert!(files.len() >= 4, "config/ holds the examples");
    for f in files {
        let out = check(&f);
        assert!(
            out.status.success(),
            "{} failed: {}",
            f.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("vserver "), "{stdout}");
    }
}

#[test]
fn every_invalid_fixture_reports_its_exact_lines() {
    let files = yaml_files("fixtures/config");
    assert!(files.len() >= 10);
    for f in files {
        let expected_path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join(f.with_extension("expected"));
        let expected = std::fs::read_to_string(&expected_path)
            .unwrap_or_else(|_| panic!("{} needs a .expected file", f.display()));
        assert!(!expected.trim().is_empty());
        let out = check(&f);
        assert_eq!(out.status.code(), Some(2), "{} must exit 2", f.display());
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            expected,
            "{}",
            f.display()
        );
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn every_warned_fixture_is_valid_and_prints_its_exact_warnings() {
    let files = yaml_files("fixtures/config_warnings");
    assert!(files.len() >= 2);
    for f in files {
        let expected_path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join(f.with_extension("expected"));
        let expected = std::fs::read_to_string(&expected_path)
            .unwrap_or_else(|_| panic!("{} needs a .expected file", f.display()));
        assert!(expected.contains(": warning: "), "{}", f.display());
        let out = check(&f);
        assert_eq!(out.status.code(), Some(0), "{} must exit 0", f.display());
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            expected,
            "{}",
            f.display()
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains(": ok"), "{stdout}");
    }
}

#[test]
fn the_shipped_examples_warn_of_nothing() {
    for f in yaml_files("config") {
        let out = check(&f);
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            "",
            "{} is an example to copy",
            f.display()
        );
    }
}

#[test]
fn run_logs_the_warnings_at_start() {
    let yaml = "admin: { listen: null }\nservices:\n  - { name: s0, address: 127.0.0.1:9, protocol: sip-udp }\nvservers:\n  - { name: v, protocol: sip-udp, bind: [127.0.0.1:0], workers: 1, failover: { no_answer_non_invite: 1s }, services: [s0] }\n";
    let file = common::ConfigFile::new("warned", yaml);
    let (mut child, rx) = common::spawn_fulcrum(&file.path, "1s");
    let mut seen = Vec::new();
    let warned = common::expect_line_keeping(&rx, "warning: below 4s", &mut seen);
    assert!(
        warned.contains(&format!("{}:5:", file.path.display()))
            && warned.contains("vservers[0].failover.no_answer_non_invite: warning: "),
        "{warned}"
    );
    // Before the vserver starts, and it starts all the same.
    assert!(!seen.iter().any(|l| l.contains("listening")), "{seen:?}");
    common::expect_line_keeping(&rx, "listening", &mut seen);
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn check_of_a_missing_file_fails_cleanly() {
    let out = check(Path::new("config/does-not-exist.yaml"));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does-not-exist.yaml"));
}

/// `fulcrum check FILE | head`: a reader that has gone ends the command quietly with the
/// status a shell shows for SIGPIPE, not a panic.
#[test]
fn check_into_a_closed_pipe_ends_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fulcrum"))
        .arg("check")
        .arg("config/fulcrum.yaml")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run fulcrum check");
    drop(child.stdout.take()); // the reader is gone before the first line
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(141), "{stderr}");
}
