//! A deliberately tiny HTTP/1.1 server for the daemon's read-only endpoints: `GET` only, one request
//! per connection (`Connection: close`), a bounded request head read under a timeout, a bounded number
//! of connections at once. Enough for Prometheus and `curl`; no framework, no new dependency.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Longest request head read (request line and headers).
pub const REQUEST_HEAD_BYTES_MAX: usize = 8 * 1024;
/// How long a client may take to send its request head, and to take the answer.
pub const REQUEST_TIMEOUT_MS: u64 = 5_000;
/// Connections served at once; more wait in the listen backlog.
pub const CONNECTIONS_MAX: usize = 32;

/// An answer: status code, content type, body.
#[derive(Clone, Debug, PartialEq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Response {
    pub fn ok(content_type: &'static str, body: String) -> Self {
        Response { status: 200, content_type, body }
    }

    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Response { status, content_type: "text/plain; charset=utf-8", body: body.into() }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        _ => "Service Unavailable",
    }
}

/// Binds `addr` now (so a taken port is an error at start, not later), for [`serve`].
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    TcpListener::from_std(listener)
}

/// Serves until the task is dropped or aborted: `handler(path)` answers each `GET`.
pub async fn serve<H, F>(listener: TcpListener, handler: H)
where
    H: Fn(String) -> F + Send + Sync + 'static,
    F: Future<Output = Response> + Send,
{
    let handler = Arc::new(handler);
    let permits = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!("metrics endpoint: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            let timeout = Duration::from_millis(REQUEST_TIMEOUT_MS);
            if tokio::time::timeout(timeout, answer(stream, &*handler)).await.is_err() {
                tracing::debug!(%peer, "metrics endpoint: client too slow; closed");
            }
            drop(permit);
        });
    }
}

async fn answer<H, F>(mut stream: TcpStream, handler: &H)
where
    H: Fn(String) -> F,
    F: Future<Output = Response>,
{
    let response = match read_head(&mut stream).await {
        Ok(head) => match parse_request_line(&head) {
            Ok(("GET", path)) => handler(path.to_owned()).await,
            Ok((_, _)) => Response::text(405, "only GET is served\n"),
            Err(why) => Response::text(400, format!("{why}\n")),
        },
        Err(response) => response,
    };
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        response.status,
        reason(response.status),
        response.content_type,
        response.body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(response.body.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// Reads up to the blank line ending the head, at most [`REQUEST_HEAD_BYTES_MAX`] bytes.
async fn read_head(stream: &mut TcpStream) -> Result<String, Response> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    loop {
        let n = stream.read(&mut buf).await.map_err(|_| Response::text(400, "read error\n"))?;
        if n == 0 {
            return Err(Response::text(400, "incomplete request\n"));
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            return String::from_utf8(head).map_err(|_| Response::text(400, "request head is not UTF-8\n"));
        }
        if head.len() > REQUEST_HEAD_BYTES_MAX {
            return Err(Response::text(431, "request head too large\n"));
        }
    }
}

/// `METHOD PATH HTTP/1.x` → (method, path without its query).
fn parse_request_line(head: &str) -> Result<(&str, &str), &'static str> {
    let line = head.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next()) else {
        return Err("malformed request line");
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Err("malformed request line");
    }
    Ok((method, target.split('?').next().unwrap_or(target)))
}

/// A `GET` of `http://addr/path` with a bounded wait: status and body (tests, `troupe` itself).
pub async fn get(addr: SocketAddr, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    let fetch = async {
        let mut stream = TcpStream::connect(addr).await?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        let text = String::from_utf8(raw).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        Ok((status, body.to_owned()))
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
    use super::*;

    #[test]
    fn request_lines() {
        assert_eq!(parse_request_line("GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n"), Ok(("GET", "/metrics")));
        assert!(parse_request_line("GET metrics HTTP/1.1").is_err());
        assert!(parse_request_line("garbage").is_err());
    }

    #[tokio::test]
    async fn serves_get_and_refuses_the_rest() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(listener, |path: String| async move {
            match path.as_str() {
                "/hello" => Response::ok("text/plain", "hi".into()),
                _ => Response::text(404, "no"),
            }
        }));
        let timeout = Duration::from_secs(5);
        assert_eq!(get(addr, "/hello", timeout).await.unwrap(), (200, "hi".into()));
        assert_eq!(get(addr, "/other", timeout).await.unwrap().0, 404);
        let mut raw = TcpStream::connect(addr).await.unwrap();
        raw.write_all(b"POST /hello HTTP/1.1\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        raw.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
        let mut huge = TcpStream::connect(addr).await.unwrap();
        let _ = huge.write_all(&vec![b'a'; REQUEST_HEAD_BYTES_MAX + 2048]).await;
        let mut answer = String::new();
        let _ = huge.read_to_string(&mut answer).await;
        assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
        server.abort();
    }
}
