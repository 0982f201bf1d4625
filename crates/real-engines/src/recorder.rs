//! A TCP proxy that records what an engine sends, so a test can compare the bytes a client got
//! through kvgate with the bytes the engine put on the wire for that very request.
//!
//! Two requests never produce the same stream (ids and timestamps differ), so the only honest
//! byte-for-byte check records the one response on its way through. Each proxied connection keeps
//! both directions; [`Recorder::exchanges`] splits them into HTTP/1.1 requests and responses
//! (health checks and load polls share the connection pool with inference requests).

use std::sync::Arc;

use anyhow::{bail, Context};
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

/// One connection's bytes, each direction in order.
#[derive(Debug, Default, Clone)]
struct Conversation {
    to_engine: Vec<u8>,
    from_engine: Vec<u8>,
}

/// A request and the engine's response to it.
#[derive(Debug, Clone)]
pub struct Exchange {
    /// Request method and path, e.g. `POST /v1/chat/completions`.
    pub request_line: String,
    /// The response status.
    pub status: u16,
    /// The response body as the engine sent it, with any chunked transfer coding removed.
    pub body: Bytes,
}

/// The recording proxy.
pub struct Recorder {
    /// Where clients connect (give this URL to kvgate as the worker).
    pub url: String,
    conversations: Arc<Mutex<Vec<Arc<Mutex<Conversation>>>>>,
    task: tokio::task::JoinHandle<()>,
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    log: Arc<Mutex<Conversation>>,
    to_engine: bool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        {
            let mut c = log.lock().await;
            let side = if to_engine { &mut c.to_engine } else { &mut c.from_engine };
            side.extend_from_slice(&buf[..n]);
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

impl Recorder {
    /// Starts a proxy on a free loopback port in front of `upstream` (`host:port`).
    pub async fn start(upstream: String) -> anyhow::Result<Recorder> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let conversations: Arc<Mutex<Vec<Arc<Mutex<Conversation>>>>> = Arc::default();
        let all = conversations.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(engine) = TcpStream::connect(&upstream).await else { continue };
                let log = Arc::new(Mutex::new(Conversation::default()));
                all.lock().await.push(log.clone());
                let (cr, cw) = client.into_split();
                let (er, ew) = engine.into_split();
                tokio::spawn(pump(cr, ew, log.clone(), true));
                tokio::spawn(pump(er, cw, log, false));
            }
        });
        Ok(Recorder { url, conversations, task })
    }

    /// Every complete request/response pair recorded so far.
    pub async fn exchanges(&self) -> anyhow::Result<Vec<Exchange>> {
        let mut out = Vec::new();
        for c in self.conversations.lock().await.iter() {
            let c = c.lock().await.clone();
            let requests = request_lines(&c.to_engine)?;
            let responses = responses(&c.from_engine)?;
            for (request_line, (status, body)) in requests.into_iter().zip(responses) {
                out.push(Exchange { request_line, status, body });
            }
        }
        Ok(out)
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn header_len(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4)
}

fn content_length(headers: &[httparse::Header<'_>]) -> Option<usize> {
    headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse().ok())
}

fn is_chunked(headers: &[httparse::Header<'_>]) -> bool {
    headers.iter().any(|h| {
        h.name.eq_ignore_ascii_case("transfer-encoding")
            && std::str::from_utf8(h.value).is_ok_and(|v| v.to_ascii_lowercase().contains("chunked"))
    })
}

/// The request lines of the requests in `buf`, in order.
fn request_lines(mut buf: &[u8]) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    while let Some(end) = header_len(buf) {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        req.parse(&buf[..end]).context("unparsable request")?;
        let line = format!("{} {}", req.method.unwrap_or(""), req.path.unwrap_or(""));
        let body = if is_chunked(req.headers) {
            let (_, used) = dechunk(&buf[end..])?;
            used
        } else {
            content_length(req.headers).unwrap_or(0)
        };
        out.push(line);
        buf = buf.get(end + body..).unwrap_or_default();
    }
    Ok(out)
}

/// The complete responses in `buf`: status and de-chunked body.
fn responses(mut buf: &[u8]) -> anyhow::Result<Vec<(u16, Bytes)>> {
    let mut out = Vec::new();
    while let Some(end) = header_len(buf) {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut headers);
        resp.parse(&buf[..end]).context("unparsable response")?;
        let status = resp.code.unwrap_or(0);
        let rest = &buf[end..];
        let (body, used) = if is_chunked(resp.headers) {
            match dechunk(rest) {
                Ok(done) => done,
                Err(_) => break, // still streaming
            }
        } else {
            let n = content_length(resp.headers).unwrap_or(rest.len());
            if rest.len() < n {
                break;
            }
            (rest[..n].to_vec(), n)
        };
        out.push((status, Bytes::from(body)));
        buf = &rest[used..];
    }
    Ok(out)
}

/// Removes chunked transfer coding: the body and the bytes it took on the wire.
fn dechunk(buf: &[u8]) -> anyhow::Result<(Vec<u8>, usize)> {
    let mut body = Vec::new();
    let mut at = 0;
    loop {
        let line_end = buf[at..].windows(2).position(|w| w == b"\r\n").context("incomplete chunk size")? + at;
        let size_text = std::str::from_utf8(&buf[at..line_end])?.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).with_context(|| format!("bad chunk size {size_text:?}"))?;
        at = line_end + 2;
        if size == 0 {
            // Trailers (none expected) end with an empty line.
            let end = buf[at..].windows(2).position(|w| w == b"\r\n").context("incomplete last chunk")? + at + 2;
            return Ok((body, end));
        }
        if buf.len() < at + size + 2 {
            bail!("incomplete chunk");
        }
        body.extend_from_slice(&buf[at..at + size]);
        at += size + 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_and_sized_responses_split_and_decode() {
        let wire = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n";
        let r = responses(wire).unwrap();
        assert_eq!(r.len(), 2, "the third is still streaming");
        assert_eq!(r[0].1, Bytes::from_static(b"ok"));
        assert_eq!(r[1].1, Bytes::from_static(b"hello world"));
        let reqs =
            b"GET /health HTTP/1.1\r\nhost: x\r\n\r\nPOST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(request_lines(reqs).unwrap(), vec!["GET /health", "POST /v1/chat/completions"]);
    }
}
