//! A minimal HTTP/1.1 client with keep-alive, for tests and benchmarks of the front door
//! (the workspace carries no general HTTP client). It speaks exactly what the front door
//! answers: responses with a `Content-Length`.

use std::io;
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One keep-alive connection.
pub struct HttpClient {
    stream: TcpStream,
    buf: Vec<u8>,
    host: String,
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

impl HttpClient {
    /// Connect to `addr`.
    pub async fn connect(addr: SocketAddr) -> io::Result<HttpClient> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(HttpClient {
            stream,
            buf: Vec::with_capacity(4096),
            host: addr.to_string(),
        })
    }

    /// `POST path` with a JSON body; the status and the body of the answer.
    pub async fn post(&mut self, path: &str, body: &[u8]) -> io::Result<(u16, Vec<u8>)> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.host,
            body.len()
        );
        let mut req = head.into_bytes();
        req.extend_from_slice(body);
        self.stream.write_all(&req).await?;
        self.read_response().await
    }

    /// `GET path`.
    pub async fn get(&mut self, path: &str) -> io::Result<(u16, Vec<u8>)> {
        let req = format!("GET {path} HTTP/1.1\r\nHost: {}\r\n\r\n", self.host);
        self.stream.write_all(req.as_bytes()).await?;
        self.read_response().await
    }

    /// Send raw bytes (a test of malformed requests) and read one response.
    pub async fn raw(&mut self, bytes: &[u8]) -> io::Result<(u16, Vec<u8>)> {
        self.stream.write_all(bytes).await?;
        self.read_response().await
    }

    async fn fill(&mut self) -> io::Result<()> {
        let mut chunk = [0u8; 8192];
        let n = self.stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed",
            ));
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    async fn read_response(&mut self) -> io::Result<(u16, Vec<u8>)> {
        let head_end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            if self.buf.len() > 64 << 10 {
                return Err(bad("response head too long"));
            }
            self.fill().await?;
        };
        let head = std::str::from_utf8(&self.buf[..head_end]).map_err(|_| bad("non-UTF-8 head"))?;
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| bad("bad status line"))?;
        let mut len = 0usize;
        for l in lines {
            if let Some((k, v)) = l.split_once(':') {
                if k.trim().eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().map_err(|_| bad("bad content-length"))?;
                }
                if k.trim().eq_ignore_ascii_case("transfer-encoding") {
                    return Err(bad("chunked responses are not supported"));
                }
            }
        }
        while self.buf.len() < head_end + len {
            self.fill().await?;
        }
        let body = self.buf[head_end..head_end + len].to_vec();
        self.buf.drain(..head_end + len);
        Ok((status, body))
    }
}
