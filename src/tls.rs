//! TLS on stream vservers and services (docs/tls.md): rustls configurations built from the
//! PEM files a config names, a swappable holder so that a reload changes the certificate of
//! new handshakes only (and keeps the running configuration, session cache included, when the
//! files did not change), the server handshake with a time bound and its failures sorted into
//! a few reasons, and the client handshake toward a service. IO at the edges (files,
//! sockets); the sorting of failures ([`Reason::of`]) and what a reload does to a listener
//! ([`renewal`]) are PURE.
//!
//! Nothing here knows the config model or a protocol: [`crate::config`] calls
//! [`server_config`] / [`client_config`] with paths and maps a [`FileProblem`] to the
//! location of the field, and a data path (tcp, http, and any stream protocol that opts in)
//! holds a [`TlsListener`] per vserver and a [`TlsConnector`] per service.
//!
//! TLS 1.2 and 1.3 only, the `ring` provider, no OpenSSL.

use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How long a server handshake may take when the vserver does not say
/// (`tls_handshake_timeout`): a client that never finishes costs a timer, not a worker.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a PEM file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{} is not PEM: {message}", path.display())]
    Pem { path: PathBuf, message: String },
    #[error("{} holds no certificate (expected a PEM `CERTIFICATE` block)", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{} holds no private key (expected a PEM `PRIVATE KEY`, `RSA PRIVATE KEY` or `EC PRIVATE KEY` block)", path.display())]
    NoKey { path: PathBuf },
    #[error("{} holds a private key that cannot be used: {source}", path.display())]
    BadKey {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("{} holds a certificate that cannot be used: {source}", path.display())]
    BadCertificate {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("the key in {} does not match the certificate in {}", key.display(), cert.display())]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("`cert` and `key` go together: give both or neither")]
    CertWithoutKey,
    #[error("cannot build the TLS configuration: {0}")]
    Build(String),
}

/// The config field a [`TlsError`] is about, so that it can be reported where it was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Cert,
    Key,
    ClientCa,
    Ca,
}

impl Field {
    /// The field's name in the config.
    pub fn name(self) -> &'static str {
        match self {
            Field::Cert => "cert",
            Field::Key => "key",
            Field::ClientCa => "client_ca",
            Field::Ca => "ca",
        }
    }
}

/// A [`TlsError`] and the field it belongs to.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct FileProblem {
    pub field: Field,
    #[source]
    pub error: TlsError,
}

fn at(field: Field) -> impl FnOnce(TlsError) -> FileProblem {
    move |error| FileProblem { field, error }
}

/// The PEM files of a terminating listener.
#[derive(Debug, Clone, Copy)]
pub struct ServerFiles<'a> {
    pub cert: &'a Path,
    pub key: &'a Path,
    /// Trust anchors for client certificates: mutual TLS when present.
    pub client_ca: Option<&'a Path>,
}

/// The PEM files of an originating client.
#[derive(Debug, Clone, Copy)]
pub struct ClientFiles<'a> {
    /// Trust anchors for the service's certificate.
    pub ca: &'a Path,
    /// A client certificate and its key, for a service that asks for one.
    pub cert: Option<&'a Path>,
    pub key: Option<&'a Path>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

const VERSIONS: &[&rustls::SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Every certificate of the PEM text `pem` read from `path` (at least one).
pub fn certificates_of(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The first private key of the PEM text `pem` read from `path`.
pub fn key_of(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::NoKey {
            path: path.to_owned(),
        },
        other => TlsError::Pem {
            path: path.to_owned(),
            message: other.to_string(),
        },
    })
}

/// A certificate chain and its key read from their files (see [`certified_from`]).
fn certified(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), FileProblem> {
    let cert_pem = read(cert).map_err(at(Field::Cert))?;
    let key_pem = read(key).map_err(at(Field::Key))?;
    certified_from((cert, &cert_pem), (key, &key_pem))
}

/// A certificate chain and its key from the PEM text of their files, checked against each
/// other: the key must parse and its public half be the end-entity certificate's.
fn certified_from(
    (cert, cert_pem): (&Path, &[u8]),
    (key, key_pem): (&Path, &[u8]),
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), FileProblem> {
    let chain = certificates_of(cert, cert_pem).map_err(at(Field::Cert))?;
    let der = key_of(key, key_pem).map_err(at(Field::Key))?;
    let signing = provider()
        .key_provider
        .load_private_key(der.clone_key())
        .map_err(|source| {
            at(Field::Key)(TlsError::BadKey {
                path: key.to_owned(),
                source,
            })
        })?;
    match rustls::sign::CertifiedKey::new(chain.clone(), signing).keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {
            Ok((chain, der))
        }
        Err(rustls::Error::InconsistentKeys(_)) => Err(at(Field::Key)(TlsError::KeyMismatch {
            cert: cert.to_owned(),
            key: key.to_owned(),
        })),
        Err(source) => Err(at(Field::Cert)(TlsError::BadCertificate {
            path: cert.to_owned(),
            source,
        })),
    }
}

/// Trust anchors from a PEM file of CA certificates.
fn roots(path: &Path, field: Field) -> Result<RootCertStore, FileProblem> {
    roots_from(path, &read(path).map_err(at(field))?, field)
}

/// Trust anchors from the PEM text `pem` of the CA file `path`.
fn roots_from(path: &Path, pem: &[u8], field: Field) -> Result<RootCertStore, FileProblem> {
    let mut store = RootCertStore::empty();
    for der in certificates_of(path, pem).map_err(at(field))? {
        store.add(der).map_err(|source| {
            at(field)(TlsError::BadCertificate {
                path: path.to_owned(),
                source,
            })
        })?;
    }
    Ok(store)
}

/// What a listener's server configuration is built from, digested (xxh3-128, the crate's
/// hash: this tells an operator's edit from no edit, it is no defence against a forger who
/// can already write the key file): the bytes of its certificate, key and client CA files,
/// and whether it has a client CA at all. The protocol versions and the crypto provider are
/// fixed; a setting that comes to shape the configuration belongs in here too. Two loads
/// with the same fingerprint build the same configuration, so a reload keeps the running one
/// and its session cache ([`TlsListener::store`]); a file renewed in place under the same
/// name changes it, whatever its modification time says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint(u128);

impl Fingerprint {
    /// The digest of `files` in order, each with its length; `None` (a file not given) is
    /// told apart from an empty file.
    fn of(files: &[Option<&[u8]>]) -> Fingerprint {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for file in files {
            match file {
                None => h.update(&[0]),
                Some(bytes) => {
                    h.update(&[1]);
                    h.update(&u64::try_from(bytes.len()).unwrap_or(u64::MAX).to_be_bytes());
                    h.update(bytes);
                }
            }
        }
        Fingerprint(h.digest128())
    }
}

/// A server configuration from `files`: the certificate chain and key (checked to match),
/// and, with `client_ca`, client certificates required and verified against it; with the
/// [`Fingerprint`] of the bytes it was built from (each file is read once).
pub fn server_config(
    files: &ServerFiles<'_>,
) -> Result<(Arc<ServerConfig>, Fingerprint), FileProblem> {
    let cert_pem = read(files.cert).map_err(at(Field::Cert))?;
    let key_pem = read(files.key).map_err(at(Field::Key))?;
    let ca_pem = match files.client_ca {
        Some(ca) => Some((ca, read(ca).map_err(at(Field::ClientCa))?)),
        None => None,
    };
    let fingerprint = Fingerprint::of(&[
        Some(&cert_pem),
        Some(&key_pem),
        ca_pem.as_ref().map(|(_, pem)| pem.as_slice()),
    ]);
    let (chain, key) = certified_from((files.cert, &cert_pem), (files.key, &key_pem))?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(|e| at(Field::Cert)(TlsError::Build(e.to_string())))?;
    let builder = match &ca_pem {
        None => builder.with_no_client_auth(),
        Some((ca, pem)) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots_from(ca, pem, Field::ClientCa)?),
                provider(),
            )
            .build()
            .map_err(|e| at(Field::ClientCa)(TlsError::Build(e.to_string())))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(chain, key)
        .map_err(|e| at(Field::Cert)(TlsError::Build(e.to_string())))?;
    Ok((Arc::new(config), fingerprint))
}

/// `config` offering the application protocols `alpn` in the handshake (RFC 7301 §3.2: the
/// server picks the first of its list the client offers, and refuses a client that offers
/// only others with `no_application_protocol`), with a fingerprint that tells the lists
/// apart, so a reload that changes them builds a new configuration.
pub fn offering_alpn(
    config: Arc<ServerConfig>,
    fingerprint: Fingerprint,
    alpn: Vec<Vec<u8>>,
) -> (Arc<ServerConfig>, Fingerprint) {
    if alpn.is_empty() {
        return (config, fingerprint);
    }
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&fingerprint.0.to_be_bytes());
    for p in &alpn {
        h.update(&[u8::try_from(p.len()).unwrap_or(u8::MAX)]);
        h.update(p);
    }
    let mut c = Arc::unwrap_or_clone(config);
    c.alpn_protocols = alpn;
    (Arc::new(c), Fingerprint(h.digest128()))
}

/// A client configuration from `files`: the service's certificate verified against `ca`,
/// with a client certificate when `cert` and `key` are given.
pub fn client_config(files: &ClientFiles<'_>) -> Result<Arc<ClientConfig>, FileProblem> {
    let roots = roots(files.ca, Field::Ca)?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(|e| at(Field::Ca)(TlsError::Build(e.to_string())))?
        .with_root_certificates(roots);
    let config = match (files.cert, files.key) {
        (None, None) => builder.with_no_client_auth(),
        (Some(cert), Some(key)) => {
            let (chain, key) = certified(cert, key)?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| at(Field::Cert)(TlsError::Build(e.to_string())))?
        }
        (Some(_), None) => return Err(at(Field::Cert)(TlsError::CertWithoutKey)),
        (None, Some(_)) => return Err(at(Field::Key)(TlsError::CertWithoutKey)),
    };
    Ok(Arc::new(config))
}

/// Why a handshake failed, as counted (`fulcrum_tls_handshake_failures_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Not finished within the handshake timeout.
    Timeout,
    /// The peer does not speak TLS (plaintext on the TLS port, or garbage records).
    NotTls,
    /// Mutual TLS: the client presented no certificate.
    NoCertificate,
    /// A certificate was refused as not issued by a trusted CA (by us, or by the peer's alert).
    UnknownCa,
    /// A certificate was refused for another reason (expired, wrong name, bad encoding...).
    BadCertificate,
    /// The peers could not agree (versions, cipher suites) or one broke the protocol.
    Protocol,
    /// The peer closed the connection before the handshake finished.
    Closed,
    /// A socket error.
    Io,
}

impl Reason {
    /// Every reason, in the order the metrics list them.
    pub const ALL: [Reason; 8] = [
        Reason::Timeout,
        Reason::NotTls,
        Reason::NoCertificate,
        Reason::UnknownCa,
        Reason::BadCertificate,
        Reason::Protocol,
        Reason::Closed,
        Reason::Io,
    ];

    /// The `reason` label.
    pub fn name(self) -> &'static str {
        match self {
            Reason::Timeout => "timeout",
            Reason::NotTls => "not_tls",
            Reason::NoCertificate => "no_certificate",
            Reason::UnknownCa => "unknown_ca",
            Reason::BadCertificate => "bad_certificate",
            Reason::Protocol => "protocol",
            Reason::Closed => "closed",
            Reason::Io => "io",
        }
    }

    /// The reason of a handshake that ended with `e` (tokio-rustls carries rustls's error
    /// inside an `io::Error`).
    pub fn of(e: &io::Error) -> Reason {
        if let Some(tls) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
            return Reason::of_tls(tls);
        }
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => Reason::Closed,
            io::ErrorKind::TimedOut => Reason::Timeout,
            _ => Reason::Io,
        }
    }

    /// The reason of a handshake that rustls ended with `e`.
    pub fn of_tls(e: &rustls::Error) -> Reason {
        use rustls::{
            AlertDescription as A, CertificateError as C, Error as E, InvalidMessage as M,
        };
        match e {
            // The first bytes are not a TLS record: no TLS content type, no TLS version, or a
            // "record" longer than TLS allows (what an HTTP request line reads as).
            E::InvalidMessage(
                M::InvalidContentType | M::UnknownProtocolVersion | M::MessageTooLarge,
            )
            | E::PeerSentOversizedRecord => Reason::NotTls,
            E::NoCertificatesPresented => Reason::NoCertificate,
            E::InvalidCertificate(C::UnknownIssuer) | E::AlertReceived(A::UnknownCA) => {
                Reason::UnknownCa
            }
            E::InvalidCertificate(_)
            | E::AlertReceived(
                A::BadCertificate
                | A::CertificateUnknown
                | A::CertificateExpired
                | A::CertificateRevoked
                | A::UnsupportedCertificate
                | A::CertificateRequired,
            ) => Reason::BadCertificate,
            _ => Reason::Protocol,
        }
    }
}

/// Handshakes of one listener, or toward one service: completed, failed by reason, and the
/// renegotiations the peer asked for on an established connection and was refused.
#[derive(Debug, Default)]
pub struct HandshakeCounters {
    pub completed: AtomicU64,
    failed: [AtomicU64; Reason::ALL.len()],
    /// TLS 1.2 renegotiations refused ([`MaybeTls`]): the peer asked for a new handshake (a
    /// client's ClientHello, a service's HelloRequest) and got the `no_renegotiation` warning
    /// alert (RFC 5246 section 7.2.2), or, asking again, a fatal alert and the close.
    pub renegotiations_refused: AtomicU64,
}

impl HandshakeCounters {
    /// Count one failure.
    pub fn fail(&self, reason: Reason) {
        if let Some(i) = Reason::ALL.iter().position(|r| *r == reason) {
            self.failed[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Count the outcome of a handshake run under a timeout, and give it as a [`Reason`].
    fn count<S>(
        &self,
        outcome: Result<io::Result<S>, tokio::time::error::Elapsed>,
    ) -> Result<S, Reason> {
        let outcome = match outcome {
            Err(_) => Err(Reason::Timeout),
            Ok(Err(e)) => Err(Reason::of(&e)),
            Ok(Ok(s)) => Ok(s),
        };
        match &outcome {
            Ok(_) => {
                self.completed.fetch_add(1, Ordering::Relaxed);
            }
            Err(r) => self.fail(*r),
        }
        outcome
    }

    /// Failures counted for `reason`.
    pub fn failed(&self, reason: Reason) -> &AtomicU64 {
        let i = Reason::ALL.iter().position(|r| *r == reason).unwrap_or(0);
        &self.failed[i]
    }
}

/// What a terminating listener hands to new handshakes; replaced by a reload
/// ([`TlsListener::store`]).
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub config: Arc<ServerConfig>,
    pub handshake_timeout: Duration,
    /// What `config` was built from; `None` when not known, and then never taken as
    /// unchanged.
    pub fingerprint: Option<Fingerprint>,
}

/// What a reload does to a listener ([`renewal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// The same files and settings: the running configuration stays, and with it the
    /// session cache, so clients resume their sessions across the reload (RFC 8446 section
    /// 2.2; RFC 5246 section 7.3 for TLS 1.2 session IDs).
    Unchanged,
    /// The same configuration, kept, with a new `tls_handshake_timeout`.
    Timeout,
    /// A new certificate, key or client CA: the new configuration replaces the running one,
    /// and the next handshake of every client is a full one.
    Config,
}

/// What storing `next` into a listener that runs `current` does. PURE.
pub fn renewal(current: &ServerTls, next: &ServerTls) -> Renewal {
    let same_files = matches!(
        (current.fingerprint, next.fingerprint),
        (Some(a), Some(b)) if a == b
    );
    if !same_files {
        Renewal::Config
    } else if current.handshake_timeout != next.handshake_timeout {
        Renewal::Timeout
    } else {
        Renewal::Unchanged
    }
}

/// The TLS side of one listening vserver: the current [`ServerTls`] (a reload stores a new
/// one; handshakes already running, and connections established, keep the one they began
/// with) and its handshake counters, which survive reloads.
#[derive(Debug)]
pub struct TlsListener {
    current: ArcSwap<ServerTls>,
    pub counters: Arc<HandshakeCounters>,
}

impl TlsListener {
    pub fn new(tls: ServerTls) -> TlsListener {
        TlsListener {
            current: ArcSwap::from_pointee(tls),
            counters: Arc::default(),
        }
    }

    /// Use `tls` for the handshakes that start from now on; the running configuration (and
    /// its session cache) stays when `tls` was built from the same files ([`renewal`]).
    /// Called by one reload at a time.
    pub fn store(&self, tls: ServerTls) -> Renewal {
        let current = self.current();
        let renewal = renewal(&current, &tls);
        match renewal {
            Renewal::Unchanged => {}
            Renewal::Timeout => self.current.store(Arc::new(ServerTls {
                config: Arc::clone(&current.config),
                ..tls
            })),
            Renewal::Config => self.current.store(Arc::new(tls)),
        }
        renewal
    }

    /// The configuration new handshakes use.
    pub fn current(&self) -> Arc<ServerTls> {
        self.current.load_full()
    }

    /// Run the server handshake on `io` within the handshake timeout, counting the outcome; the
    /// stream counts its refused renegotiations here too.
    pub async fn accept<IO>(&self, io: IO) -> Result<MaybeTls<IO>, Reason>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let tls = self.current();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::clone(&tls.config));
        self.counters
            .count(tokio::time::timeout(tls.handshake_timeout, acceptor.accept(io)).await)
            .map(|s| MaybeTls::counted(s.into(), &self.counters))
    }
}

/// What an originating client hands to new handshakes toward one service.
#[derive(Debug, Clone)]
pub struct ClientTls {
    pub config: Arc<ClientConfig>,
    /// Sent as SNI and checked against the service's certificate.
    pub server_name: ServerName<'static>,
}

/// The TLS side of one service: the current [`ClientTls`] (a reload stores a new one) and the
/// handshakes toward it. The counters are shared, so that a data path rebuilt by a reload
/// counts on with those of the connector it replaces ([`TlsConnector::carrying`]).
#[derive(Debug)]
pub struct TlsConnector {
    current: ArcSwap<ClientTls>,
    pub counters: Arc<HandshakeCounters>,
}

impl TlsConnector {
    pub fn new(tls: ClientTls) -> TlsConnector {
        TlsConnector::carrying(tls, None)
    }

    /// A connector with `tls` that counts on with `old`'s counters when there is one (the
    /// same service of the same vserver before a reload), from zero otherwise.
    pub fn carrying(tls: ClientTls, old: Option<&TlsConnector>) -> TlsConnector {
        TlsConnector {
            current: ArcSwap::from_pointee(tls),
            counters: old.map_or_else(Arc::default, |o| Arc::clone(&o.counters)),
        }
    }

    /// Use `tls` for the handshakes that start from now on.
    pub fn store(&self, tls: ClientTls) {
        self.current.store(Arc::new(tls));
    }

    /// The configuration new handshakes use.
    pub fn current(&self) -> Arc<ClientTls> {
        self.current.load_full()
    }

    /// Run the client handshake on `io` within `timeout`, counting the outcome; the stream
    /// counts its refused renegotiations here too.
    pub async fn connect<IO>(&self, io: IO, timeout: Duration) -> Result<MaybeTls<IO>, Reason>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        self.connect_by(io, tokio::time::Instant::now() + timeout)
            .await
    }

    /// Run the client handshake on `io` until `deadline` at the latest, counting the outcome.
    pub async fn connect_by<IO>(
        &self,
        io: IO,
        deadline: tokio::time::Instant,
    ) -> Result<MaybeTls<IO>, Reason>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let tls = self.current();
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(&tls.config));
        let handshake = connector.connect(tls.server_name.clone(), io);
        self.counters
            .count(tokio::time::timeout_at(deadline, handshake).await)
            .map(|s| MaybeTls::counted(s.into(), &self.counters))
    }
}

/// The name a client sends and checks: `server_name` when given, else the service's host.
/// `None` when `server_name` is neither a DNS name nor an IP address.
pub fn server_name(
    server_name: Option<&str>,
    host: std::net::IpAddr,
) -> Option<ServerName<'static>> {
    match server_name {
        Some(n) => ServerName::try_from(n.to_owned()).ok(),
        None => Some(ServerName::from(host)),
    }
}

/// A loaded rustls configuration carried in the config model next to the file names it was
/// read from, with the [`Fingerprint`] of their content when known. Always equal to another:
/// the reload plan compares file names, and a reload re-reads the files whatever the plan
/// says; the listener compares fingerprints ([`TlsListener::store`]).
#[derive(Clone)]
pub struct Loaded<T> {
    config: Option<Arc<T>>,
    fingerprint: Option<Fingerprint>,
}

impl<T> Default for Loaded<T> {
    fn default() -> Self {
        Loaded {
            config: None,
            fingerprint: None,
        }
    }
}

impl<T> Loaded<T> {
    pub fn new(value: Arc<T>) -> Loaded<T> {
        Loaded {
            config: Some(value),
            fingerprint: None,
        }
    }

    /// A configuration and the fingerprint of the files it was built from.
    pub fn fingerprinted(value: Arc<T>, fingerprint: Fingerprint) -> Loaded<T> {
        Loaded {
            config: Some(value),
            fingerprint: Some(fingerprint),
        }
    }

    /// The configuration, `None` when the files were not read (a config made from text
    /// alone, without [`crate::config::load`]).
    pub fn get(&self) -> Option<&Arc<T>> {
        self.config.as_ref()
    }

    /// What the configuration was built from, when known.
    pub fn fingerprint(&self) -> Option<Fingerprint> {
        self.fingerprint
    }
}

impl<T> PartialEq for Loaded<T> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl<T> std::fmt::Debug for Loaded<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.config.is_some() {
            "Loaded"
        } else {
            "NotLoaded"
        })
    }
}

/// A stream that is plain or TLS (either side), so one data path serves both.
///
/// Reading a TLS stream can make rustls queue records of its own to send: after the handshake,
/// a TLS 1.2 peer's renegotiation request (a client's ClientHello, a service's HelloRequest)
/// is refused with the `no_renegotiation` warning alert (RFC 5246 section 7.2.2; a second
/// request ends the connection with a fatal alert). tokio-rustls sends such records only with
/// the next write, which may never come (a SIP client that waits for its answer, a relay
/// direction that is quiet), so the peer would wait on a connection that looks dead. A read
/// sends them at once ([`answer_after_read`]).
#[derive(Debug)]
pub enum MaybeTls<IO> {
    Plain(IO),
    Tls {
        stream: Box<tokio_rustls::TlsStream<IO>>,
        /// Where refused renegotiations are counted: the listener's, or the service's.
        counters: Option<Arc<HandshakeCounters>>,
    },
}

impl<IO> MaybeTls<IO> {
    /// A TLS stream whose refused renegotiations count in `counters`.
    pub fn counted(stream: tokio_rustls::TlsStream<IO>, counters: &Arc<HandshakeCounters>) -> Self {
        MaybeTls::Tls {
            stream: Box::new(stream),
            counters: Some(Arc::clone(counters)),
        }
    }

    /// The TCP (or other) stream under the TLS layer.
    pub fn get_ref(&self) -> &IO {
        match self {
            MaybeTls::Plain(io) => io,
            MaybeTls::Tls { stream, .. } => stream.get_ref().0,
        }
    }
}

impl<IO> MaybeTls<IO> {
    /// Of a TLS connection this side accepted: the server name the client asked for (SNI)
    /// and the application protocol negotiated (ALPN).
    pub fn accepted_names(&self) -> Option<(Option<&str>, Option<&[u8]>)> {
        match self {
            MaybeTls::Tls { stream, .. } => match &**stream {
                tokio_rustls::TlsStream::Server(s) => {
                    let c = s.get_ref().1;
                    Some((c.server_name(), c.alpn_protocol()))
                }
                tokio_rustls::TlsStream::Client(_) => None,
            },
            MaybeTls::Plain(_) => None,
        }
    }
}

impl<IO> From<tokio_rustls::server::TlsStream<IO>> for MaybeTls<IO> {
    fn from(s: tokio_rustls::server::TlsStream<IO>) -> Self {
        MaybeTls::Tls {
            stream: Box::new(tokio_rustls::TlsStream::Server(s)),
            counters: None,
        }
    }
}

impl<IO> From<tokio_rustls::client::TlsStream<IO>> for MaybeTls<IO> {
    fn from(s: tokio_rustls::client::TlsStream<IO>) -> Self {
        MaybeTls::Tls {
            stream: Box::new(tokio_rustls::TlsStream::Client(s)),
            counters: None,
        }
    }
}

/// A write that never waits: it takes what the socket takes now and never registers the
/// task for write readiness. A read half that wrote with `poll_write` would take over the
/// writer task's wake-up for the socket (one waker per direction), and that task could then
/// wait forever.
pub trait TryWrite {
    /// Write what the socket takes now; `WouldBlock` when it takes nothing.
    fn try_write(&self, buf: &[u8]) -> io::Result<usize>;
}

impl TryWrite for tokio::net::TcpStream {
    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        tokio::net::TcpStream::try_write(self, buf)
    }
}

/// [`TryWrite`] as the `io::Write` rustls writes its records into.
struct TryWriter<'a, IO>(&'a IO);

impl<IO: TryWrite> io::Write for TryWriter<'_, IO> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.try_write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Whether rustls has records of its own waiting to go out on `stream`.
fn has_pending<IO>(stream: &tokio_rustls::TlsStream<IO>) -> bool {
    stream.get_ref().1.wants_write()
}

/// What a read of a TLS stream left to do: send the records rustls queued while reading
/// ([`MaybeTls`]), as far as the socket takes them now (the rest goes with the next write),
/// and count a refused renegotiation. `was_pending`: records were waiting before the read.
fn answer_after_read<IO: TryWrite>(
    stream: &mut tokio_rustls::TlsStream<IO>,
    counters: Option<&HandshakeCounters>,
    was_pending: bool,
    read: &Poll<io::Result<()>>,
) {
    let queued = has_pending(stream);
    if let Some(c) = counters
        && is_renegotiation_refused(
            stream.get_ref().1.protocol_version(),
            queued && !was_pending,
            read,
        )
    {
        c.renegotiations_refused.fetch_add(1, Ordering::Relaxed);
    }
    if !queued {
        return;
    }
    let sent = match stream {
        tokio_rustls::TlsStream::Server(s) => {
            let (io, conn) = s.get_mut();
            write_pending(conn, io)
        }
        tokio_rustls::TlsStream::Client(s) => {
            let (io, conn) = s.get_mut();
            write_pending(conn, io)
        }
    };
    if let Err(e) = sent {
        tracing::trace!(error = %e, "TLS records queued by a read wait for the next write");
    }
}

/// Write the records `conn` has queued into `io` until it takes no more.
fn write_pending<D, IO: TryWrite>(
    conn: &mut rustls::ConnectionCommon<D>,
    io: &IO,
) -> io::Result<()> {
    while conn.wants_write() {
        if conn.write_tls(&mut TryWriter(io))? == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
    }
    Ok(())
}

/// Whether a read that ended in `read` refused a renegotiation. PURE. In TLS 1.2 after the
/// handshake, the one record rustls queues while reading is the `no_renegotiation` alert
/// (`queued_by_read`: nothing was waiting before the read, something is after it); a peer
/// that asks again gets a fatal alert and the read fails. Records that were already waiting
/// (a write the socket did not take) hide an alert queued behind them: not counted then.
pub fn is_renegotiation_refused(
    version: Option<rustls::ProtocolVersion>,
    queued_by_read: bool,
    read: &Poll<io::Result<()>>,
) -> bool {
    if version != Some(rustls::ProtocolVersion::TLSv1_2) {
        return false;
    }
    match read {
        Poll::Ready(Err(e)) => matches!(
            e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()),
            Some(rustls::Error::PeerMisbehaved(
                rustls::PeerMisbehaved::TooManyRenegotiationRequests
            ))
        ),
        _ => queued_by_read,
    }
}

impl<IO: AsyncRead + AsyncWrite + TryWrite + Unpin> AsyncRead for MaybeTls<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(io) => Pin::new(io).poll_read(cx, buf),
            MaybeTls::Tls { stream, counters } => {
                let was_pending = has_pending(stream);
                let read = Pin::new(stream.as_mut()).poll_read(cx, buf);
                answer_after_read(stream, counters.as_deref(), was_pending, &read);
                read
            }
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for MaybeTls<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(io) => Pin::new(io).poll_write(cx, buf),
            MaybeTls::Tls { stream, .. } => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(io) => Pin::new(io).poll_flush(cx),
            MaybeTls::Tls { stream, .. } => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    /// On TLS: close_notify, then the write side of the socket is shut down (a half-close
    /// passed on, as on a plain stream).
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(io) => Pin::new(io).poll_shutdown(cx),
            MaybeTls::Tls { stream, .. } => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fulcrum-tls-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    /// A self-signed certificate for `name` and its key, written as PEM into `dir`.
    fn self_signed(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let ck = rcgen::generate_simple_self_signed(vec![name.to_owned()]).expect("rcgen");
        let (cert, key) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&cert, ck.cert.pem()).expect("write cert");
        std::fs::write(&key, ck.key_pair.serialize_pem()).expect("write key");
        (cert, key)
    }

    #[test]
    fn a_matching_pair_builds_and_a_mismatched_key_is_reported_at_the_key() {
        let d = tmp("pair");
        let (cert, key) = self_signed(&d, "a.test");
        let (_, other_key) = self_signed(&d, "b.test");
        let files = |key| ServerFiles {
            cert: &cert,
            key,
            client_ca: None,
        };
        assert!(server_config(&files(&key)).is_ok());
        let p = server_config(&files(&other_key)).expect_err("mismatch");
        assert_eq!(p.field, Field::Key);
        assert!(matches!(p.error, TlsError::KeyMismatch { .. }), "{p}");
        // mTLS with the certificate as its own CA.
        let mtls = ServerFiles {
            client_ca: Some(&cert),
            ..files(&key)
        };
        assert!(server_config(&mtls).is_ok());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_reload_keeps_the_config_of_unchanged_files_and_replaces_it_when_one_changes() {
        let d = tmp("renewal");
        let (cert, key) = self_signed(&d, "a.test");
        let files = ServerFiles {
            cert: &cert,
            key: &key,
            client_ca: None,
        };
        let load = |files: &ServerFiles<'_>, handshake_timeout| {
            let (config, fingerprint) = server_config(files).expect("loads");
            ServerTls {
                config,
                handshake_timeout,
                fingerprint: Some(fingerprint),
            }
        };
        let t = DEFAULT_HANDSHAKE_TIMEOUT;
        let l = TlsListener::new(load(&files, t));
        let first = Arc::clone(&l.current().config);
        // The files read again, unchanged: the same configuration object stays.
        assert_eq!(l.store(load(&files, t)), Renewal::Unchanged);
        assert!(Arc::ptr_eq(&l.current().config, &first));
        // Only the handshake timeout: kept, with the new timeout.
        assert_eq!(l.store(load(&files, 2 * t)), Renewal::Timeout);
        assert!(Arc::ptr_eq(&l.current().config, &first));
        assert_eq!(l.current().handshake_timeout, 2 * t);
        // A certificate (and key) renewed in place under the same names: replaced.
        self_signed(&d, "a.test");
        assert_eq!(l.store(load(&files, 2 * t)), Renewal::Config);
        let second = Arc::clone(&l.current().config);
        assert!(!Arc::ptr_eq(&second, &first));
        // A client CA added, from a file already in use: a change too.
        let mtls = ServerFiles {
            client_ca: Some(&cert),
            ..files
        };
        assert_eq!(l.store(load(&mtls, 2 * t)), Renewal::Config);
        assert_eq!(l.store(load(&mtls, 2 * t)), Renewal::Unchanged);
        // Built from files nobody digested: never taken as unchanged.
        let unknown = ServerTls {
            fingerprint: None,
            ..load(&mtls, 2 * t)
        };
        assert_eq!(l.store(unknown), Renewal::Config);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn unusable_files_are_reported_at_their_field() {
        let d = tmp("bad");
        let (cert, key) = self_signed(&d, "a.test");
        let missing = d.join("missing.pem");
        let garbage = d.join("garbage.pem");
        std::fs::write(&garbage, "-----BEGIN CERTIFICATE-----\n!!!\n").expect("write");
        let empty = d.join("empty.pem");
        std::fs::write(&empty, "nothing here\n").expect("write");
        let cases: [(ServerFiles, Field, &str); 5] = [
            (
                ServerFiles {
                    cert: &missing,
                    key: &key,
                    client_ca: None,
                },
                Field::Cert,
                "cannot read",
            ),
            (
                ServerFiles {
                    cert: &cert,
                    key: &missing,
                    client_ca: None,
                },
                Field::Key,
                "cannot read",
            ),
            (
                ServerFiles {
                    cert: &garbage,
                    key: &key,
                    client_ca: None,
                },
                Field::Cert,
                "not PEM",
            ),
            (
                ServerFiles {
                    cert: &cert,
                    key: &empty,
                    client_ca: None,
                },
                Field::Key,
                "no private key",
            ),
            (
                ServerFiles {
                    cert: &cert,
                    key: &key,
                    client_ca: Some(&empty),
                },
                Field::ClientCa,
                "no certificate",
            ),
        ];
        for (files, field, says) in cases {
            let p = server_config(&files).expect_err("refused");
            assert_eq!(p.field, field, "{p}");
            assert!(p.to_string().contains(says), "{p}");
        }
        // The key file given as the certificate: it holds no certificate.
        let p = server_config(&ServerFiles {
            cert: &key,
            key: &key,
            client_ca: None,
        })
        .expect_err("refused");
        assert_eq!(p.field, Field::Cert);
        let c = client_config(&ClientFiles {
            ca: &missing,
            cert: None,
            key: None,
        })
        .expect_err("refused");
        assert_eq!(c.field, Field::Ca);
        assert!(
            client_config(&ClientFiles {
                ca: &cert,
                cert: None,
                key: None
            })
            .is_ok()
        );
        let c = client_config(&ClientFiles {
            ca: &cert,
            cert: Some(&cert),
            key: None,
        })
        .expect_err("refused");
        assert_eq!(c.field, Field::Cert);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn failures_are_sorted_into_reasons() {
        use rustls::{
            AlertDescription as A, CertificateError as C, Error as E, InvalidMessage as M,
        };
        let tls = |e: E| io::Error::new(io::ErrorKind::InvalidData, e);
        for (err, want) in [
            (
                tls(E::InvalidMessage(M::InvalidContentType)),
                Reason::NotTls,
            ),
            (
                tls(E::InvalidMessage(M::UnknownProtocolVersion)),
                Reason::NotTls,
            ),
            (tls(E::NoCertificatesPresented), Reason::NoCertificate),
            (
                tls(E::InvalidCertificate(C::UnknownIssuer)),
                Reason::UnknownCa,
            ),
            (tls(E::AlertReceived(A::UnknownCA)), Reason::UnknownCa),
            (
                tls(E::InvalidCertificate(C::Expired)),
                Reason::BadCertificate,
            ),
            (
                tls(E::AlertReceived(A::BadCertificate)),
                Reason::BadCertificate,
            ),
            (tls(E::AlertReceived(A::ProtocolVersion)), Reason::Protocol),
            (tls(E::DecryptError), Reason::Protocol),
            (io::ErrorKind::UnexpectedEof.into(), Reason::Closed),
            (io::ErrorKind::ConnectionReset.into(), Reason::Closed),
            (io::ErrorKind::PermissionDenied.into(), Reason::Io),
        ] {
            assert_eq!(Reason::of(&err), want, "{err}");
        }
        let names: Vec<&str> = Reason::ALL.iter().map(|r| r.name()).collect();
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(names.len(), unique.len(), "{names:?}");
    }

    #[test]
    fn a_record_a_tls12_read_queues_is_a_refused_renegotiation() {
        use rustls::ProtocolVersion::{TLSv1_2, TLSv1_3};
        let read = Poll::Ready(Ok(()));
        let tls12 = Some(TLSv1_2);
        assert!(is_renegotiation_refused(tls12, true, &read));
        assert!(
            is_renegotiation_refused(tls12, true, &Poll::Pending),
            "a ClientHello alone gives the reader no bytes"
        );
        assert!(!is_renegotiation_refused(tls12, false, &read));
        assert!(!is_renegotiation_refused(Some(TLSv1_3), true, &read));
        assert!(!is_renegotiation_refused(None, true, &read));
        let failed =
            |e: rustls::Error| Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, e)));
        let again =
            rustls::Error::PeerMisbehaved(rustls::PeerMisbehaved::TooManyRenegotiationRequests);
        assert!(is_renegotiation_refused(tls12, false, &failed(again)));
        assert!(!is_renegotiation_refused(
            tls12,
            true,
            &failed(rustls::Error::DecryptError)
        ));
    }

    #[test]
    fn counters_count_per_reason() {
        let c = HandshakeCounters::default();
        c.fail(Reason::NotTls);
        c.fail(Reason::NotTls);
        c.fail(Reason::Timeout);
        assert_eq!(c.failed(Reason::NotTls).load(Ordering::Relaxed), 2);
        assert_eq!(c.failed(Reason::Timeout).load(Ordering::Relaxed), 1);
        assert_eq!(c.failed(Reason::Io).load(Ordering::Relaxed), 0);
    }

    #[test]
    fn the_server_name_is_the_one_given_else_the_host() {
        let ip: std::net::IpAddr = "192.0.2.7".parse().expect("ip");
        assert_eq!(
            server_name(Some("svc.example.com"), ip),
            ServerName::try_from("svc.example.com").ok()
        );
        assert_eq!(server_name(None, ip), Some(ServerName::from(ip)));
        assert_eq!(server_name(Some("not a name!"), ip), None);
    }
}
