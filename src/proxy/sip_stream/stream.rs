//! The stream a SIP connection runs over, plain TCP or TLS over TCP, either side: split into
//! the read half its reader owns and the write half, and how a service link connects. IO.

use super::*;
use crate::tls::MaybeTls;

/// TCP keepalive on service connections (which have no idle timeout): a peer that vanished
/// is found within a few minutes.
pub(super) const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

/// A stream a sip-tcp connection runs over (TCP today; a TLS stream is the same to the link
/// and the reader): split into the read half its reader task owns and the write half.
pub(crate) trait SipStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    type Read: StreamRead;
    type Write: AsyncWrite + Unpin + Send + 'static;
    fn split(self) -> (Self::Read, Self::Write);
    fn local_addr(&self) -> std::io::Result<SocketAddr>;
    /// Options of a service connection (which has no idle timeout): TCP keepalive, so a peer
    /// that vanished is found within a few minutes, and no Nagle delay.
    fn prepare_link(&self) -> std::io::Result<()>;
}

/// A read half. A TCP one can wait for bytes without holding a buffer (an idle connection
/// holds none); a TLS one cannot (its records must be read to know whether they carry
/// bytes), so its read waits with the buffer.
pub(crate) trait StreamRead: AsyncRead + Unpin + Send + 'static {
    /// Whether [`StreamRead::readable`] waits for bytes; when false it resolves at once and
    /// the read itself waits.
    const WAITS_WITHOUT_BUFFER: bool;
    /// Resolves once a read may make progress.
    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + Send;
}

/// TLS over TCP, either side (accepted from a client, or opened to a service): the same
/// plain-or-TLS stream type the tcp / http relay uses. Plain SIP connections stay bare
/// [`TcpStream`]s, whose read half can wait for bytes without holding a buffer.
impl SipStream for MaybeTls<TcpStream> {
    type Read = tokio::io::ReadHalf<MaybeTls<TcpStream>>;
    type Write = tokio::io::WriteHalf<MaybeTls<TcpStream>>;

    fn split(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.get_ref().local_addr()
    }

    fn prepare_link(&self) -> std::io::Result<()> {
        self.get_ref().prepare_link()
    }
}

impl StreamRead for tokio::io::ReadHalf<MaybeTls<TcpStream>> {
    const WAITS_WITHOUT_BUFFER: bool = false;

    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + Send {
        std::future::ready(Ok(()))
    }
}

/// TLS toward a service (a sip-tls service): the TCP connect, then the handshake, both
/// within the link's connect deadline; a failed handshake is counted by its reason and
/// fails the connect. The handshake's own bound is that deadline, so that a handshake still
/// running then is counted as a `timeout` (the link's driver polls the connect before its
/// timer, [`drive_link`]).
pub(super) struct TlsLinkConnector(pub(super) Arc<crate::tls::TlsConnector>);

impl Connector for TlsLinkConnector {
    type Stream = MaybeTls<TcpStream>;

    fn connect(
        &self,
        addr: SocketAddr,
        deadline: std::time::Instant,
    ) -> impl Future<Output = std::io::Result<Self::Stream>> + Send {
        let tls = Arc::clone(&self.0);
        async move {
            let tcp = TcpStream::connect(addr).await?;
            tls.connect_by(tcp, tokio::time::Instant::from_std(deadline))
                .await
                .map_err(|r| std::io::Error::other(format!("TLS handshake failed: {}", r.name())))
        }
    }
}

impl SipStream for TcpStream {
    type Read = OwnedReadHalf;
    type Write = OwnedWriteHalf;

    fn split(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        self.into_split()
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        TcpStream::local_addr(self)
    }

    fn prepare_link(&self) -> std::io::Result<()> {
        let keepalive = socket2::SockRef::from(self).set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_IDLE),
        );
        let _ = self.set_nodelay(true);
        keepalive
    }
}

impl StreamRead for OwnedReadHalf {
    const WAITS_WITHOUT_BUFFER: bool = true;

    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + Send {
        OwnedReadHalf::readable(self)
    }
}

/// How a service link makes its connections.
pub(crate) trait Connector: Send + Sync + 'static {
    type Stream: SipStream;
    /// A connection to `addr`; the link gives up at `deadline` (its own timer).
    fn connect(
        &self,
        addr: SocketAddr,
        deadline: std::time::Instant,
    ) -> impl Future<Output = std::io::Result<Self::Stream>> + Send;
}

/// Plain TCP.
pub(super) struct TcpConnector;

impl Connector for TcpConnector {
    type Stream = TcpStream;

    fn connect(
        &self,
        addr: SocketAddr,
        _: std::time::Instant,
    ) -> impl Future<Output = std::io::Result<TcpStream>> + Send {
        TcpStream::connect(addr)
    }
}

/// Write `bytes` whole and flush them: a TLS stream keeps what the socket did not take in its
/// own buffer until the next write or a flush, and the next write may never come (on TCP the
/// flush costs nothing).
pub(super) async fn write_out<W: AsyncWrite + Unpin>(
    write: &mut W,
    bytes: &[u8],
) -> std::io::Result<()> {
    write.write_all(bytes).await?;
    write.flush().await
}
