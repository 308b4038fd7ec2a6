//! `fulcrum-load ws-sip`: SIP calls over WebSocket (bench/ws.sh). Each of `--sockets`
//! connections upgrades with the `sip` subprotocol (over TLS for a `wss://` target, any
//! certificate accepted: the bench runs on loopback with a throwaway one), REGISTERs once,
//! then places calls back to back for `--secs` seconds: INVITE, the final answer (1xx
//! skipped), ACK and BYE along the answer's Record-Route, the BYE's 200. Prints
//! `calls= registers= failed= cps=`.

use fulcrum::peer::{first_header as first, header_values as values};
use futures_util::{SinkExt, StreamExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;

#[derive(Debug)]
struct AnyCert;

impl rustls::client::danger::ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

#[derive(Default)]
struct Counts {
    calls: AtomicU64,
    registers: AtomicU64,
    failed: AtomicU64,
}

async fn connect(
    url: &str,
    tls: bool,
) -> Result<tokio_tungstenite::WebSocketStream<Box<dyn Io>>, String> {
    let mut req = url.into_client_request().map_err(|e| e.to_string())?;
    req.headers_mut()
        .insert("sec-websocket-protocol", HeaderValue::from_static("sip"));
    let host = req.uri().host().unwrap_or("127.0.0.1").to_owned();
    let port = req.uri().port_u16().unwrap_or(if tls { 443 } else { 80 });
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
        .await
        .map_err(|e| e.to_string())?;
    let _ = tcp.set_nodelay(true);
    let io: Box<dyn Io> = if tls {
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert))
        .with_no_client_auth();
        let name =
            rustls::pki_types::ServerName::try_from(host.clone()).map_err(|e| e.to_string())?;
        let s = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|e| e.to_string())?;
        Box::new(s)
    } else {
        Box::new(tcp)
    };
    let (ws, _) = tokio_tungstenite::client_async(req, io)
        .await
        .map_err(|e| e.to_string())?;
    Ok(ws)
}

/// One connection's work until `end`.
async fn phone(i: usize, url: String, tls: bool, end: Instant, counts: Arc<Counts>) {
    let Ok(mut ws) = connect(&url, tls).await else {
        counts.failed.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let host = format!("p{i}.invalid");
    let via = |branch: &str| format!("Via: SIP/2.0/WSS {host};branch=z9hG4bK{branch};rport\r\n");
    let wait_final = async |ws: &mut tokio_tungstenite::WebSocketStream<Box<dyn Io>>,
                            call_id: &str,
                            cseq: &str|
           -> Option<String> {
        loop {
            let m = tokio::time::timeout(Duration::from_secs(5), ws.next())
                .await
                .ok()??
                .ok()?;
            let text = match m {
                Message::Text(t) => t.to_string(),
                Message::Binary(b) => String::from_utf8_lossy(&b).into_owned(),
                _ => continue,
            };
            let code: u16 = text.get(8..11).and_then(|c| c.parse().ok()).unwrap_or(0);
            if text.starts_with("SIP/2.0 ")
                && code >= 200
                && first(&text, "Call-ID") == call_id
                && first(&text, "CSeq") == cseq
            {
                return Some(text);
            }
        }
    };
    let reg_id = format!("reg{}-{i}", std::process::id());
    let register = format!(
        "REGISTER sip:example.com SIP/2.0\r\n{}Max-Forwards: 70\r\nFrom: <sip:u{i}@example.com>;tag=r{i}\r\nTo: <sip:u{i}@example.com>\r\nCall-ID: {reg_id}\r\nCSeq: 1 REGISTER\r\nSupported: path\r\nContact: <sip:u{i}@{host};transport=ws>\r\nExpires: 600\r\nContent-Length: 0\r\n\r\n",
        via(&reg_id)
    );
    if ws.send(Message::text(register)).await.is_err() {
        counts.failed.fetch_add(1, Ordering::Relaxed);
        return;
    }
    match wait_final(&mut ws, &reg_id, "1 REGISTER").await {
        Some(a) if a.starts_with("SIP/2.0 200") => {
            counts.registers.fetch_add(1, Ordering::Relaxed);
        }
        _ => {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
    let mut n = 0u64;
    while Instant::now() < end {
        n += 1;
        // Unique across runs: a UAS keeps finished calls for a while.
        let call_id = format!("c{}-{i}-{n}", std::process::id());
        let invite = format!(
            "INVITE sip:uas@example.com SIP/2.0\r\n{}Max-Forwards: 70\r\nFrom: <sip:u{i}@example.com>;tag=f{i}-{n}\r\nTo: <sip:uas@example.com>\r\nCall-ID: {call_id}\r\nCSeq: 1 INVITE\r\nContact: <sip:u{i}@{host};transport=ws>\r\nContent-Length: 0\r\n\r\n",
            via(&format!("i{call_id}"))
        );
        if ws.send(Message::text(invite)).await.is_err() {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let answer = wait_final(&mut ws, &call_id, "1 INVITE").await;
        if std::env::var_os("FULCRUM_LOAD_DEBUG").is_some() && n == 1 {
            eprintln!("answer to INVITE: {answer:?}");
        }
        let Some(ok) = answer.filter(|a| a.starts_with("SIP/2.0 200")) else {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let target = first(&ok, "Contact");
        let target = target
            .split_once('<')
            .and_then(|(_, r)| r.split_once('>'))
            .map_or(target.clone(), |(u, _)| u.to_owned());
        let routes = values(&ok, "Record-Route")
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join(", ");
        let route = if routes.is_empty() {
            String::new()
        } else {
            format!("Route: {routes}\r\n")
        };
        let (from, to) = (first(&ok, "From"), first(&ok, "To"));
        let ack = format!(
            "ACK {target} SIP/2.0\r\n{}Max-Forwards: 70\r\n{route}From: {from}\r\nTo: {to}\r\nCall-ID: {call_id}\r\nCSeq: 1 ACK\r\nContent-Length: 0\r\n\r\n",
            via(&format!("a{call_id}"))
        );
        let bye = format!(
            "BYE {target} SIP/2.0\r\n{}Max-Forwards: 70\r\n{route}From: {from}\r\nTo: {to}\r\nCall-ID: {call_id}\r\nCSeq: 2 BYE\r\nContent-Length: 0\r\n\r\n",
            via(&format!("b{call_id}"))
        );
        if ws.send(Message::text(ack)).await.is_err() || ws.send(Message::text(bye)).await.is_err()
        {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match wait_final(&mut ws, &call_id, "2 BYE").await {
            Some(a) if a.starts_with("SIP/2.0 200") => {
                counts.calls.fetch_add(1, Ordering::Relaxed);
            }
            _ => {
                counts.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    let _ = ws.close(None).await;
}

/// Run `sockets` phones against `url` for `secs` seconds; print the counts.
pub fn run(url: &str, sockets: usize, secs: u64) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let tls = url.starts_with("wss://");
    let counts = Arc::new(Counts::default());
    let started = Instant::now();
    let end = started + Duration::from_secs(secs);
    rt.block_on(async {
        let tasks: Vec<_> = (0..sockets)
            .map(|i| tokio::spawn(phone(i, url.to_owned(), tls, end, Arc::clone(&counts))))
            .collect();
        for t in tasks {
            let _ = t.await;
        }
    });
    let took = started.elapsed().as_secs_f64();
    let calls = counts.calls.load(Ordering::Relaxed);
    println!(
        "calls={calls} registers={} failed={} cps={:.0}",
        counts.registers.load(Ordering::Relaxed),
        counts.failed.load(Ordering::Relaxed),
        calls as f64 / took
    );
    Ok(())
}
