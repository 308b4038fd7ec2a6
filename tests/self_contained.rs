//! The repository stands alone: comments, messages and docs cite RFC sections and the
//! repository's own docs (docs/, README.md, BENCHMARKS.md), never a specification document or
//! an issue tracker that a reader of the repository cannot open. This walks the source, test,
//! bench, fuzz, example, config, fixture and doc trees and fails on any such reference, listing
//! `file:line`.
//!
//! The patterns are assembled at run time from pieces, so this file's own text never matches
//! them and needs no exemption.

use std::path::{Path, PathBuf};

/// Trees that hold comments, messages or docs.
const ROOTS: &[&str] = &[
    "src",
    "tests",
    "benches",
    "bench",
    "fuzz",
    "examples",
    "config",
    "fixtures",
    "docs",
    ".ci",
    "packaging",
];
/// Files at the top of the repository.
const TOP_FILES: &[&str] = &["README.md", "BENCHMARKS.md", "Cargo.toml"];
/// Build output, VCS data and installed packages (the browser test's `node_modules`, ignored
/// by git) are not the repository's text.
const SKIP_DIRS: &[&str] = &["target", ".git", "corpus", "artifacts", "node_modules"];

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if path.is_dir() {
            if !SKIP_DIRS.iter().any(|s| name == *s) {
                files(&path, out);
            }
        } else {
            out.push(path);
        }
    }
}

fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// What is wrong with `line`, if anything: the specification named as a whole upper-case word
/// (covers "§n", "section n", "'s" and "table" forms), or "issue" (any case) followed by an
/// optional space, an optional `#` and a digit.
fn dangling_reference(line: &str) -> Option<&'static str> {
    let spec = ["SP", "EC"].concat();
    let bytes = line.as_bytes();
    for (at, _) in line.match_indices(spec.as_str()) {
        let before = at.checked_sub(1).map(|i| bytes[i]);
        let after = bytes.get(at + spec.len()).copied();
        if !before.is_some_and(is_word_byte) && !after.is_some_and(is_word_byte) {
            return Some("cites the specification document");
        }
    }
    let lower = line.to_ascii_lowercase();
    let issue = ["iss", "ue"].concat();
    for (at, _) in lower.match_indices(issue.as_str()) {
        let before = at.checked_sub(1).map(|i| bytes[i]);
        if before.is_some_and(|b| b.is_ascii_alphanumeric()) {
            continue;
        }
        let rest = &lower.as_bytes()[at + issue.len()..];
        let rest = rest.strip_prefix(b" ").unwrap_or(rest);
        let rest = rest.strip_prefix(b"#").unwrap_or(rest);
        if rest.first().is_some_and(u8::is_ascii_digit) {
            return Some("cites an issue number");
        }
    }
    None
}

#[test]
fn matcher_flags_what_it_should() {
    let spec = ["SP", "EC"].concat();
    let issue = ["Iss", "ue"].concat();
    for bad in [
        format!("// see {spec} §2 rule 4"),
        format!("(the {spec}'s table)"),
        format!("/// {issue} 3's targets"),
        format!("fn measure_{}3() {{}}", issue.to_lowercase()),
        format!("as {} #12 asks", issue.to_uppercase()),
    ] {
        assert!(dangling_reference(&bad).is_some(), "not flagged: {bad}");
    }
    for good in [
        "RFC 3261 §16.11".to_string(),
        "docs/methods.md, Fallbacks".to_string(),
        format!("a known {issue} with the socket"),
        format!("{spec}_FILE"),
        "tissue 3".to_string(),
    ] {
        assert!(dangling_reference(&good).is_none(), "flagged: {good}");
    }
}

#[test]
fn no_reference_leaves_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut all = Vec::new();
    for dir in ROOTS {
        files(&root.join(dir), &mut all);
    }
    all.extend(TOP_FILES.iter().map(|f| root.join(f)));
    assert!(all.len() > 50, "found the sources: {}", all.len());
    let mut found = Vec::new();
    for path in &all {
        // Binary fixtures and images are not text a reader follows.
        let Ok(text) = std::fs::read_to_string(path) else {
            continue;
        };
        for (n, line) in text.lines().enumerate() {
            if let Some(why) = dangling_reference(line) {
                let shown = path.strip_prefix(root).unwrap_or(path).display();
                found.push(format!("{shown}:{}: {why}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "references to documents outside the repository; cite docs/ or an RFC section \
         instead:\n{}",
        found.join("\n")
    );
}
