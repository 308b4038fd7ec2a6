//! Test certificates and TLS peers: a CA made in the test (rcgen) that issues server and
//! client certificates into the test's own directory, rustls configurations from them, and
//! blocking TLS streams over std sockets for the test peers. Never files checked in.

use super::ConfigFile;
use fulcrum::ops::Ops;
use fulcrum::tls::{Reason, TlsListener};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConnection, RootCertStore, ServerConnection, StreamOwned};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A test CA that issues certificates into the test's directory.
pub struct Ca {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

/// An issued certificate: its DER, and its PEM files.
pub struct Issued {
    pub der: CertificateDer<'static>,
    pub key_der: Vec<u8>,
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
}

impl Ca {
    pub fn new(cn: &str) -> Ca {
        let key = rcgen::KeyPair::generate().expect("ca key");
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        let cert = p.self_signed(&key).expect("ca cert");
        Ca { cert, key }
    }

    pub fn der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// The CA's certificate as `name` in `f`'s directory.
    pub fn write(&self, f: &ConfigFile, name: &str) -> PathBuf {
        f.beside(name, &self.cert.pem())
    }

    /// A certificate for `names` (DNS names or IP addresses) with common name `cn`, written
    /// as `stem.crt` / `stem.key` beside `f`.
    pub fn issue_for(&self, f: &ConfigFile, stem: &str, names: &[&str], cn: &str) -> Issued {
        let key = rcgen::KeyPair::generate().expect("key");
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut p = rcgen::CertificateParams::new(names).expect("params");
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        let cert = p.signed_by(&key, &self.cert, &self.key).expect("sign");
        Issued {
            der: cert.der().clone(),
            key_der: key.serialize_der(),
            cert_path: f.beside(&format!("{stem}.crt"), &cert.pem()),
            key_path: f.beside(&format!("{stem}.key"), &key.serialize_pem()),
        }
    }

    /// A certificate for DNS name `dns` with common name `cn` (see [`Ca::issue_for`]).
    pub fn issue(&self, f: &ConfigFile, stem: &str, dns: &str, cn: &str) -> Issued {
        self.issue_for(f, stem, &[dns], cn)
    }

    pub fn roots(&self) -> RootCertStore {
        let mut r = RootCertStore::empty();
        r.add(self.der()).expect("root");
        r
    }
}

impl Issued {
    pub fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }
}

/// A client configuration trusting `ca`, presenting `cert` when given.
pub fn client_config(ca: &Ca, cert: Option<&Issued>) -> Arc<rustls::ClientConfig> {
    let b = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(ca.roots());
    Arc::new(match cert {
        Some(c) => b
            .with_client_auth_cert(vec![c.der.clone()], c.key())
            .expect("client cert"),
        None => b.with_no_client_auth(),
    })
}

/// A server configuration presenting `cert` (no client certificate asked).
pub fn server_config(cert: &Issued) -> Arc<rustls::ServerConfig> {
    Arc::new(
        rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(vec![cert.der.clone()], cert.key())
            .expect("server cert"),
    )
}

pub type ClientStream = StreamOwned<ClientConnection, TcpStream>;
pub type ServerStream = StreamOwned<ServerConnection, TcpStream>;

/// A TLS connection to `to` for `name` (handshake done within `wait`).
pub fn connect(
    to: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
    name: &str,
    wait: Duration,
) -> std::io::Result<ClientStream> {
    let sock = TcpStream::connect_timeout(&to, wait)?;
    sock.set_read_timeout(Some(wait))?;
    sock.set_nodelay(true)?;
    let server = ServerName::try_from(name.to_owned()).map_err(std::io::Error::other)?;
    let conn = ClientConnection::new(Arc::clone(cfg), server).map_err(std::io::Error::other)?;
    let mut s = StreamOwned::new(conn, sock);
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock)?;
    }
    Ok(s)
}

/// What `openssl s_client -tls1_2` printed when it asked `to` (for `name`, verified against
/// the CA file `ca`) for a renegotiation once its handshake was done (its `R` command), and
/// whether it ended within `wait` of asking: a server that answers (the `no_renegotiation`
/// alert, or a close) ends it, one that never answers leaves it waiting (killed then). `None`
/// when there is no openssl binary.
pub fn openssl_renegotiate(
    to: SocketAddr,
    ca: &std::path::Path,
    name: &str,
    wait: Duration,
) -> Option<(bool, String)> {
    use std::io::{BufRead, Write};
    use std::process::{Command, Stdio};
    Command::new("openssl").arg("version").output().ok()?;
    let mut child = Command::new("openssl")
        .args(["s_client", "-tls1_2", "-brief", "-verify_return_error"])
        .args(["-connect", &to.to_string(), "-servername", name])
        .arg("-CAfile")
        .arg(ca)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run openssl");
    let (tx, lines) = std::sync::mpsc::channel::<String>();
    let stderr = child.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let mut out = String::new();
    let deadline = Instant::now() + wait;
    // `-brief` says so once the handshake is done.
    while !out.contains("CONNECTION ESTABLISHED") {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(l) => out.push_str(&(l + "\n")),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("no TLS 1.2 connection to {to}: {out}");
            }
        }
    }
    // The stdin stays open: its end would end s_client whatever the server does.
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(b"R\n").expect("ask for a renegotiation");
    stdin.flush().expect("flush");
    let deadline = Instant::now() + wait;
    let ended = loop {
        if child.try_wait().expect("wait").is_some() {
            break true;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break false;
        }
        match lines.recv_timeout(Duration::from_millis(20)) {
            Ok(l) => out.push_str(&(l + "\n")),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    drop(stdin);
    while let Ok(l) = lines.recv_timeout(Duration::from_millis(200)) {
        out.push_str(&(l + "\n"));
    }
    Some((ended, out))
}

/// fulcrum started from the config file `f` (its TLS files read beside it).
pub fn start(f: &ConfigFile) -> Arc<Ops> {
    let cfg = fulcrum::config::load(&f.path).unwrap_or_else(|e| panic!("config: {e}"));
    Ops::start(cfg, Some(f.path.clone())).expect("start")
}

/// The first bound address of vserver `name`.
pub fn addr(ops: &Ops, name: &str) -> SocketAddr {
    ops.with_vservers(|vs, _| vs.iter().find(|v| v.name == name).map(|v| v.bound[0]))
        .flatten()
        .expect("vserver")
}

/// The TLS listener of vserver `name` (its handshake counters).
pub fn listener(ops: &Ops, name: &str) -> Arc<TlsListener> {
    ops.with_vservers(|vs, _| {
        vs.iter()
            .find(|v| v.name == name)
            .and_then(|v| v.tls().cloned())
    })
    .flatten()
    .expect("a TLS vserver")
}

/// Handshakes `l` counted as failed for reason `r`.
pub fn failed(l: &TlsListener, r: Reason) -> u64 {
    l.counters.failed(r).load(Ordering::Relaxed)
}

/// Handshakes `l` completed.
pub fn completed(l: &TlsListener) -> u64 {
    l.counters.completed.load(Ordering::Relaxed)
}

/// `GET /metrics` of `ops`, through the admin API's router.
pub fn metrics(ops: &Ops) -> String {
    let req = fulcrum::admin::router::Request::new("GET", "/metrics");
    let r = fulcrum::admin::router::handle(ops, &req);
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

/// The handshakes Prometheus text `text` shows from vserver `vserver` toward service
/// `service`: completed, and failed per reason name; `None` when it shows no series for them.
pub fn service_handshakes(text: &str, vserver: &str, service: &str) -> Option<Handshakes> {
    let labels = format!("{{vserver=\"{vserver}\",service=\"{service}\"");
    let mut found = Handshakes::default();
    let mut any = false;
    let completed = format!("fulcrum_tls_service_handshakes_total{labels}}}");
    let failed = format!("fulcrum_tls_service_handshake_failures_total{labels},reason=\"");
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let value = || -> u64 { value.parse().expect("a counter value") };
        if series == completed {
            found.completed = Some(value());
            any = true;
        } else if let Some(reason) = series.strip_prefix(&failed) {
            let reason = reason.strip_suffix("\"}").expect("the last label");
            found.failed.insert(reason.to_owned(), value());
            any = true;
        }
    }
    any.then_some(found)
}

/// What [`service_handshakes`] read.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Handshakes {
    pub completed: Option<u64>,
    pub failed: std::collections::BTreeMap<String, u64>,
}

impl Handshakes {
    /// Failures counted for `r` (0 when its series is missing: see [`Handshakes::lists_every_reason`]).
    pub fn failed(&self, r: Reason) -> u64 {
        self.failed.get(r.name()).copied().unwrap_or(0)
    }

    /// Whether every reason has its series, and nothing else.
    pub fn lists_every_reason(&self) -> bool {
        self.failed.len() == Reason::ALL.len()
            && Reason::ALL
                .iter()
                .all(|r| self.failed.contains_key(r.name()))
    }

    /// Failures for every reason.
    pub fn failed_total(&self) -> u64 {
        self.failed.values().sum()
    }

    /// Failures for reasons other than `r`.
    pub fn failed_otherwise(&self, r: Reason) -> u64 {
        (self.failed.iter())
            .filter(|(n, _)| n.as_str() != r.name())
            .map(|(_, v)| v)
            .sum()
    }
}
