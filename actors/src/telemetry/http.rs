//! The daemon's HTTP server: an axum [`Router`] served on hyper's HTTP/1.1 connections, each accepted
//! here so that the limits hold for every client — a bounded request head (larger: `431`), a bounded time
//! to send it (a slow-loris client is disconnected), a bounded number of connections at once (more wait in
//! the listen backlog), a bounded life per connection (a dashboard's event stream too: browsers reconnect
//! on their own). Optionally TLS with the cluster's certificates, and a client certificate required.
//! Malformed requests get hyper's `400`; every refusal is logged, and none of it touches training.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

/// Longest request head read (request line and headers); hyper's smallest buffer.
pub const REQUEST_HEAD_BYTES_MAX: usize = 8 * 1024;
/// How long a client may take to send a request head (and to start the next one on a kept-alive
/// connection), and to finish a TLS handshake.
pub const REQUEST_HEAD_TIMEOUT_MS: u64 = 5_000;
/// Connections served at once; more wait in the listen backlog.
pub const CONNECTIONS_MAX: usize = 64;
/// The longest a connection stays open, however busy (an event stream ends then; the page reconnects).
pub const CONNECTION_SECONDS_MAX: u64 = 600;

/// The TLS settings of an https endpoint: ring (the cluster's provider), TLS 1.2 or 1.3, `identity`'s
/// certificate, HTTP/1.1 by ALPN; with `client_auth`, a client certificate chaining to the cluster CA is
/// required (a client without one fails the handshake, which is logged).
pub fn server_tls(
    identity: &troupe_cluster::NodeIdentity,
    client_auth: bool,
) -> Result<Arc<rustls::ServerConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = if client_auth {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(identity.ca.clone()).map_err(|e| format!("the cluster CA: {e}"))?;
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| e.to_string())?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let mut config = builder
        .with_single_cert(vec![identity.cert.clone()], identity.key.clone_key())
        .map_err(|e| format!("node {}'s certificate: {e}", identity.name))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The URL of a dashboard served on `at` as the daemon announces it to the cluster (`troupe status`,
/// `troupe dashboard`): `at` itself, or — listening on every interface (0.0.0.0 or ::) — at the IP of
/// the daemon's control address `control` when that names one.
pub fn dashboard_url(https: bool, at: SocketAddr, control: SocketAddr) -> String {
    let scheme = if https { "https" } else { "http" };
    let host = if at.ip().is_unspecified() && !control.ip().is_unspecified() { control.ip() } else { at.ip() };
    format!("{scheme}://{}/", SocketAddr::new(host, at.port()))
}

/// Binds `addr` now (so a taken port is an error at start, not later), for [`serve`].
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    TcpListener::from_std(listener)
}

/// Serves `app` on `listener` until the task is dropped or aborted; over TLS with `tls`.
pub async fn serve(listener: TcpListener, app: Router, tls: Option<Arc<rustls::ServerConfig>>) {
    let permits = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let acceptor = tls.map(TlsAcceptor::from);
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!("HTTP endpoint: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (app, acceptor) = (app.clone(), acceptor.clone());
        tokio::spawn(async move {
            let served = async {
                let Some(acceptor) = acceptor else { return connection(stream, app, peer).await };
                let handshake = Duration::from_millis(REQUEST_HEAD_TIMEOUT_MS);
                match tokio::time::timeout(handshake, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => connection(tls, app, peer).await,
                    Ok(Err(e)) => tracing::warn!(%peer, "HTTP endpoint: TLS handshake refused: {e}"),
                    Err(_) => tracing::warn!(%peer, "HTTP endpoint: TLS handshake not done in {handshake:?}; closed"),
                }
            };
            let life = Duration::from_secs(CONNECTION_SECONDS_MAX);
            if tokio::time::timeout(life, served).await.is_err() {
                tracing::debug!(%peer, "HTTP endpoint: connection open for {life:?}; closed");
            }
            drop(permit);
        });
    }
}

/// One HTTP/1.1 connection, requests kept alive until the head timeout finds it idle.
async fn connection<I>(io: I, app: Router, peer: SocketAddr)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(REQUEST_HEAD_TIMEOUT_MS))
        .max_buf_size(REQUEST_HEAD_BYTES_MAX)
        .serve_connection(TokioIo::new(io), TowerToHyperService::new(app))
        .await;
    match served {
        // A malformed or oversized head (answered 400 or 431 by hyper), or a head too slow to come.
        Err(e) if e.is_parse() || e.is_parse_too_large() || e.is_timeout() => {
            tracing::warn!(%peer, "HTTP endpoint: request refused: {e}");
        }
        // A client that went away (a closed dashboard tab ends its event stream this way).
        Err(e) => tracing::debug!(%peer, "HTTP endpoint: connection dropped: {e}"),
        Ok(()) => {}
    }
}

/// A `GET` of `http://addr/path` with a bounded wait: status and body (tests, `troupe` itself).
pub async fn get(addr: SocketAddr, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    let io_error = |e: hyper::Error| std::io::Error::other(format!("GET http://{addr}{path}: {e}"));
    let fetch = async {
        let stream = TcpStream::connect(addr).await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(io_error)?;
        let driver = tokio::spawn(connection);
        let request = hyper::Request::get(path)
            .header(hyper::header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())
            .map_err(std::io::Error::other)?;
        let response = sender.send_request(request).await.map_err(io_error)?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.map_err(io_error)?.to_bytes();
        driver.abort();
        let text =
            String::from_utf8(body.to_vec()).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        Ok((status, text))
    };
    tokio::time::timeout(timeout, fetch).await.map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("GET http://{addr}{path}: no answer within {timeout:?}"),
        )
    })?
}

#[cfg(test)]
mod tests {
    use axum::routing::get as route;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn answer(addr: SocketAddr, request: &[u8]) -> String {
        let mut raw = TcpStream::connect(addr).await.unwrap();
        let _ = raw.write_all(request).await;
        let mut answer = Vec::new();
        let _ = raw.read_to_end(&mut answer).await;
        String::from_utf8_lossy(&answer).into_owned()
    }

    #[test]
    fn a_dashboard_on_every_interface_is_announced_at_the_control_address() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(dashboard_url(false, at("127.0.0.1:9400"), at("10.0.0.2:7000")), "http://127.0.0.1:9400/");
        assert_eq!(dashboard_url(true, at("0.0.0.0:9400"), at("10.0.0.2:7000")), "https://10.0.0.2:9400/");
        assert_eq!(dashboard_url(false, at("0.0.0.0:9400"), at("0.0.0.0:7000")), "http://0.0.0.0:9400/");
        assert_eq!(dashboard_url(false, at("[::]:9400"), at("[fd00::2]:7000")), "http://[fd00::2]:9400/");
    }

    #[tokio::test]
    async fn serves_get_and_refuses_the_rest_with_the_right_status() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/hello", route(|| async { "hi" }));
        let server = tokio::spawn(serve(listener, app, None));
        let timeout = Duration::from_secs(5);
        assert_eq!(get(addr, "/hello", timeout).await.unwrap(), (200, "hi".into()));
        assert_eq!(get(addr, "/hello?x=1", timeout).await.unwrap(), (200, "hi".into()));
        assert_eq!(get(addr, "/other", timeout).await.unwrap().0, 404);
        let post =
            answer(addr, b"POST /hello HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").await;
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        let huge = answer(
            addr,
            &[b"GET /hello HTTP/1.1\r\nX: ".as_slice(), &vec![b'a'; REQUEST_HEAD_BYTES_MAX + 2048]].concat(),
        )
        .await;
        assert!(huge.starts_with("HTTP/1.1 431"), "{huge}");
        let malformed = answer(addr, b"GARBAGE\x01 / HTTP/1.1\r\n\r\n").await;
        assert!(malformed.starts_with("HTTP/1.1 400"), "{malformed}");
        // Still serving after all that.
        assert_eq!(get(addr, "/hello", timeout).await.unwrap(), (200, "hi".into()));
        server.abort();
    }
}
