//! Configuration: the model, the YAML loader and validation. PURE (apart from [`load`],
//! which reads the file and the PEM files its `tls` fields name).
//!
//! A file is read into a located YAML tree ([`yaml`]), then converted and validated
//! field by field ([`parse`]); every problem is reported with its line, column and field
//! path, and nothing is returned unless the whole file is valid, so a bad file can never
//! half-apply.

mod env;
pub(crate) mod model;
mod parse;
pub(crate) mod yaml;

pub use model::*;
pub use parse::{Problem, parse_duration};

use std::fmt;
use std::path::{Path, PathBuf};

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}", Report { file, problems })]
    Invalid {
        file: String,
        problems: Vec<Problem>,
    },
}

impl ConfigError {
    /// The individual problems (empty for I/O errors).
    pub fn problems(&self) -> &[Problem] {
        match self {
            ConfigError::Io { .. } => &[],
            ConfigError::Invalid { problems, .. } => problems,
        }
    }
}

/// `FILE:LINE:COL: field.path: problem`, one line per problem.
struct Report<'a> {
    file: &'a str,
    problems: &'a [Problem],
}

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(
                f,
                "{}",
                ProblemLine {
                    file: self.file,
                    problem: p
                }
            )?;
        }
        Ok(())
    }
}

/// One problem formatted as `FILE:LINE:COL: field.path: problem`.
pub struct ProblemLine<'a> {
    pub file: &'a str,
    pub problem: &'a Problem,
}

impl fmt::Display for ProblemLine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = self.problem;
        if p.path.is_empty() {
            write!(
                f,
                "{}:{}:{}: {}",
                self.file, p.pos.line, p.pos.col, p.message
            )
        } else {
            write!(
                f,
                "{}:{}:{}: {}: {}",
                self.file, p.pos.line, p.pos.col, p.path, p.message
            )
        }
    }
}

/// One warning formatted as `FILE:LINE:COL: field.path: warning: message` ([`Config::warnings`]).
pub struct WarningLine<'a> {
    pub file: &'a str,
    pub warning: &'a Problem,
}

impl Config {
    /// Each of [`Config::warnings`], to be printed as read from `file`.
    pub fn warning_lines<'a>(&'a self, file: &'a str) -> impl Iterator<Item = WarningLine<'a>> {
        self.warnings
            .iter()
            .map(move |warning| WarningLine { file, warning })
    }
}

impl fmt::Display for WarningLine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = self.warning;
        write!(f, "{}:{}:{}: ", self.file, w.pos.line, w.pos.col)?;
        if !w.path.is_empty() {
            write!(f, "{}: ", w.path)?;
        }
        write!(f, "warning: {}", w.message)
    }
}

/// Parse and validate YAML text. `file` names the source in error lines; `${NAME}`
/// references read the process environment.
pub fn from_str(file: &str, text: &str) -> Result<Config, ConfigError> {
    from_str_with_env(file, text, &|name| std::env::var(name).ok())
}

/// [`from_str`] with the environment `${NAME}` references read from `env`.
pub fn from_str_with_env(
    file: &str,
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigError> {
    let invalid = |problems| ConfigError::Invalid {
        file: file.to_owned(),
        problems,
    };
    let mut root = yaml::parse(text).map_err(|e| {
        invalid(vec![Problem {
            pos: e.pos,
            path: String::new(),
            message: format!("YAML syntax: {}", e.message),
        }])
    })?;
    let mut unset = Vec::new();
    env::substitute(&mut root, "", env, &mut unset);
    match parse::convert(&root) {
        Ok(c) if unset.is_empty() => Ok(c),
        Ok(_) => Err(invalid(unset)),
        Err(mut problems) => {
            // A field whose reference could not be expanded is reported for that alone.
            problems.retain(|p| !unset.iter().any(|u| u.pos == p.pos && u.path == p.path));
            problems.extend(unset);
            problems.sort();
            problems.dedup();
            Err(invalid(problems))
        }
    }
}

/// Read, parse and validate a config file.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let bytes = std::fs::read(path).map_err(|source| ConfigError::Io {
        path: path.to_owned(),
        source,
    })?;
    let file = path.display().to_string();
    match String::from_utf8(bytes) {
        Ok(text) => {
            let mut cfg = from_str(&file, &text)?;
            let dir = path.parent().unwrap_or(Path::new(""));
            let mut problems = read_tls_files(&mut cfg, dir);
            problems.extend(read_flow_keys(&mut cfg, dir));
            if problems.is_empty() {
                Ok(cfg)
            } else {
                Err(ConfigError::Invalid { file, problems })
            }
        }
        Err(e) => {
            let bytes = e.as_bytes();
            let valid = e.utf8_error().valid_up_to();
            Err(ConfigError::Invalid {
                file,
                problems: vec![Problem {
                    pos: position_of(bytes, valid),
                    path: String::new(),
                    message: "not valid UTF-8 (YAML files are UTF-8 text)".into(),
                }],
            })
        }
    }
}

/// Read `flow_key_file` (relative to `dir`): one key per line, 32 hex digits, the first
/// signing; blank lines and `#` comments skipped. A file that cannot be read, a bad line or
/// no key at all is a problem at the field.
fn read_flow_keys(cfg: &mut Config, dir: &Path) -> Vec<Problem> {
    let Some(fk) = cfg.flow_key_file.as_mut() else {
        return Vec::new();
    };
    if fk.file.path.is_relative() {
        fk.file.path = dir.join(&fk.file.path);
    }
    let text = match std::fs::read_to_string(&fk.file.path) {
        Ok(t) => t,
        Err(e) => {
            return vec![problem_at(
                &fk.file,
                format!("cannot read {}: {e}", fk.file.path.display()),
            )];
        }
    };
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match crate::sip::flow::parse_key(line) {
            Some(k) => keys.push(k),
            None => {
                return vec![problem_at(
                    &fk.file,
                    format!(
                        "{} line {}: expected a key of 32 hex digits (e.g. from `openssl rand -hex 16`)",
                        fk.file.path.display(),
                        i + 1
                    ),
                )];
            }
        }
    }
    if keys.is_empty() {
        return vec![problem_at(
            &fk.file,
            format!("{} holds no key", fk.file.path.display()),
        )];
    }
    fk.keys = keys;
    Vec::new()
}

/// Resolve the files the `tls` fields name against `dir` (the config file's directory) when
/// relative, read them and build the rustls configurations into the model. Every file that
/// cannot be used is a problem at the field naming it.
fn read_tls_files(cfg: &mut Config, dir: &Path) -> Vec<Problem> {
    use crate::tls::{ClientFiles, Field, Loaded, ServerFiles};
    let resolve = |f: &mut ConfigFile| {
        if f.path.is_relative() {
            f.path = dir.join(&f.path);
        }
    };
    let mut problems = Vec::new();
    for v in &mut cfg.vservers {
        // The protocols the routing rules' `alpn` tests name are offered in the handshake.
        let alpn = v
            .routes
            .as_ref()
            .map(crate::route::Routes::alpn_protocols)
            .unwrap_or_default();
        let Some(tls) = v.tls.as_mut() else { continue };
        resolve(&mut tls.cert);
        resolve(&mut tls.key);
        if let Some(ca) = tls.client_ca.as_mut() {
            resolve(ca);
        }
        if unreadable(
            &[Some(&tls.cert), Some(&tls.key), tls.client_ca.as_ref()],
            &mut problems,
        ) {
            continue;
        }
        let files = ServerFiles {
            cert: &tls.cert.path,
            key: &tls.key.path,
            client_ca: tls.client_ca.as_ref().map(|c| c.path.as_path()),
        };
        match crate::tls::server_config(&files) {
            Ok((c, fingerprint)) => {
                let (c, fingerprint) = crate::tls::offering_alpn(c, fingerprint, alpn);
                tls.loaded = Loaded::fingerprinted(c, fingerprint);
            }
            Err(p) => {
                let at = match p.field {
                    Field::Key => &tls.key,
                    Field::ClientCa => tls.client_ca.as_ref().unwrap_or(&tls.cert),
                    Field::Cert | Field::Ca => &tls.cert,
                };
                problems.push(problem_at(at, p.error.to_string()));
            }
        }
    }
    for s in &mut cfg.services {
        let Some(tls) = s.tls.as_mut() else { continue };
        resolve(&mut tls.ca);
        for f in [tls.cert.as_mut(), tls.key.as_mut()].into_iter().flatten() {
            resolve(f);
        }
        if unreadable(
            &[Some(&tls.ca), tls.cert.as_ref(), tls.key.as_ref()],
            &mut problems,
        ) {
            continue;
        }
        let files = ClientFiles {
            ca: &tls.ca.path,
            cert: tls.cert.as_ref().map(|c| c.path.as_path()),
            key: tls.key.as_ref().map(|c| c.path.as_path()),
        };
        match crate::tls::client_config(&files) {
            Ok(c) => tls.loaded = Loaded::new(c),
            Err(p) => {
                let at = match p.field {
                    Field::Cert => tls.cert.as_ref(),
                    Field::Key => tls.key.as_ref(),
                    Field::Ca | Field::ClientCa => None,
                };
                problems.push(problem_at(at.unwrap_or(&tls.ca), p.error.to_string()));
            }
        }
    }
    problems.sort();
    problems
}

fn problem_at(f: &ConfigFile, message: String) -> Problem {
    Problem {
        pos: f.pos,
        path: f.field.clone(),
        message,
    }
}

/// Report every file of `files` that cannot be opened (not only the first of a block); true
/// when one could not.
fn unreadable(files: &[Option<&ConfigFile>], problems: &mut Vec<Problem>) -> bool {
    let mut any = false;
    for f in files.iter().flatten() {
        if let Err(e) = std::fs::File::open(&f.path) {
            problems.push(problem_at(
                f,
                format!("cannot read {}: {e}", f.path.display()),
            ));
            any = true;
        }
    }
    any
}

/// Line and column (1-based, the column counted in characters) of byte `at` of `bytes`,
/// whose first `at` bytes are valid UTF-8.
fn position_of(bytes: &[u8], at: usize) -> yaml::Pos {
    let before = bytes.get(..at).unwrap_or(bytes);
    let line_start = before
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |p| p + 1);
    let line = before.iter().filter(|b| **b == b'\n').count() + 1;
    let col = std::str::from_utf8(&before[line_start..]).map_or(1, |s| s.chars().count() + 1);
    yaml::Pos {
        line: u32::try_from(line).unwrap_or(u32::MAX),
        col: u32::try_from(col).unwrap_or(u32::MAX),
    }
}

impl Config {
    /// Addresses of a vserver's services in member order, IPv4-mapped IPv6 folded to IPv4
    /// (so they compare equal to the source addresses the kernel reports).
    pub fn member_addrs(&self, v: &Vserver) -> Vec<std::net::SocketAddr> {
        v.members()
            .filter_map(|i| self.services.get(i))
            .map(|s| std::net::SocketAddr::new(s.address.ip().to_canonical(), s.address.port()))
            .collect()
    }

    /// Index of the service called `name`.
    pub fn service_index(&self, name: &str) -> Option<usize> {
        self.services.iter().position(|s| s.name == name)
    }
}

/// One line per vserver describing what it will do, for `fulcrum check`.
pub fn summary(cfg: &Config) -> Vec<String> {
    cfg.vservers
        .iter()
        .map(|v| {
            let binds: Vec<String> = if v.protocol.is_packet() {
                let sticky = if v.sticky { " (sticky)" } else { "" };
                vec![format!("interface {}{sticky}", v.interfaces.join(" "))]
            } else {
                v.bind.iter().map(ToString::to_string).collect()
            };
            let services: Vec<String> = v
                .services
                .iter()
                .filter_map(|&i| cfg.services.get(i))
                .map(|s| match &s.dns {
                    None => s.name.clone(),
                    Some(d) => {
                        let name = d.name.trim_end_matches('.');
                        match d.kind {
                            DnsKind::Srv => format!("{} (dns {name}, SRV)", s.name),
                            DnsKind::Host { port } => format!("{} (dns {name}:{port})", s.name),
                        }
                    }
                })
                .collect();
            let algo = if v.method.is_hash() {
                format!(
                    " ({}, {} fingers)",
                    cfg.lb.hash_algorithm.name(),
                    cfg.lb.hash_fingers
                )
            } else {
                String::new()
            };
            let slow = match v.slow_start {
                Some(s) if s.new_service_request_rate > 0 => format!(
                    ", slow start {} {} every {:?}",
                    s.new_service_request_rate,
                    match s.unit {
                        RateUnit::PerSecond => "req/s",
                        RateUnit::Percent => "%",
                    },
                    s.increment_interval
                ),
                _ => String::new(),
            };
            let pool = if services.is_empty() {
                "no services of its own".to_owned()
            } else {
                format!("{} service(s): {}", services.len(), services.join(", "))
            };
            let mut line = format!(
                "vserver {}: {} on {}, {}{}{}, {pool}",
                v.name,
                v.protocol.name(),
                binds.join(" "),
                v.method.name(),
                algo,
                slow,
            );
            if let Some(r) = &v.routes {
                let names = |p: &RoutePool| -> Vec<&str> {
                    p.services
                        .iter()
                        .filter_map(|&i| cfg.services.get(i).map(|s| s.name.as_str()))
                        .collect()
                };
                let what = |t: &crate::route::Target| match t {
                    crate::route::Target::Pool(0) => "the vserver's services".to_owned(),
                    crate::route::Target::Pool(k) => v
                        .route_pools
                        .get(k - 1)
                        .map_or_else(String::new, |p| pool_line(v, p, &names(p))),
                    crate::route::Target::Reject { code, reason } => {
                        format!("reject {code} {reason}")
                    }
                    crate::route::Target::Drop => "drop".to_owned(),
                };
                for rule in &r.rules {
                    line.push_str(&format!(
                        "\n    route {}: {}",
                        rule.name,
                        what(&rule.target)
                    ));
                }
                line.push_str(&format!("\n    default: {}", what(&r.default)));
            }
            line
        })
        .collect()
}

/// A rule's pool as `fulcrum check` prints it: its services, then its method, `hash_length`,
/// slow start and failover where they differ from the vserver's.
fn pool_line(v: &Vserver, p: &RoutePool, services: &[&str]) -> String {
    let mut out = services.join(", ");
    let mut own = Vec::new();
    if let Some(m) = p.method.filter(|m| *m != v.method) {
        own.push(m.name().to_owned());
    }
    if p.hash_length != v.hash.hash_length {
        own.push(format!("hash_length {}", p.hash_length));
    }
    if p.slow_start != v.slow_start {
        own.push(match &p.slow_start {
            Some(s) => format!("slow start {}", s.new_service_request_rate),
            None => "no slow start".to_owned(),
        });
    }
    if p.failover != v.failover {
        own.push(match &p.failover {
            Some(f) => format!("failover: {} tries", f.tries),
            None => "failover off".to_owned(),
        });
    }
    if !own.is_empty() {
        out.push_str(&format!(" ({})", own.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `fulcrum check` names what a rule's pool sets apart from the vserver.
    #[test]
    fn the_summary_shows_a_pools_own_fields() {
        let yaml = "services:\n  - { name: a, address: 127.0.0.1:5071, protocol: sip-udp }\n  - { name: b, address: 127.0.0.1:5072, protocol: sip-udp }\nvservers:\n  - name: v\n    protocol: sip-udp\n    bind: 127.0.0.1:5060\n    services: [a]\n    routes:\n      - { name: same, match: { method: REGISTER }, services: [b] }\n      - { name: own, match: { method: MESSAGE }, services: [b], method: url_hash, hash_length: 12, failover: off }\n";
        let cfg = from_str("t.yaml", yaml).expect("config");
        let text = summary(&cfg).join("\n");
        assert!(text.contains("route same: b\n"), "{text}");
        assert!(
            text.contains("route own: b (url_hash, hash_length 12, failover off)"),
            "{text}"
        );
    }

    /// A file that is not UTF-8 is reported at the first bad byte, like any other problem.
    #[test]
    fn non_utf8_is_reported_with_its_position() {
        let path =
            std::env::temp_dir().join(format!("fulcrum-nonutf8-{}.yaml", std::process::id()));
        std::fs::write(&path, b"lb:\n  hash_algorithm: c\xc3\xa9\xffrp\n").expect("write");
        let e = load(&path).expect_err("invalid");
        let _ = std::fs::remove_file(&path);
        let p = e.problems();
        assert_eq!(p.len(), 1, "{e}");
        assert_eq!((p[0].pos.line, p[0].pos.col), (2, 21), "{e}");
        assert!(e.to_string().contains(":2:21: not valid UTF-8"), "{e}");
    }
}
