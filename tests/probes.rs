//! Each probe kind against a live and a dead loopback endpoint.

mod common;

use fulcrum::config::{MonitorKind, Protocol};
use fulcrum::health::probe::{ProbeError, probe};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};

const T: Duration = Duration::from_secs(2);

/// A loopback port with nothing listening, reserved for the test binary's lifetime.
async fn dead_port() -> SocketAddr {
    common::closed_port("127.0.0.1")
}

#[tokio::test]
async fn tcp_connect() {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let r = probe(&MonitorKind::TcpConnect, addr, Protocol::Tcp, T).await;
    assert!(r.is_ok(), "{r:?}");
    let dead = dead_port().await;
    assert!(
        probe(&MonitorKind::TcpConnect, dead, Protocol::Tcp, T)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn udp_send_expect() {
    let echo = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    let addr = echo.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut buf = [0u8; 64];
        while let Ok((n, from)) = echo.recv_from(&mut buf).await {
            let reply = if &buf[..n] == b"ping" {
                &b"pong!"[..]
            } else {
                &b"?"[..]
            };
            let _ = echo.send_to(reply, from).await;
        }
    });
    let kind = |send: &[u8], expect: &[u8]| MonitorKind::Udp {
        send: send.to_vec(),
        expect: Some(expect.to_vec()),
    };
    assert!(
        probe(&kind(b"ping", b"pong"), addr, Protocol::Udp, T)
            .await
            .is_ok()
    );
    assert!(matches!(
        probe(&kind(b"other", b"pong"), addr, Protocol::Udp, T).await,
        Err(ProbeError::Mismatch)
    ));
    // A dead port that stays reserved: the socket holds it (so nothing else can be given it)
    // but, connected to another peer, receives nothing from the probe, which then fails as
    // on a closed port.
    let dead = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    dead.connect("127.0.0.1:9").await.expect("connect");
    let dead_addr = dead.local_addr().expect("addr");
    assert!(
        probe(&kind(b"ping", b"pong"), dead_addr, Protocol::Udp, T)
            .await
            .is_err()
    );
}

async fn http_server(status: &'static str, body: &'static str) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            let mut buf = [0u8; 1024];
            let _ = c.read(&mut buf).await;
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = c.write_all(resp.as_bytes()).await;
        }
    });
    addr
}

#[tokio::test]
async fn http_status_and_load() {
    let kind = MonitorKind::Http {
        path: "/health".into(),
        expect_codes: vec![],
    };
    let ok = http_server("200 OK", "42\n").await;
    let r = probe(&kind, ok, Protocol::Http, T).await.expect("alive");
    assert_eq!((r.status, r.load), (Some(200), Some(42)));
    let bad = http_server("503 Busy", "").await;
    assert!(matches!(
        probe(&kind, bad, Protocol::Http, T).await,
        Err(ProbeError::UnexpectedStatus(503))
    ));
}

#[tokio::test]
async fn sip_options_udp_and_tcp() {
    let uas = fulcrum::peer::Uas::start("127.0.0.1:0".parse().expect("addr")).expect("uas");
    let any = MonitorKind::SipOptions {
        expect_codes: vec![],
    };
    let r = probe(&any, uas.addr, Protocol::SipUdp, T)
        .await
        .expect("alive");
    assert_eq!(r.status, Some(200));
    let only_404 = MonitorKind::SipOptions {
        expect_codes: vec![404],
    };
    assert!(matches!(
        probe(&only_404, uas.addr, Protocol::SipUdp, T).await,
        Err(ProbeError::UnexpectedStatus(200))
    ));

    // SIP over TCP: a tiny responder that echoes the Call-ID in a 200 with a load header.
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            let mut buf = vec![0u8; 4096];
            let n = c.read(&mut buf).await.unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]).into_owned();
            let call_id = req
                .lines()
                .find_map(|l| l.strip_prefix("Call-ID: "))
                .unwrap_or("")
                .to_owned();
            let resp = format!(
                "SIP/2.0 100 Trying\r\nCall-ID: {call_id}\r\nCSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n\
                 SIP/2.0 200 OK\r\nCall-ID: {call_id}\r\nCSeq: 1 OPTIONS\r\nX-Load: 7\r\nContent-Length: 0\r\n\r\n"
            );
            let _ = c.write_all(resp.as_bytes()).await;
        }
    });
    let r = probe(&any, addr, Protocol::SipTcp, T)
        .await
        .expect("alive over tcp");
    assert_eq!((r.status, r.load), (Some(200), Some(7)));
    let dead = dead_port().await;
    assert!(probe(&any, dead, Protocol::SipTcp, T).await.is_err());
}

/// An `http` monitor of a service with `tls` asks over TLS, with the service's CA and name
/// (a plain GET to a TLS port is refused, and the service would stay DOWN for ever).
#[tokio::test]
async fn http_over_tls_with_the_services_tls() {
    let f = common::ConfigFile::new("probe-https", "");
    let ca = common::tls::Ca::new("fulcrum probe test CA");
    let ca_path = ca.write(&f, "ca.crt");
    let cert = ca.issue(&f, "svc", "svc.test", "svc");
    let acceptor = tokio_rustls::TlsAcceptor::from(common::tls::server_config(&cert));
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((c, _)) = l.accept().await {
            let Ok(mut s) = acceptor.accept(c).await else {
                continue;
            };
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\n42\n")
                .await;
            let _ = s.shutdown().await;
        }
    });
    let config = fulcrum::tls::client_config(&fulcrum::tls::ClientFiles {
        ca: &ca_path,
        cert: None,
        key: None,
    })
    .expect("client config");
    let tls = fulcrum::tls::ClientTls {
        config,
        server_name: fulcrum::tls::server_name(Some("svc.test"), addr.ip()).expect("name"),
    };
    let kind = MonitorKind::Http {
        path: "/health".into(),
        expect_codes: vec![],
    };
    let r = fulcrum::health::probe::probe_tls(&kind, addr, Protocol::Http, Some(&tls), T)
        .await
        .expect("alive over TLS");
    assert_eq!((r.status, r.load), (Some(200), Some(42)));
}
